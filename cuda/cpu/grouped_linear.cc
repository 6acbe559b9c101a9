// CPU handler for the grouped GEMM forms (see jaxfuse/grouped_linear.h): plain loops with
// fp32 accumulation, one rounding at the store. Offsets are read on the host here (it is
// the CPU), clamped exactly as the CUDA setup kernel clamps them.
#include <vector>

#include "jaxfuse/ffi_common.h"
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

}  // namespace
}  // namespace jaxfuse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupedGemmCpu, jaxfuse::GroupedGemmCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // a: x [m, k] (fwd, wgrad) or dy [m, n] (dgrad)
                                  .Arg<xla::ffi::AnyBuffer>()  // b: w [G, k, n] (fwd, dgrad) or dy [m, n] (wgrad)
                                  .Arg<xla::ffi::AnyBuffer>()  // group_offsets: int32 [G + 1]
                                  .Ret<xla::ffi::AnyBuffer>()  // out: y [m, n], dx [m, k] or dw [G, k, n]
                                  .Attr<int32_t>("form"));     // 0 forward, 1 dgrad, 2 wgrad
