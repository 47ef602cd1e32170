"""FP8 GEMM: ``jaxops.fp8.gemm`` (per-tensor or block-scaled operands) and its twin.

On CUDA, cuBLASLt's scaled FP8 matmul (:mod:`jaxops._cublaslt`), per tensor (``SCALAR_32F``) or
with block scales (``VEC128_32F`` for 1 x 128 groups along K, ``BLK128x128_32F`` for 128 x 128
tiles; cuBLAS >= 12.9 on sm_90), so no kernel of our own is needed on Hopper. Problems cuBLASLt
cannot take (K not a multiple of 16, or of 128 with block scales; a float32 output; both operands
e5m2; N not a multiple of 8; M not a multiple of 4 with a in 1 x 128 groups), and every other
platform, run the reference: dequantize + dot, in float32. The last two conditions were measured
on an H100 (cuBLAS 13.0): its heuristic finds no algorithm for them ("the requested
functionality is not supported") at N = 130, 260, 516 in every scaling and at M = 130, 250 with
1 x 128 groups on a, while N = 200 and M = 130 in 128 x 128 tiles ran.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import _checks
from jaxops._config import resolve_impl
from jaxops._cublaslt import (
    FUSED_ACTIVATIONS,
    activate,
    check_activation,
    gemm_fp8_call,
    kernel_available,
)
from jaxops._errors import ArgumentTypeError, InvalidArgumentError
from jaxops._fp8.scales import QuantizedArray, dequantize

__all__ = ["BLOCK", "fp8_gemm", "fp8_gemm_reference"]

#: The block size of the block-scaled GEMM (1 x 128 groups, 128 x 128 tiles).
BLOCK = 128


def _operand_mode(op: str, name: str, q: QuantizedArray, k_axis_of_data: int) -> str:
    """The scaling mode of `q` along the contraction, or a clear error."""
    if q.block is None:
        return "tensor"
    if q.block == (BLOCK, BLOCK):
        return "tiles"
    if q.block == (1, BLOCK) and k_axis_of_data == 1:
        return "rows"
    raise InvalidArgumentError(
        f"{op}: {name} must be quantized per tensor, in 1 x 128 groups along K or in 128 x 128 "
        f"tiles; got block={q.block} with transposed={q.transposed} (its groups run along "
        f"{'K' if k_axis_of_data == 1 else 'the non-contracted axis'})"
    )


def _kernel_scale(mode: str, q: QuantizedArray, transpose_data: bool) -> jax.Array:
    """Q's scales as cuBLASLt takes them.

    1 x 128 groups (``VEC128_32F``): ``[KB, pad4(rows)]``, rows contiguous. 128 x 128 tiles
    (``BLK128x128_32F``): ``[row blocks, pad4(KB)]``, K blocks contiguous (rows: M for a, N for
    b; measured on an H100: the tile grid in the groups' layout gives wrong products).
    """
    scale = q.scale.astype(jnp.float32)
    if mode == "tensor":
        return scale.reshape(())
    # Our layouts, in data's coordinates: "row" [RB, KB], "col_tma" [KB, pad4(RB)].
    grid = jnp.swapaxes(scale, -1, -2) if q.scale_layout == "col_tma" else scale
    rows = q.data.shape[0] if mode == "rows" else -(-q.data.shape[0] // BLOCK)
    grid = grid[:rows] if q.scale_layout == "col_tma" else grid
    if transpose_data:  # tiles: the tile grid transposes with the data
        grid = grid.T
    # grid: [operand row blocks, KB]
    if mode == "tiles":
        pad = (-grid.shape[1]) % 4
        return jnp.pad(grid, ((0, 0), (0, pad))) if pad else grid
    kernel = grid.T  # [KB, rows]
    pad = (-kernel.shape[1]) % 4
    return jnp.pad(kernel, ((0, 0), (0, pad))) if pad else kernel


def _lt_takes(m: int, n: int, a_mode: str) -> bool:
    """Whether cuBLASLt's FP8 matmul has an algorithm for M x N (see the module docstring).

    Measured, not documented by cuBLAS; presumably 16-byte alignment: N % 8 of the bf16 / f16
    output's rows, M % 4 of the rows of a's 1 x 128 group scales ([K / 128, M], M contiguous).
    """
    return n % 8 == 0 and (a_mode != "rows" or m % 4 == 0)


def _fp8_reference(a, b, bias, activation, out_dtype):
    y = jnp.matmul(
        dequantize(a, jnp.float32),
        dequantize(b, jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return activate(activation, y).astype(out_dtype)


def _fp8_validate(op, a, b, bias, activation, out_dtype):
    for name, q in (("a", a), ("b", b)):
        if not isinstance(q, QuantizedArray):
            raise ArgumentTypeError(
                f"{op}: {name} must be a jaxops.fp8.QuantizedArray, got {type(q).__name__}"
            )
        if len(q.shape) != 2:
            raise InvalidArgumentError(
                f"{op}: {name} must be a matrix, got logical shape {q.shape}"
            )
    (m, k), (b_k, n) = a.shape, b.shape
    if b_k != k:
        raise InvalidArgumentError(
            f"{op}: a [M, K] and b [K, N] must share K; got {a.shape} and {b.shape}"
        )
    out = np.dtype(out_dtype)
    if out not in _checks.FLOAT_DTYPES:
        raise ArgumentTypeError(
            f"{op}: out_dtype must be float32, bfloat16 or float16; got {out.name}"
        )
    activation = check_activation(op, activation)
    if bias is not None:
        bias = _checks.check_array(op, "bias", bias)
        if bias.shape != (n,):
            raise InvalidArgumentError(f"{op}: bias must be [{n}], got {bias.shape}")
    # a's data [M, K] holds K on axis 1 unless transposed; b's logical [K, N] holds K on axis 1
    # of its data only when transposed (data [N, K]).
    a_mode = _operand_mode(op, "a", a, 0 if a.transposed else 1)
    b_mode = _operand_mode(op, "b", b, 1 if b.transposed else 0)
    if (a_mode == "tensor") != (b_mode == "tensor"):
        raise InvalidArgumentError(
            f"{op}: a and b must both be per-tensor or both block-scaled; got {a_mode} and {b_mode}"
        )
    if a_mode == b_mode == "tiles":
        raise InvalidArgumentError(
            f"{op}: at most one of a and b may use 128 x 128 tiles (cuBLASLt)"
        )
    return m, k, n, out, activation, bias, a_mode, b_mode


def fp8_gemm(
    a: QuantizedArray,
    b: QuantizedArray,
    *,
    bias: jax.Array | None = None,
    activation: str | None = None,
    out_dtype: Any = jnp.bfloat16,
    impl: str | None = None,
) -> jax.Array:
    """``act(dequant(a) @ dequant(b) + bias)`` on FP8 tensor cores, fp32 accumulation.

    Scalings: both per tensor (``block=None``), or block-scaled with at most one operand in
    128 x 128 tiles — the DeepSeek-V3 recipe is a in 1 x 128 groups along K
    (``quantize(x, block=(1, 128))``) and b in 128 x 128 tiles. On CUDA: cuBLASLt's scaled FP8
    matmul (block modes of cuBLAS >= 12.9 on sm_90). Hopper's FP8 tensor cores take both operands
    K-major: b is best given as the transposed copy (``quantize(w, ..., transpose=True)[1]``,
    data ``[N, K]``); a b whose data is ``[K, N]`` is transposed by XLA first (tiles only; a
    1 x 128 b must group along K). Elsewhere, and for problems cuBLASLt cannot take (see the module
    docstring), the reference: dequantize both, multiply in float32.

    Args:
      a: QuantizedArray, logical ``[M, K]``.
      b: QuantizedArray, logical ``[K, N]``.
      bias: None or ``[N]`` (any float dtype; added in fp32).
      activation: None, "relu", "gelu", "gelu_tanh" or "silu".
      out_dtype: bfloat16 (default), float16 or float32 (float32 runs the reference).
      impl: None, "ffi" or "xla".

    Returns:
      ``[M, N]`` in out_dtype.

    Raises:
      TypeError / ValueError: operands that are not QuantizedArrays, mismatched K, a block layout
        the GEMM cannot take (groups not along K, two tiled operands, per-tensor mixed with
        blocks), bad bias or out_dtype.

    Example:
      >>> import jax, jax.numpy as jnp, jaxops
      >>> x = jax.random.normal(jax.random.key(0), (64, 256), jnp.bfloat16)
      >>> w = jax.random.normal(jax.random.key(1), (256, 128), jnp.bfloat16)
      >>> qa = jaxops.fp8.quantize(x, block=(1, 128))
      >>> qb = jaxops.fp8.quantize(w, block=(128, 128), transpose=True)[1]
      >>> jaxops.fp8.gemm(qa, qb).shape
      (64, 128)
    """
    op = "jaxops.fp8.gemm"
    m, k, n, out, activation, bias, a_mode, b_mode = _fp8_validate(
        op, a, b, bias, activation, out_dtype
    )
    choice = resolve_impl(impl, kernel_available=kernel_available(), op=op)
    both_e5m2 = a.dtype == b.dtype == np.dtype(jnp.float8_e5m2)
    blocked = a_mode != "tensor"
    kernel = (
        choice == "ffi"
        and out != np.dtype(np.float32)
        and not both_e5m2
        and m > 0
        and n > 0
        and k % (BLOCK if blocked else 16) == 0
        and k > 0
        and _lt_takes(m, n, a_mode)
    )
    if not kernel:
        return _fp8_reference(a, b, bias, activation, out)
    a_data = jnp.swapaxes(a.data, 0, 1) if a.transposed else a.data  # [M, K]
    b_data = b.data if b.transposed else jnp.swapaxes(b.data, 0, 1)  # [N, K]
    a_scale = _kernel_scale(a_mode, a, a.transposed)
    b_scale = _kernel_scale(b_mode, b, not b.transposed)
    lt_act = activation if activation in FUSED_ACTIVATIONS else None
    y = gemm_fp8_call(
        a_data,
        b_data,
        a_scale,
        b_scale,
        bias,
        out_dtype=out,
        a_mode=a_mode,
        b_mode=b_mode,
        activation=lt_act,
    )
    if activation != lt_act:
        y = activate(activation, y.astype(jnp.float32)).astype(out)
    return y


def fp8_gemm_reference(a: QuantizedArray, b: QuantizedArray, **kwargs: Any) -> jax.Array:
    """The twin of :func:`fp8_gemm` (its arguments but `impl`): dequantize, multiply in fp32."""
    return fp8_gemm(a, b, impl="xla", **kwargs)


_checks.twin_signature(fp8_gemm_reference, fp8_gemm)
