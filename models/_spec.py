"""The architecture specs a :class:`~jaxops.models.DecoderConfig` is composed of.

- :class:`AttentionSpec`: the attention of every layer (heads, head widths, q/k norms, biases,
  sinks, windows, chunks, Llama 4's temperature tuning, MLA);
- :class:`Mla`: multi-head latent attention's projection widths (DeepSeek-V2/V3);
- :class:`LayerPattern`: which layers are dense, each layer's attention kind, the NoPE layers.

The MoE layer's spec is the expert-parallel layer's own,
:class:`jaxops.parallel.expert.MoESpec`; the rotary embedding's is
:class:`~jaxops.models.Rope`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxops.parallel import expert as ep

from jaxops._errors import ConfigError

__all__ = [
    "LAYER_TYPES",
    "QK_NORM_WIDTHS",
    "SPEC_FIELDS",
    "AttentionSpec",
    "LayerPattern",
    "Mla",
    "compose",
]

#: A layer's attention pattern (transformers' ``layer_types`` values).
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
#: How :attr:`AttentionSpec.qk_norm` normalizes: each head (Qwen3) or the whole projection (OLMoE).
QK_NORM_WIDTHS = ("head", "projection")


def _is_int(value: Any, minimum: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum


def _indices(op: str, name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise ConfigError(f"{op}: {name} must be a tuple of layer indices, got {value!r}")
    value = tuple(value)
    if list(value) != sorted(set(value)) or any(i < 0 for i in value):
        raise ConfigError(f"{op}: {name} must be distinct sorted indices >= 0, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class Mla:
    """Multi-head latent attention (DeepSeek-V2/V3): the widths of its projections.

    Queries: ``x -> q_a_proj [D, q_lora_rank] -> RMSNorm -> q_b_proj [q_lora_rank, H (dn + dr)]``
    (or one ``q_proj [D, H (dn + dr)]`` without a q LoRA). Keys and values: ``x ->
    kv_a_proj_with_mqa [D, kv_lora_rank + dr]``, whose first ``kv_lora_rank`` columns (the
    compressed KV, RMSNorm'd) expand through ``kv_b_proj [kv_lora_rank, H (dn + dv)]`` into each
    head's key part without RoPE (``dn``) and its value (``dv``); the last ``dr`` columns are one
    RoPE key shared by every head. Scores over ``dn + dr`` dims.

    Attributes:
      kv_lora_rank: width of the compressed KV (what a KV cache of MLA holds, with ``dr``).
      qk_nope_head_dim: dn, each head's query / key dims without RoPE.
      qk_rope_head_dim: dr, the rotary dims (DecoderConfig.head_dim is this width).
      v_head_dim: dv, each head's value width.
      q_lora_rank: width of the compressed query, or None (one q projection).
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"jaxops.models.Mla: {name} must be an int >= 1, got {value!r}")
        q = self.q_lora_rank
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
            raise ConfigError(f"jaxops.models.Mla: q_lora_rank must be None or >= 1, got {q!r}")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The attention of a decoder's layers: grouped-query attention or MLA, and its variants.

    Attributes:
      num_heads: query heads.
      num_kv_heads: key/value heads (GQA; divides num_heads; MLA: num_heads).
      head_dim: per-head width (MLA: the RoPE width ``mla.qk_rope_head_dim``, as transformers).
      qk_norm: an RMSNorm of the queries and keys before RoPE (Qwen3, OLMoE, GLM
        ``use_qk_norm``); see `qk_norm_width`.
      qk_norm_width: what the q/k RMSNorm normalizes (one of :data:`QK_NORM_WIDTHS`): "head",
        each head over ``head_dim`` with weights ``[Dh]`` (Qwen3, GLM); "projection", the whole
        q projection ``[Hq Dh]`` and k projection ``[Hkv Dh]`` before the split into heads, with
        weights of those widths (OLMoE, MiniMax-M2).
      qkv_bias: biases on the q, k and v projections (Qwen2; Qwen3, OLMoE and GLM
        ``attention_bias``).
      o_bias: a bias on the output projection (Qwen3 and OLMoE ``attention_bias``).
      sliding_window: causal attention over the last this many positions (None: all); the
        "sliding_attention" layers' window when the :class:`LayerPattern` names layer types.
      attention_chunk_size: the chunk of the "chunked_attention" layers (Llama 4), or None.
      attn_temperature_tuning: Llama 4: the queries of the NoPE layers are scaled by
        ``log1p(floor((t + 1) / floor_scale)) * attn_scale + 1`` at time step t.
      floor_scale: see `attn_temperature_tuning`.
      attn_scale: see `attn_temperature_tuning`.
      qk_l2_norm: Llama 4's ``use_qk_norm``: q and k of each head divided by their root mean
        square (no weight, the decoder's ``rms_norm_eps``) after RoPE, in the RoPE layers only.
      attention_sinks: gpt-oss: a learned logit per query head (``sinks [Hq]``) joins each
        query's softmax denominator (its probability mass is dropped, not attended).
      mla: multi-head latent attention (:class:`Mla`, DeepSeek-V3) instead of GQA, or None.

    Example:
      >>> from jaxops.models import AttentionSpec
      >>> a = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=16, qk_norm=True)
      >>> a.q_size, a.kv_size
      (128, 32)
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool = False
    qk_norm_width: str = "head"
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    qk_l2_norm: bool = False
    attention_sinks: bool = False
    mla: Mla | None = None

    def __post_init__(self):
        op = "jaxops.models.AttentionSpec"
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not _is_int(value, 1):
                raise ConfigError(f"{op}: {name} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{op}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.qk_norm_width not in QK_NORM_WIDTHS:
            raise ConfigError(
                f"{op}: qk_norm_width must be one of {QK_NORM_WIDTHS}, got {self.qk_norm_width!r}"
            )
        if self.qk_norm_width != "head" and not self.qk_norm:
            raise ConfigError(f"{op}: qk_norm_width={self.qk_norm_width!r} needs qk_norm=True")
        for name in ("sliding_window", "attention_chunk_size"):
            value = getattr(self, name)
            if value is not None and not _is_int(value, 1):
                raise ConfigError(f"{op}: {name} must be an int >= 1 or None, got {value!r}")
        for name in ("floor_scale", "attn_scale"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and value > 0)
            ):
                raise ConfigError(f"{op}: {name} must be a finite number > 0, got {value!r}")
        self._check_mla(op)

    def _check_mla(self, op: str) -> None:
        m = self.mla
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
        if self.attention_sinks or self.qk_l2_norm or self.attention_chunk_size is not None:
            raise ConfigError(
                f"{op}: mla takes none of attention_sinks, qk_l2_norm, attention_chunk_size"
            )

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


@dataclasses.dataclass(frozen=True)
class LayerPattern:
    """Which layers differ from the rest: dense FFNs, attention kinds, layers without RoPE.

    Indices are checked against the decoder's ``num_layers`` by
    :class:`~jaxops.models.DecoderConfig`.

    Attributes:
      dense_layers: the layers whose ffn is a dense SwiGLU MLP of width `dense_ffn` (sorted
        indices; DeepSeek's and GLM's first ``first_k_dense_replace``, Qwen's
        ``mlp_only_layers`` and the layers ``decoder_sparse_step`` skips, ERNIE's layers outside
        ``moe_layer_start_index`` .. ``moe_layer_end_index`` or off ``moe_layer_interval``).
        At least one layer stays MoE.
      dense_ffn: the dense MLP's inner width (``intermediate_size``); 0 without dense layers.
      layer_types: each layer's attention, one of :data:`LAYER_TYPES` per layer (gpt-oss,
        Llama 4): "full_attention" (causal), "sliding_attention" (causal within the attention's
        ``sliding_window`` time steps), "chunked_attention" (causal within each
        ``attention_chunk_size`` block of rotary positions: transformers' chunks count from the
        first real token). Empty: every layer "full_attention", windowed by ``sliding_window``
        when it is set (Mixtral).
      nope_layers: layers without rotary embedding (Llama 4's NoPE layers, transformers'
        ``no_rope_layers`` entries 0).

    Example:
      >>> from jaxops.models import LayerPattern
      >>> LayerPattern(dense_layers=(0,), dense_ffn=256).dense_layers
      (0,)
    """

    dense_layers: tuple[int, ...] = ()
    dense_ffn: int = 0
    layer_types: tuple[str, ...] = ()
    nope_layers: tuple[int, ...] = ()

    def __post_init__(self):
        op = "jaxops.models.LayerPattern"
        dense = _indices(op, "dense_layers", self.dense_layers)
        object.__setattr__(self, "dense_layers", dense)
        ffn = self.dense_ffn
        if not _is_int(ffn, 1 if dense else 0):
            raise ConfigError(f"{op}: dense_ffn must be an int >= 1 with dense_layers, got {ffn!r}")
        if ffn and not dense:
            raise ConfigError(f"{op}: dense_ffn = {ffn} without dense_layers; give 0")
        types = self.layer_types
        if not isinstance(types, tuple | list) or not all(t in LAYER_TYPES for t in types):
            raise ConfigError(
                f"{op}: layer_types must be a tuple of {LAYER_TYPES} (one per layer) or empty, "
                f"got {types!r}"
            )
        object.__setattr__(self, "layer_types", tuple(types))
        object.__setattr__(self, "nope_layers", _indices(op, "nope_layers", self.nope_layers))


#: The fields of each spec, by the :class:`~jaxops.models.DecoderConfig` field holding it.
SPEC_FIELDS: dict[str, tuple[str, ...]] = {
    "attention": tuple(f.name for f in dataclasses.fields(AttentionSpec)),
    "moe": tuple(f.name for f in dataclasses.fields(ep.MoESpec)),
    "pattern": tuple(f.name for f in dataclasses.fields(LayerPattern)),
}
_SPECS = {"attention": AttentionSpec, "moe": ep.MoESpec, "pattern": LayerPattern}


def compose(kw: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """`kw` with its spec fields (``num_heads``, ``num_experts``, ...) gathered into specs.

    Each spec's fields in `kw` replace those of the spec `kw` already holds under its name
    (``attention``, ``moe``, ``pattern``), or build a new one, starting from `defaults` (the
    flat fields' former defaults, for the deprecated flat keywords). Other keys stay.
    """
    out = dict(kw)
    for holder, names in SPEC_FIELDS.items():
        given = {n: out.pop(n) for n in names if n in out}
        if not given:
            continue
        spec = out.get(holder)
        if spec is None:
            start = {k: v for k, v in (defaults or {}).items() if k in names}
            out[holder] = _SPECS[holder](**{**start, **given})
        else:
            out[holder] = dataclasses.replace(spec, **given)
    return out
