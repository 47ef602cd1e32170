"""RMSNorm benchmark: the jaxops custom call against its pure-JAX twin (XLA's own fusion).

For every op, dtype and shape, both implementations run under ``jax.jit`` on the same inputs in
one process; their outputs are checked to agree before anything is timed. Reported per row: the
median time of each, the bandwidth each achieves on the bytes the op must minimally move, the
speed-up ``xla / ffi`` and the fraction of the device's copy bandwidth. The last lines say whether
the project's performance goals are met on this machine.

Usage (from the repository root)::

    python benchmarks/bench_rms_norm.py                  # defaults for the platform jax picks
    python benchmarks/bench_rms_norm.py --quick          # smoke test, < 1 minute on 2 CPU cores
    python benchmarks/bench_rms_norm.py --shapes 4096x4096 --dtypes bfloat16 --out results/
    python benchmarks/bench_rms_norm.py --busy --name rms_norm_busy --out results/  # 1 core busy
    python benchmarks/bench_rms_norm.py --dw-parts 512,1024   # the backward's dweight parts A/B

``--dw-parts`` also times each backward op with dweight reduced over exactly that many row ranges
(on a GPU, the backward kernel's grid: 256 CTAs by default), in the same samples as the default
count; those rows are not judged against the goals.

The custom call is requested with ``impl="ffi"`` (the strict form of the default ``impl=None``),
so a jaxops built without the platform's kernel fails loudly instead of timing XLA twice.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxops
from jaxops._rms_norm import partition as _partition

# The harness next to this script (also under ``python -m benchmarks.<script>``).
H = importlib.import_module(f"{__package__}._harness" if __package__ else "_harness")

IMPLS = ("ffi", "xla")
DEFAULT_OPS = ("rms_norm_fwd", "rms_norm_fwd_bwd", "add_rms_norm_fwd", "add_rms_norm_fwd_bwd")

CPU_SHAPES = "4096x4096,4096x1024,8192x1024,1024x8192"
GPU_SHAPES = "16384x4096,16384x8192,16384x16384"
CPU_QUICK_SHAPES = "512x1024,128x4096"
GPU_QUICK_SHAPES = "4096x4096"

DTYPES = {
    "float32": jnp.float32,
    "f32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "f16": jnp.float16,
}
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}

# (rtol, atol) for comparing the two implementations; atol is relative to max |xla output|.
TOLERANCES = {"float32": (1e-4, 1e-5), "bfloat16": (1.6e-2, 8e-3), "float16": (4e-3, 2e-3)}

# Goals of the project (see the README): checked on the shapes they are stated for. On CPU every
# row (op, dtype, shape) is also held to CPU_GOAL_SPEEDUP, or CPU_BUSY_GOAL_SPEEDUP with --busy.
CPU_GOAL_SHAPE = (4096, 4096)
CPU_GOAL_SPEEDUP = 1.5
CPU_BUSY_GOAL_SPEEDUP = 1.2
GPU_GOAL_SHAPES = ((16384, 4096), (16384, 8192), (16384, 16384))
GPU_GOAL_GBPS = 2800.0  # an H100's copy measured 2.93-2.96 TB/s (benchmarks/results/h100)
GPU_GOAL_SPEEDUP = 1.3
GPU_GOAL_OPS = ("rms_norm_fwd_bwd", "add_rms_norm_fwd_bwd")


# -------------------------------------------------------------------------------------------------
# Ops.


class Inputs(NamedTuple):
    """Operands of every op for one (dtype, shape); ``dh`` is the cotangent of add_rms_norm's h."""

    x: jax.Array
    residual: jax.Array
    weight: jax.Array
    dy: jax.Array
    dh: jax.Array


@dataclasses.dataclass(frozen=True)
class Op:
    """A benchmarked op: how to build its jitted function for an impl, and its minimal traffic.

    `build(impl, inputs, eps)` returns (jitted function, its arguments). `fwd` and `bwd` say
    which passes the op runs; `add` whether it is the fused residual-add variant.
    """

    name: str
    label: str
    build: Callable[[str, Inputs, float], tuple[Callable[..., Any], tuple[Any, ...]]]
    fwd: bool
    bwd: bool
    add: bool
    outputs: tuple[str, ...]

    def bytes_moved(self, rows: int, hidden: int, x_size: int, w_size: int) -> int:
        """Bytes the op must read and write at least.

        Forward: reads x (+ residual) and weight, writes y (+ h) and the f32 rstd per row.
        Backward: reads dy (+ dh), x (h), weight and rstd, writes dx and dweight. The residual's
        gradient of add_rms_norm equals dx and is not counted (nor returned) a second time.
        """
        n = rows * hidden
        total = 0
        if self.fwd:
            total += n * x_size * (4 if self.add else 2) + hidden * w_size + rows * 4
        if self.bwd:
            total += n * x_size * (4 if self.add else 3) + 2 * hidden * w_size + rows * 4
        return total


def _rms(impl: str, eps: float) -> Callable[[jax.Array, jax.Array], jax.Array]:
    return lambda x, w: jaxops.rms_norm(x, w, eps=eps, impl=impl)


def _add_rms(impl: str, eps: float) -> Callable[..., tuple[jax.Array, jax.Array]]:
    return lambda x, r, w: jaxops.add_rms_norm(x, r, w, eps=eps, impl=impl)


def _build_rms_fwd(impl: str, a: Inputs, eps: float):
    return jax.jit(_rms(impl, eps)), (a.x, a.weight)


def _build_rms_fwd_bwd(impl: str, a: Inputs, eps: float):
    def fwd_bwd(x, w, dy):
        y, vjp = jax.vjp(_rms(impl, eps), x, w)
        dx, dw = vjp(dy)
        return y, dx, dw

    return jax.jit(fwd_bwd), (a.x, a.weight, a.dy)


def _build_rms_bwd(impl: str, a: Inputs, eps: float):
    # The residuals of the forward pass are computed once, untimed; the VJP closure is a pytree.
    _, vjp = jax.vjp(jax.jit(_rms(impl, eps)), a.x, a.weight)
    return jax.jit(lambda vjp, dy: vjp(dy)), (vjp, a.dy)


def _build_add_fwd(impl: str, a: Inputs, eps: float):
    return jax.jit(_add_rms(impl, eps)), (a.x, a.residual, a.weight)


def _build_add_fwd_bwd(impl: str, a: Inputs, eps: float):
    def fwd_bwd(x, r, w, dy, dh):
        (y, h), vjp = jax.vjp(_add_rms(impl, eps), x, r, w)
        dx, _, dw = vjp((dy, dh))
        return y, h, dx, dw

    return jax.jit(fwd_bwd), (a.x, a.residual, a.weight, a.dy, a.dh)


def _build_add_bwd(impl: str, a: Inputs, eps: float):
    _, vjp = jax.vjp(jax.jit(_add_rms(impl, eps)), a.x, a.residual, a.weight)

    def bwd(vjp, dy, dh):
        dx, _, dw = vjp((dy, dh))
        return dx, dw

    return jax.jit(bwd), (vjp, a.dy, a.dh)


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op("rms_norm_fwd", "rms_norm fwd", _build_rms_fwd, True, False, False, ("y",)),
        Op(
            "rms_norm_fwd_bwd",
            "rms_norm fwd+bwd",
            _build_rms_fwd_bwd,
            True,
            True,
            False,
            ("y", "dx", "dweight"),
        ),
        Op("rms_norm_bwd", "rms_norm bwd", _build_rms_bwd, False, True, False, ("dx", "dweight")),
        Op("add_rms_norm_fwd", "add_rms_norm fwd", _build_add_fwd, True, False, True, ("y", "h")),
        Op(
            "add_rms_norm_fwd_bwd",
            "add_rms_norm fwd+bwd",
            _build_add_fwd_bwd,
            True,
            True,
            True,
            ("y", "h", "dx", "dweight"),
        ),
        Op(
            "add_rms_norm_bwd",
            "add_rms_norm bwd",
            _build_add_bwd,
            False,
            True,
            True,
            ("dx", "dweight"),
        ),
    )
}


def make_inputs(shape: tuple[int, ...], dtype: Any, weight_dtype: Any, seed: int) -> Inputs:
    """Random operands on the default device (generated there: no host round trip)."""
    kx, kr, kw, ky, kh = jax.random.split(jax.random.key(seed), 5)
    hidden = shape[-1]

    @jax.jit
    def gen():
        return Inputs(
            x=jax.random.normal(kx, shape, jnp.float32).astype(dtype),
            residual=jax.random.normal(kr, shape, jnp.float32).astype(dtype),
            weight=(1.0 + 0.1 * jax.random.normal(kw, (hidden,), jnp.float32)).astype(weight_dtype),
            dy=jax.random.normal(ky, shape, jnp.float32).astype(dtype),
            dh=jax.random.normal(kh, shape, jnp.float32).astype(dtype),
        )

    return jax.block_until_ready(gen())


# -------------------------------------------------------------------------------------------------
# Agreement check.


@jax.jit
def _excess(actual: jax.Array, desired: jax.Array, rtol: jax.Array, atol: jax.Array):
    """max(|a - d| - (atol * scale + rtol * |d|)) with scale = max(1, max |d|), and finiteness."""
    a = actual.astype(jnp.float32)
    d = desired.astype(jnp.float32)
    scale = jnp.maximum(1.0, jnp.max(jnp.abs(d)))
    excess = jnp.max(jnp.abs(a - d) - (atol * scale + rtol * jnp.abs(d)))
    finite = jnp.all(jnp.isfinite(a)) & jnp.all(jnp.isfinite(d))
    return excess, finite, scale


def check_agreement(op: Op, dtype_name: str, shape: tuple[int, ...], ffi_out, xla_out) -> None:
    """Raises AssertionError (from np.testing.assert_allclose) if the two impls disagree.

    The comparison runs on the device; only a failing output is copied to the host, for
    np.testing.assert_allclose to report the mismatch in detail.
    """
    rtol, atol = TOLERANCES[dtype_name]
    ffi_leaves, xla_leaves = jax.tree.leaves(ffi_out), jax.tree.leaves(xla_out)
    assert len(ffi_leaves) == len(xla_leaves) == len(op.outputs), (op.name, len(ffi_leaves))
    for name, a, d in zip(op.outputs, ffi_leaves, xla_leaves, strict=True):
        assert a.shape == d.shape and a.dtype == d.dtype, (name, a.shape, a.dtype, d.dtype)
        excess, finite, scale = _excess(a, d, jnp.float32(rtol), jnp.float32(atol))
        if bool(finite) and float(excess) <= 0.0:
            continue
        np.testing.assert_allclose(
            np.asarray(a.astype(jnp.float32)),
            np.asarray(d.astype(jnp.float32)),
            rtol=rtol,
            atol=atol * float(scale),
            equal_nan=False,
            err_msg=f"{op.name} {dtype_name} {shape}: output {name}, impl='ffi' vs impl='xla'",
        )
        raise AssertionError(f"{op.name} {dtype_name} {shape}: output {name} is not finite")


# -------------------------------------------------------------------------------------------------
# Goals.


def _find(rows: Sequence[dict[str, Any]], op: str, dtype: str, shape: tuple[int, ...]):
    for row in rows:
        if row["op_name"] == op and row["dtype"] == dtype and tuple(row["shape_tuple"]) == shape:
            return row
    return None


def evaluate_goals(
    rows: Sequence[dict[str, Any]],
    gpu: bool,
    ops: Sequence[str],
    weight_same: bool,
    busy: bool = False,
) -> list[H.Goal]:
    """The project's goals for this platform, judged on the rows measured."""
    hint = "run with the default shapes"
    if not weight_same:
        return [H.Goal("(all)", "goals are stated for weight dtype = input dtype", None)]
    goals = []
    if not gpu:
        goals.append(
            H.busy_ratio_goal(
                rows,
                lambda r: f"{r['op']} {r['dtype_label']} {r['shape']}",
                "op, dtype and shape",
                busy,
                CPU_GOAL_SPEEDUP,
                CPU_BUSY_GOAL_SPEEDUP,
            )
        )
        if busy:
            return goals
        shape_text = "x".join(map(str, CPU_GOAL_SHAPE))
        for dtype in ("float32", "bfloat16"):
            for op in ops:
                text = f"{OPS[op].label} {SHORT[dtype]} {shape_text} >= {CPU_GOAL_SPEEDUP}x XLA"
                row = _find(rows, op, dtype, CPU_GOAL_SHAPE)
                if row is None:
                    goals.append(H.Goal(text, hint, None))
                else:
                    speedup = row["speedup"]
                    goals.append(H.Goal(text, f"{speedup:.2f}x", speedup >= CPU_GOAL_SPEEDUP))
        return goals
    for op in GPU_GOAL_OPS:
        for shape in GPU_GOAL_SHAPES:
            shape_text = "x".join(map(str, shape))
            prefix = f"{OPS[op].label} bf16 {shape_text}"
            row = _find(rows, op, "bfloat16", shape) if op in ops else None
            if row is None:
                goals.append(H.Goal(f"{prefix} >= {GPU_GOAL_GBPS:.0f} GB/s", hint, None))
                goals.append(H.Goal(f"{prefix} >= {GPU_GOAL_SPEEDUP}x XLA", hint, None))
                continue
            goals.append(
                H.Goal(
                    f"{prefix} >= {GPU_GOAL_GBPS:.0f} GB/s",
                    f"{row['ffi_gbps']:.0f} GB/s ({100 * row['ffi_copy_frac']:.1f}% of the copy's "
                    f"{row['copy_gbps']:.0f})",
                    row["ffi_gbps"] >= GPU_GOAL_GBPS,
                )
            )
            goals.append(
                H.Goal(
                    f"{prefix} >= {GPU_GOAL_SPEEDUP}x XLA",
                    f"{row['speedup']:.2f}x",
                    row["speedup"] >= GPU_GOAL_SPEEDUP,
                )
            )
    return goals


# -------------------------------------------------------------------------------------------------
# Main.

COLUMNS = [
    H.Column("op", "op", align="<"),
    H.Column("dtype_label", "dtype", align="<"),
    H.Column("shape", "shape", align="<"),
    *H.FFI_XLA_COLUMNS,
    H.Column("xla_copy_frac", "xla %copy", lambda v: f"{100 * v:.1f}%"),
]


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; platform-dependent defaults are filled in here."""
    p = H.parser(
        __doc__,
        name="rms_norm",
        quick="small shapes and few repeats: a smoke test for CI",
        repeats=None,
        quick_repeats=None,
        repeats_help="timed samples per impl (default CPU 10, GPU 30; 3 with --quick)",
    )
    p.add_argument(
        "--shapes",
        help=f"comma-separated ROWSxHIDDEN (default CPU: {CPU_SHAPES}; GPU: {GPU_SHAPES})",
    )
    p.add_argument(
        "--dtypes", default="float32,bfloat16", help="input dtypes (float32, bfloat16, float16)"
    )
    p.add_argument(
        "--weight-dtype",
        default="same",
        help="weight dtype: 'same' as the input (default), float32, bfloat16 or float16",
    )
    p.add_argument(
        "--ops",
        default=",".join(DEFAULT_OPS),
        help=f"comma-separated ops or 'all' (choices: {', '.join(OPS)})",
    )
    p.add_argument(
        "--dw-parts",
        default="",
        help="comma-separated part counts: the backward ops are also timed with dweight reduced "
        "over exactly min(P, rows) row ranges (the kernel's grid on a GPU), in the same samples "
        "as the default count, each as its own row",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed calls after compilation")
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--copy-mib",
        type=int,
        help="buffer size of the copy-bandwidth probe (default CPU 256, GPU 1024)",
    )
    args = p.parse_args(argv)

    gpu = H.is_gpu()
    if args.shapes is None:
        if args.quick:
            args.shapes = GPU_QUICK_SHAPES if gpu else CPU_QUICK_SHAPES
        else:
            args.shapes = GPU_SHAPES if gpu else CPU_SHAPES
    if args.repeats is None:
        args.repeats = 3 if args.quick else (30 if gpu else 10)
    if args.quick:
        args.warmup = min(args.warmup, 1)
    if args.copy_mib is None and args.quick:
        args.copy_mib = 256 if gpu else 32
    try:
        args.shape_list = H.parse_shapes(args.shapes)
    except ValueError as e:
        p.error(str(e))
    args.op_list = list(OPS) if args.ops.strip() == "all" else _csv(args.ops)
    for op in args.op_list:
        if op not in OPS:
            p.error(f"unknown op {op!r}; choices: {', '.join(OPS)}")
    try:
        args.dw_parts_list = [int(v) for v in _csv(args.dw_parts)]
    except ValueError:
        p.error(f"--dw-parts: expected comma-separated integers, got {args.dw_parts!r}")
    if any(v < 1 for v in args.dw_parts_list):
        p.error(f"--dw-parts: part counts must be >= 1, got {args.dw_parts!r}")
    args.dtype_list = []
    for d in _csv(args.dtypes):
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}; choices: float32, bfloat16, float16")
        args.dtype_list.append(jnp.dtype(DTYPES[d]).name)
    if args.weight_dtype != "same" and args.weight_dtype not in DTYPES:
        p.error(f"unknown weight dtype {args.weight_dtype!r}")
    return args


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _dw_parts(parts: int) -> Iterator[None]:
    """While open, rms_norm's backward reduces dweight over exactly min(parts, rows) row ranges
    (a trace-time constant of jaxops' private partition module; programs traced inside keep it)."""
    saved = (_partition._MAX_PARTS, _partition._ROWS_PER_PART, _partition._MAX_PARTIAL_ELEMENTS)
    _partition._MAX_PARTS, _partition._ROWS_PER_PART = parts, 1
    _partition._MAX_PARTIAL_ELEMENTS = 1 << 62
    try:
        yield
    finally:
        (_partition._MAX_PARTS, _partition._ROWS_PER_PART, _partition._MAX_PARTIAL_ELEMENTS) = saved


def run(args: argparse.Namespace) -> H.Result:
    """Checks and times every (op, dtype, shape); the rows, copy bandwidth and goals."""
    gpu = H.is_gpu()
    if gpu and not jaxops.cuda_available():
        raise SystemExit(
            "bench_rms_norm: jax runs on a GPU but jaxops has no CUDA module "
            f"(build_info: {jaxops.build_info()}); rebuild jaxops with JAXOPS_CUDA=ON"
        )
    copy_bytes = None if args.copy_mib is None else args.copy_mib << 20
    copy = H.copy_bandwidth(copy_bytes, repeats=max(3, args.repeats))
    _log(
        f"copy bandwidth: {copy.gbps:.1f} GB/s (median; best {copy.best_gbps:.1f}) "
        f"on {copy.nbytes / 2**20:.0f} MiB, read + write"
    )

    rows: list[dict[str, Any]] = []
    total = len(args.dtype_list) * len(args.shape_list) * len(args.op_list)
    done = 0
    for dtype_name in args.dtype_list:
        wname = (
            dtype_name if args.weight_dtype == "same" else jnp.dtype(DTYPES[args.weight_dtype]).name
        )
        dtype, wdtype = jnp.dtype(dtype_name), jnp.dtype(wname)
        label = SHORT[dtype_name] + ("" if wname == dtype_name else f"/w:{SHORT[wname]}")
        for shape in args.shape_list:
            inputs = make_inputs(shape, dtype, wdtype, args.seed)
            rows_n, hidden = math.prod(shape[:-1]), shape[-1]
            shape_text = "x".join(map(str, shape))
            for op_name in args.op_list:
                op = OPS[op_name]
                built = {impl: op.build(impl, inputs, args.eps) for impl in IMPLS}
                outs = {impl: jax.block_until_ready(fn(*a)) for impl, (fn, a) in built.items()}
                check_agreement(op, dtype_name, shape, outs["ffi"], outs["xla"])
                variants = args.dw_parts_list if op.bwd else []
                for parts in variants:
                    with _dw_parts(parts):  # traced and compiled (first call) with these parts
                        fn, a = built[f"ffi@{parts}"] = op.build("ffi", inputs, args.eps)
                        out = jax.block_until_ready(fn(*a))
                    check_agreement(op, dtype_name, shape, out, outs["xla"])
                    del out
                del outs
                timings = H.time_interleaved(built, repeats=args.repeats, warmup=args.warmup)
                nbytes = op.bytes_moved(rows_n, hidden, dtype.itemsize, wdtype.itemsize)
                variant_rows = []
                for parts in variants:
                    variant = {"ffi": timings[f"ffi@{parts}"], "xla": timings["xla"]}
                    variant_rows.append(
                        {
                            "op": f"{op.label}, dw parts {min(parts, rows_n)}",
                            "op_name": f"{op.name}@dw_parts",
                            "dtype": dtype_name,
                            "weight_dtype": wname,
                            "dtype_label": label,
                            "shape": shape_text,
                            "shape_tuple": list(shape),
                            **H.ffi_xla_fields(variant, nbytes, copy),
                            "copy_gbps": copy.gbps,
                            "xla_copy_frac": H.gbps(nbytes, variant["xla"].median) / copy.gbps,
                        }
                    )
                ffi, xla = timings["ffi"], timings["xla"]
                row = {
                    "op": op.label,
                    "op_name": op.name,
                    "dtype": dtype_name,
                    "weight_dtype": wname,
                    "dtype_label": label,
                    "shape": shape_text,
                    "shape_tuple": list(shape),
                    **H.ffi_xla_fields(timings, nbytes, copy),
                    "ffi_min_ms": ffi.min_ms,
                    "xla_min_ms": xla.min_ms,
                    "copy_gbps": copy.gbps,
                }
                row["xla_copy_frac"] = row["xla_gbps"] / copy.gbps
                rows.append(row)
                rows.extend(variant_rows)
                done += 1
                _log(
                    f"[{done}/{total}] {op.label} {label} {shape_text}: "
                    f"ffi {row['ffi_ms']:.3f} ms, xla {row['xla_ms']:.3f} ms, "
                    f"xla/ffi {row['speedup']:.2f}x"
                )
                del built, timings
            del inputs
    judged = [r for r in rows if not r["op_name"].endswith("@dw_parts")]
    goals = evaluate_goals(judged, gpu, args.op_list, args.weight_dtype == "same", args.busy)
    copy_line = (
        f"copy bandwidth: {copy.gbps:.1f} GB/s (median of x + 0 on {copy.nbytes / 2**20:.0f} MiB); "
        f"times are medians of {args.repeats} samples; GB/s counts the bytes each op must move"
    )
    return H.Result(rows, COLUMNS, goals, lines=[copy_line], copy=copy)


if __name__ == "__main__":
    sys.exit(H.main(parse_args, run))
