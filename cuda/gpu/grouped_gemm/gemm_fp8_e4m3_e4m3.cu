// FP8 (e4m3 x e4m3 -> bf16), forward and dgrad (same kernel: both operands K-major, fp32
// accumulation with periodic promotion (no FastAccum), per-group alpha from the epilogue's
// alpha pointer array).
// forward: M = rows_g, N = n, K = k; A = x rows (RowMajor, ld k); B(j, kk) = wT[g][j * k + kk]
//          (ColumnMajor B = K-major, ld k); D = y rows (ld n).
// dgrad:   M = rows_g, N = k, K = n; A = dy rows (ld n); B(j, kk) = w[g][j * n + kk] (ld n);
//          D = dx rows (ld k).
// Tiles: the promoted (non-FastAccum) FP8 mainloop keeps two fp32 accumulators per thread, so
// each consumer warp group owns at most 64x128 outputs (128x256 cooperative and 128x128
// ping-pong spilled ~900 bytes): large = cooperative 128x128x128 cluster 1x2, small = ping-pong
// 64x128x128 cluster 1x1.
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_GEMM(Fp8E4m3E4m3Small, cutlass::float_e4m3_t, cutlass::layout::RowMajor,
                       cutlass::float_e4m3_t, cutlass::layout::ColumnMajor, cutlass::bfloat16_t,
                       64, 128, 128, 1, 1,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)

JAXFUSE_GG_DEFINE_FP8_PROMOTED_FAMILY(Fp8E4m3E4m3, cutlass::float_e4m3_t, cutlass::float_e4m3_t, Fp8E4m3E4m3Small)

}  // namespace jaxfuse::grouped_gemm::detail
