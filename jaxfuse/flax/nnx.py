"""Flax NNX modules: thin wrappers that own parameters and call the functional ops."""

from __future__ import annotations

from typing import Any, Callable

from flax import nnx
import jax
import jax.numpy as jnp

from jaxfuse._src.ops.linear_scale_add.api import linear_scale_add

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
    implementation: None, "ffi" or "xla".
    rngs: NNX random streams (``params`` initializes the kernel).
  """

  def __init__(self, in_features: int, features: int, *, alpha: float = 1.0,
               dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init: Initializer = default_kernel_init,
               implementation: str | None = None, rngs: nnx.Rngs):
    self.in_features = in_features
    self.features = features
    self.alpha = alpha
    self.dtype = dtype
    self.implementation = implementation
    self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, features), param_dtype))

  def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:
    x, kernel = nnx.nn.dtypes.promote_dtype((x, self.kernel.value), dtype=self.dtype)
    return linear_scale_add(x, kernel, residual, self.alpha,
                            implementation=self.implementation)


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
    save_activation: keep the activation for the backward pass instead of recomputing it.
    dtype: compute dtype of x and the expert kernels (default: promote x and param_dtype).
    param_dtype: dtype of the parameters.
    kernel_init, router_init: initializers.
    recipe: reserved for FP8 recipes (None).
    implementation: None, "ffi" or "xla".
    rngs: NNX random streams (``params`` initializes the parameters).
  """

  def __init__(self, in_features: int, num_experts: int, ffn_features: int, *, top_k: int = 2,
               activation: str = "swiglu", score_function: str = "softmax",
               normalize_topk: bool | None = None, save_activation: bool = False,
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
    x, kernel1, kernel2 = nnx.nn.dtypes.promote_dtype(
        (x, self.kernel1[...], self.kernel2[...]), dtype=self.dtype)
    return _moe(x, self.router[...], kernel1, kernel2, top_k=self.top_k,
                activation=self.activation, score_function=self.score_function,
                normalize_topk=self.normalize_topk, recipe=self.recipe,
                save_activation=self.save_activation, implementation=self.implementation)
