"""quantize, quantize_reference and fake_quant: validation, kernel or twin, vmap."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops import _checks, _ffi
from jaxops._config import check_impl
from jaxops._errors import ArgumentTypeError, InvalidArgumentError
from jaxops._fp8.partition import (
    _explicit_mesh,
    _partitioned_amax,
    _partitioned_quantize,
    _x_entries,
)
from jaxops._fp8.scales import (
    _GROUPS,
    _MIN_AMAX_FLOOR,
    AMAX_FLOOR,
    FP8_DTYPES,
    QuantizedArray,
    ScaleLayout,
    _Config,
    _finite_abs,
    _reference_blocked,
    _reference_tensor,
    _scale_shapes,
    _transposed_shape,
    dequantize,
    scale_from_amax,
)
from jaxops._sharding import padded_spec, result_sharding


def _wrap(cfg: _Config, data, scale, data_t, scale_t):
    q = QuantizedArray(data, scale, cfg.block, False, cfg.layout)
    if not cfg.transpose:
        return q
    t_scale = scale if cfg.mode == "tensor" else scale_t
    t_block = cfg.block  # in data_t's coordinates: (1, G) groups run along M, tiles stay tiles
    return q, QuantizedArray(data_t, t_scale, t_block, True, cfg.layout)


def _quantize_empty(cfg: _Config, x: jax.Array, scale: jax.Array | None):
    scale_shape, scale_t_shape = _scale_shapes(cfg, tuple(x.shape))
    if cfg.mode == "tensor":
        s = (
            scale
            if scale is not None
            else scale_from_amax(
                jnp.float32(0), cfg.dtype, pow2_scale=cfg.pow2_scale, amax_floor=cfg.amax_floor
            )
        )
        scale_out, scale_t_out = s, None
    else:
        scale_out = jnp.zeros(scale_shape, jnp.float32)
        scale_t_out = jnp.zeros(scale_t_shape, jnp.float32) if cfg.transpose else None
    data = jnp.zeros(x.shape, cfg.dtype)
    data_t = jnp.zeros(_transposed_shape(tuple(x.shape)), cfg.dtype) if cfg.transpose else None
    return data, scale_out, data_t, scale_t_out, jnp.float32(0)


def _quantize_apply(cfg: _Config, x: jax.Array, scale: jax.Array | None, use_kernel: bool):
    """(data, scale, data_t, scale_t, amax); `scale` is the given per-tensor scale, if any."""
    per_tensor = cfg.mode == "tensor"
    if x.size == 0:
        return _quantize_empty(cfg, x, scale)
    if not use_kernel:
        if not per_tensor:
            return (*_reference_blocked(cfg, x), None)
        amax = jnp.max(_finite_abs(x))
        if scale is None:
            scale = scale_from_amax(
                amax, cfg.dtype, pow2_scale=cfg.pow2_scale, amax_floor=cfg.amax_floor
            )
        data, data_t, amax = _reference_tensor(cfg, x, scale)
        return data, scale, data_t, None, amax
    operands = (x,) if scale is None else (x, jnp.asarray(scale, jnp.float32))
    return cfg.present(_quantize_op(cfg, tuple(x.shape), scale is not None)(operands))


def _kernel_path(cfg: _Config, x: jax.Array, scale: jax.Array | None):
    """The five results (absent ones as empty arrays) from the custom calls."""
    if cfg.mode == "tensor" and scale is None:
        amax = _partitioned_amax(x.ndim)(x)
        scale = scale_from_amax(
            amax, cfg.dtype, pow2_scale=cfg.pow2_scale, amax_floor=cfg.amax_floor
        )
    mesh = _explicit_mesh(x) if result_sharding(x) is not None else None
    if mesh is not None:
        # Shards that would split blocks: gather that axis explicitly (documented), so the
        # partitioner only ever sees block-aligned shards.
        arg = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.typeof(x).sharding)
        aligned = _x_entries(cfg, mesh, arg)
        if aligned != padded_spec(arg.sharding, x.ndim):
            x = jax.sharding.reshard(x, NamedSharding(mesh, P(*aligned)))
    operands = (x, scale) if cfg.mode == "tensor" else (x,)
    return _partitioned_quantize(cfg, tuple(x.shape))(*operands)


def _twin_filled(cfg: _Config, x: jax.Array, scale: jax.Array | None):
    outs = _quantize_apply(cfg, x, scale, use_kernel=False)
    dtypes = (cfg.dtype, jnp.float32, cfg.dtype, jnp.float32, jnp.float32)
    return tuple(
        jnp.zeros((0,), d) if absent else o
        for o, d, absent in zip(outs, dtypes, cfg.absent, strict=True)
    )


@functools.cache
def _quantize_op(cfg: _Config, shape: tuple[int, ...], given_scale: bool):
    """The kernel path under ``custom_vmap``.

    vmap of a blocked quantization folds the batch into x's leading (batch) axes; per-tensor
    scaling under vmap is per example (the twin).
    """

    @custom_vmap
    def op(operands):
        return _kernel_path(cfg, operands[0], operands[1] if given_scale else None)

    @op.def_vmap
    def rule(axis_size, in_batched, operands):
        batched = list(in_batched[0])
        x = operands[0]
        if not batched[0]:
            x = jnp.broadcast_to(x, (axis_size, *x.shape))
        if cfg.mode != "tensor":
            outs = _quantize_op(cfg, tuple(x.shape), False)((x,))
            outs = tuple(
                jnp.zeros((axis_size, 0), o.dtype) if absent else o
                for o, absent in zip(outs, cfg.absent, strict=True)
            )
        elif given_scale:
            scale = operands[1] if batched[1] else jnp.broadcast_to(operands[1], (axis_size,))
            outs = jax.vmap(functools.partial(_twin_filled, cfg))(x, scale)
        else:
            outs = jax.vmap(lambda xi: _twin_filled(cfg, xi, None))(x)
        return outs, (True,) * 5

    return op


def _check_dtype(op: str, dtype: Any) -> np.dtype:
    try:
        d = np.dtype(dtype)
    except TypeError:
        raise ArgumentTypeError(
            f"{op}: dtype must be float8_e4m3fn or float8_e5m2, got {dtype!r}"
        ) from None
    if d not in FP8_DTYPES:
        raise ArgumentTypeError(f"{op}: dtype must be float8_e4m3fn or float8_e5m2, got {d.name}")
    return d


def _check_group(op: str, name: str, g: Any) -> int:
    if isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, np.integer)) or g not in _GROUPS:
        raise InvalidArgumentError(f"{op}: {name} must use G in {_GROUPS}, got {g!r}")
    return int(g)


def _check_block(op: str, block: Any) -> tuple[str, int]:
    if block is None:
        return "tensor", 128
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise InvalidArgumentError(f"{op}: block must be None, (1, G) or (G, G), got {block!r}")
    rows, g = block
    g = _check_group(op, "block", g)
    if rows == 1:
        return "rows", g
    if rows == g:
        return "tiles", g
    raise InvalidArgumentError(
        f"{op}: block must be None, (1, G) or (G, G) with G in {_GROUPS}, got {block!r}"
    )


def _check_amax_floor(op: str, value: Any) -> float:
    floor = _checks.check_positive_float(op, "amax_floor", value)
    if floor < _MIN_AMAX_FLOOR:
        raise InvalidArgumentError(f"{op}: amax_floor must be >= {_MIN_AMAX_FLOOR}, got {value!r}")
    return floor


def _make_config(op, x, dtype, block, pow2_scale, transpose, scale_layout, amax_floor):
    x = _checks.check_array(op, "x", x, min_rank=1)
    mode, g = _check_block(op, block)
    transpose = _checks.check_bool(op, "transpose", transpose)
    if scale_layout not in ("row", "col_tma"):
        raise InvalidArgumentError(
            f"{op}: scale_layout must be 'row' or 'col_tma', got {scale_layout!r}"
        )
    col_tma = scale_layout == "col_tma"
    if col_tma and mode == "tensor":
        raise InvalidArgumentError(f"{op}: scale_layout='col_tma' needs a block, got block=None")
    need_2d = mode == "tiles" or transpose or col_tma
    if need_2d and x.ndim < 2:
        what = "block=(G, G)" if mode == "tiles" else ("transpose" if transpose else "col_tma")
        raise InvalidArgumentError(f"{op}: {what} needs x of rank >= 2, got shape {tuple(x.shape)}")
    cfg = _Config(
        dtype=_check_dtype(op, dtype),
        mode=mode,
        group=g,
        transpose=transpose,
        col_tma=col_tma,
        pow2_scale=_checks.check_bool(op, "pow2_scale", pow2_scale),
        amax_floor=_check_amax_floor(op, amax_floor),
    )
    return x, cfg


def quantize(
    x: jax.Array,
    *,
    dtype: Any = jnp.float8_e4m3fn,
    block: tuple[int, int] | None = (1, 128),
    pow2_scale: bool = False,
    transpose: bool = False,
    scale_layout: ScaleLayout = "row",
    amax_floor: float = AMAX_FLOOR,
    impl: str | None = None,
) -> QuantizedArray | tuple[QuantizedArray, QuantizedArray]:
    """Quantizes x to FP8 with float32 block scales (per-tensor, 1 x G or G x G).

    Per block: ``scale = max(amax, amax_floor) / max_finite(dtype)`` with amax the largest
    finite ``|x|`` of the block (rounded up to a power of two with `pow2_scale`), and
    ``data = float8(x / scale)`` rounded to nearest even, saturating at ``+-max_finite``
    (+-Inf included); NaN stays NaN. Partial blocks at the end of an axis take their scale from
    their valid part.

    Blocks and scale shapes, for x of shape ``[..., M, K]`` (``MG = ceil(M/G)``,
    ``KG = ceil(K/G)``, ``pad4(n)`` = n rounded up to a multiple of 4)::

      block=(1, G): one scale per row and group of G columns
          x   [ r0: |g0 ....|g1 ....|g2 .. ]      scale "row"      [..., M, KG]
              [ r1: |g0 ....|g1 ....|g2 .. ]      scale "col_tma"  [..., KG, pad4(M)]
      block=(G, G): one scale per G x G tile
          x   [ t00 | t01 | t02 ]                  scale "row"      [..., MG, KG]
              [ t10 | t11 | t12 ]                  scale "col_tma"  [..., KG, pad4(MG)]
      block=None: one scale for the whole tensor   scale            []

    ``"col_tma"`` stores the scales column-major (the row index is contiguous) with that index
    padded to a multiple of 4 floats (16 bytes) with zeros: the layout Hopper block-scaled GEMMs
    (DeepGEMM-style TMA loads) consume for the LHS.

    With ``transpose=True`` one pass over x also produces the quantized ``xᵀ`` — data
    ``[..., K, M]`` quantized in blocks along its own last axis (for (1, G): G consecutive rows of
    x share a scale; scales ``[..., K, MG]``, or ``[..., MG, pad4(K)]`` for col_tma) — the pair a
    backward wgrad GEMM needs. For (G, G) and per-tensor, ``q_t.data`` is exactly
    ``swapaxes(q.data)``.

    Args:
      x: float32, bfloat16 or float16 array, rank >= 1 (>= 2 for (G, G) blocks, transpose and
        col_tma). Leading axes are batch axes.
      dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
      block: None, ``(1, G)`` or ``(G, G)``, G in (32, 64, 128).
      pow2_scale: round scales up to powers of two (UE8M0-compatible).
      transpose: also return the quantized transpose.
      scale_layout: ``"row"`` or ``"col_tma"`` (blocks only).
      amax_floor: lower bound of amax (>= 1e-30); the default 1e-4 quantizes all-zero blocks
        exactly. Lower it for tensors of tiny magnitude (gradients).
      impl: None (global default), ``"ffi"`` or ``"xla"`` (the pure-JAX twin).

    Returns:
      A :class:`QuantizedArray`, or ``(q, q_t)`` with ``transpose=True`` (``q_t.transposed``).

    Raises:
      TypeError: x is not a float32/bfloat16/float16 array, or dtype is not an FP8 dtype.
      ValueError: unsupported block / G / scale_layout, or x's rank too low for the request.

    Example:
      >>> import jax, jax.numpy as jnp, jaxops
      >>> x = jax.random.normal(jax.random.key(0), (256, 512), jnp.bfloat16)
      >>> q, q_t = jaxops.fp8.quantize(x, block=(1, 128), transpose=True)
      >>> q.data.dtype, q.scale.shape, q_t.data.shape, q_t.scale.shape
      (dtype(float8_e4m3fn), (256, 4), (512, 256), (512, 2))
    """
    op = "jaxops.fp8.quantize"
    x, cfg = _make_config(op, x, dtype, block, pow2_scale, transpose, scale_layout, amax_floor)
    use_kernel = _ffi.use_kernel(check_impl(op, impl), op)
    data, scale, data_t, scale_t, _ = _quantize_apply(cfg, x, None, use_kernel)
    return _wrap(cfg, data, scale, data_t, scale_t)


def quantize_reference(
    x: jax.Array, **kwargs: Any
) -> QuantizedArray | tuple[QuantizedArray, QuantizedArray]:
    """The pure-JAX twin of :func:`quantize`: its arguments but `impl`, the same bits."""
    return quantize(x, impl="xla", **kwargs)


_checks.twin_signature(quantize_reference, quantize)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fake_quant(cfg: _Config, use_kernel: bool, x):
    data, scale, _, _, _ = _quantize_apply(cfg, x, None, use_kernel)
    return dequantize(QuantizedArray(data, scale, cfg.block, False, cfg.layout), x.dtype)


def _fake_quant_fwd(cfg, use_kernel, x):
    return _fake_quant(cfg, use_kernel, x), None


def _fake_quant_bwd(cfg, use_kernel, _, g):
    return (g,)


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def fake_quant(
    x: jax.Array,
    *,
    dtype: Any = jnp.float8_e4m3fn,
    block: tuple[int, int] | None = (1, 128),
    pow2_scale: bool = False,
    amax_floor: float = AMAX_FLOOR,
    impl: str | None = None,
) -> jax.Array:
    """``dequantize(quantize(x))`` in x's dtype, with a straight-through gradient (QAT).

    The forward pass is exactly the FP8 rounding :func:`quantize` applies; the backward pass
    passes the cotangent through unchanged (the straight-through estimator), including for
    values that saturated.

    Args:
      x: float32, bfloat16 or float16 array (see :func:`quantize` for ranks).
      dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
      block: None, ``(1, G)`` or ``(G, G)``, G in (32, 64, 128).
      pow2_scale: round scales up to powers of two.
      amax_floor: lower bound of each block's amax.
      impl: None (global default), ``"ffi"`` or ``"xla"``.

    Returns:
      An array of x's shape and dtype.

    Example:
      >>> import jax, jax.numpy as jnp, jaxops
      >>> x = jnp.linspace(-2, 2, 128).reshape(1, 128)
      >>> g = jax.grad(lambda x: jaxops.fp8.fake_quant(x).sum())(x)
      >>> bool((g == 1).all())
      True
    """
    op = "jaxops.fp8.fake_quant"
    x, cfg = _make_config(op, x, dtype, block, pow2_scale, False, "row", amax_floor)
    return _fake_quant(cfg, _ffi.use_kernel(check_impl(op, impl), op), x)
