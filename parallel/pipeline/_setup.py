"""Argument checks of the pipeline entry points and what they resolve to (:class:`Setup`).

The mesh axes, the stacking of ``stage_params``, the batch split, ``param_specs``, ``remat``
and the shape contract of ``stage_fn`` are checked here, before (or, for what needs a trace,
while) the step is traced; every message starts with the public name of the entry point.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxops._errors import ArgumentTypeError, InvalidArgumentError

from ._program import Program, build_program
from ._schedule import check_schedule

__all__ = ["Setup", "check_like", "check_mesh_axes", "checkpointed", "make_setup", "spec_axes"]


@dataclasses.dataclass(frozen=True)
class Setup:
    """The checked arguments of a pipeline call.

    Attributes:
      op: the public name of the entry point, for messages.
      pipe_axis: the pipeline mesh axis.
      data_axes: the mesh axes the batch is split over.
      p: P, the size of pipe_axis.
      v: V, chunks per device.
      m: M, microbatches per data shard.
      shards: the devices of data_axes.
      program: the per-tick program of the schedule.
      param_specs: PartitionSpecs of stage_params, the stage axis over pipe_axis.
      batch_spec: the PartitionSpec of a batch leaf (dim 0 over data_axes).
    """

    op: str
    pipe_axis: str
    data_axes: tuple[str, ...]
    p: int
    v: int
    m: int
    shards: int
    program: Program
    param_specs: Any
    batch_spec: P


def spec_axes(spec: P) -> set[str]:
    """The mesh axes a PartitionSpec names."""
    return {a for e in spec for a in (e if isinstance(e, tuple) else (e,)) if a}


def check_mesh_axes(
    op: str, mesh: Any, pipe_axis: Any, data_axes: Any
) -> tuple[str, tuple[str, ...]]:
    """``(pipe_axis, data_axes)`` checked against `mesh`; data_axes None: every other axis."""
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise ArgumentTypeError(
            f"{op}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}"
        )
    names = tuple(mesh.axis_names)
    if pipe_axis not in names:
        raise InvalidArgumentError(
            f"{op}: pipe_axis {pipe_axis!r} is not an axis of the mesh; its axes are {names}"
        )
    if data_axes is None:
        data_axes = tuple(a for a in names if a != pipe_axis)
    elif isinstance(data_axes, str):
        data_axes = (data_axes,)
    data_axes = tuple(data_axes)
    for a in data_axes:
        if a not in names or a == pipe_axis:
            raise InvalidArgumentError(
                f"{op}: data_axes must name mesh axes other than the pipeline axis "
                f"{pipe_axis!r}; got {a!r} (mesh axes {names})"
            )
    return pipe_axis, data_axes


def _leading(op: str, name: str, tree: Any, size: int, what: str) -> None:
    """Every leaf of `tree` is an array with leading dim `size` (`what` says why)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        raise InvalidArgumentError(f"{op}: {name} has no arrays")
    for path, leaf in leaves:
        where = f"{name}{jax.tree_util.keystr(path)}"
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise ArgumentTypeError(f"{op}: {where} must be an array, got {type(leaf).__name__}")
        if leaf.ndim == 0 or leaf.shape[0] != size:
            raise InvalidArgumentError(
                f"{op}: every leaf of {name} must be stacked on a leading axis of size "
                f"{size} ({what}); {where} has shape {tuple(leaf.shape)}"
            )


def _stage_specs(op: str, pipe_axis: str, param_specs: Any, stage_params: Any) -> Any:
    """PartitionSpecs of stage_params: the stage axis over pipe_axis, then `param_specs`."""
    if param_specs is None:
        return jax.tree.map(lambda _: P(pipe_axis), stage_params)
    try:
        specs = jax.tree.map(
            lambda s, _: P(pipe_axis, *s),
            param_specs,
            stage_params,
            is_leaf=lambda s: isinstance(s, P),
        )
    except ValueError as e:
        raise InvalidArgumentError(
            f"{op}: param_specs must be a pytree like one stage's params with a "
            f"PartitionSpec per leaf: {e}"
        ) from None
    for spec in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)):
        if pipe_axis in spec_axes(P(*spec[1:])):
            raise InvalidArgumentError(
                f"{op}: param_specs shard a stage's params within the stage, over mesh axes "
                f"other than the pipeline axis {pipe_axis!r}; got {P(*spec[1:])}"
            )
    return specs


def loss_specs(op: str, pipe_axis: str, loss_param_specs: Any, loss_params: Any) -> Any:
    """PartitionSpecs of loss_params: `loss_param_specs` checked, or replicated (None)."""
    if loss_param_specs is None:
        return jax.tree.map(lambda _: P(), loss_params)
    try:  # a spec where loss_params has a subtree: every leaf of it so
        specs = jax.tree.map(
            lambda s, sub: jax.tree.map(lambda _: s, sub),
            loss_param_specs,
            loss_params,
            is_leaf=lambda s: isinstance(s, P),
        )
    except ValueError as e:
        raise InvalidArgumentError(
            f"{op}: loss_param_specs must be a pytree like loss_params with a PartitionSpec "
            f"per leaf: {e}"
        ) from None
    for spec in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)):
        if not isinstance(spec, P):
            raise ArgumentTypeError(
                f"{op}: loss_param_specs must hold PartitionSpecs, got {type(spec).__name__}"
            )
        if pipe_axis in spec_axes(spec):
            raise InvalidArgumentError(
                f"{op}: loss_param_specs shard loss_params over mesh axes other than the "
                f"pipeline axis {pipe_axis!r} (the loss runs on the last stage); got {spec}"
            )
    return specs


def make_setup(
    op: str,
    stage_params: Any,
    inputs: Any,
    targets: Any,
    *,
    mesh: Any,
    pipe_axis: str,
    data_axes: Any,
    num_microbatches: Any,
    schedule: str,
    virtual_stages: Any,
    param_specs: Any,
    forward_only: bool,
) -> Setup:
    """Checks the arguments of a pipeline call and resolves them into a :class:`Setup`.

    Raises:
      TypeError / ValueError (messages start with `op`): see
        :func:`~jaxops.parallel.pipeline.pipeline_step`.
    """
    pipe_axis, data_axes = check_mesh_axes(op, mesh, pipe_axis, data_axes)
    p = dict(mesh.shape)[pipe_axis]
    schedule, p, m, v = check_schedule(op, schedule, p, num_microbatches, virtual_stages)
    _leading(
        op,
        "stage_params",
        stage_params,
        p * v,
        f"num_stages * virtual_stages = {p} * {v}: the size of mesh axis {pipe_axis!r} times "
        "the chunks per device",
    )
    shards = math.prod(dict(mesh.shape)[a] for a in data_axes)
    first = jax.tree.leaves(inputs)
    if not first:
        raise InvalidArgumentError(f"{op}: inputs has no arrays")
    batch = first[0].shape[0] if first[0].ndim else 0
    what = (
        f"the batch, split over the {shards} devices of data_axes {data_axes} and into "
        f"num_microbatches = {m}, must be a multiple of {shards * m}"
    )
    if batch == 0 or batch % (shards * m):
        raise InvalidArgumentError(f"{op}: {what}; inputs has batch {batch}")
    _leading(op, "inputs", inputs, batch, "the batch")
    if targets is not None:
        _leading(op, "targets", targets, batch, "the batch of inputs")
    return Setup(
        op=op,
        pipe_axis=pipe_axis,
        data_axes=data_axes,
        p=p,
        v=v,
        m=m,
        shards=shards,
        program=build_program(schedule, p, m, v, forward_only),
        param_specs=_stage_specs(op, pipe_axis, param_specs, stage_params),
        batch_spec=P(data_axes or None),
    )


def checkpointed(op: str, stage_fn: Callable, remat: Any) -> Callable:
    """`stage_fn` as its forward is differentiated under `remat` (see ``pipeline_step``)."""
    if remat is False or remat is None:
        return stage_fn
    if remat is True:
        return jax.checkpoint(stage_fn)
    if callable(remat):
        return jax.checkpoint(stage_fn, policy=remat)
    raise ArgumentTypeError(
        f"{op}: remat must be True, False or a jax.checkpoint_policies policy, got {remat!r}"
    )


def check_like(op: str, y: Any, x: Any) -> None:
    """stage_fn's output must be like its input: every stage feeds the next."""
    want = jax.tree.structure(x), [(a.shape, np.dtype(a.dtype)) for a in jax.tree.leaves(x)]
    got = jax.tree.structure(y), [(a.shape, np.dtype(a.dtype)) for a in jax.tree.leaves(y)]
    if got != want:
        raise InvalidArgumentError(
            f"{op}: stage_fn must return its input's structure, shapes and dtypes (each stage "
            f"feeds the next): for a microbatch {want[1]} it returned {got[1]}"
        )
