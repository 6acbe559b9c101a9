// Blockwise-scaled FP8 wgrad (Float8BlockScaling, DeepSeek-V3's recipe end to end):
// dw[g] = x[rows_g]^T @ dy[rows_g] from the column-wise copies (jaxfuse/columnwise.h), as the
// per-group FP8 wgrad (gemm_fp8_e4m3_e5m2.cu): M = k, N = n, K = rows_g, A = x^T e4m3,
// B = dy^T (e4m3 or e5m2), both K-major. The scales are 128 x 1 blocks of x and dy: one per
// column of the copy (an output row of A / column of B) and 128-row block of the group,
// applied in CUTLASS's blockwise mainloop (gemm_common.cuh, WgradBlockScaleConfig).
// TMA zero-fills the group's last, partial k-block; empty groups get no tiles and are zeroed
// by the setup launch.
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_FP8_BLOCKWISE_WGRAD_FAMILY(Fp8BlockWgradE4m3E4m3, cutlass::float_e4m3_t)
JAXFUSE_GG_DEFINE_FP8_BLOCKWISE_WGRAD_FAMILY(Fp8BlockWgradE4m3E5m2, cutlass::float_e5m2_t)

}  // namespace jaxfuse::grouped_gemm::detail
