// bf16 dgrad for group sizes that are multiples of the kernel's row granularity (the
// kUniform config; layouts as gemm_bf16_dgrad.cu). Candidates, picked by
// JAXFUSE_GROUPED_GEMM_UNIFORM_VARIANT:
//   0: cooperative 128x256x64, cluster 2x1 (torch._grouped_mm's bf16 config; 256 rows)
//   1: cooperative 256x128x64, cluster 1x2 (each consumer warpgroup 128x128; 256 rows)
//   2: cooperative 256x128x64, cluster 2x1 (512 rows)
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_GEMM(Bf16DgradUniform0, cutlass::bfloat16_t, cutlass::layout::RowMajor,
                       cutlass::bfloat16_t, cutlass::layout::ColumnMajor, cutlass::bfloat16_t,
                       128, 256, 64, 2, 1,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)
JAXFUSE_GG_DEFINE_GEMM(Bf16DgradUniform1, cutlass::bfloat16_t, cutlass::layout::RowMajor,
                       cutlass::bfloat16_t, cutlass::layout::ColumnMajor, cutlass::bfloat16_t,
                       256, 128, 64, 1, 2,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)
JAXFUSE_GG_DEFINE_GEMM(Bf16DgradUniform2, cutlass::bfloat16_t, cutlass::layout::RowMajor,
                       cutlass::bfloat16_t, cutlass::layout::ColumnMajor, cutlass::bfloat16_t,
                       256, 128, 64, 2, 1,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)

JAXFUSE_GG_DEFINE_UNIFORM_FAMILY_3(Bf16DgradUniform, Bf16DgradUniform0, Bf16DgradUniform1,
                                   Bf16DgradUniform2)

}  // namespace jaxfuse::grouped_gemm::detail
