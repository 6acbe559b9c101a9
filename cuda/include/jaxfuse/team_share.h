// The work units one cluster of a persistent grid walks under the team tile scheduler
// (cuda/gpu/grouped_gemm/team_tile_scheduler.cuh). Shared by the kernel and a host test
// (tests/test_team_share.py), which checks that every unit is walked exactly once.
#pragma once

#include <cstdint>

#include "jaxfuse/platform.h"

namespace jaxfuse {

// Cluster `cluster` walks the units first, first + stride, first + 2 stride, ... below end.
struct TeamShare {
  uint64_t first;
  uint64_t stride;
  uint64_t end;
};

// `clusters` clusters split into `teams` teams (at most one per cluster): team k owns the
// clusters [p_k, p_{k+1}), p_k = floor(k clusters / teams), and the units
// [floor(units p_k / clusters), floor(units p_{k+1} / clusters)), each team's share
// proportional to its clusters; cluster p_k + s walks its team's units s, s + S, ... (S
// clusters in the team). One team is CUTLASS's order: unit `cluster` and every `clusters`-th
// after it, with no end (its caller stops past the last group). Needs clusters >= 1 and
// units * clusters < 2^64.
JAXFUSE_HOST_DEVICE TeamShare TeamShareOf(uint64_t cluster, uint64_t clusters, uint64_t teams,
                                          uint64_t units) {
  if (teams > clusters) teams = clusters;
  if (teams <= 1) return TeamShare{cluster, clusters, ~uint64_t{0}};
  const uint64_t team = ((cluster + 1) * teams - 1) / clusters;
  const uint64_t team_first = team * clusters / teams;
  const uint64_t team_end = (team + 1) * clusters / teams;
  return TeamShare{units * team_first / clusters + (cluster - team_first),
                   team_end - team_first, units * team_end / clusters};
}

}  // namespace jaxfuse
