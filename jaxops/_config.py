"""The global implementation switch: force the pure-JAX twins of every op.

The switch is part of jax's configuration and of the jit cache key, so flipping it retraces
jitted functions instead of silently reusing kernels traced before.

- Environment: ``JAXOPS_IMPL=xla`` (read at import).
- Python: ``jaxops.set_default_impl("xla")`` / ``jaxops.set_default_impl(None)``, or the context
  manager ``with jaxops.default_impl("xla"): ...``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Literal

import jax
from jax._src import config as _jax_config

from jaxops._errors import InvalidArgumentError

__all__ = [
    "Impl",
    "check_impl",
    "default_impl",
    "get_default_impl",
    "resolve_impl",
    "set_default_impl",
]

Impl = Literal["ffi", "xla"]
_CHOICES = ("auto", "ffi", "xla")


def _env_default() -> str:
    value = os.environ.get("JAXOPS_IMPL", "auto").strip().lower() or "auto"
    if value not in _CHOICES:
        raise InvalidArgumentError(
            f"jaxops: the environment variable JAXOPS_IMPL must be one of {_CHOICES}, got {value!r}"
        )
    return value


_impl_state = _jax_config.enum_state(
    name="jaxops_impl",
    enum_values=list(_CHOICES),
    default=_env_default(),
    help="jaxops: 'auto' uses the custom calls, 'xla' forces the pure-JAX twins, 'ffi' requires "
    "the custom calls.",
    include_in_jit_key=True,
    include_in_trace_context=True,
)


def _check(op: str, impl: str | None) -> str:
    value = "auto" if impl is None else impl
    if value not in _CHOICES:
        raise InvalidArgumentError(f"{op}: impl must be None, 'ffi' or 'xla', got {impl!r}")
    return value


def check_impl(op: str, impl: str | None) -> str | None:
    """`impl` when it is None, "ffi" or "xla"; else a ValueError whose message starts with `op`."""
    _check(op, impl)
    return impl


def set_default_impl(impl: str | None) -> None:
    """Sets the process-wide default implementation of every jaxops op.

    Args:
      impl: ``"xla"`` forces the pure-JAX twins everywhere, ``"ffi"`` requires the custom calls,
        None restores automatic choice (custom calls where available).

    Example:
      >>> import jaxops
      >>> jaxops.set_default_impl("xla")
      >>> jaxops.get_default_impl()
      'xla'
      >>> jaxops.set_default_impl(None)
    """
    jax.config.update("jaxops_impl", _check("jaxops.set_default_impl", impl))


def get_default_impl() -> str:
    """The current default: ``"auto"``, ``"ffi"`` or ``"xla"``."""
    return _impl_state.value


@contextlib.contextmanager
def default_impl(impl: str | None) -> Iterator[None]:
    """Context manager form of :func:`set_default_impl`, local to the current thread.

    Example:
      >>> import jax.numpy as jnp, jaxops
      >>> with jaxops.default_impl("xla"):
      ...     y = jaxops.rms_norm(jnp.ones((2, 8)))
    """
    with _impl_state(_check("jaxops.default_impl", impl)):
        yield


def resolve_impl(impl: str | None, *, kernel_available: bool, op: str = "jaxops") -> Impl:
    """Picks the implementation of one call: its own `impl`, else the global default.

    Args:
      impl: the op's ``impl`` argument (None, "ffi" or "xla").
      kernel_available: whether a custom call exists for the platform being traced for.
      op: the public name of the op, which starts the error messages.

    Raises:
      ValueError: on an unknown `impl`, or "ffi" requested where no kernel exists.
    """
    choice = _check(op, impl)
    if choice == "auto":
        choice = _impl_state.value
    if choice == "xla":
        return "xla"
    if not kernel_available:
        if choice == "ffi":
            raise InvalidArgumentError(
                f"{op}: impl='ffi' was requested but jaxops has no custom call for this platform "
                "(on GPU, jaxops must be built with CUDA; see jaxops.build_info())"
            )
        return "xla"
    return "ffi"
