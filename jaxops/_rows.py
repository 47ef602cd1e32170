"""Row helpers shared by the MoE ops, the FP8 layouts and the expert-parallel layer (core tier).

Example:
  >>> import jax.numpy as jnp
  >>> from jaxops._rows import round_up, take_rows
  >>> round_up(10, 8)
  16
  >>> take_rows(jnp.arange(6.0).reshape(3, 2), jnp.array([2, 9]), jnp.array([True, False]))
  Array([[4., 5.],
         [0., 0.]], dtype=float32)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["round_up", "take_rows"]


def round_up(a: int, b: int) -> int:
    """The smallest multiple of `b` (> 0) that is >= `a` (Python ints)."""
    return -(-a // b) * b


def take_rows(x: jax.Array, index: jax.Array, valid: jax.Array) -> jax.Array:
    """``x[index]`` where `valid`, zero elsewhere (`index` may be anything where not valid).

    Args:
      x: ``[N, ...]`` rows of any dtype (N may be 0).
      index: integer array of any shape ``I``.
      valid: bool array of shape ``I``.

    Returns:
      ``[*I, ...]`` in x's dtype.
    """
    if x.shape[0] == 0:
        return jnp.zeros(index.shape + x.shape[1:], x.dtype)
    rows = x[jnp.where(valid, index, 0)]
    mask = valid.reshape(valid.shape + (1,) * (rows.ndim - valid.ndim))
    return jnp.where(mask, rows, jnp.zeros((), x.dtype))
