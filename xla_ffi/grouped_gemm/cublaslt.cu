// CUDA handlers of the grouped GEMM family on cuBLASLt's grouped matmul
// (CUBLASLT_BATCH_MODE_GROUPED, experimental: each group's shape and matrices are
// read from device arrays, so the group sizes never leave the device). The targets
// jaxops_grouped_gemm_lt and jaxops_grouped_gemm_wgrad_lt: the contracts of jaxops_grouped_gemm
// and jaxops_grouped_gemm_wgrad (checks.h) plus a uint8 workspace result (WorkspaceBytes).
//
// One call, on the XLA stream, never synchronizing with the host:
//   1. GroupedSetupKernel (one CTA, setup_kernels.cuh) turns the group sizes into cuBLASLt's
//   per-group arrays in the
//      workspace: each group's rows (clipped as jaxops' kernels clip them), the fixed sizes
//      (also the leading dimensions) and each group's matrix pointers; and alpha = 1, beta = 0
//      (one device scalar each: Hopper takes no per-group alpha and beta).
//   2. One cublasLtMatmul over every group. cuBLASLt is column-major, so the row-major
//      y_g = x_g @ w[g] runs as y_g^T = w[g]^T x_g^T: A = w[g] (n x k, or k x n read transposed
//      when w is [G, N, K]), B = x_g (k x m_g), D = y_g (n x m_g), all with ld = their row length.
//      The weight gradient dw[g] = x_g^T dy_g runs as dw[g]^T = dy_g^T x_g: A = dy_g (n x m_g),
//      B = x_g (k x m_g) read transposed, D = dw[g] (n x k); m_g is its reduction.
//   3. The forward with zero_tail zeros the rows past the groups (ZeroTailKernel); the weight
//      gradient zeros the groups without rows (ZeroEmptyGroupsKernel), whatever cuBLASLt made of
//      their K = 0 products.
//
// cuBLASLt's grouped matmul takes 16-bit operands (bfloat16, float16; FP8 and FP4 too, unused
// here), not float32, and every per-group pointer and leading dimension here is 16-byte aligned,
// which the algorithms are chosen for (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*): x, w | dy and
// y | dw start 16-byte aligned and their rows are whole multiples of 16 bytes. A call that is not
// so (float32 among them), or is empty, runs jaxops' own kernels instead (cuda_kernels.h); every
// other refusal (a libcublasLt without the grouped API, no algorithm) is an error naming it.
//
// The loaded libcublasLt may predate the grouped API (jax's CUDA packages accept cuBLAS 13.0): its
// one new entry point, cublasLtGroupedMatrixLayoutCreate, is looked up at run time, so the module
// still loads without it, and a library older than kMinLtVersion (cuBLAS 13.4, the first with
// grouped 16-bit matmuls on Hopper as well as Blackwell, as NVIDIA's TransformerEngine gates it)
// is not used.
//
// Per call site a GroupedLtState (the instantiate stage) holds one plan per device: the cuBLASLt
// handle, descriptor, grouped layouts and the algorithm its heuristic chose, made on the first
// execution there. Later executions point the layouts at this workspace's arrays and enqueue.
// Command buffers: the workspace is an XLA-allocated result (as in the GEMM family), so a captured
// graph keeps valid pointers.
#include "xla_ffi/common/cuda_util.cuh"

// clang-format off
#include <cublasLt.h>
// clang-format on
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "xla_ffi/common/cuda_plans.h"
#include "xla_ffi/common/cuda_vec.cuh"
#include "xla_ffi/grouped_gemm/checks.h"
#include "xla_ffi/grouped_gemm/cuda_kernels.h"
#include "xla_ffi/grouped_gemm/handlers.h"
#include "xla_ffi/grouped_gemm/setup_kernels.cuh"

namespace jaxops::grouped_gemm {

// The heuristic's average-shape preferences of a grouped matmul, by their values in
// cublasLtMatmulPreferenceAttributes_t: the headers of cuBLAS 13.0, which the binary wheel is built
// against (the oldest its dependency allows), lack them, and the module runs with whatever
// libcublasLt is installed. Newer headers must agree.
constexpr auto kPrefAverageReduction = static_cast<cublasLtMatmulPreferenceAttributes_t>(13);
constexpr auto kPrefAverageRows = static_cast<cublasLtMatmulPreferenceAttributes_t>(14);
constexpr auto kPrefAverageCols = static_cast<cublasLtMatmulPreferenceAttributes_t>(15);
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 131000  // headers known to declare them
static_assert(kPrefAverageReduction == CUBLASLT_MATMUL_PREF_GROUPED_AVERAGE_REDUCTION_DIM);
static_assert(kPrefAverageRows == CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_ROWS);
static_assert(kPrefAverageCols == CUBLASLT_MATMUL_PREF_GROUPED_DESC_D_AVERAGE_COLS);
#endif

// ---------------------------------------------------------------------------------------------
// The workspace: cuBLASLt's per-group arrays, then cuBLASLt's own workspace. Python sizes it by
// asking (LtWorkspaceBytes, exported as grouped_gemm_lt_workspace_bytes).

namespace {

constexpr int64_t kRegionAlign = 256;
constexpr int64_t kLtOwnBytes = int64_t{32} << 20;  // cuBLASLt's share: its Hopper recommendation
constexpr size_t kMinLtVersion = 130400;            // cublasLtGetVersion() of cuBLAS 13.4

int64_t Region(int64_t bytes) { return CeilDiv(bytes, kRegionAlign) * kRegionAlign; }

// Byte offsets of the arrays of `groups` groups in the workspace.
struct Layout {
  int64_t a_ptrs, b_ptrs, d_ptrs;  // const void* [G]: each group's A, B and D
  int64_t m, n, k;                 // int32 [G]: the group's rows; the fixed N and K
  int64_t alpha, beta, total;      // one region: float 1, float 0, int64 rows in groups
  int64_t lt;                      // cuBLASLt's own workspace, kLtOwnBytes
  int64_t bytes;                   // the whole

  explicit Layout(int64_t groups) {
    const int64_t pointers = Region(groups * 8);
    const int64_t words = Region(groups * 4);
    a_ptrs = 0;
    b_ptrs = a_ptrs + pointers;
    d_ptrs = b_ptrs + pointers;
    m = d_ptrs + pointers;
    n = m + words;
    k = n + words;
    alpha = k + words;
    beta = alpha + 4;
    total = alpha + 8;
    lt = alpha + kRegionAlign;
    bytes = lt + kLtOwnBytes;
  }
};

}  // namespace

int64_t LtWorkspaceBytes(int64_t groups) { return Layout(groups).bytes; }

namespace {

// ---------------------------------------------------------------------------------------------
// cuBLASLt.

ffi::Error LtError(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return ffi::Error::Success();
  return Internal(std::string("grouped_gemm (cuBLASLt): ") + what +
                  " failed: " + cublasLtGetStatusString(status));
}

using GroupedLayoutCreateFn = cublasStatus_t (*)(cublasLtMatrixLayout_t*, cudaDataType, int,
                                                 const void*, const void*, const void*);

// cublasLtGroupedMatrixLayoutCreate of the libcublasLt this process loaded, or null.
GroupedLayoutCreateFn FindGroupedLayoutCreate() {
  Dl_info info = {};
  if (dladdr(reinterpret_cast<void*>(&cublasLtCreate), &info) == 0 || info.dli_fname == nullptr) {
    return nullptr;
  }
  void* library = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);  // already loaded: a reference
  if (library == nullptr) return nullptr;
  auto* create =
      reinterpret_cast<GroupedLayoutCreateFn>(dlsym(library, "cublasLtGroupedMatrixLayoutCreate"));
  dlclose(library);  // the library stays loaded: this module links it
  return create;
}

GroupedLayoutCreateFn GroupedLayoutCreate() {
  static const GroupedLayoutCreateFn create = FindGroupedLayoutCreate();
  return create;
}

// Which of the per-group arrays (m, n, k) gives a layout's rows, columns or leading dimension.
enum class Dim { kM, kN, kK };

struct LayoutDims {
  Dim rows, cols, ld;
};

// One call in cuBLASLt's terms: what is fixed per call site, and this execution's arrays.
struct LtCall {
  cudaDataType_t in_type = CUDA_R_32F;
  cublasOperation_t op_a = CUBLAS_OP_N;
  cublasOperation_t op_b = CUBLAS_OP_N;
  LayoutDims a, b, d;
  int groups = 0;
  uint32_t avg_d_rows = 0;
  uint32_t avg_d_cols = 0;
  uint32_t avg_reduction = 0;
  const int32_t* dims[3] = {nullptr, nullptr, nullptr};  // device m, n, k arrays
  const void* a_ptrs = nullptr;
  const void* b_ptrs = nullptr;
  void* d_ptrs = nullptr;
  const void* alpha = nullptr;
  const void* beta = nullptr;
  void* lt_workspace = nullptr;
  size_t lt_workspace_bytes = 0;
  const char* op = "";  // names the call in errors
};

const int32_t* DimArray(const LtCall& call, Dim dim) { return call.dims[static_cast<int>(dim)]; }

template <typename T>
ffi::Error SetDesc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  return LtError(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)),
                 "cublasLtMatmulDescSetAttribute");
}

template <typename T>
cublasStatus_t SetPref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                       const T& value) {
  return cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value));
}

// The cuBLASLt objects of one call site on one device.
class GroupedPlan {
 public:
  GroupedPlan() = default;
  GroupedPlan(const GroupedPlan&) = delete;
  GroupedPlan& operator=(const GroupedPlan&) = delete;
  ~GroupedPlan() {
    for (cublasLtMatrixLayout_t layout : {d_, b_, a_}) {
      if (layout) cublasLtMatrixLayoutDestroy(layout);
    }
    if (desc_) cublasLtMatmulDescDestroy(desc_);
    if (handle_) cublasLtDestroy(handle_);
  }

  ffi::Error Create(const LtCall& call) {
    const GroupedLayoutCreateFn create = GroupedLayoutCreate();
    if (create == nullptr || cublasLtGetVersion() < kMinLtVersion) {
      return Internal(std::string(call.op) + ": the loaded libcublasLt (version " +
                      std::to_string(cublasLtGetVersion()) +
                      ") has no grouped matmul for Hopper: it needs cuBLAS 13.4 or newer "
                      "(cublasLtGetVersion() >= 130400; pip install -U nvidia-cublas), or "
                      "JAXOPS_GPU_GROUPED_GEMM=kernel");
    }
    if (auto e = LtError(cublasLtCreate(&handle_), "cublasLtCreate"); e.failure()) return e;
    if (auto e = LtError(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                         "cublasLtMatmulDescCreate");
        e.failure()) {
      return e;
    }
    // alpha and beta: one device scalar each (no batch stride: Hopper has no per-group ones)
    const int32_t pointer_mode = CUBLASLT_POINTER_MODE_DEVICE;
    ffi::Error error = SetDesc(desc_, CUBLASLT_MATMUL_DESC_TRANSA, call.op_a);
    if (error.success()) error = SetDesc(desc_, CUBLASLT_MATMUL_DESC_TRANSB, call.op_b);
    if (error.success()) error = SetDesc(desc_, CUBLASLT_MATMUL_DESC_POINTER_MODE, pointer_mode);
    if (error.failure()) return error;
    if (auto e = MakeLayouts(call, create); e.failure()) return e;
    return Choose(call);
  }

  // Remakes the layouts on this execution's arrays if the workspace moved (the algorithm stays:
  // the shapes and types are the call site's), and enqueues the matmul.
  ffi::Error Run(const LtCall& call, cudaStream_t stream) {
    if (call.dims[0] != arrays_[0] || call.dims[1] != arrays_[1] || call.dims[2] != arrays_[2]) {
      if (auto e = MakeLayouts(call, GroupedLayoutCreate()); e.failure()) return e;
    }
    return LtError(cublasLtMatmul(handle_, desc_, call.alpha, call.a_ptrs, a_, call.b_ptrs, b_,
                                  call.beta, call.d_ptrs, d_, call.d_ptrs, d_, &algo_,
                                  call.lt_workspace, call.lt_workspace_bytes, stream),
                   "cublasLtMatmul");
  }

 private:
  // The grouped layouts of A, B and D (C is D: beta is 0) on the call's device arrays.
  ffi::Error MakeLayouts(const LtCall& call, GroupedLayoutCreateFn create) {
    const struct {
      cublasLtMatrixLayout_t* layout;
      cudaDataType_t type;
      LayoutDims dims;
    } layouts[] = {
        {&a_, call.in_type, call.a}, {&b_, call.in_type, call.b}, {&d_, CUDA_R_32F, call.d}};
    for (const auto& l : layouts) {
      if (*l.layout != nullptr) {
        cublasLtMatrixLayoutDestroy(*l.layout);
        *l.layout = nullptr;
      }
      if (auto e = LtError(create(l.layout, l.type, call.groups, DimArray(call, l.dims.rows),
                                  DimArray(call, l.dims.cols), DimArray(call, l.dims.ld)),
                           "cublasLtGroupedMatrixLayoutCreate");
          e.failure()) {
        return e;
      }
    }
    arrays_ = {call.dims[0], call.dims[1], call.dims[2]};
    return ffi::Error::Success();
  }

  // The heuristic's first algorithm for these layouts, 16-byte-aligned matrices and the average
  // group (the shapes are on the device: the averages steer the choice).
  ffi::Error Choose(const LtCall& call) {
    cublasLtMatmulPreference_t pref = nullptr;
    if (auto e = LtError(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
        e.failure()) {
      return e;
    }
    const uint64_t workspace = call.lt_workspace_bytes;
    const uint32_t align = 16;
    cublasStatus_t status = SetPref(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace);
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      if (status == CUBLAS_STATUS_SUCCESS) status = SetPref(pref, attr, align);
    }
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> averages[] = {
        {kPrefAverageRows, call.avg_d_rows},
        {kPrefAverageCols, call.avg_d_cols},
        {kPrefAverageReduction, call.avg_reduction}};
    for (const auto& [attr, value] : averages) {
      if (status != CUBLAS_STATUS_SUCCESS) break;
      // int64_t, as NVIDIA's grouped sample and TransformerEngine pass them; the header documents
      // uint32_t, so a library that refuses the one size is given the other.
      status = SetPref(pref, attr, int64_t{value});
      if (status == CUBLAS_STATUS_INVALID_VALUE) status = SetPref(pref, attr, value);
    }
    cublasLtMatmulHeuristicResult_t result = {};
    int found = 0;
    if (status == CUBLAS_STATUS_SUCCESS) {
      status =
          cublasLtMatmulAlgoGetHeuristic(handle_, desc_, a_, b_, d_, d_, pref, 1, &result, &found);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    if (auto e = LtError(status, "choosing an algorithm (cublasLtMatmulAlgoGetHeuristic)");
        e.failure()) {
      return e;
    }
    if (found == 0) {
      return Internal(std::string(call.op) + ": cuBLASLt (version " +
                      std::to_string(cublasLtGetVersion()) +
                      ") has no grouped algorithm for these operands on this device (" +
                      std::to_string(call.groups) + " groups, average D " +
                      std::to_string(call.avg_d_rows) + " x " + std::to_string(call.avg_d_cols) +
                      ", reduction " + std::to_string(call.avg_reduction) + ")");
    }
    algo_ = result.algo;
    return ffi::Error::Success();
  }

  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr;
  cublasLtMatrixLayout_t b_ = nullptr;
  cublasLtMatrixLayout_t d_ = nullptr;
  cublasLtMatmulAlgo_t algo_ = {};
  std::array<const int32_t*, 3> arrays_ = {};
};

}  // namespace

// Per call site: one plan per device, made on the first execution there.
struct GroupedLtState {
  static ffi::TypeId id;
  DevicePlans<GroupedPlan> plans;
};
ffi::TypeId GroupedLtState::id = {};

XLA_FFI_TypeId* GroupedLtStateTypeId() { return &GroupedLtState::id; }

const XLA_FFI_TypeInfo* GroupedLtStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<GroupedLtState>();
  return &info;
}

bool LtGroupedAvailable() {
  return GroupedLayoutCreate() != nullptr && cublasLtGetVersion() >= kMinLtVersion;
}

int64_t LtVersion() { return static_cast<int64_t>(cublasLtGetVersion()); }

namespace {

ffi::Error Execute(GroupedLtState* state, int32_t device, const LtCall& call, cudaStream_t stream) {
  return state->plans.Run(device, call, stream);
}

cudaDataType_t LtType(ffi::DataType dtype) {
  return dtype == ffi::DataType::BF16 ? CUDA_R_16BF : CUDA_R_16F;  // LtEligible's two
}

// Whether cuBLASLt takes the call: 16-bit operands (its grouped matmul has no float32),
// 16-byte-aligned starts and rows of whole 16-byte multiples (x's K and N elements, y's or dw's
// N floats), sizes within int32, and something to compute.
bool LtEligible(const Problem& p, ffi::DataType dtype, const void* x, const void* other,
                const void* out) {
  const int64_t e = static_cast<int64_t>(ffi::ByteWidth(dtype));
  const bool sixteen_bit = dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16;
  const int64_t int32_max = 0x7fffffff;
  return sixteen_bit && p.rows > 0 && p.k > 0 && p.n > 0 && p.groups > 0 && p.rows <= int32_max &&
         p.k <= int32_max && p.n <= int32_max && p.groups <= int32_max && (p.k * e) % 16 == 0 &&
         (p.n * e) % 16 == 0 && IsAligned(x, 16) && IsAligned(other, 16) && IsAligned(out, 16);
}

uint32_t Clamp32(int64_t v) { return static_cast<uint32_t>(std::clamp<int64_t>(v, 1, 0x7fffffff)); }

// The workspace's arrays for `p`, the setup of its per-group entries, and the call's arrays.
struct Prepared {
  SetupParams setup;
  LtCall call;
};

ffi::ErrorOr<Prepared> Prepare(const char* op, const Problem& p, ffi::DataType dtype,
                               ffi::Result<ffi::AnyBuffer>& workspace,
                               const ffi::Buffer<ffi::S32>& sizes) {
  const Layout layout(p.groups);
  if (workspace->element_type() != ffi::DataType::U8 ||
      static_cast<int64_t>(workspace->size_bytes()) < layout.bytes ||
      !IsAligned(workspace->untyped_data(), 16)) {
    return Bad(std::string(op) +
               ": the workspace must be 16-byte-aligned uint8 [>= " + std::to_string(layout.bytes) +
               "] for " + std::to_string(p.groups) + " groups, got " + ShapeString(*workspace));
  }
  char* base = static_cast<char*>(workspace->untyped_data());
  Prepared out;
  SetupParams& s = out.setup;
  s.sizes = sizes.typed_data();
  s.groups = p.groups;
  s.rows = p.rows;
  s.n = static_cast<int32_t>(p.n);
  s.k = static_cast<int32_t>(p.k);
  s.a_ptrs = reinterpret_cast<const void**>(base + layout.a_ptrs);
  s.b_ptrs = reinterpret_cast<const void**>(base + layout.b_ptrs);
  s.d_ptrs = reinterpret_cast<const void**>(base + layout.d_ptrs);
  s.alpha = reinterpret_cast<float*>(base + layout.alpha);
  s.beta = reinterpret_cast<float*>(base + layout.beta);
  s.m = reinterpret_cast<int32_t*>(base + layout.m);
  s.ns = reinterpret_cast<int32_t*>(base + layout.n);
  s.ks = reinterpret_cast<int32_t*>(base + layout.k);
  s.total = reinterpret_cast<long long*>(base + layout.total);
  LtCall& c = out.call;
  c.op = op;
  c.in_type = LtType(dtype);
  c.groups = static_cast<int>(p.groups);
  c.dims[static_cast<int>(Dim::kM)] = s.m;
  c.dims[static_cast<int>(Dim::kN)] = s.ns;
  c.dims[static_cast<int>(Dim::kK)] = s.ks;
  c.a_ptrs = s.a_ptrs;
  c.b_ptrs = s.b_ptrs;
  c.d_ptrs = s.d_ptrs;
  c.alpha = s.alpha;
  c.beta = s.beta;
  c.lt_workspace = base + layout.lt;
  c.lt_workspace_bytes = static_cast<size_t>(workspace->size_bytes() - layout.lt);
  return out;
}

ffi::Error LaunchSetup(const char* op, const SetupParams& s, cudaStream_t stream) {
  GroupedSetupKernel<<<1, kSetupThreads, 0, stream>>>(s);
  return LastLaunchError((std::string(op) + " setup kernel").c_str());
}

ffi::Error ForwardLtDispatch(cudaStream_t stream, GroupedLtState* state, int32_t device,
                             ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> sizes,
                             ffi::Result<ffi::Buffer<ffi::F32>> y,
                             ffi::Result<ffi::AnyBuffer> workspace, bool transpose_w,
                             bool zero_tail) {
  constexpr const char* kOp = "grouped_gemm";
  auto problem = CheckForward(x, w, sizes, *y, transpose_w);
  if (problem.has_error()) return problem.error();
  const Problem& p = *problem;
  if (!LtEligible(p, x.element_type(), x.untyped_data(), w.untyped_data(), y->untyped_data())) {
    return KernelForward(stream, p, x, w, sizes, y->typed_data(), transpose_w, zero_tail);
  }
  auto prepared = Prepare(kOp, p, x.element_type(), workspace, sizes);
  if (prepared.has_error()) return prepared.error();
  SetupParams& s = prepared->setup;
  const int64_t elem = static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  s.a = {static_cast<const char*>(w.untyped_data()), p.k * p.n * elem, false};
  s.b = {static_cast<const char*>(x.untyped_data()), p.k * elem, true};
  s.d = {reinterpret_cast<const char*>(y->typed_data()), p.n * int64_t{4}, true};
  LtCall& c = prepared->call;
  // A = w[g]: n x k (ld n), or [N, K] read transposed (k x n, ld k); B = x_g: k x m_g (ld k);
  // D = y_g: n x m_g (ld n).
  c.op_a = transpose_w ? CUBLAS_OP_T : CUBLAS_OP_N;
  c.a = transpose_w ? LayoutDims{Dim::kK, Dim::kN, Dim::kK} : LayoutDims{Dim::kN, Dim::kK, Dim::kN};
  c.op_b = CUBLAS_OP_N;
  c.b = {Dim::kK, Dim::kM, Dim::kK};
  c.d = {Dim::kN, Dim::kM, Dim::kN};
  c.avg_d_rows = Clamp32(p.n);
  c.avg_d_cols = Clamp32(p.rows / p.groups);
  c.avg_reduction = Clamp32(p.k);
  if (auto e = LaunchSetup(kOp, s, stream); e.failure()) return e;
  if (auto e = Execute(state, device, c, stream); e.failure()) return e;
  if (!zero_tail) return ffi::Error::Success();
  return ZeroTail(stream, y->typed_data(), s.total, p.rows, p.n,
                  "grouped_gemm (cuBLASLt) tail zeroing kernel");
}

ffi::Error WgradLtDispatch(cudaStream_t stream, GroupedLtState* state, int32_t device,
                           ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::Buffer<ffi::S32> sizes,
                           ffi::Result<ffi::Buffer<ffi::F32>> dw,
                           ffi::Result<ffi::AnyBuffer> workspace) {
  constexpr const char* kOp = "grouped_gemm_wgrad";
  auto problem = CheckWgrad(x, dy, sizes, *dw);
  if (problem.has_error()) return problem.error();
  const Problem& p = *problem;
  if (!LtEligible(p, x.element_type(), x.untyped_data(), dy.untyped_data(), dw->untyped_data())) {
    return KernelWgrad(stream, p, x, dy, sizes, dw->typed_data());
  }
  auto prepared = Prepare(kOp, p, x.element_type(), workspace, sizes);
  if (prepared.has_error()) return prepared.error();
  SetupParams& s = prepared->setup;
  const int64_t elem = static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  s.a = {static_cast<const char*>(dy.untyped_data()), p.n * elem, true};
  s.b = {static_cast<const char*>(x.untyped_data()), p.k * elem, true};
  s.d = {reinterpret_cast<const char*>(dw->typed_data()), p.k * p.n * int64_t{4}, false};
  LtCall& c = prepared->call;
  // A = dy_g: n x m_g (ld n); B = x_g: k x m_g (ld k), read transposed; D = dw[g]: n x k (ld n).
  c.op_a = CUBLAS_OP_N;
  c.a = {Dim::kN, Dim::kM, Dim::kN};
  c.op_b = CUBLAS_OP_T;
  c.b = {Dim::kK, Dim::kM, Dim::kK};
  c.d = {Dim::kN, Dim::kK, Dim::kN};
  c.avg_d_rows = Clamp32(p.n);
  c.avg_d_cols = Clamp32(p.k);
  c.avg_reduction = Clamp32(p.rows / p.groups);
  auto chunks = EmptyGroupChunks(kOp, p.groups, p.k, p.n);
  if (chunks.has_error()) return chunks.error();
  if (auto e = LaunchSetup(kOp, s, stream); e.failure()) return e;
  if (auto e = Execute(state, device, c, stream); e.failure()) return e;
  return ZeroEmptyGroups(stream, dw->typed_data(), s.m, p.groups, p.k, p.n, *chunks,
                         "grouped_gemm_wgrad (cuBLASLt) empty-group zeroing kernel");
}

ffi::ErrorOr<std::unique_ptr<GroupedLtState>> GroupedLtInstantiate() {
  return std::make_unique<GroupedLtState>();
}

}  // namespace
}  // namespace jaxops::grouped_gemm

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmLtInstantiateCuda,
                              jaxops::grouped_gemm::GroupedLtInstantiate,
                              ffi::Ffi::BindInstantiate());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    GroupedGemmLtCuda, jaxops::grouped_gemm::ForwardLtDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()                 // stream: the XLA stream
        .Ctx<ffi::State<jaxops::grouped_gemm::GroupedLtState>>()  // state: this call site's plans
        .Ctx<ffi::DeviceOrdinal>()                                // device: which plan
        .Arg<ffi::AnyBuffer>()                                    // x [R, K]
        .Arg<ffi::AnyBuffer>()                                    // w [G, K, N] | [G, N, K]
        .Arg<ffi::Buffer<ffi::S32>>()                             // group_sizes [G]
        .Ret<ffi::Buffer<ffi::F32>>()                             // y [R, N]
        .Ret<ffi::AnyBuffer>()                                    // workspace u8 [W]
        .Attr<bool>("transpose_w")                                // w is [G, N, K]
        .Attr<bool>("zero_tail"),                                 // zeros past the groups' rows
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    GroupedGemmWgradLtCuda, jaxops::grouped_gemm::WgradLtDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()                 // stream: the XLA stream
        .Ctx<ffi::State<jaxops::grouped_gemm::GroupedLtState>>()  // state: this call site's plans
        .Ctx<ffi::DeviceOrdinal>()                                // device: which plan
        .Arg<ffi::AnyBuffer>()                                    // x [R, K]
        .Arg<ffi::AnyBuffer>()                                    // dy [R, N]
        .Arg<ffi::Buffer<ffi::S32>>()                             // group_sizes [G]
        .Ret<ffi::Buffer<ffi::F32>>()                             // dw [G, K, N]
        .Ret<ffi::AnyBuffer>(),                                   // workspace u8 [W]
    {ffi::Traits::kCmdBufferCompatible});
