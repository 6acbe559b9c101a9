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
