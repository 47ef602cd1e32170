"""The per-device body of the pipeline inside ``shard_map``: one ``lax.scan`` over the ticks.

Both entry points start with the same :func:`prologue` (this device's program row, the
microbatched inputs and the params marked varying, the stage function with its aux loss, the
activation ring). Then

- :func:`run_forward` (inference, ``pipeline_forward``): per tick the stage's forward or a
  pass-through, the activation sent on; the last stage's outputs are gathered after the loop.
- :func:`run_training` (``pipeline_step``): per tick an idle, forward, last-stage forward (with
  the loss and its vjp) or backward branch; a forward stashes the stage's vjp residuals (but
  those computed from the params alone, which the backward recomputes), the
  backward rebuilds the vjp from them with the :class:`~._trees.ResidualLayout` that a trace of
  the stage in the prologue returned. Gradients accumulate over the ticks and are reduced once
  after the loop.

Everything a tick computes varies over the pipeline axis and the batch axes, so no collective
hides in a branch only some devices take: a tick's only collectives are one ``ppermute`` of
activations forward and (training) one of gradients backward.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxops._errors import InvalidArgumentError
from jaxops._sharding import vary_like

from ._program import (
    ACT_READ,
    ACT_STORE,
    CHUNK,
    FIRST,
    GRAD_READ,
    GRAD_STORE,
    IN_STORE,
    KIND,
    LAST,
    LOSS_STORE,
    MB,
    OUT_STORE,
    STASH,
)
from ._schedule import BACKWARD, FORWARD
from ._setup import Setup, check_like, spec_axes
from ._trees import (
    ResidualLayout,
    buffer,
    conform,
    float_leaves,
    join_residuals,
    merge_floats,
    merge_frozen,
    microbatches,
    param_derived,
    ppermute,
    put,
    slot,
    split_residuals,
    vary_over,
)

__all__ = ["Prologue", "prologue", "run_forward", "run_training"]


@dataclasses.dataclass(frozen=True, eq=False)
class Prologue:
    """What the forward and the training paths share, built by :func:`prologue` in the trace.

    Attributes:
      setup: the checked arguments.
      fn: ``stage_fn`` (checkpointed per ``remat`` for training).
      has_aux: stage_fn returns ``(x, aux_loss)``.
      me: int32 scalar, this device's index on the pipeline axis.
      rows: ``[T, COLUMNS]`` int32, this device's program.
      everywhere: the pipeline axis and the data axes.
      xs: inputs split into microbatches (``[M, b, ...]`` leaves), varying everywhere.
      params: this device's stage params (``[V, ...]`` leaves), varying everywhere.
      x0: microbatch 0, the type of an activation.
      p0: chunk 0's params, the type of one stage's params.
      act_fwd: the ``ppermute`` pairs of activations: d -> d + 1 (and P - 1 -> 0 when V > 1).
      frozen: training with frozen leaves: the stage params (so ``params``, ``p0`` and a
        chunk's params) and the loss params come as pairs ``(trained, frozen)``
        (:func:`~._trees.split_frozen`), merged before stage_fn and loss_fn see them; only the
        trained half is differentiated.
    """

    setup: Setup
    fn: Callable
    has_aux: bool
    me: jax.Array
    rows: jax.Array
    everywhere: tuple[str, ...]
    xs: Any
    params: Any
    x0: Any
    p0: Any
    act_fwd: list[tuple[int, int]]
    frozen: bool = False

    def apply(self, p_v: Any, x: Any) -> tuple[Any, jax.Array]:
        """``(y, aux)``: the stage on one microbatch; aux a float32 scalar (0 without has_aux)."""
        op = self.setup.op
        out = self.fn(merge_frozen(*p_v) if self.frozen else p_v, x)
        if not self.has_aux:
            return out, vary_like(jnp.zeros((), jnp.float32), self.x0)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise InvalidArgumentError(
                f"{op}: with has_aux=True stage_fn must return (x, aux_loss)"
            )
        if jnp.shape(out[1]) != ():
            raise InvalidArgumentError(
                f"{op}: stage_fn's aux_loss must be a scalar, got shape {jnp.shape(out[1])}"
            )
        return out[0], vary_like(out[1].astype(jnp.float32), self.x0)

    def vjp(self, p_v: Any, x: Any) -> tuple[tuple[Any, jax.Array], Callable]:
        """``((y, aux), vjp function)`` of :meth:`apply` in its trained params and x."""
        if not self.frozen:
            return jax.vjp(self.apply, p_v, x)
        trained, frozen = p_v
        return jax.vjp(lambda t, x: self.apply((t, frozen), x), trained, x)

    def chunk_params(self, chunk: jax.Array) -> Any:
        """The params of this device's chunk `chunk` (one chunk: a static index, no copy)."""
        if self.setup.v == 1:
            return jax.tree.map(lambda a: a[0], self.params)
        return slot(self.params, chunk)

    def stage_input(self, act: Any, row: jax.Array) -> Any:
        """The op's input: its microbatch of inputs at stage 0, else the activation it reads."""
        return jax.tree.map(
            lambda a, b: jnp.where(row[FIRST] == 1, a, b),
            slot(self.xs, row[MB]),
            slot(act, row[ACT_READ]),
        )

    def send_forward(self, act: Any, row: jax.Array, y: Any) -> Any:
        """`act` with `y` sent to the next stage's device, stored where the program says."""
        return put(act, row[ACT_STORE], ppermute(y, self.setup.pipe_axis, self.act_fwd))

    def from_device(self, d: int, rows: Any) -> Any:
        """``[M (+ 1 dummy), b, ...]`` rows written on device d, as ``[M b, ...]`` everywhere."""
        m, axis = self.setup.m, self.setup.pipe_axis
        rows = jax.tree.map(lambda a: jnp.where(self.me == d, a[:m], 0), rows)
        rows = jax.lax.psum(rows, axis)
        return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), rows)


def prologue(
    setup: Setup, fn: Callable, has_aux: bool, params: Any, inputs: Any, frozen: bool = False
) -> Prologue:
    """The common start of both paths (see :class:`Prologue`)."""
    p, v, axis = setup.p, setup.v, setup.pipe_axis
    me = jax.lax.axis_index(axis)
    everywhere = (axis, *setup.data_axes)
    # Everything a tick computes varies over the pipeline axis and the batch axes: no collective
    # hides in a branch only some devices take. Gradients of values replicated over the batch
    # axes are reduced once, after the loop (one all-reduce per step, as data parallelism does).
    xs = vary_over(microbatches(inputs, setup.m), everywhere)
    params = vary_over(params, everywhere)
    return Prologue(
        setup=setup,
        fn=fn,
        has_aux=has_aux,
        me=me,
        rows=jnp.asarray(setup.program.rows)[:, me],
        everywhere=everywhere,
        xs=xs,
        params=params,
        x0=slot(xs, jnp.int32(0)),
        p0=slot(params, jnp.int32(0)),
        act_fwd=[(i, i + 1) for i in range(p - 1)] + ([(p - 1, 0)] if v > 1 else []),
        frozen=frozen,
    )


# -------------------------------------------------------------------------------------------------
# Inference.


def run_forward(setup: Setup, stage_fn: Callable, has_aux: bool, params: Any, inputs: Any) -> Any:
    """The last stage's outputs, like `inputs` (this device's data shard)."""
    pro = prologue(setup, stage_fn, has_aux, params, inputs)
    # Trace the stage once to check its output type (XLA drops this unused computation).
    check_like(setup.op, pro.apply(pro.p0, pro.x0)[0], pro.x0)
    init = {
        "act": buffer(setup.program.act_slots + 1, pro.x0),
        "out": buffer(setup.m + 1, pro.x0),
    }
    final, _ = jax.lax.scan(functools.partial(_forward_tick, pro), init, pro.rows)
    return pro.from_device(setup.p - 1, final["out"])  # only the last stage wrote outputs


def _forward_tick(pro: Prologue, carry: dict, row: jax.Array) -> tuple[dict, None]:
    y = jax.lax.cond(
        row[KIND] == FORWARD,
        lambda p_v, x: conform(pro.apply(p_v, x)[0], pro.x0),
        lambda p_v, x: x,
        pro.chunk_params(row[CHUNK]),
        pro.stage_input(carry["act"], row),
    )
    act = pro.send_forward(carry["act"], row, y)
    return {"act": act, "out": put(carry["out"], row[OUT_STORE], y)}, None


# -------------------------------------------------------------------------------------------------
# Training.


def _stage_forward(
    pro: Prologue, p_v: Any, x: Any, derived: dict
) -> tuple[Any, jax.Array, list, ResidualLayout]:
    """``(y, aux, stash, layout)``: the stage's forward, its residuals to stash and their layout.

    derived: the residuals computed from the params alone (:func:`param_derived`), not stashed.
    """
    (y, aux), vjp_fn = pro.vjp(p_v, x)
    stash, layout = split_residuals(vjp_fn, p_v, derived, op=pro.setup.op)
    return y, aux, stash, layout


def _loss_vjp(
    pro: Prologue, loss_fn: Callable, seed: float, lp: Any, y: Any, t: Any
) -> tuple[jax.Array, Any, Any, list]:
    """``(loss, d loss_params, dy, d float leaves of t)``, the cotangents scaled by `seed`.

    (With frozen leaves `lp` is the pair ``(trained, frozen)`` and d loss_params the trained
    half's.)
    """
    lp, frozen = lp if pro.frozen else (lp, None)

    def f(lp, y, tf):
        return loss_fn(merge_frozen(lp, frozen) if pro.frozen else lp, y, merge_floats(t, tf))

    loss, vjp_fn = jax.vjp(f, lp, y, float_leaves(t))
    if jnp.shape(loss) != ():
        raise InvalidArgumentError(
            f"{pro.setup.op}: loss_fn must return a scalar, got shape {jnp.shape(loss)}"
        )
    dlp, dy, dt = vjp_fn(vary_like(jnp.asarray(seed, loss.dtype), loss))
    return vary_like(loss.astype(jnp.float32), pro.x0), dlp, dy, dt


def _aux_cotangent(seed: float, aux: jax.Array) -> jax.Array:
    """The cotangent of a stage's aux loss: `seed`, typed like `aux`."""
    return vary_like(jnp.asarray(seed, jnp.float32), aux)


@dataclasses.dataclass(frozen=True, eq=False)
class _TrainTick:
    """One training tick on one device: the branch of its op, then the sends and the stores.

    Every branch returns the same dict (``zeros`` where it computes nothing, typed as ``types``):
    y (activation out), res (residuals to stash), dx (input gradient out), loss, dy (loss
    gradient of the last stage), dlp (loss_params gradients), dt (target gradients), and gacc:
    the parameter gradient accumulator it is given, to which the backward branch adds its
    gradients (the others return it as it is: no zero gradient is made or added).
    """

    pro: Prologue
    loss_fn: Callable
    loss_params: Any
    ts: Any
    seed: float
    layout: ResidualLayout
    derived: dict
    recompute: Callable
    aux0: jax.Array
    types: dict
    zeros: dict
    input_grads: bool

    def _forward(self, p_v: Any, x: Any) -> tuple[Any, jax.Array, list]:
        y, aux, res, layout = _stage_forward(self.pro, p_v, x, self.derived)
        if layout.where != self.layout.where:  # backward rebuilds the vjp with self.layout
            raise RuntimeError(
                f"{self.pro.setup.op}: stage_fn's vjp residuals differ between two traces "
                "(stage_fn must trace the same way every time)"
            )
        return y, aux, res

    def _conform(self, out: dict) -> dict:
        """`out` (every key but dp) typed as ``types``."""
        return conform(out, {k: self.types[k] for k in self.zeros})

    def idle(self, p_v, x, dy, res, t, chunk, gacc):
        return {**self.zeros, "gacc": gacc}

    def fwd(self, p_v, x, dy, res, t, chunk, gacc):
        y, aux, res = self._forward(p_v, x)
        out = {**self.zeros, "y": y, "res": res, "loss": aux * self.seed}
        return {**self._conform(out), "gacc": gacc}

    def fwd_last(self, p_v, x, dy, res, t, chunk, gacc):
        y, aux, res = self._forward(p_v, x)
        loss, dlp, dy, dt = _loss_vjp(self.pro, self.loss_fn, self.seed, self.loss_params, y, t)
        out = {"res": res, "loss": (loss + aux) * self.seed, "dy": dy, "dlp": dlp, "dt": dt}
        return {**self._conform({**self.zeros, **out}), "gacc": gacc}

    def bwd(self, p_v, x, dy, res, t, chunk, gacc):
        vjp_fn = join_residuals(self.layout, res, p_v, self.recompute(p_v))
        dp, dx = vjp_fn((dy, _aux_cotangent(self.seed, self.aux0)))
        dp = conform(dp, self.types["dp"])
        if self.pro.setup.v == 1:
            gacc = jax.tree.map(lambda acc, g: acc.at[0].add(g), gacc, dp)
        else:
            gacc = jax.tree.map(
                lambda acc, g: jax.lax.dynamic_update_index_in_dim(
                    acc, jax.lax.dynamic_index_in_dim(acc, chunk, keepdims=False) + g, chunk, 0
                ),
                gacc,
                dp,
            )
        return {**self._conform({**self.zeros, "dx": dx}), "gacc": gacc}

    def __call__(self, c: dict, row: jax.Array) -> tuple[dict, None]:
        pro = self.pro
        kind, mb, chunk = row[KIND], row[MB], row[CHUNK]
        x_in = pro.stage_input(c["act"], row)
        branch = jnp.where(kind == BACKWARD, 3, jnp.where(row[LAST] == 1, 2, kind))
        out = jax.lax.switch(
            branch,
            [self.idle, self.fwd, self.fwd_last, self.bwd],
            pro.chunk_params(chunk),
            x_in,
            slot(c["grad"], row[GRAD_READ]),
            slot(c["stash"], row[STASH]),
            slot(self.ts, mb) if self.ts is not None else None,
            chunk,
            c["gacc"],
        )
        act_bwd = [(j, i) for i, j in pro.act_fwd]
        grad = put(c["grad"], row[GRAD_STORE], ppermute(out["dx"], pro.setup.pipe_axis, act_bwd))
        stash_at = jnp.where(kind == FORWARD, row[STASH], pro.setup.program.stash_slots)
        new = {
            "act": pro.send_forward(c["act"], row, out["y"]),
            "grad": put(grad, row[LOSS_STORE], out["dy"]),
            "stash": put(c["stash"], stash_at, out["res"]),
            "gacc": out["gacc"],
            "dlp": jax.tree.map(jnp.add, c["dlp"], out["dlp"]),
            "loss": c["loss"] + out["loss"],
        }
        if self.input_grads:
            new["din"] = put(c["din"], row[IN_STORE], out["dx"])
            new["dt"] = put(c["dt"], row[OUT_STORE], out["dt"])
        return new, None


def run_training(
    setup: Setup,
    fn: Callable,
    loss_fn: Callable,
    has_aux: bool,
    input_grads: bool,
    grad_specs: tuple[Any, Any],
    frozen: bool,
    params: Any,
    loss_params: Any,
    inputs: Any,
    targets: Any,
) -> tuple:
    """``(loss, d params, d loss_params)`` and with input_grads ``(d inputs, d float targets)``.

    `fn` is stage_fn checkpointed per remat. The loss and every gradient are float32 sums over
    this device's microbatches, reduced over the mesh after the loop. `frozen`: params and
    loss_params are ``(trained, frozen)`` pairs, and the gradients the trained halves';
    `grad_specs`: the PartitionSpecs of the stage params' gradients and of loss_params'; a
    gradient is summed over the data axes (and for loss_params the pipeline axis) its leaf is
    not sharded over.
    """
    pro = prologue(setup, fn, has_aux, params, inputs, frozen)
    m, prog, everywhere = setup.m, setup.program, pro.everywhere
    ts = vary_over(microbatches(targets, m), everywhere) if targets is not None else None
    loss_params = vary_over(loss_params, everywhere)
    seed = 1.0 / (m * setup.shards)  # d(loss)/d(per-microbatch loss): a mean over all of them

    # Trace the stage and the loss once here for the types of their outputs, residuals and
    # gradients, and the stage's residual layout (XLA drops this unused computation).
    # Residuals computed from the params alone are recomputed by the backward, not stashed.
    derived, recompute = param_derived(pro.apply, pro.p0, pro.x0, vjp=pro.vjp)
    y0, aux0, res0, layout = _stage_forward(pro, pro.p0, pro.x0, derived)
    check_like(setup.op, y0, pro.x0)
    t0 = slot(ts, jnp.int32(0)) if ts is not None else None
    loss0, dlp0, dy0, dt0 = _loss_vjp(pro, loss_fn, seed, loss_params, y0, t0)
    vjp0 = join_residuals(layout, res0, pro.p0, recompute(pro.p0))
    dp0, dx0 = vjp0((dy0, _aux_cotangent(seed, aux0)))
    f32 = functools.partial(jax.tree.map, lambda a: a.astype(jnp.float32))
    types = {
        "y": y0,
        "res": res0,
        "dx": dx0,
        "dp": f32(dp0),
        "loss": loss0,
        "dy": dy0,
        "dlp": f32(dlp0),
        "dt": dt0,
    }
    # dp is never zero-filled: the backward branch adds it to the accumulator it is given.
    zeros = {
        k: jax.tree.map(lambda a: vary_like(jnp.zeros(a.shape, a.dtype), a), v)
        for k, v in types.items()
        if k != "dp"
    }
    tick = _TrainTick(
        pro,
        loss_fn,
        loss_params,
        ts,
        seed,
        layout,
        derived,
        recompute,
        aux0,
        types,
        zeros,
        input_grads,
    )
    x0 = pro.x0
    init = {
        "act": buffer(prog.act_slots + 1, x0),
        "grad": buffer(prog.grad_slots + 1, x0),
        # varying over the pipe axis: a residual the stage derives from constants alone (a
        # rotary table under remat) is written at the schedule's per-stage row, which varies.
        "stash": buffer(prog.stash_slots + 1, vary_over(res0, (setup.pipe_axis,))),
        "gacc": jax.tree.map(lambda a: jnp.zeros((setup.v, *a.shape), a.dtype), types["dp"]),
        "dlp": zeros["dlp"],
        "loss": zeros["loss"],
    }
    if input_grads:  # [M, ...]: these grow with the batch, like the inputs
        init["din"] = buffer(m + 1, x0)
        init["dt"] = buffer(m + 1, dt0)
    init["gacc"] = conform(init["gacc"], jax.tree.map(lambda a: a[None], types["dp"]))
    final, _ = jax.lax.scan(tick, init, pro.rows)

    def reduced(grads: Any, specs: Any, axes: tuple[str, ...]) -> Any:
        over = jax.tree.map(
            lambda spec: tuple(a for a in axes if a not in spec_axes(spec)),
            specs,
            is_leaf=lambda s: isinstance(s, P),
        )
        return jax.tree.map(lambda g, a: jax.lax.psum(g, a) if a else g, grads, over)

    param_specs, lp_specs = grad_specs
    loss = jax.lax.psum(final["loss"], everywhere)
    dparams = reduced(final["gacc"], param_specs, setup.data_axes)
    dlp = reduced(final["dlp"], lp_specs, everywhere)
    if not input_grads:
        return loss, dparams, dlp
    # Input gradients live on the device of stage 0, target gradients on that of the last stage.
    return (
        loss,
        dparams,
        dlp,
        pro.from_device(0, final["din"]),
        pro.from_device(setup.p - 1, final["dt"]),
    )
