// d = alpha * a @ b + c for 16-bit row-major matrices on SM90, with c added in fp32 before
// the one rounding to the output type (CUTLASS's LinearCombination epilogue). cuBLASLt's
// tensor-core epilogue rounds alpha * a @ b to the 16-bit type before adding c
// (scripts/probe_linear_rounding.py), so linear_scale_add's 16-bit forward runs this kernel
// where it applies (cuda/gpu/linear_scale_add.cu). Host-only interface: no CUTLASS include.
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

}  // namespace jaxfuse::residual_gemm
