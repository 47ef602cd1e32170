// Packing of the grouped GEMM's CPU operands (cpu.cc, their only user) into the fp32 panels
// the micro-kernels of cpu_micro.h read: A panels of kMr rows ([kc][kMr]) from rows or, for a
// transposed operand, columns of a row-major matrix; B panels of kNr columns ([kc][kNr], or two
// [kc][16] halves for AVX2) from a row-major or a transposed B. float32 and bfloat16 rows whose
// panel is their transpose go through register transposes (16 x 16 on AVX-512, 8 x 8 on AVX2).
#ifndef JAXOPS_XLA_FFI_GROUPED_GEMM_CPU_PACK_H_
#define JAXOPS_XLA_FFI_GROUPED_GEMM_CPU_PACK_H_

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "xla_ffi/common/cpu_convert.h"
#include "xla_ffi/common/host_float.h"
#include "xla_ffi/grouped_gemm/cpu_micro.h"
#include "xla_ffi/grouped_gemm/grouped_gemm.h"

namespace jaxops::grouped_gemm::cpu {

// Every panel is zero-padded to whole register tiles.

#if defined(JAXOPS_GROUPED_GEMM_SIMD)
// 16 values of a row as fp32: float32 as it is, bfloat16 widened (cpu_convert.h).
__attribute__((target("avx512f"))) inline __m512 Load16(const float* src) {
  return _mm512_loadu_ps(src);
}
__attribute__((target("avx512f"))) inline __m512 Load16(const BFloat16* src) {
  return convert_internal::WidenBf16x16(src);
}

// r[i] lane j -> r[j] lane i: a 16 x 16 fp32 transpose in registers (pairs of rows interleaved,
// then pairs of pairs, then the 128-bit lanes of four rows at a time). The unpacks take their
// zero-masking forms with a full mask (the same instructions; GCC 12's unmasked ones warn about
// an uninitialized placeholder).
__attribute__((target("avx512f"))) inline void Transpose16(__m512 r[16]) {
  const __mmask16 all16 = 0xffff;
  const __mmask8 all8 = 0xff;
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_maskz_unpacklo_ps(all16, r[i], r[i + 1]);
    t[i + 1] = _mm512_maskz_unpackhi_ps(all16, r[i], r[i + 1]);
  }
  // u[4g + c], lane L: rows [4g, 4g + 4) of column 4L + c.
  __m512 u[16];
  for (int g = 0; g < 4; ++g) {
    const __m512d lo01 = _mm512_castps_pd(t[4 * g]);
    const __m512d lo23 = _mm512_castps_pd(t[4 * g + 2]);
    const __m512d hi01 = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d hi23 = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(all8, lo01, lo23));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(all8, lo01, lo23));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(all8, hi01, hi23));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(all8, hi01, hi23));
  }
  // Column 4L + c takes lane L of u[c], u[4 + c], u[8 + c], u[12 + c].
  for (int c = 0; c < 4; ++c) {
    const __m512 v0 = _mm512_maskz_shuffle_f32x4(all16, u[c], u[4 + c], 0x44);
    const __m512 v1 = _mm512_maskz_shuffle_f32x4(all16, u[c], u[4 + c], 0xEE);
    const __m512 v2 = _mm512_maskz_shuffle_f32x4(all16, u[8 + c], u[12 + c], 0x44);
    const __m512 v3 = _mm512_maskz_shuffle_f32x4(all16, u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_maskz_shuffle_f32x4(all16, v0, v2, 0x88);
    r[4 + c] = _mm512_maskz_shuffle_f32x4(all16, v0, v2, 0xDD);
    r[8 + c] = _mm512_maskz_shuffle_f32x4(all16, v1, v3, 0x88);
    r[12 + c] = _mm512_maskz_shuffle_f32x4(all16, v1, v3, 0xDD);
  }
}

// dst[k * dst_ld + i] = src(i, k0 + k) for k < kc16 (a multiple of 16) and i < 16, where
// src(i, k) = rows[i][k] for i < n and 0 for i >= n: 16 x 16 blocks transposed in registers
// and stored `lanes` at a time (lanes of 12 for a 12-row panel, whose rows are 12 floats apart).
template <typename X>
__attribute__((target("avx512f"))) void TransposeRows16(const X* const* rows, int64_t n, int64_t k0,
                                                        int64_t kc16, float* dst, int64_t dst_ld,
                                                        __mmask16 lanes) {
  for (int64_t k = 0; k < kc16; k += 16) {
    __m512 r[16];
    for (int64_t i = 0; i < 16; ++i) r[i] = i < n ? Load16(rows[i] + k0 + k) : _mm512_setzero_ps();
    Transpose16(r);
    for (int64_t c = 0; c < 16; ++c) _mm512_mask_storeu_ps(dst + (k + c) * dst_ld, lanes, r[c]);
  }
}

// 8 values of a row as fp32 (AVX2): float32 as it is, bfloat16 widened (its bits are fp32's
// top half).
__attribute__((target("avx2"))) inline __m256 Load8(const float* src) {
  return _mm256_loadu_ps(src);
}
__attribute__((target("avx2"))) inline __m256 Load8(const BFloat16* src) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// r[i] lane j -> r[j] lane i: an 8 x 8 fp32 transpose in registers (pairs of rows interleaved,
// then pairs of pairs, then the 128-bit halves of rows 0-3 and 4-7 joined).
__attribute__((target("avx2"))) inline void Transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  // u[4g + c]: rows [4g, 4g + 4) of column c (low half) and of column c + 4 (high half).
  __m256 u[8];
  for (int g = 0; g < 2; ++g) {
    u[4 * g] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

// dst[k * dst_ld + i] = src(i, k0 + k) for k < kc8 (a multiple of 8) and i < 8, where
// src(i, k) = rows[i][k] for i < n and 0 for i >= n: 8 x 8 blocks transposed in registers, each
// column stored as 8 floats. With dst_ld < 8 (a 6-row A panel) a store also writes the first
// 8 - dst_ld floats of the next column, which the next store (or the caller) overwrites; the
// last one writes up to 2 floats past the block (Scratch keeps that slack).
template <typename X>
__attribute__((target("avx2"))) void TransposeRows8(const X* const* rows, int64_t n, int64_t k0,
                                                    int64_t kc8, float* dst, int64_t dst_ld) {
  for (int64_t k = 0; k < kc8; k += 8) {
    __m256 r[8];
    for (int64_t i = 0; i < 8; ++i) r[i] = i < n ? Load8(rows[i] + k0 + k) : _mm256_setzero_ps();
    Transpose8(r);
    for (int64_t c = 0; c < 8; ++c) _mm256_storeu_ps(dst + (k + c) * dst_ld, r[c]);
  }
}

// The types the AVX-512 and AVX2 packers read (others take the portable loops).
template <typename X>
inline constexpr bool kPackSimd = std::is_same_v<X, float> || std::is_same_v<X, BFloat16>;
#endif

// A panels from `rows` rows of a row-major matrix (leading dimension ld), columns [k0, k0 + kc):
// panel p holds rows [p kMr, (p + 1) kMr) as [kc][kMr]. With the AVX-512 micro-kernel (12-row
// panels) the columns are transposed 16 at a time in registers, with the AVX2 one (6-row panels)
// 8 at a time; the portable loop takes the rest. Panels are packed in order (the AVX2 path's
// stores reach 2 floats into the next panel, which its own packing overwrites).
template <int64_t kMr, typename X>
JAXOPS_CPU_CLONES void PackRows(const X* src, int64_t ld, int64_t rows, int64_t k0, int64_t kc,
                                float* dst) {
  for (int64_t p = 0; p * kMr < rows; ++p) {
    float* panel = dst + p * kc * kMr;
    const int64_t mr = std::min(kMr, rows - p * kMr);
    int64_t done = 0;
#if defined(JAXOPS_GROUPED_GEMM_SIMD)
    if constexpr (kMr == kMrAvx512 && kPackSimd<X>) {
      if (ChosenKernel() == Kernel::kAvx512) {
        const X* starts[16];
        for (int64_t i = 0; i < 16; ++i) starts[i] = i < mr ? src + (p * kMr + i) * ld : src;
        done = kc / 16 * 16;
        TransposeRows16(starts, mr, k0, done, panel, kMr, __mmask16((1u << kMr) - 1u));
      }
    }
    if constexpr (kMr == kMrAvx2 && kPackSimd<X>) {
      if (ChosenKernel() == Kernel::kAvx2) {
        const X* starts[8];
        for (int64_t i = 0; i < 8; ++i) starts[i] = i < mr ? src + (p * kMr + i) * ld : src;
        done = kc / 8 * 8;
        TransposeRows8(starts, mr, k0, done, panel, kMr);
      }
    }
#endif
    for (int64_t i = 0; i < kMr; ++i) {
      if (i >= mr) {
        for (int64_t k = done; k < kc; ++k) panel[k * kMr + i] = 0.0f;
        continue;
      }
      const X* row = src + (p * kMr + i) * ld + k0;
      for (int64_t k = done; k < kc; ++k) panel[k * kMr + i] = HostType<X>::Load(row[k]);
    }
  }
}

// A panels of the transpose: A(i, k) = src[(k0 + k) ld + c0 + i] for i < cols (columns of a
// row-major matrix become the panel's rows; each of its rows is read contiguously).
template <int64_t kMr, typename X>
JAXOPS_CPU_CLONES void PackColumns(const X* src, int64_t ld, int64_t c0, int64_t cols, int64_t k0,
                                   int64_t kc, float* dst) {
  for (int64_t p = 0; p * kMr < cols; ++p) {
    float* panel = dst + p * kc * kMr;
    const int64_t mr = std::min(kMr, cols - p * kMr);
    for (int64_t k = 0; k < kc; ++k) {
      const X* row = src + (k0 + k) * ld + c0 + p * kMr;
      float* out = panel + k * kMr;
      for (int64_t i = 0; i < mr; ++i) out[i] = HostType<X>::Load(row[i]);
      for (int64_t i = mr; i < kMr; ++i) out[i] = 0.0f;
    }
  }
}

// Where a packed B panel of kPw-column slices (kPw = kNr: [kc][kNr]; kPw = 16: [2][kc][16])
// keeps element (k, j).
template <int64_t kPw>
constexpr int64_t PanelIndex(int64_t kc, int64_t k, int64_t j) {
  return (j / kPw) * kc * kPw + k * kPw + j % kPw;
}

// The BBlock of a packed panel.
template <int64_t kPw>
inline BBlock PanelBlock(const float* panel, int64_t kc) {
  return {panel, kPw, kPw == 16 ? 16 * kc : 16};
}

// A B panel: B(k, j) = src[(k0 + k) ld + n0 + j] (row-major B), j < nr; zeros in columns
// [nr, kNr).
template <int64_t kPw, typename X>
JAXOPS_CPU_CLONES void PackB(const X* src, int64_t ld, int64_t k0, int64_t kc, int64_t n0,
                             int64_t nr, float* dst) {
  static_assert(kNr % kPw == 0, "kPw: whole slices of the panel");
  // Row by row (its kNr columns are 1-2 adjacent cache lines), the row kPrefetchRows ahead
  // prefetched: the rows are ld apart, and the loads of a weight's rows from memory stalled
  // this loop without it.
  constexpr int64_t kPrefetchRows = 8;
  for (int64_t k = 0; k < kc; ++k) {
    const X* row = src + (k0 + k) * ld + n0;
    if (k + kPrefetchRows < kc) {
      const char* ahead = reinterpret_cast<const char*>(row + kPrefetchRows * ld);
      __builtin_prefetch(ahead);
      if constexpr (sizeof(X) * kNr > 64) __builtin_prefetch(ahead + 64);
    }
    for (int64_t j0 = 0; j0 < kNr; j0 += kPw) {
      const int64_t n = std::clamp<int64_t>(nr - j0, 0, kPw);
      float* out = dst + PanelIndex<kPw>(kc, k, j0);
      for (int64_t j = 0; j < n; ++j) out[j] = HostType<X>::Load(row[j0 + j]);
      for (int64_t j = n; j < kPw; ++j) out[j] = 0.0f;
    }
  }
}

// A B panel of a transposed B: B(k, j) = src[(n0 + j) ld + k0 + k], j < nr. With the AVX-512
// micro-kernel, 16 x 16 blocks are transposed in registers, with the AVX2 one 8 x 8 blocks; the
// portable loop takes the rest.
template <int64_t kPw, typename X>
JAXOPS_CPU_CLONES void PackBTransposed(const X* src, int64_t ld, int64_t k0, int64_t kc, int64_t n0,
                                       int64_t nr, float* dst) {
  int64_t done = 0;
#if defined(JAXOPS_GROUPED_GEMM_SIMD)
  if constexpr (kPw == kNr && kPackSimd<X>) {
    if (ChosenKernel() == Kernel::kAvx512) {
      done = kc / 16 * 16;
      for (int64_t j0 = 0; j0 < kNr; j0 += 16) {
        const int64_t n = std::clamp<int64_t>(nr - j0, 0, 16);
        const X* starts[16];
        for (int64_t i = 0; i < 16; ++i) starts[i] = i < n ? src + (n0 + j0 + i) * ld : src;
        TransposeRows16(starts, n, k0, done, dst + j0, kNr, __mmask16(0xFFFF));
      }
    }
  }
  if constexpr (kPw == 16 && kPackSimd<X>) {
    if (ChosenKernel() == Kernel::kAvx2) {
      done = kc / 8 * 8;
      for (int64_t j0 = 0; j0 < kNr; j0 += 8) {
        const int64_t n = std::clamp<int64_t>(nr - j0, 0, 8);
        const X* starts[8];
        for (int64_t i = 0; i < 8; ++i) starts[i] = i < n ? src + (n0 + j0 + i) * ld : src;
        TransposeRows8(starts, n, k0, done, dst + PanelIndex<kPw>(kc, 0, j0), kPw);
      }
    }
  }
#endif
  for (int64_t j = 0; j < kNr; ++j) {
    float* out = dst + PanelIndex<kPw>(kc, 0, j);
    if (j >= nr) {
      for (int64_t k = done; k < kc; ++k) out[k * kPw] = 0.0f;
      continue;
    }
    const X* col = src + (n0 + j) * ld + k0;
    for (int64_t k = done; k < kc; ++k) out[k * kPw] = HostType<X>::Load(col[k]);
  }
}

}  // namespace jaxops::grouped_gemm::cpu

#endif  // JAXOPS_XLA_FFI_GROUPED_GEMM_CPU_PACK_H_
