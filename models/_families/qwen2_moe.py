"""Qwen2-MoE (``qwen2_moe``, ``Qwen2MoeForCausalLM``).

Softmax top-k, q/k/v biases, a shared expert behind a sigmoid gate (``mlp.shared_expert``,
``mlp.shared_expert_gate``).
"""

from __future__ import annotations

from typing import Any

from ._family import TINY, Family, Names, Shape
from ._keys import get
from .qwen3_moe import read_qwen, write_qwen


def _read(hf: dict[str, Any], shape: Shape) -> dict[str, Any]:
    shared = get(hf, "shared_expert_intermediate_size", int, 5632)
    return dict(
        read_qwen(hf, shape),
        qkv_bias=get(hf, "qkv_bias", bool, True),
        shared_ffn=shared,
        shared_gate=shared > 0,  # its shared expert is always gated
    )


def _write(c: Any, out: dict[str, Any]) -> None:
    write_qwen(c, out)
    out["qkv_bias"] = c.attention.qkv_bias
    out["shared_expert_intermediate_size"] = c.moe.shared_ffn


FAMILY = Family(
    model_type="qwen2_moe",
    architecture="Qwen2MoeForCausalLM",
    transformers_config="Qwen2MoeConfig",
    read=_read,
    write=_write,
    description="qwen2_moe has no q/k norms and a gated shared expert",
    tiny=dict(
        TINY,
        num_experts=8,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_positions=32768,
    kv_heads=16,
    dense_ffn=5632,
    names=Names(shared="shared_expert"),
)
