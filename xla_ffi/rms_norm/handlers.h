// Handler symbols of the RMSNorm family, defined in cpu.cc and cuda.cu and exported to Python by
// the nanobind modules. Names follow the chain C++ handler <-> FFI target <-> Python constant:
//   RmsNormFwd    <-> "jaxops_rms_norm_fwd"     <-> jaxops._rms_norm.TARGET_FWD
//   AddRmsNormFwd <-> "jaxops_add_rms_norm_fwd" <-> jaxops._rms_norm.TARGET_ADD_FWD
//   RmsNormBwd    <-> "jaxops_rms_norm_bwd"     <-> jaxops._rms_norm.TARGET_BWD
#ifndef JAXOPS_XLA_FFI_RMS_NORM_HANDLERS_H_
#define JAXOPS_XLA_FFI_RMS_NORM_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

// extern "C" symbols, so they live in the global namespace.
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AddRmsNormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormBwdCpu);

XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AddRmsNormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormBwdCuda);

#endif  // JAXOPS_XLA_FFI_RMS_NORM_HANDLERS_H_
