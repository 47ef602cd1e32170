// Shape validation of the GEMM FFI handlers (cuBLASLt, CUDA only: on CPU jaxops.gemm is XLA's own
// dot, the fastest CPU GEMM here).
//
// The Python wrappers validate everything at trace time and only send problems cuBLASLt supports;
// these checks guard against anything that reaches the handlers another way, so a bad call is an
// error, never an out-of-bounds access.
//
// jaxops_gemm: D = act(op(A) @ op(B) + bias), fp32 accumulation (see gemm.h for the layout).
//   operands  a (f32 | bf16 | f16) [M, K], or [K, M] with transpose_a
//             b a's dtype [K, N], or [N, K] with transpose_b
//             bias a's dtype [N] | [0]
//   results   d a's dtype [M, N]
//             aux a's dtype [M, N] | [0]: the pre-activation (gelu_tanh only; N % 8 == 0)
//             bias_grad a's dtype [N] | [0]: sum of op(B) over its K rows (no bias, no activation)
//             workspace u8 [W] (cuBLASLt workspace, W >= 0)
//   attributes transpose_a, transpose_b, activation (gemm::Activation), precision
//             (gemm::Precision: how f32 operands are multiplied).
//
// jaxops_gemm_fp8: D = act(scale_a * scale_b * (A @ B^T) + bias) with FP8 operands, both stored
// K-major (the only FP8 layout Hopper tensor cores take), fp32 accumulation.
//   operands  a (f8e4m3fn | f8e5m2) [M, K], b (f8e4m3fn | f8e5m2) [N, K] (not both e5m2),
//             a_scale f32, b_scale f32: [] per tensor, [K/128, pad4(rows)] per 1 x 128 group
//             (rows contiguous), [rows/128, pad4(K/128)] per 128 x 128 tile (K blocks contiguous:
//             cuBLASLt's BLK128x128 layout; rows = M for a, N for b; /128 rounded up),
//             bias d's dtype [N] | [0]
//   results   d (bf16 | f16) [M, N], workspace u8 [W]
//   attributes a_scale_mode, b_scale_mode (gemm::ScaleMode; not both tiles), activation.
//   K % 16 == 0; K % 128 == 0 with block scales.
#ifndef JAXOPS_XLA_FFI_GEMM_CHECKS_H_
#define JAXOPS_XLA_FFI_GEMM_CHECKS_H_

#include <cstdint>
#include <string>

#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/gemm/gemm.h"

namespace jaxops::gemm {

inline bool Is2d(const ffi::AnyBuffer& buffer, int64_t rows, int64_t cols) {
  auto dims = buffer.dimensions();
  return dims.size() == 2 && dims[0] == rows && dims[1] == cols;
}

inline bool IsVectorOrEmpty(const ffi::AnyBuffer& buffer, int64_t size) {
  auto dims = buffer.dimensions();
  return dims.size() == 1 && (dims[0] == size || dims[0] == 0);
}

inline bool IsFloat(ffi::DataType dtype) {
  return dtype == ffi::DataType::F32 || dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16;
}

inline bool IsFp8(ffi::DataType dtype) {
  return dtype == ffi::DataType::F8E4M3FN || dtype == ffi::DataType::F8E5M2;
}

inline ffi::ErrorOr<Activation> CheckActivation(int32_t activation) {
  if (activation < 0 || activation >= kNumActivations) {
    return Bad("activation must be 0 (none), 1 (relu) or 2 (gelu_tanh), got " +
               std::to_string(activation));
  }
  return static_cast<Activation>(activation);
}

inline ffi::ErrorOr<Problem> CheckGemm(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                                       const ffi::AnyBuffer& bias, const ffi::AnyBuffer& d,
                                       const ffi::AnyBuffer& aux, const ffi::AnyBuffer& bias_grad,
                                       bool transpose_a, bool transpose_b, Activation activation,
                                       int32_t precision) {
  const ffi::DataType dtype = a.element_type();
  if (!IsFloat(dtype)) {
    return Bad(std::string("jaxops_gemm: a must be float32, bfloat16 or float16, got ") +
               DataTypeName(dtype));
  }
  for (const ffi::AnyBuffer* other : {&b, &bias, &d, &aux, &bias_grad}) {
    if (other->element_type() != dtype) {
      return Bad(std::string("jaxops_gemm: every operand and result must have a's dtype ") +
                 DataTypeName(dtype) + ", got " + DataTypeName(other->element_type()));
    }
  }
  if (a.dimensions().size() != 2 || b.dimensions().size() != 2) {
    return Bad("jaxops_gemm: a and b must be matrices, got " + ShapeString(a) + " and " +
               ShapeString(b));
  }
  Problem p;
  p.transpose_a = transpose_a;
  p.transpose_b = transpose_b;
  p.m = a.dimensions()[transpose_a ? 1 : 0];
  p.k = a.dimensions()[transpose_a ? 0 : 1];
  p.n = b.dimensions()[transpose_b ? 0 : 1];
  const int64_t b_k = b.dimensions()[transpose_b ? 1 : 0];
  if (b_k != p.k) {
    return Bad("jaxops_gemm: contraction sizes differ: a " + ShapeString(a) + " and b " +
               ShapeString(b));
  }
  if (!Is2d(d, p.m, p.n)) {
    return Bad("jaxops_gemm: d must be [" + std::to_string(p.m) + ", " + std::to_string(p.n) +
               "], got " + ShapeString(d));
  }
  if (!IsVectorOrEmpty(bias, p.n) || !IsVectorOrEmpty(bias_grad, p.n)) {
    return Bad("jaxops_gemm: bias and bias_grad must be [" + std::to_string(p.n) +
               "] or [0], got " + ShapeString(bias) + " and " + ShapeString(bias_grad));
  }
  const bool with_aux = aux.element_count() > 0;
  if (with_aux && (!Is2d(aux, p.m, p.n) || activation != Activation::kGeluTanh || p.n % 8 != 0)) {
    return Bad("jaxops_gemm: aux must be d's shape, with gelu_tanh and N % 8 == 0; got " +
               ShapeString(aux));
  }
  if (bias_grad.element_count() > 0 &&
      (bias.element_count() > 0 || activation != Activation::kNone || with_aux)) {
    return Bad("jaxops_gemm: bias_grad excludes bias, aux and activations");
  }
  if (precision < 0 || precision >= kNumPrecisions) {
    return Bad("jaxops_gemm: precision must be 0 (fp32), 1 (tf32) or 2 (bf16), got " +
               std::to_string(precision));
  }
  return p;
}

// Expected shape of an FP8 operand's scales for `rows` x `k` data.
inline bool ScaleShapeOk(const ffi::AnyBuffer& scale, ScaleMode mode, int64_t rows, int64_t k) {
  auto dims = scale.dimensions();
  if (mode == ScaleMode::kTensor) return dims.size() == 0;
  const int64_t k_blocks = CeilDiv(k, kScaleBlock);
  if (mode == ScaleMode::kRows) {
    return dims.size() == 2 && dims[0] == k_blocks && dims[1] == RoundUp(rows, 4);
  }
  return dims.size() == 2 && dims[0] == CeilDiv(rows, kScaleBlock) &&
         dims[1] == RoundUp(k_blocks, 4);
}

inline ffi::ErrorOr<ScaleMode> CheckScaleMode(const char* name, int32_t mode) {
  if (mode < 0 || mode >= kNumScaleModes) {
    return Bad(std::string("jaxops_gemm_fp8: ") + name +
               " must be 0 (tensor), 1 (1x128 rows) or 2 (128x128 tiles), got " +
               std::to_string(mode));
  }
  return static_cast<ScaleMode>(mode);
}

inline ffi::ErrorOr<Problem> CheckGemmFp8(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                                          const ffi::AnyBuffer& a_scale,
                                          const ffi::AnyBuffer& b_scale, const ffi::AnyBuffer& bias,
                                          const ffi::AnyBuffer& d, ScaleMode a_mode,
                                          ScaleMode b_mode) {
  if (!IsFp8(a.element_type()) || !IsFp8(b.element_type()) ||
      (a.element_type() == ffi::DataType::F8E5M2 && b.element_type() == ffi::DataType::F8E5M2)) {
    return Bad(std::string("jaxops_gemm_fp8: a and b must be float8_e4m3fn or float8_e5m2 (not "
                           "both e5m2), got ") +
               DataTypeName(a.element_type()) + " and " + DataTypeName(b.element_type()));
  }
  const ffi::DataType out = d.element_type();
  if (out != ffi::DataType::BF16 && out != ffi::DataType::F16) {
    return Bad(std::string("jaxops_gemm_fp8: d must be bfloat16 or float16, got ") +
               DataTypeName(out));
  }
  if (bias.element_type() != out) {
    return Bad(std::string("jaxops_gemm_fp8: bias must have d's dtype, got ") +
               DataTypeName(bias.element_type()));
  }
  if (a_scale.element_type() != ffi::DataType::F32 ||
      b_scale.element_type() != ffi::DataType::F32) {
    return Bad("jaxops_gemm_fp8: scales must be float32");
  }
  if (a.dimensions().size() != 2 || b.dimensions().size() != 2 ||
      a.dimensions()[1] != b.dimensions()[1]) {
    return Bad("jaxops_gemm_fp8: a [M, K] and b [N, K] must share K, got " + ShapeString(a) +
               " and " + ShapeString(b));
  }
  Problem p;
  p.m = a.dimensions()[0];
  p.n = b.dimensions()[0];
  p.k = a.dimensions()[1];
  // Both operands K-major: in gemm.h's terms A is [M, K] and B is transposed ([N, K]).
  p.transpose_b = true;
  const bool blocked = a_mode != ScaleMode::kTensor || b_mode != ScaleMode::kTensor;
  if (p.k % 16 != 0 || (blocked && p.k % kScaleBlock != 0)) {
    return Bad("jaxops_gemm_fp8: K must be a multiple of 16 (of 128 with block scales), got " +
               std::to_string(p.k));
  }
  if (a_mode == ScaleMode::kTiles && b_mode == ScaleMode::kTiles) {
    return Bad("jaxops_gemm_fp8: at most one operand may have 128x128 tile scales");
  }
  if (!ScaleShapeOk(a_scale, a_mode, p.m, p.k) || !ScaleShapeOk(b_scale, b_mode, p.n, p.k)) {
    return Bad("jaxops_gemm_fp8: scale shapes " + ShapeString(a_scale) + " and " +
               ShapeString(b_scale) + " do not match their modes for a " + ShapeString(a) +
               " and b " + ShapeString(b));
  }
  if (!Is2d(d, p.m, p.n) || !IsVectorOrEmpty(bias, p.n)) {
    return Bad("jaxops_gemm_fp8: d must be [M, N] and bias [N] or [0], got " + ShapeString(d) +
               " and " + ShapeString(bias));
  }
  return p;
}

}  // namespace jaxops::gemm

#endif  // JAXOPS_XLA_FFI_GEMM_CHECKS_H_
