// Shared-memory staging of rows for memory-bound kernels (sm_90): one thread starts bulk
// copies (cp.async.bulk, the copy engine) of whole segments into a ring of stages, each
// stage completing on its own mbarrier, while the block computes on an earlier stage. A
// few stages hold far more bytes in flight per SM than per-thread register loads can,
// which is what a streaming kernel needs to approach the HBM bandwidth.
//
// Protocol (every kernel using it): thread 0 calls InitStageBarriers, then issues the
// first stages; __syncthreads(); for each item i: WaitStage on stage i % stages, compute
// from the stage's buffers, __syncthreads() (the stage is free), then thread 0 issues item
// i + stages into it. A stage's buffers are only read by ordinary loads, never written by
// them, so no proxy fence is needed between a stage's readers and its next bulk copy.
#pragma once

#include <cuda/ptx>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

namespace jaxfuse {
namespace gpu {

// Bytes at the start of dynamic shared memory reserved for the stage barriers (up to 16
// stages); the stage buffers follow, 128-byte aligned.
constexpr int kStageBarrierBytes = 128;

// Dynamic shared memory of one staged block at most: two blocks fit an H100/H200 SM
// (228 KB, 1 KB of it reserved per block), so one block's barrier waits overlap the other's.
constexpr int kStagedMaxSharedBytes = 112 * 1024;

__device__ __forceinline__ void InitStageBarriers(uint64_t* barriers, int stages) {
  for (int stage = 0; stage < stages; ++stage) cuda::ptx::mbarrier_init(&barriers[stage], 1);
  cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
}

// Announces `bytes` arriving on `barrier` (one thread, before that stage's copies).
__device__ __forceinline__ void ExpectStageBytes(uint64_t* barrier, uint32_t bytes) {
  cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta,
                                       cuda::ptx::space_shared, barrier, bytes);
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory to
// shared memory, completing on `barrier`.
__device__ __forceinline__ void CopyToStage(void* destination, const void* source, uint32_t bytes,
                                            uint64_t* barrier) {
  cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, destination,
                           source, bytes, barrier);
}

// Waits until the copies into a stage have landed: `phase` is the parity of the stage's use
// (0 on its first use, then alternating; kernels track it with a counter, not a division).
__device__ __forceinline__ void WaitStage(uint64_t* barrier, uint32_t phase) {
  while (!cuda::ptx::mbarrier_try_wait_parity(barrier, phase)) {
  }
}

// The most dynamic shared memory one block may opt into on the current device (227 KB on
// sm_90; 0 if the query fails), cached per device: the budget of kernels that run one
// block per SM because two stages of their rows do not fit kStagedMaxSharedBytes.
inline int MaxOptInSharedBytes() {
  static std::mutex mutex;
  static std::map<int, int> cache;
  int device = 0;
  cudaGetDevice(&device);
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(device); it != cache.end()) return it->second;
  int bytes = 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
      cudaSuccess) {
    bytes = 0;
  }
  cudaGetLastError();  // a failed query must not surface as a later launch's error
  cache.emplace(device, bytes);
  return bytes;
}

// Lets `kernel` use at least `bytes` of dynamic shared memory on the current device (the
// attribute only ever grows, so launches of one kernel with different sizes all fit).
inline void AllowStagedSharedMemory(const void* kernel, int bytes = kStagedMaxSharedBytes) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int> allowed;
  int device = 0;
  cudaGetDevice(&device);
  std::lock_guard<std::mutex> lock(mutex);
  int& current = allowed[std::make_pair(device, kernel)];
  if (current < bytes) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) ==
        cudaSuccess) {
      current = bytes;
    }
    cudaGetLastError();  // a failed call must not surface as a later launch's error
  }
}

}  // namespace gpu
}  // namespace jaxfuse
