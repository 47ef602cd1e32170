// CUDA handlers of the grouped GEMM family on CUTLASS's Hopper grouped GEMM (sm90a: TMA loads,
// warp-specialized GMMA, the persistent cooperative schedule; CUTLASS's grouped kernel with the
// problem shapes and matrix pointers in device arrays, so the group sizes never leave the device).
// The targets jaxops_grouped_gemm_cutlass and jaxops_grouped_gemm_wgrad_cutlass: the contracts of
// jaxops_grouped_gemm and jaxops_grouped_gemm_wgrad (checks.h) plus a uint8 workspace result
// (CutlassWorkspaceBytes). Built only for sm_90a, and only where CUTLASS's headers were found (the
// nvidia-cutlass wheel, a build requirement of the CUDA module; JAXOPS_HAVE_CUTLASS).
//
// One call, on the XLA stream, never synchronizing with the host:
//   1. GroupedSetupKernel (one CTA, setup_kernels.cuh) turns the group sizes into each group's
//      rows (clipped as jaxops' kernels clip them) and matrix pointers in the workspace.
//   2. ProblemsKernel writes CUTLASS's per-group problem shapes (M, N, K) and strides (the same
//      for every group: the leading dimensions are the call's K and N).
//   3. One CUTLASS grouped GEMM over every group, fp32 accumulation, fp32 output (alpha 1, no C).
//      The forward y_g = x_g @ w[g] has M = the group's rows, N, K; w[g] is [K, N] (N-major B) or,
//      transposed, [N, K] (K-major B). The weight gradient dw[g] = x_g^T dy_g has M = K, N, and
//      the group's rows as its reduction: A = x_g read as K x m_g (M-major), B = dy_g (N-major).
//      A group without rows gets M = 0 in both: CUTLASS's scheduler gives it no tiles.
//   4. The forward with zero_tail zeros the rows past the groups (ZeroTailKernel); the weight
//      gradient zeros the groups without rows (ZeroEmptyGroupsKernel).
//
// What is instantiated (each instance is about a minute of nvcc): bfloat16 operands, the three
// layouts above, one tile (128 x 128 x 64, cluster 1 x 1). CUTLASS's TMA needs 16-byte-aligned
// matrices and rows of whole 16-byte multiples: a call that is not bfloat16, not so aligned, too
// large for int32 shapes, or empty runs jaxops' own kernels instead (cuda_kernels.h), as the
// cuBLASLt handlers do. The kernel needs an sm_90 device; on another the call is an error that
// says so.
//
// Command buffers: the workspace is an XLA-allocated result, so a captured graph keeps valid
// pointers; CUTLASS's initialize only fills its parameters and the workspace on the stream.
#include "xla_ffi/common/cuda_util.cuh"

// clang-format off
#include "cutlass/cutlass.h"
#include "cutlass/version.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
// clang-format on

#include <algorithm>
#include <cstdint>
#include <string>

#include "xla_ffi/common/cuda_vec.cuh"
#include "xla_ffi/grouped_gemm/checks.h"
#include "xla_ffi/grouped_gemm/cuda_kernels.h"
#include "xla_ffi/grouped_gemm/cutlass_util.cuh"
#include "xla_ffi/grouped_gemm/handlers.h"
#include "xla_ffi/grouped_gemm/setup_kernels.cuh"

namespace jaxops::grouped_gemm {
namespace {

using cute::_1;
using cute::_128;
using cute::_64;

using Element = cutlass::bfloat16_t;
constexpr int kAlign = 8;  // bfloat16s in 16 bytes
using Tile = cute::Shape<_128, _128, _64>;
using Cluster = cute::Shape<_1, _1, _1>;

// The epilogue: D = accumulator (alpha 1, no C), fp32, row-major, stored by TMA.
using Epilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor*, kAlignD, float,
    RowMajor*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

// Shared memory the epilogue takes from the mainloop's stages.
constexpr int kEpilogueSmem = static_cast<int>(sizeof(Epilogue::SharedStorage));

// The grouped GEMM of bfloat16 A (layout LayoutA, M x K) and B (LayoutB, K x N), as CUTLASS names
// layouts: RowMajor A is K-major; RowMajor B is N-major, ColumnMajor B K-major. A macro, not a
// template: the host compiler's pass over nvcc's output fails on CUTLASS's builders instantiated
// inside a class template (seen with gcc 12), and takes them at namespace or class scope.
#define JAXOPS_CUTLASS_GROUPED(Name, LayoutA, LayoutB)                                           \
  struct Name {                                                                                  \
    using Mainloop = cutlass::gemm::collective::CollectiveBuilder<                               \
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element, \
        LayoutB*, kAlign, float, Tile, Cluster,                                                  \
        cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmem>,                        \
        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;               \
    using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;       \
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;                            \
    using StrideA = Kernel::InternalStrideA;                                                     \
    using StrideB = Kernel::InternalStrideB;                                                     \
    using StrideD = Kernel::InternalStrideD;                                                     \
  }

JAXOPS_CUTLASS_GROUPED(Forward, RowMajor, RowMajor);               // x_g @ w[g], w [G, K, N]
JAXOPS_CUTLASS_GROUPED(ForwardTransposed, RowMajor, ColumnMajor);  // x_g @ w[g]^T, w [G, N, K]
JAXOPS_CUTLASS_GROUPED(Wgrad, ColumnMajor, RowMajor);              // x_g^T @ dy_g
#undef JAXOPS_CUTLASS_GROUPED

template <typename G>
typename G::Gemm::Arguments MakeArguments(int groups, Shape3* shapes, const void** a,
                                          typename G::StrideA* sa, const void** b,
                                          typename G::StrideB* sb, void** d,
                                          typename G::StrideD* sd, int device, int sms) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sms;
  typename G::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, shapes, nullptr},  // no host copy of the shapes: they are on the device
      {reinterpret_cast<const Element**>(a), sa, reinterpret_cast<const Element**>(b), sb},
      {{}, nullptr, nullptr, reinterpret_cast<float**>(d), sd},
      hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

// CUTLASS's own workspace for `groups` groups on `sms` SMs, the largest of the three kernels'.
int64_t OwnBytes(int groups, int sms) {
  size_t bytes = 0;
  bytes = std::max(
      bytes, Forward::Gemm::get_workspace_size(MakeArguments<Forward>(
                 groups, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, sms)));
  bytes = std::max(
      bytes, ForwardTransposed::Gemm::get_workspace_size(MakeArguments<ForwardTransposed>(
                 groups, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, sms)));
  bytes = std::max(
      bytes, Wgrad::Gemm::get_workspace_size(MakeArguments<Wgrad>(
                 groups, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, sms)));
  return static_cast<int64_t>(bytes);
}

// The strides of a group's matrices, the largest of the three kernels' stride types.
constexpr size_t kStrideBytes =
    std::max({sizeof(Forward::StrideA), sizeof(Forward::StrideB), sizeof(Forward::StrideD),
              sizeof(ForwardTransposed::StrideB), sizeof(Wgrad::StrideA), sizeof(Wgrad::StrideB),
              sizeof(Wgrad::StrideD)});

// Byte offsets of the arrays of `groups` groups in the workspace.
struct Layout {
  int64_t a_ptrs, b_ptrs, d_ptrs;  // const void* [G]: each group's A, B and D
  int64_t m, n, k;                 // int32 [G]: the group's rows (n and k: unused, the setup's)
  int64_t shapes;                  // Shape3 [G]: CUTLASS's (M, N, K) of each group
  int64_t sa, sb, sd;              // the strides [G] of A, B and D
  int64_t scalars;                 // alpha, beta (the setup's, unused), rows in groups (int64)
  int64_t own;                     // CUTLASS's workspace
  int64_t bytes;                   // the whole

  Layout(int64_t groups, int64_t own_bytes) {
    const int64_t strides = groups * static_cast<int64_t>(kStrideBytes);
    Carve c;
    a_ptrs = c.Take(groups * 8);
    b_ptrs = c.Take(groups * 8);
    d_ptrs = c.Take(groups * 8);
    m = c.Take(groups * 4);
    n = c.Take(groups * 4);
    k = c.Take(groups * 4);
    shapes = c.Take(groups * static_cast<int64_t>(sizeof(Shape3)));
    sa = c.Take(strides);
    sb = c.Take(strides);
    sd = c.Take(strides);
    scalars = c.Take(kRegionAlign);
    own = c.Take(own_bytes);
    bytes = c.end;
  }
};

// CUTLASS's problem (M, N, K) and the strides of every group; a group without rows gets M = 0.
template <typename SA, typename SB, typename SD>
__global__ void __launch_bounds__(kFillThreads)
    ProblemsKernel(const int32_t* m, int64_t groups, int32_t n, int32_t k, bool wgrad,
                   Shape3* shapes, SA* sa, SA va, SB* sb, SB vb, SD* sd, SD vd) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kFillThreads;
  for (int64_t g = blockIdx.x * int64_t{kFillThreads} + threadIdx.x; g < groups; g += step) {
    const int rows = m[g];
    shapes[g] = wgrad ? cute::make_shape(rows == 0 ? 0 : int{k}, int{n}, rows)
                      : cute::make_shape(rows, int{n}, int{k});
    sa[g] = va;
    sb[g] = vb;
    sd[g] = vd;
  }
}

// Whether CUTLASS takes the call: bfloat16, 16-byte-aligned starts and rows of whole 16-byte
// multiples (x's K and N elements, y's or dw's N floats), int32 shapes, something to compute.
bool Eligible(const Problem& p, ffi::DataType dtype, const void* x, const void* other,
              const void* out) {
  const int64_t int32_max = 0x7fffffff;
  return dtype == ffi::DataType::BF16 && p.rows > 0 && p.k > 0 && p.n > 0 && p.groups > 0 &&
         p.rows <= int32_max && p.k <= int32_max && p.n <= int32_max && p.groups <= int32_max &&
         p.k % kAlign == 0 && p.n % kAlign == 0 && IsAligned(x, 16) && IsAligned(other, 16) &&
         IsAligned(out, 16);
}

// The workspace's arrays for `p` on `device` (checked), and the setup of their per-group entries.
struct Prepared {
  SetupParams setup;
  Layout layout{0, 0};
  char* base = nullptr;
  int sms = 0;
};

ffi::ErrorOr<Prepared> Prepare(const char* op, const Problem& p, int32_t device,
                               ffi::Result<ffi::AnyBuffer>& workspace,
                               const ffi::Buffer<ffi::S32>& sizes) {
  Prepared out;
  auto sms = CutlassSms(op, device, "unset JAXOPS_GPU_GROUPED_GEMM");
  if (sms.has_error()) return ffi::Unexpected(sms.error());
  out.sms = *sms;
  out.layout = Layout(p.groups, OwnBytes(static_cast<int>(p.groups), out.sms));
  auto base = CutlassWorkspace(op, *workspace, out.layout.bytes, p.groups);
  if (base.has_error()) return ffi::Unexpected(base.error());
  out.base = *base;
  const Layout& l = out.layout;
  SetupParams& s = out.setup;
  s.sizes = sizes.typed_data();
  s.groups = p.groups;
  s.rows = p.rows;
  s.n = static_cast<int32_t>(p.n);
  s.k = static_cast<int32_t>(p.k);
  PointSetup(s, out.base, l);
  return out;
}

// Steps 1-3 for the kernel G, whose A, B and D strides are va, vb and vd in every group.
template <typename G>
ffi::Error Run(const char* op, const Prepared& pr, const Problem& p, bool wgrad,
               typename G::StrideA va, typename G::StrideB vb, typename G::StrideD vd,
               int32_t device, cudaStream_t stream) {
  const std::string name = std::string(op) + " (CUTLASS)";
  GroupedSetupKernel<<<1, kSetupThreads, 0, stream>>>(pr.setup);
  if (auto e = LastLaunchError((name + " setup kernel").c_str()); e.failure()) return e;
  const Layout& l = pr.layout;
  auto* shapes = reinterpret_cast<Shape3*>(pr.base + l.shapes);
  auto* sa = reinterpret_cast<typename G::StrideA*>(pr.base + l.sa);
  auto* sb = reinterpret_cast<typename G::StrideB*>(pr.base + l.sb);
  auto* sd = reinterpret_cast<typename G::StrideD*>(pr.base + l.sd);
  ProblemsKernel<<<GridCtas(p.groups, kFillThreads, 1024), kFillThreads, 0, stream>>>(
      pr.setup.m, p.groups, static_cast<int32_t>(p.n), static_cast<int32_t>(p.k), wgrad, shapes, sa,
      va, sb, vb, sd, vd);
  if (auto e = LastLaunchError((name + " problem kernel").c_str()); e.failure()) return e;
  auto args =
      MakeArguments<G>(static_cast<int>(p.groups), shapes, pr.setup.a_ptrs, sa, pr.setup.b_ptrs, sb,
                       const_cast<void**>(pr.setup.d_ptrs), sd, device, pr.sms);
  typename G::Gemm gemm;
  if (auto e = CutlassError(gemm.can_implement(args), name + ": can_implement"); e.failure()) {
    return e;
  }
  void* own = pr.base + l.own;
  if (auto e = CutlassError(gemm.initialize(args, own, stream), name + ": initialize");
      e.failure()) {
    return e;
  }
  if (auto e = CutlassError(gemm.run(stream), name + ": run"); e.failure()) return e;
  return LastLaunchError(name.c_str());
}

ffi::Error ForwardDispatch(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                           ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::Buffer<ffi::F32>> y,
                           ffi::Result<ffi::AnyBuffer> workspace, bool transpose_w,
                           bool zero_tail) {
  constexpr const char* kOp = "grouped_gemm";
  auto problem = CheckForward(x, w, sizes, *y, transpose_w);
  if (problem.has_error()) return problem.error();
  const Problem& p = *problem;
  if (!Eligible(p, x.element_type(), x.untyped_data(), w.untyped_data(), y->untyped_data())) {
    return KernelForward(stream, p, x, w, sizes, y->typed_data(), transpose_w, zero_tail);
  }
  auto prepared = Prepare(kOp, p, device, workspace, sizes);
  if (prepared.has_error()) return prepared.error();
  SetupParams& s = prepared->setup;
  const int64_t elem = 2;
  s.a = {static_cast<const char*>(x.untyped_data()), p.k * elem, true};
  s.b = {static_cast<const char*>(w.untyped_data()), p.k * p.n * elem, false};
  s.d = {reinterpret_cast<const char*>(y->typed_data()), p.n * int64_t{4}, true};
  const int m = 1;  // the strides do not depend on the rows
  const int n = static_cast<int>(p.n);
  const int k = static_cast<int>(p.k);
  ffi::Error error = ffi::Error::Success();
  if (transpose_w) {
    using G = ForwardTransposed;
    error =
        Run<G>(kOp, *prepared, p, false,
               cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, k, 1}),
               cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k, 1}),
               cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, n, 1}), device, stream);
  } else {
    using G = Forward;
    error =
        Run<G>(kOp, *prepared, p, false,
               cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, k, 1}),
               cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k, 1}),
               cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, n, 1}), device, stream);
  }
  if (error.failure() || !zero_tail) return error;
  return ZeroTail(stream, y->typed_data(), s.total, p.rows, p.n,
                  "grouped_gemm (CUTLASS) tail zeroing kernel");
}

ffi::Error WgradDispatch(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                         ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::Buffer<ffi::F32>> dw,
                         ffi::Result<ffi::AnyBuffer> workspace) {
  constexpr const char* kOp = "grouped_gemm_wgrad";
  auto problem = CheckWgrad(x, dy, sizes, *dw);
  if (problem.has_error()) return problem.error();
  const Problem& p = *problem;
  if (!Eligible(p, x.element_type(), x.untyped_data(), dy.untyped_data(), dw->untyped_data())) {
    return KernelWgrad(stream, p, x, dy, sizes, dw->typed_data());
  }
  auto chunks = EmptyGroupChunks(kOp, p.groups, p.k, p.n);
  if (chunks.has_error()) return chunks.error();
  auto prepared = Prepare(kOp, p, device, workspace, sizes);
  if (prepared.has_error()) return prepared.error();
  SetupParams& s = prepared->setup;
  const int64_t elem = 2;
  // A = x_g (K x m_g, M-major: x's rows of the group), B = dy_g (m_g x N), D = dw[g] (K x N).
  s.a = {static_cast<const char*>(x.untyped_data()), p.k * elem, true};
  s.b = {static_cast<const char*>(dy.untyped_data()), p.n * elem, true};
  s.d = {reinterpret_cast<const char*>(dw->typed_data()), p.k * p.n * int64_t{4}, false};
  const int m = static_cast<int>(p.k);
  const int n = static_cast<int>(p.n);
  const int k = 1;  // the group's rows: the strides do not depend on them
  using G = Wgrad;
  if (auto e = Run<G>(kOp, *prepared, p, true,
                      cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, k, 1}),
                      cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k, 1}),
                      cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, n, 1}), device,
                      stream);
      e.failure()) {
    return e;
  }
  return ZeroEmptyGroups(stream, dw->typed_data(), s.m, p.groups, p.k, p.n, *chunks,
                         "grouped_gemm_wgrad (CUTLASS) empty-group zeroing kernel");
}

}  // namespace

int64_t CutlassWorkspaceBytes(int64_t groups) {
  const int g = static_cast<int>(std::clamp<int64_t>(groups, 1, 0x7fffffff));
  return Layout(groups, OwnBytes(g, kMaxSms)).bytes;
}

std::string CutlassVersion() {
  return std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." +
         std::to_string(CUTLASS_PATCH);
}

}  // namespace jaxops::grouped_gemm

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    GroupedGemmCutlassCuda, jaxops::grouped_gemm::ForwardDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA stream
        .Ctx<ffi::DeviceOrdinal>()                 // device: its SM count and architecture
        .Arg<ffi::AnyBuffer>()                     // x [R, K]
        .Arg<ffi::AnyBuffer>()                     // w [G, K, N] | [G, N, K]
        .Arg<ffi::Buffer<ffi::S32>>()              // group_sizes [G]
        .Ret<ffi::Buffer<ffi::F32>>()              // y [R, N]
        .Ret<ffi::AnyBuffer>()                     // workspace u8 [W]
        .Attr<bool>("transpose_w")                 // w is [G, N, K]
        .Attr<bool>("zero_tail"),                  // zeros past the groups' rows
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    GroupedGemmWgradCutlassCuda, jaxops::grouped_gemm::WgradDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA stream
        .Ctx<ffi::DeviceOrdinal>()                 // device: its SM count and architecture
        .Arg<ffi::AnyBuffer>()                     // x [R, K]
        .Arg<ffi::AnyBuffer>()                     // dy [R, N]
        .Arg<ffi::Buffer<ffi::S32>>()              // group_sizes [G]
        .Ret<ffi::Buffer<ffi::F32>>()              // dw [G, K, N]
        .Ret<ffi::AnyBuffer>(),                    // workspace u8 [W]
    {ffi::Traits::kCmdBufferCompatible});
