// CUDA handlers of the RMSNorm family: rms_norm forward, fused residual add + rms_norm forward,
// and the backward pass. The math lives in rms_norm.h and the contracts in checks.h.
//
// Three layers, as in jax's examples/ffi:
//   1. Templated kernels over T (x's dtype), W (the weight's dtype) and kVec (elements per
//      memory access: 16 bytes of T, or 1 for the scalar fallback).
//   2. Typed implementations (RmsNormFwdTyped<kAdd, T, W>, RmsNormBwdTyped<T, W>) that pick a
//      design for the row length, launch on the XLA stream and turn launch failures into errors.
//   3. One dispatch per handler: validates with checks.h, then DispatchFloatTypes turns the
//      runtime dtypes of x and the weight into T and W (the only switch on dtypes).
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
// Memory access is 16 bytes per load/store (8 x bfloat16 / float16, 4 x float32) when hidden is a
// multiple of that and every base pointer is 16-byte aligned; otherwise the same kernels run with
// one element per access. Row offsets are int64_t and rows are visited with grid-stride loops, so
// tensors beyond 2^31 elements and any number of rows work with a capped grid.
//
// dw is deterministic: the backward kernel with a weight runs exactly `parts` CTAs; CTA p owns
// rows [PartBegin(p), PartBegin(p + 1)), adds dy * x * rstd per column in a fixed order (each
// column of each row group belongs to one thread; the CTA's groups are combined in group order)
// and writes dw_partial[p, :]. RmsNormSumPartsKernel then adds the parts in order p = 0, 1, ...
// per column. No atomics, so equal inputs give equal bits on every run.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla_ffi/common/cuda_util.cuh"
#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/common/math.h"
#include "xla_ffi/rms_norm/checks.h"
#include "xla_ffi/rms_norm/handlers.h"
#include "xla_ffi/rms_norm/rms_norm.h"

namespace jaxops::rms_norm {
namespace {

// ---------------------------------------------------------------------------------------------
// Launch geometry.

// Elements per 16-byte access.
template <typename T>
constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));

// Accesses per thread that the warp- and block-per-row designs cache in registers: four 16-byte
// accesses (64 bytes of each row tensor), or eight elements on the scalar path.
template <int kVec>
constexpr int kCachedAccesses = kVec > 1 ? 4 : 8;

constexpr int kWarpCtaThreads = 256;      // CTA size of the warp-per-row kernels.
constexpr int kMaxGroupThreads = 512;     // Largest row group of the block-per-row kernels.
constexpr int kBlockCtaTarget = 256;      // Short rows are packed into CTAs of this many threads.
constexpr int kFwdLongRowThreads = 1024;  // CTA (= row group) size of the long-row kernels; the
constexpr int kBwdLongRowThreads = 512;   //   backward keeps five tensors in flight per access.
constexpr int kLongRowUnroll = 2;         // Accesses in flight per thread per long-row chunk.
constexpr int kSumPartsThreads = 64;      // CTA size of the dw part reduction (small CTAs spread
                                          //   its few threads, one per column, over more SMs).
constexpr int kSumPartsUnroll = 32;       // Parts loaded ahead per column in that reduction.
constexpr int kMaxWarpsPerCta = 1024 / kWarpSize;
// Grid cap; the kernels loop over rows (grid-stride), so the cap only bounds the launch.
constexpr int64_t kMaxGridCtas = int64_t{1} << 20;
// Dynamic shared memory a kernel may use without opting in.
constexpr size_t kDefaultSharedBytes = 48 * 1024;

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
// Device building blocks.

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

template <typename W>
__device__ __forceinline__ float WeightAt(const W* weight, const W& w, bool zero_centered) {
  return weight != nullptr ? EffectiveWeight(ToFloat(w), zero_centered) : 1.0f;
}

// sum_k dy[k] * w_eff[k] * x[k] over one pack: a pack's share of the backward's row dot product.
template <typename T, typename W, int kVec>
__device__ __forceinline__ float PackGradDot(const Pack<T, kVec>& dy, const Pack<T, kVec>& x,
                                             const Pack<W, kVec>& w, const W* weight,
                                             bool zero_centered) {
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    sum += ToFloat(dy.v[k]) * WeightAt(weight, w.v[k], zero_centered) * ToFloat(x.v[k]);
  }
  return sum;
}

// The columns a thread owns in the cached designs, the same for every row it visits: access i
// (0 <= i < count <= kIters) covers elements [first + i * stride, + kVec). Cached rows are at most
// kBlockRowMaxHidden (16384) elements, so these in-row offsets are int; row offsets are int64_t.
struct OwnedColumns {
  int first;
  int stride;
  int count;
};

template <int kVec, int kIters>
__device__ __forceinline__ OwnedColumns OwnColumns(int64_t hidden, int rank, int group_size) {
  const int n = static_cast<int>(hidden);
  const int first = rank * kVec;
  const int stride = group_size * kVec;
  const int count = first < n ? min(kIters, (n - first + stride - 1) / stride) : 0;
  return {first, stride, count};
}

template <int kVec, int kIters, typename W>
__device__ __forceinline__ void LoadOwnedWeight(const W* weight, const OwnedColumns& cols,
                                                Pack<W, kVec> (&w)[kIters]) {
  if (weight == nullptr) return;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    if (i < cols.count) LoadPack(weight + cols.first + i * cols.stride, w[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward, cached designs (warp-per-row and block-per-row share this row loop).
//
// Pass 1 loads the thread's part of the row into registers (add_rms_norm: loads x and residual,
// rounds h = x + residual to T, stores h) and sums squares; after the group sum, pass 2 writes y
// from registers. All loads of a pass are issued before any store so they are in flight together.
// The weight of the thread's columns is loaded once, before the row loop.
template <bool kAdd, int kVec, int kIters, typename T, typename W, typename Group>
__device__ __forceinline__ void FwdCachedRows(const FwdArgs<T, W>& a, RowRange range, int group,
                                              int rank, int group_size, Group& reducer) {
  const OwnedColumns cols = OwnColumns<kVec, kIters>(a.hidden, rank, group_size);
  const bool use_rstd_in = !kAdd && a.rstd_in != nullptr;
  Pack<W, kVec> w[kIters];
  LoadOwnedWeight(a.weight, cols, w);

  for (int64_t base = range.begin; base < range.end; base += range.stride) {
    const int64_t row = base + group;
    const bool active = row < range.end;
    const int count = active ? cols.count : 0;
    const int64_t row_offset = (active ? row : 0) * a.hidden + cols.first;

    Pack<T, kVec> hv[kIters];  // The normalized input: x, or h for add_rms_norm.
    if constexpr (kAdd) {
      Pack<T, kVec> rv[kIters];
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        if (i < count) {
          LoadPack(a.x + row_offset + i * cols.stride, hv[i]);
          LoadPack(a.residual + row_offset + i * cols.stride, rv[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        if (i < count) {
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            hv[i].v[k] = FromFloat<T>(ToFloat(hv[i].v[k]) + ToFloat(rv[i].v[k]));
          }
          StorePack(a.h + row_offset + i * cols.stride, hv[i]);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        if (i < count) LoadPack(a.x + row_offset + i * cols.stride, hv[i]);
      }
    }

    float rstd;
    if (use_rstd_in) {
      rstd = active ? a.rstd_in[row] : 0.0f;
    } else {
      float sum_squares = 0.0f;
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        if (i < count) {
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            const float f = ToFloat(hv[i].v[k]);
            sum_squares += f * f;
          }
        }
      }
      rstd = Rstd(reducer.Sum(sum_squares), a.hidden, a.eps);
    }
    if (active && rank == 0) a.rstd[row] = rstd;

#pragma unroll
    for (int i = 0; i < kIters; ++i) {  // Keep the caches packed: see ForgetValue.
      ForgetValue(hv[i]);
      ForgetValue(w[i]);
    }
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      if (i < count) {
        Pack<T, kVec> out;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float w_eff = WeightAt(a.weight, w[i].v[k], a.zero_centered);
          out.v[k] = FromFloat<T>(Normalize(ToFloat(hv[i].v[k]), rstd, w_eff));
        }
        StorePack(a.y + row_offset + i * cols.stride, out);
      }
    }
  }
}

// Warp-per-row forward (rows <= 2 KiB): `lanes` lanes per row, kWarpCtaThreads / lanes rows per
// CTA step, shuffle-only row sums.
template <bool kAdd, int kVec, typename T, typename W>
__global__ void __launch_bounds__(kWarpCtaThreads)
    RmsNormFwdWarpKernel(FwdArgs<T, W> a, int lanes) {
  constexpr int kIters = kCachedAccesses<kVec>;
  WarpRowGroup reducer(lanes);
  const int groups = static_cast<int>(blockDim.x) / lanes;
  FwdCachedRows<kAdd, kVec, kIters>(a, GridStrideRows(a.rows, groups),
                                    static_cast<int>(threadIdx.x) / lanes,
                                    static_cast<int>(threadIdx.x) % lanes, lanes, reducer);
}

// Block-per-row forward (rows <= 32 KiB): `group_threads` (a multiple of 32) threads per row,
// blockDim.x / group_threads rows per CTA step, shared-memory row sums.
template <bool kAdd, int kVec, typename T, typename W>
__global__ void __launch_bounds__(kMaxGroupThreads)
    RmsNormFwdBlockKernel(FwdArgs<T, W> a, int group_threads) {
  constexpr int kIters = kCachedAccesses<kVec>;
  __shared__ float slots[2 * kMaxWarpsPerCta];
  BlockRowGroup reducer(slots, group_threads / kWarpSize);
  const int groups = static_cast<int>(blockDim.x) / group_threads;
  FwdCachedRows<kAdd, kVec, kIters>(
      a, GridStrideRows(a.rows, groups), static_cast<int>(threadIdx.x) / group_threads,
      static_cast<int>(threadIdx.x) % group_threads, group_threads, reducer);
}

// Long-row forward (rows > 32 KiB): one row per CTA, looping over the row in chunks of
// kLongRowUnroll accesses per thread. Pass 1 reads x (add_rms_norm: x and residual, writing h)
// for the sum of squares; pass 2 re-reads x (or h, which this same thread wrote) from L2.
template <bool kAdd, int kVec, typename T, typename W>
__global__ void __launch_bounds__(kFwdLongRowThreads) RmsNormFwdLongRowKernel(FwdArgs<T, W> a) {
  constexpr int kUnroll = kLongRowUnroll;
  __shared__ float slots[2 * kMaxWarpsPerCta];
  BlockRowGroup reducer(slots, static_cast<int>(blockDim.x) / kWarpSize);
  const int64_t vecs = a.hidden / kVec;
  const int64_t chunk = static_cast<int64_t>(blockDim.x) * kUnroll;
  const T* in = kAdd ? a.h : a.x;  // What pass 2 normalizes.
  const bool use_rstd_in = !kAdd && a.rstd_in != nullptr;

  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t row_offset = row * a.hidden;
    float rstd;
    if (use_rstd_in) {
      rstd = a.rstd_in[row];
    } else {
      float sum_squares = 0.0f;
      for (int64_t v0 = threadIdx.x; v0 < vecs; v0 += chunk) {
        Pack<T, kVec> hv[kUnroll];
        if constexpr (kAdd) {
          Pack<T, kVec> rv[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t v = v0 + static_cast<int64_t>(u) * blockDim.x;
            if (v < vecs) {
              LoadPack(a.x + row_offset + v * kVec, hv[u]);
              LoadPack(a.residual + row_offset + v * kVec, rv[u]);
            }
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t v = v0 + static_cast<int64_t>(u) * blockDim.x;
            if (v < vecs) {
#pragma unroll
              for (int k = 0; k < kVec; ++k) {
                hv[u].v[k] = FromFloat<T>(ToFloat(hv[u].v[k]) + ToFloat(rv[u].v[k]));
              }
              StorePack(a.h + row_offset + v * kVec, hv[u]);
            }
          }
        } else {
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t v = v0 + static_cast<int64_t>(u) * blockDim.x;
            if (v < vecs) LoadPack(a.x + row_offset + v * kVec, hv[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + static_cast<int64_t>(u) * blockDim.x;
          if (v < vecs) {
#pragma unroll
            for (int k = 0; k < kVec; ++k) {
              const float f = ToFloat(hv[u].v[k]);
              sum_squares += f * f;
            }
          }
        }
      }
      rstd = Rstd(reducer.Sum(sum_squares), a.hidden, a.eps);
    }
    if (threadIdx.x == 0) a.rstd[row] = rstd;

    for (int64_t v0 = threadIdx.x; v0 < vecs; v0 += chunk) {
      Pack<T, kVec> hv[kUnroll];
      Pack<W, kVec> w[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + static_cast<int64_t>(u) * blockDim.x;
        if (v < vecs) {
          LoadPack(in + row_offset + v * kVec, hv[u]);
          if (a.weight != nullptr) LoadPack(a.weight + v * kVec, w[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + static_cast<int64_t>(u) * blockDim.x;
        if (v < vecs) {
          Pack<T, kVec> out;
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            const float w_eff = WeightAt(a.weight, w[u].v[k], a.zero_centered);
            out.v[k] = FromFloat<T>(Normalize(ToFloat(hv[u].v[k]), rstd, w_eff));
          }
          StorePack(a.y + row_offset + v * kVec, out);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, cached designs (warp-per-row and block-per-row share this row loop).
//
// Per row, pass 1 loads x and dy into registers, adds dy * x * rstd into the thread's dw
// accumulators and sums (dy * w_eff) * x for dot (or takes dot_in); after the group sum, pass 2
// loads dh and writes dx = GradInput(...) (+ dh) from registers.
//
// dw accumulators: with a weight the grid is exactly `parts` CTAs and dw_acc, a [groups, hidden]
// float array in dynamic shared memory, holds one row of sums per row group; each element is only
// ever touched by the one thread that owns its column in that group (so no barrier is needed
// while rows run, and the per-column order is the row order of the group). Shared memory rather
// than registers keeps the row cache, the weight and the accumulators from spilling. At the end
// the groups are added in order 0, 1, ... into dw_partial[p, :]; a part without rows writes zeros.
template <int kVec, int kIters, typename T, typename W, typename Group>
__device__ __forceinline__ void BwdCachedRows(const BwdArgs<T, W>& a, int groups, int group,
                                              int rank, int group_size, Group& reducer,
                                              float* dw_acc) {
  const OwnedColumns cols = OwnColumns<kVec, kIters>(a.hidden, rank, group_size);
  const bool has_dw = a.dw_partial != nullptr;
  const RowRange range =
      has_dw ? PartRows(a.rows, a.parts, groups) : GridStrideRows(a.rows, groups);
  Pack<W, kVec> w[kIters];
  LoadOwnedWeight(a.weight, cols, w);
  float* my_acc = has_dw ? dw_acc + static_cast<int64_t>(group) * a.hidden + cols.first : nullptr;
  if (has_dw) {
    Pack<float, kVec> zeros;
#pragma unroll
    for (int k = 0; k < kVec; ++k) zeros.v[k] = 0.0f;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      if (i < cols.count) StorePack(my_acc + i * cols.stride, zeros);
    }
  }

  for (int64_t base = range.begin; base < range.end; base += range.stride) {
    const int64_t row = base + group;
    const bool active = row < range.end;
    const int count = active ? cols.count : 0;
    const int64_t row_offset = (active ? row : 0) * a.hidden + cols.first;

#pragma unroll
    for (int i = 0; i < kIters; ++i) ForgetValue(w[i]);  // Not hoisted as fp32: see ForgetValue.
    Pack<T, kVec> xv[kIters];
    Pack<T, kVec> dyv[kIters];
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      if (i < count) {
        LoadPack(a.x + row_offset + i * cols.stride, xv[i]);
        LoadPack(a.dy + row_offset + i * cols.stride, dyv[i]);
      }
    }
    const float rstd = active ? a.rstd[row] : 0.0f;

    if (has_dw) {
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        if (i < count) {
          Pack<float, kVec> acc;
          LoadPack(my_acc + i * cols.stride, acc);
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            acc.v[k] += ToFloat(dyv[i].v[k]) * ToFloat(xv[i].v[k]) * rstd;
          }
          StorePack(my_acc + i * cols.stride, acc);
        }
      }
    }

    float dot;
    if (a.dot_in != nullptr) {
      dot = active ? a.dot_in[row] : 0.0f;
    } else {
      float partial = 0.0f;
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        if (i < count) {
          partial += PackGradDot(dyv[i], xv[i], w[i], a.weight, a.zero_centered);
        }
      }
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
    if (a.dh != nullptr) {
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        if (i < count) LoadPack(a.dh + row_offset + i * cols.stride, dhv[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      if (i < count) {
        Pack<T, kVec> out;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float g = ToFloat(dyv[i].v[k]) * WeightAt(a.weight, w[i].v[k], a.zero_centered);
          float dx = GradInput(g, ToFloat(xv[i].v[k]), rstd, coefficient);
          if (a.dh != nullptr) dx += ToFloat(dhv[i].v[k]);
          out.v[k] = FromFloat<T>(dx);
        }
        StorePack(a.dx + row_offset + i * cols.stride, out);
      }
    }
  }

  if (!has_dw) return;
  float* dw_row = a.dw_partial + static_cast<int64_t>(blockIdx.x) * a.hidden;
  if (groups == 1) {
    // Each thread copies the columns it accumulated itself: no barrier needed.
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      if (i < cols.count) {
        Pack<float, kVec> acc;
        LoadPack(my_acc + i * cols.stride, acc);
        StorePack(dw_row + cols.first + i * cols.stride, acc);
      }
    }
    return;
  }
  __syncthreads();
  for (int64_t col = threadIdx.x; col < a.hidden; col += blockDim.x) {
    float sum = 0.0f;
    for (int g = 0; g < groups; ++g) sum += dw_acc[static_cast<int64_t>(g) * a.hidden + col];
    dw_row[col] = sum;
  }
}

// Dynamic shared memory of the cached backward kernels: dw_acc [groups, hidden] floats when there
// is a weight. A group covers at most group_size * kIters * kVec columns, so this is at most
// (CTA threads) * kIters * kVec floats: 32 KiB for the warp kernel and for block CTAs of several
// rows, 64 KiB for a single row of 16384 (the launcher opts in above 48 KiB).
size_t BwdSharedBytes(bool has_dw, int groups, int64_t hidden) {
  return has_dw ? sizeof(float) * static_cast<size_t>(groups) * static_cast<size_t>(hidden) : 0;
}

// Warp-per-row backward (rows <= 2 KiB): `lanes` lanes per row, shuffle-only row sums.
template <int kVec, typename T, typename W>
__global__ void __launch_bounds__(kWarpCtaThreads)
    RmsNormBwdWarpKernel(BwdArgs<T, W> a, int lanes) {
  constexpr int kIters = kCachedAccesses<kVec>;
  extern __shared__ float4 dw_acc_storage[];
  WarpRowGroup reducer(lanes);
  BwdCachedRows<kVec, kIters>(a, static_cast<int>(blockDim.x) / lanes,
                              static_cast<int>(threadIdx.x) / lanes,
                              static_cast<int>(threadIdx.x) % lanes, lanes, reducer,
                              reinterpret_cast<float*>(dw_acc_storage));
}

// Block-per-row backward (rows <= 32 KiB): `group_threads` threads (whole warps) per row,
// shared-memory row sums.
template <int kVec, typename T, typename W>
__global__ void __launch_bounds__(kMaxGroupThreads, 1)
    RmsNormBwdBlockKernel(BwdArgs<T, W> a, int group_threads) {
  constexpr int kIters = kCachedAccesses<kVec>;
  extern __shared__ float4 dw_acc_storage[];
  __shared__ float slots[2 * kMaxWarpsPerCta];
  BlockRowGroup reducer(slots, group_threads / kWarpSize);
  BwdCachedRows<kVec, kIters>(a, static_cast<int>(blockDim.x) / group_threads,
                              static_cast<int>(threadIdx.x) / group_threads,
                              static_cast<int>(threadIdx.x) % group_threads, group_threads, reducer,
                              reinterpret_cast<float*>(dw_acc_storage));
}

// Long-row backward (rows > 32 KiB): one row per CTA step. Pass 1 reads x, dy and the weight for
// dot (skipped with dot_in); pass 2 re-reads them from L2, writes dx and, with a weight, adds
// dy * x * rstd into dw_partial[p, :] in place (each column always belongs to the same thread,
// rows in order, so the sums stay deterministic; the part's first row stores instead of adding).
template <int kVec, typename T, typename W>
__global__ void __launch_bounds__(kBwdLongRowThreads) RmsNormBwdLongRowKernel(BwdArgs<T, W> a) {
  constexpr int kUnroll = kLongRowUnroll;
  __shared__ float slots[2 * kMaxWarpsPerCta];
  BlockRowGroup reducer(slots, static_cast<int>(blockDim.x) / kWarpSize);
  const int64_t vecs = a.hidden / kVec;
  const int64_t chunk = static_cast<int64_t>(blockDim.x) * kUnroll;
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
      for (int64_t v0 = threadIdx.x; v0 < vecs; v0 += chunk) {
        Pack<T, kVec> xv[kUnroll];
        Pack<T, kVec> dyv[kUnroll];
        Pack<W, kVec> w[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + static_cast<int64_t>(u) * blockDim.x;
          if (v < vecs) {
            LoadPack(a.x + row_offset + v * kVec, xv[u]);
            LoadPack(a.dy + row_offset + v * kVec, dyv[u]);
            if (a.weight != nullptr) LoadPack(a.weight + v * kVec, w[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + static_cast<int64_t>(u) * blockDim.x;
          if (v < vecs) {
            partial += PackGradDot(dyv[u], xv[u], w[u], a.weight, a.zero_centered);
          }
        }
      }
      dot = reducer.Sum(partial);
    }
    const float coefficient = BackwardCoefficient(dot, rstd, a.hidden);
    const bool first_row = row == range.begin;

    for (int64_t v0 = threadIdx.x; v0 < vecs; v0 += chunk) {
      Pack<T, kVec> xv[kUnroll];
      Pack<T, kVec> dyv[kUnroll];
      Pack<T, kVec> dhv[kUnroll];
      Pack<W, kVec> w[kUnroll];
      Pack<float, kVec> dw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + static_cast<int64_t>(u) * blockDim.x;
        if (v < vecs) {
          LoadPack(a.x + row_offset + v * kVec, xv[u]);
          LoadPack(a.dy + row_offset + v * kVec, dyv[u]);
          if (a.dh != nullptr) LoadPack(a.dh + row_offset + v * kVec, dhv[u]);
          if (a.weight != nullptr) LoadPack(a.weight + v * kVec, w[u]);
          if (has_dw && !first_row) LoadPack(dw_row + v * kVec, dw[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + static_cast<int64_t>(u) * blockDim.x;
        if (v < vecs) {
          Pack<T, kVec> out;
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            const float dy = ToFloat(dyv[u].v[k]);
            const float x = ToFloat(xv[u].v[k]);
            const float g = dy * WeightAt(a.weight, w[u].v[k], a.zero_centered);
            float dx = GradInput(g, x, rstd, coefficient);
            if (a.dh != nullptr) dx += ToFloat(dhv[u].v[k]);
            out.v[k] = FromFloat<T>(dx);
            if (has_dw) dw[u].v[k] = (first_row ? 0.0f : dw[u].v[k]) + dy * x * rstd;
          }
          StorePack(a.dx + row_offset + v * kVec, out);
          if (has_dw) StorePack(dw_row + v * kVec, dw[u]);
        }
      }
    }
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

// ---------------------------------------------------------------------------------------------
// Typed implementations.

int64_t NextPowerOfTwo(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

// Lanes per row of the warp-per-row design: one per access up to a full warp (then each lane
// makes up to kCachedAccesses accesses).
int WarpLanes(int64_t vecs) {
  return static_cast<int>(std::min<int64_t>(kWarpSize, NextPowerOfTwo(vecs)));
}

// Threads per row of the block-per-row design: whole warps, each thread caching <= kIters accesses.
int BlockGroupThreads(int64_t vecs, int iters) {
  const int64_t warps = CeilDiv(CeilDiv(vecs, iters), kWarpSize);
  return static_cast<int>(std::clamp<int64_t>(warps * kWarpSize, kWarpSize, kMaxGroupThreads));
}

int BlockGroups(int group_threads) { return std::max(1, kBlockCtaTarget / group_threads); }

unsigned GridStrideCtas(int64_t rows, int rows_per_cta) {
  return static_cast<unsigned>(std::min(CeilDiv(rows, rows_per_cta), kMaxGridCtas));
}

template <typename T>
bool Vectorizable(int64_t hidden, std::initializer_list<const void*> pointers) {
  if (hidden % kVecElems<T> != 0) return false;
  for (const void* p : pointers) {
    if (!IsAligned(p, 16)) return false;
  }
  return true;
}

template <bool kAdd, int kVec, typename T, typename W>
ffi::Error LaunchFwd(cudaStream_t stream, const FwdArgs<T, W>& a) {
  constexpr int kIters = kCachedAccesses<kVec>;
  const int64_t vecs = a.hidden / kVec;
  if (a.hidden <= kWarpRowMaxHidden<kVec>) {
    const int lanes = WarpLanes(vecs);
    RmsNormFwdWarpKernel<kAdd, kVec, T, W>
        <<<GridStrideCtas(a.rows, kWarpCtaThreads / lanes), kWarpCtaThreads, 0, stream>>>(a, lanes);
  } else if (a.hidden <= kBlockRowMaxHidden<kVec>) {
    const int group_threads = BlockGroupThreads(vecs, kIters);
    const int groups = BlockGroups(group_threads);
    RmsNormFwdBlockKernel<kAdd, kVec, T, W>
        <<<GridStrideCtas(a.rows, groups), groups * group_threads, 0, stream>>>(a, group_threads);
  } else {
    RmsNormFwdLongRowKernel<kAdd, kVec, T, W>
        <<<GridStrideCtas(a.rows, 1), kFwdLongRowThreads, 0, stream>>>(a);
  }
  return LastLaunchError(kAdd ? "add_rms_norm forward kernel" : "rms_norm forward kernel");
}

// Forward of rms_norm (kAdd = false) and add_rms_norm (kAdd = true).
template <bool kAdd, typename T, typename W>
ffi::Error RmsNormFwdTyped(cudaStream_t stream, const FwdArgs<T, W>& a) {
  if (a.rows == 0) return ffi::Error::Success();
  if (Vectorizable<T>(a.hidden, {a.x, a.residual, a.weight, a.y, a.h})) {
    return LaunchFwd<kAdd, kVecElems<T>>(stream, a);
  }
  return LaunchFwd<kAdd, 1>(stream, a);
}

// Launches `kernel` with `shared_bytes` of dynamic shared memory, opting in above the default.
template <typename Kernel, typename... Args>
ffi::Error LaunchWithShared(Kernel kernel, unsigned grid, int block, size_t shared_bytes,
                            cudaStream_t stream, const Args&... args) {
  if (shared_bytes > kDefaultSharedBytes) {
    const cudaError_t status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
    if (status != cudaSuccess) {
      return Internal(std::string("rms_norm backward: cannot reserve ") +
                      std::to_string(shared_bytes) +
                      " bytes of shared memory: " + cudaGetErrorString(status));
    }
  }
  kernel<<<grid, block, shared_bytes, stream>>>(args...);
  return ffi::Error::Success();
}

template <int kVec, typename T, typename W>
ffi::Error LaunchBwd(cudaStream_t stream, const BwdArgs<T, W>& a) {
  constexpr int kIters = kCachedAccesses<kVec>;
  const int64_t vecs = a.hidden / kVec;
  const bool has_dw = a.dw_partial != nullptr;
  // With a weight the grid is exactly one CTA per part (PartRows); otherwise grid-stride.
  auto grid = [&](int rows_per_cta) {
    return has_dw ? static_cast<unsigned>(a.parts) : GridStrideCtas(a.rows, rows_per_cta);
  };
  ffi::Error launched;
  if (a.hidden <= kWarpRowMaxHidden<kVec>) {
    const int lanes = WarpLanes(vecs);
    const int groups = kWarpCtaThreads / lanes;
    launched = LaunchWithShared(RmsNormBwdWarpKernel<kVec, T, W>, grid(groups), kWarpCtaThreads,
                                BwdSharedBytes(has_dw, groups, a.hidden), stream, a, lanes);
  } else if (a.hidden <= kBlockRowMaxHidden<kVec>) {
    const int group_threads = BlockGroupThreads(vecs, kIters);
    const int groups = BlockGroups(group_threads);
    launched =
        LaunchWithShared(RmsNormBwdBlockKernel<kVec, T, W>, grid(groups), groups * group_threads,
                         BwdSharedBytes(has_dw, groups, a.hidden), stream, a, group_threads);
  } else {
    launched = LaunchWithShared(RmsNormBwdLongRowKernel<kVec, T, W>, grid(1), kBwdLongRowThreads, 0,
                                stream, a);
  }
  if (launched.failure()) return launched;
  return LastLaunchError("rms_norm backward kernel");
}

// Backward: dx, and with a weight dw via dw_partial (dw is float32 [hidden] or nullptr).
template <typename T, typename W>
ffi::Error RmsNormBwdTyped(cudaStream_t stream, const BwdArgs<T, W>& a, float* dw) {
  const bool has_dw = a.dw_partial != nullptr;
  if (a.rows == 0) {
    // No rows (no kernel runs), but dw = a sum over no rows = 0 must still be written; the parts
    // are zeroed too so that no output is left undefined.
    if (!has_dw) return ffi::Error::Success();
    const size_t row_bytes = sizeof(float) * static_cast<size_t>(a.hidden);
    cudaError_t status = cudaMemsetAsync(dw, 0, row_bytes, stream);
    if (status == cudaSuccess) {
      status = cudaMemsetAsync(a.dw_partial, 0, row_bytes * static_cast<size_t>(a.parts), stream);
    }
    if (status != cudaSuccess) {
      return Internal(std::string("rms_norm backward: zero-filling dw failed: ") +
                      cudaGetErrorString(status));
    }
    return ffi::Error::Success();
  }
  const bool vectorizable =
      Vectorizable<T>(a.hidden, {a.dy, a.x, a.weight, a.dh, a.dx, a.dw_partial});
  const ffi::Error main =
      vectorizable ? LaunchBwd<kVecElems<T>>(stream, a) : LaunchBwd<1>(stream, a);
  if (main.failure() || !has_dw) return main;
  const unsigned ctas =
      static_cast<unsigned>(std::min(CeilDiv(a.hidden, kSumPartsThreads), kMaxGridCtas));
  RmsNormSumPartsKernel<<<ctas, kSumPartsThreads, 0, stream>>>(a.dw_partial, dw, a.parts, a.hidden);
  return LastLaunchError("rms_norm backward dw reduction kernel");
}

// ---------------------------------------------------------------------------------------------
// Dispatch.

ffi::Error UnsupportedDtype(const char* op, const char* operand, ffi::DataType dtype) {
  return InvalidArgument(std::string(op) + ": unsupported " + operand + " dtype " +
                         DataTypeName(dtype) + "; supported dtypes are float32, bfloat16, float16");
}

// The one place where runtime dtypes become template arguments: calls
// launch(TypeTag<T>{}, TypeTag<W>{}) for x's dtype T and the weight's dtype W, each one of
// float32, bfloat16 or float16.
template <typename Launch>
ffi::Error DispatchFloatTypes(const char* op, ffi::DataType x_dtype, ffi::DataType w_dtype,
                              Launch&& launch) {
  auto with_x = [&](auto x_tag) -> ffi::Error {
    switch (w_dtype) {
      case ffi::DataType::F32:
        return launch(x_tag, TypeTag<float>{});
      case ffi::DataType::BF16:
        return launch(x_tag, TypeTag<__nv_bfloat16>{});
      case ffi::DataType::F16:
        return launch(x_tag, TypeTag<__half>{});
      default:
        return UnsupportedDtype(op, "weight", w_dtype);
    }
  };
  switch (x_dtype) {
    case ffi::DataType::F32:
      return with_x(TypeTag<float>{});
    case ffi::DataType::BF16:
      return with_x(TypeTag<__nv_bfloat16>{});
    case ffi::DataType::F16:
      return with_x(TypeTag<__half>{});
    default:
      return UnsupportedDtype(op, "x", x_dtype);
  }
}

// An absent weight (shape [0]) has no meaningful dtype; dispatch it as x's so it never fails.
ffi::DataType WeightDtype(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight, bool has_weight) {
  return has_weight ? weight.element_type() : x.element_type();
}

// The kernel arguments both forward handlers share.
template <typename T, typename W>
FwdArgs<T, W> MakeFwdArgs(const RowShape& shape, const ffi::AnyBuffer& x,
                          const ffi::AnyBuffer& weight, ffi::Result<ffi::AnyBuffer>& y,
                          ffi::Result<ffi::Buffer<ffi::F32>>& rstd, float eps,
                          bool zero_centered_weight) {
  FwdArgs<T, W> a;
  a.x = static_cast<const T*>(x.untyped_data());
  a.weight = shape.has_weight ? static_cast<const W*>(weight.untyped_data()) : nullptr;
  a.y = static_cast<T*>(y->untyped_data());
  a.rstd = rstd->typed_data();
  a.rows = shape.rows;
  a.hidden = shape.hidden;
  a.eps = eps;
  a.zero_centered = zero_centered_weight;
  return a;
}

ffi::Error RmsNormFwdCudaDispatch(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                                  ffi::Buffer<ffi::F32> rstd_in, ffi::Result<ffi::AnyBuffer> y,
                                  ffi::Result<ffi::Buffer<ffi::F32>> rstd, float eps,
                                  bool zero_centered_weight) {
  const auto shape = CheckForward(x, weight, static_cast<int64_t>(rstd_in.element_count()), *y,
                                  static_cast<int64_t>(rstd->element_count()));
  if (shape.has_error()) return shape.error();
  return DispatchFloatTypes("rms_norm", x.element_type(), WeightDtype(x, weight, shape->has_weight),
                            [&](auto x_tag, auto w_tag) -> ffi::Error {
                              using T = typename decltype(x_tag)::type;
                              using W = typename decltype(w_tag)::type;
                              FwdArgs<T, W> a = MakeFwdArgs<T, W>(*shape, x, weight, y, rstd, eps,
                                                                  zero_centered_weight);
                              a.rstd_in = shape->has_rstd_in ? rstd_in.typed_data() : nullptr;
                              return RmsNormFwdTyped</*kAdd=*/false>(stream, a);
                            });
}

ffi::Error AddRmsNormFwdCudaDispatch(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                                     ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> y,
                                     ffi::Result<ffi::AnyBuffer> h,
                                     ffi::Result<ffi::Buffer<ffi::F32>> rstd, float eps,
                                     bool zero_centered_weight) {
  const auto shape =
      CheckAddForward(x, residual, weight, *y, *h, static_cast<int64_t>(rstd->element_count()));
  if (shape.has_error()) return shape.error();
  return DispatchFloatTypes(
      "add_rms_norm", x.element_type(), WeightDtype(x, weight, shape->has_weight),
      [&](auto x_tag, auto w_tag) -> ffi::Error {
        using T = typename decltype(x_tag)::type;
        using W = typename decltype(w_tag)::type;
        FwdArgs<T, W> a = MakeFwdArgs<T, W>(*shape, x, weight, y, rstd, eps, zero_centered_weight);
        a.residual = static_cast<const T*>(residual.untyped_data());
        a.h = static_cast<T*>(h->untyped_data());
        return RmsNormFwdTyped</*kAdd=*/true>(stream, a);
      });
}

ffi::Error RmsNormBwdCudaDispatch(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                                  ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> rstd,
                                  ffi::Buffer<ffi::F32> dot_in, ffi::AnyBuffer dh,
                                  ffi::Result<ffi::AnyBuffer> dx,
                                  ffi::Result<ffi::Buffer<ffi::F32>> dw,
                                  ffi::Result<ffi::AnyBuffer> dw_partial,
                                  bool zero_centered_weight) {
  const auto shape = CheckBackward(dy, x, weight, static_cast<int64_t>(rstd.element_count()),
                                   static_cast<int64_t>(dot_in.element_count()), dh, *dx,
                                   static_cast<int64_t>(dw->element_count()), *dw_partial);
  if (shape.has_error()) return shape.error();
  return DispatchFloatTypes(
      "rms_norm backward", x.element_type(), WeightDtype(x, weight, shape->has_weight),
      [&](auto x_tag, auto w_tag) -> ffi::Error {
        using T = typename decltype(x_tag)::type;
        using W = typename decltype(w_tag)::type;
        BwdArgs<T, W> a;
        a.dy = static_cast<const T*>(dy.untyped_data());
        a.x = static_cast<const T*>(x.untyped_data());
        a.weight = shape->has_weight ? static_cast<const W*>(weight.untyped_data()) : nullptr;
        a.rstd = rstd.typed_data();
        a.dot_in = shape->has_dot_in ? dot_in.typed_data() : nullptr;
        a.dh = shape->has_dh ? static_cast<const T*>(dh.untyped_data()) : nullptr;
        a.dx = static_cast<T*>(dx->untyped_data());
        a.dw_partial =
            shape->has_weight ? static_cast<float*>(dw_partial->untyped_data()) : nullptr;
        a.rows = shape->rows;
        a.hidden = shape->hidden;
        a.parts = shape->parts;
        a.zero_centered = zero_centered_weight;
        return RmsNormBwdTyped(stream, a, shape->has_weight ? dw->typed_data() : nullptr);
      });
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Handler symbols (see handlers.h).

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RmsNormFwdCuda, RmsNormFwdCudaDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<ffi::AnyBuffer>()                     // x [..., hidden]: f32 / bf16 / f16
        .Arg<ffi::AnyBuffer>()                     // weight [hidden] or [0]: f32 / bf16 / f16
        .Arg<ffi::Buffer<ffi::F32>>()              // rstd_in [rows] or [0]
        .Ret<ffi::AnyBuffer>()                     // y: x's shape and dtype
        .Ret<ffi::Buffer<ffi::F32>>()              // rstd [rows]
        .Attr<float>("eps")                        // eps: added to the mean square
        .Attr<bool>("zero_centered_weight"),       // w_eff = 1 + w
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AddRmsNormFwdCuda, AddRmsNormFwdCudaDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<ffi::AnyBuffer>()                     // x [..., hidden]: f32 / bf16 / f16
        .Arg<ffi::AnyBuffer>()                     // residual: x's shape and dtype
        .Arg<ffi::AnyBuffer>()                     // weight [hidden] or [0]: f32 / bf16 / f16
        .Ret<ffi::AnyBuffer>()                     // y: x's shape and dtype
        .Ret<ffi::AnyBuffer>()                     // h = x + residual: x's shape and dtype
        .Ret<ffi::Buffer<ffi::F32>>()              // rstd [rows]
        .Attr<float>("eps")                        // eps: added to the mean square
        .Attr<bool>("zero_centered_weight"),       // w_eff = 1 + w
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RmsNormBwdCuda, RmsNormBwdCudaDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<ffi::AnyBuffer>()                     // dy: x's shape and dtype
        .Arg<ffi::AnyBuffer>()                     // x [..., hidden]: f32 / bf16 / f16
        .Arg<ffi::AnyBuffer>()                     // weight [hidden] or [0]: f32 / bf16 / f16
        .Arg<ffi::Buffer<ffi::F32>>()              // rstd [rows]
        .Arg<ffi::Buffer<ffi::F32>>()              // dot_in [rows] or [0]
        .Arg<ffi::AnyBuffer>()                     // dh: x's shape and dtype, or [0]
        .Ret<ffi::AnyBuffer>()                     // dx: x's shape and dtype
        .Ret<ffi::Buffer<ffi::F32>>()              // dw [hidden] or [0]
        .Ret<ffi::AnyBuffer>()                     // dw_partial [parts, hidden or 0]: f32
        .Attr<bool>("zero_centered_weight"),       // w_eff = 1 + w
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxops::rms_norm
