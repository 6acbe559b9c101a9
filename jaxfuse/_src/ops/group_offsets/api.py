"""Public group_offsets and the internal multi-output variant."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._src import implementation as implementation_lib
from jaxfuse._src.ops.group_offsets import sharding
from jaxfuse._src.ops.group_offsets import reference

INT32_LIMIT = 2**31


def check_group_sizes(group_sizes, name: str = "group_sizes") -> None:
  try:
    dtype = jnp.dtype(jnp.result_type(group_sizes))
  except TypeError as error:
    raise TypeError(f"{name} must be an array, got {type(group_sizes).__name__}") from error
  if dtype != jnp.int32:
    raise TypeError(f"{name} must have dtype int32, got {dtype}")
  if np.ndim(group_sizes) != 1:
    raise ValueError(f"{name} must have rank 1 ([G]), got shape {np.shape(group_sizes)}")


def group_offsets(group_sizes: jax.Array, *, implementation: str | None = None) -> jax.Array:
  """Exclusive prefix sum of group sizes with a leading zero, on the device.

  Args:
    group_sizes: int32 [G] (device data; negative sizes count as zero).
    implementation: None, "ffi" or "xla"; see the ``jaxfuse`` module docs.

  Returns:
    int32 [G + 1]: ``[0, s0, s0 + s1, ..., sum(s)]``. On GPU one kernel launch (one block,
    a block-wide scan looping over chunks of 1024 groups).
  """
  check_group_sizes(group_sizes)
  if implementation_lib.resolve(implementation) == "xla":
    return reference.group_offsets(group_sizes)
  return sharding.group_offsets_multi(group_sizes, (1,), (jnp.int32,), None)[0]


def offsets_dtype(stride: int, row_capacity: int | None):
  """int64 where int32 could overflow: row_capacity * stride >= 2**31 (unknown rows: stride > 1)."""
  if row_capacity is None:
    return jnp.dtype(jnp.int32) if stride == 1 else jnp.dtype(jnp.int64)
  return jnp.dtype(jnp.int64) if row_capacity * stride >= INT32_LIMIT else jnp.dtype(jnp.int32)


def group_offsets_multi(group_sizes: jax.Array, strides, *, row_capacity: int | None = None,
                        implementation: str | None = None) -> tuple:
  """Several offset arrays from one launch, each scaled by its own stride (internal).

  Like TransformerEngine's splits_to_offsets_multi: ``out[k][g] = min(rows[g], row_capacity)
  * strides[k]`` with ``rows = group_offsets(group_sizes)``, e.g. strides ``(1, K)`` for row
  offsets and element offsets. Each output's dtype is chosen from a static bound: int64
  when ``row_capacity * stride >= 2**31`` (without a capacity: int64 for strides > 1),
  else int32. ``row_capacity`` (the number of rows of the grouped operand) clamps the row
  offsets so they never exceed it, as the grouped GEMM needs.
  """
  check_group_sizes(group_sizes)
  strides = tuple(int(s) for s in strides)
  if not strides or any(s < 1 for s in strides):
    raise ValueError(f"strides must be positive integers, got {strides}")
  if row_capacity is not None:
    row_capacity = int(row_capacity)
    if row_capacity < 0:
      raise ValueError(f"row_capacity must be >= 0, got {row_capacity}")
  dtypes = tuple(offsets_dtype(s, row_capacity) for s in strides)
  if implementation_lib.resolve(implementation) == "xla":
    return reference.group_offsets_multi(group_sizes, strides, dtypes, row_capacity)
  return sharding.group_offsets_multi(group_sizes, strides, dtypes, row_capacity)
