// How the one-pass per-batch quantization (QuantizeBatchesOnePassKernel, cuda/gpu/quantize.cu)
// splits its resident grid into teams and its batches' tiles over a team's blocks. Shared by
// the handler, the kernel and a host test (tests/test_one_pass_plan.py), which checks that
// every tile of a batch is held by exactly one block and that no block holds more than its
// shared memory has room for.
#pragma once

#include <algorithm>
#include <cstdint>

#include "jaxfuse/platform.h"

namespace jaxfuse {

// teams == 0: the kernel does not run (a batch's tiles need more blocks than are resident,
// or no blocks / no tiles are allowed).
struct OnePassPlan {
  int teams = 0, team_blocks = 0, tiles_per_block = 0;
};

// The most teams whose blocks hold a batch's `tiles` tiles with at most `max_tiles` each,
// at most one team per batch; then every one of the `resident_blocks` blocks in some team,
// and the tiles spread evenly over a team's blocks.
inline OnePassPlan PlanOnePass(int64_t resident_blocks, int max_tiles, int64_t batch,
                               int64_t tiles) {
  OnePassPlan plan;
  if (resident_blocks <= 0 || max_tiles <= 0 || batch <= 0 || tiles <= 0) return plan;
  const int64_t least_blocks = (tiles + max_tiles - 1) / max_tiles;
  if (least_blocks > resident_blocks) return plan;
  plan.teams = static_cast<int>(std::min(batch, resident_blocks / least_blocks));
  plan.team_blocks = static_cast<int>(resident_blocks / plan.teams);
  plan.tiles_per_block = static_cast<int>((tiles + plan.team_blocks - 1) / plan.team_blocks);
  return plan;
}

// The tiles block `rank` of a team holds in every batch: rank + i * team_blocks for
// i < OnePassTilesHeld(...), at most tiles_per_block.
JAXFUSE_HOST_DEVICE int OnePassTilesHeld(int rank, int64_t tiles, int team_blocks,
                                         int tiles_per_block) {
  if (rank >= tiles) return 0;
  const int64_t reaching = (tiles - rank + team_blocks - 1) / team_blocks;
  return static_cast<int>(reaching < tiles_per_block ? reaching : tiles_per_block);
}

}  // namespace jaxfuse
