"""Sharding rule for the FP8 quantize FFI call (see jaxfuse/_src/sharding.py).

* Blocks along K only ("block_1d", 1 x 128, and "mxfp8", 1 x 32): every row has its own
  scales, so rows (x's leading dimensions, and scale_inv's) may be sharded; K and the
  scale columns stay replicated (a block must not be split).
* Current scaling ("per_tensor", "per_group"): the scale comes from the amax of the whole
  tensor (or of each group of rows). A device holding a block of rows would need a global
  amax (a pmax over the row shards) *before* quantizing, and the handler computes its amax
  itself from the rows it sees, so x is kept replicated: Shardy gathers sharded rows
  first. (A partitioned version would take the amax as an operand: a handler change.)
* "block_2d" (128 x 128 tiles of [R, K]): tiles span rows; x is kept replicated.
"""

from __future__ import annotations

from jaxfuse._src import sharding
from jaxfuse._src.ops.quantize import ffi

_ROW_MODES = ("block_1d", "mxfp8")
_MAX_RANK = 8


def _rule(attrs, in_ranks, out_ranks):
  rows = sharding.leading("b", in_ranks[0] - 1)
  mode = attrs["scaling_mode"]
  if mode in _ROW_MODES:
    scale = [*rows, "s"]
  elif mode == "block_2d":
    scale = [*rows[:-1], "sr", "sk"]
  else:
    scale = ["g"]
  assert len(scale) == out_ranks[1], (mode, scale, out_ranks)
  return [[*rows, "k"], ["o"]], [[*rows, "k"], scale]


_by_rows = sharding.partitioned(ffi.quantize, _rule, replicated=("k", "o", "s"))
_replicated = sharding.partitioned(
    ffi.quantize, _rule,
    replicated=("k", "o", "s", "g", "sr", "sk", *sharding.leading("b", _MAX_RANK)))


def quantize(x, offsets, *, scaling_mode, block, fmt):
  fn = _by_rows if scaling_mode in _ROW_MODES else _replicated
  return fn(x, offsets, scaling_mode=scaling_mode, block=int(block), fmt=fmt)
