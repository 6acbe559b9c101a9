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
from jaxfuse._src.ops.quantize import kernels as quantized_kernels
from jaxfuse.quantization import recipes


def _kernel_facts(kernel) -> tuple[jnp.dtype, tuple[int, int]]:
  """(dtype, [K, N] shape) of the kernel: a float array, or a ``quantize_kernel`` result
  (its original dtype and logical shape).

  Raises TypeError for other QuantizedArrays and non-float arrays, ValueError for a rank
  other than 2 or a quantized kernel whose arrays disagree in shape.
  """
  if not quantized_kernels.is_quantized_kernel(kernel):
    dtype = checks.check_float_array("kernel", kernel)
    checks.check_rank("kernel", kernel, 2, "[K, N]")
    return dtype, tuple(kernel.shape)
  if kernel.scaling_mode != "per_kernel":
    raise TypeError("a quantized kernel for linear_scale_add must come from "
                    "jaxfuse.quantize_kernel (scaling_mode 'per_kernel'), got scaling_mode "
                    f"{kernel.scaling_mode!r}")
  if kernel.data.dtype != jnp.dtype(jnp.float8_e4m3fn) or kernel.data.ndim != 2:
    raise TypeError("a quantized kernel holds float8_e4m3fn data [N, K], got "
                    f"{kernel.data.dtype} {tuple(kernel.data.shape)}")
  n, k = kernel.data.shape
  if tuple(kernel.scale_inv.shape) != (1,):
    raise ValueError("a quantized kernel needs scale_inv float32 [1] (one per tensor), got "
                     f"{tuple(kernel.scale_inv.shape)}")
  quantized_kernels.check_copy_arrays("kernel", kernel, (k, n), "transposed")
  return jnp.dtype(kernel.dtype), (k, n)


def _recipe_for(recipe, kernel):
  """The call's FP8 recipe: `recipe`, or for a quantized kernel and recipe=None the one it
  was made with (which an explicit recipe must equal)."""
  if not quantized_kernels.is_quantized_kernel(kernel):
    return recipe
  if recipe is None:
    return kernel.recipe
  if kernel.recipe != recipe:
    raise ValueError(f"a quantized kernel made with {kernel.recipe!r} cannot run with "
                     f"recipe={recipe!r}; quantize it with the call's recipe")
  return recipe


def _validate(x, kernel, residual, alpha, recipe) -> float:
  x_dtype = checks.check_float_array("x", x)
  kernel_dtype, (k, n) = _kernel_facts(kernel)
  residual_dtype = checks.check_float_array("residual", residual)
  checks.check_min_rank("x", x, 1, "[..., K]")
  checks.check_min_rank("residual", residual, 1, "[..., N]")
  if kernel_dtype != x_dtype:
    raise TypeError(f"kernel dtype {kernel_dtype} must equal x dtype {x_dtype} "
                    "(cast both to the compute dtype first)")
  if residual_dtype not in (x_dtype, jnp.dtype(jnp.float32)):
    raise TypeError(f"residual dtype must be x's dtype ({x_dtype}) or float32, "
                    f"got {residual_dtype}")
  if x.shape[-1] != k:
    raise ValueError(f"x's last dimension ({x.shape[-1]}) must equal kernel.shape[0] ({k}); "
                     f"x is {x.shape}, kernel is {(k, n)}")
  expected_residual = (*x.shape[:-1], n)
  if residual.shape != expected_residual:
    raise ValueError(f"residual must have shape {expected_residual} (x's leading shape, "
                     f"kernel.shape[1]), got {residual.shape}")
  if recipe is not None:
    _validate_fp8(x, (k, n), recipe)
  return checks.static_float("alpha", alpha)


# cuBLASLt's FP8 GEMMs need 16-byte (16-element) aligned leading dimensions; the backward
# pass multiplies transposed copies, so the row count is a leading dimension too.
_FP8_ALIGNMENT = 16


def _validate_fp8(x, kernel_shape, recipe) -> None:
  if not isinstance(recipe, recipes.Float8CurrentScaling) or recipe.per_group:
    raise ValueError("linear_scale_add supports recipe=Float8CurrentScaling(per_group=False) "
                     f"(per-tensor current scaling), got {recipe!r}")
  k, n = kernel_shape
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
  k = x.shape[-1]
  frozen = quantized_kernels.is_frozen_kernel(kernel)
  kernel_t_fp8, kernel_scale_inv, kernel_fp8 = _kernel_fp8(kernel, recipe, for_backward)
  if for_backward and not frozen:
    # x's FP8 values in both layouts from one pass: [M, K] for this GEMM and [K, M] (the
    # wgrad's K-major operand) saved, instead of an XLA transpose of the FP8 x later. A
    # frozen kernel gets no wgrad, so x is needed in one layout only.
    x_t_fp8, x_scale_inv, x_fp8 = _quantize_both_layouts(x.reshape(-1, k),
                                                         recipe.forward_format)
  else:
    x_fp8, x_scale_inv = _quantize(x.reshape(-1, k), recipe, "forward")
    x_t_fp8 = None
  out = sharding.linear_scale_add_fp8(x_fp8.reshape(x.shape), kernel_t_fp8, residual,
                                      x_scale_inv, kernel_scale_inv, alpha=alpha,
                                      fast_accumulation=recipe.forward_fast_accumulation)
  if not for_backward:
    return out, None
  saved = (x_t_fp8, x_scale_inv, kernel_fp8, kernel_scale_inv, jnp.zeros((0,), x.dtype),
           quantized_kernels.cotangent_template(kernel))
  return out, saved


def _kernel_fp8(kernel, recipe, for_backward):
  """(data [N, K], scale_inv float32 [1], and when a backward follows data [K, N], else
  None): the kernel's E4M3 values, quantized now from a 16-bit kernel in one pass that
  writes both layouts, or those of a ``quantize_kernel`` result as they are (gradient
  stopped; a frozen copy's [K, N] layout is its [N, K] data transposed)."""
  if not quantized_kernels.is_quantized_kernel(kernel):
    from jaxfuse._src.ops.quantize import api as quantize_api  # pylint: disable=g-import-not-at-top
    data_t, scale_inv, *data = quantize_api.quantize_batches_transposed(
        kernel[None], recipe.forward_format, untransposed=for_backward)
    return data_t[0], scale_inv, data[0][0] if for_backward else None
  data_t, scale_inv = (jax.lax.stop_gradient(a) for a in (kernel.data, kernel.scale_inv))
  if not for_backward:
    return data_t, scale_inv, None
  straight = kernel.data_untransposed
  return data_t, scale_inv, data_t.T if straight is None else jax.lax.stop_gradient(straight)


def _quantize_both_layouts(value, fmt):
  """Per-tensor current scaling of value [R, C] in one pass that writes both layouts:
  (data [C, R], scale_inv float32 [1], data [R, C]); the same values and scale as
  ``_quantize`` with a per-tensor recipe (quantize_batches_transposed)."""
  from jaxfuse._src.ops.quantize import api as quantize_api  # pylint: disable=g-import-not-at-top
  data_t, scale_inv, data = quantize_api.quantize_batches_transposed(value[None], fmt,
                                                                     untransposed=True)
  return data_t[0], scale_inv, data[0]


def _fp8_backward(alpha, recipe, varying_axes, saved, d_out):
  x_t_fp8, x_scale_inv, kernel_fp8, kernel_scale_inv, x_like, template = saved
  k, n = kernel_fp8.shape
  d_out_rows = d_out.reshape(-1, n)
  # Gradients in E5M2; split (non-fast) accumulation in both backward GEMMs, as TE does.
  if x_t_fp8 is None:  # a frozen quantized kernel: the dgrad alone, dy in one layout
    dy_fp8, dy_scale_inv = _quantize(d_out_rows, recipe, "gradient")
  else:
    # dy in both layouts from one pass: [M, N] for the dgrad, [N, M] for the wgrad, whose
    # FP8 operands must both be K-major (the contraction runs over the M rows).
    dy_t_fp8, dy_scale_inv, dy_fp8 = _quantize_both_layouts(d_out_rows, recipe.gradient_format)
  d_x = sharding.scaled_matmul_fp8(dy_fp8, kernel_fp8, dy_scale_inv, kernel_scale_inv,
                                   alpha=alpha, out_dtype=x_like.dtype)
  d_x = compat.match_varying_axes(d_x.reshape(*d_out.shape[:-1], k), varying_axes[0])
  d_residual = compat.match_varying_axes(d_out, varying_axes[2])
  if x_t_fp8 is None:
    return d_x, None, d_residual
  # In x's dtype, which is the kernel's (a trainable quantized kernel's: its master's).
  d_kernel = sharding.scaled_matmul_fp8(x_t_fp8, dy_t_fp8, x_scale_inv, dy_scale_inv,
                                        alpha=alpha, out_dtype=x_like.dtype)
  d_kernel = compat.match_varying_axes(d_kernel, varying_axes[1])
  return d_x, quantized_kernels.kernel_cotangent(template, d_kernel), d_residual


_linear_scale_add_fp8.defvjp(_fp8_forward, _fp8_backward)


def linear_scale_add(x: jax.Array, kernel: jax.Array, residual: jax.Array,
                     alpha: float = 1.0, *, recipe=None,
                     implementation: str | None = None) -> jax.Array:
  """residual + alpha * (x @ kernel) as one GEMM that accumulates into the residual.

  TransformerEngine's ForwardLinearScaleAdd: the product is computed with fp32
  accumulation, scaled by alpha in the GEMM epilogue and added to the residual in the
  same kernel, whose output tiles overwrite the residual's. It is written into residual's
  buffer: donate ``residual`` under ``jax.jit`` and no copy is made.

  Rounding: the residual is added to alpha * x @ kernel in fp32 and the sum rounded once
  to residual's dtype: in the jnp reference, the CPU handler, and on the GPU the 16-bit
  forward (x, kernel and residual all bfloat16 or all float16) where K and N are
  multiples of 8 and the operands 16-byte aligned: a CUTLASS SM90 GEMM whose epilogue
  reads the residual tile. Every other GPU product runs on cuBLASLt, whose tensor-core
  epilogue rounds alpha * x @ kernel to a 16-bit output type before adding the residual
  (every algorithm its heuristic offered, H100, cuBLAS 13.1;
  ``scripts/probe_linear_rounding.py``), as XLA's own fused bf16 GEMM + add does: there a
  bf16 or f16 result errs by up to half an ulp of |alpha * x @ kernel| more. That
  includes the FP8 forward's 16-bit result, an extra error far below FP8's own:
  ``JAXFUSE_LINEAR_SCALE_ADD_GEMM=cutlass`` runs it on a CUTLASS FP8 GEMM that rounds
  once, which made the FP8 step 1-3.5% slower on an H100 (session 53).
  ``JAXFUSE_LINEAR_SCALE_ADD_GEMM=cublaslt`` runs the 16-bit forward on cuBLASLt as well
  (A/B runs). Split-K cuBLASLt algorithms are kept to fp32 partial sums, so no further
  rounding is added.

  Args:
    x: [..., K], float32, bfloat16 or float16.
    kernel: [K, N], the same dtype as x (Flax layout: [in_features, out_features]); with
      the FP8 recipe also a ``jaxfuse.quantize_kernel`` result (weights quantized once).
    residual: [..., N] with x's leading shape; x's dtype or float32.
    alpha: a static real scalar (0 and negative values are fine).
    recipe: None (bf16/f16/f32 GEMM) or
      ``jaxfuse.quantization.Float8CurrentScaling(per_group=False)``: x and kernel are
      quantized to E4M3 with one current scale per tensor, the GEMM runs on the FP8 tensor
      cores (cuBLASLt, scale pointers on the device, fast accumulation unless the recipe
      says otherwise) and accumulates into the residual in place; the backward GEMMs run in FP8 too, with E5M2 gradients.
      K, N and the row count must be multiples of 16. Expected accuracy against the bf16
      op: about 2-4% relative (Frobenius) error for unit-variance data.
    implementation: None, "ffi" or "xla"; see ``jaxfuse`` module docs.

  Returns:
    residual + alpha * x @ kernel, with residual's shape and dtype.

  Differentiable in x, kernel and residual: dx = alpha * dy @ kernel.T,
  dkernel = alpha * x.T @ dy, dresidual = dy. A quantized kernel gets no gradient, unless
  it is trainable (``quantize_kernel(..., trainable=True)``): then its master does.

  Raises:
    TypeError: non-float or mixed dtypes, an alpha that is not a static real scalar, or a
      QuantizedArray kernel that is not a ``quantize_kernel`` result.
    ValueError: mismatched ranks or sizes; a recipe other than the quantized kernel's.
  """
  recipe = _recipe_for(recipe, kernel)
  alpha = _validate(x, kernel, residual, alpha, recipe)
  if implementation_lib.resolve(implementation) == "xla":
    if recipe is not None:
      return reference.linear_scale_add_fp8(x, kernel, residual, alpha, recipe)
    return reference.linear_scale_add(x, kernel, residual, alpha)
  # shard_map's varying-axes types of the operands, for the backward pass (static).
  varying_axes = tuple(compat.varying_axes(a) for a in
                       (x, kernel.data if quantized_kernels.is_quantized_kernel(kernel) else kernel,
                        residual))
  if recipe is not None:
    return _linear_scale_add_fp8(x, kernel, residual, alpha, recipe, varying_axes)
  return _linear_scale_add_ffi(x, kernel, residual, alpha, varying_axes)


def quantize_kernel(kernel: jax.Array, recipe, *, trainable: bool = False,
                    implementation: str | None = None) -> recipes.QuantizedArray:
  """The FP8 weights of a dense kernel for ``linear_scale_add``, quantized once.

  With ``recipe=Float8CurrentScaling(per_group=False)`` linear_scale_add quantizes its
  16-bit kernel on every call: an amax pass and a pass that writes it transposed (the
  K-major layout of the FP8 GEMM), and when a backward follows also untransposed (the
  dgrad's). For weights that do not change between calls (inference, the micro-batches of
  one optimizer step) quantize them once here and pass the result as the kernel: the same
  FP8 values and results, without the two passes over the weights. The dense counterpart
  of ``quantize_experts``.

  With ``trainable=True`` the result also keeps ``kernel`` (as ``master``) and the FP8
  values in [K, N], from the same pass: linear_scale_add then computes the kernel's
  gradient as from the 16-bit kernel (the wgrad reads x and dy, not the weights) and
  returns it through ``master`` to ``kernel`` (use the cotangent's ``.master``: returning
  the whole cotangent from a jitted step also writes zeros for its FP8 leaves). A result
  without a master is a constant: its backward runs the dgrad alone (no wgrad GEMM, x
  quantized in one layout).

  Args:
    kernel: [K, N] float32/bfloat16/float16, linear_scale_add's kernel layout.
    recipe: ``jaxfuse.quantization.Float8CurrentScaling(per_group=False)`` with E4M3
      forward tensors (the call that takes the result must use the same recipe).
    trainable: keep the kernel for its gradient (above).
    implementation: None, "ffi" or "xla" (same values).

  Returns:
    QuantizedArray with scaling_mode "per_kernel": data float8_e4m3fn [N, K] (the kernel
    transposed), scale_inv float32 [1] (1 / (448 / amax); 1 for an all-zero kernel),
    dtype kernel.dtype; with ``trainable`` also data_untransposed float8_e4m3fn [K, N] and
    master = kernel. ``jaxfuse.dequantize`` gives back [K, N].

  Raises:
    TypeError: kernel not a float array.
    ValueError: kernel not of rank 2, or a recipe other than per-tensor current scaling
      with E4M3 forward tensors.
  """
  if not isinstance(recipe, recipes.Float8CurrentScaling) or recipe.per_group:
    raise ValueError("quantize_kernel takes recipe=Float8CurrentScaling(per_group=False) (one "
                     f"scale per tensor, linear_scale_add's FP8 recipe), got {recipe!r}")
  if recipe.forward_format != "e4m3":
    raise ValueError("the FP8 linear_scale_add takes E4M3 weights: recipe.forward_format must "
                     f"be 'e4m3', got {recipe.forward_format!r}")
  dtype = checks.check_float_array("kernel", kernel)
  checks.check_rank("kernel", kernel, 2, "[K, N]")
  value = jax.lax.stop_gradient(kernel)
  if implementation_lib.resolve(implementation) == "xla":
    from jaxfuse._src.ops.quantize import api as quantize_api  # pylint: disable=g-import-not-at-top
    q = quantize_api.quantize(value.T, recipe, role="forward", implementation="xla")
    data, scale_inv, straight = q.data, q.scale_inv, q.data.T
  else:
    data, scale_inv, straight = _kernel_fp8(value, recipe, for_backward=trainable)
  return recipes.QuantizedArray(data=data, scale_inv=scale_inv,
                                data_untransposed=straight if trainable else None,
                                master=kernel if trainable else None, recipe=recipe,
                                scaling_mode="per_kernel", dtype=dtype, role="forward")


def flops(x_shape, kernel_shape) -> int:
  """Multiply-adds counted twice: the forward GEMM's floating-point operations."""
  return 2 * math.prod(x_shape[:-1]) * kernel_shape[0] * kernel_shape[1]
