"""Public quantize / dequantize and the fused scaled activation + quantization.

Gradients: quantization is not differentiable. ``quantize`` and
``scaled_activation_quantize`` stop gradients at their inputs (the FP8 result carries no
tangent); differentiate through ``jaxfuse.scaled_activation`` or use
``scaled_dactivation_quantize`` inside a custom_vjp (as grouped_mlp does).
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from jaxfuse._src import checks
from jaxfuse._src import implementation as implementation_lib
from jaxfuse._src.ops.group_offsets import api as offsets_api
from jaxfuse._src.ops.quantize import sharding
from jaxfuse._src.ops.quantize import reference
from jaxfuse._src.ops.scaled_activation import api as act_api
from jaxfuse.quantization import recipes

KINDS = ("activation", "weight")


def _check_recipe(recipe):
  if not isinstance(recipe, recipes.RECIPES):
    raise TypeError("recipe must be Float8CurrentScaling, Float8BlockScaling or "
                    f"MXFP8BlockScaling, got {type(recipe).__name__}")


def scaling_mode_of(recipe, kind: str = "activation") -> tuple[str, int]:
  """(scaling_mode, block) for a recipe and a tensor kind."""
  _check_recipe(recipe)
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  if isinstance(recipe, recipes.Float8CurrentScaling):
    return ("per_group" if recipe.per_group else "per_tensor"), 0
  if isinstance(recipe, recipes.Float8BlockScaling):
    return ("block_2d" if kind == "weight" else "block_1d"), recipe.block_size
  if kind == "weight":
    raise ValueError("MXFP8BlockScaling quantizes 1 x 32 blocks along the last dimension "
                     "only; use kind='activation' (transpose weights so K is last)")
  return "mxfp8", recipe.block_size


def _offsets_for(scaling_mode, rows, group_sizes, group_offsets, implementation):
  """int32 offsets for the handlers: [G + 1] for per_group, [0, rows] per tensor, else [1]."""
  if scaling_mode == "per_group":
    if group_offsets is not None:
      if jnp.result_type(group_offsets) != jnp.int32 or np.ndim(group_offsets) != 1:
        raise TypeError(f"group_offsets must be int32 [G + 1], got "
                        f"{jnp.result_type(group_offsets)} {np.shape(group_offsets)}")
      return group_offsets
    if group_sizes is None:
      raise ValueError("Float8CurrentScaling(per_group=True) needs group_sizes (or "
                       "group_offsets); use per_group=False for one scale per tensor")
    return offsets_api.group_offsets(group_sizes, implementation=implementation)
  if group_sizes is not None:
    offsets_api.check_group_sizes(group_sizes)
  if scaling_mode == "per_tensor":
    return jnp.asarray([0, rows], jnp.int32)
  return jnp.zeros((1,), jnp.int32)


def _wrap(data, scale_inv, offsets, recipe, scaling_mode, block, dtype, role):
  return recipes.QuantizedArray(
      data=data, scale_inv=scale_inv,
      group_offsets=offsets if scaling_mode == "per_group" else None, recipe=recipe,
      scaling_mode=scaling_mode, block_size=block, dtype=jnp.dtype(dtype), role=role)


def quantize(x: jax.Array, recipe, *, group_sizes=None, group_offsets=None,
             role: str = "forward", kind: str = "activation",
             implementation: str | None = None) -> recipes.QuantizedArray:
  """Quantizes x to FP8 with a recipe; returns a QuantizedArray.

  Args:
    x: [..., K] float32/bfloat16/float16 ([..., R, K] for kind="weight").
    recipe: Float8CurrentScaling, Float8BlockScaling or MXFP8BlockScaling.
    group_sizes: int32 [G] (device data), needed by Float8CurrentScaling(per_group=True):
      group g is rows offsets[g]:offsets[g+1] of x viewed as [rows, K]. Rows past
      sum(group_sizes) are stored as zeros. Negative sizes count as zero.
    group_offsets: int32 [G + 1] from ``jaxfuse.group_offsets`` instead of group_sizes
      (offsets computed once and reused).
    role: "forward" (recipe.forward_format, E4M3 by default) or "gradient"
      (recipe.gradient_format: E5M2 for current scaling and MXFP8).
    kind: "activation" (1 x block blocks along K) or "weight" (block x block tiles; only
      Float8BlockScaling distinguishes them).
    implementation: None, "ffi" or "xla".

  Not differentiable: x's gradient is stopped (FP8 values carry no tangent).
  """
  _check_recipe(recipe)
  checks.check_float_array("x", x)
  checks.check_min_rank("x", x, 2 if kind == "weight" else 1,
                        "[..., R, K]" if kind == "weight" else "[..., K]")
  scaling_mode, block = scaling_mode_of(recipe, kind)
  fmt = recipes.fp8_format(recipe, role)
  impl = implementation_lib.resolve(implementation)
  rows = int(np.prod(x.shape[:-1]))
  offsets = _offsets_for(scaling_mode, rows, group_sizes, group_offsets, impl)
  x = jax.lax.stop_gradient(x)
  if impl == "xla":
    data, scale_inv = reference.quantize_values(x, scaling_mode, block, offsets, fmt)
  else:
    data, scale_inv = sharding.quantize(x, offsets, scaling_mode=scaling_mode, block=block,
                                        fmt=fmt)
  return _wrap(data, scale_inv, offsets, recipe, scaling_mode, block, x.dtype, role)


def quantize_batches_transposed(x: jax.Array, fmt: str, *, untransposed: bool = False):
  """Current scaling of each batch of x [B, R, C] (bf16/f16/f32), written transposed.

  Returns (data [B, C, R] FP8 in ``fmt``, scale_inv float32 [B]) and, with
  ``untransposed``, a third result: the same FP8 values in x's layout [B, R, C]. Batch b
  gets one scale from its own amax (NaN counts as 0, as in every quantize kernel), and one
  pass quantizes and transposes with it. The values equal quantizing each transposed batch
  with per-tensor current scaling, without XLA's transpose of x. On the GPU a batch of up to
  ~13 M 16-bit elements (26 MB) is read from DRAM once (a team of blocks holds its tiles
  while it agrees on the amax); larger batches take an amax pass first. The FP8 weights of
  the GEMMs come from here: [N, K] (K-major) for the forward, [K, N] for the dgrad.
  """
  data, scale_inv, straight = sharding.quantize_batches_transposed(x, fmt=fmt,
                                                                   untransposed=untransposed)
  return (data, scale_inv, straight) if untransposed else (data, scale_inv)


def dequantize(q: recipes.QuantizedArray) -> jax.Array:
  """data * scale_inv in q's original dtype (pure jnp; XLA fuses it into its consumer)."""
  if not isinstance(q, recipes.QuantizedArray):
    raise TypeError(f"dequantize expects a QuantizedArray, got {type(q).__name__}")
  return reference.dequantize(q)


def scaled_activation_quantize(x: jax.Array, scales: jax.Array, group_sizes=None,
                               activation: str = "swiglu", *, recipe, group_offsets=None,
                               limit: float = 7.0, alpha: float = 1.702,
                               linear_offset: float = 1.0,
                               implementation: str | None = None) -> recipes.QuantizedArray:
  """FP8 quantization of act(x) * scales[..., None], fused (the FC1 -> FC2 hand-off of an MoE MLP).

  The activation is computed in fp32 and quantized directly (never rounded to x's dtype).
  Block scaling and MXFP8 take one pass over x; current scaling two (pass 1 reduces the
  per-group amax of the activation without writing it, pass 2 recomputes it and writes
  FP8), reading only x and scales. Rows past sum(group_sizes) are zeros under current
  scaling; block / MXFP8 scaling quantize every row (their scales are per row).

  Args:
    x, scales, activation, limit, alpha, linear_offset: as ``jaxfuse.scaled_activation``.
    group_sizes: int32 [G] over the rows of x viewed as [rows, W] (needed by per-group
      current scaling; ignored otherwise). Or ``group_offsets`` int32 [G + 1].
    recipe: the quantization recipe; data is in its forward format.

  Returns:
    QuantizedArray of shape [..., F], role "forward", dtype x.dtype. Not differentiable
    (see ``scaled_dactivation_quantize`` for the backward pass).
  """
  limit, alpha, linear_offset = act_api.validate(x, scales, activation, limit, alpha,
                                                 linear_offset)
  scaling_mode, block = scaling_mode_of(recipe, "activation")
  fmt = recipes.fp8_format(recipe, "forward")
  impl = implementation_lib.resolve(implementation)
  rows = int(np.prod(x.shape[:-1]))
  offsets = _offsets_for(scaling_mode, rows, group_sizes, group_offsets, impl)
  x, scales = jax.lax.stop_gradient(x), jax.lax.stop_gradient(scales)
  if impl == "xla":
    data, scale_inv = reference.scaled_activation_quantize(
        x, scales, offsets, activation, limit, alpha, linear_offset, scaling_mode, block, fmt)
  else:
    data, scale_inv = sharding.scaled_activation_quantize(
        x, scales, offsets, activation=activation, limit=limit, alpha=alpha,
        linear_offset=linear_offset, scaling_mode=scaling_mode, block=block, fmt=fmt)
  return _wrap(data, scale_inv, offsets, recipe, scaling_mode, block, x.dtype, "forward")


def scaled_dactivation_quantize(dy: jax.Array, x: jax.Array, scales: jax.Array,
                                group_sizes=None, activation: str = "swiglu", *, recipe,
                                group_offsets=None, return_dx: bool = False,
                                limit: float = 7.0, alpha: float = 1.702,
                                linear_offset: float = 1.0,
                                implementation: str | None = None):
  """The backward of scaled_activation fused with quantization of dx, in one kernel chain.

  For grouped MLPs: dy is the FC2 dgrad output [..., F]; dx = (dy * scale) * act'(x)
  [..., W] is quantized for the FC1 dgrad and wgrad GEMMs in the recipe's gradient format
  (E5M2 under current scaling, per group).

  Args:
    dy: [..., F] (cast to x's dtype), x: [..., W], scales: [...] as in scaled_activation.
    group_sizes / group_offsets: as in ``scaled_activation_quantize`` (pass the forward's
      offsets as a custom_vjp residual so they are not recomputed).
    recipe: the quantization recipe (role "gradient").
    return_dx: also return dx unquantized in x's dtype (same kernel, one extra write).

  Returns:
    (dx_q: QuantizedArray [..., W] role "gradient", dx or None, dscales in scales' dtype
    with dscales[row] = sum_j dy_j * act_j(x) reduced in fp32).

  Not differentiable itself (it is a backward pass).
  """
  limit, alpha, linear_offset = act_api.validate(x, scales, activation, limit, alpha,
                                                 linear_offset)
  checks.check_float_array("dy", dy)
  expected = (*x.shape[:-1], x.shape[-1] // 2 if activation != "srelu" else x.shape[-1])
  if tuple(dy.shape) != expected:
    raise ValueError(f"dy must have shape {expected} (the activation's shape), got {dy.shape}")
  scaling_mode, block = scaling_mode_of(recipe, "activation")
  fmt = recipes.fp8_format(recipe, "gradient")
  impl = implementation_lib.resolve(implementation)
  rows = int(np.prod(x.shape[:-1]))
  offsets = _offsets_for(scaling_mode, rows, group_sizes, group_offsets, impl)
  dy, x, scales = (jax.lax.stop_gradient(a) for a in (dy.astype(x.dtype), x, scales))
  if impl == "xla":
    data, scale_inv, dx32, dscales = reference.scaled_dactivation_quantize(
        dy, x, scales, offsets, activation, limit, alpha, linear_offset, scaling_mode, block, fmt)
    dx = dx32.astype(x.dtype) if return_dx else None
  else:
    data, scale_inv, dx, dscales = sharding.scaled_dactivation_quantize(
        dy, x, scales, offsets, activation=activation, limit=limit, alpha=alpha,
        linear_offset=linear_offset, scaling_mode=scaling_mode, block=block, fmt=fmt,
        return_dx=return_dx)
  dx_q = _wrap(data, scale_inv, offsets, recipe, scaling_mode, block, x.dtype, "gradient")
  return dx_q, dx, dscales.astype(scales.dtype)
