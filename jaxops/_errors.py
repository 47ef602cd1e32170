"""The error vocabulary of every jaxops tier, and the deprecation of renamed keywords.

Every exception jaxops defines derives from :class:`JaxopsError`, and also from the builtin it
has always been (``ConfigError`` is a ``ValueError``, ``CheckpointError`` a ``RuntimeError``), so
``except JaxopsError`` catches them all and no caller's ``except ValueError`` breaks. Every
message starts with the public dotted name of what was called, e.g.
``"jaxops.rms_norm: x must have rank >= 1, got shape ()"``.

Renamed keywords keep their old name for one release: :func:`renamed_kwargs` maps the old name to
the new one with a :class:`DeprecationWarning` that names both.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "ConfigError",
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


class ConfigError(JaxopsError, ValueError):
    """A configuration jaxops cannot build.

    The message names the field or config.json key, what it needs and what came.
    """


def public_name(obj: Any) -> str:
    """The public dotted name of a class or function: its module path without private parts.

    ``jaxops.parallel.expert._config.MoEConfig`` -> ``"jaxops.parallel.expert.MoEConfig"``.
    """
    parts = [p for p in obj.__module__.split(".") if not p.startswith("_")]
    return ".".join([*parts, obj.__qualname__])


_PREFIXED = (ValueError, TypeError)


def named_errors(op: str) -> Callable[[Callable], Callable]:
    """Decorator: the errors a public entry point raises start with its public dotted name `op`.

    A :class:`JaxopsError`, or a plain ``ValueError`` / ``TypeError``, whose message does not
    already start with a jaxops name (``"jaxops."``) is raised again as the same type with
    ``"{op}: "`` in front, its traceback and cause kept. Other exceptions pass unchanged.
    """

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def named(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except (JaxopsError, *_PREFIXED) as e:
                message = str(e)
                if message.startswith("jaxops.") or not (
                    isinstance(e, JaxopsError) or type(e) in _PREFIXED
                ):
                    raise
                raise type(e)(f"{op}: {message}").with_traceback(e.__traceback__) from e.__cause__

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
            raise TypeError(f"{op}: got both {new}= and its deprecated name {old}=; pass {new}=")
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
