"""Hugging Face model directories in and out: name maps, from_pretrained, save_pretrained."""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxops.parallel import checkpoint
from jaxops.parallel.checkpoint import Rule

from jaxops import fp8
from jaxops._errors import ArgumentTypeError, ConfigError, named_errors

from ._base import (
    BASE_WEIGHTS,
    MXFP4_WEIGHTS,
    BaseCodec,
    Mxfp4BaseCodec,
    as_bytes,
    as_fp8,
    mxfp4_rules,
    scale_rules,
)
from ._config import read_config
from ._decoder import MoEDecoder
from ._families import family
from ._names import mtp_copies, mtp_layers, name_map
from ._quant import (
    Fp8Block,
    Fp8Codec,
    Mxfp4,
    Mxfp4Codec,
    fp8_scale_names,
    mxfp4_check,
    read_quantization,
)

__all__ = ["from_pretrained", "name_map", "save_pretrained"]

# Tensors a model directory may hold that the decoder does not use (rotary caches of old exports).
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")
# A published layer index (model.layers.N.) in a tensor name.
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# save_pretrained's quantize=: the checkpoint format's name, a spelling of the block recipe.
_FORMATS = {"fp8-block": "block"}


def _expected_names(model: MoEDecoder, rules: Sequence[Rule]) -> set[str]:
    c = model.config
    counts = {"i": c.num_layers, "e": c.moe.num_experts}
    names: set[str] = set()
    for rule in rules:
        templates = (rule.theirs,) if isinstance(rule.theirs, str) else tuple(rule.theirs)
        stack = tuple(rule.stack or ())
        index = dict(rule.index or ())
        numbers = [index.get(s, range(counts[s])) for s in stack]
        grid = np.ndindex(*(len(n) for n in numbers)) if stack else [()]
        for idx in grid:
            values = {s: str(n[v]) for s, n, v in zip(stack, numbers, idx, strict=True)}
            names.update(t.format(**values) for t in templates)
    return names


def _codec(quant: Fp8Block | Mxfp4 | None) -> Fp8Codec | Mxfp4Codec | None:
    """The import codec of a checkpoint's quantization (None: tensors stored as they are)."""
    if isinstance(quant, Fp8Block):
        return Fp8Codec(quant)
    if isinstance(quant, Mxfp4):
        return Mxfp4Codec(quant)
    return None


def _stored_names(codec: Any, names: set[str], have: set[str]) -> set[str]:
    """The stored tensors that make `names` (an MXFP4 ``X``: ``X_blocks`` and ``X_scales``)."""
    stored = getattr(codec, "stored", None)
    if stored is None:
        return set(names)
    return {s for n in names for s in stored(n, have)}


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

    Reads ``config.json`` (any of :data:`MODEL_TYPES`), builds the parameter target with
    its shardings (:meth:`MoEDecoder.abstract_params`) and imports the safetensors files (one
    file, or shards with ``model.safetensors.index.json``) through :func:`name_map`: per-expert
    tensors stacked into the expert axis, q/k/v and gate/up fused, layers stacked. Each process
    reads what its shards need. Local directories only (no hub download). A published Llama 4
    directory (``Llama4ForConditionalGeneration``: model_type "llama4", the text model's
    tensors under ``language_model.``) loads its text model; the vision tower's and projector's
    tensors are skipped with a warning.

    DeepSeek-V3's and GLM-4.5's multi-token-prediction modules (``num_nextn_predict_layers``
    of them, stored as ``model.layers.{num_hidden_layers + k}.*``) load as the parameters
    ``mtp`` (FP8 ones dequantized like the trunk's, or kept in FP8 with ``base="fp8"``), and
    their copies of the embedding and output head (``embed_tokens``, ``shared_head.head``) are
    checked equal to the model's own. A config that announces modules the files do not hold
    at all (transformers drops them when it saves) loads without them, with a warning, and its
    config says ``mtp_layers = 0``.

    Published FP8 checkpoints load too (DeepSeek-style block scaling, as Qwen3-30B-A3B-FP8 ships:
    ``quantization_config`` with ``quant_method: "fp8"`` and ``weight_block_size``): each
    F8_E4M3 ``X.weight`` is read with its float32 ``X.weight_scale_inv`` and dequantized,
    ``float32(fp8) * scale`` per block, then cast to `dtype`, tensor by tensor as each process
    reads them: no host holds the model in full precision. FP8 checkpoints load dequantized:
    the parameters are those values in `dtype` (the model's ``fp8=`` option is independent of
    the checkpoint's format), unless ``base="fp8"``: then the layers' linear weights keep their
    FP8 bytes and scales as stored (``base_block`` the checkpoint's ``weight_block_size``;
    :mod:`~jaxops.models._base`), and an unquantized checkpoint's are quantized at load, tensor
    by tensor on the host, in ``base_block`` blocks.

    gpt-oss's published MXFP4 checkpoints load too (``quant_method: "mxfp4"``, OCP Microscaling
    FP4): each expert weight ``X`` stored as uint8 ``X_blocks`` (FP4 E2M1, two per byte) and
    ``X_scales`` (E8M0, one per 32 elements) is dequantized bit-exactly to float32 (every FP4
    value times a power of two is exact in float32), transposed to the layout an unquantized
    checkpoint's ``X`` has and cast to `dtype`, tensor by tensor as each process reads them
    (:class:`~jaxops.models._quant.Mxfp4Codec`); with ``base="mxfp4"`` they stay packed as
    stored (:mod:`~jaxops.models._base`). Other ``quant_method`` s are refused by name.

    Args:
      path: the model directory.
      mesh: the mesh (default: one device, ``("expert",)`` of size 1); see :class:`MoEDecoder`.
      dtype: parameter dtype (default: the config's ``dtype`` / ``torch_dtype``, else float32).
      compute_dtype: the model's compute dtype (default: `dtype`).
      progress: a progress bar (None: only on a terminal).
      **options: further :class:`MoEDecoder` fields (expert_axis, pipe_axis, num_microbatches,
        schedule, remat, capacity_factor, fp8, dispatch, router_aux_loss_coef,
        router_z_loss_coef, align, impl, lora, base, base_block). With ``lora`` (a
        :class:`jaxops.Lora`) the base weights load as published and the adapters are added
        fresh (PEFT's initialization, ``MoEDecoder.add_adapters`` with key 0), the only
        parameters training updates; with ``base="fp8"`` too, the base stays in FP8 (QLoRA).

    Returns:
      ``(model, params)``.

    Raises:
      ConfigError (ValueError): an unsupported model_type, feature or quantization, a missing
        config key.
      ConfigError: ``base="fp8"`` with another ``base_block`` than the checkpoint's, or on
        an MXFP4 checkpoint; ``base="mxfp4"`` on a checkpoint that is not MXFP4.
      CheckpointError: a tensor the config needs is missing, has another shape, or the files
        hold tensors the config does not account for (e.g. more experts or layers than it says,
        MTP modules it does not announce); an MTP module's copy of the embedding or output
        head that differs from the model's;
        an FP8 weight whose ``weight_scale_inv`` is missing or of another shape; MXFP4 blocks
        without scales (or scales without blocks), either not uint8 or of shapes that do not
        fit, or a scale code 255 (E8M0's NaN); with ``base="fp8"``, a ``weight_scale_inv``
        that is NaN, infinite, zero or negative in any block; with ``base="mxfp4"``, a scale
        code 255.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxops.models import from_pretrained  # doctest: +SKIP
      >>> model, params = from_pretrained("Qwen3-30B-A3B", mesh=jax.make_mesh((8,), ("expert",)),
      ...                                 dtype=jnp.bfloat16)  # doctest: +SKIP
    """
    op = "jaxops.models.from_pretrained"
    root = Path(path)
    config = read_config(root)
    quant = read_quantization(config.hf)
    tensors = checkpoint.hf_tensors(root)  # validated headers and index
    config = _announced_mtp(config, tensors)
    if mesh is None:
        mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    if dtype is None:
        dtype = config.hf.get("dtype") or config.hf.get("torch_dtype") or "float32"
    try:
        dtype = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise ConfigError(f"{op}: dtype {dtype!r} is not a dtype") from None
    lora = options.pop("lora", None)
    if options.get("base") is not None:
        options = _base_options(op, quant, options)
    model = MoEDecoder(config, mesh, dtype=compute_dtype or dtype, **options)
    rules = name_map(config)
    if model.base == "fp8":  # the FP8 weights' scales are parameters too
        shapes = model.layout.weight_shapes()
        rules = (*rules, *scale_rules(shapes, rules, model.base_block))
    rules = _language_model(config, rules, tensors)
    have = set(tensors)
    want = _expected_names(model, rules)
    codec = _codec(quant)
    if isinstance(quant, Mxfp4):  # blocks with their scales, of fitting shapes
        mxfp4_check(op, tensors, want)
    if model.base == "fp8":  # kept as stored (FP8), or quantized at load
        weights = _expected_names(model, [r for r in rules if r.ours in BASE_WEIGHTS])
        codec = BaseCodec(Fp8Block(model.base_block), weights, tensors)
    elif model.base == "mxfp4":  # the experts' blocks and scales as stored
        weights = _expected_names(model, [r for r in rules if r.ours in MXFP4_WEIGHTS])
        codec = Mxfp4BaseCodec(weights)
        rules = tuple(mxfp4_rules(rules))
        want = _expected_names(model, rules)
    stored = _stored_names(codec, want, have)  # an MXFP4 X: X_blocks and X_scales
    missing = sorted(stored - have)
    if missing:
        raise checkpoint.CheckpointError(
            f"{op}: {root} lacks {len(missing)} tensor(s) config.json implies, e.g. "
            f"{missing[:3]} (num_hidden_layers = {config.num_layers}, num_experts = "
            f"{config.moe.num_experts})"
        )
    if isinstance(quant, Fp8Block):  # the float8 weights' scales are read with them
        stored |= fp8_scale_names(op, quant, tensors, want)
    extra = sorted(n for n in have - stored if not _IGNORED.fullmatch(n))
    if config.tie_word_embeddings:
        extra = [n for n in extra if n != "lm_head.weight"]
    copies = {n: c for n, c in mtp_copies(config).items() if n in have}
    extra = [n for n in extra if n not in copies]
    extra = _skip_wrapper(config, extra)
    if extra:
        method = "mxfp4" if isinstance(quant, Mxfp4) else "fp8" if quant else None
        raise checkpoint.CheckpointError(
            f"{op}: {root} holds {len(extra)} tensor(s) config.json does not account "
            f"for, e.g. {extra[:3]} (num_hidden_layers = {config.num_layers}, num_experts = "
            f"{config.moe.num_experts}, tie_word_embeddings = {config.tie_word_embeddings}, "
            f"quantization_config = {method})"
        )
    target = model.abstract_params(dtype)
    if model.base == "fp8":  # read as float8, then held as its bytes
        target = as_fp8(target)
    params = checkpoint.import_safetensors(
        root, target, name_map=rules, progress=progress, codec=codec
    )
    if model.base == "fp8":
        params = as_bytes(params)
    _check_copies(op, root, params, target, copies, codec, progress)
    if lora is not None:  # the base as published, the adapters fresh (PEFT's initialization)
        model = dataclasses.replace(model, lora=lora)
        params = model.add_adapters(params, jax.random.key(0))
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
    quantize: fp8.Recipe | str | None = None,
) -> list[str]:
    """Writes `params` as a Hugging Face model directory that transformers loads.

    ``config.json`` (the config read by :func:`from_pretrained` with this model's values and the
    written dtype), safetensors shards of at most `max_shard_size` with
    ``model.safetensors.index.json``, and ``generation_config.json`` if given; tensors under the
    published names (per-expert weights unstacked). Every process must call it (the arrays are
    gathered to process 0, which writes, one array at a time). `path` must not exist or be empty.

    With ``quantize=jaxops.fp8.BLOCK`` (the block :class:`jaxops.fp8.Recipe`, the one FP8
    recipe type of every tier; or its names ``"block"`` and ``"fp8-block"``) the files are a
    block-scaled FP8 checkpoint as DeepSeek-V3 and
    Qwen3-30B-A3B-FP8 ship them: the decoder layers' linear weights (q/k/v/o projections,
    expert and shared-expert gate/up/down) are written as F8_E4M3 ``X.weight`` with a float32
    ``X.weight_scale_inv`` per 128 x 128 block (``scale = amax / 448``, quantized by
    :func:`jaxops.fp8.quantize` from the parameters' own values), and config.json gets the
    ``quantization_config`` (``quant_method: "fp8"``, ``fmt: "e4m3"``,
    ``activation_scheme: "dynamic"``, ``weight_block_size: [128, 128]``,
    ``modules_to_not_convert``). The embeddings, norms, router, shared-expert gate and lm_head
    stay in `dtype`. :func:`from_pretrained` reads it back dequantized.

    Args:
      model: the :class:`MoEDecoder`.
      params: its parameters (any sharding).
      path: the output directory.
      dtype: the written dtype of the float tensors (default: the parameters' own).
      max_shard_size: bytes per file, an int or a string like "5GB".
      generation_config: a dict written as generation_config.json.
      progress: a progress bar (None: only on a terminal).
      quantize: None (as they are) or the block recipe (``jaxops.fp8.BLOCK``, ``"block"`` or
        ``"fp8-block"``); the tensor and delayed recipes have no published format.

    Returns:
      The tensor names written (with the ``weight_scale_inv`` scales of an FP8 checkpoint).

    Raises:
      InvalidArgumentError (ValueError): an unknown `quantize`; ConfigError (one too): a config
        the model type cannot express.

    Example:
      >>> from jaxops.models import save_pretrained  # doctest: +SKIP
      >>> save_pretrained(model, params, "/tmp/finetuned", dtype="bfloat16")  # doctest: +SKIP
      >>> save_pretrained(model, params, "/tmp/fp8", dtype="bfloat16",
      ...                 quantize=jaxops.fp8.BLOCK)  # doctest: +SKIP
    """
    op = "jaxops.models.save_pretrained"
    if not isinstance(model, MoEDecoder):
        raise ArgumentTypeError(f"{op}: model must be a MoEDecoder, got {type(model).__name__}")
    if model.lora is not None:
        raise ConfigError(
            f"{op}: the model has LoRA adapters; write them with jaxops.models.save_adapter "
            "(PEFT's format, over the base checkpoint it was loaded from), or fold them into "
            "the weights with jaxops.models.merge_adapter first"
        )
    if model.base is not None:
        raise ConfigError(
            f"{op}: the model keeps its base in FP8 (base={model.base!r}); the checkpoint it "
            "was loaded from holds it already. Write adapters with jaxops.models.save_adapter, "
            "or merge them (jaxops.models.merge_adapter dequantizes) and save that"
        )
    if isinstance(quantize, str):
        quantize = _FORMATS.get(quantize, quantize)
    quantize = fp8.as_recipe(quantize, op, allowed=("block",), name="quantize")
    if quantize and family(model.config.model_type).names.fused_experts:
        raise ConfigError(
            f"{op}: quantize={quantize!r} writes each expert's [out, in] weights in 128 x 128 "
            f"blocks; {model.config.model_type} checkpoints hold a layer's experts as one "
            "[E, in, out] tensor, for which that format has no published layout"
        )
    written = np.dtype(jnp.dtype(dtype)) if dtype is not None else np.dtype(params["embed"].dtype)
    rules = name_map(model.config)
    config = model.config.to_hf(written)
    codec = None
    if quantize == fp8.BLOCK:
        quant = Fp8Block()
        # the MTP modules' layers as the trunk's (DeepSeek-V3 ships them so)
        quantized = [r for r in rules if r.ours in BASE_WEIGHTS]
        codec = Fp8Codec(quant, _expected_names(model, quantized))
        config["quantization_config"] = quant.to_hf(_unquantized_linears(model))
    # each MTP module's copies of the embedding and head, as published (one array, two names)
    source = params
    copies = list(mtp_copies(model.config).items())
    if copies:
        source = {
            **params,
            "mtp_copies": {str(j): params[k] for j, (_, (k, _)) in enumerate(copies)},
        }
        rules = (
            *rules,
            *(Rule(f"mtp_copies/{j}", n, transpose=t) for j, (n, (_, t)) in enumerate(copies)),
        )
    return checkpoint.export_safetensors(
        source,
        path,
        max_shard_size=max_shard_size,
        name_map=rules,
        dtype=None if dtype is None else written.name,
        progress=progress,
        config=config,
        generation_config=generation_config,
        codec=codec,
    )


def _base_options(op: str, quant: Fp8Block | Mxfp4 | None, options: dict[str, Any]) -> dict:
    """`options` of a quantized base: ``base_block`` the checkpoint's own FP8 blocks."""
    if options["base"] == "mxfp4":
        if not isinstance(quant, Mxfp4):
            raise ConfigError(
                f"{op}: base='mxfp4' keeps a published MXFP4 checkpoint's expert bytes "
                "(gpt-oss's); this checkpoint's quantization_config is "
                f"{'none' if quant is None else type(quant).__name__}: use base='fp8'"
            )
        return options
    if isinstance(quant, Mxfp4):
        raise ConfigError(
            f"{op}: base={options['base']!r} keeps block-FP8 weights; this checkpoint's experts "
            "are MXFP4 (gpt-oss): keep them with base='mxfp4', or load dequantized (base=None)"
        )
    if isinstance(quant, Fp8Block):
        block = tuple(options.get("base_block", quant.block))
        if block != tuple(quant.block):
            raise ConfigError(
                f"{op}: base_block={list(block)} differs from the checkpoint's "
                f"weight_block_size {list(quant.block)}; its FP8 bytes are kept as stored"
            )
        options = {**options, "base_block": tuple(quant.block)}
    return options


def _language_model(config: Any, rules: Sequence[Rule], tensors: Any) -> tuple[Rule, ...]:
    """`rules`, their names under the wrapper's prefix when the files are the family's wrapper's.

    The published Llama-4-Scout and Maverick checkpoints (Llama4ForConditionalGeneration) hold
    the text model as ``language_model.model.*`` and ``language_model.lm_head.weight``;
    transformers' Llama4ForCausalLM reads them by that prefix too.
    """
    wrapper = family(config.model_type).wrapper
    if (
        wrapper is None
        or "model.embed_tokens.weight" in tensors
        or wrapper.prefix + "model.embed_tokens.weight" not in tensors
    ):
        return tuple(rules)

    def prefixed(theirs):
        if isinstance(theirs, str):
            return wrapper.prefix + theirs
        return tuple(wrapper.prefix + t for t in theirs)

    return tuple(dataclasses.replace(r, theirs=prefixed(r.theirs)) for r in rules)


def _skip_wrapper(config: Any, extra: list[str]) -> list[str]:
    """`extra` less the wrapper's other tensors (Llama 4's vision tower), skipped with a warning."""
    wrapper = family(config.model_type).wrapper
    if wrapper is None or not wrapper.skipped:
        return extra
    skipped = [n for n in extra if n.startswith(wrapper.skipped)]
    if skipped:
        warnings.warn(
            f"jaxops.models.from_pretrained: skipped {len(skipped)} tensor(s) of "
            f"{wrapper.skipped_what} ({', '.join(p + '*' for p in wrapper.skipped)}): "
            "jaxops.models builds the text model",
            stacklevel=3,
        )
    return [n for n in extra if not n.startswith(wrapper.skipped)]


def _announced_mtp(config: Any, tensors: Any) -> Any:
    """`config`, without MTP modules when it announces some and the files hold none at all.

    (transformers loads DeepSeek-V3 and GLM-4.5 without them and saves the config as it read
    it.) Some of a module's tensors missing is the usual missing-tensor error.
    """
    if not config.mtp_layers:
        return config
    first = config.num_layers
    present = any(
        (m := _LAYER.match(n)) and first <= int(m[1]) < first + config.mtp_layers for n in tensors
    )
    if present:
        return config
    layers = mtp_layers(config)
    warnings.warn(
        f"jaxops.models.from_pretrained: config.json announces {config.mtp_layers} "
        f"multi-token-prediction module(s) (num_nextn_predict_layers; model.layers."
        f"{layers[0]}.*) and the files hold none (transformers drops them when it saves): "
        "loaded without them (mtp_layers = 0)",
        stacklevel=3,
    )
    return dataclasses.replace(config, mtp_layers=0)


def _check_copies(
    op: str,
    root: Path,
    params: dict[str, Any],
    target: dict[str, Any],
    copies: dict[str, tuple[str, Any]],
    codec: Any,
    progress: bool | None,
) -> None:
    """The MTP modules' copies of the embedding and head in the files equal the model's own."""
    for name, (key, transpose) in copies.items():
        rule = Rule("copy", name, transpose=transpose)
        copy = checkpoint.import_safetensors(
            root, {"copy": target[key]}, name_map=[rule], progress=progress, codec=codec
        )["copy"]
        if not bool(jnp.array_equal(copy, params[key])):
            own = "model.embed_tokens.weight" if key == "embed" else "lm_head.weight"
            raise checkpoint.CheckpointError(
                f"{op}: {root}'s {name} differs from {own}; "
                "the multi-token-prediction modules share the model's embedding and output "
                "head, so the copies stored beside them must equal those"
            )


def _unquantized_linears(model: MoEDecoder) -> list[str]:
    """The torch Linear modules an FP8 export leaves unquantized (``modules_to_not_convert``).

    transformers' FP8 loader swaps every other ``nn.Linear`` for an FP8 one; the routers are no
    ``nn.Linear`` in transformers 5 but are listed for older versions.
    """
    names = family(model.config.model_type).names
    out = ["lm_head", f"{names.moe}.{names.router}"]
    if model.config.mtp_layers:  # the MTP modules' projection and head copy stay unquantized
        out += ["eh_proj", "shared_head.head"]
    if model.config.moe.shared_ffn and model.config.moe.shared_gate:
        out.append(f"{names.moe}.{names.shared}_gate")
    return out
