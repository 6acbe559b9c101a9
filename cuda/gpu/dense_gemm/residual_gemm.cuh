// What the CUTLASS kernels behind jaxfuse/residual_gemm.h share: building a dense SM90
// GEMM's arguments for d = epilogue(a @ b, c) with c and d [m, n] row-major, and running it
// on a stream without a host sync. Each gemm_residual*.cu file instantiates its kernels
// and fills the epilogue's arguments (a LinearCombination's alpha and beta, or an EVT
// tree's) through the callback RunGemm takes.
#pragma once

#include <cstddef>
#include <cstdint>

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

namespace jaxfuse::residual_gemm::detail {

// JAXFUSE_RESIDUAL_GEMM_SWIZZLE=1|2|4|8: the persistent scheduler's tile swizzle (how many
// tiles along the raster's minor dimension it walks together, for L2 reuse); 8 by default.
// Read once per process (gemm_residual.cu).
int SwizzleSize();

inline bool Aligned16(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0;
}

// CUTLASS's problem shape is int.
inline bool FitsInt(int64_t m, int64_t n, int64_t k) {
  constexpr int64_t kIntMax = 2147483647;
  return m > 0 && n > 0 && k > 0 && m <= kIntMax && n <= kIntMax && k <= kIntMax;
}

// One launch of Gemm on `stream` for a [m, k] @ b (the mainloop's layouts say how b is
// stored) with c and d [m, n] row-major. fill_epilogue(args.epilogue.thread) sets the
// fusion's scalars. TMA descriptors are built on the host and the kernel's shared-memory
// attribute set in initialize(); nothing syncs or allocates.
template <class Gemm, class FillEpilogue>
cudaError_t RunGemm(int m, int n, int k, const void* a, const void* b, const void* c, void* d,
                    FillEpilogue fill_epilogue, void* workspace, size_t workspace_bytes,
                    int sm_count, cudaStream_t stream) {
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
  fill_epilogue(args.epilogue.thread);
  args.epilogue.ptr_C = static_cast<const ElementC*>(c);
  args.epilogue.dC = cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, {m, n, 1});
  args.epilogue.ptr_D = static_cast<ElementD*>(d);
  args.epilogue.dD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {m, n, 1});
  args.scheduler.max_swizzle_size = SwizzleSize();
  args.hw_info.device_id = 0;  // unused when sm_count > 0
  args.hw_info.sm_count = sm_count;

  if (Gemm::get_workspace_size(args) > workspace_bytes) return cudaErrorInvalidValue;
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
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

// RunGemm for `element` with one config's two output-type instantiations.
template <class BFloat16Gemm, class Float16Gemm, class FillEpilogue>
cudaError_t RunGemmFor(Element element, int m, int n, int k, const void* a, const void* b,
                       const void* c, void* d, FillEpilogue fill_epilogue, void* workspace,
                       size_t workspace_bytes, int sm_count, cudaStream_t stream) {
  return element == Element::kBFloat16
             ? RunGemm<BFloat16Gemm>(m, n, k, a, b, c, d, fill_epilogue, workspace,
                                     workspace_bytes, sm_count, stream)
             : RunGemm<Float16Gemm>(m, n, k, a, b, c, d, fill_epilogue, workspace,
                                    workspace_bytes, sm_count, stream);
}

// The FP8 kernels' epilogue: d = (alpha * a_scale_inv * b_scale_inv) * acc + c in fp32,
// rounded once to d's type. The three scalars multiply in Sm90ScalarBroadcast (alpha from
// the host, the two inverse scales read from the device when the kernel starts, so the
// quantizing kernels' scales need no host round trip).
template <class ElementCD>
using Fp8ResidualEpilogue = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementCD,
                                           float, cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90ScalarBroadcast<
        float, cute::Stride<cute::_0, cute::_0, int64_t>, 3>,
    cutlass::epilogue::fusion::Sm90AccFetch,
    cutlass::epilogue::fusion::Sm90SrcFetch<ElementCD>>;

// Fills Fp8ResidualEpilogue's arguments: {scale product, acc, c, multiply_add}.
struct Fp8Scales {
  float alpha;
  const float* a_scale_inv;
  const float* b_scale_inv;

  template <class Arguments>
  void operator()(Arguments& thread) const {
    thread = {};
    auto& scale = thread.op_0;  // Sm90ScalarBroadcast's: the product of all three
    scale.scalars[0] = alpha;
    scale.scalar_ptrs[1] = a_scale_inv;
    scale.scalar_ptrs[2] = b_scale_inv;
  }
};

// An FP8 kernel: e4m3 a [m, k] K-major times e4m3 b [n, k] K-major (Hopper's FP8 tensor
// cores read K-major operands only), c and d [m, n] row-major ELEMENT_CD, the persistent
// scheduler. A namespace-scope alias chain, as gemm_residual.cu's.
#define JAXFUSE_FP8_RESIDUAL_GEMM(NAME, ELEMENT_CD, TM, TN, TK, CM, CN, SCHEDULE)             \
  using NAME##TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::Int<TK>>;           \
  using NAME##ClusterShape = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;             \
  using NAME##Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<           \
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, NAME##TileShape,                   \
      NAME##ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto, float, float,      \
      ELEMENT_CD, cutlass::layout::RowMajor, 16 / sizeof(ELEMENT_CD), ELEMENT_CD,             \
      cutlass::layout::RowMajor, 16 / sizeof(ELEMENT_CD),                                     \
      cutlass::epilogue::TmaWarpSpecializedCooperative,                                       \
      ::jaxfuse::residual_gemm::detail::Fp8ResidualEpilogue<ELEMENT_CD>>::CollectiveOp;       \
  using NAME##Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<               \
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::float_e4m3_t,             \
      cutlass::layout::RowMajor, 16, cutlass::float_e4m3_t, cutlass::layout::ColumnMajor, 16, \
      float, NAME##TileShape, NAME##ClusterShape,                                             \
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(                     \
          sizeof(typename NAME##Epilogue::SharedStorage))>,                                   \
      SCHEDULE>::CollectiveOp;                                                                \
  using NAME##Kernel = cutlass::gemm::kernel::GemmUniversal<                                  \
      cute::Shape<int, int, int, int>, NAME##Mainloop, NAME##Epilogue,                        \
      cutlass::gemm::PersistentScheduler>;                                                    \
  using NAME = cutlass::gemm::device::GemmUniversalAdapter<NAME##Kernel>;

// The promoted (non-fast) FP8 kernels, in gemm_residual_fp8_promoted.cu.
cudaError_t RunFp8Promoted(Element element, int m, int n, int k, const Fp8Scales& scales,
                           const void* a, const void* b, const void* c, void* d,
                           void* workspace, size_t workspace_bytes, int sm_count,
                           cudaStream_t stream);

}  // namespace jaxfuse::residual_gemm::detail
