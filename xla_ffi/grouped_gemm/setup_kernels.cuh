// The device kernels of the grouped GEMM's library handlers (cuBLASLt's, cublaslt.cu; CUTLASS's,
// cutlass_sm90.cu and cutlass_fp8_sm90.cu): the setup that turns the device-side group sizes into
// per-group arrays (rows, matrix pointers), and the two zero fills (the forward's rows past the
// groups, the weight gradient's groups without rows). The kernels have internal linkage (an
// anonymous namespace): each .cu file that includes this header gets its own copy, and the
// copies never collide at link.
#ifndef JAXOPS_XLA_FFI_GROUPED_GEMM_SETUP_KERNELS_CUH_
#define JAXOPS_XLA_FFI_GROUPED_GEMM_SETUP_KERNELS_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "xla_ffi/common/cuda_util.cuh"

namespace jaxops::grouped_gemm {

// Where a group's matrix starts: base + g * stride (one matrix per group: w, dw) or
// base + start * stride (the group's first row: x, dy, y).
struct PointerRule {
  const char* base = nullptr;
  int64_t stride = 0;  // bytes
  bool per_row = false;
};

struct SetupParams {
  const int32_t* sizes = nullptr;
  int64_t groups = 0;
  int64_t rows = 0;
  int32_t n = 0;
  int32_t k = 0;
  PointerRule a, b, d;
  const void** a_ptrs = nullptr;
  const void** b_ptrs = nullptr;
  const void** d_ptrs = nullptr;
  float* alpha = nullptr;
  float* beta = nullptr;
  int32_t* m = nullptr;
  int32_t* ns = nullptr;
  int32_t* ks = nullptr;
  long long* total = nullptr;
  // The block-scaled FP8 handler's scale pointers (cutlass_fp8_sm90.cu); null arrays: none.
  PointerRule sfa, sfb;
  const void** sfa_ptrs = nullptr;
  const void** sfb_ptrs = nullptr;
};

constexpr int kSetupThreads = 1024;

namespace {

__device__ __forceinline__ const void* GroupPointer(const PointerRule& rule, int64_t g,
                                                    long long start) {
  return rule.base + (rule.per_row ? static_cast<int64_t>(start) : g) * rule.stride;
}

// One CTA: prefix sums of the clipped sizes, 1024 groups at a time, and every group's entries.
__global__ void __launch_bounds__(kSetupThreads) GroupedSetupKernel(SetupParams s) {
  __shared__ long long warp_totals[kSetupThreads / kWarpSize];
  const long long rows = s.rows;
  long long carry = 0;
  for (int64_t first = 0; first < s.groups; first += kSetupThreads) {
    const int64_t g = first + threadIdx.x;
    const long long size = g < s.groups ? max(s.sizes[g], 0) : 0;
    long long chunk = 0;
    const long long end = carry + BlockInclusiveScan(size, warp_totals, chunk);
    if (g < s.groups) {
      const long long start = min(end - size, rows);
      s.m[g] = static_cast<int32_t>(min(end, rows) - start);
      s.ns[g] = s.n;
      s.ks[g] = s.k;
      s.a_ptrs[g] = GroupPointer(s.a, g, start);
      s.b_ptrs[g] = GroupPointer(s.b, g, start);
      s.d_ptrs[g] = GroupPointer(s.d, g, start);
      if (s.sfa_ptrs != nullptr) {
        s.sfa_ptrs[g] = GroupPointer(s.sfa, g, start);
        s.sfb_ptrs[g] = GroupPointer(s.sfb, g, start);
      }
    }
    carry += chunk;
  }
  if (threadIdx.x == 0) {
    *s.total = min(carry, rows);
    *s.alpha = 1.0f;
    *s.beta = 0.0f;
  }
}

constexpr int kFillThreads = 256;

// Zeros the float4s of rows [*total, rows) of y (row_vecs float4s per row).
__global__ void __launch_bounds__(kFillThreads)
    ZeroTailKernel(float4* y, const long long* total, int64_t rows, int64_t row_vecs) {
  const int64_t end = rows * row_vecs;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kFillThreads;
  for (int64_t i = *total * row_vecs + blockIdx.x * int64_t{kFillThreads} + threadIdx.x; i < end;
       i += step) {
    y[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}

// Zeros dw[g] (group_vecs float4s) of every group g without rows; `chunks` CTAs per group.
__global__ void __launch_bounds__(kFillThreads)
    ZeroEmptyGroupsKernel(float4* dw, const int32_t* m, int64_t group_vecs, int chunks) {
  const int64_t g = blockIdx.x / chunks;
  if (m[g] != 0) return;
  float4* out = dw + g * group_vecs;
  const int64_t step = int64_t{chunks} * kFillThreads;
  for (int64_t i = (blockIdx.x % chunks) * int64_t{kFillThreads} + threadIdx.x; i < group_vecs;
       i += step) {
    out[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}

// Host side of the two fills, on the stream. ZeroTail: rows [*total, rows) of y [rows, n] (n a
// multiple of 4); `what` names the launch in an error.
inline ffi::Error ZeroTail(cudaStream_t stream, float* y, const long long* total, int64_t rows,
                           int64_t n, const char* what) {
  const int64_t row_vecs = n / 4;
  ZeroTailKernel<<<GridCtas(rows * row_vecs, kFillThreads * 4, 4096), kFillThreads, 0, stream>>>(
      reinterpret_cast<float4*>(y), total, rows, row_vecs);
  return LastLaunchError(what);
}

// The CTAs per group of ZeroEmptyGroups for dw [groups, k, n] (k * n a multiple of 4), or an
// error past CUDA's grid limit: ask before enqueueing anything.
inline ffi::ErrorOr<int> EmptyGroupChunks(const char* op, int64_t groups, int64_t k, int64_t n) {
  const int64_t group_vecs = k * n / 4;
  const int chunks =
      static_cast<int>(std::clamp<int64_t>(CeilDiv(group_vecs, int64_t{kFillThreads} * 8), 1, 64));
  if (groups * chunks > int64_t{0x7fffffff}) {
    return Bad(std::string(op) + ": " + std::to_string(groups) +
               " groups are past CUDA's grid limit");
  }
  return chunks;
}

// Zeros dw[g] of every group g whose m[g] is 0, with EmptyGroupChunks' `chunks`.
inline ffi::Error ZeroEmptyGroups(cudaStream_t stream, float* dw, const int32_t* m, int64_t groups,
                                  int64_t k, int64_t n, int chunks, const char* what) {
  ZeroEmptyGroupsKernel<<<static_cast<unsigned>(groups * chunks), kFillThreads, 0, stream>>>(
      reinterpret_cast<float4*>(dw), m, k * n / 4, chunks);
  return LastLaunchError(what);
}

}  // namespace

}  // namespace jaxops::grouped_gemm

#endif  // JAXOPS_XLA_FFI_GROUPED_GEMM_SETUP_KERNELS_CUH_
