// The expert FFN's activation between its two grouped GEMMs, on the groups' rows only: the math
// of the CPU calls in cpu_activation.cc (on a GPU XLA's fusion computes it; padding rows cost
// memory bandwidth there, not the CPU's exp).
//
// h's columns hold the first GEMM's output, float32; a row of the result a:
//   kSwiglu         a[j] = silu(h[j]) * h[F + j]                (gate | up halves, F = C / 2)
//   kClampedSwiglu  g = min(h[2j], limit), u = clip(h[2j + 1], -limit, limit),
//                   a[j] = (u + 1) * g * sigmoid(alpha * g)     (gpt-oss: gate, up interleaved)
//   kSilu           a[j] = silu(h[j])                           (F = C)
// with silu(x) = x * sigmoid(x). The gradients are JAX's autodiff of the same expressions, ties
// of min / clip included (a tie splits the gradient in halves, as jax.numpy's minimum and
// maximum do).
#ifndef JAXOPS_XLA_FFI_GROUPED_GEMM_ACTIVATION_H_
#define JAXOPS_XLA_FFI_GROUPED_GEMM_ACTIVATION_H_

#include <cstdint>
#include <cstring>

namespace jaxops::grouped_gemm {

// The activation attribute's values (jaxops._grouped_gemm.ACTIVATIONS, in order).
enum class Activation : int32_t { kSwiglu = 0, kClampedSwiglu = 1, kSilu = 2 };

// Whether the activation reads a gate and an up column per output column.
inline bool IsGlu(Activation act) { return act != Activation::kSilu; }

// e^x for x <= 0 in fp32 (Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, 1 + r + r^2 p(r)
// with p a degree-5 polynomial, about 1 ulp), 0 below ln(FLT_MIN) (no subnormals); NaN stays NaN.
// No branches or calls, so that loops over it vectorize.
inline float ExpNonPositive(float x) {
  const bool tiny = x < -87.33654f;
  const float fn_raw = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  const float fn = (fn_raw == fn_raw && !tiny) ? fn_raw : 0.0f;  // NaN and tiny: a safe exponent
  const float r = (x - fn * 0.693359375f) + fn * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fn) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return tiny ? 0.0f : y * scale;
}

// sigmoid(x) = 1 / (1 + e^-x) from e^-|x| (never overflows): s = 1 / (1 + e^-|x|) is sigmoid(|x|),
// and sigmoid(x) = 1 - sigmoid(-x) = e^-|x| s for x < 0.
inline float Sigmoid(float x) {
  const float e = ExpNonPositive(x < 0.0f ? x : -x);
  const float s = 1.0f / (1.0f + e);
  return x >= 0.0f ? s : e * s;
}

// JAX's gradient of min(x, limit) with respect to x: 1 below, 1/2 at a tie, 0 above (and NaN).
inline float MinGrad(float x, float limit) { return x < limit ? 1.0f : (x == limit ? 0.5f : 0.0f); }

// JAX's gradient of max(x, floor) with respect to x.
inline float MaxGrad(float x, float floor) { return x > floor ? 1.0f : (x == floor ? 0.5f : 0.0f); }

// One output column of the activation from its gate g and up u (kSilu: g only).
template <Activation kAct>
inline float Forward(float g, float u, float alpha, float limit) {
  if constexpr (kAct == Activation::kSwiglu) {
    return g * Sigmoid(g) * u;
  } else if constexpr (kAct == Activation::kClampedSwiglu) {
    const float gc = g > limit ? limit : g;  // min(g, limit); a NaN g stays NaN
    const float lo = u < -limit ? -limit : u;
    const float uc = lo > limit ? limit : lo;
    return (uc + 1.0f) * (gc * Sigmoid(alpha * gc));
  } else {
    return g * Sigmoid(g);
  }
}

// The gradients (dg, du) of one output column given its gradient da (kSilu: du unused).
template <Activation kAct>
inline void Backward(float g, float u, float da, float alpha, float limit, float& dg, float& du) {
  if constexpr (kAct == Activation::kSwiglu) {
    const float s = Sigmoid(g);
    dg = da * u * (s * (1.0f + g * (1.0f - s)));
    du = da * (g * s);
  } else if constexpr (kAct == Activation::kClampedSwiglu) {
    const float gc = g > limit ? limit : g;
    const float lo = u < -limit ? -limit : u;
    const float uc = lo > limit ? limit : lo;
    const float s = Sigmoid(alpha * gc);
    const float glu = gc * s;
    dg = da * (uc + 1.0f) * (s + gc * alpha * s * (1.0f - s)) * MinGrad(g, limit);
    du = da * glu * MaxGrad(u, -limit) * MinGrad(lo, limit);
  } else {
    const float s = Sigmoid(g);
    dg = da * (s * (1.0f + g * (1.0f - s)));
    du = 0.0f;
  }
}

}  // namespace jaxops::grouped_gemm

#endif  // JAXOPS_XLA_FFI_GROUPED_GEMM_ACTIVATION_H_
