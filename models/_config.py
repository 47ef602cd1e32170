"""The architecture of a Hugging Face MoE decoder, read from its ``config.json``."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

from jaxops.parallel.expert import MoESpec

from jaxops._errors import ArgumentTypeError, ConfigError, named_errors

from ._families import FAMILIES, MODEL_TYPES, config_fields, family, hf_keys
from ._rope import Rope, rotary_dim
from ._spec import (
    LAYER_TYPES,
    QK_NORM_WIDTHS,
    SPEC_FIELDS,
    AttentionSpec,
    LayerPattern,
    Mla,
    compose,
)

__all__ = [
    "ACTIVATIONS",
    "LAYER_TYPES",
    "MODEL_TYPES",
    "QK_NORM_WIDTHS",
    "ROUTERS",
    "AttentionSpec",
    "ConfigError",
    "DecoderConfig",
    "LayerPattern",
    "Mla",
    "MoESpec",
    "read_config",
]

#: The router's scores: softmax (Mixtral, Qwen, OLMoE) or sigmoid (GLM-4.5, DeepSeek-V3).
ROUTERS = ("softmax", "sigmoid")
#: The experts' activation: SwiGLU, or gpt-oss's clamped SwiGLU (gate and up interleaved).
ACTIVATIONS = ("swiglu", "clamped_swiglu")
_DEFAULT_ROPE = Rope()
_NO_PATTERN = LayerPattern()


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only MoE transformer (every model type of :data:`MODEL_TYPES`).

    Every layer is ``h += attention(rms_norm(h))`` then ``h += ffn(rms_norm(h))``. The attention
    (:class:`AttentionSpec`) is grouped-query attention (rotary embeddings in the rotate-half
    layout: :class:`Rope`, default or scaled as "linear", "dynamic", "yarn", "llama3", rotating
    the whole head or, GLM and MiniMax-M2, its first part; per-layer sliding windows, attention
    chunks and NoPE layers; Qwen3's and GLM's per-head, OLMoE's and MiniMax-M2's
    whole-projection q/k RMSNorm, Llama 4's L2 q/k norm; q/k/v/o biases; gpt-oss's attention
    sinks) or DeepSeek's multi-head latent attention (:class:`Mla`, interleaved RoPE pairs;
    ERNIE and Llama 4 interleave too). The ffn is the expert-parallel MoE layer
    (:class:`~jaxops.parallel.expert.MoESpec`: SwiGLU or gpt-oss's clamped SwiGLU experts,
    optionally with biases; softmax or sigmoid routing, a logit bias, a correction bias for the
    choice, group-limited choice, Llama 4's input weighting; shared experts, gated in
    Qwen2-MoE) or, in the pattern's dense layers (:class:`LayerPattern`), a dense SwiGLU MLP.
    Build it with :meth:`from_hf`.

    The configuration is composed of specs: `attention`, `moe`, `rope` and `pattern` hold the
    architecture of every layer; how the model runs (mesh axes, dtype, FP8 recipe, impl,
    remat, ZeRO, microbatches) is :class:`~jaxops.models.MoEDecoder`'s. The former flat fields
    (``num_heads``, ``num_experts``, ``dense_layers``, ... : each spec's fields) still work
    for one release, with a DeprecationWarning: as keywords (and the former positional order
    ``model_type, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
    num_experts, top_k, expert_ffn``), which build or replace the specs with the former
    defaults, and as attributes (``config.num_heads`` reads ``config.attention.num_heads``).

    Attributes:
      model_type: one of :data:`MODEL_TYPES`.
      vocab_size: V.
      hidden_size: D.
      num_layers: L.
      attention: every layer's attention (:class:`AttentionSpec`).
      moe: the MoE layers' spec (:class:`~jaxops.parallel.expert.MoESpec`; its
        ``router_aux_loss_coef`` is the config's own key: GLM and DeepSeek default to 0, they
        balance with the correction bias, ``jaxops.parallel.expert.update_router_bias``). The
        loss weighted is the sum over MoE layers of each layer's Switch-style loss (normalized
        by tokens times top_k), always added in training; transformers adds one loss over all
        layers (normalized by tokens times layers) and only with ``output_router_logits``, so
        the same coefficient weighs it differently (about num_layers / top_k times
        transformers' term).
      rope: the rotary embedding (:class:`Rope`). Partial rotation (``partial_rotary_factor``)
        is GLM's and MiniMax-M2's, interleaved pairs DeepSeek's, ERNIE's and Llama 4's; the
        other model types rotate the whole head in the rotate-half layout. A number in this
        place is the default RoPE with that base. The keyword ``rope_theta=`` sets the base of
        `rope`, or of the default RoPE when `rope` is not given, so
        ``dataclasses.replace(config, rope_theta=...)`` keeps the scaling;
        ``config.rope_theta`` reads ``config.rope.theta``.
      pattern: the layers that differ (:class:`LayerPattern`: dense layers, attention kinds,
        NoPE layers), checked against `num_layers`.
      rms_norm_eps: epsilon of every RMSNorm (MLA's two inner norms: 1e-6, as transformers).
      tie_word_embeddings: the output projection is the embedding table transposed.
      mtp_layers: D, the multi-token-prediction modules after the last layer (DeepSeek-V3's
        and GLM-4.5's ``num_nextn_predict_layers``; 0: none). Depth k (1..D) predicts token
        ``i + k + 1`` at position i from depth k - 1's output (the trunk's after its final
        norm for k = 1) and the embedding of token ``i + k``: ``eh_proj [enorm(emb) ;
        hnorm(h)]``, one MoE decoder layer, ``head_norm``, then the shared output head
        (:mod:`~jaxops.models._mtp`). Held as the parameters ``mtp``, loaded and saved under
        the published names ``model.layers.{num_layers + k - 1}.*``.
      hf: the config.json dict it came from (written back by ``save_pretrained``), not compared.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    attention: AttentionSpec
    moe: MoESpec
    rope: Rope = _DEFAULT_ROPE
    pattern: LayerPattern = _NO_PATTERN
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    mtp_layers: int = 0
    hf: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        op = "jaxops.models.DecoderConfig"
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(
                f"{op}: model_type must be one of {MODEL_TYPES}, got {self.model_type!r}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{op}: {name} must be an int >= 1, got {value!r}")
        n = self.mtp_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"{op}: mtp_layers must be an int >= 0, got {n!r}")
        for name, kind in (
            ("attention", AttentionSpec), ("moe", MoESpec), ("pattern", LayerPattern)
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ArgumentTypeError(
                    f"{op}: {name} must be a {kind.__name__}, got {type(value).__name__}"
                )
        if isinstance(self.rope, int | float) and not isinstance(self.rope, bool):
            object.__setattr__(self, "rope", Rope(theta=self.rope))
        if not isinstance(self.rope, Rope):
            raise ConfigError(f"{op}: rope must be a Rope, got {self.rope!r}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ConfigError(f"{op}: rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.moe.activation not in ACTIVATIONS:
            raise ConfigError(
                f"{op}: moe.activation must be one of {ACTIVATIONS}, got {self.moe.activation!r}"
            )
        self._check_family(op)
        self._check_pattern(op)

    def _check_family(self, op: str) -> None:
        fam = family(self.model_type)
        rope = self.rope
        if rope.partial_rotary_factor != 1.0 and not fam.partial_rotary:
            partial = ", ".join(m for m, f in FAMILIES.items() if f.partial_rotary)
            raise ConfigError(
                f"{op}: rope must rotate the whole head for {self.model_type} "
                f"(partial_rotary_factor 1.0; only {partial} rotate part), got {rope}"
            )
        if rope.interleave and fam.interleave == "never":
            interleaved = ", ".join(m for m, f in FAMILIES.items() if f.interleave != "never")
            raise ConfigError(
                f"{op}: rope must use the rotate-half layout for {self.model_type} (interleave "
                f"False; only {interleaved} interleave), got {rope}"
            )
        if not rope.interleave and fam.interleave == "always":
            raise ConfigError(f"{op}: {self.model_type} rotates interleaved pairs; got {rope}")
        rotary_dim(rope, self.attention.head_dim)  # an even rotated width
        if self.mtp_layers and fam.mtp_key is None:
            mtp = ", ".join(t for t, f in FAMILIES.items() if f.mtp_key is not None)
            raise ConfigError(
                f"{op}: mtp_layers (multi-token prediction) is built for {mtp} only (their "
                f"published layout); got mtp_layers={self.mtp_layers} for {self.model_type}"
            )
        m = self.attention.mla
        if (m is not None) != fam.mla:
            mla = ", ".join(t for t, f in FAMILIES.items() if f.mla)
            raise ConfigError(
                f"{op}: mla (multi-head latent attention) is {mla}'s and {mla} needs "
                f"it; got model_type {self.model_type!r} with mla={m!r}"
            )

    def _check_pattern(self, op: str) -> None:
        p, n = self.pattern, self.num_layers
        for name in ("dense_layers", "nope_layers"):
            value = getattr(p, name)
            if any(i >= n for i in value):
                raise ConfigError(
                    f"{op}: {name} must be distinct sorted indices in [0, {n}), got {value}"
                )
        if len(p.dense_layers) == n:
            raise ConfigError(
                f"{op}: dense_layers {p.dense_layers} leave no MoE layer; at least one is"
            )
        types = p.layer_types
        if types and len(types) != n:
            raise ConfigError(f"{op}: layer_types has {len(types)} entries; num_layers = {n}")
        a = self.attention
        needs = (
            ("sliding_attention", a.sliding_window, "sliding_window"),
            ("chunked_attention", a.attention_chunk_size, "attention_chunk_size"),
        )
        for kind, value, name in needs:
            if kind in types and value is None:
                raise ConfigError(f"{op}: layer_types has {kind!r} layers but {name} is None")
        if a.mla is not None and (p.nope_layers or types):
            raise ConfigError(
                f"{op}: mla takes no pattern.nope_layers or pattern.layer_types; got "
                f"{p.nope_layers}, {types}"
            )

    @property
    def layer_attention(self) -> tuple[tuple[int | None, int | None, bool], ...]:
        """Per layer ``(window, chunk, rope)``: its attention pattern.

        Its sliding window and attention chunk (None: none) and whether it applies RoPE, from
        `layer_types`, `sliding_window`, `attention_chunk_size` and `nope_layers`.
        """
        p, a = self.pattern, self.attention
        nope = set(p.nope_layers)
        out = []
        for i in range(self.num_layers):
            kind = p.layer_types[i] if p.layer_types else None
            window = a.sliding_window if kind in (None, "sliding_attention") else None
            chunk = a.attention_chunk_size if kind == "chunked_attention" else None
            out.append((window, chunk, i not in nope))
        return tuple(out)

    @property
    def rope_theta(self) -> float:
        """The RoPE base, ``rope.theta``."""
        return self.rope.theta

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The MoE layers' indices (every layer not in `dense_layers`)."""
        dense = set(self.pattern.dense_layers)
        return tuple(i for i in range(self.num_layers) if i not in dense)

    @classmethod
    @named_errors("jaxops.models.DecoderConfig.from_hf")
    def from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        """Reads a Hugging Face config dict (config.json of one of :data:`MODEL_TYPES`).

        Keys a file leaves out take the defaults of transformers' configuration class of the
        model type.

        Raises:
          ConfigError (a ValueError): an unsupported model_type or feature (naming the key and
            what is supported), a missing or mistyped key.

        Example:
          >>> from jaxops.models import DecoderConfig
          >>> cfg = DecoderConfig.from_hf({
          ...     "model_type": "mixtral", "vocab_size": 128, "hidden_size": 64,
          ...     "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          ...     "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2})
          >>> cfg.attention.head_dim, cfg.attention.kv_size, cfg.moe.num_experts
          (16, 32, 8)
        """
        return cls(**config_fields(hf))

    @named_errors("jaxops.models.DecoderConfig.to_hf")
    def to_hf(self, dtype: Any = None) -> dict[str, Any]:
        """The config.json dict: the one read (if any) with this config's values and `dtype`.

        Example:
          >>> from jaxops.models import DecoderConfig
          >>> from jaxops.models import AttentionSpec, MoESpec
          >>> cfg = DecoderConfig(
          ...     "qwen3_moe", vocab_size=128, hidden_size=64, num_layers=2,
          ...     attention=AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True),
          ...     moe=MoESpec(num_experts=8, top_k=2, expert_ffn=32))
          >>> d = cfg.to_hf("bfloat16")
          >>> d["architectures"], d["num_experts"], d["dtype"], DecoderConfig.from_hf(d) == cfg
          (['Qwen3MoeForCausalLM'], 8, 'bfloat16', True)
        """
        out = hf_keys(self, dict(self.hf))
        if dtype is not None:
            import numpy as np

            name = np.dtype(dtype).name
            out["dtype"] = name
            out.pop("torch_dtype", None)
        # transformers builds the model from these keys: they must say this config exactly.
        try:
            back = DecoderConfig.from_hf(out)
        except ConfigError as e:
            back, why = None, str(e)
        wrong = (
            [f"this config ({why})"]
            if back is None
            else [
                f"{k}={mine!r} (as {self.model_type}: {theirs!r})"
                for k, mine, theirs in _differences(self, back)
            ]
        )
        if wrong:
            raise ConfigError(
                f"jaxops.models.DecoderConfig.to_hf: {self.model_type} cannot express "
                f"{', '.join(wrong)}; transformers would build another model ("
                + "; ".join(f.description for f in FAMILIES.values())
                + ")"
            )
        return out


def _differences(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted field, a's value, b's value)`` where two configs differ (into the specs)."""
    out = []
    for f in dataclasses.fields(a):
        mine, theirs = getattr(a, f.name), getattr(b, f.name)
        if not f.compare or mine == theirs:
            continue
        if f.name in SPEC_FIELDS:
            out += _differences(mine, theirs, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, mine, theirs))
    return out


#: The former flat fields, in the former positional order (after num_layers).
_FORMER_ORDER = (
    *("model_type", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"),
    *("head_dim", "num_experts", "top_k", "expert_ffn", "normalize_topk", "shared_ffn"),
    *("qk_norm", "qkv_bias", "o_bias", "rms_norm_eps", "rope", "sliding_window"),
    *("tie_word_embeddings", "router_aux_loss_coef"),
)
#: The former flat fields' defaults where the specs' differ.
_FORMER_DEFAULTS = {"router_aux_loss_coef": 1e-3}
#: Former flat attribute -> where it is now (``"attention.num_heads"``).
MOVED = {
    **{name: f"{holder}.{name}" for holder, names in SPEC_FIELDS.items() for name in names},
    **{name: f"attention.{name}" for name in ("qk_head_dim", "v_head_dim", "q_size", "kv_size")},
}


def _composed(cls: type) -> type:
    """`cls` (DecoderConfig) also takes ``rope_theta=`` and, deprecated, the former flat fields.

    The flat keywords (and the former positional order) build or replace the specs with the
    former defaults (shared_gate with a shared expert, router_aux_loss_coef 1e-3); reading a
    former flat attribute reads it in its spec. Both with a DeprecationWarning.
    """
    init = cls.__init__
    op = "jaxops.models.DecoderConfig"
    at = [f.name for f in dataclasses.fields(cls)].index("rope")

    def __init__(self, *args: Any, rope_theta: float | None = None, **kwargs: Any) -> None:
        if len(args) > 4 and isinstance(args[4], int) and not isinstance(args[4], bool):
            if len(args) > len(_FORMER_ORDER):  # the former order: num_heads, ...
                raise ArgumentTypeError(f"{op}: too many positional arguments ({len(args)})")
            kwargs.update(zip(_FORMER_ORDER[4:], args[4:], strict=False))
            args = args[:4]
        flat = sorted(k for k in kwargs if k in MOVED)
        if flat:
            warnings.warn(
                f"{op}: the flat keywords {', '.join(flat)} moved into the specs "
                f"({', '.join(MOVED[k] for k in flat)}) and go in the next release; give "
                "attention=AttentionSpec(...), moe=MoESpec(...), pattern=LayerPattern(...)",
                DeprecationWarning,
                stacklevel=3,
            )
            defaults = dict(_FORMER_DEFAULTS)
            defaults["shared_gate"] = kwargs.get("shared_ffn", 0) > 0 and "moe" not in kwargs
            kwargs = compose(kwargs, defaults)
        if rope_theta is not None:
            given = args[at] if len(args) > at else kwargs.get("rope", Rope())
            if not isinstance(given, Rope):
                raise ConfigError(f"{op}: rope_theta= needs rope to be a Rope, got {given!r}")
            rope = dataclasses.replace(given, theta=rope_theta)
            if len(args) > at:
                args = (*args[:at], rope, *args[at + 1 :])
            else:
                kwargs["rope"] = rope
        init(self, *args, **kwargs)

    sig = inspect.signature(init)
    theta = inspect.Parameter("rope_theta", inspect.Parameter.KEYWORD_ONLY, default=None)
    __init__.__signature__ = sig.replace(parameters=[*sig.parameters.values(), theta])
    __init__.__doc__ = init.__doc__
    cls.__init__ = named_errors(op)(__init__)
    for old, new in MOVED.items():

        def getter(self: Any, _old: str = old, _new: str = new) -> Any:
            warnings.warn(
                f"{op}.{_old} moved to {_new} and the old name goes in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            holder, name = _new.split(".")
            return getattr(getattr(self, holder), name)

        setattr(cls, old, property(getter, doc=f"Deprecated: :attr:`{new}`."))
    return cls


_composed(DecoderConfig)


@named_errors("jaxops.models.read_config")
def read_config(path: str | os.PathLike) -> DecoderConfig:
    """:class:`DecoderConfig` from a model directory's config.json (or the file itself)."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    try:
        hf = json.loads(f.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{f}: no config.json (a Hugging Face model directory has one)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f}: not valid JSON ({e})") from None
    try:
        return DecoderConfig.from_hf(hf)
    except ConfigError as e:
        raise ConfigError(f"{f}: {e}") from None
