// Argument parsing shared by the scaled_activation handlers of both backends.
//
// x is [..., W] with W = 2F for the GLU kinds (gate first) and W = F for srelu; scales
// holds one value per row (float32 or x's dtype); the activation is [..., F].
#pragma once

#include <cstdint>

#include "jaxfuse/activation.h"
#include "jaxfuse/ffi_common.h"

namespace jaxfuse {

struct ActivationProblem {
  ActivationParams params;
  int64_t rows = 0;
  int64_t in_cols = 0;   // W
  int64_t out_cols = 0;  // F
};

inline bool IsActivationFloat(ffi::DataType type) {
  return type == ffi::DataType::F32 || type == ffi::DataType::BF16 || type == ffi::DataType::F16;
}

inline ffi::Error ParseActivationProblem(const ffi::AnyBuffer& x, const ffi::AnyBuffer& scales,
                                         int32_t activation, float limit, float alpha,
                                         float linear_offset, ActivationProblem* problem) {
  if (activation < 0 || activation > 2) return InvalidArgument("unknown activation ", activation);
  problem->params = {static_cast<Activation>(activation), limit, alpha, linear_offset};
  const auto dims = x.dimensions();
  if (dims.size() == 0 || !IsActivationFloat(x.element_type())) {
    return InvalidArgument("x must be a float32/bfloat16/float16 array [..., W], got ",
                           DataTypeName(x.element_type()), " ", ShapeString(dims));
  }
  problem->rows = LeadingProduct(dims);
  problem->in_cols = dims.back();
  const bool glu = IsGlu(problem->params.kind);
  if (glu && problem->in_cols % 2 != 0) {
    return InvalidArgument("GLU activations need an even last dimension, got ", problem->in_cols);
  }
  problem->out_cols = glu ? problem->in_cols / 2 : problem->in_cols;
  if (scales.element_count() != static_cast<size_t>(problem->rows) ||
      (scales.element_type() != ffi::DataType::F32 && scales.element_type() != x.element_type())) {
    return InvalidArgument("scales must hold one float32 (or x dtype) value per row: ",
                           problem->rows, " values, got ", DataTypeName(scales.element_type()),
                           " ", ShapeString(scales.dimensions()));
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckActivationOutput(const ActivationProblem& problem, const ffi::AnyBuffer& buffer,
                                        ffi::DataType type, int64_t cols, const char* name) {
  const auto dims = buffer.dimensions();
  if (buffer.element_type() != type || dims.size() == 0 || dims.back() != cols ||
      LeadingProduct(dims) != problem.rows) {
    return InvalidArgument(name, " must be ", DataTypeName(type), " [", problem.rows, ", ", cols,
                           "], got ", DataTypeName(buffer.element_type()), " ", ShapeString(dims));
  }
  return ffi::Error::Success();
}

// The backward's buffers, as both backends check them: dy [rows, F], dx (x's shape; may be
// empty when `dx_optional`, i.e. not requested), dscales float32 [rows].
inline ffi::Error ParseActivationBackward(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                          const ffi::AnyBuffer& scales, const ffi::AnyBuffer& dx,
                                          const ffi::AnyBuffer& dscales, int32_t activation,
                                          float limit, float alpha, float linear_offset,
                                          bool dx_optional, ActivationProblem* problem) {
  if (auto error = ParseActivationProblem(x, scales, activation, limit, alpha, linear_offset,
                                          problem);
      error.failure()) {
    return error;
  }
  if (auto error = CheckActivationOutput(*problem, dy, x.element_type(), problem->out_cols, "dy");
      error.failure()) {
    return error;
  }
  if (!dx_optional || dx.element_count() != 0) {
    if (auto error = CheckActivationOutput(*problem, dx, x.element_type(), problem->in_cols, "dx");
        error.failure()) {
      return error;
    }
  }
  if (dscales.element_type() != ffi::DataType::F32 ||
      dscales.element_count() != static_cast<size_t>(problem->rows)) {
    return InvalidArgument("dscales must be float32 with ", problem->rows, " elements");
  }
  return ffi::Error::Success();
}

}  // namespace jaxfuse
