"""MiniMax-M2 (``minimax_m2``, ``MiniMaxM2ForCausalLM``).

A sigmoid router with a correction bias (``block_sparse_moe.e_score_correction_bias``), q/k RMSNorm
over the whole projection, partial RoPE (``rotary_dim`` in published configs); experts named ``w1 /
w3 / w2``.
"""

from __future__ import annotations

from typing import Any

from ._family import TINY, Family, Names, Shape
from ._keys import experts_key, get, no_jitter, positive


def _read(hf: dict[str, Any], shape: Shape) -> dict[str, Any]:
    kw = dict(
        num_experts=positive(hf, experts_key(hf), 256),
        expert_ffn=positive(hf, "intermediate_size", 1536),
        normalize_topk=True,
        router="sigmoid",
        router_bias=True,
        qk_norm=True,
        qk_norm_width="projection",
    )
    no_jitter(hf)
    return kw


def _write(c: Any, out: dict[str, Any]) -> None:
    out.update(
        num_local_experts=c.moe.num_experts,
        intermediate_size=c.moe.expert_ffn,
        scoring_func="sigmoid",
        use_routing_bias=True,
        router_jitter_noise=0.0,
    )
    for key in ("num_experts", "rotary_dim"):  # rotary_dim: in rope_parameters' factor now
        out.pop(key, None)


def _rope_keys(hf: dict[str, Any], head_dim: int) -> dict[str, Any]:
    rotary = get(hf, "rotary_dim", int, None)
    if rotary is not None and hf.get("partial_rotary_factor") is None:
        return {**hf, "partial_rotary_factor": rotary / head_dim}  # transformers' legacy key
    return hf


FAMILY = Family(
    model_type="minimax_m2",
    architecture="MiniMaxM2ForCausalLM",
    transformers_config="MiniMaxM2Config",
    read=_read,
    write=_write,
    description="minimax_m2 has whole-projection q/k norms and a sigmoid router with a "
    "correction bias",
    tiny=dict(
        TINY,
        intermediate_size=32,
        head_dim=16,
        rotary_dim=8,  # published configs say partial RoPE this way
        num_local_experts=8,
    ),
    rms_norm_eps=1e-6,
    rope_theta=5000000.0,
    max_positions=196608,
    kv_heads=8,
    head_dim=128,
    top_k=8,
    partial_rotary=True,
    rope_keys=_rope_keys,
    names=Names(
        moe="block_sparse_moe",
        experts=("w1", "w3", "w2"),
        router_bias="e_score_correction_bias",
    ),
)
