// How many blocks of a kernel the current device holds at once, for persistent grids
// (a grid larger than that runs in waves, and a partial last wave idles most of the GPU).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

namespace jaxfuse {
namespace gpu {

// Multiprocessor count of `device`, read once (a host attribute query, no sync): the
// persistent grids of the CUTLASS kernels.
inline int SmCount(int device) {
  static std::mutex mutex;
  static std::map<int, int> counts;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = counts.find(device); it != counts.end()) return it->second;
  int count = 0;
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  cudaGetLastError();  // a failed query must not surface as a launch error later
  counts.emplace(device, count);
  return count;
}

// Resident blocks of `kernel` launched with `threads` threads and `shared_bytes` of dynamic
// shared memory, over all multiprocessors of the current device; at least 1. Queried once
// per (device, kernel, threads, shared_bytes) and cached: the handlers call it on every
// launch.
inline int64_t ResidentBlocks(const void* kernel, int threads, int shared_bytes = 0) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int, int>, int64_t> cache;
  int device = 0;
  cudaGetDevice(&device);
  const auto key = std::make_tuple(device, kernel, threads, shared_bytes);
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  int sms = 0, per_sm = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared_bytes);
  cudaGetLastError();  // a failed query must not surface as a launch error later
  const int64_t blocks = static_cast<int64_t>(per_sm > 0 ? per_sm : 1) * (sms > 0 ? sms : 1);
  cache.emplace(key, blocks);
  return blocks;
}

}  // namespace gpu
}  // namespace jaxfuse
