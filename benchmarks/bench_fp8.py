"""FP8 quantization benchmark: the jaxops custom calls against their pure-JAX twins.

For every block mode (per-tensor, 1x128, 128x128, with and without the fused transpose, and the
per-expert split transpose), shape and dtype, both implementations run under ``jax.jit`` on the
same input in one process; their outputs are checked to be bit-identical before anything is timed.
Reported per row: median times, the bandwidth each achieves on the bytes the op must minimally
move (read x once, write every output once), the speed-up ``xla / ffi`` and the fraction of the
device's copy bandwidth. The last lines check the project's goals: on CPU ``xla/ffi >= 1.5`` on
every row (``>= 1.2`` with ``--busy``, one core kept busy by a second process) and on the
4096x7168 and 16384x7168 bfloat16 rows; on a GPU ``>= 1.5`` and ``>= 2.7 TB/s`` on the latter.

Usage, from the repository root: ``python benchmarks/bench_fp8.py`` times 4096x1024 ... 16384x7168
in bf16 and f32; ``--quick`` is a smoke test, well under a minute on 2 cores; ``--busy --name
fp8_busy --out benchmarks/results/cpu`` writes the busy table. ``--shapes``, ``--dtypes`` and
``--modes`` pick the rows; the flags every benchmark has are described in ``_harness.parser``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import fp8

# The harness next to this script (also under ``python -m benchmarks.<script>``).
H = importlib.import_module(f"{__package__}._harness" if __package__ else "_harness")

SHAPES = "4096x1024,8192x1024,4096x7168,16384x7168"
QUICK_SHAPES = "512x1024"
GOAL_SHAPES = ("4096x7168", "16384x7168")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
MODES = {
    "tensor": {"block": None, "transpose": False},
    "tensor+T": {"block": None, "transpose": True},
    "1x128": {"block": (1, 128), "transpose": False},
    "1x128+T": {"block": (1, 128), "transpose": True},
    "128x128": {"block": (128, 128), "transpose": False},
    "128x128+T": {"block": (128, 128), "transpose": True},
    "split-T": None,  # quantize_split_transpose over 8 uneven experts
}
# xla/ffi goals: CPU (every row, every row with --busy, goal rows); GPU (goal rows, their GB/s)
FFI_XLA = H.FfiXla(("mode", "shape"), GOAL_SHAPES, cpu=(1.5, 1.2, 1.5), gpu=(1.5, 2700))

COLUMNS = [
    H.Column("mode", "mode", align="<"),
    H.Column("dtype", "dtype", align="<"),
    H.Column("shape", "shape", align="<"),
    *H.FFI_XLA_COLUMNS,
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


def _check_same(ffi: jax.Array, xla: jax.Array, what: str) -> None:
    """The kernels' result against the twin's: bit for bit, except FP8 codes on a GPU.

    XLA:GPU's float32 division is not correctly rounded, so there the twin's ``x / scale`` can
    land one FP8 step from the kernels' exact quotient; up to 0.1% of the codes may differ by one
    step. Scales, offsets and everything on a CPU must be identical.
    """
    a8 = np.atleast_1d(np.asarray(ffi)).view(np.uint8)
    b8 = np.atleast_1d(np.asarray(xla)).view(np.uint8)
    if np.array_equal(a8, b8):
        return
    if H.is_gpu() and np.dtype(ffi.dtype) in (
        np.dtype(jnp.float8_e4m3fn),
        np.dtype(jnp.float8_e5m2),
    ):
        steps = np.abs(a8.astype(np.int16) - b8.astype(np.int16))
        off = steps != 0
        if steps.max() == 1 and off.mean() <= 1e-3:
            return
    raise AssertionError(f"{what}: ffi and xla results differ ({ffi.dtype})")


def _bytes(outs: Sequence[jax.Array], x: jax.Array) -> int:
    return int(x.nbytes) + sum(int(o.nbytes) for o in outs)


def run(args) -> H.Result:
    """Checks and times every (shape, dtype, mode); the rows, copy bandwidth and goals."""
    copy = H.copy_bandwidth()
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
                    _check_same(a, b, f"{mode} {shape_text}")
                timings = H.time_interleaved(
                    {impl: (fn, operands) for impl, fn in fns.items()}, repeats=args.repeats
                )
                fields = H.ffi_xla_fields(timings, _bytes(outs["ffi"], x), copy)
                rows.append({"mode": mode, "dtype": dtype_name, "shape": shape_text, **fields})
                H.log_row(rows[-1], COLUMNS)
    return FFI_XLA.result(args, rows, COLUMNS, copy, "reading x once and writing every output once")


def parse_args(argv: Sequence[str] | None = None):
    """Command-line options: the common ones (:func:`_harness.parser`) and the shapes and modes."""
    p = H.parser(__doc__, name="fp8", repeats=7, quick=f"shapes {QUICK_SHAPES}, 3 repeats")
    p.add_list("--shapes", SHAPES, "comma-separated MxK", quick=QUICK_SHAPES)
    p.add_list("--dtypes", "bfloat16,float32", "comma-separated x dtypes")
    p.add_list("--modes", ",".join(MODES), "comma-separated modes", choices=list(MODES))
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(H.main(parse_args, run))
