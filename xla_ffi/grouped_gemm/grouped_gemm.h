// Shapes, blocking and group layout of the grouped GEMM (host code: the family has CPU kernels
// only; on GPUs jax.lax.ragged_dot is the grouped GEMM).
//
// A grouped GEMM multiplies consecutive groups of rows by their own matrix: the rows of group g
// are rows [start_g, start_g + sizes[g]) of x, start_g the sum of the sizes before g, from row 0.
// Sizes come from device data, so the kernels clip them instead of trusting them: a negative size
// counts as 0 and no group reaches past the last row (rows past the groups are padding).
#ifndef JAXOPS_XLA_FFI_GROUPED_GEMM_GROUPED_GEMM_H_
#define JAXOPS_XLA_FFI_GROUPED_GEMM_GROUPED_GEMM_H_

#include <algorithm>
#include <cstdint>
#include <vector>

namespace jaxops::grouped_gemm {

// Columns of a packed B panel: two AVX-512 registers of fp32.
inline constexpr int64_t kNr = 32;
// Depth of one packed block (a kNr-column B panel of kKc rows is 32 KiB of fp32, an L1's worth).
inline constexpr int64_t kKc = 256;
// Output rows one task computes (a multiple of every micro-kernel's row count).
inline constexpr int64_t kMb = 96;

// The [begin, end) rows of each group, clipped to [0, rows): ends[g] - begins[g] >= 0.
struct GroupRows {
  std::vector<int64_t> begins;
  std::vector<int64_t> ends;
};

inline GroupRows ClipGroups(const int32_t* sizes, int64_t groups, int64_t rows) {
  GroupRows out;
  out.begins.resize(groups);
  out.ends.resize(groups);
  int64_t at = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t size = std::max<int64_t>(0, sizes[g]);
    out.begins[g] = at;
    at = std::min(rows, at + size);
    out.ends[g] = at;
  }
  return out;
}

// One task: `rows` output rows from `first` of group `group` (for the weight gradient, rows of
// dw[group], i.e. columns of x).
struct Task {
  int64_t group;
  int64_t first;
  int64_t rows;
};

// Cuts each group's `extent(g)` output rows into tasks of at most kMb rows.
template <typename Extent>
std::vector<Task> MakeTasks(int64_t groups, Extent extent) {
  std::vector<Task> tasks;
  for (int64_t g = 0; g < groups; ++g) {
    const auto [first, last] = extent(g);
    for (int64_t r = first; r < last; r += kMb) tasks.push_back({g, r, std::min(kMb, last - r)});
  }
  return tasks;
}

}  // namespace jaxops::grouped_gemm

#endif  // JAXOPS_XLA_FFI_GROUPED_GEMM_GROUPED_GEMM_H_
