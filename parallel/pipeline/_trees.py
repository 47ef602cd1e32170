"""Pytree helpers of the pipeline body: microbatches, buffer slots, float leaves, residuals.

Everything here works leaf by leaf on pytrees of arrays: splitting a batch into microbatches,
reading and writing a slot of a ``[n, ...]`` buffer, separating float leaves (which have
gradients) from the others, splitting a vjp function into its stashed residuals and a
:class:`ResidualLayout`, and the varying-axes bookkeeping ``shard_map`` checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxops._sharding import vary_like, varying_axes

__all__ = [
    "ResidualLayout",
    "buffer",
    "conform",
    "float0_like",
    "float_leaves",
    "join_residuals",
    "merge_floats",
    "microbatches",
    "ppermute",
    "put",
    "slot",
    "split_residuals",
    "vary_over",
]


def microbatches(tree: Any, m: int) -> Any:
    """``[B, ...] -> [m, B / m, ...]`` per leaf."""
    return jax.tree.map(lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:]), tree)


def slot(tree: Any, i: jax.Array) -> Any:
    """Row `i` (a traced int32) of every leaf."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def put(tree: Any, i: jax.Array, value: Any) -> Any:
    """`tree` with row `i` of every leaf replaced by `value`'s leaf (cast to the leaf's dtype)."""
    return jax.tree.map(
        lambda a, x: jax.lax.dynamic_update_index_in_dim(a, x.astype(a.dtype), i, 0),
        tree,
        value,
    )


def buffer(n: int, like: Any) -> Any:
    """``[n, *x.shape]`` zeros per leaf x of `like`, varying like it."""
    return jax.tree.map(lambda x: vary_like(jnp.zeros((n, *x.shape), x.dtype), x), like)


def ppermute(tree: Any, axis: str, perm: list[tuple[int, int]]) -> Any:
    """``jax.lax.ppermute`` of every leaf over `axis` (zeros when `perm` is empty)."""
    if not perm:
        return jax.tree.map(jnp.zeros_like, tree)
    return jax.tree.map(lambda a: jax.lax.ppermute(a, axis, perm), tree)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def float_leaves(tree: Any) -> list:
    """The inexact leaves of `tree` (none for None)."""
    return [a for a in jax.tree.leaves(tree) if _is_float(a)] if tree is not None else []


def merge_floats(tree: Any, floats: list) -> Any:
    """`tree` with its inexact leaves replaced, in order, by `floats`."""
    if tree is None:
        return None
    leaves, treedef = jax.tree.flatten(tree)
    it = iter(floats)
    return jax.tree.unflatten(treedef, [next(it) if _is_float(a) else a for a in leaves])


def float0_like(tree: Any, floats: list) -> Any:
    """`floats` (grads of the float leaves) merged into `tree`'s structure, float0 elsewhere."""
    leaves, treedef = jax.tree.flatten(tree)
    it = iter(floats)
    out = [next(it) if _is_float(a) else np.zeros(a.shape, jax.dtypes.float0) for a in leaves]
    return jax.tree.unflatten(treedef, out)


class ResidualLayout(NamedTuple):
    """How to rebuild a stage's vjp function from its stashed residuals and its params.

    Attributes:
      treedef: the vjp function's treedef.
      where: per residual leaf, the index of the param leaf it is, or None (stashed).
    """

    treedef: Any
    where: tuple[int | None, ...]


def split_residuals(vjp_fn: Any, params: Any) -> tuple[list, ResidualLayout]:
    """Splits a vjp function into what a stage stashes and how to rebuild it.

    Returns the residual leaves that are not the params themselves (those get stashed; the
    backward reads the params instead) and the :class:`ResidualLayout`.
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
    return stashed, ResidualLayout(treedef, tuple(where))


def join_residuals(layout: ResidualLayout, stashed: list, params: Any) -> Any:
    """Inverse of :func:`split_residuals`: the vjp function from its stash and params."""
    param_leaves = jax.tree.leaves(params)
    it = iter(stashed)
    leaves = [next(it) if i is None else param_leaves[i] for i in layout.where]
    return jax.tree.unflatten(layout.treedef, leaves)


def vary_over(tree: Any, axes: Sequence[str]) -> Any:
    """Each leaf marked varying over `axes` (those it does not vary over yet)."""

    def mark(a):
        missing = tuple(sorted(set(axes) - varying_axes(a)))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(mark, tree)


def conform(tree: Any, like: Any) -> Any:
    """`tree` with the dtypes and varying axes of `like` (switch branches must agree)."""
    return jax.tree.map(lambda a, b: vary_like(a.astype(b.dtype), b), tree, like)
