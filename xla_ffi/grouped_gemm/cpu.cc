// Grouped GEMM CPU kernels: the expert FFNs' GEMMs, one custom call per grouped GEMM.
//
//   * GroupedGemm: y[rows of g] = x[rows of g] @ w[g] (w[g]^T with transpose_w), fp32 y; rows
//     past the groups are zero, or with zero_tail false left unwritten (for a caller that reads
//     the groups' rows only).
//   * GroupedGemmWgrad: dw[g] = x[rows of g]^T @ dy[rows of g], fp32; a group without rows
//     gets zeros.
//
// Blocked the way BLIS blocks a GEMM: a task owns up to kMb rows of one group's output (fewer
// when that leaves a core without work: TaskRows); per
// block of kKc along the contraction it packs its rows of A into panels of kMr rows and, per
// kNr = 32 output columns, a panel of B, both as fp32 (so every dtype and every layout, x^T for
// the weight gradient and w^T for the input gradient included, reaches one micro-kernel), and
// the micro-kernel keeps a kMr x 32 tile of fp32 sums in registers over the block. With the
// AVX-512 micro-kernel, float32 and bfloat16 operands whose panels are their transpose (A's rows,
// w^T of the input gradient) are packed by 16 x 16 transposes in registers (the portable loops
// stored one float at a time, 128 bytes apart: 6% of the 8-simulated-device decoder step's CPU
// time; bench_grouped_gemm's fwd + bwd went from 128-137 to 142-162 GFLOP/s). A float32 B
// in row-major order (w of the forward, dy of the weight gradient) is read in place instead of
// packed, 32 columns at a time: a copy of every weight per call and task otherwise (8-9% of the
// 8-simulated-device decoder's loss and gradients, 2-3% of the one-device one), unless its row
// stride is a multiple of 4 KiB (BlockB). The AVX2 kernel (6 x 16 tiles) differs, as BLIS
// blocks for Haswell: it packs every B panel, as two 16-column halves, and runs each half over
// all the A panels (MacroAvx2), so that the half stays in L1; its transposed panels are packed
// by 8 x 8 transposes in registers, and its full tiles written back without masked stores
// (2026-11-30, 2 Zen cores, one core: the expert FFN's grouped GEMMs at about 52 GFLOP/s
// against 40 with the first two undone; the 8-simulated-device decoder step 1.11x as fast with
// them, ab_models). Tasks run
// on the FFI thread pool, taken from a shared counter, so the groups' GEMMs spread over the cores
// with no loop of small XLA ops around them. fp32 accumulation throughout; the blocks of the
// contraction are added in order.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define JAXOPS_GROUPED_GEMM_SIMD 1
#endif

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/cpu_convert.h"
#include "xla_ffi/common/cpu_dispatch.h"
#include "xla_ffi/common/cpu_parallel.h"
#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/common/host_float.h"
#include "xla_ffi/grouped_gemm/checks.h"
#include "xla_ffi/grouped_gemm/grouped_gemm.h"
#include "xla_ffi/grouped_gemm/handlers.h"

namespace jaxops::grouped_gemm {
namespace {

// Rows of the micro-kernels' register tiles: AVX-512 holds 12 x 32 fp32 sums in 24 of its 32
// registers; AVX2 6 x 16 in 12 of its 16 (the panel's 32 columns in two passes); the portable
// kernel (the baseline, as the compiler vectorizes it) 4 x 32.
constexpr int64_t kMrAvx512 = 12;
constexpr int64_t kMrAvx2 = 6;
constexpr int64_t kMrPortable = 4;
static_assert(kMb % kMrAvx512 == 0 && kMb % kMrAvx2 == 0 && kMb % kMrPortable == 0,
              "kMb: whole register tiles");

// The micro-kernels, narrowest first.
enum class Kernel { kPortable, kAvx2, kAvx512 };

// ---------------------------------------------------------------------------------------------
// Micro-kernels: c[mr, nr] (+)= A (kc x kMr, packed [kc][kMr]) times B (kc x kNr: row k at
// bp + k ldb, a packed panel's ldb being kNr); c has leading dimension ldc. accumulate: add to c
// (a later block of the contraction); else overwrite it.

template <int64_t kMr>
JAXOPS_CPU_CLONES void MicroPortable(int64_t kc, const float* ap, const float* bp, int64_t ldb,
                                     float* c, int64_t ldc, int64_t mr, int64_t nr,
                                     bool accumulate) {
  float acc[kMr][kNr] = {};
  for (int64_t k = 0; k < kc; ++k) {
    for (int64_t i = 0; i < kMr; ++i) {
      const float a = ap[k * kMr + i];
      for (int64_t j = 0; j < kNr; ++j) acc[i][j] += a * bp[k * ldb + j];
    }
  }
  for (int64_t i = 0; i < mr; ++i) {
    float* row = c + i * ldc;
    for (int64_t j = 0; j < nr; ++j) row[j] = (accumulate ? row[j] : 0.0f) + acc[i][j];
  }
}

#if defined(JAXOPS_GROUPED_GEMM_SIMD)
__attribute__((target("avx512f,fma"))) void MicroAvx512(int64_t kc, const float* ap,
                                                        const float* bp, int64_t ldb, float* c,
                                                        int64_t ldc, int64_t mr, int64_t nr,
                                                        bool accumulate) {
  // Every loop over the tile's rows is unrolled, so that each index is a constant and the sums
  // live in registers only. (A runtime index in the write-back kept them in a stack array that
  // every call cleared with a `rep stos` and stored on the way out: 3.1% of the CPU time of the
  // 8-simulated-device decoder step, a tenth of this kernel's.)
  __m512 lo[kMrAvx512];
  __m512 hi[kMrAvx512];
#pragma GCC unroll 12
  for (int64_t i = 0; i < kMrAvx512; ++i) {
    lo[i] = _mm512_setzero_ps();
    hi[i] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_loadu_ps(bp + k * ldb);
    const __m512 b1 = _mm512_loadu_ps(bp + k * ldb + 16);
    const float* a = ap + k * kMrAvx512;
#pragma GCC unroll 12
    for (int64_t i = 0; i < kMrAvx512; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i]);
      lo[i] = _mm512_fmadd_ps(ai, b0, lo[i]);
      hi[i] = _mm512_fmadd_ps(ai, b1, hi[i]);
    }
  }
  // Columns past nr are masked off (a masked load or store touches no memory there).
  const __mmask16 mask_lo = nr >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nr) - 1u);
  const __mmask16 mask_hi = nr >= 32  ? __mmask16(0xFFFF)
                            : nr > 16 ? __mmask16((1u << (nr - 16)) - 1u)
                                      : __mmask16(0);
#pragma GCC unroll 12
  for (int64_t i = 0; i < kMrAvx512; ++i) {
    if (i >= mr) break;
    float* row = c + i * ldc;
    __m512 v0 = lo[i];
    __m512 v1 = hi[i];
    if (accumulate) {
      v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(mask_lo, row));
      v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(mask_hi, row + 16));
    }
    _mm512_mask_storeu_ps(row, mask_lo, v0);
    _mm512_mask_storeu_ps(row + 16, mask_hi, v1);
  }
}

// Lanes [0, n) of an 8-lane mask (n clamped to [0, 8]): AVX2's masked loads and stores touch no
// memory in the other lanes.
__attribute__((target("avx2"))) inline __m256i LaneMask(int64_t n) {
  const int32_t count = static_cast<int32_t>(std::clamp<int64_t>(n, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// AVX2 has 16 registers: a 6 x 16 tile of sums (12), two of B and a broadcast of A.
// Columns [0, nr) of c (nr <= 16; B read from bp, 16 columns). Written so that the sums stay
// in registers (set1 of a loaded float, in a function of its own): as one loop over both
// halves, with a broadcast from the pointer, GCC stored all twelve to the stack every step.
__attribute__((target("avx2,fma"), noinline)) void MicroAvx2Half(int64_t kc, const float* ap,
                                                                 const float* bp, int64_t ldb,
                                                                 float* c, int64_t ldc, int64_t mr,
                                                                 int64_t nr, bool accumulate) {
  // Every loop over the rows unrolled, as in MicroAvx512: the sums never leave the registers.
  __m256 lo[kMrAvx2];
  __m256 hi[kMrAvx2];
#pragma GCC unroll 6
  for (int64_t i = 0; i < kMrAvx2; ++i) {
    lo[i] = _mm256_setzero_ps();
    hi[i] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(bp + k * ldb);
    const __m256 b1 = _mm256_loadu_ps(bp + k * ldb + 8);
    const float* a = ap + k * kMrAvx2;
#pragma GCC unroll 6
    for (int64_t i = 0; i < kMrAvx2; ++i) {
      const __m256 ai = _mm256_set1_ps(a[i]);
      lo[i] = _mm256_fmadd_ps(ai, b0, lo[i]);
      hi[i] = _mm256_fmadd_ps(ai, b1, hi[i]);
    }
  }
  if (nr == 16) {
    // Whole rows with plain loads and stores: AVX2's masked stores are microcoded on AMD's Zen
    // cores. (With masked stores on every tile, 2026-11-30 on 2 Zen cores, the expert FFN's
    // grouped GEMMs ran about 1.15x the time of this kernel with its other changes of that day.)
#pragma GCC unroll 6
    for (int64_t i = 0; i < kMrAvx2; ++i) {
      if (i >= mr) break;
      float* row = c + i * ldc;
      __m256 v0 = lo[i];
      __m256 v1 = hi[i];
      if (accumulate) {
        v0 = _mm256_add_ps(v0, _mm256_loadu_ps(row));
        v1 = _mm256_add_ps(v1, _mm256_loadu_ps(row + 8));
      }
      _mm256_storeu_ps(row, v0);
      _mm256_storeu_ps(row + 8, v1);
    }
    return;
  }
  const __m256i mask_lo = LaneMask(nr);
  const __m256i mask_hi = LaneMask(nr - 8);
#pragma GCC unroll 6
  for (int64_t i = 0; i < kMrAvx2; ++i) {
    if (i >= mr) break;
    float* row = c + i * ldc;
    __m256 v0 = lo[i];
    __m256 v1 = hi[i];
    if (accumulate) {
      v0 = _mm256_add_ps(v0, _mm256_maskload_ps(row, mask_lo));
      v1 = _mm256_add_ps(v1, _mm256_maskload_ps(row + 8, mask_hi));
    }
    _mm256_maskstore_ps(row, mask_lo, v0);
    _mm256_maskstore_ps(row + 8, mask_hi, v1);
  }
}

#endif

// ---------------------------------------------------------------------------------------------
// Macro-kernels: c[rows, nr] (+)= A (rows x kc: panels of kMr rows, each [kc][kMr], kc kMr
// floats apart) times a B block of kc x nr (nr <= kNr), one micro-kernel call per register tile.

// A B block: columns [0, 16) of its row k at p + k ld, columns [16, 32) at p + half + k ld. A
// panel packed for AVX2 keeps its two 16-column halves apart ([2][kc][16]: half = 16 kc), so that
// the half one pass reads is kc x 64 contiguous bytes; read in place, or packed for the 32-column
// kernels, half is 16.
struct BBlock {
  const float* p;
  int64_t ld;
  int64_t half;
};

using Macro = void (*)(int64_t kc, const float* a, int64_t rows, BBlock b, float* c, int64_t ldc,
                       int64_t nr, bool accumulate);

// The kernels whose tile spans all kNr columns: one pass over the A panels.
template <int64_t kMr, auto kMicro>
void MacroPanels(int64_t kc, const float* a, int64_t rows, BBlock b, float* c, int64_t ldc,
                 int64_t nr, bool accumulate) {
  for (int64_t r = 0; r < rows; r += kMr) {
    kMicro(kc, a + r * kc, b.p, b.ld, c + r * ldc, ldc, std::min(kMr, rows - r), nr, accumulate);
  }
}

#if defined(JAXOPS_GROUPED_GEMM_SIMD)
// AVX2: a 16-column half of the block at a time, over every A panel, so that the half (16 KiB
// at kc = 256, packed) stays in L1 while the A panels (6 KiB each) stream through it, as BLIS
// blocks for Haswell. (Both halves per A panel, as before 2026-11-30, is 32 KiB of B per panel:
// all of a Zen 2/3 core's L1 with the A panel on top, so B came from L2.)
void MacroAvx2(int64_t kc, const float* a, int64_t rows, BBlock b, float* c, int64_t ldc,
               int64_t nr, bool accumulate) {
  for (int64_t h = 0; h * 16 < nr; ++h) {
    const float* bp = b.p + h * b.half;
    const int64_t nh = std::min<int64_t>(16, nr - h * 16);
    for (int64_t r = 0; r < rows; r += kMrAvx2) {
      MicroAvx2Half(kc, a + r * kc, bp, b.ld, c + r * ldc + h * 16, ldc,
                    std::min(kMrAvx2, rows - r), nh, accumulate);
    }
  }
}
#endif

// The micro-kernel every call runs: the widest this CPU has, at most JAXOPS_CPU_GEMM_KERNEL's
// (avx512, avx2 or portable: the tests pick each so; jaxops' Python side refuses other values).
Kernel ChosenKernel() {
  static const Kernel chosen = [] {
    Kernel cap = Kernel::kAvx512;
    if (const char* text = std::getenv("JAXOPS_CPU_GEMM_KERNEL"); text != nullptr) {
      if (std::strcmp(text, "avx2") == 0) cap = Kernel::kAvx2;
      if (std::strcmp(text, "portable") == 0) cap = Kernel::kPortable;
    }
#if defined(JAXOPS_GROUPED_GEMM_SIMD)
    __builtin_cpu_init();
    const bool fma = __builtin_cpu_supports("fma");
    if (cap == Kernel::kAvx512 && fma && __builtin_cpu_supports("avx512f")) return Kernel::kAvx512;
    if (cap != Kernel::kPortable && fma && __builtin_cpu_supports("avx2")) return Kernel::kAvx2;
#endif
    return Kernel::kPortable;
  }();
  return chosen;
}

// ---------------------------------------------------------------------------------------------
// Packing into fp32 panels, zero-padded to whole register tiles.

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
BBlock PanelBlock(const float* panel, int64_t kc) {
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

// ---------------------------------------------------------------------------------------------
// Tasks.

template <typename X>
struct ForwardArgs {
  Problem p;
  const X* x = nullptr;  // [R, K]
  const X* w = nullptr;  // [G, K, N], or [G, N, K] with transpose_w
  bool transpose_w = false;
  bool zero_tail = true;  // write zeros to the rows past the groups
  float* y = nullptr;     // [R, N]
};

template <typename X>
struct WgradArgs {
  Problem p;
  const X* x = nullptr;   // [R, K]
  const X* dy = nullptr;  // [R, N]
  float* dw = nullptr;    // [G, K, N]
};

// Scratch of one worker: an A block of kMb x kKc (and 8 floats of slack for the AVX2 packer's
// last store) and a B panel of kKc x kNr, fp32. Every element a kernel reads from it was packed
// there first, so it is left uninitialized.
struct Scratch {
  std::unique_ptr<float[]> a{new float[kMb * kKc + 8]};
  std::unique_ptr<float[]> b{new float[kKc * kNr]};
};

// This thread's scratch, allocated on its first task and kept for the thread's life: a chunk of
// tasks neither allocates (420 KiB, a heap search) nor clears memory. (Allocating and
// value-initializing it per chunk took 9% of the CPU time of the 8-simulated-device decoder step.)
Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// A micro-kernel's tile: kMr rows; B panels packed in slices of kPw columns (PanelIndex).
template <int64_t Mr, int64_t Pw>
struct Tile {
  static constexpr int64_t kMr = Mr;
  static constexpr int64_t kPw = Pw;
};

// Row strides of a float32 B that BlockB reads in place: not a multiple of 4 KiB. At such a
// stride every row of the block lies on its own page in the same L1 set, which holds 8-12 of
// its kc rows: measured with the AVX2 kernel before it packed every B (2 Zen cores), packing
// then ran 1.1-1.3x faster at 1024 and 2048 columns, and reading in place 1.0-1.15x faster at
// 256-768.
constexpr int64_t kAliasingBytes = 4096;

// The B operand of a block: rows [k0, k0 + kc) and columns [n0, n0 + nr) of a row-major
// matrix `src` (leading dimension ld). For the 32-column kernels (kPw = kNr) a float32 source
// with all kNr columns is read in place (no copy: the block's rows are ld apart) unless its rows
// alias (kAliasingBytes); any other dtype, a narrower edge panel, and every block of the AVX2
// kernel are packed into `panel` (fp32, zero-padded to kNr columns). AVX2 packs, since its
// passes keep a half of the block in L1 (MacroAvx2), which rows 1-2 KiB apart (a weight of
// 256-512 columns) could not stay in: 2 Zen cores, the expert FFN's grouped GEMMs, one core,
// 1.05-1.08x the time read in place.
template <int64_t kPw, typename X>
BBlock BlockB(const X* src, int64_t ld, int64_t k0, int64_t kc, int64_t n0, int64_t nr,
              float* panel) {
  if constexpr (std::is_same_v<X, float>) {
    const bool aliasing = (ld * int64_t{sizeof(float)}) % kAliasingBytes == 0;
    if (kPw == kNr && nr == kNr && !aliasing) return {src + k0 * ld + n0, ld, 16};
  }
  PackB<kPw>(src, ld, k0, kc, n0, nr, panel);
  return PanelBlock<kPw>(panel, kc);
}

// y rows [t.first, t.first + t.rows) of group t.group.
template <typename T, typename X>
void ForwardTask(const ForwardArgs<X>& a, const Task& t, Macro macro, Scratch& s) {
  const Problem& p = a.p;
  const X* w = a.w + t.group * p.k * p.n;
  float* y = a.y + t.first * p.n;
  if (p.k == 0) {
    std::fill(y, y + t.rows * p.n, 0.0f);
    return;
  }
  for (int64_t k0 = 0; k0 < p.k; k0 += kKc) {
    const int64_t kc = std::min(kKc, p.k - k0);
    PackRows<T::kMr>(a.x + t.first * p.k, p.k, t.rows, k0, kc, s.a.get());
    for (int64_t n0 = 0; n0 < p.n; n0 += kNr) {
      const int64_t nr = std::min(kNr, p.n - n0);
      BBlock b;
      if (a.transpose_w) {
        PackBTransposed<T::kPw>(w, p.k, k0, kc, n0, nr, s.b.get());
        b = PanelBlock<T::kPw>(s.b.get(), kc);
      } else {
        b = BlockB<T::kPw>(w, p.n, k0, kc, n0, nr, s.b.get());
      }
      macro(kc, s.a.get(), t.rows, b, y + n0, p.n, nr, k0 > 0);
    }
  }
}

// dw[t.group] rows [t.first, t.first + t.rows) (columns of x), over the group's rows.
template <typename T, typename X>
void WgradTask(const WgradArgs<X>& a, const GroupRows& groups, const Task& t, Macro macro,
               Scratch& s) {
  const Problem& p = a.p;
  float* dw = a.dw + (t.group * p.k + t.first) * p.n;
  const int64_t begin = groups.begins[t.group];
  const int64_t end = groups.ends[t.group];
  if (begin == end) {
    std::fill(dw, dw + t.rows * p.n, 0.0f);
    return;
  }
  for (int64_t r0 = begin; r0 < end; r0 += kKc) {
    const int64_t kc = std::min(kKc, end - r0);
    PackColumns<T::kMr>(a.x, p.k, t.first, t.rows, r0, kc, s.a.get());
    for (int64_t n0 = 0; n0 < p.n; n0 += kNr) {
      const int64_t nr = std::min(kNr, p.n - n0);
      const BBlock b = BlockB<T::kPw>(a.dy, p.n, r0, kc, n0, nr, s.b.get());
      macro(kc, s.a.get(), t.rows, b, dw + n0, p.n, nr, r0 > begin);
    }
  }
}

// Bytes of memory traffic of a task of `rows` rows (ParallelFor's unit of work).
int64_t TaskBytes(const Problem& p, int64_t rows, int64_t contraction) {
  return (rows * contraction + contraction * p.n + rows * p.n) * int64_t{4};
}

// Runs task(t, scratch) for every task over the pool.
template <typename RunTask>
ffi::Future RunTasks(ffi::ThreadPool& pool, std::vector<Task> tasks, int64_t item_bytes,
                     RunTask run) {
  const int64_t n = static_cast<int64_t>(tasks.size());
  return ParallelFor(pool, n, item_bytes,
                     [tasks = std::move(tasks), run](int64_t begin, int64_t end) {
                       Scratch& scratch = ThreadScratch();
                       for (int64_t i = begin; i < end; ++i) run(tasks[i], scratch);
                     });
}

// RunTasks with ChosenKernel(): make(tile, macro) gives the task runner of its macro-kernel
// (tile: a Tile, its register tile's rows and its B panels' layout).
template <typename Make>
ffi::Future RunWithKernel(ffi::ThreadPool& pool, std::vector<Task> tasks, int64_t item_bytes,
                          Make make) {
  switch (ChosenKernel()) {
#if defined(JAXOPS_GROUPED_GEMM_SIMD)
    case Kernel::kAvx512:
      return RunTasks(pool, std::move(tasks), item_bytes,
                      make(Tile<kMrAvx512, kNr>{}, MacroPanels<kMrAvx512, MicroAvx512>));
    case Kernel::kAvx2:
      return RunTasks(pool, std::move(tasks), item_bytes, make(Tile<kMrAvx2, 16>{}, MacroAvx2));
#endif
    default:
      return RunTasks(
          pool, std::move(tasks), item_bytes,
          make(Tile<kMrPortable, kNr>{}, MacroPanels<kMrPortable, MicroPortable<kMrPortable>>));
  }
}

template <typename X>
ffi::Future ForwardImpl(ffi::ThreadPool& pool, const ForwardArgs<X>& a, const int32_t* sizes) {
  const Problem& p = a.p;
  const GroupRows groups = ClipGroups(sizes, p.groups, p.rows);
  // Rows past the last group: zeros, unless the caller never reads them (zero_tail false: the
  // expert layer's worst-case buffers, whose rows past the groups are about three quarters of
  // them on 8 simulated devices).
  const int64_t used = p.groups > 0 ? groups.ends.back() : 0;
  if (a.zero_tail) std::fill(a.y + used * p.n, a.y + p.rows * p.n, 0.0f);
  const int64_t task_rows = TaskRows(used, Workers(pool));
  std::vector<Task> tasks = MakeTasks(
      p.groups, task_rows, [&](int64_t g) { return std::pair(groups.begins[g], groups.ends[g]); });
  return RunWithKernel(
      pool, std::move(tasks), TaskBytes(p, task_rows, p.k), [a](auto tile, Macro macro) {
        return
            [a, macro](const Task& t, Scratch& s) { ForwardTask<decltype(tile)>(a, t, macro, s); };
      });
}

template <typename X>
ffi::Future WgradImpl(ffi::ThreadPool& pool, const WgradArgs<X>& a, const int32_t* sizes) {
  const Problem& p = a.p;
  GroupRows groups = ClipGroups(sizes, p.groups, p.rows);
  const int64_t task_rows = TaskRows(p.groups * p.k, Workers(pool));
  std::vector<Task> tasks =
      MakeTasks(p.groups, task_rows, [&](int64_t) { return std::pair(int64_t{0}, p.k); });
  // A group's contraction is its rows (the average group's for the split).
  const int64_t bytes =
      TaskBytes(p, task_rows, std::max<int64_t>(1, p.rows / std::max<int64_t>(1, p.groups)));
  return RunWithKernel(pool, std::move(tasks), bytes, [a, groups](auto tile, Macro macro) {
    return [a, groups, macro](const Task& t, Scratch& s) {
      WgradTask<decltype(tile)>(a, groups, t, macro, s);
    };
  });
}

// ---------------------------------------------------------------------------------------------
// Validation and dtype dispatch.

ffi::Future ForwardDispatch(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::Buffer<ffi::F32>> y,
                            bool transpose_w, bool zero_tail) {
  auto problem = CheckForward(x, w, sizes, *y, transpose_w);
  if (problem.has_error()) return ReadyFuture(problem.error());
  return DispatchFloat("grouped_gemm", "x", x.element_type(), [&](auto tag) {
    using X = typename decltype(tag)::type;
    ForwardArgs<X> a;
    a.p = *problem;
    a.x = static_cast<const X*>(x.untyped_data());
    a.w = static_cast<const X*>(w.untyped_data());
    a.transpose_w = transpose_w;
    a.zero_tail = zero_tail;
    a.y = y->typed_data();
    return ForwardImpl<X>(pool, a, sizes.typed_data());
  });
}

ffi::Future WgradDispatch(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                          ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::Buffer<ffi::F32>> dw) {
  auto problem = CheckWgrad(x, dy, sizes, *dw);
  if (problem.has_error()) return ReadyFuture(problem.error());
  return DispatchFloat("grouped_gemm_wgrad", "x", x.element_type(), [&](auto tag) {
    using X = typename decltype(tag)::type;
    WgradArgs<X> a;
    a.p = *problem;
    a.x = static_cast<const X*>(x.untyped_data());
    a.dy = static_cast<const X*>(dy.untyped_data());
    a.dw = dw->typed_data();
    return WgradImpl<X>(pool, a, sizes.typed_data());
  });
}

}  // namespace

const char* CpuKernelName() {
  switch (ChosenKernel()) {
    case Kernel::kAvx512:
      return "avx512";
    case Kernel::kAvx2:
      return "avx2";
    default:
      return "portable";
  }
}

}  // namespace jaxops::grouped_gemm

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmCpu, jaxops::grouped_gemm::ForwardDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()  // pool
                                  .Arg<xla::ffi::AnyBuffer>()   // x [R, K]
                                  .Arg<xla::ffi::AnyBuffer>()   // w [G, K, N] | [G, N, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // group_sizes [G]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // y [R, N]
                                  .Attr<bool>("transpose_w")               // w is [G, N, K]
                                  .Attr<bool>("zero_tail"));  // zeros past the groups' rows

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmWgradCpu, jaxops::grouped_gemm::WgradDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()               // pool
                                  .Arg<xla::ffi::AnyBuffer>()                // x [R, K]
                                  .Arg<xla::ffi::AnyBuffer>()                // dy [R, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // group_sizes [G]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // dw [G, K, N]
