// The scaled matrix product behind linear_scale_add and its backward pass, as both
// backends see it:
//
//   out[P, Q] = alpha * op(a) @ op(b) (+ c[P, Q] when accumulating into c, in place)
//
// with op(a) = a or a^T ([P, R]) and op(b) = b or b^T ([R, Q]); all buffers row-major.
// The forward pass is (a = x, b = kernel, c = residual); dgrad is (a = dy, b = kernel^T);
// wgrad is (a = x^T, b = dy): alpha rides in every GEMM, never in a separate pass.
#pragma once

#include <cstdint>

#include "jaxfuse/ffi_common.h"

namespace jaxfuse {

struct MatmulProblem {
  int64_t p = 0, q = 0, r = 0;  // out is [p, q]; r is the contracted size
  bool transpose_a = false, transpose_b = false;
  ffi::DataType input_type = ffi::DataType::INVALID;   // a and b
  ffi::DataType output_type = ffi::DataType::INVALID;  // out (and c)
};

inline bool IsFloatingInput(ffi::DataType type) {
  return type == ffi::DataType::F32 || type == ffi::DataType::BF16 ||
         type == ffi::DataType::F16;
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
  problem->output_type = out.element_type();
  if (!IsFloatingInput(problem->input_type) || b.element_type() != problem->input_type) {
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
