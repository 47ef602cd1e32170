// Handler symbols of the MoE permutation family, defined in cpu.cc and cuda.cu and exported to
// Python by the nanobind modules. Names follow the chain C++ handler <-> FFI target <-> Python
// constant:
//   MoeRoute        <-> "jaxops_moe_route"         <-> jaxops._moe.TARGET_ROUTE
//   MoePermute      <-> "jaxops_moe_permute"       <-> jaxops._moe.TARGET_PERMUTE
//   MoeUnpermute    <-> "jaxops_moe_unpermute"     <-> jaxops._moe.TARGET_UNPERMUTE
//   MoeUnpermuteBwd <-> "jaxops_moe_unpermute_bwd" <-> jaxops._moe.TARGET_UNPERMUTE_BWD
#ifndef JAXOPS_XLA_FFI_MOE_HANDLERS_H_
#define JAXOPS_XLA_FFI_MOE_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

// extern "C" symbols, so they live in the global namespace.
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeRouteCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoePermuteCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeUnpermuteCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeUnpermuteBwdCpu);

XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeRouteCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoePermuteCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeUnpermuteCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeUnpermuteBwdCuda);

#endif  // JAXOPS_XLA_FFI_MOE_HANDLERS_H_
