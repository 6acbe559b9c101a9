"""Public rms_norm and add_rms_norm: validation, implementation choice, custom_vjp."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._src import checks
from jaxfuse._src import compat
from jaxfuse._src import implementation as implementation_lib
from jaxfuse._src.ops.rms_norm import sharding
from jaxfuse._src.ops.rms_norm import reference


def _validate(x, gamma, eps, zero_centered_gamma, residual=None) -> float:
  x_dtype = checks.check_float_array("x", x)
  gamma_dtype = checks.check_float_array("gamma", gamma)
  checks.check_min_rank("x", x, 1, "[..., H]")
  checks.check_rank("gamma", gamma, 1, "[H]")
  hidden = np.shape(x)[-1]
  if hidden < 1:
    raise ValueError(f"x's last dimension (H) must be >= 1, got shape {np.shape(x)}")
  if np.shape(gamma) != (hidden,):
    raise ValueError(f"gamma must have shape ({hidden},) (x's last dimension), "
                     f"got {np.shape(gamma)}")
  if gamma_dtype not in (x_dtype, jnp.dtype(jnp.float32)):
    raise TypeError(f"gamma dtype must be x's dtype ({x_dtype}) or float32, got {gamma_dtype}")
  if residual is not None:
    residual_dtype = checks.check_float_array("residual", residual)
    if np.shape(residual) != np.shape(x):
      raise ValueError(f"residual must have x's shape {np.shape(x)}, got {np.shape(residual)}")
    if residual_dtype != x_dtype:
      raise TypeError(f"residual dtype must equal x's dtype ({x_dtype}), got {residual_dtype}")
  if not isinstance(zero_centered_gamma, (bool, np.bool_)):
    raise TypeError("zero_centered_gamma must be a bool, got "
                    f"{type(zero_centered_gamma).__name__}")
  eps = checks.static_float("eps", eps)
  if not eps >= 0.0:
    raise ValueError(f"eps must be >= 0, got {eps}")
  return eps


# --- rms_norm ------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rms_norm_ffi(x, gamma, eps, zero_centered_gamma, varying_axes):
  del varying_axes
  out, _ = sharding.rms_norm_fwd(x, gamma, eps=eps, zero_centered_gamma=zero_centered_gamma)
  return out


def _rms_norm_forward(x, gamma, eps, zero_centered_gamma, varying_axes):
  del varying_axes
  out, rsigma = sharding.rms_norm_fwd(x, gamma, eps=eps,
                                      zero_centered_gamma=zero_centered_gamma)
  return out, (x, gamma, rsigma)


def _rms_norm_backward(eps, zero_centered_gamma, varying_axes, saved, d_out):
  del eps
  x, gamma, rsigma = saved
  d_x, d_gamma = sharding.rms_norm_bwd(d_out.astype(x.dtype), x, gamma, rsigma,
                                       zero_centered_gamma=zero_centered_gamma)
  # Inside shard_map, gamma's gradient from sharded rows is summed over the devices.
  return tuple(compat.match_varying_axes(c, axes)
               for c, axes in zip((d_x, d_gamma), varying_axes))


_rms_norm_ffi.defvjp(_rms_norm_forward, _rms_norm_backward)


def rms_norm(x: jax.Array, gamma: jax.Array, eps: float = 1e-6, *,
             zero_centered_gamma: bool = False,
             implementation: str | None = None) -> jax.Array:
  """RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * gamma``.

  Statistics in fp32, one rounding at the store. One kernel reads each row once (it is
  kept in registers between the reduction and the write) and writes the output plus a
  float32 ``rsigma`` per row, which the backward pass reuses.

  Args:
    x: [..., H], float32, bfloat16 or float16 (H >= 1; any H, multiples of 8 (16-bit)
      or 4 (float32) take the vectorized path).
    gamma: [H], x's dtype or float32.
    eps: a static non-negative scalar added to the mean square.
    zero_centered_gamma: scale by (1 + gamma) instead of gamma.
    implementation: None, "ffi" or "xla"; see ``jaxfuse`` module docs.

  Returns:
    [..., H] in x's dtype.

  Differentiable in x and gamma (custom_vjp with a dedicated backward kernel; dgamma is
  reduced over rows in fp32, deterministically).
  """
  eps = _validate(x, gamma, eps, zero_centered_gamma)
  zero_centered_gamma = bool(zero_centered_gamma)
  if implementation_lib.resolve(implementation) == "xla":
    return reference.rms_norm(x, gamma, eps, zero_centered_gamma)
  varying_axes = tuple(compat.varying_axes(a) for a in (x, gamma))
  return _rms_norm_ffi(x, gamma, eps, zero_centered_gamma, varying_axes)


# --- add_rms_norm --------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _add_rms_norm_ffi(x, residual, gamma, eps, zero_centered_gamma, varying_axes):
  del varying_axes
  out, new_residual, _ = sharding.add_rms_norm_fwd(x, residual, gamma, eps=eps,
                                                   zero_centered_gamma=zero_centered_gamma)
  return out, new_residual


def _add_rms_norm_forward(x, residual, gamma, eps, zero_centered_gamma, varying_axes):
  del varying_axes
  # Under differentiation the residual is usually still live (an earlier norm saved it
  # for its backward pass), and an aliased output would make XLA copy it first. Writing
  # the new residual to a fresh buffer costs nothing extra; XLA can still reuse a
  # donated residual's buffer for it. The primal (not differentiated) path aliases.
  out, new_residual, rsigma = sharding.add_rms_norm_fwd(x, residual, gamma, eps=eps,
                                                        zero_centered_gamma=zero_centered_gamma,
                                                        alias=False)
  return (out, new_residual), (new_residual, gamma, rsigma)


def _add_rms_norm_backward(eps, zero_centered_gamma, varying_axes, saved, cotangents):
  del eps
  s, gamma, rsigma = saved
  d_out, d_new_residual = cotangents
  # One kernel: the normalization's input gradient plus the gradient flowing straight
  # into the new residual; it is the gradient of both x and residual.
  d_s, d_gamma = sharding.add_rms_norm_bwd(d_out.astype(s.dtype),
                                           d_new_residual.astype(s.dtype),
                                           s, gamma, rsigma,
                                           zero_centered_gamma=zero_centered_gamma)
  return tuple(compat.match_varying_axes(c, axes)
               for c, axes in zip((d_s, d_s, d_gamma), varying_axes))


_add_rms_norm_ffi.defvjp(_add_rms_norm_forward, _add_rms_norm_backward)


def add_rms_norm(x: jax.Array, residual: jax.Array, gamma: jax.Array, eps: float = 1e-6, *,
                 zero_centered_gamma: bool = False,
                 implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
  """Residual add fused with RMSNorm: ``(rms_norm(x + residual), x + residual)``.

  The sum is formed in fp32, rounded to the residual's dtype, written as the new
  residual and normalized as rounded (so ``out == rms_norm(new_residual)``). The new
  residual is written into ``residual``'s buffer: donate ``residual`` under ``jax.jit``
  and no copy is made.

  Args:
    x: [..., H], float32, bfloat16 or float16.
    residual: x's shape and dtype.
    gamma: [H], x's dtype or float32.
    eps, zero_centered_gamma, implementation: as in ``rms_norm``.

  Returns:
    (normalized [..., H] in x's dtype, new residual [..., H]).

  Differentiable in x, residual and gamma: dx = dresidual = the normalization's input
  gradient plus the cotangent of the new residual.
  """
  eps = _validate(x, gamma, eps, zero_centered_gamma, residual=residual)
  zero_centered_gamma = bool(zero_centered_gamma)
  if implementation_lib.resolve(implementation) == "xla":
    return reference.add_rms_norm(x, residual, gamma, eps, zero_centered_gamma)
  varying_axes = tuple(compat.varying_axes(a) for a in (x, residual, gamma))
  return _add_rms_norm_ffi(x, residual, gamma, eps, zero_centered_gamma, varying_axes)


# --- forward only (inference) ---------------------------------------------------------


def rms_norm_inference(x, gamma, eps: float = 1e-6, *, zero_centered_gamma: bool = False,
                       implementation: str | None = None) -> jax.Array:
  """rms_norm without the custom_vjp: the forward kernel alone, nothing kept for a
  backward pass. Not differentiable on the "ffi" path."""
  eps = _validate(x, gamma, eps, zero_centered_gamma)
  if implementation_lib.resolve(implementation) == "xla":
    return reference.rms_norm(x, gamma, eps, bool(zero_centered_gamma))
  out, _ = sharding.rms_norm_fwd(x, gamma, eps=eps,
                                 zero_centered_gamma=bool(zero_centered_gamma))
  return out


def add_rms_norm_inference(x, residual, gamma, eps: float = 1e-6, *,
                           zero_centered_gamma: bool = False,
                           implementation: str | None = None):
  """add_rms_norm without the custom_vjp (forward kernel alone). Not differentiable on
  the "ffi" path."""
  eps = _validate(x, gamma, eps, zero_centered_gamma, residual=residual)
  if implementation_lib.resolve(implementation) == "xla":
    return reference.add_rms_norm(x, residual, gamma, eps, bool(zero_centered_gamma))
  out, new_residual, _ = sharding.add_rms_norm_fwd(x, residual, gamma, eps=eps,
                                                   zero_centered_gamma=bool(zero_centered_gamma))
  return out, new_residual


def bytes_moved(shape, dtype, *, add: bool, backward: bool = False) -> int:
  """Fewest bytes a kernel must move (for bandwidth figures): forward reads x (and the
  residual) and writes out (and the new residual); backward reads dy, s (and dz) and
  writes dx. gamma and rsigma are ignored."""
  n = int(np.prod(shape)) * jnp.dtype(dtype).itemsize
  if backward:
    return n * (4 if add else 3)
  return n * (4 if add else 2)
