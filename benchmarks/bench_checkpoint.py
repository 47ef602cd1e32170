"""Checkpoint benchmark: jaxops.parallel.checkpoint save / restore vs numpy, a cold read and Orbax.

The tree: four arrays, two float32 and two bfloat16, 1 GiB in all (``--size-mib``), sharded on a
``data x model = 2 x 4`` mesh of the 8 CPU devices. Values are standard-normal like trained
weights (zstd saves about 16% of them), or uniform random bits with ``--data bits`` (nothing to
compress: zstd gives up early, which makes Orbax's default save faster). Restores go into the
same arrays resharded on a ``4 x 2`` mesh (other block grids, one array sharded along its
trailing axis only, two partially replicated). Measured, every case ``--repeats`` times in
rounds (one sample of each case per round, the order rotated each round), medians:

- ``numpy``: the baseline. Save: each array's host copy written with ``ndarray.tofile`` to its own
  file, then ``os.fsync``. Restore: a cold ``np.fromfile`` of the same files (whole arrays, no
  resharding, nothing verified).
- ``jaxops``: ``checkpoint.save`` (returns when committed: files and directory fsynced) and
  ``checkpoint.restore`` into the resharded target (``block_until_ready``; reads only
  overlapping byte ranges, checks every CRC).
- ``orbax default``: ``ocp.StandardCheckpointer()`` (OCDBT + zstd): ``save`` +
  ``wait_until_finished``, ``restore`` into the resharded abstract tree.
- ``orbax uncompressed``: ``ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))``
  (OCDBT, no zstd; ``StandardCheckpointHandler`` has no compression switch in orbax 0.12.8),
  ``PyTreeSave`` / ``PyTreeRestore`` with ``construct_restore_args``.
- Async saves, the time the caller is blocked: ``CheckpointManager(async_save=True).save`` until
  it returns, against the device-to-host copy alone (``np.array(copy=True)`` of every distinct
  shard, the least an async save that lets the caller donate its arrays must do), and Orbax's
  ``StandardCheckpointer.save`` (an ``AsyncCheckpointer`` over ``StandardCheckpointHandler``)
  until it returns; "until committed" is until the checkpoint is complete. On CPU devices Orbax
  does not copy the arrays before returning.

Orbax is optional (the ``bench`` extra); without it its rows and goals are skipped. Every restore
(ours, Orbax's, the baseline's) is checked bit for bit against the source arrays once, before the
timed rounds. Between samples the previous checkpoint is deleted and ``os.sync()`` called, since
save timings swing widely while older checkpoints sit in the page cache. Reads are made cold the
same way for every reader: ``sync; echo 3 > /proc/sys/vm/drop_caches`` when that is writable
(root), otherwise ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file of the checkpoint (clean
pages only, no root needed); ``--cold`` picks. Before every timed step 3x the tree's bytes of
fresh memory are touched and freed (``--prefault-mib``): on a virtual machine that hands freed
memory back to its host, page cache and new buffers otherwise cost a host fault per page, several
times the copy itself, depending on how long the memory sat free. GB/s are 1e9 bytes of array
data per second; "on disk" is the size of the files one save wrote.

Goals: save >= 0.9x numpy tofile+fsync; restore with resharding >= 0.8x the cold read; save >= 5x
Orbax's default save; restore >= 2x Orbax's default restore; the async save blocks no longer
than the device-to-host copy (tolerance: <= 1.1x the copy + 5 ms).

Usage: ``python benchmarks/bench_checkpoint.py`` from the repository root, ``--quick`` for 32 MiB
and 2 rounds, ``--no-orbax`` without the Orbax cases, ``--out benchmarks/results/cpu`` to save the
tables.
"""

from __future__ import annotations

import importlib
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxops.parallel import checkpoint

# The harness next to this script (also under ``python -m benchmarks.<script>``).
H = importlib.import_module(f"{__package__}._harness" if __package__ else "_harness")

try:
    import orbax.checkpoint as ocp
except ImportError as _e:  # optional: the `bench` extra
    ocp = None
    _ORBAX_ERROR = f"{type(_e).__name__}: {_e}"
else:
    _ORBAX_ERROR = None

P = jax.P
# name, dtype, spec on the (2, 4) save mesh, spec on the (4, 2) restore mesh
ARRAYS = [
    ("f32_a", "float32", P("data", "model"), P("data", "model")),
    ("f32_b", "float32", P("model", "data"), P(None, "data")),
    ("bf16_a", "bfloat16", P(("data", "model"), None), P("data", None)),
    ("bf16_b", "bfloat16", P(None, ("data", "model")), P("data", "model")),
]
SAVE_MESH = (2, 4)
RESTORE_MESH = (4, 2)

GOAL_SAVE_VS_TOFILE = 0.9
GOAL_RESTORE_VS_COLD = 0.8
GOAL_SAVE_VS_ORBAX = 5.0
GOAL_RESTORE_VS_ORBAX = 2.0
ASYNC_TOLERANCE = 1.1  # async block <= ASYNC_TOLERANCE * D2H copy + ASYNC_SLACK_S
ASYNC_SLACK_S = 0.005

COLUMNS = [
    H.Column("method", "method", align="<"),
    H.Column("disk_mib", "on disk MiB", "{:.0f}"),
    H.Column("save_s", "save s", "{:.3f}"),
    H.Column("save_gbps", "save GB/s", "{:.2f}"),
    H.Column("restore_s", "restore s", "{:.3f}"),
    H.Column("restore_gbps", "restore GB/s", "{:.2f}"),
    H.Column("save_vs_numpy", "save / tofile", "{:.2f}x"),
    H.Column("restore_vs_numpy", "restore / cold read", "{:.2f}x"),
    H.Column("jaxops_save_x", "jaxops save / this", "{:.2f}x"),
    H.Column("jaxops_restore_x", "jaxops restore / this", "{:.2f}x"),
]
ASYNC_COLUMNS = [
    H.Column("method", "async save", align="<"),
    H.Column("block_ms", "caller blocked ms", "{:.1f}"),
    H.Column("block_vs_d2h", "blocked / D2H copy", "{:.2f}x"),
    H.Column("total_s", "until committed s", "{:.3f}"),
]


# -------------------------------------------------------------------------------------------------
# Cold reads and clean disks.


def evict(path: str | os.PathLike[str]) -> None:
    """Drops the clean page-cache pages of every file under `path` (``POSIX_FADV_DONTNEED``)."""
    root = Path(path)
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_DROP_CACHES = "/proc/sys/vm/drop_caches"


def _drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False if not allowed."""
    os.sync()
    try:
        with open(_DROP_CACHES, "w", encoding="ascii") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def _cold_method(choice: str) -> str:
    if choice in ("auto", "drop") and _drop_caches():
        return "drop_caches"
    if choice == "drop":
        raise SystemExit(f"--cold drop: cannot write {_DROP_CACHES} (needs root)")
    return "fadvise"


def _make_cold(method: str, path: str | os.PathLike[str]) -> None:
    """Makes the next read of `path` cold: flush, then drop its pages from the page cache."""
    os.sync()
    evict(path)
    if method == "drop_caches":
        _drop_caches()


def _prefault(nbytes: int) -> None:
    """Touches then frees `nbytes` of fresh memory, so the next timed step finds it backed.

    On a virtual machine that hands freed guest memory back to its host (free page reporting,
    ballooning), memory untouched for a few seconds costs a host fault per page again: a 1 GiB
    copy into fresh memory took 0.19 s right after a free and 1.4-2.3 s after a few idle seconds
    on the machine these numbers come from. Every timed step (page cache, host copies, restored
    arrays) is preceded by this, for every method alike.
    """
    if nbytes > 0:
        buf = np.ones(nbytes, np.uint8)
        del buf


def _disk_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes in the files under `path`."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _remove(path: str | os.PathLike[str]) -> None:
    """Deletes a checkpoint (directory or file) and flushes, so the next save starts clean."""
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
    os.sync()


# -------------------------------------------------------------------------------------------------
# The tree.


def _shape(elements: int) -> tuple[int, int]:
    """A near-square 2-D shape with power-of-two rows, both dims divisible by 8."""
    rows = 2 ** int(math.log2(math.isqrt(elements)))
    while elements % rows:
        rows //= 2
    shape = (rows, elements // rows)
    if any(d % 8 for d in shape):
        raise ValueError(f"cannot shard {elements} elements as a 2-D array over 8 devices")
    return shape


def _values(rng: np.random.Generator, dt: np.dtype, count: int, data: str) -> np.ndarray:
    """`count` values of dtype `dt`: normal like trained weights, or uniform random bits."""
    if data == "bits":
        return rng.integers(0, 2**32, size=count * dt.itemsize // 4, dtype=np.uint32).view(dt)
    return rng.standard_normal(count, dtype=np.float32).astype(dt, copy=False)


def _make_tree(size_mib: int, mesh: jax.sharding.Mesh, data: str, seed: int = 0):
    """(device tree, host copies, restore targets), ``size_mib`` MiB in all."""
    if size_mib % len(ARRAYS):
        raise ValueError(f"--size-mib must be a multiple of {len(ARRAYS)}")
    per = size_mib * 2**20 // len(ARRAYS)
    rmesh = jax.make_mesh(RESTORE_MESH, ("data", "model"))
    rng = np.random.default_rng(seed)
    tree, host, target = {}, {}, {}
    for name, dtype, spec, rspec in ARRAYS:
        dt = np.dtype(jnp.dtype(dtype))
        shape = _shape(per // dt.itemsize)
        arr = _values(rng, dt, per // dt.itemsize, data).reshape(shape)
        host[name] = arr
        tree[name] = jax.make_array_from_callback(
            shape, jax.NamedSharding(mesh, spec), lambda idx, a=arr: np.array(a[idx], copy=True)
        )
        target[name] = jax.ShapeDtypeStruct(shape, dt, sharding=jax.NamedSharding(rmesh, rspec))
    jax.block_until_ready(tree)
    return tree, host, target


def _nbytes(host: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in host.values())


def _bits(a: Any) -> np.ndarray:
    """The raw bits of an array (random bits hold NaNs: compare bits, not values)."""
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _check(what: str, restored: dict[str, Any], host: dict[str, np.ndarray], target=None) -> None:
    for name, want in host.items():
        got = restored[name]
        if target is not None and got.sharding != target[name].sharding:
            raise AssertionError(f"{what}: {name} restored as {got.sharding}")
        if not np.array_equal(_bits(got), _bits(want)):
            raise AssertionError(f"{what}: {name} differs from the saved array")


def _distinct_shards(tree: dict[str, jax.Array]) -> list[jax.Shard]:
    """One shard per distinct block of every array: what a save must copy to the host."""
    out = []
    for x in tree.values():
        seen = set()
        for s in x.addressable_shards:
            block = tuple((sl.start, sl.stop) for sl in s.index)
            if block not in seen:
                seen.add(block)
                out.append(s)
    return out


# -------------------------------------------------------------------------------------------------
# The cases. Each has save(path) -> (seconds blocked, seconds until durable) and
# restore(path) -> (seconds, restored tree).


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


class _Numpy:
    name = "numpy tofile+fsync / cold fromfile"

    def __init__(self, host):
        self.host = host

    def save(self, path: Path) -> tuple[float, float]:
        def run():
            path.mkdir()
            for name, arr in self.host.items():
                with open(path / f"{name}.bin", "wb") as f:
                    arr.tofile(f)
                    f.flush()
                    os.fsync(f.fileno())

        s, _ = _timed(run)
        return s, s

    def restore(self, path: Path) -> tuple[float, Any]:
        def run():
            return {
                name: np.fromfile(path / f"{name}.bin", arr.dtype).reshape(arr.shape)
                for name, arr in self.host.items()
            }

        return _timed(run)


class _Jaxops:
    name = "jaxops checkpoint"

    def __init__(self, tree, target):
        self.tree, self.target = tree, target

    def save(self, path: Path) -> tuple[float, float]:
        s, _ = _timed(lambda: checkpoint.save(path, self.tree, progress=False))
        return s, s

    def restore(self, path: Path) -> tuple[float, Any]:
        return _timed(
            lambda: jax.block_until_ready(checkpoint.restore(path, self.target, progress=False))
        )


class _OrbaxDefault:
    name = "orbax default (ocdbt+zstd)"

    def __init__(self, tree, target):
        self.tree, self.target = tree, target
        self.ckptr = ocp.StandardCheckpointer()

    def save(self, path: Path) -> tuple[float, float]:
        start = time.perf_counter()
        self.ckptr.save(path, self.tree)
        blocked = time.perf_counter() - start
        self.ckptr.wait_until_finished()
        return blocked, time.perf_counter() - start

    def restore(self, path: Path) -> tuple[float, Any]:
        return _timed(lambda: jax.block_until_ready(self.ckptr.restore(path, self.target)))

    def close(self) -> None:
        self.ckptr.close()


class _OrbaxUncompressed:
    name = "orbax uncompressed (ocdbt)"

    def __init__(self, tree, target):
        self.tree, self.target = tree, target
        self.ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
        self.restore_args = ocp.checkpoint_utils.construct_restore_args(target)

    def save(self, path: Path) -> tuple[float, float]:
        s, _ = _timed(lambda: self.ckptr.save(path, args=ocp.args.PyTreeSave(self.tree)))
        return s, s

    def restore(self, path: Path) -> tuple[float, Any]:
        args = ocp.args.PyTreeRestore(self.target, restore_args=self.restore_args)
        return _timed(lambda: jax.block_until_ready(self.ckptr.restore(path, args=args)))

    def close(self) -> None:
        self.ckptr.close()


class _JaxopsAsync:
    name = "jaxops CheckpointManager.save"

    def __init__(self, tree, directory: Path):
        self.tree = tree
        self.mgr = checkpoint.CheckpointManager(directory, async_save=True, progress=False)
        self.step = 0

    def save(self) -> tuple[float, float, Path]:
        step, self.step = self.step, self.step + 1
        start = time.perf_counter()
        self.mgr.save(step, self.tree)
        blocked = time.perf_counter() - start
        self.mgr.wait()
        return blocked, time.perf_counter() - start, self.mgr.step_path(step)

    def close(self) -> None:
        self.mgr.close()


def _d2h_copy(shards: list[jax.Shard]) -> float:
    s, copies = _timed(lambda: [np.array(sh.data, copy=True) for sh in shards])
    del copies
    return s


# -------------------------------------------------------------------------------------------------
# Running.


def run(args) -> H.Result:
    """Verifies then times every case in rounds; the rows, the async rows and the goals."""
    mesh = jax.make_mesh(SAVE_MESH, ("data", "model"))
    t0 = time.perf_counter()
    tree, host, target = _make_tree(args.size_mib, mesh, args.data)
    nbytes = _nbytes(host)
    print(
        f"tree: {', '.join(f'{k} {v.dtype}{list(v.shape)}' for k, v in host.items())}: "
        f"{nbytes / 2**20:.0f} MiB ({time.perf_counter() - t0:.1f} s to make)",
        file=sys.stderr,
    )
    work = Path(tempfile.mkdtemp(prefix="jaxops-bench-checkpoint-", dir=args.dir))
    cases: list[Any] = [_Numpy(host), _Jaxops(tree, target)]
    if ocp is not None and not args.no_orbax:
        cases += [_OrbaxDefault(tree, target), _OrbaxUncompressed(tree, target)]
    async_case = _JaxopsAsync(tree, work / "manager")
    shards = _distinct_shards(tree)
    save_s = {c.name: [] for c in cases}
    blocked_s = {c.name: [] for c in cases}
    restore_s = {c.name: [] for c in cases}
    async_s: dict[str, list[float]] = {"d2h": [], "block": [], "total": []}
    disk: dict[str, int] = {}
    touch = args.prefault_mib * 2**20 if args.prefault_mib is not None else 3 * nbytes
    try:
        # Correctness (and warm-up) once: every restore equals the source, bit for bit.
        for i, case in enumerate(cases):
            path = work / f"check_{i}"
            case.save(path)
            _make_cold(args.cold_method, path)
            disk[case.name] = _disk_bytes(path)
            _, out = case.restore(path)
            _check(case.name, out, host, None if isinstance(case, _Numpy) else target)
            del out
            _remove(path)
        _, _, path = async_case.save()
        _check(async_case.name, checkpoint.restore(path, target, progress=False), host, target)
        _remove(path)
        _d2h_copy(shards)
        print(f"restores verified ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)

        for r in range(args.repeats):
            # Rotated each round, so no case always runs right after the same other one.
            for i, case in enumerate(cases[r % len(cases) :] + cases[: r % len(cases)]):
                path = work / f"run_{r}_{i}"
                _prefault(touch)
                blocked, durable = case.save(path)
                save_s[case.name].append(durable)
                blocked_s[case.name].append(blocked)
                _make_cold(args.cold_method, path)
                _prefault(touch)
                seconds, out = case.restore(path)
                restore_s[case.name].append(seconds)
                del out
                _remove(path)
            for step in ("d2h", "async") if r % 2 == 0 else ("async", "d2h"):
                _prefault(touch)
                if step == "d2h":
                    async_s["d2h"].append(_d2h_copy(shards))
                    continue
                blocked, total, path = async_case.save()
                async_s["block"].append(blocked)
                async_s["total"].append(total)
                _remove(path)
            print(
                f"round {r + 1}/{args.repeats} done ({time.perf_counter() - t0:.1f} s)",
                file=sys.stderr,
            )
    finally:
        for case in cases:
            close = getattr(case, "close", None)
            if close is not None:
                close()
        async_case.close()
        shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    rows = []
    for case in cases:
        s, rs = med(save_s[case.name]), med(restore_s[case.name])
        rows.append(
            {
                "method": case.name,
                "save_s": s,
                "save_gbps": H.gbps(nbytes, s),
                "restore_s": rs,
                "restore_gbps": H.gbps(nbytes, rs),
                "disk_mib": disk[case.name] / 2**20,
                "save_samples_s": save_s[case.name],
                "save_blocked_samples_s": blocked_s[case.name],
                "restore_samples_s": restore_s[case.name],
            }
        )
    by = {r["method"]: r for r in rows}
    base, ours = by[_Numpy.name], by[_Jaxops.name]
    for row in rows:
        row["save_vs_numpy"] = base["save_s"] / row["save_s"]
        row["restore_vs_numpy"] = base["restore_s"] / row["restore_s"]
        row["jaxops_save_x"] = row["save_s"] / ours["save_s"]
        row["jaxops_restore_x"] = row["restore_s"] / ours["restore_s"]

    d2h = med(async_s["d2h"])
    async_rows = [
        {"method": "device-to-host copy of every distinct shard", "block_ms": 1e3 * d2h},
        {
            "method": "jaxops CheckpointManager(async_save=True).save",
            "block_ms": 1e3 * med(async_s["block"]),
            "total_s": med(async_s["total"]),
        },
    ]
    if _OrbaxDefault.name in by:
        async_rows.append(
            {
                "method": "orbax StandardCheckpointer.save (async)",
                "block_ms": 1e3 * med(blocked_s[_OrbaxDefault.name]),
                "total_s": by[_OrbaxDefault.name]["save_s"],
            }
        )
    for row in async_rows:
        row["block_vs_d2h"] = row["block_ms"] / (1e3 * d2h)
    async_rows[0]["samples_s"] = async_s["d2h"]
    async_rows[1]["samples_s"] = async_s["block"]
    async_rows[1]["total_samples_s"] = async_s["total"]

    info = {
        "nbytes": nbytes,
        "arrays": {k: f"{v.dtype}{list(v.shape)}" for k, v in host.items()},
        "prefault_bytes": touch,
    }
    return H.Result(
        rows,
        COLUMNS,
        _goals(by, async_rows, d2h),
        tables=[H.Table("async", async_rows, ASYNC_COLUMNS)],
        lines=[_setup_line(args, info)],
        extra={"tree": info, "orbax": getattr(ocp, "__version__", None)},
    )


def _setup_line(args, info: dict[str, Any]) -> str:
    arrays = ", ".join(f"{k} {v}" for k, v in info["arrays"].items())
    return (
        f"{info['nbytes'] / 2**20:.0f} MiB ({arrays}), saved on a "
        f"{SAVE_MESH[0]}x{SAVE_MESH[1]} mesh, restored onto {RESTORE_MESH[0]}x"
        f"{RESTORE_MESH[1]}; {args.data} values; medians of {args.repeats}; cold reads by "
        f"{args.cold_method}; {info['prefault_bytes'] / 2**20:.0f} MiB of memory touched before "
        "every timed step"
    )


def _goals(by: dict[str, dict[str, Any]], async_rows, d2h: float) -> list[H.Goal]:
    base, ours = by[_Numpy.name], by[_Jaxops.name]
    save_x = ours["save_vs_numpy"]
    restore_x = ours["restore_vs_numpy"]
    goals = [
        H.Goal(
            f"jaxops save >= {GOAL_SAVE_VS_TOFILE}x numpy tofile+fsync",
            f"{ours['save_gbps']:.2f} / {base['save_gbps']:.2f} GB/s = {save_x:.2f}x",
            save_x >= GOAL_SAVE_VS_TOFILE,
        ),
        H.Goal(
            f"jaxops restore with resharding >= {GOAL_RESTORE_VS_COLD}x a cold read",
            f"{ours['restore_gbps']:.2f} / {base['restore_gbps']:.2f} GB/s = {restore_x:.2f}x",
            restore_x >= GOAL_RESTORE_VS_COLD,
        ),
    ]
    default, unc = by.get(_OrbaxDefault.name), by.get(_OrbaxUncompressed.name)
    if default is None:
        why = _ORBAX_ERROR or "skipped (--no-orbax)"
        goals += [
            H.Goal(f"jaxops save >= {GOAL_SAVE_VS_ORBAX}x orbax default save", why, None),
            H.Goal(f"jaxops restore >= {GOAL_RESTORE_VS_ORBAX}x orbax restore", why, None),
        ]
    else:
        unc_save = f"; uncompressed {unc['jaxops_save_x']:.2f}x" if unc else ""
        unc_restore = f"; uncompressed {unc['jaxops_restore_x']:.2f}x" if unc else ""
        goals += [
            H.Goal(
                f"jaxops save >= {GOAL_SAVE_VS_ORBAX}x orbax default save",
                f"{ours['save_gbps']:.2f} / {default['save_gbps']:.2f} GB/s = "
                f"{default['jaxops_save_x']:.2f}x{unc_save}",
                default["jaxops_save_x"] >= GOAL_SAVE_VS_ORBAX,
            ),
            H.Goal(
                f"jaxops restore >= {GOAL_RESTORE_VS_ORBAX}x orbax default restore",
                f"{ours['restore_gbps']:.2f} / {default['restore_gbps']:.2f} GB/s = "
                f"{default['jaxops_restore_x']:.2f}x{unc_restore}",
                default["jaxops_restore_x"] >= GOAL_RESTORE_VS_ORBAX,
            ),
        ]
    block = async_rows[1]["block_ms"] / 1e3
    limit = ASYNC_TOLERANCE * d2h + ASYNC_SLACK_S
    goals.append(
        H.Goal(
            f"async save blocks <= the device-to-host copy (tolerance {ASYNC_TOLERANCE}x + "
            f"{ASYNC_SLACK_S * 1e3:.0f} ms)",
            f"{block * 1e3:.1f} ms vs copy {d2h * 1e3:.1f} ms (limit {limit * 1e3:.1f} ms)",
            block <= limit,
        )
    )
    return goals


def parse_args(argv: Sequence[str] | None = None):
    """Command-line options: the common ones (:func:`_harness.parser`) and the tree and reads."""
    p = H.parser(__doc__, name="checkpoint", repeats=5, quick="32 MiB, 2 repeats", quick_repeats=2)
    p.add_argument("--size-mib", type=int, default=1024, help="MiB of array data in the tree")
    p.add_argument(
        "--cold",
        default="auto",
        choices=["auto", "drop", "fadvise"],
        help="how reads are made cold: drop_caches (root), fadvise, or auto (drop if allowed)",
    )
    p.add_argument(
        "--data",
        default="normal",
        choices=["normal", "bits"],
        help="array contents: normal values (like weights) or uniform random bits",
    )
    p.add_argument(
        "--prefault-mib",
        type=int,
        default=None,
        help="fresh memory touched before every timed step (default: 3x the tree; 0: none)",
    )
    p.add_argument("--dir", default=None, help="parent of the work directory (default: TMPDIR)")
    p.add_argument("--no-orbax", action="store_true", help="skip the Orbax cases")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib = min(args.size_mib, 32)
    args.cold_method = _cold_method(args.cold)
    if ocp is None:
        print(
            f"note: orbax not importable ({_ORBAX_ERROR}); its cases are skipped", file=sys.stderr
        )
    return args


def _header(args) -> str:
    orbax = getattr(ocp, "__version__", None) or "not installed"
    return f"orbax {orbax}; cold reads by {args.cold_method}"


if __name__ == "__main__":
    sys.exit(H.main(parse_args, run, cpu_devices=8, header=_header))
