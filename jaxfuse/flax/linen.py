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
