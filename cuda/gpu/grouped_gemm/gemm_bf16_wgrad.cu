// bf16 wgrad: dw[g] = x[rows_g]^T @ dy[rows_g] (ragged contraction).
// CUTLASS terms: M = k, N = n, K = rows_g; A(i, r) = x[(lo + r) * k + i] (ColumnMajor A =
// M-major, ld k); B(j, r) = dy[(lo + r) * n + j] (RowMajor B = N-major, ld n);
// D = dw[g] (RowMajor, ld n). Empty groups get M = 0 (no tiles) and are zeroed separately.
#include <cstdlib>

#include "wgrad_variants.cuh"

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

int& Bf16WgradVariant() {
  static int variant = [] {
    const char* value = std::getenv("JAXFUSE_GROUPED_GEMM_WGRAD_VARIANT");
    const int parsed = value ? std::atoi(value) : 0;
    return parsed >= 1 && parsed <= 6 ? parsed : 0;
  }();
  return variant;
}

// JAXFUSE_GG_DEFINE_FAMILY_2, except that JAXFUSE_GROUPED_GEMM_WGRAD_VARIANT=1..6 runs one
// of the experimental kernels of wgrad_variants.cuh instead of either config.
size_t Bf16Wgrad_WorkspaceBytes(TileConfig config, int num_groups, int sm_count) {
  const size_t own = config == TileConfig::kSmall
                         ? CutlassWorkspaceBytes<Bf16WgradSmall>(num_groups, sm_count)
                         : CutlassWorkspaceBytes<Bf16WgradLarge>(num_groups, sm_count);
  if (Bf16WgradVariant() == 0) return own;
  return std::max({own, Bf16WgradVariantA_WorkspaceBytes(num_groups, sm_count),
                   Bf16WgradVariantB_WorkspaceBytes(num_groups, sm_count)});
}

cudaError_t Bf16Wgrad_Run(TileConfig config, const GemmArrays& arrays, int sm_count,
                          cudaStream_t stream) {
  const int variant = Bf16WgradVariant();
  if (variant >= 1 && variant <= 3) return Bf16WgradVariantA_Run(variant, arrays, sm_count, stream);
  if (variant >= 4 && variant <= 6) return Bf16WgradVariantB_Run(variant, arrays, sm_count, stream);
  return config == TileConfig::kSmall ? RunGemm<Bf16WgradSmall>(arrays, sm_count, stream)
                                      : RunGemm<Bf16WgradLarge>(arrays, sm_count, stream);
}

}  // namespace jaxfuse::grouped_gemm::detail
