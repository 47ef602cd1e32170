"""What generation runs on: the KV cache, the sampling settings and one forward over the cache.

Shared by :func:`~jaxops.models.generate`'s plain decoding (:mod:`._generate`) and its
speculative decoding with the MTP modules (:mod:`._speculative`). The cache's layout and size
are described in :mod:`._generate`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxops

from ._layers import (
    LayerKind,
    Tokens,
    Visible,
    attention_inputs,
    attention_output,
    embed,
    layer_kinds,
)
from ._layout import Layout
from ._run import ffn

__all__ = [
    "Cache",
    "Sampling",
    "categorical",
    "choose",
    "layer",
    "next_token",
    "prompt_tokens",
    "sample",
    "seen",
    "to_slots",
    "trunk",
    "warped",
]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: arrays only, so greedy and sampling share one compile.

    Attributes:
      greedy: bool scalar: the most likely token (the filters and the key are then unused).
      temperature: float32 scalar > 0.
      top_k: int32 scalar in ``[1, V]`` (V: no filter).
      top_p: float32 scalar in ``(0, 1]`` (1: no filter).
      eos: int32 ``[n]``: the ids that end a row (-1: none), n a multiple of 8.
      pad: int32 scalar: what a finished row emits.
      key: a typed ``jax.random`` key; in plain decoding new token i samples with
        ``fold_in(key, i)``.
    """

    greedy: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    eos: jax.Array
    pad: jax.Array
    key: jax.Array


jax.tree_util.register_dataclass(
    Sampling,
    data_fields=["greedy", "temperature", "top_k", "top_p", "eos", "pad", "key"],
    meta_fields=[],
)


@dataclasses.dataclass(frozen=True)
class Cache:
    """The KV cache: ``kv`` (per layer, ``[L, B, C, ...]``), ``index, positions, segments``.

    Each slot's time step, rotary position (Llama 4's attention chunks) and document, int32
    ``[B, C]``.

    ``kv``: GQA ``(k, v)`` each ``[L, B, C, Hkv, Dh]``; MLA ``(latent [L, B, C, R],
    k_rope [L, B, C, 1, dr])``.
    """

    kv: tuple[jax.Array, ...]
    index: jax.Array
    positions: jax.Array
    segments: jax.Array


jax.tree_util.register_dataclass(
    Cache, data_fields=["kv", "index", "positions", "segments"], meta_fields=[]
)


def warped(s: Sampling, logits: jax.Array) -> jax.Array:
    """float32 ``logits [..., V]`` over the temperature, -inf outside top-k and top-p.

    Its softmax is the distribution :func:`sample` draws from (transformers' warpers).
    """
    logits = logits / s.temperature
    ranked = -jnp.sort(-logits, axis=-1)
    kth = jax.lax.dynamic_slice_in_dim(ranked, s.top_k - 1, 1, axis=ranked.ndim - 1)
    logits, ranked = (jnp.where(x < kth, -jnp.inf, x) for x in (logits, ranked))
    # top_p: the smallest set of most likely tokens whose probability reaches top_p; a token
    # stays when the tokens more likely than it hold less than top_p (the most likely always).
    probs = jax.nn.softmax(ranked, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs < s.top_p) | (s.top_p >= 1.0)
    cutoff = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """int32 ``[B]`` drawn from ``softmax(logits [B, V])``, split like the batch."""
    sharding = jax.typeof(logits).sharding
    out = sharding.update(spec=P(*sharding.spec[:1])) if sharding.spec else None
    return jax.random.categorical(key, logits, out_sharding=out).astype(jnp.int32)


def sample(s: Sampling, logits: jax.Array, key: jax.Array) -> jax.Array:
    """int32 ``[B]`` drawn from ``softmax(logits [B, V] / temperature)`` after top-k, top-p."""
    return categorical(key, warped(s, logits))


def choose(s: Sampling, logits: jax.Array, key: jax.Array) -> jax.Array:
    """int32 ``[B]``: the next token of float32 ``logits [B, V]`` (transformers' warpers).

    Greedy runs only the argmax (a ``lax.cond``: no sort of the vocabulary).
    """
    argmax = lambda logits, key: jnp.argmax(logits, axis=-1).astype(jnp.int32)  # noqa: E731
    return jax.lax.cond(s.greedy, argmax, functools.partial(sample, s), logits, key)


def next_token(
    s: Sampling, logits: jax.Array, i: Any, done: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(token, done)``: new token `i` of each row, and which rows emitted an EOS token.

    A finished row emits `s.pad`.
    """
    token = jnp.where(done, s.pad, choose(s, logits, jax.random.fold_in(s.key, i)))
    return token, done | jnp.isin(token, s.eos)


def to_slots(x: jax.Array, slots: int) -> jax.Array:
    """``x [B, S, ...]`` (time on axis 1) as the cache's ``[B, slots, ...]``.

    The last `slots` time steps, step ``t`` in slot ``t % slots``; zeros (segment 0: empty)
    after a prompt shorter than the cache.
    """
    s = x.shape[1]
    if s < slots:
        return jnp.pad(x, [(0, 0), (0, slots - s)] + [(0, 0)] * (x.ndim - 2))
    return jnp.roll(x[:, s - slots :], (s - slots) % slots, axis=1)


def prompt_tokens(layout: Layout, mask: jax.Array) -> Tokens:
    """The prompt's tokens, `mask` int32 ``[B, S]`` (1: a token, 0: padding, left or right).

    Time steps ``0 .. S - 1``; rotary positions counting a row's tokens from 0 (padding before
    them holds position 0); segment 1 for a token, 0 (attended by nothing) for padding.
    """
    b, s = mask.shape
    return Tokens(
        index=layout.place(jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))),
        positions=jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32),
        segments=mask.astype(jnp.int32),
    )


def seen(cache: Cache, where: Tokens) -> Tokens:
    """The keys a decode step's queries `where` ``[B, Q]`` attend to: the cache's, then theirs."""
    return Tokens(
        index=jnp.concatenate([cache.index, where.index], 1),
        positions=jnp.concatenate([cache.positions, where.positions], 1),
        segments=jnp.concatenate([cache.segments, where.segments], 1),
    )


def layer(
    layout: Layout,
    key: str,
    ffn: Callable,
    where: Tokens,
    keys: Tokens,
    keep: Callable[[jax.Array], jax.Array],
    static: LayerKind,
    h: jax.Array,
    xs: tuple[dict[str, Any], tuple[jax.Array, ...] | None, LayerKind | None],
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """One decoder layer over `h` whose queries are placed by `where`, keys by `keys`.

    ``xs``: the layer's parameters, its cached KV entries (``_layers.attention_inputs``'
    ``kv``, time on axis 1; None in the prefill, where the queries attend to their own keys)
    and its attention pattern when the layers' differ (else `static`). Returns
    ``(h', keep(kv))``: this call's KV entries as the cache stores them. `key`: the stack
    (a quantized base's weights are dequantized here, one layer at a time).
    """
    ops, c = layout.ops, layout.config
    p, past, kind = xs
    p = layout.dequantized(p, key)  # a quantized base: this layer's weights, for this step
    kind = static if kind is None else kind
    a = jaxops.rms_norm(h, p["attn_norm"], eps=c.rms_norm_eps, impl=ops.impl)
    q, kv = attention_inputs(ops, c, p, a, where, kind)
    seen = kv
    if past is not None:  # the cached entries, then this step's
        seen = tuple(jnp.concatenate([old, new], 1) for old, new in zip(past, kv, strict=True))
    a = attention_output(ops, c, p, q, seen, Visible(where, keys, kind.window, kind.chunk))
    y, h = jaxops.add_rms_norm(a, h, p["mlp_norm"], eps=c.rms_norm_eps, impl=ops.impl)
    m, _ = ffn(p, y, where.valid)
    return h + m, tuple(keep(x) for x in kv)


def trunk(
    layout: Layout,
    params: dict[str, Any],
    tokens: jax.Array,
    where: Tokens,
    keys: Tokens,
    keep: Callable[[jax.Array], jax.Array],
    past: tuple[jax.Array, ...] | None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """The last layer's output ``[B, s, H]`` (before the final norm) and every layer's KV entries.

    Embedding, then the layers (one ``lax.scan`` per run of one kind); the KV entries are
    stacked ``[L, ...]`` in layer order. `tokens` int32 ``[B, s]`` placed by `where`; `keys`
    places the cached entries `past` (``[L, B, C, ...]``; None: the queries attend to their own
    keys only) followed by the queries' own; `keep` maps each new KV entry to what is returned.
    """
    x = layout.place(embed(layout.ops, params["embed"], jnp.where(where.valid, tokens, 0)))
    h, entries = x, []
    for key, start, stop, first in layout.runs:
        n = stop - start
        static, scanned = layer_kinds(layout.config, range(first, first + n))
        body = functools.partial(layer, layout, key, ffn(layout, key), where, keys, keep, static)
        stack = jax.tree.map(lambda a, i=start, j=stop: a[i:j], params[key])
        cached = None if past is None else tuple(a[first : first + n] for a in past)
        h, kv = jax.lax.scan(body, h, (stack, cached, scanned))
        entries.append(kv)
    kv = entries[0] if len(entries) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *entries)
    return h, kv
