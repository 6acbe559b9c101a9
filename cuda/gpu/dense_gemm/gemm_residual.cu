// The 16-bit CUTLASS SM90 kernels behind jaxfuse/residual_gemm.h: d = alpha * a @ b + beta *
// c with a [m, k] K-major, b [k, n] N-major, c and d [m, n] row-major; fp32 accumulation and
// epilogue math, one rounding at the store. One config per 16-bit type: cooperative
// 128x256x64 tiles, a 2x1 cluster, the persistent tile scheduler (one CTA per SM walks the
// output tiles), as CUTLASS's dense SM90 bf16 examples.
#include <cstdlib>

#include "residual_gemm.cuh"

namespace jaxfuse::residual_gemm {
namespace {

using namespace cute;

using TileShape = Shape<_128, _256, _64>;
using ClusterShape = Shape<_2, _1, _1>;
using LayoutA = cutlass::layout::RowMajor;  // a [m, k]: K-major
using LayoutB = cutlass::layout::RowMajor;  // b [k, n]: N-major (16-bit wgmma reads either)
using LayoutC = cutlass::layout::RowMajor;  // c, d [m, n]

// Namespace-scope aliases rather than a class template of builders (gcc's host pass
// failed on nested collective builders: DESIGN.md, pitfalls).
#define JAXFUSE_RESIDUAL_GEMM(NAME, ELEMENT)                                                  \
  using NAME##Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<           \
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,           \
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ELEMENT, LayoutC,        \
      16 / sizeof(ELEMENT), ELEMENT, LayoutC, 16 / sizeof(ELEMENT),                           \
      cutlass::epilogue::TmaWarpSpecializedCooperative,                                       \
      cutlass::epilogue::fusion::LinearCombination<ELEMENT, float, ELEMENT, float>>::         \
      CollectiveOp;                                                                           \
  using NAME##Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<               \
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ELEMENT, LayoutA,                  \
      16 / sizeof(ELEMENT), ELEMENT, LayoutB, 16 / sizeof(ELEMENT), float, TileShape,         \
      ClusterShape,                                                                           \
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(                     \
          sizeof(typename NAME##Epilogue::SharedStorage))>,                                   \
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;                      \
  using NAME##Kernel = cutlass::gemm::kernel::GemmUniversal<                                  \
      Shape<int, int, int, int>, NAME##Mainloop, NAME##Epilogue,                              \
      cutlass::gemm::PersistentScheduler>;                                                    \
  using NAME = cutlass::gemm::device::GemmUniversalAdapter<NAME##Kernel>;

JAXFUSE_RESIDUAL_GEMM(BFloat16Gemm, cutlass::bfloat16_t)
JAXFUSE_RESIDUAL_GEMM(Float16Gemm, cutlass::half_t)

// LinearCombination: d = alpha * acc + beta * c.
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

// Default 8: on an H100 the forward at 4096-65536 x 4096-8192 ran 0.973x XLA's time-paired
// cuBLASLt call on average against 0.960x with CUTLASS's 1, and cuBLASLt's own 0.985x
// (session 52, benchmarks/results/linear_scale_add_s52*).
int SwizzleSize() {
  static const int size = [] {
    const char* value = std::getenv("JAXFUSE_RESIDUAL_GEMM_SWIZZLE");
    const int parsed = value != nullptr ? std::atoi(value) : 8;
    return parsed == 1 || parsed == 2 || parsed == 4 ? parsed : 8;
  }();
  return size;
}

}  // namespace detail

bool Supports(int64_t m, int64_t n, int64_t k, const void* a, const void* b, const void* c,
              const void* d) {
  using detail::Aligned16;
  return detail::FitsInt(m, n, k) && k % 8 == 0 && n % 8 == 0 && Aligned16(a) &&
         Aligned16(b) && Aligned16(c) && Aligned16(d);
}

cudaError_t Run(Element element, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
                const void* b, const void* c, void* d, void* workspace, size_t workspace_bytes,
                int sm_count, cudaStream_t stream) {
  if (!Supports(m, n, k, a, b, c, d) || sm_count <= 0) return cudaErrorInvalidValue;
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  return detail::RunGemmFor<BFloat16Gemm, Float16Gemm>(element, mi, ni, ki, a, b, c, d,
                                                       AlphaBeta{alpha}, workspace,
                                                       workspace_bytes, sm_count, stream);
}

}  // namespace jaxfuse::residual_gemm
