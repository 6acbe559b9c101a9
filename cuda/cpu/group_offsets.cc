// CPU handler for group_offsets: exclusive prefix sums of group sizes (negative sizes
// count as zero), one output per stride, optionally clamped to a row capacity.
#include <vector>

#include "jaxfuse/ffi_common.h"

namespace jaxfuse {
namespace {

ffi::Error GroupOffsetsCpuImpl(ffi::AnyBuffer sizes, ffi::RemainingRets outputs,
                               ffi::Span<const int64_t> strides, int64_t row_capacity) {
  if (sizes.element_type() != ffi::DataType::S32 || sizes.dimensions().size() != 1) {
    return InvalidArgument("group_sizes must be int32 [G], got ", DataTypeName(sizes.element_type()),
                           " ", ShapeString(sizes.dimensions()));
  }
  const int64_t groups = sizes.dimensions()[0];
  if (outputs.size() != strides.size()) {
    return InvalidArgument("group_offsets: ", outputs.size(), " outputs but ", strides.size(),
                           " strides");
  }
  const int32_t* in = static_cast<const int32_t*>(sizes.untyped_data());
  std::vector<int64_t> rows(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) {
    rows[g + 1] = rows[g] + (in[g] > 0 ? in[g] : 0);
  }
  for (size_t k = 0; k < outputs.size(); ++k) {
    auto result = outputs.get<ffi::AnyBuffer>(k);
    if (result.has_error()) return result.error();
    ffi::AnyBuffer out = **result;
    if (out.element_count() != static_cast<size_t>(groups + 1)) {
      return InvalidArgument("group offsets output ", k, " must have ", groups + 1, " elements");
    }
    for (int64_t g = 0; g <= groups; ++g) {
      int64_t value = rows[g];
      if (row_capacity >= 0 && value > row_capacity) value = row_capacity;
      value *= strides[k];
      if (out.element_type() == ffi::DataType::S64) {
        static_cast<int64_t*>(out.untyped_data())[g] = value;
      } else if (out.element_type() == ffi::DataType::S32) {
        static_cast<int32_t*>(out.untyped_data())[g] = static_cast<int32_t>(value);
      } else {
        return InvalidArgument("group offsets outputs must be int32 or int64");
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxfuse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupOffsetsCpu, jaxfuse::GroupOffsetsCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // group_sizes int32 [G]
                                  .RemainingRets()             // offsets [G + 1] per stride
                                  .Attr<xla::ffi::Span<const int64_t>>("strides")
                                  .Attr<int64_t>("row_capacity"));  // < 0: none
