// Splitting CPU work over the XLA FFI thread pool, completing through an ffi::Future.
#ifndef JAXOPS_XLA_FFI_COMMON_CPU_PARALLEL_H_
#define JAXOPS_XLA_FFI_COMMON_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <utility>

#if defined(__linux__)
#include <sched.h>
#endif
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxops {

namespace ffi = xla::ffi;

// Sizes of ParallelFor's work, in bytes of memory traffic (bytes read plus bytes written).
//
// Problems below kParallelInlineBytes run on the calling thread, returning a ready future. Going
// through the pool (a pool thread's wake-up, XLA's continuation of the async custom call) costs
// about 1.5-2.5 us on a 2-core AMD EPYC (Zen 4) under XLA:CPU, which the second core wins back
// from about 256 KiB of traffic on. Measured with rms_norm and add_rms_norm forward, f32 and bf16,
// 8 to 512 rows of 1024 (medians of 600 calls, 3 runs, load average 2-3): pool / inline time was
// 1.0-1.2 at 64-128 KiB, 0.9-1.1 at 256 KiB, 0.75-0.98 at 512 KiB and 0.56-0.83 from 1 MiB on.
inline constexpr int64_t kParallelInlineBytes = int64_t{256} << 10;
// Smallest chunk taken from the shared counter: keeps the counter traffic and the per-chunk
// setup of the kernels (one row, one panel) negligible.
inline constexpr int64_t kParallelMinChunkBytes = int64_t{32} << 10;
// Chunks per worker (the calling thread and pool tasks, one per core) when the problem is large
// enough: a worker that stalls (its core taken by another process) holds up one chunk, about
// 1 / (kParallelChunksPerWorker * workers) of the op, while the others take the rest.
inline constexpr int64_t kParallelChunksPerWorker = 8;

// A future that is already complete, with `error` if it is a failure.
inline ffi::Future ReadyFuture(ffi::Error error = ffi::Error::Success()) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (error.failure()) {
    promise.SetError(std::move(error));
  } else {
    promise.SetAvailable();
  }
  return future;
}

// Cores this process may run on: its CPU affinity on Linux (what XLA:CPU sizes its pool by),
// else the hardware's threads; at least 1. Read once.
inline int64_t ProcessCores() {
  static const int64_t cores = [] {
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
      return std::max<int64_t>(1, CPU_COUNT(&set));
    }
#endif
    return std::max<int64_t>(1, std::thread::hardware_concurrency());
  }();
  return cores;
}

// JAXOPS_CPU_THREADS: a positive integer, else 0 (unset; jaxops' Python side refuses any other
// value when it loads the module). Read once.
inline int64_t ThreadsFromEnvironment() {
  static const int64_t threads = [] {
    const char* text = std::getenv("JAXOPS_CPU_THREADS");
    if (text == nullptr || *text == '\0') return int64_t{0};
    char* end = nullptr;
    const long long value = std::strtoll(text, &end, 10);
    return (*end == '\0' && value > 0) ? static_cast<int64_t>(value) : int64_t{0};
  }();
  return threads;
}

// Threads a call splits its work over: JAXOPS_CPU_THREADS if set (at most the pool's), else the
// pool's, unless the pool has more threads than the process has cores. XLA:CPU gives its pool a
// thread per device when a process has more (simulated) devices than cores, since each device's
// program runs on it at once; a call that split its work there would queue chunks behind the
// other devices' work and wait for them. It runs on the calling thread instead. (8 simulated
// devices on 2 cores, the MoE decoder's train step: 720-750 -> 620 ms with every jaxops CPU call
// on its calling thread, 715 ms on 2 threads.)
inline int64_t Workers(const ffi::ThreadPool& pool) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chosen = ThreadsFromEnvironment();
  if (chosen > 0) return std::min(chosen, threads);
  return threads > ProcessCores() ? 1 : threads;
}

// How ParallelFor cuts n items of `item_bytes` bytes of traffic each, with a pool of `threads`
// threads: `chunks` chunks of `chunk` items (the last one shorter), taken by the calling thread and
// `helpers` pool tasks.
struct ParallelPlan {
  int64_t chunk = 0;
  int64_t chunks = 0;
  int64_t helpers = 0;
};

inline ParallelPlan PlanParallel(int64_t n, int64_t item_bytes, int64_t threads) {
  ParallelPlan plan;
  if (n <= 0) return plan;
  item_bytes = std::max<int64_t>(1, item_bytes);
  const int64_t inline_items = (kParallelInlineBytes + item_bytes - 1) / item_bytes;
  if (n < inline_items || n == 1 || threads <= 1) {
    plan.chunk = n;
    plan.chunks = 1;
    return plan;
  }
  // The calling thread works too and takes the place of one pool thread: with Workers(), one
  // thread per core, so a task for every pool thread on top would only oversubscribe the cores.
  const int64_t workers = threads;
  const int64_t min_items = (kParallelMinChunkBytes + item_bytes - 1) / item_bytes;
  const int64_t target =
      (n + kParallelChunksPerWorker * workers - 1) / (kParallelChunksPerWorker * workers);
  plan.chunk = std::max<int64_t>(1, std::max(min_items, target));
  plan.chunks = (n + plan.chunk - 1) / plan.chunk;
  plan.helpers = std::min(workers - 1, plan.chunks - 1);
  return plan;
}

// Runs body(begin, end) over contiguous chunks covering [0, n) (each item costing about
// `item_bytes` bytes of memory traffic), then finish() once, on whichever thread completed the last
// chunk. The returned future completes after finish() returned.
//
// Small problems (see kParallelInlineBytes) run inline on the calling thread, which then returns
// a ready future. Larger ones are cut into up to kParallelChunksPerWorker chunks per worker (none
// below kParallelMinChunkBytes) that the calling thread and pool tasks take from a shared atomic
// counter until none is left, so the work flows to whichever threads are running.
//
// body and finish must not throw; they are moved into state shared by the tasks, which may run
// after this function returned (a task that starts after the last chunk was taken does nothing).
template <typename Body, typename Finish>
ffi::Future ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t item_bytes, Body body,
                        Finish finish) {
  const ParallelPlan plan = PlanParallel(n, item_bytes, Workers(pool));
  if (plan.chunks <= 1) {
    if (n > 0) body(int64_t{0}, n);
    finish();
    return ReadyFuture();
  }

  struct State {
    ffi::Promise promise;
    std::atomic<int64_t> next{0};  // the next chunk to take
    std::atomic<int64_t> remaining;
    int64_t n;
    ParallelPlan plan;
    Body body;
    Finish finish;
    State(int64_t count, const ParallelPlan& p, Body b, Finish f)
        : remaining(p.chunks), n(count), plan(p), body(std::move(b)), finish(std::move(f)) {}

    // Takes chunks until none is left; the thread that completes the last one finishes.
    void Work() {
      for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < plan.chunks;
           c = next.fetch_add(1, std::memory_order_relaxed)) {
        const int64_t begin = c * plan.chunk;
        body(begin, std::min(n, begin + plan.chunk));
        if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
          finish();
          promise.SetAvailable();
        }
      }
    }
  };
  auto state = std::make_shared<State>(n, plan, std::move(body), std::move(finish));
  ffi::Future future(state->promise);
  for (int64_t h = 0; h < plan.helpers; ++h) {
    pool.Schedule([state] { state->Work(); });
  }
  state->Work();
  return future;
}

// ParallelFor without a finishing step.
template <typename Body>
ffi::Future ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t item_bytes, Body body) {
  return ParallelFor(pool, n, item_bytes, std::move(body), [] {});
}

}  // namespace jaxops

#endif  // JAXOPS_XLA_FFI_COMMON_CPU_PARALLEL_H_
