// The CUTLASS SM90 kernels behind jaxfuse/residual_gemm.h: d = alpha * a @ b + beta * c with
// a [m, k] K-major, b [k, n] N-major, c and d [m, n] row-major; fp32 accumulation and
// epilogue math, one rounding at the store. One config per 16-bit type: cooperative
// 128x256x64 tiles, a 2x1 cluster, the persistent tile scheduler (one CTA per SM walks the
// output tiles), as CUTLASS's dense SM90 bf16 examples.
#include <cstdlib>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "jaxfuse/residual_gemm.h"

#if !defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
#error "jaxfuse residual GEMM needs -gencode=arch=compute_90a,code=sm_90a"
#endif

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

// JAXFUSE_RESIDUAL_GEMM_SWIZZLE=1|2|4|8: the persistent scheduler's tile swizzle (how many
// tiles along the raster's minor dimension it walks together, for L2 reuse). Default 8:
// on an H100 the forward at 4096-65536 x 4096-8192 ran 0.973x XLA's time-paired cuBLASLt
// call on average against 0.960x with CUTLASS's 1, and cuBLASLt's own 0.985x (session 52,
// benchmarks/results/linear_scale_add_s52*). Read once per process.
int SwizzleSize() {
  static const int size = [] {
    const char* value = std::getenv("JAXFUSE_RESIDUAL_GEMM_SWIZZLE");
    const int parsed = value != nullptr ? std::atoi(value) : 8;
    return parsed == 1 || parsed == 2 || parsed == 4 ? parsed : 8;
  }();
  return size;
}

template <class Gemm>
typename Gemm::Arguments MakeArguments(int m, int n, int k, float alpha, const void* a,
                                       const void* b, const void* c, void* d, int sm_count) {
  using Kernel = typename Gemm::GemmKernel;
  using ElementA = typename Gemm::ElementA;
  using ElementB = typename Gemm::ElementB;
  using ElementC = typename Kernel::CollectiveEpilogue::ElementC;
  using ElementD = typename Kernel::CollectiveEpilogue::ElementD;
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {m, n, k, 1};
  args.mainloop.ptr_A = static_cast<const ElementA*>(a);
  args.mainloop.dA = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {m, k, 1});
  args.mainloop.ptr_B = static_cast<const ElementB*>(b);
  args.mainloop.dB = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {n, k, 1});
  args.epilogue.thread.alpha = alpha;
  args.epilogue.thread.beta = 1.0f;
  args.epilogue.ptr_C = static_cast<const ElementC*>(c);
  args.epilogue.dC = cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, {m, n, 1});
  args.epilogue.ptr_D = static_cast<ElementD*>(d);
  args.epilogue.dD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {m, n, 1});
  args.scheduler.max_swizzle_size = SwizzleSize();
  args.hw_info.device_id = 0;  // unused when sm_count > 0
  args.hw_info.sm_count = sm_count;
  return args;
}

template <class Gemm>
cudaError_t RunGemm(int m, int n, int k, float alpha, const void* a, const void* b,
                    const void* c, void* d, void* workspace, size_t workspace_bytes,
                    int sm_count, cudaStream_t stream) {
  auto args = MakeArguments<Gemm>(m, n, k, alpha, a, b, c, d, sm_count);
  if (Gemm::get_workspace_size(args) > workspace_bytes) return cudaErrorInvalidValue;
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  // initialize(): TMA descriptors built on the host (no sync), the kernel's shared-memory
  // attribute set once; run(): one launch on `stream`.
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) {
    cudaError_t error = cudaGetLastError();
    return error != cudaSuccess ? error : cudaErrorUnknown;
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    cudaError_t error = cudaGetLastError();
    return error != cudaSuccess ? error : cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}

bool Aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

}  // namespace

bool Supports(int64_t m, int64_t n, int64_t k, const void* a, const void* b, const void* c,
              const void* d) {
  constexpr int64_t kIntMax = 2147483647;
  return m > 0 && n > 0 && k > 0 && m <= kIntMax && n <= kIntMax && k <= kIntMax &&
         k % 8 == 0 && n % 8 == 0 && Aligned16(a) && Aligned16(b) && Aligned16(c) &&
         Aligned16(d);
}

cudaError_t Run(Element element, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
                const void* b, const void* c, void* d, void* workspace, size_t workspace_bytes,
                int sm_count, cudaStream_t stream) {
  if (!Supports(m, n, k, a, b, c, d) || sm_count <= 0) return cudaErrorInvalidValue;
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  return element == Element::kBFloat16
             ? RunGemm<BFloat16Gemm>(mi, ni, ki, alpha, a, b, c, d, workspace,
                                     workspace_bytes, sm_count, stream)
             : RunGemm<Float16Gemm>(mi, ni, ki, alpha, a, b, c, d, workspace,
                                    workspace_bytes, sm_count, stream);
}

}  // namespace jaxfuse::residual_gemm
