"""ffi_call wrappers for the quantization handlers (cuda/cpu/quantize.cc,
cuda/gpu/quantize.cu, cuda/gpu/scaled_activation_quantize.cu).

Every handler takes the group offsets (int32 [G + 1]; a dummy [1] for block modes) and
returns an ``amax`` float32 [G] buffer besides data and scale_inv: the CUDA kernels of
current scaling accumulate per-group amax there (atomicMax, zeroed in the same launch
chain); it is scratch and the wrappers drop it. All handlers run per vmapped example
(vmap_method="sequential"): group offsets index the rows of one example.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._src import checks
from jaxfuse._src import compat
from jaxfuse._src import ffi as ffi_registry
from jaxfuse._src.ops.scaled_activation import ffi as act_ffi
from jaxfuse.quantization import recipes


def scale_inv_type(shape, scaling_mode, block, num_groups):
  """ShapeDtypeStruct of scale_inv for values of `shape` ([..., K])."""
  k = shape[-1]
  if scaling_mode in ("per_tensor", "per_group"):
    return jax.ShapeDtypeStruct((num_groups,), jnp.float32)
  if scaling_mode == "block_2d":
    return jax.ShapeDtypeStruct((*shape[:-2], -(-shape[-2] // block), -(-k // block)),
                                jnp.float32)
  dtype = jnp.uint8 if scaling_mode == "mxfp8" else jnp.float32
  return jax.ShapeDtypeStruct((*shape[:-1], -(-k // block)), dtype)


def _mode_attrs(scaling_mode, block):
  return dict(mode=np.int32(recipes.SCALING_MODES[scaling_mode]), block=np.int32(block))


def _amax_type(offsets, scaling_mode):
  current = scaling_mode in ("per_tensor", "per_group")
  return jax.ShapeDtypeStruct((offsets.shape[0] - 1 if current else 1,), jnp.float32)


def _columnwise_type(shape, offsets, fmt, wanted):
  """The optional column-wise result: [K, columnwise_width(rows, G)] FP8, or empty [0]."""
  if not wanted:
    return jax.ShapeDtypeStruct((0,), recipes.FP8_DTYPES[fmt])
  rows = int(np.prod(shape[:-1]))
  return jax.ShapeDtypeStruct((shape[-1], columnwise_width(rows, offsets.shape[0] - 1)),
                              recipes.FP8_DTYPES[fmt])


def quantize(x, offsets, *, scaling_mode, block, fmt, columnwise=False):
  """(data, scale_inv), and with ``columnwise`` (current scaling only) a third result: the
  column-wise copy of data, as group_columnwise(data, offsets) would make it, written by
  the same kernel pass (the FP8 wgrad's operand)."""
  ffi_registry.ensure_registered()
  num_groups = offsets.shape[0] - 1
  out_types = (jax.ShapeDtypeStruct(x.shape, recipes.FP8_DTYPES[fmt]),
               scale_inv_type(x.shape, scaling_mode, block, num_groups),
               _amax_type(offsets, scaling_mode),
               _columnwise_type(x.shape, offsets, fmt, columnwise))
  data, scale_inv, _, copy = jax.ffi.ffi_call("jaxfuse_quantize", out_types,
                                              vmap_method="sequential")(
      x, offsets, **_mode_attrs(scaling_mode, block))
  out = (compat.vary_like(data, x, offsets), compat.vary_like(scale_inv, x, offsets))
  return (*out, compat.vary_like(copy, x, offsets)) if columnwise else out


def quantize_gathered(x, source_rows, offsets, amax, *, fmt, columnwise=False):
  """Per-group current scaling of gathered rows: row r of the result is x[source_rows[r]].

  x [T, K] float; source_rows int32 [M] (indices outside [0, T) read row 0 or T - 1);
  offsets int32 [G + 1] group the M result rows; amax float32 [G] is each group's amax,
  given (``gathered.group_amax``), so the kernel makes one pass. Returns (data FP8 [M, K],
  scale_inv float32 [G]) as ``quantize(x[source_rows], offsets, scaling_mode="per_group")``
  would, plus the column-wise copy with ``columnwise``. The MoE layer's FP8 experts read
  their tokens through it, so the expert-sorted 16-bit copy is never written.
  """
  ffi_registry.ensure_registered()
  rows = source_rows.shape[0]
  out_types = (jax.ShapeDtypeStruct((rows, x.shape[-1]), recipes.FP8_DTYPES[fmt]),
               jax.ShapeDtypeStruct((offsets.shape[0] - 1,), jnp.float32),
               _columnwise_type((rows, x.shape[-1]), offsets, fmt, columnwise))
  data, scale_inv, copy = jax.ffi.ffi_call("jaxfuse_quantize_gathered", out_types,
                                           vmap_method="sequential")(
      x, source_rows, offsets, amax)
  inputs = (x, source_rows, offsets, amax)
  out = (compat.vary_like(data, *inputs), compat.vary_like(scale_inv, *inputs))
  return (*out, compat.vary_like(copy, *inputs)) if columnwise else out


def scaled_activation_quantize(x, scales, offsets, *, activation, limit, alpha, linear_offset,
                               scaling_mode, block, fmt, columnwise=False):
  """(data, scale_inv), plus the column-wise copy of data with ``columnwise`` (as quantize)."""
  ffi_registry.ensure_registered()
  shape = (*x.shape[:-1], act_ffi.out_features(x.shape, activation))
  num_groups = offsets.shape[0] - 1
  out_types = (jax.ShapeDtypeStruct(shape, recipes.FP8_DTYPES[fmt]),
               scale_inv_type(shape, scaling_mode, block, num_groups),
               _amax_type(offsets, scaling_mode),
               _columnwise_type(shape, offsets, fmt, columnwise))
  data, scale_inv, _, copy = jax.ffi.ffi_call("jaxfuse_scaled_activation_quantize", out_types,
                                              vmap_method="sequential")(
      x, scales, offsets, **act_ffi.activation_attrs(activation, limit, alpha, linear_offset),
      **_mode_attrs(scaling_mode, block))
  inputs = (x, scales, offsets)
  out = (compat.vary_like(data, *inputs), compat.vary_like(scale_inv, *inputs))
  return (*out, compat.vary_like(copy, *inputs)) if columnwise else out


def scaled_dactivation_quantize(dy, x, scales, offsets, *, activation, limit, alpha,
                                linear_offset, scaling_mode, block, fmt, return_dx,
                                columnwise=False):
  """(data, scale_inv, dx or None, dscales float32), plus the column-wise copy of data with
  ``columnwise`` (as quantize): the dact fused with the quantization for FC1's dgrad and
  its FP8 wgrad."""
  ffi_registry.ensure_registered()
  num_groups = offsets.shape[0] - 1
  out_types = (jax.ShapeDtypeStruct(x.shape, recipes.FP8_DTYPES[fmt]),
               scale_inv_type(x.shape, scaling_mode, block, num_groups),
               jax.ShapeDtypeStruct(x.shape if return_dx else (0,), x.dtype),
               jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32), _amax_type(offsets, scaling_mode),
               _columnwise_type(x.shape, offsets, fmt, columnwise))
  data, scale_inv, dx, dscales, _, copy = jax.ffi.ffi_call(
      "jaxfuse_scaled_dactivation_quantize", out_types, vmap_method="sequential")(
          dy, x, scales, offsets,
          **act_ffi.activation_attrs(activation, limit, alpha, linear_offset),
          **_mode_attrs(scaling_mode, block))
  inputs = (dy, x, scales, offsets)
  out = (compat.vary_like(data, *inputs), compat.vary_like(scale_inv, *inputs),
         compat.vary_like(dx, *inputs) if return_dx else None,
         compat.vary_like(dscales, *inputs))
  return (*out, compat.vary_like(copy, *inputs)) if columnwise else out


def batch_amax(x):
  """x [B, R, C] (float32/bfloat16/float16) -> amax float32 [B]: max |x[b]| over each
  batch, NaN counted as 0, 0 for an empty batch. Pass 1 of per-tensor current scaling
  (quantize_transposed takes its result); the CUDA kernel streams x once at close to the
  DRAM bandwidth, where XLA's reduction of the same jnp expression reads at ~3.3 TB/s."""
  ffi_registry.ensure_registered()
  out_type = jax.ShapeDtypeStruct((x.shape[0],), jnp.float32)
  amax = jax.ffi.ffi_call("jaxfuse_batch_amax", out_type, vmap_method="sequential")(x)
  return compat.vary_like(amax, x)


def quantize_transposed(x, amax, *, fmt, untransposed=False):
  """x [B, R, C] (float32/bfloat16/float16) -> (data [B, C, R] FP8, scale_inv float32 [B],
  data_untransposed: [B, R, C] FP8 with ``untransposed``, else an empty [0] array).

  data[b, c, r] = fp8(x[b, r, c] * scale[b]) with scale[b] = fp8_max / amax[b] (1 when
  amax[b] is 0 or inf) from the given amax float32 [B]; scale_inv = 1 / scale. One kernel
  pass: the FP8 forward weights of the grouped GEMM, K-major, without an XLA transpose;
  with ``untransposed`` the same bytes also in x's layout (what the FP8 dgrad takes).
  """
  ffi_registry.ensure_registered()
  batch, rows, cols = x.shape
  fp8 = recipes.FP8_DTYPES[fmt]
  out_types = (jax.ShapeDtypeStruct((batch, cols, rows), fp8),
               jax.ShapeDtypeStruct((batch,), jnp.float32),
               jax.ShapeDtypeStruct(x.shape if untransposed else (0,), fp8))
  data, scale_inv, straight = jax.ffi.ffi_call("jaxfuse_quantize_transposed", out_types,
                                               vmap_method="sequential")(x, amax)
  return tuple(compat.vary_like(out, x, amax) for out in (data, scale_inv, straight))


def quantize_batches_transposed(x, *, fmt, untransposed=False):
  """x [B, R, C] (float32/bfloat16/float16) -> (data [B, C, R] FP8, scale_inv float32 [B],
  data_untransposed: [B, R, C] FP8 with ``untransposed``, else an empty [0] array).

  ``quantize_transposed(x, batch_amax(x))`` in one call: the same bytes. On the GPU a
  batch whose 128 x 128 tiles fit in the shared memory of a team of resident blocks (16-bit
  x, C % 8 == 0, R % 16 == 0; up to ~13 M elements a batch on an H100/H200) is read from
  DRAM once: a cooperative kernel holds the tiles while the team agrees on the amax, then
  quantizes them (``cuda/gpu/quantize.cu``, QuantizeBatchesOnePassKernel). Otherwise the
  amax kernel and the transposed quantization run one after the other. The op's fourth
  result, uint32 [2, B], is the kernels' scratch (amaxes, arrival counters).

  Raises:
    ValueError: x is not [B, R, C]. The handler rejects other dtypes, naming x.
  """
  checks.check_rank("x", x, 3, "[B, R, C]")
  ffi_registry.ensure_registered()
  batch, rows, cols = x.shape
  fp8 = recipes.FP8_DTYPES[fmt]
  out_types = (jax.ShapeDtypeStruct((batch, cols, rows), fp8),
               jax.ShapeDtypeStruct((batch,), jnp.float32),
               jax.ShapeDtypeStruct(x.shape if untransposed else (0,), fp8),
               jax.ShapeDtypeStruct((2, batch), jnp.uint32))
  data, scale_inv, straight, _ = jax.ffi.ffi_call(
      "jaxfuse_quantize_batches_transposed", out_types, vmap_method="sequential")(x)
  return tuple(compat.vary_like(out, x) for out in (data, scale_inv, straight))


# Mirrors kWeightBlock (jaxfuse/quantize.h): the blockwise grouped GEMM's weight tiles.
WEIGHT_BLOCK = 128


def quantize_blocks_transposed(x, *, fmt, untransposed=False):
  """x [B, R, C] (float32/bfloat16/float16) -> (data [B, C, R] FP8, scale_inv float32
  [B, ceil(R / 128), ceil(C / 128)], data_untransposed: [B, R, C] FP8 with
  ``untransposed``, else an empty [0] array), FP8 of ``fmt`` ("e4m3" or "e5m2").

  One scale per 128 x 128 tile x[b, 128 i:128 (i + 1), 128 j:128 (j + 1)] (smaller at the
  edges): scale = fp8_max / amax of the tile (NaN counted as 0; 1 when the amax is 0 or
  inf), scale_inv[b, i, j] = 1 / scale, data[b, c, r] = fp8(x[b, r, c] * scale). The same
  bits as the 2-D block quantization of x (block 128) with data swapped to [B, C, R]: the
  blockwise grouped GEMM's weights, forward layout and with ``untransposed`` the dgrad's,
  from one kernel pass.
  """
  checks.check_rank("x", x, 3, "[B, R, C]")
  checks.check_float_array("x", x)
  if fmt not in recipes.FP8_DTYPES:
    raise ValueError(f"fmt must be one of {tuple(recipes.FP8_DTYPES)}, got {fmt!r}")
  ffi_registry.ensure_registered()
  batch, rows, cols = x.shape
  fp8 = recipes.FP8_DTYPES[fmt]
  blocks = (batch, -(-rows // WEIGHT_BLOCK), -(-cols // WEIGHT_BLOCK))
  out_types = (jax.ShapeDtypeStruct((batch, cols, rows), fp8),
               jax.ShapeDtypeStruct(blocks, jnp.float32),
               jax.ShapeDtypeStruct(x.shape if untransposed else (0,), fp8))
  data, scale_inv, straight = jax.ffi.ffi_call("jaxfuse_quantize_blocks_transposed", out_types,
                                               vmap_method="sequential")(x)
  return tuple(compat.vary_like(out, x) for out in (data, scale_inv, straight))


# Mirrors jaxfuse/columnwise.h: each group's first column is 16-aligned.
COLUMNWISE_ALIGN = 16


def columnwise_width(rows: int, groups: int) -> int:
  """Columns of the column-wise copy of `rows` grouped rows (jaxfuse/columnwise.h)."""
  align = COLUMNWISE_ALIGN
  return -(-rows // align) * align + align * groups


def columnwise_start(clamped_offset, group):
  """First column of group `group` whose rows start at `clamped_offset` (ints or arrays)."""
  align = COLUMNWISE_ALIGN
  return (clamped_offset + align - 1) // align * align + align * group


def group_columnwise(data, offsets):
  """FP8 data [M, K] (rows grouped by offsets int32 [G + 1]) -> its column-wise copy, a
  buffer of shape [K, columnwise_width(M, G)]: group g's rows as columns from
  columnwise_start(c_g, g) of a transposed [K, W] matrix, zeros elsewhere, stored in G + 1
  row-major blocks cut at the group starts (the blocked layout of
  cuda/include/jaxfuse/columnwise.h, which the FP8 wgrad reads: the buffer is not that
  [K, W] matrix). The CUDA kernel needs K to be a multiple of 16 (as the FP8 GEMMs do);
  the CPU handler takes any K."""
  ffi_registry.ensure_registered()
  rows, cols = data.shape
  groups = offsets.shape[0] - 1
  out_type = jax.ShapeDtypeStruct((cols, columnwise_width(rows, groups)), data.dtype)
  out = jax.ffi.ffi_call("jaxfuse_group_columnwise", out_type,
                         vmap_method="sequential")(data, offsets)
  return compat.vary_like(out, data, offsets)


# Mirrors kColumnwiseScaleBlock and kColumnwiseMaxGroups (jaxfuse/columnwise.h, quantize.h):
# rows per scaling block of a group's column-wise copy; the most groups the CUDA kernels
# hold in shared memory.
COLUMNWISE_SCALE_BLOCK = 128
COLUMNWISE_MAX_GROUPS = 4096


def columnwise_scale_rows(rows: int, groups: int) -> int:
  """Rows of the blockwise scales of a column-wise copy of `rows` grouped rows
  (ColumnwiseScaleRows in jaxfuse/columnwise.h): ceil(rows / 128) + groups."""
  return -(-rows // COLUMNWISE_SCALE_BLOCK) + groups


def columnwise_scale_row(clamped_offset, group):
  """Scale row of block 0 of group `group` whose rows start at `clamped_offset` (ints or
  arrays; ColumnwiseScaleRow): block j of the group is this row + j."""
  return clamped_offset // COLUMNWISE_SCALE_BLOCK + group


def quantize_columnwise_blocks(x, offsets, *, fmt):
  """x [M, C] (float32/bfloat16/float16), rows grouped by offsets int32 [G + 1] ->
  (data FP8 [C, columnwise_width(M, G)], scale_inv float32 [columnwise_scale_rows(M, G), C]),
  FP8 of ``fmt`` ("e4m3" or "e5m2"): the FP8 grouped wgrad's operand under
  Float8BlockScaling, x transposed per group with one scale per column of x and 128-row
  block of the group (cuda/include/jaxfuse/columnwise.h).

  With the clamped offsets c_g (clamp(offsets, 0, M), made non-decreasing, as the grouped
  GEMM reads them), row r of group g is column columnwise_start(c_g, g) + r - c_g of the
  copy, stored in the blocked layout of group_columnwise; every other column is zero.
  Block j of group g (rows c_g + 128 j .. min(c_g + 128 (j + 1), c_{g+1})) is scale row
  columnwise_scale_row(c_g, g) + j; rows of no block hold 1. Each (block, column) has the
  bits the 1 x 128 block quantization (Float8BlockScaling, block_1d) gives that block's
  values of the column as one row: scale = fp8_max / amax (NaN counted as 0; 1 when the
  amax is 0 or inf), scale_inv = 1 / scale. Any offsets are safe (no out-of-bounds access).

  Raises:
    ValueError: x not of rank 2, offsets not [G + 1] with 1 <= G <= 4096, unknown fmt.
    TypeError: x not float32/bfloat16/float16, offsets not int32.
  """
  checks.check_rank("x", x, 2, "[M, C]")
  checks.check_float_array("x", x)
  if checks.dtype_of("offsets", offsets) != jnp.int32:
    raise TypeError(f"offsets must be int32 [G + 1], got {jnp.result_type(offsets)}")
  if np.ndim(offsets) != 1 or not 2 <= np.shape(offsets)[0] <= COLUMNWISE_MAX_GROUPS + 1:
    raise ValueError(f"offsets must be int32 [G + 1] with 1 <= G <= {COLUMNWISE_MAX_GROUPS}, "
                     f"got shape {np.shape(offsets)}")
  if fmt not in recipes.FP8_DTYPES:
    raise ValueError(f"fmt must be one of {tuple(recipes.FP8_DTYPES)}, got {fmt!r}")
  ffi_registry.ensure_registered()
  rows, cols = x.shape
  groups = offsets.shape[0] - 1
  out_types = (jax.ShapeDtypeStruct((cols, columnwise_width(rows, groups)),
                                    recipes.FP8_DTYPES[fmt]),
               jax.ShapeDtypeStruct((columnwise_scale_rows(rows, groups), cols), jnp.float32))
  data, scale_inv = jax.ffi.ffi_call("jaxfuse_quantize_columnwise_blocks", out_types,
                                     vmap_method="sequential")(x, offsets)
  return compat.vary_like(data, x, offsets), compat.vary_like(scale_inv, x, offsets)
