// Backward kernels of the RMSNorm family, one per design of kernel_util.cuh (warp-per-row,
// block-per-row, long rows), the dw part reduction, their arguments and the backward's pack
// helpers. Templated over T (x's dtype), W (the weight's dtype) and kVec (elements per memory
// access); cuda.cu picks and launches them.
//
// dw is deterministic: the backward kernel with a weight runs exactly `parts` CTAs; CTA p owns
// rows [PartBegin(p), PartBegin(p + 1)), adds dy * x * rstd per column in a fixed order (each
// column of each row group belongs to one thread; the CTA's groups are combined in group order)
// and writes dw_partial[p, :]. RmsNormSumPartsKernel then adds the parts per column in a fixed
// order (ranges of parts, then the ranges' sums). No atomics, so equal inputs give equal bits on
// every run.
#ifndef JAXOPS_XLA_FFI_RMS_NORM_BWD_KERNELS_CUH_
#define JAXOPS_XLA_FFI_RMS_NORM_BWD_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "xla_ffi/common/cuda_util.cuh"
#include "xla_ffi/common/cuda_vec.cuh"
#include "xla_ffi/rms_norm/kernel_util.cuh"
#include "xla_ffi/rms_norm/rms_norm.h"

namespace jaxops::rms_norm {

// ---------------------------------------------------------------------------------------------
// Kernel arguments. Absent optional operands are nullptr.

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
// Backward pack helpers.

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

// dw[j] = the sum over the parts p of dw_partial[p, j], in a fixed order: kSumPartsSlices
// consecutive ranges of parts are each summed in order p = begin, begin + 1, ... by their own
// warp, and the ranges' sums are then added in range order. A CTA owns kSumPartsCols columns
// (each warp's loads coalesced across them), and each thread keeps kSumPartsUnroll loads in
// flight (dw_partial was just written and sits in L2). One column per thread, the parts in one
// sequence, took 44 us at hidden 4096 x 256 parts under ncu on an H200 (64 CTAs, 3% occupancy,
// stalled on L2 latency), a sixth of the fwd+bwd's kernel time there.
__global__ void __launch_bounds__(kSumPartsThreads)
    RmsNormSumPartsKernel(const float* dw_partial, float* dw, int64_t parts, int64_t hidden) {
  __shared__ float slice_sums[kSumPartsSlices][kSumPartsCols];
  const int lane = static_cast<int>(threadIdx.x) % kSumPartsCols;
  const int slice = static_cast<int>(threadIdx.x) / kSumPartsCols;
  const int64_t begin = parts * slice / kSumPartsSlices;
  const int64_t end = parts * (slice + 1) / kSumPartsSlices;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kSumPartsCols; first < hidden;
       first += static_cast<int64_t>(gridDim.x) * kSumPartsCols) {
    const int64_t col = first + lane;
    float sum = 0.0f;
    if (col < hidden) {
      int64_t p = begin;
      for (; p + kSumPartsUnroll <= end; p += kSumPartsUnroll) {
        float v[kSumPartsUnroll];
#pragma unroll
        for (int u = 0; u < kSumPartsUnroll; ++u) v[u] = dw_partial[(p + u) * hidden + col];
#pragma unroll
        for (int u = 0; u < kSumPartsUnroll; ++u) sum += v[u];
      }
#pragma unroll 4
      for (; p < end; ++p) sum += dw_partial[p * hidden + col];
    }
    slice_sums[slice][lane] = sum;
    __syncthreads();
    if (slice == 0 && col < hidden) {
      float total = slice_sums[0][lane];
#pragma unroll
      for (int s = 1; s < kSumPartsSlices; ++s) total += slice_sums[s][lane];
      dw[col] = total;
    }
    __syncthreads();  // slice_sums is rewritten by the next block of columns
  }
}

}  // namespace jaxops::rms_norm

#endif  // JAXOPS_XLA_FFI_RMS_NORM_BWD_KERNELS_CUH_
