"""jaxops: XLA FFI kernels for JAX on NVIDIA Hopper GPUs and on CPU.

Public API (everything else is private):

- :func:`rms_norm`, :func:`add_rms_norm` and their pure-JAX twins :func:`rms_norm_reference`,
  :func:`add_rms_norm_reference`.
- The implementation policy, one vocabulary for every ``impl=`` of every tier (None: best
  available, "ffi": the custom call required, "xla": the pure-JAX twin, or an order of preference
  such as ``("ffi", "xla")``): :func:`choose_impl` (which one an op family runs), the global
  default :func:`set_default_impl`, :func:`get_default_impl`, :func:`default_impl` (or the
  ``JAXOPS_IMPL=xla`` environment variable), :data:`IMPLS`.
- :func:`gemm` (GEMM with fused bias and activation, cuBLASLt on CUDA) and its twin
  :func:`gemm_reference`.
- Matmul precision: :func:`precision` (context manager and decorator), :func:`current_precision`,
  :func:`precision_report` (or the ``JAXOPS_MATMUL_PRECISION`` environment variable).
- Errors: :class:`JaxopsError`, the base of every exception jaxops raises on bad input;
  :class:`InvalidArgumentError` (a ``ValueError``) for argument values, shapes or combinations a
  call cannot take, :class:`ArgumentTypeError` (a ``TypeError``) for arguments of the wrong type,
  and :class:`ConfigError` (an ``InvalidArgumentError``) for configurations it cannot build.
  Every message starts with the public dotted name of what was called.
- :class:`Lora`: low-rank adapters (rank, alpha, rsLoRA, the weights they adapt), the one
  adapter setting the expert layer (``MoEConfig.lora``) takes.
- :func:`reuse_host_memory`: keep freed host memory in the process (glibc ``mallopt``), so
  XLA:CPU's per-step temporaries are not page-faulted in again every step.
- :func:`build_info` (what was built, and which path each op family takes here),
  :func:`cuda_available`, :class:`JaxlibVersionError` and :class:`CudaModuleMissingWarning`
  (issued once at import where jax has a CUDA GPU but this install has no CUDA module).
- ``jaxops.fp8``: FP8 quantization (per-tensor, 1 x G and G x G blocks, fused transpose,
  per-expert split transpose, fake quantization, delayed scaling), FP8 GEMM (per-tensor and
  block-scaled) and the differentiable FP8 layer ``jaxops.fp8.linear``.
- ``jaxops.moe``: MoE token permute / unpermute (any expert count, alignment padding, capacity,
  FP8 scales, on device without host synchronization).
- ``jaxops.parallel``: expert and pipeline parallelism, sharded checkpointing.
- ``jaxops.models``: published MoE models (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, GLM-4.5,
  DeepSeek-V3 / Kimi K2, ERNIE-4.5-MoE, gpt-oss, Llama 4, MiniMax-M2) with Hugging Face import
  and export, fine-tuning, generation and memory plans.

The three tiers, each a folder of the repository, imports running only downwards::

    jaxops.models    (models/)    published models, their configs and name maps
        |
    jaxops.parallel  (parallel/)  expert and pipeline parallelism, checkpointing
        |
    jaxops           (jaxops/)    the core: kernels (rms_norm, fp8, moe, gemm,
                                  grouped_gemm), precision, sharding helpers, errors

No module imports from a tier above its own, and no underscore-prefixed name crosses a tier:
what two tiers share lives in a core module under a public name (``jaxops._rows``,
``jaxops._checks``, ``jaxops._sharding``, ``jaxops._errors``, ...). ``tests/test_layout.py``
checks both on the installed package.
"""

from jaxops import fp8, moe
from jaxops._config import IMPLS, default_impl, get_default_impl, set_default_impl
from jaxops._errors import ArgumentTypeError, ConfigError, InvalidArgumentError, JaxopsError
from jaxops._ffi import (
    CudaModuleMissingWarning,
    JaxlibVersionError,
    build_info,
    choose_impl,
    cuda_available,
)
from jaxops._gemm import gemm, gemm_reference
from jaxops._host import reuse_host_memory
from jaxops._lora import Lora
from jaxops._precision import current_precision, precision, precision_report
from jaxops._rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)

__version__ = "0.1.0"

__all__ = [
    "IMPLS",
    "ArgumentTypeError",
    "ConfigError",
    "CudaModuleMissingWarning",
    "InvalidArgumentError",
    "JaxlibVersionError",
    "JaxopsError",
    "Lora",
    "__version__",
    "add_rms_norm",
    "add_rms_norm_reference",
    "build_info",
    "choose_impl",
    "cuda_available",
    "current_precision",
    "default_impl",
    "fp8",
    "gemm",
    "gemm_reference",
    "get_default_impl",
    "moe",
    "precision",
    "precision_report",
    "reuse_host_memory",
    "rms_norm",
    "rms_norm_reference",
    "set_default_impl",
]
