"""The cuBLASLt GEMM layer shared by :func:`jaxops.gemm` and ``jaxops.fp8.gemm`` / ``linear``.

- the custom calls ``jaxops_gemm`` (:func:`gemm_call`) and ``jaxops_gemm_fp8``
  (:func:`gemm_fp8_call`), and whether this process can run them (:func:`kernel_available`);
- the epilogue activations: :data:`ACTIVATIONS`, those cuBLASLt fuses
  (:data:`FUSED_ACTIVATIONS`), and their float32 math in XLA (:func:`activate`,
  :func:`activation_grad`) for the others and for the backward passes;
- validation of a dense layer's operands (:func:`check_dense`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops import _checks, _ffi
from jaxops._errors import ArgumentTypeError, InvalidArgumentError
from jaxops._sharding import matmul_sharding

__all__ = [
    "ACTIVATIONS",
    "FUSED_ACTIVATIONS",
    "TARGET_GEMM",
    "TARGET_GEMM_FP8",
    "activate",
    "activation_grad",
    "check_activation",
    "check_dense",
    "gemm_call",
    "gemm_fp8_call",
    "kernel_available",
]

TARGET_GEMM = "jaxops_gemm"
TARGET_GEMM_FP8 = "jaxops_gemm_fp8"

ACTIVATIONS: tuple[str | None, ...] = (None, "relu", "gelu", "gelu_tanh", "silu")
# Activations the cuBLASLt epilogue applies (gemm::Activation); the others run in XLA.
_LT_ACTIVATION = {None: 0, "relu": 1, "gelu_tanh": 2}
#: The activations cuBLASLt fuses into its epilogue (its GELU is the tanh approximation).
FUSED_ACTIVATIONS: tuple[str | None, ...] = tuple(_LT_ACTIVATION)
# jaxops precision mode -> gemm::Precision (float32 operands). bf16_3x runs XLA's dot.
_LT_PRECISION = {"fp32": 0, "tf32": 1, "bf16": 2}
_SCALE_MODE = {"tensor": 0, "rows": 1, "tiles": 2}  # gemm::ScaleMode
_WORKSPACE_BYTES = 32 << 20  # gemm::kWorkspaceBytes


# -------------------------------------------------------------------------------------------------
# Activations (fp32 in, fp32 out) and their derivatives.


def activate(activation: str | None, h: jax.Array) -> jax.Array:
    """``act(h)`` for one of :data:`ACTIVATIONS` ("gelu" is exact, "gelu_tanh" the tanh form)."""
    if activation is None:
        return h
    if activation == "relu":
        return jnp.maximum(h, 0.0)
    if activation == "gelu":
        return jax.nn.gelu(h, approximate=False)
    if activation == "gelu_tanh":
        return jax.nn.gelu(h, approximate=True)
    return jax.nn.silu(h)


def activation_grad(activation: str | None, h: jax.Array) -> jax.Array:
    """D act / d h at the (float32) pre-activation h."""
    if activation is None:
        return jnp.ones_like(h)
    if activation == "relu":
        return (h > 0).astype(h.dtype)
    if activation == "silu":
        s = jax.nn.sigmoid(h)
        return s * (1.0 + h * (1.0 - s))
    if activation == "gelu":
        cdf = 0.5 * (1.0 + jax.lax.erf(h / math.sqrt(2.0)))
        pdf = jnp.exp(-0.5 * h * h) / math.sqrt(2.0 * math.pi)
        return cdf + h * pdf
    c = math.sqrt(2.0 / math.pi)
    inner = c * (h + 0.044715 * h**3)
    t = jnp.tanh(inner)
    return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * h * h)


def check_activation(op: str, activation: Any) -> str | None:
    """`activation` when it is one of :data:`ACTIVATIONS`, else a ValueError naming `op`."""
    if activation not in ACTIVATIONS:
        raise InvalidArgumentError(
            f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}"
        )
    return activation


def check_dense(op: str, x: Any, w: Any, bias: Any, activation: Any, transpose_w: Any):
    """Validates the operands of ``act(x @ w + bias)``.

    Args:
      op: the public name of the op (starts every message).
      x: float ``[..., K]``.
      w: x's dtype, ``[K, N]`` (``[N, K]`` with `transpose_w`).
      bias: None or x's dtype ``[N]``.
      activation: one of :data:`ACTIVATIONS`.
      transpose_w: bool.

    Returns:
      ``(x, w, bias, activation, transpose_w, N)``.

    Raises:
      TypeError / ValueError: wrong dtypes, ranks, mismatched K, bad bias shape or activation.
    """
    x = _checks.check_array(op, "x", x, min_rank=1)
    w = _checks.check_array(op, "w", w)
    if w.ndim != 2:
        raise InvalidArgumentError(
            f"{op}: w must be a matrix [K, N] (or [N, K]), got shape {w.shape}"
        )
    if w.dtype != x.dtype:
        raise ArgumentTypeError(f"{op}: w must have x's dtype {x.dtype}, got {w.dtype}")
    transpose_w = _checks.check_bool(op, "transpose_w", transpose_w)
    k = x.shape[-1]
    w_k, n = (w.shape[1], w.shape[0]) if transpose_w else w.shape
    if w_k != k:
        layout = "[N, K]" if transpose_w else "[K, N]"
        raise InvalidArgumentError(
            f"{op}: w must be {layout} with K = x.shape[-1] = {k}; got w of shape {w.shape}"
        )
    if bias is not None:
        bias = _checks.check_array(op, "bias", bias)
        if bias.shape != (n,) or bias.dtype != x.dtype:
            raise InvalidArgumentError(
                f"{op}: bias must be [{n}] with x's dtype {x.dtype}; got {bias.shape} {bias.dtype}"
            )
    return x, w, bias, check_activation(op, activation), transpose_w, n


# -------------------------------------------------------------------------------------------------
# The custom calls.


def kernel_available() -> bool:
    """Whether the default backend is a CUDA GPU and jaxops was built with cuBLASLt."""
    return _ffi.has_kernel("gemm", jax.default_backend())


def gemm_call(
    mode: str,
    a,
    b,
    bias,
    *,
    transpose_a: bool = False,
    transpose_b: bool = False,
    activation: str | None = None,
    aux: bool = False,
    bias_grad: bool = False,
):
    """One ``jaxops_gemm`` custom call: ``d = act(op(a) @ op(b) + bias)``.

    Args:
      mode: the precision mode of float32 operands, "fp32", "tf32" or "bf16".
      a: ``[M, K]`` (``[K, M]`` with `transpose_a`), float32, bfloat16 or float16.
      b: a's dtype, ``[K, N]`` (``[N, K]`` with `transpose_b`).
      bias: None or a's dtype ``[N]``.
      transpose_a: a is stored transposed.
      transpose_b: b is stored transposed.
      activation: one of :data:`FUSED_ACTIVATIONS`.
      aux: also return the pre-activation (the epilogue's auxiliary output).
      bias_grad: also return the column sums of op(b) (the BGRADA epilogue: a bias gradient).

    Returns:
      ``(d [M, N], pre-activation [M, N] | None, bias gradient [N] | None)`` in a's dtype.
    """
    _ffi.ensure_registered(TARGET_GEMM)
    m = a.shape[1] if transpose_a else a.shape[0]
    n = b.shape[0] if transpose_b else b.shape[1]
    dtype = a.dtype
    empty = jnp.zeros((0,), dtype)
    # On Explicit meshes the result types carry the operands' row and column shardings.
    mn = matmul_sharding(a, b, 1 if transpose_a else 0, 0 if transpose_b else 1)
    col = None if mn is None else NamedSharding(mn.mesh, P(mn.spec[1]))
    out_types = [
        jax.ShapeDtypeStruct((m, n), dtype, sharding=mn),
        jax.ShapeDtypeStruct((m, n) if aux else (0,), dtype, sharding=mn if aux else None),
        jax.ShapeDtypeStruct(
            (n,) if bias_grad else (0,), dtype, sharding=col if bias_grad else None
        ),
        jax.ShapeDtypeStruct((_WORKSPACE_BYTES,), jnp.uint8),
    ]
    d, aux_out, bias_grad_out, _ = _ffi.ffi_call(
        TARGET_GEMM,
        out_types,
        a,
        b,
        empty if bias is None else bias,
        vmap_method="sequential",
        transpose_a=bool(transpose_a),
        transpose_b=bool(transpose_b),
        activation=np.int32(_LT_ACTIVATION[activation]),
        precision=np.int32(_LT_PRECISION[mode]),
    )
    return d, (aux_out if aux else None), (bias_grad_out if bias_grad else None)


def gemm_fp8_call(
    a_data,
    b_data,
    a_scale,
    b_scale,
    bias,
    *,
    out_dtype: Any,
    a_mode: str,
    b_mode: str,
    activation: str | None = None,
):
    """One ``jaxops_gemm_fp8`` custom call: ``act(dequant(a) @ dequant(b)ᵀ + bias)``.

    Args:
      a_data: float8 ``[M, K]``.
      b_data: float8 ``[N, K]`` (both operands K-major, as Hopper's FP8 tensor cores take them).
      a_scale: float32 ``[]`` ("tensor"), ``[K / 128, pad4(M)]`` ("rows", M contiguous) or
        ``[M / 128, pad4(K / 128)]`` ("tiles", K blocks contiguous); /128 rounded up.
      b_scale: as a_scale, for b.
      bias: None or ``[N]`` in out_dtype.
      out_dtype: bfloat16 or float16.
      a_mode: "tensor", "rows" (1 x 128 groups along K) or "tiles" (128 x 128).
      b_mode: as a_mode, for b.
      activation: one of :data:`FUSED_ACTIVATIONS`.

    Returns:
      ``[M, N]`` in out_dtype.
    """
    _ffi.ensure_registered(TARGET_GEMM_FP8)
    m, n = a_data.shape[0], b_data.shape[0]
    bias_operand = jnp.zeros((0,), out_dtype) if bias is None else bias.astype(out_dtype)
    y, _ = _ffi.ffi_call(
        TARGET_GEMM_FP8,
        [
            jax.ShapeDtypeStruct((m, n), out_dtype, sharding=matmul_sharding(a_data, b_data, 0, 0)),
            jax.ShapeDtypeStruct((_WORKSPACE_BYTES,), jnp.uint8),
        ],
        a_data,
        b_data,
        a_scale,
        b_scale,
        bias_operand,
        vmap_method="sequential",
        a_scale_mode=np.int32(_SCALE_MODE[a_mode]),
        b_scale_mode=np.int32(_SCALE_MODE[b_mode]),
        activation=np.int32(_LT_ACTIVATION[activation]),
    )
    return y
