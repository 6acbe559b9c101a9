// Per-group TMA descriptors prepared before the grouped kernel runs.
//
// CUTLASS's SM90 pointer-array kernels keep one TMA descriptor per operand and SM in global
// memory and rewrite it at every group change: the producer warp patches A's and B's in
// shared memory, copies them out with a release fence and acquires them again before the
// next load; each consumer warp group does the same for D, after draining its TMA stores.
// At 512 rows per group a CTA changes group every one to four tiles, and the sampled stalls
// of session 38 put the first k-block of a tile that starts a group at a third of the
// mainloop's waits (cuda/gpu/grouped_gemm/README.md, "Where the warps stall").
//
// Here a small kernel launched between the setup kernel and the GEMM writes every group's
// A, B and D descriptors once (CUTLASS's own code patches them, so they are the very
// descriptors CUTLASS would build), and the collectives below only point the TMA at group
// g's at a group change and prefetch them. The descriptors live in each collective's
// workspace, after the per-SM ones CUTLASS still allocates (and no longer writes).
//
// The bf16 cooperative kernels use them (gemm_common.cuh, TensormapVariants): 1-4% faster
// at 512 rows per group on an H100, the same at 8192. The ping-pong kernels ran 10-15%
// slower with them and keep CUTLASS's (README.md, "Per-group descriptors").
#pragma once

#include <cstdint>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace jaxfuse::grouped_gemm::detail {

// The descriptor one operand's TMA copies use. The kernel keeps it in a local variable and
// hands it to the collective by const reference at a group change, hence `mutable`; the
// collectives' copies take a `TmaDescriptor const*`, which the conversion gives them.
struct GroupTensormap {
  cute::TmaDescriptor const* group0;  // this operand's descriptor of group 0
  int32_t per_group;                  // descriptors from one group to the next
  mutable cute::TmaDescriptor const* current;

  CUTLASS_DEVICE void Point(int32_t group) const {
    current = group0 + static_cast<int64_t>(group) * per_group;
  }
  CUTLASS_DEVICE operator cute::TmaDescriptor const*() const { return current; }
};

// Makes a prepared descriptor visible to this thread's TMA (it was written through the
// generic proxy, by the preparing kernel) and starts fetching it.
CUTLASS_DEVICE void AcquireAndPrefetch(cute::TmaDescriptor const* descriptor) {
  cute::tma_descriptor_fence_acquire(descriptor);
  cute::prefetch_tma_descriptor(descriptor);
}

// The builder's SM90 pointer-array mainloop (16-bit or FP8) reading prepared descriptors.
template <class Base>
struct PreparedTensormapMainloop : Base {
  using Base::Base;
  using Stock = Base;
  static constexpr bool kPreparedTensormaps = true;
  using typename Base::Arguments;
  using typename Base::Params;
  using typename Base::TensorMapStorage;
  static constexpr int kOperands = 2;  // A, B

  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const& problem_shape, Arguments const& args,
                                   int sm_count) {
    return Base::get_workspace_size(problem_shape, args, sm_count) +
           static_cast<size_t>(problem_shape.groups()) * kOperands * sizeof(cute::TmaDescriptor);
  }

  // Group g's A descriptor is [kOperands * g], its B descriptor the one after it.
  CUTLASS_HOST_DEVICE static cute::TmaDescriptor* Prepared(Params const& params, int sm_count) {
    return reinterpret_cast<cute::TmaDescriptor*>(params.tensormaps) + kOperands * sm_count;
  }

  CUTLASS_DEVICE auto tensormaps_init(Params const& params, TensorMapStorage&, int32_t sm_count,
                                      int32_t /*sm_idx*/) {
    cute::TmaDescriptor const* prepared = Prepared(params, sm_count);
    return cute::make_tuple(GroupTensormap{prepared, kOperands, prepared},
                            GroupTensormap{prepared + 1, kOperands, prepared + 1});
  }

  // Called by the whole producer warp right after the previous tile's loads were issued,
  // so the fetch overlaps the wait for a free stage.
  template <class TensorMapA, class TensorMapB, class ProblemShape_MNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage&, Params const&,
                                                cute::tuple<TensorMapA, TensorMapB> const& maps,
                                                ProblemShape_MNKL shape, int32_t next_batch) {
    cute::get<0>(maps).Point(next_batch);
    cute::get<1>(maps).Point(next_batch);
    // A group with no tiles has no descriptors (the kernel's first call may name one).
    if (cute::get<0>(shape) > 0 && cute::get<1>(shape) > 0) {
      AcquireAndPrefetch(cute::get<0>(maps).current);
      AcquireAndPrefetch(cute::get<1>(maps).current);
    }
  }

  template <class TensorMapA, class TensorMapB>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage&,
                                                  cute::tuple<TensorMapA, TensorMapB> const&) {}

  // Acquired in tensormaps_perform_update, before the prefetch.
  template <class TensorMapA, class TensorMapB>
  CUTLASS_DEVICE void tensormaps_fence_acquire(cute::tuple<TensorMapA, TensorMapB> const&) {}
};

// The builder's SM90 pointer-array TMA epilogue (no source C) storing through prepared
// descriptors: no store drain and no descriptor rewrite at a group change.
template <class Base>
struct PreparedTensormapEpilogue : Base {
  using Base::Base;
  using typename Base::Arguments;
  using typename Base::Params;
  using typename Base::TensorMapStorage;
  static_assert(cute::is_void_v<typename Base::ElementC>, "prepared D descriptors only");
  // CUTLASS's per-SM descriptors: one D per epilogue warp group.
  static constexpr int kPerSmDescriptors = Base::NumEpilogueWarpGroups;

  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const& problem_shape, Arguments const& args,
                                   int sm_count) {
    return Base::get_workspace_size(problem_shape, args, sm_count) +
           static_cast<size_t>(problem_shape.groups()) * sizeof(cute::TmaDescriptor);
  }

  // Group g's D descriptor is [g]. (Base::get_workspace_size puts the per-SM descriptors
  // first; the fusion's workspace after them is empty for LinearCombination.)
  CUTLASS_HOST_DEVICE static cute::TmaDescriptor* Prepared(Params const& params, int sm_count) {
    return params.tensormaps + kPerSmDescriptors * sm_count;
  }

  CUTLASS_DEVICE auto store_init(Params const& params, TensorMapStorage&, int32_t sm_count,
                                 int32_t /*sm_idx*/, int32_t /*warp_group_idx*/) {
    cute::TmaDescriptor const* prepared = Prepared(params, sm_count);
    return cute::make_tuple(GroupTensormap{prepared, 1, prepared});
  }

  // The kernel calls these for C's load too (IsLoad), which has no descriptor here.
  template <bool IsLoad, class TensorMap, class ProblemShape_MNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage&, Params const&,
                                                TensorMap const& map, ProblemShape_MNKL shape,
                                                int32_t next_batch, int32_t /*warp_group_idx*/) {
    if constexpr (!IsLoad) {
      map.Point(next_batch);
      if (cute::get<0>(shape) > 0 && cute::get<1>(shape) > 0) AcquireAndPrefetch(map.current);
    }
  }

  template <bool IsLoad, class TensorMap>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage&, TensorMap const&,
                                                  int32_t /*warp_group_idx*/ = 0) {}

  template <bool IsLoad, class TensorMap>
  CUTLASS_DEVICE void tensormaps_fence_acquire(TensorMap const&) {}
};

// Writes every group's A, B and D descriptors for Kernel (whose collectives are the two
// above): one warp per group, patching the host-built templates in shared memory with the
// group's address, extents and strides (CUTLASS's own mainloop code for A and B; the same
// steps as its epilogue for D) and copying them out with a release fence. Groups with no
// tiles (M or N zero) are skipped: the kernel never points at them.
template <class Kernel, int kWarps = 4>
__global__ void __launch_bounds__(32 * kWarps)
    PrepareTensormapsKernel(CUTLASS_GRID_CONSTANT typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Mainloop = typename Kernel::CollectiveMainloop;
  using MainloopBase = typename Mainloop::Stock;
  using Epilogue = typename Kernel::CollectiveEpilogue;
  using ElementD = typename Epilogue::ElementD;
  __shared__ typename MainloopBase::TensorMapStorage mainloop_maps[kWarps];
  __shared__ alignas(128) cute::TmaDescriptor d_maps[kWarps];

  // The shapes, pointers and strides come from the setup kernel launched before this one
  // (as a programmatic dependent where the GEMM is one); the GEMM waits for this grid.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
  const int warp = threadIdx.x / 32;
  const int group = blockIdx.x * kWarps + warp;
  if (group >= params.problem_shape.groups()) return;
  auto shape = cute::append<4>(params.problem_shape.get_problem_shape(group), 1);
  const int32_t m = cute::get<0>(shape), n = cute::get<1>(shape);
  if (m == 0 || n == 0) return;
  const int sm_count = params.hw_info.sm_count;

  MainloopBase mainloop;
  auto per_sm = mainloop.tensormaps_init(params.mainloop, mainloop_maps[warp], sm_count, 0);
  mainloop.tensormaps_perform_update(mainloop_maps[warp], params.mainloop, per_sm, shape, group);
  __syncwarp();
  cute::TmaDescriptor* prepared_ab = Mainloop::Prepared(params.mainloop, sm_count);
  mainloop.tensormaps_cp_fence_release(
      mainloop_maps[warp], cute::make_tuple(prepared_ab + Mainloop::kOperands * group,
                                            prepared_ab + Mainloop::kOperands * group + 1));

  if (cute::elect_one_sync()) {
    auto const* source = reinterpret_cast<uint4 const*>(params.epilogue.tma_store_d.get_tma_descriptor());
    auto* target = reinterpret_cast<uint4*>(&d_maps[warp]);
    for (int i = 0; i < static_cast<int>(sizeof(cute::TmaDescriptor) / sizeof(uint4)); ++i) {
      target[i] = source[i];
    }
    cute::tma_descriptor_replace_addr_in_shared_mem(d_maps[warp], params.epilogue.ptr_D[group]);
    cute::array<uint32_t, 5> extents = {1, 1, 1, 1, 1};
    cute::array<uint64_t, 5> strides = {0, 0, 0, 0, 0};
    auto tensor_d = cute::make_tensor(static_cast<ElementD const*>(nullptr),
                                      cute::make_layout(cute::make_shape(m, n, cute::Int<1>{}),
                                                        params.epilogue.dD[group]));
    cute::detail::fill_tma_gmem_shape_stride(params.epilogue.tma_store_d, tensor_d, extents, strides);
    for (uint64_t& stride : strides) stride = stride * cute::sizeof_bits_v<ElementD> / 8;
    cute::tma_descriptor_replace_dims_strides_in_shared_mem(d_maps[warp], extents, strides);
  }
  __syncwarp();
  cute::tma_descriptor_cp_fence_release(Epilogue::Prepared(params.epilogue, sm_count) + group,
                                        d_maps[warp]);
#endif
}

}  // namespace jaxfuse::grouped_gemm::detail
