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
