// The block-scaled FP8 grouped GEMMs on CUTLASS's Hopper kernel (sm90a; CUTLASS example 68: TMA
// loads, warp-specialized FP8 GMMA with the persistent cooperative schedule, each 128-deep slice
// of the reduction accumulated in fp32 and promoted through its scales). DeepSeek-V3's recipe:
// tokens (and gradients) in 1 x 128 groups along the reduction, the weights in 128 x 128 tiles,
// and for the weight gradient both operands transposed per expert in 128-token groups.
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
//
// Target jaxops_grouped_gemm_fp8_wgrad_cutlass (GroupedGemmFp8WgradCutlassCuda), dw[g] =
// dequant(x_g)^T dequant(dy_g) from the per-expert split transposes of
// jaxops.fp8.quantize_split_transpose (x [M, K] and dy [M, N] split by the same sizes):
//   operands  xs_data  float8_e4m3fn [K, C]      expert g = columns col_offsets[g] .. + sizes[g]
//                                                 (starts at multiples of 16; C a multiple of 16)
//             xs_scale float32 [S, K]            the split's [K, S] transposed: expert g's
//                                                 128-token block b of row k at
//                                                 [scale_offsets[g] + b, k] (M-major, packed)
//             dys_data float8_e4m3fn [N, C], dys_scale float32 [S, N]: the same for dy
//             col_offsets, scale_offsets int32 [G + 1], sizes int32 [G] (the split's, clamped)
//   results   dw float32 [G, K, N]; experts without rows get zeros
//             workspace uint8 [CutlassFp8WorkspaceBytes(G)]
//
// The Python wrappers (jaxops._grouped_gemm.grouped_gemm_fp8, grouped_gemm_fp8_wgrad) build the
// scale layouts and call these targets only where they run: K and N multiples of 16 (TMA rows
// of whole 16 bytes), something to compute, int32 shapes.
//
// One call, on the XLA stream, never synchronizing with the host: a setup kernel turns the sizes
// into each group's problem (M, N, K; a group without rows gets M = 0: no tiles), its five
// pointers (A, B, D and the two scale arrays), strides and scale layouts in the workspace; one
// CUTLASS grouped GEMM runs every group; then the forward's rows past the groups, or the weight
// gradient's groups without rows, are zeroed. The workspace is an XLA-allocated result (command
// buffers keep valid pointers).
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

using Fp8 = cutlass::float_e4m3_t;
constexpr int kBlock = 128;    // the scale blocks' width along K (and N for w)
constexpr int kAlignFp8 = 16;  // e4m3s in 16 bytes
// Example 68's tile; clusters of one CTA as the bfloat16 kernels' (no TMA multicast: a group's
// last N tile never waits on a partner; 1 x 2 is a tuning to measure).
using Tile = cute::Shape<_128, _128, _128>;
using Cluster = cute::Shape<_1, _1, _1>;

// D = accumulator (alpha 1, no C), fp32, row-major, stored by TMA.
using Epilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor*, kAlignD, float,
    RowMajor*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

// The grouped GEMM of e4m3 A (RowMajor: K-major) and B (ColumnMajor K x N: K-major), A's scales
// per row and 128 of the reduction, B's per `GranularityN` rows (of N) and 128, both M/N-major. A
// macro, not a template: the host compiler takes CUTLASS's builders at namespace or class scope
// only (cutlass_sm90.cu).
#define JAXOPS_CUTLASS_FP8_GROUPED(Name, GranularityN)                                             \
  struct Name {                                                                                    \
    using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, GranularityN, kBlock>;        \
    using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());                                   \
    using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());                                   \
    using Mainloop = cutlass::gemm::collective::CollectiveBuilder<                                 \
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8,                                  \
        cute::tuple<RowMajor*, LayoutSFA*>, kAlignFp8, Fp8, cute::tuple<ColumnMajor*, LayoutSFB*>, \
        kAlignFp8, float, Tile, Cluster,                                                           \
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(                        \
            sizeof(Epilogue::SharedStorage))>,                                                     \
        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;     \
    using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;         \
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;                              \
    using StrideA = Kernel::InternalStrideA;                                                       \
    using StrideB = Kernel::InternalStrideB;                                                       \
    using StrideD = Kernel::InternalStrideD;                                                       \
  }

// The forward: A = x's rows of the group, B = w[g] as [N, K] rows, w in 128 x 128 tiles.
JAXOPS_CUTLASS_FP8_GROUPED(Forward, kBlock);
// The weight gradient: A = x's split transpose of the group (K x m_g), B = dy's (N x m_g); both
// in 128-token groups per row.
JAXOPS_CUTLASS_FP8_GROUPED(Wgrad, 1);
#undef JAXOPS_CUTLASS_FP8_GROUPED

// The largest of the two kernels' per-group entry of each array.
template <typename T, typename U>
constexpr int64_t Larger() {
  return static_cast<int64_t>(std::max(sizeof(T), sizeof(U)));
}

// Byte offsets of the arrays of `groups` groups in the workspace (either kernel's).
struct Layout {
  int64_t a_ptrs, b_ptrs, d_ptrs, sfa_ptrs, sfb_ptrs;  // const void* [G]
  int64_t m, n, k;                                     // int32 [G] (the setup's; m: rows)
  int64_t shapes;                                      // Shape3 [G]
  int64_t sa, sb, sd;                                  // strides [G]
  int64_t lsfa, lsfb;  // scale layouts [G] (filled; CUTLASS 4.2's grouped mainloop
                       // recomputes each group's from its problem shape)
  int64_t scalars;     // alpha, beta (the setup's, unused), rows in groups (int64)
  int64_t own;         // CUTLASS's workspace
  int64_t bytes;       // the whole

  Layout(int64_t groups, int64_t own_bytes) {
    Carve c;
    a_ptrs = c.Take(groups * 8);
    b_ptrs = c.Take(groups * 8);
    d_ptrs = c.Take(groups * 8);
    sfa_ptrs = c.Take(groups * 8);
    sfb_ptrs = c.Take(groups * 8);
    m = c.Take(groups * 4);
    n = c.Take(groups * 4);
    k = c.Take(groups * 4);
    shapes = c.Take(groups * static_cast<int64_t>(sizeof(Shape3)));
    sa = c.Take(groups * Larger<Forward::StrideA, Wgrad::StrideA>());
    sb = c.Take(groups * Larger<Forward::StrideB, Wgrad::StrideB>());
    sd = c.Take(groups * Larger<Forward::StrideD, Wgrad::StrideD>());
    lsfa = c.Take(groups * Larger<Forward::LayoutSFA, Wgrad::LayoutSFA>());
    lsfb = c.Take(groups * Larger<Forward::LayoutSFB, Wgrad::LayoutSFB>());
    scalars = c.Take(kRegionAlign);
    own = c.Take(own_bytes);
    bytes = c.end;
  }
};

// CUTLASS's arguments for kernel G over the workspace's arrays (base null: sizes only).
template <typename G>
typename G::Gemm::Arguments MakeArguments(int groups, char* base, const Layout& l, int device,
                                          int sms) {
  const auto at = [base](int64_t offset) { return base == nullptr ? nullptr : base + offset; };
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sms;
  typename G::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                   // no host copy of the shapes: they are on the device
                                   {groups, reinterpret_cast<Shape3*>(at(l.shapes)), nullptr},
                                   {reinterpret_cast<const Fp8**>(at(l.a_ptrs)),
                                    reinterpret_cast<typename G::StrideA*>(at(l.sa)),
                                    reinterpret_cast<const Fp8**>(at(l.b_ptrs)),
                                    reinterpret_cast<typename G::StrideB*>(at(l.sb)),
                                    reinterpret_cast<const float**>(at(l.sfa_ptrs)),
                                    reinterpret_cast<typename G::LayoutSFA*>(at(l.lsfa)),
                                    reinterpret_cast<const float**>(at(l.sfb_ptrs)),
                                    reinterpret_cast<typename G::LayoutSFB*>(at(l.lsfb))},
                                   {{},
                                    nullptr,
                                    nullptr,
                                    reinterpret_cast<float**>(at(l.d_ptrs)),
                                    reinterpret_cast<typename G::StrideD*>(at(l.sd))},
                                   hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

// CUTLASS's own workspace for `groups` groups on `sms` SMs, the larger of the two kernels'.
int64_t OwnBytes(int groups, int sms) {
  const Layout none(0, 0);
  return static_cast<int64_t>(std::max(
      Forward::Gemm::get_workspace_size(MakeArguments<Forward>(groups, nullptr, none, 0, sms)),
      Wgrad::Gemm::get_workspace_size(MakeArguments<Wgrad>(groups, nullptr, none, 0, sms))));
}

// The forward's problem (M, N, K), strides and scale layouts of every group (M = 0: no rows).
__global__ void __launch_bounds__(kFillThreads)
    ForwardProblemsKernel(const int32_t* m, int64_t groups, int32_t n, int32_t k, Shape3* shapes,
                          Forward::StrideA* sa, Forward::StrideA va, Forward::StrideB* sb,
                          Forward::StrideB vb, Forward::StrideD* sd, Forward::StrideD vd,
                          Forward::LayoutSFA* lsfa, Forward::LayoutSFB* lsfb) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kFillThreads;
  for (int64_t g = blockIdx.x * int64_t{kFillThreads} + threadIdx.x; g < groups; g += step) {
    const auto shape = cute::make_shape(m[g], int{n}, int{k});
    shapes[g] = shape;
    sa[g] = va;
    sb[g] = vb;
    sd[g] = vd;
    lsfa[g] = Forward::ScaleConfig::tile_atom_to_shape_SFA(cute::append<4>(shape, 1));
    lsfb[g] = Forward::ScaleConfig::tile_atom_to_shape_SFB(cute::append<4>(shape, 1));
  }
}

// Everything of the weight gradient's groups in one pass (no scan: the split's offsets are given).
struct WgradSetup {
  const char* xs = nullptr;          // [K, C] e4m3
  const char* dys = nullptr;         // [N, C] e4m3
  const float* xs_scale = nullptr;   // [S, K]
  const float* dys_scale = nullptr;  // [S, N]
  const int32_t* col_offsets = nullptr;
  const int32_t* scale_offsets = nullptr;
  const int32_t* sizes = nullptr;
  float* dw = nullptr;  // [G, K, N]
  int64_t groups = 0;
  int32_t k = 0, n = 0;
  int64_t columns = 0;       // C
  int64_t scale_blocks = 0;  // S
  const void** a_ptrs = nullptr;
  const void** b_ptrs = nullptr;
  const void** d_ptrs = nullptr;
  const void** sfa_ptrs = nullptr;
  const void** sfb_ptrs = nullptr;
  int32_t* m = nullptr;  // each group's rows (ZeroEmptyGroups' reading)
  Shape3* shapes = nullptr;
  Wgrad::StrideA* sa = nullptr;
  Wgrad::StrideB* sb = nullptr;
  Wgrad::StrideD* sd = nullptr;
  Wgrad::StrideA va{};
  Wgrad::StrideB vb{};
  Wgrad::StrideD vd{};
  Wgrad::LayoutSFA* lsfa = nullptr;
  Wgrad::LayoutSFB* lsfb = nullptr;
};

// dw[g] (K x N) = A (K x m_g: the group's columns of xs) times B (m_g x N: dy's, read from the
// [N, m_g] rows of dys); a group without rows gets M = 0 (no tiles; zeroed afterwards). The
// offsets and sizes are device data: a group that would reach past C columns or S scale blocks,
// or start off a 16-column boundary (TMA), is cut to what fits, or to no rows, so no read leaves
// the buffers whatever they hold (jaxops.fp8.quantize_split_transpose's are always in bounds).
__global__ void __launch_bounds__(kFillThreads) WgradSetupKernel(WgradSetup s) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kFillThreads;
  for (int64_t g = blockIdx.x * int64_t{kFillThreads} + threadIdx.x; g < s.groups; g += step) {
    const int64_t col = min(max(int64_t{s.col_offsets[g]}, int64_t{0}), s.columns);
    const int64_t scol = min(max(int64_t{s.scale_offsets[g]}, int64_t{0}), s.scale_blocks);
    int64_t fit = min(s.columns - col, (s.scale_blocks - scol) * kBlock);
    if (col % kAlignFp8 != 0) fit = 0;
    const int rows = static_cast<int>(min(max(int64_t{s.sizes[g]}, int64_t{0}), fit));
    s.a_ptrs[g] = s.xs + col;
    s.b_ptrs[g] = s.dys + col;
    s.d_ptrs[g] = s.dw + g * int64_t{s.k} * s.n;
    s.sfa_ptrs[g] = s.xs_scale + scol * s.k;
    s.sfb_ptrs[g] = s.dys_scale + scol * s.n;
    s.m[g] = rows;
    const auto shape = cute::make_shape(rows == 0 ? 0 : int{s.k}, int{s.n}, rows);
    s.shapes[g] = shape;
    s.sa[g] = s.va;
    s.sb[g] = s.vb;
    s.sd[g] = s.vd;
    s.lsfa[g] = Wgrad::ScaleConfig::tile_atom_to_shape_SFA(cute::append<4>(shape, 1));
    s.lsfb[g] = Wgrad::ScaleConfig::tile_atom_to_shape_SFB(cute::append<4>(shape, 1));
  }
}

// One CUTLASS grouped GEMM of kernel G over the workspace's arrays, on the stream.
template <typename G>
ffi::Error Run(const std::string& name, int64_t groups, char* base, const Layout& l, int32_t device,
               int sms, cudaStream_t stream) {
  auto args = MakeArguments<G>(static_cast<int>(groups), base, l, device, sms);
  typename G::Gemm gemm;
  if (auto e = CutlassError(gemm.can_implement(args), name + ": can_implement"); e.failure()) {
    return e;
  }
  if (auto e = CutlassError(gemm.initialize(args, base + l.own, stream), name + ": initialize");
      e.failure()) {
    return e;
  }
  if (auto e = CutlassError(gemm.run(stream), name + ": run"); e.failure()) return e;
  return LastLaunchError(name.c_str());
}

// The checked device and the workspace's base and layout for `groups` groups.
struct Prepared {
  char* base = nullptr;
  Layout layout{0, 0};
  int sms = 0;
};

ffi::ErrorOr<Prepared> Prepare(const char* op, int64_t groups, int32_t device,
                               ffi::AnyBuffer& workspace) {
  Prepared out;
  auto sms = CutlassSms(op, device, "call it with impl=\"xla\"");
  if (sms.has_error()) return ffi::Unexpected(sms.error());
  out.sms = *sms;
  out.layout = Layout(groups, OwnBytes(static_cast<int>(groups), out.sms));
  auto base = CutlassWorkspace(op, workspace, out.layout.bytes, groups);
  if (base.has_error()) return ffi::Unexpected(base.error());
  out.base = *base;
  return out;
}

// Whether the shapes are ones the kernels take (the wrappers send no others).
ffi::Error CheckSizes(const std::string& name, int64_t m, int64_t k, int64_t n, int64_t groups) {
  const int64_t int32_max = 0x7fffffff;
  if (m <= 0 || k <= 0 || n <= 0 || groups <= 0 || m > int32_max || k > int32_max ||
      n > int32_max || groups > int32_max || k % kAlignFp8 != 0 || n % kAlignFp8 != 0) {
    return InvalidArgument(name + ": needs sizes of 1 to 2^31 - 1 with K and N multiples of 16; " +
                           "got rows " + std::to_string(m) + ", K " + std::to_string(k) + ", N " +
                           std::to_string(n) + ", groups " + std::to_string(groups));
  }
  return ffi::Error::Success();
}

// The forward's problem, or the error naming what is wrong (the contract above).
ffi::ErrorOr<Problem> CheckForward(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& xs,
                                   const ffi::AnyBuffer& w, const ffi::Buffer<ffi::F32>& ws,
                                   const ffi::Buffer<ffi::S32>& sizes,
                                   const ffi::Buffer<ffi::F32>& y) {
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
  if (auto e = CheckSizes(std::string(kOp) + " (CUTLASS)", p.rows, p.k, p.n, p.groups);
      e.failure()) {
    return ffi::Unexpected(e);
  }
  return p;
}

ffi::Error ForwardDispatch(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                           ffi::Buffer<ffi::F32> x_scale, ffi::AnyBuffer w,
                           ffi::Buffer<ffi::F32> w_scale, ffi::Buffer<ffi::S32> sizes,
                           ffi::Result<ffi::Buffer<ffi::F32>> y,
                           ffi::Result<ffi::AnyBuffer> workspace, bool zero_tail) {
  constexpr const char* kOp = "grouped_gemm_fp8";
  const std::string name = std::string(kOp) + " (CUTLASS)";
  auto problem = CheckForward(x, x_scale, w, w_scale, sizes, *y);
  if (problem.has_error()) return problem.error();
  const Problem& p = *problem;
  if (!IsAligned(x.untyped_data(), 16) || !IsAligned(w.untyped_data(), 16) ||
      !IsAligned(y->untyped_data(), 16)) {
    return InvalidArgument(name + ": x_data, w_data and y must start 16-byte aligned");
  }
  auto prepared = Prepare(kOp, p.groups, device, *workspace);
  if (prepared.has_error()) return prepared.error();
  char* base = prepared->base;
  const Layout& l = prepared->layout;

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

  using G = Forward;
  const int n = static_cast<int>(p.n);
  const int k = static_cast<int>(p.k);
  // The strides do not depend on the group's rows (1 here).
  ForwardProblemsKernel<<<GridCtas(p.groups, kFillThreads, 1024), kFillThreads, 0, stream>>>(
      s.m, p.groups, s.n, s.k, reinterpret_cast<Shape3*>(base + l.shapes),
      reinterpret_cast<G::StrideA*>(base + l.sa),
      cutlass::make_cute_packed_stride(G::StrideA{}, {1, k, 1}),
      reinterpret_cast<G::StrideB*>(base + l.sb),
      cutlass::make_cute_packed_stride(G::StrideB{}, {n, k, 1}),
      reinterpret_cast<G::StrideD*>(base + l.sd),
      cutlass::make_cute_packed_stride(G::StrideD{}, {1, n, 1}),
      reinterpret_cast<G::LayoutSFA*>(base + l.lsfa),
      reinterpret_cast<G::LayoutSFB*>(base + l.lsfb));
  if (auto e = LastLaunchError((name + " problem kernel").c_str()); e.failure()) return e;
  if (auto e = Run<G>(name, p.groups, base, l, device, prepared->sms, stream); e.failure()) {
    return e;
  }
  if (!zero_tail) return ffi::Error::Success();
  return ZeroTail(stream, y->typed_data(), s.total, p.rows, p.n,
                  "grouped_gemm_fp8 (CUTLASS) tail zeroing kernel");
}

// The weight gradient's problem (rows: the split's token columns C), or the error.
ffi::ErrorOr<Problem> CheckWgrad(const ffi::AnyBuffer& xs, const ffi::Buffer<ffi::F32>& xss,
                                 const ffi::AnyBuffer& dys, const ffi::Buffer<ffi::F32>& dyss,
                                 const ffi::Buffer<ffi::S32>& cols,
                                 const ffi::Buffer<ffi::S32>& scols,
                                 const ffi::Buffer<ffi::S32>& sizes,
                                 const ffi::Buffer<ffi::F32>& dw) {
  constexpr const char* kOp = "grouped_gemm_fp8_wgrad";
  const auto xd = xs.dimensions();
  const auto yd = dys.dimensions();
  const auto xsd = xss.dimensions();
  const auto ysd = dyss.dimensions();
  const auto wd = dw.dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xsd.size() != 2 || ysd.size() != 2 || wd.size() != 3 ||
      xs.element_type() != ffi::DataType::F8E4M3FN ||
      dys.element_type() != ffi::DataType::F8E4M3FN || yd[1] != xd[1] || ysd[0] != xsd[0] ||
      xsd[1] != xd[0] || ysd[1] != yd[0] || wd[1] != xd[0] || wd[2] != yd[0] ||
      xd[1] % kAlignFp8 != 0) {
    return Bad(std::string(kOp) + ": xs_data float8_e4m3fn [K, C], xs_scale float32 [S, K], " +
               "dys_data float8_e4m3fn [N, C], dys_scale float32 [S, N] and dw float32 [G, K, N] " +
               "(C a multiple of 16); got xs_data " + ShapeString(xs) + ", xs_scale " +
               ShapeString(xss) + ", dys_data " + ShapeString(dys) + ", dys_scale " +
               ShapeString(dyss) + ", dw " + ShapeString(dw));
  }
  Problem p;
  p.k = xd[0];
  p.n = yd[0];
  p.rows = xd[1];
  p.groups = wd[0];
  const auto cd = cols.dimensions();
  const auto sd = scols.dimensions();
  if (cd.size() != 1 || cd[0] != p.groups + 1 || sd.size() != 1 || sd[0] != p.groups + 1) {
    return Bad(std::string(kOp) + ": col_offsets and scale_offsets must be int32 [" +
               std::to_string(p.groups + 1) + "], got " + ShapeString(cols) + " and " +
               ShapeString(scols));
  }
  if (auto e = CheckGroups(kOp, sizes, p.groups); e.failure()) return ffi::Unexpected(e);
  if (auto e = CheckSizes(std::string(kOp) + " (CUTLASS)", p.rows, p.k, p.n, p.groups);
      e.failure()) {
    return ffi::Unexpected(e);
  }
  return p;
}

ffi::Error WgradDispatch(cudaStream_t stream, int32_t device, ffi::AnyBuffer xs,
                         ffi::Buffer<ffi::F32> xs_scale, ffi::AnyBuffer dys,
                         ffi::Buffer<ffi::F32> dys_scale, ffi::Buffer<ffi::S32> col_offsets,
                         ffi::Buffer<ffi::S32> scale_offsets, ffi::Buffer<ffi::S32> sizes,
                         ffi::Result<ffi::Buffer<ffi::F32>> dw,
                         ffi::Result<ffi::AnyBuffer> workspace) {
  constexpr const char* kOp = "grouped_gemm_fp8_wgrad";
  const std::string name = std::string(kOp) + " (CUTLASS)";
  auto problem = CheckWgrad(xs, xs_scale, dys, dys_scale, col_offsets, scale_offsets, sizes, *dw);
  if (problem.has_error()) return problem.error();
  const Problem& p = *problem;
  if (!IsAligned(xs.untyped_data(), 16) || !IsAligned(dys.untyped_data(), 16) ||
      !IsAligned(dw->untyped_data(), 16)) {
    return InvalidArgument(name + ": xs_data, dys_data and dw must start 16-byte aligned");
  }
  auto chunks = EmptyGroupChunks(kOp, p.groups, p.k, p.n);
  if (chunks.has_error()) return chunks.error();
  auto prepared = Prepare(kOp, p.groups, device, *workspace);
  if (prepared.has_error()) return prepared.error();
  char* base = prepared->base;
  const Layout& l = prepared->layout;

  using G = Wgrad;
  WgradSetup s;
  s.xs = static_cast<const char*>(xs.untyped_data());
  s.dys = static_cast<const char*>(dys.untyped_data());
  s.xs_scale = xs_scale.typed_data();
  s.dys_scale = dys_scale.typed_data();
  s.col_offsets = col_offsets.typed_data();
  s.scale_offsets = scale_offsets.typed_data();
  s.sizes = sizes.typed_data();
  s.dw = dw->typed_data();
  s.groups = p.groups;
  s.k = static_cast<int32_t>(p.k);
  s.n = static_cast<int32_t>(p.n);
  s.columns = p.rows;
  s.scale_blocks = xs_scale.dimensions()[0];
  s.a_ptrs = reinterpret_cast<const void**>(base + l.a_ptrs);
  s.b_ptrs = reinterpret_cast<const void**>(base + l.b_ptrs);
  s.d_ptrs = reinterpret_cast<const void**>(base + l.d_ptrs);
  s.sfa_ptrs = reinterpret_cast<const void**>(base + l.sfa_ptrs);
  s.sfb_ptrs = reinterpret_cast<const void**>(base + l.sfb_ptrs);
  s.m = reinterpret_cast<int32_t*>(base + l.m);
  s.shapes = reinterpret_cast<Shape3*>(base + l.shapes);
  s.sa = reinterpret_cast<G::StrideA*>(base + l.sa);
  s.sb = reinterpret_cast<G::StrideB*>(base + l.sb);
  s.sd = reinterpret_cast<G::StrideD*>(base + l.sd);
  // Rows of C tokens (the split's row stride) for A and B, whatever the group's token count.
  const int columns = static_cast<int>(p.rows);
  s.va = cutlass::make_cute_packed_stride(G::StrideA{}, {1, columns, 1});
  s.vb = cutlass::make_cute_packed_stride(G::StrideB{}, {1, columns, 1});
  s.vd = cutlass::make_cute_packed_stride(G::StrideD{}, {1, static_cast<int>(p.n), 1});
  s.lsfa = reinterpret_cast<G::LayoutSFA*>(base + l.lsfa);
  s.lsfb = reinterpret_cast<G::LayoutSFB*>(base + l.lsfb);
  WgradSetupKernel<<<GridCtas(p.groups, kFillThreads, 1024), kFillThreads, 0, stream>>>(s);
  if (auto e = LastLaunchError((name + " setup kernel").c_str()); e.failure()) return e;
  if (auto e = Run<G>(name, p.groups, base, l, device, prepared->sms, stream); e.failure()) {
    return e;
  }
  return ZeroEmptyGroups(stream, dw->typed_data(), s.m, p.groups, p.k, p.n, *chunks,
                         "grouped_gemm_fp8_wgrad (CUTLASS) empty-group zeroing kernel");
}

}  // namespace

int64_t CutlassFp8WorkspaceBytes(int64_t groups) {
  const int g = static_cast<int>(std::clamp<int64_t>(groups, 1, 0x7fffffff));
  return Layout(groups, OwnBytes(g, kMaxSms)).bytes;
}

}  // namespace jaxops::grouped_gemm

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    GroupedGemmFp8CutlassCuda, jaxops::grouped_gemm::ForwardDispatch,
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    GroupedGemmFp8WgradCutlassCuda, jaxops::grouped_gemm::WgradDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA stream
        .Ctx<ffi::DeviceOrdinal>()                 // device: its SM count and architecture
        .Arg<ffi::AnyBuffer>()                     // xs_data e4m3 [K, C]
        .Arg<ffi::Buffer<ffi::F32>>()              // xs_scale [S, K]
        .Arg<ffi::AnyBuffer>()                     // dys_data e4m3 [N, C]
        .Arg<ffi::Buffer<ffi::F32>>()              // dys_scale [S, N]
        .Arg<ffi::Buffer<ffi::S32>>()              // col_offsets [G + 1]
        .Arg<ffi::Buffer<ffi::S32>>()              // scale_offsets [G + 1]
        .Arg<ffi::Buffer<ffi::S32>>()              // sizes [G]
        .Ret<ffi::Buffer<ffi::F32>>()              // dw [G, K, N]
        .Ret<ffi::AnyBuffer>(),                    // workspace u8 [W]
    {ffi::Traits::kCmdBufferCompatible});
