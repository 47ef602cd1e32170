"""ERNIE-4.5-MoE (``ernie4_5_moe``, ``Ernie4_5_MoeForCausalLM``).

Softmax top-k renormalized with a correction bias for the choice (``mlp.moe_statics``), shared
experts, MoE layers by range and interval, interleaved RoPE pairs, tied embeddings by default.
"""

from __future__ import annotations

from typing import Any

from jaxops._errors import ConfigError

from ._family import TINY, Family, Names, Shape
from ._keys import get, positive


def _dense(hf: dict[str, Any], layers: int) -> tuple[int, ...]:
    """MoE layers are those in [start, end] with (i + 1) % interval == 0; the others dense."""
    start = get(hf, "moe_layer_start_index", int, 1)
    end = get(hf, "moe_layer_end_index", int, -1)
    end = layers - 1 if end == -1 else end
    interval = positive(hf, "moe_layer_interval", 1)
    return tuple(i for i in range(layers) if not (start <= i <= end and (i + 1) % interval == 0))


def _read(hf: dict[str, Any], shape: Shape) -> dict[str, Any]:
    experts = positive(hf, "moe_num_experts", 64)
    ffn = positive(hf, "moe_intermediate_size", 1536)
    kw = dict(
        num_experts=experts,
        expert_ffn=ffn,
        dense_layers=_dense(hf, shape.layers),
        normalize_topk=True,
        router_bias=True,
        shared_gate=False,
        shared_ffn=get(hf, "moe_num_shared_experts", int, 2) * ffn,
    )
    if get(hf, "use_bias", bool, False):
        raise ConfigError(
            "config.json: use_bias = true is not supported for ernie4_5_moe (biases on every "
            "linear layer, lm_head included; no published ERNIE-4.5-MoE has them); only false"
        )
    top_k = positive(hf, "moe_k", 6)
    norm_min = get(hf, "moe_norm_min", float, 1e-12)
    if norm_min > top_k / experts:  # the top-k softmax weights sum to at least k / E
        raise ConfigError(
            f"config.json: moe_norm_min = {norm_min} is not supported: above moe_k / "
            f"moe_num_experts ({top_k / experts}) it clamps the weights' sum, which jaxops' "
            "router does not"
        )
    return kw


def _range(moe: tuple[int, ...], layers: int) -> dict[str, int]:
    """moe_layer_start_index / end_index / interval saying the MoE layers `moe` (if any do)."""
    for interval in range(1, layers + 1):
        start, end = moe[0], moe[-1]
        if tuple(i for i in range(start, end + 1) if (i + 1) % interval == 0) == moe:
            return dict(
                moe_layer_start_index=start, moe_layer_end_index=end, moe_layer_interval=interval
            )
    return dict(moe_layer_start_index=-1)  # no such range: refused when read back


def _write(c: Any, out: dict[str, Any]) -> None:
    out.update(
        moe_num_experts=c.moe.num_experts,
        moe_intermediate_size=c.moe.expert_ffn,
        moe_k=c.moe.top_k,
        moe_num_shared_experts=c.moe.shared_ffn // c.moe.expert_ffn,
        use_bias=False,
        **_range(c.moe_layers, c.num_layers),
    )
    for key in ("num_experts_per_tok", "num_experts", "num_local_experts"):
        out.pop(key, None)  # aliases of moe_k and moe_num_experts


FAMILY = Family(
    model_type="ernie4_5_moe",
    architecture="Ernie4_5_MoeForCausalLM",
    transformers_config="Ernie4_5_MoeConfig",
    read=_read,
    write=_write,
    description="ernie4_5_moe renormalizes the top-k weights, has a correction bias, ungated "
    "shared experts and interleaved RoPE",
    tiny=dict(
        TINY,
        intermediate_size=96,
        num_hidden_layers=5,
        moe_num_experts=8,
        moe_k=2,
        moe_intermediate_size=32,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        moe_layer_interval=2,  # MoE layers 1 and 3; dense 0, 2, 4
    ),
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_positions=131072,
    kv_heads=4,
    dense_ffn=12288,
    top_k_key="moe_k",
    top_k=6,
    tie_word_embeddings=True,
    interleave="always",
    names=Names(router_bias="moe_statics.e_score_correction_bias", router_bias_squeeze=True),
)
