// The scaled matrix product behind linear_scale_add and its backward pass, as both
// backends see it:
//
//   out[P, Q] = alpha * op(a) @ op(b) (+ c[P, Q] when accumulating into c, in place)
//
// with op(a) = a or a^T ([P, R]) and op(b) = b or b^T ([R, Q]); all buffers row-major.
// The forward pass is (a = x, b = kernel, c = residual); dgrad is (a = dy, b = kernel^T);
// wgrad is (a = x^T, b = dy): alpha rides in every GEMM, never in a separate pass.
//
// FP8 (Float8CurrentScaling per tensor): a and b are float8_e4m3fn or float8_e5m2 (not both
// e5m2), given "NT" (op(a) = a, op(b) = b^T: both K-major, as Hopper's FP8 tensor cores
// need), and the product is further scaled by the per-tensor dequantization factors
// a_scale_inv * b_scale_inv, read on the device. out (and c) are bf16, f16 or f32.
#pragma once

#include <cstdint>

#include "jaxfuse/ffi_common.h"

namespace jaxfuse {

struct MatmulProblem {
  int64_t p = 0, q = 0, r = 0;  // out is [p, q]; r is the contracted size
  bool transpose_a = false, transpose_b = false;
  ffi::DataType input_type = ffi::DataType::INVALID;   // a (and b, unless FP8)
  ffi::DataType b_type = ffi::DataType::INVALID;
  ffi::DataType output_type = ffi::DataType::INVALID;  // out (and c)
};

inline bool IsFloatingInput(ffi::DataType type) {
  return type == ffi::DataType::F32 || type == ffi::DataType::BF16 ||
         type == ffi::DataType::F16;
}

inline bool IsFp8(ffi::DataType type) {
  return type == ffi::DataType::F8E4M3FN || type == ffi::DataType::F8E5M2;
}

// Checks ranks, sizes and dtypes; `c` is null for the non-accumulating form. The Python
// wrappers check the same things with friendlier names; this guards direct callers.
inline ffi::Error ParseMatmulProblem(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                                     const ffi::AnyBuffer* c, const ffi::AnyBuffer& out,
                                     bool transpose_a, bool transpose_b,
                                     MatmulProblem* problem) {
  const auto a_dims = a.dimensions();
  const auto b_dims = b.dimensions();
  const auto out_dims = out.dimensions();
  // Leading dimensions fold into rows wherever that is a plain reshape: a when it is not
  // transposed, and out/c (so an aliased residual keeps its shape and is never copied).
  if (b_dims.size() != 2 || out_dims.size() == 0 || a_dims.size() == 0 ||
      (transpose_a && a_dims.size() != 2)) {
    return InvalidArgument("matmul operands must be a [..., R] (or [R, P] transposed), ",
                           "b rank 2 and out [..., Q]; got a ", ShapeString(a_dims), ", b ",
                           ShapeString(b_dims), ", out ", ShapeString(out_dims));
  }
  problem->transpose_a = transpose_a;
  problem->transpose_b = transpose_b;
  problem->p = transpose_a ? a_dims[1] : LeadingProduct(a_dims);
  problem->r = transpose_a ? a_dims[0] : a_dims.back();
  const int64_t b_rows = transpose_b ? b_dims[1] : b_dims[0];
  problem->q = transpose_b ? b_dims[0] : b_dims[1];
  if (b_rows != problem->r) {
    return InvalidArgument("matmul contracted sizes differ: op(a) is [", problem->p, ", ",
                           problem->r, "] but op(b) is [", b_rows, ", ", problem->q, "]");
  }
  if (LeadingProduct(out_dims) != problem->p || out_dims.back() != problem->q) {
    return InvalidArgument("matmul output must hold [", problem->p, ", ", problem->q,
                           "], got ", ShapeString(out_dims));
  }
  if (c != nullptr) {
    const auto c_dims = c->dimensions();
    if (c_dims.size() == 0 || LeadingProduct(c_dims) != problem->p || c_dims.back() != problem->q) {
      return InvalidArgument("matmul accumulator must be [", problem->p, ", ", problem->q,
                             "], got ", ShapeString(c_dims));
    }
    if (c->element_type() != out.element_type()) {
      return InvalidArgument("matmul accumulator dtype ", DataTypeName(c->element_type()),
                             " differs from the output dtype ",
                             DataTypeName(out.element_type()));
    }
  }
  problem->input_type = a.element_type();
  problem->b_type = b.element_type();
  problem->output_type = out.element_type();
  if (IsFp8(problem->input_type) || IsFp8(problem->b_type)) {
    if (!IsFp8(problem->input_type) || !IsFp8(problem->b_type) ||
        (problem->input_type == ffi::DataType::F8E5M2 && problem->b_type == ffi::DataType::F8E5M2)) {
      return InvalidArgument("FP8 matmul inputs must both be FP8 and not both float8_e5m2, got ",
                             DataTypeName(problem->input_type), " and ",
                             DataTypeName(problem->b_type));
    }
    if (transpose_a || !transpose_b) {
      return InvalidArgument("FP8 matmul operands must be K-major: a [P, R], b [Q, R] "
                             "(transpose_a = false, transpose_b = true)");
    }
    if (!IsFloatingInput(problem->output_type)) {
      return InvalidArgument("FP8 matmul output must be float32, bfloat16 or float16, got ",
                             DataTypeName(problem->output_type));
    }
    return ffi::Error::Success();
  }
  if (!IsFloatingInput(problem->input_type) || problem->b_type != problem->input_type) {
    return InvalidArgument("matmul inputs must both be float32, bfloat16 or float16, got ",
                           DataTypeName(a.element_type()), " and ",
                           DataTypeName(b.element_type()));
  }
  if (problem->output_type != problem->input_type &&
      problem->output_type != ffi::DataType::F32) {
    return InvalidArgument("matmul output dtype must be the input dtype or float32, got ",
                           DataTypeName(problem->output_type));
  }
  return ffi::Error::Success();
}

}  // namespace jaxfuse
