"""Hugging Face model directories in and out: name maps, from_pretrained, save_pretrained."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxops.models._config import ConfigError, DecoderConfig, read_config
from jaxops.models._decoder import MoEDecoder
from jaxops.parallel import checkpoint
from jaxops.parallel.checkpoint import Rule
from jaxops.parallel.checkpoint._hf_import import _hf_tensors

__all__ = ["from_pretrained", "name_map", "save_pretrained"]

# Tensors a model directory may hold that the decoder does not use (rotary caches of old exports).
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")


def _expert_names(model_type: str) -> tuple[str, str, str, str]:
    """(MoE module, gate, up, down) names in the published checkpoints."""
    if model_type == "mixtral":
        return "block_sparse_moe", "w1", "w3", "w2"
    return "mlp", "gate_proj", "up_proj", "down_proj"


def name_map(config: DecoderConfig) -> tuple[Rule, ...]:
    """The checkpoint Rules between :class:`MoEDecoder` parameters and published tensor names.

    The names are those of the model's published checkpoints (what ``save_pretrained`` of
    transformers writes), as :class:`~jaxops.parallel.checkpoint.Rule` s.

    Layers are stacked on our leading axis (placeholder ``{i}``) and experts on the next
    (``{e}``); q/k/v and gate/up are fused on our side (the GQA split sizes come from the
    config); our kernels are ``[in, out]``, torch Linear weights ``[out, in]``.

    Example:
      >>> from jaxops.models import DecoderConfig, name_map
      >>> cfg = DecoderConfig("mixtral", 128, 64, 2, 4, 2, 16, 8, 2, 96)
      >>> rule = [r for r in name_map(cfg) if r.ours == "layers/moe/w_in"][0]
      >>> rule.stack, rule.theirs[1]
      (('i', 'e'), 'model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight')
    """
    c = config
    lay = "model.layers.{i}."
    moe, gate, up, down = _expert_names(c.model_type)
    sizes = (c.q_size, c.kv_size, c.kv_size)
    qkv = [lay + f"self_attn.{n}_proj" for n in ("q", "k", "v")]
    t = (1, 0)
    rules = [
        Rule("embed", "model.embed_tokens.weight"),
        Rule("layers/attn_norm", lay + "input_layernorm.weight", stack=("i",)),
        Rule(
            "layers/w_qkv",
            tuple(n + ".weight" for n in qkv),
            transpose=t,
            sizes=sizes,
            stack=("i",),
        ),
        Rule("layers/w_o", lay + "self_attn.o_proj.weight", transpose=t, stack=("i",)),
        Rule("layers/mlp_norm", lay + "post_attention_layernorm.weight", stack=("i",)),
        Rule("layers/moe/router", lay + f"{moe}.gate.weight", transpose=t, stack=("i",)),
        Rule(
            "layers/moe/w_in",
            (lay + f"{moe}.experts.{{e}}.{gate}.weight", lay + f"{moe}.experts.{{e}}.{up}.weight"),
            transpose=t,
            stack=("i", "e"),
        ),
        Rule(
            "layers/moe/w_out",
            lay + f"{moe}.experts.{{e}}.{down}.weight",
            transpose=t,
            stack=("i", "e"),
        ),
        Rule("final_norm", "model.norm.weight"),
    ]
    if c.qkv_bias:
        rules.append(
            Rule("layers/b_qkv", tuple(n + ".bias" for n in qkv), sizes=sizes, stack=("i",))
        )
    if c.o_bias:
        rules.append(Rule("layers/b_o", lay + "self_attn.o_proj.bias", stack=("i",)))
    if c.qk_norm:
        rules.append(Rule("layers/q_norm", lay + "self_attn.q_norm.weight", stack=("i",)))
        rules.append(Rule("layers/k_norm", lay + "self_attn.k_norm.weight", stack=("i",)))
    if c.shared_ffn:
        shared = lay + "mlp.shared_expert."
        rules += [
            Rule(
                "layers/moe/shared_w_in",
                (shared + "gate_proj.weight", shared + "up_proj.weight"),
                transpose=t,
                stack=("i",),
            ),
            Rule("layers/moe/shared_w_out", shared + "down_proj.weight", transpose=t, stack=("i",)),
            Rule(
                "layers/moe/shared_gate",
                lay + "mlp.shared_expert_gate.weight",
                transpose=t,
                stack=("i",),
            ),
        ]
    if not c.tie_word_embeddings:
        rules.append(Rule("lm_head", "lm_head.weight", transpose=t))
    return tuple(rules)


def _expected_names(model: MoEDecoder, rules: Sequence[Rule]) -> set[str]:
    c = model.config
    counts = {"i": c.num_layers, "e": c.num_experts}
    names: set[str] = set()
    for rule in rules:
        templates = (rule.theirs,) if isinstance(rule.theirs, str) else tuple(rule.theirs)
        stack = tuple(rule.stack or ())
        grid = np.ndindex(*(counts[s] for s in stack)) if stack else [()]
        for idx in grid:
            values = {s: str(v) for s, v in zip(stack, idx, strict=True)}
            names.update(t.format(**values) for t in templates)
    return names


def from_pretrained(
    path: str | os.PathLike,
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype: Any = None,
    compute_dtype: Any = None,
    progress: bool | None = None,
    **options: Any,
) -> tuple[MoEDecoder, dict[str, Any]]:
    """A :class:`MoEDecoder` and its parameters, sharded on `mesh`, from a Hugging Face directory.

    Reads ``config.json`` (Mixtral, Qwen3-MoE or Qwen2-MoE), builds the parameter target with
    its shardings (:meth:`MoEDecoder.abstract_params`) and imports the safetensors files (one
    file, or shards with ``model.safetensors.index.json``) through :func:`name_map`: per-expert
    tensors stacked into the expert axis, q/k/v and gate/up fused, layers stacked. Each process
    reads what its shards need. Local directories only (no hub download).

    Args:
      path: the model directory.
      mesh: the mesh (default: one device, ``("expert",)`` of size 1); see :class:`MoEDecoder`.
      dtype: parameter dtype (default: the config's ``dtype`` / ``torch_dtype``, else float32).
      compute_dtype: the model's compute dtype (default: `dtype`).
      progress: a progress bar (None: only on a terminal).
      **options: further :class:`MoEDecoder` fields (expert_axis, pipe_axis, microbatches,
        schedule, remat, capacity_factor, fp8, dispatch, aux_loss_coef, z_loss_coef, align,
        impl).

    Returns:
      ``(model, params)``.

    Raises:
      ConfigError (ValueError): an unsupported model_type or feature, a missing config key.
      CheckpointError: a tensor the config needs is missing, has another shape, or the files
        hold tensors the config does not account for (e.g. more experts or layers than it says).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxops.models import from_pretrained  # doctest: +SKIP
      >>> model, params = from_pretrained("Qwen3-30B-A3B", mesh=jax.make_mesh((8,), ("expert",)),
      ...                                 dtype=jnp.bfloat16)  # doctest: +SKIP
    """
    root = Path(path)
    config = read_config(root)
    if mesh is None:
        mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    if dtype is None:
        dtype = config.hf.get("dtype") or config.hf.get("torch_dtype") or "float32"
    try:
        dtype = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise ConfigError(f"from_pretrained: dtype {dtype!r} is not a dtype") from None
    model = MoEDecoder(config, mesh, dtype=compute_dtype or dtype, **options)
    rules = name_map(config)
    have = set(_hf_tensors(root))  # validated headers and index
    want = _expected_names(model, rules)
    missing = sorted(want - have)
    if missing:
        raise checkpoint.CheckpointError(
            f"from_pretrained: {root} lacks {len(missing)} tensor(s) config.json implies, e.g. "
            f"{missing[:3]} (num_hidden_layers = {config.num_layers}, num_experts = "
            f"{config.num_experts})"
        )
    extra = sorted(n for n in have - want if not _IGNORED.fullmatch(n))
    if config.tie_word_embeddings:
        extra = [n for n in extra if n != "lm_head.weight"]
    if extra:
        raise checkpoint.CheckpointError(
            f"from_pretrained: {root} holds {len(extra)} tensor(s) config.json does not account "
            f"for, e.g. {extra[:3]} (num_hidden_layers = {config.num_layers}, num_experts = "
            f"{config.num_experts}, tie_word_embeddings = {config.tie_word_embeddings})"
        )
    params = checkpoint.import_safetensors(
        root, model.abstract_params(dtype), name_map=rules, progress=progress
    )
    return model, params


def save_pretrained(
    model: MoEDecoder,
    params: dict[str, Any],
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    max_shard_size: int | str = "5GB",
    generation_config: dict[str, Any] | None = None,
    progress: bool | None = None,
) -> list[str]:
    """Writes `params` as a Hugging Face model directory that transformers loads.

    ``config.json`` (the config read by :func:`from_pretrained` with this model's values and the
    written dtype), safetensors shards of at most `max_shard_size` with
    ``model.safetensors.index.json``, and ``generation_config.json`` if given; tensors under the
    published names (per-expert weights unstacked). Every process must call it (the arrays are
    gathered to process 0, which writes, one array at a time). `path` must not exist or be empty.

    Args:
      model: the :class:`MoEDecoder`.
      params: its parameters (any sharding).
      path: the output directory.
      dtype: the written dtype of the float tensors (default: the parameters' own).
      max_shard_size: bytes per file, an int or a string like "5GB".
      generation_config: a dict written as generation_config.json.
      progress: a progress bar (None: only on a terminal).

    Returns:
      The tensor names written.

    Example:
      >>> from jaxops.models import save_pretrained  # doctest: +SKIP
      >>> save_pretrained(model, params, "/tmp/finetuned", dtype="bfloat16")  # doctest: +SKIP
    """
    if not isinstance(model, MoEDecoder):
        raise TypeError(f"save_pretrained: model must be a MoEDecoder, got {type(model).__name__}")
    written = np.dtype(jnp.dtype(dtype)) if dtype is not None else np.dtype(params["embed"].dtype)
    return checkpoint.export_safetensors(
        params,
        path,
        max_shard_size=max_shard_size,
        name_map=name_map(model.config),
        dtype=None if dtype is None else written.name,
        progress=progress,
        config=model.config.to_hf(written),
        generation_config=generation_config,
    )
