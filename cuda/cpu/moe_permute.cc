// CPU handlers for the MoE token permutation (see jaxfuse/moe_permute.h): plain loops,
// fp32 accumulation, one rounding at the store.
#include <cstring>

#include "jaxfuse/ffi_common.h"
#include "jaxfuse/moe_permute.h"
#include "jaxfuse/numeric.h"

namespace jaxfuse {
namespace {

float Load(const void* base, ffi::DataType type, int64_t index) {
  switch (type) {
    case ffi::DataType::F32: return static_cast<const float*>(base)[index];
    case ffi::DataType::BF16: return ToFloat(static_cast<const bfloat16_bits*>(base)[index]);
    default: return ToFloat(static_cast<const float16_bits*>(base)[index]);
  }
}

void Store(void* base, ffi::DataType type, int64_t index, float value) {
  switch (type) {
    case ffi::DataType::F32: static_cast<float*>(base)[index] = value; break;
    case ffi::DataType::BF16: static_cast<bfloat16_bits*>(base)[index] = ToBFloat16(value); break;
    default: static_cast<float16_bits*>(base)[index] = ToFloat16(value); break;
  }
}

size_t ElementBytes(ffi::DataType type) { return type == ffi::DataType::F32 ? 4 : 2; }

ffi::Error PermuteCpu(ffi::AnyBuffer x, ffi::AnyBuffer row_map, ffi::Result<ffi::AnyBuffer> out) {
  PermuteProblem p;
  if (auto e = ParsePermute(x, row_map, *out, &p); e.failure()) return e;
  const int32_t* map = row_map.typed_data<int32_t>();
  const size_t row_bytes = p.hidden * ElementBytes(x.element_type());
  const char* src = static_cast<const char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  for (int64_t t = 0; t < p.tokens; ++t) {
    for (int64_t j = 0; j < p.topk; ++j) {
      const int32_t row = map[t * p.topk + j];
      if (!RowInRange(row, p.rows)) continue;
      std::memcpy(dst + row * row_bytes, src + t * row_bytes, row_bytes);
    }
  }
  return ffi::Error::Success();
}

ffi::Error UnpermuteCpu(ffi::AnyBuffer y, ffi::AnyBuffer row_map, ffi::AnyBuffer w,
                        ffi::Result<ffi::AnyBuffer> out) {
  PermuteProblem p;
  if (auto e = ParseUnpermute(y, row_map, w, *out, &p); e.failure()) return e;
  const int32_t* map = row_map.typed_data<int32_t>();
  const float* weights = w.typed_data<float>();
  const ffi::DataType type = y.element_type();
  for (int64_t t = 0; t < p.tokens; ++t) {
    for (int64_t h = 0; h < p.hidden; ++h) {
      float sum = 0.0f;
      for (int64_t j = 0; j < p.topk; ++j) {
        const int32_t row = map[t * p.topk + j];
        if (!RowInRange(row, p.rows)) continue;
        sum += weights[t * p.topk + j] * Load(y.untyped_data(), type, row * p.hidden + h);
      }
      Store(out->untyped_data(), type, t * p.hidden + h, sum);
    }
  }
  return ffi::Error::Success();
}

ffi::Error UnpermuteBwdCpu(ffi::AnyBuffer dout, ffi::AnyBuffer y, ffi::AnyBuffer row_map,
                           ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> dy,
                           ffi::Result<ffi::AnyBuffer> dw) {
  PermuteProblem p;
  if (auto e = ParseUnpermuteBwd(dout, y, row_map, w, *dy, *dw, &p); e.failure()) return e;
  const int32_t* map = row_map.typed_data<int32_t>();
  const float* weights = w.typed_data<float>();
  float* d_weights = dw->typed_data<float>();
  const ffi::DataType type = y.element_type();
  for (int64_t t = 0; t < p.tokens; ++t) {
    for (int64_t j = 0; j < p.topk; ++j) {
      const int32_t row = map[t * p.topk + j];
      float dot = 0.0f;
      if (RowInRange(row, p.rows)) {
        const float weight = weights[t * p.topk + j];
        for (int64_t h = 0; h < p.hidden; ++h) {
          const float g = Load(dout.untyped_data(), type, t * p.hidden + h);
          dot += g * Load(y.untyped_data(), type, row * p.hidden + h);
          Store(dy->untyped_data(), type, row * p.hidden + h, weight * g);
        }
      }
      d_weights[t * p.topk + j] = dot;
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxfuse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseMoePermuteCpu, jaxfuse::PermuteCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()   // x [T, H]
                                  .Arg<xla::ffi::AnyBuffer>()   // row_map int32 [T, k]
                                  .Ret<xla::ffi::AnyBuffer>());  // out [T*k, H]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseMoeUnpermuteCpu, jaxfuse::UnpermuteCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()   // y_sorted [T*k, H]
                                  .Arg<xla::ffi::AnyBuffer>()   // row_map int32 [T, k]
                                  .Arg<xla::ffi::AnyBuffer>()   // combine_weights f32 [T, k]
                                  .Ret<xla::ffi::AnyBuffer>());  // out [T, H]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseMoeUnpermuteBwdCpu, jaxfuse::UnpermuteBwdCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()   // d_out [T, H]
                                  .Arg<xla::ffi::AnyBuffer>()   // y_sorted [T*k, H]
                                  .Arg<xla::ffi::AnyBuffer>()   // row_map int32 [T, k]
                                  .Arg<xla::ffi::AnyBuffer>()   // combine_weights f32 [T, k]
                                  .Ret<xla::ffi::AnyBuffer>()   // d_y_sorted [T*k, H]
                                  .Ret<xla::ffi::AnyBuffer>());  // d_combine_weights f32 [T, k]
