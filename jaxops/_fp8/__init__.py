"""FP8 quantization as XLA FFI custom calls, with pure-JAX twins, and the FP8 GEMM and layer.

Public API: :mod:`jaxops.fp8`.

The algorithm, per block (a 1 x G group along the last axis, a G x G tile over the last two axes,
or the whole tensor):

- ``amax = max |x|`` over the block's finite values (NaN and +-Inf do not count);
- ``scale = max(amax, amax_floor) / max_finite(dtype)`` in float32, rounded up to a power of two
  with ``pow2_scale`` (a UE8M0 exponent);
- ``data = float8(x / scale)``: float32 division, then round to nearest even; values beyond the
  format (and +-Inf) saturate to +-max_finite, NaN stays NaN.

``x ~= data * scale``. The custom calls and the twins produce identical bits.

Layers, from the public functions down: validation and choice of implementation;
``custom_partitioning`` with Shardy rules (block-aligned shards stay local); ``jax.ffi.ffi_call``
of the targets below, for CPU and CUDA.

Modules by concern: ``scales`` (QuantizedArray, dequantize, scale math, the pure-JAX twin),
``partition`` (the custom calls and their custom_partitioning / Shardy rules), ``quantize``
(quantize, fake_quant), ``delayed`` (delayed scaling), ``split`` (quantize_split_transpose),
``gemm`` (the FP8 GEMM on cuBLASLt, through :mod:`jaxops._cublaslt`), ``linear`` (the
differentiable FP8 layer ``jaxops.fp8.linear``) and ``recipe`` (the one FP8 recipe type every
tier takes).
"""

from jaxops._fp8.delayed import (
    DelayedScaling,
    Fp8Meta,
    init_fp8_meta,
    quantize_delayed,
    scale_from_amax_history,
    update_fp8_meta,
)
from jaxops._fp8.gemm import fp8_gemm, fp8_gemm_reference
from jaxops._fp8.linear import fp8_linear
from jaxops._fp8.partition import TARGET_AMAX, TARGET_QUANTIZE
from jaxops._fp8.quantize import fake_quant, quantize, quantize_reference
from jaxops._fp8.recipe import BLOCK, SCALINGS, TENSOR, Recipe, as_recipe
from jaxops._fp8.scales import (
    AMAX_FLOOR,
    QuantizedArray,
    dequantize,
    max_finite,
    scale_from_amax,
)
from jaxops._fp8.split import (
    TARGET_SPLIT_TRANSPOSE,
    SplitQuantized,
    quantize_split_transpose,
    quantize_split_transpose_reference,
)

__all__ = [
    "AMAX_FLOOR",
    "BLOCK",
    "SCALINGS",
    "TENSOR",
    "Recipe",
    "as_recipe",
    "TARGET_AMAX",
    "TARGET_QUANTIZE",
    "TARGET_SPLIT_TRANSPOSE",
    "DelayedScaling",
    "Fp8Meta",
    "QuantizedArray",
    "SplitQuantized",
    "dequantize",
    "fake_quant",
    "fp8_gemm",
    "fp8_gemm_reference",
    "fp8_linear",
    "init_fp8_meta",
    "max_finite",
    "quantize",
    "quantize_delayed",
    "quantize_reference",
    "quantize_split_transpose",
    "quantize_split_transpose_reference",
    "scale_from_amax",
    "scale_from_amax_history",
    "update_fp8_meta",
]
