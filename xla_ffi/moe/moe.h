// MoE token permutation: the layout arithmetic shared by host (g++) and device (nvcc) code.
//
// A routing assigns each of T tokens to K expert slots: expert_ids[t, k] in [0, E) (anything
// else, -1 included, is an unused slot). Slot s = t * K + k. The permuted layout groups the used
// slots by expert in ascending expert order and, within an expert, in slot order (token order,
// then k), so it is deterministic. Expert e keeps its first min(n_e, capacity) slots (capacity < 0:
// no limit) and drops the rest; its group is padded with zero rows to a multiple of `align`:
//   group_size[e]   = RoundUp(min(n_e, capacity), align)
//   group_offset[e] = sum of group_size[0 .. e)
//   row of slot s   = group_offset[e] + (number of earlier slots of expert e), if kept
// The permuted tensor has the static worst-case row count PermutedRows(T * K, E, align, capacity);
// rows from group_offset[E] (num_rows) on are zero.
#ifndef JAXOPS_XLA_FFI_MOE_MOE_H_
#define JAXOPS_XLA_FFI_MOE_MOE_H_

#include <cstdint>

#include "xla_ffi/common/math.h"

namespace jaxops::moe {

// Largest supported `align` (rows of zero padding per expert are at most align - 1).
inline constexpr int64_t kMaxAlign = 4096;
// Row and slot indices are int32: every count stays below this.
inline constexpr int64_t kMaxRows = (int64_t{1} << 31) - 1;
// No capacity limit.
inline constexpr int64_t kNoCapacity = -1;

JAXOPS_HOST_DEVICE int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

JAXOPS_HOST_DEVICE bool IsExpert(int32_t e, int64_t experts) { return e >= 0 && e < experts; }

// Slots expert e keeps out of `count` routed to it.
JAXOPS_HOST_DEVICE int64_t KeptSlots(int64_t count, int64_t capacity) {
  return capacity < 0 || count < capacity ? count : capacity;
}

// Rows of expert e's group: its kept slots padded to a multiple of align (0 stays 0).
JAXOPS_HOST_DEVICE int64_t GroupRows(int64_t count, int64_t capacity, int64_t align) {
  return RoundUp(KeptSlots(count, capacity), align);
}

// The static row count of the permuted tensor: every possible routing fits.
//   no capacity:   slots + E * (align - 1)
//   capacity C:    min(that, E * RoundUp(min(C, slots), align))
JAXOPS_HOST_DEVICE int64_t PermutedRows(int64_t slots, int64_t experts, int64_t align,
                                        int64_t capacity) {
  const int64_t rows = slots + experts * (align - 1);
  if (capacity < 0) return rows;
  const int64_t per_expert = RoundUp(capacity < slots ? capacity : slots, align);
  const int64_t capped = experts * per_expert;
  return capped < rows ? capped : rows;
}

}  // namespace jaxops::moe

#endif  // JAXOPS_XLA_FFI_MOE_MOE_H_
