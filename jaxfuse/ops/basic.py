"""Basic operations: small frozen descriptions with a pure-jnp (unfused) apply.

Each op is a frozen (hashable) dataclass. It describes

* ``param_shapes(in_features)``: its parameters, ``{name: (shape, init)}``;
* ``out_features(in_features)``: the width of its output;
* ``extra_inputs``: the names of the extra inputs it reads (``Sequential(x, name=value)``);
* ``apply(params, x, extras)``: the unfused computation in plain jnp, returning
  ``(y, outputs)`` where ``outputs`` maps extra-output names to values (only
  ``AddExtraInput`` has one: its sum, under its extra input's name).

Parameters are stored in their ``param_dtype`` (float32 by default) and cast to the
compute dtype (x's dtype) when applied. The fuser (``jaxfuse.ops.fuser``) replaces windows
of these ops with jaxfuse's fused operations; the unfused apply is the reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxfuse._src.ops.grouped_linear import reference as grouped_linear_reference
from jaxfuse._src.ops.rms_norm import reference as rms_norm_reference
from jaxfuse._src.ops.scaled_activation import reference as activation_reference

_ACTIVATIONS = ("swiglu", "clamped_swiglu", "srelu")
_GLU = ("swiglu", "clamped_swiglu")
_TENSOR_PARALLEL = (None, "column", "row")


def lecun_normal_init(fan_in_axis: int):
  """Normal(0, 1 / fan_in) initializer over the given axis (Flax's lecun_normal)."""
  def init(key, shape, dtype):
    fan_in = shape[fan_in_axis]
    return (jax.random.normal(key, shape, jnp.float32) / jnp.sqrt(float(fan_in))).astype(dtype)
  return init


def ones_init(key, shape, dtype):
  del key
  return jnp.ones(shape, dtype)


def zeros_init(key, shape, dtype):
  del key
  return jnp.zeros(shape, dtype)


class BasicOp:
  """Base class of the basic operations (see the module docstring)."""

  extra_inputs: tuple[str, ...] = ()

  def param_shapes(self, in_features: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    del in_features
    return {}

  def out_features(self, in_features: int) -> int:
    return in_features

  def apply(self, params: dict, x: jax.Array, extras: dict) -> tuple[jax.Array, dict]:
    raise NotImplementedError


def _extra(extras: dict, name: str, op) -> jax.Array:
  if name not in extras:
    raise ValueError(f"{type(op).__name__} needs the extra input {name!r}: call the "
                     f"Sequential with {name}=... (got extras {sorted(extras)})")
  return extras[name]


@dataclasses.dataclass(frozen=True)
class Linear(BasicOp):
  """y = x @ kernel, kernel [in_features, features] (TransformerEngine's BasicLinear; no bias).

  tensor_parallel: None, "column" (input replicated, output features sharded: no
  communication) or "row" (input features sharded: the partial products are summed with
  ``jax.lax.psum`` over ``axis_name`` when it is given, i.e. inside ``shard_map``). A
  row-parallel linear must not absorb a following residual add (the residual would be
  added once per device), so the LinearScaleAdd fusion refuses it.
  """
  features: int
  tensor_parallel: str | None = None
  axis_name: Any = None
  param_dtype: Any = jnp.float32

  def __post_init__(self):
    if not isinstance(self.features, int) or self.features < 1:
      raise ValueError(f"Linear: features must be a positive int, got {self.features!r}")
    if self.tensor_parallel not in _TENSOR_PARALLEL:
      raise ValueError(f"Linear: tensor_parallel must be one of {_TENSOR_PARALLEL}, "
                       f"got {self.tensor_parallel!r}")

  def param_shapes(self, in_features):
    return {"kernel": ((in_features, self.features), lecun_normal_init(0))}

  def out_features(self, in_features):
    return self.features

  def reduce(self, y):
    """The row-parallel all-reduce (identity otherwise)."""
    if self.tensor_parallel == "row" and self.axis_name is not None:
      return jax.lax.psum(y, self.axis_name)
    return y

  def apply(self, params, x, extras):
    kernel = params["kernel"].astype(x.dtype)
    y = jnp.matmul(x, kernel, preferred_element_type=jnp.float32).astype(x.dtype)
    return self.reduce(y), {}


@dataclasses.dataclass(frozen=True)
class ConstantScale(BasicOp):
  """y = scale * x with a static real scale."""
  scale: float

  def __post_init__(self):
    if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)):
      raise TypeError(f"ConstantScale: scale must be a static real number, got {self.scale!r}")

  def apply(self, params, x, extras):
    return (x.astype(jnp.float32) * jnp.float32(self.scale)).astype(x.dtype), {}


@dataclasses.dataclass(frozen=True)
class AddExtraInput(BasicOp):
  """y = x + extras[name] (e.g. the residual of a transformer block).

  in_place=True declares that the sum may overwrite the extra input's buffer
  (TransformerEngine's in-place AddExtraInput); the LinearScaleAdd fusion needs it, since
  its GEMM accumulates into the residual. The sum is also an extra *output* of the
  Sequential under ``name`` (``return_extra=True``): the new residual stream.
  """
  name: str = "residual"
  in_place: bool = False

  @property
  def extra_inputs(self):
    return (self.name,)

  def apply(self, params, x, extras):
    residual = _extra(extras, self.name, self)
    dtype = jnp.result_type(x.dtype, residual.dtype)
    y = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(dtype)
    return y, {self.name: y}


@dataclasses.dataclass(frozen=True)
class ScaledActivation(BasicOp):
  """y = act(x) * extras[scales][..., None] (see ``jaxfuse.scaled_activation``).

  GLU kinds ("swiglu", "clamped_swiglu") halve the width: [..., 2F] -> [..., F].
  """
  activation: str = "swiglu"
  scales: str = "scales"
  limit: float = 7.0
  alpha: float = 1.702
  linear_offset: float = 1.0

  def __post_init__(self):
    if self.activation not in _ACTIVATIONS:
      raise ValueError(f"ScaledActivation: activation must be one of {_ACTIVATIONS}, "
                       f"got {self.activation!r}")

  @property
  def extra_inputs(self):
    return (self.scales,)

  def out_features(self, in_features):
    if self.activation in _GLU:
      if in_features % 2:
        raise ValueError(f"ScaledActivation({self.activation!r}) needs an even input width, "
                         f"got {in_features}")
      return in_features // 2
    return in_features

  def apply(self, params, x, extras):
    scales = _extra(extras, self.scales, self)
    y = activation_reference.scaled_activation(x, scales, self.activation, self.limit,
                                               self.alpha, self.linear_offset)
    return y, {}


@dataclasses.dataclass(frozen=True)
class GroupedLinear(BasicOp):
  """Rows of group g times kernel[g], kernel [num_groups, in_features, features].

  The rows of x ([M, K]) are sorted by group; ``extras[group_sizes]`` (int32 [G]) says how
  many rows each group has (see ``jaxfuse.grouped_linear``).

  recipe: None (16-bit GEMM) or ``Float8CurrentScaling(per_group=True)``: the FP8 grouped
  GEMM of ``jaxfuse.grouped_linear(..., recipe=recipe)`` (x quantized to E4M3 per group of
  rows, the kernel per expert; FP8 dgrad and, with ``recipe.fp8_wgrad``, FP8 wgrad; K and N
  multiples of 16). Unfused
  it runs with the Sequential's implementation ("ffi": the FP8 kernels; "xla": the jnp
  FP8 reference, whose gradients are straight-through).
  """
  num_groups: int
  features: int
  group_sizes: str = "group_sizes"
  param_dtype: Any = jnp.float32
  recipe: Any = None

  # fuser.run passes the Sequential's implementation to the unfused apply (FP8 path).
  takes_implementation = True

  def __post_init__(self):
    for field in ("num_groups", "features"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"GroupedLinear: {field} must be a positive int, got {value!r}")
    if self.recipe is not None:
      from jaxfuse.quantization import Float8CurrentScaling  # pylint: disable=g-import-not-at-top
      if not (isinstance(self.recipe, Float8CurrentScaling) and self.recipe.per_group
              and self.recipe.forward_format == "e4m3"):
        raise ValueError("GroupedLinear: recipe must be None or Float8CurrentScaling("
                         f"per_group=True) with forward_format='e4m3', got {self.recipe!r}")

  @property
  def extra_inputs(self):
    return (self.group_sizes,)

  def param_shapes(self, in_features):
    return {"kernel": ((self.num_groups, in_features, self.features), lecun_normal_init(1))}

  def out_features(self, in_features):
    return self.features

  def apply(self, params, x, extras, implementation: str | None = None):
    group_sizes = _extra(extras, self.group_sizes, self)
    kernel = params["kernel"].astype(x.dtype)
    if self.recipe is None:
      return grouped_linear_reference.grouped_linear(x, kernel, group_sizes), {}
    from jaxfuse._src.ops.grouped_linear import api as grouped_linear_api  # pylint: disable=g-import-not-at-top
    return grouped_linear_api.grouped_linear(x, kernel, group_sizes, recipe=self.recipe,
                                             implementation=implementation), {}


@dataclasses.dataclass(frozen=True)
class RMSNorm(BasicOp):
  """y = x / rms(x) * gamma (or * (1 + gamma) with zero_centered_gamma), gamma [H]."""
  eps: float = 1e-6
  zero_centered_gamma: bool = False
  param_dtype: Any = jnp.float32

  def param_shapes(self, in_features):
    return {"gamma": ((in_features,), zeros_init if self.zero_centered_gamma else ones_init)}

  def apply(self, params, x, extras):
    return rms_norm_reference.rms_norm(x, params["gamma"], float(self.eps),
                                       bool(self.zero_centered_gamma)), {}


@dataclasses.dataclass(frozen=True)
class Quantize(BasicOp):
  """Fake quantization: y = dequantize(quantize(x, recipe)) with a straight-through gradient.

  Marks where a tensor is cast to FP8 (TransformerEngine's Quantize op). Unfused it is a
  quantize-dequantize round trip in jnp (``recipe``: a ``jaxfuse.quantization`` recipe;
  per-group current scaling reads the group sizes from ``extras[group_sizes]``).
  """
  recipe: Any
  group_sizes: str = "group_sizes"

  @property
  def extra_inputs(self):
    return (self.group_sizes,) if getattr(self.recipe, "per_group", False) else ()

  def apply(self, params, x, extras):
    from jaxfuse._src.ops.quantize import api as quantize_api  # pylint: disable=g-import-not-at-top
    sizes = _extra(extras, self.group_sizes, self) if self.extra_inputs else None
    q = quantize_api.quantize(x, self.recipe, group_sizes=sizes, implementation="xla")
    y = quantize_api.dequantize(q).astype(x.dtype)
    return x + jax.lax.stop_gradient(y - x), {}
