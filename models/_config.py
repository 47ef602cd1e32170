"""The architecture of a Hugging Face MoE decoder, read from its ``config.json``."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
from pathlib import Path
from typing import Any

from jaxops.models._quant import read_quantization
from jaxops.models._rope import Rope, read_rope, rope_to_hf

from jaxops._errors import ConfigError, named_errors

__all__ = ["MODEL_TYPES", "QK_NORM_WIDTHS", "ConfigError", "DecoderConfig", "read_config"]

#: The ``model_type`` values :class:`DecoderConfig` reads (the decoder covers them end to end).
MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe")

_ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}


def _get(cfg: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise ConfigError(
                f"config.json: missing {key!r} (model_type {cfg.get('model_type')!r})"
            )
        return default
    value = cfg[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ConfigError(f"config.json: {key!r} must be {kinds[0].__name__}, got {value!r}")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds):
        raise ConfigError(f"config.json: {key!r} must be {kinds[0].__name__}, got {value!r}")
    return value


def _positive(cfg: dict[str, Any], key: str, default: Any = ...) -> int:
    value = _get(cfg, key, int, default)
    if value < 1:
        raise ConfigError(f"config.json: {key!r} must be >= 1, got {value}")
    return value


# transformers' defaults for keys a config.json leaves out: (rms_norm_eps, rope_theta).
_DEFAULTS = {
    "mixtral": (1e-5, 1e6),
    "qwen3_moe": (1e-6, 10000.0),
    "qwen2_moe": (1e-6, 10000.0),
    "olmoe": (1e-5, 10000.0),
}
# transformers' num_key_value_heads when config.json has none (None: num_attention_heads).
_KV_HEADS = {"mixtral": 8, "qwen3_moe": 4, "qwen2_moe": 16, "olmoe": None}
# transformers' router_aux_loss_coef when config.json has none.
_AUX_COEF = {"mixtral": 1e-3, "qwen3_moe": 1e-3, "qwen2_moe": 1e-3, "olmoe": 1e-2}
#: How :attr:`DecoderConfig.qk_norm` normalizes: each head (Qwen3) or the whole projection (OLMoE).
QK_NORM_WIDTHS = ("head", "projection")


# transformers' max_position_embeddings when config.json has none (the "dynamic" RoPE's length,
# and "yarn" / "llama3"'s original length when their parameters have none).
_MAX_POSITIONS = {"mixtral": 131072, "qwen3_moe": 32768, "qwen2_moe": 32768, "olmoe": 4096}
_DEFAULT_ROPE = Rope()


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only MoE transformer: Mixtral, Qwen3-MoE, Qwen2-MoE or OLMoE.

    Every layer is ``h += attention(rms_norm(h))`` then ``h += moe(rms_norm(h))`` with GQA
    attention (rotary embeddings in the rotate-half layout: :class:`Rope`, default or scaled as
    "linear", "dynamic", "yarn", "llama3"; an optional causal sliding window,
    Qwen3's per-head or OLMoE's whole-projection q/k RMSNorm, Qwen2's q/k/v biases) and the
    expert-parallel MoE layer
    (SwiGLU experts; Qwen2-MoE adds a gated shared expert). Build it with :meth:`from_hf`.

    Attributes:
      model_type: one of :data:`MODEL_TYPES`.
      vocab_size: V.
      hidden_size: D.
      num_layers: L.
      num_heads: query heads.
      num_kv_heads: key/value heads (GQA; divides num_heads).
      head_dim: per-head width.
      num_experts: E routed experts per layer.
      top_k: experts per token.
      expert_ffn: each routed expert's inner width.
      normalize_topk: renormalize the k router weights (Mixtral always; Qwen and OLMoE
        ``norm_topk_prob``).
      shared_ffn: the shared expert's inner width (Qwen2-MoE), 0 for none.
      qk_norm: an RMSNorm of the queries and keys before RoPE (Qwen3, OLMoE); see
        `qk_norm_width`.
      qkv_bias: biases on the q, k and v projections (Qwen2; Qwen3 and OLMoE ``attention_bias``).
      o_bias: a bias on the output projection (Qwen3 and OLMoE ``attention_bias``).
      rms_norm_eps: epsilon of every RMSNorm.
      rope: the rotary embedding (``jaxops.models._rope.Rope``) of the whole head in the
        rotate-half layout (these model types have no partial or interleaved RoPE). A number in
        this place (the former ``rope_theta`` positional argument) is the default RoPE with that
        base. The keyword ``rope_theta=`` (kept, not deprecated: the one parameter of the default
        RoPE) sets the base of `rope`, or of the default RoPE when `rope` is not given, so
        ``dataclasses.replace(config, rope_theta=...)`` keeps the scaling; ``config.rope_theta``
        reads ``config.rope.theta``.
      sliding_window: causal attention over the last this many positions (None: all).
      tie_word_embeddings: the output projection is the embedding table transposed.
      router_aux_loss_coef: weight of the load-balancing loss (the config's own key). The loss
        weighted is the sum over layers of each layer's Switch-style loss (normalized by tokens
        times top_k), always added in training; transformers adds one loss over all layers
        (normalized by tokens times layers) and only with ``output_router_logits``, so the same
        coefficient weighs it differently (about num_layers / top_k times transformers' term).
      hf: the config.json dict it came from (written back by ``save_pretrained``), not compared.
      qk_norm_width: what the q/k RMSNorm normalizes (one of :data:`QK_NORM_WIDTHS`): "head",
        each head over ``head_dim`` with weights ``[Dh]`` (Qwen3); "projection", the whole
        q projection ``[Hq Dh]`` and k projection ``[Hkv Dh]`` before the split into heads, with
        weights of those widths (OLMoE).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_ffn: int
    normalize_topk: bool = True
    shared_ffn: int = 0
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope: Rope = _DEFAULT_ROPE
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 1e-3
    hf: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    qk_norm_width: str = "head"

    def __post_init__(self):
        op = "jaxops.models.DecoderConfig"
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(
                f"{op}: model_type must be one of {MODEL_TYPES}, got {self.model_type!r}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "num_experts", "top_k", "expert_ffn"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{op}: {name} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{op}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"{op}: top_k ({self.top_k}) must be <= num_experts ({self.num_experts})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"{op}: head_dim must be even for RoPE, got {self.head_dim}")
        if isinstance(self.rope, int | float) and not isinstance(self.rope, bool):
            object.__setattr__(self, "rope", Rope(theta=self.rope))
        if not isinstance(self.rope, Rope):
            raise ConfigError(f"{op}: rope must be a Rope, got {self.rope!r}")
        if self.rope.partial_rotary_factor != 1.0 or self.rope.interleave:
            raise ConfigError(
                f"{op}: rope must rotate the whole head in the rotate-half layout for "
                f"{self.model_type} (partial_rotary_factor 1.0, interleave False), got {self.rope}"
            )
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ConfigError(f"{op}: rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.qk_norm_width not in QK_NORM_WIDTHS:
            raise ConfigError(
                f"{op}: qk_norm_width must be one of {QK_NORM_WIDTHS}, got {self.qk_norm_width!r}"
            )
        if self.qk_norm_width != "head" and not self.qk_norm:
            raise ConfigError(f"{op}: qk_norm_width={self.qk_norm_width!r} needs qk_norm=True")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(
                f"{op}: sliding_window must be >= 1 or None, got {self.sliding_window}"
            )

    @property
    def rope_theta(self) -> float:
        """The RoPE base, ``rope.theta``."""
        return self.rope.theta

    @property
    def q_size(self) -> int:
        """Width of the query projection, ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection, ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    @named_errors("jaxops.models.DecoderConfig.from_hf")
    def from_hf(cls, hf: dict[str, Any]) -> DecoderConfig:
        """Reads a Hugging Face config dict (config.json of Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE).

        Raises:
          ConfigError (a ValueError): an unsupported model_type or feature (naming the key and
            what is supported), a missing or mistyped key.

        Example:
          >>> from jaxops.models import DecoderConfig
          >>> cfg = DecoderConfig.from_hf({
          ...     "model_type": "mixtral", "vocab_size": 128, "hidden_size": 64,
          ...     "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          ...     "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2})
          >>> cfg.head_dim, cfg.kv_size, cfg.num_experts, cfg.normalize_topk
          (16, 32, 8, True)
        """
        if not isinstance(hf, dict):
            raise ConfigError(f"config.json must hold an object, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"config.json: model_type {model_type!r} is not supported; supported: "
                f"{', '.join(MODEL_TYPES)} (DeepSeek-V3's MoE block: "
                "jaxops.models.moe_block_config)"
            )
        read_quantization(hf)  # FP8 block checkpoints load; others are refused by name
        act = _get(hf, "hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"config.json: hidden_act {act!r} is not supported; supported: silu")
        hidden = _positive(hf, "hidden_size")
        heads = _positive(hf, "num_attention_heads")
        head_dim = _get(hf, "head_dim", int, None)
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(
                    f"config.json: hidden_size ({hidden}) is not a multiple of "
                    f"num_attention_heads ({heads}) and no head_dim is given"
                )
            head_dim = hidden // heads
        kw: dict[str, Any] = {}
        if model_type == "mixtral":
            experts = _positive(hf, "num_local_experts")
            kw["expert_ffn"] = _positive(hf, "intermediate_size")
            kw["normalize_topk"] = True
            jitter = _get(hf, "router_jitter_noise", float, 0.0)
            if jitter:
                raise ConfigError(
                    f"config.json: router_jitter_noise = {jitter} is not supported (only 0.0)"
                )
            kw["sliding_window"] = _get(hf, "sliding_window", int, None)
        elif model_type == "olmoe":
            experts = _positive(hf, _experts_key(hf))
            kw["expert_ffn"] = _positive(hf, "intermediate_size")
            kw["normalize_topk"] = _get(hf, "norm_topk_prob", bool, False)
            clip = _get(hf, "clip_qkv", float, None)
            if clip is not None:
                raise ConfigError(
                    f"config.json: clip_qkv = {clip} is not supported for olmoe; only null"
                )
            if head_dim * heads != hidden:
                raise ConfigError(
                    f"config.json: head_dim = {head_dim} is not supported for olmoe: "
                    f"transformers' q/k norms have hidden_size ({hidden}) / "
                    f"num_attention_heads ({heads}) per head"
                )
            kw["qk_norm"], kw["qk_norm_width"] = True, "projection"
            kw["qkv_bias"] = kw["o_bias"] = _get(hf, "attention_bias", bool, False)
        else:
            experts = _positive(hf, _experts_key(hf))
            kw["expert_ffn"] = _positive(hf, "moe_intermediate_size")
            kw["normalize_topk"] = _get(hf, "norm_topk_prob", bool, False)
            if _get(hf, "decoder_sparse_step", int, 1) != 1 or _get(
                hf, "mlp_only_layers", list, []
            ):
                raise ConfigError(
                    "config.json: decoder_sparse_step != 1 or a non-empty mlp_only_layers (dense "
                    "layers between MoE layers) is not supported; every layer must be MoE"
                )
            if _get(hf, "use_sliding_window", bool, False):
                raise ConfigError(
                    "config.json: use_sliding_window = true is not supported for "
                    f"{model_type} (its per-layer windows); only false"
                )
            if model_type == "qwen3_moe":
                kw["qk_norm"] = True
                bias = _get(hf, "attention_bias", bool, False)
                kw["qkv_bias"] = kw["o_bias"] = bias
            else:
                kw["qkv_bias"] = _get(hf, "qkv_bias", bool, True)
                kw["shared_ffn"] = _get(hf, "shared_expert_intermediate_size", int, 5632)
        return cls(
            model_type=model_type,
            vocab_size=_positive(hf, "vocab_size"),
            hidden_size=hidden,
            num_layers=_positive(hf, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_positive(hf, "num_key_value_heads", _KV_HEADS[model_type] or heads),
            head_dim=head_dim,
            num_experts=experts,
            top_k=_positive(hf, "num_experts_per_tok"),
            rms_norm_eps=_get(hf, "rms_norm_eps", float, _DEFAULTS[model_type][0]),
            rope=_read_rope(hf, model_type, head_dim),
            tie_word_embeddings=_get(hf, "tie_word_embeddings", bool, False),
            router_aux_loss_coef=_get(hf, "router_aux_loss_coef", float, _AUX_COEF[model_type]),
            hf=dict(hf),
            **kw,
        )

    @named_errors("jaxops.models.DecoderConfig.to_hf")
    def to_hf(self, dtype: Any = None) -> dict[str, Any]:
        """The config.json dict: the one read (if any) with this config's values and `dtype`.

        Example:
          >>> from jaxops.models import DecoderConfig
          >>> cfg = DecoderConfig("qwen3_moe", 128, 64, 2, 4, 2, 16, 8, 2, 32, qk_norm=True)
          >>> d = cfg.to_hf("bfloat16")
          >>> d["architectures"], d["num_experts"], d["dtype"], DecoderConfig.from_hf(d) == cfg
          (['Qwen3MoeForCausalLM'], 8, 'bfloat16', True)
        """
        out = dict(self.hf)
        # The weights this config describes are not quantized (save_pretrained adds a
        # quantization_config back when it writes quantized files).
        out.pop("quantization_config", None)
        out.update(
            model_type=self.model_type,
            architectures=[_ARCHITECTURES[self.model_type]],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            num_experts_per_tok=self.top_k,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            router_aux_loss_coef=self.router_aux_loss_coef,
        )
        for key in ("rope_theta", "rope_scaling", "partial_rotary_factor"):
            out.pop(key, None)  # all in rope_parameters
        out.update(rope_to_hf(self.rope))
        if self.model_type == "mixtral":
            out.update(
                num_local_experts=self.num_experts,
                intermediate_size=self.expert_ffn,
                sliding_window=self.sliding_window,
            )
        elif self.model_type == "olmoe":
            out.update(
                num_experts=self.num_experts,
                intermediate_size=self.expert_ffn,
                norm_topk_prob=self.normalize_topk,
                attention_bias=self.qkv_bias,
                clip_qkv=None,
            )
            out.pop("num_local_experts", None)
            out.pop("head_dim", None)  # transformers' q/k norms assume hidden_size / heads
        else:
            out.update(
                num_experts=self.num_experts,
                moe_intermediate_size=self.expert_ffn,
                norm_topk_prob=self.normalize_topk,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                use_sliding_window=False,
            )
            out.pop("num_local_experts", None)
            if self.model_type == "qwen3_moe":
                out["attention_bias"] = self.qkv_bias
            else:
                out["qkv_bias"] = self.qkv_bias
                out["shared_expert_intermediate_size"] = self.shared_ffn
        if len(out.get("layer_types") or []) != self.num_layers:
            out.pop("layer_types", None)  # stale (e.g. after a change of num_layers)
        if dtype is not None:
            import numpy as np

            name = np.dtype(dtype).name
            out["dtype"] = name
            out.pop("torch_dtype", None)
        # transformers builds the model from these keys: they must say this config exactly.
        back = DecoderConfig.from_hf(out)
        wrong = [
            f"{f.name}={getattr(self, f.name)!r} (as {self.model_type}: {getattr(back, f.name)!r})"
            for f in dataclasses.fields(self)
            if f.compare and getattr(self, f.name) != getattr(back, f.name)
        ]
        if wrong:
            raise ConfigError(
                f"jaxops.models.DecoderConfig.to_hf: {self.model_type} cannot express "
                f"{', '.join(wrong)}; "
                "transformers would build another model (qwen3_moe has q/k norms and no shared "
                "expert; mixtral renormalizes the top-k weights and has no shared expert or "
                "biases; qwen2_moe has no q/k norms; olmoe has whole-projection q/k norms, "
                "head_dim = hidden_size / num_attention_heads, no shared expert and no sliding "
                "window)"
            )
        return out


def _experts_key(hf: dict[str, Any]) -> str:
    """The key of the routed expert count: num_experts, or its alias num_local_experts."""
    # transformers 5 writes num_local_experts for Qwen too (num_experts is its alias).
    key = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
    return key if hf.get(key) is not None else "num_experts"


def _read_rope(hf: dict[str, Any], model_type: str, head_dim: int) -> Rope:
    rope = read_rope(
        hf, head_dim, _DEFAULTS[model_type][1], default_max_positions=_MAX_POSITIONS[model_type]
    )
    if rope.partial_rotary_factor != 1.0:
        raise ConfigError(
            f"config.json: partial_rotary_factor = {rope.partial_rotary_factor} is not supported "
            f"for {model_type} (transformers rotates its whole head); only 1.0"
        )
    return rope


def _rope_theta_keyword(cls: type) -> type:
    """The constructor of `cls` also takes ``rope_theta=``: the base of its ``rope``."""
    init = cls.__init__
    at = [f.name for f in dataclasses.fields(cls)].index("rope")

    def __init__(self, *args: Any, rope_theta: float | None = None, **kwargs: Any) -> None:
        if rope_theta is not None:
            args = list(args)
            given = args[at] if len(args) > at else kwargs.get("rope", Rope())
            if not isinstance(given, Rope):
                raise ConfigError(
                    f"jaxops.models.DecoderConfig: rope_theta= needs rope to be a Rope, got "
                    f"{given!r}"
                )
            rope = dataclasses.replace(given, theta=rope_theta)
            if len(args) > at:
                args[at] = rope
            else:
                kwargs["rope"] = rope
        init(self, *args, **kwargs)

    sig = inspect.signature(init)
    theta = inspect.Parameter("rope_theta", inspect.Parameter.KEYWORD_ONLY, default=None)
    __init__.__signature__ = sig.replace(parameters=[*sig.parameters.values(), theta])
    __init__.__doc__ = init.__doc__
    cls.__init__ = __init__
    return cls


_rope_theta_keyword(DecoderConfig)


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
