"""The FP8 experts of an MoE layer with the token permutation folded into the quantization.

With ``Float8CurrentScaling(per_group=True)`` and FP8 weight gradients, the expert MLP
never reads the 16-bit expert-sorted tokens: its FC1 takes x quantized per expert, its FC2
wgrad and dgrad dy quantized per expert. So instead of permuting x (writing the sorted
16-bit copy: T*k rows) and quantizing that copy (an amax pass and a quantizing pass over
it), the quantization reads the tokens through the routing (quantize/gathered.py); and in
the backward pass the output gradient's unpermute transpose (another sorted 16-bit copy)
is folded the same way. One custom_vjp spans the permutation, the expert MLP and the
unpermute:

    forward:   x_q   = quantize_gathered(tokens, source_rows)    per expert, E4M3
               y     = grouped_mlp's FP8 forward (Fp8Stages.forward, given x_q)
               out   = unpermute(y, row_map)                     unit weights
    backward:  dy_q  = quantize_gathered(d_out, source_rows)     per expert, E5M2
               dx, dk1, dk2, dscales = Fp8Stages.backward (given dy_q)
               d_tokens = unpermute(dx, row_map)                 the permutation's transpose

Same bytes and results as moe_permute + grouped_mlp + moe_unpermute (tests compare them
bit for bit); at the DeepSeek-like layer (16k tokens, top-6, H = 2048) it skips ~0.8 GB
of traffic in each direction. ``with fp8_experts.use_gathered(False):`` (or the environment
variable JAXFUSE_MOE_GATHERED_FP8=0 at import) keeps the unfused ops, for A/B runs.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from jaxfuse._src import compat
from jaxfuse._src.ops.group_offsets import api as offsets_api
from jaxfuse._src.ops.grouped_linear import api as linear_api
from jaxfuse._src.ops.grouped_mlp import api as mlp_api
from jaxfuse._src.ops.moe_permute import sharding as permute_sharding
from jaxfuse._src.ops.quantize import columnwise as quantize_columnwise
from jaxfuse._src.ops.quantize import gathered
from jaxfuse.quantization import recipes

_ENABLED = compat.traced_bool_flag(
    "jaxfuse_moe_gathered_fp8", True,
    "Whether jaxfuse.moe's FP8 experts quantize their tokens through the routing instead of "
    "permuting them in 16 bits first (same results; fewer bytes).")


@contextlib.contextmanager
def use_gathered(enabled: bool = True):
  """``with use_gathered(False):`` traces moe's FP8 experts as moe_permute + grouped_mlp +
  moe_unpermute (A/B runs, tests)."""
  with _ENABLED(enabled):
    yield


def applies(recipe, implementation: str) -> bool:
  """Whether moe runs its experts here: the FFI path, per-expert current scaling with FP8
  weight gradients where the quantize kernels write the wgrad's column-wise copies (one
  device, or shard_map with every axis manual), unless ``use_gathered(False)``."""
  if not _ENABLED.value or implementation != "ffi":
    return False
  return (isinstance(recipe, recipes.Float8CurrentScaling) and recipe.per_group and
          quantize_columnwise.fuses(recipe))


def moe_experts(tokens, kernel1, kernel2, row_map, group_sizes, scales, *, activation,
                recipe, save_activation, limit, alpha, linear_offset):
  """unpermute(grouped_mlp(permute(tokens), ...), row_map) for the FP8 recipes `applies`
  accepts: tokens [T, H], row_map int32 [T, k] and group_sizes int32 [E] from
  moe_permute.moe_routing, scales [T*k] in expert order; the other arguments as
  grouped_mlp's (validated the same way, against the sorted rows' shape). Returns [T, H]."""
  rows = row_map.shape[0] * row_map.shape[1]
  sorted_rows = jax.ShapeDtypeStruct((rows, tokens.shape[-1]), tokens.dtype)
  _, config = mlp_api.checked_config(sorted_rows, kernel1, kernel2, group_sizes, scales,
                                     activation, recipe, save_activation, "ffi", limit, alpha,
                                     linear_offset)
  offsets = offsets_api.group_offsets(group_sizes, implementation="ffi")
  source_rows = gathered.source_rows_of(row_map)
  varying_axes = tuple(compat.varying_axes(a) for a in (
      tokens, linear_api.kernel_leaf(kernel1), linear_api.kernel_leaf(kernel2), scales))
  return _experts(tokens, kernel1, kernel2, offsets, scales, source_rows, row_map, config,
                  varying_axes)


def _unit_unpermute(sorted_values, row_map):
  return permute_sharding.unpermute(sorted_values, row_map,
                                    jnp.ones(row_map.shape, jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _experts(tokens, kernel1, kernel2, offsets, scales, source_rows, row_map, config,
             varying_axes):
  return _forward(tokens, kernel1, kernel2, offsets, scales, source_rows, row_map, config,
                  varying_axes, for_backward=False)[0]


def _forward(tokens, kernel1, kernel2, offsets, scales, source_rows, row_map, config,
             varying_axes, for_backward=True):
  del varying_axes
  frozen1 = config.frozen_kernels[0]
  x_quantized = gathered.quantize_gathered_rows(
      tokens, source_rows, offsets, config.recipe, "forward",
      copy=for_backward and not frozen1)
  y_sorted, saved = mlp_api.Fp8Stages.forward(tokens, kernel1, kernel2, offsets, scales, config,
                                         for_backward, x_quantized=x_quantized)
  return _unit_unpermute(y_sorted, row_map), (saved, offsets, source_rows, row_map)


def _backward(config, varying_axes, residuals, d_out):
  saved, offsets, source_rows, row_map = residuals  # offsets: the forward's, not recomputed
  # The sorted rows' shape and dtype (out, and so d_out, has the tokens' dtype).
  sorted_rows = jax.ShapeDtypeStruct((source_rows.shape[0], d_out.shape[-1]), d_out.dtype)
  frozen2 = config.frozen_kernels[1]
  dy_quantized = gathered.quantize_gathered_rows(
      d_out.astype(sorted_rows.dtype), source_rows, offsets, config.recipe, "gradient",
      copy=not frozen2)
  tokens_axes, kernel1_axes, kernel2_axes, scales_axes = varying_axes
  mlp_axes = (tokens_axes, kernel1_axes, kernel2_axes, frozenset(), scales_axes)
  d_sorted, d_kernel1, d_kernel2, _, d_scales = mlp_api.Fp8Stages.backward(
      config, mlp_axes, saved, sorted_rows, dy_quantized=dy_quantized)
  d_tokens = compat.match_varying_axes(_unit_unpermute(d_sorted, row_map), tokens_axes)
  return d_tokens, d_kernel1, d_kernel2, None, d_scales, None, None


_experts.defvjp(_forward, _backward)
