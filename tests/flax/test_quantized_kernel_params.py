"""The FP8 LinearScaleAdd modules (linen and nnx): recipe=Float8CurrentScaling(per_group=False)
runs the FP8 op, and quantize_kernel_params replaces the dense kernels by
jaxfuse.quantize_kernel results, which give the outputs of quantizing in every call: no
gradient for frozen copies, the 16-bit module's gradients through trainable ones."""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse.flax import linen as jf_linen
from jaxfuse.flax import nnx as jf_nnx
from tests import helpers

# FP8 GEMMs need K, N and the rows to be multiples of 16.
IN, OUT = 32, 48
RECIPE = jaxfuse.quantization.Float8CurrentScaling(per_group=False)
IMPLEMENTATIONS = ["ffi", "xla"]


def inputs(seed=0):
  rng = np.random.default_rng(seed)
  return (helpers.random_array(rng, (2, 16, IN), jnp.float32),
          helpers.random_array(rng, (2, 16, OUT), jnp.bfloat16))


def assert_equal(actual, expected):
  np.testing.assert_array_equal(np.asarray(actual, np.float32), np.asarray(expected, np.float32))


def assert_same(implementation, actual, expected):
  """Bit for bit on the FFI path (the GEMMs read the same FP8 bytes); within one bfloat16
  rounding on the XLA path (its float32 dot sums in an order that depends on how XLA lays
  out a parameter or a computed operand)."""
  if implementation == "ffi":
    assert_equal(actual, expected)
  else:
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                               rtol=2.0 ** -7, atol=0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_linen_fp8_module_matches_the_functional_op(implementation):
  module = jf_linen.LinearScaleAdd(features=OUT, alpha=0.5, dtype=jnp.bfloat16, recipe=RECIPE,
                                   implementation=implementation)
  x, residual = inputs()
  params = module.init(jax.random.key(0), x, residual)["params"]
  out = jax.jit(module.apply)({"params": params}, x, residual)
  want = jaxfuse.linear_scale_add(x.astype(jnp.bfloat16), params["kernel"].astype(jnp.bfloat16),
                                  residual, 0.5, recipe=RECIPE, implementation=implementation)
  assert_equal(out, want)
  # FP8, not the 16-bit op: the two differ by the quantization error.
  bf16 = jaxfuse.linear_scale_add(x.astype(jnp.bfloat16), params["kernel"].astype(jnp.bfloat16),
                                  residual, 0.5, implementation=implementation)
  assert np.any(np.asarray(out, np.float32) != np.asarray(bf16, np.float32))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_linen_on_quantized_and_trainable_params(implementation):
  module = jf_linen.LinearScaleAdd(features=OUT, alpha=-1.5, dtype=jnp.bfloat16, recipe=RECIPE,
                                   implementation=implementation)
  x, residual = inputs(1)
  params = module.init(jax.random.key(1), x, residual)["params"]
  quantized = jf_linen.quantize_kernel_params(params, RECIPE, dtype=jnp.bfloat16)
  assert isinstance(quantized["kernel"], jaxfuse.quantization.QuantizedArray)
  assert quantized["kernel"].scaling_mode == "per_kernel"
  apply = jax.jit(module.apply)
  assert_same(implementation, apply({"params": quantized}, x, residual),
              apply({"params": params}, x, residual))

  def loss(p, quantize, trainable=False):
    if quantize:
      p = jf_linen.quantize_kernel_params(p, RECIPE, dtype=jnp.bfloat16, trainable=trainable)
    return jnp.sum(module.apply({"params": p}, x, residual).astype(jnp.float32) ** 2)

  grad = jax.jit(jax.grad(loss), static_argnums=(1, 2))
  grads_16, grads_trainable = grad(params, False), grad(params, True, True)
  assert grads_trainable["kernel"].dtype == params["kernel"].dtype
  assert_same(implementation, grads_trainable["kernel"], grads_16["kernel"])
  assert np.abs(np.asarray(grads_16["kernel"])).max() > 0
  grads_frozen = jax.grad(lambda p: loss(p, False))(quantized)  # constants
  assert not np.asarray(grads_frozen["kernel"].data, np.float32).any()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_nnx_on_quantized_params(implementation):
  x, residual = inputs(2)
  model = jf_nnx.LinearScaleAdd(IN, OUT, alpha=0.75, dtype=jnp.bfloat16, recipe=RECIPE,
                                implementation=implementation, rngs=nnx.Rngs(0))
  out = model(x, residual)
  want = jaxfuse.linear_scale_add(x.astype(jnp.bfloat16), model.kernel.get_value().astype(
      jnp.bfloat16), residual, 0.75, recipe=RECIPE, implementation=implementation)
  assert_equal(out, want)
  jf_nnx.quantize_kernel_params(model, RECIPE, dtype=jnp.bfloat16)
  assert isinstance(model.kernel.get_value(), jaxfuse.quantization.QuantizedArray)
  assert_same(implementation, model(x, residual), out)
