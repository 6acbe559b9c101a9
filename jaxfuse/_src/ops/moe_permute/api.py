"""Public moe_permute / moe_unpermute: drop-less token permutation for MoE layers.

``moe_permute`` sorts the T*k (token, expert) copies by expert (a stable ``argsort`` in
jnp gives the order; the row copy is the kernel) and returns the group sizes the grouped
GEMMs need; ``moe_unpermute`` gathers each token's k rows back and sums them with the
combine weights (fp32 accumulation; each output token sums its own rows, so no atomics and
the result is deterministic).

Gradients (custom_vjp, one kernel each):
  permute:               d_x = unpermute(d_x_sorted, row_map)           (unweighted)
  unpermute, no weights: d_y_sorted = permute(d_out, row_map)
  unpermute, weights:    d_y_sorted[row_map[t, j]] = w[t, j] * d_out[t],
                         d_w[t, j] = <y_sorted[row_map[t, j]], d_out[t]>
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._src import checks
from jaxfuse._src import compat
from jaxfuse._src import implementation as implementation_lib
from jaxfuse._src.ops.moe_permute import sharding
from jaxfuse._src.ops.moe_permute import reference


def _check_row_map(row_map) -> None:
  dtype = checks.dtype_of("row_map", row_map)
  if dtype != jnp.dtype(jnp.int32) or np.ndim(row_map) != 2:
    raise TypeError(f"row_map must be int32 [T, k] (from moe_permute), got {dtype} "
                    f"{np.shape(row_map)}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _permute_rows(x, row_map, varying_axes):
  del varying_axes
  return sharding.permute(x, row_map)


def _permute_fwd(x, row_map, varying_axes):
  del varying_axes
  return sharding.permute(x, row_map), row_map


def _permute_bwd(varying_axes, row_map, d_sorted):
  ones = jnp.ones(row_map.shape, jnp.float32)
  d_x = sharding.unpermute(d_sorted, row_map, ones)
  return compat.match_varying_axes(d_x, varying_axes), None


_permute_rows.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _unpermute_unweighted(y_sorted, row_map, varying_axes):
  del varying_axes
  return sharding.unpermute(y_sorted, row_map, jnp.ones(row_map.shape, jnp.float32))


def _unpermute_unweighted_fwd(y_sorted, row_map, varying_axes):
  del varying_axes
  out = sharding.unpermute(y_sorted, row_map, jnp.ones(row_map.shape, jnp.float32))
  return out, row_map


def _unpermute_unweighted_bwd(varying_axes, row_map, d_out):
  d_y = sharding.permute(d_out, row_map)
  return compat.match_varying_axes(d_y, varying_axes), None


_unpermute_unweighted.defvjp(_unpermute_unweighted_fwd, _unpermute_unweighted_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _unpermute_weighted(y_sorted, row_map, weights, varying_axes):
  del varying_axes
  return sharding.unpermute(y_sorted, row_map, weights)


def _unpermute_weighted_fwd(y_sorted, row_map, weights, varying_axes):
  del varying_axes
  return sharding.unpermute(y_sorted, row_map, weights), (y_sorted, row_map, weights)


def _unpermute_weighted_bwd(varying_axes, saved, d_out):
  y_sorted, row_map, weights = saved
  d_y, d_w = sharding.unpermute_backward(d_out.astype(y_sorted.dtype), y_sorted, row_map, weights)
  y_axes, _, w_axes = varying_axes
  return (compat.match_varying_axes(d_y, y_axes), None, compat.match_varying_axes(d_w, w_axes))


_unpermute_weighted.defvjp(_unpermute_weighted_fwd, _unpermute_weighted_bwd)


def moe_routing(expert_indices: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
  """(row_map int32 [T, k], group_sizes int32 [E]) for top-k expert ids [T, k].

  row_map[t, j] is the row of the expert-sorted order holding copy j of token t (stable
  sort: within an expert, tokens keep their order). Ids outside [0, num_experts) sort last
  and belong to no group.
  """
  dtype = checks.dtype_of("expert_indices", expert_indices)
  if not jnp.issubdtype(dtype, jnp.integer) or np.ndim(expert_indices) != 2:
    raise TypeError(f"expert_indices must be an integer [T, k] array, got {dtype} "
                    f"{np.shape(expert_indices)}")
  if not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
    raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
  return reference.routing(expert_indices, int(num_experts))


def moe_permute(x: jax.Array, expert_indices: jax.Array, num_experts: int, *,
                implementation: str | None = None):
  """Token copies in expert-contiguous order, drop-less (no capacity, every copy kept).

  Args:
    x: [T, H] float32, bfloat16 or float16.
    expert_indices: integer [T, k], the experts each token goes to (top-k routing).
    num_experts: E (static).
    implementation: None, "ffi" or "xla".

  Returns:
    (x_sorted [T*k, H], row_map int32 [T, k], group_sizes int32 [E]): x_sorted[row_map[t, j]]
    = x[t]; rows of expert e are contiguous, experts in order; pass group_sizes to the
    grouped GEMMs and row_map to ``moe_unpermute``.

  Differentiable in x (the backward pass is an unweighted unpermute).
  """
  checks.check_float_array("x", x)
  checks.check_rank("x", x, 2, "[T, H]")
  row_map, group_sizes = moe_routing(expert_indices, num_experts)
  if row_map.shape[0] != x.shape[0]:
    raise ValueError(f"expert_indices must have x's {x.shape[0]} tokens as first dimension, "
                     f"got {tuple(expert_indices.shape)}")
  if implementation_lib.resolve(implementation) == "xla":
    return reference.permute(x, row_map), row_map, group_sizes
  return _permute_rows(x, row_map, compat.varying_axes(x)), row_map, group_sizes


def moe_unpermute(y_sorted: jax.Array, row_map: jax.Array, combine_weights=None, *,
                  implementation: str | None = None) -> jax.Array:
  """Each token's k rows gathered back and summed: out[t] = sum_j w[t, j] * y[row_map[t, j]].

  Args:
    y_sorted: [T*k, H] float32, bfloat16 or float16 in expert order.
    row_map: int32 [T, k] from ``moe_permute`` (entries outside [0, T*k) count as zero rows).
    combine_weights: [T, k] float (e.g. router probabilities), or None for unit weights
      (when the weights were already applied, e.g. as grouped_mlp's activation scales).
    implementation: None, "ffi" or "xla".

  Returns:
    [T, H] in y_sorted's dtype; fp32 accumulation over the k rows, one rounding.

  Differentiable in y_sorted and combine_weights.
  """
  checks.check_float_array("y_sorted", y_sorted)
  checks.check_rank("y_sorted", y_sorted, 2, "[T*k, H]")
  _check_row_map(row_map)
  tokens, topk = row_map.shape
  if y_sorted.shape[0] != tokens * topk:
    raise ValueError(f"y_sorted must have T*k = {tokens * topk} rows (row_map is "
                     f"{tuple(row_map.shape)}), got {tuple(y_sorted.shape)}")
  if combine_weights is not None:
    checks.check_float_array("combine_weights", combine_weights)
    if tuple(combine_weights.shape) != tuple(row_map.shape):
      raise ValueError(f"combine_weights must have row_map's shape {tuple(row_map.shape)}, "
                       f"got {tuple(combine_weights.shape)}")
  if implementation_lib.resolve(implementation) == "xla":
    return reference.unpermute(y_sorted, row_map, combine_weights)
  if combine_weights is None:
    return _unpermute_unweighted(y_sorted, row_map, compat.varying_axes(y_sorted))
  weights = combine_weights.astype(jnp.float32)
  varying_axes = tuple(compat.varying_axes(a) for a in (y_sorted, row_map, weights))
  return _unpermute_weighted(y_sorted, row_map, weights, varying_axes)
