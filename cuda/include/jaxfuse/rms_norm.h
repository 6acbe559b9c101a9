// RMSNorm and residual-add + RMSNorm as both backends compute them.
//
// Forward, per row of H elements (statistics in fp32, one rounding at each store):
//
//   s        = x + residual            (add variant only; rounded to the storage dtype,
//                                       written as the new residual, and normalized as
//                                       rounded, so out == rms_norm(new_residual) exactly)
//   rsigma   = 1 / sqrt(mean(s^2) + eps)                 (fp32, saved for backward)
//   out_j    = (s_j * rsigma) * g_j,   g = gamma or (1 + gamma) when zero-centered
//
// Backward, with xhat = s * rsigma and dxhat = dy * g:
//
//   dx_j     = rsigma * (dxhat_j - xhat_j * mean(dxhat * xhat)) (+ dz_j, the gradient
//              flowing into the new residual, for the add variant)
//   dgamma_j = sum over rows of dy_j * xhat_j   (fp32; the CUDA handler sums per-block
//              partials in a fixed order: deterministic, no atomics)
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "jaxfuse/ffi_common.h"
#include "jaxfuse/platform.h"

namespace jaxfuse {

// The scale gamma applies, in fp32.
JAXFUSE_HOST_DEVICE float RmsNormScale(float gamma, bool zero_centered_gamma) {
  return zero_centered_gamma ? 1.0f + gamma : gamma;
}

// 1 / sqrt(sum_of_squares / cols + eps). Uses the correctly rounded sqrt and a division
// on both backends (not rsqrtf's approximation), so CPU and GPU agree to the last bit
// for the same sum.
JAXFUSE_HOST_DEVICE float RmsNormRsigma(float sum_of_squares, int64_t cols, float eps) {
  return 1.0f / sqrtf(sum_of_squares / static_cast<float>(cols) + eps);
}

JAXFUSE_HOST_DEVICE float RmsNormApply(float s, float rsigma, float scale) {
  return (s * rsigma) * scale;
}

// dx for one element, given m = mean(dxhat * xhat) over the row.
JAXFUSE_HOST_DEVICE float RmsNormInputGrad(float dy, float s, float rsigma, float scale,
                                           float m) {
  const float xhat = s * rsigma;
  return rsigma * (dy * scale - xhat * m);
}

struct RmsNormProblem {
  int64_t rows = 0, cols = 0;
  ffi::DataType x_type = ffi::DataType::INVALID;
  ffi::DataType gamma_type = ffi::DataType::INVALID;
};

inline bool IsRmsNormType(ffi::DataType type) {
  return type == ffi::DataType::F32 || type == ffi::DataType::BF16 ||
         type == ffi::DataType::F16;
}

// Checks the shared layout: `x` [..., H] (any rank >= 1), gamma [H] of x's dtype or
// float32, and `like_x` buffers with x's element count and dtype, rsigma float32 with
// `rows` elements. The Python wrappers check the same with friendlier names.
inline ffi::Error ParseRmsNormProblem(const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma,
                                      const ffi::AnyBuffer& rsigma,
                                      std::initializer_list<const ffi::AnyBuffer*> like_x,
                                      RmsNormProblem* problem) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() == 0 || gamma.dimensions().size() != 1 ||
      gamma.dimensions()[0] != x_dims.back()) {
    return InvalidArgument("rms_norm expects x [..., H] and gamma [H]; got x ",
                           ShapeString(x_dims), ", gamma ", ShapeString(gamma.dimensions()));
  }
  problem->cols = x_dims.back();
  problem->rows = LeadingProduct(x_dims);
  problem->x_type = x.element_type();
  problem->gamma_type = gamma.element_type();
  if (!IsRmsNormType(problem->x_type)) {
    return InvalidArgument("rms_norm: x must be float32, bfloat16 or float16, got ",
                           DataTypeName(problem->x_type));
  }
  if (problem->gamma_type != problem->x_type && problem->gamma_type != ffi::DataType::F32) {
    return InvalidArgument("rms_norm: gamma must have x's dtype or float32, got ",
                           DataTypeName(problem->gamma_type));
  }
  for (const ffi::AnyBuffer* other : like_x) {
    if (other->element_count() != x.element_count() ||
        other->element_type() != problem->x_type) {
      return InvalidArgument("rms_norm: every row buffer must match x ", ShapeString(x_dims),
                             " ", DataTypeName(problem->x_type), ", got ",
                             ShapeString(other->dimensions()), " ",
                             DataTypeName(other->element_type()));
    }
  }
  if (rsigma.element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(rsigma.element_count()) != problem->rows) {
    return InvalidArgument("rms_norm: rsigma must be float32 with ", problem->rows,
                           " elements, got ", ShapeString(rsigma.dimensions()), " ",
                           DataTypeName(rsigma.element_type()));
  }
  return ffi::Error::Success();
}

}  // namespace jaxfuse
