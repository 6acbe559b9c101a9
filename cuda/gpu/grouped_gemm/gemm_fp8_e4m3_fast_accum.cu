// FP8 (e4m3 x e4m3 -> bf16) forward with fast accumulation: the tensor cores' own FP8
// accumulator, never promoted to fp32 registers mid-mainloop (CUTLASS's FP8FastAccum
// schedules). TransformerEngine uses it for the forward GEMM (use_split_accumulator=False for
// fprop) and the promoted mainloop for the backward GEMMs; so does jaxfuse
// (Float8CurrentScaling.forward_fast_accumulation). Layouts as gemm_fp8_e4m3_e4m3.cu.
// Tiles: one accumulator set per thread, so the cooperative 128x256x128 tile fits without
// spilling (the promoted mainloop needs two sets and is held to 128x128):
// large = cooperative 128x256x128 cluster 1x2, small = ping-pong 64x128x128 cluster 1x1.
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_GEMM(Fp8E4m3FastAccumLarge, cutlass::float_e4m3_t, cutlass::layout::RowMajor,
                       cutlass::float_e4m3_t, cutlass::layout::ColumnMajor, cutlass::bfloat16_t,
                       128, 256, 128, 1, 2,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)
JAXFUSE_GG_DEFINE_GEMM(Fp8E4m3FastAccumSmall, cutlass::float_e4m3_t, cutlass::layout::RowMajor,
                       cutlass::float_e4m3_t, cutlass::layout::ColumnMajor, cutlass::bfloat16_t,
                       64, 128, 128, 1, 1,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)

JAXFUSE_GG_DEFINE_FAMILY_2(Fp8E4m3FastAccum, Fp8E4m3FastAccumLarge, Fp8E4m3FastAccumSmall)

}  // namespace jaxfuse::grouped_gemm::detail
