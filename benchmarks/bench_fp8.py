"""FP8 quantization benchmark: the jaxops custom calls against their pure-JAX twins.

For every block mode (per-tensor, 1x128, 128x128, with and without the fused transpose, and the
per-expert split transpose), shape and dtype, both implementations run under ``jax.jit`` on the
same input in one process; their outputs are checked to be bit-identical before anything is timed.
Reported per row: median times, the bandwidth each achieves on the bytes the op must minimally
move (read x once, write every output once), the speed-up ``xla / ffi`` and the fraction of the
device's copy bandwidth. The last lines check the project's goals: on CPU ``xla/ffi >= 1.5`` on
every row (``>= 1.2`` with ``--busy``, one core kept busy by a second process) and on the
4096x7168 and 16384x7168 bfloat16 rows; on a GPU ``>= 1.5`` and ``>= 2.7 TB/s`` on the latter.

Usage (from the repository root)::

    python benchmarks/bench_fp8.py                 # 4096x1024 ... 16384x7168, bf16 and f32
    python benchmarks/bench_fp8.py --quick         # smoke test, well under a minute on 2 cores
    python benchmarks/bench_fp8.py --out benchmarks/results/cpu
    python benchmarks/bench_fp8.py --busy --name fp8_busy --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxops
from jaxops import fp8

if __package__:
    from . import _harness as H
else:
    import _harness as H

SHAPES = "4096x1024,8192x1024,4096x7168,16384x7168"
QUICK_SHAPES = "512x1024"
GOAL_SHAPES = ("4096x7168", "16384x7168")
MODES = {
    "tensor": {"block": None, "transpose": False},
    "tensor+T": {"block": None, "transpose": True},
    "1x128": {"block": (1, 128), "transpose": False},
    "1x128+T": {"block": (1, 128), "transpose": True},
    "128x128": {"block": (128, 128), "transpose": False},
    "128x128+T": {"block": (128, 128), "transpose": True},
    "split-T": None,  # quantize_split_transpose over 8 uneven experts
}
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
CPU_GOAL_RATIO = 1.5
CPU_BUSY_GOAL_RATIO = 1.2  # every row, with --busy
GPU_GOAL_RATIO = 1.5
GPU_GOAL_GBPS = 2700.0

COLUMNS = [
    H.Column("mode", "mode", align="<"),
    H.Column("dtype", "dtype", align="<"),
    H.Column("shape", "shape", align="<"),
    H.Column("ffi_ms", "ffi ms", "{:.3f}"),
    H.Column("xla_ms", "xla ms", "{:.3f}"),
    H.Column("ffi_gbps", "ffi GB/s", "{:.1f}"),
    H.Column("xla_gbps", "xla GB/s", "{:.1f}"),
    H.Column("speedup", "xla/ffi", "{:.2f}x"),
    H.Column("ffi_copy_frac", "ffi %copy", lambda v: f"{100 * v:.1f}%"),
]


def _sizes(m: int) -> np.ndarray:
    """8 uneven expert sizes summing to m (one empty expert)."""
    weights = np.array([5, 1, 0, 9, 3, 7, 2, 4], np.float64)
    sizes = np.floor(weights / weights.sum() * m).astype(np.int32)
    sizes[0] += m - sizes.sum()
    return sizes


def _fn(mode: str, impl: str):
    if MODES[mode] is None:
        return jax.jit(
            lambda x, gs: jax.tree_util.tree_leaves(fp8.quantize_split_transpose(x, gs, impl=impl))
        )
    kwargs = MODES[mode]
    return jax.jit(lambda x: jax.tree_util.tree_leaves(fp8.quantize(x, impl=impl, **kwargs)))


def _bytes(outs: Sequence[jax.Array], x: jax.Array) -> int:
    return int(x.nbytes) + sum(int(o.nbytes) for o in outs)


def run(args) -> tuple[list[dict[str, Any]], H.CopyBandwidth, list[H.Goal]]:
    copy = H.copy_bandwidth()
    gpu = H.is_gpu()
    rows = []
    for shape_text in args.shape_list:
        shape = tuple(int(v) for v in shape_text.split("x"))
        for dtype_name in args.dtype_list:
            x = jax.random.normal(jax.random.key(0), shape, DTYPES[dtype_name]) * 3
            for mode in args.mode_list:
                operands = (x,) if MODES[mode] is not None else (x, jnp.asarray(_sizes(shape[0])))
                fns = {impl: _fn(mode, impl) for impl in ("ffi", "xla")}
                outs = {impl: jax.block_until_ready(fn(*operands)) for impl, fn in fns.items()}
                for a, b in zip(outs["ffi"], outs["xla"], strict=True):
                    a8, b8 = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
                    if not np.array_equal(a8.view(np.uint8), b8.view(np.uint8)):
                        raise AssertionError(f"{mode} {shape_text}: ffi and xla results differ")
                timings = H.time_interleaved(
                    {impl: (fn, operands) for impl, fn in fns.items()}, repeats=args.repeats
                )
                nbytes = _bytes(outs["ffi"], x)
                ffi_s, xla_s = timings["ffi"].median, timings["xla"].median
                rows.append(
                    {
                        "mode": mode,
                        "dtype": dtype_name,
                        "shape": shape_text,
                        "bytes": nbytes,
                        "ffi_ms": 1e3 * ffi_s,
                        "xla_ms": 1e3 * xla_s,
                        "ffi_gbps": H.gbps(nbytes, ffi_s),
                        "xla_gbps": H.gbps(nbytes, xla_s),
                        "speedup": xla_s / ffi_s,
                        "ffi_copy_frac": H.gbps(nbytes, ffi_s) / copy.gbps,
                        "timings": {k: t.to_json() for k, t in timings.items()},
                    }
                )
                print(H.format_table(rows[-1:], COLUMNS).splitlines()[-1], file=sys.stderr)
    goal_rows = [r for r in rows if r["shape"] in GOAL_SHAPES and r["dtype"] == "bfloat16"]
    goals = []
    if not gpu:
        goals.append(
            H.ratio_goal(
                rows,
                CPU_BUSY_GOAL_RATIO if args.busy else CPU_GOAL_RATIO,
                lambda r: f"{r['mode']} {r['dtype']} {r['shape']}",
                "mode, dtype and shape" + (" with one core busy" if args.busy else ""),
            )
        )
        if args.busy:
            return rows, copy, goals
    if not goal_rows:
        goals.append(H.Goal("xla/ffi on the goal shapes", "goal shapes not run", None))
    else:
        worst = min(goal_rows, key=lambda r: r["speedup"])
        ratio = GPU_GOAL_RATIO if gpu else CPU_GOAL_RATIO
        goals.append(
            H.Goal(
                f"xla/ffi >= {ratio} on {'/'.join(GOAL_SHAPES)} bf16 (every mode)",
                f"worst {worst['speedup']:.2f}x ({worst['mode']} {worst['shape']})",
                worst["speedup"] >= ratio,
            )
        )
        if gpu:
            slow = min(goal_rows, key=lambda r: r["ffi_gbps"])
            goals.append(
                H.Goal(
                    f"ffi >= {GPU_GOAL_GBPS:.0f} GB/s on the goal shapes",
                    f"worst {slow['ffi_gbps']:.0f} GB/s ({slow['mode']} {slow['shape']})",
                    slow["ffi_gbps"] >= GPU_GOAL_GBPS,
                )
            )
    return rows, copy, goals


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None, help=f"comma-separated MxK (default {SHAPES})")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated x dtypes")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, 3 repeats")
    p.add_argument("--out", default=None, help="directory for fp8.md / fp8.json")
    p.add_argument("--name", default="fp8")
    H.add_busy_argument(p)
    args = p.parse_args(argv)
    if args.quick:
        args.shapes = args.shapes or QUICK_SHAPES
        args.repeats = min(args.repeats, 3)
    args.shape_list = (args.shapes or SHAPES).split(",")
    args.dtype_list = args.dtypes.split(",")
    args.mode_list = args.modes.split(",")
    unknown = [m for m in args.mode_list if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints the table and the goals, writes files when --out is given."""
    args = parse_args(argv)
    device = jax.devices()[0]
    print(
        f"jax {jax.__version__} on {device.device_kind} ({jax.default_backend()}); "
        f"jaxops build {jaxops.build_info()}; repeats {args.repeats}",
        file=sys.stderr,
    )
    with H.measuring(args):
        rows, copy, goals = run(args)
    copy_line = (
        f"copy bandwidth: {copy.gbps:.1f} GB/s; times are medians of {args.repeats} samples; "
        "GB/s counts reading x once and writing every output once"
    )
    H.report(args, rows, COLUMNS, copy, goals, copy_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
