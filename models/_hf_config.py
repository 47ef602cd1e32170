"""Each model type's config.json keys written back from a :class:`~jaxops.models.DecoderConfig`.

:func:`hf_keys` is the inverse of :func:`jaxops.models._families.config_fields`: the config
dict read (if any) with the config's values under the model type's keys, as transformers'
configuration class of the model type reads them.
"""

from __future__ import annotations

from typing import Any

from ._rope import rope_to_hf

__all__ = ["ARCHITECTURES", "hf_keys"]

ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
}


def _ernie_range(moe: tuple[int, ...], layers: int) -> dict[str, int]:
    """moe_layer_start_index / end_index / interval saying the MoE layers `moe` (if any do)."""
    for interval in range(1, layers + 1):
        start, end = moe[0], moe[-1]
        if tuple(i for i in range(start, end + 1) if (i + 1) % interval == 0) == moe:
            return dict(moe_layer_start_index=start, moe_layer_end_index=end,
                        moe_layer_interval=interval)  # fmt: skip
    return dict(moe_layer_start_index=-1)  # no such range: refused when read back


def hf_keys(c: Any, out: dict[str, Any]) -> dict[str, Any]:
    """`out` (the config dict read, if any) with the model-type keys of config `c` written."""
    out.pop("quantization_config", None)  # written back by save_pretrained when it quantizes
    out.update(
        model_type=c.model_type,
        architectures=[ARCHITECTURES[c.model_type]],
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        num_experts_per_tok=c.top_k,
        hidden_act="silu",
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        router_aux_loss_coef=c.router_aux_loss_coef,
    )
    for key in ("rope_theta", "rope_scaling", "partial_rotary_factor"):
        out.pop(key, None)  # all in rope_parameters
    out.update(rope_to_hf(c.rope))
    if c.dense_layers and c.model_type != "llama4_text":
        out["intermediate_size"] = c.dense_ffn
    first_k = len(c.dense_layers) if c.dense_layers == tuple(range(len(c.dense_layers))) else -1
    if c.model_type == "mixtral":
        out.update(
            num_local_experts=c.num_experts,
            intermediate_size=c.expert_ffn,
            sliding_window=c.sliding_window,
        )
    elif c.model_type == "olmoe":
        out.update(
            num_experts=c.num_experts,
            intermediate_size=c.expert_ffn,
            norm_topk_prob=c.normalize_topk,
            attention_bias=c.qkv_bias,
            clip_qkv=None,
        )
        out.pop("num_local_experts", None)
        out.pop("head_dim", None)  # transformers' q/k norms assume hidden_size / heads
    elif c.model_type in ("qwen3_moe", "qwen2_moe"):
        out.update(
            num_experts=c.num_experts,
            moe_intermediate_size=c.expert_ffn,
            norm_topk_prob=c.normalize_topk,
            decoder_sparse_step=1,
            mlp_only_layers=list(c.dense_layers),
            use_sliding_window=False,
        )
        out.pop("num_local_experts", None)
        if c.model_type == "qwen3_moe":
            out["attention_bias"] = c.qkv_bias
        else:
            out["qkv_bias"] = c.qkv_bias
            out["shared_expert_intermediate_size"] = c.shared_ffn
    elif c.model_type in _WRITERS:
        _WRITERS[c.model_type](c, out)
    elif c.model_type == "ernie4_5_moe":
        out.update(
            moe_num_experts=c.num_experts,
            moe_intermediate_size=c.expert_ffn,
            moe_k=c.top_k,
            moe_num_shared_experts=c.shared_ffn // c.expert_ffn,
            use_bias=False,
            **_ernie_range(c.moe_layers, c.num_layers),
        )
        for key in ("num_experts_per_tok", "num_experts", "num_local_experts"):
            out.pop(key, None)  # aliases of moe_k and moe_num_experts
    else:
        out.update(
            n_routed_experts=c.num_experts,
            moe_intermediate_size=c.expert_ffn,
            norm_topk_prob=c.normalize_topk,
            first_k_dense_replace=first_k,
            n_group=c.n_group,
            topk_group=c.topk_group,
            routed_scaling_factor=c.routed_scaling_factor,
            n_shared_experts=c.shared_ffn // c.expert_ffn,
        )
        out.pop("num_local_experts", None)
        if c.model_type == "glm4_moe":
            out.update(use_qk_norm=c.qk_norm, attention_bias=c.qkv_bias)
        elif c.mla is not None:
            out.update(
                q_lora_rank=c.mla.q_lora_rank,
                kv_lora_rank=c.mla.kv_lora_rank,
                qk_nope_head_dim=c.mla.qk_nope_head_dim,
                qk_rope_head_dim=c.mla.qk_rope_head_dim,
                v_head_dim=c.mla.v_head_dim,
                rope_interleave=c.rope.interleave,
                attention_bias=False,
            )
    if len(out.get("layer_types") or []) != c.num_layers:
        out.pop("layer_types", None)  # stale (e.g. after a change of num_layers)
    return out


def _number(x: float) -> float | int:
    """`x`, as an int when it is one (transformers' strict configs type some keys int)."""
    return int(x) if float(x).is_integer() else x


def _gpt_oss(c: Any, out: dict[str, Any]) -> None:
    out.update(
        num_local_experts=c.num_experts,
        intermediate_size=c.expert_ffn,
        attention_bias=c.qkv_bias,
        swiglu_alpha=c.swiglu_alpha,
        swiglu_limit=c.swiglu_limit,
        sliding_window=c.sliding_window,
        layer_types=list(c.layer_types) or ["full_attention"] * c.num_layers,
    )
    out.pop("num_experts", None)


def _llama4(c: Any, out: dict[str, Any]) -> None:
    out.update(
        num_local_experts=c.num_experts,
        intermediate_size=c.expert_ffn,
        moe_layers=list(c.moe_layers),
        interleave_moe_layer_step=1,
        no_rope_layers=[int(i not in c.nope_layers) for i in range(c.num_layers)],
        attention_chunk_size=c.attention_chunk_size,
        layer_types=list(c.layer_types) or ["full_attention"] * c.num_layers,
        use_qk_norm=c.qk_l2_norm,
        attn_temperature_tuning=c.attn_temperature_tuning,
        floor_scale=_number(c.floor_scale),
        attn_scale=c.attn_scale,
        attention_bias=c.qkv_bias,
        router_jitter_noise=0.0,
    )
    if c.dense_layers:
        out["intermediate_size_mlp"] = c.dense_ffn
    out.pop("num_experts", None)


def _minimax_m2(c: Any, out: dict[str, Any]) -> None:
    out.update(
        num_local_experts=c.num_experts,
        intermediate_size=c.expert_ffn,
        scoring_func="sigmoid",
        use_routing_bias=True,
        router_jitter_noise=0.0,
    )
    for key in ("num_experts", "rotary_dim"):  # rotary_dim: in rope_parameters' factor now
        out.pop(key, None)


_WRITERS = {"gpt_oss": _gpt_oss, "llama4_text": _llama4, "minimax_m2": _minimax_m2}
