"""The MoE decoder laid out on a mesh: every model type of :data:`jaxops.models.MODEL_TYPES`.

:class:`MoEDecoder` is a facade: its fields are the runtime settings, validated once; from them
it builds one :class:`~jaxops.models._layout.Layout` (``model.layout``: the parameter layout,
batch placement, how the layers compute), and its public methods check their arguments and run
the functions of that value (:mod:`~jaxops.models._run` the layer loops,
:mod:`~jaxops.models._objective` the loss and gradients, :mod:`~jaxops.models._train` the
train step). The layers are the pure functions of :mod:`~jaxops.models._layers`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxops.parallel import expert as ep
from jaxops.parallel import pipeline as pl

import jaxops
from jaxops import _checks
from jaxops._config import check_impl
from jaxops._errors import ArgumentTypeError, ConfigError, InvalidArgumentError, renamed_fields
from jaxops._lora import as_lora

from . import _batch, _context, _mtp, _objective, _run, _train
from ._adapters import lora_targets
from ._base import BASES
from ._config import DecoderConfig
from ._layout import Layout, Settings

__all__ = [
    "ATTENTION_IMPLS",
    "DECODER_SCHEDULES",
    "GRAD_REDUCES",
    "MOE_IMPLS",
    "REMAT_POLICIES",
    "ZERO_STAGES",
    "MoEDecoder",
    "check_batch",
    "check_trainable",
]

#: The pipeline schedules the decoder trains with (of :data:`jaxops.parallel.pipeline.SCHEDULES`;
#: "interleaved" would need the layers stored in its round-robin layout).
DECODER_SCHEDULES = tuple(s for s in pl.SCHEDULES if s != "interleaved")
#: MoE implementations: the expert-parallel layer or its dense masked twin.
MOE_IMPLS = ("ep", "dense")
#: How attention computes: "auto" (``jax.nn.dot_product_attention`` on GPUs in bfloat16 and
#: float16, where cuDNN's fused attention takes it; blockwise elsewhere, and with a context
#: axis), "blockwise" (an online softmax over blocks, no ``[S, S]`` array), "xla" (float32
#: scores and softmax in jnp) or "dot_product" (``jax.nn.dot_product_attention`` where it
#: applies, else blockwise).
ATTENTION_IMPLS = ("auto", "blockwise", "xla", "dot_product")
_OP = "jaxops.models.MoEDecoder"
#: The ``remat`` policies by name: what each layer keeps for its backward. "none": every
#: residual; "full": only its input (the backward recomputes the layer); "matmuls": the outputs
#: of the projections and of every XLA dot (the backward recomputes norms, softmax, activations).
REMAT_POLICIES = ("none", "full", "matmuls")
#: ZeRO stages of :attr:`MoEDecoder.zero`: none, the optimizer state, the parameters too.
ZERO_STAGES = (0, 1, 3)
#: How :meth:`MoEDecoder.loss_and_grads` reduces the gradients: one flat buffer per reduction
#: group in a ``shard_map`` of the step, or where jax's partitioner makes each gradient.
GRAD_REDUCES = ("flat", "partitioner")


def _doc(source: Any) -> Callable[[Callable], Callable]:
    """Gives the decorated delegate the docstring of the Layout member `source` it returns."""
    doc = (source.fget if isinstance(source, property) else source).__doc__

    def give(f: Callable) -> Callable:
        f.__doc__ = doc
        return f

    return give


@renamed_fields(
    {
        "microbatches": "num_microbatches",
        "aux_loss_coef": "router_aux_loss_coef",
        "z_loss_coef": "router_z_loss_coef",
    }
)
@dataclasses.dataclass(frozen=True)
class MoEDecoder(Settings):
    """A decoder-only MoE transformer laid out on a mesh: parameters, forward, loss, gradients.

    Per layer (``L`` of them, parameters stacked on a leading layer axis)::

        a = attention(rms_norm(h))                   jaxops.rms_norm, jaxops.gemm projections
        y, h = add_rms_norm(a, h)                    jaxops.add_rms_norm (residual + norm)
        h = h + moe(y)                               jaxops.parallel.expert.moe_layer

    (``h + mlp(y)``, a dense SwiGLU MLP, in the config's ``dense_layers``), then ``rms_norm``
    and the output projection (``jaxops.gemm``; the embedding table with tied embeddings).
    Attention is grouped-query causal attention in plain jnp with rotary position embeddings,
    float32 softmax, q/k RMSNorm, biases and an optional sliding window as the config says, or
    DeepSeek's multi-head latent attention, as transformers computes them (the layer functions
    are in ``jaxops.models._layers`` and ``jaxops.models._mla``). `impl` reaches every jaxops
    op the model runs.

    The mesh: experts over `expert_axis` (which must exist; size 1 on one device), MoE layers
    over `pipe_axis` when the mesh has it with size > 1 (``Lm / P`` consecutive MoE layers per
    pipeline stage, trained with :func:`jaxops.parallel.pipeline.pipeline_step`), the batch
    over every other axis and the expert axis. Without a pipe axis the layers run in one
    ``lax.scan`` per run of consecutive layers of one kind (MoE or dense), or one over the
    repeats of a dense / MoE pattern (Llama 4 Maverick's alternation).

    Dense and MoE layers: the MoE layers are stacked in ``params["layers"]`` and the dense ones
    in ``params["dense_layers"]`` (two stacks, since their parameters differ). A pipeline stage
    holds MoE layers only, so that every stage stacks and scans the same layers; the dense
    layers must then come first (DeepSeek-V3's and GLM-4.5's ``first_k_dense_replace``) and run
    ahead of the pipeline, on every pipe stage alike, like the embedding: their parameters are
    replicated over the pipe axis and each stage computes them for its data shard's whole
    batch, a cost of ``Ld`` dense layers per device besides its ``Lm / P`` MoE layers (3
    against 58 / P for DeepSeek-V3). Without a pipeline dense layers may sit anywhere
    (Qwen's ``mlp_only_layers``).

    The fields are the runtime settings, validated once. ``model.layout`` is the
    :class:`~jaxops.models._layout.Layout` built of them: the value the loss, the gradients,
    the train step and :func:`~jaxops.models.generate` run on (the parameter layout, batch
    placement, how the layers compute); its public layout members (:attr:`pipe`,
    :attr:`batch_axes`, :meth:`param_specs`, :meth:`zero_specs`, :meth:`init`,
    :meth:`place_batch`, ...) are the model's too.

    Attributes:
      config: the architecture (:class:`DecoderConfig`).
      mesh: the device mesh.
      expert_axis: the mesh axis the experts are split over.
      pipe_axis: the pipeline mesh axis (ignored when the mesh has none or it has size 1).
      context_axis: the mesh axis each sequence is split over (context parallelism; ignored
        when the mesh has none or it has size 1): with C devices on it every sequence is cut
        into 2C chunks, device c holding chunks c and 2C - 1 - c (an even share of causal
        work), and attention passes the keys and values around the ring of the C devices
        (blockwise attention on each step, the backward passing their gradients the same
        way); everything else treats the chunks as rows of the batch. The sequence length
        must be a multiple of 2C; :meth:`place_batch` splits ``[B, S]`` arrays over the
        other batch axes (:attr:`input_axes`), and the methods take and return whole
        sequences in order. With a pipe axis too, each stage all-gathers the keys over the
        context axis instead of passing them around a ring. ``generate`` refuses it.
      num_microbatches: microbatches per data shard in the pipeline (>= the pipe size is
        efficient). Formerly ``microbatches`` (deprecated alias for one release).
      schedule: "1f1b" or "gpipe" (:data:`DECODER_SCHEDULES`).
      remat: what each layer keeps for its backward (``jax.checkpoint``), one of
        :data:`REMAT_POLICIES`: "none" (False; every residual), "full" (True; only the layer's
        input, the backward recomputes its forward) or "matmuls" (the projections' and dots'
        outputs); or a ``jax.checkpoint_policies`` policy. None (the default): "none", or
        "matmuls" with a quantized ``base``, which refuses "none": every residual includes
        each layer's dequantized weights (the projections' ``custom_vjp`` keeps its weight),
        a float copy of the whole base for the backward.
      dtype: compute dtype (float32, bfloat16 or float16); parameters may be stored in another.
      capacity_factor: None (dropless, as transformers) or the MoE layer's capacity factor.
      fp8: None, or the block :class:`jaxops.fp8.Recipe` (``jaxops.fp8.BLOCK`` or its name
        "block"; the one recipe type of every tier, kept as given): DeepSeek-V3 block-scaled FP8
        numerics in the expert GEMMs and the attention projections (``jaxops.fp8.linear``);
        embedding, output projection, attention scores and norms stay in the compute dtype, as
        in DeepSeek-V3's recipe. Each device quantizes its own tokens. The tensor and delayed
        recipes are refused.
      dispatch: the MoE layer's dispatch ("dtype", or "fp8" with fp8="block": tokens cross the
        expert exchange as FP8 with their 1 x 128 scales; see ``MoEConfig.dispatch``).
      exchange: the MoE layer's exchange (``MoEConfig.exchange``: "auto" is
        ``ragged_all_to_all`` on GPU and the all-gather form on CPU; "ragged", "dense" or
        "gather").
      router_aux_loss_coef: weight of each layer's load-balancing loss (None: the config's
        ``router_aux_loss_coef``). Formerly ``aux_loss_coef``.
      router_z_loss_coef: weight of each layer's router z-loss. Formerly ``z_loss_coef``.
      align: the MoE layer's group alignment.
      impl: jaxops' implementation policy (:func:`jaxops.choose_impl`), passed unchanged to
        every op of the model (norms, projections, FP8, the MoE layer): None (best available),
        "xla" (the pure-JAX twins), "ffi" (a custom call required for every op the model runs:
        refused here on a platform where one is missing, as the GEMMs are on CPU, where XLA's
        dot runs them) or an order of preference such as ``("ffi", "xla")`` (the kernels
        wherever jaxops has them).
      moe_impl: "ep": the expert-parallel layer; "dense": its dense twin
        ``moe_layer_reference`` (every expert on every token, experts replicated; no pipeline),
        the baseline of benchmarks/bench_models.py.
      attention_impl: one of :data:`ATTENTION_IMPLS`. "blockwise": queries and keys in
        blocks of `attention_block` with an online softmax and a backward that recomputes
        per block, so no ``[S, S]`` array exists (memory ``O(S x block)``), the block pairs
        the mask empties (causal future, outside a window, other documents) skipped; "xla":
        the whole float32 ``[B, H, S, S]`` scores in jnp; "dot_product":
        ``jax.nn.dot_product_attention`` (cuDNN's fused attention on a GPU) where keys and
        values have one head width and there are no sinks, else blockwise (multi-head latent
        attention's 192 / 128 in DeepSeek-V3, gpt-oss's sinks). "auto": "dot_product" on a
        GPU in bfloat16 / float16, else "blockwise"; with a context axis always blockwise
        (its ring). Within one block both blockwise and "xla" compute the whole scores.
      attention_block: queries and keys per block of blockwise attention (an int >= 1).
      scan_unroll: layers per iteration of each layer ``lax.scan`` (its ``unroll``): 1 (one
        compiled layer body, compile time flat in the layer count) or more, True for every
        layer of a scan in straight-line code. Unrolled layers keep their residuals in plain
        buffers instead of copying them into and out of stacked ``[L, ...]`` ones: on CPU the
        4-layer train steps of benchmarks/bench_models.py ran 1.12-1.18x faster fully
        unrolled (same-process A/Bs), with about the same temporaries; compile time grows
        with the layers unrolled. Same numbers either way.
      zero: ZeRO sharding over the batch axes (:data:`ZERO_STAGES`): 0 none; 1 the optimizer
        state (:meth:`init_optimizer`) and the gradients the update reads
        (:meth:`train_step`); 3 the parameters too (:meth:`zero_specs`), each
        layer's weights all-gathered as the layer runs (again in its backward, instead of
        keeping them), the gradients reduced to the shards; the weights the layers only cast
        (``CAST_BEFORE_GATHER``) cast to a narrower compute dtype first (half the bytes),
        their gradients reduced in theirs (not a pipeline stage's, or its loss's head). With
        a pipe axis a stage's layers are gathered for the whole step.
      grad_reduce: how :meth:`loss_and_grads` reduces the gradients over the batch axes
        (:data:`GRAD_REDUCES`). "flat" (default): the loss and its gradients in one
        ``shard_map`` over the batch axes, each device's gradients summed in one all-reduce
        of one flat buffer per reduction group (the weights replicated over every batch axis;
        the experts, over the axes they are not split on) and dtype; it takes over where there
        is no pipeline, one microbatch, ``zero`` 0 or 1, ``moe_impl="ep"`` and more than one
        device on the batch axes, and "partitioner" runs elsewhere. "partitioner": jax's
        partitioner all-reduces each gradient where it is made (XLA combines them into a
        tuple, whose operands XLA:CPU reduces one rendezvous each: on 8 simulated CPU devices
        the 4x256x16x2x256:16x128 step of benchmarks/bench_models.py had 93 rendezvous per
        step, and "flat" ran it 1.4% faster, an A/B in one process with each built first).
        Same loss and gradients up to the order of the sums; "flat" holds one more copy of
        the gradients while it reduces them. With ``zero=1``, "flat" makes :meth:`train_step`
        reduce-scatter each group straight into the ZeRO-1 shards the update reads: half an
        all-reduce's traffic, and no full reduced gradient on any device.
      vocab_chunk: None (the loss's float32 logits ``[B, S, V]`` whole) or the output
        projection's columns per step of a loop that holds ``[B, S, vocab_chunk]`` of them,
        recomputed in the backward (:mod:`~jaxops.models._loss`): GB per device for a large
        vocabulary, for one more pass of the projection; the same loss up to sum order.
      lora: None, or low-rank adapters (:class:`jaxops.Lora`) on the weights its ``targets``
        name as PEFT names them: the GQA attention's ``q_proj``, ``k_proj``, ``v_proj``,
        ``o_proj`` or MLA's ``q_a_proj``, ``q_b_proj`` (``q_proj``), ``kv_a_proj_with_mqa``,
        ``kv_b_proj``, ``o_proj`` (adapters ``<name>_lora_a [L, in, r]``, ``<name>_lora_b [L, r,
        out]`` in each stack), the dense layers' ``mlp.gate_proj``, ``mlp.up_proj``,
        ``mlp.down_proj``, the shared experts' ``shared_experts.gate_proj`` (``up_proj``,
        ``down_proj``), the routed experts' ``experts.gate_up_proj`` /
        ``experts.down_proj`` and the ``router``
        (``MoEConfig.lora``: one pair per expert, sharded with the experts). The base weights
        are frozen: :meth:`loss_and_grads` differentiates the adapters only
        (:meth:`trainable`), :meth:`init_optimizer` and :meth:`train_step` update them alone.
        :meth:`add_adapters` adds fresh ones to loaded weights, ``save_adapter`` /
        ``load_adapter`` write and read them in PEFT's format, ``merge_adapter`` folds them
        into the weights. On a pipe mesh they train through the pipeline schedule (the base
        weights and the head are its frozen leaves); adapter dropout there is refused (not
        built yet).
      base: None (the base weights in the parameters' dtype), "fp8": the decoder layers'
        linear weights (attention projections, routed and shared experts, dense MLPs) kept
        frozen as float8_e4m3fn bytes with float32 scales per ``base_block`` block
        (``X`` and ``X_scale_inv`` parameters, the published block-FP8 format's meaning), or
        "mxfp4": the routed experts kept as packed E2M1 bytes with E8M0 scales per 32 inputs
        (``X [L, E, in / 2, out]``, ``X_scales [L, E, in / 32, out]``, gpt-oss's published
        format; the other weights in the parameters' dtype). Each layer's are dequantized as
        the layer runs and again in its backward, never all at once
        (:mod:`~jaxops.models._base`). ``from_pretrained`` keeps a published FP8 (MXFP4)
        checkpoint's bytes so, or quantizes an unquantized one to FP8 at load; :meth:`init`
        draws and quantizes. The base is frozen: only ``lora`` adapters train on it.
      base_block: ``(rows, columns)`` of a scale's block of a torch ``[out, in]`` weight
        (a published checkpoint's ``weight_block_size``; ``from_pretrained`` takes it from
        the checkpoint).
      mtp_loss_weight: lambda of the multi-token-prediction loss (the config's
        ``mtp_layers`` = D modules, :mod:`~jaxops.models._mtp`): the loss adds ``lambda / D
        * sum_k CE_k``, each depth's cross-entropy over its own counted targets (the targets
        ``k`` places further on, within the same document: a target past a document's end, or
        at padding, counts for nothing). 0 (default): the modules stay out of the loss and are
        frozen (:meth:`trainable` leaves them out; ``save_pretrained`` writes them as loaded).
        DeepSeek-V3 trained with 0.3 then 0.1. With a pipe axis the modules run after the
        last stage, on its devices. With ``lora`` the modules' layers get adapters on the
        same targets as the trunk's (their names: ``model.layers.{L + k}``, as the
        checkpoint stores the modules), which the MTP loss trains with the trunk's; with
        ``base="fp8"`` the modules' layers are base weights in FP8 like the trunk's.
      layout: the :class:`~jaxops.models._layout.Layout` of the fields above (not a field:
        built once, on construction).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxops.models import AttentionSpec, DecoderConfig, MoEDecoder, MoESpec
      >>> cfg = DecoderConfig("mixtral", vocab_size=64, hidden_size=32, num_layers=2,
      ...                     attention=AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
      ...                     moe=MoESpec(num_experts=4, top_k=2, expert_ffn=16))
      >>> model = MoEDecoder(cfg, jax.make_mesh((1,), ("expert",)))
      >>> params = model.init(jax.random.key(0))
      >>> tokens = jnp.zeros((2, 8), jnp.int32)
      >>> jax.jit(model.logits)(params, tokens).shape
      (2, 8, 64)
    """

    def __post_init__(self):
        op = _OP
        if not isinstance(self.config, DecoderConfig):
            raise ArgumentTypeError(
                f"{op}: config must be a DecoderConfig, got {type(self.config).__name__}"
            )
        if not isinstance(self.mesh, jax.sharding.Mesh):
            raise ArgumentTypeError(
                f"{op}: mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}"
            )
        _checks.check_int(op, "num_microbatches", self.num_microbatches, 1)
        self._check_base(op)
        if self.remat is None:  # as the base asks (Layout.remat_policy): kept None
            pass
        elif isinstance(self.remat, bool):
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        elif not callable(self.remat) and self.remat not in REMAT_POLICIES:
            raise ConfigError(
                f"{op}: remat must be one of {REMAT_POLICIES}, a bool or a "
                f"jax.checkpoint_policies policy, got {self.remat!r}"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(
                f"{op}: attention_impl must be one of {ATTENTION_IMPLS}, got "
                f"{self.attention_impl!r}"
            )
        _checks.check_int(op, "attention_block", self.attention_block, 1)
        explicit = all(t == jax.sharding.AxisType.Explicit for t in self.mesh.axis_types)
        if self.layout.context > 1 and not explicit:
            raise ConfigError(
                f"{op}: a context axis ({self.context_axis!r}) needs a mesh of Explicit axes "
                "(jax.make_mesh's default), whose sharded sequences the ring attention runs on; "
                f"got axis types {tuple(str(t) for t in self.mesh.axis_types)}"
            )
        if self.layout.context > 1 and self.attention_impl not in ("auto", "blockwise"):
            raise ConfigError(
                f"{op}: the context axis {self.context_axis!r} (size {self.layout.context}) "
                "splits each sequence over devices, which only blockwise attention's ring "
                f"attends over; attention_impl must be 'auto' or 'blockwise', got "
                f"{self.attention_impl!r}"
            )
        if self.moe_impl not in MOE_IMPLS:
            raise ConfigError(f"{op}: moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        if self.schedule not in DECODER_SCHEDULES:
            raise ConfigError(
                f"{op}: schedule must be one of {DECODER_SCHEDULES}, got {self.schedule!r}"
            )
        try:
            recipe = jaxops.fp8.as_recipe(self.fp8, op, allowed=("block",))
        except InvalidArgumentError as e:
            raise ConfigError(str(e)) from None
        object.__setattr__(self, "fp8", recipe)
        self._check_impl(op)
        dtype = np.dtype(self.dtype)
        if dtype not in _checks.FLOAT_DTYPES:
            raise ArgumentTypeError(
                f"{op}: dtype must be float32, bfloat16 or float16, got {dtype.name}"
            )
        object.__setattr__(self, "dtype", dtype)
        if not isinstance(self.scan_unroll, bool | int | np.integer) or (
            not isinstance(self.scan_unroll, bool) and self.scan_unroll < 1
        ):
            raise ConfigError(
                f"{op}: scan_unroll must be True or an int >= 1, got {self.scan_unroll!r}"
            )
        if self.zero not in ZERO_STAGES:
            raise ConfigError(f"{op}: zero must be one of {ZERO_STAGES}, got {self.zero!r}")
        if self.vocab_chunk is not None:
            _checks.check_int(op, "vocab_chunk", self.vocab_chunk, 1)
        if self.grad_reduce not in GRAD_REDUCES:
            raise ConfigError(
                f"{op}: grad_reduce must be one of {GRAD_REDUCES}, got {self.grad_reduce!r}"
            )
        self._check_lora(op)
        self._check_mtp(op)
        # the fields validated and normalized: the layout of them, checked against the mesh
        self.layout.check_mesh(op)
        if self.moe_impl == "dense" and self.pipe > 1:
            raise ConfigError(f"{op}: moe_impl='dense' runs without a pipeline (pipe axis size 1)")
        self.moe  # noqa: B018 -- validates the MoE settings now

    def _check_mtp(self, op: str) -> None:
        w = self.mtp_loss_weight
        if isinstance(w, bool) or not isinstance(w, int | float | np.floating | np.integer):
            raise ConfigError(f"{op}: mtp_loss_weight must be a number >= 0, got {w!r}")
        if not (math.isfinite(w) and w >= 0):
            raise ConfigError(f"{op}: mtp_loss_weight must be a finite number >= 0, got {w!r}")
        object.__setattr__(self, "mtp_loss_weight", float(w))
        if not w:
            return
        if not self.config.mtp_layers:
            raise ConfigError(
                f"{op}: mtp_loss_weight={w} needs multi-token-prediction modules; the config "
                "has mtp_layers = 0 (a checkpoint announces them as num_nextn_predict_layers)"
            )

    def _check_lora(self, op: str) -> None:
        lora = as_lora(op, self.lora)
        if lora is None:
            return
        lora.check_targets(op, lora_targets(self.config))

    def _check_base(self, op: str) -> None:
        if self.base not in BASES:
            raise ConfigError(f"{op}: base must be one of {BASES}, got {self.base!r}")
        block = self.base_block
        if (
            not isinstance(block, tuple | list)
            or len(block) != 2
            or not all(isinstance(b, int | np.integer) and not isinstance(b, bool) for b in block)
            or min(block) < 1
        ):
            raise ConfigError(
                f"{op}: base_block must be two ints >= 1 (rows, columns of a torch [out, in] "
                f"weight's scale block), got {block!r}"
            )
        object.__setattr__(self, "base_block", (int(block[0]), int(block[1])))
        if self.base == "mxfp4":
            moe = self.config.moe
            widths = {"hidden_size": self.config.hidden_size, "moe.expert_ffn": moe.expert_ffn}
            bad = {k: v for k, v in widths.items() if v % 32}
            if bad:
                raise ConfigError(
                    f"{op}: base='mxfp4' packs the experts' inputs in blocks of 32; {bad} "
                    "is not a multiple of 32"
                )
        if self.base is not None and (self.remat is False or self.remat == "none"):
            raise ConfigError(
                f"{op}: base={self.base!r} needs remat 'matmuls' (the default with it) or "
                "'full': with remat='none' the backward would keep every layer's dequantized "
                "weights, a float copy of the whole base"
            )

    def _check_trainable(self, op: str) -> None:
        """:func:`check_trainable` of this model."""
        check_trainable(self, op)

    def _check_impl(self, op: str) -> None:
        """`impl` taken, and a required custom call present for every op family the model runs."""
        try:
            check_impl(op, self.impl)
        except InvalidArgumentError as e:
            raise ConfigError(str(e)) from None
        platform = self.mesh.devices.flat[0].platform
        families = ["rms_norm", "gemm", "moe", "grouped_gemm"] + (["fp8"] if self.fp8 else [])
        for family in families:
            try:
                jaxops.choose_impl(family, self.impl, backend=platform)
            except InvalidArgumentError:
                raise ConfigError(
                    f"{op}: impl={self.impl!r} requires a custom call for every op the model "
                    f"runs, and jaxops has no {family} custom call on {platform}; pass "
                    "impl=('ffi', 'xla') for the custom calls wherever they exist"
                ) from None

    # ---------------------------------------------------------------------------------------------
    # The layout value, and the layout's public members as the model's.

    @functools.cached_property
    def layout(self) -> Layout:
        """The model on its mesh (:class:`~jaxops.models._layout.Layout`), of these fields."""
        return Layout.of(self)

    @property
    @_doc(Layout.pipe)
    def pipe(self) -> int:
        return self.layout.pipe

    @property
    @_doc(Layout.data_axes)
    def data_axes(self) -> tuple[str, ...]:
        return self.layout.data_axes

    @property
    @_doc(Layout.batch_axes)
    def batch_axes(self) -> tuple[str, ...]:
        return self.layout.batch_axes

    @property
    @_doc(Layout.context)
    def context(self) -> int:
        return self.layout.context

    @property
    @_doc(Layout.input_axes)
    def input_axes(self) -> tuple[str, ...]:
        return self.layout.input_axes

    @property
    @_doc(Layout.batch_devices)
    def batch_devices(self) -> int:
        return self.layout.batch_devices

    @property
    @_doc(Layout.moe)
    def moe(self) -> ep.MoEConfig:
        return self.layout.moe

    @_doc(Layout.param_shapes)
    def param_shapes(self) -> dict[str, Any]:
        return self.layout.param_shapes()

    @_doc(Layout.compute_specs)
    def compute_specs(self) -> dict[str, Any]:
        return self.layout.compute_specs()

    @_doc(Layout.zero_specs)
    def zero_specs(self) -> dict[str, Any]:
        return self.layout.zero_specs()

    @_doc(Layout.param_specs)
    def param_specs(self) -> dict[str, Any]:
        return self.layout.param_specs()

    @_doc(Layout.shardings)
    def shardings(self) -> dict[str, Any]:
        return self.layout.shardings()

    @_doc(Layout.named)
    def named(self, specs: Any) -> Any:
        return self.layout.named(specs)

    @_doc(Layout.optimizer_shardings)
    def optimizer_shardings(self, optimizer: Any, params: Any = None) -> Any:
        return self.layout.optimizer_shardings(optimizer, params)

    @_doc(Layout.init_optimizer)
    def init_optimizer(self, optimizer: Any, params: dict[str, Any]) -> Any:
        self._check_trainable(f"{_OP}.init_optimizer")
        return self.layout.init_optimizer(optimizer, params)

    @_doc(Layout.gathered)
    def gathered(self, params: dict[str, Any]) -> dict[str, Any]:
        return self.layout.gathered(params)

    @_doc(Layout.abstract_params)
    def abstract_params(self, dtype: Any = jnp.float32) -> dict[str, Any]:
        return self.layout.abstract_params(dtype)

    @_doc(Layout.init)
    def init(self, key: jax.Array, dtype: Any = jnp.float32) -> dict[str, Any]:
        return self.layout.init(key, dtype)

    @_doc(Layout.add_adapters)
    def add_adapters(self, params: dict[str, Any], key: jax.Array) -> dict[str, Any]:
        return self.layout.add_adapters(params, key)

    @_doc(Layout.trainable)
    def trainable(self, params: Any) -> Any:
        return self.layout.trainable(params)

    @_doc(Layout.place_batch)
    def place_batch(self, *arrays: Any) -> Any:
        return self.layout.place_batch(*arrays)

    @functools.cached_property
    def _pipe_loss(self) -> Callable:
        """The pipe mesh's loss, differentiable: its gradient is the pipeline step's."""
        return _objective.pipe_loss(self.layout)

    # ---------------------------------------------------------------------------------------------
    # Public methods: validate once, then run the internals.

    def _check(
        self, op: str, tokens, targets, mask, positions, segments, mtp: bool = False
    ) -> _batch.Batch:
        """The validated batch of a public method (:func:`check_batch`)."""
        return check_batch(self, op, tokens, targets, mask, positions, segments, mtp)

    def _in_order(self, x: jax.Array) -> jax.Array:
        """Per-token outputs ``[B, S, ...]`` in sequence order (from the context axis's rows)."""
        return x if self.layout.context == 1 else _context.from_rows(self.layout, x)

    def hidden_states(
        self,
        params: dict[str, Any],
        tokens: jax.Array,
        *,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """The last layer's output ``[B, S, D]`` (compute dtype), before the final norm.

        The batch arguments are those of :meth:`logits`.
        """
        op = f"{_OP}.hidden_states"
        batch = self._check(op, tokens, None, attention_mask, positions, segment_ids)
        return self._in_order(_objective.hidden(self.layout, params, batch))

    def logits(
        self,
        params: dict[str, Any],
        tokens: jax.Array,
        *,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """float32 logits ``[B, S, V]`` of int ``tokens [B, S]`` (call it under ``jax.jit``).

        B must be a multiple of the devices of the batch axes (times the microbatches with a
        pipeline).

        Args:
          params: the parameters (:meth:`init`, :func:`~jaxops.models.from_pretrained`).
          tokens: int32/int64 ``[B, S]`` ids in ``[0, V)``. Host (numpy) arrays are checked
            and an id out of range raises ValueError naming it; on device arrays (under jit)
            such an id embeds as NaN, so its row's logits (and any loss over them) are NaN.
          attention_mask: bool or int ``[B, S]``, 0 at padding (left or right), or None. No
            query sees a padding key, and padding never reaches the MoE router (its routing
            statistics and load-balancing loss count real tokens only). Logits at padding are
            meaningless.
          positions: int ``[B, S]`` rotary positions (transformers' ``position_ids``), or None:
            the index within the document with `segment_ids`, else ``cumsum(attention_mask) -
            1`` with a mask (left padding as transformers' generate), else ``0 .. S-1``.
          segment_ids: int ``[B, S]``: documents packed in one row (1, 2, ...; 0 = padding),
            each attending only to itself (:func:`~jaxops.models.pack_sequences` makes them).
            Causality and the sliding window count in row indices.

        Returns:
          float32 ``[B, S, V]``.
        """
        batch = self._check(f"{_OP}.logits", tokens, None, attention_mask, positions, segment_ids)
        layout = self.layout
        h = _objective.hidden(layout, params, batch)
        return self._in_order(layout.head(layout.head_params(params), h))

    def mtp_logits(
        self,
        params: dict[str, Any],
        tokens: jax.Array,
        *,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """float32 logits ``[B, S, D, V]`` of the D multi-token-prediction modules.

        ``[:, i, k - 1]`` is depth k's prediction of token ``i + k + 1`` at position i, from
        the trunk and the tokens up to ``i + k`` (:mod:`~jaxops.models._mtp`); where ``i + k``
        lies past the row's end, in another document or at padding it is meaningless. The
        arguments are :meth:`logits`'; without a pipeline (call it under ``jax.jit``).

        Raises:
          ConfigError: the config has no MTP modules (``mtp_layers = 0``), or a pipe axis.
        """
        op = f"{_OP}.mtp_logits"
        if not self.config.mtp_layers:
            raise ConfigError(f"{op}: the config has no multi-token-prediction modules")
        if self.pipe > 1:
            raise ConfigError(f"{op}: runs without a pipeline (pipe axis size 1)")
        batch = self._check(op, tokens, None, attention_mask, positions, segment_ids, mtp=True)
        layout = self.layout
        x, where, _ = _objective.inputs(layout, params, batch)
        h = _run.run_all(layout, params, x, where)[0]
        head = layout.head_params(params)
        out, _ = _mtp.hidden(layout, params, head, h, where, batch.mtp_tokens)
        logits = jnp.stack([layout.head(head_k, y) for head_k, y in out], axis=2)
        return self._in_order(logits)

    def forward(
        self,
        params: dict[str, Any],
        tokens: jax.Array,
        *,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, ep.MoEAux]:
        """``(logits, aux)`` without a pipeline; aux: the layers' ``MoEAux``, stacked.

        ``aux.tokens_per_expert [Lm, E]`` is the load of every expert of every MoE layer
        (``config.moe_layers``, in order; real tokens only). The batch arguments are those of
        :meth:`logits`.
        """
        op = f"{_OP}.forward"
        if self.pipe > 1:
            raise InvalidArgumentError(
                f"{op}: per-layer MoE statistics are not available through the pipeline; use "
                "logits() or loss()"
            )
        batch = self._check(op, tokens, None, attention_mask, positions, segment_ids)
        layout = self.layout
        x, where, _ = _objective.inputs(layout, params, batch)
        h, aux = _run.run_all(layout, params, x, where)
        return self._in_order(layout.head(layout.head_params(params), h)), aux

    def loss(
        self,
        params: dict[str, Any],
        tokens: jax.Array,
        targets: jax.Array,
        *,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Next-token cross-entropy of ``targets [B, S]`` plus the layers' MoE aux losses.

        The cross-entropy is the mean over the targets of the whole batch that count: a target
        of -100 (transformers' ignore index) or at a padding token counts for nothing; a batch
        with no target left has cross-entropy 0 (and zero gradients), never NaN. Targets are
        already shifted: ``targets[b, i]`` is the token to predict after ``tokens[b, i]``.

        With a pipe axis it runs the pipeline's forwards only; the value equals
        :meth:`loss_and_grads`'s, and ``jax.grad`` of it runs the pipeline step (the backward
        of the schedule). With ``num_microbatches > 1`` and no pipe axis the microbatches run
        one after another (gradient accumulation, the aux losses per microbatch).

        Args:
          params: the parameters.
          tokens: as in :meth:`logits`.
          targets: int ``[B, S]``, ids in ``[0, V)`` or -100 (checked in host arrays; another
            id on device gives a NaN loss).
          attention_mask: as in :meth:`logits`.
          positions: as in :meth:`logits`.
          segment_ids: as in :meth:`logits`.

        Returns:
          The float32 loss.
        """
        batch = self._check(f"{_OP}.loss", tokens, targets, attention_mask, positions, segment_ids)
        if self.pipe > 1:
            return self._pipe_loss(params, batch)
        return _objective.objective(self.layout, params, batch)

    def loss_and_grads(
        self,
        params: dict[str, Any],
        tokens: jax.Array,
        targets: jax.Array,
        *,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, Any]]:
        """``(loss, grads)`` of :meth:`loss`, grads like params (with ``lora``: the adapters').

        With ``lora`` the gradients are shaped like ``trainable(params)``: the adapter leaves,
        every other leaf None (no base weight's gradient is computed).

        With a pipe axis: one :func:`~jaxops.parallel.pipeline.pipeline_step` (the schedule,
        ``num_microbatches`` per data shard; the MoE aux losses per microbatch). Without one:
        ``jax.value_and_grad`` of the loss, over ``num_microbatches`` microbatches one after
        another when > 1 (gradient accumulation: the activations of one microbatch live at a
        time), and on several devices of the batch axes with ``grad_reduce="flat"`` (the
        default) in one ``shard_map``, the gradients reduced as flat buffers (see
        :attr:`grad_reduce`). The arguments are those of :meth:`loss`, and `dropout_key`:
        with ``lora`` of ``dropout`` > 0, the step's random key (a ``jax.random.key``, or a
        raw ``uint32[2]`` key; required): the adapters of the attention projections (PEFT's
        ``target_modules``) drop their inputs out, each layer and microbatch with its own
        masks. The other adapters take no dropout (PEFT refuses it on ``target_parameters``,
        as it writes them). Ignored without dropout.
        """
        op = f"{_OP}.loss_and_grads"
        self._check_trainable(op)
        batch = self._check(op, tokens, targets, attention_mask, positions, segment_ids)
        key = self._dropout_key(op, dropout_key)
        layout = self.layout
        if self.pipe > 1:
            return _objective.pipeline_step(layout, params, batch)
        if layout.flat_grads:
            return _objective.flat_loss_and_grads(layout, params, batch)
        return _objective.loss_and_grads(layout, params, batch, key)

    def _dropout_key(self, op: str, key: Any) -> jax.Array | None:
        """The training step's LoRA dropout key, checked (None where there is no dropout)."""
        if self.lora is None or self.lora.dropout == 0:
            return None
        if key is None:
            raise InvalidArgumentError(
                f"{op}: dropout_key is required with lora dropout {self.lora.dropout} (a "
                "jax.random.key, a new one each step)"
            )
        typed = isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        if typed and key.shape == ():
            return key
        if not typed and np.shape(key) == (2,) and np.result_type(key) == np.uint32:
            return jnp.asarray(key)
        raise InvalidArgumentError(
            f"{op}: dropout_key must be one jax.random.key (or a raw uint32[2] key), got "
            f"{getattr(key, 'dtype', type(key).__name__)}{list(np.shape(key))}"
        )

    def _zero_loss_and_grads(
        self,
        params,
        tokens,
        targets,
        *,
        attention_mask=None,
        positions=None,
        segment_ids=None,
        dropout_key=None,
    ) -> tuple[jax.Array, dict[str, Any]]:
        """:meth:`loss_and_grads` with the gradients as ZeRO-1 shards (:meth:`zero_specs`).

        Only with ``layout.flat_zero``; the step's batch is checked as :meth:`train_step`'s.
        """
        op = f"{_OP}.train_step"
        batch = self._check(op, tokens, targets, attention_mask, positions, segment_ids)
        return _objective.flat_loss_and_grads(self.layout, params, batch, scatter=True)

    def train_step(self, optimizer: Any) -> _train.TrainStep:
        """A jitted training step: :meth:`loss_and_grads`, ``optimizer.update``, applied.

        ``step(params, opt_state, tokens, targets, **batch) -> (params, opt_state, loss)``.

        `optimizer`: an optax ``GradientTransformation`` (or anything with ``init`` and
        ``update(grads, state, params)``); its state from :meth:`init_optimizer`. The batch
        keywords are :meth:`loss`'s. Parameters and state are donated, laid out by
        :attr:`zero`. ``step.lower(...)`` takes ``jax.ShapeDtypeStruct`` s
        (``jaxops.models.plan`` compiles it so).

        Example:
          >>> import jax, numpy as np, optax
          >>> from jaxops.models import AttentionSpec, DecoderConfig, MoEDecoder, MoESpec
          >>> cfg = DecoderConfig("mixtral", vocab_size=64, hidden_size=32, num_layers=2,
          ...                     attention=AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
          ...                     moe=MoESpec(num_experts=4, top_k=2, expert_ffn=16))
          >>> model = MoEDecoder(cfg, jax.make_mesh((1,), ("expert",)), zero=1)
          >>> opt = optax.adamw(1e-3)
          >>> params = model.init(jax.random.key(0))
          >>> state = model.init_optimizer(opt, params)
          >>> tokens = np.zeros((2, 8), np.int32)
          >>> params, state, loss = model.train_step(opt)(params, state, tokens, tokens)
          >>> loss.shape
          ()
        """
        self._check_trainable(f"{_OP}.train_step")
        # with flat ZeRO-1 the gradients come reduce-scattered into the ZeRO-1 shards
        grads = self._zero_loss_and_grads if self.layout.flat_zero else self.loss_and_grads
        return _train.train_step(self.layout, optimizer, grads)


def check_batch(
    model: MoEDecoder, op: str, tokens, targets, mask, positions, segments, mtp: bool = False
) -> _batch.Batch:
    """The validated batch of a public method of `model` named `op` (targets None: logits).

    With the MTP modules in the loss (or `mtp`: their logits), the depths' inputs and targets
    (:func:`_mtp.shifted`); with a context axis: its rows of chunk pairs
    (:func:`_context.to_rows`). The models tier's other modules (post-training's) validate
    their batches through it.
    """
    layout = model.layout
    shards = int(np.prod([dict(model.mesh.shape)[a] for a in layout.input_axes]))
    split = targets is not None and (model.pipe > 1 or model.num_microbatches > 1)
    split |= model.pipe > 1
    m = model.num_microbatches if split else 1
    why = f"(the {shards} devices of the batch axes {layout.input_axes}" + (
        f" times {m} microbatches)" if m > 1 else ")"
    )
    batch = _batch.check_batch(
        op,
        model.config.vocab_size,
        shards * m,
        why,
        tokens,
        targets,
        need_targets=targets is not None,
        attention_mask=mask,
        positions=positions,
        segment_ids=segments,
    )
    if mtp or (layout.mtp_trained and targets is not None):  # the MTP depths' inputs, targets
        batch = _mtp.shifted(batch, model.config.mtp_layers)
    if layout.context == 1:
        return batch
    c, s = layout.context, batch.tokens.shape[1]
    if s % (2 * c):
        raise InvalidArgumentError(
            f"{op}: tokens' sequence length ({s}) must be a multiple of {2 * c}: the context "
            f"axis {model.context_axis!r} of size {c} splits each sequence into {2 * c} "
            "chunks, two per device"
        )
    return _context.to_rows(layout, batch)


def check_trainable(model: MoEDecoder, op: str) -> None:
    """Refuses training `model` where it cannot (`op`: the public name asking).

    A quantized base trains only through adapters; adapter dropout not through a pipeline.
    """
    if model.base is not None and model.lora is None:
        raise ConfigError(
            f"{op}: base={model.base!r} keeps the base weights frozen and quantized, so they "
            "have no gradients; train adapters on it (lora=jaxops.Lora(...))"
        )
    if model.lora is not None and model.lora.dropout > 0 and model.pipe > 1:
        raise ConfigError(
            f"{op}: lora dropout ({model.lora.dropout}) through a pipeline is not built yet "
            f"(pipe axis {model.pipe_axis!r} of size {model.pipe}); train with dropout=0 "
            "there, or with dropout on a mesh without a pipe axis"
        )
