"""The MoE custom calls, their ``custom_partitioning`` with Shardy rules, and their vmap.

Only the hidden (and scale-column) axes may be sharded: every device moves its columns, and the
unpermute backward all-reduces only the ``[T, K]`` probability gradient. The token and row axes
must be replicated (the expert-grouped layout is global): a sharded one is refused with an error
naming ``shard_map`` and expert parallelism. Under vmap each op runs as a loop over the batch
(each example has its own expert groups and row count).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops import _ffi
from jaxops._errors import InvalidArgumentError
from jaxops._moe.layout import (
    TARGET_PERMUTE,
    TARGET_ROUTE,
    TARGET_UNPERMUTE,
    TARGET_UNPERMUTE_BWD,
    Route,
)
from jaxops._sharding import axes_of, padded_spec

__all__ = [
    "explicit_mesh",
    "permute_op",
    "refuse_sharded",
    "route_op",
    "unpermute_bwd_op",
    "unpermute_op",
]

# Route workspace on CUDA: chunks of this many slots, at most _WORKSPACE_LIMIT int32 in all.
_CHUNK_SLOTS = 256
_WORKSPACE_LIMIT = 1 << 22


def explicit_mesh(x: jax.Array):
    """The mesh of x's type when it is sharded over explicit axes (result types need shardings)."""
    sharding = jax.typeof(x).sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or getattr(sharding, "spec", None) is None:
        return None
    return mesh


def refuse_sharded(op: str, name: str, entry, axis: str) -> None:
    """Raises when `name`'s `axis` (a token or row axis) is sharded over mesh axes `entry`."""
    if entry is not None:
        raise InvalidArgumentError(
            f"jaxops.moe.{op}: {name} is sharded along its {axis} axis over mesh axes {entry!r}; "
            "the expert-grouped layout is global, so this needs communication that jaxops will "
            "not insert silently. Call jaxops.moe inside shard_map (each device permutes its own "
            "tokens), or use jaxops.parallel expert parallelism."
        )


# -------------------------------------------------------------------------------------------------
# The custom calls, with result types sharded like their operands on explicit meshes.


def _typed(mesh, *entries) -> NamedSharding | None:
    return None if mesh is None else NamedSharding(mesh, P(*entries))


def _hidden_entry(x: jax.Array):
    return padded_spec(jax.typeof(x).sharding, x.ndim)[-1] if explicit_mesh(x) is not None else None


def _empty_f32() -> jax.Array:
    return jnp.zeros((0,), jnp.float32)


def _route_chunks(slots: int, experts: int) -> int:
    """Workspace rows of the route kernel: chunks of _CHUNK_SLOTS slots, bounded in total size."""
    return max(1, min(-(-slots // _CHUNK_SLOTS), _WORKSPACE_LIMIT // experts))


def _route_ffi(cfg: Route, ids: jax.Array):
    t, k = ids.shape
    mesh = explicit_mesh(ids)
    i32 = jnp.int32
    out_types = (
        jax.ShapeDtypeStruct((t, k), i32, sharding=_typed(mesh, None, None)),
        jax.ShapeDtypeStruct((cfg.rows,), i32, sharding=_typed(mesh, None)),
        jax.ShapeDtypeStruct((cfg.experts,), i32, sharding=_typed(mesh, None)),
        jax.ShapeDtypeStruct((cfg.experts + 1,), i32, sharding=_typed(mesh, None)),
        jax.ShapeDtypeStruct((), i32, sharding=_typed(mesh)),
        jax.ShapeDtypeStruct((cfg.experts,), i32, sharding=_typed(mesh, None)),
        jax.ShapeDtypeStruct(
            (_route_chunks(t * k, cfg.experts), cfg.experts), i32, sharding=_typed(mesh, None, None)
        ),
    )
    outs = _ffi.ffi_call(
        TARGET_ROUTE,
        out_types,
        ids,
        align=np.int64(cfg.align),
        capacity=np.int64(cfg.capacity_attr),
    )
    return tuple(outs[:6])


def _permute_ffi(tokens, source, row_map, scales, probs):
    rows = source.shape[0]
    mesh = explicit_mesh(tokens)
    out_types = (
        jax.ShapeDtypeStruct(
            (rows, tokens.shape[1]),
            tokens.dtype,
            sharding=_typed(mesh, None, _hidden_entry(tokens)),
        ),
        jax.ShapeDtypeStruct(
            (rows, scales.shape[1]) if scales is not None else (0,),
            jnp.float32,
            sharding=_typed(mesh, None, _hidden_entry(scales))
            if scales is not None
            else _typed(mesh, None),
        ),
        jax.ShapeDtypeStruct(
            (rows,) if probs is not None else (0,), jnp.float32, sharding=_typed(mesh, None)
        ),
    )
    out, out_scales, out_probs = _ffi.ffi_call(
        TARGET_PERMUTE,
        out_types,
        tokens,
        source,
        row_map,
        scales if scales is not None else _empty_f32(),
        probs if probs is not None else _empty_f32(),
    )
    return (
        out,
        (out_scales if scales is not None else None),
        (out_probs if probs is not None else None),
    )


def _unpermute_ffi(expert_out, row_map, probs):
    t = row_map.shape[0]
    mesh = explicit_mesh(expert_out)
    out_type = jax.ShapeDtypeStruct(
        (t, expert_out.shape[1]),
        expert_out.dtype,
        sharding=_typed(mesh, None, _hidden_entry(expert_out)),
    )
    return _ffi.ffi_call(
        TARGET_UNPERMUTE,
        out_type,
        expert_out,
        row_map,
        probs if probs is not None else _empty_f32(),
    )


def _unpermute_bwd_ffi(d_out, expert_out, source, probs):
    mesh = explicit_mesh(expert_out)
    out_types = (
        jax.ShapeDtypeStruct(
            expert_out.shape, expert_out.dtype, sharding=_typed(mesh, None, _hidden_entry(d_out))
        ),
        jax.ShapeDtypeStruct(probs.shape, jnp.float32, sharding=_typed(mesh, None, None)),
    )
    return tuple(_ffi.ffi_call(TARGET_UNPERMUTE_BWD, out_types, d_out, expert_out, source, probs))


# -------------------------------------------------------------------------------------------------
# custom_partitioning with Shardy rules, and vmap as a loop over the batch.


def _specs(arg_shapes) -> list[tuple]:
    return [padded_spec(a.sharding, len(a.shape)) for a in arg_shapes]


def _rep(mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P(*([None] * ndim)))


def _columns(mesh, entry) -> NamedSharding:
    """Rows replicated, columns sharded over `entry`."""
    return NamedSharding(mesh, P(None, entry))


def _sequential_vmap(fn):
    @custom_vmap
    def op(operands):
        return fn(*operands)

    @op.def_vmap
    def rule(axis_size, in_batched, operands):
        operands = tuple(
            x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, b in zip(operands, in_batched[0], strict=True)
        )
        out = jax.lax.map(op, operands)
        return out, jax.tree.map(lambda _: True, out)

    return lambda *operands: op(operands)


def _custom_op(fn, shardings, rule: str):
    """`fn` under custom_partitioning and a sequential vmap.

    ``shardings(mesh, arg_shapes)`` checks the operand shardings and returns
    ``(result shardings, operand shardings, the lowering of one shard)``.
    """

    def partition(mesh, arg_shapes, result_shape):
        results, operands, lower = shardings(mesh, arg_shapes)
        return mesh, lower, results, operands

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[0]

    op = custom_partitioning(fn)
    op.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
    return _sequential_vmap(op)


@functools.cache
def route_op(cfg: Route):
    """The routing of ids ``[T, K]``: row_map, source, sizes, offsets, num_rows, dropped."""
    call = functools.partial(_route_ffi, cfg)

    def shardings(mesh, arg_shapes):
        (ids_spec,) = _specs(arg_shapes)
        refuse_sharded("permute", "expert_ids", axes_of(ids_spec) or None, "token")
        results = tuple(_rep(mesh, ndim) for ndim in (2, 1, 1, 1, 0, 1))
        return results, (_rep(mesh, 2),), call

    return _custom_op(call, shardings, "t k -> u l, r, e, f, , e")


@functools.cache
def permute_op(has_scales: bool, has_probs: bool):
    """(tokens, source, row_map[, scales][, probs]) -> (rows[, scales][, probs])."""

    def call(*operands):
        tokens, source, row_map, *rest = operands
        scales = rest.pop(0) if has_scales else None
        probs = rest.pop(0) if has_probs else None
        out, out_scales, out_probs = _permute_ffi(tokens, source, row_map, scales, probs)
        return (out,) + ((out_scales,) if has_scales else ()) + ((out_probs,) if has_probs else ())

    def shardings(mesh, arg_shapes):
        specs = _specs(arg_shapes)
        refuse_sharded("permute", "tokens", specs[0][0], "token")
        refuse_sharded("permute", "source", specs[1][0], "row")
        refuse_sharded("permute", "row_map", axes_of(specs[2]) or None, "token")
        args = [_columns(mesh, specs[0][1]), _rep(mesh, 1), _rep(mesh, 2)]
        outs = [_columns(mesh, specs[0][1])]
        if has_scales:
            refuse_sharded("permute", "scales", specs[3][0], "token")
            args.append(_columns(mesh, specs[3][1]))
            outs.append(_columns(mesh, specs[3][1]))
        if has_probs:
            args.append(_rep(mesh, 2))
            outs.append(_rep(mesh, 1))
        return tuple(outs), tuple(args), call

    rule_in = ["t h", "r", "t k"] + (["t s"] if has_scales else []) + (["t k"] if has_probs else [])
    rule_out = ["u h"] + (["u s"] if has_scales else []) + (["u"] if has_probs else [])
    return _custom_op(call, shardings, f"{', '.join(rule_in)} -> {', '.join(rule_out)}")


@functools.cache
def unpermute_op(has_probs: bool):
    """(expert_out, row_map[, probs]) -> ``[T, H]``."""

    def call(*operands):
        expert_out, row_map = operands[:2]
        return _unpermute_ffi(expert_out, row_map, operands[2] if has_probs else None)

    def shardings(mesh, arg_shapes):
        specs = _specs(arg_shapes)
        refuse_sharded("unpermute", "expert_out", specs[0][0], "row")
        refuse_sharded("unpermute", "row_map", axes_of(specs[1]) or None, "token")
        hidden = _columns(mesh, specs[0][1])
        args = (hidden, _rep(mesh, 2)) + ((_rep(mesh, 2),) if has_probs else ())
        return hidden, args, call

    rule = "r h, t k, t k -> u h" if has_probs else "r h, t k -> u h"
    return _custom_op(call, shardings, rule)


@functools.cache
def unpermute_bwd_op():
    """(d_out, expert_out, source, probs) -> (d_expert_out, d_probs)."""

    def shardings(mesh, arg_shapes):
        specs = _specs(arg_shapes)
        refuse_sharded("unpermute", "the output gradient", specs[0][0], "token")
        refuse_sharded("unpermute", "expert_out", specs[1][0], "row")
        h = specs[0][1]
        hidden_axes = axes_of((h,))
        hs = _columns(mesh, h)

        def lower(d_out, expert_out, source, probs):
            d_expert, d_probs = _unpermute_bwd_ffi(d_out, expert_out, source, probs)
            if hidden_axes:  # each device has a part of every dot product
                d_probs = jax.lax.psum(d_probs, hidden_axes)
            return d_expert, d_probs

        return (hs, _rep(mesh, 2)), (hs, hs, _rep(mesh, 1), _rep(mesh, 2)), lower

    return _custom_op(_unpermute_bwd_ffi, shardings, "t h, r h, r, t k -> r h, t k")
