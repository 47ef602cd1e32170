// Kernels of the FP8 quantize and amax handlers: per-tensor (with or without transpose), 1 x G
// row groups and G x G tiles, and the amax reduction. Templated over F (the fp8 format traits
// E4M3 / E5M2), T (x's dtype) and kVec (elements per load: 16 bytes of T, or 1 for the scalar
// fallback); cuda.cu picks and launches them. Their building blocks, and how the bits stay equal
// to the CPU handlers', are in kernel_util.cuh.
//
// Kernels (256 threads per CTA unless noted; element offsets are int64_t; grids are capped and
// the kernels loop, so any size works):
//
//   * Fp8RowsKernel - block_mode rows without transpose (the hot path). A group of G elements of
//     one row is owned by `lanes` consecutive lanes of a warp: G / (kRowsPacks * kVec) lanes with
//     kRowsPacks 16-byte loads each, issued before any is used, when K is a multiple of 16 bytes
//     and the pointers are aligned (lane r loads packs r and r + lanes of the group, so a load
//     instruction reads whole 32-byte sectors when rows start 32-byte aligned, i.e. K times the
//     element size is a multiple of 32); otherwise 32 lanes with G / 32 scalar loads each,
//     coalesced. The group's amax is a shuffle max within those lanes, then every lane quantizes
//     its elements from registers and stores its codes (one 4- or 8-byte store per pack on the
//     vector path). Lane 0 of the group writes the scale. Warps walk the flat list of (row, group)
//     units grid-stride, whole warps at a time (so shuffles are uniform), over a grid of one wave
//     of resident CTAs; a lane's (row, group) advances by a constant step (no division per unit).
//     Each pack's largest |x| bits decide the quantizer's path (QuantizePack) and, below Inf, are
//     its finite amax.
//
//   * Fp8TileKernel - everything that needs a G x G tile: block_mode tiles (with or without
//     transpose), rows with transpose, and per-tensor with transpose (64 x 64 tiles). A CTA loads
//     a tile into shared memory (coalesced along K, 16-byte loads when possible) and, from the
//     loaded registers, reduces the amaxes the mode needs: per row (shuffles, then a shared
//     atomicMax), per column (per-thread maxima, shuffles, shared atomicMax) or per tile (warp
//     reduce, shared atomicMax). One thread per row / column / tile then computes the scale,
//     writes it (and the col_tma padding) and leaves the quantizer in shared memory. data is
//     written row by row from the tile, four codes per thread (QuantizePack, one 32-bit store)
//     when K % 4 == 0; data_t column by column (consecutive threads take consecutive m, so the
//     stores are coalesced along M and the shared reads are conflict-free thanks to a row pitch
//     of an odd number of 32-bit words), or four codes per thread through a 4 x 4 shuffle
//     transpose per quad of lanes: of the shared code tile's codes when M and K are multiples of 4
//     (tiles, per-tensor), of the T tile's elements, quantized with the column scales, when M is
//     (rows). Where data_t repeats data's bytes (tiles, per-tensor) the codes go through a second
//     shared tile instead of being computed twice. Tiles are visited grid-stride; shared memory
//     above 48 KiB (float32 with G = 128) is opted into at launch. The tile is stored as 32-bit
//     words for 16-bit T. Compiled for kTileMinCtas resident CTAs per SM (40 registers); the
//     kBatch > 1 instance (G = 128 tiles that shared memory holds to 4 CTAs per SM) for
//     kBigTileMinCtas, with kBatch tile loads per thread in flight.
//
//   * Per-tensor (the scale is given: scale_in): cudaMemsetAsync zeroes the amax output, then one
//     pass - Fp8PerTensorKernel (grid-stride, kFlatPacks 16-byte loads in flight per thread) or,
//     with transpose, the tile kernel (64 x 64 tiles) - quantizes with scale_in[0] and measures
//     amax on the way: each CTA reduces its threads' maxima (warp __reduce_max_sync, shared
//     memory) and does one global atomicMax on the amax output's bits. Thread 0 of CTA 0 alone
//     writes scale[0]; no kernel reads scale[]. An empty x still launches one CTA of
//     Fp8PerTensorKernel, which writes scale[0].
//
//   * amax handler: the same memset and Fp8PerTensorKernel<void> (the reduction above without
//     quantizing). No host synchronization anywhere.
#ifndef JAXOPS_XLA_FFI_FP8_QUANTIZE_KERNELS_CUH_
#define JAXOPS_XLA_FFI_FP8_QUANTIZE_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "xla_ffi/common/cuda_util.cuh"
#include "xla_ffi/common/cuda_vec.cuh"
#include "xla_ffi/fp8/fp8.h"
#include "xla_ffi/fp8/kernel_util.cuh"

namespace jaxops::fp8 {

// ---------------------------------------------------------------------------------------------
// Kernel arguments.

template <typename T>
struct RowsArgs {
  const T* x = nullptr;
  uint8_t* data = nullptr;
  float* scale = nullptr;
  int64_t rows = 0;  // batch * M
  int64_t m = 0;
  int64_t k = 0;
  int64_t kgroups = 0;  // ceil(K / G)
  int group = 0;
  int lanes = 0;  // lanes per group: G / (kRowsPacks * kVec), or 32 when kVec == 1
  int lanes_log2 = 0;
  ScaleGrid grid;
  float amax_floor = 0.0f;
  bool pow2_scale = false;
};

template <typename T>
struct FlatArgs {
  const T* x = nullptr;
  uint8_t* data = nullptr;
  float* scale = nullptr;           // 1 element, written by thread 0 of CTA 0
  const float* scale_in = nullptr;  // 1 element: the per-tensor scale
  uint32_t* amax = nullptr;         // the amax output's bits (zeroed before the launch)
  int64_t n = 0;
};

template <typename T>
struct TileArgs {
  const T* x = nullptr;
  uint8_t* data = nullptr;
  uint8_t* data_t = nullptr;  // nullptr: no transpose
  float* scale = nullptr;
  float* scale_t = nullptr;         // rows / tiles with transpose only
  const float* scale_in = nullptr;  // per-tensor only: the scale
  uint32_t* amax = nullptr;         // per-tensor only: the amax output's bits (zeroed before)
  int64_t batch = 0;
  int64_t m = 0;
  int64_t k = 0;
  int64_t mtiles = 0;
  int64_t ktiles = 0;
  int tile = 0;  // G (or kPerTensorTile)
  int tile_log2 = 0;
  int32_t mode = kPerTensor;
  ScaleGrid grid;    // rows / tiles
  ScaleGrid grid_t;  // rows / tiles with transpose
  float amax_floor = 0.0f;
  bool pow2_scale = false;
  bool data_words = false;    // data's rows in 32-bit words: K % 4 == 0, data 4-byte aligned
  bool data_t_words = false;  // data_t's rows in 32-bit words: M % 4 == 0, data_t aligned
};

// Whether the tile kernel's data_t repeats data's codes (tiles, per-tensor with the transpose), so
// that they go through the shared code tile: the kernel's shared memory and its launch depend on
// it.
template <typename T>
__host__ __device__ __forceinline__ bool SharesCodes(const TileArgs<T>& a) {
  return a.data_t != nullptr && a.mode != kRows;
}

// ---------------------------------------------------------------------------------------------
// Kernels.

// Rows without transpose: see the file comment.
template <typename F, int kVec, typename T>
__global__ void __launch_bounds__(kThreads) Fp8RowsKernel(RowsArgs<T> a) {
  constexpr int kMaxAccesses = kVec > 1 ? kRowsPacks : kMaxTile / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  // Per lane: kRowsPacks on the vector path, G / 32 on the scalar path.
  const int accesses = a.group / (a.lanes * kVec);
  const int64_t slots = (a.rows * a.kgroups) << a.lanes_log2;
  // The grid is at most one wave of resident CTAs, so threads loop; each lane's unit (row, kg)
  // advances by a constant step, computed once (stride is a multiple of 32, so of the lanes).
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t unit_step = stride >> a.lanes_log2;
  const int64_t row_step = DivNonNegative(unit_step, a.kgroups);
  const int64_t kg_step = unit_step - row_step * a.kgroups;
  int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + (threadIdx.x - lane);
  int64_t row = DivNonNegative((base + lane) >> a.lanes_log2, a.kgroups);
  int64_t kg = ((base + lane) >> a.lanes_log2) - row * a.kgroups;
  for (; base < slots; base += stride) {
    const int64_t slot = base + lane;
    const bool active = slot < slots;
    const int64_t unit = slot >> a.lanes_log2;
    const int rank = static_cast<int>(slot & (a.lanes - 1));
    const int64_t group_begin = kg * a.group;
    const int64_t row_offset = row * a.k;

    // Every load first (the lane's loads in flight together), then the amax.
    Pack<T, kVec> v[kMaxAccesses];
    bool present[kMaxAccesses];
#pragma unroll
    for (int i = 0; i < kMaxAccesses; ++i) {
      const int64_t col = group_begin + static_cast<int64_t>(rank + i * a.lanes) * kVec;
      present[i] = i < accesses && active && col < a.k;
      if (present[i]) LoadPack(a.x + row_offset + col, v[i]);
    }
    uint32_t abs_bits[kMaxAccesses] = {};
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < kMaxAccesses; ++i) {
      if (present[i]) {
        abs_bits[i] = PackAbsBits(v[i]);
        amax = MaxBits(amax, PackFiniteAmax(v[i], abs_bits[i]));
      }
    }
    amax = GroupMax(amax, a.lanes);
    const float scale = ScaleFromAmax<F>(FromBits(amax), a.amax_floor, a.pow2_scale);
    const Quant q = MakeQuant(scale);
#pragma unroll
    for (int i = 0; i < kMaxAccesses; ++i) {
      const int64_t col = group_begin + static_cast<int64_t>(rank + i * a.lanes) * kVec;
      if (present[i]) {
        CodePack<kVec> codes;
        QuantizePack<F>(v[i], abs_bits[i], q, codes);
        StoreCodes(a.data + row_offset + col, codes);
      }
    }
    if (active && rank == 0) {
      if (!a.grid.col_tma) {
        a.scale[unit] = scale;  // row layout: Index(b, m, kg) = row * kgroups + kg
      } else {
        const int64_t b = DivNonNegative(row, a.m);
        WriteScale(a.scale, a.grid, b, row - b * a.m, kg, scale);
      }
    }
    row += row_step;
    kg += kg_step;
    if (kg >= a.kgroups) {
      kg -= a.kgroups;
      ++row;
    }
  }
}

// Per-tensor pass, grid-stride over the flat tensor: atomicMax of the finite amax's bits into
// *a.amax (zeroed before the launch) and, for a format F, the codes of x with the scale
// scale_in[0], which thread 0 of CTA 0 also writes to scale[0]. F = void measures amax only
// (the amax handler; data, scale and scale_in are unused).
template <typename F, int kVec, typename T>
__global__ void __launch_bounds__(kThreads) Fp8PerTensorKernel(FlatArgs<T> a) {
  constexpr bool kQuantize = !std::is_void_v<F>;
  __shared__ uint32_t warp_max[kThreads / kWarpSize];
  Quant q{0.0f, 0.0f, 0.0f};
  if constexpr (kQuantize) {
    const float scale = *a.scale_in;
    if (blockIdx.x == 0 && threadIdx.x == 0) *a.scale = scale;
    q = MakeQuant(scale);
  }
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t vecs = a.n / kVec;
  uint32_t m = 0;
  // kFlatPacks packs per thread and iteration, stride apart, every load issued before any is used.
  for (int64_t i = first; i < vecs; i += kFlatPacks * stride) {
    Pack<T, kVec> p[kFlatPacks];
    bool present[kFlatPacks];
#pragma unroll
    for (int u = 0; u < kFlatPacks; ++u) {
      present[u] = i + u * stride < vecs;
      if (present[u]) LoadPack(a.x + (i + u * stride) * kVec, p[u]);
    }
#pragma unroll
    for (int u = 0; u < kFlatPacks; ++u) {
      if (!present[u]) continue;
      const uint32_t abs_bits = PackAbsBits(p[u]);
      m = MaxBits(m, PackFiniteAmax(p[u], abs_bits));
      if constexpr (kQuantize) {
        CodePack<kVec> codes;
        QuantizePack<F>(p[u], abs_bits, q, codes);
        StoreCodes(a.data + (i + u * stride) * kVec, codes);
      }
    }
  }
  for (int64_t i = vecs * kVec + first; i < a.n; i += stride) {
    const float x = LoadFloat(a.x[i]);
    m = MaxBits(m, FiniteAbsBits(x));
    if constexpr (kQuantize) a.data[i] = QuantizeValue<F>(x, q);
  }
  BlockMaxToGlobal(m, warp_max, a.amax);
}

// Tiles (with or without transpose), rows with transpose and per-tensor with transpose: see the
// file comment. Dynamic shared memory: the T tile (TileBytes), then, when data_t repeats data's
// bytes, a tile of codes with rows of tile + kCodePad bytes.
template <typename F, int kVec, typename T, int kBatch>
__global__ void __launch_bounds__(kThreads, kBatch > 1 ? kBigTileMinCtas : kTileMinCtas)
    Fp8TileKernel(TileArgs<T> a) {
  extern __shared__ float4 dynamic_shared[];
  __shared__ uint32_t row_amax[kMaxTile];
  __shared__ uint32_t col_amax[kMaxTile];
  __shared__ Quant row_q[kMaxTile];
  __shared__ Quant col_q[kMaxTile];
  __shared__ uint32_t tile_amax;
  __shared__ Quant tile_q;
  __shared__ uint32_t warp_max[kThreads / kWarpSize];

  const int g = a.tile;
  const int pitch = g + kTilePad<T>;
  const int code_pitch = g + kCodePad;
  T* tile = reinterpret_cast<T*>(dynamic_shared);
  uint8_t* code_tile = reinterpret_cast<uint8_t*>(dynamic_shared) + TileBytes<T>(g, g);
  const bool per_tensor = a.mode == kPerTensor;
  const bool rows_mode = a.mode == kRows;
  const bool tiles_mode = a.mode == kTiles;
  const bool transpose = a.data_t != nullptr;
  const bool shared_codes = SharesCodes(a);  // data_t[b, k, m] == data[b, m, k]
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int t = static_cast<int>(threadIdx.x);

  Quant tensor_q{0.0f, 0.0f, 0.0f};
  uint32_t tensor_amax = 0;  // per-tensor: the thread's max over all its tiles
  if (per_tensor) {
    const float scale = *a.scale_in;
    if (blockIdx.x == 0 && t == 0) a.scale[0] = scale;
    tensor_q = MakeQuant(scale);
  }
  for (int i = t; i < kMaxTile; i += blockDim.x) {
    row_amax[i] = 0;
    col_amax[i] = 0;
  }
  if (t == 0) tile_amax = 0;
  __syncthreads();

  const int64_t tiles = a.batch * a.mtiles * a.ktiles;
  for (int64_t index = blockIdx.x; index < tiles; index += gridDim.x) {
    const int64_t kt = index % a.ktiles;
    const int64_t rest = index / a.ktiles;
    const int64_t mt = rest % a.mtiles;
    const int64_t b = rest / a.mtiles;
    const int64_t m0 = mt * g;
    const int64_t k0 = kt * g;
    const int rows = static_cast<int>(MinOf<int64_t>(g, a.m - m0));
    const int cols = static_cast<int>(MinOf<int64_t>(g, a.k - k0));

    // 1. Load the tile and reduce the amaxes the mode needs.
    const uint32_t local = LoadTile<kVec, kBatch>(
        a.x + (b * a.m + m0) * a.k + k0, a.k, rows, cols, g, a.tile_log2, tile, pitch,
        rows_mode ? row_amax : nullptr, rows_mode && transpose ? col_amax : nullptr);
    if (tiles_mode) {
      const uint32_t w = __reduce_max_sync(kFullWarpMask, local);
      if (lane == 0 && w != 0) atomicMax(&tile_amax, w);
    }
    tensor_amax = MaxBits(tensor_amax, local);
    __syncthreads();

    // 2. Scales: one thread per row (threads [0, g)) and per column (threads [g, 2g)), or one
    //    per tile.
    if (rows_mode) {
      if (t < rows) {
        const float s = ScaleFromAmax<F>(FromBits(row_amax[t]), a.amax_floor, a.pow2_scale);
        row_q[t] = MakeQuant(s);
        WriteScale(a.scale, a.grid, b, m0 + t, kt, s);
      } else if (transpose && t >= g && t - g < cols) {
        const int c = t - g;
        const float s = ScaleFromAmax<F>(FromBits(col_amax[c]), a.amax_floor, a.pow2_scale);
        col_q[c] = MakeQuant(s);
        WriteScale(a.scale_t, a.grid_t, b, k0 + c, mt, s);
      }
    } else if (tiles_mode && t == 0) {
      const float s = ScaleFromAmax<F>(FromBits(tile_amax), a.amax_floor, a.pow2_scale);
      tile_q = MakeQuant(s);
      WriteScale(a.scale, a.grid, b, mt, kt, s);
      if (transpose) WriteScale(a.scale_t, a.grid_t, b, kt, mt, s);
    }
    __syncthreads();

    // The amaxes were read above; clear them for the next tile (its loads start after the
    // barrier at the end of this iteration).
    if (t < kMaxTile) {
      row_amax[t] = 0;
      col_amax[t] = 0;
    }
    if (t == 0) tile_amax = 0;

    // 3. data, row by row (consecutive threads: consecutive k), four codes (one 32-bit word) per
    //    thread when K % 4 == 0 (then cols % 4 == 0 too), else one.
    uint8_t* out = a.data + (b * a.m + m0) * a.k + k0;
    if (a.data_words) {
      for (int e = 4 * t; e < g * g; e += 4 * static_cast<int>(blockDim.x)) {
        const int r = e >> a.tile_log2;
        const int c = e & (g - 1);
        if (r < rows && c < cols) {
          const Quant q = rows_mode ? row_q[r] : (per_tensor ? tensor_q : tile_q);
          const Pack<T, 4> p = LoadSharedQuad(tile + r * pitch + c);
          CodePack<4> codes;
          QuantizePack<F>(p, PackAbsBits(p), q, codes);
          *reinterpret_cast<uint32_t*>(out + r * a.k + c) = codes.w[0];
          if (shared_codes) {
            *reinterpret_cast<uint32_t*>(code_tile + r * code_pitch + c) = codes.w[0];
          }
        }
      }
    } else {
      for (int e = t; e < g * g; e += blockDim.x) {
        const int r = e >> a.tile_log2;
        const int c = e & (g - 1);
        if (r < rows && c < cols) {
          const Quant q = rows_mode ? row_q[r] : (per_tensor ? tensor_q : tile_q);
          const uint8_t code = QuantizeValue<F>(LoadFloat(tile[r * pitch + c]), q);
          out[r * a.k + c] = code;
          if (shared_codes) code_tile[r * code_pitch + c] = code;
        }
      }
    }

    // 4. data_t, column by column. With the codes in the shared code tile and M, K multiples of 4
    //    (so rows and cols are too), a warp takes 32 rows x 4 columns at a time: lane (p, q) =
    //    (lane / 4, lane % 4) loads the four codes of row r0 + 4p + q (one 32-bit word; rows are
    //    g + 4 bytes apart, so the warp's 32 rows hit distinct banks), each quad transposes its
    //    4 x 4 codes with shuffles, and lane (p, q) stores column c + q's codes of rows
    //    r0 + 4p .. r0 + 4p + 3 (one 32-bit store: a warp writes 32 contiguous bytes of each of
    //    four columns). Rows with transpose and M a multiple of 4: the same lane mapping over
    //    the T tile, quantized with the column scales (below). Otherwise one code per thread
    //    (consecutive threads: consecutive m).
    if (transpose) {
      if (shared_codes) __syncthreads();
      uint8_t* out_t = a.data_t + (b * a.k + k0) * a.m + m0;
      const int p = lane >> 2;  // the lane's quad and place in it, for the 4 x 4 transposes
      const int q = lane & 3;
      if (shared_codes && a.data_words && a.data_t_words) {
        ForEachQuadBlock(g, [&](int r0, int c) {
          const int r = r0 + 4 * p + q;  // the row whose codes this lane loads
          const uint32_t word =
              r < rows && c < cols
                  ? *reinterpret_cast<const uint32_t*>(code_tile + r * code_pitch + c)
                  : 0u;
          uint32_t column = 0;  // codes of column c + q, rows r0 + 4p .. r0 + 4p + 3
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint32_t row_word = __shfl_sync(kFullWarpMask, word, (lane & ~3) | j);
            column |= ((row_word >> (8 * q)) & 0xffu) << (8 * j);
          }
          if (r0 + 4 * p < rows && c < cols) {
            *reinterpret_cast<uint32_t*>(out_t + (c + q) * a.m + r0 + 4 * p) = column;
          }
        });
      } else if (rows_mode && a.data_t_words) {
        // Rows with transpose, M a multiple of 4: data_t's codes use the column scales. A warp
        // takes 32 rows x 4 columns of the tile at a time: lane (p, q) = (lane / 4, lane % 4)
        // loads row r0 + 4p + q's elements in columns c .. c + 3 (conflict-free: rows are an odd
        // number of words apart). In step j each lane sends its element (q - j) % 4 and receives
        // from lane (p, (q + j) % 4), so it ends with column c + q's elements of rows
        // r0 + 4p + (q + j) % 4 in slot j. It quantizes them as one pack with col_q[c + q],
        // rotates the code bytes into row order and stores them as one 32-bit word (a warp
        // writes 32 contiguous bytes of each of four columns).
        ForEachQuadBlock(g, [&](int r0, int c) {
          const int r = r0 + 4 * p + q;  // the row whose elements this lane loads
          Pack<T, 4> mine = {};
          if (r < rows && c < cols) mine = LoadSharedQuad(tile + r * pitch + c);
          uint32_t got[4];  // slot j: column c + q, row r0 + 4p + (q + j) % 4
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint32_t sent = QuadElementBits(mine, (q - j) & 3);
            got[j] = __shfl_sync(kFullWarpMask, sent, (lane & ~3) | ((q + j) & 3));
          }
          const Pack<T, 4> column = QuadFromBits<T>(got);
          if (r0 + 4 * p < rows && c + q < cols) {
            CodePack<4> codes;
            QuantizePack<F>(column, PackAbsBits(column), col_q[c + q], codes);
            // Byte j holds row (q + j) % 4: rotating left by q bytes puts row i in byte i.
            const uint32_t word = __funnelshift_l(codes.w[0], codes.w[0], 8 * q);
            *reinterpret_cast<uint32_t*>(out_t + (c + q) * a.m + r0 + 4 * p) = word;
          }
        });
      } else {
        for (int e = t; e < g * g; e += blockDim.x) {
          const int c = e >> a.tile_log2;
          const int r = e & (g - 1);
          if (r < rows && c < cols) {
            out_t[c * a.m + r] = shared_codes
                                     ? code_tile[r * code_pitch + c]
                                     : QuantizeValue<F>(LoadFloat(tile[r * pitch + c]), col_q[c]);
          }
        }
      }
    }
    __syncthreads();  // The tile, codes and quantizers are reused by the next tile.
  }
  if (per_tensor) BlockMaxToGlobal(tensor_amax, warp_max, a.amax);
}

}  // namespace jaxops::fp8

#endif  // JAXOPS_XLA_FFI_FP8_QUANTIZE_KERNELS_CUH_
