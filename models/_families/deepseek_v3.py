"""DeepSeek-V3 / R1, Kimi K2, Moonlight (``deepseek_v3``, ``DeepseekV3ForCausalLM``).

Multi-head latent attention (:class:`~jaxops.models.Mla`, interleaved RoPE pairs by default), the
grouped sigmoid router of GLM-4.5 with its correction bias, shared experts, dense first layers.
"""

from __future__ import annotations

from typing import Any

from jaxops._errors import ConfigError

from .._spec import Mla
from ._family import TINY, Family, Shape
from ._keys import get, positive
from .glm4_moe import read_grouped_sigmoid, write_grouped_sigmoid


def _read_mla(hf: dict[str, Any]) -> Mla:
    # An explicit null q_lora_rank: the queries are projected directly (DeepSeek-V2-Lite).
    q_lora = None if "q_lora_rank" in hf and hf["q_lora_rank"] is None else 1536
    return Mla(
        q_lora_rank=q_lora and positive(hf, "q_lora_rank", q_lora),
        kv_lora_rank=positive(hf, "kv_lora_rank", 512),
        qk_nope_head_dim=positive(hf, "qk_nope_head_dim", 128),
        qk_rope_head_dim=positive(hf, "qk_rope_head_dim", 64),
        v_head_dim=positive(hf, "v_head_dim", 128),
    )


def _read(hf: dict[str, Any], shape: Shape) -> dict[str, Any]:
    kw = read_grouped_sigmoid(
        hf, shape, experts=256, ffn=2048, first_k_dense=3, n_group=8, topk_group=4, scaling=2.5
    )
    kw["mla"] = mla = _read_mla(hf)
    kw["head_dim"] = mla.qk_rope_head_dim  # transformers' head_dim: the RoPE width
    if get(hf, "attention_bias", bool, False):
        raise ConfigError(
            "config.json: attention_bias = true is not supported for deepseek_v3 (no "
            "published DeepSeek-V3 has it); only false"
        )
    return kw


def _write(c: Any, out: dict[str, Any]) -> None:
    write_grouped_sigmoid(c, out)
    m = c.attention.mla
    out.update(
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_interleave=c.rope.interleave,
        attention_bias=False,
    )


FAMILY = Family(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    transformers_config="DeepseekV3Config",
    read=_read,
    write=_write,
    description="deepseek_v3 has multi-head latent attention, a sigmoid router and its dense "
    "layers first",
    tiny=dict(
        TINY,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        num_nextn_predict_layers=0,
        norm_topk_prob=True,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
    ),
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_positions=4096,
    aux_loss_coef=0.0,
    mtp_key="num_nextn_predict_layers",
    mtp_default=1,
    dense_ffn=18432,
    interleave="key",
    mla=True,
)
