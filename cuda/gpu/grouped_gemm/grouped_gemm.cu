// jaxfuse grouped GEMM: dispatch, workspace layout, setup kernel and zeroing kernels.
// No CUTLASS header here (compiles in seconds); the CUTLASS kernels live in gemm_*.cu.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <string>

#include "internal.cuh"
#include "jaxfuse/columnwise.h"
#include "jaxfuse/grouped_gemm.h"

namespace jaxfuse::grouped_gemm {
namespace {

using detail::GemmArrays;

constexpr size_t kAlign = 256;
// Threads per block of SetupKernel. Block 0 writes the setup arrays; the other blocks zero
// what the GEMM does not write. 256 rather than 1024: block 0's scans synchronize fewer
// warps, and one wave of 256-thread blocks still zeroes at full bandwidth.
constexpr int kSetupThreads = 256;
// Up to this many groups (G + 1 offsets in one warp's lanes), one warp of block 0 writes
// the setup arrays with shuffles only, no block barrier.
constexpr int kWarpSetupMaxGroups = 31;
// 16-bit wgrad with at most this many rows per group (m / G) runs the ping-pong kSmall
// config (see ChooseTileConfig); up to the second bound when kLarge's cluster pairs would
// leave a CTA idle and kSmall's would not.
constexpr int64_t kWgradPingPongMaxRows = 1024;
constexpr int64_t kWgradOddRowTilesPingPongMaxRows = 2048;

// Problems up to this many multiply-adds (m * n * k, m the static row count) launch their
// CUTLASS kernel as a programmatic dependent of the setup kernel (JAXFUSE_GROUPED_GEMM_PDL
// overrides). Measured on H100s (bench_grouped_mlp, alternating processes, sessions 35-38):
// the T=2048 grouped MLP (GEMMs of 2^31-2^32 MACs, ~20-30 us each) runs 0.197-0.199 ms
// fwd+bwd with it against 0.204-0.205 without; the T=65536 one (2^39 MACs per GEMM)
// 7.99 against 7.87-7.88 ms, so large problems launch plainly.
constexpr int64_t kProgrammaticLaunchMaxMacs = int64_t{1} << 34;

size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

bool Is16Bit(ElementType t) { return t == ElementType::kBF16 || t == ElementType::kF16; }
bool IsFp8(ElementType t) {
  return t == ElementType::kFloat8E4M3 || t == ElementType::kFloat8E5M2;
}
int ElementBytes(ElementType t) { return Is16Bit(t) ? 2 : 1; }

using WorkspaceFn = size_t (*)(TileConfig, int, int);
using RunFn = cudaError_t (*)(TileConfig, const GemmArrays&, int, cudaStream_t);
using GranularityFn = int (*)();
// The kUniform kernel of a family (null members when it has none).
struct UniformKernel {
  WorkspaceFn workspace = nullptr;
  RunFn run = nullptr;
  GranularityFn row_granularity = nullptr;
};
struct Family {
  WorkspaceFn workspace = nullptr;
  RunFn run = nullptr;
  bool has_alpha = false;
  UniformKernel uniform;
};

#define JAXFUSE_GG_FAMILY(NAME, ALPHA) \
  Family { &detail::NAME##_WorkspaceBytes, &detail::NAME##_Run, ALPHA, {} }
#define JAXFUSE_GG_FAMILY_WITH_UNIFORM(NAME)                                           \
  Family {                                                                             \
    &detail::NAME##_WorkspaceBytes, &detail::NAME##_Run, false, {                      \
      &detail::NAME##Uniform_WorkspaceBytes, &detail::NAME##Uniform_Run,               \
          &detail::NAME##Uniform_RowGranularity                                        \
    }                                                                                  \
  }

// The kernel family for a problem (types/form only), or a null family when unsupported.
Family PickFamily(const Problem& p) {
  if (p.gated != nullptr) {  // bf16 forward only (GatedEpilogue)
    const bool bf16 = p.a_type == ElementType::kBF16 && p.b_type == ElementType::kBF16 &&
                      p.out_type == ElementType::kBF16;
    if (!bf16 || p.form != Form::kForward || p.fast_accumulation || p.block_scaling ||
        p.columnwise) {
      return {};
    }
    return JAXFUSE_GG_FAMILY(Bf16FwdGated, false);
  }
  if (Is16Bit(p.a_type)) {
    if (p.b_type != p.a_type || p.out_type != p.a_type || p.fast_accumulation) return {};
    const bool bf16 = p.a_type == ElementType::kBF16;
    switch (p.form) {
      case Form::kForward:
        return bf16 ? JAXFUSE_GG_FAMILY_WITH_UNIFORM(Bf16Fwd) : JAXFUSE_GG_FAMILY(F16Fwd, false);
      case Form::kDgrad:
        return bf16 ? JAXFUSE_GG_FAMILY_WITH_UNIFORM(Bf16Dgrad)
                    : JAXFUSE_GG_FAMILY(F16Dgrad, false);
      case Form::kWgrad:
        return bf16 ? JAXFUSE_GG_FAMILY(Bf16Wgrad, false) : JAXFUSE_GG_FAMILY(F16Wgrad, false);
    }
    return {};
  }
  if (IsFp8(p.a_type)) {
    if (p.out_type != ElementType::kBF16) return {};
    if (p.block_scaling) {
      if (p.fast_accumulation) return {};
      if (p.form == Form::kWgrad) {
        // x^T e4m3 x dy^T (gradient format) from the column-wise copies, 128 x 1 blocks.
        if (!p.columnwise || p.a_type != ElementType::kFloat8E4M3) return {};
        return p.b_type == ElementType::kFloat8E5M2
                   ? JAXFUSE_GG_FAMILY(Fp8BlockWgradE4m3E5m2, false)
                   : JAXFUSE_GG_FAMILY(Fp8BlockWgradE4m3E4m3, false);
      }
      // Forward (e4m3 x) and dgrad (e4m3 or e5m2 dy) against the e4m3 weight; the scales
      // live in the mainloop, so no alpha.
      if (p.columnwise || p.b_type != ElementType::kFloat8E4M3) return {};
      if (p.form == Form::kForward && p.a_type != ElementType::kFloat8E4M3) return {};
      return p.a_type == ElementType::kFloat8E5M2 ? JAXFUSE_GG_FAMILY(Fp8BlockE5m2E4m3, false)
                                                  : JAXFUSE_GG_FAMILY(Fp8BlockE4m3E4m3, false);
    }
    if (p.form == Form::kWgrad) {
      // FP8 wgrad reads the column-wise copies (jaxfuse/columnwise.h): A = x^T e4m3,
      // B = dy^T in the gradient format; both K-major, so the forward's layouts.
      if (!p.columnwise || p.a_type != ElementType::kFloat8E4M3 || p.fast_accumulation) {
        return {};
      }
      return p.b_type == ElementType::kFloat8E5M2 ? JAXFUSE_GG_FAMILY(Fp8E4m3E5m2, true)
                                                  : JAXFUSE_GG_FAMILY(Fp8E4m3E4m3, true);
    }
    // Forward and dgrad: A e4m3 or e5m2 (gradient operand), B e4m3.
    if (p.b_type != ElementType::kFloat8E4M3 || p.columnwise) return {};
    const bool e4m3 = p.a_type == ElementType::kFloat8E4M3;
    if (p.fast_accumulation) {
      // Only the forward (E4M3 activations) accumulates fast; gradients keep the promoted
      // mainloop, as in TransformerEngine.
      if (p.form != Form::kForward || !e4m3) return {};
      return JAXFUSE_GG_FAMILY(Fp8E4m3FastAccum, true);
    }
    return e4m3 ? JAXFUSE_GG_FAMILY(Fp8E4m3E4m3, true) : JAXFUSE_GG_FAMILY(Fp8E5m2E4m3, true);
  }
  return {};
}
#undef JAXFUSE_GG_FAMILY
#undef JAXFUSE_GG_FAMILY_WITH_UNIFORM

bool Aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Workspace layout (offsets from the 256-aligned base).
// kAdaptive adds a second shapes array and the kUniform kernel's own CUTLASS workspace.
struct Layout {
  size_t offsets, shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, alpha, alpha_ptrs;
  size_t ptr_sfa, ptr_sfb;  // blockwise FP8 scale pointers
  size_t cutlass, cutlass_bytes;
  size_t shapes_uniform = 0, cutlass_uniform = 0, cutlass_uniform_bytes = 0;
  size_t total;
};

Layout MakeLayout(const Problem& p, const Family& family, TileConfig config, int sm_count) {
  const size_t g = static_cast<size_t>(p.num_groups);
  Layout l{};
  size_t at = 0;
  auto take = [&](size_t bytes) {
    size_t here = at;
    at = AlignUp(at + bytes);
    return here;
  };
  l.offsets = take((g + 1) * sizeof(int64_t));
  l.shapes = take(g * 3 * sizeof(int32_t));
  l.ptr_a = take(g * sizeof(void*));
  l.ptr_b = take(g * sizeof(void*));
  l.ptr_d = take(g * sizeof(void*));
  l.stride_a = take(g * sizeof(int64_t));
  l.stride_b = take(g * sizeof(int64_t));
  l.stride_d = take(g * sizeof(int64_t));
  l.alpha = take(g * sizeof(float));
  l.alpha_ptrs = take(g * sizeof(float*));
  l.ptr_sfa = take(g * sizeof(float*));
  l.ptr_sfb = take(g * sizeof(float*));
  // The first (or only) kernel: kLarge for kAdaptive, the kUniform kernel for kUniform.
  l.cutlass_bytes = config == TileConfig::kUniform
                        ? family.uniform.workspace(config, p.num_groups, sm_count)
                        : family.workspace(config == TileConfig::kAdaptive ? TileConfig::kLarge
                                                                           : config,
                                           p.num_groups, sm_count);
  l.cutlass = take(l.cutlass_bytes);
  if (config == TileConfig::kAdaptive) {
    l.shapes_uniform = take(g * 3 * sizeof(int32_t));
    l.cutlass_uniform_bytes = family.uniform.workspace(config, p.num_groups, sm_count);
    l.cutlass_uniform = take(l.cutlass_uniform_bytes);
  }
  l.total = at + kAlign;  // slack so that an unaligned base can be aligned up
  return l;
}

// ------------------------------------------------------------------------------------------
// Device code.

struct SetupParams {
  int form;  // 0 forward, 1 dgrad, 2 wgrad
  int num_groups;
  int64_t m, k, n;
  const int32_t* offsets;
  const char* a;
  const char* b;
  char* out;
  int a_bytes, b_bytes, out_bytes;
  bool b_k_major_forward;  // FP8 forward: b = w^T [G, n, k]
  bool columnwise;  // FP8 wgrad: a = x^T, b = dy^T, the blocked column-wise copies (columnwise.h)
  const float* a_scale_inv;
  const float* b_scale_inv;
  // Outputs (workspace).
  int64_t* clamped;  // [G+1]: offsets clamped to [0, m], running max (non-decreasing)
  int32_t* shapes;   // [G][3]
  const void** ptr_a;
  const void** ptr_b;
  void** ptr_d;
  int64_t* stride_a;
  int64_t* stride_b;
  int64_t* stride_d;
  float* alpha;
  const float** alpha_ptrs;
  // Blockwise FP8 (block_scaling): each group's scale pointers (nullptr otherwise), and the
  // scale counts per row of a (contraction blocks) and per expert of b (tiles); the wgrad
  // (columnwise) instead per scale row of x^T (k) and of dy^T (n), from the group's first
  // scale row (ColumnwiseScaleRow).
  const float** ptr_sfa;
  const float** ptr_sfb;
  int64_t sfa_per_row;
  int64_t sfb_per_group;
  // kAdaptive (forward/dgrad): shapes of the kUniform launch (nullptr otherwise), its row
  // granularity and the large kernel's (CTA tile M).
  int32_t* shapes_uniform;
  int uniform_rows;
  int large_rows;
  // kAdaptive: output column tiles (both kernels tile N by 256). kUniform's 2x1 cluster
  // spends that many slots on a row of tiles; kLarge's 1x2 cluster rounds an odd count up
  // (one idle CTA per row of tiles, e.g. 11 -> 12 at n = 2816).
  int col_tiles;
};

// kAdaptive: the kUniform kernel takes every tile when it computes at most 1/64 more tile
// slots than the large kernel (ragged sizes leave part of its M-blocks empty, an odd
// column-tile count part of kLarge's N-blocks); its gain on sizes it fits is 2-4% (README).
constexpr int64_t kUniformMaxExtraSlotsPer = 64;

__device__ __forceinline__ int64_t ClampRow(int32_t offset, int64_t m) {
  const int64_t v = offset;
  return v < 0 ? 0 : (v > m ? m : v);
}

// kAdaptive's rule, in three pieces shared by the block and the one-warp setup: the 128-row
// tile slots each kernel spends on a group, their sum over a warp, and the verdict.
struct TileSlots {
  unsigned long long large = 0, uniform = 0;
};

__device__ __forceinline__ void AddGroupSlots(const SetupParams& p, int64_t rows,
                                              TileSlots& slots) {
  slots.large += (rows + p.large_rows - 1) / p.large_rows;
  slots.uniform += (rows + p.uniform_rows - 1) / p.uniform_rows * (p.uniform_rows / p.large_rows);
}

__device__ __forceinline__ TileSlots WarpSumSlots(TileSlots slots) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    slots.large += __shfl_xor_sync(0xffffffffu, slots.large, offset);
    slots.uniform += __shfl_xor_sync(0xffffffffu, slots.uniform, offset);
  }
  return slots;
}

// `total` counts 128-row slots; each row slot holds the kernel's column-tile slots.
__device__ __forceinline__ bool UniformSlotsFit(const SetupParams& p, const TileSlots& total) {
  const int64_t large_col_slots = (p.col_tiles + 1) / 2 * 2;
  return total.uniform * p.col_tiles * kUniformMaxExtraSlotsPer <=
         total.large * large_col_slots * (kUniformMaxExtraSlotsPer + 1);
}

// kAdaptive: whether the kUniform kernel wastes at most 1/kUniformMaxExtraSlotsPer more
// 128-row tile slots than the large kernel on the clamped sizes (p.clamped, written by this
// block). Call it uniformly across the block.
__device__ bool UniformFits(const SetupParams& p) {
  __shared__ unsigned long long slots[2];  // large, uniform
  if (threadIdx.x == 0) slots[0] = slots[1] = 0;
  __syncthreads();
  TileSlots mine;
  for (int g = threadIdx.x; g < p.num_groups; g += blockDim.x) {
    AddGroupSlots(p, p.clamped[g + 1] - p.clamped[g], mine);
  }
  // Warp sums first: 1024 threads' atomics on one shared word serialize (measured: the
  // setup launch took 8-16 us instead of 3-4 us).
  mine = WarpSumSlots(mine);
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&slots[0], mine.large);
    atomicAdd(&slots[1], mine.uniform);
  }
  __syncthreads();
  TileSlots total;
  total.large = slots[0];
  total.uniform = slots[1];
  __syncthreads();
  return UniformSlotsFit(p, total);
}

// UniformFits for one warp holding every group (num_groups <= 31): lane g's rows. Call it
// from every lane of the warp.
__device__ bool UniformFitsWarp(const SetupParams& p, int64_t rows) {
  TileSlots mine;
  if (static_cast<int>(threadIdx.x & 31) < p.num_groups) AddGroupSlots(p, rows, mine);
  return UniformSlotsFit(p, WarpSumSlots(mine));
}

// Group g's shape, pointers, strides and alpha, from its clamped row range [lo, hi).
// `uniform` (kAdaptive): the kUniform launch gets the rows.
__device__ __forceinline__ void WriteGroup(const SetupParams& p, int g, int64_t lo, int64_t hi,
                                           bool uniform) {
  const int32_t rows = static_cast<int32_t>(hi - lo);
  int32_t* shape = p.shapes + 3 * g;
  if (p.shapes_uniform != nullptr) {  // kAdaptive: one launch gets the rows, the other none
    int32_t* other = p.shapes_uniform + 3 * g;
    if (uniform) {
      int32_t* swap = shape;
      shape = other;
      other = swap;
    }
    other[0] = 0;
    other[1] = static_cast<int32_t>(p.form == 0 ? p.n : p.k);
    other[2] = static_cast<int32_t>(p.form == 0 ? p.k : p.n);
  }
  const int64_t weight = static_cast<int64_t>(g) * p.k * p.n;  // w[g] / dw[g] element offset
  if (p.form == 0) {  // forward: (rows, n, k)
    shape[0] = rows;
    shape[1] = static_cast<int32_t>(p.n);
    shape[2] = static_cast<int32_t>(p.k);
    p.ptr_a[g] = p.a + lo * p.k * p.a_bytes;
    p.stride_a[g] = p.k;
    p.ptr_b[g] = p.b + weight * p.b_bytes;
    p.stride_b[g] = p.b_k_major_forward ? p.k : p.n;
    p.ptr_d[g] = p.out + lo * p.n * p.out_bytes;
    p.stride_d[g] = p.n;
  } else if (p.form == 1) {  // dgrad: (rows, k, n)
    shape[0] = rows;
    shape[1] = static_cast<int32_t>(p.k);
    shape[2] = static_cast<int32_t>(p.n);
    p.ptr_a[g] = p.a + lo * p.n * p.a_bytes;
    p.stride_a[g] = p.n;
    p.ptr_b[g] = p.b + weight * p.b_bytes;
    p.stride_b[g] = p.n;
    p.ptr_d[g] = p.out + lo * p.k * p.out_bytes;
    p.stride_d[g] = p.k;
  } else {  // wgrad: (k, n, rows); an empty group gets no tiles (SetupKernel zeroes it)
    shape[0] = rows > 0 ? static_cast<int32_t>(p.k) : 0;
    shape[1] = rows > 0 ? static_cast<int32_t>(p.n) : 0;
    shape[2] = rows;
    if (p.columnwise) {  // K-major copies: group g's storage block (columnwise.h)
      const int64_t start = ColumnwiseStart(lo, g);
      const int64_t begin = ColumnwiseBlockBegin(lo, g), end = ColumnwiseStart(hi, g + 1);
      p.ptr_a[g] = p.a + ColumnwiseIndex(p.k, begin, end, 0, start) * p.a_bytes;
      p.stride_a[g] = end - begin;
      p.ptr_b[g] = p.b + ColumnwiseIndex(p.n, begin, end, 0, start) * p.b_bytes;
      p.stride_b[g] = end - begin;
    } else {
      p.ptr_a[g] = p.a + lo * p.k * p.a_bytes;
      p.stride_a[g] = p.k;
      p.ptr_b[g] = p.b + lo * p.n * p.b_bytes;
      p.stride_b[g] = p.n;
    }
    p.ptr_d[g] = p.out + weight * p.out_bytes;
    p.stride_d[g] = p.n;
  }
  if (p.ptr_sfa != nullptr && p.columnwise) {  // blockwise wgrad: [blocks_g, k] / [blocks_g, n]
    const int64_t scale_row = ColumnwiseScaleRow(lo, g);
    p.ptr_sfa[g] = p.a_scale_inv + scale_row * p.sfa_per_row;
    p.ptr_sfb[g] = p.b_scale_inv + scale_row * p.sfb_per_group;
  } else if (p.ptr_sfa != nullptr) {
    p.ptr_sfa[g] = p.a_scale_inv + lo * p.sfa_per_row;
    p.ptr_sfb[g] = p.b_scale_inv + g * p.sfb_per_group;
  }
  if (p.alpha != nullptr) {
    const float sa = p.a_scale_inv != nullptr ? p.a_scale_inv[g] : 1.0f;
    const float sb = p.b_scale_inv != nullptr ? p.b_scale_inv[g] : 1.0f;
    p.alpha[g] = sa * sb;
    p.alpha_ptrs[g] = p.alpha + g;
  }
}

// The whole block's work, any G. Pass 1: clamped[i] = max_{j <= i} clamp(offsets[j], 0, m)
// (block scan, chunked). Pass 2: per-group shapes, pointers, strides and alphas.
__device__ void WriteSetup(const SetupParams& p) {
  __shared__ int64_t warp_max[kSetupThreads / 32];
  __shared__ int64_t carry;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  if (tid == 0) carry = 0;
  __syncthreads();
  const int count = p.num_groups + 1;
  for (int base = 0; base < count; base += kSetupThreads) {
    const int i = base + tid;
    int64_t v = 0;
    if (i < count) v = ClampRow(p.offsets[i], p.m);
    // Inclusive max-scan within the warp.
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      int64_t u = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v = max(v, u);
    }
    if (lane == 31) warp_max[warp] = v;
    __syncthreads();
    if (warp == 0) {
      int64_t w = lane < kSetupThreads / 32 ? warp_max[lane] : 0;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        int64_t u = __shfl_up_sync(0xffffffffu, w, d);
        if (lane >= d) w = max(w, u);
      }
      if (lane < kSetupThreads / 32) warp_max[lane] = w;  // inclusive prefix over warps
    }
    __syncthreads();
    int64_t prefix = carry;
    if (warp > 0) prefix = max(prefix, warp_max[warp - 1]);
    v = max(v, prefix);
    if (i < count) p.clamped[i] = v;
    __syncthreads();  // everyone read `carry` and warp_max
    if (tid == kSetupThreads - 1) carry = v;
    __syncthreads();
  }
  // __syncthreads above also orders the global writes of `clamped` for this block.
  const bool uniform = p.shapes_uniform != nullptr && UniformFits(p);
  for (int g = tid; g < p.num_groups; g += kSetupThreads) {
    WriteGroup(p, g, p.clamped[g], p.clamped[g + 1], uniform);
  }
}

// WriteSetup for num_groups <= kWarpSetupMaxGroups, by one warp: lane i holds offset i, a
// max-scan by shuffles clamps it, and lane g writes group g. No block barrier and no read
// back of `clamped`, so the launch's critical path is a few dependent loads and stores.
__device__ void WriteSetupWarp(const SetupParams& p) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int count = p.num_groups + 1;
  int64_t v = lane < count ? ClampRow(p.offsets[lane], p.m) : 0;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v = max(v, u);
  }
  if (lane < count) p.clamped[lane] = v;
  const int64_t hi = __shfl_down_sync(0xffffffffu, v, 1);
  const bool uniform = p.shapes_uniform != nullptr && UniformFitsWarp(p, hi - v);
  if (lane < p.num_groups) WriteGroup(p, lane, v, hi, uniform);
}

// max_{j < count} clamp(offsets[j], 0, m), i.e. clamped[count - 1], reduced by the whole block
// and returned to every thread. Call it uniformly across the block.
__device__ int64_t ClampedMax(const int32_t* offsets, int count, int64_t m) {
  __shared__ int64_t warp_max[kSetupThreads / 32];
  int64_t v = 0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) v = max(v, ClampRow(offsets[i], m));
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, d));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = v;
  __syncthreads();
  int64_t result = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) result = max(result, warp_max[w]);
  __syncthreads();  // warp_max is reused by the next call
  return result;
}

// What the GEMM does not write, zeroed in the setup's launch (one launch fewer per GEMM):
// forward/dgrad: rows [0, clamped[0]) and [clamped[G], m) of the row-major [m, cols]
// output; wgrad: dw[g] of every group with no rows (the GEMM gives it no tiles). `units`:
// 16-byte units per output row (forward/dgrad) or per dw[g] (wgrad).
struct ZeroParams {
  uint4* out;
  int64_t units;
  // The gated forward's activation output [m, n / 2] (its uncovered rows too), or null.
  uint4* act_out = nullptr;
  int64_t act_units = 0;
};

// max_{j < count} clamp(offsets[j], 0, m) for count <= 32, by one warp with shuffles only
// (no block barrier); every lane gets it, and *first gets clamp(offsets[0], 0, m).
__device__ int64_t ClampedMaxWarp(const int32_t* offsets, int count, int64_t m, int64_t* first) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  int64_t v = lane < count ? ClampRow(offsets[lane], m) : 0;
  *first = __shfl_sync(0xffffffffu, v, 0);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, d));
  return v;
}

// Block (0, 0) writes the setup arrays: one warp when G <= kWarpSetupMaxGroups
// (WriteSetupWarp), else the whole block (WriteSetup). Every block zeroes a grid-stride
// share, with the clamped offsets it needs recomputed from the device offsets, so no block
// waits for another. For forward/dgrad with G + 1 <= 32 offsets every warp finds its bounds
// alone, so the zeroing warps of block 0 do not wait for its setup warp either.
__global__ void __launch_bounds__(kSetupThreads) SetupKernel(SetupParams p, ZeroParams z) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Where the GEMM that follows is launched as a programmatic dependent (small problems,
  // UseProgrammaticLaunch) it may start its CTAs now; it reads nothing before
  // griddepcontrol.wait, which returns once this grid is complete and its writes are
  // visible. (Without the launch attribute this is a no-op.)
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  const bool warp_setup = p.num_groups <= kWarpSetupMaxGroups;
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    if (!warp_setup) {
      WriteSetup(p);
    } else if (threadIdx.x < 32) {
      WriteSetupWarp(p);
    }
  }
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p.form != 2) {
    int64_t head = 0, tail = 0;  // clamped[0] and clamped[G]
    if (warp_setup) {
      tail = ClampedMaxWarp(p.offsets, p.num_groups + 1, p.m, &head);
    } else {
      head = ClampRow(p.offsets[0], p.m);
      tail = ClampedMax(p.offsets, p.num_groups + 1, p.m);
    }
    const int64_t head_end = head * z.units;
    const int64_t tail_begin = tail * z.units;
    const int64_t total = head_end + (p.m * z.units - tail_begin);
    for (int64_t i = first; i < total; i += stride) {
      z.out[i < head_end ? i : tail_begin + (i - head_end)] = zero;
    }
    if (z.act_out != nullptr) {
      const int64_t act_head_end = head * z.act_units;
      const int64_t act_tail_begin = tail * z.act_units;
      const int64_t act_total = act_head_end + (p.m * z.act_units - act_tail_begin);
      for (int64_t i = first; i < act_total; i += stride) {
        z.act_out[i < act_head_end ? i : act_tail_begin + (i - act_head_end)] = zero;
      }
    }
    return;
  }
  for (int g = blockIdx.y; g < p.num_groups; g += gridDim.y) {
    const int64_t before = ClampedMax(p.offsets, g + 1, p.m);  // clamped[g]
    if (max(before, ClampRow(p.offsets[g + 1], p.m)) != before) continue;  // g has rows
    uint4* dst = z.out + static_cast<int64_t>(g) * z.units;
    for (int64_t i = first; i < z.units; i += stride) dst[i] = zero;
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------
// Host API.

namespace detail {
TuningOptions& ActiveTuningOptions() {
  static TuningOptions options = [] {
    TuningOptions o;
    if (const char* raster = std::getenv("JAXFUSE_GROUPED_GEMM_RASTER")) {
      if (raster[0] == 'N' || raster[0] == 'n') o.raster = 'N';
      if (raster[0] == 'M' || raster[0] == 'm') o.raster = 'M';
    }
    if (const char* swizzle = std::getenv("JAXFUSE_GROUPED_GEMM_SWIZZLE")) {
      const int value = std::atoi(swizzle);
      if (value == 1 || value == 2 || value == 4 || value == 8) o.swizzle = value;
    }
    if (const char* tile = std::getenv("JAXFUSE_GROUPED_GEMM_TILE")) {
      const std::string value(tile);
      if (value == "large") o.tile = TileConfig::kLarge;
      if (value == "small") o.tile = TileConfig::kSmall;
      if (value == "uniform") o.tile = TileConfig::kUniform;
      if (value == "adaptive") o.tile = TileConfig::kAdaptive;
    }
    if (const char* mainloop = std::getenv("JAXFUSE_GROUPED_GEMM_FP8_MAINLOOP")) {
      const std::string value(mainloop);
      if (value == "stock") o.fp8_mainloop = 's';
      if (value == "pipelined") o.fp8_mainloop = 'p';
    }
    if (const char* pdl = std::getenv("JAXFUSE_GROUPED_GEMM_PDL")) {
      if (pdl[0] == '0') o.pdl = 0;
      if (pdl[0] == '1') o.pdl = 1;
    }
    if (const char* pair = std::getenv("JAXFUSE_GROUPED_GEMM_WGRAD_PAIR")) {
      o.wgrad_pair = pair[0] != '0';
    }
    if (const char* teams = std::getenv("JAXFUSE_GROUPED_GEMM_TEAMS")) {
      const int value = std::atoi(teams);
      if (value >= 1 && value <= 1024) o.teams = value;  // else the heuristic (TeamsFor)
    }
    if (const char* tensormaps = std::getenv("JAXFUSE_GROUPED_GEMM_TENSORMAPS")) {
      const std::string value(tensormaps);
      if (value == "prepared") o.prepared_tensormaps = true;
      if (value == "cutlass") o.prepared_tensormaps = false;
    }
    if (const char* stores = std::getenv("JAXFUSE_GROUPED_GEMM_GATED_STORES")) {
      const std::string value(stores);
      if (value == "tma") o.gated_tma_stores = true;
      if (value == "registers") o.gated_tma_stores = false;
    }
    return o;
  }();
  return options;
}
}  // namespace detail

bool IsSupported(const Problem& p) {
  if (p.num_groups < 1) return false;
  if (p.m < 0 || p.k < 0 || p.n < 0) return false;
  constexpr int64_t kMax = (int64_t{1} << 31) - 1;
  if (p.m > kMax || p.k > kMax || p.n > kMax) return false;
  if (p.columnwise && ColumnwiseWidth(p.m, p.num_groups) > kMax) return false;
  const Family family = PickFamily(p);
  if (family.run == nullptr) return false;
  // TMA: 16-byte aligned leading dimensions and group base addresses.
  const int64_t multiple = IsFp8(p.a_type) ? 16 : 8;
  if (p.k % multiple != 0 || p.n % multiple != 0) return false;
  if (!Aligned16(p.a) || !Aligned16(p.b) || !Aligned16(p.out)) return false;
  if (p.block_scaling && (p.a_scale_inv == nullptr || p.b_scale_inv == nullptr)) return false;
  if (p.gated != nullptr) {
    // 256-column tiles of 128 gate + 128 linear columns (gated_epilogue.cuh).
    if (p.n % 256 != 0 || !IsGlu(p.gated->activation.kind)) return false;
    if (p.gated->scales == nullptr || !Aligned16(p.gated->act_out)) return false;
  }
  return true;
}

// Measured on an H200 (132 SMs), k = 2048, n = 4096, see README.md: the large configs win or
// tie everywhere except where they leave SMs idle, so the small configs are for small
// problems and narrow outputs only.
TileConfig ChooseTileConfig(const Problem& p, int sm_count) {
  if (sm_count <= 0) sm_count = 132;
  // Large-config CTA tile N: 256 (16-bit and FP8 fast accumulation), 128 (promoted FP8: the
  // two accumulator sets do not fit a 128x256 cooperative tile without spilling).
  const int64_t tile_n = IsFp8(p.a_type) && !p.fast_accumulation ? 128 : 256;
  const int64_t groups = std::max(1, p.num_groups);
  const int64_t rows_per_group = std::max<int64_t>(1, p.m / groups);
  if (p.form == Form::kWgrad) {
    // Output tiles are k x n per group (cluster 2x1 along k); the contraction is the rows.
    const int64_t tiles = groups * CeilDiv(p.k, 128) * CeilDiv(p.n, tile_n);
    if (p.n <= tile_n / 2 || tiles < 2 * sm_count) return TileConfig::kSmall;
    // 16-bit, short contractions: each tile's mainloop is a few k-blocks, and the ping-pong
    // kernel overlaps one tile's epilogue with the next one's mainloop. Measured on the
    // H200 (k = 2048, n = 4096): +7% at 512 rows per group, -4% at 8192. The FP8 small
    // config (64-row tiles) loses there (README).
    if (Is16Bit(p.a_type) && rows_per_group <= kWgradPingPongMaxRows) return TileConfig::kSmall;
    // kLarge's 2x1 cluster pairs k's 128-row tiles: an odd count idles one CTA of every
    // group's last pair (1/12 of them at k = 1408, a 64-expert layer's FC2 wgrad with
    // F = 1408), where the bf16 small config's 1x2 pairs of column tiles waste nothing when
    // ceil(n / 128) is even. Measured (H100, check_grouped_gemm --wgrad-configs, 1536 rows
    // per group, k = 1408, n = 2048): 582-590 against 542-573 TFLOP/s. Off with the pairs
    // (JAXFUSE_GROUPED_GEMM_WGRAD_PAIR=0 restores the earlier choice entirely).
    if (p.a_type == ElementType::kBF16 && rows_per_group <= kWgradOddRowTilesPingPongMaxRows &&
        CeilDiv(p.k, 128) % 2 == 1 && detail::Bf16WgradPairsColumnTiles(p.n)) {
      return TileConfig::kSmall;
    }
    return TileConfig::kLarge;
  }
  const int64_t out_cols = p.form == Form::kForward ? p.n : p.k;
  const int64_t n_tiles = CeilDiv(out_cols, tile_n);
  if (out_cols <= tile_n / 2) return TileConfig::kSmall;
  // The large configs use 1x2 clusters (along N, which is the same for every group, so ragged
  // group sizes waste no cluster slots); an odd, small N-tile count would idle CTAs.
  if (n_tiles % 2 == 1 && n_tiles < 4) return TileConfig::kSmall;
  const int64_t tiles = groups * CeilDiv(rows_per_group, 128) * n_tiles;
  if (tiles < 2 * sm_count) return TileConfig::kSmall;
  // kAdaptive costs one launch that finds no tile (3-4 us on the H200): worth it from about
  // half a millisecond of GEMM (64 x 512 rows, k = n = 2048 and more).
  if (PickFamily(p).uniform.run != nullptr && tiles >= 8 * sm_count) {
    return TileConfig::kAdaptive;
  }
  return TileConfig::kLarge;
}

namespace {
// kUniform / kAdaptive become kLarge for families without a kUniform kernel.
TileConfig ResolveConfig(const Problem& p, int sm_count) {
  TileConfig config = p.tile_config;
  if (config == TileConfig::kAuto) config = detail::ActiveTuningOptions().tile;
  if (config == TileConfig::kAuto) config = ChooseTileConfig(p, sm_count);
  const bool uniform = config == TileConfig::kUniform || config == TileConfig::kAdaptive;
  if (uniform && PickFamily(p).uniform.run == nullptr) return TileConfig::kLarge;
  return config;
}

// Whether the CUTLASS kernel launches as a programmatic dependent of the setup kernel:
// m * k * n multiply-adds (every form; m the static row count) up to
// kProgrammaticLaunchMaxMacs, unless JAXFUSE_GROUPED_GEMM_PDL says otherwise.
bool UseProgrammaticLaunch(const Problem& p) {
  const int forced = detail::ActiveTuningOptions().pdl;
  if (forced >= 0) return forced == 1;
  const double macs = static_cast<double>(p.m) * static_cast<double>(p.k) * static_cast<double>(p.n);
  return macs <= static_cast<double>(kProgrammaticLaunchMaxMacs);
}
// Teams of the team tile scheduler (team_tile_scheduler.cuh; only the bf16 ping-pong
// kernels take it): JAXFUSE_GROUPED_GEMM_TEAMS where set, else, for the short-contraction
// wgrad (at most 1024 rows per group), as many teams as keep the operands of the groups
// walked side by side within about half of the L2 (each team works on its own group), at
// most 4. Measured on an H100 (session 42, README "The team tile scheduler"): in
// `check_grouped_gemm --teams` the 512-row wgrad (6 MB of operands per group) ran 1-5%
// faster with 2-4 teams, 8 gained nothing and 16 (96 MB side by side) lost 15-40%; the
// ping-pong forward and dgrad gained nothing at any count, and every kernel lost at 8192
// rows per group with 4 teams or more. In the op benchmark 4 teams made the wgrad's kernel
// 2% (64 x 512), 11% (128 x 512) and 8% (64 x ~512 routed) faster.
int TeamsFor(const Problem& p) {
  const int forced = detail::ActiveTuningOptions().teams;
  if (forced > 0) return forced;
  if (p.form != Form::kWgrad || p.num_groups < 2) return 1;
  constexpr double kSideBySideBytes = 24.0 * (1 << 20);
  constexpr double kMaxRowsPerGroup = 1024;  // longer contractions: not measured to gain
  constexpr int kMaxTeams = 4;
  const double rows_per_group = static_cast<double>(p.m) / p.num_groups;
  if (rows_per_group > kMaxRowsPerGroup) return 1;
  const double group_bytes =
      rows_per_group * (p.k * ElementBytes(p.a_type) + p.n * ElementBytes(p.b_type));
  if (group_bytes <= 0) return 1;
  const double fit = std::floor(kSideBySideBytes / group_bytes);
  return static_cast<int>(std::max(1.0, std::min<double>(kMaxTeams, fit)));
}
}  // namespace

size_t WorkspaceBytes(const Problem& p, int sm_count) {
  const Family family = PickFamily(p);
  if (family.run == nullptr || p.num_groups < 1 || sm_count <= 0) return 0;
  return MakeLayout(p, family, ResolveConfig(p, sm_count), sm_count).total;
}

cudaError_t Run(const Problem& p, int sm_count, cudaStream_t stream) {
  if (!IsSupported(p) || sm_count <= 0) return cudaErrorInvalidValue;
  const Family family = PickFamily(p);
  const TileConfig config = ResolveConfig(p, sm_count);
  const Layout layout = MakeLayout(p, family, config, sm_count);
  if (p.workspace == nullptr || p.workspace_bytes < layout.total) return cudaErrorInvalidValue;

  const int out_bytes = ElementBytes(p.out_type);
  const bool wgrad = p.form == Form::kWgrad;
  // Output extent: rows x cols for forward/dgrad, G x k x n for wgrad.
  const int64_t out_cols = p.form == Form::kForward ? p.n : p.k;
  const int64_t contraction = p.form == Form::kForward ? p.k : p.n;
  if (!wgrad) {
    if (p.m == 0 || out_cols == 0) return cudaSuccess;  // empty output
    if (contraction == 0) {                            // x @ (empty) = 0
      if (p.gated != nullptr) {  // and act(0, 0) = 0 for the gated kinds
        const cudaError_t error = cudaMemsetAsync(
            p.gated->act_out, 0, static_cast<size_t>(p.m * (out_cols / 2) * out_bytes), stream);
        if (error != cudaSuccess) return error;
      }
      return cudaMemsetAsync(p.out, 0, static_cast<size_t>(p.m * out_cols * out_bytes), stream);
    }
  } else {
    if (p.k == 0 || p.n == 0) return cudaSuccess;  // empty output
    if (p.m == 0) {                                // every group is empty
      return cudaMemsetAsync(
          p.out, 0, static_cast<size_t>(p.num_groups) * p.k * p.n * out_bytes, stream);
    }
  }

  char* base = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(p.workspace) + kAlign - 1) / kAlign * kAlign);
  SetupParams s{};
  s.form = p.form == Form::kForward ? 0 : (p.form == Form::kDgrad ? 1 : 2);
  s.num_groups = p.num_groups;
  s.m = p.m;
  s.k = p.k;
  s.n = p.n;
  s.offsets = p.group_offsets;
  s.a = static_cast<const char*>(p.a);
  s.b = static_cast<const char*>(p.b);
  s.out = static_cast<char*>(p.out);
  s.a_bytes = ElementBytes(p.a_type);
  s.b_bytes = ElementBytes(p.b_type);
  s.out_bytes = out_bytes;
  s.b_k_major_forward = IsFp8(p.a_type) && p.form == Form::kForward;
  s.columnwise = p.columnwise;
  s.a_scale_inv = p.a_scale_inv;
  s.b_scale_inv = p.b_scale_inv;
  s.clamped = reinterpret_cast<int64_t*>(base + layout.offsets);
  s.shapes = reinterpret_cast<int32_t*>(base + layout.shapes);
  s.ptr_a = reinterpret_cast<const void**>(base + layout.ptr_a);
  s.ptr_b = reinterpret_cast<const void**>(base + layout.ptr_b);
  s.ptr_d = reinterpret_cast<void**>(base + layout.ptr_d);
  s.stride_a = reinterpret_cast<int64_t*>(base + layout.stride_a);
  s.stride_b = reinterpret_cast<int64_t*>(base + layout.stride_b);
  s.stride_d = reinterpret_cast<int64_t*>(base + layout.stride_d);
  s.alpha = family.has_alpha ? reinterpret_cast<float*>(base + layout.alpha) : nullptr;
  s.alpha_ptrs = family.has_alpha ? reinterpret_cast<const float**>(base + layout.alpha_ptrs)
                                  : nullptr;
  if (p.block_scaling) {
    s.ptr_sfa = reinterpret_cast<const float**>(base + layout.ptr_sfa);
    s.ptr_sfb = reinterpret_cast<const float**>(base + layout.ptr_sfb);
    if (wgrad) {  // one scale per column of the copies per scale row (columnwise.h)
      s.sfa_per_row = p.k;
      s.sfb_per_group = p.n;
    } else {
      const int64_t contraction_blocks = CeilDiv(contraction, detail::kBlockScale);
      s.sfa_per_row = contraction_blocks;
      s.sfb_per_group = CeilDiv(out_cols, detail::kBlockScale) * contraction_blocks;
    }
  }
  const bool adaptive = config == TileConfig::kAdaptive;
  s.shapes_uniform =
      adaptive ? reinterpret_cast<int32_t*>(base + layout.shapes_uniform) : nullptr;
  s.uniform_rows = adaptive ? family.uniform.row_granularity() : 0;
  s.large_rows = 128;  // CTA tile M of the 16-bit large kernels
  s.col_tiles = static_cast<int>(CeilDiv(out_cols, 256));  // CTA tile N of both

  // One launch: setup arrays (block 0) and the zeroing of what the GEMM does not write.
  // At most one wave of blocks: every block pays a block-wide reduction of the offsets even
  // when nothing is uncovered (the usual case); on the H200 a grid of 4 waves made the
  // launch cost 7.2 us, one wave 3.9 us (T=2048 grouped MLP). One wave of 1024-thread
  // blocks still zeroes at full bandwidth when there is something to zero.
  ZeroParams z{static_cast<uint4*>(p.out), 0};
  dim3 grid(1, 1);
  if (!wgrad) {
    z.units = out_cols * out_bytes / 16;
    if (p.gated != nullptr) {
      z.act_out = static_cast<uint4*>(p.gated->act_out);
      z.act_units = z.units / 2;  // n / 2 bf16 columns; n is a multiple of 256
    }
    grid.x = static_cast<unsigned>(std::max<int64_t>(
        1, std::min<int64_t>(CeilDiv(p.m * z.units, kSetupThreads), sm_count)));
  } else {
    z.units = p.k * p.n * out_bytes / 16;
    const int64_t gy = std::min<int64_t>(p.num_groups, 65535);
    const int64_t per_group_cap = std::max<int64_t>(1, sm_count / gy);
    grid.x = static_cast<unsigned>(std::max<int64_t>(
        1, std::min<int64_t>(CeilDiv(z.units, kSetupThreads), per_group_cap)));
    grid.y = static_cast<unsigned>(gy);
  }
  SetupKernel<<<grid, kSetupThreads, 0, stream>>>(s, z);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;

  GemmArrays arrays;
  arrays.num_groups = p.num_groups;
  arrays.problem_shapes = s.shapes;
  arrays.ptr_a = s.ptr_a;
  arrays.ptr_b = s.ptr_b;
  arrays.ptr_d = s.ptr_d;
  arrays.stride_a = s.stride_a;
  arrays.stride_b = s.stride_b;
  arrays.stride_d = s.stride_d;
  arrays.alpha_ptrs = s.alpha_ptrs;
  arrays.ptr_sfa = s.ptr_sfa;
  arrays.ptr_sfb = s.ptr_sfb;
  arrays.cutlass_workspace = base + layout.cutlass;
  arrays.cutlass_workspace_bytes = layout.cutlass_bytes;
  // Raster order: measured on the H200 (README), N wins 2-4% for forward/dgrad of large
  // groups (8 x 8192 rows, bf16 and FP8); M wins for wgrad. At 512 rows per group M reads
  // 15% less DRAM in the forward and wins 2-8% on equal sizes, but loses 0-4% on routed
  // sizes and in the dgrad (H100, session 41, README "Raster order and DRAM traffic").
  const char raster = detail::ActiveTuningOptions().raster;
  arrays.raster = raster != 0 ? raster : (wgrad ? 'M' : 'N');
  arrays.columns = wgrad || p.form == Form::kForward ? p.n : p.k;
  arrays.rows = p.m;
  arrays.pdl = UseProgrammaticLaunch(p);
  arrays.teams = TeamsFor(p);
  arrays.gated = p.gated;
  arrays.out = p.out;
  if (config == TileConfig::kUniform) return family.uniform.run(config, arrays, sm_count, stream);
  if (!adaptive) return family.run(config, arrays, sm_count, stream);
  // kAdaptive: both kernels on the stream; the one the setup kernel gave no rows exits at once.
  const cudaError_t large_error = family.run(TileConfig::kLarge, arrays, sm_count, stream);
  if (large_error != cudaSuccess) return large_error;
  GemmArrays uniform_arrays = arrays;
  uniform_arrays.problem_shapes = s.shapes_uniform;
  uniform_arrays.cutlass_workspace = base + layout.cutlass_uniform;
  uniform_arrays.cutlass_workspace_bytes = layout.cutlass_uniform_bytes;
  return family.uniform.run(config, uniform_arrays, sm_count, stream);
}

}  // namespace jaxfuse::grouped_gemm
