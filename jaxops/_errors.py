"""The error vocabulary of every jaxops tier, and the deprecation of renamed keywords.

Every exception jaxops raises on bad input derives from :class:`JaxopsError`, and also from the
builtin it has always been, so ``except JaxopsError`` catches them all and no caller's
``except ValueError`` / ``except TypeError`` breaks:

- :class:`InvalidArgumentError` (a ``ValueError``): an argument of the right type but a value,
  shape or combination the call cannot take;
- :class:`ArgumentTypeError` (a ``TypeError``): an argument of the wrong type, or a traced value
  where a static one is needed;
- :class:`ConfigError` (an :class:`InvalidArgumentError`): a configuration jaxops cannot build;
- ``jaxops.parallel.checkpoint.CheckpointError`` (a ``RuntimeError``): files that do not hold
  what they should.

Every message starts, exactly once, with the public dotted name of what the user called, e.g.
``"jaxops.rms_norm: x must have rank >= 1, got shape ()"``. :func:`named_errors` puts it there at
the public boundary: the outermost public call names the error, whatever name an inner public
call gave it.

Renamed keywords keep their old name for one release: :func:`renamed_kwargs` maps the old name to
the new one with a :class:`DeprecationWarning` that names both.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "ArgumentTypeError",
    "ConfigError",
    "InvalidArgumentError",
    "JaxopsError",
    "named_errors",
    "public_name",
    "renamed_fields",
    "renamed_kwargs",
]


class JaxopsError(Exception):
    """Base class of the exceptions jaxops defines.

    Example:
      >>> import jaxops
      >>> issubclass(jaxops.ConfigError, jaxops.JaxopsError)
      True
    """


class InvalidArgumentError(JaxopsError, ValueError):
    """An argument jaxops cannot take: a value, shape or combination out of its domain.

    A ``ValueError``. The message starts with the public name of the call and names the argument,
    what it must be and what came.

    Example:
      >>> import jax.numpy as jnp, jaxops
      >>> try:
      ...     jaxops.rms_norm(jnp.ones(()))
      ... except jaxops.InvalidArgumentError as e:
      ...     print(e)
      jaxops.rms_norm: x must have rank >= 1, got shape ()
    """


class ArgumentTypeError(JaxopsError, TypeError):
    """An argument of a type jaxops cannot take (or traced where a static value is needed).

    A ``TypeError``. The message starts with the public name of the call and names the argument,
    the type it must have and the type that came.
    """


class ConfigError(InvalidArgumentError):
    """A configuration jaxops cannot build.

    An :class:`InvalidArgumentError` (so a ``ValueError``). The message names the field or
    config.json key, what it needs and what came.
    """


def public_name(obj: Any) -> str:
    """The public dotted name of a class or function: its module path without private parts.

    ``jaxops.parallel.expert._config.MoEConfig`` -> ``"jaxops.parallel.expert.MoEConfig"``.
    """
    parts = [p for p in obj.__module__.split(".") if not p.startswith("_")]
    return ".".join([*parts, obj.__qualname__])


# The builtins a public call's plain errors are raised again as: same base, and a JaxopsError.
_UPGRADE: dict[type, type] = {ValueError: InvalidArgumentError, TypeError: ArgumentTypeError}
# "jaxops.a.b: " (a public dotted name) at the start of a message.
_NAMED = re.compile(r"jaxops(?:\.[A-Za-z_][A-Za-z0-9_]*)+: ")
# The public call now running in this thread / task, if any: the outermost one names errors.
_CALL: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxops_call", default=None)


def renamed(e: BaseException, op: str) -> BaseException | None:
    """`e` as the error of public call `op`, or None where `e` is not jaxops' to rename.

    A :class:`JaxopsError`, or a plain ``ValueError`` / ``TypeError`` (then raised as
    :class:`InvalidArgumentError` / :class:`ArgumentTypeError`), gets its message started by
    ``"{op}: "`` exactly once: a public name an inner call put there is replaced.
    """
    cls = type(e)
    if not isinstance(e, JaxopsError):
        if cls not in _UPGRADE:
            return None
        cls = _UPGRADE[cls]
    message = str(e)
    found = _NAMED.match(message)
    if found is not None:
        message = message[found.end() :]
    message = f"{op}: {message}"
    if cls is type(e) and message == str(e):
        return e
    try:
        new = cls(message)
    except Exception:  # a subclass whose constructor takes other arguments: left as it is
        return None
    new.__cause__, new.__suppress_context__ = e.__cause__, e.__suppress_context__
    return new.with_traceback(e.__traceback__)


def named_errors(op: str) -> Callable[[Callable], Callable]:
    """Decorator: the errors a public entry point raises start with its public dotted name `op`.

    Only the outermost public call renames (one public entry point calling another names the
    error by the one the user called): a :class:`JaxopsError`, or a plain ``ValueError`` /
    ``TypeError`` (raised again as :class:`InvalidArgumentError` / :class:`ArgumentTypeError`),
    gets ``"{op}: "`` in front of its message, in place of any ``"jaxops.<name>: "`` already
    there, its traceback and cause kept. Other exceptions pass unchanged.
    """

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def named(*args: Any, **kwargs: Any) -> Any:
            if _CALL.get() is not None:  # inside another public call: that one names the error
                return fn(*args, **kwargs)
            token = _CALL.set(op)
            try:
                return fn(*args, **kwargs)
            except (JaxopsError, ValueError, TypeError) as e:
                new = renamed(e, op)
                if new is None or new is e:
                    raise
                raise new from new.__cause__
            finally:
                _CALL.reset(token)

        return named

    return wrap


def renamed_kwargs(
    op: str, kwargs: dict[str, Any], renames: Mapping[str, str], *, stacklevel: int = 3
) -> dict[str, Any]:
    """`kwargs` with every deprecated keyword of `renames` (old -> new) moved to its new name.

    Each old name found issues one DeprecationWarning naming `op`, the old and the new keyword.
    Giving both names is a TypeError. The dict is changed in place and returned.
    """
    for old, new in renames.items():
        if old not in kwargs:
            continue
        if new in kwargs:
            raise ArgumentTypeError(
                f"{op}: got both {new}= and its deprecated name {old}=; pass {new}="
            )
        warnings.warn(
            f"{op}: the keyword {old}= is renamed {new}= and the old name goes in the next release",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        kwargs[new] = kwargs.pop(old)
    return kwargs


def renamed_fields(renames: Mapping[str, str]):
    """Class decorator for a dataclass whose fields `renames` (old -> new) were renamed.

    The constructor takes the old keyword with a DeprecationWarning (see :func:`renamed_kwargs`),
    and reading the old attribute returns the new one with a DeprecationWarning.
    """

    def wrap(cls: type) -> type:
        init = cls.__init__
        op = public_name(cls)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **renamed_kwargs(op, kwargs, renames))

        __init__.__doc__ = init.__doc__
        __init__.__signature__ = inspect.signature(init)  # type: ignore[attr-defined]
        cls.__init__ = __init__  # type: ignore[method-assign]
        for old, new in renames.items():

            def getter(self: Any, _old: str = old, _new: str = new) -> Any:
                warnings.warn(
                    f"{op}.{_old} is renamed {_new} and the old name goes in the next release",
                    DeprecationWarning,
                    stacklevel=2,
                )
                return getattr(self, _new)

            setattr(cls, old, property(getter, doc=f"Deprecated name of :attr:`{new}`."))
        return cls

    return wrap
