"""Public scaled_activation: validation, implementation choice, custom_vjp."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfuse._src import checks
from jaxfuse._src import compat
from jaxfuse._src import implementation as implementation_lib
from jaxfuse._src.ops.scaled_activation import sharding
from jaxfuse._src.ops.scaled_activation import reference


def validate(x, scales, activation, limit, alpha, linear_offset):
  """Checks the arguments; returns the static (limit, alpha, linear_offset) as floats."""
  if activation not in reference.ACTIVATIONS:
    raise ValueError(f"activation must be one of {reference.ACTIVATIONS}, got {activation!r}")
  x_dtype = checks.check_float_array("x", x)
  scales_dtype = checks.check_float_array("scales", scales)
  checks.check_min_rank("x", x, 1, "[..., W]")
  if activation in reference.GLU and x.shape[-1] % 2 != 0:
    raise ValueError(f"x's last dimension must be even for {activation} ([..., 2F], gate "
                     f"first), got {x.shape[-1]}")
  if scales_dtype not in (jnp.dtype(jnp.float32), x_dtype):
    raise TypeError(f"scales dtype must be float32 or x's dtype ({x_dtype}), got {scales_dtype}")
  if tuple(scales.shape) != tuple(x.shape[:-1]):
    raise ValueError(f"scales must have shape {tuple(x.shape[:-1])} (one value per row of x), "
                     f"got {tuple(scales.shape)}")
  return (checks.static_float("limit", limit), checks.static_float("alpha", alpha),
          checks.static_float("linear_offset", linear_offset))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _scaled_activation_ffi(x, scales, activation, limit, alpha, linear_offset, varying_axes):
  del varying_axes
  return sharding.forward(x, scales, activation=activation, limit=limit, alpha=alpha,
                          linear_offset=linear_offset)


def _forward(x, scales, activation, limit, alpha, linear_offset, varying_axes):
  del varying_axes
  out = sharding.forward(x, scales, activation=activation, limit=limit, alpha=alpha,
                         linear_offset=linear_offset)
  return out, (x, scales)


def _backward(activation, limit, alpha, linear_offset, varying_axes, saved, dy):
  x, scales = saved
  # One fused kernel reads dy, x and scales once and writes dx and dscales. dscales is
  # always computed (it costs a register reduction over data the kernel reads anyway);
  # JAX drops it when scales needs no gradient.
  dx, dscales = sharding.backward(dy.astype(x.dtype), x, scales, activation=activation,
                                  limit=limit,
                                  alpha=alpha, linear_offset=linear_offset)
  dscales = dscales.astype(scales.dtype)
  return tuple(compat.match_varying_axes(c, axes)
               for c, axes in zip((dx, dscales), varying_axes))


_scaled_activation_ffi.defvjp(_forward, _backward)


def scaled_activation(x: jax.Array, scales: jax.Array, activation: str = "swiglu", *,
                      limit: float = 7.0, alpha: float = 1.702, linear_offset: float = 1.0,
                      implementation: str | None = None) -> jax.Array:
  """act(x) * scales[..., None], one memory-bound kernel.

  Args:
    x: [..., 2F] for the GLU kinds (the gate in the first half), [..., F] for srelu;
      float32, bfloat16 or float16.
    scales: [...] (= x.shape[:-1]), one value per row, float32 or x's dtype (e.g. the MoE
      router probabilities).
    activation: "swiglu" (silu(a) * b), "clamped_swiglu" (a' = min(a, limit),
      b' = clip(b, -limit, limit) + linear_offset, a' * sigmoid(alpha * a') * b') or
      "srelu" (relu(x)**2).
    limit, alpha, linear_offset: static floats used by clamped_swiglu, as float32 values
      (the math is fp32: a limit of 1.9999999999999991 acts as 2.0).
    implementation: None, "ffi" or "xla"; see the ``jaxfuse`` module docs.

  Returns:
    [..., F] in x's dtype. All math in fp32, one rounding at the store. NaN inputs give NaN
    outputs; sigmoid is computed stably (silu(-1e4) = -0). The CUDA kernels take the
    sigmoid's exp and reciprocal from the hardware approximations (under 1e-6 relative
    error for |x| < 8; a sigmoid below 2^-126 is 0), the CPU handler from libm.

  Differentiable in x and scales: dx = (dy * scale) * act'(x) and
  dscales[row] = sum_j dy_j * act_j(x) (fp32 reduction), both from one fused kernel.
  """
  limit, alpha, linear_offset = validate(x, scales, activation, limit, alpha, linear_offset)
  if implementation_lib.resolve(implementation) == "xla":
    return reference.scaled_activation(x, scales, activation, limit, alpha, linear_offset)
  varying_axes = tuple(compat.varying_axes(a) for a in (x, scales))
  return _scaled_activation_ffi(x, scales, activation, limit, alpha, linear_offset, varying_axes)
