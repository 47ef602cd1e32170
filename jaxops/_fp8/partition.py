"""The quantize custom calls and their sharding: FFI calls, custom_partitioning, Shardy rules."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops import _ffi
from jaxops._fp8.scales import _TMA_ALIGN, _ceil, _Config, _scale_shapes, _transposed_shape
from jaxops._sharding import axes_of, padded_spec, result_sharding

TARGET_QUANTIZE = "jaxops_fp8_quantize"
TARGET_AMAX = "jaxops_fp8_amax"
_BLOCK_MODE = {"tensor": 0, "rows": 1, "tiles": 2}


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
    outs = _ffi.ffi_call(
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
    return cfg.present(outs)


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
