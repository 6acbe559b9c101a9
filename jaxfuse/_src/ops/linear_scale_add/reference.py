"""Pure-jnp specification of linear_scale_add (the "xla" implementation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def linear_scale_add(x: jax.Array, kernel: jax.Array, residual: jax.Array,
                     alpha: float) -> jax.Array:
  """residual + alpha * (x @ kernel), accumulated in fp32, rounded once to residual.dtype.

  Shapes: x [..., K], kernel [K, N], residual [..., N] (x's leading shape).
  """
  product = jnp.matmul(x, kernel, preferred_element_type=jnp.float32)
  return (residual.astype(jnp.float32) + alpha * product).astype(residual.dtype)


def linear_scale_add_fp8(x: jax.Array, kernel: jax.Array, residual: jax.Array, alpha: float,
                         recipe) -> jax.Array:
  """The FP8 forward as the kernels compute it: per-tensor E4M3 quantization of x and
  kernel, exact products of the FP8 values accumulated in fp32, scaled by the two inverse
  scales, added to the residual and rounded once.

  Gradients pass straight through the quantization (d(dequantized x)/dx = 1), so the
  reference stays differentiable; the FFI backward quantizes the gradients instead.
  `kernel` may be a ``quantize_kernel`` QuantizedArray: its FP8 values are used as they
  are, and it gets no gradient unless it is trainable (then its master does).
  """
  from jaxfuse._src.ops.quantize import kernels as quantized_kernels  # pylint: disable=g-import-not-at-top
  from jaxfuse._src.ops.quantize import api as quantize_api  # pylint: disable=g-import-not-at-top

  def dequantized(value):
    q = quantize_api.quantize(value, recipe, role="forward", implementation="xla")
    return q.data.astype(jnp.float32) * q.scale_inv[0]

  def straight_through(value, value_dequantized):
    value = value.astype(jnp.float32)
    return value + jax.lax.stop_gradient(value_dequantized - value)

  k = x.shape[-1]
  x_rows = x.reshape(-1, k)
  x_dequantized = dequantized(x_rows)
  # The kernel's dequantized values as the FP8 GEMM reads them, [N, K] (K-major): from a
  # quantize_kernel result's data, or quantized here from kernel^T.
  if quantized_kernels.is_quantized_kernel(kernel):
    w_t_dequantized = kernel.data.astype(jnp.float32) * kernel.scale_inv[0]
    target = quantized_kernels.gradient_target(kernel)  # its master, or None (frozen)
  else:
    w_t_dequantized = dequantized(kernel.T)
    target = kernel
  w_t_dequantized = jax.lax.stop_gradient(w_t_dequantized)
  w_dequantized = w_t_dequantized.T
  # The value: the product of the dequantized FP8 operands (x [M, K] times [N, K]^T, one
  # contraction for both kinds of kernel); the gradient: that of the straight-through
  # product (`through - stop_gradient(through)` is exactly zero).
  exact = jax.lax.dot_general(jax.lax.stop_gradient(x_dequantized), w_t_dequantized,
                              (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  w_through = w_dequantized if target is None else straight_through(target, w_dequantized)
  through = jnp.matmul(straight_through(x_rows, x_dequantized), w_through,
                       preferred_element_type=jnp.float32)
  product = exact + (through - jax.lax.stop_gradient(through))
  out = residual.astype(jnp.float32) + alpha * product.reshape(*x.shape[:-1], -1)
  return out.astype(residual.dtype)
