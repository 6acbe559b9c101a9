"""Pure-jnp specification of the MoE token permutation (the "xla" implementation).

A routing of T tokens to k experts each is described by ``row_map`` int32 [T, k]: the row
of the expert-sorted order that holds copy j of token t (a permutation of [0, T*k)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def routing(expert_indices: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
  """(row_map int32 [T, k], group_sizes int32 [E]) of a top-k assignment.

  Copies are sorted by expert with a stable sort of the flattened [T*k] expert ids, so
  within an expert tokens keep their order. Ids outside [0, num_experts) sort after every
  expert and are in no group (the grouped GEMMs leave such rows at zero).
  """
  tokens, topk = expert_indices.shape
  flat = expert_indices.reshape(-1).astype(jnp.int32)
  flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  rows = tokens * topk
  row_map = jnp.zeros((rows,), jnp.int32).at[order].set(jnp.arange(rows, dtype=jnp.int32))
  group_sizes = expert_counts(flat, num_experts)
  return row_map.reshape(tokens, topk), group_sizes


def expert_counts(indices, num_experts: int, dtype=jnp.int32):
  """[E] number of entries of `indices` equal to each expert id (ids outside [0, E) count
  for none). A compare-and-sum over [N, E]: XLA fuses it into one reduction, where a
  scatter-add of N ones into E bins serializes on atomics (29-48 us for 98304 ids into 64
  bins on the H200)."""
  flat = indices.reshape(-1, 1)
  return jnp.sum(flat == jnp.arange(num_experts, dtype=flat.dtype), axis=0, dtype=dtype)


def permute(x: jax.Array, row_map: jax.Array) -> jax.Array:
  """out[row_map[t, j]] = x[t]: [T, H] -> [T*k, H] (entries outside [0, T*k) dropped)."""
  tokens, topk = row_map.shape
  copies = jnp.repeat(x, topk, axis=0)
  out = jnp.zeros((tokens * topk, x.shape[1]), x.dtype)
  return out.at[row_map.reshape(-1)].set(copies, mode="drop")


def unpermute(y_sorted: jax.Array, row_map: jax.Array,
              combine_weights: jax.Array | None = None) -> jax.Array:
  """out[t] = sum_j w[t, j] * y_sorted[row_map[t, j]] in fp32, rounded once to y's dtype."""
  rows = jnp.take(y_sorted, row_map, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
  if combine_weights is None:
    out = jnp.sum(rows, axis=1)
  else:
    out = jnp.einsum("tkh,tk->th", rows, combine_weights.astype(jnp.float32))
  return out.astype(y_sorted.dtype)
