// CUDA handlers for the MoE token permutation (see jaxfuse/moe_permute.h).
//
// One block per token (the permute: a few tokens per iteration, grid-stride) handles that
// token's k copies, so each output row has exactly one writer: no atomics, deterministic
// sums. Threads walk a row in units of 8 elements: one 16-byte access for 16-bit types (two
// for fp32) whenever H is a multiple of 8 and the buffers are 16-byte aligned, with a scalar
// path otherwise.
// Accumulation (unpermute) and the weight-gradient dot products are fp32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <initializer_list>

#include "jaxfuse/ffi_common.h"
#include "jaxfuse/moe_permute.h"

namespace jaxfuse {
namespace {

constexpr int kUnit = 8;

__device__ __forceinline__ float LoadOne(const float* p) { return *p; }
__device__ __forceinline__ float LoadOne(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float LoadOne(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void StoreOne(float* p, float v) { *p = v; }
__device__ __forceinline__ void StoreOne(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void StoreOne(__half* p, float v) { *p = __float2half_rn(v); }

// 8 elements of T as raw bits: one uint4 for 16-bit types, two for fp32.
template <typename T>
struct Raw8 {
  static constexpr int kWords = sizeof(T) * kUnit / 16;
  uint4 word[kWords];
};

template <typename T>
__device__ __forceinline__ void LoadRaw(const T* p, bool vector, int valid, Raw8<T>& r) {
  if (vector && valid == kUnit) {
#pragma unroll
    for (int i = 0; i < Raw8<T>::kWords; ++i) r.word[i] = reinterpret_cast<const uint4*>(p)[i];
    return;
  }
  T* e = reinterpret_cast<T*>(r.word);
#pragma unroll
  for (int i = 0; i < kUnit; ++i) {
    if (i < valid) e[i] = p[i];
  }
}

template <typename T>
__device__ __forceinline__ void StoreRaw(T* p, bool vector, int valid, const Raw8<T>& r) {
  if (vector && valid == kUnit) {
#pragma unroll
    for (int i = 0; i < Raw8<T>::kWords; ++i) reinterpret_cast<uint4*>(p)[i] = r.word[i];
    return;
  }
  const T* e = reinterpret_cast<const T*>(r.word);
#pragma unroll
  for (int i = 0; i < kUnit; ++i) {
    if (i < valid) p[i] = e[i];
  }
}

template <typename T>
__device__ __forceinline__ void ToFloat8(const Raw8<T>& r, int valid, float (&v)[kUnit]) {
  const T* e = reinterpret_cast<const T*>(r.word);
#pragma unroll
  for (int i = 0; i < kUnit; ++i) v[i] = i < valid ? LoadOne(e + i) : 0.0f;
}

template <typename T>
__device__ __forceinline__ void FromFloat8(const float (&v)[kUnit], Raw8<T>& r) {
  T* e = reinterpret_cast<T*>(r.word);
#pragma unroll
  for (int i = 0; i < kUnit; ++i) StoreOne(e + i, v[i]);
}

struct Shape {
  int64_t tokens, topk, hidden, rows;
  bool vector;
  __device__ int64_t Units() const { return (hidden + kUnit - 1) / kUnit; }
  __device__ int Valid(int64_t u) const {
    const int64_t left = hidden - u * kUnit;
    return left >= kUnit ? kUnit : static_cast<int>(left);
  }
};

// 16-byte store that bypasses L2 retention (st.global.cs): the permuted rows are read again
// only by the next GEMM, long after they would have been evicted anyway.
template <typename T>
__device__ __forceinline__ void StoreRawStreaming(T* p, bool vector, int valid,
                                                  const Raw8<T>& r) {
  if (vector && valid == kUnit) {
#pragma unroll
    for (int i = 0; i < Raw8<T>::kWords; ++i) __stcs(reinterpret_cast<uint4*>(p) + i, r.word[i]);
    return;
  }
  StoreRaw(p, vector, valid, r);
}

// kTokens tokens per block iteration: a thread loads its unit of every token before the
// first store, so each thread keeps kTokens loads in flight instead of one.
template <typename T, int kTokens, bool kStreaming>
__global__ void PermuteKernel(const T* __restrict__ x, const int32_t* __restrict__ row_map,
                              T* __restrict__ out, Shape s) {
  const int64_t units = s.Units();
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kTokens; first < s.tokens;
       first += static_cast<int64_t>(gridDim.x) * kTokens) {
    const int count = s.tokens - first < kTokens ? static_cast<int>(s.tokens - first) : kTokens;
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
      const int valid = s.Valid(u);
      Raw8<T> r[kTokens];
#pragma unroll
      for (int i = 0; i < kTokens; ++i) {
        if (i < count) LoadRaw(x + (first + i) * s.hidden + u * kUnit, s.vector, valid, r[i]);
      }
#pragma unroll
      for (int i = 0; i < kTokens; ++i) {
        if (i >= count) break;
        const int64_t t = first + i;
        for (int64_t j = 0; j < s.topk; ++j) {
          const int32_t row = __ldg(row_map + t * s.topk + j);
          if (!RowInRange(row, s.rows)) continue;
          T* destination = out + row * s.hidden + u * kUnit;
          if constexpr (kStreaming) {
            StoreRawStreaming(destination, s.vector, valid, r[i]);
          } else {
            StoreRaw(destination, s.vector, valid, r[i]);
          }
        }
      }
    }
  }
}

template <typename T>
__global__ void UnpermuteKernel(const T* __restrict__ y, const int32_t* __restrict__ row_map,
                                const float* __restrict__ w, T* __restrict__ out, Shape s) {
  const int64_t units = s.Units();
  for (int64_t t = blockIdx.x; t < s.tokens; t += gridDim.x) {
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
      const int valid = s.Valid(u);
      float acc[kUnit] = {};
      for (int64_t j = 0; j < s.topk; ++j) {
        const int32_t row = __ldg(row_map + t * s.topk + j);
        if (!RowInRange(row, s.rows)) continue;
        const float weight = __ldg(w + t * s.topk + j);
        Raw8<T> r;
        LoadRaw(y + row * s.hidden + u * kUnit, s.vector, valid, r);
        float v[kUnit];
        ToFloat8(r, valid, v);
#pragma unroll
        for (int i = 0; i < kUnit; ++i) acc[i] = fmaf(weight, v[i], acc[i]);
      }
      Raw8<T> r;
      FromFloat8(acc, r);
      StoreRaw(out + t * s.hidden + u * kUnit, s.vector, valid, r);
    }
  }
}

// Block-wide sum; every thread gets the result. blockDim.x is a multiple of 32, <= 1024.
__device__ __forceinline__ float BlockSum(float value, float* shared) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // shared is reused across calls
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = lane < warps ? shared[lane] : 0.0f;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

template <typename T>
__global__ void UnpermuteBwdKernel(const T* __restrict__ dout, const T* __restrict__ y,
                                   const int32_t* __restrict__ row_map,
                                   const float* __restrict__ w, T* __restrict__ dy,
                                   float* __restrict__ dw, Shape s) {
  __shared__ float shared[32];
  const int64_t units = s.Units();
  for (int64_t t = blockIdx.x; t < s.tokens; t += gridDim.x) {
    for (int64_t j = 0; j < s.topk; ++j) {
      const int32_t row = __ldg(row_map + t * s.topk + j);
      const bool in_range = RowInRange(row, s.rows);  // uniform across the block
      const float weight = __ldg(w + t * s.topk + j);
      float dot = 0.0f;
      if (in_range) {
        for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
          const int valid = s.Valid(u);
          Raw8<T> rg, ry;
          LoadRaw(dout + t * s.hidden + u * kUnit, s.vector, valid, rg);
          LoadRaw(y + row * s.hidden + u * kUnit, s.vector, valid, ry);
          float g[kUnit], v[kUnit];
          ToFloat8(rg, valid, g);
          ToFloat8(ry, valid, v);
#pragma unroll
          for (int i = 0; i < kUnit; ++i) {
            dot = fmaf(g[i], v[i], dot);
            g[i] *= weight;
          }
          FromFloat8(g, rg);
          StoreRaw(dy + row * s.hidden + u * kUnit, s.vector, valid, rg);
        }
      }
      dot = BlockSum(dot, shared);
      if (threadIdx.x == 0) dw[t * s.topk + j] = dot;
    }
  }
}

inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline int ThreadsFor(int64_t hidden) {
  int64_t threads = ((((hidden + kUnit - 1) / kUnit) + 31) / 32) * 32;
  if (threads < 32) threads = 32;
  if (threads > 256) threads = 256;
  return static_cast<int>(threads);
}

inline int GridFor(int64_t tokens) {
  return static_cast<int>(tokens < (1 << 20) ? tokens : (1 << 20));
}

template <typename Fn>
ffi::Error DispatchFloat(ffi::DataType type, Fn&& fn) {
  switch (type) {
    case ffi::DataType::F32: return fn(float{});
    case ffi::DataType::BF16: return fn(__nv_bfloat16{});
    default: return fn(__half{});
  }
}

ffi::Error LaunchError(const char* what) {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return Internal(what, ": ", cudaGetErrorString(error));
  return ffi::Error::Success();
}

Shape MakeShape(const PermuteProblem& p, std::initializer_list<const void*> pointers) {
  bool vector = p.hidden % kUnit == 0;
  for (const void* pointer : pointers) vector = vector && Aligned16(pointer);
  return Shape{p.tokens, p.topk, p.hidden, p.rows, vector};
}

// Benchmark knobs, read once: JAXFUSE_MOE_PERMUTE_TOKENS (1, 2, 4 or 8 tokens per block
// iteration) and JAXFUSE_MOE_PERMUTE_STREAMING (0: plain stores; default 1, streaming).
// Four tokens: the DeepSeek-like layer's two permutes took 373 us per step against 500 with
// one token per iteration (H100, benchmarks/results/profile_kernels_s35perm_t{1,4}_*).
// Streaming stores: 331 against 374 us, as fast as the unpermute per byte; the grouped GEMMs
// after them took the same time as in the 8-token process (H100,
// profile_kernels_s46perm{stream,4,8}_*).
struct PermuteKnobs {
  int tokens = 4;
  bool streaming = true;
};

const PermuteKnobs& PermuteKnobsFromEnv() {
  static const PermuteKnobs knobs = [] {
    PermuteKnobs k;
    if (const char* value = std::getenv("JAXFUSE_MOE_PERMUTE_TOKENS")) {
      const int parsed = std::atoi(value);
      if (parsed == 1 || parsed == 2 || parsed == 4 || parsed == 8) k.tokens = parsed;
    }
    if (const char* value = std::getenv("JAXFUSE_MOE_PERMUTE_STREAMING")) {
      k.streaming = value[0] != '0';
    }
    return k;
  }();
  return knobs;
}

template <typename T, bool kStreaming>
void LaunchPermute(const T* x, const int32_t* row_map, T* out, const Shape& s, int tokens,
                   cudaStream_t stream) {
  const int threads = ThreadsFor(s.hidden);
  const int64_t iterations = (s.tokens + tokens - 1) / tokens;
  const int grid = GridFor(iterations);
  switch (tokens) {
    case 2: PermuteKernel<T, 2, kStreaming><<<grid, threads, 0, stream>>>(x, row_map, out, s); break;
    case 4: PermuteKernel<T, 4, kStreaming><<<grid, threads, 0, stream>>>(x, row_map, out, s); break;
    case 8: PermuteKernel<T, 8, kStreaming><<<grid, threads, 0, stream>>>(x, row_map, out, s); break;
    default: PermuteKernel<T, 1, kStreaming><<<grid, threads, 0, stream>>>(x, row_map, out, s);
  }
}

ffi::Error PermuteCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer row_map,
                       ffi::Result<ffi::AnyBuffer> out) {
  PermuteProblem p;
  if (auto e = ParsePermute(x, row_map, *out, &p); e.failure()) return e;
  if (p.rows == 0 || p.hidden == 0) return ffi::Error::Success();
  const Shape s = MakeShape(p, {x.untyped_data(), out->untyped_data()});
  const PermuteKnobs& knobs = PermuteKnobsFromEnv();
  return DispatchFloat(x.element_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* source = static_cast<const T*>(x.untyped_data());
    T* destination = static_cast<T*>(out->untyped_data());
    if (knobs.streaming) {
      LaunchPermute<T, true>(source, row_map.typed_data<int32_t>(), destination, s,
                             knobs.tokens, stream);
    } else {
      LaunchPermute<T, false>(source, row_map.typed_data<int32_t>(), destination, s,
                              knobs.tokens, stream);
    }
    return LaunchError("moe permute kernel");
  });
}

ffi::Error UnpermuteCuda(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer row_map,
                         ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out) {
  PermuteProblem p;
  if (auto e = ParseUnpermute(y, row_map, w, *out, &p); e.failure()) return e;
  if (p.tokens == 0 || p.hidden == 0) return ffi::Error::Success();
  if (p.topk == 0) {  // no copies: zeros
    return cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream) == cudaSuccess
               ? ffi::Error::Success()
               : Internal("zeroing the unpermute output failed");
  }
  const Shape s = MakeShape(p, {y.untyped_data(), out->untyped_data()});
  return DispatchFloat(y.element_type(), [&](auto zero) {
    using T = decltype(zero);
    UnpermuteKernel<T><<<GridFor(p.tokens), ThreadsFor(p.hidden), 0, stream>>>(
        static_cast<const T*>(y.untyped_data()), row_map.typed_data<int32_t>(),
        w.typed_data<float>(), static_cast<T*>(out->untyped_data()), s);
    return LaunchError("moe unpermute kernel");
  });
}

ffi::Error UnpermuteBwdCuda(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer y,
                            ffi::AnyBuffer row_map, ffi::AnyBuffer w,
                            ffi::Result<ffi::AnyBuffer> dy, ffi::Result<ffi::AnyBuffer> dw) {
  PermuteProblem p;
  if (auto e = ParseUnpermuteBwd(dout, y, row_map, w, *dy, *dw, &p); e.failure()) return e;
  if (p.rows == 0) return ffi::Error::Success();
  const Shape s = MakeShape(p, {dout.untyped_data(), y.untyped_data(), dy->untyped_data()});
  return DispatchFloat(y.element_type(), [&](auto zero) {
    using T = decltype(zero);
    UnpermuteBwdKernel<T><<<GridFor(p.tokens), ThreadsFor(p.hidden), 0, stream>>>(
        static_cast<const T*>(dout.untyped_data()), static_cast<const T*>(y.untyped_data()),
        row_map.typed_data<int32_t>(), w.typed_data<float>(),
        static_cast<T*>(dy->untyped_data()), dw->typed_data<float>(), s);
    return LaunchError("moe unpermute backward kernel");
  });
}

}  // namespace
}  // namespace jaxfuse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseMoePermuteCuda, jaxfuse::PermuteCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // x [T, H]
                                  .Arg<xla::ffi::AnyBuffer>()   // row_map int32 [T, k]
                                  .Ret<xla::ffi::AnyBuffer>(),  // out [T*k, H]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseMoeUnpermuteCuda, jaxfuse::UnpermuteCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // y_sorted [T*k, H]
                                  .Arg<xla::ffi::AnyBuffer>()   // row_map int32 [T, k]
                                  .Arg<xla::ffi::AnyBuffer>()   // combine_weights f32 [T, k]
                                  .Ret<xla::ffi::AnyBuffer>(),  // out [T, H]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseMoeUnpermuteBwdCuda, jaxfuse::UnpermuteBwdCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // d_out [T, H]
                                  .Arg<xla::ffi::AnyBuffer>()   // y_sorted [T*k, H]
                                  .Arg<xla::ffi::AnyBuffer>()   // row_map int32 [T, k]
                                  .Arg<xla::ffi::AnyBuffer>()   // combine_weights f32 [T, k]
                                  .Ret<xla::ffi::AnyBuffer>()   // d_y_sorted [T*k, H]
                                  .Ret<xla::ffi::AnyBuffer>(),  // d_combine_weights f32 [T, k]
                              {xla::ffi::Traits::kCmdBufferCompatible});
