"""Where the tokens of a batch sit and which keys each query sees: the one mask builder.

:class:`Tokens` places every token (time step, rotary position, document); :func:`allowed`
builds the bool ``[b, sq, sk]`` mask of queries over keys from two placements (causal, sliding
window, Llama 4's chunks, packed documents, padding, KV-cache slots); :class:`Visible` holds
the same mask unbuilt, so that blockwise attention builds one block of it at a time
(:meth:`Visible.block`) and no ``[sq, sk]`` array need exist.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["Tokens", "Visible", "allowed"]


@dataclasses.dataclass(frozen=True)
class Tokens:
    """Where each token of a batch sits: its time index, its position and its document.

    The attention mask of every layer is built from these (:func:`allowed`), for the training
    forward and for the KV cache alike. A pytree (it passes through ``jit``, ``scan`` and the
    pipeline like the activations).

    Attributes:
      index: int32 ``[b, s]``: the time step (causality and sliding windows count in it;
        transformers' cache_position), ``0 .. s-1`` in a training batch.
      positions: int32 ``[b, s]``: the rotary position (transformers' position_ids).
      segments: int32 ``[b, s]``: the document of each token; 0 is padding, which no query
        sees and which never reaches the MoE router. A query sees keys of its own document only.
        None: one document per row, no padding (no mask work at all beyond causality).
    """

    index: jax.Array
    positions: jax.Array
    segments: jax.Array | None = None

    @property
    def valid(self) -> jax.Array | None:
        """The real tokens, bool ``[b, s]`` (segment != 0); None without segments (all real)."""
        return None if self.segments is None else self.segments != 0


jax.tree_util.register_dataclass(
    Tokens, data_fields=["index", "positions", "segments"], meta_fields=[]
)


def allowed(
    q: Tokens,
    k: Tokens,
    window: Any = None,
    *,
    chunk: Any = None,
    valid_keys: jax.Array | None = None,
) -> jax.Array:
    """Which key each query attends to, bool ``[b, sq, sk]`` (the one mask builder).

    A query sees a key of its own document (equal nonzero segment ids: padding and packed
    documents are excluded) at the same or an earlier time step, within `window` steps when
    given (``q - k < window``, transformers' sliding window), in the same `chunk` of rotary
    positions when given (``q_pos // chunk == k_pos // chunk``, Llama 4's chunked attention:
    transformers counts its chunks from each row's first real token, which is position 0).
    `window` and `chunk` may be traced int scalars (a scan over layers of different kinds; a
    huge value then means none). `valid_keys` ``[b, sk]`` further restricts the keys (the
    filled slots of a KV cache).
    """
    qi, ki = q.index[:, :, None], k.index[:, None, :]
    ok = qi >= ki
    if q.segments is not None and k.segments is not None:
        ok &= q.segments[:, :, None] == k.segments[:, None, :]
    if k.segments is not None:
        ok &= k.valid[:, None, :]
    if window is not None:
        ok &= qi - ki < window
    if chunk is not None:
        ok &= q.positions[:, :, None] // chunk == k.positions[:, None, :] // chunk
    if valid_keys is not None:
        ok &= valid_keys[:, None, :]
    return ok


@dataclasses.dataclass(frozen=True)
class Visible:
    """Which keys each query sees, unbuilt: :func:`allowed`'s arguments.

    Attributes:
      q: the queries' placement (``[b, sq]`` leaves).
      k: the keys' placement (``[b, sk]`` leaves).
      window: the sliding window in time steps, or None (a traced int scalar allowed).
      chunk: the attention chunk in rotary positions, or None (a traced int scalar allowed).
      valid_keys: bool ``[b, sk]`` (the filled slots of a KV cache), or None.
    """

    q: Tokens
    k: Tokens
    window: Any = None
    chunk: Any = None
    valid_keys: jax.Array | None = None

    def dense(self) -> jax.Array:
        """The whole mask, bool ``[b, sq, sk]``."""
        return allowed(self.q, self.k, self.window, chunk=self.chunk, valid_keys=self.valid_keys)

    def block(self, q0: jax.Array, nq: int, k0: jax.Array, nk: int, sk: int) -> jax.Array:
        """Queries ``q0 .. q0 + nq - 1`` over keys ``k0 .. k0 + nk - 1``: bool ``[b, nq, nk]``.

        `q0` and `k0` may be traced; the placements must hold those rows (pad them first).
        Keys at or past `sk` (the real key count: padding of the last block) are never seen.
        """

        def rows(t: Tokens, start: jax.Array, n: int) -> Tokens:
            return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, n, 1), t)

        valid = None
        if self.valid_keys is not None:
            valid = jax.lax.dynamic_slice_in_dim(self.valid_keys, k0, nk, 1)
        ok = allowed(
            rows(self.q, q0, nq), rows(self.k, k0, nk), self.window, chunk=self.chunk,
            valid_keys=valid,
        )  # fmt: skip
        return ok & (k0 + jnp.arange(nk) < sk)[None, None, :]


jax.tree_util.register_dataclass(
    Visible, data_fields=["q", "k", "window", "chunk", "valid_keys"], meta_fields=[]
)
