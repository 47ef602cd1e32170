"""The architecture specs a :class:`~jaxops.models.DecoderConfig` is composed of.

- :class:`Mla`: multi-head latent attention's projection widths (DeepSeek-V2/V3).
"""

from __future__ import annotations

import dataclasses

from jaxops._errors import ConfigError

__all__ = ["Mla"]


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
