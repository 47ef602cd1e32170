// Micro- and macro-kernels of the grouped GEMM's CPU calls (cpu.cc, their only user; the
// blocking around them is described there): the register-tile kernels for AVX-512 (12 x 32),
// AVX2 (6 x 16, a 32-column panel in two passes) and the portable baseline (4 x 32), the
// macro-kernels that call one per register tile of a block, and the choice of kernel for this
// CPU.
#ifndef JAXOPS_XLA_FFI_GROUPED_GEMM_CPU_MICRO_H_
#define JAXOPS_XLA_FFI_GROUPED_GEMM_CPU_MICRO_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define JAXOPS_GROUPED_GEMM_SIMD 1
#endif

#include "xla_ffi/common/host_float.h"
#include "xla_ffi/grouped_gemm/grouped_gemm.h"

namespace jaxops::grouped_gemm::cpu {

// Rows of the micro-kernels' register tiles: AVX-512 holds 12 x 32 fp32 sums in 24 of its 32
// registers; AVX2 6 x 16 in 12 of its 16 (the panel's 32 columns in two passes); the portable
// kernel (the baseline, as the compiler vectorizes it) 4 x 32.
inline constexpr int64_t kMrAvx512 = 12;
inline constexpr int64_t kMrAvx2 = 6;
inline constexpr int64_t kMrPortable = 4;
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
__attribute__((target("avx512f,fma"))) inline void MicroAvx512(int64_t kc, const float* ap,
                                                               const float* bp, int64_t ldb,
                                                               float* c, int64_t ldc, int64_t mr,
                                                               int64_t nr, bool accumulate) {
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

// Rows [0, mr) of a 6 x 16 tile of sums (lo: columns 0-7, hi: 8-15) added to (accumulate) or
// written over c's rows (leading dimension ldc). kMasked: only the lanes of mask_lo and mask_hi
// are read and written; else all 16 columns, with plain loads and stores (the masks unused).
// Always inlined, with its row loop unrolled, so that the sums stay in registers.
template <bool kMasked>
__attribute__((target("avx2"), always_inline)) inline void WriteTileAvx2(
    const __m256 (&lo)[kMrAvx2], const __m256 (&hi)[kMrAvx2], float* c, int64_t ldc, int64_t mr,
    bool accumulate, __m256i mask_lo, __m256i mask_hi) {
#pragma GCC unroll 6
  for (int64_t i = 0; i < kMrAvx2; ++i) {
    if (i >= mr) break;
    float* row = c + i * ldc;
    __m256 v0 = lo[i];
    __m256 v1 = hi[i];
    if constexpr (kMasked) {
      if (accumulate) {
        v0 = _mm256_add_ps(v0, _mm256_maskload_ps(row, mask_lo));
        v1 = _mm256_add_ps(v1, _mm256_maskload_ps(row + 8, mask_hi));
      }
      _mm256_maskstore_ps(row, mask_lo, v0);
      _mm256_maskstore_ps(row + 8, mask_hi, v1);
    } else {
      if (accumulate) {
        v0 = _mm256_add_ps(v0, _mm256_loadu_ps(row));
        v1 = _mm256_add_ps(v1, _mm256_loadu_ps(row + 8));
      }
      _mm256_storeu_ps(row, v0);
      _mm256_storeu_ps(row + 8, v1);
    }
  }
}

// AVX2 has 16 registers: a 6 x 16 tile of sums (12), two of B and a broadcast of A.
// Columns [0, nr) of c (nr <= 16; B read from bp, 16 columns). Written so that the sums stay
// in registers (set1 of a loaded float, in a function of its own): as one loop over both
// halves, with a broadcast from the pointer, GCC stored all twelve to the stack every step.
__attribute__((target("avx2,fma"), noinline)) inline void MicroAvx2Half(
    int64_t kc, const float* ap, const float* bp, int64_t ldb, float* c, int64_t ldc, int64_t mr,
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
  // Whole rows with plain loads and stores: AVX2's masked stores are microcoded on AMD's Zen
  // cores. (With masked stores on every tile, 2026-11-30 on 2 Zen cores, the expert FFN's
  // grouped GEMMs ran about 1.15x the time of this kernel with its other changes of that day.)
  if (nr == 16) {
    WriteTileAvx2<false>(lo, hi, c, ldc, mr, accumulate, LaneMask(16), LaneMask(8));
  } else {
    WriteTileAvx2<true>(lo, hi, c, ldc, mr, accumulate, LaneMask(nr), LaneMask(nr - 8));
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
inline void MacroAvx2(int64_t kc, const float* a, int64_t rows, BBlock b, float* c, int64_t ldc,
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
inline Kernel ChosenKernel() {
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

}  // namespace jaxops::grouped_gemm::cpu

#endif  // JAXOPS_XLA_FFI_GROUPED_GEMM_CPU_MICRO_H_
