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
  from jaxfuse._src.ops.grouped_linear import reference as kernel_helpers  # pylint: disable=g-import-not-at-top
  from jaxfuse._src.ops.quantize import api as quantize_api  # pylint: disable=g-import-not-at-top

  def straight_through(value, dequantized=None):
    if dequantized is None:
      q = quantize_api.quantize(value, recipe, role="forward", implementation="xla")
      dequantized = q.data.astype(jnp.float32) * q.scale_inv[0]
    return value.astype(jnp.float32) + jax.lax.stop_gradient(
        dequantized - value.astype(jnp.float32))

  if kernel_helpers.is_quantized_kernel(kernel):
    w = jax.lax.stop_gradient(kernel.data.T.astype(jnp.float32) * kernel.scale_inv[0])
    target = kernel_helpers.gradient_target(kernel)  # its master, or None (frozen)
    w = w if target is None else straight_through(target, w)
  else:
    w = straight_through(kernel)
  k = w.shape[0]
  product = jnp.matmul(straight_through(x.reshape(-1, k)), w,
                       preferred_element_type=jnp.float32)
  out = residual.astype(jnp.float32) + alpha * product.reshape(*x.shape[:-1], -1)
  return out.astype(residual.dtype)
