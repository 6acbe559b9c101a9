// Experimental bf16 wgrad kernels 4-6 (wgrad_variants.cuh says why).
#include "wgrad_variants.cuh"

namespace jaxfuse::grouped_gemm::detail {

// 4: today's kLarge (cooperative 128x256, 2x1) with a whole tile of store stages.
JAXFUSE_GG_DEFINE_BF16_WGRAD_EPI_STAGES(Bf16WgradV4, 128, 256, 2, 1,
                                        KernelPtrArrayTmaWarpSpecializedCooperative,
                                        PtrArrayTmaWarpSpecializedCooperative, 8)
// 5: cooperative 256x128 (each consumer warp group a 128x128 half), cluster 1x2.
JAXFUSE_GG_WGRAD_VARIANT(Bf16WgradV5, 256, 128, 1, 2,
                         KernelPtrArrayTmaWarpSpecializedCooperative,
                         PtrArrayTmaWarpSpecializedCooperative)
// 6: 1 and 3 together (ping-pong 128x128, 2x1 cluster, a whole tile of store stages).
JAXFUSE_GG_DEFINE_BF16_WGRAD_EPI_STAGES(Bf16WgradV6, 128, 128, 2, 1,
                                        KernelPtrArrayTmaWarpSpecializedPingpong,
                                        PtrArrayTmaWarpSpecializedPingpong, 8)

size_t Bf16WgradVariantB_WorkspaceBytes(int num_groups, int sm_count) {
  return std::max({CutlassWorkspaceBytes<Bf16WgradV4>(num_groups, sm_count),
                   CutlassWorkspaceBytes<Bf16WgradV5>(num_groups, sm_count),
                   CutlassWorkspaceBytes<Bf16WgradV6>(num_groups, sm_count)});
}

cudaError_t Bf16WgradVariantB_Run(int variant, const GemmArrays& arrays, int sm_count,
                                  cudaStream_t stream) {
  switch (variant) {
    case 4: return RunGemm<Bf16WgradV4>(arrays, sm_count, stream);
    case 5: return RunGemm<Bf16WgradV5>(arrays, sm_count, stream);
    case 6: return RunGemm<Bf16WgradV6>(arrays, sm_count, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jaxfuse::grouped_gemm::detail
