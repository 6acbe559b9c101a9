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
