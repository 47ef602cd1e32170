"""Autodiff of the MoE custom calls: ``jax.custom_vjp`` rules with custom-call backward passes.

The backward of permute is an unpermute without weights (no scatter-add); the backward of a
weighted unpermute is one custom call that writes the expert-row gradient and the ``[T, K]``
probability gradient. :func:`unpermute_rows` is the unpermute arithmetic without a rule, for
layers that build their own backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxops import _ffi
from jaxops._moe.layout import FP8_DTYPES, Route
from jaxops._moe.partition import permute_op, route_op, unpermute_bwd_op, unpermute_op
from jaxops._moe.reference import unpermute_rows_reference
from jaxops._sharding import cotangent_like

__all__ = ["permute_vjp", "unpermute_rows", "unpermute_vjp"]


def _unpermute_kernel(expert_out, row_map, probs):
    """Unpermute on the custom call; float8 rows are accumulated in float32 and rounded back."""
    x = expert_out.astype(jnp.float32) if expert_out.dtype in FP8_DTYPES else expert_out
    operands = (x, row_map) + ((probs,) if probs is not None else ())
    return unpermute_op(probs is not None)(*operands).astype(expert_out.dtype)


def unpermute_rows(expert_out, row_map, probs, impl: str | None = None):
    """The unpermute arithmetic without its autodiff rule: the custom call or the twin.

    For layers that build their own backward (the expert-parallel dispatch's gradient).
    `expert_out` ``[R, H]``, `row_map` int32 ``[T, K]`` (rows outside ``[0, R)`` contribute
    zero), `probs` float32 ``[T, K]`` or None; returns ``[T, H]`` in expert_out's dtype.
    """
    if expert_out.size and row_map.size and _ffi.use_kernel(impl, "jaxops.moe.unpermute"):
        return _unpermute_kernel(expert_out, row_map, probs)
    return unpermute_rows_reference(expert_out, row_map, probs)


def _permute_kernel(tokens, source, row_map, scales, probs):
    operands = (tokens, source, row_map)
    operands += (scales,) if scales is not None else ()
    operands += (probs,) if probs is not None else ()
    outs = list(permute_op(scales is not None, probs is not None)(*operands))
    out = outs.pop(0)
    out_scales = outs.pop(0) if scales is not None else None
    out_probs = outs.pop(0) if probs is not None else None
    return out, out_scales, out_probs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def permute_vjp(cfg: Route, tokens, expert_ids, probs, scales):
    """Routes and permutes on the custom calls.

    Returns:
      ``(rows, scales | None, probs | None, routing)``, routing as
      :func:`jaxops._moe.reference.route_reference` returns it.
    """
    return _permute_vjp_fwd(cfg, tokens, expert_ids, probs, scales)[0]


def _permute_vjp_fwd(cfg: Route, tokens, expert_ids, probs, scales):
    row_map, source, sizes, offsets, num_rows, dropped = route_op(cfg)(expert_ids)
    out, out_scales, out_probs = _permute_kernel(tokens, source, row_map, scales, probs)
    routing = (row_map, source, sizes, offsets, num_rows, dropped)
    return (out, out_scales, out_probs, routing), (row_map, tokens, probs, scales)


def _permute_vjp_bwd(cfg: Route, residuals, cotangents):
    row_map, tokens, probs, scales = residuals
    d_out, d_scales_out, d_probs_out, _ = cotangents
    d_tokens = cotangent_like(_unpermute_kernel(d_out, row_map, None), tokens)
    d_scales = d_probs = None
    if scales is not None:
        d_scales = cotangent_like(_unpermute_kernel(d_scales_out, row_map, None), scales)
    if probs is not None:
        valid = row_map >= 0
        d_probs = jnp.where(valid, d_probs_out[jnp.where(valid, row_map, 0)], 0.0)
        d_probs = cotangent_like(d_probs.astype(probs.dtype), probs)
    return d_tokens, None, d_probs, d_scales


permute_vjp.defvjp(_permute_vjp_fwd, _permute_vjp_bwd)


@jax.custom_vjp
def unpermute_vjp(expert_out, row_map, source, probs):
    """Unpermute on the custom call, differentiable in expert_out and probs (float32 or None)."""
    return _unpermute_kernel(expert_out, row_map, probs)


def _unpermute_vjp_fwd(expert_out, row_map, source, probs):
    out = _unpermute_kernel(expert_out, row_map, probs)
    return out, (expert_out, row_map, source, probs)


def _unpermute_vjp_bwd(residuals, d_out):
    expert_out, row_map, source, probs = residuals
    if probs is None:
        if expert_out.dtype in FP8_DTYPES:
            d_out = d_out.astype(jnp.float32)
        d_expert = _permute_kernel(d_out, source, row_map, None, None)[0]
        d_probs = None
    else:
        d_expert, d_probs = unpermute_bwd_op()(d_out, expert_out, source, probs.astype(jnp.float32))
        d_probs = cotangent_like(d_probs.astype(probs.dtype), probs)
    d_expert = cotangent_like(d_expert.astype(expert_out.dtype), expert_out)
    return d_expert, None, None, d_probs


unpermute_vjp.defvjp(_unpermute_vjp_fwd, _unpermute_vjp_bwd)
