"""The family registry: every published model family jaxops.models reads, one module each.

Each module of this package defines one :class:`Family` value (``FAMILY``): its config.json's
``model_type`` and architecture, transformers' defaults, ``read`` (its keys into
:class:`~jaxops.models.DecoderConfig` keywords) and ``write`` (back), its tensor names, its
quantized-expert layout and a tiny config for tests. Everything else in jaxops.models looks a
family up here (:func:`family`); adding one is a new module here plus its line in
:data:`FAMILIES` (and its row in the tests' table): see the contributor guide.

:func:`config_fields` reads a config.json dict (what every family shares, then the family's own
keys); :func:`hf_keys` writes a config back.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

from jaxops.parallel.expert import MoESpec

from jaxops._errors import ConfigError

from .._quant import read_quantization
from .._rope import Rope, read_rope, rope_to_hf
from .._spec import LAYER_TYPES, SPEC_FIELDS, compose
from . import (
    deepseek_v3,
    ernie4_5_moe,
    glm4_moe,
    gpt_oss,
    llama4,
    minimax_m2,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_moe,
)
from ._family import INTERLEAVE, Family, Names, Shape, Wrapper
from ._keys import get, positive

__all__ = [
    "FAMILIES",
    "INTERLEAVE",
    "LAYER_TYPES",
    "MODEL_TYPES",
    "Family",
    "Names",
    "Shape",
    "Wrapper",
    "config_fields",
    "family",
    "hf_keys",
    "moe_layers",
]

#: model_type -> :class:`Family`, every family jaxops.models reads (read-only).
FAMILIES: Mapping[str, Family] = types.MappingProxyType(
    {
        f.model_type: f
        for f in (
            mixtral.FAMILY,
            qwen3_moe.FAMILY,
            qwen2_moe.FAMILY,
            olmoe.FAMILY,
            glm4_moe.FAMILY,
            deepseek_v3.FAMILY,
            ernie4_5_moe.FAMILY,
            gpt_oss.FAMILY,
            llama4.FAMILY,
            minimax_m2.FAMILY,
        )
    }
)
#: The ``model_type`` values :class:`~jaxops.models.DecoderConfig` reads.
MODEL_TYPES = tuple(FAMILIES)
# A wrapper's model_type (llama4) -> the family inside it.
_WRAPPED = {f.wrapper.model_type: f for f in FAMILIES.values() if f.wrapper is not None}


def _supported() -> str:
    wrapped = ", ".join(
        f"{w} (whose {f.wrapper.config_key} is a {f.model_type})" for w, f in _WRAPPED.items()
    )
    return f"{', '.join(MODEL_TYPES)}" + (f" (and {wrapped})" if wrapped else "")


def family(model_type: str) -> Family:
    """The :class:`Family` of a ``model_type`` (of :data:`MODEL_TYPES`).

    Raises:
      ConfigError: an unknown model_type, naming the supported ones.

    Example:
      >>> from jaxops.models import family
      >>> f = family("mixtral")
      >>> f.architecture, f.names.moe, f.names.experts
      ('MixtralForCausalLM', 'block_sparse_moe', ('w1', 'w3', 'w2'))
    """
    try:
        return FAMILIES[model_type]
    except (KeyError, TypeError):
        raise ConfigError(
            f"model_type {model_type!r} is not supported; supported: {_supported()}"
        ) from None


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~jaxops.models.DecoderConfig` keywords of a config.json dict.

    The keys every family shares and the family's own (:attr:`Family.read`, which names the
    specs' fields), composed into the specs (``attention``, ``moe``, ``pattern``, ``rope``).

    Raises:
      ConfigError: an unsupported model_type, feature or key value (naming it), a missing or
        mistyped key.
    """
    if not isinstance(hf, dict):
        raise ConfigError(f"config.json must hold an object, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    inner = _WRAPPED.get(model_type)
    if inner is not None:  # a published wrapper (multimodal Llama 4): its text model
        read_quantization(hf)
        key = inner.wrapper.config_key
        text = hf.get(key)
        if not isinstance(text, dict):
            raise ConfigError(
                f"config.json: model_type {model_type!r} needs a {key} object (the language "
                f"model's keys), got {type(text).__name__}"
            )
        return config_fields({**text, "model_type": inner.model_type})
    if model_type not in FAMILIES:
        raise ConfigError(
            f"config.json: model_type {model_type!r} is not supported; supported: {_supported()}"
        )
    fam = FAMILIES[model_type]
    read_quantization(hf)  # FP8 block and MXFP4 checkpoints load; others are refused by name
    act = get(hf, "hidden_act", str, "silu")
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act {act!r} is not supported; supported: silu")
    hidden = positive(hf, "hidden_size")
    heads = positive(hf, "num_attention_heads")
    layers = positive(hf, "num_hidden_layers")
    head_dim = get(hf, "head_dim", int, fam.head_dim)
    if head_dim is None and not fam.mla:
        if hidden % heads:
            raise ConfigError(
                f"config.json: hidden_size ({hidden}) is not a multiple of "
                f"num_attention_heads ({heads}) and no head_dim is given"
            )
        head_dim = hidden // heads
    kw = fam.read(hf, Shape(hidden, heads, layers, head_dim))
    head_dim = kw.pop("head_dim", head_dim)
    if kw.get("dense_layers"):
        kw["dense_ffn"] = positive(hf, fam.dense_ffn_key, fam.dense_ffn)
    interleave = fam.interleave == "always" or (
        fam.interleave == "key" and get(hf, "rope_interleave", bool, True)
    )
    rope_hf = hf if fam.rope_keys is None else fam.rope_keys(hf, head_dim)
    return compose(
        dict(
            model_type=model_type,
            vocab_size=positive(hf, "vocab_size"),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=positive(hf, "num_key_value_heads", fam.kv_heads or heads),
            head_dim=head_dim,
            rms_norm_eps=get(hf, "rms_norm_eps", float, fam.rms_norm_eps),
            rope=_read_rope(fam, rope_hf, head_dim, interleave),
            tie_word_embeddings=get(hf, "tie_word_embeddings", bool, fam.tie_word_embeddings),
            mtp_layers=_mtp_layers(hf, fam),
            hf=dict(hf),
            **_moe_keys(hf, fam),
            **kw,
        )
    )


def _mtp_layers(hf: dict[str, Any], fam: Family) -> int:
    """The multi-token-prediction layers config.json announces (0: the family has none)."""
    if fam.mtp_key is None:
        return 0
    n = get(hf, fam.mtp_key, int, fam.mtp_default)
    if n < 0:
        raise ConfigError(f"config.json: {fam.mtp_key} must be >= 0, got {n}")
    return n


def _moe_keys(hf: dict[str, Any], fam: Family) -> dict[str, Any]:
    """The MoE keys every family reads alike: experts per token, the load-balancing weight."""
    return dict(
        top_k=positive(hf, fam.top_k_key, ... if fam.top_k is None else fam.top_k),
        router_aux_loss_coef=get(hf, "router_aux_loss_coef", float, fam.aux_loss_coef),
    )


def moe_layers(hf: dict[str, Any], layers: int) -> tuple[MoESpec, tuple[int, ...]]:
    """The MoE spec of a config.json's MoE layers, and which of its first `layers` layers are.

    What one MoE block needs (``jaxops.models.moe_block_config``), read as :func:`config_fields`
    reads it (the family's ``read``) from a config.json that may hold the MoE keys only: the
    attention's keys take placeholders where absent, and the layer count is `layers` where the
    file has fewer or none.

    Raises:
      ConfigError: an unsupported model_type or MoE feature, a missing or mistyped key.
    """
    fam = family(hf.get("model_type"))
    act = get(hf, "hidden_act", str, "silu")
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act {act!r} is not supported; supported: silu")
    hidden = positive(hf, "hidden_size", 1)
    layers = max(layers, get(hf, "num_hidden_layers", int, 1))
    kw = fam.read(hf, Shape(hidden, 1, layers, hidden))  # one head of the whole width
    spec = {k: v for k, v in kw.items() if k in SPEC_FIELDS["moe"]}
    moe = compose({**_moe_keys(hf, fam), **spec})["moe"]
    dense = kw.get("dense_layers", ())
    return moe, tuple(i for i in range(layers) if i not in dense)


def _read_rope(fam: Family, hf: dict[str, Any], head_dim: int, interleave: bool) -> Rope:
    rope = read_rope(
        hf,
        head_dim,
        fam.rope_theta,
        default_max_positions=fam.max_positions,
        interleave=interleave,
    )
    if rope.partial_rotary_factor != 1.0 and not fam.partial_rotary:
        raise ConfigError(
            f"config.json: partial_rotary_factor = {rope.partial_rotary_factor} is not supported "
            f"for {fam.model_type} (transformers rotates its whole head); only 1.0"
        )
    return rope


def hf_keys(c: Any, out: dict[str, Any]) -> dict[str, Any]:
    """`out` (the config dict read, if any) with the keys of config `c` written.

    The inverse of :func:`config_fields`: the keys every family shares, then the family's own
    (:attr:`Family.write`), as transformers' configuration class of the model type reads them.
    """
    fam = family(c.model_type)
    a = c.attention
    out.pop("quantization_config", None)  # written back by save_pretrained when it quantizes
    out.update(
        model_type=c.model_type,
        architectures=[fam.architecture],
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        num_experts_per_tok=c.moe.top_k,
        hidden_act="silu",
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        router_aux_loss_coef=c.moe.router_aux_loss_coef,
    )
    for key in ("rope_theta", "rope_scaling", "partial_rotary_factor"):
        out.pop(key, None)  # all in rope_parameters
    out.update(rope_to_hf(c.rope))
    if c.pattern.dense_layers:
        out[fam.dense_ffn_key] = c.pattern.dense_ffn
    if fam.mtp_key is not None:
        out[fam.mtp_key] = c.mtp_layers
    fam.write(c, out)
    if len(out.get("layer_types") or []) != c.num_layers:
        out.pop("layer_types", None)  # stale (e.g. after a change of num_layers)
    return out
