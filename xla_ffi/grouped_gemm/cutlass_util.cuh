// What the CUTLASS grouped GEMM handlers share (cutlass_sm90.cu: bfloat16; cutlass_fp8_sm90.cu:
// block-scaled FP8): the group problem shape and layouts both use, the workspace's layout rules and
// the setup's arrays in it, the device check (an sm_90 GPU with at most kMaxSms SMs, the count the
// workspace is sized for) and CUTLASS's status as an ffi::Error.
#ifndef JAXOPS_XLA_FFI_GROUPED_GEMM_CUTLASS_UTIL_CUH_
#define JAXOPS_XLA_FFI_GROUPED_GEMM_CUTLASS_UTIL_CUH_

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "cutlass/cutlass.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/layout/matrix.h"
#include "xla_ffi/common/cuda_util.cuh"
#include "xla_ffi/common/cuda_vec.cuh"
#include "xla_ffi/grouped_gemm/setup_kernels.cuh"

namespace jaxops::grouped_gemm {

// The problem shape of one group: (M, N, K), ints, in device memory.
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Shape3 = ProblemShape::UnderlyingProblemShape;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;
inline constexpr int kAlignD = 4;  // float outputs: 4 in 16 bytes (TMA's rows)

// Workspace sizes are computed for up to this many SMs (CUTLASS keeps TMA descriptors per SM);
// H100 and H200 have 132.
inline constexpr int kMaxSms = 256;
inline constexpr int64_t kRegionAlign = 256;
// CUTLASS keeps TMA descriptors (CUtensorMap: 64-byte aligned) in its part of the workspace, which
// starts at a multiple of kRegionAlign: the workspace itself must be so aligned.
inline constexpr int64_t kWorkspaceAlign = 64;

// `bytes` rounded up to a whole number of workspace regions.
inline int64_t Region(int64_t bytes) { return CeilDiv(bytes, kRegionAlign) * kRegionAlign; }

// Lays out a workspace region after region: Take(bytes) is the next region's offset.
struct Carve {
  int64_t end = 0;
  int64_t Take(int64_t bytes) {
    const int64_t at = end;
    end += Region(bytes);
    return at;
  }
};

// The setup kernel's arrays (setup_kernels.cuh) at the offsets of a workspace layout L (its
// a_ptrs, b_ptrs, d_ptrs, m, n, k and scalars) from `base`.
template <typename L>
void PointSetup(SetupParams& s, char* base, const L& l) {
  s.a_ptrs = reinterpret_cast<const void**>(base + l.a_ptrs);
  s.b_ptrs = reinterpret_cast<const void**>(base + l.b_ptrs);
  s.d_ptrs = reinterpret_cast<const void**>(base + l.d_ptrs);
  s.m = reinterpret_cast<int32_t*>(base + l.m);
  s.ns = reinterpret_cast<int32_t*>(base + l.n);
  s.ks = reinterpret_cast<int32_t*>(base + l.k);
  s.alpha = reinterpret_cast<float*>(base + l.scalars);
  s.beta = reinterpret_cast<float*>(base + l.scalars + 4);
  s.total = reinterpret_cast<long long*>(base + l.scalars + 8);
}

// The device's SM count, queried once per device (the first 64 ordinals), or 0.
inline int SmCount(int device) {
  static std::atomic<int> cache[64] = {};
  if (device >= 0 && device < 64) {
    if (const int known = cache[device].load(std::memory_order_relaxed); known > 0) return known;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 0;
  }
  if (device >= 0 && device < 64) cache[device].store(sms, std::memory_order_relaxed);
  return sms;
}

// Whether the device is an sm_90 (Hopper) one: the only one these kernels run on.
inline bool IsSm90(int device) {
  int major = 0;
  int minor = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
         major == 9 && minor == 0;
}

// The SM count of `device` if the CUTLASS kernels run there, else the error naming why; `undo`
// says how the user avoids the kernels.
inline ffi::ErrorOr<int> CutlassSms(const char* op, int32_t device, const char* undo) {
  if (!IsSm90(device)) {
    return Bad(std::string(op) + " (CUTLASS): the kernels are built for sm_90a (H100, H200); " +
               "device " + std::to_string(device) + " is not one: " + undo);
  }
  const int sms = SmCount(device);
  if (sms <= 0 || sms > kMaxSms) {
    return Bad(std::string(op) + " (CUTLASS): device " + std::to_string(device) + " has " +
               std::to_string(sms) + " SMs; the workspace is sized for 1 to " +
               std::to_string(kMaxSms));
  }
  return sms;
}

// The workspace as a base pointer, or the error naming what it must be.
inline ffi::ErrorOr<char*> CutlassWorkspace(const char* op, ffi::AnyBuffer& workspace,
                                            int64_t bytes, int64_t groups) {
  if (workspace.element_type() != ffi::DataType::U8 ||
      static_cast<int64_t>(workspace.size_bytes()) < bytes ||
      !IsAligned(workspace.untyped_data(), kWorkspaceAlign)) {
    return Bad(std::string(op) + " (CUTLASS): the workspace must be " +
               std::to_string(kWorkspaceAlign) +
               "-byte-aligned uint8 [>= " + std::to_string(bytes) + "] for " +
               std::to_string(groups) + " groups, got " + ShapeString(workspace));
  }
  return static_cast<char*>(workspace.untyped_data());
}

inline ffi::Error CutlassError(cutlass::Status status, const std::string& what) {
  if (status == cutlass::Status::kSuccess) return ffi::Error::Success();
  return Internal(what + " failed: " + cutlassGetStatusString(status));
}

}  // namespace jaxops::grouped_gemm

#endif  // JAXOPS_XLA_FFI_GROUPED_GEMM_CUTLASS_UTIL_CUH_
