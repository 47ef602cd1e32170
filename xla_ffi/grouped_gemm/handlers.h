// Handler symbols of the grouped GEMM family, defined in cpu.cc and cuda.cu and exported to
// Python by the nanobind modules. Names follow the chain C++ handler <-> FFI target <-> Python
// constant:
//   GroupedGemm      <-> "jaxops_grouped_gemm"       <-> jaxops._grouped_gemm.TARGET_GROUPED_GEMM
//   GroupedGemmWgrad <-> "jaxops_grouped_gemm_wgrad" <-> jaxops._grouped_gemm.TARGET_WGRAD
//   GroupedGemmLt    <-> "jaxops_grouped_gemm_lt"    <->
//   jaxops._grouped_gemm.TARGET_GROUPED_GEMM_LT GroupedGemmWgradLt <->
//   "jaxops_grouped_gemm_wgrad_lt"
//                      <-> jaxops._grouped_gemm.TARGET_WGRAD_LT
//     (CUDA only, with cuBLASLt: cuBLASLt's grouped matmul, cublaslt.cu; stateful, with
//     GroupedGemmLtInstantiateCuda and the state type GroupedLtState)
//   GroupedActivationFwd <-> "jaxops_grouped_activation_fwd"
//                        <-> jaxops._grouped_gemm.TARGET_ACTIVATION_FWD (CPU only)
//   GroupedActivationBwd <-> "jaxops_grouped_activation_bwd"
//                        <-> jaxops._grouped_gemm.TARGET_ACTIVATION_BWD (CPU only)
#ifndef JAXOPS_XLA_FFI_GROUPED_GEMM_HANDLERS_H_
#define JAXOPS_XLA_FFI_GROUPED_GEMM_HANDLERS_H_

#include <cstdint>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

// extern "C" symbols, so they live in the global namespace.
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmWgradCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedActivationFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedActivationBwdCpu);

XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmWgradCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmLtInstantiateCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmLtCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmWgradLtCuda);

namespace jaxops::grouped_gemm {
// The micro-kernel the CPU calls run on this machine: "avx512", "avx2" or "portable" (the widest
// the CPU has, at most JAXOPS_CPU_GEMM_KERNEL's).
const char* CpuKernelName();

// cublaslt.cu (built with cuBLASLt only).
inline constexpr const char* kLtStateTypeName = "jaxops.grouped_gemm.GroupedLtState";
XLA_FFI_TypeId* GroupedLtStateTypeId();
const XLA_FFI_TypeInfo* GroupedLtStateTypeInfo();
// Bytes of the cuBLASLt handlers' workspace for `groups` groups (the per-group arrays and 32 MiB
// for cuBLASLt), exported by the CUDA module as grouped_gemm_lt_workspace_bytes.
int64_t LtWorkspaceBytes(int64_t groups);
// Whether the loaded libcublasLt has the grouped matmul (and jaxops was built with its headers).
bool LtGroupedAvailable();
// cublasLtGetVersion() of the loaded libcublasLt, e.g. 131000 for 13.1.0.
int64_t LtVersion();
}  // namespace jaxops::grouped_gemm

#endif  // JAXOPS_XLA_FFI_GROUPED_GEMM_HANDLERS_H_
