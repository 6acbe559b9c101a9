"""Public grouped_linear: validation, implementation choice, custom_vjp.

The forward pass turns group_sizes into offsets once; the offsets travel to the backward
pass as a custom_vjp residual, where the dgrad and wgrad kernels read them as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfuse._src import checks
from jaxfuse._src import compat
from jaxfuse._src import implementation as implementation_lib
from jaxfuse._src.ops.grouped_linear import ffi
from jaxfuse._src.ops.grouped_linear import reference
from jaxfuse._src.ops.grouped_linear import sharding

# TMA (the Hopper copy engine the CUTLASS kernels use) needs 16-byte aligned rows.
_FFI_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_ALIGNMENT_ELEMENTS = 8


def _validate(x, kernel, group_sizes, recipe, implementation: str) -> None:
  x_dtype = checks.check_float_array("x", x)
  kernel_dtype = checks.check_float_array("kernel", kernel)
  checks.check_rank("x", x, 2, "[M, K]")
  checks.check_rank("kernel", kernel, 3, "[G, K, N]")
  checks.check_rank("group_sizes", group_sizes, 1, "[G]")
  sizes_dtype = checks.dtype_of("group_sizes", group_sizes)
  if sizes_dtype != jnp.dtype(jnp.int32):
    raise TypeError(f"group_sizes must be int32 [G], got {sizes_dtype}")
  if kernel_dtype != x_dtype:
    raise TypeError(f"kernel dtype {kernel_dtype} must equal x dtype {x_dtype}")
  groups, k, n = kernel.shape
  if x.shape[1] != k:
    raise ValueError(f"x's last dimension ({x.shape[1]}) must equal kernel.shape[1] ({k}); "
                     f"x is {x.shape}, kernel is {kernel.shape}")
  if group_sizes.shape[0] != groups:
    raise ValueError(f"group_sizes must have shape ({groups},) (kernel.shape[0] groups), "
                     f"got {group_sizes.shape}")
  if groups < 1:
    raise ValueError("kernel must have at least one group (kernel.shape[0] >= 1)")
  if recipe is not None:
    raise NotImplementedError("grouped_linear: FP8 recipes are not implemented yet")
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
    kernel: [G, K, N], x's dtype (``ragged_dot``'s right-hand side layout).
    group_sizes: int32 [G], on the device. Negative sizes count as zero; sizes summing past
      M are cut at M; rows past the total come out as zeros.
    recipe: reserved for FP8 recipes (not implemented yet: must be None).
    implementation: None, "ffi" or "xla".

  Returns:
    [M, N] in x's dtype (fp32 accumulation, one rounding).

  Differentiable in x and kernel; the backward pass (dgrad dy @ W_g^T, wgrad x_g^T @ dy_g,
  zero for empty groups) reuses the forward pass's offsets.

  Raises:
    TypeError: non-float or mixed dtypes, group_sizes not int32, 32-bit x on the FFI path.
    ValueError: mismatched shapes; K or N not a multiple of 8 on the FFI path.
  """
  implementation = implementation_lib.resolve(implementation)
  _validate(x, kernel, group_sizes, recipe, implementation)
  if implementation == "xla":
    return reference.grouped_linear(x, kernel, group_sizes)
  offsets = group_offsets(group_sizes)
  varying_axes = tuple(compat.varying_axes(a) for a in (x, kernel, offsets))
  return grouped_linear_with_offsets(x, kernel, offsets, varying_axes)


def flops(m: int, k: int, n: int) -> int:
  """Floating-point operations of one grouped GEMM form over m routed rows."""
  return 2 * m * k * n



