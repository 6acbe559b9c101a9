// bf16 forward of a gated MLP's FC1 with the scaled activation in its epilogue
// (gated_epilogue.cuh): h[rows_g] = x[rows_g] @ w1[g] and a = act(h) * scales, one kernel.
// Layouts as gemm_bf16_fwd.cu (A = x K-major, B = w1[g] N-major); the kLarge tile
// (cooperative 128x256x64), CUTLASS's per-SM descriptors.
#include "gated_epilogue.cuh"
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

// CLUSTER_N CTAs along N share the x tile by multicast: 2 (the kLarge tile's cluster) where
// a group's F / 128 column tiles pair up, else 1 (a 1x2 cluster would pad an odd count and
// spend a tile's mainloop on nothing).
// TILE_N columns per tile (half gate, half linear); KERNEL_SCHEDULE cooperative (128 x 256,
// both warp groups on one tile) or ping-pong (128 x 128, the warp groups on alternate
// tiles, one's epilogue under the other's mainloop).
template <int kTileN, int kClusterN, class KernelSchedule>
struct GatedKernelTypes {
  using TileShape = cute::Shape<cute::_128, cute::Int<kTileN>, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::Int<kClusterN>, cute::_1>;
  using CollectiveEpilogue = GatedEpilogueAdapter<GatedEpilogueArray>;
  using CollectiveMainloop = GatedTileMainloop<typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::bfloat16_t,
      cutlass::layout::RowMajor*, 8, cutlass::bfloat16_t, cutlass::layout::RowMajor*, 8, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp>;
  using Kernel = WaitForPriorGrid<
      cutlass::gemm::kernel::GemmUniversal<GroupShape, CollectiveMainloop, CollectiveEpilogue>>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};
using Cooperative = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using Bf16FwdGatedGemm = GatedKernelTypes<256, 2, Cooperative>::Gemm;
using Bf16FwdGatedGemm1x1 = GatedKernelTypes<256, 1, Cooperative>::Gemm;
using Bf16FwdGatedPingpong =
    GatedKernelTypes<128, 1, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong>::Gemm;

size_t Bf16FwdGated_WorkspaceBytes(TileConfig, int num_groups, int sm_count) {
  return std::max({CutlassWorkspaceBytes<Bf16FwdGatedGemm>(num_groups, sm_count),
                   CutlassWorkspaceBytes<Bf16FwdGatedGemm1x1>(num_groups, sm_count),
                   CutlassWorkspaceBytes<Bf16FwdGatedPingpong>(num_groups, sm_count)});
}

// kSmall: the ping-pong kernel; otherwise the cooperative one, its 1x2 cluster where a
// group's F / 128 column tiles pair up (arrays.columns = n = 2F).
cudaError_t Bf16FwdGated_Run(TileConfig config, const GemmArrays& arrays, int sm_count,
                             cudaStream_t stream) {
  if (arrays.gated == nullptr) return cudaErrorInvalidValue;
  if (config == TileConfig::kSmall) return RunGemm<Bf16FwdGatedPingpong>(arrays, sm_count, stream);
  const bool paired = arrays.columns / 256 % 2 == 0;
  return paired ? RunGemm<Bf16FwdGatedGemm>(arrays, sm_count, stream)
                : RunGemm<Bf16FwdGatedGemm1x1>(arrays, sm_count, stream);
}

}  // namespace jaxfuse::grouped_gemm::detail
