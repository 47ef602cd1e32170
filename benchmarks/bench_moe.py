"""MoE permute / unpermute benchmark: the jaxops custom calls against their pure-JAX twins.

The twin is what MaxText does: ``argsort`` of the expert ids, then gathers (and JAX autodiff,
i.e. scatter-adds, for the backward). Both implementations run under ``jax.jit`` in one process on
the same routing (top-k distinct experts per token from random logits, softmax weights); their
forward outputs are checked to agree (permute bit-exact, unpermute within bf16 rounding) before
anything is timed. Four timed ops per case:

- ``permute``: route + move the rows (tokens and probs);
- ``permute+bwd``: the forward and the VJP of the permuted tokens (an unweighted unpermute);
- ``unpermute``: the probability-weighted sum of each token's K expert rows;
- ``unpermute+bwd``: the forward and the VJP for expert rows and probs.

GB/s counts the rows each op reads and writes once: a permute reads T*K token rows and writes R
rows (R = T*K + E*(align-1)), an unpermute reads T*K rows and writes T, its backward reads T*K
rows of the output gradient and R expert rows and writes R rows. The goal lines check the
project's goals: on CPU ``xla/ffi >= 1.5`` on every row (``>= 1.2`` with ``--busy``, one core kept
busy by a second process) and ``>= 3`` for every op on the two stated bfloat16 cases; on a GPU
``>= 2`` and ``>= 2400 GB/s`` on those.

Usage (from the repository root)::

    python benchmarks/bench_moe.py                 # H = 1024 cases and the two goal cases
    python benchmarks/bench_moe.py --quick         # smoke test, well under a minute on 2 cores
    python benchmarks/bench_moe.py --out benchmarks/results/cpu
    python benchmarks/bench_moe.py --busy --name moe_busy --out benchmarks/results/cpu
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
from jaxops import moe

if __package__:
    from . import _harness as H
else:
    import _harness as H

# T x K x E x H
CASES = "4096x2x8x1024,8192x2x8x1024,4096x8x128x7168,16384x2x8x4096"
QUICK_CASES = "512x4x16x512"
GOAL_CASES = ("4096x8x128x7168", "16384x2x8x4096")
OPS = ("permute", "permute+bwd", "unpermute", "unpermute+bwd")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
CPU_GOAL_RATIO = 3.0
CPU_ROW_GOAL_RATIO = 1.5  # every row
CPU_BUSY_GOAL_RATIO = 1.2  # every row, with --busy
GPU_GOAL_RATIO = 2.0
GPU_GOAL_GBPS = 2400.0

COLUMNS = [
    H.Column("op", "op", align="<"),
    H.Column("dtype", "dtype", align="<"),
    H.Column("case", "T x K x E x H", align="<"),
    H.Column("align", "align"),
    H.Column("ffi_ms", "ffi ms", "{:.3f}"),
    H.Column("xla_ms", "xla ms", "{:.3f}"),
    H.Column("ffi_gbps", "ffi GB/s", "{:.1f}"),
    H.Column("xla_gbps", "xla GB/s", "{:.1f}"),
    H.Column("speedup", "xla/ffi", "{:.2f}x"),
    H.Column("ffi_copy_frac", "ffi %copy", lambda v: f"{100 * v:.1f}%"),
]


def routing(t: int, k: int, e: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """Top-k distinct experts per token and their softmax weights, from random logits."""
    logits = jax.random.normal(jax.random.key(seed), (t, e), jnp.float32)
    probs, ids = jax.lax.top_k(jax.nn.softmax(logits), k)
    return ids.astype(jnp.int32), probs


def _fns(impl: str, e: int, align: int) -> dict[str, Any]:
    def fwd(x, ids, probs):
        p = moe.permute(x, ids, e, probs=probs, align=align, impl=impl)
        return p.tokens, p.probs

    def fwd_bwd(x, ids, probs, ct):
        out, vjp = jax.vjp(lambda a: moe.permute(a, ids, e, align=align, impl=impl).tokens, x)
        return out, vjp(ct)[0]

    def unperm(y, ids, probs, perm):
        return moe.unpermute(y, perm, probs=probs, impl=impl)

    def unperm_bwd(y, ids, probs, perm, g):
        out, vjp = jax.vjp(lambda a, b: moe.unpermute(a, perm, probs=b, impl=impl), y, probs)
        return out, *vjp(g)

    return {
        "permute": jax.jit(fwd),
        "permute+bwd": jax.jit(fwd_bwd),
        "unpermute": jax.jit(unperm),
        "unpermute+bwd": jax.jit(unperm_bwd),
    }


def _row_bytes(op: str, t: int, k: int, rows: int, h: int, itemsize: int) -> int:
    """Bytes of the rows `op` reads and writes once (see the module docstring)."""
    permute = (t * k + rows) * h
    unpermute = (t * k + t) * h
    unpermute_bwd = (t * k + 2 * rows) * h
    counts = {
        "permute": permute,
        "permute+bwd": permute + unpermute,
        "unpermute": unpermute,
        "unpermute+bwd": unpermute + unpermute_bwd,
    }
    return counts[op] * itemsize


def _check(op: str, case: str, ffi_out, xla_out, dtype) -> None:
    for a, b in zip(jax.tree.leaves(ffi_out), jax.tree.leaves(xla_out), strict=True):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if op == "permute":
            ok = np.array_equal(a64, b64)
        else:  # sums rounded to the dtype in a different order
            tol = 4 * float(jnp.finfo(dtype).eps) * max(1.0, float(np.max(np.abs(b64), initial=0)))
            ok = bool(np.allclose(a64, b64, rtol=tol, atol=tol))
        if not ok:
            raise AssertionError(f"{op} {case}: ffi and xla results differ")


def run(args) -> tuple[list[dict[str, Any]], H.CopyBandwidth, list[H.Goal]]:
    copy = H.copy_bandwidth()
    gpu = H.is_gpu()
    rows_out = []
    for case in args.case_list:
        t, k, e, h = (int(v) for v in case.split("x"))
        ids, probs = routing(t, k, e)
        for dtype_name in args.dtype_list:
            dtype = DTYPES[dtype_name]
            x = jax.random.normal(jax.random.key(1), (t, h), dtype)
            perm = moe.permute(x, ids, e, probs=probs, align=args.align)
            rows = perm.tokens.shape[0]
            y = jax.random.normal(jax.random.key(2), (rows, h), dtype)
            g = jax.random.normal(jax.random.key(3), (t, h), dtype)
            operands = {
                "permute": (x, ids, probs),
                "permute+bwd": (x, ids, probs, y),
                "unpermute": (y, ids, probs, perm),
                "unpermute+bwd": (y, ids, probs, perm, g),
            }
            fns = {impl: _fns(impl, e, args.align) for impl in ("ffi", "xla")}
            for op in args.op_list:
                outs = {
                    impl: jax.block_until_ready(fns[impl][op](*operands[op]))
                    for impl in ("ffi", "xla")
                }
                _check(op, case, outs["ffi"], outs["xla"], dtype)
                del outs
                timings = H.time_interleaved(
                    {impl: (fns[impl][op], operands[op]) for impl in ("ffi", "xla")},
                    repeats=args.repeats,
                )
                nbytes = _row_bytes(op, t, k, rows, h, jnp.dtype(dtype).itemsize)
                ffi_s, xla_s = timings["ffi"].median, timings["xla"].median
                rows_out.append(
                    {
                        "op": op,
                        "dtype": dtype_name,
                        "case": case,
                        "align": args.align,
                        "bytes": nbytes,
                        "ffi_ms": 1e3 * ffi_s,
                        "xla_ms": 1e3 * xla_s,
                        "ffi_gbps": H.gbps(nbytes, ffi_s),
                        "xla_gbps": H.gbps(nbytes, xla_s),
                        "speedup": xla_s / ffi_s,
                        "ffi_copy_frac": H.gbps(nbytes, ffi_s) / copy.gbps,
                        "timings": {kk: tt.to_json() for kk, tt in timings.items()},
                    }
                )
                print(H.format_table(rows_out[-1:], COLUMNS).splitlines()[-1], file=sys.stderr)
    return rows_out, copy, _goals(rows_out, gpu, args.busy)


def _goals(rows: Sequence[dict[str, Any]], gpu: bool, busy: bool = False) -> list[H.Goal]:
    goals = []
    if not gpu:
        goals.append(
            H.ratio_goal(
                rows,
                CPU_BUSY_GOAL_RATIO if busy else CPU_ROW_GOAL_RATIO,
                lambda r: f"{r['op']} {r['dtype']} {r['case']}",
                "op, dtype and case" + (" with one core busy" if busy else ""),
            )
        )
        if busy:
            return goals
    goal_rows = [r for r in rows if r["case"] in GOAL_CASES and r["dtype"] == "bfloat16"]
    if not goal_rows:
        return [*goals, H.Goal("xla/ffi on the goal cases", "run with the default cases", None)]
    ratio = GPU_GOAL_RATIO if gpu else CPU_GOAL_RATIO
    worst = min(goal_rows, key=lambda r: r["speedup"])
    goals += [
        H.Goal(
            f"xla/ffi >= {ratio} on {' and '.join(GOAL_CASES)} bf16 (every op)",
            f"worst {worst['speedup']:.2f}x ({worst['op']} {worst['case']})",
            worst["speedup"] >= ratio,
        )
    ]
    if gpu:
        slow = min(goal_rows, key=lambda r: r["ffi_gbps"])
        goals.append(
            H.Goal(
                f"ffi >= {GPU_GOAL_GBPS:.0f} GB/s on the goal cases",
                f"worst {slow['ffi_gbps']:.0f} GB/s ({slow['op']} {slow['case']})",
                slow["ffi_gbps"] >= GPU_GOAL_GBPS,
            )
        )
    return goals


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=None, help=f"comma-separated TxKxExH (default {CASES})")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated token dtypes")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated ops")
    p.add_argument("--align", type=int, default=1, help="group size multiple")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--quick", action="store_true", help=f"case {QUICK_CASES}, 3 repeats")
    p.add_argument("--out", default=None, help="directory for moe.md / moe.json")
    p.add_argument("--name", default="moe")
    H.add_busy_argument(p)
    args = p.parse_args(argv)
    if args.quick:
        args.cases = args.cases or QUICK_CASES
        args.repeats = min(args.repeats, 3)
    args.case_list = (args.cases or CASES).split(",")
    args.dtype_list = args.dtypes.split(",")
    args.op_list = args.ops.split(",")
    unknown = [o for o in args.op_list if o not in OPS]
    if unknown:
        p.error(f"unknown ops {unknown}; choose from {list(OPS)}")
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
        "GB/s counts the rows each op reads and writes once (see bench_moe.py)"
    )
    H.report(args, rows, COLUMNS, copy, goals, copy_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
