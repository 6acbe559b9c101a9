"""Per-group FP8 quantization of gathered rows: an MoE layer's tokens in expert order.

The expert-sorted rows of an MoE layer are copies of its tokens: row r is
``tokens[source_rows[r]]``. Quantizing them per group (per expert) with current scaling
normally takes the 16-bit sorted copy (the permutation writes it, the amax pass and the
quantizing pass read it). Here neither pass needs it:

* A group's amax is the max of its rows' amaxes, and a row's amax is its token's: one
  reduction over the T tokens (``token_amax``, k times fewer bytes than the sorted rows),
  a gather of T*k floats and a segment max (``group_amax``).
* The quantizing pass reads each row straight from the tokens (``ffi.quantize_gathered``:
  the CUDA kernel's producer follows source_rows) and writes the FP8 rows and, for the FP8
  wgrad, their column-wise copy.

The result has the very bytes of ``quantize(tokens[source_rows], group_offsets=offsets)``
(maxima are exact in any order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse._src.ops.quantize import columnwise
from jaxfuse._src.ops.quantize import ffi
from jaxfuse.quantization import recipes


def token_amax(tokens: jax.Array) -> jax.Array:
  """[T, K] float -> float32 [T]: max |tokens[t]| with NaN counted as 0 (as the quantize
  kernels' amax, jaxfuse/fp8.h's AbsForAmax); 0 for K = 0."""
  magnitude = jnp.abs(tokens.astype(jnp.float32))
  return jnp.max(jnp.where(jnp.isnan(magnitude), 0.0, magnitude), axis=-1, initial=0.0)


def source_rows_of(row_map: jax.Array) -> jax.Array:
  """int32 [T, k] row_map (row of copy j of token t, a permutation of [0, T*k)) -> int32
  [T*k]: the token each expert-sorted row copies."""
  tokens, topk = row_map.shape
  rows = tokens * topk
  token_of_copy = jnp.arange(rows, dtype=jnp.int32) // topk
  return jnp.zeros((rows,), jnp.int32).at[row_map.reshape(-1)].set(token_of_copy, mode="drop")


def group_amax(per_source_amax: jax.Array, source_rows: jax.Array,
               offsets: jax.Array) -> jax.Array:
  """float32 [G]: the max over group g's rows r (offsets[g] <= r < offsets[g + 1], offsets
  int32 [G + 1] clamped to the M rows as the kernels clamp them) of
  per_source_amax[source_rows[r]]; 0 for an empty group. Rows of no group count for none.

  A compare-and-max over [M, G] that XLA fuses into one reduction: a segment max (a
  scatter-max of M values into G bins) serializes on atomics, 61 us per call at the
  DeepSeek-like layer's 98304 rows and 64 experts on an H100
  (benchmarks/results/profile_kernels_s43_*)."""
  rows = source_rows.shape[0]
  row_amax = jnp.take(per_source_amax, source_rows, mode="clip")
  bounds = jnp.clip(offsets, 0, rows)
  starts, ends = bounds[:-1], jnp.maximum(bounds[:-1], bounds[1:])
  row = jnp.arange(rows, dtype=offsets.dtype)[:, None]
  inside = (row >= starts[None, :]) & (row < ends[None, :])
  return jnp.max(jnp.where(inside, row_amax[:, None], 0.0), axis=0, initial=0.0)


def quantize_gathered_rows(tokens, source_rows, offsets, recipe, role: str, *, copy: bool):
  """tokens [T, K] gathered to [M, K] by source_rows and quantized per group (offsets int32
  [G + 1]) in the recipe's format for `role` ("forward" or "gradient"): (data FP8 [M, K],
  scale_inv float32 [G], the FP8 wgrad's operand: a columnwise.Columnwise copy with
  ``copy``, else the (data, scale_inv) pair), as columnwise.quantize_rows returns for the
  gathered 16-bit rows. Not differentiable (stop_gradient: the callers' custom_vjp)."""
  tokens = jax.lax.stop_gradient(tokens)
  amax = group_amax(token_amax(tokens), source_rows, offsets)
  out = ffi.quantize_gathered(tokens, source_rows, offsets, amax,
                              fmt=recipes.fp8_format(recipe, role), columnwise=copy)
  if copy:
    data, scale_inv, columns = out
    return data, scale_inv, columnwise.Columnwise(columns, scale_inv)
  data, scale_inv = out
  return data, scale_inv, (data, scale_inv)
