"""The per-tick program of a schedule: what each device reads and writes at every tick.

A :class:`~jaxops.parallel.pipeline._schedule.ScheduleTable` says which op a device runs; the
program adds where its input comes from and where its outputs go: slots of fixed-size buffers
for the activations and gradients in transit and for the stashed residuals, allocated by greedy
interval colouring so a buffer holds no more values than are alive at once. One int32 row of
``COLUMNS`` entries per (tick, device); the columns are named below.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from ._schedule import BACKWARD, FORWARD, IDLE, ScheduleTable, cached_table

__all__ = ["COLUMNS", "Program", "allocate", "build_program"]

# Columns of the program: one int32 row per (tick, device).
KIND, MB, CHUNK = 0, 1, 2  # the op: its kind, microbatch and the device's chunk
FIRST, LAST = 3, 4  # 1 when the op is a forward of the first / last model stage
ACT_READ, STASH, GRAD_READ = 5, 6, 7  # slots the op reads (STASH: a forward writes it)
ACT_STORE, GRAD_STORE, LOSS_STORE = 8, 9, 10  # slots the arriving activation / gradient and
# the loss gradient of the last stage are written to at the end of the tick
IN_STORE, OUT_STORE = 11, 12  # microbatch row of the input gradient / the last stage's output
COLUMNS = 13


def allocate(intervals: list[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Slots for values written at the end of tick w and read during tick r > w.

    A slot is free again for a value written at the end of tick r: greedy interval colouring.

    Args:
      intervals: ``(w, r, key)`` per value.

    Returns:
      ``({key: slot}, number of slots)``.
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
class Program:
    """The per-tick program of a schedule.

    Attributes:
      table: the schedule.
      rows: ``[T, P, COLUMNS]`` int32. A write with nothing to write goes to the dummy slot
        past the real ones (index act_slots, grad_slots, stash_slots, or M for the
        microbatch-indexed IN_STORE / OUT_STORE).
      act_slots: activation slots per device.
      grad_slots: gradient slots per device (incoming input gradients and loss gradients).
      stash_slots: stash slots per device (0 without backward).
    """

    table: ScheduleTable
    rows: np.ndarray
    act_slots: int
    grad_slots: int
    stash_slots: int


def _when(table: ScheduleTable) -> dict[tuple[int, int, int], int]:
    """``{(kind, microbatch, model stage): tick}`` of every op of the table."""
    p = table.num_stages
    when: dict[tuple[int, int, int], int] = {}
    for t in range(table.num_ticks):
        for d in range(p):
            k = int(table.kind[t, d])
            if k != IDLE:
                s = int(table.chunk[t, d]) * p + d
                when[(k, int(table.microbatch[t, d]), s)] = t
    return when


@functools.lru_cache(maxsize=256)
def build_program(schedule: str, p: int, m: int, v: int, forward_only: bool) -> Program:
    """The :class:`Program` of checked counts (see :func:`~._schedule.cached_table`)."""
    table = cached_table(schedule, p, m, v, forward_only)
    last = p * v - 1
    when = _when(table)
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
    alloc = [[allocate(x[d]) for d in range(p)] for x in (acts, grads, stash)]
    n_act, n_grad, n_stash = (max(n for _, n in a) for a in alloc)
    rows = np.zeros((table.num_ticks, p, COLUMNS), np.int32)
    # Writes with nothing to write go to a dummy slot past the real ones.
    rows[..., ACT_READ] = n_act
    rows[..., ACT_STORE] = n_act
    rows[..., GRAD_READ] = n_grad
    rows[..., GRAD_STORE] = n_grad
    rows[..., LOSS_STORE] = n_grad
    rows[..., STASH] = n_stash
    rows[..., IN_STORE] = m
    rows[..., OUT_STORE] = m
    for (k, mb, s), t in when.items():
        d, chunk = s % p, s // p
        row = rows[t, d]
        row[KIND], row[MB], row[CHUNK] = k, mb, chunk
        if k == FORWARD:
            row[FIRST], row[LAST] = s == 0, s == last
            if s > 0:
                row[ACT_READ] = alloc[0][d][0][(mb, s)]
            if s < last:
                rows[t, (s + 1) % p, ACT_STORE] = alloc[0][(s + 1) % p][0][(mb, s + 1)]
            if not forward_only:
                row[STASH] = alloc[2][d][0][(mb, s)]
                if s == last:
                    row[LOSS_STORE] = alloc[1][d][0][(mb, s)]
            if s == last:
                row[OUT_STORE] = mb
        else:
            row[STASH] = alloc[2][d][0][(mb, s)]
            row[GRAD_READ] = alloc[1][d][0][(mb, s)]
            if s > 0:
                rows[t, (s - 1) % p, GRAD_STORE] = alloc[1][(s - 1) % p][0][(mb, s - 1)]
            else:
                row[IN_STORE] = mb
    return Program(table, rows, n_act, n_grad, n_stash)
