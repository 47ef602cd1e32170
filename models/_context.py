"""The context axis: each sequence of a batch split over devices, in zigzag chunk pairs, and back.

With a ``context`` mesh axis of C devices every sequence of S tokens is cut into 2C chunks of
``S / 2C``; context device c holds chunks c and 2C - 1 - c (so that causal attention's work is
even: an early chunk with a late one) as one row of ``S / C`` tokens. A batch ``[B, S]``
becomes ``C B`` such rows, split over the batch axes with the context axis among them, and
everything but attention treats them as a batch (embedding, norms, the MoE layer, the loss):
the rows carry their tokens' global time steps, rotary positions and documents
(:class:`~jaxops.models._mask.Tokens`), which is all the masks read, and attention passes the
keys and values around the context ring (:func:`~jaxops.models._blockwise.ring_attention`).

:func:`to_rows` makes the rows of a validated batch (each device cutting its own chunks out of
the rows it holds: no collective), :func:`from_rows` puts per-token outputs (logits) back in
sequence order (an all-gather over the context axis).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxops._sharding import place

from . import _batch

__all__ = ["from_rows", "to_rows"]


def _pairs(c: int) -> np.ndarray:
    """``[C, 2]``: the chunks of each context device (c and 2C - 1 - c)."""
    return np.array([[i, 2 * c - 1 - i] for i in range(c)])


def to_rows(layout: Any, batch: _batch.Batch) -> _batch.Batch:
    """`batch` (``[B, S]`` split over ``layout.input_axes``) as ``C B`` rows of ``S / C``.

    Split over ``layout.batch_axes``; each row holds its context device's chunk pair, with the
    global time steps, positions and documents of its tokens (``attention_mask`` folded into
    the documents).
    """
    where = _batch.placement(batch)
    fields = {
        "tokens": batch.tokens,
        "targets": batch.targets,
        "positions": where.positions,
        "segment_ids": where.segments,
        "index": where.index,
        "mtp_tokens": batch.mtp_tokens,
        "mtp_targets": batch.mtp_targets,
    }
    fields = {k: v for k, v in fields.items() if v is not None}
    cut = _cutter(
        layout.mesh,
        layout.context,
        layout.context_axis,
        layout.input_axes,
        layout.batch_axes,
        tuple(sorted(fields)),
    )
    inputs = P(layout.input_axes)
    out = cut(place(fields, layout.mesh, jax.tree.map(lambda _: inputs, fields)))
    return _batch.Batch(
        out["tokens"],
        out.get("targets"),
        None,
        out["positions"],
        out.get("segment_ids"),
        out["index"],
        out.get("mtp_tokens"),
        out.get("mtp_targets"),
    )


def from_rows(layout: Any, x: jax.Array) -> jax.Array:
    """Per-token outputs of the rows (``[C B, S / C, ...]``) as ``[B, S, ...]``, in order.

    Split over ``layout.input_axes``: every context device gathers its rows' chunks.
    """
    join = _joiner(
        layout.mesh, layout.context, layout.context_axis, layout.input_axes, layout.batch_axes
    )
    return join(place(x, layout.mesh, P(layout.batch_axes)))


# The two shard_maps, jitted and built once per mesh and setting: called eagerly (a batch placed
# outside the step), an unjitted shard_map would run its body op by op, one small program per
# op, field and shape.
@functools.lru_cache(maxsize=64)
def _cutter(mesh, c: int, axis: str, input_axes, batch_axes, names: tuple[str, ...]):
    """Each device cuts its chunk pair out of the rows it holds: no collective."""
    chunks = _pairs(c)

    def cut(fields):
        mine = jnp.asarray(chunks)[jax.lax.axis_index(axis)]

        def one(a):  # [n, S, ...] -> [n, S / C, ...]: this device's two chunks
            n, s, *rest = a.shape
            a = a.reshape(n, 2 * c, s // (2 * c), *rest)[:, mine]
            return a.reshape(n, s // c, *rest)

        return jax.tree.map(one, fields)

    inputs, rows = P(input_axes), P(batch_axes)
    return jax.jit(
        jax.shard_map(
            cut,
            mesh=mesh,
            in_specs=({n: inputs for n in names},),
            out_specs={n: rows for n in names},
            check_vma=False,
        )
    )


@functools.lru_cache(maxsize=64)
def _joiner(mesh, c: int, axis: str, input_axes, batch_axes):
    """Every context device gathers its rows' chunks and puts them in sequence order."""
    order = np.argsort(_pairs(c).reshape(-1))  # chunk k's place among the gathered ones

    def join(a):  # [n, S / C, ...] -> [n, S, ...]
        n, half = a.shape[0], a.shape[1] // 2
        every = jax.lax.all_gather(a, axis)  # [C, n, S / C, ...]
        every = every.reshape(c, n, 2, half, *a.shape[2:])
        every = jnp.moveaxis(every, 1, 0).reshape(n, 2 * c, half, *a.shape[2:])
        return every[:, order].reshape(n, 2 * c * half, *a.shape[2:])

    return jax.jit(
        jax.shard_map(
            join, mesh=mesh, in_specs=(P(batch_axes),), out_specs=P(input_axes), check_vma=False
        )
    )
