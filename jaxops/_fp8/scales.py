"""Scales and layouts: QuantizedArray, dequantize, scale math and the pure-JAX quantization."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import _checks
from jaxops._errors import ArgumentTypeError
from jaxops._rows import round_up

#: Default lower bound of a block's amax (DeepGEMM's value): an all-zero block gets scale
#: ``1e-4 / max_finite`` and quantizes to exact zeros.
AMAX_FLOOR = 1e-4
_MIN_AMAX_FLOOR = 1e-30  # keeps every scale a normal float32
#: The amax floor of gradient blocks: gradients can be tiny, so their blocks keep their own scale.
GRAD_AMAX_FLOOR = 1e-30
_GROUPS = (32, 64, 128)
_TMA_ALIGN = 4  # col_tma scales: rows padded to a multiple of 4 floats (16 bytes)
FP8_DTYPES: tuple[np.dtype, ...] = _checks.FP8_DTYPES
ScaleLayout = Literal["row", "col_tma"]


def max_finite(dtype: Any) -> float:
    """Largest finite value of an FP8 dtype: 448 for float8_e4m3fn, 57344 for float8_e5m2."""
    return float(jnp.finfo(dtype).max)


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
        raise ArgumentTypeError(
            f"jaxops.fp8.dequantize: q must be a QuantizedArray, got {type(q).__name__}"
        )
    out_dtype = np.dtype(dtype)
    if out_dtype not in _checks.FLOAT_DTYPES:
        names = ", ".join(_checks.dtype_name(d) for d in _checks.FLOAT_DTYPES)
        raise ArgumentTypeError(
            f"jaxops.fp8.dequantize: dtype must be one of {names}; got {out_dtype.name}"
        )
    y = (q.data.astype(jnp.float32) * _expand_scale(q)).astype(out_dtype)
    return jnp.swapaxes(y, -1, -2) if q.transposed else y


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

    @property
    def absent(self) -> tuple[bool, ...]:
        """Which of the five results (data, scale, data_t, scale_t, amax) this config lacks."""
        per_tensor = self.mode == "tensor"
        return (False, False, not self.transpose, per_tensor or not self.transpose, not per_tensor)

    def present(self, outs) -> tuple:
        """The five results, those this config lacks as None."""
        return tuple(None if absent else o for o, absent in zip(outs, self.absent, strict=True))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


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
        return (*lead, cols, round_up(rows, _TMA_ALIGN))
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
    return _scale_from_amax(
        amax, jnp.dtype(dtype), pow2_scale=bool(pow2_scale), amax_floor=float(amax_floor)
    )


# The twins are jitted: called eagerly, each of their dozens of jnp operations would be
# dispatched and compiled on its own (most of the FP8 tests' time); under an outer jit they are
# inlined.
@functools.partial(jax.jit, static_argnames=("dtype", "pow2_scale", "amax_floor"))
def _scale_from_amax(amax: jax.Array, dtype: Any, *, pow2_scale: bool, amax_floor: float):
    amax = jnp.asarray(amax, jnp.float32)
    scale = _div_max_finite(jnp.maximum(amax, np.float32(amax_floor)), dtype)
    if not pow2_scale:
        return scale
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    bumped = (bits & np.uint32(0xFF800000)) + np.uint32(0x00800000)
    bits = jnp.where((bits & np.uint32(0x007FFFFF)) != 0, bumped, bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _div_max_finite(a: jax.Array, dtype: Any) -> jax.Array:
    """``a / max_finite(dtype)`` in float32, correctly rounded on every backend.

    XLA:GPU's float32 division is not correctly rounded (measured on an H100: the per-tensor
    scale came out one ulp above numpy's for some amax), and XLA:CPU rewrites a division by a
    broadcast constant into a multiplication by its reciprocal. Both FP8 formats have
    ``max_finite = 7 * 2**p`` (448 = 7 * 2**6, 57344 = 7 * 2**13), so for a positive normal `a`
    the quotient is the 24-bit significand divided by 7 in integer arithmetic, rounded to
    nearest even by hand, with the exponent lowered by p; that is exactly the kernels'
    ``__fdiv_rn``. Other values (zero, subnormal, inf, NaN) take the plain division.
    """
    limit = max_finite(dtype)
    p = round(np.log2(limit / 7))
    if 7 * 2**p != limit:  # pragma: no cover - both FP8 formats satisfy it
        raise AssertionError(f"max_finite({np.dtype(dtype).name}) = {limit} is not 7 * 2**p")
    a = jnp.asarray(a, jnp.float32)
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
    exponent = ((bits >> 23) & np.uint32(0xFF)).astype(jnp.int32)
    n = ((bits & np.uint32(0x7FFFFF)) | np.uint32(0x800000)) << 5  # [2**28, 2**29)
    q, r = n // np.uint32(7), n % np.uint32(7)  # q in [2**25.2, 2**26.2)
    shift = jnp.where(q >= np.uint32(1 << 26), np.uint32(3), np.uint32(2))
    mant = q >> shift
    rest = q & ((np.uint32(1) << shift) - np.uint32(1))
    half = np.uint32(1) << (shift - np.uint32(1))
    up = (rest > half) | ((rest == half) & ((r != 0) | ((mant & np.uint32(1)) == 1)))
    mant = mant + up.astype(jnp.uint32)
    carry = mant >> 24  # rounding up reached 2**24
    mant = mant >> carry
    new_exponent = exponent - 5 + shift.astype(jnp.int32) - p + carry.astype(jnp.int32)
    out = (new_exponent.astype(jnp.uint32) << 23) | (mant & np.uint32(0x7FFFFF))
    exact = jax.lax.bitcast_convert_type(out, jnp.float32)
    normal = (exponent >= 1) & (exponent <= 254) & (new_exponent >= 1) & (a > 0)
    return jnp.where(normal, exact, a / np.float32(limit))


def _no_reciprocal(divisor: jax.Array, finite_like: jax.Array) -> jax.Array:
    """`divisor` broadcast to `finite_like`'s shape, in a form XLA keeps as a divisor.

    XLA rewrites ``a / broadcast(b)`` into ``a * broadcast(1 / b)``, which is off by one ulp for
    some ``a``; the kernels divide exactly. ``finite_like * 0 + divisor`` (exact for finite
    values, which XLA does not fold for floats) keeps the division elementwise, and correctly
    rounded on XLA:CPU (not on XLA:GPU, whose float32 division is itself approximate: there the
    twin's FP8 codes can differ from the kernels' by one step), also under vmap, without
    materializing anything.
    """
    return finite_like * np.float32(0) + divisor


def _encode(x32: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
    """FP8 codes of ``x32 / scale``.

    The optimization barrier keeps them FP8 inside a larger program: with excess precision
    allowed (XLA's default), XLA:GPU removes a float32 -> FP8 -> float32 convert pair, so a
    dequantization fused after the encoding would see the unrounded quotient.
    """
    limit = np.float32(max_finite(dtype))
    return jax.lax.optimization_barrier(jnp.clip(x32 / scale, -limit, limit).astype(dtype))


def _block_amax_rows(a: jax.Array, g: int) -> jax.Array:
    """[..., K] -> [..., ceil(K/G)] max over groups of G along the last axis (a >= 0)."""
    k = a.shape[-1]
    pad = round_up(k, g) - k
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    return a.reshape((*a.shape[:-1], a.shape[-1] // g, g)).max(axis=-1)


def _to_layout(cfg: _Config, grid: jax.Array, rank1: bool) -> jax.Array:
    """A [..., rows, cols] grid in cfg's layout."""
    if rank1:
        grid = grid[0]
    if not cfg.col_tma:
        return grid
    t = jnp.swapaxes(grid, -1, -2)
    pad = round_up(t.shape[-1], _TMA_ALIGN) - t.shape[-1]
    return jnp.pad(t, [(0, 0)] * (t.ndim - 1) + [(0, pad)])


@functools.partial(jax.jit, static_argnums=(0,))
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
        data = _encode(x32, _no_reciprocal(full, a), cfg.dtype)
        data_t = scale_t = None
        if cfg.transpose:
            at = jnp.swapaxes(a, -1, -2)
            scale_t = scale_from_amax(_block_amax_rows(at, g), **params)  # [..., K, MG]
            full_t = jnp.repeat(scale_t, g, axis=-1)[..., :m]
            data_t = _encode(jnp.swapaxes(x32, -1, -2), _no_reciprocal(full_t, at), cfg.dtype)
    else:
        row_max = _block_amax_rows(a, g)  # [..., M, KG]
        tile = _block_amax_rows(jnp.swapaxes(row_max, -1, -2), g)  # [..., KG, MG]
        scale_t = scale_from_amax(tile, **params)
        scale = jnp.swapaxes(scale_t, -1, -2)  # [..., MG, KG]
        full = jnp.repeat(jnp.repeat(scale, g, axis=-1)[..., :k], g, axis=-2)[..., :m, :]
        data = _encode(x32, _no_reciprocal(full, a), cfg.dtype)
        data_t = jnp.swapaxes(data, -1, -2) if cfg.transpose else None
        scale_t = scale_t if cfg.transpose else None
    data = data[0] if rank1 else data
    scale = _to_layout(cfg, scale, rank1)
    if scale_t is not None:
        scale_t = _to_layout(cfg, scale_t, False)
    return data, scale, data_t, scale_t


@functools.partial(jax.jit, static_argnums=(0,))
def _reference_tensor(cfg: _Config, x: jax.Array, scale: jax.Array):
    """Per-tensor twin with a given scale: (data, data_t, amax)."""
    amax = jnp.max(_finite_abs(x), initial=np.float32(0))
    data = _encode(x.astype(jnp.float32), _no_reciprocal(scale, _finite_abs(x)), cfg.dtype)
    data_t = jnp.swapaxes(data, -1, -2) if cfg.transpose else None
    return data, data_t, amax
