"""The value that says one published model family at the Hugging Face edge: :class:`Family`.

A family is everything that differs between published checkpoints of the same decoder: which
``model_type`` and architecture name its config.json carries, transformers' defaults for the keys
a file leaves out, how its keys read into :class:`~jaxops.models.DecoderConfig` keywords and
back, what its architecture allows (partial or interleaved RoPE, MLA), its tensor names
(:class:`Names`), the published wrapper it may come in (:class:`Wrapper`), and a tiny config.json
for tests and examples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from jaxops._errors import ConfigError

__all__ = ["INTERLEAVE", "TINY", "Family", "Names", "Shape", "Wrapper"]

#: How a family's RoPE pairs the rotated dims: "never" (rotate-half), "always" (interleaved
#: pairs) or "key" (config.json's ``rope_interleave``, default true: DeepSeek-V3).
INTERLEAVE = ("never", "always", "key")


#: The sizes every family's tiny config starts from (:attr:`Family.tiny`): a 128-token
#: vocabulary, width 64, 2 layers of 4 query and 2 key/value heads, 2 experts per token.
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
)


class Shape(NamedTuple):
    """The keys every family reads the same way, handed to :attr:`Family.read`."""

    hidden: int
    heads: int
    layers: int
    head_dim: int | None  # None: MLA (DeepSeek-V3), whose head_dim its read sets


@dataclasses.dataclass(frozen=True)
class Names:
    """A family's tensor names, relative to ``model.layers.{i}.`` (its MoE module's below it).

    Attributes:
      moe: the MoE module of a layer (and of a dense layer's MLP): ``mlp``, Mixtral's and
        MiniMax-M2's ``block_sparse_moe``, Llama 4's ``feed_forward``.
      experts: the (gate, up, down) projections of one expert, ``experts.{e}.<name>.weight``;
        Mixtral's ``w1, w3, w2``.
      fused_experts: each layer's experts are one tensor ``experts.gate_up_proj [E, D, 2F]`` and
        ``experts.down_proj [E, F, D]`` (gpt-oss, Llama 4) instead of a module per expert.
      router: the router module under `moe` (``gate``; ``router`` with fused experts).
      router_bias: the correction bias's name under `moe` (a buffer, kept float32).
      router_bias_squeeze: the published correction bias is ``[1, E]`` (ERNIE's moe_statics).
      shared: the shared experts' module under `moe` (``shared_expert`` or ``shared_experts``).
    """

    moe: str = "mlp"
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    fused_experts: bool = False
    router: str = "gate"
    router_bias: str = "gate.e_score_correction_bias"
    router_bias_squeeze: bool = False
    shared: str = "shared_experts"


@dataclasses.dataclass(frozen=True)
class Wrapper:
    """A published checkpoint that holds the family's model inside a larger one.

    Llama 4's ``Llama4ForConditionalGeneration`` (model_type ``llama4``): its text model's keys
    under ``text_config`` and tensors under ``language_model.``, beside a vision tower.

    Attributes:
      model_type: the wrapper's config.json ``model_type``.
      config_key: the key of the family's own config inside it.
      prefix: the family's tensors' name prefix inside it.
      skipped: name prefixes of the wrapper's other tensors, skipped with a warning on load.
      skipped_what: what those are, for the warning.
    """

    model_type: str
    config_key: str
    prefix: str
    skipped: tuple[str, ...] = ()
    skipped_what: str = ""


@dataclasses.dataclass(frozen=True)
class Family:
    """One published model family: its config.json keys, defaults, tensor names and limits.

    Attributes:
      model_type: config.json's ``model_type`` (:attr:`DecoderConfig.model_type`).
      architecture: transformers' ``*ForCausalLM`` class, written to ``architectures``.
      transformers_config: transformers' configuration class name (tests build tiny models).
      read: ``read(hf, shape) -> dict``: the family's own keys as spec fields by name
        (``num_experts``, ``expert_ffn`` and every field only this family sets: ``qk_norm``,
        ``dense_layers``, ...), which ``config_fields`` composes into the config's specs;
        `shape` holds what every family reads alike.
      write: ``write(config, out)``: the family's own keys of a DecoderConfig into the dict
        `out` (the inverse of `read`).
      description: what transformers builds for this model_type, in a clause (the message of a
        config the family cannot express).
      tiny: a tiny config.json of the family (a few layers, hidden 64, 8 experts) for tests and
        examples; transformers builds it.
      rms_norm_eps: transformers' default ``rms_norm_eps``.
      rope_theta: transformers' default RoPE base.
      max_positions: transformers' default ``max_position_embeddings`` (the "dynamic" RoPE's
        length, and "yarn" / "llama3"'s original length when their parameters have none).
      kv_heads: transformers' default ``num_key_value_heads`` (None: num_attention_heads).
      aux_loss_coef: ``router_aux_loss_coef`` when config.json has none: transformers' where
        its model has the loss; 0 for families that balance with a correction bias instead.
      head_dim: transformers' default ``head_dim`` (None: hidden_size / num_attention_heads).
      dense_ffn: the dense MLP width's default (None: the family has no dense layers).
      dense_ffn_key: the dense MLP width's key.
      top_k_key: the key of the experts per token.
      top_k: its default (None: required).
      tie_word_embeddings: its default.
      interleave: how the RoPE pairs dims, one of :data:`INTERLEAVE`.
      partial_rotary: the RoPE may rotate part of each head (GLM-4.5, MiniMax-M2).
      rope_keys: ``rope_keys(hf, head_dim) -> dict``: config.json with the RoPE keys the family
        implies filled in (its default RoPE parameters, a legacy key), or None.
      mla: the attention is multi-head latent attention (:class:`~jaxops.models.Mla`).
      names: its tensor names.
      wrapper: the published wrapper it may come in, or None.
      moe_module: the MoE block's module name in transformers' model (PEFT's adapter names
        follow the modules, not the checkpoint's tensor names: Mixtral's ``block_sparse_moe``
        tensors load into ``mlp``).
      peft_swapped: PEFT reads the family's fused ``[E, H, 2F]`` expert tensors as ``[E, out,
        in]`` (Llama 4's experts have no ``is_transposed`` flag): its ``lora_A`` holds our B
        and its ``lora_B`` our A (:mod:`~jaxops.models._peft`).
      mtp_key: the config.json key of its multi-token-prediction layers' count (DeepSeek-V3's
        and GLM-4.5's ``num_nextn_predict_layers``, stored as ``model.layers.{L + k}.*``), or
        None: the family has no published MTP layers jaxops reads.
      mtp_default: transformers' default of `mtp_key`.
    """

    model_type: str
    architecture: str
    transformers_config: str
    read: Callable[[dict[str, Any], Shape], dict[str, Any]]
    write: Callable[[Any, dict[str, Any]], None]
    description: str
    tiny: Mapping[str, Any]
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    kv_heads: int | None = None
    aux_loss_coef: float = 1e-3
    head_dim: int | None = None
    dense_ffn: int | None = None
    dense_ffn_key: str = "intermediate_size"
    top_k_key: str = "num_experts_per_tok"
    top_k: int | None = None
    tie_word_embeddings: bool = False
    interleave: str = "never"
    partial_rotary: bool = False
    rope_keys: Callable[[dict[str, Any], int], dict[str, Any]] | None = None
    mla: bool = False
    names: Names = Names()
    wrapper: Wrapper | None = None
    moe_module: str = "mlp"
    peft_swapped: bool = False
    mtp_key: str | None = None
    mtp_default: int = 0

    def __post_init__(self):
        if self.interleave not in INTERLEAVE:
            raise ConfigError(
                f"jaxops.models.Family: interleave must be one of {INTERLEAVE}, got "
                f"{self.interleave!r}"
            )

    def tiny_config(self, **overrides: Any) -> dict[str, Any]:
        """A copy of :attr:`tiny` with ``model_type`` and `overrides` set (a config.json dict).

        Example:
          >>> from jaxops.models import family
          >>> family("olmoe").tiny_config(num_hidden_layers=1)["num_hidden_layers"]
          1
        """
        return {**self.tiny, "model_type": self.model_type, **overrides}
