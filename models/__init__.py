"""jaxops.models: published MoE architectures on jaxops' kernels and parallel layers.

- The family registry (:func:`family`, :class:`Family`, :data:`FAMILIES`): each published
  family's model_type, transformers' defaults, config.json reading and writing, tensor names and
  a tiny test config, one module each under ``models/_families/``.
- :class:`DecoderConfig` (from a Hugging Face ``config.json``: Mixtral, Qwen3-MoE, Qwen2-MoE,
  OLMoE, GLM-4.5 (glm4_moe), DeepSeek-V3 / Kimi K2 / Moonlight (deepseek_v3, with
  :class:`Mla`, multi-head latent attention), ERNIE-4.5-MoE (ernie4_5_moe), gpt-oss
  (gpt_oss), Llama 4 (llama4_text, and llama4's text model) and MiniMax-M2 (minimax_m2);
  dense layers among the MoE layers, per-layer attention patterns (sliding, chunked, NoPE);
  composed of specs: :class:`AttentionSpec`, :class:`MoESpec` (the expert layer's own),
  :class:`LayerPattern` and its :class:`Rope`: default, linear, dynamic, yarn or llama3
  scaling, :func:`read_rope`)
  and :class:`MoEDecoder`: the decoder laid out on a mesh (experts over an ``expert`` axis,
  layers over a ``pipe`` axis as pipeline stages, the batch over the rest) with ``init``,
  ``logits``, ``loss`` and ``loss_and_grads``.
- Fine-tuning: ``attention_mask=``, ``positions=`` and ``segment_ids=`` on every
  :class:`MoEDecoder` method, targets of :data:`IGNORE_INDEX` (-100) left out of the loss,
  :func:`pack_sequences` (documents packed into rows, :class:`PackedBatch`), :func:`generate`
  (a KV cache, greedy or sampled), :data:`REMAT_POLICIES` and gradient accumulation.
- :func:`from_pretrained` / :func:`save_pretrained`: a Hugging Face model directory in, sharded
  parameters out, and back (transformers loads what it writes); :func:`name_map` is the mapping.
  Published FP8 checkpoints (128 x 128 block scales) and gpt-oss's MXFP4 checkpoints load
  dequantized, and
  ``save_pretrained(..., quantize="fp8-block")`` writes that format.
- Training at scale: ``MoEDecoder(..., zero=1 or 3)`` (:data:`ZERO_STAGES`: the optimizer
  state, and with 3 the parameters, sharded over the batch axes; ZeRO-3 gathers the
  projections' and experts' weights in the compute dtype), ``vocab_chunk`` (the loss over
  vocabulary chunks, never the whole logits), ``init_optimizer`` and ``train_step`` (loss,
  gradients and an optax update in one jitted step), and
  ``python -m jaxops.models.plan`` (:mod:`jaxops.models.plan`): the memory plan of that step
  for a config.json on a mesh of simulated devices, compiled ahead of time.
- :data:`DECODER_SCHEDULES`, :data:`MOE_IMPLS`, :data:`MODEL_TYPES`, :data:`BLOCK_MODEL_TYPES`:
  what the decoder and the blocks take.
- :func:`llama_name_map` and :data:`LLAMA_NAME_MAP`: a Llama-style dense tree and
  ``LlamaForCausalLM`` (every published model's name map lives in this package).
- :func:`moe_block_config`, :func:`load_moe_block`, :func:`is_moe_layer`: one layer's MoE block
  of DeepSeek-V3, Qwen2-MoE, Qwen3-MoE, Mixtral or OLMoE as a ``jaxops.parallel.expert.moe_layer``.

The sources live in the repository's top-level ``models/`` folder, the top tier: it builds on
``jaxops.parallel`` and the core ``jaxops``, and nothing below imports it.
"""

if __name__ != "jaxops.models":
    raise ImportError(
        f"this is jaxops.models and cannot be imported as {__name__!r}; use `import jaxops.models`"
    )

import warnings as _warnings

from jaxops._errors import ConfigError

from ._blocks import BLOCK_MODEL_TYPES, is_moe_layer, load_moe_block, moe_block_config
from ._config import (
    MODEL_TYPES,
    QK_NORM_WIDTHS,
    ROUTERS,
    AttentionSpec,
    DecoderConfig,
    LayerPattern,
    Mla,
    MoESpec,
    read_config,
)
from ._decoder import (
    ATTENTION_IMPLS,
    DECODER_SCHEDULES,
    GRAD_REDUCES,
    MOE_IMPLS,
    REMAT_POLICIES,
    ZERO_STAGES,
    MoEDecoder,
)
from ._families import FAMILIES, Family, family
from ._generate import generate
from ._hf import from_pretrained, save_pretrained
from ._names import LLAMA_NAME_MAP, llama_name_map, name_map
from ._packing import IGNORE_INDEX, PackedBatch, pack_sequences
from ._peft import load_adapter, merge_adapter, save_adapter
from ._rope import ROPE_KINDS, Rope, read_rope

__all__ = [
    "ATTENTION_IMPLS",
    "BLOCK_MODEL_TYPES",
    "DECODER_SCHEDULES",
    "FAMILIES",
    "GRAD_REDUCES",
    "IGNORE_INDEX",
    "LLAMA_NAME_MAP",
    "MODEL_TYPES",
    "MOE_IMPLS",
    "QK_NORM_WIDTHS",
    "REMAT_POLICIES",
    "ROPE_KINDS",
    "ROUTERS",
    "ZERO_STAGES",
    "AttentionSpec",
    "ConfigError",
    "DecoderConfig",
    "Family",
    "LayerPattern",
    "Mla",
    "MoEDecoder",
    "MoESpec",
    "PackedBatch",
    "Rope",
    "family",
    "from_pretrained",
    "generate",
    "is_moe_layer",
    "load_adapter",
    "llama_name_map",
    "load_moe_block",
    "merge_adapter",
    "moe_block_config",
    "name_map",
    "pack_sequences",
    "read_config",
    "read_rope",
    "save_adapter",
    "save_pretrained",
]


def __getattr__(name: str):
    if name == "SCHEDULES":
        _warnings.warn(
            "jaxops.models.SCHEDULES is renamed DECODER_SCHEDULES (the decoder's subset of "
            "jaxops.parallel.pipeline.SCHEDULES) and the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return DECODER_SCHEDULES
    raise AttributeError(f"module 'jaxops.models' has no attribute {name!r}")
