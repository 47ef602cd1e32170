// The per-call-site state of the stateful CUDA handlers (cuBLASLt's: the GEMM family and the
// grouped GEMM's cuBLASLt targets): one plan per device, made on the first execution there.
//
// A Plan has `ffi::Error Create(const Call&)` (the handle, descriptors and algorithm of the call
// site's shapes) and `ffi::Error Run(const Call&, cudaStream_t)` (this execution's pointers,
// enqueued on the stream).
#ifndef JAXOPS_XLA_FFI_COMMON_CUDA_PLANS_H_
#define JAXOPS_XLA_FFI_COMMON_CUDA_PLANS_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxops {

template <typename Plan>
class DevicePlans {
 public:
  // Runs `call` with the plan of `device`, made by Plan::Create on first use (a failed Create
  // leaves no plan: the next execution tries again).
  template <typename Call>
  xla::ffi::Error Run(int32_t device, const Call& call, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::unique_ptr<Plan>& plan = plans_[device];
    if (!plan) {
      auto made = std::make_unique<Plan>();
      if (auto e = made->Create(call); e.failure()) return e;
      plan = std::move(made);
    }
    return plan->Run(call, stream);
  }

 private:
  std::mutex mutex_;
  std::map<int32_t, std::unique_ptr<Plan>> plans_;
};

}  // namespace jaxops

#endif  // JAXOPS_XLA_FFI_COMMON_CUDA_PLANS_H_
