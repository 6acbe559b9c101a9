"""Public grouped_linear: validation, implementation choice, custom_vjp.

The forward pass turns group_sizes into offsets once; the offsets travel to the backward
pass as a custom_vjp residual, where the dgrad and wgrad kernels read them as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._src import checks
from jaxfuse._src import compat
from jaxfuse._src import implementation as implementation_lib
from jaxfuse._src.ops.grouped_linear import ffi
from jaxfuse._src.ops.grouped_linear import reference
from jaxfuse._src.ops.grouped_linear import sharding
from jaxfuse._src.ops.quantize import columnwise as quantize_columnwise
from jaxfuse._src.ops.quantize import kernels as quantized_kernels
from jaxfuse.quantization import recipes

# TMA (the Hopper copy engine the CUTLASS kernels use) needs 16-byte aligned rows.
_FFI_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_ALIGNMENT_ELEMENTS = 8


# A quantized kernel's dtype is the one it was quantized from.
QUANTIZED_DTYPE_HINT = ("; quantize the kernel in x's dtype (quantize_experts(kernel.astype("
                        "x.dtype), recipe), or the Flax modules' quantize_expert_params(..., "
                        "dtype=...))")


is_quantized_kernel = quantized_kernels.is_quantized_kernel


def kernel_facts(name: str, kernel) -> tuple[np.dtype, tuple[int, int, int]]:
  """(dtype, [G, K, N] shape) of a grouped GEMM kernel: a 16-bit/fp32 array, or a
  QuantizedArray from ``quantize_experts`` (its original dtype and logical shape).

  Raises TypeError for other QuantizedArrays (a kernel must be quantized per expert or in
  128 x 128 tiles, in E4M3, laid out [G, N, K]) and for non-float arrays; ValueError for a
  rank other than 3 or scales of the wrong shape.
  """
  if not is_quantized_kernel(kernel):
    dtype = checks.check_float_array(name, kernel)
    checks.check_rank(name, kernel, 3, "[G, K, N]")
    return dtype, tuple(kernel.shape)
  if kernel.scaling_mode not in recipes.EXPERT_MODES:
    raise TypeError(f"a quantized {name} must come from jaxfuse.quantize_experts (scaling_mode "
                    f"one of {recipes.EXPERT_MODES}), got scaling_mode {kernel.scaling_mode!r}")
  if kernel.data.dtype != jnp.dtype(jnp.float8_e4m3fn) or kernel.data.ndim != 3:
    raise TypeError(f"a quantized {name} holds float8_e4m3fn data [G, N, K], got "
                    f"{kernel.data.dtype} {tuple(kernel.data.shape)}")
  groups, n, k = kernel.data.shape
  if kernel.scaling_mode == "per_expert":
    scales, what = (groups,), "one per expert"
  else:
    block = ffi.SCALE_BLOCK
    scales, what = (groups, -(-n // block), -(-k // block)), f"one per {block} x {block} tile"
  if tuple(kernel.scale_inv.shape) != scales:
    raise ValueError(f"a quantized {name} needs scale_inv float32 {list(scales)} ({what}), "
                     f"got {tuple(kernel.scale_inv.shape)}")
  quantized_kernels.check_copy_arrays(name, kernel, (groups, k, n), "transposed per expert")
  return jnp.dtype(kernel.dtype), (groups, k, n)


def recipe_for_kernels(recipe, *kernels):
  """The FP8 recipe of a call whose kernels may be pre-quantized: `recipe`, or with
  recipe=None the recipe the quantized kernels were made with (all of them the same)."""
  quantized = [kernel for kernel in kernels if is_quantized_kernel(kernel)]
  if not quantized:
    return recipe
  if recipe is None:
    recipe = quantized[0].recipe
  if recipe is None:
    raise ValueError("a quantized kernel runs the FP8 GEMMs and must carry its recipe: make "
                     "it with jaxfuse.quantize_experts(kernel, recipe)")
  for kernel in quantized:
    if kernel.recipe != recipe:
      raise ValueError(f"a quantized kernel made with {kernel.recipe!r} cannot run with "
                       f"recipe={recipe!r}; quantize it with the call's recipe")
  return recipe


def check_kernel_mode(name: str, kernel, recipe) -> None:
  """A quantized kernel's scales must be the recipe's: one per expert for
  Float8CurrentScaling, one per 128 x 128 tile for Float8BlockScaling (TypeError)."""
  if not is_quantized_kernel(kernel):
    return
  expected = ("expert_block_2d" if isinstance(recipe, recipes.Float8BlockScaling)
              else "per_expert")
  if kernel.scaling_mode != expected:
    raise TypeError(f"a quantized {name} with scaling_mode {kernel.scaling_mode!r} cannot run "
                    f"with recipe={recipe!r} (which takes {expected!r}); quantize it with "
                    "jaxfuse.quantize_experts(kernel, recipe)")


def kernel_leaf(kernel):
  """The array a kernel's shard_map varying axes are read from: its FP8 data if quantized."""
  return kernel.data if is_quantized_kernel(kernel) else kernel


def expert_weights(kernel, recipe, untransposed: bool):
  """reference.expert_weights on the FFI path: the FP8 weights the grouped GEMMs read."""
  return reference.expert_weights(kernel, recipe, "ffi", untransposed=untransposed)


def _validate(x, kernel, group_sizes, recipe, implementation: str) -> None:
  x_dtype = checks.check_float_array("x", x)
  kernel_dtype, kernel_shape = kernel_facts("kernel", kernel)
  checks.check_rank("x", x, 2, "[M, K]")
  checks.check_rank("group_sizes", group_sizes, 1, "[G]")
  sizes_dtype = checks.dtype_of("group_sizes", group_sizes)
  if sizes_dtype != jnp.dtype(jnp.int32):
    raise TypeError(f"group_sizes must be int32 [G], got {sizes_dtype}")
  if kernel_dtype != x_dtype:
    raise TypeError(f"kernel dtype {kernel_dtype} must equal x dtype {x_dtype}"
                    + QUANTIZED_DTYPE_HINT * is_quantized_kernel(kernel))
  groups, k, n = kernel_shape
  if x.shape[1] != k:
    raise ValueError(f"x's last dimension ({x.shape[1]}) must equal kernel.shape[1] ({k}); "
                     f"x is {x.shape}, kernel is {kernel_shape}")
  if group_sizes.shape[0] != groups:
    raise ValueError(f"group_sizes must have shape ({groups},) (kernel.shape[0] groups), "
                     f"got {group_sizes.shape}")
  if groups < 1:
    raise ValueError("kernel must have at least one group (kernel.shape[0] >= 1)")
  names = ("K (x.shape[1])", "N (kernel.shape[2])")
  check_kernel_mode("kernel", kernel, recipe)
  if isinstance(recipe, recipes.Float8BlockScaling):
    validate_blockwise(recipe, k, n, "grouped_linear", names)
  elif recipe is not None:
    validate_fp8(recipe, k, n, "grouped_linear", names,
                 groups if implementation == "ffi" else 1, blockwise_too=True)
  if implementation == "ffi":
    if x_dtype not in _FFI_DTYPES:
      raise TypeError(f"grouped_linear's kernels take bfloat16 or float16 x, got {x_dtype}; "
                      "cast x and kernel, or pass implementation='xla'")
    for name, size in (("K (x.shape[1])", k), ("N (kernel.shape[2])", n)):
      if size % _ALIGNMENT_ELEMENTS:
        raise ValueError(f"grouped_linear needs {name} to be a multiple of "
                         f"{_ALIGNMENT_ELEMENTS} for 16-bit inputs (16-byte aligned rows for "
                         f"TMA), got {size}; pad it, or pass implementation='xla'")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_linear_with_offsets(x, kernel, group_offsets, varying_axes=(frozenset(),) * 3):
  """grouped_linear on precomputed int32 [G + 1] offsets (the FFI path, differentiable).

  Callers that run several grouped GEMMs over one routing (a grouped MLP) compute the
  offsets once and pass them to each; the backward pass reuses them as they are.
  `varying_axes` (static) holds shard_map's varying axes of (x, kernel, offsets).
  """
  return sharding.grouped_gemm(x, kernel, group_offsets, form=ffi.FORWARD)


def _forward(x, kernel, group_offsets, varying_axes):
  del varying_axes
  out = sharding.grouped_gemm(x, kernel, group_offsets, form=ffi.FORWARD)
  return out, (x, kernel, group_offsets)


def _backward(varying_axes, saved, d_out):
  x, kernel, group_offsets = saved
  d_out = d_out.astype(x.dtype)
  d_x = sharding.grouped_gemm(d_out, kernel, group_offsets, form=ffi.DGRAD)
  d_kernel = sharding.grouped_gemm(x, d_out, group_offsets, form=ffi.WGRAD)
  # Integer offsets have no cotangent. Inside shard_map, the gradient of a replicated
  # kernel computed from sharded tokens is summed over the devices.
  return (compat.match_varying_axes(d_x, varying_axes[0]),
          compat.match_varying_axes(d_kernel, varying_axes[1]), None)


grouped_linear_with_offsets.defvjp(_forward, _backward)


# --- FP8 (Float8CurrentScaling(per_group=True)) ----------------------------------------

# The CUTLASS FP8 kernels read K-major operands through TMA: 16-byte (16-element) rows.
FP8_ALIGNMENT = 16


# The column-wise copies the FP8 wgrad reads keep every group's start in shared memory
# (cuda/include/jaxfuse/quantize.h, kColumnwiseMaxGroups).
FP8_WGRAD_MAX_GROUPS = 4096


def check_fp8_operands(recipe, k: int, n: int, op: str, names=("K", "N")) -> None:
  """What every FP8 grouped GEMM needs: E4M3 forward tensors, K and N TMA-aligned."""
  if recipe.forward_format != "e4m3":
    raise ValueError(f"{op}'s FP8 kernels take E4M3 forward operands: recipe.forward_format "
                     f"must be 'e4m3', got {recipe.forward_format!r}")
  for name, size in zip(names, (k, n)):
    if size % FP8_ALIGNMENT:
      raise ValueError(f"FP8 {op} needs {name} to be a multiple of {FP8_ALIGNMENT} "
                       f"(16-byte aligned FP8 rows for TMA), got {size}")


def validate_fp8(recipe, k: int, n: int, op: str, names=("K", "N"), groups: int = 1,
                 blockwise_too: bool = False) -> None:
  """The recipe and shape rules of the FP8 grouped GEMMs (shared with grouped_mlp).
  `blockwise_too`: the op also takes Float8BlockScaling (checked by validate_blockwise)."""
  from jaxfuse.quantization import Float8CurrentScaling  # pylint: disable=g-import-not-at-top
  if not isinstance(recipe, Float8CurrentScaling) or not recipe.per_group:
    also = " or Float8BlockScaling() (1 x 128 and 128 x 128 blocks)" if blockwise_too else ""
    raise ValueError(f"{op} supports recipe=Float8CurrentScaling(per_group=True) (one scale "
                     f"per group of rows and per expert){also}, got {recipe!r}")
  check_fp8_operands(recipe, k, n, op, names)
  if recipe.fp8_wgrad and groups > FP8_WGRAD_MAX_GROUPS:
    raise ValueError(f"FP8 {op}'s FP8 weight gradients take at most {FP8_WGRAD_MAX_GROUPS} "
                     f"groups, got {groups}; pass a recipe with fp8_wgrad=False (16-bit "
                     "weight gradients)")


def fp8_gemm(a_data, a_scale_inv, b_data, b_scale_inv, group_offsets, form, dtype, recipe):
  """One FP8 grouped GEMM form (bfloat16 result) cast to `dtype`.

  The forward accumulates fast when recipe.forward_fast_accumulation is set; dgrad always
  promotes to fp32 (TransformerEngine's split accumulator for the gradient GEMMs).
  """
  fast = int(form) == ffi.FORWARD and recipe.forward_fast_accumulation
  out = sharding.grouped_gemm(a_data, b_data, group_offsets, form=form,
                              a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv,
                              fast_accumulation=fast)
  return out.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def grouped_linear_fp8_with_offsets(x, kernel, group_offsets, recipe,
                                    varying_axes=(frozenset(),) * 3):
  """FP8 grouped_linear on precomputed int32 [G + 1] offsets (FFI path, differentiable).

  Forward: x in E4M3 with one scale per group of rows, the kernel in E4M3 with one scale
  per expert (quantized transposed, [G, N, K]), the FP8 grouped GEMM. Backward: dgrad in
  FP8 (the output gradient in the recipe's gradient format, E5M2 by default, per group;
  the weight's FP8 values as [G, K, N], written by the forward's quantization pass); wgrad
  in FP8 from the forward's FP8 x and the dgrad's FP8 output gradient (recipe.fp8_wgrad),
  else in 16-bit from the saved x. A `kernel` from ``quantize_experts`` is used as it is
  and gets no gradient (its cotangent is None: a constant, like any quantize result),
  unless it is trainable: then its cotangent holds the wgrad at ``master``.
  """
  return _fp8_forward(x, kernel, group_offsets, recipe, varying_axes, for_backward=False)[0]


def _fp8_forward(x, kernel, group_offsets, recipe, varying_axes, for_backward=True):
  del varying_axes
  # x's column-wise copy (the wgrad's operand) from the same pass when a wgrad follows.
  fuse = (for_backward and quantize_columnwise.fuses(recipe) and
          not quantized_kernels.is_frozen_kernel(kernel))
  x_data, x_scale_inv, x_fp8 = quantize_columnwise.quantize_rows(x, recipe, group_offsets,
                                                                 "forward", copy=fuse)
  # The weight's FP8 values in both layouts from one pass when the backward needs them:
  # [G, N, K] for the forward, [G, K, N] saved for dgrad (a pre-quantized kernel's as given).
  w_t_data, w_scale_inv, *w_data = expert_weights(kernel, recipe, untransposed=for_backward)
  out = fp8_gemm(x_data, x_scale_inv, w_t_data, w_scale_inv, group_offsets, ffi.FORWARD,
                 x.dtype, recipe)
  # The backward's wgrad input: the FP8 x (fp8_wgrad) or the 16-bit one; none for a
  # pre-quantized kernel, which gets no gradient.
  x_saved = x_fp8 if recipe.fp8_wgrad else x
  if quantized_kernels.is_frozen_kernel(kernel):
    x_saved = None
  return out, (x_saved, w_data[0] if w_data else None, w_scale_inv, group_offsets,
               quantized_kernels.cotangent_template(kernel))


def fp8_dgrad(d_out, w_data, w_scale_inv, group_offsets, recipe, dtype, columnwise=False,
              d_out_quantized=None):
  """The FP8 dgrad: d_out quantized per group in the recipe's gradient format (E5M2 by
  default) times the saved FP8 kernel [G, K, N] (the forward's values and scales).

  Returns (dx in `dtype`, the FP8 output gradient for the FP8 wgrad): (dy_data,
  dy_scale_inv), or with ``columnwise`` its quantize_columnwise.Columnwise copy, written by
  the same quantization pass. ``d_out_quantized``: that (data, scale_inv, operand) triple
  made by the caller (d_out is then not read), e.g. gathered.quantize_gathered_rows.
  """
  if d_out_quantized is None:
    d_out_quantized = quantize_columnwise.quantize_rows(d_out, recipe, group_offsets,
                                                        "gradient", copy=columnwise)
  dy_data, dy_scale_inv, dy_fp8 = d_out_quantized
  d_x = fp8_gemm(dy_data, dy_scale_inv, w_data, w_scale_inv, group_offsets, ffi.DGRAD,
                 dtype, recipe)
  return d_x, dy_fp8


def fp8_wgrad(x_fp8, dy_fp8, group_offsets, dtype, *, rows: int):
  """The FP8 wgrad dw[g] = x_g^T @ dy_g of `rows` grouped rows. Each operand is a (data
  [rows, ·], scale_inv [G]) pair or its quantize_columnwise.Columnwise copy: x in E4M3, dy
  in E4M3 or E5M2, both quantized per group over `group_offsets` (promoted fp32
  accumulation). Pairs go through the sharded grouped GEMM, which transposes them
  column-wise; copies straight to the kernel (the quantize kernels wrote them only where
  nothing is partitioned). Returns [G, K, N] in `dtype`."""
  if isinstance(x_fp8, quantize_columnwise.Columnwise) or isinstance(
      dy_fp8, quantize_columnwise.Columnwise):
    x_t = quantize_columnwise.to_columnwise(x_fp8, group_offsets)
    dy_t = quantize_columnwise.to_columnwise(dy_fp8, group_offsets)
    out = ffi.fp8_wgrad_columnwise(x_t.data, dy_t.data, group_offsets, x_t.scale_inv,
                                   dy_t.scale_inv, rows=rows)
    return out.astype(dtype)
  (x_data, x_scale_inv), (dy_data, dy_scale_inv) = x_fp8, dy_fp8
  out = sharding.grouped_gemm(x_data, dy_data, group_offsets, form=ffi.WGRAD,
                              a_scale_inv=x_scale_inv, b_scale_inv=dy_scale_inv)
  return out.astype(dtype)


def _fp8_backward(recipe, varying_axes, saved, d_out):
  x_saved, w_data, w_scale_inv, group_offsets, template = saved
  dtype = d_out.dtype  # the output's, which is x's
  fuse = isinstance(x_saved, quantize_columnwise.Columnwise)  # the forward's choice
  d_x, dy_fp8 = fp8_dgrad(d_out, w_data, w_scale_inv, group_offsets, recipe, dtype,
                          columnwise=fuse)
  if x_saved is None:  # a frozen pre-quantized kernel: a constant, no weight gradient
    return compat.match_varying_axes(d_x, varying_axes[0]), None, None
  if recipe.fp8_wgrad:
    d_kernel = fp8_wgrad(x_saved, dy_fp8, group_offsets, dtype, rows=d_out.shape[0])
  else:
    d_kernel = sharding.grouped_gemm(x_saved, d_out, group_offsets, form=ffi.WGRAD)
  # A trainable quantized kernel's gradient goes to its master.
  d_kernel = compat.match_varying_axes(d_kernel, varying_axes[1])
  return (compat.match_varying_axes(d_x, varying_axes[0]),
          quantized_kernels.kernel_cotangent(template, d_kernel), None)


grouped_linear_fp8_with_offsets.defvjp(_fp8_forward, _fp8_backward)


# --- Blockwise FP8 (Float8BlockScaling: DeepSeek-V3's recipe) ------------------------------


def validate_blockwise(recipe, k: int, n: int, op: str, names=("K", "N")) -> None:
  """The recipe and shape rules of the blockwise FP8 grouped GEMMs."""
  if recipe.block_size != ffi.SCALE_BLOCK:
    raise ValueError(f"{op}'s blockwise FP8 kernels scale 1 x {ffi.SCALE_BLOCK} and "
                     f"{ffi.SCALE_BLOCK} x {ffi.SCALE_BLOCK} blocks: "
                     f"Float8BlockScaling.block_size must be {ffi.SCALE_BLOCK}, got "
                     f"{recipe.block_size}")
  check_fp8_operands(recipe, k, n, op, names)


def blockwise_weights(kernel, recipe, untransposed: bool):
  """reference.expert_block_weights on the FFI path: the FP8 tiles the GEMMs read."""
  return reference.expert_block_weights(kernel, recipe, "ffi", untransposed=untransposed)


def blockwise_rows(value, recipe, role: str, implementation: str):
  """(FP8 data [M, C], scale_inv float32 [M, ceil(C / 128)]): 1 x 128 blocks of each row."""
  from jaxfuse._src.ops.quantize import api as quantize_api  # pylint: disable=g-import-not-at-top
  q = quantize_api.quantize(value, recipe, role=role, implementation=implementation)
  return q.data, q.scale_inv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def grouped_linear_blockwise_with_offsets(x, kernel, group_offsets, recipe,
                                          varying_axes=(frozenset(),) * 3):
  """Blockwise FP8 grouped_linear on precomputed int32 [G + 1] offsets (FFI path).

  Forward: x in E4M3 with 1 x 128 block scales along K, the kernel in E4M3 with one scale
  per 128 x 128 tile (both layouts from one pass: [G, N, K] for the forward, [G, K, N]
  saved for the dgrad), the blockwise FP8 grouped GEMM. Backward: dgrad in FP8 (the
  output gradient in the recipe's gradient format, 1 x 128 blocks along N, times the
  forward's FP8 weight as [G, K, N]); wgrad from the saved x and the output gradient,
  in FP8 with 128 x 1 blocks (recipe.fp8_wgrad, see blockwise_wgrad) or 16-bit. A
  ``quantize_experts`` kernel is used as it is: a frozen one gets no gradient (x is not
  kept), a trainable one's gradient goes to its master.
  """
  return _blockwise_forward(x, kernel, group_offsets, recipe, varying_axes,
                            for_backward=False)[0]


def _blockwise_forward(x, kernel, group_offsets, recipe, varying_axes, for_backward=True):
  del varying_axes
  x_data, x_scale_inv = blockwise_rows(x, recipe, "forward", "ffi")
  w_t, w = blockwise_weights(kernel, recipe, untransposed=for_backward)
  out = blockwise_gemm(x_data, x_scale_inv, w_t, group_offsets, ffi.FORWARD, x.dtype)
  x_saved = None if quantized_kernels.is_frozen_kernel(kernel) else x
  return out, (x_saved, w, group_offsets, quantized_kernels.cotangent_template(kernel))


def blockwise_gemm(a_data, a_scale_inv, w, group_offsets, form, dtype):
  """One blockwise FP8 grouped GEMM form: a (FP8 [M, C], 1 x 128 block scales [M,
  ceil(C/128)]) times the weight tiles w = (data, tile scale_inv) in the form's layout
  ([G, N, K] for the forward, [G, K, N] for the dgrad); the result in `dtype`."""
  w_data, w_scale_inv = w
  return sharding.grouped_gemm_blockwise(a_data, w_data, group_offsets, a_scale_inv,
                                         w_scale_inv, form=form).astype(dtype)


def blockwise_dgrad(d_out, w, group_offsets, recipe, dtype):
  """The blockwise FP8 dgrad: d_out in 1 x 128 blocks (the recipe's gradient format) times
  the FP8 weight tiles w = (data [G, K, N], scale_inv [G, K/128, N/128]); in `dtype`."""
  dy_data, dy_scale_inv = blockwise_rows(d_out, recipe, "gradient", "ffi")
  return blockwise_gemm(dy_data, dy_scale_inv, w, group_offsets, ffi.DGRAD, dtype)


def blockwise_wgrad(x, dy, group_offsets, recipe):
  """The weight gradient dw[g] = x_g^T @ dy_g ([G, K, N] in x's dtype) of the blockwise
  recipe from the 16-bit x [M, K] and dy [M, N]: with recipe.fp8_wgrad, where no
  partitioning can follow (quantize_columnwise.fusion_enabled), both quantized in 128 x 1
  blocks down each group's rows into their column-wise copies (x in the forward format, dy
  in the gradient format) and the blockwise FP8 wgrad kernel; else the 16-bit grouped
  GEMM (sharding rules included)."""
  dy = dy.astype(x.dtype)
  if not (recipe.fp8_wgrad and quantize_columnwise.fusion_enabled()):
    return sharding.grouped_gemm(x, dy, group_offsets, form=ffi.WGRAD)
  from jaxfuse._src.ops.quantize import ffi as quantize_ffi  # pylint: disable=g-import-not-at-top
  x_t, x_t_scale_inv = quantize_ffi.quantize_columnwise_blocks(
      jax.lax.stop_gradient(x), group_offsets, fmt=recipes.fp8_format(recipe, "forward"))
  dy_t, dy_t_scale_inv = quantize_ffi.quantize_columnwise_blocks(
      jax.lax.stop_gradient(dy), group_offsets, fmt=recipes.fp8_format(recipe, "gradient"))
  d_kernel = ffi.fp8_blockwise_wgrad_columnwise(x_t, dy_t, group_offsets, x_t_scale_inv,
                                                dy_t_scale_inv, rows=x.shape[0])
  return d_kernel.astype(x.dtype)


def _blockwise_backward(recipe, varying_axes, saved, d_out):
  x, w, group_offsets, template = saved
  dtype = d_out.dtype  # the output's, which is x's
  d_x = compat.match_varying_axes(blockwise_dgrad(d_out, w, group_offsets, recipe, dtype),
                                  varying_axes[0])
  if x is None:  # a frozen quantize_experts kernel: a constant
    return d_x, None, None
  d_kernel = blockwise_wgrad(x, d_out, group_offsets, recipe)
  d_kernel = compat.match_varying_axes(d_kernel, varying_axes[1])
  return d_x, quantized_kernels.kernel_cotangent(template, d_kernel), None


grouped_linear_blockwise_with_offsets.defvjp(_blockwise_forward, _blockwise_backward)


def group_offsets(group_sizes: jax.Array) -> jax.Array:
  """int32 [G + 1] exclusive prefix sum with a leading zero; negative sizes count as zero."""
  sizes = jnp.maximum(group_sizes, 0)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes, dtype=jnp.int32)])


def grouped_linear(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array, *, recipe=None,
                   implementation: str | None = None) -> jax.Array:
  """Rows of group g times kernel[g]: the grouped GEMM of a mixture-of-experts layer.

  Same result as ``jax.lax.ragged_dot(x, kernel, group_sizes)``, without its dense
  expansion: on GPU a CUTLASS SM90 grouped kernel whose problem shapes are built on the
  device from the offsets, so group sizes never reach the host (CUDA-graph safe).

  Args:
    x: [M, K] bfloat16 or float16 (float32 with implementation="xla"), rows sorted by group.
    kernel: [G, K, N], x's dtype (``ragged_dot``'s right-hand side layout); or, with an
      FP8 recipe, its FP8 copy from ``jaxfuse.quantize_experts`` (quantized once, e.g. for
      inference or over the micro-batches of one step: the call then skips the weight's
      amax and quantization passes; the result is the same as from the 16-bit kernel
      quantized with the same recipe). A quantized kernel gets no gradient unless it was
      made with ``trainable=True``: then its 16-bit master gets the gradient the 16-bit
      kernel would.
    group_sizes: int32 [G], on the device. Negative sizes count as zero; sizes summing past
      M are cut at M; rows past the total come out as zeros. Under ``jax.jit`` with x
      sharded by tokens they still describe the rows of the whole x (each device derives
      the offsets of its own row block; see grouped_linear/sharding.py).
    recipe: None (16-bit GEMMs; with a quantized kernel, the recipe it was made with) or
      ``jaxfuse.quantization.Float8CurrentScaling(per_group=True)``: x is quantized to E4M3
      with one current scale per group of rows, the kernel with one scale per expert
      (transposed to [G, N, K], the layout the FP8 kernels take), and the grouped GEMM
      runs on the FP8 tensor cores with the per-group factors in its epilogue (result
      rounded to bfloat16, then cast to x's dtype). The forward GEMM accumulates in the
      tensor cores' FP8 accumulator unless ``recipe.forward_fast_accumulation`` is False
      (then it promotes to fp32 every few k-blocks, ~20% slower on the H200). Backward:
      dgrad in FP8 (the output gradient in E5M2, per group; the saved FP8 weight);
      wgrad in FP8 too (``recipe.fp8_wgrad``, the default: the forward's FP8 x and the
      dgrad's FP8 output gradient, transposed column-wise, as in TransformerEngine's
      Hopper recipe), else in 16-bit from the saved x. K and N must be multiples of 16.
      Expected accuracy against the 16-bit op: a few percent relative (Frobenius) error
      for unit-variance data.
      Or ``jaxfuse.quantization.Float8BlockScaling()`` (DeepSeek-V3's recipe): x in E4M3
      with one scale per row and 128-wide block of K, the kernel with one scale per
      128 x 128 tile of each expert, applied inside CUTLASS's blockwise FP8 mainloop
      (every 128-deep partial sum times its two scales, accumulated in fp32), so an
      outlier only coarsens its own block. Backward: dgrad in FP8 (the output gradient in
      1 x 128 blocks along N, in recipe.gradient_format, E4M3 by default) against the
      forward's FP8 weight; wgrad in 16-bit from the saved x, or in FP8 with
      ``recipe.fp8_wgrad=True`` (x and the output gradient in 128 x 1 blocks down each
      group's rows, transposed, on one device or inside shard_map with every axis manual;
      not yet faster on the H200, see Float8BlockScaling). block_size must be 128;
      K and N multiples of 16 (partial blocks are fine). The kernel's tiles are
      quantized in both layouts by one pass per call, or once by ``quantize_experts``.

  Returns:
    [M, N] in x's dtype (fp32 accumulation, one rounding).

  Differentiable in x and kernel (a trainable quantized kernel's master); the backward
  pass (dgrad dy @ W_g^T, wgrad x_g^T @ dy_g, zero for empty groups) reuses the forward
  pass's offsets.

  Raises:
    TypeError: non-float or mixed dtypes, group_sizes not int32, 32-bit x on the FFI path,
      a quantized kernel whose scaling does not match the recipe.
    ValueError: mismatched shapes; K or N not a multiple of 8 on the FFI path (16 with an
      FP8 recipe); an FP8 recipe other than Float8CurrentScaling(per_group=True) or
      Float8BlockScaling(block_size=128) with E4M3 forward tensors; a quantized kernel made
      with another recipe than the call's.
  """
  implementation = implementation_lib.resolve(implementation)
  recipe = recipe_for_kernels(recipe, kernel)
  _validate(x, kernel, group_sizes, recipe, implementation)
  blockwise = isinstance(recipe, recipes.Float8BlockScaling)
  if implementation == "xla":
    if blockwise:
      return reference.grouped_linear_blockwise(x, kernel, group_sizes, recipe)
    if recipe is not None:
      return reference.grouped_linear_fp8(x, kernel, group_sizes, recipe)
    return reference.grouped_linear(x, kernel, group_sizes)
  offsets = group_offsets(group_sizes)
  varying_axes = tuple(compat.varying_axes(a) for a in (x, kernel_leaf(kernel), offsets))
  if blockwise:
    return grouped_linear_blockwise_with_offsets(x, kernel, offsets, recipe, varying_axes)
  if recipe is not None:
    return grouped_linear_fp8_with_offsets(x, kernel, offsets, recipe, varying_axes)
  return grouped_linear_with_offsets(x, kernel, offsets, varying_axes)


def quantize_experts(kernel: jax.Array, recipe, *, trainable: bool = False,
                     implementation: str | None = None) -> recipes.QuantizedArray:
  """FP8 expert weights for ``grouped_linear`` / ``grouped_mlp``, quantized once.

  The FP8 recipes quantize a 16-bit kernel on every call: with per-group current scaling
  an amax pass per expert and a quantizing pass that writes it transposed (the K-major
  layout the FP8 tensor cores take); with block scaling a pass over 128 x 128 tiles that
  writes both layouts. For weights that do not change between calls (inference, the
  micro-batches of one optimizer step) quantize them once here and pass the result as the
  kernel: the same FP8 values, without the passes over the weights.

  Training on such a copy: with ``trainable=True`` the result also keeps ``kernel`` (as
  ``master``) and the FP8 values in the dgrad's layout, from the same pass. The ops then
  compute the kernel's gradient as they would from the 16-bit kernel (the wgrad reads x
  and the output gradient, not the weights) and return it through ``master`` to
  ``kernel``: quantize once per optimizer step, outside a loop over micro-batches
  (TransformerEngine's FP8 weight caching), and the gradients are those of quantizing in
  every micro-batch. Use the cotangent's ``.master``: returning the whole cotangent from a
  jitted step also writes zeros for its FP8 leaves (XLA drops them otherwise).

  Args:
    kernel: [G, K, N] float32/bfloat16/float16, ``grouped_linear``'s kernel layout.
    recipe: ``jaxfuse.quantization.Float8CurrentScaling`` (one scale per expert) or
      ``Float8BlockScaling()`` (one scale per 128 x 128 tile, block_size 128), with E4M3
      forward tensors; the call that takes the result must use the same recipe.
    trainable: keep the kernel for its gradient (above); else the result is a constant.
    implementation: None, "ffi" or "xla" (same values).

  Returns:
    QuantizedArray with data float8_e4m3fn [G, N, K] (expert g's kernel transposed) and
    dtype kernel.dtype. Current scaling: scaling_mode "per_expert", scale_inv float32 [G]
    (1 / (448 / amax of expert g); 1 for an all-zero expert). Block scaling: scaling_mode
    "expert_block_2d", scale_inv float32 [G, ceil(N / 128), ceil(K / 128)] (tile (j, i)
    of data[g] is tile (i, j) of kernel[g]; the values of ``jaxfuse.quantize(kernel,
    recipe, kind="weight")`` transposed). With ``trainable`` also data_untransposed
    float8_e4m3fn [G, K, N] and master = kernel. ``jaxfuse.dequantize`` gives back
    [G, K, N]. The FP8 values carry no gradient (as for every quantize result); a
    trainable result's master is kernel itself, so its gradient reaches kernel.

  Raises:
    TypeError: kernel not a float array, or a recipe that is neither Float8CurrentScaling
      nor Float8BlockScaling.
    ValueError: kernel not of rank 3, the recipe's forward format is not E4M3, or a block
      size other than 128.
  """
  blockwise = isinstance(recipe, recipes.Float8BlockScaling)
  if not (blockwise or isinstance(recipe, recipes.Float8CurrentScaling)):
    raise TypeError("quantize_experts takes recipe=Float8CurrentScaling(...) (one scale per "
                    "expert) or Float8BlockScaling() (one per 128 x 128 tile), the FP8 "
                    f"grouped GEMMs' weight scalings, got {recipe!r}")
  if recipe.forward_format != "e4m3":
    raise ValueError(f"the FP8 grouped GEMMs take E4M3 weights: recipe.forward_format must be "
                     f"'e4m3', got {recipe.forward_format!r}")
  if blockwise and recipe.block_size != ffi.SCALE_BLOCK:
    raise ValueError(f"the blockwise FP8 grouped GEMMs scale {ffi.SCALE_BLOCK} x "
                     f"{ffi.SCALE_BLOCK} weight tiles: Float8BlockScaling.block_size must be "
                     f"{ffi.SCALE_BLOCK}, got {recipe.block_size}")
  dtype = checks.check_float_array("kernel", kernel)
  checks.check_rank("kernel", kernel, 3, "[G, K, N]")
  impl = implementation_lib.resolve(implementation)
  frozen = jax.lax.stop_gradient(kernel)
  if blockwise:
    (data, scale_inv), untransposed = reference.expert_block_weights(
        frozen, recipe, impl, untransposed=bool(trainable))
    straight = untransposed[0] if trainable else None
  else:
    data, scale_inv, *copies = reference.quantize_experts_t(frozen, recipe, impl,
                                                           untransposed=bool(trainable))
    straight = copies[0] if trainable else None
  return recipes.QuantizedArray(data=data, scale_inv=scale_inv, data_untransposed=straight,
                                master=kernel if trainable else None, recipe=recipe,
                                scaling_mode="expert_block_2d" if blockwise else "per_expert",
                                block_size=recipe.block_size if blockwise else 0,
                                dtype=dtype, role="forward")


def flops(m: int, k: int, n: int) -> int:
  """Floating-point operations of one grouped GEMM form over m routed rows."""
  return 2 * m * k * n



