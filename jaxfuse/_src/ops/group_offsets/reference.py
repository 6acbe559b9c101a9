"""Pure-jnp specification of group_offsets (the "xla" implementation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_offsets(group_sizes: jax.Array) -> jax.Array:
  """int32 [G] -> int32 [G + 1]: [0, s0, s0 + s1, ...], negative sizes counted as zero."""
  sizes = jnp.maximum(group_sizes, 0).astype(jnp.int32)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes, dtype=jnp.int32)])


def group_offsets_multi(group_sizes: jax.Array, strides, dtypes, row_capacity) -> tuple:
  """One offsets array per stride: min(row offsets, row_capacity) * stride, in its dtype."""
  rows = group_offsets(group_sizes)
  wide = any(jnp.dtype(d) == jnp.int64 for d in dtypes)
  if wide and not jax.config.jax_enable_x64:
    raise NotImplementedError(
        "group_offsets_multi: the reference (implementation='xla') can only produce int64 "
        "offsets with jax_enable_x64; use implementation='ffi'")
  if row_capacity is not None:
    rows = jnp.minimum(rows, row_capacity)
  return tuple(rows.astype(dtype) * jnp.asarray(stride, dtype)
               for stride, dtype in zip(strides, dtypes))
