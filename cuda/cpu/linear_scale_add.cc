// CPU handlers for the scaled matrix product (see jaxfuse/linear_scale_add.h): plain
// loops with fp32 accumulation and one rounding at the store. They exist so that CI,
// which has no GPU, runs the real custom-call path.
#include <vector>

#include "jaxfuse/ffi_common.h"
#include "jaxfuse/fp8.h"
#include "jaxfuse/linear_scale_add.h"
#include "jaxfuse/numeric.h"

namespace jaxfuse {
namespace {

// FP8 storage, decoded with the shared conversions of jaxfuse/fp8.h.
struct E4M3Bits { uint8_t bits; };
struct E5M2Bits { uint8_t bits; };
float ToFloat(E4M3Bits value) { return E4M3ToFloat(value.bits); }
float ToFloat(E5M2Bits value) { return E5M2ToFloat(value.bits); }
using jaxfuse::ToFloat;

template <typename In>
float LoadInput(const void* base, int64_t index) {
  return ToFloat(static_cast<const In*>(base)[index]);
}

// out[i, j] = alpha * sum_k op(a)[i, k] op(b)[k, j] (+ c[i, j]), row by row so the
// inner loop walks b and the accumulator row contiguously when b is not transposed.
template <typename InA, typename InB, typename Out>
void MatmulRows(const MatmulProblem& problem, const void* a, const void* b, const void* c,
                void* out, float alpha) {
  const int64_t p = problem.p, q = problem.q, r = problem.r;
  std::vector<float> row(q);
  for (int64_t i = 0; i < p; ++i) {
    std::fill(row.begin(), row.end(), 0.0f);
    for (int64_t k = 0; k < r; ++k) {
      const float a_ik = LoadInput<InA>(a, problem.transpose_a ? k * p + i : i * r + k);
      if (problem.transpose_b) {
        for (int64_t j = 0; j < q; ++j) row[j] += a_ik * LoadInput<InB>(b, j * r + k);
      } else {
        for (int64_t j = 0; j < q; ++j) row[j] += a_ik * LoadInput<InB>(b, k * q + j);
      }
    }
    for (int64_t j = 0; j < q; ++j) {
      float value = alpha * row[j];
      // c and out may be the same buffer (in place): read before write, element by element.
      if (c != nullptr) value += ToFloat(static_cast<const Out*>(c)[i * q + j]);
      static_cast<Out*>(out)[i * q + j] = FromFloat<Out>(value);
    }
  }
}

template <typename InA, typename InB>
ffi::Error DispatchOutput(const MatmulProblem& problem, const void* a, const void* b,
                          const void* c, void* out, float alpha) {
  if (problem.output_type == ffi::DataType::F32) {
    MatmulRows<InA, InB, float>(problem, a, b, c, out, alpha);
  } else if (problem.output_type == ffi::DataType::BF16) {
    MatmulRows<InA, InB, bfloat16_bits>(problem, a, b, c, out, alpha);
  } else {
    MatmulRows<InA, InB, float16_bits>(problem, a, b, c, out, alpha);
  }
  return ffi::Error::Success();
}

template <typename InA>
ffi::Error DispatchFp8B(const MatmulProblem& problem, const void* a, const void* b,
                        const void* c, void* out, float alpha) {
  if (problem.b_type == ffi::DataType::F8E4M3FN) {
    return DispatchOutput<InA, E4M3Bits>(problem, a, b, c, out, alpha);
  }
  return DispatchOutput<InA, E5M2Bits>(problem, a, b, c, out, alpha);
}

ffi::Error Matmul(const MatmulProblem& problem, const void* a, const void* b, const void* c,
                  void* out, float alpha) {
  switch (problem.input_type) {
    case ffi::DataType::F32: return DispatchOutput<float, float>(problem, a, b, c, out, alpha);
    case ffi::DataType::BF16:
      return DispatchOutput<bfloat16_bits, bfloat16_bits>(problem, a, b, c, out, alpha);
    case ffi::DataType::F16:
      return DispatchOutput<float16_bits, float16_bits>(problem, a, b, c, out, alpha);
    case ffi::DataType::F8E4M3FN: return DispatchFp8B<E4M3Bits>(problem, a, b, c, out, alpha);
    default: return DispatchFp8B<E5M2Bits>(problem, a, b, c, out, alpha);
  }
}

// The per-tensor dequantization factors of the FP8 forms, as one multiplier of alpha.
float Fp8Alpha(float alpha, const ffi::AnyBuffer& a_scale_inv, const ffi::AnyBuffer& b_scale_inv) {
  return alpha * static_cast<const float*>(a_scale_inv.untyped_data())[0] *
         static_cast<const float*>(b_scale_inv.untyped_data())[0];
}

ffi::Error LinearScaleAddCpuImpl(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer c,
                                 ffi::Result<ffi::AnyBuffer> out, float alpha,
                                 bool transpose_a, bool transpose_b) {
  MatmulProblem problem;
  if (auto error = ParseMatmulProblem(a, b, &c, *out, transpose_a, transpose_b, &problem);
      error.failure()) {
    return error;
  }
  return Matmul(problem, a.untyped_data(), b.untyped_data(), c.untyped_data(),
                out->untyped_data(), alpha);
}

ffi::Error ScaledMatmulCpuImpl(ffi::AnyBuffer a, ffi::AnyBuffer b,
                               ffi::Result<ffi::AnyBuffer> out, float alpha,
                               bool transpose_a, bool transpose_b) {
  MatmulProblem problem;
  if (auto error = ParseMatmulProblem(a, b, nullptr, *out, transpose_a, transpose_b, &problem);
      error.failure()) {
    return error;
  }
  return Matmul(problem, a.untyped_data(), b.untyped_data(), nullptr, out->untyped_data(),
                alpha);
}

ffi::Error LinearScaleAddFp8CpuImpl(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer c,
                                    ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv,
                                    ffi::Result<ffi::AnyBuffer> out, float alpha, bool) {
  MatmulProblem problem;
  if (auto error = ParseMatmulProblem(a, b, &c, *out, false, true, &problem); error.failure()) {
    return error;
  }
  return Matmul(problem, a.untyped_data(), b.untyped_data(), c.untyped_data(),
                out->untyped_data(), Fp8Alpha(alpha, a_scale_inv, b_scale_inv));
}

ffi::Error ScaledMatmulFp8CpuImpl(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv,
                                  ffi::AnyBuffer b_scale_inv, ffi::Result<ffi::AnyBuffer> out,
                                  float alpha, bool) {
  MatmulProblem problem;
  if (auto error = ParseMatmulProblem(a, b, nullptr, *out, false, true, &problem);
      error.failure()) {
    return error;
  }
  return Matmul(problem, a.untyped_data(), b.untyped_data(), nullptr, out->untyped_data(),
                Fp8Alpha(alpha, a_scale_inv, b_scale_inv));
}

}  // namespace
}  // namespace jaxfuse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseLinearScaleAddFp8Cpu, jaxfuse::LinearScaleAddFp8CpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // a: FP8 [..., R]
                                  .Arg<xla::ffi::AnyBuffer>()  // b: FP8 [Q, R]
                                  .Arg<xla::ffi::AnyBuffer>()  // c: residual [..., Q], aliased to out
                                  .Arg<xla::ffi::AnyBuffer>()  // a_scale_inv: float32 [1]
                                  .Arg<xla::ffi::AnyBuffer>()  // b_scale_inv: float32 [1]
                                  .Ret<xla::ffi::AnyBuffer>()  // out
                                  .Attr<float>("alpha")
                                  .Attr<bool>("fast_accumulation"));  // ignored on the CPU

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseScaledMatmulFp8Cpu, jaxfuse::ScaledMatmulFp8CpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // a: FP8 [..., R]
                                  .Arg<xla::ffi::AnyBuffer>()  // b: FP8 [Q, R]
                                  .Arg<xla::ffi::AnyBuffer>()  // a_scale_inv: float32 [1]
                                  .Arg<xla::ffi::AnyBuffer>()  // b_scale_inv: float32 [1]
                                  .Ret<xla::ffi::AnyBuffer>()  // out
                                  .Attr<float>("alpha")
                                  .Attr<bool>("fast_accumulation"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseLinearScaleAddCpu, jaxfuse::LinearScaleAddCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // a: x [P, R] (or [R, P])
                                  .Arg<xla::ffi::AnyBuffer>()  // b: kernel [R, Q] (or [Q, R])
                                  .Arg<xla::ffi::AnyBuffer>()  // c: residual [P, Q], aliased to out
                                  .Ret<xla::ffi::AnyBuffer>()  // out: c + alpha * op(a) @ op(b)
                                  .Attr<float>("alpha")
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseScaledMatmulCpu, jaxfuse::ScaledMatmulCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // a
                                  .Arg<xla::ffi::AnyBuffer>()  // b
                                  .Ret<xla::ffi::AnyBuffer>()  // out: alpha * op(a) @ op(b)
                                  .Attr<float>("alpha")
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));
