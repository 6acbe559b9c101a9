"""Pure-jnp specification of grouped_linear (the "xla" implementation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._src.ops.quantize.kernels import gradient_target
from jaxfuse._src.ops.quantize.kernels import is_quantized_kernel


def clamped_offsets(group_sizes: jax.Array, rows: int) -> jax.Array:
  """int32 [G + 1]: where each group's rows start, negative sizes as zero, cut at `rows`."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), rows)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends.astype(jnp.int32)])


def grouped_linear(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """Rows of group g times kernel[g], like ``jax.lax.ragged_dot``.

  x [M, K], kernel [G, K, N], group_sizes int [G] -> [M, N] in x's dtype, accumulated in
  fp32. Negative sizes count as zero; sizes summing past M are cut at M; rows past the
  last group are zero.
  """
  offsets = clamped_offsets(group_sizes, x.shape[0])
  sizes = jnp.diff(offsets)
  out = jax.lax.ragged_dot(x, kernel, sizes, preferred_element_type=jnp.float32)
  return out.astype(x.dtype)


# --- FP8 (Float8CurrentScaling(per_group=True)) ----------------------------------------


def expert_offsets(groups: int, rows_per_expert: int) -> jax.Array:
  """int32 [G + 1] = rows_per_expert * arange(G + 1): one quantization group per expert."""
  return jnp.asarray(np.arange(groups + 1, dtype=np.int64) * rows_per_expert, jnp.int32)


def quantize_experts_t(kernel: jax.Array, recipe, implementation: str,
                       untransposed: bool = False):
  """Per-expert quantization of kernel^T in the forward format.

  kernel [G, K, N] -> (data [G, N, K] (K-major, the layout the FP8 forward kernel takes),
  scale_inv float32 [G]): kernel^T viewed as [G * N, K] quantized per group of N rows, so
  expert g gets one scale from its own amax. With ``untransposed`` a third result: the
  same FP8 values as [G, K, N] (the layout the FP8 dgrad takes), from the same pass.
  """
  from jaxfuse._src.ops.quantize import api as quantize_api  # pylint: disable=g-import-not-at-top
  groups, _, n = kernel.shape
  if implementation == "ffi":
    # The same values as the path below, without XLA's transpose and a second amax pass.
    return quantize_api.quantize_batches_transposed(kernel, recipe.forward_format,
                                                    untransposed=untransposed)
  # [G, N, K] quantized as G * N rows (no reshape, so a sharded N stays sharded).
  kernel_t = jnp.swapaxes(kernel, 1, 2)
  q = quantize_api.quantize(kernel_t, recipe, group_offsets=expert_offsets(groups, n),
                            role="forward", implementation=implementation)
  if untransposed:
    return q.data, q.scale_inv, jnp.swapaxes(q.data, 1, 2)
  return q.data, q.scale_inv


def expert_weights(kernel, recipe, implementation: str, untransposed: bool = False):
  """(data [G, N, K], scale_inv [G], and with `untransposed` data [G, K, N]): the FP8
  weights the grouped GEMMs read, quantized now from a 16-bit kernel (quantize_experts_t)
  or, for a ``quantize_experts`` result, as they are (their gradient is stopped; a
  trainable one's [G, K, N] copy is its own, written by the same pass)."""
  if not is_quantized_kernel(kernel):
    return quantize_experts_t(kernel, recipe, implementation, untransposed=untransposed)
  data, scale_inv = (jax.lax.stop_gradient(a) for a in (kernel.data, kernel.scale_inv))
  if not untransposed:
    return data, scale_inv
  straight = kernel.data_untransposed
  straight = jnp.swapaxes(data, 1, 2) if straight is None else jax.lax.stop_gradient(straight)
  return data, scale_inv, straight


def quantize_rows(value: jax.Array, recipe, offsets: jax.Array, role: str,
                  implementation: str):
  """Per-group (rows offsets[g]:offsets[g+1]) quantization: (data, scale_inv [G])."""
  from jaxfuse._src.ops.quantize import api as quantize_api  # pylint: disable=g-import-not-at-top
  q = quantize_api.quantize(value, recipe, group_offsets=offsets, role=role,
                            implementation=implementation)
  return q.data, q.scale_inv


def fp8_products(a_data, a_scale_inv, w_t_data, w_scale_inv, offsets):
  """What the FP8 forward kernel computes before its bfloat16 rounding.

  a_data: FP8 [M, K] with a_scale_inv float32 [G] per group of rows; w_t_data: FP8
  [G, N, K] with w_scale_inv float32 [G]; offsets: int32 [G + 1], non-decreasing, within
  [0, M]. Returns (float32 [M, N]: exact FP8 products summed in fp32 times
  a_scale_inv[g] * w_scale_inv[g], zero for rows past the groups; each row's group, G for
  those rows).
  """
  m = a_data.shape[0]
  row_group = jnp.searchsorted(offsets[1:], jnp.arange(m, dtype=jnp.int32), side="right")
  alpha = jnp.concatenate([a_scale_inv * w_scale_inv, jnp.zeros((1,), jnp.float32)])
  exact = jax.lax.ragged_dot(a_data.astype(jnp.float32),
                             jnp.swapaxes(w_t_data, 1, 2).astype(jnp.float32),
                             jnp.diff(offsets), precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
  return exact * alpha[row_group][:, None], row_group


def grouped_linear_fp8(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array,
                       recipe) -> jax.Array:
  """The FP8 forward as the kernels compute it.

  x is quantized to E4M3 with one scale per group of rows, kernel with one scale per
  expert; exact products of the FP8 values are accumulated in fp32, multiplied by
  x_scale_inv[g] * kernel_scale_inv[g] and rounded once to bfloat16 (then cast to x's
  dtype, as the FFI path does).

  Gradients pass straight through the quantization (d(dequantized x)/dx = 1): the
  gradients are those of the product of the dequantized operands. The FFI backward
  quantizes the output gradient instead (E5M2 dgrad and, with recipe.fp8_wgrad, FP8 wgrad).
  `kernel` may be a ``quantize_experts`` QuantizedArray: its FP8 values are used as they
  are, and it gets no gradient unless it is trainable (then its master does).
  """
  m = x.shape[0]
  offsets = clamped_offsets(group_sizes, m)
  sizes = jnp.diff(offsets)
  x_data, x_scale_inv = quantize_rows(x, recipe, offsets, "forward", "xla")
  w_t_data, w_scale_inv = expert_weights(kernel, recipe, "xla")
  w_data = jnp.swapaxes(w_t_data, 1, 2).astype(jnp.float32)
  exact, row_group = fp8_products(x_data, x_scale_inv, w_t_data, w_scale_inv, offsets)
  # The straight-through path, whose gradient the result carries (none for a frozen
  # quantized kernel: a constant).
  x_scale_row = jnp.concatenate([x_scale_inv, jnp.ones((1,), jnp.float32)])[row_group]
  x_st = _straight_through(x, x_data.astype(jnp.float32) * x_scale_row[:, None])
  w_dequantized = w_data * w_scale_inv[:, None, None]
  target = gradient_target(kernel)  # the kernel, a trainable copy's master, or None
  w_st = w_dequantized if target is None else _straight_through(target, w_dequantized)
  through = jax.lax.ragged_dot(x_st, w_st, sizes, precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
  out = through + jax.lax.stop_gradient(exact - through)
  return out.astype(jnp.bfloat16).astype(x.dtype)


def _straight_through(value, dequantized):
  value = value.astype(jnp.float32)
  return value + jax.lax.stop_gradient(dequantized - value)


# --- Blockwise FP8 (Float8BlockScaling) ------------------------------------------------------


def expert_block_weights(kernel, recipe, implementation: str, untransposed: bool = False):
  """The FP8 weights of the blockwise grouped GEMMs: one scale per 128 x 128 tile.

  kernel [G, K, N] (16-bit) -> ((w_t [G, N, K], w_t_scale_inv float32 [G, ceil(N/128),
  ceil(K/128)]) for the forward, and with `untransposed` (w [G, K, N], w_scale_inv
  [G, ceil(K/128), ceil(N/128)]) for the dgrad, else None). A tile's amax does not depend
  on its orientation, so one quantization gives both layouts: on the FFI path one kernel
  pass writes them (``quantize_blocks_transposed``); the XLA path quantizes [G, K, N] and
  transposes. A ``quantize_experts`` result (scaling_mode "expert_block_2d") is used as it
  is (its gradient stopped; a trainable one's [G, K, N] copy is its own).
  """
  from jaxfuse._src.ops.quantize import api as quantize_api  # pylint: disable=g-import-not-at-top
  from jaxfuse._src.ops.quantize import sharding as quantize_sharding  # pylint: disable=g-import-not-at-top
  if is_quantized_kernel(kernel):
    w_t, w_t_scale_inv = (jax.lax.stop_gradient(a) for a in (kernel.data, kernel.scale_inv))
    if not untransposed:
      return (w_t, w_t_scale_inv), None
    w = kernel.data_untransposed
    w = jnp.swapaxes(w_t, 1, 2) if w is None else jax.lax.stop_gradient(w)
    return (w_t, w_t_scale_inv), (w, jnp.swapaxes(w_t_scale_inv, 1, 2))
  if implementation == "ffi":
    w_t, w_scale_inv, w = quantize_sharding.quantize_blocks_transposed(
        kernel, fmt=recipe.forward_format, untransposed=untransposed)
  else:
    q = quantize_api.quantize(kernel, recipe, kind="weight", role="forward",
                              implementation=implementation)
    w_t, w_scale_inv, w = jnp.swapaxes(q.data, 1, 2), q.scale_inv, q.data
  forward = (w_t, jnp.swapaxes(w_scale_inv, 1, 2))
  return forward, ((w, w_scale_inv) if untransposed else None)


def grouped_linear_blockwise(x: jax.Array, kernel, group_sizes: jax.Array,
                             recipe) -> jax.Array:
  """The blockwise FP8 forward as the kernels compute it (DeepSeek-V3's recipe).

  x is quantized to E4M3 in 1 x 128 blocks along K, kernel [G, K, N] in 128 x 128 tiles;
  the products of the dequantized values (each FP8 value times its block's scale) are
  accumulated in fp32 and rounded once to bfloat16, then cast to x's dtype. Rows past the
  groups are zero. Gradients pass straight through the quantization (the gradients of the
  product of the dequantized operands); the FFI backward quantizes the output gradient for
  its dgrad instead and runs a 16-bit wgrad. `kernel` may be a ``quantize_experts``
  result: its FP8 tiles are used as they are, and it gets no gradient unless it is
  trainable (then its master does).
  """
  from jaxfuse._src.ops.quantize import api as quantize_api  # pylint: disable=g-import-not-at-top
  from jaxfuse._src.ops.quantize import reference as quantize_reference  # pylint: disable=g-import-not-at-top
  offsets = clamped_offsets(group_sizes, x.shape[0])
  q_x = quantize_api.quantize(x, recipe, role="forward", implementation="xla")
  (w_t, w_t_scale_inv), _ = expert_block_weights(kernel, recipe, "xla")
  w_dequantized = jnp.swapaxes(
      quantize_reference.dequantize_tiles(w_t, w_t_scale_inv, recipe.block_size), 1, 2)
  x_st = _straight_through(x, quantize_reference.dequantize_float32(q_x))
  target = gradient_target(kernel)  # the kernel, a trainable copy's master, or None
  w_st = w_dequantized if target is None else _straight_through(target, w_dequantized)
  out = jax.lax.ragged_dot(x_st, w_st, jnp.diff(offsets), precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
  return out.astype(jnp.bfloat16).astype(x.dtype)
