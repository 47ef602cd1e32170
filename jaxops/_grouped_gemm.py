"""Grouped GEMM custom calls: consecutive groups of rows, each times its own matrix.

The expert layer's grouped GEMMs (:mod:`jaxops.parallel.expert`) run here, on XLA:CPU and on
CUDA GPUs. XLA lowers ``jax.lax.ragged_dot`` to one dense dot over every group for every row (a
masked ``[G, R, K]`` operand, G times the FLOPs); these calls compute each group's rows only.
The CUDA kernel (``xla_ffi/grouped_gemm/kernels.cuh``) tiles each group's product 128 x 128 x 32
through shared memory: tensor cores (WMMA, fp32 accumulation) for bfloat16 and float16, fp32
FMAs for float32; each CTA finds its group from the device-side sizes (no host round trip). It
first ran on an H200 on 2026-11-30: correct against float64 at every tested edge, memcheck and
racecheck clean; its speed is well below cuBLAS's dense GEMM (``benchmarks/results/h100``).
Float32 operands are multiplied in fp32 whatever :func:`jaxops.precision` says (no TF32: XLA:GPU's
default dots, TF32, differ from it by about 1e-3 relative); :func:`jaxops.precision_report`
lists these calls. ``JAXOPS_GPU_GEMM_PIPELINE=async`` (read at each call) gives the 16-bit
kernels four shared-memory stages filled by ``cp.async`` instead of the register-staged loads
(compiled, not yet run on a GPU).

``JAXOPS_GPU_GROUPED_GEMM=cublaslt`` (read when a call is traced, on a GPU default backend) runs
the calls on cuBLASLt's grouped matmul instead (``xla_ffi/grouped_gemm/cublaslt.cu``, targets
:data:`TARGET_GROUPED_GEMM_LT` and :data:`TARGET_WGRAD_LT`; compiled, not yet run on a GPU): a
one-CTA kernel turns the device-side sizes into cuBLASLt's per-group shapes and pointers, then one
``cublasLtMatmul`` runs every group, with fp32 accumulation. It needs a CUDA module built with
cuBLASLt and a libcublasLt with the grouped API for Hopper (cuBLAS 13.4 or newer:
``jaxops.build_info()["CUDA"]["cublaslt_grouped"]``; otherwise the call fails naming the version),
and takes bfloat16 and float16 calls whose x, w (dy) and output start 16-byte aligned with K and N
multiples of 8; other calls (float32 among them: cuBLASLt's grouped matmul has none) run jaxops'
kernels. Each call has a uint8 workspace (the per-group arrays and 32 MiB for cuBLASLt).

``JAXOPS_GPU_GROUPED_GEMM=cutlass`` runs them on CUTLASS's Hopper grouped GEMM instead
(``xla_ffi/grouped_gemm/cutlass_sm90.cu``, targets :data:`TARGET_GROUPED_GEMM_CUTLASS` and
:data:`TARGET_WGRAD_CUTLASS`; compiled, not yet run on a GPU): TMA loads and warp-specialized GMMA
with CUTLASS's persistent cooperative schedule, the problem shapes and matrix pointers in device
arrays that a setup kernel fills from the device-side sizes, fp32 accumulation and output. It
needs a CUDA module built for sm_90a with CUTLASS's headers (the nvidia-cutlass wheel at build
time: ``jaxops.build_info()["CUDA"]["cutlass"]`` names the version) and an sm_90 GPU (H100,
H200), and takes bfloat16 calls whose x, w (dy) and output start 16-byte aligned with K and N
multiples of 8; other calls run jaxops' kernels. Its workspace holds the per-group arrays and
CUTLASS's own (TMA descriptors per SM).

:func:`grouped_gemm_fp8` multiplies block-scaled FP8 operands (DeepSeek-V3's recipe: x in 1 x 128
groups along K, w in 128 x 128 tiles) on CUTLASS's Hopper grouped GEMM with blockwise scaling
(``xla_ffi/grouped_gemm/cutlass_fp8_sm90.cu``, target :data:`TARGET_GROUPED_GEMM_FP8_CUTLASS`),
and :func:`grouped_gemm_fp8_wgrad` its weight gradient from the per-expert transposes in
128-token groups (:data:`TARGET_WGRAD_FP8_CUTLASS`); compiled, not yet run on a GPU. They are
chosen as the bfloat16 CUTLASS kernels are (``JAXOPS_GPU_GROUPED_GEMM=cutlass``, an sm_90 GPU:
:func:`fp8_kernel_available`); elsewhere their pure-JAX twins (dequantize, ``ragged_dot`` and its
weight gradient in float32) run. The forward's kernel reads each group's scales of x as one
packed M-major matrix (:func:`group_packed_scales`).

The rows of group g are rows ``[start_g, start_g + group_sizes[g])``, from row 0 in order. The
kernels clip the sizes, which are device data: a negative size counts as 0, and no group reaches
past the last row. Outputs are float32 (fp32 accumulation), whatever the inputs' dtype (float32,
bfloat16 or float16).

- :func:`grouped_gemm`: ``y[rows of g] = x[rows of g] @ w[g]`` (``w[g].T`` with
  `transpose_w`); rows past the groups are zero (``zero_tail=False``: left unwritten). C++
  ``GroupedGemm`` <-> target ``"jaxops_grouped_gemm"`` <-> :data:`TARGET_GROUPED_GEMM`.
- :func:`grouped_gemm_wgrad`: ``dw[g] = x[rows of g].T @ dy[rows of g]``; a group without rows
  gets zeros. ``GroupedGemmWgrad`` <-> ``"jaxops_grouped_gemm_wgrad"`` <-> :data:`TARGET_WGRAD`.

The CPU micro-kernel is the widest the CPU has: AVX-512's (12 x 32 fp32 sums in registers), AVX2's
(6 x 16, with FMA), else a portable one the compiler vectorizes for the baseline.
``JAXOPS_CPU_GEMM_KERNEL`` (``avx512``, ``avx2`` or ``portable``) in the environment caps it (the
tests run each kernel the machine has so); ``jaxops.build_info()["cpu"]["grouped_gemm_kernel"]``
says which one runs.

- :func:`grouped_activation` / :func:`grouped_activation_bwd` (CPU only): the expert FFN's
  activation between its GEMMs (:data:`ACTIVATIONS`) and its gradient, on the groups' rows only;
  rows past the groups are zero (or, with ``zero_tail=False``, left unwritten). The expert
  layer's buffers are sized for the worst case of the
  routing (on 8 simulated devices about 640 of 2172 rows were in groups), and XLA's fusion takes
  an exp on every row of them. ``GroupedActivationFwd`` / ``GroupedActivationBwd`` <->
  ``"jaxops_grouped_activation_fwd"`` / ``"jaxops_grouped_activation_bwd"`` <->
  :data:`TARGET_ACTIVATION_FWD` / :data:`TARGET_ACTIVATION_BWD`. On a GPU XLA's fusion runs the
  activation (memory bandwidth there, not an exp per element of a CPU core).

``zero_tail=False`` is for a caller that reads the groups' rows only: the rows past the groups
then hold whatever the output buffer held (not zeros, possibly not finite), and the call skips
writing them. The expert layer's FFN passes it for its intermediates (the first GEMM's output,
the activation, and their gradients): on 8 simulated CPU devices three quarters of its
worst-case buffers' rows are past the groups, and zeroing them took 2.5% of the train step
(``bench_models.py``'s 4x256x16x2x256:16x128 on 2 x 4: 358.2 -> 349.4 ms).

All are plain custom calls (the expert layer's ``custom_vjp`` pairs them); their pure-JAX twins
are ``jax.lax.ragged_dot`` and its VJP (:func:`grouped_gemm_reference`,
:func:`grouped_gemm_wgrad_reference`) and :func:`activation_reference` on the groups' rows
(:func:`grouped_activation_reference`, :func:`grouped_activation_bwd_reference`), the tests'
oracles besides float64 numpy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import _checks, _ffi
from jaxops._config import resolve_impl
from jaxops._errors import ArgumentTypeError, InvalidArgumentError
from jaxops._fp8.scales import QuantizedArray, dequantize
from jaxops._fp8.split import SplitQuantized
from jaxops._sharding import vary_like

__all__ = [
    "ACTIVATIONS",
    "TARGET_ACTIVATION_BWD",
    "TARGET_ACTIVATION_FWD",
    "TARGET_GROUPED_GEMM",
    "FP8_BLOCK",
    "TARGET_GROUPED_GEMM_CUTLASS",
    "TARGET_GROUPED_GEMM_FP8_CUTLASS",
    "TARGET_WGRAD_FP8_CUTLASS",
    "TARGET_GROUPED_GEMM_LT",
    "TARGET_WGRAD",
    "TARGET_WGRAD_CUTLASS",
    "TARGET_WGRAD_LT",
    "activation_kernel_available",
    "activation_reference",
    "grouped_activation",
    "grouped_activation_bwd",
    "grouped_activation_bwd_reference",
    "grouped_activation_reference",
    "fp8_kernel_available",
    "fp8_kernel_runs",
    "group_packed_scales",
    "grouped_gemm",
    "grouped_gemm_fp8",
    "grouped_gemm_fp8_reference",
    "grouped_gemm_fp8_wgrad",
    "grouped_gemm_fp8_wgrad_reference",
    "grouped_gemm_reference",
    "grouped_gemm_wgrad",
    "grouped_gemm_wgrad_reference",
    "kernel_available",
]

TARGET_GROUPED_GEMM = "jaxops_grouped_gemm"
TARGET_WGRAD = "jaxops_grouped_gemm_wgrad"
TARGET_GROUPED_GEMM_LT = "jaxops_grouped_gemm_lt"
TARGET_WGRAD_LT = "jaxops_grouped_gemm_wgrad_lt"
TARGET_GROUPED_GEMM_CUTLASS = "jaxops_grouped_gemm_cutlass"
TARGET_WGRAD_CUTLASS = "jaxops_grouped_gemm_wgrad_cutlass"
TARGET_GROUPED_GEMM_FP8_CUTLASS = "jaxops_grouped_gemm_fp8_cutlass"
TARGET_WGRAD_FP8_CUTLASS = "jaxops_grouped_gemm_fp8_wgrad_cutlass"
TARGET_ACTIVATION_FWD = "jaxops_grouped_activation_fwd"
TARGET_ACTIVATION_BWD = "jaxops_grouped_activation_bwd"

#: The grouped activation calls' activations, in the order of their C++ codes (activation.h):
#: "swiglu" (``silu(gate) * up``, gate and up the halves of h's columns), "clamped_swiglu"
#: (gpt-oss: gate and up interleaved, ``gate = min(gate, limit)``,
#: ``up = clip(up, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``) and "silu".
ACTIVATIONS = ("swiglu", "clamped_swiglu", "silu")

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
#: The FP8 grouped GEMM's block: x in 1 x 128 groups along K, w in 128 x 128 tiles.
FP8_BLOCK = 128


def kernel_available(backend: str | None = None) -> bool:
    """Whether the custom calls run on `backend` (default: jax's default backend).

    True on the CPU, and on a CUDA GPU when jaxops' CUDA module is loaded.
    """
    backend = jax.default_backend() if backend is None else backend
    platform = {"cpu": "cpu", "gpu": "CUDA", "cuda": "CUDA"}.get(backend)
    if platform is None or (TARGET_GROUPED_GEMM, platform) not in set(_ffi.registered_targets()):
        return False
    if platform == "cpu":
        return True
    try:
        return _ffi.kernel_available(backend)  # not on ROCm
    except RuntimeError:  # no GPU backend in this process
        return False


def _check(op: str, name: str, a, ndim: int, dtype=None) -> jax.Array:
    """`a` as an array of rank `ndim` and dtype `dtype` (default: a float of :data:`_DTYPES`)."""
    want = _DTYPES if dtype is None else (dtype,)
    a = _checks.check_array(op, name, a, dtypes=tuple(np.dtype(d) for d in want))
    if a.ndim != ndim:
        raise InvalidArgumentError(f"{op}: {name} must have {ndim} dimensions, got shape {a.shape}")
    return a


def _check_sizes(op: str, group_sizes, groups: int) -> jax.Array:
    group_sizes = _check(op, "group_sizes", group_sizes, 1, jnp.int32)
    if group_sizes.shape != (groups,):
        raise InvalidArgumentError(
            f"{op}: group_sizes must be int32 [{groups}] (one size per group), got "
            f"{group_sizes.shape}"
        )
    return group_sizes


def grouped_gemm(
    x, w, group_sizes, *, transpose_w: bool = False, zero_tail: bool = True
) -> jax.Array:
    """``y[rows of g] = x[rows of g] @ w[g]`` for consecutive groups of rows, float32.

    Args:
      x: ``[R, K]`` float32, bfloat16 or float16.
      w: x's dtype, ``[G, K, N]`` (``[G, N, K]`` with `transpose_w`: read transposed, no copy).
      group_sizes: int32 ``[G]``; group g is the next ``group_sizes[g]`` rows of x.
      transpose_w: w's last two axes are ``[N, K]``.
      zero_tail: write zeros to the rows past the groups. False leaves them unwritten (whatever
        the buffer held, possibly not finite): only for a caller that never reads them.

    Returns:
      float32 ``[R, N]``; rows past the groups are zero (unspecified with ``zero_tail=False``).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops._grouped_gemm import grouped_gemm
      >>> x = jnp.ones((5, 3)); w = jnp.stack([jnp.eye(3), 2 * jnp.eye(3)])
      >>> grouped_gemm(x, w, jnp.array([2, 2], jnp.int32))[:, 0].tolist()
      [1.0, 1.0, 2.0, 2.0, 0.0]
    """
    op = "grouped_gemm"
    x = _check(op, "x", x, 2)
    w = _check(op, "w", w, 3, x.dtype)
    k = x.shape[1]
    wk, n = (w.shape[2], w.shape[1]) if transpose_w else (w.shape[1], w.shape[2])
    if wk != k:
        layout = "[G, N, K]" if transpose_w else "[G, K, N]"
        raise InvalidArgumentError(
            f"{op}: w must be {layout} with K = x.shape[1] = {k}; got {w.shape}"
        )
    group_sizes = _check_sizes(op, group_sizes, w.shape[0])
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    attrs = {"transpose_w": bool(transpose_w), "zero_tail": bool(zero_tail)}
    library = _library_target(op, False, x.dtype, k, n, w.shape[0])
    if library is None:
        return _ffi.ffi_call(TARGET_GROUPED_GEMM, out, x, w, group_sizes, **attrs)
    target, workspace = library
    y, _ = _ffi.ffi_call(target, (out, workspace), x, w, group_sizes, **attrs)
    return y


def grouped_gemm_wgrad(x, dy, group_sizes) -> jax.Array:
    """``dw[g] = x[rows of g].T @ dy[rows of g]``, float32 ``[G, K, N]``.

    Args:
      x: ``[R, K]`` float32, bfloat16 or float16.
      dy: x's dtype, ``[R, N]``.
      group_sizes: int32 ``[G]``, as in :func:`grouped_gemm`.

    Returns:
      float32 ``[G, K, N]``; groups without rows get zeros.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops._grouped_gemm import grouped_gemm_wgrad
      >>> dw = grouped_gemm_wgrad(jnp.ones((4, 2)), jnp.ones((4, 3)), jnp.array([3, 0], jnp.int32))
      >>> dw[:, 0, 0].tolist()
      [3.0, 0.0]
    """
    op = "grouped_gemm_wgrad"
    x = _check(op, "x", x, 2)
    dy = _check(op, "dy", dy, 2, x.dtype)
    if dy.shape[0] != x.shape[0]:
        raise InvalidArgumentError(
            f"{op}: dy must have x's {x.shape[0]} rows, got shape {dy.shape}"
        )
    group_sizes = _check(op, "group_sizes", group_sizes, 1, jnp.int32)
    out = jax.ShapeDtypeStruct((group_sizes.shape[0], x.shape[1], dy.shape[1]), jnp.float32)
    library = _library_target(op, True, x.dtype, x.shape[1], dy.shape[1], group_sizes.shape[0])
    if library is None:
        return _ffi.ffi_call(TARGET_WGRAD, out, x, dy, group_sizes)
    target, workspace = library
    dw, _ = _ffi.ffi_call(target, (out, workspace), x, dy, group_sizes)
    return dw


# JAXOPS_GPU_GROUPED_GEMM's library choices: (forward target, weight-gradient target, the CUDA
# module's workspace-size function, the dtypes the library takes, what the module needs).
_LIBRARIES = {
    "cublaslt": (
        TARGET_GROUPED_GEMM_LT,
        TARGET_WGRAD_LT,
        "grouped_gemm_lt_workspace_bytes",
        (jnp.bfloat16, jnp.float16),
        "cuBLASLt grouped GEMM",
    ),
    "cutlass": (
        TARGET_GROUPED_GEMM_CUTLASS,
        TARGET_WGRAD_CUTLASS,
        "grouped_gemm_cutlass_workspace_bytes",
        (jnp.bfloat16,),
        "CUTLASS grouped GEMM (it is built for sm_90a with CUTLASS's headers)",
    ),
}


def _library_target(
    op: str, wgrad: bool, dtype, k: int, n: int, groups: int
) -> tuple[str, jax.ShapeDtypeStruct] | None:
    """The library target of the call and its workspace, or None: jaxops' own calls run.

    A library's target runs where ``JAXOPS_GPU_GROUPED_GEMM`` names it when the call is traced,
    jax's default backend is a GPU and the call is one it takes: operands of a dtype it has whose
    rows (K and N) are whole 16-byte multiples (the handlers also run the kernels on operands that
    start unaligned). A CUDA module without it is then an error.
    """
    choice = _ffi.gpu_grouped_gemm()
    if choice not in _LIBRARIES or jax.default_backend() != "gpu":
        return None
    forward, backward, size_function, dtypes, what = _LIBRARIES[choice]
    if np.dtype(dtype) not in tuple(np.dtype(d) for d in dtypes) or k % 8 or n % 8:
        return None
    workspace_bytes = _ffi.cuda_module_function(size_function)
    if workspace_bytes is None:
        raise RuntimeError(
            f"{op}: JAXOPS_GPU_GROUPED_GEMM={choice}, but jaxops' CUDA module has no {what} "
            f"({_ffi.build_info().get('CUDA', 'no CUDA module')}); unset it to run jaxops' "
            "kernels"
        )
    target = backward if wgrad else forward
    _ffi.ensure_registered(target)
    return target, jax.ShapeDtypeStruct((int(workspace_bytes(groups)),), jnp.uint8)


def _clipped(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The kernels' reading of the sizes: negative as 0, none past the last row."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), rows)
    return jnp.diff(ends, prepend=0).astype(jnp.int32)


def grouped_gemm_reference(x, w, group_sizes, *, transpose_w: bool = False) -> jax.Array:
    """The pure-JAX twin of :func:`grouped_gemm` (``jax.lax.ragged_dot``, float32)."""
    w = jnp.swapaxes(w, 1, 2) if transpose_w else w
    sizes = _clipped(group_sizes, x.shape[0])
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)


def grouped_gemm_wgrad_reference(x, dy, group_sizes) -> jax.Array:
    """The pure-JAX twin of :func:`grouped_gemm_wgrad` (``ragged_dot``'s VJP, float32)."""
    sizes = _clipped(group_sizes, x.shape[0])
    shape = (group_sizes.shape[0], x.shape[1], dy.shape[1])
    # Inside shard_map the zero primal varies like x and dy: invariant, its gradient would be
    # the sum over the devices (of every device's groups).
    _, vjp = jax.vjp(
        lambda w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32),
        vary_like(jnp.zeros(shape, x.dtype), x, dy, group_sizes),
    )
    return vjp(dy.astype(jnp.float32))[0].astype(jnp.float32)


# -------------------------------------------------------------------------------------------------
# The block-scaled FP8 grouped GEMM (DeepSeek-V3's recipe) on CUTLASS's Hopper kernel.


def fp8_kernel_available(backend: str | None = None) -> bool:
    """Whether :func:`grouped_gemm_fp8`'s CUTLASS kernel runs on `backend` (default: jax's).

    True on an sm_90 GPU (H100, H200) when jaxops' CUDA module was built for sm_90a with
    CUTLASS's headers and ``JAXOPS_GPU_GROUPED_GEMM=cutlass`` (read when a call is traced: the
    kernel has not run on a GPU yet, so it is chosen as the bfloat16 CUTLASS kernels are);
    everywhere else the call runs its pure-JAX twin.
    """
    backend = jax.default_backend() if backend is None else backend
    if backend not in ("gpu", "cuda") or _ffi.gpu_grouped_gemm() != "cutlass":
        return False
    if not kernel_available(backend):
        return False
    if _ffi.cuda_module_function("grouped_gemm_fp8_cutlass_workspace_bytes") is None:
        return False
    return getattr(jax.devices(backend)[0], "compute_capability", None) == "9.0"


def fp8_kernel_runs(shape: tuple[int, int, int, int], impl=None, op: str = "grouped_gemm_fp8"):
    """Whether :func:`grouped_gemm_fp8` of float8_e4m3fn operands runs its CUTLASS kernel.

    shape: ``(R, K, N, G)``. The kernel runs where :func:`fp8_kernel_available` and `impl`
    allows it (None: where it runs; "ffi": required, an error where it does not run at all),
    for problems with K and N multiples of 16 (TMA's 16-byte rows) and every size of 1 to
    ``2**31 - 1``; otherwise the twin runs.
    """
    if resolve_impl(impl, kernel_available=fp8_kernel_available(), op=op) == "xla":
        return False
    _, k, n, _ = shape
    return min(shape) > 0 and max(shape) < 2**31 and k % 16 == 0 and n % 16 == 0


def _check_quantized(op: str, name: str, q, ndim: int, block: tuple[int, int]) -> QuantizedArray:
    if not isinstance(q, QuantizedArray):
        raise ArgumentTypeError(
            f"{op}: {name} must be a jaxops.fp8.QuantizedArray, got {type(q).__name__}"
        )
    if q.ndim != ndim or q.block != block:
        raise InvalidArgumentError(
            f"{op}: {name} must be {ndim}-D, quantized in {block[0]} x {block[1]} blocks of its "
            f"data; got shape {q.shape}, block={q.block}"
        )
    return q


def _fp8_rows_first(q: QuantizedArray) -> tuple[jax.Array, jax.Array]:
    """The data ``[R, K]`` and scales ``[R, KB]`` of x (1 x 128 groups along K)."""
    rows, kb = q.data.shape[0], -(-q.data.shape[1] // FP8_BLOCK)
    scale = jnp.swapaxes(q.scale, 0, 1)[:rows] if q.scale_layout == "col_tma" else q.scale
    return q.data, scale.reshape(rows, kb)


def _fp8_k_major(q: QuantizedArray) -> tuple[jax.Array, jax.Array]:
    """The data ``[G, N, K]`` and tile scales ``[G, KB, NB]`` of w, as CUTLASS reads them.

    The data K-major (transposed by XLA when w's is ``[G, K, N]``), the scales N-major.
    """
    data, scale = q.data, q.scale
    grid = (-(-data.shape[1] // FP8_BLOCK), -(-data.shape[2] // FP8_BLOCK))  # data's tile grid
    if q.scale_layout == "col_tma":  # [G, cols, pad4(rows)] -> [G, rows, cols]
        scale = jnp.swapaxes(scale, 1, 2)[:, : grid[0]]
    # scale is now [G, data rows / 128, data cols / 128]
    if q.transposed:  # data [G, N, K]: tiles [G, NB, KB]
        return data, jnp.swapaxes(scale, 1, 2)
    return jnp.swapaxes(data, 1, 2), scale  # data [G, K, N]: tiles [G, KB, NB] already


def group_packed_scales(scale: jax.Array, sizes: jax.Array) -> jax.Array:
    """Row scales ``[R, KB]`` laid out as CUTLASS's grouped kernel reads them: ``[R * KB]``.

    Each group's scales form one packed M-major matrix: the scale of the group's row i (counting
    from its first row, ``start``) and K block b is at ``start * KB + b * m + i``, m the group's
    rows. `sizes` are the clipped group sizes (:func:`_clipped`); rows past the groups keep
    their row-major places, so the layout is a permutation of the ``R * KB`` scales.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops._grouped_gemm import group_packed_scales
      >>> s = jnp.arange(8.0).reshape(4, 2)  # 4 rows, 2 K blocks
      >>> group_packed_scales(s, jnp.array([3, 0], jnp.int32)).tolist()
      [0.0, 2.0, 4.0, 1.0, 3.0, 5.0, 6.0, 7.0]
    """
    rows, kb = scale.shape
    if sizes.shape[0] == 0 or rows == 0:
        return scale.reshape(-1)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    row = jnp.arange(rows, dtype=jnp.int32)
    group = jnp.searchsorted(ends, row, side="right")
    inside = group < sizes.shape[0]
    group = jnp.minimum(group, sizes.shape[0] - 1)
    start, m = starts[group][:, None], sizes[group][:, None]
    block = jnp.arange(kb, dtype=jnp.int32)[None, :]
    packed = start * kb + block * m + (row[:, None] - start)
    dst = jnp.where(inside[:, None], packed, row[:, None] * kb + block)
    flat = jnp.zeros((rows * kb,), scale.dtype)
    return flat.at[dst.reshape(-1)].set(scale.reshape(-1), unique_indices=True, mode="drop")


def grouped_gemm_fp8(
    x: QuantizedArray,
    w: QuantizedArray,
    group_sizes,
    *,
    zero_tail: bool = True,
    impl: str | None = None,
) -> jax.Array:
    """``y[rows of g] = dequant(x)[rows of g] @ dequant(w)[g]`` on FP8 tensor cores, float32.

    DeepSeek-V3's block scaling: x in 1 x 128 groups along K, w in 128 x 128 tiles. On an sm_90
    GPU with jaxops' CUDA module built with CUTLASS (:func:`fp8_kernel_available`), CUTLASS's
    Hopper grouped GEMM with blockwise scaling (``xla_ffi/grouped_gemm/cutlass_fp8_sm90.cu``,
    :data:`TARGET_GROUPED_GEMM_FP8_CUTLASS`): every 128-deep slice of K is accumulated in fp32 and
    promoted through its two scales; the group sizes stay on the device. It takes float8_e4m3fn
    operands with K and N multiples of 16; other calls, and other platforms, run the twin
    (:func:`grouped_gemm_fp8_reference`: dequantize, multiply in float32).

    Hopper's FP8 tensor cores read both operands K-major: give w transposed (data
    ``[G, N, K]``, as ``quantize(w, block=(128, 128), transpose=True)[1]`` gives it). A w whose
    data is ``[G, K, N]`` is transposed by XLA first (one pass over w); the data ``[G, K, N]``
    with ``transposed=True`` is the K-major operand of the product with ``w[g]ᵀ`` (a backward
    input gradient).

    Args:
      x: :class:`jaxops.fp8.QuantizedArray`, logical ``[R, K]``, block ``(1, 128)``, not
        transposed (scale layout "row" or "col_tma").
      w: QuantizedArray, logical ``[G, K, N]``, block ``(128, 128)``.
      group_sizes: int32 ``[G]``; group g is the next ``group_sizes[g]`` rows of x (clipped as
        :func:`grouped_gemm` clips them).
      zero_tail: write zeros to the rows past the groups (False: unspecified, for a caller that
        never reads them).
      impl: None (the kernel where it runs, else the twin), "ffi" (the kernel, required) or
        "xla" (the twin).

    Returns:
      float32 ``[R, N]``; rows past the groups are zero.

    Example:
      >>> import jax, jax.numpy as jnp, jaxops
      >>> from jaxops._grouped_gemm import grouped_gemm_fp8
      >>> x = jaxops.fp8.quantize(jnp.ones((5, 128)), block=(1, 128))
      >>> w = jaxops.fp8.quantize(jnp.ones((2, 128, 16)), block=(128, 128), transpose=True)[1]
      >>> grouped_gemm_fp8(x, w, jnp.array([2, 2], jnp.int32))[:, 0].tolist()
      [128.0, 128.0, 128.0, 128.0, 0.0]
    """
    op = "grouped_gemm_fp8"
    x = _check_quantized(op, "x", x, 2, (1, FP8_BLOCK))
    w = _check_quantized(op, "w", w, 3, (FP8_BLOCK, FP8_BLOCK))
    if x.transposed:
        raise InvalidArgumentError(
            f"{op}: x must hold its own data [R, K] (1 x 128 groups along K), not its transpose"
        )
    (rows, k), (groups, wk, n) = x.shape, w.shape
    if wk != k:
        raise InvalidArgumentError(
            f"{op}: w must be logically [G, K, N] with K = x.shape[1] = {k}; got {w.shape}"
        )
    group_sizes = _check_sizes(op, group_sizes, groups)
    e4m3 = np.dtype(jnp.float8_e4m3fn)
    kernel = fp8_kernel_runs((rows, k, n, groups), impl, op)
    if not kernel or x.dtype != e4m3 or w.dtype != e4m3:
        return _fp8_twin(x, w, group_sizes)
    x_data, x_scale = _fp8_rows_first(x)
    w_data, w_scale = _fp8_k_major(w)
    sizes = _clipped(group_sizes, rows)
    x_scale = group_packed_scales(x_scale.astype(jnp.float32), sizes)
    size_function = _ffi.cuda_module_function("grouped_gemm_fp8_cutlass_workspace_bytes")
    workspace = jax.ShapeDtypeStruct((int(size_function(groups)),), jnp.uint8)
    out = jax.ShapeDtypeStruct((rows, n), jnp.float32)
    _ffi.ensure_registered(TARGET_GROUPED_GEMM_FP8_CUTLASS)
    y, _ = _ffi.ffi_call(
        TARGET_GROUPED_GEMM_FP8_CUTLASS,
        (out, workspace),
        x_data,
        x_scale,
        w_data,
        w_scale.astype(jnp.float32),
        group_sizes,
        zero_tail=bool(zero_tail),
    )
    return y


def _fp8_twin(x: QuantizedArray, w: QuantizedArray, group_sizes: jax.Array) -> jax.Array:
    sizes = _clipped(group_sizes, x.shape[0])
    return jax.lax.ragged_dot(
        dequantize(x, jnp.float32),
        dequantize(w, jnp.float32),
        sizes,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def grouped_gemm_fp8_reference(
    x: QuantizedArray, w: QuantizedArray, group_sizes, *, zero_tail: bool = True
) -> jax.Array:
    """The pure-JAX twin of :func:`grouped_gemm_fp8` (its arguments but `impl`).

    Dequantizes both operands and multiplies them with ``jax.lax.ragged_dot`` in float32 at full
    precision.
    """
    return grouped_gemm_fp8(x, w, group_sizes, zero_tail=zero_tail, impl="xla")


_checks.twin_signature(grouped_gemm_fp8_reference, grouped_gemm_fp8)


def _check_split(op: str, name: str, q) -> SplitQuantized:
    if not isinstance(q, SplitQuantized):
        raise ArgumentTypeError(
            f"{op}: {name} must be a jaxops.fp8.SplitQuantized "
            f"(jaxops.fp8.quantize_split_transpose), got {type(q).__name__}"
        )
    if q.group != FP8_BLOCK:
        raise InvalidArgumentError(
            f"{op}: {name} must be quantized in groups of {FP8_BLOCK} tokens, got {q.group}"
        )
    return q


def grouped_gemm_fp8_wgrad(xs, dys, *, impl: str | None = None) -> jax.Array:
    """``dw[g] = dequant(x)[rows of g]ᵀ @ dequant(dy)[rows of g]`` on FP8 tensor cores, float32.

    The weight gradient of DeepSeek-V3's recipe: x and dy transposed per expert and quantized in
    groups of 128 of the expert's tokens (:func:`jaxops.fp8.quantize_split_transpose`, split by the
    same group sizes: the kernel reads xs's offsets and sizes for both). On an sm_90 GPU with
    ``JAXOPS_GPU_GROUPED_GEMM=cutlass`` (:func:`fp8_kernel_available`), CUTLASS's blockwise-scaled
    grouped GEMM (:data:`TARGET_WGRAD_FP8_CUTLASS`; each expert a problem ``K x N`` reduced over
    its tokens, every 128 of them promoted through their scales); it takes float8_e4m3fn splits
    with K and N multiples of 16. Other calls, and other platforms, run the twin
    (:func:`grouped_gemm_fp8_wgrad_reference`).

    Args:
      xs: :class:`jaxops.fp8.SplitQuantized` of x ``[M, K]`` in groups of 128 tokens.
      dys: the same of dy ``[M, N]``, split by the same group sizes.
      impl: None (the kernel where it runs, else the twin), "ffi" (the kernel, required) or
        "xla" (the twin).

    Returns:
      float32 ``[G, K, N]``; experts without rows get zeros.

    Example:
      >>> import jax.numpy as jnp, jaxops
      >>> from jaxops._grouped_gemm import grouped_gemm_fp8_wgrad
      >>> sizes = jnp.array([3, 0], jnp.int32)
      >>> xs = jaxops.fp8.quantize_split_transpose(jnp.ones((4, 16)), sizes)
      >>> dys = jaxops.fp8.quantize_split_transpose(jnp.ones((4, 32)), sizes)
      >>> grouped_gemm_fp8_wgrad(xs, dys)[:, 0, 0].tolist()
      [3.0, 0.0]
    """
    op = "grouped_gemm_fp8_wgrad"
    xs = _check_split(op, "xs", xs)
    dys = _check_split(op, "dys", dys)
    if (
        dys.num_rows != xs.num_rows
        or dys.sizes.shape != xs.sizes.shape
        or dys.data.shape[1:] != xs.data.shape[1:]
    ):
        raise InvalidArgumentError(
            f"{op}: xs and dys must split the same rows by the same groups; got xs of "
            f"{xs.num_rows} rows in {xs.sizes.shape[0]} groups (data {xs.data.shape}), dys of "
            f"{dys.num_rows} rows in {dys.sizes.shape[0]} groups (data {dys.data.shape})"
        )
    # dy's layout read through x's offsets and sizes, in the twin as in the kernel.
    dys = dataclasses.replace(
        dys, col_offsets=xs.col_offsets, scale_offsets=xs.scale_offsets, sizes=xs.sizes
    )
    (k, columns), n, groups = xs.data.shape, dys.data.shape[0], xs.sizes.shape[0]
    e4m3 = np.dtype(jnp.float8_e4m3fn)
    kernel = fp8_kernel_runs((columns, k, n, groups), impl, op)
    if not kernel or xs.data.dtype != e4m3 or dys.data.dtype != e4m3 or xs.num_rows == 0:
        return _fp8_wgrad_twin(xs, dys)
    size_function = _ffi.cuda_module_function("grouped_gemm_fp8_cutlass_workspace_bytes")
    workspace = jax.ShapeDtypeStruct((int(size_function(groups)),), jnp.uint8)
    out = jax.ShapeDtypeStruct((groups, k, n), jnp.float32)
    _ffi.ensure_registered(TARGET_WGRAD_FP8_CUTLASS)
    dw, _ = _ffi.ffi_call(
        TARGET_WGRAD_FP8_CUTLASS,
        (out, workspace),
        xs.data,
        jnp.swapaxes(xs.scale, 0, 1).astype(jnp.float32),  # [S, K]: M-major, packed per group
        dys.data,
        jnp.swapaxes(dys.scale, 0, 1).astype(jnp.float32),
        xs.col_offsets,
        xs.scale_offsets,
        xs.sizes,
    )
    return dw


def _fp8_wgrad_twin(xs: SplitQuantized, dys: SplitQuantized) -> jax.Array:
    x, dy = xs.dequantize(jnp.float32), dys.dequantize(jnp.float32)
    shape = (xs.sizes.shape[0], x.shape[1], dy.shape[1])
    _, vjp = jax.vjp(
        lambda w: jax.lax.ragged_dot(
            x,
            w,
            xs.sizes,
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        ),
        vary_like(jnp.zeros(shape, jnp.float32), x, dy, xs.sizes),
    )
    return vjp(dy)[0]


def grouped_gemm_fp8_wgrad_reference(xs, dys) -> jax.Array:
    """The pure-JAX twin of :func:`grouped_gemm_fp8_wgrad` (its arguments but `impl`).

    Dequantizes both splits back to rows and takes ``jax.lax.ragged_dot``'s weight gradient in
    float32 at full precision.
    """
    return grouped_gemm_fp8_wgrad(xs, dys, impl="xla")


_checks.twin_signature(grouped_gemm_fp8_wgrad_reference, grouped_gemm_fp8_wgrad)


# -------------------------------------------------------------------------------------------------
# The expert FFN's activation on the groups' rows.


def activation_kernel_available(backend: str | None = None) -> bool:
    """Whether the grouped activation calls run on `backend` (default: jax's default backend).

    True on the CPU (the calls have no CUDA kernel: on a GPU XLA's fusion runs the activation).
    """
    backend = jax.default_backend() if backend is None else backend
    return backend == "cpu" and (TARGET_ACTIVATION_FWD, "cpu") in set(_ffi.registered_targets())


def _check_activation(op: str, activation: str, alpha: float, limit: float) -> None:
    if activation not in ACTIVATIONS:
        raise InvalidArgumentError(
            f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}"
        )
    if activation == "clamped_swiglu":
        for name, value in (("alpha", alpha), ("limit", limit)):
            if not (np.isfinite(value) and value > 0):
                raise InvalidArgumentError(f"{op}: {name} must be finite and > 0, got {value!r}")


def _check_h(op: str, h, activation: str) -> tuple[jax.Array, int]:
    """The checked h (float32 ``[R, C]``) and F, the activation's columns."""
    h = _check(op, "h", h, 2, jnp.float32)
    gated = activation != "silu"
    if gated and h.shape[1] % 2:
        raise InvalidArgumentError(
            f"{op}: {activation} needs an even number of columns in h (gate and up), got "
            f"shape {h.shape}"
        )
    return h, h.shape[1] // 2 if gated else h.shape[1]


def _attrs(activation: str, alpha: float, limit: float) -> dict:
    return {
        "activation": np.int32(ACTIVATIONS.index(activation)),
        "alpha": np.float32(alpha),
        "limit": np.float32(limit),
    }


def grouped_activation(
    h,
    group_sizes,
    activation: str,
    *,
    dtype=jnp.float32,
    alpha: float = 1.702,
    limit: float = 7.0,
    zero_tail: bool = True,
) -> jax.Array:
    """The activation of the groups' rows of h, in `dtype`; rows past the groups are zero.

    Args:
      h: float32 ``[R, C]``: the first expert GEMM's output (C even for the gated activations).
      group_sizes: int32 ``[G]``, as in :func:`grouped_gemm` (only their clipped sum matters).
      activation: one of :data:`ACTIVATIONS`.
      dtype: the output's dtype: float32, bfloat16 or float16 (computed in float32, rounded).
      alpha: clamped_swiglu's sigmoid scale (finite, > 0; gpt-oss's 1.702 by default).
      limit: clamped_swiglu's clamp (finite, > 0; gpt-oss's 7.0 by default).
      zero_tail: write zeros to the rows past the groups; False leaves them unwritten, as in
        :func:`grouped_gemm`.

    Returns:
      ``[R, F]`` in `dtype`: F = C / 2 for the gated activations, else C.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops._grouped_gemm import grouped_activation
      >>> h = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # gate | up
      >>> a = grouped_activation(h, jnp.array([2], jnp.int32), "swiglu")  # silu(gate) * up
      >>> [round(v, 4) for v in a[:, 0].tolist()]
      [1.4621, 11.4309, 0.0]
    """
    op = "grouped_activation"
    _check_activation(op, activation, alpha, limit)
    h, f = _check_h(op, h, activation)
    group_sizes = _check(op, "group_sizes", group_sizes, 1, jnp.int32)
    if np.dtype(dtype) not in tuple(np.dtype(d) for d in _DTYPES):
        raise InvalidArgumentError(f"{op}: dtype must be float32, bfloat16 or float16, got {dtype}")
    out = jax.ShapeDtypeStruct((h.shape[0], f), dtype)
    return _ffi.ffi_call(
        TARGET_ACTIVATION_FWD,
        out,
        h,
        group_sizes,
        zero_tail=bool(zero_tail),
        **_attrs(activation, alpha, limit),
    )


def grouped_activation_bwd(
    h,
    da,
    group_sizes,
    activation: str,
    *,
    alpha: float = 1.702,
    limit: float = 7.0,
    zero_tail: bool = True,
) -> jax.Array:
    """The gradient of :func:`grouped_activation` with respect to h: float32 ``[R, C]``.

    Args:
      h: float32 ``[R, C]``, as in :func:`grouped_activation`.
      da: ``[R, F]`` float32, bfloat16 or float16: the output's gradient.
      group_sizes: int32 ``[G]``, as in :func:`grouped_activation`.
      activation: one of :data:`ACTIVATIONS`.
      alpha: clamped_swiglu's sigmoid scale, as in :func:`grouped_activation`.
      limit: clamped_swiglu's clamp, as in :func:`grouped_activation`.
      zero_tail: write zeros to the rows past the groups; False leaves them unwritten, as in
        :func:`grouped_gemm`.

    Returns:
      float32 ``[R, C]``: JAX's gradient of the activation times da on the groups' rows (a tie
      of clamped_swiglu's min or clip takes half the gradient, as jax.numpy's do); rows past
      the groups are zero (unspecified with ``zero_tail=False``).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops._grouped_gemm import grouped_activation_bwd
      >>> h, da = jnp.array([[0.0, 3.0]]), jnp.ones((1, 1))
      >>> grouped_activation_bwd(h, da, jnp.array([1], jnp.int32), "swiglu").tolist()
      [[1.5, 0.0]]
    """
    op = "grouped_activation_bwd"
    _check_activation(op, activation, alpha, limit)
    h, f = _check_h(op, h, activation)
    da = _check(op, "da", da, 2)
    if da.shape != (h.shape[0], f):
        raise InvalidArgumentError(
            f"{op}: da must be [{h.shape[0]}, {f}] for h {h.shape}, got {da.shape}"
        )
    group_sizes = _check(op, "group_sizes", group_sizes, 1, jnp.int32)
    out = jax.ShapeDtypeStruct(h.shape, jnp.float32)
    return _ffi.ffi_call(
        TARGET_ACTIVATION_BWD,
        out,
        h,
        da,
        group_sizes,
        zero_tail=bool(zero_tail),
        **_attrs(activation, alpha, limit),
    )


def activation_reference(h, activation: str, alpha: float = 1.702, limit: float = 7.0):
    """The activation in pure JAX on every row of ``h [..., C]`` (h's dtype): ``[..., F]``."""
    if activation == "swiglu":
        gate, up = jnp.split(h, 2, axis=-1)
        return jax.nn.silu(gate) * up
    if activation == "clamped_swiglu":
        gate, up = h[..., 0::2], h[..., 1::2]
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))
    return jax.nn.silu(h)


def _in_groups(group_sizes, rows: int) -> jax.Array:
    """Whether each row is in a group, bool ``[R, 1]`` (sizes clipped as the kernels clip them)."""
    used = jnp.sum(_clipped(group_sizes, rows))
    return (jnp.arange(rows) < used)[:, None]


def grouped_activation_reference(
    h, group_sizes, activation: str, *, dtype=jnp.float32, alpha: float = 1.702, limit: float = 7.0
) -> jax.Array:
    """The pure-JAX twin of :func:`grouped_activation`."""
    a = activation_reference(h.astype(jnp.float32), activation, alpha, limit)
    return jnp.where(_in_groups(group_sizes, h.shape[0]), a, 0).astype(dtype)


def grouped_activation_bwd_reference(
    h, da, group_sizes, activation: str, *, alpha: float = 1.702, limit: float = 7.0
) -> jax.Array:
    """The pure-JAX twin of :func:`grouped_activation_bwd` (the activation's VJP, float32)."""
    # Inside shard_map h varies like da (an invariant h with a varying da is refused by vjp).
    h = vary_like(h, h, da, group_sizes)
    _, vjp = jax.vjp(lambda x: activation_reference(x, activation, alpha, limit), h)
    dh = vjp(da.astype(jnp.float32))[0]
    return jnp.where(_in_groups(group_sizes, h.shape[0]), dh, 0).astype(jnp.float32)
