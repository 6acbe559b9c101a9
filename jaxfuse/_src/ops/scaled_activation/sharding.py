"""Sharding rules for the scaled activation FFI calls (see jaxfuse/_src/sharding.py).

Rows (the leading dimensions of x, and scales) may be sharded: each device activates its
rows. Features: "srelu" is elementwise, so its feature dimension may be sharded too; the
gated activations ("swiglu", "clamped_swiglu") pair feature j with feature j + F/2 of the
same row, so their feature dimension is kept replicated (Shardy gathers it first).
"""

from __future__ import annotations

import jax

from jaxfuse._src import sharding
from jaxfuse._src.ops.scaled_activation import ffi


def _features(activation):
  return ("f", "f") if activation == "srelu" else ("f", "o")


def _fwd_rule(attrs, in_ranks, out_ranks):
  del out_ranks
  rows = sharding.leading("b", in_ranks[0] - 1)
  f_in, f_out = _features(attrs["activation"])
  return [[*rows, f_in], rows], [[*rows, f_out]]


def _bwd_rule(attrs, in_ranks, out_ranks):
  del out_ranks
  rows = sharding.leading("b", in_ranks[1] - 1)
  f_in, f_out = _features(attrs["activation"])
  return [[*rows, f_out], [*rows, f_in], rows], [[*rows, f_in], rows]


def _srelu_bwd_local(reduce_axes, *args, **attrs):
  dx, dscales = ffi.backward(*args, **attrs)
  return dx, jax.lax.psum(dscales, reduce_axes)


_forward = sharding.partitioned(ffi.forward, _fwd_rule, replicated=("o",))
_forward_gated = sharding.partitioned(ffi.forward, _fwd_rule, replicated=("f", "o"))
# srelu: dscales sums over the features, so a sharded feature dimension is psummed.
_backward = sharding.partitioned(ffi.backward, _bwd_rule, summed=("f",),
                                 local=_srelu_bwd_local)
_backward_gated = sharding.partitioned(ffi.backward, _bwd_rule, replicated=("f", "o"))


def forward(x, scales, **attrs):
  fn = _forward if attrs["activation"] == "srelu" else _forward_gated
  return fn(x, scales, **attrs)


def backward(dy, x, scales, **attrs):
  fn = _backward if attrs["activation"] == "srelu" else _backward_gated
  return fn(dy, x, scales, **attrs)
