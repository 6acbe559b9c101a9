"""Pure-jnp specification of FP8 quantization (the "xla" implementation).

The FP8 rounding is ``clip(v, -fp8_max, fp8_max).astype(float8_*)``: round to nearest
even, saturating to the largest finite value, NaN kept. The CPU handler (jaxfuse/fp8.h)
and the CUDA kernels (cvt.rn.satfinite) store identical bits; tests check it.

Scale rules (jaxfuse/fp8.h):
  current / block scaling: scale = fp8_max / amax, 1 when amax is 0 or inf (never inf or
    NaN); scale_inv = 1 / scale. amax ignores NaN elements (they are stored as NaN).
  MXFP8: E8M0 exponent e = ceil(log2(amax / fp8_max)) + 127 (127 when amax is 0 or inf),
    clamped to [0, 254]; elements are multiplied by 2^(127 - e).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse.quantization import recipes
from jaxfuse._src.ops.scaled_activation import reference as act_reference

FLT_MAX = float(np.finfo(np.float32).max)


def _abs_for_amax(v):
  return jnp.where(jnp.isnan(v), 0.0, jnp.abs(v))


def scale_from_amax(amax, fp8_max):
  ok = (amax > 0) & (amax <= FLT_MAX)
  scale = jnp.where(ok, fp8_max / jnp.where(ok, amax, 1.0), 1.0)
  return jnp.minimum(scale, FLT_MAX).astype(jnp.float32)


def e8m0_from_amax(amax, fp8_max):
  ratio = (amax / fp8_max).astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(ratio, jnp.uint32)
  exponent = (bits >> 23) & 0xFF
  exponent = exponent + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)
  exponent = jnp.minimum(exponent, 254)
  exponent = jnp.where((amax > 0) & (amax <= FLT_MAX), exponent, 127)
  return exponent.astype(jnp.uint8)


def e8m0_to_float(biased):
  biased = biased.astype(jnp.uint32)
  bits = jnp.where(biased == 0, jnp.uint32(0x00400000), biased << 23)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def to_fp8(v, fmt):
  fp8_max = recipes.FP8_MAX[fmt]
  return jnp.clip(v, -fp8_max, fp8_max).astype(recipes.FP8_DTYPES[fmt])


def group_of_rows(offsets, rows):
  """Group index per row (G for rows past offsets[G]), offsets clamped into [0, rows]."""
  clamped = jnp.clip(offsets, 0, rows)
  return jnp.searchsorted(clamped[1:], jnp.arange(rows, dtype=jnp.int32), side="right")


def _pad_last(v, multiple, axis=-1):
  size = v.shape[axis]
  pad = (-size) % multiple
  if pad == 0:
    return v
  widths = [(0, 0)] * v.ndim
  widths[axis] = (0, pad)
  return jnp.pad(v, widths)


def quantize_values(v, scaling_mode: str, block: int, offsets, fmt: str):
  """(data, scale_inv) for fp32 values v [..., K] ([..., R, K] for block_2d)."""
  v = v.astype(jnp.float32)
  fp8_max = recipes.FP8_MAX[fmt]
  k = v.shape[-1]
  if scaling_mode in ("per_tensor", "per_group"):
    rows = int(np.prod(v.shape[:-1]))
    flat = v.reshape(rows, k)
    if scaling_mode == "per_tensor":
      offsets = jnp.asarray([0, rows], jnp.int32)
    num_groups = offsets.shape[0] - 1
    group = group_of_rows(offsets, rows)
    row_amax = jnp.max(_abs_for_amax(flat), axis=1, initial=0.0)
    amax = jax.ops.segment_max(row_amax, group, num_segments=num_groups + 1)[:num_groups]
    amax = jnp.maximum(amax, 0.0)
    scale = scale_from_amax(amax, fp8_max)
    row_scale = jnp.concatenate([scale, jnp.ones((1,), jnp.float32)])[group]
    data = to_fp8(flat * row_scale[:, None], fmt)
    data = jnp.where((group < num_groups)[:, None], data, jnp.zeros_like(data))
    return data.reshape(v.shape), (1.0 / scale).astype(jnp.float32)
  if scaling_mode in ("block_1d", "mxfp8"):
    nb = -(-k // block)
    padded = _pad_last(v, block).reshape(*v.shape[:-1], nb, block)
    amax = jnp.max(_abs_for_amax(padded), axis=-1, initial=0.0)
    if scaling_mode == "mxfp8":
      e = e8m0_from_amax(amax, fp8_max)
      scale, scale_inv = e8m0_to_float(254 - e), e
    else:
      scale = scale_from_amax(amax, fp8_max)
      scale_inv = (1.0 / scale).astype(jnp.float32)
    data = to_fp8(padded * scale[..., None], fmt).reshape(*v.shape[:-1], nb * block)[..., :k]
    return data, scale_inv
  if scaling_mode == "block_2d":
    r = v.shape[-2]
    nr, nc = -(-r // block), -(-k // block)
    padded = _pad_last(_pad_last(v, block, -1), block, -2)
    tiles = padded.reshape(*v.shape[:-2], nr, block, nc, block)
    amax = jnp.max(_abs_for_amax(tiles), axis=(-3, -1), initial=0.0)
    scale = scale_from_amax(amax, fp8_max)
    data = to_fp8(tiles * scale[..., :, None, :, None], fmt)
    data = data.reshape(*v.shape[:-2], nr * block, nc * block)[..., :r, :k]
    return data, (1.0 / scale).astype(jnp.float32)
  raise ValueError(f"unknown scaling mode {scaling_mode!r}")


def dequantize(q) -> jax.Array:
  """data.astype(f32) * scale_inv (broadcast by scaling mode), in the original dtype."""
  return dequantize_float32(q).astype(q.dtype)


def dequantize_float32(q) -> jax.Array:
  """data.astype(f32) * scale_inv (broadcast by scaling mode), kept in float32 (what the
  blockwise GEMMs multiply: one fp32 product per value, no 16-bit rounding)."""
  data = q.data.astype(jnp.float32)
  mode, block = q.scaling_mode, q.block_size
  if mode == "per_tensor":
    out = data * q.scale_inv[0]
  elif mode == "per_group":
    rows = int(np.prod(data.shape[:-1]))
    num_groups = q.scale_inv.shape[0]
    group = group_of_rows(q.group_offsets, rows)
    row_scale = jnp.concatenate([q.scale_inv, jnp.zeros((1,), jnp.float32)])[group]
    out = (data.reshape(rows, -1) * row_scale[:, None]).reshape(data.shape)
  elif mode in ("block_1d", "mxfp8"):
    scale_inv = e8m0_to_float(q.scale_inv) if mode == "mxfp8" else q.scale_inv
    out = data * jnp.repeat(scale_inv, block, axis=-1)[..., :data.shape[-1]]
  elif mode == "per_expert":  # quantize_experts: data [G, N, K] of a kernel [G, K, N]
    out = jnp.swapaxes(data * q.scale_inv[:, None, None], 1, 2)
  elif mode == "per_kernel":  # quantize_kernel: data [N, K] of a dense kernel [K, N]
    out = (data * q.scale_inv[0]).T
  elif mode in ("block_2d", "expert_block_2d"):
    out = dequantize_tiles(data, q.scale_inv, block)
    if mode == "expert_block_2d":  # quantize_experts: data [G, N, K] of a kernel [G, K, N]
      out = jnp.swapaxes(out, 1, 2)
  else:
    raise ValueError(f"unknown scaling mode {mode!r}")
  return out


def dequantize_tiles(data, scale_inv, block: int) -> jax.Array:
  """float32 data [..., R, C] times the scale_inv [..., ceil(R/block), ceil(C/block)] of its
  block x block tiles (the 2-D block scaling modes)."""
  scale = jnp.repeat(jnp.repeat(scale_inv, block, axis=-1), block, axis=-2)
  return data.astype(jnp.float32) * scale[..., :data.shape[-2], :data.shape[-1]]


def scaled_activation_quantize(x, scales, offsets, activation, limit, alpha, linear_offset,
                               scaling_mode, block, fmt):
  """Quantizes act(x) * scales in fp32 (no intermediate rounding to x's dtype)."""
  act = act_reference.activation_f32(x, activation, limit, alpha, linear_offset)
  values = act * scales.astype(jnp.float32)[..., None]
  return quantize_values(values, scaling_mode, block, offsets, fmt)


def scaled_dactivation_quantize(dy, x, scales, offsets, activation, limit, alpha, linear_offset,
                                scaling_mode, block, fmt):
  """(data, scale_inv, dx fp32, dscales fp32) of the fused backward pass."""
  dx, dscales = act_reference.scaled_activation_backward_f32(dy, x, scales, activation, limit,
                                                             alpha, linear_offset)
  data, scale_inv = quantize_values(dx, scaling_mode, block, offsets, fmt)
  return data, scale_inv, dx, dscales


def quantize_columnwise_blocks(x, offsets, fmt: str):
  """(data FP8 [C, W], scale_inv float32 [S, C]) of ffi.quantize_columnwise_blocks for
  x [M, C] and offsets int32 [G + 1] (any values; traceable), W = columnwise_width(M, G),
  S = columnwise_scale_rows(M, G).

  Every scale slot s is block j of group g (s = columnwise_scale_row(c_g, g) + j, with the
  clamped offsets c_g) or no block's. The slots' rows, transposed, are the rows of one
  [S * C, 128] array (a block's values of column i, zeros past the block and for slots of
  no block), quantized by block_1d (quantize_values, block 128), so each (block, column) is
  literally the 1 x 128 block quantization and slots of no block get scale_inv 1. Their
  bytes are then scattered to the copy's columns and the columns into the blocked storage
  of cuda/include/jaxfuse/columnwise.h (int32 indices: C * W < 2^31).
  """
  from jaxfuse._src.ops.quantize import ffi as quantize_ffi  # layout helpers (no cycle)

  block = quantize_ffi.COLUMNWISE_SCALE_BLOCK
  m, c = x.shape
  groups = offsets.shape[0] - 1
  width = quantize_ffi.columnwise_width(m, groups)
  slots = quantize_ffi.columnwise_scale_rows(m, groups)
  clamped = jax.lax.cummax(jnp.clip(offsets.astype(jnp.int32), 0, m))
  group_ids = jnp.arange(groups, dtype=jnp.int32)
  first_slot = quantize_ffi.columnwise_scale_row(clamped[:-1], group_ids)  # increasing
  slot = jnp.arange(slots, dtype=jnp.int32)
  g = jnp.searchsorted(first_slot, slot, side="right").astype(jnp.int32) - 1  # -1: before g 0
  g_in = jnp.clip(g, 0, groups - 1)
  j = slot - first_slot[g_in]
  begin_row, end_row = clamped[g_in], clamped[g_in + 1]
  live = (g >= 0) & (j < (end_row - begin_row + block - 1) // block)
  rows = (begin_row + block * j)[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]
  valid = live[:, None] & (rows < end_row[:, None])  # [S, 128]
  if m == 0:
    values = jnp.zeros((slots, block, c), jnp.float32)
  else:
    values = jnp.where(valid[..., None], x.astype(jnp.float32)[jnp.clip(rows, 0, m - 1)], 0.0)
  data, scale_inv = quantize_values(jnp.swapaxes(values, 1, 2), "block_1d", block, None, fmt)
  # data [S, C, 128] -> the copy's columns [C, W]: slot s's byte p of column i at copy column
  # columnwise_start(c_g, g) + 128 j + p (dropped where not valid).
  codes = jax.lax.bitcast_convert_type(data, jnp.uint8)
  column = quantize_ffi.columnwise_start(begin_row, g_in)[:, None] + (rows - begin_row[:, None])
  column = jnp.where(valid, column, width)
  columns = jnp.zeros((c, width), jnp.uint8).at[:, column.reshape(-1)].set(
      jnp.moveaxis(codes, 1, 0).reshape(c, slots * block), mode="drop")
  # Blocked storage: column col of block b (begins[b] <= col < begins[b + 1]), row i at
  # c * begins[b] + i * (begins[b + 1] - begins[b]) + col - begins[b].
  group_starts = quantize_ffi.columnwise_start(clamped[1:],
                                               jnp.arange(1, groups + 1, dtype=jnp.int32))
  begins = jnp.concatenate([jnp.zeros((1,), jnp.int32), group_starts,
                            jnp.full((1,), width, jnp.int32)])  # [G + 2]: blocks 0 .. G, W
  col = jnp.arange(width, dtype=jnp.int32)
  b = jnp.searchsorted(begins[:-1], col, side="right").astype(jnp.int32) - 1
  lo, hi = begins[b], begins[b + 1]
  i = jnp.arange(c, dtype=jnp.int32)[:, None]
  flat = c * lo[None, :] + i * (hi - lo)[None, :] + (col - lo)[None, :]
  stored = jnp.zeros((c * width,), jnp.uint8).at[flat.reshape(-1)].set(columns.reshape(-1))
  data_out = jax.lax.bitcast_convert_type(stored.reshape(c, width), recipes.FP8_DTYPES[fmt])
  return data_out, scale_inv[..., 0]
