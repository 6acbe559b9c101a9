// Experimental bf16 wgrad kernels for short contractions (512 rows per group: 8 k-blocks
// per output tile), selected by JAXFUSE_GROUPED_GEMM_WGRAD_VARIANT=1..6 in place of the
// family's configs (gemm_bf16_wgrad.cu), to measure which of two suspected costs keeps the
// 64 x 512 wgrad at ~0.8 of cuBLAS's batched GEMM (README "Against XLA's batched GEMM"):
//   - L2 -> SM operand traffic: a 128x128 tile with no cluster loads 0.0156 bytes per flop,
//     more than a cluster-multicast or 128x256 tile (variants 1, 2, 5, 6);
//   - the epilogue: with CUTLASS's 2 store stages the consumers wait on their TMA stores
//     within every tile; a whole tile of store stages lets them go straight back to the
//     mainloop (variants 3, 4, 6).
// Same layouts as gemm_bf16_wgrad.cu. Whatever wins becomes a config there and the rest go.
// Kernels 1-3 live in gemm_bf16_wgrad_variants_a.cu, 4-6 in _b.cu (compile time and memory).
#pragma once
#include "gemm_common.cuh"


// JAXFUSE_GG_DEFINE_GEMM with the TMA epilogue's store stages (StagesD) set to STAGES_D
// instead of the builder's min(epilogue subtiles, 2); everything else as the builder does.
#define JAXFUSE_GG_DEFINE_BF16_WGRAD_EPI_STAGES(NAME, TM, TN, CM, CN, KS, ES, STAGES_D)      \
  namespace NAME##_types {                                                                 \
  using Element = cutlass::bfloat16_t;                                                     \
  using TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::_64>;                  \
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;                \
  using EpilogueTile = decltype(cutlass::epilogue::collective::detail::                    \
                                    sm90_compute_tile_shape_or_override<                   \
                                        Element, cutlass::epilogue::collective::           \
                                                     EpilogueTileAuto,                     \
                                        ES, TileShape>());                                 \
  static constexpr int kEpiTiles =                                                         \
      cute::size(cute::shape_div(cute::take<0, 2>(TileShape{}), EpilogueTile{}));          \
  static_assert(STAGES_D <= kEpiTiles, "more store stages than epilogue subtiles");        \
  using EpiPolicy = cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<                     \
      cute::min(kEpiTiles, 4), STAGES_D,                                                   \
      cute::size(EpilogueTile{}) /                                                         \
          (cutlass::epilogue::collective::detail::sm90_is_cooperative_v<ES> ? 256 : 128),  \
      /*ReuseSmemC=*/false, /*DelayTmaStore=*/false, ES::NumEpilogueWarpGroups>;           \
  using CollectiveEpilogue = typename cutlass::epilogue::collective::detail::              \
      Sm90TmaBuilderImpl<TileShape, EpilogueTile, float, float, void,                      \
                         cutlass::layout::RowMajor*, 8, Element,                           \
                         cutlass::layout::RowMajor*, 8,                                    \
                         cutlass::epilogue::fusion::LinearCombination<Element, float,      \
                                                                      void, float>,        \
                         EpiPolicy>::CollectiveOp;                                         \
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<        \
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element,                        \
      cutlass::layout::ColumnMajor*, 8, Element, cutlass::layout::RowMajor*, 8, float,     \
      TileShape, ClusterShape,                                                             \
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(                  \
          sizeof(typename CollectiveEpilogue::SharedStorage))>,                            \
      KS>::CollectiveOp;                                                                   \
  using Kernel = WaitForPriorGrid<cutlass::gemm::kernel::GemmUniversal<                    \
      GroupShape, CollectiveMainloop, CollectiveEpilogue>>;                                \
  }                                                                                        \
  using NAME = cutlass::gemm::device::GemmUniversalAdapter<NAME##_types::Kernel>;

#define JAXFUSE_GG_WGRAD_VARIANT(NAME, TM, TN, CM, CN, KS, ES)                              \
  JAXFUSE_GG_DEFINE_GEMM(NAME, cutlass::bfloat16_t, cutlass::layout::ColumnMajor,          \
                         cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t, \
                         TM, TN, 64, CM, CN, KS, ES)

namespace jaxfuse::grouped_gemm::detail {
// The active variant: JAXFUSE_GROUPED_GEMM_WGRAD_VARIANT (0 = the family's configs) at first
// use; check_grouped_gemm --wgrad-variants assigns it. Defined in gemm_bf16_wgrad.cu.
int& Bf16WgradVariant();
// Kernels 1-3 (part A) and 4-6 (part B).
size_t Bf16WgradVariantA_WorkspaceBytes(int num_groups, int sm_count);
size_t Bf16WgradVariantB_WorkspaceBytes(int num_groups, int sm_count);
cudaError_t Bf16WgradVariantA_Run(int variant, const GemmArrays& arrays, int sm_count,
                                  cudaStream_t stream);
cudaError_t Bf16WgradVariantB_Run(int variant, const GemmArrays& arrays, int sm_count,
                                  cudaStream_t stream);
using cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
using cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
}  // namespace jaxfuse::grouped_gemm::detail
