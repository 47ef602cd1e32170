// CUDA handlers of the GEMM family on cuBLASLt (contracts in checks.h, layout in gemm.h).
//
// Every call site gets a GemmState at instantiation (the FFI instantiate stage). On its first
// execution on a device it creates that device's cuBLASLt handle, matmul descriptor and matrix
// layouts and asks cuBLASLt's heuristic for the best algorithm; later executions only set the
// buffer pointers and enqueue the matmul. Everything is released with the executable.
//
// Command buffers: the handlers are kCmdBufferCompatible. cublasLtMatmul is capturable when it is
// given its workspace, and the workspace is an XLA-allocated result buffer (not the FFI scratch
// allocator, whose memory is released when the handler returns and would leave a captured graph
// pointing at freed memory). Nothing synchronizes with the host.
#include "xla_ffi/common/cuda_util.cuh"

// clang-format off
#include <cublasLt.h>
// clang-format on

#include <cstdint>
#include <memory>
#include <string>

#include "xla_ffi/common/cuda_plans.h"
#include "xla_ffi/gemm/checks.h"
#include "xla_ffi/gemm/gemm.h"
#include "xla_ffi/gemm/handlers.h"

namespace jaxops::gemm {

namespace {

ffi::Error LtError(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return ffi::Error::Success();
  return Internal(std::string(what) + " failed: " + cublasLtGetStatusString(status));
}

cudaDataType_t CudaType(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::F32:
      return CUDA_R_32F;
    case ffi::DataType::BF16:
      return CUDA_R_16BF;
    case ffi::DataType::F16:
      return CUDA_R_16F;
    case ffi::DataType::F8E4M3FN:
      return CUDA_R_8F_E4M3;
    default:  // F8E5M2: the checks admit nothing else
      return CUDA_R_8F_E5M2;
  }
}

// One cuBLASLt matmul: what is fixed per call site (shape, types, epilogue, scale modes) and the
// pointers of this execution. "first" and "second" are cuBLASLt's operands (our B and A).
struct LtCall {
  LtShape shape;
  cudaDataType_t first_type = CUDA_R_32F;
  cudaDataType_t second_type = CUDA_R_32F;
  cudaDataType_t d_type = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  bool fp8 = false;
  cublasLtMatmulMatrixScale_t first_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  cublasLtMatmulMatrixScale_t second_scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  const void* first = nullptr;
  const void* second = nullptr;
  void* d = nullptr;
  const void* bias = nullptr;  // bias (input) or bias gradient (output), d's type
  void* aux = nullptr;         // pre-activation output, d's type
  const void* first_scale = nullptr;
  const void* second_scale = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

template <typename T>
ffi::Error SetDesc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  return LtError(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)),
                 "cublasLtMatmulDescSetAttribute");
}

template <typename T>
ffi::Error SetPref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                   const T& value) {
  return LtError(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)),
                 "cublasLtMatmulPreferenceSetAttribute");
}

// The cuBLASLt objects of one call site on one device.
class Plan {
 public:
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (d_) cublasLtMatrixLayoutDestroy(d_);
    if (second_) cublasLtMatrixLayoutDestroy(second_);
    if (first_) cublasLtMatrixLayoutDestroy(first_);
    if (desc_) cublasLtMatmulDescDestroy(desc_);
    if (handle_) cublasLtDestroy(handle_);
  }

  // Creates the handle, the descriptor with its per-call-site attributes and the layouts.
  ffi::Error Create(const LtCall& call) {
    const LtShape& s = call.shape;
    if (auto e = LtError(cublasLtCreate(&handle_), "cublasLtCreate"); e.failure()) return e;
    if (auto e = LtError(cublasLtMatmulDescCreate(&desc_, call.compute, CUDA_R_32F),
                         "cublasLtMatmulDescCreate");
        e.failure()) {
      return e;
    }
    const cublasOperation_t op_first = s.trans_first ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_second = s.trans_second ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (auto e = SetDesc(desc_, CUBLASLT_MATMUL_DESC_TRANSA, op_first); e.failure()) return e;
    if (auto e = SetDesc(desc_, CUBLASLT_MATMUL_DESC_TRANSB, op_second); e.failure()) return e;
    if (auto e = SetDesc(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE, call.epilogue); e.failure()) {
      return e;
    }
    if (call.bias != nullptr) {
      if (auto e = SetDesc(desc_, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, call.d_type); e.failure()) {
        return e;
      }
    }
    if (call.aux != nullptr) {
      const int64_t aux_ld = s.d_ld;
      if (auto e = SetDesc(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, aux_ld); e.failure()) {
        return e;
      }
      if (auto e = SetDesc(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, call.d_type);
          e.failure()) {
        return e;
      }
    }
    if (call.fp8) {
      // Block scaling takes no fast accumulation; per-tensor scaling keeps the accurate mode too.
      const int8_t fast_accum = 0;
      if (auto e = SetDesc(desc_, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accum); e.failure()) {
        return e;
      }
      if (auto e = SetDesc(desc_, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, call.first_scale_mode);
          e.failure()) {
        return e;
      }
      if (auto e = SetDesc(desc_, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, call.second_scale_mode);
          e.failure()) {
        return e;
      }
    }
    if (auto e = LtError(cublasLtMatrixLayoutCreate(&first_, call.first_type, s.first_rows,
                                                    s.first_cols, s.first_ld),
                         "cublasLtMatrixLayoutCreate");
        e.failure()) {
      return e;
    }
    if (auto e = LtError(cublasLtMatrixLayoutCreate(&second_, call.second_type, s.second_rows,
                                                    s.second_cols, s.second_ld),
                         "cublasLtMatrixLayoutCreate");
        e.failure()) {
      return e;
    }
    return LtError(cublasLtMatrixLayoutCreate(&d_, call.d_type, s.d_rows, s.d_cols, s.d_ld),
                   "cublasLtMatrixLayoutCreate");
  }

  // Sets this execution's pointers, (re)chooses the algorithm if the buffers are less aligned
  // than the one chosen assumed, and enqueues the matmul.
  ffi::Error Run(const LtCall& call, cudaStream_t stream) {
    if (call.bias != nullptr) {
      if (auto e = SetDesc(desc_, CUBLASLT_MATMUL_DESC_BIAS_POINTER, call.bias); e.failure()) {
        return e;
      }
    }
    if (call.aux != nullptr) {
      if (auto e = SetDesc(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, call.aux);
          e.failure()) {
        return e;
      }
    }
    if (call.fp8) {
      if (auto e = SetDesc(desc_, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, call.first_scale);
          e.failure()) {
        return e;
      }
      if (auto e = SetDesc(desc_, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, call.second_scale);
          e.failure()) {
        return e;
      }
    }
    const int32_t align_first = AddressAlignment(call.first);
    const int32_t align_second = AddressAlignment(call.second);
    const int32_t align_d = AddressAlignment(call.d);
    if (!chosen_ || align_first < align_first_ || align_second < align_second_ ||
        align_d < align_d_ || call.workspace_bytes < workspace_bytes_) {
      if (auto e = Choose(call, align_first, align_second, align_d); e.failure()) return e;
    }
    const float alpha = 1.0f;
    const float beta = 0.0f;
    return LtError(cublasLtMatmul(handle_, desc_, &alpha, call.first, first_, call.second, second_,
                                  &beta, call.d, d_, call.d, d_, &algo_, call.workspace,
                                  call.workspace_bytes, stream),
                   "cublasLtMatmul");
  }

 private:
  ffi::Error Choose(const LtCall& call, int32_t align_first, int32_t align_second,
                    int32_t align_d) {
    cublasLtMatmulPreference_t pref = nullptr;
    if (auto e = LtError(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
        e.failure()) {
      return e;
    }
    const uint64_t workspace = call.workspace_bytes;
    const uint32_t a_align = static_cast<uint32_t>(align_first);
    const uint32_t b_align = static_cast<uint32_t>(align_second);
    const uint32_t d_align = static_cast<uint32_t>(align_d);
    cublasLtMatmulHeuristicResult_t result = {};
    int found = 0;
    ffi::Error error = SetPref(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace);
    if (error.success()) error = SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a_align);
    if (error.success()) error = SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b_align);
    if (error.success()) error = SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, d_align);
    if (error.success()) error = SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, d_align);
    if (error.success()) {
      error = LtError(cublasLtMatmulAlgoGetHeuristic(handle_, desc_, first_, second_, d_, d_, pref,
                                                     1, &result, &found),
                      "cublasLtMatmulAlgoGetHeuristic");
    }
    cublasLtMatmulPreferenceDestroy(pref);
    if (error.failure()) return error;
    if (found == 0) {
      const LtShape& s = call.shape;
      return Internal(
          "cuBLASLt has no algorithm for this GEMM (column-major m=" + std::to_string(s.m) +
          " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k) + ", epilogue " +
          std::to_string(static_cast<int>(call.epilogue)) + ") on this device");
    }
    algo_ = result.algo;
    chosen_ = true;
    align_first_ = align_first;
    align_second_ = align_second;
    align_d_ = align_d;
    workspace_bytes_ = call.workspace_bytes;
    return ffi::Error::Success();
  }

  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t first_ = nullptr;
  cublasLtMatrixLayout_t second_ = nullptr;
  cublasLtMatrixLayout_t d_ = nullptr;
  cublasLtMatmulAlgo_t algo_ = {};
  bool chosen_ = false;
  int32_t align_first_ = 0;
  int32_t align_second_ = 0;
  int32_t align_d_ = 0;
  size_t workspace_bytes_ = 0;
};

}  // namespace

// Per call site: one plan per device, created on the first execution there.
struct GemmState {
  static ffi::TypeId id;
  DevicePlans<Plan> plans;
};
ffi::TypeId GemmState::id = {};

XLA_FFI_TypeId* GemmStateTypeId() { return &GemmState::id; }

const XLA_FFI_TypeInfo* GemmStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<GemmState>();
  return &info;
}

namespace {

// Runs `call` with this call site's plan for `device` (creating it on first use).
ffi::Error Execute(GemmState* state, int32_t device, const LtCall& call, cudaStream_t stream) {
  return state->plans.Run(device, call, stream);
}

cublasComputeType_t ComputeType(ffi::DataType dtype, int32_t precision) {
  if (dtype != ffi::DataType::F32) return CUBLAS_COMPUTE_32F;
  switch (static_cast<Precision>(precision)) {
    case Precision::kTf32:
      return CUBLAS_COMPUTE_32F_FAST_TF32;
    case Precision::kBf16:
      return CUBLAS_COMPUTE_32F_FAST_16BF;
    default:
      return CUBLAS_COMPUTE_32F;
  }
}

cublasLtEpilogue_t Epilogue(Activation activation, bool bias, bool aux, bool bias_grad) {
  if (bias_grad) return CUBLASLT_EPILOGUE_BGRADA;
  switch (activation) {
    case Activation::kRelu:
      return bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
    case Activation::kGeluTanh:
      if (aux) return bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
      return bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
    default:
      return bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  }
}

cublasLtMatmulMatrixScale_t LtScaleMode(ScaleMode mode) {
  switch (mode) {
    case ScaleMode::kRows:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case ScaleMode::kTiles:
      return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    default:
      return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  }
}

ffi::Error GemmDispatch(cudaStream_t stream, GemmState* state, int32_t device, ffi::AnyBuffer a,
                        ffi::AnyBuffer b, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> d,
                        ffi::Result<ffi::AnyBuffer> aux, ffi::Result<ffi::AnyBuffer> bias_grad,
                        ffi::Result<ffi::AnyBuffer> workspace, bool transpose_a, bool transpose_b,
                        int32_t activation_attr, int32_t precision) {
  auto activation = CheckActivation(activation_attr);
  if (activation.has_error()) return activation.error();
  auto problem =
      CheckGemm(a, b, bias, *d, *aux, *bias_grad, transpose_a, transpose_b, *activation, precision);
  if (problem.has_error()) return problem.error();
  const Problem& p = *problem;
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) return InvalidArgument("jaxops_gemm: K must be > 0 (the wrappers handle K = 0)");
  const bool with_bias = bias.element_count() > 0;
  const bool with_aux = aux->element_count() > 0;
  const bool with_bias_grad = bias_grad->element_count() > 0;
  LtCall call;
  call.shape = ToColumnMajor(p);
  call.first_type = call.second_type = call.d_type = CudaType(a.element_type());
  call.compute = ComputeType(a.element_type(), precision);
  call.epilogue = Epilogue(*activation, with_bias, with_aux, with_bias_grad);
  call.first = b.untyped_data();
  call.second = a.untyped_data();
  call.d = d->untyped_data();
  call.bias =
      with_bias_grad ? bias_grad->untyped_data() : (with_bias ? bias.untyped_data() : nullptr);
  call.aux = with_aux ? aux->untyped_data() : nullptr;
  call.workspace = workspace->untyped_data();
  call.workspace_bytes = workspace->size_bytes();
  return Execute(state, device, call, stream);
}

ffi::Error GemmFp8Dispatch(cudaStream_t stream, GemmState* state, int32_t device, ffi::AnyBuffer a,
                           ffi::AnyBuffer b, ffi::AnyBuffer a_scale, ffi::AnyBuffer b_scale,
                           ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> d,
                           ffi::Result<ffi::AnyBuffer> workspace, int32_t a_scale_mode,
                           int32_t b_scale_mode, int32_t activation_attr) {
  auto activation = CheckActivation(activation_attr);
  if (activation.has_error()) return activation.error();
  auto a_mode = CheckScaleMode("a_scale_mode", a_scale_mode);
  if (a_mode.has_error()) return a_mode.error();
  auto b_mode = CheckScaleMode("b_scale_mode", b_scale_mode);
  if (b_mode.has_error()) return b_mode.error();
  auto problem = CheckGemmFp8(a, b, a_scale, b_scale, bias, *d, *a_mode, *b_mode);
  if (problem.has_error()) return problem.error();
  const Problem& p = *problem;
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) return InvalidArgument("jaxops_gemm_fp8: K must be > 0");
  const bool with_bias = bias.element_count() > 0;
  LtCall call;
  call.shape = ToColumnMajor(p);
  call.first_type = CudaType(b.element_type());
  call.second_type = CudaType(a.element_type());
  call.d_type = CudaType(d->element_type());
  call.compute = CUBLAS_COMPUTE_32F;
  call.epilogue = Epilogue(*activation, with_bias, /*aux=*/false, /*bias_grad=*/false);
  call.fp8 = true;
  call.first_scale_mode = LtScaleMode(*b_mode);  // cuBLASLt's A is our b
  call.second_scale_mode = LtScaleMode(*a_mode);
  call.first = b.untyped_data();
  call.second = a.untyped_data();
  call.first_scale = b_scale.untyped_data();
  call.second_scale = a_scale.untyped_data();
  call.d = d->untyped_data();
  call.bias = with_bias ? bias.untyped_data() : nullptr;
  call.workspace = workspace->untyped_data();
  call.workspace_bytes = workspace->size_bytes();
  return Execute(state, device, call, stream);
}

ffi::ErrorOr<std::unique_ptr<GemmState>> GemmInstantiate() { return std::make_unique<GemmState>(); }

}  // namespace
}  // namespace jaxops::gemm

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmInstantiateCuda, jaxops::gemm::GemmInstantiate,
                              ffi::Ffi::BindInstantiate());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    GemmCuda, jaxops::gemm::GemmDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()    // stream: the XLA compute stream
        .Ctx<ffi::State<jaxops::gemm::GemmState>>()  // state: plans of this call site
        .Ctx<ffi::DeviceOrdinal>()                   // device: which plan
        .Arg<ffi::AnyBuffer>()                       // a [M, K] | [K, M]
        .Arg<ffi::AnyBuffer>()                       // b [K, N] | [N, K]
        .Arg<ffi::AnyBuffer>()                       // bias [N] | [0]
        .Ret<ffi::AnyBuffer>()                       // d [M, N]
        .Ret<ffi::AnyBuffer>()                       // aux [M, N] | [0]
        .Ret<ffi::AnyBuffer>()                       // bias_grad [N] | [0]
        .Ret<ffi::AnyBuffer>()                       // workspace u8 [W]
        .Attr<bool>("transpose_a")                   // a holds A^T
        .Attr<bool>("transpose_b")                   // b holds B^T
        .Attr<int32_t>("activation")                 // gemm::Activation
        .Attr<int32_t>("precision"),                 // gemm::Precision (f32 only)
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    GemmFp8Cuda, jaxops::gemm::GemmFp8Dispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()    // stream: the XLA compute stream
        .Ctx<ffi::State<jaxops::gemm::GemmState>>()  // state: plans of this call site
        .Ctx<ffi::DeviceOrdinal>()                   // device: which plan
        .Arg<ffi::AnyBuffer>()                       // a fp8 [M, K]
        .Arg<ffi::AnyBuffer>()                       // b fp8 [N, K]
        .Arg<ffi::AnyBuffer>()                       // a_scale f32
        .Arg<ffi::AnyBuffer>()                       // b_scale f32
        .Arg<ffi::AnyBuffer>()                       // bias [N] | [0]
        .Ret<ffi::AnyBuffer>()                       // d [M, N] bf16 | f16
        .Ret<ffi::AnyBuffer>()                       // workspace u8 [W]
        .Attr<int32_t>("a_scale_mode")               // gemm::ScaleMode of a
        .Attr<int32_t>("b_scale_mode")               // gemm::ScaleMode of b
        .Attr<int32_t>("activation"),                // gemm::Activation
    {ffi::Traits::kCmdBufferCompatible});
