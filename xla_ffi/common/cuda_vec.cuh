// Vectorized memory access for the CUDA kernels of every op family (compiled by nvcc only).
//
//   * Pack<T, N>: N consecutive elements moved with the widest aligned accesses (16 bytes at most)
//     by LoadPack / StorePack; ForgetValue keeps a register cache of packs packed.
//   * kVecElems<T>: elements of T per 16-byte access.
//   * IsAligned, Vectorizable: host checks that choose between the 16-byte path and the scalar
//     fallback (kVec = 1) of a kernel.
#ifndef JAXOPS_XLA_FFI_COMMON_CUDA_VEC_CUH_
#define JAXOPS_XLA_FFI_COMMON_CUDA_VEC_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

namespace jaxops {

// The widest single access (in bytes) used to move `bytes` contiguous bytes: 16 at most.
__host__ __device__ constexpr int AccessBytes(int bytes) { return bytes < 16 ? bytes : 16; }

// Elements per 16-byte access.
template <typename T>
constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));

template <int kBytes>
struct RawWord;
template <>
struct RawWord<2> {
  using type = unsigned short;
};
template <>
struct RawWord<4> {
  using type = unsigned int;
};
template <>
struct RawWord<8> {
  using type = uint2;
};
template <>
struct RawWord<16> {
  using type = uint4;
};

// N consecutive elements of T, aligned for the accesses that LoadPack / StorePack issue.
template <typename T, int N>
struct alignas(AccessBytes(static_cast<int>(sizeof(T)) * N)) Pack {
  T v[N];
};

// Loads p[0, N). p must be aligned to AccessBytes(N * sizeof(T)) bytes.
template <typename T, int N>
__device__ __forceinline__ void LoadPack(const T* p, Pack<T, N>& out) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
  using Word = typename RawWord<AccessBytes(kBytes)>::type;
  const Word* src = reinterpret_cast<const Word*>(p);
  Word* dst = reinterpret_cast<Word*>(&out);
#pragma unroll
  for (int i = 0; i < kBytes / AccessBytes(kBytes); ++i) dst[i] = src[i];
}

// Stores p[0, N). p must be aligned to AccessBytes(N * sizeof(T)) bytes.
template <typename T, int N>
__device__ __forceinline__ void StorePack(T* p, const Pack<T, N>& in) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
  using Word = typename RawWord<AccessBytes(kBytes)>::type;
  const Word* src = reinterpret_cast<const Word*>(&in);
  Word* dst = reinterpret_cast<Word*>(p);
#pragma unroll
  for (int i = 0; i < kBytes / AccessBytes(kBytes); ++i) dst[i] = src[i];
}

// Hides the value of p from the optimizer at this point (an empty volatile asm that claims to
// rewrite each 32-bit word; it emits no instruction). fp32 values converted from p before this
// point cannot be reused after it, nor hoisted out of the enclosing loop, so code that reads a
// register cache of 16-bit elements more than once keeps the packed words (two elements per
// register) live instead of one fp32 register per element, and converts again when it reads
// (one cheap integer op per element). This keeps the row caches of the RMSNorm kernels in
// registers without spilling.
template <typename T, int N>
__device__ __forceinline__ void ForgetValue(Pack<T, N>& p) {
  if constexpr (sizeof(Pack<T, N>) % sizeof(unsigned) == 0) {
    unsigned* words = reinterpret_cast<unsigned*>(&p);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(Pack<T, N>) / sizeof(unsigned)); ++i) {
      asm volatile("" : "+r"(words[i]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host checks.

inline bool IsAligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Whether rows of `row_length` elements of T can be moved in 16-byte accesses: row_length is a
// multiple of kVecElems<T> and every base pointer is 16-byte aligned (nullptr, an absent
// operand, counts as aligned).
template <typename T>
bool Vectorizable(int64_t row_length, std::initializer_list<const void*> pointers) {
  if (row_length % kVecElems<T> != 0) return false;
  for (const void* p : pointers) {
    if (!IsAligned(p, 16)) return false;
  }
  return true;
}

}  // namespace jaxops

#endif  // JAXOPS_XLA_FFI_COMMON_CUDA_VEC_CUH_
