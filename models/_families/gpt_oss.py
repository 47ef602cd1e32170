"""gpt-oss (``gpt_oss``, ``GptOssForCausalLM``).

Softmax over the top-k router logits (with a learned logit bias), experts with biases and the
clamped SwiGLU, attention sinks, q/k/v/o biases, sliding and full attention layers alternating,
YaRN RoPE by default; each layer's experts stored as one tensor (``mlp.experts.gate_up_proj``, gate
and up interleaved), MXFP4 when published.
"""

from __future__ import annotations

from typing import Any

from ._family import TINY, Family, Names, Shape
from ._keys import experts_key, get, layer_types, positive

# gpt-oss's rope_parameters when config.json has none (transformers' GptOssConfig).
_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_THETA = 150000.0


def _read(hf: dict[str, Any], shape: Shape) -> dict[str, Any]:
    bias = get(hf, "attention_bias", bool, True)
    window = hf.get("sliding_window", 128)  # an explicit null: no window
    alternate = [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(shape.layers)
    ]
    return dict(
        expert_ffn=positive(hf, "intermediate_size", 2880),
        # transformers: softmax over the top-k logits, the same weights
        normalize_topk=True,
        qkv_bias=bias,
        o_bias=bias,
        attention_sinks=True,
        expert_bias=True,
        router_logit_bias=True,
        activation="clamped_swiglu",
        swiglu_alpha=get(hf, "swiglu_alpha", float, 1.702),
        swiglu_limit=get(hf, "swiglu_limit", float, 7.0),
        sliding_window=None if window is None else positive(hf, "sliding_window", 128),
        layer_types=layer_types(hf, shape.layers, alternate),
        num_experts=positive(hf, experts_key(hf), 128),
    )


def _write(c: Any, out: dict[str, Any]) -> None:
    out.update(
        num_local_experts=c.moe.num_experts,
        intermediate_size=c.moe.expert_ffn,
        attention_bias=c.attention.qkv_bias,
        swiglu_alpha=c.moe.swiglu_alpha,
        swiglu_limit=c.moe.swiglu_limit,
        sliding_window=c.attention.sliding_window,
        layer_types=list(c.pattern.layer_types) or ["full_attention"] * c.num_layers,
    )
    out.pop("num_experts", None)


def _rope_keys(hf: dict[str, Any], head_dim: int) -> dict[str, Any]:
    if any(isinstance(hf.get(k), dict) for k in ("rope_parameters", "rope_scaling")):
        return hf
    return {**hf, "rope_parameters": {**_ROPE, "rope_theta": hf.get("rope_theta", _THETA)}}


FAMILY = Family(
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    transformers_config="GptOssConfig",
    read=_read,
    write=_write,
    description="gpt_oss has attention sinks, biases everywhere and the clamped SwiGLU",
    tiny=dict(
        TINY,
        intermediate_size=32,
        num_hidden_layers=4,
        head_dim=16,
        num_local_experts=8,
        sliding_window=4,  # sliding layers 0 and 2 see 4 of the 12 tokens
        swiglu_limit=0.3,  # the clamp acts on the tiny model's activations
    ),
    rms_norm_eps=1e-5,
    rope_theta=_THETA,
    max_positions=131072,
    kv_heads=8,
    head_dim=64,
    top_k=4,
    rope_keys=_rope_keys,
    names=Names(fused_experts=True, router="router"),
)
