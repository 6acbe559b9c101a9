"""Public linear_scale_add: validation, implementation choice, custom_vjp."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxfuse._src import checks
from jaxfuse._src import compat
from jaxfuse._src import implementation as implementation_lib
from jaxfuse._src.ops.linear_scale_add import reference
from jaxfuse._src.ops.linear_scale_add import sharding


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
    _validate_fp8(x, kernel, recipe)
  return checks.static_float("alpha", alpha)


# cuBLASLt's FP8 GEMMs need 16-byte (16-element) aligned leading dimensions; the backward
# pass multiplies transposed copies, so the row count is a leading dimension too.
_FP8_ALIGNMENT = 16


def _validate_fp8(x, kernel, recipe) -> None:
  from jaxfuse.quantization import Float8CurrentScaling  # pylint: disable=g-import-not-at-top
  if not isinstance(recipe, Float8CurrentScaling) or recipe.per_group:
    raise ValueError("linear_scale_add supports recipe=Float8CurrentScaling(per_group=False) "
                     f"(per-tensor current scaling), got {recipe!r}")
  k, n = kernel.shape
  rows = math.prod(x.shape[:-1])
  for name, size in (("K (x.shape[-1])", k), ("N (kernel.shape[1])", n),
                     ("the row count of x (prod(x.shape[:-1]))", rows)):
    if size % _FP8_ALIGNMENT:
      raise ValueError(f"FP8 linear_scale_add needs {name} to be a multiple of "
                       f"{_FP8_ALIGNMENT}, got {size}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _linear_scale_add_ffi(x, kernel, residual, alpha, varying_axes):
  out, _ = _forward(x, kernel, residual, alpha, varying_axes)
  return out


def _forward(x, kernel, residual, alpha, varying_axes):
  del varying_axes  # used by the backward pass only
  # residual goes in with its own shape: a reshape of an aliased operand costs a copy.
  out = sharding.linear_scale_add(x, kernel, residual, alpha=alpha, transpose_a=False,
                                  transpose_b=False)
  return out, (x, kernel)


def _backward(alpha, varying_axes, saved, d_out):
  x, kernel = saved
  k, n = kernel.shape
  # Both backward GEMMs carry alpha in their epilogue (TransformerEngine's
  # BackwardLinearScale); the cotangent is cast to the compute dtype as TE does.
  d_out_compute = d_out.astype(x.dtype)
  d_x = sharding.scaled_matmul(d_out_compute, kernel, alpha=alpha, transpose_b=True)
  d_kernel = sharding.scaled_matmul(x.reshape(-1, k), d_out_compute.reshape(-1, n), alpha=alpha,
                               transpose_a=True)
  # Inside shard_map, gradients of replicated operands are summed over the devices.
  return tuple(compat.match_varying_axes(cotangent, axes)
               for cotangent, axes in zip((d_x, d_kernel, d_out), varying_axes))


_linear_scale_add_ffi.defvjp(_forward, _backward)


# --- FP8 (per-tensor current scaling) ------------------------------------------------


def _quantize(value, recipe, role):
  from jaxfuse._src.ops.quantize import api as quantize_api  # pylint: disable=g-import-not-at-top
  q = quantize_api.quantize(value, recipe, role=role, implementation="ffi")
  return q.data, q.scale_inv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _linear_scale_add_fp8(x, kernel, residual, alpha, recipe, varying_axes):
  out, _ = _fp8_forward(x, kernel, residual, alpha, recipe, varying_axes, for_backward=False)
  return out


def _fp8_forward(x, kernel, residual, alpha, recipe, varying_axes, for_backward=True):
  del varying_axes
  from jaxfuse._src.ops.quantize import api as quantize_api  # pylint: disable=g-import-not-at-top
  k = kernel.shape[0]
  # E4M3 with one scale per tensor. The kernel goes in transposed ([N, K], K-major) from
  # one quantizing pass, which also writes the [K, N] copy the dgrad takes when a backward
  # follows (no transpose of the bf16 kernel here, none of the FP8 one there).
  kernel_t_fp8, kernel_scale_inv, *kernel_fp8 = quantize_api.quantize_batches_transposed(
      kernel[None], recipe.forward_format, untransposed=for_backward)
  if for_backward:
    # x's FP8 values in both layouts from one pass: [M, K] for this GEMM and [K, M] (the
    # wgrad's K-major operand) saved, instead of an XLA transpose of the FP8 x later.
    x_t_fp8, x_scale_inv, x_fp8 = _quantize_both_layouts(x.reshape(-1, k),
                                                         recipe.forward_format)
  else:
    x_fp8, x_scale_inv = _quantize(x.reshape(-1, k), recipe, "forward")
  out = sharding.linear_scale_add_fp8(x_fp8.reshape(x.shape), kernel_t_fp8[0], residual,
                                      x_scale_inv, kernel_scale_inv, alpha=alpha,
                                      fast_accumulation=recipe.forward_fast_accumulation)
  if not for_backward:
    return out, None
  saved = (x_t_fp8, x_scale_inv, kernel_fp8[0][0], kernel_scale_inv,
           jnp.zeros((0,), x.dtype), jnp.zeros((0,), kernel.dtype))
  return out, saved


def _quantize_both_layouts(value, fmt):
  """Per-tensor current scaling of value [R, C] in one pass that writes both layouts:
  (data [C, R], scale_inv float32 [1], data [R, C]); the same values and scale as
  ``_quantize`` with a per-tensor recipe (quantize_batches_transposed)."""
  from jaxfuse._src.ops.quantize import api as quantize_api  # pylint: disable=g-import-not-at-top
  data_t, scale_inv, data = quantize_api.quantize_batches_transposed(value[None], fmt,
                                                                     untransposed=True)
  return data_t[0], scale_inv, data[0]


def _fp8_backward(alpha, recipe, varying_axes, saved, d_out):
  x_t_fp8, x_scale_inv, kernel_fp8, kernel_scale_inv, x_like, kernel_like = saved
  k, n = kernel_fp8.shape
  # Gradients in E5M2; split (non-fast) accumulation in both backward GEMMs, as TE does.
  # dy in both layouts from one pass: [M, N] for the dgrad, [N, M] for the wgrad, whose
  # FP8 operands must both be K-major (the contraction runs over the M rows).
  dy_t_fp8, dy_scale_inv, dy_fp8 = _quantize_both_layouts(d_out.reshape(-1, n),
                                                          recipe.gradient_format)
  d_x = sharding.scaled_matmul_fp8(dy_fp8, kernel_fp8, dy_scale_inv, kernel_scale_inv,
                                   alpha=alpha, out_dtype=x_like.dtype)
  d_kernel = sharding.scaled_matmul_fp8(x_t_fp8, dy_t_fp8, x_scale_inv, dy_scale_inv,
                                        alpha=alpha, out_dtype=kernel_like.dtype)
  return tuple(compat.match_varying_axes(cotangent, axes) for cotangent, axes in
               zip((d_x.reshape(*d_out.shape[:-1], k), d_kernel, d_out), varying_axes))


_linear_scale_add_fp8.defvjp(_fp8_forward, _fp8_backward)


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
    recipe: None (bf16/f16/f32 GEMM) or
      ``jaxfuse.quantization.Float8CurrentScaling(per_group=False)``: x and kernel are
      quantized to E4M3 with one current scale per tensor, the GEMM runs on the FP8 tensor
      cores (cuBLASLt, scale pointers on the device, fast accumulation) and accumulates
      into the residual in place; the backward GEMMs run in FP8 too, with E5M2 gradients.
      K, N and the row count must be multiples of 16. Expected accuracy against the bf16
      op: about 2-4% relative (Frobenius) error for unit-variance data.
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
    if recipe is not None:
      return reference.linear_scale_add_fp8(x, kernel, residual, alpha, recipe)
    return reference.linear_scale_add(x, kernel, residual, alpha)
  # shard_map's varying-axes types of the operands, for the backward pass (static).
  varying_axes = tuple(compat.varying_axes(a) for a in (x, kernel, residual))
  if recipe is not None:
    return _linear_scale_add_fp8(x, kernel, residual, alpha, recipe, varying_axes)
  return _linear_scale_add_ffi(x, kernel, residual, alpha, varying_axes)


def flops(x_shape, kernel_shape) -> int:
  """Multiply-adds counted twice: the forward GEMM's floating-point operations."""
  return 2 * math.prod(x_shape[:-1]) * kernel_shape[0] * kernel_shape[1]
