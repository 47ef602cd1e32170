"""Testing helpers: per-dtype tolerances and collective counting in compiled HLO.

Used by jaxops' own test suite and useful to check that user code built on jaxops stays local
under sharding.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxops import testing
  >>> text = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile().as_text()
  >>> testing.count_collectives(text)
  {}
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

__all__ = ["COLLECTIVES", "assert_allclose", "collective_shapes", "count_collectives", "tolerance"]

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "all-to-all",
    "collective-permute",
    "reduce-scatter",
    "ragged-all-to-all",
)

# Relative tolerance of one rounding to the dtype plus fp32 accumulation error.
_TOLERANCES = {
    "float64": {"rtol": 1e-12, "atol": 1e-12},
    "float32": {"rtol": 2e-5, "atol": 2e-5},
    "bfloat16": {"rtol": 2**-7, "atol": 2**-7},
    "float16": {"rtol": 2**-10, "atol": 2**-10},
}


def tolerance(dtype: Any) -> dict[str, float]:
    """``{"rtol": ..., "atol": ...}`` for comparing a result computed in `dtype` with float64.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops.testing import tolerance
      >>> tolerance(jnp.bfloat16)["rtol"]
      0.0078125
    """
    name = np.dtype(dtype).name
    if name not in _TOLERANCES:
        raise ValueError(f"tolerance: no tolerance for dtype {name}; known: {sorted(_TOLERANCES)}")
    return dict(_TOLERANCES[name])


def assert_allclose(
    actual: Any, expected: Any, dtype: Any = None, *, scale: float = 1.0, err_msg: str = ""
) -> None:
    """Asserts closeness with the tolerance of `dtype` (default: `actual`'s dtype) times `scale`.

    NaNs must be in the same places; infinities must match exactly.
    """
    dtype = np.asarray(actual).dtype if dtype is None else dtype
    tol = tolerance(dtype)
    np.testing.assert_allclose(
        np.asarray(actual, dtype=np.float64),
        np.asarray(expected, dtype=np.float64),
        rtol=tol["rtol"] * scale,
        atol=tol["atol"] * scale,
        equal_nan=True,
        err_msg=err_msg,
    )


_OP = re.compile(r"=\s*(\([^=]*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Counts collective instructions (async pairs counted once) in compiled HLO text."""
    counts: dict[str, int] = {}
    for match in _OP.finditer(hlo_text):
        counts[match.group(2)] = counts.get(match.group(2), 0) + 1
    return counts


def collective_shapes(hlo_text: str, kind: str) -> list[str]:
    """Result shapes (e.g. ``"f32[16]{0}"``) of every `kind` collective in compiled HLO text."""
    return [m.group(1) for m in _OP.finditer(hlo_text) if m.group(2) == kind]
