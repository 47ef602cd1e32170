"""How the decoder's layers compute: :class:`Ops`, the projections and softmax attention.

The compute primitives both attentions build on: grouped-query attention
(:mod:`~jaxops.models._layers`) and multi-head latent attention (:mod:`~jaxops.models._mla`).
Pure functions of their arrays and an :class:`Ops`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import jaxops
from jaxops._sharding import place

from . import _blockwise
from ._config import DecoderConfig
from ._mask import Visible

__all__ = [
    "CAUSAL_BLOCKS",
    "CAUSAL_BLOCK_MIN",
    "DROPOUT_KEY",
    "PROJECTION",
    "Ops",
    "adapted",
    "adapter_down",
    "adapter_up",
    "attend",
    "attend_expanded",
    "causal_blocks",
    "projection",
]


#: Where a layer's parameters carry the LoRA dropout key of a training step (the objective
#: puts one per layer there; :func:`adapted` reads it).
DROPOUT_KEY = "lora_dropout_key"
#: The ``jax.ad_checkpoint.checkpoint_name`` of every projection's output (remat policies).
PROJECTION = "jaxops.models.projection"


@dataclasses.dataclass(frozen=True)
class Ops:
    """How the layers compute: the settings every layer function shares.

    Attributes:
      dtype: compute dtype (float32, bfloat16 or float16).
      impl: jaxops' implementation policy (:func:`jaxops.choose_impl`), passed unchanged to
        every jaxops op (the GEMMs and ``fp8.linear`` included), which resolves it per family.
      fp8: None, or the block :class:`jaxops.fp8.Recipe` for DeepSeek-V3 block-scaled FP8
        attention projections.
      mesh: the mesh batch-sharded tokens live on (each device quantizes its own rows), or None.
      attention: how :func:`attend` computes: "blockwise" (an online softmax over blocks of
        queries and keys, no ``[sq, sk]`` array), "xla" (the whole float32 scores and softmax
        in jnp) or "dot_product" (``jax.nn.dot_product_attention``: cuDNN's fused attention on
        a GPU where it supports the shapes, else XLA's; for keys and values of one head width
        and no sinks, else blockwise).
      attention_block: queries and keys per block of blockwise attention.
      context_axis: the mesh axis each sequence is split over (its keys and values pass around
        its ring: :func:`~jaxops.models._blockwise.ring_attention`), or None.
      context: the size of the context axis (1 without one).
      context_exchange: how the keys of a context axis reach every device's queries: "ring"
        (:func:`~jaxops.models._blockwise.ring_attention`: passed on device to device while
        each step is computed) or "gather" (:func:`~jaxops.models._blockwise.gathered_attention`:
        all-gathered once a layer; the exchange inside pipeline stages).
      lora_dropout: ``Lora.dropout``: the adapters' input dropout where a layer's parameters
        carry a key (:data:`DROPOUT_KEY`, training only).
      lora_scaling: the low-rank adapters' scale (``Lora.scaling``), or None without adapters:
        a projection whose layer holds ``<name>_lora_a`` / ``<name>_lora_b`` adds
        ``scaling * (x @ A) @ B`` (:func:`adapted`).
    """

    dtype: Any
    impl: Any = None
    fp8: Any = None
    mesh: jax.sharding.Mesh | None = None
    attention: str = "xla"
    lora_scaling: float | None = None
    lora_dropout: float = 0.0
    attention_block: int = 512
    context_axis: str | None = None
    context: int = 1
    context_exchange: str = "ring"


def adapted(ops: Ops, p: dict[str, jax.Array], name: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """``y`` (the projection `name` of ``x``) plus its adapter ``scaling * (x @ A) @ B``, if any.

    ``A = p[name + "_lora_a"] [K, r]``, ``B = p[name + "_lora_b"] [r, N]``, in the compute dtype
    (never FP8: the base projection may be), float32 accumulation, the sum in the compute dtype.
    With a dropout key in `p` (:data:`DROPOUT_KEY`) and ``ops.lora_dropout`` > 0, ``x`` is
    dropped out first (each element kept with ``1 - dropout``, scaled by its inverse; the mask
    drawn from the key folded with the adapter's name). The two halves:
    :func:`adapter_down` and :func:`adapter_up`.
    """
    return adapter_up(ops, p, name, y, adapter_down(ops, p, name, x))


def adapter_down(ops: Ops, p: dict[str, jax.Array], name: str, x: jax.Array) -> jax.Array | None:
    """``t = dropout(x) @ A [..., r]`` of the adapter `name` (see :func:`adapted`), or None."""
    a = p.get(f"{name}_lora_a")
    if a is None or ops.lora_scaling is None:
        return None
    key = p.get(DROPOUT_KEY)
    if key is not None and ops.lora_dropout > 0:  # training: PEFT's lora_dropout on x
        keep = 1.0 - ops.lora_dropout
        key = jax.random.fold_in(key, zlib.crc32(name.encode()))
        # drawn where x lives: each device makes the bits of its own rows only
        mask = jax.random.bernoulli(key, keep, x.shape, out_sharding=jax.typeof(x).sharding)
        x = jnp.where(mask, x / keep, jnp.zeros((), x.dtype)).astype(x.dtype)
    dt = ops.dtype
    return jnp.dot(x.astype(dt), a.astype(dt), preferred_element_type=jnp.float32).astype(dt)


def adapter_up(
    ops: Ops, p: dict[str, jax.Array], name: str, y: jax.Array, t: jax.Array | None
) -> jax.Array:
    """``y + scaling * t @ B`` (float32 accumulation, in y's dtype); `y` when `t` is None."""
    if t is None:
        return y
    d = jnp.dot(t, p[f"{name}_lora_b"].astype(ops.dtype), preferred_element_type=jnp.float32)
    return (y.astype(jnp.float32) + ops.lora_scaling * d).astype(y.dtype)


def projection(ops: Ops, x: jax.Array, w: jax.Array, bias: jax.Array | None) -> jax.Array:
    """``x @ w + bias``: ``jaxops.gemm`` (bias in the epilogue), or ``fp8.linear`` with FP8.

    Args:
      ops: the compute settings.
      x: ``[..., K]`` in the compute dtype.
      w: ``[K, N]`` (cast to the compute dtype).
      bias: ``[N]`` or None.

    Returns:
      ``[..., N]`` in the compute dtype.
    """
    w = w.astype(ops.dtype)
    if ops.fp8 != "block":
        return checkpoint_name(jaxops.gemm(x, w, bias, impl=ops.impl), PROJECTION)

    def linear(x, w, *bias):
        return jaxops.fp8.linear(x, w, *(bias or (None,)), impl=ops.impl)

    spec = getattr(jax.typeof(x).sharding, "spec", None)
    if ops.mesh is None or spec is None or all(s is None for s in spec):
        # local (a pipeline stage) or whole
        return checkpoint_name(linear(x, w, *([] if bias is None else [bias])), PROJECTION)
    # Batch-sharded tokens: each device quantizes its own (the recipe's 128-row blocks of the
    # weight gradient's transposed operand would otherwise gather every row of x), as inside a
    # pipeline stage and in the expert GEMMs; the weight gradient is summed.
    operands = (x, w) if bias is None else (x, w, bias)
    out = jax.shard_map(
        linear,
        mesh=ops.mesh,
        in_specs=(P(*spec),) + (P(),) * (len(operands) - 1),
        out_specs=P(*spec),
    )(*operands)
    return checkpoint_name(out, PROJECTION)


def attend(
    ops: Ops,
    c: DecoderConfig,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: Visible,
    scale: float | None = None,
    causal: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Softmax attention of ``q [b, sq, Hq, Dh]`` over ``k [b, sk, Hkv, Dh]``, ``v [.., Dv]``.

    Returns ``[b, sq, Hq Dv]``. `visible`: which keys each query sees (:class:`Visible`, the
    mask of :func:`~jaxops.models._mask.allowed`). Scores are ``q . k`` times `scale`
    (default ``Dh ** -0.5``), float32, as is the softmax; a query that sees no key at all
    (padding) gets zeros, never NaN. By ``ops.attention``:

    - "blockwise": in blocks of ``ops.attention_block`` queries and keys with an online
      softmax (:mod:`~jaxops.models._blockwise`: no ``[sq, sk]`` array in the forward or the
      backward, the block pairs the mask empties skipped) once the queries or the keys are
      more than one block; within one block, as "xla".
    - "xla": the whole float32 ``[b, H, sq, sk]`` scores and mask in jnp; with `causal` (the
      queries and keys are the same tokens in order, the mask causal) in
      :data:`CAUSAL_BLOCKS` query blocks, each against the keys up to its last query only.
    - "dot_product": ``jax.nn.dot_product_attention`` (cuDNN's fused attention on a GPU where
      it supports the shapes, skipping the masked blocks with `causal`), for keys and values
      of one width and no sinks; otherwise blockwise.

    `sinks` ``[Hq]`` (gpt-oss): one more logit per head in each query's softmax denominator,
    whose probability is dropped.
    """
    b, sq, hq, dh = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    if ops.attention == "dot_product" and dv == dh and sinks is None and ops.context == 1:
        mask = visible.dense()
        out = jax.nn.dot_product_attention(
            q, k, v, mask=mask[:, None], scale=scale, is_causal=causal
        )  # [b, sq, Hq, Dh]
        seen = jnp.any(mask, axis=-1)[:, :, None, None]  # a query that sees no key: zeros
        return jnp.where(seen, out, jnp.zeros((), out.dtype)).reshape(b, sq, hq * dv)
    q = _group_heads(q, hkv)
    scale = dh**-0.5 if scale is None else scale
    block = ops.attention_block
    if ops.context > 1 or (ops.attention != "xla" and max(sq, sk) > block):
        return _attend_blockwise(ops, c, q, (k, v), visible, scale, sinks).reshape(b, sq, hq * dv)
    mask = visible.dense()
    blocks = causal_blocks(sq) if causal and sk == sq else 1
    if blocks == 1:
        out = _softmax_attention(ops, q, k, v, mask, scale, sinks)
    else:  # query block i sees keys up to its last query only: the masked blocks are skipped
        bounds = [sq * i // blocks for i in range(blocks + 1)]
        out = jnp.concatenate(
            [
                _softmax_attention(
                    ops, q[:, lo:hi], k[:, :hi], v[:, :hi], mask[:, lo:hi, :hi], scale, sinks
                )
                for lo, hi in itertools.pairwise(bounds)
            ],
            axis=1,
        )
    return out.reshape(b, sq, hq * dv)


def attend_expanded(
    ops: Ops,
    c: DecoderConfig,
    q: jax.Array,
    kv: tuple[jax.Array, ...],
    params: dict[str, jax.Array],
    expand: Callable[[Any, Any], tuple[jax.Array, jax.Array]],
    visible: Visible,
    scale: float | None = None,
    causal: bool = False,
) -> jax.Array:
    """:func:`attend` over the keys and values ``expand(params, kv) = (k, v)``.

    `kv` is a compressed form of the keys and values, every leaf ``[b, sk, ...]`` (multi-head
    latent attention's latent and shared RoPE key), `params` what `expand` reads besides it.
    On a context axis the ring carries `kv` and each device expands the keys of each step
    (:func:`~jaxops.models._blockwise.ring_attention`: ``R + dr`` numbers a token travel
    instead of ``H (dn + dr + dv)``); otherwise the keys are expanded once, here.
    """
    if ops.context == 1:
        return attend(ops, c, q, *expand(params, kv), visible, scale, causal)
    b, sq, hq, dh = q.shape
    k, v = jax.eval_shape(expand, params, kv)
    hkv, dv = k.shape[2], v.shape[-1]
    q = _group_heads(q, hkv)
    scale = dh**-0.5 if scale is None else scale
    out = _attend_blockwise(ops, c, q, kv, visible, scale, None, expand, params)
    return out.reshape(b, sq, hq * dv)


def _group_heads(q: jax.Array, hkv: int) -> jax.Array:
    """``q [b, s, Hq, Dh]`` as ``[b, s, Hkv, Hq / Hkv, Dh]``: each KV head's query heads.

    With one query head per KV head (MLA's expanded keys, multi-head attention) the group axis
    is inserted, not reshaped in: jax's reshape drops the sharding of a batch axis of size 1
    when it also inserts an axis of size 1 (``[1@(data,expert), s, H, D] -> [1, s, H, 1, D]``),
    and the attention then ran on an unsharded batch (a one-sequence DeepSeek-V3 step failed to
    trace past one attention block).
    """
    b, s, hq, dh = q.shape
    if hq == hkv:
        return q[:, :, :, None]
    return q.reshape(b, s, hkv, hq // hkv, dh)


def _attend_blockwise(
    ops: Ops, c: DecoderConfig, q, kv, visible: Visible, scale: float, sinks, expand=None, params=()
) -> jax.Array:
    """:func:`~jaxops.models._blockwise.attention`, on each device's rows of a sharded batch.

    ``kv = (k, v)``, or on a context axis with `expand` what the ring carries (see
    :func:`attend_expanded`). (Each row attends within itself: with batch-sharded tokens every
    device runs its own rows in a ``shard_map``, as inside a pipeline stage, where the tokens
    are local already.)
    """
    extra = () if sinks is None else (sinks,)
    hops, near = _ring_reach(c, visible, q.shape[1])
    fixed = near(visible)  # a bool unless the window is traced (then read inside)

    def run(q, kv, params, visible, *sinks):
        kw = dict(sinks=sinks[0] if sinks else None, dtype=ops.dtype, block=ops.attention_block)
        if ops.context > 1 and ops.context_exchange == "gather":  # every device's keys at once
            return _blockwise.gathered_attention(
                q, kv, visible, axis=ops.context_axis, scale=scale, expand=expand,
                params=params, **kw,
            )  # fmt: skip
        if ops.context > 1:  # each device its chunks' queries, the keys around the ring
            return _blockwise.ring_attention(
                q, kv, visible, axis=ops.context_axis, size=ops.context, scale=scale,
                expand=expand, params=params, hops=hops,
                near=fixed if isinstance(fixed, bool) else near(visible), **kw,
            )  # fmt: skip
        return _blockwise.attention(q, *kv, visible, scale=scale, **kw)

    spec = getattr(jax.typeof(q).sharding, "spec", None)
    if ops.mesh is None or spec is None or spec[0] is None:  # local (a pipeline stage) or whole
        return run(q, kv, params, visible, *extra)
    rows = P(spec[0])
    visible = jax.tree.map(jnp.asarray, visible)  # a Python window or chunk as a scalar
    in_specs = (
        rows,
        jax.tree.map(lambda _: rows, kv),
        jax.tree.map(lambda _: P(), params),  # the compute layout: whole on every device
        jax.tree.map(lambda a: rows if a.ndim else P(), visible),
        *(P(),) * len(extra),
    )
    args = place((q, kv, params, visible, *extra), ops.mesh, in_specs)
    return jax.shard_map(run, mesh=ops.mesh, in_specs=in_specs, out_specs=rows, check_vma=False)(
        *args
    )


def _ring_reach(c: DecoderConfig, visible: Visible, rows: int) -> tuple[int | None, Callable]:
    """``(hops, near)`` of a context ring (:func:`~jaxops.models._blockwise.ring_attention`).

    A sliding window or an attention chunk bounds how far back a query looks: ``window - 1``
    time steps, ``chunk - 1`` within a document (whose tokens are consecutive). In the zigzag
    placement of :mod:`~jaxops.models._context` a row of `rows` tokens is two chunks of
    ``rows / 2`` (the c-th and the (2C-1-c)-th of the sequence), so the keys within that reach
    of a device's queries lie on the devices at most ``hops = ceil(reach / (rows / 2))``
    places away, either way. ``near(visible)``: whether this layer is so bounded (a bool, or
    a traced bool in a scan over windowed and full layers, whose bound is then the config's
    window or chunk, else :data:`~jaxops.models._layers.UNLIMITED`).
    """
    bounds = [
        b for b in (c.attention.sliding_window, c.attention.attention_chunk_size) if b is not None
    ]
    if not bounds or rows < 2:
        return None, lambda visible: False
    limit = max(bounds)
    hops = -(-(limit - 1) // (rows // 2))

    def near(visible: Visible) -> bool | jax.Array:
        given = [b for b in (visible.window, visible.chunk) if b is not None]
        if not given:
            return False
        if all(isinstance(b, int) for b in given):
            return True
        return functools.reduce(jnp.logical_or, [jnp.asarray(b) <= limit for b in given])

    return hops, near


#: Query blocks of causal self-attention in the jnp softmax (each block computes the scores of
#: the keys up to its last query only), for sequences of at least 2 * CAUSAL_BLOCK_MIN tokens.
CAUSAL_BLOCKS = 4
CAUSAL_BLOCK_MIN = 32


def causal_blocks(s: int) -> int:
    """How many query blocks causal self-attention over `s` tokens is computed in."""
    return max(1, min(CAUSAL_BLOCKS, s // CAUSAL_BLOCK_MIN))


def _softmax_attention(ops: Ops, q, k, v, mask, scale: float, sinks) -> jax.Array:
    """``q [b, sq, Hkv, G, Dh]`` over ``k [b, sk, Hkv, Dh]``: ``[b, sq, Hkv, G, Dv]``, ops.dtype.

    float32 scores and softmax; `mask` bool ``[b, sq, sk]``; a query that sees no key gets zeros.
    """
    hkv, g = q.shape[2], q.shape[3]
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
    scores = scores * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:  # [Hq] -> [1, Hkv, G, 1, 1]
        sink = sinks.astype(jnp.float32).reshape(1, hkv, g, 1, 1)
        top = jnp.maximum(top, sink)
    e = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sink - top)
    probs = (e / jnp.where(total > 0, total, 1.0)).astype(ops.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(ops.dtype)
