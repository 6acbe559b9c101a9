// Internal interface between the dispatch file (grouped_gemm.cu, no CUTLASS) and the
// per-family CUTLASS kernel files (gemm_*.cu). Host-only types; no CUTLASS headers here.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "jaxfuse/grouped_gemm.h"

namespace jaxfuse::grouped_gemm::detail {

// Device arrays filled by the setup kernel, read by the CUTLASS pointer-array kernel.
// The layouts match CUTLASS's types (static_asserted in gemm_common.cuh):
//   problem_shapes: cute::Shape<int,int,int> = 3 x int32 per group (M, N, K in CUTLASS terms)
//   stride_*:       cute::Stride<int64_t,_1,_0> or <_1,int64_t,_0> = one int64 (the leading
//                   dimension) per group
struct GemmArrays {
  int num_groups = 0;
  int32_t* problem_shapes = nullptr;  // [G][3]
  const void** ptr_a = nullptr;       // [G]
  const void** ptr_b = nullptr;       // [G]
  void** ptr_d = nullptr;             // [G]
  int64_t* stride_a = nullptr;        // [G]
  int64_t* stride_b = nullptr;        // [G]
  int64_t* stride_d = nullptr;        // [G]
  const float** alpha_ptrs = nullptr; // [G] (per-group FP8 only; nullptr otherwise)
  const float** ptr_sfa = nullptr;    // [G] (blockwise FP8 only): group g's first row of
  const float** ptr_sfb = nullptr;    // [G]   a's scales, expert g's tile scales of b (wgrad:
                                      //       group g's first scale rows of x^T and dy^T)
  void* cutlass_workspace = nullptr;  // CUTLASS's own workspace (tensormaps per SM)
  size_t cutlass_workspace_bytes = 0;
  char raster = 'M';                  // tile scheduler raster order: 'M' or 'N' (host value)
  int64_t columns = 0;                // CUTLASS N of every group (host value; the bf16 wgrad
                                      // picks its small kernel's cluster shape from it)
  int64_t rows = 0;                   // m, the row-ragged operands' rows (host value; the
                                      // gated epilogue's store descriptors cover them all)
  bool pdl = false;                   // launch as a programmatic dependent (host value)
  int teams = 1;                      // team tile scheduler's teams (team_tile_scheduler.cuh;
                                      // host value; kernels without it ignore it)
  // The gated FC1 (gemm_bf16_fwd_gated.cu) only: its activation output and scales, and the
  // whole output's base address (h row 0: the epilogue finds a group's rows from ptr_d).
  const GatedEpilogue* gated = nullptr;  // host pointer, read before the launch
  const void* out = nullptr;
};

// Block edge of the blockwise FP8 scales (both the 1 x 128 and the 128 x 128 blocks);
// gemm_common.cuh's BlockScaleConfig is built on it.
inline constexpr int64_t kBlockScale = 128;

// Runtime tuning knobs, read once from the environment at first use (not device data; no
// extra kernels); check_grouped_gemm sweeps them through this reference.
// - CUTLASS's persistent group tile scheduler: the order in which a wave of CTAs walks the
//   output tiles ('M': consecutive tiles down M; 'N': along N; 0: per form, see
//   grouped_gemm.cu) and the swizzle width (1, 2, 4 or 8 tiles):
//   JAXFUSE_GROUPED_GEMM_RASTER (M|N), JAXFUSE_GROUPED_GEMM_SWIZZLE.
// - The tile configuration of problems that leave it at kAuto (kAuto: the heuristic):
//   JAXFUSE_GROUPED_GEMM_TILE (large | small | uniform | adaptive).
// - The mainloop of the promoted FP8 families (gemm_common.cuh, Fp8PromotedFamily): 'p' the
//   pipelined promotion (the default), 's' CUTLASS's stock mainloop:
//   JAXFUSE_GROUPED_GEMM_FP8_MAINLOOP (pipelined | stock).
struct TuningOptions {
  char raster = 0;
  int swizzle = 1;
  TileConfig tile = TileConfig::kAuto;
  char fp8_mainloop = 'p';
  // Programmatic dependent launch of the CUTLASS kernels (their CTAs resident while the
  // setup kernel runs; WaitForPriorGrid): -1 where the problem is small (grouped_gemm.cu,
  // UseProgrammaticLaunch), 0 never, 1 always: JAXFUSE_GROUPED_GEMM_PDL=0|1.
  int pdl = -1;
  // JAXFUSE_GROUPED_GEMM_WGRAD_PAIR=0: the bf16 wgrad's kSmall always runs its 1x1-cluster
  // kernel (default: the 1x2 one where the column tiles pair up; gemm_bf16_wgrad.cu).
  bool wgrad_pair = true;
  // The 16-bit cooperative kernels read per-group TMA descriptors prepared before they run
  // (prepared_tensormaps.cuh) instead of rewriting CUTLASS's per-SM ones at every group
  // change; JAXFUSE_GROUPED_GEMM_TENSORMAPS=cutlass runs CUTLASS's (the ping-pong kernels
  // always do: prepared ones measured 10-15% slower there, README.md).
  bool prepared_tensormaps = true;
  // Teams of the tile scheduler of the bf16 ping-pong kernels (team_tile_scheduler.cuh): each
  // team of CTAs walks its own contiguous share of the tiles, so a CTA changes group every
  // few tiles. 1 = CUTLASS's order; 0 = the heuristic (grouped_gemm.cu, TeamsFor).
  // JAXFUSE_GROUPED_GEMM_TEAMS=1..1024.
  int teams = 0;
  // How the gated FC1's epilogue writes h and act (gated_epilogue.cuh): staged in shared
  // memory and stored by the TMA unit (true), or straight from registers (false: the form
  // the GPU tests passed in session 56; the staged stores have not run on a GPU yet):
  // JAXFUSE_GROUPED_GEMM_GATED_STORES=tma|registers.
  bool gated_tma_stores = false;
};
TuningOptions& ActiveTuningOptions();

// Whether the bf16 wgrad's kSmall runs its 1x2-cluster kernel for CUTLASS N = `columns`:
// the 128-wide column tiles pair up (and JAXFUSE_GROUPED_GEMM_WGRAD_PAIR is not 0). Both
// the kernel choice (gemm_bf16_wgrad.cu) and the heuristic (grouped_gemm.cu) ask this.
inline bool Bf16WgradPairsColumnTiles(int64_t columns) {
  return ActiveTuningOptions().wgrad_pair && columns > 0 && (columns + 127) / 128 % 2 == 0;
}

// One entry point pair per kernel family (one family per .cu file). `config` is kLarge or
// kSmall (families with a single config ignore it).
#define JAXFUSE_GG_DECLARE_FAMILY(NAME)                                                    \
  size_t NAME##_WorkspaceBytes(TileConfig config, int num_groups, int sm_count);          \
  cudaError_t NAME##_Run(TileConfig config, const GemmArrays& arrays, int sm_count,        \
                         cudaStream_t stream);

// 16-bit families. Layout names: A/B majors in CUTLASS terms.
JAXFUSE_GG_DECLARE_FAMILY(Bf16Fwd)    // A K-major (x), B N-major (w[g])
JAXFUSE_GG_DECLARE_FAMILY(Bf16Dgrad)  // A K-major (dy), B K-major (w[g] read as [k, n])
JAXFUSE_GG_DECLARE_FAMILY(Bf16Wgrad)  // A M-major (x^T), B N-major (dy)
// bf16 forward with a gated activation in the epilogue (Problem::gated; gated_epilogue.cuh):
// one config, cooperative 128x256x64, cluster 1x2.
JAXFUSE_GG_DECLARE_FAMILY(Bf16FwdGated)
JAXFUSE_GG_DECLARE_FAMILY(F16Fwd)
JAXFUSE_GG_DECLARE_FAMILY(F16Dgrad)
JAXFUSE_GG_DECLARE_FAMILY(F16Wgrad)
// FP8 families: A K-major, B K-major, bf16 output, per-group alpha.
JAXFUSE_GG_DECLARE_FAMILY(Fp8E4m3E4m3)
JAXFUSE_GG_DECLARE_FAMILY(Fp8E5m2E4m3)
JAXFUSE_GG_DECLARE_FAMILY(Fp8E4m3FastAccum)  // forward only: FP8 fast accumulation
JAXFUSE_GG_DECLARE_FAMILY(Fp8E4m3E5m2)       // wgrad only: x^T e4m3, dy^T e5m2 (columnwise)
// Blockwise FP8 families (forward and dgrad): A K-major with 1 x 128 scales, B K-major
// e4m3 with 128 x 128 tile scales, applied in the mainloop; bf16 output, no alpha.
JAXFUSE_GG_DECLARE_FAMILY(Fp8BlockE4m3E4m3)
JAXFUSE_GG_DECLARE_FAMILY(Fp8BlockE5m2E4m3)  // dgrad with E5M2 output gradients
// Blockwise FP8 wgrad (single config): x^T e4m3 x dy^T (e4m3 | e5m2) from the column-wise
// copies, 128 x 1 block scales of both along the rows (jaxfuse/columnwise.h).
JAXFUSE_GG_DECLARE_FAMILY(Fp8BlockWgradE4m3E4m3)
JAXFUSE_GG_DECLARE_FAMILY(Fp8BlockWgradE4m3E5m2)

// kUniform kernels (bf16 forward/dgrad), one config each; NAME_RowGranularity() = its CTA
// tile M x cluster M.
JAXFUSE_GG_DECLARE_FAMILY(Bf16FwdUniform)
JAXFUSE_GG_DECLARE_FAMILY(Bf16DgradUniform)
int Bf16FwdUniform_RowGranularity();
int Bf16DgradUniform_RowGranularity();

#undef JAXFUSE_GG_DECLARE_FAMILY

}  // namespace jaxfuse::grouped_gemm::detail
