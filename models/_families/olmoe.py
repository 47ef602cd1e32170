"""OLMoE (``olmoe``, ``OlmoeForCausalLM``).

Softmax top-k, q/k RMSNorm over the whole projection, every layer MoE; the smallest family, the
worked example of the contributor guide.
"""

from __future__ import annotations

from typing import Any

from jaxops._errors import ConfigError

from ._family import TINY, Family, Shape
from ._keys import experts_key, get, positive


def _read(hf: dict[str, Any], shape: Shape) -> dict[str, Any]:
    clip = get(hf, "clip_qkv", float, None)
    if clip is not None:
        raise ConfigError(f"config.json: clip_qkv = {clip} is not supported for olmoe; only null")
    if shape.head_dim * shape.heads != shape.hidden:
        raise ConfigError(
            f"config.json: head_dim = {shape.head_dim} is not supported for olmoe: "
            f"transformers' q/k norms have hidden_size ({shape.hidden}) / "
            f"num_attention_heads ({shape.heads}) per head"
        )
    bias = get(hf, "attention_bias", bool, False)
    return dict(
        num_experts=positive(hf, experts_key(hf)),
        expert_ffn=positive(hf, "intermediate_size"),
        normalize_topk=get(hf, "norm_topk_prob", bool, False),
        qk_norm=True,
        qk_norm_width="projection",
        qkv_bias=bias,
        o_bias=bias,
    )


def _write(c: Any, out: dict[str, Any]) -> None:
    out.update(
        num_experts=c.moe.num_experts,
        intermediate_size=c.moe.expert_ffn,
        norm_topk_prob=c.moe.normalize_topk,
        attention_bias=c.attention.qkv_bias,
        clip_qkv=None,
    )
    out.pop("num_local_experts", None)
    out.pop("head_dim", None)  # transformers' q/k norms assume hidden_size / heads


FAMILY = Family(
    model_type="olmoe",
    architecture="OlmoeForCausalLM",
    transformers_config="OlmoeConfig",
    read=_read,
    write=_write,
    description="olmoe has whole-projection q/k norms, head_dim = hidden_size / "
    "num_attention_heads, no shared expert and no sliding window",
    tiny=dict(
        TINY,
        num_experts=8,
        intermediate_size=32,
    ),
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_positions=4096,
    aux_loss_coef=1e-2,
)
