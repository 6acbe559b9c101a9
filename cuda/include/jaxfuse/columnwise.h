// The column-wise copy of a row-grouped FP8 tensor: what the FP8 grouped wgrad reads.
//
// SM90 FP8 tensor cores take both operands K-major, and the wgrad's contraction runs over
// the rows of a group (dw[g] = x[rows_g]^T @ dy[rows_g]). So the FP8 wgrad reads x and dy
// transposed, each group's rows as contiguous columns, and TMA needs every group to start
// on a 16-byte boundary.
//
// Columns. Row r of group g (clamped offsets c_g <= r < c_{g+1}) is column
// ColumnwiseStart(c_g, g) + (r - c_g) of a [k, W] transposed tensor, W = ColumnwiseWidth(m,
// G); every other column (alignment padding, rows of no group) is zero.
// ColumnwiseStart(c_g, g) = roundup16(c_g) + 16 g is a closed form: no scan over the group
// sizes, and consecutive groups never overlap (start_g + rows_g <= c_{g+1} + 16 g + 15 <
// start_{g+1}). W bounds every start + rows and is a multiple of 16. c_g are the grouped
// GEMM's clamped offsets (jaxfuse/grouped_linear.h): clamp(offsets[g], 0, m), made
// non-decreasing.
//
// Storage (the blocked layout). The columns are cut into G + 1 blocks at the group starts:
// block b covers columns [ColumnwiseBlockBegin(c_b, b), ColumnwiseBlockBegin(c_{b+1}, b + 1))
// for b < G (group b's columns and the padding after them; block 0 begins at column 0) and
// block G the tail [start_G, W). Each block is stored row-major as its own [k, end - begin]
// matrix, from element k * begin of the buffer:
//
//   column col of block b, row i  ->  k * begin_b + i * (end_b - begin_b) + (col - begin_b)
//
// so the buffer holds k * W elements, as a [k, W] matrix would, and a group's operand is one
// matrix with leading dimension end_b - begin_b (a multiple of 16, about the group's rows).
// Reading the copy as [k, W] with leading dimension W (the layout until f76496db) made the
// FP8 wgrad's TMA boxes span k * W bytes: 5-11% slower at 8 x 8192 rows on the H200
// (logs/check_grouped_gemm_columnwise_layouts_*_s22call2.log under benchmarks/results/).
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

// First column of block b (b in [0, G]; c_b its clamped offset, unused for b == 0): 0 for
// block 0, else group b's start (block G: the tail after the last group).
JAXFUSE_HOST_DEVICE int64_t ColumnwiseBlockBegin(int64_t clamped_offset, int64_t block) {
  return block == 0 ? 0 : ColumnwiseStart(clamped_offset, block);
}

// Element index of row i, column col of the block [begin, end) in a copy of k rows.
JAXFUSE_HOST_DEVICE int64_t ColumnwiseIndex(int64_t k, int64_t begin, int64_t end, int64_t i,
                                            int64_t col) {
  return k * begin + i * (end - begin) + (col - begin);
}

// Blockwise scales of a column-wise copy (Float8BlockScaling's FP8 wgrad): each group's rows
// are cut into blocks of kColumnwiseScaleBlock rows from the group's first row (block j of
// group g: rows c_g + 128 j .. min(c_g + 128 (j + 1), c_{g+1})), and every column of a block
// has its own scale: the wgrad's contraction runs over the rows, so these are the 1 x 128
// blocks of x^T and dy^T along that contraction (DeepSeek-V3's 128 x 1 blocks of x and dy).
// The scales are a float32 [ColumnwiseScaleRows(m, G), k] matrix: block j of group g is row
// ColumnwiseScaleRow(c_g, g) + j, its k scales contiguous (the M- / N-major scale layout of
// CUTLASS's blockwise mainloop, so group g's scales are one [blocks_g, k] matrix from that
// row). Like ColumnwiseStart a closed form: floor(c_g / 128) + g never lets consecutive
// groups overlap (ceil(L / 128) <= floor((c + L) / 128) - floor(c / 128) + 1), and the
// rows of no block (between groups, past the last) hold 1.
inline constexpr int64_t kColumnwiseScaleBlock = 128;

JAXFUSE_HOST_DEVICE int64_t ColumnwiseScaleRow(int64_t clamped_offset, int64_t group) {
  return clamped_offset / kColumnwiseScaleBlock + group;
}

JAXFUSE_HOST_DEVICE int64_t ColumnwiseScaleRows(int64_t rows, int64_t groups) {
  return (rows + kColumnwiseScaleBlock - 1) / kColumnwiseScaleBlock + groups;
}

// Blocks of a group of `group_rows` rows (0 for an empty group).
JAXFUSE_HOST_DEVICE int64_t ColumnwiseScaleBlocks(int64_t group_rows) {
  return (group_rows + kColumnwiseScaleBlock - 1) / kColumnwiseScaleBlock;
}

}  // namespace jaxfuse
