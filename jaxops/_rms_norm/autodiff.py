"""RMSNorm's vmap and autodiff rules over the custom calls.

``custom_vmap`` folds a batch axis into the kernel's rows (batched weights fall back to the
twin); ``jax.custom_vjp`` makes the backward pass the ``jaxops_rms_norm_bwd`` kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from jaxops._rms_norm.partition import (
    partitioned_add_fwd,
    partitioned_bwd,
    partitioned_fwd,
    unpack_bwd,
)
from jaxops._rms_norm.reference import Config, reference_add_fwd, reference_bwd, reference_fwd
from jaxops._sharding import cotangent_like, vary_like

__all__ = ["add_rms_norm_vjp", "rms_norm_vjp"]


# -------------------------------------------------------------------------------------------------
# vmap: fold the batch axis into the rows (batched weights fall back to the twin).


def _broadcast_unbatched(axis_size, values, batched):
    return [
        v if (v is None or b) else jnp.broadcast_to(v, (axis_size, *v.shape))
        for v, b in zip(values, batched, strict=True)
    ]


def _with_vmap(partitioned, batch_rule):
    """`partitioned` on a tuple of operands under ``custom_vmap``.

    ``batch_rule(op, axis_size, batched, operands)`` returns the batched results (every result
    is batched); `op` is the vmapped op itself, for rules that fold the batch into the rows.
    """

    @custom_vmap
    def op(operands):
        return partitioned(*operands)

    @op.def_vmap
    def rule(axis_size, in_batched, operands):
        out = batch_rule(op, axis_size, list(in_batched[0]), operands)
        return out, jax.tree.map(lambda _: True, out)

    return op


@functools.cache
def _fwd_op(cfg: Config):
    def batch_rule(op, axis_size, batched, operands):
        if cfg.has_weight and batched[1]:
            (x,) = _broadcast_unbatched(axis_size, operands[:1], batched[:1])
            return jax.vmap(functools.partial(reference_fwd, cfg))(x, operands[1])
        return op(operands)

    return _with_vmap(partitioned_fwd(cfg), batch_rule)


@functools.cache
def _add_fwd_op(cfg: Config):
    def batch_rule(op, axis_size, batched, operands):
        x, residual = _broadcast_unbatched(axis_size, operands[:2], batched[:2])
        if cfg.has_weight and batched[2]:
            return jax.vmap(functools.partial(reference_add_fwd, cfg))(x, residual, operands[2])
        return op((x, residual, *operands[2:]))

    return _with_vmap(partitioned_add_fwd(cfg), batch_rule)


@functools.cache
def _bwd_op(cfg: Config, has_dh: bool):
    def batch_rule(op, axis_size, batched, operands):
        dy, x, rstd, weight, dh = unpack_bwd(cfg, has_dh, operands)
        dy, x, rstd = _broadcast_unbatched(axis_size, [dy, x, rstd], batched[:3])
        if has_dh:
            (dh,) = _broadcast_unbatched(axis_size, [dh], batched[-1:])
        if cfg.has_weight and batched[3]:
            dx, dw = jax.vmap(functools.partial(reference_bwd, cfg))(dy, x, rstd, weight, dh)
        else:
            # The kernel treats the batch as more rows; its dweight would sum over the batch,
            # so the per-example dweight comes from XLA.
            fixed = [dy, x, rstd] + ([weight] if cfg.has_weight else []) + ([dh] if has_dh else [])
            dx = op(tuple(fixed))[0]
            dw = None
            if cfg.has_weight:
                _, dw = reference_bwd(
                    cfg, dy, x, rstd, weight, None, reduce_axes=tuple(range(1, x.ndim - 1))
                )
        return (dx,) if dw is None else (dx, dw)

    return _with_vmap(partitioned_bwd(cfg, has_dh), batch_rule)


# -------------------------------------------------------------------------------------------------
# Autodiff.


def _rows(x: jax.Array) -> int:
    return int(np.prod(x.shape[:-1], dtype=np.int64))


def _fwd_apply(cfg: Config, x, weight):
    if _rows(x) == 0:
        return jnp.zeros_like(x), jnp.zeros(x.shape[:-1], jnp.float32)
    operands = (x, weight) if cfg.has_weight else (x,)
    return _fwd_op(cfg)(operands)


def _add_fwd_apply(cfg: Config, x, residual, weight):
    if _rows(x) == 0:
        return jnp.zeros_like(x), jnp.zeros_like(x), jnp.zeros(x.shape[:-1], jnp.float32)
    operands = (x, residual, weight) if cfg.has_weight else (x, residual)
    return _add_fwd_op(cfg)(operands)


def _bwd_apply(cfg: Config, dy, x, rstd, weight, dh):
    if _rows(x) == 0:
        dx = jnp.zeros_like(x) if dh is None else dh
        dw = None if weight is None else jnp.zeros(weight.shape, weight.dtype)
        return dx, dw
    operands = (
        (dy, x, rstd) + ((weight,) if cfg.has_weight else ()) + ((dh,) if dh is not None else ())
    )
    outs = _bwd_op(cfg, dh is not None)(operands)
    dw = outs[1].astype(weight.dtype) if cfg.has_weight else None
    return outs[0], dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def rms_norm_vjp(cfg: Config, x, weight):
    """RMSNorm on the custom calls, forward and backward."""
    return _fwd_apply(cfg, x, weight)[0]


def _rms_norm_vjp_fwd(cfg: Config, x, weight):
    y, rstd = _fwd_apply(cfg, x, weight)
    return y, (x, weight, rstd)


def _rms_norm_vjp_bwd(cfg: Config, residuals, dy):
    x, weight, rstd = residuals
    dx, dw = _bwd_apply(cfg, dy, x, rstd, weight, None)
    return cotangent_like(dx, x), cotangent_like(dw, weight)


rms_norm_vjp.defvjp(_rms_norm_vjp_fwd, _rms_norm_vjp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def add_rms_norm_vjp(cfg: Config, x, residual, weight):
    """Residual add + RMSNorm on the custom calls, forward and backward: ``(y, h)``."""
    y, h, _ = _add_fwd_apply(cfg, x, residual, weight)
    return y, h


def _add_rms_norm_vjp_fwd(cfg: Config, x, residual, weight):
    y, h, rstd = _add_fwd_apply(cfg, x, residual, weight)
    # Empty arrays that carry the shard_map varying axes and the Explicit-mesh sharding of the
    # leading axes of x and residual, for the cotangents.
    markers = tuple(vary_like(v[..., :0], v) for v in (x, residual))
    return (y, h), (h, weight, rstd, markers)


def _add_rms_norm_vjp_bwd(cfg: Config, residuals, cotangents):
    h, weight, rstd, (x_marker, residual_marker) = residuals
    dy, dh = cotangents
    dx, dw = _bwd_apply(cfg, dy, h, rstd, weight, dh)
    return (
        cotangent_like(dx, x_marker),
        cotangent_like(dx, residual_marker),
        cotangent_like(dw, weight),
    )


add_rms_norm_vjp.defvjp(_add_rms_norm_vjp_fwd, _add_rms_norm_vjp_bwd)
