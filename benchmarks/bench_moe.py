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

Usage, from the repository root: ``python benchmarks/bench_moe.py`` runs the H = 1024 cases and the
two goal cases, ``--quick`` a smoke test (well under a minute on 2 cores), and ``--busy --name
moe_busy --out benchmarks/results/cpu`` the busy table; ``--cases``, ``--dtypes``, ``--ops`` and
``--align`` pick what runs (the common flags: ``_harness.parser``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import moe

# The harness next to this script (also under ``python -m benchmarks.<script>``).
H = importlib.import_module(f"{__package__}._harness" if __package__ else "_harness")

# T x K x E x H
CASES = "4096x2x8x1024,8192x2x8x1024,4096x8x128x7168,16384x2x8x4096"
QUICK_CASES = "512x4x16x512"
GOAL_CASES = ("4096x8x128x7168", "16384x2x8x4096")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
OPS = ("permute", "permute+bwd", "unpermute", "unpermute+bwd")
# xla/ffi goals: CPU (every row, every row with --busy, goal rows); GPU (goal rows, their GB/s)
FFI_XLA = H.FfiXla(("op", "case"), GOAL_CASES, cpu=(1.5, 1.2, 3.0), gpu=(2.0, 2400))

COLUMNS = [
    H.Column("op", "op", align="<"),
    H.Column("dtype", "dtype", align="<"),
    H.Column("case", "T x K x E x H", align="<"),
    H.Column("align", "align"),
    *H.FFI_XLA_COLUMNS,
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


def run(args) -> H.Result:
    """Checks and times every (case, dtype, op); the rows, copy bandwidth and goals."""
    copy = H.copy_bandwidth()
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
                fields = H.ffi_xla_fields(timings, nbytes, copy)
                row = {"op": op, "dtype": dtype_name, "case": case, "align": args.align}
                rows_out.append({**row, **fields})
                H.log_row(rows_out[-1], COLUMNS)
    return FFI_XLA.result(
        args, rows_out, COLUMNS, copy, "the rows each op reads and writes once (see bench_moe.py)"
    )


def parse_args(argv: Sequence[str] | None = None):
    """Command-line options: the common ones (:func:`_harness.parser`) and the cases and ops."""
    p = H.parser(__doc__, name="moe", repeats=11, quick=f"case {QUICK_CASES}, 3 repeats")
    p.add_list("--cases", CASES, "comma-separated TxKxExH", quick=QUICK_CASES)
    p.add_list("--dtypes", "bfloat16,float32", "comma-separated token dtypes")
    p.add_list("--ops", ",".join(OPS), "comma-separated ops", choices=OPS)
    p.add_argument("--align", type=int, default=1, help="group size multiple")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(H.main(parse_args, run))
