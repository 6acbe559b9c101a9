// CUDA handlers for scaled_activation: the forward kernel and the fused backward kernel
// (dx and dscales from one pass over dy, x and scales). See rowwise.cuh for the layout:
// one block per row, 16-byte accesses, fp32 math, one rounding at the store.
#include <cuda_runtime.h>

#include "jaxfuse/ffi_common.h"
#include "jaxfuse/scaled_activation.h"
#include "rowwise.cuh"

namespace jaxfuse {
namespace {

using gpu::PointerAligned16;

ffi::Error ForwardCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scales,
                       ffi::Result<ffi::AnyBuffer> out, int32_t activation, float limit,
                       float alpha, float linear_offset) {
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
  if (problem.rows == 0 || problem.out_cols == 0) return ffi::Error::Success();
  return gpu::DispatchFloat(x.element_type(), [&](auto zero) {
    using T = decltype(zero);
    gpu::ActProducer<T> p;
    p.x = static_cast<const T*>(x.untyped_data());
    p.scales = scales.untyped_data();
    p.scales_f32 = scales.element_type() == ffi::DataType::F32;
    p.params = problem.params;
    p.f = problem.out_cols;
    p.w = problem.in_cols;
    p.vector = problem.out_cols % 8 == 0 && PointerAligned16(p.x);
    gpu::SinkArgs<T> s;
    s.out = static_cast<T*>(out->untyped_data());
    s.out_vector = problem.out_cols % 8 == 0 && PointerAligned16(s.out);
    s.rows = problem.rows;
    s.cols = problem.out_cols;
    gpu::LaunchRowKernel<gpu::ActProducer<T>, gpu::SinkKind::kStore, T>(
        p, s, (problem.out_cols + 7) / 8, stream);
    return gpu::LaunchError("scaled_activation forward kernel");
  });
}

ffi::Error BackwardCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                        ffi::AnyBuffer scales, ffi::Result<ffi::AnyBuffer> dx,
                        ffi::Result<ffi::AnyBuffer> dscales, int32_t activation, float limit,
                        float alpha, float linear_offset) {
  ActivationProblem problem;
  if (auto error = ParseActivationBackward(dy, x, scales, *dx, *dscales, activation, limit,
                                           alpha, linear_offset, /*dx_optional=*/false,
                                           &problem);
      error.failure()) {
    return error;
  }
  if (problem.rows == 0) return ffi::Error::Success();
  if (problem.out_cols == 0) {  // empty rows: dscales = 0
    return cudaMemsetAsync(dscales->untyped_data(), 0, dscales->size_bytes(), stream) == cudaSuccess
               ? ffi::Error::Success()
               : Internal("zeroing dscales failed");
  }
  return gpu::DispatchFloat(x.element_type(), [&](auto zero) {
    using T = decltype(zero);
    gpu::DActPairProducer<T> p;
    p.dy = static_cast<const T*>(dy.untyped_data());
    p.x = static_cast<const T*>(x.untyped_data());
    p.scales = scales.untyped_data();
    p.scales_f32 = scales.element_type() == ffi::DataType::F32;
    p.params = problem.params;
    p.f = problem.out_cols;
    p.w = problem.in_cols;
    p.vector = problem.out_cols % 8 == 0 && PointerAligned16(p.x) && PointerAligned16(p.dy);
    gpu::SinkArgs<T> s;
    s.out = static_cast<T*>(dx->untyped_data());
    s.out_vector = problem.out_cols % 8 == 0 && PointerAligned16(s.out);
    s.side = static_cast<float*>(dscales->untyped_data());
    s.rows = problem.rows;
    s.cols = problem.in_cols;
    gpu::LaunchRowKernel<gpu::DActPairProducer<T>, gpu::SinkKind::kStore, T>(
        p, s, (problem.out_cols + 7) / 8, stream);
    return gpu::LaunchError("scaled_activation backward kernel");
  });
}

}  // namespace
}  // namespace jaxfuse

namespace xffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseScaledActivationFwdCuda, jaxfuse::ForwardCuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()  // x [..., W]
                                  .Arg<xffi::AnyBuffer>()  // scales [...]
                                  .Ret<xffi::AnyBuffer>()  // out [..., F]
                                  .Attr<int32_t>("activation")
                                  .Attr<float>("limit")
                                  .Attr<float>("alpha")
                                  .Attr<float>("linear_offset"),
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseScaledActivationBwdCuda, jaxfuse::BackwardCuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()  // dy [..., F]
                                  .Arg<xffi::AnyBuffer>()  // x [..., W]
                                  .Arg<xffi::AnyBuffer>()  // scales [...]
                                  .Ret<xffi::AnyBuffer>()  // dx [..., W]
                                  .Ret<xffi::AnyBuffer>()  // dscales float32 [...]
                                  .Attr<int32_t>("activation")
                                  .Attr<float>("limit")
                                  .Attr<float>("alpha")
                                  .Attr<float>("linear_offset"),
                              {xffi::Traits::kCmdBufferCompatible});
