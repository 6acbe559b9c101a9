// bf16 forward: y[rows_g] = x[rows_g] @ w[g].
// CUTLASS terms: M = rows_g, N = n, K = k; A = x rows (RowMajor = K-major, ld k);
// B = w[g] [k, n] (RowMajor B = N-major, ld n); D = y rows (RowMajor, ld n).
#include "epilogue_stages.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_GEMM(Bf16FwdLarge, cutlass::bfloat16_t, cutlass::layout::RowMajor,
                       cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                       128, 256, 64, 1, 2,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative)
JAXFUSE_GG_DEFINE_GEMM(Bf16FwdSmall, cutlass::bfloat16_t, cutlass::layout::RowMajor,
                       cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::bfloat16_t,
                       128, 128, 64, 1, 1,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong)

// The same two with 4 epilogue store buffers (JAXFUSE_GROUPED_GEMM_EPILOGUE_STAGES=4).
JAXFUSE_GG_DEFINE_GEMM_EPILOGUE_STAGES(Bf16FwdLarge4, cutlass::bfloat16_t, cutlass::layout::RowMajor,
                                       cutlass::bfloat16_t, cutlass::layout::RowMajor,
                                       cutlass::bfloat16_t, 128, 256, 64, 1, 2,
                                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, 4)
JAXFUSE_GG_DEFINE_GEMM_EPILOGUE_STAGES(Bf16FwdSmall4, cutlass::bfloat16_t, cutlass::layout::RowMajor,
                                       cutlass::bfloat16_t, cutlass::layout::RowMajor,
                                       cutlass::bfloat16_t, 128, 128, 64, 1, 1,
                                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                       cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, 4)

JAXFUSE_GG_DEFINE_FAMILY_2_EPILOGUE_STAGES(Bf16Fwd, Bf16FwdLarge, Bf16FwdLarge4, Bf16FwdSmall,
                                           Bf16FwdSmall4)

}  // namespace jaxfuse::grouped_gemm::detail
