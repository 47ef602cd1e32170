"""Pipeline parallelism inside one ``jax.jit``: GPipe, 1F1B and interleaved 1F1B schedules.

The model is a stack of ``L = num_stages * virtual_stages`` stages with one ``stage_fn`` and
stacked parameters. The stages are spread over the ``num_stages`` devices of a mesh axis; the
whole train step (every microbatch's forward, loss and backward) is one ``shard_map`` over the
mesh holding one ``lax.scan`` over the ticks of a static schedule::

    tick t on device d:   forward  F(m, v): x -> stage_fn(params[v], x)   (and the loss, last stage)
                          backward B(m, v): the stage's jax.vjp on dy     (param grads accumulated)
                          or idle
                          then one ppermute of activations to d + 1 and one of gradients to d - 1

Backward is not obtained by differentiating the loop: each ``F`` runs ``jax.vjp`` of its stage
and stashes what the backward needs in a slot of a fixed-size buffer, and the matching ``B``
reads the slot, applies the vjp and frees the slot. What is stashed is set by ``remat``:

- ``remat=False``: the vjp's residuals (no recomputation),
- ``remat=True``: only the stage input (``jax.checkpoint``: the backward recomputes the forward),
- a ``jax.checkpoint_policies`` policy: the residuals that policy saves.

Residuals that are the stage's parameters themselves are never stashed (the backward reads them
from the parameters). The number of slots is the largest number of microbatches a device holds
at once, which the schedule decides:

==============  ===============================  =====================================
schedule        order on each device             stashed microbatches per device
==============  ===============================  =====================================
"gpipe"         all forwards, then all backwards ``M * V`` (grows with M)
"1f1b"          warm-up ``P - d - 1`` forwards,  at most ``P`` (independent of M)
                then one forward / one backward
"interleaved"   Megatron-LM's interleaved 1F1B   at most ``2 (P - 1) + (V - 1) P + 1``
                over V chunks per device         microbatch-chunks (independent of M)
==============  ===============================  =====================================

With P devices, M microbatches and V virtual stages every schedule takes ``2 (V M + P - 1)``
ticks of one chunk's forward or backward, so its bubble (idle fraction, counting forward and
backward ticks alike) is ``(P - 1) / (V M + P - 1)``; :func:`schedule_table` returns the table and
:func:`plot_schedule` draws it. ``"gpipe"`` with ``virtual_stages > 1`` is the circular schedule
of MaxText and praxis.

Layout of ``stage_params``: every leaf is stacked on a leading axis of size ``L`` that is
sharded over the pipeline axis, so device d holds rows ``d V .. d V + V - 1``. Row ``d V + v``
is model stage ``v P + d`` (round robin, as interleaved and circular schedules need; for V = 1
that is the model order). :func:`interleave` and :func:`deinterleave` convert from and to the
model order.

The batch (``inputs``, ``targets``) is split over ``data_axes`` (by default every other mesh
axis) and each device's share into ``num_microbatches`` microbatches. Gradients of the stage
parameters and of ``loss_params`` accumulate locally over the microbatches and are all-reduced
over the data axes (where they are replicated) once, after the loop, as in plain data
parallelism. Other mesh axes may shard the stage parameters (``param_specs``) -- for example
the expert axis of :func:`jaxops.parallel.expert.moe_layer` stages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops import _checks
from jaxops._sharding import place, vary_like, varying_axes

__all__ = [
    "SCHEDULES",
    "PipelineGrads",
    "ScheduleTable",
    "deinterleave",
    "interleave",
    "pipeline_forward",
    "pipeline_step",
    "plot_schedule",
    "schedule_table",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved")

IDLE, FORWARD, BACKWARD = 0, 1, 2


# -------------------------------------------------------------------------------------------------
# Argument checks.


def _check_schedule(
    op: str, schedule: Any, num_stages: Any, num_microbatches: Any, virtual_stages: Any
) -> tuple[str, int, int, int]:
    if schedule not in SCHEDULES:
        raise ValueError(f"{op}: schedule must be one of {SCHEDULES}, got {schedule!r}")
    p = _checks.check_int(op, "num_stages", num_stages, 1)
    m = _checks.check_int(op, "num_microbatches", num_microbatches, 1)
    v = _checks.check_int(op, "virtual_stages", virtual_stages, 1)
    if schedule == "1f1b" and v != 1:
        raise ValueError(
            f"{op}: schedule='1f1b' runs one stage per device (virtual_stages=1), got "
            f"virtual_stages={v}; use schedule='interleaved' for {v} chunks per device"
        )
    if schedule == "interleaved" and v < 2:
        raise ValueError(
            f"{op}: schedule='interleaved' needs virtual_stages >= 2 chunks per device, got "
            f"{v}; use schedule='1f1b' for one"
        )
    if v > 1 and m % p:
        raise ValueError(
            f"{op}: with virtual_stages={v} the microbatches go round the {p} stages in groups "
            f"of {p}, so num_microbatches must be a multiple of {p}, got {m}"
        )
    return schedule, p, m, v


# -------------------------------------------------------------------------------------------------
# Schedules: each device's op order, then a tick-by-tick simulation.


def _device_orders(
    schedule: str, p: int, m: int, v: int, forward_only: bool = False
) -> list[list[tuple[int, int, int]]]:
    """Per device, its ops ``(kind, microbatch, chunk)`` in the order it runs them."""
    n = m * v

    def fwd(k: int) -> tuple[int, int, int]:
        group, r = divmod(k, p * v)
        return FORWARD, group * p + r % p, r // p

    def bwd(k: int) -> tuple[int, int, int]:
        group, r = divmod(k, p * v)
        return BACKWARD, group * p + r % p, v - 1 - r // p

    orders = []
    for d in range(p):
        if forward_only:
            ops = [fwd(k) for k in range(n)]
        elif schedule == "gpipe":
            ops = [fwd(k) for k in range(n)] + [bwd(k) for k in range(n)]
        else:
            warm = (p - d - 1) if v == 1 else 2 * (p - d - 1) + (v - 1) * p
            warm = min(warm, n)
            ops = [fwd(k) for k in range(warm)]
            for i in range(n - warm):
                ops += [fwd(warm + i), bwd(i)]
            ops += [bwd(k) for k in range(n - warm, n)]
        orders.append(ops)
    return orders


def _simulate(orders: list[list[tuple[int, int, int]]], p: int, v: int) -> np.ndarray:
    """``[T, P, 3]`` int32 (kind, microbatch, chunk) of the schedule.

    Every device runs its next op as soon as its input arrived (an activation or gradient sent
    at tick t can be used from tick t + 1).
    """
    last = p * v - 1
    done: dict[tuple[int, int, int], int] = {}
    pos = [0] * p
    rows = []
    while any(pos[d] < len(orders[d]) for d in range(p)):
        t = len(rows)
        row = []
        for d in range(p):
            if pos[d] == len(orders[d]):
                row.append((IDLE, 0, 0))
                continue
            kind, mb, chunk = orders[d][pos[d]]
            s = chunk * p + d
            if kind == FORWARD:
                dep = None if s == 0 else (FORWARD, mb, s - 1)
            else:
                dep = (FORWARD, mb, s) if s == last else (BACKWARD, mb, s + 1)
            ready = dep is None or done.get(dep, t) < t
            row.append((kind, mb, chunk) if ready else (IDLE, 0, 0))
        if all(r[0] == IDLE for r in row):  # the orders above never get here
            raise RuntimeError("pipeline schedule deadlocked")
        for d, (kind, mb, chunk) in enumerate(row):
            if kind != IDLE:
                done[(kind, mb, chunk * p + d)] = t
                pos[d] += 1
        rows.append(row)
    return np.asarray(rows, np.int32).reshape(len(rows), p, 3)


@dataclasses.dataclass(frozen=True, eq=False)
class ScheduleTable:
    """What every device does at every tick of a pipeline schedule.

    Attributes:
      schedule: "gpipe", "1f1b" or "interleaved" (or "forward" for :func:`pipeline_forward`).
      num_stages: P, the devices of the pipeline axis.
      num_microbatches: M.
      virtual_stages: V, model chunks per device.
      kind: ``[T, P]`` int32: 0 idle, 1 forward, 2 backward.
      microbatch: ``[T, P]`` int32, the microbatch of the op (0 when idle).
      chunk: ``[T, P]`` int32, the device's chunk v of the op (model stage ``v P + d``).
    """

    schedule: str
    num_stages: int
    num_microbatches: int
    virtual_stages: int
    kind: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray

    @property
    def num_ticks(self) -> int:
        """T, the length of the schedule in ticks of one chunk's forward or backward."""
        return int(self.kind.shape[0])

    @property
    def bubble_fraction(self) -> float:
        """Idle device-ticks over all device-ticks (forward and backward ticks counted alike)."""
        return float(np.mean(self.kind == IDLE)) if self.kind.size else 0.0

    @property
    def theoretical_bubble(self) -> float:
        """``(P - 1) / (V M + P - 1)``, the bubble of a schedule without stalls."""
        p, m, v = self.num_stages, self.num_microbatches, self.virtual_stages
        return (p - 1) / (v * m + p - 1)

    def in_flight(self) -> int:
        """The most microbatch-chunks any device holds between their forward and backward."""
        most = 0
        for d in range(self.num_stages):
            held = np.cumsum(
                (self.kind[:, d] == FORWARD).astype(int) - (self.kind[:, d] == BACKWARD)
            )
            most = max(most, int(held.max(initial=0)))
        return most

    def __str__(self) -> str:
        lines = [
            f"{self.schedule}: P={self.num_stages} M={self.num_microbatches} "
            f"V={self.virtual_stages}, {self.num_ticks} ticks, bubble "
            f"{self.bubble_fraction:.3f}"
        ]
        for d in range(self.num_stages):
            cells = []
            for t in range(self.num_ticks):
                k = self.kind[t, d]
                label = f"{'FB'[k - 1]}{self.microbatch[t, d]}" if k else "."
                if k and self.virtual_stages > 1:
                    label += f".{self.chunk[t, d]}"
                cells.append(label)
            width = max(len(c) for c in cells) if cells else 1
            lines.append(f"d{d}: " + " ".join(c.rjust(width) for c in cells))
        return "\n".join(lines)


@functools.lru_cache(maxsize=256)
def _table(schedule: str, p: int, m: int, v: int, forward_only: bool) -> ScheduleTable:
    ops = _simulate(_device_orders(schedule, p, m, v, forward_only), p, v)
    return ScheduleTable(
        schedule="forward" if forward_only else schedule,
        num_stages=p,
        num_microbatches=m,
        virtual_stages=v,
        kind=ops[..., 0],
        microbatch=ops[..., 1],
        chunk=ops[..., 2],
    )


def schedule_table(
    schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> ScheduleTable:
    """The tick-by-tick action table of a pipeline schedule.

    Every device runs its ops in the schedule's order, each as soon as its input has arrived
    (one tick after the neighbour computed it); one op takes one tick.

    Args:
      schedule: "gpipe", "1f1b" or "interleaved".
      num_stages: P, the devices on the pipeline axis.
      num_microbatches: M (a multiple of P when virtual_stages > 1).
      virtual_stages: V chunks per device (1 for "1f1b", >= 2 for "interleaved").

    Returns:
      A :class:`ScheduleTable` with ``2 (V M + P - 1)`` ticks and bubble fraction
      ``(P - 1) / (V M + P - 1)``.

    Raises:
      ValueError / TypeError: an unknown schedule or counts that do not fit it.

    Example:
      >>> from jaxops.parallel.pipeline import schedule_table
      >>> table = schedule_table("1f1b", num_stages=4, num_microbatches=8)
      >>> table.num_ticks, round(table.bubble_fraction, 3), table.in_flight()
      (22, 0.273, 4)
      >>> print(schedule_table("1f1b", 2, 3))
      1f1b: P=2 M=3 V=1, 8 ticks, bubble 0.250
      d0: F0 F1  . B0 F2 B1  . B2
      d1:  . F0 B0 F1 B1 F2 B2  .
    """
    args = _check_schedule(
        "jaxops.parallel.pipeline.schedule_table",
        schedule,
        num_stages,
        num_microbatches,
        virtual_stages,
    )
    return _table(*args, False)


def plot_schedule(
    table: ScheduleTable | str,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    virtual_stages: int = 1,
    *,
    path: Any = None,
):
    """Draws a schedule as a timeline: one row per device, forward / backward / idle per tick.

    Needs matplotlib (``pip install 'jaxops[examples]'``). The title carries the bubble fraction.

    Args:
      table: a :class:`ScheduleTable`, or a schedule name followed by the counts of
        :func:`schedule_table`.
      num_stages: with a schedule name, P.
      num_microbatches: with a schedule name, M.
      virtual_stages: with a schedule name, V.
      path: where to write the PNG (None: do not write).

    Returns:
      The matplotlib Figure.

    Example:
      >>> import tempfile, os
      >>> from jaxops.parallel.pipeline import plot_schedule
      >>> out = os.path.join(tempfile.mkdtemp(), "1f1b.png")
      >>> fig = plot_schedule("1f1b", 4, 8, path=out)
      >>> fig.axes[0].get_title()
      '1f1b: P=4 M=8 V=1 -- 22 ticks, bubble 27.3% (theory 27.3%)'
      >>> open(out, "rb").read(4) == bytes([0x89]) + b"PNG"
      True
    """
    if isinstance(table, str):
        if num_stages is None or num_microbatches is None:
            raise TypeError(
                "jaxops.parallel.pipeline.plot_schedule: with a schedule name, give num_stages "
                "and num_microbatches"
            )
        table = schedule_table(table, num_stages, num_microbatches, virtual_stages)
    if not isinstance(table, ScheduleTable):
        raise TypeError(
            "jaxops.parallel.pipeline.plot_schedule: table must be a ScheduleTable or a "
            f"schedule name, got {type(table).__name__}"
        )
    import matplotlib  # a Figure without pyplot: no backend switch, nothing shown
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    p, t = table.num_stages, table.num_ticks
    fig = Figure(figsize=(min(2 + 0.28 * t, 40), 1 + 0.45 * p), dpi=100)
    ax = fig.add_subplot()
    v = max(table.virtual_stages, 1)
    forward = matplotlib.colormaps["Blues"]
    backward = matplotlib.colormaps["Oranges"]
    for d in range(p):
        for tick in range(t):
            k = int(table.kind[tick, d])
            if k == IDLE:
                color = "#eeeeee"
            else:
                shade = 0.45 + 0.4 * int(table.chunk[tick, d]) / max(v - 1, 1)
                color = (forward if k == FORWARD else backward)(shade)
            ax.add_patch(Rectangle((tick, d), 1, 1, color=color, lw=0))
            if k != IDLE and t <= 80:
                ax.text(
                    tick + 0.5,
                    d + 0.5,
                    str(table.microbatch[tick, d]),
                    ha="center",
                    va="center",
                    fontsize=7,
                )
    ax.set_xlim(0, t)
    ax.set_ylim(p, 0)
    ax.set_yticks([d + 0.5 for d in range(p)], [f"device {d}" for d in range(p)])
    ax.set_xlabel("tick (one chunk's forward or backward)")
    ax.set_title(
        f"{table.schedule}: P={p} M={table.num_microbatches} V={table.virtual_stages} -- "
        f"{t} ticks, bubble {100 * table.bubble_fraction:.1f}% "
        f"(theory {100 * table.theoretical_bubble:.1f}%)"
    )
    ax.legend(
        handles=[
            Patch(color=forward(0.6), label="forward"),
            Patch(color=backward(0.6), label="backward"),
            Patch(color="#eeeeee", label="idle"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, format="png")
    return fig


# -------------------------------------------------------------------------------------------------
# From the table to per-tick buffer slots.

# Columns of the program: one int32 row per (tick, device).
_KIND, _MB, _CHUNK, _FIRST, _LAST = 0, 1, 2, 3, 4
_ACT_READ, _STASH, _GRAD_READ, _ACT_STORE, _GRAD_STORE, _LOSS_STORE = 5, 6, 7, 8, 9, 10
_IN_STORE, _OUT_STORE = 11, 12
_COLUMNS = 13


def _allocate(intervals: list[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Slots for values written at the end of tick w and read during tick r > w.

    A slot is free again for a value written at the end of tick r: greedy interval colouring.
    """
    slot_free_after: list[int] = []
    slots: dict[Any, int] = {}
    for w, r, key in sorted(intervals, key=lambda i: (i[0], i[1])):
        for i, free in enumerate(slot_free_after):
            if free <= w:
                slot_free_after[i] = r
                slots[key] = i
                break
        else:
            slots[key] = len(slot_free_after)
            slot_free_after.append(r)
    return slots, len(slot_free_after)


@dataclasses.dataclass(frozen=True, eq=False)
class _Program:
    table: ScheduleTable
    rows: np.ndarray  # [T, P, _COLUMNS] int32
    act_slots: int
    grad_slots: int
    stash_slots: int


@functools.lru_cache(maxsize=256)
def _program(schedule: str, p: int, m: int, v: int, forward_only: bool) -> _Program:
    table = _table(schedule, p, m, v, forward_only)
    last = p * v - 1
    when: dict[tuple[int, int, int], int] = {}
    for t in range(table.num_ticks):
        for d in range(p):
            k = int(table.kind[t, d])
            if k != IDLE:
                s = int(table.chunk[t, d]) * p + d
                when[(k, int(table.microbatch[t, d]), s)] = t
    acts: list[list] = [[] for _ in range(p)]
    grads: list[list] = [[] for _ in range(p)]
    stash: list[list] = [[] for _ in range(p)]
    for (k, mb, s), t in when.items():
        d = s % p
        if k == FORWARD and s < last:  # the activation goes to stage s + 1
            acts[(s + 1) % p].append((t, when[(FORWARD, mb, s + 1)], (mb, s + 1)))
        if k == FORWARD and not forward_only:
            stash[d].append((t, when[(BACKWARD, mb, s)], (mb, s)))
            if s == last:  # the loss gradient, kept on this device
                grads[d].append((t, when[(BACKWARD, mb, s)], (mb, s)))
        if k == BACKWARD and s > 0:  # the input gradient goes to stage s - 1
            grads[(s - 1) % p].append((t, when[(BACKWARD, mb, s - 1)], (mb, s - 1)))
    alloc = [[_allocate(x[d]) for d in range(p)] for x in (acts, grads, stash)]
    n_act, n_grad, n_stash = (max(n for _, n in a) for a in alloc)
    rows = np.zeros((table.num_ticks, p, _COLUMNS), np.int32)
    # Writes with nothing to write go to a dummy slot past the real ones.
    rows[..., _ACT_READ] = n_act
    rows[..., _ACT_STORE] = n_act
    rows[..., _GRAD_READ] = n_grad
    rows[..., _GRAD_STORE] = n_grad
    rows[..., _LOSS_STORE] = n_grad
    rows[..., _STASH] = n_stash
    rows[..., _IN_STORE] = m
    rows[..., _OUT_STORE] = m
    for (k, mb, s), t in when.items():
        d, chunk = s % p, s // p
        row = rows[t, d]
        row[_KIND], row[_MB], row[_CHUNK] = k, mb, chunk
        if k == FORWARD:
            row[_FIRST], row[_LAST] = s == 0, s == last
            if s > 0:
                row[_ACT_READ] = alloc[0][d][0][(mb, s)]
            if s < last:
                rows[t, (s + 1) % p, _ACT_STORE] = alloc[0][(s + 1) % p][0][(mb, s + 1)]
            if not forward_only:
                row[_STASH] = alloc[2][d][0][(mb, s)]
                if s == last:
                    row[_LOSS_STORE] = alloc[1][d][0][(mb, s)]
            if s == last:
                row[_OUT_STORE] = mb
        else:
            row[_STASH] = alloc[2][d][0][(mb, s)]
            row[_GRAD_READ] = alloc[1][d][0][(mb, s)]
            if s > 0:
                rows[t, (s - 1) % p, _GRAD_STORE] = alloc[1][(s - 1) % p][0][(mb, s - 1)]
            else:
                row[_IN_STORE] = mb
    return _Program(table, rows, n_act, n_grad, n_stash)


# -------------------------------------------------------------------------------------------------
# Parameter layout.


def interleave(stage_params: Any, *, num_stages: int, virtual_stages: int) -> Any:
    """Reorders params stacked in model order (stage 0 .. L-1) into the pipeline layout.

    Args:
      stage_params: pytree of arrays stacked on a leading axis of size
        ``L = num_stages * virtual_stages`` in model order.
      num_stages: P, devices on the pipeline axis.
      virtual_stages: V, chunks per device.

    Returns:
      The same pytree with row ``d V + v`` holding model stage ``v P + d``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops.parallel.pipeline import interleave, deinterleave
      >>> w = jnp.arange(8)
      >>> interleave(w, num_stages=4, virtual_stages=2)
      Array([0, 4, 1, 5, 2, 6, 3, 7], dtype=int32)
      >>> deinterleave(interleave(w, num_stages=4, virtual_stages=2), num_stages=4,
      ...              virtual_stages=2).tolist()
      [0, 1, 2, 3, 4, 5, 6, 7]
    """
    return jax.tree.map(lambda a: _regroup(a, (virtual_stages, num_stages)), stage_params)


def deinterleave(stage_params: Any, *, num_stages: int, virtual_stages: int) -> Any:
    """Inverse of :func:`interleave`: pipeline layout back to model order."""
    return jax.tree.map(lambda a: _regroup(a, (num_stages, virtual_stages)), stage_params)


def _regroup(a: Any, split: tuple[int, int]) -> Any:
    """``[A * B, ...] -> [B * A, ...]``: row ``i A + j`` moves to ``j B + i``."""
    if a.shape[0] != split[0] * split[1]:
        raise ValueError(
            f"jaxops.parallel.pipeline: the stacked stage axis must have size "
            f"num_stages * virtual_stages = {split[0] * split[1]}, got shape {tuple(a.shape)}"
        )
    if split[0] == 1 or split[1] == 1:
        return a
    sharding = getattr(jax.typeof(a), "sharding", None)
    if sharding is not None and any(sharding.spec):  # explicitly sharded: replicate first
        a = jax.reshard(a, NamedSharding(sharding.mesh, P()))
    b = a.reshape(*split, *a.shape[1:])
    return jnp.swapaxes(b, 0, 1).reshape(a.shape)


# -------------------------------------------------------------------------------------------------
# The step.


class PipelineGrads(NamedTuple):
    """Gradients of the pipelined loss.

    Attributes:
      stage_params: like ``stage_params`` (same layout, dtypes and sharding).
      loss_params: like ``loss_params`` (None when it was None).
      inputs: like ``inputs`` (None with ``input_grads=False``).
      targets: like ``targets``; integer leaves get ``float0`` zeros, as ``jax.grad`` gives them
        (None with ``input_grads=False`` or without targets).
    """

    stage_params: Any
    loss_params: Any
    inputs: Any
    targets: Any


@dataclasses.dataclass(frozen=True)
class _Setup:
    op: str
    axis: str
    data_axes: tuple[str, ...]
    p: int
    v: int
    m: int
    shards: int
    program: _Program
    param_specs: Any
    batch_spec: P


def _check_mesh_axes(op: str, mesh: Any, axis: Any, data_axes: Any) -> tuple[str, tuple]:
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(f"{op}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    if axis not in names:
        raise ValueError(f"{op}: axis {axis!r} is not an axis of the mesh; its axes are {names}")
    if data_axes is None:
        data_axes = tuple(a for a in names if a != axis)
    elif isinstance(data_axes, str):
        data_axes = (data_axes,)
    data_axes = tuple(data_axes)
    for a in data_axes:
        if a not in names or a == axis:
            raise ValueError(
                f"{op}: data_axes must name mesh axes other than the pipeline axis {axis!r}; "
                f"got {a!r} (mesh axes {names})"
            )
    return axis, data_axes


def _leading(op: str, name: str, tree: Any, size: int, what: str) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        raise ValueError(f"{op}: {name} has no arrays")
    for path, leaf in leaves:
        where = f"{name}{jax.tree_util.keystr(path)}"
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise TypeError(f"{op}: {where} must be an array, got {type(leaf).__name__}")
        if leaf.ndim == 0 or leaf.shape[0] != size:
            raise ValueError(
                f"{op}: every leaf of {name} must be stacked on a leading axis of size "
                f"{size} ({what}); {where} has shape {tuple(leaf.shape)}"
            )


def _setup(
    op: str,
    stage_params: Any,
    inputs: Any,
    targets: Any,
    *,
    mesh: Any,
    axis: str,
    data_axes: Any,
    num_microbatches: Any,
    schedule: str,
    virtual_stages: Any,
    param_specs: Any,
    forward_only: bool,
) -> _Setup:
    axis, data_axes = _check_mesh_axes(op, mesh, axis, data_axes)
    p = dict(mesh.shape)[axis]
    schedule, p, m, v = _check_schedule(op, schedule, p, num_microbatches, virtual_stages)
    _leading(
        op,
        "stage_params",
        stage_params,
        p * v,
        f"num_stages * virtual_stages = {p} * {v}: the size of mesh axis {axis!r} times "
        "the chunks per device",
    )
    shards = math.prod(dict(mesh.shape)[a] for a in data_axes)
    first = jax.tree.leaves(inputs)
    if not first:
        raise ValueError(f"{op}: inputs has no arrays")
    batch = first[0].shape[0] if first[0].ndim else 0
    what = (
        f"the batch, split over the {shards} devices of data_axes {data_axes} and into "
        f"num_microbatches = {m}, must be a multiple of {shards * m}"
    )
    if batch == 0 or batch % (shards * m):
        raise ValueError(f"{op}: {what}; inputs has batch {batch}")
    _leading(op, "inputs", inputs, batch, "the batch")
    if targets is not None:
        _leading(op, "targets", targets, batch, "the batch of inputs")
    if param_specs is None:
        param_specs = jax.tree.map(lambda _: P(axis), stage_params)
    else:
        try:
            param_specs = jax.tree.map(
                lambda s, _: P(axis, *s),
                param_specs,
                stage_params,
                is_leaf=lambda s: isinstance(s, P),
            )
        except ValueError as e:
            raise ValueError(
                f"{op}: param_specs must be a pytree like one stage's params with a "
                f"PartitionSpec per leaf: {e}"
            ) from None
        for spec in jax.tree.leaves(param_specs, is_leaf=lambda s: isinstance(s, P)):
            if axis in _spec_axes(P(*spec[1:])):
                raise ValueError(
                    f"{op}: param_specs shard a stage's params within the stage, over mesh axes "
                    f"other than the pipeline axis {axis!r}; got {P(*spec[1:])}"
                )
    return _Setup(
        op=op,
        axis=axis,
        data_axes=data_axes,
        p=p,
        v=v,
        m=m,
        shards=shards,
        program=_program(schedule, p, m, v, forward_only),
        param_specs=param_specs,
        batch_spec=P(data_axes or None),
    )


def _microbatches(tree: Any, m: int) -> Any:
    return jax.tree.map(lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:]), tree)


def _slot(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _put(tree: Any, i: jax.Array, value: Any) -> Any:
    return jax.tree.map(
        lambda a, x: jax.lax.dynamic_update_index_in_dim(a, x.astype(a.dtype), i, 0),
        tree,
        value,
    )


def _buffer(n: int, like: Any) -> Any:
    """``[n, *x.shape]`` zeros per leaf of `like`, varying like it."""
    return jax.tree.map(lambda x: vary_like(jnp.zeros((n, *x.shape), x.dtype), x), like)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _stage_vjp_fn(stage_fn: Callable, remat: Any) -> Callable:
    if remat is False or remat is None:
        return stage_fn
    if remat is True:
        return jax.checkpoint(stage_fn)
    if callable(remat):
        return jax.checkpoint(stage_fn, policy=remat)
    raise TypeError(
        "jaxops.parallel.pipeline: remat must be True, False or a jax.checkpoint_policies "
        f"policy, got {remat!r}"
    )


def _split_residuals(vjp_fn: Any, params: Any) -> tuple[list, Any, list[int | None]]:
    """Splits a vjp function into what a stage stashes and how to rebuild it.

    Returns the residual leaves that are not the params themselves (those get stashed), the
    treedef, and for each residual leaf the index of the param leaf it is (None: stashed).
    """
    leaves, treedef = jax.tree.flatten(vjp_fn)
    param_leaves = jax.tree.leaves(params)
    where: list[int | None] = []
    stashed = []
    for leaf in leaves:
        hit = next((i for i, q in enumerate(param_leaves) if leaf is q), None)
        where.append(hit)
        if hit is None:
            stashed.append(leaf)
    return stashed, treedef, where


def _join_residuals(treedef: Any, where: list[int | None], stashed: list, params: Any) -> Any:
    param_leaves = jax.tree.leaves(params)
    it = iter(stashed)
    leaves = [next(it) if i is None else param_leaves[i] for i in where]
    return jax.tree.unflatten(treedef, leaves)


def _spec_axes(spec: P) -> set[str]:
    return {a for e in spec for a in (e if isinstance(e, tuple) else (e,)) if a}


def _vary_over(tree: Any, axes: Sequence[str]) -> Any:
    """Each leaf marked varying over `axes` (those it does not vary over yet)."""

    def mark(a):
        missing = tuple(sorted(set(axes) - varying_axes(a)))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(mark, tree)


def _conform(tree: Any, like: Any) -> Any:
    """`tree` with the dtypes and varying axes of `like` (switch branches must agree)."""
    return jax.tree.map(lambda a, b: vary_like(a.astype(b.dtype), b), tree, like)


def _run(
    setup: _Setup,
    stage_fn: Callable,
    loss_fn: Callable | None,
    remat: Any,
    has_aux: bool,
    input_grads: bool,
    params: Any,
    loss_params: Any,
    inputs: Any,
    targets: Any,
):
    """The per-device body: one scan over the schedule's ticks."""
    p, v, m, axis = setup.p, setup.v, setup.m, setup.axis
    prog = setup.program
    forward_only = loss_fn is None
    me = jax.lax.axis_index(axis)
    rows = jnp.asarray(prog.rows)[:, me]  # [T, _COLUMNS]
    everywhere = (axis, *setup.data_axes)
    # Everything a tick computes varies over the pipeline axis and the batch axes: no collective
    # hides in a branch only some devices take. Gradients of values replicated over the batch
    # axes are reduced once, after the loop (one all-reduce per step, as data parallelism does).
    xs = _vary_over(_microbatches(inputs, m), everywhere)
    ts = _vary_over(_microbatches(targets, m), everywhere) if targets is not None else None
    reduce_axes = jax.tree.map(
        lambda spec: tuple(a for a in setup.data_axes if a not in _spec_axes(spec)),
        setup.param_specs,
        is_leaf=lambda s: isinstance(s, P),
    )
    params = _vary_over(params, everywhere)
    loss_params = _vary_over(loss_params, everywhere)
    x0 = _slot(xs, jnp.int32(0))
    p0 = _slot(params, jnp.int32(0))
    fn = _stage_vjp_fn(stage_fn, remat)
    seed = 1.0 / (m * setup.shards)  # d(loss)/d(per-microbatch loss): a mean over all of them

    def apply(p_v, x):
        out = fn(p_v, x)
        if not has_aux:
            return out, vary_like(jnp.zeros((), jnp.float32), x0)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"{setup.op}: with has_aux=True stage_fn must return (x, aux_loss)")
        if jnp.shape(out[1]) != ():
            raise ValueError(
                f"{setup.op}: stage_fn's aux_loss must be a scalar, got shape {jnp.shape(out[1])}"
            )
        return out[0], vary_like(out[1].astype(jnp.float32), x0)

    # Trace the stage once here for the types of its output, residuals and gradients (XLA drops
    # this unused computation).
    (y0, aux0), vjp0 = jax.vjp(apply, p0, x0)
    _check_like(setup.op, y0, x0)
    res0, treedef0, where0 = _split_residuals(vjp0, p0)
    layout = {"treedef": treedef0, "where": where0}
    act_fwd = [(i, i + 1) for i in range(p - 1)] + ([(p - 1, 0)] if v > 1 else [])
    act_bwd = [(j, i) for i, j in act_fwd]

    if forward_only:

        def tick_forward(c, row):
            x_in = jax.tree.map(
                lambda a, b: jnp.where(row[_FIRST] == 1, a, b),
                _slot(xs, row[_MB]),
                _slot(c["act"], row[_ACT_READ]),
            )
            y = jax.lax.cond(
                row[_KIND] == FORWARD,
                lambda p_v, x: _conform(apply(p_v, x)[0], x0),
                lambda p_v, x: x,
                _slot(params, row[_CHUNK]),
                x_in,
            )
            act = _put(c["act"], row[_ACT_STORE], _ppermute(y, axis, act_fwd))
            return {"act": act, "out": _put(c["out"], row[_OUT_STORE], y)}, None

        init = {"act": _buffer(prog.act_slots + 1, x0), "out": _buffer(m + 1, x0)}
        final, _ = jax.lax.scan(tick_forward, init, rows)
        # Only the device of the last stage wrote real outputs.
        outs = jax.tree.map(lambda a: jnp.where(me == p - 1, a[:m], 0), final["out"])
        outs = jax.lax.psum(outs, axis)
        return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), outs)

    def loss_vjp(lp, y, t):
        def f(lp, y, tf):
            return loss_fn(lp, y, _merge_floats(t, tf))

        loss, vjp_fn = jax.vjp(f, lp, y, _float_leaves(t))
        if jnp.shape(loss) != ():
            raise ValueError(
                f"{setup.op}: loss_fn must return a scalar, got shape {jnp.shape(loss)}"
            )
        dlp, dy, dt = vjp_fn(vary_like(jnp.asarray(seed, loss.dtype), loss))
        return vary_like(loss.astype(jnp.float32), x0), dlp, dy, dt

    t0 = _slot(ts, jnp.int32(0)) if ts is not None else None
    loss0, dlp0, dy0, dt0 = loss_vjp(loss_params, y0, t0)
    dp0, dx0 = vjp0((dy0, vary_like(jnp.asarray(seed, jnp.float32), aux0)))
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
    zeros = jax.tree.map(lambda a: vary_like(jnp.zeros(a.shape, a.dtype), a), types)

    def idle(p_v, x, dy, res, t):
        return zeros

    def forward(p_v, x):
        (y, aux), vjp_fn = jax.vjp(apply, p_v, x)
        res, layout["treedef"], layout["where"] = _split_residuals(vjp_fn, p_v)
        return y, aux, res

    def fwd(p_v, x, dy, res, t):
        y, aux, res = forward(p_v, x)
        return _conform({**zeros, "y": y, "res": res, "loss": aux * seed}, types)

    def fwd_last(p_v, x, dy, res, t):
        _, aux, res = forward(p_v, x)
        loss, dlp, dy, dt = loss_vjp(loss_params, _, t)
        out = {**zeros, "res": res, "loss": (loss + aux) * seed, "dy": dy, "dlp": dlp, "dt": dt}
        return _conform(out, types)

    def bwd(p_v, x, dy, res, t):
        vjp_fn = _join_residuals(layout["treedef"], layout["where"], res, p_v)
        dp, dx = vjp_fn((dy, vary_like(jnp.asarray(seed, jnp.float32), aux0)))
        return _conform({**zeros, "dx": dx, "dp": dp}, types)

    def tick(c, row):
        kind, mb, chunk = row[_KIND], row[_MB], row[_CHUNK]
        x_in = jax.tree.map(
            lambda a, b: jnp.where(row[_FIRST] == 1, a, b),
            _slot(xs, mb),
            _slot(c["act"], row[_ACT_READ]),
        )
        branch = jnp.where(kind == BACKWARD, 3, jnp.where(row[_LAST] == 1, 2, kind))
        out = jax.lax.switch(
            branch,
            [idle, fwd, fwd_last, bwd],
            _slot(params, chunk),
            x_in,
            _slot(c["grad"], row[_GRAD_READ]),
            _slot(c["stash"], row[_STASH]),
            _slot(ts, mb) if ts is not None else None,
        )
        grad = _put(c["grad"], row[_GRAD_STORE], _ppermute(out["dx"], axis, act_bwd))
        stash_at = jnp.where(kind == FORWARD, row[_STASH], prog.stash_slots)
        new = {
            "act": _put(c["act"], row[_ACT_STORE], _ppermute(out["y"], axis, act_fwd)),
            "grad": _put(grad, row[_LOSS_STORE], out["dy"]),
            "stash": _put(c["stash"], stash_at, out["res"]),
            "gacc": jax.tree.map(
                lambda acc, g: jax.lax.dynamic_update_index_in_dim(
                    acc, jax.lax.dynamic_index_in_dim(acc, chunk, keepdims=False) + g, chunk, 0
                ),
                c["gacc"],
                out["dp"],
            ),
            "dlp": jax.tree.map(jnp.add, c["dlp"], out["dlp"]),
            "loss": c["loss"] + out["loss"],
        }
        if input_grads:
            new["din"] = _put(c["din"], row[_IN_STORE], out["dx"])
            new["dt"] = _put(c["dt"], row[_OUT_STORE], out["dt"])
        return new, None

    init = {
        "act": _buffer(prog.act_slots + 1, x0),
        "grad": _buffer(prog.grad_slots + 1, x0),
        "stash": _buffer(prog.stash_slots + 1, res0),
        "gacc": jax.tree.map(lambda a: jnp.zeros((v, *a.shape), a.dtype), types["dp"]),
        "dlp": zeros["dlp"],
        "loss": zeros["loss"],
    }
    if input_grads:  # [M, ...]: these grow with the batch, like the inputs
        init["din"] = _buffer(m + 1, x0)
        init["dt"] = _buffer(m + 1, dt0)
    init["gacc"] = _conform(init["gacc"], jax.tree.map(lambda a: a[None], types["dp"]))
    final, _ = jax.lax.scan(tick, init, rows)

    loss = jax.lax.psum(final["loss"], everywhere)
    dparams = jax.tree.map(
        lambda g, axes: jax.lax.psum(g, axes) if axes else g, final["gacc"], reduce_axes
    )
    dlp = jax.lax.psum(final["dlp"], everywhere)
    # Input gradients live on the device of stage 0, target gradients on that of the last stage.
    if not input_grads:
        return loss, dparams, dlp
    din = jax.tree.map(lambda a: jnp.where(me == 0, a[:m], 0), final["din"])
    din = jax.lax.psum(din, axis)
    dt = jax.tree.map(lambda a: jnp.where(me == p - 1, a[:m], 0), final["dt"])
    dt = jax.lax.psum(dt, axis)
    unbatch = functools.partial(jax.tree.map, lambda a: a.reshape(-1, *a.shape[2:]))
    return loss, dparams, dlp, unbatch(din), unbatch(dt)


def _ppermute(tree: Any, axis: str, perm: list[tuple[int, int]]) -> Any:
    if not perm:
        return jax.tree.map(jnp.zeros_like, tree)
    return jax.tree.map(lambda a: jax.lax.ppermute(a, axis, perm), tree)


def _float_leaves(tree: Any) -> list:
    return [a for a in jax.tree.leaves(tree) if _is_float(a)] if tree is not None else []


def _merge_floats(tree: Any, floats: list) -> Any:
    if tree is None:
        return None
    leaves, treedef = jax.tree.flatten(tree)
    it = iter(floats)
    return jax.tree.unflatten(treedef, [next(it) if _is_float(a) else a for a in leaves])


def _float0_like(tree: Any, floats: list) -> Any:
    """`floats` (grads of the float leaves) merged into `tree`'s structure, float0 elsewhere."""
    leaves, treedef = jax.tree.flatten(tree)
    it = iter(floats)
    out = [next(it) if _is_float(a) else np.zeros(a.shape, jax.dtypes.float0) for a in leaves]
    return jax.tree.unflatten(treedef, out)


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
    axis: str = "pipe",
    data_axes: str | Sequence[str] | None = None,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    remat: bool | Callable = False,
    has_aux: bool = False,
    param_specs: Any = None,
    input_grads: bool = True,
) -> tuple[jax.Array, PipelineGrads]:
    """Loss and gradients of a pipelined model, in one ``shard_map`` (call it under ``jax.jit``).

    The model is ``loss_fn(loss_params, stage_{L-1}(... stage_0(inputs)), targets)`` with
    ``stage_s(x) = stage_fn(params of stage s, x)``; the loss is averaged over the
    microbatches and the data shards, which equals the full-batch loss when ``loss_fn`` averages
    over its batch. See the module docstring for the schedules and the parameter layout.

    Args:
      stage_fn: ``(params of one stage, x) -> x`` (or ``-> (x, aux_loss)`` with has_aux), the
        output like the input (same pytree, shapes and dtypes). It runs on one device's
        microbatch, inside ``shard_map``: collectives over the non-pipeline mesh axes are
        allowed (an expert-parallel MoE layer, tensor parallelism).
      stage_params: pytree, every leaf stacked on a leading axis of ``L = P * virtual_stages``
        stages (P the size of `axis`) in the round-robin layout of :func:`interleave`.
      inputs: pytree of ``[B, ...]`` arrays, the input of stage 0; B a multiple of
        ``num_microbatches`` times the devices of `data_axes`.
      loss_fn: ``(loss_params, outputs, targets) -> scalar`` on one microbatch; runs on the
        device of the last stage.
      mesh: the mesh holding `axis` (and `data_axes`).
      num_microbatches: M, microbatches per data shard (a multiple of P when V > 1).
      targets: pytree of ``[B, ...]`` arrays split like inputs and passed to loss_fn, or None.
      loss_params: pytree passed whole to loss_fn (an output head, say), or None.
      axis: the pipeline mesh axis.
      data_axes: mesh axes the batch is split over (default: every axis but `axis`).
      schedule: "gpipe", "1f1b" or "interleaved".
      virtual_stages: V, chunks per device (1 for "1f1b", >= 2 for "interleaved").
      remat: what a stage keeps for its backward: False its vjp residuals, True only its input
        (the backward recomputes the forward), or a ``jax.checkpoint_policies`` policy.
      has_aux: stage_fn returns ``(x, aux_loss)``; the scalar aux losses of all stages are added
        to the loss (averaged over microbatches like it), e.g. MoE load-balancing losses.
      param_specs: pytree like one stage's params of PartitionSpecs for the dims after the
        stage axis, over mesh axes other than `axis` (default: replicated). A leaf sharded over
        a data axis is a different parameter on each device of it (the experts of an
        expert-parallel layer, whose tokens are split over that axis too): its gradient is not
        reduced over that axis; the gradients of leaves replicated over a data axis are.
      input_grads: also return the gradients of inputs and targets. They are as large as the
        batch (buffers that grow with M); without them the step's memory does not.

    Returns:
      ``(loss, grads)``: the float32 loss and a :class:`PipelineGrads` (``grads.stage_params``
      in the layout and sharding of stage_params).

    Raises:
      TypeError / ValueError: an unknown schedule, M or V that do not fit it, a mesh without
        the axes, params not stacked on ``P * V`` stages, a batch not divisible by
        ``M * data shards``, stage_fn changing its input's shape, loss_fn not scalar.

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
        raise TypeError(f"{op}: stage_fn and loss_fn must be callables")
    setup = _setup(
        op,
        stage_params,
        inputs,
        targets,
        mesh=mesh,
        axis=axis,
        data_axes=data_axes,
        num_microbatches=num_microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        param_specs=param_specs,
        forward_only=False,
    )
    _stage_vjp_fn(stage_fn, remat)  # validates remat
    batch = setup.batch_spec
    in_specs = (
        setup.param_specs,
        jax.tree.map(lambda _: P(), loss_params),
        jax.tree.map(lambda _: batch, inputs),
        jax.tree.map(lambda _: batch, targets),
    )
    dt_specs = [batch for _ in _float_leaves(targets)]
    out_specs = (P(), setup.param_specs, in_specs[1], in_specs[2], dt_specs)
    args = place((stage_params, loss_params, inputs, targets), mesh, in_specs)
    input_grads = _checks.check_bool(op, "input_grads", input_grads)
    body = functools.partial(_run, setup, stage_fn, loss_fn, remat, has_aux, input_grads)
    if not input_grads:
        out_specs = out_specs[:3]
    results = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True
    )(*args)
    cast = functools.partial(jax.tree.map, lambda g, a: g.astype(a.dtype))
    loss, dparams, dlp = results[0], cast(results[1], stage_params), cast(results[2], loss_params)
    if not input_grads:
        return loss, PipelineGrads(dparams, dlp, None, None)
    din, dt = cast(results[3], inputs), results[4]
    dt = [g.astype(a.dtype) for g, a in zip(dt, _float_leaves(targets), strict=True)]
    dtargets = _float0_like(targets, dt) if targets is not None else None
    return loss, PipelineGrads(dparams, dlp, din, dtargets)


def pipeline_forward(
    stage_fn: Callable[[Any, Any], Any],
    stage_params: Any,
    inputs: Any,
    *,
    mesh: jax.sharding.Mesh,
    num_microbatches: int,
    axis: str = "pipe",
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
      axis: as in :func:`pipeline_step`.
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
        raise TypeError(f"{op}: stage_fn must be callable")
    schedule = (
        "interleaved" if _checks.check_int(op, "virtual_stages", virtual_stages, 1) > 1 else "gpipe"
    )
    setup = _setup(
        op,
        stage_params,
        inputs,
        None,
        mesh=mesh,
        axis=axis,
        data_axes=data_axes,
        num_microbatches=num_microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        param_specs=param_specs,
        forward_only=True,
    )
    in_specs = (setup.param_specs, jax.tree.map(lambda _: setup.batch_spec, inputs))
    args = place((stage_params, inputs), mesh, in_specs)

    def body(params, inputs):
        return _run(setup, stage_fn, None, False, has_aux, False, params, None, inputs, None)

    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=in_specs[1], check_vma=True)(
        *args
    )


def _check_like(op: str, y: Any, x: Any) -> None:
    """stage_fn's output must be like its input: every stage feeds the next."""
    want = jax.tree.structure(x), [(a.shape, np.dtype(a.dtype)) for a in jax.tree.leaves(x)]
    got = jax.tree.structure(y), [(a.shape, np.dtype(a.dtype)) for a in jax.tree.leaves(y)]
    if got != want:
        raise ValueError(
            f"{op}: stage_fn must return its input's structure, shapes and dtypes (each stage "
            f"feeds the next): for a microbatch {want[1]} it returned {got[1]}"
        )
