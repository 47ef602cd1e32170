// Shape validation of the grouped GEMM FFI handlers, shared by the CPU and CUDA dispatch.
//
// The Python wrappers validate everything at trace time; these checks guard the kernels against
// anything that reaches them another way, so a bad call is an error, never an out-of-bounds
// access. Group sizes are device data and are clipped by the kernels instead (grouped_gemm.h).
//
// jaxops_grouped_gemm: y[rows of g] = x[rows of g] @ w[g] (w[g].T with transpose_w).
//   operands  x (f32 | bf16 | f16) [R, K], w x's dtype [G, K, N] ([G, N, K] with transpose_w),
//             group_sizes int32 [G]
//   result    y f32 [R, N]; rows past the groups are zero
// jaxops_grouped_gemm_wgrad: dw[g] = x[rows of g].T @ dy[rows of g].
//   operands  x (f32 | bf16 | f16) [R, K], dy x's dtype [R, N], group_sizes int32 [G]
//   result    dw f32 [G, K, N]; groups without rows get zeros
#ifndef JAXOPS_XLA_FFI_GROUPED_GEMM_CHECKS_H_
#define JAXOPS_XLA_FFI_GROUPED_GEMM_CHECKS_H_

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/ffi_util.h"

namespace jaxops::grouped_gemm {

// The sizes of one call.
struct Problem {
  int64_t rows = 0;    // R
  int64_t k = 0;       // x's columns (the contraction of the forward)
  int64_t n = 0;       // y's columns (dy's for the weight gradient)
  int64_t groups = 0;  // G
};

inline ffi::Error CheckGroups(const char* op, const ffi::Buffer<ffi::S32>& sizes, int64_t groups) {
  if (sizes.dimensions().size() != 1 || sizes.dimensions()[0] != groups) {
    return InvalidArgument(std::string(op) + ": group_sizes must be int32 [" +
                           std::to_string(groups) + "], got " + ShapeString(sizes));
  }
  return ffi::Error::Success();
}

// The forward's problem, or the error naming what is wrong.
inline ffi::ErrorOr<Problem> CheckForward(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                          const ffi::Buffer<ffi::S32>& sizes,
                                          const ffi::Buffer<ffi::F32>& y, bool transpose_w) {
  constexpr const char* kOp = "grouped_gemm";
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3) {
    return Bad(std::string(kOp) + ": x must be [R, K] and w [G, K, N] (or [G, N, K]); got x " +
               ShapeString(x) + ", w " + ShapeString(w));
  }
  Problem p;
  p.rows = xd[0];
  p.k = xd[1];
  p.groups = wd[0];
  p.n = transpose_w ? wd[1] : wd[2];
  const int64_t wk = transpose_w ? wd[2] : wd[1];
  if (wk != p.k || w.element_type() != x.element_type()) {
    return Bad(std::string(kOp) + ": w must hold x's dtype and K = " + std::to_string(p.k) +
               "; got x " + ShapeString(x) + ", w " + ShapeString(w));
  }
  if (auto e = CheckGroups(kOp, sizes, p.groups); e.failure()) return ffi::Unexpected(e);
  const auto yd = y.dimensions();
  if (yd.size() != 2 || yd[0] != p.rows || yd[1] != p.n) {
    return Bad(std::string(kOp) + ": y must be float32 [" + std::to_string(p.rows) + ", " +
               std::to_string(p.n) + "], got " + ShapeString(y));
  }
  return p;
}

// The weight gradient's problem, or the error naming what is wrong.
inline ffi::ErrorOr<Problem> CheckWgrad(const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy,
                                        const ffi::Buffer<ffi::S32>& sizes,
                                        const ffi::Buffer<ffi::F32>& dw) {
  constexpr const char* kOp = "grouped_gemm_wgrad";
  const auto xd = x.dimensions();
  const auto dyd = dy.dimensions();
  const auto dwd = dw.dimensions();
  if (xd.size() != 2 || dyd.size() != 2 || dwd.size() != 3 || dyd[0] != xd[0] || dwd[1] != xd[1] ||
      dwd[2] != dyd[1] || dy.element_type() != x.element_type()) {
    return Bad(std::string(kOp) + ": x [R, K], dy [R, N] of x's dtype and dw float32 [G, K, N]; " +
               "got x " + ShapeString(x) + ", dy " + ShapeString(dy) + ", dw " + ShapeString(dw));
  }
  Problem p;
  p.rows = xd[0];
  p.k = xd[1];
  p.n = dyd[1];
  p.groups = dwd[0];
  if (auto e = CheckGroups(kOp, sizes, p.groups); e.failure()) return ffi::Unexpected(e);
  return p;
}

}  // namespace jaxops::grouped_gemm

#endif  // JAXOPS_XLA_FFI_GROUPED_GEMM_CHECKS_H_
