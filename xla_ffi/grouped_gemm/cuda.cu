// CUDA handlers of the grouped GEMM family: the forward (x @ w[g], or x @ w[g].T) and the weight
// gradient, the same targets and contracts as the CPU handlers (checks.h). The kernels and their
// design live in kernels.cuh.
//
// Three layers, as in jax's examples/ffi:
//   1. Kernels: GroupedGemmFwdKernel<T, kTransW> and GroupedGemmWgradKernel<T> (kernels.cuh).
//   2. Implementations (ForwardImpl<T>, WgradImpl<T>): the grid, the 16-byte-load eligibility
//      of each operand, the launch on the XLA stream, launch errors turned into ffi::Error.
//   3. One dispatch per handler: validates with checks.h, then switches once on the dtype.
//
// Nothing synchronizes with the host: the group sizes stay on the device, and each CTA finds its
// group itself.
//
// JAXOPS_GPU_GEMM_PIPELINE (read at each call) picks the kernels' pipeline for bfloat16 and
// float16: "registers" (the default: the register-staged one, run and tested on an H200 on
// 2026-11-30) or "async" (kAsyncStages cp.async stages; compiled, not yet run on a GPU). float32
// always takes the register-staged one.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "xla_ffi/common/cuda_util.cuh"
#include "xla_ffi/common/cuda_vec.cuh"
#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/common/math.h"
#include "xla_ffi/grouped_gemm/checks.h"
#include "xla_ffi/grouped_gemm/cuda_kernels.h"
#include "xla_ffi/grouped_gemm/handlers.h"
#include "xla_ffi/grouped_gemm/kernels.cuh"

namespace jaxops::grouped_gemm {
namespace {

// Largest grid.y (CUDA's limit): N up to 65535 * kBn columns.
constexpr int64_t kMaxGridY = 65535;

ffi::Error CheckGrid(const char* op, int64_t x_ctas, int64_t y_ctas) {
  if (x_ctas > int64_t{0x7fffffff} || y_ctas > kMaxGridY) {
    return InvalidArgument(std::string(op) + ": the problem needs a grid of " +
                           std::to_string(x_ctas) + " x " + std::to_string(y_ctas) +
                           " CTAs, past CUDA's limits (2^31 - 1 x 65535)");
  }
  return ffi::Error::Success();
}

// The kernel arguments: a and b with the row lengths that decide their 16-byte loads.
template <typename T>
Args<T> MakeArgs(const Problem& p, const void* a, int64_t a_ld, const void* b, int64_t b_ld,
                 const ffi::Buffer<ffi::S32>& sizes, float* out) {
  Args<T> args;
  args.a = static_cast<const T*>(a);
  args.b = static_cast<const T*>(b);
  args.sizes = sizes.typed_data();
  args.out = out;
  args.rows = p.rows;
  args.k = p.k;
  args.n = p.n;
  args.groups = p.groups;
  args.a_vec = Vectorizable<T>(a_ld, {a});  // cuda_vec.cuh: aligned, whole 16-byte accesses
  args.b_vec = Vectorizable<T>(b_ld, {b});
  return args;
}

// The pipeline stages of T's kernels (kernels.cuh's kStages) that JAXOPS_GPU_GEMM_PIPELINE asks
// for: 0 (register-staged) or kAsyncStages (16-bit types only).
template <typename T>
ffi::ErrorOr<int> PipelineStages(const char* op) {
  const char* text = std::getenv("JAXOPS_GPU_GEMM_PIPELINE");
  if (text == nullptr || *text == '\0' || std::strcmp(text, "registers") == 0) return 0;
  if (std::strcmp(text, "async") == 0) return std::is_same_v<T, float> ? 0 : kAsyncStages;
  return Bad(std::string(op) +
             ": JAXOPS_GPU_GEMM_PIPELINE must be \"registers\" or \"async\", got \"" + text + "\"");
}

// Launches `kernel` with `shared_bytes` of dynamic shared memory (reserved first when above the
// default).
template <typename T>
ffi::Error Launch(const char* op, void (*kernel)(Args<T>), size_t shared_bytes, dim3 grid,
                  cudaStream_t stream, const Args<T>& a) {
  if (auto e = ReserveDynamicShared(op, kernel, shared_bytes); e.failure()) return e;
  kernel<<<grid, kThreads, shared_bytes, stream>>>(a);
  return LastLaunchError(op);
}

template <typename T, bool kTransW>
ffi::Error LaunchForward(int stages, dim3 grid, cudaStream_t stream, const Args<T>& a) {
  constexpr const char* kOp = "grouped_gemm forward kernel";
  if constexpr (!std::is_same_v<T, float>) {
    if (stages == kAsyncStages) {
      return Launch(kOp, GroupedGemmFwdKernel<T, kTransW, kAsyncStages>,
                    kAsyncSharedBytes<T, false, kTransW, kAsyncStages>, grid, stream, a);
    }
  }
  return Launch(kOp, GroupedGemmFwdKernel<T, kTransW, 0>, 0, grid, stream, a);
}

template <typename T>
ffi::Error ForwardImpl(cudaStream_t stream, const Problem& p, const Args<T>& a, bool transpose_w) {
  constexpr const char* kOp = "grouped_gemm";
  if (p.rows == 0 || p.n == 0) return ffi::Error::Success();  // y is empty
  const int64_t x_ctas = CeilDiv(p.rows, int64_t{kBm}) + p.groups + 1;
  const int64_t y_ctas = CeilDiv(p.n, int64_t{kBn});
  if (auto e = CheckGrid(kOp, x_ctas, y_ctas); e.failure()) return e;
  auto stages = PipelineStages<T>(kOp);
  if (stages.has_error()) return stages.error();
  const dim3 grid(static_cast<unsigned>(x_ctas), static_cast<unsigned>(y_ctas));
  if (transpose_w) return LaunchForward<T, true>(*stages, grid, stream, a);
  return LaunchForward<T, false>(*stages, grid, stream, a);
}

template <typename T>
ffi::Error WgradImpl(cudaStream_t stream, const Problem& p, const Args<T>& a) {
  constexpr const char* kOp = "grouped_gemm_wgrad";
  if (p.groups == 0 || p.k == 0 || p.n == 0) return ffi::Error::Success();  // dw is empty
  const int64_t x_ctas = p.groups * CeilDiv(p.k, int64_t{kBm});
  const int64_t y_ctas = CeilDiv(p.n, int64_t{kBn});
  if (auto e = CheckGrid(kOp, x_ctas, y_ctas); e.failure()) return e;
  auto stages = PipelineStages<T>(kOp);
  if (stages.has_error()) return stages.error();
  const dim3 grid(static_cast<unsigned>(x_ctas), static_cast<unsigned>(y_ctas));
  constexpr const char* kKernel = "grouped_gemm_wgrad kernel";
  if constexpr (!std::is_same_v<T, float>) {
    if (*stages == kAsyncStages) {
      return Launch(kKernel, GroupedGemmWgradKernel<T, kAsyncStages>,
                    kAsyncSharedBytes<T, true, false, kAsyncStages>, grid, stream, a);
    }
  }
  return Launch(kKernel, GroupedGemmWgradKernel<T, 0>, 0, grid, stream, a);
}

}  // namespace

ffi::Error KernelForward(cudaStream_t stream, const Problem& p, const ffi::AnyBuffer& x,
                         const ffi::AnyBuffer& w, const ffi::Buffer<ffi::S32>& sizes, float* y,
                         bool transpose_w, bool zero_tail) {
  return DispatchFloat("grouped_gemm", "x", x.element_type(), [&](auto tag) -> ffi::Error {
    using T = typename decltype(tag)::type;
    Args<T> a =
        MakeArgs<T>(p, x.untyped_data(), p.k, w.untyped_data(), transpose_w ? p.k : p.n, sizes, y);
    a.zero_tail = zero_tail;
    return ForwardImpl<T>(stream, p, a, transpose_w);
  });
}

ffi::Error KernelWgrad(cudaStream_t stream, const Problem& p, const ffi::AnyBuffer& x,
                       const ffi::AnyBuffer& dy, const ffi::Buffer<ffi::S32>& sizes, float* dw) {
  return DispatchFloat("grouped_gemm_wgrad", "x", x.element_type(), [&](auto tag) -> ffi::Error {
    using T = typename decltype(tag)::type;
    const Args<T> a = MakeArgs<T>(p, x.untyped_data(), p.k, dy.untyped_data(), p.n, sizes, dw);
    return WgradImpl<T>(stream, p, a);
  });
}

namespace {

// ---------------------------------------------------------------------------------------------
// Dispatch.

ffi::Error ForwardDispatch(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                           ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::Buffer<ffi::F32>> y,
                           bool transpose_w, bool zero_tail) {
  auto problem = CheckForward(x, w, sizes, *y, transpose_w);
  if (problem.has_error()) return problem.error();
  return KernelForward(stream, *problem, x, w, sizes, y->typed_data(), transpose_w, zero_tail);
}

ffi::Error WgradDispatch(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                         ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::Buffer<ffi::F32>> dw) {
  auto problem = CheckWgrad(x, dy, sizes, *dw);
  if (problem.has_error()) return problem.error();
  return KernelWgrad(stream, *problem, x, dy, sizes, dw->typed_data());
}

}  // namespace
}  // namespace jaxops::grouped_gemm

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    GroupedGemmCuda, jaxops::grouped_gemm::ForwardDispatch,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<xla::ffi::AnyBuffer>()                     // x [R, K]
        .Arg<xla::ffi::AnyBuffer>()                     // w [G, K, N] | [G, N, K]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // group_sizes [G]
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // y [R, N]
        .Attr<bool>("transpose_w")                      // w is [G, N, K]
        .Attr<bool>("zero_tail"),                       // zeros past the groups' rows
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    GroupedGemmWgradCuda, jaxops::grouped_gemm::WgradDispatch,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<xla::ffi::AnyBuffer>()                     // x [R, K]
        .Arg<xla::ffi::AnyBuffer>()                     // dy [R, N]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // group_sizes [G]
        .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),        // dw [G, K, N]
    {xla::ffi::Traits::kCmdBufferCompatible});
