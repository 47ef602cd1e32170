// Blocking and group layout of the grouped GEMM's CPU kernels (host code; the CUDA kernels'
// tiling is in kernels.cuh, the shape checks both share in checks.h).
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
// Output rows one task computes at most (a multiple of every micro-kernel's row count): large
// tasks pack each B panel for more rows (measured on 2 Zen 4 cores, the expert FFN's fwd + bwd:
// 96-row tasks 0.93-1.64x the loop of XLA dots, 384-row tasks 1.13-1.75x).
inline constexpr int64_t kMb = 384;
// Tasks per worker the split aims at (smaller tasks when the groups are few or small, so that
// every core gets work), and the fewest rows a task takes.
inline constexpr int64_t kTasksPerWorker = 4;
inline constexpr int64_t kMinTaskRows = 48;

// Rows per task for `rows` output rows over `workers` threads (Workers() of cpu_parallel.h): a
// multiple of 12 in [kMinTaskRows, kMb]. One worker runs the tasks one after another, so there
// nothing is gained by cutting a group: its tasks take kMb rows. (Cut for four tasks, a group of
// about 130 rows ran as a task of 132 rows and one of a few, each packing the group's transposed
// weight for the input gradient and ending in a partial register tile: on 8 simulated devices
// sharing 2 cores, where every jaxops call runs on its device's thread, the MoE decoder's train
// step took 1.1% longer, with its other change of that day: ab_models, 2026-11-29.)
inline int64_t TaskRows(int64_t rows, int64_t workers) {
  if (workers <= 1) return kMb;
  const int64_t tasks = kTasksPerWorker * std::max<int64_t>(1, workers);
  const int64_t per = (rows + tasks - 1) / tasks;
  return std::clamp<int64_t>((per + 11) / 12 * 12, kMinTaskRows, kMb);
}

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

// Cuts each group's `extent(g)` output rows into tasks of at most `task_rows` rows.
template <typename Extent>
std::vector<Task> MakeTasks(int64_t groups, int64_t task_rows, Extent extent) {
  std::vector<Task> tasks;
  for (int64_t g = 0; g < groups; ++g) {
    const auto [first, last] = extent(g);
    for (int64_t r = first; r < last; r += task_rows) {
      tasks.push_back({g, r, std::min(task_rows, last - r)});
    }
  }
  return tasks;
}

}  // namespace jaxops::grouped_gemm

#endif  // JAXOPS_XLA_FFI_GROUPED_GEMM_GROUPED_GEMM_H_
