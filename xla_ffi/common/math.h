// Small helpers shared by host (g++) and device (nvcc) code.
#ifndef JAXOPS_XLA_FFI_COMMON_MATH_H_
#define JAXOPS_XLA_FFI_COMMON_MATH_H_

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define JAXOPS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JAXOPS_HOST_DEVICE inline
#endif

namespace jaxops {

// 1 / sqrt(v). The device path uses the hardware approximation (max 2 ulp).
JAXOPS_HOST_DEVICE float ReciprocalSqrt(float v) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(v);
#else
  return 1.0f / std::sqrt(v);
#endif
}

// ceil(a / b) for positive b.
JAXOPS_HOST_DEVICE int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace jaxops

#endif  // JAXOPS_XLA_FFI_COMMON_MATH_H_
