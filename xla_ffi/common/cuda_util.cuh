// Helpers shared by the CUDA code of every op family (compiled by nvcc only); the vectorized
// accesses are in cuda_vec.cuh.
//
//   * ToFloat / FromFloat: fp32 <-> float32 / bfloat16 / float16 (round to nearest even).
//   * WarpSum: butterfly sum over a warp; every lane gets the same bits. BlockInclusiveScan:
//     prefix sums over a CTA.
//   * Host side: DispatchFloat (the dtype switch of the CUDA dispatch), grid sizes, stream fills,
//     the dynamic shared memory opt-in, and LastLaunchError, which turns a failed kernel launch
//     into an ffi::Error.
#ifndef JAXOPS_XLA_FFI_COMMON_CUDA_UTIL_CUH_
#define JAXOPS_XLA_FFI_COMMON_CUDA_UTIL_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
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
#include "xla_ffi/common/math.h"

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

// Grid cap of the kernels that loop over their work (grid-stride): it only bounds the launch.
inline constexpr int64_t kMaxGridCtas = int64_t{1} << 20;
// Dynamic shared memory a kernel may use without opting in (ReserveDynamicShared).
inline constexpr size_t kDefaultDynamicSharedBytes = 48 * 1024;

// CTAs for `work` items at `per_cta` items per CTA: at least 1, at most `cap`.
inline unsigned GridCtas(int64_t work, int64_t per_cta, int64_t cap = kMaxGridCtas) {
  return static_cast<unsigned>(std::clamp<int64_t>(CeilDiv(work, per_cta), 1, cap));
}

// The smallest power of two >= n (1 for n <= 1).
inline int64_t NextPowerOfTwo(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

// Calls launch(TypeTag<T>{}) for a float32, bfloat16 or float16 dtype, with T = float,
// __nv_bfloat16 or __half; any other dtype is an InvalidArgument error naming the supported ones.
template <typename Launch>
ffi::Error DispatchFloat(const char* op, const char* operand, ffi::DataType dtype,
                         Launch&& launch) {
  return SwitchFloat<float, __nv_bfloat16, __half>(op, operand, dtype, launch,
                                                   [](ffi::Error error) { return error; });
}

// Sets `bytes` bytes at p to `value` on the stream (nothing for 0 bytes); `what` names the fill
// in the error.
inline ffi::Error FillAsync(const char* what, void* p, int value, int64_t bytes,
                            cudaStream_t stream) {
  if (bytes == 0) return ffi::Error::Success();
  const cudaError_t status = cudaMemsetAsync(p, value, static_cast<size_t>(bytes), stream);
  if (status == cudaSuccess) return ffi::Error::Success();
  return Internal(std::string(what) + " failed: " + cudaGetErrorString(status));
}

// Lets `kernel` use `bytes` of dynamic shared memory: an opt-in above the default 48 KiB.
template <typename Kernel>
ffi::Error ReserveDynamicShared(const char* op, Kernel kernel, size_t bytes) {
  if (bytes <= kDefaultDynamicSharedBytes) return ffi::Error::Success();
  const cudaError_t status = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (status == cudaSuccess) return ffi::Error::Success();
  return Internal(std::string(op) + ": cannot reserve " + std::to_string(bytes) +
                  " bytes of shared memory: " + cudaGetErrorString(status));
}

// Launch shapes ResidentCtas caches per kernel and device (keys 0 .. kResidentKeys - 1).
inline constexpr int kResidentKeys = 8;

// CTAs of kKernel (kCtaThreads threads per CTA, shared_bytes of dynamic shared memory) that are
// resident on the current device at once: the grid of a grid-stride kernel that runs in one wave.
// Cached per kernel, device (the first 64 ordinals) and key, so the runtime is queried once for
// each; a caller whose launches differ in shared_bytes gives each size its own key (a key outside
// [0, kResidentKeys) is not cached). A kernel above the default dynamic shared memory must have
// been granted it (ReserveDynamicShared) first.
template <auto kKernel, int kCtaThreads>
ffi::ErrorOr<int64_t> ResidentCtas(const char* op, size_t shared_bytes = 0, int key = 0) {
  static std::atomic<int64_t> cache[64][kResidentKeys] = {};
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  const bool cached =
      status == cudaSuccess && device >= 0 && device < 64 && key >= 0 && key < kResidentKeys;
  if (cached) {
    if (const int64_t known = cache[device][key].load(std::memory_order_relaxed); known > 0) {
      return known;
    }
  }
  int sms = 0;
  int per_sm = 0;
  if (status == cudaSuccess) {
    status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (status == cudaSuccess) {
    status =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kCtaThreads, shared_bytes);
  }
  if (status != cudaSuccess) {
    return ffi::Unexpected(Internal(
        std::string(op) + ": cannot query the device's occupancy: " + cudaGetErrorString(status)));
  }
  const int64_t ctas = int64_t{std::max(sms, 1)} * std::max(per_sm, 1);
  if (cached) cache[device][key].store(ctas, std::memory_order_relaxed);
  return ctas;
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
