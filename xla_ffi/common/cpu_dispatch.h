// The dtype switch of the CPU handlers: ffi_util.h's SwitchFloat with host_float.h's storage
// types, completing through an ffi::Future as the CPU handlers do.
#ifndef JAXOPS_XLA_FFI_COMMON_CPU_DISPATCH_H_
#define JAXOPS_XLA_FFI_COMMON_CPU_DISPATCH_H_

#include <utility>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/cpu_parallel.h"
#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/common/host_float.h"

namespace jaxops {

// Returns fn(TypeTag<X>{}) (an ffi::Future) for a float32, bfloat16 or float16 dtype, with
// X = float, BFloat16 or Float16; any other dtype gives a ready future with an InvalidArgument
// error naming the supported ones.
template <typename Fn>
ffi::Future DispatchFloat(const char* op, const char* operand, ffi::DataType dtype, Fn&& fn) {
  return SwitchFloat<float, BFloat16, Float16>(
      op, operand, dtype, fn, [](ffi::Error error) { return ReadyFuture(std::move(error)); });
}

}  // namespace jaxops

#endif  // JAXOPS_XLA_FFI_COMMON_CPU_DISPATCH_H_
