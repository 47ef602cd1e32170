"""The decoder laid out on its mesh: :class:`Layout`, the value its objective and steps run on.

:class:`Layout` is built once by :class:`~jaxops.models.MoEDecoder` from its fields (the config,
the mesh and the runtime settings, validated there) and held as ``model.layout``. It says where
every parameter and batch row lives (shapes, PartitionSpecs, shardings, ZeRO shards and the
ZeRO-3 gathers, initialization, batch placement), how the layers compute (:attr:`Layout.ops`,
remat, scan unroll, the runs of layers of one kind) and computes the embedding and the head.
The layer loops are the functions of :mod:`~jaxops.models._run`, the objective and the steps
those of :mod:`~jaxops.models._objective`, :mod:`~jaxops.models._train` and
:mod:`~jaxops.models._generate`, all of a Layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxops.parallel import expert as ep

from jaxops._config import ImplChoice
from jaxops._errors import ConfigError
from jaxops._lora import Lora
from jaxops._sharding import axes_of, constrain, manual_axes, padded_spec, place
from jaxops.fp8 import Recipe

from . import _base, _layers, _loss, _mla
from ._adapters import MOE_TARGETS, adapters_of, attention_targets, is_adapter, with_frozen
from ._config import DecoderConfig
from ._names import name_map

__all__ = ["CAST_BEFORE_GATHER", "GATHERED", "Layout", "Settings", "without_gathered"]

_INIT_STD = 0.02  # transformers' initializer_range for these models
# Leaves initialized to zeros: biases and the attention sinks.
_ZERO_INIT = tuple(
    f"['{k}']"
    for k in ("b_qkv", "b_o", "router_bias", "router_logit_bias", "b_in", "b_out", "sinks")
)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)


def _is_sharding(x: Any) -> bool:
    return isinstance(x, NamedSharding)


#: The checkpoint name of ZeRO-3's gathered weights, which a layer's backward gathers again.
GATHERED = "zero_gathered"


#: Weights the layers use only cast to the compute dtype (projections, expert FFNs, output
#: head), which ZeRO-3 casts before it gathers them. Not the embedding (its gradient is a
#: scatter-add of rows, which must sum in the stored dtype), norms, biases, sinks or the
#: router, which the layers use in float32.
CAST_BEFORE_GATHER = frozenset(
    (
        *("w_qkv", "w_o", "w_q", "w_q_a", "w_q_b", "w_kv_a", "w_kv_b", "w_in", "w_out"),
        *("shared_w_in", "shared_w_out", "lm_head"),
    )
)
_CAST_KEYS = frozenset(jax.tree_util.DictKey(k) for k in CAST_BEFORE_GATHER)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather_as(
    x: jax.Array, compute: Any, stored: Any, target: NamedSharding, source: NamedSharding
) -> jax.Array:
    """`x` cast to `compute`, then laid out on `target` (the all-gather moves `compute`).

    The gradient is cast back to `stored` before it is laid out on `source`, so the reduction
    the partitioner inserts there (a reduce-scatter of the devices' partial sums) sums in
    `stored`, as it did with the cast after the gather.
    """
    narrow = x.astype(compute)
    if jnp.issubdtype(compute, jnp.floating) and compute.itemsize == 2:
        # moved as 16-bit integers: XLA:CPU computes bfloat16 / float16 collectives in
        # float32 (converting around them), which would undo the saving
        bits = jax.lax.bitcast_convert_type(narrow, jnp.uint16)
        return jax.lax.bitcast_convert_type(constrain(bits, target), compute)
    return constrain(narrow, target)


def _gather_as_fwd(x, compute, stored, target, source):
    return _gather_as(x, compute, stored, target, source), None


def _gather_as_bwd(compute, stored, target, source, _, ct):
    return (constrain(ct.astype(stored), source),)


_gather_as.defvjp(_gather_as_fwd, _gather_as_bwd)


def _initialized(abstract: Any, key: jax.Array) -> Any:
    """Arrays for the ``jax.ShapeDtypeStruct`` leaves of `abstract`, placed on their shardings.

    normal(0, 0.02) matrices (transformers' initializer_range), unit norms, zero biases; LoRA
    adapters as PEFT: A uniform in ``+-1 / sqrt(in)``, B zero. None leaves stay None.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)

    def make(key):
        keys = jax.random.split(key, len(leaves))
        out = []
        for (path, leaf), k in zip(leaves, keys, strict=True):
            name = jax.tree_util.keystr(path)
            if name.endswith("_lora_b']") or (
                not is_adapter(path) and "norm" not in name and name.endswith(_ZERO_INIT)
            ):
                out.append(jnp.zeros(leaf.shape, leaf.dtype))
            elif is_adapter(path):
                bound = 1.0 / np.sqrt(leaf.shape[-2])
                u = jax.random.uniform(k, leaf.shape, jnp.float32, -bound, bound)
                out.append(u.astype(leaf.dtype))
            elif "norm" in name:
                out.append(jnp.ones(leaf.shape, leaf.dtype))
            else:
                out.append((jax.random.normal(k, leaf.shape) * _INIT_STD).astype(leaf.dtype))
        return jax.tree_util.tree_unflatten(treedef, out)

    out_shardings = jax.tree.map(lambda a: a.sharding, abstract)
    return jax.jit(make, out_shardings=out_shardings)(key)


def _inserted(params: Any, extra: Any) -> Any:
    """`params` (nested dicts) with the non-None leaves of `extra` added at their paths."""
    if not isinstance(extra, dict):
        return extra
    out = dict(params)
    for k, v in extra.items():
        if v is not None:
            out[k] = _inserted(params.get(k, {}), v)
    return out


def without_gathered(
    remat: bool | Callable, names: tuple[str, ...] = (GATHERED,)
) -> bool | Callable:
    """`remat` keeping nothing of `names` (:data:`GATHERED`; False: everything else)."""
    if remat is True:
        return True
    if remat is False:
        return jax.checkpoint_policies.save_anything_except_these_names(*names)

    def policy(prim, *args, **params):
        if params.get("name") in names:
            return False
        return remat(prim, *args, **params)

    return policy


#: What a layer keeps for its backward under ``remat="matmuls"``: the projections' outputs and
#: every XLA dot's.
_MATMULS = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable,
    jax.checkpoint_policies.save_only_these_names(_layers.PROJECTION),
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The decoder's fields, defined once: the config, the mesh and the runtime settings.

    :class:`~jaxops.models.MoEDecoder` (which documents each, validates and normalizes them)
    and :class:`Layout` (which runs on them) are both these fields.
    """

    config: DecoderConfig
    mesh: jax.sharding.Mesh
    expert_axis: str = "expert"
    pipe_axis: str = "pipe"
    context_axis: str = "context"
    num_microbatches: int = 1
    schedule: str = "1f1b"
    remat: bool | str | Callable | None = None
    dtype: Any = jnp.float32
    capacity_factor: float | None = None
    fp8: Recipe | str | None = None
    dispatch: str = "dtype"
    exchange: str = "auto"
    router_aux_loss_coef: float | None = None
    router_z_loss_coef: float = 0.0
    align: int = 8
    impl: ImplChoice = None
    moe_impl: str = "ep"
    attention_impl: str = "auto"
    attention_block: int = 512
    zero: int = 0
    scan_unroll: int | bool = 1
    grad_reduce: str = "flat"
    vocab_chunk: int | None = None
    lora: Lora | None = None
    base: str | None = None
    base_block: tuple[int, int] = (128, 128)
    mtp_loss_weight: float = 0.0


@dataclasses.dataclass(frozen=True)
class Layout(Settings):
    """The decoder on its mesh: parameter layout, batch placement, how the layers compute.

    A frozen value of :class:`~jaxops.models.MoEDecoder`'s fields (:class:`Settings`, already
    validated and normalized by it: ``remat`` a policy name, callable or None, ``dtype`` a
    numpy dtype, ``fp8`` a recipe or None); hashable, so jitted functions take it as a static
    argument. Built by :meth:`of`.
    """

    @classmethod
    def of(cls, settings: Settings) -> Layout:
        """The layout of `settings` (a :class:`~jaxops.models.MoEDecoder`): the same fields."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(Settings)})

    def check_mesh(self, op: str) -> None:
        """The mesh's axes fit the config (ConfigError naming what does not)."""
        shape = dict(self.mesh.shape)
        if self.expert_axis not in shape:
            raise ConfigError(
                f"{op}: the mesh has no axis {self.expert_axis!r} (expert_axis); its axes are "
                f"{tuple(shape)}. On one device use jax.make_mesh((1,), ('expert',))"
            )
        if self.config.moe.num_experts % shape[self.expert_axis]:
            raise ConfigError(
                f"{op}: num_experts = {self.config.moe.num_experts} must be divisible by the size "
                f"{shape[self.expert_axis]} of the expert axis {self.expert_axis!r}"
            )
        c = self.config
        if len(c.moe_layers) % self.pipe:
            raise ConfigError(
                f"{op}: the {len(c.moe_layers)} MoE layers (num_layers = {c.num_layers} less "
                f"{len(c.pattern.dense_layers)} dense) must be divisible by the size {self.pipe} "
                f"of the pipe axis {self.pipe_axis!r}"
            )
        if self.pipe > 1 and c.pattern.dense_layers != tuple(range(len(c.pattern.dense_layers))):
            raise ConfigError(
                f"{op}: with a pipeline the dense layers must come first (they run ahead of "
                f"the pipeline stages); got dense_layers = {c.pattern.dense_layers}"
            )
        if self.expert_axis == self.pipe_axis:
            raise ConfigError(
                f"{op}: expert_axis and pipe_axis are both {self.expert_axis!r}; the experts and "
                "the pipeline stages need two different mesh axes"
            )

    @property
    def pipe(self) -> int:
        """Pipeline stages: the size of the pipe axis (1 without one)."""
        return dict(self.mesh.shape).get(self.pipe_axis, 1)

    @property
    def context(self) -> int:
        """Context devices each sequence is split over: the size of the context axis (1 without)."""
        return dict(self.mesh.shape).get(self.context_axis, 1)

    @property
    def input_axes(self) -> tuple[str, ...]:
        """The mesh axes a batch's ``[B, S]`` rows are split over as given (:meth:`place_batch`).

        The batch axes; with a context axis all but it: each sequence is split over the context
        axis into chunk pairs inside the step (:mod:`~jaxops.models._context`).
        """
        return tuple(a for a in self.batch_axes if self.context == 1 or a != self.context_axis)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Mesh axes the batch is split over besides the expert axis (all but expert and pipe)."""
        return tuple(a for a in self.mesh.axis_names if a not in (self.expert_axis, self.pipe_axis))

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """All mesh axes the batch is split over: ``(*data_axes, expert_axis)``."""
        return (*self.data_axes, self.expert_axis)

    @property
    def batch_devices(self) -> int:
        """The devices of the batch axes: how many shards the batch is split into."""
        return int(np.prod([dict(self.mesh.shape)[a] for a in self.batch_axes]))

    @functools.cached_property
    def ops(self) -> _layers.Ops:
        """How the layers compute: dtype, impl, FP8, mesh, the attention."""
        platform = self.mesh.devices.flat[0].platform
        attention = self.attention_impl
        if attention == "auto":  # cuDNN's where it applies on a GPU, else blockwise
            half = np.dtype(self.dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
            attention = "dot_product" if platform == "gpu" and half else "blockwise"
        if self.context > 1:  # a sequence split over devices: only the ring sees all its keys
            attention = "blockwise"
        return _layers.Ops(
            self.dtype,
            self.impl,
            self.fp8,
            self.mesh,
            attention=attention,
            attention_block=self.attention_block,
            context_axis=self.context_axis if self.context > 1 else None,
            context=self.context,
            # in a pipeline stage a ring's collective-permute would name the devices of every
            # stage, which run other work at that tick (_blockwise.gathered_attention)
            context_exchange="gather" if self.pipe > 1 else "ring",
            lora_scaling=None if self.lora is None else self.lora.scaling,
            lora_dropout=0.0 if self.lora is None else self.lora.dropout,
        )

    @property
    def unroll(self) -> int | bool:
        """``lax.scan``'s unroll for the layer scans (``scan_unroll``; False is 1)."""
        return self.scan_unroll if self.scan_unroll is True else max(int(self.scan_unroll), 1)

    @property
    def remat_policy(self) -> bool | Callable:
        """What a layer keeps for its backward: False (everything), True (its input) or a policy.

        (``remat`` None: "none", or "matmuls" with a quantized base.)
        """
        if callable(self.remat):
            return self.remat
        remat = self.remat
        if remat is None:  # the default: "none", "matmuls" on a quantized base
            remat = "none" if self.base is None else "matmuls"
        return {"none": False, "full": True, "matmuls": _MATMULS}[remat]

    @property
    def flat_grads(self) -> bool:
        """Whether the gradients are reduced as flat buffers in one ``shard_map``.

        (``grad_reduce="flat"`` where it takes over: no pipeline, one microbatch, ``zero`` 0
        or 1, the expert-parallel MoE layer and more than one device on the batch axes.)
        """
        return (
            self.grad_reduce == "flat"
            and self.lora is None
            and self.pipe == 1
            and self.num_microbatches == 1
            and self.zero in (0, 1)
            and self.moe_impl == "ep"
            and self.batch_devices > 1
        )

    @property
    def flat_zero(self) -> bool:
        """Whether the train step reduce-scatters flat gradient buffers into ZeRO-1 shards.

        (:mod:`~jaxops.models._flat`; the updated shards are all-gathered by the partitioner.)
        """
        return self.flat_grads and self.zero == 1

    def place(self, x: jax.Array) -> jax.Array:
        """Activations ``[B, ...]`` split over the batch axes.

        A no-op off Explicit meshes, and inside a ``shard_map`` over the batch axes (the flat
        gradient step's), where `x` holds this device's rows.
        """
        if all(a in manual_axes() for a in self.batch_axes):
            return x
        return place(x, self.mesh, P(self.batch_axes))

    def embed(self, table: jax.Array, tokens: jax.Array, where: _layers.Tokens) -> jax.Array:
        """The tokens' rows of `table`, split over the batch axes; 0 at padding."""
        table = self.gather(table, P(), self.zero_specs()["embed"])
        x = self.place(_layers.embed(self.ops, table, tokens))
        if where.segments is not None:
            x = jnp.where(where.valid[..., None], x, jnp.zeros((), x.dtype))
        return x

    def head_params(self, params: dict[str, Any], cast: bool = True) -> dict[str, Any]:
        """The final norm and output projection, gathered (`cast`: see :meth:`gather`)."""
        key = "embed" if self.config.tie_word_embeddings else "lm_head"
        zero = self.zero_specs()
        head = {"final_norm": params["final_norm"], key: params[key]}
        return self.gather(head, P(), {k: zero[k] for k in head}, cast)

    def head(self, head: dict[str, Any], h: jax.Array) -> jax.Array:
        """float32 logits of the last layer's output `h` (`head`: :meth:`head_params`)."""
        return _layers.head(self.ops, self.config, head, h)

    def losses(self, head: dict[str, Any], h: jax.Array, targets: jax.Array):
        """``(sum, count)`` of the cross-entropy of ``head(head, h)`` (by ``vocab_chunk``)."""
        return _loss.head_losses(self.ops, self.config, head, h, targets, self.vocab_chunk)

    def token_nll(self, head: dict[str, Any], h: jax.Array, targets: jax.Array) -> jax.Array:
        """float32 cross-entropy of each target (0 where ignored; by ``vocab_chunk``)."""
        return _loss.head_nll(self.ops, self.config, head, h, targets, self.vocab_chunk)

    def stages(self, layers: dict[str, Any]) -> dict[str, Any]:
        """``[L, ...]`` layers as ``[P, L / P, ...]`` pipeline stages (a view of the sharding)."""
        n = self.pipe
        return jax.tree.map(lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:]), layers)

    def pipeline_keywords(self) -> dict[str, Any]:
        """The keywords every pipeline call of the decoder shares."""
        return {
            "mesh": self.mesh,
            "num_microbatches": self.num_microbatches,
            "pipe_axis": self.pipe_axis,
            "data_axes": self.batch_axes,
            "has_aux": True,
            "param_specs": self.layer_specs(None),
        }

    def gather(self, tree: Any, specs: Any, source: Any, cast: bool = True) -> Any:
        """ZeRO-3: `tree` (parameters stored on `source` specs) laid out on `specs`.

        The weights the layers only use cast to the compute dtype (:data:`CAST_BEFORE_GATHER`)
        are cast before they are gathered, when that narrows them (float32 parameters,
        bfloat16 compute): half the all-gather's bytes and of the gathered copies, the same
        values. Their gradients are reduced in the stored dtype, as when cast after the gather
        (:func:`_gather_as`); `cast` False gathers every leaf in its own dtype (where the caller
        differentiates the gathered tree itself). Named :data:`GATHERED`, so that a layer's
        backward gathers them again. Else `tree`.
        """
        if self.zero != 3:
            return tree
        if isinstance(specs, P):
            specs = jax.tree.map(lambda _: specs, tree)
        if isinstance(source, P):
            source = jax.tree.map(lambda _: source, tree)
        compute = np.dtype(self.dtype)

        def one(path, a, spec, src):
            target = self.named(spec)
            stored = np.dtype(a.dtype)
            if (
                cast
                and path
                and path[-1] in _CAST_KEYS
                and jnp.issubdtype(stored, jnp.floating)
                and stored.itemsize > compute.itemsize
            ):
                return _gather_as(a, compute, stored, target, self.named(src))
            return constrain(a, target)

        gathered = jax.tree_util.tree_map_with_path(one, tree, specs, source)
        return jax.ad_checkpoint.checkpoint_name(gathered, GATHERED)

    @functools.cached_property
    def moe(self) -> ep.MoEConfig:
        """The MoE layer's config: the config's MoE spec and how it runs on this mesh.

        (``router_aux_loss_coef``, when given, replaces the spec's.)
        """
        spec = self.config.moe
        if self.router_aux_loss_coef is not None:
            spec = dataclasses.replace(spec, router_aux_loss_coef=self.router_aux_loss_coef)
        lora = self.lora
        experts = [] if lora is None else [MOE_TARGETS[t] for t in lora.targets if t in MOE_TARGETS]
        return ep.MoEConfig(
            lora=dataclasses.replace(lora, targets=tuple(experts)) if experts else None,
            spec=spec,
            hidden_size=self.config.hidden_size,
            capacity_factor=self.capacity_factor,
            router_z_loss_coef=self.router_z_loss_coef,
            align=self.align,
            expert_axis=self.expert_axis,
            data_axes=self.data_axes,
            dtype=self.dtype,
            fp8=self.fp8,
            dispatch=self.dispatch,
            exchange=self.exchange,
        )

    def param_shapes(self) -> dict[str, Any]:
        """The parameter tree's shapes: :meth:`weight_shapes` and a quantized base's scales.

        With ``base="fp8"`` each base weight ``X`` (:data:`~jaxops.models._base.BASE_WEIGHTS`)
        has its float32 scales ``X_scale_inv`` beside it, one per block; with ``base="mxfp4"``
        the routed experts' ``w_in`` / ``w_out`` are packed ``[L, E, in / 2, out]`` bytes with
        ``X_scales [L, E, in / 32, out]`` E8M0 codes (:mod:`~jaxops.models._base`).
        """
        tree = self.weight_shapes()
        for key, maps in self.block_maps.items():
            *path, name = key.split("/")
            node = tree
            for part in path:
                node = node[part]
            shape = node[name]
            node[name + _base.SCALE] = (shape[0], *_base.scale_shape(shape[1:], maps))
        if self.base == "mxfp4":
            for key in self.base_keys:
                node = tree["layers"]["moe"]
                name = key.rsplit("/", 1)[1]
                node[name], node[name + _base.MXFP4_SCALES] = _base.mxfp4_shapes(node[name])
        return tree

    @property
    def base_keys(self) -> frozenset[str]:
        """The tree keys of the weights a quantized base holds as bytes ({} unquantized)."""
        if self.base == "mxfp4":
            return _base.MXFP4_WEIGHTS
        return frozenset(self.block_maps)

    @functools.cached_property
    def block_maps(self) -> dict[str, _base.Maps]:
        """Per base weight, its blocks (:func:`~jaxops.models._base.block_maps`); {} unquantized."""
        if self.base != "fp8":
            return {}
        return _base.block_maps(self.weight_shapes(), name_map(self.config), self.base_block)

    def weight_shapes(self) -> dict[str, Any]:
        """The parameter tree's shapes (``layers`` leaves stacked ``[Lm, ...]``), unquantized.

        ``embed [V, D]``; per MoE layer (``layers``, the config's ``moe_layers`` in order)
        ``attn_norm [D]``, the attention's (GQA: ``w_qkv [D, (Hq + 2 Hkv) Dh]`` (q, k, v side
        by side), ``b_qkv`` (Qwen2, GLM, gpt-oss), ``q_norm, k_norm [Dh]`` (Qwen3, GLM;
        ``[Hq Dh]`` and ``[Hkv Dh]`` for OLMoE and MiniMax-M2), ``w_o [Hq Dh, D]``, ``b_o``
        (Qwen3's, OLMoE's and gpt-oss's attention_bias), ``sinks [Hq]`` (gpt-oss); MLA: those
        of ``jaxops.models._mla``), ``mlp_norm [D]``, ``moe`` (``MoEConfig.param_shapes``:
        ``router [D, E]``, ``router_logit_bias [E]`` (gpt-oss), ``router_bias [E]`` (float32),
        ``w_in [E, D, 2F]`` (gate, up; interleaved for gpt-oss), ``w_out [E, F, D]``, ``b_in
        [E, 2F]`` and ``b_out [E, D]`` (gpt-oss), the shared experts); per dense
        layer (``dense_layers [Ld, ...]``, present when the config has dense layers) the same
        with ``mlp`` (``w_in [D, 2F]``, ``w_out [F, D]``) for ``moe``; then ``final_norm [D]``
        and ``lm_head [D, V]`` (absent with tied embeddings); with the config's MTP modules
        ``mtp`` (each leaf stacked ``[mtp_layers, ...]``: :meth:`_mtp_shapes`). Kernels are
        ``[in, out]``.
        """
        c = self.config
        d = c.hidden_size
        attn = self.attention_shapes()

        def stack(layer, n):
            return jax.tree.map(lambda s: (n, *s), layer, is_leaf=lambda s: isinstance(s, tuple))

        moe = {**attn, "moe": dict(self.moe.param_shapes)}
        tree = {"embed": (c.vocab_size, d), "layers": stack(moe, len(c.moe_layers))}
        if c.pattern.dense_layers:
            f = c.pattern.dense_ffn
            mlp = {"w_in": (d, 2 * f), "w_out": (f, d)}
            widths = {"gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
            for name in () if self.lora is None else self.lora.targets:
                name = name.removeprefix("mlp.")
                if name in widths:
                    mlp[f"{name}_lora_a"] = (widths[name][0], self.lora.rank)
                    mlp[f"{name}_lora_b"] = (self.lora.rank, widths[name][1])
            dense = {**attn, "mlp": mlp}
            tree["dense_layers"] = stack(dense, len(c.pattern.dense_layers))
        tree["final_norm"] = (d,)
        if not c.tie_word_embeddings:
            tree["lm_head"] = (d, c.vocab_size)
        if c.mtp_layers:
            tree["mtp"] = stack(self._mtp_shapes(), c.mtp_layers)
        return tree

    def attention_shapes(self) -> dict[str, Any]:
        """One layer's norms' and attention's shapes (with its adapters), for weight_shapes."""
        c = self.config
        d = c.hidden_size
        attn: dict[str, Any] = {"attn_norm": (d,)}
        if c.attention.mla is not None:
            attn.update(_mla.param_shapes(c))
        else:
            qkv = c.attention.q_size + 2 * c.attention.kv_size
            attn["w_qkv"] = (d, qkv)
            if c.attention.qkv_bias:
                attn["b_qkv"] = (qkv,)
            if c.attention.qk_norm:
                whole = c.attention.qk_norm_width == "projection"
                attn["q_norm"] = (c.attention.q_size,) if whole else (c.attention.head_dim,)
                attn["k_norm"] = (c.attention.kv_size,) if whole else (c.attention.head_dim,)
            attn["w_o"] = (c.attention.q_size, d)
            if c.attention.o_bias:
                attn["b_o"] = (d,)
            if c.attention.attention_sinks:
                attn["sinks"] = (c.attention.num_heads,)
        widths = attention_targets(c)
        for name in () if self.lora is None else self.lora.targets:
            if name in widths:
                n_in, n_out = widths[name]
                attn[f"{name}_lora_a"] = (n_in, self.lora.rank)
                attn[f"{name}_lora_b"] = (self.lora.rank, n_out)
        attn["mlp_norm"] = (d,)
        return attn

    def _mtp_shapes(self) -> dict[str, Any]:
        """One multi-token-prediction module's shapes (unstacked; :mod:`~jaxops.models._mtp`).

        ``enorm, hnorm [D]``, ``eh_proj [2D, D]`` (the embedding's rows first), ``head_norm
        [D]`` and ``block``: an MoE layer's parameters as :attr:`mtp_layout` lays them out
        (with the trunk's adapters only where the MTP loss trains them).
        """
        d = self.config.hidden_size
        block_layout = self.mtp_layout
        block = {**block_layout.attention_shapes(), "moe": dict(block_layout.moe.param_shapes)}
        return {"enorm": (d,), "hnorm": (d,), "eh_proj": (2 * d, d), "head_norm": (d,),
                "block": block}  # fmt: skip

    @functools.cached_property
    def mtp_layout(self) -> Layout:
        """The layout the MTP modules' layers run on (:mod:`~jaxops.models._mtp`).

        This one, its FP8 base included (a module's linear weights are base weights like the
        trunk's: ``mtp/block/...`` of :data:`~jaxops.models._base.BASE_WEIGHTS`; an MXFP4 base
        packs the trunk's routed experts only, as gpt-oss publishes them, and leaves the
        modules' layers unquantized); its LoRA adapters only when the MTP loss trains the
        modules (``mtp_loss_weight > 0``): frozen modules carry none.
        """
        lora = self.lora if self.mtp_trained else None
        base = None if self.base == "mxfp4" else self.base
        if (lora, base) == (self.lora, self.base):
            return self
        return dataclasses.replace(self, lora=lora, base=base)

    @property
    def mtp_trained(self) -> bool:
        """Whether the loss has the MTP modules' term (``mtp_layers`` and a weight > 0)."""
        return bool(self.config.mtp_layers) and self.mtp_loss_weight > 0

    @property
    def runs(self) -> tuple[tuple[str, int, int, int], ...]:
        """:meth:`runs_in` of every layer."""
        return self.runs_in(None)

    def stack_of(self, layer: int) -> str:
        """The stack of model layer `layer`: "dense_layers" or "layers" (MoE)."""
        return "dense_layers" if layer in self.config.pattern.dense_layers else "layers"

    def stack_rows(self, stop: int) -> dict[str, int]:
        """Per stack, how many of its layers come before model layer `stop`."""
        keys = [self.stack_of(i) for i in range(stop)]
        return {k: keys.count(k) for k in ("layers", "dense_layers")}

    def runs_in(self, stop: int | None) -> tuple[tuple[str, int, int, int], ...]:
        """``(stack, start, stop, first layer)`` of each run of consecutive layers of one kind.

        In layer order, of the layers before `stop` (None: all); `stack` is "layers" (MoE) or
        "dense_layers", ``start:stop`` the run's rows of that stack and `first layer` the
        model's index of its first layer.
        """
        runs: list[list] = []
        count = {"layers": 0, "dense_layers": 0}
        for i in range(self.config.num_layers if stop is None else stop):
            key = self.stack_of(i)
            if runs and runs[-1][0] == key:
                runs[-1][2] += 1
            else:
                runs.append([key, count[key], count[key] + 1, i])
            count[key] += 1
        return tuple(tuple(r) for r in runs)

    @functools.cached_property
    def period(self) -> tuple[int, tuple[str, ...]] | None:
        """``(first layer, stacks)`` of layers that repeat one pattern of both kinds, or None.

        The layers from `first layer` on repeat the pattern `stacks` at least twice (Llama 4
        Maverick's and ERNIE's dense / MoE alternation): they run as one scan over the repeats.
        """
        keys = [self.stack_of(i) for i in range(self.config.num_layers)]
        for first in range(len(keys)):
            tail = keys[first:]
            for n in range(2, len(tail) // 2 + 1):
                if len(tail) % n == 0 and len(set(tail[:n])) == 2:
                    if tail == tail[:n] * (len(tail) // n):
                        return first, tuple(tail[:n])
        return None

    def layer_specs(self, lead: Any) -> dict[str, Any]:
        shapes = self.param_shapes()["layers"]
        specs = {k: P(lead) for k in shapes if k != "moe"}
        moe_specs = ep.moe_param_specs(self.moe)
        if self.moe_impl == "dense":  # every device runs every expert
            moe_specs = {k: P() for k in moe_specs}
        specs["moe"] = {k: P(lead, *s) for k, s in moe_specs.items() if k in shapes["moe"]}
        for k in shapes["moe"]:  # a quantized base weight's scales: laid out as the weight
            for suffix in (_base.SCALE, _base.MXFP4_SCALES):
                if k.endswith(suffix) and k.removesuffix(suffix) in specs["moe"]:
                    specs["moe"][k] = specs["moe"][k.removesuffix(suffix)]
        return specs

    def compute_specs(self) -> dict[str, Any]:
        """PartitionSpecs of the parameters as the layers use them.

        MoE layers over the pipe axis, experts over the expert axis, everything else
        replicated (the dense layers too). Without ZeRO-3 the parameters are stored so.
        """
        lead = self.pipe_axis if self.pipe > 1 else None
        specs = {"embed": P(), "layers": self.layer_specs(lead)}
        if self.config.pattern.dense_layers:  # replicated (with a pipeline they run ahead of it)
            shapes = self.param_shapes()["dense_layers"]
            specs["dense_layers"] = jax.tree.map(lambda _: P(), shapes, is_leaf=_is_shape)
        specs["final_norm"] = P()
        if not self.config.tie_word_embeddings:
            specs["lm_head"] = P()
        if self.config.mtp_layers:  # after the last stage: replicated over the pipe axis
            specs["mtp"] = {
                "enorm": P(), "hnorm": P(), "eh_proj": P(), "head_norm": P(),
                "block": self.mtp_layout.layer_specs(None),
            }  # fmt: skip
        return specs

    def zero_specs(self) -> dict[str, Any]:
        """PartitionSpecs of the ZeRO shards: :meth:`compute_specs` split over the batch axes.

        Each parameter is split over every batch axis (``data_axes`` and the expert axis, size
        > 1) it is replicated on, one axis at a time on its first dimension that the axis
        divides: a weight replicated on all ``N`` devices of the batch axes keeps ``1 / N`` of
        itself per device, an expert weight ``1 / D`` (D: the data axes' devices). A dimension
        no axis divides stays whole (a norm of odd width). The optimizer state is laid out so
        with ``zero >= 1`` and the parameters with ``zero = 3``.

        The first dimension, not the largest, keeps each device's shard in few contiguous
        pieces: a split of a row-major array's last dimension made XLA:CPU copy every
        parameter and optimizer state into a transposed layout for the update and back after
        the all-gather (measured on 2 x 4 CPU devices, 4x256x16x2x256 adamw: 65 ms per update
        with the largest dimension, 28 ms with the first, 39 ms without ZeRO). With ``zero =
        1`` a stack's layer axis is split too (the update is elementwise); with ``zero = 3``
        never (the layer scan slices it).
        """
        sizes = dict(self.mesh.shape)
        axes = [a for a in self.batch_axes if sizes[a] > 1]

        def split(spec: P, shape: tuple[int, ...], first: int) -> P:
            entries = list(padded_spec(NamedSharding(self.mesh, spec), len(shape)))
            local = [
                n // int(np.prod([sizes[a] for a in axes_of([e])]))
                for n, e in zip(shape, entries, strict=True)
            ]
            for a in (a for a in axes if a not in axes_of(entries)):
                fit = [i for i in range(first, len(shape)) if local[i] % sizes[a] == 0]
                if not fit:
                    continue
                i = fit[0]
                entries[i] = (*axes_of([entries[i]]), a)
                local[i] //= sizes[a]
            return P(*(e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in entries))

        shapes = self.param_shapes()
        out = {}
        for key, specs in self.compute_specs().items():
            first = 1 if self.zero == 3 and key in ("layers", "dense_layers", "mtp") else 0
            out[key] = jax.tree.map(
                lambda s, shape, f=first: split(s, shape, f), specs, shapes[key], is_leaf=_is_spec
            )
        return out

    def param_specs(self) -> dict[str, Any]:
        """PartitionSpecs the parameters are stored with.

        :meth:`compute_specs`, or with ``zero = 3`` :meth:`zero_specs` (the layers gather
        what they use).
        """
        return self.zero_specs() if self.zero == 3 else self.compute_specs()

    def shardings(self) -> dict[str, Any]:
        """NamedShardings of :meth:`param_specs` on the mesh."""
        return self.named(self.param_specs())

    def named(self, specs: Any) -> Any:
        """A pytree of PartitionSpecs as NamedShardings on the mesh."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=_is_spec)

    def optimizer_shardings(self, optimizer: Any, params: Any = None) -> Any:
        """NamedShardings of the state of an optax-style `optimizer` for these parameters.

        Every subtree of ``optimizer.init(params)`` shaped like the parameters (Adam's moments)
        takes :meth:`zero_specs` with ``zero >= 1``, else the parameters' own; any other leaf
        (a step count) is replicated.

        Args:
          optimizer: anything with ``init(params)`` (an ``optax.GradientTransformation``).
          params: the parameters or their abstract twin (default :meth:`abstract_params`).
        """
        params = self.trainable(self.abstract_params() if params is None else params)
        state = jax.eval_shape(optimizer.init, params)
        treedef = jax.tree.structure(params)
        specs = self.trainable_specs(self.zero_specs() if self.zero >= 1 else self.param_specs())
        moments = self.named(specs)
        replicated = NamedSharding(self.mesh, P())

        def like(x):
            return moments if jax.tree.structure(x) == treedef else replicated

        return jax.tree.map(like, state, is_leaf=lambda x: jax.tree.structure(x) == treedef)

    def init_optimizer(self, optimizer: Any, params: dict[str, Any]) -> Any:
        """``optimizer.init(params)`` laid out by :meth:`optimizer_shardings` (ZeRO shards)."""
        shardings = self.optimizer_shardings(optimizer, params)
        with jax.set_mesh(self.mesh):
            init = jax.jit(lambda p: constrain(optimizer.init(p), shardings))
            return init(self.trainable(params))

    @property
    def frozen(self) -> bool:
        """Whether training leaves some parameters as they are (:meth:`trainable`)."""
        return self.lora is not None or (bool(self.config.mtp_layers) and not self.mtp_trained)

    def trainable(self, params: Any) -> Any:
        """The parameters training updates, every other leaf None.

        All; with ``lora`` the adapters only (:func:`adapters_of`); the MTP modules (``mtp``)
        only with ``mtp_loss_weight > 0``.
        """
        return self._trainable(params, None)

    def trainable_specs(self, specs: Any) -> Any:
        """:meth:`trainable` of a tree of PartitionSpecs (or NamedShardings)."""
        return self._trainable(specs, lambda x: isinstance(x, P | NamedSharding))

    def _trainable(self, tree: Any, is_leaf: Callable | None) -> Any:
        if self.lora is not None:
            return adapters_of(tree, is_leaf=is_leaf)
        if isinstance(tree, dict) and "mtp" in tree and not self.mtp_trained:
            return {**tree, "mtp": jax.tree.map(lambda _: None, tree["mtp"], is_leaf=is_leaf)}
        return tree

    def with_trained(self, trained: Any, params: Any) -> Any:
        """`params` with :meth:`trainable`'s leaves from `trained`."""
        return with_frozen(trained, params) if self.frozen else trained

    def gathered(self, params: dict[str, Any]) -> dict[str, Any]:
        """`params` laid out as the layers use them (:meth:`compute_specs`; ZeRO-3 gathered)."""
        return jax.device_put(params, self.named(self.compute_specs()))

    def abstract_params(self, dtype: Any = jnp.float32) -> dict[str, Any]:
        """The parameter tree as ``jax.ShapeDtypeStruct`` s with their shardings (a load target).

        The MoE router's correction bias (``router_bias``, GLM and DeepSeek) stays float32.
        """
        dtype = np.dtype(dtype)
        shardings = self.shardings()
        leaves, treedef = jax.tree_util.tree_flatten_with_path(
            self.param_shapes(), is_leaf=_is_shape
        )
        base = {tuple(k.split("/")) for k in self.base_keys}
        if self.base == "mxfp4":
            base |= {(*k[:-1], k[-1] + _base.MXFP4_SCALES) for k in base}

        def dtype_of(path: tuple) -> np.dtype:
            names = tuple(getattr(k, "key", None) for k in path)
            if names in base:
                return np.dtype(np.uint8)  # FP8 bytes, packed MXFP4, E8M0 codes
            if names[-1] == "router_bias" or names[-1].endswith(_base.SCALE):
                return np.dtype(np.float32)
            return dtype

        out = [
            jax.ShapeDtypeStruct(shape, dtype_of(path), sharding=sharding)
            for (path, shape), sharding in zip(
                leaves, jax.tree.leaves(shardings, is_leaf=_is_sharding), strict=True
            )
        ]
        return jax.tree_util.tree_unflatten(treedef, out)

    def init(self, key: jax.Array, dtype: Any = jnp.float32) -> dict[str, Any]:
        """Random parameters placed on the mesh.

        normal(0, 0.02) matrices (transformers' initializer_range), unit norms, zero biases
        (the router's correction bias too). With ``base="fp8"`` the base weights are drawn in
        `dtype` and quantized (:meth:`quantize_base`).
        """
        if self.base is None:
            return _initialized(self.abstract_params(dtype), key)
        plain = dataclasses.replace(self, base=None)
        return self.quantize_base(_initialized(plain.abstract_params(dtype), key))

    def quantize_base(self, params: dict[str, Any]) -> dict[str, Any]:
        """Unquantized `params` with the base weights quantized as ``base`` says.

        "fp8": per block ``scale = amax / 448``, as a published checkpoint
        (:func:`~jaxops.models._base.quantize`), the FP8 values as their bytes (uint8);
        "mxfp4": the routed experts packed (:func:`~jaxops.models._base.quantize_mxfp4`).
        Placed on :meth:`shardings`.
        """
        maps = self.block_maps

        def quantized(params):
            out = jax.tree.map(lambda x: x, params)
            for key in self.base_keys:
                *path, name = key.split("/")
                node = out
                for part in path:
                    node[part] = dict(node[part])
                    node = node[part]
                if self.base == "mxfp4":
                    node[name], node[name + _base.MXFP4_SCALES] = _base.quantize_mxfp4(node[name])
                    continue
                data, node[name + _base.SCALE] = _base.quantize(node[name], maps[key])
                node[name] = jax.lax.bitcast_convert_type(data, jnp.uint8)
            return out

        target = jax.tree_util.tree_flatten_with_path(self.abstract_params())[0]
        sharding = {path: a.sharding for path, a in target}
        out = jax.eval_shape(quantized, params)  # with or without adapters
        shardings = jax.tree_util.tree_map_with_path(lambda path, _: sharding[path], out)
        return jax.jit(quantized, out_shardings=shardings)(params)

    def dequantized(self, p: dict[str, Any], key: str) -> dict[str, Any]:
        """One layer's parameters `p` of stack `key`, its FP8 base weights in the compute dtype.

        (:func:`~jaxops.models._base.dequantized`; `p` itself when the base is unquantized.)
        """
        if self.base is None:
            return p
        return _base.dequantized(p, self.block_maps, self.dtype, key)

    def add_adapters(self, params: dict[str, Any], key: jax.Array) -> dict[str, Any]:
        """`params` (the base weights, as loaded) with :attr:`lora`'s adapters added, placed.

        Initialized as PEFT does: each ``*_lora_a`` uniform in ``+-1 / sqrt(in)``, each
        ``*_lora_b`` zero, so the adapters add nothing until trained.
        """
        if self.lora is None:
            return params
        fresh = _initialized(adapters_of(self.abstract_params()), key)
        return _inserted(params, fresh)

    def place_batch(self, *arrays: Any) -> Any:
        """Host arrays ``[B, ...]`` as global arrays split over the batch axes.

        (With a context axis: over the others, :attr:`input_axes`.) Every process passes the
        same global values; one array in, one out.
        """
        sharding = NamedSharding(self.mesh, P(self.input_axes))

        def put(a):
            a = np.asarray(a)
            return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

        out = tuple(put(a) for a in arrays)
        return out[0] if len(out) == 1 else out
