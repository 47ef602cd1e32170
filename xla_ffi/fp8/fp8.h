// FP8 quantization math shared by the CPU (g++) and CUDA (nvcc) kernels.
//
// The algorithm, for one block of values (a 1 x G group, a G x G tile or the whole tensor):
//
//   amax  = max |x| over the block's finite values (NaN and +-Inf do not count)
//   scale = max(amax, amax_floor) / max_finite(format)           fp32, round to nearest even
//           (pow2_scale: rounded up to the next power of two, so it is a UE8M0 exponent)
//   q     = fp8(x / scale)                                        fp32 division, then fp8 with
//           round to nearest even; beyond +-max_finite (incl. +-Inf) saturates to +-max_finite;
//           NaN stays NaN (sign kept)
//
// so that x ~= q * scale. The conversion is bit-for-bit ml_dtypes' float32 -> float8 conversion
// of clip(x / scale, -max_finite, max_finite). Everything below is integer and select operations
// plus one fp32 division and one fp32 addition (both correctly rounded on host and device), so
// CPU and GPU produce identical bits and GCC vectorizes the loops that use them.
#ifndef JAXOPS_XLA_FFI_FP8_FP8_H_
#define JAXOPS_XLA_FFI_FP8_FP8_H_

#include <cstdint>
#include <cstring>

#include "xla_ffi/common/math.h"

namespace jaxops::fp8 {

// Block modes of the quantize handler (the "block_mode" attribute).
enum BlockMode : int32_t {
  kPerTensor = 0,  // one scale for the whole tensor
  kRows = 1,       // 1 x G groups along the last axis
  kTiles = 2,      // G x G tiles over the last two axes
};

// The default lower bound of amax: a block of zeros gets scale 1e-4 / max_finite and quantizes
// to exact zeros (DeepGEMM uses the same value).
inline constexpr float kDefaultAmaxFloor = 1e-4f;

// Format traits: exponent bias, explicit mantissa bits, largest finite code and value, NaN code.
struct E4M3 {
  static constexpr uint32_t kBias = 7;
  static constexpr uint32_t kMantissa = 3;
  static constexpr uint32_t kMaxCode = 0x7e;  // 448
  static constexpr uint32_t kNanCode = 0x7f;
  static constexpr float kMaxFinite = 448.0f;
};

struct E5M2 {
  static constexpr uint32_t kBias = 15;
  static constexpr uint32_t kMantissa = 2;
  static constexpr uint32_t kMaxCode = 0x7b;  // 57344
  static constexpr uint32_t kNanCode = 0x7e;
  static constexpr float kMaxFinite = 57344.0f;
};

JAXOPS_HOST_DEVICE uint32_t Bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

JAXOPS_HOST_DEVICE float FromBits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// |v| as fp32 bits, or 0 for NaN and +-Inf. Bit patterns of non-negative floats order like the
// floats, so amax is an unsigned max over these (0 for a block without finite values).
JAXOPS_HOST_DEVICE uint32_t FiniteAbsBits(float v) {
  const uint32_t a = Bits(v) & 0x7fffffffu;
  return a & (0u - static_cast<uint32_t>(a < 0x7f800000u));  // a mask, not a select: vectorizes
}

JAXOPS_HOST_DEVICE uint32_t MaxBits(uint32_t a, uint32_t b) { return a > b ? a : b; }

// Correctly rounded fp32 a / b and a + b (no contraction or approximation on the device).
JAXOPS_HOST_DEVICE float DivRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

JAXOPS_HOST_DEVICE float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// The dequantization multiplier of a block whose finite amax is `amax` (>= 0, finite).
// amax_floor > 0 keeps the scale a normal fp32 number (the Python API requires >= 1e-30).
template <typename F>
JAXOPS_HOST_DEVICE float ScaleFromAmax(float amax, float amax_floor, bool pow2_scale) {
  const float clamped = amax > amax_floor ? amax : amax_floor;
  const float scale = DivRn(clamped, F::kMaxFinite);
  if (!pow2_scale) return scale;
  // Round up to a power of two: a non-zero mantissa bumps the exponent and clears the mantissa.
  const uint32_t u = Bits(scale);
  return FromBits((u & 0x007fffffu) != 0 ? (u & 0xff800000u) + 0x00800000u : u);
}

// fp32 -> fp8 bits: round to nearest even, saturating to +-max finite, NaN -> NaN (sign kept).
template <typename F>
JAXOPS_HOST_DEVICE uint8_t EncodeFp8(float f) {
  constexpr uint32_t kDropped = 23 - F::kMantissa;         // fp32 mantissa bits dropped
  constexpr uint32_t kRebias = (127 - F::kBias) << 23;     // fp32 -> fp8 exponent offset
  constexpr uint32_t kMinNormal = (128 - F::kBias) << 23;  // fp32 bits of 2^(1 - bias)
  constexpr uint32_t kMagic = (127 + 24 - F::kBias - F::kMantissa)
                              << 23;  // ulp = fp8 subnormal step
  const uint32_t u = Bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal range: rebias, then round to nearest even on the dropped bits.
  const uint32_t odd = (a >> kDropped) & 1u;
  const uint32_t normal = (a - kRebias + ((1u << (kDropped - 1)) - 1u) + odd) >> kDropped;
  // Below the smallest normal: the fp32 adder rounds a + magic onto the subnormal grid.
  const uint32_t subnormal = Bits(AddRn(FromBits(a), FromBits(kMagic))) - kMagic;
  uint32_t code = a < kMinNormal ? subnormal : normal;
  code = code < F::kMaxCode ? code : F::kMaxCode;  // saturate, +-Inf included
  code = a > 0x7f800000u ? F::kNanCode : code;
  return static_cast<uint8_t>(code | sign);
}

// fp8 bits of x / scale.
template <typename F>
JAXOPS_HOST_DEVICE uint8_t Quantize(float x, float scale) {
  return EncodeFp8<F>(DivRn(x, scale));
}

// Size helpers shared by the handlers' shape checks and the kernels.
JAXOPS_HOST_DEVICE int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// Scales are padded to a multiple of 4 floats (16 bytes) along the TMA-contiguous axis.
inline constexpr int64_t kTmaAlignFloats = 4;

// Where the scale of block (b, r, c) of a [batch, rows, cols] grid of blocks is stored.
//   row layout ("row"):          scale[b, r, c]                   batch * rows * cols floats
//   column layout ("col_tma"):   scale[b, c, r], rows padded to a multiple of 4 (the padding
//                                holds zeros)                     batch * cols * round_up(rows, 4)
// The kernel that writes block (b, rows - 1, c) also writes the padding after it.
struct ScaleGrid {
  int64_t batch = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  bool col_tma = false;

  JAXOPS_HOST_DEVICE int64_t PaddedRows() const {
    return col_tma ? RoundUp(rows, kTmaAlignFloats) : rows;
  }
  JAXOPS_HOST_DEVICE int64_t Count() const { return batch * PaddedRows() * cols; }
  JAXOPS_HOST_DEVICE int64_t Index(int64_t b, int64_t r, int64_t c) const {
    return col_tma ? (b * cols + c) * PaddedRows() + r : (b * rows + r) * cols + c;
  }
  // Entries after (b, rows - 1, c) that are padding: PaddedRows() - rows of them, contiguous.
  JAXOPS_HOST_DEVICE int64_t PaddingAfterLastRow() const { return PaddedRows() - rows; }
};

// quantize_split_transpose: each expert's columns start at a multiple of 16 (16-byte aligned
// fp8 rows), so the packed buffer has at most round_up(M + 15 E, 16) columns and at most
// floor(M / G) + E scale columns.
inline constexpr int64_t kSplitColumnAlign = 16;

JAXOPS_HOST_DEVICE int64_t SplitColumns(int64_t m, int64_t experts) {
  return RoundUp(m + (kSplitColumnAlign - 1) * experts, kSplitColumnAlign);
}

JAXOPS_HOST_DEVICE int64_t SplitScaleColumns(int64_t m, int64_t experts, int64_t group) {
  return m / group + experts;
}

}  // namespace jaxops::fp8

#endif  // JAXOPS_XLA_FFI_FP8_FP8_H_
