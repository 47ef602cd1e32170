"""The decoder's layers as pure functions.

Rotary embedding, the attention mask (:class:`Tokens`, :func:`allowed`: causal, sliding
window, packed documents, padding, KV-cache slots), attention (grouped-query here, multi-head
latent in :mod:`~jaxops.models._mla`), the decoder layer, embedding, output head and
cross-entropy with ignored targets. :class:`Ops`, the projections and the softmax attention
both attentions share come from :mod:`~jaxops.models._ops` (re-exported here).

Each function takes the arrays it computes on and an :class:`Ops` (compute dtype, FP8 recipe,
jaxops implementation, mesh) and holds no state; :class:`~jaxops.models.MoEDecoder` lays them
out on a mesh. `ops.impl` reaches every jaxops op they call (``rms_norm``, ``add_rms_norm``,
``gemm``, ``fp8.linear``), so ``impl="xla"`` runs no jaxops custom call.

Shapes: ``b`` batch, ``s`` sequence, ``D`` model width, ``Hq`` / ``Hkv`` query / key-value heads
of width ``Dh``, ``V`` vocabulary. Kernels are ``[in, out]``.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxops.models._layers import cross_entropy
  >>> float(cross_entropy(jnp.zeros((1, 2, 4)), jnp.array([[0, 3]])))  # log 4
  1.3862943649291992
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxops
from jaxops._errors import InvalidArgumentError

from . import _mla
from ._config import DecoderConfig
from ._mask import Tokens, Visible, allowed
from ._ops import (
    CAUSAL_BLOCK_MIN,
    CAUSAL_BLOCKS,
    DROPOUT_KEY,
    PROJECTION,
    Ops,
    adapted,
    attend,
    causal_blocks,
    projection,
)
from ._packing import IGNORE_INDEX
from ._rope import Rope, apply_rotary

__all__ = [
    "DROPOUT_KEY",
    "CAUSAL_BLOCKS",
    "CAUSAL_BLOCK_MIN",
    "IGNORE_INDEX",
    "PROJECTION",
    "QKV",
    "UNLIMITED",
    "LayerKind",
    "Ops",
    "Tokens",
    "Visible",
    "allowed",
    "attend",
    "attention",
    "attention_inputs",
    "attention_output",
    "causal_blocks",
    "cross_entropy",
    "decoder_layer",
    "embed",
    "head",
    "layer_kinds",
    "mlp",
    "output",
    "projection",
    "qkv",
    "rotary",
    "rotate_half",
    "token_losses",
    "token_nll",
]


#: The fused ``w_qkv``'s parts by the names transformers gives their projections (LoRA targets).
QKV = ("q_proj", "k_proj", "v_proj")


def rotate_half(x: jax.Array) -> jax.Array:
    """``[-x2, x1]`` of the two halves of the last axis (transformers' rotate_half)."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rotary(x: jax.Array, rope: Rope | float, positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding of ``x [b, s, heads, Dh]`` at int ``positions [b, s]``.

    ``jaxops.models._rope.apply_rotary`` with `rope` (a number: the default RoPE with that
    base). Positions default to ``0 .. s-1``; float32 angles, cos and sin (times the rope's
    attention scaling) cast to x's dtype, as transformers computes them.
    """
    if not isinstance(rope, Rope):
        rope = Rope(theta=rope)
    return apply_rotary(x, rope, positions)


#: "No window / no chunk" in a traced per-layer value (more time steps than any sequence).
UNLIMITED = 2**30


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """One layer's attention pattern: its sliding window, attention chunk and RoPE.

    Python values when every layer of the model has the same pattern; int32 / bool scalars
    (from per-layer arrays scanned with the stacked layers, :func:`layer_kinds`) when they
    differ (gpt-oss's sliding and full layers, Llama 4's chunked RoPE and full NoPE layers), a
    window or chunk of :data:`UNLIMITED` then meaning none.

    Attributes:
      window: the sliding window in time steps, or None.
      chunk: the attention chunk in rotary positions, or None.
      rope: whether the layer applies rotary embeddings (Llama 4's NoPE layers do not).
    """

    window: Any = None
    chunk: Any = None
    rope: Any = True


jax.tree_util.register_dataclass(LayerKind, data_fields=["window", "chunk", "rope"], meta_fields=[])


def layer_kinds(c: DecoderConfig, layers: Any) -> tuple[LayerKind, LayerKind | None]:
    """``(static, scanned)``: the attention patterns of the model layers `layers`, for a scan.

    When every layer of the model has one pattern, `static` is it (Python values) and `scanned`
    None; otherwise `static` is None-free filler and `scanned` holds per-layer arrays
    ``[len(layers)]`` to scan with the layers' parameters.
    """
    every = c.layer_attention
    if len(set(every)) == 1:
        window, chunk, rope = every[0]
        return LayerKind(window, chunk, rope), None
    rows = [every[i] for i in layers]
    return LayerKind(), LayerKind(
        window=jnp.asarray([UNLIMITED if w is None else w for w, _, _ in rows], jnp.int32),
        chunk=jnp.asarray([UNLIMITED if ch is None else ch for _, ch, _ in rows], jnp.int32),
        rope=jnp.asarray([r for _, _, r in rows], jnp.bool_),
    )


def _l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis in float32, no weight (Llama 4's L2Norm).

    Plain jnp, not ``jaxops.rms_norm`` with a weight of ones: that weight would be a constant
    inside a pipeline stage's shard_map, and the kernel's weight gradient a per-device value.
    """
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _maybe(flag: Any, f: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """``f(x)`` where `flag` (a bool, or a traced bool scalar: both computed), else ``x``."""
    if flag is True:
        return f(x)
    if flag is False:
        return x
    return jnp.where(flag, f(x), x)


def qkv(
    ops: Ops,
    c: DecoderConfig,
    p: dict[str, jax.Array],
    x: jax.Array,
    where: Tokens,
    kind: LayerKind | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries ``[b, s, Hq, Dh]``, keys and values ``[b, s, Hkv, Dh]`` of ``x [b, s, D]``.

    The fused projection (``w_qkv``, optional ``b_qkv``), the q/k RMSNorm (``attention.qk_norm``: of
    each head, Qwen3, or of the whole q and k projections before the split into heads, OLMoE),
    then the rotary embedding of q and k at the rotary positions of `where` (not in the NoPE
    layers of `kind`), Llama 4's L2 norm after it (``qk_l2_norm``, RoPE layers) and its
    temperature of the NoPE layers' queries (``attn_temperature_tuning``, by time step).
    """
    dt = ops.dtype
    b, s, _ = x.shape
    hq, hkv, dh = c.attention.num_heads, c.attention.num_kv_heads, c.attention.head_dim
    rope = True if kind is None else kind.rope
    out = projection(ops, x, p["w_qkv"], p["b_qkv"].astype(dt) if c.attention.qkv_bias else None)
    q, k, v = jnp.split(
        out, [c.attention.q_size, c.attention.q_size + c.attention.kv_size], axis=-1
    )
    q, k, v = (adapted(ops, p, n, x, y) for n, y in zip(QKV, (q, k, v), strict=True))
    whole = c.attention.qk_norm and c.attention.qk_norm_width == "projection"
    if whole:  # q_norm [Hq Dh], k_norm [Hkv Dh]
        q = jaxops.rms_norm(q, p["q_norm"], eps=c.rms_norm_eps, impl=ops.impl)
        k = jaxops.rms_norm(k, p["k_norm"], eps=c.rms_norm_eps, impl=ops.impl)
    q = q.reshape(b, s, hq, dh)
    k = k.reshape(b, s, hkv, dh)
    v = v.reshape(b, s, hkv, dh)
    if c.attention.qk_norm and not whole:  # q_norm, k_norm [Dh]
        q = jaxops.rms_norm(q, p["q_norm"], eps=c.rms_norm_eps, impl=ops.impl)
        k = jaxops.rms_norm(k, p["k_norm"], eps=c.rms_norm_eps, impl=ops.impl)
    q = _maybe(rope, lambda a: rotary(a, c.rope, where.positions), q)
    k = _maybe(rope, lambda a: rotary(a, c.rope, where.positions), k)
    if c.attention.qk_l2_norm:
        l2 = functools.partial(_l2_norm, eps=c.rms_norm_eps)
        q, k = _maybe(rope, l2, q), _maybe(rope, l2, k)
    if c.attention.attn_temperature_tuning and rope is not True:  # the NoPE layers' queries
        t = where.index.astype(jnp.float32)
        scale = (
            jnp.log1p(jnp.floor((t + 1.0) / c.attention.floor_scale)) * c.attention.attn_scale + 1.0
        )
        warm = (q.astype(jnp.float32) * scale[:, :, None, None]).astype(dt)
        q = warm if rope is False else jnp.where(rope, q, warm)
    return q, k, v


def output(ops: Ops, c: DecoderConfig, p: dict[str, jax.Array], out: jax.Array) -> jax.Array:
    """The attention's output projection of ``out [b, s, Hq Dh]`` (``w_o``, optional ``b_o``)."""
    y = projection(ops, out, p["w_o"], p["b_o"].astype(ops.dtype) if c.attention.o_bias else None)
    return adapted(ops, p, "o_proj", out, y)


def attention_inputs(
    ops: Ops,
    c: DecoderConfig,
    p: dict[str, jax.Array],
    x: jax.Array,
    where: Tokens,
    kind: LayerKind | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """``(q, kv)`` of ``x [b, s, D]``: the queries and what a KV cache keeps of each token.

    GQA: ``q [b, s, Hq, Dh]`` and ``kv = (k, v)``, each ``[b, s, Hkv, Dh]`` (:func:`qkv`; `kind`
    says whether the layer applies RoPE). MLA (``mla``): ``q [b, s, H, dn + dr]`` and ``kv =
    (latent [b, s, kv_lora_rank], k_rope [b, s, 1, dr])``, the normalized compressed KV and the
    shared RoPE key (``jaxops.models._mla``). Either way the arrays of `kv` have time on axis 1.
    """
    if c.attention.mla is not None:
        return _mla.inputs(ops, c, p, x, where.positions)
    q, k, v = qkv(ops, c, p, x, where, kind)
    return q, (k, v)


def attention_output(
    ops: Ops,
    c: DecoderConfig,
    p: dict[str, jax.Array],
    q: jax.Array,
    kv: tuple[jax.Array, ...],
    visible: Visible,
    *,
    causal: bool = False,
) -> jax.Array:
    """The attention of queries `q` over the keys of `kv` (:func:`attention_inputs`), projected.

    `visible`: which keys each query sees (:class:`Visible`); `causal` as in :func:`attend`;
    the layer's ``sinks`` (``c.attention.attention_sinks``) join the softmax. Returns
    ``[b, sq, D]``.
    """
    if c.attention.mla is not None:
        return _mla.output(ops, c, p, q, kv, visible, causal=causal)
    sinks = p["sinks"] if c.attention.attention_sinks else None
    return output(ops, c, p, attend(ops, c, q, *kv, visible, causal=causal, sinks=sinks))


def attention(
    ops: Ops,
    c: DecoderConfig,
    p: dict[str, jax.Array],
    x: jax.Array,
    where: Tokens,
    kind: LayerKind | None = None,
) -> jax.Array:
    """Self-attention of ``x [b, s, D]`` (compute dtype) over its own tokens.

    ``p`` (GQA): ``w_qkv [D, (Hq + 2 Hkv) Dh]``, optional ``b_qkv``, ``q_norm`` / ``k_norm
    [Dh]`` (Qwen3, GLM; ``[Hq Dh]`` / ``[Hkv Dh]`` for OLMoE and MiniMax-M2), ``w_o [Hq Dh,
    D]``, optional ``b_o``, ``sinks [Hq]`` (gpt-oss); with MLA those of
    ``jaxops.models._mla``. `where` places every token (causal, document and padding mask,
    rotary positions); `kind` is the layer's pattern (:class:`LayerKind`: sliding window,
    chunk, RoPE; None: the config's one pattern, a ValueError when its layers differ).
    Returns ``[b, s, D]``.
    """
    if kind is None:
        kind, scanned = layer_kinds(c, ())
        if scanned is not None:
            raise InvalidArgumentError(
                "jaxops.models._layers.attention: the config's layers have different attention "
                "patterns (layer_types / nope_layers); pass the layer's kind"
            )
    q, kv = attention_inputs(ops, c, p, x, where, kind)
    visible = Visible(where, where, kind.window, kind.chunk)
    return attention_output(ops, c, p, q, kv, visible, causal=True)


def mlp(ops: Ops, p: dict[str, jax.Array], y: jax.Array) -> jax.Array:
    """The dense SwiGLU MLP of ``y [b, s, D]``: ``(silu(y W_gate) * (y W_up)) W_down``.

    ``p``: ``w_in [D, 2F]`` (gate, up side by side), ``w_out [F, D]``, and the LoRA adapters
    of ``gate_proj``, ``up_proj`` and ``down_proj`` it holds. Returns ``[b, s, D]``.
    """
    gate, up = jnp.split(projection(ops, y, p["w_in"], None), 2, axis=-1)
    gate, up = adapted(ops, p, "gate_proj", y, gate), adapted(ops, p, "up_proj", y, up)
    act = jax.nn.silu(gate) * up
    return adapted(ops, p, "down_proj", act, projection(ops, act, p["w_out"], None))


def decoder_layer(
    ops: Ops,
    c: DecoderConfig,
    ffn: Callable[[dict[str, Any], jax.Array, jax.Array | None], tuple[jax.Array, Any]],
    where: Tokens,
    kind: LayerKind,
    h: jax.Array,
    xs: Any,
) -> tuple[jax.Array, Any]:
    """One decoder layer: ``h + attention(rms_norm(h))``, then ``+ ffn(rms_norm(...))``.

    The argument order is that of a ``lax.scan`` body over stacked layers (after `kind`).

    Args:
      ops: the compute settings.
      c: the architecture.
      ffn: ``(layer params, y [b, s, D], token_mask [b, s] or None) -> (out [b, s, D], aux)``:
        the MoE layer on ``p["moe"]`` (aux: its MoEAux) or the dense :func:`mlp` on
        ``p["mlp"]`` (aux None).
      where: the tokens' time steps, positions and documents (:class:`Tokens`); padding
        (segment 0) is masked out of the attention and of the MoE router.
      kind: the layer's attention pattern (:class:`LayerKind`), when all layers share it.
      h: the residual stream ``[b, s, D]`` (compute dtype).
      xs: one layer's parameters (``attn_norm``, the attention's, ``mlp_norm``, ``moe`` or
        ``mlp``), or ``(parameters, kind)`` when the layers' patterns differ (:func:`layer_kinds`).

    Returns:
      ``(h', aux)``: the layer's output and its ffn's statistics.
    """
    p, kind = xs if isinstance(xs, tuple) else (xs, kind)
    a = jaxops.rms_norm(h, p["attn_norm"], eps=c.rms_norm_eps, impl=ops.impl)
    a = attention(ops, c, p, a, where, kind)
    y, h = jaxops.add_rms_norm(a, h, p["mlp_norm"], eps=c.rms_norm_eps, impl=ops.impl)
    m, aux = ffn(p, y, where.valid)
    return h + m, aux


def embed(ops: Ops, table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Rows of ``table [V, D]`` for int ``tokens [b, s]``, in the compute dtype.

    Batch-sharded tokens gather their rows where they live (no gather of the tokens). An id
    outside ``[0, V)`` gets a row of NaN (so its logits and the loss are NaN), never another
    token's row.
    """
    sharding = jax.typeof(tokens).sharding
    spec = getattr(sharding, "spec", None)
    nan = jnp.nan
    if spec is not None and any(s is not None for s in spec):
        out = NamedSharding(sharding.mesh, P(*spec, None))
        rows = table.at[tokens].get(mode="fill", fill_value=nan, out_sharding=out)
    else:
        rows = table.at[tokens].get(mode="fill", fill_value=nan)
    return rows.astype(ops.dtype)


def head(ops: Ops, c: DecoderConfig, params: dict[str, Any], h: jax.Array) -> jax.Array:
    """Final norm and output projection: float32 logits ``[..., V]``.

    ``params``: ``final_norm [D]`` and ``lm_head [D, V]``, or ``embed [V, D]`` (tied).
    """
    h = jaxops.rms_norm(h, params["final_norm"], eps=c.rms_norm_eps, impl=ops.impl)
    if "lm_head" in params:
        logits = jaxops.gemm(h, params["lm_head"].astype(ops.dtype), impl=ops.impl)
    else:  # tied: the embedding table [V, D] is the [N, K] weight
        logits = jaxops.gemm(h, params["embed"].astype(ops.dtype), transpose_w=True, impl=ops.impl)
    return logits.astype(jnp.float32)


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """The cross-entropy of each target: float32 ``[...]``, 0 where it is :data:`IGNORE_INDEX`.

    float ``logits [..., V]``, int ``targets [...]``; another id outside ``[0, V)`` gives NaN.
    ``-token_nll`` is each target's log-probability.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    keep = targets != IGNORE_INDEX
    safe = jnp.where(keep, targets, 0)
    picked = jnp.take_along_axis(logp, safe[..., None], axis=-1, mode="fill", fill_value=jnp.nan)
    picked = jnp.where(safe[..., None] < 0, jnp.nan, picked)  # not wrapped to the last ids
    return jnp.where(keep, -picked[..., 0], 0.0)


def token_losses(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sum, count)``: the summed cross-entropy of the counted targets and their number.

    float ``logits [..., V]``, int ``targets [...]``; a target equal to :data:`IGNORE_INDEX`
    counts for nothing. Both float32 scalars. Another id outside ``[0, V)`` gives NaN.
    """
    total = jnp.sum(token_nll(logits, targets))
    return total, jnp.sum(targets != IGNORE_INDEX, dtype=jnp.float32)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of float ``logits [..., V]`` against int ``targets [...]`` (float32).

    Targets equal to :data:`IGNORE_INDEX` (-100) are left out of the mean; with none left the
    loss is 0 (and so is its gradient), never NaN.
    """
    total, count = token_losses(logits, targets)
    return total / jnp.maximum(count, 1.0)
