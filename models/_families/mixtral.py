"""Mixtral (``mixtral``, ``MixtralForCausalLM``).

Softmax top-k renormalized, every layer MoE, an optional sliding window; experts named
``block_sparse_moe.experts.{e}.w1 / w3 / w2``.
"""

from __future__ import annotations

from typing import Any

from ._family import TINY, Family, Names, Shape
from ._keys import get, no_jitter, positive


def _read(hf: dict[str, Any], shape: Shape) -> dict[str, Any]:
    no_jitter(hf)
    return dict(
        num_experts=positive(hf, "num_local_experts"),
        expert_ffn=positive(hf, "intermediate_size"),
        normalize_topk=True,
        sliding_window=get(hf, "sliding_window", int, None),
    )


def _write(c: Any, out: dict[str, Any]) -> None:
    out.update(
        num_local_experts=c.moe.num_experts,
        intermediate_size=c.moe.expert_ffn,
        sliding_window=c.attention.sliding_window,
    )


FAMILY = Family(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    transformers_config="MixtralConfig",
    read=_read,
    write=_write,
    description="mixtral renormalizes the top-k weights and has no shared expert, biases or "
    "dense layers",
    tiny=dict(
        TINY,
        num_local_experts=8,
        intermediate_size=48,
    ),
    rms_norm_eps=1e-5,
    rope_theta=1e6,
    max_positions=131072,
    kv_heads=8,
    names=Names(moe="block_sparse_moe", experts=("w1", "w3", "w2")),
)
