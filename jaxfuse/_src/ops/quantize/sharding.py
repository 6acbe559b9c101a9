"""Sharding rules for the FP8 quantize FFI calls (see jaxfuse/_src/sharding.py).

``quantize``:

* Blocks along K only ("block_1d", 1 x 128, and "mxfp8", 1 x 32): every row has its own
  scales, so rows (x's leading dimensions, and scale_inv's) may be sharded; K and the
  scale columns stay replicated (a block must not be split).
* Current scaling ("per_tensor", "per_group"): every dimension of x may be sharded. The
  scale comes from the amax of the whole tensor (or of each group of rows), so a device
  holding a block of x computes the amax of its block per group, the amaxes are combined
  with ``pmax`` over the mesh axes sharding x (a [G] float32 all-reduce), and the block is
  quantized with the global scale: the result is bit-identical to the unsharded op.
  group offsets describe the rows of the *whole* x viewed as [rows, K] (global row
  numbers); each device derives the global row number of its rows from its shard position
  (``jax.lax.axis_index``), so offsets stay replicated and mean the same as unsharded.
  The handler computes the amax from the rows it sees and has no "given scale" operand,
  so each device hands it its rows plus one row per group holding the global amax (see
  ``quantize_current_local``): the scales and FP8 values are the kernel's own. Cost: the
  per-group amax in jnp, and a float32 copy of the block laid out by group (and the FP8
  rows gathered back) around the kernel. Unsharded, the kernel runs alone.
* "block_2d" (128 x 128 tiles of [R, K]): tiles span rows; x is kept replicated.

``batch_amax`` (x [B, R, C] -> amax float32 [B]): B may be sharded with no communication;
a sharded R or C gives each device its block's amax, combined with ``pmax``.
``quantize_transposed`` (x [B, R, C] -> data [B, C, R] with a given amax [B]): every
dimension may be sharded; each device quantizes its block with the given (global) amax,
so nothing is communicated.
``quantize_batches_transposed`` (the same with the amax found by the op): B may be sharded
with no communication; a sharded R or C runs ``batch_amax``, ``pmax`` and
``quantize_transposed`` on each device's block (bit-identical).
``quantize_blocks_transposed`` (x [B, R, C] -> data [B, C, R], one scale per 128 x 128
tile): B may be sharded with no communication; R and C are kept replicated (a shard
boundary inside a tile would split its amax, and uneven shards would shift the tiles).

``scaled_activation_quantize`` / ``scaled_dactivation_quantize``: rows may be sharded (x,
scales, dy, dx, dscales and the data keep the row sharding). The feature dimension may be
sharded for "srelu" (elementwise) under current scaling (dscales is then a per-device
partial summed with ``psum``); gated activations pair feature j with j + F/2 and blocks
must not be split, so otherwise features stay replicated. Block scaling / MXFP8: each
device runs the fused kernel on its rows. Current scaling with a sharded dimension: each
device computes the activation (or its gradient) of its block in float32 with the
scaled_activation kernels (the same per-element math as the fused kernels, so the same
values), then amax, ``pmax`` and quantization as above. That writes the float32 values
(and their copy by group) besides the fused two-pass kernel chain's work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse._src import sharding
from jaxfuse._src.ops.quantize import ffi
from jaxfuse._src.ops.scaled_activation import ffi as act_ffi

_ROW_MODES = ("block_1d", "mxfp8")
_CURRENT = ("per_tensor", "per_group")
_MAX_RANK = 8
_ROW_FACTORS = tuple(sharding.leading("b", _MAX_RANK))


def quantize_current_local(values, offsets, factor_axes, row_factors, col_factor, fmt):
  """(data, scale_inv [G]) of a block of float32 values [..., K] with the global amax.

  Runs inside a partitioned computation: `factor_axes` says which mesh axes shard each
  dimension (rows: `row_factors`, columns: `col_factor`); `offsets` int32 [G + 1] are in
  global row numbers.

  1. Each row's group from its global row number; the block's amax per group (jnp; exact,
     a max involves no rounding); ``pmax`` over the mesh axes sharding the values.
  2. The quantize kernel itself computes the scales and FP8 values, so they are the
     kernel's bit for bit (no second implementation of the scale division): the block's
     rows are laid out by group with one extra row per group holding the global amax
     right after the group's rows (then every group's amax as the kernel sees it is the
     global one), and the kernel runs per group on that [rows + G, K] array; the extra
     rows are dropped.
  """
  shape = values.shape
  k = shape[-1]
  flat = values.reshape(-1, k).astype(jnp.float32)
  # Padding rows (uneven blocks) get the id total_rows: no group, no amax.
  row_ids, total_rows = sharding.global_row_ids(shape[:-1], factor_axes, row_factors)
  num_groups = offsets.shape[0] - 1
  clamped = jnp.clip(offsets, 0, total_rows)
  group = jnp.searchsorted(clamped[1:], row_ids, side="right").astype(jnp.int32)
  cols = sharding.global_index(k, factor_axes, col_factor)
  # Padding columns are zeroed (they would count in the kernel's amax).
  flat = jnp.where(cols < sharding.global_size(k, factor_axes, col_factor), flat, 0.0)
  row_amax = jnp.max(jnp.where(jnp.isnan(flat), 0.0, jnp.abs(flat)), axis=1, initial=0.0)
  amax = jax.ops.segment_max(row_amax, group, num_segments=num_groups + 1)[:num_groups]
  amax = jnp.maximum(amax, 0.0)
  axes = (sharding.all_axes(factor_axes, row_factors)
          + tuple(factor_axes.get(col_factor, ())))
  if axes:
    amax = jax.lax.pmax(amax, axes)
  # Rows by group (stable), group g's amax row after its rows, rows of no group last.
  rows = flat.shape[0]
  order = jnp.argsort(group, stable=True)
  rank = jnp.zeros((rows,), jnp.int32).at[order].set(jnp.arange(rows, dtype=jnp.int32))
  position = rank + group
  counts = jnp.zeros((num_groups + 1,), jnp.int32).at[group].add(1)
  ends = jnp.cumsum(counts)[:num_groups].astype(jnp.int32)  # rows of groups <= g
  steps = jnp.arange(num_groups, dtype=jnp.int32)
  amax_rows = jnp.zeros((num_groups, k), jnp.float32).at[:, 0].set(amax)
  augmented = jnp.zeros((rows + num_groups, k), jnp.float32)
  augmented = augmented.at[position].set(flat).at[ends + steps].set(amax_rows)
  aug_offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends + steps + 1])
  data, scale_inv = ffi.quantize(augmented, aug_offsets, scaling_mode="per_group", block=0,
                                 fmt=fmt)
  return data[position].reshape(shape), scale_inv


# --- quantize --------------------------------------------------------------------------


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


def _current_local(factor_axes, x, offsets, *, scaling_mode, block, fmt):
  del scaling_mode, block
  rows = sharding.leading("b", x.ndim - 1)
  return quantize_current_local(x.astype(jnp.float32), offsets, factor_axes, rows, "k", fmt)


_by_rows = sharding.partitioned(ffi.quantize, _rule, replicated=("k", "o", "s"))
_current = sharding.partitioned(ffi.quantize, _rule, replicated=("o", "g"),
                                summed=(*_ROW_FACTORS, "k"), local=_current_local,
                                local_factors=True)
_replicated = sharding.partitioned(
    ffi.quantize, _rule,
    replicated=("k", "o", "s", "g", "sr", "sk", *_ROW_FACTORS))


def quantize(x, offsets, *, scaling_mode, block, fmt):
  if scaling_mode in _ROW_MODES:
    fn = _by_rows
  elif scaling_mode in _CURRENT:
    fn = _current
  else:
    fn = _replicated
  return fn(x, offsets, scaling_mode=scaling_mode, block=int(block), fmt=fmt)


# --- scaled_activation_quantize ------------------------------------------------------------


def _features(attrs):
  """(input, output) feature factors: shared (shardable) only for srelu, current scaling."""
  if attrs["activation"] == "srelu" and attrs["scaling_mode"] in _CURRENT:
    return "f", "f"
  return "w", "f"


def _scale_factors(attrs, rows):
  mode = attrs["scaling_mode"]
  return ["g"] if mode in _CURRENT else [*rows, "s"]


def _act_rule(attrs, in_ranks, out_ranks):
  del out_ranks
  rows = sharding.leading("b", in_ranks[0] - 1)
  f_in, f_out = _features(attrs)
  return ([[*rows, f_in], rows, ["o"]], [[*rows, f_out], _scale_factors(attrs, rows)])


def _act_attrs(attrs):
  return {k: attrs[k] for k in ("activation", "limit", "alpha", "linear_offset")}


def _act_local(factor_axes, x, scales, offsets, **attrs):
  rows = sharding.leading("b", x.ndim - 1)
  # The fused kernel's values: act(x) * scale in float32 (same per-element math).
  values = act_ffi.forward(x.astype(jnp.float32), scales.astype(jnp.float32),
                           **_act_attrs(attrs))
  return quantize_current_local(values, offsets, factor_axes, rows, "f", attrs["fmt"])


def _dact_rule(attrs, in_ranks, out_ranks):
  rows = sharding.leading("b", in_ranks[1] - 1)
  f_in, f_out = _features(attrs)
  del out_ranks
  dx = [*rows, f_in] if attrs["return_dx"] else ["z"]
  return ([[*rows, f_out], [*rows, f_in], rows, ["o"]],
          [[*rows, f_in], _scale_factors(attrs, rows), dx, rows])


def _dact_local(factor_axes, dy, x, scales, offsets, **attrs):
  rows = sharding.leading("b", x.ndim - 1)
  dx32, dscales = act_ffi.backward(dy.astype(jnp.float32), x.astype(jnp.float32),
                                   scales.astype(jnp.float32), **_act_attrs(attrs))
  feature_axes = tuple(factor_axes.get("f", ()))
  if feature_axes:  # srelu with sharded features: per-device partial sums of each row
    dscales = jax.lax.psum(dscales, feature_axes)
  data, scale_inv = quantize_current_local(dx32, offsets, factor_axes, rows,
                                           _features(attrs)[0], attrs["fmt"])
  dx = dx32.astype(x.dtype) if attrs["return_dx"] else jnp.zeros((0,), x.dtype)
  return data, scale_inv, dx, dscales


def _act_call(x, scales, offsets, **attrs):
  return ffi.scaled_activation_quantize(x, scales, offsets, **attrs)


def _dact_call(dy, x, scales, offsets, **attrs):
  data, scale_inv, dx, dscales = ffi.scaled_dactivation_quantize(dy, x, scales, offsets,
                                                                 **attrs)
  if dx is None:
    dx = jnp.zeros((0,), x.dtype)
  return data, scale_inv, dx, dscales


_ACT_REPLICATED = ("w", "o", "s", "g", "z")
_act_by_rows = sharding.partitioned(_act_call, _act_rule, replicated=("f", *_ACT_REPLICATED))
_act_current = sharding.partitioned(_act_call, _act_rule, replicated=_ACT_REPLICATED,
                                    summed=(*_ROW_FACTORS, "f"), local=_act_local,
                                    local_factors=True)
_dact_by_rows = sharding.partitioned(_dact_call, _dact_rule,
                                     replicated=("f", *_ACT_REPLICATED))
_dact_current = sharding.partitioned(_dact_call, _dact_rule, replicated=_ACT_REPLICATED,
                                     summed=(*_ROW_FACTORS, "f"), local=_dact_local,
                                     local_factors=True)


def _static(attrs):
  out = dict(attrs)
  for key in ("limit", "alpha", "linear_offset"):
    out[key] = float(out[key])
  out["block"] = int(out["block"])
  return out


def scaled_activation_quantize(x, scales, offsets, **attrs):
  fn = _act_current if attrs["scaling_mode"] in _CURRENT else _act_by_rows
  return fn(x, scales, offsets, **_static(attrs))


def scaled_dactivation_quantize(dy, x, scales, offsets, **attrs):
  """(data, scale_inv, dx or None, dscales float32), as ffi.scaled_dactivation_quantize."""
  fn = _dact_current if attrs["scaling_mode"] in _CURRENT else _dact_by_rows
  attrs = _static(attrs)
  attrs["return_dx"] = bool(attrs["return_dx"])
  data, scale_inv, dx, dscales = fn(dy, x, scales, offsets, **attrs)
  return data, scale_inv, (dx if attrs["return_dx"] else None), dscales


# --- batch_amax ------------------------------------------------------------------------


def _amax_rule(attrs, in_ranks, out_ranks):
  del attrs, in_ranks, out_ranks
  return [["b", "r", "c"]], [["b"]]


def _amax_local(reduce_axes, x):
  return jax.lax.pmax(ffi.batch_amax(x), reduce_axes)


_batch_amax = sharding.partitioned(ffi.batch_amax, _amax_rule, reduction=("r", "c"),
                                   local=_amax_local)


def batch_amax(x):
  """ffi.batch_amax with its sharding rule: a sharded R or C gives each device the amax of
  its block, combined with ``pmax`` (what XLA does for the jnp reduction)."""
  return _batch_amax(x)


# --- quantize_transposed ---------------------------------------------------------------


def _transposed_rule(attrs, in_ranks, out_ranks):
  del in_ranks, out_ranks
  straight = ["b", "r", "c"] if attrs["untransposed"] else ["z"]
  return [["b", "r", "c"], ["b"]], [["b", "c", "r"], ["b"], straight]


_transposed = sharding.partitioned(ffi.quantize_transposed, _transposed_rule,
                                   replicated=("z",))


def quantize_transposed(x, amax, *, fmt, untransposed=False):
  """ffi.quantize_transposed with its sharding rule (purely local); the untransposed copy
  is None unless asked for."""
  data, scale_inv, straight = _transposed(x, amax.astype(jnp.float32), fmt=fmt,
                                          untransposed=bool(untransposed))
  return data, scale_inv, straight if untransposed else None


# --- quantize_batches_transposed -------------------------------------------------------


def _batches_rule(attrs, in_ranks, out_ranks):
  del in_ranks, out_ranks
  straight = ["b", "r", "c"] if attrs["untransposed"] else ["z"]
  return [["b", "r", "c"]], [["b", "c", "r"], ["b"], straight]


def _batches_local(reduce_axes, x, *, fmt, untransposed):
  amax = jax.lax.pmax(ffi.batch_amax(x), reduce_axes)
  return ffi.quantize_transposed(x, amax, fmt=fmt, untransposed=untransposed)


# R and C are in every result but scale_inv, which reduces over them: "summed" factors.
_batches_transposed = sharding.partitioned(ffi.quantize_batches_transposed, _batches_rule,
                                           replicated=("z",), summed=("r", "c"),
                                           local=_batches_local)


def quantize_batches_transposed(x, *, fmt, untransposed=False):
  """ffi.quantize_batches_transposed with its sharding rule (B local; a sharded R or C
  combines the devices' amaxes with ``pmax``); the untransposed copy is None unless asked
  for."""
  data, scale_inv, straight = _batches_transposed(x, fmt=fmt, untransposed=bool(untransposed))
  return data, scale_inv, straight if untransposed else None


# --- quantize_blocks_transposed --------------------------------------------------------


def _blocks_transposed_rule(attrs, in_ranks, out_ranks):
  del in_ranks, out_ranks
  straight = ["b", "r", "c"] if attrs["untransposed"] else ["z"]
  return [["b", "r", "c"]], [["b", "c", "r"], ["b", "sr", "sc"], straight]


_blocks_transposed = sharding.partitioned(ffi.quantize_blocks_transposed,
                                          _blocks_transposed_rule,
                                          replicated=("r", "c", "sr", "sc", "z"))


def quantize_blocks_transposed(x, *, fmt, untransposed=False):
  """ffi.quantize_blocks_transposed with its sharding rule (B sharded, R and C
  replicated); the untransposed copy is None unless asked for."""
  data, scale_inv, straight = _blocks_transposed(x, fmt=fmt, untransposed=bool(untransposed))
  return data, scale_inv, straight if untransposed else None
