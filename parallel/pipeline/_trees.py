"""Pytree helpers of the pipeline body: microbatches, buffer slots, float leaves, residuals.

Everything here works leaf by leaf on pytrees of arrays: splitting a batch into microbatches,
reading and writing a slot of a ``[n, ...]`` buffer, separating float leaves (which have
gradients) from the others, splitting a vjp function into its stashed residuals and a
:class:`ResidualLayout`, and the varying-axes bookkeeping ``shard_map`` checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from jaxops._sharding import vary_like, varying_axes

try:  # prunes a jaxpr to what some of its outputs need (private; without it nothing is derived)
    from jax._src.interpreters.partial_eval import dce_jaxpr as _dce_jaxpr
except ImportError:  # pragma: no cover
    _dce_jaxpr = None

__all__ = [
    "ResidualLayout",
    "buffer",
    "conform",
    "float0_like",
    "float_leaves",
    "join_residuals",
    "merge_frozen",
    "merge_floats",
    "microbatches",
    "param_derived",
    "ppermute",
    "put",
    "slot",
    "split_frozen",
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


def _is_none(x: Any) -> bool:
    return x is None


def split_frozen(tree: Any, mask: Any) -> tuple[Any, Any]:
    """``(trained, frozen)``: `tree` twice, the frozen leaves None in one, the others in the other.

    `mask`: a bool per leaf of `tree` (True: frozen).
    """
    trained = jax.tree.map(lambda m, a: None if m else a, mask, tree)
    frozen = jax.tree.map(lambda m, a: a if m else None, mask, tree)
    return trained, frozen


def merge_frozen(trained: Any, frozen: Any) -> Any:
    """Inverse of :func:`split_frozen`: each leaf from whichever of the two holds it."""
    return jax.tree.map(lambda t, f: f if t is None else t, trained, frozen, is_leaf=_is_none)


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
      where: per residual leaf, ``("param", i)`` (it is param leaf i: the backward reads the
        param), ``("derived", i)`` (it is computed from the params alone, a cast or a slice of
        a weight say: the backward recomputes it, output i of :func:`param_derived`'s
        function) or ``("stash", i)`` (stashed leaf i).
    """

    treedef: Any
    where: tuple[tuple[str, int], ...]


def param_derived(fn: Any, params: Any, x: Any, vjp: Callable | None = None) -> tuple[dict, Any]:
    """Which vjp residuals of ``fn(params, x)`` do not depend on x, and a function computing them.

    Returns ``(derived, recompute)``: ``{index: (shape, dtype)}`` of the residuals (indices into
    the vjp function's leaves) computed from `params` and constants alone (weights cast to the
    compute dtype, sliced out of a stack, transposed, ...), and ``recompute(params)``, the list
    of those leaves in index order: only what they need of the stage is computed (dead code
    pruned from a trace of the vjp, collectives included). A pipeline stashes the others per
    microbatch; these it recomputes in the backward instead of keeping a copy of the stage's
    weights per microbatch in flight. Without jax's jaxpr pruning (a private API) nothing is
    derived. `vjp`: ``(params, x) -> (out, vjp function)`` (default ``jax.vjp(fn, params,
    x)``; one that differentiates some of the params only, the frozen ones closed over).
    """
    if _dce_jaxpr is None:
        return {}, lambda p: []
    vjp = vjp or (lambda p, x: jax.vjp(fn, p, x))
    closed = jax.make_jaxpr(lambda p, x: jax.tree.leaves(vjp(p, x)[1]))(params, x)
    jaxpr, n_p = closed.jaxpr, len(jax.tree.leaves(params))
    n_out = len(jaxpr.outvars)
    derived = tuple(
        i
        for i in range(n_out)
        if not any(_dce_jaxpr(jaxpr, [j == i for j in range(n_out)])[1][n_p:])
    )
    if not derived:
        return {}, lambda p: []
    pruned, used = _dce_jaxpr(jaxpr, [i in derived for i in range(n_out)])
    if any(used[n_p:]):  # cannot happen: every kept output is independent of x
        return {}, lambda p: []
    run = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(pruned, closed.consts))

    def recompute(p: Any) -> list:
        return list(run(*(a for a, u in zip(jax.tree.leaves(p), used[:n_p], strict=True) if u)))

    avals = [v.aval for v in jaxpr.outvars]
    return {i: (tuple(avals[i].shape), avals[i].dtype) for i in derived}, recompute


def split_residuals(
    vjp_fn: Any,
    params: Any,
    derived: dict | None = None,
    *,
    op: str = "jaxops.parallel.pipeline.pipeline_step",
) -> tuple[list, ResidualLayout]:
    """Splits a vjp function into what a stage stashes and how to rebuild it.

    Returns the residual leaves that are neither the params themselves (the backward reads the
    params instead) nor in `derived` (of :func:`param_derived`: the backward recomputes them),
    which get stashed, and the :class:`ResidualLayout`.

    Raises:
      RuntimeError: a derived leaf's shape or dtype is not the one :func:`param_derived` traced
        (the stage traced differently twice).
    """
    derived = derived or {}
    leaves, treedef = jax.tree.flatten(vjp_fn)
    param_leaves = jax.tree.leaves(params)
    where: list[tuple[str, int]] = []
    stashed = []
    order = sorted(derived)
    for i, leaf in enumerate(leaves):
        hit = next((k for k, q in enumerate(param_leaves) if leaf is q), None)
        if hit is not None:
            where.append(("param", hit))
        elif i in derived:
            if (tuple(leaf.shape), leaf.dtype) != derived[i]:
                raise RuntimeError(
                    f"{op}: stage_fn's vjp residual {i} is {leaf.shape} {leaf.dtype} here "
                    f"and {derived[i]} in another trace (stage_fn must trace the same way "
                    "every time)"
                )
            where.append(("derived", order.index(i)))
        else:
            where.append(("stash", len(stashed)))
            stashed.append(leaf)
    return stashed, ResidualLayout(treedef, tuple(where))


def join_residuals(
    layout: ResidualLayout, stashed: list, params: Any, derived: Sequence = ()
) -> Any:
    """Inverse of :func:`split_residuals`: the vjp function from its parts.

    `derived` are the recomputed leaves, ``recompute(params)`` of :func:`param_derived`.
    """
    sources = {"param": jax.tree.leaves(params), "stash": stashed, "derived": derived}
    leaves = [sources[kind][i] for kind, i in layout.where]
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
