"""Flax linen modules: thin wrappers that own parameters and call the functional ops."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxfuse._src.ops.linear_scale_add.api import linear_scale_add

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
    implementation: None, "ffi" or "xla" (see ``jaxfuse.linear_scale_add``).
  """

  features: int
  alpha: float = 1.0
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Initializer = default_kernel_init
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:
    kernel = self.param("kernel", self.kernel_init, (jnp.shape(x)[-1], self.features),
                        self.param_dtype)
    x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
    return linear_scale_add(x, kernel, residual, self.alpha,
                            implementation=self.implementation)


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
    save_activation: keep the activation for the backward pass instead of recomputing it.
    dtype: compute dtype of x and the expert kernels (default: promote x and param_dtype).
    param_dtype: dtype of the parameters.
    kernel_init, router_init: initializers.
    recipe: reserved for FP8 recipes (None).
    implementation: None, "ffi" or "xla".
  """

  num_experts: int
  ffn_features: int
  top_k: int = 2
  activation: str = "swiglu"
  score_function: str = "softmax"
  normalize_topk: bool | None = None
  save_activation: bool = False
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
    kernel1 = self.param("kernel1", self.kernel_init, (self.num_experts, hidden, width),
                         self.param_dtype)
    kernel2 = self.param("kernel2", self.kernel_init,
                         (self.num_experts, self.ffn_features, hidden), self.param_dtype)
    x, kernel1, kernel2 = nn.dtypes.promote_dtype(x, kernel1, kernel2, dtype=self.dtype)
    return _moe(x, router, kernel1, kernel2, top_k=self.top_k, activation=self.activation,
                score_function=self.score_function, normalize_topk=self.normalize_topk,
                recipe=self.recipe, save_activation=self.save_activation,
                implementation=self.implementation)
