// Forward kernels of the RMSNorm family (rms_norm and add_rms_norm), one per design of
// kernel_util.cuh (warp-per-row, block-per-row, long rows), with their arguments and the
// forward's pack helpers. Templated over kAdd (add_rms_norm), T (x's dtype), W (the weight's
// dtype) and kVec (elements per memory access); cuda.cu picks and launches them.
#ifndef JAXOPS_XLA_FFI_RMS_NORM_FWD_KERNELS_CUH_
#define JAXOPS_XLA_FFI_RMS_NORM_FWD_KERNELS_CUH_

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

// ---------------------------------------------------------------------------------------------
// Forward pack helpers.

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

}  // namespace jaxops::rms_norm

#endif  // JAXOPS_XLA_FFI_RMS_NORM_FWD_KERNELS_CUH_
