"""The MoE decoder laid out on a mesh: Mixtral, Qwen3-MoE, Qwen2-MoE.

:class:`MoEDecoder` holds the mesh layout (parameter specs and shardings, initialization, batch
placement) and the public methods; the layers it runs are the pure functions of
:mod:`jaxops.models._layers`. Every public method validates its arguments once and then runs
the private objective.
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
from jaxops.models import _layers
from jaxops.models._config import DecoderConfig
from jaxops.parallel import expert as ep
from jaxops.parallel import pipeline as pl

from jaxops import _checks
from jaxops._errors import ConfigError, renamed_fields
from jaxops._ffi import has_kernel
from jaxops._sharding import place

__all__ = ["DECODER_SCHEDULES", "MOE_IMPLS", "MoEDecoder"]

#: The pipeline schedules the decoder trains with (of :data:`jaxops.parallel.pipeline.SCHEDULES`;
#: "interleaved" would need the layers stored in its round-robin layout).
DECODER_SCHEDULES = tuple(s for s in pl.SCHEDULES if s != "interleaved")
#: MoE implementations: the expert-parallel layer or its dense masked twin.
MOE_IMPLS = ("ep", "dense")
_INIT_STD = 0.02  # transformers' initializer_range for these models
_OP = "jaxops.models.MoEDecoder"
_TOKEN_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


@renamed_fields(
    {
        "microbatches": "num_microbatches",
        "aux_loss_coef": "router_aux_loss_coef",
        "z_loss_coef": "router_z_loss_coef",
    }
)
@dataclasses.dataclass(frozen=True)
class MoEDecoder:
    """A decoder-only MoE transformer laid out on a mesh: parameters, forward, loss, gradients.

    Per layer (``L`` of them, parameters stacked on a leading layer axis)::

        a = attention(rms_norm(h))                   jaxops.rms_norm, jaxops.gemm projections
        y, h = add_rms_norm(a, h)                    jaxops.add_rms_norm (residual + norm)
        h = h + moe(y)                               jaxops.parallel.expert.moe_layer

    then ``rms_norm`` and the output projection (``jaxops.gemm``; the embedding table with tied
    embeddings). Attention is grouped-query causal attention in plain jnp with rotary position
    embeddings (rotate-half layout), float32 softmax, Qwen3's q/k RMSNorm and an optional
    sliding window, as transformers computes it (the layer functions are in
    ``jaxops.models._layers``). `impl` reaches every jaxops op the model runs.

    The mesh: experts over `expert_axis` (which must exist; size 1 on one device), layers over
    `pipe_axis` when the mesh has it with size > 1 (``L / P`` consecutive layers per pipeline
    stage, trained with :func:`jaxops.parallel.pipeline.pipeline_step`), the batch over every
    other axis and the expert axis. Without a pipe axis the layers run in one ``lax.scan``.

    Attributes:
      config: the architecture (:class:`DecoderConfig`).
      mesh: the device mesh.
      expert_axis: the mesh axis the experts are split over.
      pipe_axis: the pipeline mesh axis (ignored when the mesh has none or it has size 1).
      num_microbatches: microbatches per data shard in the pipeline (>= the pipe size is
        efficient). Formerly ``microbatches`` (deprecated alias for one release).
      schedule: "1f1b" or "gpipe" (:data:`DECODER_SCHEDULES`).
      remat: recompute each layer's forward in the backward (``jax.checkpoint``).
      dtype: compute dtype (float32, bfloat16 or float16); parameters may be stored in another.
      capacity_factor: None (dropless, as transformers) or the MoE layer's capacity factor.
      fp8: None or "block": DeepSeek-V3 block-scaled FP8 numerics in the expert GEMMs and the
        attention projections (``jaxops.fp8.linear``); embedding, output projection, attention
        scores and norms stay in the compute dtype, as in DeepSeek-V3's recipe. Each device
        quantizes its own tokens.
      dispatch: the MoE layer's dispatch ("dtype", or "fp8" with fp8="block": tokens cross the
        expert exchange as FP8 with their 1 x 128 scales; see ``MoEConfig.dispatch``).
      router_aux_loss_coef: weight of each layer's load-balancing loss (None: the config's
        ``router_aux_loss_coef``). Formerly ``aux_loss_coef``.
      router_z_loss_coef: weight of each layer's router z-loss. Formerly ``z_loss_coef``.
      align: the MoE layer's group alignment.
      impl: None, "ffi" or "xla": jaxops' kernels or their pure-JAX twins, for every op of the
        model (norms, projections, FP8, the MoE layer). "ffi" runs a kernel wherever jaxops has
        one for the platform (the GEMMs run XLA's dot on CPU, where jaxops has no GEMM kernel).
      moe_impl: "ep": the expert-parallel layer; "dense": its dense twin
        ``moe_layer_reference`` (every expert on every token, experts replicated; no pipeline),
        the baseline of benchmarks/bench_models.py.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxops.models import DecoderConfig, MoEDecoder
      >>> cfg = DecoderConfig("mixtral", vocab_size=64, hidden_size=32, num_layers=2,
      ...                     num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4, top_k=2,
      ...                     expert_ffn=16)
      >>> model = MoEDecoder(cfg, jax.make_mesh((1,), ("expert",)))
      >>> params = model.init(jax.random.key(0))
      >>> tokens = jnp.zeros((2, 8), jnp.int32)
      >>> jax.jit(model.logits)(params, tokens).shape
      (2, 8, 64)
    """

    config: DecoderConfig
    mesh: jax.sharding.Mesh
    expert_axis: str = "expert"
    pipe_axis: str = "pipe"
    num_microbatches: int = 1
    schedule: str = "1f1b"
    remat: bool = False
    dtype: Any = jnp.float32
    capacity_factor: float | None = None
    fp8: str | None = None
    dispatch: str = "dtype"
    router_aux_loss_coef: float | None = None
    router_z_loss_coef: float = 0.0
    align: int = 8
    impl: str | None = None
    moe_impl: str = "ep"

    def __post_init__(self):
        op = _OP
        if not isinstance(self.config, DecoderConfig):
            raise TypeError(
                f"{op}: config must be a DecoderConfig, got {type(self.config).__name__}"
            )
        if not isinstance(self.mesh, jax.sharding.Mesh):
            raise TypeError(
                f"{op}: mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}"
            )
        shape = dict(self.mesh.shape)
        if self.expert_axis not in shape:
            raise ConfigError(
                f"{op}: the mesh has no axis {self.expert_axis!r} (expert_axis); its axes are "
                f"{tuple(shape)}. On one device use jax.make_mesh((1,), ('expert',))"
            )
        if self.config.num_experts % shape[self.expert_axis]:
            raise ConfigError(
                f"{op}: num_experts = {self.config.num_experts} must be divisible by the size "
                f"{shape[self.expert_axis]} of the expert axis {self.expert_axis!r}"
            )
        if self.config.num_layers % self.pipe:
            raise ConfigError(
                f"{op}: num_layers = {self.config.num_layers} must be divisible by the size "
                f"{self.pipe} of the pipe axis {self.pipe_axis!r}"
            )
        _checks.check_int(op, "num_microbatches", self.num_microbatches, 1)
        if self.moe_impl not in MOE_IMPLS:
            raise ConfigError(f"{op}: moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        if self.moe_impl == "dense" and self.pipe > 1:
            raise ConfigError(f"{op}: moe_impl='dense' runs without a pipeline (pipe axis size 1)")
        if self.schedule not in DECODER_SCHEDULES:
            raise ConfigError(
                f"{op}: schedule must be one of {DECODER_SCHEDULES}, got {self.schedule!r}"
            )
        if self.impl not in (None, "ffi", "xla"):
            raise ConfigError(f"{op}: impl must be None, 'ffi' or 'xla', got {self.impl!r}")
        dtype = np.dtype(self.dtype)
        if dtype not in _checks.FLOAT_DTYPES:
            raise TypeError(f"{op}: dtype must be float32, bfloat16 or float16, got {dtype.name}")
        object.__setattr__(self, "dtype", dtype)
        self.moe  # noqa: B018 -- validates the MoE settings now

    # ---------------------------------------------------------------------------------------------
    # Layout.

    @property
    def pipe(self) -> int:
        """Pipeline stages: the size of the pipe axis (1 without one)."""
        return dict(self.mesh.shape).get(self.pipe_axis, 1)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Mesh axes the batch is split over besides the expert axis (all but expert and pipe)."""
        return tuple(a for a in self.mesh.axis_names if a not in (self.expert_axis, self.pipe_axis))

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """All mesh axes the batch is split over: ``(*data_axes, expert_axis)``."""
        return (*self.data_axes, self.expert_axis)

    @functools.cached_property
    def moe(self) -> ep.MoEConfig:
        """The MoE layer's config (SwiGLU experts, softmax router, the shared expert if any)."""
        c = self.config
        coef = self.router_aux_loss_coef
        return ep.MoEConfig(
            num_experts=c.num_experts,
            top_k=c.top_k,
            hidden_size=c.hidden_size,
            expert_ffn=c.expert_ffn,
            activation="swiglu",
            router="softmax",
            normalize_topk=c.normalize_topk,
            capacity_factor=self.capacity_factor,
            router_aux_loss_coef=c.router_aux_loss_coef if coef is None else coef,
            router_z_loss_coef=self.router_z_loss_coef,
            align=self.align,
            expert_axis=self.expert_axis,
            data_axes=self.data_axes,
            dtype=self.dtype,
            fp8=self.fp8,
            dispatch=self.dispatch,
            shared_ffn=c.shared_ffn,
            shared_gate=c.shared_ffn > 0,
        )

    def param_shapes(self) -> dict[str, Any]:
        """The parameter tree's shapes (``layers`` leaves stacked ``[L, ...]``).

        ``embed [V, D]``; per layer ``attn_norm [D]``, ``w_qkv [D, (Hq + 2 Hkv) Dh]`` (q, k, v
        side by side), ``b_qkv`` (Qwen2), ``q_norm, k_norm [Dh]`` (Qwen3), ``w_o [Hq Dh, D]``,
        ``b_o`` (Qwen3 attention_bias), ``mlp_norm [D]``, ``moe`` (``MoEConfig.param_shapes``:
        ``router [D, E]``, ``w_in [E, D, 2F]`` (gate, up), ``w_out [E, F, D]``, the shared
        expert); then ``final_norm [D]`` and ``lm_head [D, V]`` (absent with tied embeddings).
        Kernels are ``[in, out]``.
        """
        c = self.config
        d, qkv = c.hidden_size, c.q_size + 2 * c.kv_size
        layer: dict[str, Any] = {"attn_norm": (d,), "w_qkv": (d, qkv)}
        if c.qkv_bias:
            layer["b_qkv"] = (qkv,)
        if c.qk_norm:
            layer["q_norm"] = (c.head_dim,)
            layer["k_norm"] = (c.head_dim,)
        layer["w_o"] = (c.q_size, d)
        if c.o_bias:
            layer["b_o"] = (d,)
        layer["mlp_norm"] = (d,)
        layer["moe"] = dict(self.moe.param_shapes)
        stacked = jax.tree.map(
            lambda s: (c.num_layers, *s), layer, is_leaf=lambda s: isinstance(s, tuple)
        )
        tree = {"embed": (c.vocab_size, d), "layers": stacked, "final_norm": (d,)}
        if not c.tie_word_embeddings:
            tree["lm_head"] = (d, c.vocab_size)
        return tree

    def _layer_specs(self, lead: Any) -> dict[str, Any]:
        shapes = self.param_shapes()["layers"]
        specs = {k: P(lead) for k in shapes if k != "moe"}
        moe_specs = ep.moe_param_specs(self.moe)
        if self.moe_impl == "dense":  # every device runs every expert
            moe_specs = {k: P() for k in moe_specs}
        specs["moe"] = {k: P(lead, *s) for k, s in moe_specs.items() if k in shapes["moe"]}
        return specs

    def param_specs(self) -> dict[str, Any]:
        """PartitionSpecs of the parameters.

        Layers over the pipe axis, experts over the expert axis, everything else replicated.
        """
        lead = self.pipe_axis if self.pipe > 1 else None
        specs = {"embed": P(), "layers": self._layer_specs(lead), "final_norm": P()}
        if not self.config.tie_word_embeddings:
            specs["lm_head"] = P()
        return specs

    def shardings(self) -> dict[str, Any]:
        """NamedShardings of :meth:`param_specs` on the mesh."""
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), self.param_specs(), is_leaf=_is_spec
        )

    def abstract_params(self, dtype: Any = jnp.float32) -> dict[str, Any]:
        """The parameter tree as ``jax.ShapeDtypeStruct`` s with their shardings (a load target).

        The MoE correction bias (none of these models has one) would stay float32.
        """
        dtype = np.dtype(dtype)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s, dtype, sharding=sh),
            self.param_shapes(),
            self.shardings(),
            is_leaf=lambda s: isinstance(s, tuple),
        )

    def init(self, key: jax.Array, dtype: Any = jnp.float32) -> dict[str, Any]:
        """Random parameters placed on the mesh.

        normal(0, 0.02) matrices (transformers' initializer_range), unit norms, zero biases.
        """
        abstract = self.abstract_params(dtype)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)

        def make(key):
            keys = jax.random.split(key, len(leaves))
            out = []
            for (path, leaf), k in zip(leaves, keys, strict=True):
                name = jax.tree_util.keystr(path)
                if "norm" in name:
                    out.append(jnp.ones(leaf.shape, leaf.dtype))
                elif name.endswith("['b_qkv']") or name.endswith("['b_o']"):
                    out.append(jnp.zeros(leaf.shape, leaf.dtype))
                else:
                    out.append((jax.random.normal(k, leaf.shape) * _INIT_STD).astype(leaf.dtype))
            return jax.tree_util.tree_unflatten(treedef, out)

        out_shardings = jax.tree.map(lambda a: a.sharding, abstract)
        return jax.jit(make, out_shardings=out_shardings)(key)

    def place_batch(self, *arrays: Any) -> Any:
        """Host arrays ``[B, ...]`` as global arrays split over the batch axes.

        Every process passes the same global values; one array in, one out.
        """
        sharding = NamedSharding(self.mesh, P(self.batch_axes))

        def put(a):
            a = np.asarray(a)
            return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

        out = tuple(put(a) for a in arrays)
        return out[0] if len(out) == 1 else out

    # ---------------------------------------------------------------------------------------------
    # The model: unvalidated internals on the layer functions.

    @functools.cached_property
    def _ops(self) -> _layers.Ops:
        platform = self.mesh.devices.flat[0].platform
        gemm_impl = self.impl
        if self.impl == "ffi" and not has_kernel("gemm", platform):
            gemm_impl = "xla"
        return _layers.Ops(self.dtype, self.impl, self.fp8, self.mesh, gemm_impl)

    def _moe_fn(self) -> Callable:
        cfg = self.moe

        def moe(p, y):
            if self.moe_impl == "dense":
                return ep.moe_layer_reference(p, y, cfg, impl=self.impl)
            return ep.moe_layer(p, y, cfg, mesh=self.mesh, impl=self.impl)

        return moe

    def _run_layers(self, layers: dict[str, Any], h: jax.Array) -> tuple[jax.Array, ep.MoEAux]:
        """``h`` through the stacked `layers` (one lax.scan); the per-layer MoEAux, stacked."""
        body = functools.partial(_layers.decoder_layer, self._ops, self.config, self._moe_fn())
        if self.remat:
            body = jax.checkpoint(body)
        return jax.lax.scan(body, h, layers)

    def _place(self, x: jax.Array) -> jax.Array:
        """Activations ``[B, ...]`` split over the batch axes (a no-op off Explicit meshes)."""
        return place(x, self.mesh, P(self.batch_axes))

    def _head_params(self, params: dict[str, Any]) -> dict[str, Any]:
        key = "embed" if self.config.tie_word_embeddings else "lm_head"
        return {"final_norm": params["final_norm"], key: params[key]}

    def _head(self, head: dict[str, Any], h: jax.Array) -> jax.Array:
        return _layers.head(self._ops, self.config, head, h)

    def _stages(self, layers: dict[str, Any]) -> dict[str, Any]:
        """``[L, ...]`` layers as ``[P, L / P, ...]`` pipeline stages (a view of the sharding)."""
        n = self.pipe
        return jax.tree.map(lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:]), layers)

    def _pipeline(self) -> dict[str, Any]:
        """The keywords every pipeline call of the decoder shares."""
        return {
            "mesh": self.mesh,
            "num_microbatches": self.num_microbatches,
            "pipe_axis": self.pipe_axis,
            "data_axes": self.batch_axes,
            "has_aux": True,
            "param_specs": self._layer_specs(None),
        }

    def _stage(self, sp: dict[str, Any], x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One pipeline stage: its layers, and the sum of their MoE aux losses."""
        h, aux = self._run_layers(sp, x)
        return h, jnp.sum(aux.loss)

    def _hidden(self, params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        x = _layers.embed(self._ops, params["embed"], tokens)
        if self.pipe > 1:
            stages = self._stages(params["layers"])
            return pl.pipeline_forward(self._stage, stages, x, **self._pipeline())
        return self._run_layers(params["layers"], self._place(x))[0]

    def _objective(self, params: dict[str, Any], tokens: jax.Array, targets: jax.Array):
        """The training loss: mean next-token cross-entropy plus the layers' MoE aux losses.

        Without a pipeline the aux losses are each layer's over the whole batch; with one, per
        microbatch, averaged over the microbatches and data shards as :meth:`loss_and_grads`
        computes them, from a forward-only pipeline (each stage adds its aux loss to a
        per-example carry).
        """
        x = _layers.embed(self._ops, params["embed"], tokens)
        if self.pipe == 1:
            h, aux = self._run_layers(params["layers"], self._place(x))
            return _layers.cross_entropy(self._head(self._head_params(params), h), targets) + (
                jnp.sum(aux.loss)
            )

        def stage(sp, carry):
            h, aux = self._stage(sp, carry["h"])
            return {"h": h, "aux": carry["aux"] + aux}, jnp.zeros((), jnp.float32)

        carry = {"h": x, "aux": self._place(jnp.zeros(tokens.shape[:1], jnp.float32))}
        out = pl.pipeline_forward(stage, self._stages(params["layers"]), carry, **self._pipeline())
        logits = self._head(self._head_params(params), out["h"])
        return _layers.cross_entropy(logits, targets) + jnp.mean(out["aux"])

    # ---------------------------------------------------------------------------------------------
    # Public methods: validate once, then run the internals.

    def _check_tokens(self, op: str, tokens: Any, name: str = "tokens") -> jax.Array:
        tokens = _checks.check_array(op, name, tokens, dtypes=_TOKEN_DTYPES, min_rank=2)
        if tokens.ndim != 2:
            raise ValueError(f"{op}: {name} must be [batch, seq], got shape {tuple(tokens.shape)}")
        shards = int(np.prod([dict(self.mesh.shape)[a] for a in self.batch_axes]))
        per = shards * (self.num_microbatches if self.pipe > 1 else 1)
        if tokens.shape[0] % per:
            raise ValueError(
                f"{op}: {name}' batch ({tokens.shape[0]}) must be a multiple of {per} (the "
                f"{shards} devices of the batch axes {self.batch_axes}"
                + (f" times {self.num_microbatches} microbatches)" if self.pipe > 1 else ")")
            )
        return tokens

    def _check_pair(self, op: str, tokens: Any, targets: Any) -> tuple[jax.Array, jax.Array]:
        tokens = self._check_tokens(op, tokens)
        targets = self._check_tokens(op, targets, "targets")
        if targets.shape != tokens.shape:
            raise ValueError(
                f"{op}: targets must have the shape of tokens {tuple(tokens.shape)}, got "
                f"{tuple(targets.shape)}"
            )
        return tokens, targets

    def hidden_states(self, params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        """The last layer's output ``[B, S, D]`` (compute dtype), before the final norm."""
        return self._hidden(params, self._check_tokens(f"{_OP}.hidden_states", tokens))

    def logits(self, params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        """float32 logits ``[B, S, V]`` of int ``tokens [B, S]`` (call it under ``jax.jit``).

        B must be a multiple of the devices of the batch axes (times the microbatches with a
        pipeline). Positions are ``0 .. S-1``; there is no padding mask and no KV cache.
        """
        h = self._hidden(params, self._check_tokens(f"{_OP}.logits", tokens))
        return self._head(self._head_params(params), h)

    def forward(self, params: dict[str, Any], tokens: jax.Array) -> tuple[jax.Array, ep.MoEAux]:
        """``(logits, aux)`` without a pipeline; aux: the layers' ``MoEAux``, stacked.

        ``aux.tokens_per_expert [L, E]`` is the load of every expert of every layer.
        """
        op = f"{_OP}.forward"
        if self.pipe > 1:
            raise ValueError(
                f"{op}: per-layer MoE statistics are not available through the pipeline; use "
                "logits() or loss()"
            )
        tokens = self._check_tokens(op, tokens)
        x = self._place(_layers.embed(self._ops, params["embed"], tokens))
        h, aux = self._run_layers(params["layers"], x)
        return self._head(self._head_params(params), h), aux

    def loss(self, params: dict[str, Any], tokens: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy of ``targets [B, S]`` plus the layers' MoE aux losses.

        With a pipe axis it runs the pipeline's forwards only (no backward); the value equals
        :meth:`loss_and_grads`'s loss. For gradients on a pipe mesh use :meth:`loss_and_grads`.
        """
        tokens, targets = self._check_pair(f"{_OP}.loss", tokens, targets)
        return self._objective(params, tokens, targets)

    def loss_and_grads(
        self, params: dict[str, Any], tokens: jax.Array, targets: jax.Array
    ) -> tuple[jax.Array, dict[str, Any]]:
        """``(loss, grads)``, grads like params.

        With a pipe axis: one :func:`~jaxops.parallel.pipeline.pipeline_step` (the schedule,
        ``num_microbatches`` per data shard; the MoE aux losses are computed per microbatch);
        else ``jax.value_and_grad`` of the loss.
        """
        tokens, targets = self._check_pair(f"{_OP}.loss_and_grads", tokens, targets)
        if self.pipe == 1:
            return jax.value_and_grad(self._objective)(params, tokens, targets)
        x, embed_vjp = jax.vjp(
            lambda e: self._place(_layers.embed(self._ops, e, tokens)), params["embed"]
        )
        loss, g = pl.pipeline_step(
            self._stage,
            self._stages(params["layers"]),
            x,
            targets=targets,
            loss_params=self._head_params(params),
            loss_fn=lambda head, h, t: _layers.cross_entropy(self._head(head, h), t),
            schedule=self.schedule,
            remat=self.remat,
            **self._pipeline(),
        )
        (d_embed,) = embed_vjp(g.inputs)
        layers = jax.tree.map(lambda a, p: a.reshape(p.shape), g.stage_params, params["layers"])
        grads = {"embed": d_embed, "layers": layers, "final_norm": g.loss_params["final_norm"]}
        if self.config.tie_word_embeddings:
            grads["embed"] = d_embed + g.loss_params["embed"]
        else:
            grads["lm_head"] = g.loss_params["lm_head"]
        return loss, grads
