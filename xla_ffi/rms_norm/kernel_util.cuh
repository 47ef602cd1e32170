// Device building blocks shared by the RMSNorm kernels (fwd_kernels.cuh and bwd_kernels.cuh):
// launch geometry, rows and row groups (the row sums of each design), a thread's accesses and
// the pack helpers that load them. Templated over T (x's dtype), W (the weight's dtype) and kVec
// (elements per memory access: 16 bytes of T, or 1 for the scalar fallback); the math is
// rms_norm.h's.
//
// x is viewed as [rows, hidden]; a "row group" is the set of threads that owns one row; all
// arithmetic is fp32. Three designs, chosen by the number of accesses per row:
//
//   * Warp-per-row, for rows of at most 32 x 4 accesses of 16 bytes, i.e. 2 KiB (hidden <= 1024
//     for bfloat16 / float16, <= 512 for float32; <= 256 on the scalar path). A group is
//     L = min(32, next_pow2(accesses per row)) lanes of one warp, so short rows (head_dim 128)
//     do not idle lanes; a CTA of 256 threads runs 256 / L rows at a time; row sums are warp
//     shuffles only, with no barrier.
//   * Block-per-row, for rows of at most 512 x 4 accesses, i.e. 32 KiB (hidden <= 16384 for
//     16-bit types, <= 8192 for float32; <= 4096 on the scalar path). A group is G whole warps
//     (32 <= G <= 512 threads); row sums go through warp shuffles and shared memory. Short rows
//     run several per CTA (CTAs of up to 256 threads, or a single row when G > 128).
//   Both cache the thread's part of the row in registers between the two passes (at most
//   kCachedAccesses accesses per thread: 4 x 16 bytes, or 8 elements on the scalar path), so
//   every tensor is read from memory exactly once, and load the weight of the thread's columns
//   once for all the rows the thread visits. The backward keeps its per-column dw sums in shared
//   memory, which leaves the registers to the row cache (no spills at <= 128 registers).
//   * Long rows (anything larger). One row per CTA (1024 threads forward, 512 backward), looping
//     over the row in chunks; the second pass re-reads x (h for add_rms_norm, x and dy for the
//     backward) from L2 instead of caching it, so any hidden works.
//
// The cached and the long-row designs share their per-access code (the pack helpers below and in
// fwd_kernels.cuh / bwd_kernels.cuh, over a thread's accesses in a row or in a chunk of a row). Row
// offsets are int64_t and rows are visited with grid-stride loops, so tensors beyond 2^31 elements
// and any number of rows work with a capped grid.
#ifndef JAXOPS_XLA_FFI_RMS_NORM_KERNEL_UTIL_CUH_
#define JAXOPS_XLA_FFI_RMS_NORM_KERNEL_UTIL_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "xla_ffi/common/cuda_util.cuh"
#include "xla_ffi/common/cuda_vec.cuh"
#include "xla_ffi/common/math.h"
#include "xla_ffi/rms_norm/rms_norm.h"

namespace jaxops::rms_norm {

// ---------------------------------------------------------------------------------------------
// Launch geometry.

// Accesses per thread that the warp- and block-per-row designs cache in registers: four 16-byte
// accesses (64 bytes of each row tensor), or eight elements on the scalar path.
template <int kVec>
constexpr int kCachedAccesses = kVec > 1 ? 4 : 8;

constexpr int kWarpCtaThreads = 256;      // CTA size of the warp-per-row kernels.
constexpr int kMaxGroupThreads = 512;     // Largest row group of the block-per-row kernels.
constexpr int kFwdLongRowThreads = 1024;  // CTA (= row group) size of the long-row kernels; the
constexpr int kBwdLongRowThreads = 512;   //   backward keeps five tensors in flight per access.
constexpr int kLongRowUnroll = 2;         // Accesses in flight per thread per long-row chunk.
constexpr int kSumPartsCols = 32;   // Columns per CTA of the dw part reduction (one warp wide).
constexpr int kSumPartsSlices = 8;  // Part ranges it sums at once per column, then in order.
constexpr int kSumPartsThreads = kSumPartsCols * kSumPartsSlices;
constexpr int kSumPartsUnroll = 32;  // Parts loaded ahead per thread in that reduction.
constexpr int kMaxWarpsPerCta = 1024 / kWarpSize;

// Largest hidden (elements) of the warp- and block-per-row designs for an access width.
template <int kVec>
constexpr int64_t kWarpRowMaxHidden = int64_t{kWarpSize} * kCachedAccesses<kVec> * kVec;
template <int kVec>
constexpr int64_t kBlockRowMaxHidden = int64_t{kMaxGroupThreads} * kCachedAccesses<kVec> * kVec;

// ---------------------------------------------------------------------------------------------
// Rows and row groups.

// The rows a CTA visits: base = begin, begin + stride, ... while base < end; its row group g
// takes row base + g when that is < end (otherwise it idles but still joins the reductions).
struct RowRange {
  int64_t begin;
  int64_t end;
  int64_t stride;
};

// All rows, spread over the grid.
__device__ __forceinline__ RowRange GridStrideRows(int64_t rows, int groups) {
  return {static_cast<int64_t>(blockIdx.x) * groups, rows,
          static_cast<int64_t>(gridDim.x) * groups};
}

// The rows of part p = blockIdx.x (the grid has exactly `parts` CTAs).
__device__ __forceinline__ RowRange PartRows(int64_t rows, int64_t parts, int groups) {
  const int64_t p = blockIdx.x;
  return {PartBegin(p, rows, parts), PartBegin(p + 1, rows, parts), groups};
}

// The CTA cut into `count` row groups of `size` threads; this thread is rank `rank` of group
// `index`.
struct RowGroups {
  int count;
  int index;
  int rank;
  int size;
};

__device__ __forceinline__ RowGroups CtaRowGroups(int size) {
  const int t = static_cast<int>(threadIdx.x);
  return {static_cast<int>(blockDim.x) / size, t / size, t % size, size};
}

// Row sums of the warp-per-row design: a group is `size` lanes (a power of two <= 32) of one
// warp, aligned to a multiple of `size`, so xor partners stay inside the group. Every lane of the
// warp must call Sum; all lanes of a group return the same bits.
class WarpRowGroup {
 public:
  __device__ explicit WarpRowGroup(int size) : size_(size) {}

  __device__ __forceinline__ float Sum(float v) const {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      if (offset < size_) v += __shfl_xor_sync(kFullWarpMask, v, offset);
    }
    return v;
  }

 private:
  int size_;
};

// Row sums of the block-per-row design: a group is `warps` consecutive warps. Warp sums go to
// shared memory and every thread adds its group's warps in order (identical bits in the group).
// Two slot sets alternate, so one barrier per sum suffices: a thread can only overwrite a slot
// set after everyone passed the barrier of the sum in between, i.e. finished reading it. Every
// thread of the CTA must call Sum the same number of times.
class BlockRowGroup {
 public:
  __device__ BlockRowGroup(float* slots, int warps) : slots_(slots), warps_(warps) {}

  __device__ __forceinline__ float Sum(float v) {
    v = WarpSum(v);
    float* slots = slots_ + parity_ * kMaxWarpsPerCta;
    const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
    if (threadIdx.x % kWarpSize == 0) slots[warp] = v;
    __syncthreads();
    const int first = warp / warps_ * warps_;
    float total = 0.0f;
    for (int w = 0; w < warps_; ++w) total += slots[first + w];
    parity_ ^= 1;
    return total;
  }

 private:
  float* slots_;  // [2][kMaxWarpsPerCta]
  int warps_;
  int parity_ = 0;
};

// The BlockRowGroup of a kernel's CTA, over its (static) shared slots: `warps` warps per group.
__device__ __forceinline__ BlockRowGroup CtaBlockRowGroup(int warps) {
  __shared__ float slots[2 * kMaxWarpsPerCta];
  return BlockRowGroup(slots, warps);
}

// ---------------------------------------------------------------------------------------------
// A thread's accesses and the pack helpers.
//
// The helpers below move and reduce the packs of one thread's accesses in a row, the same code
// for both designs: an access set says which accesses exist (Valid) and where access i lies
// relative to the thread's base pointer (Offset).

// The columns a thread owns in the cached designs, the same for every row it visits: access i
// (0 <= i < count <= kIters) covers elements [first + i * stride, + kVec). Cached rows are at most
// kBlockRowMaxHidden (16384) elements, so these in-row offsets are int; row offsets are int64_t.
struct OwnedColumns {
  int first;
  int stride;
  int count;
};

template <int kVec, int kIters>
__device__ __forceinline__ OwnedColumns OwnColumns(int64_t hidden, const RowGroups& g) {
  const int n = static_cast<int>(hidden);
  const int first = g.rank * kVec;
  const int stride = g.size * kVec;
  const int count = first < n ? min(kIters, (n - first + stride - 1) / stride) : 0;
  return {first, stride, count};
}

// The accesses of a cached row, from the thread's first column (count 0 for an idle group).
struct OwnedAccesses {
  int stride;
  int count;
  __device__ __forceinline__ bool Valid(int i) const { return i < count; }
  __device__ __forceinline__ int Offset(int i) const { return i * stride; }
};

// The accesses of a long-row chunk, from the row start: access u is the thread's vector
// v0 + u * blockDim.x of the row's `vecs` vectors, if that exists.
template <int kVec>
struct ChunkAccesses {
  int64_t v0;
  int64_t vecs;
  __device__ __forceinline__ int64_t Vector(int u) const {
    return v0 + static_cast<int64_t>(u) * blockDim.x;
  }
  __device__ __forceinline__ bool Valid(int u) const { return Vector(u) < vecs; }
  __device__ __forceinline__ int64_t Offset(int u) const { return Vector(u) * kVec; }
};

// Calls fn(ChunkAccesses<kVec>) for each chunk of the thread's accesses in a long row of `vecs`
// accesses, in order (the CTA is the row group).
template <int kVec, typename Fn>
__device__ __forceinline__ void ForEachChunk(int64_t vecs, Fn&& fn) {
  const int64_t chunk = static_cast<int64_t>(blockDim.x) * kLongRowUnroll;
  for (int64_t v0 = threadIdx.x; v0 < vecs; v0 += chunk) fn(ChunkAccesses<kVec>{v0, vecs});
}

template <typename T, int kVec, int kN, typename Accesses>
__device__ __forceinline__ void LoadPacks(const T* base, const Accesses& acc,
                                          Pack<T, kVec> (&packs)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    if (acc.Valid(i)) LoadPack(base + acc.Offset(i), packs[i]);
  }
}

// Two row tensors at the same accesses, loads interleaved (all in flight together).
template <typename T, int kVec, int kN, typename Accesses>
__device__ __forceinline__ void LoadPackPairs(const T* p, const T* q, const Accesses& acc,
                                              Pack<T, kVec> (&pv)[kN], Pack<T, kVec> (&qv)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    if (acc.Valid(i)) {
      LoadPack(p + acc.Offset(i), pv[i]);
      LoadPack(q + acc.Offset(i), qv[i]);
    }
  }
}

// The weight of the accesses, whose offsets start at weight + first (left unset without a
// weight: WeightAt then ignores it).
template <typename W, int kVec, int kN, typename Accesses>
__device__ __forceinline__ void LoadWeight(const W* weight, int first, const Accesses& acc,
                                           Pack<W, kVec> (&w)[kN]) {
  if (weight == nullptr) return;
  LoadPacks(weight + first, acc, w);
}

template <typename W>
__device__ __forceinline__ float WeightAt(const W* weight, const W& w, bool zero_centered) {
  return weight != nullptr ? EffectiveWeight(ToFloat(w), zero_centered) : 1.0f;
}

}  // namespace jaxops::rms_norm

#endif  // JAXOPS_XLA_FFI_RMS_NORM_KERNEL_UTIL_CUH_
