// CUDA handlers of the RMSNorm family: rms_norm forward, fused residual add + rms_norm forward,
// and the backward pass. The kernels live in fwd_kernels.cuh and bwd_kernels.cuh, their designs
// and building blocks in kernel_util.cuh, the math in rms_norm.h and the contracts in checks.h.
//
// Three layers, as in jax's examples/ffi:
//   1. Templated kernels over T (x's dtype), W (the weight's dtype) and kVec (elements per
//      memory access: 16 bytes of T, or 1 for the scalar fallback): fwd_kernels.cuh and
//      bwd_kernels.cuh.
//   2. Typed implementations (RmsNormFwdTyped<kAdd, T, W>, RmsNormBwdTyped<T, W>) that pick the
//      access width and a design for the row length (PlanRows), launch on the XLA stream and turn
//      launch failures into errors.
//   3. One dispatch per handler: validates with checks.h, then DispatchFloatTypes (the common
//      DispatchFloat for x, then for the weight) turns their runtime dtypes into T and W.
//
// Memory access is 16 bytes per load/store (8 x bfloat16 / float16, 4 x float32) when hidden is a
// multiple of that and every base pointer is 16-byte aligned; otherwise the same kernels run with
// one element per access. Nothing synchronizes with the host.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "xla_ffi/common/cuda_util.cuh"
#include "xla_ffi/common/cuda_vec.cuh"
#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/common/math.h"
#include "xla_ffi/rms_norm/bwd_kernels.cuh"
#include "xla_ffi/rms_norm/checks.h"
#include "xla_ffi/rms_norm/fwd_kernels.cuh"
#include "xla_ffi/rms_norm/handlers.h"
#include "xla_ffi/rms_norm/kernel_util.cuh"
#include "xla_ffi/rms_norm/rms_norm.h"

namespace jaxops::rms_norm {
namespace {

// ---------------------------------------------------------------------------------------------
// Launch plans.

constexpr int kBlockCtaTarget = 256;  // Short rows are packed into CTAs of this many threads.

enum class Design { kWarpRow, kBlockRow, kLongRow };

// A design and its launch shape: CTAs of cta_threads threads, rows_per_cta row groups of
// group_threads threads each (the argument of the warp- and block-per-row kernels).
struct RowPlan {
  Design design;
  int group_threads;
  int rows_per_cta;
  int cta_threads;
};

// Lanes per row of the warp-per-row design: one per access up to a full warp (then each lane
// makes up to kCachedAccesses accesses).
int WarpLanes(int64_t vecs) {
  return static_cast<int>(std::min<int64_t>(kWarpSize, NextPowerOfTwo(vecs)));
}

// Threads per row of the block-per-row design: whole warps, each thread caching <= iters accesses.
int BlockGroupThreads(int64_t vecs, int iters) {
  const int64_t warps = CeilDiv(CeilDiv(vecs, iters), kWarpSize);
  return static_cast<int>(std::clamp<int64_t>(warps * kWarpSize, kWarpSize, kMaxGroupThreads));
}

// The design for rows of `hidden` elements accessed kVec at a time; long rows run CTAs of
// long_row_threads threads, one row each.
template <int kVec>
RowPlan PlanRows(int64_t hidden, int long_row_threads) {
  const int64_t vecs = hidden / kVec;
  if (hidden <= kWarpRowMaxHidden<kVec>) {
    const int lanes = WarpLanes(vecs);
    return {Design::kWarpRow, lanes, kWarpCtaThreads / lanes, kWarpCtaThreads};
  }
  if (hidden <= kBlockRowMaxHidden<kVec>) {
    const int group_threads = BlockGroupThreads(vecs, kCachedAccesses<kVec>);
    const int groups = std::max(1, kBlockCtaTarget / group_threads);
    return {Design::kBlockRow, group_threads, groups, groups * group_threads};
  }
  return {Design::kLongRow, long_row_threads, 1, long_row_threads};
}

// Launches the kernel of the plan's design with `shared_bytes` of dynamic shared memory: the
// warp- and block-per-row kernels take (a, group_threads), the long-row kernel (a).
template <typename Args, typename WarpKernel, typename BlockKernel, typename LongRowKernel>
ffi::Error LaunchPlan(const RowPlan& plan, unsigned grid, size_t shared_bytes, cudaStream_t stream,
                      const Args& a, WarpKernel warp_kernel, BlockKernel block_kernel,
                      LongRowKernel long_row_kernel, const char* op, const char* what) {
  auto reserve = [&](auto kernel) { return ReserveDynamicShared(op, kernel, shared_bytes); };
  switch (plan.design) {
    case Design::kWarpRow:
      if (auto e = reserve(warp_kernel); e.failure()) return e;
      warp_kernel<<<grid, plan.cta_threads, shared_bytes, stream>>>(a, plan.group_threads);
      break;
    case Design::kBlockRow:
      if (auto e = reserve(block_kernel); e.failure()) return e;
      block_kernel<<<grid, plan.cta_threads, shared_bytes, stream>>>(a, plan.group_threads);
      break;
    case Design::kLongRow:
      if (auto e = reserve(long_row_kernel); e.failure()) return e;
      long_row_kernel<<<grid, plan.cta_threads, shared_bytes, stream>>>(a);
      break;
  }
  return LastLaunchError(what);
}

// ---------------------------------------------------------------------------------------------
// Typed implementations.

template <bool kAdd, int kVec, typename T, typename W>
ffi::Error LaunchFwd(cudaStream_t stream, const FwdArgs<T, W>& a) {
  const RowPlan plan = PlanRows<kVec>(a.hidden, kFwdLongRowThreads);
  return LaunchPlan(plan, GridCtas(a.rows, plan.rows_per_cta), 0, stream, a,
                    RmsNormFwdWarpKernel<kAdd, kVec, T, W>, RmsNormFwdBlockKernel<kAdd, kVec, T, W>,
                    RmsNormFwdLongRowKernel<kAdd, kVec, T, W>,
                    kAdd ? "add_rms_norm forward" : "rms_norm forward",
                    kAdd ? "add_rms_norm forward kernel" : "rms_norm forward kernel");
}

// Forward of rms_norm (kAdd = false) and add_rms_norm (kAdd = true).
template <bool kAdd, typename T, typename W>
ffi::Error RmsNormFwdTyped(cudaStream_t stream, const FwdArgs<T, W>& a) {
  if (a.rows == 0) return ffi::Error::Success();
  if (Vectorizable<T>(a.hidden, {a.x, a.residual, a.weight, a.y, a.h})) {
    return LaunchFwd<kAdd, kVecElems<T>>(stream, a);
  }
  return LaunchFwd<kAdd, 1>(stream, a);
}

// Dynamic shared memory of the cached backward kernels: dw_acc [groups, hidden] floats when there
// is a weight. A group covers at most group_size * kIters * kVec columns, so this is at most
// (CTA threads) * kIters * kVec floats: 32 KiB for the warp kernel and for block CTAs of several
// rows, 64 KiB for a single row of 16384 (LaunchPlan opts in above 48 KiB).
size_t BwdSharedBytes(const RowPlan& plan, bool has_dw, int64_t hidden) {
  if (!has_dw || plan.design == Design::kLongRow) return 0;
  return sizeof(float) * static_cast<size_t>(plan.rows_per_cta) * static_cast<size_t>(hidden);
}

template <int kVec, typename T, typename W>
ffi::Error LaunchBwd(cudaStream_t stream, const BwdArgs<T, W>& a) {
  const RowPlan plan = PlanRows<kVec>(a.hidden, kBwdLongRowThreads);
  const bool has_dw = a.dw_partial != nullptr;
  // With a weight the grid is exactly one CTA per part (PartRows); otherwise grid-stride.
  const unsigned grid =
      has_dw ? static_cast<unsigned>(a.parts) : GridCtas(a.rows, plan.rows_per_cta);
  return LaunchPlan(plan, grid, BwdSharedBytes(plan, has_dw, a.hidden), stream, a,
                    RmsNormBwdWarpKernel<kVec, T, W>, RmsNormBwdBlockKernel<kVec, T, W>,
                    RmsNormBwdLongRowKernel<kVec, T, W>, "rms_norm backward",
                    "rms_norm backward kernel");
}

// Backward: dx, and with a weight dw via dw_partial (dw is float32 [hidden] or nullptr).
template <typename T, typename W>
ffi::Error RmsNormBwdTyped(cudaStream_t stream, const BwdArgs<T, W>& a, float* dw) {
  const bool has_dw = a.dw_partial != nullptr;
  if (a.rows == 0) {
    // No rows (no kernel runs), but dw = a sum over no rows = 0 must still be written; the parts
    // are zeroed too so that no output is left undefined.
    if (!has_dw) return ffi::Error::Success();
    const char* what = "rms_norm backward: zero-filling dw";
    const int64_t row_bytes = static_cast<int64_t>(sizeof(float)) * a.hidden;
    if (auto e = FillAsync(what, dw, 0, row_bytes, stream); e.failure()) return e;
    return FillAsync(what, a.dw_partial, 0, row_bytes * a.parts, stream);
  }
  const bool vectorizable =
      Vectorizable<T>(a.hidden, {a.dy, a.x, a.weight, a.dh, a.dx, a.dw_partial});
  const ffi::Error main =
      vectorizable ? LaunchBwd<kVecElems<T>>(stream, a) : LaunchBwd<1>(stream, a);
  if (main.failure() || !has_dw) return main;
  RmsNormSumPartsKernel<<<GridCtas(a.hidden, kSumPartsCols), kSumPartsThreads, 0, stream>>>(
      a.dw_partial, dw, a.parts, a.hidden);
  return LastLaunchError("rms_norm backward dw reduction kernel");
}

// ---------------------------------------------------------------------------------------------
// Dispatch.

// Calls launch(TypeTag<T>{}, TypeTag<W>{}) for x's dtype T and the weight's dtype W, each one of
// float32, bfloat16 or float16 (cuda_util.cuh's DispatchFloat, x first).
template <typename Launch>
ffi::Error DispatchFloatTypes(const char* op, ffi::DataType x_dtype, ffi::DataType w_dtype,
                              Launch&& launch) {
  return DispatchFloat(op, "x", x_dtype, [&](auto x_tag) -> ffi::Error {
    return DispatchFloat(op, "weight", w_dtype,
                         [&](auto w_tag) -> ffi::Error { return launch(x_tag, w_tag); });
  });
}

// An absent weight (shape [0]) has no meaningful dtype; dispatch it as x's so it never fails.
ffi::DataType WeightDtype(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight, bool has_weight) {
  return has_weight ? weight.element_type() : x.element_type();
}

// The kernel arguments both forward handlers share.
template <typename T, typename W>
FwdArgs<T, W> MakeFwdArgs(const RowShape& shape, const ffi::AnyBuffer& x,
                          const ffi::AnyBuffer& weight, ffi::Result<ffi::AnyBuffer>& y,
                          ffi::Result<ffi::Buffer<ffi::F32>>& rstd, float eps,
                          bool zero_centered_weight) {
  FwdArgs<T, W> a;
  a.x = static_cast<const T*>(x.untyped_data());
  a.weight = shape.has_weight ? static_cast<const W*>(weight.untyped_data()) : nullptr;
  a.y = static_cast<T*>(y->untyped_data());
  a.rstd = rstd->typed_data();
  a.rows = shape.rows;
  a.hidden = shape.hidden;
  a.eps = eps;
  a.zero_centered = zero_centered_weight;
  return a;
}

ffi::Error RmsNormFwdCudaDispatch(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                                  ffi::Buffer<ffi::F32> rstd_in, ffi::Result<ffi::AnyBuffer> y,
                                  ffi::Result<ffi::Buffer<ffi::F32>> rstd, float eps,
                                  bool zero_centered_weight) {
  const auto shape = CheckForward(x, weight, static_cast<int64_t>(rstd_in.element_count()), *y,
                                  static_cast<int64_t>(rstd->element_count()));
  if (shape.has_error()) return shape.error();
  return DispatchFloatTypes("rms_norm", x.element_type(), WeightDtype(x, weight, shape->has_weight),
                            [&](auto x_tag, auto w_tag) -> ffi::Error {
                              using T = typename decltype(x_tag)::type;
                              using W = typename decltype(w_tag)::type;
                              FwdArgs<T, W> a = MakeFwdArgs<T, W>(*shape, x, weight, y, rstd, eps,
                                                                  zero_centered_weight);
                              a.rstd_in = shape->has_rstd_in ? rstd_in.typed_data() : nullptr;
                              return RmsNormFwdTyped</*kAdd=*/false>(stream, a);
                            });
}

ffi::Error AddRmsNormFwdCudaDispatch(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                                     ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> y,
                                     ffi::Result<ffi::AnyBuffer> h,
                                     ffi::Result<ffi::Buffer<ffi::F32>> rstd, float eps,
                                     bool zero_centered_weight) {
  const auto shape =
      CheckAddForward(x, residual, weight, *y, *h, static_cast<int64_t>(rstd->element_count()));
  if (shape.has_error()) return shape.error();
  return DispatchFloatTypes(
      "add_rms_norm", x.element_type(), WeightDtype(x, weight, shape->has_weight),
      [&](auto x_tag, auto w_tag) -> ffi::Error {
        using T = typename decltype(x_tag)::type;
        using W = typename decltype(w_tag)::type;
        FwdArgs<T, W> a = MakeFwdArgs<T, W>(*shape, x, weight, y, rstd, eps, zero_centered_weight);
        a.residual = static_cast<const T*>(residual.untyped_data());
        a.h = static_cast<T*>(h->untyped_data());
        return RmsNormFwdTyped</*kAdd=*/true>(stream, a);
      });
}

ffi::Error RmsNormBwdCudaDispatch(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                                  ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> rstd,
                                  ffi::Buffer<ffi::F32> dot_in, ffi::AnyBuffer dh,
                                  ffi::Result<ffi::AnyBuffer> dx,
                                  ffi::Result<ffi::Buffer<ffi::F32>> dw,
                                  ffi::Result<ffi::AnyBuffer> dw_partial,
                                  bool zero_centered_weight) {
  const auto shape = CheckBackward(dy, x, weight, static_cast<int64_t>(rstd.element_count()),
                                   static_cast<int64_t>(dot_in.element_count()), dh, *dx,
                                   static_cast<int64_t>(dw->element_count()), *dw_partial);
  if (shape.has_error()) return shape.error();
  return DispatchFloatTypes(
      "rms_norm backward", x.element_type(), WeightDtype(x, weight, shape->has_weight),
      [&](auto x_tag, auto w_tag) -> ffi::Error {
        using T = typename decltype(x_tag)::type;
        using W = typename decltype(w_tag)::type;
        BwdArgs<T, W> a;
        a.dy = static_cast<const T*>(dy.untyped_data());
        a.x = static_cast<const T*>(x.untyped_data());
        a.weight = shape->has_weight ? static_cast<const W*>(weight.untyped_data()) : nullptr;
        a.rstd = rstd.typed_data();
        a.dot_in = shape->has_dot_in ? dot_in.typed_data() : nullptr;
        a.dh = shape->has_dh ? static_cast<const T*>(dh.untyped_data()) : nullptr;
        a.dx = static_cast<T*>(dx->untyped_data());
        a.dw_partial =
            shape->has_weight ? static_cast<float*>(dw_partial->untyped_data()) : nullptr;
        a.rows = shape->rows;
        a.hidden = shape->hidden;
        a.parts = shape->parts;
        a.zero_centered = zero_centered_weight;
        return RmsNormBwdTyped(stream, a, shape->has_weight ? dw->typed_data() : nullptr);
      });
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Handler symbols (see handlers.h).

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RmsNormFwdCuda, RmsNormFwdCudaDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<ffi::AnyBuffer>()                     // x [..., hidden]: f32 / bf16 / f16
        .Arg<ffi::AnyBuffer>()                     // weight [hidden] or [0]: f32 / bf16 / f16
        .Arg<ffi::Buffer<ffi::F32>>()              // rstd_in [rows] or [0]
        .Ret<ffi::AnyBuffer>()                     // y: x's shape and dtype
        .Ret<ffi::Buffer<ffi::F32>>()              // rstd [rows]
        .Attr<float>("eps")                        // eps: added to the mean square
        .Attr<bool>("zero_centered_weight"),       // w_eff = 1 + w
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AddRmsNormFwdCuda, AddRmsNormFwdCudaDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<ffi::AnyBuffer>()                     // x [..., hidden]: f32 / bf16 / f16
        .Arg<ffi::AnyBuffer>()                     // residual: x's shape and dtype
        .Arg<ffi::AnyBuffer>()                     // weight [hidden] or [0]: f32 / bf16 / f16
        .Ret<ffi::AnyBuffer>()                     // y: x's shape and dtype
        .Ret<ffi::AnyBuffer>()                     // h = x + residual: x's shape and dtype
        .Ret<ffi::Buffer<ffi::F32>>()              // rstd [rows]
        .Attr<float>("eps")                        // eps: added to the mean square
        .Attr<bool>("zero_centered_weight"),       // w_eff = 1 + w
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RmsNormBwdCuda, RmsNormBwdCudaDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<ffi::AnyBuffer>()                     // dy: x's shape and dtype
        .Arg<ffi::AnyBuffer>()                     // x [..., hidden]: f32 / bf16 / f16
        .Arg<ffi::AnyBuffer>()                     // weight [hidden] or [0]: f32 / bf16 / f16
        .Arg<ffi::Buffer<ffi::F32>>()              // rstd [rows]
        .Arg<ffi::Buffer<ffi::F32>>()              // dot_in [rows] or [0]
        .Arg<ffi::AnyBuffer>()                     // dh: x's shape and dtype, or [0]
        .Ret<ffi::AnyBuffer>()                     // dx: x's shape and dtype
        .Ret<ffi::Buffer<ffi::F32>>()              // dw [hidden] or [0]
        .Ret<ffi::AnyBuffer>()                     // dw_partial [parts, hidden or 0]: f32
        .Attr<bool>("zero_centered_weight"),       // w_eff = 1 + w
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxops::rms_norm
