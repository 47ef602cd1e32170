// Row conversions from fp32 to a storage type for CPU kernels: StoreFromFloat(src, dst, n) writes
// dst[j] = HostType<X>::Store(src[j]), bit for bit the same on every CPU.
//
// Kernels that produce 16-bit outputs compute a row piece in fp32 into an L1-resident tile and
// hand it to StoreFromFloat (StoreThroughTile does both). For bfloat16 on CPUs with AVX512-BF16
// (e.g. AMD Zen 4, Intel Sapphire Rapids), StoreFromFloat converts 32 values with one
// VCVTNE2PS2BF16 instruction instead of about ten integer operations per 16 values. That
// instruction rounds to nearest even and quiets NaNs exactly as HostType<BFloat16>::Store does, but
// flushes subnormal inputs to zero, so a block of 32 values holding a subnormal is converted by the
// integer path instead (VFPCLASSPS finds them).
#ifndef JAXOPS_XLA_FFI_COMMON_CPU_CONVERT_H_
#define JAXOPS_XLA_FFI_COMMON_CPU_CONVERT_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "xla_ffi/common/host_float.h"

// JAXOPS_CPU_AVX512BF16: the AVX512-BF16 paths are compiled (chosen at run time by HasAvx512Bf16).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define JAXOPS_CPU_AVX512BF16 1
#define JAXOPS_AVX512BF16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#endif

namespace jaxops {

// Values per tile of the fp32 staging buffers of 16-bit outputs (4 KiB: stays in L1).
inline constexpr int64_t kConvertTile = 1024;

namespace convert_internal {

template <typename X>
JAXOPS_CPU_CLONES void StoreRowGeneric(const float* src, X* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = HostType<X>::Store(src[j]);
}

#if defined(JAXOPS_CPU_AVX512BF16)
inline bool HasAvx512Bf16() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
}

constexpr int kSubnormalClass = 0x20;  // VFPCLASSPS category: denormal

// dst[0, 32) = bfloat16 of a (values 0-15) and b (16-31), exactly as HostType<BFloat16>::Store.
JAXOPS_AVX512BF16_TARGET inline void StoreBf16x32(__m512 a, __m512 b, BFloat16* dst) {
  const __mmask16 subnormal =
      _mm512_fpclass_ps_mask(a, kSubnormalClass) | _mm512_fpclass_ps_mask(b, kSubnormalClass);
  if (subnormal != 0) {  // rare: the integer conversion
    float values[32];
    _mm512_storeu_ps(values, a);
    _mm512_storeu_ps(values + 16, b);
    for (int i = 0; i < 32; ++i) dst[i] = HostType<BFloat16>::Store(values[i]);
    return;
  }
  const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  _mm512_storeu_si512(static_cast<void*>(dst), packed);
}

// 16 bfloat16 values at src as fp32, with AVX-512F alone (its bits are fp32's top half, as
// HostType<BFloat16>::Load). (The zero-masking forms with a full mask are the same instructions;
// GCC 12's unmasked ones warn about an uninitialized placeholder.)
__attribute__((target("avx512f"))) inline __m512 WidenBf16x16(const BFloat16* src) {
  const __mmask16 all = 0xffff;
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(
      _mm512_maskz_slli_epi32(all, _mm512_maskz_cvtepu16_epi32(all, bits), 16));
}

// The same, for the AVX512-BF16 paths.
JAXOPS_AVX512BF16_TARGET inline __m512 LoadBf16x16(const BFloat16* src) {
  return WidenBf16x16(src);
}

JAXOPS_AVX512BF16_TARGET inline void StoreBf16Avx512(const float* src, BFloat16* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    StoreBf16x32(_mm512_loadu_ps(src + j), _mm512_loadu_ps(src + j + 16), dst + j);
  }
  for (; j < n; ++j) dst[j] = HostType<BFloat16>::Store(src[j]);
}
#endif

}  // namespace convert_internal

// dst[j] = HostType<X>::Store(src[j]) for j < n.
template <typename X>
inline void StoreFromFloat(const float* src, X* dst, int64_t n) {
  if constexpr (std::is_same_v<X, float>) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
    return;
  } else {
#if defined(JAXOPS_CPU_AVX512BF16)
    if constexpr (std::is_same_v<X, BFloat16>) {
      if (convert_internal::HasAvx512Bf16()) {
        convert_internal::StoreBf16Avx512(src, dst, n);
        return;
      }
    }
#endif
    convert_internal::StoreRowGeneric(src, dst, n);
  }
}

// Writes n values of a row to out: fill(begin, count, values) computes values [begin, begin +
// count) in fp32. A float row is filled in place (one call); a 16-bit row tile by tile through an
// fp32 tile on the stack that StoreFromFloat converts.
template <typename X, typename Fill>
inline void StoreThroughTile(X* out, int64_t n, Fill&& fill) {
  if constexpr (std::is_same_v<X, float>) {
    fill(int64_t{0}, n, out);
  } else {
    float tile[kConvertTile];
    for (int64_t j0 = 0; j0 < n; j0 += kConvertTile) {
      const int64_t count = n - j0 < kConvertTile ? n - j0 : kConvertTile;
      fill(j0, count, tile);
      StoreFromFloat(tile, out + j0, count);
    }
  }
}

}  // namespace jaxops

#endif  // JAXOPS_XLA_FFI_COMMON_CPU_CONVERT_H_
