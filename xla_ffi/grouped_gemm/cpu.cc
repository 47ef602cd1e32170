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
// stride is a multiple of 4 KiB (BlockB). Tasks run on
// the FFI thread pool, taken from a shared counter, so the groups' GEMMs spread over the cores
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

// The panel's 32 columns in two passes over the A panel (kc x 6 floats, from L1): the classic
// Haswell blocking.
void MicroAvx2(int64_t kc, const float* ap, const float* bp, int64_t ldb, float* c, int64_t ldc,
               int64_t mr, int64_t nr, bool accumulate) {
  MicroAvx2Half(kc, ap, bp, ldb, c, ldc, mr, std::min<int64_t>(nr, 16), accumulate);
  if (nr > 16) MicroAvx2Half(kc, ap, bp + 16, ldb, c + 16, ldc, mr, nr - 16, accumulate);
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

// The types the AVX-512 packers read (others take the portable loops).
template <typename X>
inline constexpr bool kPackAvx512 = std::is_same_v<X, float> || std::is_same_v<X, BFloat16>;
#endif

// A panels from `rows` rows of a row-major matrix (leading dimension ld), columns [k0, k0 + kc):
// panel p holds rows [p kMr, (p + 1) kMr) as [kc][kMr]. With the AVX-512 micro-kernel (12-row
// panels) the columns are transposed 16 at a time in registers; the portable loop takes the rest.
template <int64_t kMr, typename X>
JAXOPS_CPU_CLONES void PackRows(const X* src, int64_t ld, int64_t rows, int64_t k0, int64_t kc,
                                float* dst) {
  for (int64_t p = 0; p * kMr < rows; ++p) {
    float* panel = dst + p * kc * kMr;
    const int64_t mr = std::min(kMr, rows - p * kMr);
    int64_t done = 0;
#if defined(JAXOPS_GROUPED_GEMM_SIMD)
    if constexpr (kMr == kMrAvx512 && kPackAvx512<X>) {
      if (ChosenKernel() == Kernel::kAvx512) {
        const X* starts[16];
        for (int64_t i = 0; i < 16; ++i) starts[i] = i < mr ? src + (p * kMr + i) * ld : src;
        done = kc / 16 * 16;
        TransposeRows16(starts, mr, k0, done, panel, kMr, __mmask16((1u << kMr) - 1u));
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

// A B panel [kc][kNr]: B(k, j) = src[(k0 + k) ld + n0 + j] (row-major B), j < nr.
template <typename X>
JAXOPS_CPU_CLONES void PackB(const X* src, int64_t ld, int64_t k0, int64_t kc, int64_t n0,
                             int64_t nr, float* dst) {
  for (int64_t k = 0; k < kc; ++k) {
    const X* row = src + (k0 + k) * ld + n0;
    float* out = dst + k * kNr;
    for (int64_t j = 0; j < nr; ++j) out[j] = HostType<X>::Load(row[j]);
    for (int64_t j = nr; j < kNr; ++j) out[j] = 0.0f;
  }
}

// A B panel of a transposed B: B(k, j) = src[(n0 + j) ld + k0 + k], j < nr. With the AVX-512
// micro-kernel, 16 x 16 blocks are transposed in registers; the portable loop takes the rest.
template <typename X>
JAXOPS_CPU_CLONES void PackBTransposed(const X* src, int64_t ld, int64_t k0, int64_t kc, int64_t n0,
                                       int64_t nr, float* dst) {
  int64_t done = 0;
#if defined(JAXOPS_GROUPED_GEMM_SIMD)
  if constexpr (kPackAvx512<X>) {
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
#endif
  for (int64_t j = 0; j < kNr; ++j) {
    if (j >= nr) {
      for (int64_t k = done; k < kc; ++k) dst[k * kNr + j] = 0.0f;
      continue;
    }
    const X* col = src + (n0 + j) * ld + k0;
    for (int64_t k = done; k < kc; ++k) dst[k * kNr + j] = HostType<X>::Load(col[k]);
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

// Scratch of one worker: an A block of kMb x kKc and a B panel of kKc x kNr, fp32. Every element
// a kernel reads from it was packed there first, so it is left uninitialized.
struct Scratch {
  std::unique_ptr<float[]> a{new float[kMb * kKc]};
  std::unique_ptr<float[]> b{new float[kKc * kNr]};
};

// This thread's scratch, allocated on its first task and kept for the thread's life: a chunk of
// tasks neither allocates (420 KiB, a heap search) nor clears memory. (Allocating and
// value-initializing it per chunk took 9% of the CPU time of the 8-simulated-device decoder step.)
Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

using Micro = void (*)(int64_t, const float*, const float*, int64_t, float*, int64_t, int64_t,
                       int64_t, bool);

// Row strides of a float32 B that BlockB reads in place: not a multiple of 4 KiB. At such a
// stride every row of the block lies on its own page in the same L1 set, which holds 8-12 of
// its kc rows: measured with the AVX2 kernel (2 Zen cores), packing then ran 1.1-1.3x faster
// at 1024 and 2048 columns, and reading in place 1.0-1.15x faster at 256-768.
constexpr int64_t kAliasingBytes = 4096;

// The B operand of a block: rows [k0, k0 + kc) and columns [n0, n0 + nr) of a row-major
// matrix `src` (leading dimension ld). A float32 source with all kNr columns is read in place
// (no copy: the block's rows are ld apart) unless its rows alias (kAliasingBytes); any other
// dtype, or a narrower edge panel, is packed into `panel` (fp32, zero-padded to kNr columns).
// Returns {rows, their stride}.
template <typename X>
std::pair<const float*, int64_t> BlockB(const X* src, int64_t ld, int64_t k0, int64_t kc,
                                        int64_t n0, int64_t nr, float* panel) {
  if constexpr (std::is_same_v<X, float>) {
    const bool aliasing = (ld * int64_t{sizeof(float)}) % kAliasingBytes == 0;
    if (nr == kNr && !aliasing) return {src + k0 * ld + n0, ld};
  }
  PackB(src, ld, k0, kc, n0, nr, panel);
  return {panel, kNr};
}

// y rows [t.first, t.first + t.rows) of group t.group.
template <int64_t kMr, typename X>
void ForwardTask(const ForwardArgs<X>& a, const Task& t, Micro micro, Scratch& s) {
  const Problem& p = a.p;
  const X* w = a.w + t.group * p.k * p.n;
  float* y = a.y + t.first * p.n;
  if (p.k == 0) {
    std::fill(y, y + t.rows * p.n, 0.0f);
    return;
  }
  for (int64_t k0 = 0; k0 < p.k; k0 += kKc) {
    const int64_t kc = std::min(kKc, p.k - k0);
    PackRows<kMr>(a.x + t.first * p.k, p.k, t.rows, k0, kc, s.a.get());
    for (int64_t n0 = 0; n0 < p.n; n0 += kNr) {
      const int64_t nr = std::min(kNr, p.n - n0);
      std::pair<const float*, int64_t> b{s.b.get(), kNr};
      if (a.transpose_w) {
        PackBTransposed(w, p.k, k0, kc, n0, nr, s.b.get());
      } else {
        b = BlockB(w, p.n, k0, kc, n0, nr, s.b.get());
      }
      for (int64_t r = 0; r < t.rows; r += kMr) {
        micro(kc, s.a.get() + (r / kMr) * kc * kMr, b.first, b.second, y + r * p.n + n0, p.n,
              std::min(kMr, t.rows - r), nr, k0 > 0);
      }
    }
  }
}

// dw[t.group] rows [t.first, t.first + t.rows) (columns of x), over the group's rows.
template <int64_t kMr, typename X>
void WgradTask(const WgradArgs<X>& a, const GroupRows& groups, const Task& t, Micro micro,
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
    PackColumns<kMr>(a.x, p.k, t.first, t.rows, r0, kc, s.a.get());
    for (int64_t n0 = 0; n0 < p.n; n0 += kNr) {
      const int64_t nr = std::min(kNr, p.n - n0);
      const auto [b, ldb] = BlockB(a.dy, p.n, r0, kc, n0, nr, s.b.get());
      for (int64_t r = 0; r < t.rows; r += kMr) {
        micro(kc, s.a.get() + (r / kMr) * kc * kMr, b, ldb, dw + r * p.n + n0, p.n,
              std::min(kMr, t.rows - r), nr, r0 > begin);
      }
    }
  }
}

// Bytes of memory traffic of a task of `rows` rows (ParallelFor's unit of work).
int64_t TaskBytes(const Problem& p, int64_t rows, int64_t contraction) {
  return (rows * contraction + contraction * p.n + rows * p.n) * int64_t{4};
}

// Runs task(t, micro, scratch) for every task over the pool, with the micro-kernel this machine
// has (kMr rows: its tiles).
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

// RunTasks with ChosenKernel(): make(mr, micro) gives the task runner of a micro-kernel whose
// tiles have mr rows (a std::integral_constant).
template <typename Make>
ffi::Future RunWithKernel(ffi::ThreadPool& pool, std::vector<Task> tasks, int64_t item_bytes,
                          Make make) {
  switch (ChosenKernel()) {
#if defined(JAXOPS_GROUPED_GEMM_SIMD)
    case Kernel::kAvx512:
      return RunTasks(pool, std::move(tasks), item_bytes,
                      make(std::integral_constant<int64_t, kMrAvx512>{}, MicroAvx512));
    case Kernel::kAvx2:
      return RunTasks(pool, std::move(tasks), item_bytes,
                      make(std::integral_constant<int64_t, kMrAvx2>{}, MicroAvx2));
#endif
    default:
      return RunTasks(
          pool, std::move(tasks), item_bytes,
          make(std::integral_constant<int64_t, kMrPortable>{}, MicroPortable<kMrPortable>));
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
  return RunWithKernel(pool, std::move(tasks), TaskBytes(p, task_rows, p.k),
                       [a](auto mr, Micro micro) {
                         return [a, micro](const Task& t, Scratch& s) {
                           ForwardTask<decltype(mr)::value>(a, t, micro, s);
                         };
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
  return RunWithKernel(pool, std::move(tasks), bytes, [a, groups](auto mr, Micro micro) {
    return [a, groups, micro](const Task& t, Scratch& s) {
      WgradTask<decltype(mr)::value>(a, groups, t, micro, s);
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
