// Shape validation of the RMSNorm FFI handlers, shared by the CPU and CUDA dispatch.
//
// The Python wrappers validate everything at trace time; these checks guard the kernels against
// anything that reaches them another way, so a bad call is an error, never an out-of-bounds access.
//
// Handler contracts (x is viewed as [rows, hidden]; "[0]" marks an absent optional operand):
//   jaxops_rms_norm_fwd      x, weight [hidden] | [0], rstd_in [rows] | [0]  ->  y, rstd [rows]
//   jaxops_add_rms_norm_fwd  x, residual, weight [hidden] | [0]              ->  y, h, rstd [rows]
//   jaxops_rms_norm_bwd      dy, x, weight [hidden] | [0], rstd [rows], dot_in [rows] | [0],
//                            dh (x's shape) | [0]
//                            ->  dx, dw [hidden] | [0] (f32), dw_partial [parts, hidden] | [parts,
//                            0]
// rstd_in, when given, replaces the row statistic (used when the hidden axis is sharded and the
// sum of squares was all-reduced outside the kernel); dot_in likewise replaces
// dot[r] = sum_j dy[r, j] * w_eff[j] * x[r, j], already scaled by hidden_local / hidden_total so
// that the kernel's division by its own hidden size yields the global mean. dh is added to dx
// (add_rms_norm's h cotangent).
#ifndef JAXOPS_XLA_FFI_RMS_NORM_CHECKS_H_
#define JAXOPS_XLA_FFI_RMS_NORM_CHECKS_H_

#include <cstdint>
#include <string>

#include "xla_ffi/common/ffi_util.h"

namespace jaxops::rms_norm {

struct RowShape {
  int64_t rows = 0;
  int64_t hidden = 0;
  bool has_weight = false;
  bool has_rstd_in = false;
};

struct BackwardShape {
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t parts = 0;
  bool has_weight = false;
  bool has_dot_in = false;
  bool has_dh = false;
};

inline ffi::Error CheckInput(const ffi::AnyBuffer& x, RowShape& shape) {
  if (x.dimensions().size() == 0)
    return InvalidArgument("rms_norm: x must have rank >= 1, got rank 0");
  shape.hidden = LastDim(x);
  shape.rows = LeadingCount(x);
  if (shape.hidden < 1) return InvalidArgument("rms_norm: the hidden (last) axis of x is empty");
  return ffi::Error::Success();
}

inline ffi::Error CheckWeight(const ffi::AnyBuffer& weight, RowShape& shape) {
  const int64_t n = ElementCount(weight);
  if (weight.dimensions().size() != 1 || (n != 0 && n != shape.hidden)) {
    return InvalidArgument("rms_norm: weight must have shape (" + std::to_string(shape.hidden) +
                           ",) or (0,) for no weight, got " + std::to_string(n) + " elements");
  }
  shape.has_weight = n != 0;
  return ffi::Error::Success();
}

inline ffi::Error CheckRowVector(const char* name, int64_t count, int64_t rows, bool optional) {
  if (count == rows || (optional && count == 0)) return ffi::Error::Success();
  return InvalidArgument(std::string("rms_norm: ") + name + " must have " + std::to_string(rows) +
                         " elements (one per row), got " + std::to_string(count));
}

// x, the weight and rstd [rows]: the first checks of every handler.
inline ffi::ErrorOr<RowShape> CheckRowsAndRstd(const ffi::AnyBuffer& x,
                                               const ffi::AnyBuffer& weight, int64_t rstd_count) {
  RowShape shape;
  if (auto e = CheckInput(x, shape); e.failure()) return ffi::Unexpected(std::move(e));
  if (auto e = CheckWeight(weight, shape); e.failure()) return ffi::Unexpected(std::move(e));
  if (auto e = CheckRowVector("rstd", rstd_count, shape.rows, false); e.failure())
    return ffi::Unexpected(std::move(e));
  return shape;
}

inline ffi::ErrorOr<RowShape> CheckForward(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight,
                                           int64_t rstd_in_count, const ffi::AnyBuffer& y,
                                           int64_t rstd_count) {
  auto shape = CheckRowsAndRstd(x, weight, rstd_count);
  if (shape.has_error()) return shape;
  if (auto e = CheckRowVector("rstd_in", rstd_in_count, shape->rows, true); e.failure())
    return ffi::Unexpected(std::move(e));
  if (!SameShape(x, y) || x.element_type() != y.element_type()) {
    return ffi::Unexpected(InvalidArgument("rms_norm: y must match x in shape and dtype"));
  }
  shape->has_rstd_in = rstd_in_count != 0;
  return shape;
}

inline ffi::ErrorOr<RowShape> CheckAddForward(const ffi::AnyBuffer& x,
                                              const ffi::AnyBuffer& residual,
                                              const ffi::AnyBuffer& weight, const ffi::AnyBuffer& y,
                                              const ffi::AnyBuffer& h, int64_t rstd_count) {
  auto shape = CheckRowsAndRstd(x, weight, rstd_count);
  if (shape.has_error()) return shape;
  for (const ffi::AnyBuffer* other : {&residual, &y, &h}) {
    if (!SameShape(x, *other) || x.element_type() != other->element_type()) {
      return ffi::Unexpected(
          InvalidArgument("add_rms_norm: residual, y and h must match x in shape and dtype"));
    }
  }
  return shape;
}

inline ffi::ErrorOr<BackwardShape> CheckBackward(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                                 const ffi::AnyBuffer& weight, int64_t rstd_count,
                                                 int64_t dot_in_count, const ffi::AnyBuffer& dh,
                                                 const ffi::AnyBuffer& dx, int64_t dw_count,
                                                 const ffi::AnyBuffer& dw_partial) {
  const auto checked = CheckRowsAndRstd(x, weight, rstd_count);
  if (checked.has_error()) return ffi::Unexpected(checked.error());
  const RowShape& row = *checked;
  if (auto e = CheckRowVector("dot_in", dot_in_count, row.rows, true); e.failure())
    return ffi::Unexpected(std::move(e));
  for (const ffi::AnyBuffer* other : {&dy, &dx}) {
    if (!SameShape(x, *other) || x.element_type() != other->element_type()) {
      return ffi::Unexpected(
          InvalidArgument("rms_norm backward: dy and dx must match x in shape and dtype"));
    }
  }
  BackwardShape shape;
  shape.rows = row.rows;
  shape.hidden = row.hidden;
  shape.has_weight = row.has_weight;
  shape.has_dot_in = dot_in_count != 0;
  shape.has_dh = ElementCount(dh) != 0;
  if (shape.has_dh && (!SameShape(x, dh) || x.element_type() != dh.element_type())) {
    return ffi::Unexpected(
        InvalidArgument("rms_norm backward: dh must match x in shape and dtype, or be empty"));
  }
  const int64_t weight_count = row.has_weight ? row.hidden : 0;
  if (dw_count != weight_count) {
    return ffi::Unexpected(
        InvalidArgument("rms_norm backward: dw must have as many elements as weight"));
  }
  auto pdims = dw_partial.dimensions();
  if (dw_partial.element_type() != ffi::DataType::F32 || pdims.size() != 2 || pdims[0] < 1 ||
      pdims[1] != weight_count) {
    return ffi::Unexpected(
        InvalidArgument("rms_norm backward: dw_partial must be float32 of shape (parts >= 1, " +
                        std::to_string(weight_count) + ")"));
  }
  shape.parts = pdims[0];
  return shape;
}

}  // namespace jaxops::rms_norm

#endif  // JAXOPS_XLA_FFI_RMS_NORM_CHECKS_H_
