"""MoE blocks of published models as ``jaxops.parallel.expert`` layers.

DeepSeek-V3, Qwen-MoE, OLMoE and Mixtral: the router, routed experts and shared experts of one
layer, read from Hugging Face files. The MoE spec is the family registry's
(:func:`~jaxops.models._families.moe_layers`: each family's own ``read``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jaxops.parallel import checkpoint
from jaxops.parallel import expert as ep

from jaxops._errors import ConfigError, InvalidArgumentError, named_errors

from ._families import moe_layers
from ._families._keys import positive
from ._names import moe_block_rules
from ._quant import read_quantization

__all__ = ["BLOCK_MODEL_TYPES", "is_moe_layer", "load_moe_block", "moe_block_config"]

#: model_type values whose MoE block :func:`moe_block_config` reads.
BLOCK_MODEL_TYPES = ("deepseek_v3", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe")


def _model_type(hf: Any) -> str:
    if not isinstance(hf, dict):
        raise ConfigError(f"config must be a dict (config.json), got {type(hf).__name__}")
    kind = hf.get("model_type")
    if kind not in BLOCK_MODEL_TYPES:
        raise ConfigError(
            f"config.json: model_type {kind!r} has no MoE block here; supported: "
            f"{', '.join(BLOCK_MODEL_TYPES)}"
        )
    return kind


@named_errors("jaxops.models.is_moe_layer")
def is_moe_layer(hf: dict[str, Any], layer: int) -> bool:
    """Whether layer `layer` of the model is an MoE layer.

    DeepSeek-V3's first ``first_k_dense_replace`` layers are dense FFNs; so are Qwen's
    ``mlp_only_layers`` and the layers ``decoder_sparse_step`` skips. `hf` needs the MoE keys
    a published config.json holds (the family's keys without a transformers default).

    Example:
      >>> from jaxops.models import is_moe_layer
      >>> hf = {"model_type": "deepseek_v3", "num_experts_per_tok": 8, "first_k_dense_replace": 3}
      >>> [is_moe_layer(hf, i) for i in range(5)]
      [False, False, False, True, True]
    """
    _model_type(hf)
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise InvalidArgumentError(f"layer must be an int >= 0, got {layer!r}")
    return layer in moe_layers(hf, layer + 1)[1]


@named_errors("jaxops.models.moe_block_config")
def moe_block_config(
    hf: dict[str, Any],
    *,
    expert_axis: str = "expert",
    data_axes: tuple[str, ...] = (),
    dtype: Any = jnp.float32,
    **overrides: Any,
) -> ep.MoEConfig:
    """The :class:`~jaxops.parallel.expert.MoEConfig` of a published model's MoE block.

    - DeepSeek-V3: sigmoid scores, the ``e_score_correction_bias`` for the choice only,
      ``n_group`` / ``topk_group`` group-limited choice, ``norm_topk_prob``,
      ``routed_scaling_factor``, ``n_shared_experts`` shared experts as one FFN of width
      ``n_shared_experts * moe_intermediate_size``.
    - Qwen2-MoE: softmax, ``norm_topk_prob``, a shared expert of width
      ``shared_expert_intermediate_size`` behind a sigmoid gate. Qwen3-MoE: softmax,
      ``norm_topk_prob``. OLMoE: softmax, ``norm_topk_prob``, experts of width
      ``intermediate_size``. Mixtral: softmax, renormalized.

    Args:
      hf: the config.json dict.
      expert_axis: the mesh axis of the experts.
      data_axes: further mesh axes the tokens are split over.
      dtype: the experts' compute dtype.
      **overrides: other MoEConfig fields (capacity_factor, fp8, router_aux_loss_coef, ...).

    Example:
      >>> from jaxops.models import moe_block_config
      >>> cfg = moe_block_config({"model_type": "deepseek_v3", "hidden_size": 64,
      ...     "moe_intermediate_size": 32, "n_routed_experts": 16, "num_experts_per_tok": 4,
      ...     "n_group": 4, "topk_group": 2, "n_shared_experts": 2})
      >>> cfg.router, cfg.router_bias, cfg.routed_scaling_factor, cfg.shared_ffn
      ('sigmoid', True, 2.5, 64)
    """
    _model_type(hf)
    spec, _ = moe_layers(hf, 1)  # the family's read (transformers' defaults)
    return ep.MoEConfig(
        spec=dataclasses.replace(spec, router_aux_loss_coef=0.0),
        hidden_size=positive(hf, "hidden_size"),
        router_z_loss_coef=0.0,
        expert_axis=expert_axis,
        data_axes=data_axes,
        dtype=dtype,
        **overrides,
    )


@named_errors("jaxops.models.load_moe_block")
def load_moe_block(
    path: str | os.PathLike,
    layer: int,
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype: Any = jnp.float32,
    **config_options: Any,
) -> tuple[ep.MoEConfig, dict[str, jax.Array]]:
    """The MoE block of one layer of a Hugging Face model directory, as a ``moe_layer``.

    Returns ``(cfg, params)`` for :func:`jaxops.parallel.expert.moe_layer`, params sharded on
    `mesh`.

    The router bias (DeepSeek-V3's ``e_score_correction_bias``) is kept in float32.

    Args:
      path: the model directory (config.json + safetensors).
      layer: the layer index; a dense layer (:func:`is_moe_layer` false) raises.
      mesh: where the experts go (``cfg.expert_axis`` must be an axis; default one device).
      dtype: parameter dtype.
      **config_options: passed to :func:`moe_block_config`.

    Example:
      >>> from jaxops.models import load_moe_block  # doctest: +SKIP
      >>> cfg, params = load_moe_block("DeepSeek-V3", 3, mesh=mesh)  # doctest: +SKIP
      >>> y, aux = moe_layer(params, x, cfg, mesh=mesh)  # doctest: +SKIP
    """
    import json

    root = Path(path)
    try:
        hf = json.loads((root / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{root}: no config.json") from None
    if read_quantization(hf) is not None:
        raise ConfigError(
            f"{root}: a quantized checkpoint ({hf['quantization_config'].get('quant_method')}); "
            "load_moe_block reads unquantized weights only (jaxops.models.from_pretrained reads "
            "FP8 block and MXFP4 checkpoints)"
        )
    kind = _model_type(hf)
    op = "jaxops.models.load_moe_block"
    layers = positive(hf, "num_hidden_layers")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
        raise InvalidArgumentError(f"{op}: layer must be an int in [0, {layers}), got {layer!r}")
    if not is_moe_layer(hf, layer):
        raise InvalidArgumentError(
            f"{op}: layer {layer} of {root} is a dense layer (first_k_dense_replace / "
            "mlp_only_layers / decoder_sparse_step in config.json)"
        )
    cfg = moe_block_config(hf, **config_options)
    if mesh is None:
        mesh = jax.make_mesh((1,), (cfg.expert_axis,), devices=jax.devices()[:1])
    specs = ep.moe_param_specs(cfg)
    target = {
        name: jax.ShapeDtypeStruct(
            shape,
            np.float32 if name == "router_bias" else np.dtype(jnp.dtype(dtype)),
            sharding=NamedSharding(mesh, specs[name]),
        )
        for name, shape in cfg.param_shapes.items()
    }
    params = checkpoint.import_safetensors(root, target, name_map=moe_block_rules(kind, layer, cfg))
    return cfg, params
