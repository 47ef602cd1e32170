// The block-scaled FP8 grouped GEMM on CUTLASS's Hopper kernel (sm90a; CUTLASS example 68: TMA
// loads, warp-specialized FP8 GMMA with the persistent cooperative schedule, each 128-deep slice
// of K accumulated in fp32 and promoted through its scales). DeepSeek-V3's recipe: x in 1 x 128
// groups along K, the weights in 128 x 128 tiles.
//
// Target jaxops_grouped_gemm_fp8_cutlass (GroupedGemmFp8CutlassCuda), y[rows of g] =
// dequant(x)[rows of g] @ dequant(w[g])^T:
//   operands  x_data  float8_e4m3fn [R, K]       (K-major, as quantized)
//             x_scale float32 [R * KB]           KB = ceil(K / 128); group-packed, M-major: the
//                                                 scale of row r of group g (rows from start_g)
//                                                 and K block b is at
//                                                 start_g * KB + b * m_g + (r - start_g), m_g the
//                                                 group's clipped rows (CUTLASS reads each
//                                                 group's scales as one packed M-major matrix)
//             w_data  float8_e4m3fn [G, N, K]    (K-major: Hopper's FP8 GMMA takes no other)
//             w_scale float32 [G, KB, NB]        NB = ceil(N / 128); tile (n, k) of group g at
//                                                 [g, k, n] (N-major, as CUTLASS reads it)
//             group_sizes int32 [G]              device data, clipped as every grouped kernel
//                                                 clips them (grouped_gemm.h)
//   results   y float32 [R, N]; rows past the groups zero (zero_tail) or unwritten
//             workspace uint8 [CutlassFp8WorkspaceBytes(G)]
//   attrs     zero_tail (bool)
// The Python wrapper (jaxops._grouped_gemm.grouped_gemm_fp8) builds both scale layouts from
// fp8.quantize's and calls this target only where it runs: K and N multiples of 16 (TMA rows of
// whole 16 bytes for x, w and y), at least one row, one group and one column, int32 shapes.
//
// One call, on the XLA stream, never synchronizing with the host: the setup kernel
// (setup_kernels.cuh) turns the sizes into each group's rows and its five pointers (x, w, y and
// the two scale arrays); ProblemsKernel writes CUTLASS's shapes, strides and scale layouts; one
// CUTLASS grouped GEMM runs every group (a group without rows gets M = 0: no tiles); the rows past
// the groups are then zeroed. The workspace is an XLA-allocated result (command buffers keep
// valid pointers).
#include "xla_ffi/common/cuda_util.cuh"

// clang-format off
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/detail/blockwise_scale_layout.hpp"
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
#include "xla_ffi/grouped_gemm/cutlass_util.cuh"
#include "xla_ffi/grouped_gemm/handlers.h"
#include "xla_ffi/grouped_gemm/setup_kernels.cuh"

namespace jaxops::grouped_gemm {
namespace {

using cute::_1;
using cute::_128;

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Shape3 = ProblemShape::UnderlyingProblemShape;
using Fp8 = cutlass::float_e4m3_t;
constexpr int kBlock = 128;    // the scale blocks' width along K (and N for w)
constexpr int kAlignFp8 = 16;  // e4m3s in 16 bytes
constexpr int kAlignD = 4;     // floats in 16 bytes
// Example 68's tile; clusters of one CTA as the bfloat16 kernels' (no TMA multicast: a group's
// last N tile never waits on a partner; 1 x 2 is a tuning to measure).
using Tile = cute::Shape<_128, _128, _128>;
using Cluster = cute::Shape<_1, _1, _1>;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

// Scales: x per row and 128 columns of K, w per 128 x 128 tile; both M/N-major.
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kBlock, kBlock>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

// D = accumulator (alpha 1, no C), fp32, row-major, stored by TMA.
using Epilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor*, kAlignD, float,
    RowMajor*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

// A = x's rows of the group (RowMajor: K-major), B = w[g] ([N, K] rows: ColumnMajor K x N).
using Mainloop = cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8, cute::tuple<RowMajor*, LayoutSFA*>,
    kAlignFp8, Fp8, cute::tuple<ColumnMajor*, LayoutSFB*>, kAlignFp8, float, Tile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using StrideA = Kernel::InternalStrideA;
using StrideB = Kernel::InternalStrideB;
using StrideD = Kernel::InternalStrideD;

Gemm::Arguments MakeArguments(int groups, Shape3* shapes, const void** a, StrideA* sa,
                              const void** b, StrideB* sb, const void** sfa, LayoutSFA* lsfa,
                              const void** sfb, LayoutSFB* lsfb, void** d, StrideD* sd, int device,
                              int sms) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sms;
  Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, shapes, nullptr},  // no host copy of the shapes: they are on the device
      {reinterpret_cast<const Fp8**>(a), sa, reinterpret_cast<const Fp8**>(b), sb,
       reinterpret_cast<const float**>(sfa), lsfa, reinterpret_cast<const float**>(sfb), lsfb},
      {{}, nullptr, nullptr, reinterpret_cast<float**>(d), sd},
      hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

int64_t OwnBytes(int groups, int sms) {
  return static_cast<int64_t>(Gemm::get_workspace_size(
      MakeArguments(groups, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                    nullptr, nullptr, nullptr, 0, sms)));
}

// Byte offsets of the arrays of `groups` groups in the workspace.
struct Layout {
  int64_t a_ptrs, b_ptrs, d_ptrs, sfa_ptrs, sfb_ptrs;  // const void* [G]
  int64_t m, n, k;                                     // int32 [G] (the setup's)
  int64_t shapes;                                      // Shape3 [G]
  int64_t sa, sb, sd;                                  // strides [G]
  int64_t lsfa, lsfb;                                  // scale layouts [G]
  int64_t scalars;  // alpha, beta (the setup's, unused), rows in groups (int64)
  int64_t own;      // CUTLASS's workspace
  int64_t bytes;    // the whole

  Layout(int64_t groups, int64_t own_bytes) {
    const auto each = [groups](size_t bytes) { return groups * static_cast<int64_t>(bytes); };
    Carve c;
    a_ptrs = c.Take(each(8));
    b_ptrs = c.Take(each(8));
    d_ptrs = c.Take(each(8));
    sfa_ptrs = c.Take(each(8));
    sfb_ptrs = c.Take(each(8));
    m = c.Take(each(4));
    n = c.Take(each(4));
    k = c.Take(each(4));
    shapes = c.Take(each(sizeof(Shape3)));
    sa = c.Take(each(sizeof(StrideA)));
    sb = c.Take(each(sizeof(StrideB)));
    sd = c.Take(each(sizeof(StrideD)));
    lsfa = c.Take(each(sizeof(LayoutSFA)));
    lsfb = c.Take(each(sizeof(LayoutSFB)));
    scalars = c.Take(kRegionAlign);
    own = c.Take(own_bytes);
    bytes = c.end;
  }
};

// CUTLASS's problem (M, N, K), strides and scale layouts of every group (M = 0: no rows).
__global__ void __launch_bounds__(kFillThreads)
    ProblemsKernel(const int32_t* m, int64_t groups, int32_t n, int32_t k, Shape3* shapes,
                   StrideA* sa, StrideA va, StrideB* sb, StrideB vb, StrideD* sd, StrideD vd,
                   LayoutSFA* lsfa, LayoutSFB* lsfb) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kFillThreads;
  for (int64_t g = blockIdx.x * int64_t{kFillThreads} + threadIdx.x; g < groups; g += step) {
    const int rows = m[g];
    shapes[g] = cute::make_shape(rows, int{n}, int{k});
    sa[g] = va;
    sb[g] = vb;
    sd[g] = vd;
    lsfa[g] = ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(rows, int{n}, int{k}, 1));
    lsfb[g] = ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(rows, int{n}, int{k}, 1));
  }
}

// The call's problem, or the error naming what is wrong (the contract above).
ffi::ErrorOr<Problem> Check(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& xs,
                            const ffi::AnyBuffer& w, const ffi::Buffer<ffi::F32>& ws,
                            const ffi::Buffer<ffi::S32>& sizes, const ffi::Buffer<ffi::F32>& y) {
  constexpr const char* kOp = "grouped_gemm_fp8";
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 ||
      x.element_type() != ffi::DataType::F8E4M3FN || w.element_type() != ffi::DataType::F8E4M3FN) {
    return Bad(std::string(kOp) + ": x_data must be float8_e4m3fn [R, K], w_data float8_e4m3fn " +
               "[G, N, K] and y float32 [R, N]; got x_data " + ShapeString(x) + ", w_data " +
               ShapeString(w) + ", y " + ShapeString(y));
  }
  Problem p;
  p.rows = xd[0];
  p.k = xd[1];
  p.groups = wd[0];
  p.n = wd[1];
  const int64_t kb = CeilDiv(p.k, int64_t{kBlock});
  const int64_t nb = CeilDiv(p.n, int64_t{kBlock});
  const auto xsd = xs.dimensions();
  const auto wsd = ws.dimensions();
  if (wd[2] != p.k || yd[0] != p.rows || yd[1] != p.n || xsd.size() != 1 || xsd[0] != p.rows * kb ||
      wsd.size() != 3 || wsd[0] != p.groups || wsd[1] != kb || wsd[2] != nb) {
    return Bad(std::string(kOp) + ": with x_data [" + std::to_string(p.rows) + ", " +
               std::to_string(p.k) + "] and " + std::to_string(p.groups) +
               " groups, w_data must be [G, N, K], x_scale float32 [R * KB], w_scale float32 "
               "[G, KB, NB] and y [R, N] (KB, NB: K and N in blocks of 128); got w_data " +
               ShapeString(w) + ", x_scale " + ShapeString(xs) + ", w_scale " + ShapeString(ws) +
               ", y " + ShapeString(y));
  }
  if (auto e = CheckGroups(kOp, sizes, p.groups); e.failure()) return ffi::Unexpected(e);
  const int64_t int32_max = 0x7fffffff;
  if (p.rows <= 0 || p.k <= 0 || p.n <= 0 || p.groups <= 0 || p.rows > int32_max ||
      p.k > int32_max || p.n > int32_max || p.groups > int32_max || p.k % kAlignFp8 != 0 ||
      p.n % kAlignFp8 != 0) {
    return Bad(std::string(kOp) + " (CUTLASS): needs R, K, N and G of 1 to 2^31 - 1 with K and " +
               "N multiples of 16; got R " + std::to_string(p.rows) + ", K " + std::to_string(p.k) +
               ", N " + std::to_string(p.n) + ", G " + std::to_string(p.groups));
  }
  return p;
}

ffi::Error Dispatch(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                    ffi::Buffer<ffi::F32> x_scale, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> w_scale,
                    ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::Buffer<ffi::F32>> y,
                    ffi::Result<ffi::AnyBuffer> workspace, bool zero_tail) {
  constexpr const char* kOp = "grouped_gemm_fp8";
  const std::string name = std::string(kOp) + " (CUTLASS)";
  auto problem = Check(x, x_scale, w, w_scale, sizes, *y);
  if (problem.has_error()) return problem.error();
  const Problem& p = *problem;
  if (!IsAligned(x.untyped_data(), 16) || !IsAligned(w.untyped_data(), 16) ||
      !IsAligned(y->untyped_data(), 16)) {
    return InvalidArgument(name + ": x_data, w_data and y must start 16-byte aligned");
  }
  auto sms = CutlassSms(kOp, device, "call it with impl=\"xla\"");
  if (sms.has_error()) return sms.error();
  const Layout l(p.groups, OwnBytes(static_cast<int>(p.groups), *sms));
  auto based = CutlassWorkspace(kOp, *workspace, l.bytes, p.groups);
  if (based.has_error()) return based.error();
  char* base = *based;

  const int64_t kb = CeilDiv(p.k, int64_t{kBlock});
  const int64_t nb = CeilDiv(p.n, int64_t{kBlock});
  SetupParams s;
  s.sizes = sizes.typed_data();
  s.groups = p.groups;
  s.rows = p.rows;
  s.n = static_cast<int32_t>(p.n);
  s.k = static_cast<int32_t>(p.k);
  s.a = {static_cast<const char*>(x.untyped_data()), p.k, true};
  s.b = {static_cast<const char*>(w.untyped_data()), p.n * p.k, false};
  s.d = {reinterpret_cast<const char*>(y->typed_data()), p.n * int64_t{4}, true};
  s.sfa = {reinterpret_cast<const char*>(x_scale.typed_data()), kb * int64_t{4}, true};
  s.sfb = {reinterpret_cast<const char*>(w_scale.typed_data()), kb * nb * int64_t{4}, false};
  PointSetup(s, base, l);
  s.sfa_ptrs = reinterpret_cast<const void**>(base + l.sfa_ptrs);
  s.sfb_ptrs = reinterpret_cast<const void**>(base + l.sfb_ptrs);
  GroupedSetupKernel<<<1, kSetupThreads, 0, stream>>>(s);
  if (auto e = LastLaunchError((name + " setup kernel").c_str()); e.failure()) return e;

  const int n = static_cast<int>(p.n);
  const int k = static_cast<int>(p.k);
  auto* shapes = reinterpret_cast<Shape3*>(base + l.shapes);
  auto* sa = reinterpret_cast<StrideA*>(base + l.sa);
  auto* sb = reinterpret_cast<StrideB*>(base + l.sb);
  auto* sd = reinterpret_cast<StrideD*>(base + l.sd);
  auto* lsfa = reinterpret_cast<LayoutSFA*>(base + l.lsfa);
  auto* lsfb = reinterpret_cast<LayoutSFB*>(base + l.lsfb);
  // The strides do not depend on the group's rows (1 here).
  ProblemsKernel<<<GridCtas(p.groups, kFillThreads, 1024), kFillThreads, 0, stream>>>(
      s.m, p.groups, s.n, s.k, shapes, sa, cutlass::make_cute_packed_stride(StrideA{}, {1, k, 1}),
      sb, cutlass::make_cute_packed_stride(StrideB{}, {n, k, 1}), sd,
      cutlass::make_cute_packed_stride(StrideD{}, {1, n, 1}), lsfa, lsfb);
  if (auto e = LastLaunchError((name + " problem kernel").c_str()); e.failure()) return e;

  auto args =
      MakeArguments(static_cast<int>(p.groups), shapes, s.a_ptrs, sa, s.b_ptrs, sb, s.sfa_ptrs,
                    lsfa, s.sfb_ptrs, lsfb, const_cast<void**>(s.d_ptrs), sd, device, *sms);
  Gemm gemm;
  if (auto e = CutlassError(gemm.can_implement(args), name + ": can_implement"); e.failure()) {
    return e;
  }
  if (auto e = CutlassError(gemm.initialize(args, base + l.own, stream), name + ": initialize");
      e.failure()) {
    return e;
  }
  if (auto e = CutlassError(gemm.run(stream), name + ": run"); e.failure()) return e;
  if (auto e = LastLaunchError(name.c_str()); e.failure()) return e;
  if (!zero_tail) return ffi::Error::Success();
  return ZeroTail(stream, y->typed_data(), s.total, p.rows, p.n,
                  "grouped_gemm_fp8 (CUTLASS) tail zeroing kernel");
}

}  // namespace

int64_t CutlassFp8WorkspaceBytes(int64_t groups) {
  const int g = static_cast<int>(std::clamp<int64_t>(groups, 1, 0x7fffffff));
  return Layout(groups, OwnBytes(g, kMaxSms)).bytes;
}

}  // namespace jaxops::grouped_gemm

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    GroupedGemmFp8CutlassCuda, jaxops::grouped_gemm::Dispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA stream
        .Ctx<ffi::DeviceOrdinal>()                 // device: its SM count and architecture
        .Arg<ffi::AnyBuffer>()                     // x_data e4m3 [R, K]
        .Arg<ffi::Buffer<ffi::F32>>()              // x_scale [R * KB], group-packed
        .Arg<ffi::AnyBuffer>()                     // w_data e4m3 [G, N, K]
        .Arg<ffi::Buffer<ffi::F32>>()              // w_scale [G, KB, NB]
        .Arg<ffi::Buffer<ffi::S32>>()              // group_sizes [G]
        .Ret<ffi::Buffer<ffi::F32>>()              // y [R, N]
        .Ret<ffi::AnyBuffer>()                     // workspace u8 [W]
        .Attr<bool>("zero_tail"),                  // zeros past the groups' rows
    {ffi::Traits::kCmdBufferCompatible});
