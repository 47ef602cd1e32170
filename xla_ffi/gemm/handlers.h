// Handler symbols of the GEMM family, defined in cuda.cu (CUDA only: on CPU jaxops.gemm is XLA's
// dot) and exported to Python by the CUDA nanobind module. Names follow the chain C++ handler <->
// FFI target <-> Python constant:
//   GemmCuda    <-> "jaxops_gemm"     <-> jaxops._gemm.TARGET_GEMM
//   GemmFp8Cuda <-> "jaxops_gemm_fp8" <-> jaxops._gemm.TARGET_GEMM_FP8
// Both are stateful: GemmInstantiateCuda (the instantiate stage) gives every call site a
// GemmState holding, per device, the cuBLASLt handle, descriptors and chosen algorithm. The state
// type is registered from Python (jax.ffi.register_ffi_type) with GemmStateTypeId/TypeInfo.
#ifndef JAXOPS_XLA_FFI_GEMM_HANDLERS_H_
#define JAXOPS_XLA_FFI_GEMM_HANDLERS_H_

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(GemmInstantiateCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GemmCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GemmFp8Cuda);

namespace jaxops::gemm {

inline constexpr const char* kStateTypeName = "jaxops.gemm.GemmState";
XLA_FFI_TypeId* GemmStateTypeId();
const XLA_FFI_TypeInfo* GemmStateTypeInfo();

}  // namespace jaxops::gemm

#endif  // JAXOPS_XLA_FFI_GEMM_HANDLERS_H_
