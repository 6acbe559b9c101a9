"""Flax MoE modules (linen and nnx): parameters, same result as the functional layer,
gradients, and a few optimizer steps that lower the loss."""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse.flax import linen as jf_linen
from jaxfuse.flax import nnx as jf_nnx
from tests import helpers

HIDDEN, FFN, EXPERTS, TOPK = 16, 8, 4, 2


def inputs(seed=0):
  return helpers.random_array(np.random.default_rng(seed), (2, 12, HIDDEN), jnp.float32)


@pytest.mark.parametrize("activation, width", [("swiglu", 2 * FFN), ("srelu", FFN)])
def test_linen_moe_matches_functional(activation, width):
  module = jf_linen.MoE(num_experts=EXPERTS, ffn_features=FFN, top_k=TOPK,
                        activation=activation, dtype=jnp.bfloat16, implementation="ffi")
  x = inputs()
  params = module.init(jax.random.key(0), x)["params"]
  assert params["router"].shape == (HIDDEN, EXPERTS)
  assert params["kernel1"].shape == (EXPERTS, HIDDEN, width)
  assert params["kernel2"].shape == (EXPERTS, FFN, HIDDEN)
  out, aux = module.apply({"params": params}, x)
  assert out.shape == x.shape and out.dtype == jnp.bfloat16
  want, want_aux = jaxfuse.moe(x.astype(jnp.bfloat16), params["router"],
                               params["kernel1"].astype(jnp.bfloat16),
                               params["kernel2"].astype(jnp.bfloat16), top_k=TOPK,
                               activation=activation, implementation="ffi")
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  np.testing.assert_allclose(float(aux), float(want_aux))


def test_nnx_moe_matches_functional_and_trains():
  module = jf_nnx.MoE(HIDDEN, EXPERTS, FFN, top_k=TOPK, dtype=jnp.bfloat16,
                      implementation="ffi", rngs=nnx.Rngs(0))
  x = inputs(1)
  out, aux = module(x)
  want, _ = jaxfuse.moe(x.astype(jnp.bfloat16), module.router[...],
                        module.kernel1[...].astype(jnp.bfloat16),
                        module.kernel2[...].astype(jnp.bfloat16), top_k=TOPK,
                        implementation="ffi")
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  target = jnp.tanh(x[..., ::-1])
  optimizer = nnx.Optimizer(module, optax.adam(3e-2), wrt=nnx.Param)

  @nnx.jit
  def step(module, optimizer):
    def loss_fn(module):
      out, aux = module(x)
      return jnp.mean((out.astype(jnp.float32) - target) ** 2) + 0.01 * aux
    loss, grads = nnx.value_and_grad(loss_fn)(module)
    optimizer.update(module, grads)
    return loss

  losses = [float(step(module, optimizer)) for _ in range(15)]
  assert losses[-1] < 0.8 * losses[0], losses


def test_linen_moe_gradients_reach_every_parameter():
  module = jf_linen.MoE(num_experts=EXPERTS, ffn_features=FFN, top_k=TOPK,
                        score_function="sigmoid", dtype=jnp.bfloat16, implementation="ffi")
  x = inputs(2)
  params = module.init(jax.random.key(1), x)

  def loss(params):
    out, aux = module.apply(params, x)
    return jnp.sum(jnp.sin(out.astype(jnp.float32))) + 0.1 * aux

  grads = jax.jit(jax.grad(loss))(params)["params"]
  # The same module on the reference implementation (ragged_dot, jnp), in float32.
  ref_module = module.clone(implementation="xla", dtype=jnp.float32)
  ref_grads = jax.grad(lambda p: jnp.sum(jnp.sin(ref_module.apply(p, x)[0])) +
                       0.1 * ref_module.apply(p, x)[1])(params)["params"]
  for name in ("router", "kernel1", "kernel2"):
    assert np.abs(np.asarray(grads[name])).max() > 0, name
    helpers.assert_close(grads[name], helpers.as_f64(ref_grads[name]), jnp.bfloat16, msg=name)
