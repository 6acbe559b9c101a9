"""Pure-jnp specification of grouped_mlp (the "xla" implementation): the composition of
the grouped_linear reference (``jax.lax.ragged_dot``) and the scaled activation reference,
differentiated by JAX's autodiff."""

from __future__ import annotations

import jax

from jaxfuse._src.ops.grouped_linear import reference as linear_reference
from jaxfuse._src.ops.scaled_activation import reference as act_reference


def grouped_mlp(x: jax.Array, kernel1: jax.Array, kernel2: jax.Array, group_sizes: jax.Array,
                scales: jax.Array, activation: str = "swiglu", limit: float = 7.0,
                alpha: float = 1.702, linear_offset: float = 1.0) -> jax.Array:
  """FC2(act(FC1(x)) * scales[:, None]) with per-group (expert) weights; [M, H] in x's dtype."""
  h = linear_reference.grouped_linear(x, kernel1, group_sizes)
  a = act_reference.scaled_activation(h, scales, activation, limit, alpha, linear_offset)
  return linear_reference.grouped_linear(a, kernel2, group_sizes)
