"""Gradients reduced over the batch axes as flat buffers, inside a ``shard_map``.

XLA:CPU runs a collective of a tuple as one rendezvous per operand, and jax's partitioner makes
one collective per gradient; here each group of leaves that are reduced over the same mesh axes
with the same dtype is concatenated into one buffer, reduced by one collective, and split back.
Two reductions, both of a device's local blocks (the functions run in a ``shard_map`` over the
batch axes):

- :func:`sum_flat`: each gradient summed over the batch axes its parameter is replicated on.
- :func:`scatter_flat`: the same sums, each device keeping only its ZeRO shard of each gradient
  (``psum_scatter``: half an all-reduce's traffic, and no full reduced copy).

The parameters are not gathered so: one all-gather of a flat buffer must then copy each
parameter out of it (one copy of all of them per device), which cost more than the per-leaf
all-gathers' rendezvous it saved (about 4% of a step on 8 simulated CPU devices).

A ZeRO shard (:meth:`~jaxops.models._layout.Layout.zero_specs`) splits some dimensions of a
device's block further over the batch axes the block is replicated on, each dimension over its
new axes in the batch axes' order. :class:`_Blocks` reorders a block so that the ZeRO shards are
rows, in the order of the device index over those axes (``jax.lax.axis_index`` of the tuple);
the rows of all leaves of a group, side by side, are the flat buffer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops._sharding import axes_of, padded_spec

__all__ = ["scatter_flat", "sum_flat"]


class _Blocks:
    """How one device's block of a leaf splits into its ZeRO shards.

    Attributes:
      axes: the batch axes the ZeRO spec adds (the shards' axes), in the batch axes' order.
      rows: the number of shards (the product of those axes' sizes).
      shard: the local shape of one ZeRO shard.
      expanded: the block's shape with each split dimension ``n`` as ``[k_1, ..., n / prod(k)]``.
      perm: the transpose of ``expanded`` that puts the ``k`` s first, in `axes`' order.
    """

    def __init__(self, mesh: Any, block: tuple[int, ...], spec: P, zero: P, batch: tuple[str, ...]):
        sizes = dict(mesh.shape)
        have = padded_spec(NamedSharding(mesh, spec), len(block))
        want = padded_spec(NamedSharding(mesh, zero), len(block))
        expanded: list[int] = []
        where: dict[str, int] = {}  # axis -> its position in `expanded`
        rest: list[int] = []
        shard: list[int] = []
        for n, old, new in zip(block, have, want, strict=True):
            added = [a for a in axes_of([new]) if a not in axes_of([old])]
            for a in added:
                where[a] = len(expanded)
                expanded.append(sizes[a])
                n //= sizes[a]
            rest.append(len(expanded))
            expanded.append(n)
            shard.append(n)
        self.axes = tuple(a for a in batch if a in where)
        self.rows = int(np.prod([sizes[a] for a in self.axes]))
        self.shard = tuple(shard)
        self.expanded = tuple(expanded)
        self.perm = tuple(where[a] for a in self.axes) + tuple(rest)

    def to_rows(self, x: jax.Array) -> jax.Array:
        """A block as ``[rows, shard size]``, row ``r`` the shard of device ``r``."""
        return jnp.transpose(x.reshape(self.expanded), self.perm).reshape(self.rows, -1)


def _reduced_over(spec: P, batch: tuple[str, ...], sizes: dict[str, int]) -> tuple[str, ...]:
    """The batch axes (size > 1) a leaf of `spec` is replicated on."""
    return tuple(a for a in batch if a not in axes_of(spec) and sizes[a] > 1)


def _spec_leaves(specs: Any) -> list[P]:
    return jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))


def sum_flat(grads: Any, specs: Any, mesh: Any, batch: tuple[str, ...]) -> Any:
    """`grads` summed over the `batch` axes each leaf's spec leaves out.

    `grads` are this device's blocks, laid out by `specs`: one all-reduce per group of leaves
    with the same axes and dtype.
    """
    sizes = dict(mesh.shape)
    leaves, tree = jax.tree.flatten(grads)
    groups: dict[tuple[tuple[str, ...], Any], list[int]] = {}
    for i, (g, spec) in enumerate(zip(leaves, _spec_leaves(specs), strict=True)):
        over = _reduced_over(spec, batch, sizes)
        if over:
            groups.setdefault((over, g.dtype), []).append(i)
    out = list(leaves)
    for (over, _), index in groups.items():
        flat = jax.lax.psum(jnp.concatenate([leaves[i].reshape(-1) for i in index]), over)
        start = 0
        for i in index:
            out[i] = flat[start : start + leaves[i].size].reshape(leaves[i].shape)
            start += leaves[i].size
    return jax.tree.unflatten(tree, out)


def scatter_flat(grads: Any, specs: Any, zero: Any, mesh: Any, batch: tuple[str, ...]) -> Any:
    """`grads` summed like :func:`sum_flat`, each device keeping its ZeRO shard (`zero` specs).

    A group (same reduced axes, shard axes and dtype) is one ``psum_scatter`` over the shard
    axes, then a ``psum`` of the kept shard over the reduced axes no dimension could be split
    over (if any). Leaves the ZeRO spec leaves whole are summed as by :func:`sum_flat` and
    come back whole.
    """
    sizes = dict(mesh.shape)
    leaves, tree = jax.tree.flatten(grads)
    spec_leaves, zero_leaves = _spec_leaves(specs), _spec_leaves(zero)
    out = list(leaves)
    whole: list[int] = []
    groups: dict[tuple[tuple[str, ...], tuple[str, ...], Any], list[tuple[int, _Blocks]]] = {}
    for i, g in enumerate(leaves):
        over = _reduced_over(spec_leaves[i], batch, sizes)
        if not over:
            continue
        blocks = _Blocks(mesh, g.shape, spec_leaves[i], zero_leaves[i], batch)
        if not blocks.axes:
            whole.append(i)
            continue
        groups.setdefault((over, blocks.axes, g.dtype), []).append((i, blocks))
    if whole:
        summed = sum_flat([leaves[i] for i in whole], [spec_leaves[i] for i in whole], mesh, batch)
        for i, s in zip(whole, summed, strict=True):
            out[i] = s
    for (over, axes, _), members in groups.items():
        flat = jnp.concatenate([b.to_rows(leaves[i]) for i, b in members], axis=1)
        flat = jax.lax.psum_scatter(flat, axes, scatter_dimension=0, tiled=True)[0]
        rest = tuple(a for a in over if a not in axes)
        if rest:
            flat = jax.lax.psum(flat, rest)
        start = 0
        for i, b in members:
            size = int(np.prod(b.shard))
            out[i] = flat[start : start + size].reshape(b.shard)
            start += size
    return jax.tree.unflatten(tree, out)
