"""The permuted layout: custom-call targets, limits, :func:`permuted_rows` and :class:`Permuted`."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxops import _checks
from jaxops._rows import round_up

__all__ = [
    "FP8_DTYPES",
    "INT32",
    "MAX_ALIGN",
    "MAX_ROWS",
    "TARGET_PERMUTE",
    "TARGET_ROUTE",
    "TARGET_UNPERMUTE",
    "TARGET_UNPERMUTE_BWD",
    "TOKEN_DTYPES",
    "Permuted",
    "Route",
    "permuted_rows",
]

TARGET_ROUTE = "jaxops_moe_route"
TARGET_PERMUTE = "jaxops_moe_permute"
TARGET_UNPERMUTE = "jaxops_moe_unpermute"
TARGET_UNPERMUTE_BWD = "jaxops_moe_unpermute_bwd"

#: Largest supported ``align``.
MAX_ALIGN = 4096
#: Largest slot or row count (int32 indices).
MAX_ROWS = 2**31 - 1

FP8_DTYPES = _checks.FP8_DTYPES
#: Dtypes of the rows permute and unpermute move.
TOKEN_DTYPES = (*_checks.FLOAT_DTYPES, *FP8_DTYPES)
INT32 = (np.dtype(np.int32),)


def permuted_rows(
    num_tokens: int, top_k: int, num_experts: int, align: int = 1, capacity: int | None = None
) -> int:
    """The static row count R of :func:`permute`'s output: every routing fits.

    ``R = T * K + E * (align - 1)``; with a capacity C also at most
    ``E * round_up(min(C, T * K), align)``.

    Example:
      >>> from jaxops import moe
      >>> moe.permuted_rows(4096, 8, 128, align=16), moe.permuted_rows(8, 2, 4, capacity=3)
      (34688, 12)
    """
    slots = num_tokens * top_k
    rows = slots + num_experts * (align - 1)
    if capacity is not None:
        rows = min(rows, num_experts * round_up(min(capacity, slots), align))
    return rows


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Permuted:
    """Tokens grouped by expert, and what :func:`unpermute` needs to bring them back.

    R is :func:`permuted_rows`; T, K come from ``expert_ids``; E is ``num_experts``.

    Attributes:
      tokens: ``[R, H]`` in the tokens' dtype; expert e's rows are
        ``group_offsets[e] : group_offsets[e] + group_sizes[e]``, zero padding at the end of
        each group and from ``num_rows`` on.
      scales: float32 ``[R, S]`` (the FP8 scales moved along with their rows), or None.
      probs: float32 ``[R]``, each row's routing probability (0 on padding rows), or None.
      group_sizes: int32 ``[E]``, padded group sizes (``jax.lax.ragged_dot``'s group_sizes).
      group_offsets: int32 ``[E + 1]``; ``group_offsets[E] == num_rows``.
      row_map: int32 ``[T, K]``, the row of slot (t, k), -1 if unused or dropped.
      source: int32 ``[R]``, the slot ``t * K + k`` each row holds, -1 on padding rows.
      num_rows: int32 ``[]``, rows in use (padding included).
      dropped: int32 ``[E]``, slots each expert dropped because of its capacity.
      num_experts: E.
      align: the group size multiple.
      capacity: the per-expert slot limit, or None.
    """

    tokens: jax.Array
    scales: jax.Array | None
    probs: jax.Array | None
    group_sizes: jax.Array
    group_offsets: jax.Array
    row_map: jax.Array
    source: jax.Array
    num_rows: jax.Array
    dropped: jax.Array
    num_experts: int = 1
    align: int = 1
    capacity: int | None = None

    def tree_flatten(self):
        fields = dataclasses.fields(self)
        children = tuple(getattr(self, f.name) for f in fields[:9])
        return children, (self.num_experts, self.align, self.capacity)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def kept(self) -> jax.Array:
        """Whether slot (t, k) has a row (used and not dropped): bool ``[T, K]``."""
        return self.row_map >= 0


@dataclasses.dataclass(frozen=True)
class Route:
    """The static configuration of one routing: E, align, capacity and the row count R."""

    experts: int
    align: int
    capacity: int | None
    rows: int

    @property
    def capacity_attr(self) -> int:
        """The kernels' capacity attribute: -1 for none."""
        return -1 if self.capacity is None else self.capacity
