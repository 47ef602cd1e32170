"""The one registration point of jaxops' XLA FFI targets.

Every compiled module (``_jaxops_cpu`` always, ``_jaxops_cuda`` when CUDA was built) lists its
handlers as ``(target name, capsule or dict of stage capsules, stateful)`` and the types of their
state. Stateless targets are registered at import for platform ``"cpu"`` and ``"CUDA"``; stateful
ones, and before them their state types (which need the backend to exist first), on first use
through :func:`ensure_registered`.

At import the FFI C API version the modules were compiled against is compared with the one of the
running jaxlib, and an incompatible skew raises :class:`JaxlibVersionError` with both versions.
Where jax has a CUDA GPU backend but this install has no CUDA module (a CPU-only build), import
warns once with :class:`CudaModuleMissingWarning` instead of letting every op silently run its
pure-JAX twin; :func:`op_paths` tells which implementation each op family takes.
"""

from __future__ import annotations

import functools
import glob
import importlib
import importlib.util
import os
import re
import threading
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import jax
import jaxlib.version
import numpy as np

from jaxops._config import ImplChoice, get_default_impl, resolve_impl
from jaxops._errors import InvalidArgumentError, JaxopsError
from jaxops._sharding import vary_like

__all__ = [
    "CudaModuleMissingWarning",
    "JaxlibVersionError",
    "build_info",
    "choose_impl",
    "crc32c_chunks",
    "cuda_available",
    "ensure_registered",
    "ffi_call",
    "has_kernel",
    "op_paths",
]

_PLATFORM_OF_MODULE = {"_jaxops_cpu": "cpu", "_jaxops_cuda": "CUDA"}


class JaxlibVersionError(JaxopsError, ImportError):
    """The running jaxlib cannot load handlers compiled against the jaxlib jaxops was built with."""


class CudaModuleMissingWarning(UserWarning):
    """jax has a CUDA GPU backend, but this jaxops install has no CUDA module.

    Issued once, at import. Every op then runs its pure-JAX twin on the GPU. The fix: install the
    jaxops wheel with the CUDA module (``pip install 'jaxops[cuda13]'``), or build from source
    with nvcc on PATH and ``JAXOPS_CUDA=ON``.
    """


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
            "pip install --no-build-isolation --force-reinstall --no-deps jaxops; or, with the "
            f"jaxops wheel, install a jaxlib with XLA FFI API {built[0]}.x, x >= {built[1]}: "
            "pip install -U 'jaxops[cuda13]'"
        )


def _load(name: str) -> ModuleType | None:
    try:
        module = importlib.import_module(f"jaxops.{name}")
        _load_errors.pop(name, None)
        return module
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
        _load_errors[name] = str(e)
        warnings.warn(
            f"jaxops: the compiled module {name} failed to load ({e}); its kernels are "
            "unavailable and the pure-JAX implementations run instead",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


_lock = threading.Lock()
_load_errors: dict[str, str] = {}  # module name -> why a built module failed to load
_modules: dict[str, ModuleType] = {}
_pending: dict[tuple[str, str], _Target] = {}
_pending_types: dict[str, list[tuple[str, Any]]] = {}  # by platform
_registered: set[tuple[str, str]] = set()


def _register(target: _Target) -> None:
    jax.ffi.register_ffi_target(target.name, target.capsule, platform=target.platform)
    _registered.add((target.name, target.platform))


def _check_cpu_threads() -> None:
    """JAXOPS_CPU_THREADS, read by the CPU kernels: unset, or a positive integer."""
    value = os.environ.get("JAXOPS_CPU_THREADS")
    if value is not None and not (value.isascii() and value.isdigit() and int(value) > 0):
        raise InvalidArgumentError(
            "JAXOPS_CPU_THREADS must be a positive integer (the threads a jaxops CPU call splits "
            f"its work over) or unset, got {value!r}"
        )


#: JAXOPS_CPU_GEMM_KERNEL's values: the widest grouped GEMM micro-kernel the CPU calls may use.
CPU_GEMM_KERNELS = ("avx512", "avx2", "portable")


def _check_choice(variable: str, choices: tuple[str, ...], what: str) -> None:
    """Raises unless the environment variable is unset or one of `choices` (`what` it sets)."""
    value = os.environ.get(variable)
    if value is not None and value not in choices:
        raise InvalidArgumentError(
            f"{variable} must be one of {', '.join(repr(k) for k in choices)} ({what}) or "
            f"unset, got {value!r}"
        )


#: JAXOPS_GPU_GEMM_PIPELINE's values: the CUDA grouped GEMM's pipeline for bfloat16 and float16
#: ("registers", the default: the next step's tiles staged in registers; "async": 4 shared stages
#: filled by cp.async, not yet run on a GPU). float32 always takes "registers".
GPU_GEMM_PIPELINES = ("registers", "async")

#: JAXOPS_GPU_GROUPED_GEMM's values: what the CUDA grouped GEMM calls run, read when a call is
#: traced ("kernel", the default: jaxops' kernels; "cublaslt": cuBLASLt's grouped matmul for
#: bfloat16 and float16, needs a CUDA module built with cuBLASLt and cuBLAS 13.4 or newer;
#: "cutlass": CUTLASS's Hopper grouped GEMM for bfloat16, needs a CUDA module built for sm_90a
#: with CUTLASS's headers and an sm_90 GPU; neither has run on a GPU yet).
GPU_GROUPED_GEMMS = ("kernel", "cublaslt", "cutlass")
_GROUPED_GEMM_CHOICE = "what the CUDA grouped GEMM calls run"


def gpu_grouped_gemm() -> str:
    """JAXOPS_GPU_GROUPED_GEMM now: one of :data:`GPU_GROUPED_GEMMS` (unset: "kernel")."""
    _check_choice("JAXOPS_GPU_GROUPED_GEMM", GPU_GROUPED_GEMMS, _GROUPED_GEMM_CHOICE)
    return os.environ.get("JAXOPS_GPU_GROUPED_GEMM", "kernel")


def cuda_module_function(name: str) -> Any:
    """The function `name` of the loaded CUDA module, or None (no module, or it lacks `name`)."""
    module = _modules.get("CUDA")
    return None if module is None else getattr(module, name, None)


def check_settings() -> None:
    """Raises InvalidArgumentError for a JAXOPS_* environment setting jaxops cannot take.

    Run at import: JAXOPS_CPU_THREADS, JAXOPS_CPU_GEMM_KERNEL, JAXOPS_GPU_GEMM_PIPELINE and
    JAXOPS_GPU_GROUPED_GEMM, each unset or one of its values.
    """
    _check_cpu_threads()
    _check_choice(
        "JAXOPS_CPU_GEMM_KERNEL",
        CPU_GEMM_KERNELS,
        "the widest grouped GEMM micro-kernel of the CPU calls",
    )
    _check_choice(
        "JAXOPS_GPU_GEMM_PIPELINE",
        GPU_GEMM_PIPELINES,
        "the CUDA grouped GEMM's pipeline for 16-bit operands",
    )
    _check_choice("JAXOPS_GPU_GROUPED_GEMM", GPU_GROUPED_GEMMS, _GROUPED_GEMM_CHOICE)


def _initialize() -> None:
    """Loads the compiled modules, checks their FFI API, registers their stateless targets."""
    check_settings()
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
    _warn_if_cuda_module_missing()


# jax's CUDA PJRT plugins (jax[cuda13] / jax[cuda12] install them) and the modules beside them.
_CUDA_PLUGIN_MODULES = (
    "jax_plugins.xla_cuda13",
    "jax_plugins.xla_cuda12",
    "jax_cuda13_plugin",
    "jax_cuda12_plugin",
)
_NVIDIA_GPU_PATHS = ("/proc/driver/nvidia/gpus/*", "/dev/nvidia[0-9]*")


def _gpu_backend_present() -> bool:
    """Whether jax has (or will have) a CUDA GPU backend here, without starting its backends.

    If jax's backends are already up, they are asked. Otherwise (at ``import jaxops``, where
    starting them would fix jax's configuration too early): jax's platforms are not restricted
    away from CUDA (``JAX_PLATFORMS``), a jax CUDA plugin is installed, ``CUDA_VISIBLE_DEVICES``
    does not hide every GPU, and the NVIDIA driver shows a GPU.
    """
    try:
        from jax._src import xla_bridge

        initialized = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a private API; judge from the signs below
        initialized = False
    if initialized:
        try:
            devices = jax.devices("gpu")
        except RuntimeError:
            return False
        return any("rocm" not in d.client.platform_version.lower() for d in devices)
    platforms = os.environ.get("JAX_PLATFORMS", "") or (jax.config.jax_platforms or "")
    names = {p.strip().lower() for p in platforms.split(",") if p.strip()}
    if names and not names & {"cuda", "gpu"}:
        return False
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    plugin = False
    for name in _CUDA_PLUGIN_MODULES:
        try:
            plugin = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            plugin = False
        if plugin:
            break
    return plugin and any(glob.glob(pattern) for pattern in _NVIDIA_GPU_PATHS)


_warned_cuda_missing = False


def _cuda_missing_reason() -> str:
    error = _load_errors.get("_jaxops_cuda")
    if error is not None:
        return f"the CUDA module of this install failed to load ({error})"
    return "no CUDA module in this install (jaxops was built without nvcc)"


def _warn_if_cuda_module_missing() -> None:
    """Warns once (CudaModuleMissingWarning) if jax has a CUDA GPU but jaxops no CUDA module."""
    global _warned_cuda_missing
    if _warned_cuda_missing or cuda_available() or "_jaxops_cuda" in _load_errors:
        return  # a module that failed to load has warned already, with its error
    if not _gpu_backend_present():
        return
    _warned_cuda_missing = True
    warnings.warn(
        f"jaxops: {_cuda_missing_reason()}, but jax's CUDA GPU backend is present: every jaxops op "
        "runs its pure-JAX twin on the GPU instead of the custom calls. Install the jaxops wheel "
        "with the CUDA module: pip install 'jaxops[cuda13]', or build from source with nvcc on "
        "PATH and JAXOPS_CUDA=ON (JAXOPS_CUDA=ON pip install . in a checkout). "
        "jaxops.build_info()['paths'] shows what each op family runs.",
        CudaModuleMissingWarning,
        stacklevel=3,
    )


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


def use_kernel(impl: str | None, op: str = "jaxops") -> bool:
    """Whether an op called with `impl` runs its custom call on the default backend.

    `op` is the public name of the op, which starts the error raised for ``impl="ffi"`` where
    no kernel exists.
    """
    available = kernel_available(jax.default_backend())
    return resolve_impl(impl, kernel_available=available, op=op) == "ffi"


def ffi_call(
    target: str, out_types: Any, *operands: Any, vmap_method: str = "sequential", **attrs: Any
) -> Any:
    """``jax.ffi.ffi_call(target, out_types)(*operands, **attrs)`` with shard_map-correct types.

    Inside shard_map the results are marked varying over the axes the operands vary over (see
    :func:`jaxops._sharding.vary_like`).
    """
    call = jax.ffi.ffi_call(target, out_types, vmap_method=vmap_method)
    return vary_like(call(*operands, **attrs), *operands)


def crc32c_chunks(data: Any, chunk: int) -> list[int]:
    """CRC-32C of each `chunk`-byte piece of `data` (the CPU module's host function).

    Args:
      data: a contiguous uint8 numpy array (or anything numpy views as bytes).
      chunk: bytes per piece (>= 1); the last piece may be shorter.

    Returns:
      One CRC per piece (``[]`` for no bytes). SSE4.2 where the CPU has it, without the GIL.

    Example:
      >>> import numpy as np
      >>> from jaxops._ffi import crc32c_chunks
      >>> hex(crc32c_chunks(np.frombuffer(b"123456789", np.uint8), 4096)[0])
      '0xe3069283'
    """
    return _modules["cpu"].crc32c_chunks(np.frombuffer(data, np.uint8), chunk)


def cuda_available() -> bool:
    """Whether the CUDA module of jaxops was built and loaded."""
    return "CUDA" in _modules


OP_FAMILIES = ("rms_norm", "fp8", "moe", "gemm", "grouped_gemm")
CPU_CUSTOM_CALL = "custom call (CPU module)"
CUDA_CUSTOM_CALL = "custom call (CUDA module)"


def op_paths(backend: str | None = None) -> dict[str, str]:
    """Which implementation each op family takes on `backend` with the default ``impl``.

    Args:
      backend: a jax backend name ("cpu", "gpu"/"cuda", ...); None: ``jax.default_backend()``
        (which starts jax's backends).

    Returns:
      ``{family: path}`` for rms_norm, fp8 (quantization; FP8 GEMMs follow gemm), moe, gemm and
      grouped_gemm (the expert FFNs' GEMMs; on a GPU, layers with one local expert run one
      ``jax.lax.ragged_dot`` whatever this says), each path ``"custom call (CPU module)"``,
      ``"custom call (CUDA module)"`` or ``"pure-JAX twin: <reason>"``.

    Example:
      >>> import jaxops
      >>> jaxops._ffi.op_paths("cpu")["rms_norm"]
      'custom call (CPU module)'
    """
    backend = jax.default_backend() if backend is None else backend
    if get_default_impl() == "xla":
        reason = "pure-JAX twin: forced (JAXOPS_IMPL=xla or jaxops.set_default_impl('xla'))"
        return dict.fromkeys(OP_FAMILIES, reason)
    return _kernel_paths(backend)


def has_kernel(family: str, backend: str) -> bool:
    """Whether jaxops has a custom call of op `family` on `backend`, whatever the default impl.

    `family` is "rms_norm", "fp8" (quantization), "moe", "gemm" (also the FP8 GEMMs) or
    "grouped_gemm";
    `backend` "cpu" or "gpu". True where ``impl="ffi"`` can run the family.

    Example:
      >>> from jaxops._ffi import has_kernel
      >>> has_kernel("rms_norm", "cpu"), has_kernel("gemm", "cpu")
      (True, False)
    """
    return _kernel_paths(backend)[family].startswith("custom call")


def choose_impl(family: str, impl: ImplChoice = None, *, backend: str | None = None) -> str:
    """The implementation op `family` runs with `impl` on `backend`: "ffi" or "xla".

    The public query of jaxops' one implementation policy (:mod:`jaxops._config`): every
    ``impl=`` of every tier (the ops, ``moe_layer``, ``MoEDecoder``) is resolved this way, per
    op family, when the op is traced. None follows the global default (best available unless
    :func:`jaxops.set_default_impl` says otherwise); "ffi" requires the custom call and raises
    where the family has none; "xla" is the pure-JAX twin; a tuple is an order of preference.

    Args:
      family: an op family of ``jaxops.build_info()["paths"]``: "rms_norm", "fp8" (quantization),
        "moe", "gemm" (also the FP8 GEMMs) or "grouped_gemm".
      impl: None, "ffi", "xla" or a tuple such as ``("ffi", "xla")``.
      backend: "cpu" or "gpu" (default: jax's default backend).

    Raises:
      InvalidArgumentError: an unknown `family` or `impl`, or a required custom call the family
        does not have on `backend`.

    Example:
      >>> import jaxops
      >>> jaxops.choose_impl("rms_norm", backend="cpu"), jaxops.choose_impl("gemm", backend="cpu")
      ('ffi', 'xla')
      >>> jaxops.choose_impl("gemm", ("ffi", "xla"), backend="cpu")
      'xla'
      >>> try:
      ...     jaxops.choose_impl("gemm", "ffi", backend="cpu")
      ... except jaxops.InvalidArgumentError as e:
      ...     print(str(e)[:62])
      jaxops.choose_impl: impl='ffi' requires a custom call, but jax
    """
    op = "jaxops.choose_impl"
    if family not in OP_FAMILIES:
        raise InvalidArgumentError(f"{op}: family must be one of {OP_FAMILIES}, got {family!r}")
    backend = jax.default_backend() if backend is None else backend
    return resolve_impl(impl, kernel_available=has_kernel(family, backend), op=op)


def _kernel_paths(backend: str) -> dict[str, str]:
    if backend == "cpu":
        paths = dict.fromkeys(OP_FAMILIES, CPU_CUSTOM_CALL)
        paths["gemm"] = "pure-JAX twin: no CPU GEMM kernel (XLA's dot runs it)"
        return paths
    if backend in ("gpu", "cuda"):
        if not cuda_available():
            return dict.fromkeys(OP_FAMILIES, f"pure-JAX twin: {_cuda_missing_reason()}")
        if not kernel_available(backend):
            return dict.fromkeys(OP_FAMILIES, "pure-JAX twin: no jaxops kernels for ROCm GPUs")
        paths = dict.fromkeys(OP_FAMILIES, CUDA_CUSTOM_CALL)
        if _modules["CUDA"].build_info().get("cublaslt") is None:
            paths["gemm"] = "pure-JAX twin: the CUDA module was built without cuBLASLt"
        return paths
    return dict.fromkeys(OP_FAMILIES, f"pure-JAX twin: no jaxops kernels for the {backend} backend")


def build_info() -> dict[str, dict[str, Any]]:
    """What each compiled module was built with, and the path each op family takes here.

    Returns:
      One entry per loaded module, keyed by platform ("cpu", "CUDA"): jaxlib version and XLA FFI
      API it was built against; for CUDA also the CUDA version, the architectures, where
      cuBLASLt comes from (``cublaslt``: "wheel", "toolkit" or None), the loaded libcublasLt's
      ``cublaslt_version`` (e.g. 130400 for 13.4.0; None without cuBLASLt) and
      ``cublaslt_grouped``, whether it has the grouped matmul ``JAXOPS_GPU_GROUPED_GEMM=cublaslt``
      runs on (cuBLAS 13.4 or newer), and ``cutlass``, the version of the CUTLASS headers its
      sm_90a grouped GEMM (``JAXOPS_GPU_GROUPED_GEMM=cutlass``) was built with, or None; for the
      CPU also
      ``grouped_gemm_kernel``, the micro-kernel of the grouped GEMM calls on this machine
      ("avx512", "avx2" or "portable": the widest the CPU has, at most
      ``JAXOPS_CPU_GEMM_KERNEL``'s). And ``"paths"``: per op family (rms_norm, fp8, moe,
      gemm, grouped_gemm), the implementation it takes on jax's default backend (see
      :func:`op_paths`; computing it starts jax's backends).

    Example:
      >>> import jaxops
      >>> jaxops.build_info()["cpu"]["platform"]
      'cpu'
      >>> sorted(jaxops.build_info()["paths"])
      ['fp8', 'gemm', 'grouped_gemm', 'moe', 'rms_norm']
    """
    info: dict[str, dict[str, Any]] = {
        platform: dict(module.build_info()) for platform, module in _modules.items()
    }
    if "cpu" in _modules:
        info["cpu"]["grouped_gemm_kernel"] = _modules["cpu"].grouped_gemm_kernel()
    info["paths"] = op_paths()
    return info


def registered_targets() -> list[tuple[str, str]]:
    """(target name, platform) pairs registered with XLA so far."""
    return sorted(_registered)


_initialize()
