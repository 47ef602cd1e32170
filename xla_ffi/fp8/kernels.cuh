// Device code of the FP8 quantization family: the CUDA kernels and their building blocks,
// templated over F (the fp8 format traits E4M3 / E5M2), T (x's dtype) and kVec (elements per
// load: 16 bytes of T, or 1 for the scalar fallback). cuda.cu picks and launches them.
//
// Every value goes through fp8.h (FiniteAbsBits, ScaleFromAmax, EncodeFp8, DivRn), so the bits
// equal the CPU handlers'. Two device-only details keep them equal:
//   * x / scale for a power-of-two scale (always the case with pow2_scale) is computed as
//     x * (1 / scale) when that reciprocal is an exact normal float: both are the correctly
//     rounded value of the same real number, and the multiply saves the division.
//   * GPU arithmetic returns a canonical NaN, while a CPU division returns its NaN operand (x,
//     else the scale) with its sign; since the sign of a NaN reaches the fp8 code, the quotient
//     of a NaN operand is replaced by that operand (QuantizeValue), and float16 NaNs keep their
//     sign through the conversion to fp32 (LoadFloat).
// amaxes are unsigned maxima over fp32 bits (non-negative floats order like their bits), so
// every reduction - shuffles, shared and global atomicMax - is exact and order-independent.
//
// Kernels (256 threads per CTA unless noted; element offsets are int64_t; grids are capped and
// the kernels loop, so any size works):
//
//   * Fp8RowsKernel - block_mode rows without transpose (the hot path). A group of G elements of
//     one row is owned by `lanes` = min(32, G / kVec) consecutive lanes of a warp (one 16-byte load
//     each when K is a multiple of 16 bytes and the pointers are aligned; otherwise 32 lanes with
//     G / 32 scalar loads each, coalesced); the group's amax is a shuffle max within those lanes,
//     then every lane quantizes its elements from registers and stores its codes (one 4- or
//     8-byte store on the vector path). Lane 0 of the group writes the scale. Warps walk the flat
//     list of (row, group) units grid-stride, whole warps at a time (so shuffles are uniform).
//
//   * Fp8TileKernel - everything that needs a G x G tile: block_mode tiles (with or without
//     transpose), rows with transpose, and per-tensor with transpose (64 x 64 tiles). A CTA loads
//     a tile into shared memory (coalesced along K, 16-byte loads when possible) and, from the
//     loaded registers, reduces the amaxes the mode needs: per row (shuffles, then a shared
//     atomicMax), per column (per-thread maxima, shuffles, shared atomicMax) or per tile (warp
//     reduce, shared atomicMax). One thread per row / column / tile then computes the scale,
//     writes it (and the col_tma padding) and leaves the quantizer in shared memory. data is
//     written row by row from the tile; data_t column by column (consecutive threads take
//     consecutive m, so the stores are coalesced along M and the shared reads are conflict-free
//     thanks to a row pitch of an odd number of 32-bit words). Where data_t repeats data's bytes
//     (tiles, per-tensor) the codes go through a second shared tile instead of being computed
//     twice. Tiles are visited grid-stride; shared memory above 48 KiB (float32 with G = 128) is
//     opted into at launch.
//
//   * Per-tensor (the scale is given: scale_in): cudaMemsetAsync zeroes the amax output, then one
//     pass - Fp8PerTensorKernel (grid-stride, 16-byte loads) or, with transpose, the tile kernel
//     (64 x 64 tiles) - quantizes with scale_in[0] and measures amax on the way: each CTA reduces
//     its threads' maxima (warp __reduce_max_sync, shared memory) and does one global atomicMax on
//     the amax output's bits. Thread 0 of CTA 0 alone writes scale[0]; no kernel reads scale[].
//     An empty x still launches one CTA of Fp8PerTensorKernel, which writes scale[0].
//
//   * amax handler: the same memset and Fp8PerTensorKernel<void> (the reduction above without
//     quantizing). No host synchronization anywhere.
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
#ifndef JAXOPS_XLA_FFI_FP8_KERNELS_CUH_
#define JAXOPS_XLA_FFI_FP8_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "xla_ffi/common/cuda_util.cuh"
#include "xla_ffi/common/cuda_vec.cuh"
#include "xla_ffi/common/math.h"
#include "xla_ffi/fp8/fp8.h"

namespace jaxops::fp8 {

// ---------------------------------------------------------------------------------------------
// Launch geometry (the host-only grid caps are in cuda.cu).

__host__ __device__ constexpr int Log2(int n) { return n <= 1 ? 0 : 1 + Log2(n / 2); }

constexpr int kThreads = 256;       // CTA size of every kernel but the offsets scan.
constexpr int kScanThreads = 1024;  // CTA size of Fp8SplitOffsetsKernel.
constexpr int kMaxTile = 128;       // Largest G (rows and columns of a tile).
constexpr int kPerTensorTile = 64;  // Tile of the per-tensor transpose.
constexpr int kPerTensorTileLog2 = Log2(kPerTensorTile);
constexpr int kSplitTileCols = 64;  // K columns per panel tile of the split transpose.
constexpr int kSplitTileColsLog2 = Log2(kSplitTileCols);
constexpr int kCodePad = 4;  // Row padding (bytes) of the shared code tile.

static_assert(kThreads % kMaxTile == 0 && kThreads >= 2 * kMaxTile,
              "the tile kernel gives one thread to each row and each column of a tile");

// Row padding (elements) of a shared tile of T: one 32-bit word, so that a row is an odd number
// of words long (tile widths are multiples of 4 elements) and column walks are conflict-free.
template <typename T>
constexpr int kTilePad = 4 / static_cast<int>(sizeof(T));

// Bytes of a shared tile of `rows` x `cols` elements of T (padded rows), rounded to 16.
template <typename T>
__host__ __device__ __forceinline__ int64_t TileBytes(int64_t rows, int64_t cols) {
  const int64_t elements = rows * (cols + kTilePad<T>);
  return RoundUp(elements * static_cast<int64_t>(sizeof(T)), 16);
}

// ---------------------------------------------------------------------------------------------
// Device building blocks.

template <typename A>
__device__ __forceinline__ A MinOf(A a, A b) {
  return a < b ? a : b;
}

// n / d for non-negative operands: 32-bit division when both fit (the common case), which is
// several times cheaper than the 64-bit one.
__device__ __forceinline__ int64_t DivNonNegative(int64_t n, int64_t d) {
  if (((n | d) >> 32) == 0) {
    return static_cast<int64_t>(static_cast<uint32_t>(n) / static_cast<uint32_t>(d));
  }
  return n / d;
}

// Element -> fp32. bfloat16 is widened by a shift; a float16 NaN keeps its sign (the hardware
// conversion may return a canonical NaN), as the CPU conversion does.
__device__ __forceinline__ float LoadFloat(float v) { return v; }
__device__ __forceinline__ float LoadFloat(__nv_bfloat16 v) {
  return __uint_as_float(static_cast<uint32_t>(__bfloat16_as_ushort(v)) << 16);
}
__device__ __forceinline__ float LoadFloat(__half v) {
  const float f = __half2float(v);
  const uint32_t sign = (static_cast<uint32_t>(__half_as_ushort(v)) & 0x8000u) << 16;
  return isnan(f) ? __uint_as_float(__float_as_uint(f) | sign) : f;
}

// A block's quantizer: the scale, and 1 / scale when x * (1 / scale) == x / scale for every x
// (scale a positive power of two whose reciprocal is a normal float), else 0. Plain data, so it
// can live in shared memory.
struct Quant {
  float scale;
  float inv;
};

__device__ __forceinline__ Quant MakeQuant(float scale) {
  const uint32_t u = Bits(scale);
  const uint32_t exponent = u >> 23;  // with the sign bit: negative scales fail the range test
  const bool pow2 = (u & 0x007fffffu) == 0 && exponent >= 1 && exponent <= 253;
  return Quant{scale, pow2 ? FromBits((254u - exponent) << 23) : 0.0f};
}

// fp8 code of x given y = x / scale: a NaN quotient takes the sign of the NaN operand the CPU
// division returns (x first, then the scale); only the sign of a NaN reaches the code.
template <typename F>
__device__ __forceinline__ uint8_t EncodeQuotient(float x, float y, float scale) {
  if (isnan(y)) y = isnan(x) ? x : (isnan(scale) ? scale : y);
  return EncodeFp8<F>(y);
}

template <typename F>
__device__ __forceinline__ uint8_t QuantizeValue(float x, const Quant& q) {
  const float y = q.inv != 0.0f ? __fmul_rn(x, q.inv) : DivRn(x, q.scale);
  return EncodeQuotient<F>(x, y, q.scale);
}

// Codes of a pack of kVec elements (one branch on the quantizer for the whole pack).
template <typename F, int kVec, typename T>
__device__ __forceinline__ void QuantizePack(const Pack<T, kVec>& in, const Quant& q,
                                             uint8_t (&codes)[kVec]) {
  if (q.inv != 0.0f) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = LoadFloat(in.v[j]);
      codes[j] = EncodeQuotient<F>(x, __fmul_rn(x, q.inv), q.scale);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = LoadFloat(in.v[j]);
      codes[j] = EncodeQuotient<F>(x, DivRn(x, q.scale), q.scale);
    }
  }
}

// Stores kVec codes at p (aligned to kVec bytes): one access.
template <int kVec>
__device__ __forceinline__ void StoreCodes(uint8_t* p, const uint8_t (&codes)[kVec]) {
  if constexpr (kVec == 1) {
    *p = codes[0];
  } else {
    Pack<uint8_t, kVec> pack;
#pragma unroll
    for (int j = 0; j < kVec; ++j) pack.v[j] = codes[j];
    StorePack(p, pack);
  }
}

template <typename T, int kVec>
__device__ __forceinline__ uint32_t PackAmax(const Pack<T, kVec>& p) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < kVec; ++j) m = MaxBits(m, FiniteAbsBits(LoadFloat(p.v[j])));
  return m;
}

// Max over aligned groups of `width` lanes (a power of two <= 32); all lanes of the warp call it
// and every lane of a group gets the group's max.
__device__ __forceinline__ uint32_t GroupMax(uint32_t v, int width) {
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    if (offset < width) v = MaxBits(v, __shfl_xor_sync(kFullWarpMask, v, offset));
  }
  return v;
}

// Max over the lanes whose index agrees modulo `stride` (a power of two); all lanes call it.
__device__ __forceinline__ uint32_t StridedMax(uint32_t v, int stride) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    if (offset >= stride) v = MaxBits(v, __shfl_xor_sync(kFullWarpMask, v, offset));
  }
  return v;
}

// Writes the scale of block (b, r, c) of `grid`, and the col_tma padding after the last row.
__device__ __forceinline__ void WriteScale(float* scale, const ScaleGrid& grid, int64_t b,
                                           int64_t r, int64_t c, float value) {
  const int64_t index = grid.Index(b, r, c);
  scale[index] = value;
  if (r == grid.rows - 1) {
    const int64_t padding = grid.PaddingAfterLastRow();
    for (int64_t i = 1; i <= padding; ++i) scale[index + i] = 0.0f;
  }
}

// atomicMax of the CTA's max of v into *amax (fp32 bits of a non-negative float in global
// memory); warp_max holds kThreads / 32 entries. All threads of a kThreads CTA call it, once.
__device__ __forceinline__ void BlockMaxToGlobal(uint32_t v, uint32_t* warp_max, uint32_t* amax) {
  v = __reduce_max_sync(kFullWarpMask, v);
  if (threadIdx.x % kWarpSize == 0) warp_max[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t block_max = 0;
    for (int w = 0; w < kThreads / kWarpSize; ++w) block_max = MaxBits(block_max, warp_max[w]);
    if (block_max != 0) atomicMax(amax, block_max);
  }
}

// Loads the rows x cols block at src (row stride ld) into tile[r * pitch + c] (r < rows,
// c < cols; the rest of the tile_rows x 2^cols_log2 tile is not written) and reduces amaxes from
// the loaded registers: row_amax[r] and col_amax[c] (shared, zero before the call; each skipped
// when nullptr) get atomicMax'ed, and the thread's max over everything it loaded is returned
// (for a tile amax). A tile row is 2^cols_log2 / kVec consecutive threads (`lanes`); with
// kVec > 1, cols and every offset are multiples of kVec and src is 16-byte aligned. Every thread
// of the CTA must call it (shuffles).
template <int kVec, typename T>
__device__ __forceinline__ uint32_t LoadTile(const T* src, int64_t ld, int rows, int cols,
                                             int tile_rows, int cols_log2, T* tile, int pitch,
                                             uint32_t* row_amax, uint32_t* col_amax) {
  const int lanes_log2 = cols_log2 - Log2(kVec);
  const int lanes = 1 << lanes_log2;
  const int row_lanes = lanes < kWarpSize ? lanes : kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  // tile_rows * lanes is a multiple of 32, so every warp runs the same number of iterations.
  const int slots = tile_rows << lanes_log2;
  // blockDim.x is a multiple of lanes: a thread always loads the same columns.
  const int col = (static_cast<int>(threadIdx.x) & (lanes - 1)) * kVec;
  uint32_t col_max[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) col_max[j] = 0;
  uint32_t total = 0;
  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    const int r = s >> lanes_log2;
    uint32_t vmax = 0;
    if (r < rows && col < cols) {
      Pack<T, kVec> p;
      LoadPack(src + r * ld + col, p);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        tile[r * pitch + col + j] = p.v[j];
        const uint32_t bits = FiniteAbsBits(LoadFloat(p.v[j]));
        vmax = MaxBits(vmax, bits);
        col_max[j] = MaxBits(col_max[j], bits);
      }
    }
    total = MaxBits(total, vmax);
    if (row_amax != nullptr) {
      const uint32_t rmax = GroupMax(vmax, row_lanes);
      if (lane % row_lanes == 0 && rmax != 0) atomicMax(&row_amax[r], rmax);
    }
  }
  if (col_amax != nullptr) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const uint32_t cmax = StridedMax(col_max[j], lanes);
      if (lane < lanes && cmax != 0) atomicMax(&col_amax[col + j], cmax);
    }
  }
  return total;
}

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
struct RowsArgs {
  const T* x = nullptr;
  uint8_t* data = nullptr;
  float* scale = nullptr;
  int64_t rows = 0;  // batch * M
  int64_t m = 0;
  int64_t k = 0;
  int64_t kgroups = 0;  // ceil(K / G)
  int group = 0;
  int lanes = 0;  // lanes per group: min(32, G / kVec)
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
};

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

// Rows without transpose: see the file comment.
template <typename F, int kVec, typename T>
__global__ void __launch_bounds__(kThreads) Fp8RowsKernel(RowsArgs<T> a) {
  constexpr int kMaxAccesses = kVec > 1 ? 1 : kMaxTile / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int accesses = a.group / (a.lanes * kVec);  // per lane: 1, or G / 32 on the scalar path
  const int64_t slots = (a.rows * a.kgroups) << a.lanes_log2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + (threadIdx.x - lane);
       base < slots; base += stride) {
    const int64_t slot = base + lane;
    const bool active = slot < slots;
    const int64_t unit = active ? slot >> a.lanes_log2 : 0;
    const int rank = static_cast<int>(slot & (a.lanes - 1));
    const int64_t row = DivNonNegative(unit, a.kgroups);
    const int64_t kg = unit - row * a.kgroups;
    const int64_t group_begin = kg * a.group;
    const int64_t row_offset = row * a.k;

    Pack<T, kVec> v[kMaxAccesses];
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < kMaxAccesses; ++i) {
      const int64_t col = group_begin + static_cast<int64_t>(rank + i * a.lanes) * kVec;
      if (i < accesses && active && col < a.k) {
        LoadPack(a.x + row_offset + col, v[i]);
        amax = MaxBits(amax, PackAmax(v[i]));
      }
    }
    amax = GroupMax(amax, a.lanes);
    const float scale = ScaleFromAmax<F>(FromBits(amax), a.amax_floor, a.pow2_scale);
    const Quant q = MakeQuant(scale);
#pragma unroll
    for (int i = 0; i < kMaxAccesses; ++i) {
      const int64_t col = group_begin + static_cast<int64_t>(rank + i * a.lanes) * kVec;
      if (i < accesses && active && col < a.k) {
        uint8_t codes[kVec];
        QuantizePack<F>(v[i], q, codes);
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
  Quant q{0.0f, 0.0f};
  if constexpr (kQuantize) {
    const float scale = *a.scale_in;
    if (blockIdx.x == 0 && threadIdx.x == 0) *a.scale = scale;
    q = MakeQuant(scale);
  }
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t vecs = a.n / kVec;
  uint32_t m = 0;
  for (int64_t i = first; i < vecs; i += stride) {
    Pack<T, kVec> p;
    LoadPack(a.x + i * kVec, p);
    m = MaxBits(m, PackAmax(p));
    if constexpr (kQuantize) {
      uint8_t codes[kVec];
      QuantizePack<F>(p, q, codes);
      StoreCodes(a.data + i * kVec, codes);
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
template <typename F, int kVec, typename T>
__global__ void __launch_bounds__(kThreads) Fp8TileKernel(TileArgs<T> a) {
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
  const bool shared_codes = transpose && !rows_mode;  // data_t[b, k, m] == data[b, m, k]
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int t = static_cast<int>(threadIdx.x);

  Quant tensor_q{0.0f, 0.0f};
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
    const uint32_t local = LoadTile<kVec>(a.x + (b * a.m + m0) * a.k + k0, a.k, rows, cols, g,
                                          a.tile_log2, tile, pitch, rows_mode ? row_amax : nullptr,
                                          rows_mode && transpose ? col_amax : nullptr);
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

    // 3. data, row by row (consecutive threads: consecutive k).
    uint8_t* out = a.data + (b * a.m + m0) * a.k + k0;
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

    // 4. data_t, column by column (consecutive threads: consecutive m).
    if (transpose) {
      if (shared_codes) __syncthreads();
      uint8_t* out_t = a.data_t + (b * a.k + k0) * a.m + m0;
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
    __syncthreads();  // The tile, codes and quantizers are reused by the next tile.
  }
  if (per_tensor) BlockMaxToGlobal(tensor_amax, warp_max, a.amax);
}

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
  __shared__ T tile[kMaxTile * kPitch];
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

#endif  // JAXOPS_XLA_FFI_FP8_KERNELS_CUH_
