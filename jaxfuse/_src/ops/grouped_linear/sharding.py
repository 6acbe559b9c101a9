"""Sharding rules for the grouped GEMM FFI calls (see jaxfuse/_src/sharding.py).

Shardable: the tokens (rows M of x, dy and the results) and N, the kernel's output
features (tensor parallelism of an expert layer). K, the groups and the group offsets
stay replicated (a sharded K is gathered by Shardy).

What group_sizes / group_offsets mean with tokens sharded: they describe the rows of the
*whole* x (global row numbers; group g is rows offsets[g]:offsets[g+1] of the unsharded x,
rows sorted by group), exactly as without sharding. Each device holds a contiguous block
of rows starting at ``start = jax.lax.axis_index(token axes) * local_rows`` and runs the
kernel on its block with local offsets ``clip(offsets - start, 0, local_rows)``: the part
of each group that falls in its block (empty for the others). Rows past the last group
stay zeros. No communication is needed for that: offsets are replicated ([G + 1] int32).

Forms:
* forward [m, k] x [G, k, n] -> [m, n]: local (tokens and N sharded, no communication);
* dgrad [m, n] x [G, k, n] -> [m, k]: contracts N, so with N sharded each device's partial
  dx is summed with ``psum`` (in float32, after the handler rounds each partial to dx's
  dtype); tokens stay local;
* wgrad [m, k] x [m, n] -> [G, k, n]: contracts the tokens, so with tokens sharded each
  device's partial dkernel (its rows of each group) is summed with ``psum`` over the token
  axes (float32, after the handler's rounding of each partial); N stays sharded.

The FP8 grouped GEMM (forward a [m, k] x w^T [G, n, k], dgrad dy [m, n] x [G, k, n], with
float32 [G] scale operands, replicated) follows the same rules. Its per-group current
scaling needs global amaxes; the quantization calls do that (quantize/sharding.py).
On GPU a sharded N must stay TMA-aligned per device (N / devices a multiple of 8 for
16-bit, 16 for FP8); rows per device need no alignment.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse._src import sharding
from jaxfuse._src.ops.grouped_linear import ffi

_REPLICATED = ("k", "g", "o")


def _rule(attrs, in_ranks, out_ranks):
  del out_ranks
  form = attrs["form"]
  scales = [["g"], ["g"]] if len(in_ranks) == 5 else []
  if form == ffi.FORWARD:
    w = ["g", "n", "k"] if scales else ["g", "k", "n"]
    return [["m", "k"], w, ["o"], *scales], [["m", "n"]]
  if form == ffi.DGRAD:
    return [["m", "n"], ["g", "k", "n"], ["o"], *scales], [["m", "k"]]
  return [["m", "k"], ["m", "n"], ["o"], *scales], [["g", "k", "n"]]


def _gemm(a, b, offsets, *scales, form, out_dtype, fast_accumulation=False):
  a_scale_inv, b_scale_inv = scales if scales else (None, None)
  return ffi.grouped_gemm(a, b, offsets, form=form, a_scale_inv=a_scale_inv,
                          b_scale_inv=b_scale_inv, out_dtype=out_dtype,
                          fast_accumulation=fast_accumulation)


def _local_offsets(factor_axes, offsets, rows):
  """The offsets of this device's block of `rows` rows when the tokens are sharded."""
  token_axes = tuple(factor_axes.get("m", ()))
  if not token_axes:
    return offsets
  start = sharding.shard_start(token_axes, rows)
  # Offsets past the global M (and padding rows of uneven blocks) belong to no group.
  total = sharding.global_size(rows, factor_axes, "m")
  return jnp.clip(jnp.clip(offsets, 0, total) - start, 0, rows).astype(jnp.int32)


def _local(factor_axes, a, b, offsets, *scales, form, out_dtype, fast_accumulation=False):
  token_axes = tuple(factor_axes.get("m", ()))
  offsets = _local_offsets(factor_axes, offsets, a.shape[0])
  out = _gemm(a, b, offsets, *scales, form=form, out_dtype=out_dtype,
              fast_accumulation=fast_accumulation)
  summed = {ffi.DGRAD: tuple(factor_axes.get("n", ())), ffi.WGRAD: token_axes}.get(form, ())
  if summed:
    out = jax.lax.psum(out.astype(jnp.float32), summed).astype(out.dtype)
  return out


# Forward: tokens and N stay sharded (tokens need local offsets).
_forward = sharding.partitioned(_gemm, _rule, replicated=_REPLICATED, summed=("m",),
                                local=_local, local_factors=True)
# dgrad contracts N (summed), tokens need local offsets.
_dgrad = sharding.partitioned(_gemm, _rule, replicated=_REPLICATED, summed=("m", "n"),
                              local=_local, local_factors=True)
# wgrad contracts the tokens.
_wgrad = sharding.partitioned(_gemm, _rule, replicated=_REPLICATED, reduction=("m",),
                              local=_local, local_factors=True)
_BY_FORM = {ffi.FORWARD: _forward, ffi.DGRAD: _dgrad, ffi.WGRAD: _wgrad}


# --- Blockwise FP8 (Float8BlockScaling) --------------------------------------------------
# Operands a, b, offsets, a's 1 x 128 scales [m, blocks of the contraction] and b's tile
# scales [G, blocks of the output columns, blocks of the contraction]. Only the tokens may
# stay sharded: a sharded N would cut the weight's 128 x 128 tiles, so N and the block
# factors are replicated (Shardy gathers them).
_BLOCKWISE_REPLICATED = ("k", "n", "g", "o", "kb", "nb")


def _blockwise_rule(attrs, in_ranks, out_ranks):
  del in_ranks, out_ranks
  if attrs["form"] == ffi.FORWARD:
    return ([["m", "k"], ["g", "n", "k"], ["o"], ["m", "kb"], ["g", "nb", "kb"]],
            [["m", "n"]])
  return ([["m", "n"], ["g", "k", "n"], ["o"], ["m", "nb"], ["g", "kb", "nb"]], [["m", "k"]])


def _blockwise_gemm(a, b, offsets, a_scale_inv, b_scale_inv, *, form):
  return ffi.grouped_gemm_blockwise(a, b, offsets, a_scale_inv, b_scale_inv, form=form)


def _blockwise_local(factor_axes, a, b, offsets, a_scale_inv, b_scale_inv, *, form):
  return _blockwise_gemm(a, b, _local_offsets(factor_axes, offsets, a.shape[0]), a_scale_inv,
                         b_scale_inv, form=form)


_blockwise = sharding.partitioned(_blockwise_gemm, _blockwise_rule,
                                  replicated=_BLOCKWISE_REPLICATED, summed=("m",),
                                  local=_blockwise_local, local_factors=True)


# --- The gated FC1 (h and its scaled activation from one kernel) ---------------------------
# x [m, k], w [G, k, n], offsets, scales [m] -> h [m, n], act [m, f]. Only the tokens may
# stay sharded (with local offsets, as the forward): gate column j pairs with column F + j,
# so a sharded N would split the pairs; N, F and K are replicated (Shardy gathers them).
def _gated_rule(attrs, in_ranks, out_ranks):
  del attrs, in_ranks, out_ranks
  return [["m", "k"], ["g", "k", "n"], ["o"], ["m"]], [["m", "n"], ["m", "f"]]


def _gated_local(factor_axes, x, w, offsets, scales, **attrs):
  return ffi.grouped_gemm_gated(x, w, _local_offsets(factor_axes, offsets, x.shape[0]), scales,
                                **attrs)


_gated = sharding.partitioned(ffi.grouped_gemm_gated, _gated_rule,
                              replicated=("k", "n", "f", "g", "o"), summed=("m",),
                              local=_gated_local, local_factors=True)


def grouped_gemm_gated(x, w, group_offsets, scales, *, activation, limit, alpha,
                       linear_offset):
  """ffi.grouped_gemm_gated (h, act) with the sharding rules above."""
  return _gated(x, w, group_offsets, scales, activation=activation, limit=float(limit),
                alpha=float(alpha), linear_offset=float(linear_offset))


def grouped_gemm_blockwise(a, b, group_offsets, a_scale_inv, b_scale_inv, *, form):
  """ffi.grouped_gemm_blockwise with the sharding rules above."""
  return _blockwise(a, b, group_offsets, a_scale_inv, b_scale_inv, form=int(form))


def grouped_gemm(a, b, group_offsets, *, form, a_scale_inv=None, b_scale_inv=None,
                 out_dtype=None, fast_accumulation=False):
  """ffi.grouped_gemm with the sharding rules above (16-bit and FP8)."""
  fn = _BY_FORM[int(form)]
  if a_scale_inv is not None:
    out_dtype = jnp.dtype(out_dtype or jnp.bfloat16)
    return fn(a, b, group_offsets, a_scale_inv, b_scale_inv, form=int(form),
              out_dtype=out_dtype, fast_accumulation=bool(fast_accumulation))
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  return fn(a, b, group_offsets, form=int(form), out_dtype=out_dtype)
