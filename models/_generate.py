"""Text generation with a KV cache: :func:`generate` for :class:`~jaxops.models.MoEDecoder`.

Two compiled functions per model, prompt shape and number of new tokens (the sampling settings
are arguments, not constants: greedy and sampled generation share them): the prefill runs the
whole prompt at once, fills the cache and picks the first new token; the decode runs
one ``lax.while_loop`` whose body (the decode step, traced once and reused for every new token)
feeds the last token through the layers, writes its keys and values into the cache (donated,
updated in place) and picks the next token. Both are laid out like training: the batch over the
model's batch axes, the experts over its expert axis (the expert-parallel MoE layer). With
``speculative="mtp"`` the prefill and decode loop of :mod:`._speculative` (the MTP modules'
drafts checked by the trunk) run instead, on a cache of this layout (never a ring buffer)
and the MTP layers' own beside it.

The cache of a model with ``L`` layers, ``Hkv`` key/value heads of width ``Dh``:
``k, v [L, B, C, Hkv, Dh]`` in the compute dtype (with multi-head latent attention, DeepSeek-V3:
the compressed KV and the shared RoPE key, ``latent [L, B, C, R]`` and
``k_rope [L, B, C, 1, dr]``, expanded into keys and values at each step) and, shared by the
layers, each slot's time step, rotary position and document (``index, positions, segments``
int32 ``[B, C]``; segment 0 is an empty or padding slot) from which
:func:`~jaxops.models._mask.allowed` builds the mask. ``C = S + max_new_tokens``; with a
sliding window ``W`` in every layer the cache is a ring buffer of ``C = min(W, S +
max_new_tokens)`` slots (time step ``t`` in slot ``t % C``). A cached token costs
``2 * L * Hkv * Dh * itemsize + 12`` bytes (Mixtral-8x7B in bfloat16: 128 KiB); with MLA
``L * (R + dr) * itemsize + 12`` (DeepSeek-V3 in bfloat16: 61 * 576 * 2 bytes, 69 KiB, where
its 128 heads of 192 / 128 would cost 61 * 128 * 320 * 2 bytes, 4.8 MiB).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops import _checks
from jaxops._errors import ArgumentTypeError, ConfigError, InvalidArgumentError

from . import _speculative
from ._decoder import MoEDecoder
from ._decoding import Cache, Sampling, next_token, prompt_tokens, seen, to_slots, trunk
from ._layers import Tokens
from ._layout import Layout

__all__ = ["generate"]

_OP = "jaxops.models.generate"
_TOKEN_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


@functools.partial(jax.jit, static_argnames=("layout", "slots", "steps"))
def _prefill(
    params: dict[str, Any],
    prompt: jax.Array,
    mask: jax.Array,
    sampling: Sampling,
    *,
    layout: Layout,
    slots: int,
    steps: int,
) -> tuple[Cache, jax.Array, jax.Array]:
    """The prompt through the model: the filled cache, the first new token, the EOS flags."""
    b = prompt.shape[0]
    where = prompt_tokens(layout, mask)
    h, kv = trunk(layout, params, prompt, where, where, lambda x: to_slots(x, slots), None)
    logits = layout.head(layout.head_params(params), h[:, -1:])[:, 0]
    cache = Cache(kv, *(to_slots(x, slots) for x in (where.index, where.positions, where.segments)))
    token, done = next_token(sampling, logits, 0, layout.place(jnp.zeros((b,), bool)))
    out = jnp.where(jnp.arange(steps) == 0, token[:, None], sampling.pad)
    return cache, out, done


@functools.partial(jax.jit, static_argnames=("layout", "start"), donate_argnames=("cache", "out"))
def _decode(
    params: dict[str, Any],
    cache: Cache,
    out: jax.Array,
    done: jax.Array,
    first: jax.Array,
    sampling: Sampling,
    *,
    layout: Layout,
    start: int,
) -> tuple[jax.Array, Cache]:
    """The new tokens after the first: one ``lax.while_loop`` over the decode step.

    `out` int32 ``[B, N]`` holds the first new token in column 0; `done` bool ``[B]``; `first`
    int32 ``[B]`` the position of the first new token; `start` the prompt length S.
    """
    steps = out.shape[1]
    slots = cache.index.shape[1]

    def step(carry):
        i, cache, out, done = carry
        t = start + i - 1  # the time step of the token fed (the one chosen last)
        fed = jax.lax.dynamic_index_in_dim(out, i - 1, axis=1)
        where = Tokens(
            index=jnp.full_like(fed, t),
            positions=first[:, None] + i - 1,
            segments=(~done[:, None]).astype(jnp.int32),  # a finished row's tokens are padding
        )
        h, kv = trunk(layout, params, fed, where, seen(cache, where), lambda x: x, cache.kv)
        logits = layout.head(layout.head_params(params), h[:, -1:])[:, 0]
        slot = t % slots
        cache = Cache(
            tuple(
                jax.lax.dynamic_update_slice_in_dim(old, new, slot, axis=2)
                for old, new in zip(cache.kv, kv, strict=True)
            ),
            *(
                jax.lax.dynamic_update_slice_in_dim(old, new, slot, axis=1)
                for old, new in (
                    (cache.index, where.index),
                    (cache.positions, where.positions),
                    (cache.segments, where.segments),
                )
            ),
        )
        token, done = next_token(sampling, logits, i, done)
        out = jax.lax.dynamic_update_index_in_dim(out, token[:, None], i, axis=1)
        return i + 1, cache, out, done

    def more(carry):
        i, _, _, done = carry
        return (i < steps) & ~jnp.all(done)

    _, cache, out, _ = jax.lax.while_loop(more, step, (jnp.int32(1), cache, out, done))
    return out, cache  # the cache out too, so that the donated one is updated in place


def _check_mask(mask: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The attention mask as int32 host values: 0/1, left padding, a real token in every row."""
    if mask is None:
        return np.ones(shape, np.int32)
    if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
        raise ArgumentTypeError(
            f"{_OP}: attention_mask must be an array, got {type(mask).__name__}"
        )
    values = np.asarray(mask)
    if values.shape != shape:
        raise InvalidArgumentError(
            f"{_OP}: attention_mask must have the prompt's shape {shape}, got {values.shape}"
        )
    if values.dtype != bool and not np.issubdtype(values.dtype, np.integer):
        raise ArgumentTypeError(
            f"{_OP}: attention_mask must be bool or int, got {values.dtype.name}"
        )
    if not np.isin(values, (0, 1)).all():
        raise InvalidArgumentError(f"{_OP}: attention_mask must hold 0 and 1 only")
    values = values.astype(np.int32)
    empty = np.flatnonzero(values.sum(1) == 0)
    if empty.size:
        raise InvalidArgumentError(
            f"{_OP}: attention_mask row {empty[0]} has no real token (all 0)"
        )
    right = np.flatnonzero((np.diff(values, axis=1) < 0).any(1))
    if right.size:
        raise InvalidArgumentError(
            f"{_OP}: attention_mask must be left-padded (padding first, as transformers' "
            f"padding_side='left' gives), got a 0 after a 1 in row {right[0]}"
        )
    return values


def _sampling(
    vocab: int,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    key: Any,
    eos_token_id: Any,
    pad_token_id: Any,
) -> Sampling:
    """The checked sampling settings (host arrays and the key)."""
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        optional = value is None and name == "top_p"
        if not optional and (
            isinstance(value, bool) or not isinstance(value, (int, float, np.number))
        ):
            raise ArgumentTypeError(f"{_OP}: {name} must be a number, got {type(value).__name__}")
    if not (np.isfinite(temperature) and temperature >= 0):
        raise InvalidArgumentError(
            f"{_OP}: temperature must be finite and >= 0, got {temperature!r}"
        )
    if top_p is not None and not 0 < top_p <= 1:
        raise InvalidArgumentError(f"{_OP}: top_p must be in (0, 1], got {top_p!r}")
    if top_k is not None:
        top_k = _checks.check_int(_OP, "top_k", top_k, 1)
    if temperature > 0 and key is None:
        raise InvalidArgumentError(
            f"{_OP}: key is required when temperature > 0 (sampling), e.g. jax.random.key(0); "
            "got None"
        )
    if eos_token_id is None:
        eos = [-1]
    elif isinstance(eos_token_id, Sequence) and eos_token_id:
        eos = [_checks.check_int(_OP, "eos_token_id", e, 0) for e in eos_token_id]
    else:
        eos = [_checks.check_int(_OP, "eos_token_id", eos_token_id, 0)]
    if pad_token_id is not None:
        pad = _checks.check_int(_OP, "pad_token_id", pad_token_id, 0)
    if key is None:
        key = jax.random.key(0)  # unused: greedy
    elif not isinstance(key, jax.Array):
        raise ArgumentTypeError(f"{_OP}: key must be a jax.random key, got {type(key).__name__}")
    elif not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # a raw uint32 key: one compile for both kinds
    return Sampling(
        greedy=np.bool_(temperature == 0),
        temperature=np.float32(temperature or 1.0),
        top_k=np.int32(min(top_k or vocab, vocab)),
        top_p=np.float32(1.0 if top_p is None else top_p),
        eos=np.asarray(eos + [-1] * (-len(eos) % 8), np.int32),  # 1 to 8 ids: one compile
        pad=np.int32(max(eos[0], 0) if pad_token_id is None else pad),
        key=key,
    )


def generate(
    model: MoEDecoder,
    params: dict[str, Any],
    prompt: Any,
    max_new_tokens: int,
    *,
    attention_mask: Any = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key: jax.Array | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    speculative: str | None = None,
    return_stats: bool = False,
) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
    """The prompt followed by `max_new_tokens` generated tokens, as transformers' ``generate``.

    The prompt runs at once (prefill), then each new token is one decode step over the KV cache
    (with `speculative`, each step makes 1 to D + 1 tokens; see the module docstring for the
    cache's layout and size); the two are compiled once per model
    and shapes. Prompt tokens sit at positions ``cumsum(attention_mask) - 1``
    (transformers' position ids), new tokens continue from there; a sliding window (Mixtral)
    counts time steps, padding included, as transformers does. Call it outside ``jax.jit`` (it
    checks host values and compiles its own functions; the sampling settings, the key and the
    EOS ids are arguments of those, so changing them compiles nothing new).

    Args:
      model: the decoder; its mesh must have no pipe axis of size > 1.
      params: its parameters (:meth:`MoEDecoder.init`, :func:`from_pretrained`); ZeRO-3
        shards are gathered whole first (:meth:`MoEDecoder.gathered`).
      prompt: int32 or int64 ``[B, S]`` token ids; B a multiple of the devices of
        ``model.batch_axes`` (the batch is split over them, the experts over the expert axis).
        Host (numpy) ids of real tokens are checked against ``[0, V)``; on device arrays an id
        out of range embeds as NaN (its row's tokens are then meaningless).
      max_new_tokens: the tokens to generate, >= 1.
      attention_mask: 0/1 ``[B, S]`` (bool or int), 1 for real tokens: left padding (the
        padding before each row's prompt, transformers' ``padding_side="left"``); right padding
        is refused. None: every token is real.
      temperature: 0 picks the most likely token (greedy); > 0 samples from
        ``softmax(logits / temperature)`` after the `top_k` then `top_p` filters.
      top_k: keep the k most likely tokens (None: all).
      top_p: keep the smallest set of most likely tokens whose probability reaches top_p, at
        least one (nucleus sampling; None or 1: all).
      key: a ``jax.random`` key (typed or raw uint32), required when temperature > 0; the
        same key gives the same tokens, on any mesh (plain decoding: step i samples with
        ``fold_in(key, i)``; speculative decoding draws otherwise, so its tokens differ).
      eos_token_id: an id or ids that end a row: a row that emitted one continues with
        `pad_token_id`, and generation stops once every row did (the output keeps its shape).
      pad_token_id: what a finished row emits (default: the first eos_token_id).
      speculative: None, or "mtp": speculative decoding with the model's multi-token
        prediction modules (``config.mtp_layers`` = D >= 1, ``params["mtp"]``, as DeepSeek-V3
        and GLM-4.5 checkpoints ship them): they draft D tokens, the trunk checks them in one
        step and keeps 1 to D + 1 tokens. Greedy output is token for token the plain greedy
        output up to floating-point rounding (D + 1 queries over a longer cache may round
        otherwise, so nearly tied logits can order differently) where a token's result does
        not depend on the other tokens of a forward (not with a ``capacity_factor``, whose
        drops do, nor with per-tensor FP8 scales); sampling
        keeps its distribution (speculative sampling), not its tokens for a key. The cache
        then has ``S + (D + 1) * (max_new_tokens - 1)`` slots (rejected drafts leave empty
        ones).
      return_stats: also return ``{"new_tokens": int32 [B], "trunk_steps": int32 [B]}``: each
        row's generated tokens up to its EOS (included) and the trunk forwards that made them
        (the prefill's included; equal to ``new_tokens`` without `speculative`), whose ratio
        is the tokens per trunk step.

    Returns:
      int32 ``[B, S + max_new_tokens]``: the prompt, then the new tokens (batch-sharded); with
      `return_stats`, ``(tokens, stats)``.

    Raises:
      ConfigError: a mesh with pipeline stages or a context axis; ``speculative="mtp"`` for a
        model without MTP modules.
      TypeError / ValueError: a bad argument (named, with what was expected and what came).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxops.models import AttentionSpec, DecoderConfig, MoEDecoder, MoESpec, generate
      >>> cfg = DecoderConfig("mixtral", vocab_size=64, hidden_size=32, num_layers=2,
      ...                     attention=AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
      ...                     moe=MoESpec(num_experts=4, top_k=2, expert_ffn=16))
      >>> model = MoEDecoder(cfg, jax.make_mesh((1,), ("expert",)))
      >>> params = model.init(jax.random.key(0))
      >>> prompt = jnp.array([[0, 0, 5, 7], [1, 2, 3, 4]], jnp.int32)
      >>> mask = jnp.array([[0, 0, 1, 1], [1, 1, 1, 1]], jnp.int32)
      >>> out = generate(model, params, prompt, 3, attention_mask=mask)
      >>> out.shape, out.dtype, bool((out[:, :4] == prompt).all())
      ((2, 7), dtype('int32'), True)
      >>> sampled = generate(model, params, prompt, 3, attention_mask=mask, temperature=0.8,
      ...                    top_p=0.9, key=jax.random.key(1))
      >>> bool((sampled == generate(model, params, prompt, 3, attention_mask=mask,
      ...       temperature=0.8, top_p=0.9, key=jax.random.key(1))).all())
      True
    """
    if not isinstance(model, MoEDecoder):
        raise ArgumentTypeError(f"{_OP}: model must be a MoEDecoder, got {type(model).__name__}")
    if model.layout.context > 1:
        raise ConfigError(
            f"{_OP}: generation needs a mesh without a context axis, got the context axis "
            f"{model.context_axis!r} of size {model.layout.context}; use "
            "dataclasses.replace(model, mesh=jax.make_mesh(...)) with a mesh of data and expert "
            "axes only, and reshard the params onto it: jax.device_put(params, "
            "new_model.shardings())"
        )
    if model.pipe > 1:
        raise ConfigError(
            f"{_OP}: generation needs a mesh without pipeline stages, got the pipe axis "
            f"{model.pipe_axis!r} of size {model.pipe}; use dataclasses.replace(model, "
            "mesh=jax.make_mesh(...)) with a mesh of data and expert axes only, and reshard the "
            "params onto it: jax.device_put(params, new_model.shardings())"
        )
    if isinstance(prompt, jax.core.Tracer):
        raise ArgumentTypeError(f"{_OP}: call generate outside jax.jit (it got a traced prompt)")
    prompt = _checks.check_array(_OP, "prompt", prompt, dtypes=_TOKEN_DTYPES, min_rank=2)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise InvalidArgumentError(
            f"{_OP}: prompt must be [batch, seq], got shape {tuple(prompt.shape)}"
        )
    b, s = prompt.shape
    shards = model.batch_devices
    if b % shards:
        raise InvalidArgumentError(
            f"{_OP}: prompt's batch ({b}) must be a multiple of {shards} (the devices of the "
            f"batch axes {model.batch_axes})"
        )
    steps = _checks.check_int(_OP, "max_new_tokens", max_new_tokens, 1)
    if speculative not in (None, "mtp"):
        raise InvalidArgumentError(f"{_OP}: speculative must be None or 'mtp', got {speculative!r}")
    depth = model.config.mtp_layers if speculative else 0
    has_mtp = isinstance(params, dict) and "mtp" in params
    if speculative and (not depth or not has_mtp):
        raise ConfigError(
            f"{_OP}: speculative='mtp' needs the model's multi-token prediction modules "
            f"(config.mtp_layers >= 1 and params['mtp']), got mtp_layers={depth} and "
            f"{'a' if has_mtp else 'no'} params['mtp']; load a checkpoint that ships "
            "them (DeepSeek-V3, GLM-4.5) or generate with speculative=None"
        )
    mask = _check_mask(attention_mask, (b, s))
    vocab = model.config.vocab_size
    if isinstance(prompt, np.ndarray):
        real = prompt[mask == 1]
        if real.min() < 0 or real.max() >= vocab:
            raise InvalidArgumentError(
                f"{_OP}: prompt token ids must be in [0, {vocab}) (the vocabulary), got ids "
                f"from {real.min()} to {real.max()}"
            )
    sampling = _sampling(vocab, temperature, top_k, top_p, key, eos_token_id, pad_token_id)
    replicated = NamedSharding(model.mesh, P())
    sampling = dataclasses.replace(sampling, key=jax.device_put(sampling.key, replicated))
    windows = {w for w, _, _ in model.config.layer_attention}  # a ring when every layer has one
    window = None if None in windows else max(windows)
    slots = s + steps if window is None else min(window, s + steps)
    if depth:  # no ring buffer: rejected drafts leave empty slots behind
        slots = _speculative.slots(s, steps, depth)
    prompt, mask_dev = model.place_batch(np.asarray(prompt).astype(np.int32), mask)
    if model.zero == 3:  # the whole model gathered for generation
        params = model.gathered(params)
    layout = model.layout
    first = model.place_batch(mask.sum(1).astype(np.int32))
    trunk_steps = None
    if depth:
        cache, drafts, out, done = _speculative.prefill(
            params, prompt, mask_dev, sampling, layout=layout, slots=slots, steps=steps
        )
        if steps > 1:
            out, trunk_steps, _, _ = _speculative.decode(
                params, cache, drafts, out, done, first, sampling, layout=layout, start=s
            )
            trunk_steps = trunk_steps + 1  # the prefill's
    else:
        cache, out, done = _prefill(
            params, prompt, mask_dev, sampling, layout=layout, slots=slots, steps=steps
        )
        if steps > 1:
            out, _ = _decode(params, cache, out, done, first, sampling, layout=layout, start=s)
    tokens = jnp.concatenate([prompt, out], axis=1)
    if not return_stats:
        return tokens
    ended = jnp.isin(out, sampling.eos)
    made = jnp.where(jnp.any(ended, 1), jnp.argmax(ended, 1) + 1, steps).astype(jnp.int32)
    return tokens, {"new_tokens": made, "trunk_steps": made if trunk_steps is None else trunk_steps}
