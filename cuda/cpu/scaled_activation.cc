// CPU handlers for scaled_activation (forward and the fused backward): plain loops over
// the per-element math of jaxfuse/activation.h, fp32 throughout, one rounding at the store.
#include "jaxfuse/activation.h"
#include "jaxfuse/ffi_common.h"
#include "jaxfuse/quantize.h"
#include "jaxfuse/scaled_activation.h"

namespace jaxfuse {
namespace {

ffi::Error ForwardCpu(ffi::AnyBuffer x, ffi::AnyBuffer scales, ffi::Result<ffi::AnyBuffer> out,
                      int32_t activation, float limit, float alpha, float linear_offset) {
  ActivationProblem problem;
  if (auto error = ParseActivationProblem(x, scales, activation, limit, alpha, linear_offset,
                                          &problem);
      error.failure()) {
    return error;
  }
  if (auto error = CheckActivationOutput(problem, *out, x.element_type(), problem.out_cols, "out");
      error.failure()) {
    return error;
  }
  const int64_t f = problem.out_cols, w = problem.in_cols;
  const bool glu = IsGlu(problem.params.kind);
  for (int64_t r = 0; r < problem.rows; ++r) {
    const float scale = LoadAsFloat(scales.untyped_data(), scales.element_type(), r);
    for (int64_t j = 0; j < f; ++j) {
      const float a = LoadAsFloat(x.untyped_data(), x.element_type(), r * w + j);
      const float b = glu ? LoadAsFloat(x.untyped_data(), x.element_type(), r * w + f + j) : 0.0f;
      StoreFromFloat(out->untyped_data(), out->element_type(), r * f + j,
                     ActivationForward(problem.params, a, b) * scale);
    }
  }
  return ffi::Error::Success();
}

ffi::Error BackwardCpu(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer scales,
                       ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dscales,
                       int32_t activation, float limit, float alpha, float linear_offset) {
  ActivationProblem problem;
  if (auto error = ParseActivationBackward(dy, x, scales, *dx, *dscales, activation, limit,
                                           alpha, linear_offset, /*dx_optional=*/false,
                                           &problem);
      error.failure()) {
    return error;
  }
  const int64_t f = problem.out_cols, w = problem.in_cols;
  const bool glu = IsGlu(problem.params.kind);
  float* ds = static_cast<float*>(dscales->untyped_data());
  for (int64_t r = 0; r < problem.rows; ++r) {
    const float scale = LoadAsFloat(scales.untyped_data(), scales.element_type(), r);
    float sum = 0.0f;
    for (int64_t j = 0; j < f; ++j) {
      const float a = LoadAsFloat(x.untyped_data(), x.element_type(), r * w + j);
      const float b = glu ? LoadAsFloat(x.untyped_data(), x.element_type(), r * w + f + j) : 0.0f;
      const float g = LoadAsFloat(dy.untyped_data(), dy.element_type(), r * f + j);
      const ActivationGrad grad = ActivationBackward(problem.params, a, b);
      sum += g * grad.value;
      const float gs = g * scale;
      StoreFromFloat(dx->untyped_data(), dx->element_type(), r * w + j, gs * grad.da);
      if (glu) StoreFromFloat(dx->untyped_data(), dx->element_type(), r * w + f + j, gs * grad.db);
    }
    ds[r] = sum;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxfuse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseScaledActivationFwdCpu, jaxfuse::ForwardCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [..., W]
                                  .Arg<xla::ffi::AnyBuffer>()  // scales [...]
                                  .Ret<xla::ffi::AnyBuffer>()  // out [..., F]
                                  .Attr<int32_t>("activation")
                                  .Attr<float>("limit")
                                  .Attr<float>("alpha")
                                  .Attr<float>("linear_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseScaledActivationBwdCpu, jaxfuse::BackwardCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // dy [..., F]
                                  .Arg<xla::ffi::AnyBuffer>()  // x [..., W]
                                  .Arg<xla::ffi::AnyBuffer>()  // scales [...]
                                  .Ret<xla::ffi::AnyBuffer>()  // dx [..., W]
                                  .Ret<xla::ffi::AnyBuffer>()  // dscales float32 [...]
                                  .Attr<int32_t>("activation")
                                  .Attr<float>("limit")
                                  .Attr<float>("alpha")
                                  .Attr<float>("linear_offset"));
