"""RMSNorm and fused residual-add + RMSNorm as XLA FFI custom calls, with their pure-JAX twins.

Layers, from the public functions down, and the modules that hold them:

1. :func:`rms_norm` / :func:`add_rms_norm`: validation at trace time, choice of implementation
   (``api``).
2. ``jax.custom_vjp``: the backward pass is the ``jaxops_rms_norm_bwd`` kernel (``autodiff``).
3. ``jax.custom_batching.custom_vmap``: vmap folds the batch into the kernel's rows
   (``autodiff``).
4. ``custom_partitioning`` with Shardy rules: sharded leading axes run locally with no
   collective; a sharded hidden axis runs the kernel per shard and all-reduces only the per-row
   partial sum of squares (forward) or the per-row partial dot product (backward)
   (``partition``).
5. ``jax.ffi.ffi_call`` of the targets below, for CPU and CUDA (``partition``).

The pure-JAX twins (the test oracle and the ``impl="xla"`` path) are in ``reference``.
"""

from jaxops._rms_norm.api import add_rms_norm, rms_norm
from jaxops._rms_norm.partition import TARGET_ADD_FWD, TARGET_BWD, TARGET_FWD
from jaxops._rms_norm.reference import add_rms_norm_reference, rms_norm_reference

__all__ = [
    "TARGET_ADD_FWD",
    "TARGET_BWD",
    "TARGET_FWD",
    "add_rms_norm",
    "add_rms_norm_reference",
    "rms_norm",
    "rms_norm_reference",
]
