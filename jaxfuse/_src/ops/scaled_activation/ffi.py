"""ffi_call wrappers for the scaled activation handlers (cuda/cpu/scaled_activation.cc,
cuda/gpu/scaled_activation.cu). Leading dimensions fold into rows inside the handlers, so
vmap batches by adding a leading dimension (vmap_method="broadcast_all")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._src import compat
from jaxfuse._src import ffi as ffi_registry

ACTIVATION_CODES = {"swiglu": 0, "srelu": 1, "clamped_swiglu": 2}


def activation_attrs(activation, limit, alpha, linear_offset) -> dict:
  return dict(activation=np.int32(ACTIVATION_CODES[activation]), limit=np.float32(limit),
              alpha=np.float32(alpha), linear_offset=np.float32(linear_offset))


def out_features(x_shape, activation) -> int:
  return x_shape[-1] // 2 if activation != "srelu" else x_shape[-1]


def forward(x, scales, *, activation, limit, alpha, linear_offset):
  ffi_registry.ensure_registered()
  out_type = jax.ShapeDtypeStruct((*x.shape[:-1], out_features(x.shape, activation)), x.dtype)
  out = jax.ffi.ffi_call("jaxfuse_scaled_activation_fwd", out_type,
                         vmap_method="broadcast_all")(
      x, scales, **activation_attrs(activation, limit, alpha, linear_offset))
  return compat.vary_like(out, x, scales)


def backward(dy, x, scales, *, activation, limit, alpha, linear_offset):
  """One fused kernel: (dx in x's dtype, dscales float32 [...])."""
  ffi_registry.ensure_registered()
  out_types = (jax.ShapeDtypeStruct(x.shape, x.dtype),
               jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32))
  dx, dscales = jax.ffi.ffi_call("jaxfuse_scaled_activation_bwd", out_types,
                                 vmap_method="broadcast_all")(
      dy, x, scales, **activation_attrs(activation, limit, alpha, linear_offset))
  return compat.vary_like(dx, dy, x, scales), compat.vary_like(dscales, dy, x, scales)
