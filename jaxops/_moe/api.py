"""The public permute / unpermute: validation at trace time and the choice of implementation."""

from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import _checks, _ffi
from jaxops._config import check_impl
from jaxops._errors import ArgumentTypeError, InvalidArgumentError
from jaxops._moe.autodiff import permute_vjp, unpermute_vjp
from jaxops._moe.layout import (
    INT32,
    MAX_ALIGN,
    MAX_ROWS,
    TOKEN_DTYPES,
    Permuted,
    Route,
    permuted_rows,
)
from jaxops._moe.partition import explicit_mesh, refuse_sharded
from jaxops._moe.reference import (
    permute_rows_reference,
    route_reference,
    unpermute_rows_reference,
)
from jaxops._sharding import padded_spec

__all__ = ["permute", "permute_reference", "unpermute", "unpermute_reference"]


def _static_int(op: str, name: str, value: Any, minimum: int, maximum: int) -> int:
    if isinstance(value, jax.core.Tracer):
        raise ArgumentTypeError(
            f"jaxops.moe.{op}: {name} must be a static Python int, got a traced value"
        )
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(
            f"jaxops.moe.{op}: {name} must be an int, got {type(value).__name__}"
        )
    value = operator.index(value)
    if not minimum <= value <= maximum:
        raise InvalidArgumentError(
            f"jaxops.moe.{op}: {name} must be in [{minimum}, {maximum}], got {value}"
        )
    return value


def _token_axis_local(op: str, name: str, x: jax.Array, axis: str = "token") -> None:
    """On explicit meshes the sharding is known at trace time: refuse a sharded token/row axis."""
    if explicit_mesh(x) is not None:
        entry = padded_spec(jax.typeof(x).sharding, x.ndim)[0]
        refuse_sharded(op, name, entry, axis)


def _check_probs(op: str, probs: Any, shape: tuple[int, ...]) -> jax.Array | None:
    if probs is None:
        return None
    probs = _checks.check_array(f"jaxops.moe.{op}", "probs", probs)
    if tuple(probs.shape) != shape:
        raise InvalidArgumentError(
            f"jaxops.moe.{op}: probs must have expert_ids' shape {shape} (T, K), "
            f"got {tuple(probs.shape)}"
        )
    return probs


def _check_scales(op: str, scales: Any, t: int, h: int) -> jax.Array | None:
    if scales is None:
        return None
    scales = _checks.check_array(op, "scales", scales, dtypes=(np.dtype(np.float32),))
    s = scales.shape[1] if scales.ndim == 2 else 0
    if scales.ndim != 2 or scales.shape[0] != t or s < 1 or h % s:
        raise InvalidArgumentError(
            f"{op}: scales must be float32 (T, H / G) = ({t}, {h} / G) for a group size G "
            f"that divides H, got {tuple(scales.shape)}"
        )
    return scales


def _validate_permute(tokens, expert_ids, num_experts, probs, align, scales, capacity, impl):
    op = "jaxops.moe.permute"
    tokens = _checks.check_array(op, "tokens", tokens, dtypes=TOKEN_DTYPES)
    if tokens.ndim != 2:
        raise InvalidArgumentError(
            f"{op}: tokens must have shape (T, H), got {tuple(tokens.shape)}"
        )
    expert_ids = _checks.check_array(op, "expert_ids", expert_ids, dtypes=INT32)
    t, h = tokens.shape
    if expert_ids.ndim != 2 or expert_ids.shape[0] != t or expert_ids.shape[1] < 1:
        raise InvalidArgumentError(
            f"{op}: expert_ids must have shape (T, K) with T = {t} (tokens' rows) and K >= 1, "
            f"got {tuple(expert_ids.shape)}"
        )
    k = expert_ids.shape[1]
    num_experts = _static_int("permute", "num_experts", num_experts, 1, MAX_ROWS)
    align = _static_int("permute", "align", align, 1, MAX_ALIGN)
    if capacity is not None:
        capacity = _static_int("permute", "capacity", capacity, 0, MAX_ROWS)
    probs = _check_probs("permute", probs, (t, k))
    scales = _check_scales(op, scales, t, h)
    check_impl(op, impl)
    rows = permuted_rows(t, k, num_experts, align, capacity)
    if t * k > MAX_ROWS or rows > MAX_ROWS:
        raise InvalidArgumentError(
            f"{op}: T * K = {t * k} slots and R = {rows} rows must stay below 2^31 "
            f"(R = T * K + E * (align - 1))"
        )
    cfg = Route(experts=num_experts, align=align, capacity=capacity, rows=rows)
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
        tokens, expert_ids, num_experts, probs, align, scales, capacity, impl
    )
    _token_axis_local("permute", "tokens", tokens)
    _token_axis_local("permute", "expert_ids", expert_ids)
    probs32 = None if probs is None else probs.astype(jnp.float32)
    if tokens.size == 0 or expert_ids.size == 0 or not _ffi.use_kernel(impl, "jaxops.moe.permute"):
        routing = route_reference(cfg, expert_ids)
        out, out_scales, out_probs = permute_rows_reference(
            tokens, routing[1], scales, probs32, expert_ids.shape[1]
        )
    else:
        out, out_scales, out_probs, routing = permute_vjp(cfg, tokens, expert_ids, probs32, scales)
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


def _validate_unpermute(expert_out, permuted, probs, num_tokens, impl):
    op = "jaxops.moe.unpermute"
    if not isinstance(permuted, Permuted):
        raise ArgumentTypeError(
            f"{op}: permuted must be a jaxops.moe.Permuted, got {type(permuted).__name__}"
        )
    expert_out = _checks.check_array(op, "expert_out", expert_out, dtypes=TOKEN_DTYPES)
    rows = permuted.source.shape[0]
    if expert_out.ndim != 2 or expert_out.shape[0] != rows:
        raise InvalidArgumentError(
            f"{op}: expert_out must have shape (R, H') with R = {rows} (permuted rows), "
            f"got {tuple(expert_out.shape)}"
        )
    t = permuted.row_map.shape[0]
    if num_tokens is not None and num_tokens != t:
        raise InvalidArgumentError(
            f"{op}: num_tokens must equal T = {t}, the tokens permute saw, got {num_tokens!r}"
        )
    probs = _check_probs("unpermute", probs, tuple(permuted.row_map.shape))
    check_impl(op, impl)
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
    expert_out, probs = _validate_unpermute(expert_out, permuted, probs, num_tokens, impl)
    _token_axis_local("unpermute", "expert_out", expert_out, "row")
    row_map = permuted.row_map
    if (
        expert_out.size == 0
        or row_map.size == 0
        or not _ffi.use_kernel(impl, "jaxops.moe.unpermute")
    ):
        return unpermute_rows_reference(expert_out, row_map, probs)
    probs32 = None if probs is None else probs.astype(jnp.float32)
    return unpermute_vjp(expert_out, row_map, permuted.source, probs32)


def permute_reference(tokens, expert_ids, num_experts, **kwargs) -> Permuted:
    """The pure-JAX twin of :func:`permute` (argsort + gather)."""
    return permute(tokens, expert_ids, num_experts, impl="xla", **kwargs)


def unpermute_reference(expert_out, permuted, **kwargs) -> jax.Array:
    """The pure-JAX twin of :func:`unpermute` (gather + weighted sum)."""
    return unpermute(expert_out, permuted, impl="xla", **kwargs)


_checks.twin_signature(permute_reference, permute)
_checks.twin_signature(unpermute_reference, unpermute)
