// How the one-pass per-batch quantization (QuantizeBatchesOnePassKernel, cuda/gpu/quantize.cu)
// splits its resident grid into teams and its batches' tiles over a team's blocks. Shared by
// the handler, the kernel and a host test (tests/test_one_pass_plan.py), which checks that
// every tile of a batch is held by exactly one block, that no block holds more than its
// shared memory has room for, and that no other team count costs a block less.
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
// batch. A block walks ceil(batch / teams) rounds, each costing the tiles it holds
// (ceil(tiles / team_blocks)) plus a fixed part, kOnePassRoundTiles tiles' worth: the team's
// wait for every block's amax and the refill pipeline's drain. The plan takes the team count
// with the least rounds x (tiles + kOnePassRoundTiles), the most teams among equals. The most
// teams alone can leave a last round with few of them busy: 8 batches of 128 tiles on 132
// blocks of 6 make 6 teams of 22 blocks, 2 rounds of 6 tiles, where 4 teams of 33 blocks
// hold 4 (H100, session 45: 0.036 -> 0.031 ms). The fixed part comes from the same
// measurement: DeepSeek-like FC2 weights (64 batches of 176 tiles) ran 0.303 ms in 16 rounds
// of 6 tiles (4 teams) and 0.321 ms in 22 rounds of 4 (3 teams), which rounds x tiles alone
// ranks the other way. Every one of the `resident_blocks` blocks is in some team
// (team_blocks = resident_blocks / teams).
inline constexpr int64_t kOnePassRoundTiles = 2;

inline int64_t OnePassCost(int64_t resident_blocks, int64_t batch, int64_t tiles, int64_t teams) {
  const int64_t team_blocks = resident_blocks / teams;
  return ((batch + teams - 1) / teams) *
         ((tiles + team_blocks - 1) / team_blocks + kOnePassRoundTiles);
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
