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
from jaxops.models._config import read_config
from jaxops.models._decoder import MoEDecoder
from jaxops.models._names import name_map
from jaxops.parallel import checkpoint
from jaxops.parallel.checkpoint import Rule

from jaxops._errors import ConfigError, named_errors

__all__ = ["from_pretrained", "name_map", "save_pretrained"]

# Tensors a model directory may hold that the decoder does not use (rotary caches of old exports).
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")


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


@named_errors("jaxops.models.from_pretrained")
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
      **options: further :class:`MoEDecoder` fields (expert_axis, pipe_axis, num_microbatches,
        schedule, remat, capacity_factor, fp8, dispatch, router_aux_loss_coef,
        router_z_loss_coef, align, impl).

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
    op = "jaxops.models.from_pretrained"
    root = Path(path)
    config = read_config(root)
    if mesh is None:
        mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    if dtype is None:
        dtype = config.hf.get("dtype") or config.hf.get("torch_dtype") or "float32"
    try:
        dtype = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise ConfigError(f"{op}: dtype {dtype!r} is not a dtype") from None
    model = MoEDecoder(config, mesh, dtype=compute_dtype or dtype, **options)
    rules = name_map(config)
    have = set(checkpoint.hf_tensors(root))  # validated headers and index
    want = _expected_names(model, rules)
    missing = sorted(want - have)
    if missing:
        raise checkpoint.CheckpointError(
            f"{op}: {root} lacks {len(missing)} tensor(s) config.json implies, e.g. "
            f"{missing[:3]} (num_hidden_layers = {config.num_layers}, num_experts = "
            f"{config.num_experts})"
        )
    extra = sorted(n for n in have - want if not _IGNORED.fullmatch(n))
    if config.tie_word_embeddings:
        extra = [n for n in extra if n != "lm_head.weight"]
    if extra:
        raise checkpoint.CheckpointError(
            f"{op}: {root} holds {len(extra)} tensor(s) config.json does not account "
            f"for, e.g. {extra[:3]} (num_hidden_layers = {config.num_layers}, num_experts = "
            f"{config.num_experts}, tie_word_embeddings = {config.tie_word_embeddings})"
        )
    params = checkpoint.import_safetensors(
        root, model.abstract_params(dtype), name_map=rules, progress=progress
    )
    return model, params


@named_errors("jaxops.models.save_pretrained")
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
    op = "jaxops.models.save_pretrained"
    if not isinstance(model, MoEDecoder):
        raise TypeError(f"{op}: model must be a MoEDecoder, got {type(model).__name__}")
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
