"""Trace-time argument validation shared by every jaxops op.

Each check raises a ValueError or TypeError whose message starts with the op's public name (the
`op` argument, e.g. ``"jaxops.rms_norm"``) and names the argument, what was expected and what
came. :func:`renamed_keywords` keeps a renamed keyword working for one release.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxops._errors import ArgumentTypeError, InvalidArgumentError, renamed_kwargs

__all__ = [
    "twin_signature",
    "FLOAT_DTYPES",
    "FP8_DTYPES",
    "check_array",
    "check_bool",
    "check_int",
    "check_positive_float",
    "dtype_name",
    "renamed_keywords",
]

_F = TypeVar("_F", bound=Callable[..., Any])

FLOAT_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(jnp.float32),
    np.dtype(jnp.bfloat16),
    np.dtype(jnp.float16),
)
FP8_DTYPES: tuple[np.dtype, ...] = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


def dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def check_array(
    op: str,
    name: str,
    value: Any,
    *,
    dtypes: Sequence[np.dtype] = FLOAT_DTYPES,
    min_rank: int = 0,
) -> jax.Array:
    """Returns `value` as a jax array after checking its dtype and rank.

    Raises:
      TypeError: if `value` is not an array or its dtype is not one of `dtypes`.
      ValueError: if its rank is below `min_rank`.
    """
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        if isinstance(value, (int, float, bool, complex)) or value is None:
            raise ArgumentTypeError(f"{op}: {name} must be an array, got {type(value).__name__}")
        value = jnp.asarray(value)
    dtype = np.dtype(value.dtype)
    if dtype not in dtypes:
        names = ", ".join(dtype_name(d) for d in dtypes)
        raise ArgumentTypeError(f"{op}: {name} must have dtype {names}; got {dtype_name(dtype)}")
    if value.ndim < min_rank:
        raise InvalidArgumentError(
            f"{op}: {name} must have rank >= {min_rank}, got shape {tuple(value.shape)}"
        )
    return value


def check_positive_float(op: str, name: str, value: Any) -> float:
    """A static, finite, strictly positive Python float."""
    if isinstance(value, jax.core.Tracer):
        raise ArgumentTypeError(f"{op}: {name} must be a static Python number, got a traced value")
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise ArgumentTypeError(
            f"{op}: {name} must be a number, got {type(value).__name__}"
        ) from None
    if not math.isfinite(result) or result <= 0.0:
        raise InvalidArgumentError(f"{op}: {name} must be finite and > 0, got {value!r}")
    return result


def check_int(op: str, name: str, value: Any, minimum: int) -> int:
    """A static Python int (not a bool) >= `minimum`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise InvalidArgumentError(f"{op}: {name} must be >= {minimum}, got {value}")
    return int(value)


def check_bool(op: str, name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")
    return bool(value)


def renamed_keywords(op: str, renames: Mapping[str, str]) -> Callable[[_F], _F]:
    """Decorator: the function also takes the old keywords of `renames` (old -> new).

    Each old keyword is passed on under its new name with a DeprecationWarning naming `op` (see
    :func:`jaxops._errors.renamed_kwargs`); giving both names is a TypeError.

    Example:
      >>> import warnings
      >>> @renamed_keywords("jaxops.example", {"recipe": "fp8"})
      ... def f(*, fp8="block"):
      ...     return fp8
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     f(recipe="tensor"), caught[0].category.__name__
      ('tensor', 'DeprecationWarning')
    """

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **renamed_kwargs(op, kwargs, renames))

        return wrapper  # type: ignore[return-value]

    return wrap


def twin_signature(twin: Callable, op: Callable) -> Callable:
    """Gives a twin the signature of `op` without `impl`; returns `twin`.

    For twins written ``def twin(x, ..., **kwargs)`` that forward to `op` with ``impl="xla"``:
    help(), IDEs and docs then show their real arguments.
    """
    sig = inspect.signature(op)
    params = [p for p in sig.parameters.values() if p.name != "impl"]
    twin.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return twin
