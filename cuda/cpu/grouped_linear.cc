// CPU handler for the grouped GEMM forms (see jaxfuse/grouped_linear.h): plain loops with
// fp32 accumulation, one rounding at the store. Offsets are read on the host here (it is
// the CPU), clamped exactly as the CUDA setup kernel clamps them.
#include <algorithm>
#include <vector>

#include "jaxfuse/ffi_common.h"
#include "jaxfuse/fp8.h"
#include "jaxfuse/grouped_linear.h"
#include "jaxfuse/numeric.h"

namespace jaxfuse {
namespace {

template <typename T>
void GroupedGemm(const GroupedProblem& p, const std::vector<int64_t>& rows, const T* a,
                 const T* b, T* out) {
  const int64_t m = p.m, k = p.k, n = p.n;
  std::vector<float> accumulator;
  if (p.form == GroupedForm::kWgrad) {
    accumulator.resize(k * n);
    for (int64_t g = 0; g < p.groups; ++g) {
      std::fill(accumulator.begin(), accumulator.end(), 0.0f);
      for (int64_t r = rows[g]; r < rows[g + 1]; ++r) {
        for (int64_t i = 0; i < k; ++i) {
          const float x_ri = ToFloat(a[r * k + i]);
          for (int64_t j = 0; j < n; ++j) accumulator[i * n + j] += x_ri * ToFloat(b[r * n + j]);
        }
      }
      for (int64_t e = 0; e < k * n; ++e) out[g * k * n + e] = FromFloat<T>(accumulator[e]);
    }
    return;
  }
  // forward: out[m, n] = a[m, k] @ w[g] ([k, n]); dgrad: out[m, k] = a[m, n] @ w[g]^T.
  const bool forward = p.form == GroupedForm::kForward;
  const int64_t inner = forward ? k : n, width = forward ? n : k;
  accumulator.resize(width);
  const T zero = FromFloat<T>(0.0f);
  for (int64_t r = 0; r < rows[0]; ++r)
    for (int64_t j = 0; j < width; ++j) out[r * width + j] = zero;
  for (int64_t g = 0; g < p.groups; ++g) {
    const T* w = b + g * k * n;
    for (int64_t r = rows[g]; r < rows[g + 1]; ++r) {
      std::fill(accumulator.begin(), accumulator.end(), 0.0f);
      for (int64_t c = 0; c < inner; ++c) {
        const float a_rc = ToFloat(a[r * inner + c]);
        if (forward) {
          for (int64_t j = 0; j < n; ++j) accumulator[j] += a_rc * ToFloat(w[c * n + j]);
        } else {
          for (int64_t j = 0; j < k; ++j) accumulator[j] += a_rc * ToFloat(w[j * n + c]);
        }
      }
      for (int64_t j = 0; j < width; ++j) out[r * width + j] = FromFloat<T>(accumulator[j]);
    }
  }
  for (int64_t r = rows[p.groups]; r < m; ++r)
    for (int64_t j = 0; j < width; ++j) out[r * width + j] = zero;
}

ffi::Error GroupedGemmCpuImpl(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer offsets,
                              ffi::Result<ffi::AnyBuffer> out, int32_t form) {
  GroupedProblem problem;
  if (auto error = ParseGroupedProblem(a, b, offsets, *out, form, &problem); error.failure()) {
    return error;
  }
  const ffi::DataType type = a.element_type();
  if (b.element_type() != type || out->element_type() != type) {
    return InvalidArgument("grouped GEMM operands must share one dtype, got ",
                           DataTypeName(type), ", ", DataTypeName(b.element_type()), " -> ",
                           DataTypeName(out->element_type()));
  }
  const auto rows = ClampOffsets(offsets.typed_data<int32_t>(), problem.groups, problem.m);
  switch (type) {
    case ffi::DataType::F32:
      GroupedGemm(problem, rows, static_cast<const float*>(a.untyped_data()),
                  static_cast<const float*>(b.untyped_data()),
                  static_cast<float*>(out->untyped_data()));
      break;
    case ffi::DataType::BF16:
      GroupedGemm(problem, rows, static_cast<const bfloat16_bits*>(a.untyped_data()),
                  static_cast<const bfloat16_bits*>(b.untyped_data()),
                  static_cast<bfloat16_bits*>(out->untyped_data()));
      break;
    case ffi::DataType::F16:
      GroupedGemm(problem, rows, static_cast<const float16_bits*>(a.untyped_data()),
                  static_cast<const float16_bits*>(b.untyped_data()),
                  static_cast<float16_bits*>(out->untyped_data()));
      break;
    default:
      return InvalidArgument("grouped GEMM dtype must be float32, bfloat16 or float16, got ",
                             DataTypeName(type));
  }
  return ffi::Error::Success();
}

ffi::Error CheckFp8Scales(const ffi::AnyBuffer& a_scale_inv, const ffi::AnyBuffer& b_scale_inv,
                          int64_t groups) {
  for (const ffi::AnyBuffer* scale : {&a_scale_inv, &b_scale_inv}) {
    const auto dims = scale->dimensions();
    if (scale->element_type() != ffi::DataType::F32 || dims.size() != 1 || dims[0] != groups) {
      return InvalidArgument("FP8 grouped GEMM scale_inv must be float32 [G = ", groups,
                             "], got ", DataTypeName(scale->element_type()), ShapeString(dims));
    }
  }
  return ffi::Error::Success();
}

// FP8 codes -> float (jaxfuse/fp8.h, the decoding the tests compare with ml_dtypes).
bool DecodeFp8(const ffi::AnyBuffer& buffer, std::vector<float>* values) {
  const auto* codes = static_cast<const uint8_t*>(buffer.untyped_data());
  const int64_t count = static_cast<int64_t>(buffer.element_count());
  values->resize(count);
  switch (buffer.element_type()) {
    case ffi::DataType::F8E4M3FN:
      for (int64_t i = 0; i < count; ++i) (*values)[i] = E4M3ToFloat(codes[i]);
      return true;
    case ffi::DataType::F8E5M2:
      for (int64_t i = 0; i < count; ++i) (*values)[i] = E5M2ToFloat(codes[i]);
      return true;
    default:
      return false;
  }
}

// The FP8 forms as the CUTLASS kernels compute them: exact products of the FP8 values
// accumulated in fp32, times alpha_g = a_scale_inv[g] * b_scale_inv[g], one rounding to
// bfloat16. Both forms are out[rows_g] = a[rows_g, inner] @ b[g]^T with b[g] [width, inner]:
// forward b = w^T [G, n, k] (inner k), dgrad b = w [G, k, n] (inner n).
void GroupedGemmFp8(const GroupedProblem& p, const std::vector<int64_t>& rows,
                    const std::vector<float>& a, const std::vector<float>& b,
                    const float* a_scale_inv, const float* b_scale_inv, bfloat16_bits* out) {
  const bool forward = p.form == GroupedForm::kForward;
  const int64_t inner = forward ? p.k : p.n, width = forward ? p.n : p.k;
  const bfloat16_bits zero = FromFloat<bfloat16_bits>(0.0f);
  for (int64_t r = 0; r < rows[0]; ++r)
    for (int64_t j = 0; j < width; ++j) out[r * width + j] = zero;
  for (int64_t g = 0; g < p.groups; ++g) {
    const float alpha = a_scale_inv[g] * b_scale_inv[g];
    const float* w = b.data() + g * p.k * p.n;
    for (int64_t r = rows[g]; r < rows[g + 1]; ++r) {
      const float* a_r = a.data() + r * inner;
      for (int64_t j = 0; j < width; ++j) {
        const float* w_j = w + j * inner;
        float accumulator = 0.0f;
        for (int64_t c = 0; c < inner; ++c) accumulator += a_r[c] * w_j[c];
        out[r * width + j] = FromFloat<bfloat16_bits>(alpha * accumulator);
      }
    }
  }
  for (int64_t r = rows[p.groups]; r < p.m; ++r)
    for (int64_t j = 0; j < width; ++j) out[r * width + j] = zero;
}

ffi::Error GroupedGemmFp8CpuImpl(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer offsets,
                                 ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv,
                                 ffi::Result<ffi::AnyBuffer> out, int32_t form,
                                 bool fast_accumulation) {
  GroupedProblem problem;
  if (auto error = ParseGroupedProblem(a, b, offsets, *out, form, &problem,
                                       /*weight_transposed=*/form == 0);
      error.failure()) {
    return error;
  }
  // The loops below accumulate exactly either way; the flag is checked, not used.
  if (auto error = CheckFastAccumulation(form, a.element_type(), fast_accumulation);
      error.failure()) {
    return error;
  }
  if (problem.form == GroupedForm::kWgrad) {
    return InvalidArgument("FP8 grouped GEMM: the wgrad form (2) reads column-wise copies; "
                           "call jaxfuse_grouped_gemm_fp8_wgrad");
  }
  if (out->element_type() != ffi::DataType::BF16) {
    return InvalidArgument("FP8 grouped GEMM output must be bfloat16, got ",
                           DataTypeName(out->element_type()));
  }
  if (auto error = CheckFp8Scales(a_scale_inv, b_scale_inv, problem.groups); error.failure()) {
    return error;
  }
  std::vector<float> a_values, b_values;
  if (!DecodeFp8(a, &a_values) || !DecodeFp8(b, &b_values)) {
    return InvalidArgument("FP8 grouped GEMM takes float8_e4m3fn or float8_e5m2 inputs, got ",
                           DataTypeName(a.element_type()), " x ",
                           DataTypeName(b.element_type()));
  }
  const auto rows = ClampOffsets(offsets.typed_data<int32_t>(), problem.groups, problem.m);
  GroupedGemmFp8(problem, rows, a_values, b_values,
                 static_cast<const float*>(a_scale_inv.untyped_data()),
                 static_cast<const float*>(b_scale_inv.untyped_data()),
                 static_cast<bfloat16_bits*>(out->untyped_data()));
  return ffi::Error::Success();
}

// The blockwise FP8 forms as CUTLASS's blockwise mainloop computes them: per 128-wide
// block kb of the contraction, exact products of the FP8 values summed in fp32, times
// a_scale_inv[r, kb] * b_scale_inv[g, j / 128, kb], added to an fp32 accumulator; one rounding
// to bfloat16. b[g] is [width, inner] as in GroupedGemmFp8; rows outside the groups are zero.
void GroupedGemmFp8Blockwise(const GroupedProblem& p, const std::vector<int64_t>& rows,
                             const std::vector<float>& a, const std::vector<float>& b,
                             const float* a_scale_inv, const float* b_scale_inv,
                             bfloat16_bits* out) {
  const int64_t inner = ContractionOf(p), width = OutColumnsOf(p);
  const int64_t inner_blocks = ScaleBlocks(inner), width_blocks = ScaleBlocks(width);
  const bfloat16_bits zero = FromFloat<bfloat16_bits>(0.0f);
  std::fill(out, out + p.m * width, zero);
  for (int64_t g = 0; g < p.groups; ++g) {
    const float* w = b.data() + g * p.k * p.n;
    const float* w_scales = b_scale_inv + g * width_blocks * inner_blocks;
    for (int64_t r = rows[g]; r < rows[g + 1]; ++r) {
      const float* a_r = a.data() + r * inner;
      const float* a_scales = a_scale_inv + r * inner_blocks;
      for (int64_t j = 0; j < width; ++j) {
        const float* w_j = w + j * inner;
        const float* w_j_scales = w_scales + (j / kGemmScaleBlock) * inner_blocks;
        float accumulator = 0.0f;
        for (int64_t kb = 0; kb < inner_blocks; ++kb) {
          const int64_t end = std::min(inner, (kb + 1) * kGemmScaleBlock);
          float partial = 0.0f;
          for (int64_t c = kb * kGemmScaleBlock; c < end; ++c) partial += a_r[c] * w_j[c];
          accumulator += partial * (a_scales[kb] * w_j_scales[kb]);
        }
        out[r * width + j] = FromFloat<bfloat16_bits>(accumulator);
      }
    }
  }
}

ffi::Error GroupedGemmFp8BlockwiseCpuImpl(ffi::AnyBuffer a, ffi::AnyBuffer b,
                                          ffi::AnyBuffer offsets, ffi::AnyBuffer a_scale_inv,
                                          ffi::AnyBuffer b_scale_inv,
                                          ffi::Result<ffi::AnyBuffer> out, int32_t form) {
  GroupedProblem problem;
  if (auto error = ParseGroupedProblem(a, b, offsets, *out, form, &problem,
                                       /*weight_transposed=*/form == 0);
      error.failure()) {
    return error;
  }
  if (out->element_type() != ffi::DataType::BF16) {
    return InvalidArgument("blockwise FP8 grouped GEMM output must be bfloat16, got ",
                           DataTypeName(out->element_type()));
  }
  if (auto error = CheckBlockScales(problem, a_scale_inv, b_scale_inv); error.failure()) {
    return error;
  }
  const bool a_ok = a.element_type() == ffi::DataType::F8E4M3FN ||
                    (problem.form == GroupedForm::kDgrad &&
                     a.element_type() == ffi::DataType::F8E5M2);
  std::vector<float> a_values, b_values;
  if (!a_ok || b.element_type() != ffi::DataType::F8E4M3FN || !DecodeFp8(a, &a_values) ||
      !DecodeFp8(b, &b_values)) {
    return InvalidArgument("blockwise FP8 grouped GEMM takes a float8_e4m3fn weight and a "
                           "float8_e4m3fn x (forward) or a float8_e4m3fn or float8_e5m2 dy "
                           "(dgrad), got ", DataTypeName(a.element_type()), " x ",
                           DataTypeName(b.element_type()), " for form ", form);
  }
  const auto rows = ClampOffsets(offsets.typed_data<int32_t>(), problem.groups, problem.m);
  GroupedGemmFp8Blockwise(problem, rows, a_values, b_values,
                          static_cast<const float*>(a_scale_inv.untyped_data()),
                          static_cast<const float*>(b_scale_inv.untyped_data()),
                          static_cast<bfloat16_bits*>(out->untyped_data()));
  return ffi::Error::Success();
}

// The FP8 wgrad on column-wise copies (jaxfuse/columnwise.h), as the CUTLASS kernels
// compute it: exact products of the FP8 values summed in fp32, one rounding to bfloat16;
// zero for an empty group. Reads only the columns of each group's rows (never the padding).
// Per-group scaling (block_scaling false): dw[g][i, j] = alpha_g * sum over the group's
// columns c of xT[i, c] * dyT[j, c], alpha_g = a_scale_inv[g] * b_scale_inv[g]. Blockwise
// (Float8BlockScaling's 128 x 1 blocks): the sum runs per 128-row block bj of the group,
// times a_scale_inv[row_g + bj, i] * b_scale_inv[row_g + bj, j] (row_g =
// ColumnwiseScaleRow), added to an fp32 accumulator, as the blockwise mainloop promotes.
ffi::Error ColumnwiseWgradCpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer offsets,
                              ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv,
                              ffi::AnyBuffer out, int64_t rows, bool block_scaling) {
  GroupedProblem p;
  if (auto error = ParseColumnwiseWgrad(a, b, offsets, out, rows, &p); error.failure()) {
    return error;
  }
  if (auto error = block_scaling ? CheckColumnwiseBlockScales(p, a_scale_inv, b_scale_inv)
                                 : CheckFp8Scales(a_scale_inv, b_scale_inv, p.groups);
      error.failure()) {
    return error;
  }
  if (out.element_type() != ffi::DataType::BF16) {
    return InvalidArgument("FP8 grouped wgrad output must be bfloat16, got ",
                           DataTypeName(out.element_type()));
  }
  if (a.element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArgument("FP8 grouped wgrad: a (x^T) must be float8_e4m3fn, got ",
                           DataTypeName(a.element_type()));
  }
  std::vector<float> a_values, b_values;
  if (!DecodeFp8(a, &a_values) || !DecodeFp8(b, &b_values)) {
    return InvalidArgument("FP8 grouped wgrad: b (dy^T) must be float8_e4m3fn or float8_e5m2, "
                           "got ", DataTypeName(b.element_type()));
  }
  const auto clamped = ClampOffsets(offsets.typed_data<int32_t>(), p.groups, p.m);
  const auto* a_scales = static_cast<const float*>(a_scale_inv.untyped_data());
  const auto* b_scales = static_cast<const float*>(b_scale_inv.untyped_data());
  auto* dw = static_cast<bfloat16_bits*>(out.untyped_data());
  const int64_t block = block_scaling ? kColumnwiseScaleBlock : std::max<int64_t>(1, p.m);
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t start = ColumnwiseStart(clamped[g], g), count = clamped[g + 1] - clamped[g];
    const int64_t begin = ColumnwiseBlockBegin(clamped[g], g);
    const int64_t end = ColumnwiseStart(clamped[g + 1], g + 1);
    const int64_t scale_row = ColumnwiseScaleRow(clamped[g], g);
    for (int64_t i = 0; i < p.k; ++i) {
      const float* x_i = a_values.data() + ColumnwiseIndex(p.k, begin, end, i, start);
      for (int64_t j = 0; j < p.n; ++j) {
        const float* dy_j = b_values.data() + ColumnwiseIndex(p.n, begin, end, j, start);
        float accumulator = 0.0f;
        for (int64_t c0 = 0, bj = 0; c0 < count; c0 += block, ++bj) {
          float partial = 0.0f;
          for (int64_t c = c0; c < std::min(count, c0 + block); ++c) partial += x_i[c] * dy_j[c];
          accumulator += block_scaling ? partial * (a_scales[(scale_row + bj) * p.k + i] *
                                                    b_scales[(scale_row + bj) * p.n + j])
                                       : partial;
        }
        const float alpha = block_scaling ? 1.0f : a_scales[g] * b_scales[g];
        dw[(g * p.k + i) * p.n + j] =
            FromFloat<bfloat16_bits>(count > 0 ? alpha * accumulator : 0.0f);
      }
    }
  }
  return ffi::Error::Success();
}

ffi::Error GroupedGemmFp8WgradCpuImpl(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer offsets,
                                      ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv,
                                      ffi::Result<ffi::AnyBuffer> out, int64_t rows) {
  return ColumnwiseWgradCpu(a, b, offsets, a_scale_inv, b_scale_inv, *out, rows,
                            /*block_scaling=*/false);
}

ffi::Error GroupedGemmFp8BlockwiseWgradCpuImpl(ffi::AnyBuffer a, ffi::AnyBuffer b,
                                               ffi::AnyBuffer offsets, ffi::AnyBuffer a_scale_inv,
                                               ffi::AnyBuffer b_scale_inv,
                                               ffi::Result<ffi::AnyBuffer> out, int64_t rows) {
  return ColumnwiseWgradCpu(a, b, offsets, a_scale_inv, b_scale_inv, *out, rows,
                            /*block_scaling=*/true);
}

}  // namespace
}  // namespace jaxfuse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupedGemmCpu, jaxfuse::GroupedGemmCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // a: x [m, k] (fwd, wgrad) or dy [m, n] (dgrad)
                                  .Arg<xla::ffi::AnyBuffer>()  // b: w [G, k, n] (fwd, dgrad) or dy [m, n] (wgrad)
                                  .Arg<xla::ffi::AnyBuffer>()  // group_offsets: int32 [G + 1]
                                  .Ret<xla::ffi::AnyBuffer>()  // out: y [m, n], dx [m, k] or dw [G, k, n]
                                  .Attr<int32_t>("form"));     // 0 forward, 1 dgrad, 2 wgrad

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupedGemmFp8Cpu, jaxfuse::GroupedGemmFp8CpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // a: FP8 x [m, k] (fwd) or dy [m, n] (dgrad)
                                  .Arg<xla::ffi::AnyBuffer>()  // b: FP8 w^T [G, n, k] (fwd) or w [G, k, n] (dgrad)
                                  .Arg<xla::ffi::AnyBuffer>()  // group_offsets: int32 [G + 1]
                                  .Arg<xla::ffi::AnyBuffer>()  // a_scale_inv: float32 [G]
                                  .Arg<xla::ffi::AnyBuffer>()  // b_scale_inv: float32 [G]
                                  .Ret<xla::ffi::AnyBuffer>()  // out: bf16 y [m, n] or dx [m, k]
                                  .Attr<int32_t>("form")       // 0 forward, 1 dgrad
                                  .Attr<bool>("fast_accumulation"));  // forward only; exact here

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupedGemmFp8WgradCpu, jaxfuse::GroupedGemmFp8WgradCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // a: x^T e4m3 [k, W], column-wise copy
                                  .Arg<xla::ffi::AnyBuffer>()  // b: dy^T e4m3|e5m2 [n, W], column-wise copy
                                  .Arg<xla::ffi::AnyBuffer>()  // group_offsets: int32 [G + 1]
                                  .Arg<xla::ffi::AnyBuffer>()  // a_scale_inv: float32 [G]
                                  .Arg<xla::ffi::AnyBuffer>()  // b_scale_inv: float32 [G]
                                  .Ret<xla::ffi::AnyBuffer>()  // out: bf16 dw [G, k, n]
                                  .Attr<int64_t>("rows"));     // m: rows the copies were made from

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupedGemmFp8BlockwiseCpu,
                              jaxfuse::GroupedGemmFp8BlockwiseCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // a: e4m3 x [m, k] (fwd) or e4m3|e5m2 dy [m, n] (dgrad)
                                  .Arg<xla::ffi::AnyBuffer>()  // b: e4m3 w^T [G, n, k] (fwd) or w [G, k, n] (dgrad)
                                  .Arg<xla::ffi::AnyBuffer>()  // group_offsets: int32 [G + 1]
                                  .Arg<xla::ffi::AnyBuffer>()  // a_scale_inv: float32 [m, ceil(kc / 128)]
                                  .Arg<xla::ffi::AnyBuffer>()  // b_scale_inv: float32 [G, ceil(nc / 128), ceil(kc / 128)]
                                  .Ret<xla::ffi::AnyBuffer>()  // out: bf16 y [m, n] or dx [m, k]
                                  .Attr<int32_t>("form"));     // 0 forward, 1 dgrad

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupedGemmFp8BlockwiseWgradCpu,
                              jaxfuse::GroupedGemmFp8BlockwiseWgradCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // a: x^T e4m3 [k, W], column-wise copy
                                  .Arg<xla::ffi::AnyBuffer>()  // b: dy^T e4m3|e5m2 [n, W], column-wise copy
                                  .Arg<xla::ffi::AnyBuffer>()  // group_offsets: int32 [G + 1]
                                  .Arg<xla::ffi::AnyBuffer>()  // a_scale_inv: float32 [S, k], S = ColumnwiseScaleRows(rows, G)
                                  .Arg<xla::ffi::AnyBuffer>()  // b_scale_inv: float32 [S, n]
                                  .Ret<xla::ffi::AnyBuffer>()  // out: bf16 dw [G, k, n]
                                  .Attr<int64_t>("rows"));     // m: rows the copies were made from
