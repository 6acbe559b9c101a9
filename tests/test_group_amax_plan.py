"""GroupAmaxKernel's rows per block (cuda/include/jaxfuse/group_amax_plan.h, used by the
per-group amax pass in cuda/gpu/quantize.cu), compiled for the host with the system's C++
compiler and checked on a grid of row counts, row widths and resident-block counts: at
least one row; no more than ~64 KB a block (the kernel's two rounds of loads) unless one row
is larger; no less than ~8 KB where 64 KB allows it; as close to an even share of the
resident blocks as those bounds allow; a forced count returned as it is. The GPU test
test_group_amax_rows_per_block_change_no_bit checks that any split gives the same amaxes."""

from __future__ import annotations

from tests import helpers

_DRIVER = r"""
#include <cstdint>
#include <cstdio>
#include "jaxfuse/group_amax_plan.h"

int Fail(const char* what, long long rows, long long row_bytes, long long resident) {
  std::printf("%s: rows=%lld row_bytes=%lld resident=%lld\n", what, rows, row_bytes, resident);
  return 1;
}

int main() {
  const long long row_counts[] = {0, 1, 7, 301, 2048, 6000, 40000, 65536, 1LL << 24};
  const long long widths[] = {2, 16, 128, 2048, 4096, 8190, 8192, 8194, 65536, 65538, 1 << 20};
  const long long residents[] = {1, 132, 1056, 2112};
  for (long long rows : row_counts)
    for (long long row_bytes : widths)
      for (long long resident : residents) {
        const long long got = jaxfuse::GroupAmaxRowsPerBlock(rows, row_bytes, resident);
        const long long most = row_bytes >= 65536 ? 1 : 65536 / row_bytes;
        const long long least = row_bytes >= 8192 ? 1 : (8192 + row_bytes - 1) / row_bytes;
        if (got < 1) return Fail("no rows a block", rows, row_bytes, resident);
        if (got > most) return Fail("more than 64 KB a block", rows, row_bytes, resident);
        if (got < least) return Fail("less than 8 KB a block", rows, row_bytes, resident);
        const long long share = rows / resident;
        if (share >= least && share <= most && got != share)
          return Fail("not the resident blocks' share", rows, row_bytes, resident);
        if (jaxfuse::GroupAmaxRowsPerBlock(rows, row_bytes, resident, 3) != 3)
          return Fail("a forced count changed", rows, row_bytes, resident);
      }
  // The measured shapes on an H100's 1056 resident blocks (132 SMs x 8): the T=2048 grouped
  // MLP's x and dy (2048 rows of 1024 bf16) four rows, 8 KB, a block; its T=65536 x (65536
  // rows of 2048 bf16) 16 rows, 64 KB.
  if (jaxfuse::GroupAmaxRowsPerBlock(2048, 2048, 1056) != 4) return Fail("T=2048", 2048, 2048, 1056);
  if (jaxfuse::GroupAmaxRowsPerBlock(65536, 4096, 1056) != 16) return Fail("T=65536", 65536, 4096, 1056);
  std::printf("ok\n");
  return 0;
}
"""


def test_rows_per_block_stay_within_8_to_64_kb(tmp_path):
  result = helpers.run_host_driver(_DRIVER, tmp_path, "group_amax_plan_driver")
  assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout
