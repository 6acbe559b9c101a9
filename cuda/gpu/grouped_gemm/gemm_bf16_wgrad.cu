// bf16 wgrad: dw[g] = x[rows_g]^T @ dy[rows_g] (ragged contraction).
// CUTLASS terms: M = k, N = n, K = rows_g; A(i, r) = x[(lo + r) * k + i] (ColumnMajor A =
// M-major, ld k); B(j, r) = dy[(lo + r) * n + j] (RowMajor B = N-major, ld n);
// D = dw[g] (RowMajor, ld n). Empty groups get M = 0 (no tiles) and are zeroed separately.
#include <cstdlib>
#include <cstring>

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
// kSmall's tile with a 1x2 cluster: the two CTAs of a cluster share (multicast) x's tile, so
// each loads 0.0117 instead of 0.0156 bytes of operands per flop. Run for kSmall when the
// column tiles pair up (ceil(n / 128) even). Measured (check_grouped_gemm --wgrad-configs,
// H100, s36): +0-11% over the 1x1 kernel at 512 rows per group, +3-8% over kLarge on a
// DeepSeek-like FC2 wgrad (k = 1408, n = 2048, 1536 rows per group).
JAXFUSE_GG_DEFINE_GEMM(Bf16WgradSmallPair, cutlass::bfloat16_t, cutlass::layout::ColumnMajor,
                       cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                       128, 128, 64, 1, 2,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)

// Experimental (s37): kSmall's tile with a 2x2 cluster (both operands multicast: 0.0078
// bytes per flop) or a 1x4 one (x's tile shared by four: 0.0098), picked instead of the 1x2
// kernel by JAXFUSE_GROUPED_GEMM_WGRAD_CLUSTER=2x2 / 1x4, read at every call so
// check_grouped_gemm can switch it in one process. Where the tiles do not divide by the
// cluster, CUTLASS's scheduler idles the spare CTAs (correct, slower).
JAXFUSE_GG_DEFINE_GEMM(Bf16WgradSmallQuad, cutlass::bfloat16_t, cutlass::layout::ColumnMajor,
                       cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                       128, 128, 64, 2, 2,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)
JAXFUSE_GG_DEFINE_GEMM(Bf16WgradSmallRow4, cutlass::bfloat16_t, cutlass::layout::ColumnMajor,
                       cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                       128, 128, 64, 1, 4,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)

namespace {
// 4 for "2x2", 14 for "1x4", else 0 (the default kernels).
int ExperimentalSmallCluster() {
  const char* value = std::getenv("JAXFUSE_GROUPED_GEMM_WGRAD_CLUSTER");
  if (value == nullptr) return 0;
  if (std::strcmp(value, "2x2") == 0) return 4;
  if (std::strcmp(value, "1x4") == 0) return 14;
  return 0;
}
}  // namespace

size_t Bf16Wgrad_WorkspaceBytes(TileConfig config, int num_groups, int sm_count) {
  if (config != TileConfig::kSmall) {
    return CutlassWorkspaceBytes<Bf16WgradLarge>(num_groups, sm_count);
  }
  // Either small kernel may run (the choice needs n): room for both.
  return std::max({CutlassWorkspaceBytes<Bf16WgradSmall>(num_groups, sm_count),
                   CutlassWorkspaceBytes<Bf16WgradSmallPair>(num_groups, sm_count),
                   CutlassWorkspaceBytes<Bf16WgradSmallQuad>(num_groups, sm_count),
                   CutlassWorkspaceBytes<Bf16WgradSmallRow4>(num_groups, sm_count)});
}

cudaError_t Bf16Wgrad_Run(TileConfig config, const GemmArrays& arrays, int sm_count,
                          cudaStream_t stream) {
  if (config != TileConfig::kSmall) return RunGemm<Bf16WgradLarge>(arrays, sm_count, stream);
  switch (ExperimentalSmallCluster()) {
    case 4: return RunGemm<Bf16WgradSmallQuad>(arrays, sm_count, stream);
    case 14: return RunGemm<Bf16WgradSmallRow4>(arrays, sm_count, stream);
    default: break;
  }
  if (Bf16WgradPairsColumnTiles(arrays.columns)) {
    return RunGemm<Bf16WgradSmallPair>(arrays, sm_count, stream);
  }
  return RunGemm<Bf16WgradSmall>(arrays, sm_count, stream);
}

}  // namespace jaxfuse::grouped_gemm::detail
