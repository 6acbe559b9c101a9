"""Pure-jnp specification of grouped_mlp (the "xla" implementation): the composition of
the grouped_linear reference (``jax.lax.ragged_dot``) and the scaled activation reference,
differentiated by JAX's autodiff."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse._src.ops.grouped_linear import reference as linear_reference
from jaxfuse._src.ops.scaled_activation import reference as act_reference


def grouped_mlp(x: jax.Array, kernel1: jax.Array, kernel2: jax.Array, group_sizes: jax.Array,
                scales: jax.Array, activation: str = "swiglu", limit: float = 7.0,
                alpha: float = 1.702, linear_offset: float = 1.0) -> jax.Array:
  """FC2(act(FC1(x)) * scales[:, None]) with per-group (expert) weights; [M, H] in x's dtype."""
  h = linear_reference.grouped_linear(x, kernel1, group_sizes)
  a = act_reference.scaled_activation(h, scales, activation, limit, alpha, linear_offset)
  return linear_reference.grouped_linear(a, kernel2, group_sizes)


def grouped_mlp_fp8(x: jax.Array, kernel1: jax.Array, kernel2: jax.Array,
                    group_sizes: jax.Array, scales: jax.Array, activation: str, limit: float,
                    alpha: float, linear_offset: float, recipe) -> jax.Array:
  """The FP8 composition as the kernels compute it, with straight-through gradients.

  FC1 is ``grouped_linear_fp8``; the scaled activation is computed in fp32 and quantized
  per group without rounding to x's dtype (``scaled_activation_quantize``); FC2 is
  ``grouped_linear_fp8`` on that fp32 activation. [M, H] in x's dtype.
  """
  h = linear_reference.grouped_linear_fp8(x, kernel1, group_sizes, recipe)
  act = act_reference.activation_f32(h, activation, limit, alpha, linear_offset)
  a = act * scales.astype(jnp.float32)[:, None]
  return linear_reference.grouped_linear_fp8(a, kernel2, group_sizes, recipe).astype(x.dtype)


def grouped_mlp_blockwise(x: jax.Array, kernel1, kernel2, group_sizes: jax.Array,
                          scales: jax.Array, activation: str, limit: float, alpha: float,
                          linear_offset: float, recipe) -> jax.Array:
  """The blockwise FP8 composition (Float8BlockScaling) as the kernels compute it, with
  straight-through gradients: ``grouped_linear_blockwise`` for FC1 and FC2, the scaled
  activation in fp32 between them (quantized in 1 x 128 blocks without rounding to x's
  dtype). [M, H] in x's dtype."""
  h = linear_reference.grouped_linear_blockwise(x, kernel1, group_sizes, recipe)
  act = act_reference.activation_f32(h, activation, limit, alpha, linear_offset)
  a = act * scales.astype(jnp.float32)[:, None]
  out = linear_reference.grouped_linear_blockwise(a, kernel2, group_sizes, recipe)
  return out.astype(x.dtype)
