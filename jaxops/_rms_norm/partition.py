"""The RMSNorm custom calls and their ``custom_partitioning`` with Shardy rules.

Sharded leading (row) axes run locally with no collective. A sharded hidden axis runs the kernel
per shard and all-reduces only the per-row partial sum of squares (forward) or the per-row
partial dot product (backward); the backward all-reduces dweight over the axes that shard rows.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning

from jaxops import _ffi
from jaxops._rms_norm.reference import Config, effective_weight, residual_add
from jaxops._sharding import axes_of, named, padded_spec, result_sharding

__all__ = [
    "TARGET_ADD_FWD",
    "TARGET_BWD",
    "TARGET_FWD",
    "partitioned_add_fwd",
    "partitioned_bwd",
    "partitioned_fwd",
    "unpack_bwd",
]

TARGET_FWD = "jaxops_rms_norm_fwd"
TARGET_ADD_FWD = "jaxops_add_rms_norm_fwd"
TARGET_BWD = "jaxops_rms_norm_bwd"

# The backward kernel reduces dweight deterministically over at most this many row ranges.
_MAX_PARTS = 256
_ROWS_PER_PART = 32
_MAX_PARTIAL_ELEMENTS = 1 << 22

# -------------------------------------------------------------------------------------------------
# One shard: the FFI calls.


def _num_parts(rows: int, hidden: int) -> int:
    return max(1, min(_MAX_PARTS, -(-rows // _ROWS_PER_PART), _MAX_PARTIAL_ELEMENTS // hidden))


def _empty(dtype: Any) -> jax.Array:
    # Absent optional operand. Built inside the trace: custom_partitioning rejects constants.
    return jnp.zeros((0,), dtype)


def _weight_operand(weight: jax.Array | None, dtype: Any) -> jax.Array:
    return _empty(dtype) if weight is None else weight


def _fwd_ffi(cfg: Config, x, weight, rstd_in=None):
    rows = x.shape[:-1]
    out_types = (
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=result_sharding(x)),
        jax.ShapeDtypeStruct(rows, jnp.float32, sharding=result_sharding(x, 1)),
    )
    return _ffi.ffi_call(
        TARGET_FWD,
        out_types,
        x,
        _weight_operand(weight, x.dtype),
        _empty(jnp.float32) if rstd_in is None else rstd_in,
        eps=np.float32(cfg.eps),
        zero_centered_weight=cfg.zero_centered,
        vmap_method="broadcast_all",
    )


def _add_fwd_ffi(cfg: Config, x, residual, weight):
    out_types = (
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=result_sharding(x)),
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=result_sharding(x)),
        jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32, sharding=result_sharding(x, 1)),
    )
    return _ffi.ffi_call(
        TARGET_ADD_FWD,
        out_types,
        x,
        residual,
        _weight_operand(weight, x.dtype),
        eps=np.float32(cfg.eps),
        zero_centered_weight=cfg.zero_centered,
        vmap_method="broadcast_all",
    )


def _bwd_ffi(cfg: Config, dy, x, rstd, weight, dh, dot_in=None):
    hidden = x.shape[-1]
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    weight_count = hidden if weight is not None else 0
    w_sharding = None if weight is None else getattr(jax.typeof(weight), "sharding", None)
    if w_sharding is not None and getattr(w_sharding.mesh, "empty", True):
        w_sharding = None
    out_types = (
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=result_sharding(x)),
        jax.ShapeDtypeStruct((weight_count,), jnp.float32, sharding=w_sharding),
        jax.ShapeDtypeStruct((_num_parts(rows, hidden), weight_count), jnp.float32),
    )
    dx, dw, _ = _ffi.ffi_call(
        TARGET_BWD,
        out_types,
        dy,
        x,
        _weight_operand(weight, x.dtype),
        rstd,
        _empty(jnp.float32) if dot_in is None else dot_in,
        _empty(x.dtype) if dh is None else dh,
        zero_centered_weight=cfg.zero_centered,
        vmap_method="broadcast_all",
    )
    return dx, (dw if weight is not None else None)


# -------------------------------------------------------------------------------------------------
# custom_partitioning with Shardy rules.
#
# Operands are passed as flat tuples whose layout depends on the config (weight present or not,
# dh present or not), so each config gets its own partitioned function.


def _split_spec(mesh, arg):
    spec = padded_spec(arg.sharding, len(arg.shape))
    return spec[:-1], spec[-1]


def _global_rstd(x, hidden_axes, hidden_total: int, eps: float):
    """Rstd of rows whose hidden axis is split over `hidden_axes`: one all-reduce of [rows] f32."""
    x32 = x.astype(jnp.float32)
    sum_squares = jax.lax.psum(jnp.sum(x32 * x32, axis=-1), hidden_axes)
    return jax.lax.rsqrt(sum_squares / hidden_total + jnp.float32(eps))


@functools.cache
def partitioned_fwd(cfg: Config):
    """(x[, weight]) -> (y, rstd) on the custom call, partitioned."""

    def fwd(*operands):
        x, weight = operands[0], (operands[1] if cfg.has_weight else None)
        return _fwd_ffi(cfg, x, weight)

    def partition(mesh, arg_shapes, result_shape):
        lead, hidden_axes = _split_spec(mesh, arg_shapes[0])
        hidden_total = arg_shapes[0].shape[-1]

        def lower(*operands):
            x, weight = operands[0], (operands[1] if cfg.has_weight else None)
            if hidden_axes is None:
                return _fwd_ffi(cfg, x, weight)
            return _fwd_ffi(cfg, x, weight, _global_rstd(x, hidden_axes, hidden_total, cfg.eps))

        x_sharding = named(mesh, *lead, hidden_axes)
        args = (x_sharding, named(mesh, hidden_axes)) if cfg.has_weight else (x_sharding,)
        return mesh, lower, (x_sharding, named(mesh, *lead)), args

    def infer(mesh, arg_shapes, result_shape):
        lead, hidden_axes = _split_spec(mesh, arg_shapes[0])
        return named(mesh, *lead, hidden_axes), named(mesh, *lead)

    fn = custom_partitioning(fwd)
    rule = "... h, h -> ... h, ..." if cfg.has_weight else "... h -> ... h, ..."
    fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
    return fn


@functools.cache
def partitioned_add_fwd(cfg: Config):
    """(x, residual[, weight]) -> (y, h, rstd) on the custom call, partitioned."""

    def add_fwd(*operands):
        x, residual = operands[0], operands[1]
        return _add_fwd_ffi(cfg, x, residual, operands[2] if cfg.has_weight else None)

    def partition(mesh, arg_shapes, result_shape):
        lead, hidden_axes = _split_spec(mesh, arg_shapes[0])
        hidden_total = arg_shapes[0].shape[-1]

        def lower(*operands):
            x, residual = operands[0], operands[1]
            weight = operands[2] if cfg.has_weight else None
            if hidden_axes is None:
                return _add_fwd_ffi(cfg, x, residual, weight)
            h = residual_add(x, residual)
            rstd = _global_rstd(h, hidden_axes, hidden_total, cfg.eps)
            y, rstd = _fwd_ffi(cfg, h, weight, rstd)
            return y, h, rstd

        x_sharding = named(mesh, *lead, hidden_axes)
        args = (x_sharding, x_sharding)
        if cfg.has_weight:
            args += (named(mesh, hidden_axes),)
        return mesh, lower, (x_sharding, x_sharding, named(mesh, *lead)), args

    def infer(mesh, arg_shapes, result_shape):
        lead, hidden_axes = _split_spec(mesh, arg_shapes[0])
        x_sharding = named(mesh, *lead, hidden_axes)
        return x_sharding, x_sharding, named(mesh, *lead)

    fn = custom_partitioning(add_fwd)
    rule = (
        "... h, ... h, h -> ... h, ... h, ..."
        if cfg.has_weight
        else "... h, ... h -> ... h, ... h, ..."
    )
    fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
    return fn


def unpack_bwd(cfg: Config, has_dh: bool, operands):
    """(dy, x, rstd[, weight][, dh]) -> dy, x, rstd, weight | None, dh | None."""
    dy, x, rstd = operands[:3]
    rest = list(operands[3:])
    weight = rest.pop(0) if cfg.has_weight else None
    dh = rest.pop(0) if has_dh else None
    return dy, x, rstd, weight, dh


@functools.cache
def partitioned_bwd(cfg: Config, has_dh: bool):
    """(dy, x, rstd[, weight][, dh]) -> (dx[, dweight float32]) on the custom call, partitioned."""

    def bwd(*operands):
        dy, x, rstd, weight, dh = unpack_bwd(cfg, has_dh, operands)
        dx, dw = _bwd_ffi(cfg, dy, x, rstd, weight, dh)
        return (dx, dw) if cfg.has_weight else (dx,)

    def partition(mesh, arg_shapes, result_shape):
        lead, hidden_axes = _split_spec(mesh, arg_shapes[1])
        batch_axes = axes_of(lead)
        hidden_total = arg_shapes[1].shape[-1]

        def lower(*operands):
            dy, x, rstd, weight, dh = unpack_bwd(cfg, has_dh, operands)
            dot_in = None
            if hidden_axes is not None:
                w = effective_weight(weight, cfg.zero_centered)
                g = dy.astype(jnp.float32) if w is None else dy.astype(jnp.float32) * w
                dot = jax.lax.psum(jnp.sum(g * x.astype(jnp.float32), axis=-1), hidden_axes)
                # The kernel divides by its local hidden size; scale so that it means the global.
                dot_in = dot * (x.shape[-1] / hidden_total)
            dx, dw = _bwd_ffi(cfg, dy, x, rstd, weight, dh, dot_in)
            if dw is None:
                return (dx,)
            return dx, (jax.lax.psum(dw, batch_axes) if batch_axes else dw)

        x_sharding = named(mesh, *lead, hidden_axes)
        args = (x_sharding, x_sharding, named(mesh, *lead))
        results = (x_sharding,)
        if cfg.has_weight:
            args += (named(mesh, hidden_axes),)
            results += (named(mesh, hidden_axes),)
        if has_dh:
            args += (x_sharding,)
        return mesh, lower, results, args

    def infer(mesh, arg_shapes, result_shape):
        lead, hidden_axes = _split_spec(mesh, arg_shapes[1])
        results = (named(mesh, *lead, hidden_axes),)
        if cfg.has_weight:
            results += (named(mesh, hidden_axes),)
        return results

    fn = custom_partitioning(bwd)
    operands = (
        ["... h", "... h", "..."]
        + (["h"] if cfg.has_weight else [])
        + (["... h"] if has_dh else [])
    )
    results = ["... h"] + (["h"] if cfg.has_weight else [])
    rule = f"{', '.join(operands)} -> {', '.join(results)}"
    fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
    return fn
