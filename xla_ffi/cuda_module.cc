// The CUDA nanobind module: exports every CUDA FFI handler of jaxops. Compiled by the host
// compiler; the handlers themselves live in the .cu files (see handlers.h of each family).
#include "xla_ffi/fp8/handlers.h"
#include "xla_ffi/grouped_gemm/handlers.h"
#ifdef JAXOPS_HAVE_CUBLASLT
#include "xla_ffi/gemm/handlers.h"
#endif
#include "xla_ffi/module_common.h"
#include "xla_ffi/moe/handlers.h"
#include "xla_ffi/rms_norm/handlers.h"

namespace jaxops {
namespace {

std::vector<Registration> Registrations() {
  std::vector<Registration> registrations = {
      Register("jaxops_rms_norm_fwd", RmsNormFwdCuda),
      Register("jaxops_add_rms_norm_fwd", AddRmsNormFwdCuda),
      Register("jaxops_rms_norm_bwd", RmsNormBwdCuda),
      Register("jaxops_fp8_quantize", Fp8QuantizeCuda),
      Register("jaxops_fp8_amax", Fp8AmaxCuda),
      Register("jaxops_fp8_quantize_split_transpose", Fp8QuantizeSplitTransposeCuda),
      Register("jaxops_moe_route", MoeRouteCuda),
      Register("jaxops_moe_permute", MoePermuteCuda),
      Register("jaxops_moe_unpermute", MoeUnpermuteCuda),
      Register("jaxops_moe_unpermute_bwd", MoeUnpermuteBwdCuda),
      Register("jaxops_grouped_gemm", GroupedGemmCuda),
      Register("jaxops_grouped_gemm_wgrad", GroupedGemmWgradCuda),
  };
#ifdef JAXOPS_HAVE_CUBLASLT
  registrations.push_back(RegisterStateful("jaxops_gemm", GemmInstantiateCuda, GemmCuda));
  registrations.push_back(RegisterStateful("jaxops_gemm_fp8", GemmInstantiateCuda, GemmFp8Cuda));
  registrations.push_back(
      RegisterStateful("jaxops_grouped_gemm_lt", GroupedGemmLtInstantiateCuda, GroupedGemmLtCuda));
  registrations.push_back(RegisterStateful("jaxops_grouped_gemm_wgrad_lt",
                                           GroupedGemmLtInstantiateCuda, GroupedGemmWgradLtCuda));
#endif
#ifdef JAXOPS_HAVE_CUTLASS
  registrations.push_back(Register("jaxops_grouped_gemm_cutlass", GroupedGemmCutlassCuda));
  registrations.push_back(
      Register("jaxops_grouped_gemm_wgrad_cutlass", GroupedGemmWgradCutlassCuda));
  registrations.push_back(Register("jaxops_grouped_gemm_fp8_cutlass", GroupedGemmFp8CutlassCuda));
  registrations.push_back(
      Register("jaxops_grouped_gemm_fp8_wgrad_cutlass", GroupedGemmFp8WgradCutlassCuda));
#endif
  return registrations;
}

std::vector<TypeRegistration> Types() {
#ifdef JAXOPS_HAVE_CUBLASLT
  return {
      RegisterType(gemm::kStateTypeName, gemm::GemmStateTypeId(), gemm::GemmStateTypeInfo()),
      RegisterType(grouped_gemm::kLtStateTypeName, grouped_gemm::GroupedLtStateTypeId(),
                   grouped_gemm::GroupedLtStateTypeInfo()),
  };
#else
  return {};
#endif
}

}  // namespace
}  // namespace jaxops

NB_MODULE(_jaxops_cuda, m) {
  m.doc() = "jaxops CUDA FFI handlers";
  m.def("registrations", &jaxops::Registrations,
        "List of (target name, handler capsule or stage dict, stateful) for the CUDA platform.");
#ifdef JAXOPS_HAVE_CUBLASLT
  m.def("grouped_gemm_lt_workspace_bytes", &jaxops::grouped_gemm::LtWorkspaceBytes,
        "Bytes of the cuBLASLt grouped GEMM handlers' workspace for a number of groups.");
#endif
#ifdef JAXOPS_HAVE_CUTLASS
  m.def("grouped_gemm_cutlass_workspace_bytes", &jaxops::grouped_gemm::CutlassWorkspaceBytes,
        "Bytes of the CUTLASS grouped GEMM handlers' workspace for a number of groups.");
  m.def("grouped_gemm_fp8_cutlass_workspace_bytes", &jaxops::grouped_gemm::CutlassFp8WorkspaceBytes,
        "Bytes of the CUTLASS block-scaled FP8 grouped GEMM handlers' workspace for a number of "
        "groups.");
#endif
  m.def("types", &jaxops::Types,
        "List of (type name, jax.ffi.register_ffi_type registration) of the handlers' state.");
  m.def("build_info", [] {
    nanobind::dict info = jaxops::BuildInfo("CUDA");
    info["cuda_version"] = JAXOPS_CUDA_VERSION;
    info["cuda_architectures"] = JAXOPS_CUDA_ARCHITECTURES;
#ifdef JAXOPS_HAVE_CUBLASLT
    info["cublaslt"] = JAXOPS_CUBLASLT_SOURCE;
    info["cublaslt_version"] = jaxops::grouped_gemm::LtVersion();
    info["cublaslt_grouped"] = jaxops::grouped_gemm::LtGroupedAvailable();
#else
    info["cublaslt"] = nanobind::none();
    info["cublaslt_version"] = nanobind::none();
    info["cublaslt_grouped"] = false;
#endif
#ifdef JAXOPS_HAVE_CUTLASS
    info["cutlass"] = jaxops::grouped_gemm::CutlassVersion();
#else
    info["cutlass"] = nanobind::none();
#endif
    return info;
  });
}
