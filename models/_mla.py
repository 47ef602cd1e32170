"""Multi-head latent attention (DeepSeek-V2/V3) as pure functions.

The layer's parameters (kernels ``[in, out]``; ``H`` heads, ``dn`` / ``dr`` / ``dv`` the
widths of :class:`~jaxops.models.Mla`, ``R`` its ``kv_lora_rank``, ``Rq`` its ``q_lora_rank``):

- queries: ``w_q_a [D, Rq]``, ``q_a_norm [Rq]``, ``w_q_b [Rq, H (dn + dr)]``; or, without a q
  LoRA, ``w_q [D, H (dn + dr)]``;
- keys and values: ``w_kv_a [D, R + dr]``, ``kv_a_norm [R]``, ``w_kv_b [R, H (dn + dv)]``;
- output: ``w_o [H dv, D]``.

:func:`inputs` gives the queries and what a KV cache keeps per token: the normalized compressed
KV ``latent [b, s, R]`` and the RoPE key ``k_rope [b, s, 1, dr]`` that every head shares, so a
cached token costs ``R + dr`` numbers per layer (576 for DeepSeek-V3, against ``2 H dh`` =
32768 for a GQA cache of 128 heads of 128). :func:`output` expands the keys and values of every
key position through ``w_kv_b`` and attends. As in transformers: the two inner RMSNorms use
eps 1e-6, the rotary dims come last in each head (the interleaved pairs de-interleaved), and
the softmax scale is ``(dn + dr) ** -0.5`` times YaRN's ``mscale_all_dim`` correction.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxops.models import AttentionSpec, DecoderConfig, Mla, MoEDecoder, MoESpec
  >>> mla = Mla(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
  ...           q_lora_rank=24)
  >>> cfg = DecoderConfig("deepseek_v3", 64, 32, 2, AttentionSpec(4, 4, 8, mla=mla),
  ...                     MoESpec(4, 2, 16, router="sigmoid"))
  >>> model = MoEDecoder(cfg, jax.make_mesh((1,), ("expert",)))
  >>> params = model.init(jax.random.key(0))
  >>> params["layers"]["w_kv_a"].shape, params["layers"]["w_kv_b"].shape
  ((2, 32, 24), (2, 16, 64))
  >>> jax.jit(model.logits)(params, jnp.zeros((1, 5), jnp.int32)).shape
  (1, 5, 64)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxops

from ._config import DecoderConfig
from ._mask import Visible
from ._ops import Ops, adapted, adapter_down, adapter_up, attend_expanded, projection
from ._rope import apply_rotary, softmax_scale_factor

__all__ = ["NORM_EPS", "cache_bytes_per_token", "inputs", "output", "param_shapes"]

#: The epsilon of the two inner RMSNorms (transformers' DeepseekV3RMSNorm default; the
#: config's rms_norm_eps is not passed to them).
NORM_EPS = 1e-6


def param_shapes(c: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """One layer's attention parameter shapes (see the module docstring)."""
    m, h, d = c.attention.mla, c.attention.num_heads, c.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    if m.q_lora_rank is None:
        out["w_q"] = (d, c.attention.q_size)
    else:
        out.update(w_q_a=(d, m.q_lora_rank), q_a_norm=(m.q_lora_rank,))
        out["w_q_b"] = (m.q_lora_rank, c.attention.q_size)
    out.update(
        w_kv_a=(d, m.kv_lora_rank + m.qk_rope_head_dim),
        kv_a_norm=(m.kv_lora_rank,),
        w_kv_b=(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim)),
        w_o=(h * m.v_head_dim, d),
    )
    return out


def inputs(
    ops: Ops, c: DecoderConfig, p: dict[str, jax.Array], x: jax.Array, positions: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """``(q [b, s, H, dn + dr], (latent [b, s, R], k_rope [b, s, 1, dr]))`` of ``x [b, s, D]``.

    The rotary embedding (at int `positions` ``[b, s]``) is applied to the queries' last `dr`
    dims and to `k_rope`.
    """
    m = c.attention.mla
    b, s, _ = x.shape
    dn = m.qk_nope_head_dim
    if m.q_lora_rank is None:
        q = adapted(ops, p, "q_proj", x, projection(ops, x, p["w_q"], None))
    else:
        q = adapted(ops, p, "q_a_proj", x, projection(ops, x, p["w_q_a"], None))
        q = jaxops.rms_norm(q, p["q_a_norm"], eps=NORM_EPS, impl=ops.impl)
        q = adapted(ops, p, "q_b_proj", q, projection(ops, q, p["w_q_b"], None))
    q = q.reshape(b, s, c.attention.num_heads, c.attention.qk_head_dim)
    q = jnp.concatenate([q[..., :dn], apply_rotary(q[..., dn:], c.rope, positions)], axis=-1)
    kv = adapted(ops, p, "kv_a_proj_with_mqa", x, projection(ops, x, p["w_kv_a"], None))
    latent = jaxops.rms_norm(kv[..., : m.kv_lora_rank], p["kv_a_norm"], eps=NORM_EPS, impl=ops.impl)
    k_rope = apply_rotary(kv[..., None, m.kv_lora_rank :], c.rope, positions)
    return q, (latent, k_rope)


def output(
    ops: Ops,
    c: DecoderConfig,
    p: dict[str, jax.Array],
    q: jax.Array,
    kv: tuple[jax.Array, jax.Array],
    visible: Visible,
    *,
    causal: bool = False,
) -> jax.Array:
    """Attention of `q` over the keys of ``kv = (latent [b, sk, R], k_rope [b, sk, 1, dr])``.

    Each key position's latent expands through ``w_kv_b`` into every head's key part without
    RoPE and its value; on a context axis the ring carries the latent and the RoPE key, not the
    expanded keys and values (``_ops.attend_expanded``). `visible`: which keys each query
    sees; `causal` as in ``_ops.attend``.
    Returns ``[b, sq, D]``.
    """
    m = c.attention.mla
    h, dn, dr = c.attention.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim
    latent, k_rope = kv
    # The kv_b_proj adapter's down projection (and dropout) where the latent is; a context
    # ring carries its rank-wide result with the latent, each device expanding on arrival.
    t = adapter_down(ops, p, "kv_b_proj", latent)
    carried = (latent, k_rope) if t is None else (latent, k_rope, t)
    params = {k: p[k] for k in ("w_kv_b", "kv_b_proj_lora_b") if t is not None or k == "w_kv_b"}

    def expand(params, carried):  # every head's keys and values of these tokens
        latent, k_rope, *t = carried
        b, sk, _ = latent.shape
        expanded = projection(ops, latent, params["w_kv_b"], None)
        expanded = adapter_up(ops, params, "kv_b_proj", expanded, t[0] if t else None)
        expanded = expanded.reshape(b, sk, h, dn + m.v_head_dim)
        k_nope, v = expanded[..., :dn], expanded[..., dn:]
        rope = jnp.broadcast_to(k_rope.astype(k_nope.dtype), (b, sk, h, dr))
        return jnp.concatenate([k_nope, rope], axis=-1), v

    scale = c.attention.qk_head_dim**-0.5 * softmax_scale_factor(c.rope)
    # dn + dr != dv: never cuDNN's
    out = attend_expanded(ops, c, q, carried, params, expand, visible, scale, causal)
    return adapted(ops, p, "o_proj", out, projection(ops, out, p["w_o"], None))


def cache_bytes_per_token(c: DecoderConfig, itemsize: int) -> int:
    """Bytes a KV cache holds per token and layer.

    ``(R + dr) * itemsize`` with MLA, else ``2 Hkv Dh * itemsize`` (keys and values).
    """
    if c.attention.mla is None:
        return 2 * c.attention.kv_size * itemsize
    return (c.attention.mla.kv_lora_rank + c.attention.mla.qk_rope_head_dim) * itemsize
