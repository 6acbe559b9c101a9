"""tokamax as a same-run baseline: Google's JAX kernel library and its grouped GEMM.

``tokamax.ragged_dot(..., implementation="mosaic")`` runs tokamax's Pallas Mosaic GPU kernels
on Hopper: the forward (x [M, K] @ w [G, K, N]) in its SM90 ragged kernel; the backward
through tokamax's own VJP, with the dgrad in the same kernel on w transposed by XLA and the
wgrad in its ragged-contracting kernel. The implementation is named explicitly, so a shape
that tokamax's Mosaic kernels do not take fails instead of falling back to XLA.

The GPU image has no tokamax. scripts/fetch_bench_wheels.sh downloads its wheel and the
dependencies that the image lacks into .whl/bench/. gpu_run.sh installs them into a directory
of their own, named by JAXFUSE_BENCH_SITE, which ``load`` appends to sys.path: the image's
packages (jax, flax, numpy) still come first.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

from jaxfuse._src.ops.scaled_activation import reference as act_reference

IMPLEMENTATION = "mosaic"


def load():
  """(the tokamax module, None), or (None, why it cannot be imported)."""
  site = os.environ.get("JAXFUSE_BENCH_SITE")
  if site and site not in sys.path:
    sys.path.append(site)
  try:
    import tokamax  # pylint: disable=g-import-not-at-top  (optional baseline)
  except Exception as error:  # pylint: disable=broad-except  (any import failure: no baseline)
    return None, f"{type(error).__name__}: {str(error)[:200]}"
  return tokamax, None


def version(tokamax) -> str:
  try:
    from importlib import metadata  # pylint: disable=g-import-not-at-top
    return metadata.version("tokamax")
  except Exception:  # pylint: disable=broad-except
    return getattr(tokamax, "__version__", "unknown")


def ragged_dot(tokamax, x, w, sizes):
  return tokamax.ragged_dot(x, w, sizes, implementation=IMPLEMENTATION)


def gemm_fns(tokamax):
  """{form: jitted fn}: forward (x, w, sizes), dgrad and wgrad (x, w, sizes, dy) as jax.vjp
  derives them from tokamax's custom VJP (one GEMM each)."""
  def forward(x, w, sizes):
    return ragged_dot(tokamax, x, w, sizes)

  def dgrad(x, w, sizes, dy):
    return jax.vjp(lambda x: ragged_dot(tokamax, x, w, sizes), x)[1](dy)[0]

  def wgrad(x, w, sizes, dy):
    return jax.vjp(lambda w: ragged_dot(tokamax, x, w, sizes), w)[1](dy)[0]

  return {"fwd": jax.jit(forward), "dgrad": jax.jit(dgrad), "wgrad": jax.jit(wgrad)}


def grouped_mlp(tokamax, x, kernel1, kernel2, sizes, scales):
  """FC1 -> SwiGLU(h) * scales -> FC2 with tokamax's grouped GEMMs; the activation is
  jaxfuse's jnp reference (fp32 math, x's dtype out), which XLA fuses around them."""
  h = ragged_dot(tokamax, x, kernel1, sizes)
  a = act_reference.scaled_activation(h, scales, "swiglu")
  return ragged_dot(tokamax, a, kernel2, sizes)


def mlp_fns(tokamax):
  """{"fwd", "fwd+bwd"}: jitted steps with bench_grouped_mlp's argument order."""
  def forward(x, k1, k2, scales, sizes, dy):
    del dy
    return grouped_mlp(tokamax, x, k1, k2, sizes, scales)

  def forward_backward(x, k1, k2, scales, sizes, dy):
    out, vjp = jax.vjp(lambda x, k1, k2, s: grouped_mlp(tokamax, x, k1, k2, sizes, s),
                       x, k1, k2, scales)
    return out, vjp(dy)

  return {"fwd": jax.jit(forward), "fwd+bwd": jax.jit(forward_backward)}


def max_relative_error(result, expected) -> float:
  """max |result - expected| / max |expected| in float32 (a sanity check of the baseline
  against jaxfuse's result on the same inputs, recorded next to its timings)."""
  result, expected = (jnp.asarray(a, jnp.float32) for a in (result, expected))
  scale = jnp.maximum(jnp.max(jnp.abs(expected)), 1e-30)
  return float(jnp.max(jnp.abs(result - expected)) / scale)
