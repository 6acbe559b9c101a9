"""Sharding rules for the grouped GEMM FFI calls (see jaxfuse/_src/sharding.py).

What is shardable: N, the kernel's output features (tensor parallelism of an expert
layer). Tokens (rows), K, the groups and the group offsets stay replicated.

Why tokens are not: group_sizes / group_offsets describe the rows of the *whole* x (rows
sorted by group, group g at rows offsets[g]:offsets[g+1]). A device holding a block of
rows would need the sizes of the groups within its own block, which are not a slice of the
global sizes; under jit with a NamedSharding there is no way to derive them without
communication. So a token-sharded x is gathered by Shardy before the grouped GEMM (correct,
not cheap). For token (data/expert) parallelism, sort the tokens per shard and call
grouped_linear inside ``jax.shard_map`` with per-shard group sizes (shape [shards, G]
sharded like the tokens, each shard passing its own row): inside shard_map no rule is
involved and every device runs the kernel on its own rows and sizes.

Forms: forward [m, k] x [G, k, n] -> [m, n] and wgrad [m, k] x [m, n] -> [G, k, n] keep N
sharded with no communication; dgrad [m, n] x [G, k, n] -> [m, k] contracts N, so with N
sharded each device computes a partial dx that is summed with ``psum`` (in float32, after
the handler's rounding of each partial to dx's dtype).

The FP8 grouped GEMM (scale operands) is not partitioned: XLA gathers its operands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse._src import sharding
from jaxfuse._src.ops.grouped_linear import ffi

_REPLICATED = ("m", "k", "g", "o")


def _rule(attrs, in_ranks, out_ranks):
  del in_ranks, out_ranks
  form = attrs["form"]
  if form == ffi.FORWARD:
    return [["m", "k"], ["g", "k", "n"], ["o"]], [["m", "n"]]
  if form == ffi.DGRAD:
    return [["m", "n"], ["g", "k", "n"], ["o"]], [["m", "k"]]
  return [["m", "k"], ["m", "n"], ["o"]], [["g", "k", "n"]]


def _local(reduce_axes, a, b, offsets, **attrs):
  partial = ffi.grouped_gemm(a, b, offsets, **attrs)
  return jax.lax.psum(partial.astype(jnp.float32), reduce_axes).astype(partial.dtype)


_grouped_gemm = sharding.partitioned(ffi.grouped_gemm, _rule, replicated=_REPLICATED)
# dgrad contracts N: a sharded N is summed (only this form; forward and wgrad keep N).
_grouped_gemm_dgrad = sharding.partitioned(ffi.grouped_gemm, _rule, replicated=_REPLICATED,
                                           summed=("n",), local=_local)


def grouped_gemm(a, b, group_offsets, *, form, a_scale_inv=None, b_scale_inv=None,
                 out_dtype=None):
  """ffi.grouped_gemm with the sharding rule above (FP8: the plain call)."""
  if a_scale_inv is not None:
    return ffi.grouped_gemm(a, b, group_offsets, form=form, a_scale_inv=a_scale_inv,
                            b_scale_inv=b_scale_inv, out_dtype=out_dtype)
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  fn = _grouped_gemm_dgrad if form == ffi.DGRAD else _grouped_gemm
  return fn(a, b, group_offsets, form=int(form), out_dtype=out_dtype)
