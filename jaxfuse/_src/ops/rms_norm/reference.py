"""Pure-jnp specification of rms_norm and add_rms_norm (the "xla" implementation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rsigma(s: jax.Array, eps: float) -> jax.Array:
  """1 / sqrt(mean(s^2) + eps) over the last axis, in fp32: shape s.shape[:-1]."""
  s32 = s.astype(jnp.float32)
  return jax.lax.rsqrt(jnp.mean(s32 * s32, axis=-1) + jnp.float32(eps))


def _scale(gamma: jax.Array, zero_centered_gamma: bool) -> jax.Array:
  gamma32 = gamma.astype(jnp.float32)
  return 1.0 + gamma32 if zero_centered_gamma else gamma32


def rms_norm(x: jax.Array, gamma: jax.Array, eps: float,
             zero_centered_gamma: bool = False) -> jax.Array:
  """(x * rsigma) * g in fp32, rounded once to x.dtype; g = gamma or 1 + gamma."""
  normalized = x.astype(jnp.float32) * rsigma(x, eps)[..., None]
  return (normalized * _scale(gamma, zero_centered_gamma)).astype(x.dtype)


def add_rms_norm(x: jax.Array, residual: jax.Array, gamma: jax.Array, eps: float,
                 zero_centered_gamma: bool = False) -> tuple[jax.Array, jax.Array]:
  """(rms_norm(s), s) with s = x + residual added in fp32 and rounded to residual.dtype.

  The normalization reads s as rounded (as stored), so out == rms_norm(new_residual).
  """
  s = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(residual.dtype)
  return rms_norm(s, gamma, eps, zero_centered_gamma), s
