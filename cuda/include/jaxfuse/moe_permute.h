// MoE token permutation, as both backends see it.
//
// row_map int32 [T, k] says where copy j of token t lives in the expert-sorted order
// (a permutation of [0, T*k), as jaxfuse's permute builds it). Three handlers, all in
// "token" form (one token's k copies handled together, so no two writers share a row and
// nothing needs atomics; results are deterministic):
//
//   permute:        out[row_map[t, j], :] = x[t, :]                      (a row copy)
//   unpermute:      out[t, :] = sum_j w[t, j] * y[row_map[t, j], :]      (fp32 accumulation)
//   unpermute_bwd:  dy[row_map[t, j], :] = w[t, j] * dout[t, :]
//                   dw[t, j] = sum_h y[row_map[t, j], h] * dout[t, h]   (fp32)
//
// Entries of row_map outside [0, T*k) are skipped (no out-of-bounds access): unpermute
// treats them as zero rows; permute and unpermute_bwd write nothing for them.
#pragma once

#include <cstdint>

#include "jaxfuse/ffi_common.h"
#include "jaxfuse/platform.h"

namespace jaxfuse {

struct PermuteProblem {
  int64_t tokens = 0;  // T
  int64_t topk = 0;    // k
  int64_t hidden = 0;  // H
  int64_t rows = 0;    // T * k
};

inline bool IsFloat(ffi::DataType type) {
  return type == ffi::DataType::F32 || type == ffi::DataType::BF16 ||
         type == ffi::DataType::F16;
}

inline ffi::Error ParseRowMap(const ffi::AnyBuffer& row_map, PermuteProblem* problem) {
  const auto dims = row_map.dimensions();
  if (dims.size() != 2 || row_map.element_type() != ffi::DataType::S32) {
    return InvalidArgument("row_map must be int32 [T, k], got ",
                           DataTypeName(row_map.element_type()), ShapeString(dims));
  }
  problem->tokens = dims[0];
  problem->topk = dims[1];
  problem->rows = dims[0] * dims[1];
  return ffi::Error::Success();
}

// Checks a [rows, H] matrix of a float type.
inline ffi::Error CheckMatrix(const ffi::AnyBuffer& buffer, const char* name, int64_t rows,
                              int64_t hidden, ffi::DataType type) {
  const auto dims = buffer.dimensions();
  if (dims.size() != 2 || dims[0] != rows || dims[1] != hidden || buffer.element_type() != type) {
    return InvalidArgument(name, " must be ", DataTypeName(type), " [", rows, ", ", hidden,
                           "], got ", DataTypeName(buffer.element_type()), ShapeString(dims));
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckWeights(const ffi::AnyBuffer& w, const char* name,
                               const PermuteProblem& p) {
  const auto dims = w.dimensions();
  if (dims.size() != 2 || dims[0] != p.tokens || dims[1] != p.topk ||
      w.element_type() != ffi::DataType::F32) {
    return InvalidArgument(name, " must be float32 [", p.tokens, ", ", p.topk, "], got ",
                           DataTypeName(w.element_type()), ShapeString(dims));
  }
  return ffi::Error::Success();
}

// permute: x [T, H] -> out [T*k, H].
inline ffi::Error ParsePermute(const ffi::AnyBuffer& x, const ffi::AnyBuffer& row_map,
                               const ffi::AnyBuffer& out, PermuteProblem* p) {
  if (auto e = ParseRowMap(row_map, p); e.failure()) return e;
  const auto dims = x.dimensions();
  if (dims.size() != 2 || dims[0] != p->tokens || !IsFloat(x.element_type())) {
    return InvalidArgument("x must be a float [", p->tokens, ", H] matrix, got ",
                           DataTypeName(x.element_type()), ShapeString(dims));
  }
  p->hidden = dims[1];
  return CheckMatrix(out, "out", p->rows, p->hidden, x.element_type());
}

// unpermute: y [T*k, H], w [T, k] -> out [T, H].
inline ffi::Error ParseUnpermute(const ffi::AnyBuffer& y, const ffi::AnyBuffer& row_map,
                                 const ffi::AnyBuffer& w, const ffi::AnyBuffer& out,
                                 PermuteProblem* p) {
  if (auto e = ParseRowMap(row_map, p); e.failure()) return e;
  const auto dims = y.dimensions();
  if (dims.size() != 2 || dims[0] != p->rows || !IsFloat(y.element_type())) {
    return InvalidArgument("y_sorted must be a float [", p->rows, ", H] matrix (T*k rows), got ",
                           DataTypeName(y.element_type()), ShapeString(dims));
  }
  p->hidden = dims[1];
  if (auto e = CheckWeights(w, "combine_weights", *p); e.failure()) return e;
  return CheckMatrix(out, "out", p->tokens, p->hidden, y.element_type());
}

// unpermute_bwd: dout [T, H], y [T*k, H], w [T, k] -> dy [T*k, H], dw f32 [T, k].
inline ffi::Error ParseUnpermuteBwd(const ffi::AnyBuffer& dout, const ffi::AnyBuffer& y,
                                    const ffi::AnyBuffer& row_map, const ffi::AnyBuffer& w,
                                    const ffi::AnyBuffer& dy, const ffi::AnyBuffer& dw,
                                    PermuteProblem* p) {
  if (auto e = ParseUnpermute(y, row_map, w, dout, p); e.failure()) return e;
  if (auto e = CheckMatrix(dy, "d_y_sorted", p->rows, p->hidden, y.element_type()); e.failure()) {
    return e;
  }
  return CheckWeights(dw, "d_combine_weights", *p);
}

JAXFUSE_HOST_DEVICE bool RowInRange(int32_t row, int64_t rows) {
  return row >= 0 && static_cast<int64_t>(row) < rows;
}

}  // namespace jaxfuse
