// Grouped activation CPU kernels: the expert FFN's activation (activation.h) between its two
// grouped GEMMs, on the rows the groups cover only.
//
//   * GroupedActivationFwd: a[r] = act(h[r]) for the groups' rows, zeros after them; h float32,
//     a float32, bfloat16 or float16.
//   * GroupedActivationBwd: dh[r] = the gradient of act at h[r] times da[r] for the groups'
//     rows, zeros after them; da float32, bfloat16 or float16, dh float32.
//
// With zero_tail false both leave the rows after the groups unwritten (a caller that reads the
// groups' rows only: the expert layer's intermediates).
//
// The expert layer's buffers are sized for the worst case of the routing: on 8 simulated
// devices the gather exchange's 2172-row buffer held about 640 rows of groups, and XLA's fusion
// computed the activation and its gradient on every row (an exp per element). Rows run in
// parallel on the FFI thread pool; the columns of a row in a loop the compiler vectorizes
// (activation.h's exp has no branches or calls).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/cpu_convert.h"
#include "xla_ffi/common/cpu_dispatch.h"
#include "xla_ffi/common/cpu_parallel.h"
#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/common/host_float.h"
#include "xla_ffi/grouped_gemm/activation.h"
#include "xla_ffi/grouped_gemm/handlers.h"

namespace jaxops::grouped_gemm {
namespace {

// The sizes of one call.
struct Shape {
  int64_t rows = 0;       // R
  int64_t in = 0;         // h's columns C
  int64_t out = 0;        // a's columns F (C / 2 for a gated activation, else C)
  int64_t used = 0;       // rows the groups cover, clipped as the grouped GEMMs clip them
  bool zero_tail = true;  // write zeros to rows [used, rows) of the output
};

// Rows [0, used) the groups cover: negative sizes count as 0, none past the last row.
int64_t UsedRows(const int32_t* sizes, int64_t groups, int64_t rows) {
  int64_t at = 0;
  for (int64_t g = 0; g < groups; ++g) at = std::min(rows, at + std::max<int64_t>(0, sizes[g]));
  return at;
}

// Gate and up of output column c of a row of h (kSilu: the column itself, no up).
template <Activation kAct>
inline void GateUp(const float* h, int64_t f, int64_t c, float& g, float& u) {
  if constexpr (kAct == Activation::kSwiglu) {
    g = h[c];
    u = h[f + c];
  } else if constexpr (kAct == Activation::kClampedSwiglu) {
    g = h[2 * c];
    u = h[2 * c + 1];
  } else {
    g = h[c];
    u = 0.0f;
  }
}

// out[j] = act(h)[j0 + j] for j < count (one row of h; f output columns).
template <Activation kAct>
JAXOPS_CPU_CLONES void ForwardColumns(const float* h, int64_t f, int64_t j0, int64_t count,
                                      float alpha, float limit, float* out) {
  for (int64_t j = 0; j < count; ++j) {
    float g, u;
    GateUp<kAct>(h, f, j0 + j, g, u);
    out[j] = Forward<kAct>(g, u, alpha, limit);
  }
}

// One row of dh from its rows of h and da.
template <Activation kAct, typename X>
JAXOPS_CPU_CLONES void BackwardRow(const float* h, const X* da, int64_t f, float alpha, float limit,
                                   float* dh) {
  for (int64_t c = 0; c < f; ++c) {
    float g, u, dg, du;
    GateUp<kAct>(h, f, c, g, u);
    Backward<kAct>(g, u, HostType<X>::Load(da[c]), alpha, limit, dg, du);
    if constexpr (kAct == Activation::kSwiglu) {
      dh[c] = dg;
      dh[f + c] = du;
    } else if constexpr (kAct == Activation::kClampedSwiglu) {
      dh[2 * c] = dg;
      dh[2 * c + 1] = du;
    } else {
      dh[c] = dg;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Typed implementations: zeros after the groups' rows (unless zero_tail is false), then the rows
// over the pool.

template <Activation kAct, typename X>
ffi::Future ForwardImpl(ffi::ThreadPool& pool, const Shape& s, const float* h, X* a, float alpha,
                        float limit) {
  if (s.zero_tail) {
    std::memset(static_cast<void*>(a + s.used * s.out), 0,
                static_cast<size_t>((s.rows - s.used) * s.out) * sizeof(X));
  }
  const int64_t row_bytes = s.in * int64_t{4} + s.out * int64_t{sizeof(X)};
  return ParallelFor(pool, s.used, row_bytes, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = h + r * s.in;
      StoreThroughTile(a + r * s.out, s.out, [&](int64_t j0, int64_t count, float* out) {
        ForwardColumns<kAct>(row, s.out, j0, count, alpha, limit, out);
      });
    }
  });
}

template <Activation kAct, typename X>
ffi::Future BackwardImpl(ffi::ThreadPool& pool, const Shape& s, const float* h, const X* da,
                         float* dh, float alpha, float limit) {
  if (s.zero_tail) {
    std::memset(static_cast<void*>(dh + s.used * s.in), 0,
                static_cast<size_t>((s.rows - s.used) * s.in) * sizeof(float));
  }
  const int64_t row_bytes = s.in * int64_t{8} + s.out * int64_t{sizeof(X)};
  return ParallelFor(pool, s.used, row_bytes, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      BackwardRow<kAct>(h + r * s.in, da + r * s.out, s.out, alpha, limit, dh + r * s.in);
    }
  });
}

// fn(std::integral_constant<Activation, act>) for the activation attribute's value.
template <typename Fn>
ffi::Future WithActivation(Activation act, Fn&& fn) {
  switch (act) {
    case Activation::kSwiglu:
      return fn(std::integral_constant<Activation, Activation::kSwiglu>{});
    case Activation::kClampedSwiglu:
      return fn(std::integral_constant<Activation, Activation::kClampedSwiglu>{});
    default:
      return fn(std::integral_constant<Activation, Activation::kSilu>{});
  }
}

// ---------------------------------------------------------------------------------------------
// Validation and dtype dispatch.

// The call's shape, or the error naming what is wrong. `out` is a's [R, F] (da's backward).
ffi::ErrorOr<Shape> CheckShape(const char* op, const ffi::Buffer<ffi::F32>& h,
                               const ffi::Buffer<ffi::S32>& sizes, const ffi::AnyBuffer& out,
                               const char* out_name, int32_t activation, float alpha, float limit) {
  if (activation < 0 || activation > static_cast<int32_t>(Activation::kSilu)) {
    return Bad(std::string(op) + ": activation must be 0 (swiglu), 1 (clamped_swiglu) or 2 " +
               "(silu), got " + std::to_string(activation));
  }
  const Activation act = static_cast<Activation>(activation);
  if (act == Activation::kClampedSwiglu && !(alpha > 0.0f && limit > 0.0f)) {
    return Bad(std::string(op) + ": clamped_swiglu needs alpha > 0 and limit > 0, got alpha " +
               std::to_string(alpha) + ", limit " + std::to_string(limit));
  }
  const auto hd = h.dimensions();
  const auto od = out.dimensions();
  if (hd.size() != 2 || sizes.dimensions().size() != 1 || (IsGlu(act) && hd[1] % 2 != 0)) {
    return Bad(std::string(op) + ": h must be float32 [R, C] (C even for a gated activation) " +
               "and group_sizes int32 [G]; got h " + ShapeString(h) + ", group_sizes " +
               ShapeString(sizes));
  }
  Shape s;
  s.rows = hd[0];
  s.in = hd[1];
  s.out = IsGlu(act) ? s.in / 2 : s.in;
  if (od.size() != 2 || od[0] != s.rows || od[1] != s.out) {
    return Bad(std::string(op) + ": " + out_name + " must be [" + std::to_string(s.rows) + ", " +
               std::to_string(s.out) + "] for h " + ShapeString(h) + ", got " + ShapeString(out));
  }
  s.used = UsedRows(sizes.typed_data(), sizes.dimensions()[0], s.rows);
  return s;
}

ffi::Future ForwardDispatch(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h,
                            ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::AnyBuffer> a,
                            int32_t activation, float alpha, float limit, bool zero_tail) {
  constexpr const char* kOp = "grouped_activation";
  auto shape = CheckShape(kOp, h, sizes, *a, "a", activation, alpha, limit);
  if (shape.has_error()) return ReadyFuture(shape.error());
  shape->zero_tail = zero_tail;
  return DispatchFloat(kOp, "a", a->element_type(), [&](auto tag) {
    using X = typename decltype(tag)::type;
    return WithActivation(static_cast<Activation>(activation), [&](auto act) {
      return ForwardImpl<decltype(act)::value, X>(pool, *shape, h.typed_data(),
                                                  static_cast<X*>(a->untyped_data()), alpha, limit);
    });
  });
}

ffi::Future BackwardDispatch(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h, ffi::AnyBuffer da,
                             ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::Buffer<ffi::F32>> dh,
                             int32_t activation, float alpha, float limit, bool zero_tail) {
  constexpr const char* kOp = "grouped_activation_bwd";
  auto shape = CheckShape(kOp, h, sizes, da, "da", activation, alpha, limit);
  if (shape.has_error()) return ReadyFuture(shape.error());
  shape->zero_tail = zero_tail;
  if (dh->dimensions().size() != 2 || dh->dimensions()[0] != shape->rows ||
      dh->dimensions()[1] != shape->in) {
    return ReadyFuture(InvalidArgument(std::string(kOp) + ": dh must be float32 like h " +
                                       ShapeString(h) + ", got " + ShapeString(*dh)));
  }
  return DispatchFloat(kOp, "da", da.element_type(), [&](auto tag) {
    using X = typename decltype(tag)::type;
    return WithActivation(static_cast<Activation>(activation), [&](auto act) {
      return BackwardImpl<decltype(act)::value, X>(pool, *shape, h.typed_data(),
                                                   static_cast<const X*>(da.untyped_data()),
                                                   dh->typed_data(), alpha, limit);
    });
  });
}

}  // namespace
}  // namespace jaxops::grouped_gemm

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedActivationFwdCpu, jaxops::grouped_gemm::ForwardDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()             // pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // h [R, C]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // group_sizes [G]
                                  .Ret<xla::ffi::AnyBuffer>()   // a (f32 | bf16 | f16) [R, F]
                                  .Attr<int32_t>("activation")  // 0 swiglu, 1 clamped, 2 silu
                                  .Attr<float>("alpha")         // clamped_swiglu's alpha
                                  .Attr<float>("limit")         // clamped_swiglu's limit
                                  .Attr<bool>("zero_tail"));    // zeros past the groups' rows

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedActivationBwdCpu, jaxops::grouped_gemm::BackwardDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()             // pool
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // h [R, C]
                                  .Arg<xla::ffi::AnyBuffer>()  // da (f32 | bf16 | f16) [R, F]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // group_sizes [G]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // dh [R, C]
                                  .Attr<int32_t>("activation")  // 0 swiglu, 1 clamped, 2 silu
                                  .Attr<float>("alpha")         // clamped_swiglu's alpha
                                  .Attr<float>("limit")         // clamped_swiglu's limit
                                  .Attr<bool>("zero_tail"));    // zeros past the groups' rows
