"""The pure-JAX twins of RMSNorm: the test oracle, the ``impl="xla"`` path and the vmap fallback.

The twins are differentiated by JAX itself; :func:`reference_bwd` is the closed-form backward
the batched-weight vmap rule uses.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "Config",
    "add_rms_norm_reference",
    "effective_weight",
    "reference_add_fwd",
    "reference_bwd",
    "reference_fwd",
    "residual_add",
    "rms_norm_reference",
]


@dataclasses.dataclass(frozen=True)
class Config:
    """The static configuration of one RMSNorm: eps, weight convention, weight present."""

    eps: float
    zero_centered: bool
    has_weight: bool


def effective_weight(weight: jax.Array | None, zero_centered: bool) -> jax.Array | None:
    """The float32 multiplier: `weight`, ``1 + weight`` when `zero_centered`, or None."""
    if weight is None:
        return None
    w = weight.astype(jnp.float32)
    return 1.0 + w if zero_centered else w


# The twins are jitted: called eagerly (the tests' oracle, impl="xla" outside jit), each of their
# jnp operations would be dispatched and compiled on its own; under an outer jit they are inlined.
@functools.partial(jax.jit, static_argnums=(0,))
def reference_fwd(cfg: Config, x: jax.Array, weight: jax.Array | None):
    """``(y, rstd)``: y in x's dtype, rstd float32 ``x.shape[:-1]``."""
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1) + jnp.float32(cfg.eps))
    y = x32 * rstd[..., None]
    w = effective_weight(weight, cfg.zero_centered)
    if w is not None:
        y = y * w
    return y.astype(x.dtype), rstd


def rms_norm_reference(
    x: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    zero_centered_weight: bool = False,
) -> jax.Array:
    """Pure-JAX RMSNorm, the twin of :func:`rms_norm` (same arguments, no validation)."""
    cfg = Config(float(eps), bool(zero_centered_weight), weight is not None)
    return reference_fwd(cfg, x, weight)[0]


def add_rms_norm_reference(
    x: jax.Array, residual: jax.Array, weight: jax.Array | None = None, **kwargs: Any
) -> tuple[jax.Array, jax.Array]:
    """Pure-JAX twin of :func:`add_rms_norm`: returns ``(rms_norm(h), h)``, h = x + residual.

    Keyword arguments (`eps`, `zero_centered_weight`) as :func:`rms_norm_reference` takes them.
    """
    h = residual_add(x, residual)
    return rms_norm_reference(h, weight, **kwargs), h


def residual_add(x: jax.Array, residual: jax.Array) -> jax.Array:
    """``h = x + residual``, added in float32 and rounded once to x's dtype."""
    return (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)


@functools.partial(jax.jit, static_argnums=(0,))
def reference_add_fwd(cfg: Config, x: jax.Array, residual: jax.Array, weight: jax.Array | None):
    """``(y, h, rstd)`` of the fused residual add + RMSNorm."""
    h = residual_add(x, residual)
    y, rstd = reference_fwd(cfg, h, weight)
    return y, h, rstd


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("reduce_axes",))
def reference_bwd(cfg, dy, x, rstd, weight, dh, *, reduce_axes=None):
    """Dx and fp32 dweight from the closed-form backward, in XLA (vmap fallback)."""
    x32 = x.astype(jnp.float32)
    dy32 = dy.astype(jnp.float32)
    w = effective_weight(weight, cfg.zero_centered)
    g = dy32 if w is None else dy32 * w
    r = rstd[..., None]
    dot = jnp.sum(g * x32, axis=-1, keepdims=True)
    dx = r * g - x32 * (r * r * r) * dot / x.shape[-1]
    if dh is not None:
        dx = dx + dh.astype(jnp.float32)
    dw = None
    if weight is not None:
        axes = tuple(range(x.ndim - 1)) if reduce_axes is None else reduce_axes
        dw = jnp.sum(dy32 * x32 * r, axis=axes)
    return dx.astype(x.dtype), dw
