"""The pure-JAX twins of the MoE custom calls: the test oracle and the ``impl="xla"`` path.

An argsort + gather, as MaxText does; differentiated by JAX itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxops._moe.layout import Route
from jaxops._rows import take_rows

__all__ = ["permute_rows_reference", "route_reference", "unpermute_rows_reference"]


# The twins are jitted: called eagerly (the tests' oracle, impl="xla" outside jit), each of their
# jnp operations would be dispatched and compiled on its own; under an outer jit they are inlined.
@functools.partial(jax.jit, static_argnums=(0,))
def route_reference(cfg: Route, ids: jax.Array):
    """The routing of int32 ``ids [T, K]``.

    Returns:
      ``(row_map [T, K], source [R], group_sizes [E], group_offsets [E + 1], num_rows [],
      dropped [E])``, all int32.
    """
    t, k = ids.shape
    e = cfg.experts
    flat = ids.reshape(-1)
    key = jnp.where((flat >= 0) & (flat < e), flat, e)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sorted_key = key[order]
    counts = jnp.bincount(key, length=e + 1).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.arange(t * k, dtype=jnp.int32) - starts[sorted_key]
    kept = counts[:e] if cfg.capacity is None else jnp.minimum(counts[:e], cfg.capacity)
    sizes = (kept + cfg.align - 1) // cfg.align * cfg.align
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes, dtype=jnp.int32)])
    used = sorted_key < e
    if cfg.capacity is not None:
        used &= rank < cfg.capacity
    row = jnp.where(used, offsets[jnp.minimum(sorted_key, e - 1)] + rank, -1)
    row_map = jnp.zeros((t * k,), jnp.int32).at[order].set(row).reshape(t, k)
    source = (
        jnp.full((cfg.rows,), -1, jnp.int32)
        .at[jnp.where(used, row, cfg.rows)]
        .set(order, mode="drop")
    )
    return row_map, source, sizes, offsets, offsets[e], counts[:e] - kept


@functools.partial(jax.jit, static_argnames=("top_k",))
def permute_rows_reference(tokens, source, scales, probs, top_k: int):
    """Rows ``[R, ...]`` of tokens, scales (or None) and flat probs (or None) by `source`."""
    valid = source >= 0
    t = source // top_k
    out = take_rows(tokens, t, valid)
    out_scales = None if scales is None else take_rows(scales, t, valid)
    out_probs = None if probs is None else take_rows(probs.reshape(-1), source, valid)
    return out, out_scales, out_probs


@jax.jit
def unpermute_rows_reference(expert_out, row_map, probs):
    """``out[t] = sum_k probs[t, k] * expert_out[row_map[t, k]]``, float32 accumulation."""
    valid = (row_map >= 0) & (row_map < expert_out.shape[0])
    rows = take_rows(expert_out, row_map, valid).astype(jnp.float32)  # [T, K, H]
    if probs is not None:
        rows = rows * probs.astype(jnp.float32)[..., None]
    return jnp.sum(rows, axis=1).astype(expert_out.dtype)
