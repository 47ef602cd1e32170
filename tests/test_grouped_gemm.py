"""The grouped GEMM CPU custom calls (``jaxops._grouped_gemm``) against float64 numpy.

Shapes cross the kernels' blocks (K, and a group's rows for the weight gradient, past one
256-deep block, N past a 32-column panel and its 16-column AVX2 halves, rows past the register
tiles of 12, 6 and 4 rows and a 96-row task; each micro-kernel in a subprocess of its own),
with empty groups, negative and oversized group sizes (clipped), zero-size operands and one
element; dtypes float32, bfloat16 and float16 (outputs float32). Also the pure-JAX twins,
trace-time errors, vmap, shard_map on 8 devices and a hypothesis fuzz. The grouped activation
calls the same way: each activation and output dtype, rows past the groups zero, a row past the
16-bit outputs' conversion tile, clamped_swiglu's ties at its clamps (half gradients), extreme
and NaN inputs.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _numerics import rel_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxops
from jaxops import _ffi
from jaxops import _grouped_gemm as gg
from jaxops.testing import count_collectives

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# Rows, K, N and the group sizes.
SHAPES = {
    "blocks-300x257x130": (300, 257, 130, [100, 0, 150, 20]),
    "deep-97x600x33": (97, 600, 33, [40, 57]),
    "tasks-250x64x96": (250, 64, 96, [250]),
    # float32 rows 4 KiB apart: w and dy packed, not read in place (their rows alias in L1)
    "aliasing-70x40x1024": (70, 40, 1024, [30, 0, 40]),
    "long-group-600x40x50": (600, 40, 50, [520, 80]),
    "clipped-60x17x40": (60, 17, 40, [25, -4, 50, 9]),
    "tiny-7x1x33": (7, 1, 33, [3, 4]),
    "one-element": (1, 1, 1, [1]),
    "no-rows": (0, 5, 4, [0, 3]),
    "no-k": (9, 0, 6, [4, 5]),
    "no-n": (9, 5, 0, [4, 5]),
    "no-groups-used": (8, 5, 6, [0, 0]),
}


def _rows(sizes, rows):
    """[(begin, end)] of each group as the kernels clip them."""
    out, at = [], 0
    for size in sizes:
        end = min(rows, at + max(0, int(size)))
        out.append((at, end))
        at = end
    return out


def _oracle(x, w, dy, sizes):
    """float64 (y, dw) of y[rows of g] = x[rows] @ w[g], dw[g] = x[rows].T @ dy[rows]."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    y = np.zeros((x.shape[0], w.shape[2]))
    dw = np.zeros_like(w)
    for g, (b, e) in enumerate(_rows(sizes, x.shape[0])):
        y[b:e] = x[b:e] @ w[g]
        dw[g] = x[b:e].T @ dy[b:e]
    return y, dw


def _inputs(rows, k, n, sizes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)), dtype)
    dy = jnp.asarray(rng.standard_normal((rows, n)), dtype)
    return x, w, dy, jnp.asarray(sizes, jnp.int32)


def _close(got, want):
    assert got.dtype == jnp.float32 and got.shape == want.shape, (got.dtype, got.shape)
    # The inputs are exact in float32; the sums are float32 in a different order than numpy's.
    if want.size:
        assert rel_error(got, want) < 1e-5, rel_error(got, want)


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_kernels_match_float64(shape, dtype):
    rows, k, n, sizes = SHAPES[shape]
    x, w, dy, gs = _inputs(rows, k, n, sizes, dtype)
    y_ref, dw_ref = _oracle(x, w, dy, sizes)
    y = jax.jit(gg.grouped_gemm)(x, w, gs)
    y_t = jax.jit(lambda x, w, gs: gg.grouped_gemm(x, w, gs, transpose_w=True))(
        x, jnp.swapaxes(w, 1, 2), gs
    )
    dw = jax.jit(gg.grouped_gemm_wgrad)(x, dy, gs)
    _close(y, y_ref)
    _close(y_t, y_ref)
    _close(dw, dw_ref)
    # Rows past the groups and the gradients of groups without rows are exactly zero.
    spans = _rows(sizes, rows)
    used = spans[-1][1]
    assert not np.asarray(y)[used:].any()
    empty = [g for g, (b, e) in enumerate(spans) if b == e]
    assert not np.asarray(dw)[empty].any()


# The CUDA kernel's edges besides SHAPES': 128 x 128 output tiles and 32-deep steps crossed,
# rows whose K or N allows 16-byte loads and rows that do not, more than 256 groups (the CTA's
# scan over the sizes in several chunks), sizes past the last row (clipped), a tail of zero rows.
GPU_SHAPES = {
    **SHAPES,
    "tiles-700x300x260": (700, 300, 260, [130, 0, 300, 200, 60]),
    "aligned-512x256x384": (512, 256, 384, [128, 256, 100]),
    "odd-k-333x257x129": (333, 257, 129, [1, 127, 129, 0, 70]),
    "many-groups-1100x40x136": (1100, 40, 136, [3, 0, 5] * 110),
    "clipped-past-rows-300x64x64": (300, 64, 64, [100, 150, 2**30, 7]),
    # cuBLASLt's setup kernel scans 1024 sizes at a time
    "groups-2400x16x24": (2400, 16, 24, [2, 0, 1, 1] * 600),
}


# What every GPU test runs: the CUDA kernels' pipelines (JAXOPS_GPU_GEMM_PIPELINE, read at each
# call; float32 always runs "registers"), cuBLASLt's grouped matmul and CUTLASS's grouped GEMM
# (JAXOPS_GPU_GROUPED_GEMM, read at trace time; calls a library does not take run the kernels).
GPU_VARIANTS = [*_ffi.GPU_GEMM_PIPELINES, "cublaslt", "cutlass"]
# Per library: its forward and weight-gradient targets, and the dtypes it takes.
LIBRARY_TARGETS = {
    "cublaslt": (gg.TARGET_GROUPED_GEMM_LT, gg.TARGET_WGRAD_LT, (jnp.bfloat16, jnp.float16)),
    "cutlass": (gg.TARGET_GROUPED_GEMM_CUTLASS, gg.TARGET_WGRAD_CUTLASS, (jnp.bfloat16,)),
}


def _require_lt():
    info = _ffi.build_info().get("CUDA", {})
    if not info.get("cublaslt_grouped"):
        pytest.skip(
            f"no cuBLASLt grouped matmul here (CUDA module {info}): it needs jaxops built with "
            "cuBLASLt and a libcublasLt of cuBLAS 13.4 or newer"
        )


def _require_cutlass():
    info = _ffi.build_info().get("CUDA", {})
    if not info.get("cutlass"):
        pytest.skip(f"no CUTLASS grouped GEMM in this CUDA module ({info})")
    if jax.devices("gpu")[0].compute_capability != "9.0":
        pytest.skip("CUTLASS's grouped GEMM is built for sm_90a (H100, H200) only")


def _require_library(library: str):
    _require_lt() if library == "cublaslt" else _require_cutlass()


@pytest.fixture(params=GPU_VARIANTS)
def gpu_pipeline(request, monkeypatch):
    if request.param in LIBRARY_TARGETS:
        _require_library(request.param)
        monkeypatch.setenv("JAXOPS_GPU_GROUPED_GEMM", request.param)
    else:
        monkeypatch.setenv("JAXOPS_GPU_GEMM_PIPELINE", request.param)
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES), ids=list(GPU_SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_gpu_kernels_match_float64(shape, dtype, gpu_pipeline):
    """The CUDA kernels (forward, transposed weights, weight gradient) against float64."""
    gpu = jax.devices("gpu")[0]
    rows, k, n, sizes = GPU_SHAPES[shape]
    x, w, dy, gs = jax.device_put(_inputs(rows, k, n, sizes, dtype), gpu)
    y_ref, dw_ref = _oracle(x, w, dy, sizes)
    assert gg.kernel_available("gpu")
    if gpu_pipeline in LIBRARY_TARGETS:  # the library's targets where it takes the call
        text = jax.jit(gg.grouped_gemm).lower(x, w, gs).as_text()
        text += jax.jit(gg.grouped_gemm_wgrad).lower(x, dy, gs).as_text()
        *targets, dtypes = LIBRARY_TARGETS[gpu_pipeline]
        takes = np.dtype(dtype) in [np.dtype(d) for d in dtypes] and k % 8 == 0 and n % 8 == 0
        for target in targets:
            assert (f"@{target}(" in text) == takes, text[-2000:]
    y = jax.jit(gg.grouped_gemm)(x, w, gs)
    y_t = jax.jit(lambda x, w, gs: gg.grouped_gemm(x, w, gs, transpose_w=True))(
        x, jnp.swapaxes(w, 1, 2), gs
    )
    dw = jax.jit(gg.grouped_gemm_wgrad)(x, dy, gs)
    assert y.devices() == {gpu}
    _close(y, y_ref)
    _close(y_t, y_ref)
    _close(dw, dw_ref)
    spans = _rows(sizes, rows)
    assert not np.asarray(y)[spans[-1][1] :].any()
    assert not np.asarray(dw)[[g for g, (b, e) in enumerate(spans) if b == e]].any()


@pytest.mark.gpu
def test_gpu_operands_sliced_at_an_odd_offset(gpu_pipeline):
    """x's rows (K = 137) forbid 16-byte loads, and x is a slice one element into a larger buffer
    inside jit: the element-by-element loads match float64 too."""
    gpu = jax.devices("gpu")[0]
    x, w, dy, gs = jax.device_put(_inputs(201, 137, 72, [50, 0, 100, 51], jnp.bfloat16), gpu)
    big = jnp.concatenate([jnp.zeros((1,), x.dtype), x.reshape(-1)])

    @jax.jit
    def f(big, w, dy, gs):
        xs = big[1:].reshape(x.shape)
        return gg.grouped_gemm(xs, w, gs), gg.grouped_gemm_wgrad(xs, dy, gs)

    y, dw = f(big, w, dy, gs)
    y_ref, dw_ref = _oracle(x, w, dy, [50, 0, 100, 51])
    _close(y, y_ref)
    _close(dw, dw_ref)


@pytest.mark.parametrize("shape", ["blocks-300x257x130", "clipped-60x17x40", "no-rows"])
def test_twins_match_float64(shape):
    rows, k, n, sizes = SHAPES[shape]
    x, w, dy, gs = _inputs(rows, k, n, sizes, jnp.float32)
    y_ref, dw_ref = _oracle(x, w, dy, sizes)
    _close(gg.grouped_gemm_reference(x, w, gs), y_ref)
    _close(gg.grouped_gemm_reference(x, jnp.swapaxes(w, 1, 2), gs, transpose_w=True), y_ref)
    _close(gg.grouped_gemm_wgrad_reference(x, dy, gs), dw_ref)


def test_bad_input_is_named_at_trace_time():
    x, w, dy, gs = _inputs(8, 5, 6, [4, 4], jnp.float32)
    with pytest.raises(TypeError, match=r"grouped_gemm: w must have dtype float32; got bfloat16"):
        gg.grouped_gemm(x, w.astype(jnp.bfloat16), gs)
    with pytest.raises(ValueError, match=r"grouped_gemm: w must be \[G, K, N\] with K = .* 5"):
        gg.grouped_gemm(x, jnp.swapaxes(w, 1, 2), gs)
    with pytest.raises(ValueError, match=r"grouped_gemm: w must have 3 dimensions"):
        gg.grouped_gemm(x, w[0], gs)
    with pytest.raises(ValueError, match=r"group_sizes must be int32 \[2\]"):
        gg.grouped_gemm(x, w, gs[:1])
    with pytest.raises(TypeError, match=r"group_sizes must have dtype int32; got float32"):
        gg.grouped_gemm(x, w, gs.astype(jnp.float32))
    with pytest.raises(TypeError, match=r"grouped_gemm: x must have dtype float32, bfloat16"):
        gg.grouped_gemm(x.astype(jnp.int32), w, gs)
    with pytest.raises(ValueError, match=r"grouped_gemm_wgrad: dy must have x's 8 rows"):
        gg.grouped_gemm_wgrad(x, dy[:3], gs)
    with pytest.raises(TypeError, match=r"grouped_gemm_wgrad: dy must have dtype float32"):
        gg.grouped_gemm_wgrad(x, dy.astype(jnp.float16), gs)


def test_vmap_runs_each_example():
    x, w, dy, gs = _inputs(40, 9, 11, [10, 0, 25], jnp.float32)
    xs = jnp.stack([x, 2 * x])
    sizes = jnp.stack([gs, jnp.asarray([40, 0, 0], jnp.int32)])
    ys = jax.vmap(gg.grouped_gemm, in_axes=(0, None, 0))(xs, w, sizes)
    for i in range(2):
        _close(ys[i], _oracle(xs[i], w, dy, np.asarray(sizes[i]))[0])


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_inside_shard_map_each_device_multiplies_its_own_groups(impl):
    """y and dw of each device's own rows and groups, the kernels' and the twins' (the twins'
    dw is ragged_dot's VJP: from an invariant zero primal it came back summed over the devices);
    no collective."""
    devices = jax.devices("cpu")[:8]
    mesh = jax.make_mesh((len(devices),), ("expert",), devices=devices)
    n_dev, rows, k, n, groups = len(devices), 48, 20, 36, 3
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((n_dev * rows, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n_dev * groups, k, n)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((n_dev * rows, n)), jnp.float32)
    sizes = jnp.asarray(rng.integers(0, 17, (n_dev * groups,)), jnp.int32)
    host = tuple(np.asarray(a) for a in (x, w, dy, sizes))
    x, w, dy, sizes = jax.device_put((x, w, dy, sizes), NamedSharding(mesh, P("expert")))
    if impl == "ffi":
        gemm, wgrad = gg.grouped_gemm, gg.grouped_gemm_wgrad
    else:
        gemm, wgrad = gg.grouped_gemm_reference, gg.grouped_gemm_wgrad_reference

    @jax.jit
    def f(x, w, dy, sizes):
        return jax.shard_map(
            lambda x, w, dy, sizes: (gemm(x, w, sizes), wgrad(x, dy, sizes)),
            mesh=mesh,
            in_specs=(P("expert"),) * 4,
            out_specs=(P("expert"), P("expert")),
        )(x, w, dy, sizes)

    assert count_collectives(f.lower(x, w, dy, sizes).compile().as_text()) == {}
    y, dw = (np.asarray(a) for a in f(x, w, dy, sizes))
    hx, hw, hdy, hsizes = host
    for d in range(n_dev):
        part = slice(d * rows, (d + 1) * rows)
        g = slice(d * groups, (d + 1) * groups)
        want_y, want_dw = _oracle(hx[part], hw[g], hdy[part], hsizes[g])
        _close(jnp.asarray(y[part]), want_y)
        _close(jnp.asarray(dw[g]), want_dw)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(0, 130),
    k=st.integers(0, 70),
    n=st.integers(0, 70),
    sizes=st.lists(st.integers(-5, 80), min_size=1, max_size=5),
    dtype=st.sampled_from(DTYPES),
    transpose_w=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fuzz_against_float64(rows, k, n, sizes, dtype, transpose_w, seed):
    x, w, dy, gs = _inputs(rows, k, n, sizes, dtype, seed)
    y_ref, dw_ref = _oracle(x, w, dy, sizes)
    wt = jnp.swapaxes(w, 1, 2) if transpose_w else w
    _close(gg.grouped_gemm(x, wt, gs, transpose_w=transpose_w), y_ref)
    _close(gg.grouped_gemm_wgrad(x, dy, gs), dw_ref)


_SCRIPT = r"""
import numpy as np, jax.numpy as jnp
from jaxops import _grouped_gemm as gg
rng = np.random.default_rng(1)
x = rng.standard_normal((150, 300)).astype(np.float32)
w = rng.standard_normal((3, 300, 45)).astype(np.float32)
dy = rng.standard_normal((150, 45)).astype(np.float32)
sizes = np.array([70, 0, 77], np.int32)
np.savez(__import__("sys").argv[1], y=gg.grouped_gemm(x, w, sizes),
         yt=gg.grouped_gemm(x, np.swapaxes(w, 1, 2), sizes, transpose_w=True),
         dw=gg.grouped_gemm_wgrad(x, dy, sizes), x=x, w=w, dy=dy, sizes=sizes)
"""


def _run_in_subprocess(
    tmp_path, script: str = _SCRIPT, args: tuple[str, ...] = (), **env_changes: str | None
) -> subprocess.CompletedProcess:
    """`script` (out.npz in tmp_path, then `args` on its command line) in a fresh process, with
    environment variables set (None: removed)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "out.npz"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )


# Every shape and dtype of SHAPES, each kernel's outputs written to an npz (y, y with w
# transposed, dw per case) with the kernel build_info reports.
_SWEEP_SCRIPT = r"""
import sys, numpy as np, jax.numpy as jnp, jaxops
from jaxops import _grouped_gemm as gg
cases = {}
for name, (rows, k, n, sizes) in eval(sys.argv[2]).items():
    for dtype in ("float32", "bfloat16", "float16"):
        rng = np.random.default_rng(rows + k + n)
        x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
        w = jnp.asarray(rng.standard_normal((len(sizes), k, n)), dtype)
        dy = jnp.asarray(rng.standard_normal((rows, n)), dtype)
        gs = jnp.asarray(sizes, jnp.int32)
        key = f"{name}-{dtype}"
        cases[key + "-x"], cases[key + "-w"], cases[key + "-dy"] = (
            np.asarray(a, np.float32) for a in (x, w, dy))
        cases[key + "-y"] = np.asarray(gg.grouped_gemm(x, w, gs))
        cases[key + "-yt"] = np.asarray(
            gg.grouped_gemm(x, jnp.swapaxes(w, 1, 2), gs, transpose_w=True))
        cases[key + "-dw"] = np.asarray(gg.grouped_gemm_wgrad(x, dy, gs))
np.savez(sys.argv[1], kernel=jaxops.build_info()["cpu"]["grouped_gemm_kernel"], **cases)
"""


def _cpu_flags() -> set[str]:
    """The x86 feature flags of this machine's CPU (/proc/cpuinfo), empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _widest_kernel(cap: str) -> str:
    """The micro-kernel the calls should pick under JAXOPS_CPU_GEMM_KERNEL=`cap` here."""
    flags = _cpu_flags()
    has = {"avx512": {"avx512f", "fma"} <= flags, "avx2": {"avx2", "fma"} <= flags}
    order = list(_ffi.CPU_GEMM_KERNELS)  # widest first
    return next(k for k in order[order.index(cap) :] if k == "portable" or has[k])


@pytest.mark.parametrize("kernel", _ffi.CPU_GEMM_KERNELS)
def test_each_micro_kernel_matches_float64(tmp_path, kernel):
    """Every shape of SHAPES and every dtype with JAXOPS_CPU_GEMM_KERNEL=`kernel`: build_info
    names the widest kernel this CPU has at or below it (AVX-512's 12 x 32 tiles, AVX2's 6 x 16,
    the portable 4 x 32), and y, y from w transposed and dw match float64 numpy. A kernel this
    CPU lacks runs the first shape only (the kernel it falls back to has its own row)."""
    fallback = _widest_kernel(kernel) != kernel
    shapes = dict(list(SHAPES.items())[:1]) if fallback else SHAPES
    run = _run_in_subprocess(
        tmp_path, _SWEEP_SCRIPT, (repr(shapes),), JAXOPS_CPU_GEMM_KERNEL=kernel
    )
    assert run.returncode == 0, run.stderr[-3000:]
    r = np.load(tmp_path / "out.npz")
    assert str(r["kernel"]) == _widest_kernel(kernel), (str(r["kernel"]), _cpu_flags() & {
        "avx512f", "avx2", "fma"})  # fmt: skip
    for name, (_, _, _, sizes) in shapes.items():
        for dtype in ("float32", "bfloat16", "float16"):
            key = f"{name}-{dtype}"
            y_ref, dw_ref = _oracle(r[key + "-x"], r[key + "-w"], r[key + "-dy"], sizes)
            for got, want in ((r[key + "-y"], y_ref), (r[key + "-yt"], y_ref)):
                _close(jnp.asarray(got), want)
            _close(jnp.asarray(r[key + "-dw"]), dw_ref)


# The suite sets JAXOPS_CPU_THREADS=2 (tests/conftest.py), so _SCRIPT's 4 tasks split over 2
# threads there; these runs take the calls' own choice: on the calling thread where the pool has a
# thread per simulated device beyond the cores (8 devices), over the pool with one device.
@pytest.mark.parametrize(
    "env",
    [
        pytest.param({"JAXOPS_CPU_THREADS": None, "JAX_NUM_CPU_DEVICES": "8"}, id="8dev-default"),
        pytest.param({"JAXOPS_CPU_THREADS": None, "JAX_NUM_CPU_DEVICES": "1"}, id="1dev-default"),
        pytest.param({"JAXOPS_CPU_THREADS": "1"}, id="one-thread"),
    ],
)
def test_subprocess_settings_match_float64(tmp_path, env):
    """The threads a call splits its work over (JAXOPS_CPU_THREADS, or the call's own choice)."""
    run = _run_in_subprocess(tmp_path, **env)
    assert run.returncode == 0, run.stderr[-3000:]
    r = np.load(tmp_path / "out.npz")
    y_ref, dw_ref = _oracle(r["x"], r["w"], r["dy"], r["sizes"])
    for got, want in ((r["y"], y_ref), (r["yt"], y_ref), (r["dw"], dw_ref)):
        _close(jnp.asarray(got), want)


_BAD_SETTINGS = (
    [("JAXOPS_CPU_THREADS", v, "must be a positive integer") for v in ("0", "-2", "two", "1.5")]
    + [("JAXOPS_CPU_GEMM_KERNEL", v, "must be one of") for v in ("AVX2", "sse", "1", "")]
    + [("JAXOPS_GPU_GEMM_PIPELINE", v, "must be one of") for v in ("Async", "wgmma", "4", "")]
    + [("JAXOPS_GPU_GROUPED_GEMM", v, "must be one of") for v in ("cuBLASLt", "CUTLASS", "")]
)


@pytest.mark.parametrize(("variable", "value", "message"), _BAD_SETTINGS)
def test_bad_setting_is_refused(monkeypatch, variable, value, message):
    """The checks import runs (_ffi.check_settings), each bad value named with its variable."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"^{variable} {message}") as info:
        _ffi.check_settings()
    assert repr(value) in str(info.value)


def test_bad_setting_is_refused_at_import(tmp_path):
    """Importing jaxops with a bad setting fails with that message (one fresh process)."""
    run = _run_in_subprocess(tmp_path, JAXOPS_CPU_GEMM_KERNEL="sse")
    assert run.returncode != 0
    assert "JAXOPS_CPU_GEMM_KERNEL must be one of" in run.stderr, run.stderr[-3000:]
    assert "'sse'" in run.stderr, run.stderr[-3000:]


@pytest.mark.skipif(
    _ffi.cuda_module_function("grouped_gemm_lt_workspace_bytes") is None,
    reason="no CUDA module built with cuBLASLt in this install",
)
def test_cuda_module_has_the_cublaslt_grouped_targets():
    """The CUDA module built with cuBLASLt (it loads without a GPU) registers both cuBLASLt
    grouped targets as stateful, finds the grouped API in a libcublasLt of cuBLAS 13.4 or newer
    (looked up at run time) and not in an older one, and sizes the workspace: three pointer and
    three int32 arrays of a value per group and one region of scalars, each 256-byte aligned,
    and 32 MiB for cuBLASLt."""
    module = _ffi._modules["CUDA"]
    info = module.build_info()
    assert info["cublaslt_version"] >= 130000, info
    assert info["cublaslt_grouped"] is (info["cublaslt_version"] >= 130400), info
    stateful = {name for name, _, is_stateful in module.registrations() if is_stateful}
    assert {gg.TARGET_GROUPED_GEMM_LT, gg.TARGET_WGRAD_LT} <= stateful
    workspace = _ffi.cuda_module_function("grouped_gemm_lt_workspace_bytes")

    def aligned(n):
        return -(-n // 256) * 256

    for groups in (1, 63, 1000, 2400):
        arrays = 3 * aligned(8 * groups) + 3 * aligned(4 * groups) + 256
        assert workspace(groups) == arrays + (32 << 20)


@pytest.mark.skipif(
    _ffi.cuda_module_function("grouped_gemm_cutlass_workspace_bytes") is None,
    reason="no CUDA module built for sm_90a with CUTLASS's headers in this install",
)
def test_cuda_module_has_the_cutlass_grouped_targets():
    """The CUDA module built with CUTLASS (it loads without a GPU) names the CUTLASS version,
    registers the CUTLASS targets (stateless) and sizes their workspaces without a GPU: at least
    the per-group arrays (three pointers, three int32, a shape and three strides of 8 bytes or
    more a group, each region 256-byte aligned), a region of scalars, and CUTLASS's own."""
    module = _ffi._modules["CUDA"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", module.build_info()["cutlass"])
    stateless = {name for name, _, is_stateful in module.registrations() if not is_stateful}
    assert {gg.TARGET_GROUPED_GEMM_CUTLASS, gg.TARGET_WGRAD_CUTLASS} <= stateless
    workspace = _ffi.cuda_module_function("grouped_gemm_cutlass_workspace_bytes")

    def aligned(n):
        return -(-n // 256) * 256

    counts = (1, 63, 1000, 2400)
    sizes = [workspace(groups) for groups in counts]
    assert sizes == sorted(set(sizes)) and all(s % 256 == 0 for s in sizes), sizes
    for groups, size in zip(counts, sizes, strict=True):
        arrays = 6 * aligned(8 * groups) + 3 * aligned(4 * groups) + aligned(12 * groups)
        assert size > arrays + 256, (groups, size)
    # The block-scaled FP8 targets: five pointers, three int32, a shape, three strides and two
    # scale layouts (8 bytes or more each) a group, then the scalars and CUTLASS's own.
    assert {gg.TARGET_GROUPED_GEMM_FP8_CUTLASS, gg.TARGET_WGRAD_FP8_CUTLASS} <= stateless
    workspace = _ffi.cuda_module_function("grouped_gemm_fp8_cutlass_workspace_bytes")
    sizes = [workspace(groups) for groups in counts]
    assert sizes == sorted(set(sizes)) and all(s % 256 == 0 for s in sizes), sizes
    for groups, size in zip(counts, sizes, strict=True):
        arrays = 10 * aligned(8 * groups) + 3 * aligned(4 * groups) + aligned(12 * groups)
        assert size > arrays + 256, (groups, size)


@pytest.mark.parametrize("library", list(LIBRARY_TARGETS))
def test_library_setting_leaves_the_cpu_calls_alone(monkeypatch, library):
    """JAXOPS_GPU_GROUPED_GEMM=cublaslt or cutlass picks the library's targets on a GPU only; a
    bad value set after import is refused when a call is traced, on any backend."""
    monkeypatch.setenv("JAXOPS_GPU_GROUPED_GEMM", library)
    x, w, dy, gs = _inputs(8, 8, 8, [4, 4], jnp.bfloat16)  # a call both take on a GPU
    text = jax.jit(gg.grouped_gemm).lower(x, w, gs).as_text()
    text += jax.jit(gg.grouped_gemm_wgrad).lower(x, dy, gs).as_text()
    assert gg.TARGET_GROUPED_GEMM in text and gg.TARGET_WGRAD in text
    for target in LIBRARY_TARGETS[library][:2]:
        assert target not in text
    _close(gg.grouped_gemm(x, w, gs), _oracle(x, w, dy, [4, 4])[0])
    monkeypatch.setenv("JAXOPS_GPU_GROUPED_GEMM", "cuBLASLt")
    with pytest.raises(ValueError, match=r"JAXOPS_GPU_GROUPED_GEMM must be one of .*'cuBLASLt'"):
        gg.grouped_gemm_wgrad(x, dy, gs)


# -------------------------------------------------------------------------------------------------
# The grouped activation calls (CPU): the expert FFN's activation on the groups' rows.

ACTIVATIONS = list(gg.ACTIVATIONS)
ALPHA, LIMIT = 1.702, 1.5  # a small limit: clamped_swiglu's clamps cut standard normal inputs
# Rows, columns of h (even: the gated activations' gate and up) and the group sizes.
ACT_SHAPES = {
    "rows-300x130": (300, 130, [100, 0, 150, 20]),
    "wide-37x2050": (37, 2050, [30]),  # a row past the 16-bit outputs' 1024-value tile
    "clipped-60x34": (60, 34, [25, -4, 50, 9]),
    "all-rows-9x2": (9, 2, [9]),
    "one-element": (1, 2, [1]),
    "no-rows": (0, 6, [0, 3]),
    "no-groups-used": (8, 6, [0, 0]),
    "no-columns": (5, 0, [3]),
}


def _act64(h, activation):
    """float64 (a, vjp) of the activation on every row: vjp(da) is the gradient for h."""
    h = np.asarray(h, np.float64)
    with np.errstate(over="ignore"):
        sig = lambda v: 1.0 / (1.0 + np.exp(-v))  # noqa: E731
        if activation == "silu":
            s = sig(h)
            return h * s, lambda da: da * s * (1 + h * (1 - s))
        if activation == "swiglu":
            g, u = np.split(h, 2, axis=1)
            s = sig(g)
            return g * s * u, lambda da: np.concatenate(
                [da * u * s * (1 + g * (1 - s)), da * g * s], axis=1
            )
        g, u = h[:, 0::2], h[:, 1::2]
        gc, lo = np.minimum(g, LIMIT), np.maximum(u, -LIMIT)
        uc = np.minimum(lo, LIMIT)
        s = sig(ALPHA * gc)

        def grad(v, at, below):  # jax's balanced gradient of min / max at a tie
            return np.where(v == at, 0.5, np.where(v < at, below, 1.0 - below))

        def vjp(da):
            dh = np.empty_like(h)
            dh[:, 0::2] = da * (uc + 1) * (s + gc * ALPHA * s * (1 - s)) * grad(g, LIMIT, 1.0)
            dh[:, 1::2] = da * gc * s * grad(u, -LIMIT, 0.0) * grad(lo, LIMIT, 1.0)
            return dh

        return (uc + 1) * gc * s, vjp


def _act_inputs(rows, cols, sizes, activation, dtype, seed=0):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((rows, cols)).astype(np.float32) * 3
    if activation == "clamped_swiglu" and h.size:  # ties of the clamps: half gradients
        h.flat[: min(4, h.size)] = [LIMIT, -LIMIT, LIMIT, LIMIT][: min(4, h.size)]
    f = cols if activation == "silu" else cols // 2
    da = jnp.asarray(rng.standard_normal((rows, f)), dtype)
    return jnp.asarray(h), da, jnp.asarray(sizes, jnp.int32)


def _act_tol(dtype) -> float:
    """Relative error bound of an output rounded to `dtype` (the math is float32 either way)."""
    return {jnp.float32: 2e-6, jnp.bfloat16: 8e-3, jnp.float16: 1e-3}[dtype]


def _act_check(h, da, sizes, activation, dtype):
    kw = dict(alpha=ALPHA, limit=LIMIT)
    a = jax.jit(lambda h, s: gg.grouped_activation(h, s, activation, dtype=dtype, **kw))(h, sizes)
    dh = jax.jit(lambda h, d, s: gg.grouped_activation_bwd(h, d, s, activation, **kw))(h, da, sizes)
    a64, vjp = _act64(h, activation)
    dh64 = vjp(np.asarray(da, np.float64))
    used = _rows(np.asarray(sizes), h.shape[0])[-1][1] if sizes.size else 0
    assert a.dtype == dtype and a.shape == a64.shape
    assert dh.dtype == jnp.float32 and dh.shape == h.shape
    # Rows past the groups are exactly zero; the groups' rows match float64.
    assert not np.asarray(a, np.float32)[used:].any() and not np.asarray(dh)[used:].any()
    if a64[:used].size:
        assert rel_error(a[:used], a64[:used]) < _act_tol(dtype), rel_error(a[:used], a64[:used])
        # da is exact in float32; the gradient's math is float32.
        assert rel_error(dh[:used], dh64[:used]) < 2e-6, rel_error(dh[:used], dh64[:used])
    return a, dh


@pytest.mark.parametrize("shape", list(ACT_SHAPES), ids=list(ACT_SHAPES))
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_activation_kernels_match_float64(shape, activation, dtype):
    rows, cols, sizes = ACT_SHAPES[shape]
    h, da, gs = _act_inputs(rows, cols, sizes, activation, dtype)
    a, dh = _act_check(h, da, gs, activation, dtype)
    # And the pure-JAX twins (XLA's own exp: a few float32 ulps apart).
    kw = dict(alpha=ALPHA, limit=LIMIT)
    a_ref = gg.grouped_activation_reference(h, gs, activation, dtype=dtype, **kw)
    dh_ref = gg.grouped_activation_bwd_reference(h, da, gs, activation, **kw)
    if a.size:
        assert rel_error(a, a_ref) <= _act_tol(dtype) and rel_error(dh, dh_ref) < 2e-6


def test_activation_extreme_inputs_stay_finite_and_exact_at_zero():
    h = jnp.asarray([[0.0, 0.0], [-100.0, 5.0], [100.0, 5.0], [-1e30, 1.0], [88.0, 1.0]])
    gs = jnp.asarray([5], jnp.int32)
    a = np.asarray(gg.grouped_activation(h, gs, "swiglu"))[:, 0]
    assert a[0] == 0.0 and abs(a[1]) < 1e-30 and a[2] == 500.0 and a[3] == 0.0 and a[4] == 88.0
    dh = np.asarray(gg.grouped_activation_bwd(h, jnp.ones((5, 1)), gs, "swiglu"))
    assert np.isfinite(dh).all() and dh[0].tolist() == [0.0, 0.0]
    nan = np.asarray(gg.grouped_activation(jnp.asarray([[np.nan, 1.0]]), gs[:1], "swiglu"))
    assert np.isnan(nan).all()


def test_activation_bad_input_is_named_at_trace_time():
    h, da, gs = _act_inputs(8, 6, [4, 4], "swiglu", jnp.float32)
    with pytest.raises(ValueError, match=r"grouped_activation: activation must be one of"):
        gg.grouped_activation(h, gs, "gelu")
    with pytest.raises(ValueError, match=r"swiglu needs an even number of columns in h"):
        gg.grouped_activation(h[:, :5], gs, "swiglu")
    with pytest.raises(TypeError, match=r"grouped_activation: h must have dtype float32; got"):
        gg.grouped_activation(h.astype(jnp.bfloat16), gs, "swiglu")
    with pytest.raises(TypeError, match=r"group_sizes must have dtype int32; got float32"):
        gg.grouped_activation(h, gs.astype(jnp.float32), "swiglu")
    with pytest.raises(ValueError, match=r"grouped_activation: dtype must be float32, bfloat16"):
        gg.grouped_activation(h, gs, "swiglu", dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"limit must be finite and > 0, got nan"):
        gg.grouped_activation(h, gs, "clamped_swiglu", limit=float("nan"))
    with pytest.raises(ValueError, match=r"grouped_activation_bwd: da must be \[8, 3\]"):
        gg.grouped_activation_bwd(h, da[:, :2], gs, "swiglu")
    with pytest.raises(ValueError, match=r"grouped_activation_bwd: da must be \[8, 6\]"):
        gg.grouped_activation_bwd(h, da, gs, "silu")


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_activation_bwd_inside_shard_map_with_an_invariant_h(impl):
    """A replicated h (invariant over the mesh) with each device's own da: the kernel and the
    twin give each device's gradient (the twin's jax.vjp refused the mixed types before)."""
    devices = jax.devices("cpu")[:8]
    mesh = jax.make_mesh((len(devices),), ("expert",), devices=devices)
    rows, c = 6, 8
    rng = np.random.default_rng(5)
    h = rng.standard_normal((rows, c)).astype(np.float32)
    da = rng.standard_normal((8 * rows, c // 2)).astype(np.float32)
    sizes = np.tile(np.array([3, 2], np.int32), 8)
    bwd = gg.grouped_activation_bwd if impl == "ffi" else gg.grouped_activation_bwd_reference
    f = jax.jit(
        jax.shard_map(
            lambda da, sizes: bwd(jnp.asarray(h), da, sizes, "swiglu"),
            mesh=mesh,
            in_specs=(P("expert"), P("expert")),
            out_specs=P("expert"),
        )
    )
    sharding = NamedSharding(mesh, P("expert"))
    got = np.asarray(f(jax.device_put(da, sharding), jax.device_put(sizes, sharding)))
    _, vjp = _act64(h, "swiglu")
    for d in range(8):
        dh = got[d * rows : (d + 1) * rows]
        want = vjp(da[d * rows : (d + 1) * rows].astype(np.float64))
        assert rel_error(dh[:5], want[:5]) < 2e-6, (d, rel_error(dh[:5], want[:5]))
        assert not dh[5:].any()  # the row past the groups [3, 2]


def test_activation_vmap_runs_each_example():
    h = _act_inputs(20, 8, [10, 5], "swiglu", jnp.float32)[0]
    hs, sizes = jnp.stack([h, -h]), jnp.asarray([[10, 5], [3, 0]], jnp.int32)
    out = jax.vmap(lambda h, s: gg.grouped_activation(h, s, "swiglu"))(hs, sizes)
    for i in range(2):
        want = gg.grouped_activation_reference(hs[i], sizes[i], "swiglu")
        assert (
            rel_error(out[i], want) < 2e-6 and not np.asarray(out[i])[int(sizes[i].sum()) :].any()
        )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(0, 90),
    half=st.integers(0, 70),
    sizes=st.lists(st.integers(-5, 60), min_size=1, max_size=4),
    activation=st.sampled_from(ACTIVATIONS),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_activation_fuzz_against_float64(rows, half, sizes, activation, dtype, seed):
    h, da, gs = _act_inputs(rows, 2 * half, sizes, activation, dtype, seed)
    _act_check(h, da, gs, activation, dtype)


def _check_zero_tail(op, zero_tail, device):
    """zero_tail's contract for one call on `device` (see the tests below)."""
    rows, k, sizes = 90, 48, [30, 0, 25]
    used = 55
    rng = np.random.default_rng(5)
    held = jnp.asarray(rng.standard_normal((rows, k)) + 3.0, jnp.float32)  # no zeros
    gs = jnp.asarray(sizes, jnp.int32)
    silu = gg._attrs("silu", 1.702, 7.0)  # the attributes the wrappers pass
    if op.startswith("gemm"):
        w = jnp.asarray(rng.standard_normal((len(sizes), k, k)), jnp.float32)
        attrs = dict(transpose_w=op == "gemm-transposed", zero_tail=zero_tail)
        w_math = jnp.swapaxes(w, 1, 2) if attrs["transpose_w"] else w
        target, operands = gg.TARGET_GROUPED_GEMM, (held, w, gs)
        want = _oracle(held, w_math, np.zeros((rows, k), np.float32), sizes)[0]
    elif op == "activation":  # silu: a [R, C] like h
        attrs = dict(silu, zero_tail=zero_tail)
        target, operands = gg.TARGET_ACTIVATION_FWD, (held, gs)
        want = _act64(held, "silu")[0]
    else:  # dh [R, C] like h
        da = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
        attrs = dict(silu, zero_tail=zero_tail)
        target, operands = gg.TARGET_ACTIVATION_BWD, (held, da, gs)
        want = _act64(held, "silu")[1](np.asarray(da, np.float64))
    operands = jax.device_put(operands, device)
    out = jax.ShapeDtypeStruct((rows, k), jnp.float32)
    plain = jax.jit(lambda *a: jax.ffi.ffi_call(target, out)(*a, **attrs))(*operands)
    assert plain.devices() == {device}
    assert rel_error(plain[:used], want[:used]) < 2e-6, rel_error(plain[:used], want[:used])
    call = jax.ffi.ffi_call(target, out, input_output_aliases={0: 0})
    tail = np.asarray(jax.jit(lambda *a: call(*a, **attrs))(*operands))[used:]
    if zero_tail:
        assert not tail.any()
    else:
        np.testing.assert_array_equal(tail, np.asarray(held)[used:])


@pytest.mark.parametrize("zero_tail", [True, False], ids=["zeroed", "unwritten"])
@pytest.mark.parametrize("op", ["gemm", "gemm-transposed", "activation", "activation-bwd"])
def test_zero_tail_false_leaves_the_rows_past_the_groups_as_they_were(op, zero_tail):
    """zero_tail=False: the rows past the groups keep what the output buffer held (the output is
    aliased to an input of its shape here, so that it holds that input's rows), zero_tail=True
    zeroes them; the groups' rows of an unaliased call match float64 either way."""
    _check_zero_tail(op, zero_tail, jax.devices("cpu")[0])
    # The public wrappers pass the attribute through.
    x = jnp.ones((4, 2))
    text = (
        jax.jit(
            lambda x: gg.grouped_gemm(
                x, jnp.ones((1, 2, 2)), jnp.array([1], jnp.int32), zero_tail=zero_tail
            )
        )
        .lower(x)
        .as_text()
    )
    assert f"zero_tail = {str(zero_tail).lower()}" in text


@pytest.mark.gpu
@pytest.mark.parametrize("zero_tail", [True, False], ids=["zeroed", "unwritten"])
@pytest.mark.parametrize("op", ["gemm", "gemm-transposed"])
def test_gpu_zero_tail_false_leaves_the_rows_past_the_groups_as_they_were(op, zero_tail):
    """The CUDA forward kernel's zero_tail, as the CPU test above."""
    _check_zero_tail(op, zero_tail, jax.devices("gpu")[0])


@pytest.mark.gpu
@pytest.mark.parametrize("zero_tail", [True, False], ids=["zeroed", "unwritten"])
@pytest.mark.parametrize("transpose_w", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("library", list(LIBRARY_TARGETS))
def test_gpu_library_zero_tail(library, transpose_w, zero_tail):
    """A library's target (bfloat16, K = N = 48: a call both take) zeros the rows past the
    groups with a kernel of its own, or leaves them. Its output is the donated buffer of float32
    rows (no operand of the call has y's dtype to alias), so that it holds those rows before."""
    _require_library(library)
    device = jax.devices("gpu")[0]
    rows, k, sizes, used = 90, 48, [30, 0, 25], 55
    rng = np.random.default_rng(5)
    held = np.asarray(rng.standard_normal((rows, k)) + 3.0, np.float32)  # no zeros
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, k)), jnp.bfloat16)
    want = _oracle(x, jnp.swapaxes(w, 1, 2) if transpose_w else w, np.zeros_like(held), sizes)[0]
    target = LIBRARY_TARGETS[library][0]
    _ffi.ensure_registered(target)
    size_function = f"grouped_gemm_{'lt' if library == 'cublaslt' else library}_workspace_bytes"
    workspace = _ffi.cuda_module_function(size_function)(len(sizes))
    outs = (
        jax.ShapeDtypeStruct(held.shape, jnp.float32),
        jax.ShapeDtypeStruct((workspace,), jnp.uint8),
    )
    call = jax.ffi.ffi_call(target, outs)
    f = jax.jit(
        lambda buf, x, w, gs: call(x, w, gs, transpose_w=transpose_w, zero_tail=zero_tail)[0],
        donate_argnums=0,
        keep_unused=True,
    )
    operands = jax.device_put((held, x, w, jnp.asarray(sizes, jnp.int32)), device)
    assert "input_output_alias" in f.lower(*operands).compile().as_text()
    y = np.asarray(f(*operands))
    assert operands[0].is_deleted()
    assert rel_error(y[:used], want[:used]) < 1e-5, rel_error(y[:used], want[:used])
    if zero_tail:
        assert not y[used:].any()
    else:
        np.testing.assert_array_equal(y[used:], held[used:])


# -------------------------------------------------------------------------------------------------
# The block-scaled FP8 grouped GEMM (grouped_gemm_fp8): x in 1 x 128 groups, w in 128 x 128 tiles.

# Rows, K, N and the group sizes: whole and partial 128-blocks of K and N, an empty group,
# negative and oversized sizes (clipped), one row, no rows.
FP8_SHAPES = {
    "blocks-300x256x384": (300, 256, 384, [100, 0, 150, 20]),
    "partial-blocks-130x200x72": (130, 200, 72, [60, 70]),
    "clipped-60x128x64": (60, 128, 64, [25, -4, 50, 9]),
    "one-row": (1, 128, 16, [1]),
    "no-rows": (0, 128, 32, [0, 0]),
}
# The CUTLASS kernel's edges besides those: more groups than the setup's 1024-wide scan with
# empty ones among them, gpt-oss's K and N (2880: 22.5 blocks of 128), sizes past the last row,
# and K = 200 and N = 72 (not multiples of 16: the twin runs).
FP8_GPU_SHAPES = {
    **FP8_SHAPES,
    "many-groups-2600x256x128": (2600, 256, 128, [2, 0, 1, 3] * 325),
    "gpt-oss-200x2880x2880": (200, 2880, 2880, [64, 0, 100, 36]),
    "clipped-past-rows-300x384x256": (300, 384, 256, [100, 150, 2**30, 7]),
    "aligned-1024x512x256": (1024, 512, 256, [256, 512, 128, 128]),
}


def _fp8_operands(rows, k, n, sizes, seed=0, *, transposed=True, layout="row"):
    """(x, w) quantized as the expert layer quantizes them, the sizes, and float64 oracles of
    the dequantized operands built from the row-layout scales with numpy alone."""
    rng = np.random.default_rng(seed)
    # Rows and experts of different magnitudes: the scales, not one range, carry them.
    x = rng.standard_normal((rows, k)) * np.exp(rng.uniform(-4, 4, (rows, 1)))
    w = rng.standard_normal((len(sizes), k, n)) * np.exp(rng.uniform(-2, 2, (len(sizes), 1, 1)))
    x, w = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    xq = jaxops.fp8.quantize(x, block=(1, 128), scale_layout=layout)
    pair = jaxops.fp8.quantize(w, block=(128, 128), transpose=True, scale_layout=layout)
    wq = pair[1] if transposed else pair[0]
    x_row = jaxops.fp8.quantize(x, block=(1, 128))
    w_row = jaxops.fp8.quantize(w, block=(128, 128))
    x64 = np.asarray(x_row.data, np.float64) * np.repeat(np.asarray(x_row.scale), 128, 1)[:, :k]
    tiles = np.repeat(np.repeat(np.asarray(w_row.scale), 128, 1), 128, 2)[:, :k, :n]
    w64 = np.asarray(w_row.data, np.float64) * tiles
    return xq, wq, jnp.asarray(sizes, jnp.int32), x64, w64


def _fp8_oracle(x64, w64, sizes):
    y = np.zeros((x64.shape[0], w64.shape[2]))
    for g, (b, e) in enumerate(_rows(sizes, x64.shape[0])):
        y[b:e] = x64[b:e] @ w64[g]
    return y


@pytest.mark.parametrize("layout", ["row", "col_tma"])
@pytest.mark.parametrize("transposed", [True, False], ids=["w-k-major", "w-n-major"])
@pytest.mark.parametrize("shape", list(FP8_SHAPES), ids=list(FP8_SHAPES))
def test_fp8_twin_matches_float64(shape, transposed, layout):
    rows, k, n, sizes = FP8_SHAPES[shape]
    xq, wq, gs, x64, w64 = _fp8_operands(rows, k, n, sizes, transposed=transposed, layout=layout)
    y = jax.jit(gg.grouped_gemm_fp8)(xq, wq, gs)
    _close(y, _fp8_oracle(x64, w64, sizes))
    assert not np.asarray(y)[_rows(sizes, rows)[-1][1] :].any()
    np.testing.assert_array_equal(y, gg.grouped_gemm_fp8_reference(xq, wq, gs))


def test_fp8_input_gradient_operand_is_w_data_marked_transposed():
    """dx = dy @ w[g]ᵀ takes w's own quantized data [G, K, N] marked transposed: logically
    [G, N, K], K-major for that product, no copy."""
    dy, _, gs, dy64, _ = _fp8_operands(40, 256, 128, [15, 25])  # dy [R, N] with N = 256
    _, wq, _, _, w64 = _fp8_operands(40, 128, 256, [15, 25], seed=1, transposed=False)
    w_t = dataclasses.replace(wq, transposed=True)
    assert w_t.shape == (2, 256, 128)
    _close(gg.grouped_gemm_fp8(dy, w_t, gs), _fp8_oracle(dy64, np.swapaxes(w64, 1, 2), [15, 25]))


_PACK_ROWS, _PACK_BLOCKS = 37, 3
_pack = jax.jit(gg.group_packed_scales)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(-6, 25), min_size=5, max_size=5))
def test_group_packed_scales_are_cutlass_grouped_layout(sizes):
    """Row scales laid out as CUTLASS's grouped blockwise kernel reads them (each group one
    packed M-major matrix from its first row's place): a permutation of the scales."""
    scale = np.arange(_PACK_ROWS * _PACK_BLOCKS, dtype=np.float32).reshape(_PACK_ROWS, -1)
    spans = _rows(sizes, _PACK_ROWS)
    clipped = jnp.asarray([e - b for b, e in spans], jnp.int32)
    got = np.asarray(_pack(jnp.asarray(scale), clipped))
    assert sorted(got) == sorted(scale.ravel())
    for b, e in spans:
        for i in range(e - b):
            for block in range(_PACK_BLOCKS):
                assert got[b * _PACK_BLOCKS + block * (e - b) + i] == scale[b + i, block]


def test_fp8_bad_input_is_named_at_trace_time():
    xq, wq, gs, _, _ = _fp8_operands(8, 128, 16, [4, 4])
    with pytest.raises(TypeError, match=r"grouped_gemm_fp8: x must be a jaxops.fp8.Quantized"):
        gg.grouped_gemm_fp8(xq.dequantize(), wq, gs)
    with pytest.raises(ValueError, match=r"grouped_gemm_fp8: w must be 3-D, quantized in 128 x"):
        gg.grouped_gemm_fp8(xq, jaxops.fp8.quantize(jnp.ones((2, 16, 128))), gs)
    with pytest.raises(ValueError, match=r"grouped_gemm_fp8: x must be 2-D, quantized in 1 x 128"):
        gg.grouped_gemm_fp8(wq, wq, gs)
    with pytest.raises(ValueError, match=r"w must be logically \[G, K, N\] with K = .* 128"):
        gg.grouped_gemm_fp8(xq, dataclasses.replace(wq, transposed=False), gs)
    with pytest.raises(ValueError, match=r"x must hold its own data"):
        gg.grouped_gemm_fp8(dataclasses.replace(xq, transposed=True), wq, gs)
    with pytest.raises(ValueError, match=r"grouped_gemm_fp8: group_sizes must be int32 \[2\]"):
        gg.grouped_gemm_fp8(xq, wq, gs[:1])
    with pytest.raises(ValueError, match=r"grouped_gemm_fp8: impl='ffi' requires a custom call"):
        gg.grouped_gemm_fp8(xq, wq, gs, impl="ffi")  # no GPU here, or not opted in


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(FP8_GPU_SHAPES), ids=list(FP8_GPU_SHAPES))
def test_gpu_fp8_cutlass_kernel_matches_float64(shape, monkeypatch):
    """CUTLASS's block-scaled FP8 grouped GEMM against float64: both layouts of w and of the
    scales, the rows past the groups zero (or, zero_tail=False, the groups' rows the same)."""
    _require_cutlass()
    monkeypatch.setenv("JAXOPS_GPU_GROUPED_GEMM", "cutlass")
    assert gg.fp8_kernel_available("gpu")
    gpu = jax.devices("gpu")[0]
    rows, k, n, sizes = FP8_GPU_SHAPES[shape]
    spans = _rows(sizes, rows)
    takes = rows > 0 and k % 16 == 0 and n % 16 == 0
    for transposed, layout in [(True, "row"), (False, "col_tma")]:
        *operands, x64, w64 = _fp8_operands(rows, k, n, sizes, transposed=transposed, layout=layout)
        xq, wq, gs = jax.device_put(operands, gpu)
        text = jax.jit(gg.grouped_gemm_fp8).lower(xq, wq, gs).as_text()
        assert (f"@{gg.TARGET_GROUPED_GEMM_FP8_CUTLASS}(" in text) == takes
        y = jax.jit(gg.grouped_gemm_fp8)(xq, wq, gs)
        assert y.devices() == {gpu}
        _close(y, _fp8_oracle(x64, w64, sizes))
        assert not np.asarray(y)[spans[-1][1] :].any()
        open_tail = jax.jit(lambda x, w, s: gg.grouped_gemm_fp8(x, w, s, zero_tail=False))
        np.testing.assert_array_equal(
            np.asarray(open_tail(xq, wq, gs))[: spans[-1][1]], np.asarray(y)[: spans[-1][1]]
        )


# The weight gradient from per-expert split transposes (rows, K, N, group sizes): 128-token
# blocks crossed and partial, an empty expert, sizes past the rows (clamped), one row.
FP8_WGRAD_SHAPES = {
    "blocks-420x256x128": (420, 256, 128, [200, 0, 57, 130]),
    "clipped-90x128x64": (90, 128, 64, [40, -3, 70]),
    "one-row": (1, 16, 32, [1]),
}
FP8_WGRAD_GPU_SHAPES = {
    **FP8_WGRAD_SHAPES,
    "many-experts-3000x256x128": (3000, 256, 128, [5, 0, 11, 2] * 150),
    "gpt-oss-600x2880x2880": (600, 2880, 2880, [300, 0, 129, 171]),
    "long-expert-4100x512x256": (4100, 512, 256, [4000, 100]),
}


def _split64(q) -> list[np.ndarray]:
    """Each expert's dequantized transpose [K, m_e], float64, from the split's own layout."""
    data, scale = np.asarray(q.data, np.float64), np.asarray(q.scale, np.float64)
    cols, scols, sizes = (np.asarray(a) for a in (q.col_offsets, q.scale_offsets, q.sizes))
    out = []
    for c, sc, m in zip(cols[:-1], scols[:-1], sizes, strict=True):
        blocks = np.repeat(scale[:, sc : sc + -(-m // 128)], 128, axis=1)[:, :m]
        out.append(data[:, c : c + m] * blocks)
    return out


def _fp8_wgrad_operands(rows, k, n, sizes, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)) * np.exp(rng.uniform(-3, 3, (rows, 1)))
    dy = rng.standard_normal((rows, n)) * np.exp(rng.uniform(-8, 0, (rows, 1)))
    gs = jnp.asarray(sizes, jnp.int32)
    xs = jaxops.fp8.quantize_split_transpose(jnp.asarray(x, jnp.float32), gs)
    dys = jaxops.fp8.quantize_split_transpose(jnp.asarray(dy, jnp.float32), gs, amax_floor=1e-30)
    want = np.stack([a @ b.T for a, b in zip(_split64(xs), _split64(dys), strict=True)])
    return xs, dys, want


@pytest.mark.parametrize("shape", list(FP8_WGRAD_SHAPES), ids=list(FP8_WGRAD_SHAPES))
def test_fp8_wgrad_twin_matches_float64(shape):
    xs, dys, want = _fp8_wgrad_operands(*FP8_WGRAD_SHAPES[shape])
    dw = jax.jit(gg.grouped_gemm_fp8_wgrad)(xs, dys)
    _close(dw, want)
    np.testing.assert_array_equal(dw, gg.grouped_gemm_fp8_wgrad_reference(xs, dys))


def test_fp8_wgrad_bad_input_is_named_at_trace_time():
    xs, dys, _ = _fp8_wgrad_operands(40, 16, 32, [20, 20])
    with pytest.raises(TypeError, match=r"grouped_gemm_fp8_wgrad: xs must be a jaxops.fp8.Split"):
        gg.grouped_gemm_fp8_wgrad(xs.dequantize(), dys)
    other = jaxops.fp8.quantize_split_transpose(jnp.ones((40, 32)), jnp.asarray([40], jnp.int32))
    with pytest.raises(ValueError, match=r"xs and dys must split the same rows by the same groups"):
        gg.grouped_gemm_fp8_wgrad(xs, other)
    small = jaxops.fp8.quantize_split_transpose(
        jnp.ones((40, 32)), jnp.asarray([20, 20], jnp.int32), block=64
    )
    with pytest.raises(ValueError, match=r"dys must be quantized in groups of 128 tokens, got 64"):
        gg.grouped_gemm_fp8_wgrad(xs, small)
    with pytest.raises(ValueError, match=r"grouped_gemm_fp8_wgrad: impl='ffi' requires"):
        gg.grouped_gemm_fp8_wgrad(xs, dys, impl="ffi")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(FP8_WGRAD_GPU_SHAPES), ids=list(FP8_WGRAD_GPU_SHAPES))
def test_gpu_fp8_wgrad_cutlass_kernel_matches_float64(shape, monkeypatch):
    """CUTLASS's FP8 weight gradient against float64; experts without rows exactly zero."""
    _require_cutlass()
    monkeypatch.setenv("JAXOPS_GPU_GROUPED_GEMM", "cutlass")
    rows, k, n, sizes = FP8_WGRAD_GPU_SHAPES[shape]
    xs, dys, want = _fp8_wgrad_operands(rows, k, n, sizes)
    xs, dys = jax.device_put((xs, dys), jax.devices("gpu")[0])
    text = jax.jit(gg.grouped_gemm_fp8_wgrad).lower(xs, dys).as_text()
    assert (f"@{gg.TARGET_WGRAD_FP8_CUTLASS}(" in text) == (k % 16 == 0 and n % 16 == 0)
    dw = jax.jit(gg.grouped_gemm_fp8_wgrad)(xs, dys)
    _close(dw, want)
    empty = [g for g, (b, e) in enumerate(_rows(sizes, rows)) if b == e]
    assert not np.asarray(dw)[empty].any()
