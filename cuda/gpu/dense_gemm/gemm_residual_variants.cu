// EXPERIMENT (session 53): other tiles for the bf16 and FP8 (fast accumulation, bf16 out)
// residual GEMMs, chosen with JAXFUSE_RESIDUAL_GEMM_VARIANT=1|2|3 for a same-run sweep on the
// GPU. 1: 1x2 cluster; 2: 256x128 tiles, 2x1 cluster; 3: ping-pong 64x256 tiles, 1x2
// cluster. To be reduced to the winner (or removed) once measured.
#include <cstdlib>

#include "residual_gemm.cuh"

namespace jaxfuse::residual_gemm {
namespace {

using namespace cute;

#define JAXFUSE_RESIDUAL_VARIANT(NAME, ELEMENT_AB, LAYOUT_B, ALIGN_AB, FUSION, TM, TN, TK, CM,  \
                                 CN, SCHEDULE, EPILOGUE_SCHEDULE)                              \
  using NAME##Tile = Shape<Int<TM>, Int<TN>, Int<TK>>;                                        \
  using NAME##Cluster = Shape<Int<CM>, Int<CN>, _1>;                                          \
  using NAME##Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<           \
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, NAME##Tile, NAME##Cluster,         \
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, cutlass::bfloat16_t,     \
      cutlass::layout::RowMajor, 8, cutlass::bfloat16_t, cutlass::layout::RowMajor, 8,        \
      EPILOGUE_SCHEDULE, FUSION>::CollectiveOp;                                               \
  using NAME##Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<               \
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ELEMENT_AB,                        \
      cutlass::layout::RowMajor, ALIGN_AB, ELEMENT_AB, LAYOUT_B, ALIGN_AB, float, NAME##Tile, \
      NAME##Cluster,                                                                          \
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(                     \
          sizeof(typename NAME##Epilogue::SharedStorage))>,                                   \
      SCHEDULE>::CollectiveOp;                                                                \
  using NAME##Kernel = cutlass::gemm::kernel::GemmUniversal<                                  \
      Shape<int, int, int, int>, NAME##Mainloop, NAME##Epilogue,                              \
      cutlass::gemm::PersistentScheduler>;                                                    \
  using NAME = cutlass::gemm::device::GemmUniversalAdapter<NAME##Kernel>;

using Bf16Fusion =
    cutlass::epilogue::fusion::LinearCombination<cutlass::bfloat16_t, float, cutlass::bfloat16_t,
                                                 float>;
using Fp8Fusion = detail::Fp8ResidualEpilogue<cutlass::bfloat16_t>;

JAXFUSE_RESIDUAL_VARIANT(Bf16Cluster12, cutlass::bfloat16_t, cutlass::layout::RowMajor, 8,
                         Bf16Fusion, 128, 256, 64, 1, 2,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                         cutlass::epilogue::TmaWarpSpecializedCooperative)
JAXFUSE_RESIDUAL_VARIANT(Bf16Tile256x128, cutlass::bfloat16_t, cutlass::layout::RowMajor, 8,
                         Bf16Fusion, 256, 128, 64, 2, 1,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                         cutlass::epilogue::TmaWarpSpecializedCooperative)
JAXFUSE_RESIDUAL_VARIANT(Bf16Pingpong, cutlass::bfloat16_t, cutlass::layout::RowMajor, 8,
                         Bf16Fusion, 64, 256, 64, 1, 2,
                         cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                         cutlass::epilogue::TmaWarpSpecialized)
JAXFUSE_RESIDUAL_VARIANT(Fp8Cluster12, cutlass::float_e4m3_t, cutlass::layout::ColumnMajor, 16,
                         Fp8Fusion, 128, 256, 128, 1, 2,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                         cutlass::epilogue::TmaWarpSpecializedCooperative)
JAXFUSE_RESIDUAL_VARIANT(Fp8Tile256x128, cutlass::float_e4m3_t, cutlass::layout::ColumnMajor, 16,
                         Fp8Fusion, 256, 128, 128, 2, 1,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                         cutlass::epilogue::TmaWarpSpecializedCooperative)
JAXFUSE_RESIDUAL_VARIANT(Fp8Pingpong, cutlass::float_e4m3_t, cutlass::layout::ColumnMajor, 16,
                         Fp8Fusion, 64, 256, 128, 1, 2,
                         cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                         cutlass::epilogue::TmaWarpSpecialized)

struct AlphaBeta {
  float alpha;
  template <class Arguments>
  void operator()(Arguments& thread) const {
    thread.alpha = alpha;
    thread.beta = 1.0f;
  }
};

}  // namespace

namespace detail {

int Variant() {
  static const int variant = [] {
    const char* value = std::getenv("JAXFUSE_RESIDUAL_GEMM_VARIANT");
    const int parsed = value != nullptr ? std::atoi(value) : 0;
    return parsed >= 1 && parsed <= 3 ? parsed : 0;
  }();
  return variant;
}

cudaError_t RunBFloat16Variant(int variant, int m, int n, int k, float alpha, const void* a,
                               const void* b, const void* c, void* d, void* workspace,
                               size_t workspace_bytes, int sm_count, cudaStream_t stream) {
  const AlphaBeta epilogue{alpha};
  switch (variant) {
    case 1: return RunGemm<Bf16Cluster12>(m, n, k, a, b, c, d, epilogue, workspace,
                                          workspace_bytes, sm_count, stream);
    case 2: return RunGemm<Bf16Tile256x128>(m, n, k, a, b, c, d, epilogue, workspace,
                                            workspace_bytes, sm_count, stream);
    default: return RunGemm<Bf16Pingpong>(m, n, k, a, b, c, d, epilogue, workspace,
                                          workspace_bytes, sm_count, stream);
  }
}

cudaError_t RunFp8FastVariant(int variant, int m, int n, int k, const Fp8Scales& scales,
                              const void* a, const void* b, const void* c, void* d,
                              void* workspace, size_t workspace_bytes, int sm_count,
                              cudaStream_t stream) {
  switch (variant) {
    case 1: return RunGemm<Fp8Cluster12>(m, n, k, a, b, c, d, scales, workspace,
                                         workspace_bytes, sm_count, stream);
    case 2: return RunGemm<Fp8Tile256x128>(m, n, k, a, b, c, d, scales, workspace,
                                           workspace_bytes, sm_count, stream);
    default: return RunGemm<Fp8Pingpong>(m, n, k, a, b, c, d, scales, workspace,
                                         workspace_bytes, sm_count, stream);
  }
}

}  // namespace detail
}  // namespace jaxfuse::residual_gemm
