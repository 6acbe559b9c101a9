"""Sharding rules for the RMSNorm FFI calls (see jaxfuse/_src/sharding.py).

Rows (every leading dimension of x) may be sharded: each device normalizes its rows. The
hidden dimension is normalized over, so it is kept replicated (a sharded hidden dimension
is gathered by Shardy before the call). gamma is replicated.

Backward: dx keeps the row sharding; dgamma sums over the rows, so with sharded rows each
device computes dgamma of its rows and the partials are summed with ``psum`` (in float32;
the handler rounds each partial to gamma's dtype first, one extra rounding for bf16
gamma).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse._src import sharding
from jaxfuse._src.ops.rms_norm import ffi


def _rows(rank):
  return sharding.leading("b", rank - 1)


def _fwd_rule(attrs, in_ranks, out_ranks):
  del attrs, out_ranks
  rows = _rows(in_ranks[0])
  return [[*rows, "h"], ["h"]], [[*rows, "h"], rows]


def _add_fwd_rule(attrs, in_ranks, out_ranks):
  del attrs, out_ranks
  rows = _rows(in_ranks[0])
  return [[*rows, "h"], [*rows, "h"], ["h"]], [[*rows, "h"], [*rows, "h"], rows]


def _bwd_rule(attrs, in_ranks, out_ranks):
  del attrs, out_ranks
  rows = _rows(in_ranks[0])
  return [[*rows, "h"], [*rows, "h"], ["h"], rows], [[*rows, "h"], ["h"]]


def _add_bwd_rule(attrs, in_ranks, out_ranks):
  del attrs, out_ranks
  rows = _rows(in_ranks[0])
  return ([[*rows, "h"], [*rows, "h"], [*rows, "h"], ["h"], rows], [[*rows, "h"], ["h"]])


def _sum_dgamma(reduce_axes, outs):
  d_s, d_gamma = outs
  total = jax.lax.psum(d_gamma.astype(jnp.float32), reduce_axes)
  return d_s, total.astype(d_gamma.dtype)


def _bwd_local(reduce_axes, *args, **attrs):
  return _sum_dgamma(reduce_axes, ffi.rms_norm_bwd(*args, **attrs))


def _add_bwd_local(reduce_axes, *args, **attrs):
  return _sum_dgamma(reduce_axes, ffi.add_rms_norm_bwd(*args, **attrs))


def _row_factors(max_rank=8):
  return tuple(sharding.leading("b", max_rank))


rms_norm_fwd = sharding.partitioned(ffi.rms_norm_fwd, _fwd_rule, replicated=("h",))
add_rms_norm_fwd = sharding.partitioned(ffi.add_rms_norm_fwd, _add_fwd_rule, replicated=("h",))
rms_norm_bwd = sharding.partitioned(ffi.rms_norm_bwd, _bwd_rule, replicated=("h",),
                                    summed=_row_factors(), local=_bwd_local)
add_rms_norm_bwd = sharding.partitioned(ffi.add_rms_norm_bwd, _add_bwd_rule, replicated=("h",),
                                        summed=_row_factors(), local=_add_bwd_local)
