"""Llama 4 (``llama4_text``, ``Llama4ForCausalLM``).

The text model, also of the published ``llama4`` multimodal checkpoints. A top-k sigmoid router
weighting the experts' inputs, a shared expert of the experts' width, MoE layers every
``interleave_moe_layer_step``, NoPE layers with temperature tuning, chunked attention, an L2 q/k
norm, interleaved RoPE pairs; each layer's experts stored as one tensor
(``feed_forward.experts.gate_up_proj``).
"""

from __future__ import annotations

from typing import Any

from jaxops._errors import ConfigError

from ._family import TINY, Family, Names, Shape, Wrapper
from ._keys import get, layer_types, no_jitter, positive


def _number(x: float) -> float | int:
    """`x`, as an int when it is one (transformers' strict configs type some keys int)."""
    return int(x) if float(x).is_integer() else x


def _read(hf: dict[str, Any], shape: Shape) -> dict[str, Any]:
    layers = shape.layers
    kw: dict[str, Any] = {}
    kw["expert_ffn"] = ffn = positive(hf, "intermediate_size", 8192)
    kw["shared_ffn"], kw["shared_gate"] = ffn, False  # its shared expert: intermediate_size wide
    kw["normalize_topk"], kw["router"], kw["weight_inputs"] = False, "sigmoid", True
    kw["qkv_bias"] = kw["o_bias"] = get(hf, "attention_bias", bool, False)
    no_jitter(hf)
    step = positive(hf, "interleave_moe_layer_step", 1)
    moe = get(hf, "moe_layers", list, list(range(step - 1, layers, step)))
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in moe):
        raise ConfigError(f"config.json: 'moe_layers' must hold layer indices, got {moe!r}")
    kw["dense_layers"] = tuple(i for i in range(layers) if i not in set(moe))
    rope = get(hf, "no_rope_layers", list, None) or [
        int((i + 1) % positive(hf, "no_rope_layer_interval", 4) != 0) for i in range(layers)
    ]
    if len(rope) != layers or any(r not in (0, 1) or isinstance(r, float) for r in rope):
        raise ConfigError(
            f"config.json: 'no_rope_layers' must hold num_hidden_layers ({layers}) of 0 (no "
            f"RoPE) or 1, got {rope!r}"
        )
    kw["nope_layers"] = tuple(i for i, r in enumerate(rope) if not r)
    chunk = hf["attention_chunk_size"] if "attention_chunk_size" in hf else 8192
    if chunk is not None:
        chunk = positive(hf, "attention_chunk_size", 8192)
    kw["attention_chunk_size"] = chunk
    kw["layer_types"] = layer_types(
        hf,
        layers,
        ["chunked_attention" if r and chunk is not None else "full_attention" for r in rope],
    )
    kw["qk_l2_norm"] = get(hf, "use_qk_norm", bool, True)
    kw["attn_temperature_tuning"] = get(hf, "attn_temperature_tuning", bool, True)
    kw["floor_scale"] = get(hf, "floor_scale", float, 8192.0)
    kw["attn_scale"] = get(hf, "attn_scale", float, 0.1)
    kw["num_experts"] = positive(hf, "num_local_experts", 16)
    return kw


def _write(c: Any, out: dict[str, Any]) -> None:
    out.update(
        num_local_experts=c.moe.num_experts,
        intermediate_size=c.moe.expert_ffn,
        moe_layers=list(c.moe_layers),
        interleave_moe_layer_step=1,
        no_rope_layers=[int(i not in c.pattern.nope_layers) for i in range(c.num_layers)],
        attention_chunk_size=c.attention.attention_chunk_size,
        layer_types=list(c.pattern.layer_types) or ["full_attention"] * c.num_layers,
        use_qk_norm=c.attention.qk_l2_norm,
        attn_temperature_tuning=c.attention.attn_temperature_tuning,
        floor_scale=_number(c.attention.floor_scale),
        attn_scale=c.attention.attn_scale,
        attention_bias=c.attention.qkv_bias,
        router_jitter_noise=0.0,
    )
    out.pop("num_experts", None)


FAMILY = Family(
    model_type="llama4_text",
    architecture="Llama4ForCausalLM",
    transformers_config="Llama4TextConfig",
    read=_read,
    write=_write,
    description="llama4_text has a top-k sigmoid router weighting the experts' inputs and a "
    "shared expert of the experts' width",
    tiny=dict(
        TINY,
        intermediate_size=32,
        intermediate_size_mlp=48,
        num_hidden_layers=4,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,  # MoE layers 1 and 3, dense 0 and 2
        no_rope_layer_interval=2,  # NoPE layers 1 and 3
        attention_chunk_size=4,  # the RoPE layers attend within chunks of 4 positions
        floor_scale=4,  # temperature tuning acts from time step 3 on
        attn_scale=0.5,
    ),
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_positions=131072,
    kv_heads=8,
    head_dim=128,
    dense_ffn=16384,
    dense_ffn_key="intermediate_size_mlp",
    top_k=1,
    interleave="always",
    names=Names(moe="feed_forward", fused_experts=True, router="router", shared="shared_expert"),
    wrapper=Wrapper(
        model_type="llama4",
        config_key="text_config",
        prefix="language_model.",
        skipped=("vision_model.", "multi_modal_projector."),
        skipped_what="Llama 4's vision tower and projector",
    ),
    moe_module="feed_forward",
    peft_swapped=True,
)
