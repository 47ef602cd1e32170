"""MoE token permutation as XLA FFI custom calls, with pure-JAX twins (API: :mod:`jaxops.moe`).

A routing sends each of T tokens to K expert slots (``expert_ids[t, k]``; ids outside
``[0, E)``, -1 included, mark unused slots). Slot ``s = t * K + k``. :func:`permute` groups the
used slots by expert, in ascending expert order and, within an expert, in slot order (token
order, then k): the result is deterministic. Expert e keeps its first ``min(n_e, capacity)``
slots and drops the later ones; its group is padded with zero rows to a multiple of ``align``::

    group_sizes[e]   = round_up(min(n_e, capacity), align)
    group_offsets[e] = group_sizes[0] + ... + group_sizes[e - 1]

The permuted tensor has the static worst-case row count :func:`permuted_rows`::

    R = T * K + E * (align - 1)                                   (no capacity)
    R = min(T * K + E * (align - 1), E * round_up(min(C, T * K), align))   (capacity C)

and rows from ``num_rows = group_offsets[E]`` on are zero. Everything runs on device inside the
custom calls (a counting sort over experts, not a general sort); nothing is synchronized with
the host.

Layers, from the public functions down, and the modules that hold them: validation and choice of
implementation (``api``); ``jax.custom_vjp``, whose backward passes are custom calls too, never
scatter-adds (``autodiff``); ``custom_vmap`` (a batch runs as a loop over its examples) and
``custom_partitioning`` with Shardy rules over ``jax.ffi.ffi_call`` of the targets, for CPU and
CUDA (``partition``). ``layout`` holds the targets, :class:`Permuted` and :func:`permuted_rows`;
``reference`` the pure-JAX twins.

Sharding: the hidden axis may be sharded (tensor parallelism): every device moves its columns, no
collective (the backward all-reduces only the ``[T, K]`` probability gradient). The expert-grouped
layout is global, so tokens sharded along T cannot be permuted without communication: call
:func:`permute` inside ``shard_map`` (each device permutes its own tokens, no collective) or use
expert parallelism (:mod:`jaxops.parallel`). jaxops raises instead of gathering them silently.
"""

from jaxops._moe.api import permute, permute_reference, unpermute, unpermute_reference
from jaxops._moe.autodiff import unpermute_rows
from jaxops._moe.layout import (
    MAX_ALIGN,
    TARGET_PERMUTE,
    TARGET_ROUTE,
    TARGET_UNPERMUTE,
    TARGET_UNPERMUTE_BWD,
    Permuted,
    permuted_rows,
)

__all__ = [
    "MAX_ALIGN",
    "TARGET_PERMUTE",
    "TARGET_ROUTE",
    "TARGET_UNPERMUTE",
    "TARGET_UNPERMUTE_BWD",
    "Permuted",
    "permute",
    "permute_reference",
    "permuted_rows",
    "unpermute",
    "unpermute_reference",
    "unpermute_rows",
]
