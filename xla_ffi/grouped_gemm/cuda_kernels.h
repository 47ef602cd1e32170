// The CUDA grouped GEMM's own kernels (kernels.cuh), entered past the checks of checks.h: the
// handlers of cuda.cu call them, and so do those of cublaslt.cu for the calls cuBLASLt's grouped
// matmul does not take.
#ifndef JAXOPS_XLA_FFI_GROUPED_GEMM_CUDA_KERNELS_H_
#define JAXOPS_XLA_FFI_GROUPED_GEMM_CUDA_KERNELS_H_

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/grouped_gemm/checks.h"

namespace jaxops::grouped_gemm {

// y [R, N] float32 = the groups of x @ w (CheckForward's problem p), on the stream.
ffi::Error KernelForward(cudaStream_t stream, const Problem& p, const ffi::AnyBuffer& x,
                         const ffi::AnyBuffer& w, const ffi::Buffer<ffi::S32>& sizes, float* y,
                         bool transpose_w, bool zero_tail);

// dw [G, K, N] float32 = the groups of x.T @ dy (CheckWgrad's problem p), on the stream.
ffi::Error KernelWgrad(cudaStream_t stream, const Problem& p, const ffi::AnyBuffer& x,
                       const ffi::AnyBuffer& dy, const ffi::Buffer<ffi::S32>& sizes, float* dw);

}  // namespace jaxops::grouped_gemm

#endif  // JAXOPS_XLA_FFI_GROUPED_GEMM_CUDA_KERNELS_H_
