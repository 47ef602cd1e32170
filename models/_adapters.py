"""LoRA at the models tier: the targets a decoder has, and the trainable part of a parameter tree.

The targets are named as PEFT names them (transformers' module names); :func:`adapters_of` and
:func:`with_frozen` cut a tree to its adapters and put it back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from . import _layers, _mla
from ._config import DecoderConfig

__all__ = [
    "ATTENTION_TARGETS",
    "DENSE_TARGETS",
    "EXPERT_TARGETS",
    "MLA_TARGETS",
    "MOE_TARGETS",
    "ROUTER_TARGET",
    "SHARED_TARGETS",
    "adapters_of",
    "attention_targets",
    "is_adapter",
    "lora_targets",
    "with_frozen",
]

#: LoRA targets of the GQA attention, by transformers' projection names (``w_qkv`` holds the
#: first three side by side, ``w_o`` is ``o_proj``).
ATTENTION_TARGETS = (*_layers.QKV, "o_proj")
#: LoRA targets of multi-head latent attention (transformers' names) -> the weights they adapt.
MLA_TARGETS = {
    "q_proj": "w_q",
    "q_a_proj": "w_q_a",
    "q_b_proj": "w_q_b",
    "kv_a_proj_with_mqa": "w_kv_a",
    "kv_b_proj": "w_kv_b",
    "o_proj": "w_o",
}
#: LoRA targets of the dense layers' MLP (``mlp.<name>``: transformers' projection names below
#: the MLP module; ``w_in`` holds gate and up side by side).
DENSE_TARGETS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
#: LoRA targets of the routed experts (PEFT's ``target_parameters`` names, relative to the MoE
#: module) -> the expert layer's weights (``MoEConfig.lora``).
EXPERT_TARGETS = {"experts.gate_up_proj": "w_in", "experts.down_proj": "w_out"}
#: LoRA targets of the shared experts (transformers' projection names below the shared expert
#: module, whatever a family calls it) -> the expert layer's (``MoEConfig.lora``).
SHARED_TARGETS = {
    "shared_experts.gate_proj": "shared_gate_proj",
    "shared_experts.up_proj": "shared_up_proj",
    "shared_experts.down_proj": "shared_down_proj",
}
#: The MoE router's LoRA target (PEFT's ``target_parameters`` on the family's router weight).
ROUTER_TARGET = "router"
#: The MoE layer's LoRA targets -> the expert layer's weights (``MoEConfig.lora``).
MOE_TARGETS = {**EXPERT_TARGETS, **SHARED_TARGETS, ROUTER_TARGET: "router"}


def attention_targets(config: DecoderConfig) -> dict[str, tuple[int, int]]:
    """The attention's LoRA targets a decoder of `config` has -> ``(in, out)`` of each."""
    a, d = config.attention, config.hidden_size
    if a.mla is None:
        return {
            "q_proj": (d, a.q_size),
            "k_proj": (d, a.kv_size),
            "v_proj": (d, a.kv_size),
            "o_proj": (a.q_size, d),
        }
    shapes = _mla.param_shapes(config)
    return {name: shapes[w] for name, w in MLA_TARGETS.items() if w in shapes}


def lora_targets(config: DecoderConfig) -> tuple[str, ...]:
    """The LoRA targets a decoder of `config` has.

    Its attention's, the dense layers' MLP's and the shared experts' (where it has them), the
    routed experts', the router.
    """
    dense = DENSE_TARGETS if config.pattern.dense_layers else ()
    shared = tuple(SHARED_TARGETS) if config.moe.shared_ffn else ()
    return (*attention_targets(config), *dense, *shared, *EXPERT_TARGETS, ROUTER_TARGET)


def is_adapter(path: tuple) -> bool:
    """Whether a tree path (``tree_map_with_path``'s) ends in an adapter (``*_lora_*``)."""
    last = path[-1] if path else None
    return isinstance(last, jax.tree_util.DictKey) and "_lora_" in str(last.key)


def adapters_of(tree: Any, is_leaf: Callable | None = None) -> Any:
    """`tree` with every leaf but the adapters' (``*_lora_a``, ``*_lora_b``) None.

    The trainable part of a model with LoRA; `tree` is the parameters, or their specs,
    shardings or shapes (give `is_leaf` for a leaf type that is a pytree node itself).
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if is_adapter(path) else None, tree, is_leaf=is_leaf
    )


def with_frozen(adapters: Any, params: Any) -> Any:
    """`params` with its adapter leaves taken from `adapters` (:func:`adapters_of`'s shape)."""
    return jax.tree.map(
        lambda a, p: p if a is None else a, adapters, params, is_leaf=lambda x: x is None
    )
