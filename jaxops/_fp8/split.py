"""quantize_split_transpose: per-expert transposed FP8 operands of the weight gradient."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops import _checks, _ffi
from jaxops._config import check_impl
from jaxops._errors import InvalidArgumentError
from jaxops._fp8.partition import _explicit_mesh, _named
from jaxops._fp8.quantize import _check_amax_floor, _check_dtype, _check_group
from jaxops._fp8.scales import (
    AMAX_FLOOR,
    _Config,
    _encode,
    _finite_abs,
    scale_from_amax,
)
from jaxops._rows import round_up
from jaxops._sharding import padded_spec, result_sharding

TARGET_SPLIT_TRANSPOSE = "jaxops_fp8_quantize_split_transpose"
_SPLIT_COLUMN_ALIGN = 16  # quantize_split_transpose: experts start at multiples of 16 columns


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
        return _dequantize_split(
            self.data,
            self.scale,
            self.col_offsets,
            self.scale_offsets,
            self.sizes,
            self.num_rows,
            self.group,
            jnp.dtype(dtype),
        )


# The pure-JAX paths below are jitted (one program per shape and setting, not one per jnp op
# when called eagerly); inside a user's jit they inline.
@functools.partial(jax.jit, static_argnums=(5, 6, 7))
def _dequantize_split(data, scale, col_offsets, scale_offsets, sizes, m: int, g: int, dtype):
    col, scol, valid = _row_layout(sizes, col_offsets, scale_offsets, m, g)
    cols = jnp.where(valid, col, 0)
    scols = jnp.where(valid, scol, 0)
    values = data[:, cols].astype(jnp.float32) * scale[:, scols]
    return jnp.where(valid[:, None], values.T, 0).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1,))
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
    columns = round_up(m + (_SPLIT_COLUMN_ALIGN - 1) * e, _SPLIT_COLUMN_ALIGN)
    return columns, m // g + e


@functools.partial(jax.jit, static_argnums=(0,))
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
    op = "jaxops.fp8.quantize_split_transpose"
    x = _checks.check_array(op, "x", x, min_rank=2)
    if x.ndim != 2:
        raise InvalidArgumentError(f"{op}: x must have shape (M, K), got {tuple(x.shape)}")
    group_sizes = _checks.check_array(
        op, "group_sizes", group_sizes, dtypes=(np.dtype(np.int32),), min_rank=1
    )
    if group_sizes.ndim != 1 or group_sizes.shape[0] < 1:
        raise InvalidArgumentError(
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
        raise InvalidArgumentError(f"{op}: M + 15 E must stay below 2^31 columns, got M={m}")
    check_impl(op, impl)
    if x.size == 0 or not _ffi.use_kernel(impl, op):
        data, scale, col_offsets, scale_offsets = _split_reference(cfg, x, group_sizes)
    else:
        data, scale, col_offsets, scale_offsets = _partitioned_split(cfg)(x, group_sizes)
    return SplitQuantized(
        data, scale, col_offsets, scale_offsets, _clamped_sizes(group_sizes, m), cfg.group, m
    )


def quantize_split_transpose_reference(x: jax.Array, group_sizes: jax.Array, **kwargs):
    """The pure-JAX twin of :func:`quantize_split_transpose`."""
    return quantize_split_transpose(x, group_sizes, impl="xla", **kwargs)
