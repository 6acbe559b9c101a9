"""Pure-jnp specification of grouped_linear (the "xla" implementation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
