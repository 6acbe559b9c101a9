"""Recipe dataclasses and the QuantizedArray pytree (see jaxfuse.quantization)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp

FP8_DTYPES = {"e4m3": jnp.dtype(jnp.float8_e4m3fn), "e5m2": jnp.dtype(jnp.float8_e5m2)}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
ROLES = ("forward", "gradient")


def _check_block(block_size):
  # The CUDA kernels reduce a block's amax across block/8 adjacent lanes of a warp.
  if block_size not in (8, 16, 32, 64, 128, 256):
    raise ValueError(f"block_size must be a power of two from 8 to 256, got {block_size}")


def _check_format(name, value):
  if value not in FP8_DTYPES:
    raise ValueError(f"{name} must be one of {tuple(FP8_DTYPES)}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling:
  """One scale per group of rows (per_group=True) or per tensor: scale = fp8_max / amax.

  forward_fast_accumulation: the forward GEMM (E4M3 x E4M3) accumulates in the tensor cores'
  FP8 accumulator without promoting partial sums to fp32 registers every few k-blocks. It is
  faster (and on Hopper lets the grouped GEMM use 128x256 tiles) and a little less precise;
  TransformerEngine's default for the forward GEMM. The gradient GEMMs always promote
  (TransformerEngine's split accumulator).

  fp8_wgrad: the grouped ops (grouped_linear, grouped_mlp) compute weight gradients in FP8
  too, from the FP8 copies the forward and dgrad already made (x in E4M3, the output
  gradient in gradient_format) transposed column-wise, as TransformerEngine's Hopper recipe
  does; the backward then keeps no 16-bit copy of x. False runs them in 16-bit from the
  saved 16-bit inputs (more accurate, slower, more memory).
  """
  per_group: bool = True
  forward_format: str = "e4m3"
  gradient_format: str = "e5m2"
  forward_fast_accumulation: bool = True
  fp8_wgrad: bool = True

  def __post_init__(self):
    _check_format("forward_format", self.forward_format)
    _check_format("gradient_format", self.gradient_format)


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling:
  """1 x block_size blocks (activations) / block_size^2 tiles (weights), fp32 scales.

  fp8_wgrad: the grouped ops (grouped_linear, grouped_mlp, moe) compute weight gradients in
  FP8 too, as DeepSeek-V3 does: x (forward_format) and the output gradient
  (gradient_format) quantized in block_size x 1 blocks down each group's rows, transposed,
  and the blockwise FP8 wgrad kernel. This needs a single device or shard_map with every
  mesh axis manual (the transposed copies' width depends on the rows per device); under
  automatic partitioning the weight gradients stay 16-bit. Off by default: on the H200 the
  kernel (a row and a column scale per output every 128 rows, promoted while the next
  k-tile runs) is only 1.10-1.12x the bf16 wgrad at 8 x 8192 rows and 0.87x at 512 rows per
  group, so the two extra quantizing passes make the step slower (the blockwise grouped MLP
  at T=65536: 7.19 ms against 6.99 ms with 16-bit weight gradients, same run).
  """
  block_size: int = 128
  forward_format: str = "e4m3"
  gradient_format: str = "e4m3"
  fp8_wgrad: bool = False

  def __post_init__(self):
    _check_format("forward_format", self.forward_format)
    _check_format("gradient_format", self.gradient_format)
    _check_block(self.block_size)


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling:
  """OCP MX: 1 x block_size blocks (32), E8M0 (power-of-two) scales stored as uint8."""
  block_size: int = 32
  forward_format: str = "e4m3"
  gradient_format: str = "e5m2"

  def __post_init__(self):
    _check_format("forward_format", self.forward_format)
    _check_format("gradient_format", self.gradient_format)
    _check_block(self.block_size)


Recipe = Union[Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling]
RECIPES = (Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling)

# Scaling modes (static metadata of a QuantizedArray) and their handler codes.
SCALING_MODES = {"per_tensor": 0, "per_group": 0, "block_1d": 1, "block_2d": 2, "mxfp8": 3}
# quantize_experts' modes: data [G, N, K] of a kernel [G, K, N] (per-expert current scaling,
# or 128 x 128 tiles for the blockwise FP8 grouped GEMM).
EXPERT_MODES = ("per_expert", "expert_block_2d")


def fp8_format(recipe, role: str) -> str:
  if role not in ROLES:
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")
  return recipe.forward_format if role == "forward" else recipe.gradient_format


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """FP8 data with its inverse scales: ``value ~= data.astype(f32) * scale_inv[...]``.

  Dynamic fields (pytree leaves):
    data: FP8 (float8_e4m3fn or float8_e5m2) with the shape of the original array
      (transposed per expert for "per_expert").
    scale_inv: the dequantization multipliers, by scaling_mode:
      "per_tensor": float32 [1]; "per_group": float32 [G] (rows of group g are
      group_offsets[g]:group_offsets[g+1]; rows past group_offsets[G] hold zeros);
      "per_expert" (``jaxfuse.quantize_experts``): float32 [G] for data [G, N, K], expert
      g's kernel [K, N] transposed (the K-major layout of the FP8 grouped GEMMs);
      "per_kernel" (``jaxfuse.quantize_kernel``): float32 [1] for data [N, K], a dense
      kernel [K, N] transposed (the K-major layout of the FP8 linear_scale_add);
      "expert_block_2d" (``jaxfuse.quantize_experts`` with Float8BlockScaling): float32
      [G, ceil(N / block), ceil(K / block)] for data [G, N, K], one scale per block x
      block tile of each expert's kernel [K, N], transposed with it;
      "block_1d": float32 [..., ceil(K / block)]; "block_2d": float32
      [..., ceil(R / block), ceil(K / block)] for data [..., R, K]; "mxfp8": uint8
      [..., ceil(K / block)] biased exponents (2^(e - 127)).
    group_offsets: int32 [G + 1] for "per_group", else None.
    data_untransposed: for a trainable "per_expert" / "expert_block_2d" / "per_kernel"
      array, the same FP8 values in the kernel's layout [G, K, N] / [K, N] (what the FP8
      dgrad reads; an "expert_block_2d" copy's tile scales are scale_inv swapped), else
      None.
    master: for a trainable "per_expert" / "expert_block_2d" / "per_kernel" array (``quantize_experts`` /
      ``quantize_kernel`` with ``trainable=True``), the 16-bit kernel the values were
      quantized from: the ops that take the array send the kernel's gradient there (the
      wgrad does not read the weights), so one quantization can serve many calls that
      still train the kernel. Else None.
  Static fields: recipe, scaling_mode, block_size, dtype (the original dtype, which
  dequantize returns), role ("forward" or "gradient").
  """
  data: jax.Array
  scale_inv: jax.Array
  group_offsets: Optional[jax.Array] = None
  data_untransposed: Optional[jax.Array] = None
  master: Optional[jax.Array] = None
  recipe: Any = dataclasses.field(default=None, metadata=dict(static=True))
  scaling_mode: str = dataclasses.field(default="per_tensor", metadata=dict(static=True))
  block_size: int = dataclasses.field(default=0, metadata=dict(static=True))
  dtype: Any = dataclasses.field(default=jnp.dtype(jnp.float32), metadata=dict(static=True))
  role: str = dataclasses.field(default="forward", metadata=dict(static=True))

  @property
  def shape(self):
    """The shape of the array it represents (what ``dequantize`` returns): data's, or for
    "per_expert" / "expert_block_2d" data [G, N, K] the kernel's [G, K, N] ("per_kernel":
    [N, K] -> [K, N])."""
    if self.scaling_mode in EXPERT_MODES:
      groups, n, k = self.data.shape
      return (groups, k, n)
    if self.scaling_mode == "per_kernel":
      n, k = self.data.shape
      return (k, n)
    return self.data.shape

  @property
  def fp8_dtype(self):
    return self.data.dtype

  def dequantize(self) -> jax.Array:
    from jaxfuse._src.ops.quantize import reference  # pylint: disable=g-import-not-at-top
    return reference.dequantize(self)
