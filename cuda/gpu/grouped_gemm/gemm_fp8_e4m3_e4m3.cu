// FP8 (e4m3 x e4m3 -> bf16), forward and dgrad (same kernel: both operands K-major, fp32
// accumulation with periodic promotion (no FastAccum), per-group alpha from the epilogue's
// alpha pointer array).
// forward: M = rows_g, N = n, K = k; A = x rows (RowMajor, ld k); B(j, kk) = wT[g][j * k + kk]
//          (ColumnMajor B = K-major, ld k); D = y rows (ld n).
// dgrad:   M = rows_g, N = k, K = n; A = dy rows (ld n); B(j, kk) = w[g][j * n + kk] (ld n);
//          D = dx rows (ld k).
// Tiles and mainloops: JAXFUSE_GG_DEFINE_FP8_PROMOTED_FAMILY (gemm_common.cuh): large =
// cooperative 128x128x128 cluster 1x2, small = ping-pong 64x128x128 cluster 1x1, each with
// the pipelined promotion (fp8_pipelined_promotion.cuh) and the stock mainloop for A/B.
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_FP8_PROMOTED_FAMILY(Fp8E4m3E4m3, cutlass::float_e4m3_t, cutlass::float_e4m3_t)

}  // namespace jaxfuse::grouped_gemm::detail
