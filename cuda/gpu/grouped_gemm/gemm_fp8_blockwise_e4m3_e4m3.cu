// Blockwise-scaled FP8 (e4m3 x e4m3 -> bf16), forward and dgrad: DeepSeek-V3's recipe
// (jaxfuse.quantization.Float8BlockScaling), 1 x 128 scales for the row operand and
// 128 x 128 tile scales for the weight, both applied in CUTLASS's blockwise mainloop.
// Layouts as gemm_fp8_e4m3_e4m3.cu (both operands K-major); scale layouts and tiles:
// gemm_common.cuh (BlockScaleConfig, JAXFUSE_GG_DEFINE_FP8_BLOCKWISE_FAMILY).
#include "gemm_common.cuh"

namespace jaxfuse::grouped_gemm::detail {

JAXFUSE_GG_DEFINE_FP8_BLOCKWISE_FAMILY(Fp8BlockE4m3E4m3, cutlass::float_e4m3_t)

}  // namespace jaxfuse::grouped_gemm::detail
