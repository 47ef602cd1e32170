// Pieces shared by the nanobind modules of every platform.
#ifndef JAXOPS_XLA_FFI_MODULE_COMMON_H_
#define JAXOPS_XLA_FFI_MODULE_COMMON_H_

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <tuple>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace jaxops {

namespace nb = nanobind;

// One FFI target of a module: its name, the handler as a PyCapsule for jax.ffi.register_ffi_target,
// and whether it has state (instantiate stage) and must be registered once a backend exists.
using Registration = std::tuple<std::string, nb::capsule, bool>;

inline Registration Register(const char* name, XLA_FFI_Handler* handler, bool stateful = false) {
  return {name, nb::capsule(reinterpret_cast<void*>(handler)), stateful};
}

// What the module was built against, for the import-time compatibility check.
inline nb::dict BuildInfo(const char* platform) {
  nb::dict info;
  info["platform"] = platform;
  info["jaxlib_version"] = JAXOPS_JAXLIB_VERSION;
  info["ffi_api_major"] = XLA_FFI_API_MAJOR;
  info["ffi_api_minor"] = XLA_FFI_API_MINOR;
  return info;
}

}  // namespace jaxops

#endif  // JAXOPS_XLA_FFI_MODULE_COMMON_H_
