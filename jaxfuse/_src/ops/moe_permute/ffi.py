"""ffi_call wrappers for the MoE permutation handlers (cuda/cpu/moe_permute.cc,
cuda/gpu/moe_permute.cu). None needs scratch space."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse._src import compat
from jaxfuse._src import ffi as ffi_registry


def permute(x: jax.Array, row_map: jax.Array) -> jax.Array:
  """out [T*k, H] with out[row_map[t, j]] = x[t]."""
  ffi_registry.ensure_registered()
  tokens, topk = row_map.shape
  out_type = jax.ShapeDtypeStruct((tokens * topk, x.shape[1]), x.dtype)
  out = jax.ffi.ffi_call("jaxfuse_moe_permute", out_type, vmap_method="sequential")(x, row_map)
  return compat.vary_like(out, x, row_map)


def unpermute(y_sorted: jax.Array, row_map: jax.Array, weights: jax.Array) -> jax.Array:
  """out [T, H] = sum_j weights[t, j] * y_sorted[row_map[t, j]] (weights float32 [T, k])."""
  ffi_registry.ensure_registered()
  out_type = jax.ShapeDtypeStruct((row_map.shape[0], y_sorted.shape[1]), y_sorted.dtype)
  out = jax.ffi.ffi_call("jaxfuse_moe_unpermute", out_type, vmap_method="sequential")(
      y_sorted, row_map, weights)
  return compat.vary_like(out, y_sorted, row_map, weights)


def unpermute_backward(d_out, y_sorted, row_map, weights):
  """(d_y_sorted [T*k, H] in y's dtype, d_weights float32 [T, k]) from one kernel."""
  ffi_registry.ensure_registered()
  out_types = (jax.ShapeDtypeStruct(y_sorted.shape, y_sorted.dtype),
               jax.ShapeDtypeStruct(row_map.shape, jnp.float32))
  d_y, d_w = jax.ffi.ffi_call("jaxfuse_moe_unpermute_bwd", out_types,
                              vmap_method="sequential")(d_out, y_sorted, row_map, weights)
  inputs = (d_out, y_sorted, row_map, weights)
  return compat.vary_like(d_y, *inputs), compat.vary_like(d_w, *inputs)
