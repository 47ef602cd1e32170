// Device building blocks shared by the FP8 quantization kernels (quantize_kernels.cuh and
// split_kernels.cuh): launch geometry, element loads, the quantizer (Quant, QuantizeValue,
// QuantizePack), code stores, warp and CTA amax reductions, scale writes and the shared-memory
// tile load. Templated over F (the fp8 format traits E4M3 / E5M2), T (x's dtype) and kVec
// (elements per load: 16 bytes of T, or 1 for the scalar fallback).
//
// Every value goes through fp8.h (FiniteAbsBits, ScaleFromAmax, EncodeFp8, DivRn), so the bits
// equal the CPU handlers'. These device-only details keep them equal:
//   * x / scale for a power-of-two scale (always the case with pow2_scale) is computed as
//     x * (1 / scale) when that reciprocal is an exact normal float: both are the correctly
//     rounded value of the same real number, and the multiply saves the division.
//   * For other scales in [2^-60, 2^60] and a pack of finite x with |x| <= 2^60 (the common case),
//     x / scale is computed from r = RN(1 / scale) (one correctly rounded reciprocal per block)
//     as q0 = RN(x r) and two corrections q' = RN(q + r RN(x - scale q)) (fused multiply-adds),
//     without branches. q0 is within 1.5 ulp of x / scale, the first correction makes it
//     faithful, and the second is then the correctly rounded quotient (Markstein's theorem: r is
//     RN(1 / scale) and the residual is exact). That needs an exact residual and no overflow:
//     quotients of at least 2^-20 in magnitude come from |x| >= 2^-80, whose residuals are
//     normal; below 2^-20 every faithful quotient has the fp8 code +-0, and the sign is x's
//     (copysign, which also keeps -0). Other packs take the division (QuantizePack).
//   * GPU arithmetic returns a canonical NaN, while a CPU division returns its NaN operand (x,
//     else the scale) with its sign; since the sign of a NaN reaches the fp8 code, the quotient
//     of a NaN operand is replaced by that operand (QuantizeValue), and float16 NaNs keep their
//     sign through the conversion to fp32 (LoadFloat).
//   * On sm_89 and later the quotients are encoded by the hardware conversion, two at a time
//     (cvt.rn.satfinite: round to nearest even, +-Inf and out-of-range values saturate to the
//     largest finite code), which is EncodeFp8's rounding and saturation; only NaN differs (the
//     hardware's NaN code drops the sign), so a NaN quotient takes EncodeFp8's code (EncodeNaN).
//     Older architectures run EncodeFp8 itself.
// amaxes are unsigned maxima over fp32 bits (non-negative floats order like their bits), so
// every reduction - shuffles, shared and global atomicMax - is exact and order-independent.
#ifndef JAXOPS_XLA_FFI_FP8_KERNEL_UTIL_CUH_
#define JAXOPS_XLA_FFI_FP8_KERNEL_UTIL_CUH_

#include <cuda_fp8.h>
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
constexpr int kMinTile = 32;        // Smallest G.
constexpr int kMaxTile = 128;       // Largest G (rows and columns of a tile).
constexpr int kRowsPacks = 2;       // 16-byte packs per lane and group in Fp8RowsKernel.
constexpr int kFlatPacks = 2;       // Packs per thread and iteration in Fp8PerTensorKernel.
// Resident CTAs per SM Fp8TileKernel is compiled for (its register cap: 40, no spills). Left to
// itself, ptxas (nvcc 13.0, sm_90a) gave its instances 60 to 114 registers (loop invariants kept
// live), 2 to 4 CTAs per SM.
constexpr int kTileMinCtas = 6;
// G = 128 tiles whose shared memory allows at most 4 CTAs per SM (16-bit x with the code tile,
// about 50 KiB; float32, 65-81 KiB): Fp8TileKernel issues kBigTileLoadBatch loads at once in
// LoadTile (a thread loads 8 or 16 packs of such a tile, 64 elements on the scalar fallback) and
// is compiled for kBigTileMinCtas CTAs per SM (at most 64 registers; ptxas used 55 to 63, no
// spills; a batch of 4 spilled for float16). Without the code tile a 16-bit G = 128 tile takes
// 33 KiB, and 6 CTAs of the 40-register instance fit: those keep one load at a time.
constexpr int kBigTileLoadBatch = 2;
constexpr int kBigTileMinCtas = 4;
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

// A block's quantizer: the scale; inv = 1 / scale when x * (1 / scale) == x / scale for every x
// (scale a positive power of two whose reciprocal is a normal float), else 0; rcp = RN(1 / scale)
// for the corrected quotient when inv is 0 and scale is in [2^-60, 2^60], else 0. Plain data, so
// it can live in shared memory.
struct Quant {
  float scale;
  float inv;
  float rcp;
};

// Bounds of the corrected quotient (see the file comment), and the bits of +Inf: |x| bits at or
// above it are Inf or NaN.
constexpr float kRcpMinScale = 0x1p-60f;
constexpr float kRcpMaxScale = 0x1p60f;
constexpr uint32_t kRcpMaxAbsBits = 0x5d800000u;  // 2^60
constexpr uint32_t kInfBits = 0x7f800000u;

__device__ __forceinline__ Quant MakeQuant(float scale) {
  const uint32_t u = Bits(scale);
  const uint32_t exponent = u >> 23;  // with the sign bit: negative scales fail the range test
  const bool pow2 = (u & 0x007fffffu) == 0 && exponent >= 1 && exponent <= 253;
  const bool rcp = !pow2 && scale >= kRcpMinScale && scale <= kRcpMaxScale;
  return Quant{scale, pow2 ? FromBits((254u - exponent) << 23) : 0.0f,
               rcp ? __frcp_rn(scale) : 0.0f};
}

// RN(x / q.scale) for finite x with |x| <= 2^60, given q.rcp != 0 (see the file comment).
__device__ __forceinline__ float CorrectedQuotient(float x, const Quant& q) {
  float y = __fmul_rn(x, q.rcp);
  y = __fmaf_rn(q.rcp, __fmaf_rn(-q.scale, y, x), y);
  y = __fmaf_rn(q.rcp, __fmaf_rn(-q.scale, y, x), y);
  return copysignf(y, x);
}

// The quotient the CPU division returns for x / scale given the device's y: a NaN quotient takes
// the sign of the NaN operand the CPU returns (x first, then the scale); only the sign of a NaN
// reaches the code.
__device__ __forceinline__ float CpuQuotient(float x, float y, float scale) {
  return isnan(y) ? (isnan(x) ? x : (isnan(scale) ? scale : y)) : y;
}

// EncodeFp8's code of a NaN y (the format's NaN code with y's sign), else `code`.
template <typename F>
__device__ __forceinline__ uint32_t EncodeNaN(float y, uint32_t code) {
  return isnan(y) ? (F::kNanCode | ((Bits(y) >> 24) & 0x80u)) : code;
}

// EncodeFp8<F>(y0) | EncodeFp8<F>(y1) << 8 for y0, y1 that are not NaN, by the hardware
// conversion where there is one.
template <typename F>
__device__ __forceinline__ uint32_t EncodePairNotNaN(float y0, float y1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  constexpr __nv_fp8_interpretation_t kKind = std::is_same_v<F, E4M3> ? __NV_E4M3 : __NV_E5M2;
  return __nv_cvt_float2_to_fp8x2(make_float2(y0, y1), __NV_SATFINITE, kKind);
#else
  return EncodeFp8<F>(y0) | (static_cast<uint32_t>(EncodeFp8<F>(y1)) << 8);
#endif
}

// EncodeFp8<F>(y0) | EncodeFp8<F>(y1) << 8.
template <typename F>
__device__ __forceinline__ uint32_t EncodePair(float y0, float y1) {
  const uint32_t both = EncodePairNotNaN<F>(y0, y1);
  return EncodeNaN<F>(y0, both & 0xffu) | (EncodeNaN<F>(y1, (both >> 8) & 0xffu) << 8);
}

// fp8 code of x given y = x / scale computed on the device.
template <typename F>
__device__ __forceinline__ uint8_t EncodeQuotient(float x, float y, float scale) {
  return static_cast<uint8_t>(EncodePair<F>(CpuQuotient(x, y, scale), 0.0f));
}

template <typename F>
__device__ __forceinline__ uint8_t QuantizeValue(float x, const Quant& q) {
  const float y = q.inv != 0.0f ? __fmul_rn(x, q.inv) : DivRn(x, q.scale);
  return EncodeQuotient<F>(x, y, q.scale);
}

// The largest |x| bits of a pack, NaN and Inf included (their bits are above every finite value's).
template <typename T, int kVec>
__device__ __forceinline__ uint32_t PackAbsBits(const Pack<T, kVec>& p) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < kVec; ++j) m = MaxBits(m, Bits(LoadFloat(p.v[j])) & 0x7fffffffu);
  return m;
}

// kVec fp8 codes as they are stored: 32-bit words of four codes (the first in the low byte), or
// one code in w[0]'s low byte for kVec = 1.
template <int kVec>
struct CodePack {
  static_assert(kVec == 1 || kVec == 4 || kVec == 8 || kVec == 16, "kVec: 1, 4, 8 or 16");
  uint32_t w[kVec >= 4 ? kVec / 4 : 1];
};

// Codes of kVec quotients, encoded in pairs; kChecked: some may be NaN.
template <typename F, bool kChecked, int kVec>
__device__ __forceinline__ void EncodeQuotients(const float (&y)[kVec], CodePack<kVec>& out) {
  if constexpr (kVec == 1) {
    out.w[0] = (kChecked ? EncodePair<F>(y[0], 0.0f) : EncodePairNotNaN<F>(y[0], 0.0f)) & 0xffu;
  } else {
#pragma unroll
    for (int j = 0; j < kVec; j += 4) {
      const uint32_t lo =
          kChecked ? EncodePair<F>(y[j], y[j + 1]) : EncodePairNotNaN<F>(y[j], y[j + 1]);
      const uint32_t hi =
          kChecked ? EncodePair<F>(y[j + 2], y[j + 3]) : EncodePairNotNaN<F>(y[j + 2], y[j + 3]);
      out.w[j / 4] = (lo & 0xffffu) | (hi << 16);
    }
  }
}

// Codes of a pack of kVec elements. One branch for the whole pack: finite x times a power-of-two
// reciprocal, or finite x up to 2^60 over a scale with rcp (the corrected quotient), are encoded
// without per-element branches; other packs (NaN, Inf, a scale without inv or rcp) take the
// division and the NaN rules.
// abs_bits: PackAbsBits(in).
template <typename F, int kVec, typename T>
__device__ __forceinline__ void QuantizePack(const Pack<T, kVec>& in, uint32_t abs_bits,
                                             const Quant& q, CodePack<kVec>& codes) {
  float y[kVec];
  if (q.inv != 0.0f && abs_bits < kInfBits) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) y[j] = __fmul_rn(LoadFloat(in.v[j]), q.inv);
    EncodeQuotients<F, false>(y, codes);
  } else if (q.rcp != 0.0f && abs_bits <= kRcpMaxAbsBits) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) y[j] = CorrectedQuotient(LoadFloat(in.v[j]), q);
    EncodeQuotients<F, false>(y, codes);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = LoadFloat(in.v[j]);
      const float quotient = q.inv != 0.0f ? __fmul_rn(x, q.inv) : DivRn(x, q.scale);
      y[j] = CpuQuotient(x, quotient, q.scale);
    }
    EncodeQuotients<F, true>(y, codes);
  }
}

// Four consecutive elements of a shared tile; p is 4-byte aligned for 16-bit T (two 32-bit loads,
// so a warp reading consecutive quads is at most 2-way bank conflicted).
template <typename T>
__device__ __forceinline__ Pack<T, 4> LoadSharedQuad(const T* p) {
  Pack<T, 4> q;
  if constexpr (sizeof(T) == 2) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(p);
    uint32_t* dst = reinterpret_cast<uint32_t*>(&q);
    dst[0] = src[0];
    dst[1] = src[1];
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) q.v[j] = p[j];
  }
  return q;
}

// The bits of element e (0..3, a runtime index: selects, no local memory) of a quad, zero-extended.
template <typename T>
__device__ __forceinline__ uint32_t QuadElementBits(const Pack<T, 4>& quad, int e) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(&quad);
  if constexpr (sizeof(T) == 2) {
    const uint32_t word = e < 2 ? w[0] : w[1];
    return (e & 1) != 0 ? word >> 16 : word & 0xffffu;
  } else {
    return e < 2 ? ((e & 1) != 0 ? w[1] : w[0]) : ((e & 1) != 0 ? w[3] : w[2]);
  }
}

// The quad whose element j has the bits QuadElementBits returned in bits[j].
template <typename T>
__device__ __forceinline__ Pack<T, 4> QuadFromBits(const uint32_t (&bits)[4]) {
  Pack<T, 4> quad;
  uint32_t* w = reinterpret_cast<uint32_t*>(&quad);
  if constexpr (sizeof(T) == 2) {
    w[0] = bits[0] | (bits[1] << 16);
    w[1] = bits[2] | (bits[3] << 16);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = bits[j];
  }
  return quad;
}

// Stores kVec codes at p (aligned to kVec bytes): one access.
template <int kVec>
__device__ __forceinline__ void StoreCodes(uint8_t* p, const CodePack<kVec>& codes) {
  if constexpr (kVec == 1) {
    *p = static_cast<uint8_t>(codes.w[0]);
  } else if constexpr (kVec == 4) {
    *reinterpret_cast<uint32_t*>(p) = codes.w[0];
  } else if constexpr (kVec == 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(codes.w[0], codes.w[1]);
  } else {
    *reinterpret_cast<uint4*>(p) = make_uint4(codes.w[0], codes.w[1], codes.w[2], codes.w[3]);
  }
}

template <typename T, int kVec>
__device__ __forceinline__ uint32_t PackAmax(const Pack<T, kVec>& p) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < kVec; ++j) m = MaxBits(m, FiniteAbsBits(LoadFloat(p.v[j])));
  return m;
}

// The finite amax of a pack given abs_bits = PackAbsBits(p): abs_bits itself unless the pack holds
// Inf or NaN (then measured again without them).
template <typename T, int kVec>
__device__ __forceinline__ uint32_t PackFiniteAmax(const Pack<T, kVec>& p, uint32_t abs_bits) {
  return abs_bits < kInfBits ? abs_bits : PackAmax(p);
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

// Calls f(r0, c) for this warp's blocks of 32 rows x 4 columns of a g x g tile (g a multiple of
// 32): blocks warp, warp + warps, ... of the CTA's warps, rows fastest. Warp-uniform, so f may
// shuffle.
template <typename Fn>
__device__ __forceinline__ void ForEachQuadBlock(int g, Fn&& f) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int warps = static_cast<int>(blockDim.x) / kWarpSize;
  const int row_blocks = g / kWarpSize;
  for (int block = warp; block < row_blocks * (g / 4); block += warps) {
    f((block % row_blocks) * kWarpSize, (block / row_blocks) * 4);
  }
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

// Stores a pack at tile + offset (shared): as 32-bit words for 16-bit T (offset even, so they are
// aligned), else element by element.
template <typename T, int kVec>
__device__ __forceinline__ void StoreSharedPack(T* dst, const Pack<T, kVec>& p) {
  if constexpr (sizeof(T) == 2 && kVec % 2 == 0) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(&p);
    uint32_t* words = reinterpret_cast<uint32_t*>(dst);
#pragma unroll
    for (int j = 0; j < kVec / 2; ++j) words[j] = src[j];
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) dst[j] = p.v[j];
  }
}

// Loads the rows x cols block at src (row stride ld) into tile[r * pitch + c] (r < rows,
// c < cols; the rest of the tile_rows x 2^cols_log2 tile is not written) and reduces amaxes from
// the loaded registers: row_amax[r] and col_amax[c] (shared, zero before the call; each skipped
// when nullptr) get atomicMax'ed, and the thread's max over everything it loaded is returned
// (for a tile amax). A tile row is 2^cols_log2 / kVec consecutive threads (`lanes`); with
// kVec > 1, cols and every offset are multiples of kVec and src is 16-byte aligned; for 16-bit T
// (StoreSharedPack writes 32-bit words) the tile is 4-byte aligned and pitch is even. A thread
// has kBatch loads in flight at once. Every thread of the CTA must call it (shuffles).
template <int kVec, int kBatch = 1, typename T>
__device__ __forceinline__ uint32_t LoadTile(const T* src, int64_t ld, int rows, int cols,
                                             int tile_rows, int cols_log2, T* tile, int pitch,
                                             uint32_t* row_amax, uint32_t* col_amax) {
  const int lanes_log2 = cols_log2 - Log2(kVec);
  const int lanes = 1 << lanes_log2;
  const int row_lanes = lanes < kWarpSize ? lanes : kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int threads = static_cast<int>(blockDim.x);
  // tile_rows * lanes is a multiple of 32, so every warp runs the same number of iterations.
  const int slots = tile_rows << lanes_log2;
  // blockDim.x is a multiple of lanes: a thread always loads the same columns.
  const int col = (static_cast<int>(threadIdx.x) & (lanes - 1)) * kVec;
  uint32_t col_max[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) col_max[j] = 0;
  uint32_t total = 0;
  // The pack of slot row r (when present): into the tile, and into the amaxes.
  auto consume = [&](const Pack<T, kVec>& p, bool present, int r) {
    uint32_t vmax = 0;
    if (present) {
      StoreSharedPack(tile + r * pitch + col, p);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
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
  };
  if constexpr (kBatch == 1) {
    for (int s = threadIdx.x; s < slots; s += threads) {
      const int r = s >> lanes_log2;
      const bool present = r < rows && col < cols;
      Pack<T, kVec> p;
      if (present) LoadPack(src + r * ld + col, p);
      consume(p, present, r);
    }
  } else {
    for (int s0 = threadIdx.x; s0 < slots; s0 += kBatch * threads) {
      // kBatch loads in flight before any is used (`s < slots` is the same for a whole warp).
      Pack<T, kVec> p[kBatch];
      bool present[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int s = s0 + u * threads;
        const int r = s >> lanes_log2;
        present[u] = s < slots && r < rows && col < cols;
        if (present[u]) LoadPack(src + r * ld + col, p[u]);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int s = s0 + u * threads;
        if (s < slots) consume(p[u], present[u], s >> lanes_log2);
      }
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

}  // namespace jaxops::fp8

#endif  // JAXOPS_XLA_FFI_FP8_KERNEL_UTIL_CUH_
