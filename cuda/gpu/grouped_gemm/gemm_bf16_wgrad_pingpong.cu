// bf16 wgrad, the ping-pong configs (layouts as gemm_bf16_wgrad.cu): 128x160x64 tiles, one
// per consumer warp group, so a tile's epilogue overlaps the other warp group's mainloop;
// cluster 2x1 (kPingpongM) or 1x2 (kPingpongN). cuBLAS's dense bf16 GEMM of the same sizes
// runs this tile and schedule on the H200 (nvjet_sm90_tst_128x160_64x5_2x1). Tiles cover
// dw[g] (k x n) whatever the group's rows, so neither cluster wastes a slot here.
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_GEMM(Bf16WgradPingpongM, cutlass::bfloat16_t, cutlass::layout::ColumnMajor,
                       cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                       128, 160, 64, 2, 1,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)
JAXFUSE_GG_DEFINE_GEMM(Bf16WgradPingpongN, cutlass::bfloat16_t, cutlass::layout::ColumnMajor,
                       cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                       128, 160, 64, 1, 2,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)

JAXFUSE_GG_DEFINE_PINGPONG_FAMILY(Bf16WgradPingpong, Bf16WgradPingpongM, Bf16WgradPingpongN)

}  // namespace jaxfuse::grouped_gemm::detail
