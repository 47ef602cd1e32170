// CUDA kernels of the grouped GEMM family: one tiled kernel for the forward (x @ w[g], or
// x @ w[g].T) and the weight gradient (x[rows of g].T @ dy[rows of g]), templated over the
// element type and the operands' layouts; cuda.cu validates, picks and launches them.
//
// A CTA computes a kBm x kBn tile of one group's product, stepping kBk deep through the
// contraction: it loads an A and a B tile (16-byte loads where the rows allow them, else element
// by element, zeros past the edges) into registers, then shared memory, issuing the next step's
// loads before multiplying the current tiles with fp32 accumulation: tensor-core WMMA fragments (16
// x 16 x 16) for bfloat16 and float16, FMAs of an 8 x 8 register tile per thread for float32
// (products and sums stay float32, as the CPU kernels and XLA:CPU compute them). Group sizes are
// device data: every CTA reads them and finds its own tile with a scan over the CTA (no host round
// trip, no scratch buffer).
//   forward: grid.x = ceil(R / kBm) + G + 1 row tiles (each group's tiles in group order, then
//            tiles that zero the rows past the groups, unless zero_tail is false; spare ones
//            return), grid.y = ceil(N / kBn);
//   wgrad:   grid.x = G * ceil(K / kBm), grid.y = ceil(N / kBn); each CTA walks its group's rows.
// Group sizes are clipped as the CPU kernels clip them (grouped_gemm.h's ClipGroups): negative
// counts as 0, no group past the last row.
//
// Two pipelines feed the multiply (the kernels' kStages): 0, the next step's tiles staged in
// registers and stored to one shared buffer per operand (two barriers a step); or, for bfloat16
// and float16, kAsyncStages shared buffers filled by cp.async (16-byte global -> shared copies,
// zero-filled past the edges) kAsyncStages - 1 steps ahead of the multiply (one barrier a step;
// dynamic shared memory). cuda.cu picks one (JAXOPS_GPU_GEMM_PIPELINE).
#ifndef JAXOPS_XLA_FFI_GROUPED_GEMM_KERNELS_CUH_
#define JAXOPS_XLA_FFI_GROUPED_GEMM_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "xla_ffi/common/cuda_util.cuh"
#include "xla_ffi/common/cuda_vec.cuh"

namespace jaxops::grouped_gemm {

inline constexpr int kBm = 128;  // Output rows per CTA tile.
inline constexpr int kBn = 128;  // Output columns per CTA tile.
inline constexpr int kBk = 32;   // Contraction depth per shared-memory step.
inline constexpr int kThreads = 256;
inline constexpr int kPad = 8;     // Shared rows padded by 16 bytes (16-bit) against conflicts.
inline constexpr int kFrag = 16;   // WMMA fragment edge.
inline constexpr int kWarpsM = 2;  // Warps along the tile's rows (64 rows each) ...
inline constexpr int kWarpsN = 4;  // ... and columns (32 columns each).
inline constexpr int kWarpRows = kBm / kWarpsM;
inline constexpr int kWarpCols = kBn / kWarpsN;
inline constexpr int kThreadTile = 8;  // float32: an 8 x 8 tile per thread, strided by 16.
static_assert(kWarpsM * kWarpsN * kWarpSize == kThreads, "one warp per warp tile");
static_assert(16 * kThreadTile == kBm && 16 * kThreadTile == kBn, "16 x 16 threads cover a tile");

// The operands of one launch. Pointers are to whole arrays; the CTA offsets them.
template <typename T>
struct Args {
  const T* a = nullptr;            // forward: x [R, K]; wgrad: x [R, K] (read as its transpose)
  const T* b = nullptr;            // forward: w [G, K, N] or [G, N, K]; wgrad: dy [R, N]
  const int32_t* sizes = nullptr;  // [G]
  float* out = nullptr;            // forward: y [R, N]; wgrad: dw [G, K, N]
  int64_t rows = 0;                // R
  int64_t k = 0;                   // K
  int64_t n = 0;                   // N
  int64_t groups = 0;              // G
  bool a_vec = false;              // a's rows allow 16-byte loads (aligned base, ld % vec == 0)
  bool b_vec = false;
  bool zero_tail = true;  // forward: zero y's rows past the groups (else unwritten)
};

// CTAs per SM the kernels ask registers for: two for the 16-bit types (128 registers, the
// WMMA path held without spills in the forward, 16-24 bytes in the wgrad), one for float32 (its
// 8 x 8 tile, staged loads and addresses took up to 238 registers; 128 spilled 368-444 bytes).
template <typename T>
inline constexpr int kMinCtas = std::is_same_v<T, float> ? 1 : 2;

// ---------------------------------------------------------------------------------------------
// Shared-memory tiles.

// A kRows x kCols tile of a row-major matrix, padded rows; element (r, c) at data[r][c].
template <typename T, int kRows, int kCols>
struct Tile {
  static constexpr int kLd = kCols + kPad;
  alignas(128) T data[kRows][kLd];
};

// A tile's share of one thread, staged in registers between the global loads and the shared
// store (so the next step's loads are in flight while the CTA multiplies the current tiles):
// kSlots 16-byte accesses, access v = threadIdx.x + i * kThreads of the tile row-major.
template <typename T, int kRows, int kCols>
struct Staged {
  static constexpr int kV = kVecElems<T>;
  static constexpr int kPerRow = kCols / kV;
  static constexpr int kSlots = kRows * kPerRow / kThreads;
  static_assert(kCols % kV == 0 && (kRows * kPerRow) % kThreads == 0, "whole accesses per thread");
  uint4 v[kSlots];
};

// The 16 bytes of elements [c, c + kVecElems) of tile row r (at `row`), read one at a time: zero
// past vr valid rows and vc valid columns (nothing there is read).
template <typename T>
__device__ __forceinline__ uint4 LoadElements(const T* row, int r, int c, int64_t vr, int64_t vc) {
  constexpr int kV = kVecElems<T>;
  T e[kV];
#pragma unroll
  for (int k = 0; k < kV; ++k) e[k] = (r < vr && c + k < vc) ? row[c + k] : FromFloat<T>(0.0f);
  uint4 word;
  memcpy(&word, e, sizeof(uint4));
  return word;
}

// Loads this thread's share of the tile whose (0, 0) is src (rows ld apart) with vr valid rows
// and vc valid columns; the rest is zero. 16-byte loads where `vec` and the whole access is
// inside the valid columns, else element by element.
template <typename T, int kRows, int kCols>
__device__ __forceinline__ void Fetch(Staged<T, kRows, kCols>& st, const T* src, int64_t ld,
                                      int64_t vr, int64_t vc, bool vec) {
  using S = Staged<T, kRows, kCols>;
#pragma unroll
  for (int i = 0; i < S::kSlots; ++i) {
    const int v = static_cast<int>(threadIdx.x) + i * kThreads;
    const int r = v / S::kPerRow;
    const int c = (v % S::kPerRow) * S::kV;
    // Rows past vr are never read (their address is formed, not dereferenced: computing it
    // inside the guards kept 64-bit offsets live and spilled 104-176 bytes at 128 registers).
    const T* row = src + static_cast<int64_t>(r) * ld;
    if (vec && r < vr && c + S::kV <= vc) {
      st.v[i] = __ldg(reinterpret_cast<const uint4*>(row + c));
    } else {
      st.v[i] = LoadElements<T>(row, r, c, vr, vc);
    }
  }
}

// Stores this thread's staged share into the shared tile.
template <typename T, int kRows, int kCols>
__device__ __forceinline__ void Store(Tile<T, kRows, kCols>& tile,
                                      const Staged<T, kRows, kCols>& st) {
  using S = Staged<T, kRows, kCols>;
#pragma unroll
  for (int i = 0; i < S::kSlots; ++i) {
    const int v = static_cast<int>(threadIdx.x) + i * kThreads;
    *reinterpret_cast<uint4*>(&tile.data[v / S::kPerRow][(v % S::kPerRow) * S::kV]) = st.v[i];
  }
}

// ---------------------------------------------------------------------------------------------
// Asynchronous copies (sm_80 and later): the multi-stage pipeline's global -> shared loads.

// Copies src_bytes (16 or 0) bytes from global src to shared dst and zero-fills the rest of the
// 16; both addresses 16-byte aligned. Completes at a later CopyAsyncWait.
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src, int src_bytes) {
  const unsigned shared = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(src),
               "r"(src_bytes)
               : "memory");
}

// Closes this thread's group of copies issued since the last commit.
__device__ __forceinline__ void CopyAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Fetch's counterpart for the multi-stage pipeline: this thread's share of the tile straight
// into shared memory. Accesses that Fetch loads 16 bytes at a time are asynchronous copies (rows
// past vr copy 0 bytes from the tile's first element, which is valid, and are zero-filled); the
// others are read element by element (zeros past the edges) and stored at once.
template <typename T, int kRows, int kCols>
__device__ __forceinline__ void Fetch(Tile<T, kRows, kCols>& tile, const T* src, int64_t ld,
                                      int64_t vr, int64_t vc, bool vec) {
  using S = Staged<T, kRows, kCols>;
#pragma unroll
  for (int i = 0; i < S::kSlots; ++i) {
    const int v = static_cast<int>(threadIdx.x) + i * kThreads;
    const int r = v / S::kPerRow;
    const int c = (v % S::kPerRow) * S::kV;
    const T* row = src + static_cast<int64_t>(r) * ld;
    T* dst = &tile.data[r][c];
    if (vec && c + S::kV <= vc) {
      const bool valid = r < vr;
      CopyAsync16(dst, valid ? row + c : src, valid ? 16 : 0);
    } else {
      *reinterpret_cast<uint4*>(dst) = LoadElements<T>(row, r, c, vr, vc);
    }
  }
}

// The A tile: [kBm][kBk] (A(m, k) = data[m][k]) or, kACol, [kBk][kBm] (A(m, k) = data[k][m]).
template <typename T, bool kACol>
using ATile = std::conditional_t<kACol, Tile<T, kBk, kBm>, Tile<T, kBm, kBk>>;
template <typename T, bool kACol>
using AStaged = std::conditional_t<kACol, Staged<T, kBk, kBm>, Staged<T, kBm, kBk>>;
// The B tile: [kBk][kBn] (B(k, n) = data[k][n]) or, kBCol, [kBn][kBk] (B(k, n) = data[n][k]).
template <typename T, bool kBCol>
using BTile = std::conditional_t<kBCol, Tile<T, kBn, kBk>, Tile<T, kBk, kBn>>;
template <typename T, bool kBCol>
using BStaged = std::conditional_t<kBCol, Staged<T, kBn, kBk>, Staged<T, kBk, kBn>>;

template <typename T, bool kACol>
__device__ __forceinline__ float AAt(const ATile<T, kACol>& a, int m, int k) {
  if constexpr (kACol) {
    return ToFloat(a.data[k][m]);
  } else {
    return ToFloat(a.data[m][k]);
  }
}

template <typename T, bool kBCol>
__device__ __forceinline__ float BAt(const BTile<T, kBCol>& b, int k, int n) {
  if constexpr (kBCol) {
    return ToFloat(b.data[n][k]);
  } else {
    return ToFloat(b.data[k][n]);
  }
}

// ---------------------------------------------------------------------------------------------
// The CTA's multiply-accumulate of one kBk step, and its output.

// float32: thread (ty, tx) of 16 x 16 owns rows ty + 16 i and columns tx + 16 j.
struct SimtAcc {
  float v[kThreadTile][kThreadTile];
};

template <typename T, bool kACol, bool kBCol>
__device__ __forceinline__ void SimtStep(const ATile<T, kACol>& a, const BTile<T, kBCol>& b,
                                         SimtAcc& acc) {
  const int ty = static_cast<int>(threadIdx.x) / 16;
  const int tx = static_cast<int>(threadIdx.x) % 16;
#pragma unroll 4
  for (int k = 0; k < kBk; ++k) {
    float av[kThreadTile];
    float bv[kThreadTile];
#pragma unroll
    for (int i = 0; i < kThreadTile; ++i) av[i] = AAt<T, kACol>(a, ty + 16 * i, k);
#pragma unroll
    for (int j = 0; j < kThreadTile; ++j) bv[j] = BAt<T, kBCol>(b, k, tx + 16 * j);
#pragma unroll
    for (int i = 0; i < kThreadTile; ++i) {
#pragma unroll
      for (int j = 0; j < kThreadTile; ++j) acc.v[i][j] = fmaf(av[i], bv[j], acc.v[i][j]);
    }
  }
}

// Writes out[(m, n)] = acc for the tile's rows m < vr and columns n < vc; out points at the
// tile's (0, 0), rows ld apart.
__device__ __forceinline__ void SimtStore(const SimtAcc& acc, float* out, int64_t ld, int64_t vr,
                                          int64_t vc) {
  const int ty = static_cast<int>(threadIdx.x) / 16;
  const int tx = static_cast<int>(threadIdx.x) % 16;
#pragma unroll
  for (int i = 0; i < kThreadTile; ++i) {
    const int m = ty + 16 * i;
    if (m >= vr) continue;
#pragma unroll
    for (int j = 0; j < kThreadTile; ++j) {
      const int c = tx + 16 * j;
      if (c < vc) out[static_cast<int64_t>(m) * ld + c] = acc.v[i][j];
    }
  }
}

// bfloat16 / float16: warp (wm, wn) of kWarpsM x kWarpsN owns a 64 x 32 block, 4 x 2 fragments.
template <typename T>
using WmmaType = std::conditional_t<std::is_same_v<T, __half>, __half, __nv_bfloat16>;
using AccFrag = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, kFrag, kFrag, kFrag, float>;
inline constexpr int kFragsM = kWarpRows / kFrag;
inline constexpr int kFragsN = kWarpCols / kFrag;

struct WmmaAcc {
  AccFrag f[kFragsM][kFragsN];
};

template <typename T, bool kACol, bool kBCol>
__device__ __forceinline__ void WmmaStep(const ATile<T, kACol>& a, const BTile<T, kBCol>& b,
                                         WmmaAcc& acc) {
  namespace wmma = nvcuda::wmma;
  using ALayout = std::conditional_t<kACol, wmma::col_major, wmma::row_major>;
  using BLayout = std::conditional_t<kBCol, wmma::col_major, wmma::row_major>;
  using E = WmmaType<T>;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int m0 = (warp / kWarpsN) * kWarpRows;
  const int n0 = (warp % kWarpsN) * kWarpCols;
#pragma unroll
  for (int kk = 0; kk < kBk; kk += kFrag) {
    wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, E, ALayout> af[kFragsM];
    wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, E, BLayout> bf[kFragsN];
#pragma unroll
    for (int i = 0; i < kFragsM; ++i) {
      const int m = m0 + i * kFrag;
      const T* p = kACol ? &a.data[kk][m] : &a.data[m][kk];
      wmma::load_matrix_sync(af[i], reinterpret_cast<const E*>(p), ATile<T, kACol>::kLd);
    }
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) {
      const int n = n0 + j * kFrag;
      const T* p = kBCol ? &b.data[n][kk] : &b.data[kk][n];
      wmma::load_matrix_sync(bf[j], reinterpret_cast<const E*>(p), BTile<T, kBCol>::kLd);
    }
#pragma unroll
    for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) wmma::mma_sync(acc.f[i][j], af[i], bf[j], acc.f[i][j]);
    }
  }
}

// Writes the warp's fragments through its kFrag x kFrag slice of `stage` (shared), keeping rows
// m < vr and columns n < vc of the tile; out points at the tile's (0, 0), rows ld apart.
__device__ __forceinline__ void WmmaStore(WmmaAcc& acc, float* stage, float* out, int64_t ld,
                                          int64_t vr, int64_t vc) {
  namespace wmma = nvcuda::wmma;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int m0 = (warp / kWarpsN) * kWarpRows;
  const int n0 = (warp % kWarpsN) * kWarpCols;
  float* mine = stage + warp * kFrag * kFrag;
#pragma unroll
  for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) {
      wmma::store_matrix_sync(mine, acc.f[i][j], kFrag, wmma::mem_row_major);
      __syncwarp();
      // Each lane writes 8 elements: half a row of the fragment.
      const int r = lane / 2;
      const int c0 = (lane % 2) * 8;
      const int m = m0 + i * kFrag + r;
      if (m < vr) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int c = n0 + j * kFrag + c0 + e;
          if (c < vc) out[static_cast<int64_t>(m) * ld + c] = mine[r * kFrag + c0 + e];
        }
      }
      __syncwarp();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Finding a CTA's group.

// What a CTA learns of the groups (shared memory).
struct GroupSpan {
  int64_t group;       // -1: not found
  int64_t begin;       // first row of the group (clipped)
  int64_t end;         // one past its last row (clipped)
  int64_t tile_first;  // forward: the first row of the CTA's tile
  int64_t used_rows;   // rows the groups cover (the clipped sizes' sum)
  int64_t used_tiles;  // forward: row tiles of all groups
};

// Scans the clipped group sizes over the CTA, kThreads groups at a time. With `want_tile` >= 0
// (forward), finds the group of row tile `want_tile` (tiles of kBm rows, group by group); with
// `want_group` >= 0 (wgrad), that group's rows. Every thread of the CTA calls it; `span` is
// complete for all of them on return.
__device__ inline void FindSpan(const int32_t* sizes, int64_t groups, int64_t rows,
                                int64_t want_tile, int64_t want_group, GroupSpan& span,
                                long long* warp_totals) {
  if (threadIdx.x == 0) span.group = -1;
  long long rows_before = 0;
  long long tiles_before = 0;
  for (int64_t base = 0; base < groups; base += kThreads) {
    const int64_t g = base + threadIdx.x;
    const long long size = g < groups ? (sizes[g] > 0 ? sizes[g] : 0) : 0;
    long long chunk_rows = 0;
    const long long rows_incl = BlockInclusiveScan(size, warp_totals, chunk_rows);
    const long long begin_raw = rows_before + rows_incl - size;
    const long long begin = begin_raw < rows ? begin_raw : rows;
    const long long end_raw = rows_before + rows_incl;
    const long long end = end_raw < rows ? end_raw : rows;
    const long long tiles = (end - begin + kBm - 1) / kBm;
    long long chunk_tiles = 0;
    const long long tiles_incl = BlockInclusiveScan(tiles, warp_totals, chunk_tiles);
    const long long tile_begin = tiles_before + tiles_incl - tiles;
    if (g < groups) {
      const bool hit = want_group >= 0
                           ? g == want_group
                           : (want_tile >= tile_begin && want_tile < tile_begin + tiles);
      if (hit) {
        span.group = g;
        span.begin = begin;
        span.end = end;
        span.tile_first = begin + (want_tile - tile_begin) * kBm;
      }
    }
    rows_before += chunk_rows;
    tiles_before += chunk_tiles;
  }
  if (threadIdx.x == 0) {
    span.used_rows = rows_before < rows ? rows_before : rows;
    span.used_tiles = tiles_before;
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// The kernels.

// One kBm x kBn tile of out (rows m, columns n) = sum over the contraction of A(m, k) B(k, n),
// where fetch(step, a_staged, b_staged) loads this thread's share of contraction step `step`'s
// tiles into registers, into acc. Software-pipelined: step s + 1's loads are issued before step
// s's multiply.
template <typename T, bool kACol, bool kBCol, typename Acc, typename FetchStep>
__device__ __forceinline__ void Pipeline(int64_t steps, FetchStep& fetch, Acc& acc) {
  __shared__ ATile<T, kACol> a;
  __shared__ BTile<T, kBCol> b;
  AStaged<T, kACol> sa;
  BStaged<T, kBCol> sb;
  if (steps > 0) fetch(0, sa, sb);
  for (int64_t s = 0; s < steps; ++s) {
    Store(a, sa);
    Store(b, sb);
    __syncthreads();
    if (s + 1 < steps) fetch(s + 1, sa, sb);
    if constexpr (std::is_same_v<T, float>) {
      SimtStep<T, kACol, kBCol>(a, b, acc);
    } else {
      WmmaStep<T, kACol, kBCol>(a, b, acc);
    }
    __syncthreads();  // the tiles are rewritten by the next step
  }
}

// One stage of the multi-stage pipeline: an A and a B tile.
template <typename T, bool kACol, bool kBCol>
struct StageTiles {
  ATile<T, kACol> a;
  BTile<T, kBCol> b;
};

// Shared buffers of the multi-stage pipeline (bfloat16 / float16): 4 stages are 68-80 KiB of
// dynamic shared memory, two CTAs per SM (with the static epilogue stage) inside Hopper's 227 KiB.
inline constexpr int kAsyncStages = 4;

template <typename T, bool kACol, bool kBCol, int kStages>
inline constexpr size_t kAsyncSharedBytes = kStages * sizeof(StageTiles<T, kACol, kBCol>);

// Pipeline with kStages shared stages filled by asynchronous copies, kStages - 1 steps ahead:
// step s waits for its own copies, one barrier (all of step s's tiles are in; every thread is
// done with step s - 1's buffer), issues step s + kStages - 1 into that buffer, multiplies.
// fetch(step, a_tile, b_tile) fills a stage's tiles (Fetch on shared tiles).
template <typename T, bool kACol, bool kBCol, int kStages, typename Acc, typename FetchStep>
__device__ __forceinline__ void PipelineAsync(int64_t steps, FetchStep& fetch, Acc& acc) {
  static_assert(kStages >= 2, "at least one stage in flight while one is multiplied");
  extern __shared__ __align__(128) unsigned char dynamic_shared[];
  auto* stages = reinterpret_cast<StageTiles<T, kACol, kBCol>*>(dynamic_shared);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) fetch(s, stages[s].a, stages[s].b);
    CopyAsyncCommit();  // (empty groups past the last step keep the wait's count uniform)
  }
  for (int64_t s = 0; s < steps; ++s) {
    CopyAsyncWait<kStages - 2>();
    __syncthreads();
    const int64_t ahead = s + kStages - 1;
    if (ahead < steps) {
      StageTiles<T, kACol, kBCol>& next = stages[ahead % kStages];
      fetch(ahead, next.a, next.b);
    }
    CopyAsyncCommit();
    const StageTiles<T, kACol, kBCol>& now = stages[s % kStages];
    if constexpr (std::is_same_v<T, float>) {
      SimtStep<T, kACol, kBCol>(now.a, now.b, acc);
    } else {
      WmmaStep<T, kACol, kBCol>(now.a, now.b, acc);
    }
  }
}

// Pipeline's product, stored: rows m < vr and columns n < vc of the tile at out (rows ld apart).
// kStages: 0, the register-staged Pipeline; else PipelineAsync with that many stages.
template <typename T, bool kACol, bool kBCol, int kStages, typename FetchStep>
__device__ __forceinline__ void TileProduct(int64_t steps, FetchStep&& fetch, float* out,
                                            int64_t ld, int64_t vr, int64_t vc) {
  if constexpr (std::is_same_v<T, float>) {
    SimtAcc acc;
#pragma unroll
    for (int i = 0; i < kThreadTile; ++i) {
#pragma unroll
      for (int j = 0; j < kThreadTile; ++j) acc.v[i][j] = 0.0f;
    }
    if constexpr (kStages > 0) {
      PipelineAsync<T, kACol, kBCol, kStages>(steps, fetch, acc);
    } else {
      Pipeline<T, kACol, kBCol>(steps, fetch, acc);
    }
    SimtStore(acc, out, ld, vr, vc);
  } else {
    __shared__ __align__(128) float stage[kThreads / kWarpSize][kFrag * kFrag];
    WmmaAcc acc;
#pragma unroll
    for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) nvcuda::wmma::fill_fragment(acc.f[i][j], 0.0f);
    }
    if constexpr (kStages > 0) {
      PipelineAsync<T, kACol, kBCol, kStages>(steps, fetch, acc);
    } else {
      Pipeline<T, kACol, kBCol>(steps, fetch, acc);
    }
    WmmaStore(acc, &stage[0][0], out, ld, vr, vc);
  }
}

// Forward: y[rows of g] = x[rows of g] @ w[g] (kTransW: w[g] is [N, K], read as its transpose).
// kStages: TileProduct's (with kStages > 0, kAsyncSharedBytes of dynamic shared memory).
template <typename T, bool kTransW, int kStages>
__global__ void __launch_bounds__(kThreads, kMinCtas<T>) GroupedGemmFwdKernel(Args<T> a) {
  __shared__ GroupSpan span;
  __shared__ long long warp_totals[kThreads / kWarpSize];
  FindSpan(a.sizes, a.groups, a.rows, blockIdx.x, -1, span, warp_totals);
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kBn;
  const int64_t vc = a.n - n0 < kBn ? a.n - n0 : kBn;
  if (span.group < 0) {
    // Past the groups' tiles: zero the rows past the groups, kBm at a time (unless the caller
    // never reads them: zero_tail false).
    if (!a.zero_tail) return;
    const int64_t first =
        span.used_rows + (static_cast<int64_t>(blockIdx.x) - span.used_tiles) * kBm;
    if (first >= a.rows) return;
    const int64_t vr = a.rows - first < kBm ? a.rows - first : kBm;
    for (int64_t e = threadIdx.x; e < vr * vc; e += kThreads) {
      a.out[(first + e / vc) * a.n + n0 + e % vc] = 0.0f;
    }
    return;
  }
  const int64_t first = span.tile_first;
  const int64_t vr = span.end - first < kBm ? span.end - first : kBm;
  const T* x = a.a + first * a.k;
  const T* w = a.b + span.group * a.k * a.n;
  // at, bt: this thread's registers (Staged) or a shared stage's tiles (Tile).
  auto fetch = [&](int64_t s, auto& at, auto& bt) {
    const int64_t k0 = s * kBk;
    const int64_t vk = a.k - k0 < kBk ? a.k - k0 : kBk;
    Fetch(at, x + k0, a.k, vr, vk, a.a_vec);
    if constexpr (kTransW) {
      Fetch(bt, w + n0 * a.k + k0, a.k, vc, vk, a.b_vec);  // [n][k]
    } else {
      Fetch(bt, w + k0 * a.n + n0, a.n, vk, vc, a.b_vec);  // [k][n]
    }
  };
  TileProduct<T, false, kTransW, kStages>((a.k + kBk - 1) / kBk, fetch, a.out + first * a.n + n0,
                                          a.n, vr, vc);
}

// Weight gradient: dw[g] = x[rows of g].T @ dy[rows of g]; a group without rows gets zeros.
// kStages: as the forward's.
template <typename T, int kStages>
__global__ void __launch_bounds__(kThreads, kMinCtas<T>) GroupedGemmWgradKernel(Args<T> a) {
  __shared__ GroupSpan span;
  __shared__ long long warp_totals[kThreads / kWarpSize];
  const int64_t m_tiles = (a.k + kBm - 1) / kBm;
  const int64_t g = static_cast<int64_t>(blockIdx.x) / m_tiles;
  const int64_t m0 = (static_cast<int64_t>(blockIdx.x) % m_tiles) * kBm;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kBn;
  FindSpan(a.sizes, a.groups, a.rows, -1, g, span, warp_totals);
  const int64_t vm = a.k - m0 < kBm ? a.k - m0 : kBm;
  const int64_t vc = a.n - n0 < kBn ? a.n - n0 : kBn;
  const int64_t begin = span.begin;
  const int64_t count = span.end - span.begin;
  auto fetch = [&](int64_t s, auto& at, auto& bt) {
    const int64_t r0 = begin + s * kBk;
    const int64_t vk = count - s * kBk < kBk ? count - s * kBk : kBk;
    Fetch(at, a.a + r0 * a.k + m0, a.k, vk, vm, a.a_vec);  // [row][m]: A col-major
    Fetch(bt, a.b + r0 * a.n + n0, a.n, vk, vc, a.b_vec);  // [row][n]
  };
  TileProduct<T, true, false, kStages>((count + kBk - 1) / kBk, fetch,
                                       a.out + (g * a.k + m0) * a.n + n0, a.n, vm, vc);
}

}  // namespace jaxops::grouped_gemm

#endif  // JAXOPS_XLA_FFI_GROUPED_GEMM_KERNELS_CUH_
