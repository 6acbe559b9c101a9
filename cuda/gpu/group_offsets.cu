// CUDA handler for group_offsets: one launch of one 512-thread block; cub::BlockScan (2
// groups per thread) over chunks of 1024 groups with a running carry (any G). Each output k gets
// min(prefix, row_capacity) * stride[k], as int32 or int64. No workspace, no host sync.
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include "jaxfuse/ffi_common.h"

namespace jaxfuse {
namespace {

constexpr int kMaxOutputs = 8;
constexpr int kThreads = 512;
constexpr int kItems = 2;  // 1024 groups per chunk

struct OffsetOutputs {
  void* data[kMaxOutputs];
  int64_t stride[kMaxOutputs];
  bool wide[kMaxOutputs];  // int64
  int count;
};

__global__ void __launch_bounds__(kThreads) GroupOffsetsKernel(const int32_t* sizes, int64_t groups,
                                                               int64_t row_capacity,
                                                               OffsetOutputs outputs) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage storage;
  int64_t carry = 0;
  auto write = [&](int64_t index, int64_t rows) {
    if (row_capacity >= 0 && rows > row_capacity) rows = row_capacity;
#pragma unroll
    for (int k = 0; k < kMaxOutputs; ++k) {  // unrolled: the parameter is indexed statically
      if (k >= outputs.count) break;
      const int64_t value = rows * outputs.stride[k];
      if (outputs.wide[k]) {
        static_cast<int64_t*>(outputs.data[k])[index] = value;
      } else {
        static_cast<int32_t*>(outputs.data[k])[index] = static_cast<int32_t>(value);
      }
    }
  };
  for (int64_t base = 0; base < groups; base += kThreads * kItems) {
    const int64_t g0 = base + threadIdx.x * kItems;
    int64_t items[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int32_t size = g0 + i < groups ? sizes[g0 + i] : 0;
      items[i] = size > 0 ? size : 0;  // negative sizes count as zero
    }
    int64_t chunk_total;
    Scan(storage).ExclusiveSum(items, items, chunk_total);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      if (g0 + i < groups) write(g0 + i, carry + items[i]);
    }
    carry += chunk_total;
    __syncthreads();  // storage is reused by the next chunk
  }
  if (threadIdx.x == 0) write(groups, carry);
}

ffi::Error GroupOffsetsCuda(cudaStream_t stream, ffi::AnyBuffer sizes, ffi::RemainingRets rets,
                            ffi::Span<const int64_t> strides, int64_t row_capacity) {
  if (sizes.element_type() != ffi::DataType::S32 || sizes.dimensions().size() != 1) {
    return InvalidArgument("group_sizes must be int32 [G], got ", DataTypeName(sizes.element_type()),
                           " ", ShapeString(sizes.dimensions()));
  }
  const int64_t groups = sizes.dimensions()[0];
  if (rets.size() != strides.size() || rets.size() == 0 ||
      rets.size() > static_cast<size_t>(kMaxOutputs)) {
    return InvalidArgument("group_offsets: 1 to ", kMaxOutputs, " outputs, one per stride; got ",
                           rets.size(), " outputs and ", strides.size(), " strides");
  }
  OffsetOutputs outputs{};
  outputs.count = static_cast<int>(rets.size());
  for (size_t k = 0; k < rets.size(); ++k) {
    auto result = rets.get<ffi::AnyBuffer>(k);
    if (result.has_error()) return result.error();
    ffi::AnyBuffer out = **result;
    if (out.element_count() != static_cast<size_t>(groups + 1) ||
        (out.element_type() != ffi::DataType::S32 && out.element_type() != ffi::DataType::S64)) {
      return InvalidArgument("group offsets output ", k, " must be int32/int64 [", groups + 1, "]");
    }
    outputs.data[k] = out.untyped_data();
    outputs.stride[k] = strides[k];
    outputs.wide[k] = out.element_type() == ffi::DataType::S64;
  }
  GroupOffsetsKernel<<<1, kThreads, 0, stream>>>(static_cast<const int32_t*>(sizes.untyped_data()),
                                                 groups, row_capacity, outputs);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return Internal("group offsets kernel: ", cudaGetErrorString(error));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxfuse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupOffsetsCuda, jaxfuse::GroupOffsetsCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // group_sizes int32 [G]
                                  .RemainingRets()             // offsets [G + 1] per stride
                                  .Attr<xla::ffi::Span<const int64_t>>("strides")
                                  .Attr<int64_t>("row_capacity"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
