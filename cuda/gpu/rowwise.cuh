// Row-wise memory-bound kernel machinery shared by scaled_activation.cu and quantize.cu.
//
// One CUDA block walks a row at a time (grid-stride over rows); its threads walk the row
// in "units" of 8 consecutive output columns, so every global access is 16 bytes for
// 16-bit types (two for fp32, 8 bytes of FP8) whenever rows are 16-byte aligned, with a
// scalar path for unaligned shapes and the ragged tail. A Producer computes the fp32
// values of one unit (loading x, dy, scales); a Sink consumes them (stores in x's dtype,
// reduces amax, quantizes). Block scaling with block = 8 * L reduces amax over L adjacent
// lanes with warp shuffles, so a 1 x 128 or 1 x 32 block is quantized in one pass.
//
// Two kernels run that scheme. RowKernel loads each unit straight from global memory.
// StagedRowKernel (rows 16-byte aligned; by default the plain activation backward only,
// see StagedByDefault) streams a row's inputs through shared memory instead (staging.cuh):
// a persistent block walks its rows in tiles, and one thread keeps the next stages' tiles
// in flight with bulk copies, so far more bytes are in flight per SM than registers hold.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "jaxfuse/activation.h"
#include "jaxfuse/fp8.h"
#include "jaxfuse/quantize.h"
#include "occupancy.cuh"
#include "staging.cuh"

namespace jaxfuse {
namespace gpu {

constexpr int kUnit = 8;

__device__ __forceinline__ float LoadOne(const float* p) { return __ldg(p); }
__device__ __forceinline__ float LoadOne(const __nv_bfloat16* p) { return __bfloat162float(p[0]); }
__device__ __forceinline__ float LoadOne(const __half* p) { return __half2float(p[0]); }

__device__ __forceinline__ void StoreOne(float* p, float v) { *p = v; }
__device__ __forceinline__ void StoreOne(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void StoreOne(__half* p, float v) { *p = __float2half_rn(v); }

// Loads up to 8 elements starting at p (valid of them; the rest read as 0).
template <typename T>
__device__ __forceinline__ void Load8(const T* p, bool vector, int valid, float (&v)[8]) {
  if (vector && valid == 8) {
    if constexpr (sizeof(T) == 4) {
      const float4 lo = __ldg(reinterpret_cast<const float4*>(p));
      const float4 hi = __ldg(reinterpret_cast<const float4*>(p) + 1);
      v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
      v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
    } else {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = LoadOne(e + i);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = i < valid ? LoadOne(p + i) : 0.0f;
}

// Loads 8 elements from 16-byte-aligned shared memory (a staged tile).
template <typename T>
__device__ __forceinline__ void LoadShared8(const T* p, float (&v)[8]) {
  if constexpr (sizeof(T) == 4) {
    const float4 lo = reinterpret_cast<const float4*>(p)[0];
    const float4 hi = reinterpret_cast<const float4*>(p)[1];
    v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
    v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = LoadOne(e + i);
  }
}

// The 8 16-bit elements held in one 16-byte register load (raw).
template <typename T>
__device__ __forceinline__ void RawToFloat8(const uint4& raw, float (&v)[8]) {
  static_assert(sizeof(T) == 2, "8 elements in 16 bytes");
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = LoadOne(e + i);
}

template <typename T>
__device__ __forceinline__ void Store8(T* p, bool vector, int valid, const float (&v)[8]) {
  if (vector && valid == 8) {
    if constexpr (sizeof(T) == 4) {
      reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int i = 0; i < 8; ++i) StoreOne(e + i, v[i]);
      *reinterpret_cast<uint4*>(p) = raw;
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (i < valid) StoreOne(p + i, v[i]);
  }
}

// float pair -> two FP8 bytes with hardware round-to-nearest-even, satfinite, NaN kept:
// the same bits as FloatToFp8 (jaxfuse/fp8.h).
__device__ __forceinline__ uint16_t Fp8x2(float a, float b, Fp8Format format) {
  const float2 pair = make_float2(a, b);
  return format == Fp8Format::kE4M3
             ? static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3))
             : static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E5M2));
}

// 8 values (times scale) as 8 FP8 bytes, element 0 in the lowest byte.
__device__ __forceinline__ uint2 PackFp8x8(const float (&v)[8], float scale, Fp8Format format) {
  uint16_t pairs[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = Fp8x2(v[2 * i] * scale, v[2 * i + 1] * scale, format);
  return make_uint2(pairs[0] | (static_cast<uint32_t>(pairs[1]) << 16),
                    pairs[2] | (static_cast<uint32_t>(pairs[3]) << 16));
}

// Writes 8 values (times scale) as FP8 at p (valid of them).
__device__ __forceinline__ void StoreFp8x8(uint8_t* p, bool vector, int valid, const float (&v)[8],
                                           float scale, Fp8Format format) {
  const uint2 packed = PackFp8x8(v, scale, format);
  if (vector && valid == 8) {
    *reinterpret_cast<uint2*>(p) = packed;
    return;
  }
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&packed);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (i < valid) p[i] = bytes[i];
  }
}

// Hints that a unit's 16 bytes at p will be read soon (RowKernel, one step ahead): into
// L1 (level 1) or L2 (level 2). A prefetch never faults and holds no register.
__device__ __forceinline__ void PrefetchUnit(const void* p, int level) {
  if (level == 1) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
  } else {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
  }
}

__device__ __forceinline__ bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

template <typename T>
__device__ __forceinline__ float LoadScale(const void* scales, bool scales_f32, int64_t row) {
  return scales_f32 ? __ldg(static_cast<const float*>(scales) + row)
                    : LoadOne(static_cast<const T*>(scales) + row);
}

// act(a[i], b[i]) for 8 elements, switching on the kind once: the element loop has no
// branches, so the 8 exp/reciprocal chains interleave.
__device__ __forceinline__ void ActivationForward8(const ActivationParams& params,
                                                   const float (&a)[8], const float (&b)[8],
                                                   float (&out)[8]) {
  switch (params.kind) {
    case Activation::kSwiglu:
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = SwigluForward(a[i], b[i]);
      break;
    case Activation::kClampedSwiglu:
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = ClampedSwigluForward(params, a[i], b[i]);
      break;
    default:
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = SreluForward(a[i]);
  }
}

// The value and partial derivatives of 8 elements, switching on the kind once.
__device__ __forceinline__ void ActivationBackward8(const ActivationParams& params,
                                                    const float (&a)[8], const float (&b)[8],
                                                    ActivationGrad (&out)[8]) {
  switch (params.kind) {
    case Activation::kSwiglu:
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = SwigluBackward(a[i], b[i]);
      break;
    case Activation::kClampedSwiglu:
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = ClampedSwigluBackward(params, a[i], b[i]);
      break;
    default:
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = SreluBackward(a[i]);
  }
}

// --- producers ------------------------------------------------------------------------
// Compute(row, unit, scale, v, side) fills v[chunk][0..8) for output columns Col(chunk, unit)
// and adds a row-reduction term to side (dscales); scale is RowScale(row), loaded once per
// row by the kernel. Valid(chunk, unit) elements of 8 are real. Prefetch(row, unit, level)
// hints the unit's inputs (PrefetchUnit).
//
// Producers with kStaged also run in StagedRowKernel (when `vector`): their inputs are
// Streams() row segments, Segment(stream, row, col) being where the one for the tile
// starting at F-space column col begins in global memory (8 elements per unit, the tile's
// units contiguous in every stream). ComputeStaged reads unit `offset / 8` of the tile from
// the segments' shared-memory copies; RowScale is the row's activation scale.
constexpr int kMaxStreams = 3;
// Staged producers of 16-bit inputs also compute from registers: ComputeRaw takes the
// unit's 16 bytes of each of its Streams() segments (raw[stream], loaded by the kernel from
// Segment(stream, row, 8 u)), so a kernel can issue several units' loads before any math
// (QuantizeColumnwiseKernel). kRawStreams bounds Streams().

// Plain values: x [rows, cols]; with kGathered, output row r is x[source_rows[r]] (x
// [sources, cols]): an MoE layer's expert-sorted rows read straight from its tokens. A
// gathered source index outside [0, sources) reads row 0 or sources - 1, never out of
// bounds (the callers build the indices from a permutation; sources > 0 wherever there
// are rows).
template <typename T, bool kGathered = false>
struct LoadProducer {
  static constexpr int kChunks = 1;
  static constexpr bool kSide = false;
  const T* x;
  int64_t cols;
  bool vector;  // cols % 8 == 0 and x 16-byte aligned
  const int32_t* source_rows = nullptr;  // [rows], kGathered only
  int64_t sources = 0;
  __device__ const T* Row(int64_t row) const {
    if constexpr (kGathered) {
      const int64_t source = min(max(static_cast<int64_t>(__ldg(source_rows + row)),
                                     int64_t{0}), sources - 1);
      return x + source * cols;
    } else {
      return x + row * cols;
    }
  }
  __device__ int64_t Units() const { return (cols + kUnit - 1) / kUnit; }
  __device__ int64_t Col(int, int64_t u) const { return u * kUnit; }
  __device__ int Valid(int, int64_t u) const {
    const int64_t left = cols - u * kUnit;
    return left >= kUnit ? kUnit : static_cast<int>(left);
  }
  __device__ void Compute(int64_t row, int64_t u, float, float (&v)[1][8], float&) const {
    Load8(Row(row) + u * kUnit, vector, Valid(0, u), v[0]);
  }
  __device__ void Prefetch(int64_t row, int64_t u, int level) const {
    PrefetchUnit(Row(row) + u * kUnit, level);
  }
  static constexpr bool kStaged = true;
  __host__ __device__ int Streams() const { return 1; }
  __device__ const T* Segment(int, int64_t row, int64_t col) const { return Row(row) + col; }
  __device__ float RowScale(int64_t) const { return 1.0f; }
  __device__ void ComputeStaged(const T* const (&segment)[kMaxStreams], int offset, float,
                                float (&v)[1][8], float&) const {
    LoadShared8(segment[0] + offset, v[0]);
  }
  static constexpr int kRawStreams = 1;
  __device__ void ComputeRaw(const uint4 (&raw)[kRawStreams], float, float (&v)[1][8],
                             float&) const {
    RawToFloat8<T>(raw[0], v[0]);
  }
};

template <typename T>
using GatherLoadProducer = LoadProducer<T, true>;

// act(x) * scale: x [rows, W], output [rows, F].
template <typename T>
struct ActProducer {
  static constexpr int kChunks = 1;
  static constexpr bool kSide = false;
  const T* x;
  const void* scales;
  bool scales_f32;
  ActivationParams params;
  int64_t f, w;
  bool vector;  // f % 8 == 0 and x aligned
  __device__ int64_t Units() const { return (f + kUnit - 1) / kUnit; }
  __device__ int64_t Col(int, int64_t u) const { return u * kUnit; }
  __device__ int Valid(int, int64_t u) const {
    const int64_t left = f - u * kUnit;
    return left >= kUnit ? kUnit : static_cast<int>(left);
  }
  __device__ void Prefetch(int64_t row, int64_t u, int level) const {
    const T* base = x + row * w + u * kUnit;
    PrefetchUnit(base, level);
    if (IsGlu(params.kind)) PrefetchUnit(base + f, level);
  }
  __device__ void Compute(int64_t row, int64_t u, float scale, float (&v)[1][8], float&) const {
    const int valid = Valid(0, u);
    const T* base = x + row * w + u * kUnit;
    float a[8], b[8];
    Load8(base, vector, valid, a);
    if (IsGlu(params.kind)) {
      Load8(base + f, vector, valid, b);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) b[i] = 0.0f;
    }
    float act[8];
    ActivationForward8(params, a, b, act);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[0][i] = act[i] * scale;
  }
  // Staged: stream 0 the gate half, stream 1 the linear half (GLU kinds).
  static constexpr bool kStaged = true;
  __host__ __device__ int Streams() const { return IsGlu(params.kind) ? 2 : 1; }
  __device__ const T* Segment(int stream, int64_t row, int64_t col) const {
    return x + row * w + stream * f + col;
  }
  __device__ float RowScale(int64_t row) const { return LoadScale<T>(scales, scales_f32, row); }
  __device__ void ComputeStaged(const T* const (&segment)[kMaxStreams], int offset, float scale,
                                float (&v)[1][8], float&) const {
    float a[8], b[8], act[8];
    LoadShared8(segment[0] + offset, a);
    if (IsGlu(params.kind)) {
      LoadShared8(segment[1] + offset, b);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) b[i] = 0.0f;
    }
    ActivationForward8(params, a, b, act);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[0][i] = act[i] * scale;
  }
  static constexpr int kRawStreams = 2;
  __device__ void ComputeRaw(const uint4 (&raw)[kRawStreams], float scale, float (&v)[1][8],
                             float&) const {
    float a[8], b[8], act[8];
    RawToFloat8<T>(raw[0], a);
    if (IsGlu(params.kind)) {
      RawToFloat8<T>(raw[1], b);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) b[i] = 0.0f;
    }
    ActivationForward8(params, a, b, act);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[0][i] = act[i] * scale;
  }
};

// Backward: dx = dy * scale * act'(x) over [rows, W]; side = sum dy * act (dscales).
// Pair form: unit u yields da at columns 8u.. and (GLU) db at F + 8u..
template <typename T>
struct DActPairProducer {
  static constexpr int kChunks = 2;
  static constexpr bool kSide = true;
  const T* dy;
  const T* x;
  const void* scales;
  bool scales_f32;
  ActivationParams params;
  int64_t f, w;
  bool vector;
  __device__ int64_t Units() const { return (f + kUnit - 1) / kUnit; }
  __device__ int64_t Col(int chunk, int64_t u) const { return chunk * f + u * kUnit; }
  __device__ int Valid(int chunk, int64_t u) const {
    if (chunk == 1 && !IsGlu(params.kind)) return 0;
    const int64_t left = f - u * kUnit;
    return left >= kUnit ? kUnit : static_cast<int>(left);
  }
  __device__ void Prefetch(int64_t row, int64_t u, int level) const {
    const T* base = x + row * w + u * kUnit;
    PrefetchUnit(base, level);
    PrefetchUnit(dy + row * f + u * kUnit, level);
    if (IsGlu(params.kind)) PrefetchUnit(base + f, level);
  }
  __device__ void Compute(int64_t row, int64_t u, float scale, float (&v)[2][8],
                          float& side) const {
    const int valid = Valid(0, u);
    const T* base = x + row * w + u * kUnit;
    float a[8], b[8], g[8];
    Load8(base, vector, valid, a);
    Load8(dy + row * f + u * kUnit, vector, valid, g);
    const bool glu = IsGlu(params.kind);
    if (glu) {
      Load8(base + f, vector, valid, b);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) b[i] = 0.0f;
    }
    ActivationGrad grads[8];
    ActivationBackward8(params, a, b, grads);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const ActivationGrad& grad = grads[i];
      if (i < valid) side += g[i] * grad.value;
      const float gs = g[i] * scale;
      v[0][i] = gs * grad.da;
      v[1][i] = glu ? gs * grad.db : 0.0f;
    }
  }  // Staged: stream 0 the gate half of x, stream 1 dy, stream 2 the linear half (GLU).
  static constexpr bool kStaged = true;
  __host__ __device__ int Streams() const { return IsGlu(params.kind) ? 3 : 2; }
  __device__ const T* Segment(int stream, int64_t row, int64_t col) const {
    return stream == 1 ? dy + row * f + col : x + row * w + (stream == 2 ? f : 0) + col;
  }
  __device__ float RowScale(int64_t row) const { return LoadScale<T>(scales, scales_f32, row); }
  __device__ void ComputeStaged(const T* const (&segment)[kMaxStreams], int offset, float scale,
                                float (&v)[2][8], float& side) const {
    const bool glu = IsGlu(params.kind);
    float a[8], b[8], g[8];
    LoadShared8(segment[0] + offset, a);
    LoadShared8(segment[1] + offset, g);
    if (glu) {
      LoadShared8(segment[2] + offset, b);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) b[i] = 0.0f;
    }
    FromValues(a, b, g, scale, v, side);
  }
  // The dx halves and the dscales term of a whole unit from x's halves a, b (zeros unless
  // GLU) and dy's g.
  __device__ void FromValues(const float (&a)[8], const float (&b)[8], const float (&g)[8],
                             float scale, float (&v)[2][8], float& side) const {
    const bool glu = IsGlu(params.kind);
    ActivationGrad grads[8];
    ActivationBackward8(params, a, b, grads);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      side += g[i] * grads[i].value;
      const float gs = g[i] * scale;
      v[0][i] = gs * grads[i].da;
      v[1][i] = glu ? gs * grads[i].db : 0.0f;
    }
  }
  static constexpr int kRawStreams = 3;
  __device__ void ComputeRaw(const uint4 (&raw)[kRawStreams], float scale, float (&v)[2][8],
                             float& side) const {
    const bool glu = IsGlu(params.kind);
    float a[8], b[8], g[8];
    RawToFloat8<T>(raw[0], a);
    RawToFloat8<T>(raw[1], g);
    if (glu) {
      RawToFloat8<T>(raw[2], b);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) b[i] = 0.0f;
    }
    FromValues(a, b, g, scale, v, side);
  }
};

// Flat form of the backward for block scaling when F is not a multiple of the block:
// unit u covers dx columns 8u.. of W, element by element (GLU halves handled per element).
template <typename T>
struct DActFlatProducer {
  static constexpr int kChunks = 1;
  static constexpr bool kSide = true;
  static constexpr bool kStaged = false;  // a unit may straddle the halves
  const T* dy;
  const T* x;
  const void* scales;
  bool scales_f32;
  ActivationParams params;
  int64_t f, w;
  bool vector;  // f % 8 == 0 and aligned: a unit lies in one half
  __device__ int64_t Units() const { return (w + kUnit - 1) / kUnit; }
  __device__ int64_t Col(int, int64_t u) const { return u * kUnit; }
  __device__ int Valid(int, int64_t u) const {
    const int64_t left = w - u * kUnit;
    return left >= kUnit ? kUnit : static_cast<int>(left);
  }
  __device__ float RowScale(int64_t row) const { return LoadScale<T>(scales, scales_f32, row); }
  __device__ void Prefetch(int64_t, int64_t, int) const {}  // rare shapes: not worth it
  __device__ void Compute(int64_t row, int64_t u, float scale, float (&v)[1][8],
                          float& side) const {
    const bool glu = IsGlu(params.kind);
    const int valid = Valid(0, u);
    const int64_t c0 = u * kUnit;
    if (vector && valid == 8) {
      const bool second = c0 >= f;
      const int64_t j0 = second ? c0 - f : c0;
      float a[8], b[8], g[8];
      Load8(x + row * w + j0, true, 8, a);
      Load8(dy + row * f + j0, true, 8, g);
      if (glu) {
        Load8(x + row * w + f + j0, true, 8, b);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) b[i] = 0.0f;
      }
      ActivationGrad grads[8];
      ActivationBackward8(params, a, b, grads);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const ActivationGrad& grad = grads[i];
        if (!second) side += g[i] * grad.value;
        v[0][i] = g[i] * scale * (second ? grad.db : grad.da);
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[0][i] = 0.0f;
      if (i >= valid) continue;
      const int64_t c = c0 + i;
      const bool second = c >= f;
      const int64_t j = second ? c - f : c;
      const float a = LoadOne(x + row * w + j);
      const float b = glu ? LoadOne(x + row * w + f + j) : 0.0f;
      const float g = LoadOne(dy + row * f + j);
      const ActivationGrad grad = ActivationBackward(params, a, b);
      if (!second) side += g * grad.value;
      v[0][i] = g * scale * (second ? grad.db : grad.da);
    }
  }
};

// --- block reduction ------------------------------------------------------------------

__device__ __forceinline__ float2 BlockReduceMaxSum(float m, float s) {
  __shared__ float2 partial[32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    s += __shfl_xor_sync(0xffffffffu, s, offset);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) partial[warp] = make_float2(m, s);
  __syncthreads();
  float2 result = make_float2(0.0f, 0.0f);
  if (warp == 0) {
    const int warps = (blockDim.x + 31) / 32;
    float2 mine = lane < warps ? partial[lane] : make_float2(0.0f, 0.0f);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      mine.x = fmaxf(mine.x, __shfl_xor_sync(0xffffffffu, mine.x, offset));
      mine.y += __shfl_xor_sync(0xffffffffu, mine.y, offset);
    }
    result = mine;
  }
  __syncthreads();  // partial is reused by the next row
  return result;    // valid in thread 0
}

// Non-negative floats order like their bit patterns, so atomicMax on the bits is a float
// max (amax starts at +0 and NaN never reaches it: MaxAbs drops NaN).
__device__ __forceinline__ void AtomicMaxNonNegative(float* address, float value) {
  atomicMax(reinterpret_cast<unsigned int*>(address), __float_as_uint(value));
}

// max(amax, |v|) with NaN dropped, as AbsForAmax (jaxfuse/fp8.h) defines it: fmaxf returns
// the other operand when one is NaN, and amax is never NaN. One instruction (|v| is an
// operand modifier) where AbsForAmax's explicit NaN test costs three.
__device__ __forceinline__ float MaxAbs(float amax, float v) { return fmaxf(amax, fabsf(v)); }

// --- sinks ----------------------------------------------------------------------------

enum class SinkKind { kStore, kAmax, kCurrent, kBlock };

// Output pointers and the quantization parameters of a launch.
template <typename T>
struct SinkArgs {
  T* out = nullptr;             // unquantized output [rows, cols] (kStore, or extra dx)
  bool out_vector = false;
  uint8_t* data = nullptr;      // FP8 [rows, cols]
  bool data_vector = false;
  void* scale_inv = nullptr;    // float [G] / float or uint8 [rows, cols / block]
  float* amax = nullptr;        // float [G]
  float* side = nullptr;        // float [rows] (dscales)
  const int32_t* offsets = nullptr;
  int64_t num_groups = 0, rows = 0, cols = 0;
  int block = 0;                // block scaling: elements per block (a power of two >= 8)
  int block_shift = 0;          // log2(block)
  int64_t blocks_per_row = 0;   // ceil(cols / block)
  bool mx = false;
  Fp8Format format = Fp8Format::kE4M3;
  int prefetch = 0;             // RowKernel: prefetch the next step's unit into L1 (1), L2 (2)
};

// A row's sink state: the current-scaling factor of its group, and the per-thread partial
// amax and side (dscales) sums that EndRow reduces over the block.
struct RowState {
  float scale = 1.0f;
  bool valid = true;  // the row lies in a group (current scaling)
  float amax = 0.0f;
  float side = 0.0f;
};

template <SinkKind kKind, typename T>
__device__ __forceinline__ RowState BeginRow(const SinkArgs<T>& s, int64_t row, float fp8_max) {
  RowState state;
  if constexpr (kKind == SinkKind::kCurrent) {
    const int64_t g = GroupOfRow(s.offsets, s.num_groups, row, s.rows);
    state.valid = g < s.num_groups;
    if (state.valid) state.scale = ScaleFromAmax(s.amax[g], fp8_max);
  }
  return state;
}

// Current scaling: block 0 writes scale_inv[g] = 1 / scale(amax[g]) for every group, the
// inverse of the scale BeginRow applies (one launch fewer than a separate kernel).
template <SinkKind kKind, typename T>
__device__ __forceinline__ void WriteGroupScaleInv(const SinkArgs<T>& s, float fp8_max) {
  if constexpr (kKind == SinkKind::kCurrent) {
    if (blockIdx.x != 0) return;
    float* scale_inv = static_cast<float*>(s.scale_inv);
    for (int64_t g = threadIdx.x; g < s.num_groups; g += blockDim.x) {
      scale_inv[g] = 1.0f / ScaleFromAmax(s.amax[g], fp8_max);
    }
  }
}

// Consumes one unit's values v (valid of 8 are real) for columns col.. of `row`. Every
// thread of the warp calls it, those without a unit with valid = 0: kBlock shuffles across
// the `lanes` threads of a block.
template <SinkKind kKind, typename T>
__device__ __forceinline__ void SinkUnit(const SinkArgs<T>& s, int64_t row, int64_t col,
                                         int valid, const float (&v)[8], int lanes, float fp8_max,
                                         RowState& state) {
  if constexpr (kKind == SinkKind::kStore) {
    if (valid > 0) Store8(s.out + row * s.cols + col, s.out_vector, valid, v);
    return;
  }
  if (s.out != nullptr && valid > 0) Store8(s.out + row * s.cols + col, s.out_vector, valid, v);
  if constexpr (kKind == SinkKind::kAmax) {
#pragma unroll
    for (int i = 0; i < 8; ++i) state.amax = MaxAbs(state.amax, v[i]);
  } else if constexpr (kKind == SinkKind::kCurrent) {
    if (valid > 0) {
      if (state.valid) {
        StoreFp8x8(s.data + row * s.cols + col, s.data_vector, valid, v, state.scale, s.format);
      } else {
        const float zeros[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        StoreFp8x8(s.data + row * s.cols + col, s.data_vector, valid, zeros, 1.0f, s.format);
      }
    }
  } else {  // kBlock: `lanes` adjacent threads share one block of s.block elements
    float local = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) local = MaxAbs(local, v[i]);
    // Unrolled with a uniform guard (lanes is at most 32): a runtime loop costs its own
    // counter and branch per step.
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      if (offset < lanes) local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, offset));
    }
    float scale;
    // Shifts and masks: s.block is a power of two (64-bit divisions per unit cost more than
    // the rest of the unit's work).
    const int64_t block_index = row * s.blocks_per_row + (col >> s.block_shift);
    const bool leader = valid > 0 && (col & (s.block - 1)) == 0;
    if (s.mx) {
      const uint8_t e = E8M0FromAmax(local, fp8_max);
      scale = E8M0InverseToFloat(e);
      if (leader) static_cast<uint8_t*>(s.scale_inv)[block_index] = e;
    } else {
      scale = ScaleFromAmax(local, fp8_max);
      if (leader) static_cast<float*>(s.scale_inv)[block_index] = 1.0f / scale;
    }
    if (valid > 0) StoreFp8x8(s.data + row * s.cols + col, s.data_vector, valid, v, scale, s.format);
  }
}

// Reduces the row's amax and side over the block (every thread calls it; uniform branch)
// and publishes them: the group's amax (atomic max), side[row].
template <class P, SinkKind kKind, typename T>
__device__ __forceinline__ void EndRow(const SinkArgs<T>& s, int64_t row, const RowState& state) {
  if (kKind == SinkKind::kAmax || (P::kSide && s.side != nullptr)) {
    const float2 reduced = BlockReduceMaxSum(state.amax, state.side);
    if (threadIdx.x == 0) {
      if constexpr (kKind == SinkKind::kAmax) {
        const int64_t g = GroupOfRow(s.offsets, s.num_groups, row, s.rows);
        if (g < s.num_groups) AtomicMaxNonNegative(s.amax + g, reduced.x);
      }
      if (s.side != nullptr) s.side[row] = reduced.y;
    }
  }
}

// RowKernel: launch bounds of 512 threads, the most ThreadsFor() returns; every
// instantiation stays at or under 64 registers with them, without spills (nvcc 13.0,
// e9c2e614). One unit per thread per step, with the next step's unit prefetched
// (SinkArgs::prefetch): two or four units per step (all loads issued first) measured
// slower on the H200 at T=65536, 2F=8192 (4b955f61: SwiGLU backward 0.855 -> 1.068 ->
// 1.302 ms, 1x128 quantized 0.683 -> 0.715 -> 0.863 ms): the extra registers cost more
// occupancy than the loads in flight gain.
template <class P, SinkKind kKind, typename T>
__device__ __forceinline__ void RowKernelBody(const P& p, const SinkArgs<T>& s) {
  const int64_t units = p.Units();
  const int lanes = s.block / kUnit;  // block scaling: lanes per block (power of two)
  const float fp8_max = Fp8Max(s.format);
  WriteGroupScaleInv<kKind>(s, fp8_max);
  for (int64_t row = blockIdx.x; row < s.rows; row += gridDim.x) {
    RowState state = BeginRow<kKind>(s, row, fp8_max);
    const float scale = p.RowScale(row);
    for (int64_t base = 0; base < units; base += blockDim.x) {
      const int64_t u = base + threadIdx.x;
      const bool active = u < units;
      // The next step's inputs travel while this step computes: the quantizing sinks keep
      // a warp busy long enough between its loads that one unit in flight per thread
      // leaves DRAM idle (Nsight Compute: half the stall cycles wait on L1TEX).
      if (s.prefetch != 0 && u + blockDim.x < units) p.Prefetch(row, u + blockDim.x, s.prefetch);
      float v[P::kChunks][8];
      if (active) {
        p.Compute(row, u, scale, v, state.side);
      } else {
#pragma unroll
        for (int c = 0; c < P::kChunks; ++c)
#pragma unroll
          for (int i = 0; i < 8; ++i) v[c][i] = 0.0f;
      }
#pragma unroll
      for (int c = 0; c < P::kChunks; ++c) {
        SinkUnit<kKind>(s, row, p.Col(c, u), active ? p.Valid(c, u) : 0, v[c], lanes, fp8_max,
                        state);
      }
    }
    EndRow<P, kKind>(s, row, state);
  }
}

template <class P, SinkKind kKind, typename T>
__global__ void __launch_bounds__(512) RowKernel(P p, SinkArgs<T> s) {
  RowKernelBody<P, kKind, T>(p, s);
}

// RowKernel with registers capped for kMinBlocks resident blocks of 256 threads (launches
// of at most 256 threads): the activation-gradient producers (GradientMinBlocks), whose 64
// registers under RowKernel hold an SM to half its threads.
template <class P, SinkKind kKind, typename T, int kMinBlocks>
__global__ void __launch_bounds__(256, kMinBlocks) RowKernelCapped(P p, SinkArgs<T> s) {
  RowKernelBody<P, kKind, T>(p, s);
}

// The tiling of a StagedRowKernel launch. A block owns rows blockIdx.x, + gridDim.x, ...;
// each row is tiles_per_row tiles of tile_units units (the last one shorter), and tile i of
// the block's sequence waits on stage i % stages.
struct StagedTiling {
  int stages = 0;
  int tile_units = 0;         // a multiple of 32: block-scaling blocks never straddle tiles
  int64_t tiles_per_row = 0;
  int streams = 0;
  int stream_bytes = 0;       // bytes of one stream's segment of a full tile
};

template <class P, SinkKind kKind, typename T>
__global__ void __launch_bounds__(512) StagedRowKernel(P p, SinkArgs<T> s, StagedTiling tiling) {
  extern __shared__ __align__(128) unsigned char shared[];
  uint64_t* full = reinterpret_cast<uint64_t*>(shared);  // one mbarrier per stage
  unsigned char* buffers = shared + kStageBarrierBytes;   // [stages][streams][stream_bytes]
  const int64_t units = p.Units();
  const int lanes = s.block / kUnit;
  const float fp8_max = Fp8Max(s.format);
  const int64_t rows_mine =
      s.rows > blockIdx.x ? (s.rows - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int64_t tiles = rows_mine * tiling.tiles_per_row;
  // Cursors advance by increments: 64-bit divisions per tile cost as much as a tile's work.
  int64_t issued = 0, issue_row = blockIdx.x, issue_first = 0;  // thread 0's copy cursor

  // Starts the bulk copies of the next tile to copy into `stage` (one thread).
  auto issue_next = [&](int stage) {
    const int64_t left = units - issue_first;
    const int64_t count = left < tiling.tile_units ? left : tiling.tile_units;
    const uint32_t bytes = static_cast<uint32_t>(count * kUnit * sizeof(T));
    ExpectStageBytes(&full[stage], bytes * tiling.streams);
    for (int stream = 0; stream < tiling.streams; ++stream) {
      CopyToStage(buffers + (stage * tiling.streams + stream) * tiling.stream_bytes,
                  p.Segment(stream, issue_row, issue_first * kUnit), bytes, &full[stage]);
    }
    ++issued;
    issue_first += tiling.tile_units;
    if (issue_first >= units) {
      issue_first = 0;
      issue_row += gridDim.x;
    }
  };

  if (threadIdx.x == 0) {
    InitStageBarriers(full, tiling.stages);
    for (int stage = 0; stage < tiling.stages && issued < tiles; ++stage) issue_next(stage);
  }
  __syncthreads();

  WriteGroupScaleInv<kKind>(s, fp8_max);
  RowState state;
  float scale = 1.0f;
  int stage = 0;
  uint32_t phase = 0;
  int64_t row = blockIdx.x, first = 0;
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t left = units - first;
    const int count = static_cast<int>(left < tiling.tile_units ? left : tiling.tile_units);
    if (first == 0) {
      state = BeginRow<kKind>(s, row, fp8_max);
      scale = p.RowScale(row);
    }
    const T* segment[kMaxStreams];
#pragma unroll
    for (int stream = 0; stream < kMaxStreams; ++stream) {
      segment[stream] = reinterpret_cast<const T*>(
          buffers + (stage * tiling.streams + stream) * tiling.stream_bytes);
    }
    WaitStage(&full[stage], phase);
    for (int base = 0; base < count; base += blockDim.x) {
      const int local = base + static_cast<int>(threadIdx.x);
      const bool active = local < count;
      const int64_t u = first + local;
      float v[P::kChunks][8];
      if (active) {
        p.ComputeStaged(segment, local * kUnit, scale, v, state.side);
      } else {
#pragma unroll
        for (int c = 0; c < P::kChunks; ++c)
#pragma unroll
          for (int e = 0; e < 8; ++e) v[c][e] = 0.0f;
      }
#pragma unroll
      for (int c = 0; c < P::kChunks; ++c) {
        SinkUnit<kKind>(s, row, p.Col(c, u), active ? p.Valid(c, u) : 0, v[c], lanes, fp8_max,
                        state);
      }
    }
    __syncthreads();  // every thread is done with the stage: refill it
    if (threadIdx.x == 0 && issued < tiles) issue_next(stage);
    first += tiling.tile_units;
    if (first >= units) {
      EndRow<P, kKind>(s, row, state);
      first = 0;
      row += gridDim.x;
    }
    if (++stage == tiling.stages) {
      stage = 0;
      phase ^= 1;
    }
  }
}

constexpr int kDefaultRowPrefetch = 1;

// JAXFUSE_ROWWISE_PREFETCH: RowKernel prefetches each thread's next unit into L1 (1) or
// L2 (2), or not (0). Read once.
inline int RowPrefetchLevel() {
  static const int level = [] {
    if (const char* value = std::getenv("JAXFUSE_ROWWISE_PREFETCH")) {
      if (value[0] == '0' || value[0] == '1' || value[0] == '2') return value[0] - '0';
    }
    return kDefaultRowPrefetch;
  }();
  return level;
}

// JAXFUSE_ROWWISE_MAX_THREADS (64, 128, 256 or 512), or 0 when unset: an upper bound on
// threads per block that replaces the rules of ThreadsFor (a benchmark knob). Read once.
inline int RowThreadsOverride() {
  static const int max_threads = [] {
    if (const char* value = std::getenv("JAXFUSE_ROWWISE_MAX_THREADS")) {
      const int parsed = std::atoi(value);
      if (parsed == 64 || parsed == 128 || parsed == 256 || parsed == 512) return parsed;
    }
    return 0;
  }();
  return max_threads;
}

// RowKernelCapped's kMinBlocks for the activation-gradient producers (P::kSide), or 0 for
// RowKernel: JAXFUSE_ROWWISE_MIN_BLOCKS = 0, 5 or 6 (48 / 40 registers) for all of their
// sinks (a benchmark knob, read once); unset, 5 for the current-scaling passes of the pair
// producer. Those passes of the FP8 grouped MLP (T=65536, F=2048, 64-thread blocks) on the
// H200 (d6a2cef8, profile_kernels_s23_regs*): amax 316 -> 283 (48) / 285 (40) us,
// quantizing 276 -> 248 / 262 us; RowKernel's 64 registers left an SM at half its threads.
constexpr int kDefaultGradientMinBlocks = 5;

inline int RowMinBlocksOverride() {
  static const int min_blocks = [] {
    if (const char* value = std::getenv("JAXFUSE_ROWWISE_MIN_BLOCKS")) {
      const int parsed = std::atoi(value);
      if (parsed == 0 || parsed == 5 || parsed == 6) return parsed;
    }
    return -1;  // unset: the default rule
  }();
  return min_blocks;
}

template <class P, SinkKind kKind>
int GradientMinBlocks() {
  const int override_blocks = RowMinBlocksOverride();
  if (override_blocks >= 0) return override_blocks;
  const bool current = kKind == SinkKind::kAmax || kKind == SinkKind::kCurrent;
  return current && P::kChunks == 2 ? kDefaultGradientMinBlocks : 0;
}

constexpr int kDefaultMaxRowThreads = 256;

// Problems of at least this many units (rows x units per row) launch kLargeProblemThreads
// threads per block unless JAXFUSE_ROWWISE_MAX_THREADS is set. Measured on the H200 at
// T=65536, 2F=8192 (512 units per row, 33.5M units; b6cdc018 against 9e2113f4): 64
// threads per row, each walking 8 units, against 256 covering it in 2 steps: SwiGLU forward
// 0.514 -> 0.469 ms (76% -> 82% of copy), backward 0.910 -> 0.848, 1x128 quantized
// 0.688 -> 0.652, per-group current scaling 0.940 -> 0.825, its backward 1.720 -> 1.503;
// 512 threads was slower than 256 throughout. At T=2048, 2F=2048 (262K units) covering
// the row stayed faster (40 vs 58 us forward), hence the size rule.
constexpr int64_t kLargeProblemUnits = int64_t{1} << 22;
constexpr int kLargeProblemThreads = 64;

// Threads per block for `rows` rows of `units` units: enough to cover a row (up to
// kDefaultMaxRowThreads or the override) for small problems, kLargeProblemThreads for
// large ones; a multiple of 32 (block-scaling lane groups must not straddle warps).
inline int ThreadsFor(int64_t rows, int64_t units) {
  const int override_threads = RowThreadsOverride();
  if (override_threads == 0 && rows * units >= kLargeProblemUnits) return kLargeProblemThreads;
  const int max_threads = override_threads != 0 ? override_threads : kDefaultMaxRowThreads;
  int64_t threads = ((units + 31) / 32) * 32;
  if (threads < 64) threads = 64;
  if (threads > max_threads) threads = max_threads;
  return static_cast<int>(threads);
}

// One block per row. A resident wave of blocks walking rows with a stride (the amax carried
// over a group's rows, the next row prefetched) measured slower on the H200 (e0c2eacd, same
// run, T=65536, 2F=8192): SwiGLU forward 0.438 against 0.381 ms, 1x128 quantized 0.426
// against 0.366, per-group current scaling 0.657 against 0.625; also on the grouped MLP's
// 2048-wide rows (76690146: the activation gradient's amax pass 0.403 against 0.367 ms).
inline int GridFor(int64_t rows) {
  return static_cast<int>(rows < (1 << 20) ? (rows > 0 ? rows : 1) : (1 << 20));
}

// Reads a positive integer knob from the environment (fallback when unset or invalid).
inline int EnvInt(const char* name, int fallback) {
  if (const char* value = std::getenv(name)) {
    const int parsed = std::atoi(value);
    if (parsed > 0) return parsed;
  }
  return fallback;
}

// When and how the staged kernel runs (benchmark knobs, read once). JAXFUSE_ROWWISE_STAGED
// =0 never, =1 for every producer that supports it, unset: StagedByDefault.
// JAXFUSE_ROWWISE_STAGES (2-8), JAXFUSE_ROWWISE_STAGED_THREADS (64-512) and
// JAXFUSE_ROWWISE_TILE_UNITS (a multiple of 32) override the defaults below.
enum class StagedMode { kDefault, kNever, kAlways };

struct StagedConfig {
  StagedMode mode = StagedMode::kDefault;
  // Two stages: more resident blocks (warps) per SM beat deeper stages. SwiGLU backward at
  // T=65536, 2F=8192 bf16 (82ebaf3d): 2 stages 0.750 ms, 3 0.771, 4 0.821 (0.739 against
  // 0.853 at 7ca682fc).
  int stages = 2;
  int threads = 256;
  int tile_units = 512;  // two units per thread per tile: 8 KB per bf16 stream
};

inline const StagedConfig& GetStagedConfig() {
  static const StagedConfig config = [] {
    StagedConfig c;
    if (const char* value = std::getenv("JAXFUSE_ROWWISE_STAGED")) {
      c.mode = value[0] == '0' ? StagedMode::kNever : StagedMode::kAlways;
    }
    c.stages = std::min(8, std::max(2, EnvInt("JAXFUSE_ROWWISE_STAGES", c.stages)));
    const int threads = EnvInt("JAXFUSE_ROWWISE_STAGED_THREADS", c.threads);
    if (threads == 64 || threads == 128 || threads == 256 || threads == 512) c.threads = threads;
    const int tile_units = EnvInt("JAXFUSE_ROWWISE_TILE_UNITS", c.tile_units);
    if (tile_units % 32 == 0 && tile_units <= 4096) c.tile_units = tile_units;
    return c;
  }();
  return config;
}

// The tiling of `units` units per row over `streams` input streams of T, and its threads.
template <typename T>
StagedTiling StagedTilingFor(int64_t units, int streams, int* threads) {
  const StagedConfig& config = GetStagedConfig();
  StagedTiling tiling;
  const int64_t row_units = ((units + 31) / 32) * 32;
  tiling.tile_units = static_cast<int>(std::min<int64_t>(config.tile_units, row_units));
  tiling.stages = config.stages;
  tiling.streams = streams;
  auto stage_bytes = [&] { return streams * tiling.tile_units * kUnit * static_cast<int>(sizeof(T)); };
  while (kStageBarrierBytes + tiling.stages * stage_bytes() > kStagedMaxSharedBytes) {
    if (tiling.stages > 2) {
      --tiling.stages;
    } else {
      tiling.tile_units = std::max(32, (tiling.tile_units / 2) / 32 * 32);
    }
  }
  tiling.stream_bytes = tiling.tile_units * kUnit * static_cast<int>(sizeof(T));
  tiling.tiles_per_row = (units + tiling.tile_units - 1) / tiling.tile_units;
  *threads = std::min(config.threads, std::max(64, tiling.tile_units));
  return tiling;
}

// Whether producer P with sink kKind runs staged unless the environment says otherwise:
// the plain activation backward (three input streams, a store sink). Measured on the H200
// at T=65536, 2F=8192 bf16 (9f7fea60, 4 stages, against RowKernel): SwiGLU backward 0.754
// vs 0.844 ms (87% vs 77% of copy); the forward 0.491 vs 0.472 (2-3 stages at 82ebaf3d:
// 0.462-0.483, within noise of RowKernel), and the quantizing sinks, whose per-unit work
// wants more warps per SM than staged blocks leave, slower (1x128 0.729 vs 0.592,
// per-group current 1.157 vs 0.877 ms; with 2-3 stages 0.65-0.68 and 1.04-1.05).
template <class P, SinkKind kKind>
constexpr bool StagedByDefault() {
  return kKind == SinkKind::kStore && P::kSide;
}

// Launches the row kernel of producer p and sink kKind over s.rows rows of `units` units:
// StagedRowKernel when the producer's rows are 16-byte aligned (p.vector) and it is staged
// (StagedByDefault, JAXFUSE_ROWWISE_STAGED), else RowKernel (GridFor, ThreadsFor).
template <class P, SinkKind kKind, typename T>
void LaunchRowKernel(const P& p, const SinkArgs<T>& s, int64_t units, cudaStream_t stream) {
  if constexpr (P::kStaged) {
    const StagedMode mode = GetStagedConfig().mode;
    const bool staged = mode == StagedMode::kAlways ||
                        (mode == StagedMode::kDefault && StagedByDefault<P, kKind>());
    if (staged && p.vector && units > 0) {
      int threads = 0;
      const StagedTiling tiling = StagedTilingFor<T>(units, p.Streams(), &threads);
      const int shared_bytes = kStageBarrierBytes + tiling.stages * tiling.streams * tiling.stream_bytes;
      const void* kernel = reinterpret_cast<const void*>(&StagedRowKernel<P, kKind, T>);
      AllowStagedSharedMemory(kernel);
      const int64_t grid = std::min<int64_t>(s.rows, ResidentBlocks(kernel, threads, shared_bytes));
      StagedRowKernel<P, kKind, T><<<static_cast<int>(grid), threads, shared_bytes, stream>>>(
          p, s, tiling);
      return;
    }
  }
  SinkArgs<T> args = s;
  args.prefetch = RowPrefetchLevel();
  const int threads = ThreadsFor(s.rows, units);
  if constexpr (P::kSide) {
    if (threads <= 256) {
      switch (GradientMinBlocks<P, kKind>()) {
        case 5:
          RowKernelCapped<P, kKind, T, 5><<<GridFor(s.rows), threads, 0, stream>>>(p, args);
          return;
        case 6:
          RowKernelCapped<P, kKind, T, 6><<<GridFor(s.rows), threads, 0, stream>>>(p, args);
          return;
        default:
          break;
      }
    }
  }
  RowKernel<P, kKind, T><<<GridFor(s.rows), threads, 0, stream>>>(p, args);
}

inline bool PointerAligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Calls fn(T{}) with T the CUDA type of a float32/bfloat16/float16 buffer.
template <typename Fn>
auto DispatchFloat(ffi::DataType type, Fn&& fn) {
  switch (type) {
    case ffi::DataType::F32: return fn(float{});
    case ffi::DataType::BF16: return fn(__nv_bfloat16{});
    default: return fn(__half{});
  }
}

inline ffi::Error LaunchError(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return Internal(what, ": ", cudaGetErrorString(error));
  return ffi::Error::Success();
}

}  // namespace gpu
}  // namespace jaxfuse
