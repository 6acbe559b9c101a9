// A group tile scheduler that splits the persistent CTAs into teams, each walking its own
// contiguous share of the tiles, so that a CTA changes group every few tiles instead of at
// nearly every one.
//
// Why: CUTLASS's group scheduler hands cluster p the work units p, p + P, p + 2P, ... of
// the tile list of every group laid end to end (P clusters). A 512-row group of the bf16
// forward is 128 ping-pong tiles of 128 x 128 and P = 132, so a ping-pong CTA changes group
// at every tile; its DRAM reads then run at 1.7-1.9x the operands' size and it runs 40%
// below CUTLASS's strided-batched ping-pong kernel with the same tile order
// (README.md, "Raster order and DRAM traffic"). The gap shrinks as groups grow (13% for the
// 512-row wgrad, which changes group every ~4 tiles; 2-3% at 8192 rows, every ~16 tiles).
//
// How: with T teams (GemmArrays::teams: grouped_gemm.cu's TeamsFor, or
// JAXFUSE_GROUPED_GEMM_TEAMS), team k owns the clusters [p_k, p_{k+1}), p_k = floor(k P / T),
// and the work units [floor(U p_k / P), floor(U p_{k+1} / P)) of the U units in all (a unit
// is one cluster's worth of tiles: the stock scheduler's linear index divided by the cluster
// size). Within a team, cluster s walks its units s, s + S, s + 2S, ... (S clusters in the
// team; jaxfuse/team_share.h, whose host test checks that every unit is walked exactly
// once). Each team's share is proportional to its clusters, and a unit maps to
// (group, m, n) exactly as in CUTLASS's scheduler, so raster order, swizzle and clusters
// mean what they meant. T = 1 is CUTLASS's order.
//
// U needs every group's tile count: each warp sums them from the device shapes when its
// scheduler is built (G / 32 loads per lane), only where T > 1.
#pragma once

#include <cstdint>

#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/sm90_tile_scheduler_group.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "jaxfuse/team_share.h"

namespace jaxfuse::grouped_gemm::detail {

// The grouped problem shape of kernels scheduled by teams: GroupProblemShape itself, as a
// distinct type so that CUTLASS's scheduler selector (specialized below) picks
// TeamGroupTileScheduler for exactly these kernels.
template <class UnderlyingShape>
struct TeamGroupProblemShape : cutlass::gemm::GroupProblemShape<UnderlyingShape> {};

template <class GroupProblemShape, int SchedulerPipelineStageCount>
class TeamGroupTileScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<
          GroupProblemShape, SchedulerPipelineStageCount> {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<
      GroupProblemShape, SchedulerPipelineStageCount>;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  using RasterOrder = typename Base::RasterOrder;
  using SchedulerResponse = typename Base::SchedulerResponse;

  struct Arguments : Base::Arguments {
    int teams = 1;  // 1: CUTLASS's order
  };
  struct Params : Base::Params {
    int teams = 1;
  };

  template <class TileShape, class ClusterShape>
  static Params to_underlying_arguments(GroupProblemShape problem_shapes, TileShape tile_shape,
                                        ClusterShape cluster_shape,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& arguments, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(
        problem_shapes, tile_shape, cluster_shape, hw_info, arguments, workspace,
        epilogue_subtile, ktile_start_alignment_count);
    params.teams = arguments.teams > 1 ? arguments.teams : 1;
    return params;
  }

  TeamGroupTileScheduler() = default;

  CUTLASS_DEVICE TeamGroupTileScheduler(Params const& params, SchedulerResponse* response_ptr)
      : Base(params, response_ptr) {
#if defined(__CUDA_ARCH__)
    // The stock first linear index (as CUTLASS's constructor computes it) is
    // cluster * cluster_size + position in the cluster.
    const bool along_n = params.raster_order_ == RasterOrder::AlongN;
    const uint64_t first = along_n ? uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * gridDim.x
                                   : uint64_t(blockIdx.x) * gridDim.y + uint64_t(blockIdx.y);
    cluster_size_ = uint64_t(params.cluster_shape_.m()) * params.cluster_shape_.n();
    const uint64_t clusters = uint64_t(gridDim.x) * gridDim.y * gridDim.z / cluster_size_;
    const uint64_t cluster = first / cluster_size_;
    position_in_cluster_ = first % cluster_size_;
    // One team (CUTLASS's order) needs no unit count: its walk ends past the last group.
    const uint64_t units =
        params.teams > 1 && clusters > 1 ? TotalTiles(params) / cluster_size_ : 0;
    const TeamShare share = TeamShareOf(cluster, clusters, uint64_t(params.teams), units);
    unit_ = share.first;
    stride_ = share.stride;
    end_ = share.end;
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return CurrentWork();
  }

  // As CUTLASS's, with this scheduler's next unit.
  template <typename TileSchedulerPipeline, typename TileSchedulerPipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(TileSchedulerPipeline& scheduler_pipeline,
                                           TileSchedulerPipelineState scheduler_pipe_producer_state,
                                           uint32_t advance_count = 1) {
    unit_ += stride_ * advance_count;
    WorkTileInfo work_tile = CurrentWork();
    scheduler_pipeline.producer_acquire(scheduler_pipe_producer_state);
    if (cute::elect_one_sync()) {
      this->response_ptr_[scheduler_pipe_producer_state.index()] = work_tile;
      cutlass::arch::fence_view_async_shared();
      scheduler_pipeline.producer_commit(scheduler_pipe_producer_state);
    }
    return cute::make_tuple(work_tile, true);
  }

 private:
  CUTLASS_DEVICE WorkTileInfo CurrentWork() {
    // Whole warps only (CUTLASS's group walk shuffles); a unit past the team's share is
    // another team's.
    if (unit_ >= end_) return WorkTileInfo::invalid_work_tile();
    return this->get_current_work_for_linear_idx(unit_ * cluster_size_ + position_in_cluster_);
  }

  // Tile slots of all groups, each group's counts rounded up as CUTLASS's walk rounds them
  // (to the cluster shape times the swizzle), summed by the warp.
  CUTLASS_DEVICE static uint64_t TotalTiles(Params const& params) {
    uint64_t total = 0;
#if defined(__CUDA_ARCH__)
    const int lane = threadIdx.x % 32;
    const uint64_t round_m = uint64_t(params.cluster_shape_.m()) << params.log_swizzle_size_;
    const uint64_t round_n = uint64_t(params.cluster_shape_.n()) << params.log_swizzle_size_;
    for (int group = lane; group < params.problem_shapes_.groups(); group += 32) {
      const auto shape = params.problem_shapes_.get_problem_shape(group);
      const uint64_t m = static_cast<uint64_t>(cute::get<0>(shape) > 0 ? cute::get<0>(shape) : 0);
      const uint64_t n = static_cast<uint64_t>(cute::get<1>(shape) > 0 ? cute::get<1>(shape) : 0);
      const uint64_t tiles_m = (m + params.cta_shape_.m() - 1) / params.cta_shape_.m();
      const uint64_t tiles_n = (n + params.cta_shape_.n() - 1) / params.cta_shape_.n();
      total += (tiles_m + round_m - 1) / round_m * round_m * ((tiles_n + round_n - 1) / round_n * round_n);
    }
    for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
#endif
    return total;
  }

  uint64_t unit_ = 0;
  uint64_t stride_ = 1;
  uint64_t end_ = 0;
  uint64_t cluster_size_ = 1;
  uint64_t position_in_cluster_ = 0;
};

}  // namespace jaxfuse::grouped_gemm::detail

namespace cutlass::gemm::kernel::detail {

// Kernels built on TeamGroupProblemShape get the team scheduler; every other grouped kernel
// keeps CUTLASS's (the general GroupScheduler specialization).
template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount,
          class UnderlyingShape>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount,
                             jaxfuse::grouped_gemm::detail::TeamGroupProblemShape<UnderlyingShape>> {
  using Scheduler = jaxfuse::grouped_gemm::detail::TeamGroupTileScheduler<
      jaxfuse::grouped_gemm::detail::TeamGroupProblemShape<UnderlyingShape>,
      static_cast<int>(SchedulerPipelineStageCount)>;
};

}  // namespace cutlass::gemm::kernel::detail
