"""Flax RMSNorm and tensor-parallel transformer block modules (linen and nnx) against
plain unsharded jnp references on 8 CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxfuse._src import compat
from jaxfuse._src.ops.rms_norm import reference as norm_ref
from jaxfuse.flax import linen as jf_linen
from jaxfuse.flax import nnx as jf_nnx
from jaxfuse.parallel import block as parallel_block
from tests import helpers

S, B, H, HEADS, HEAD_DIM, MLP = 16, 2, 32, 8, 4, 64
EPS = 1e-6


def mesh_of(tp):
  return Mesh(np.array(jax.devices("cpu")[:tp]), ("tp",))


def reference_block(p, x):
  """The block on global parameters, no parallelism, plain jnp."""
  s, b, _ = x.shape
  qkv = jnp.matmul(norm_ref.rms_norm(x, p["attn_norm"], EPS), p["qkv_kernel"])
  qkv = qkv.reshape(s, b, HEADS, 3, HEAD_DIM)
  attention = parallel_block.causal_attention(qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :])
  x = x + jnp.matmul(attention.reshape(s, b, HEADS * HEAD_DIM), p["out_kernel"])
  up_gate = jnp.matmul(norm_ref.rms_norm(x, p["mlp_norm"], EPS), p["up_gate_kernel"])
  up_gate = up_gate.reshape(s, b, MLP, 2)
  return x + jnp.matmul(jax.nn.silu(up_gate[..., 0]) * up_gate[..., 1], p["down_kernel"])


def random_x(seed=0):
  return helpers.random_array(np.random.default_rng(seed), (S, B, H), jnp.float32)


@pytest.mark.parametrize("implementation", ["ffi", "xla"])
def test_rms_norm_modules(implementation):
  x = random_x(1)
  residual = random_x(2)
  module = jf_linen.RMSNorm(epsilon=EPS, implementation=implementation)
  params = module.init(jax.random.key(0), x)
  params = jax.tree.map(lambda g: g * 1.5, params)
  gamma = params["params"]["scale"]
  helpers.assert_close(module.apply(params, x), helpers.as_f64(norm_ref.rms_norm(x, gamma, EPS)),
                       jnp.float32)
  out, new_residual = module.apply(params, x, residual)
  ref_out, ref_residual = norm_ref.add_rms_norm(x, residual, gamma, EPS)
  helpers.assert_close(out, helpers.as_f64(ref_out), jnp.float32)
  helpers.assert_close(new_residual, helpers.as_f64(ref_residual), jnp.float32)

  nnx_module = jf_nnx.RMSNorm(H, epsilon=EPS, zero_centered_gamma=True,
                              implementation=implementation)
  nnx_module.scale[...] = gamma - 1.0
  helpers.assert_close(nnx_module(x), helpers.as_f64(norm_ref.rms_norm(x, gamma, EPS)),
                       jnp.float32)
  out, _ = nnx_module(x, residual)
  helpers.assert_close(out, helpers.as_f64(ref_out), jnp.float32)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_nnx_block_matches_unsharded_reference(sequence_parallel):
  model = jf_nnx.TensorParallelTransformerBlock(
      H, HEADS, HEAD_DIM, MLP, epsilon=EPS, sequence_parallel=sequence_parallel,
      implementation="ffi", rngs=flax_nnx.Rngs(0))
  # Larger weights than the default init so that every part of the block matters.
  for name in ("qkv_kernel", "out_kernel", "up_gate_kernel", "down_kernel"):
    getattr(model, name)[...] = getattr(model, name)[...] * 10
  x = random_x(3)
  params = {name: getattr(model, name)[...] for name in parallel_block.PARAM_NAMES}
  expected = reference_block(params, x)
  mesh = mesh_of(4)
  out = jax.jit(lambda x: jf_nnx.apply_sharded(model, x, mesh=mesh))(x)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-4, atol=1e-4)

  # Gradients with respect to the (global) parameters and x.
  graphdef, state = flax_nnx.split(model)

  def loss(state, x):
    return jnp.sum(jnp.sin(jf_nnx.apply_sharded(flax_nnx.merge(graphdef, state), x,
                                                mesh=mesh)))

  grads, dx = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, x)
  ref_grads, ref_dx = jax.grad(lambda p, x: jnp.sum(jnp.sin(reference_block(p, x))),
                               argnums=(0, 1))(params, x)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(ref_dx), rtol=1e-4, atol=1e-4)
  for name in parallel_block.PARAM_NAMES:
    np.testing.assert_allclose(np.asarray(grads[name][...]), np.asarray(ref_grads[name]),
                               rtol=2e-4, atol=2e-4, err_msg=name)


def test_linen_block_initializes_shards_and_matches_reference():
  tp = 2
  mesh = mesh_of(tp)
  module = jf_linen.TensorParallelTransformerBlock(HEADS, HEAD_DIM, MLP, epsilon=EPS,
                                                   kernel_init=jax.nn.initializers.normal(0.2),
                                                   implementation="ffi")
  specs = {"params": parallel_block.param_specs("tp")}
  x = random_x(4)
  init = jax.jit(compat.shard_map(lambda x: module.init(jax.random.key(0), x), mesh=mesh,
                                  in_specs=P("tp"), out_specs=specs))
  variables = init(x)
  params = variables["params"]
  shapes = parallel_block.global_param_shapes(H, HEADS, HEAD_DIM, MLP)
  assert {k: v.shape for k, v in params.items()} == shapes
  # Shards differ between devices (the key is folded with the axis index).
  qkv = np.asarray(params["qkv_kernel"])
  half = qkv.shape[1] // 2
  assert not np.allclose(qkv[:, :half], qkv[:, half:])
  apply = jax.jit(compat.shard_map(module.apply, mesh=mesh, in_specs=(specs, P("tp")),
                                   out_specs=P("tp")))
  np.testing.assert_allclose(np.asarray(apply(variables, x)),
                             np.asarray(reference_block(params, x)), rtol=1e-4, atol=1e-4)


def test_block_rejects_heads_not_divisible_by_tp():
  model = jf_nnx.TensorParallelTransformerBlock(H, 6, HEAD_DIM, MLP, rngs=flax_nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"num_heads \(6\) must be divisible by the "
                                       r"tensor-parallel size tp=4"):
    jf_nnx.apply_sharded(model, random_x(), mesh=mesh_of(4))
