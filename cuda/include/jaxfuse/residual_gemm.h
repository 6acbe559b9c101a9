// d = alpha * a @ b + c on SM90 for 16-bit row-major matrices, and its FP8 form d = alpha *
// a_scale_inv * b_scale_inv * a @ b^T + c, with c added in fp32 before the one rounding to
// the 16-bit output type (CUTLASS epilogues). cuBLASLt's tensor-core epilogue rounds the
// scaled product to the 16-bit type before adding c (scripts/probe_linear_rounding.py), so
// linear_scale_add's 16-bit forward runs the 16-bit kernel where it applies, and its FP8
// forward the FP8 one with JAXFUSE_LINEAR_SCALE_ADD_GEMM=cutlass
// (cuda/gpu/linear_scale_add.cu). Host-only interface: no CUTLASS include; the kernels are
// in cuda/gpu/dense_gemm/.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace jaxfuse::residual_gemm {

enum class Element { kBFloat16, kFloat16 };

// Whether the kernel takes this problem: a [m, k], b [k, n], c and d [m, n], all row-major
// and dense; TMA needs 16-byte aligned rows and base addresses (k and n multiples of 8);
// CUTLASS's problem shape is int.
bool Supports(int64_t m, int64_t n, int64_t k, const void* a, const void* b, const void* c,
              const void* d);

// One kernel launch on `stream`; no host sync, no allocation. c may alias d (in place: each
// output tile reads its own c tile before it writes it). `workspace` is CUTLASS's (the
// persistent scheduler's; the call checks that it fits). Returns cudaErrorInvalidValue for
// a problem Supports rejects.
cudaError_t Run(Element element, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
                const void* b, const void* c, void* d, void* workspace, size_t workspace_bytes,
                int sm_count, cudaStream_t stream);

// Whether the FP8 kernel takes this problem: a [m, k] and b [n, k] float8_e4m3fn (both
// K-major), c and d [m, n] 16-bit, row-major and dense; k a multiple of 16 and n of 8 (TMA's
// 16-byte rows), 16-byte aligned base addresses, int-sized shapes.
bool SupportsFp8(int64_t m, int64_t n, int64_t k, const void* a, const void* b, const void* c,
                 const void* d);

// As Run, for the FP8 forward: e4m3 a @ b^T scaled by alpha and the two float32 inverse
// scales on the device (read when the kernel starts), plus c. fast_accumulation keeps the
// tensor cores' FP8 accumulator for the whole mainloop; otherwise partial sums are promoted
// to fp32 registers every few k-blocks (cuBLASLt's split accumulation).
cudaError_t RunFp8(Element element, bool fast_accumulation, int64_t m, int64_t n, int64_t k,
                   float alpha, const float* a_scale_inv, const float* b_scale_inv,
                   const void* a, const void* b, const void* c, void* d, void* workspace,
                   size_t workspace_bytes, int sm_count, cudaStream_t stream);

}  // namespace jaxfuse::residual_gemm
