// CPU handlers for FP8 quantization and the fused scaled activation + quantization (forward
// and backward). Reference loops: values are computed in fp32 into a temporary, then
// quantized by QuantizeCpu (jaxfuse/quantize.h) with the FP8 rounding of jaxfuse/fp8.h.
#include <algorithm>
#include <vector>

#include "jaxfuse/activation.h"
#include "jaxfuse/ffi_common.h"
#include "jaxfuse/fp8.h"
#include "jaxfuse/quantize.h"
#include "jaxfuse/scaled_activation.h"

namespace jaxfuse {
namespace {

// The column-wise copy, when asked for, from the row-wise FP8 data just written.
void WriteColumnwiseCpu(bool wanted, const ColumnwiseProblem& copy, const ffi::AnyBuffer& data,
                        const ffi::AnyBuffer& offsets, ffi::AnyBuffer& columnwise) {
  if (!wanted) return;
  ColumnwiseCpu(copy, static_cast<const uint8_t*>(data.untyped_data()),
                offsets.typed_data<int32_t>(), static_cast<uint8_t*>(columnwise.untyped_data()));
}

ffi::Error QuantizeCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer offsets,
                           ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> scale_inv,
                           ffi::Result<ffi::AnyBuffer> amax,
                           ffi::Result<ffi::AnyBuffer> columnwise, int32_t mode, int32_t block) {
  const auto dims = x.dimensions();
  if (dims.size() == 0 || !IsFloatType(x.element_type())) {
    return InvalidArgument("quantize: x must be a float32/bfloat16/float16 array, got ",
                           DataTypeName(x.element_type()), " ", ShapeString(dims));
  }
  QuantizeProblem problem;
  problem.cols = dims.back();
  if (mode == static_cast<int32_t>(ScalingMode::kBlock2D)) {
    if (dims.size() < 2) return InvalidArgument("2-D block scaling needs x of rank >= 2");
    problem.rows = dims[dims.size() - 2];
    problem.batch = LeadingProduct(dims) / (problem.rows ? problem.rows : 1);
    if (problem.rows == 0) problem.batch = 0;
  } else {
    problem.rows = LeadingProduct(dims);
  }
  if (auto error = CheckQuantizeOutputs(problem, offsets, *data, *scale_inv, *amax, mode, block);
      error.failure()) {
    return error;
  }
  if (data->element_count() != x.element_count()) return InvalidArgument("data must have x's shape");
  ColumnwiseProblem copy;
  bool copy_wanted = false;
  if (auto error = CheckColumnwiseOutput(problem, *data, *columnwise, &copy, &copy_wanted);
      error.failure()) {
    return error;
  }
  const std::vector<float> values = ToFloatVector(x);
  QuantizeCpu(problem, values.data(), static_cast<const int32_t*>(offsets.untyped_data()),
              static_cast<uint8_t*>(data->untyped_data()), scale_inv->untyped_data(),
              static_cast<float*>(amax->untyped_data()));
  WriteColumnwiseCpu(copy_wanted, copy, *data, offsets, *columnwise);
  return ffi::Error::Success();
}

// x's rows gathered (source indices clamped to [0, T), as the CUDA producer reads them),
// then quantized per group with the given amaxes.
ffi::Error QuantizeGatheredCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer source_rows,
                                   ffi::AnyBuffer offsets, ffi::AnyBuffer amax,
                                   ffi::Result<ffi::AnyBuffer> data,
                                   ffi::Result<ffi::AnyBuffer> scale_inv,
                                   ffi::Result<ffi::AnyBuffer> columnwise) {
  QuantizeProblem problem;
  if (auto error = ParseQuantizeGathered(x, source_rows, offsets, amax, *data, *scale_inv,
                                         &problem);
      error.failure()) {
    return error;
  }
  ColumnwiseProblem copy;
  bool copy_wanted = false;
  if (auto error = CheckColumnwiseOutput(problem, *data, *columnwise, &copy, &copy_wanted);
      error.failure()) {
    return error;
  }
  const std::vector<float> sources = ToFloatVector(x);
  const int64_t source_count = x.dimensions()[0], cols = problem.cols;
  const int32_t* index = source_rows.typed_data<int32_t>();
  std::vector<float> values(static_cast<size_t>(problem.rows * cols));
  for (int64_t r = 0; r < problem.rows; ++r) {
    const int64_t source = std::min<int64_t>(std::max<int64_t>(index[r], 0), source_count - 1);
    std::copy_n(sources.begin() + source * cols, cols, values.begin() + r * cols);
  }
  std::vector<float> amax_used(static_cast<size_t>(problem.num_groups));
  QuantizeCpu(problem, values.data(), offsets.typed_data<int32_t>(),
              static_cast<uint8_t*>(data->untyped_data()), scale_inv->untyped_data(),
              amax_used.data(), static_cast<const float*>(amax.untyped_data()));
  WriteColumnwiseCpu(copy_wanted, copy, *data, offsets, *columnwise);
  return ffi::Error::Success();
}

ffi::Error QuantizeTransposedCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer amax,
                                     ffi::Result<ffi::AnyBuffer> data,
                                     ffi::Result<ffi::AnyBuffer> scale_inv,
                                     ffi::Result<ffi::AnyBuffer> data_untransposed) {
  TransposedProblem problem;
  if (auto error = ParseQuantizeTransposed(x, amax, *data, *scale_inv, *data_untransposed,
                                           &problem);
      error.failure()) {
    return error;
  }
  QuantizeTransposedCpu(problem, x, static_cast<const float*>(amax.untyped_data()),
                        static_cast<uint8_t*>(data->untyped_data()),
                        static_cast<float*>(scale_inv->untyped_data()),
                        static_cast<uint8_t*>(data_untransposed->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error QuantizeBatchesTransposedCpuImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> data,
                                            ffi::Result<ffi::AnyBuffer> scale_inv,
                                            ffi::Result<ffi::AnyBuffer> data_untransposed,
                                            ffi::Result<ffi::AnyBuffer> scratch) {
  TransposedProblem problem;
  if (auto error = ParseQuantizeBatchesTransposed(x, *data, *scale_inv, *data_untransposed,
                                                  *scratch, &problem);
      error.failure()) {
    return error;
  }
  std::vector<float> amax(problem.batch);
  BatchAmaxCpu(BatchAmaxProblem{problem.batch, problem.rows * problem.cols}, x, amax.data());
  QuantizeTransposedCpu(problem, x, amax.data(), static_cast<uint8_t*>(data->untyped_data()),
                        static_cast<float*>(scale_inv->untyped_data()),
                        static_cast<uint8_t*>(data_untransposed->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error QuantizeBlocksTransposedCpuImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> data,
                                           ffi::Result<ffi::AnyBuffer> scale_inv,
                                           ffi::Result<ffi::AnyBuffer> data_untransposed) {
  TransposedProblem problem;
  if (auto error = ParseQuantizeBlocksTransposed(x, *data, *scale_inv, *data_untransposed,
                                                 &problem);
      error.failure()) {
    return error;
  }
  QuantizeBlocksTransposedCpu(problem, x, static_cast<uint8_t*>(data->untyped_data()),
                              static_cast<float*>(scale_inv->untyped_data()),
                              static_cast<uint8_t*>(data_untransposed->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error QuantizeColumnwiseBlocksCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer offsets,
                                           ffi::Result<ffi::AnyBuffer> data,
                                           ffi::Result<ffi::AnyBuffer> scale_inv) {
  ColumnwiseBlocksProblem problem;
  if (auto error = ParseQuantizeColumnwiseBlocks(x, offsets, *data, *scale_inv, &problem);
      error.failure()) {
    return error;
  }
  QuantizeColumnwiseBlocksCpu(problem, x, offsets.typed_data<int32_t>(),
                              static_cast<uint8_t*>(data->untyped_data()),
                              static_cast<float*>(scale_inv->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error BatchAmaxCpuImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> amax) {
  BatchAmaxProblem problem;
  if (auto error = ParseBatchAmax(x, *amax, &problem); error.failure()) return error;
  BatchAmaxCpu(problem, x, static_cast<float*>(amax->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error ActivationQuantizeCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer scales,
                                     ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> data,
                                     ffi::Result<ffi::AnyBuffer> scale_inv,
                                     ffi::Result<ffi::AnyBuffer> amax,
                                     ffi::Result<ffi::AnyBuffer> columnwise, int32_t activation,
                                     float limit, float alpha, float linear_offset, int32_t mode,
                                     int32_t block) {
  ActivationProblem act;
  if (auto error = ParseActivationProblem(x, scales, activation, limit, alpha, linear_offset, &act);
      error.failure()) {
    return error;
  }
  QuantizeProblem problem;
  problem.rows = act.rows;
  problem.cols = act.out_cols;
  if (mode == static_cast<int32_t>(ScalingMode::kBlock2D)) {
    return InvalidArgument("2-D block scaling is for weights, not activations");
  }
  if (auto error = CheckQuantizeOutputs(problem, offsets, *data, *scale_inv, *amax, mode, block);
      error.failure()) {
    return error;
  }
  if (data->element_count() != static_cast<size_t>(act.rows * act.out_cols)) {
    return InvalidArgument("data must be [rows, F]");
  }
  ColumnwiseProblem copy;
  bool copy_wanted = false;
  if (auto error = CheckColumnwiseOutput(problem, *data, *columnwise, &copy, &copy_wanted);
      error.failure()) {
    return error;
  }
  const int64_t f = act.out_cols, w = act.in_cols;
  const bool glu = IsGlu(act.params.kind);
  std::vector<float> values(act.rows * f);
  for (int64_t r = 0; r < act.rows; ++r) {
    const float scale = LoadAsFloat(scales.untyped_data(), scales.element_type(), r);
    for (int64_t j = 0; j < f; ++j) {
      const float a = LoadAsFloat(x.untyped_data(), x.element_type(), r * w + j);
      const float b = glu ? LoadAsFloat(x.untyped_data(), x.element_type(), r * w + f + j) : 0.0f;
      values[r * f + j] = ActivationForward(act.params, a, b) * scale;
    }
  }
  QuantizeCpu(problem, values.data(), static_cast<const int32_t*>(offsets.untyped_data()),
              static_cast<uint8_t*>(data->untyped_data()), scale_inv->untyped_data(),
              static_cast<float*>(amax->untyped_data()));
  WriteColumnwiseCpu(copy_wanted, copy, *data, offsets, *columnwise);
  return ffi::Error::Success();
}

ffi::Error DactivationQuantizeCpuImpl(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer scales,
                                      ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> data,
                                      ffi::Result<ffi::AnyBuffer> scale_inv,
                                      ffi::Result<ffi::AnyBuffer> dx,
                                      ffi::Result<ffi::AnyBuffer> dscales,
                                      ffi::Result<ffi::AnyBuffer> amax,
                                      ffi::Result<ffi::AnyBuffer> columnwise, int32_t activation,
                                      float limit, float alpha, float linear_offset, int32_t mode,
                                      int32_t block) {
  ActivationProblem act;
  QuantizeProblem problem;
  if (auto error = ParseDactivationQuantize(dy, x, scales, offsets, *data, *scale_inv, *dx,
                                            *dscales, *amax, activation, limit, alpha,
                                            linear_offset, mode, block, &act, &problem);
      error.failure()) {
    return error;
  }
  ColumnwiseProblem copy;
  bool copy_wanted = false;
  if (auto error = CheckColumnwiseOutput(problem, *data, *columnwise, &copy, &copy_wanted);
      error.failure()) {
    return error;
  }
  const bool write_dx = dx->element_count() != 0;
  const int64_t f = act.out_cols, w = act.in_cols;
  const bool glu = IsGlu(act.params.kind);
  std::vector<float> values(act.rows * w);
  float* ds = static_cast<float*>(dscales->untyped_data());
  for (int64_t r = 0; r < act.rows; ++r) {
    const float scale = LoadAsFloat(scales.untyped_data(), scales.element_type(), r);
    float sum = 0.0f;
    for (int64_t j = 0; j < f; ++j) {
      const float a = LoadAsFloat(x.untyped_data(), x.element_type(), r * w + j);
      const float b = glu ? LoadAsFloat(x.untyped_data(), x.element_type(), r * w + f + j) : 0.0f;
      const float g = LoadAsFloat(dy.untyped_data(), dy.element_type(), r * f + j);
      const ActivationGrad grad = ActivationBackward(act.params, a, b);
      sum += g * grad.value;
      const float gs = g * scale;
      values[r * w + j] = gs * grad.da;
      if (glu) values[r * w + f + j] = gs * grad.db;
    }
    ds[r] = sum;
  }
  if (write_dx) {
    for (int64_t i = 0; i < act.rows * w; ++i) {
      StoreFromFloat(dx->untyped_data(), dx->element_type(), i, values[i]);
    }
  }
  QuantizeCpu(problem, values.data(), static_cast<const int32_t*>(offsets.untyped_data()),
              static_cast<uint8_t*>(data->untyped_data()), scale_inv->untyped_data(),
              static_cast<float*>(amax->untyped_data()));
  WriteColumnwiseCpu(copy_wanted, copy, *data, offsets, *columnwise);
  return ffi::Error::Success();
}

ffi::Error ColumnwiseCpuImpl(ffi::AnyBuffer data, ffi::AnyBuffer offsets,
                             ffi::Result<ffi::AnyBuffer> out) {
  ColumnwiseProblem problem;
  if (auto error = ParseColumnwise(data, offsets, *out, &problem); error.failure()) return error;
  ColumnwiseCpu(problem, static_cast<const uint8_t*>(data.untyped_data()),
                offsets.typed_data<int32_t>(), static_cast<uint8_t*>(out->untyped_data()));
  return ffi::Error::Success();
}
}  // namespace
}  // namespace jaxfuse

namespace xffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseQuantizeCpu, jaxfuse::QuantizeCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()  // x [..., K]
                                  .Arg<xffi::AnyBuffer>()  // group offsets int32 [G + 1]
                                  .Ret<xffi::AnyBuffer>()  // data fp8, x's shape
                                  .Ret<xffi::AnyBuffer>()  // scale_inv
                                  .Ret<xffi::AnyBuffer>()  // amax float32 [G] (scratch)
                                  .Ret<xffi::AnyBuffer>()  // columnwise FP8 [K, W] or [0]
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseQuantizeGatheredCpu, jaxfuse::QuantizeGatheredCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()  // x [T, K]
                                  .Arg<xffi::AnyBuffer>()  // source_rows int32 [M]
                                  .Arg<xffi::AnyBuffer>()  // group offsets int32 [G + 1]
                                  .Arg<xffi::AnyBuffer>()  // group amax float32 [G] (given)
                                  .Ret<xffi::AnyBuffer>()  // data fp8 [M, K]
                                  .Ret<xffi::AnyBuffer>()  // scale_inv float32 [G]
                                  .Ret<xffi::AnyBuffer>());  // columnwise FP8 [K, W] or [0]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseQuantizeTransposedCpu, jaxfuse::QuantizeTransposedCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()   // x [B, R, C]
                                  .Arg<xffi::AnyBuffer>()   // amax float32 [B] (given)
                                  .Ret<xffi::AnyBuffer>()   // data fp8 [B, C, R]
                                  .Ret<xffi::AnyBuffer>()   // scale_inv float32 [B]
                                  .Ret<xffi::AnyBuffer>()); // data_untransposed [B, R, C] or [0]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseQuantizeBatchesTransposedCpu,
                              jaxfuse::QuantizeBatchesTransposedCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()   // x [B, R, C]
                                  .Ret<xffi::AnyBuffer>()   // data fp8 [B, C, R]
                                  .Ret<xffi::AnyBuffer>()   // scale_inv float32 [B]
                                  .Ret<xffi::AnyBuffer>()   // data_untransposed [B, R, C] or [0]
                                  .Ret<xffi::AnyBuffer>()); // scratch uint32 [2, B] (unused)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseQuantizeBlocksTransposedCpu,
                              jaxfuse::QuantizeBlocksTransposedCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()   // x [B, R, C]
                                  .Ret<xffi::AnyBuffer>()   // data fp8 [B, C, R]
                                  .Ret<xffi::AnyBuffer>()   // scale_inv f32 [B, R/128, C/128]
                                  .Ret<xffi::AnyBuffer>()); // data_untransposed [B, R, C] or [0]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseQuantizeColumnwiseBlocksCpu,
                              jaxfuse::QuantizeColumnwiseBlocksCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()   // x [M, C], rows grouped
                                  .Arg<xffi::AnyBuffer>()   // group offsets int32 [G + 1]
                                  .Ret<xffi::AnyBuffer>()   // data FP8 [C, ColumnwiseWidth(M, G)]
                                  .Ret<xffi::AnyBuffer>()); // scale_inv f32 [S(M, G), C]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseBatchAmaxCpu, jaxfuse::BatchAmaxCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()   // x [B, R, C]
                                  .Ret<xffi::AnyBuffer>()); // amax float32 [B]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseScaledActivationQuantizeCpu,
                              jaxfuse::ActivationQuantizeCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()  // x [R, W]
                                  .Arg<xffi::AnyBuffer>()  // scales [R]
                                  .Arg<xffi::AnyBuffer>()  // group offsets int32 [G + 1]
                                  .Ret<xffi::AnyBuffer>()  // data fp8 [R, F]
                                  .Ret<xffi::AnyBuffer>()  // scale_inv
                                  .Ret<xffi::AnyBuffer>()  // amax float32 [G] (scratch)
                                  .Ret<xffi::AnyBuffer>()  // columnwise FP8 [K, W] or [0]
                                  .Attr<int32_t>("activation")
                                  .Attr<float>("limit")
                                  .Attr<float>("alpha")
                                  .Attr<float>("linear_offset")
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseScaledDactivationQuantizeCpu,
                              jaxfuse::DactivationQuantizeCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()  // dy [R, F]
                                  .Arg<xffi::AnyBuffer>()  // x [R, W]
                                  .Arg<xffi::AnyBuffer>()  // scales [R]
                                  .Arg<xffi::AnyBuffer>()  // group offsets int32 [G + 1]
                                  .Ret<xffi::AnyBuffer>()  // data fp8 [R, W]
                                  .Ret<xffi::AnyBuffer>()  // scale_inv
                                  .Ret<xffi::AnyBuffer>()  // dx [R, W] in x's dtype, or [0]
                                  .Ret<xffi::AnyBuffer>()  // dscales float32 [R]
                                  .Ret<xffi::AnyBuffer>()  // amax float32 [G] (scratch)
                                  .Ret<xffi::AnyBuffer>()  // columnwise FP8 [K, W] or [0]
                                  .Attr<int32_t>("activation")
                                  .Attr<float>("limit")
                                  .Attr<float>("alpha")
                                  .Attr<float>("linear_offset")
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupColumnwiseCpu, jaxfuse::ColumnwiseCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()   // data FP8 [M, K], rows grouped
                                  .Arg<xffi::AnyBuffer>()   // group offsets int32 [G + 1]
                                  .Ret<xffi::AnyBuffer>()); // out FP8 [K, ColumnwiseWidth(M, G)]
