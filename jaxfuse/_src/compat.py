"""The one place that papers over differences between the supported jax versions.

jaxfuse supports jax 0.10.x and 0.11.x. Anything that moved between them, or that would
otherwise need a private ``jax._src`` import, goes here and nowhere else.
"""

from __future__ import annotations

import jax

JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:3] if part.isdigit())


def shard_map(f, *, mesh, in_specs, out_specs, check_vma: bool = True):
  """``jax.shard_map`` (public since jax 0.7), with its replication check switch."""
  return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=check_vma)


def default_platform() -> str:
  """Platform of the default backend: "cpu", "gpu" or "tpu"."""
  return jax.default_backend()


def has_cuda_backend() -> bool:
  """Whether jax can see a CUDA device (without raising when it cannot)."""
  try:
    return any(device.platform == "gpu" for device in jax.devices("gpu"))
  except RuntimeError:
    return False


def varying_axes(value) -> frozenset:
  """Mesh axes along which `value` varies inside shard_map (empty outside it).

  jax 0.8+ keeps them in ``aval.manual_axis_type.varying``; 0.7 had ``aval.vma``.
  """
  aval = jax.typeof(value)
  manual_axis_type = getattr(aval, "manual_axis_type", None)
  if manual_axis_type is not None:
    return frozenset(manual_axis_type.varying)
  return frozenset(getattr(aval, "vma", frozenset()))


def vary_like(value, *others):
  """Marks `value` as varying along every mesh axis along which any of `others` varies.

  XLA custom calls (``jax.ffi.ffi_call``) do not propagate shard_map's varying-axes type:
  their results come out replicated-typed even when computed from per-device data. This
  restores the type that the equivalent jnp computation would have.
  """
  wanted = frozenset().union(*(varying_axes(other) for other in others))
  missing = wanted - varying_axes(value)
  if missing:
    value = jax.lax.pcast(value, tuple(sorted(missing)), to="varying")
  return value


def match_varying_axes(cotangent, primal_axes: frozenset):
  """Gives a cotangent its primal's varying-axes type inside shard_map.

  `primal_axes` is ``varying_axes(primal)`` read in the forward pass (a custom_vjp
  backward does not see its residuals' varying axes, so callers pass them as static
  data). Axes along which the cotangent varies but its primal does not are summed: the
  gradient of a replicated weight computed from sharded activations is a per-device
  partial sum, reduced as autodiff of plain jnp code would reduce it. Axes the primal
  varies along are marked varying.
  """
  extra = varying_axes(cotangent) - primal_axes
  if extra:
    cotangent = jax.lax.psum(cotangent, tuple(sorted(extra)))
  missing = primal_axes - varying_axes(cotangent)
  if missing:
    cotangent = jax.lax.pcast(cotangent, tuple(sorted(missing)), to="varying")
  return cotangent


def all_mesh_axes_manual() -> bool:
  """Whether tracing happens inside shard_map with every mesh axis manual (per-device code:
  nothing traced here is partitioned further). False outside shard_map."""
  get_abstract_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  if get_abstract_mesh is None:
    return False
  axis_types = tuple(getattr(get_abstract_mesh(), "axis_types", ()))
  manual = getattr(jax.sharding.AxisType, "Manual", None)
  return bool(axis_types) and all(axis_type == manual for axis_type in axis_types)


def traced_bool_flag(name: str, default: bool, help_text: str):
  """A jax config flag that is part of the jit and trace caches' keys (private jax API).

  Returns the flag's state: ``state.value`` reads it, ``with state(False):`` sets it in
  this thread. A flag that changes what an op traces to must be part of those keys, or a
  cached trace from before the change would be reused.
  """
  from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top
  return jax_config.bool_state(name, default, help_text, include_in_jit_key=True,
                               include_in_trace_context=True)
