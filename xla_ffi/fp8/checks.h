// Shape validation of the FP8 FFI handlers and their dtype switch (SwitchTypes), shared by the
// CPU and CUDA dispatch.
//
// The Python wrappers validate everything at trace time; these checks guard the kernels against
// anything that reaches them another way, so a bad call is an error, never an out-of-bounds access.
//
// jaxops_fp8_quantize: x (float32 | bfloat16 | float16, rank >= 1) is viewed as [batch, M, K]
// (K the last axis, M the one before it or 1, batch the product of the rest).
//   operands  x, scale_in [1] per-tensor | [0]   (the per-tensor scale, from jaxops_fp8_amax or
//                                                 a delayed-scaling history; amax is still
//                                                 measured and returned)
//   results   data     float8 (e4m3fn | e5m2), x's shape
//             scale    f32, ScaleGrid per mode:  per-tensor 1 element
//                                               rows  {batch, M,         ceil(K/G), col_tma}
//                                               tiles {batch, ceil(M/G), ceil(K/G), col_tma}
//             data_t   data's dtype, x's shape with the last two axes swapped | [0]
//             scale_t  f32: per-tensor [0];  rows  {batch, K,         ceil(M/G), col_tma}
//                                            tiles {batch, ceil(K/G), ceil(M/G), col_tma} | [0]
//             amax     f32 [1] per-tensor (finite amax of x) | [0]
//   attributes block_mode (BlockMode), group G in {32, 64, 128}, transpose, col_tma (not with
//              per-tensor), pow2_scale, amax_floor (> 0).
//
// jaxops_fp8_amax: x (float32 | bfloat16 | float16, any shape) -> amax f32 [] (the largest finite
// |x|, 0 for an empty tensor or one without finite values). Per-tensor current scaling runs it
// before jaxops_fp8_quantize (a second pass over x cannot be chained inside one CPU handler).
//
// jaxops_fp8_quantize_split_transpose: x [M, K] (float32 | bfloat16 | float16) holds the rows of
// E experts one after another; group_sizes int32 [E] (clamped on device: negative sizes count as
// 0, rows past M are ignored).
//   results   data_t        float8 [K, SplitColumns(M, E)]
//             scale_t       f32    [K, SplitScaleColumns(M, E, G)]
//             col_offsets   int32  [E + 1]   first column of expert e (multiples of 16)
//             scale_offsets int32  [E + 1]   first scale column of expert e
//   Expert e (rows start_e .. start_e + m_e of x) occupies columns [col_offsets[e],
//   col_offsets[e] + m_e) of data_t, quantized in 1 x G groups along those columns with scales in
//   columns [scale_offsets[e], scale_offsets[e] + ceil(m_e / G)); everything else is zero.
//   attributes group G, pow2_scale, amax_floor.
#ifndef JAXOPS_XLA_FFI_FP8_CHECKS_H_
#define JAXOPS_XLA_FFI_FP8_CHECKS_H_

#include <cstdint>
#include <limits>
#include <string>

#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/fp8/fp8.h"

namespace jaxops::fp8 {

struct QuantizeShape {
  int64_t batch = 0;
  int64_t m = 0;
  int64_t k = 0;
  int64_t group = 0;
  BlockMode mode = kPerTensor;
  bool transpose = false;
  ScaleGrid scale;    // per-tensor: unused
  ScaleGrid scale_t;  // per-tensor or no transpose: unused
};

struct SplitShape {
  int64_t m = 0;
  int64_t k = 0;
  int64_t experts = 0;
  int64_t group = 0;
  int64_t columns = 0;        // SplitColumns(m, experts)
  int64_t scale_columns = 0;  // SplitScaleColumns(m, experts, group)
};

inline bool IsFp8(ffi::DataType t) {
  return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2;
}

inline ffi::Error CheckCount(const char* op, const char* name, int64_t count, int64_t expected) {
  if (count == expected) return ffi::Error::Success();
  return InvalidArgument(std::string(op) + ": " + name + " must have " + std::to_string(expected) +
                         " elements, got " + std::to_string(count));
}

// amax_floor > 0 keeps every scale positive (and, from 1e-30 up, a normal float).
inline ffi::Error CheckAmaxFloor(const char* op, float amax_floor) {
  if (amax_floor > 0.0f) return ffi::Error::Success();
  return InvalidArgument(std::string(op) + ": amax_floor must be > 0");
}

inline ffi::Error CheckGroup(const char* op, int64_t group) {
  if (group == 32 || group == 64 || group == 128) return ffi::Error::Success();
  return InvalidArgument(std::string(op) + ": group must be 32, 64 or 128, got " +
                         std::to_string(group));
}

inline ffi::ErrorOr<QuantizeShape> CheckQuantize(
    const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& scale_in, const ffi::AnyBuffer& data,
    const ffi::Buffer<ffi::F32>& scale, const ffi::AnyBuffer& data_t,
    const ffi::Buffer<ffi::F32>& scale_t, const ffi::Buffer<ffi::F32>& amax, int32_t block_mode,
    int64_t group, bool transpose, bool col_tma, float amax_floor) {
  constexpr const char* kOp = "fp8 quantize";
  const auto scale_in_count = static_cast<int64_t>(scale_in.element_count());
  const auto scale_count = static_cast<int64_t>(scale.element_count());
  const auto scale_t_count = static_cast<int64_t>(scale_t.element_count());
  const auto amax_count = static_cast<int64_t>(amax.element_count());
  QuantizeShape s;
  auto dims = x.dimensions();
  const size_t rank = dims.size();
  if (rank == 0) return ffi::Unexpected(InvalidArgument("fp8 quantize: x must have rank >= 1"));
  if (block_mode != kPerTensor && block_mode != kRows && block_mode != kTiles) {
    return ffi::Unexpected(InvalidArgument("fp8 quantize: block_mode must be 0, 1 or 2, got " +
                                           std::to_string(block_mode)));
  }
  if (auto e = CheckGroup(kOp, group); e.failure()) return ffi::Unexpected(std::move(e));
  if (auto e = CheckAmaxFloor(kOp, amax_floor); e.failure()) return ffi::Unexpected(std::move(e));
  s.mode = static_cast<BlockMode>(block_mode);
  s.group = group;
  s.transpose = transpose;
  s.k = dims[rank - 1];
  s.m = rank >= 2 ? dims[rank - 2] : 1;
  s.batch = 1;
  for (size_t i = 0; i + 2 < rank; ++i) s.batch *= dims[i];
  if (s.mode == kPerTensor && col_tma) {
    return ffi::Unexpected(InvalidArgument("fp8 quantize: col_tma needs a block mode"));
  }
  if (transpose && rank < 2) {
    return ffi::Unexpected(InvalidArgument("fp8 quantize: transpose needs x of rank >= 2"));
  }
  if (!IsFp8(data.element_type()) || !SameShape(x, data)) {
    return ffi::Unexpected(
        InvalidArgument("fp8 quantize: data must be float8_e4m3fn or float8_e5m2 with x's shape"));
  }
  const int64_t mg = CeilDiv(s.m, group);
  const int64_t kg = CeilDiv(s.k, group);
  if (s.mode == kRows) {
    s.scale = ScaleGrid{s.batch, s.m, kg, col_tma};
    s.scale_t = ScaleGrid{s.batch, s.k, mg, col_tma};
  } else if (s.mode == kTiles) {
    s.scale = ScaleGrid{s.batch, mg, kg, col_tma};
    s.scale_t = ScaleGrid{s.batch, kg, mg, col_tma};
  }
  const bool per_tensor = s.mode == kPerTensor;
  if (auto e = CheckCount(kOp, "scale", scale_count, per_tensor ? 1 : s.scale.Count()); e.failure())
    return ffi::Unexpected(std::move(e));
  if (auto e = CheckCount(kOp, "amax", amax_count, per_tensor ? 1 : 0); e.failure())
    return ffi::Unexpected(std::move(e));
  if (auto e = CheckCount(kOp, "scale_in", scale_in_count, per_tensor ? 1 : 0); e.failure())
    return ffi::Unexpected(std::move(e));
  const int64_t expected_scale_t = transpose && !per_tensor ? s.scale_t.Count() : 0;
  if (auto e = CheckCount(kOp, "scale_t", scale_t_count, expected_scale_t); e.failure())
    return ffi::Unexpected(std::move(e));
  if (!transpose) {
    if (auto e = CheckCount(kOp, "data_t", ElementCount(data_t), 0); e.failure())
      return ffi::Unexpected(std::move(e));
    return s;
  }
  auto tdims = data_t.dimensions();
  bool ok = data_t.element_type() == data.element_type() && tdims.size() == rank;
  for (size_t i = 0; ok && i + 2 < rank; ++i) ok = tdims[i] == dims[i];
  ok = ok && tdims[rank - 2] == s.k && tdims[rank - 1] == s.m;
  if (!ok) {
    return ffi::Unexpected(InvalidArgument(
        "fp8 quantize: data_t must have data's dtype and x's shape with the last two axes "
        "swapped"));
  }
  return s;
}

inline ffi::Error CheckAmax(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& amax) {
  (void)x;
  return CheckCount("fp8 amax", "amax", static_cast<int64_t>(amax.element_count()), 1);
}

inline ffi::ErrorOr<SplitShape> CheckSplitTranspose(
    const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& group_sizes, const ffi::AnyBuffer& data_t,
    const ffi::Buffer<ffi::F32>& scale_t, const ffi::Buffer<ffi::S32>& col_offsets,
    const ffi::Buffer<ffi::S32>& scale_offsets, int64_t group, float amax_floor) {
  constexpr const char* kOp = "fp8 quantize_split_transpose";
  const auto experts = static_cast<int64_t>(group_sizes.element_count());
  const auto scale_t_count = static_cast<int64_t>(scale_t.element_count());
  const auto col_offsets_count = static_cast<int64_t>(col_offsets.element_count());
  const auto scale_offsets_count = static_cast<int64_t>(scale_offsets.element_count());
  auto dims = x.dimensions();
  if (dims.size() != 2) {
    return ffi::Unexpected(
        InvalidArgument("fp8 quantize_split_transpose: x must have rank 2, got rank " +
                        std::to_string(dims.size())));
  }
  if (auto e = CheckGroup(kOp, group); e.failure()) return ffi::Unexpected(std::move(e));
  if (auto e = CheckAmaxFloor(kOp, amax_floor); e.failure()) return ffi::Unexpected(std::move(e));
  SplitShape s;
  s.m = dims[0];
  s.k = dims[1];
  s.experts = experts;
  s.group = group;
  s.columns = SplitColumns(s.m, experts);
  s.scale_columns = SplitScaleColumns(s.m, experts, group);
  if (s.columns > std::numeric_limits<int32_t>::max()) {
    return ffi::Unexpected(InvalidArgument(
        "fp8 quantize_split_transpose: the packed buffer needs more than 2^31 - 1 columns"));
  }
  auto tdims = data_t.dimensions();
  if (!IsFp8(data_t.element_type()) || tdims.size() != 2 || tdims[0] != s.k ||
      tdims[1] != s.columns) {
    return ffi::Unexpected(
        InvalidArgument("fp8 quantize_split_transpose: data_t must be float8 of shape (" +
                        std::to_string(s.k) + ", " + std::to_string(s.columns) + ")"));
  }
  if (auto e = CheckCount(kOp, "scale_t", scale_t_count, s.k * s.scale_columns); e.failure())
    return ffi::Unexpected(std::move(e));
  if (auto e = CheckCount(kOp, "col_offsets", col_offsets_count, experts + 1); e.failure())
    return ffi::Unexpected(std::move(e));
  if (auto e = CheckCount(kOp, "scale_offsets", scale_offsets_count, experts + 1); e.failure())
    return ffi::Unexpected(std::move(e));
  return s;
}

// The one place where the dtypes of x and of the fp8 output become template arguments, for the
// CPU and the CUDA dispatch alike (each names its storage types of x, as in SwitchFloat): returns
// fn(TypeTag<X>{}, TypeTag<F>{}) with X the storage type of x's float32 / bfloat16 / float16 and
// F = E4M3 for float8_e4m3fn, E5M2 for float8_e5m2; any other dtype gives fail(error).
template <typename F32, typename BF16, typename F16, typename Fn, typename Fail>
auto SwitchTypes(const char* op, ffi::DataType x_dtype, ffi::DataType fp8_dtype, Fn&& fn,
                 Fail&& fail) {
  return SwitchFloat<F32, BF16, F16>(
      op, "x", x_dtype,
      [&](auto x_tag) {
        switch (fp8_dtype) {
          case ffi::DataType::F8E4M3FN:
            return fn(x_tag, TypeTag<E4M3>{});
          case ffi::DataType::F8E5M2:
            return fn(x_tag, TypeTag<E5M2>{});
          default:
            return fail(InvalidArgument(
                std::string(op) + ": output dtype must be float8_e4m3fn or float8_e5m2, got " +
                DataTypeName(fp8_dtype)));
        }
      },
      fail);
}

}  // namespace jaxops::fp8

#endif  // JAXOPS_XLA_FFI_FP8_CHECKS_H_
