"""Sharding rules for linear_scale_add's FFI calls (see jaxfuse/_src/sharding.py).

Forward, out = residual + alpha * x @ kernel, x [..., K], kernel [K, N], residual [..., N]:

* the leading (token/batch) dimensions and N may be sharded: every device runs the fused
  GEMM on its block, no communication;
* K (contracted) may be sharded too: the residual must be added once, so a device then
  computes its partial product alpha * x_k @ kernel_k in float32 (jaxfuse_scaled_matmul),
  the partials are summed with ``psum`` over K's mesh axes, and the residual is added
  after the sum (in float32, one rounding to the residual's dtype). This is not the fused
  in-place kernel: with K sharded the residual is not updated in place.

Backward GEMMs (scaled_matmul): dx = alpha * dy @ kernel^T contracts N, dkernel =
alpha * x^T @ dy contracts the rows; a sharded contracted dimension is reduced the same
way (float32 partials, psum, one rounding). This is what makes the weight gradient of a
token-sharded (data-parallel) layer come out right without gathering the activations.

FP8 (per-tensor current scaling): the quantization of x, kernel^T and dy takes a global
amax (``pmax``, quantize/sharding.py), so every device gets the same scales as unsharded.
Forward c + alpha * s_a * s_b * a @ b^T, a [..., K] FP8, b [N, K] FP8, float32 [1] scales
(replicated): rows and N may be sharded with no communication; a sharded K is reduced as
in the 16-bit forward: each device's float32 partial product (scaled_matmul_fp8 with the
same global scales), ``psum``, then the residual added once (not in place). Backward
``scaled_matmul_fp8`` (a [..., P] x b [N, P]^T): a sharded contracted P (N for dgrad, the
rows for wgrad) gives float32 partials summed with ``psum``, rounded once. On GPU each
device's block must meet cuBLASLt's FP8 alignment as the whole tensors must (the number
of rows per device, K and N per device multiples of 16): the op validates global shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse._src import sharding
from jaxfuse._src.ops.linear_scale_add import ffi


def _forward_rule(attrs, in_ranks, out_ranks):
  del attrs, out_ranks
  rows = sharding.leading("b", in_ranks[0] - 1)
  return [[*rows, "k"], ["k", "n"], [*rows, "n"]], [[*rows, "n"]]


def _forward_local(reduce_axes, x, kernel, residual, *, alpha, transpose_a, transpose_b):
  partial = ffi.scaled_matmul(x, kernel, alpha=alpha, transpose_a=transpose_a,
                              transpose_b=transpose_b, out_dtype=jnp.float32)
  total = jax.lax.psum(partial, reduce_axes)
  return (residual.astype(jnp.float32) + total).astype(residual.dtype)


def _matmul_rule(attrs, in_ranks, out_ranks):
  del out_ranks
  if attrs["transpose_a"]:  # a [P, K]: the rows P are contracted
    a, out_rows = ["p", "m"], ["m"]
  else:
    out_rows = sharding.leading("b", in_ranks[0] - 1)
    a = [*out_rows, "p"]
  b = ["n", "p"] if attrs["transpose_b"] else ["p", "n"]
  return [a, b], [[*out_rows, "n"]]


def _matmul_local(reduce_axes, a, b, *, alpha, transpose_a, transpose_b, out_dtype):
  partial = ffi.scaled_matmul(a, b, alpha=alpha, transpose_a=transpose_a,
                              transpose_b=transpose_b, out_dtype=jnp.float32)
  return jax.lax.psum(partial, reduce_axes).astype(out_dtype)


def _fp8_forward_rule(attrs, in_ranks, out_ranks):
  del attrs, out_ranks
  rows = sharding.leading("b", in_ranks[0] - 1)
  return [[*rows, "k"], ["n", "k"], [*rows, "n"], ["sa"], ["sb"]], [[*rows, "n"]]


def _fp8_matmul_rule(attrs, in_ranks, out_ranks):
  del attrs, out_ranks
  rows = sharding.leading("b", in_ranks[0] - 1)
  return [[*rows, "p"], ["n", "p"], ["sa"], ["sb"]], [[*rows, "n"]]


def _fp8_matmul_local(reduce_axes, a, b, a_scale_inv, b_scale_inv, *, alpha, out_dtype,
                      fast_accumulation):
  partial = ffi.scaled_matmul_fp8(a, b, a_scale_inv, b_scale_inv, alpha=alpha,
                                  out_dtype=jnp.float32, fast_accumulation=fast_accumulation)
  return jax.lax.psum(partial, reduce_axes).astype(out_dtype)


def _fp8_forward_local(reduce_axes, a, b, c, a_scale_inv, b_scale_inv, *, alpha,
                      fast_accumulation):
  partial = ffi.scaled_matmul_fp8(a, b, a_scale_inv, b_scale_inv, alpha=alpha,
                                  out_dtype=jnp.float32, fast_accumulation=fast_accumulation)
  total = jax.lax.psum(partial, reduce_axes)
  return (c.astype(jnp.float32) + total).astype(c.dtype)


_linear_scale_add_fp8 = sharding.partitioned(ffi.linear_scale_add_fp8, _fp8_forward_rule,
                                             replicated=("sa", "sb"), reduction=("k",),
                                             local=_fp8_forward_local)
_scaled_matmul_fp8 = sharding.partitioned(ffi.scaled_matmul_fp8, _fp8_matmul_rule,
                                          replicated=("sa", "sb"), reduction=("p",),
                                          local=_fp8_matmul_local)


def linear_scale_add_fp8(a, b, c, a_scale_inv, b_scale_inv, *, alpha, fast_accumulation):
  return _linear_scale_add_fp8(a, b, c, a_scale_inv, b_scale_inv, alpha=float(alpha),
                               fast_accumulation=bool(fast_accumulation))


def scaled_matmul_fp8(a, b, a_scale_inv, b_scale_inv, *, alpha, out_dtype,
                      fast_accumulation=False):
  return _scaled_matmul_fp8(a, b, a_scale_inv, b_scale_inv, alpha=float(alpha),
                            out_dtype=jnp.dtype(out_dtype),
                            fast_accumulation=bool(fast_accumulation))


linear_scale_add = sharding.partitioned(ffi.linear_scale_add, _forward_rule, reduction=("k",),
                                        local=_forward_local)
_scaled_matmul = sharding.partitioned(ffi.scaled_matmul, _matmul_rule, reduction=("p",),
                                      local=_matmul_local)


def scaled_matmul(a, b, *, alpha, transpose_a=False, transpose_b=False, out_dtype=None):
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  return _scaled_matmul(a, b, alpha=alpha, transpose_a=bool(transpose_a),
                        transpose_b=bool(transpose_b), out_dtype=out_dtype)
