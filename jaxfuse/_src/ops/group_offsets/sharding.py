"""Sharding rule for the group offsets FFI call (see jaxfuse/_src/sharding.py).

A prefix sum over all groups: group_sizes and the offsets are replicated (they are tiny;
a sharded group_sizes is gathered first). Declaring the rule keeps the call itself from
being treated as an opaque op whose operands must be gathered to every device along with
whatever XLA decides around it.
"""

from __future__ import annotations

from jaxfuse._src import sharding
from jaxfuse._src.ops.group_offsets import ffi


def _rule(attrs, in_ranks, out_ranks):
  del attrs, in_ranks
  return [["g"]], [["o"]] * len(out_ranks)


_group_offsets_multi = sharding.partitioned(ffi.group_offsets_multi, _rule,
                                            replicated=("g", "o"))


def group_offsets_multi(group_sizes, strides, dtypes, row_capacity) -> tuple:
  return _group_offsets_multi(group_sizes, strides=tuple(int(s) for s in strides),
                              dtypes=tuple(dtypes), row_capacity=row_capacity)
