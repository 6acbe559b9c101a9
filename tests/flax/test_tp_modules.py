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


# --- tensor-parallel layer modules ----------------------------------------------------

TP, N = 4, 64


def _stack_normalized(outputs):
  """(new residual, normalized) with the replicated normalized activations stacked per
  device (out_specs P("tp")), so that a test sees every device's copy."""
  new_residual, normalized = outputs
  return new_residual, normalized[None]


def _linen_init_apply(module, args, arg_specs, out_specs, layer, post=lambda out: out):
  """(global params, output) of a linen layer initialized and applied inside shard_map;
  ``post`` maps each device's output first."""
  mesh = mesh_of(TP)
  param_specs = {"params": jf_linen.layer_specs(layer)}
  init = jax.jit(compat.shard_map(lambda *a: module.init(jax.random.key(0), *a), mesh=mesh,
                                  in_specs=arg_specs, out_specs=param_specs))
  variables = init(*args)
  # Scales away from their ones/zeros init, so that a wrong gamma shows.
  variables = jax.tree_util.tree_map_with_path(
      lambda path, v: v * (1.0 + 0.5 * jnp.arange(v.shape[-1]) / v.shape[-1])
      if "scale" in jax.tree_util.keystr(path) else v, variables)
  apply = jax.jit(compat.shard_map(lambda v, *a: post(module.apply(v, *a)), mesh=mesh,
                                   in_specs=(param_specs, *arg_specs), out_specs=out_specs))
  return variables["params"], apply(variables, *args)


def _close(got, want):
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_linen_column_parallel_linear_shards_and_matches_reference():
  x, residual = random_x(5), helpers.random_array(np.random.default_rng(6), (S, B, N),
                                                  jnp.float32)
  module = jf_linen.ColumnParallelLinear(N, alpha=0.5, implementation="ffi")
  params, out = _linen_init_apply(module, (x, residual), (P("tp"), P(None, None, "tp")),
                                  P(None, None, "tp"), "ColumnParallelLinear")
  kernel = params["kernel"]
  assert kernel.shape == (H, N)
  assert not np.allclose(kernel[:, :N // TP], kernel[:, N // TP:2 * N // TP])  # shards differ
  _close(out, residual + 0.5 * jnp.matmul(x, kernel))


def test_linen_row_parallel_linear_matches_reference():
  x = helpers.random_array(np.random.default_rng(7), (S, B, N), jnp.float32)
  residual = random_x(8)
  module = jf_linen.RowParallelLinear(H)
  params, out = _linen_init_apply(module, (x, residual), (P(None, None, "tp"), P("tp")),
                                  P("tp"), "RowParallelLinear")
  assert params["kernel"].shape == (N, H)
  _close(out, residual + jnp.matmul(x, params["kernel"]))


def test_linen_rms_norm_column_parallel_linear_matches_reference():
  x = random_x(9)
  module = jf_linen.RMSNormColumnParallelLinear(N, epsilon=EPS, implementation="ffi")
  params, out = _linen_init_apply(module, (x,), (P("tp"),), P(None, None, "tp"),
                                  "RMSNormColumnParallelLinear")
  assert params["scale"].shape == (H,) and params["kernel"].shape == (H, N)
  _close(out, jnp.matmul(norm_ref.rms_norm(x, params["scale"], EPS), params["kernel"]))


def test_linen_row_parallel_residual_rms_norm_matches_reference():
  # Device d's partial product is rows [d * S, (d + 1) * S) of y_partials (the tail sums
  # them over the devices).
  y_partials = helpers.random_array(np.random.default_rng(10), (TP * S, B, H), jnp.float32)
  residual = random_x(11)
  module = jf_linen.RowParallelResidualRMSNorm(epsilon=EPS, implementation="ffi")
  params, (new_residual, normalized) = _linen_init_apply(
      module, (y_partials, residual), (P("tp"), P("tp")), (P("tp"), P("tp")),
      "RowParallelResidualRMSNorm", post=_stack_normalized)
  summed = y_partials.reshape(TP, S, B, H).sum(0)
  want_normalized, want_residual = norm_ref.add_rms_norm(summed, residual, params["scale"], EPS)
  _close(new_residual, want_residual)
  assert normalized.shape == (TP, S, B, H)
  for copy in normalized:  # gathered: every device holds all of it
    _close(copy, want_normalized)


def test_linen_column_parallel_linear_rejects_features_not_divisible_by_tp():
  module = jf_linen.ColumnParallelLinear(N + 2)
  with pytest.raises(ValueError, match=r"features \(66\) must be divisible by the "
                                       r"tensor-parallel size tp=4"):
    jax.jit(compat.shard_map(lambda x: module.init(jax.random.key(0), x), mesh=mesh_of(TP),
                             in_specs=P("tp"), out_specs=P()))(random_x())


def _nnx_sharded(model, args, arg_specs, out_specs, post=lambda out: out):
  """model(*args) inside shard_map on its sharded state (each device's output mapped by
  ``post``), and a loss's gradients with respect to the global state and the args."""
  graphdef, state = flax_nnx.split(model)
  mesh = mesh_of(TP)

  def run(state, *args):
    return compat.shard_map(lambda s, *a: post(flax_nnx.merge(graphdef, s)(*a)), mesh=mesh,
                            in_specs=(model.state_specs(state), *arg_specs),
                            out_specs=out_specs)(state, *args)

  loss = lambda state, *args: sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(run(state, *args)))
  grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args) + 1))))(state, *args)
  return jax.jit(run)(state, *args), grads


@pytest.mark.parametrize("layer", ["column", "row", "norm_column", "tail"])
def test_nnx_layers_match_reference_in_values_and_gradients(layer):
  rngs = flax_nnx.Rngs(0)
  x = random_x(12)
  wide = helpers.random_array(np.random.default_rng(13), (S, B, N), jnp.float32)
  if layer == "column":
    model = jf_nnx.ColumnParallelLinear(H, N, implementation="ffi", rngs=rngs)
    args, specs, out_spec = (x,), (P("tp"),), P(None, None, "tp")
    reference = lambda p, x: jnp.matmul(x, p["kernel"])
  elif layer == "row":
    model = jf_nnx.RowParallelLinear(N, H, rngs=rngs)
    args, specs, out_spec = (wide,), (P(None, None, "tp"),), P("tp")
    reference = lambda p, x: jnp.matmul(x, p["kernel"])
  elif layer == "norm_column":
    model = jf_nnx.RMSNormColumnParallelLinear(H, N, epsilon=EPS, implementation="ffi",
                                               rngs=rngs)
    model.scale[...] = 1.0 + 0.5 * jnp.arange(H) / H
    args, specs, out_spec = (x,), (P("tp"),), P(None, None, "tp")
    reference = lambda p, x: jnp.matmul(norm_ref.rms_norm(x, p["scale"], EPS), p["kernel"])
  else:
    model = jf_nnx.RowParallelResidualRMSNorm(H, epsilon=EPS, implementation="ffi")
    model.scale[...] = 1.0 + 0.5 * jnp.arange(H) / H
    y = x  # every device contributes the same partial product: the sum is TP * x
    args, specs, out_spec = (y, random_x(14)), (P(), P("tp")), (P("tp"), P("tp"))

    def reference(p, y, r):  # (new residual, normalized once per device)
      normalized, new_residual = norm_ref.add_rms_norm(TP * y, r, p["scale"], EPS)
      return new_residual, jnp.broadcast_to(normalized, (TP, *normalized.shape))
  params = {name: value[...] for name, value in flax_nnx.state(model).items()}
  post = _stack_normalized if layer == "tail" else (lambda out: out)
  out, grads = _nnx_sharded(model, args, specs, out_spec, post)
  jax.tree.map(_close, out, reference(params, *args))
  ref_loss = lambda p, *a: sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(reference(p, *a)))
  ref_grads = jax.grad(ref_loss, argnums=tuple(range(len(args) + 1)))(params, *args)
  for name in params:
    _close(grads[0][name][...], ref_grads[0][name])
  for got, want in zip(grads[1:], ref_grads[1:]):
    _close(got, want)
