"""Sharding rules for the MoE permutation FFI calls (see jaxfuse/_src/sharding.py).

What the routing indices mean under sharding: ``row_map[t, j]`` is always a *global* row
of the expert-sorted order (a row of the whole [T*k, H] x_sorted), for the global token t,
exactly as unsharded. The routing (``moe_routing``: a stable sort of all T*k expert ids)
is global, so a token's copies can land in any row block and a row block can hold copies
of any token: moving rows between devices is inherent, whatever the rule.

* The hidden dimension H may be sharded: permute and unpermute copy whole rows, so every
  device works on its columns with no communication; ``d_weights`` (a dot product over H)
  is summed with ``psum``.
* Tokens: ``moe_permute`` with x sharded by tokens returns x_sorted sharded by rows over
  the same mesh axes (rows r0:r0 + T*k/D on each device, the layout the token-sharded
  grouped GEMMs take). Each device scatters the copies of its tokens into a zero
  [T*k, H] buffer (jnp) and the buffers are summed and split with ``psum_scatter`` (a
  reduce-scatter; every row has exactly one non-zero contribution, so the sum is exact).
  row_map stays sharded like the tokens.
* ``moe_unpermute`` with y_sorted sharded by rows returns the output sharded by tokens over
  the same axes. It needs the *full* index set: row_map and combine_weights ([T, k],
  small) are kept replicated (Shardy gathers them if they are sharded). Each device sums,
  for every token, the rows it holds (others count as zero; float32) and the [T, H]
  partial sums are reduced and split with ``psum_scatter``, then rounded once.
* The weighted backward pass (d_y_sorted, d_weights) does the same: the scaled output
  gradient of each token is scattered to its rows (reduce-scatter to the row blocks), the
  unscaled one likewise for the dot products of d_weights, which are summed back to
  replicated [T, k] with ``psum``.

Cost: the token-sharded paths run as XLA-fused jnp (scatter / take) instead of the FFI
kernels, and a reduce-scatter moves T*k*H values for permute (k times the T*H of an
all-gather of x) and T*H float32 values for unpermute (less than the T*k*H of gathering
y_sorted). For expert parallelism proper (tokens exchanged with an all-to-all), call the
ops per device inside ``jax.shard_map`` with per-device routing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse._src import sharding
from jaxfuse._src.ops.moe_permute import ffi


_ROWS = "(t j)"


def _permute_rule(attrs, in_ranks, out_ranks):
  del attrs, in_ranks, out_ranks
  # The sorted rows are the compound (t j), t major: sharding the tokens shards them into
  # blocks of T*k/D rows in the same order (the factor lists name it "(t j)").
  return [["t", "h"], ["t", "j"]], [[_ROWS, "h"]]


def _scatter_rows(values, row_map, rows, start):
  """[rows, H]: values[t] (or values[t, j]) written to row row_map[t, j] - start."""
  tokens, topk = row_map.shape
  if values.ndim == 2:
    values = jnp.repeat(values[:, None, :], topk, axis=1)
  out = jnp.zeros((rows, values.shape[-1]), values.dtype)
  return out.at[(row_map - start).reshape(-1)].set(values.reshape(tokens * topk, -1),
                                                   mode="drop")


def _permute_local(factor_axes, x, row_map):
  token_axes = tuple(factor_axes.get("t", ()))
  if not token_axes:
    return ffi.permute(x, row_map)
  total_rows = row_map.shape[0] * row_map.shape[1] * sharding.axes_size(token_axes)
  full = _scatter_rows(x, row_map, total_rows, 0)
  return jax.lax.psum_scatter(full, token_axes, scatter_dimension=0, tiled=True)


def _unpermute_rule(attrs, in_ranks, out_ranks):
  del attrs, in_ranks, out_ranks
  return [[_ROWS, "h"], ["u", "j"], ["u", "j"]], [["t", "h"]]


def _local_rows(y, row_map, weights, start):
  """[T, H] float32: sum over j of w[t, j] * y[row_map[t, j] - start], rows held only."""
  local = row_map - start
  held = (local >= 0) & (local < y.shape[0])
  rows = jnp.take(y, jnp.where(held, local, 0), axis=0).astype(jnp.float32)
  w = jnp.where(held, weights.astype(jnp.float32), 0.0)
  return jnp.einsum("tkh,tk->th", rows, w)


def _unpermute_local(factor_axes, y, row_map, weights):
  row_axes = tuple(factor_axes.get(_ROWS, ()))
  if not row_axes:
    return ffi.unpermute(y, row_map, weights)
  start = sharding.shard_start(row_axes, y.shape[0])
  partial = _local_rows(y, row_map, weights, start)
  out = jax.lax.psum_scatter(partial, row_axes, scatter_dimension=0, tiled=True)
  return out.astype(y.dtype)


def _unpermute_bwd_rule(attrs, in_ranks, out_ranks):
  del attrs, in_ranks, out_ranks
  return ([["t", "h"], [_ROWS, "h"], ["u", "j"], ["u", "j"]], [[_ROWS, "h"], ["u", "j"]])


def _unpermute_bwd_local(factor_axes, d_out, y, row_map, weights):
  token_axes = tuple(factor_axes.get("t", ()))
  row_axes = tuple(factor_axes.get(_ROWS, ()))
  hidden_axes = tuple(factor_axes.get("h", ()))
  if not token_axes and not row_axes:
    d_y, d_w = ffi.unpermute_backward(d_out, y, row_map, weights)
    return d_y, (jax.lax.psum(d_w, hidden_axes) if hidden_axes else d_w)
  # Tokens and rows are sharded the same way (result_axes_from ties them).
  axes = token_axes
  t_start = sharding.shard_start(axes, d_out.shape[0])
  local_map = jax.lax.dynamic_slice_in_dim(row_map, t_start, d_out.shape[0])
  local_w = jax.lax.dynamic_slice_in_dim(weights, t_start, d_out.shape[0]).astype(jnp.float32)
  total_rows = row_map.shape[0] * row_map.shape[1]
  d_out32 = d_out.astype(jnp.float32)
  scaled = d_out32[:, None, :] * local_w[:, :, None]
  d_y = jax.lax.psum_scatter(_scatter_rows(scaled, local_map, total_rows, 0), axes,
                             scatter_dimension=0, tiled=True)
  copies = jax.lax.psum_scatter(_scatter_rows(d_out32, local_map, total_rows, 0), axes,
                                scatter_dimension=0, tiled=True)
  dots = jnp.sum(y.astype(jnp.float32) * copies, axis=1)  # per held row
  r_start = sharding.shard_start(axes, y.shape[0])
  local = row_map - r_start
  held = (local >= 0) & (local < y.shape[0])
  d_w = jnp.where(held, jnp.take(dots, jnp.where(held, local, 0)), 0.0)
  d_w = jax.lax.psum(d_w, axes + hidden_axes)
  return d_y.astype(y.dtype), d_w


permute = sharding.partitioned(ffi.permute, _permute_rule, replicated=("j",), summed=("t",),
                               local=_permute_local, local_factors=True,
                               result_axes_from={_ROWS: "t"})
_unpermute = sharding.partitioned(ffi.unpermute, _unpermute_rule, replicated=("u", "j"),
                                  summed=(_ROWS,), local=_unpermute_local, local_factors=True,
                                  result_axes_from={"t": _ROWS})
_unpermute_bwd = sharding.partitioned(
    ffi.unpermute_backward, _unpermute_bwd_rule, replicated=("u", "j"),
    summed=("t", _ROWS, "h"), local=_unpermute_bwd_local, local_factors=True,
    result_axes_from={_ROWS: "t", "t": _ROWS})


def unpermute(y_sorted, row_map, weights):
  return _unpermute(y_sorted, row_map, weights)


def unpermute_backward(d_out, y_sorted, row_map, weights):
  return _unpermute_bwd(d_out, y_sorted, row_map, weights)
