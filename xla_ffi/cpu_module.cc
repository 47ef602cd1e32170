// The CPU nanobind module: exports every CPU FFI handler of jaxops.
#include "xla_ffi/fp8/handlers.h"
#include "xla_ffi/module_common.h"
#include "xla_ffi/moe/handlers.h"
#include "xla_ffi/rms_norm/handlers.h"

namespace jaxops {
namespace {

std::vector<Registration> Registrations() {
  return {
      Register("jaxops_rms_norm_fwd", RmsNormFwdCpu),
      Register("jaxops_add_rms_norm_fwd", AddRmsNormFwdCpu),
      Register("jaxops_rms_norm_bwd", RmsNormBwdCpu),
      Register("jaxops_fp8_quantize", Fp8QuantizeCpu),
      Register("jaxops_fp8_amax", Fp8AmaxCpu),
      Register("jaxops_fp8_quantize_split_transpose", Fp8QuantizeSplitTransposeCpu),
      Register("jaxops_moe_route", MoeRouteCpu),
      Register("jaxops_moe_permute", MoePermuteCpu),
      Register("jaxops_moe_unpermute", MoeUnpermuteCpu),
      Register("jaxops_moe_unpermute_bwd", MoeUnpermuteBwdCpu),
  };
}

}  // namespace
}  // namespace jaxops

NB_MODULE(_jaxops_cpu, m) {
  m.doc() = "jaxops CPU FFI handlers";
  m.def("registrations", &jaxops::Registrations,
        "List of (target name, handler capsule, stateful) for the CPU platform.");
  m.def(
      "types", [] { return std::vector<jaxops::TypeRegistration>{}; },
      "List of (type name, jax.ffi.register_ffi_type registration): none on CPU.");
  m.def("build_info", [] { return jaxops::BuildInfo("cpu"); });
}
