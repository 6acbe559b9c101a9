// bf16 dgrad, the kUniform config (layouts as gemm_bf16_dgrad.cu): cooperative 128x256x64 with a
// 2x1 cluster (torch._grouped_mm's bf16 config), whose two CTAs along M share the weight
// tile by multicast. The group scheduler rounds every group's 128-row tile count up to 2
// (an idle slot per odd count), so it fits sizes with even tile counts (multiples of 256
// rows, say); kAdaptive gives it the tiles only then.
// Measured against 1x2 and against 256x128 tiles (clusters 1x2, 2x1): README.md.
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_GEMM_TENSORMAP_VARIANTS(
    Bf16DgradUniformGemm, cutlass::bfloat16_t, cutlass::layout::RowMajor,
    cutlass::bfloat16_t, cutlass::layout::ColumnMajor, cutlass::bfloat16_t,
    128, 256, 64, 2, 1,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)

JAXFUSE_GG_DEFINE_UNIFORM_FAMILY(Bf16DgradUniform, Bf16DgradUniformGemm)

}  // namespace jaxfuse::grouped_gemm::detail
