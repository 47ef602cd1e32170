"""Blockwise attention: an online softmax over key blocks, a backward that recomputes per block.

The queries are taken ``block`` at a time; each query block runs over the key blocks with a
running maximum, sum and output (the online softmax of FlashAttention), and keeps only its
output and its log-sum-exp for the backward, which recomputes each block's probabilities
from them. No array of ``[sq, sk]`` exists in the forward or the backward: the largest holds
one block pair's scores, ``[b, heads, block, block]`` in float32.

The mask is built one block pair at a time from the tokens' placement
(:meth:`~jaxops.models._mask.Visible.block`: causal, sliding window, chunks, packed documents,
padding, KV-cache slots), and a block pair it empties entirely (keys in the causal future,
outside the window, of other documents) is skipped by ``lax.cond``, not computed and masked.
Grouped-query attention reads each key-value head once for its group of query heads (no
repeat); keys and values may have different widths (multi-head latent attention); attention
sinks (gpt-oss) join every query's softmax denominator, and get their gradient.

Shapes: ``q [b, sq, Hkv, G, Dh]``, ``k [b, sk, Hkv, Dh]``, ``v [b, sk, Hkv, Dv]``; the output
``[b, sq, Hkv, G, Dv]``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ._mask import Tokens, Visible

__all__ = ["attention"]


def _accumulator(dtype: Any) -> Any:
    """The dtype scores, softmax statistics and sums are computed in: float32, or float64."""
    return jnp.promote_types(dtype, jnp.float32)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: Visible,
    *,
    scale: float,
    sinks: jax.Array | None,
    dtype: Any,
    block: int,
) -> jax.Array:
    """Softmax attention of `q` over `k`, `v` where `visible` allows, in blocks of `block`.

    Args:
      q: ``[b, sq, Hkv, G, Dh]`` queries (G query heads per key-value head).
      k: ``[b, sk, Hkv, Dh]`` keys.
      v: ``[b, sk, Hkv, Dv]`` values.
      visible: which keys each query sees (placements ``[b, sq]`` / ``[b, sk]``).
      scale: the scores' scale.
      sinks: ``[Hkv * G]`` (gpt-oss), one more logit per head in each softmax denominator,
        whose probability is dropped; or None.
      dtype: the compute dtype (the probabilities' in the products with v, and the output's).
      block: queries and keys per block.

    Returns:
      ``[b, sq, Hkv, G, Dv]`` in `dtype`; a query that sees no key gets zeros.
    """
    sq, sk = q.shape[1], k.shape[1]
    if sq == 0 or sk == 0:  # no query, or no key to see: zeros
        return jnp.zeros((*q.shape[:-1], v.shape[-1]), dtype)
    nq, nk = -(-sq // block), -(-sk // block)
    q = _pad(q, nq * block)
    k, v = _pad(k, nk * block), _pad(v, nk * block)
    padded = Visible(
        _pad_tokens(visible.q, nq * block),
        _pad_tokens(visible.k, nk * block),
        visible.window,
        visible.chunk,
        None if visible.valid_keys is None else _pad(visible.valid_keys, nk * block),
    )
    out = _flash(q, k, v, sinks, padded, scale, jnp.dtype(dtype), block, sk)
    return out[:, :sq]


def _pad(a: jax.Array, n: int) -> jax.Array:
    """`a` with zeros (False) appended on axis 1 up to `n` rows."""
    return jnp.pad(a, [(0, 0), (0, n - a.shape[1])] + [(0, 0)] * (a.ndim - 2))


def _pad_tokens(t: Tokens, n: int) -> Tokens:
    """The placement padded to `n` tokens (the last token repeated; such keys are never seen)."""
    return jax.tree.map(lambda a: jnp.pad(a, [(0, 0), (0, n - a.shape[1])], mode="edge"), t)


def _blocks(a: jax.Array, block: int) -> jax.Array:
    """``[b, n * block, ...]`` as ``[n, b, block, ...]``."""
    b, s = a.shape[:2]
    return jnp.moveaxis(a.reshape(b, s // block, block, *a.shape[2:]), 1, 0)


def _unblocks(a: jax.Array) -> jax.Array:
    """Inverse of :func:`_blocks`."""
    n, b, block = a.shape[:3]
    return jnp.moveaxis(a, 0, 1).reshape(b, n * block, *a.shape[3:])


def _scores(qi, kj, mask, scale, acc) -> jax.Array:
    """``[b, Hkv, G, bq, bk]`` scores of a block pair in `acc`, -inf where `mask` hides a key."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=acc) * scale
    return jnp.where(mask[:, None, None], s, -jnp.inf)


def _sink(sinks: jax.Array, hkv: int, g: int, acc: Any) -> jax.Array:
    return sinks.astype(acc).reshape(1, hkv, g, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(q, k, v, sinks, visible, scale, dtype, block, sk):
    return _forward(q, k, v, sinks, visible, scale, dtype, block, sk)[0]


def _forward(q, k, v, sinks, visible: Visible, scale, dtype, block, sk):
    """``(out [b, sq, Hkv, G, Dv], lse [nq, b, Hkv, G, block])`` over padded inputs."""
    b, _, hkv, g, _ = q.shape
    dv, acc = v.shape[-1], _accumulator(dtype)
    kb, vb = _blocks(k, block), _blocks(v, block)
    nk = kb.shape[0]

    def query_block(_, xs):
        i, qi = xs

        def key_block(carry, j):
            mask = visible.block(i * block, block, j * block, block, sk)

            def compute(carry):
                m, total, o = carry
                s = _scores(qi, kb[j], mask, scale, acc)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                top = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - top[..., None])
                alpha = jnp.exp(m - top)  # 0 while nothing was seen (m = -inf)
                pv = jnp.einsum(
                    "bkgqs,bskd->bkgqd", p.astype(dtype), vb[j], preferred_element_type=acc
                )
                return m_new, total * alpha + jnp.sum(p, axis=-1), o * alpha[..., None] + pv

            return jax.lax.cond(jnp.any(mask), compute, lambda c: c, carry), None

        init = (
            jnp.full((b, hkv, g, block), -jnp.inf, acc),
            jnp.zeros((b, hkv, g, block), acc),
            jnp.zeros((b, hkv, g, block, dv), acc),
        )
        (m, total, o), _ = jax.lax.scan(key_block, init, jnp.arange(nk))
        if sinks is not None:  # one more logit in the denominator
            sink = _sink(sinks, hkv, g, acc)
            top = jnp.maximum(m, sink)
            alpha = jnp.exp(m - top)
            total, o, m = total * alpha + jnp.exp(sink - top), o * alpha[..., None], top
        seen = total > 0
        out = o / jnp.where(seen, total, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), 0.0)
        return None, (jnp.moveaxis(out, 3, 1).astype(dtype), lse)  # [b, bq, Hkv, G, Dv]

    qb = _blocks(q, block)
    _, (out, lse) = jax.lax.scan(query_block, None, (jnp.arange(qb.shape[0]), qb))
    return _unblocks(out), lse


def _flash_fwd(q, k, v, sinks, visible, scale, dtype, block, sk):
    out, lse = _forward(q, k, v, sinks, visible, scale, dtype, block, sk)
    return out, (q, k, v, sinks, visible, out, lse)


def _flash_bwd(scale, dtype, block, sk, res, dout):
    q, k, v, sinks, visible, out, lse = res
    hkv, g = q.shape[2:4]
    acc = _accumulator(dtype)
    kb, vb = _blocks(k, block), _blocks(v, block)
    nk = kb.shape[0]
    # D = rowsum(dO * O): the softmax's backward term per query, [nq, b, Hkv, G, block]
    delta = jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1)
    delta = jnp.moveaxis(_blocks(delta, block), 2, 4)

    def query_block(carry, xs):
        i, qi, doi, lse_i, d_i = xs

        def key_block(carry, j):
            mask = visible.block(i * block, block, j * block, block, sk)

            def compute(carry):
                dq, dk, dv = carry
                kj, vj = kb[j], vb[j]
                p = jnp.exp(_scores(qi, kj, mask, scale, acc) - lse_i[..., None])
                dv_j = jnp.einsum(
                    "bkgqs,bqkgd->bskd", p.astype(dtype), doi, preferred_element_type=acc
                )
                dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=acc)
                ds = (p * (dp - d_i[..., None])).astype(dtype)
                dq = dq + scale * jnp.einsum(
                    "bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=acc
                )
                dk_j = scale * jnp.einsum("bkgqs,bqkgd->bskd", ds, qi, preferred_element_type=acc)
                return dq, dk.at[j].add(dk_j), dv.at[j].add(dv_j)

            return jax.lax.cond(jnp.any(mask), compute, lambda c: c, carry), None

        dq0 = jnp.zeros(qi.shape, acc)
        (dq, dk, dv), _ = jax.lax.scan(key_block, (dq0, *carry), jnp.arange(nk))
        return (dk, dv), dq

    xs = (jnp.arange(lse.shape[0]), _blocks(q, block), _blocks(dout.astype(dtype), block))
    init = (jnp.zeros(kb.shape, acc), jnp.zeros(vb.shape, acc))
    (dk, dv), dq = jax.lax.scan(query_block, init, (*xs, lse, delta))
    dsinks = None
    if sinks is not None:  # d sink = -sum over queries of p_sink * D
        p_sink = jnp.exp(_sink(sinks, hkv, g, acc) - lse)  # [nq, b, Hkv, G, block]
        dsinks = -jnp.sum(p_sink * delta, axis=(0, 1, 4)).reshape(sinks.shape)
        dsinks = dsinks.astype(sinks.dtype)
    return (
        _unblocks(dq).astype(q.dtype),
        _unblocks(dk).astype(k.dtype),
        _unblocks(dv).astype(v.dtype),
        dsinks,
        None,
    )


_flash.defvjp(_flash_fwd, _flash_bwd)
