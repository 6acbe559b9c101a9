"""FP8 inference in the Flax modules: quantize_expert_params (linen and nnx) replaces the
expert kernels by jaxfuse.quantize_experts results, and MoE / GroupedLinear then give the
same outputs as quantizing the kernels in every call, with no gradient for them."""

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

# FP8 GEMMs need H, 2F and F to be multiples of 16.
HIDDEN, FFN, EXPERTS, TOPK = 32, 16, 4, 2
RECIPE = jaxfuse.quantization.Float8CurrentScaling(per_group=True)
# Both weight scalings: one scale per expert, and DeepSeek-V3's 128 x 128 tiles.
RECIPES = [pytest.param(RECIPE, id="per_group"),
           pytest.param(jaxfuse.quantization.Float8BlockScaling(), id="blockwise")]
IMPLEMENTATIONS = ["ffi", "xla"]


def inputs(seed=0, shape=(2, 12, HIDDEN)):
  return helpers.random_array(np.random.default_rng(seed), shape, jnp.float32)


def assert_equal(actual, expected):
  np.testing.assert_array_equal(np.asarray(actual, np.float32), np.asarray(expected, np.float32))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_linen_moe_on_quantized_params(implementation, recipe):
  module = jf_linen.MoE(num_experts=EXPERTS, ffn_features=FFN, top_k=TOPK, dtype=jnp.bfloat16,
                        recipe=recipe, implementation=implementation)
  x = inputs()
  params = module.init(jax.random.key(0), x)["params"]
  quantized = jf_linen.quantize_expert_params(params, recipe, dtype=jnp.bfloat16)
  for name in ("kernel1", "kernel2"):
    assert isinstance(quantized[name], jaxfuse.quantization.QuantizedArray)
  assert quantized["router"] is params["router"]  # rank 2, not an expert kernel
  out, aux = jax.jit(module.apply)({"params": params}, x)
  out_q, aux_q = jax.jit(module.apply)({"params": quantized}, x)
  assert_equal(out_q, out)
  assert float(aux_q) == float(aux)
  assert np.abs(np.asarray(out_q, np.float32)).max() > 0

  def loss(p):
    out, aux = module.apply({"params": p}, x)
    return jnp.sum(out.astype(jnp.float32) ** 2) + aux

  grads = jax.grad(loss)(quantized)
  assert np.abs(np.asarray(grads["router"])).max() > 0  # the router still learns
  assert not np.asarray(grads["kernel1"].data, np.float32).any()  # constants


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_linen_moe_trains_on_trainable_quantized_params(implementation, recipe):
  """quantize_expert_params(..., trainable=True) inside the loss: every parameter's gradient
  (the float32 expert kernels' through the bf16 cast and the copies' masters, the
  router's) equals the 16-bit module's, which quantizes its kernels in the call."""
  module = jf_linen.MoE(num_experts=EXPERTS, ffn_features=FFN, top_k=TOPK, dtype=jnp.bfloat16,
                        recipe=recipe, implementation=implementation)
  x = inputs(3)
  params = module.init(jax.random.key(1), x)["params"]

  def loss(p, trainable):
    if trainable:
      p = jf_linen.quantize_expert_params(p, recipe, dtype=jnp.bfloat16, trainable=True)
    out, aux = module.apply({"params": p}, x)
    return jnp.sum(out.astype(jnp.float32) ** 2) + aux

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  grads_q, grads_16 = grad(params, True), grad(params, False)
  for name in ("kernel1", "kernel2", "router"):
    assert grads_q[name].dtype == params[name].dtype
    assert_equal(grads_q[name], grads_16[name])
    assert np.abs(np.asarray(grads_q[name], np.float32)).max() > 0


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_nnx_moe_and_grouped_linear_on_quantized_params(implementation, recipe):
  rngs = nnx.Rngs(0)
  moe = jf_nnx.MoE(HIDDEN, EXPERTS, FFN, top_k=TOPK, dtype=jnp.bfloat16, recipe=recipe,
                   implementation=implementation, rngs=rngs)
  linear = jf_nnx.GroupedLinear(HIDDEN, EXPERTS, 48, dtype=jnp.bfloat16, recipe=recipe,
                                implementation=implementation, rngs=rngs)
  x = inputs(1)
  rows = inputs(2, (24, HIDDEN))
  sizes = jnp.array([5, 0, 11, 8], jnp.int32)
  out, aux = moe(x)
  out_linear = linear(rows, sizes)
  for module in (moe, linear):
    assert jf_nnx.quantize_expert_params(module, recipe, dtype=jnp.bfloat16) is module
  assert isinstance(moe.kernel1.get_value(), jaxfuse.quantization.QuantizedArray)
  assert isinstance(linear.kernel.get_value(), jaxfuse.quantization.QuantizedArray)
  out_q, aux_q = moe(x)
  assert_equal(out_q, out)
  assert float(aux_q) == float(aux)
  assert_equal(linear(rows, sizes), out_linear)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_linen_grouped_linear_on_quantized_params(implementation, recipe):
  module = jf_linen.GroupedLinear(num_groups=EXPERTS, features=48, dtype=jnp.bfloat16,
                                  recipe=recipe, implementation=implementation)
  rows = inputs(3, (24, HIDDEN))
  sizes = jnp.array([7, 9, 0, 8], jnp.int32)
  params = module.init(jax.random.key(1), rows, sizes)["params"]
  quantized = jf_linen.quantize_expert_params(params, recipe, dtype=jnp.bfloat16,
                                              names=("kernel",))
  assert isinstance(quantized["kernel"], jaxfuse.quantization.QuantizedArray)
  assert_equal(module.apply({"params": quantized}, rows, sizes),
               module.apply({"params": params}, rows, sizes))


def test_quantized_params_in_another_dtype_are_refused():
  module = jf_linen.MoE(num_experts=EXPERTS, ffn_features=FFN, top_k=TOPK, dtype=jnp.bfloat16,
                        recipe=RECIPE, implementation="xla")
  x = inputs()
  params = module.init(jax.random.key(0), x)["params"]
  quantized = jf_linen.quantize_expert_params(params, RECIPE)  # float32 parameters kept
  with pytest.raises(TypeError, match="kernel1 dtype float32 must equal x dtype bfloat16"):
    module.apply({"params": quantized}, x)
