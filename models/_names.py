"""Every Hugging Face name map of jaxops.models: our parameter trees <-> published tensor names.

- :func:`name_map`: :class:`~jaxops.models.MoEDecoder` (every model type it reads).
- :func:`moe_block_rules`: one layer's MoE block (``moe_layer`` parameters) of DeepSeek-V3,
  Qwen2-MoE, Qwen3-MoE, OLMoE or Mixtral.
- :data:`LLAMA_NAME_MAP` and :func:`llama_name_map`: a Llama-style dense tree and
  ``LlamaForCausalLM`` (formerly in ``jaxops.parallel.checkpoint``, where the names stay as
  deprecated aliases for one release).

Each map is a tuple of :class:`jaxops.parallel.checkpoint.Rule` for ``import_safetensors``,
``export_safetensors`` and ``hf_target``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxops.parallel import expert as ep
from jaxops.parallel.checkpoint import Rule

from jaxops._errors import ArgumentTypeError, InvalidArgumentError, named_errors

from ._config import DecoderConfig
from ._families import family

__all__ = [
    "LLAMA_NAME_MAP",
    "expert_names",
    "llama_name_map",
    "moe_block_rules",
    "mtp_copies",
    "mtp_layers",
    "name_map",
]


def expert_names(model_type: str) -> tuple[str, str, str, str]:
    """(MoE module, gate, up, down) names in the published checkpoints (the family's).

    Mixtral's ``block_sparse_moe`` / ``w1, w3, w2``; the others' (Qwen, OLMoE, DeepSeek-V3)
    ``mlp`` / ``gate_proj, up_proj, down_proj``.
    """
    names = family(model_type).names
    return (names.moe, *names.experts)


@named_errors("jaxops.models.name_map")
def name_map(config: DecoderConfig) -> tuple[Rule, ...]:
    """The checkpoint Rules between :class:`MoEDecoder` parameters and published tensor names.

    The names are those of the model's published checkpoints (what ``save_pretrained`` of
    transformers writes), as :class:`~jaxops.parallel.checkpoint.Rule` s.

    Layers are stacked on our leading axis (placeholder ``{i}``) and experts on the next
    (``{e}``); with dense layers, our MoE stack ``layers`` and dense stack ``dense_layers``
    each name their layers' published indices (``Rule.index``). q/k/v and gate/up are fused on
    our side (the GQA split sizes come from the config); our kernels are ``[in, out]``, torch
    Linear weights ``[out, in]``. The q/k norms (``self_attn.q_norm`` / ``k_norm``) are per head
    for Qwen3 and GLM and of the whole projection for OLMoE (the shapes come from the parameter
    tree). DeepSeek-V3's multi-head latent attention keeps its projections apart (``q_a_proj``,
    ``q_a_layernorm``, ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
    ``kv_b_proj``, ``o_proj``).

    Example:
      >>> from jaxops.models import AttentionSpec, DecoderConfig, MoESpec, name_map
      >>> cfg = DecoderConfig("mixtral", 128, 64, 2, AttentionSpec(4, 2, 16), MoESpec(8, 2, 96))
      >>> rule = [r for r in name_map(cfg) if r.ours == "layers/moe/w_in"][0]
      >>> rule.stack, rule.theirs[1]
      (('i', 'e'), 'model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight')
    """
    c = config
    t = (1, 0)
    rules = [Rule("embed", "model.embed_tokens.weight")]
    stacks = [("layers", c.moe_layers)]
    if c.pattern.dense_layers:
        stacks.append(("dense_layers", c.pattern.dense_layers))
    for key, layers in stacks:
        index = {"i": layers} if c.pattern.dense_layers else None
        rules += _attention_rules(c, key, index)
        if key == "layers":
            rules += _moe_rules(c, index)
        else:
            lay = f"model.layers.{{i}}.{expert_names(c.model_type)[0]}."
            rules += [
                Rule(
                    "dense_layers/mlp/w_in",
                    (lay + "gate_proj.weight", lay + "up_proj.weight"),
                    transpose=t,
                    stack=("i",),
                    index=index,
                ),
                Rule(
                    "dense_layers/mlp/w_out",
                    lay + "down_proj.weight",
                    transpose=t,
                    stack=("i",),
                    index=index,
                ),
            ]
    rules.append(Rule("final_norm", "model.norm.weight"))
    if not c.tie_word_embeddings:
        rules.append(Rule("lm_head", "lm_head.weight", transpose=t))
    if c.mtp_layers:
        rules += _mtp_rules(c)
    return tuple(rules)


def mtp_layers(config: DecoderConfig) -> tuple[int, ...]:
    """The published layer indices of the MTP modules: ``num_layers .. num_layers + D - 1``."""
    return tuple(range(config.num_layers, config.num_layers + config.mtp_layers))


def mtp_copies(config: DecoderConfig) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """Published name -> ``(our key, transpose)`` of the MTP modules' copies of shared tensors.

    DeepSeek-V3 and GLM-4.5 store each module's ``embed_tokens`` and ``shared_head.head``
    beside it, equal to the model's embedding and output head (GLM-4.6 leaves them out); the
    modules share the model's own.
    """
    head = ("embed", None) if config.tie_word_embeddings else ("lm_head", (1, 0))
    out = {}
    for i in mtp_layers(config):
        out[f"model.layers.{i}.embed_tokens.weight"] = ("embed", None)
        out[f"model.layers.{i}.shared_head.head.weight"] = head
    return out


def _mtp_rules(c: DecoderConfig) -> list[Rule]:
    """The MTP modules' Rules: ``mtp/*`` stacked over the depths (``model.layers.{L + k}``)."""
    index = {"i": mtp_layers(c)}
    lay = "model.layers.{i}."
    t = (1, 0)
    rules = [
        Rule("mtp/enorm", lay + "enorm.weight", stack=("i",), index=index),
        Rule("mtp/hnorm", lay + "hnorm.weight", stack=("i",), index=index),
        Rule("mtp/eh_proj", lay + "eh_proj.weight", transpose=t, stack=("i",), index=index),
        Rule("mtp/head_norm", lay + "shared_head.norm.weight", stack=("i",), index=index),
    ]
    return rules + _attention_rules(c, "mtp/block", index) + _moe_rules(c, index, "mtp/block")


def _attention_rules(c: DecoderConfig, key: str, index: dict | None) -> list[Rule]:
    """The norms' and the attention's Rules of our stack `key`."""
    lay = "model.layers.{i}."
    t = (1, 0)

    def rule(ours, theirs, **kw):
        return Rule(f"{key}/{ours}", theirs, stack=("i",), index=index, **kw)

    rules = [
        rule("attn_norm", lay + "input_layernorm.weight"),
        rule("mlp_norm", lay + "post_attention_layernorm.weight"),
    ]
    attn = lay + "self_attn."
    if c.attention.mla is not None:
        if c.attention.mla.q_lora_rank is None:
            rules.append(rule("w_q", attn + "q_proj.weight", transpose=t))
        else:
            rules += [
                rule("w_q_a", attn + "q_a_proj.weight", transpose=t),
                rule("q_a_norm", attn + "q_a_layernorm.weight"),
                rule("w_q_b", attn + "q_b_proj.weight", transpose=t),
            ]
        rules += [
            rule("w_kv_a", attn + "kv_a_proj_with_mqa.weight", transpose=t),
            rule("kv_a_norm", attn + "kv_a_layernorm.weight"),
            rule("w_kv_b", attn + "kv_b_proj.weight", transpose=t),
            rule("w_o", attn + "o_proj.weight", transpose=t),
        ]
        return rules
    sizes = (c.attention.q_size, c.attention.kv_size, c.attention.kv_size)
    qkv = [attn + f"{n}_proj" for n in ("q", "k", "v")]
    rules += [
        rule("w_qkv", tuple(n + ".weight" for n in qkv), transpose=t, sizes=sizes),
        rule("w_o", attn + "o_proj.weight", transpose=t),
    ]
    if c.attention.qkv_bias:
        rules.append(rule("b_qkv", tuple(n + ".bias" for n in qkv), sizes=sizes))
    if c.attention.o_bias:
        rules.append(rule("b_o", attn + "o_proj.bias"))
    if c.attention.qk_norm:
        rules.append(rule("q_norm", attn + "q_norm.weight"))
        rules.append(rule("k_norm", attn + "k_norm.weight"))
    if c.attention.attention_sinks:
        rules.append(rule("sinks", attn + "sinks"))
    return rules


def _moe_rules(c: DecoderConfig, index: dict | None, key: str = "layers") -> list[Rule]:
    """The MoE block's Rules of our stack `key` (``layers``, or the MTP modules' block)."""
    lay = "model.layers.{i}."
    t = (1, 0)
    names = family(c.model_type).names
    if names.fused_experts:
        return _fused_moe_rules(c, index, key)
    moe = names.moe
    gate, up, down = names.experts
    experts = lay + f"{moe}.experts.{{e}}."
    rules = [
        Rule(f"{key}/moe/router", lay + f"{moe}.{names.router}.weight", transpose=t,
             stack=("i",), index=index),
        Rule(
            f"{key}/moe/w_in",
            (experts + f"{gate}.weight", experts + f"{up}.weight"),
            transpose=t,
            stack=("i", "e"),
            index=index,
        ),
        Rule(f"{key}/moe/w_out", experts + f"{down}.weight", transpose=t, stack=("i", "e"),
             index=index),
    ]  # fmt: skip
    if c.moe.router_bias:  # kept float32, as published
        rules.append(
            Rule(f"{key}/moe/router_bias", lay + f"{moe}.{names.router_bias}", stack=("i",),
                 index=index, dtype="float32", squeeze=0 if names.router_bias_squeeze else None)
        )  # fmt: skip
    if c.moe.shared_ffn:
        gated = c.moe.shared_gate
        shared = lay + f"{moe}.{names.shared}."
        rules += [
            Rule(
                f"{key}/moe/shared_w_in",
                (shared + "gate_proj.weight", shared + "up_proj.weight"),
                transpose=t,
                stack=("i",),
                index=index,
            ),
            Rule(f"{key}/moe/shared_w_out", shared + "down_proj.weight", transpose=t,
                 stack=("i",), index=index),
        ]  # fmt: skip
        if gated:
            rules.append(
                Rule(f"{key}/moe/shared_gate", lay + f"{moe}.{names.shared}_gate.weight",
                     transpose=t, stack=("i",), index=index)
            )  # fmt: skip
    return rules


def _fused_moe_rules(c: DecoderConfig, index: dict | None, key: str = "layers") -> list[Rule]:
    """gpt-oss's and Llama 4's MoE blocks: one expert tensor per layer, ours' layout."""
    names = family(c.model_type).names
    moe = f"model.layers.{{i}}.{names.moe}."
    t = (1, 0)

    def rule(ours, theirs, **kw):
        theirs = moe + theirs if isinstance(theirs, str) else tuple(moe + t for t in theirs)
        return Rule(f"{key}/moe/{ours}", theirs, stack=("i",), index=index, **kw)

    rules = [
        rule("router", f"{names.router}.weight", transpose=t),
        rule("w_in", "experts.gate_up_proj"),  # [E, D, 2F], as ours
        rule("w_out", "experts.down_proj"),  # [E, F, D]
    ]
    if c.moe.router_logit_bias:
        rules.append(rule("router_logit_bias", f"{names.router}.bias"))
    if c.moe.expert_bias:
        rules += [
            rule("b_in", "experts.gate_up_proj_bias"),
            rule("b_out", "experts.down_proj_bias"),
        ]
    if c.moe.shared_ffn:  # Llama 4's shared expert
        shared = f"{names.shared}."
        rules += [
            rule(
                "shared_w_in", (shared + "gate_proj.weight", shared + "up_proj.weight"), transpose=t
            ),
            rule("shared_w_out", shared + "down_proj.weight", transpose=t),
        ]
    return rules


def moe_block_rules(kind: str, layer: int, cfg: ep.MoEConfig) -> list[Rule]:
    """The Rules of layer `layer`'s MoE block (``moe_layer`` parameters) in a `kind` checkpoint."""
    pre = f"model.layers.{layer}."
    t = (1, 0)
    names = family(kind).names
    moe = names.moe
    gate, up, down = names.experts
    experts = pre + f"{moe}.experts.{{e}}."
    rules = [
        Rule("router", pre + f"{moe}.{names.router}.weight", transpose=t),
        Rule(
            "w_in",
            (experts + f"{gate}.weight", experts + f"{up}.weight"),
            transpose=t,
            stack=("e",),
        ),
        Rule("w_out", experts + f"{down}.weight", transpose=t, stack=("e",)),
    ]
    if cfg.router_bias:
        rules.append(Rule("router_bias", pre + f"{moe}.{names.router_bias}"))
    if cfg.shared_ffn:
        shared = pre + f"{moe}.{names.shared}."
        rules += [
            Rule(
                "shared_w_in", (shared + "gate_proj.weight", shared + "up_proj.weight"), transpose=t
            ),
            Rule("shared_w_out", shared + "down_proj.weight", transpose=t),
        ]
        if cfg.shared_gate:
            gate_name = pre + f"{moe}.{names.shared}_gate.weight"
            rules.append(Rule("shared_gate", gate_name, transpose=t))
    return rules


LLAMA_NAME_MAP: tuple[Rule, ...] = (
    Rule("embed/embedding", "model.embed_tokens.weight"),
    Rule("layers/{i}/attn_norm/scale", "model.layers.{i}.input_layernorm.weight"),
    Rule(
        "layers/{i}/attn/qkv/kernel",
        [
            "model.layers.{i}.self_attn.q_proj.weight",
            "model.layers.{i}.self_attn.k_proj.weight",
            "model.layers.{i}.self_attn.v_proj.weight",
        ],
        transpose=(1, 0),
    ),
    Rule(
        "layers/{i}/attn/out/kernel", "model.layers.{i}.self_attn.o_proj.weight", transpose=(1, 0)
    ),
    Rule("layers/{i}/mlp_norm/scale", "model.layers.{i}.post_attention_layernorm.weight"),
    Rule(
        "layers/{i}/mlp/gate_up/kernel",
        ["model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"],
        transpose=(1, 0),
    ),
    Rule("layers/{i}/mlp/down/kernel", "model.layers.{i}.mlp.down_proj.weight", transpose=(1, 0)),
    Rule("final_norm/scale", "model.norm.weight"),
    Rule("lm_head/kernel", "lm_head.weight", transpose=(1, 0)),
)
"""Our Llama-style tree <-> Hugging Face ``LlamaForCausalLM`` names (multi-head attention).

Our layout: ``embed/embedding [V, D]``, per layer ``i``: ``attn_norm/scale [D]``,
``attn/qkv/kernel [D, 3D]`` (q, k, v fused), ``attn/out/kernel [D, D]``,
``mlp_norm/scale [D]``, ``mlp/gate_up/kernel [D, 2F]`` (gate, up fused),
``mlp/down/kernel [F, D]``; then ``final_norm/scale [D]`` and ``lm_head/kernel [D, V]``. Dense
kernels are ``[in, out]``; Hugging Face stores torch Linear weights ``[out, in]``, hence the
transposes. For grouped-query attention, tied embeddings or biases use :func:`llama_name_map`,
which derives them from the model's config.
"""


def _config_dict(config: Any) -> dict[str, Any]:
    """A Hugging Face config as a dict: a dict, an object with to_dict(), or a config.json path."""
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        config = json.loads(path.read_text())
    elif hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ArgumentTypeError(
            "config must be a dict, an object with to_dict() or a "
            f"path to a config.json, got {type(config).__name__}"
        )
    return dict(config)


@named_errors("jaxops.models.llama_name_map")
def llama_name_map(config: Any, *, rope: str = "rotate_half") -> tuple[Rule, ...]:
    """The Rules between our Llama-style tree and ``LlamaForCausalLM``, for `config`.

    The layout of :data:`LLAMA_NAME_MAP` (fused q/k/v and gate/up kernels ``[in, out]``), with
    what the config decides filled in: the q/k/v split ``sizes=(H*Dh, K*Dh, K*Dh)`` from
    ``num_attention_heads`` (H), ``num_key_value_heads`` (K, default H) and ``head_dim`` (Dh,
    default ``hidden_size // H``); with ``tie_word_embeddings`` our ``lm_head/kernel [D, V]``
    reads (and, on export, must equal) ``model.embed_tokens.weight``, so no ``lm_head.weight`` is
    written; with ``attention_bias`` the rules for ``attn/qkv/bias [(H+2K)*Dh]`` and
    ``attn/out/bias [D]``, with ``mlp_bias`` those for ``mlp/gate_up/bias [2F]`` and
    ``mlp/down/bias [D]``.

    Args:
      config: the Hugging Face config: a dict (``config.to_dict()``, a loaded config.json), an
        object with ``to_dict()`` (a ``transformers.LlamaConfig``), or the path of a config.json
        or of a model directory holding one.
      rope: our q/k layout: ``"rotate_half"`` (transformers', nothing to permute) or
        ``"interleaved"`` (Meta's original code: the q/k rows of each head are permuted, see
        ``Rule.rope``).

    Returns:
      The rules, for ``export_safetensors``, ``import_safetensors`` and ``hf_target`` of
      :mod:`jaxops.parallel.checkpoint`.

    Raises:
      ValueError: a missing or inconsistent head count.

    Example:
      >>> from jaxops.models import llama_name_map
      >>> rules = llama_name_map({"hidden_size": 2048, "num_attention_heads": 32, "head_dim": 64,
      ...                         "num_key_value_heads": 8, "tie_word_embeddings": True})
      >>> [r.sizes for r in rules if r.ours == "layers/{i}/attn/qkv/kernel"]
      [(2048, 512, 512)]
      >>> [r.theirs for r in rules if r.ours == "lm_head/kernel"]
      ['model.embed_tokens.weight']
    """
    c = _config_dict(config)
    if rope not in ("rotate_half", "interleaved"):
        raise InvalidArgumentError(f"rope must be 'rotate_half' or 'interleaved', got {rope!r}")
    heads = c.get("num_attention_heads")
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or (
        c["hidden_size"] // heads if isinstance(heads, int) and c.get("hidden_size") else None
    )
    if not all(isinstance(v, int) and v > 0 for v in (heads, kv, head_dim)) or heads % kv:
        raise InvalidArgumentError(
            "the config needs num_attention_heads, a "
            "num_key_value_heads that divides it and head_dim or hidden_size; got "
            f"{ {k: c.get(k) for k in ('num_attention_heads', 'num_key_value_heads', 'head_dim')} }"
        )
    sizes = (heads * head_dim, kv * head_dim, kv * head_dim)
    qk_rope = (head_dim, head_dim, None) if rope == "interleaved" else None
    lay = "model.layers.{i}."
    qkv = [lay + f"self_attn.{n}_proj" for n in "qkv"]
    gate_up = [lay + "mlp.gate_proj", lay + "mlp.up_proj"]
    t = (1, 0)
    rules = [
        Rule("embed/embedding", "model.embed_tokens.weight"),
        Rule("layers/{i}/attn_norm/scale", lay + "input_layernorm.weight"),
        Rule(
            "layers/{i}/attn/qkv/kernel",
            [n + ".weight" for n in qkv],
            transpose=t,
            sizes=sizes,
            rope=qk_rope,
        ),
        Rule("layers/{i}/attn/out/kernel", lay + "self_attn.o_proj.weight", transpose=t),
        Rule("layers/{i}/mlp_norm/scale", lay + "post_attention_layernorm.weight"),
        Rule("layers/{i}/mlp/gate_up/kernel", [n + ".weight" for n in gate_up], transpose=t),
        Rule("layers/{i}/mlp/down/kernel", lay + "mlp.down_proj.weight", transpose=t),
        Rule("final_norm/scale", "model.norm.weight"),
    ]
    if c.get("attention_bias"):
        rules += [
            Rule("layers/{i}/attn/qkv/bias", [n + ".bias" for n in qkv], sizes=sizes, rope=qk_rope),
            Rule("layers/{i}/attn/out/bias", lay + "self_attn.o_proj.bias"),
        ]
    if c.get("mlp_bias"):
        rules += [
            Rule("layers/{i}/mlp/gate_up/bias", [n + ".bias" for n in gate_up]),
            Rule("layers/{i}/mlp/down/bias", lay + "mlp.down_proj.bias"),
        ]
    tied = bool(c.get("tie_word_embeddings", False))
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    rules.append(Rule("lm_head/kernel", head, transpose=t))
    return tuple(rules)
