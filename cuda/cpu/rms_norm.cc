// CPU handlers for RMSNorm and residual-add + RMSNorm (see jaxfuse/rms_norm.h): plain
// loops, fp32 statistics, one rounding at each store. They exist so that CI, which has no
// GPU, runs the real custom-call path (attributes, aliasing, custom_vjp plumbing).
#include <vector>

#include "jaxfuse/ffi_common.h"
#include "jaxfuse/numeric.h"
#include "jaxfuse/rms_norm.h"

namespace jaxfuse {
namespace {

template <typename T>
float Load(const void* base, int64_t index) {
  return ToFloat(static_cast<const T*>(base)[index]);
}

template <typename T>
void StoreAt(void* base, int64_t index, float value) {
  static_cast<T*>(base)[index] = FromFloat<T>(value);
}

// residual/new_residual may be null (plain RMSNorm); new_residual may alias residual:
// each element is read before it is written.
template <typename T, typename G>
void Forward(const RmsNormProblem& p, const void* x, const void* residual, const void* gamma,
             void* out, void* new_residual, float* rsigma, float eps, bool zero_centered) {
  std::vector<float> row(p.cols);
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t base = r * p.cols;
    float sum = 0.0f;
    for (int64_t j = 0; j < p.cols; ++j) {
      float s = Load<T>(x, base + j);
      if (residual != nullptr) {
        s = ToFloat(FromFloat<T>(s + Load<T>(residual, base + j)));  // rounded as stored
        StoreAt<T>(new_residual, base + j, s);
      }
      row[j] = s;
      sum += s * s;
    }
    const float rs = RmsNormRsigma(sum, p.cols, eps);
    rsigma[r] = rs;
    for (int64_t j = 0; j < p.cols; ++j) {
      const float scale = RmsNormScale(Load<G>(gamma, j), zero_centered);
      StoreAt<T>(out, base + j, RmsNormApply(row[j], rs, scale));
    }
  }
}

// dz may be null (plain RMSNorm). dgamma is written in G.
template <typename T, typename G>
void Backward(const RmsNormProblem& p, const void* dy, const void* dz, const void* s,
              const void* gamma, const float* rsigma, void* dx, void* dgamma,
              bool zero_centered) {
  std::vector<float> dgamma_acc(p.cols, 0.0f), scale(p.cols);
  for (int64_t j = 0; j < p.cols; ++j) scale[j] = RmsNormScale(Load<G>(gamma, j), zero_centered);
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t base = r * p.cols;
    const float rs = rsigma[r];
    float dot = 0.0f;
    for (int64_t j = 0; j < p.cols; ++j) {
      const float g = Load<T>(dy, base + j);
      const float xhat = Load<T>(s, base + j) * rs;
      dot += g * scale[j] * xhat;
      dgamma_acc[j] += g * xhat;
    }
    const float m = dot / static_cast<float>(p.cols);
    for (int64_t j = 0; j < p.cols; ++j) {
      float value = RmsNormInputGrad(Load<T>(dy, base + j), Load<T>(s, base + j), rs,
                                     scale[j], m);
      if (dz != nullptr) value += Load<T>(dz, base + j);
      StoreAt<T>(dx, base + j, value);
    }
  }
  for (int64_t j = 0; j < p.cols; ++j) StoreAt<G>(dgamma, j, dgamma_acc[j]);
}

ffi::Error ForwardImpl(ffi::AnyBuffer x, const ffi::AnyBuffer* residual, ffi::AnyBuffer gamma,
                       ffi::AnyBuffer* out, ffi::AnyBuffer* new_residual,
                       ffi::AnyBuffer* rsigma, float eps, bool zero_centered) {
  RmsNormProblem p;
  ffi::Error error = residual != nullptr
      ? ParseRmsNormProblem(x, gamma, *rsigma, {residual, out, new_residual}, &p)
      : ParseRmsNormProblem(x, gamma, *rsigma, {out}, &p);
  if (error.failure()) return error;
  const void* r = residual ? residual->untyped_data() : nullptr;
  void* nr = new_residual ? new_residual->untyped_data() : nullptr;
  float* rs = static_cast<float*>(rsigma->untyped_data());
  const bool g32 = p.gamma_type == ffi::DataType::F32;
#define JAXFUSE_FWD(T, G) \
  Forward<T, G>(p, x.untyped_data(), r, gamma.untyped_data(), out->untyped_data(), nr, rs, eps, zero_centered)
  switch (p.x_type) {
    case ffi::DataType::F32: JAXFUSE_FWD(float, float); break;
    case ffi::DataType::BF16:
      if (g32) JAXFUSE_FWD(bfloat16_bits, float); else JAXFUSE_FWD(bfloat16_bits, bfloat16_bits);
      break;
    default:
      if (g32) JAXFUSE_FWD(float16_bits, float); else JAXFUSE_FWD(float16_bits, float16_bits);
  }
#undef JAXFUSE_FWD
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::AnyBuffer dy, const ffi::AnyBuffer* dz, ffi::AnyBuffer s,
                        ffi::AnyBuffer gamma, ffi::AnyBuffer rsigma, ffi::AnyBuffer* dx,
                        ffi::AnyBuffer* dgamma, bool zero_centered) {
  RmsNormProblem p;
  ffi::Error error = dz != nullptr
      ? ParseRmsNormProblem(s, gamma, rsigma, {&dy, dz, dx}, &p)
      : ParseRmsNormProblem(s, gamma, rsigma, {&dy, dx}, &p);
  if (error.failure()) return error;
  if (dgamma->element_count() != static_cast<size_t>(p.cols) ||
      dgamma->element_type() != p.gamma_type) {
    return InvalidArgument("rms_norm backward: dgamma must be like gamma, got ",
                           ShapeString(dgamma->dimensions()));
  }
  const void* z = dz ? dz->untyped_data() : nullptr;
  const float* rs = static_cast<const float*>(rsigma.untyped_data());
  const bool g32 = p.gamma_type == ffi::DataType::F32;
#define JAXFUSE_BWD(T, G)                                                                  \
  Backward<T, G>(p, dy.untyped_data(), z, s.untyped_data(), gamma.untyped_data(), rs,     \
                 dx->untyped_data(), dgamma->untyped_data(), zero_centered)
  switch (p.x_type) {
    case ffi::DataType::F32: JAXFUSE_BWD(float, float); break;
    case ffi::DataType::BF16:
      if (g32) JAXFUSE_BWD(bfloat16_bits, float); else JAXFUSE_BWD(bfloat16_bits, bfloat16_bits);
      break;
    default:
      if (g32) JAXFUSE_BWD(float16_bits, float); else JAXFUSE_BWD(float16_bits, float16_bits);
  }
#undef JAXFUSE_BWD
  return ffi::Error::Success();
}

ffi::Error RmsNormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> rsigma,
                         float eps, bool zero_centered_gamma) {
  return ForwardImpl(x, nullptr, gamma, &*out, nullptr, &*rsigma, eps, zero_centered_gamma);
}

ffi::Error AddRmsNormFwdCpu(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer gamma,
                            ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> new_residual,
                            ffi::Result<ffi::AnyBuffer> rsigma, float eps,
                            bool zero_centered_gamma) {
  return ForwardImpl(x, &residual, gamma, &*out, &*new_residual, &*rsigma, eps,
                     zero_centered_gamma);
}

ffi::Error RmsNormBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer s, ffi::AnyBuffer gamma,
                         ffi::AnyBuffer rsigma, ffi::Result<ffi::AnyBuffer> dx,
                         ffi::Result<ffi::AnyBuffer> dgamma, bool zero_centered_gamma) {
  return BackwardImpl(dy, nullptr, s, gamma, rsigma, &*dx, &*dgamma, zero_centered_gamma);
}

ffi::Error AddRmsNormBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer dz, ffi::AnyBuffer s,
                            ffi::AnyBuffer gamma, ffi::AnyBuffer rsigma,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                            bool zero_centered_gamma) {
  return BackwardImpl(dy, &dz, s, gamma, rsigma, &*dx, &*dgamma, zero_centered_gamma);
}

}  // namespace
}  // namespace jaxfuse

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseRmsNormFwdCpu, jaxfuse::RmsNormFwdCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x [..., H]
                                  .Arg<ffi::AnyBuffer>()  // gamma [H]
                                  .Ret<ffi::AnyBuffer>()  // out [..., H], x's dtype
                                  .Ret<ffi::AnyBuffer>()  // rsigma [...], float32
                                  .Attr<float>("eps")
                                  .Attr<bool>("zero_centered_gamma"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseAddRmsNormFwdCpu, jaxfuse::AddRmsNormFwdCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x [..., H]
                                  .Arg<ffi::AnyBuffer>()  // residual [..., H], aliased to new_residual
                                  .Arg<ffi::AnyBuffer>()  // gamma [H]
                                  .Ret<ffi::AnyBuffer>()  // out = rms_norm(x + residual)
                                  .Ret<ffi::AnyBuffer>()  // new_residual = x + residual
                                  .Ret<ffi::AnyBuffer>()  // rsigma [...], float32
                                  .Attr<float>("eps")
                                  .Attr<bool>("zero_centered_gamma"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseRmsNormBwdCpu, jaxfuse::RmsNormBwdCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // dy [..., H]
                                  .Arg<ffi::AnyBuffer>()  // x (the normalized input) [..., H]
                                  .Arg<ffi::AnyBuffer>()  // gamma [H]
                                  .Arg<ffi::AnyBuffer>()  // rsigma [...]
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma [H], gamma's dtype
                                  .Attr<bool>("zero_centered_gamma"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseAddRmsNormBwdCpu, jaxfuse::AddRmsNormBwdCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // dy [..., H]
                                  .Arg<ffi::AnyBuffer>()  // dz: gradient of new_residual
                                  .Arg<ffi::AnyBuffer>()  // s = new_residual [..., H]
                                  .Arg<ffi::AnyBuffer>()  // gamma [H]
                                  .Arg<ffi::AnyBuffer>()  // rsigma [...]
                                  .Ret<ffi::AnyBuffer>()  // dx (= dresidual)
                                  .Ret<ffi::AnyBuffer>()  // dgamma [H]
                                  .Attr<bool>("zero_centered_gamma"));
