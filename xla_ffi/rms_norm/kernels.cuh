// Device code of the RMSNorm family: the CUDA kernels and their building blocks, templated over
// T (x's dtype), W (the weight's dtype) and kVec (elements per memory access: 16 bytes of T, or 1
// for the scalar fallback). cuda.cu picks and launches them; the math is rms_norm.h's.
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
// The cached and the long-row designs share their per-access code (the pack helpers below, over
// a thread's accesses in a row or in a chunk of a row). Row offsets are int64_t and rows are
// visited with grid-stride loops, so tensors beyond 2^31 elements and any number of rows work
// with a capped grid.
//
// dw is deterministic: the backward kernel with a weight runs exactly `parts` CTAs; CTA p owns
// rows [PartBegin(p), PartBegin(p + 1)), adds dy * x * rstd per column in a fixed order (each
// column of each row group belongs to one thread; the CTA's groups are combined in group order)
// and writes dw_partial[p, :]. RmsNormSumPartsKernel then adds the parts in order p = 0, 1, ...
// per column. No atomics, so equal inputs give equal bits on every run.
#ifndef JAXOPS_XLA_FFI_RMS_NORM_KERNELS_CUH_
#define JAXOPS_XLA_FFI_RMS_NORM_KERNELS_CUH_

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
constexpr int kSumPartsThreads = 64;      // CTA size of the dw part reduction (small CTAs spread
                                          //   its few threads, one per column, over more SMs).
constexpr int kSumPartsUnroll = 32;       // Parts loaded ahead per column in that reduction.
constexpr int kMaxWarpsPerCta = 1024 / kWarpSize;

// Largest hidden (elements) of the warp- and block-per-row designs for an access width.
template <int kVec>
constexpr int64_t kWarpRowMaxHidden = int64_t{kWarpSize} * kCachedAccesses<kVec> * kVec;
template <int kVec>
constexpr int64_t kBlockRowMaxHidden = int64_t{kMaxGroupThreads} * kCachedAccesses<kVec> * kVec;

// ---------------------------------------------------------------------------------------------
// Kernel arguments. Absent optional operands are nullptr.

template <typename T, typename W>
struct FwdArgs {
  const T* x = nullptr;
  const T* residual = nullptr;     // add_rms_norm only.
  const W* weight = nullptr;       // nullptr: no weight (w_eff = 1).
  const float* rstd_in = nullptr;  // rms_norm only; replaces the computed rstd.
  T* y = nullptr;
  T* h = nullptr;  // add_rms_norm only: x + residual, rounded to T.
  float* rstd = nullptr;
  int64_t rows = 0;
  int64_t hidden = 0;
  float eps = 0.0f;
  bool zero_centered = false;
};

template <typename T, typename W>
struct BwdArgs {
  const T* dy = nullptr;
  const T* x = nullptr;
  const W* weight = nullptr;  // nullptr: no weight (w_eff = 1, no dw).
  const float* rstd = nullptr;
  const float* dot_in = nullptr;  // Replaces dot[r] = sum_j g * x.
  const T* dh = nullptr;          // Added to dx.
  T* dx = nullptr;
  float* dw_partial = nullptr;  // [parts, hidden]; nullptr exactly when there is no weight.
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t parts = 0;
  bool zero_centered = false;
};

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

// The forward's input to normalize at x + row_offset: x, or for add_rms_norm (kAdd)
// h = x + residual rounded to T, which is also stored. All loads are issued before any store.
template <bool kAdd, typename T, typename W, int kVec, int kN, typename Accesses>
__device__ __forceinline__ void LoadFwdInput(const FwdArgs<T, W>& a, int64_t row_offset,
                                             const Accesses& acc, Pack<T, kVec> (&hv)[kN]) {
  if constexpr (kAdd) {
    Pack<T, kVec> rv[kN];
    LoadPackPairs(a.x + row_offset, a.residual + row_offset, acc, hv, rv);
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      if (acc.Valid(i)) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          hv[i].v[k] = FromFloat<T>(ToFloat(hv[i].v[k]) + ToFloat(rv[i].v[k]));
        }
        StorePack(a.h + row_offset + acc.Offset(i), hv[i]);
      }
    }
  } else {
    LoadPacks(a.x + row_offset, acc, hv);
  }
}

// sum += v^2 over the valid packs, in order.
template <typename T, int kVec, int kN, typename Accesses>
__device__ __forceinline__ void AddSquares(const Pack<T, kVec> (&packs)[kN], const Accesses& acc,
                                           float& sum) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    if (acc.Valid(i)) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float f = ToFloat(packs[i].v[k]);
        sum += f * f;
      }
    }
  }
}

// y = h * rstd * w_eff at y + row_offset.
template <typename T, typename W, int kVec, int kN, typename Accesses>
__device__ __forceinline__ void StoreNormalized(const FwdArgs<T, W>& a, int64_t row_offset,
                                                const Accesses& acc, const Pack<T, kVec> (&hv)[kN],
                                                const Pack<W, kVec> (&w)[kN], float rstd) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    if (acc.Valid(i)) {
      Pack<T, kVec> out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float w_eff = WeightAt(a.weight, w[i].v[k], a.zero_centered);
        out.v[k] = FromFloat<T>(Normalize(ToFloat(hv[i].v[k]), rstd, w_eff));
      }
      StorePack(a.y + row_offset + acc.Offset(i), out);
    }
  }
}

// dot += sum_k dy[k] * w_eff[k] * x[k] over the valid packs: their share of the backward's row
// dot product (each pack summed on its own, then added, in order).
template <typename T, typename W, int kVec, int kN, typename Accesses>
__device__ __forceinline__ void AddGradDot(const BwdArgs<T, W>& a, const Accesses& acc,
                                           const Pack<T, kVec> (&dyv)[kN],
                                           const Pack<T, kVec> (&xv)[kN],
                                           const Pack<W, kVec> (&w)[kN], float& dot) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    if (acc.Valid(i)) {
      float sum = 0.0f;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        sum += ToFloat(dyv[i].v[k]) * WeightAt(a.weight, w[i].v[k], a.zero_centered) *
               ToFloat(xv[i].v[k]);
      }
      dot += sum;
    }
  }
}

// dx = GradInput(dy * w_eff, x, rstd, coefficient) (+ dh when a.dh is given) of one pack; with
// dw (a long row's dw_partial sums), also dw = (from_zero ? 0 : dw) + dy * x * rstd.
template <typename T, typename W, int kVec>
__device__ __forceinline__ Pack<T, kVec> GradInputPack(
    const BwdArgs<T, W>& a, const Pack<T, kVec>& dyv, const Pack<T, kVec>& xv,
    const Pack<W, kVec>& w, const Pack<T, kVec>& dhv, float rstd, float coefficient,
    Pack<float, kVec>* dw = nullptr, bool from_zero = false) {
  Pack<T, kVec> out;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const float dy = ToFloat(dyv.v[k]);
    const float x = ToFloat(xv.v[k]);
    const float g = dy * WeightAt(a.weight, w.v[k], a.zero_centered);
    float dx = GradInput(g, x, rstd, coefficient);
    if (a.dh != nullptr) dx += ToFloat(dhv.v[k]);
    out.v[k] = FromFloat<T>(dx);
    if (dw != nullptr) dw->v[k] = (from_zero ? 0.0f : dw->v[k]) + dy * x * rstd;
  }
  return out;
}

template <typename T, int kVec, int kN>
__device__ __forceinline__ void ForgetValues(Pack<T, kVec> (&packs)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) ForgetValue(packs[i]);
}

// ---------------------------------------------------------------------------------------------
// Forward.
//
// Cached designs (warp-per-row and block-per-row share this row loop): pass 1 loads the thread's
// part of the row into registers (add_rms_norm: loads x and residual, rounds h = x + residual to
// T, stores h) and sums squares; after the group sum, pass 2 writes y from registers. The weight
// of the thread's columns is loaded once, before the row loop.
template <bool kAdd, int kVec, typename T, typename W, typename Group>
__device__ __forceinline__ void FwdCachedRows(const FwdArgs<T, W>& a, const RowGroups& g,
                                              Group& reducer) {
  constexpr int kIters = kCachedAccesses<kVec>;
  const OwnedColumns cols = OwnColumns<kVec, kIters>(a.hidden, g);
  const RowRange range = GridStrideRows(a.rows, g.count);
  const bool use_rstd_in = !kAdd && a.rstd_in != nullptr;
  Pack<W, kVec> w[kIters];
  LoadWeight(a.weight, cols.first, OwnedAccesses{cols.stride, cols.count}, w);

  for (int64_t base = range.begin; base < range.end; base += range.stride) {
    const int64_t row = base + g.index;
    const bool active = row < range.end;
    const OwnedAccesses acc{cols.stride, active ? cols.count : 0};
    const int64_t row_offset = (active ? row : 0) * a.hidden + cols.first;

    Pack<T, kVec> hv[kIters];  // The normalized input: x, or h for add_rms_norm.
    LoadFwdInput<kAdd>(a, row_offset, acc, hv);
    float rstd;
    if (use_rstd_in) {
      rstd = active ? a.rstd_in[row] : 0.0f;
    } else {
      float sum_squares = 0.0f;
      AddSquares(hv, acc, sum_squares);
      rstd = Rstd(reducer.Sum(sum_squares), a.hidden, a.eps);
    }
    if (active && g.rank == 0) a.rstd[row] = rstd;

#pragma unroll
    for (int i = 0; i < kIters; ++i) {  // Keep the caches packed: see ForgetValue.
      ForgetValue(hv[i]);
      ForgetValue(w[i]);
    }
    StoreNormalized(a, row_offset, acc, hv, w, rstd);
  }
}

// Warp-per-row forward (rows <= 2 KiB): `lanes` lanes per row, kWarpCtaThreads / lanes rows per
// CTA step, shuffle-only row sums.
template <bool kAdd, int kVec, typename T, typename W>
__global__ void __launch_bounds__(kWarpCtaThreads)
    RmsNormFwdWarpKernel(FwdArgs<T, W> a, int lanes) {
  WarpRowGroup reducer(lanes);
  FwdCachedRows<kAdd, kVec>(a, CtaRowGroups(lanes), reducer);
}

// Block-per-row forward (rows <= 32 KiB): `group_threads` (a multiple of 32) threads per row,
// blockDim.x / group_threads rows per CTA step, shared-memory row sums.
template <bool kAdd, int kVec, typename T, typename W>
__global__ void __launch_bounds__(kMaxGroupThreads)
    RmsNormFwdBlockKernel(FwdArgs<T, W> a, int group_threads) {
  BlockRowGroup reducer = CtaBlockRowGroup(group_threads / kWarpSize);
  FwdCachedRows<kAdd, kVec>(a, CtaRowGroups(group_threads), reducer);
}

// Long-row forward (rows > 32 KiB): one row per CTA, looping over the row in chunks of
// kLongRowUnroll accesses per thread. Pass 1 reads x (add_rms_norm: x and residual, writing h)
// for the sum of squares; pass 2 re-reads x (or h, which this same thread wrote) from L2.
template <bool kAdd, int kVec, typename T, typename W>
__global__ void __launch_bounds__(kFwdLongRowThreads) RmsNormFwdLongRowKernel(FwdArgs<T, W> a) {
  constexpr int kUnroll = kLongRowUnroll;
  BlockRowGroup reducer = CtaBlockRowGroup(static_cast<int>(blockDim.x) / kWarpSize);
  const int64_t vecs = a.hidden / kVec;
  const T* in = kAdd ? a.h : a.x;  // What pass 2 normalizes.
  const bool use_rstd_in = !kAdd && a.rstd_in != nullptr;

  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t row_offset = row * a.hidden;
    float rstd;
    if (use_rstd_in) {
      rstd = a.rstd_in[row];
    } else {
      float sum_squares = 0.0f;
      ForEachChunk<kVec>(vecs, [&](const auto& acc) {
        Pack<T, kVec> hv[kUnroll];
        LoadFwdInput<kAdd>(a, row_offset, acc, hv);
        AddSquares(hv, acc, sum_squares);
      });
      rstd = Rstd(reducer.Sum(sum_squares), a.hidden, a.eps);
    }
    if (threadIdx.x == 0) a.rstd[row] = rstd;

    ForEachChunk<kVec>(vecs, [&](const auto& acc) {
      Pack<T, kVec> hv[kUnroll];
      Pack<W, kVec> w[kUnroll];
      LoadPacks(in + row_offset, acc, hv);
      LoadWeight(a.weight, 0, acc, w);
      StoreNormalized(a, row_offset, acc, hv, w, rstd);
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Backward.
//
// Cached designs (warp-per-row and block-per-row share this row loop): per row, pass 1 loads x
// and dy into registers, adds dy * x * rstd into the thread's dw accumulators and sums
// (dy * w_eff) * x for dot (or takes dot_in); after the group sum, pass 2 loads dh and writes
// dx = GradInput(...) (+ dh) from registers.
//
// dw accumulators: with a weight the grid is exactly `parts` CTAs and dw_acc, a [groups, hidden]
// float array in dynamic shared memory, holds one row of sums per row group; each element is only
// ever touched by the one thread that owns its column in that group (so no barrier is needed
// while rows run, and the per-column order is the row order of the group). Shared memory rather
// than registers keeps the row cache, the weight and the accumulators from spilling. At the end
// the groups are added in order 0, 1, ... into dw_partial[p, :]; a part without rows writes zeros.
template <int kVec, typename T, typename W, typename Group>
__device__ __forceinline__ void BwdCachedRows(const BwdArgs<T, W>& a, const RowGroups& g,
                                              Group& reducer, float* dw_acc) {
  constexpr int kIters = kCachedAccesses<kVec>;
  const OwnedColumns cols = OwnColumns<kVec, kIters>(a.hidden, g);
  const OwnedAccesses owned{cols.stride, cols.count};
  const bool has_dw = a.dw_partial != nullptr;
  const RowRange range =
      has_dw ? PartRows(a.rows, a.parts, g.count) : GridStrideRows(a.rows, g.count);
  Pack<W, kVec> w[kIters];
  LoadWeight(a.weight, cols.first, owned, w);
  float* my_acc = has_dw ? dw_acc + static_cast<int64_t>(g.index) * a.hidden + cols.first : nullptr;
  if (has_dw) {
    Pack<float, kVec> zeros;
#pragma unroll
    for (int k = 0; k < kVec; ++k) zeros.v[k] = 0.0f;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      if (owned.Valid(i)) StorePack(my_acc + owned.Offset(i), zeros);
    }
  }

  for (int64_t base = range.begin; base < range.end; base += range.stride) {
    const int64_t row = base + g.index;
    const bool active = row < range.end;
    const OwnedAccesses acc{cols.stride, active ? cols.count : 0};
    const int64_t row_offset = (active ? row : 0) * a.hidden + cols.first;

#pragma unroll
    for (int i = 0; i < kIters; ++i) ForgetValue(w[i]);  // Not hoisted as fp32: see ForgetValue.
    Pack<T, kVec> xv[kIters];
    Pack<T, kVec> dyv[kIters];
    LoadPackPairs(a.x + row_offset, a.dy + row_offset, acc, xv, dyv);
    const float rstd = active ? a.rstd[row] : 0.0f;

    if (has_dw) {
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        if (acc.Valid(i)) {
          Pack<float, kVec> sums;
          LoadPack(my_acc + acc.Offset(i), sums);
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            sums.v[k] += ToFloat(dyv[i].v[k]) * ToFloat(xv[i].v[k]) * rstd;
          }
          StorePack(my_acc + acc.Offset(i), sums);
        }
      }
    }

    float dot;
    if (a.dot_in != nullptr) {
      dot = active ? a.dot_in[row] : 0.0f;
    } else {
      float partial = 0.0f;
      AddGradDot(a, acc, dyv, xv, w, partial);
      dot = reducer.Sum(partial);
    }
    const float coefficient = BackwardCoefficient(dot, rstd, a.hidden);
#pragma unroll
    for (int i = 0; i < kIters; ++i) {  // Keep the caches packed: see ForgetValue.
      ForgetValue(xv[i]);
      ForgetValue(dyv[i]);
      ForgetValue(w[i]);
    }

    Pack<T, kVec> dhv[kIters];
    if (a.dh != nullptr) LoadPacks(a.dh + row_offset, acc, dhv);
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      if (acc.Valid(i)) {
        StorePack(a.dx + row_offset + acc.Offset(i),
                  GradInputPack(a, dyv[i], xv[i], w[i], dhv[i], rstd, coefficient));
      }
    }
  }

  if (!has_dw) return;
  float* dw_row = a.dw_partial + static_cast<int64_t>(blockIdx.x) * a.hidden;
  if (g.count == 1) {
    // Each thread copies the columns it accumulated itself: no barrier needed.
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      if (owned.Valid(i)) {
        Pack<float, kVec> sums;
        LoadPack(my_acc + owned.Offset(i), sums);
        StorePack(dw_row + cols.first + owned.Offset(i), sums);
      }
    }
    return;
  }
  __syncthreads();
  for (int64_t col = threadIdx.x; col < a.hidden; col += blockDim.x) {
    float sum = 0.0f;
    for (int i = 0; i < g.count; ++i) sum += dw_acc[static_cast<int64_t>(i) * a.hidden + col];
    dw_row[col] = sum;
  }
}

// Warp-per-row backward (rows <= 2 KiB): `lanes` lanes per row, shuffle-only row sums.
template <int kVec, typename T, typename W>
__global__ void __launch_bounds__(kWarpCtaThreads)
    RmsNormBwdWarpKernel(BwdArgs<T, W> a, int lanes) {
  extern __shared__ float4 dw_acc_storage[];
  WarpRowGroup reducer(lanes);
  BwdCachedRows<kVec>(a, CtaRowGroups(lanes), reducer, reinterpret_cast<float*>(dw_acc_storage));
}

// Block-per-row backward (rows <= 32 KiB): `group_threads` threads (whole warps) per row,
// shared-memory row sums.
template <int kVec, typename T, typename W>
__global__ void __launch_bounds__(kMaxGroupThreads, 1)
    RmsNormBwdBlockKernel(BwdArgs<T, W> a, int group_threads) {
  extern __shared__ float4 dw_acc_storage[];
  BlockRowGroup reducer = CtaBlockRowGroup(group_threads / kWarpSize);
  BwdCachedRows<kVec>(a, CtaRowGroups(group_threads), reducer,
                      reinterpret_cast<float*>(dw_acc_storage));
}

// Long-row backward (rows > 32 KiB): one row per CTA step. Pass 1 reads x, dy and the weight for
// dot (skipped with dot_in); pass 2 re-reads them from L2, writes dx and, with a weight, adds
// dy * x * rstd into dw_partial[p, :] in place (each column always belongs to the same thread,
// rows in order, so the sums stay deterministic; the part's first row stores instead of adding).
template <int kVec, typename T, typename W>
__global__ void __launch_bounds__(kBwdLongRowThreads) RmsNormBwdLongRowKernel(BwdArgs<T, W> a) {
  constexpr int kUnroll = kLongRowUnroll;
  BlockRowGroup reducer = CtaBlockRowGroup(static_cast<int>(blockDim.x) / kWarpSize);
  const int64_t vecs = a.hidden / kVec;
  const bool has_dw = a.dw_partial != nullptr;
  const RowRange range = has_dw ? PartRows(a.rows, a.parts, 1) : GridStrideRows(a.rows, 1);
  float* dw_row = has_dw ? a.dw_partial + static_cast<int64_t>(blockIdx.x) * a.hidden : nullptr;

  for (int64_t row = range.begin; row < range.end; row += range.stride) {
    const int64_t row_offset = row * a.hidden;
    const float rstd = a.rstd[row];
    float dot;
    if (a.dot_in != nullptr) {
      dot = a.dot_in[row];
    } else {
      float partial = 0.0f;
      ForEachChunk<kVec>(vecs, [&](const auto& acc) {
        Pack<T, kVec> xv[kUnroll];
        Pack<T, kVec> dyv[kUnroll];
        Pack<W, kVec> w[kUnroll];
        LoadPackPairs(a.x + row_offset, a.dy + row_offset, acc, xv, dyv);
        LoadWeight(a.weight, 0, acc, w);
        AddGradDot(a, acc, dyv, xv, w, partial);
      });
      dot = reducer.Sum(partial);
    }
    const float coefficient = BackwardCoefficient(dot, rstd, a.hidden);
    const bool first_row = row == range.begin;

    ForEachChunk<kVec>(vecs, [&](const auto& acc) {
      Pack<T, kVec> xv[kUnroll];
      Pack<T, kVec> dyv[kUnroll];
      Pack<T, kVec> dhv[kUnroll];
      Pack<W, kVec> w[kUnroll];
      Pack<float, kVec> dw[kUnroll];
      LoadPackPairs(a.x + row_offset, a.dy + row_offset, acc, xv, dyv);
      if (a.dh != nullptr) LoadPacks(a.dh + row_offset, acc, dhv);
      LoadWeight(a.weight, 0, acc, w);
      if (has_dw && !first_row) LoadPacks(dw_row, acc, dw);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (acc.Valid(u)) {
          StorePack(a.dx + row_offset + acc.Offset(u),
                    GradInputPack(a, dyv[u], xv[u], w[u], dhv[u], rstd, coefficient,
                                  has_dw ? &dw[u] : nullptr, first_row));
          if (has_dw) StorePack(dw_row + acc.Offset(u), dw[u]);
        }
      }
    });
  }

  // A part without rows still owes its (zero) row of dw_partial.
  if (has_dw && range.begin == range.end) {
    for (int64_t col = threadIdx.x; col < a.hidden; col += blockDim.x) dw_row[col] = 0.0f;
  }
}

// dw[j] = sum over p = 0, 1, ..., parts - 1 (in that order) of dw_partial[p, j]. One thread per
// column (coalesced across the warp); the sequential order leaves little parallelism, so each
// thread keeps kSumPartsUnroll loads in flight (dw_partial was just written and sits in L2) while
// the adds stay in order.
__global__ void __launch_bounds__(kSumPartsThreads)
    RmsNormSumPartsKernel(const float* dw_partial, float* dw, int64_t parts, int64_t hidden) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; col < hidden;
       col += stride) {
    float sum = 0.0f;
    int64_t p = 0;
    for (; p + kSumPartsUnroll <= parts; p += kSumPartsUnroll) {
      float v[kSumPartsUnroll];
#pragma unroll
      for (int u = 0; u < kSumPartsUnroll; ++u) v[u] = dw_partial[(p + u) * hidden + col];
#pragma unroll
      for (int u = 0; u < kSumPartsUnroll; ++u) sum += v[u];
    }
#pragma unroll 4
    for (; p < parts; ++p) sum += dw_partial[p * hidden + col];
    dw[col] = sum;
  }
}

}  // namespace jaxops::rms_norm

#endif  // JAXOPS_XLA_FFI_RMS_NORM_KERNELS_CUH_
