"""RMSNorm and fused residual-add + RMSNorm as XLA FFI custom calls, with their pure-JAX twins.

Layers, from the public functions down:

1. :func:`rms_norm` / :func:`add_rms_norm`: validation at trace time, choice of implementation.
2. ``jax.custom_vjp``: the backward pass is the ``jaxops_rms_norm_bwd`` kernel.
3. ``jax.custom_batching.custom_vmap``: vmap folds the batch into the kernel's rows.
4. ``custom_partitioning`` with Shardy rules: sharded leading axes run locally with no
   collective; a sharded hidden axis runs the kernel per shard and all-reduces only the per-row
   partial sum of squares (forward) or the per-row partial dot product (backward).
5. ``jax.ffi.ffi_call`` of the targets below, for CPU and CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning

from jaxops import _checks, _ffi
from jaxops._sharding import (
    axes_of,
    cotangent_like,
    named,
    padded_spec,
    result_sharding,
    vary_like,
)

__all__ = [
    "TARGET_ADD_FWD",
    "TARGET_BWD",
    "TARGET_FWD",
    "add_rms_norm",
    "add_rms_norm_reference",
    "rms_norm",
    "rms_norm_reference",
]

TARGET_FWD = "jaxops_rms_norm_fwd"
TARGET_ADD_FWD = "jaxops_add_rms_norm_fwd"
TARGET_BWD = "jaxops_rms_norm_bwd"

# The backward kernel reduces dweight deterministically over at most this many row ranges.
_MAX_PARTS = 256
_ROWS_PER_PART = 32
_MAX_PARTIAL_ELEMENTS = 1 << 22


@dataclasses.dataclass(frozen=True)
class _Config:
    eps: float
    zero_centered: bool
    has_weight: bool


# -------------------------------------------------------------------------------------------------
# Pure-JAX twins: the test oracle and the impl="xla" path. Differentiated by JAX itself.


def _effective_weight(weight: jax.Array | None, zero_centered: bool) -> jax.Array | None:
    if weight is None:
        return None
    w = weight.astype(jnp.float32)
    return 1.0 + w if zero_centered else w


def _reference_fwd(cfg: _Config, x: jax.Array, weight: jax.Array | None):
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1) + jnp.float32(cfg.eps))
    y = x32 * rstd[..., None]
    w = _effective_weight(weight, cfg.zero_centered)
    if w is not None:
        y = y * w
    return y.astype(x.dtype), rstd


def rms_norm_reference(
    x: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    zero_centered_weight: bool = False,
) -> jax.Array:
    """Pure-JAX RMSNorm, the twin of :func:`rms_norm` (same arguments, no validation)."""
    cfg = _Config(float(eps), bool(zero_centered_weight), weight is not None)
    return _reference_fwd(cfg, x, weight)[0]


def add_rms_norm_reference(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    zero_centered_weight: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Pure-JAX twin of :func:`add_rms_norm`: returns ``(rms_norm(h), h)``, h = x + residual."""
    h = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
    return rms_norm_reference(h, weight, eps=eps, zero_centered_weight=zero_centered_weight), h


def _reference_bwd(cfg, dy, x, rstd, weight, dh, *, reduce_axes=None):
    """Dx and fp32 dweight from the closed-form backward, in XLA (vmap fallback)."""
    x32 = x.astype(jnp.float32)
    dy32 = dy.astype(jnp.float32)
    w = _effective_weight(weight, cfg.zero_centered)
    g = dy32 if w is None else dy32 * w
    r = rstd[..., None]
    dot = jnp.sum(g * x32, axis=-1, keepdims=True)
    dx = r * g - x32 * (r * r * r) * dot / x.shape[-1]
    if dh is not None:
        dx = dx + dh.astype(jnp.float32)
    dw = None
    if weight is not None:
        axes = tuple(range(x.ndim - 1)) if reduce_axes is None else reduce_axes
        dw = jnp.sum(dy32 * x32 * r, axis=axes)
    return dx.astype(x.dtype), dw


# -------------------------------------------------------------------------------------------------
# One shard: the FFI calls.


def _num_parts(rows: int, hidden: int) -> int:
    return max(1, min(_MAX_PARTS, -(-rows // _ROWS_PER_PART), _MAX_PARTIAL_ELEMENTS // hidden))


def _empty(dtype: Any) -> jax.Array:
    # Absent optional operand. Built inside the trace: custom_partitioning rejects constants.
    return jnp.zeros((0,), dtype)


def _weight_operand(weight: jax.Array | None, dtype: Any) -> jax.Array:
    return _empty(dtype) if weight is None else weight


def _fwd_ffi(cfg: _Config, x, weight, rstd_in=None):
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


def _add_fwd_ffi(cfg: _Config, x, residual, weight):
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


def _bwd_ffi(cfg: _Config, dy, x, rstd, weight, dh, dot_in=None):
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
# Sharding: custom_partitioning with Shardy rules.
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
def _partitioned_fwd(cfg: _Config):
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
def _partitioned_add_fwd(cfg: _Config):
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
            h = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
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


def _unpack_bwd(cfg: _Config, has_dh: bool, operands):
    """(dy, x, rstd[, weight][, dh]) -> dy, x, rstd, weight | None, dh | None."""
    dy, x, rstd = operands[:3]
    rest = list(operands[3:])
    weight = rest.pop(0) if cfg.has_weight else None
    dh = rest.pop(0) if has_dh else None
    return dy, x, rstd, weight, dh


@functools.cache
def _partitioned_bwd(cfg: _Config, has_dh: bool):
    def bwd(*operands):
        dy, x, rstd, weight, dh = _unpack_bwd(cfg, has_dh, operands)
        dx, dw = _bwd_ffi(cfg, dy, x, rstd, weight, dh)
        return (dx, dw) if cfg.has_weight else (dx,)

    def partition(mesh, arg_shapes, result_shape):
        lead, hidden_axes = _split_spec(mesh, arg_shapes[1])
        batch_axes = axes_of(lead)
        hidden_total = arg_shapes[1].shape[-1]

        def lower(*operands):
            dy, x, rstd, weight, dh = _unpack_bwd(cfg, has_dh, operands)
            dot_in = None
            if hidden_axes is not None:
                w = _effective_weight(weight, cfg.zero_centered)
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


# -------------------------------------------------------------------------------------------------
# vmap: fold the batch axis into the rows (batched weights fall back to the twin).


def _broadcast_unbatched(axis_size, values, batched):
    return [
        v if (v is None or b) else jnp.broadcast_to(v, (axis_size, *v.shape))
        for v, b in zip(values, batched, strict=True)
    ]


@functools.cache
def _fwd_op(cfg: _Config):
    partitioned = _partitioned_fwd(cfg)

    @custom_vmap
    def op(operands):
        return partitioned(*operands)

    @op.def_vmap
    def rule(axis_size, in_batched, operands):
        batched = list(in_batched[0])
        x, weight = operands[0], (operands[1] if cfg.has_weight else None)
        if cfg.has_weight and batched[1]:
            x = x if batched[0] else jnp.broadcast_to(x, (axis_size, *x.shape))
            out = jax.vmap(functools.partial(_reference_fwd, cfg))(x, weight)
        else:
            out = op(operands)
        return out, (True, True)

    return op


@functools.cache
def _add_fwd_op(cfg: _Config):
    partitioned = _partitioned_add_fwd(cfg)

    @custom_vmap
    def op(operands):
        return partitioned(*operands)

    @op.def_vmap
    def rule(axis_size, in_batched, operands):
        batched = list(in_batched[0])
        x, residual = _broadcast_unbatched(axis_size, operands[:2], batched[:2])
        if cfg.has_weight and batched[2]:

            def reference(x, residual, weight):
                h = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
                y, rstd = _reference_fwd(cfg, h, weight)
                return y, h, rstd

            out = jax.vmap(reference)(x, residual, operands[2])
        else:
            out = op((x, residual, *operands[2:]))
        return out, (True, True, True)

    return op


@functools.cache
def _bwd_op(cfg: _Config, has_dh: bool):
    partitioned = _partitioned_bwd(cfg, has_dh)

    @custom_vmap
    def op(operands):
        return partitioned(*operands)

    @op.def_vmap
    def rule(axis_size, in_batched, operands):
        batched = list(in_batched[0])
        dy, x, rstd, weight, dh = _unpack_bwd(cfg, has_dh, operands)
        dy, x, rstd = _broadcast_unbatched(axis_size, [dy, x, rstd], batched[:3])
        if has_dh:
            (dh,) = _broadcast_unbatched(axis_size, [dh], batched[-1:])
        weight_batched = cfg.has_weight and batched[3]
        if weight_batched:
            ref = functools.partial(_reference_bwd, cfg)
            dx, dw = jax.vmap(ref)(dy, x, rstd, weight, dh)
        else:
            # The kernel treats the batch as more rows; its dweight would sum over the batch,
            # so the per-example dweight comes from XLA.
            fixed = [dy, x, rstd] + ([weight] if cfg.has_weight else []) + ([dh] if has_dh else [])
            dx = op(tuple(fixed))[0]
            dw = None
            if cfg.has_weight:
                _, dw = _reference_bwd(
                    cfg, dy, x, rstd, weight, None, reduce_axes=tuple(range(1, x.ndim - 1))
                )
        outs = (dx,) if dw is None else (dx, dw)
        return outs, (True,) * len(outs)

    return op


# -------------------------------------------------------------------------------------------------
# Autodiff.


def _rows(x: jax.Array) -> int:
    return int(np.prod(x.shape[:-1], dtype=np.int64))


def _fwd_apply(cfg: _Config, x, weight):
    if _rows(x) == 0:
        return jnp.zeros_like(x), jnp.zeros(x.shape[:-1], jnp.float32)
    operands = (x, weight) if cfg.has_weight else (x,)
    return _fwd_op(cfg)(operands)


def _add_fwd_apply(cfg: _Config, x, residual, weight):
    if _rows(x) == 0:
        return jnp.zeros_like(x), jnp.zeros_like(x), jnp.zeros(x.shape[:-1], jnp.float32)
    operands = (x, residual, weight) if cfg.has_weight else (x, residual)
    return _add_fwd_op(cfg)(operands)


def _bwd_apply(cfg: _Config, dy, x, rstd, weight, dh):
    if _rows(x) == 0:
        dx = jnp.zeros_like(x) if dh is None else dh
        dw = None if weight is None else jnp.zeros(weight.shape, weight.dtype)
        return dx, dw
    operands = (
        (dy, x, rstd) + ((weight,) if cfg.has_weight else ()) + ((dh,) if dh is not None else ())
    )
    outs = _bwd_op(cfg, dh is not None)(operands)
    dw = outs[1].astype(weight.dtype) if cfg.has_weight else None
    return outs[0], dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rms_norm(cfg: _Config, x, weight):
    return _fwd_apply(cfg, x, weight)[0]


def _rms_norm_fwd(cfg: _Config, x, weight):
    y, rstd = _fwd_apply(cfg, x, weight)
    return y, (x, weight, rstd)


def _rms_norm_bwd(cfg: _Config, residuals, dy):
    x, weight, rstd = residuals
    dx, dw = _bwd_apply(cfg, dy, x, rstd, weight, None)
    return cotangent_like(dx, x), cotangent_like(dw, weight)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _add_rms_norm(cfg: _Config, x, residual, weight):
    y, h, _ = _add_fwd_apply(cfg, x, residual, weight)
    return y, h


def _add_rms_norm_fwd(cfg: _Config, x, residual, weight):
    y, h, rstd = _add_fwd_apply(cfg, x, residual, weight)
    # Empty arrays that carry the shard_map varying axes of x and residual, for the cotangents.
    markers = tuple(vary_like(jnp.zeros((0,), jnp.float32), v) for v in (x, residual))
    return (y, h), (h, weight, rstd, markers)


def _add_rms_norm_bwd(cfg: _Config, residuals, cotangents):
    h, weight, rstd, (x_marker, residual_marker) = residuals
    dy, dh = cotangents
    dx, dw = _bwd_apply(cfg, dy, h, rstd, weight, dh)
    return (
        cotangent_like(dx, x_marker),
        cotangent_like(dx, residual_marker),
        cotangent_like(dw, weight),
    )


_add_rms_norm.defvjp(_add_rms_norm_fwd, _add_rms_norm_bwd)


# -------------------------------------------------------------------------------------------------
# Public API.


def _validate(op: str, x, weight, eps, zero_centered_weight) -> tuple[jax.Array, Any, _Config]:
    x = _checks.check_array(op, "x", x, min_rank=1)
    if x.shape[-1] < 1:
        raise ValueError(f"{op}: the last axis of x (hidden) must be >= 1, got shape {x.shape}")
    if weight is not None:
        weight = _checks.check_array(op, "weight", weight)
        if tuple(weight.shape) != (x.shape[-1],):
            raise ValueError(
                f"{op}: weight must have shape ({x.shape[-1]},) to match the last axis of x, "
                f"got {tuple(weight.shape)}"
            )
    cfg = _Config(
        eps=_checks.check_positive_float(op, "eps", eps),
        zero_centered=_checks.check_bool(op, "zero_centered_weight", zero_centered_weight),
        has_weight=weight is not None,
    )
    return x, weight, cfg


def rms_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    zero_centered_weight: bool = False,
    impl: str | None = None,
) -> jax.Array:
    """Root-mean-square normalization over the last axis.

    ``y = x * rsqrt(mean(x**2, axis=-1) + eps) * w`` where ``w = weight``, ``1 + weight`` when
    `zero_centered_weight`, or 1 without a weight. All arithmetic is in float32.

    Args:
      x: ``[..., hidden]`` float32, bfloat16 or float16, rank >= 1, ``hidden >= 1``; any number
        of rows (including zero).
      weight: ``[hidden]`` float32, bfloat16 or float16 (independent of x's dtype), or None.
      eps: added to the mean square; a static, finite number > 0.
      zero_centered_weight: scale by ``1 + weight`` (weights stored around zero).
      impl: None for the custom call (the pure-JAX twin where no kernel exists for the platform),
        ``"ffi"`` to require the custom call, ``"xla"`` for the pure-JAX twin. The global switch
        (``jaxops.set_default_impl("xla")`` or ``JAXOPS_IMPL=xla``) forces the twin everywhere.

    Returns:
      ``y`` with x's shape and dtype.

    Raises:
      TypeError: x or weight has an unsupported dtype, eps is not a number or is traced.
      ValueError: x has rank 0 or an empty last axis, weight's shape is not ``(hidden,)``,
        eps is not finite and > 0, or impl is unknown.

    Sharding: under jit, leading axes sharded over any mesh axes run without a collective; a
    sharded hidden axis all-reduces only the per-row sum of squares. The backward pass
    all-reduces dweight over the mesh axes that shard the rows.

    Example:
      >>> import jax, jax.numpy as jnp, jaxops
      >>> x = jnp.arange(8.0).reshape(2, 4)
      >>> y = jax.jit(jaxops.rms_norm)(x, jnp.ones(4))
      >>> bool(jnp.allclose(y, jaxops.rms_norm(x, jnp.ones(4), impl="xla")))
      True
    """
    x, weight, cfg = _validate("rms_norm", x, weight, eps, zero_centered_weight)
    if not _ffi.use_kernel(impl):
        return _reference_fwd(cfg, x, weight)[0]
    return _rms_norm(cfg, x, weight)


def add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    zero_centered_weight: bool = False,
    impl: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Residual add fused with RMSNorm: ``h = x + residual``, ``y = rms_norm(h)``.

    The kernel reads x and residual once and writes h and y in one pass. h is rounded to x's
    dtype before it is normalized, so ``y == rms_norm(h)`` exactly as the unfused code computes.

    Args:
      x: ``[..., hidden]`` float32, bfloat16 or float16, rank >= 1.
      residual: same shape and dtype as x.
      weight: ``[hidden]`` float32, bfloat16 or float16, or None.
      eps: as in :func:`rms_norm`.
      zero_centered_weight: as in :func:`rms_norm`.
      impl: as in :func:`rms_norm`.

    Returns:
      ``(y, h)``, both with x's shape and dtype; h is the new residual stream.

    Raises:
      TypeError: as in :func:`rms_norm`, or residual's dtype differs from x's.
      ValueError: as in :func:`rms_norm`, or residual's shape differs from x's.

    Example:
      >>> import jax.numpy as jnp, jaxops
      >>> x, r = jnp.ones((2, 4)), jnp.full((2, 4), 2.0)
      >>> y, h = jaxops.add_rms_norm(x, r)
      >>> float(h[0, 0]), round(float(y[0, 0]), 4)
      (3.0, 1.0)
    """
    x, weight, cfg = _validate("add_rms_norm", x, weight, eps, zero_centered_weight)
    residual = _checks.check_array("add_rms_norm", "residual", residual)
    if residual.dtype != x.dtype:
        raise TypeError(
            f"add_rms_norm: residual must have x's dtype {_checks.dtype_name(x.dtype)}, "
            f"got {_checks.dtype_name(residual.dtype)}"
        )
    if residual.shape != x.shape:
        raise ValueError(
            f"add_rms_norm: residual must have x's shape {tuple(x.shape)}, "
            f"got {tuple(residual.shape)}"
        )
    if not _ffi.use_kernel(impl):
        return add_rms_norm_reference(
            x, residual, weight, eps=cfg.eps, zero_centered_weight=cfg.zero_centered
        )
    return _add_rms_norm(cfg, x, residual, weight)
