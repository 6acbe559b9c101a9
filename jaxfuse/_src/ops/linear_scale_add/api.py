"""Public linear_scale_add: validation, implementation choice, custom_vjp."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxfuse._src import checks
from jaxfuse._src import compat
from jaxfuse._src import implementation as implementation_lib
from jaxfuse._src.ops.linear_scale_add import ffi
from jaxfuse._src.ops.linear_scale_add import reference


def _validate(x, kernel, residual, alpha, recipe) -> float:
  x_dtype = checks.check_float_array("x", x)
  kernel_dtype = checks.check_float_array("kernel", kernel)
  residual_dtype = checks.check_float_array("residual", residual)
  checks.check_min_rank("x", x, 1, "[..., K]")
  checks.check_rank("kernel", kernel, 2, "[K, N]")
  checks.check_min_rank("residual", residual, 1, "[..., N]")
  if kernel_dtype != x_dtype:
    raise TypeError(f"kernel dtype {kernel_dtype} must equal x dtype {x_dtype} "
                    "(cast both to the compute dtype first)")
  if residual_dtype not in (x_dtype, jnp.dtype(jnp.float32)):
    raise TypeError(f"residual dtype must be x's dtype ({x_dtype}) or float32, "
                    f"got {residual_dtype}")
  k, n = kernel.shape
  if x.shape[-1] != k:
    raise ValueError(f"x's last dimension ({x.shape[-1]}) must equal kernel.shape[0] ({k}); "
                     f"x is {x.shape}, kernel is {kernel.shape}")
  expected_residual = (*x.shape[:-1], n)
  if residual.shape != expected_residual:
    raise ValueError(f"residual must have shape {expected_residual} (x's leading shape, "
                     f"kernel.shape[1]), got {residual.shape}")
  if recipe is not None:
    raise NotImplementedError("linear_scale_add: FP8 recipes are not implemented yet")
  return checks.static_float("alpha", alpha)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _linear_scale_add_ffi(x, kernel, residual, alpha, varying_axes):
  out, _ = _forward(x, kernel, residual, alpha, varying_axes)
  return out


def _forward(x, kernel, residual, alpha, varying_axes):
  del varying_axes  # used by the backward pass only
  # residual goes in with its own shape: a reshape of an aliased operand costs a copy.
  out = ffi.linear_scale_add(x, kernel, residual, alpha=alpha)
  return out, (x, kernel)


def _backward(alpha, varying_axes, saved, d_out):
  x, kernel = saved
  k, n = kernel.shape
  # Both backward GEMMs carry alpha in their epilogue (TransformerEngine's
  # BackwardLinearScale); the cotangent is cast to the compute dtype as TE does.
  d_out_compute = d_out.astype(x.dtype)
  d_x = ffi.scaled_matmul(d_out_compute, kernel, alpha=alpha, transpose_b=True)
  d_kernel = ffi.scaled_matmul(x.reshape(-1, k), d_out_compute.reshape(-1, n), alpha=alpha,
                               transpose_a=True)
  # Inside shard_map, gradients of replicated operands are summed over the devices.
  return tuple(compat.match_varying_axes(cotangent, axes)
               for cotangent, axes in zip((d_x, d_kernel, d_out), varying_axes))


_linear_scale_add_ffi.defvjp(_forward, _backward)


def linear_scale_add(x: jax.Array, kernel: jax.Array, residual: jax.Array,
                     alpha: float = 1.0, *, recipe=None,
                     implementation: str | None = None) -> jax.Array:
  """residual + alpha * (x @ kernel) as one GEMM that accumulates into the residual.

  TransformerEngine's ForwardLinearScaleAdd: the product is computed with fp32
  accumulation, scaled by alpha in the GEMM epilogue and added to the residual in the
  same kernel (cuBLASLt with beta = 1 and C = D = residual on GPU). The result is written
  into residual's buffer: donate ``residual`` under ``jax.jit`` and no copy is made.

  Args:
    x: [..., K], float32, bfloat16 or float16.
    kernel: [K, N], the same dtype as x (Flax layout: [in_features, out_features]).
    residual: [..., N] with x's leading shape; x's dtype or float32.
    alpha: a static real scalar (0 and negative values are fine).
    recipe: reserved for FP8 recipes (not implemented yet: must be None).
    implementation: None, "ffi" or "xla"; see ``jaxfuse`` module docs.

  Returns:
    residual + alpha * x @ kernel, with residual's shape and dtype.

  Differentiable in x, kernel and residual: dx = alpha * dy @ kernel.T,
  dkernel = alpha * x.T @ dy, dresidual = dy.

  Raises:
    TypeError: non-float or mixed dtypes, or an alpha that is not a static real scalar.
    ValueError: mismatched ranks or sizes.
  """
  alpha = _validate(x, kernel, residual, alpha, recipe)
  if implementation_lib.resolve(implementation) == "xla":
    return reference.linear_scale_add(x, kernel, residual, alpha)
  # shard_map's varying-axes types of the operands, for the backward pass (static).
  varying_axes = tuple(compat.varying_axes(a) for a in (x, kernel, residual))
  return _linear_scale_add_ffi(x, kernel, residual, alpha, varying_axes)


def flops(x_shape, kernel_shape) -> int:
  """Multiply-adds counted twice: the forward GEMM's floating-point operations."""
  return 2 * math.prod(x_shape[:-1]) * kernel_shape[0] * kernel_shape[1]
