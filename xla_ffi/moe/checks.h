// Shape validation of the MoE permutation FFI handlers, shared by the CPU and CUDA dispatch.
//
// The Python wrappers validate everything at trace time; these checks guard the kernels against
// anything that reaches them another way, so a bad call is an error, never an out-of-bounds access.
// Index values are guarded in the kernels too: a source slot outside [0, T * K) gives a zero row
// and a row_map entry outside [0, R) contributes nothing.
//
// jaxops_moe_route: expert_ids int32 [T, K] -> the permuted layout of moe.h.
//   results   row_map       int32 [T, K]     row of slot (t, k), -1 if unused or dropped
//             source        int32 [R]        slot t * K + k held by each row, -1 for zero rows
//             group_sizes   int32 [E]        padded group sizes
//             group_offsets int32 [E + 1]    first row of each group; [E] = num_rows
//             num_rows      int32 []         used rows (padding included)
//             dropped       int32 [E]        slots each expert dropped for capacity
//             workspace     int32 [C, E]     scratch (C >= 1 chunks of slots on CUDA)
//   attributes align in [1, kMaxAlign], capacity >= 0 or -1 (none).
//   R >= PermutedRows(T * K, E, align, capacity) and every count below 2^31.
//
// jaxops_moe_permute: out[r] = tokens[s / K] for s = source[r] if row_map[s] == r (a consistent
// pair, as jaxops_moe_route writes them); every other row is zero. The CPU kernel walks tokens
// (each token row is read once and written to its rows), the CUDA kernel walks rows.
//   operands  tokens (f32 | bf16 | f16 | f8e4m3fn | f8e5m2) [T, H], source int32 [R],
//             row_map int32 [T, K], scales f32 [T, S] | [0], probs f32 [T, K] | [0]
//   results   out tokens' dtype [R, H], out_scales f32 [R, S] | [0], out_probs f32 [R] | [0]
//             (scales and probs move with their rows; zero on the zero rows)
//
// jaxops_moe_unpermute: out[t] = sum_k w[t, k] * expert_out[row_map[t, k]] (fp32 accumulation;
// w = probs, or 1 without probs; rows < 0 contribute nothing).
//   operands  expert_out (f32 | bf16 | f16) [R, H], row_map int32 [T, K], probs f32 [T, K] | [0]
//   results   out expert_out's dtype [T, H]
//
// jaxops_moe_unpermute_bwd: the backward of the weighted unpermute, one pass over the rows.
//   operands  d_out [T, H], expert_out [R, H] (same dtype: f32 | bf16 | f16), source int32 [R],
//             probs f32 [T, K]
//   results   d_expert [R, H]: probs[s] * d_out[s / K] for s = source[r] (zero rows elsewhere)
//             d_probs f32 [T, K]: dot(d_out[t], expert_out[row of (t, k)]), 0 for unused slots
#ifndef JAXOPS_XLA_FFI_MOE_CHECKS_H_
#define JAXOPS_XLA_FFI_MOE_CHECKS_H_

#include <cstdint>
#include <string>
#include <utility>

#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/moe/moe.h"

namespace jaxops::moe {

struct RouteShape {
  int64_t tokens = 0;
  int64_t top_k = 0;
  int64_t slots = 0;  // tokens * top_k
  int64_t experts = 0;
  int64_t rows = 0;
  int64_t align = 1;
  int64_t capacity = kNoCapacity;
  int64_t chunks = 1;       // workspace rows
  int64_t chunk_slots = 0;  // slots per chunk: CeilDiv(slots, chunks)
};

struct RowsShape {
  int64_t tokens = 0;  // T
  int64_t top_k = 0;   // K
  int64_t rows = 0;    // R
  int64_t hidden = 0;  // H
  int64_t scale_columns = 0;
  bool has_scales = false;
  bool has_probs = false;
};

inline ffi::Unexpected<ffi::Error> ShapeError(const char* op, const char* name,
                                              const std::string& expected, const std::string& got) {
  return Bad(std::string(op) + ": " + name + " must have shape " + expected + ", got " + got);
}

inline std::string Dims(int64_t a) { return "[" + std::to_string(a) + "]"; }
inline std::string Dims(int64_t a, int64_t b) {
  return "[" + std::to_string(a) + ", " + std::to_string(b) + "]";
}

// dims == {a, b}.
template <typename B>
inline bool Is2d(const B& b, int64_t a, int64_t c) {
  auto dims = b.dimensions();
  return dims.size() == 2 && dims[0] == a && dims[1] == c;
}

inline bool IsTokenType(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16 ||
         t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2;
}

inline bool IsFloatType(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

inline ffi::ErrorOr<RouteShape> CheckRoute(const ffi::Buffer<ffi::S32>& ids,
                                           const ffi::Buffer<ffi::S32>& row_map,
                                           int64_t source_count, int64_t sizes_count,
                                           int64_t offsets_count, int64_t num_rows_count,
                                           int64_t dropped_count, int64_t workspace_count,
                                           int64_t align, int64_t capacity) {
  const char* op = "moe route";
  auto dims = ids.dimensions();
  if (dims.size() != 2) return ShapeError(op, "expert_ids", "[T, K]", ShapeString(ids));
  RouteShape s;
  s.tokens = dims[0];
  s.top_k = dims[1];
  s.slots = s.tokens * s.top_k;
  s.experts = sizes_count;
  s.rows = source_count;
  s.align = align;
  s.capacity = capacity;
  if (s.top_k < 1) return ShapeError(op, "expert_ids", "[T, K] with K >= 1", ShapeString(ids));
  if (s.slots > kMaxRows) {
    return Bad(std::string(op) + ": T * K must be below 2^31, got " + std::to_string(s.slots));
  }
  if (!Is2d(row_map, s.tokens, s.top_k)) {
    return ShapeError(op, "row_map", Dims(s.tokens, s.top_k), ShapeString(row_map));
  }
  if (s.experts < 1 || s.experts > kMaxRows) {
    return Bad(std::string(op) + ": group_sizes must have E in [1, 2^31) elements, got " +
               std::to_string(s.experts));
  }
  if (offsets_count != s.experts + 1 || dropped_count != s.experts || num_rows_count != 1) {
    return Bad(std::string(op) + ": group_offsets, dropped and num_rows must have " +
               std::to_string(s.experts + 1) + ", " + std::to_string(s.experts) +
               " and 1 elements, got " + std::to_string(offsets_count) + ", " +
               std::to_string(dropped_count) + " and " + std::to_string(num_rows_count));
  }
  if (align < 1 || align > kMaxAlign) {
    return Bad(std::string(op) + ": align must be in [1, " + std::to_string(kMaxAlign) + "], got " +
               std::to_string(align));
  }
  if (capacity < kNoCapacity) {
    return Bad(std::string(op) + ": capacity must be >= 0 or -1 (none), got " +
               std::to_string(capacity));
  }
  const int64_t needed = PermutedRows(s.slots, s.experts, align, capacity);
  if (s.rows < needed || s.rows > kMaxRows) {
    return Bad(std::string(op) + ": source must have between " + std::to_string(needed) +
               " and 2^31 - 1 rows, got " + std::to_string(s.rows));
  }
  if (workspace_count < s.experts || workspace_count % s.experts != 0) {
    return Bad(std::string(op) + ": workspace must have a positive multiple of E = " +
               std::to_string(s.experts) + " elements, got " + std::to_string(workspace_count));
  }
  s.chunks = workspace_count / s.experts;
  s.chunk_slots = s.slots == 0 ? 0 : CeilDiv(s.slots, s.chunks);
  return s;
}

// Optional [T, K] f32 probs: [0] (absent) or exactly T * K elements (with T * K = 0 the two
// coincide and probs count as absent).
inline ffi::Error CheckProbs(const char* op, int64_t probs_count, int64_t tokens, int64_t top_k,
                             bool* present) {
  *present = probs_count != 0;
  if (probs_count == 0 || probs_count == tokens * top_k) return ffi::Error::Success();
  return InvalidArgument(std::string(op) +
                         ": probs must have T * K = " + std::to_string(tokens * top_k) +
                         " elements or none, got " + std::to_string(probs_count));
}

inline ffi::ErrorOr<RowsShape> CheckPermute(const ffi::AnyBuffer& tokens, int64_t source_count,
                                            const ffi::Buffer<ffi::S32>& row_map,
                                            const ffi::AnyBuffer& scales, int64_t probs_count,
                                            const ffi::AnyBuffer& out,
                                            const ffi::AnyBuffer& out_scales,
                                            int64_t out_probs_count) {
  const char* op = "moe permute";
  if (!IsTokenType(tokens.element_type())) {
    return Bad(std::string(op) +
               ": tokens dtype must be float32, bfloat16, float16, float8_e4m3fn or "
               "float8_e5m2, got " +
               DataTypeName(tokens.element_type()));
  }
  if (tokens.dimensions().size() != 2) {
    return ShapeError(op, "tokens", "[T, H]", ShapeString(tokens));
  }
  RowsShape s;
  s.tokens = tokens.dimensions()[0];
  s.hidden = tokens.dimensions()[1];
  s.rows = source_count;
  auto map_dims = row_map.dimensions();
  if (map_dims.size() != 2 || map_dims[0] != s.tokens || map_dims[1] < 1) {
    return ShapeError(op, "row_map", "[T, K] with T = " + std::to_string(s.tokens) + ", K >= 1",
                      ShapeString(row_map));
  }
  s.top_k = map_dims[1];
  if (s.tokens * s.top_k > kMaxRows) {
    return Bad(std::string(op) + ": T * K must be below 2^31, got " +
               std::to_string(s.tokens * s.top_k));
  }
  if (out.element_type() != tokens.element_type() || !Is2d(out, s.rows, s.hidden)) {
    return ShapeError(op, "out", Dims(s.rows, s.hidden) + " of tokens' dtype", ShapeString(out));
  }
  // Absent scales are a rank-1 [0] buffer; present ones are [T, S].
  s.has_scales = scales.dimensions().size() == 2;
  if (!s.has_scales && ElementCount(scales) != 0) {
    return ShapeError(op, "scales", "float32 [T, S] or [0]", ShapeString(scales));
  }
  if (s.has_scales) {
    if (scales.element_type() != ffi::DataType::F32 || scales.dimensions().size() != 2 ||
        scales.dimensions()[0] != s.tokens) {
      return ShapeError(op, "scales", "float32 [T, S]", ShapeString(scales));
    }
    s.scale_columns = scales.dimensions()[1];
    if (!Is2d(out_scales, s.rows, s.scale_columns)) {
      return ShapeError(op, "out_scales", Dims(s.rows, s.scale_columns), ShapeString(out_scales));
    }
  } else if (ElementCount(out_scales) != 0) {
    return ShapeError(op, "out_scales", "[0] without scales", ShapeString(out_scales));
  }
  if (auto e = CheckProbs(op, probs_count, s.tokens, s.top_k, &s.has_probs); e.failure()) {
    return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  if (out_probs_count != (s.has_probs ? s.rows : 0)) {
    return Bad(std::string(op) + ": out_probs must have " +
               std::to_string(s.has_probs ? s.rows : 0) + " elements, got " +
               std::to_string(out_probs_count));
  }
  return s;
}

inline ffi::ErrorOr<RowsShape> CheckUnpermute(const ffi::AnyBuffer& expert_out,
                                              const ffi::Buffer<ffi::S32>& row_map,
                                              int64_t probs_count, const ffi::AnyBuffer& out) {
  const char* op = "moe unpermute";
  if (!IsFloatType(expert_out.element_type())) {
    return Bad(std::string(op) + ": expert_out dtype must be float32, bfloat16 or float16, got " +
               DataTypeName(expert_out.element_type()));
  }
  if (expert_out.dimensions().size() != 2) {
    return ShapeError(op, "expert_out", "[R, H]", ShapeString(expert_out));
  }
  if (row_map.dimensions().size() != 2 || row_map.dimensions()[1] < 1) {
    return ShapeError(op, "row_map", "[T, K] with K >= 1", ShapeString(row_map));
  }
  RowsShape s;
  s.rows = expert_out.dimensions()[0];
  s.hidden = expert_out.dimensions()[1];
  s.tokens = row_map.dimensions()[0];
  s.top_k = row_map.dimensions()[1];
  if (s.tokens * s.top_k > kMaxRows) {
    return Bad(std::string(op) + ": T * K must be below 2^31, got " +
               std::to_string(s.tokens * s.top_k));
  }
  if (auto e = CheckProbs(op, probs_count, s.tokens, s.top_k, &s.has_probs); e.failure()) {
    return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  if (out.element_type() != expert_out.element_type() || !Is2d(out, s.tokens, s.hidden)) {
    return ShapeError(op, "out", Dims(s.tokens, s.hidden) + " of expert_out's dtype",
                      ShapeString(out));
  }
  return s;
}

inline ffi::ErrorOr<RowsShape> CheckUnpermuteBwd(const ffi::AnyBuffer& d_out,
                                                 const ffi::AnyBuffer& expert_out,
                                                 int64_t source_count,
                                                 const ffi::Buffer<ffi::F32>& probs,
                                                 const ffi::AnyBuffer& d_expert,
                                                 const ffi::Buffer<ffi::F32>& d_probs) {
  const char* op = "moe unpermute_bwd";
  if (!IsFloatType(d_out.element_type()) || expert_out.element_type() != d_out.element_type() ||
      d_expert.element_type() != d_out.element_type()) {
    return Bad(std::string(op) +
               ": d_out, expert_out and d_expert must share one dtype of float32, "
               "bfloat16 or float16, got " +
               DataTypeName(d_out.element_type()) + ", " + DataTypeName(expert_out.element_type()) +
               " and " + DataTypeName(d_expert.element_type()));
  }
  if (d_out.dimensions().size() != 2) return ShapeError(op, "d_out", "[T, H]", ShapeString(d_out));
  RowsShape s;
  s.tokens = d_out.dimensions()[0];
  s.hidden = d_out.dimensions()[1];
  s.rows = source_count;
  if (probs.dimensions().size() != 2 || probs.dimensions()[0] != s.tokens ||
      probs.dimensions()[1] < 1) {
    return ShapeError(op, "probs", "[T, K] with T = " + std::to_string(s.tokens),
                      ShapeString(probs));
  }
  s.top_k = probs.dimensions()[1];
  s.has_probs = true;
  if (s.tokens * s.top_k > kMaxRows) {
    return Bad(std::string(op) + ": T * K must be below 2^31, got " +
               std::to_string(s.tokens * s.top_k));
  }
  if (!Is2d(expert_out, s.rows, s.hidden)) {
    return ShapeError(op, "expert_out", Dims(s.rows, s.hidden), ShapeString(expert_out));
  }
  if (!Is2d(d_expert, s.rows, s.hidden)) {
    return ShapeError(op, "d_expert", Dims(s.rows, s.hidden), ShapeString(d_expert));
  }
  if (!Is2d(d_probs, s.tokens, s.top_k)) {
    return ShapeError(op, "d_probs", Dims(s.tokens, s.top_k), ShapeString(d_probs));
  }
  return s;
}

}  // namespace jaxops::moe

#endif  // JAXOPS_XLA_FFI_MOE_CHECKS_H_
