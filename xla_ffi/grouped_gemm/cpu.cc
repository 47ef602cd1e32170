// Grouped GEMM CPU kernels: the expert FFNs' GEMMs, one custom call per grouped GEMM.
//
//   * GroupedGemm: y[rows of g] = x[rows of g] @ w[g] (w[g]^T with transpose_w), fp32 y; rows
//     past the groups are zero, or with zero_tail false left unwritten (for a caller that reads
//     the groups' rows only).
//   * GroupedGemmWgrad: dw[g] = x[rows of g]^T @ dy[rows of g], fp32; a group without rows
//     gets zeros.
//
// Blocked the way BLIS blocks a GEMM: a task owns up to kMb rows of one group's output (fewer
// when that leaves a core without work: TaskRows); per
// block of kKc along the contraction it packs its rows of A into panels of kMr rows and, per
// kNr = 32 output columns, a panel of B, both as fp32 (so every dtype and every layout, x^T for
// the weight gradient and w^T for the input gradient included, reaches one micro-kernel), and
// the micro-kernel keeps a kMr x 32 tile of fp32 sums in registers over the block. With the
// AVX-512 micro-kernel, float32 and bfloat16 operands whose panels are their transpose (A's rows,
// w^T of the input gradient) are packed by 16 x 16 transposes in registers (the portable loops
// stored one float at a time, 128 bytes apart: 6% of the 8-simulated-device decoder step's CPU
// time; bench_grouped_gemm's fwd + bwd went from 128-137 to 142-162 GFLOP/s). A float32 B
// in row-major order (w of the forward, dy of the weight gradient) is read in place instead of
// packed, 32 columns at a time: a copy of every weight per call and task otherwise (8-9% of the
// 8-simulated-device decoder's loss and gradients, 2-3% of the one-device one), unless its row
// stride is a multiple of 4 KiB (BlockB). The AVX2 kernel (6 x 16 tiles) differs, as BLIS
// blocks for Haswell: it packs every B panel, as two 16-column halves, and runs each half over
// all the A panels (MacroAvx2), so that the half stays in L1; its transposed panels are packed
// by 8 x 8 transposes in registers, and its full tiles written back without masked stores
// (2026-11-30, 2 Zen cores, one core: the expert FFN's grouped GEMMs at about 52 GFLOP/s
// against 40 with the first two undone; the 8-simulated-device decoder step 1.11x as fast with
// them, ab_models). Tasks run on the FFI thread pool, taken from a shared counter, so the groups'
// GEMMs spread over the cores with no loop of small XLA ops around them. fp32 accumulation
// throughout; the blocks of the contraction are added in order.
//
// The micro- and macro-kernels and the choice among them are in cpu_micro.h, the packers in
// cpu_pack.h; this file holds the tasks (blocking, scratch, B read in place or packed) and the
// handlers.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/cpu_convert.h"
#include "xla_ffi/common/cpu_dispatch.h"
#include "xla_ffi/common/cpu_parallel.h"
#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/common/host_float.h"
#include "xla_ffi/grouped_gemm/checks.h"
#include "xla_ffi/grouped_gemm/cpu_micro.h"
#include "xla_ffi/grouped_gemm/cpu_pack.h"
#include "xla_ffi/grouped_gemm/grouped_gemm.h"
#include "xla_ffi/grouped_gemm/handlers.h"

namespace jaxops::grouped_gemm {
namespace cpu {
namespace {

// ---------------------------------------------------------------------------------------------
// Tasks.

template <typename X>
struct ForwardArgs {
  Problem p;
  const X* x = nullptr;  // [R, K]
  const X* w = nullptr;  // [G, K, N], or [G, N, K] with transpose_w
  bool transpose_w = false;
  bool zero_tail = true;  // write zeros to the rows past the groups
  float* y = nullptr;     // [R, N]
};

template <typename X>
struct WgradArgs {
  Problem p;
  const X* x = nullptr;   // [R, K]
  const X* dy = nullptr;  // [R, N]
  float* dw = nullptr;    // [G, K, N]
};

// Scratch of one worker: an A block of kMb x kKc (and 8 floats of slack for the AVX2 packer's
// last store) and a B panel of kKc x kNr, fp32. Every element a kernel reads from it was packed
// there first, so it is left uninitialized.
struct Scratch {
  std::unique_ptr<float[]> a{new float[kMb * kKc + 8]};
  std::unique_ptr<float[]> b{new float[kKc * kNr]};
};

// This thread's scratch, allocated on its first task and kept for the thread's life: a chunk of
// tasks neither allocates (420 KiB, a heap search) nor clears memory. (Allocating and
// value-initializing it per chunk took 9% of the CPU time of the 8-simulated-device decoder step.)
Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// A micro-kernel's tile: kMr rows; B panels packed in slices of kPw columns (PanelIndex).
template <int64_t Mr, int64_t Pw>
struct Tile {
  static constexpr int64_t kMr = Mr;
  static constexpr int64_t kPw = Pw;
};

// Row strides of a float32 B that BlockB reads in place: not a multiple of 4 KiB. At such a
// stride every row of the block lies on its own page in the same L1 set, which holds 8-12 of
// its kc rows: measured with the AVX2 kernel before it packed every B (2 Zen cores), packing
// then ran 1.1-1.3x faster at 1024 and 2048 columns, and reading in place 1.0-1.15x faster at
// 256-768.
constexpr int64_t kAliasingBytes = 4096;

// The B operand of a block: rows [k0, k0 + kc) and columns [n0, n0 + nr) of a row-major
// matrix `src` (leading dimension ld). For the 32-column kernels (kPw = kNr) a float32 source
// with all kNr columns is read in place (no copy: the block's rows are ld apart) unless its rows
// alias (kAliasingBytes); any other dtype, a narrower edge panel, and every block of the AVX2
// kernel are packed into `panel` (fp32, zero-padded to kNr columns). AVX2 packs, since its
// passes keep a half of the block in L1 (MacroAvx2), which rows 1-2 KiB apart (a weight of
// 256-512 columns) could not stay in: 2 Zen cores, the expert FFN's grouped GEMMs, one core,
// 1.05-1.08x the time read in place.
template <int64_t kPw, typename X>
BBlock BlockB(const X* src, int64_t ld, int64_t k0, int64_t kc, int64_t n0, int64_t nr,
              float* panel) {
  if constexpr (std::is_same_v<X, float>) {
    const bool aliasing = (ld * int64_t{sizeof(float)}) % kAliasingBytes == 0;
    if (kPw == kNr && nr == kNr && !aliasing) return {src + k0 * ld + n0, ld, 16};
  }
  PackB<kPw>(src, ld, k0, kc, n0, nr, panel);
  return PanelBlock<kPw>(panel, kc);
}

// y rows [t.first, t.first + t.rows) of group t.group.
template <typename T, typename X>
void ForwardTask(const ForwardArgs<X>& a, const Task& t, Macro macro, Scratch& s) {
  const Problem& p = a.p;
  const X* w = a.w + t.group * p.k * p.n;
  float* y = a.y + t.first * p.n;
  if (p.k == 0) {
    std::fill(y, y + t.rows * p.n, 0.0f);
    return;
  }
  for (int64_t k0 = 0; k0 < p.k; k0 += kKc) {
    const int64_t kc = std::min(kKc, p.k - k0);
    PackRows<T::kMr>(a.x + t.first * p.k, p.k, t.rows, k0, kc, s.a.get());
    for (int64_t n0 = 0; n0 < p.n; n0 += kNr) {
      const int64_t nr = std::min(kNr, p.n - n0);
      BBlock b;
      if (a.transpose_w) {
        PackBTransposed<T::kPw>(w, p.k, k0, kc, n0, nr, s.b.get());
        b = PanelBlock<T::kPw>(s.b.get(), kc);
      } else {
        b = BlockB<T::kPw>(w, p.n, k0, kc, n0, nr, s.b.get());
      }
      macro(kc, s.a.get(), t.rows, b, y + n0, p.n, nr, k0 > 0);
    }
  }
}

// dw[t.group] rows [t.first, t.first + t.rows) (columns of x), over the group's rows.
template <typename T, typename X>
void WgradTask(const WgradArgs<X>& a, const GroupRows& groups, const Task& t, Macro macro,
               Scratch& s) {
  const Problem& p = a.p;
  float* dw = a.dw + (t.group * p.k + t.first) * p.n;
  const int64_t begin = groups.begins[t.group];
  const int64_t end = groups.ends[t.group];
  if (begin == end) {
    std::fill(dw, dw + t.rows * p.n, 0.0f);
    return;
  }
  for (int64_t r0 = begin; r0 < end; r0 += kKc) {
    const int64_t kc = std::min(kKc, end - r0);
    PackColumns<T::kMr>(a.x, p.k, t.first, t.rows, r0, kc, s.a.get());
    for (int64_t n0 = 0; n0 < p.n; n0 += kNr) {
      const int64_t nr = std::min(kNr, p.n - n0);
      const BBlock b = BlockB<T::kPw>(a.dy, p.n, r0, kc, n0, nr, s.b.get());
      macro(kc, s.a.get(), t.rows, b, dw + n0, p.n, nr, r0 > begin);
    }
  }
}

// Bytes of memory traffic of a task of `rows` rows (ParallelFor's unit of work).
int64_t TaskBytes(const Problem& p, int64_t rows, int64_t contraction) {
  return (rows * contraction + contraction * p.n + rows * p.n) * int64_t{4};
}

// Runs task(t, scratch) for every task over the pool.
template <typename RunTask>
ffi::Future RunTasks(ffi::ThreadPool& pool, std::vector<Task> tasks, int64_t item_bytes,
                     RunTask run) {
  const int64_t n = static_cast<int64_t>(tasks.size());
  return ParallelFor(pool, n, item_bytes,
                     [tasks = std::move(tasks), run](int64_t begin, int64_t end) {
                       Scratch& scratch = ThreadScratch();
                       for (int64_t i = begin; i < end; ++i) run(tasks[i], scratch);
                     });
}

// RunTasks with ChosenKernel(): make(tile, macro) gives the task runner of its macro-kernel
// (tile: a Tile, its register tile's rows and its B panels' layout).
template <typename Make>
ffi::Future RunWithKernel(ffi::ThreadPool& pool, std::vector<Task> tasks, int64_t item_bytes,
                          Make make) {
  switch (ChosenKernel()) {
#if defined(JAXOPS_GROUPED_GEMM_SIMD)
    case Kernel::kAvx512:
      return RunTasks(pool, std::move(tasks), item_bytes,
                      make(Tile<kMrAvx512, kNr>{}, MacroPanels<kMrAvx512, MicroAvx512>));
    case Kernel::kAvx2:
      return RunTasks(pool, std::move(tasks), item_bytes, make(Tile<kMrAvx2, 16>{}, MacroAvx2));
#endif
    default:
      return RunTasks(
          pool, std::move(tasks), item_bytes,
          make(Tile<kMrPortable, kNr>{}, MacroPanels<kMrPortable, MicroPortable<kMrPortable>>));
  }
}

template <typename X>
ffi::Future ForwardImpl(ffi::ThreadPool& pool, const ForwardArgs<X>& a, const int32_t* sizes) {
  const Problem& p = a.p;
  const GroupRows groups = ClipGroups(sizes, p.groups, p.rows);
  // Rows past the last group: zeros, unless the caller never reads them (zero_tail false: the
  // expert layer's worst-case buffers, whose rows past the groups are about three quarters of
  // them on 8 simulated devices).
  const int64_t used = p.groups > 0 ? groups.ends.back() : 0;
  if (a.zero_tail) std::fill(a.y + used * p.n, a.y + p.rows * p.n, 0.0f);
  const int64_t task_rows = TaskRows(used, Workers(pool));
  std::vector<Task> tasks = MakeTasks(
      p.groups, task_rows, [&](int64_t g) { return std::pair(groups.begins[g], groups.ends[g]); });
  return RunWithKernel(
      pool, std::move(tasks), TaskBytes(p, task_rows, p.k), [a](auto tile, Macro macro) {
        return
            [a, macro](const Task& t, Scratch& s) { ForwardTask<decltype(tile)>(a, t, macro, s); };
      });
}

template <typename X>
ffi::Future WgradImpl(ffi::ThreadPool& pool, const WgradArgs<X>& a, const int32_t* sizes) {
  const Problem& p = a.p;
  GroupRows groups = ClipGroups(sizes, p.groups, p.rows);
  const int64_t task_rows = TaskRows(p.groups * p.k, Workers(pool));
  std::vector<Task> tasks =
      MakeTasks(p.groups, task_rows, [&](int64_t) { return std::pair(int64_t{0}, p.k); });
  // A group's contraction is its rows (the average group's for the split).
  const int64_t bytes =
      TaskBytes(p, task_rows, std::max<int64_t>(1, p.rows / std::max<int64_t>(1, p.groups)));
  return RunWithKernel(pool, std::move(tasks), bytes, [a, groups](auto tile, Macro macro) {
    return [a, groups, macro](const Task& t, Scratch& s) {
      WgradTask<decltype(tile)>(a, groups, t, macro, s);
    };
  });
}

// ---------------------------------------------------------------------------------------------
// Validation and dtype dispatch.

ffi::Future ForwardDispatch(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::Buffer<ffi::F32>> y,
                            bool transpose_w, bool zero_tail) {
  auto problem = CheckForward(x, w, sizes, *y, transpose_w);
  if (problem.has_error()) return ReadyFuture(problem.error());
  return DispatchFloat("grouped_gemm", "x", x.element_type(), [&](auto tag) {
    using X = typename decltype(tag)::type;
    ForwardArgs<X> a;
    a.p = *problem;
    a.x = static_cast<const X*>(x.untyped_data());
    a.w = static_cast<const X*>(w.untyped_data());
    a.transpose_w = transpose_w;
    a.zero_tail = zero_tail;
    a.y = y->typed_data();
    return ForwardImpl<X>(pool, a, sizes.typed_data());
  });
}

ffi::Future WgradDispatch(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                          ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::Buffer<ffi::F32>> dw) {
  auto problem = CheckWgrad(x, dy, sizes, *dw);
  if (problem.has_error()) return ReadyFuture(problem.error());
  return DispatchFloat("grouped_gemm_wgrad", "x", x.element_type(), [&](auto tag) {
    using X = typename decltype(tag)::type;
    WgradArgs<X> a;
    a.p = *problem;
    a.x = static_cast<const X*>(x.untyped_data());
    a.dy = static_cast<const X*>(dy.untyped_data());
    a.dw = dw->typed_data();
    return WgradImpl<X>(pool, a, sizes.typed_data());
  });
}

}  // namespace
}  // namespace cpu

const char* CpuKernelName() {
  switch (cpu::ChosenKernel()) {
    case cpu::Kernel::kAvx512:
      return "avx512";
    case cpu::Kernel::kAvx2:
      return "avx2";
    default:
      return "portable";
  }
}

}  // namespace jaxops::grouped_gemm

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmCpu, jaxops::grouped_gemm::cpu::ForwardDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()  // pool
                                  .Arg<xla::ffi::AnyBuffer>()   // x [R, K]
                                  .Arg<xla::ffi::AnyBuffer>()   // w [G, K, N] | [G, N, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // group_sizes [G]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // y [R, N]
                                  .Attr<bool>("transpose_w")               // w is [G, N, K]
                                  .Attr<bool>("zero_tail"));  // zeros past the groups' rows

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmWgradCpu, jaxops::grouped_gemm::cpu::WgradDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()               // pool
                                  .Arg<xla::ffi::AnyBuffer>()                // x [R, K]
                                  .Arg<xla::ffi::AnyBuffer>()                // dy [R, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // group_sizes [G]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // dw [G, K, N]
