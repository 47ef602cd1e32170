"""Grouped GEMM benchmark: the expert FFN's custom calls against the loop of XLA dots.

One MoE layer's expert FFN on one device (the CPU, or a GPU with jaxops' CUDA module), forward +
backward (``jax.value_and_grad`` of
``sum(y * y)`` over x, w_in and w_out) of::

    h = grouped_linear(x, w_in)        # [R, 2F]
    a = silu(h[:, :F]) * h[:, F:]      # [R, F]
    y = grouped_linear(a, w_out)       # [R, D]

with the expert layer's grouped GEMM (``jaxops.parallel.expert._ffn._grouped_linear``, the
``custom_vjp`` op of ``grouped_ffn``, groups padded to multiples of the loop's tile from row 0
as its twin needs them: ``CPU_TILE`` = 32 rows, ``GPU_TILE`` = 64 on a GPU (the layer's CPU
plan leaves them unpadded for the custom calls); ``a`` cast back to ``--dtype`` as the layer
does) run these ways in one process, timed interleaved on the same inputs (``--dtype``, float32
by default; accumulation float32):

- ``ffi``: ``impl="ffi"``, the custom calls ``jaxops_grouped_gemm`` and
  ``jaxops_grouped_gemm_wgrad`` (:mod:`jaxops._grouped_gemm`; CPU or CUDA);
- ``xla``: ``impl="xla"``, their twin: a ``fori_loop`` over the groups of XLA dots per chunk;
- ``ragged_dot`` (on a GPU only): ``jax.lax.ragged_dot`` and its VJP, which XLA:GPU lowers to a
  dense dot over every group (a masked ``[E, R, K]`` operand; cases where that operand passes
  ``--ragged-dot-max-gib`` skip it);
- ``ffi_async`` (on a GPU, 16-bit ``--dtype``): ``ffi`` with ``JAXOPS_GPU_GEMM_PIPELINE=async``
  (the CUDA kernels' cp.async pipeline; ``ffi`` then runs the default, ``registers``, and each
  call of either is waited for before the variable changes);
- ``ffi_lt`` (on a GPU whose libcublasLt has the grouped matmul, 16-bit ``--dtype``): ``ffi``
  traced with ``JAXOPS_GPU_GROUPED_GEMM=cublaslt``, the calls on cuBLASLt's grouped matmul
  (``jaxops_grouped_gemm_lt``, ``jaxops_grouped_gemm_wgrad_lt``); where cuBLASLt refuses the case
  the row says why (``lt_error``) and the rest is timed;
- ``ffi_cutlass`` (on an sm_90 GPU with a CUDA module built with CUTLASS, ``--dtype bfloat16``):
  ``ffi`` traced with ``JAXOPS_GPU_GROUPED_GEMM=cutlass``, the calls on CUTLASS's Hopper grouped
  GEMM (``jaxops_grouped_gemm_cutlass``, ``jaxops_grouped_gemm_wgrad_cutlass``); a failure is
  reported the same way (``cutlass_error``);
- ``fp8`` and ``fp8_cutlass`` (on an sm_90 GPU with a CUDA module built with CUTLASS,
  ``--dtype bfloat16``): the layer's ``fp8="block"`` GEMMs, activation quantization included
  (x and dy in 1 x 128 groups, w in 128 x 128 tiles, the wgrad's per-expert 128-row groups):
  ``fp8`` dequantizes the FP8 operands and runs jaxops' kernels in float32 (the path without the
  FP8 kernels), ``fp8_cutlass`` traced with ``JAXOPS_GPU_GROUPED_GEMM=cutlass`` runs the three
  GEMMs on CUTLASS's block-scaled FP8 grouped GEMMs (``jaxops_grouped_gemm_fp8_cutlass``,
  ``jaxops_grouped_gemm_fp8_wgrad_cutlass``). fp8_cutlass is
  checked against fp8 (the same quantized values: 2e-2) and both against ``ffi`` within FP8's
  resolution (``FP8_TOLERANCE``); a failure is reported (``fp8_cutlass_error``);
- ``tokamax`` (on a GPU where ``tokamax`` is installed): both projections on
  ``tokamax.ragged_dot`` (its Mosaic GPU kernel, ``implementation="mosaic"``) and its VJP, the
  JAX peer's grouped GEMM; a failure is reported (``tokamax_error``);
- ``dense``: the lower bound of XLA's own dot on the same FLOPs: one dense ``x @ w_in[0]`` and
  ``a @ w_out[0]`` over the U rows in groups (no grouping at all), with its backward.

A case ``ExDxF:M`` has E experts, model width D and expert width F; each expert gets about M
rows: group sizes drawn with a fixed numpy seed between 25/32 M and 5/4 M (200 to 320 for
M = 256), rounded down to multiples of 32; R = U + 64 spare rows (U = the sum of the sizes; the
grouped GEMMs skip the spare rows, as the layer's padding). ffi, xla and ragged_dot are checked
to give the same loss and gradients (relative error < 1e-5 in float32, 2e-2 in the 16-bit dtypes,
where ``a`` is rounded to them) before anything is timed, and the ffi program is checked to hold
the custom calls (the others none). Reported per case: the median ms of
each, GFLOP/s of each on ``3 x 2 x U x (D x 2F + F x D)`` (forward + backward), and the ratios
xla/ffi and dense/ffi. The goal lines: the custom calls are faster than the loop of XLA dots
(xla/ffi >= 1) on every case; on a GPU also at least half as fast as the one dense dot
(dense/ffi >= 0.5), and the default cases there are ``GPU_CASES`` (real models' expert shapes);
the columns ffi/lt and dense/lt compare cuBLASLt's grouped matmul with them, ffi/cutlass and
dense/cutlass CUTLASS's grouped GEMM, tokamax/ffi and tokamax/cutlass tokamax's ragged_dot, and
cutlass/fp8 the block-scaled FP8 layer on CUTLASS's FP8 kernel against the bfloat16 one on
CUTLASS's (goal >= 1.4x, activation quantization included).

On the CPU a second table times the activation between the GEMMs (swiglu, forward + backward:
``a`` in ``--dtype`` and the gradient of h) per ``--act-cases`` case ``RxCxU`` (h float32
``[R, C]``, the groups covering its first U rows): ``calls``, jaxops' grouped activation calls
(:func:`jaxops._grouped_gemm.grouped_activation` and its backward: the U rows only), against
``xla``, XLA's fusion of the same math on every row (what the layer ran before them). The
default cases are the expert buffers of ``bench_models.py``'s 4x256x16x2x256:16x128 train step:
2172 rows of which about 636 in groups on one of 8 simulated devices, and 4592 rows of which
4096 (plus group padding) on one device. Goal: the calls at least as fast as the fusion on every
row (xla/calls >= 1).

Usage, from the repository root: ``python benchmarks/bench_grouped_gemm.py`` runs the three
default cases, ``--quick`` one small case (a smoke test, seconds on 2 cores), ``--cases
32x256x128:256 --out benchmarks/results/cpu`` picks cases and saves the tables (the common
flags: ``_harness.parser``). The process has one CPU device (``JAX_NUM_CPU_DEVICES`` overrides
it); on a GPU backend it runs on the first GPU (``JAX_PLATFORMS=cpu`` for the CPU kernels
there).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxops.parallel.expert import _ffn

import jaxops
from jaxops import _grouped_gemm

# The harness next to this script (also under ``python -m benchmarks.<script>``).
H = importlib.import_module(f"{__package__}._harness" if __package__ else "_harness")

# E x D x F : rows per expert (about)
CASES = "32x256x128:256,16x256x256:256,8x1024x512:512"
# On a GPU when --cases is left at CASES: Qwen3-30B-A3B's experts (128 x 2048 x 768) at 512
# rows each, Mixtral's (8 x 4096 x 14336) at 2048, and 64 of DeepSeek-V3's 256 (7168 x 2048; one
# device's share over 4) at 128.
GPU_CASES = "128x2048x768:512,8x4096x14336:2048,64x7168x2048:128"
QUICK_CASES = "8x128x64:64"
SPARE_ROWS = 64
PIPELINE_VARIABLE = "JAXOPS_GPU_GEMM_PIPELINE"
GROUPED_VARIABLE = "JAXOPS_GPU_GROUPED_GEMM"
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}
# The fp8 variants against the bfloat16 ffi: FP8's resolution (e4m3: 2^-4 relative per element).
FP8_TOLERANCE = 0.1
FP8_CALLS = {"jaxops_grouped_gemm_fp8_cutlass", "jaxops_grouped_gemm_fp8_wgrad_cutlass"}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
CALLS = {"jaxops_grouped_gemm", "jaxops_grouped_gemm_wgrad"}
# The library variants: (JAXOPS_GPU_GROUPED_GEMM's value, the dtypes it takes, its calls).
LIBRARIES = {
    "lt": (
        "cublaslt",
        ("bfloat16", "float16"),
        {"jaxops_grouped_gemm_lt", "jaxops_grouped_gemm_wgrad_lt"},
    ),
    "cutlass": (
        "cutlass",
        ("bfloat16",),
        {"jaxops_grouped_gemm_cutlass", "jaxops_grouped_gemm_wgrad_cutlass"},
    ),
}
# h's rows x columns x the rows in groups: the expert buffers of bench_models' default step
# while the CPU groups were padded to 32 rows (until 2026-11-29; now 2076 rows with about 526
# in groups on 2 x 4, 4208 with about 4152 on one device).
ACT_CASES = "2172x512x636,4592x512x4096"
QUICK_ACT_CASES = "300x64x100"
ACT_CALLS = {"jaxops_grouped_activation_fwd", "jaxops_grouped_activation_bwd"}


def _tile() -> int:
    """The plan's tile on this backend: the groups' row multiple."""
    return _ffn.GPU_TILE if H.is_gpu() else _ffn.CPU_TILE


COLUMNS = [
    H.Column("case", "E x D x F : M", align="<"),
    H.Column("rows", "U / R", align="<"),
    H.Column("ffi_ms", "ffi ms", "{:.3f}"),
    H.Column("xla_ms", "xla ms", "{:.3f}"),
    H.Column("ragged_dot_ms", "ragged_dot ms", "{:.3f}"),
    H.Column("dense_ms", "dense ms", "{:.3f}"),
    H.Column("ffi_gflops", "ffi GFLOP/s", "{:.1f}"),
    H.Column("xla_gflops", "xla GFLOP/s", "{:.1f}"),
    H.Column("dense_gflops", "dense GFLOP/s", "{:.1f}"),
    H.Column("speedup", "xla/ffi", "{:.2f}x"),
    H.Column("ragged_ratio", "ragged_dot/ffi", "{:.2f}x"),
    H.Column("ffi_async_ms", "ffi async ms", "{:.3f}"),
    H.Column("async_ratio", "ffi/async", "{:.2f}x"),
    H.Column("ffi_lt_ms", "ffi lt ms", "{:.3f}"),
    H.Column("lt_ratio", "ffi/lt", "{:.2f}x"),
    H.Column("dense_ratio", "dense/ffi", "{:.2f}x"),
    H.Column("dense_lt_ratio", "dense/lt", "{:.2f}x"),
    H.Column("ffi_cutlass_ms", "ffi cutlass ms", "{:.3f}"),
    H.Column("cutlass_ratio", "ffi/cutlass", "{:.2f}x"),
    H.Column("dense_cutlass_ratio", "dense/cutlass", "{:.2f}x"),
    H.Column("fp8_ms", "fp8 ms", "{:.3f}"),
    H.Column("fp8_cutlass_ms", "fp8 cutlass ms", "{:.3f}"),
    H.Column("fp8_ratio", "cutlass/fp8 cutlass", "{:.2f}x"),
    H.Column("fp8_dequant_ratio", "fp8/fp8 cutlass", "{:.2f}x"),
    H.Column("tokamax_ms", "tokamax ms", "{:.3f}"),
    H.Column("tokamax_ratio", "tokamax/ffi", "{:.2f}x"),
    H.Column("tokamax_cutlass_ratio", "tokamax/cutlass", "{:.2f}x"),
]
# tokamax.ragged_dot's implementation timed as the JAX peer: its Mosaic GPU (sm_90) kernel.
TOKAMAX_IMPLEMENTATION = "mosaic"


ACT_COLUMNS = [
    H.Column("case", "R x C x U", align="<"),
    H.Column("calls_ms", "calls ms", "{:.3f}"),
    H.Column("xla_ms", "xla ms", "{:.3f}"),
    H.Column("ratio", "xla/calls", "{:.2f}x"),
]


def parse_act_case(case: str) -> tuple[int, int, int]:
    """``"2172x512x636"`` -> (R, C, U)."""
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)", case.strip())
    if match is None:
        raise ValueError(f"bad activation case {case!r}: expected RxCxU, e.g. 2172x512x636")
    r, c, u = (int(v) for v in match.groups())
    if r < 1 or c < 2 or c % 2 or not 0 <= u <= r:
        raise ValueError(f"bad activation case {case!r}: R >= 1, C even >= 2, 0 <= U <= R")
    return r, c, u


def _act_case(args, case: str) -> dict[str, Any]:
    """Times the grouped activation calls against XLA's fusion on every row (swiglu)."""
    r, c, u = parse_act_case(case)
    dtype = DTYPES[args.dtype]
    kh, kd = jax.random.split(jax.random.key(args.seed))
    h = jax.random.normal(kh, (r, c), jnp.float32).at[u:].set(0)  # the GEMM's zero padding
    da = jax.random.normal(kd, (r, c // 2), jnp.float32).astype(dtype)
    sizes = jnp.asarray([u], jnp.int32)

    @jax.jit
    def calls(h, da, sizes):
        a = _grouped_gemm.grouped_activation(h, sizes, "swiglu", dtype=dtype)
        return a, _grouped_gemm.grouped_activation_bwd(h, da, sizes, "swiglu")

    @jax.jit
    def xla(h, da, sizes):
        a, vjp = jax.vjp(lambda h: _grouped_gemm.activation_reference(h, "swiglu"), h)
        return a.astype(dtype), vjp(da.astype(jnp.float32))[0]

    for name, fn, want in (("calls", calls, ACT_CALLS), ("xla", xla, set())):
        found = set(re.findall(r"jaxops_grouped_activation_\w+", fn.lower(h, da, sizes).as_text()))
        if found != want:
            raise AssertionError(f"{case}: the {name} program calls {sorted(found)}, not {want}")
    got, ref = calls(h, da, sizes), xla(h, da, sizes)
    for name, a, b in zip(("a", "dh"), got, ref, strict=True):
        err = _rel_error(a, b)
        if not err < TOLERANCE[args.dtype]:
            raise AssertionError(f"{case}: {name} of the calls and XLA differ ({err:.3g})")
    operands = (h, da, sizes)
    timings = H.time_interleaved(
        {"calls": (calls, operands), "xla": (xla, operands)}, repeats=args.repeats
    )
    seconds = {name: t.median for name, t in timings.items()}
    row = {
        "case": case,
        "rows": r,
        "columns": c,
        "used_rows": u,
        "dtype": args.dtype,
        **{f"{name}_ms": 1e3 * s for name, s in seconds.items()},
        "ratio": seconds["xla"] / seconds["calls"],
        "timings": {name: t.to_json() for name, t in timings.items()},
    }
    H.log_row(row, ACT_COLUMNS)
    return row


def parse_case(case: str) -> tuple[int, int, int, int]:
    """``"32x256x128:256"`` -> (E, D, F, M)."""
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+):(\d+)", case.strip())
    if match is None:
        raise ValueError(f"bad case {case!r}: expected ExDxF:M, e.g. 32x256x128:256")
    values = tuple(int(v) for v in match.groups())
    if any(v < 1 for v in values):
        raise ValueError(f"bad case {case!r}: every number must be >= 1")
    return values  # type: ignore[return-value]


def group_sizes(experts: int, per_expert: int, seed: int, tile: int) -> np.ndarray:
    """int32 [E]: drawn between 25/32 and 5/4 of `per_expert`, rounded down to `tile`."""
    low, high = round(per_expert * 25 / 32), round(per_expert * 5 / 4)
    sizes = np.random.default_rng(seed).integers(low, high, size=experts, endpoint=True)
    return (sizes // tile * tile).astype(np.int32)


def _ffn_loss(impl: str, tile: int, fp8: bool = False):
    """``sum(y * y)`` of the grouped FFN with the grouped GEMMs of `impl` ("ffi" or "xla"; with
    tile 0, ragged_dot), block-scaled FP8 with `fp8`."""

    def loss(x, w_in, w_out, groups):
        h = _ffn._grouped_linear(tile, fp8, impl, x, w_in, groups)
        f = h.shape[1] // 2
        a = (jax.nn.silu(h[:, :f]) * h[:, f:]).astype(x.dtype)
        y = _ffn._grouped_linear(tile, fp8, impl, a, w_out, groups)
        return jnp.sum(y * y)

    return loss


def _tokamax_loss(x, w_in, w_out, groups):
    """``sum(y * y)`` of the grouped FFN with both projections on ``tokamax.ragged_dot``."""
    import tokamax  # an optional peer, installed on the GPU machine only

    def linear(a, w):
        return tokamax.ragged_dot(
            a,
            w,
            groups[0],
            preferred_element_type=jnp.float32,
            implementation=TOKAMAX_IMPLEMENTATION,
        )

    h = linear(x, w_in)
    f = h.shape[1] // 2
    a = (jax.nn.silu(h[:, :f]) * h[:, f:]).astype(x.dtype)
    y = linear(a, w_out)
    return jnp.sum(y * y)


def _dense_loss(x, w_in, w_out):
    """The same math as one dense GEMM per projection over every row of x."""
    h = jnp.dot(x, w_in, preferred_element_type=jnp.float32)
    f = h.shape[1] // 2
    a = (jax.nn.silu(h[:, :f]) * h[:, f:]).astype(x.dtype)
    y = jnp.dot(a, w_out, preferred_element_type=jnp.float32)
    return jnp.sum(y * y)


class _WithEnv:
    """A jitted function traced and run with the environment variables `env` set (the CUDA
    grouped GEMM reads JAXOPS_GPU_GEMM_PIPELINE at each call, JAXOPS_GPU_GROUPED_GEMM when it is
    traced): each call is waited for before the variables are restored."""

    def __init__(self, fn, env: dict[str, str]):
        self.fn = fn
        self.env = env

    def _run(self, method, *args):
        old = {name: os.environ.get(name) for name in self.env}
        os.environ.update(self.env)
        try:
            return jax.block_until_ready(method(*args))
        finally:
            for name, value in old.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value

    def lower(self, *args):
        return self._run(self.fn.lower, *args)

    def __call__(self, *args):
        return self._run(self.fn, *args)


def _library_available(name: str) -> bool:
    """Whether a library variant runs here: cuBLASLt's grouped matmul (a GPU and a libcublasLt
    that has it), CUTLASS's grouped GEMM (an sm_90 GPU and a CUDA module built with CUTLASS)."""
    if not H.is_gpu():
        return False
    info = jaxops.build_info().get("CUDA", {})
    if name == "lt":
        return bool(info.get("cublaslt_grouped"))
    return bool(info.get("cutlass")) and jax.devices()[0].compute_capability == "9.0"


@jax.jit
def _rel_error_of(got, want):
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30)


def _rel_error(got, want) -> float:
    """||got - want|| / ||want||, in float32 where the arrays are (on a GPU the gradients of the
    default cases are up to 11 GB each: copied to the host in float64 they took minutes)."""
    return float(_rel_error_of(got, want))


def _check(case: str, fns, operands, tolerance: float) -> None:
    """Raises unless the grouped ways agree and only the ffi program holds the custom calls."""
    grouped = [impl for impl in fns if impl != "dense"]
    for impl in grouped:
        text = fns[impl].lower(*operands[impl]).as_text()
        calls = set(re.findall(r"jaxops_grouped_gemm\w*", text))
        library = impl.removeprefix("ffi_")
        if library in LIBRARIES:
            want = LIBRARIES[library][2]
        elif impl == "fp8_cutlass":
            want = FP8_CALLS
        elif impl == "fp8":
            want = CALLS
        else:
            want = CALLS if impl.startswith("ffi") else set()
        if calls != want:
            raise AssertionError(f"{case}: the {impl} program calls {sorted(calls)}, not {want}")
    outs = {impl: jax.block_until_ready(fns[impl](*operands[impl])) for impl in grouped}
    names = ("loss", "dx", "dw_in", "dw_out")
    pairs = [("ffi", impl, tolerance) for impl in grouped[1:] if not impl.startswith("fp8")]
    pairs += [("ffi", impl, FP8_TOLERANCE) for impl in grouped if impl.startswith("fp8")]
    if "fp8_cutlass" in outs:  # the same quantized values, on the FP8 kernel or dequantized
        pairs.append(("fp8", "fp8_cutlass", tolerance))
    for base, impl, bound in pairs:
        (loss, grads), (loss_base, grads_base) = outs[impl], outs[base]
        for name, got, want in zip(names, (loss, *grads), (loss_base, *grads_base), strict=True):
            err = _rel_error(got, want)
            if not err < bound:
                raise AssertionError(
                    f"{case}: {name} of {base} and {impl} differ (relative error {err:.3g})"
                )


def _ratio(seconds: dict[str, float], slower: str, faster: str) -> float | None:
    """seconds[slower] / seconds[faster], or None where either did not run."""
    return seconds[slower] / seconds[faster] if slower in seconds and faster in seconds else None


def _case(args, case: str) -> dict[str, Any]:
    e, d, f, m = parse_case(case)
    tile = _tile()
    sizes = group_sizes(e, m, args.seed, tile)
    used = int(sizes.sum())
    rows = used + SPARE_ROWS
    dtype = DTYPES[args.dtype]
    kx, ki, ko = jax.random.split(jax.random.key(args.seed), 3)
    x = jax.random.normal(kx, (rows, d), jnp.float32).astype(dtype)
    w_in = (jax.random.normal(ki, (e, d, 2 * f), jnp.float32) / np.sqrt(d)).astype(dtype)
    w_out = (jax.random.normal(ko, (e, f, d), jnp.float32) / np.sqrt(f)).astype(dtype)
    groups = _ffn._groups(jnp.asarray(sizes))
    grad = {"argnums": (0, 1, 2)}
    fns = {
        "ffi": jax.jit(jax.value_and_grad(_ffn_loss("ffi", tile), **grad)),
        "xla": jax.jit(jax.value_and_grad(_ffn_loss("xla", tile), **grad)),
    }
    # ragged_dot's dense form: a float32 [E, R, max(D, 2F)] operand.
    if H.is_gpu() and 4 * e * rows * max(d, 2 * f) <= args.ragged_dot_max_gib * 2**30:
        fns["ragged_dot"] = jax.jit(jax.value_and_grad(_ffn_loss("xla", 0), **grad))
    if H.is_gpu() and args.dtype != "float32":  # both pipelines, each call waited for
        fns["ffi_async"] = _WithEnv(fns["ffi"], {PIPELINE_VARIABLE: "async"})
        fns["ffi"] = _WithEnv(fns["ffi"], {PIPELINE_VARIABLE: "registers"})
    errors: dict[str, str | None] = dict.fromkeys(LIBRARIES)
    for library, (setting, dtypes, _) in LIBRARIES.items():
        if not _library_available(library) or args.dtype not in dtypes:
            continue
        fn = jax.jit(jax.value_and_grad(_ffn_loss("ffi", tile), **grad))
        fns[f"ffi_{library}"] = _WithEnv(fn, {GROUPED_VARIABLE: setting})
        try:  # a library's refusal (no algorithm, ...) is reported, not fatal
            fns[f"ffi_{library}"](x, w_in, w_out, groups)
        except jax.errors.JaxRuntimeError as e:
            errors[library] = f"{type(e).__name__}: {e}"[:500]
            print(f"{case}: {setting}'s grouped GEMM failed: {errors[library]}", file=sys.stderr)
            del fns[f"ffi_{library}"]
    errors["fp8_cutlass"] = None
    if _library_available("cutlass") and args.dtype == "bfloat16":
        fp8_loss = _ffn_loss("ffi", tile, fp8=True)
        fns["fp8"] = jax.jit(jax.value_and_grad(fp8_loss, **grad))
        fn = jax.jit(jax.value_and_grad(fp8_loss, **grad))
        fns["fp8_cutlass"] = _WithEnv(fn, {GROUPED_VARIABLE: "cutlass"})
        try:  # reported, not fatal, as the libraries
            fns["fp8_cutlass"](x, w_in, w_out, groups)
        except jax.errors.JaxRuntimeError as e:
            errors["fp8_cutlass"] = f"{type(e).__name__}: {e}"[:500]
            print(f"{case}: the FP8 grouped GEMM failed: {errors['fp8_cutlass']}", file=sys.stderr)
            del fns["fp8_cutlass"]
    errors["tokamax"] = None
    if H.is_gpu() and importlib.util.find_spec("tokamax") is not None:
        fns["tokamax"] = jax.jit(jax.value_and_grad(_tokamax_loss, **grad))
        try:  # the peer's refusal (a shape or dtype its kernel lacks) is reported, not fatal
            jax.block_until_ready(fns["tokamax"](x, w_in, w_out, groups))
        except Exception as e:  # any failure of the optional peer
            errors["tokamax"] = f"{type(e).__name__}: {e}"[:500]
            print(f"{case}: tokamax's ragged_dot failed: {errors['tokamax']}", file=sys.stderr)
            del fns["tokamax"]
    fns["dense"] = jax.jit(jax.value_and_grad(_dense_loss, **grad))
    dense_in = (jnp.array(x[:used]), jnp.array(w_in[0]), jnp.array(w_out[0]))
    operands = dict.fromkeys(fns, (x, w_in, w_out, groups))
    operands["dense"] = jax.block_until_ready(dense_in)
    _check(case, fns, operands, TOLERANCE[args.dtype])
    timings = H.time_interleaved(
        {impl: (fns[impl], operands[impl]) for impl in fns}, repeats=args.repeats
    )
    flops = 3 * 2 * used * (d * 2 * f + f * d)
    seconds = {impl: timings[impl].median for impl in fns}
    row: dict[str, Any] = {
        "case": case,
        "rows": f"{used} / {rows}",
        "experts": e,
        "d": d,
        "f": f,
        "used_rows": used,
        "total_rows": rows,
        "group_sizes": sizes.tolist(),
        "flops": flops,
        **{f"{impl}_ms": 1e3 * s for impl, s in seconds.items()},
        **{f"{impl}_gflops": flops / s / 1e9 for impl, s in seconds.items()},
        "dtype": args.dtype,
        "speedup": seconds["xla"] / seconds["ffi"],
        "ragged_ratio": seconds["ragged_dot"] / seconds["ffi"] if "ragged_dot" in seconds else None,
        "dense_ratio": seconds["dense"] / seconds["ffi"],
        "async_ratio": seconds["ffi"] / seconds["ffi_async"] if "ffi_async" in seconds else None,
        **{
            key: value
            for library in LIBRARIES
            for key, value in (
                (f"{library}_ratio", _ratio(seconds, "ffi", f"ffi_{library}")),
                (f"dense_{library}_ratio", _ratio(seconds, "dense", f"ffi_{library}")),
                (f"{library}_error", errors[library]),
            )
        },
        "fp8_ratio": _ratio(seconds, "ffi_cutlass", "fp8_cutlass"),
        "fp8_dequant_ratio": _ratio(seconds, "fp8", "fp8_cutlass"),
        "fp8_cutlass_error": errors["fp8_cutlass"],
        "tokamax_ratio": _ratio(seconds, "tokamax", "ffi"),
        "tokamax_cutlass_ratio": _ratio(seconds, "tokamax", "ffi_cutlass"),
        "tokamax_error": errors["tokamax"],
        "timings": {impl: t.to_json() for impl, t in timings.items()},
    }
    H.log_row(row, COLUMNS)
    return row


def run(args) -> H.Result:
    """Checks and times every case; the rows and the goal."""
    if not _grouped_gemm.kernel_available():
        raise SystemExit(
            "bench_grouped_gemm: no grouped GEMM custom calls on jax's default backend "
            f"({jax.default_backend()}): they run on the CPU and on CUDA GPUs with jaxops' CUDA "
            f"module (build_info: {jaxops.build_info()}); run it with JAX_PLATFORMS=cpu"
        )
    gpu = H.is_gpu()
    cases = GPU_CASES.split(",") if gpu and args.case_list == CASES.split(",") else args.case_list
    rows = [_case(args, case) for case in cases]
    text = "grouped GEMM custom calls faster than the loop of XLA dots (xla/ffi >= 1)"
    goals = [H.worst_goal(rows, "speedup", 1.0, text, lambda r: r["case"])]
    if gpu:
        text = "on GPU, half the speed of one dense dot of the same FLOPs (dense/ffi >= 0.5)"
        goals.append(H.worst_goal(rows, "dense_ratio", 0.5, text, lambda r: r["case"]))
        fp8_rows = [r for r in rows if r["fp8_ratio"] is not None]
        if fp8_rows:
            text = (
                "block-scaled FP8 on CUTLASS's FP8 grouped GEMM, quantization included, vs "
                "bfloat16 on CUTLASS's (cutlass/fp8 cutlass >= 1.4)"
            )
            goals.append(H.worst_goal(fp8_rows, "fp8_ratio", 1.4, text, lambda r: r["case"]))
    tables = []
    if _grouped_gemm.activation_kernel_available():
        act_rows = [_act_case(args, case) for case in args.act_case_list]
        text = (
            "grouped activation calls at least as fast as XLA's fusion on every row "
            "(xla/calls >= 1)"
        )
        goals.append(H.worst_goal(act_rows, "ratio", 1.0, text, lambda r: r["case"]))
        title = (
            "the activation between the GEMMs (swiglu, fwd+bwd): the grouped activation calls on "
            "the U rows in groups vs XLA's fusion on all R rows"
        )
        tables.append(H.Table("activation", act_rows, ACT_COLUMNS, title))
    line = (
        f"times are medians of {args.repeats} samples of fwd+bwd; GFLOP/s counts "
        "3 x 2 x U x (D x 2F + F x D) on the U rows in groups (R = U + "
        f"{SPARE_ROWS} spare rows); dense: one dot per projection over the U rows"
    )
    return H.Result(rows, COLUMNS, goals, tables=tables, lines=[line])


def parse_args(argv: Sequence[str] | None = None):
    """Command-line options: the common ones (:func:`_harness.parser`) and the cases."""
    p = H.parser(__doc__, name="grouped_gemm", repeats=11, quick=f"case {QUICK_CASES}, 3 repeats")
    p.add_list("--cases", CASES, "comma-separated ExDxF:M (M: rows per expert)", quick=QUICK_CASES)
    p.add_list(
        "--act-cases",
        ACT_CASES,
        "comma-separated RxCxU of the activation table (CPU): h [R, C], U rows in groups",
        quick=QUICK_ACT_CASES,
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the group sizes and inputs")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument(
        "--ragged-dot-max-gib",
        type=float,
        default=16.0,
        help="on a GPU, time ragged_dot only where its dense operand is at most this many GiB",
    )
    args = p.parse_args(argv)
    for case in args.case_list:
        try:
            parse_case(case)
        except ValueError as e:
            p.error(str(e))
    for case in args.act_case_list:
        try:
            parse_act_case(case)
        except ValueError as e:
            p.error(str(e))
    return args


if __name__ == "__main__":
    sys.exit(H.main(parse_args, run, cpu_devices=1))
