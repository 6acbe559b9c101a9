// The FP8 forward of linear_scale_add behind jaxfuse/residual_gemm.h, with fast
// accumulation (the tensor cores' own FP8 accumulator, never promoted mid-mainloop: CUTLASS's
// FP8FastAccum schedule, TransformerEngine's fprop setting and Float8CurrentScaling's
// default): d = alpha * a_scale_inv * b_scale_inv * a @ b^T + c, c added in fp32 before the
// one rounding to d's type (cuBLASLt's FP8 epilogue rounds the scaled product to the
// 16-bit type first). One accumulator set per thread, so the cooperative 128x256x128 tile
// fits without spilling; a 2x1 cluster as the 16-bit kernels. Opt-in
// (JAXFUSE_LINEAR_SCALE_ADD_GEMM=cutlass): the FP8 step ran 1-3.5% faster on cuBLASLt on an
// H100, this tile and three others measured (session 53), so cuBLASLt is the default.
#include "residual_gemm.cuh"

namespace jaxfuse::residual_gemm {
namespace {

JAXFUSE_FP8_RESIDUAL_GEMM(BFloat16FastGemm, cutlass::bfloat16_t, 128, 256, 128, 2, 1,
                          cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum)
JAXFUSE_FP8_RESIDUAL_GEMM(Float16FastGemm, cutlass::half_t, 128, 256, 128, 2, 1,
                          cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum)

}  // namespace

bool SupportsFp8(int64_t m, int64_t n, int64_t k, const void* a, const void* b, const void* c,
                 const void* d) {
  using detail::Aligned16;
  // a's and b's rows are k bytes and c's and d's 2n: TMA needs 16-byte rows.
  return detail::FitsInt(m, n, k) && k % 16 == 0 && n % 8 == 0 && Aligned16(a) &&
         Aligned16(b) && Aligned16(c) && Aligned16(d);
}

cudaError_t RunFp8(Element element, bool fast_accumulation, int64_t m, int64_t n, int64_t k,
                   float alpha, const float* a_scale_inv, const float* b_scale_inv,
                   const void* a, const void* b, const void* c, void* d, void* workspace,
                   size_t workspace_bytes, int sm_count, cudaStream_t stream) {
  if (!SupportsFp8(m, n, k, a, b, c, d) || sm_count <= 0 || a_scale_inv == nullptr ||
      b_scale_inv == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const detail::Fp8Scales scales{alpha, a_scale_inv, b_scale_inv};
  if (!fast_accumulation) {
    return detail::RunFp8Promoted(element, mi, ni, ki, scales, a, b, c, d, workspace,
                                  workspace_bytes, sm_count, stream);
  }
  return detail::RunGemmFor<BFloat16FastGemm, Float16FastGemm>(
      element, mi, ni, ki, a, b, c, d, scales, workspace, workspace_bytes, sm_count, stream);
}

}  // namespace jaxfuse::residual_gemm
