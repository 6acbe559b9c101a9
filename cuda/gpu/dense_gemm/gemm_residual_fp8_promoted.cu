// The FP8 forward of linear_scale_add without fast accumulation
// (Float8CurrentScaling(forward_fast_accumulation=False)): CUTLASS's FP8 mainloop adds the
// tensor cores' partial sums into fp32 registers every few k-blocks, as cuBLASLt's split
// accumulation does. Two accumulator sets per thread, so the tile is held to 128x128x128
// (128x256 spills: grouped_gemm/gemm_fp8_e4m3_fast_accum.cu). The epilogue is
// gemm_residual_fp8.cu's: c added in fp32, one rounding.
#include "residual_gemm.cuh"

namespace jaxfuse::residual_gemm {
namespace {

JAXFUSE_FP8_RESIDUAL_GEMM(BFloat16PromotedGemm, cutlass::bfloat16_t, 128, 128, 128, 2, 1,
                          cutlass::gemm::KernelTmaWarpSpecializedCooperative)
JAXFUSE_FP8_RESIDUAL_GEMM(Float16PromotedGemm, cutlass::half_t, 128, 128, 128, 2, 1,
                          cutlass::gemm::KernelTmaWarpSpecializedCooperative)

}  // namespace

namespace detail {

cudaError_t RunFp8Promoted(Element element, int m, int n, int k, const Fp8Scales& scales,
                           const void* a, const void* b, const void* c, void* d,
                           void* workspace, size_t workspace_bytes, int sm_count,
                           cudaStream_t stream) {
  return RunGemmFor<BFloat16PromotedGemm, Float16PromotedGemm>(
      element, m, n, k, a, b, c, d, scales, workspace, workspace_bytes, sm_count, stream);
}

}  // namespace detail
}  // namespace jaxfuse::residual_gemm
