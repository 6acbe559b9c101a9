// jaxfuse grouped GEMM: host-only interface to the CUTLASS SM90 grouped kernels.
//
// This header deliberately includes no CUTLASS/cute header, so the XLA FFI handler
// that calls it compiles fast. The implementation lives in cuda/gpu/grouped_gemm/.
//
// Layouts (all row-major, dense). "Rows" are the row-ragged dimension split into groups
// by `group_offsets`; rows past the last (clamped) offset are outputs of zeros.
//   kForward  a = x [m, k],  b = w [G, k, n],  out = y [m, n]:   y[rows_g] = x[rows_g] @ w[g]
//   kDgrad    a = dy [m, n], b = w [G, k, n],  out = dx [m, k]:  dx[rows_g] = dy[rows_g] @ w[g]^T
//   kWgrad    a = x [m, k],  b = dy [m, n],    out = dw [G, k, n]: dw[g] = x[rows_g]^T @ dy[rows_g]
//                                                                  (dw[g] = 0 for an empty group)
// FP8 (both operands must be K-major for SM90 FP8 wgmma; output is bf16):
//   kForward  a = x [m, k] e4m3, b = w TRANSPOSED [G, n, k] e4m3
//   kDgrad    a = dy [m, n] e4m3|e5m2, b = w [G, k, n] e4m3
//   kWgrad    columnwise = true: a = x^T, b = dy^T, the column-wise copies of the rows
//             (jaxfuse/columnwise.h): a [k, ColumnwiseWidth(m, G)] e4m3,
//             b [n, ColumnwiseWidth(m, G)] e4m3|e5m2 buffers in blocked storage: group
//             g's rows are the columns from ColumnwiseStart(clamped offset g, g) of its own
//             row-major block. out = dw [G, k, n] (zero for empty groups).
//   out = (a_scale_inv[g] * b_scale_inv[g]) * (a @ b) per group (a null scale pointer means 1).
//   block_scaling (kForward / kDgrad, DeepSeek-V3's blockwise recipe): a_scale_inv and
//   b_scale_inv are per block instead, with kc the contraction (k forward, n dgrad) and nc
//   the output columns (n forward, k dgrad):
//     a_scale_inv float32 [m, ceil(kc / 128)]: row r's 1 x 128 block of the contraction;
//     b_scale_inv float32 [G, ceil(nc / 128), ceil(kc / 128)]: expert g's 128 x 128 tile of
//       its K-major operand (forward: w^T [n, k]; dgrad: w [k, n]);
//   out[r, j] = sum over blocks kb of a_scale_inv[r, kb] * b_scale_inv[g, j / 128, kb] *
//   (the block's FP8 products), applied in the mainloop (fp32 accumulation every 128 k).
//   Both pointers are required; a is e4m3 or (dgrad) e5m2, b e4m3.
//   block_scaling with kWgrad (and columnwise, required): 128 x 1 blocks of x and dy along
//   the contraction, one scale per column of each copy per 128-row block of a group
//   (jaxfuse/columnwise.h, ColumnwiseScaleRow): a_scale_inv float32
//   [ColumnwiseScaleRows(m, G), k], b_scale_inv float32 [ColumnwiseScaleRows(m, G), n];
//   dw[g][i, j] = sum over the group's blocks bj of a_scale_inv[row_g + bj, i] *
//   b_scale_inv[row_g + bj, j] * (the block's FP8 products), row_g = ColumnwiseScaleRow(c_g, g);
//   a is e4m3, b e4m3 or e5m2.
//   fast_accumulation (kForward with e4m3 x e4m3 only): accumulate in the tensor cores' FP8
//   accumulator without promoting to fp32 registers every few k-blocks (faster, a little less
//   precise; TransformerEngine's default for the forward GEMM).
//
// group_offsets: DEVICE int32 [G+1]; offsets[0] = 0, non-decreasing by contract. The kernels
// never trust it: every offset is clamped to [0, m] and made non-decreasing (running max), so
// negative sizes count as zero and sizes summing past m are cut at m. Rows outside
// [offsets'[0], offsets'[G]) of y/dx are written as zeros.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "jaxfuse/activation.h"

namespace jaxfuse::grouped_gemm {

enum class ElementType { kBF16, kF16, kFloat8E4M3, kFloat8E5M2 };
enum class Form { kForward, kDgrad, kWgrad };

// Optional tile-configuration override (for benchmarks/tests). kAuto picks with a host
// heuristic from m, n, k, G and the form (never from device data); when that pick is
// kAdaptive, the setup kernel makes the last choice on the device, from the sizes.
enum class TileConfig {
  kAuto = 0,
  kLarge = 1,  // 16-bit: cooperative 128x256x64 (cluster 1x2; wgrad 2x1);
               // FP8: cooperative 128x128x128, cluster 1x2 (fast accumulation: 128x256x128)
  kSmall = 2,  // 16-bit: ping-pong 128x128x64, cluster 1x1 (bf16 wgrad: 1x2 where
               // ceil(n / 128) is even); FP8: ping-pong 64x128x128, 1x1
               // (f16 has one config, the large one, for both)
  // bf16 forward/dgrad only (other families run kLarge for both):
  kUniform = 3,   // cooperative 128x256x64, cluster 2x1: for groups with even 128-row tile
                  // counts; correct for any sizes, an idle slot per odd count
  kAdaptive = 4,  // kLarge and kUniform both launched; the setup kernel reads the sizes on
                  // the device and gives every tile to kUniform when that wastes no more
                  // than 1/64 of the tiles, else to kLarge (the other launch finds no tile)
};

// FC1 of a gated MLP with its scaled activation in the epilogue (Problem::gated): kForward
// with bf16 a, b and out, n a multiple of 256 (n = 2F, gate columns first). `out` gets h =
// x @ w[g] as the plain forward writes it; act_out [m, n / 2] bf16 gets
// act(h[:, :F], h[:, F:]) * scales[row] (jaxfuse/activation.h, fp32 math on the
// bf16-rounded h, rounded to bf16: what scaled_activation writes for that h), zeros for
// rows outside the groups.
struct GatedEpilogue {
  ActivationParams activation;    // kSwiglu or kClampedSwiglu
  const void* scales = nullptr;   // DEVICE [m]: float32 (scales_f32) or bf16
  bool scales_f32 = true;
  void* act_out = nullptr;        // DEVICE [m, n / 2] bf16, 16-byte aligned
};

struct Problem {
  Form form;
  ElementType a_type;     // bf16/f16, or an FP8 type (see above)
  ElementType b_type;
  ElementType out_type;   // bf16 or f16 (must equal a_type for 16-bit inputs; bf16 for FP8)
  int64_t m;              // rows of the row-ragged operands (capacity)
  int64_t k, n;
  int num_groups;         // G >= 1
  const int32_t* group_offsets;  // DEVICE [G+1]
  const void* a;
  const void* b;
  void* out;              // DEVICE pointers
  const float* a_scale_inv;  // FP8 only: DEVICE [G] (or nullptr = 1)
  const float* b_scale_inv;  // FP8 only: DEVICE [G] (or nullptr = 1)
  void* workspace;           // DEVICE scratch, >= WorkspaceBytes(problem, sm_count) bytes,
  size_t workspace_bytes;    // 256-byte aligned (XLA buffers are)
  bool fast_accumulation = false;  // FP8 forward only (e4m3 x e4m3), see above
  bool columnwise = false;         // FP8 wgrad only (and required there): a, b column-wise
  bool block_scaling = false;      // FP8 forward/dgrad: per-block scales (see above)
  TileConfig tile_config = TileConfig::kAuto;  // optional override
  const GatedEpilogue* gated = nullptr;        // bf16 forward only: see GatedEpilogue
};

// Host-only arithmetic: depends on form, types, G, k, n (the tile choice) and sm_count only,
// never on device data; callable without a GPU. Returns 0 for an unsupported problem.
size_t WorkspaceBytes(const Problem& problem, int sm_count);

// Enqueues everything on `stream`: no host sync, no allocation, no D2H copy, no reading of
// device data on the host (CUDA-graph capturable; a replay after the offsets changed on the
// device is correct). Returns the first error; cudaErrorInvalidValue for an unsupported
// combination or a too-small workspace, with nothing launched.
// `sm_count` is the device's multiprocessor count (the persistent grid size).
cudaError_t Run(const Problem& problem, int sm_count, cudaStream_t stream);

// Host check of types, shapes and alignment (k, n multiples of 8 for 16-bit types, of 16 for
// FP8; 16-byte aligned a/b/out pointers; m, k, n < 2^31; G >= 1; fast_accumulation only for
// the e4m3 x e4m3 forward; block_scaling only for FP8, with both scale pointers, and for the
// wgrad only from column-wise copies). Upstream raises on false.
bool IsSupported(const Problem& problem);

// The tile configuration the heuristic picks from form, types, m, k, n, G and sm_count (host
// values only). Run/WorkspaceBytes use it when tile_config == kAuto and the environment
// variable JAXFUSE_GROUPED_GEMM_TILE (large | small) is not set.
TileConfig ChooseTileConfig(const Problem& problem, int sm_count);

}  // namespace jaxfuse::grouped_gemm
