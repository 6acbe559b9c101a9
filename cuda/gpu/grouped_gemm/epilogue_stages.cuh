// An A/B of the bf16 epilogue's shared-memory store buffering (JAXFUSE_GROUPED_GEMM_
// EPILOGUE_STAGES=4): kernels built with 4 output-subtile buffers next to the builder's 2.
// Included by gemm_bf16_fwd.cu and gemm_bf16_wgrad.cu only.
#pragma once

#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {
// 0 (the builder's 2 buffers) or 4, from JAXFUSE_GROUPED_GEMM_EPILOGUE_STAGES, read once
// (grouped_gemm.cu); check_grouped_gemm sets it through SetEpilogueStagesOption.
int EpilogueStagesOption();
void SetEpilogueStagesOption(int stages);
}  // namespace jaxfuse::grouped_gemm::detail

// JAXFUSE_GG_DEFINE_GEMM with STAGES_D shared-memory buffers for the epilogue's output
// subtiles instead of the builder's 2 (min(subtiles, 2)): the epilogue waits before writing
// a subtile until at most STAGES_D - 1 earlier TMA stores still read shared memory. The
// mainloop's stage count shrinks to what is left (StageCountAutoCarveout).
#define JAXFUSE_GG_DEFINE_GEMM_EPILOGUE_STAGES(NAME, EA, LA, EB, LB, ED, TM, TN, TK, CM, CN, KS,  \
                                               ES, STAGES_D)                                 \
  namespace NAME##_types {                                                                 \
  using TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::Int<TK>>;              \
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;                \
  static constexpr int kAlignA = 128 / cutlass::sizeof_bits<EA>::value;                    \
  static constexpr int kAlignB = 128 / cutlass::sizeof_bits<EB>::value;                    \
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ED>::value;                    \
  using EpilogueTile = decltype(cutlass::epilogue::collective::detail::                    \
                                    sm90_compute_tile_shape_or_override<                   \
                                        ED, cutlass::epilogue::collective::EpilogueTileAuto, \
                                        ES, TileShape>());                                 \
  using BuilderPolicy = decltype(cutlass::epilogue::collective::detail::                   \
                                     sm90_get_tma_dispatch_policy<TileShape, EpilogueTile, \
                                                                  void, ED, ES>());        \
  using EpiloguePolicy = cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<                \
      BuilderPolicy::StagesC, STAGES_D, BuilderPolicy::FragmentSize,                       \
      BuilderPolicy::ReuseSmemC, BuilderPolicy::DelayTmaStore,                             \
      BuilderPolicy::NumEpilogueWarpGroups>;                                               \
  using CollectiveEpilogue = typename cutlass::epilogue::collective::detail::              \
      Sm90TmaBuilderImpl<TileShape, EpilogueTile, float, float, void,                      \
                         cutlass::layout::RowMajor*, kAlignD, ED, cutlass::layout::RowMajor*, \
                         kAlignD, cutlass::epilogue::fusion::LinearCombination<ED, float, void, float>, \
                         EpiloguePolicy>::CollectiveOp;                                    \
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<        \
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, EA, LA*, kAlignA, EB, LB*,      \
      kAlignB, float, TileShape, ClusterShape,                                             \
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(                  \
          sizeof(typename CollectiveEpilogue::SharedStorage))>,                            \
      KS>::CollectiveOp;                                                                   \
  using Kernel = cutlass::gemm::kernel::GemmUniversal<GroupShape, CollectiveMainloop,      \
                                                      CollectiveEpilogue>;                 \
  }                                                                                        \
  using NAME = cutlass::gemm::device::GemmUniversalAdapter<NAME##_types::Kernel>;

// JAXFUSE_GG_DEFINE_FAMILY_2 whose configs also have a kernel with 4 epilogue stages
// (JAXFUSE_GG_DEFINE_GEMM_EPILOGUE_STAGES), run when ActiveTuningOptions().epilogue_stages
// is 4: an A/B of the epilogue's store buffering.
#define JAXFUSE_GG_DEFINE_FAMILY_2_EPILOGUE_STAGES(NAME, LARGE, LARGE4, SMALL, SMALL4)          \
  size_t NAME##_WorkspaceBytes(TileConfig config, int num_groups, int sm_count) {          \
    return config == TileConfig::kSmall                                                    \
               ? std::max(CutlassWorkspaceBytes<SMALL>(num_groups, sm_count),              \
                          CutlassWorkspaceBytes<SMALL4>(num_groups, sm_count))             \
               : std::max(CutlassWorkspaceBytes<LARGE>(num_groups, sm_count),              \
                          CutlassWorkspaceBytes<LARGE4>(num_groups, sm_count));            \
  }                                                                                        \
  cudaError_t NAME##_Run(TileConfig config, const GemmArrays& arrays, int sm_count,        \
                         cudaStream_t stream) {                                            \
    const bool four = EpilogueStagesOption() == 4;                          \
    if (config == TileConfig::kSmall) {                                                    \
      return four ? RunGemm<SMALL4>(arrays, sm_count, stream)                              \
                  : RunGemm<SMALL>(arrays, sm_count, stream);                              \
    }                                                                                      \
    return four ? RunGemm<LARGE4>(arrays, sm_count, stream)                                \
                : RunGemm<LARGE>(arrays, sm_count, stream);                                \
  }
