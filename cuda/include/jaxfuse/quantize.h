// Shared pieces of the quantization handlers: group lookup from device offsets (both
// backends), argument parsing, and the CPU reference implementation of every scaling mode.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "jaxfuse/columnwise.h"
#include "jaxfuse/ffi_common.h"
#include "jaxfuse/fp8.h"
#include "jaxfuse/grouped_linear.h"
#include "jaxfuse/numeric.h"
#include "jaxfuse/platform.h"
#include "jaxfuse/scaled_activation.h"

namespace jaxfuse {

// offsets[i] read from device data clamped into [0, rows]: garbage never indexes memory.
JAXFUSE_HOST_DEVICE int64_t ClampedOffset(const int32_t* offsets, int64_t i, int64_t rows) {
  const int64_t value = offsets[i];
  return value < 0 ? 0 : (value > rows ? rows : value);
}

// The group g with offsets[g] <= row < offsets[g + 1], or num_groups when the row lies past
// offsets[num_groups] (the rows no group covers). Offsets are non-decreasing when they come
// from group_offsets; any other content still yields an index in [0, num_groups].
JAXFUSE_HOST_DEVICE int64_t GroupOfRow(const int32_t* offsets, int64_t num_groups, int64_t row,
                                       int64_t rows) {
  int64_t lo = 0, hi = num_groups;  // answer in [lo, hi]: number of offsets[1..G] <= row
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (ClampedOffset(offsets, mid + 1, rows) <= row) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

inline bool IsFloatType(ffi::DataType type) {
  return type == ffi::DataType::F32 || type == ffi::DataType::BF16 || type == ffi::DataType::F16;
}

inline ffi::Error Fp8FormatOf(ffi::DataType type, Fp8Format* format) {
  if (type == ffi::DataType::F8E4M3FN) {
    *format = Fp8Format::kE4M3;
  } else if (type == ffi::DataType::F8E5M2) {
    *format = Fp8Format::kE5M2;
  } else {
    return InvalidArgument("quantized data must be float8_e4m3fn or float8_e5m2, got ",
                           DataTypeName(type));
  }
  return ffi::Error::Success();
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The layout of one quantization: values [batch, rows, cols] (batch > 1 only for 2-D
// blocks), groups for current scaling.
struct QuantizeProblem {
  ScalingMode mode = ScalingMode::kCurrent;
  int64_t block = 0;
  int64_t batch = 1, rows = 0, cols = 0;
  int64_t num_groups = 0;
  Fp8Format format = Fp8Format::kE4M3;
};

// Checks the shapes of data / scale_inv / amax for a problem whose rows and cols are set.
inline ffi::Error CheckQuantizeOutputs(QuantizeProblem& problem, const ffi::AnyBuffer& offsets,
                                       const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale_inv,
                                       const ffi::AnyBuffer& amax, int32_t mode, int32_t block) {
  if (mode < 0 || mode > 3) return InvalidArgument("unknown scaling mode ", mode);
  problem.mode = static_cast<ScalingMode>(mode);
  problem.block = block;
  if (auto error = Fp8FormatOf(data.element_type(), &problem.format); error.failure()) return error;
  if (offsets.element_type() != ffi::DataType::S32 || offsets.dimensions().size() != 1 ||
      offsets.dimensions()[0] < 1) {
    return InvalidArgument("group offsets must be int32 [G + 1], got ",
                           DataTypeName(offsets.element_type()), " ",
                           ShapeString(offsets.dimensions()));
  }
  problem.num_groups = offsets.dimensions()[0] - 1;
  const int64_t total = problem.batch * problem.rows;
  if (problem.mode == ScalingMode::kCurrent) {
    if (scale_inv.element_type() != ffi::DataType::F32 ||
        scale_inv.element_count() != static_cast<size_t>(problem.num_groups) ||
        amax.element_count() != static_cast<size_t>(problem.num_groups)) {
      return InvalidArgument("current scaling needs float32 scale_inv and amax of ",
                             problem.num_groups, " groups, got ",
                             ShapeString(scale_inv.dimensions()), " and ",
                             ShapeString(amax.dimensions()));
    }
    return ffi::Error::Success();
  }
  if (block <= 0 || block % 8 != 0) return InvalidArgument("block size must be a positive multiple of 8, got ", block);
  const bool mx = problem.mode == ScalingMode::kMxfp8;
  const ffi::DataType want = mx ? ffi::DataType::U8 : ffi::DataType::F32;
  int64_t count = total * CeilDiv(problem.cols, block);
  if (problem.mode == ScalingMode::kBlock2D) {
    count = problem.batch * CeilDiv(problem.rows, block) * CeilDiv(problem.cols, block);
  }
  if (scale_inv.element_type() != want || scale_inv.element_count() != static_cast<size_t>(count)) {
    return InvalidArgument("block scaling needs ", DataTypeName(want), " scale_inv with ", count,
                           " elements, got ", DataTypeName(scale_inv.element_type()), " ",
                           ShapeString(scale_inv.dimensions()));
  }
  return ffi::Error::Success();
}

// Transposed quantization with given amaxes (the FP8 forward weights of the grouped GEMM:
// kernel [G, K, N] -> K-major [G, N, K]): x [B, R, C] float -> data [B, C, R] FP8 with
// data[b, c, r] = fp8(x[b, r, c] * scale[b]), scale[b] = ScaleFromAmax(amax[b]) and
// scale_inv[b] = 1 / scale[b]. The amaxes come from the caller (batch_amax below, its own
// op so that it is partitioned as a reduction), which keeps this kernel free of them.
// Optionally the same FP8 values untransposed too, [B, R, C] (the grouped GEMM's FP8 dgrad
// takes the weight that way): one more byte written per element instead of an XLA
// transpose of the FP8 data later (a byte read and a byte written).
struct TransposedProblem {
  int64_t batch = 0, rows = 0, cols = 0;
  Fp8Format format = Fp8Format::kE4M3;
  bool untransposed = false;  // data_untransposed is [B, R, C] (else [0])
};

// The layout both transposed quantizations share: x [B, R, C] float, data [B, C, R] FP8
// (its dtype gives the format), data_untransposed [B, R, C] of data's dtype or [0]. `op`
// prefixes the messages.
inline ffi::Error ParseTransposedLayout(const char* op, const ffi::AnyBuffer& x,
                                        const ffi::AnyBuffer& data,
                                        const ffi::AnyBuffer& data_untransposed,
                                        TransposedProblem* problem) {
  const auto dims = x.dimensions();
  if (dims.size() != 3 || !IsFloatType(x.element_type())) {
    return InvalidArgument(op, ": x must be a float32/bfloat16/float16 array [B, R, C], got ",
                           DataTypeName(x.element_type()), " ", ShapeString(dims));
  }
  problem->batch = dims[0];
  problem->rows = dims[1];
  problem->cols = dims[2];
  if (auto error = Fp8FormatOf(data.element_type(), &problem->format); error.failure()) {
    return error;
  }
  const auto data_dims = data.dimensions();
  if (data_dims.size() != 3 || data_dims[0] != problem->batch ||
      data_dims[1] != problem->cols || data_dims[2] != problem->rows) {
    return InvalidArgument(op, ": data must be [B, C, R] = [", problem->batch, ", ",
                           problem->cols, ", ", problem->rows, "], got ",
                           ShapeString(data_dims));
  }
  const auto straight_dims = data_untransposed.dimensions();
  problem->untransposed = straight_dims.size() == 3;
  const bool empty = straight_dims.size() == 1 && straight_dims[0] == 0;
  if (data_untransposed.element_type() != data.element_type() ||
      !(empty || (problem->untransposed && straight_dims[0] == problem->batch &&
                  straight_dims[1] == problem->rows && straight_dims[2] == problem->cols))) {
    return InvalidArgument(op, ": data_untransposed must be [B, R, C] = [", problem->batch,
                           ", ", problem->rows, ", ", problem->cols,
                           "] or [0] in data's dtype, got ",
                           DataTypeName(data_untransposed.element_type()), " ",
                           ShapeString(straight_dims));
  }
  return ffi::Error::Success();
}

// scale_inv of the per-batch transposed quantizations: float32, B values.
inline ffi::Error CheckBatchScaleInv(const char* op, const ffi::AnyBuffer& scale_inv,
                                     int64_t batch) {
  if (scale_inv.element_type() != ffi::DataType::F32 ||
      scale_inv.element_count() != static_cast<size_t>(batch)) {
    return InvalidArgument(op, ": scale_inv must be float32 [B = ", batch, "], got ",
                           DataTypeName(scale_inv.element_type()), " ",
                           ShapeString(scale_inv.dimensions()));
  }
  return ffi::Error::Success();
}

inline ffi::Error ParseQuantizeTransposed(const ffi::AnyBuffer& x, const ffi::AnyBuffer& amax,
                                          const ffi::AnyBuffer& data,
                                          const ffi::AnyBuffer& scale_inv,
                                          const ffi::AnyBuffer& data_untransposed,
                                          TransposedProblem* problem) {
  if (auto error = ParseTransposedLayout("quantize_transposed", x, data, data_untransposed,
                                         problem);
      error.failure()) {
    return error;
  }
  const auto amax_dims = amax.dimensions();
  if (amax.element_type() != ffi::DataType::F32 || amax_dims.size() != 1 ||
      amax_dims[0] != problem->batch) {
    return InvalidArgument("quantize_transposed: amax must be float32 [B = ", problem->batch,
                           "], got ", DataTypeName(amax.element_type()), " ",
                           ShapeString(amax_dims));
  }
  return CheckBatchScaleInv("quantize_transposed", scale_inv, problem->batch);
}

// Per-batch current scaling written transposed, amax included (quantize_batches_transposed):
// quantize_transposed's outputs with amax[b] = max |x[b]| (NaN counted as 0) found by the op
// itself, plus scratch uint32 [2, B] (the CUDA handler's amaxes and arrival counters; the
// host handler leaves it alone).
inline ffi::Error ParseQuantizeBatchesTransposed(const ffi::AnyBuffer& x,
                                                 const ffi::AnyBuffer& data,
                                                 const ffi::AnyBuffer& scale_inv,
                                                 const ffi::AnyBuffer& data_untransposed,
                                                 const ffi::AnyBuffer& scratch,
                                                 TransposedProblem* problem) {
  if (auto error = ParseTransposedLayout("quantize_batches_transposed", x, data,
                                         data_untransposed, problem);
      error.failure()) {
    return error;
  }
  if (auto error = CheckBatchScaleInv("quantize_batches_transposed", scale_inv, problem->batch);
      error.failure()) {
    return error;
  }
  const auto scratch_dims = scratch.dimensions();
  if (scratch.element_type() != ffi::DataType::U32 || scratch_dims.size() != 2 ||
      scratch_dims[0] != 2 || scratch_dims[1] != problem->batch) {
    return InvalidArgument("quantize_batches_transposed: scratch must be uint32 [2, B = ",
                           problem->batch, "], got ", DataTypeName(scratch.element_type()),
                           " ", ShapeString(scratch_dims));
  }
  return ffi::Error::Success();
}

// The weight tiles of the blockwise FP8 grouped GEMM (Float8BlockScaling's 2-D blocks).
inline constexpr int64_t kWeightBlock = 128;

// Transposed quantization with one scale per kWeightBlock x kWeightBlock tile (the
// blockwise grouped GEMM's weights, both layouts from one pass): x [B, R, C] float ->
// data [B, C, R] FP8 with data[b, c, r] = fp8(x[b, r, c] * scale[b, r / 128, c / 128]),
// scale[b, i, j] = ScaleFromAmax of the tile's amax (partial tiles at the edges, NaN
// counted as 0), scale_inv float32 [B, ceil(R / 128), ceil(C / 128)] = 1 / scale, and
// data_untransposed as for quantize_transposed. The same bits as the 2-D block
// quantization (block 128) of x, transposed.
inline ffi::Error ParseQuantizeBlocksTransposed(const ffi::AnyBuffer& x,
                                                const ffi::AnyBuffer& data,
                                                const ffi::AnyBuffer& scale_inv,
                                                const ffi::AnyBuffer& data_untransposed,
                                                TransposedProblem* problem) {
  if (auto error = ParseTransposedLayout("quantize_blocks_transposed", x, data,
                                         data_untransposed, problem);
      error.failure()) {
    return error;
  }
  const int64_t row_blocks = CeilDiv(problem->rows, kWeightBlock);
  const int64_t col_blocks = CeilDiv(problem->cols, kWeightBlock);
  const auto dims = scale_inv.dimensions();
  if (scale_inv.element_type() != ffi::DataType::F32 || dims.size() != 3 ||
      dims[0] != problem->batch || dims[1] != row_blocks || dims[2] != col_blocks) {
    return InvalidArgument("quantize_blocks_transposed: scale_inv must be float32 [B, ceil(R / ",
                           kWeightBlock, "), ceil(C / ", kWeightBlock, ")] = [",
                           problem->batch, ", ", row_blocks, ", ", col_blocks, "], got ",
                           DataTypeName(scale_inv.element_type()), " ", ShapeString(dims));
  }
  return ffi::Error::Success();
}

// Per-batch amax of x [B, R, C] float -> amax float32 [B]: max |x[b]| over the batch's
// R x C elements, NaN counted as 0 (as in every quantize kernel), 0 for an empty batch.
// Pass 1 of per-tensor current scaling for quantize_transposed, as its own op so that
// XLA partitions it like a reduction (a sharded R or C is combined with pmax).
struct BatchAmaxProblem {
  int64_t batch = 0, elements = 0;  // elements per batch: R * C
};

inline ffi::Error ParseBatchAmax(const ffi::AnyBuffer& x, const ffi::AnyBuffer& amax,
                                 BatchAmaxProblem* problem) {
  const auto dims = x.dimensions();
  if (dims.size() != 3 || !IsFloatType(x.element_type())) {
    return InvalidArgument("batch_amax: x must be a float32/bfloat16/float16 array [B, R, C], "
                           "got ", DataTypeName(x.element_type()), " ", ShapeString(dims));
  }
  problem->batch = dims[0];
  problem->elements = dims[1] * dims[2];
  const auto amax_dims = amax.dimensions();
  if (amax.element_type() != ffi::DataType::F32 || amax_dims.size() != 1 ||
      amax_dims[0] != problem->batch) {
    return InvalidArgument("batch_amax: amax must be float32 [B = ", problem->batch, "], got ",
                           DataTypeName(amax.element_type()), " ", ShapeString(amax_dims));
  }
  return ffi::Error::Success();
}

// --- The columnwise copy of row-grouped FP8 data (jaxfuse/columnwise.h) -------------
// Most groups the CUDA kernel holds in shared memory (its clamped offsets, 4 bytes each,
// within the 48 KB a launch gets without opting in).
inline constexpr int64_t kColumnwiseMaxGroups = 4096;

struct ColumnwiseProblem {
  int64_t rows = 0, cols = 0, groups = 0, width = 0;
};

// data [m, k] 1-byte (FP8), offsets int32 [G + 1], out [k, ColumnwiseWidth(m, G)] of
// data's dtype.
inline ffi::Error ParseColumnwise(const ffi::AnyBuffer& data, const ffi::AnyBuffer& offsets,
                                  const ffi::AnyBuffer& out, ColumnwiseProblem* problem) {
  const auto dims = data.dimensions();
  const auto o_dims = offsets.dimensions();
  if (dims.size() != 2 || (data.element_type() != ffi::DataType::F8E4M3FN &&
                           data.element_type() != ffi::DataType::F8E5M2)) {
    return InvalidArgument("group_columnwise: data must be float8_e4m3fn or float8_e5m2 "
                           "[M, K], got ", DataTypeName(data.element_type()), " ",
                           ShapeString(dims));
  }
  if (o_dims.size() != 1 || o_dims[0] < 2 || offsets.element_type() != ffi::DataType::S32) {
    return InvalidArgument("group_columnwise: group_offsets must be int32 [G + 1] with G >= 1, "
                           "got ", DataTypeName(offsets.element_type()), ShapeString(o_dims));
  }
  problem->rows = dims[0];
  problem->cols = dims[1];
  problem->groups = o_dims[0] - 1;
  if (problem->groups > kColumnwiseMaxGroups) {
    return InvalidArgument("group_columnwise: at most ", kColumnwiseMaxGroups,
                           " groups, got ", problem->groups);
  }
  problem->width = ColumnwiseWidth(problem->rows, problem->groups);
  const auto out_dims = out.dimensions();
  if (out.element_type() != data.element_type() || out_dims.size() != 2 ||
      out_dims[0] != problem->cols || out_dims[1] != problem->width) {
    return InvalidArgument("group_columnwise: out must be ", DataTypeName(data.element_type()),
                           " [K, ColumnwiseWidth(M, G)] = [", problem->cols, ", ",
                           problem->width, "], got ", DataTypeName(out.element_type()), " ",
                           ShapeString(out_dims));
  }
  return ffi::Error::Success();
}

// The column-wise copy that a current-scaling quantization writes besides its row-wise
// data when asked (`columnwise` not empty): the FP8 wgrad's operand, the same bytes as
// group_columnwise(data, offsets) would make of the row-wise result, without that second
// pass over the FP8 data. Sets *wanted; requires per-group current scaling of [rows, cols]
// values (batch 1) and columnwise of data's dtype, [cols, ColumnwiseWidth(rows, G)].
inline ffi::Error CheckColumnwiseOutput(const QuantizeProblem& problem,
                                        const ffi::AnyBuffer& data,
                                        const ffi::AnyBuffer& columnwise,
                                        ColumnwiseProblem* copy, bool* wanted) {
  *wanted = columnwise.element_count() != 0;
  if (!*wanted) return ffi::Error::Success();
  if (problem.mode != ScalingMode::kCurrent || problem.batch != 1) {
    return InvalidArgument("columnwise: the column-wise copy is written by current scaling "
                           "only (scaling mode per_tensor or per_group)");
  }
  if (problem.num_groups < 1 || problem.num_groups > kColumnwiseMaxGroups) {
    return InvalidArgument("columnwise: needs 1 to ", kColumnwiseMaxGroups, " groups, got ",
                           problem.num_groups);
  }
  copy->rows = problem.rows;
  copy->cols = problem.cols;
  copy->groups = problem.num_groups;
  copy->width = ColumnwiseWidth(problem.rows, problem.num_groups);
  const auto dims = columnwise.dimensions();
  if (columnwise.element_type() != data.element_type() || dims.size() != 2 ||
      dims[0] != copy->cols || dims[1] != copy->width) {
    return InvalidArgument("columnwise must be ", DataTypeName(data.element_type()),
                           " [K, ColumnwiseWidth(M, G)] = [", copy->cols, ", ", copy->width,
                           "] (or empty), got ", DataTypeName(columnwise.element_type()), " ",
                           ShapeString(dims));
  }
  return ffi::Error::Success();
}

// The blockwise-scaled column-wise copy (Float8BlockScaling's FP8 grouped wgrad,
// jaxfuse/columnwise.h): x [rows, cols] float with its rows grouped by offsets int32
// [G + 1] -> data FP8 [cols, ColumnwiseWidth(rows, G)] in the blocked column-wise layout
// (row r of group g is column ColumnwiseStart(c_g, g) + r - c_g; every other column zero)
// and scale_inv float32 [ColumnwiseScaleRows(rows, G), cols]: block j of group g (rows
// c_g + 128 j .. min(c_g + 128 (j + 1), c_{g+1})) is scale row ColumnwiseScaleRow(c_g, g) +
// j, one scale per column of x; rows of no block hold 1. Each (block, column) is quantized
// as the 1 x 128 block quantization (block_1d) quantizes that block's values of the column
// as one row: the same amax (NaN counted as 0), ScaleFromAmax, rounding and scale_inv.
// The FP8 format is data's dtype.
struct ColumnwiseBlocksProblem {
  int64_t rows = 0, cols = 0, groups = 0, width = 0, scale_rows = 0;
  Fp8Format format = Fp8Format::kE4M3;
};

inline ffi::Error ParseQuantizeColumnwiseBlocks(const ffi::AnyBuffer& x,
                                                const ffi::AnyBuffer& offsets,
                                                const ffi::AnyBuffer& data,
                                                const ffi::AnyBuffer& scale_inv,
                                                ColumnwiseBlocksProblem* problem) {
  const auto dims = x.dimensions();
  if (dims.size() != 2 || !IsFloatType(x.element_type())) {
    return InvalidArgument("quantize_columnwise_blocks: x must be a float32/bfloat16/float16 "
                           "array [M, C], got ", DataTypeName(x.element_type()), " ",
                           ShapeString(dims));
  }
  const auto o_dims = offsets.dimensions();
  if (o_dims.size() != 1 || o_dims[0] < 2 || offsets.element_type() != ffi::DataType::S32) {
    return InvalidArgument("quantize_columnwise_blocks: group_offsets must be int32 [G + 1] "
                           "with G >= 1, got ", DataTypeName(offsets.element_type()), " ",
                           ShapeString(o_dims));
  }
  problem->rows = dims[0];
  problem->cols = dims[1];
  problem->groups = o_dims[0] - 1;
  if (problem->groups > kColumnwiseMaxGroups) {
    return InvalidArgument("quantize_columnwise_blocks: at most ", kColumnwiseMaxGroups,
                           " groups, got ", problem->groups);
  }
  problem->width = ColumnwiseWidth(problem->rows, problem->groups);
  problem->scale_rows = ColumnwiseScaleRows(problem->rows, problem->groups);
  if (auto error = Fp8FormatOf(data.element_type(), &problem->format); error.failure()) {
    return error;
  }
  const auto data_dims = data.dimensions();
  if (data_dims.size() != 2 || data_dims[0] != problem->cols ||
      data_dims[1] != problem->width) {
    return InvalidArgument("quantize_columnwise_blocks: data must be [C, ColumnwiseWidth(M, G)]"
                           " = [", problem->cols, ", ", problem->width, "], got ",
                           ShapeString(data_dims));
  }
  const auto scale_dims = scale_inv.dimensions();
  if (scale_inv.element_type() != ffi::DataType::F32 || scale_dims.size() != 2 ||
      scale_dims[0] != problem->scale_rows || scale_dims[1] != problem->cols) {
    return InvalidArgument("quantize_columnwise_blocks: scale_inv must be float32 "
                           "[ColumnwiseScaleRows(M, G), C] = [", problem->scale_rows, ", ",
                           problem->cols, "], got ", DataTypeName(scale_inv.element_type()),
                           " ", ShapeString(scale_dims));
  }
  return ffi::Error::Success();
}

#if !defined(__CUDACC__)
// --- CPU reference implementation (plain loops) ------------------------------------

inline float LoadAsFloat(const void* base, ffi::DataType type, int64_t index) {
  switch (type) {
    case ffi::DataType::F32: return static_cast<const float*>(base)[index];
    case ffi::DataType::BF16: return ToFloat(static_cast<const bfloat16_bits*>(base)[index]);
    default: return ToFloat(static_cast<const float16_bits*>(base)[index]);
  }
}

inline void StoreFromFloat(void* base, ffi::DataType type, int64_t index, float value) {
  switch (type) {
    case ffi::DataType::F32: static_cast<float*>(base)[index] = value; break;
    case ffi::DataType::BF16: static_cast<bfloat16_bits*>(base)[index] = ToBFloat16(value); break;
    default: static_cast<float16_bits*>(base)[index] = ToFloat16(value); break;
  }
}

inline std::vector<float> ToFloatVector(const ffi::AnyBuffer& buffer) {
  std::vector<float> values(buffer.element_count());
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = LoadAsFloat(buffer.untyped_data(), buffer.element_type(), static_cast<int64_t>(i));
  }
  return values;
}

// Quantizes values [batch * rows, cols] (fp32) into data, scale_inv and amax.
// Current scaling takes the group amaxes from given_amax when it is not null (quantize_
// gathered: computed by the caller) instead of from the values.
inline void QuantizeCpu(const QuantizeProblem& p, const float* values, const int32_t* offsets,
                        uint8_t* data, void* scale_inv, float* amax_out,
                        const float* given_amax = nullptr) {
  const float fp8_max = Fp8Max(p.format);
  const int64_t total_rows = p.batch * p.rows;
  const int64_t cols = p.cols;
  auto quantize = [&](float v, float scale) {
    return FloatToFp8(v * scale, p.format);
  };
  if (p.mode == ScalingMode::kCurrent) {
    const int64_t groups = p.num_groups;
    std::vector<float> amax(groups, 0.0f);
    if (given_amax != nullptr) {
      amax.assign(given_amax, given_amax + groups);
    } else {
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t begin = ClampedOffset(offsets, g, total_rows);
        const int64_t end = std::max(begin, ClampedOffset(offsets, g + 1, total_rows));
        for (int64_t i = begin * cols; i < end * cols; ++i) amax[g] = std::max(amax[g], AbsForAmax(values[i]));
      }
    }
    std::vector<float> scale(groups);
    for (int64_t g = 0; g < groups; ++g) {
      scale[g] = ScaleFromAmax(amax[g], fp8_max);
      static_cast<float*>(scale_inv)[g] = 1.0f / scale[g];
      amax_out[g] = amax[g];
    }
    for (int64_t r = 0; r < total_rows; ++r) {
      const int64_t g = GroupOfRow(offsets, groups, r, total_rows);
      for (int64_t c = 0; c < cols; ++c) {
        data[r * cols + c] = g < groups ? quantize(values[r * cols + c], scale[g]) : 0;
      }
    }
    return;
  }
  amax_out[0] = 0.0f;
  const int64_t block = p.block;
  const int64_t col_blocks = CeilDiv(cols, block);
  if (p.mode == ScalingMode::kBlock2D) {
    const int64_t row_blocks = CeilDiv(p.rows, block);
    for (int64_t b = 0; b < p.batch; ++b) {
      for (int64_t rb = 0; rb < row_blocks; ++rb) {
        for (int64_t cb = 0; cb < col_blocks; ++cb) {
          const int64_t r0 = b * p.rows + rb * block, r1 = b * p.rows + std::min(p.rows, (rb + 1) * block);
          const int64_t c0 = cb * block, c1 = std::min(cols, c0 + block);
          float amax = 0.0f;
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, AbsForAmax(values[r * cols + c]));
          const float scale = ScaleFromAmax(amax, fp8_max);
          static_cast<float*>(scale_inv)[(b * row_blocks + rb) * col_blocks + cb] = 1.0f / scale;
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t c = c0; c < c1; ++c) data[r * cols + c] = quantize(values[r * cols + c], scale);
        }
      }
    }
    return;
  }
  const bool mx = p.mode == ScalingMode::kMxfp8;
  for (int64_t r = 0; r < total_rows; ++r) {
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      const int64_t c0 = cb * block, c1 = std::min(cols, c0 + block);
      float amax = 0.0f;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, AbsForAmax(values[r * cols + c]));
      float scale;
      if (mx) {
        const uint8_t e = E8M0FromAmax(amax, fp8_max);
        static_cast<uint8_t*>(scale_inv)[r * col_blocks + cb] = e;
        scale = E8M0InverseToFloat(e);
      } else {
        scale = ScaleFromAmax(amax, fp8_max);
        static_cast<float*>(scale_inv)[r * col_blocks + cb] = 1.0f / scale;
      }
      for (int64_t c = c0; c < c1; ++c) data[r * cols + c] = quantize(values[r * cols + c], scale);
    }
  }
}
// The per-batch amax above, on the host.
inline void BatchAmaxCpu(const BatchAmaxProblem& p, const ffi::AnyBuffer& x, float* amax) {
  for (int64_t b = 0; b < p.batch; ++b) {
    float value = 0.0f;
    for (int64_t i = 0; i < p.elements; ++i) {
      const float magnitude =
          std::fabs(LoadAsFloat(x.untyped_data(), x.element_type(), b * p.elements + i));
      if (magnitude > value) value = magnitude;  // false for NaN: it counts as 0
    }
    amax[b] = value;
  }
}
// The transposed quantization above, on the host.
inline void QuantizeTransposedCpu(const TransposedProblem& p, const ffi::AnyBuffer& x,
                                  const float* amax, uint8_t* data, float* scale_inv,
                                  uint8_t* data_untransposed) {
  const float fp8_max = Fp8Max(p.format);
  for (int64_t b = 0; b < p.batch; ++b) {
    const float scale = ScaleFromAmax(amax[b], fp8_max);
    scale_inv[b] = 1.0f / scale;
    const int64_t in = b * p.rows * p.cols;
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t c = 0; c < p.cols; ++c) {
        const float value = LoadAsFloat(x.untyped_data(), x.element_type(), in + r * p.cols + c);
        const uint8_t code = FloatToFp8(value * scale, p.format);
        data[in + c * p.rows + r] = code;
        if (p.untransposed) data_untransposed[in + r * p.cols + c] = code;
      }
    }
  }
}
// The tile-scaled transposed quantization above, on the host: the block_2d loop of
// QuantizeCpu (same amax, scale and rounding) with the two layouts as outputs.
inline void QuantizeBlocksTransposedCpu(const TransposedProblem& p, const ffi::AnyBuffer& x,
                                        uint8_t* data, float* scale_inv,
                                        uint8_t* data_untransposed) {
  const float fp8_max = Fp8Max(p.format);
  const int64_t row_blocks = CeilDiv(p.rows, kWeightBlock);
  const int64_t col_blocks = CeilDiv(p.cols, kWeightBlock);
  const auto value = [&](int64_t index) {
    return LoadAsFloat(x.untyped_data(), x.element_type(), index);
  };
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t in = b * p.rows * p.cols;
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      for (int64_t cb = 0; cb < col_blocks; ++cb) {
        const int64_t r0 = rb * kWeightBlock, r1 = std::min(p.rows, r0 + kWeightBlock);
        const int64_t c0 = cb * kWeightBlock, c1 = std::min(p.cols, c0 + kWeightBlock);
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = c0; c < c1; ++c) {
            amax = std::max(amax, AbsForAmax(value(in + r * p.cols + c)));
          }
        }
        const float scale = ScaleFromAmax(amax, fp8_max);
        scale_inv[(b * row_blocks + rb) * col_blocks + cb] = 1.0f / scale;
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = c0; c < c1; ++c) {
            const uint8_t code = FloatToFp8(value(in + r * p.cols + c) * scale, p.format);
            data[in + c * p.rows + r] = code;
            if (p.untransposed) data_untransposed[in + r * p.cols + c] = code;
          }
        }
      }
    }
  }
}
// The columnwise copy on the host (CPU handler and tests): jaxfuse/columnwise.h's layout,
// zeros in every column that holds no row.
inline void ColumnwiseCpu(const ColumnwiseProblem& p, const uint8_t* data,
                          const int32_t* offsets, uint8_t* out) {
  std::fill(out, out + p.cols * p.width, uint8_t{0});
  // c_g exactly as the grouped GEMM (and its wgrad reading this copy) clamps them.
  const std::vector<int64_t> clamped = ClampOffsets(offsets, p.groups, p.rows);
  for (int64_t g = 0; g < p.groups; ++g) {  // the tail block (after the last group) stays zero
    const int64_t begin = ColumnwiseBlockBegin(clamped[g], g);
    const int64_t end = ColumnwiseStart(clamped[g + 1], g + 1);
    const int64_t start = ColumnwiseStart(clamped[g], g);
    for (int64_t r = clamped[g]; r < clamped[g + 1]; ++r) {
      const int64_t col = start + (r - clamped[g]);
      for (int64_t i = 0; i < p.cols; ++i) {
        out[ColumnwiseIndex(p.cols, begin, end, i, col)] = data[r * p.cols + i];
      }
    }
  }
}
// The blockwise-scaled column-wise copy above, on the host: every column and scale row
// first set to its "no block" value (0, 1), then each block's columns as block_1d's loop
// in QuantizeCpu quantizes a block of a row.
inline void QuantizeColumnwiseBlocksCpu(const ColumnwiseBlocksProblem& p, const ffi::AnyBuffer& x,
                                        const int32_t* offsets, uint8_t* data,
                                        float* scale_inv) {
  std::fill(data, data + p.cols * p.width, uint8_t{0});
  std::fill(scale_inv, scale_inv + p.scale_rows * p.cols, 1.0f);
  const float fp8_max = Fp8Max(p.format);
  const auto value = [&](int64_t row, int64_t col) {
    return LoadAsFloat(x.untyped_data(), x.element_type(), row * p.cols + col);
  };
  // c_g exactly as the grouped GEMM (and the wgrad reading this copy) clamps them.
  const std::vector<int64_t> clamped = ClampOffsets(offsets, p.groups, p.rows);
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t begin = ColumnwiseBlockBegin(clamped[g], g);
    const int64_t end = ColumnwiseStart(clamped[g + 1], g + 1);
    const int64_t start = ColumnwiseStart(clamped[g], g);
    const int64_t first_scale_row = ColumnwiseScaleRow(clamped[g], g);
    for (int64_t r0 = clamped[g], j = 0; r0 < clamped[g + 1]; r0 += kColumnwiseScaleBlock, ++j) {
      const int64_t r1 = std::min(clamped[g + 1], r0 + kColumnwiseScaleBlock);
      for (int64_t i = 0; i < p.cols; ++i) {
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; ++r) amax = std::max(amax, AbsForAmax(value(r, i)));
        const float scale = ScaleFromAmax(amax, fp8_max);
        scale_inv[(first_scale_row + j) * p.cols + i] = 1.0f / scale;
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t col = start + (r - clamped[g]);
          data[ColumnwiseIndex(p.cols, begin, end, i, col)] = FloatToFp8(value(r, i) * scale,
                                                                         p.format);
        }
      }
    }
  }
}
#endif  // !defined(__CUDACC__)

// Shapes, dtypes and modes of the fused activation-gradient + quantization (both backends):
// dy [rows, F], x [rows, W] (W = 2F for GLU kinds), dx (x's shape, or empty when not
// requested), dscales float32 [rows], and the quantized outputs of dx.
inline ffi::Error ParseDactivationQuantize(
    const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x, const ffi::AnyBuffer& scales,
    const ffi::AnyBuffer& offsets, const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale_inv,
    const ffi::AnyBuffer& dx, const ffi::AnyBuffer& dscales, const ffi::AnyBuffer& amax,
    int32_t activation, float limit, float alpha, float linear_offset, int32_t mode,
    int32_t block, ActivationProblem* act, QuantizeProblem* problem) {
  if (auto error = ParseActivationBackward(dy, x, scales, dx, dscales, activation, limit, alpha,
                                           linear_offset, /*dx_optional=*/true, act);
      error.failure()) {
    return error;
  }
  if (mode == static_cast<int32_t>(ScalingMode::kBlock2D)) {
    return InvalidArgument("2-D block scaling is for weights, not activation gradients");
  }
  problem->rows = act->rows;
  problem->cols = act->in_cols;
  return CheckQuantizeOutputs(*problem, offsets, data, scale_inv, amax, mode, block);
}

// Shapes and dtypes of quantize_gathered (both backends): x [sources, K] float, source_rows
// int32 [rows], group offsets int32 [G + 1], the given group amaxes float32 [G], data FP8
// [rows, K] and scale_inv float32 [G]. Fills a per-group current-scaling problem.
inline ffi::Error ParseQuantizeGathered(const ffi::AnyBuffer& x, const ffi::AnyBuffer& source_rows,
                                        const ffi::AnyBuffer& offsets, const ffi::AnyBuffer& amax,
                                        const ffi::AnyBuffer& data,
                                        const ffi::AnyBuffer& scale_inv,
                                        QuantizeProblem* problem) {
  const auto dims = x.dimensions();
  if (dims.size() != 2 || !IsFloatType(x.element_type())) {
    return InvalidArgument("quantize_gathered: x must be a float32/bfloat16/float16 [T, K] "
                           "array, got ", DataTypeName(x.element_type()), " ",
                           ShapeString(dims));
  }
  if (source_rows.element_type() != ffi::DataType::S32 ||
      source_rows.dimensions().size() != 1) {
    return InvalidArgument("quantize_gathered: source_rows must be int32 [M], got ",
                           DataTypeName(source_rows.element_type()), " ",
                           ShapeString(source_rows.dimensions()));
  }
  if (amax.element_type() != ffi::DataType::F32) {
    return InvalidArgument("quantize_gathered: amax must be float32 [G], got ",
                           DataTypeName(amax.element_type()));
  }
  problem->rows = source_rows.dimensions()[0];
  problem->cols = dims[1];
  if (problem->rows > 0 && dims[0] == 0) {
    return InvalidArgument("quantize_gathered: x has no rows to gather ", problem->rows,
                           " rows from");
  }
  if (auto error = CheckQuantizeOutputs(*problem, offsets, data, scale_inv, amax,
                                        static_cast<int32_t>(ScalingMode::kCurrent), 0);
      error.failure()) {
    return error;
  }
  const auto data_dims = data.dimensions();
  if (data_dims.size() != 2 || data_dims[0] != problem->rows || data_dims[1] != problem->cols) {
    return InvalidArgument("quantize_gathered: data must be [", problem->rows, ", ",
                           problem->cols, "] (source_rows' length, x's columns), got ",
                           ShapeString(data_dims));
  }
  return ffi::Error::Success();
}

}  // namespace jaxfuse
