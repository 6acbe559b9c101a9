"""Router logits at float32 accuracy from bfloat16 tensor-core GEMMs (the default, see KNOB).

The router must see float32 logits: TF32 (10-bit mantissas) flips top-k choices between
near-tied experts. XLA runs a HIGHEST-precision float32 dot on CUDA cores, and the router's
three GEMMs (logits, d_x, d_kernel) took 0.45 ms of the 10.1 ms DeepSeek-like layer step on
the H200 (benchmarks/results/profile_kernels_s34moe_*). This module computes the same
values with bfloat16 GEMMs that accumulate in float32:

  * every operand is split exactly into bfloat16 parts, v = v1 + v2 + v3 (each part takes
    the next 8 significant bits, cut with a bit mask; bfloat16 keeps float32's exponent
    range, so a float32 value needs at most 3 parts, a float16 value 2, a bfloat16 value 1);
  * a product of two parts is exact in float32, so the dot is the sum of the part products
    v_i . w_j over i + j <= 4 (the terms above that lie below float32's rounding, as in
    XLA's BF16_BF16_F32_X6 algorithm), accumulated in float32;
  * the part products that share a left operand run as one GEMM, the right parts
    concatenated along N (logits, d_kernel) or along K (d_x), so each large operand is read
    once per part instead of once per term.

For the usual bfloat16 tokens, logits and d_kernel are one GEMM each (x has one part) and
d_x one GEMM with K = 6E. Results differ from the HIGHEST dot only in the order of the
float32 additions.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from jaxfuse._src import compat

# Read when a router is traced: "split_bf16" (the default) makes the fused path compute the
# logits here, "highest" keeps the specification's float32 HIGHEST dot. The GPU tests of the
# split path passed at 092b3675 (session 35, H100); the first version had lost its
# remainders to XLA's excess precision on the GPU (session 34), hence the bit mask below.
KNOB = "JAXFUSE_MOE_ROUTER_LOGITS"


def split_bf16_enabled() -> bool:
  """Whether the fused path computes the logits here (KNOB unset or "split_bf16")."""
  value = os.environ.get(KNOB, "split_bf16")
  if value not in ("split_bf16", "highest"):
    raise ValueError(f"{KNOB} must be 'split_bf16' or 'highest', got {value!r}")
  return value == "split_bf16"


# Highest part index sum kept: i + j <= _MAX_ORDER (1-based), XLA's X6 selection.
_MAX_ORDER = 4


def _partner_count(left_index: int, right_parts: int) -> int:
  """How many right parts (the first ones) pair with left part `left_index` (0-based)."""
  return max(0, min(right_parts, _MAX_ORDER - left_index - 1))


def split_parts(value: jax.Array, parts: int) -> list[jax.Array]:
  """`parts` bfloat16 arrays whose float32 sum is `value` (exactly, for parts = 3 and a
  float32 value): each part is the top 8 significant bits of what is left.

  The parts are cut with a bit mask, not by rounding through bfloat16: under XLA's default
  excess precision the GPU compiler folds convert(convert(v, bf16), f32) back to v, which
  made every remainder zero (logits at bfloat16 accuracy; seen on the GPU in session 34).
  A masked float32 value converts to bfloat16 exactly, so no rounding is left to fold.
  """
  if parts == 1 and value.dtype == jnp.bfloat16:
    return [value]
  rest = value.astype(jnp.float32)
  out = []
  for index in range(parts):
    if index == parts - 1:
      head = rest  # what is left fits 8 bits when the parts cover the type
    else:
      bits = jax.lax.bitcast_convert_type(rest, jnp.uint32) & jnp.uint32(0xFFFF0000)
      head = jax.lax.bitcast_convert_type(bits, jnp.float32)
      rest = rest - head  # exact: the low 16 bits of rest
    out.append(head.astype(jnp.bfloat16))
  return out


def part_count(dtype) -> int:
  """bfloat16 parts that represent a value of `dtype` exactly (float32 needs 3)."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.dtype(jnp.bfloat16):
    return 1
  if dtype == jnp.dtype(jnp.float16):
    return 2  # 11-bit mantissas, within bfloat16's exponent range
  return 3


def _dot_f32(a, b, dimension_numbers):
  return jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32)


def _split_matmul(left_parts, right_parts, contract_left: int, contract_right: int):
  """Sum over i + j <= _MAX_ORDER of left_i . right_j (contracting the given axes of 2-D
  operands), as one GEMM per left part with that part's right partners side by side."""
  total = None
  for i, left in enumerate(left_parts):
    partners = right_parts[:_partner_count(i, len(right_parts))]
    if not partners:
      continue
    free_right = 1 - contract_right
    stacked = jnp.concatenate(partners, axis=free_right)
    product = _dot_f32(left, stacked, (((contract_left,), (contract_right,)), ((), ())))
    # product: [free_left, len(partners) * free_right]; sum the partners' blocks.
    width = partners[0].shape[free_right]
    blocks = product.reshape(product.shape[0], len(partners), width)
    term = jnp.sum(blocks, axis=1)
    total = term if total is None else total + term
  return total


def router_logits(x: jax.Array, router_kernel: jax.Array) -> jax.Array:
  """float32 [T, E] = x [T, H] @ router_kernel [H, E] at float32 accuracy.

  Args:
    x: [T, H] bfloat16, float16 or float32.
    router_kernel: [H, E] float (used as float32).

  Returns:
    float32 [T, E]. Differentiable in both (gradients at float32 accuracy, in the inputs'
    dtypes; inside shard_map, a replicated kernel's gradient is summed over the axes its
    tokens vary along, as for a plain dot).
  """
  varying_axes = (compat.varying_axes(x), compat.varying_axes(router_kernel))
  return _router_logits(x, router_kernel, varying_axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _router_logits(x, router_kernel, varying_axes):
  del varying_axes
  return _logits(x, router_kernel)


def _logits(x, router_kernel):
  x_parts = split_parts(x, part_count(x.dtype))
  kernel_parts = split_parts(router_kernel, 3)
  return _split_matmul(x_parts, kernel_parts, 1, 0)


def _router_logits_fwd(x, router_kernel, varying_axes):
  del varying_axes
  return _logits(x, router_kernel), (x, router_kernel)


def _router_logits_bwd(varying_axes, saved, d_logits):
  x, router_kernel = saved
  d_parts = split_parts(d_logits, 3)
  kernel_parts = split_parts(router_kernel, 3)
  # d_x [T, H] = d_logits [T, E] . kernel^T: the contraction is E (small), so the terms
  # go side by side along K: [d_i ...] [T, n*E] against [kernel_j ...] [n*E, H].
  lefts, rights = [], []
  for i, d_part in enumerate(d_parts):
    for j in range(_partner_count(i, len(kernel_parts))):
      lefts.append(d_part)
      rights.append(kernel_parts[j])
  d_x = _dot_f32(jnp.concatenate(lefts, axis=1), jnp.concatenate(rights, axis=1),
                 (((1,), (1,)), ((), ())))
  # d_kernel [H, E] = x^T . d_logits: x's parts against d's parts side by side along N.
  x_parts = split_parts(x, part_count(x.dtype))
  d_kernel = _split_matmul(x_parts, d_parts, 0, 0)
  x_axes, kernel_axes = varying_axes
  return (compat.match_varying_axes(d_x.astype(x.dtype), x_axes),
          compat.match_varying_axes(d_kernel.astype(router_kernel.dtype), kernel_axes))


_router_logits.defvjp(_router_logits_fwd, _router_logits_bwd)
