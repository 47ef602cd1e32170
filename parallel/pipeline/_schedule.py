"""Pipeline schedules: argument checks, each device's op order, and the tick-by-tick table.

A schedule is first a list of ops ``(kind, microbatch, chunk)`` per device in the order the
device runs them (:func:`device_orders`), then a simulation that runs every op as soon as its
input has arrived (:func:`simulate`). :class:`ScheduleTable` holds the result;
:func:`schedule_table` is the public entry point.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from jaxops import _checks
from jaxops._errors import InvalidArgumentError

__all__ = [
    "BACKWARD",
    "FORWARD",
    "IDLE",
    "SCHEDULES",
    "ScheduleTable",
    "cached_table",
    "check_schedule",
    "device_orders",
    "schedule_table",
    "simulate",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved")

# The kinds of op a device runs at a tick.
IDLE, FORWARD, BACKWARD = 0, 1, 2


def check_schedule(
    op: str, schedule: Any, num_stages: Any, num_microbatches: Any, virtual_stages: Any
) -> tuple[str, int, int, int]:
    """``(schedule, P, M, V)`` checked against each other.

    Raises:
      ValueError / TypeError (messages start with `op`): an unknown schedule, counts that are
        not ints >= 1, V that the schedule does not run, M not a multiple of P when V > 1.
    """
    if schedule not in SCHEDULES:
        raise InvalidArgumentError(f"{op}: schedule must be one of {SCHEDULES}, got {schedule!r}")
    p = _checks.check_int(op, "num_stages", num_stages, 1)
    m = _checks.check_int(op, "num_microbatches", num_microbatches, 1)
    v = _checks.check_int(op, "virtual_stages", virtual_stages, 1)
    if schedule == "1f1b" and v != 1:
        raise InvalidArgumentError(
            f"{op}: schedule='1f1b' runs one stage per device (virtual_stages=1), got "
            f"virtual_stages={v}; use schedule='interleaved' for {v} chunks per device"
        )
    if schedule == "interleaved" and v < 2:
        raise InvalidArgumentError(
            f"{op}: schedule='interleaved' needs virtual_stages >= 2 chunks per device, got "
            f"{v}; use schedule='1f1b' for one"
        )
    if v > 1 and m % p:
        raise InvalidArgumentError(
            f"{op}: with virtual_stages={v} the microbatches go round the {p} stages in groups "
            f"of {p}, so num_microbatches must be a multiple of {p}, got {m}"
        )
    return schedule, p, m, v


def device_orders(
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


def simulate(orders: list[list[tuple[int, int, int]]], p: int, v: int) -> np.ndarray:
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
            raise RuntimeError(
                f"jaxops.parallel.pipeline.schedule_table: the schedule deadlocked at tick {t} "
                "(a bug in jaxops)"
            )
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
      schedule: "gpipe", "1f1b" or "interleaved" (or "forward" for
        :func:`~jaxops.parallel.pipeline.pipeline_forward`).
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
def cached_table(schedule: str, p: int, m: int, v: int, forward_only: bool) -> ScheduleTable:
    """The :class:`ScheduleTable` of checked counts, cached.

    With forward_only the devices run their forwards in order and no backward; the table's
    schedule then reads "forward".
    """
    ops = simulate(device_orders(schedule, p, m, v, forward_only), p, v)
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
    args = check_schedule(
        "jaxops.parallel.pipeline.schedule_table",
        schedule,
        num_stages,
        num_microbatches,
        virtual_stages,
    )
    return cached_table(*args, False)
