"""The implementation policy of every op: one vocabulary, resolved in one place.

Every ``impl=`` of jaxops, from :func:`jaxops.rms_norm` to ``MoEDecoder``, takes the same values
and means the same, resolved per op family by :func:`resolve_impl` (queried publicly through
:func:`jaxops.choose_impl`):

- None: the global default (below), which is "best available": the custom call where jaxops has
  one for the platform, the pure-JAX twin elsewhere.
- "ffi": the custom call is required; an op family without one on the platform raises.
- "xla": the pure-JAX twin.
- a tuple such as ``("ffi", "xla")``: an ordered preference, the first the platform has ("xla"
  always exists), whatever the global default.

The global default is part of jax's configuration and of the jit cache key, so flipping it
retraces jitted functions instead of silently reusing kernels traced before.

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
    "IMPLS",
    "Impl",
    "ImplChoice",
    "check_impl",
    "default_impl",
    "get_default_impl",
    "resolve_impl",
    "set_default_impl",
]

Impl = Literal["ffi", "xla"]
#: What ``impl=`` takes: None, one of :data:`IMPLS`, or a tuple of them in order of preference.
ImplChoice = Impl | tuple[Impl, ...] | None
#: The implementations: jaxops' custom call ("ffi") and its pure-JAX twin ("xla").
IMPLS = ("ffi", "xla")
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


def _check(op: str, impl: ImplChoice) -> str | tuple[str, ...]:
    """The normalized `impl`: "auto" (None), "ffi", "xla" or the preference tuple."""
    if impl is None:
        return "auto"
    if isinstance(impl, str) and impl in IMPLS:
        return impl
    if (
        isinstance(impl, tuple)
        and impl
        and all(isinstance(i, str) and i in IMPLS for i in impl)
        and len(set(impl)) == len(impl)
    ):
        return impl
    raise InvalidArgumentError(
        f"{op}: impl must be None, 'ffi', 'xla' or a tuple of them in order of preference "
        f"(e.g. ('ffi', 'xla')), got {impl!r}"
    )


def check_impl(op: str, impl: ImplChoice) -> ImplChoice:
    """`impl` when :func:`resolve_impl` takes it; else an InvalidArgumentError starting `op`."""
    _check(op, impl)
    return impl


def set_default_impl(impl: Impl | None) -> None:
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
    jax.config.update("jaxops_impl", _global("jaxops.set_default_impl", impl))


def get_default_impl() -> str:
    """The current default: ``"auto"``, ``"ffi"`` or ``"xla"``."""
    return _impl_state.value


@contextlib.contextmanager
def default_impl(impl: Impl | None) -> Iterator[None]:
    """Context manager form of :func:`set_default_impl`, local to the current thread.

    Example:
      >>> import jax.numpy as jnp, jaxops
      >>> with jaxops.default_impl("xla"):
      ...     y = jaxops.rms_norm(jnp.ones((2, 8)))
    """
    with _impl_state(_global("jaxops.default_impl", impl)):
        yield


def _global(op: str, impl: Impl | None) -> str:
    """The global default's value of `impl`: None ("auto"), "ffi" or "xla" (no preference)."""
    value = _check(op, impl)
    if isinstance(value, tuple):
        raise InvalidArgumentError(f"{op}: impl must be None, 'ffi' or 'xla', got {impl!r}")
    return value


def resolve_impl(impl: ImplChoice, *, kernel_available: bool, op: str = "jaxops") -> Impl:
    """The one place an ``impl=`` is resolved: its own value, else the global default.

    Args:
      impl: the op's ``impl`` argument (:data:`ImplChoice`).
      kernel_available: whether a custom call of the op exists for the platform traced for.
      op: the public name of the op, which starts the error messages.

    Returns:
      "ffi" (run the custom call) or "xla" (run the pure-JAX twin).

    Raises:
      InvalidArgumentError: an unknown `impl`, or "ffi" required (alone, or as the only
        preference) where no kernel exists.

    Example:
      >>> from jaxops._config import resolve_impl
      >>> resolve_impl(("ffi", "xla"), kernel_available=False)
      'xla'
      >>> resolve_impl(None, kernel_available=True)
      'ffi'
    """
    choice = _check(op, impl)
    if choice == "auto":
        choice = _impl_state.value
    if choice == "auto":  # the best available
        return "ffi" if kernel_available else "xla"
    order = (choice,) if isinstance(choice, str) else choice
    for candidate in order:
        if candidate == "xla" or kernel_available:
            return candidate
    raise InvalidArgumentError(
        f"{op}: impl={impl!r} requires a custom call, but jaxops has none for this op on this "
        "platform (on GPU, jaxops must be built with CUDA; see jaxops.build_info() and "
        "jaxops.choose_impl); pass impl=('ffi', 'xla') to prefer the custom call where it exists"
    )
