// What every FFI handler file includes: the XLA FFI API, the version check, and small
// helpers for error messages and shapes.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

// Handlers built against newer FFI headers than the runtime speaks are refused when
// jaxlib loads them, with an error far from the cause. Fail the build instead.
#ifndef JAXFUSE_MAX_FFI_API_MINOR
#define JAXFUSE_MAX_FFI_API_MINOR 4
#endif
static_assert(XLA_FFI_API_MAJOR == 0 && XLA_FFI_API_MINOR <= JAXFUSE_MAX_FFI_API_MINOR,
              "jaxfuse: the XLA FFI headers are newer than the FFI API the supported jaxlib "
              "runtimes speak (0.3 for jaxlib 0.10, 0.4 for jaxlib 0.11). Build against "
              "jaxlib<0.12, or raise JAXFUSE_MAX_FFI_API_MINOR together with the jaxlib pin.");

namespace jaxfuse {

namespace ffi = ::xla::ffi;

// Concatenates its arguments with operator<< into an InvalidArgument error.
template <typename... Parts>
ffi::Error InvalidArgument(Parts&&... parts) {
  std::ostringstream message;
  message << "jaxfuse: ";
  (message << ... << std::forward<Parts>(parts));
  return ffi::Error::InvalidArgument(message.str());
}

template <typename... Parts>
ffi::Error Internal(Parts&&... parts) {
  std::ostringstream message;
  message << "jaxfuse: ";
  (message << ... << std::forward<Parts>(parts));
  return ffi::Error::Internal(message.str());
}

inline std::string ShapeString(ffi::Span<const int64_t> dims) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << "]";
  return out.str();
}

inline const char* DataTypeName(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    default: return "unsupported";
  }
}

// The leading dimensions multiplied: the rows of a [..., cols] matrix (1 for rank 1).
inline int64_t LeadingProduct(ffi::Span<const int64_t> dims) {
  int64_t product = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) product *= dims[i];
  return product;
}

}  // namespace jaxfuse
