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

// How many teams: each team's blocks hold a batch's `tiles` tiles with at most `max_tiles`
// each, so at most resident_blocks / ceil(tiles / max_tiles) teams, and at most one per
// batch. A block's time goes as the rounds of batches it walks (ceil(batch / teams)) times
// the tiles it holds in each (ceil(tiles / team_blocks)); the plan takes the team count with
// the least of that product, the most teams among equals. The most teams alone can leave a
// last round with few of them busy: 8 batches of 128 tiles on 132 blocks of 6 make 6 teams of
// 22 blocks, 2 rounds x 6 tiles, where 4 teams of 33 blocks hold 4 each (2 x 4). Every one of
// the `resident_blocks` blocks is in some team (team_blocks = resident_blocks / teams).
inline int64_t OnePassCost(int64_t resident_blocks, int64_t batch, int64_t tiles, int64_t teams) {
  const int64_t team_blocks = resident_blocks / teams;
  return ((batch + teams - 1) / teams) * ((tiles + team_blocks - 1) / team_blocks);
}

// most_teams_only: the most teams that fit, as before session 45 (the handler's A/B knob
// JAXFUSE_QUANTIZE_ONE_PASS_PLAN=most_teams).
inline OnePassPlan PlanOnePass(int64_t resident_blocks, int max_tiles, int64_t batch,
                               int64_t tiles, bool most_teams_only = false) {
  OnePassPlan plan;
  if (resident_blocks <= 0 || max_tiles <= 0 || batch <= 0 || tiles <= 0) return plan;
  const int64_t least_blocks = (tiles + max_tiles - 1) / max_tiles;
  if (least_blocks > resident_blocks) return plan;
  const int64_t most_teams = std::min(batch, resident_blocks / least_blocks);
  int64_t teams = most_teams;
  for (int64_t t = most_teams - 1; t >= 1 && !most_teams_only; --t) {
    if (OnePassCost(resident_blocks, batch, tiles, t) <
        OnePassCost(resident_blocks, batch, tiles, teams)) {
      teams = t;
    }
  }
  plan.teams = static_cast<int>(teams);
  plan.team_blocks = static_cast<int>(resident_blocks / teams);
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
