// How many rows each block of GroupAmaxKernel (the per-group amax of a plain tensor, pass 1
// of per-group current scaling; cuda/gpu/quantize.cu) reads. Shared by the handler and a
// host test (tests/test_group_amax_plan.py), which checks the bounds below and the plans of
// the measured shapes.
#pragma once

#include <algorithm>
#include <cstdint>

namespace jaxfuse {

// ~64 KB of input a block (two rounds of the kernel's 16-byte loads), fewer rows where that
// leaves resident blocks idle, but no less than ~8 KB: on the T=2048 grouped MLP's 4 MB x
// and dy (2 KB rows; H100, one call, profile_kernels_s46amax{32,default,4}_* under
// benchmarks/results/; us for the two calls) 64 KB a block (64 blocks) took 22.9, one
// resident wave's share (one row a block, 2048 blocks, half of each block's threads idle)
// 19.6, 8 KB a block (512 blocks) 9.0.
inline constexpr int64_t kGroupAmaxBlockBytes = 64 * 1024;
inline constexpr int64_t kGroupAmaxMinBlockBytes = 8 * 1024;

// Rows a block reads, for `rows` rows of `row_bytes` bytes (> 0) and `resident_blocks`
// blocks resident on the GPU (> 0): between ceil(8 KB / row_bytes) and 64 KB / row_bytes
// (at least one row), as close to rows / resident_blocks as that allows. forced_rows > 0
// (the JAXFUSE_GROUP_AMAX_ROWS benchmark knob) is returned as it is.
inline int64_t GroupAmaxRowsPerBlock(int64_t rows, int64_t row_bytes, int64_t resident_blocks,
                                     int64_t forced_rows = 0) {
  if (forced_rows > 0) return forced_rows;
  const int64_t most = std::max<int64_t>(1, kGroupAmaxBlockBytes / row_bytes);
  const int64_t least =
      std::min(most, (kGroupAmaxMinBlockBytes + row_bytes - 1) / row_bytes);
  return std::clamp(rows / resident_blocks, least, most);
}

}  // namespace jaxfuse
