// Handler symbols of the FP8 family, defined in cpu.cc and cuda.cu and exported to Python by the
// nanobind modules. Names follow the chain C++ handler <-> FFI target <-> Python constant:
//   Fp8Quantize               <-> "jaxops_fp8_quantize"
//                             <-> jaxops._fp8.TARGET_QUANTIZE
//   Fp8Amax                   <-> "jaxops_fp8_amax"      <-> jaxops._fp8.TARGET_AMAX
//   Fp8QuantizeSplitTranspose <-> "jaxops_fp8_quantize_split_transpose"
//                             <-> jaxops._fp8.TARGET_SPLIT_TRANSPOSE
#ifndef JAXOPS_XLA_FFI_FP8_HANDLERS_H_
#define JAXOPS_XLA_FFI_FP8_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

// extern "C" symbols, so they live in the global namespace.
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8QuantizeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8AmaxCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8QuantizeSplitTransposeCpu);

XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8QuantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8AmaxCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8QuantizeSplitTransposeCuda);

#endif  // JAXOPS_XLA_FFI_FP8_HANDLERS_H_
