// The pybind11 module: the FFI handlers of each platform, the custom types they use, and
// what was built. Python (jaxfuse/_src/ffi.py) registers them lazily.
//
// Adding an op: define its handler symbols in cuda/cpu/<op>.cc and cuda/gpu/<op>.cu, then
// list them below. Nothing else in C++ changes.
#include <pybind11/pybind11.h>

#include "jaxfuse/ffi_common.h"

#if defined(JAXFUSE_WITH_CUDA)
#include <cuda_runtime_api.h>
#include <cublasLt.h>
#include <cutlass/version.h>
namespace jaxfuse::cublaslt {
size_t LoadedVersion();
}
namespace jaxfuse {
size_t GroupedGemmWorkspaceBytes(int32_t form, int32_t a_type, int32_t b_type, int64_t m,
                                 int64_t k, int64_t n, int64_t groups, int sm_count,
                                 bool fast_accumulation, bool block_scaling, bool gated);
}
#endif

namespace py = pybind11;

// --- registry: CPU handlers (name, symbol) -----------------------------------------
#define JAXFUSE_CPU_HANDLERS(X)                                                   \
  X("jaxfuse_linear_scale_add", JaxfuseLinearScaleAddCpu)                         \
  X("jaxfuse_scaled_matmul", JaxfuseScaledMatmulCpu)                              \
  X("jaxfuse_linear_scale_add_fp8", JaxfuseLinearScaleAddFp8Cpu)                 \
  X("jaxfuse_scaled_matmul_fp8", JaxfuseScaledMatmulFp8Cpu)                       \
  X("jaxfuse_grouped_gemm", JaxfuseGroupedGemmCpu)                                \
  X("jaxfuse_grouped_gemm_fp8", JaxfuseGroupedGemmFp8Cpu)                         \
  X("jaxfuse_grouped_gemm_fp8_wgrad", JaxfuseGroupedGemmFp8WgradCpu)              \
  X("jaxfuse_grouped_gemm_fp8_blockwise", JaxfuseGroupedGemmFp8BlockwiseCpu)      \
  X("jaxfuse_grouped_gemm_fp8_blockwise_wgrad", JaxfuseGroupedGemmFp8BlockwiseWgradCpu) \
  X("jaxfuse_group_columnwise", JaxfuseGroupColumnwiseCpu)                        \
  X("jaxfuse_group_offsets", JaxfuseGroupOffsetsCpu)                              \
  X("jaxfuse_scaled_activation_fwd", JaxfuseScaledActivationFwdCpu)               \
  X("jaxfuse_scaled_activation_bwd", JaxfuseScaledActivationBwdCpu)               \
  X("jaxfuse_quantize", JaxfuseQuantizeCpu)                                       \
  X("jaxfuse_quantize_gathered", JaxfuseQuantizeGatheredCpu)                      \
  X("jaxfuse_quantize_transposed", JaxfuseQuantizeTransposedCpu)                  \
  X("jaxfuse_quantize_batches_transposed", JaxfuseQuantizeBatchesTransposedCpu)   \
  X("jaxfuse_quantize_blocks_transposed", JaxfuseQuantizeBlocksTransposedCpu)     \
  X("jaxfuse_quantize_columnwise_blocks", JaxfuseQuantizeColumnwiseBlocksCpu)     \
  X("jaxfuse_batch_amax", JaxfuseBatchAmaxCpu)                                    \
  X("jaxfuse_scaled_activation_quantize", JaxfuseScaledActivationQuantizeCpu)     \
  X("jaxfuse_scaled_dactivation_quantize", JaxfuseScaledDactivationQuantizeCpu)   \
  X("jaxfuse_rms_norm_fwd", JaxfuseRmsNormFwdCpu)                                 \
  X("jaxfuse_add_rms_norm_fwd", JaxfuseAddRmsNormFwdCpu)                          \
  X("jaxfuse_rms_norm_bwd", JaxfuseRmsNormBwdCpu)                                 \
  X("jaxfuse_add_rms_norm_bwd", JaxfuseAddRmsNormBwdCpu)                          \
  X("jaxfuse_moe_permute", JaxfuseMoePermuteCpu)                                  \
  X("jaxfuse_moe_unpermute", JaxfuseMoeUnpermuteCpu)                              \
  X("jaxfuse_moe_unpermute_bwd", JaxfuseMoeUnpermuteBwdCpu)

// --- registry: stateful CUDA handlers (name, instantiate, initialize, execute) ------
#define JAXFUSE_CUDA_HANDLERS(X)                                                   \
  X("jaxfuse_linear_scale_add", JaxfuseLinearScaleAddInstantiateCuda,              \
    JaxfuseMatmulInitializeCuda, JaxfuseLinearScaleAddCuda)                       \
  X("jaxfuse_scaled_matmul", JaxfuseScaledMatmulInstantiateCuda,                   \
    JaxfuseMatmulInitializeCuda, JaxfuseScaledMatmulCuda)                          \
  X("jaxfuse_linear_scale_add_fp8", JaxfuseLinearScaleAddFp8InstantiateCuda,       \
    JaxfuseMatmulInitializeCuda, JaxfuseLinearScaleAddFp8Cuda)                     \
  X("jaxfuse_scaled_matmul_fp8", JaxfuseScaledMatmulFp8InstantiateCuda,            \
    JaxfuseMatmulInitializeCuda, JaxfuseScaledMatmulFp8Cuda)

// --- registry: stateless CUDA handlers (name, execute) ------------------------------
#define JAXFUSE_CUDA_STATELESS_HANDLERS(X)                                          \
  X("jaxfuse_grouped_gemm", JaxfuseGroupedGemmCuda)                                 \
  X("jaxfuse_grouped_gemm_fp8", JaxfuseGroupedGemmFp8Cuda)                          \
  X("jaxfuse_grouped_gemm_fp8_wgrad", JaxfuseGroupedGemmFp8WgradCuda)               \
  X("jaxfuse_grouped_gemm_fp8_blockwise", JaxfuseGroupedGemmFp8BlockwiseCuda)       \
  X("jaxfuse_grouped_gemm_fp8_blockwise_wgrad", JaxfuseGroupedGemmFp8BlockwiseWgradCuda) \
  X("jaxfuse_grouped_gemm_gated", JaxfuseGroupedGemmGatedCuda)                      \
  X("jaxfuse_group_columnwise", JaxfuseGroupColumnwiseCuda)                         \
  X("jaxfuse_group_offsets", JaxfuseGroupOffsetsCuda)                               \
  X("jaxfuse_scaled_activation_fwd", JaxfuseScaledActivationFwdCuda)                \
  X("jaxfuse_scaled_activation_bwd", JaxfuseScaledActivationBwdCuda)                \
  X("jaxfuse_quantize", JaxfuseQuantizeCuda)                                        \
  X("jaxfuse_quantize_gathered", JaxfuseQuantizeGatheredCuda)                       \
  X("jaxfuse_quantize_transposed", JaxfuseQuantizeTransposedCuda)                   \
  X("jaxfuse_quantize_batches_transposed", JaxfuseQuantizeBatchesTransposedCuda)    \
  X("jaxfuse_quantize_blocks_transposed", JaxfuseQuantizeBlocksTransposedCuda)      \
  X("jaxfuse_quantize_columnwise_blocks", JaxfuseQuantizeColumnwiseBlocksCuda)      \
  X("jaxfuse_batch_amax", JaxfuseBatchAmaxCuda)                                     \
  X("jaxfuse_scaled_activation_quantize", JaxfuseScaledActivationQuantizeCuda)      \
  X("jaxfuse_scaled_dactivation_quantize", JaxfuseScaledDactivationQuantizeCuda)    \
  X("jaxfuse_rms_norm_fwd", JaxfuseRmsNormFwdCuda)                                  \
  X("jaxfuse_add_rms_norm_fwd", JaxfuseAddRmsNormFwdCuda)                           \
  X("jaxfuse_rms_norm_bwd", JaxfuseRmsNormBwdCuda)                                  \
  X("jaxfuse_add_rms_norm_bwd", JaxfuseAddRmsNormBwdCuda)                           \
  X("jaxfuse_moe_permute", JaxfuseMoePermuteCuda)                                   \
  X("jaxfuse_moe_unpermute", JaxfuseMoeUnpermuteCuda)                               \
  X("jaxfuse_moe_unpermute_bwd", JaxfuseMoeUnpermuteBwdCuda)

// --- registry: CUDA state types (name, type id function, type info function) --------
#define JAXFUSE_CUDA_TYPES(X) \
  X("jaxfuse.MatmulState", JaxfuseMatmulStateTypeId, JaxfuseMatmulStateTypeInfo)

#define JAXFUSE_DECLARE_CPU(name, symbol) XLA_FFI_DECLARE_HANDLER_SYMBOL(symbol);
JAXFUSE_CPU_HANDLERS(JAXFUSE_DECLARE_CPU)

#if defined(JAXFUSE_WITH_CUDA)
#define JAXFUSE_DECLARE_CUDA(name, instantiate, initialize, execute) \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(instantiate);                      \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(initialize);                       \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(execute);
JAXFUSE_CUDA_HANDLERS(JAXFUSE_DECLARE_CUDA)
#define JAXFUSE_DECLARE_CUDA_STATELESS(name, execute) XLA_FFI_DECLARE_HANDLER_SYMBOL(execute);
JAXFUSE_CUDA_STATELESS_HANDLERS(JAXFUSE_DECLARE_CUDA_STATELESS)
#define JAXFUSE_DECLARE_TYPE(name, type_id, type_info) \
  XLA_FFI_DECLARE_TYPE_ID_SYMBOL(type_id);             \
  XLA_FFI_DECLARE_TYPE_INFO_SYMBOL(type_info);
JAXFUSE_CUDA_TYPES(JAXFUSE_DECLARE_TYPE)
#endif

namespace {

template <typename T>
py::capsule Capsule(T* pointer) {
  // XLA only reads through these pointers; pybind11 capsules hold a void*.
  return py::capsule(const_cast<void*>(reinterpret_cast<const void*>(pointer)));
}

// {"cpu": {name: capsule}, "CUDA": {name: capsule or {"instantiate": ..., "execute": ...}}}
py::dict Handlers() {
  py::dict cpu;
#define JAXFUSE_ADD_CPU(name, symbol) cpu[name] = Capsule(symbol);
  JAXFUSE_CPU_HANDLERS(JAXFUSE_ADD_CPU)
  py::dict handlers;
  handlers["cpu"] = cpu;
#if defined(JAXFUSE_WITH_CUDA)
  py::dict cuda;
#define JAXFUSE_ADD_CUDA(name, instantiate, initialize, execute)            \
  {                                                                         \
    py::dict stages;                                                        \
    stages["instantiate"] = Capsule(instantiate);                           \
    stages["initialize"] = Capsule(initialize);                             \
    stages["execute"] = Capsule(execute);                                   \
    cuda[name] = stages;                                                    \
  }
  JAXFUSE_CUDA_HANDLERS(JAXFUSE_ADD_CUDA)
#define JAXFUSE_ADD_CUDA_STATELESS(name, execute) cuda[name] = Capsule(execute);
  JAXFUSE_CUDA_STATELESS_HANDLERS(JAXFUSE_ADD_CUDA_STATELESS)
  handlers["CUDA"] = cuda;
#endif
  return handlers;
}

// {"CUDA": {name: {"type_id": capsule, "type_info": capsule}}}
py::dict Types() {
  py::dict types;
#if defined(JAXFUSE_WITH_CUDA)
  py::dict cuda;
#define JAXFUSE_ADD_TYPE(name, type_id, type_info)              \
  {                                                             \
    py::dict registration;                                      \
    registration["type_id"] = Capsule(type_id());               \
    registration["type_info"] = Capsule(type_info());           \
    cuda[name] = registration;                                  \
  }
  JAXFUSE_CUDA_TYPES(JAXFUSE_ADD_TYPE)
  types["CUDA"] = cuda;
#endif
  return types;
}

py::dict BuildInfo() {
  py::dict info;
  py::list platforms;
  platforms.append("cpu");
  info["jaxlib_version"] = JAXFUSE_BUILD_JAXLIB_VERSION;
  info["ffi_api_version"] = py::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
#if defined(JAXFUSE_WITH_CUDA)
  platforms.append("CUDA");
  py::list archs;
  archs.append(JAXFUSE_CUDA_ARCHITECTURES);
  info["cuda_architectures"] = archs;
  info["cuda_version"] = py::make_tuple(CUDART_VERSION / 1000, (CUDART_VERSION % 1000) / 10);
  info["cublas_header_version"] =
      py::make_tuple(CUBLAS_VER_MAJOR, CUBLAS_VER_MINOR, CUBLAS_VER_PATCH);
  info["cutlass_version"] =
      py::make_tuple(CUTLASS_MAJOR, CUTLASS_MINOR, CUTLASS_PATCH);
#else
  info["cuda_architectures"] = py::list();
  info["cuda_version"] = py::none();
  info["cublas_header_version"] = py::none();
  info["cutlass_version"] = py::none();
#endif
  info["platforms"] = platforms;
  return info;
}

// Version of the cuBLASLt library loaded at run time (0 if it cannot be opened). Opening
// it is deferred to this call, so importing jaxfuse never needs cuBLAS.
size_t LoadedCublasLtVersion() {
#if defined(JAXFUSE_WITH_CUDA)
  return jaxfuse::cublaslt::LoadedVersion();
#else
  return 0;
#endif
}

// Scratch bytes of the CUDA grouped GEMM (0 without the CUDA part). Types: 0 bf16, 1 f16,
// 2 float8_e4m3fn, 3 float8_e5m2; forms: 0 forward, 1 dgrad, 2 wgrad; fast_accumulation: the
// FP8 forward's fast-accumulation kernels (their own tile shapes); block_scaling: the
// blockwise FP8 kernels (forward, dgrad, and with form 2 the blockwise wgrad); gated: the
// bf16 forward with a gated activation in its epilogue (jaxfuse_grouped_gemm_gated).
size_t GroupedGemmWorkspaceBytes(int32_t form, int32_t a_type, int32_t b_type, int64_t m,
                                 int64_t k, int64_t n, int64_t groups, int sm_count,
                                 bool fast_accumulation, bool block_scaling, bool gated) {
#if defined(JAXFUSE_WITH_CUDA)
  return jaxfuse::GroupedGemmWorkspaceBytes(form, a_type, b_type, m, k, n, groups, sm_count,
                                            fast_accumulation, block_scaling, gated);
#else
  return 0;
#endif
}

}  // namespace

PYBIND11_MODULE(_jaxfuse, module) {
  module.doc() = "jaxfuse's XLA FFI handlers (see jaxfuse/_src/ffi.py)";
  module.def("handlers", &Handlers, "FFI handler capsules per platform");
  module.def("types", &Types, "FFI state types per platform");
  module.def("build_info", &BuildInfo, "What this extension was built with");
  module.def("grouped_gemm_workspace_bytes", &GroupedGemmWorkspaceBytes, py::arg("form"),
             py::arg("a_type"), py::arg("b_type"), py::arg("m"), py::arg("k"), py::arg("n"),
             py::arg("groups"), py::arg("sm_count"), py::arg("fast_accumulation") = false,
             py::arg("block_scaling") = false, py::arg("gated") = false,
             "Scratch bytes the CUDA grouped GEMM needs (0 without the CUDA part)");
  module.def("loaded_cublaslt_version", &LoadedCublasLtVersion,
             "Version of the cuBLASLt library opened at run time, 0 if none");
}
