// Host (CPU) element types and branch-free conversions to and from fp32.
//
// bfloat16 and float16 are stored as uint16_t bit patterns; the conversions are written with
// integer and select operations only, so GCC vectorizes loops that use them. fp32 -> 16-bit
// rounds to nearest even, overflows to +-inf, keeps NaN a (quiet) NaN and produces subnormals,
// exactly as ml_dtypes / numpy convert.
#ifndef JAXOPS_XLA_FFI_COMMON_HOST_FLOAT_H_
#define JAXOPS_XLA_FFI_COMMON_HOST_FLOAT_H_

#include <cstdint>
#include <cstring>

// Hot CPU loops are compiled for AVX-512, AVX2 and the baseline; the loader picks one per machine.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JAXOPS_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define JAXOPS_CPU_CLONES
#endif

namespace jaxops {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

struct BFloat16 {
  uint16_t bits;
};

struct Float16 {
  uint16_t bits;
};

// HostType<T>::Load / Store convert one element of storage type T to and from fp32.
template <typename T>
struct HostType;

template <>
struct HostType<float> {
  static float Load(float v) { return v; }
  static float Store(float v) { return v; }
};

template <>
struct HostType<BFloat16> {
  static float Load(BFloat16 v) { return BitsFloat(static_cast<uint32_t>(v.bits) << 16); }
  static BFloat16 Store(float f) {
    const uint32_t u = FloatBits(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
    return BFloat16{static_cast<uint16_t>(is_nan ? quiet_nan : rounded)};
  }
};

template <>
struct HostType<Float16> {
  static float Load(Float16 v) {
    const uint32_t h = v.bits;
    const uint32_t sign = (h & 0x8000u) << 16;
    const uint32_t shifted = (h & 0x7fffu) << 13;  // exponent and mantissa in fp32 position
    const uint32_t exponent = shifted & 0x0f800000u;
    const uint32_t normal = shifted + (112u << 23);  // rebias 15 -> 127
    const uint32_t inf_nan = normal + (112u << 23);  // exponent 31 -> 255
    // Subnormal (and zero): value = mantissa * 2^-24, computed exactly in fp32.
    const float subnormal = BitsFloat(shifted + (113u << 23)) - BitsFloat(113u << 23);
    const uint32_t magnitude = exponent == 0x0f800000u ? inf_nan
                               : exponent == 0         ? FloatBits(subnormal)
                                                       : normal;
    return BitsFloat(magnitude | sign);
  }
  static Float16 Store(float f) {
    const uint32_t u = FloatBits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t a = u & 0x7fffffffu;
    // |f| >= 65520 rounds to inf; NaN stays a quiet NaN.
    const uint32_t overflow = a > 0x7f800000u ? 0x7e00u : 0x7c00u;
    // |f| < 2^-14: add a magic number so the fp32 adder rounds the mantissa to the subnormal grid.
    const uint32_t magic = 126u << 23;  // 0.5, whose ulp is 2^-24: the f16 subnormal step
    const uint32_t subnormal = FloatBits(BitsFloat(a) + BitsFloat(magic)) - magic;
    // Normal range: rebias and round to nearest even on the 13 dropped bits.
    const uint32_t odd = (a >> 13) & 1u;
    const uint32_t normal = (a - (112u << 23) + 0xfffu + odd) >> 13;
    const uint32_t magnitude = a >= 0x477ff000u ? overflow : a < 0x38800000u ? subnormal : normal;
    return Float16{static_cast<uint16_t>(magnitude | sign)};
  }
};

}  // namespace jaxops

#endif  // JAXOPS_XLA_FFI_COMMON_HOST_FLOAT_H_
