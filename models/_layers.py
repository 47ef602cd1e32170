"""The decoder's layers as pure functions.

Projections, rotary embedding, attention, the decoder layer, embedding, output head and
cross-entropy.

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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxops.models._config import DecoderConfig

import jaxops

__all__ = [
    "Ops",
    "attention",
    "cross_entropy",
    "decoder_layer",
    "embed",
    "head",
    "projection",
    "rotary",
    "rotate_half",
]


@dataclasses.dataclass(frozen=True)
class Ops:
    """How the layers compute: the settings every layer function shares.

    Attributes:
      dtype: compute dtype (float32, bfloat16 or float16).
      impl: None, "ffi" or "xla", passed to every jaxops op.
      fp8: None, or "block" for DeepSeek-V3 block-scaled FP8 attention projections.
      mesh: the mesh batch-sharded tokens live on (each device quantizes its own rows), or None.
      gemm_impl: the `impl` of the GEMMs (``jaxops.gemm``, and ``fp8.linear`` whose impl covers
        its GEMMs and quantization): `impl`, except "xla" where ``impl="ffi"`` asks for kernels
        and jaxops has no GEMM kernel for the platform (CPU: XLA's dot is the GEMM there).
    """

    dtype: Any
    impl: str | None = None
    fp8: str | None = None
    mesh: jax.sharding.Mesh | None = None
    gemm_impl: str | None = None


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
        return jaxops.gemm(x, w, bias, impl=ops.gemm_impl)

    def linear(x, w, *bias):
        return jaxops.fp8.linear(x, w, *(bias or (None,)), impl=ops.gemm_impl)

    spec = getattr(jax.typeof(x).sharding, "spec", None)
    if ops.mesh is None or spec is None or all(s is None for s in spec):
        return linear(x, w, *([] if bias is None else [bias]))  # local (a pipeline stage) or whole
    # Batch-sharded tokens: each device quantizes its own (the recipe's 128-row blocks of the
    # weight gradient's transposed operand would otherwise gather every row of x), as inside a
    # pipeline stage and in the expert GEMMs; the weight gradient is summed.
    operands = (x, w) if bias is None else (x, w, bias)
    return jax.shard_map(
        linear,
        mesh=ops.mesh,
        in_specs=(P(*spec),) + (P(),) * (len(operands) - 1),
        out_specs=P(*spec),
    )(*operands)


def rotate_half(x: jax.Array) -> jax.Array:
    """``[-x2, x1]`` of the two halves of the last axis (transformers' rotate_half)."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rotary(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding of ``x [b, s, heads, Dh]`` at positions ``0 .. s-1``.

    Rotate-half layout; float32 angles cast to x's dtype, as transformers computes them.
    """
    s, dh = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    return x * cos + rotate_half(x) * sin


def attention(ops: Ops, c: DecoderConfig, p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """Causal grouped-query self-attention of ``x [b, s, D]`` (compute dtype).

    ``p``: ``w_qkv [D, (Hq + 2 Hkv) Dh]``, optional ``b_qkv``, ``q_norm`` / ``k_norm [Dh]``
    (Qwen3), ``w_o [Hq Dh, D]``, optional ``b_o``. float32 scores and softmax; an optional
    sliding window (`c.sliding_window`). Returns ``[b, s, D]``.
    """
    dt = ops.dtype
    b, s, _ = x.shape
    hq, hkv, dh = c.num_heads, c.num_kv_heads, c.head_dim
    qkv = projection(ops, x, p["w_qkv"], p["b_qkv"].astype(dt) if c.qkv_bias else None)
    q, k, v = jnp.split(qkv, [c.q_size, c.q_size + c.kv_size], axis=-1)
    q = q.reshape(b, s, hq, dh)
    k = k.reshape(b, s, hkv, dh)
    v = v.reshape(b, s, hkv, dh)
    if c.qk_norm:
        q = jaxops.rms_norm(q, p["q_norm"], eps=c.rms_norm_eps, impl=ops.impl)
        k = jaxops.rms_norm(k, p["k_norm"], eps=c.rms_norm_eps, impl=ops.impl)
    q = rotary(q, c.rope_theta).reshape(b, s, hkv, hq // hkv, dh)
    k = rotary(k, c.rope_theta)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
    scores = scores * (dh**-0.5)
    i = jnp.arange(s)[:, None]
    j = jnp.arange(s)[None, :]
    allowed = j <= i
    if c.sliding_window is not None:
        allowed &= i - j < c.sliding_window
    scores = jnp.where(allowed, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    out = out.astype(dt).reshape(b, s, c.q_size)
    return projection(ops, out, p["w_o"], p["b_o"].astype(dt) if c.o_bias else None)


def decoder_layer(
    ops: Ops,
    c: DecoderConfig,
    moe: Callable[[Any, jax.Array], tuple[jax.Array, Any]],
    h: jax.Array,
    p: dict[str, Any],
) -> tuple[jax.Array, Any]:
    """One decoder layer: ``h + attention(rms_norm(h))``, then ``+ moe(rms_norm(...))``.

    The argument order is that of a ``lax.scan`` body over stacked layers.

    Args:
      ops: the compute settings.
      c: the architecture.
      moe: ``(moe params, y [b, s, D]) -> (out [b, s, D], MoEAux)``.
      h: the residual stream ``[b, s, D]`` (compute dtype).
      p: one layer's parameters (``attn_norm``, the attention's, ``mlp_norm``, ``moe``).

    Returns:
      ``(h', aux)``: the layer's output and its MoE statistics.
    """
    a = jaxops.rms_norm(h, p["attn_norm"], eps=c.rms_norm_eps, impl=ops.impl)
    a = attention(ops, c, p, a)
    y, h = jaxops.add_rms_norm(a, h, p["mlp_norm"], eps=c.rms_norm_eps, impl=ops.impl)
    m, aux = moe(p["moe"], y)
    return h + m, aux


def embed(ops: Ops, table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Rows of ``table [V, D]`` for int ``tokens [b, s]``, in the compute dtype.

    Batch-sharded tokens gather their rows where they live (no gather of the tokens).
    """
    sharding = jax.typeof(tokens).sharding
    spec = getattr(sharding, "spec", None)
    if spec is not None and any(s is not None for s in spec):
        rows = table.at[tokens].get(out_sharding=NamedSharding(sharding.mesh, P(*spec, None)))
    else:
        rows = jnp.take(table, tokens, axis=0)
    return rows.astype(ops.dtype)


def head(ops: Ops, c: DecoderConfig, params: dict[str, Any], h: jax.Array) -> jax.Array:
    """Final norm and output projection: float32 logits ``[..., V]``.

    ``params``: ``final_norm [D]`` and ``lm_head [D, V]``, or ``embed [V, D]`` (tied).
    """
    h = jaxops.rms_norm(h, params["final_norm"], eps=c.rms_norm_eps, impl=ops.impl)
    if "lm_head" in params:
        logits = jaxops.gemm(h, params["lm_head"].astype(ops.dtype), impl=ops.gemm_impl)
    else:  # tied: the embedding table [V, D] is the [N, K] weight
        logits = jaxops.gemm(
            h, params["embed"].astype(ops.dtype), transpose_w=True, impl=ops.gemm_impl
        )
    return logits.astype(jnp.float32)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of float ``logits [..., V]`` against int ``targets [...]`` (float32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
