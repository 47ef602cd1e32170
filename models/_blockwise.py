"""Blockwise attention: an online softmax over key blocks, a backward that recomputes per block.

The queries are taken ``block`` at a time (fewer queries than that: all of them, rounded up to
8); each query block runs over the key blocks with a running maximum, sum and output (the
online softmax of FlashAttention), and keeps only its output and its log-sum-exp for the
backward, which recomputes each block's probabilities from them. No array of ``[sq, sk]``
exists in the forward or the backward: what grows with the sequence is linear in it (the
inputs, the output, the backward's float32 gradients of the keys and values), and a block
pair's scores are ``[b, heads, block, block]`` in float32.

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

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxops._errors import InvalidArgumentError
from jaxops._sharding import cotangent_like, vary_like

from ._mask import Tokens, Visible

__all__ = ["attention", "gathered_attention", "ring_attention"]


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
    bq = _query_block(sq, block)
    nq, nk = -(-sq // bq), -(-sk // block)
    q = _pad(q, nq * bq)
    k, v = _pad(k, nk * block), _pad(v, nk * block)
    padded = Visible(
        _pad_tokens(visible.q, nq * bq),
        _pad_tokens(visible.k, nk * block),
        visible.window,
        visible.chunk,
        None if visible.valid_keys is None else _pad(visible.valid_keys, nk * block),
    )
    out = _flash(q, k, v, sinks, padded, scale, jnp.dtype(dtype), (bq, block), sk)
    return out[:, :sq]


def _query_block(sq: int, block: int) -> int:
    """Queries per block: `block`, or `sq` rounded up to 8 when fewer (no padding to a block).

    (A decode step's one query then computes ``[8, block]`` scores per key block, not
    ``[block, block]``.)
    """
    return min(block, -(-sq // 8) * 8)


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


def _partial(q, k, v, visible: Visible, scale, dtype, blocks, sk):
    """``(out, lse)`` of `q` over the keys `k`, `v` alone (padded inputs).

    out ``[b, sq, Hkv, G, Dv]`` normalized over these keys, lse ``[b, sq, Hkv, G]`` their
    log-sum-exp (-inf for a query that sees none of them), both in the accumulation dtype:
    partial results over disjoint keys merge exactly (:func:`_merge`).
    """
    b, _, hkv, g, _ = q.shape
    dv, acc = v.shape[-1], _accumulator(dtype)
    bq, bk = blocks
    kb, vb = _blocks(k, bk), _blocks(v, bk)
    nk = kb.shape[0]

    def query_block(_, xs):
        i, qi = xs

        def key_block(carry, j):
            mask = visible.block(i * bq, bq, j * bk, bk, sk)

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
            jnp.full((b, hkv, g, bq), -jnp.inf, acc),
            jnp.zeros((b, hkv, g, bq), acc),
            jnp.zeros((b, hkv, g, bq, dv), acc),
        )
        init = vary_like(init, q, k, v)  # inside a shard_map: as the blocks' results
        # A while loop (a traced trip count), not a scan: a differentiated scan around the
        # attention (the layers') would otherwise keep every block pair's scores and mask as
        # residuals of this loop, though the backward (:func:`_backward_part`) never reads them.
        m, total, o = jax.lax.fori_loop(
            0, jnp.asarray(nk), lambda j, carry: key_block(carry, j)[0], init
        )
        seen = total > 0
        out = o / jnp.where(seen, total, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
        return None, (jnp.moveaxis(out, 3, 1), jnp.moveaxis(lse, 3, 1))

    qb = _blocks(q, bq)
    _, (out, lse) = jax.lax.scan(query_block, None, (jnp.arange(qb.shape[0]), qb))
    return _unblocks(out), _unblocks(lse)


def _finite(lse: jax.Array) -> jax.Array:
    """`lse` with 0 where it is -inf (no key: every probability against it is exp(-inf) = 0)."""
    return jnp.where(jnp.isfinite(lse), lse, 0.0)


def _merge(a: tuple, b: tuple) -> tuple:
    """The ``(out, lse)`` of two partial results over disjoint keys."""
    lse = jnp.logaddexp(a[1], b[1])
    weight = lambda part: jnp.exp(part[1] - _finite(lse))[..., None]  # noqa: E731
    return a[0] * weight(a) + b[0] * weight(b), lse


def _with_sinks(out, lse, sinks, dtype):
    """``(out in dtype, lse)`` with the sinks' logits joining every denominator."""
    if sinks is not None:
        sink = sinks.astype(lse.dtype).reshape(lse.shape[2:])
        total = jnp.logaddexp(lse, sink)
        out, lse = out * jnp.exp(lse - total)[..., None], total
    return out.astype(dtype), lse


def _backward_part(q, k, v, visible: Visible, dout, lse, delta, scale, dtype, blocks, sk):
    """``(dq, dk, dv)`` (accumulation dtype) of the keys `k`, `v`'s part of the attention.

    `lse`: the whole attention's log-sum-exp ``[b, sq, Hkv, G]`` (all keys and the sinks),
    `delta`: ``rowsum(dout * out)`` of the whole output, same shape.
    """
    acc = _accumulator(dtype)
    bq, bk = blocks
    kb, vb = _blocks(k, bk), _blocks(v, bk)
    nk = kb.shape[0]

    def query_block(carry, xs):
        i, qi, doi, lse_i, d_i = xs

        def key_block(carry, j):
            mask = visible.block(i * bq, bq, j * bk, bk, sk)

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

        dq0 = vary_like(jnp.zeros(qi.shape, acc), q, k, v, dout)
        (dq, dk, dv), _ = jax.lax.scan(key_block, (dq0, *carry), jnp.arange(nk))
        return (dk, dv), dq

    by_block = lambda a: jnp.moveaxis(_blocks(a, bq), 2, -1)  # [nq, b, Hkv, G, block]  # noqa: E731
    xs = (
        jnp.arange(q.shape[1] // bq),
        _blocks(q, bq),
        _blocks(dout.astype(dtype), bq),
        by_block(_finite(lse)),
        by_block(delta),
    )
    init = vary_like((jnp.zeros(kb.shape, acc), jnp.zeros(vb.shape, acc)), q, k, v, dout)
    (dk, dv), dq = jax.lax.scan(query_block, init, xs)
    return _unblocks(dq), _unblocks(dk), _unblocks(dv)


def _delta(dout, out):
    """``rowsum(dout * out)`` ``[b, sq, Hkv, G]``: the softmax backward's per-query term."""
    acc = _accumulator(out.dtype)
    return jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1)


def _dsinks(sinks, lse, delta):
    """The sinks' gradient: ``-sum over queries of p_sink * delta`` per head."""
    p_sink = jnp.exp(sinks.astype(lse.dtype).reshape(lse.shape[2:]) - _finite(lse))
    return -jnp.sum(p_sink * delta, axis=(0, 1)).reshape(sinks.shape).astype(sinks.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(q, k, v, sinks, visible, scale, dtype, blocks, sk):
    return _flash_fwd(q, k, v, sinks, visible, scale, dtype, blocks, sk)[0]


def _flash_fwd(q, k, v, sinks, visible, scale, dtype, blocks, sk):
    out, lse = _partial(q, k, v, visible, scale, dtype, blocks, sk)
    out, lse = _with_sinks(out, lse, sinks, dtype)
    return out, (q, k, v, sinks, visible, out, lse)


def _flash_bwd(scale, dtype, blocks, sk, res, dout):
    q, k, v, sinks, visible, out, lse = res
    delta = _delta(dout, out)
    dq, dk, dv = _backward_part(q, k, v, visible, dout, lse, delta, scale, dtype, blocks, sk)
    dsinks = None if sinks is None else _dsinks(sinks, lse, delta)
    # typed like their primals (inside a shard_map: reduced over the axes a primal is
    # invariant over, e.g. the sinks of a pipeline stage over the batch axes)
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsinks)
    return (*map(cotangent_like, grads, (q, k, v, sinks)), None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def ring_attention(
    q: jax.Array,
    kv: Any,
    visible: Visible,
    *,
    axis: str,
    size: int,
    scale: float,
    sinks: jax.Array | None,
    dtype: Any,
    block: int,
    expand: Callable[[Any, Any], tuple[jax.Array, jax.Array]] | None = None,
    params: Any = (),
    hops: int | None = None,
    near: bool | jax.Array = False,
) -> jax.Array:
    """:func:`attention` of this device's queries over the keys of every device of `axis`.

    Inside ``shard_map``: `kv` (with the keys' placement) passes around the ring of the `size`
    devices of mesh axis `axis` by ``ppermute``, one step per device, each step's blockwise
    attention merged into the running result (its log-sum-exp); the backward passes it around
    again with its gradient, which is home after the last step. The mask is the placements'
    (global time steps, positions, documents), wherever the tokens sit.

    Args:
      q: as :func:`attention`.
      kv: what the ring carries, every leaf ``[b, sk, ...]``: the keys and values ``(k, v)``
        themselves, or (with `expand`) a compressed form that each device expands on arrival:
        multi-head latent attention passes its latent and shared RoPE key (``R + dr`` numbers a
        token instead of ``H (dn + dr + dv)``).
      visible: as :func:`attention` (no KV-cache slots: ``visible.valid_keys`` is None).
      expand: ``expand(params, kv) -> (k, v)``, differentiable in both; None: `kv` is
        ``(k, v)``.
      params: what `expand` reads besides `kv` (their gradient: this device's queries' part,
        summed over the keys of every device).
      hops: with `near`, the keys reach only the devices this many places behind and ahead on
        the ring (a sliding window or attention chunk: a query looks back a bounded number of
        time steps, and the caller knows which devices hold them), ``2 hops`` sends instead of
        ``size - 1`` when that is fewer; None: once around the ring.
      near: whether `hops` applies to this call: a bool, or a traced bool scalar (a scan over
        layers of which only some are windowed: both rings are compiled, ``lax.cond`` picks).
      axis: the ring's mesh axis.
      size: the number of devices on `axis`.
      scale: as :func:`attention`.
      sinks: as :func:`attention`.
      dtype: as :func:`attention`.
      block: as :func:`attention`.

    Returns:
      ``[b, sq, Hkv, G, Dv]`` in `dtype`, as :func:`attention`.
    """
    sq, sk = q.shape[1], jax.tree.leaves(kv)[0].shape[1]
    if visible.valid_keys is not None:
        raise InvalidArgumentError(
            "jaxops.models._blockwise.ring_attention: visible.valid_keys (KV-cache slots) must "
            "be None: the ring passes whole sequences' keys"
        )
    bq = _query_block(sq, block)
    nq, nk = -(-sq // bq), -(-sk // block)
    padded = Visible(
        _pad_tokens(visible.q, nq * bq),
        _pad_tokens(visible.k, nk * block),
        visible.window,
        visible.chunk,
    )
    q, kv = _pad(q, nq * bq), jax.tree.map(lambda a: _pad(a, nk * block), kv)
    ring = _Ring(expand, axis, size, scale, jnp.dtype(dtype), (bq, block), sk, None)
    if hops is None or 2 * hops >= size - 1 or near is False:  # every device's keys
        out = _ring(q, kv, params, sinks, padded, ring)
    else:  # those of the `hops` devices either way
        near_ring = dataclasses.replace(ring, hops=hops)
        if near is True:
            out = _ring(q, kv, params, sinks, padded, near_ring)
        else:
            out = jax.lax.cond(
                near,
                lambda *a: _ring(*a, near_ring),
                lambda *a: _ring(*a, ring),
                q, kv, params, sinks, padded,
            )  # fmt: skip
    return out[:, :sq]


def gathered_attention(
    q: jax.Array,
    kv: Any,
    visible: Visible,
    *,
    axis: str,
    scale: float,
    sinks: jax.Array | None,
    dtype: Any,
    block: int,
    expand: Callable[[Any, Any], tuple[jax.Array, jax.Array]] | None = None,
    params: Any = (),
) -> jax.Array:
    """:func:`attention` of this device's queries over the keys of every device of `axis`, gathered.

    Inside ``shard_map``: `kv` and the keys' placement are all-gathered over `axis` (each
    device then holds the keys of the whole sequence, in device order; the mask reads the
    placements, so the order does not matter), expanded by `expand` if given, and this
    device's queries attend over them blockwise; the backward reduce-scatters the keys'
    gradient home (the all-gather's transpose). The exchange of context parallelism inside
    pipeline stages: an all-gather over one axis involves only the devices of that axis's
    group, which run the same stage at the same time, while a ``ppermute`` (the ring's
    collective-permute) names every device of the mesh, so on XLA:CPU it waits for stages
    whose pipeline tick runs other work. Memory: one layer's keys and values of the whole
    sequence (its blocks' scores stay ``[b, heads, block, block]``).

    Args:
      q: as :func:`attention`.
      kv: as :func:`ring_attention`: ``(k, v)``, or with `expand` what is gathered (the latent
        and shared RoPE key of multi-head latent attention).
      visible: as :func:`ring_attention`.
      axis: the mesh axis the sequence is split over.
      scale: as :func:`attention`.
      sinks: as :func:`attention`.
      dtype: as :func:`attention`.
      block: as :func:`attention`.
      expand: as :func:`ring_attention`.
      params: as :func:`ring_attention`.

    Returns:
      ``[b, sq, Hkv, G, Dv]`` in `dtype`, as :func:`attention`.
    """
    if visible.valid_keys is not None:
        raise InvalidArgumentError(
            "jaxops.models._blockwise.gathered_attention: visible.valid_keys (KV-cache slots) "
            "must be None: the keys gathered are whole sequences'"
        )
    every = jax.tree.map(lambda a: jax.lax.all_gather(a, axis, axis=1, tiled=True), (kv, visible.k))
    k, v = tuple(every[0]) if expand is None else expand(params, every[0])
    seen = Visible(visible.q, every[1], visible.window, visible.chunk)
    return attention(q, k, v, seen, scale=scale, sinks=sinks, dtype=dtype, block=block)


@dataclasses.dataclass(frozen=True)
class _Ring:
    """What a ring's custom_vjp holds static (see :func:`ring_attention`).

    `hops`: the keys go that many devices each way (None: once around the ring).
    """

    expand: Any
    axis: str
    size: int
    scale: float
    dtype: Any
    blocks: tuple[int, int]
    sk: int
    hops: int | None


def _send(tree: Any, r: _Ring, shift: int = 1) -> Any:
    """Every leaf to the device `shift` places on in the ring."""
    perm = [(i, (i + shift) % r.size) for i in range(r.size)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, r.axis, perm), tree)


def _keys(r: _Ring, params, kv):
    """``(k, v)`` of what the ring carries."""
    return tuple(kv) if r.expand is None else r.expand(params, kv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, kv, params, sinks, visible, r):
    return _ring_fwd(q, kv, params, sinks, visible, r)[0]


def _ring_fwd(q, kv, params, sinks, visible, r):
    def part_of(held):  # (out, lse) of this device's queries over the keys `held`
        k, v = _keys(r, params, held[0])
        seen = Visible(visible.q, held[1], visible.window, visible.chunk)
        return _partial(q, k, v, seen, r.scale, r.dtype, r.blocks, r.sk)

    def sweep(held, part, n, shift):
        # `part` merged with the keys `held` and those of the `n` devices on (`shift` a step),
        # each step's keys sent on while they are computed
        def body(_, carry):
            held, part = carry
            return _send(held, r, shift), _merge(part, part_of(held))

        # a while loop (as in _partial): one loop body for the steps, their buffers shared
        held, part = jax.lax.fori_loop(0, jnp.asarray(n), body, (held, part))
        return _merge(part, part_of(held))

    acc = _accumulator(r.dtype)
    dv = jax.eval_shape(lambda: _keys(r, params, kv))[1].shape[-1]
    part = (jnp.zeros((*q.shape[:-1], dv), acc), jnp.full(q.shape[:-1], -jnp.inf, acc))
    own = (kv, visible.k)
    if r.hops is None:  # once around: size - 1 sends
        part = sweep(own, part, r.size - 1, 1)
    else:  # the keys of the `hops` devices behind, then ahead
        part = sweep(own, part, r.hops, 1)
        if r.hops:
            part = sweep(_send(own, r, -1), part, r.hops - 1, -1)
    out, lse = _with_sinks(*part, sinks, r.dtype)
    return out, (q, kv, params, sinks, visible, out, lse)


def _ring_bwd(r, res, dout):
    q, kv, params, sinks, visible, out, lse = res
    delta = _delta(dout, out)
    acc = _accumulator(r.dtype)
    zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, acc), tree)  # noqa: E731

    def add(a, b):
        return jax.tree.map(lambda x, y: x + y.astype(acc), a, b)

    def grads_of(held):  # (dq, d kv, d params) of this device's queries over `held`'s keys
        seen = Visible(visible.q, held[1], visible.window, visible.chunk)
        args = (dout, lse, delta, r.scale, r.dtype, r.blocks, r.sk)
        if r.expand is None:
            k, v = held[0]
            dq_s, dk_s, dv_s = _backward_part(q, k, v, seen, *args)
            return dq_s, (dk_s, dv_s), ()
        (k, v), pull = jax.vjp(r.expand, params, held[0])
        dq_s, dk_s, dv_s = _backward_part(q, k, v, seen, *args)
        dp_s, dkv_s = pull((dk_s.astype(k.dtype), dv_s.astype(v.dtype)))
        return dq_s, dkv_s, dp_s

    def sweep(held, grads, n, shift, home):
        # `grads` (dq, dp) plus those of the keys `held` and of the `n` devices on (`shift` a
        # step); their keys' gradient travels with them and goes `home` places at the end
        def body(_, carry):
            held, dkv, dq, dp = carry
            dq_s, dkv_s, dp_s = grads_of(held)
            dkv = _send(add(dkv, dkv_s), r, shift)
            return _send(held, r, shift), dkv, dq + dq_s, add(dp, dp_s)

        held, dkv, dq, dp = jax.lax.fori_loop(0, jnp.asarray(n), body, (held, zeros(kv), *grads))
        dq_s, dkv_s, dp_s = grads_of(held)
        return (dq + dq_s, add(dp, dp_s)), _send(add(dkv, dkv_s), r, home)

    own = (kv, visible.k)
    grads = (jnp.zeros(q.shape, acc), zeros(params))
    if r.hops is None:  # once around: the gradient is home after `size` sends
        grads, dkv = sweep(own, grads, r.size - 1, 1, 1)
    else:  # `hops` devices each way, each direction's gradient home in one send
        grads, dkv = sweep(own, grads, r.hops, 1, -r.hops)
        if r.hops:
            grads, ahead = sweep(_send(own, r, -1), grads, r.hops - 1, -1, r.hops)
            dkv = add(dkv, ahead)
    dq, dp = grads
    dsinks = None if sinks is None else _dsinks(sinks, lse, delta)
    cast = lambda grads, like: jax.tree.map(lambda g, a: g.astype(a.dtype), grads, like)  # noqa: E731
    return (
        cotangent_like(dq.astype(q.dtype), q),
        jax.tree.map(cotangent_like, cast(dkv, kv), kv),
        jax.tree.map(cotangent_like, cast(dp, params), params),
        cotangent_like(dsinks, sinks),
        None,
    )


_ring.defvjp(_ring_fwd, _ring_bwd)
