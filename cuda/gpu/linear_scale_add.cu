// CUDA handlers for the scaled matrix product (see jaxfuse/linear_scale_add.h) through
// cuBLASLt: alpha in the epilogue, and for linear_scale_add beta = 1 with C = D = the
// residual buffer, so the product accumulates into the residual in place. linear_scale_add's
// 16-bit forward runs the CUTLASS residual GEMM instead (jaxfuse/residual_gemm.h), where
// cuBLASLt would round twice; its FP8 forward does with JAXFUSE_LINEAR_SCALE_ADD_GEMM=cutlass.
//
// Stages: instantiate validates the shapes once and builds the cuBLASLt descriptors;
// initialize creates the device's handle and picks the algorithm: by default cuBLASLt's
// heuristic's first choice. JAXFUSE_CUBLASLT_AUTOTUNE=1 times up to 8 heuristic candidates
// once on scratch buffers of the problem's shapes, as XLA's autotuner does for its own
// GEMMs; =sustained times each over ~50 ms of back-to-back runs on random bits after as
// long a warm-up, the regime of a training step under the GPU's power cap, where a burst's
// ranking need not hold. JAXFUSE_CUBLASLT_LOG=1 prints every candidate's times, the choice,
// and why the candidates went untimed when they did. Timing is opt-in: on an H100 the
// sustained picks did not speed up the FP8 linear_scale_add end to end (session 48).
// Execute only enqueues one GEMM. Nothing syncs or allocates in execute, so the
// handlers are command-buffer (CUDA graph) compatible.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "cublaslt.h"
#include "jaxfuse/ffi_common.h"
#include "jaxfuse/linear_scale_add.h"
#include "jaxfuse/residual_gemm.h"
#include "occupancy.cuh"

namespace jaxfuse {
namespace {

cudaDataType_t CudaType(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::BF16: return CUDA_R_16BF;
    case ffi::DataType::F16: return CUDA_R_16F;
    case ffi::DataType::F8E4M3FN: return CUDA_R_8F_E4M3;
    case ffi::DataType::F8E5M2: return CUDA_R_8F_E5M2;
    default: return CUDA_R_32F;
  }
}

// Largest power of two (up to 256) dividing the address: cuBLASLt's heuristic assumes
// 256-byte aligned operands unless told otherwise.
uint32_t Alignment(const void* pointer) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

size_t ElementBytes(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return 4;
    case ffi::DataType::BF16:
    case ffi::DataType::F16: return 2;
    default: return 1;  // FP8
  }
}

enum class Autotune { kOff, kBurst, kSustained };

Autotune AutotuneMode() {
  const char* value = std::getenv("JAXFUSE_CUBLASLT_AUTOTUNE");
  if (value == nullptr || std::strcmp(value, "0") == 0) return Autotune::kOff;
  if (std::strcmp(value, "sustained") == 0) return Autotune::kSustained;
  return Autotune::kBurst;
}

bool AutotuneLog() {
  const char* value = std::getenv("JAXFUSE_CUBLASLT_LOG");
  return value != nullptr && std::strcmp(value, "0") != 0;
}

// JAXFUSE_CUBLASLT_CANDIDATE=i runs the heuristic's i-th candidate (the last one where it
// returns fewer), untimed: for diagnosing one algorithm's numerics or speed. -1 when unset.
int ForcedCandidate() {
  const char* value = std::getenv("JAXFUSE_CUBLASLT_CANDIDATE");
  return value == nullptr || *value == '\0' ? -1 : std::max(std::atoi(value), 0);
}

// JAXFUSE_CUBLASLT_COMPUTE=pedantic asks cuBLASLt for CUBLAS_COMPUTE_32F_PEDANTIC instead of
// CUBLAS_COMPUTE_32F for 16-bit products: an experiment on whether its epilogue then adds
// the residual before the one rounding to the 16-bit output
// (scripts/probe_linear_rounding.py --compute pedantic).
cublasComputeType_t ComputeType() {
  const char* value = std::getenv("JAXFUSE_CUBLASLT_COMPUTE");
  return value != nullptr && std::strcmp(value, "pedantic") == 0 ? CUBLAS_COMPUTE_32F_PEDANTIC
                                                                 : CUBLAS_COMPUTE_32F;
}

// JAXFUSE_LINEAR_SCALE_ADD_GEMM picks linear_scale_add's forward GEMM with a 16-bit
// residual: unset, the CUTLASS residual GEMM for 16-bit operands and cuBLASLt for FP8 ones;
// "cutlass", the CUTLASS kernels for both (one rounding everywhere, but on an H100 the FP8
// step ran 1-3.5% slower than on cuBLASLt: session 53,
// benchmarks/results/linear_scale_add_fp8_s53*); "cublaslt", cuBLASLt for both (A/B runs).
// Read once per process.
enum class ForwardGemm { kDefault, kCutlass, kCublasLt };

ForwardGemm ForwardGemmChoice() {
  static const ForwardGemm choice = [] {
    const char* value = std::getenv("JAXFUSE_LINEAR_SCALE_ADD_GEMM");
    if (value != nullptr && std::strcmp(value, "cublaslt") == 0) return ForwardGemm::kCublasLt;
    if (value != nullptr && std::strcmp(value, "cutlass") == 0) return ForwardGemm::kCutlass;
    return ForwardGemm::kDefault;
  }();
  return choice;
}

// Random bits shaped into finite values of one element type, one 32-bit word per step:
// word = (hash & keep) | set. Tensor-core power depends on how many bits toggle, so a
// sustained timing on constant data would run cooler than a training step does.
struct RandomFill {
  uint32_t keep;
  uint32_t set;
};

RandomFill RandomFillFor(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::BF16: return {0x80FF80FFu, 0x3F003F00u};  // +-[0.5, 2)
    case ffi::DataType::F16: return {0x87FF87FFu, 0x38003800u};   // +-[0.5, 2)
    case ffi::DataType::F8E4M3FN: return {0xF7F7F7F7u, 0u};       // exponent < 15: no NaN
    case ffi::DataType::F8E5M2: return {0xFBFBFBFBu, 0u};         // exponent < 31: no Inf/NaN
    default: return {0x807FFFFFu, 0x3F000000u};                   // fp32 +-[0.5, 1)
  }
}

__global__ void RandomFillKernel(uint32_t* words, size_t count, RandomFill fill, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < count;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t hash = static_cast<uint32_t>(i) * 0x9E3779B9u + seed;  // lowbias32
    hash ^= hash >> 16;
    hash *= 0x7FEB352Du;
    hash ^= hash >> 15;
    hash *= 0x846CA68Bu;
    hash ^= hash >> 16;
    words[i] = (hash & fill.keep) | fill.set;
  }
}

// Device memory for the autotuning scratch: stream-ordered (no device-wide sync) where the
// device's memory pool allows, else cudaMalloc (FastestCandidate relaxes the thread's
// capture mode first); freed on scope exit.
struct ScratchBuffer {
  void* data = nullptr;
  size_t size_bytes = 0;
  cudaStream_t stream;
  bool stream_ordered = true;
  std::string async_error;  // why cudaMallocAsync failed, when it did (for the log)

  ScratchBuffer(size_t bytes, cudaStream_t stream_) : stream(stream_) {
    bytes = (std::max<size_t>(bytes, 256) + 3) / 4 * 4;  // whole words for RandomFillKernel
    if (cudaError_t status = cudaMallocAsync(&data, bytes, stream); status != cudaSuccess) {
      async_error = cudaGetErrorString(status);
      cudaGetLastError();
      stream_ordered = false;
      if (cudaMalloc(&data, bytes) != cudaSuccess) {
        data = nullptr;
        return;
      }
    }
    // Small finite values (0x3C3C: bf16 ~0.0115, f16 ~1.06, fp32 ~0.0115): no NaN or Inf
    // paths.
    cudaMemsetAsync(data, 0x3C, bytes, stream);
    size_bytes = bytes;
  }
  // Overwrites the buffer with random finite values of `type` (sustained timing).
  void Randomize(ffi::DataType type, uint32_t seed) {
    if (!data) return;
    const size_t words = size_bytes / 4;
    const unsigned blocks = static_cast<unsigned>(std::min<size_t>((words + 255) / 256, 4096));
    RandomFillKernel<<<blocks, 256, 0, stream>>>(static_cast<uint32_t*>(data), words,
                                                 RandomFillFor(type), seed);
  }
  ~ScratchBuffer() {
    if (!data) return;
    if (stream_ordered) {
      cudaFreeAsync(data, stream);
    } else {
      cudaStreamSynchronize(stream);
      cudaFree(data);
    }
  }
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
};

#define JAXFUSE_RETURN_IF_CUBLAS_ERROR(expression)                                       \
  do {                                                                                   \
    const cublasStatus_t status_ = (expression);                                         \
    if (status_ != CUBLAS_STATUS_SUCCESS) {                                              \
      return Internal(#expression " failed: ", cublaslt::StatusString(status_));         \
    }                                                                                    \
  } while (0)

// Per custom-call state: the validated problem, its descriptors, and per device (and
// operand alignment) the chosen algorithm. Shared by the devices of one executable, so
// the algorithm table is guarded.
struct MatmulState {
  static ffi::TypeId id;

  MatmulProblem problem;
  bool accumulate = false;
  bool fp8 = false;
  bool fast_accumulation = false;  // FP8 only: TransformerEngine uses it for the forward GEMM
  size_t workspace_bytes = 0;
  const cublaslt::Api* api = nullptr;
  cublasLtMatrixLayout_t layout_a = nullptr;  // cuBLAS "A": our b
  cublasLtMatrixLayout_t layout_b = nullptr;  // cuBLAS "B": our a
  cublasLtMatrixLayout_t layout_c = nullptr;  // C and D

  // One per device (and alignment): its own descriptor, since FP8 scale pointers are set
  // on it at each execution and devices run on their own threads.
  struct Algorithm {
    cublasLtHandle_t handle;
    cublasLtMatmulDesc_t desc;
    cublasLtMatmulAlgo_t algo;
  };
  using AlgorithmKey = std::tuple<int, uint32_t, uint32_t, uint32_t>;  // device, alignments
  std::mutex mutex;
  std::map<AlgorithmKey, Algorithm> algorithms;

  ~MatmulState() {
    if (!api) return;
    for (auto& [key, algorithm] : algorithms) api->MatmulDescDestroy(algorithm.desc);
    if (layout_c) api->MatrixLayoutDestroy(layout_c);
    if (layout_b) api->MatrixLayoutDestroy(layout_b);
    if (layout_a) api->MatrixLayoutDestroy(layout_a);
  }

  bool Empty() const { return problem.p == 0 || problem.q == 0 || problem.r == 0; }

  // Row-major out[P, Q] = op(a) op(b) is column-major out^T[Q, P] = op(b)^T op(a)^T, so
  // cuBLAS's A is our b and its B is our a, with the same transpose flags.
  ffi::Error BuildDescriptors() {
    std::string error;
    api = cublaslt::GetApi(&error);
    if (!api) return Internal(error);
    if (Empty()) return ffi::Error::Success();
    const int64_t p = problem.p, q = problem.q, r = problem.r;
    const cudaDataType_t a_type = CudaType(problem.input_type);
    const cudaDataType_t b_type = CudaType(problem.b_type);
    const cudaDataType_t output = CudaType(problem.output_type);
    // Stored shapes, column-major view: b is [R, Q] (or [Q, R]) row-major.
    if (problem.transpose_b) {
      JAXFUSE_RETURN_IF_CUBLAS_ERROR(api->MatrixLayoutCreate(&layout_a, b_type, r, q, r));
    } else {
      JAXFUSE_RETURN_IF_CUBLAS_ERROR(api->MatrixLayoutCreate(&layout_a, b_type, q, r, q));
    }
    if (problem.transpose_a) {
      JAXFUSE_RETURN_IF_CUBLAS_ERROR(api->MatrixLayoutCreate(&layout_b, a_type, p, r, p));
    } else {
      JAXFUSE_RETURN_IF_CUBLAS_ERROR(api->MatrixLayoutCreate(&layout_b, a_type, r, p, r));
    }
    JAXFUSE_RETURN_IF_CUBLAS_ERROR(api->MatrixLayoutCreate(&layout_c, output, q, p, q));
    return ffi::Error::Success();
  }

  ffi::Error CreateDesc(cublasLtMatmulDesc_t* desc) const {
    const cublasComputeType_t compute = fp8 ? CUBLAS_COMPUTE_32F : ComputeType();
    JAXFUSE_RETURN_IF_CUBLAS_ERROR(api->MatmulDescCreate(desc, compute, CUDA_R_32F));
    const cublasOperation_t trans_a = problem.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t trans_b = problem.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    JAXFUSE_RETURN_IF_CUBLAS_ERROR(api->MatmulDescSetAttribute(
        *desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
    JAXFUSE_RETURN_IF_CUBLAS_ERROR(api->MatmulDescSetAttribute(
        *desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
    if (fp8) {
      const int8_t fast = fast_accumulation ? 1 : 0;
      JAXFUSE_RETURN_IF_CUBLAS_ERROR(api->MatmulDescSetAttribute(
          *desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
    }
    return ffi::Error::Success();
  }

  // The algorithm for this device and these operand alignments, found once. With
  // `autotune` (initialize stage only: it synchronizes) and JAXFUSE_CUBLASLT_AUTOTUNE set,
  // the heuristic's candidates are timed and the fastest kept; otherwise its first.
  ffi::Error FindAlgorithm(int device, const void* a, const void* b, const void* out,
                           const Algorithm** found, bool autotune = false) {
    const AlgorithmKey key{device, Alignment(a), Alignment(b), Alignment(out)};
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = algorithms.find(key); it != algorithms.end()) {
      *found = &it->second;
      return ffi::Error::Success();
    }
    Algorithm algorithm{};
    JAXFUSE_RETURN_IF_CUBLAS_ERROR(cublaslt::GetHandle(device, &algorithm.handle));
    if (auto error = CreateDesc(&algorithm.desc); error.failure()) return error;
    cublasLtMatmulPreference_t preference = nullptr;
    JAXFUSE_RETURN_IF_CUBLAS_ERROR(api->MatmulPreferenceCreate(&preference));
    auto set = [&](cublasLtMatmulPreferenceAttributes_t attribute, auto value) {
      return api->MatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value));
    };
    set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(workspace_bytes));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, std::get<2>(key));  // cuBLAS A = b
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, std::get<1>(key));  // cuBLAS B = a
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, std::get<3>(key));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, std::get<3>(key));
    // A split-K algorithm may keep its partial sums in the output type or add them up in
    // the output buffer: for a 16-bit output, one rounding per partial sum. fp32 partials
    // only, as torch's allow_bf16_reduced_precision_reduction = False. (The epilogue still
    // rounds alpha * a @ b to the 16-bit output type before adding c, with or without
    // split-K: every candidate did on an H100, scripts/probe_linear_rounding.py.)
    const cudaDataType_t output_type = CudaType(problem.output_type);
    if (output_type == CUDA_R_16BF || output_type == CUDA_R_16F) {
      set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
          static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));
    }
    constexpr int kCandidates = 8;
    const int forced = ForcedCandidate();
    const Autotune mode = autotune && forced < 0 ? AutotuneMode() : Autotune::kOff;
    // Initialize asks for kCandidates even untimed: results[0] of that query is what every
    // measured run used.
    cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
    int count = 0;
    const cublasStatus_t status = api->MatmulAlgoGetHeuristic(
        algorithm.handle, algorithm.desc, layout_a, layout_b, layout_c, layout_c, preference,
        autotune || forced >= 0 ? kCandidates : 1, results, &count);
    api->MatmulPreferenceDestroy(preference);
    if (status != CUBLAS_STATUS_SUCCESS || count == 0) {
      api->MatmulDescDestroy(algorithm.desc);
      return Internal("cuBLASLt found no algorithm for a [", problem.p, ", ", problem.q,
                      ", ", problem.r, "] product: ", cublaslt::StatusString(status));
    }
    const int best = forced >= 0 ? std::min(forced, count - 1)
                     : mode != Autotune::kOff && count > 1
                         ? FastestCandidate(device, algorithm, results, count, mode)
                         : 0;
    if (mode == Autotune::kOff && AutotuneLog()) {  // FastestCandidate logs the timed modes
      for (int i = 0; i < count; ++i) {
        std::fprintf(stderr, "%s candidate %d (%s)%s\n", LogPrefix().c_str(), i,
                     Describe(results[i].algo).c_str(), i == best ? ": chosen, untimed" : "");
      }
    }
    algorithm.algo = results[best].algo;
    *found = &algorithms.emplace(key, algorithm).first->second;
    return ffi::Error::Success();
  }

  // "jaxfuse cuBLASLt autotune [P, Q, R] fp8": the start of this problem's log lines.
  std::string LogPrefix() const {
    return "jaxfuse cuBLASLt autotune [" + std::to_string(problem.p) + ", " +
           std::to_string(problem.q) + ", " + std::to_string(problem.r) + "]" +
           (fp8 ? " fp8" : "");
  }

  // cuBLASLt's configuration of a candidate, for the log: algorithm id, tile, stages, the
  // split-K count and its reduction scheme (a CUBLASLT_REDUCTION_SCHEME_* value).
  std::string Describe(const cublasLtMatmulAlgo_t& algo) const {
    int id = -1, tile = -1, stages = -1, split_k = -1;
    uint32_t reduction = 0xFFFFFFFFu;
    size_t written = 0;
    api->MatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &written);
    api->MatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile),
                                      &written);
    api->MatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages,
                                      sizeof(stages), &written);
    api->MatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split_k,
                                      sizeof(split_k), &written);
    api->MatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction,
                                      sizeof(reduction), &written);
    return "algo " + std::to_string(id) + " tile " + std::to_string(tile) + " stages " +
           std::to_string(stages) + " split-k " + std::to_string(split_k) + " reduction " +
           std::to_string(static_cast<int>(reduction));
  }

  // Index of the fastest of `count` candidates, timed on scratch buffers of this problem's
  // shapes on a private stream: the minimum of 3 timed runs after one warm-up each, or
  // with Autotune::kSustained the mean over ~kSustainedMs of back-to-back runs on random
  // bits, after as long a warm-up. Any failure (no memory, a candidate that errors) falls
  // back to the heuristic's order.
  int FastestCandidate(int device, const Algorithm& algorithm,
                       const cublasLtMatmulHeuristicResult_t* results, int count,
                       Autotune mode) const {
    constexpr float kSustainedMs = 50.0f;
    // The FP8 scale scratch: one float per operand, each at its own 256-byte boundary as
    // XLA places buffers. cuBLASLt rejects misaligned scale pointers: with b's scale 4
    // bytes after a's, every FP8 candidate failed with CUBLAS_STATUS_NOT_SUPPORTED.
    constexpr size_t kScaleStride = 256;
    const bool sustained = mode == Autotune::kSustained;
    const bool log = AutotuneLog();
    // Should XLA initialize a custom call while this thread captures a CUDA graph (command
    // buffers), synchronizing or allocating calls would fail: relax the thread's capture
    // mode for the timing (our private stream is never captured) and restore it after.
    cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&capture_mode);
    int previous_device = 0;
    cudaGetDevice(&previous_device);
    if (previous_device != device) cudaSetDevice(device);
    const size_t a_bytes = problem.p * problem.r * ElementBytes(problem.input_type);
    const size_t b_bytes = problem.q * problem.r * ElementBytes(problem.b_type);
    const size_t out_bytes = problem.p * problem.q * ElementBytes(problem.output_type);
    size_t free_bytes = 0, total_bytes = 0;
    cudaStream_t stream = nullptr;
    cudaEvent_t start = nullptr, stop = nullptr;
    int best = -1;
    // Why the candidates could not be timed (the heuristic's order is kept), for the log.
    std::string skipped;
    auto succeeded = [&](cudaError_t status, const char* what) {
      if (status != cudaSuccess) skipped = std::string(what) + ": " + cudaGetErrorString(status);
      return status == cudaSuccess;
    };
    const size_t scratch_bytes = a_bytes + b_bytes + out_bytes + workspace_bytes;
    if (succeeded(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo") &&
        scratch_bytes >= free_bytes / 2) {
      skipped = "scratch of " + std::to_string(scratch_bytes) + " bytes, " +
                std::to_string(free_bytes) + " free";
    }
    if (skipped.empty() &&
        succeeded(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate") &&
        succeeded(cudaEventCreate(&start), "cudaEventCreate") &&
        succeeded(cudaEventCreate(&stop), "cudaEventCreate")) {
      ScratchBuffer a(a_bytes, stream), b(b_bytes, stream), out(out_bytes, stream),
          workspace(workspace_bytes, stream), scales(2 * kScaleStride, stream);
      const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
      // FP8: the scale pointers on the descriptor point at scratch (finite 0x3C3C3C3C
      // floats) while timing; Execute sets the real ones before every product.
      bool ready = a.data && b.data && out.data && workspace.data && scales.data;
      std::string async_error;
      for (const ScratchBuffer* buffer : {&a, &b, &out, &workspace, &scales}) {
        if (async_error.empty()) async_error = buffer->async_error;
      }
      if (!ready) skipped = "no scratch memory (cudaMallocAsync: " + async_error + ")";
      if (log && ready && !async_error.empty()) {
        std::fprintf(stderr, "%s: cudaMallocAsync failed (%s), scratch from cudaMalloc\n",
                     LogPrefix().c_str(), async_error.c_str());
      }
      if (ready && sustained) {
        a.Randomize(problem.input_type, 1);
        b.Randomize(problem.b_type, 2);
        out.Randomize(problem.output_type, 3);
        scales.Randomize(ffi::DataType::F32, 4);
      }
      if (ready && fp8) {
        const void* a_scale = scales.data;
        const void* b_scale = static_cast<const char*>(scales.data) + kScaleStride;
        ready = api->MatmulDescSetAttribute(algorithm.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                            &a_scale, sizeof(a_scale)) == CUBLAS_STATUS_SUCCESS &&
                api->MatmulDescSetAttribute(algorithm.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                            &b_scale, sizeof(b_scale)) == CUBLAS_STATUS_SUCCESS;
        if (!ready) skipped = "setting the FP8 scale pointers failed";
      }
      float best_ms = 0.0f;
      for (int i = 0; ready && i < count; ++i) {
        auto run = [&] {
          return api->Matmul(algorithm.handle, algorithm.desc, &alpha, b.data, layout_a, a.data,
                             layout_b, &beta, out.data, layout_c, out.data, layout_c,
                             &results[i].algo, workspace.data, workspace_bytes, stream);
        };
        if (const cublasStatus_t warm_up = run(); warm_up != CUBLAS_STATUS_SUCCESS) {
          if (log) {
            std::fprintf(stderr, "%s candidate %d (%s) failed: %s\n", LogPrefix().c_str(), i,
                         Describe(results[i].algo).c_str(),
                         cublaslt::StatusString(warm_up).c_str());
          }
          continue;
        }
        float fastest = -1.0f;
        for (int repeat = 0; repeat < 3; ++repeat) {
          float ms = 0.0f;
          cudaError_t status = cudaEventRecord(start, stream);
          const bool ran = status == cudaSuccess && run() == CUBLAS_STATUS_SUCCESS;
          if (ran) status = cudaEventRecord(stop, stream);
          if (ran && status == cudaSuccess) status = cudaEventSynchronize(stop);
          if (ran && status == cudaSuccess) status = cudaEventElapsedTime(&ms, start, stop);
          if (!ran || status != cudaSuccess) {
            if (log) {
              std::fprintf(stderr, "%s candidate %d (%s) failed: timing: %s\n",
                           LogPrefix().c_str(), i, Describe(results[i].algo).c_str(),
                           ran ? cudaGetErrorString(status) : "a timed run failed");
            }
            cudaGetLastError();
            fastest = -1.0f;
            break;
          }
          if (fastest < 0.0f || ms < fastest) fastest = ms;
        }
        if (fastest < 0.0f) continue;  // logged above
        float score = fastest;
        if (sustained) {
          // As many runs as fill kSustainedMs at the burst speed: once to reach the power
          // and clock state of a long step, once timed.
          const int runs = static_cast<int>(std::min(kSustainedMs / fastest + 1.0f, 100000.0f));
          bool ok = true;
          for (int pass = 0; ok && pass < 2; ++pass) {
            if (pass == 1) ok = cudaEventRecord(start, stream) == cudaSuccess;
            for (int run_index = 0; ok && run_index < runs; ++run_index) {
              ok = run() == CUBLAS_STATUS_SUCCESS;
            }
          }
          float ms = 0.0f;
          ok = ok && cudaEventRecord(stop, stream) == cudaSuccess &&
               cudaEventSynchronize(stop) == cudaSuccess &&
               cudaEventElapsedTime(&ms, start, stop) == cudaSuccess;
          score = ok ? ms / runs : -1.0f;
        }
        if (log) {
          const std::string sustained_ms =
              !sustained ? "" : score < 0.0f ? ", sustained failed" :
                                               ", sustained " + std::to_string(score) + " ms";
          std::fprintf(stderr, "%s candidate %d (%s): burst %.4f ms%s\n", LogPrefix().c_str(),
                       i, Describe(results[i].algo).c_str(), fastest, sustained_ms.c_str());
        }
        if (score >= 0.0f && (best < 0 || score < best_ms)) {
          best = i;
          best_ms = score;
        }
      }
    }  // the scratch is freed on `stream` here
    if (stream) cudaStreamSynchronize(stream);
    if (stop) cudaEventDestroy(stop);
    if (start) cudaEventDestroy(start);
    if (stream) cudaStreamDestroy(stream);
    cudaGetLastError();  // a failed scratch allocation is not the caller's error
    if (previous_device != device) cudaSetDevice(previous_device);
    cudaThreadExchangeStreamCaptureMode(&capture_mode);
    if (log) {
      std::fprintf(stderr, "%s: candidate %d of %d chosen%s%s\n", LogPrefix().c_str(),
                   best < 0 ? 0 : best, count, skipped.empty() ? "" : ", untimed: ",
                   skipped.c_str());
    }
    return best < 0 ? 0 : best;
  }
};

ffi::TypeId MatmulState::id = {};

ffi::ErrorOr<std::unique_ptr<MatmulState>> MakeState(const ffi::AnyBuffer& a,
                                                     const ffi::AnyBuffer& b,
                                                     const ffi::AnyBuffer* c,
                                                     const ffi::AnyBuffer& out,
                                                     const ffi::AnyBuffer& workspace,
                                                     bool transpose_a, bool transpose_b,
                                                     bool fast_accumulation = false) {
  auto state = std::make_unique<MatmulState>();
  // ffi::Unexpected: jaxlib 0.10's ErrorOr has no implicit conversion from Error.
  if (auto error = ParseMatmulProblem(a, b, c, out, transpose_a, transpose_b, &state->problem);
      error.failure()) {
    return ffi::Unexpected<ffi::Error>(std::move(error));
  }
  state->accumulate = c != nullptr;
  state->fp8 = IsFp8(state->problem.input_type);
  state->fast_accumulation = fast_accumulation;
  state->workspace_bytes = workspace.size_bytes();
  if (auto error = state->BuildDescriptors(); error.failure()) {
    return ffi::Unexpected<ffi::Error>(std::move(error));
  }
  return std::move(state);
}

// The CUTLASS residual GEMM an accumulating product runs (alignment permitting), if any:
// the 16-bit forward a [p, r] @ b [r, q] + c, all of one 16-bit type; with
// JAXFUSE_LINEAR_SCALE_ADD_GEMM=cutlass also the FP8 forward e4m3 a [p, r] @ (e4m3
// b [q, r])^T + c with a 16-bit c. Both add c in fp32 before their one rounding; the rest
// (f32 outputs, which round once on cuBLASLt too) stays on cuBLASLt.
enum class ResidualKernel { kNone, kSixteenBit, kFp8 };

ResidualKernel ResidualKernelFor(const MatmulProblem& problem) {
  const ffi::DataType type = problem.output_type;
  const ForwardGemm choice = ForwardGemmChoice();
  if (choice == ForwardGemm::kCublasLt || problem.transpose_a ||
      (type != ffi::DataType::BF16 && type != ffi::DataType::F16)) {
    return ResidualKernel::kNone;
  }
  if (!problem.transpose_b && problem.input_type == type && problem.b_type == type) {
    return ResidualKernel::kSixteenBit;
  }
  if (choice == ForwardGemm::kCutlass && problem.transpose_b &&
      problem.input_type == ffi::DataType::F8E4M3FN &&
      problem.b_type == ffi::DataType::F8E4M3FN) {
    return ResidualKernel::kFp8;
  }
  return ResidualKernel::kNone;
}

// Whether the residual GEMM takes these operands (c is d: the product accumulates in place).
bool ResidualGemmSupports(ResidualKernel kernel, const MatmulProblem& problem, const void* a,
                          const void* b, const void* d) {
  switch (kernel) {
    case ResidualKernel::kSixteenBit:
      return residual_gemm::Supports(problem.p, problem.q, problem.r, a, b, d, d);
    case ResidualKernel::kFp8:
      return residual_gemm::SupportsFp8(problem.p, problem.q, problem.r, a, b, d, d);
    default: return false;
  }
}

ffi::Error Initialize(int device, MatmulState* state) {
  if (state->Empty()) return ffi::Error::Success();
  // Handle and algorithm for 256-byte aligned operands, the usual case, found before any
  // graph capture; other alignments are looked up on first use.
  static const char aligned[256] __attribute__((aligned(256))) = {};
  // A product the residual GEMM takes when aligned needs cuBLASLt only for odd operands.
  const MatmulProblem& problem = state->problem;
  if (state->accumulate &&
      ResidualGemmSupports(ResidualKernelFor(problem), problem, aligned, aligned, aligned)) {
    return ffi::Error::Success();
  }
  const MatmulState::Algorithm* algorithm = nullptr;
  return state->FindAlgorithm(device, aligned, aligned, aligned, &algorithm,
                              /*autotune=*/true);
}

// a_scale_inv/b_scale_inv: FP8 only, float32 scalars on the device.
ffi::Error Execute(cudaStream_t stream, int device, MatmulState* state,
                   const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::AnyBuffer* c,
                   ffi::AnyBuffer out, ffi::AnyBuffer workspace, float alpha,
                   const ffi::AnyBuffer* a_scale_inv = nullptr,
                   const ffi::AnyBuffer* b_scale_inv = nullptr) {
  const MatmulProblem& problem = state->problem;
  // XLA aliases c to out; copy if it ever did not, so the update stays correct.
  if (c != nullptr && c->untyped_data() != out.untyped_data() && out.size_bytes() > 0) {
    if (cudaMemcpyAsync(out.untyped_data(), c->untyped_data(), out.size_bytes(),
                        cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
      return Internal("copying the residual into the output failed");
    }
  }
  if (problem.p == 0 || problem.q == 0) return ffi::Error::Success();
  if (problem.r == 0) {  // an empty contraction adds nothing
    if (c != nullptr) return ffi::Error::Success();
    return cudaMemsetAsync(out.untyped_data(), 0, out.size_bytes(), stream) == cudaSuccess
               ? ffi::Error::Success()
               : Internal("zeroing an empty product failed");
  }
  const ResidualKernel residual_kernel =
      c != nullptr ? ResidualKernelFor(problem) : ResidualKernel::kNone;
  if (ResidualGemmSupports(residual_kernel, problem, a.untyped_data(), b.untyped_data(),
                           out.untyped_data())) {
    // c added in fp32 before the one rounding (cuBLASLt rounds the scaled product to 16
    // bits first).
    const auto element = problem.output_type == ffi::DataType::BF16
                             ? residual_gemm::Element::kBFloat16
                             : residual_gemm::Element::kFloat16;
    void* d = out.untyped_data();
    const cudaError_t status =
        residual_kernel == ResidualKernel::kFp8
            ? residual_gemm::RunFp8(
                  element, state->fast_accumulation, problem.p, problem.q, problem.r, alpha,
                  static_cast<const float*>(a_scale_inv->untyped_data()),
                  static_cast<const float*>(b_scale_inv->untyped_data()), a.untyped_data(),
                  b.untyped_data(), d, d, workspace.untyped_data(), workspace.size_bytes(),
                  gpu::SmCount(device), stream)
            : residual_gemm::Run(element, problem.p, problem.q, problem.r, alpha,
                                 a.untyped_data(), b.untyped_data(), d, d,
                                 workspace.untyped_data(), workspace.size_bytes(),
                                 gpu::SmCount(device), stream);
    if (status != cudaSuccess) {
      return Internal("the ", residual_kernel == ResidualKernel::kFp8 ? "FP8 " : "",
                      "residual GEMM [", problem.p, ", ", problem.q, ", ", problem.r,
                      "] failed: ", cudaGetErrorString(status));
    }
    return ffi::Error::Success();
  }
  const MatmulState::Algorithm* algorithm = nullptr;
  if (auto error = state->FindAlgorithm(device, a.untyped_data(), b.untyped_data(),
                                        out.untyped_data(), &algorithm);
      error.failure()) {
    return error;
  }
  if (state->fp8) {
    // Device pointers, so the scales computed by the quantization kernels are read by the
    // GEMM without a host round trip. cuBLAS's A is our b.
    const void* a_scale = b_scale_inv->untyped_data();
    const void* b_scale = a_scale_inv->untyped_data();
    JAXFUSE_RETURN_IF_CUBLAS_ERROR(state->api->MatmulDescSetAttribute(
        algorithm->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale)));
    JAXFUSE_RETURN_IF_CUBLAS_ERROR(state->api->MatmulDescSetAttribute(
        algorithm->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)));
  }
  const float beta = c != nullptr ? 1.0f : 0.0f;
  void* d = out.untyped_data();
  JAXFUSE_RETURN_IF_CUBLAS_ERROR(state->api->Matmul(
      algorithm->handle, algorithm->desc, &alpha, b.untyped_data(), state->layout_a,
      a.untyped_data(), state->layout_b, &beta, d, state->layout_c, d, state->layout_c,
      &algorithm->algo, workspace.untyped_data(), workspace.size_bytes(), stream));
  return ffi::Error::Success();
}

// The 16-bit bindings carry no scales, which every FP8 product reads: FP8 operands go
// through the *_fp8 targets.
ffi::Error RejectFp8Operands(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  if (IsFp8(a.element_type()) || IsFp8(b.element_type())) {
    return InvalidArgument("FP8 operands need their scales: use the *_fp8 matmul targets, got ",
                           DataTypeName(a.element_type()), " and ",
                           DataTypeName(b.element_type()));
  }
  return ffi::Error::Success();
}

// --- bindings: linear_scale_add (accumulating) ------------------------------------

ffi::ErrorOr<std::unique_ptr<MatmulState>> LinearScaleAddInstantiate(
    ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer c, ffi::Result<ffi::AnyBuffer> out,
    ffi::Result<ffi::AnyBuffer> workspace, float, bool transpose_a, bool transpose_b) {
  if (auto error = RejectFp8Operands(a, b); error.failure()) {
    return ffi::Unexpected<ffi::Error>(std::move(error));
  }
  return MakeState(a, b, &c, *out, *workspace, transpose_a, transpose_b);
}

ffi::Error LinearScaleAddExecute(cudaStream_t stream, int32_t device, MatmulState* state,
                                 ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer c,
                                 ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::AnyBuffer> workspace, float alpha, bool,
                                 bool) {
  return Execute(stream, device, state, a, b, &c, *out, *workspace, alpha);
}

// --- bindings: scaled_matmul (no accumulator) -----------------------------------

ffi::ErrorOr<std::unique_ptr<MatmulState>> ScaledMatmulInstantiate(
    ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> out,
    ffi::Result<ffi::AnyBuffer> workspace, float, bool transpose_a, bool transpose_b) {
  if (auto error = RejectFp8Operands(a, b); error.failure()) {
    return ffi::Unexpected<ffi::Error>(std::move(error));
  }
  return MakeState(a, b, nullptr, *out, *workspace, transpose_a, transpose_b);
}

ffi::Error ScaledMatmulExecute(cudaStream_t stream, int32_t device, MatmulState* state,
                               ffi::AnyBuffer a, ffi::AnyBuffer b,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> workspace, float alpha, bool, bool) {
  return Execute(stream, device, state, a, b, nullptr, *out, *workspace, alpha);
}

// --- bindings: FP8 (a [P, R], b [Q, R], per-tensor scales on the device) -----------

ffi::ErrorOr<std::unique_ptr<MatmulState>> LinearScaleAddFp8Instantiate(
    ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer c, ffi::AnyBuffer, ffi::AnyBuffer,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace, float,
    bool fast_accumulation) {
  return MakeState(a, b, &c, *out, *workspace, false, true, fast_accumulation);
}

ffi::Error LinearScaleAddFp8Execute(cudaStream_t stream, int32_t device, MatmulState* state,
                                    ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer c,
                                    ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv,
                                    ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::AnyBuffer> workspace, float alpha, bool) {
  return Execute(stream, device, state, a, b, &c, *out, *workspace, alpha, &a_scale_inv,
                 &b_scale_inv);
}

ffi::ErrorOr<std::unique_ptr<MatmulState>> ScaledMatmulFp8Instantiate(
    ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer, ffi::AnyBuffer,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace, float,
    bool fast_accumulation) {
  return MakeState(a, b, nullptr, *out, *workspace, false, true, fast_accumulation);
}

ffi::Error ScaledMatmulFp8Execute(cudaStream_t stream, int32_t device, MatmulState* state,
                                  ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv,
                                  ffi::AnyBuffer b_scale_inv, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::AnyBuffer> workspace, float alpha, bool) {
  return Execute(stream, device, state, a, b, nullptr, *out, *workspace, alpha, &a_scale_inv,
                 &b_scale_inv);
}

ffi::Error MatmulInitialize(int32_t device, MatmulState* state) {
  return Initialize(device, state);
}

}  // namespace
}  // namespace jaxfuse

namespace ffi = xla::ffi;
using jaxfuse::MatmulState;

extern "C" XLA_FFI_TypeId* JaxfuseMatmulStateTypeId() { return &MatmulState::id; }
extern "C" const XLA_FFI_TypeInfo* JaxfuseMatmulStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<MatmulState>();
  return &info;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseMatmulInitializeCuda, jaxfuse::MatmulInitialize,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<MatmulState>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseLinearScaleAddInstantiateCuda,
                              jaxfuse::LinearScaleAddInstantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // c
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<float>("alpha")
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseLinearScaleAddCuda, jaxfuse::LinearScaleAddExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<MatmulState>>()
                                  .Arg<ffi::AnyBuffer>()  // a: x [P, R] (or [R, P])
                                  .Arg<ffi::AnyBuffer>()  // b: kernel [R, Q] (or [Q, R])
                                  .Arg<ffi::AnyBuffer>()  // c: residual [P, Q], aliased to out
                                  .Ret<ffi::AnyBuffer>()  // out: c + alpha * op(a) @ op(b)
                                  .Ret<ffi::AnyBuffer>()  // workspace: uint8 scratch for cuBLASLt
                                  .Attr<float>("alpha")
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseScaledMatmulInstantiateCuda,
                              jaxfuse::ScaledMatmulInstantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<float>("alpha")
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseScaledMatmulCuda, jaxfuse::ScaledMatmulExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<MatmulState>>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Ret<ffi::AnyBuffer>()  // out: alpha * op(a) @ op(b)
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<float>("alpha")
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseLinearScaleAddFp8InstantiateCuda,
                              jaxfuse::LinearScaleAddFp8Instantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // c
                                  .Arg<ffi::AnyBuffer>()  // a_scale_inv
                                  .Arg<ffi::AnyBuffer>()  // b_scale_inv
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<float>("alpha")
                                  .Attr<bool>("fast_accumulation"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseLinearScaleAddFp8Cuda, jaxfuse::LinearScaleAddFp8Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<MatmulState>>()
                                  .Arg<ffi::AnyBuffer>()  // a: FP8 x [P, R]
                                  .Arg<ffi::AnyBuffer>()  // b: FP8 kernel^T [Q, R]
                                  .Arg<ffi::AnyBuffer>()  // c: residual [P, Q], aliased to out
                                  .Arg<ffi::AnyBuffer>()  // a_scale_inv: float32 [] on the device
                                  .Arg<ffi::AnyBuffer>()  // b_scale_inv: float32 []
                                  .Ret<ffi::AnyBuffer>()  // out: c + alpha * sa * sb * a @ b^T
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<float>("alpha")
                                  .Attr<bool>("fast_accumulation"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseScaledMatmulFp8InstantiateCuda,
                              jaxfuse::ScaledMatmulFp8Instantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // a_scale_inv
                                  .Arg<ffi::AnyBuffer>()  // b_scale_inv
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<float>("alpha")
                                  .Attr<bool>("fast_accumulation"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseScaledMatmulFp8Cuda, jaxfuse::ScaledMatmulFp8Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<MatmulState>>()
                                  .Arg<ffi::AnyBuffer>()  // a: FP8 [P, R]
                                  .Arg<ffi::AnyBuffer>()  // b: FP8 [Q, R]
                                  .Arg<ffi::AnyBuffer>()  // a_scale_inv: float32 []
                                  .Arg<ffi::AnyBuffer>()  // b_scale_inv: float32 []
                                  .Ret<ffi::AnyBuffer>()  // out: alpha * sa * sb * a @ b^T
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<float>("alpha")
                                  .Attr<bool>("fast_accumulation"),
                              {ffi::Traits::kCmdBufferCompatible});
