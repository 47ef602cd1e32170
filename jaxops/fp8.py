"""FP8 for JAX: quantization (per-tensor, 1 x G and G x G blocks, fused transpose), GEMM, layer.

The public namespace ``jaxops.fp8``; the implementation lives in ``jaxops._fp8``.

- the FP8 recipe every tier takes as ``fp8=``: :class:`Recipe` (tensor current, tensor
  delayed, or block 1 x 128 / 128 x 128 scaling), :data:`BLOCK`, :data:`TENSOR`,
  :data:`SCALINGS`, :func:`as_recipe`;
- :func:`quantize` / :func:`dequantize` and :class:`QuantizedArray`;
- :func:`quantize_split_transpose` and :class:`SplitQuantized` (per-expert wgrad operands);
- :func:`fake_quant` (straight-through quantize-dequantize);
- delayed scaling: :class:`DelayedScaling`, :class:`Fp8Meta`, :func:`init_fp8_meta`,
  :func:`quantize_delayed`, :func:`update_fp8_meta`, :func:`scale_from_amax_history`;
- :func:`scale_from_amax`, :func:`max_finite`, :data:`AMAX_FLOOR`, and the pure-JAX twins
  :func:`quantize_reference`, :func:`quantize_split_transpose_reference`;
- FP8 GEMM: :func:`gemm` (per-tensor or block-scaled operands, cuBLASLt on CUDA) and its twin
  :func:`gemm_reference`, and the differentiable layer :func:`linear` (its recipe keyword is
  ``fp8=``; ``recipe=`` is the deprecated name, as for the delayed-scaling functions).
"""

from jaxops._fp8 import (
    AMAX_FLOOR,
    BLOCK,
    SCALINGS,
    TENSOR,
    DelayedScaling,
    Fp8Meta,
    QuantizedArray,
    Recipe,
    SplitQuantized,
    as_recipe,
    dequantize,
    fake_quant,
    init_fp8_meta,
    max_finite,
    quantize,
    quantize_delayed,
    quantize_reference,
    quantize_split_transpose,
    quantize_split_transpose_reference,
    scale_from_amax,
    scale_from_amax_history,
    update_fp8_meta,
)
from jaxops._fp8 import fp8_gemm as gemm
from jaxops._fp8 import fp8_gemm_reference as gemm_reference
from jaxops._fp8 import fp8_linear as linear

__all__ = [
    "AMAX_FLOOR",
    "BLOCK",
    "SCALINGS",
    "TENSOR",
    "DelayedScaling",
    "Fp8Meta",
    "QuantizedArray",
    "Recipe",
    "SplitQuantized",
    "as_recipe",
    "dequantize",
    "fake_quant",
    "gemm",
    "gemm_reference",
    "init_fp8_meta",
    "linear",
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
