"""The one-pass per-batch quantization's plan (cuda/include/jaxfuse/one_pass_plan.h, used by
QuantizeBatchesOnePassKernel in cuda/gpu/quantize.cu), compiled for the host with the
system's C++ compiler and checked on a grid of resident-block, tile-cap, batch and tile
counts. A tile no block holds would never be quantized, a tile held twice would be written
twice with one block's view of the amax, and a block holding more than tiles_per_block
would overrun its shared memory; a grid larger than what is resident would deadlock at the
team's counter. The plan must also give a block the least work (rounds of batches x (tiles
held + a round's fixed part)) of any team count that fits. The GPU test
test_one_pass_batch_quantization_matches_the_cpu_bit_for_bit checks the kernel."""

from __future__ import annotations

from tests import helpers

_DRIVER = r"""
#include <cstdint>
#include <cstdio>
#include <vector>
#include "jaxfuse/one_pass_plan.h"

int Fail(const char* what, long long resident, int max_tiles, long long batch, long long tiles) {
  std::printf("%s: resident=%lld max_tiles=%d batch=%lld tiles=%lld\n", what, resident,
              max_tiles, batch, tiles);
  return 1;
}

int main() {
  const long long residents[] = {0, 1, 2, 3, 7, 64, 132, 264};
  const int caps[] = {0, 1, 2, 3, 6};
  const long long batches[] = {0, 1, 2, 5, 64, 300};
  const long long tile_counts[] = {0, 1, 2, 5, 6, 24, 131, 132, 133, 256, 320, 791, 792, 793, 2000};
  for (long long resident : residents)
    for (int cap : caps)
      for (long long batch : batches)
        for (long long tiles : tile_counts) {
          const jaxfuse::OnePassPlan plan = jaxfuse::PlanOnePass(resident, cap, batch, tiles);
          const bool fits = resident > 0 && cap > 0 && batch > 0 && tiles > 0 &&
                            tiles <= resident * cap;
          if (!fits) {
            if (plan.teams != 0) return Fail("a plan where none fits", resident, cap, batch, tiles);
            continue;
          }
          if (plan.teams < 1) return Fail("no plan where one fits", resident, cap, batch, tiles);
          if (plan.teams > batch) return Fail("more teams than batches", resident, cap, batch, tiles);
          if ((long long)plan.teams * plan.team_blocks > resident)
            return Fail("more blocks than resident", resident, cap, batch, tiles);
          if (plan.tiles_per_block < 1 || plan.tiles_per_block > cap)
            return Fail("tiles_per_block outside 1 .. cap", resident, cap, batch, tiles);
          // At most one idle team's worth of blocks left out: every resident block is used
          // unless the teams do not divide them.
          if (resident - (long long)plan.teams * plan.team_blocks >= plan.teams)
            return Fail("blocks left idle", resident, cap, batch, tiles);
          // No feasible team count (each team's blocks can hold the tiles) costs a block less
          // than the plan: rounds x (tiles held + 2 tiles' worth of a round's fixed part).
          const auto cost = [&](long long teams) {
            const long long blocks = resident / teams;
            return ((batch + teams - 1) / teams) * ((tiles + blocks - 1) / blocks + 2);
          };
          for (long long teams = 1; teams <= batch && teams <= resident; ++teams)
            if ((resident / teams) * cap >= tiles && cost(teams) < cost(plan.teams))
              return Fail("a team count with less work a block", resident, cap, batch, tiles);
          std::vector<int> held_by(tiles, 0);
          for (int rank = 0; rank < plan.team_blocks; ++rank) {
            const int held = jaxfuse::OnePassTilesHeld(rank, tiles, plan.team_blocks,
                                                       plan.tiles_per_block);
            if (held < 0 || held > plan.tiles_per_block)
              return Fail("a block holds too many tiles", resident, cap, batch, tiles);
            for (int i = 0; i < held; ++i) {
              const long long t = rank + (long long)i * plan.team_blocks;
              if (t >= tiles) return Fail("a held tile past the last", resident, cap, batch, tiles);
              ++held_by[t];
            }
          }
          for (long long t = 0; t < tiles; ++t)
            if (held_by[t] != 1) return Fail("a tile not held exactly once", resident, cap, batch, tiles);
        }
  // The issue's shapes on 132 blocks of 6 tiles: DeepSeek FC1 (16 x 22 tiles) in 2 teams of
  // 66 blocks; a grouped-MLP FC1 expert (16 x 32) in one team of all 132; the T=2048 grouped
  // MLP's FC1 (8 experts of 8 x 16 tiles) in 4 teams of 33 blocks holding 4 tiles, 2 rounds
  // (not 6 teams of 22 holding 6: 6 experts, then 2 with 4 teams idle; what the most-teams
  // plan gives); DeepSeek-like FC2 (64 batches of 11 x 16 tiles) in 4 teams of 33 blocks
  // holding 6, 16 rounds (measured faster than 3 teams holding 4 in 22 rounds).
  struct Expected {
    const char* name;
    long long batch, tiles;
    bool most_teams_only;
    int teams, team_blocks, tiles_per_block;
  };
  const Expected expected[] = {{"DeepSeek FC1", 64, 352, false, 2, 66, 6},
                               {"grouped MLP FC1", 8, 512, false, 1, 132, 4},
                               {"small grouped MLP FC1", 8, 128, false, 4, 33, 4},
                               {"DeepSeek FC2", 64, 176, false, 4, 33, 6},
                               {"small FC1, most teams", 8, 128, true, 6, 22, 6}};
  for (const Expected& e : expected) {
    const jaxfuse::OnePassPlan plan =
        jaxfuse::PlanOnePass(132, 6, e.batch, e.tiles, e.most_teams_only);
    if (plan.teams != e.teams || plan.team_blocks != e.team_blocks ||
        plan.tiles_per_block != e.tiles_per_block) {
      std::printf("unexpected %s plan: %d %d %d\n", e.name, plan.teams, plan.team_blocks,
                  plan.tiles_per_block);
      return 1;
    }
  }
  std::printf("ok\n");
  return 0;
}
"""


def test_every_tile_is_held_once_by_a_resident_team(tmp_path):
  result = helpers.run_host_driver(_DRIVER, tmp_path, "one_pass_plan_driver")
  assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout
