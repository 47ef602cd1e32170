"""GLM-4.5 (``glm4_moe``, ``Glm4MoeForCausalLM``).

A sigmoid router with a correction bias and group-limited choice, shared experts, the first
``first_k_dense_replace`` layers dense, partial RoPE (half the head by default), optional per-head
q/k RMSNorm.
"""

from __future__ import annotations

from typing import Any

from jaxops._errors import ConfigError

from ._family import TINY, Family, Shape
from ._keys import first_dense, get, positive, rope_has_partial, routed_key


def read_grouped_sigmoid(
    hf: dict[str, Any],
    shape: Shape,
    *,
    experts: int,
    ffn: int,
    first_k_dense: int,
    n_group: int,
    topk_group: int,
    scaling: float,
) -> dict[str, Any]:
    """The MoE keys GLM-4.5 and DeepSeek-V3 share (the keyword defaults are transformers')."""
    ffn = positive(hf, "moe_intermediate_size", ffn)
    shared = get(hf, "n_shared_experts", int, 1)
    if shared < 0:
        raise ConfigError(f"config.json: 'n_shared_experts' must be >= 0, got {shared}")
    scoring = get(hf, "scoring_func", str, "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(
            f"config.json: scoring_func = {scoring!r} is not supported for "
            f"{hf.get('model_type')} (transformers' router is sigmoid); only 'sigmoid'"
        )
    return dict(
        num_experts=positive(hf, routed_key(hf), experts),
        expert_ffn=ffn,
        dense_layers=first_dense(hf, shape.layers, first_k_dense),
        normalize_topk=get(hf, "norm_topk_prob", bool, True),
        router="sigmoid",
        router_bias=True,
        shared_gate=False,
        n_group=positive(hf, "n_group", n_group),
        topk_group=positive(hf, "topk_group", topk_group),
        routed_scaling_factor=get(hf, "routed_scaling_factor", float, scaling),
        shared_ffn=shared * ffn,
    )


def write_grouped_sigmoid(c: Any, out: dict[str, Any]) -> None:
    """The inverse of :func:`read_grouped_sigmoid`."""
    dense = c.pattern.dense_layers
    out.update(
        n_routed_experts=c.moe.num_experts,
        moe_intermediate_size=c.moe.expert_ffn,
        norm_topk_prob=c.moe.normalize_topk,
        # dense layers other than the first k: refused when read back
        first_k_dense_replace=len(dense) if dense == tuple(range(len(dense))) else -1,
        n_group=c.moe.n_group,
        topk_group=c.moe.topk_group,
        routed_scaling_factor=c.moe.routed_scaling_factor,
        n_shared_experts=c.moe.shared_ffn // c.moe.expert_ffn,
    )
    out.pop("num_local_experts", None)


def _read(hf: dict[str, Any], shape: Shape) -> dict[str, Any]:
    kw = read_grouped_sigmoid(
        hf, shape, experts=128, ffn=1408, first_k_dense=1, n_group=1, topk_group=1, scaling=1.0
    )
    kw["qk_norm"] = get(hf, "use_qk_norm", bool, False)
    kw["qkv_bias"] = get(hf, "attention_bias", bool, False)
    return kw


def _write(c: Any, out: dict[str, Any]) -> None:
    write_grouped_sigmoid(c, out)
    out.update(use_qk_norm=c.attention.qk_norm, attention_bias=c.attention.qkv_bias)


def _rope_keys(hf: dict[str, Any], head_dim: int) -> dict[str, Any]:
    if hf.get("partial_rotary_factor") is None and not rope_has_partial(hf):
        return {**hf, "partial_rotary_factor": 0.5}  # transformers' default
    return hf


FAMILY = Family(
    model_type="glm4_moe",
    architecture="Glm4MoeForCausalLM",
    transformers_config="Glm4MoeConfig",
    read=_read,
    write=_write,
    description="glm4_moe has a sigmoid router and its dense layers first",
    tiny=dict(
        TINY,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        num_nextn_predict_layers=0,
        norm_topk_prob=True,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
        use_qk_norm=True,
        attention_bias=True,
        partial_rotary_factor=0.5,
    ),
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_positions=131072,
    kv_heads=8,
    aux_loss_coef=0.0,
    mtp_key="num_nextn_predict_layers",
    mtp_default=1,
    dense_ffn=10944,
    partial_rotary=True,
    rope_keys=_rope_keys,
)
