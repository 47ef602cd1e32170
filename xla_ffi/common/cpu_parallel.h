// Splitting CPU work over the XLA FFI thread pool, completing through an ffi::Future.
#ifndef JAXOPS_XLA_FFI_COMMON_CPU_PARALLEL_H_
#define JAXOPS_XLA_FFI_COMMON_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxops {

namespace ffi = xla::ffi;

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

// Runs body(begin, end) over contiguous chunks covering [0, n), at most one chunk per pool thread
// and none smaller than `min_chunk` items (so small problems run inline on the calling thread),
// then finish() once, on whichever thread ran the last chunk. The calling thread runs the first
// chunk itself. The returned future completes after finish() returned.
//
// body and finish must stay valid and must not throw; they are copied into the tasks.
template <typename Body, typename Finish>
ffi::Future ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t min_chunk, Body body,
                        Finish finish) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunks =
      n <= 0
          ? 0
          : std::max<int64_t>(1, std::min<int64_t>(threads, n / std::max<int64_t>(1, min_chunk)));
  if (chunks <= 1) {
    if (n > 0) body(int64_t{0}, n);
    finish();
    return ReadyFuture();
  }

  struct State {
    ffi::Promise promise;
    std::atomic<int64_t> remaining;
    Body body;
    Finish finish;
    State(int64_t count, Body b, Finish f)
        : remaining(count), body(std::move(b)), finish(std::move(f)) {}
  };
  auto state = std::make_shared<State>(chunks, std::move(body), std::move(finish));
  ffi::Future future(state->promise);

  auto run_chunk = [state, n, chunks](int64_t c) {
    const int64_t begin = n / chunks * c + std::min(c, n % chunks);
    const int64_t end = n / chunks * (c + 1) + std::min(c + 1, n % chunks);
    state->body(begin, end);
    if (state->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      state->finish();
      state->promise.SetAvailable();
    }
  };
  for (int64_t c = 1; c < chunks; ++c) {
    pool.Schedule([run_chunk, c] { run_chunk(c); });
  }
  run_chunk(0);
  return future;
}

// ParallelFor without a finishing step.
template <typename Body>
ffi::Future ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t min_chunk, Body body) {
  return ParallelFor(pool, n, min_chunk, std::move(body), [] {});
}

}  // namespace jaxops

#endif  // JAXOPS_XLA_FFI_COMMON_CPU_PARALLEL_H_
