// bf16 wgrad: dw[g] = x[rows_g]^T @ dy[rows_g] (ragged contraction).
// CUTLASS terms: M = k, N = n, K = rows_g; A(i, r) = x[(lo + r) * k + i] (ColumnMajor A =
// M-major, ld k); B(j, r) = dy[(lo + r) * n + j] (RowMajor B = N-major, ld n);
// D = dw[g] (RowMajor, ld n). Empty groups get M = 0 (no tiles) and are zeroed separately.
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_GEMM_TENSORMAP_VARIANTS(
    Bf16WgradLarge, cutlass::bfloat16_t, cutlass::layout::ColumnMajor,
    cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
    128, 256, 64, 2, 1,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)
// Both small kernels hand out their tiles through the team tile scheduler
// (team_tile_scheduler.cuh), with grouped_gemm.cu's TeamsFor count: up to 4 teams where a
// group has at most 1024 rows.
JAXFUSE_GG_DEFINE_GEMM_TEAMS(Bf16WgradSmall, cutlass::bfloat16_t, cutlass::layout::ColumnMajor,
                             cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                             128, 128, 64, 1, 1,
                             cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                             cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)
// kSmall's tile with a 1x2 cluster: the two CTAs of a cluster share (multicast) x's tile, so
// each loads 0.0117 instead of 0.0156 bytes of operands per flop. Run for kSmall when the
// column tiles pair up (ceil(n / 128) even). Measured (check_grouped_gemm --wgrad-configs,
// H100, s36): +0-11% over the 1x1 kernel at 512 rows per group, +3-8% over kLarge on a
// DeepSeek-like FC2 wgrad (k = 1408, n = 2048, 1536 rows per group).
JAXFUSE_GG_DEFINE_GEMM_TEAMS(Bf16WgradSmallPair, cutlass::bfloat16_t, cutlass::layout::ColumnMajor,
                             cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                             128, 128, 64, 1, 2,
                             cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                             cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)

size_t Bf16Wgrad_WorkspaceBytes(TileConfig config, int num_groups, int sm_count) {
  if (config != TileConfig::kSmall) {
    return CutlassWorkspaceBytes<Bf16WgradLarge>(num_groups, sm_count);
  }
  // Either small kernel may run (the choice needs n): room for both.
  return std::max(CutlassWorkspaceBytes<Bf16WgradSmall>(num_groups, sm_count),
                  CutlassWorkspaceBytes<Bf16WgradSmallPair>(num_groups, sm_count));
}

cudaError_t Bf16Wgrad_Run(TileConfig config, const GemmArrays& arrays, int sm_count,
                          cudaStream_t stream) {
  if (config != TileConfig::kSmall) return RunGemm<Bf16WgradLarge>(arrays, sm_count, stream);
  if (Bf16WgradPairsColumnTiles(arrays.columns)) {
    return RunGemm<Bf16WgradSmallPair>(arrays, sm_count, stream);
  }
  return RunGemm<Bf16WgradSmall>(arrays, sm_count, stream);
}

}  // namespace jaxfuse::grouped_gemm::detail
