// FP8 mainloop with promoted fp32 accumulation whose promotions overlap the tensor cores.
//
// CUTLASS's promoted FP8 mainloop (MainloopSm90ArrayTmaGmmaWarpSpecializedFP8, through
// GmmaFP8Accumulation) issues a k-tile's wgmma into a partial accumulator, waits for *all*
// of them to finish (warpgroup_wait<0>) and adds the partial into the fp32 accumulator
// before it issues the next k-tile: every k-tile ends in a bubble on the tensor cores that
// only the other consumer warp group can fill. The mainloop below keeps two partial
// accumulators and alternates between them: while k-tile t runs into one, the FADDs promote
// k-tile t-1 out of the other. Three register sets instead of two: at the cooperative
// 128x128 tile each consumer warp group holds 64x128 outputs, 3 x 64 fp32 registers per
// thread, inside the 232 that the kernel gives a consumer thread.
//
// Numerics are the stock mainloop's at its default promotion interval (one k-tile of 128 =
// 4 wgmma k-blocks of 32): each k-tile is accumulated in the tensor cores from zero and
// added to the fp32 accumulator in the same order. `mma_promotion_interval` is ignored.
//
// Everything else (TMA loads, pipeline, tensormap updates for the pointer array, mma_tail)
// is the base collective's: the derived type only replaces mma(), whose k-tile loop is
// fp8_two_partial_loop.cuh's. Like the base, it leaves the last k-tile's shared-memory stage
// for mma_tail to release.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "fp8_two_partial_loop.cuh"

namespace jaxfuse::grouped_gemm::detail {

template <class Base>
struct PipelinedPromotionMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;

  // accum += partial, once the wgmma batch that wrote `partial` has completed.
  template <class Accumulator, class Partial>
  CUTLASS_DEVICE static void Promote(Accumulator& accum, Partial& partial) {
    cute::warpgroup_fence_operand(partial);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size(accum); ++i) accum(i) += partial(i);
    cute::warpgroup_fence_operand(partial);
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const& /*mainloop_params*/) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");
    TiledMma tiled_mma;
    auto fragments = MakeOperandFragments<SmemLayoutA, SmemLayoutB>(tiled_mma, shared_tensors,
                                                                    thread_idx);
    auto& tCrA = get<0>(fragments);
    auto& tCrB = get<1>(fragments);

    Tensor partial0 = make_fragment_like(accum);
    Tensor partial1 = make_fragment_like(accum);
    clear(accum);
    RunTwoPartialKTiles(
        pipeline, smem_pipe_read, k_tile_count, partial0, partial1,
        [&](auto& partial, int stage) { IssueKTile(tiled_mma, tCrA, tCrB, partial, stage); },
        [&](auto& partial, int /*stage*/, auto in_flight, auto&& release) {
          warpgroup_wait<decltype(in_flight)::value>();
          release();  // the wgmma that read the stage is done; the FADDs read registers
          Promote(accum, partial);
        });
  }
};

}  // namespace jaxfuse::grouped_gemm::detail
