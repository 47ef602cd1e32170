"""LoRA adapters in PEFT's format: ``adapter_config.json`` and ``adapter_model.safetensors``.

What PEFT's ``PeftModel.from_pretrained`` loads onto transformers' model of the family (and
:func:`load_adapter` reads back). The attention's adapters are PEFT's ``lora.Linear`` ones
(``target_modules``; GQA's q/k/v/o, MLA's q_a/q_b (or q), kv_a_proj_with_mqa, kv_b, o):
``...self_attn.q_proj.lora_A.weight [r, in]`` (our ``A`` transposed) and ``lora_B.weight
[out, r]``. The routed experts' are PEFT's ``target_parameters`` LoRA on the
fused expert tensors (``ParamWrapper``, one rank-r pair per expert): ``lora_A.weight [E r, in]``
holds expert e's ``A_e`` transposed in rows ``e r .. e r + r`` (expert-major), ``lora_B.weight
[out, E r]`` its ``B_e`` transposed in columns ``k E + e`` (rank-major), and PEFT's delta of
expert e is ``scaling * B_e^T A_e^T`` in the tensor's own ``[out, in]`` layout, our ``A_e @ B_e``
transposed. Both expert tensors of a module targeted, the first (``gate_up_proj``) is wrapped
inside the second: its names carry ``.base_layer``. Llama 4's fused tensors are read by PEFT
as ``[E, out, in]`` (:attr:`Family.peft_swapped`): there ``lora_A`` holds B and ``lora_B`` A.
The multi-token-prediction modules' layers, when their loss trains adapters on them, are
``model.layers.{L + k}`` (where the checkpoint stores them): PEFT applies those to the last
layers of transformers' model built with ``num_hidden_layers = L + D`` (transformers builds no
MTP modules; on its ``L``-layer model PEFT leaves them unused).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxops.parallel import checkpoint

from jaxops._errors import ArgumentTypeError, ConfigError, named_errors

from ._adapters import (
    DENSE_TARGETS,
    EXPERT_TARGETS,
    MLA_TARGETS,
    ROUTER_TARGET,
    SHARED_TARGETS,
    attention_targets,
)
from ._decoder import MoEDecoder
from ._families import family
from ._mtp import BLOCK
from ._names import mtp_layers

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "load_adapter", "merge_adapter", "save_adapter"]

#: The adapter directory's files, as PEFT names them.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers"


def _layer_stacks(model: MoEDecoder) -> dict[str, tuple[int, ...]]:
    """Our stacks of layers (their keys in the parameter tree) -> the model layers of their rows.

    The MTP modules' layers (``mtp/block``) are ``model.layers.{L + k}``, as stored.
    """
    c = model.config
    out = {"layers": c.moe_layers, "dense_layers": c.pattern.dense_layers}
    if c.mtp_layers:
        out[BLOCK] = mtp_layers(c)
    return out


def _stack(params: dict[str, Any], key: str) -> dict[str, Any]:
    """The subtree of stack `key` ("mtp/block": ``params["mtp"]["block"]``), {} if absent."""
    for part in key.split("/"):
        params = params.get(part, {})
    return params


def _moe_stacks(model: MoEDecoder) -> dict[str, tuple[int, ...]]:
    """The stacks of MoE layers: the trunk's, and the MTP modules' when they have adapters."""
    out = {"layers": model.config.moe_layers}
    if _mtp_adapted(model):
        out[BLOCK] = mtp_layers(model.config)
    return out


def _mtp_adapted(model: MoEDecoder) -> bool:
    """Whether the MTP modules' layers carry adapters (``Layout.mtp_layout``)."""
    return bool(model.config.mtp_layers) and model.layout.mtp_layout.lora is not None


def _expert_names(model: MoEDecoder) -> dict[str, str]:
    """Our expert weight -> its PEFT module path below ``model.layers.{i}``."""
    fam = family(model.config.model_type)
    experts = [EXPERT_TARGETS[t] for t in model.lora.targets if t in EXPERT_TARGETS]
    base = f"{fam.moe_module}.experts"
    nested = len(experts) == 2  # gate_up_proj's wrapper inside down_proj's
    return {w: base + (".base_layer" if nested and w == "w_in" else "") for w in experts}


def _shared_names(model: MoEDecoder) -> dict[str, str]:
    """The shared expert's adapted projections and the router: our name -> its PEFT path.

    (Below ``model.layers.{i}``; each a 2-D weight PEFT adapts as a ``lora.Linear``'s.)
    """
    fam = family(model.config.model_type)
    out = {
        SHARED_TARGETS[t]: f"{fam.moe_module}.{fam.names.shared}.{t.split('.')[-1]}"
        for t in model.lora.targets
        if t in SHARED_TARGETS
    }
    if ROUTER_TARGET in model.lora.targets:
        out["router"] = f"{fam.moe_module}.{fam.names.router}"
    return out


def _dense_targets(lora: Any) -> list[str]:
    return [t for t in lora.targets if t in DENSE_TARGETS]


def _dense_names(model: MoEDecoder) -> list[str]:
    """The dense MLP's adapted projections (``gate_proj``, ...) of the model's targets."""
    return [t.removeprefix("mlp.") for t in _dense_targets(model.lora)]


def _to_peft(a: np.ndarray, b: np.ndarray, swapped: bool) -> tuple[np.ndarray, np.ndarray]:
    """Our ``a [E, in, r]``, ``b [E, r, out]`` as PEFT's ``(lora_A [E r, .], lora_B [., E r])``."""
    e, n_in, r = a.shape
    n_out = b.shape[-1]
    if swapped:
        return b.reshape(e * r, n_out), a.transpose(1, 2, 0).reshape(n_in, r * e)
    return a.transpose(0, 2, 1).reshape(e * r, n_in), b.transpose(2, 1, 0).reshape(n_out, r * e)


def _host(x: jax.Array) -> np.ndarray:
    """float32 numpy copy of a (small) global array, on every process."""
    if not getattr(x, "is_fully_addressable", True):
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x, np.float32)


def _from_peft(lora_a: np.ndarray, lora_b: np.ndarray, e: int, swapped: bool):
    """The inverse of :func:`_to_peft`: ``(a [E, in, r], b [E, r, out])``."""
    if swapped:
        lora_a, lora_b = lora_b, lora_a  # lora_A [E r, out] <- b, lora_B [in, r E] <- a
        n_in, n_out = lora_a.shape[0], lora_b.shape[1]
        r = lora_b.shape[0] // e
        a = lora_a.reshape(n_in, r, e).transpose(2, 0, 1)
        b = lora_b.reshape(e, r, n_out)
        return a, b
    r = lora_a.shape[0] // e
    a = lora_a.reshape(e, r, -1).transpose(0, 2, 1)
    b = lora_b.reshape(lora_b.shape[0], r, e).transpose(2, 1, 0)
    return a, b


def _peft_tensors(model: MoEDecoder, params: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every adapter tensor by its PEFT name (float32, on the host of every process)."""
    out: dict[str, np.ndarray] = {}
    for stack, layers in _layer_stacks(model).items():
        p = _stack(params, stack)
        for name in attention_targets(model.config):
            if f"{name}_lora_a" not in p:
                continue
            a, b = _host(p[f"{name}_lora_a"]), _host(p[f"{name}_lora_b"])
            for row, layer in enumerate(layers):
                key = f"{_PREFIX}.{layer}.self_attn.{name}"
                out[f"{key}.lora_A.weight"] = a[row].T
                out[f"{key}.lora_B.weight"] = b[row].T
    fam = family(model.config.model_type)
    mlp = params.get("dense_layers", {}).get("mlp", {})
    for name in _dense_names(model):
        a, b = _host(mlp[f"{name}_lora_a"]), _host(mlp[f"{name}_lora_b"])
        for row, layer in enumerate(model.config.pattern.dense_layers):
            key = f"{_PREFIX}.{layer}.{fam.moe_module}.{name}"
            out[f"{key}.lora_A.weight"] = a[row].T
            out[f"{key}.lora_B.weight"] = b[row].T
    swapped = fam.peft_swapped
    for stack, layers in _moe_stacks(model).items():
        moe = _stack(params, stack)["moe"]
        for weight, module in _shared_names(model).items():
            a, b = _host(moe[f"{weight}_lora_a"]), _host(moe[f"{weight}_lora_b"])
            for row, layer in enumerate(layers):
                key = f"{_PREFIX}.{layer}.{module}"
                out[f"{key}.lora_A.weight"] = a[row].T
                out[f"{key}.lora_B.weight"] = b[row].T
        for weight, module in _expert_names(model).items():
            a, b = _host(moe[f"{weight}_lora_a"]), _host(moe[f"{weight}_lora_b"])
            for row, layer in enumerate(layers):
                lora_a, lora_b = _to_peft(a[row], b[row], swapped)
                key = f"{_PREFIX}.{layer}.{module}"
                out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = lora_a, lora_b
    return out


def _adapter_config(model: MoEDecoder) -> dict[str, Any]:
    lora = model.lora
    fam = family(model.config.model_type)
    parameters = [
        *(f"{fam.moe_module}.{t.removeprefix('mlp.')}.weight" for t in _dense_targets(lora)),
        *(f"{path}.weight" for path in _shared_names(model).values()),
        *(f"{fam.moe_module}.{t}" for t in lora.targets if t in EXPERT_TARGETS),
    ]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "use_rslora": lora.rslora,
        "target_modules": [t for t in lora.targets if t in attention_targets(model.config)],
        # PEFT moves target_modules named gate_proj / up_proj / down_proj onto the fused
        # experts: the dense MLP's and the shared experts' are named as parameters (saved as
        # lora.Linear's are)
        "target_parameters": parameters,
        # a training setting (the adapter's inference is the same); PEFT refuses a dropout
        # with target_parameters, on which jaxops drops nothing either
        "lora_dropout": 0.0 if parameters else lora.dropout,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def _check_lora(op: str, model: Any) -> None:
    if not isinstance(model, MoEDecoder):
        raise ArgumentTypeError(f"{op}: model must be a MoEDecoder, got {type(model).__name__}")
    if model.lora is None:
        raise ConfigError(f"{op}: the model has no adapters (MoEDecoder(..., lora=jaxops.Lora))")


@named_errors("jaxops.models.save_adapter")
def save_adapter(model: MoEDecoder, params: dict[str, Any], path: str | os.PathLike) -> Path:
    """Writes the model's LoRA adapters as a PEFT adapter directory (float32).

    ``adapter_config.json`` (r, lora_alpha, use_rslora, the attention's ``target_modules`` and
    the experts' ``target_parameters``) and ``adapter_model.safetensors``, which
    ``peft.PeftModel.from_pretrained(model, path)`` loads onto transformers' model of the
    family (the base checkpoint :func:`~jaxops.models.from_pretrained` read) and
    :func:`load_adapter` reads back. The base weights are not written; the MTP modules' layers'
    adapters (a model with ``mtp_loss_weight > 0``) are, as ``model.layers.{L + k}``'s. Every
    process calls it (the adapters are gathered); process 0 writes.

    Args:
      model: a :class:`~jaxops.models.MoEDecoder` with ``lora``.
      params: its parameters (the adapters' leaves are read).
      path: the directory; must not exist, or be empty.

    Returns:
      The directory.
    """
    op = "jaxops.models.save_adapter"
    _check_lora(op, model)
    out = Path(path)
    tensors = {k: np.ascontiguousarray(v) for k, v in _peft_tensors(model, params).items()}
    scratch = Path(tempfile.mkdtemp(prefix="jaxops-adapters-"))
    try:
        checkpoint.export_safetensors(tensors, scratch / "out", progress=False)
        if jax.process_index() == 0:
            out.mkdir(parents=True, exist_ok=True)
            if any(out.iterdir()):
                raise ConfigError(f"{op}: {out} is not empty")
            shutil.move(str(scratch / "out" / "model.safetensors"), out / ADAPTER_WEIGHTS)
            (out / ADAPTER_CONFIG).write_text(json.dumps(_adapter_config(model), indent=2))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


@named_errors("jaxops.models.load_adapter")
def load_adapter(
    model: MoEDecoder, params: dict[str, Any], path: str | os.PathLike
) -> dict[str, Any]:
    """`params` with its adapters read from a PEFT adapter directory (:func:`save_adapter`).

    What PEFT wrote (``PeftModel.save_pretrained`` of a LoRA on transformers' model of the
    family) or :func:`save_adapter` did. The directory's rank, alpha, rsLoRA and targets must be
    the model's ``lora`` (its ``adapter_config.json`` is checked), and PEFT features jaxops does
    not build (another adapter type, DoRA, LoRA biases, per-module ranks or alphas, trained
    copies of whole modules, a layer subset) are refused naming the key; every adapter tensor
    the model has must be there with its shape (CheckpointError naming it), but for a
    trunk-only adapter read into a model that trains its MTP modules' adapters: theirs in
    `params` are kept (with a warning), so a LoRA trained without the MTP loss goes on with it.
    Adapters of layers past the trunk that the model has none of (an MTP module's, for a model
    whose modules are frozen) are refused (ConfigError). The adapters are placed as the
    parameters are.
    """
    op = "jaxops.models.load_adapter"
    _check_lora(op, model)
    root = Path(path)
    try:
        config = json.loads((root / ADAPTER_CONFIG).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{op}: {root} has no {ADAPTER_CONFIG}") from None
    unsupported = {
        "peft_type": ("LORA",),
        "use_dora": (False, None),
        "lora_bias": (False, None),
        "bias": ("none", None),
        "rank_pattern": ({}, None),
        "alpha_pattern": ({}, None),
        "modules_to_save": (None, []),
        "layers_to_transform": (None, []),
    }
    for key, allowed in unsupported.items():
        if config.get(key) not in allowed:
            raise ConfigError(
                f"{op}: {root}/{ADAPTER_CONFIG} has {key} = {config.get(key)!r}; jaxops reads "
                f"LoRA adapters with {key} in {list(allowed)}"
            )
    want = _adapter_config(model)
    keys = ("r", "lora_alpha", "use_rslora", "target_modules", "target_parameters")
    differ = [
        f"{k}={config.get(k)!r} (the model's {want[k]!r})"
        for k in keys
        if (sorted(config.get(k) or []) if k.startswith("target") else config.get(k))
        != (sorted(want[k]) if k.startswith("target") else want[k])
    ]
    if differ:
        raise ConfigError(f"{op}: {root} holds other adapters: {', '.join(differ)}")
    from safetensors.numpy import load_file

    stored = load_file(str(root / ADAPTER_WEIGHTS))
    expected = _peft_tensors(model, params)
    missing = sorted(set(expected) - set(stored))
    past_trunk = [k for k in expected if _layer_of(k) >= model.config.num_layers]
    keep_mtp = bool(past_trunk) and not any(k in stored for k in past_trunk)
    if keep_mtp:  # a trunk-only adapter, into a model that trains its MTP modules' adapters too
        warnings.warn(
            f"{op}: {root} holds no adapters of the MTP modules' layers (model.layers."
            f"{model.config.num_layers}..); theirs in params are kept (fresh ones add nothing)",
            stacklevel=3,
        )
        missing = [k for k in missing if k not in past_trunk]
    if missing:
        raise checkpoint.CheckpointError(
            f"{op}: {root} lacks {len(missing)} adapter tensor(s), e.g. {missing[:3]}"
        )
    past = [k for k in stored if k not in expected and _layer_of(k) >= model.config.num_layers]
    if past:  # adapters of MTP modules' layers (model.layers.{L + k}) the model has none of
        raise ConfigError(
            f"{op}: {root} holds {len(past)} adapter tensor(s) of layers past the trunk's "
            f"{model.config.num_layers}, e.g. {sorted(past)[:2]}: the MTP modules' adapters. "
            "The model's MTP layers carry adapters only when its MTP loss trains them: load "
            "them into a model with mtp_loss_weight > 0 (and mtp_layers as trained)"
        )
    for k, v in expected.items():
        if k in stored and stored[k].shape != v.shape:
            raise checkpoint.CheckpointError(
                f"{op}: {k} has shape {stored[k].shape} in {root}, the model's is {v.shape}"
            )
    return _place(model, params, stored, keep_mtp)


def _layer_of(name: str) -> int:
    """The layer index of a PEFT tensor name (``...model.layers.{i}....``), -1 if it has none."""
    rest = name.removeprefix(_PREFIX + ".")
    head = rest.split(".", 1)[0]
    return int(head) if rest != name and head.isdigit() else -1


def _place(
    model: MoEDecoder, params: dict[str, Any], stored: dict[str, np.ndarray], keep_mtp: bool
):
    """`params` with the adapter leaves built from PEFT's tensors `stored`, on their shardings.

    `keep_mtp`: the MTP modules' layers keep the adapters they have in `params`.
    """
    out = jax.tree.map(lambda x: x, params)
    shardings = model.shardings()

    def stacked(name: str, layers: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        a = np.stack([stored[name.format(i) + ".lora_A.weight"].T for i in layers])
        b = np.stack([stored[name.format(i) + ".lora_B.weight"].T for i in layers])
        return a, b

    def put(node: dict, where: Any, leaf: str, value: np.ndarray) -> None:
        node[leaf] = jax.device_put(value.astype(node[leaf].dtype), where[leaf])

    stacks = _layer_stacks(model)
    moe_stacks = _moe_stacks(model)
    if keep_mtp:
        stacks.pop(BLOCK, None)
        moe_stacks.pop(BLOCK, None)
    for stack, layers in stacks.items():
        p, where = _stack(out, stack), _stack(shardings, stack)
        for name in attention_targets(model.config):
            if f"{name}_lora_a" not in p:
                continue
            a, b = stacked(f"{_PREFIX}.{{}}.self_attn.{name}", layers)
            put(p, where, f"{name}_lora_a", a)
            put(p, where, f"{name}_lora_b", b)
    fam = family(model.config.model_type)
    mlp = out.get("dense_layers", {}).get("mlp", {})
    for name in _dense_names(model):
        a, b = stacked(f"{_PREFIX}.{{}}.{fam.moe_module}.{name}", model.config.pattern.dense_layers)
        put(mlp, shardings["dense_layers"]["mlp"], f"{name}_lora_a", a)
        put(mlp, shardings["dense_layers"]["mlp"], f"{name}_lora_b", b)
    swapped = fam.peft_swapped
    e = model.config.moe.num_experts
    for stack, layers in moe_stacks.items():
        moe, where = _stack(out, stack)["moe"], _stack(shardings, stack)["moe"]
        for weight, module in _shared_names(model).items():
            a, b = stacked(f"{_PREFIX}.{{}}.{module}", layers)
            put(moe, where, f"{weight}_lora_a", a)
            put(moe, where, f"{weight}_lora_b", b)
        for weight, module in _expert_names(model).items():
            pairs = [
                _from_peft(
                    stored[f"{_PREFIX}.{i}.{module}.lora_A.weight"],
                    stored[f"{_PREFIX}.{i}.{module}.lora_B.weight"],
                    e,
                    swapped,
                )
                for i in layers
            ]
            for k, leaf in enumerate((f"{weight}_lora_a", f"{weight}_lora_b")):
                put(moe, where, leaf, np.stack([pair[k] for pair in pairs]))
    return out


def _delta(scaling: float, a: jax.Array, b: jax.Array) -> jax.Array:
    """float32 ``scaling * a @ b`` over the leading (layer, expert) axes."""
    return scaling * jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32))


def _merged_layer(model: MoEDecoder, p: dict[str, Any]) -> dict[str, Any]:
    """One stack's parameters with its adapters folded into their weights (and dropped)."""
    c, s = model.config, model.lora.scaling
    out = {k: v for k, v in p.items() if "_lora_" not in k}
    adds: dict[str, list[tuple[slice, jax.Array]]] = {}

    def add(weight: str, name: str, part: slice = slice(None), where: dict | None = None):
        src = p if where is None else where
        if f"{name}_lora_a" in src:
            delta = _delta(s, src[f"{name}_lora_a"], src[f"{name}_lora_b"])
            adds.setdefault(weight, []).append((part, delta))

    if c.attention.mla is None:
        q, kv = c.attention.q_size, c.attention.kv_size
        add("w_qkv", "q_proj", slice(0, q))
        add("w_qkv", "k_proj", slice(q, q + kv))
        add("w_qkv", "v_proj", slice(q + kv, q + 2 * kv))
        add("w_o", "o_proj")
    else:
        for name, weight in MLA_TARGETS.items():
            add(weight, name)
    for weight, deltas in adds.items():
        w = out[weight].astype(jnp.float32)
        for part, delta in deltas:
            w = w.at[..., part].add(delta)
        out[weight] = w.astype(p[weight].dtype)
    if "mlp" in p:
        mlp = {k: v for k, v in p["mlp"].items() if "_lora_" not in k}
        f = mlp["w_out"].shape[-2]
        w_in = mlp["w_in"].astype(jnp.float32)
        for name, part in (("gate_proj", slice(0, f)), ("up_proj", slice(f, 2 * f))):
            if f"{name}_lora_a" in p["mlp"]:
                w_in = w_in.at[..., part].add(
                    _delta(s, p["mlp"][f"{name}_lora_a"], p["mlp"][f"{name}_lora_b"])
                )
        mlp["w_in"] = w_in.astype(p["mlp"]["w_in"].dtype)
        if "down_proj_lora_a" in p["mlp"]:
            delta = _delta(s, p["mlp"]["down_proj_lora_a"], p["mlp"]["down_proj_lora_b"])
            mlp["w_out"] = (mlp["w_out"].astype(jnp.float32) + delta).astype(mlp["w_out"].dtype)
        out["mlp"] = mlp
    if "moe" in p:
        m = p["moe"]
        moe = {k: v for k, v in m.items() if "_lora_" not in k}
        for weight in ("w_in", "w_out", "shared_w_out", "router"):
            name = "shared_down_proj" if weight == "shared_w_out" else weight
            if f"{name}_lora_a" in m:
                delta = _delta(s, m[f"{name}_lora_a"], m[f"{name}_lora_b"])
                moe[weight] = (moe[weight].astype(jnp.float32) + delta).astype(m[weight].dtype)
        if "shared_w_in" in m:
            fs = m["shared_w_out"].shape[-2]
            w_in = m["shared_w_in"].astype(jnp.float32)
            for name, part in (
                ("shared_gate_proj", slice(0, fs)),
                ("shared_up_proj", slice(fs, None)),
            ):
                if f"{name}_lora_a" in m:
                    w_in = w_in.at[..., part].add(
                        _delta(s, m[f"{name}_lora_a"], m[f"{name}_lora_b"])
                    )
            moe["shared_w_in"] = w_in.astype(m["shared_w_in"].dtype)
        out["moe"] = moe
    return out


@named_errors("jaxops.models.merge_adapter")
def merge_adapter(model: MoEDecoder, params: dict[str, Any]) -> tuple[MoEDecoder, dict[str, Any]]:
    """The model without adapters and `params` with them folded into the base weights.

    Each adapted weight becomes ``W + scaling * A @ B`` (computed in float32, stored in the
    weight's dtype; the q / k / v parts of ``w_qkv`` and the gate / up halves of the MLPs'
    ``w_in`` each take their own adapter), laid out as the plain model lays out its
    parameters. ``jaxops.models.save_pretrained`` then writes a full checkpoint. A base
    kept in FP8 (``base="fp8"``) is dequantized first, into the model's compute dtype: the
    merged model has an unquantized base (``base=None``), each merged weight one copy.

    Returns:
      ``(model, params)``: ``dataclasses.replace(model, lora=None, base=None)`` and its
      parameters.
    """
    _check_lora("jaxops.models.merge_adapter", model)
    plain = dataclasses.replace(model, lora=None, base=None)

    def merge(params):
        out = dict(params)
        for stack in ("layers", "dense_layers"):
            if stack in params:
                layers = model.layout.dequantized(params[stack], stack)
                out[stack] = _merged_layer(model, layers)
        if "mtp" in params:  # the MTP modules' layers (adapted when their loss trained them)
            block = model.layout.dequantized(params["mtp"]["block"], BLOCK)
            out["mtp"] = {**params["mtp"], "block": _merged_layer(model, block)}
        return out

    with jax.set_mesh(model.mesh):
        merged = jax.jit(merge, out_shardings=plain.shardings())(params)
    return plain, merged
