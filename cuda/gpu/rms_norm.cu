// CUDA handlers for RMSNorm and residual-add + RMSNorm (math in jaxfuse/rms_norm.h).
//
// Fast path (H a multiple of 16 bytes' worth of elements, 16-byte aligned buffers):
// `tpr` threads per row, each holding kVecs 16-byte vectors of the row in registers
// between the reduction and the write, so every byte is read once and written once.
// Each thread holds at least 2 vectors; rows of up to 64 vectors share a warp (tpr = 1..32,
// a power of two); wider rows use a multiple of 32 threads and a warp-shuffle +
// shared-memory block reduction.
// Threads of a row read consecutive 16-byte vectors (coalesced). The grid is resident
// (occupancy.cuh): each row slot (blocks x rows per block) walks the rows with a fixed
// stride.
//
// Backward: the same resident grid of slots, each loading its next row before working on
// the current one; each slot accumulates its dgamma partial sum in registers and writes
// it to a float32 [slots, H] scratch result, which a second kernel sums over slots in a
// fixed order: deterministic, no atomics.
//
// Staged path (rows of at least kStagedMinVectors vectors, 16-byte aligned, two stages of
// whole rows within the shared-memory budget; taken before the register-resident one):
// a resident grid of blocks, each walking rows with a stride while one thread keeps the
// next rows' inputs in flight with bulk copies into shared memory (staging.cuh). More
// bytes in flight than registers hold: on the H200 (9f7fea60) rms_norm fwd+bwd at
// 65536 x 8192 bf16 1.92 -> 1.72 ms, add_rms_norm 3.92 -> 3.49 ms, 16384 x 8192 0.56 ->
// 0.46 ms; the forwards within noise of the register kernels except wider rows (8192 x
// 16384: 0.27 -> 0.21 ms). Rows whose two stages exceed 112 KB (add_rms_norm and the
// backward at 16384 bf16) run one block per SM on the device's opt-in shared memory: at
// 8192 x 16384 (8040eb20) add_rms_norm fwd 0.477 -> 0.322 ms, rms_norm fwd+bwd 0.645 ->
// 0.464 ms, add_rms_norm fwd+bwd 0.947 -> 0.813 ms.
//
// Generic path (odd H, misaligned buffers, H beyond the register-resident capacity):
// scalar loads, two passes over the row (the second pass mostly hits L2), the backward's
// dgamma partials accumulated in the scratch row the slot owns.
//
// Nothing syncs with the host or allocates: command-buffer (CUDA graph) compatible.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "jaxfuse/ffi_common.h"
#include "jaxfuse/rms_norm.h"
#include "occupancy.cuh"
#include "staging.cuh"

namespace jaxfuse {
namespace {

// Threads per block of the register-resident kernels, by vectors per thread: more vectors
// keep more registers live (the backward with 8 vectors and its dgamma accumulators uses
// ~250 registers: one 256-thread block per SM), so the 2-vector kernels take wider rows.
constexpr int FwdMaxThreads(int) { return 512; }
// Two vectors per thread fit three 512-thread blocks per SM (<= 42 registers; the
// compiler picked 53 for rms_norm's strided loop when left alone).
constexpr int FwdMinBlocks(int vecs) { return vecs > 2 ? 1 : 3; }
constexpr int BwdMaxThreads(int vecs) { return vecs <= 2 ? 512 : 256; }
// Measured on the H200 at 65536 x 8192 and 16384 x 4096 bf16 (2237ad74, results README):
// 2 vectors per thread (up to 512 threads per row) against the earlier 128-thread target
// (8 vectors at H = 8192): rms_norm forward 51% -> 69% of copy bandwidth, add_rms_norm
// forward 70% -> 90%, their forward + backward 44% -> 56% and 40% -> 52%; 1 vector per
// thread was slower. (Since c8688e9c, with the resident grids: 80-83% and 88-94%.)
constexpr int kDefaultThreadsPerRow = 512;
constexpr int kBlockThreads = 256;  // threads per block when rows share a block
constexpr int kGenericThreads = 256;

// Target threads per row (a power of two, 32-1024): the configuration takes the fewest
// vectors per thread (at least 2) whose row fits in that many threads.
// JAXFUSE_RMS_NORM_THREADS_PER_ROW overrides the default (benchmarks sweep it); read once.
int ThreadsPerRowTarget() {
  static const int target = [] {
    if (const char* value = std::getenv("JAXFUSE_RMS_NORM_THREADS_PER_ROW")) {
      const int parsed = std::atoi(value);
      if (parsed >= 32 && parsed <= 1024 && (parsed & (parsed - 1)) == 0) return parsed;
    }
    return kDefaultThreadsPerRow;
  }();
  return target;
}

// Register-resident grids are resident (as many blocks as fit on the GPU at once, each
// walking rows with a stride; the backward's slots also prefetch their next row) unless
// JAXFUSE_RMS_NORM_PERSISTENT=0, which launches one block per row group (a benchmark knob:
// on the H200 the two were within run-to-run noise of each other in the forward). Read once.
bool PersistentGrid() {
  static const bool persistent = [] {
    const char* value = std::getenv("JAXFUSE_RMS_NORM_PERSISTENT");
    return value == nullptr || std::atoi(value) != 0;
  }();
  return persistent;
}

// Blocks of a register-resident launch that wants `wanted` blocks of `threads` threads:
// at most one resident wave (a second, partial wave would run on a fraction of the GPU
// while holding its share of the rows) unless PersistentGrid() is off; at least 1.
int64_t GridBlocks(const void* kernel, int threads, int64_t wanted) {
  const int64_t blocks =
      PersistentGrid() ? std::min(wanted, gpu::ResidentBlocks(kernel, threads)) : wanted;
  return std::max<int64_t>(1, blocks);
}

// --- conversions ------------------------------------------------------------------

__device__ __forceinline__ float ToF(float v) { return v; }
__device__ __forceinline__ float ToF(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToF(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T FromF(float v);
template <> __device__ __forceinline__ float FromF<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half FromF<__half>(float v) {
  return __float2half_rn(v);
}

// Rounds to T and back: the value as stored.
template <typename T> __device__ __forceinline__ float Rounded(float v) {
  return ToF(FromF<T>(v));
}

template <typename T>
struct alignas(16) Pack {
  static constexpr int kElems = 16 / sizeof(T);
  T v[kElems];
};

template <typename T>
__device__ __forceinline__ Pack<T> LoadPack(const T* base, int64_t index) {
  return *reinterpret_cast<const Pack<T>*>(base + index);
}

template <typename T>
__device__ __forceinline__ void StorePack(T* base, int64_t index, const Pack<T>& pack) {
  *reinterpret_cast<Pack<T>*>(base + index) = pack;
}

// kN scales (gamma or 1 + gamma) from column `col`, with 16-byte loads.
template <typename G, int kN>
__device__ __forceinline__ void LoadScales(const G* gamma, int64_t col, bool zero_centered,
                                           float (&scale)[kN]) {
  constexpr int kPer = Pack<G>::kElems;
  static_assert(kN % kPer == 0, "gamma vectors must tile the x vector");
#pragma unroll
  for (int i = 0; i < kN; i += kPer) {
    const Pack<G> pack = LoadPack(gamma, col + i);
#pragma unroll
    for (int k = 0; k < kPer; ++k) scale[i + k] = RmsNormScale(ToF(pack.v[k]), zero_centered);
  }
}

// Sum over the `tpr` threads of a row (threadIdx.x in [0, tpr), row threadIdx.y). tpr is
// a power of two <= 32 or a multiple of 32. Every thread of the block must call it.
// The result is the same on every thread of the row (fixed summation order).
__device__ __forceinline__ float RowSum(float value, int tpr) {
  const int width = tpr < 32 ? tpr : 32;
  for (int offset = width / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  if (tpr <= 32) return value;
  __shared__ float partial[32];
  const int warps = tpr / 32;
  const int base = threadIdx.y * warps;
  if (threadIdx.x % 32 == 0) partial[base + threadIdx.x / 32] = value;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) total += partial[base + w];
  __syncthreads();  // partial is reused by the next call
  return total;
}

// --- forward, register resident -------------------------------------------------------

// Loads the kVecs vectors this thread holds of row `row` when the row exists: x, or for
// kAdd x + residual as stored (rounded to T).
template <typename T, int kVecs, bool kAdd>
__device__ __forceinline__ void LoadRow(const T* x, const T* residual, int64_t row,
                                        int64_t rows, int64_t cols, int tpr,
                                        Pack<T> (&xs)[kVecs]) {
  constexpr int kElems = Pack<T>::kElems;
  if (row >= rows) return;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int64_t col = (static_cast<int64_t>(v) * tpr + threadIdx.x) * kElems;
    if (col < cols) {
      xs[v] = LoadPack(x, row * cols + col);
      if constexpr (kAdd) {
        const Pack<T> r = LoadPack(residual, row * cols + col);
#pragma unroll
        for (int k = 0; k < kElems; ++k) xs[v].v[k] = FromF<T>(ToF(xs[v].v[k]) + ToF(r.v[k]));
      }
    }
  }
}

// A grid of `slots` rows (blocks x rows per block) walks the rows with a fixed stride.
// Measured on the H200 at 65536 x 8192 bf16 (c8688e9c, 9e2113f4), against this kernel at
// 0.64 ms (rms_norm) and 1.14 ms (add_rms_norm): prefetching each slot's next row gained
// nothing for rms_norm and cost add_rms_norm a third (72 registers: one 512-thread block
// per SM); holding the gamma scales in registers across rows (loaded once per slot, 58-62
// registers: two blocks per SM) was 12% and 6% slower. Hence three blocks per SM.
template <typename T, typename G, int kVecs, bool kAdd>
__global__ void __launch_bounds__(FwdMaxThreads(kVecs), FwdMinBlocks(kVecs))
RmsNormFwdKernel(const T* __restrict__ x, const T* residual, const G* __restrict__ gamma,
                 T* __restrict__ out, T* new_residual, float* __restrict__ rsigma,
                 int64_t rows, int64_t cols, float eps, bool zero_centered) {
  constexpr int kElems = Pack<T>::kElems;
  const int tpr = blockDim.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  // Every thread of the block runs the same number of iterations (block-wide reductions).
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * blockDim.y; row0 < rows;
       row0 += stride) {
    const int64_t row = row0 + threadIdx.y;
    const bool valid_row = row < rows;
    const int64_t base = row * cols;
    Pack<T> xs[kVecs];
    LoadRow<T, kVecs, kAdd>(x, residual, row, rows, cols, tpr, xs);
    float sum = 0.0f;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int64_t col = (static_cast<int64_t>(v) * tpr + threadIdx.x) * kElems;
      if (valid_row && col < cols) {
        if constexpr (kAdd) StorePack(new_residual, base + col, xs[v]);
#pragma unroll
        for (int k = 0; k < kElems; ++k) {
          const float f = ToF(xs[v].v[k]);
          sum += f * f;
        }
      }
    }
    sum = RowSum(sum, tpr);
    if (!valid_row) continue;  // after the block-wide reduction
    const float rsig = RmsNormRsigma(sum, cols, eps);
    if (threadIdx.x == 0) rsigma[row] = rsig;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int64_t col = (static_cast<int64_t>(v) * tpr + threadIdx.x) * kElems;
      if (col < cols) {
        float scale[kElems];
        LoadScales(gamma, col, zero_centered, scale);
        Pack<T> o;
#pragma unroll
        for (int k = 0; k < kElems; ++k) {
          o.v[k] = FromF<T>(RmsNormApply(ToF(xs[v].v[k]), rsig, scale[k]));
        }
        StorePack(out, base + col, o);
      }
    }
  }
}

// --- backward, register resident ------------------------------------------------------

// Loads the kVecs vectors this thread holds of row `row` of dy and s (and dz when kAdd),
// and the row's rsigma, when the row exists.
template <typename T, int kVecs, bool kAdd>
__device__ __forceinline__ void LoadBwdRow(const T* dy, const T* dz, const T* s,
                                           const float* rsigma, int64_t row, int64_t rows,
                                           int64_t cols, int tpr, Pack<T> (&gs)[kVecs],
                                           Pack<T> (&xs)[kVecs], Pack<T> (&dzs)[kVecs],
                                           float& rs) {
  constexpr int kElems = Pack<T>::kElems;
  if (row >= rows) return;
  rs = rsigma[row];
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int64_t col = (static_cast<int64_t>(v) * tpr + threadIdx.x) * kElems;
    if (col < cols) {
      gs[v] = LoadPack(dy, row * cols + col);
      xs[v] = LoadPack(s, row * cols + col);
      if constexpr (kAdd) dzs[v] = LoadPack(dz, row * cols + col);
    }
  }
}

// Each slot loads its next row before working on the current one (kVecs <= 4: with 8
// vectors the dgamma accumulators alone hold 64 registers). Unlike the forward's, this
// prefetch paid off on the H200: fwd+bwd minus fwd 1.46 -> 1.18-1.23 ms at 65536 x 8192.
template <typename T, typename G, int kVecs, bool kAdd>
__global__ void __launch_bounds__(BwdMaxThreads(kVecs))
RmsNormBwdKernel(const T* __restrict__ dy, const T* __restrict__ dz, const T* __restrict__ s,
                 const G* __restrict__ gamma, const float* __restrict__ rsigma,
                 T* __restrict__ dx, float* __restrict__ partials, int64_t slots_used,
                 int64_t rows, int64_t cols, bool zero_centered) {
  constexpr int kElems = Pack<T>::kElems;
  constexpr bool kPrefetch = kVecs <= 4;
  const int tpr = blockDim.x;
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  const float inv_cols = 1.0f / static_cast<float>(cols);
  float acc[kVecs][kElems];
#pragma unroll
  for (int v = 0; v < kVecs; ++v)
#pragma unroll
    for (int k = 0; k < kElems; ++k) acc[v][k] = 0.0f;

  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * blockDim.y;
  Pack<T> g[kVecs], x[kVecs], extra[kVecs];
  float rs = 0.0f;
  if constexpr (kPrefetch) {
    LoadBwdRow<T, kVecs, kAdd>(dy, dz, s, rsigma, first_row + threadIdx.y, rows, cols, tpr,
                               g, x, extra, rs);
  }
  // Every thread of the block runs the same number of iterations (block-wide reductions).
  for (int64_t row0 = first_row; row0 < rows; row0 += stride) {
    const int64_t row = row0 + threadIdx.y;
    const bool valid_row = row < rows;
    const int64_t base = row * cols;
    Pack<T> next_g[kVecs], next_x[kVecs], next_extra[kVecs];
    float next_rs = 0.0f;
    if constexpr (kPrefetch) {
      LoadBwdRow<T, kVecs, kAdd>(dy, dz, s, rsigma, row + stride, rows, cols, tpr, next_g,
                                 next_x, next_extra, next_rs);
    } else {  // dz is loaded where it is used: registers
      LoadBwdRow<T, kVecs, false>(dy, dz, s, rsigma, row, rows, cols, tpr, g, x, extra, rs);
    }
    float dot = 0.0f;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int64_t col = (static_cast<int64_t>(v) * tpr + threadIdx.x) * kElems;
      if (valid_row && col < cols) {
        float scale[kElems];
        LoadScales(gamma, col, zero_centered, scale);
#pragma unroll
        for (int k = 0; k < kElems; ++k) {
          const float gy = ToF(g[v].v[k]);
          const float xhat = ToF(x[v].v[k]) * rs;
          dot += gy * scale[k] * xhat;
          acc[v][k] += gy * xhat;
        }
      }
    }
    dot = RowSum(dot, tpr);
    const float m = dot * inv_cols;
    if (valid_row) {
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int64_t col = (static_cast<int64_t>(v) * tpr + threadIdx.x) * kElems;
        if (col < cols) {
          float scale[kElems];
          LoadScales(gamma, col, zero_centered, scale);
          if constexpr (kAdd && !kPrefetch) extra[v] = LoadPack(dz, base + col);
          Pack<T> o;
#pragma unroll
          for (int k = 0; k < kElems; ++k) {
            float value = RmsNormInputGrad(ToF(g[v].v[k]), ToF(x[v].v[k]), rs, scale[k], m);
            if constexpr (kAdd) value += ToF(extra[v].v[k]);
            o.v[k] = FromF<T>(value);
          }
          StorePack(dx, base + col, o);
        }
      }
    }
    if constexpr (kPrefetch) {
      rs = next_rs;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        g[v] = next_g[v];
        x[v] = next_x[v];
        if constexpr (kAdd) extra[v] = next_extra[v];
      }
    }
  }
  if (slot >= slots_used) return;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int64_t col = (static_cast<int64_t>(v) * tpr + threadIdx.x) * kElems;
    if (col < cols) {
#pragma unroll
      for (int k = 0; k < kElems; k += 4) {
        *reinterpret_cast<float4*>(partials + slot * cols + col + k) =
            make_float4(acc[v][k], acc[v][k + 1], acc[v][k + 2], acc[v][k + 3]);
      }
    }
  }
}

// --- staged: whole rows through shared memory (staging.cuh) ---------------------------------
//
// A resident grid of blocks, each walking rows blockIdx.x, + gridDim.x, ...; thread 0 keeps
// the next `stages` rows' inputs in flight with bulk copies while the block reduces and
// writes the current one from shared memory. The register-resident kernels hold one row
// per thread group in registers, which caps the bytes in flight per SM; this is for rows
// wide enough to fill a block (kStagedMinVectors).

constexpr int kStagedMaxThreads = 256;
constexpr int64_t kStagedMinVectors = 128;

// JAXFUSE_RMS_NORM_STAGED=0 keeps the register-resident kernels (a benchmark knob); read once.
bool StagedEnabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("JAXFUSE_RMS_NORM_STAGED");
    return value == nullptr || std::atoi(value) != 0;
  }();
  return enabled;
}

// Most stages per block: JAXFUSE_RMS_NORM_STAGES (2-8) overrides the default (a benchmark
// knob); read once.
int MaxStages() {
  static const int stages = [] {
    const char* value = std::getenv("JAXFUSE_RMS_NORM_STAGES");
    const int parsed = value != nullptr ? std::atoi(value) : 0;
    // 2: more resident blocks per SM. At 65536 x 8192 bf16 (82ebaf3d) rms_norm fwd+bwd
    // took 1.589 ms with 2 stages, 1.683 with 3, 1.659 with up to 4 (the forward 0.609,
    // 0.645, 0.622); at 16384 x 4096 0.230, 0.236, 0.243.
    return parsed >= 2 && parsed <= 8 ? parsed : 2;
  }();
  return stages;
}

// Whether the staged backward with `vecs_per_thread` vectors per thread holds its gamma
// scales in registers. By default from 4 vectors (rows of 8192 bf16 up: 32 KB of fp32
// gamma and more, which the L1 left beside the stages does not keep): on the H200
// (8040eb20) rms_norm fwd+bwd at 65536 x 8192 1.558 -> 1.470 ms, add_rms_norm 2.405 ->
// 2.231 ms, 8192 x 16384 0.464 -> 0.418 and 0.813 -> 0.604 ms; rows of 4096 (2 vectors)
// were 5-9% slower held. JAXFUSE_RMS_NORM_BWD_HOLD_SCALES=0|1 forces it (a benchmark knob);
// read once.
bool HoldScalesInBwd(int64_t vecs_per_thread) {
  static const int forced = [] {
    const char* value = std::getenv("JAXFUSE_RMS_NORM_BWD_HOLD_SCALES");
    return value == nullptr ? -1 : (std::atoi(value) != 0 ? 1 : 0);
  }();
  return forced >= 0 ? forced == 1 : vecs_per_thread >= 4;
}

// The stage count (2 to MaxStages) for rows of `row_bytes` over `streams` inputs, or 0
// when two stages do not fit. The budget is kStagedMaxSharedBytes (two or more blocks per
// SM); rows too wide for that (add_rms_norm and backward rows of 16384 bf16) take one
// block per SM with up to the device's opt-in limit.
int StagesFor(int64_t row_bytes, int streams) {
  const int64_t per_stage = row_bytes * streams;
  for (const int64_t budget : {static_cast<int64_t>(gpu::kStagedMaxSharedBytes),
                               static_cast<int64_t>(gpu::MaxOptInSharedBytes())}) {
    const int64_t fit = (budget - gpu::kStageBarrierBytes) / per_stage;
    if (fit >= 2) return static_cast<int>(std::min<int64_t>(fit, MaxStages()));
  }
  return 0;
}

// Dynamic shared memory of a staged launch: the barriers, then `stages` x `streams` rows.
int StagedSharedBytes(int stages, int streams, int64_t row_bytes) {
  return gpu::kStageBarrierBytes + stages * streams * static_cast<int>(row_bytes);
}

int StagedThreads(int64_t vectors) {
  return static_cast<int>(std::min<int64_t>(kStagedMaxThreads, (vectors + 31) / 32 * 32));
}

// Element `col`.. of a staged row as stored: x, or for kAdd x + residual rounded to T.
template <typename T, bool kAdd>
__device__ __forceinline__ Pack<T> StagedInput(const T* stage, int64_t cols, int64_t col) {
  Pack<T> value = *reinterpret_cast<const Pack<T>*>(stage + col);
  if constexpr (kAdd) {
    const Pack<T> residual = *reinterpret_cast<const Pack<T>*>(stage + cols + col);
#pragma unroll
    for (int k = 0; k < Pack<T>::kElems; ++k) {
      value.v[k] = FromF<T>(ToF(value.v[k]) + ToF(residual.v[k]));
    }
  }
  return value;
}

template <typename T, typename G, bool kAdd>
__global__ void __launch_bounds__(kStagedMaxThreads)
RmsNormStagedFwdKernel(const T* __restrict__ x, const T* residual, const G* __restrict__ gamma,
                       T* __restrict__ out, T* new_residual, float* __restrict__ rsigma,
                       int64_t rows, int64_t cols, float eps, bool zero_centered, int stages) {
  constexpr int kElems = Pack<T>::kElems;
  constexpr int kStreams = kAdd ? 2 : 1;  // x, residual
  extern __shared__ __align__(128) unsigned char shared[];
  uint64_t* full = reinterpret_cast<uint64_t*>(shared);
  T* buffers = reinterpret_cast<T*>(shared + gpu::kStageBarrierBytes);  // [stages][streams][cols]
  const int64_t vectors = cols / kElems;
  const uint32_t row_bytes = static_cast<uint32_t>(cols * sizeof(T));
  const int64_t my_rows = rows > blockIdx.x ? (rows - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  auto issue = [&](int64_t i, int stage) {  // row i of this block into `stage`
    const int64_t row = blockIdx.x + i * gridDim.x;
    T* destination = buffers + static_cast<int64_t>(stage) * kStreams * cols;
    gpu::ExpectStageBytes(&full[stage], row_bytes * kStreams);
    gpu::CopyToStage(destination, x + row * cols, row_bytes, &full[stage]);
    if constexpr (kAdd) {
      gpu::CopyToStage(destination + cols, residual + row * cols, row_bytes, &full[stage]);
    }
  };
  if (threadIdx.x == 0) {
    gpu::InitStageBarriers(full, stages);
    for (int64_t i = 0; i < my_rows && i < stages; ++i) issue(i, static_cast<int>(i));
  }
  __syncthreads();
  int stage_index = 0;
  uint32_t phase = 0;
  for (int64_t i = 0; i < my_rows; ++i) {
    const int64_t row = blockIdx.x + i * gridDim.x;
    const int64_t base = row * cols;
    const T* stage = buffers + stage_index * kStreams * cols;
    gpu::WaitStage(&full[stage_index], phase);
    float sum = 0.0f;
    for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
      const Pack<T> value = StagedInput<T, kAdd>(stage, cols, v * kElems);
      if constexpr (kAdd) StorePack(new_residual, base + v * kElems, value);
#pragma unroll
      for (int k = 0; k < kElems; ++k) sum += ToF(value.v[k]) * ToF(value.v[k]);
    }
    const float rsig = RmsNormRsigma(RowSum(sum, blockDim.x), cols, eps);
    if (threadIdx.x == 0) rsigma[row] = rsig;
    for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
      const Pack<T> value = StagedInput<T, kAdd>(stage, cols, v * kElems);
      float scale[kElems];
      LoadScales(gamma, v * kElems, zero_centered, scale);
      Pack<T> o;
#pragma unroll
      for (int k = 0; k < kElems; ++k) o.v[k] = FromF<T>(RmsNormApply(ToF(value.v[k]), rsig, scale[k]));
      StorePack(out, base + v * kElems, o);
    }
    __syncthreads();  // the stage is free
    if (threadIdx.x == 0 && i + stages < my_rows) issue(i + stages, stage_index);
    if (++stage_index == stages) {  // counters, not 64-bit divisions per row
      stage_index = 0;
      phase ^= 1;
    }
  }
}

// Backward: each block accumulates its dgamma partial sums for the kVecs vectors per
// thread it owns (columns fixed across rows) in registers and writes them to row
// blockIdx.x of the partials scratch (summed by DgammaReduceKernel).
// kHoldScales keeps this thread's gamma scales in registers for all its rows instead of
// loading them (L1/L2) twice per row (HoldScalesInBwd).
template <typename T, typename G, int kVecs, bool kAdd, bool kHoldScales>
__global__ void __launch_bounds__(kStagedMaxThreads)
RmsNormStagedBwdKernel(const T* __restrict__ dy, const T* __restrict__ dz,
                       const T* __restrict__ s, const G* __restrict__ gamma,
                       const float* __restrict__ rsigma, T* __restrict__ dx,
                       float* __restrict__ partials, int64_t rows, int64_t cols,
                       bool zero_centered, int stages) {
  constexpr int kElems = Pack<T>::kElems;
  constexpr int kStreams = kAdd ? 3 : 2;  // dy, s, dz
  extern __shared__ __align__(128) unsigned char shared[];
  uint64_t* full = reinterpret_cast<uint64_t*>(shared);
  T* buffers = reinterpret_cast<T*>(shared + gpu::kStageBarrierBytes);  // [stages][streams][cols]
  const uint32_t row_bytes = static_cast<uint32_t>(cols * sizeof(T));
  const float inv_cols = 1.0f / static_cast<float>(cols);
  const int64_t my_rows = rows > blockIdx.x ? (rows - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  auto issue = [&](int64_t i, int stage) {  // row i of this block into `stage`
    const int64_t row = blockIdx.x + i * gridDim.x;
    T* destination = buffers + static_cast<int64_t>(stage) * kStreams * cols;
    gpu::ExpectStageBytes(&full[stage], row_bytes * kStreams);
    gpu::CopyToStage(destination, dy + row * cols, row_bytes, &full[stage]);
    gpu::CopyToStage(destination + cols, s + row * cols, row_bytes, &full[stage]);
    if constexpr (kAdd) {
      gpu::CopyToStage(destination + 2 * cols, dz + row * cols, row_bytes, &full[stage]);
    }
  };
  if (threadIdx.x == 0) {
    gpu::InitStageBarriers(full, stages);
    for (int64_t i = 0; i < my_rows && i < stages; ++i) issue(i, static_cast<int>(i));
  }
  __syncthreads();
  float acc[kVecs][kElems];
#pragma unroll
  for (int v = 0; v < kVecs; ++v)
#pragma unroll
    for (int k = 0; k < kElems; ++k) acc[v][k] = 0.0f;
  float held[kHoldScales ? kVecs : 1][kElems];
  if constexpr (kHoldScales) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int64_t col = (static_cast<int64_t>(v) * blockDim.x + threadIdx.x) * kElems;
      if (col < cols) LoadScales(gamma, col, zero_centered, held[v]);
    }
  }
  // This thread's scales for vector v: held, or loaded for this use.
  auto scales_of = [&](int v, int64_t col, float (&scale)[kElems]) {
    if constexpr (kHoldScales) {
#pragma unroll
      for (int k = 0; k < kElems; ++k) scale[k] = held[v][k];
    } else {
      LoadScales(gamma, col, zero_centered, scale);
    }
  };
  int stage_index = 0;
  uint32_t phase = 0;
  for (int64_t i = 0; i < my_rows; ++i) {
    const int64_t row = blockIdx.x + i * gridDim.x;
    const T* stage = buffers + stage_index * kStreams * cols;
    const float rs = rsigma[row];
    gpu::WaitStage(&full[stage_index], phase);
    float dot = 0.0f;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int64_t col = (static_cast<int64_t>(v) * blockDim.x + threadIdx.x) * kElems;
      if (col < cols) {
        const Pack<T> g = *reinterpret_cast<const Pack<T>*>(stage + col);
        const Pack<T> xv = *reinterpret_cast<const Pack<T>*>(stage + cols + col);
        float scale[kElems];
        scales_of(v, col, scale);
#pragma unroll
        for (int k = 0; k < kElems; ++k) {
          const float gy = ToF(g.v[k]);
          const float xhat = ToF(xv.v[k]) * rs;
          dot += gy * scale[k] * xhat;
          acc[v][k] += gy * xhat;
        }
      }
    }
    const float m = RowSum(dot, blockDim.x) * inv_cols;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int64_t col = (static_cast<int64_t>(v) * blockDim.x + threadIdx.x) * kElems;
      if (col < cols) {
        const Pack<T> g = *reinterpret_cast<const Pack<T>*>(stage + col);
        const Pack<T> xv = *reinterpret_cast<const Pack<T>*>(stage + cols + col);
        float scale[kElems];
        scales_of(v, col, scale);
        Pack<T> o;
#pragma unroll
        for (int k = 0; k < kElems; ++k) {
          float value = RmsNormInputGrad(ToF(g.v[k]), ToF(xv.v[k]), rs, scale[k], m);
          if constexpr (kAdd) value += ToF(stage[2 * cols + col + k]);
          o.v[k] = FromF<T>(value);
        }
        StorePack(dx, row * cols + col, o);
      }
    }
    __syncthreads();  // the stage is free
    if (threadIdx.x == 0 && i + stages < my_rows) issue(i + stages, stage_index);
    if (++stage_index == stages) {  // counters, not 64-bit divisions per row
      stage_index = 0;
      phase ^= 1;
    }
  }
  float* partial = partials + static_cast<int64_t>(blockIdx.x) * cols;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const int64_t col = (static_cast<int64_t>(v) * blockDim.x + threadIdx.x) * kElems;
    if (col < cols) {
#pragma unroll
      for (int k = 0; k < kElems; k += 4) {
        *reinterpret_cast<float4*>(partial + col + k) =
            make_float4(acc[v][k], acc[v][k + 1], acc[v][k + 2], acc[v][k + 3]);
      }
    }
  }
}

// --- generic (scalar, two passes) ---------------------------------------------------------

template <typename T, typename G, bool kAdd>
__global__ void __launch_bounds__(kGenericThreads)
RmsNormFwdGenericKernel(const T* x, const T* residual, const G* gamma, T* out, T* new_residual,
                        float* rsigma, int64_t rows, int64_t cols, float eps,
                        bool zero_centered) {
  const int64_t row = blockIdx.x;
  const int64_t base = row * cols;
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    float value = ToF(x[base + j]);
    if constexpr (kAdd) {
      const T stored = FromF<T>(value + ToF(residual[base + j]));
      new_residual[base + j] = stored;
      value = ToF(stored);
    }
    sum += value * value;
  }
  sum = RowSum(sum, blockDim.x);
  const float rs = RmsNormRsigma(sum, cols, eps);
  if (threadIdx.x == 0) rsigma[row] = rs;
  const T* source = kAdd ? new_residual : x;  // this thread wrote its own elements above
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float scale = RmsNormScale(ToF(gamma[j]), zero_centered);
    out[base + j] = FromF<T>(RmsNormApply(ToF(source[base + j]), rs, scale));
  }
}

template <typename T, typename G, bool kAdd>
__global__ void __launch_bounds__(kGenericThreads)
RmsNormBwdGenericKernel(const T* dy, const T* dz, const T* s, const G* gamma,
                        const float* rsigma, T* dx, float* partials, int64_t rows,
                        int64_t cols, bool zero_centered) {
  float* partial = partials + static_cast<int64_t>(blockIdx.x) * cols;  // this slot's row
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) partial[j] = 0.0f;
  const float inv_cols = 1.0f / static_cast<float>(cols);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * cols;
    const float rs = rsigma[row];
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      const float gy = ToF(dy[base + j]);
      const float xhat = ToF(s[base + j]) * rs;
      dot += gy * RmsNormScale(ToF(gamma[j]), zero_centered) * xhat;
      partial[j] += gy * xhat;  // only this thread touches column j of this slot
    }
    const float m = RowSum(dot, blockDim.x) * inv_cols;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      const float scale = RmsNormScale(ToF(gamma[j]), zero_centered);
      float value = RmsNormInputGrad(ToF(dy[base + j]), ToF(s[base + j]), rs, scale, m);
      if constexpr (kAdd) value += ToF(dz[base + j]);
      dx[base + j] = FromF<T>(value);
    }
  }
}

// dgamma[j] = sum over the first `count` partial rows, in a fixed order.
constexpr int kReduceCols = 32, kReduceRows = 16;

template <typename G>
__global__ void __launch_bounds__(kReduceCols * kReduceRows)
DgammaReduceKernel(const float* __restrict__ partials, int64_t count, int64_t cols,
                   G* __restrict__ dgamma) {
  __shared__ float sums[kReduceRows][kReduceCols + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kReduceCols + threadIdx.x;
  float acc = 0.0f;
  if (col < cols) {
    for (int64_t p = threadIdx.y; p < count; p += kReduceRows) acc += partials[p * cols + col];
  }
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < kReduceRows; ++i) total += sums[i][threadIdx.x];
    dgamma[col] = FromF<G>(total);
  }
}

// --- launch configuration -----------------------------------------------------------------

struct Config {
  int vecs = 0;  // 16-byte vectors per thread: 1, 2, 4 or 8
  int tpr = 0;   // threads per row
  int rpb = 0;   // rows per block
};

// The register-resident configuration for rows of `cols` elements, or false when the
// generic kernel must run: the fewest vectors per thread (2, 4, 8) whose row fits in
// ThreadsPerRowTarget() threads (8 vectors: whatever it takes), within max_threads(vecs).
bool ChooseConfig(int64_t cols, int elems, int (*max_threads)(int), Config* config) {
  if (cols % elems != 0) return false;
  const int64_t vectors = cols / elems;
  const int target = ThreadsPerRowTarget();
  for (int vecs : {2, 4, 8}) {
    const int64_t needed = (vectors + vecs - 1) / vecs;
    if (needed > target && vecs < 8) continue;
    int64_t tpr = 1;
    if (needed <= 32) {
      while (tpr < needed) tpr *= 2;
    } else {
      tpr = (needed + 31) / 32 * 32;
    }
    if (tpr > max_threads(vecs)) {
      if (vecs < 8) continue;
      return false;
    }
    config->vecs = vecs;
    config->tpr = static_cast<int>(tpr);
    config->rpb = std::max(1, kBlockThreads / config->tpr);
    return true;
  }
  return false;
}

bool Aligned16(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0;
}

ffi::Error LaunchError(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) return ffi::Error::Success();
  return Internal(what, " launch failed: ", cudaGetErrorString(status));
}

struct FwdArgs {
  const void* x;
  const void* residual;  // null: plain RMSNorm
  const void* gamma;
  void* out;
  void* new_residual;
  float* rsigma;
  int64_t rows, cols;
  float eps;
  bool zero_centered;
};

template <typename T, typename G, bool kAdd>
ffi::Error LaunchFwd(cudaStream_t stream, const FwdArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* r = static_cast<const T*>(a.residual);
  const G* g = static_cast<const G*>(a.gamma);
  T* out = static_cast<T*>(a.out);
  T* nr = static_cast<T*>(a.new_residual);
  Config c;
  const bool aligned = Aligned16(a.x) && Aligned16(a.gamma) && Aligned16(a.out) &&
                       (!kAdd || (Aligned16(a.residual) && Aligned16(a.new_residual)));
  constexpr int kElems = Pack<T>::kElems;
  const int stages = StagesFor(a.cols * static_cast<int64_t>(sizeof(T)), kAdd ? 2 : 1);
  if (aligned && StagedEnabled() && a.cols % kElems == 0 && a.cols / kElems >= kStagedMinVectors &&
      stages > 0) {
    const auto kernel = &RmsNormStagedFwdKernel<T, G, kAdd>;
    const int threads = StagedThreads(a.cols / kElems);
    const int shared_bytes = StagedSharedBytes(stages, kAdd ? 2 : 1, a.cols * sizeof(T));
    gpu::AllowStagedSharedMemory(reinterpret_cast<const void*>(kernel), shared_bytes);
    const int64_t blocks = std::min(
        a.rows, gpu::ResidentBlocks(reinterpret_cast<const void*>(kernel), threads, shared_bytes));
    kernel<<<blocks, threads, shared_bytes, stream>>>(x, r, g, out, nr, a.rsigma, a.rows, a.cols,
                                                      a.eps, a.zero_centered, stages);
  } else if (aligned && ChooseConfig(a.cols, Pack<T>::kElems, &FwdMaxThreads, &c)) {
    const dim3 block(c.tpr, c.rpb);
    const int64_t wanted = (a.rows + c.rpb - 1) / c.rpb;
    switch (c.vecs) {
#define JAXFUSE_CASE(V)                                                                    \
  case V: {                                                                                \
    const auto kernel = &RmsNormFwdKernel<T, G, V, kAdd>;                                  \
    const int64_t blocks =                                                                 \
        GridBlocks(reinterpret_cast<const void*>(kernel), c.tpr * c.rpb, wanted);          \
    kernel<<<blocks, block, 0, stream>>>(x, r, g, out, nr, a.rsigma, a.rows, a.cols,       \
                                         a.eps, a.zero_centered);                          \
    break;                                                                                 \
  }
      JAXFUSE_CASE(2) JAXFUSE_CASE(4) JAXFUSE_CASE(8)
#undef JAXFUSE_CASE
    }
  } else {
    RmsNormFwdGenericKernel<T, G, kAdd><<<a.rows, kGenericThreads, 0, stream>>>(
        x, r, g, out, nr, a.rsigma, a.rows, a.cols, a.eps, a.zero_centered);
  }
  return LaunchError("rms_norm forward");
}

struct BwdArgs {
  const void* dy;
  const void* dz;  // null: plain RMSNorm
  const void* s;
  const void* gamma;
  const float* rsigma;
  void* dx;
  void* dgamma;
  float* partials;
  int64_t max_slots;  // rows of the partials scratch
  int64_t rows, cols;
  bool zero_centered;
};

template <typename T, typename G, bool kAdd>
ffi::Error LaunchBwd(cudaStream_t stream, const BwdArgs& a) {
  const T* dy = static_cast<const T*>(a.dy);
  const T* dz = static_cast<const T*>(a.dz);
  const T* s = static_cast<const T*>(a.s);
  const G* g = static_cast<const G*>(a.gamma);
  T* dx = static_cast<T*>(a.dx);
  int64_t slots_used = 0;
  if (a.rows > 0) {
    Config c;
    const bool aligned = Aligned16(a.dy) && Aligned16(a.s) && Aligned16(a.gamma) &&
                         Aligned16(a.dx) && Aligned16(a.partials) &&
                         (!kAdd || Aligned16(a.dz));
    constexpr int kElems = Pack<T>::kElems;
    const int64_t vectors = a.cols / kElems;
    const int threads = StagedThreads(vectors);
    const int64_t vecs_per_thread = (vectors + threads - 1) / threads;
    const int stages = StagesFor(a.cols * static_cast<int64_t>(sizeof(T)), kAdd ? 3 : 2);
    if (aligned && StagedEnabled() && a.cols % kElems == 0 && vectors >= kStagedMinVectors &&
        vecs_per_thread <= 8 && stages > 0) {
      const int shared_bytes = StagedSharedBytes(stages, kAdd ? 3 : 2, a.cols * sizeof(T));
      switch (vecs_per_thread <= 1 ? 1 : vecs_per_thread <= 2 ? 2 : vecs_per_thread <= 4 ? 4 : 8) {
#define JAXFUSE_CASE(V)                                                                    \
  case V: {                                                                                \
    const auto kernel = HoldScalesInBwd(V) ? &RmsNormStagedBwdKernel<T, G, V, kAdd, true>    \
                                          : &RmsNormStagedBwdKernel<T, G, V, kAdd, false>;   \
    const void* key = reinterpret_cast<const void*>(kernel);                               \
    gpu::AllowStagedSharedMemory(key, shared_bytes);                                       \
    const int64_t blocks = std::min({a.rows, a.max_slots,                                  \
                                     gpu::ResidentBlocks(key, threads, shared_bytes)});    \
    slots_used = blocks;                                                                   \
    kernel<<<blocks, threads, shared_bytes, stream>>>(dy, dz, s, g, a.rsigma, dx,          \
                                                      a.partials, a.rows, a.cols,          \
                                                      a.zero_centered, stages);            \
    break;                                                                                 \
  }
        JAXFUSE_CASE(1) JAXFUSE_CASE(2) JAXFUSE_CASE(4) JAXFUSE_CASE(8)
#undef JAXFUSE_CASE
      }
    } else if (aligned && ChooseConfig(a.cols, Pack<T>::kElems, &BwdMaxThreads, &c)) {
      const dim3 block(c.tpr, c.rpb);
      // No more slots than the dgamma scratch has rows.
      const int64_t wanted = std::min((a.rows + c.rpb - 1) / c.rpb, a.max_slots / c.rpb);
      switch (c.vecs) {
#define JAXFUSE_CASE(V)                                                                    \
  case V: {                                                                                \
    const auto kernel = &RmsNormBwdKernel<T, G, V, kAdd>;                                  \
    const int64_t blocks =                                                                 \
        GridBlocks(reinterpret_cast<const void*>(kernel), c.tpr * c.rpb, wanted);          \
    slots_used = std::min(blocks * c.rpb, a.max_slots);                                    \
    kernel<<<blocks, block, 0, stream>>>(dy, dz, s, g, a.rsigma, dx, a.partials,           \
                                         slots_used, a.rows, a.cols, a.zero_centered);     \
    break;                                                                                 \
  }
        JAXFUSE_CASE(2) JAXFUSE_CASE(4) JAXFUSE_CASE(8)
#undef JAXFUSE_CASE
      }
    } else {
      const int64_t blocks = std::min(a.rows, a.max_slots);
      slots_used = blocks;
      RmsNormBwdGenericKernel<T, G, kAdd><<<blocks, kGenericThreads, 0, stream>>>(
          dy, dz, s, g, a.rsigma, dx, a.partials, a.rows, a.cols, a.zero_centered);
    }
    if (auto error = LaunchError("rms_norm backward"); error.failure()) return error;
  }
  const dim3 block(kReduceCols, kReduceRows);
  const int64_t blocks = (a.cols + kReduceCols - 1) / kReduceCols;
  DgammaReduceKernel<G><<<blocks, block, 0, stream>>>(a.partials, slots_used, a.cols,
                                                      static_cast<G*>(a.dgamma));
  return LaunchError("rms_norm dgamma reduction");
}

// Calls F<T, G>::Run(args...) for the problem's dtypes.
template <template <typename, typename> class F, typename... Args>
ffi::Error Dispatch(const RmsNormProblem& p, Args&&... args) {
  const bool g32 = p.gamma_type == ffi::DataType::F32;
  switch (p.x_type) {
    case ffi::DataType::F32: return F<float, float>::Run(args...);
    case ffi::DataType::BF16:
      return g32 ? F<__nv_bfloat16, float>::Run(args...)
                 : F<__nv_bfloat16, __nv_bfloat16>::Run(args...);
    case ffi::DataType::F16:
      return g32 ? F<__half, float>::Run(args...) : F<__half, __half>::Run(args...);
    default: return InvalidArgument("rms_norm: unsupported dtype");
  }
}

template <typename T, typename G>
struct FwdRunner {
  static ffi::Error Run(cudaStream_t stream, const FwdArgs& a) {
    return a.residual ? LaunchFwd<T, G, true>(stream, a) : LaunchFwd<T, G, false>(stream, a);
  }
};

template <typename T, typename G>
struct BwdRunner {
  static ffi::Error Run(cudaStream_t stream, const BwdArgs& a) {
    return a.dz ? LaunchBwd<T, G, true>(stream, a) : LaunchBwd<T, G, false>(stream, a);
  }
};

ffi::Error Forward(cudaStream_t stream, ffi::AnyBuffer x, const ffi::AnyBuffer* residual,
                   ffi::AnyBuffer gamma, ffi::AnyBuffer* out, ffi::AnyBuffer* new_residual,
                   ffi::AnyBuffer* rsigma, float eps, bool zero_centered) {
  RmsNormProblem p;
  ffi::Error error = residual != nullptr
      ? ParseRmsNormProblem(x, gamma, *rsigma, {residual, out, new_residual}, &p)
      : ParseRmsNormProblem(x, gamma, *rsigma, {out}, &p);
  if (error.failure()) return error;
  if (p.rows == 0) return ffi::Error::Success();
  if (p.cols > static_cast<int64_t>(INT32_MAX) || p.rows > static_cast<int64_t>(INT32_MAX)) {
    return InvalidArgument("rms_norm: rows and H must each be < 2^31");
  }
  FwdArgs a{x.untyped_data(),
            residual ? residual->untyped_data() : nullptr,
            gamma.untyped_data(),
            out->untyped_data(),
            new_residual ? new_residual->untyped_data() : nullptr,
            static_cast<float*>(rsigma->untyped_data()),
            p.rows, p.cols, eps, zero_centered};
  return Dispatch<FwdRunner>(p, stream, a);
}

ffi::Error Backward(cudaStream_t stream, ffi::AnyBuffer dy, const ffi::AnyBuffer* dz,
                    ffi::AnyBuffer s, ffi::AnyBuffer gamma, ffi::AnyBuffer rsigma,
                    ffi::AnyBuffer* dx, ffi::AnyBuffer* dgamma, ffi::AnyBuffer* workspace,
                    bool zero_centered) {
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
  const auto w_dims = workspace->dimensions();
  if (workspace->element_type() != ffi::DataType::F32 || w_dims.size() != 2 ||
      w_dims[1] != p.cols || w_dims[0] < 1) {
    return InvalidArgument("rms_norm backward: the scratch must be float32 [slots, ",
                           p.cols, "], got ", ShapeString(w_dims));
  }
  if (p.cols > static_cast<int64_t>(INT32_MAX) || p.rows > static_cast<int64_t>(INT32_MAX)) {
    return InvalidArgument("rms_norm: rows and H must each be < 2^31");
  }
  BwdArgs a{dy.untyped_data(),
            dz ? dz->untyped_data() : nullptr,
            s.untyped_data(),
            gamma.untyped_data(),
            static_cast<const float*>(rsigma.untyped_data()),
            dx->untyped_data(),
            dgamma->untyped_data(),
            static_cast<float*>(workspace->untyped_data()),
            w_dims[0], p.rows, p.cols, zero_centered};
  return Dispatch<BwdRunner>(p, stream, a);
}

ffi::Error RmsNormFwdCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> rsigma, float eps,
                              bool zero_centered_gamma) {
  return Forward(stream, x, nullptr, gamma, &*out, nullptr, &*rsigma, eps,
                 zero_centered_gamma);
}

ffi::Error AddRmsNormFwdCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                                 ffi::AnyBuffer gamma, ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::AnyBuffer> new_residual,
                                 ffi::Result<ffi::AnyBuffer> rsigma, float eps,
                                 bool zero_centered_gamma) {
  return Forward(stream, x, &residual, gamma, &*out, &*new_residual, &*rsigma, eps,
                 zero_centered_gamma);
}

ffi::Error RmsNormBwdCudaImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer s,
                              ffi::AnyBuffer gamma, ffi::AnyBuffer rsigma,
                              ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                              ffi::Result<ffi::AnyBuffer> workspace, bool zero_centered_gamma) {
  return Backward(stream, dy, nullptr, s, gamma, rsigma, &*dx, &*dgamma, &*workspace,
                  zero_centered_gamma);
}

ffi::Error AddRmsNormBwdCudaImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer dz,
                                 ffi::AnyBuffer s, ffi::AnyBuffer gamma, ffi::AnyBuffer rsigma,
                                 ffi::Result<ffi::AnyBuffer> dx,
                                 ffi::Result<ffi::AnyBuffer> dgamma,
                                 ffi::Result<ffi::AnyBuffer> workspace,
                                 bool zero_centered_gamma) {
  return Backward(stream, dy, &dz, s, gamma, rsigma, &*dx, &*dgamma, &*workspace,
                  zero_centered_gamma);
}

}  // namespace
}  // namespace jaxfuse

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseRmsNormFwdCuda, jaxfuse::RmsNormFwdCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [..., H]
                                  .Arg<ffi::AnyBuffer>()  // gamma [H]
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // rsigma [...], float32
                                  .Attr<float>("eps")
                                  .Attr<bool>("zero_centered_gamma"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseAddRmsNormFwdCuda, jaxfuse::AddRmsNormFwdCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [..., H]
                                  .Arg<ffi::AnyBuffer>()  // residual, aliased to new_residual
                                  .Arg<ffi::AnyBuffer>()  // gamma [H]
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // new_residual
                                  .Ret<ffi::AnyBuffer>()  // rsigma
                                  .Attr<float>("eps")
                                  .Attr<bool>("zero_centered_gamma"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseRmsNormBwdCuda, jaxfuse::RmsNormBwdCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // x (normalized input)
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // rsigma
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>()  // workspace: float32 [slots, H]
                                  .Attr<bool>("zero_centered_gamma"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseAddRmsNormBwdCuda, jaxfuse::AddRmsNormBwdCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // dz (gradient of new_residual)
                                  .Arg<ffi::AnyBuffer>()  // s = new_residual
                                  .Arg<ffi::AnyBuffer>()  // gamma
                                  .Arg<ffi::AnyBuffer>()  // rsigma
                                  .Ret<ffi::AnyBuffer>()  // ds (= dx = dresidual)
                                  .Ret<ffi::AnyBuffer>()  // dgamma
                                  .Ret<ffi::AnyBuffer>()  // workspace: float32 [slots, H]
                                  .Attr<bool>("zero_centered_gamma"),
                              {ffi::Traits::kCmdBufferCompatible});
