"""A training or inference batch of the decoder: validation and the token placement.

:func:`check_batch` validates what a public method of :class:`~jaxops.models.MoEDecoder` gets
(tokens, targets, ``attention_mask``, ``positions``, ``segment_ids``), before anything is traced:
shapes, dtypes, for host (numpy) arrays the range of every id, and for concrete arrays (not
traced under ``jax.jit``) the values of the masks: ``attention_mask`` only 0/1, ``segment_ids``
only ``>= 0``. :func:`placement` turns the masks into the
:class:`~jaxops.models._layers.Tokens` every layer's attention mask is built from.
:func:`split_microbatches` cuts a batch into microbatches that stay on the devices holding them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops import _checks
from jaxops._errors import InvalidArgumentError
from jaxops._sharding import place

from ._layers import IGNORE_INDEX, Tokens

__all__ = ["Batch", "check_batch", "placement", "split_microbatches"]

_INT_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_MASK_DTYPES = (np.dtype(bool), *_INT_DTYPES)


@dataclasses.dataclass(frozen=True)
class Batch:
    """A validated batch: int ``tokens [B, S]``, ``targets [B, S]`` (or None) and the masks.

    ``index``: the tokens' time steps where they are not ``0 .. S-1`` (the rows of a context
    axis, :mod:`~jaxops.models._context`), else None. ``mtp_tokens`` / ``mtp_targets [B, S,
    D]``: the inputs and targets of the D multi-token-prediction depths
    (:func:`~jaxops.models._mtp.shifted`), or None.
    """

    tokens: jax.Array
    targets: jax.Array | None
    attention_mask: jax.Array | None
    positions: jax.Array | None
    segment_ids: jax.Array | None
    index: jax.Array | None = None
    mtp_tokens: jax.Array | None = None
    mtp_targets: jax.Array | None = None


jax.tree_util.register_dataclass(
    Batch,
    data_fields=[
        *("tokens", "targets", "attention_mask", "positions", "segment_ids", "index"),
        *("mtp_tokens", "mtp_targets"),
    ],
    meta_fields=[],
)


def _host_range(op: str, name: str, a: Any, vocab: int, ignore: bool, real: Any = None) -> None:
    """Refuses ids outside ``[0, vocab)`` (and not IGNORE_INDEX when `ignore`) in a host array.

    `real`: a host bool array of the real tokens (padding is not looked at), or None (all).
    """
    if isinstance(a, jax.Array):
        return  # device arrays are not copied back to look (see the methods' docstrings)
    a = np.asarray(a)
    bad = (a < 0) | (a >= vocab)
    if ignore:
        bad &= a != IGNORE_INDEX
    if real is not None:
        bad &= real
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InvalidArgumentError(
            f"{op}: {name} holds id {int(a[where])} at {where}, outside [0, {vocab}) (the "
            f"vocabulary size{'; -100 marks an ignored target' if ignore else ''})"
        )


def _mask_values(op: str, name: str, a: Any, what: str) -> None:
    """Refuses an `attention_mask` holding other than 0/1 or `segment_ids` holding ids < 0.

    Host arrays and concrete device arrays (copied to the host: a ``[B, S]`` mask) are looked
    at; traced ones (under ``jax.jit``) cannot be, and are not. No jax op runs here, so a
    concrete array closed over by a jitted function is checked as a constant.
    """
    if isinstance(a, jax.core.Tracer) or a.dtype == bool:
        return
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return
    a = np.asarray(a)
    bad = (a < 0) if name == "segment_ids" else ((a != 0) & (a != 1))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InvalidArgumentError(
            f"{op}: {name} must hold {what}, got {int(a[where])} at {where} "
            f"({int(bad.sum())} such entries)"
        )


def _array(op: str, name: str, a: Any, dtypes: tuple, shape: tuple | None) -> jax.Array:
    a = _checks.check_array(op, name, a, dtypes=dtypes, min_rank=2)
    want = "[batch, seq]" if shape is None else f"the shape of tokens {shape}"
    if a.ndim != 2 or (shape is not None and tuple(a.shape) != shape):
        verb = "be" if shape is None else "have"
        raise InvalidArgumentError(f"{op}: {name} must {verb} {want}, got shape {tuple(a.shape)}")
    return a


def check_batch(
    op: str,
    vocab: int,
    multiple: int,
    why: str,
    tokens: Any,
    targets: Any = None,
    *,
    attention_mask: Any = None,
    positions: Any = None,
    segment_ids: Any = None,
    need_targets: bool = False,
) -> Batch:
    """Validates a batch; every message names `op` and the argument.

    Args:
      op: the public name of the method.
      vocab: the vocabulary size V (host ids are checked against it).
      multiple: the batch must be a multiple of this; `why` says why (the devices, ...).
      why: the reason for `multiple`, in words.
      tokens: int32/int64 ``[B, S]``.
      targets: like tokens; ids in ``[0, V)`` or IGNORE_INDEX (-100).
      attention_mask: bool or int ``[B, S]`` (0 = padding, 1 = a token) or None; an int mask
        holding any other value is refused where it is concrete (not traced under ``jax.jit``).
      positions: int ``[B, S]`` rotary positions or None.
      segment_ids: int ``[B, S]`` documents (0 = padding, 1, 2, ... the documents) or None; a
        negative id is refused where it is concrete (not traced under ``jax.jit``).
      need_targets: targets must be given.

    Raises:
      InvalidArgumentError: (a ValueError) an argument of the wrong shape or values.
      ArgumentTypeError: (a TypeError) an argument that is no array or of the wrong dtype.
    """
    host = {"tokens": tokens, "targets": targets}
    tokens = _array(op, "tokens", tokens, _INT_DTYPES, None)
    shape = tuple(tokens.shape)
    if shape[0] % multiple:
        raise InvalidArgumentError(
            f"{op}: tokens' batch ({shape[0]}) must be a multiple of {multiple} {why}"
        )
    if need_targets and targets is None:
        raise InvalidArgumentError(f"{op}: targets are required")
    if targets is not None:
        targets = _array(op, "targets", targets, _INT_DTYPES, shape)
    real = None  # host bool [B, S] of the real tokens, when the masks are host arrays
    for m in (attention_mask, segment_ids):
        if m is not None and not isinstance(m, jax.Array):
            m = np.asarray(m) != 0
            real = m if real is None else real & m
    if attention_mask is not None:
        attention_mask = _array(op, "attention_mask", attention_mask, _MASK_DTYPES, shape)
        _mask_values(op, "attention_mask", attention_mask, "only 0 (padding) and 1 (a token)")
    if positions is not None:
        positions = _array(op, "positions", positions, _INT_DTYPES, shape)
    if segment_ids is not None:
        segment_ids = _array(op, "segment_ids", segment_ids, _INT_DTYPES, shape)
        _mask_values(op, "segment_ids", segment_ids, "ids >= 0 (0 = padding, 1, 2, ... documents)")
    _host_range(op, "tokens", host["tokens"], vocab, ignore=False, real=real)
    if targets is not None:
        _host_range(op, "targets", host["targets"], vocab, ignore=True)
    return Batch(tokens, targets, attention_mask, positions, segment_ids)


def placement(batch: Batch) -> Tokens:
    """The :class:`Tokens` of a batch: time steps, rotary positions, documents.

    Documents: ``segment_ids`` where given (0 = padding), else one document per row; a zero
    ``attention_mask`` makes a token padding either way. Positions: ``positions`` where given;
    else the index within the token's document with segment ids; else, with an attention mask,
    the count of real tokens before it (``cumsum(mask) - 1``, what transformers' generate passes
    for left padding); else ``0 .. S-1``.
    """
    b, s = batch.tokens.shape
    index = batch.index
    if index is None:
        index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    segments = None  # one document per row, no padding
    if batch.segment_ids is not None:
        segments = batch.segment_ids.astype(jnp.int32)
    if batch.attention_mask is not None:
        real = batch.attention_mask != 0
        segments = real.astype(jnp.int32) if segments is None else jnp.where(real, segments, 0)
    if batch.positions is not None:
        positions = batch.positions.astype(jnp.int32)
    elif batch.segment_ids is not None:
        starts = jnp.concatenate(
            [jnp.ones((b, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1
        )
        first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
        positions = index - first
    elif batch.attention_mask is not None:
        positions = jnp.maximum(jnp.cumsum(batch.attention_mask != 0, axis=1) - 1, 0)
        positions = positions.astype(jnp.int32)
    else:
        positions = index
    return Tokens(index, positions, segments)


def split_microbatches(tree: Any, m: int, sharding: Any = None) -> Any:
    """``[B, ...]`` leaves as ``[M, B / M, ...]``, microbatch i the i-th slice of every shard.

    With the batch split over D devices (contiguous blocks), microbatch i takes rows
    ``[d B/D + i B/(D M), ...)`` of each device d, so every microbatch is split over the same
    D devices and no row moves. `sharding`: ``(mesh, batch axes)`` to pin the result's layout.
    """

    def cut(a):
        shards = 1
        if sharding is not None:
            mesh, axes = sharding
            shards = int(np.prod([dict(mesh.shape)[x] for x in axes]))
        b = a.shape[0]
        a = a.reshape(shards, m, b // (shards * m), *a.shape[1:])
        a = jnp.swapaxes(a, 0, 1).reshape(m, b // m, *a.shape[3:])
        if sharding is None:
            return a
        spec = P(None, sharding[1])
        placed = place(a, sharding[0], spec)
        if placed is a:  # not an Explicit mesh: a constraint for the partitioner
            placed = jax.lax.with_sharding_constraint(a, NamedSharding(sharding[0], spec))
        return placed

    return jax.tree.map(cut, tree)
