"""Numerical helpers shared by the tests (beside jaxops.testing's per-dtype tolerances)."""

from __future__ import annotations

import numpy as np


def rel_error(actual, expected) -> float:
    """Relative Frobenius error ``|actual - expected| / |expected|``, computed in float64."""
    a = np.asarray(actual, np.float64).ravel()
    b = np.asarray(expected, np.float64).ravel()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))
