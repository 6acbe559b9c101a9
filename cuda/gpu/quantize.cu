// CUDA handlers for FP8 quantization and its fusion with the scaled activations.
//
// Current scaling (per group / per tensor), in one launch chain with no host sync:
//   1. cudaMemsetAsync(amax, 0)
//   2. RowKernel<kAmax>: per row, the block's amax of the values (activation recomputed
//      from x, never written), atomicMax on the float bits into amax[group of row]
//      (groups located by a binary search over the device offsets; rows past the last
//      offset belong to no group); the fused backward also writes dscales (and dx when
//      asked) in this pass. Plain quantize of an aligned tensor runs GroupAmaxKernel
//      instead (whole runs of a group's rows per block), and the activations' aligned
//      16-bit passes RunAmaxKernel (a contiguous run of rows per warp)
//   3. RowKernel<kCurrent>: block 0 writes scale_inv[g] = 1 / (fp8_max / amax[g]); every
//      row recomputes its values and writes FP8 with its group's scale; rows past the last
//      offset are written as zeros.
// Block scaling (1 x 128) and MXFP8 (1 x 32, E8M0): one pass, RowKernel<kBlock> (amax of a
// block by warp shuffles across the block/8 lanes that hold it).
// 2-D block scaling (weights, 128 x 128): one CUDA block per tile, two reads of the tile
// (the second from L1/L2).
// Transposed quantization (the grouped GEMM's FP8 weights, [B, R, C] -> [B, C, R] and
// optionally [B, R, C] too): per-batch scales from given amaxes (quantize_transposed) or
// one scale per 128 x 128 tile (quantize_blocks_transposed), both from one read of x; and
// per-batch current scaling amax included (quantize_batches_transposed), from one read of x
// where a batch's tiles fit in a team of blocks' shared memory (QuantizeBatchesOnePassKernel,
// a cooperative launch), else the amax kernel and quantize_transposed's.
#include <cuda/atomic>
#include <cuda_pipeline_primitives.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "jaxfuse/ffi_common.h"
#include "jaxfuse/fp8.h"
#include "jaxfuse/group_amax_plan.h"
#include "jaxfuse/one_pass_plan.h"
#include "jaxfuse/quantize.h"
#include "jaxfuse/scaled_activation.h"
#include "rowwise.cuh"

namespace jaxfuse {
namespace {

using gpu::PointerAligned16;
using gpu::SinkArgs;
using gpu::SinkKind;

// scale_inv[g] = 1 / scale(amax[g]) after the amax pass (current scaling).
__global__ void CurrentScaleInvKernel(const float* amax, float* scale_inv, int64_t groups,
                                      Fp8Format format) {
  for (int64_t g = blockIdx.x * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    scale_inv[g] = 1.0f / ScaleFromAmax(amax[g], Fp8Max(format));
  }
}

bool ValidLaneBlock(int64_t block) {
  return block >= 8 && block <= 256 && (block & (block - 1)) == 0;
}

// --- the per-group amax of a plain tensor (pass 1 of current scaling for quantize) ------

// A block's share of rows for GroupAmaxKernel: GroupAmaxRowsPerBlock (8-64 KB of input,
// jaxfuse/group_amax_plan.h).
constexpr int kGroupAmaxThreads = 256;
constexpr int kGroupAmaxLoads = 4;  // 8-element units in flight per thread

// amax[g] = max |x| over the rows of group g (GroupOfRow; rows of no group are skipped),
// for x [rows, cols] with cols % 8 == 0 and x 16-byte aligned. Each block takes
// rows_per_block consecutive rows. When they all lie in one group (GroupOfRow is
// non-decreasing in the row, so the first and last row decide), the block streams them as
// one flat run with kGroupAmaxLoads 16-byte loads in flight per thread, reduces once and
// issues one atomic; a block across a group boundary falls back to a warp per row. The
// RowKernel<kAmax> pass this replaces reduces every 4 KB row over its block: on the grouped
// MLP's 2048-wide rows it read at 2.3 TB/s, 48% of DRAM (Nsight Compute, logs/
// ncu_activations_mlp_*_s22call2.log under benchmarks/results/).
template <typename T>
__global__ void __launch_bounds__(kGroupAmaxThreads)
GroupAmaxKernel(const T* __restrict__ x, const int32_t* __restrict__ offsets, int64_t num_groups,
                int64_t rows, int64_t cols, int64_t rows_per_block, float* __restrict__ amax) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t last = min(rows, first + rows_per_block) - 1;
  if (first > last) return;
  const int64_t group = GroupOfRow(offsets, num_groups, first, rows);
  if (group == GroupOfRow(offsets, num_groups, last, rows)) {
    if (group >= num_groups) return;  // rows past the last offset: no group
    const T* begin = x + first * cols;
    const int64_t units = (last + 1 - first) * cols / gpu::kUnit;
    float local = 0.0f;
    for (int64_t base = threadIdx.x; base < units; base += kGroupAmaxThreads * kGroupAmaxLoads) {
      float v[kGroupAmaxLoads][8];
#pragma unroll
      for (int i = 0; i < kGroupAmaxLoads; ++i) {  // every load issued before any max
        const int64_t u = base + i * kGroupAmaxThreads;
        gpu::Load8(begin + u * gpu::kUnit, true, u < units ? 8 : 0, v[i]);
      }
#pragma unroll
      for (int i = 0; i < kGroupAmaxLoads; ++i)
#pragma unroll
        for (int e = 0; e < 8; ++e) local = gpu::MaxAbs(local, v[i][e]);
    }
    const float reduced = gpu::BlockReduceMaxSum(local, 0.0f).x;
    if (threadIdx.x == 0) gpu::AtomicMaxNonNegative(amax + group, reduced);
    return;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t units = cols / gpu::kUnit;
  for (int64_t row = first + warp; row <= last; row += kGroupAmaxThreads / 32) {
    float local = 0.0f;
    for (int64_t u = lane; u < units; u += 32) {
      float v[8];
      gpu::Load8(x + row * cols + u * gpu::kUnit, true, 8, v);
#pragma unroll
      for (int e = 0; e < 8; ++e) local = gpu::MaxAbs(local, v[e]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, offset));
    }
    const int64_t g = GroupOfRow(offsets, num_groups, row, rows);
    if (lane == 0 && g < num_groups) gpu::AtomicMaxNonNegative(amax + g, local);
  }
}

// --- the per-batch amax of a plain tensor (pass 1 of per-tensor current scaling) --------

constexpr int kBatchAmaxThreads = 256;
constexpr int kBatchAmaxLoads = 8;  // 16-byte loads per thread and round

// Running max |v| of the 8 elements in `raw` (16 bytes of x). 16-bit types stay packed:
// HMNMX2 takes two elements per instruction and returns the other operand for a NaN (so a
// NaN counts as 0, as in every quantize kernel); the max of bf16/f16 values is exact.
__device__ __forceinline__ void AccumulateAbsMax(const uint4& raw, __nv_bfloat162 (&acc)[4]) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] = __hmax2(acc[i], __habs2(pairs[i]));
}
__device__ __forceinline__ void AccumulateAbsMax(const uint4& raw, __half2 (&acc)[4]) {
  const __half2* pairs = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] = __hmax2(acc[i], __habs2(pairs[i]));
}
__device__ __forceinline__ void AccumulateAbsMax(const uint4& raw, float (&acc)[4]) {
  const float* values = reinterpret_cast<const float*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] = gpu::MaxAbs(acc[i], values[i]);  // fmaxf drops NaN
}
__device__ __forceinline__ float Widen(__nv_bfloat162 v) {
  return fmaxf(__low2float(v), __high2float(v));
}
__device__ __forceinline__ float Widen(__half2 v) { return fmaxf(__low2float(v), __high2float(v)); }
__device__ __forceinline__ float Widen(float v) { return v; }
__device__ __forceinline__ void Zero(__nv_bfloat162& v) { v = __float2bfloat162_rn(0.0f); }
__device__ __forceinline__ void Zero(__half2& v) { v = __float2half2_rn(0.0f); }
__device__ __forceinline__ void Zero(float& v) { v = 0.0f; }

// The packed accumulator of AccumulateAbsMax for elements of type T.
template <typename T>
using AbsMaxLane =
    std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162,
                       std::conditional_t<std::is_same_v<T, __half>, __half2, float>>;

// amax[b] = max |x[b]| over batch b's `elements` elements (amax zeroed before the launch).
// A round is kBatchAmaxLoads raw 16-byte loads per thread; blocks (blockIdx.x) stride
// over a batch's rounds, batches go by blockIdx.y (strided past 65535). The max of 16-bit
// values stays packed (AccumulateAbsMax). `vector`: every batch starts 16-byte aligned;
// the elements after the last whole unit (and every element when not `vector`) are read
// one by one. One atomicMax per block and batch. Unlike GroupAmaxKernel it needs no
// offsets array: the batches are equal runs of R * C elements.
template <typename T>
__global__ void __launch_bounds__(kBatchAmaxThreads)
BatchAmaxKernel(const T* __restrict__ x, int64_t batch, int64_t elements, bool vector,
                float* __restrict__ amax) {
  constexpr int kPerUnit = 16 / static_cast<int>(sizeof(T));
  const int64_t threads = static_cast<int64_t>(gridDim.x) * kBatchAmaxThreads;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * kBatchAmaxThreads + threadIdx.x;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    const T* begin = x + b * elements;
    AbsMaxLane<T> lanes[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) Zero(lanes[i]);
    const int64_t units = vector ? elements / kPerUnit : 0;
    const uint4* raw_units = reinterpret_cast<const uint4*>(begin);
    int64_t base = static_cast<int64_t>(blockIdx.x) * kBatchAmaxThreads * kBatchAmaxLoads +
                   threadIdx.x;
    // Whole rounds without bounds checks, so that the compiler keeps loads in flight ahead
    // of the maxes (SASS: four 16-byte loads per thread; with a check per load it kept
    // two); then one checked round.
    for (; base + (kBatchAmaxLoads - 1) * kBatchAmaxThreads < units;
         base += threads * kBatchAmaxLoads) {
      uint4 raw[kBatchAmaxLoads];
#pragma unroll
      for (int i = 0; i < kBatchAmaxLoads; ++i) {
        raw[i] = __ldg(raw_units + base + i * kBatchAmaxThreads);
      }
#pragma unroll
      for (int i = 0; i < kBatchAmaxLoads; ++i) AccumulateAbsMax(raw[i], lanes);
    }
    if (base < units) {
#pragma unroll
      for (int i = 0; i < kBatchAmaxLoads; ++i) {
        const int64_t u = base + i * kBatchAmaxThreads;
        if (u < units) AccumulateAbsMax(__ldg(raw_units + u), lanes);
      }
    }
    float local = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) local = fmaxf(local, Widen(lanes[i]));
    for (int64_t i = units * kPerUnit + thread; i < elements; i += threads) {
      local = gpu::MaxAbs(local, gpu::LoadOne(begin + i));
    }
    const float reduced = gpu::BlockReduceMaxSum(local, 0.0f).x;
    if (threadIdx.x == 0 && reduced > 0.0f) gpu::AtomicMaxNonNegative(amax + b, reduced);
  }
}

// --- the per-group amax of an activation's values (pass 1 of current scaling) ------------

constexpr int kRunAmaxThreads = 256;
constexpr int kRunAmaxWarps = kRunAmaxThreads / 32;

// RunAmaxKernel's resident blocks asked of the register allocator: 64 registers hold the
// gradient's batches (2 units x 3 streams) without spilling, the activation's (4 x 2)
// spill at 64 and fit in 80.
template <class P>
constexpr int RunAmaxMinBlocks() {
  return P::kRawStreams == 3 ? 4 : 3;
}

// amax[g] = max |v| over the values that producer P (16-bit inputs with a register form,
// ComputeRaw; rows 16-byte aligned, p.vector) computes for the rows of group g, and
// side[row] (dscales) when s.side is set; nothing else is written. Each warp takes a
// contiguous run of rows_per_warp rows, one row at a time: its lanes take units lane,
// lane + 32, ... in batches of 8 / kRawStreams units whose 16-byte loads are all issued
// before any math (about eight loads in flight per lane, as QuantizeColumnwiseKernel). A
// lane's running max carries over the run's rows while their group stays the same and is
// reduced over the warp, with one atomic, only when it changes; side is reduced per row by
// warp shuffles (a fixed order: the same sums every run). RowKernel<kAmax>, which it
// replaces, walks a row per block and reduces each row over the block: on the FP8 grouped
// MLP (T=65536, F=2048) its activation pass read at 3.34 TB/s and the gradient's at 3.25,
// this kernel's at 4.13 and 3.94 (H200, profile_kernels_s26{rowamax,runamax}_2026-12-02_
// a0727081.json: 161 -> 130 and 248 -> 205 us).
template <class P, typename T>
__global__ void __launch_bounds__(kRunAmaxThreads, RunAmaxMinBlocks<P>())
RunAmaxKernel(P p, SinkArgs<T> s, int64_t rows_per_warp) {
  constexpr int kBatch = 8 / P::kRawStreams;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kRunAmaxWarps + threadIdx.x / 32;
  const int64_t first = warp * rows_per_warp;
  const int64_t end = min(s.rows, first + rows_per_warp);
  const int64_t units = p.Units();
  const int streams = p.Streams();
  int64_t group = s.num_groups;  // the group of the running max (num_groups: none yet)
  float local = 0.0f;
  // Publishes the running max of `group` (warp-uniform: every lane calls it).
  auto flush = [&] {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, offset));
    }
    if (lane == 0 && group < s.num_groups) gpu::AtomicMaxNonNegative(s.amax + group, local);
    local = 0.0f;
  };
  for (int64_t row = first; row < end; ++row) {
    const int64_t g = GroupOfRow(s.offsets, s.num_groups, row, s.rows);
    if (g != group) {
      flush();
      group = g;
    }
    // A row of no group only contributes its dscales.
    if (g >= s.num_groups && s.side == nullptr) continue;
    const float scale = p.RowScale(row);
    float side = 0.0f;
    for (int64_t base = lane; base < units; base += 32 * kBatch) {
      uint4 raw[kBatch][P::kRawStreams];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int64_t u = base + j * 32;
#pragma unroll
        for (int stream = 0; stream < P::kRawStreams; ++stream) {
          raw[j][stream] = u < units && stream < streams
                               ? __ldg(reinterpret_cast<const uint4*>(
                                     p.Segment(stream, row, u * gpu::kUnit)))
                               : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (base + j * 32 >= units) break;
        float v[P::kChunks][8];
        p.ComputeRaw(raw[j], scale, v, side);
#pragma unroll
        for (int c = 0; c < P::kChunks; ++c)
#pragma unroll
          for (int e = 0; e < 8; ++e) local = gpu::MaxAbs(local, v[c][e]);
      }
    }
    if (s.side != nullptr) {
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        side += __shfl_xor_sync(0xffffffffu, side, offset);
      }
      if (lane == 0) s.side[row] = side;
    }
  }
  flush();
}

// JAXFUSE_RUN_AMAX=0 runs RowKernel<kAmax> where RunAmaxKernel would (a benchmark knob:
// the same amaxes; dscales summed in another order). Read once.
inline bool RunAmaxEnabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("JAXFUSE_RUN_AMAX");
    return value == nullptr || value[0] != '0';
  }();
  return enabled;
}

// JAXFUSE_GROUP_AMAX_ROWS=N gives every GroupAmaxKernel block N rows instead of
// GroupAmaxRowsPerBlock's share (a benchmark knob: the same amaxes). Read once; 0 when unset.
inline int64_t GroupAmaxRowsOverride() {
  static const int64_t rows = gpu::EnvInt("JAXFUSE_GROUP_AMAX_ROWS", 0);
  return rows;
}

// Launches RunAmaxKernel as one wave of resident blocks (every warp's run the same length,
// so none idles at the end), or fewer blocks when rows run out. False when the problem is
// not its kind (then the caller runs RowKernel<kAmax>): fewer than 32 units per row would
// idle lanes, and a pass that also writes dx belongs to RowKernel's sinks.
template <class P, typename T>
bool LaunchRunAmax(const P& p, const SinkArgs<T>& s, int64_t units, cudaStream_t stream) {
  if constexpr (P::kStaged && sizeof(T) == 2) {
    if (!RunAmaxEnabled() || !p.vector || s.out != nullptr || units < 32 || s.rows <= 0) {
      return false;
    }
    const void* kernel = reinterpret_cast<const void*>(&RunAmaxKernel<P, T>);
    const int64_t resident = gpu::ResidentBlocks(kernel, kRunAmaxThreads);
    const int64_t blocks = std::min(resident, CeilDiv(s.rows, int64_t{kRunAmaxWarps}));
    const int64_t rows_per_warp = CeilDiv(s.rows, blocks * kRunAmaxWarps);
    const int64_t grid = CeilDiv(CeilDiv(s.rows, rows_per_warp), int64_t{kRunAmaxWarps});
    RunAmaxKernel<P, T><<<static_cast<unsigned>(grid), kRunAmaxThreads, 0, stream>>>(
        p, s, rows_per_warp);
    return true;
  } else {
    return false;
  }
}

// Pass 1 of current scaling for producer p: GroupAmaxKernel where p reads a plain aligned
// tensor and nothing else is written in the pass, RunAmaxKernel for the activations' 16-bit
// aligned producers, else RowKernel<kAmax>.
template <class P, typename T>
void LaunchAmaxPass(const P& p, const SinkArgs<T>& s, int64_t units, cudaStream_t stream) {
  if constexpr (std::is_same_v<P, gpu::LoadProducer<T>>) {
    if (p.vector && s.out == nullptr && s.side == nullptr && s.cols > 0) {
      const int64_t resident = gpu::ResidentBlocks(
          reinterpret_cast<const void*>(&GroupAmaxKernel<T>), kGroupAmaxThreads);
      const int64_t rows_per_block = GroupAmaxRowsPerBlock(
          s.rows, s.cols * static_cast<int64_t>(sizeof(T)), resident, GroupAmaxRowsOverride());
      const int64_t blocks = CeilDiv(s.rows, rows_per_block);
      if (blocks <= (int64_t{1} << 31) - 1) {
        GroupAmaxKernel<T><<<static_cast<unsigned>(blocks), kGroupAmaxThreads, 0, stream>>>(
            p.x, s.offsets, s.num_groups, s.rows, s.cols, rows_per_block, s.amax);
        return;
      }
    }
  } else if (LaunchRunAmax(p, s, units, stream)) {
    return;
  }
  gpu::LaunchRowKernel<P, SinkKind::kAmax, T>(p, s, units, stream);
}

// Where a current-scaling chain also writes the column-wise copy (none: out == nullptr).
struct ColumnwiseTarget {
  uint8_t* out = nullptr;
  ColumnwiseProblem copy;
};

// Pass 2 of current scaling with the column-wise copy (defined below the byte tiles).
template <class P, typename T>
ffi::Error LaunchCurrentWithColumnwise(const P& p, const SinkArgs<T>& s, int64_t units,
                                       const ColumnwiseTarget& target, cudaStream_t stream);

// Pass 2 of current scaling: scale_inv from the group amaxes in s.amax and the FP8 rows,
// with the column-wise copy when `target` names one.
template <class P, typename T>
ffi::Error LaunchCurrentPass(const P& p, const SinkArgs<T>& s, int64_t units,
                             const ColumnwiseTarget& target, cudaStream_t stream) {
  if (target.out != nullptr) return LaunchCurrentWithColumnwise(p, s, units, target, stream);
  if (s.rows > 0) {
    gpu::LaunchRowKernel<P, SinkKind::kCurrent, T>(p, s, units, stream);
  } else if (s.num_groups > 0) {  // no rows: the scales of the zero amaxes only
    CurrentScaleInvKernel<<<1, 256, 0, stream>>>(s.amax, static_cast<float*>(s.scale_inv),
                                                 s.num_groups, s.format);
  }
  return gpu::LaunchError("current-scaling quantization kernels");
}

// Runs the quantization chain of `problem` for producer p (units per row: units), writing
// the column-wise copy of the result too when `target` names one (current scaling only).
template <class P, typename T>
ffi::Error LaunchRows(cudaStream_t stream, const P& p, SinkArgs<T> s, int64_t units,
                      const QuantizeProblem& problem, const ColumnwiseTarget& target = {}) {
  if (problem.mode == ScalingMode::kCurrent) {
    if (problem.num_groups > 0 &&
        cudaMemsetAsync(s.amax, 0, problem.num_groups * sizeof(float), stream) != cudaSuccess) {
      return Internal("zeroing the amax scratch failed");
    }
    if (s.rows > 0) LaunchAmaxPass(p, s, units, stream);
    if (auto error = gpu::LaunchError("current-scaling amax pass"); error.failure()) return error;
    SinkArgs<T> second = s;
    second.out = nullptr;   // dx (if any) and dscales were written by pass 1
    second.side = nullptr;
    return LaunchCurrentPass(p, second, units, target, stream);
  }
  if (!ValidLaneBlock(problem.block)) {
    return InvalidArgument("the CUDA kernels support block sizes 8, 16, 32, 64, 128 and 256, got ",
                           problem.block);
  }
  if (cudaMemsetAsync(s.amax, 0, sizeof(float), stream) != cudaSuccess) {
    return Internal("zeroing the amax scratch failed");
  }
  s.mx = problem.mode == ScalingMode::kMxfp8;
  s.block_shift = 0;
  while ((1 << s.block_shift) < s.block) ++s.block_shift;
  s.blocks_per_row = (s.cols + s.block - 1) / s.block;
  if (s.rows > 0) gpu::LaunchRowKernel<P, SinkKind::kBlock, T>(p, s, units, stream);
  return gpu::LaunchError("block quantization kernel");
}

template <typename T>
SinkArgs<T> MakeSink(const QuantizeProblem& problem, ffi::AnyBuffer offsets, ffi::AnyBuffer& data,
                     ffi::AnyBuffer& scale_inv, ffi::AnyBuffer& amax) {
  SinkArgs<T> s;
  s.data = static_cast<uint8_t*>(data.untyped_data());
  s.data_vector = problem.cols % 8 == 0 && PointerAligned16(s.data);
  s.scale_inv = scale_inv.untyped_data();
  s.amax = static_cast<float*>(amax.untyped_data());
  s.offsets = static_cast<const int32_t*>(offsets.untyped_data());
  s.num_groups = problem.num_groups;
  s.rows = problem.batch * problem.rows;
  s.cols = problem.cols;
  s.block = static_cast<int>(problem.block);
  s.format = problem.format;
  return s;
}

// --- transposing a 128 x 128 tile of bytes in shared memory ------------------------------
//
// The tiled kernels below (QuantizeTransposedTiledKernel, ColumnwiseKernel) stage 128
// source rows of 128 FP8 bytes in shared memory, row-major, with each row's 16-byte chunks
// XOR-swizzled by the row's block of 16 (SwizzledChunk), and write the transpose. In the
// store phase each thread takes four output rows (source bytes i0 .. i0 + 3) of one
// 16-column part (source rows part * 16 ..): one 4-byte word of each of the part's 16
// source rows holds those bytes (16 shared loads instead of 64), and byte permutes
// transpose them in registers. A warp's four quads x eight parts hit 32 different banks
// (the swizzle) and its stores cover 128 contiguous bytes of four output rows.
constexpr int kByteTile = 128;                 // source rows = bytes per source row
constexpr int kByteTileChunks = kByteTile / 16;  // 16-byte chunks per row, 16-row parts
constexpr int kByteTileThreads = 256;
static_assert(kByteTile / 4 * kByteTileChunks == kByteTileThreads, "one quad per thread");

// Where chunk `chunk` of source row `row` lives in its shared row.
__device__ __forceinline__ int SwizzledChunk(int row, int chunk) {
  return chunk ^ ((row / 16) % kByteTileChunks);
}

// This thread's part and first output row in the store phase.
__device__ __forceinline__ int ByteTilePart() { return threadIdx.x % kByteTileChunks; }
__device__ __forceinline__ int ByteTileFirstOutputRow() {
  return threadIdx.x / kByteTileChunks * 4;
}

// The words holding bytes i0 .. i0 + 3 of the part's 16 source rows.
__device__ __forceinline__ void LoadTransposeSources(const uint8_t* tile, int part, int i0,
                                                     uint32_t (&source)[16]) {
  const int word_at = SwizzledChunk(part * 16, i0 / 16) * 16 + i0 % 16;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    source[j] = *reinterpret_cast<const uint32_t*>(tile + (part * 16 + j) * kByteTile + word_at);
  }
}

// Output row i0 + r of the part: byte r of each source word, in source-row order.
__device__ __forceinline__ uint4 TransposedRow(const uint32_t (&source)[16], int r) {
  const unsigned pick = static_cast<unsigned>(r | ((r + 4) << 4));  // byte r of x, of y
  uint32_t words[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint32_t low = __byte_perm(source[4 * w], source[4 * w + 1], pick);
    const uint32_t high = __byte_perm(source[4 * w + 2], source[4 * w + 3], pick);
    words[w] = __byte_perm(low, high, 0x5410);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// --- transposed (the FP8 weights of the GEMMs): given amax, or one scale per tile --------

static_assert(kByteTile == kWeightBlock,
              "the byte tiles are quantize_blocks_transposed's scaling blocks");

// max |x| over a tile held by the block in raw 16-byte registers (zeros where the tile
// leaves x, which cannot raise it), for every thread. The packed 16-bit max is exact and
// drops NaN (AccumulateAbsMax), so this is the amax Block2DKernel finds in float. One
// barrier: the next tile's writes to warp_amax come after the two barriers that follow
// this tile's reads in the caller.
template <typename T, int kLoads>
__device__ __forceinline__ float TileAmax(const uint4 (&raw)[kLoads]) {
  __shared__ float warp_amax[kByteTileThreads / 32];
  AbsMaxLane<T> lanes[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) Zero(lanes[i]);
#pragma unroll
  for (int j = 0; j < kLoads; ++j) AccumulateAbsMax(raw[j], lanes);
  float local = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) local = fmaxf(local, Widen(lanes[i]));
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, offset));
  }
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = local;
  __syncthreads();
  float amax = warp_amax[0];
#pragma unroll
  for (int w = 1; w < kByteTileThreads / 32; ++w) amax = fmaxf(amax, warp_amax[w]);
  return amax;
}

// The tiled kernel (16-bit x): one tile of 128 rows x 128 columns of one batch entry per
// step of a grid-stride loop (needs C % 8 == 0, R % 16 == 0, x, data 16-byte and the
// untransposed copy 8-byte aligned). Loads: 16 threads cover 256 contiguous bytes of a row,
// 8 raw 16-byte loads in flight per thread (raw registers, converted one unit at a time:
// at most 64 registers, so four blocks fit on an SM). The FP8 bytes go to the untransposed
// copy (8-byte stores, 128 contiguous bytes per row) and to the shared tile as whole 8-byte
// halves of swizzled chunks, and leave transposed in 128-byte runs per output row.
// Nsight Compute on 128 x [2048, 4096] bf16 (s23): this kernel 0.737 ms, 90.3% of DRAM
// bandwidth; the general kernel below 1.22 ms, 54.5% (63 registers, 50% occupancy); this
// one holding float instead of raw registers 1.33 ms, 50.2% (123 registers, 25%).
// kTileScales (quantize_blocks_transposed): the tile is also the scaling block, so its
// scale comes from its own amax, reduced from the raw registers before the conversion
// (TileAmax), and goes to scale_inv[b, rt, ct]; amax is not read. Otherwise the scale is
// batch b's, from amax[b], and scale_inv is [B].
// The 16-bit tiled kernels hold a tile raw: thread t has 16-byte unit t % 16 (8 elements) of
// the tile's rows t / 16 + 16 j, j < kByteTileLoads.
constexpr int kByteTileUnitsPerRow = kByteTile / 8;                                 // 16
constexpr int kByteTileLoads = kByteTile * kByteTileUnitsPerRow / kByteTileThreads;  // 8
constexpr int kByteTileRowStep = kByteTileThreads / kByteTileUnitsPerRow;           // 16

// Writes tile (r0, c0) of batch b, held raw by the block as above (zeros outside x),
// quantized with `scale`: the untransposed copy directly (when asked for; 8-byte stores,
// 128 contiguous bytes per row) and the transposed data through the shared byte tile (whole
// 8-byte halves of swizzled chunks in, 128-byte runs per output row out). Returns with the
// block synchronized and the byte tile free. Needs C % 8 == 0, R % 16 == 0.
template <typename T>
__device__ __forceinline__ void StoreQuantizedByteTile(const uint4 (&raw)[kByteTileLoads],
                                                       float scale, Fp8Format format,
                                                       uint8_t* tile, uint8_t* data,
                                                       uint8_t* data_untransposed, int64_t b,
                                                       int64_t rows, int64_t cols, int64_t r0,
                                                       int64_t c0) {
  const int u = threadIdx.x % kByteTileUnitsPerRow, r_first = threadIdx.x / kByteTileUnitsPerRow;
  const int64_t col = c0 + u * 8;
  const bool col_in = col < cols;  // C % 8 == 0: a unit is whole or absent
#pragma unroll
  for (int j = 0; j < kByteTileLoads; ++j) {
    const int r = r_first + j * kByteTileRowStep;
    const T* e = reinterpret_cast<const T*>(&raw[j]);
    uint16_t pairs[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      pairs[k] = gpu::Fp8x2(gpu::LoadOne(e + 2 * k) * scale, gpu::LoadOne(e + 2 * k + 1) * scale,
                            format);
    }
    const uint2 packed = make_uint2(pairs[0] | (static_cast<uint32_t>(pairs[1]) << 16),
                                    pairs[2] | (static_cast<uint32_t>(pairs[3]) << 16));
    // Rows and columns outside x stage zeros, never stored.
    *reinterpret_cast<uint2*>(tile + r * kByteTile + SwizzledChunk(r, u / 2) * 16 +
                              (u % 2) * 8) = packed;
    if (data_untransposed != nullptr && col_in && r0 + r < rows) {
      *reinterpret_cast<uint2*>(data_untransposed + (b * rows + r0 + r) * cols + col) = packed;
    }
  }
  __syncthreads();
  const int part = ByteTilePart(), i0 = ByteTileFirstOutputRow();
  if (r0 + part * 16 < rows) {  // R % 16 == 0: a part is whole or absent
    uint32_t source[16];
    LoadTransposeSources(tile, part, i0, source);
    uint8_t* out = data + (b * cols + c0) * rows + r0 + part * 16;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if (c0 + i0 + r < cols) {
        *reinterpret_cast<uint4*>(out + (i0 + r) * rows) = TransposedRow(source, r);
      }
    }
  }
  __syncthreads();  // the byte tile is rewritten by the next tile
}

// The tiled kernel (16-bit x): one tile of 128 rows x 128 columns of one batch entry per
// step of a grid-stride loop (needs C % 8 == 0, R % 16 == 0, x, data 16-byte and the
// untransposed copy 8-byte aligned). Loads: 16 threads cover 256 contiguous bytes of a row,
// 8 raw 16-byte loads in flight per thread (raw registers, converted one unit at a time:
// at most 64 registers, so four blocks fit on an SM); then StoreQuantizedByteTile.
// Nsight Compute on 128 x [2048, 4096] bf16 (s23): this kernel 0.737 ms, 90.3% of DRAM
// bandwidth; the general kernel below 1.22 ms, 54.5% (63 registers, 50% occupancy); this
// one holding float instead of raw registers 1.33 ms, 50.2% (123 registers, 25%).
// kTileScales (quantize_blocks_transposed): the tile is also the scaling block, so its
// scale comes from its own amax, reduced from the raw registers before the conversion
// (TileAmax), and goes to scale_inv[b, rt, ct]; amax is not read. Otherwise the scale is
// batch b's, from amax[b], and scale_inv is [B].
template <typename T, bool kTileScales>
__global__ void __launch_bounds__(kByteTileThreads, 4)
QuantizeTransposedTiledKernel(const T* __restrict__ x, const float* __restrict__ amax,
                              uint8_t* __restrict__ data, float* __restrict__ scale_inv,
                              uint8_t* __restrict__ data_untransposed, int64_t batch,
                              int64_t rows, int64_t cols, int64_t row_tiles, int64_t col_tiles,
                              Fp8Format format) {
  static_assert(sizeof(T) == 2, "16-bit inputs: one 16-byte load per 8 elements");
  __shared__ __align__(16) uint8_t tile[kByteTile * kByteTile];
  const int64_t tiles = batch * row_tiles * col_tiles;
  const float fp8_max = Fp8Max(format);
  const int u = threadIdx.x % kByteTileUnitsPerRow, r_first = threadIdx.x / kByteTileUnitsPerRow;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t b = t / (row_tiles * col_tiles);
    const int64_t rt = (t / col_tiles) % row_tiles;
    const int64_t ct = t % col_tiles;
    const int64_t r0 = rt * kByteTile, c0 = ct * kByteTile;
    const int64_t col = c0 + u * 8;
    const bool col_in = col < cols;
    const T* in = x + (b * rows + r0) * cols + col;
    uint4 raw[kByteTileLoads];
#pragma unroll
    for (int j = 0; j < kByteTileLoads; ++j) {  // all loads first
      const int r = r_first + j * kByteTileRowStep;
      raw[j] = col_in && r0 + r < rows ? __ldg(reinterpret_cast<const uint4*>(in + r * cols))
                                       : make_uint4(0, 0, 0, 0);
    }
    float scale;
    if constexpr (kTileScales) {
      scale = ScaleFromAmax(TileAmax<T>(raw), fp8_max);
      if (threadIdx.x == 0) scale_inv[t] = 1.0f / scale;  // t enumerates (b, rt, ct)
    } else {
      scale = ScaleFromAmax(amax[b], fp8_max);
      if (rt == 0 && ct == 0 && threadIdx.x == 0) scale_inv[b] = 1.0f / scale;
    }
    StoreQuantizedByteTile<T>(raw, scale, format, tile, data, data_untransposed, b, rows, cols,
                              r0, c0);
  }
}

// --- per-batch current scaling from one read of x (quantize_batches_transposed) ---------
//
// Current scaling needs a batch's amax before its first FP8 byte, so BatchAmaxKernel and
// then QuantizeTransposedTiledKernel read x twice. Where a batch's 128 x 128 tiles fit in
// the shared memory of a team of blocks, QuantizeBatchesOnePassKernel reads them once. The
// grid is resident as a whole (a cooperative launch, which the counter wait below needs)
// and split into teams; team i takes batches i, i + teams, ... For each batch every block
// of the team holds its tiles in shared memory, folds their amax into amax[b] with one
// atomic and counts itself in at arrivals[b]; once the whole team has arrived it quantizes
// its tiles from shared memory with StoreQuantizedByteTile. Each slot is refilled with the
// block's tile of the team's next batch as soon as its tile is stored, so the next batch's
// reads overlap this batch's writes. The values are the two kernels': the same packed max
// over the same bits, the same stores. Measured (s44, H100, bench_quantize_weights): 1.20-
// 1.24x the two kernels on 8-64 experts of 6-16 MB, 80-84% of the copy bandwidth (the
// ideal, one read instead of two, is 1.5x; the refill above gained < 1%).
// Raw 16-bit tiles (32 KB each) an SM holds: one block of 6 (8 warps per SM), or, under
// JAXFUSE_QUANTIZE_ONE_PASS_BLOCKS=2, two blocks of 3 (16 warps per SM for the store phase;
// 2 x 112 KB of shared memory). Both measured the same (session 45, H100: 77-83% of the copy
// bandwidth), so more warps are not what the kernel lacks.
constexpr int kOnePassSmTiles = 6;
constexpr int OnePassMaxTiles(int blocks_per_sm) { return kOnePassSmTiles / blocks_per_sm; }
constexpr int kRawTileUnits = kByteTileLoads * kByteTileThreads;  // 16-byte units per tile

constexpr int OnePassSharedBytes(int tiles_per_block) {
  return kByteTile * kByteTile + tiles_per_block * kRawTileUnits * 16;
}

template <typename T, int kBlocksPerSm>
__global__ void __launch_bounds__(kByteTileThreads, kBlocksPerSm)
QuantizeBatchesOnePassKernel(const T* __restrict__ x, uint8_t* __restrict__ data,
                             float* __restrict__ scale_inv,
                             uint8_t* __restrict__ data_untransposed, float* __restrict__ amax,
                             unsigned* __restrict__ arrivals, int64_t batch, int64_t rows,
                             int64_t cols, int64_t col_tiles, int64_t tiles, int teams,
                             int team_blocks, int tiles_per_block, Fp8Format format) {
  static_assert(sizeof(T) == 2, "16-bit inputs: one 16-byte unit per 8 elements");
  extern __shared__ __align__(16) uint8_t shared[];
  uint8_t* tile = shared;
  uint4* held_tiles = reinterpret_cast<uint4*>(shared + kByteTile * kByteTile);
  __shared__ float batch_amax;
  const int team = blockIdx.x / team_blocks, rank = blockIdx.x % team_blocks;
  const float fp8_max = Fp8Max(format);
  const int u = threadIdx.x % kByteTileUnitsPerRow, r_first = threadIdx.x / kByteTileUnitsPerRow;
  // The block's tiles of every batch: rank + i * team_blocks, i < held (the same indices in
  // each batch). Slot i holds tile i; a thread only ever touches its own units of a slot.
  const int held = OnePassTilesHeld(rank, tiles, team_blocks, tiles_per_block);
  const auto unit = [&](int i, int j) -> uint4& {
    return held_tiles[i * kRawTileUnits + j * kByteTileThreads + threadIdx.x];
  };
  const auto tile_row = [&](int i) {
    return (rank + int64_t{i} * team_blocks) / col_tiles * kByteTile;
  };
  const auto tile_col = [&](int i) {
    return (rank + int64_t{i} * team_blocks) % col_tiles * kByteTile;
  };
  // Tile i of batch b into slot i (16 zero bytes for units outside x, which is not read).
  const auto fetch = [&](int64_t b, int i) {
    const int64_t r0 = tile_row(i), col = tile_col(i) + u * 8;
    const T* in = x + (b * rows + r0) * cols + col;
#pragma unroll
    for (int j = 0; j < kByteTileLoads; ++j) {
      const int r = r_first + j * kByteTileRowStep;
      const bool inside = col < cols && r0 + r < rows;
      __pipeline_memcpy_async(&unit(i, j), inside ? in + r * cols : x, 16, inside ? 0 : 16);
    }
  };
  if (team < batch) {
    for (int i = 0; i < held; ++i) fetch(team, i);
  }
  __pipeline_commit();
  for (int64_t b = team; b < batch; b += teams) {
    __pipeline_wait_prior(0);
    // A thread reads back only the units it copied: no barrier before the max.
    AbsMaxLane<T> lanes[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) Zero(lanes[i]);
    for (int i = 0; i < held; ++i) {
#pragma unroll
      for (int j = 0; j < kByteTileLoads; ++j) AccumulateAbsMax(unit(i, j), lanes);
    }
    float local = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) local = fmaxf(local, Widen(lanes[i]));
    const float reduced = gpu::BlockReduceMaxSum(local, 0.0f).x;
    if (threadIdx.x == 0) {
      if (reduced > 0.0f) gpu::AtomicMaxNonNegative(amax + b, reduced);
      cuda::atomic_ref<unsigned, cuda::thread_scope_device> arrived(arrivals[b]);
      arrived.fetch_add(1u, cuda::memory_order_release);  // after this block's amax
      while (arrived.load(cuda::memory_order_acquire) < static_cast<unsigned>(team_blocks)) {
        __nanosleep(64);
      }
      batch_amax = cuda::atomic_ref<float, cuda::thread_scope_device>(amax[b]).load(
          cuda::memory_order_relaxed);
    }
    __syncthreads();
    const float scale = ScaleFromAmax(batch_amax, fp8_max);
    if (rank == 0 && threadIdx.x == 0) scale_inv[b] = 1.0f / scale;
    const int64_t next = b + teams;
    for (int i = 0; i < held; ++i) {
      uint4 raw[kByteTileLoads];
#pragma unroll
      for (int j = 0; j < kByteTileLoads; ++j) raw[j] = unit(i, j);
      StoreQuantizedByteTile<T>(raw, scale, format, tile, data, data_untransposed, b, rows,
                                cols, tile_row(i), tile_col(i));
      // The values are stored (so read from the slot): the slot takes the next batch's tile.
      if (next < batch) fetch(next, i);
    }
    __pipeline_commit();
    // batch_amax is rewritten only after BlockReduceMaxSum's barriers.
  }
}

// The general kernel (any R, C, alignment): one tile of kTransposeTileRows x
// kTransposeTileCols input elements per step. The 16-byte loads run along C (coalesced),
// the FP8 bytes are staged in shared memory transposed, and the stores run along R. The
// shared row pitch of 132 bytes keeps the transposing byte stores at 2-way bank conflicts
// and the 4-byte reads of the store phase conflict-free.
constexpr int kTransposeTileRows = 128;  // R per tile: one 128-byte FP8 line per output row
constexpr int kTransposeTileCols = 64;   // C per tile: one 128-byte bf16 line per input row
constexpr int kTransposePitch = kTransposeTileRows + 4;
constexpr int kTransposeThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kTransposeThreads)
QuantizeTransposedGeneralKernel(const T* __restrict__ x, const float* __restrict__ amax,
                         uint8_t* __restrict__ data, float* __restrict__ scale_inv,
                         uint8_t* __restrict__ data_untransposed, int64_t batch, int64_t rows,
                         int64_t cols, int64_t row_tiles, int64_t col_tiles, Fp8Format format,
                         bool vector_in, bool vector_out) {
  __shared__ __align__(16) uint8_t tile[kTransposeTileCols * kTransposePitch];
  constexpr int kUnitsPerRow = kTransposeTileCols / 8;   // 8-element loads per tile row
  constexpr int kChunksPerCol = kTransposeTileRows / 16; // 16-byte stores per output row
  constexpr int kLoads = kTransposeTileRows * kUnitsPerRow / kTransposeThreads;
  static_assert(kLoads * kTransposeThreads == kTransposeTileRows * kUnitsPerRow, "even split");
  const int64_t tiles = batch * row_tiles * col_tiles;
  const float fp8_max = Fp8Max(format);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t b = t / (row_tiles * col_tiles);
    const int64_t rt = (t / col_tiles) % row_tiles;
    const int64_t ct = t % col_tiles;
    const float scale = ScaleFromAmax(amax[b], fp8_max);
    if (rt == 0 && ct == 0 && threadIdx.x == 0) scale_inv[b] = 1.0f / scale;
    const int64_t r0 = rt * kTransposeTileRows, c0 = ct * kTransposeTileCols;
    const T* in = x + b * rows * cols;
    // All loads of a thread first (kLoads 16-byte vectors in flight), then the conversions.
    float v[kLoads][8];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = threadIdx.x + j * kTransposeThreads;
      const int r = i / kUnitsPerRow, u = i % kUnitsPerRow;
      const int64_t row = r0 + r, col = c0 + u * 8;
      const int64_t left = row < rows ? cols - col : 0;
      const int valid = left <= 0 ? 0 : (left >= 8 ? 8 : static_cast<int>(left));
      gpu::Load8(in + row * cols + col, vector_in, valid, v[j]);
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int i = threadIdx.x + j * kTransposeThreads;
      const int r = i / kUnitsPerRow, u = i % kUnitsPerRow;
#pragma unroll
      for (int k = 0; k < 8; k += 2) {
        const uint16_t pair = gpu::Fp8x2(v[j][k] * scale, v[j][k + 1] * scale, format);
        tile[(u * 8 + k) * kTransposePitch + r] = static_cast<uint8_t>(pair);
        tile[(u * 8 + k + 1) * kTransposePitch + r] = static_cast<uint8_t>(pair >> 8);
      }
      if (data_untransposed != nullptr) {  // the same bytes in x's layout (8-byte stores)
        const int64_t row = r0 + r, col = c0 + u * 8;
        const int64_t left = row < rows ? cols - col : 0;
        const int valid = left <= 0 ? 0 : (left >= 8 ? 8 : static_cast<int>(left));
        if (valid > 0) {
          gpu::StoreFp8x8(data_untransposed + (b * rows + row) * cols + col, vector_in, valid,
                          v[j], scale, format);
        }
      }
    }
    __syncthreads();
    uint8_t* out = data + b * cols * rows;
    for (int i = threadIdx.x; i < kTransposeTileCols * kChunksPerCol; i += kTransposeThreads) {
      const int c = i / kChunksPerCol, q = i % kChunksPerCol;
      const int64_t col = c0 + c, row = r0 + q * 16;
      if (col >= cols || row >= rows) continue;
      const uint32_t* src = reinterpret_cast<const uint32_t*>(tile + c * kTransposePitch + q * 16);
      uint8_t* dst = out + col * rows + row;
      if (vector_out) {  // rows % 16 == 0: a whole 16-byte chunk
        *reinterpret_cast<uint4*>(dst) = make_uint4(src[0], src[1], src[2], src[3]);
      } else {
        const int valid = rows - row >= 16 ? 16 : static_cast<int>(rows - row);
        for (int k = 0; k < valid; ++k) dst[k] = tile[c * kTransposePitch + q * 16 + k];
      }
    }
    __syncthreads();  // the tile is rewritten by the next iteration
  }
}

// The general kernel of quantize_blocks_transposed (float32 x, or R, C, pointers the tiled
// kernel cannot take): one 128 x 128 tile (the scaling block) per step of a grid-stride
// loop, read twice like Block2DKernel (its amax, then its values again from L1/L2), the
// FP8 bytes staged transposed in shared memory and stored along R. Pitch as
// kTransposePitch: 2-way conflicts on the byte stores, 4-byte reads conflict-free.
constexpr int kBlocksPitch = kByteTile + 4;
constexpr int kBlocksThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kBlocksThreads)
QuantizeBlocksTransposedGeneralKernel(const T* __restrict__ x, uint8_t* __restrict__ data,
                                      float* __restrict__ scale_inv,
                                      uint8_t* __restrict__ data_untransposed, int64_t batch,
                                      int64_t rows, int64_t cols, int64_t row_tiles,
                                      int64_t col_tiles, Fp8Format format, bool vector_in,
                                      bool vector_straight, bool vector_out) {
  __shared__ __align__(16) uint8_t tile[kByteTile * kBlocksPitch];
  __shared__ float shared_scale;
  constexpr int kChunksPerCol = kByteTile / 16;  // 16-byte stores per output row
  const int64_t tiles = batch * row_tiles * col_tiles;
  const float fp8_max = Fp8Max(format);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t b = t / (row_tiles * col_tiles);
    const int64_t rt = (t / col_tiles) % row_tiles;
    const int64_t ct = t % col_tiles;
    const int64_t r0 = rt * kByteTile, c0 = ct * kByteTile;
    const int tile_rows = static_cast<int>(min(static_cast<int64_t>(kByteTile), rows - r0));
    const int tile_cols = static_cast<int>(min(static_cast<int64_t>(kByteTile), cols - c0));
    const int units_per_row = (tile_cols + 7) / 8;
    const int units = tile_rows * units_per_row;
    const T* in = x + (b * rows + r0) * cols + c0;
    float local = 0.0f;
    for (int i = threadIdx.x; i < units; i += kBlocksThreads) {
      const int r = i / units_per_row, u = i % units_per_row;
      const int valid = min(8, tile_cols - u * 8);
      float v[8];
      gpu::Load8(in + r * cols + u * 8, vector_in, valid, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) local = gpu::MaxAbs(local, v[k]);
    }
    const float reduced = gpu::BlockReduceMaxSum(local, 0.0f).x;
    if (threadIdx.x == 0) {
      const float scale = ScaleFromAmax(reduced, fp8_max);
      shared_scale = scale;
      scale_inv[t] = 1.0f / scale;  // t enumerates (b, rt, ct)
    }
    __syncthreads();
    const float scale = shared_scale;
    uint8_t* straight =
        data_untransposed == nullptr ? nullptr : data_untransposed + (b * rows + r0) * cols + c0;
    for (int i = threadIdx.x; i < units; i += kBlocksThreads) {
      const int r = i / units_per_row, u = i % units_per_row;
      const int valid = min(8, tile_cols - u * 8);
      float v[8];
      gpu::Load8(in + r * cols + u * 8, vector_in, valid, v);
      const uint2 packed = gpu::PackFp8x8(v, scale, format);
      uint8_t bytes[8];  // by shifts: a byte view of `packed` would put it on the stack
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        bytes[k] = static_cast<uint8_t>((k < 4 ? packed.x : packed.y) >> (8 * (k % 4)));
        if (k < valid) tile[(u * 8 + k) * kBlocksPitch + r] = bytes[k];
      }
      if (straight != nullptr) {
        uint8_t* dst = straight + r * cols + u * 8;
        if (vector_straight && valid == 8) {
          *reinterpret_cast<uint2*>(dst) = packed;
        } else {
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            if (k < valid) dst[k] = bytes[k];
          }
        }
      }
    }
    __syncthreads();
    uint8_t* out = data + (b * cols + c0) * rows + r0;
    for (int i = threadIdx.x; i < tile_cols * kChunksPerCol; i += kBlocksThreads) {
      const int c = i / kChunksPerCol, q = i % kChunksPerCol;
      const int valid = min(16, tile_rows - q * 16);
      if (valid <= 0) continue;
      const uint8_t* src = tile + c * kBlocksPitch + q * 16;
      uint8_t* dst = out + c * rows + q * 16;
      if (vector_out && valid == 16) {  // R % 16 == 0: 16-byte aligned
        const uint32_t* words = reinterpret_cast<const uint32_t*>(src);
        *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
      } else {
        for (int k = 0; k < valid; ++k) dst[k] = src[k];
      }
    }
    __syncthreads();  // the tile and shared_scale are rewritten by the next iteration
  }
}

// --- 2-D blocks (weights) ---------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(256) Block2DKernel(const T* x, uint8_t* data, float* scale_inv,
                                                     int64_t rows, int64_t cols, int block,
                                                     int64_t row_blocks, int64_t col_blocks,
                                                     Fp8Format format, bool vector) {
  const int64_t tile = blockIdx.x;
  const int64_t cb = tile % col_blocks;
  const int64_t rb = (tile / col_blocks) % row_blocks;
  const int64_t b = tile / (col_blocks * row_blocks);
  const int64_t r0 = rb * block, c0 = cb * block;
  const int64_t tile_rows = min(static_cast<int64_t>(block), rows - r0);
  const int64_t tile_cols = min(static_cast<int64_t>(block), cols - c0);
  const int64_t units_per_row = (tile_cols + 7) / 8;
  const int64_t units = tile_rows * units_per_row;
  const T* base = x + (b * rows + r0) * cols + c0;
  uint8_t* out = data + (b * rows + r0) * cols + c0;
  float amax = 0.0f;
  for (int64_t i = threadIdx.x; i < units; i += blockDim.x) {
    const int64_t r = i / units_per_row, u = i % units_per_row;
    const int64_t left = tile_cols - u * 8;
    float v[8];
    gpu::Load8(base + r * cols + u * 8, vector, left >= 8 ? 8 : static_cast<int>(left), v);
#pragma unroll
    for (int k = 0; k < 8; ++k) amax = gpu::MaxAbs(amax, v[k]);
  }
  const float reduced = gpu::BlockReduceMaxSum(amax, 0.0f).x;
  __shared__ float shared_scale;
  if (threadIdx.x == 0) {
    const float scale = ScaleFromAmax(reduced, Fp8Max(format));
    shared_scale = scale;
    scale_inv[tile] = 1.0f / scale;
  }
  __syncthreads();
  const float scale = shared_scale;
  for (int64_t i = threadIdx.x; i < units; i += blockDim.x) {
    const int64_t r = i / units_per_row, u = i % units_per_row;
    const int64_t left = tile_cols - u * 8;
    const int valid = left >= 8 ? 8 : static_cast<int>(left);
    float v[8];
    gpu::Load8(base + r * cols + u * 8, vector, valid, v);
    gpu::StoreFp8x8(out + r * cols + u * 8, vector, valid, v, scale, format);
  }
}

// JAXFUSE_QUANTIZE_TRANSPOSED=general runs the general transposed kernel on every shape
// (a benchmark knob for A/B against the tiled one; read once).
bool TransposedGeneralForced() {
  static const bool forced = [] {
    const char* value = std::getenv("JAXFUSE_QUANTIZE_TRANSPOSED");
    return value != nullptr && std::string(value) == "general";
  }();
  return forced;
}

// --- handlers ----------------------------------------------------------------------------

// The column-wise copy a handler was asked for (CheckColumnwiseOutput), as a launch target.
ffi::Error ParseColumnwiseTarget(const QuantizeProblem& problem, const ffi::AnyBuffer& data,
                                 ffi::AnyBuffer& columnwise, ColumnwiseTarget* target) {
  bool wanted = false;
  if (auto error = CheckColumnwiseOutput(problem, data, columnwise, &target->copy, &wanted);
      error.failure()) {
    return error;
  }
  target->out = wanted ? static_cast<uint8_t*>(columnwise.untyped_data()) : nullptr;
  return ffi::Error::Success();
}

ffi::Error QuantizeCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer offsets,
                        ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> scale_inv,
                        ffi::Result<ffi::AnyBuffer> amax,
                        ffi::Result<ffi::AnyBuffer> columnwise, int32_t mode, int32_t block) {
  const auto dims = x.dimensions();
  if (dims.size() == 0 || !IsFloatType(x.element_type())) {
    return InvalidArgument("quantize: x must be a float32/bfloat16/float16 array, got ",
                           DataTypeName(x.element_type()), " ", ShapeString(dims));
  }
  QuantizeProblem problem;
  problem.cols = dims.back();
  const bool two_d = mode == static_cast<int32_t>(ScalingMode::kBlock2D);
  if (two_d) {
    if (dims.size() < 2) return InvalidArgument("2-D block scaling needs x of rank >= 2");
    problem.rows = dims[dims.size() - 2];
    problem.batch = problem.rows ? LeadingProduct(dims) / problem.rows : 0;
  } else {
    problem.rows = LeadingProduct(dims);
  }
  if (auto error = CheckQuantizeOutputs(problem, offsets, *data, *scale_inv, *amax, mode, block);
      error.failure()) {
    return error;
  }
  if (data->element_count() != x.element_count()) return InvalidArgument("data must have x's shape");
  ColumnwiseTarget target;
  if (auto error = ParseColumnwiseTarget(problem, *data, *columnwise, &target); error.failure()) {
    return error;
  }
  return gpu::DispatchFloat(x.element_type(), [&](auto zero) -> ffi::Error {
    using T = decltype(zero);
    const T* px = static_cast<const T*>(x.untyped_data());
    if (two_d) {
      if (cudaMemsetAsync(amax->untyped_data(), 0, sizeof(float), stream) != cudaSuccess) {
        return Internal("zeroing the amax scratch failed");
      }
      const int64_t row_blocks = CeilDiv(problem.rows, block), col_blocks = CeilDiv(problem.cols, block);
      const int64_t tiles = problem.batch * row_blocks * col_blocks;
      if (tiles == 0) return ffi::Error::Success();
      const bool vector = problem.cols % 8 == 0 && PointerAligned16(px) &&
                          PointerAligned16(data->untyped_data());
      Block2DKernel<T><<<static_cast<unsigned>(tiles), 256, 0, stream>>>(
          px, static_cast<uint8_t*>(data->untyped_data()),
          static_cast<float*>(scale_inv->untyped_data()), problem.rows, problem.cols, block,
          row_blocks, col_blocks, problem.format, vector);
      return gpu::LaunchError("2-D block quantization kernel");
    }
    gpu::LoadProducer<T> p;
    p.x = px;
    p.cols = problem.cols;
    p.vector = problem.cols % 8 == 0 && PointerAligned16(px);
    SinkArgs<T> s = MakeSink<T>(problem, offsets, *data, *scale_inv, *amax);
    return LaunchRows(stream, p, s, CeilDiv(problem.cols, 8), problem, target);
  });
}

// Per-group current scaling of gathered rows x[source_rows[r]] (an MoE layer's tokens in
// expert order, never written in 16 bits) with the group amaxes given: the caller computes
// them from per-token amaxes (jaxfuse/_src/ops/quantize/gathered.py), so only pass 2 runs
// here, reading the tokens through GatherLoadProducer, with the column-wise copy when asked
// for.
ffi::Error QuantizeGatheredCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer source_rows,
                                ffi::AnyBuffer offsets, ffi::AnyBuffer amax,
                                ffi::Result<ffi::AnyBuffer> data,
                                ffi::Result<ffi::AnyBuffer> scale_inv,
                                ffi::Result<ffi::AnyBuffer> columnwise) {
  QuantizeProblem problem;
  if (auto error = ParseQuantizeGathered(x, source_rows, offsets, amax, *data, *scale_inv,
                                         &problem);
      error.failure()) {
    return error;
  }
  ColumnwiseTarget target;
  if (auto error = ParseColumnwiseTarget(problem, *data, *columnwise, &target); error.failure()) {
    return error;
  }
  return gpu::DispatchFloat(x.element_type(), [&](auto zero) -> ffi::Error {
    using T = decltype(zero);
    gpu::GatherLoadProducer<T> p;
    p.x = static_cast<const T*>(x.untyped_data());
    p.cols = problem.cols;
    p.vector = problem.cols % 8 == 0 && PointerAligned16(p.x);
    p.source_rows = static_cast<const int32_t*>(source_rows.untyped_data());
    p.sources = x.dimensions()[0];
    // Pass 2 only reads the amaxes: the given ones stand in for the chain's scratch.
    SinkArgs<T> s = MakeSink<T>(problem, offsets, *data, *scale_inv, amax);
    return LaunchCurrentPass(p, s, CeilDiv(problem.cols, int64_t{8}), target, stream);
  });
}

// amax[b] (zeroed before) = max |x[b]| over each batch's `elements` elements.
template <typename T>
ffi::Error LaunchBatchAmax(const T* px, int64_t batch, int64_t elements, float* amax,
                           cudaStream_t stream) {
  constexpr int64_t kPerUnit = 16 / sizeof(T);
  const bool vector = PointerAligned16(px) && (batch == 1 || elements % kPerUnit == 0);
  // Two rounds of loads (64 KB of 16-bit input) per block, like GroupAmaxKernel. A
  // persistent grid (the resident blocks spread over the batches) measured the same:
  // 263 against 262 us for the three amaxes of the FP8 linear_scale_add step at 65536 x
  // 4096 (profile_kernels_s24{persistent,amax2}_*.json under benchmarks/results/).
  constexpr int64_t kRoundsPerBlock = 2;
  const int64_t rounds =
      CeilDiv(CeilDiv(elements, kPerUnit), int64_t{kBatchAmaxThreads} * kBatchAmaxLoads);
  const int64_t batch_rows = std::min<int64_t>(batch, 65535);
  // Past 2^20 blocks per batch the blocks stride.
  const int64_t per_batch =
      std::clamp<int64_t>(CeilDiv(rounds, kRoundsPerBlock), 1, int64_t{1} << 20);
  const dim3 grid(static_cast<unsigned>(per_batch), static_cast<unsigned>(batch_rows));
  BatchAmaxKernel<T><<<grid, kBatchAmaxThreads, 0, stream>>>(px, batch, elements, vector, amax);
  return gpu::LaunchError("batch amax kernel");
}

ffi::Error BatchAmaxCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> amax) {
  BatchAmaxProblem problem;
  if (auto error = ParseBatchAmax(x, *amax, &problem); error.failure()) return error;
  if (problem.batch == 0) return ffi::Error::Success();
  float* pamax = static_cast<float*>(amax->untyped_data());
  if (cudaMemsetAsync(pamax, 0, problem.batch * sizeof(float), stream) != cudaSuccess) {
    return Internal("zeroing the amax failed");
  }
  if (problem.elements == 0) return ffi::Error::Success();
  return gpu::DispatchFloat(x.element_type(), [&](auto zero) -> ffi::Error {
    using T = decltype(zero);
    return LaunchBatchAmax(static_cast<const T*>(x.untyped_data()), problem.batch,
                           problem.elements, pamax, stream);
  });
}

// The outputs of both transposed quantizations and what their kernels may vectorize:
// 16-byte loads of x along C, 16-byte stores of data along R, 8-byte stores of the
// untransposed copy (nullptr unless asked for; it must be 8-byte aligned like x is 16-byte).
struct TransposedOutputs {
  uint8_t* data;
  uint8_t* straight;
  bool vector_in, vector_out, vector_straight;
};

template <typename T>
TransposedOutputs TransposedOutputsOf(const TransposedProblem& problem, const T* x,
                                      ffi::AnyBuffer& data, ffi::AnyBuffer& data_untransposed) {
  TransposedOutputs out;
  out.data = static_cast<uint8_t*>(data.untyped_data());
  out.straight = problem.untransposed ? static_cast<uint8_t*>(data_untransposed.untyped_data())
                                      : nullptr;
  out.vector_in = problem.cols % 8 == 0 && PointerAligned16(x);
  out.vector_out = problem.rows % 16 == 0 && PointerAligned16(out.data);
  out.vector_straight = problem.cols % 8 == 0 &&
                        (out.straight == nullptr ||
                         (reinterpret_cast<uintptr_t>(out.straight) & 7u) == 0);
  return out;
}

// Whether the tiled kernels take this problem: 16-bit x, C % 8 == 0, R % 16 == 0, x and
// data 16-byte and the untransposed copy 8-byte aligned (else the general kernels).
template <typename T>
bool TiledKernelsFit(const TransposedOutputs& out) {
  return sizeof(T) == 2 && out.vector_in && out.vector_out && out.vector_straight &&
         !TransposedGeneralForced();
}

// Every tile in its own block (up to 2^20; then each walks tiles with a stride).
unsigned TileGrid(int64_t tiles) {
  return static_cast<unsigned>(std::min<int64_t>(tiles, int64_t{1} << 20));
}

// The transposed quantization of x (rows, cols > 0) with the given amax [B].
template <typename T>
ffi::Error LaunchQuantizeTransposed(const TransposedProblem& problem, const T* px,
                                    const float* amax, float* scale_inv,
                                    const TransposedOutputs& out, cudaStream_t stream) {
  if constexpr (sizeof(T) == 2) {
    if (TiledKernelsFit<T>(out)) {
      const int64_t row_tiles = CeilDiv(problem.rows, kByteTile);
      const int64_t col_tiles = CeilDiv(problem.cols, kByteTile);
      QuantizeTransposedTiledKernel<T, false>
          <<<TileGrid(problem.batch * row_tiles * col_tiles), kByteTileThreads, 0, stream>>>(
              px, amax, out.data, scale_inv, out.straight, problem.batch, problem.rows,
              problem.cols, row_tiles, col_tiles, problem.format);
      return gpu::LaunchError("transposed quantization kernel");
    }
  }
  const int64_t row_tiles = CeilDiv(problem.rows, kTransposeTileRows);
  const int64_t col_tiles = CeilDiv(problem.cols, kTransposeTileCols);
  QuantizeTransposedGeneralKernel<T>
      <<<TileGrid(problem.batch * row_tiles * col_tiles), kTransposeThreads, 0, stream>>>(
          px, amax, out.data, scale_inv, out.straight, problem.batch, problem.rows,
          problem.cols, row_tiles, col_tiles, problem.format,
          out.vector_in && out.vector_straight, out.vector_out);
  return gpu::LaunchError("transposed quantization kernel");
}

ffi::Error QuantizeTransposedCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer amax,
                                  ffi::Result<ffi::AnyBuffer> data,
                                  ffi::Result<ffi::AnyBuffer> scale_inv,
                                  ffi::Result<ffi::AnyBuffer> data_untransposed) {
  TransposedProblem problem;
  if (auto error = ParseQuantizeTransposed(x, amax, *data, *scale_inv, *data_untransposed,
                                           &problem);
      error.failure()) {
    return error;
  }
  if (problem.batch == 0) return ffi::Error::Success();
  const float* pamax = static_cast<const float*>(amax.untyped_data());
  float* pscale_inv = static_cast<float*>(scale_inv->untyped_data());
  if (problem.rows == 0 || problem.cols == 0) {  // no elements: only the scales
    CurrentScaleInvKernel<<<1, 256, 0, stream>>>(pamax, pscale_inv, problem.batch,
                                                 problem.format);
    return gpu::LaunchError("scale_inv kernel");
  }
  return gpu::DispatchFloat(x.element_type(), [&](auto zero) -> ffi::Error {
    using T = decltype(zero);
    const T* px = static_cast<const T*>(x.untyped_data());
    return LaunchQuantizeTransposed(problem, px, pamax, pscale_inv,
                                    TransposedOutputsOf(problem, px, *data, *data_untransposed),
                                    stream);
  });
}

// JAXFUSE_QUANTIZE_ONE_PASS=0 runs the two kernels (A/B); JAXFUSE_QUANTIZE_ONE_PASS_BLOCKS
// (1 or 2) picks the kernel's blocks per SM; JAXFUSE_QUANTIZE_ONE_PASS_PLAN=most_teams the
// plan of the most teams (PlanOnePass); JAXFUSE_QUANTIZE_ONE_PASS_TILES caps the tiles a
// block holds (1 .. OnePassMaxTiles(blocks); tests use it to give small shapes many blocks
// and teams). Read once.
struct OnePassSettings {
  int blocks_per_sm = 1;
  int max_tiles = 0;  // 0: the one-pass kernel is off
  bool most_teams_only = false;  // PlanOnePass's A/B knob
};

const OnePassSettings& OnePassSettingsFromEnvironment() {
  static const OnePassSettings settings = [] {
    OnePassSettings chosen;
    chosen.blocks_per_sm = gpu::EnvInt("JAXFUSE_QUANTIZE_ONE_PASS_BLOCKS", 1) == 2 ? 2 : 1;
    const char* plan = std::getenv("JAXFUSE_QUANTIZE_ONE_PASS_PLAN");
    chosen.most_teams_only = plan != nullptr && std::string(plan) == "most_teams";
    const char* value = std::getenv("JAXFUSE_QUANTIZE_ONE_PASS");
    if (value != nullptr && std::string(value) == "0") return chosen;
    const int most = OnePassMaxTiles(chosen.blocks_per_sm);
    chosen.max_tiles =
        std::clamp(gpu::EnvInt("JAXFUSE_QUANTIZE_ONE_PASS_TILES", most), 1, most);
    return chosen;
  }();
  return settings;
}

// Blocks of QuantizeBatchesOnePassKernel<T, kBlocksPerSm> resident at once with the most
// shared memory (kBlocksPerSm per SM), or 0 where the device has no cooperative launch or
// too little shared memory (PlanOnePass, jaxfuse/one_pass_plan.h, then plans no teams).
template <typename T, int kBlocksPerSm>
int64_t OnePassResidentBlocks() {
  int device = 0, cooperative = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device);
  constexpr int kMostShared = OnePassSharedBytes(OnePassMaxTiles(kBlocksPerSm));
  if (cooperative == 0 || gpu::MaxOptInSharedBytes() < kMostShared) return 0;
  const void* kernel =
      reinterpret_cast<const void*>(QuantizeBatchesOnePassKernel<T, kBlocksPerSm>);
  gpu::AllowStagedSharedMemory(kernel, kMostShared);
  return gpu::ResidentBlocks(kernel, kByteTileThreads, kMostShared);
}

template <typename T, int kBlocksPerSm>
ffi::Error LaunchQuantizeBatchesOnePass(const TransposedProblem& problem, const OnePassPlan& plan,
                                        const T* px, float* scale_inv,
                                        const TransposedOutputs& out, float* amax,
                                        unsigned* arrivals, cudaStream_t stream) {
  const int64_t col_tiles = CeilDiv(problem.cols, kByteTile);
  const int64_t tiles = CeilDiv(problem.rows, kByteTile) * col_tiles;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(plan.teams * plan.team_blocks));
  config.blockDim = dim3(kByteTileThreads);
  config.dynamicSmemBytes = OnePassSharedBytes(plan.tiles_per_block);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeCooperative;  // every block resident: the team waits
  attribute[0].val.cooperative = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, QuantizeBatchesOnePassKernel<T, kBlocksPerSm>, px, out.data,
                     scale_inv, out.straight, amax, arrivals, problem.batch, problem.rows, problem.cols,
                     col_tiles, tiles, plan.teams, plan.team_blocks, plan.tiles_per_block,
                     problem.format);
  return gpu::LaunchError("one-pass batch quantization kernel");
}

// Per-batch current scaling, written transposed, amax included (quantize_batches_transposed):
// QuantizeBatchesOnePassKernel where it runs, else BatchAmaxKernel and the transposed
// quantization. scratch [2, B] holds the amaxes and the one-pass kernel's arrival counters.
ffi::Error QuantizeBatchesTransposedCuda(cudaStream_t stream, ffi::AnyBuffer x,
                                         ffi::Result<ffi::AnyBuffer> data,
                                         ffi::Result<ffi::AnyBuffer> scale_inv,
                                         ffi::Result<ffi::AnyBuffer> data_untransposed,
                                         ffi::Result<ffi::AnyBuffer> scratch) {
  TransposedProblem problem;
  if (auto error = ParseQuantizeBatchesTransposed(x, *data, *scale_inv, *data_untransposed,
                                                  *scratch, &problem);
      error.failure()) {
    return error;
  }
  if (problem.batch == 0) return ffi::Error::Success();
  float* amax = static_cast<float*>(scratch->untyped_data());
  unsigned* arrivals = reinterpret_cast<unsigned*>(amax + problem.batch);
  if (cudaMemsetAsync(amax, 0, 2 * problem.batch * sizeof(float), stream) != cudaSuccess) {
    return Internal("zeroing the amax failed");
  }
  float* pscale_inv = static_cast<float*>(scale_inv->untyped_data());
  if (problem.rows == 0 || problem.cols == 0) {  // no elements: amax 0, scale 1
    CurrentScaleInvKernel<<<1, 256, 0, stream>>>(amax, pscale_inv, problem.batch,
                                                 problem.format);
    return gpu::LaunchError("scale_inv kernel");
  }
  return gpu::DispatchFloat(x.element_type(), [&](auto zero) -> ffi::Error {
    using T = decltype(zero);
    const T* px = static_cast<const T*>(x.untyped_data());
    const TransposedOutputs out = TransposedOutputsOf(problem, px, *data, *data_untransposed);
    if constexpr (sizeof(T) == 2) {
      if (TiledKernelsFit<T>(out)) {
        const int64_t tiles = CeilDiv(problem.rows, kByteTile) * CeilDiv(problem.cols, kByteTile);
        const OnePassSettings& settings = OnePassSettingsFromEnvironment();
        const bool two = settings.blocks_per_sm == 2;
        const int64_t resident =
            two ? OnePassResidentBlocks<T, 2>() : OnePassResidentBlocks<T, 1>();
        const OnePassPlan plan = PlanOnePass(resident, settings.max_tiles, problem.batch, tiles,
                                             settings.most_teams_only);
        if (plan.teams > 0) {
          return two ? LaunchQuantizeBatchesOnePass<T, 2>(problem, plan, px, pscale_inv, out,
                                                         amax, arrivals, stream)
                     : LaunchQuantizeBatchesOnePass<T, 1>(problem, plan, px, pscale_inv, out,
                                                         amax, arrivals, stream);
        }
      }
    }
    if (auto error = LaunchBatchAmax(px, problem.batch, problem.rows * problem.cols, amax,
                                     stream);
        error.failure()) {
      return error;
    }
    return LaunchQuantizeTransposed(problem, px, amax, pscale_inv, out, stream);
  });
}

// The tiled kernel (kTileScales) for 16-bit x with C % 8 == 0, R % 16 == 0, x and data
// 16-byte and the untransposed copy 8-byte aligned (as quantize_transposed's); the general
// blocks kernel otherwise, and for every shape under JAXFUSE_QUANTIZE_TRANSPOSED=general.
ffi::Error QuantizeBlocksTransposedCuda(cudaStream_t stream, ffi::AnyBuffer x,
                                        ffi::Result<ffi::AnyBuffer> data,
                                        ffi::Result<ffi::AnyBuffer> scale_inv,
                                        ffi::Result<ffi::AnyBuffer> data_untransposed) {
  TransposedProblem problem;
  if (auto error = ParseQuantizeBlocksTransposed(x, *data, *scale_inv, *data_untransposed,
                                                 &problem);
      error.failure()) {
    return error;
  }
  const int64_t row_tiles = CeilDiv(problem.rows, kWeightBlock);
  const int64_t col_tiles = CeilDiv(problem.cols, kWeightBlock);
  const int64_t tiles = problem.batch * row_tiles * col_tiles;
  if (tiles == 0) return ffi::Error::Success();  // no elements and no scales
  return gpu::DispatchFloat(x.element_type(), [&](auto zero) -> ffi::Error {
    using T = decltype(zero);
    const T* px = static_cast<const T*>(x.untyped_data());
    float* pscale_inv = static_cast<float*>(scale_inv->untyped_data());
    const TransposedOutputs out = TransposedOutputsOf(problem, px, *data, *data_untransposed);
    const unsigned grid = TileGrid(tiles);
    if constexpr (sizeof(T) == 2) {
      if (TiledKernelsFit<T>(out)) {
        QuantizeTransposedTiledKernel<T, true><<<grid, kByteTileThreads, 0, stream>>>(
            px, nullptr, out.data, pscale_inv, out.straight, problem.batch, problem.rows,
            problem.cols, row_tiles, col_tiles, problem.format);
        return gpu::LaunchError("tile-scaled transposed quantization kernel");
      }
    }
    QuantizeBlocksTransposedGeneralKernel<T><<<grid, kBlocksThreads, 0, stream>>>(
        px, out.data, pscale_inv, out.straight, problem.batch, problem.rows, problem.cols,
        row_tiles, col_tiles, problem.format, out.vector_in, out.vector_straight,
        out.vector_out);
    return gpu::LaunchError("tile-scaled transposed quantization kernel");
  });
}

// --- the columnwise copy of row-grouped FP8 data (jaxfuse/columnwise.h) -----------------

// One block per output tile of kColumnwiseTileK output rows (K) x kColumnwiseTileCols
// output columns (source rows). The block first finds the clamped offsets (running max) of
// every group in shared memory, then the source row of each of its columns by binary
// search (-1: padding, written as zero) and the storage block (jaxfuse/columnwise.h) of each
// 16-column part: block boundaries are multiples of 16, so no part straddles two. Loads: 16
// bytes along K of one source row (coalesced) into the swizzled byte tile; stores: the
// byte-tile transposition above.
constexpr int kColumnwiseTileCols = kByteTile;  // source rows per tile
constexpr int kColumnwiseTileK = kByteTile;     // source bytes per row per tile
constexpr int kColumnwiseThreads = kByteTileThreads;

// c_g = max_{j <= g} clamp(offsets[j], 0, rows) for g in [0, count), into clamped[] (shared),
// by the whole block: each thread scans a contiguous run, then a block scan of run maxima.
__device__ void ClampedOffsetsToShared(const int32_t* offsets, int count, int64_t rows,
                                       int32_t* clamped) {
  __shared__ int32_t warp_max[kColumnwiseThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = (count + kColumnwiseThreads - 1) / kColumnwiseThreads;
  const int begin = min(count, tid * per), end = min(count, begin + per);
  int32_t run = 0;
  for (int i = begin; i < end; ++i) {
    run = max(run, static_cast<int32_t>(ClampedOffset(offsets, i, rows)));
    clamped[i] = run;
  }
  int32_t inclusive = run;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive = max(inclusive, up);
  }
  if (lane == 31) warp_max[warp] = inclusive;
  __syncthreads();
  int32_t before = __shfl_up_sync(0xffffffffu, inclusive, 1);
  if (lane == 0) before = 0;
  for (int w = 0; w < warp; ++w) before = max(before, warp_max[w]);
  for (int i = begin; i < end; ++i) clamped[i] = max(clamped[i], before);
  __syncthreads();
}

// The source row of each of a tile's kColumnwiseTileCols columns (from col0; -1: padding)
// and the storage block [begin, end) of each 16-column part, from the clamped offsets in
// shared memory (threads below kColumnwiseTileCols; the caller synchronizes).
__device__ __forceinline__ void ColumnwiseTileColumns(const int32_t* clamped, int groups,
                                                      int64_t width, int64_t col0,
                                                      int64_t* source_row, int64_t* part_begin,
                                                      int64_t* part_end) {
  if (threadIdx.x >= kColumnwiseTileCols) return;
  const int64_t col = col0 + threadIdx.x;
  // Last group g with ColumnwiseStart(c_g, g) <= col (starts strictly increase in g).
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (ColumnwiseStart(clamped[mid], mid) <= col) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t row = clamped[lo] + (col - ColumnwiseStart(clamped[lo], lo));
  source_row[threadIdx.x] = col < width && row >= clamped[lo] && row < clamped[lo + 1] ? row : -1;
  if (threadIdx.x % 16 == 0) {
    const int64_t tail_begin = ColumnwiseStart(clamped[groups], groups);
    const bool tail = lo == groups - 1 && col >= tail_begin;  // block G: after the last group
    part_begin[threadIdx.x / 16] = tail ? tail_begin : ColumnwiseBlockBegin(clamped[lo], lo);
    part_end[threadIdx.x / 16] = tail ? width : ColumnwiseStart(clamped[lo + 1], lo + 1);
  }
}

__global__ void __launch_bounds__(kColumnwiseThreads)
ColumnwiseKernel(const uint8_t* __restrict__ data, const int32_t* __restrict__ offsets,
                 int groups, int64_t rows, int64_t cols, int64_t width,
                 uint8_t* __restrict__ out) {
  extern __shared__ int32_t clamped[];  // [groups + 1]
  __shared__ int64_t source_row[kColumnwiseTileCols];
  constexpr int kChunks = kColumnwiseTileK / 16;  // 16-byte chunks per tile row
  constexpr int kParts = kColumnwiseTileCols / 16;  // 16-column parts per tile
  __shared__ int64_t part_begin[kParts], part_end[kParts];  // the storage block of each part
  __shared__ __align__(16) uint8_t tile[kColumnwiseTileCols * kColumnwiseTileK];
  constexpr int kSteps = kColumnwiseTileCols * kChunks / kColumnwiseThreads;
  ClampedOffsetsToShared(offsets, groups + 1, rows, clamped);
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kColumnwiseTileCols;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * kColumnwiseTileK;
  ColumnwiseTileColumns(clamped, groups, width, col0, source_row, part_begin, part_end);
  __syncthreads();
#pragma unroll
  for (int step = 0; step < kSteps; ++step) {
    const int c = threadIdx.x + step * kColumnwiseThreads;
    const int q = c / kChunks, chunk = c % kChunks;
    const int64_t row = source_row[q];
    const int64_t kk = k0 + chunk * 16;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (row >= 0 && kk < cols) value = *reinterpret_cast<const uint4*>(data + row * cols + kk);
    *reinterpret_cast<uint4*>(tile + q * kColumnwiseTileK + SwizzledChunk(q, chunk) * 16) = value;
  }
  __syncthreads();
  // Store phase: each thread writes four output rows (k0 + i0 .. + 3) of one 16-column part.
  const int part = ByteTilePart(), i0 = ByteTileFirstOutputRow();
  if (col0 + part * 16 >= width) return;
  const int64_t begin = part_begin[part], end = part_end[part];
  uint32_t source[16];
  LoadTransposeSources(tile, part, i0, source);
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int64_t kk = k0 + i0 + r;
    if (kk >= cols) break;
    *reinterpret_cast<uint4*>(out + ColumnwiseIndex(cols, begin, end, kk, col0 + part * 16)) =
        TransposedRow(source, r);
  }
}

// Launches ColumnwiseKernel: data FP8 [copy.rows, copy.cols] -> its column-wise copy out,
// after the kernel's requirements (`op` and `k_name` name them in the errors).
ffi::Error LaunchColumnwiseKernel(const ColumnwiseProblem& copy, const uint8_t* data,
                                  const int32_t* offsets, uint8_t* out, cudaStream_t stream,
                                  const char* op, const char* k_name) {
  if (copy.cols == 0 || copy.width == 0) return gpu::LaunchError("columnwise copy");
  // The kernel loads 16-byte chunks of data's rows (the FP8 GEMMs need the same of K).
  if (copy.cols % kColumnwiseAlign != 0) {
    return InvalidArgument(op, ": ", k_name, " must be a multiple of ", kColumnwiseAlign,
                           " on GPU, got ", copy.cols);
  }
  if (!PointerAligned16(data) || !PointerAligned16(out)) {
    return InvalidArgument(op, ": data and out must be 16-byte aligned");
  }
  const dim3 grid(static_cast<unsigned>(CeilDiv(copy.width, kColumnwiseTileCols)),
                  static_cast<unsigned>(CeilDiv(copy.cols, kColumnwiseTileK)));
  if (grid.y > 65535) {
    return InvalidArgument(op, ": K = ", copy.cols, " exceeds ",
                           int64_t{65535} * kColumnwiseTileK);
  }
  const size_t shared = static_cast<size_t>(copy.groups + 1) * sizeof(int32_t);
  ColumnwiseKernel<<<grid, kColumnwiseThreads, shared, stream>>>(
      data, offsets, static_cast<int>(copy.groups), copy.rows, copy.cols, copy.width, out);
  return gpu::LaunchError("columnwise copy kernel");
}

ffi::Error ColumnwiseCuda(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer offsets,
                          ffi::Result<ffi::AnyBuffer> out) {
  ColumnwiseProblem problem;
  if (auto error = ParseColumnwise(data, offsets, *out, &problem); error.failure()) return error;
  return LaunchColumnwiseKernel(problem, static_cast<const uint8_t*>(data.untyped_data()),
                                offsets.typed_data<int32_t>(),
                                static_cast<uint8_t*>(out->untyped_data()), stream,
                                "group_columnwise", "K (data.shape[1])");
}

// --- current scaling's second pass with the column-wise copy (cast + transpose) ---------
//
// QuantizeColumnwiseKernel stands for RowKernel<kCurrent> followed by ColumnwiseKernel when
// the FP8 wgrad needs the column-wise copy of what is quantized (TransformerEngine's cast +
// transpose): the same bytes, with one read of the producer's inputs and no second pass
// over the FP8 data. One block per tile: kByteTile columns of the copy (source rows of one
// group, or padding) x kColumnwiseUnits units (128 values) of each of the producer's chunks,
// in the order of TileOrder over a 1-D grid. Each thread computes eight (row, unit) values through the producer and quantizes them as
// RowKernel<kCurrent> would (the scale of GroupOfRow's group; zeros for rows of no group),
// stores them row-wise (8 bytes) and into its chunk's swizzled byte tile; the store phase
// writes the tiles transposed, as ColumnwiseKernel does. Rows that no column covers (before
// c_0 or from c_G: rows past the groups) are quantized row-wise by a grid-stride loop.
constexpr int kColumnwiseUnits = kByteTile / gpu::kUnit;
constexpr int kColumnwiseRowStep = kByteTileThreads / kColumnwiseUnits;  // 16 rows per step

template <class P, typename T>
__device__ __forceinline__ void QuantizeUncoveredRows(const P& p, const SinkArgs<T>& s,
                                                      int64_t first_covered,
                                                      int64_t end_covered, float fp8_max) {
  const int64_t units = p.Units();
  const int64_t uncovered = first_covered + (s.rows - end_covered);
  const int64_t items = uncovered * units;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < items;
       i += stride) {
    const int64_t index = i / units, u = i % units;
    const int64_t row = index < first_covered ? index : end_covered + (index - first_covered);
    const int64_t g = GroupOfRow(s.offsets, s.num_groups, row, s.rows);
    float v[P::kChunks][8] = {};
    float side = 0.0f;
    const bool live = g < s.num_groups;
    if (live) p.Compute(row, u, p.RowScale(row), v, side);
    const float scale = live ? ScaleFromAmax(s.amax[g], fp8_max) : 1.0f;
#pragma unroll
    for (int c = 0; c < P::kChunks; ++c) {
      if (p.Valid(c, u) == 0) continue;
      *reinterpret_cast<uint2*>(s.data + row * s.cols + p.Col(c, u)) =
          live ? gpu::PackFp8x8(v[c], scale, s.format) : make_uint2(0, 0);
    }
  }
}

// The order of the tiles over a 1-D grid: panels of `panel` copy-column tiles, each panel
// walking its column tiles fastest and then the unit tiles, so the blocks resident at once
// (about four panels on the H200) read whole source rows (every unit tile of them) and
// write runs of panel x 128 bytes of every copy row. Column tiles fastest over the whole
// grid (panel >= column tiles, the order of a 2-D grid) leaves each source row's 256-byte
// pieces to blocks far apart in time; unit tiles fastest, each copy row's 128-byte pieces.
// (Panels of 16 column tiles: the 528 resident blocks at T=65536, F=2048 span two panels.)
struct TileOrder {
  int64_t column_tiles = 0, unit_tiles = 0, panel = 0;
};

__device__ __forceinline__ void TileOfBlock(const TileOrder& order, int64_t block,
                                            int64_t* column_tile, int64_t* unit_tile) {
  const int64_t panel_blocks = order.panel * order.unit_tiles;
  const int64_t panel = block / panel_blocks, within = block % panel_blocks;
  const int64_t first = panel * order.panel;
  // The last panel may be narrower.
  const int64_t width = min(order.panel, order.column_tiles - first);
  *column_tile = first + within % width;
  *unit_tile = within / width;
}

template <class P, typename T>
__global__ void __launch_bounds__(kByteTileThreads, 4)
QuantizeColumnwiseKernel(P p, SinkArgs<T> s, int64_t width, uint8_t* __restrict__ out,
                         TileOrder order) {
  extern __shared__ __align__(16) unsigned char shared[];
  constexpr int kTileBytes = kByteTile * kByteTile;
  uint8_t* tiles = shared;  // [P::kChunks][kByteTile source rows][kByteTile bytes]
  int32_t* clamped = reinterpret_cast<int32_t*>(shared + P::kChunks * kTileBytes);  // [G + 1]
  constexpr int kParts = kByteTile / 16;
  __shared__ int64_t source_row[kByteTile];
  __shared__ float row_scale[kByteTile];
  __shared__ bool row_zero[kByteTile];
  __shared__ int64_t part_begin[kParts], part_end[kParts];
  const float fp8_max = Fp8Max(s.format);
  const int groups = static_cast<int>(s.num_groups);
  const int64_t units = p.Units();
  if (blockIdx.x == 0) {
    float* scale_inv = static_cast<float*>(s.scale_inv);
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
      scale_inv[g] = 1.0f / ScaleFromAmax(s.amax[g], fp8_max);
    }
  }
  ClampedOffsetsToShared(s.offsets, groups + 1, s.rows, clamped);
  int64_t column_tile, unit_tile;
  TileOfBlock(order, blockIdx.x, &column_tile, &unit_tile);
  const int64_t col0 = column_tile * kByteTile;
  const int64_t u0 = unit_tile * kColumnwiseUnits;
  ColumnwiseTileColumns(clamped, groups, width, col0, source_row, part_begin, part_end);
  if (threadIdx.x < kByteTile) {  // source_row[threadIdx.x] was written by this thread
    const int64_t row = source_row[threadIdx.x];
    const int64_t g = row >= 0 ? GroupOfRow(s.offsets, s.num_groups, row, s.rows) : s.num_groups;
    row_zero[threadIdx.x] = g >= s.num_groups;
    row_scale[threadIdx.x] = g < s.num_groups ? ScaleFromAmax(s.amax[g], fp8_max) : 1.0f;
  }
  __syncthreads();
  const int uu = threadIdx.x % kColumnwiseUnits;
  const int64_t u = u0 + uu;
  const bool unit_in = u < units;
  constexpr int kSteps = kByteTile / kColumnwiseRowStep;
  auto tile_row = [](int step) {
    return static_cast<int>(threadIdx.x) / kColumnwiseUnits + step * kColumnwiseRowStep;
  };
  auto live = [&](int q) { return unit_in && source_row[q] >= 0 && !row_zero[q]; };
  // Quantizes a step's values: row-wise to data, and into the chunks' byte tiles.
  auto sink = [&](int q, const float (&v)[P::kChunks][8]) {
    const int64_t row = source_row[q];
    const bool is_live = live(q);
#pragma unroll
    for (int c = 0; c < P::kChunks; ++c) {
      const uint2 packed =
          is_live ? gpu::PackFp8x8(v[c], row_scale[q], s.format) : make_uint2(0, 0);
      if (unit_in && row >= 0 && p.Valid(c, u) > 0) {
        *reinterpret_cast<uint2*>(s.data + row * s.cols + p.Col(c, u)) = packed;
      }
      *reinterpret_cast<uint2*>(tiles + c * kTileBytes + q * kByteTile +
                                SwizzledChunk(q, uu / 2) * 16 + (uu % 2) * 8) = packed;
    }
  };
  if constexpr (sizeof(T) == 2) {
    // Batches of steps with all of their 16-byte loads issued before any math: about eight
    // loads in flight per thread (as QuantizeTransposedTiledKernel), where one unit at a
    // time left the activation gradient's pass at 2.5 TB/s.
    constexpr int kBatch = 8 / P::kRawStreams;
    static_assert(kSteps % kBatch == 0, "whole batches");
    const int streams = p.Streams();
#pragma unroll 1
    for (int base = 0; base < kSteps; base += kBatch) {
      uint4 raw[kBatch][P::kRawStreams];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int q = tile_row(base + j);
        const bool is_live = live(q);
#pragma unroll
        for (int stream = 0; stream < P::kRawStreams; ++stream) {
          raw[j][stream] =
              is_live && stream < streams
                  ? __ldg(reinterpret_cast<const uint4*>(
                        p.Segment(stream, source_row[q], u * gpu::kUnit)))
                  : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int q = tile_row(base + j);
        float v[P::kChunks][8] = {};
        float side = 0.0f;
        if (live(q)) p.ComputeRaw(raw[j], p.RowScale(source_row[q]), v, side);
        sink(q, v);
      }
    }
  } else {  // float inputs: one unit at a time
#pragma unroll 2
    for (int step = 0; step < kSteps; ++step) {
      const int q = tile_row(step);
      float v[P::kChunks][8] = {};
      float side = 0.0f;
      if (live(q)) p.Compute(source_row[q], u, p.RowScale(source_row[q]), v, side);
      sink(q, v);
    }
  }
  __syncthreads();
  const int part = ByteTilePart(), i0 = ByteTileFirstOutputRow();
  const int64_t rows_in_tile =
      units - u0 < kColumnwiseUnits ? (units - u0) * gpu::kUnit : kByteTile;
  if (col0 + part * 16 < width) {
    const int64_t begin = part_begin[part], end = part_end[part];
#pragma unroll
    for (int c = 0; c < P::kChunks; ++c) {
      if (p.Valid(c, u0) == 0) continue;  // the chunk has no columns (srelu's second)
      uint32_t source[16];
      LoadTransposeSources(tiles + c * kTileBytes, part, i0, source);
      const int64_t k_first = p.Col(c, u0);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (i0 + r >= rows_in_tile) break;
        *reinterpret_cast<uint4*>(out + ColumnwiseIndex(s.cols, begin, end, k_first + i0 + r,
                                                        col0 + part * 16)) =
            TransposedRow(source, r);
      }
    }
  }
  QuantizeUncoveredRows(p, s, clamped[0], clamped[groups], fp8_max);
}

// JAXFUSE_COLUMNWISE_FUSED=0 runs RowKernel<kCurrent> and ColumnwiseKernel instead of the
// fused kernel (a benchmark knob: same bytes). Read once.
inline bool ColumnwiseFusedEnabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("JAXFUSE_COLUMNWISE_FUSED");
    return value == nullptr || value[0] != '0';
  }();
  return enabled;
}

// Column tiles per panel of QuantizeColumnwiseKernel's tile order (TileOrder):
// JAXFUSE_COLUMNWISE_PANEL (a benchmark knob, read once; a huge value gives the column-
// tiles-fastest order), else kDefaultColumnwisePanel. The three passes of the FP8 grouped
// MLP at T=65536, F=2048 on the H200 (a30d7199, profile_kernels_s26panel*): column tiles
// fastest 932 us, panels of 4 903, of 8 907, of 16 876.
constexpr int kDefaultColumnwisePanel = 16;

inline int64_t ColumnwisePanel() {
  static const int64_t panel = gpu::EnvInt("JAXFUSE_COLUMNWISE_PANEL", kDefaultColumnwisePanel);
  return panel;
}

template <class P, typename T>
ffi::Error LaunchCurrentWithColumnwise(const P& p, const SinkArgs<T>& s, int64_t units,
                                       const ColumnwiseTarget& target, cudaStream_t stream) {
  const ColumnwiseProblem& copy = target.copy;
  // The fused kernel takes the producers with a register form (not DActFlatProducer).
  if constexpr (P::kStaged) {
    TileOrder order;
    order.column_tiles = CeilDiv(copy.width, kByteTile);
    order.unit_tiles = CeilDiv(units, kColumnwiseUnits);
    order.panel = std::min(ColumnwisePanel(), order.column_tiles);
    const int64_t blocks = order.column_tiles * order.unit_tiles;
    const bool fusable = p.vector && s.data_vector && PointerAligned16(target.out) &&
                         units > 0 && copy.width > 0 && blocks <= (int64_t{1} << 31) - 1;
    if (fusable && ColumnwiseFusedEnabled()) {
      const size_t shared = static_cast<size_t>(P::kChunks) * kByteTile * kByteTile +
                            static_cast<size_t>(copy.groups + 1) * sizeof(int32_t);
      const void* kernel = reinterpret_cast<const void*>(&QuantizeColumnwiseKernel<P, T>);
      if (shared > 48 * 1024) gpu::AllowStagedSharedMemory(kernel, static_cast<int>(shared));
      QuantizeColumnwiseKernel<P, T><<<static_cast<unsigned>(blocks), kByteTileThreads, shared,
                                       stream>>>(p, s, copy.width, target.out, order);
      return gpu::LaunchError("fused quantization + column-wise copy kernel");
    }
  }
  // The two kernels: the row-wise pass, then the copy of its FP8 bytes.
  if (s.rows > 0) {
    gpu::LaunchRowKernel<P, SinkKind::kCurrent, T>(p, s, units, stream);
  } else {
    CurrentScaleInvKernel<<<1, 256, 0, stream>>>(s.amax, static_cast<float*>(s.scale_inv),
                                                 s.num_groups, s.format);
  }
  return LaunchColumnwiseKernel(copy, s.data, s.offsets, target.out, stream, "columnwise",
                                "K (the last dimension)");
}

ffi::Error ActivationQuantizeCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scales,
                                  ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> data,
                                  ffi::Result<ffi::AnyBuffer> scale_inv,
                                  ffi::Result<ffi::AnyBuffer> amax,
                                  ffi::Result<ffi::AnyBuffer> columnwise, int32_t activation,
                                  float limit, float alpha, float linear_offset, int32_t mode,
                                  int32_t block) {
  ActivationProblem act;
  if (auto error = ParseActivationProblem(x, scales, activation, limit, alpha, linear_offset, &act);
      error.failure()) {
    return error;
  }
  if (mode == static_cast<int32_t>(ScalingMode::kBlock2D)) {
    return InvalidArgument("2-D block scaling is for weights, not activations");
  }
  QuantizeProblem problem;
  problem.rows = act.rows;
  problem.cols = act.out_cols;
  if (auto error = CheckQuantizeOutputs(problem, offsets, *data, *scale_inv, *amax, mode, block);
      error.failure()) {
    return error;
  }
  if (data->element_count() != static_cast<size_t>(act.rows * act.out_cols)) {
    return InvalidArgument("data must be [rows, F]");
  }
  ColumnwiseTarget target;
  if (auto error = ParseColumnwiseTarget(problem, *data, *columnwise, &target); error.failure()) {
    return error;
  }
  return gpu::DispatchFloat(x.element_type(), [&](auto zero) -> ffi::Error {
    using T = decltype(zero);
    gpu::ActProducer<T> p;
    p.x = static_cast<const T*>(x.untyped_data());
    p.scales = scales.untyped_data();
    p.scales_f32 = scales.element_type() == ffi::DataType::F32;
    p.params = act.params;
    p.f = act.out_cols;
    p.w = act.in_cols;
    p.vector = act.out_cols % 8 == 0 && PointerAligned16(p.x);
    SinkArgs<T> s = MakeSink<T>(problem, offsets, *data, *scale_inv, *amax);
    return LaunchRows(stream, p, s, CeilDiv(act.out_cols, 8), problem, target);
  });
}

ffi::Error DactivationQuantizeCuda(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                                   ffi::AnyBuffer scales, ffi::AnyBuffer offsets,
                                   ffi::Result<ffi::AnyBuffer> data,
                                   ffi::Result<ffi::AnyBuffer> scale_inv,
                                   ffi::Result<ffi::AnyBuffer> dx,
                                   ffi::Result<ffi::AnyBuffer> dscales,
                                   ffi::Result<ffi::AnyBuffer> amax,
                                   ffi::Result<ffi::AnyBuffer> columnwise, int32_t activation,
                                   float limit, float alpha, float linear_offset, int32_t mode,
                                   int32_t block) {
  ActivationProblem act;
  QuantizeProblem problem;
  if (auto error = ParseDactivationQuantize(dy, x, scales, offsets, *data, *scale_inv, *dx,
                                            *dscales, *amax, activation, limit, alpha,
                                            linear_offset, mode, block, &act, &problem);
      error.failure()) {
    return error;
  }
  ColumnwiseTarget target;
  if (auto error = ParseColumnwiseTarget(problem, *data, *columnwise, &target); error.failure()) {
    return error;
  }
  const bool write_dx = dx->element_count() != 0;
  if (act.rows > 0 && act.out_cols == 0 &&
      cudaMemsetAsync(dscales->untyped_data(), 0, dscales->size_bytes(), stream) != cudaSuccess) {
    return Internal("zeroing dscales failed");
  }
  return gpu::DispatchFloat(x.element_type(), [&](auto zero) -> ffi::Error {
    using T = decltype(zero);
    SinkArgs<T> s = MakeSink<T>(problem, offsets, *data, *scale_inv, *amax);
    s.side = act.out_cols > 0 ? static_cast<float*>(dscales->untyped_data()) : nullptr;
    if (write_dx) {
      s.out = static_cast<T*>(dx->untyped_data());
      s.out_vector = act.out_cols % 8 == 0 && PointerAligned16(s.out);
    }
    const T* px = static_cast<const T*>(x.untyped_data());
    const T* pdy = static_cast<const T*>(dy.untyped_data());
    const bool vector = act.out_cols % 8 == 0 && PointerAligned16(px) && PointerAligned16(pdy);
    const bool pair = problem.mode == ScalingMode::kCurrent ||
                      !IsGlu(act.params.kind) || act.out_cols % problem.block == 0;
    if (pair) {  // dx halves at columns j and F + j from one read of a, b, dy
      gpu::DActPairProducer<T> p{pdy, px, scales.untyped_data(),
                                 scales.element_type() == ffi::DataType::F32, act.params,
                                 act.out_cols, act.in_cols, vector};
      return LaunchRows(stream, p, s, CeilDiv(act.out_cols, 8), problem, target);
    }
    // Blocks straddle the two halves of dx: walk dx's columns in order instead.
    gpu::DActFlatProducer<T> p{pdy, px, scales.untyped_data(),
                               scales.element_type() == ffi::DataType::F32, act.params,
                               act.out_cols, act.in_cols, vector};
    return LaunchRows(stream, p, s, CeilDiv(act.in_cols, 8), problem, target);
  });
}

// --- the blockwise-scaled column-wise copy (Float8BlockScaling's FP8 grouped wgrad) ---------
//
// quantize_columnwise_blocks (jaxfuse/quantize.h, layouts in jaxfuse/columnwise.h): one
// block per (scale slot, tile of kBlocksCopyCols columns of x), grid (S, ceil(C / 128)),
// S = ColumnwiseScaleRows(M, G). Each block computes the clamped offsets of every group in
// shared memory (as ColumnwiseKernel) and finds, by binary search, the last group g with
// ColumnwiseScaleRow(c_g, g) <= slot (the rows strictly increase in g); j = slot - that row.
//  - j < blocks of g: block j of group g. The block's <= 128 rows x 128 columns are loaded
//    along C (coalesced, 8 units in flight per thread), each column's amax is reduced over
//    the rows (registers, a shuffle, then shared memory across warps), its scale_inv
//    written, and the FP8 bytes staged transposed in shared memory (one 4-byte word per 4
//    consecutive rows) and stored along the rows: one 16-byte-aligned run of the block's
//    rows per column, 16-byte stores (rows past the block's end stage zeros).
//  - otherwise the slot is no block's: its scale row gets 1.
// Zero columns (every column that holds no row) need an owner each; the closed forms of
// jaxfuse/columnwise.h give every one of them a block of this grid, so nothing else runs
// and nothing is written twice:
//  - padding after a non-empty group (to the next block's begin): the group's last block,
//    extending its run (both ends are multiples of 16);
//  - an empty group's 16 columns: slot ColumnwiseScaleRow(c_g, g) belongs to no block
//    (the previous group's rows end at or before it, the next group's start after it);
//  - columns [0, start_0) before group 0 (offsets[0] > 0): the slots below group 0's first
//    row take 128 columns each, and the slot of that first row the remainder (< 128);
//  - the tail [start_G, W): the slots past the last group's rows (past its one slot when
//    it is empty), 128 columns each; there are at least ceil((W - start_G) / 128) of them,
//    since floor(c / 128) + ceil(L / 128) <= floor((c + L) / 128) + 1.
constexpr int kBlocksCopyCols = 128;  // columns of x per block: 16 units of 8
constexpr int kBlocksCopyThreads = kColumnwiseThreads;  // ClampedOffsetsToShared's block size
constexpr int kBlocksCopyUnits = kBlocksCopyCols / gpu::kUnit;              // 16 per row
constexpr int kBlocksCopyLoads = kColumnwiseScaleBlock * kBlocksCopyUnits / kBlocksCopyThreads;
// Shared row pitch of the staged bytes (one row per column of x): 33 words keep the 16-byte
// stores of a warp conflict-free in the store phase (4-byte reads).
constexpr int kBlocksCopyPitch = kColumnwiseScaleBlock + 4;
static_assert(kColumnwiseScaleBlock == 128 && kBlocksCopyLoads == 8,
              "each thread holds 8 rows (two runs of 4) of one unit");

// The 8 values of x one thread holds per row: raw 16-byte registers for aligned 16-bit x
// (converted where used: half the registers of floats, so four blocks fit on an SM), else
// floats from gpu::Load8 (any C, any alignment; 0 past C).
template <typename T, bool kRaw>
struct CopyUnit {
  float v[8];
  __device__ __forceinline__ void Load(const T* p, bool vector, int valid) {
    gpu::Load8(p, vector, valid, v);
  }
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = 0.0f;
  }
  __device__ __forceinline__ float At(int e) const { return v[e]; }
};

template <typename T>
struct CopyUnit<T, true> {
  uint4 raw;
  // C % 8 == 0: a unit is whole (valid == 8) or past C (never loaded).
  __device__ __forceinline__ void Load(const T* p, bool, int) {
    raw = __ldg(reinterpret_cast<const uint4*>(p));
  }
  __device__ __forceinline__ void Zero() { raw = make_uint4(0, 0, 0, 0); }
  __device__ __forceinline__ float At(int e) const {
    return gpu::LoadOne(reinterpret_cast<const T*>(&raw) + e);
  }
};

// max |x| of each of a unit's 8 columns over a thread's loads (NaN counted as 0, as
// block_1d's MaxAbs). Raw 16-bit values stay packed (AccumulateAbsMax keeps the two
// columns of a pair apart; the max of bf16/f16 values is exact): converting every value
// twice, here and when quantizing, took the bf16 kernel past 64 registers (spills).
template <typename T, bool kRaw>
__device__ __forceinline__ void ColumnAmax(const CopyUnit<T, kRaw> (&values)[kBlocksCopyLoads],
                                           float (&amax)[8]) {
  if constexpr (kRaw) {
    AbsMaxLane<T> lanes[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) Zero(lanes[i]);
#pragma unroll
    for (int l = 0; l < kBlocksCopyLoads; ++l) AccumulateAbsMax(values[l].raw, lanes);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      amax[2 * i] = __low2float(lanes[i]);
      amax[2 * i + 1] = __high2float(lanes[i]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      amax[e] = 0.0f;
#pragma unroll
      for (int l = 0; l < kBlocksCopyLoads; ++l) amax[e] = gpu::MaxAbs(amax[e], values[l].At(e));
    }
  }
}

// Zeros columns [lo, hi) (multiples of 16, inside the storage block [begin, end)) of the
// copy rows k0 .. k0 + tile_cols - 1: 16-byte stores, consecutive threads along a row.
__device__ __forceinline__ void ZeroCopyColumns(uint8_t* data, int64_t cols, int64_t begin,
                                                int64_t end, int64_t lo, int64_t hi, int64_t k0,
                                                int tile_cols) {
  if (lo >= hi) return;
  const int64_t chunks = (hi - lo) / 16;
  const int64_t items = chunks * tile_cols;
  for (int64_t i = threadIdx.x; i < items; i += kBlocksCopyThreads) {
    const int64_t c = i / chunks, q = i % chunks;
    *reinterpret_cast<uint4*>(data + ColumnwiseIndex(cols, begin, end, k0 + c, lo + 16 * q)) =
        make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ void WriteUnitScales(float* scale_row, int tile_cols) {
  for (int c = threadIdx.x; c < tile_cols; c += kBlocksCopyThreads) scale_row[c] = 1.0f;
}

// Row (within the block) of a thread's load j: rows 4 q .. 4 q + 3 and 64 + 4 q .. + 3 for
// the thread's quad q = threadIdx.x / 16, so four consecutive rows' bytes of a column pack
// into one word; a warp's load j still reads two whole 256-byte rows.
__device__ __forceinline__ int CopyRowOfLoad(int j) {
  return 4 * (static_cast<int>(threadIdx.x) / kBlocksCopyUnits) + j % 4 + 64 * (j / 4);
}

template <typename T, bool kRaw>
__global__ void __launch_bounds__(kBlocksCopyThreads, kRaw ? 4 : 2)
QuantizeColumnwiseBlocksKernel(const T* __restrict__ x, const int32_t* __restrict__ offsets,
                               int groups, int64_t rows, int64_t cols, int64_t width,
                               bool vector, Fp8Format format, uint8_t* __restrict__ data,
                               float* __restrict__ scale_inv) {
  extern __shared__ int32_t clamped[];  // [groups + 1]
  __shared__ __align__(16) uint8_t tile[kBlocksCopyCols * kBlocksCopyPitch];
  __shared__ float warp_amax[kBlocksCopyThreads / 32][kBlocksCopyCols];
  __shared__ float column_scale[kBlocksCopyCols];
  constexpr int64_t kBlock = kColumnwiseScaleBlock;
  ClampedOffsetsToShared(offsets, groups + 1, rows, clamped);
  const int64_t slot = blockIdx.x;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * kBlocksCopyCols;
  const int tile_cols = static_cast<int>(min(static_cast<int64_t>(kBlocksCopyCols), cols - k0));
  float* scale_row = scale_inv + slot * cols + k0;
  const int64_t first_slot = ColumnwiseScaleRow(clamped[0], 0);
  if (slot < first_slot) {  // a slot before group 0's rows: 128 columns of [0, start_0)
    WriteUnitScales(scale_row, tile_cols);
    ZeroCopyColumns(data, cols, 0, ColumnwiseStart(clamped[1], 1), kBlock * slot,
                    kBlock * (slot + 1), k0, tile_cols);
    return;
  }
  int g = 0, hi = groups - 1;  // the last group whose first scale row is <= slot
  while (g < hi) {
    const int mid = (g + hi + 1) / 2;
    if (ColumnwiseScaleRow(clamped[mid], mid) <= slot) {
      g = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t c_g = clamped[g], c_next = clamped[g + 1];
  const int64_t j = slot - ColumnwiseScaleRow(c_g, g);
  const int64_t blocks = ColumnwiseScaleBlocks(c_next - c_g);
  const int64_t begin = ColumnwiseBlockBegin(c_g, g);
  const int64_t start = ColumnwiseStart(c_g, g), end = ColumnwiseStart(c_next, g + 1);
  if (slot == first_slot) {  // the rest of [0, start_0) (g is 0)
    ZeroCopyColumns(data, cols, 0, end, kBlock * first_slot, start, k0, tile_cols);
  }
  if (j >= blocks) {  // no block's slot
    WriteUnitScales(scale_row, tile_cols);
    if (j == 0) ZeroCopyColumns(data, cols, begin, end, start, end, k0, tile_cols);  // empty g
    const int64_t tail_chunk = j - max(blocks, int64_t{1});
    if (g == groups - 1 && tail_chunk >= 0) {  // block G: [end, width)
      const int64_t lo = end + kBlock * tail_chunk;
      ZeroCopyColumns(data, cols, end, width, lo, min(width, lo + kBlock), k0, tile_cols);
    }
    return;
  }
  // Block j of group g: rows r0 .. r0 + n - 1, columns k0 .. k0 + tile_cols - 1 of x.
  const int64_t r0 = c_g + kBlock * j;
  const int n = static_cast<int>(min(kBlock, c_next - r0));
  const int u = threadIdx.x % kBlocksCopyUnits;
  const int64_t col = k0 + u * gpu::kUnit;
  const int valid = static_cast<int>(max(int64_t{0}, min(int64_t{8}, cols - col)));
  CopyUnit<T, kRaw> values[kBlocksCopyLoads];
#pragma unroll
  for (int l = 0; l < kBlocksCopyLoads; ++l) {  // every load issued before any math
    const int row = CopyRowOfLoad(l);
    if (row < n && valid > 0) {
      values[l].Load(x + (r0 + row) * cols + col, vector, valid);
    } else {
      values[l].Zero();
    }
  }
  // Each column's amax: the thread's 8 rows, the other quad of the warp (lane ^ 16 holds
  // the same unit), then the 8 warps through shared memory. MaxAbs drops NaN, as
  // block_1d's reduction does.
  float amax[8];
  ColumnAmax(values, amax);
#pragma unroll
  for (int e = 0; e < 8; ++e) amax[e] = fmaxf(amax[e], __shfl_xor_sync(0xffffffffu, amax[e], 16));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane < 16) {
#pragma unroll
    for (int e = 0; e < 8; ++e) warp_amax[warp][u * 8 + e] = amax[e];
  }
  __syncthreads();
  if (threadIdx.x < kBlocksCopyCols) {
    float reduced = warp_amax[0][threadIdx.x];
#pragma unroll
    for (int w = 1; w < kBlocksCopyThreads / 32; ++w) {
      reduced = fmaxf(reduced, warp_amax[w][threadIdx.x]);
    }
    const float scale = ScaleFromAmax(reduced, Fp8Max(format));
    column_scale[threadIdx.x] = scale;
    if (static_cast<int>(threadIdx.x) < tile_cols) scale_row[threadIdx.x] = 1.0f / scale;
  }
  __syncthreads();
  // Quantize (block_1d's product and rounding) into the staged rows: a column's 4
  // consecutive rows as one word. Rows past n and columns past C hold zeros (never stored
  // past the run's last chunk).
  const int quad = threadIdx.x / kBlocksCopyUnits;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float scale = column_scale[u * 8 + e];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const CopyUnit<T, kRaw>* v = values + 4 * half;
      const uint32_t low = gpu::Fp8x2(v[0].At(e) * scale, v[1].At(e) * scale, format);
      const uint32_t high = gpu::Fp8x2(v[2].At(e) * scale, v[3].At(e) * scale, format);
      *reinterpret_cast<uint32_t*>(tile + (u * 8 + e) * kBlocksCopyPitch + 64 * half +
                                   4 * quad) = low | (high << 16);
    }
  }
  __syncthreads();
  // Store phase: column c's run of the block's rows from column start + 128 j of the copy,
  // ceil(n / 16) 16-byte chunks (its last chunk's bytes past n are the staged zeros, inside
  // the group's padding: the run's end is a multiple of 16 no later than `end`).
  constexpr int kChunks = kColumnwiseScaleBlock / 16;
  const int chunks = (n + 15) / 16;
  const int64_t run = start + kBlock * j;
  for (int i = threadIdx.x; i < kBlocksCopyCols * kChunks; i += kBlocksCopyThreads) {
    const int c = i / kChunks, q = i % kChunks;
    if (c >= tile_cols || q >= chunks) continue;
    const uint32_t* src =
        reinterpret_cast<const uint32_t*>(tile + c * kBlocksCopyPitch + 16 * q);
    *reinterpret_cast<uint4*>(data + ColumnwiseIndex(cols, begin, end, k0 + c, run + 16 * q)) =
        make_uint4(src[0], src[1], src[2], src[3]);
  }
  if (j == blocks - 1) {  // the group's padding after its rows, up to the next block
    ZeroCopyColumns(data, cols, begin, end, run + 16 * chunks, end, k0, tile_cols);
  }
}

// The aligned 16-bit kernel (raw registers) for bf16/f16 x with C % 8 == 0, 16-byte
// aligned; the float one otherwise. Needs data 16-byte aligned (XLA's buffers are).
ffi::Error QuantizeColumnwiseBlocksCuda(cudaStream_t stream, ffi::AnyBuffer x,
                                        ffi::AnyBuffer offsets,
                                        ffi::Result<ffi::AnyBuffer> data,
                                        ffi::Result<ffi::AnyBuffer> scale_inv) {
  ColumnwiseBlocksProblem problem;
  if (auto error = ParseQuantizeColumnwiseBlocks(x, offsets, *data, *scale_inv, &problem);
      error.failure()) {
    return error;
  }
  if (problem.cols == 0) return ffi::Error::Success();  // data and scale_inv are empty
  uint8_t* pdata = static_cast<uint8_t*>(data->untyped_data());
  if (!PointerAligned16(pdata)) {
    return InvalidArgument("quantize_columnwise_blocks: data must be 16-byte aligned");
  }
  const int64_t column_tiles = CeilDiv(problem.cols, kBlocksCopyCols);
  if (column_tiles > 65535 || problem.scale_rows > (int64_t{1} << 31) - 1) {
    return InvalidArgument("quantize_columnwise_blocks: C = ", problem.cols, " exceeds ",
                           int64_t{65535} * kBlocksCopyCols, " or M = ", problem.rows,
                           " is too large");
  }
  const dim3 grid(static_cast<unsigned>(problem.scale_rows),
                  static_cast<unsigned>(column_tiles));
  const size_t shared = static_cast<size_t>(problem.groups + 1) * sizeof(int32_t);
  return gpu::DispatchFloat(x.element_type(), [&](auto zero) -> ffi::Error {
    using T = decltype(zero);
    const T* px = static_cast<const T*>(x.untyped_data());
    const bool vector = problem.cols % gpu::kUnit == 0 && PointerAligned16(px);
    const int32_t* poffsets = offsets.typed_data<int32_t>();
    float* pscale_inv = static_cast<float*>(scale_inv->untyped_data());
    const int groups = static_cast<int>(problem.groups);
    if constexpr (sizeof(T) == 2) {
      if (vector) {
        QuantizeColumnwiseBlocksKernel<T, true><<<grid, kBlocksCopyThreads, shared, stream>>>(
            px, poffsets, groups, problem.rows, problem.cols, problem.width, vector,
            problem.format, pdata, pscale_inv);
        return gpu::LaunchError("blockwise column-wise quantization kernel");
      }
    }
    QuantizeColumnwiseBlocksKernel<T, false><<<grid, kBlocksCopyThreads, shared, stream>>>(
        px, poffsets, groups, problem.rows, problem.cols, problem.width, vector,
        problem.format, pdata, pscale_inv);
    return gpu::LaunchError("blockwise column-wise quantization kernel");
  });
}

}  // namespace
}  // namespace jaxfuse

namespace xffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseQuantizeCuda, jaxfuse::QuantizeCuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()  // x [..., K]
                                  .Arg<xffi::AnyBuffer>()  // group offsets int32 [G + 1]
                                  .Ret<xffi::AnyBuffer>()  // data fp8
                                  .Ret<xffi::AnyBuffer>()  // scale_inv
                                  .Ret<xffi::AnyBuffer>()  // amax float32 (scratch)
                                  .Ret<xffi::AnyBuffer>()  // columnwise FP8 [K, W] or [0]
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("block"),
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseQuantizeGatheredCuda, jaxfuse::QuantizeGatheredCuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()  // x [T, K]
                                  .Arg<xffi::AnyBuffer>()  // source_rows int32 [M]
                                  .Arg<xffi::AnyBuffer>()  // group offsets int32 [G + 1]
                                  .Arg<xffi::AnyBuffer>()  // group amax float32 [G] (given)
                                  .Ret<xffi::AnyBuffer>()  // data fp8 [M, K]
                                  .Ret<xffi::AnyBuffer>()  // scale_inv float32 [G]
                                  .Ret<xffi::AnyBuffer>(),  // columnwise FP8 [K, W] or [0]
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseQuantizeTransposedCuda, jaxfuse::QuantizeTransposedCuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()  // x [B, R, C]
                                  .Arg<xffi::AnyBuffer>()  // amax float32 [B] (given)
                                  .Ret<xffi::AnyBuffer>()  // data fp8 [B, C, R]
                                  .Ret<xffi::AnyBuffer>()  // scale_inv float32 [B]
                                  .Ret<xffi::AnyBuffer>(), // data_untransposed [B, R, C] or [0]
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseQuantizeBatchesTransposedCuda,
                              jaxfuse::QuantizeBatchesTransposedCuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()   // x [B, R, C]
                                  .Ret<xffi::AnyBuffer>()   // data fp8 [B, C, R]
                                  .Ret<xffi::AnyBuffer>()   // scale_inv float32 [B]
                                  .Ret<xffi::AnyBuffer>()   // data_untransposed [B, R, C] or [0]
                                  .Ret<xffi::AnyBuffer>(),  // scratch uint32 [2, B]
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseQuantizeBlocksTransposedCuda,
                              jaxfuse::QuantizeBlocksTransposedCuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()  // x [B, R, C]
                                  .Ret<xffi::AnyBuffer>()  // data fp8 [B, C, R]
                                  .Ret<xffi::AnyBuffer>()  // scale_inv f32 [B, R/128, C/128]
                                  .Ret<xffi::AnyBuffer>(), // data_untransposed [B, R, C] or [0]
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseQuantizeColumnwiseBlocksCuda,
                              jaxfuse::QuantizeColumnwiseBlocksCuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()   // x [M, C], rows grouped
                                  .Arg<xffi::AnyBuffer>()   // group offsets int32 [G + 1]
                                  .Ret<xffi::AnyBuffer>()   // data FP8 [C, ColumnwiseWidth(M, G)]
                                  .Ret<xffi::AnyBuffer>(),  // scale_inv f32 [S(M, G), C]
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseBatchAmaxCuda, jaxfuse::BatchAmaxCuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()   // x [B, R, C]
                                  .Ret<xffi::AnyBuffer>(),  // amax float32 [B]
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseScaledActivationQuantizeCuda,
                              jaxfuse::ActivationQuantizeCuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()  // x [R, W]
                                  .Arg<xffi::AnyBuffer>()  // scales [R]
                                  .Arg<xffi::AnyBuffer>()  // group offsets int32 [G + 1]
                                  .Ret<xffi::AnyBuffer>()  // data fp8 [R, F]
                                  .Ret<xffi::AnyBuffer>()  // scale_inv
                                  .Ret<xffi::AnyBuffer>()  // amax float32 (scratch)
                                  .Ret<xffi::AnyBuffer>()  // columnwise FP8 [K, W] or [0]
                                  .Attr<int32_t>("activation")
                                  .Attr<float>("limit")
                                  .Attr<float>("alpha")
                                  .Attr<float>("linear_offset")
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("block"),
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseScaledDactivationQuantizeCuda,
                              jaxfuse::DactivationQuantizeCuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()  // dy [R, F]
                                  .Arg<xffi::AnyBuffer>()  // x [R, W]
                                  .Arg<xffi::AnyBuffer>()  // scales [R]
                                  .Arg<xffi::AnyBuffer>()  // group offsets int32 [G + 1]
                                  .Ret<xffi::AnyBuffer>()  // data fp8 [R, W]
                                  .Ret<xffi::AnyBuffer>()  // scale_inv
                                  .Ret<xffi::AnyBuffer>()  // dx [R, W] or [0]
                                  .Ret<xffi::AnyBuffer>()  // dscales float32 [R]
                                  .Ret<xffi::AnyBuffer>()  // amax float32 (scratch)
                                  .Ret<xffi::AnyBuffer>()  // columnwise FP8 [K, W] or [0]
                                  .Attr<int32_t>("activation")
                                  .Attr<float>("limit")
                                  .Attr<float>("alpha")
                                  .Attr<float>("linear_offset")
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("block"),
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupColumnwiseCuda, jaxfuse::ColumnwiseCuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()   // data FP8 [M, K], rows grouped
                                  .Arg<xffi::AnyBuffer>()   // group offsets int32 [G + 1]
                                  .Ret<xffi::AnyBuffer>(),  // out FP8 [K, ColumnwiseWidth(M, G)]
                              {xffi::Traits::kCmdBufferCompatible});
