// The grouped GEMM forms behind grouped_linear, as both backends see them (see
// cuda/include/jaxfuse/grouped_gemm.h for the CUDA kernels' contract):
//
//   form 0, forward: out[m, n]    = per group g: a[rows_g, k] @ b[g]        (a = x, b = w [G, k, n])
//   form 1, dgrad:   out[m, k]    = per group g: a[rows_g, n] @ b[g]^T      (a = dy, b = w [G, k, n])
//   form 2, wgrad:   out[G, k, n] = per group g: a[rows_g, k]^T @ b[rows_g] (a = x, b = dy [m, n])
//
// rows_g = [offsets'[g], offsets'[g+1]) where offsets' clamps group_offsets into [0, m] and
// makes them non-decreasing: negative sizes count as zero, sums past m are cut at m. Rows of
// out outside every group are zero; dw of an empty group is zero.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "jaxfuse/columnwise.h"
#include "jaxfuse/ffi_common.h"

namespace jaxfuse {

enum class GroupedForm : int32_t { kForward = 0, kDgrad = 1, kWgrad = 2 };

struct GroupedProblem {
  GroupedForm form = GroupedForm::kForward;
  int64_t m = 0, k = 0, n = 0;
  int64_t groups = 0;
};

// Shapes by form; checks what the Python wrapper already checked, for direct callers.
// `weight_transposed`: the forward weight comes as [G, n, k] (FP8 needs it K-major).
inline ffi::Error ParseGroupedProblem(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                                      const ffi::AnyBuffer& offsets, const ffi::AnyBuffer& out,
                                      int32_t form, GroupedProblem* problem,
                                      bool weight_transposed = false) {
  const auto a_dims = a.dimensions(), b_dims = b.dimensions(), o_dims = offsets.dimensions();
  const auto out_dims = out.dimensions();
  if (form < 0 || form > 2) return InvalidArgument("grouped GEMM form must be 0, 1 or 2, got ", form);
  problem->form = static_cast<GroupedForm>(form);
  if (o_dims.size() != 1 || o_dims[0] < 2 || offsets.element_type() != ffi::DataType::S32) {
    return InvalidArgument("group_offsets must be int32 [G + 1] with G >= 1, got ",
                           DataTypeName(offsets.element_type()), ShapeString(o_dims));
  }
  problem->groups = o_dims[0] - 1;
  if (a_dims.size() != 2) return InvalidArgument("grouped GEMM a must be rank 2, got ", ShapeString(a_dims));
  problem->m = a_dims[0];
  const int64_t g = problem->groups;
  bool ok = true;
  switch (problem->form) {
    case GroupedForm::kForward:  // a [m, k], b [G, k, n] (or [G, n, k]), out [m, n]
      problem->k = a_dims[1];
      ok = b_dims.size() == 3 && b_dims[0] == g &&
           b_dims[weight_transposed ? 2 : 1] == problem->k;
      problem->n = ok ? b_dims[weight_transposed ? 1 : 2] : 0;
      ok = ok && out_dims.size() == 2 && out_dims[0] == problem->m && out_dims[1] == problem->n;
      break;
    case GroupedForm::kDgrad:  // a [m, n], b [G, k, n], out [m, k]
      problem->n = a_dims[1];
      ok = b_dims.size() == 3 && b_dims[0] == g && b_dims[2] == problem->n;
      problem->k = ok ? b_dims[1] : 0;
      ok = ok && out_dims.size() == 2 && out_dims[0] == problem->m && out_dims[1] == problem->k;
      break;
    case GroupedForm::kWgrad:  // a [m, k], b [m, n], out [G, k, n]
      problem->k = a_dims[1];
      ok = b_dims.size() == 2 && b_dims[0] == problem->m;
      problem->n = ok ? b_dims[1] : 0;
      ok = ok && out_dims.size() == 3 && out_dims[0] == g && out_dims[1] == problem->k &&
           out_dims[2] == problem->n;
      break;
  }
  if (!ok) {
    return InvalidArgument("grouped GEMM form ", form, ": inconsistent shapes a ",
                           ShapeString(a_dims), ", b ", ShapeString(b_dims), ", out ",
                           ShapeString(out_dims), " for G = ", g);
  }
  return ffi::Error::Success();
}

// The FP8 wgrad (both backends): dw[g] = x[rows_g]^T @ dy[rows_g] from the column-wise
// copies (jaxfuse/columnwise.h, blocked storage in buffers a [k, W] and b [n, W], W =
// ColumnwiseWidth(rows, G)); out = dw [G, k, n]. `rows` (m) is the row count of the tensors the copies were made
// from (W alone does not determine it); offsets are clamped to it as in the other forms.
inline ffi::Error ParseColumnwiseWgrad(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                                       const ffi::AnyBuffer& offsets, const ffi::AnyBuffer& out,
                                       int64_t rows, GroupedProblem* problem) {
  const auto a_dims = a.dimensions(), b_dims = b.dimensions(), o_dims = offsets.dimensions();
  const auto out_dims = out.dimensions();
  if (o_dims.size() != 1 || o_dims[0] < 2 || offsets.element_type() != ffi::DataType::S32) {
    return InvalidArgument("group_offsets must be int32 [G + 1] with G >= 1, got ",
                           DataTypeName(offsets.element_type()), ShapeString(o_dims));
  }
  problem->form = GroupedForm::kWgrad;
  problem->groups = o_dims[0] - 1;
  problem->m = rows;
  const int64_t width = rows >= 0 ? ColumnwiseWidth(rows, problem->groups) : -1;
  if (rows < 0 || a_dims.size() != 2 || b_dims.size() != 2 || a_dims[1] != width ||
      b_dims[1] != width) {
    return InvalidArgument("FP8 grouped wgrad: a and b must be the column-wise copies [K, W] "
                           "and [N, W] with W = ColumnwiseWidth(rows = ", rows, ", G = ",
                           problem->groups, ") = ", width, ", got a ", ShapeString(a_dims),
                           ", b ", ShapeString(b_dims));
  }
  problem->k = a_dims[0];
  problem->n = b_dims[0];
  if (out_dims.size() != 3 || out_dims[0] != problem->groups || out_dims[1] != problem->k ||
      out_dims[2] != problem->n) {
    return InvalidArgument("FP8 grouped wgrad: out must be [G, K, N] = [", problem->groups,
                           ", ", problem->k, ", ", problem->n, "], got ", ShapeString(out_dims));
  }
  return ffi::Error::Success();
}

// FP8 fast accumulation (the tensor cores' FP8 accumulator, no promotion to fp32 registers)
// exists for the forward form with E4M3 activations only; gradients keep the promoted
// mainloop, as in TransformerEngine. Both handlers check it the same way.
inline ffi::Error CheckFastAccumulation(int32_t form, ffi::DataType a_type,
                                        bool fast_accumulation) {
  if (fast_accumulation &&
      (form != static_cast<int32_t>(GroupedForm::kForward) || a_type != ffi::DataType::F8E4M3FN)) {
    return InvalidArgument("FP8 grouped GEMM: fast_accumulation is only available for the "
                           "forward form (0) with float8_e4m3fn activations, got form ", form,
                           " with ", DataTypeName(a_type));
  }
  return ffi::Error::Success();
}

// Blockwise FP8 (Float8BlockScaling, DeepSeek-V3's recipe) of the forward and dgrad forms:
// a's scales float32 [m, ceil(kc / 128)] (1 x 128 blocks of its rows), b's float32
// [G, ceil(nc / 128), ceil(kc / 128)] (128 x 128 tiles of each expert's K-major operand),
// kc the contraction (k forward, n dgrad), nc the output columns (n forward, k dgrad).
inline constexpr int64_t kGemmScaleBlock = 128;

// Scale blocks along a dimension of `size` (the last one partial).
inline int64_t ScaleBlocks(int64_t size) { return (size + kGemmScaleBlock - 1) / kGemmScaleBlock; }

inline int64_t ContractionOf(const GroupedProblem& p) {
  return p.form == GroupedForm::kForward ? p.k : p.n;
}
inline int64_t OutColumnsOf(const GroupedProblem& p) {
  return p.form == GroupedForm::kForward ? p.n : p.k;
}

// The blockwise FP8 wgrad (p from ParseColumnwiseWgrad): 128 x 1 blocks of x and dy along
// each group's rows, a_scale_inv float32 [ColumnwiseScaleRows(m, G), k] and b_scale_inv
// float32 [ColumnwiseScaleRows(m, G), n] (jaxfuse/columnwise.h).
inline ffi::Error CheckColumnwiseBlockScales(const GroupedProblem& p,
                                             const ffi::AnyBuffer& a_scale_inv,
                                             const ffi::AnyBuffer& b_scale_inv) {
  const int64_t scale_rows = ColumnwiseScaleRows(p.m, p.groups);
  const char* names[2] = {"a_scale_inv", "b_scale_inv"};
  const ffi::AnyBuffer* scales[2] = {&a_scale_inv, &b_scale_inv};
  const int64_t columns[2] = {p.k, p.n};
  for (int i = 0; i < 2; ++i) {
    const auto dims = scales[i]->dimensions();
    if (scales[i]->element_type() != ffi::DataType::F32 || dims.size() != 2 ||
        dims[0] != scale_rows || dims[1] != columns[i]) {
      return InvalidArgument("blockwise FP8 grouped wgrad: ", names[i], " must be float32 "
                             "[ColumnwiseScaleRows(rows, G), ", i == 0 ? "K" : "N", "] = [",
                             scale_rows, ", ", columns[i], "], got ",
                             DataTypeName(scales[i]->element_type()), ShapeString(dims));
    }
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckBlockScales(const GroupedProblem& p, const ffi::AnyBuffer& a_scale_inv,
                                   const ffi::AnyBuffer& b_scale_inv) {
  if (p.form == GroupedForm::kWgrad) {
    return InvalidArgument("blockwise FP8 grouped GEMM: only the forward (0) and dgrad (1) "
                           "forms, got the wgrad form (2): call "
                           "jaxfuse_grouped_gemm_fp8_blockwise_wgrad");
  }
  const int64_t kc = ScaleBlocks(ContractionOf(p)), nc = ScaleBlocks(OutColumnsOf(p));
  const auto a_dims = a_scale_inv.dimensions(), b_dims = b_scale_inv.dimensions();
  if (a_scale_inv.element_type() != ffi::DataType::F32 || a_dims.size() != 2 ||
      a_dims[0] != p.m || a_dims[1] != kc) {
    return InvalidArgument("blockwise FP8 grouped GEMM: a_scale_inv must be float32 [m, "
                           "ceil(contraction / 128)] = [", p.m, ", ", kc, "], got ",
                           DataTypeName(a_scale_inv.element_type()), ShapeString(a_dims));
  }
  if (b_scale_inv.element_type() != ffi::DataType::F32 || b_dims.size() != 3 ||
      b_dims[0] != p.groups || b_dims[1] != nc || b_dims[2] != kc) {
    return InvalidArgument("blockwise FP8 grouped GEMM: b_scale_inv must be float32 [G, "
                           "ceil(out columns / 128), ceil(contraction / 128)] = [", p.groups,
                           ", ", nc, ", ", kc, "], got ",
                           DataTypeName(b_scale_inv.element_type()), ShapeString(b_dims));
  }
  return ffi::Error::Success();
}

// offsets' of the contract above, on the host (CPU handler).
inline std::vector<int64_t> ClampOffsets(const int32_t* offsets, int64_t groups, int64_t m) {
  std::vector<int64_t> clamped(groups + 1);
  int64_t running = 0;
  for (int64_t g = 0; g <= groups; ++g) {
    running = std::max(running, std::min<int64_t>(std::max<int64_t>(offsets[g], 0), m));
    clamped[g] = running;
  }
  return clamped;
}

}  // namespace jaxfuse
