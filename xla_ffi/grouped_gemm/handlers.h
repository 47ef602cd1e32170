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
//   GroupedGemmCutlass      <-> "jaxops_grouped_gemm_cutlass"
//                           <-> jaxops._grouped_gemm.TARGET_GROUPED_GEMM_CUTLASS
//   GroupedGemmWgradCutlass <-> "jaxops_grouped_gemm_wgrad_cutlass"
//                           <-> jaxops._grouped_gemm.TARGET_WGRAD_CUTLASS
//     (CUDA only, sm_90a, with CUTLASS's headers: CUTLASS's Hopper grouped GEMM, cutlass_sm90.cu)
//   GroupedGemmFp8Cutlass <-> "jaxops_grouped_gemm_fp8_cutlass"
//                         <-> jaxops._grouped_gemm.TARGET_GROUPED_GEMM_FP8_CUTLASS
//   GroupedGemmFp8WgradCutlass <-> "jaxops_grouped_gemm_fp8_wgrad_cutlass"
//                              <-> jaxops._grouped_gemm.TARGET_WGRAD_FP8_CUTLASS
//     (CUDA only, sm_90a, with CUTLASS's headers: the block-scaled FP8 grouped GEMMs,
//     cutlass_fp8_sm90.cu)
//   GroupedActivationFwd <-> "jaxops_grouped_activation_fwd"
//                        <-> jaxops._grouped_gemm.TARGET_ACTIVATION_FWD (CPU only)
//   GroupedActivationBwd <-> "jaxops_grouped_activation_bwd"
//                        <-> jaxops._grouped_gemm.TARGET_ACTIVATION_BWD (CPU only)
#ifndef JAXOPS_XLA_FFI_GROUPED_GEMM_HANDLERS_H_
#define JAXOPS_XLA_FFI_GROUPED_GEMM_HANDLERS_H_

#include <cstdint>
#include <string>

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
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmCutlassCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmWgradCutlassCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmFp8CutlassCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmFp8WgradCutlassCuda);

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

// cutlass_sm90.cu (built with CUTLASS's headers only, for sm_90a).
// Bytes of the CUTLASS handlers' workspace for `groups` groups (the per-group arrays and CUTLASS's
// own, sized for up to 256 SMs), exported by the CUDA module as
// grouped_gemm_cutlass_workspace_bytes.
int64_t CutlassWorkspaceBytes(int64_t groups);
// cutlass_fp8_sm90.cu: bytes of the FP8 handlers' workspace for `groups` groups (sized as
// CutlassWorkspaceBytes'), exported as grouped_gemm_fp8_cutlass_workspace_bytes.
int64_t CutlassFp8WorkspaceBytes(int64_t groups);
// The version of the CUTLASS headers the kernels were built with, e.g. "4.2.0".
std::string CutlassVersion();
}  // namespace jaxops::grouped_gemm

#endif  // JAXOPS_XLA_FFI_GROUPED_GEMM_HANDLERS_H_
