"""Speculative decoding with the MTP modules: ``generate(..., speculative="mtp")``.

The model's D = ``mtp_layers`` multi-token-prediction modules (:mod:`._mtp`) draft D tokens
after each trunk step; the trunk then runs the last token and the D drafts in one forward
(D + 1 queries over the KV cache) and keeps the longest run of drafts it agrees with, plus one
token of its own: 1 to D + 1 new tokens per trunk step. The drafts are only proposals:

- greedy (temperature 0): a draft is kept when it is the trunk's argmax at its position, and
  the token after the kept run is the trunk's argmax there, so the output is token for token
  the plain greedy output, whatever the drafts were (up to floating-point rounding: the trunk
  runs D + 1 queries over a longer cache, whose sums may round otherwise, so two nearly tied
  logits can order differently, more likely in bfloat16);
- sampling: standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023). Draft j
  is drawn from the module's distribution ``q_j`` (the same temperature, top-k and top-p as
  the trunk's), kept with probability ``min(1, p_j(d_j) / q_j(d_j))`` under the trunk's
  distribution ``p_j``; at the first rejection the token is drawn from ``max(p_j - q_j, 0)``
  renormalized, and after D kept drafts from ``p_D``. Each new token then has the
  distribution of plain sampling (not the same tokens for a key: the draws differ).

The rows of a batch keep different numbers of tokens per step, so every row has its own time
step and position; the cache is written at one cursor shared by the rows, D + 1 slots per
step, and a rejected draft's slot is marked empty (segment 0), never seen again. The cache
therefore has ``S + (D + 1) * (max_new_tokens - 1)`` slots (no ring buffer: the families that
ship MTP modules have no sliding windows) for the trunk and, per depth, the MTP layer's own
keys and values at the same slots.

Depth k (1-based) at position i reads token ``i + k``; after a step the last position's
tokens ahead are the new drafts, so with D >= 2 the cache entries of depths k >= 2 at the last
k - 1 positions of a step were computed from drafts that may be rejected later. They are not
recomputed: this can lower later drafts' acceptance, never change the output. The published
checkpoints have D = 1, where it does not arise.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

import jaxops

from ._decoding import (
    Cache,
    Sampling,
    categorical,
    layer,
    next_token,
    prompt_tokens,
    seen,
    to_slots,
    trunk,
    warped,
)
from ._layers import Tokens, embed, layer_kinds, projection
from ._layout import Layout
from ._mtp import BLOCK
from ._run import ffn

__all__ = ["Drafts", "decode", "prefill", "slots"]


@dataclasses.dataclass(frozen=True)
class Drafts:
    """The MTP modules' proposals for the next step and the state they were drawn from.

    Attributes:
      tokens: int32 ``[B, D]``: the drafts, depth 1 first.
      probs: float32 ``[B, D, V]``: the distributions they were drawn from (unused by greedy
        decoding, where they are zeros).
      kv: the MTP layers' KV cache, each leaf ``[D, B, C, ...]`` (as the trunk's cache, one
        layer per depth).
    """

    tokens: jax.Array
    probs: jax.Array
    kv: tuple[jax.Array, ...]


jax.tree_util.register_dataclass(Drafts, data_fields=["tokens", "probs", "kv"], meta_fields=[])


def slots(prompt: int, steps: int, depth: int) -> int:
    """The cache's slots: the prompt's, then D + 1 per trunk step (at most ``steps - 1``)."""
    return prompt + (depth + 1) * (steps - 1)


def _draw(s: Sampling, logits: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(token [B], probs [B, V])``: a draft from float32 ``logits [B, V]``.

    Greedy: the argmax, and zeros for the distribution (the acceptance compares tokens).
    """

    def greedy(logits, key):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), jnp.zeros_like(logits)

    def sampled(logits, key):
        w = warped(s, logits)
        return categorical(key, w), jax.nn.softmax(w, axis=-1)

    return jax.lax.cond(s.greedy, greedy, sampled, logits, key)


def _ahead(stream: jax.Array, drafts: list[jax.Array], last: jax.Array, k: int) -> jax.Array:
    """int32 ``[B, n]``: the token ``k + 1`` positions after each of the n positions.

    `stream` ``[B, n]`` holds the token after each position, known up to the row's `last`
    position ``[B]``; past it come the `drafts` of this call's earlier depths.
    """
    n = stream.shape[1]
    ext = jnp.concatenate([stream] + [d[:, None] for d in drafts], axis=1)
    m = jnp.arange(n)[None, :] + k
    src = jnp.where(m <= last[:, None], m, n + m - last[:, None] - 1)
    return jnp.take_along_axis(ext, jnp.clip(src, 0, ext.shape[1] - 1), axis=1)


def _draft(
    layout: Layout,
    params: dict[str, Any],
    head: dict[str, Any],
    h: jax.Array,
    where: Tokens,
    keys: Tokens,
    stream: jax.Array,
    last: jax.Array,
    past: tuple[jax.Array, ...] | None,
    keep: Any,
    s: Sampling,
    key: jax.Array,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """The MTP modules over n positions: ``(drafts [B, D], probs [B, D, V], kv)``.

    `h` ``[B, n, H]``: the trunk's last layer output at the positions placed by `where`
    (before its final norm); `stream` int32 ``[B, n]`` the token after each position, known up
    to each row's `last` position; the drafts are read at `last`. `past`: the MTP layers'
    cached entries (``[D, B, C, ...]``; None in the prefill), `keys` placing them and the new
    ones. `kv`: this call's entries, ``keep`` applied, stacked ``[D, ...]``.
    """
    c, ops = layout.config, layout.ops
    block = layout.mtp_layout
    eps = c.rms_norm_eps
    static, scanned = layer_kinds(c, [c.num_layers - 1])  # the last layer's pattern
    kind = None if scanned is None else jax.tree.map(lambda a: a[0], scanned)
    moe = ffn(block, BLOCK)
    x = jaxops.rms_norm(h, head["final_norm"], eps=eps, impl=ops.impl)
    at_last = last[:, None, None]
    drafts, probs, entries = [], [], []
    for k in range(c.mtp_layers):
        p = jax.tree.map(lambda a, k=k: a[k], params["mtp"])
        tokens = jnp.where(where.valid, _ahead(stream, drafts, last, k), 0)
        e = layout.place(embed(ops, params["embed"], tokens))
        e = jnp.where(where.valid[..., None], e, jnp.zeros((), e.dtype))
        e = jaxops.rms_norm(e, p["enorm"], eps=eps, impl=ops.impl)
        prev = jaxops.rms_norm(x, p["hnorm"], eps=eps, impl=ops.impl)
        y = projection(ops, jnp.concatenate([e, prev], axis=-1), p["eh_proj"], None)
        cached = None if past is None else tuple(a[k] for a in past)
        y, kv = layer(block, BLOCK, moe, where, keys, keep, static, y, (p["block"], cached, kind))
        y_last = jnp.take_along_axis(y, at_last, axis=1)
        logits = layout.head({**head, "final_norm": p["head_norm"]}, y_last)[:, 0]
        token, prob = _draw(s, logits, jax.random.fold_in(key, k))
        drafts.append(token)
        probs.append(prob)
        entries.append(kv)
        x = jaxops.rms_norm(y, p["head_norm"], eps=eps, impl=ops.impl)
    kv = jax.tree.map(lambda *a: jnp.stack(a), *entries)
    return jnp.stack(drafts, axis=1), jnp.stack(probs, axis=1), kv


def _verify(
    s: Sampling, logits: jax.Array, drafts: Drafts, key: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(kept [B], token [B])``: how many drafts the trunk keeps and its token after them.

    `logits` float32 ``[B, D + 1, V]``: the trunk's at the last token and at each draft.
    """
    depth = drafts.tokens.shape[1]

    def greedy(logits, key):
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, D + 1]
        same = (drafts.tokens == best[:, :depth]).astype(jnp.int32)
        kept = jnp.sum(jnp.cumprod(same, axis=1), axis=1).astype(jnp.int32)
        return kept, jnp.take_along_axis(best, kept[:, None], axis=1)[:, 0]

    def sampled(logits, key):
        p = jax.nn.softmax(warped(s, logits), axis=-1)  # [B, D + 1, V]
        d = drafts.tokens[..., None]
        p_d = jnp.take_along_axis(p[:, :depth], d, axis=-1)[..., 0]
        q_d = jnp.take_along_axis(drafts.probs, d, axis=-1)[..., 0]
        u = jax.random.uniform(jax.random.fold_in(key, 0), p_d.shape)
        keep = (u * q_d < p_d).astype(jnp.int32)  # u < p / q (q > 0: the draft was drawn)
        kept = jnp.sum(jnp.cumprod(keep, axis=1), axis=1).astype(jnp.int32)
        # After a rejection at j: max(p_j - q_j, 0) renormalized; after D kept drafts: p_D.
        rest = jnp.concatenate([jnp.maximum(p[:, :depth] - drafts.probs, 0.0), p[:, depth:]], 1)
        rest = jnp.take_along_axis(rest, kept[:, None, None], axis=1)[:, 0]
        own = jnp.take_along_axis(p, kept[:, None, None], axis=1)[:, 0]
        rest = jnp.where(jnp.sum(rest, -1, keepdims=True) > 0, rest, own)  # rounding: p == q
        token = categorical(jax.random.fold_in(key, 1), jnp.log(rest))
        return kept, token

    return jax.lax.cond(s.greedy, greedy, sampled, logits, key)


@functools.partial(jax.jit, static_argnames=("layout", "slots", "steps"))
def prefill(
    params: dict[str, Any],
    prompt: jax.Array,
    mask: jax.Array,
    sampling: Sampling,
    *,
    layout: Layout,
    slots: int,
    steps: int,
) -> tuple[Cache, Drafts, jax.Array, jax.Array]:
    """The prompt through the trunk and the MTP modules: ``(cache, drafts, out, done)``.

    The trunk's cache and the MTP layers' hold the prompt in slots ``0 .. S - 1``; `out` int32
    ``[B, steps]`` the first new token in column 0 (`pad` after it); `done` the EOS flags.
    """
    b, s = prompt.shape
    where = prompt_tokens(layout, mask)

    def keep(x):
        return to_slots(x, slots)  # slots > S: the prompt in slots 0 .. S - 1, zeros after

    h, kv = trunk(layout, params, prompt, where, where, keep, None)
    head = layout.head_params(params)
    logits = layout.head(head, h[:, -1:])[:, 0]
    token, done = next_token(sampling, logits, 0, layout.place(jnp.zeros((b,), bool)))
    stream = jnp.concatenate([prompt[:, 1:], token[:, None]], axis=1)
    last = jnp.full((b,), s - 1, jnp.int32)
    # (key, 0) drew the token; (key, n) for n in 1 .. steps - 1 are the decode steps'
    key = jax.random.fold_in(sampling.key, steps)
    tokens, probs, mtp_kv = _draft(
        layout, params, head, h, where, where, stream, last, None, keep, sampling, key
    )
    cache = Cache(kv, *(keep(x) for x in (where.index, where.positions, where.segments)))
    out = jnp.where(jnp.arange(steps) == 0, token[:, None], sampling.pad)
    return cache, Drafts(tokens, probs, mtp_kv), out, done


@functools.partial(
    jax.jit, static_argnames=("layout", "start"), donate_argnames=("cache", "drafts", "out")
)
def decode(
    params: dict[str, Any],
    cache: Cache,
    drafts: Drafts,
    out: jax.Array,
    done: jax.Array,
    first: jax.Array,
    sampling: Sampling,
    *,
    layout: Layout,
    start: int,
) -> tuple[jax.Array, jax.Array, Cache, Drafts]:
    """The new tokens after the first: one ``lax.while_loop`` over the speculative step.

    `out` int32 ``[B, N]`` holds the first new token in column 0; `done` bool ``[B]``; `first`
    int32 ``[B]`` the position of the first new token; `start` the prompt length S. Returns
    ``(out, trunk steps, cache, drafts)``, the trunk steps int32 ``[B]`` (the steps in which
    the row was still generating).
    """
    steps = out.shape[1]
    depth = drafts.tokens.shape[1]
    b = out.shape[0]
    ahead = jnp.arange(depth + 1, dtype=jnp.int32)
    head = layout.head_params(params)

    def step(carry):
        n, made, trunk_steps, cache, drafts, out, done = carry
        live = ~done & (made < steps)
        last_token = jnp.take_along_axis(out, jnp.maximum(made - 1, 0)[:, None], axis=1)
        fed = jnp.concatenate([last_token, drafts.tokens], axis=1)  # [B, D + 1]
        t = start + made - 1  # the time step of the last token, per row
        where = Tokens(
            index=t[:, None] + ahead,
            positions=(first + made - 1)[:, None] + ahead,
            segments=jnp.broadcast_to(live[:, None], fed.shape).astype(jnp.int32),
        )
        keys = seen(cache, where)
        h, kv = trunk(layout, params, fed, where, keys, lambda x: x, cache.kv)
        key = jax.random.fold_in(sampling.key, n + 1)  # 0: the prefill's
        kept, token = _verify(sampling, layout.head(head, h), drafts, jax.random.fold_in(key, 0))
        # The new tokens: the kept drafts, then the trunk's token.
        new = jnp.where(ahead < kept[:, None], jnp.pad(drafts.tokens, ((0, 0), (0, 1))), 0)
        new = jnp.where(ahead == kept[:, None], token[:, None], new)
        eos = jnp.isin(new, sampling.eos) & (ahead <= kept[:, None])
        count = jnp.where(jnp.any(eos, 1), jnp.argmax(eos, 1) + 1, kept + 1)
        count = jnp.where(live, count, 0).astype(jnp.int32)
        rel = jnp.arange(steps, dtype=jnp.int32)[None, :] - made[:, None]
        fill = (rel >= 0) & (rel < count[:, None])
        out = jnp.where(fill, jnp.take_along_axis(new, jnp.clip(rel, 0, depth), axis=1), out)
        done = done | (live & jnp.any(eos & (ahead < count[:, None]), 1))
        # The fed tokens the trunk kept (the last token and the kept drafts) stay in the cache.
        kept_where = dataclasses.replace(
            where, segments=(live[:, None] & (ahead <= kept[:, None])).astype(jnp.int32)
        )
        kept_keys = dataclasses.replace(
            keys, segments=jnp.concatenate([cache.segments, kept_where.segments], 1)
        )
        tokens, probs, mtp_kv = _draft(
            layout,
            params,
            head,
            h,
            kept_where,
            kept_keys,
            new,
            kept,
            drafts.kv,
            lambda x: x,
            sampling,
            jax.random.fold_in(key, 1),
        )
        slot = start + n * (depth + 1)

        def put(old, new, axis):
            return jax.lax.dynamic_update_slice_in_dim(old, new.astype(old.dtype), slot, axis=axis)

        cache = Cache(
            tuple(put(old, new, 2) for old, new in zip(cache.kv, kv, strict=True)),
            put(cache.index, kept_where.index, 1),
            put(cache.positions, kept_where.positions, 1),
            put(cache.segments, kept_where.segments, 1),
        )
        mtp_kv = tuple(put(old, new, 2) for old, new in zip(drafts.kv, mtp_kv, strict=True))
        drafts = Drafts(jnp.where(live[:, None], tokens, 0), probs, mtp_kv)
        made = jnp.minimum(made + count, steps)
        return n + 1, made, trunk_steps + live, cache, drafts, out, done

    def more(carry):
        _, made, _, _, _, _, done = carry
        return jnp.any(~done & (made < steps))

    zeros = layout.place(jnp.zeros((b,), jnp.int32))
    init = (jnp.int32(0), zeros + 1, zeros, cache, drafts, out, done)
    _, _, trunk_steps, cache, drafts, out, _ = jax.lax.while_loop(more, step, init)
    return out, trunk_steps, cache, drafts
