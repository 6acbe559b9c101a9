// The column-wise copy of a row-grouped FP8 tensor: what the FP8 grouped wgrad reads.
//
// SM90 FP8 tensor cores take both operands K-major, and the wgrad's contraction runs over
// the rows of a group (dw[g] = x[rows_g]^T @ dy[rows_g]). So the FP8 wgrad reads x and dy
// transposed, each group's rows as contiguous columns, and TMA needs every group to start
// on a 16-byte boundary. The layout:
//
//   rowwise data [m, k] (1-byte elements)  ->  columnwise [k, ColumnwiseWidth(m, G)]
//   row r of group g (clamped offsets c_g <= r < c_{g+1})  ->  column ColumnwiseStart(c_g, g)
//                                                                + (r - c_g)
//   every other column (alignment padding, rows of no group) is zero.
//
// ColumnwiseStart(c_g, g) = roundup16(c_g) + 16 g is a closed form: no scan over the group
// sizes, and consecutive groups never overlap (start_g + rows_g <= c_{g+1} + 16 g + 15 <
// start_{g+1}). The width bounds every start + rows and is a multiple of 16 (the row pitch
// TMA needs). c_g are the grouped GEMM's clamped offsets (jaxfuse/grouped_linear.h):
// clamp(offsets[g], 0, m), made non-decreasing.
#pragma once

#include <cstdint>

#include "jaxfuse/platform.h"

namespace jaxfuse {

// Alignment of each group's first column, in elements (16 bytes of FP8).
inline constexpr int64_t kColumnwiseAlign = 16;

JAXFUSE_HOST_DEVICE int64_t ColumnwiseStart(int64_t clamped_offset, int64_t group) {
  return (clamped_offset + kColumnwiseAlign - 1) / kColumnwiseAlign * kColumnwiseAlign +
         kColumnwiseAlign * group;
}

JAXFUSE_HOST_DEVICE int64_t ColumnwiseWidth(int64_t rows, int64_t groups) {
  return (rows + kColumnwiseAlign - 1) / kColumnwiseAlign * kColumnwiseAlign +
         kColumnwiseAlign * groups;
}

}  // namespace jaxfuse
