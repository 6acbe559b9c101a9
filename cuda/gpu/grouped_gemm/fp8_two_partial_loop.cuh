// The k-tile loop shared by the pipelined FP8 mainloops (fp8_pipelined_promotion.cuh for the
// per-group kernels, fp8_blockwise_pipelined_promotion.cuh for the blockwise ones).
//
// Each k-tile is one committed wgmma batch into a partial accumulator, started from zero. Two
// partials alternate: k-tile t is issued into one before k-tile t-1, in the other, is
// retired (waited for, promoted into the fp32 accumulator, its shared-memory stage
// released), so the promotion's CUDA-core work overlaps k-tile t on the tensor cores. The
// last stage is left for the collective's mma_tail to release, as CUTLASS's mainloops do.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace jaxfuse::grouped_gemm::detail {

// The wgmma operand descriptors (MMA, M|N, K, PIPE) of A and B over every shared-memory
// stage, for the consumer warp group of thread `thread_idx`, as a (tCrA, tCrB) tuple.
template <class SmemLayoutA, class SmemLayoutB, class TiledMma, class TensorStorage>
CUTLASS_DEVICE auto MakeOperandFragments(TiledMma& tiled_mma, TensorStorage& shared_tensors,
                                         int thread_idx) {
  using namespace cute;
  constexpr int kThreadsPerWarpGroup = cutlass::NumThreadsPerWarpGroup;
  constexpr int kMmaWarpGroups = size(TiledMma{}) / kThreadsPerWarpGroup;
  Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
  Layout warp_group_thread_layout =
      make_layout(Int<kMmaWarpGroups>{}, Int<kThreadsPerWarpGroup>{});
  const int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / kThreadsPerWarpGroup, 0);
  auto thread_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
  return make_tuple(thread_mma.make_fragment_A(thread_mma.partition_A(sA)),
                    thread_mma.make_fragment_B(thread_mma.partition_B(sB)));
}

// Issues one k-tile (every k-block of shared-memory stage `stage`) into `partial`,
// starting from zero, as one committed wgmma batch.
template <class TiledMma, class FragmentA, class FragmentB, class Partial>
CUTLASS_DEVICE void IssueKTile(TiledMma& tiled_mma, FragmentA const& tCrA, FragmentB const& tCrB,
                               Partial& partial, int stage) {
  tiled_mma.accumulate_ = cute::GMMA::ScaleOut::Zero;
  cute::warpgroup_fence_operand(partial);
  cute::warpgroup_arrive();
  CUTLASS_PRAGMA_UNROLL
  for (int k_block = 0; k_block < cute::size<2>(tCrA); ++k_block) {
    cute::gemm(tiled_mma, tCrA(cute::_, cute::_, k_block, stage),
               tCrB(cute::_, cute::_, k_block, stage), partial);
    tiled_mma.accumulate_ = cute::GMMA::ScaleOut::One;
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_fence_operand(partial);
}

// Runs `k_tile_count` k-tiles through `partial0` / `partial1`:
//   issue(partial, stage): issue the k-tile in shared-memory stage `stage` into `partial`;
//   retire(partial, stage, cute::Int<W>{}, release): wait until at most W wgmma batches are
//     in flight (W = 1: the k-tile just issued runs on; W = 0: the last one), add `partial`
//     into the accumulator and call release() once the stage's shared memory is no longer
//     read (release is a no-op for the last k-tile, which mma_tail releases).
// The register arrays cannot be chosen by a run-time index, hence the loop unrolled by two.
template <class Pipeline, class PipelineState, class Partial, class Issue, class Retire>
CUTLASS_DEVICE void RunTwoPartialKTiles(Pipeline& pipeline, PipelineState smem_pipe_read,
                                        int k_tile_count, Partial& partial0, Partial& partial1,
                                        Issue&& issue, Retire&& retire) {
  // Empty groups get no tiles (the setup kernel zeroes their outputs), so a tile always has
  // k-tiles; the guard keeps a zero count from issuing a wait on nothing.
  if (k_tile_count <= 0) return;
  PipelineState smem_pipe_release = smem_pipe_read;
  auto next_stage = [&]() {
    auto token = pipeline.consumer_try_wait(smem_pipe_read);
    pipeline.consumer_wait(smem_pipe_read, token);
    const int stage = smem_pipe_read.index();
    ++smem_pipe_read;
    return stage;
  };
  auto release_stage = [&]() {
    pipeline.consumer_release(smem_pipe_release);
    ++smem_pipe_release;
  };
  auto keep_stage = []() {};
  using cute::Int;

  int held = next_stage();  // the stage of the k-tile issued before the one in flight
  issue(partial0, held);
  int remaining = k_tile_count - 1;
  CUTLASS_PRAGMA_NO_UNROLL
  while (remaining > 0) {
    int issued = next_stage();
    issue(partial1, issued);
    --remaining;
    retire(partial0, held, Int<1>{}, release_stage);
    held = issued;
    if (remaining == 0) {
      retire(partial1, held, Int<0>{}, keep_stage);
      return;
    }
    issued = next_stage();
    issue(partial0, issued);
    --remaining;
    retire(partial1, held, Int<1>{}, release_stage);
    held = issued;
  }
  retire(partial0, held, Int<0>{}, keep_stage);
}

}  // namespace jaxfuse::grouped_gemm::detail
