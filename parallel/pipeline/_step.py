"""The pipeline entry points: :func:`pipeline_step` and :func:`pipeline_forward`.

:func:`pipeline_step` (loss and gradients, in a :class:`PipelineGrads`) and
:func:`pipeline_forward` (inference) each check their arguments and run one ``shard_map`` over
the mesh around the body of ``_run``.

Their pipeline mesh axis keyword is ``pipe_axis=``; the old name ``axis=`` still works for one
release with a DeprecationWarning.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxops import _checks
from jaxops._errors import ArgumentTypeError, InvalidArgumentError, renamed_kwargs
from jaxops._sharding import place

from ._run import run_forward, run_training
from ._setup import checkpointed, loss_specs, make_setup
from ._trees import float0_like, float_leaves, split_frozen

__all__ = ["PipelineGrads", "pipeline_forward", "pipeline_step"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _takes_old_axis_keyword(fn: _F) -> _F:
    """`fn` that also takes its ``pipe_axis=`` under the deprecated name ``axis=``."""
    op = f"jaxops.parallel.pipeline.{fn.__name__}"

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **renamed_kwargs(op, kwargs, {"axis": "pipe_axis"}))

    return wrapper  # type: ignore[return-value]


class PipelineGrads(NamedTuple):
    """Gradients of the pipelined loss.

    Attributes:
      stage_params: like ``stage_params`` (same layout, dtypes and sharding; None at the
        leaves ``frozen`` marks).
      loss_params: like ``loss_params`` (None when it was None, and at frozen leaves).
      inputs: like ``inputs`` (None with ``input_grads=False``).
      targets: like ``targets``; integer leaves get ``float0`` zeros, as ``jax.grad`` gives them
        (None with ``input_grads=False`` or without targets).
    """

    stage_params: Any
    loss_params: Any
    inputs: Any
    targets: Any


@_takes_old_axis_keyword
def pipeline_step(
    stage_fn: Callable[[Any, Any], Any],
    stage_params: Any,
    inputs: Any,
    *,
    loss_fn: Callable[[Any, Any, Any], jax.Array],
    mesh: jax.sharding.Mesh,
    num_microbatches: int,
    targets: Any = None,
    loss_params: Any = None,
    pipe_axis: str = "pipe",
    data_axes: str | Sequence[str] | None = None,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    remat: bool | Callable = False,
    has_aux: bool = False,
    param_specs: Any = None,
    input_grads: bool = True,
    frozen: Any = None,
    loss_param_specs: Any = None,
) -> tuple[jax.Array, PipelineGrads]:
    """Loss and gradients of a pipelined model, in one ``shard_map`` (call it under ``jax.jit``).

    The model is ``loss_fn(loss_params, stage_{L-1}(... stage_0(inputs)), targets)`` with
    ``stage_s(x) = stage_fn(params of stage s, x)``; the loss is averaged over the
    microbatches and the data shards, which equals the full-batch loss when ``loss_fn`` averages
    over its batch. See :mod:`jaxops.parallel.pipeline` for the schedules and the parameter
    layout.

    Args:
      stage_fn: ``(params of one stage, x) -> x`` (or ``-> (x, aux_loss)`` with has_aux), the
        output like the input (same pytree, shapes and dtypes). It runs on one device's
        microbatch, inside ``shard_map``: collectives over the non-pipeline mesh axes are
        allowed (an expert-parallel MoE layer, tensor parallelism).
      stage_params: pytree, every leaf stacked on a leading axis of ``L = P * virtual_stages``
        stages (P the size of `pipe_axis`) in the round-robin layout of
        :func:`~jaxops.parallel.pipeline.interleave`.
      inputs: pytree of ``[B, ...]`` arrays, the input of stage 0; B a multiple of
        ``num_microbatches`` times the devices of `data_axes`.
      loss_fn: ``(loss_params, outputs, targets) -> scalar`` on one microbatch; runs on the
        devices of the last stage, inside ``shard_map`` like stage_fn (collectives over the
        non-pipeline axes allowed: a multi-token-prediction module's MoE layer).
      mesh: the mesh holding `pipe_axis` (and `data_axes`).
      num_microbatches: M, microbatches per data shard (a multiple of P when V > 1).
      targets: pytree of ``[B, ...]`` arrays split like inputs and passed to loss_fn, or None.
      loss_params: pytree passed to loss_fn (an output head, say), or None: whole, or each
        device's shard of the leaves `loss_param_specs` shards.
      pipe_axis: the pipeline mesh axis (its old name ``axis=`` works for one more release,
        with a DeprecationWarning).
      data_axes: mesh axes the batch is split over (default: every axis but `pipe_axis`).
      schedule: "gpipe", "1f1b" or "interleaved".
      virtual_stages: V, chunks per device (1 for "1f1b", >= 2 for "interleaved").
      remat: what a stage keeps for its backward: False its vjp residuals, True only its input
        (the backward recomputes the forward), or a ``jax.checkpoint_policies`` policy.
      has_aux: stage_fn returns ``(x, aux_loss)``; the scalar aux losses of all stages are added
        to the loss (averaged over microbatches like it), e.g. MoE load-balancing losses.
      param_specs: pytree like one stage's params of PartitionSpecs for the dims after the
        stage axis, over mesh axes other than `pipe_axis` (default: replicated). A leaf sharded over
        a data axis is a different parameter on each device of it (the experts of an
        expert-parallel layer, whose tokens are split over that axis too): its gradient is not
        reduced over that axis; the gradients of leaves replicated over a data axis are.
      input_grads: also return the gradients of inputs and targets. They are as large as the
        batch (buffers that grow with M); without them the step's memory does not.
      frozen: which parameters are read but not trained (adapters on a frozen base, a frozen
        head): bools like ``(stage_params, loss_params)``, or a prefix of that tree (``(mask,
        True)`` freezes the whole of loss_params; True for a dict freezes every leaf in it).
        A frozen leaf's gradient is never computed (its weight gradient is not in the
        program) and comes back None; residuals computed from frozen leaves alone (a
        dequantized weight, say) are recomputed by the backward, like the trained params'.
        None (the default): everything is trained.
      loss_param_specs: pytree like loss_params (or a prefix of it) of PartitionSpecs over
        mesh axes other than `pipe_axis` (default: every leaf replicated), with param_specs'
        rule for the gradients: a leaf sharded over a data axis (the experts of an MoE layer
        in the loss) is not reduced over it.

    Returns:
      ``(loss, grads)``: the float32 loss and a :class:`PipelineGrads` (``grads.stage_params``
      in the layout and sharding of stage_params, None at frozen leaves).

    Raises:
      TypeError / ValueError: an unknown schedule, M or V that do not fit it, a mesh without
        the axes, params not stacked on ``P * V`` stages, a batch not divisible by
        ``M * data shards``, stage_fn changing its input's shape, loss_fn not scalar, `frozen`
        not bools shaped like (a prefix of) ``(stage_params, loss_params)``, loss_param_specs
        not shaped like loss_params or naming the pipeline axis.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxops.parallel.pipeline import pipeline_step
      >>> mesh = jax.make_mesh((4, 2), ("pipe", "data"))
      >>> params = {"w": jax.random.normal(jax.random.key(0), (4, 16, 16)) / 4}
      >>> x = jax.random.normal(jax.random.key(1), (32, 16))
      >>> y = jnp.zeros((32, 16))
      >>> step = jax.jit(lambda p, x, y: pipeline_step(
      ...     lambda p, x: jnp.tanh(x @ p["w"]), p, x, targets=y,
      ...     loss_fn=lambda _, out, y: jnp.mean((out - y) ** 2),
      ...     mesh=mesh, num_microbatches=8))
      >>> loss, grads = step(params, x, y)
      >>> loss.shape, grads.stage_params["w"].shape
      ((), (4, 16, 16))
    """
    op = "jaxops.parallel.pipeline.pipeline_step"
    if not callable(stage_fn) or not callable(loss_fn):
        raise ArgumentTypeError(f"{op}: stage_fn and loss_fn must be callables")
    setup = make_setup(
        op,
        stage_params,
        inputs,
        targets,
        mesh=mesh,
        pipe_axis=pipe_axis,
        data_axes=data_axes,
        num_microbatches=num_microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        param_specs=param_specs,
        forward_only=False,
    )
    fn = checkpointed(op, stage_fn, remat)
    batch = setup.batch_spec
    param_specs = setup.param_specs
    lp_specs = loss_specs(op, setup.pipe_axis, loss_param_specs, loss_params)
    params, lparams = stage_params, loss_params
    masks = _frozen_masks(op, frozen, stage_params, loss_params)
    if masks is not None:  # each a pair (trained, frozen)
        sp_mask, lp_mask = masks
        param_specs, lp_specs = split_frozen(param_specs, sp_mask), split_frozen(lp_specs, lp_mask)
        params, lparams = split_frozen(params, sp_mask), split_frozen(lparams, lp_mask)
    grad_specs, dlp_specs = (param_specs[0], lp_specs[0]) if masks else (param_specs, lp_specs)
    in_specs = (
        param_specs,
        lp_specs,
        jax.tree.map(lambda _: batch, inputs),
        jax.tree.map(lambda _: batch, targets),
    )
    dt_specs = [batch for _ in float_leaves(targets)]
    out_specs = (P(), grad_specs, dlp_specs, in_specs[2], dt_specs)
    args = place((params, lparams, inputs, targets), mesh, in_specs)
    input_grads = _checks.check_bool(op, "input_grads", input_grads)
    body = functools.partial(
        run_training,
        setup,
        fn,
        loss_fn,
        has_aux,
        input_grads,
        (grad_specs, dlp_specs),
        masks is not None,
    )
    if not input_grads:
        out_specs = out_specs[:3]
    results = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True
    )(*args)

    def cast(grads: Any, like: Any) -> Any:
        return jax.tree.map(
            lambda g, a: None if g is None else g.astype(a.dtype), grads, like, is_leaf=_is_none
        )

    loss, dparams, dlp = results[0], cast(results[1], stage_params), cast(results[2], loss_params)
    if not input_grads:
        return loss, PipelineGrads(dparams, dlp, None, None)
    din, dt = cast(results[3], inputs), results[4]
    dt = [g.astype(a.dtype) for g, a in zip(dt, float_leaves(targets), strict=True)]
    dtargets = float0_like(targets, dt) if targets is not None else None
    return loss, PipelineGrads(dparams, dlp, din, dtargets)


def _is_none(x: Any) -> bool:
    return x is None


def _frozen_masks(op: str, frozen: Any, stage_params: Any, loss_params: Any) -> Any:
    """``(stage mask, loss mask)``: `frozen` as a bool per leaf, or None when nothing is frozen."""
    if frozen is None:
        return None
    trees = (stage_params, loss_params)
    for m in jax.tree.leaves(frozen):
        if not isinstance(m, bool | np.bool_):
            raise ArgumentTypeError(
                f"{op}: frozen must hold bools (True: a leaf read but not trained), got "
                f"{type(m).__name__} {m!r}"
            )
    try:
        masks = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: bool(m), sub), frozen, trees)
    except ValueError as e:
        raise InvalidArgumentError(
            f"{op}: frozen must be bools shaped like (stage_params, loss_params) or a prefix "
            f"of that tree: {e}"
        ) from None
    if not any(jax.tree.leaves(masks)):
        return None
    return masks


@_takes_old_axis_keyword
def pipeline_forward(
    stage_fn: Callable[[Any, Any], Any],
    stage_params: Any,
    inputs: Any,
    *,
    mesh: jax.sharding.Mesh,
    num_microbatches: int,
    pipe_axis: str = "pipe",
    data_axes: str | Sequence[str] | None = None,
    virtual_stages: int = 1,
    has_aux: bool = False,
    param_specs: Any = None,
) -> Any:
    """The pipelined model's outputs (inference): forwards only, no stash.

    Every device runs its forwards in order (``V M + P - 1`` ticks); the outputs of the last
    stage are all-reduced over the pipeline axis so they come back like `inputs`.

    Args:
      stage_fn: as in :func:`pipeline_step` (with has_aux, the aux losses are dropped).
      stage_params: as in :func:`pipeline_step`.
      inputs: as in :func:`pipeline_step`.
      mesh: as in :func:`pipeline_step`.
      num_microbatches: as in :func:`pipeline_step`.
      pipe_axis: as in :func:`pipeline_step`.
      data_axes: as in :func:`pipeline_step`.
      virtual_stages: V chunks per device (the schedule is the forward half of "gpipe"; of
        "interleaved" when V > 1).
      has_aux: as in :func:`pipeline_step`.
      param_specs: as in :func:`pipeline_step`.

    Returns:
      ``stage_{L-1}(... stage_0(inputs))``, like inputs (sharded over data_axes).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxops.parallel.pipeline import pipeline_forward
      >>> mesh = jax.make_mesh((8,), ("pipe",))
      >>> params = {"w": jnp.ones((8, 4, 4)) / 4}
      >>> out = jax.jit(lambda p, x: pipeline_forward(lambda p, x: x @ p["w"], p, x,
      ...     mesh=mesh, num_microbatches=2))(params, jnp.ones((6, 4)))
      >>> out.shape, float(out[0, 0])
      ((6, 4), 1.0)
    """
    op = "jaxops.parallel.pipeline.pipeline_forward"
    if not callable(stage_fn):
        raise ArgumentTypeError(f"{op}: stage_fn must be callable")
    schedule = (
        "interleaved" if _checks.check_int(op, "virtual_stages", virtual_stages, 1) > 1 else "gpipe"
    )
    setup = make_setup(
        op,
        stage_params,
        inputs,
        None,
        mesh=mesh,
        pipe_axis=pipe_axis,
        data_axes=data_axes,
        num_microbatches=num_microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        param_specs=param_specs,
        forward_only=True,
    )
    in_specs = (setup.param_specs, jax.tree.map(lambda _: setup.batch_spec, inputs))
    args = place((stage_params, inputs), mesh, in_specs)

    body = functools.partial(run_forward, setup, stage_fn, has_aux)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=in_specs[1], check_vma=True)(
        *args
    )
