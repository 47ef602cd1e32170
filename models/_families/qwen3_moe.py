"""Qwen3-MoE (``qwen3_moe``, ``Qwen3MoeForCausalLM``).

Softmax top-k, per-head q/k RMSNorm, dense layers by ``mlp_only_layers`` / ``decoder_sparse_step``.
"""

from __future__ import annotations

from typing import Any

from jaxops._errors import ConfigError

from ._family import TINY, Family, Shape
from ._keys import experts_key, get, positive, sparse_step_dense


def read_qwen(hf: dict[str, Any], shape: Shape) -> dict[str, Any]:
    """The keys Qwen3-MoE and Qwen2-MoE share: experts, their width, top-k norm, dense layers."""
    if get(hf, "use_sliding_window", bool, False):
        raise ConfigError(
            "config.json: use_sliding_window = true is not supported for "
            f"{hf.get('model_type')} (its per-layer windows); only false"
        )
    return dict(
        num_experts=positive(hf, experts_key(hf)),
        expert_ffn=positive(hf, "moe_intermediate_size"),
        normalize_topk=get(hf, "norm_topk_prob", bool, False),
        dense_layers=sparse_step_dense(hf, shape.layers),
    )


def write_qwen(c: Any, out: dict[str, Any]) -> None:
    """The inverse of :func:`read_qwen`."""
    out.update(
        num_experts=c.moe.num_experts,
        moe_intermediate_size=c.moe.expert_ffn,
        norm_topk_prob=c.moe.normalize_topk,
        decoder_sparse_step=1,
        mlp_only_layers=list(c.pattern.dense_layers),
        use_sliding_window=False,
    )
    out.pop("num_local_experts", None)


def _read(hf: dict[str, Any], shape: Shape) -> dict[str, Any]:
    bias = get(hf, "attention_bias", bool, False)
    return dict(read_qwen(hf, shape), qk_norm=True, qkv_bias=bias, o_bias=bias)


def _write(c: Any, out: dict[str, Any]) -> None:
    write_qwen(c, out)
    out["attention_bias"] = c.attention.qkv_bias


FAMILY = Family(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    transformers_config="Qwen3MoeConfig",
    read=_read,
    write=_write,
    description="qwen3_moe has q/k norms and no shared expert",
    tiny=dict(
        TINY,
        num_experts=8,
        moe_intermediate_size=32,
        head_dim=16,
        norm_topk_prob=True,
        tie_word_embeddings=True,
    ),
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_positions=32768,
    kv_heads=4,
    dense_ffn=6144,
)
