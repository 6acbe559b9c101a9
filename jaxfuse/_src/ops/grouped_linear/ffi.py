"""ffi_call wrapper for the grouped GEMM handlers (cuda/cpu/grouped_linear.cc,
cuda/gpu/grouped_linear.cu): forward, dgrad and wgrad forms of one target."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._src import compat
from jaxfuse._src import ffi as ffi_registry

FORWARD, DGRAD, WGRAD = 0, 1, 2
_TYPE_CODES = {jnp.dtype(jnp.bfloat16): 0, jnp.dtype(jnp.float16): 1,
               jnp.dtype(jnp.float8_e4m3fn): 2, jnp.dtype(jnp.float8_e5m2): 3}
_DEFAULT_SM_COUNT = 132  # H100/H200 SXM


@functools.cache
def _sm_count() -> int:
  """Largest multiprocessor count among visible GPUs: the persistent grid's size."""
  counts = [getattr(d, "core_count", 0) or 0 for d in jax.devices("gpu")] if \
      compat.has_cuda_backend() else []
  return max(counts, default=_DEFAULT_SM_COUNT) or _DEFAULT_SM_COUNT


def _workspace_bytes(form, a, b, m, k, n, groups, fast_accumulation,
                     block_scaling=False, gated=False) -> int:
  extension = ffi_registry.require_extension()
  a_code = _TYPE_CODES.get(jnp.dtype(a.dtype))
  b_code = _TYPE_CODES.get(jnp.dtype(b.dtype))
  if a_code is None or b_code is None:
    return 0  # the handler reports the unsupported dtype
  return int(extension.grouped_gemm_workspace_bytes(form, a_code, b_code, m, k, n, groups,
                                                    _sm_count(), fast_accumulation,
                                                    block_scaling, gated))


def grouped_gemm(a: jax.Array, b: jax.Array, group_offsets: jax.Array, *, form: int,
                 a_scale_inv=None, b_scale_inv=None, out_dtype=None,
                 fast_accumulation: bool = False) -> jax.Array:
  """One grouped GEMM form (see cuda/include/jaxfuse/grouped_linear.h).

  forward: a = x [m, k], b = w [G, k, n] -> [m, n]; dgrad: a = dy [m, n], b = w -> [m, k];
  wgrad: a = x [m, k], b = dy [m, n] -> [G, k, n]. group_offsets: int32 [G + 1] on the
  device. FP8 (a_scale_inv, b_scale_inv: float32 [G]) takes the forward weight as
  [G, n, k] and returns bfloat16; its wgrad takes x in E4M3 and dy in E4M3 or E5M2,
  row-wise like the 16-bit form, and transposes both (see _fp8_wgrad); fast_accumulation
  (FP8 forward with E4M3 activations only, else the handler raises) keeps the tensor cores'
  FP8 accumulator instead of promoting to fp32 every few k-blocks.
  """
  ffi_registry.ensure_registered()
  groups = group_offsets.shape[0] - 1
  fp8 = a_scale_inv is not None
  m = a.shape[0]
  if fp8 and form == WGRAD:
    return _fp8_wgrad(a, b, group_offsets, a_scale_inv, b_scale_inv)
  if form == FORWARD:
    k = a.shape[1]
    n = b.shape[1] if fp8 else b.shape[2]
    out_shape = (m, n)
  elif form == DGRAD:
    n, k = a.shape[1], b.shape[1]
    out_shape = (m, k)
  else:
    k, n = a.shape[1], b.shape[1]
    out_shape = (groups, k, n)
  out_dtype = jnp.dtype(out_dtype or (jnp.bfloat16 if fp8 else a.dtype))
  out_type = jax.ShapeDtypeStruct(out_shape, out_dtype)
  target = "jaxfuse_grouped_gemm_fp8" if fp8 else "jaxfuse_grouped_gemm"
  operands = (a, b, group_offsets) + ((a_scale_inv, b_scale_inv) if fp8 else ())
  attrs = dict(form=np.int32(form))
  if fp8:
    attrs["fast_accumulation"] = bool(fast_accumulation)
  workspace_bytes = _workspace_bytes(form, a, b, m, k, n, groups, fast_accumulation)
  return _call(target, out_type, operands, attrs, workspace_bytes)


# The gated FC1's CTA tile holds 128 gate and 128 linear columns: 2F must be a multiple.
GATED_WIDTH_MULTIPLE = 256


def supports_gated(x, w, activation: str) -> bool:
  """Whether grouped_gemm_gated's CUDA kernel takes this FC1 (the CPU path takes any)."""
  return (activation in ("swiglu", "clamped_swiglu") and jnp.dtype(x.dtype) == jnp.bfloat16
          and jnp.dtype(w.dtype) == jnp.bfloat16 and w.shape[2] % GATED_WIDTH_MULTIPLE == 0)


def grouped_gemm_gated(x: jax.Array, w: jax.Array, group_offsets: jax.Array,
                       scales: jax.Array, *, activation: str, limit: float, alpha: float,
                       linear_offset: float) -> tuple[jax.Array, jax.Array]:
  """FC1 of a gated MLP and its scaled activation: (h, act).

  x: bfloat16 [m, H]; w: bfloat16 [G, H, 2F] (gate columns first, 2F a multiple of 256);
  group_offsets: int32 [G + 1] on the device; scales: float32 or bfloat16 [m].
  h = x @ w[g] per group, bfloat16 [m, 2F]; act = scaled_activation(h, scales) bfloat16
  [m, F], bit for bit. On CUDA one kernel writes both from FC1's accumulators
  (cuda/gpu/grouped_gemm/gated_epilogue.cuh); on CPU the forward GEMM and the scaled
  activation run one after the other. Rows outside the groups are zeros in both.
  """
  from jaxfuse._src.ops.scaled_activation import ffi as act_ffi  # pylint: disable=g-import-not-at-top
  ffi_registry.ensure_registered()
  groups = group_offsets.shape[0] - 1
  (m, k), width = x.shape, w.shape[2]
  attrs = act_ffi.activation_attrs(activation, limit, alpha, linear_offset)
  out_types = (jax.ShapeDtypeStruct((m, width), x.dtype),
               jax.ShapeDtypeStruct((m, width // 2), x.dtype))
  workspace_bytes = _workspace_bytes(FORWARD, x, w, m, k, width, groups, False, gated=True)

  def cpu(x, w, group_offsets, scales):
    h = grouped_gemm(x, w, group_offsets, form=FORWARD)
    return h, act_ffi.forward(h, scales, activation=activation, limit=limit, alpha=alpha,
                              linear_offset=linear_offset)

  def cuda(x, w, group_offsets, scales):
    workspace = jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8)
    h, act, _ = jax.ffi.ffi_call("jaxfuse_grouped_gemm_gated", (*out_types, workspace),
                                 vmap_method="sequential")(x, w, group_offsets, scales, **attrs)
    return h, act

  operands = (x, w, group_offsets, scales)
  h, act = jax.lax.platform_dependent(*operands, cpu=cpu, cuda=cuda)
  return compat.vary_like(h, *operands), compat.vary_like(act, *operands)


# The blockwise FP8 scales' block edge (the kernels' 1 x 128 and 128 x 128 blocks).
SCALE_BLOCK = 128


def grouped_gemm_blockwise(a: jax.Array, b: jax.Array, group_offsets: jax.Array,
                           a_scale_inv: jax.Array, b_scale_inv: jax.Array, *,
                           form: int) -> jax.Array:
  """One blockwise-scaled FP8 grouped GEMM (DeepSeek-V3's recipe), bfloat16 result.

  forward: a = x [m, k] E4M3 with a_scale_inv float32 [m, ceil(k / 128)] (1 x 128 blocks),
  b = w^T [G, n, k] E4M3 with b_scale_inv float32 [G, ceil(n / 128), ceil(k / 128)]
  (128 x 128 tiles) -> [m, n]. dgrad: a = dy [m, n] E4M3 or E5M2 with [m, ceil(n / 128)],
  b = w [G, k, n] E4M3 with [G, ceil(k / 128), ceil(n / 128)] -> [m, k]. Each 128-block of
  the contraction's fp32 partial sums is multiplied by its two scales (see
  cuda/include/jaxfuse/grouped_gemm.h); rows outside the groups are zero.
  """
  ffi_registry.ensure_registered()
  groups = group_offsets.shape[0] - 1
  m = a.shape[0]
  if form == FORWARD:
    k, n = a.shape[1], b.shape[1]
    out_shape = (m, n)
  elif form == DGRAD:
    n, k = a.shape[1], b.shape[1]
    out_shape = (m, k)
  else:
    raise ValueError(f"the blockwise FP8 grouped GEMM has the forward ({FORWARD}) and dgrad "
                     f"({DGRAD}) forms, got form {form}")
  out_type = jax.ShapeDtypeStruct(out_shape, jnp.bfloat16)
  workspace_bytes = _workspace_bytes(form, a, b, m, k, n, groups, False, block_scaling=True)
  return _call("jaxfuse_grouped_gemm_fp8_blockwise", out_type,
               (a, b, group_offsets, a_scale_inv, b_scale_inv), dict(form=np.int32(form)),
               workspace_bytes)


def _call(target, out_type, operands, attrs, workspace_bytes):
  """One grouped GEMM handler on whichever backend runs: the CUDA handler also returns its
  scratch (`workspace_bytes`, host arithmetic), which is dropped; the CPU handler has none."""

  def cpu(*args):
    return jax.ffi.ffi_call(target, out_type, vmap_method="sequential")(*args, **attrs)

  def cuda(*args):
    workspace = jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8)
    out, _ = jax.ffi.ffi_call(target, (out_type, workspace),
                              vmap_method="sequential")(*args, **attrs)
    return out

  out = jax.lax.platform_dependent(*operands, cpu=cpu, cuda=cuda)
  return compat.vary_like(out, *operands)


def _fp8_wgrad(x, dy, group_offsets, x_scale_inv, dy_scale_inv):
  """dw [G, k, n] bfloat16 = per group x_scale_inv[g] * dy_scale_inv[g] * x_g^T @ dy_g.

  SM90 FP8 tensor cores read both operands K-major, and the wgrad contracts the rows: the
  column-wise copies of x and dy (each group's rows as 16-aligned columns, one transposing
  kernel each) feed jaxfuse_grouped_gemm_fp8_wgrad. On CPU the same two steps run, so CI
  covers the layout the GPU kernel reads.
  """
  from jaxfuse._src.ops.quantize import ffi as quantize_ffi  # pylint: disable=g-import-not-at-top
  x_t = quantize_ffi.group_columnwise(x, group_offsets)
  dy_t = quantize_ffi.group_columnwise(dy, group_offsets)
  return fp8_wgrad_columnwise(x_t, dy_t, group_offsets, x_scale_inv, dy_scale_inv,
                              rows=x.shape[0])


def fp8_wgrad_columnwise(x_t, dy_t, group_offsets, x_scale_inv, dy_scale_inv, *, rows: int):
  """The FP8 wgrad kernel alone, on column-wise copies (quantize ffi.group_columnwise) of
  `rows` grouped rows: x_t [k, W] E4M3, dy_t [n, W] E4M3 or E5M2 -> bfloat16 [G, k, n]."""
  (k, _), (n, _) = x_t.shape, dy_t.shape
  m = int(rows)
  groups = group_offsets.shape[0] - 1
  out_type = jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16)
  operands = (x_t, dy_t, group_offsets, x_scale_inv, dy_scale_inv)
  workspace_bytes = _workspace_bytes(WGRAD, x_t, dy_t, m, k, n, groups, False)
  return _call("jaxfuse_grouped_gemm_fp8_wgrad", out_type, operands,
               dict(rows=np.int64(m)), workspace_bytes)


def fp8_blockwise_wgrad_columnwise(x_t, dy_t, group_offsets, x_t_scale_inv, dy_t_scale_inv, *,
                                   rows: int):
  """The blockwise FP8 wgrad kernel (Float8BlockScaling) on column-wise copies of `rows`
  grouped rows quantized in 128 x 1 blocks (quantize ffi.quantize_columnwise_blocks):
  x_t [k, W] E4M3 with x_t_scale_inv float32 [S, k], dy_t [n, W] E4M3 or E5M2 with
  dy_t_scale_inv float32 [S, n], W = ColumnwiseWidth(rows, G), S = ColumnwiseScaleRows(rows,
  G) (cuda/include/jaxfuse/columnwise.h) -> bfloat16 [G, k, n]: per group, each 128-row
  block's fp32 partial sums times its two scales (zero for an empty group)."""
  ffi_registry.ensure_registered()
  (k, _), (n, _) = x_t.shape, dy_t.shape
  m = int(rows)
  groups = group_offsets.shape[0] - 1
  out_type = jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16)
  operands = (x_t, dy_t, group_offsets, x_t_scale_inv, dy_t_scale_inv)
  workspace_bytes = _workspace_bytes(WGRAD, x_t, dy_t, m, k, n, groups, False,
                                     block_scaling=True)
  return _call("jaxfuse_grouped_gemm_fp8_blockwise_wgrad", out_type, operands,
               dict(rows=np.int64(m)), workspace_bytes)
