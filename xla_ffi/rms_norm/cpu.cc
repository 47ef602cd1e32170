// RMSNorm CPU kernels: one pass per row (the row stays in L1/L2 between its two loops), rows split
// over the XLA FFI thread pool, inner loops written so GCC vectorizes them (lane-blocked fp32
// accumulators, branch-free 16-bit conversions) and compiled for AVX-512, AVX2 and the baseline.
// 16-bit results are computed in fp32 into an L1 tile and converted by StoreFromFloat (one
// instruction per 32 bfloat16 values where the CPU has AVX512-BF16).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/cpu_convert.h"
#include "xla_ffi/common/cpu_dispatch.h"
#include "xla_ffi/common/cpu_memory.h"
#include "xla_ffi/common/cpu_parallel.h"
#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/common/host_float.h"
#include "xla_ffi/rms_norm/checks.h"
#include "xla_ffi/rms_norm/handlers.h"
#include "xla_ffi/rms_norm/rms_norm.h"

namespace jaxops::rms_norm {
namespace {

// Independent fp32 accumulators per reduction: wide enough for two AVX-512 registers, and a fixed
// summation order, so results do not depend on the instruction set the loader picked.
constexpr int64_t kLanes = 32;

using Weights = std::shared_ptr<const std::vector<float>>;

// ---------------------------------------------------------------------------------------------
// Numeric functions: one row.

template <typename X>
JAXOPS_CPU_CLONES float RowSumSquares(const X* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = HostType<X>::Load(x[j + l]);
      lanes[l] += v * v;
    }
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; j < n; ++j) {
    const float v = HostType<X>::Load(x[j]);
    sum += v * v;
  }
  return sum;
}

// out = x + residual in fp32 (rounded to X by the caller's store).
template <typename X>
JAXOPS_CPU_CLONES void AddToFloat(const X* x, const X* residual, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = HostType<X>::Load(x[j]) + HostType<X>::Load(residual[j]);
}

// out = x * rstd * w_eff in fp32 (w_eff == nullptr: no weight).
template <typename X>
JAXOPS_CPU_CLONES void ScaleToFloat(const X* x, const float* w_eff, float rstd, float* out,
                                    int64_t n) {
  if (w_eff == nullptr) {
    for (int64_t j = 0; j < n; ++j) out[j] = Normalize(HostType<X>::Load(x[j]), rstd, 1.0f);
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = Normalize(HostType<X>::Load(x[j]), rstd, w_eff[j]);
  }
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
// bfloat16: two values per 32-bit word, the even one is the word shifted left by 16 and the odd
// one the word with its low half cleared, so the loop needs no widening shuffles; even and odd
// values have kLanes accumulators each.
template <>
JAXOPS_CPU_CLONES float RowSumSquares<BFloat16>(const BFloat16* x, int64_t n) {
  float even[kLanes] = {};
  float odd[kLanes] = {};
  int64_t j = 0;
  for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      uint32_t pair;
      std::memcpy(&pair, x + j + 2 * l, sizeof(pair));
      const float e = BitsFloat(pair << 16);
      const float o = BitsFloat(pair & 0xffff0000u);
      even[l] += e * e;
      odd[l] += o * o;
    }
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += even[l] + odd[l];
  for (; j < n; ++j) {
    const float v = HostType<BFloat16>::Load(x[j]);
    sum += v * v;
  }
  return sum;
}
#endif

// h = round(x + residual), elementwise (the row then stays in L1/L2 for its sum of squares).
template <typename X>
void RowAdd(const X* x, const X* residual, X* h, int64_t n) {
  StoreThroughTile(h, n, [&](int64_t j0, int64_t count, float* out) {
    AddToFloat(x + j0, residual + j0, out, count);
  });
}

#if defined(JAXOPS_CPU_AVX512BF16)
// RowScale of a bfloat16 row on CPUs with AVX512-BF16: 32 values per step straight from registers
// to the output (the same values as ScaleToFloat + StoreFromFloat).
JAXOPS_AVX512BF16_TARGET void ScaleBf16Avx512(const BFloat16* x, const float* w_eff, float rstd,
                                              BFloat16* y, int64_t n) {
  const __m512 r = _mm512_set1_ps(rstd);
  int64_t j = 0;
  if (w_eff == nullptr) {
    for (; j + 32 <= n; j += 32) {
      const __m512 a = _mm512_mul_ps(convert_internal::LoadBf16x16(x + j), r);
      const __m512 b = _mm512_mul_ps(convert_internal::LoadBf16x16(x + j + 16), r);
      convert_internal::StoreBf16x32(a, b, y + j);
    }
  } else {
    for (; j + 32 <= n; j += 32) {
      const __m512 a = _mm512_mul_ps(_mm512_mul_ps(convert_internal::LoadBf16x16(x + j), r),
                                     _mm512_loadu_ps(w_eff + j));
      const __m512 b = _mm512_mul_ps(_mm512_mul_ps(convert_internal::LoadBf16x16(x + j + 16), r),
                                     _mm512_loadu_ps(w_eff + j + 16));
      convert_internal::StoreBf16x32(a, b, y + j);
    }
  }
  for (; j < n; ++j) {
    y[j] = HostType<BFloat16>::Store(
        Normalize(HostType<BFloat16>::Load(x[j]), rstd, w_eff == nullptr ? 1.0f : w_eff[j]));
  }
}
#endif

// y = round(x * rstd * w_eff) (w_eff == nullptr: no weight).
template <typename X>
void RowScale(const X* x, const float* w_eff, float rstd, X* y, int64_t n) {
#if defined(JAXOPS_CPU_AVX512BF16)
  if constexpr (std::is_same_v<X, BFloat16>) {
    if (convert_internal::HasAvx512Bf16()) {
      ScaleBf16Avx512(x, w_eff, rstd, y, n);
      return;
    }
  }
#endif
  StoreThroughTile(y, n, [&](int64_t j0, int64_t count, float* out) {
    ScaleToFloat(x + j0, w_eff == nullptr ? nullptr : w_eff + j0, rstd, out, count);
  });
}

// sum_j dy[j] * w_eff[j] * x[j] (w_eff = 1 without a weight).
template <typename X, bool kWeight>
JAXOPS_CPU_CLONES float RowGradDot(const X* dy, const X* x, const float* w_eff, int64_t n) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float g = HostType<X>::Load(dy[j + l]) * (kWeight ? w_eff[j + l] : 1.0f);
      lanes[l] += g * HostType<X>::Load(x[j + l]);
    }
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; j < n; ++j) {
    sum += HostType<X>::Load(dy[j]) * (kWeight ? w_eff[j] : 1.0f) * HostType<X>::Load(x[j]);
  }
  return sum;
}

// dx = rstd * dy * w_eff - coefficient * x (+ dh) in fp32; with a weight also
// dw_acc += dy * x * rstd. One loop over the row piece for all of it; the variants are separate
// instantiations so the loop has no branches.
template <typename X, bool kWeight, bool kDh>
JAXOPS_CPU_CLONES void GradInputToFloat(const X* dy, const X* x, const float* w_eff, const X* dh,
                                        float rstd, float coefficient, float* dx, float* dw_acc,
                                        int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float dyv = HostType<X>::Load(dy[j]);
    const float xv = HostType<X>::Load(x[j]);
    float v = GradInput(kWeight ? dyv * w_eff[j] : dyv, xv, rstd, coefficient);
    if constexpr (kDh) v += HostType<X>::Load(dh[j]);
    dx[j] = v;
    if constexpr (kWeight) dw_acc[j] += dyv * xv * rstd;
  }
}

template <typename X, bool kWeight, bool kDh>
void RowGradInput(const X* dy, const X* x, const float* w_eff, const X* dh, float rstd,
                  float coefficient, X* dx, float* dw_acc, int64_t n) {
  StoreThroughTile(dx, n, [&](int64_t j0, int64_t count, float* out) {
    GradInputToFloat<X, kWeight, kDh>(dy + j0, x + j0, kWeight ? w_eff + j0 : nullptr,
                                      kDh ? dh + j0 : nullptr, rstd, coefficient, out,
                                      kWeight ? dw_acc + j0 : nullptr, count);
  });
}

// The backward of one row: dot (unless given), then dx and the dweight partial.
template <typename X>
void RowBackward(const X* dy, const X* x, const float* w_eff, const X* dh, const float* dot_in,
                 float rstd, X* dx, float* dw_acc, int64_t n) {
  const bool weight = w_eff != nullptr;
  const float dot = dot_in != nullptr ? *dot_in
                    : weight          ? RowGradDot<X, true>(dy, x, w_eff, n)
                                      : RowGradDot<X, false>(dy, x, w_eff, n);
  const float c = BackwardCoefficient(dot, rstd, n);
  if (weight && dh != nullptr) {
    RowGradInput<X, true, true>(dy, x, w_eff, dh, rstd, c, dx, dw_acc, n);
  } else if (weight) {
    RowGradInput<X, true, false>(dy, x, w_eff, dh, rstd, c, dx, dw_acc, n);
  } else if (dh != nullptr) {
    RowGradInput<X, false, true>(dy, x, w_eff, dh, rstd, c, dx, dw_acc, n);
  } else {
    RowGradInput<X, false, false>(dy, x, w_eff, dh, rstd, c, dx, dw_acc, n);
  }
}

// out[j] = sum_p partial[p * n + j], in order p = 0, 1, ...
JAXOPS_CPU_CLONES void SumParts(const float* partial, int64_t parts, float* out, int64_t n) {
  std::fill(out, out + n, 0.0f);
  for (int64_t p = 0; p < parts; ++p) {
    const float* row = partial + p * n;
    for (int64_t j = 0; j < n; ++j) out[j] += row[j];
  }
}

// ---------------------------------------------------------------------------------------------
// Typed implementations.

// Bytes of memory traffic of one row: `arrays` arrays of `hidden` elements of type X.
template <typename X>
int64_t RowBytes(int64_t hidden, int64_t arrays) {
  return arrays * hidden * static_cast<int64_t>(sizeof(X));
}

template <typename X>
ffi::Future RmsNormFwdImpl(ffi::ThreadPool& pool, const RowShape& s, const X* x, Weights w,
                           const float* rstd_in, X* y, float* rstd, float eps) {
  const int64_t hidden = s.hidden;
  return ParallelFor(pool, s.rows, RowBytes<X>(hidden, 2), [=](int64_t begin, int64_t end) {
    const float* w_eff = w ? w->data() : nullptr;
    for (int64_t r = begin; r < end; ++r) {
      const X* xr = x + r * hidden;
      const float inv = rstd_in ? rstd_in[r] : Rstd(RowSumSquares(xr, hidden), hidden, eps);
      rstd[r] = inv;
      RowScale(xr, w_eff, inv, y + r * hidden, hidden);
    }
  });
}

template <typename X>
ffi::Future AddRmsNormFwdImpl(ffi::ThreadPool& pool, const RowShape& s, const X* x,
                              const X* residual, Weights w, X* y, X* h, float* rstd, float eps) {
  const int64_t hidden = s.hidden;
  return ParallelFor(pool, s.rows, RowBytes<X>(hidden, 4), [=](int64_t begin, int64_t end) {
    const float* w_eff = w ? w->data() : nullptr;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t offset = r * hidden;
      RowAdd(x + offset, residual + offset, h + offset, hidden);
      const float inv = Rstd(RowSumSquares(h + offset, hidden), hidden, eps);
      rstd[r] = inv;
      RowScale(h + offset, w_eff, inv, y + offset, hidden);
    }
  });
}

template <typename X>
ffi::Future RmsNormBwdImpl(ffi::ThreadPool& pool, const BackwardShape& s, const X* dy, const X* x,
                           Weights w, const float* rstd, const float* dot_in, const X* dh, X* dx,
                           float* dw, float* dw_partial) {
  const int64_t hidden = s.hidden;
  const int64_t rows = s.rows;
  const int64_t parts = s.parts;
  // dy, x and dx (and dh) of the rows of a part, plus its fp32 dweight accumulator.
  const int64_t part_bytes =
      CeilDiv(rows, parts) * RowBytes<X>(hidden, dh != nullptr ? 4 : 3) + hidden * 4;
  auto body = [=](int64_t p_begin, int64_t p_end) {
    const float* w_eff = w ? w->data() : nullptr;
    for (int64_t p = p_begin; p < p_end; ++p) {
      float* acc = w ? dw_partial + p * hidden : nullptr;
      if (acc != nullptr) std::fill(acc, acc + hidden, 0.0f);
      const int64_t r_end = PartBegin(p + 1, rows, parts);
      for (int64_t r = PartBegin(p, rows, parts); r < r_end; ++r) {
        const int64_t offset = r * hidden;
        RowBackward(dy + offset, x + offset, w_eff, dh ? dh + offset : nullptr,
                    dot_in ? dot_in + r : nullptr, rstd[r], dx + offset, acc, hidden);
      }
    }
  };
  auto finish = [=] {
    if (w) SumParts(dw_partial, parts, dw, hidden);
  };
  return ParallelFor(pool, parts, part_bytes, body, finish);
}

// ---------------------------------------------------------------------------------------------
// Dispatch: validation and the dtype switch.

// The weight as fp32 w_eff (1 + w when zero-centered), or null when there is no weight.
ffi::ErrorOr<Weights> EffectiveWeights(const ffi::AnyBuffer& weight, bool zero_centered) {
  const int64_t n = ElementCount(weight);
  if (n == 0) return Weights();
  auto out = std::make_shared<std::vector<float>>(n);
  auto fill = [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* typed = static_cast<const T*>(weight.untyped_data());
    for (int64_t j = 0; j < n; ++j) {
      (*out)[j] = EffectiveWeight(HostType<T>::Load(typed[j]), zero_centered);
    }
    return ffi::Error::Success();
  };
  ffi::Error filled = SwitchFloat<float, BFloat16, Float16>(
      "rms_norm", "weight", weight.element_type(), fill, [](ffi::Error error) { return error; });
  if (filled.failure()) return ffi::Unexpected(std::move(filled));
  return Weights(std::move(out));
}

// Like jaxops::In, but nullptr for an empty buffer (an absent weight or dh).
template <typename X>
const X* In(const ffi::AnyBuffer& b) {
  return ElementCount(b) == 0 ? nullptr : static_cast<const X*>(b.untyped_data());
}

ffi::Future RmsNormFwdDispatch(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                               ffi::Buffer<ffi::F32> rstd_in, ffi::Result<ffi::AnyBuffer> y,
                               ffi::Result<ffi::Buffer<ffi::F32>> rstd, float eps,
                               bool zero_centered_weight) {
  auto shape = CheckForward(x, weight, rstd_in.element_count(), *y, rstd->element_count());
  if (shape.has_error()) return ReadyFuture(shape.error());
  auto w = EffectiveWeights(weight, zero_centered_weight);
  if (w.has_error()) return ReadyFuture(w.error());
  const float* given = shape->has_rstd_in ? rstd_in.typed_data() : nullptr;
  return DispatchFloat("rms_norm", "x", x.element_type(), [&](auto tag) {
    using X = typename decltype(tag)::type;
    return RmsNormFwdImpl(pool, *shape, In<X>(x), *w, given, Out<X>(y), rstd->typed_data(), eps);
  });
}

ffi::Future AddRmsNormFwdDispatch(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                                  ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> y,
                                  ffi::Result<ffi::AnyBuffer> h,
                                  ffi::Result<ffi::Buffer<ffi::F32>> rstd, float eps,
                                  bool zero_centered_weight) {
  auto shape = CheckAddForward(x, residual, weight, *y, *h, rstd->element_count());
  if (shape.has_error()) return ReadyFuture(shape.error());
  auto w = EffectiveWeights(weight, zero_centered_weight);
  if (w.has_error()) return ReadyFuture(w.error());
  return DispatchFloat("add_rms_norm", "x", x.element_type(), [&](auto tag) {
    using X = typename decltype(tag)::type;
    return AddRmsNormFwdImpl(pool, *shape, In<X>(x), In<X>(residual), *w, Out<X>(y), Out<X>(h),
                             rstd->typed_data(), eps);
  });
}

ffi::Future RmsNormBwdDispatch(ffi::ThreadPool pool, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                               ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> rstd,
                               ffi::Buffer<ffi::F32> dot_in, ffi::AnyBuffer dh,
                               ffi::Result<ffi::AnyBuffer> dx,
                               ffi::Result<ffi::Buffer<ffi::F32>> dw,
                               ffi::Result<ffi::AnyBuffer> dw_partial, bool zero_centered_weight) {
  auto shape = CheckBackward(dy, x, weight, rstd.element_count(), dot_in.element_count(), dh, *dx,
                             dw->element_count(), *dw_partial);
  if (shape.has_error()) return ReadyFuture(shape.error());
  auto w = EffectiveWeights(weight, zero_centered_weight);
  if (w.has_error()) return ReadyFuture(w.error());
  const float* dot = shape->has_dot_in ? dot_in.typed_data() : nullptr;
  float* dw_data = dw->typed_data();
  float* partial = static_cast<float*>(dw_partial->untyped_data());
  return DispatchFloat("rms_norm backward", "x", x.element_type(), [&](auto tag) {
    using X = typename decltype(tag)::type;
    return RmsNormBwdImpl(pool, *shape, In<X>(dy), In<X>(x), *w, rstd.typed_data(), dot, In<X>(dh),
                          Out<X>(dx), dw_data, partial);
  });
}

}  // namespace
}  // namespace jaxops::rms_norm

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormFwdCpu, jaxops::rms_norm::RmsNormFwdDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()             // pool
                                  .Arg<xla::ffi::AnyBuffer>()              // x [..., H]
                                  .Arg<xla::ffi::AnyBuffer>()              // weight [H] | [0]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd_in [R] | [0]
                                  .Ret<xla::ffi::AnyBuffer>()              // y [..., H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd [R]
                                  .Attr<float>("eps")                      // eps > 0
                                  .Attr<bool>("zero_centered_weight"));    // w_eff = 1 + w

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddRmsNormFwdCpu, jaxops::rms_norm::AddRmsNormFwdDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()             // pool
                                  .Arg<xla::ffi::AnyBuffer>()              // x [..., H]
                                  .Arg<xla::ffi::AnyBuffer>()              // residual [..., H]
                                  .Arg<xla::ffi::AnyBuffer>()              // weight [H] | [0]
                                  .Ret<xla::ffi::AnyBuffer>()              // y [..., H]
                                  .Ret<xla::ffi::AnyBuffer>()              // h = x + residual
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd [R]
                                  .Attr<float>("eps")                      // eps > 0
                                  .Attr<bool>("zero_centered_weight"));    // w_eff = 1 + w

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormBwdCpu, jaxops::rms_norm::RmsNormBwdDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()             // pool
                                  .Arg<xla::ffi::AnyBuffer>()              // dy [..., H]
                                  .Arg<xla::ffi::AnyBuffer>()              // x (or h) [..., H]
                                  .Arg<xla::ffi::AnyBuffer>()              // weight [H] | [0]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd [R]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // dot_in [R] | [0]
                                  .Arg<xla::ffi::AnyBuffer>()              // dh [..., H] | [0]
                                  .Ret<xla::ffi::AnyBuffer>()              // dx [..., H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // dw [H] | [0]
                                  .Ret<xla::ffi::AnyBuffer>()              // dw_partial [P, H]
                                  .Attr<bool>("zero_centered_weight"));    // w_eff = 1 + w
