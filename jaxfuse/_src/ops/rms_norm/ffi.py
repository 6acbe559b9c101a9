"""ffi_call wrappers for the RMSNorm handlers (cuda/cpu/rms_norm.cc, cuda/gpu/rms_norm.cu).

Targets:

* ``jaxfuse_rms_norm_fwd``: (x, gamma) -> (out, rsigma);
* ``jaxfuse_add_rms_norm_fwd``: (x, residual, gamma) -> (out, new_residual, rsigma), with
  residual aliased to new_residual (in place when the caller donates it);
* ``jaxfuse_rms_norm_bwd``: (dy, x, gamma, rsigma) -> (dx, dgamma);
* ``jaxfuse_add_rms_norm_bwd``: (dy, dz, s, gamma, rsigma) -> (ds, dgamma), ds = the
  normalization's input gradient plus dz, the gradient flowing into new_residual.

Leading dimensions fold into rows inside the handlers, so every operand keeps its own
shape (reshaping an aliased residual would make XLA copy it); rsigma has x.shape[:-1].
On CUDA the backward handlers take a float32 [partials, H] scratch result for the
per-block dgamma partial sums, reduced by a second kernel in a fixed order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._src import compat
from jaxfuse._src import ffi as ffi_registry

# Upper bound on the dgamma partial sums of the CUDA backward (one per row slot of the
# grid): 4 x 132 SMs. The handler uses min(rows, this) slots.
MAX_DGAMMA_PARTIALS = 528


def dgamma_partials(rows: int) -> int:
  return max(1, min(rows, MAX_DGAMMA_PARTIALS))


def _call(target, operands, out_types, *, aliases=None, attrs, workspace=None):
  """Runs `target` on the platform being lowered for; `workspace` (a ShapeDtypeStruct)
  is an extra CUDA-only result."""
  ffi_registry.ensure_registered()
  aliases = aliases or {}
  out_types = tuple(out_types)

  def cpu(*args):
    return tuple(jax.ffi.ffi_call(target, out_types, input_output_aliases=aliases,
                                  vmap_method="sequential")(*args, **attrs))

  def cuda(*args):
    types = out_types + ((workspace,) if workspace is not None else ())
    results = jax.ffi.ffi_call(target, types, input_output_aliases=aliases,
                               vmap_method="sequential")(*args, **attrs)
    return tuple(results[:len(out_types)])

  outs = jax.lax.platform_dependent(*operands, cpu=cpu, cuda=cuda)
  return tuple(compat.vary_like(out, *operands) for out in outs)


def _fwd_attrs(eps, zero_centered_gamma):
  return dict(eps=np.float32(eps), zero_centered_gamma=bool(zero_centered_gamma))


def rms_norm_fwd(x, gamma, *, eps, zero_centered_gamma):
  """-> (out [x.shape, x.dtype], rsigma [x.shape[:-1], float32])."""
  out_types = (jax.ShapeDtypeStruct(x.shape, x.dtype),
               jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32))
  return _call("jaxfuse_rms_norm_fwd", (x, gamma), out_types,
               attrs=_fwd_attrs(eps, zero_centered_gamma))


def add_rms_norm_fwd(x, residual, gamma, *, eps, zero_centered_gamma, alias=True):
  """-> (out, new_residual, rsigma); new_residual is written into residual's buffer when
  `alias` (XLA copies the residual first if it is still live after the call)."""
  out_types = (jax.ShapeDtypeStruct(x.shape, x.dtype),
               jax.ShapeDtypeStruct(residual.shape, residual.dtype),
               jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32))
  return _call("jaxfuse_add_rms_norm_fwd", (x, residual, gamma), out_types,
               aliases={1: 1} if alias else {}, attrs=_fwd_attrs(eps, zero_centered_gamma))


def _bwd_types(s, gamma):
  rows = int(np.prod(s.shape[:-1], dtype=np.int64))
  workspace = jax.ShapeDtypeStruct((dgamma_partials(rows), s.shape[-1]), jnp.float32)
  return (jax.ShapeDtypeStruct(s.shape, s.dtype),
          jax.ShapeDtypeStruct(gamma.shape, gamma.dtype)), workspace


def rms_norm_bwd(dy, x, gamma, rsigma, *, zero_centered_gamma):
  """-> (dx, dgamma)."""
  out_types, workspace = _bwd_types(x, gamma)
  return _call("jaxfuse_rms_norm_bwd", (dy, x, gamma, rsigma), out_types,
               attrs=dict(zero_centered_gamma=bool(zero_centered_gamma)), workspace=workspace)


def add_rms_norm_bwd(dy, dz, s, gamma, rsigma, *, zero_centered_gamma):
  """-> (ds, dgamma); ds is the gradient of both x and residual."""
  out_types, workspace = _bwd_types(s, gamma)
  return _call("jaxfuse_add_rms_norm_bwd", (dy, dz, s, gamma, rsigma), out_types,
               attrs=dict(zero_centered_gamma=bool(zero_centered_gamma)), workspace=workspace)
