// bf16 dgrad: dx[rows_g] = dy[rows_g] @ w[g]^T.
// CUTLASS terms: M = rows_g, N = k, K = n; A = dy rows (RowMajor = K-major, ld n);
// B(j, kk) = w[g][j * n + kk] (ColumnMajor B = K-major, ld n); D = dx rows (RowMajor, ld k).
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_GEMM_TENSORMAP_VARIANTS(
    Bf16DgradLarge, cutlass::bfloat16_t, cutlass::layout::RowMajor,
    cutlass::bfloat16_t, cutlass::layout::ColumnMajor, cutlass::bfloat16_t,
    128, 256, 64, 1, 2,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)
// On the team tile scheduler (team_tile_scheduler.cuh) so that JAXFUSE_GROUPED_GEMM_TEAMS
// reaches it; by default one team, CUTLASS's order (more teams gained nothing: README.md).
JAXFUSE_GG_DEFINE_GEMM_TEAMS(Bf16DgradSmall, cutlass::bfloat16_t, cutlass::layout::RowMajor,
                             cutlass::bfloat16_t, cutlass::layout::ColumnMajor, cutlass::bfloat16_t,
                             128, 128, 64, 1, 1,
                             cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                             cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)

JAXFUSE_GG_DEFINE_FAMILY_2(Bf16Dgrad, Bf16DgradLarge, Bf16DgradSmall)

}  // namespace jaxfuse::grouped_gemm::detail
