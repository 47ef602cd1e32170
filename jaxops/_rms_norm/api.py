"""The public RMSNorm ops: validation at trace time and the choice of implementation."""

from __future__ import annotations

from typing import Any

import jax

from jaxops import _checks, _ffi
from jaxops._config import check_impl
from jaxops._errors import ArgumentTypeError, InvalidArgumentError
from jaxops._rms_norm.autodiff import add_rms_norm_vjp, rms_norm_vjp
from jaxops._rms_norm.reference import (
    Config,
    add_rms_norm_reference,
    reference_add_fwd,
    reference_fwd,
)

__all__ = ["add_rms_norm", "rms_norm"]


def _validate(op: str, x, weight, eps, zero_centered_weight, impl) -> tuple[jax.Array, Any, Config]:
    x = _checks.check_array(op, "x", x, min_rank=1)
    if x.shape[-1] < 1:
        raise InvalidArgumentError(
            f"{op}: the last axis of x (hidden) must be >= 1, got shape {x.shape}"
        )
    if weight is not None:
        weight = _checks.check_array(op, "weight", weight)
        if tuple(weight.shape) != (x.shape[-1],):
            raise InvalidArgumentError(
                f"{op}: weight must have shape ({x.shape[-1]},) to match the last axis of x, "
                f"got {tuple(weight.shape)}"
            )
    cfg = Config(
        eps=_checks.check_positive_float(op, "eps", eps),
        zero_centered=_checks.check_bool(op, "zero_centered_weight", zero_centered_weight),
        has_weight=weight is not None,
    )
    check_impl(op, impl)
    return x, weight, cfg


def rms_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    zero_centered_weight: bool = False,
    impl: str | None = None,
) -> jax.Array:
    """Root-mean-square normalization over the last axis.

    ``y = x * rsqrt(mean(x**2, axis=-1) + eps) * w`` where ``w = weight``, ``1 + weight`` when
    `zero_centered_weight`, or 1 without a weight. All arithmetic is in float32.

    Args:
      x: ``[..., hidden]`` float32, bfloat16 or float16, rank >= 1, ``hidden >= 1``; any number
        of rows (including zero).
      weight: ``[hidden]`` float32, bfloat16 or float16 (independent of x's dtype), or None.
      eps: added to the mean square; a static, finite number > 0.
      zero_centered_weight: scale by ``1 + weight`` (weights stored around zero).
      impl: None for the custom call (the pure-JAX twin where no kernel exists for the platform),
        ``"ffi"`` to require the custom call, ``"xla"`` for the pure-JAX twin. The global switch
        (``jaxops.set_default_impl("xla")`` or ``JAXOPS_IMPL=xla``) forces the twin everywhere.

    Returns:
      ``y`` with x's shape and dtype.

    Raises:
      TypeError: x or weight has an unsupported dtype, eps is not a number or is traced.
      ValueError: x has rank 0 or an empty last axis, weight's shape is not ``(hidden,)``,
        eps is not finite and > 0, or impl is unknown.

    Sharding: under jit, leading axes sharded over any mesh axes run without a collective; a
    sharded hidden axis all-reduces only the per-row sum of squares. The backward pass
    all-reduces dweight over the mesh axes that shard the rows.

    Example:
      >>> import jax, jax.numpy as jnp, jaxops
      >>> x = jnp.arange(8.0).reshape(2, 4)
      >>> y = jax.jit(jaxops.rms_norm)(x, jnp.ones(4))
      >>> bool(jnp.allclose(y, jaxops.rms_norm(x, jnp.ones(4), impl="xla")))
      True
    """
    x, weight, cfg = _validate("jaxops.rms_norm", x, weight, eps, zero_centered_weight, impl)
    if not _ffi.use_kernel(impl, "jaxops.rms_norm"):
        return reference_fwd(cfg, x, weight)[0]
    return rms_norm_vjp(cfg, x, weight)


def add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    zero_centered_weight: bool = False,
    impl: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Residual add fused with RMSNorm: ``h = x + residual``, ``y = rms_norm(h)``.

    The kernel reads x and residual once and writes h and y in one pass. h is rounded to x's
    dtype before it is normalized, so ``y == rms_norm(h)`` exactly as the unfused code computes.

    Args:
      x: ``[..., hidden]`` float32, bfloat16 or float16, rank >= 1.
      residual: same shape and dtype as x.
      weight: ``[hidden]`` float32, bfloat16 or float16, or None.
      eps: as in :func:`rms_norm`.
      zero_centered_weight: as in :func:`rms_norm`.
      impl: as in :func:`rms_norm`.

    Returns:
      ``(y, h)``, both with x's shape and dtype; h is the new residual stream.

    Raises:
      TypeError: as in :func:`rms_norm`, or residual's dtype differs from x's.
      ValueError: as in :func:`rms_norm`, or residual's shape differs from x's.

    Example:
      >>> import jax.numpy as jnp, jaxops
      >>> x, r = jnp.ones((2, 4)), jnp.full((2, 4), 2.0)
      >>> y, h = jaxops.add_rms_norm(x, r)
      >>> float(h[0, 0]), round(float(y[0, 0]), 4)
      (3.0, 1.0)
    """
    op = "jaxops.add_rms_norm"
    x, weight, cfg = _validate(op, x, weight, eps, zero_centered_weight, impl)
    residual = _checks.check_array(op, "residual", residual)
    if residual.dtype != x.dtype:
        raise ArgumentTypeError(
            f"{op}: residual must have x's dtype {_checks.dtype_name(x.dtype)}, "
            f"got {_checks.dtype_name(residual.dtype)}"
        )
    if residual.shape != x.shape:
        raise InvalidArgumentError(
            f"{op}: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
        )
    if not _ffi.use_kernel(impl, "jaxops.add_rms_norm"):
        return reference_add_fwd(cfg, x, residual, weight)[:2]
    return add_rms_norm_vjp(cfg, x, residual, weight)


_checks.twin_signature(add_rms_norm_reference, add_rms_norm)
