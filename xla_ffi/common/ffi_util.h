// Host-side helpers for FFI handlers of every op family (CPU and CUDA dispatch code): errors,
// shapes of buffers, and SwitchFloat, the one switch from a float dtype to a storage type.
#ifndef JAXOPS_XLA_FFI_COMMON_FFI_UTIL_H_
#define JAXOPS_XLA_FFI_COMMON_FFI_UTIL_H_

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxops {

namespace ffi = xla::ffi;

inline ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, message);
}

inline ffi::Error Internal(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInternal, message);
}

inline const char* DataTypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::F64:
      return "float64";
    case ffi::DataType::F8E4M3FN:
      return "float8_e4m3fn";
    case ffi::DataType::F8E5M2:
      return "float8_e5m2";
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    default:
      return "an unsupported dtype";
  }
}

// Size of the last dimension, or 0 for a rank-0 buffer.
inline int64_t LastDim(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  return dims.size() == 0 ? 0 : dims.back();
}

inline int64_t ElementCount(const ffi::AnyBuffer& buffer) {
  return static_cast<int64_t>(buffer.element_count());
}

// Product of all but the last dimension (the "rows" of a row-wise op).
inline int64_t LeadingCount(const ffi::AnyBuffer& buffer) {
  int64_t rows = 1;
  auto dims = buffer.dimensions();
  for (size_t i = 0; i + 1 < dims.size(); ++i) rows *= dims[i];
  return rows;
}

inline bool SameShape(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  auto da = a.dimensions();
  auto db = b.dimensions();
  if (da.size() != db.size()) return false;
  for (size_t i = 0; i < da.size(); ++i) {
    if (da[i] != db[i]) return false;
  }
  return true;
}

// "[d0, d1, ...]" of an ffi::AnyBuffer or ffi::Buffer<T>, for error messages.
template <typename BufferT>
inline std::string ShapeString(const BufferT& b) {
  std::string s = "[";
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// The failure of a Check* function that returns an ErrorOr.
inline ffi::Unexpected<ffi::Error> Bad(const std::string& message) {
  return ffi::Unexpected<ffi::Error>(InvalidArgument(message));
}

// ---------------------------------------------------------------------------------------------
// Dtype dispatch.

template <typename T>
struct TypeTag {
  using type = T;
};

// The error of an operand that must be float32, bfloat16 or float16 but has another dtype.
inline ffi::Error UnsupportedFloatDtype(const char* op, const char* operand, ffi::DataType dtype) {
  return InvalidArgument(std::string(op) + ": " + operand +
                         " dtype must be float32, bfloat16 or float16, got " + DataTypeName(dtype));
}

// The one place where a float dtype becomes a template argument, for the CPU and the CUDA
// dispatch alike (each names its storage types: F32, BF16 and F16 for float32, bfloat16 and
// float16): returns fn(TypeTag<F32>{}), fn(TypeTag<BF16>{}) or fn(TypeTag<F16>{}), and for any
// other dtype fail(UnsupportedFloatDtype(op, operand, dtype)), which turns the error into fn's
// return type. See DispatchFloat in cuda_util.cuh and cpu_dispatch.h.
template <typename F32, typename BF16, typename F16, typename Fn, typename Fail>
auto SwitchFloat(const char* op, const char* operand, ffi::DataType dtype, Fn&& fn, Fail&& fail)
    -> decltype(fn(TypeTag<F32>{})) {
  switch (dtype) {
    case ffi::DataType::F32:
      return fn(TypeTag<F32>{});
    case ffi::DataType::BF16:
      return fn(TypeTag<BF16>{});
    case ffi::DataType::F16:
      return fn(TypeTag<F16>{});
    default:
      return fail(UnsupportedFloatDtype(op, operand, dtype));
  }
}

}  // namespace jaxops

#endif  // JAXOPS_XLA_FFI_COMMON_FFI_UTIL_H_
