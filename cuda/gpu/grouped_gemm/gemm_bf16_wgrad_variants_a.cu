// Experimental bf16 wgrad kernels 1-3 (wgrad_variants.cuh says why).
#include "wgrad_variants.cuh"

namespace jaxfuse::grouped_gemm::detail {

// 1, 2: ping-pong 128x128 with a cluster (dy's or x's tile multicast to two CTAs).
JAXFUSE_GG_WGRAD_VARIANT(Bf16WgradV1, 128, 128, 2, 1, KernelPtrArrayTmaWarpSpecializedPingpong,
                         PtrArrayTmaWarpSpecializedPingpong)
JAXFUSE_GG_WGRAD_VARIANT(Bf16WgradV2, 128, 128, 1, 2, KernelPtrArrayTmaWarpSpecializedPingpong,
                         PtrArrayTmaWarpSpecializedPingpong)
// 3: today's kSmall (ping-pong 128x128, no cluster) with a whole tile of store stages.
JAXFUSE_GG_DEFINE_BF16_WGRAD_EPI_STAGES(Bf16WgradV3, 128, 128, 1, 1,
                                        KernelPtrArrayTmaWarpSpecializedPingpong,
                                        PtrArrayTmaWarpSpecializedPingpong, 8)

size_t Bf16WgradVariantA_WorkspaceBytes(int num_groups, int sm_count) {
  return std::max({CutlassWorkspaceBytes<Bf16WgradV1>(num_groups, sm_count),
                   CutlassWorkspaceBytes<Bf16WgradV2>(num_groups, sm_count),
                   CutlassWorkspaceBytes<Bf16WgradV3>(num_groups, sm_count)});
}

cudaError_t Bf16WgradVariantA_Run(int variant, const GemmArrays& arrays, int sm_count,
                                  cudaStream_t stream) {
  switch (variant) {
    case 1: return RunGemm<Bf16WgradV1>(arrays, sm_count, stream);
    case 2: return RunGemm<Bf16WgradV2>(arrays, sm_count, stream);
    case 3: return RunGemm<Bf16WgradV3>(arrays, sm_count, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jaxfuse::grouped_gemm::detail
