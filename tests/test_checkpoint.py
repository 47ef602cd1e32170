"""Tests of jaxops.parallel.checkpoint: format, resharding restore, atomicity, manager, HF I/O."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxops.models import LLAMA_NAME_MAP
from jaxops.parallel import checkpoint as ckpt
from jaxops.parallel.checkpoint import _index as ckpt_index
from jaxops.parallel.checkpoint import _io as ckpt_io

from jaxops.testing import run_processes, spawn_processes

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

DTYPES = {
    "f32": np.float32,
    "bf16": ml_dtypes.bfloat16,
    "f16": np.float16,
    "f64": np.float64,
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "i8": np.int8,
    "i32": np.int32,
    "i64": np.int64,
    "u8": np.uint8,
    "bool": np.bool_,
}
SHAPES = {
    "scalar": (),
    "empty": (0,),
    "empty2d": (0, 8),
    "one": (1,),
    "odd": (7,),
    "odd3d": (5, 3, 2),
    "8x24": (8, 24),
    "16x8x4": (16, 8, 4),
}


def _values(shape, dtype, seed=0):
    """Distinct, exactly representable values of `dtype` (raw bits for floats)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype)
    # Floats: uniform values, cast (NaN-free, so comparisons are exact).
    return rng.uniform(-8, 8, shape).astype(dtype)


def _bits(a):
    a = np.asarray(a)
    return a.reshape(-1).view(np.uint8).tobytes() if a.size else b""


def _mesh(shape=(2, 4), names=("a", "b")):
    return jax.make_mesh(shape, names)


def _spec_for(shape, mesh):
    """A spec sharding the first dims that the mesh axes divide, else replicated."""
    entries = []
    axes = list(mesh.axis_names)
    for n in shape:
        if axes and n > 0 and n % mesh.shape[axes[0]] == 0:
            entries.append(axes.pop(0))
        else:
            entries.append(None)
    return P(*entries)


def _put(a, mesh, spec=None):
    spec = _spec_for(a.shape, mesh) if spec is None else spec
    return jax.device_put(a, NamedSharding(mesh, spec))


def _like(a, sharding):
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)


# -------------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_round_trip_bit_exact(tmp_path, dtype, shape):
    host = _values(shape, dtype)
    mesh = _mesh()
    x = _put(host, mesh)
    ckpt.save(tmp_path / "c", {"x": x, "host": host}, step=3)
    other = _mesh((4, 2))
    sharding = NamedSharding(other, _spec_for(shape, other))
    out = ckpt.restore(tmp_path / "c", {"x": _like(x, sharding), "host": host})
    assert out["x"].dtype == x.dtype and out["x"].shape == shape
    assert out["x"].sharding == sharding
    assert _bits(out["x"]) == _bits(host.astype(x.dtype))  # float64 is float32 without x64
    assert isinstance(out["host"], np.ndarray) and _bits(out["host"]) == _bits(host)
    info = ckpt.describe(tmp_path / "c")
    assert info["step"] == 3 and info["arrays"]["host"] == {
        "shape": shape,
        "dtype": np.dtype(dtype).name,
    }


def test_python_scalars_and_nested_containers(tmp_path):
    tree = {"opt": [np.int32(4), (jnp.ones(3), 2.5)], "flag": True, "count": 7}
    ckpt.save(tmp_path / "c", tree)
    out = ckpt.restore(tmp_path / "c")  # no target: nested dicts of numpy arrays
    assert out["opt"]["0"] == 4 and out["opt"]["1"]["1"] == 2.5
    assert out["flag"].dtype == np.bool_ and out["count"] == 7
    np.testing.assert_array_equal(out["opt"]["1"]["0"], np.ones(3, np.float32))


RESHARD_CASES = {
    "2x4->4x2": ((2, 4), P("a", "b"), (4, 2), P("a", "b")),
    "rows->cols": ((2, 4), P("a", None), (4, 2), P(None, ("a", "b"))),
    "sharded->replicated": ((2, 4), P("b", "a"), (2, 4), P()),
    "replicated->sharded": ((2, 4), P(), (2, 4), P(("a", "b"), None)),
    "8->1device": ((8, 1), P("a", None), None, None),
    "cols->rows": ((1, 8), P(None, "b"), (8, 1), P("a", None)),
}


@pytest.mark.parametrize("case", list(RESHARD_CASES.values()), ids=list(RESHARD_CASES))
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_restore_resharded(tmp_path, case, dtype):
    src_shape, src_spec, dst_shape, dst_spec = case
    host = _values((16, 24), dtype, seed=1)
    x = _put(host, _mesh(src_shape), src_spec)
    ckpt.save(tmp_path / "c", {"w": x})
    if dst_shape is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    else:
        sharding = NamedSharding(_mesh(dst_shape), dst_spec)
    out = ckpt.restore(tmp_path / "c", {"w": _like(x, sharding)})["w"]
    assert out.sharding == sharding
    assert _bits(out) == _bits(host)
    for shard in out.addressable_shards:  # every device got exactly its block
        assert _bits(shard.data) == _bits(host[shard.index])


def test_restore_target_may_be_arrays(tmp_path):
    x = _put(np.arange(32.0, dtype=np.float32).reshape(8, 4), _mesh())
    ckpt.save(tmp_path / "c", {"w": x})
    like = jax.device_put(jnp.zeros((8, 4)), NamedSharding(_mesh((4, 2)), P(None, "b")))
    out = ckpt.restore(tmp_path / "c", {"w": like})["w"]
    assert out.sharding == like.sharding and np.array_equal(out, x)


def test_partial_restore_of_a_subtree(tmp_path):
    tree = {"params": {"w": jnp.arange(6.0), "b": jnp.ones(2)}, "opt": {"mu": jnp.zeros(6)}}
    ckpt.save(tmp_path / "c", tree)
    target = {"w": jax.ShapeDtypeStruct((6,), jnp.float32)}
    out = ckpt.restore(tmp_path / "c", target, subtree="params")
    assert out["w"].tolist() == list(range(6))
    host = ckpt.restore(tmp_path / "c", subtree="opt")
    assert list(host) == ["mu"]


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 6),
    depth=st.integers(1, 3),
    src=st.sampled_from([P("a", "b"), P("b", None), P(None, "a"), P(), P(("a", "b"), None)]),
    dst=st.sampled_from([P("a", "b"), P(None, "b"), P("b", "a"), P(), P(None, ("b", "a"))]),
    chunk=st.sampled_from([8, 24, 64, 1 << 20]),
)
def test_fuzz_resharding_and_chunks(tmp_path_factory, rows, cols, depth, src, dst, chunk):
    # Sizes divisible by 8 on both sharded dims; small checksum chunks exercise chunk rounding.
    shape = (rows * 8, cols * 8, depth)
    host = _values(shape, np.float32, seed=rows * 100 + cols * 10 + depth)
    d = tmp_path_factory.mktemp("fuzz")
    old = ckpt_index.CHUNK_BYTES
    ckpt_index.CHUNK_BYTES = chunk
    try:
        ckpt.save(d / "c", {"x": _put(host, _mesh((2, 4)), src)})
    finally:
        ckpt_index.CHUNK_BYTES = old
    sharding = NamedSharding(_mesh((4, 2)), dst)
    out = ckpt.restore(d / "c", {"x": _like(host, sharding)})["x"]
    assert _bits(out) == _bits(host)


def _count_reads(monkeypatch):
    counter = {"bytes": 0}
    real = os.preadv

    def preadv(fd, buffers, offset):
        n = real(fd, buffers, offset)
        counter["bytes"] += n
        return n

    monkeypatch.setattr(os, "preadv", preadv)
    return counter


def test_restore_reads_only_overlapping_ranges(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_index, "CHUNK_BYTES", 4096)
    host = _values((64, 1024), np.float32)  # 256 KiB, rows of 4 KiB, stored as 8 row blocks
    ckpt.save(tmp_path / "c", {"w": _put(host, _mesh(), P(("a", "b"), None))})
    counter = _count_reads(monkeypatch)
    # One device's target: rows 8..16 only -> exactly those 32 KiB are read.
    sub = jax.ShapeDtypeStruct((64, 1024), jnp.float32, sharding=NamedSharding(_mesh(), P("b")))
    out = ckpt.restore(tmp_path / "c", {"w": sub})["w"]
    assert _bits(out) == _bits(host)
    assert counter["bytes"] == host.nbytes  # 4 distinct row blocks of 64 KiB, each read once
    counter["bytes"] = 0
    # Column targets across the stored row blocks: each stored chunk is read once and scattered
    # into both column regions.
    cols = NamedSharding(_mesh(), P(None, "a"))
    out = ckpt.restore(tmp_path / "c", {"w": _like(host, cols)})["w"]
    assert _bits(out) == _bits(host) and counter["bytes"] == host.nbytes
    counter["bytes"] = 0
    # One region, rows 8..24 x columns 100..300, across two stored row blocks: per row only
    # the 4 KiB chunk holding it (a row is one chunk here).
    stored = json.loads((tmp_path / "c" / "index.json").read_text())["arrays"]["w"]["blocks"]
    assert len(stored) == 8
    reader = ckpt_io._Reader(tmp_path / "c", {"chunk_bytes": 4096})
    info = {"dtype": "float32", "blocks": stored}
    part = ckpt_io._read_region(reader, "w", info, (8, 100), (16, 200))
    reader.close()
    assert _bits(part) == _bits(host[8:24, 100:300])
    assert counter["bytes"] == 16 * 4096


def _crc32c_reference(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_crc32c_known_answer():
    from jaxops import _jaxops_cpu

    assert _jaxops_cpu.crc32c_chunks(np.frombuffer(b"123456789", np.uint8), 4096) == [0xE3069283]
    assert _jaxops_cpu.crc32c_chunks(np.zeros(0, np.uint8), 8) == []
    with pytest.raises(ValueError, match="chunk must be > 0"):
        _jaxops_cpu.crc32c_chunks(np.zeros(4, np.uint8), 0)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=700), chunk=st.integers(1, 100), skip=st.integers(0, 7))
def test_fuzz_crc32c_chunks(data, chunk, skip):
    # Unaligned starts, odd chunk sizes, the 4-stream and the tail paths.
    from jaxops import _jaxops_cpu

    buf = np.frombuffer(bytes(skip) + data, np.uint8)[skip:]
    got = _jaxops_cpu.crc32c_chunks(buf, chunk)
    want = [_crc32c_reference(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    assert got == want


# -------------------------------------------------------------------------------------------------
# Format: safetensors files, the index, atomic commit


def test_files_open_with_safetensors(tmp_path):
    f32 = _values((16, 8), np.float32)
    bf16 = _values((8, 8), ml_dtypes.bfloat16)
    ckpt.save(tmp_path / "c", {"f32": _put(f32, _mesh()), "bf16": _put(bf16, _mesh(), P())})
    index = json.loads((tmp_path / "c" / "index.json").read_text())
    assert index["format"] == "jaxops.checkpoint" and index["num_processes"] == 1
    for key, host in (("f32", f32), ("bf16", bf16)):
        for block in index["arrays"][key]["blocks"]:
            with safe_open(tmp_path / "c" / block["file"], "np") as f:
                got = f.get_tensor(block["name"])
            region = tuple(
                slice(s, s + n) for s, n in zip(block["start"], block["shape"], strict=True)
            )
            assert _bits(got) == _bits(host[region])
    assert len(index["arrays"]["bf16"]["blocks"]) == 1  # replicated: written once
    assert not list(tmp_path.glob(".*"))  # no temporary directory left


def test_existing_path_is_refused(tmp_path):
    ckpt.save(tmp_path / "c", {"x": jnp.ones(2)})
    with pytest.raises(FileExistsError, match="already exists"):
        ckpt.save(tmp_path / "c", {"x": jnp.ones(2)})


def test_leftover_partial_is_not_a_checkpoint(tmp_path):
    (tmp_path / ".c.partial").mkdir()
    (tmp_path / ".c.partial" / "junk").write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="not a committed checkpoint"):
        ckpt.restore(tmp_path / ".c.partial", {"x": jax.ShapeDtypeStruct((2,), jnp.float32)})
    ckpt.save(tmp_path / "c", {"x": jnp.ones(2)})  # the next save of the name removes it
    assert not (tmp_path / ".c.partial").exists()


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_flipped_byte_is_detected(tmp_path):
    host = _values((64, 64), np.float32)
    ckpt.save(tmp_path / "c", {"w": _put(host, _mesh(), P())})
    block = json.loads((tmp_path / "c" / "index.json").read_text())["arrays"]["w"]["blocks"][0]
    _flip_byte(tmp_path / "c" / block["file"], block["offset"] + 1234)
    with pytest.raises(ckpt.CheckpointError, match="checksum mismatch"):
        ckpt.restore(tmp_path / "c", {"w": _like(host, NamedSharding(_mesh(), P("a")))})


def test_truncated_file_and_header_mismatch(tmp_path):
    host = _values((32, 32), np.float32)
    ckpt.save(tmp_path / "c", {"w": host})
    target = {"w": jax.ShapeDtypeStruct(host.shape, host.dtype)}
    index_path = tmp_path / "c" / "index.json"
    index = json.loads(index_path.read_text())
    block = index["arrays"]["w"]["blocks"][0]
    block["offset"] += 4  # the index disagrees with the file's own header
    index_path.write_text(json.dumps(index))
    with pytest.raises(ckpt.CheckpointError, match="the index says"):
        ckpt.restore(tmp_path / "c", target)
    block["offset"] -= 4
    index_path.write_text(json.dumps(index))
    file = tmp_path / "c" / block["file"]
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ckpt.CheckpointError, match="truncated"):
        ckpt.restore(tmp_path / "c", target)


def test_each_file_header_is_read_once_per_restore(tmp_path, monkeypatch):
    tree = {f"p{i}": np.full((4,), i, np.float32) for i in range(50)}
    ckpt.save(tmp_path / "c", tree)
    calls = []
    real = ckpt_io._read_header
    monkeypatch.setattr(ckpt_io, "_read_header", lambda path: calls.append(path) or real(path))
    out = ckpt.restore(tmp_path / "c", {k: np.zeros(4, np.float32) for k in tree})
    assert all(np.array_equal(out[k], tree[k]) for k in tree)
    assert len(calls) == 1, calls  # one data file: its header parsed once, not once per tensor


def test_malformed_index_is_refused(tmp_path):
    ckpt.save(tmp_path / "c", {"w": np.ones((2, 2), np.float32)})
    index_path = tmp_path / "c" / "index.json"
    good = index_path.read_text()
    for mutate in (
        lambda i: i["arrays"]["w"]["blocks"][0].pop("crc32c"),
        lambda i: i["arrays"]["w"]["blocks"][0].update(nbytes=15),
        lambda i: i["arrays"]["w"].update(shape=[2, "2"]),
        lambda i: i["arrays"]["w"].update(dtype="complex64"),
        lambda i: i.update(checksum="md5"),
    ):
        index = json.loads(good)
        mutate(index)
        index_path.write_text(json.dumps(index))
        with pytest.raises(ckpt.CheckpointError, match=r"malformed entry for 'w'|unknown checksum"):
            ckpt.restore(tmp_path / "c", {"w": np.zeros((2, 2), np.float32)})
    index_path.write_text(good[: len(good) // 2])
    with pytest.raises(ckpt.CheckpointError, match="not valid JSON"):
        ckpt.restore(tmp_path / "c", {"w": np.zeros((2, 2), np.float32)})


@pytest.mark.parametrize("name", ["../x.safetensors", "/etc/passwd", "a/../../b.safetensors", ".."])
def test_index_file_names_cannot_escape(tmp_path, name):
    ckpt.save(tmp_path / "c", {"w": np.ones(4, np.float32)})
    index_path = tmp_path / "c" / "index.json"
    index = json.loads(index_path.read_text())
    index["arrays"]["w"]["blocks"][0]["file"] = name
    index_path.write_text(json.dumps(index))
    with pytest.raises(ckpt.CheckpointError, match="refusing file name"):
        ckpt.restore(tmp_path / "c", {"w": np.zeros(4, np.float32)})


def test_tree_keys_cannot_escape(tmp_path):
    tree = {"..": {"..": np.ones(3, np.float32)}, "x.safetensors": np.zeros(1, np.int8)}
    ckpt.save(tmp_path / "d" / "c", tree)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["c"]
    assert sorted(p.name for p in (tmp_path / "d" / "c").iterdir()) == [
        "data-00000-of-00001.safetensors",
        "index.json",
    ]
    assert ckpt.restore(tmp_path / "d" / "c")[".."][".."].tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="must not contain '/'"):
        ckpt.save(tmp_path / "e", {"/etc/passwd": np.ones(1)})


def test_bad_input_errors(tmp_path):
    with pytest.raises(TypeError, match="leaf 'z' has dtype complex64; supported dtypes"):
        ckpt.save(tmp_path / "a", {"z": np.zeros(2, np.complex64)})
    with pytest.raises(TypeError, match=r"leaf 's' must be a jax\.Array, numpy array"):
        ckpt.save(tmp_path / "b", {"s": "text"})
    with pytest.raises(TypeError, match="not JSON serializable"):
        ckpt.save(tmp_path / "c", {"x": np.ones(1)}, metadata={"f": object()})
    ckpt.save(tmp_path / "ok", {"x": np.ones((2, 3), np.float32)})
    with pytest.raises(ckpt.CheckpointError, match="no array 'y'"):
        ckpt.restore(tmp_path / "ok", {"y": np.ones((2, 3), np.float32)})
    with pytest.raises(ckpt.CheckpointError, match=r"stored as float32\[2, 3\], the target is"):
        ckpt.restore(tmp_path / "ok", {"x": np.ones((3, 2), np.float32)})
    with pytest.raises(ckpt.CheckpointError, match=r"the target is bfloat16\[2, 3\]"):
        ckpt.restore(tmp_path / "ok", {"x": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)})
    with pytest.raises(TypeError, match="target leaf 'x' must be"):
        ckpt.restore(tmp_path / "ok", {"x": "float32[2,3]"})
    with pytest.raises(ckpt.CheckpointError, match="not a committed checkpoint"):
        ckpt.restore(tmp_path / "missing", {"x": np.ones(1)})


_KILL_SCRIPT = """
import sys, numpy as np
from jaxops.parallel import checkpoint
root = sys.argv[1]
x = np.arange(16 << 20, dtype=np.float32)  # 64 MiB
if sys.argv[2] == "first":
    checkpoint.save(root + "/1", {"x": x[:1000]}, step=1)
else:
    print("saving", flush=True)
    checkpoint.save(root + "/2", {"x": x, "y": x[::-1].copy()}, step=2)
"""


@pytest.mark.slow
def test_kill_during_save_never_leaves_a_bad_checkpoint(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    run = [sys.executable, "-c", _KILL_SCRIPT, str(tmp_path)]
    # cwd "/": `python -c` puts the working directory on sys.path, and the source tree's jaxops
    # (without its compiled module) must not shadow the installed package.
    opts = dict(env=env, cwd="/", timeout=120, capture_output=True, text=True)
    first = subprocess.run([*run, "first"], **opts)
    assert first.returncode == 0, first.stdout + first.stderr
    t0 = time.monotonic()
    second = subprocess.run([*run, "second"], **opts)
    assert second.returncode == 0, second.stdout + second.stderr
    duration = time.monotonic() - t0
    ckpt_target = {"x": np.zeros(16 << 20, np.float32), "y": np.zeros(16 << 20, np.float32)}
    expect = np.arange(16 << 20, dtype=np.float32)
    rng = np.random.default_rng(0)
    outcomes = set()
    for _ in range(8):
        import shutil

        shutil.rmtree(tmp_path / "2", ignore_errors=True)
        proc = subprocess.Popen(
            [*run, "second"],
            env=env,
            cwd="/",
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert proc.stdout.readline().strip() == "saving"
        time.sleep(rng.uniform(0, duration * 0.8))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if (tmp_path / "2").exists():
            out = ckpt.restore(tmp_path / "2", ckpt_target)
            assert np.array_equal(out["x"], expect) and np.array_equal(out["y"], expect[::-1])
            outcomes.add("committed")
        else:
            with pytest.raises(ckpt.CheckpointError):
                ckpt.restore(tmp_path / "2", ckpt_target)
            outcomes.add("absent")
        first = ckpt.restore(tmp_path / "1", {"x": np.zeros(1000, np.float32)})
        assert np.array_equal(first["x"], expect[:1000])
        assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) in (
            ["1"],
            ["1", "2"],
        )
    assert "absent" in outcomes, outcomes


# -------------------------------------------------------------------------------------------------
# CheckpointManager


def test_manager_retention(tmp_path):
    mgr = ckpt.CheckpointManager(tmp_path, max_to_keep=2, keep_every=4, async_save=False)
    for step in range(10):
        mgr.save(step, {"x": jnp.full((3,), step)})
    assert mgr.all_steps() == [0, 4, 8, 9] and mgr.latest_step() == 9
    out = mgr.restore(None, {"x": jax.ShapeDtypeStruct((3,), jnp.int32)})
    assert out["x"].tolist() == [9, 9, 9]
    with pytest.raises(FileExistsError, match="step 9 exists"):
        mgr.save(9, {"x": jnp.ones(3)})
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        mgr.save(-1, {"x": jnp.ones(3)})


def test_manager_async_saves_values_before_donation(tmp_path):
    mesh = _mesh()
    x = _put(np.arange(8 * 64, dtype=np.float32).reshape(8, 64), mesh)
    expect = np.asarray(x).copy()
    update = jax.jit(lambda a: a * 2 + 1, donate_argnums=0)
    with ckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(0, {"x": x})
        for _ in range(5):
            x = update(x)  # reuses the donated buffer while the save may still be writing
        x.block_until_ready()
        mgr.save(1, {"x": x})
        mgr.wait()
        target = {"x": _like(x, x.sharding)}
        assert np.array_equal(mgr.restore(0, target)["x"], expect)
        assert np.array_equal(mgr.restore(1, target)["x"], np.asarray(x))


def test_manager_async_error_surfaces(tmp_path, monkeypatch):
    mgr = ckpt.CheckpointManager(tmp_path)
    real = os.fsync

    def failing_fsync(fd):
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    mgr.save(0, {"x": jnp.ones(4)})  # returns: the failure happens in the background
    with pytest.raises(OSError, match="injected"):
        mgr.wait()
    mgr.save(1, {"x": jnp.ones(4)})
    with pytest.raises(OSError, match="injected"):
        mgr.save(2, {"x": jnp.ones(4)})  # the error of step 1 is raised by the next call
    monkeypatch.setattr(os, "fsync", real)
    mgr.save(3, {"x": jnp.ones(4)})
    mgr.close()
    assert mgr.all_steps() == [3]
    assert not list(tmp_path.glob(".*"))


def test_manager_ema(tmp_path):
    mesh = _mesh()
    target = {
        "params": {"w": _like(np.zeros((8, 4), np.float32), NamedSharding(mesh, P("a", "b")))},
        "step": np.zeros((), np.int32),
    }
    values = [np.full((8, 4), v, np.float32) for v in (1.0, 3.0, 7.0)]
    with ckpt.CheckpointManager(tmp_path, ema_decay=0.5) as mgr:
        for step, v in enumerate(values[:2]):
            mgr.save(step, {"params": {"w": _put(v, mesh, P("a", "b"))}, "step": np.int32(step)})
        mgr.wait()
        ema = mgr.restore(1, target, ema=True)
        assert np.allclose(ema["params"]["w"], 0.5 * 1 + 0.5 * 3)
        assert ema["step"] == 1  # no EMA of integers: the saved value
        assert ema["params"]["w"].sharding == target["params"]["w"].sharding
        assert "ema/step" not in ckpt.describe(tmp_path / "1")["arrays"]  # integers: no EMA
    # A new manager (a restart) continues the average after restoring.
    with ckpt.CheckpointManager(tmp_path, ema_decay=0.5) as mgr:
        mgr.restore(None, target)
        mgr.save(2, {"params": {"w": _put(values[2], mesh, P("a", "b"))}, "step": np.int32(2)})
        mgr.wait()
        ema = mgr.restore(2, target, ema=True)
        assert np.allclose(ema["params"]["w"], 0.5 * 2 + 0.5 * 7)
    # A restart that restores only the EMA (to evaluate it) continues it too.
    with ckpt.CheckpointManager(tmp_path, ema_decay=0.5) as mgr:
        assert np.allclose(mgr.restore(2, target, ema=True)["params"]["w"], 4.5)
        mgr.save(3, {"params": {"w": _put(values[0], mesh, P("a", "b"))}, "step": np.int32(3)})
        mgr.wait()
        assert np.allclose(mgr.restore(3, target, ema=True)["params"]["w"], 0.5 * 4.5 + 0.5 * 1)
        with pytest.raises(ValueError, match="ema=True needs a target"):
            mgr.restore(3, None, ema=True)
        with pytest.warns(UserWarning, match="target=None does not reload the EMA"):
            assert "ema" in mgr.restore(3, None)
    with pytest.raises(ValueError, match="ema_decay must be"):
        ckpt.CheckpointManager(tmp_path, ema_decay=1.0)
    with pytest.raises(ValueError, match="max_to_keep must be"):
        ckpt.CheckpointManager(tmp_path, max_to_keep=0)


def test_manager_ema_subtree_and_bf16(tmp_path):
    tree = {"params": jnp.full((4,), 2.0, jnp.bfloat16), "opt": jnp.ones(4)}
    with ckpt.CheckpointManager(tmp_path, ema_decay=0.9, ema_subtree="params") as mgr:
        mgr.save(0, tree)
    arrays = ckpt.describe(tmp_path / "0")["arrays"]
    assert arrays["ema/params"] == {"shape": (4,), "dtype": "float32"}
    assert "ema/opt" not in arrays


def test_progress_bar_only_when_asked_or_on_a_terminal(tmp_path, capsys):
    assert ckpt_io._progress_bar(None, 1 << 30, "save") is None  # pytest's stderr is no terminal
    assert ckpt_io._progress_bar(False, 1 << 30, "save") is None
    bar = ckpt_io._progress_bar(True, 1 << 30, "save")
    assert bar is not None and bar.total == 1 << 30
    bar.close()
    ckpt.save(tmp_path / "c", {"x": np.ones(4)}, progress=False)
    assert capsys.readouterr().err == ""


def test_manager_removes_leftovers(tmp_path):
    (tmp_path / ".5.partial").mkdir()
    ckpt.CheckpointManager(tmp_path).close()
    assert not (tmp_path / ".5.partial").exists()


# -------------------------------------------------------------------------------------------------
# Hugging Face export / import


def _llama_tree(layers=2, d=8, f=12, vocab=16, seed=0):
    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    tree = {
        "embed": {"embedding": w(vocab, d)},
        "layers": {
            str(i): {
                "attn_norm": {"scale": w(d)},
                "attn": {"qkv": {"kernel": w(d, 3 * d)}, "out": {"kernel": w(d, d)}},
                "mlp_norm": {"scale": w(d)},
                "mlp": {"gate_up": {"kernel": w(d, 2 * f)}, "down": {"kernel": w(f, d)}},
            }
            for i in range(layers)
        },
        "final_norm": {"scale": w(d)},
        "lm_head": {"kernel": w(d, vocab)},
    }
    return tree


def test_export_llama_layout_loads_with_safetensors(tmp_path):
    tree = _llama_tree()
    mesh = _mesh()
    sharded = jax.tree.map(lambda a: _put(a, mesh), tree)
    names = ckpt.export_safetensors(sharded, tmp_path / "hf", name_map=LLAMA_NAME_MAP)
    assert "model.layers.1.self_attn.k_proj.weight" in names
    loaded = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(loaded) == sorted(names) and len(names) == 2 + 2 * 9 + 1
    d = 8
    qkv = tree["layers"]["1"]["attn"]["qkv"]["kernel"]
    np.testing.assert_array_equal(loaded["model.layers.1.self_attn.q_proj.weight"], qkv[:, :d].T)
    np.testing.assert_array_equal(
        loaded["model.layers.1.self_attn.v_proj.weight"], qkv[:, 2 * d :].T
    )
    np.testing.assert_array_equal(loaded["lm_head.weight"], tree["lm_head"]["kernel"].T)
    with safe_open(tmp_path / "hf" / "model.safetensors", "np") as f:
        assert f.metadata() == {"format": "pt"}
    # And back into a sharded target.
    target = jax.tree.map(lambda a: _like(a, a.sharding), sharded)
    back = ckpt.import_safetensors(tmp_path / "hf", target, name_map=LLAMA_NAME_MAP)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True):
        assert _bits(a) == _bits(b)
    assert jax.tree.leaves(back)[0].sharding == jax.tree.leaves(sharded)[0].sharding


def test_export_sharded_files_from_checkpoint(tmp_path):
    tree = _llama_tree(layers=3)
    ckpt.save(tmp_path / "c", tree)
    names = ckpt.export_safetensors(
        tmp_path / "c", tmp_path / "hf", max_shard_size="1KB", dtype="bfloat16"
    )
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded = {}
    for f in files:
        loaded.update(load_file(tmp_path / "hf" / f))
    assert sorted(loaded) == sorted(names) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in loaded.values())
    emb = loaded["embed.embedding"]  # no rule: "/" -> "."
    assert emb.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(emb, tree["embed"]["embedding"].astype(ml_dtypes.bfloat16))
    target = {"embed": {"embedding": jax.ShapeDtypeStruct((16, 8), jnp.float32)}}
    back = ckpt.import_safetensors(tmp_path / "hf", target)
    assert back["embed"]["embedding"].dtype == jnp.float32


def test_rules_split_sizes_and_errors(tmp_path):
    qkv = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    rule = ckpt.Rule("qkv", ["q", "k", "v"], axis=1, sizes=(4, 2, 2))
    parts = dict(rule.to_theirs("qkv", qkv))
    assert parts["q"].shape == (4, 4) and parts["v"].shape == (4, 2)
    assert np.array_equal(rule.to_ours([parts["q"], parts["k"], parts["v"]]), qkv)
    with pytest.raises(ValueError, match="does not split into 3 parts"):
        ckpt.Rule("qkv", ["q", "k", "v"], axis=1).to_theirs("qkv", qkv[:, :7])
    with pytest.raises(ValueError, match="both map to 'x'"):
        ckpt.export_safetensors(
            {"a": qkv, "b": qkv + 1}, tmp_path / "o", name_map=[ckpt.Rule("{n}", "x")]
        )
    ckpt.export_safetensors({"a": qkv}, tmp_path / "hf")
    with pytest.raises(ckpt.CheckpointError, match="'b' needs"):
        ckpt.import_safetensors(tmp_path / "hf", {"b": qkv})
    with pytest.raises(ckpt.CheckpointError, match=r"has shape \[4, 8\], the target \[8, 4\]"):
        ckpt.import_safetensors(tmp_path / "hf", {"a": qkv.T})
    with pytest.raises(ValueError, match="max_shard_size must be"):
        ckpt.export_safetensors({"a": qkv}, tmp_path / "x", max_shard_size="lots")
    with pytest.raises(FileExistsError):
        ckpt.export_safetensors({"a": qkv}, tmp_path / "hf")


# -------------------------------------------------------------------------------------------------
# Several processes

_SAVE_SCRIPT = """
import numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxops.parallel import checkpoint
root, = ARGS
mesh = jax.make_mesh((2, 4), ("a", "b"))
def make(shape, dtype, spec):
    host = np.arange(np.prod(shape)).reshape(shape).astype(dtype)
    return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda i: host[i])
tree = {
    "w": make((16, 24), np.float32, P("a", "b")),
    "e": make((8, 8), jax.numpy.bfloat16, P(None, "b")),
    "r1": make((64,), np.float32, P()),
    "r2": make((32,), np.int32, P()),
    "r3": make((48,), np.float32, P()),
    "r4": make((16,), np.float32, P()),
}
checkpoint.save(root, tree, step=5)
checkpoint.export_safetensors(tree, root + "_hf", max_shard_size="1KB")  # collective gathers
print("SAVED", PROCESS_ID)
"""

_RESTORE_SCRIPT = """
import numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxops.parallel import checkpoint
root, = ARGS
mesh = jax.make_mesh((jax.device_count() // 2, 2), ("x", "y"))
specs = {"w": P("y", "x"), "e": P("x", None), "r1": P("x"), "r2": P(), "r3": P(), "r4": P("y")}
shapes = {"w": (16, 24), "e": (8, 8), "r1": (64,), "r2": (32,), "r3": (48,), "r4": (16,)}
dtypes = {"e": jax.numpy.bfloat16, "r2": np.int32}
target = {
    k: jax.ShapeDtypeStruct(shapes[k], dtypes.get(k, np.float32), sharding=NamedSharding(mesh, s))
    for k, s in specs.items()
}
out = checkpoint.restore(root, target)
for k, v in out.items():
    host = np.arange(np.prod(shapes[k])).reshape(shapes[k]).astype(target[k].dtype)
    for s in v.addressable_shards:
        assert np.array_equal(np.asarray(s.data), host[s.index]), k
print("RESTORED", PROCESS_ID, jax.process_count())
"""


def _restore_check(path, nproc):
    if nproc == 1:
        mesh = _mesh((4, 2), ("x", "y"))
        out = ckpt.restore(
            path,
            {
                "w": jax.ShapeDtypeStruct(
                    (16, 24), jnp.float32, sharding=NamedSharding(mesh, P("y", "x"))
                )
            },
        )
        assert np.array_equal(out["w"], np.arange(16 * 24, dtype=np.float32).reshape(16, 24))
        return
    outs = run_processes(_RESTORE_SCRIPT, nproc, 8 // nproc, args=(str(path),), timeout=180)
    assert all(f"RESTORED {i} {nproc}" in o for i, o in enumerate(outs)), outs


@pytest.mark.multiprocess
@pytest.mark.parametrize("saved,restored", [(2, 4), (4, 2), (2, 1)], ids=["2to4", "4to2", "2to1"])
def test_multiprocess_save_restore(tmp_path, saved, restored):
    path = tmp_path / "c"
    outs = run_processes(_SAVE_SCRIPT, saved, 8 // saved, args=(str(path),), timeout=180)
    # Anywhere in the output, not as a whole line: gloo writes its own messages from another
    # thread to the same pipe, unbuffered and in pieces, and may split our line (seen in CI).
    assert all(f"SAVED {i}" in o for i, o in enumerate(outs)), outs
    index = json.loads((path / "index.json").read_text())
    assert index["num_processes"] == saved and index["step"] == 5
    files = {b["file"] for a in index["arrays"].values() for b in a["blocks"]}
    assert files == {f"data-{p:05d}-of-{saved:05d}.safetensors" for p in range(saved)}
    # Replicated arrays are written once each, spread over the processes.
    owners = {index["arrays"][k]["blocks"][0]["file"] for k in ("r1", "r2", "r3", "r4")}
    assert len(owners) >= 2, owners
    assert all(len(index["arrays"][k]["blocks"]) == 1 for k in ("r1", "r2", "r3", "r4"))
    _restore_check(path, restored)
    exported = {}
    for f in (tmp_path / "c_hf").glob("*.safetensors"):
        exported.update(load_file(f))
    assert sorted(exported) == ["e", "r1", "r2", "r3", "r4", "w"]
    np.testing.assert_array_equal(
        exported["w"], np.arange(16 * 24, dtype=np.float32).reshape(16, 24)
    )
    np.testing.assert_array_equal(exported["r2"], np.arange(32, dtype=np.int32))


_DIE_SCRIPT = """
import os, signal, time, numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxops.parallel import checkpoint
root, = ARGS
mesh = jax.make_mesh((2, 2), ("a", "b"))
x = jax.make_array_from_callback((8, 8), NamedSharding(mesh, P("a", "b")),
                                 lambda i: np.ones((8, 8), np.float32)[i])
checkpoint.save(root + "/1", {"x": x})
if PROCESS_ID == 1:  # dies after writing its file, before reporting it
    from jaxops.parallel.checkpoint._coordination import _Coordinator
    publish = _Coordinator.publish
    def die(self, name, value):
        if name == "written":
            os.kill(os.getpid(), signal.SIGKILL)
        publish(self, name, value)
    _Coordinator.publish = die
t0 = time.monotonic()
try:
    checkpoint.save(root + "/2", {"x": x}, timeout=60)
    print("UNEXPECTED COMMIT")
except Exception as e:
    print("FAILED", type(e).__name__, round(time.monotonic() - t0))
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_process_death_commits_nothing(tmp_path):
    t0 = time.monotonic()
    results = spawn_processes(_DIE_SCRIPT, 2, 2, args=(str(tmp_path),), timeout=120)
    elapsed = time.monotonic() - t0
    codes = [code for code, _ in results]
    assert codes[1] == -signal.SIGKILL, results
    assert codes[0] is not None and elapsed < 100, (elapsed, results)  # bounded by the heartbeat
    assert "UNEXPECTED COMMIT" not in results[0][1]
    assert not (tmp_path / "2").exists()
    out = ckpt.restore(tmp_path / "1", {"x": np.zeros((8, 8), np.float32)})
    assert np.array_equal(out["x"], np.ones((8, 8)))


def test_docstring_examples():
    from jaxops import testing

    attempted = testing.run_docstring_examples(ckpt)
    assert attempted > 40, attempted


# -------------------------------------------------------------------------------------------------
# What save refuses before writing anything, and byte order.


@pytest.mark.parametrize(
    "tree,step,match",
    [
        ({"__metadata__": np.arange(3.0)}, None, "'__metadata__' is not allowed"),
        ({"a[0:2]": np.arange(2.0)}, None, r"'a\[0:2\]' is not allowed"),
        ({"w": np.arange(2.0)}, 3.0, "step must be a non-negative integer or None, got 3.0"),
        ({"w": np.arange(2.0)}, "3", "step must be a non-negative integer or None, got '3'"),
        ({"w": np.arange(2.0)}, True, "step must be a non-negative integer or None, got True"),
        ({"w": np.arange(2.0)}, -1, "step must be a non-negative integer or None, got -1"),
    ],
    ids=["metadata_key", "block_name_key", "float_step", "str_step", "bool_step", "neg_step"],
)
def test_save_refuses_what_restore_could_not_read(tmp_path, tree, step, match):
    with pytest.raises(ValueError, match=match):
        ckpt.save(tmp_path / "c", tree, step=step)
    assert not (tmp_path / "c").exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("step", [np.int64(5), jnp.int32(5), 5], ids=["numpy", "jax", "int"])
def test_integer_scalar_steps_are_stored_as_ints(tmp_path, step):
    ckpt.save(tmp_path / "c", {"w": np.arange(2.0)}, step=step)
    assert ckpt.describe(tmp_path / "c")["step"] == 5


def test_big_endian_arrays_round_trip_by_value(tmp_path):
    values = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    big = values.astype(">f4")
    ckpt.save(tmp_path / "c", {"x": big, "i": np.arange(3, dtype=">i8")})
    out = ckpt.restore(tmp_path / "c")
    np.testing.assert_array_equal(out["x"], values)
    np.testing.assert_array_equal(out["i"], [0, 1, 2])
    # Into a big-endian numpy target: the values, in native byte order.
    got = ckpt.restore(tmp_path / "c", {"x": np.zeros((2, 3), ">f4"), "i": np.zeros(3, ">i8")})
    np.testing.assert_array_equal(got["x"], values)
    assert got["x"].dtype.isnative
    # Export: the safetensors library (an outside reader) sees the same values.
    from safetensors.numpy import load_file

    ckpt.export_safetensors({"x": big}, tmp_path / "hf")
    np.testing.assert_array_equal(load_file(tmp_path / "hf" / "model.safetensors")["x"], values)
