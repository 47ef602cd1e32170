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

// One FFI target of a module: its name, the handler (a PyCapsule, or for a stateful target a dict
// of PyCapsules keyed by FFI stage) for jax.ffi.register_ffi_target, and whether it has state and
// must be registered once a backend exists.
using Registration = std::tuple<std::string, nb::object, bool>;

inline nb::capsule Capsule(XLA_FFI_Handler* handler) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

inline Registration Register(const char* name, XLA_FFI_Handler* handler) {
  return {name, Capsule(handler), false};
}

inline Registration RegisterStateful(const char* name, XLA_FFI_Handler* instantiate,
                                     XLA_FFI_Handler* execute) {
  nb::dict stages;
  stages["instantiate"] = Capsule(instantiate);
  stages["execute"] = Capsule(execute);
  return {name, stages, true};
}

// A state type of the module's handlers: its name and jax.ffi.register_ffi_type's registration.
using TypeRegistration = std::tuple<std::string, nb::dict>;

inline TypeRegistration RegisterType(const char* name, XLA_FFI_TypeId* type_id,
                                     const XLA_FFI_TypeInfo* type_info) {
  nb::dict registration;
  registration["type_id"] = nb::capsule(static_cast<void*>(type_id));
  registration["type_info"] = nb::capsule(const_cast<void*>(static_cast<const void*>(type_info)));
  return {name, registration};
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
