// The scaled activations' per-element math, as both backends see it (fp32 throughout).
//
// GLU kinds read a row of x as [a | b] (the gate a in the first half):
//   swiglu:          act = silu(a) * b,                  silu(a) = a * sigmoid(a)
//   clamped_swiglu:  a' = min(a, limit), b' = clip(b, -limit, limit) + linear_offset,
//                    act = a' * sigmoid(alpha * a') * b'
// and srelu reads x alone: act = relu(x)^2. Output = act * scale[row].
//
// NaN propagates (every clamp is written with comparisons that are false for NaN, never
// fminf/fmaxf, which would drop it), and sigmoid is computed stably: silu(-1e4) is -0,
// not NaN.
#pragma once

#include <cmath>
#include <cstdint>

#include "jaxfuse/platform.h"

namespace jaxfuse {

enum class Activation : int32_t { kSwiglu = 0, kSrelu = 1, kClampedSwiglu = 2 };

struct ActivationParams {
  Activation kind = Activation::kSwiglu;
  float limit = 7.0f;
  float alpha = 1.702f;
  float linear_offset = 1.0f;
};

JAXFUSE_HOST_DEVICE bool IsGlu(Activation kind) { return kind != Activation::kSrelu; }

// sigmoid(x) without overflow: exp of a non-positive argument only. NaN -> NaN.
// On the device exp and the reciprocal are the hardware approximations (MUFU ex2 and rcp,
// flushing subnormals): libm's expf and IEEE division cost ~8 and ~5 instructions each,
// which made the fused activation + quantization kernels issue-bound rather than
// memory-bound (Nsight Compute at T=65536, 2F=8192: 84% issue slots busy at 61% of copy
// bandwidth). Error: ex2.approx ~2 ulp plus |x| * 2^-24 from rounding the argument, rcp
// 1 ulp on [1, 2]; under 1e-6 relative for |x| < 8, far below bf16 and FP8 resolution. A
// sigmoid below 2^-126 (x < -87.3) is 0 instead of subnormal.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float Exp2Approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float ReciprocalApprox(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

JAXFUSE_HOST_DEVICE float Sigmoid(float x) {
#if defined(__CUDA_ARCH__)
  const float e = Exp2Approx(-fabsf(x) * 1.4426950408889634f);  // exp(-|x|) in [0, 1]
  const float inverse = ReciprocalApprox(1.0f + e);
  return x >= 0.0f ? inverse : e * inverse;
#else
  const float e = std::exp(-std::fabs(x));
  const float denominator = 1.0f + e;
  return x >= 0.0f ? 1.0f / denominator : e / denominator;
#endif
}

// Forward values, one function per kind (kernels switch on the kind once per vector of
// elements, not per element, so the element loop has no branches).
JAXFUSE_HOST_DEVICE float SwigluForward(float a, float b) { return a * Sigmoid(a) * b; }

JAXFUSE_HOST_DEVICE float ClampedSwigluForward(const ActivationParams& p, float a, float b) {
  const float ac = a > p.limit ? p.limit : a;
  const float bc = (b > p.limit ? p.limit : (b < -p.limit ? -p.limit : b)) + p.linear_offset;
  return ac * Sigmoid(p.alpha * ac) * bc;
}

JAXFUSE_HOST_DEVICE float SreluForward(float a) {
  const float r = a <= 0.0f ? 0.0f : a;  // NaN stays NaN
  return r * r;
}

// Forward value act(a, b) (b ignored for srelu).
JAXFUSE_HOST_DEVICE float ActivationForward(const ActivationParams& p, float a, float b) {
  switch (p.kind) {
    case Activation::kSwiglu: return SwigluForward(a, b);
    case Activation::kClampedSwiglu: return ClampedSwigluForward(p, a, b);
    default: return SreluForward(a);
  }
}

// Forward value and the partial derivatives d act / d a and d act / d b.
struct ActivationGrad {
  float value, da, db;
};

JAXFUSE_HOST_DEVICE ActivationGrad SwigluBackward(float a, float b) {
  const float s = Sigmoid(a);
  const float silu = a * s;
  return {silu * b, b * s * (1.0f + a * (1.0f - s)), silu};
}

JAXFUSE_HOST_DEVICE ActivationGrad ClampedSwigluBackward(const ActivationParams& p, float a,
                                                         float b) {
  const bool a_clamped = a > p.limit;
  const float ac = a_clamped ? p.limit : a;
  const bool b_clamped = b > p.limit || b < -p.limit;
  const float bc = (b > p.limit ? p.limit : (b < -p.limit ? -p.limit : b)) + p.linear_offset;
  const float s = Sigmoid(p.alpha * ac);
  const float gate = ac * s;
  const float d_gate = s * (1.0f + p.alpha * ac * (1.0f - s));
  return {gate * bc, a_clamped ? 0.0f : bc * d_gate, b_clamped ? 0.0f : gate};
}

JAXFUSE_HOST_DEVICE ActivationGrad SreluBackward(float a) {
  const float r = a <= 0.0f ? 0.0f : a;
  return {r * r, 2.0f * r, 0.0f};
}

JAXFUSE_HOST_DEVICE ActivationGrad ActivationBackward(const ActivationParams& p, float a, float b) {
  switch (p.kind) {
    case Activation::kSwiglu: return SwigluBackward(a, b);
    case Activation::kClampedSwiglu: return ClampedSwigluBackward(p, a, b);
    default: return SreluBackward(a);
  }
}

}  // namespace jaxfuse
