"""Helpers for the custom_partitioning rules of jaxops ops.

Every op's partition callback reads the operand shardings XLA chose, decides which axes stay local
and which need a collective inside the op (always a reduction of a small per-row or per-column
partial, never a gather of the operand), and returns the lowering for one shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "SpecEntry",
    "axes_of",
    "constrain",
    "cotangent_like",
    "manual_axes",
    "matmul_sharding",
    "named",
    "padded_spec",
    "place",
    "result_sharding",
    "unflatten_rows",
    "vary_like",
    "varying_axes",
]

SpecEntry = str | tuple[str, ...] | None


def padded_spec(sharding: Any, ndim: int) -> tuple[SpecEntry, ...]:
    """The PartitionSpec of `sharding` as a tuple of exactly `ndim` entries (None = replicated)."""
    spec = tuple(getattr(sharding, "spec", ()) or ())
    spec = spec + (None,) * (ndim - len(spec))
    return tuple(_normalize(entry) for entry in spec[:ndim])


def unflatten_rows(y: jax.Array, x: jax.Array) -> jax.Array:
    """``y [prod(x.shape[:-1]), N]`` (rows of `x` flattened) as ``[*x.shape[:-1], N]``.

    On an Explicit mesh the leading dimensions keep `x`'s sharding: left to itself, the reshape
    may split a sharded row axis of several mesh axes over two dimensions (with a size-1 mesh
    axis among them, ``("data", "expert")`` of data 2 x expert 1 became data on the batch and
    expert on the sequence), which the next elementwise op with a ``[B, S, ...]`` operand then
    refuses.
    """
    shape = (*x.shape[:-1], y.shape[-1])
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return y.reshape(shape)
    lead = padded_spec(sharding, x.ndim)[:-1]
    last = padded_spec(jax.typeof(y).sharding, 2)[1]
    return jax.lax.reshape(y, shape, out_sharding=NamedSharding(mesh, P(*lead, last)))


def _normalize(entry: Any) -> SpecEntry:
    if entry is None or entry == ():
        return None
    if isinstance(entry, tuple):
        return entry if len(entry) > 1 else entry[0]
    if entry is P.UNCONSTRAINED:
        return None
    return entry


def axes_of(entries: Sequence[SpecEntry]) -> tuple[str, ...]:
    """The mesh axis names used by spec entries, in order, each once."""
    names: list[str] = []
    for entry in entries:
        if entry is None:
            continue
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name not in names:
                names.append(name)
    return tuple(names)


def manual_axes() -> tuple[str, ...]:
    """The mesh axes that are manual where this is traced (inside ``shard_map``), else ()."""
    return tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())


def place(tree: Any, mesh: Any, specs: Any) -> Any:
    """`tree` resharded onto `specs`, a matching pytree of PartitionSpecs, on Explicit meshes.

    shard_map wants its inputs to match its in_specs there; on other meshes `tree` is unchanged.
    """
    if not isinstance(mesh, jax.sharding.Mesh) or not any(
        t == AxisType.Explicit for t in mesh.axis_types
    ):
        return tree
    return jax.tree.map(
        lambda a, s: jax.reshard(a, NamedSharding(mesh, s)),
        tree,
        specs,
        is_leaf=lambda s: isinstance(s, P),
    )


def constrain(tree: Any, shardings: Any) -> Any:
    """`tree` laid out on `shardings` (a matching pytree of NamedShardings) inside a trace.

    ``jax.reshard`` on meshes with Explicit axes (where the sharding is part of the type),
    ``with_sharding_constraint`` on others; the partitioner inserts the collectives.
    """

    def one(a: Any, s: NamedSharding) -> Any:
        if any(t == AxisType.Explicit for t in s.mesh.axis_types):
            return jax.reshard(a, s)
        return jax.lax.with_sharding_constraint(a, s)

    return jax.tree.map(one, tree, shardings)


def named(mesh: Any, *entries: SpecEntry) -> NamedSharding:
    """NamedSharding on `mesh` with the given spec entries."""
    return NamedSharding(mesh, P(*entries))


def result_sharding(x: jax.Array, ndim_dropped: int = 0) -> Any:
    """The sharding a result derived row-wise from `x` should carry in its type.

    On meshes with Explicit axes the sharding is part of the array's type, and a custom call
    result typed as replicated would force XLA to gather. `ndim_dropped` trailing axes of `x` are
    dropped (e.g. 1 for a per-row statistic). Returns None outside explicit sharding.
    """
    sharding = jax.typeof(x).sharding
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None or getattr(mesh, "empty", True):
        return None
    entries = padded_spec(sharding, x.ndim)
    if ndim_dropped:
        entries = entries[: x.ndim - ndim_dropped]
    return NamedSharding(mesh, P(*entries))


def matmul_sharding(a: Any, b: Any, a_rows: int, b_cols: int) -> NamedSharding | None:
    """The sharding of a custom-call matmul's ``[M, N]`` result type on Explicit meshes.

    M keeps `a`'s entry on its axis `a_rows`, N `b`'s entry on its axis `b_cols` (dropped when
    it names a mesh axis M already uses); the contraction axis leaves the type. The result is the
    whole product whatever the operands' shardings, so this only types it: a custom call typed
    replicated would not match the sharded values around it (a ``custom_vjp`` cotangent, say).
    None where `a` is not on a mesh with Explicit axes.
    """
    sharding = jax.typeof(a).sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return None
    if not any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return None
    m_entry = padded_spec(sharding, a.ndim)[a_rows]
    b_sharding = jax.typeof(b).sharding
    n_entry = None
    if getattr(b_sharding, "mesh", None) == mesh:
        n_entry = padded_spec(b_sharding, b.ndim)[b_cols]
        if set(axes_of([n_entry])) & set(axes_of([m_entry])):
            n_entry = None
    return NamedSharding(mesh, P(m_entry, n_entry))


# -------------------------------------------------------------------------------------------------
# Inside shard_map: the manual axes a value varies over.


def varying_axes(x: Any) -> frozenset[str]:
    """The shard_map axes over which `x` varies (empty outside shard_map or when invariant)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()) or ())
    return frozenset(getattr(aval, "vma", ()) or ())


def vary_like(outputs: Any, *inputs: Any) -> Any:
    """Marks custom-call `outputs` as varying over every shard_map axis any of `inputs` varies over.

    A custom call's results carry no varying-axes type of their own; typed invariant, they would
    fail the type check of a ``custom_vjp`` backward rule whose primal input varies.
    """
    axes: frozenset[str] = frozenset()
    for x in jax.tree.leaves(inputs):
        axes |= varying_axes(x)
    if not axes:
        return outputs

    def mark(y):
        missing = tuple(sorted(axes - varying_axes(y)))
        return jax.lax.pcast(y, missing, to="varying") if missing else y

    return jax.tree.map(mark, outputs)


def cotangent_like(ct: Any, primal: Any) -> Any:
    """`ct` given the varying axes of `primal`, as a ``custom_vjp`` backward rule must return it.

    A primal that is invariant over a shard_map axis was used by every device: its cotangent is
    the sum of the devices' partial cotangents (a ``psum`` over that axis).
    """
    if ct is None:
        return None
    want = varying_axes(primal)
    have = varying_axes(ct)
    extra = tuple(sorted(have - want))
    if extra:
        ct = jax.lax.psum(ct, extra)
    missing = tuple(sorted(want - varying_axes(ct)))
    ct = jax.lax.pcast(ct, missing, to="varying") if missing else ct
    return _explicit_like(ct, primal)


def _explicit_like(ct: jax.Array, primal: Any) -> jax.Array:
    """`ct` resharded to the Explicit-mesh sharding of `primal` where their types differ.

    On an Explicit mesh the sharding is part of the type a ``custom_vjp`` backward must match; a
    custom call's result may come back typed otherwise. Only the leading ``ct.ndim - 1`` axes
    are compared (a marker may stand for the primal with an empty last axis).
    """
    want = jax.typeof(primal).sharding
    mesh = getattr(want, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or ct.ndim != jax.typeof(primal).ndim:
        return ct
    if not any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return ct
    lead = padded_spec(want, ct.ndim)[:-1] if ct.ndim else ()
    have = padded_spec(jax.typeof(ct).sharding, ct.ndim)[:-1] if ct.ndim else ()
    if lead == have:
        return ct
    last = padded_spec(jax.typeof(ct).sharding, ct.ndim)[-1:]
    return jax.reshard(ct, NamedSharding(mesh, P(*lead, *last)))
