// The GEMM family's problem description, shared by the dispatch code and the cuBLASLt plans.
//
// jaxops works on row-major arrays, cuBLASLt on column-major matrices. A row-major [R, C] array is
// the column-major C x R matrix with leading dimension C, so the row-major product
//   D[M, N] = op(A) @ op(B)      A [M, K] (or [K, M] transposed), B [K, N] (or [N, K] transposed)
// is the column-major product D^T (N x M) = op(B)^T (N x K) * op(A)^T (K x M): cuBLASLt's first
// operand is our B, its second our A, and its (m, n, k) are our (N, M, K). A bias of N elements is
// added along the rows of D^T (cuBLASLt's BIAS epilogue), and a bias gradient over the M rows of D
// is the reduction of cuBLASLt's first operand along its k (the BGRADA epilogue).
#ifndef JAXOPS_XLA_FFI_GEMM_GEMM_H_
#define JAXOPS_XLA_FFI_GEMM_GEMM_H_

#include <cstdint>

namespace jaxops::gemm {

// Activations the cuBLASLt epilogue applies (the others run as XLA elementwise ops in Python).
enum class Activation : int32_t { kNone = 0, kRelu = 1, kGeluTanh = 2 };
inline constexpr int32_t kNumActivations = 3;

// How float32 operands are multiplied (jaxops.precision); 16-bit operands always take fp32
// accumulation. "bf16_3x" has no cuBLASLt equivalent and never reaches the kernel.
enum class Precision : int32_t { kFp32 = 0, kTf32 = 1, kBf16 = 2 };
inline constexpr int32_t kNumPrecisions = 3;

// Scaling of an FP8 operand: one float32 for the tensor, one per 1 x 128 group along K (stored
// K-block-major with the rows contiguous, rows padded to 4), or one per 128 x 128 tile (stored
// the same way over tiles).
enum class ScaleMode : int32_t { kTensor = 0, kRows = 1, kTiles = 2 };
inline constexpr int32_t kNumScaleModes = 3;
inline constexpr int64_t kScaleBlock = 128;

// Bytes of cuBLASLt workspace every GEMM custom call receives (NVIDIA's recommendation for
// Hopper); the Python wrappers allocate it as a result buffer.
inline constexpr int64_t kWorkspaceBytes = int64_t{32} << 20;

constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// A row-major GEMM, as the handlers receive it.
struct Problem {
  int64_t m = 0;  // rows of D
  int64_t n = 0;  // columns of D
  int64_t k = 0;  // contraction
  bool transpose_a = false;
  bool transpose_b = false;
};

// The same GEMM in cuBLASLt's column-major terms (see the header comment).
struct LtShape {
  int64_t m = 0, n = 0, k = 0;
  bool trans_first = false;                              // op of cuBLASLt's first operand (our B)
  bool trans_second = false;                             // op of cuBLASLt's second operand (our A)
  int64_t first_rows = 0, first_cols = 0, first_ld = 0;  // storage of our B
  int64_t second_rows = 0, second_cols = 0, second_ld = 0;  // storage of our A
  int64_t d_rows = 0, d_cols = 0, d_ld = 0;                 // storage of D
};

constexpr LtShape ToColumnMajor(const Problem& p) {
  LtShape s;
  s.m = p.n;
  s.n = p.m;
  s.k = p.k;
  // B row-major [K, N] is column-major N x K (no op); [N, K] is K x N (op = T).
  s.trans_first = p.transpose_b;
  s.first_rows = p.transpose_b ? p.k : p.n;
  s.first_cols = p.transpose_b ? p.n : p.k;
  s.first_ld = s.first_rows;
  // A row-major [M, K] is column-major K x M (no op); [K, M] is M x K (op = T).
  s.trans_second = p.transpose_a;
  s.second_rows = p.transpose_a ? p.m : p.k;
  s.second_cols = p.transpose_a ? p.k : p.m;
  s.second_ld = s.second_rows;
  s.d_rows = p.n;
  s.d_cols = p.m;
  s.d_ld = p.n;
  return s;
}

// Largest power of two (at most 256) dividing a byte address: the alignment cuBLASLt may assume.
inline int32_t AddressAlignment(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  int32_t alignment = 256;
  while (alignment > 1 && (address % static_cast<uintptr_t>(alignment)) != 0) alignment /= 2;
  return alignment;
}

}  // namespace jaxops::gemm

#endif  // JAXOPS_XLA_FFI_GEMM_GEMM_H_
