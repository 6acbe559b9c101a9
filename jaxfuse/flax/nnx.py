"""Flax NNX modules: thin wrappers that own parameters and call the functional ops."""

from __future__ import annotations

from typing import Any, Callable

from flax import nnx
import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jaxfuse._src import compat
from jaxfuse._src.ops.linear_scale_add.api import linear_scale_add
from jaxfuse._src.ops.rms_norm.api import add_rms_norm
from jaxfuse._src.ops.rms_norm.api import rms_norm
from jaxfuse.flax import _experts
from jaxfuse.parallel import block as parallel_block
from jaxfuse.parallel import layers as parallel_layers

Initializer = Callable[..., jax.Array]
default_kernel_init = nnx.initializers.lecun_normal()


class LinearScaleAdd(nnx.Module):
  """``residual + alpha * (x @ kernel)``, fused, accumulating into the residual.

  Called as ``module(x, residual)`` with x [..., in_features] and residual
  [..., features]; the kernel is [in_features, features].

  Args:
    in_features: K.
    features: N.
    alpha: static scale of the product.
    dtype: compute dtype of x and the kernel (default: promote x and param_dtype).
    param_dtype: dtype of the kernel parameter.
    kernel_init: initializer of the kernel.
    recipe: None, or ``Float8CurrentScaling(per_group=False)`` for the FP8 op; the kernel
      may then be quantized once (``quantize_kernel_params``).
    implementation: None, "ffi" or "xla".
    rngs: NNX random streams (``params`` initializes the kernel).
  """

  def __init__(self, in_features: int, features: int, *, alpha: float = 1.0,
               dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init: Initializer = default_kernel_init, recipe: Any = None,
               implementation: str | None = None, rngs: nnx.Rngs):
    self.in_features = in_features
    self.features = features
    self.alpha = alpha
    self.dtype = dtype
    self.recipe = recipe
    self.implementation = implementation
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, features), param_dtype))

  def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:
    promote = lambda *arrays, dtype: nnx.nn.dtypes.promote_dtype(arrays, dtype=dtype)
    x, kernel = _experts.promote(promote, x, [self.kernel.get_value()], self.dtype)
    return linear_scale_add(x, kernel, residual, self.alpha, recipe=self.recipe,
                            implementation=self.implementation)


def _gamma_for(x, gamma):
  """gamma as the op accepts it: x's dtype or float32."""
  if gamma.dtype not in (x.dtype, jnp.dtype(jnp.float32)):
    gamma = gamma.astype(jnp.float32)
  return gamma


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis (``jaxfuse.rms_norm``); ``module(x, residual)`` runs the
  fused residual add + RMSNorm and returns (normalized, x + residual).

  Args:
    num_features: H.
    epsilon: added to the mean square.
    zero_centered_gamma: the scale is 1 + scale (initialized to zeros).
    param_dtype: dtype of ``scale``.
    implementation: None, "ffi" or "xla".
    rngs: unused (for signature symmetry with Flax's RMSNorm).
  """

  def __init__(self, num_features: int, *, epsilon: float = 1e-6,
               zero_centered_gamma: bool = False, param_dtype: Any = jnp.float32,
               implementation: str | None = None, rngs: nnx.Rngs | None = None):
    del rngs
    self.num_features = num_features
    self.epsilon = epsilon
    self.zero_centered_gamma = zero_centered_gamma
    self.implementation = implementation
    init = jnp.zeros if zero_centered_gamma else jnp.ones
    self.scale = nnx.Param(init((num_features,), param_dtype))

  def __call__(self, x: jax.Array, residual: jax.Array | None = None):
    gamma = _gamma_for(x, self.scale[...])
    if residual is None:
      return rms_norm(x, gamma, self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
                      implementation=self.implementation)
    return add_rms_norm(x, residual, gamma, self.epsilon,
                        zero_centered_gamma=self.zero_centered_gamma,
                        implementation=self.implementation)


# --- tensor-parallel layers (issue 6) -------------------------------------------------
#
# Built outside shard_map with the *global* parameters. ``state_specs`` gives the
# PartitionSpecs that shard their state (column-parallel kernels by columns, row-parallel
# by rows, norm scales replicated); the module merged from a shard of that state runs
# inside ``jax.shard_map`` over ``axis_name`` (as ``apply_sharded`` does for the block).


def _specs_by_name(state, specs: dict[str, Any]):
  """A PartitionSpec per leaf of ``state`` (from ``nnx.split``): the spec of the first
  name on its path found in ``specs``, else replicated."""

  def spec(path, _):
    names = [str(getattr(key, "key", getattr(key, "name", ""))) for key in path]
    for name in names:
      if name in specs:
        return specs[name]
    return P()

  return jax.tree_util.tree_map_with_path(spec, state)


class _ParallelLayer(nnx.Module):
  """Shared by the layers: ``state_specs`` from linen's ``layer_specs``."""

  axis_name: str

  def state_specs(self, state):
    """PartitionSpecs for ``state`` (from ``nnx.split(self)``), by parameter name."""
    from jaxfuse.flax import linen as linen_modules  # pylint: disable=g-import-not-at-top
    return _specs_by_name(state, linen_modules.layer_specs(type(self).__name__,
                                                           self.axis_name))


class ColumnParallelLinear(_ParallelLayer):
  """``jaxfuse.parallel.column_parallel_linear`` with a global kernel [in_features,
  features] (see ``jaxfuse.flax.linen.ColumnParallelLinear`` for the call). Inside
  shard_map the merged module holds this device's [in_features, features/tp] columns.

  Args:
    in_features: H.
    features: N (divisible by tp).
    axis_name, gather_input, alpha, inference, dtype, implementation: as in linen.
    param_dtype, kernel_init: of the global kernel.
    rngs: NNX random streams (``params``).
  """

  def __init__(self, in_features: int, features: int, *, axis_name: str = "tp",
               gather_input: bool = True, alpha: float = 1.0, inference: bool = False,
               dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init: Initializer = default_kernel_init,
               implementation: str | None = None, rngs: nnx.Rngs):
    self.axis_name, self.gather_input, self.alpha = axis_name, gather_input, alpha
    self.inference, self.dtype, self.implementation = inference, dtype, implementation
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, features), param_dtype))

  def __call__(self, x: jax.Array, residual: jax.Array | None = None) -> jax.Array:
    dtype = self.dtype or x.dtype
    return parallel_layers.column_parallel_linear(
        x.astype(dtype), self.kernel[...].astype(dtype), axis_name=self.axis_name,
        gather_input=self.gather_input, residual=residual, alpha=self.alpha,
        inference=self.inference, implementation=self.implementation)


class RowParallelLinear(_ParallelLayer):
  """``jaxfuse.parallel.row_parallel_linear`` with a global kernel [in_features, features]
  (this device's [in_features/tp, features] rows inside shard_map; see
  ``jaxfuse.flax.linen.RowParallelLinear``).

  Args:
    in_features: K (divisible by tp).
    features: N.
    axis_name, reduce, inference, dtype: as in linen.
    param_dtype, kernel_init, rngs: as in ColumnParallelLinear.
  """

  def __init__(self, in_features: int, features: int, *, axis_name: str = "tp",
               reduce: str = "scatter", inference: bool = False, dtype: Any = None,
               param_dtype: Any = jnp.float32, kernel_init: Initializer = default_kernel_init,
               rngs: nnx.Rngs):
    self.axis_name, self.reduce, self.inference, self.dtype = axis_name, reduce, inference, dtype
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, features), param_dtype))

  def __call__(self, x_shard: jax.Array, residual: jax.Array | None = None) -> jax.Array:
    dtype = self.dtype or x_shard.dtype
    return parallel_layers.row_parallel_linear(
        x_shard.astype(dtype), self.kernel[...].astype(dtype), axis_name=self.axis_name,
        reduce=self.reduce, residual=residual, inference=self.inference)


class RMSNormColumnParallelLinear(_ParallelLayer):
  """``jaxfuse.parallel.rms_norm_column_parallel_linear`` with ``scale`` [in_features]
  (replicated) and a global kernel [in_features, features] (see
  ``jaxfuse.flax.linen.RMSNormColumnParallelLinear``).

  Args:
    in_features: H.
    features: N (divisible by tp).
    axis_name, epsilon, zero_centered_gamma, gather_input, inference, dtype,
      implementation: as in linen.
    param_dtype, kernel_init, rngs: as in ColumnParallelLinear.
  """

  def __init__(self, in_features: int, features: int, *, axis_name: str = "tp",
               epsilon: float = 1e-6, zero_centered_gamma: bool = False,
               gather_input: bool = True, inference: bool = False, dtype: Any = None,
               param_dtype: Any = jnp.float32, kernel_init: Initializer = default_kernel_init,
               implementation: str | None = None, rngs: nnx.Rngs):
    self.axis_name, self.epsilon, self.zero_centered_gamma = axis_name, epsilon, zero_centered_gamma
    self.gather_input, self.inference, self.dtype = gather_input, inference, dtype
    self.implementation = implementation
    init = jnp.zeros if zero_centered_gamma else jnp.ones
    self.scale = nnx.Param(init((in_features,), param_dtype))
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, features), param_dtype))

  def __call__(self, x_shard: jax.Array) -> jax.Array:
    x_shard = x_shard.astype(self.dtype or x_shard.dtype)
    return parallel_layers.rms_norm_column_parallel_linear(
        x_shard, _gamma_for(x_shard, self.scale[...]), self.kernel[...].astype(x_shard.dtype),
        axis_name=self.axis_name, eps=self.epsilon,
        zero_centered_gamma=self.zero_centered_gamma, gather_input=self.gather_input,
        inference=self.inference, implementation=self.implementation)


class RowParallelResidualRMSNorm(_ParallelLayer):
  """The fused row-parallel tail (``jaxfuse.parallel.row_parallel_residual_rms_norm``)
  with ``scale`` [features], the next layer's norm weight (replicated); see
  ``jaxfuse.flax.linen.RowParallelResidualRMSNorm``.

  Args:
    features: H.
    axis_name, epsilon, zero_centered_gamma, reduce, gather_output, inference,
      implementation: as in linen.
    param_dtype: of the scale.
  """

  def __init__(self, features: int, *, axis_name: str = "tp", epsilon: float = 1e-6,
               zero_centered_gamma: bool = False, reduce: str = "scatter",
               gather_output: bool = True, inference: bool = False,
               param_dtype: Any = jnp.float32, implementation: str | None = None):
    self.axis_name, self.epsilon, self.zero_centered_gamma = axis_name, epsilon, zero_centered_gamma
    self.reduce, self.gather_output, self.inference = reduce, gather_output, inference
    self.implementation = implementation
    init = jnp.zeros if zero_centered_gamma else jnp.ones
    self.scale = nnx.Param(init((features,), param_dtype))

  def __call__(self, y_partial: jax.Array, residual_shard: jax.Array):
    return parallel_layers.row_parallel_residual_rms_norm(
        y_partial, residual_shard, _gamma_for(residual_shard, self.scale[...]),
        axis_name=self.axis_name, eps=self.epsilon,
        zero_centered_gamma=self.zero_centered_gamma, reduce=self.reduce,
        gather_output=self.gather_output, inference=self.inference,
        implementation=self.implementation)


class TensorParallelTransformerBlock(nnx.Module):
  """A Megatron-style tensor-parallel pre-norm transformer block (see
  ``jaxfuse.flax.linen.TensorParallelTransformerBlock`` and ``jaxfuse.parallel.block``).

  The module is built outside shard_map with the *global* parameters; run it with
  ``apply_sharded(model, x, mesh=mesh)``, which splits the module, shards its state with
  ``state_specs`` (column-parallel kernels by columns, row-parallel by rows, norms
  replicated) and calls the module inside ``jax.shard_map`` on each device's shards.
  Calling the module directly inside your own shard_map on a module merged from sharded
  state works the same way.

  Args:
    hidden: H.
    num_heads, head_dim, mlp_dim: attention heads and MLP size in total (heads and
      mlp_dim divisible by tp).
    axis_name: the tensor-parallel mesh axis.
    epsilon, sequence_parallel, inference, dtype, implementation: as in the linen block.
    param_dtype: parameter dtype.
    kernel_init: initializer of the global kernels (default normal(0.02)).
    rngs: NNX random streams (``params``).
  """

  def __init__(self, hidden: int, num_heads: int, head_dim: int, mlp_dim: int, *,
               axis_name: str = "tp", epsilon: float = 1e-6, sequence_parallel: bool = True,
               inference: bool = False, dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init: Initializer = nnx.initializers.normal(0.02),
               implementation: str | None = None, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.head_dim = head_dim
    self.mlp_dim = mlp_dim
    self.axis_name = axis_name
    self.epsilon = epsilon
    self.sequence_parallel = sequence_parallel
    self.inference = inference
    self.dtype = dtype
    self.implementation = implementation
    shapes = parallel_block.global_param_shapes(hidden, num_heads, head_dim, mlp_dim)
    for name in parallel_block.PARAM_NAMES:
      if name.endswith("_norm"):
        value = jnp.ones(shapes[name], param_dtype)
      else:
        value = kernel_init(rngs.params(), shapes[name], param_dtype)
      setattr(self, name, nnx.Param(value))

  def state_specs(self, state):
    """PartitionSpecs for ``state`` (from ``nnx.split(self)``), by parameter name."""
    return _specs_by_name(state, parallel_block.param_specs(self.axis_name))

  def __call__(self, x: jax.Array) -> jax.Array:
    tp = parallel_layers.tensor_parallel_size(self.axis_name)
    parallel_block.check_divisible(self.num_heads, self.mlp_dim, tp)
    dtype = self.dtype or x.dtype
    x = x.astype(dtype)
    params = {}
    for name in parallel_block.PARAM_NAMES:
      value = getattr(self, name)[...]
      params[name] = _gamma_for(x, value) if name.endswith("_norm") else value.astype(dtype)
    return parallel_block.transformer_block(
        params, x, axis_name=self.axis_name, head_dim=self.head_dim, eps=self.epsilon,
        sequence_parallel=self.sequence_parallel, inference=self.inference,
        implementation=self.implementation)


def apply_sharded(model: TensorParallelTransformerBlock, x: jax.Array, *, mesh) -> jax.Array:
  """Runs ``model(x)`` inside ``jax.shard_map`` over ``model.axis_name`` of ``mesh``.

  x is the global activation [S, B, H]: sharded along the sequence with
  sequence_parallel, replicated otherwise; the result has the same layout.
  """
  graphdef, state = nnx.split(model)
  x_spec = P(model.axis_name) if model.sequence_parallel else P()

  def body(state, x):
    return nnx.merge(graphdef, state)(x)

  return compat.shard_map(body, mesh=mesh, in_specs=(model.state_specs(state), x_spec),
                          out_specs=x_spec)(state, x)
# --- grouped linear (issue 4) ---------------------------------------------------------

from jaxfuse._src.ops.grouped_linear.api import grouped_linear as _grouped_linear  # noqa: E402


class GroupedLinear(nnx.Module):
  """``jaxfuse.grouped_linear`` owning its kernel [num_groups, in_features, features] (see
  ``jaxfuse.flax.linen.GroupedLinear``); called as ``module(x, group_sizes)``.

  Args:
    in_features: K.
    num_groups: G, the experts.
    features: N.
    dtype, recipe, implementation: as in linen.
    param_dtype, kernel_init: of the kernel (fan-in per expert by default).
    rngs: NNX random streams (``params``).
  """

  def __init__(self, in_features: int, num_groups: int, features: int, *, dtype: Any = None,
               param_dtype: Any = jnp.float32,
               kernel_init: Initializer = nnx.initializers.variance_scaling(
                   1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                   batch_axis=(0,)),
               recipe: Any = None, implementation: str | None = None, rngs: nnx.Rngs):
    self.num_groups, self.dtype = num_groups, dtype
    self.recipe, self.implementation = recipe, implementation
    self.kernel = nnx.Param(kernel_init(rngs.params(), (num_groups, in_features, features),
                                        param_dtype))

  def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    if jnp.shape(group_sizes) != (self.num_groups,):
      raise ValueError(f"group_sizes must have shape ({self.num_groups},) (num_groups), "
                       f"got {jnp.shape(group_sizes)}")
    dtype = self.dtype or x.dtype
    kernel = self.kernel.get_value()
    if not _experts.is_quantized(kernel):  # a quantize_expert_params kernel runs as it is
      kernel = kernel.astype(dtype)
    return _grouped_linear(x.astype(dtype), kernel, group_sizes,
                           recipe=self.recipe, implementation=self.implementation)


# --- mixture of experts (issue 5) ------------------------------------------------------

from jaxfuse._src.ops.moe.api import moe as _moe  # noqa: E402

default_expert_init = nnx.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))


class MoE(nnx.Module):
  """A drop-less mixture-of-experts MLP: router, permutation, grouped MLP, unpermute.

  Called as ``out, aux_loss = module(x)`` with x [..., in_features]; out has x's shape.
  Add ``coefficient * aux_loss`` (the load-balancing loss, 1.0 when balanced) to the
  training loss. Parameters: ``router`` [H, E], ``kernel1`` [E, H, 2F] (GLU kinds, gate
  first; [E, H, F] for srelu), ``kernel2`` [E, F, H]. See ``jaxfuse.moe``.

  Args:
    in_features: H.
    num_experts: E.
    ffn_features: F, the hidden size of one expert.
    top_k: experts per token.
    activation: "swiglu", "clamped_swiglu" or "srelu".
    score_function: "softmax" or "sigmoid"; normalize_topk: see ``jaxfuse.moe_router``.
    save_activation: keep the activation for the backward pass instead of recomputing it
      (None: as ``jaxfuse.grouped_mlp`` decides).
    dtype: compute dtype of x and the expert kernels (default: promote x and param_dtype).
    param_dtype: dtype of the parameters.
    kernel_init, router_init: initializers.
    recipe: None (bf16), or jaxfuse.quantization.Float8CurrentScaling(per_group=True) for
      FP8 expert GEMMs (see jaxfuse.grouped_mlp; its fp8_wgrad picks FP8 or 16-bit weight
      gradients). For inference, ``quantize_expert_params`` quantizes the expert kernels
      once; the module then runs on them as they are.
    implementation: None, "ffi" or "xla".
    rngs: NNX random streams (``params`` initializes the parameters).
  """

  def __init__(self, in_features: int, num_experts: int, ffn_features: int, *, top_k: int = 2,
               activation: str = "swiglu", score_function: str = "softmax",
               normalize_topk: bool | None = None, save_activation: bool | None = None,
               dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init: Initializer = default_expert_init,
               router_init: Initializer = nnx.initializers.normal(stddev=0.02),
               recipe: Any = None, implementation: str | None = None, rngs: nnx.Rngs):
    self.in_features = in_features
    self.num_experts = num_experts
    self.ffn_features = ffn_features
    self.top_k = top_k
    self.activation = activation
    self.score_function = score_function
    self.normalize_topk = normalize_topk
    self.save_activation = save_activation
    self.dtype = dtype
    self.recipe = recipe
    self.implementation = implementation
    width = 2 * ffn_features if activation != "srelu" else ffn_features
    self.router = nnx.Param(router_init(rngs.params(), (in_features, num_experts), param_dtype))
    self.kernel1 = nnx.Param(kernel_init(rngs.params(), (num_experts, in_features, width),
                                         param_dtype))
    self.kernel2 = nnx.Param(kernel_init(rngs.params(), (num_experts, ffn_features, in_features),
                                         param_dtype))

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, kernel1, kernel2 = _experts.promote(
        lambda *a, dtype: nnx.nn.dtypes.promote_dtype(a, dtype=dtype), x,
        (self.kernel1.get_value(), self.kernel2.get_value()), self.dtype)
    return _moe(x, self.router[...], kernel1, kernel2, top_k=self.top_k,
                activation=self.activation, score_function=self.score_function,
                normalize_topk=self.normalize_topk, recipe=self.recipe,
                save_activation=self.save_activation, implementation=self.implementation)


def quantize_kernel_params(module: nnx.Module, recipe, *, dtype=None) -> nnx.Module:
  """FP8 dense kernels quantized once: the kernel of every ``LinearScaleAdd`` inside
  `module` (built with ``recipe=Float8CurrentScaling(per_group=False)``) is replaced by its
  ``jaxfuse.quantize_kernel`` copy, in place; their calls then skip the weights'
  quantization passes.

  Args:
    module: an nnx module (or a model holding such modules).
    recipe: the modules' recipe.
    dtype: the modules' compute dtype: the kernels are cast to it first, so the FP8 values
      equal those each call would compute; None keeps the parameters' dtype.

  Returns:
    `module`, whose LinearScaleAdd kernel Params now hold QuantizedArrays (constants).
  """
  iter_modules = getattr(nnx, "iter_modules", None)  # a function from flax 0.12 on
  modules = iter_modules(module) if iter_modules is not None else module.iter_modules()
  for _, sub in modules:
    if isinstance(sub, LinearScaleAdd):
      sub.kernel.set_value(_experts.quantize(sub.kernel.get_value(), recipe, dtype))
  return module


def quantize_expert_params(module: nnx.Module, recipe, *, dtype=None) -> nnx.Module:
  """FP8 inference: quantizes the expert kernels of every ``MoE`` (kernel1, kernel2) and
  ``GroupedLinear`` (kernel) inside `module` once (``jaxfuse.quantize_experts``), in place;
  their calls then skip the weights' quantization passes.

  Args:
    module: an nnx module (or a model holding such modules).
    recipe: the modules' recipe, ``Float8CurrentScaling(per_group=True)``.
    dtype: the modules' compute dtype: the kernels are cast to it first, so the FP8 values
      equal those each call would compute; None keeps the parameters' dtype (which must
      then be x's).

  Returns:
    `module`, whose expert kernel Params now hold QuantizedArrays (constants: no gradient).
  """
  iter_modules = getattr(nnx, "iter_modules", None)  # a function from flax 0.12 on
  modules = iter_modules(module) if iter_modules is not None else module.iter_modules()
  for _, sub in modules:
    names = (("kernel1", "kernel2") if isinstance(sub, MoE) else
             ("kernel",) if isinstance(sub, GroupedLinear) else ())
    for name in names:
      param = getattr(sub, name)
      param.set_value(_experts.quantize(param.get_value(), recipe, dtype))
  return module
