"""linear_scale: alpha * (x @ kernel) with alpha in the GEMM epilogues (TE's BackwardLinearScale).

Forward, dgrad and wgrad are all ``jaxfuse_scaled_matmul`` custom calls (cuBLASLt on GPU,
C++ loops on CPU) carrying alpha in their epilogue, so neither pass spends a separate
scaling kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfuse._src import checks
from jaxfuse._src import compat
from jaxfuse._src import implementation as implementation_lib
from jaxfuse._src.ops.linear_scale_add import ffi


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _linear_scale_ffi(x, kernel, alpha, varying_axes):
  return _forward(x, kernel, alpha, varying_axes)[0]


def _forward(x, kernel, alpha, varying_axes):
  del varying_axes
  return ffi.scaled_matmul(x, kernel, alpha=alpha), (x, kernel)


def _backward(alpha, varying_axes, saved, d_out):
  x, kernel = saved
  k, n = kernel.shape
  d_out = d_out.astype(x.dtype)
  d_x = ffi.scaled_matmul(d_out, kernel, alpha=alpha, transpose_b=True)
  d_kernel = ffi.scaled_matmul(x.reshape(-1, k), d_out.reshape(-1, n), alpha=alpha,
                               transpose_a=True)
  return tuple(compat.match_varying_axes(c, axes)
               for c, axes in zip((d_x, d_kernel), varying_axes))


_linear_scale_ffi.defvjp(_forward, _backward)


def linear_scale(x: jax.Array, kernel: jax.Array, alpha: float = 1.0, *,
                 implementation: str | None = None) -> jax.Array:
  """alpha * (x @ kernel) in x's dtype (fp32 accumulation, alpha applied in fp32).

  x: [..., K]; kernel: [K, N], x's dtype. Differentiable: dx = alpha * dy @ kernel.T,
  dkernel = alpha * x.T @ dy, each one scaled GEMM.
  """
  checks.check_float_array("x", x)
  checks.check_float_array("kernel", kernel)
  checks.check_min_rank("x", x, 1, "[..., K]")
  checks.check_rank("kernel", kernel, 2, "[K, N]")
  if kernel.dtype != x.dtype:
    raise TypeError(f"kernel dtype {kernel.dtype} must equal x dtype {x.dtype}")
  if x.shape[-1] != kernel.shape[0]:
    raise ValueError(f"x's last dimension ({x.shape[-1]}) must equal kernel.shape[0] "
                     f"({kernel.shape[0]})")
  alpha = checks.static_float("alpha", alpha)
  if implementation_lib.resolve(implementation) == "xla":
    y = jnp.matmul(x, kernel, preferred_element_type=jnp.float32)
    return (jnp.float32(alpha) * y).astype(x.dtype)
  varying_axes = tuple(compat.varying_axes(a) for a in (x, kernel))
  return _linear_scale_ffi(x, kernel, alpha, varying_axes)
