// Blockwise-scaled FP8 mainloop whose scaled promotions overlap the tensor cores.
//
// CUTLASS's blockwise FP8 mainloop (MainloopSm90ArrayTmaGmmaWarpSpecializedBlockwise) issues
// a k-tile's wgmma into a partial accumulator, waits for it (warpgroup_wait<0>) and only then
// multiplies the partial by the k-tile's scales into the fp32 accumulator, before it issues
// the next k-tile: every k-tile ends in a bubble on the tensor cores. The mainloop below does
// for the blockwise kernels what PipelinedPromotionMainloop (fp8_pipelined_promotion.cuh)
// does for the per-group ones: two partial accumulators, and k-tile t's wgmma runs while
// k-tile t-1's partial is scaled and added (the loop is fp8_two_partial_loop.cuh's).
//
// The scales live in the same shared-memory stage as the operands (the producer loads them
// there with cp.async), so a stage's scales are read and used before that stage is released.
//
// Numerics are the stock mainloop's at its only promotion interval here (one k-tile of 128 =
// one scale block = 4 wgmma k-blocks of 32): each k-tile is accumulated in the tensor cores
// from zero, multiplied by the same scale products in the same order and added to the fp32
// accumulator; the results are bit-identical to the stock mainloop's.
//
// Registers: three fp32 accumulator sets (64 each at a 64x128 warp-group tile) plus the
// scales: one combined scale per row for the forward/dgrad (1 x 128 and 128 x 128 blocks:
// two per thread), a row scale per output row for the wgrad (two per thread; its column
// scales stay in shared memory).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "fp8_two_partial_loop.cuh"

namespace jaxfuse::grouped_gemm::detail {

template <class Base>
struct PipelinedBlockwiseMainloop : Base {
  using typename Base::ElementBlockScale;
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::SmemLayoutSFB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  static constexpr int kScaleRowsPerTile = Base::ScaleMsPerTile;
  static constexpr int kScaleColumnsPerTile = Base::ScaleNsPerTile;
  static_assert(Base::ScalePromotionInterval == 4,
                "one scale block per 128-deep k-tile: every k-tile is promoted");
  // The two scale shapes jaxfuse builds (gemm_common.cuh): a scale per output row and one
  // per tile for the columns (BlockScaleConfig: forward and dgrad), or a scale per output
  // row and per output column (WgradBlockScaleConfig).
  static_assert(kScaleRowsPerTile > 1, "a scale per output row");
  // The wgrad: its thread's 32 column scales are read from shared memory as the promotion
  // uses them instead of being held in registers (three accumulator sets plus 34 scales
  // spilled, 156 bytes at 232 registers).
  static constexpr bool kColumnScalesFromSmem = kScaleColumnsPerTile > 1;

  // Reads stage `stage`'s row scales into registers; for the forward/dgrad also the tile's
  // column scale, folded into each row scale (as the stock mainloop does, same rounding).
  template <class SmemScalesA, class SmemScalesB, class ScalesA, class ScalesB>
  CUTLASS_DEVICE static void LoadScales(SmemScalesA const& tCsSFA, SmemScalesB const& tCsSFB,
                                        ScalesA& tCrSFA, ScalesB& tCrSFB, int stage) {
    using namespace cute;
    copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), tCrSFA);
    if constexpr (!kColumnScalesFromSmem) {
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), tCrSFB);
      const ElementBlockScale scale_b = tCrSFB(_0{});
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(filter_zeros(tCrSFA)); ++i) {
        filter_zeros(tCrSFA)(i) = filter_zeros(tCrSFA)(i) * scale_b;
      }
    }
  }

  // accum += partial * scales, once the wgmma batch that wrote `partial` has completed.
  template <class Accumulator, class Partial, class ScalesA, class ScalesB>
  CUTLASS_DEVICE static void PromoteScaled(Accumulator& accum, Partial& partial,
                                           ScalesA const& tCrSFA, ScalesB const& tCrSFB) {
    using namespace cute;
    warpgroup_fence_operand(partial);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); ++i) {
      if constexpr (kColumnScalesFromSmem) {
        accum(i) += partial(i) * tCrSFA(i) * tCrSFB(i);
      } else {
        accum(i) += partial(i) * tCrSFA(i);
      }
    }
    warpgroup_fence_operand(partial);
  }

  // PromoteScaled with stage `stage`'s scales: the registers LoadScales filled, or for the
  // column scales of the wgrad the stage itself (kColumnScalesFromSmem).
  template <class Accumulator, class Partial, class ScalesA, class ScalesB, class SmemScalesB>
  CUTLASS_DEVICE static void PromoteStage(Accumulator& accum, Partial& partial,
                                          ScalesA const& tCrSFA, ScalesB const& tCrSFB,
                                          SmemScalesB const& tCsSFB, int stage) {
    using namespace cute;
    if constexpr (kColumnScalesFromSmem) {
      PromoteScaled(accum, partial, tCrSFA, tCsSFB(_, _, _, make_coord(_0{}, stage)));
    } else {
      PromoteScaled(accum, partial, tCrSFA, tCrSFB);
    }
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const& /*mainloop_params*/) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");
    // The scale stages seen as (BLK_M, BLK_N, (BLK_K, PIPE)) tensors that broadcast A's
    // scales along N and B's along M, so that they partition like the accumulator.
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                               make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                    make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                make_stride(stride<1>(SmemLayoutSFA{}),
                                            stride<2>(SmemLayoutSFA{})))));
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                               make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                    make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                make_stride(stride<1>(SmemLayoutSFB{}),
                                            stride<2>(SmemLayoutSFB{})))));

    TiledMma tiled_mma;
    auto fragments = MakeOperandFragments<SmemLayoutA, SmemLayoutB>(tiled_mma, shared_tensors,
                                                                    thread_idx);
    auto& tCrA = get<0>(fragments);
    auto& tCrB = get<1>(fragments);
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);  // (MMA,M,N,(K,PIPE))
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
    // One register per distinct scale (the broadcast modes keep stride 0).
    Tensor tCrSFA = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
    Tensor tCrSFB = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));

    Tensor partial0 = make_fragment_like(accum);
    Tensor partial1 = make_fragment_like(accum);
    clear(accum);
    RunTwoPartialKTiles(
        pipeline, smem_pipe_read, k_tile_count, partial0, partial1,
        [&](auto& partial, int stage) { IssueKTile(tiled_mma, tCrA, tCrB, partial, stage); },
        [&](auto& partial, int stage, auto in_flight, auto&& release) {
          // The scale loads go out before the wait, so that they overlap it.
          LoadScales(tCsSFA, tCsSFB, tCrSFA, tCrSFB, stage);
          warpgroup_wait<decltype(in_flight)::value>();
          PromoteStage(accum, partial, tCrSFA, tCrSFB, tCsSFB, stage);
          // The stage's scales have been read: the compiler barrier keeps those
          // shared-memory reads ahead of the arrive that hands the stage back.
          asm volatile("" ::: "memory");
          release();
        });
  }
};

}  // namespace jaxfuse::grouped_gemm::detail
