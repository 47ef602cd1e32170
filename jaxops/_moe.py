"""MoE token permutation as XLA FFI custom calls, with pure-JAX twins (API: :mod:`jaxops.moe`).

A routing sends each of T tokens to K expert slots (``expert_ids[t, k]``; ids outside
``[0, E)``, -1 included, mark unused slots). Slot ``s = t * K + k``. :func:`permute` groups the
used slots by expert, in ascending expert order and, within an expert, in slot order (token
order, then k): the result is deterministic. Expert e keeps its first ``min(n_e, capacity)``
slots and drops the later ones; its group is padded with zero rows to a multiple of ``align``::

    group_sizes[e]   = round_up(min(n_e, capacity), align)
    group_offsets[e] = group_sizes[0] + ... + group_sizes[e - 1]

The permuted tensor has the static worst-case row count :func:`permuted_rows`::

    R = T * K + E * (align - 1)                                   (no capacity)
    R = min(T * K + E * (align - 1), E * round_up(min(C, T * K), align))   (capacity C)

and rows from ``num_rows = group_offsets[E]`` on are zero. Everything runs on device inside the
custom calls (a counting sort over experts, not a general sort); nothing is synchronized with
the host.

Layers, from the public functions down: validation and choice of implementation;
``jax.custom_vjp`` (the backward passes are custom calls too, never scatter-adds);
``custom_vmap`` (a batch runs as a loop over its examples); ``custom_partitioning`` with Shardy
rules; ``jax.ffi.ffi_call`` of the targets below, for CPU and CUDA.

Sharding: the hidden axis may be sharded (tensor parallelism): every device moves its columns, no
collective (the backward all-reduces only the ``[T, K]`` probability gradient). The expert-grouped
layout is global, so tokens sharded along T cannot be permuted without communication: call
:func:`permute` inside ``shard_map`` (each device permutes its own tokens, no collective) or use
expert parallelism (:mod:`jaxops.parallel`). jaxops raises instead of gathering them silently.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops import _checks, _ffi
from jaxops._rows import round_up, take_rows
from jaxops._sharding import axes_of, cotangent_like, padded_spec

__all__ = [
    "MAX_ALIGN",
    "TARGET_PERMUTE",
    "TARGET_ROUTE",
    "TARGET_UNPERMUTE",
    "TARGET_UNPERMUTE_BWD",
    "Permuted",
    "permute",
    "permute_reference",
    "permuted_rows",
    "unpermute",
    "unpermute_reference",
]

TARGET_ROUTE = "jaxops_moe_route"
TARGET_PERMUTE = "jaxops_moe_permute"
TARGET_UNPERMUTE = "jaxops_moe_unpermute"
TARGET_UNPERMUTE_BWD = "jaxops_moe_unpermute_bwd"

#: Largest supported ``align``.
MAX_ALIGN = 4096
_MAX_ROWS = 2**31 - 1
# Route workspace on CUDA: chunks of this many slots, at most _WORKSPACE_LIMIT int32 in all.
_CHUNK_SLOTS = 256
_WORKSPACE_LIMIT = 1 << 22

_TOKEN_DTYPES = (
    *_checks.FLOAT_DTYPES,
    np.dtype(jnp.float8_e4m3fn),
    np.dtype(jnp.float8_e5m2),
)
_FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
_INT32 = (np.dtype(np.int32),)


def permuted_rows(
    num_tokens: int, top_k: int, num_experts: int, align: int = 1, capacity: int | None = None
) -> int:
    """The static row count R of :func:`permute`'s output: every routing fits.

    ``R = T * K + E * (align - 1)``; with a capacity C also at most
    ``E * round_up(min(C, T * K), align)``.

    Example:
      >>> from jaxops import moe
      >>> moe.permuted_rows(4096, 8, 128, align=16), moe.permuted_rows(8, 2, 4, capacity=3)
      (34688, 12)
    """
    slots = num_tokens * top_k
    rows = slots + num_experts * (align - 1)
    if capacity is not None:
        rows = min(rows, num_experts * round_up(min(capacity, slots), align))
    return rows


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Permuted:
    """Tokens grouped by expert, and what :func:`unpermute` needs to bring them back.

    R is :func:`permuted_rows`; T, K come from ``expert_ids``; E is ``num_experts``.

    Attributes:
      tokens: ``[R, H]`` in the tokens' dtype; expert e's rows are
        ``group_offsets[e] : group_offsets[e] + group_sizes[e]``, zero padding at the end of
        each group and from ``num_rows`` on.
      scales: float32 ``[R, S]`` (the FP8 scales moved along with their rows), or None.
      probs: float32 ``[R]``, each row's routing probability (0 on padding rows), or None.
      group_sizes: int32 ``[E]``, padded group sizes (``jax.lax.ragged_dot``'s group_sizes).
      group_offsets: int32 ``[E + 1]``; ``group_offsets[E] == num_rows``.
      row_map: int32 ``[T, K]``, the row of slot (t, k), -1 if unused or dropped.
      source: int32 ``[R]``, the slot ``t * K + k`` each row holds, -1 on padding rows.
      num_rows: int32 ``[]``, rows in use (padding included).
      dropped: int32 ``[E]``, slots each expert dropped because of its capacity.
      num_experts: E.
      align: the group size multiple.
      capacity: the per-expert slot limit, or None.
    """

    tokens: jax.Array
    scales: jax.Array | None
    probs: jax.Array | None
    group_sizes: jax.Array
    group_offsets: jax.Array
    row_map: jax.Array
    source: jax.Array
    num_rows: jax.Array
    dropped: jax.Array
    num_experts: int = 1
    align: int = 1
    capacity: int | None = None

    def tree_flatten(self):
        children = (
            self.tokens,
            self.scales,
            self.probs,
            self.group_sizes,
            self.group_offsets,
            self.row_map,
            self.source,
            self.num_rows,
            self.dropped,
        )
        return children, (self.num_experts, self.align, self.capacity)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def kept(self) -> jax.Array:
        """Whether slot (t, k) has a row (used and not dropped): bool ``[T, K]``."""
        return self.row_map >= 0


@dataclasses.dataclass(frozen=True)
class _Route:
    experts: int
    align: int
    capacity: int | None
    rows: int

    @property
    def capacity_attr(self) -> int:
        return -1 if self.capacity is None else self.capacity


# -------------------------------------------------------------------------------------------------
# Pure-JAX twins (the test oracle and the impl="xla" path): argsort + gather, as MaxText does.


def _route_reference(cfg: _Route, ids: jax.Array):
    t, k = ids.shape
    e = cfg.experts
    flat = ids.reshape(-1)
    key = jnp.where((flat >= 0) & (flat < e), flat, e)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sorted_key = key[order]
    counts = jnp.bincount(key, length=e + 1).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.arange(t * k, dtype=jnp.int32) - starts[sorted_key]
    kept = counts[:e] if cfg.capacity is None else jnp.minimum(counts[:e], cfg.capacity)
    sizes = (kept + cfg.align - 1) // cfg.align * cfg.align
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes, dtype=jnp.int32)])
    used = sorted_key < e
    if cfg.capacity is not None:
        used &= rank < cfg.capacity
    row = jnp.where(used, offsets[jnp.minimum(sorted_key, e - 1)] + rank, -1)
    row_map = jnp.zeros((t * k,), jnp.int32).at[order].set(row).reshape(t, k)
    source = (
        jnp.full((cfg.rows,), -1, jnp.int32)
        .at[jnp.where(used, row, cfg.rows)]
        .set(order, mode="drop")
    )
    return row_map, source, sizes, offsets, offsets[e], counts[:e] - kept


def _permute_rows_reference(tokens, source, scales, probs, top_k: int):
    valid = source >= 0
    t = source // top_k
    out = take_rows(tokens, t, valid)
    out_scales = None if scales is None else take_rows(scales, t, valid)
    out_probs = None if probs is None else take_rows(probs.reshape(-1), source, valid)
    return out, out_scales, out_probs


def _unpermute_reference(expert_out, row_map, probs):
    valid = (row_map >= 0) & (row_map < expert_out.shape[0])
    rows = take_rows(expert_out, row_map, valid).astype(jnp.float32)  # [T, K, H]
    if probs is not None:
        rows = rows * probs.astype(jnp.float32)[..., None]
    return jnp.sum(rows, axis=1).astype(expert_out.dtype)


# -------------------------------------------------------------------------------------------------
# The custom calls.


def _explicit(x: jax.Array):
    """The mesh of x's type when it is sharded over explicit axes (result types need shardings)."""
    sharding = jax.typeof(x).sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or getattr(sharding, "spec", None) is None:
        return None
    return mesh


def _typed(mesh, *entries) -> NamedSharding | None:
    return None if mesh is None else NamedSharding(mesh, P(*entries))


def _hidden_entry(x: jax.Array):
    return padded_spec(jax.typeof(x).sharding, x.ndim)[-1] if _explicit(x) is not None else None


def _empty_f32() -> jax.Array:
    return jnp.zeros((0,), jnp.float32)


def _route_chunks(slots: int, experts: int) -> int:
    """Workspace rows of the route kernel: chunks of _CHUNK_SLOTS slots, bounded in total size."""
    return max(1, min(-(-slots // _CHUNK_SLOTS), _WORKSPACE_LIMIT // experts))


def _route_ffi(cfg: _Route, ids: jax.Array):
    t, k = ids.shape
    mesh = _explicit(ids)
    rep = _typed(mesh)
    i32 = jnp.int32
    out_types = (
        jax.ShapeDtypeStruct((t, k), i32, sharding=_typed(mesh, None, None)),
        jax.ShapeDtypeStruct((cfg.rows,), i32, sharding=_typed(mesh, None)),
        jax.ShapeDtypeStruct((cfg.experts,), i32, sharding=_typed(mesh, None)),
        jax.ShapeDtypeStruct((cfg.experts + 1,), i32, sharding=_typed(mesh, None)),
        jax.ShapeDtypeStruct((), i32, sharding=rep),
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
    mesh = _explicit(tokens)
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
    mesh = _explicit(expert_out)
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
    mesh = _explicit(expert_out)
    out_types = (
        jax.ShapeDtypeStruct(
            expert_out.shape, expert_out.dtype, sharding=_typed(mesh, None, _hidden_entry(d_out))
        ),
        jax.ShapeDtypeStruct(probs.shape, jnp.float32, sharding=_typed(mesh, None, None)),
    )
    return tuple(_ffi.ffi_call(TARGET_UNPERMUTE_BWD, out_types, d_out, expert_out, source, probs))


# -------------------------------------------------------------------------------------------------
# Sharding: custom_partitioning with Shardy rules. Only the hidden (and scale-column) axes may be
# sharded; the token and row axes must be replicated (see the module docstring).


def _local_axis(op: str, name: str, entry, axis: str) -> None:
    if entry is not None:
        raise ValueError(
            f"jaxops.moe.{op}: {name} is sharded along its {axis} axis over mesh axes {entry!r}; "
            "the expert-grouped layout is global, so this needs communication that jaxops will "
            "not insert silently. Call jaxops.moe inside shard_map (each device permutes its own "
            "tokens), or use jaxops.parallel expert parallelism."
        )


def _specs(arg_shapes) -> list[tuple]:
    return [padded_spec(a.sharding, len(a.shape)) for a in arg_shapes]


def _rep(mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P(*([None] * ndim)))


def _route_shardings(mesh) -> tuple[NamedSharding, ...]:
    """row_map, source, group_sizes, group_offsets, num_rows, dropped: all replicated."""
    return tuple(_rep(mesh, ndim) for ndim in (2, 1, 1, 1, 0, 1))


@functools.cache
def _route_op(cfg: _Route):
    def partition(mesh, arg_shapes, result_shape):
        (ids_spec,) = _specs(arg_shapes)
        _local_axis("permute", "expert_ids", axes_of(ids_spec) or None, "token")
        return mesh, functools.partial(_route_ffi, cfg), _route_shardings(mesh), (_rep(mesh, 2),)

    def infer(mesh, arg_shapes, result_shape):
        return _route_shardings(mesh)

    fn = custom_partitioning(functools.partial(_route_ffi, cfg))
    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule="t k -> u l, r, e, f, , e",
    )
    return _sequential_vmap(fn)


@functools.cache
def _permute_op(has_scales: bool, has_probs: bool):
    def unpack(operands):
        tokens, source, row_map, *rest = operands
        scales = rest.pop(0) if has_scales else None
        probs = rest.pop(0) if has_probs else None
        return tokens, source, row_map, scales, probs

    def call(*operands):
        out, out_scales, out_probs = _permute_ffi(*unpack(operands))
        return (out,) + ((out_scales,) if has_scales else ()) + ((out_probs,) if has_probs else ())

    def shardings(mesh, arg_shapes):
        specs = _specs(arg_shapes)
        _local_axis("permute", "tokens", specs[0][0], "token")
        _local_axis("permute", "source", specs[1][0], "row")
        _local_axis("permute", "row_map", axes_of(specs[2]) or None, "token")
        h = specs[0][1]
        args = [NamedSharding(mesh, P(None, h)), _rep(mesh, 1), _rep(mesh, 2)]
        outs = [NamedSharding(mesh, P(None, h))]
        if has_scales:
            _local_axis("permute", "scales", specs[3][0], "token")
            s = specs[3][1]
            args.append(NamedSharding(mesh, P(None, s)))
            outs.append(NamedSharding(mesh, P(None, s)))
        if has_probs:
            args.append(_rep(mesh, 2))
            outs.append(_rep(mesh, 1))
        return tuple(outs), tuple(args)

    def partition(mesh, arg_shapes, result_shape):
        outs, args = shardings(mesh, arg_shapes)
        return mesh, call, outs, args

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[0]

    rule_in = ["t h", "r", "t k"] + (["t s"] if has_scales else []) + (["t k"] if has_probs else [])
    rule_out = ["u h"] + (["u s"] if has_scales else []) + (["u"] if has_probs else [])
    fn = custom_partitioning(call)
    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=f"{', '.join(rule_in)} -> {', '.join(rule_out)}",
    )
    return _sequential_vmap(fn)


@functools.cache
def _unpermute_op(has_probs: bool):
    def call(*operands):
        expert_out, row_map = operands[:2]
        return _unpermute_ffi(expert_out, row_map, operands[2] if has_probs else None)

    def shardings(mesh, arg_shapes):
        specs = _specs(arg_shapes)
        _local_axis("unpermute", "expert_out", specs[0][0], "row")
        _local_axis("unpermute", "row_map", axes_of(specs[1]) or None, "token")
        h = specs[0][1]
        args = (NamedSharding(mesh, P(None, h)), _rep(mesh, 2)) + (
            (_rep(mesh, 2),) if has_probs else ()
        )
        return NamedSharding(mesh, P(None, h)), args

    def partition(mesh, arg_shapes, result_shape):
        out, args = shardings(mesh, arg_shapes)
        return mesh, call, out, args

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[0]

    fn = custom_partitioning(call)
    rule = "r h, t k, t k -> u h" if has_probs else "r h, t k -> u h"
    fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
    return _sequential_vmap(fn)


@functools.cache
def _unpermute_bwd_op():
    def shardings(mesh, arg_shapes):
        specs = _specs(arg_shapes)
        _local_axis("unpermute", "the output gradient", specs[0][0], "token")
        _local_axis("unpermute", "expert_out", specs[1][0], "row")
        h = specs[0][1]
        hs = NamedSharding(mesh, P(None, h))
        args = (hs, hs, _rep(mesh, 1), _rep(mesh, 2))
        return (hs, _rep(mesh, 2)), args, axes_of((h,))

    def partition(mesh, arg_shapes, result_shape):
        outs, args, hidden_axes = shardings(mesh, arg_shapes)

        def lower(d_out, expert_out, source, probs):
            d_expert, d_probs = _unpermute_bwd_ffi(d_out, expert_out, source, probs)
            if hidden_axes:  # each device has a part of every dot product
                d_probs = jax.lax.psum(d_probs, hidden_axes)
            return d_expert, d_probs

        return mesh, lower, outs, args

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[0]

    fn = custom_partitioning(_unpermute_bwd_ffi)
    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule="t h, r h, r, t k -> r h, t k",
    )
    return _sequential_vmap(fn)


# -------------------------------------------------------------------------------------------------
# vmap: a loop over the batch (each example has its own expert groups and row count).


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


# -------------------------------------------------------------------------------------------------
# Autodiff: explicit backward passes, all custom calls.


def _unpermute_kernel(expert_out, row_map, probs):
    """Unpermute on the custom call; float8 rows are accumulated in float32 and rounded back."""
    x = expert_out.astype(jnp.float32) if expert_out.dtype in _FP8_DTYPES else expert_out
    operands = (x, row_map) + ((probs,) if probs is not None else ())
    return _unpermute_op(probs is not None)(*operands).astype(expert_out.dtype)


def unpermute_rows(expert_out, row_map, probs, impl: str | None = None):
    """The unpermute arithmetic without its autodiff rule: the custom call or the twin.

    For layers that build their own backward (the expert-parallel dispatch's gradient).
    `expert_out` ``[R, H]``, `row_map` int32 ``[T, K]`` (rows outside ``[0, R)`` contribute
    zero), `probs` float32 ``[T, K]`` or None; returns ``[T, H]`` in expert_out's dtype.
    """
    if expert_out.size and row_map.size and _ffi.use_kernel(impl):
        return _unpermute_kernel(expert_out, row_map, probs)
    return _unpermute_reference(expert_out, row_map, probs)


def _permute_kernel(tokens, source, row_map, scales, probs):
    operands = (tokens, source, row_map)
    operands += (scales,) if scales is not None else ()
    operands += (probs,) if probs is not None else ()
    outs = list(_permute_op(scales is not None, probs is not None)(*operands))
    out = outs.pop(0)
    out_scales = outs.pop(0) if scales is not None else None
    out_probs = outs.pop(0) if probs is not None else None
    return out, out_scales, out_probs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _permute_vjp(cfg: _Route, tokens, expert_ids, probs, scales):
    return _permute_vjp_fwd(cfg, tokens, expert_ids, probs, scales)[0]


def _permute_vjp_fwd(cfg: _Route, tokens, expert_ids, probs, scales):
    row_map, source, sizes, offsets, num_rows, dropped = _route_op(cfg)(expert_ids)
    out, out_scales, out_probs = _permute_kernel(tokens, source, row_map, scales, probs)
    routing = (row_map, source, sizes, offsets, num_rows, dropped)
    return (out, out_scales, out_probs, routing), (row_map, tokens, probs, scales)


def _permute_vjp_bwd(cfg: _Route, residuals, cotangents):
    row_map, tokens, probs, scales = residuals
    d_out, d_scales_out, d_probs_out, _ = cotangents
    d_tokens = cotangent_like(_unpermute_kernel(d_out, row_map, None), tokens)
    d_scales = d_probs = None
    if scales is not None:
        d_scales = cotangent_like(_unpermute_kernel(d_scales_out, row_map, None), scales)
    if probs is not None:
        valid = row_map >= 0
        d_probs = jnp.where(valid, d_probs_out[jnp.where(valid, row_map, 0)], 0.0)
        d_probs = cotangent_like(d_probs.astype(probs.dtype), probs)
    return d_tokens, None, d_probs, d_scales


_permute_vjp.defvjp(_permute_vjp_fwd, _permute_vjp_bwd)


@jax.custom_vjp
def _unpermute_vjp(expert_out, row_map, source, probs):
    return _unpermute_kernel(expert_out, row_map, probs)


def _unpermute_vjp_fwd(expert_out, row_map, source, probs):
    out = _unpermute_kernel(expert_out, row_map, probs)
    return out, (expert_out, row_map, source, probs)


def _unpermute_vjp_bwd(residuals, d_out):
    expert_out, row_map, source, probs = residuals
    if probs is None:
        if expert_out.dtype in _FP8_DTYPES:
            d_out = d_out.astype(jnp.float32)
        d_expert = _permute_kernel(d_out, source, row_map, None, None)[0]
        d_probs = None
    else:
        d_expert, d_probs = _unpermute_bwd_op()(
            d_out, expert_out, source, probs.astype(jnp.float32)
        )
        d_probs = cotangent_like(d_probs.astype(probs.dtype), probs)
    d_expert = cotangent_like(d_expert.astype(expert_out.dtype), expert_out)
    return d_expert, None, None, d_probs


_unpermute_vjp.defvjp(_unpermute_vjp_fwd, _unpermute_vjp_bwd)


# -------------------------------------------------------------------------------------------------
# Validation and the public API.


def _static_int(op: str, name: str, value: Any, minimum: int, maximum: int) -> int:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"jaxops.moe.{op}: {name} must be a static Python int, got a traced value")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"jaxops.moe.{op}: {name} must be an int, got {type(value).__name__}")
    value = operator.index(value)
    if not minimum <= value <= maximum:
        raise ValueError(f"jaxops.moe.{op}: {name} must be in [{minimum}, {maximum}], got {value}")
    return value


def _token_axis_local(op: str, name: str, x: jax.Array, axis: str = "token") -> None:
    """On explicit meshes the sharding is known at trace time: refuse a sharded token/row axis."""
    if _explicit(x) is not None:
        entry = padded_spec(jax.typeof(x).sharding, x.ndim)[0]
        _local_axis(op, name, entry, axis)


def _check_probs(op: str, probs: Any, shape: tuple[int, ...]) -> jax.Array | None:
    if probs is None:
        return None
    probs = _checks.check_array(f"jaxops.moe.{op}", "probs", probs)
    if tuple(probs.shape) != shape:
        raise ValueError(
            f"jaxops.moe.{op}: probs must have expert_ids' shape {shape} (T, K), "
            f"got {tuple(probs.shape)}"
        )
    return probs


def _validate_permute(tokens, expert_ids, num_experts, probs, align, scales, capacity):
    op = "jaxops.moe.permute"
    tokens = _checks.check_array(op, "tokens", tokens, dtypes=_TOKEN_DTYPES)
    if tokens.ndim != 2:
        raise ValueError(f"{op}: tokens must have shape (T, H), got {tuple(tokens.shape)}")
    expert_ids = _checks.check_array(op, "expert_ids", expert_ids, dtypes=_INT32)
    t, h = tokens.shape
    if expert_ids.ndim != 2 or expert_ids.shape[0] != t or expert_ids.shape[1] < 1:
        raise ValueError(
            f"{op}: expert_ids must have shape (T, K) with T = {t} (tokens' rows) and K >= 1, "
            f"got {tuple(expert_ids.shape)}"
        )
    k = expert_ids.shape[1]
    num_experts = _static_int("permute", "num_experts", num_experts, 1, _MAX_ROWS)
    align = _static_int("permute", "align", align, 1, MAX_ALIGN)
    if capacity is not None:
        capacity = _static_int("permute", "capacity", capacity, 0, _MAX_ROWS)
    probs = _check_probs("permute", probs, (t, k))
    if scales is not None:
        scales = _checks.check_array(op, "scales", scales, dtypes=(np.dtype(np.float32),))
        s = scales.shape[1] if scales.ndim == 2 else 0
        if scales.ndim != 2 or scales.shape[0] != t or s < 1 or h % s:
            raise ValueError(
                f"{op}: scales must be float32 (T, H / G) = ({t}, {h} / G) for a group size G "
                f"that divides H, got {tuple(scales.shape)}"
            )
    rows = permuted_rows(t, k, num_experts, align, capacity)
    if t * k > _MAX_ROWS or rows > _MAX_ROWS:
        raise ValueError(
            f"{op}: T * K = {t * k} slots and R = {rows} rows must stay below 2^31 "
            f"(R = T * K + E * (align - 1))"
        )
    cfg = _Route(experts=num_experts, align=align, capacity=capacity, rows=rows)
    return tokens, expert_ids, probs, scales, cfg


def permute(
    tokens: jax.Array,
    expert_ids: jax.Array,
    num_experts: int,
    *,
    probs: jax.Array | None = None,
    align: int = 1,
    scales: jax.Array | None = None,
    capacity: int | None = None,
    impl: str | None = None,
) -> Permuted:
    """Groups token rows by expert, padded per expert, in one static-shape buffer.

    Expert ids outside ``[0, num_experts)`` (such as -1) mark unused slots. A token routed twice
    to the same expert gets two rows. Rows are ordered by expert, then by slot ``t * K + k``
    (stable and deterministic); with a capacity C, an expert keeps its first C slots in that
    order and drops the rest (``Permuted.dropped`` counts them; their ``row_map`` entry is -1).
    Each expert's group is zero-padded to a multiple of `align`. The output has
    ``R = T * K + E * (align - 1)`` rows (with a capacity, at most ``E * round_up(C, align)``;
    see :func:`permuted_rows`). Routing runs on device: no host synchronization.

    Differentiable in tokens, probs and scales (the backward is :func:`unpermute` without
    weights, a custom call). Works under jit, vmap (one example at a time) and with the hidden
    axis sharded; with tokens sharded along T, call it inside ``shard_map``.

    Args:
      tokens: ``[T, H]``: float32, bfloat16, float16, or float8 (e4m3fn / e5m2) with `scales`.
      expert_ids: int32 ``[T, K]``, the top-k expert choices.
      num_experts: E >= 1.
      probs: ``[T, K]`` routing weights (float32, bfloat16 or float16), moved to
        ``Permuted.probs`` (float32 ``[R]``).
      align: group size multiple, 1 to 4096 (8, 16 or 128 for grouped GEMMs).
      scales: float32 ``[T, H / G]`` per-token FP8 scales, moved with their rows.
      capacity: at most this many slots per expert (>= 0), or None.
      impl: None (the global default), ``"ffi"`` or ``"xla"`` (the argsort + gather twin).

    Returns:
      A :class:`Permuted`.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops import moe
      >>> tokens = jnp.arange(6, dtype=jnp.float32).reshape(3, 2)
      >>> ids = jnp.array([[1, 0], [1, -1], [0, 1]], jnp.int32)
      >>> p = moe.permute(tokens, ids, num_experts=2, align=2)
      >>> p.tokens[:, 0].tolist(), p.group_sizes.tolist(), p.row_map.tolist()
      ([0.0, 4.0, 0.0, 2.0, 4.0, 0.0, 0.0, 0.0], [2, 4], [[2, 0], [3, -1], [1, 4]])
    """
    tokens, expert_ids, probs, scales, cfg = _validate_permute(
        tokens, expert_ids, num_experts, probs, align, scales, capacity
    )
    _token_axis_local("permute", "tokens", tokens)
    _token_axis_local("permute", "expert_ids", expert_ids)
    probs32 = None if probs is None else probs.astype(jnp.float32)
    if tokens.size == 0 or expert_ids.size == 0 or not _ffi.use_kernel(impl):
        routing = _route_reference(cfg, expert_ids)
        out, out_scales, out_probs = _permute_rows_reference(
            tokens, routing[1], scales, probs32, expert_ids.shape[1]
        )
    else:
        out, out_scales, out_probs, routing = _permute_vjp(cfg, tokens, expert_ids, probs32, scales)
    row_map, source, sizes, offsets, num_rows, dropped = routing
    return Permuted(
        out,
        out_scales,
        out_probs,
        sizes,
        offsets,
        row_map,
        source,
        num_rows,
        dropped,
        cfg.experts,
        cfg.align,
        cfg.capacity,
    )


def _validate_unpermute(expert_out, permuted, probs, num_tokens):
    op = "jaxops.moe.unpermute"
    if not isinstance(permuted, Permuted):
        raise TypeError(
            f"{op}: permuted must be a jaxops.moe.Permuted, got {type(permuted).__name__}"
        )
    expert_out = _checks.check_array(op, "expert_out", expert_out, dtypes=_TOKEN_DTYPES)
    rows = permuted.source.shape[0]
    if expert_out.ndim != 2 or expert_out.shape[0] != rows:
        raise ValueError(
            f"{op}: expert_out must have shape (R, H') with R = {rows} (permuted rows), "
            f"got {tuple(expert_out.shape)}"
        )
    t = permuted.row_map.shape[0]
    if num_tokens is not None and num_tokens != t:
        raise ValueError(
            f"{op}: num_tokens must equal T = {t}, the tokens permute saw, got {num_tokens!r}"
        )
    probs = _check_probs("unpermute", probs, tuple(permuted.row_map.shape))
    return expert_out, probs


def unpermute(
    expert_out: jax.Array,
    permuted: Permuted,
    *,
    probs: jax.Array | None = None,
    num_tokens: int | None = None,
    impl: str | None = None,
) -> jax.Array:
    """Brings expert rows back to their tokens: ``out[t] = sum_k probs[t, k] * expert_out[row]``.

    Each token gathers the rows of its K slots (``permuted.row_map``) and adds them, weighted by
    `probs` when given, accumulating in float32 and rounding once. Unused and dropped slots
    contribute zero. Differentiable in expert_out and probs (the backward is one custom call
    that writes the expert-row gradient and the ``[T, K]`` probability gradient).

    Args:
      expert_out: ``[R, H']`` (float32, bfloat16 or float16; float8 is accumulated in float32),
        rows in :func:`permute`'s layout.
      permuted: the :class:`Permuted` from :func:`permute`.
      probs: ``[T, K]`` weights (float32, bfloat16 or float16), or None for a plain sum.
      num_tokens: T, checked against ``permuted`` when given.
      impl: None (the global default), ``"ffi"`` or ``"xla"`` (the gather + sum twin).

    Returns:
      ``[T, H']`` in expert_out's dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops import moe
      >>> tokens = jnp.arange(6, dtype=jnp.float32).reshape(3, 2)
      >>> ids = jnp.array([[1, 0], [1, -1], [0, 1]], jnp.int32)
      >>> probs = jnp.array([[0.75, 0.25], [1.0, 0.0], [0.5, 0.5]])
      >>> p = moe.permute(tokens, ids, num_experts=2)
      >>> moe.unpermute(p.tokens * 2, p, probs=probs)[:, 0].tolist()
      [0.0, 4.0, 8.0]
    """
    expert_out, probs = _validate_unpermute(expert_out, permuted, probs, num_tokens)
    _token_axis_local("unpermute", "expert_out", expert_out, "row")
    row_map = permuted.row_map
    if expert_out.size == 0 or row_map.size == 0 or not _ffi.use_kernel(impl):
        return _unpermute_reference(expert_out, row_map, probs)
    probs32 = None if probs is None else probs.astype(jnp.float32)
    return _unpermute_vjp(expert_out, row_map, permuted.source, probs32)


def permute_reference(tokens, expert_ids, num_experts, **kwargs) -> Permuted:
    """The pure-JAX twin of :func:`permute` (argsort + gather)."""
    return permute(tokens, expert_ids, num_experts, impl="xla", **kwargs)


def unpermute_reference(expert_out, permuted, **kwargs) -> jax.Array:
    """The pure-JAX twin of :func:`unpermute` (gather + weighted sum)."""
    return unpermute(expert_out, permuted, impl="xla", **kwargs)
