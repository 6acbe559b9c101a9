// bf16 forward: y[rows_g] = x[rows_g] @ w[g].
// CUTLASS terms: M = rows_g, N = n, K = k; A = x rows (RowMajor = K-major, ld k);
// B = w[g] [k, n] (RowMajor B = N-major, ld n); D = y rows (RowMajor, ld n).
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_GEMM_TENSORMAP_VARIANTS(
    Bf16FwdLarge, cutlass::bfloat16_t, cutlass::layout::RowMajor,
    cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
    128, 256, 64, 1, 2,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)
// On the team tile scheduler (team_tile_scheduler.cuh) so that JAXFUSE_GROUPED_GEMM_TEAMS
// reaches it; by default one team, CUTLASS's order (more teams gained nothing: README.md).
JAXFUSE_GG_DEFINE_GEMM_TEAMS(Bf16FwdSmall, cutlass::bfloat16_t, cutlass::layout::RowMajor,
                             cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                             128, 128, 64, 1, 1,
                             cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                             cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)

JAXFUSE_GG_DEFINE_FAMILY_2(Bf16Fwd, Bf16FwdLarge, Bf16FwdSmall)

}  // namespace jaxfuse::grouped_gemm::detail
