// Kernels of the FP8 quantize_split_transpose handler: the per-expert transposed layout of
// grouped GEMMs (column-wise 1 x G scales over each expert's rows, packed experts padded to 16
// columns). Templated over F (the fp8 format traits E4M3 / E5M2), T (x's dtype) and kVec
// (elements per load: 16 bytes of T, or 1 for the scalar fallback); cuda.cu launches them. Their
// building blocks are in kernel_util.cuh. 256 threads per CTA unless noted; element offsets are
// int64_t.
//
//   * quantize_split_transpose, three kernels on the stream:
//     1. Fp8SplitOffsetsKernel (one CTA of 1024 threads) clamps group_sizes and writes
//        col_offsets / scale_offsets with block scans over chunks of 1024 experts. The clamped
//        start of expert e is min(M, A_e) with A_e = sum_{i<e} max(group_sizes[i], 0).
//     2. Fp8SplitPanelKernel, grid (scale column p, K chunk): panel p is G consecutive rows of
//        one expert (found by binary search in scale_offsets); the CTA recomputes A_e with a
//        block sum (there is no scratch buffer to pass it in), then for each 64-column K tile
//        loads the panel (<= G rows x 64 columns) into shared memory with per-column amaxes,
//        writes the column scales to scale_t[:, p] and the codes transposed into data_t (stores
//        coalesced along the packed columns). The expert's last panel also zeroes its padding
//        columns (up to the next multiple of 16). CTAs with p >= scale_offsets[E] exit.
//     3. Fp8SplitTailKernel zeroes data_t[:, col_offsets[E]:] and scale_t[:, scale_offsets[E]:]
//        (one CTA per row of K, grid-stride).
//     Every element of data_t and scale_t is written exactly once; there is no memset.
#ifndef JAXOPS_XLA_FFI_FP8_SPLIT_KERNELS_CUH_
#define JAXOPS_XLA_FFI_FP8_SPLIT_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "xla_ffi/common/cuda_util.cuh"
#include "xla_ffi/common/cuda_vec.cuh"
#include "xla_ffi/common/math.h"
#include "xla_ffi/fp8/fp8.h"
#include "xla_ffi/fp8/kernel_util.cuh"

namespace jaxops::fp8 {

// ---------------------------------------------------------------------------------------------
// Device building blocks.

// Sum over the CTA (all threads call it); partial holds blockDim.x / 32 entries.
__device__ __forceinline__ long long BlockSum(long long v, long long* partial) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullWarpMask, v, offset);
  }
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) partial[warp] = v;
  __syncthreads();
  long long total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x) / kWarpSize; ++w) total += partial[w];
  return total;
}

// ---------------------------------------------------------------------------------------------
// Kernel arguments.

template <typename T>
struct SplitArgs {
  const T* x = nullptr;
  const int32_t* group_sizes = nullptr;
  uint8_t* data_t = nullptr;
  float* scale_t = nullptr;
  int32_t* col_offsets = nullptr;    // written by step 1, read by steps 2 and 3
  int32_t* scale_offsets = nullptr;  //
  int64_t m = 0;
  int64_t k = 0;
  int64_t experts = 0;
  int64_t columns = 0;
  int64_t scale_columns = 0;
  int64_t ktiles = 0;           // ceil(K / kSplitTileCols)
  int64_t tiles_per_chunk = 0;  // K tiles per blockIdx.y
  int group = 0;
  int group_log2 = 0;
  float amax_floor = 0.0f;
  bool pow2_scale = false;
};

// ---------------------------------------------------------------------------------------------
// Kernels.

// Split transpose, step 1: col_offsets and scale_offsets (one CTA of kScanThreads threads).
__global__ void __launch_bounds__(kScanThreads)
    Fp8SplitOffsetsKernel(const int32_t* group_sizes, int64_t experts, int64_t m, int group,
                          int32_t* col_offsets, int32_t* scale_offsets) {
  __shared__ long long warp_totals[kScanThreads / kWarpSize];
  if (threadIdx.x == 0) {
    col_offsets[0] = 0;
    scale_offsets[0] = 0;
  }
  long long rows_before = 0;  // A_e: sum of max(group_sizes, 0) over earlier chunks (unclamped)
  long long cols_before = 0;
  long long scales_before = 0;
  for (int64_t chunk = 0; chunk < experts; chunk += blockDim.x) {
    const int64_t e = chunk + threadIdx.x;
    const long long size = e < experts ? static_cast<long long>(max(group_sizes[e], 0)) : 0;
    long long total = 0;
    const long long rows_end = rows_before + BlockInclusiveScan(size, warp_totals, total);
    rows_before += total;
    // Clamped rows of expert e: min(M, A_{e+1}) - min(M, A_e).
    const long long rows_e =
        (rows_end < m ? rows_end : m) - (rows_end - size < m ? rows_end - size : m);
    const long long cols_e = RoundUp(rows_e, kSplitColumnAlign);
    const long long scales_e = CeilDiv(rows_e, group);
    const long long cols_end = cols_before + BlockInclusiveScan(cols_e, warp_totals, total);
    cols_before += total;
    const long long scales_end = scales_before + BlockInclusiveScan(scales_e, warp_totals, total);
    scales_before += total;
    if (e < experts) {
      // Both fit in int32: cols_end <= SplitColumns(M, E) < 2^31 (checked by the dispatch).
      col_offsets[e + 1] = static_cast<int32_t>(cols_end);
      scale_offsets[e + 1] = static_cast<int32_t>(scales_end);
    }
  }
}

// Split transpose, step 2: one panel (G rows of one expert) x one chunk of K per CTA.
template <typename F, int kVec, typename T>
__global__ void __launch_bounds__(kThreads) Fp8SplitPanelKernel(SplitArgs<T> a) {
  constexpr int kPitch = kSplitTileCols + kTilePad<T>;
  __shared__ alignas(16) T tile[kMaxTile * kPitch];  // aligned: LoadTile stores 32-bit words
  __shared__ uint32_t col_amax[kSplitTileCols];
  __shared__ Quant col_q[kSplitTileCols];
  __shared__ long long partial[kThreads / kWarpSize];

  const int64_t p = blockIdx.x;
  if (p >= a.scale_offsets[a.experts]) return;  // An unused scale column (the tail kernel's).
  const int t = static_cast<int>(threadIdx.x);
  for (int i = t; i < kSplitTileCols; i += blockDim.x) col_amax[i] = 0;

  // The expert: the largest e < E with scale_offsets[e] <= p (empty experts share their
  // successor's offset, so e is the one whose columns contain p). E >= 1 here.
  int64_t lo = 0;
  int64_t hi = a.experts - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (a.scale_offsets[mid] <= p) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t e = lo;
  // Its first row: min(M, A_e), A_e = sum_{i<e} max(group_sizes[i], 0) (as in step 1).
  long long sum = 0;
  for (int64_t i = t; i < e; i += blockDim.x) sum += max(a.group_sizes[i], 0);
  const long long before = BlockSum(sum, partial);  // its barrier also orders col_amax's init
  const long long after = before + max(a.group_sizes[e], 0);
  const int64_t start = before < a.m ? before : a.m;
  const int64_t rows_e = (after < a.m ? after : a.m) - start;
  const int64_t first = (p - a.scale_offsets[e]) * a.group;  // first row of the panel in e
  const int rows = static_cast<int>(MinOf<int64_t>(a.group, rows_e - first));
  const int64_t col0 = a.col_offsets[e] + first;  // its first column in data_t
  // The expert's last panel also zeroes the padding up to the next multiple of 16 columns.
  const int pad =
      first + a.group >= rows_e ? static_cast<int>(RoundUp(rows_e, kSplitColumnAlign) - rows_e) : 0;
  const T* src = a.x + (start + first) * a.k;

  const int64_t kt_begin = static_cast<int64_t>(blockIdx.y) * a.tiles_per_chunk;
  const int64_t kt_end = MinOf(a.ktiles, kt_begin + a.tiles_per_chunk);
  for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
    const int64_t k0 = kt * kSplitTileCols;
    const int cols = static_cast<int>(MinOf<int64_t>(kSplitTileCols, a.k - k0));
    LoadTile<kVec>(src + k0, a.k, rows, cols, a.group, kSplitTileColsLog2, tile, kPitch, nullptr,
                   col_amax);
    __syncthreads();
    if (t < cols) {
      const float s = ScaleFromAmax<F>(FromBits(col_amax[t]), a.amax_floor, a.pow2_scale);
      col_q[t] = MakeQuant(s);
      col_amax[t] = 0;  // Only this thread reads it; the next loads follow two barriers.
      a.scale_t[(k0 + t) * a.scale_columns + p] = s;
    }
    __syncthreads();
    uint8_t* out = a.data_t + k0 * a.columns + col0;
    for (int i = t; i < kSplitTileCols * a.group; i += blockDim.x) {
      const int c = i >> a.group_log2;
      const int r = i & (a.group - 1);
      if (c < cols && r < rows) {
        out[c * a.columns + r] = QuantizeValue<F>(LoadFloat(tile[r * kPitch + c]), col_q[c]);
      }
    }
    if (pad > 0) {
      for (int i = t; i < kSplitTileCols * kSplitColumnAlign; i += blockDim.x) {
        const int c = i / kSplitColumnAlign;
        const int j = i % kSplitColumnAlign;
        if (c < cols && j < pad) out[c * a.columns + rows + j] = 0;
      }
    }
    __syncthreads();  // The tile and quantizers are reused by the next K tile.
  }
}

// Split transpose, step 3: zero the columns after the last expert's.
__global__ void __launch_bounds__(kThreads)
    Fp8SplitTailKernel(uint8_t* data_t, float* scale_t, const int32_t* col_offsets,
                       const int32_t* scale_offsets, int64_t experts, int64_t k, int64_t columns,
                       int64_t scale_columns) {
  const int64_t col_begin = col_offsets[experts];
  const int64_t scale_begin = scale_offsets[experts];
  for (int64_t row = blockIdx.x; row < k; row += gridDim.x) {
    for (int64_t c = col_begin + threadIdx.x; c < columns; c += blockDim.x) {
      data_t[row * columns + c] = 0;
    }
    for (int64_t c = scale_begin + threadIdx.x; c < scale_columns; c += blockDim.x) {
      scale_t[row * scale_columns + c] = 0.0f;
    }
  }
}

}  // namespace jaxops::fp8

#endif  // JAXOPS_XLA_FFI_FP8_SPLIT_KERNELS_CUH_
