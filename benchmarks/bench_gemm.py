"""GEMM benchmark: jaxops.gemm and jaxops.fp8.gemm against their peers, in one process.

Cases (M x N x K, both sides under ``jax.jit`` on the same inputs, outputs checked to agree first):

- ``gemm+bias+gelu``: ``jaxops.gemm(x, w, b, activation="gelu_tanh")`` against XLA's own
  ``gelu(x @ w + b)`` (which XLA:GPU also fuses through cuBLASLt epilogues). ratio = xla / jaxops.
- ``gemm+bias+gelu fwd+bwd``: the same with its backward (dgrad, wgrad, bias gradient).
- ``fp8 block gemm``: ``jaxops.fp8.gemm`` with the DeepSeek-V3 scaling (x in 1 x 128 groups, w in
  128 x 128 tiles) against the bf16 GEMM of the same shape; ratio = bf16 / fp8, and PFLOP/s.

On CPU jaxops.gemm *is* XLA's dot (the documented CPU path) and FP8 runs the dequantize + dot
reference, so the CPU ratios only show that nothing is lost; the goals are for an H100:
bf16 gemm+bias+gelu at least equal to XLA, FP8 block-scaled 4096 x 7168 x 16384 >= 1.35 PFLOP/s.

Usage::

    python benchmarks/bench_gemm.py [--quick] [--shapes 4096x7168x16384] [--out DIR]
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jaxops

# The harness next to this script (also under ``python -m benchmarks.<script>``).
H = importlib.import_module(f"{__package__}._harness" if __package__ else "_harness")

GPU_SHAPES = "4096x7168x16384,8192x8192x8192,4096x4096x4096"
CPU_SHAPES = "1024x1024x1024,512x2048x1024"
GPU_QUICK = "4096x7168x16384"
CPU_QUICK = "256x256x512"
GOAL_SHAPE = (4096, 7168, 16384)
GOAL_FP8_PFLOPS = 1.35
GOAL_EPILOGUE_RATIO = 1.0


def _inputs(m, n, k):
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    b = jax.random.normal(keys[2], (n,), jnp.bfloat16)
    dy = jax.random.normal(keys[3], (m, n), jnp.bfloat16)
    return x, w, b, dy


def _xla_epilogue(x, w, b):
    h = jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
    return jax.nn.gelu(h, approximate=True).astype(x.dtype)


def _ours(x, w, b):
    return jaxops.gemm(x, w, b, activation="gelu_tanh")


def _fwd_bwd(f):
    def run(x, w, b, dy):
        y, vjp = jax.vjp(f, x, w, b)
        return (y, *vjp(dy))

    return jax.jit(run)


def _check(a, b, what, tol=2e-2):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    if err > tol:
        raise SystemExit(f"{what}: jaxops and the peer disagree (relative error {err:.3g})")


def bench_shape(shape, repeats):
    m, n, k = shape
    x, w, b, dy = _inputs(m, n, k)
    flops = 2.0 * m * n * k
    rows = []
    ours, xla = jax.jit(_ours), jax.jit(_xla_epilogue)
    _check(ours(x, w, b), xla(x, w, b), "gemm+bias+gelu")
    t = H.time_interleaved({"ours": (ours, (x, w, b)), "xla": (xla, (x, w, b))}, repeats=repeats)
    rows.append(_row("gemm+bias+gelu bf16", shape, t, flops, "XLA"))
    ours_fb, xla_fb = _fwd_bwd(_ours), _fwd_bwd(_xla_epilogue)
    for got, want in zip(ours_fb(x, w, b, dy), xla_fb(x, w, b, dy), strict=True):
        _check(got, want, "gemm+bias+gelu fwd+bwd")
    t = H.time_interleaved(
        {"ours": (ours_fb, (x, w, b, dy)), "xla": (xla_fb, (x, w, b, dy))}, repeats=repeats
    )
    rows.append(_row("gemm+bias+gelu fwd+bwd bf16", shape, t, 3 * flops, "XLA"))
    qa = jaxops.fp8.quantize(x, block=(1, 128))
    qb = jaxops.fp8.quantize(w, block=(128, 128), transpose=True)[1]
    fp8 = jax.jit(lambda a, b: jaxops.fp8.gemm(a, b))
    bf16 = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    _check(fp8(qa, qb), bf16(x, w), "fp8 block gemm", tol=0.06)  # two e4m3 operands
    t = H.time_interleaved({"ours": (fp8, (qa, qb)), "xla": (bf16, (x, w))}, repeats=repeats)
    rows.append(_row("fp8 block gemm (1x128 . 128x128)", shape, t, flops, "bf16 GEMM"))
    return rows


def _row(case, shape, timings, flops, peer):
    ours, other = timings["ours"].median, timings["xla"].median
    return {
        "case": case,
        "shape": "x".join(map(str, shape)),
        "jaxops_ms": ours * 1e3,
        "peer": peer,
        "peer_ms": other * 1e3,
        "ratio": other / ours,
        "jaxops_tflops": flops / ours / 1e12,
        "peer_tflops": flops / other / 1e12,
    }


COLUMNS = [
    H.Column("case", "case", align="<"),
    H.Column("shape", "M x N x K", align="<"),
    H.Column("jaxops_ms", "jaxops ms", "{:.3f}"),
    H.Column("peer", "peer", align="<"),
    H.Column("peer_ms", "peer ms", "{:.3f}"),
    H.Column("ratio", "peer/jaxops", "{:.2f}"),
    H.Column("jaxops_tflops", "jaxops TFLOP/s", "{:.1f}"),
    H.Column("peer_tflops", "peer TFLOP/s", "{:.1f}"),
]


def goals(rows, gpu):
    by = {(r["case"], r["shape"]): r for r in rows}
    goal_shape = "x".join(map(str, GOAL_SHAPE))
    epi = by.get(("gemm+bias+gelu bf16", goal_shape))
    fp8 = by.get(("fp8 block gemm (1x128 . 128x128)", goal_shape))
    if not gpu:
        why = "needs a GPU; on CPU jaxops.gemm is XLA's dot and FP8 runs the reference"
        return [
            H.Goal("gemm+bias+gelu >= XLA on H100", why, None),
            H.Goal(f"fp8 block {goal_shape} >= {GOAL_FP8_PFLOPS} PFLOP/s on H100", why, None),
        ]
    out = []
    if epi is not None:
        value = f"{epi['ratio']:.2f}x XLA"
        out.append(H.Goal("gemm+bias+gelu >= XLA", value, epi["ratio"] >= GOAL_EPILOGUE_RATIO))
    if fp8 is not None:
        pflops = fp8["jaxops_tflops"] / 1e3
        value = f"{pflops:.2f} PFLOP/s ({fp8['ratio']:.2f}x bf16)"
        out.append(
            H.Goal(
                f"fp8 block {goal_shape} >= {GOAL_FP8_PFLOPS} PFLOP/s",
                value,
                pflops >= GOAL_FP8_PFLOPS,
            )
        )
    return out


def run(args) -> H.Result:
    """Checks and times every shape's three cases; the rows and the goals."""
    rows = []
    for shape in args.shape_list:
        rows.extend(bench_shape(shape, args.repeats))
    return H.Result(rows, COLUMNS, goals(rows, H.is_gpu()))


def parse_args(argv: Sequence[str] | None = None):
    """Command-line options: the common ones (:func:`_harness.parser`) and the shapes."""
    p = H.parser(__doc__, name="gemm", repeats=11, quick="one small shape, 3 repeats")
    p.add_argument("--shapes", default=None, help="comma-separated MxNxK")
    args = p.parse_args(argv)
    if H.is_gpu():
        default = GPU_QUICK if args.quick else GPU_SHAPES
    else:
        default = CPU_QUICK if args.quick else CPU_SHAPES
    args.shape_list = H.parse_shapes(args.shapes or default)
    for shape in args.shape_list:
        if len(shape) != 3:
            p.error(f"--shapes: expected MxNxK, got {shape}")
    return args


if __name__ == "__main__":
    sys.exit(H.main(parse_args, run))
