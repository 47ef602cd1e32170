"""jaxops.models: published MoE architectures on jaxops' kernels and parallel layers.

- :class:`DecoderConfig` (from a Hugging Face ``config.json``: Mixtral, Qwen3-MoE, Qwen2-MoE)
  and :class:`MoEDecoder`: the decoder laid out on a mesh (experts over an ``expert`` axis,
  layers over a ``pipe`` axis as pipeline stages, the batch over the rest) with ``init``,
  ``logits``, ``loss`` and ``loss_and_grads``.
- :func:`from_pretrained` / :func:`save_pretrained`: a Hugging Face model directory in, sharded
  parameters out, and back (transformers loads what it writes); :func:`name_map` is the mapping.
- :func:`moe_block_config`, :func:`load_moe_block`, :func:`is_moe_layer`: one layer's MoE block
  of DeepSeek-V3, Qwen2-MoE, Qwen3-MoE or Mixtral as a ``jaxops.parallel.expert.moe_layer``.
"""

from jaxops.models._blocks import BLOCK_MODEL_TYPES, is_moe_layer, load_moe_block, moe_block_config
from jaxops.models._config import MODEL_TYPES, ConfigError, DecoderConfig, read_config
from jaxops.models._decoder import MOE_IMPLS, SCHEDULES, MoEDecoder
from jaxops.models._hf import from_pretrained, name_map, save_pretrained

__all__ = [
    "BLOCK_MODEL_TYPES",
    "MODEL_TYPES",
    "MOE_IMPLS",
    "SCHEDULES",
    "ConfigError",
    "DecoderConfig",
    "MoEDecoder",
    "from_pretrained",
    "is_moe_layer",
    "load_moe_block",
    "moe_block_config",
    "name_map",
    "read_config",
    "save_pretrained",
]
