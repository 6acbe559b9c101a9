"""Pure-jnp specification of the scaled activations (the "xla" implementation).

Everything is computed in fp32 and rounded once to x's dtype. The explicit derivatives
(``activation_grad``) are the specification of the fused backward kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = ("swiglu", "srelu", "clamped_swiglu")
GLU = ("swiglu", "clamped_swiglu")


def split(x32, activation):
  if activation in GLU:
    f = x32.shape[-1] // 2
    return x32[..., :f], x32[..., f:]
  return x32, None


def activation_f32(x, activation, limit, alpha, linear_offset):
  """act(x) in fp32: [..., 2F] -> [..., F] for GLU kinds, [..., F] -> [..., F] for srelu."""
  a, b = split(x.astype(jnp.float32), activation)
  if activation == "swiglu":
    return a * jax.nn.sigmoid(a) * b
  if activation == "clamped_swiglu":
    # Comparisons rather than minimum/clip so NaN propagates the same way as the kernels.
    ac = jnp.where(a > limit, limit, a)
    bc = jnp.where(b > limit, limit, jnp.where(b < -limit, -limit, b)) + linear_offset
    return ac * jax.nn.sigmoid(alpha * ac) * bc
  r = jnp.where(a <= 0, 0.0, a)
  return r * r


def activation_grad(x, activation, limit, alpha, linear_offset):
  """(act, d act/d a, d act/d b) in fp32 (d/db is None for srelu)."""
  a, b = split(x.astype(jnp.float32), activation)
  if activation == "swiglu":
    s = jax.nn.sigmoid(a)
    silu = a * s
    return silu * b, b * s * (1 + a * (1 - s)), silu
  if activation == "clamped_swiglu":
    a_clamped = a > limit
    ac = jnp.where(a_clamped, limit, a)
    b_clamped = (b > limit) | (b < -limit)
    bc = jnp.where(b > limit, limit, jnp.where(b < -limit, -limit, b)) + linear_offset
    s = jax.nn.sigmoid(alpha * ac)
    gate = ac * s
    d_gate = s * (1 + alpha * ac * (1 - s))
    return gate * bc, jnp.where(a_clamped, 0.0, bc * d_gate), jnp.where(b_clamped, 0.0, gate)
  r = jnp.where(a <= 0, 0.0, a)
  return r * r, 2 * r, None


def scaled_activation(x, scales, activation="swiglu", limit=7.0, alpha=1.702,
                      linear_offset=1.0):
  """act(x) * scales[..., None], computed in fp32, returned in x's dtype."""
  act = activation_f32(x, activation, limit, alpha, linear_offset)
  return (act * scales.astype(jnp.float32)[..., None]).astype(x.dtype)


def scaled_activation_backward_f32(dy, x, scales, activation, limit, alpha, linear_offset):
  """(dx fp32 [..., W], dscales fp32 [...]) of the fused backward pass."""
  value, da, db = activation_grad(x, activation, limit, alpha, linear_offset)
  g = dy.astype(jnp.float32)
  gs = g * scales.astype(jnp.float32)[..., None]
  dx = gs * da if db is None else jnp.concatenate([gs * da, gs * db], axis=-1)
  return dx, jnp.sum(g * value, axis=-1)
