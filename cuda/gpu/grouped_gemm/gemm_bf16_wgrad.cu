// bf16 wgrad: dw[g] = x[rows_g]^T @ dy[rows_g] (ragged contraction).
// CUTLASS terms: M = k, N = n, K = rows_g; A(i, r) = x[(lo + r) * k + i] (ColumnMajor A =
// M-major, ld k); B(j, r) = dy[(lo + r) * n + j] (RowMajor B = N-major, ld n);
// D = dw[g] (RowMajor, ld n). Empty groups get M = 0 (no tiles) and are zeroed separately.
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_GEMM(Bf16WgradLarge, cutlass::bfloat16_t, cutlass::layout::ColumnMajor,
                       cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                       128, 256, 64, 2, 1,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)
JAXFUSE_GG_DEFINE_GEMM(Bf16WgradSmall, cutlass::bfloat16_t, cutlass::layout::ColumnMajor,
                       cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                       128, 128, 64, 1, 1,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)

JAXFUSE_GG_DEFINE_FAMILY_2(Bf16Wgrad, Bf16WgradLarge, Bf16WgradSmall)

}  // namespace jaxfuse::grouped_gemm::detail
