"""FP8 quantization as XLA FFI custom calls, with pure-JAX twins. Public API: :mod:`jaxops.fp8`.

The algorithm, per block (a 1 x G group along the last axis, a G x G tile over the last two axes,
or the whole tensor):

- ``amax = max |x|`` over the block's finite values (NaN and +-Inf do not count);
- ``scale = max(amax, amax_floor) / max_finite(dtype)`` in float32, rounded up to a power of two
  with ``pow2_scale`` (a UE8M0 exponent);
- ``data = float8(x / scale)``: float32 division, then round to nearest even; values beyond the
  format (and +-Inf) saturate to +-max_finite, NaN stays NaN.

``x ~= data * scale``. The custom calls and the twins produce identical bits.

Layers, from the public functions down: validation and choice of implementation;
``custom_partitioning`` with Shardy rules (block-aligned shards stay local); ``jax.ffi.ffi_call``
of the targets below, for CPU and CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops import _checks, _ffi
from jaxops._sharding import axes_of, padded_spec, result_sharding

__all__ = [
    "AMAX_FLOOR",
    "TARGET_AMAX",
    "TARGET_QUANTIZE",
    "TARGET_SPLIT_TRANSPOSE",
    "DelayedScaling",
    "Fp8Meta",
    "QuantizedArray",
    "SplitQuantized",
    "dequantize",
    "fake_quant",
    "init_fp8_meta",
    "max_finite",
    "quantize",
    "quantize_delayed",
    "quantize_reference",
    "quantize_split_transpose",
    "quantize_split_transpose_reference",
    "scale_from_amax",
    "scale_from_amax_history",
    "update_fp8_meta",
]

TARGET_QUANTIZE = "jaxops_fp8_quantize"
TARGET_AMAX = "jaxops_fp8_amax"
TARGET_SPLIT_TRANSPOSE = "jaxops_fp8_quantize_split_transpose"

#: Default lower bound of a block's amax (DeepGEMM's value): an all-zero block gets scale
#: ``1e-4 / max_finite`` and quantizes to exact zeros.
AMAX_FLOOR = 1e-4
_MIN_AMAX_FLOOR = 1e-30  # keeps every scale a normal float32
_GROUPS = (32, 64, 128)
_TMA_ALIGN = 4  # col_tma scales: rows padded to a multiple of 4 floats (16 bytes)
_SPLIT_COLUMN_ALIGN = 16  # quantize_split_transpose: experts start at multiples of 16 columns
_BLOCK_MODE = {"tensor": 0, "rows": 1, "tiles": 2}

FP8_DTYPES: tuple[np.dtype, ...] = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
ScaleLayout = Literal["row", "col_tma"]


def max_finite(dtype: Any) -> float:
    """Largest finite value of an FP8 dtype: 448 for float8_e4m3fn, 57344 for float8_e5m2."""
    return float(jnp.finfo(dtype).max)


# -------------------------------------------------------------------------------------------------
# QuantizedArray.


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """An FP8 array with float32 dequantization scales: ``x ~= data * scale`` over blocks.

    Attributes:
      data: float8 array. Holds x itself, or xᵀ (last two axes swapped) when ``transposed``.
      scale: float32 multipliers, one per block of ``data``; their layout is ``scale_layout``
        (see :func:`quantize`). Per-tensor scaling: shape ``()``.
      block: ``(1, G)``, ``(G, G)`` or None (per-tensor), in ``data``'s coordinates.
      transposed: whether ``data`` holds the transpose of the logical array.
      scale_layout: ``"row"`` or ``"col_tma"``.

    The logical shape (:attr:`shape`) is ``data``'s, with the last two axes swapped back when
    ``transposed``. A QuantizedArray is a pytree (``data`` and ``scale`` are its leaves), so it
    goes through ``jit``, ``vmap`` (over leading batch axes) and ``custom_vjp`` residuals.

    Example:
      >>> import jax.numpy as jnp, jaxops
      >>> q = jaxops.fp8.quantize(jnp.ones((4, 256)))
      >>> q.shape, q.scale.shape, q.dequantize(jnp.float32)[0, 0]
      ((4, 256), (4, 2), Array(1., dtype=float32))
    """

    data: jax.Array
    scale: jax.Array
    block: tuple[int, int] | None = (1, 128)
    transposed: bool = False
    scale_layout: ScaleLayout = "row"

    def tree_flatten(self):
        return (self.data, self.scale), (self.block, self.transposed, self.scale_layout)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], children[1], *aux)

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.data.shape)
        return (*shape[:-2], shape[-1], shape[-2]) if self.transposed else shape

    @property
    def dtype(self) -> np.dtype:
        """The FP8 dtype of ``data``."""
        return np.dtype(self.data.dtype)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return int(self.data.size)

    def dequantize(self, dtype: Any = jnp.bfloat16) -> jax.Array:
        """``data * scale`` in `dtype`, with the logical shape (see :func:`dequantize`)."""
        return dequantize(self, dtype)


def _expand_scale(q: QuantizedArray) -> jax.Array:
    """The scale of every element of ``q.data`` (float32, data's shape)."""
    data, scale = q.data, q.scale
    if q.block is None:
        return jnp.broadcast_to(
            scale.reshape(scale.shape + (1,) * (data.ndim - scale.ndim)), data.shape
        )
    rows_block, g = q.block
    rows, cols = (data.shape[-2], data.shape[-1]) if data.ndim >= 2 else (1, data.shape[-1])
    grid_rows = -(-rows // rows_block)
    if q.scale_layout == "col_tma":
        scale = jnp.swapaxes(scale, -1, -2)[..., :grid_rows, :]
    if data.ndim == 1:
        return jnp.repeat(scale, g, axis=-1)[..., :cols]
    scale = jnp.repeat(scale, g, axis=-1)[..., :cols]
    return jnp.repeat(scale, rows_block, axis=-2)[..., :rows, :]


def dequantize(q: QuantizedArray, dtype: Any = jnp.bfloat16) -> jax.Array:
    """Dequantizes: ``data * scale`` broadcast over the blocks, in `dtype`, logical shape.

    Plain jnp on purpose: XLA fuses it into the consumer (a GEMM prologue or an elementwise op),
    which a custom call would prevent.

    Args:
      q: a :class:`QuantizedArray`.
      dtype: float32, bfloat16 or float16.

    Returns:
      An array of shape ``q.shape`` (transposed data is transposed back).

    Example:
      >>> import jax.numpy as jnp, jaxops
      >>> x = jnp.linspace(-1, 1, 256).reshape(2, 128)
      >>> err = jnp.abs(jaxops.fp8.dequantize(jaxops.fp8.quantize(x), jnp.float32) - x).max()
      >>> bool(err <= 1 / 16)
      True
    """
    if not isinstance(q, QuantizedArray):
        raise TypeError(f"dequantize: q must be a QuantizedArray, got {type(q).__name__}")
    out_dtype = np.dtype(dtype)
    if out_dtype not in _checks.FLOAT_DTYPES:
        names = ", ".join(_checks.dtype_name(d) for d in _checks.FLOAT_DTYPES)
        raise TypeError(f"dequantize: dtype must be one of {names}; got {out_dtype.name}")
    y = (q.data.astype(jnp.float32) * _expand_scale(q)).astype(out_dtype)
    return jnp.swapaxes(y, -1, -2) if q.transposed else y


# -------------------------------------------------------------------------------------------------
# Configuration.


@dataclasses.dataclass(frozen=True)
class _Config:
    dtype: np.dtype
    mode: str  # "tensor" | "rows" | "tiles"
    group: int
    transpose: bool
    col_tma: bool
    pow2_scale: bool
    amax_floor: float

    @property
    def block(self) -> tuple[int, int] | None:
        if self.mode == "tensor":
            return None
        return (1, self.group) if self.mode == "rows" else (self.group, self.group)

    @property
    def layout(self) -> ScaleLayout:
        return "col_tma" if self.col_tma else "row"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil(a, b) * b


def _grids(cfg: _Config, shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(rows, cols) of the scale grids of data and of data_t, per batch entry."""
    k = shape[-1]
    m = shape[-2] if len(shape) >= 2 else 1
    mg, kg = _ceil(m, cfg.group), _ceil(k, cfg.group)
    if cfg.mode == "rows":
        return (m, kg), (k, mg)
    return (mg, kg), (kg, mg)


def _grid_shape(cfg: _Config, lead: tuple[int, ...], grid: tuple[int, int], rank1: bool):
    rows, cols = grid
    if cfg.col_tma:
        return (*lead, cols, _round_up(rows, _TMA_ALIGN))
    return lead + ((cols,) if rank1 else (rows, cols))


def _scale_shapes(cfg: _Config, shape: tuple[int, ...]):
    """Shapes of scale and scale_t (None without transpose) for x of `shape`."""
    if cfg.mode == "tensor":
        return (), None
    grid, grid_t = _grids(cfg, shape)
    lead = tuple(shape[:-2])
    scale = _grid_shape(cfg, lead, grid, len(shape) == 1)
    scale_t = _grid_shape(cfg, lead, grid_t, False) if cfg.transpose else None
    return scale, scale_t


def _transposed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*tuple(shape[:-2]), shape[-1], shape[-2])


# -------------------------------------------------------------------------------------------------
# Pure-JAX twins: the test oracle and the impl="xla" path.


def _finite_abs(x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return jnp.where(jnp.isfinite(x32), jnp.abs(x32), jnp.float32(0))


def scale_from_amax(
    amax: jax.Array,
    dtype: Any = jnp.float8_e4m3fn,
    *,
    pow2_scale: bool = False,
    amax_floor: float = AMAX_FLOOR,
) -> jax.Array:
    """The dequantization scale of blocks whose finite amax is `amax` (float32, any shape).

    ``max(amax, amax_floor) / max_finite(dtype)``, rounded up to a power of two with
    `pow2_scale`. Bit-identical to the kernels' computation.

    Example:
      >>> import jax.numpy as jnp, jaxops
      >>> float(jaxops.fp8.scale_from_amax(jnp.float32(448.0)))
      1.0
    """
    amax = jnp.asarray(amax, jnp.float32)
    divisor = _no_reciprocal(jnp.float32(max_finite(dtype)), amax)
    scale = jnp.maximum(amax, np.float32(amax_floor)) / divisor
    if not pow2_scale:
        return scale
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    bumped = (bits & np.uint32(0xFF800000)) + np.uint32(0x00800000)
    bits = jnp.where((bits & np.uint32(0x007FFFFF)) != 0, bumped, bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _no_reciprocal(divisor: jax.Array, finite_like: jax.Array) -> jax.Array:
    """`divisor` broadcast to `finite_like`'s shape, in a form XLA keeps as a divisor.

    XLA rewrites ``a / broadcast(b)`` into ``a * broadcast(1 / b)``, which is off by one ulp for
    some ``a``; the kernels divide exactly. ``finite_like * 0 + divisor`` (exact for finite
    values, which XLA does not fold for floats) keeps the division elementwise and correctly
    rounded, also under vmap, without materializing anything.
    """
    return finite_like * np.float32(0) + divisor


def _encode(x32: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
    limit = np.float32(max_finite(dtype))
    return jnp.clip(x32 / scale, -limit, limit).astype(dtype)


def _block_amax_rows(a: jax.Array, g: int) -> jax.Array:
    """[..., K] -> [..., ceil(K/G)] max over groups of G along the last axis (a >= 0)."""
    k = a.shape[-1]
    pad = _round_up(k, g) - k
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    return a.reshape((*a.shape[:-1], a.shape[-1] // g, g)).max(axis=-1)


def _to_layout(cfg: _Config, grid: jax.Array, rank1: bool) -> jax.Array:
    """A [..., rows, cols] grid in cfg's layout."""
    if rank1:
        grid = grid[0]
    if not cfg.col_tma:
        return grid
    t = jnp.swapaxes(grid, -1, -2)
    pad = _round_up(t.shape[-1], _TMA_ALIGN) - t.shape[-1]
    return jnp.pad(t, [(0, 0)] * (t.ndim - 1) + [(0, pad)])


def _reference_blocked(cfg: _Config, x: jax.Array):
    """Rows / tiles mode twin: (data, scale, data_t, scale_t)."""
    rank1 = x.ndim == 1
    x3 = x[None] if rank1 else x
    x32 = x3.astype(jnp.float32)
    a = _finite_abs(x3)
    g = cfg.group
    params = {"dtype": cfg.dtype, "pow2_scale": cfg.pow2_scale, "amax_floor": cfg.amax_floor}
    m, k = x3.shape[-2], x3.shape[-1]
    if cfg.mode == "rows":
        scale = scale_from_amax(_block_amax_rows(a, g), **params)  # [..., M, KG]
        full = jnp.repeat(scale, g, axis=-1)[..., :k]
        data = _encode(x32, full, cfg.dtype)
        data_t = scale_t = None
        if cfg.transpose:
            at = jnp.swapaxes(a, -1, -2)
            scale_t = scale_from_amax(_block_amax_rows(at, g), **params)  # [..., K, MG]
            full_t = jnp.repeat(scale_t, g, axis=-1)[..., :m]
            data_t = _encode(jnp.swapaxes(x32, -1, -2), full_t, cfg.dtype)
    else:
        row_max = _block_amax_rows(a, g)  # [..., M, KG]
        tile = _block_amax_rows(jnp.swapaxes(row_max, -1, -2), g)  # [..., KG, MG]
        scale_t = scale_from_amax(tile, **params)
        scale = jnp.swapaxes(scale_t, -1, -2)  # [..., MG, KG]
        full = jnp.repeat(jnp.repeat(scale, g, axis=-1)[..., :k], g, axis=-2)[..., :m, :]
        data = _encode(x32, full, cfg.dtype)
        data_t = jnp.swapaxes(data, -1, -2) if cfg.transpose else None
        scale_t = scale_t if cfg.transpose else None
    data = data[0] if rank1 else data
    scale = _to_layout(cfg, scale, rank1)
    if scale_t is not None:
        scale_t = _to_layout(cfg, scale_t, False)
    return data, scale, data_t, scale_t


def _reference_tensor(cfg: _Config, x: jax.Array, scale: jax.Array):
    """Per-tensor twin with a given scale: (data, data_t, amax)."""
    amax = jnp.max(_finite_abs(x), initial=np.float32(0))
    data = _encode(x.astype(jnp.float32), _no_reciprocal(scale, _finite_abs(x)), cfg.dtype)
    data_t = jnp.swapaxes(data, -1, -2) if cfg.transpose else None
    return data, data_t, amax


# -------------------------------------------------------------------------------------------------
# FFI calls (one shard).


def _quantize_ffi(cfg: _Config, x: jax.Array, scale_in: jax.Array | None):
    """(data, scale, data_t | None, scale_t | None, amax | None) from the quantize kernel."""
    shape = tuple(x.shape)
    scale_shape, scale_t_shape = _scale_shapes(cfg, shape)
    per_tensor = cfg.mode == "tensor"
    sh = _typed_shardings(cfg, x)
    out_types = (
        jax.ShapeDtypeStruct(shape, cfg.dtype, sharding=sh[0]),
        jax.ShapeDtypeStruct(scale_shape, jnp.float32, sharding=sh[1]),
        jax.ShapeDtypeStruct(
            _transposed_shape(shape) if cfg.transpose else (0,), cfg.dtype, sharding=sh[2]
        ),
        jax.ShapeDtypeStruct(
            scale_t_shape if scale_t_shape is not None else (0,), jnp.float32, sharding=sh[3]
        ),
        jax.ShapeDtypeStruct(() if per_tensor else (0,), jnp.float32, sharding=sh[4]),
    )
    data, scale, data_t, scale_t, amax = _ffi.ffi_call(
        TARGET_QUANTIZE,
        out_types,
        x,
        jnp.reshape(scale_in, (1,)) if per_tensor else jnp.zeros((0,), jnp.float32),
        block_mode=np.int32(_BLOCK_MODE[cfg.mode]),
        group=np.int32(cfg.group),
        transpose=cfg.transpose,
        col_tma=cfg.col_tma,
        pow2_scale=cfg.pow2_scale,
        amax_floor=np.float32(cfg.amax_floor),
    )
    return (
        data,
        scale,
        data_t if cfg.transpose else None,
        scale_t if (cfg.transpose and not per_tensor) else None,
        amax if per_tensor else None,
    )


def _explicit_mesh(x: jax.Array):
    """The mesh of x's type when x is sharded over explicit axes (result types need shardings)."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    return None if mesh is None or getattr(mesh, "empty", True) else mesh


def _typed_shardings(cfg: _Config, x: jax.Array) -> list:
    """Shardings of the five quantize results' types (None outside explicit sharding)."""
    mesh = _explicit_mesh(x)
    if mesh is None or result_sharding(x) is None:
        return [None] * 5
    arg = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.typeof(x).sharding)
    specs = _out_specs(cfg, _x_entries(cfg, mesh, arg), x.ndim)
    return [NamedSharding(mesh, P(*spec)) for spec in specs]


def _amax_ffi(x: jax.Array) -> jax.Array:
    mesh = _explicit_mesh(x) if result_sharding(x) is not None else None
    sharding = None if mesh is None else NamedSharding(mesh, P())
    return _ffi.ffi_call(TARGET_AMAX, jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding), x)


# -------------------------------------------------------------------------------------------------
# Sharding: custom_partitioning with Shardy rules.
#
# A sharded axis stays local when every shard holds whole blocks: leading (batch) axes always;
# the last two axes when their local size is a multiple of G (and, for col_tma scales, when the
# padded scale rows split evenly too). Per-tensor scaling keeps every axis local and all-reduces
# one float (the amax). Any other sharding of the last two axes is gathered for that axis only.


def _mesh_size(mesh, entry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def _axis_ok(cfg: _Config, mesh, entry, size: int, axis: str) -> bool:
    """Whether the M ("m") or K ("k") axis of x can stay sharded by `entry`."""
    n = _mesh_size(mesh, entry)
    if n == 1:
        return True
    if size % n:
        return False
    local = size // n
    if cfg.mode == "tensor":
        return True
    g = cfg.group
    if axis == "m" and cfg.mode == "rows" and not cfg.transpose:
        return local % _TMA_ALIGN == 0 if cfg.col_tma else True
    if local % g:
        return False
    if cfg.col_tma and (axis == "m" or cfg.transpose):
        # A scale grid padded along this axis must split into equal, unpadded pieces.
        grid_local = local if cfg.mode == "rows" else local // g
        return grid_local % _TMA_ALIGN == 0
    return True


def _x_entries(cfg: _Config, mesh, arg) -> tuple:
    """X's spec with the last two axes unsharded where shards would split blocks."""
    dims = tuple(arg.shape)
    spec = list(padded_spec(arg.sharding, len(dims)))
    if len(dims) >= 2 and not _axis_ok(cfg, mesh, spec[-2], dims[-2], "m"):
        spec[-2] = None
    if not _axis_ok(cfg, mesh, spec[-1], dims[-1], "k"):
        spec[-1] = None
    return tuple(spec)


def _grid_spec(cfg: _Config, lead, row_entry, col_entry, rank1: bool) -> tuple:
    if cfg.col_tma:
        return (*lead, col_entry, row_entry)
    return (*lead, col_entry) if rank1 else (*lead, row_entry, col_entry)


def _out_specs(cfg: _Config, xs: tuple, ndim: int):
    """PartitionSpec entries of (data, scale, data_t, scale_t, amax) for x spec `xs`."""
    lead = xs[:-2] if ndim >= 2 else ()
    m_entry = xs[-2] if ndim >= 2 else None
    k_entry = xs[-1]
    data_t = (*lead, k_entry, m_entry) if cfg.transpose else (None,)
    if cfg.mode == "tensor":
        return xs, (), data_t, (None,), ()
    scale = _grid_spec(cfg, lead, m_entry, k_entry, ndim == 1)
    scale_t = _grid_spec(cfg, lead, k_entry, m_entry, False) if cfg.transpose else (None,)
    return xs, scale, data_t, scale_t, (None,)


def _sharding_rule(cfg: _Config, shape: tuple[int, ...]) -> str:
    """Shardy rule of the quantize call (operands x[, scale_in]; five results).

    x's axes are factors; an axis holding whole blocks is the compound factor (grid, within),
    whose grid factor is shared with the scale axes, so shardings propagate to the scales.
    """
    ndim = len(shape)
    g = cfg.group
    fresh = iter(f"z{i}" for i in range(32))
    lead = [f"b{i}" for i in range(max(0, ndim - 2))]
    m, k = (shape[-2] if ndim >= 2 else 1), shape[-1]
    blocked = cfg.mode != "tensor"
    m_grouped = cfg.mode == "tiles" or (cfg.mode == "rows" and cfg.transpose)
    # A compound factor needs two blocks or more (Shardy refuses a size-1 factor in one); an axis
    # of a single block cannot be split at block granularity anyway.
    x_m = "(mg mq)" if (m_grouped and m % g == 0 and m > g) else "m"
    x_k = "(kg kq)" if (blocked and k % g == 0 and k > g) else "k"
    m_grid = "mg" if x_m != "m" else next(fresh)
    k_grid = "kg" if x_k != "k" else next(fresh)
    x_axes = [*lead, *([x_m] if ndim >= 2 else []), x_k]

    def grid(row: str, row_size: int, col: str, rank1: bool) -> str:
        if cfg.col_tma:
            padded = row if row_size % _TMA_ALIGN == 0 else next(fresh)
            return " ".join([*lead, col, padded])
        return " ".join([*lead, col] if rank1 else [*lead, row, col])

    operands = [" ".join(x_axes)] + ([""] if not blocked else [])
    results = [" ".join(x_axes)]
    if not blocked:
        results.append("")
    elif cfg.mode == "rows":
        results.append(grid(x_m, m, k_grid, ndim == 1))
    else:
        results.append(grid(m_grid, _ceil(m, g), k_grid, False))
    if cfg.transpose:
        results.append(" ".join([*lead, x_k, x_m]))
        if not blocked:
            results.append(next(fresh))
        elif cfg.mode == "rows":
            results.append(grid(x_k, k, m_grid, False))
        else:
            results.append(grid(k_grid, _ceil(k, g), m_grid, False))
    else:
        results += [next(fresh), next(fresh)]
    results.append("" if not blocked else next(fresh))
    return f"{', '.join(operands)} -> {', '.join(results)}"


def _named(mesh, entries) -> NamedSharding:
    return NamedSharding(mesh, P(*entries))


@functools.cache
def _partitioned_quantize(cfg: _Config, shape: tuple[int, ...]):
    per_tensor = cfg.mode == "tensor"

    def quantize(*operands):
        return _quantize_ffi(cfg, operands[0], operands[1] if per_tensor else None)

    def fill(outs):
        # Absent results are empty arrays, so every config has the same five results.
        data, scale, data_t, scale_t, amax = outs
        empty = jnp.zeros((0,), jnp.float32)
        return (
            data,
            scale,
            data_t if data_t is not None else jnp.zeros((0,), cfg.dtype),
            scale_t if scale_t is not None else empty,
            amax if amax is not None else empty,
        )

    def partition(mesh, arg_shapes, result_shape):
        xs = _x_entries(cfg, mesh, arg_shapes[0])
        sharded = axes_of(xs)

        def lower(*operands):
            x = operands[0]
            scale_in = operands[1] if per_tensor else None
            data, scale, data_t, scale_t, amax = fill(_quantize_ffi(cfg, x, scale_in))
            if per_tensor and sharded:
                amax = jax.lax.pmax(amax, sharded)
            return data, scale, data_t, scale_t, amax

        outs = tuple(_named(mesh, spec) for spec in _out_specs(cfg, xs, len(shape)))
        args = (_named(mesh, xs),) + ((_named(mesh, ()),) if per_tensor else ())
        return mesh, lower, outs, args

    def infer(mesh, arg_shapes, result_shape):
        xs = _x_entries(cfg, mesh, arg_shapes[0])
        return tuple(_named(mesh, spec) for spec in _out_specs(cfg, xs, len(shape)))

    fn = custom_partitioning(lambda *operands: fill(quantize(*operands)))
    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=_sharding_rule(cfg, shape),
        **_factor_sizes(cfg, shape),
    )
    return fn


def _factor_sizes(cfg: _Config, shape: tuple[int, ...]) -> dict[str, int]:
    """Sizes of the factors of :func:`_sharding_rule` that only appear inside compound factors."""
    rule = _sharding_rule(cfg, shape)
    g = cfg.group
    m, k = (shape[-2] if len(shape) >= 2 else 1), shape[-1]
    sizes = {"mq": g, "mg": m // g, "kq": g, "kg": k // g}
    standalone = set(re.sub(r"\([^)]*\)", " ", rule).replace(",", " ").split())
    return {n: v for n, v in sizes.items() if re.search(rf"\b{n}\b", rule) and n not in standalone}


@functools.cache
def _partitioned_amax(ndim: int):
    def partition(mesh, arg_shapes, result_shape):
        xs = padded_spec(arg_shapes[0].sharding, ndim)
        sharded = axes_of(xs)

        def lower(x):
            amax = _amax_ffi(x)
            return jax.lax.pmax(amax, sharded) if sharded else amax

        return mesh, lower, _named(mesh, ()), (_named(mesh, xs),)

    def infer(mesh, arg_shapes, result_shape):
        return _named(mesh, ())

    fn = custom_partitioning(_amax_ffi)
    axes = " ".join(f"a{i}" for i in range(ndim))
    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=f"{axes} -> ",
        reduction_factors=tuple(f"a{i}" for i in range(ndim)),
    )
    return fn


# -------------------------------------------------------------------------------------------------
# quantize.


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
    data, scale_out, data_t, scale_t, amax = _quantize_op(cfg, tuple(x.shape), scale is not None)(
        operands
    )
    return (
        data,
        scale_out,
        data_t if cfg.transpose else None,
        scale_t if (cfg.transpose and not per_tensor) else None,
        amax if per_tensor else None,
    )


def _absent(cfg: _Config) -> tuple[bool, ...]:
    """Which of (data, scale, data_t, scale_t, amax) the config does not produce."""
    per_tensor = cfg.mode == "tensor"
    return (False, False, not cfg.transpose, per_tensor or not cfg.transpose, not per_tensor)


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
        for o, d, absent in zip(outs, dtypes, _absent(cfg), strict=True)
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
                for o, absent in zip(outs, _absent(cfg), strict=True)
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
        raise TypeError(
            f"{op}: dtype must be float8_e4m3fn or float8_e5m2, got {dtype!r}"
        ) from None
    if d not in FP8_DTYPES:
        raise TypeError(f"{op}: dtype must be float8_e4m3fn or float8_e5m2, got {d.name}")
    return d


def _check_group(op: str, name: str, g: Any) -> int:
    if isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, np.integer)) or g not in _GROUPS:
        raise ValueError(f"{op}: {name} must use G in {_GROUPS}, got {g!r}")
    return int(g)


def _check_block(op: str, block: Any) -> tuple[str, int]:
    if block is None:
        return "tensor", 128
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise ValueError(f"{op}: block must be None, (1, G) or (G, G), got {block!r}")
    rows, g = block
    g = _check_group(op, "block", g)
    if rows == 1:
        return "rows", g
    if rows == g:
        return "tiles", g
    raise ValueError(
        f"{op}: block must be None, (1, G) or (G, G) with G in {_GROUPS}, got {block!r}"
    )


def _check_amax_floor(op: str, value: Any) -> float:
    floor = _checks.check_positive_float(op, "amax_floor", value)
    if floor < _MIN_AMAX_FLOOR:
        raise ValueError(f"{op}: amax_floor must be >= {_MIN_AMAX_FLOOR}, got {value!r}")
    return floor


def _make_config(op, x, dtype, block, pow2_scale, transpose, scale_layout, amax_floor):
    x = _checks.check_array(op, "x", x, min_rank=1)
    mode, g = _check_block(op, block)
    transpose = _checks.check_bool(op, "transpose", transpose)
    if scale_layout not in ("row", "col_tma"):
        raise ValueError(f"{op}: scale_layout must be 'row' or 'col_tma', got {scale_layout!r}")
    col_tma = scale_layout == "col_tma"
    if col_tma and mode == "tensor":
        raise ValueError(f"{op}: scale_layout='col_tma' needs a block, got block=None")
    need_2d = mode == "tiles" or transpose or col_tma
    if need_2d and x.ndim < 2:
        what = "block=(G, G)" if mode == "tiles" else ("transpose" if transpose else "col_tma")
        raise ValueError(f"{op}: {what} needs x of rank >= 2, got shape {tuple(x.shape)}")
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
    x, cfg = _make_config(
        "quantize", x, dtype, block, pow2_scale, transpose, scale_layout, amax_floor
    )
    data, scale, data_t, scale_t, _ = _quantize_apply(cfg, x, None, _ffi.use_kernel(impl))
    return _wrap(cfg, data, scale, data_t, scale_t)


def quantize_reference(
    x: jax.Array,
    *,
    dtype: Any = jnp.float8_e4m3fn,
    block: tuple[int, int] | None = (1, 128),
    pow2_scale: bool = False,
    transpose: bool = False,
    scale_layout: ScaleLayout = "row",
    amax_floor: float = AMAX_FLOOR,
) -> QuantizedArray | tuple[QuantizedArray, QuantizedArray]:
    """The pure-JAX twin of :func:`quantize` (same arguments and bits)."""
    return quantize(
        x,
        dtype=dtype,
        block=block,
        pow2_scale=pow2_scale,
        transpose=transpose,
        scale_layout=scale_layout,
        amax_floor=amax_floor,
        impl="xla",
    )


# -------------------------------------------------------------------------------------------------
# fake_quant: quantize-dequantize with a straight-through gradient.


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
    x, cfg = _make_config("fake_quant", x, dtype, block, pow2_scale, False, "row", amax_floor)
    return _fake_quant(cfg, _ffi.use_kernel(impl), x)


# -------------------------------------------------------------------------------------------------
# Delayed scaling (TransformerEngine-style recipes).


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """A delayed-scaling recipe: per-tensor scales from a history of past amaxes.

    Attributes:
      history_len: number of past amax values kept.
      amax_compute: ``"max"`` (largest amax in the history) or ``"most_recent"``.
      margin: the scale is multiplied by ``2**margin`` (headroom for growth).
      dtype: FP8 dtype.
      pow2_scale: round scales up to powers of two.
      amax_floor: lower bound of the amax the scale is computed from.
    """

    history_len: int = 1024
    amax_compute: Literal["max", "most_recent"] = "max"
    margin: int = 0
    dtype: Any = jnp.float8_e4m3fn
    pow2_scale: bool = False
    amax_floor: float = AMAX_FLOOR

    def __post_init__(self):
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(
                f"DelayedScaling: history_len must be an int >= 1, got {self.history_len!r}"
            )
        if self.amax_compute not in ("max", "most_recent"):
            raise ValueError(
                f"DelayedScaling: amax_compute must be 'max' or 'most_recent', "
                f"got {self.amax_compute!r}"
            )
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"DelayedScaling: margin must be an int >= 0, got {self.margin!r}")
        _check_dtype("DelayedScaling", self.dtype)
        _check_amax_floor("DelayedScaling", self.amax_floor)


class Fp8Meta(NamedTuple):
    """Delayed-scaling state of one tensor (a pytree): the amax history and the current scale.

    Attributes:
      amax_history: float32 ``[history_len]``, most recent first.
      scale: float32 ``[]``, the dequantization scale used for the next quantization.
    """

    amax_history: jax.Array
    scale: jax.Array


def init_fp8_meta(recipe: DelayedScaling = DelayedScaling()) -> Fp8Meta:
    """A fresh state: an all-zero history and scale 1.

    Example:
      >>> import jaxops
      >>> meta = jaxops.fp8.init_fp8_meta(jaxops.fp8.DelayedScaling(history_len=4))
      >>> meta.amax_history.shape, float(meta.scale)
      ((4,), 1.0)
    """
    return Fp8Meta(jnp.zeros((recipe.history_len,), jnp.float32), jnp.ones((), jnp.float32))


def scale_from_amax_history(amax_history: jax.Array, recipe: DelayedScaling) -> jax.Array:
    """The scale the recipe derives from a history (float32 ``[]``)."""
    amax = amax_history[0] if recipe.amax_compute == "most_recent" else jnp.max(amax_history)
    amax = amax * np.float32(2.0**recipe.margin)  # exact: a power of two
    return scale_from_amax(
        amax, recipe.dtype, pow2_scale=recipe.pow2_scale, amax_floor=recipe.amax_floor
    )


def update_fp8_meta(meta: Fp8Meta, amax: jax.Array, recipe: DelayedScaling) -> Fp8Meta:
    """Pushes `amax` into the history (dropping the oldest) and recomputes the scale."""
    history = jnp.roll(meta.amax_history, 1).at[0].set(jnp.asarray(amax, jnp.float32))
    return Fp8Meta(history, scale_from_amax_history(history, recipe))


def quantize_delayed(
    x: jax.Array,
    meta: Fp8Meta,
    recipe: DelayedScaling = DelayedScaling(),
    *,
    transpose: bool = False,
    impl: str | None = None,
) -> tuple[QuantizedArray | tuple[QuantizedArray, QuantizedArray], Fp8Meta]:
    """Per-tensor quantization with the scale from `meta`, in one pass over x.

    The kernel measures x's amax while it quantizes; the returned state has it pushed into the
    history and the scale for the next step recomputed (TransformerEngine's delayed scaling).
    Values beyond the stale scale's range saturate.

    Args:
      x: float32, bfloat16 or float16 array, rank >= 1 (>= 2 with `transpose`).
      meta: the tensor's :class:`Fp8Meta`.
      recipe: the :class:`DelayedScaling` recipe.
      transpose: also return the quantized transpose.
      impl: None, ``"ffi"`` or ``"xla"``.

    Returns:
      ``(q, new_meta)``, or ``((q, q_t), new_meta)`` with `transpose`.

    Example:
      >>> import jax.numpy as jnp, jaxops
      >>> recipe = jaxops.fp8.DelayedScaling(history_len=8)
      >>> meta = jaxops.fp8.init_fp8_meta(recipe)
      >>> q, meta = jaxops.fp8.quantize_delayed(jnp.full((4, 32), 3.0), meta, recipe)
      >>> float(meta.amax_history[0])
      3.0
    """
    if not isinstance(meta, Fp8Meta):
        raise TypeError(f"quantize_delayed: meta must be an Fp8Meta, got {type(meta).__name__}")
    x, cfg = _make_config(
        "quantize_delayed",
        x,
        recipe.dtype,
        None,
        recipe.pow2_scale,
        transpose,
        "row",
        recipe.amax_floor,
    )
    scale = jnp.asarray(meta.scale, jnp.float32)
    if scale.shape != ():
        raise ValueError(f"quantize_delayed: meta.scale must have shape (), got {scale.shape}")
    data, scale, data_t, scale_t, amax = _quantize_apply(cfg, x, scale, _ffi.use_kernel(impl))
    return _wrap(cfg, data, scale, data_t, scale_t), update_fp8_meta(meta, amax, recipe)


# -------------------------------------------------------------------------------------------------
# quantize_split_transpose: per-expert transposed 1 x G quantization for wgrad GEMMs.


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class SplitQuantized:
    """Per-expert quantized transposes packed in one buffer (from :func:`quantize_split_transpose`).

    For x ``[M, K]`` holding E experts' rows one after another::

      data   [K, C]   expert e = columns col_offsets[e] .. col_offsets[e] + sizes[e]
                      |  e0  |pad|   e1   |pad| e2 |pad| ... unused ... |
      scale  [K, S]   expert e = columns scale_offsets[e] .. + ceil(sizes[e] / G)

    ``C = round_up(M + 15 E, 16)``, ``S = M // G + E``. Expert blocks start at multiples of 16
    columns (16-byte aligned rows for TMA); within a block, G consecutive tokens share one scale
    per k (128 x 1 scales in x's coordinates). Padding and unused entries are zero.

    Attributes:
      data: float8 ``[K, C]``.
      scale: float32 ``[K, S]``.
      col_offsets: int32 ``[E + 1]``.
      scale_offsets: int32 ``[E + 1]``.
      sizes: int32 ``[E]``, the group sizes after clamping (negative -> 0, rows past M dropped).
      group: G.
      num_rows: M.
    """

    data: jax.Array
    scale: jax.Array
    col_offsets: jax.Array
    scale_offsets: jax.Array
    sizes: jax.Array
    group: int = 128
    num_rows: int = 0

    def tree_flatten(self):
        children = (self.data, self.scale, self.col_offsets, self.scale_offsets, self.sizes)
        return children, (self.group, self.num_rows)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def dequantize(self, dtype: Any = jnp.bfloat16) -> jax.Array:
        """The rows of x back, ``[M, K]`` in `dtype` (rows past the experts' total are zero)."""
        layout = _row_layout(
            self.sizes, self.col_offsets, self.scale_offsets, self.num_rows, self.group
        )
        col, scol, valid = layout
        cols = jnp.where(valid, col, 0)
        scols = jnp.where(valid, scol, 0)
        values = self.data[:, cols].astype(jnp.float32) * self.scale[:, scols]
        return jnp.where(valid[:, None], values.T, 0).astype(dtype)


def _clamped_sizes(group_sizes: jax.Array, m: int) -> jax.Array:
    sizes = jnp.clip(group_sizes, 0, m)
    ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, m), sizes)
    return jnp.diff(ends, prepend=jnp.zeros((1,), ends.dtype)).astype(jnp.int32)


def _split_offsets(sizes: jax.Array, g: int) -> tuple[jax.Array, jax.Array]:
    zero = jnp.zeros((1,), jnp.int32)
    padded = (sizes + (_SPLIT_COLUMN_ALIGN - 1)) // _SPLIT_COLUMN_ALIGN * _SPLIT_COLUMN_ALIGN
    col = jnp.concatenate([zero, jnp.cumsum(padded, dtype=jnp.int32)])
    scol = jnp.concatenate([zero, jnp.cumsum((sizes + g - 1) // g, dtype=jnp.int32)])
    return col, scol


def _row_layout(sizes, col_offsets, scale_offsets, m: int, g: int):
    """Per row of x: (packed column, scale column, whether the row belongs to an expert)."""
    ends = jnp.cumsum(sizes, dtype=jnp.int32)
    rows = jnp.arange(m, dtype=jnp.int32)
    expert = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    valid = rows < (ends[-1] if sizes.shape[0] else 0)
    e = jnp.minimum(expert, sizes.shape[0] - 1)
    j = rows - (ends[e] - sizes[e])
    return col_offsets[e] + j, scale_offsets[e] + j // g, valid


def _split_shapes(m: int, k: int, e: int, g: int) -> tuple[int, int]:
    columns = _round_up(m + (_SPLIT_COLUMN_ALIGN - 1) * e, _SPLIT_COLUMN_ALIGN)
    return columns, m // g + e


def _split_reference(cfg: _Config, x: jax.Array, group_sizes: jax.Array):
    m, k = x.shape
    e = group_sizes.shape[0]
    g = cfg.group
    columns, scale_columns = _split_shapes(m, k, e, g)
    sizes = _clamped_sizes(group_sizes, m)
    col_offsets, scale_offsets = _split_offsets(sizes, g)
    col, scol, valid = _row_layout(sizes, col_offsets, scale_offsets, m, g)
    seg = jnp.where(valid, scol, scale_columns)
    amax = jax.ops.segment_max(_finite_abs(x), seg, num_segments=scale_columns)  # [S, K]
    used = jnp.arange(scale_columns) < scale_offsets[-1]
    scale = jnp.where(
        used[:, None],
        scale_from_amax(
            jnp.maximum(amax, 0), cfg.dtype, pow2_scale=cfg.pow2_scale, amax_floor=cfg.amax_floor
        ),
        jnp.float32(0),
    )
    row_scale = scale[jnp.where(valid, scol, 0)]  # [M, K]
    q = jax.lax.bitcast_convert_type(
        _encode(x.astype(jnp.float32), row_scale, cfg.dtype), jnp.uint8
    )
    target = jnp.where(valid, col, columns)
    data = jnp.zeros((k, columns), jnp.uint8).at[:, target].set(q.T, mode="drop")
    data = jax.lax.bitcast_convert_type(data, cfg.dtype)
    return data, scale.T, col_offsets, scale_offsets


def _split_ffi(cfg: _Config, x: jax.Array, group_sizes: jax.Array):
    m, k = x.shape
    e = group_sizes.shape[0]
    columns, scale_columns = _split_shapes(m, k, e, cfg.group)
    mesh = _explicit_mesh(x) if result_sharding(x) is not None else None
    if mesh is None:
        rows_sh = flat_sh = None
    else:
        k_entry = padded_spec(jax.typeof(x).sharding, 2)[1]
        rows_sh, flat_sh = NamedSharding(mesh, P(k_entry, None)), NamedSharding(mesh, P(None))
    out_types = (
        jax.ShapeDtypeStruct((k, columns), cfg.dtype, sharding=rows_sh),
        jax.ShapeDtypeStruct((k, scale_columns), jnp.float32, sharding=rows_sh),
        jax.ShapeDtypeStruct((e + 1,), jnp.int32, sharding=flat_sh),
        jax.ShapeDtypeStruct((e + 1,), jnp.int32, sharding=flat_sh),
    )
    return _ffi.ffi_call(
        TARGET_SPLIT_TRANSPOSE,
        out_types,
        x,
        group_sizes,
        group=np.int32(cfg.group),
        pow2_scale=cfg.pow2_scale,
        amax_floor=np.float32(cfg.amax_floor),
    )


@functools.cache
def _partitioned_split(cfg: _Config):
    def partition(mesh, arg_shapes, result_shape):
        k_entry = padded_spec(arg_shapes[0].sharding, 2)[1]
        outs = (
            _named(mesh, (k_entry, None)),
            _named(mesh, (k_entry, None)),
            _named(mesh, (None,)),
            _named(mesh, (None,)),
        )
        args = (_named(mesh, (None, k_entry)), _named(mesh, (None,)))
        return mesh, functools.partial(_split_ffi, cfg), outs, args

    def infer(mesh, arg_shapes, result_shape):
        k_entry = padded_spec(arg_shapes[0].sharding, 2)[1]
        return (
            _named(mesh, (k_entry, None)),
            _named(mesh, (k_entry, None)),
            _named(mesh, (None,)),
            _named(mesh, (None,)),
        )

    fn = custom_partitioning(functools.partial(_split_ffi, cfg))
    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule="m k, e -> k c, k s, f, f",
        need_replication_factors=("m",),
    )
    return fn


def quantize_split_transpose(
    x: jax.Array,
    group_sizes: jax.Array,
    *,
    block: int = 128,
    dtype: Any = jnp.float8_e4m3fn,
    pow2_scale: bool = False,
    amax_floor: float = AMAX_FLOOR,
    impl: str | None = None,
) -> SplitQuantized:
    """Quantizes each expert's rows of x transposed, for per-expert wgrad GEMMs, in one pass.

    x holds the tokens of E experts one after another (``group_sizes[e]`` rows each, as MoE
    permute produces them). Expert e's ``[m_e, K]`` block is transposed to ``[K, m_e]`` and
    quantized in groups of G consecutive tokens per k (G x 1 scales in x's coordinates), all
    packed in one static-shape buffer (see :class:`SplitQuantized`). Any M works (no multiple of
    G needed) and empty experts are fine. The sizes stay on device: nothing is synchronized with
    the host. Sizes are clamped: negative sizes count as 0 and rows past M are dropped.

    Args:
      x: float32, bfloat16 or float16 ``[M, K]``.
      group_sizes: int32 ``[E]``, E >= 1.
      block: G, one of 32, 64, 128.
      dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
      pow2_scale: round scales up to powers of two.
      amax_floor: lower bound of each group's amax.
      impl: None, ``"ffi"`` or ``"xla"``.

    Returns:
      A :class:`SplitQuantized`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxops
      >>> x = jax.random.normal(jax.random.key(0), (300, 64), jnp.bfloat16)
      >>> s = jaxops.fp8.quantize_split_transpose(x, jnp.array([100, 0, 200], jnp.int32))
      >>> s.data.shape, s.scale.shape, s.col_offsets.tolist()
      ((64, 352), (64, 5), [0, 112, 112, 320])
    """
    op = "quantize_split_transpose"
    x = _checks.check_array(op, "x", x, min_rank=2)
    if x.ndim != 2:
        raise ValueError(f"{op}: x must have shape (M, K), got {tuple(x.shape)}")
    group_sizes = _checks.check_array(
        op, "group_sizes", group_sizes, dtypes=(np.dtype(np.int32),), min_rank=1
    )
    if group_sizes.ndim != 1 or group_sizes.shape[0] < 1:
        raise ValueError(
            f"{op}: group_sizes must have shape (E,) with E >= 1, got {tuple(group_sizes.shape)}"
        )
    cfg = _Config(
        dtype=_check_dtype(op, dtype),
        mode="rows",
        group=_check_group(op, "block", block),
        transpose=True,
        col_tma=False,
        pow2_scale=_checks.check_bool(op, "pow2_scale", pow2_scale),
        amax_floor=_check_amax_floor(op, amax_floor),
    )
    m, k = x.shape
    columns, _ = _split_shapes(m, k, group_sizes.shape[0], cfg.group)
    if columns >= 2**31:
        raise ValueError(f"{op}: M + 15 E must stay below 2^31 columns, got M={m}")
    if x.size == 0 or not _ffi.use_kernel(impl):
        data, scale, col_offsets, scale_offsets = _split_reference(cfg, x, group_sizes)
    else:
        data, scale, col_offsets, scale_offsets = _partitioned_split(cfg)(x, group_sizes)
    return SplitQuantized(
        data, scale, col_offsets, scale_offsets, _clamped_sizes(group_sizes, m), cfg.group, m
    )


def quantize_split_transpose_reference(x: jax.Array, group_sizes: jax.Array, **kwargs):
    """The pure-JAX twin of :func:`quantize_split_transpose`."""
    return quantize_split_transpose(x, group_sizes, impl="xla", **kwargs)
