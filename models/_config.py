"""The architecture of a Hugging Face MoE decoder, read from its ``config.json``."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
from pathlib import Path
from typing import Any

from jaxops._errors import ConfigError, named_errors

from ._families import FAMILIES, LAYER_TYPES, MODEL_TYPES, config_fields, family, hf_keys
from ._rope import Rope, rotary_dim
from ._spec import Mla

__all__ = [
    "ACTIVATIONS",
    "LAYER_TYPES",
    "MODEL_TYPES",
    "QK_NORM_WIDTHS",
    "ROUTERS",
    "ConfigError",
    "DecoderConfig",
    "Mla",
    "read_config",
]

#: How :attr:`DecoderConfig.qk_norm` normalizes: each head (Qwen3) or the whole projection (OLMoE).
QK_NORM_WIDTHS = ("head", "projection")
#: The router's scores: softmax (Mixtral, Qwen, OLMoE) or sigmoid (GLM-4.5, DeepSeek-V3).
ROUTERS = ("softmax", "sigmoid")
#: The experts' activation: SwiGLU, or gpt-oss's clamped SwiGLU (gate and up interleaved).
ACTIVATIONS = ("swiglu", "clamped_swiglu")
_DEFAULT_ROPE = Rope()


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only MoE transformer (every model type of :data:`MODEL_TYPES`).

    Every layer is ``h += attention(rms_norm(h))`` then ``h += ffn(rms_norm(h))``. The attention
    is grouped-query attention (rotary embeddings in the rotate-half layout: :class:`Rope`,
    default or scaled as "linear", "dynamic", "yarn", "llama3", rotating the whole head or, GLM
    and MiniMax-M2, its first part; per-layer sliding windows, attention chunks and NoPE layers;
    Qwen3's and GLM's per-head, OLMoE's and MiniMax-M2's whole-projection q/k RMSNorm, Llama
    4's L2 q/k norm; q/k/v/o biases; gpt-oss's attention sinks) or DeepSeek's multi-head latent
    attention (:class:`Mla`, interleaved RoPE pairs; ERNIE and Llama 4 interleave too). The ffn
    is the expert-parallel MoE layer (SwiGLU or gpt-oss's clamped SwiGLU experts, optionally
    with biases; softmax or sigmoid routing, a logit bias, a correction bias for the choice,
    group-limited choice, Llama 4's input weighting; shared experts, gated in Qwen2-MoE) or, in
    the `dense_layers`, a dense SwiGLU MLP. Build it with :meth:`from_hf`.

    Attributes:
      model_type: one of :data:`MODEL_TYPES`.
      vocab_size: V.
      hidden_size: D.
      num_layers: L.
      num_heads: query heads.
      num_kv_heads: key/value heads (GQA; divides num_heads; MLA: num_heads).
      head_dim: per-head width (MLA: the RoPE width ``mla.qk_rope_head_dim``, as transformers).
      num_experts: E routed experts per MoE layer.
      top_k: experts per token.
      expert_ffn: each routed expert's inner width.
      normalize_topk: renormalize the k router weights (Mixtral always; the others'
        ``norm_topk_prob``).
      shared_ffn: the shared experts' inner width (Qwen2-MoE's shared expert; GLM's and
        DeepSeek's ``n_shared_experts`` experts as one FFN), 0 for none.
      qk_norm: an RMSNorm of the queries and keys before RoPE (Qwen3, OLMoE, GLM
        ``use_qk_norm``); see `qk_norm_width`.
      qkv_bias: biases on the q, k and v projections (Qwen2; Qwen3, OLMoE and GLM
        ``attention_bias``).
      o_bias: a bias on the output projection (Qwen3 and OLMoE ``attention_bias``).
      rms_norm_eps: epsilon of every RMSNorm (MLA's two inner norms: 1e-6, as transformers).
      rope: the rotary embedding (``jaxops.models._rope.Rope``). Partial rotation
        (``partial_rotary_factor``) is GLM's, interleaved pairs DeepSeek's; the other model
        types rotate the whole head in the rotate-half layout. A number in this place (the former
        ``rope_theta`` positional argument) is the default RoPE with that base. The keyword
        ``rope_theta=`` (kept, not deprecated: the one parameter of the default RoPE) sets the
        base of `rope`, or of the default RoPE when `rope` is not given, so
        ``dataclasses.replace(config, rope_theta=...)`` keeps the scaling; ``config.rope_theta``
        reads ``config.rope.theta``.
      sliding_window: causal attention over the last this many positions (None: all).
      tie_word_embeddings: the output projection is the embedding table transposed.
      router_aux_loss_coef: weight of the load-balancing loss (the config's own key; GLM and
        DeepSeek default to 0: they balance with the correction bias,
        ``jaxops.parallel.expert.update_router_bias``). The loss weighted is the sum over MoE
        layers of each layer's Switch-style loss (normalized by tokens times top_k), always
        added in training; transformers adds one loss over all layers (normalized by tokens
        times layers) and only with ``output_router_logits``, so the same coefficient weighs it
        differently (about num_layers / top_k times transformers' term).
      hf: the config.json dict it came from (written back by ``save_pretrained``), not compared.
      qk_norm_width: what the q/k RMSNorm normalizes (one of :data:`QK_NORM_WIDTHS`): "head",
        each head over ``head_dim`` with weights ``[Dh]`` (Qwen3, GLM); "projection", the whole
        q projection ``[Hq Dh]`` and k projection ``[Hkv Dh]`` before the split into heads, with
        weights of those widths (OLMoE).
      dense_layers: the layers whose ffn is a dense SwiGLU MLP of width `dense_ffn` (sorted
        indices; DeepSeek's and GLM's first ``first_k_dense_replace``, Qwen's
        ``mlp_only_layers`` and the layers ``decoder_sparse_step`` skips, ERNIE's layers outside
        ``moe_layer_start_index`` .. ``moe_layer_end_index`` or off ``moe_layer_interval``).
        At least one layer stays MoE.
      dense_ffn: the dense MLP's inner width (``intermediate_size``); 0 without dense layers.
      router: the router's scores, one of :data:`ROUTERS`.
      router_bias: a float32 correction bias added to the scores for the choice only
        (``e_score_correction_bias``, GLM, DeepSeek and ERNIE; no gradient, see
        ``update_router_bias``).
      n_group: the experts form this many groups; each token chooses among its `topk_group`
        best groups (a group's score: the sum of its two best), DeepSeek-V3's group-limited
        routing. 1: no groups.
      topk_group: groups each token chooses from.
      routed_scaling_factor: the routed experts' weights are multiplied by it.
      shared_gate: the shared expert's output passes a sigmoid gate (Qwen2-MoE); GLM,
        DeepSeek and ERNIE add their shared experts as they are.
      mla: multi-head latent attention (DeepSeek-V3) instead of GQA, or None.
      layer_types: each layer's attention, one of :data:`LAYER_TYPES` per layer (gpt-oss,
        Llama 4): "full_attention" (causal), "sliding_attention" (causal within
        `sliding_window` time steps), "chunked_attention" (causal within each
        `attention_chunk_size` block of rotary positions: transformers' chunks count from the
        first real token). Empty: every layer "full_attention", windowed by `sliding_window`
        when it is set (Mixtral).
      attention_chunk_size: the chunk of the "chunked_attention" layers (Llama 4), or None.
      nope_layers: layers without rotary embedding (Llama 4's NoPE layers, transformers'
        ``no_rope_layers`` entries 0).
      attn_temperature_tuning: Llama 4: the queries of the NoPE layers are scaled by
        ``log1p(floor((t + 1) / floor_scale)) * attn_scale + 1`` at time step t.
      floor_scale: see `attn_temperature_tuning`.
      attn_scale: see `attn_temperature_tuning`.
      qk_l2_norm: Llama 4's ``use_qk_norm``: q and k of each head divided by their root mean
        square (no weight, eps `rms_norm_eps`) after RoPE, in the RoPE layers only.
      attention_sinks: gpt-oss: a learned logit per query head (``sinks [Hq]``) joins each
        query's softmax denominator (its probability mass is dropped, not attended).
      activation: the experts' (routed and shared) activation, one of :data:`ACTIVATIONS`:
        "swiglu" (``silu(gate) * up``, gate and up side by side) or "clamped_swiglu" (gpt-oss:
        gate and up interleaved, ``(clip(up, -l, l) + 1) * g * sigmoid(alpha g)`` with ``g =
        min(gate, l)``, l = `swiglu_limit`, alpha = `swiglu_alpha`).
      swiglu_alpha: see `activation`.
      swiglu_limit: see `activation`.
      expert_bias: the routed experts' projections have biases (gpt-oss).
      router_logit_bias: the router's logits have a learned bias (gpt-oss ``router.bias``).
      weight_inputs: each chosen expert gets its token scaled by the routing weight and the
        outputs are summed (Llama 4), instead of weighting the outputs.
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
    dense_layers: tuple[int, ...] = ()
    dense_ffn: int = 0
    router: str = "softmax"
    router_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_gate: bool = True
    mla: Mla | None = None
    layer_types: tuple[str, ...] = ()
    attention_chunk_size: int | None = None
    nope_layers: tuple[int, ...] = ()
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    qk_l2_norm: bool = False
    attention_sinks: bool = False
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False
    router_logit_bias: bool = False
    weight_inputs: bool = False

    def __post_init__(self):
        op = "jaxops.models.DecoderConfig"
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(
                f"{op}: model_type must be one of {MODEL_TYPES}, got {self.model_type!r}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "num_experts", "top_k", "expert_ffn", "n_group",
                     "topk_group"):  # fmt: skip
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
        if isinstance(self.rope, int | float) and not isinstance(self.rope, bool):
            object.__setattr__(self, "rope", Rope(theta=self.rope))
        if not isinstance(self.rope, Rope):
            raise ConfigError(f"{op}: rope must be a Rope, got {self.rope!r}")
        fam = family(self.model_type)
        if self.rope.partial_rotary_factor != 1.0 and not fam.partial_rotary:
            partial = ", ".join(m for m, f in FAMILIES.items() if f.partial_rotary)
            raise ConfigError(
                f"{op}: rope must rotate the whole head for {self.model_type} "
                f"(partial_rotary_factor 1.0; only {partial} rotate part), got {self.rope}"
            )
        if self.rope.interleave and fam.interleave == "never":
            interleaved = ", ".join(m for m, f in FAMILIES.items() if f.interleave != "never")
            raise ConfigError(
                f"{op}: rope must use the rotate-half layout for {self.model_type} (interleave "
                f"False; only {interleaved} interleave), got {self.rope}"
            )
        if not self.rope.interleave and fam.interleave == "always":
            raise ConfigError(f"{op}: {self.model_type} rotates interleaved pairs; got {self.rope}")
        rotary_dim(self.rope, self.head_dim)  # an even rotated width
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
        self._check_layers(op)
        self._check_router(op)
        self._check_mla(op)
        self._check_attention(op)

    def _check_layers(self, op: str) -> None:
        dense = self.dense_layers
        if not isinstance(dense, tuple | list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in dense
        ):
            raise ConfigError(f"{op}: dense_layers must be a tuple of layer indices, got {dense!r}")
        dense = tuple(dense)
        object.__setattr__(self, "dense_layers", dense)
        if list(dense) != sorted(set(dense)) or any(not 0 <= i < self.num_layers for i in dense):
            raise ConfigError(
                f"{op}: dense_layers must be distinct sorted indices in [0, {self.num_layers}), "
                f"got {dense}"
            )
        if len(dense) == self.num_layers:
            raise ConfigError(f"{op}: dense_layers {dense} leave no MoE layer; at least one is")
        ffn = self.dense_ffn
        if isinstance(ffn, bool) or not isinstance(ffn, int) or ffn < (1 if dense else 0):
            raise ConfigError(f"{op}: dense_ffn must be an int >= 1 with dense_layers, got {ffn!r}")
        if ffn and not dense:
            raise ConfigError(f"{op}: dense_ffn = {ffn} without dense_layers; give 0")

    def _check_router(self, op: str) -> None:
        if self.router not in ROUTERS:
            raise ConfigError(f"{op}: router must be one of {ROUTERS}, got {self.router!r}")
        e, g = self.num_experts, self.n_group
        if e % g or not 1 <= self.topk_group <= g:
            raise ConfigError(
                f"{op}: n_group ({g}) must divide num_experts ({e}) and topk_group "
                f"({self.topk_group}) be in [1, n_group]"
            )
        if g > 1 and self.top_k > self.topk_group * (e // g):
            raise ConfigError(
                f"{op}: top_k ({self.top_k}) exceeds the experts of topk_group ({self.topk_group})"
                f" groups of {e // g}"
            )
        if g > 1 and e // g < 2:
            raise ConfigError(f"{op}: groups of {e // g} expert; a group's score needs 2")
        scale = self.routed_scaling_factor
        if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
            raise ConfigError(f"{op}: routed_scaling_factor must be > 0, got {scale!r}")

    def _check_mla(self, op: str) -> None:
        m = self.mla
        if (m is not None) != family(self.model_type).mla:
            mla = ", ".join(t for t, f in FAMILIES.items() if f.mla)
            raise ConfigError(
                f"{op}: mla (multi-head latent attention) is {mla}'s and {mla} needs "
                f"it; got model_type {self.model_type!r} with mla={m!r}"
            )
        if m is None:
            return
        if not isinstance(m, Mla):
            raise ConfigError(f"{op}: mla must be an Mla or None, got {type(m).__name__}")
        if self.head_dim != m.qk_rope_head_dim or self.num_kv_heads != self.num_heads:
            raise ConfigError(
                f"{op}: with mla, head_dim must be mla.qk_rope_head_dim ({m.qk_rope_head_dim}) "
                f"and num_kv_heads num_heads ({self.num_heads}); got {self.head_dim}, "
                f"{self.num_kv_heads}"
            )
        if self.qk_norm or self.qkv_bias or self.o_bias or self.sliding_window is not None:
            raise ConfigError(
                f"{op}: mla has no q/k norm, attention biases or sliding window; got qk_norm="
                f"{self.qk_norm}, qkv_bias={self.qkv_bias}, o_bias={self.o_bias}, "
                f"sliding_window={self.sliding_window}"
            )

    def _check_attention(self, op: str) -> None:
        types = self.layer_types
        if not isinstance(types, tuple | list) or not all(t in LAYER_TYPES for t in types):
            raise ConfigError(
                f"{op}: layer_types must be a tuple of {LAYER_TYPES} (one per layer) or empty, "
                f"got {types!r}"
            )
        object.__setattr__(self, "layer_types", tuple(types))
        if types and len(types) != self.num_layers:
            raise ConfigError(
                f"{op}: layer_types has {len(types)} entries; num_layers = {self.num_layers}"
            )
        chunk = self.attention_chunk_size
        if chunk is not None and (
            isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1
        ):
            raise ConfigError(
                f"{op}: attention_chunk_size must be an int >= 1 or None, got {chunk!r}"
            )
        needs = (
            ("sliding_attention", self.sliding_window, "sliding_window"),
            ("chunked_attention", chunk, "attention_chunk_size"),
        )
        for kind, value, name in needs:
            if kind in types and value is None:
                raise ConfigError(f"{op}: layer_types has {kind!r} layers but {name} is None")
        nope = self.nope_layers
        if not isinstance(nope, tuple | list) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in nope
        ):
            raise ConfigError(f"{op}: nope_layers must be a tuple of layer indices, got {nope!r}")
        nope = tuple(nope)
        object.__setattr__(self, "nope_layers", nope)
        if list(nope) != sorted(set(nope)) or any(not 0 <= i < self.num_layers for i in nope):
            raise ConfigError(
                f"{op}: nope_layers must be distinct sorted indices in [0, {self.num_layers}), "
                f"got {nope}"
            )
        for name in ("floor_scale", "attn_scale", "swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and value > 0)
            ):
                raise ConfigError(f"{op}: {name} must be a finite number > 0, got {value!r}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(
                f"{op}: activation must be one of {ACTIVATIONS}, got {self.activation!r}"
            )
        if self.mla is not None and (self.attention_sinks or self.qk_l2_norm or nope or types):
            raise ConfigError(
                f"{op}: mla takes none of attention_sinks, qk_l2_norm, nope_layers, layer_types"
            )

    @property
    def layer_attention(self) -> tuple[tuple[int | None, int | None, bool], ...]:
        """Per layer ``(window, chunk, rope)``: its attention pattern.

        Its sliding window and attention chunk (None: none) and whether it applies RoPE, from
        `layer_types`, `sliding_window`, `attention_chunk_size` and `nope_layers`.
        """
        nope = set(self.nope_layers)
        out = []
        for i in range(self.num_layers):
            kind = self.layer_types[i] if self.layer_types else None
            window = self.sliding_window if kind in (None, "sliding_attention") else None
            chunk = self.attention_chunk_size if kind == "chunked_attention" else None
            out.append((window, chunk, i not in nope))
        return tuple(out)

    @property
    def rope_theta(self) -> float:
        """The RoPE base, ``rope.theta``."""
        return self.rope.theta

    @property
    def qk_head_dim(self) -> int:
        """Each head's query / key width: head_dim (GQA) or ``dn + dr`` (MLA)."""
        m = self.mla
        return self.head_dim if m is None else m.qk_nope_head_dim + m.qk_rope_head_dim

    @property
    def v_head_dim(self) -> int:
        """Each head's value width: head_dim (GQA) or ``mla.v_head_dim``."""
        return self.head_dim if self.mla is None else self.mla.v_head_dim

    @property
    def q_size(self) -> int:
        """Width of the query projection, ``num_heads * qk_head_dim``."""
        return self.num_heads * self.qk_head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection, ``num_kv_heads * head_dim`` (GQA)."""
        return self.num_kv_heads * self.head_dim

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The MoE layers' indices (every layer not in `dense_layers`)."""
        dense = set(self.dense_layers)
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
          >>> cfg.head_dim, cfg.kv_size, cfg.num_experts, cfg.normalize_topk
          (16, 32, 8, True)
        """
        return cls(**config_fields(hf))

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
        wrong = [
            f"{f.name}={getattr(self, f.name)!r}"
            + ("" if back is None else f" (as {self.model_type}: {getattr(back, f.name)!r})")
            for f in dataclasses.fields(self)
            if f.compare and (back is None or getattr(self, f.name) != getattr(back, f.name))
        ]
        if back is None:
            wrong = [f"this config ({why})"]
        if wrong:
            raise ConfigError(
                f"jaxops.models.DecoderConfig.to_hf: {self.model_type} cannot express "
                f"{', '.join(wrong)}; transformers would build another model ("
                + "; ".join(f.description for f in FAMILIES.values())
                + ")"
            )
        return out


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
