// CUTLASS 3.x SM90 pointer-array grouped GEMM: shared type-building macro and host glue.
// Included only by the per-family kernel files (gemm_*.cu); each of them instantiates a few
// kernels (compiles cost ~80 s and ~4 GB for the first kernel of a file).
#pragma once

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <utility>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "fp8_blockwise_pipelined_promotion.cuh"
#include "fp8_pipelined_promotion.cuh"
#include "internal.cuh"
#include "prepared_tensormaps.cuh"
#include "team_tile_scheduler.cuh"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "jaxfuse grouped GEMM needs CUDA >= 12.3 and -gencode=arch=compute_90a,code=sm_90a"
#endif

namespace jaxfuse::grouped_gemm::detail {

using GroupShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // <M,N,K>
// The same shape for kernels whose tiles the team scheduler hands out (team_tile_scheduler.cuh).
using TeamGroupShape = TeamGroupProblemShape<cute::Shape<int, int, int>>;

// A CUTLASS kernel whose every CTA first waits for the grid launched before it on the
// stream (griddepcontrol.wait: that grid complete, its writes visible). CUTLASS's SM90
// pointer-array kernels have no such wait of their own, and they read the setup kernel's
// arrays from their first instruction on; with it they may be launched as programmatic
// dependents of the setup kernel (JAXFUSE_GROUPED_GEMM_PDL), so their launch overlaps it.
// Without the launch attribute the wait returns at once.
template <class Base>
struct WaitForPriorGrid : Base {
  CUTLASS_DEVICE void operator()(typename Base::Params const& params, char* smem_buf) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    Base::operator()(params, smem_buf);
  }
};

// Defines, at namespace scope (gcc's host pass failed when the collective builders were nested
// in a class template), the type NAME = GemmUniversalAdapter<...> for one grouped kernel:
//   EA/EB: operand element types, LA/LB: CUTLASS layout tags (RowMajor/ColumnMajor; see the
//   family files for what they mean), ED: output element type (C is void: no source read),
//   TM/TN/TK: CTA tile, CM/CN: cluster, KS/ES: mainloop / epilogue schedules.
#define JAXFUSE_GG_DEFINE_GEMM(NAME, EA, LA, EB, LB, ED, TM, TN, TK, CM, CN, KS, ES)          \
  JAXFUSE_GG_DEFINE_GEMM_WITH_MAINLOOP(NAME, StockMainloop, EA, LA, EB, LB, ED, TM, TN, TK, CM,  \
                                       CN, KS, ES)

// The builder's mainloop as it is; the alternative is PipelinedPromotionMainloop
// (fp8_pipelined_promotion.cuh), which replaces the promoted FP8 mainloop's mma().
template <class BuilderMainloop>
using StockMainloop = BuilderMainloop;

// JAXFUSE_GG_DEFINE_GEMM with the builder's collective mainloop wrapped in WRAP<...>.
#define JAXFUSE_GG_DEFINE_GEMM_WITH_MAINLOOP(NAME, WRAP, EA, LA, EB, LB, ED, TM, TN, TK, CM, CN, \
                                             KS, ES)                                       \
  JAXFUSE_GG_DEFINE_GEMM_WRAPPED(NAME, WRAP, StockEpilogue, EA, LA, EB, LB, ED, TM, TN, TK,   \
                                 CM, CN, KS, ES)

template <class BuilderEpilogue>
using StockEpilogue = BuilderEpilogue;

// JAXFUSE_GG_DEFINE_GEMM twice, as TensormapVariants (below): NAME##Cutlass with CUTLASS's
// collectives, NAME##Prepared reading per-group descriptors (prepared_tensormaps.cuh).
#define JAXFUSE_GG_DEFINE_GEMM_TENSORMAP_VARIANTS(NAME, EA, LA, EB, LB, ED, TM, TN, TK, CM, CN,  \
                                                  KS, ES)                                      \
  JAXFUSE_GG_DEFINE_GEMM_WRAPPED(NAME##Cutlass, StockMainloop, StockEpilogue, EA, LA, EB, LB,  \
                                 ED, TM, TN, TK, CM, CN, KS, ES)                               \
  JAXFUSE_GG_DEFINE_GEMM_WRAPPED(NAME##Prepared, PreparedTensormapMainloop,                    \
                                 PreparedTensormapEpilogue, EA, LA, EB, LB, ED, TM, TN, TK, CM, \
                                 CN, KS, ES)                                                   \
  using NAME = TensormapVariants<NAME##Cutlass, NAME##Prepared>;

// JAXFUSE_GG_DEFINE_GEMM with its tiles handed out by the team scheduler
// (team_tile_scheduler.cuh; TuningOptions::teams, 1 = CUTLASS's order).
#define JAXFUSE_GG_DEFINE_GEMM_TEAMS(NAME, EA, LA, EB, LB, ED, TM, TN, TK, CM, CN, KS, ES)    \
  JAXFUSE_GG_DEFINE_GEMM_SHAPED(NAME, TeamGroupShape, StockMainloop, StockEpilogue, EA, LA, EB, \
                                LB, ED, TM, TN, TK, CM, CN, KS, ES)                        \
  static_assert(std::is_base_of_v<TeamGroupTileScheduler<TeamGroupShape, 8>,                 \
                                  typename NAME::GemmKernel::TileScheduler>,                 \
                "the team scheduler specialization was not picked");

// The builder's collectives wrapped in MAINLOOP<...> and EPILOGUE<...>.
#define JAXFUSE_GG_DEFINE_GEMM_WRAPPED(NAME, WRAP, EPILOGUE, EA, LA, EB, LB, ED, TM, TN, TK, CM, \
                                       CN, KS, ES)                                         \
  JAXFUSE_GG_DEFINE_GEMM_SHAPED(NAME, GroupShape, WRAP, EPILOGUE, EA, LA, EB, LB, ED, TM, TN, \
                                TK, CM, CN, KS, ES)

// The same with the kernel's grouped problem shape type SHAPE (GroupShape or TeamGroupShape).
#define JAXFUSE_GG_DEFINE_GEMM_SHAPED(NAME, SHAPE, WRAP, EPILOGUE, EA, LA, EB, LB, ED, TM, TN, \
                                      TK, CM, CN, KS, ES)                                  \
  namespace NAME##_types {                                                                 \
  using TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::Int<TK>>;              \
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;                \
  static constexpr int kAlignA = 128 / cutlass::sizeof_bits<EA>::value;                    \
  static constexpr int kAlignB = 128 / cutlass::sizeof_bits<EB>::value;                    \
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ED>::value;                    \
  using CollectiveEpilogue = EPILOGUE<typename cutlass::epilogue::collective::CollectiveBuilder< \
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,        \
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,                 \
      cutlass::layout::RowMajor*, kAlignD, ED, cutlass::layout::RowMajor*, kAlignD, ES,    \
      cutlass::epilogue::fusion::LinearCombination<ED, float, void, float>>::CollectiveOp>; \
  using CollectiveMainloop = WRAP<typename cutlass::gemm::collective::CollectiveBuilder<   \
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, EA, LA*, kAlignA, EB, LB*,      \
      kAlignB, float, TileShape, ClusterShape,                                             \
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(                  \
          sizeof(typename CollectiveEpilogue::SharedStorage))>,                            \
      KS>::CollectiveOp>;                                                                  \
  using Kernel = WaitForPriorGrid<cutlass::gemm::kernel::GemmUniversal<                      \
      SHAPE, CollectiveMainloop, CollectiveEpilogue>>;                                     \
  }                                                                                        \
  using NAME = cutlass::gemm::device::GemmUniversalAdapter<NAME##_types::Kernel>;

// Maximum number of co-resident clusters of this kernel on the current device (0 = unknown,
// CUTLASS then sizes the persistent grid from the SM count). A device property, cached per
// device; never depends on device data.
template <class Gemm>
int MaxActiveClusters() {
  using Kernel = typename Gemm::GemmKernel;
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // 0 = not computed, -1 = query failed
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    cudaGetLastError();
    return 0;
  }
  int cached = cache[device].load(std::memory_order_relaxed);
  if (cached != 0) return cached > 0 ? cached : 0;

  const int cm = cute::size<0>(typename Kernel::ClusterShape{});
  const int cn = cute::size<1>(typename Kernel::ClusterShape{});
  const int smem = static_cast<int>(Kernel::SharedStorageSize);
  const void* fn = reinterpret_cast<const void*>(cutlass::device_kernel<Kernel>);
  int result = -1;
  if (cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess) {
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = cm;
    attribute[0].val.clusterDim.y = cn;
    attribute[0].val.clusterDim.z = 1;
    config.gridDim = dim3(cm, cn, 1);
    config.blockDim = dim3(Kernel::MaxThreadsPerBlock, 1, 1);
    config.dynamicSmemBytes = smem;
    config.attrs = attribute;
    config.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, fn, &config) == cudaSuccess && clusters > 0) {
      result = clusters;
    }
  }
  cudaGetLastError();  // a failed query must not leak a sticky-looking error into run()
  cache[device].store(result, std::memory_order_relaxed);
  return result > 0 ? result : 0;
}

// Whether a collective mainloop takes blockwise scale factors (CUTLASS's FP8 blockwise
// mainloops: ptr_SFA / ptr_SFB pointer arrays, one per group).
template <class Mainloop, class = void>
struct TakesBlockScales : std::false_type {};
template <class Mainloop>
struct TakesBlockScales<Mainloop,
                        std::void_t<decltype(std::declval<typename Mainloop::Arguments&>().ptr_SFA)>>
    : std::true_type {};

// Whether scheduler arguments take a team count (team_tile_scheduler.cuh).
template <class SchedulerArguments, class = void>
struct HasTeams : std::false_type {};
template <class SchedulerArguments>
struct HasTeams<SchedulerArguments,
                std::void_t<decltype(std::declval<SchedulerArguments&>().teams)>>
    : std::true_type {};

// Whether an epilogue fills its own arguments from the setup arrays (a static
// FillArguments(Arguments&, const GemmArrays&): gated_epilogue.cuh) instead of taking
// CUTLASS's LinearCombination ones below.
template <class Epilogue, class = void>
struct FillsOwnArguments : std::false_type {};
template <class Epilogue>
struct FillsOwnArguments<Epilogue, std::void_t<decltype(Epilogue::FillArguments(
                                       std::declval<typename Epilogue::Arguments&>(),
                                       std::declval<const GemmArrays&>()))>> : std::true_type {};

template <class Gemm>
typename Gemm::Arguments MakeArguments(const GemmArrays& arrays, int sm_count,
                                       int max_active_clusters) {
  using Kernel = typename Gemm::GemmKernel;
  using ElementA = typename Gemm::ElementA;
  using ElementB = typename Gemm::ElementB;
  using ElementD = typename Kernel::CollectiveEpilogue::ElementD;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using UnderlyingShape = typename GroupShape::UnderlyingProblemShape;
  // The setup kernel writes these as plain int32 triples / int64 leading dimensions.
  static_assert(sizeof(UnderlyingShape) == 3 * sizeof(int32_t), "problem shape layout");
  static_assert(sizeof(StrideA) == sizeof(int64_t), "stride A layout");
  static_assert(sizeof(StrideB) == sizeof(int64_t), "stride B layout");
  static_assert(sizeof(StrideD) == sizeof(int64_t), "stride D layout");
  static_assert(cute::is_void_v<typename Kernel::CollectiveEpilogue::ElementC>,
                "epilogue must not read a source");

  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  // No host problem shapes: the kernel reads shapes on the device (graph safe).
  static_cast<GroupShape&>(args.problem_shape) =
      GroupShape{arrays.num_groups, reinterpret_cast<UnderlyingShape*>(arrays.problem_shapes),
                 nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const ElementA**>(arrays.ptr_a);
  args.mainloop.dA = reinterpret_cast<StrideA*>(arrays.stride_a);
  args.mainloop.ptr_B = reinterpret_cast<const ElementB**>(arrays.ptr_b);
  args.mainloop.dB = reinterpret_cast<StrideB*>(arrays.stride_b);
  if constexpr (TakesBlockScales<typename Kernel::CollectiveMainloop>::value) {
    // The mainloop rebuilds each group's scale layout from its problem shape
    // (BlockScaleConfig's K-major strides), so the layout arrays are never read.
    args.mainloop.ptr_SFA = arrays.ptr_sfa;
    args.mainloop.layout_SFA = nullptr;
    args.mainloop.ptr_SFB = arrays.ptr_sfb;
    args.mainloop.layout_SFB = nullptr;
  }

  using CollectiveEpilogue = typename Kernel::CollectiveEpilogue;
  if constexpr (FillsOwnArguments<CollectiveEpilogue>::value) {
    CollectiveEpilogue::FillArguments(args.epilogue, arrays);
  } else {
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.0f;
    fusion.beta = 0.0f;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.beta_ptr_array = nullptr;
    fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
    if (arrays.alpha_ptrs != nullptr) {
      fusion.alpha_ptr_array = arrays.alpha_ptrs;  // one pointer per group
      fusion.dAlpha = {cute::_0{}, cute::_0{}, 1};
    } else {
      fusion.alpha_ptr_array = nullptr;
      fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
    }
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = static_cast<StrideC*>(nullptr);
    args.epilogue.ptr_D = reinterpret_cast<ElementD**>(arrays.ptr_d);
    args.epilogue.dD = reinterpret_cast<StrideD*>(arrays.stride_d);
  }

  using Raster = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = arrays.raster == 'N' ? Raster::AlongN : Raster::AlongM;
  args.scheduler.max_swizzle_size = ActiveTuningOptions().swizzle;
  if constexpr (HasTeams<decltype(args.scheduler)>::value) {
    args.scheduler.teams = arrays.teams;
  }

  args.hw_info.device_id = 0;  // unused when sm_count > 0
  args.hw_info.sm_count = sm_count;
  args.hw_info.max_active_clusters = max_active_clusters;
  return args;
}

// Host-only: CUTLASS's workspace (tensormaps per SM + scheduler; with prepared tensormaps
// also one descriptor per group and operand) for this kernel.
template <class Gemm>
size_t OneGemmWorkspaceBytes(int num_groups, int sm_count) {
  GemmArrays dummy;
  dummy.num_groups = num_groups;
  auto args = MakeArguments<Gemm>(dummy, sm_count, /*max_active_clusters=*/0);
  return Gemm::get_workspace_size(args);
}

// Whether Kernel's collectives read per-group descriptors (prepared_tensormaps.cuh).
template <class Kernel, class = void>
struct ReadsPreparedTensormaps : std::false_type {};
template <class Kernel>
struct ReadsPreparedTensormaps<
    Kernel, std::void_t<decltype(Kernel::CollectiveMainloop::kPreparedTensormaps)>>
    : std::true_type {};

// Launches PrepareTensormapsKernel for the initialized `gemm` (its parameters hold the
// descriptor templates and the setup arrays' addresses): one warp per group, as a
// programmatic dependent of the setup kernel where the GEMM is one.
template <class Gemm>
cudaError_t LaunchPrepareTensormaps(const Gemm& gemm, int num_groups, bool pdl,
                                    cudaStream_t stream) {
  using Kernel = typename Gemm::GemmKernel;
  constexpr int kWarps = 4;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((num_groups + kWarps - 1) / kWarps, 1, 1);
  config.blockDim = dim3(32 * kWarps, 1, 1);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, PrepareTensormapsKernel<Kernel, kWarps>, gemm.params());
}

template <class Gemm>
cudaError_t RunOneGemm(const GemmArrays& arrays, int sm_count, cudaStream_t stream) {
  if (sm_count <= 0 || arrays.num_groups <= 0) return cudaErrorInvalidValue;
  auto args = MakeArguments<Gemm>(arrays, sm_count, MaxActiveClusters<Gemm>());
  if (Gemm::get_workspace_size(args) > arrays.cutlass_workspace_bytes) {
    return cudaErrorInvalidValue;
  }
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  // initialize(): builds the TMA descriptor templates on the host (driver entry point, no
  // sync) and launches nothing for this scheduler; run(): one kernel launch on `stream`.
  if (gemm.initialize(args, arrays.cutlass_workspace, stream) != cutlass::Status::kSuccess) {
    cudaError_t error = cudaGetLastError();
    return error != cudaSuccess ? error : cudaErrorUnknown;
  }
  if constexpr (ReadsPreparedTensormaps<typename Gemm::GemmKernel>::value) {
    cudaError_t error = LaunchPrepareTensormaps(gemm, arrays.num_groups, arrays.pdl, stream);
    if (error != cudaSuccess) return error;
  }
  if (gemm.run(stream, /*cuda_adapter=*/nullptr, arrays.pdl) !=
      cutlass::Status::kSuccess) {
    cudaError_t error = cudaGetLastError();
    return error != cudaSuccess ? error : cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}

// One kernel built twice: with CUTLASS's per-SM descriptors, rewritten at every group
// change, and with per-group descriptors prepared before it runs (prepared_tensormaps.cuh;
// the default). ActiveTuningOptions().prepared_tensormaps (JAXFUSE_GROUPED_GEMM_TENSORMAPS)
// picks one; the workspace has room for either.
template <class CutlassGemm, class PreparedGemm>
struct TensormapVariants {
  using GemmKernel = typename CutlassGemm::GemmKernel;  // tile and cluster shapes
};

template <class Gemm>
struct GemmRunner {
  static size_t Workspace(int num_groups, int sm_count) {
    return OneGemmWorkspaceBytes<Gemm>(num_groups, sm_count);
  }
  static cudaError_t Run(const GemmArrays& arrays, int sm_count, cudaStream_t stream) {
    return RunOneGemm<Gemm>(arrays, sm_count, stream);
  }
};
template <class CutlassGemm, class PreparedGemm>
struct GemmRunner<TensormapVariants<CutlassGemm, PreparedGemm>> {
  static size_t Workspace(int num_groups, int sm_count) {
    return std::max(OneGemmWorkspaceBytes<CutlassGemm>(num_groups, sm_count),
                    OneGemmWorkspaceBytes<PreparedGemm>(num_groups, sm_count));
  }
  static cudaError_t Run(const GemmArrays& arrays, int sm_count, cudaStream_t stream) {
    return ActiveTuningOptions().prepared_tensormaps
               ? RunOneGemm<PreparedGemm>(arrays, sm_count, stream)
               : RunOneGemm<CutlassGemm>(arrays, sm_count, stream);
  }
};

// The workspace Gemm (one kernel or TensormapVariants) needs, and running it.
template <class Gemm>
size_t CutlassWorkspaceBytes(int num_groups, int sm_count) {
  return GemmRunner<Gemm>::Workspace(num_groups, sm_count);
}
template <class Gemm>
cudaError_t RunGemm(const GemmArrays& arrays, int sm_count, cudaStream_t stream) {
  return GemmRunner<Gemm>::Run(arrays, sm_count, stream);
}

}  // namespace jaxfuse::grouped_gemm::detail

// Defines NAME_WorkspaceBytes / NAME_Run for a family with a large and a small config.
#define JAXFUSE_GG_DEFINE_FAMILY_2(NAME, LARGE, SMALL)                                       \
  size_t NAME##_WorkspaceBytes(TileConfig config, int num_groups, int sm_count) {          \
    return config == TileConfig::kSmall ? CutlassWorkspaceBytes<SMALL>(num_groups, sm_count) \
                                        : CutlassWorkspaceBytes<LARGE>(num_groups, sm_count); \
  }                                                                                        \
  cudaError_t NAME##_Run(TileConfig config, const GemmArrays& arrays, int sm_count,        \
                         cudaStream_t stream) {                                            \
    return config == TileConfig::kSmall ? RunGemm<SMALL>(arrays, sm_count, stream)         \
                                        : RunGemm<LARGE>(arrays, sm_count, stream);        \
  }

// Same for a family with a single config.
#define JAXFUSE_GG_DEFINE_FAMILY_1(NAME, ONLY)                                               \
  size_t NAME##_WorkspaceBytes(TileConfig, int num_groups, int sm_count) {                 \
    return CutlassWorkspaceBytes<ONLY>(num_groups, sm_count);                              \
  }                                                                                        \
  cudaError_t NAME##_Run(TileConfig, const GemmArrays& arrays, int sm_count,               \
                         cudaStream_t stream) {                                            \
    return RunGemm<ONLY>(arrays, sm_count, stream);                                        \
  }

// A kUniform family: a single-config family plus NAME_RowGranularity = CTA tile M x
// cluster M, the row multiple that wastes no cluster slot.
#define JAXFUSE_GG_DEFINE_UNIFORM_FAMILY(NAME, ONLY)                                         \
  JAXFUSE_GG_DEFINE_FAMILY_1(NAME, ONLY)                                                   \
  int NAME##_RowGranularity() {                                                            \
    using Kernel = typename ONLY::GemmKernel;                                              \
    return static_cast<int>(cute::size<0>(typename Kernel::TileShape{}) *                  \
                            cute::size<0>(typename Kernel::ClusterShape{}));               \
  }

namespace jaxfuse::grouped_gemm::detail {

// A promoted FP8 family: each config (large, small) has the PipelinedPromotionMainloop
// kernel (the default) and the stock CUTLASS one, chosen at run time by
// ActiveTuningOptions().fp8_mainloop (JAXFUSE_GROUPED_GEMM_FP8_MAINLOOP=stock|pipelined),
// so that one build can A/B them. Same tiles and numerics; only the overlap differs. The
// blockwise families use it too.
template <class Large, class LargeStock, class Small, class SmallStock>
struct Fp8PromotedFamily {
  static bool Stock() { return ActiveTuningOptions().fp8_mainloop == 's'; }
  static size_t Workspace(TileConfig config, int num_groups, int sm_count) {
    if (config == TileConfig::kSmall) {
      return std::max(CutlassWorkspaceBytes<Small>(num_groups, sm_count),
                      CutlassWorkspaceBytes<SmallStock>(num_groups, sm_count));
    }
    return std::max(CutlassWorkspaceBytes<Large>(num_groups, sm_count),
                    CutlassWorkspaceBytes<LargeStock>(num_groups, sm_count));
  }
  static cudaError_t Run(TileConfig config, const GemmArrays& arrays, int sm_count,
                         cudaStream_t stream) {
    if (config == TileConfig::kSmall) {
      return Stock() ? RunGemm<SmallStock>(arrays, sm_count, stream)
                     : RunGemm<Small>(arrays, sm_count, stream);
    }
    return Stock() ? RunGemm<LargeStock>(arrays, sm_count, stream)
                   : RunGemm<Large>(arrays, sm_count, stream);
  }
};

}  // namespace jaxfuse::grouped_gemm::detail

// NAME_WorkspaceBytes / NAME_Run of a family whose configs each have a pipelined and a stock
// kernel (Fp8PromotedFamily; a single-config family passes its kernels as both configs).
#define JAXFUSE_GG_DEFINE_FP8_MAINLOOP_ENTRY_POINTS(NAME, LARGE, LARGE_STOCK, SMALL, SMALL_STOCK) \
  size_t NAME##_WorkspaceBytes(TileConfig config, int num_groups, int sm_count) {              \
    return Fp8PromotedFamily<LARGE, LARGE_STOCK, SMALL, SMALL_STOCK>::Workspace(               \
        config, num_groups, sm_count);                                                         \
  }                                                                                            \
  cudaError_t NAME##_Run(TileConfig config, const GemmArrays& arrays, int sm_count,            \
                         cudaStream_t stream) {                                                \
    return Fp8PromotedFamily<LARGE, LARGE_STOCK, SMALL, SMALL_STOCK>::Run(config, arrays,      \
                                                                          sm_count, stream);   \
  }

// One promoted FP8 config (EA x EB -> bf16, both operands K-major; CTA tile TM x TN x 128)
// twice: NAME with the pipelined promotion, NAME##Stock with CUTLASS's mainloop.
#define JAXFUSE_GG_DEFINE_FP8_PROMOTED_GEMMS(NAME, EA, EB, TM, TN, CM, CN, KS, ES)              \
  JAXFUSE_GG_DEFINE_GEMM_WITH_MAINLOOP(NAME, PipelinedPromotionMainloop, EA,                   \
                                       cutlass::layout::RowMajor, EB,                          \
                                       cutlass::layout::ColumnMajor, cutlass::bfloat16_t, TM,  \
                                       TN, 128, CM, CN, KS, ES)                                \
  JAXFUSE_GG_DEFINE_GEMM_WITH_MAINLOOP(NAME##Stock, StockMainloop, EA,                         \
                                       cutlass::layout::RowMajor, EB,                          \
                                       cutlass::layout::ColumnMajor, cutlass::bfloat16_t, TM,  \
                                       TN, 128, CM, CN, KS, ES)

// Defines a promoted FP8 family (EA x EB -> bf16; A RowMajor, B ColumnMajor: both K-major):
// the kernels NAME{Large,LargeStock,Small,SmallStock} and NAME_WorkspaceBytes / NAME_Run.
//   large: cooperative 128x128x128, cluster 1x2 (each consumer warp group owns 64x128
//          outputs: three 64-register fp32 sets per thread with the pipelined mainloop);
//   small: ping-pong 64x128x128, cluster 1x1 (a warp group owns a 64x128 tile).
// 128x256 cooperative and 128x128 ping-pong spill even with the stock mainloop's two sets.
#define JAXFUSE_GG_DEFINE_FP8_PROMOTED_FAMILY(NAME, EA, EB)                                     \
  JAXFUSE_GG_DEFINE_FP8_PROMOTED_GEMMS(NAME##Large, EA, EB, 128, 128, 1, 2,                    \
                                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative, \
                                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative) \
  JAXFUSE_GG_DEFINE_FP8_PROMOTED_GEMMS(NAME##Small, EA, EB, 64, 128, 1, 1,                     \
                                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong, \
                                       cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)   \
  JAXFUSE_GG_DEFINE_FP8_MAINLOOP_ENTRY_POINTS(NAME, NAME##Large, NAME##LargeStock, NAME##Small, \
                                              NAME##SmallStock)

namespace jaxfuse::grouped_gemm::detail {

// DeepSeek-V3's blockwise FP8 scaling as the blockwise mainloops read it: one scale per row
// and 128-wide block of the contraction for A (1 x 128), one per 128 x 128 tile for B, both
// K-major: A's scales row-major [rows, ceil(kc / 128)], B's [G][ceil(nc / 128)]
// [ceil(kc / 128)], the layouts jaxfuse.quantize writes (block_1d, block_2d).
inline constexpr int kBlockScaleSize = static_cast<int>(kBlockScale);
using BlockScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, kBlockScaleSize, kBlockScaleSize,
                                              cute::GMMA::Major::K, cute::GMMA::Major::K>;
using BlockLayoutSFA = decltype(BlockScaleConfig::deduce_layoutSFA());
using BlockLayoutSFB = decltype(BlockScaleConfig::deduce_layoutSFB());

// The blockwise FP8 wgrad's scales (Float8BlockScaling's 128 x 1 blocks of x and dy): its
// contraction is a group's rows, so A = x^T and B = dy^T carry one scale per output row /
// column and 128-row block of the group, M- and N-major: group g's scales are one
// [ceil(rows_g / 128), k] (A) and [ceil(rows_g / 128), n] (B) matrix, the layout of
// jaxfuse/columnwise.h's ColumnwiseScaleRow. (Both majors must match: CUTLASS 4.2's
// smem_atom_layoutSFB tests majorSFA.)
using WgradBlockScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, kBlockScaleSize, cute::GMMA::Major::MN,
                                              cute::GMMA::Major::MN>;
using WgradBlockLayoutSFA = decltype(WgradBlockScaleConfig::deduce_layoutSFA());
using WgradBlockLayoutSFB = decltype(WgradBlockScaleConfig::deduce_layoutSFB());

}  // namespace jaxfuse::grouped_gemm::detail

// One blockwise-scaled FP8 kernel NAME (EA x EB -> bf16; A RowMajor, B ColumnMajor: both
// K-major; CTA tile TM x TN x 128, so each k-tile is one scale block; SFA / SFB the scale
// layouts). The mainloop multiplies each k-tile's partial sums by its scales while promoting
// them to fp32; the epilogue has no per-group alpha. WRAP: StockMainloop (CUTLASS's
// blockwise mainloop) or PipelinedBlockwiseMainloop (fp8_blockwise_pipelined_promotion.cuh).
#define JAXFUSE_GG_DEFINE_FP8_BLOCKWISE_GEMM(NAME, WRAP, EA, EB, SFA, SFB, TM, TN, CM, CN, KS,  \
                                             ES)                                              \
  namespace NAME##_types {                                                                    \
  using TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::Int<kBlockScaleSize>>;    \
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;                   \
  static constexpr int kAlignA = 128 / cutlass::sizeof_bits<EA>::value;                       \
  static constexpr int kAlignB = 16;                                                          \
  static constexpr int kAlignD = 8;                                                           \
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<        \
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,           \
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,                    \
      cutlass::layout::RowMajor*, kAlignD, cutlass::bfloat16_t, cutlass::layout::RowMajor*,   \
      kAlignD, ES,                                                                            \
      cutlass::epilogue::fusion::LinearCombination<cutlass::bfloat16_t, float, void,          \
                                                   float>>::CollectiveOp;                     \
  using CollectiveMainloop = WRAP<typename cutlass::gemm::collective::CollectiveBuilder<      \
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, EA,                                \
      cute::tuple<cutlass::layout::RowMajor*, SFA*>, kAlignA,                                 \
      EB, cute::tuple<cutlass::layout::ColumnMajor*, SFB*>,                                   \
      kAlignB, float, TileShape, ClusterShape,                                                \
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(                     \
          sizeof(typename CollectiveEpilogue::SharedStorage))>,                               \
      KS>::CollectiveOp>;                                                                     \
  using Kernel = WaitForPriorGrid<cutlass::gemm::kernel::GemmUniversal<                         \
      GroupShape, CollectiveMainloop, CollectiveEpilogue>>;                                   \
  }                                                                                           \
  using NAME = cutlass::gemm::device::GemmUniversalAdapter<NAME##_types::Kernel>;

// One blockwise FP8 config twice: NAME with the pipelined mainloop, NAME##Stock with
// CUTLASS's (JAXFUSE_GROUPED_GEMM_FP8_MAINLOOP=stock), for A/B in one build.
#define JAXFUSE_GG_DEFINE_FP8_BLOCKWISE_GEMMS(NAME, EA, EB, SFA, SFB, TM, TN, CM, CN, KS, ES)   \
  JAXFUSE_GG_DEFINE_FP8_BLOCKWISE_GEMM(NAME, PipelinedBlockwiseMainloop, EA, EB, SFA, SFB, TM, \
                                       TN, CM, CN, KS, ES)                                     \
  JAXFUSE_GG_DEFINE_FP8_BLOCKWISE_GEMM(NAME##Stock, StockMainloop, EA, EB, SFA, SFB, TM, TN,   \
                                       CM, CN, KS, ES)

// A blockwise FP8 family (EA x e4m3 -> bf16), the promoted families' tiles, each config with
// both mainloops (NAME{Large,LargeStock,Small,SmallStock}):
//   large: cooperative 128x128x128, cluster 1x2; small: ping-pong 64x128x128, cluster 1x1.
#define JAXFUSE_GG_DEFINE_FP8_BLOCKWISE_FAMILY(NAME, EA)                                        \
  JAXFUSE_GG_DEFINE_FP8_BLOCKWISE_GEMMS(                                                       \
      NAME##Large, EA, cutlass::float_e4m3_t, BlockLayoutSFA, BlockLayoutSFB, 128, 128, 1, 2,  \
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,                  \
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)                                \
  JAXFUSE_GG_DEFINE_FP8_BLOCKWISE_GEMMS(                                                       \
      NAME##Small, EA, cutlass::float_e4m3_t, BlockLayoutSFA, BlockLayoutSFB, 64, 128, 1, 1,   \
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,                     \
      cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)                                   \
  JAXFUSE_GG_DEFINE_FP8_MAINLOOP_ENTRY_POINTS(NAME, NAME##Large, NAME##LargeStock, NAME##Small, \
                                              NAME##SmallStock)

// A blockwise FP8 wgrad family (e4m3 x^T x EB dy^T -> bf16, from the column-wise copies,
// WgradBlockScaleConfig's scales; the output tiles are k x n per group), one config with
// both mainloops (NAME##Gemm, NAME##GemmStock): cooperative 128x128x128, cluster 1x2. (A
// ping-pong 64x128x128 config ran 0.79x of the stock cooperative one at 8 x 8192 rows and
// 0.94x at 64 x 512 on the H200, 2da1c0b6: its warp groups taking turns did not hide the
// per-element promotion, a row and a column scale per output every 128 rows.)
#define JAXFUSE_GG_DEFINE_FP8_BLOCKWISE_WGRAD_FAMILY(NAME, EB)                                  \
  JAXFUSE_GG_DEFINE_FP8_BLOCKWISE_GEMMS(                                                       \
      NAME##Gemm, cutlass::float_e4m3_t, EB, WgradBlockLayoutSFA, WgradBlockLayoutSFB, 128,    \
      128, 1, 2, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,       \
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)                                \
  JAXFUSE_GG_DEFINE_FP8_MAINLOOP_ENTRY_POINTS(NAME, NAME##Gemm, NAME##GemmStock, NAME##Gemm,   \
                                              NAME##GemmStock)
