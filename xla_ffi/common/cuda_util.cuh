// Device helpers shared by the CUDA kernels of every op family (compiled by nvcc only).
//
//   * ToFloat / FromFloat: fp32 <-> float32 / bfloat16 / float16 (round to nearest even).
//   * Pack<T, N>: N consecutive elements moved with the widest aligned accesses (16 bytes at most);
//     ForgetValue keeps a register cache of packs packed.
//   * WarpSum: butterfly sum over a warp; every lane gets the same bits. BlockInclusiveScan:
//     prefix sums over a CTA.
//   * TypeTag, DispatchFloat: the switch from a float32 / bfloat16 / float16 dtype to a type.
//   * IsAligned, LastLaunchError: host helpers for choosing the access width and for turning a
//     failed kernel launch into an ffi::Error.
#ifndef JAXOPS_XLA_FFI_COMMON_CUDA_UTIL_CUH_
#define JAXOPS_XLA_FFI_COMMON_CUDA_UTIL_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

// The XLA FFI headers trip diagnostics of nvcc's front end and of the host compiler (a switch
// covering every enumerator without a trailing return, always_inline on non-inline templates);
// silence them for those headers only. Every .cu file includes
// this header before anything else that includes ffi.h; later includes are no-ops.
#pragma nv_diagnostic push
#pragma nv_diag_suppress 940
#pragma nv_diag_suppress 2473
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wreturn-type"
#include "xla/ffi/api/ffi.h"
#pragma GCC diagnostic pop
#pragma nv_diagnostic pop

#include "xla_ffi/common/ffi_util.h"

namespace jaxops {

inline constexpr unsigned kFullWarpMask = 0xffffffffu;
inline constexpr int kWarpSize = 32;

// ---------------------------------------------------------------------------------------------
// Element conversions.

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}

// ---------------------------------------------------------------------------------------------
// Vectorized memory access.

// The widest single access (in bytes) used to move `bytes` contiguous bytes: 16 at most.
__host__ __device__ constexpr int AccessBytes(int bytes) { return bytes < 16 ? bytes : 16; }

template <int kBytes>
struct RawWord;
template <>
struct RawWord<2> {
  using type = unsigned short;
};
template <>
struct RawWord<4> {
  using type = unsigned int;
};
template <>
struct RawWord<8> {
  using type = uint2;
};
template <>
struct RawWord<16> {
  using type = uint4;
};

// N consecutive elements of T, aligned for the accesses that LoadPack / StorePack issue.
template <typename T, int N>
struct alignas(AccessBytes(static_cast<int>(sizeof(T)) * N)) Pack {
  T v[N];
};

// Loads p[0, N). p must be aligned to AccessBytes(N * sizeof(T)) bytes.
template <typename T, int N>
__device__ __forceinline__ void LoadPack(const T* p, Pack<T, N>& out) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
  using Word = typename RawWord<AccessBytes(kBytes)>::type;
  const Word* src = reinterpret_cast<const Word*>(p);
  Word* dst = reinterpret_cast<Word*>(&out);
#pragma unroll
  for (int i = 0; i < kBytes / AccessBytes(kBytes); ++i) dst[i] = src[i];
}

// Stores p[0, N). p must be aligned to AccessBytes(N * sizeof(T)) bytes.
template <typename T, int N>
__device__ __forceinline__ void StorePack(T* p, const Pack<T, N>& in) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
  using Word = typename RawWord<AccessBytes(kBytes)>::type;
  const Word* src = reinterpret_cast<const Word*>(&in);
  Word* dst = reinterpret_cast<Word*>(p);
#pragma unroll
  for (int i = 0; i < kBytes / AccessBytes(kBytes); ++i) dst[i] = src[i];
}

// Hides the value of p from the optimizer at this point (an empty volatile asm that claims to
// rewrite each 32-bit word; it emits no instruction). fp32 values converted from p before this
// point cannot be reused after it, nor hoisted out of the enclosing loop, so code that reads a
// register cache of 16-bit elements more than once keeps the packed words (two elements per
// register) live instead of one fp32 register per element, and converts again when it reads
// (one cheap integer op per element). This keeps the row caches of the RMSNorm kernels in
// registers without spilling.
template <typename T, int N>
__device__ __forceinline__ void ForgetValue(Pack<T, N>& p) {
  if constexpr (sizeof(Pack<T, N>) % sizeof(unsigned) == 0) {
    unsigned* words = reinterpret_cast<unsigned*>(&p);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(Pack<T, N>) / sizeof(unsigned)); ++i) {
      asm volatile("" : "+r"(words[i]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Reductions.

// Sum over the 32 lanes of a warp (all must call it). The butterfly adds the same operands on
// every lane (addition is commutative), so all lanes return identical bits.
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullWarpMask, v, offset);
  }
  return v;
}

// Inclusive prefix sum over the CTA (all threads call it, blockDim.x a multiple of 32); `total`
// gets the CTA's sum. warp_totals holds blockDim.x / 32 entries and may be reused by the next
// call.
__device__ __forceinline__ long long BlockInclusiveScan(long long v, long long* warp_totals,
                                                        long long& total) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const long long other = __shfl_up_sync(kFullWarpMask, v, offset);
    if (lane >= offset) v += other;
  }
  __syncthreads();  // The previous call's readers are done with warp_totals.
  if (lane == kWarpSize - 1) warp_totals[warp] = v;
  __syncthreads();
  long long before = 0;
  long long sum = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x) / kWarpSize; ++w) {
    const long long t = warp_totals[w];
    if (w < warp) before += t;
    sum += t;
  }
  total = sum;
  return v + before;
}

// ---------------------------------------------------------------------------------------------
// Host helpers.

template <typename T>
struct TypeTag {
  using type = T;
};

// The one place where a float dtype becomes a template argument: calls launch(TypeTag<T>{}) for
// float32, bfloat16 or float16.
template <typename Launch>
ffi::Error DispatchFloat(const char* op, const char* operand, ffi::DataType dtype,
                         Launch&& launch) {
  switch (dtype) {
    case ffi::DataType::F32:
      return launch(TypeTag<float>{});
    case ffi::DataType::BF16:
      return launch(TypeTag<__nv_bfloat16>{});
    case ffi::DataType::F16:
      return launch(TypeTag<__half>{});
    default:
      return InvalidArgument(std::string(op) + ": " + operand +
                             " dtype must be float32, bfloat16 or float16, got " +
                             DataTypeName(dtype));
  }
}

inline bool IsAligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Checks the launch that was just issued on this thread (launch configuration errors surface here;
// the kernel itself runs asynchronously and is never waited for).
inline ffi::Error LastLaunchError(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) return ffi::Error::Success();
  return Internal(std::string(what) + " failed: " + cudaGetErrorName(status) + ": " +
                  cudaGetErrorString(status));
}

}  // namespace jaxops

#endif  // JAXOPS_XLA_FFI_COMMON_CUDA_UTIL_CUH_
