// Blockwise-scaled FP8 dgrad with an E5M2 output gradient (e5m2 x e4m3 -> bf16):
// Float8BlockScaling(gradient_format="e5m2"). Otherwise as gemm_fp8_blockwise_e4m3_e4m3.cu.
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_FP8_BLOCKWISE_FAMILY(Fp8BlockE5m2E4m3, cutlass::float_e5m2_t)

}  // namespace jaxfuse::grouped_gemm::detail
