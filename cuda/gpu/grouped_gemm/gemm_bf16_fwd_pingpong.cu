// bf16 forward, the ping-pong configs (layouts as gemm_bf16_fwd.cu): 128x160x64 tiles, one
// per consumer warp group, so a tile's epilogue overlaps the other warp group's mainloop;
// cluster 2x1 (kPingpongM) or 1x2 (kPingpongN). cuBLAS's dense bf16 GEMM of the same sizes
// runs this tile and schedule on the H200 (nvjet_sm90_tst_128x160_64x5_2x1).
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_GEMM(Bf16FwdPingpongM, cutlass::bfloat16_t, cutlass::layout::RowMajor,
                       cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                       128, 160, 64, 2, 1,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)
JAXFUSE_GG_DEFINE_GEMM(Bf16FwdPingpongN, cutlass::bfloat16_t, cutlass::layout::RowMajor,
                       cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                       128, 160, 64, 1, 2,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)

JAXFUSE_GG_DEFINE_PINGPONG_FAMILY(Bf16FwdPingpong, Bf16FwdPingpongM, Bf16FwdPingpongN)

}  // namespace jaxfuse::grouped_gemm::detail
