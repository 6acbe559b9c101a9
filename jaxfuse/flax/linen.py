"""Flax linen modules: thin wrappers that own parameters and call the functional ops."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxfuse._src.ops.linear_scale_add.api import linear_scale_add
from jaxfuse._src.ops.rms_norm.api import add_rms_norm
from jaxfuse._src.ops.rms_norm.api import rms_norm
from jaxfuse.flax import _experts
from jaxfuse.parallel import block as parallel_block
from jaxfuse.parallel import layers as parallel_layers

Initializer = Callable[..., jax.Array]
default_kernel_init = nn.initializers.lecun_normal()


class LinearScaleAdd(nn.Module):
  """``residual + alpha * (x @ kernel)``, fused, accumulating into the residual.

  Called as ``module(x, residual)`` with x [..., in_features] and residual
  [..., features]. The kernel is [in_features, features] (Flax's Dense layout).

  Attributes:
    features: output features N.
    alpha: static scale of the product (TransformerEngine's ConstantScale).
    dtype: compute dtype of x and the kernel (default: promote x and param_dtype).
    param_dtype: dtype of the kernel parameter.
    kernel_init: initializer of the kernel.
    recipe: None, or ``Float8CurrentScaling(per_group=False)`` for the FP8 op; the kernel
      may then be a ``quantize_kernel_params`` copy (quantized once).
    implementation: None, "ffi" or "xla" (see ``jaxfuse.linear_scale_add``).
  """

  features: int
  alpha: float = 1.0
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = default_kernel_init
  recipe: Any = None
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:
    kernel = _quantizable_param(self, "kernel", self.kernel_init,
                                (jnp.shape(x)[-1], self.features), self.param_dtype)
    x, kernel = _experts.promote(nn.dtypes.promote_dtype, x, [kernel], self.dtype)
    return linear_scale_add(x, kernel, residual, self.alpha, recipe=self.recipe,
                            implementation=self.implementation)


def _gamma_for(x, gamma):
  """gamma as the op accepts it: x's dtype or float32."""
  if gamma.dtype not in (x.dtype, jnp.dtype(jnp.float32)):
    gamma = gamma.astype(jnp.float32)
  return gamma


class RMSNorm(nn.Module):
  """RMSNorm over the last axis (``jaxfuse.rms_norm``); with a residual, the fused
  residual add + RMSNorm (``jaxfuse.add_rms_norm``).

  Called as ``module(x)`` -> normalized, or ``module(x, residual)`` ->
  (normalized, x + residual). The parameter is ``scale`` [H] (ones, or zeros when
  ``zero_centered_gamma``, whose scale is 1 + gamma).

  Attributes:
    epsilon: added to the mean square.
    zero_centered_gamma: scale by (1 + scale).
    param_dtype: dtype of the scale (kept as is when float32 or x's dtype).
    implementation: None, "ffi" or "xla".
  """

  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  param_dtype: Any = jnp.float32
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: jax.Array, residual: jax.Array | None = None):
    init = nn.initializers.zeros if self.zero_centered_gamma else nn.initializers.ones
    gamma = _gamma_for(x, self.param("scale", init, (jnp.shape(x)[-1],), self.param_dtype))
    if residual is None:
      return rms_norm(x, gamma, self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
                      implementation=self.implementation)
    return add_rms_norm(x, residual, gamma, self.epsilon,
                        zero_centered_gamma=self.zero_centered_gamma,
                        implementation=self.implementation)


# --- tensor-parallel layers (issue 6) -------------------------------------------------
#
# Each runs inside ``jax.shard_map`` over ``axis_name`` and owns this device's parameter
# shards: ``init`` inside shard_map creates local shapes, the kernels drawn with the key
# folded with the device's axis index (so shards differ). Outside shard_map the global
# parameters are the shards concatenated along the sharded dimension; LAYER_SPECS gives
# their PartitionSpecs for shard_map's in_specs/out_specs.


def _shard_init(kernel_init: Initializer, axis_name):
  """kernel_init with the key folded with this device's index along axis_name."""

  def init(key, shape, dtype):
    return kernel_init(jax.random.fold_in(key, jax.lax.axis_index(axis_name)), shape, dtype)

  return init


def _features_shard(features: int, axis_name) -> int:
  """features / tp, or a ValueError naming both."""
  tp = parallel_layers.tensor_parallel_size(axis_name)
  if features % tp:
    raise ValueError(f"features ({features}) must be divisible by the tensor-parallel size "
                     f"tp={tp} (mesh axis {axis_name!r})")
  return features // tp


def layer_specs(layer: str, axis_name="tp") -> dict[str, Any]:
  """PartitionSpecs of a tensor-parallel layer module's global parameters, by name:
  column-parallel kernels split by columns, row-parallel by rows, norm scales
  replicated. ``layer``: the module's class name."""
  column, row, replicated = P(None, axis_name), P(axis_name, None), P()
  return {"ColumnParallelLinear": {"kernel": column},
          "RowParallelLinear": {"kernel": row},
          "RMSNormColumnParallelLinear": {"scale": replicated, "kernel": column},
          "RowParallelResidualRMSNorm": {"scale": replicated}}[layer]


class ColumnParallelLinear(nn.Module):
  """``jaxfuse.parallel.column_parallel_linear`` owning its kernel shard [H, features/tp].

  Called as ``module(x)`` or ``module(x, residual)`` (-> residual + alpha * x @ kernel,
  the fused in-place GEMM). x: the sequence-parallel shard [S/tp, ..., H] (all-gathered
  first), or the full [S, ..., H] with ``gather_input=False``.

  Attributes:
    features: N, the output size over all devices (divisible by tp).
    axis_name: the tensor-parallel mesh axis.
    gather_input: all-gather x along the sequence first.
    alpha: the residual form's scale.
    inference: forward kernels only (see ``jaxfuse.parallel.layers``).
    dtype: compute dtype (default: x's); the kernel is cast to it.
    param_dtype: parameter dtype.
    kernel_init: initializer of the kernel shards.
    implementation: None, "ffi" or "xla" for the fused GEMM.

  Raises:
    ValueError: features not divisible by tp (and the layer's own errors).
  """

  features: int
  axis_name: str = "tp"
  gather_input: bool = True
  alpha: float = 1.0
  inference: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = default_kernel_init
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: jax.Array, residual: jax.Array | None = None) -> jax.Array:
    shape = (jnp.shape(x)[-1], _features_shard(self.features, self.axis_name))
    kernel = self.param("kernel", _shard_init(self.kernel_init, self.axis_name), shape,
                        self.param_dtype)
    dtype = self.dtype or x.dtype
    return parallel_layers.column_parallel_linear(
        x.astype(dtype), kernel.astype(dtype), axis_name=self.axis_name,
        gather_input=self.gather_input, residual=residual, alpha=self.alpha,
        inference=self.inference, implementation=self.implementation)


class RowParallelLinear(nn.Module):
  """``jaxfuse.parallel.row_parallel_linear`` owning its kernel shard [K/tp, features].

  Called as ``module(x_shard)`` or ``module(x_shard, residual)`` (residual added in fp32
  after the reduction, never inside the GEMM). x_shard: [S, ..., K/tp], this device's
  input features.

  Attributes:
    features: N, the output size.
    axis_name: the tensor-parallel mesh axis.
    reduce: "scatter" (sequence-parallel output [S/tp, ..., N]) or "all" (decode).
    inference, dtype, param_dtype, kernel_init: as in ColumnParallelLinear.
  """

  features: int
  axis_name: str = "tp"
  reduce: str = "scatter"
  inference: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = default_kernel_init

  @nn.compact
  def __call__(self, x_shard: jax.Array, residual: jax.Array | None = None) -> jax.Array:
    shape = (jnp.shape(x_shard)[-1], self.features)
    kernel = self.param("kernel", _shard_init(self.kernel_init, self.axis_name), shape,
                        self.param_dtype)
    dtype = self.dtype or x_shard.dtype
    return parallel_layers.row_parallel_linear(
        x_shard.astype(dtype), kernel.astype(dtype), axis_name=self.axis_name,
        reduce=self.reduce, residual=residual, inference=self.inference)


class RMSNormColumnParallelLinear(nn.Module):
  """``jaxfuse.parallel.rms_norm_column_parallel_linear``: RMSNorm of the sequence shard,
  all-gather, column-parallel kernel. Parameters: ``scale`` [H] (replicated; ones, or
  zeros when ``zero_centered_gamma``) and the kernel shard [H, features/tp].

  Attributes:
    features, axis_name, gather_input, inference, dtype, param_dtype, kernel_init: as in
      ColumnParallelLinear.
    epsilon, zero_centered_gamma: as in RMSNorm.
    implementation: None, "ffi" or "xla" for the norm.
  """

  features: int
  axis_name: str = "tp"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  gather_input: bool = True
  inference: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = default_kernel_init
  implementation: str | None = None

  @nn.compact
  def __call__(self, x_shard: jax.Array) -> jax.Array:
    hidden = jnp.shape(x_shard)[-1]
    init = nn.initializers.zeros if self.zero_centered_gamma else nn.initializers.ones
    gamma = self.param("scale", init, (hidden,), self.param_dtype)
    kernel = self.param("kernel", _shard_init(self.kernel_init, self.axis_name),
                        (hidden, _features_shard(self.features, self.axis_name)),
                        self.param_dtype)
    x_shard = x_shard.astype(self.dtype or x_shard.dtype)
    return parallel_layers.rms_norm_column_parallel_linear(
        x_shard, _gamma_for(x_shard, gamma), kernel.astype(x_shard.dtype),
        axis_name=self.axis_name, eps=self.epsilon,
        zero_centered_gamma=self.zero_centered_gamma, gather_input=self.gather_input,
        inference=self.inference, implementation=self.implementation)


class RowParallelResidualRMSNorm(nn.Module):
  """The fused row-parallel tail, ``jaxfuse.parallel.row_parallel_residual_rms_norm``:
  reduce -> add residual -> RMSNorm with this module's ``scale`` [H] (the next layer's
  norm weight, replicated) -> all-gather.

  Called as ``module(y_partial, residual_shard)`` -> (new residual shard, normalized
  activations), with y_partial [S, ..., H] this device's partial product.

  Attributes:
    axis_name, epsilon, zero_centered_gamma, inference, param_dtype, implementation: as
      above.
    reduce: "scatter" or "all".
    gather_output: all-gather the normalized shard (reduce="scatter").
  """

  axis_name: str = "tp"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  reduce: str = "scatter"
  gather_output: bool = True
  inference: bool = False
  param_dtype: Any = jnp.float32
  implementation: str | None = None

  @nn.compact
  def __call__(self, y_partial: jax.Array, residual_shard: jax.Array):
    init = nn.initializers.zeros if self.zero_centered_gamma else nn.initializers.ones
    gamma = self.param("scale", init, (jnp.shape(y_partial)[-1],), self.param_dtype)
    return parallel_layers.row_parallel_residual_rms_norm(
        y_partial, residual_shard, _gamma_for(residual_shard, gamma),
        axis_name=self.axis_name, eps=self.epsilon,
        zero_centered_gamma=self.zero_centered_gamma, reduce=self.reduce,
        gather_output=self.gather_output, inference=self.inference,
        implementation=self.implementation)


class TensorParallelTransformerBlock(nn.Module):
  """A Megatron-style tensor-parallel pre-norm transformer block; runs inside
  ``jax.shard_map`` over ``axis_name`` on per-device parameter shards.

  Attention: RMSNorm on the sequence shard, column-parallel QKV (whole heads per
  device), causal softmax attention, row-parallel out-projection; MLP: column-parallel
  up/gate with SwiGLU, row-parallel down. See ``jaxfuse.parallel.block`` for the
  parameter layout and ``jaxfuse.parallel.block.param_specs`` for the PartitionSpecs of
  the global parameters.

  ``init`` inside shard_map creates this device's shards (local shapes; kernels drawn
  with the key folded with the device's axis index, so shards differ). Call with
  x [S/tp, B, H] (sequence_parallel=True) or the replicated x [S, B, H] (False, for
  decode-sized batches; all-reduce instead of reduce-scatter).

  Attributes:
    num_heads: attention heads in total (divisible by tp).
    head_dim: per-head size.
    mlp_dim: MLP hidden size in total (divisible by tp).
    axis_name: the tensor-parallel mesh axis.
    epsilon: RMSNorm epsilon.
    sequence_parallel: see above.
    inference: forward kernels only (see ``jaxfuse.parallel.layers``).
    dtype: compute dtype (default: x's dtype); kernels are cast to it.
    param_dtype: parameter dtype.
    kernel_init: initializer of the kernel shards (default normal(0.02), Megatron's).
    implementation: None, "ffi" or "xla" for the norms.
  """

  num_heads: int
  head_dim: int
  mlp_dim: int
  axis_name: str = "tp"
  epsilon: float = 1e-6
  sequence_parallel: bool = True
  inference: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = nn.initializers.normal(0.02)
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    tp = parallel_layers.tensor_parallel_size(self.axis_name)
    parallel_block.check_divisible(self.num_heads, self.mlp_dim, tp)
    hidden = jnp.shape(x)[-1]
    shapes = parallel_block.global_param_shapes(hidden, self.num_heads, self.head_dim,
                                                self.mlp_dim)
    specs = parallel_block.param_specs(self.axis_name)
    shard_init = _shard_init(self.kernel_init, self.axis_name)
    params = {}
    for name in parallel_block.PARAM_NAMES:
      shape = _local_shape(shapes[name], specs[name], tp)
      if name.endswith("_norm"):
        params[name] = self.param(name, nn.initializers.ones, shape, self.param_dtype)
      else:
        params[name] = self.param(name, shard_init, shape, self.param_dtype)
    dtype = self.dtype or x.dtype
    x = x.astype(dtype)
    params = {name: (_gamma_for(x, value) if name.endswith("_norm") else value.astype(dtype))
              for name, value in params.items()}
    return parallel_block.transformer_block(
        params, x, axis_name=self.axis_name, head_dim=self.head_dim, eps=self.epsilon,
        sequence_parallel=self.sequence_parallel, inference=self.inference,
        implementation=self.implementation)


def _local_shape(shape, spec, tp):
  return tuple(size // tp if axis is not None else size
               for size, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))))
# --- grouped linear (issue 4) ---------------------------------------------------------

from jaxfuse._src.ops.grouped_linear.api import grouped_linear as _grouped_linear  # noqa: E402


def _quantizable_param(module: nn.Module, name: str, init, shape, dtype):
  """module.param(name, ...), or the QuantizedArray that quantize_expert_params /
  quantize_kernel_params stored under that name (as it is: Flax's shape check compares
  leaves, and its data is transposed)."""
  if module.has_variable("params", name):
    value = module.get_variable("params", name)
    if _experts.is_quantized(value):
      if tuple(value.shape) != tuple(shape):
        raise ValueError(f"the quantized parameter {name!r} represents shape "
                         f"{tuple(value.shape)}, the module expects {tuple(shape)}")
      return value
  return module.param(name, init, shape, dtype)


class GroupedLinear(nn.Module):
  """``jaxfuse.grouped_linear`` owning its kernel [num_groups, in_features, features]: the
  expert GEMM of a mixture-of-experts layer (rows of group g times kernel[g]).

  Called as ``module(x, group_sizes)`` with x [M, in_features], rows sorted by group, and
  int32 group_sizes [num_groups] on the device (see ``jaxfuse.grouped_linear``: rows past
  their total come out as zeros). Returns [M, features].

  Attributes:
    num_groups: G, the experts.
    features: N.
    dtype: compute dtype (default: x's); the kernel is cast to it.
    param_dtype: parameter dtype.
    kernel_init: initializer of the [G, K, N] kernel (fan-in per expert by default).
    recipe: None (16-bit), ``Float8CurrentScaling(per_group=True)`` or
      ``Float8BlockScaling()`` (FP8 GEMMs, see
      ``jaxfuse.grouped_linear``). For inference with current scaling,
      ``quantize_expert_params(params, recipe, names=("kernel",))`` quantizes the kernel
      once.
    implementation: None, "ffi" or "xla".

  Raises:
    ValueError: group_sizes not of shape [num_groups] (and grouped_linear's own errors).
  """

  num_groups: int
  features: int
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))
  recipe: Any = None
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    if jnp.shape(group_sizes) != (self.num_groups,):
      raise ValueError(f"group_sizes must have shape ({self.num_groups},) (num_groups), "
                       f"got {jnp.shape(group_sizes)}")
    kernel = _quantizable_param(self, "kernel", self.kernel_init,
                           (self.num_groups, jnp.shape(x)[-1], self.features), self.param_dtype)
    dtype = self.dtype or x.dtype
    if not _experts.is_quantized(kernel):  # a quantize_expert_params kernel runs as it is
      kernel = kernel.astype(dtype)
    return _grouped_linear(x.astype(dtype), kernel, group_sizes,
                           recipe=self.recipe, implementation=self.implementation)


# --- mixture of experts (issue 5) ------------------------------------------------------

from jaxfuse._src.ops.moe.api import moe as _moe  # noqa: E402

default_expert_init = nn.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))


class MoE(nn.Module):
  """A drop-less mixture-of-experts MLP: router, permutation, grouped MLP, unpermute.

  Called as ``out, aux_loss = module(x)`` with x [..., H]; out has x's shape. Add
  ``coefficient * aux_loss`` (the load-balancing loss, 1.0 when balanced) to the training
  loss. Parameters: ``router`` [H, E] (fp32 routing), ``kernel1`` [E, H, 2F] (GLU kinds,
  gate first; [E, H, F] for srelu) and ``kernel2`` [E, F, H]. See ``jaxfuse.moe``.

  Attributes:
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
  """

  num_experts: int
  ffn_features: int
  top_k: int = 2
  activation: str = "swiglu"
  score_function: str = "softmax"
  normalize_topk: bool | None = None
  save_activation: bool | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = default_expert_init
  router_init: Initializer = nn.initializers.normal(stddev=0.02)
  recipe: Any = None
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    hidden = jnp.shape(x)[-1]
    width = 2 * self.ffn_features if self.activation != "srelu" else self.ffn_features
    router = self.param("router", self.router_init, (hidden, self.num_experts), self.param_dtype)
    kernel1 = _quantizable_param(self, "kernel1", self.kernel_init,
                            (self.num_experts, hidden, width), self.param_dtype)
    kernel2 = _quantizable_param(self, "kernel2", self.kernel_init,
                            (self.num_experts, self.ffn_features, hidden), self.param_dtype)
    x, kernel1, kernel2 = _experts.promote(
        lambda *a, dtype: nn.dtypes.promote_dtype(*a, dtype=dtype), x, (kernel1, kernel2),
        self.dtype)
    return _moe(x, router, kernel1, kernel2, top_k=self.top_k, activation=self.activation,
                score_function=self.score_function, normalize_topk=self.normalize_topk,
                recipe=self.recipe, save_activation=self.save_activation,
                implementation=self.implementation)


def quantize_expert_params(params, recipe, *, dtype=None, names=("kernel1", "kernel2"),
                           trainable=False):
  """FP8 expert weights quantized once: `params` with every rank-3 parameter named in
  `names` quantized (``jaxfuse.quantize_experts``); ``MoE`` (kernel1, kernel2) and
  ``GroupedLinear`` (names=("kernel",)) modules then run on them without quantizing in each
  call. For inference; or, with ``trainable=True``, for the micro-batches of a training
  step (see ``jaxfuse.quantize_experts``).

  Args:
    params: a params tree (``variables["params"]``, or a subtree).
    recipe: the modules' recipe, ``Float8CurrentScaling(per_group=True)``.
    dtype: the modules' compute dtype (``dtype=``): the kernels are cast to it first, so the
      FP8 values equal those each call would compute; None keeps the parameters' dtype
      (which must then be x's).
    names: parameter names to quantize; other leaves are left as they are.
    trainable: keep each kernel (cast to `dtype`) as its copy's master: differentiated
      through this call, the parameters get the gradients of the 16-bit modules; a
      gradient taken with respect to the returned tree holds them at each copy's
      ``.master``.

  Returns:
    The same tree with those leaves replaced by QuantizedArrays: constants (the modules
    give them no gradient), or trainable copies.
  """
  return _quantize_named(params, recipe, dtype, names, trainable, rank=3)


def quantize_kernel_params(params, recipe, *, dtype=None, names=("kernel",), trainable=False):
  """A dense FP8 kernel quantized once: `params` with every rank-2 parameter named in
  `names` quantized (``jaxfuse.quantize_kernel``), for ``LinearScaleAdd`` modules with
  ``recipe=Float8CurrentScaling(per_group=False)``, which then run on them without
  quantizing in each call. Pass the subtree of those modules: other modules' rank-2
  "kernel" parameters (``nn.Dense``) would be replaced too.

  Args and result as for ``quantize_expert_params``, with the recipe
  ``Float8CurrentScaling(per_group=False)``.
  """
  return _quantize_named(params, recipe, dtype, names, trainable, rank=2)


def _quantize_named(params, recipe, dtype, names, trainable, rank):
  """`params` with every parameter of rank `rank` named in `names` quantized once
  (_experts.quantize: quantize_experts for rank 3, quantize_kernel for rank 2)."""
  def visit(path, leaf):
    name = getattr(path[-1], "key", None) if path else None
    if name in names and jnp.ndim(leaf) == rank:
      return _experts.quantize(leaf, recipe, dtype, trainable)
    return leaf

  return jax.tree_util.tree_map_with_path(visit, params)
