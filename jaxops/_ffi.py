"""The one registration point of jaxops' XLA FFI targets.

Every compiled module (``_jaxops_cpu`` always, ``_jaxops_cuda`` when CUDA was built) lists its
handlers as ``(target name, capsule or dict of stage capsules, stateful)`` and the types of their
state. Stateless targets are registered at import for platform ``"cpu"`` and ``"CUDA"``; stateful
ones, and before them their state types (which need the backend to exist first), on first use
through :func:`ensure_registered`.

At import the FFI C API version the modules were compiled against is compared with the one of the
running jaxlib, and an incompatible skew raises :class:`JaxlibVersionError` with both versions.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import threading
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import jax
import jaxlib.version

from jaxops._config import resolve_impl
from jaxops._sharding import vary_like

__all__ = [
    "JaxlibVersionError",
    "build_info",
    "cuda_available",
    "ensure_registered",
    "ffi_call",
]

_PLATFORM_OF_MODULE = {"_jaxops_cpu": "cpu", "_jaxops_cuda": "CUDA"}


class JaxlibVersionError(ImportError):
    """The running jaxlib cannot load handlers compiled against the jaxlib jaxops was built with."""


@dataclass(frozen=True)
class _Target:
    name: str
    platform: str
    capsule: Any
    stateful: bool


def _runtime_ffi_api_version() -> tuple[int, int] | None:
    """The XLA FFI C API (major, minor) of the running jaxlib, from the headers it ships."""
    header = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
    try:
        with open(header, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    major = re.search(r"#define\s+XLA_FFI_API_MAJOR\s+(\d+)", text)
    minor = re.search(r"#define\s+XLA_FFI_API_MINOR\s+(\d+)", text)
    if major is None or minor is None:
        return None
    return int(major.group(1)), int(minor.group(1))


def check_compatibility(info: dict[str, Any], runtime: tuple[int, int] | None) -> None:
    """Raises JaxlibVersionError if handlers built as `info` describes cannot run on `runtime`.

    Handlers speak the XLA FFI C API. They load on a jaxlib whose FFI API has the same major
    version and the same or a newer minor version than the one they were compiled against.

    Args:
      info: a module's ``build_info()`` (``jaxlib_version``, ``ffi_api_major``, ``ffi_api_minor``).
      runtime: the running jaxlib's FFI API ``(major, minor)``, or None when it cannot be read.
    """
    if runtime is None:
        return
    built = (int(info["ffi_api_major"]), int(info["ffi_api_minor"]))
    if runtime[0] != built[0] or runtime[1] < built[1]:
        raise JaxlibVersionError(
            f"jaxops {info['platform']} kernels were built against jaxlib "
            f"{info['jaxlib_version']} (XLA FFI API {built[0]}.{built[1]}), but the running jaxlib "
            f"{jaxlib.version.__version__} provides XLA FFI API {runtime[0]}.{runtime[1]}. "
            "Rebuild jaxops against the installed jaxlib: "
            "pip install --no-build-isolation --force-reinstall --no-deps jaxops"
        )


def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"jaxops.{name}")
    except ImportError as e:
        if name == "_jaxops_cpu":
            raise ImportError(
                "jaxops' compiled CPU module is missing: jaxops must be installed with pip "
                "(pip install .), not imported from its source tree"
            ) from e
        if isinstance(e, ModuleNotFoundError) and e.name == f"jaxops.{name}":
            return None  # not built
        # Built but not loadable, e.g. the cuBLASLt it links is missing (pip install nvidia-cublas,
        # which jax[cuda13] installs).
        warnings.warn(
            f"jaxops: the compiled module {name} failed to load ({e}); its kernels are "
            "unavailable and the pure-JAX implementations run instead",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}
_pending: dict[tuple[str, str], _Target] = {}
_pending_types: dict[str, list[tuple[str, Any]]] = {}  # by platform
_registered: set[tuple[str, str]] = set()


def _register(target: _Target) -> None:
    jax.ffi.register_ffi_target(target.name, target.capsule, platform=target.platform)
    _registered.add((target.name, target.platform))


def _initialize() -> None:
    runtime = _runtime_ffi_api_version()
    for name, platform in _PLATFORM_OF_MODULE.items():
        module = _load(name)
        if module is None:
            continue
        check_compatibility(module.build_info(), runtime)
        _modules[platform] = module
        _pending_types[platform] = list(module.types())
        for target_name, capsule, stateful in module.registrations():
            target = _Target(target_name, platform, capsule, stateful)
            if stateful:
                _pending[(target_name, platform)] = target
            else:
                _register(target)


def ensure_registered(name: str) -> None:
    """Registers the stateful target `name` on every platform, once, after backends exist."""
    with _lock:
        todo = [t for key, t in _pending.items() if key[0] == name]
        if not todo:
            return
        jax.devices()  # backends first: FFI types must be registered after backend start-up
        for target in todo:
            for type_name, registration in _pending_types.pop(target.platform, []):
                jax.ffi.register_ffi_type(type_name, registration, platform=target.platform)
            _register(target)
            del _pending[(target.name, target.platform)]


@functools.cache
def kernel_available(backend: str) -> bool:
    """Whether jaxops has custom calls for `backend` ("cpu", "gpu"/"cuda"; not ROCm)."""
    if backend == "cpu":
        return True
    if backend in ("gpu", "cuda"):
        platform_version = jax.devices(backend)[0].client.platform_version.lower()
        return cuda_available() and "rocm" not in platform_version
    return False


def use_kernel(impl: str | None) -> bool:
    """Whether an op called with `impl` runs its custom call on the default backend."""
    return resolve_impl(impl, kernel_available=kernel_available(jax.default_backend())) == "ffi"


def ffi_call(
    target: str, out_types: Any, *operands: Any, vmap_method: str = "sequential", **attrs: Any
) -> Any:
    """``jax.ffi.ffi_call(target, out_types)(*operands, **attrs)`` with shard_map-correct types.

    Inside shard_map the results are marked varying over the axes the operands vary over (see
    :func:`jaxops._sharding.vary_like`).
    """
    call = jax.ffi.ffi_call(target, out_types, vmap_method=vmap_method)
    return vary_like(call(*operands, **attrs), *operands)


def cuda_available() -> bool:
    """Whether the CUDA module of jaxops was built and loaded."""
    return "CUDA" in _modules


def build_info() -> dict[str, dict[str, Any]]:
    """What each compiled module was built with, keyed by platform ("cpu", "CUDA").

    Example:
      >>> import jaxops
      >>> jaxops.build_info()["cpu"]["platform"]
      'cpu'
    """
    return {platform: dict(module.build_info()) for platform, module in _modules.items()}


def registered_targets() -> list[tuple[str, str]]:
    """(target name, platform) pairs registered with XLA so far."""
    return sorted(_registered)


_initialize()
