// The CPU nanobind module: exports every CPU FFI handler of jaxops, and the chunked CRC-32C that
// jaxops.parallel.checkpoint uses, and which grouped GEMM micro-kernel this machine runs.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "xla_ffi/checkpoint/crc32c.h"
#include "xla_ffi/fp8/handlers.h"
#include "xla_ffi/grouped_gemm/handlers.h"
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
      Register("jaxops_grouped_gemm", GroupedGemmCpu),
      Register("jaxops_grouped_gemm_wgrad", GroupedGemmWgradCpu),
      Register("jaxops_grouped_activation_fwd", GroupedActivationFwdCpu),
      Register("jaxops_grouped_activation_bwd", GroupedActivationBwdCpu),
  };
}

}  // namespace
}  // namespace jaxops

namespace nb = nanobind;

NB_MODULE(_jaxops_cpu, m) {
  m.doc() = "jaxops CPU FFI handlers";
  m.def("registrations", &jaxops::Registrations,
        "List of (target name, handler capsule, stateful) for the CPU platform.");
  m.def(
      "types", [] { return std::vector<jaxops::TypeRegistration>{}; },
      "List of (type name, jax.ffi.register_ffi_type registration): none on CPU.");
  m.def("build_info", [] { return jaxops::BuildInfo("cpu"); });
  m.def(
      "crc32c_chunks",
      [](nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> data,
         size_t chunk) {
        if (chunk == 0) throw nb::value_error("crc32c_chunks: chunk must be > 0, got 0");
        nb::gil_scoped_release release;
        return jaxops::Crc32cChunks(data.data(), data.shape(0), chunk);
      },
      nb::arg("data"), nb::arg("chunk"),
      "CRC-32C of each `chunk`-byte piece of a contiguous 1-D uint8 host array (the last piece "
      "may be shorter), as a list of ints. Releases the GIL.");
  m.def("crc32c_hardware", &jaxops::Crc32cHardware,
        "Whether crc32c_chunks uses the SSE4.2 crc32 instruction on this machine.");
  m.def(
      "grouped_gemm_kernel", [] { return std::string(jaxops::grouped_gemm::CpuKernelName()); },
      "The micro-kernel of the grouped GEMM calls on this machine: 'avx512', 'avx2' or "
      "'portable' (the widest the CPU has, at most JAXOPS_CPU_GEMM_KERNEL's).");
}
