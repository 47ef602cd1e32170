// RMSNorm math shared by the CPU and CUDA kernels.
//
// Forward, per row r of a [rows, hidden] view (all arithmetic in fp32):
//   rstd[r] = 1 / sqrt(sum_j x[r, j]^2 / hidden + eps)
//   y[r, j] = x[r, j] * rstd[r] * w_eff[j],   w_eff = w, or 1 + w when zero-centered,
//                                             or 1 when there is no weight.
// Backward, with g[r, j] = dy[r, j] * w_eff[j] and dot[r] = sum_j g[r, j] * x[r, j]:
//   dx[r, j] = rstd[r] * g[r, j] - x[r, j] * rstd[r]^3 * dot[r] / hidden  (+ dh[r, j])
//   dw[j]    = sum_r dy[r, j] * x[r, j] * rstd[r]
// dw is reduced deterministically, without atomics: rows are cut into `parts` contiguous ranges
// that depend only on (rows, parts); each range is summed in an order fixed by the kernel design
// into dw_partial[p, :], and the parts are then summed in a fixed order (CPU: p = 0, 1, ...;
// CUDA: 8 ranges of parts each in order, then the ranges in order). Same inputs give the same
// bits on one platform (CPU and CUDA may differ in the last bits).
#ifndef JAXOPS_XLA_FFI_RMS_NORM_RMS_NORM_H_
#define JAXOPS_XLA_FFI_RMS_NORM_RMS_NORM_H_

#include <cstdint>

#include "xla_ffi/common/math.h"

namespace jaxops::rms_norm {

JAXOPS_HOST_DEVICE float Rstd(float sum_squares, int64_t hidden, float eps) {
  return ReciprocalSqrt(sum_squares / static_cast<float>(hidden) + eps);
}

JAXOPS_HOST_DEVICE float EffectiveWeight(float w, bool zero_centered) {
  return zero_centered ? 1.0f + w : w;
}

JAXOPS_HOST_DEVICE float Normalize(float x, float rstd, float w_eff) { return x * rstd * w_eff; }

// The coefficient c of dx = rstd * g - c * x.
JAXOPS_HOST_DEVICE float BackwardCoefficient(float dot, float rstd, int64_t hidden) {
  return rstd * rstd * rstd * dot / static_cast<float>(hidden);
}

JAXOPS_HOST_DEVICE float GradInput(float g, float x, float rstd, float coefficient) {
  return rstd * g - coefficient * x;
}

// First row of part p when `rows` rows are cut into `parts` nearly equal contiguous ranges.
JAXOPS_HOST_DEVICE int64_t PartBegin(int64_t p, int64_t rows, int64_t parts) {
  return rows / parts * p + (p < rows % parts ? p : rows % parts);
}

}  // namespace jaxops::rms_norm

#endif  // JAXOPS_XLA_FFI_RMS_NORM_RMS_NORM_H_
