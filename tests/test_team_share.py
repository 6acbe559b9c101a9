"""The team tile scheduler's partition of work units (cuda/include/jaxfuse/team_share.h,
used by cuda/gpu/grouped_gemm/team_tile_scheduler.cuh): compiled for the host with the
system's C++ compiler and checked exhaustively on small grids. A unit walked twice would
compute a tile twice (harmless), a unit never walked would leave output tiles unwritten,
so every unit below the total must be walked exactly once, for any cluster, team and unit
count, and the shares must stay balanced. The GPU test
test_team_tile_scheduler_matches_float64_numpy_and_cutlass_order checks the kernels."""

from __future__ import annotations

from tests import helpers

# Walks every (clusters, teams, units) of a grid and prints the first violation, or "ok".
_DRIVER = r"""
#include <cstdint>
#include <cstdio>
#include <vector>
#include "jaxfuse/team_share.h"

int main() {
  const uint64_t unit_counts[] = {0, 1, 2, 5, 63, 64, 65, 127, 128, 1000, 4096, 8191};
  for (uint64_t clusters = 1; clusters <= 140; ++clusters)
    for (uint64_t teams = 0; teams <= 70; ++teams)
      for (uint64_t units : unit_counts) {
        std::vector<int> walked(units, 0);
        uint64_t most = 0, least = ~uint64_t{0};
        for (uint64_t cluster = 0; cluster < clusters; ++cluster) {
          const jaxfuse::TeamShare share = jaxfuse::TeamShareOf(cluster, clusters, teams, units);
          if (share.stride == 0) {
            std::printf("stride 0: clusters=%llu teams=%llu units=%llu cluster=%llu\n",
                        (unsigned long long)clusters, (unsigned long long)teams,
                        (unsigned long long)units, (unsigned long long)cluster);
            return 1;
          }
          uint64_t count = 0;
          // One team has no end of its own: the scheduler stops past the last unit.
          for (uint64_t unit = share.first; unit < share.end && unit < units; unit += share.stride) {
            ++walked[unit];
            ++count;
          }
          most = count > most ? count : most;
          least = count < least ? count : least;
        }
        for (uint64_t unit = 0; unit < units; ++unit)
          if (walked[unit] != 1) {
            std::printf("unit %llu walked %d times: clusters=%llu teams=%llu units=%llu\n",
                        (unsigned long long)unit, walked[unit], (unsigned long long)clusters,
                        (unsigned long long)teams, (unsigned long long)units);
            return 1;
          }
        // Proportional shares: a team of S clusters gets about S/clusters of the units, so
        // no cluster walks more than two units beyond another.
        if (most > least + 2) {
          std::printf("unbalanced (%llu vs %llu units): clusters=%llu teams=%llu units=%llu\n",
                      (unsigned long long)most, (unsigned long long)least,
                      (unsigned long long)clusters, (unsigned long long)teams,
                      (unsigned long long)units);
          return 1;
        }
      }
  // Past the clusters, teams are clamped to one per cluster.
  const jaxfuse::TeamShare many = jaxfuse::TeamShareOf(3, 66, 1000, 4096);
  const jaxfuse::TeamShare one_each = jaxfuse::TeamShareOf(3, 66, 66, 4096);
  if (many.first != one_each.first || many.stride != 1 || many.end != one_each.end) {
    std::printf("teams past the clusters not clamped\n");
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
"""


def test_every_unit_is_walked_exactly_once_by_balanced_shares(tmp_path):
  result = helpers.run_host_driver(_DRIVER, tmp_path, "team_share_driver")
  assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout
