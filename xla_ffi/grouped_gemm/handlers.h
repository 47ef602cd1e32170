// Handler symbols of the grouped GEMM family, defined in cpu.cc and cuda.cu and exported to
// Python by the nanobind modules. Names follow the chain C++ handler <-> FFI target <-> Python
// constant:
//   GroupedGemm      <-> "jaxops_grouped_gemm"       <-> jaxops._grouped_gemm.TARGET_GROUPED_GEMM
//   GroupedGemmWgrad <-> "jaxops_grouped_gemm_wgrad" <-> jaxops._grouped_gemm.TARGET_WGRAD
//   GroupedActivationFwd <-> "jaxops_grouped_activation_fwd"
//                        <-> jaxops._grouped_gemm.TARGET_ACTIVATION_FWD (CPU only)
//   GroupedActivationBwd <-> "jaxops_grouped_activation_bwd"
//                        <-> jaxops._grouped_gemm.TARGET_ACTIVATION_BWD (CPU only)
#ifndef JAXOPS_XLA_FFI_GROUPED_GEMM_HANDLERS_H_
#define JAXOPS_XLA_FFI_GROUPED_GEMM_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

// extern "C" symbols, so they live in the global namespace.
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmWgradCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedActivationFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedActivationBwdCpu);

XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedGemmWgradCuda);

namespace jaxops::grouped_gemm {
// The micro-kernel the CPU calls run on this machine: "avx512", "avx2" or "portable" (the widest
// the CPU has, at most JAXOPS_CPU_GEMM_KERNEL's).
const char* CpuKernelName();
}  // namespace jaxops::grouped_gemm

#endif  // JAXOPS_XLA_FFI_GROUPED_GEMM_HANDLERS_H_
