// f16 (half) forward, dgrad and wgrad: one tile config each (cooperative 128x256x64;
// cluster 1x2 for forward/dgrad (ragged M), 2x1 for wgrad). Layouts as in gemm_bf16_fwd.cu / gemm_bf16_dgrad.cu / gemm_bf16_wgrad.cu.
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_GEMM(F16FwdGemm, cutlass::half_t, cutlass::layout::RowMajor,
                       cutlass::half_t, cutlass::layout::RowMajor, cutlass::half_t,
                       128, 256, 64, 1, 2,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)
JAXFUSE_GG_DEFINE_GEMM(F16DgradGemm, cutlass::half_t, cutlass::layout::RowMajor,
                       cutlass::half_t, cutlass::layout::ColumnMajor, cutlass::half_t,
                       128, 256, 64, 1, 2,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)
JAXFUSE_GG_DEFINE_GEMM(F16WgradGemm, cutlass::half_t, cutlass::layout::ColumnMajor,
                       cutlass::half_t, cutlass::layout::RowMajor, cutlass::half_t,
                       128, 256, 64, 2, 1,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)

JAXFUSE_GG_DEFINE_FAMILY_1(F16Fwd, F16FwdGemm)
JAXFUSE_GG_DEFINE_FAMILY_1(F16Dgrad, F16DgradGemm)
JAXFUSE_GG_DEFINE_FAMILY_1(F16Wgrad, F16WgradGemm)

}  // namespace jaxfuse::grouped_gemm::detail
