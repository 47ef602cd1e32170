"""MoE token permutation for JAX: group tokens by expert and bring expert outputs back.

The public namespace ``jaxops.moe``; the implementation lives in ``jaxops._moe``.

- :func:`permute` -> :class:`Permuted` (tokens grouped by expert, padded per expert to a multiple
  of ``align``, optional capacity, FP8 scales and routing probabilities moved along);
- :func:`unpermute` (weighted sum of each token's expert rows, float32 accumulation);
- :func:`permuted_rows` (the static row count), the pure-JAX twins :func:`permute_reference` and
  :func:`unpermute_reference`, and :data:`MAX_ALIGN`.
"""

from jaxops._moe import (
    MAX_ALIGN,
    Permuted,
    permute,
    permute_reference,
    permuted_rows,
    unpermute,
    unpermute_reference,
)

__all__ = [
    "MAX_ALIGN",
    "Permuted",
    "permute",
    "permute_reference",
    "permuted_rows",
    "unpermute",
    "unpermute_reference",
]
