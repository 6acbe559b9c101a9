// FP8 wgrad (e4m3 x e5m2 -> bf16): dw[g] = x[rows_g]^T @ dy[rows_g] from the column-wise
// copies (jaxfuse/columnwise.h), so both operands are K-major as SM90 FP8 wgmma needs:
// M = k, N = n, K = rows_g; A(i, r) = xT[i * width + start_g + r] (RowMajor A, ld width);
// B(j, r) = dyT[j * width + start_g + r] (ColumnMajor B = K-major, ld width); D = dw[g]
// (ld n). TMA zero-fills a group's last k-block past its rows (per-group tensor maps), so the
// alignment padding between groups is never read. Empty groups get no tiles and are zeroed
// by the setup launch. Promoted fp32 accumulation (TransformerEngine's split accumulator for
// the gradient GEMMs); tiles and mainloops as gemm_fp8_e4m3_e4m3.cu (JAXFUSE_GG_DEFINE_FP8_
// PROMOTED_FAMILY), which also serves the e4m3-gradient wgrad.
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_FP8_PROMOTED_FAMILY(Fp8E4m3E5m2, cutlass::float_e4m3_t, cutlass::float_e5m2_t)

}  // namespace jaxfuse::grouped_gemm::detail
