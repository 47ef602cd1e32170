// Device code of the MoE token permutation family: the CUDA kernels and their building blocks
// (the route kernels over int32 indices, the permute kernel over the word it moves rows with,
// and the unpermute kernels over T, the float dtype, and kVec, elements per access: 16 bytes of
// T, or 1 for the scalar fallback). cuda.cu launches them; the layout arithmetic is moe.h's.
//
// Nothing synchronizes with the host: every count stays on the device. Element offsets are
// int64_t; grids are capped and the kernels loop (grid-stride), so any size works; empty inputs
// launch nothing except what writes the small outputs.
//
//   * Route: a stable counting sort over the T * K slots in five steps on the stream.
//     0. cudaMemsetAsync sets every source row to -1 (padding rows stay -1).
//     1. MoeRouteCountKernel: the slots are cut into C chunks (C = rows of the workspace, chunk c
//        covers [c * chunk_slots, min((c + 1) * chunk_slots, T * K))); one warp owns a chunk and
//        its workspace row ws[c, 0:E], which it zeroes and then fills with per-expert counts,
//        32 slots per step: __match_any_sync groups the lanes with equal experts and the
//        group's lowest lane adds the group's size. Only the owning warp touches the row, so
//        there are no atomics (__syncwarp orders the steps).
//     2. MoeRouteChunkPrefixKernel turns each expert's column of counts into an exclusive
//        prefix over the chunks (ws[c, e] = slots of expert e in chunks before c) and leaves the
//        total count in group_sizes[e]. A CTA of 1024 threads owns up to 32 experts (lanes, so
//        loads are coalesced) and splits the chunks among its thread groups: sums of the ranges,
//        a scan over the groups, then the running prefix of each range (fast for small E too).
//     3. MoeRouteOffsetsKernel (one CTA of 1024 threads) walks the experts in tiles: dropped,
//        padded group sizes and a block-wide exclusive scan (64-bit carry across tiles) into
//        group_offsets; group_offsets[E] = num_rows = the total.
//     4. MoeRoutePlaceKernel repeats step 1's walk: a slot's rank within its expert is
//        ws[c, e] (the slots in earlier chunks and earlier steps) plus the lanes of its group
//        below it; the group's lowest lane then advances ws[c, e]. Ranks follow slot order, so
//        the layout is deterministic and equal to the sequential CPU sort. Kept slots get
//        row = group_offsets[e] + rank (row_map and source); dropped and unused slots get -1.
//     With T * K == 0 steps 1-3 still run (they write the zeros of the small outputs); step 4
//     is skipped.
//
//   * Permute: one CTA per output row (grid-stride). Rows are moved as raw bytes (any token
//     dtype) in 16-byte words when a row is a multiple of 16 bytes and both base pointers are
//     16-byte aligned, else in the widest of 8 / 4 / 2 / 1-byte words that fits; each thread
//     keeps kRowUnroll words in flight. A source outside [0, T * K), or one whose row_map entry
//     is not this row, gives a zero row (and zero scales / prob). The scales row and the prob of
//     the slot ride along.
//
//   * Unpermute: one CTA per token (grid-stride); each thread owns kRowUnroll 16-byte packs of
//     columns (strided by the CTA, so accesses are coalesced) and adds the K rows in slot order
//     k = 0, 1, ... into fp32 accumulators, rounding once. The token's (row, weight) pairs are
//     staged in shared memory kKTile at a time, so any K works. Accumulators start at -0.0f, the
//     identity of fp32 addition, so the first term is exactly w * x as on the CPU; a token
//     without valid rows gets +0.
//
//   * Unpermute backward: cudaMemsetAsync zeroes d_probs (slots that no row holds), then one CTA
//     per row (grid-stride): d_expert[r] = probs[s] * d_out[s / K] for s = source[r] (a zero row
//     for an invalid s) and d_probs[s] = the fp32 dot product of d_out[s / K] and expert_out[r],
//     reduced in a fixed order (per-thread partial sums, warp shuffles, then the warps in order
//     by thread 0): deterministic, no atomics.
//
// CTAs of the row kernels have 32 to 256 threads: enough for each thread to make up to
// kRowUnroll accesses per row.
#ifndef JAXOPS_XLA_FFI_MOE_KERNELS_CUH_
#define JAXOPS_XLA_FFI_MOE_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "xla_ffi/common/cuda_util.cuh"
#include "xla_ffi/common/cuda_vec.cuh"
#include "xla_ffi/common/math.h"
#include "xla_ffi/moe/moe.h"

namespace jaxops::moe {

// ---------------------------------------------------------------------------------------------
// Launch geometry.

constexpr int kRouteWarps = 4;  // Warps (one chunk of slots each) per CTA of the route walks.
constexpr int kRouteThreads = kRouteWarps * kWarpSize;
constexpr int kPrefixThreads = 1024;  // CTA size of the chunk prefix (groups x experts).
constexpr int kScanThreads = 1024;    // The single CTA of the group offsets scan.
constexpr int kMinRowThreads = 32;    // CTA sizes of the row kernels.
constexpr int kMaxRowThreads = 256;
constexpr int kRowUnroll = 4;  // Accesses in flight per thread in the row kernels.
constexpr int kKTile = 256;    // (row, weight) pairs of a token staged at once by the unpermute.

static_assert(kPrefixThreads % kWarpSize == 0 && kScanThreads % kWarpSize == 0 &&
                  kMaxRowThreads % kWarpSize == 0,
              "the block reductions work on whole warps");

// ---------------------------------------------------------------------------------------------
// Kernel arguments. Absent optional operands are nullptr.

struct RouteArgs {
  const int32_t* ids = nullptr;  // [T * K]
  int32_t* row_map = nullptr;    // [T * K]
  int32_t* source = nullptr;     // [R]
  int32_t* group_sizes = nullptr;
  int32_t* group_offsets = nullptr;
  int32_t* num_rows = nullptr;
  int32_t* dropped = nullptr;
  int32_t* workspace = nullptr;  // [C, E]
  int64_t slots = 0;
  int64_t experts = 0;
  int64_t chunks = 0;
  int64_t chunk_slots = 0;
  int64_t align = 1;
  int64_t capacity = kNoCapacity;
};

struct PermuteArgs {
  const void* tokens = nullptr;  // [T, row_words] words
  const int32_t* source = nullptr;
  const int32_t* row_map = nullptr;  // [T * K]: a row is used if row_map[source[r]] == r
  const float* scales = nullptr;     // [T, S]
  const float* probs = nullptr;      // [T * K]
  void* out = nullptr;               // [R, row_words] words
  float* out_scales = nullptr;       // [R, S]
  float* out_probs = nullptr;        // [R]
  int64_t rows = 0;
  int64_t row_words = 0;  // Words of the kernel's Word per row.
  int64_t slots = 0;
  int64_t top_k = 1;
  int64_t scale_columns = 0;
};

template <typename T>
struct UnpermuteArgs {
  const T* expert_out = nullptr;  // [R, H]
  const int32_t* row_map = nullptr;
  const float* probs = nullptr;  // [T, K]
  T* out = nullptr;              // [T, H]
  int64_t tokens = 0;
  int64_t top_k = 1;
  int64_t rows = 0;
  int64_t hidden = 0;
};

template <typename T>
struct UnpermuteBwdArgs {
  const T* d_out = nullptr;       // [T, H]
  const T* expert_out = nullptr;  // [R, H]
  const int32_t* source = nullptr;
  const float* probs = nullptr;  // [T, K]
  T* d_expert = nullptr;         // [R, H]
  float* d_probs = nullptr;      // [T, K]
  int64_t slots = 0;
  int64_t top_k = 1;
  int64_t rows = 0;
  int64_t hidden = 0;
};

// ---------------------------------------------------------------------------------------------
// Device building blocks.

// Slots [begin, end) of chunk c; chunks past the last slot are empty.
struct SlotRange {
  int64_t begin;
  int64_t end;
};

__device__ __forceinline__ SlotRange ChunkSlots(int64_t c, int64_t slots, int64_t chunk_slots) {
  const int64_t begin = c * chunk_slots;
  const int64_t end = begin + chunk_slots;
  return {begin < slots ? begin : slots, end < slots ? end : slots};
}

// The expert of `slot`, or -1 when it is past the chunk's end or holds no expert.
__device__ __forceinline__ int32_t SlotExpert(const int32_t* ids, int64_t slot, int64_t end,
                                              int64_t experts) {
  if (slot >= end) return -1;
  const int32_t e = ids[slot];
  return IsExpert(e, experts) ? e : -1;
}

// Token of a used slot: slot / K, in 32 bits when both fit (always, for a routing below 2^31
// slots), which is several times cheaper than the 64-bit division.
__device__ __forceinline__ int64_t TokenOf(int64_t slot, int64_t top_k) {
  if (((slot | top_k) >> 32) == 0) {
    return static_cast<int64_t>(static_cast<uint32_t>(slot) / static_cast<uint32_t>(top_k));
  }
  return slot / top_k;
}

// Sum over the CTA in a fixed order (warp butterflies, then the warps in order); the result is
// valid in thread 0 only. All threads call it; warp_sums holds blockDim.x / 32 entries and may
// be reused by the next call.
__device__ __forceinline__ float BlockSumToThread0(float v, float* warp_sums) {
  v = WarpSum(v);
  __syncthreads();  // Thread 0 of the previous call is done reading warp_sums.
  if (threadIdx.x % kWarpSize == 0) warp_sums[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float total = 0.0f;
  if (threadIdx.x == 0) {
    for (int w = 0; w < static_cast<int>(blockDim.x) / kWarpSize; ++w) total += warp_sums[w];
  }
  return total;
}

// ---------------------------------------------------------------------------------------------
// Route kernels.

// Step 1: per-chunk expert counts into ws[c, :] (one warp per chunk).
__global__ void __launch_bounds__(kRouteThreads) MoeRouteCountKernel(RouteArgs a) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t first_chunk =
      static_cast<int64_t>(blockIdx.x) * kRouteWarps + static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t chunk_stride = static_cast<int64_t>(gridDim.x) * kRouteWarps;
  for (int64_t c = first_chunk; c < a.chunks; c += chunk_stride) {
    int32_t* counts = a.workspace + c * a.experts;
    for (int64_t e = lane; e < a.experts; e += kWarpSize) counts[e] = 0;
    __syncwarp();
    const SlotRange range = ChunkSlots(c, a.slots, a.chunk_slots);
    for (int64_t base = range.begin; base < range.end; base += kWarpSize) {
      const int32_t e = SlotExpert(a.ids, base + lane, range.end, a.experts);
      const unsigned group = __match_any_sync(kFullWarpMask, e);
      if (e >= 0 && lane == __ffs(group) - 1) counts[e] += __popc(group);
      __syncwarp();  // The next step's leader of e may be another lane.
    }
  }
}

// Step 2: ws[:, e] becomes the exclusive prefix over chunks; group_sizes[e] = the total count.
// A CTA owns a tile of `width` consecutive experts (a power of two <= 32, so a warp holds
// 32 / width whole groups): thread tid serves expert tile * width + tid % width for group
// tid / width, and the groups split the chunks into contiguous ranges (so a small E still has
// many threads walking the chunks, and loads are coalesced along experts). Pass 1 sums each
// range; a scan over the groups (shuffles by multiples of width within the warp, then the warp
// totals in warp order from shared memory) gives each range's start; pass 2 rewrites the range
// as running prefixes.
__global__ void __launch_bounds__(kPrefixThreads)
    MoeRouteChunkPrefixKernel(RouteArgs a, int width) {
  __shared__ int32_t warp_totals[kPrefixThreads / kWarpSize][kWarpSize];
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int x = tid % width;  // == lane % width
  const int64_t groups = blockDim.x / width;
  const int64_t group = tid / width;
  const int64_t span = CeilDiv(a.chunks, groups);
  const int64_t c_begin = group * span < a.chunks ? group * span : a.chunks;
  const int64_t c_end = c_begin + span < a.chunks ? c_begin + span : a.chunks;
  const int64_t tiles = CeilDiv(a.experts, width);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {  // Uniform over the CTA.
    const int64_t e = tile * width + x;
    const bool active = e < a.experts;
    int32_t* column = a.workspace + (active ? e : 0);
    int32_t partial = 0;  // Every count and prefix is at most T * K < 2^31.
    if (active) {
#pragma unroll 4
      for (int64_t c = c_begin; c < c_end; ++c) partial += column[c * a.experts];
    }
    int32_t inclusive = partial;  // Over this warp's groups up to this one.
#pragma unroll
    for (int offset = width; offset < kWarpSize; offset *= 2) {
      const int32_t other = __shfl_up_sync(kFullWarpMask, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    __syncthreads();  // The previous tile's readers are done with warp_totals.
    if (lane >= kWarpSize - width) warp_totals[warp][x] = inclusive;  // The warp's last group.
    __syncthreads();
    int32_t before = 0;
    int32_t total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x) / kWarpSize; ++w) {
      const int32_t t = warp_totals[w][x];
      if (w < warp) before += t;
      total += t;
    }
    if (active) {
      int32_t running = before + inclusive - partial;
#pragma unroll 4
      for (int64_t c = c_begin; c < c_end; ++c) {
        const int32_t count = column[c * a.experts];
        column[c * a.experts] = running;
        running += count;
      }
      if (group == 0) a.group_sizes[e] = total;
    }
  }
}

// Step 3 (one CTA of kScanThreads): dropped, padded group sizes, group offsets and num_rows.
__global__ void __launch_bounds__(kScanThreads) MoeRouteOffsetsKernel(RouteArgs a) {
  __shared__ long long warp_totals[kScanThreads / kWarpSize];
  long long carry = 0;  // Rows of the experts of earlier tiles.
  for (int64_t e0 = 0; e0 < a.experts; e0 += blockDim.x) {
    const int64_t e = e0 + threadIdx.x;
    long long rows = 0;
    if (e < a.experts) {
      const int64_t count = a.group_sizes[e];
      rows = GroupRows(count, a.capacity, a.align);
      a.dropped[e] = static_cast<int32_t>(count - KeptSlots(count, a.capacity));
      a.group_sizes[e] = static_cast<int32_t>(rows);
    }
    long long total = 0;
    const long long end = carry + BlockInclusiveScan(rows, warp_totals, total);
    // Every offset is at most num_rows <= R < 2^31 (checked by the dispatch).
    if (e < a.experts) a.group_offsets[e] = static_cast<int32_t>(end - rows);
    carry += total;
  }
  if (threadIdx.x == 0) {
    a.group_offsets[a.experts] = static_cast<int32_t>(carry);
    a.num_rows[0] = static_cast<int32_t>(carry);
  }
}

// Step 4: ranks in slot order, row_map and source (one warp per chunk, as in step 1).
__global__ void __launch_bounds__(kRouteThreads) MoeRoutePlaceKernel(RouteArgs a) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const unsigned lanes_below = (1u << lane) - 1u;
  const int64_t first_chunk =
      static_cast<int64_t>(blockIdx.x) * kRouteWarps + static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t chunk_stride = static_cast<int64_t>(gridDim.x) * kRouteWarps;
  for (int64_t c = first_chunk; c < a.chunks; c += chunk_stride) {
    int32_t* next_rank = a.workspace + c * a.experts;  // Slots of e before this step.
    const SlotRange range = ChunkSlots(c, a.slots, a.chunk_slots);
    for (int64_t base = range.begin; base < range.end; base += kWarpSize) {
      const int64_t slot = base + lane;
      const int32_t e = SlotExpert(a.ids, slot, range.end, a.experts);
      const unsigned group = __match_any_sync(kFullWarpMask, e);
      const int32_t group_rank = e >= 0 ? next_rank[e] : 0;
      __syncwarp();  // Every lane of the group has read next_rank[e].
      if (e >= 0 && lane == __ffs(group) - 1) next_rank[e] = group_rank + __popc(group);
      __syncwarp();  // The update is visible to the next step.
      if (slot < range.end) {
        int32_t row = -1;
        if (e >= 0) {
          const int64_t rank = static_cast<int64_t>(group_rank) + __popc(group & lanes_below);
          if (a.capacity < 0 || rank < a.capacity) {
            // Below group_offsets[e + 1] <= num_rows <= R < 2^31.
            row = static_cast<int32_t>(a.group_offsets[e] + rank);
            a.source[row] = static_cast<int32_t>(slot);
          }
        }
        a.row_map[slot] = row;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Permute kernel: rows moved as Word-sized raw words.

template <typename Word>
__global__ void __launch_bounds__(kMaxRowThreads) MoePermuteKernel(PermuteArgs a) {
  const Word* tokens = static_cast<const Word*>(a.tokens);
  Word* out = static_cast<Word*>(a.out);
  const int tid = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  const int64_t n = a.row_words;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const int64_t slot = a.source[r];
    const bool used = slot >= 0 && slot < a.slots && a.row_map[slot] == r;
    const int64_t t = used ? TokenOf(slot, a.top_k) : 0;
    const Word* src = tokens + t * n;
    Word* dst = out + r * n;
    for (int64_t i0 = tid; i0 < n; i0 += static_cast<int64_t>(threads) * kRowUnroll) {
      Word w[kRowUnroll];
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const int64_t i = i0 + static_cast<int64_t>(u) * threads;
        w[u] = used && i < n ? src[i] : Word{};
      }
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const int64_t i = i0 + static_cast<int64_t>(u) * threads;
        if (i < n) dst[i] = w[u];
      }
    }
    if (a.scales != nullptr) {
      const float* scale_src = a.scales + t * a.scale_columns;
      float* scale_dst = a.out_scales + r * a.scale_columns;
      for (int64_t j = tid; j < a.scale_columns; j += threads) {
        scale_dst[j] = used ? scale_src[j] : 0.0f;
      }
    }
    if (a.probs != nullptr && tid == 0) a.out_probs[r] = used ? a.probs[slot] : 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------
// Unpermute kernels.

// out[t] = sum_k w[t, k] * expert_out[row_map[t, k]], one CTA per token.
template <int kVec, typename T>
__global__ void __launch_bounds__(kMaxRowThreads) MoeUnpermuteKernel(UnpermuteArgs<T> a) {
  __shared__ int32_t staged_rows[kKTile];  // -1: contributes nothing.
  __shared__ float staged_weights[kKTile];
  const int tid = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  const int64_t vecs = a.hidden / kVec;
  const int64_t chunk = static_cast<int64_t>(threads) * kRowUnroll;
  for (int64_t t = blockIdx.x; t < a.tokens; t += gridDim.x) {
    const int64_t first_slot = t * a.top_k;
    T* dst = a.out + t * a.hidden;
    // Uniform over the CTA (the barriers below are reached by every thread).
    for (int64_t v0 = 0; v0 < vecs; v0 += chunk) {
      float acc[kRowUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[u][j] = -0.0f;  // -0 + x == x for every x.
      }
      bool any = false;  // Same value in every thread: the staged rows are shared.
      for (int64_t k0 = 0; k0 < a.top_k; k0 += kKTile) {
        const int n = static_cast<int>(a.top_k - k0 < kKTile ? a.top_k - k0 : kKTile);
        __syncthreads();  // The previous tile's readers are done.
        for (int i = tid; i < n; i += threads) {
          const int64_t slot = first_slot + k0 + i;
          const int32_t row = a.row_map[slot];
          staged_rows[i] = row >= 0 && row < a.rows ? row : -1;
          staged_weights[i] = a.probs != nullptr ? a.probs[slot] : 1.0f;
        }
        __syncthreads();
        for (int i = 0; i < n; ++i) {
          const int32_t row = staged_rows[i];
          if (row < 0) continue;
          any = true;
          const float w = staged_weights[i];
          const T* src = a.expert_out + static_cast<int64_t>(row) * a.hidden;
          Pack<T, kVec> x[kRowUnroll];
#pragma unroll
          for (int u = 0; u < kRowUnroll; ++u) {
            const int64_t v = v0 + tid + static_cast<int64_t>(u) * threads;
            if (v < vecs) LoadPack(src + v * kVec, x[u]);
          }
#pragma unroll
          for (int u = 0; u < kRowUnroll; ++u) {
            const int64_t v = v0 + tid + static_cast<int64_t>(u) * threads;
            if (v < vecs) {
#pragma unroll
              for (int j = 0; j < kVec; ++j) acc[u][j] = fmaf(w, ToFloat(x[u].v[j]), acc[u][j]);
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const int64_t v = v0 + tid + static_cast<int64_t>(u) * threads;
        if (v < vecs) {
          Pack<T, kVec> y;
#pragma unroll
          for (int j = 0; j < kVec; ++j) y.v[j] = FromFloat<T>(any ? acc[u][j] : 0.0f);
          StorePack(dst + v * kVec, y);
        }
      }
    }
  }
}

// d_expert[r] = probs[s] * d_out[s / K], d_probs[s] = dot(d_out[s / K], expert_out[r]) for
// s = source[r], one CTA per row.
template <int kVec, typename T>
__global__ void __launch_bounds__(kMaxRowThreads) MoeUnpermuteBwdKernel(UnpermuteBwdArgs<T> a) {
  __shared__ float warp_sums[kMaxRowThreads / kWarpSize];
  const int tid = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  const int64_t vecs = a.hidden / kVec;
  const int64_t chunk = static_cast<int64_t>(threads) * kRowUnroll;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const int64_t slot = a.source[r];
    T* dst = a.d_expert + r * a.hidden;
    if (slot < 0 || slot >= a.slots) {  // Uniform over the CTA.
      Pack<T, kVec> zeros;
#pragma unroll
      for (int j = 0; j < kVec; ++j) zeros.v[j] = FromFloat<T>(0.0f);
      for (int64_t v = tid; v < vecs; v += threads) StorePack(dst + v * kVec, zeros);
      continue;
    }
    const float w = a.probs[slot];
    const T* g = a.d_out + TokenOf(slot, a.top_k) * a.hidden;
    const T* x = a.expert_out + r * a.hidden;
    float dot[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) dot[u] = 0.0f;
    for (int64_t v0 = tid; v0 < vecs; v0 += chunk) {
      Pack<T, kVec> gv[kRowUnroll];
      Pack<T, kVec> xv[kRowUnroll];
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const int64_t v = v0 + static_cast<int64_t>(u) * threads;
        if (v < vecs) {
          LoadPack(g + v * kVec, gv[u]);
          LoadPack(x + v * kVec, xv[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const int64_t v = v0 + static_cast<int64_t>(u) * threads;
        if (v < vecs) {
          Pack<T, kVec> d;
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const float gf = ToFloat(gv[u].v[j]);
            d.v[j] = FromFloat<T>(w * gf);
            dot[u] = fmaf(gf, ToFloat(xv[u].v[j]), dot[u]);
          }
          StorePack(dst + v * kVec, d);
        }
      }
    }
    float partial = dot[0];
#pragma unroll
    for (int u = 1; u < kRowUnroll; ++u) partial += dot[u];
    const float total = BlockSumToThread0(partial, warp_sums);
    if (tid == 0) a.d_probs[slot] = total;
  }
}

}  // namespace jaxops::moe

#endif  // JAXOPS_XLA_FFI_MOE_KERNELS_CUH_
