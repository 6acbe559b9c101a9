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
  using CollectiveEpilogue =
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<GatedEpilogueArray>;
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

namespace {

template <class Gemm>
typename Gemm::Arguments MakeGatedArguments(const GemmArrays& arrays, int sm_count,
                                            int max_active_clusters) {
  using Kernel = typename Gemm::GemmKernel;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using UnderlyingShape = typename GroupShape::UnderlyingProblemShape;
  static_assert(sizeof(UnderlyingShape) == 3 * sizeof(int32_t), "problem shape layout");
  static_assert(sizeof(StrideA) == sizeof(int64_t) && sizeof(StrideB) == sizeof(int64_t),
                "stride layouts");
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = GroupShape{arrays.num_groups,
                                  reinterpret_cast<UnderlyingShape*>(arrays.problem_shapes), nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const cutlass::bfloat16_t**>(arrays.ptr_a);
  args.mainloop.dA = reinterpret_cast<StrideA*>(arrays.stride_a);
  args.mainloop.ptr_B = reinterpret_cast<const cutlass::bfloat16_t**>(arrays.ptr_b);
  args.mainloop.dB = reinterpret_cast<StrideB*>(arrays.stride_b);
  args.epilogue.ptr_D = reinterpret_cast<cutlass::bfloat16_t**>(arrays.ptr_d);
  args.epilogue.dD = nullptr;
  if (arrays.gated != nullptr) {
    const GatedEpilogue& gated = *arrays.gated;
    GatedEpilogueParams& params = args.epilogue.gated;
    params.activation = gated.activation;
    params.scales = gated.scales;
    params.scales_f32 = gated.scales_f32;
    params.h = static_cast<const __nv_bfloat16*>(arrays.out);
    params.act = static_cast<__nv_bfloat16*>(gated.act_out);
    params.columns = arrays.columns;
  }
  using Raster = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = arrays.raster == 'N' ? Raster::AlongN : Raster::AlongM;
  args.scheduler.max_swizzle_size = ActiveTuningOptions().swizzle;
  args.hw_info.device_id = 0;
  args.hw_info.sm_count = sm_count;
  args.hw_info.max_active_clusters = max_active_clusters;
  return args;
}

template <class Gemm>
size_t GatedWorkspaceBytes(int num_groups, int sm_count) {
  GemmArrays dummy;
  dummy.num_groups = num_groups;
  return Gemm::get_workspace_size(MakeGatedArguments<Gemm>(dummy, sm_count, 0));
}

template <class Gemm>
cudaError_t RunGated(const GemmArrays& arrays, int sm_count, cudaStream_t stream) {
  auto args = MakeGatedArguments<Gemm>(arrays, sm_count, MaxActiveClusters<Gemm>());
  if (Gemm::get_workspace_size(args) > arrays.cutlass_workspace_bytes) {
    return cudaErrorInvalidValue;
  }
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.initialize(args, arrays.cutlass_workspace, stream) != cutlass::Status::kSuccess) {
    cudaError_t error = cudaGetLastError();
    return error != cudaSuccess ? error : cudaErrorUnknown;
  }
  if (gemm.run(stream, /*cuda_adapter=*/nullptr, arrays.pdl) != cutlass::Status::kSuccess) {
    cudaError_t error = cudaGetLastError();
    return error != cudaSuccess ? error : cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}

}  // namespace

size_t Bf16FwdGated_WorkspaceBytes(TileConfig, int num_groups, int sm_count) {
  return std::max({GatedWorkspaceBytes<Bf16FwdGatedGemm>(num_groups, sm_count),
                   GatedWorkspaceBytes<Bf16FwdGatedGemm1x1>(num_groups, sm_count),
                   GatedWorkspaceBytes<Bf16FwdGatedPingpong>(num_groups, sm_count)});
}

// kSmall: the ping-pong kernel; otherwise the cooperative one, its 1x2 cluster where a
// group's F / 128 column tiles pair up (arrays.columns = n = 2F).
cudaError_t Bf16FwdGated_Run(TileConfig config, const GemmArrays& arrays, int sm_count,
                             cudaStream_t stream) {
  if (sm_count <= 0 || arrays.num_groups <= 0 || arrays.gated == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (config == TileConfig::kSmall) return RunGated<Bf16FwdGatedPingpong>(arrays, sm_count, stream);
  const bool paired = arrays.columns / 256 % 2 == 0;
  return paired ? RunGated<Bf16FwdGatedGemm>(arrays, sm_count, stream)
                : RunGated<Bf16FwdGatedGemm1x1>(arrays, sm_count, stream);
}

}  // namespace jaxfuse::grouped_gemm::detail
