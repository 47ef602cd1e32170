// Memory hints for large CPU outputs, and typed views of FFI buffers for CPU kernels.
#ifndef JAXOPS_XLA_FFI_COMMON_CPU_MEMORY_H_
#define JAXOPS_XLA_FFI_COMMON_CPU_MEMORY_H_

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxops {

// XLA:CPU hands large results out as fresh memory, so writing them first costs one page fault
// per 4 KiB page, which on small machines costs as much as the kernel itself. Asking for
// transparent huge pages on the 2 MiB-aligned interior of a large output (before the first
// write) cuts that 512-fold. Advisory only: failure or an already-populated buffer is harmless.
inline void AdviseHugePages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 4 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

// Typed views of FFI buffers for CPU kernels.
template <typename X>
const X* In(const xla::ffi::AnyBuffer& b) {
  return static_cast<const X*>(b.untyped_data());
}

// A large output about to be written for the first time (hinted for huge pages).
template <typename T>
T* Out(xla::ffi::Result<xla::ffi::AnyBuffer>& b) {
  AdviseHugePages(b->untyped_data(), b->size_bytes());
  return static_cast<T*>(b->untyped_data());
}

}  // namespace jaxops

#endif  // JAXOPS_XLA_FFI_COMMON_CPU_MEMORY_H_
