// MoE permutation CPU kernels. The layout arithmetic is moe.h's; the contracts are checks.h's.
//
//   * Route: one sequential counting sort over the T * K slots (O(T K + E), microseconds next to
//     moving the rows): count per expert, take each slot's rank in slot order, then place it.
//   * Permute: tasks own ranges of tokens; each token row is read once and copied (bytes, any
//     dtype) to the rows of its slots, then the task zeroes the rows of its share of [0, R)
//     that hold no slot. Rows go out with streaming stores (no read-for-ownership).
//   * Unpermute: per token, the K rows are added in slot order into an fp32 tile of up to
//     kTile columns that stays in L1, then rounded once and streamed out.
//   * Unpermute backward: per row, d_expert = probs * d_out[token] and the fp32 dot product of
//     d_out[token] with the row (kLanes partial sums, so the loop vectorizes; fixed order).
// Inner loops are contiguous fp32 / integer loops compiled for AVX-512, AVX2 and the baseline.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/cpu_convert.h"
#include "xla_ffi/common/cpu_dispatch.h"
#include "xla_ffi/common/cpu_memory.h"
#include "xla_ffi/common/cpu_parallel.h"
#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/common/host_float.h"
#include "xla_ffi/moe/checks.h"
#include "xla_ffi/moe/handlers.h"
#include "xla_ffi/moe/moe.h"

namespace jaxops::moe {
namespace {

// Columns of the fp32 accumulator tile of the unpermute (16 KiB).
constexpr int64_t kTile = 4096;
// Partial sums of the dot products (one AVX-512 register of fp32 per 16).
constexpr int64_t kLanes = 32;

// ---------------------------------------------------------------------------------------------
// Streaming stores: rows of the (large, freshly allocated) outputs are written once and not read
// back soon, so they bypass the cache (no read-for-ownership of the destination lines). Callers
// end their task with StreamFence().

void StreamCopy(void* dst, const void* src, int64_t n) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  int64_t i = 0;
#if defined(__SSE2__)
  if (reinterpret_cast<uintptr_t>(d) % 16 == 0) {
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
  }
#endif
  std::memcpy(d + i, s + i, n - i);
}

void StreamZero(void* dst, int64_t n) {
  auto* d = static_cast<uint8_t*>(dst);
  int64_t i = 0;
#if defined(__SSE2__)
  if (reinterpret_cast<uintptr_t>(d) % 16 == 0) {
    const __m128i zero = _mm_setzero_si128();
    for (; i + 16 <= n; i += 16) _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), zero);
  }
#endif
  std::memset(d + i, 0, n - i);
}

void StreamFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// ---------------------------------------------------------------------------------------------
// Numeric functions: one row span.

// acc = w * x
template <typename X>
JAXOPS_CPU_CLONES void ScaleInto(const X* x, float w, float* acc, int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] = w * HostType<X>::Load(x[j]);
}

// acc += w * x
template <typename X>
JAXOPS_CPU_CLONES void AddScaled(const X* x, float w, float* acc, int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] += w * HostType<X>::Load(x[j]);
}

// Streams n fp32 values out as X: converted into `staging` first unless X is float.
template <typename X>
void StreamFromFloat(const float* acc, X* staging, X* dst, int64_t n) {
  const int64_t bytes = n * static_cast<int64_t>(sizeof(X));
  if constexpr (std::is_same_v<X, float>) {
    StreamCopy(dst, acc, bytes);
  } else {
    StoreFromFloat(acc, staging, n);
    StreamCopy(dst, staging, bytes);
  }
}

// sum_j a[j] * b[j] in fp32, kLanes partial sums added in lane order.
template <typename X>
JAXOPS_CPU_CLONES float Dot(const X* a, const X* b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      lanes[l] += HostType<X>::Load(a[j + l]) * HostType<X>::Load(b[j + l]);
    }
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; j < n; ++j) sum += HostType<X>::Load(a[j]) * HostType<X>::Load(b[j]);
  return sum;
}

// ---------------------------------------------------------------------------------------------
// Typed implementations.

struct RouteOutputs {
  int32_t* row_map;
  int32_t* source;
  int32_t* group_sizes;
  int32_t* group_offsets;
  int32_t* num_rows;
  int32_t* dropped;
  int32_t* counts;  // workspace, E entries
};

void RouteImpl(const RouteShape& s, const int32_t* ids, const RouteOutputs& out) {
  std::fill(out.counts, out.counts + s.experts, 0);
  std::fill(out.source, out.source + s.rows, -1);
  // Pass 1: each used slot's rank among the earlier slots of its expert.
  for (int64_t slot = 0; slot < s.slots; ++slot) {
    const int32_t e = ids[slot];
    out.row_map[slot] = IsExpert(e, s.experts) ? out.counts[e]++ : -1;
  }
  // Group sizes and offsets.
  int64_t offset = 0;
  for (int64_t e = 0; e < s.experts; ++e) {
    const int64_t kept = KeptSlots(out.counts[e], s.capacity);
    const int64_t rows = GroupRows(out.counts[e], s.capacity, s.align);
    out.group_offsets[e] = static_cast<int32_t>(offset);
    out.group_sizes[e] = static_cast<int32_t>(rows);
    out.dropped[e] = static_cast<int32_t>(out.counts[e] - kept);
    offset += rows;
  }
  out.group_offsets[s.experts] = static_cast<int32_t>(offset);
  out.num_rows[0] = static_cast<int32_t>(offset);
  // Pass 2: rows of the kept slots.
  for (int64_t slot = 0; slot < s.slots; ++slot) {
    const int32_t rank = out.row_map[slot];
    if (rank < 0) continue;
    if (s.capacity >= 0 && rank >= s.capacity) {
      out.row_map[slot] = -1;
      continue;
    }
    const int32_t row = out.group_offsets[ids[slot]] + rank;
    out.row_map[slot] = row;
    out.source[row] = static_cast<int32_t>(slot);
  }
}

struct PermuteArgs {
  RowsShape shape;
  const uint8_t* tokens;
  int64_t element_bytes;
  const int32_t* source;
  const int32_t* row_map;
  const float* scales;  // nullptr: none
  const float* probs;   // nullptr: none
  uint8_t* out;
  float* out_scales;
  float* out_probs;
};

// Whether row r holds slot `slot` (a consistent source / row_map pair).
inline bool Holds(const PermuteArgs& a, int64_t r, int64_t slot) {
  return slot >= 0 && slot < a.shape.tokens * a.shape.top_k && a.row_map[slot] == r;
}

// Task [begin, end) of tokens: writes the rows of those tokens' slots (each token row is read
// once while it is in L1) and zeroes the rows in the matching share of [0, R) that hold no slot.
ffi::Future PermuteImpl(ffi::ThreadPool& pool, const PermuteArgs& a) {
  const int64_t row_bytes = a.shape.hidden * a.element_bytes;
  const int64_t columns = a.shape.scale_columns;
  const int64_t scale_bytes = columns * static_cast<int64_t>(sizeof(float));
  auto body = [a, row_bytes, columns, scale_bytes](int64_t begin, int64_t end) {
    const int64_t k_count = a.shape.top_k;
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k = 0; k < k_count; ++k) {
        const int64_t slot = t * k_count + k;
        const int64_t r = a.row_map[slot];
        if (r < 0 || r >= a.shape.rows || a.source[r] != slot) continue;
        StreamCopy(a.out + r * row_bytes, a.tokens + t * row_bytes, row_bytes);
        if (a.scales != nullptr) {
          std::memcpy(a.out_scales + r * columns, a.scales + t * columns, scale_bytes);
        }
        if (a.probs != nullptr) a.out_probs[r] = a.probs[slot];
      }
    }
    const int64_t tokens = a.shape.tokens;
    const int64_t first = a.shape.rows * begin / tokens;
    const int64_t last = end == tokens ? a.shape.rows : a.shape.rows * end / tokens;
    for (int64_t r = first; r < last; ++r) {
      if (Holds(a, r, a.source[r])) continue;
      StreamZero(a.out + r * row_bytes, row_bytes);
      if (a.scales != nullptr) std::memset(a.out_scales + r * columns, 0, scale_bytes);
      if (a.probs != nullptr) a.out_probs[r] = 0.0f;
    }
    StreamFence();
  };
  const int64_t per_token = (a.shape.top_k + 1) * (row_bytes + scale_bytes);
  return ParallelFor(pool, a.shape.tokens, per_token, body);
}

template <typename X>
ffi::Future UnpermuteImpl(ffi::ThreadPool& pool, const RowsShape& s, const X* x,
                          const int32_t* row_map, const float* probs, X* out) {
  auto body = [=](int64_t begin, int64_t end) {
    float acc[kTile];
    X rounded[kTile];
    for (int64_t t = begin; t < end; ++t) {
      X* dst = out + t * s.hidden;
      for (int64_t h0 = 0; h0 < s.hidden; h0 += kTile) {
        const int64_t n = std::min(kTile, s.hidden - h0);
        bool any = false;
        for (int64_t k = 0; k < s.top_k; ++k) {
          const int64_t slot = t * s.top_k + k;
          const int64_t row = row_map[slot];
          if (row < 0 || row >= s.rows) continue;
          const float w = probs != nullptr ? probs[slot] : 1.0f;
          const X* src = x + row * s.hidden + h0;
          if (any) {
            AddScaled(src, w, acc, n);
          } else {
            ScaleInto(src, w, acc, n);
            any = true;
          }
        }
        if (!any) std::fill(acc, acc + n, 0.0f);
        StreamFromFloat(acc, rounded, dst + h0, n);
      }
    }
    StreamFence();
  };
  const int64_t token_bytes = (s.top_k + 1) * s.hidden * static_cast<int64_t>(sizeof(X));
  return ParallelFor(pool, s.tokens, token_bytes, body);
}

template <typename X>
ffi::Future UnpermuteBwdImpl(ffi::ThreadPool& pool, const RowsShape& s, const X* d_out, const X* x,
                             const int32_t* source, const float* probs, X* d_expert,
                             float* d_probs) {
  const int64_t slots = s.tokens * s.top_k;
  std::fill(d_probs, d_probs + slots, 0.0f);
  auto body = [=](int64_t begin, int64_t end) {
    float scaled[kTile];
    X rounded[kTile];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t slot = source[r];
      X* dst = d_expert + r * s.hidden;
      if (slot < 0 || slot >= slots) {
        StreamZero(dst, s.hidden * static_cast<int64_t>(sizeof(X)));
        continue;
      }
      const X* g = d_out + (slot / s.top_k) * s.hidden;
      for (int64_t h0 = 0; h0 < s.hidden; h0 += kTile) {
        const int64_t n = std::min(kTile, s.hidden - h0);
        ScaleInto(g + h0, probs[slot], scaled, n);
        StreamFromFloat(scaled, rounded, dst + h0, n);
      }
      d_probs[slot] = Dot(g, x + r * s.hidden, s.hidden);
    }
    StreamFence();
  };
  return ParallelFor(pool, s.rows, 3 * s.hidden * static_cast<int64_t>(sizeof(X)), body);
}

// ---------------------------------------------------------------------------------------------
// Dispatch: validation and the dtype switches.

ffi::Error RouteDispatch(ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::Buffer<ffi::S32>> row_map,
                         ffi::Result<ffi::Buffer<ffi::S32>> source,
                         ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                         ffi::Result<ffi::Buffer<ffi::S32>> group_offsets,
                         ffi::Result<ffi::Buffer<ffi::S32>> num_rows,
                         ffi::Result<ffi::Buffer<ffi::S32>> dropped,
                         ffi::Result<ffi::Buffer<ffi::S32>> workspace, int64_t align,
                         int64_t capacity) {
  auto shape = CheckRoute(ids, *row_map, source->element_count(), group_sizes->element_count(),
                          group_offsets->element_count(), num_rows->element_count(),
                          dropped->element_count(), workspace->element_count(), align, capacity);
  if (shape.has_error()) return shape.error();
  RouteOutputs out{row_map->typed_data(),       source->typed_data(),   group_sizes->typed_data(),
                   group_offsets->typed_data(), num_rows->typed_data(), dropped->typed_data(),
                   workspace->typed_data()};
  RouteImpl(*shape, ids.typed_data(), out);
  return ffi::Error::Success();
}

ffi::Future PermuteDispatch(ffi::ThreadPool pool, ffi::AnyBuffer tokens,
                            ffi::Buffer<ffi::S32> source, ffi::Buffer<ffi::S32> row_map,
                            ffi::AnyBuffer scales, ffi::Buffer<ffi::F32> probs,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_scales,
                            ffi::Result<ffi::Buffer<ffi::F32>> out_probs) {
  auto shape = CheckPermute(tokens, source.element_count(), row_map, scales, probs.element_count(),
                            *out, *out_scales, out_probs->element_count());
  if (shape.has_error()) return ReadyFuture(shape.error());
  if (shape->tokens == 0) {  // no token rows: every output row is zero
    std::memset(out->untyped_data(), 0, out->size_bytes());
    std::memset(out_scales->untyped_data(), 0, out_scales->size_bytes());
    std::memset(out_probs->untyped_data(), 0, out_probs->size_bytes());
    return ReadyFuture();
  }
  PermuteArgs a;
  a.shape = *shape;
  a.tokens = In<uint8_t>(tokens);
  a.element_bytes = static_cast<int64_t>(ffi::ByteWidth(tokens.element_type()));
  a.source = source.typed_data();
  a.row_map = row_map.typed_data();
  a.scales = shape->has_scales ? In<float>(scales) : nullptr;
  a.probs = shape->has_probs ? probs.typed_data() : nullptr;
  a.out = Out<uint8_t>(out);
  a.out_scales = shape->has_scales ? static_cast<float*>(out_scales->untyped_data()) : nullptr;
  a.out_probs = shape->has_probs ? out_probs->typed_data() : nullptr;
  return PermuteImpl(pool, a);
}

ffi::Future UnpermuteDispatch(ffi::ThreadPool pool, ffi::AnyBuffer expert_out,
                              ffi::Buffer<ffi::S32> row_map, ffi::Buffer<ffi::F32> probs,
                              ffi::Result<ffi::AnyBuffer> out) {
  auto shape = CheckUnpermute(expert_out, row_map, probs.element_count(), *out);
  if (shape.has_error()) return ReadyFuture(shape.error());
  const float* p = shape->has_probs ? probs.typed_data() : nullptr;
  return DispatchFloat("moe unpermute", "expert_out", expert_out.element_type(), [&](auto tag) {
    using X = typename decltype(tag)::type;
    return UnpermuteImpl<X>(pool, *shape, In<X>(expert_out), row_map.typed_data(), p, Out<X>(out));
  });
}

ffi::Future UnpermuteBwdDispatch(ffi::ThreadPool pool, ffi::AnyBuffer d_out,
                                 ffi::AnyBuffer expert_out, ffi::Buffer<ffi::S32> source,
                                 ffi::Buffer<ffi::F32> probs, ffi::Result<ffi::AnyBuffer> d_expert,
                                 ffi::Result<ffi::Buffer<ffi::F32>> d_probs) {
  auto shape =
      CheckUnpermuteBwd(d_out, expert_out, source.element_count(), probs, *d_expert, *d_probs);
  if (shape.has_error()) return ReadyFuture(shape.error());
  return DispatchFloat("moe unpermute_bwd", "d_out", d_out.element_type(), [&](auto tag) {
    using X = typename decltype(tag)::type;
    return UnpermuteBwdImpl<X>(pool, *shape, In<X>(d_out), In<X>(expert_out), source.typed_data(),
                               probs.typed_data(), Out<X>(d_expert), d_probs->typed_data());
  });
}

}  // namespace
}  // namespace jaxops::moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeRouteCpu, jaxops::moe::RouteDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // expert_ids [T, K]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // row_map [T, K]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // source [R]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // group_sizes [E]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // group_offsets [E+1]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // num_rows []
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // dropped [E]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // workspace [C, E]
                                  .Attr<int64_t>("align")                  // group row multiple
                                  .Attr<int64_t>("capacity"));             // slots/expert or -1

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoePermuteCpu, jaxops::moe::PermuteDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()             // pool
                                  .Arg<xla::ffi::AnyBuffer>()              // tokens [T, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // source [R]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // row_map [T, K]
                                  .Arg<xla::ffi::AnyBuffer>()  // scales f32 [T, S] | [0]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // probs [T, K] | [0]
                                  .Ret<xla::ffi::AnyBuffer>()              // out [R, H]
                                  .Ret<xla::ffi::AnyBuffer>()  // out_scales [R, S] | [0]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // out_probs [R] | [0]

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeUnpermuteCpu, jaxops::moe::UnpermuteDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()             // pool
                                  .Arg<xla::ffi::AnyBuffer>()              // expert_out [R, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // row_map [T, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // probs [T, K] | [0]
                                  .Ret<xla::ffi::AnyBuffer>());            // out [T, H]

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeUnpermuteBwdCpu, jaxops::moe::UnpermuteBwdDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()               // pool
                                  .Arg<xla::ffi::AnyBuffer>()                // d_out [T, H]
                                  .Arg<xla::ffi::AnyBuffer>()                // expert_out [R, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // source [R]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    // probs [T, K]
                                  .Ret<xla::ffi::AnyBuffer>()                // d_expert [R, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // d_probs [T, K]
