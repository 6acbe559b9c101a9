"""grouped_mlp with Float8BlockScaling (DeepSeek-V3's recipe): the FFI path against the
blockwise reference, its backward against float64 numpy on the FP8 values it quantizes,
accuracy against the 16-bit op, what runs, weights quantized once (frozen and trainable),
errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import Mesh, PartitionSpec as P

import jaxfuse
from jaxfuse._src import compat
from jaxfuse._src.ops.quantize import columnwise
from tests import helpers
from tests.ops.test_grouped_linear_fp8_blockwise import numpy_blockwise
from tests.ops.test_grouped_linear_fp8_blockwise_wgrad import column_blocks_of
from tests.ops.test_grouped_mlp import (ACTIVATIONS, ALPHA, BACKENDS, LIMIT, LINEAR_OFFSET,
                                        group_rows, make_inputs, on, sizes_cases)
from tests.ops.test_grouped_mlp_fp8 import (BACKEND_IMPLEMENTATIONS,
                                            call_with_changed_shapes,
                                            check_accuracy_against_the_bf16_op,
                                            check_save_activation_gives_identical_gradients,
                                            relative_error)

RECIPE = jaxfuse.quantization.Float8BlockScaling()
E5M2_GRADIENTS = jaxfuse.quantization.Float8BlockScaling(gradient_format="e5m2")
FP8_WGRAD = jaxfuse.quantization.Float8BlockScaling(fp8_wgrad=True)
E5M2_GRADIENTS_WGRAD16 = jaxfuse.quantization.Float8BlockScaling(gradient_format="e5m2",
                                                                  fp8_wgrad=False)
ACT = dict(limit=LIMIT, alpha=ALPHA, linear_offset=LINEAR_OFFSET)


def shapes(backend):
  # H and F not multiples of 128: partial blocks in every GEMM's contraction and output.
  return (64, 144, 80) if backend == "cpu" else (1024, 400, 272)


def call(impl, activation, recipe=RECIPE, save_activation=False):
  return lambda x, k1, k2, sizes, scales: jaxfuse.grouped_mlp(
      x, k1, k2, sizes, scales, activation, recipe=recipe, implementation=impl,
      save_activation=save_activation, **ACT)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", list(sizes_cases(64)))
def test_ffi_matches_the_blockwise_reference(backend, activation, case):
  """Same quantization and FP8 products as the reference; h may differ by one bf16
  rounding (fp32 summation order), which can move an activation across an E4M3 rounding
  boundary: one FC2 input off by one E4M3 step (2^-3 of it), hence a 2^-4 bound on the
  largest element error and bf16-level Frobenius agreement."""
  m, hidden, ffn = shapes(backend)
  sizes = sizes_cases(m)[case]
  x, k1, k2, scales = make_inputs(40, m, hidden, ffn, len(sizes), activation, jnp.bfloat16)
  x, k1, k2, scales, group_sizes = on(backend, x, k1, k2, scales,
                                      jnp.asarray(sizes, jnp.int32))
  out = jax.jit(call("ffi", activation))(x, k1, k2, group_sizes, scales)
  assert out.dtype == jnp.bfloat16 and out.shape == (m, hidden)
  expected = helpers.on_cpu(call("xla", activation), x, k1, k2, group_sizes, scales)
  scale = np.abs(helpers.as_f64(expected)).max()
  max_error = np.abs(helpers.as_f64(out) - helpers.as_f64(expected)).max() / scale
  assert max_error <= 2.0 ** -4, case
  assert relative_error(out, expected) < 1e-2, case
  covered = list(group_rows(sizes, m))[-1][2]
  assert not np.asarray(out[covered:], np.float32).any(), "rows past the groups must be zero"


def _np_tiles(kernel, recipe):
  """(data [G, K, N], scale_inv [G, K/128, N/128]) of a weight's 128 x 128 tiles."""
  q = helpers.on_cpu(lambda w: jaxfuse.quantize(w, recipe, kind="weight",
                                                implementation="xla"), kernel)
  return q.data, q.scale_inv


def _np_rows(value, recipe, role):
  q = helpers.on_cpu(lambda v: jaxfuse.quantize(v, recipe, role=role, implementation="xla"),
                     value)
  return q.data, q.scale_inv


def _np_wgrad(a, dy, sizes):
  a, dy = helpers.as_f64(a), helpers.as_f64(dy)
  out = np.zeros((len(sizes), a.shape[1], dy.shape[1]))
  for g, start, end in group_rows(sizes, a.shape[0]):
    out[g] = a[start:end].T @ dy[start:end]
  return out


@pytest.mark.parametrize("recipe", [pytest.param(FP8_WGRAD, id="e4m3"),
                                    pytest.param(E5M2_GRADIENTS_WGRAD16, id="e5m2-wgrad16")])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", ["uniform", "empty_groups", "sum_less_than_rows"])
def test_backward_matches_float64_numpy_on_its_fp8_values(backend, activation, case, recipe):
  """The backward step by step in float64 numpy: dy in 1 x 128 blocks (the recipe's
  gradient format) times kernel2's tiles gives da (rounded to bf16, as the op stores it);
  the fused activation backward of (da, h) gives dh, its 1 x 128 blocks and dscales (the
  jnp reference of scaled_dactivation_quantize, tested against numpy on its own); dx is
  dh's blocks times kernel1's tiles; the wgrads x^T dh and act(h)^T dy, in FP8 (each
  operand in 128 x 1 blocks down each group's rows, quantized here by the reference of
  1 x 128 blocks on each block transposed; run with the column-wise copies enabled, as on
  one device) or in 16-bit (fp8_wgrad=False). h is
  FC1's output from the op's own forward (jax.vjp's residual is not exposed, so it is
  recomputed by the FFI forward GEMM). Each step matches to bf16 roundings; a rounding
  that moves a value across an FP8 boundary moves it by one FP8 step, so the budget is 2%
  Frobenius (a wrong scale layout or operand gives O(1))."""
  m, hidden, ffn = shapes(backend)
  sizes = sizes_cases(m)[case]
  x, k1, k2, scales = make_inputs(41, m, hidden, ffn, len(sizes), activation, jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(42), (m, hidden), jnp.bfloat16)
  x, k1, k2, scales, d_out, group_sizes = on(backend, x, k1, k2, scales, d_out,
                                             jnp.asarray(sizes, jnp.int32))
  fn = lambda x, k1, k2, s: call("ffi", activation, recipe)(x, k1, k2, group_sizes, s)
  with columnwise.fused(everywhere=True):
    _, vjp = jax.vjp(fn, x, k1, k2, scales)
    dx, dk1, dk2, dscales = jax.jit(vjp)(d_out)
  h = jax.jit(lambda x, k: jaxfuse.grouped_linear(x, k, group_sizes, recipe=recipe,
                                                  implementation="ffi"))(x, k1)
  h = helpers.on_cpu(lambda v: v, h)
  dy_data, dy_scale = _np_rows(d_out, recipe, "gradient")
  k2_data, k2_scale = _np_tiles(k2, recipe)
  da, _ = numpy_blockwise(dy_data, dy_scale, k2_data, k2_scale, sizes)
  da = jnp.asarray(da, jnp.bfloat16)
  dh_q, dh, want_dscales = helpers.on_cpu(
      lambda da, h, s: jaxfuse.scaled_dactivation_quantize(
          da, h, s, activation=activation, recipe=recipe, return_dx=True,
          implementation="xla", **ACT), da, h, scales)
  k1_data, k1_scale = _np_tiles(k1, recipe)
  want_dx, _ = numpy_blockwise(dh_q.data, dh_q.scale_inv, k1_data, k1_scale, sizes)
  a = helpers.on_cpu(lambda h, s: jaxfuse.scaled_activation(h, s, activation,
                                                            implementation="xla", **ACT),
                     h, scales)
  if recipe.fp8_wgrad:
    want_dk1 = _np_wgrad(column_blocks_of(x, sizes, recipe, "forward"),
                         column_blocks_of(dh, sizes, recipe, "gradient"), sizes)
    want_dk2 = _np_wgrad(column_blocks_of(a, sizes, recipe, "forward"),
                         column_blocks_of(d_out, sizes, recipe, "gradient"), sizes)
  else:
    want_dk1, want_dk2 = _np_wgrad(x, dh, sizes), _np_wgrad(a, d_out, sizes)
  checks = [("dx", dx, want_dx), ("dkernel1", dk1, want_dk1), ("dkernel2", dk2, want_dk2),
            ("dscales", dscales, want_dscales)]
  for name, got, want in checks:
    assert got.dtype == (jnp.float32 if name == "dscales" else jnp.bfloat16), name
    assert relative_error(got, want) < 2e-2, f"{case} {name}"
  for g, start, end in group_rows(sizes, m):
    if start == end:  # empty groups: exactly zero weight gradients
      assert not np.asarray(dk1[g], np.float32).any(), f"dkernel1[{g}]"
      assert not np.asarray(dk2[g], np.float32).any(), f"dkernel2[{g}]"


@pytest.mark.parametrize("backend, implementation", BACKEND_IMPLEMENTATIONS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_accuracy_against_the_bf16_op(backend, implementation, activation):
  """Two chained blockwise FP8 GEMMs: ~6% relative (Frobenius) forward error on CPU shapes
  (as per-group scaling), the gradients through two quantized gradients and two E4M3
  weights. Budgets as for per-group scaling: 10% forward, 20% gradients."""
  check_accuracy_against_the_bf16_op(lambda act: call(implementation, act), backend,
                                     activation, (128, 144, 80), seed=43)


def test_save_activation_gives_identical_gradients():
  check_save_activation_gives_identical_gradients(
      lambda save: call("ffi", "swiglu", save_activation=save), 144, 80, seed=45)


def _training_jaxpr(k1, k2, x, scales, sizes, recipe=RECIPE):
  loss = lambda x, k1, k2, s: jnp.sum(call("ffi", "swiglu", recipe)(x, k1, k2, sizes, s)
                                      .astype(jnp.float32))
  return jax.make_jaxpr(jax.grad(loss, argnums=(0, 3)))(x, k1, k2, scales)


@pytest.mark.parametrize("fp8_wgrad", [False, True], ids=["partitionable", "one-device"])
def test_blockwise_gemms_and_fused_quantization_run(fp8_wgrad):
  """One offsets computation; FC1/FC2 forward and dgrad on the blockwise FP8 kernel, the
  two wgrads on the blockwise FP8 wgrad kernel from four column-wise block quantizations
  where no partitioning follows (one device; forced here), else on the 16-bit one; one
  pass per weight writes both FP8 layouts; the fused activation kernels quantize the
  hand-offs; no XLA dot anywhere."""
  x, k1, k2, scales = make_inputs(46, 32, 16, 16, 4, "swiglu", jnp.bfloat16)
  sizes = jnp.asarray([8, 0, 16, 8], jnp.int32)
  with columnwise.fused(fp8_wgrad, everywhere=fp8_wgrad):
    jaxpr = _training_jaxpr(k1, k2, x, scales, sizes, FP8_WGRAD)
  count = lambda predicate: helpers.count_primitives(jaxpr, predicate)
  name_is = lambda *names: lambda e: e.primitive.name in names
  assert count(helpers.ffi_target("jaxfuse_group_offsets")) == 1
  assert count(name_is("cumsum")) == 0
  # Each GEMM in both platform branches of platform_dependent.
  assert count(helpers.ffi_target("jaxfuse_grouped_gemm_fp8_blockwise")) == 4 * 2
  assert count(helpers.ffi_target("jaxfuse_grouped_gemm")) == (0 if fp8_wgrad else 2 * 2)
  assert count(helpers.ffi_target("jaxfuse_grouped_gemm_fp8_blockwise_wgrad")) == (
      2 * 2 if fp8_wgrad else 0)
  assert count(helpers.ffi_target("jaxfuse_quantize_columnwise_blocks")) == (
      4 if fp8_wgrad else 0)
  assert count(helpers.ffi_target("jaxfuse_quantize_blocks_transposed")) == 2
  assert count(helpers.ffi_target("jaxfuse_quantize")) == 2  # x and dy, 1 x 128 blocks
  assert count(helpers.ffi_target("jaxfuse_scaled_activation_quantize")) == 1
  assert count(helpers.ffi_target("jaxfuse_scaled_dactivation_quantize")) == 1
  # The 16-bit activation for FC2's wgrad: recomputed once in the backward pass.
  assert count(helpers.ffi_target("jaxfuse_scaled_activation_fwd")) == 1
  assert count(name_is("ragged_dot_general", "ragged_dot", "dot_general")) == 0
  # XLA transposes only the two weights' tile scales (float32, a few KB at full size): no
  # FP8 or 16-bit data.
  transposed = [e.invars[0].aval for e in helpers.equations(jaxpr)
                if e.primitive.name == "transpose"]
  assert [(a.dtype, a.shape) for a in transposed] == [(jnp.float32, (4, 1, 1))] * 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_weights_quantized_once(backend, trainable):
  """quantize_experts(kernel, Float8BlockScaling()) holds the values the call would
  quantize: the same output bits, the same dx and dscales; a trainable copy's master gets
  the 16-bit kernel's gradient, a frozen copy none. The weights' quantization passes are
  gone from the step."""
  m, hidden, ffn = shapes(backend)
  sizes = sizes_cases(m)["empty_groups"]
  x, k1, k2, scales = make_inputs(47, m, hidden, ffn, len(sizes), "swiglu", jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(48), (m, hidden), jnp.bfloat16)
  x, k1, k2, scales, d_out, group_sizes = on(backend, x, k1, k2, scales, d_out,
                                             jnp.asarray(sizes, jnp.int32))
  q1, q2 = (jax.jit(lambda k: jaxfuse.quantize_experts(k, RECIPE, trainable=trainable,
                                                      implementation="ffi"))(k)
            for k in (k1, k2))
  fn = lambda x, k1, k2, s: call("ffi", "swiglu")(x, k1, k2, group_sizes, s)
  out, vjp = jax.vjp(fn, x, k1, k2, scales)
  q_out, q_vjp = jax.vjp(fn, x, q1, q2, scales)
  np.testing.assert_array_equal(np.asarray(q_out, np.float32), np.asarray(out, np.float32))
  dx, dk1, dk2, ds = jax.jit(vjp)(d_out)
  q_dx, q_dk1, q_dk2, q_ds = jax.jit(q_vjp)(d_out)
  np.testing.assert_array_equal(np.asarray(q_dx, np.float32), np.asarray(dx, np.float32))
  np.testing.assert_array_equal(np.asarray(q_ds), np.asarray(ds))
  for got, want in ((q_dk1, dk1), (q_dk2, dk2)):
    if trainable:
      np.testing.assert_array_equal(np.asarray(got.master, np.float32),
                                    np.asarray(want, np.float32))
    else:
      assert got.master is None or not np.asarray(got.master, np.float32).any()
  jaxpr = _training_jaxpr(q1, q2, x, scales, group_sizes)
  assert helpers.count_primitives(
      jaxpr, helpers.ffi_target("jaxfuse_quantize_blocks_transposed")) == 0
  # A frozen copy needs no wgrad: only the dgrads' and forwards' GEMMs remain. (The wgrad
  # is FP8 where no partitioning follows: a single GPU.)
  wgrad = ("jaxfuse_grouped_gemm_fp8_blockwise_wgrad"
           if RECIPE.fp8_wgrad and columnwise.fusion_enabled() else "jaxfuse_grouped_gemm")
  assert helpers.count_primitives(jaxpr, helpers.ffi_target(wgrad)) == (
      2 * 2 if trainable else 0)


def test_moe_layer_runs_the_blockwise_recipe():
  """jaxfuse.moe passes the recipe to its grouped MLP: forward and gradients close to the
  16-bit layer (the FP8 budgets above)."""
  rng = np.random.default_rng(49)
  tokens, hidden, ffn, experts = 64, 144, 80, 4
  x = helpers.random_array(rng, (tokens, hidden), jnp.bfloat16)
  router = helpers.random_array(rng, (hidden, experts), jnp.float32)
  k1 = helpers.random_array(rng, (experts, hidden, 2 * ffn), jnp.bfloat16,
                            scale=1 / np.sqrt(hidden))
  k2 = helpers.random_array(rng, (experts, ffn, hidden), jnp.bfloat16, scale=1 / np.sqrt(ffn))

  def loss(recipe):
    def fn(x, k1, k2):
      out = jaxfuse.moe(x, router, k1, k2, top_k=2, recipe=recipe)
      out = out[0] if isinstance(out, tuple) else out
      return jnp.sum(jnp.sin(out.astype(jnp.float32))), out
    return fn

  (_, out), grads = jax.jit(jax.value_and_grad(loss(RECIPE), argnums=(0, 1, 2),
                                               has_aux=True))(x, k1, k2)
  (_, want), want_grads = jax.jit(jax.value_and_grad(loss(None), argnums=(0, 1, 2),
                                                     has_aux=True))(x, k1, k2)
  assert relative_error(out, want) < 0.10
  for name, got, expected in zip(("dx", "dkernel1", "dkernel2"), grads, want_grads):
    assert relative_error(got, expected) < 0.2, name


def test_shard_map_tokens_sharded_matches_per_shard_calls():
  """Under shard_map with the tokens sharded and the kernels replicated, each device runs
  the blockwise MLP on its own rows and routing (1 x 128 blocks are per row, the weights'
  tiles the same on every device): the output equals the op applied to each shard alone,
  bit for bit; the kernels' gradients are the per-shard gradients summed (bf16 level)."""
  mesh = Mesh(np.array(jax.devices("cpu")), ("data",))
  devices = mesh.devices.size
  m_local, groups, hidden, ffn = 16, 3, 144, 80
  x, k1, k2, scales = make_inputs(50, m_local * devices, hidden, ffn, groups, "swiglu",
                                  jnp.bfloat16)
  rng = np.random.default_rng(51)
  sizes = jnp.asarray(np.stack([rng.multinomial(m_local - 2, np.ones(groups) / groups)
                                for _ in range(devices)]).astype(np.int32))
  op = lambda x, k1, k2, s, sz: call("ffi", "swiglu")(x, k1, k2, sz, s)
  layer = compat.shard_map(lambda x, k1, k2, s, sz: op(x, k1, k2, s, sz[0]), mesh=mesh,
                           in_specs=(P("data"), P(), P(), P("data"), P("data")),
                           out_specs=P("data"))
  out = jax.jit(layer)(x, k1, k2, scales, sizes)
  rows = lambda a, d: a[d * m_local:(d + 1) * m_local]
  for d in range(devices):
    np.testing.assert_array_equal(
        np.asarray(rows(out, d), np.float32),
        np.asarray(jax.jit(op)(rows(x, d), k1, k2, rows(scales, d), sizes[d]), np.float32))
  loss = lambda f: lambda x, k1, k2, s, sz: jnp.sum(jnp.sin(f(x, k1, k2, s, sz)
                                                            .astype(jnp.float32)))
  grads = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2, 3)))(x, k1, k2, scales, sizes)
  # Each device alone, as inside shard_map (every axis manual): the FP8 wgrads.
  with columnwise.fused(everywhere=True):
    shard_grads = [jax.jit(jax.grad(loss(op), argnums=(0, 1, 2, 3)))(
        rows(x, d), k1, k2, rows(scales, d), sizes[d]) for d in range(devices)]
  for index, name in ((0, "dx"), (3, "dscales")):
    want = np.concatenate([np.asarray(g[index], np.float32) for g in shard_grads])
    np.testing.assert_array_equal(np.asarray(grads[index], np.float32), want, err_msg=name)
  for index, name in ((1, "dkernel1"), (2, "dkernel2")):
    want = sum(helpers.as_f64(g[index]) for g in shard_grads)
    helpers.assert_close(grads[index], want, jnp.bfloat16, msg=name)


@pytest.mark.parametrize("change, error, match", [
    (dict(recipe=jaxfuse.quantization.Float8BlockScaling(block_size=64)), ValueError,
     r"block_size must be 128, got 64"),
    (dict(recipe=jaxfuse.quantization.Float8BlockScaling(forward_format="e5m2")), ValueError,
     r"forward_format must be 'e4m3'"),
    (dict(x=(8, 24), k1=(2, 24, 32), k2=(2, 16, 24)), ValueError,
     r"H \(x.shape\[1\]\) to be a multiple of 16"),
    (dict(k1=(2, 16, 40), k2=(2, 20, 16)), ValueError,
     r"kernel1.shape\[2\] to be a multiple of 16"),
    (dict(k1=(2, 16, 48), k2=(2, 24, 16)), ValueError,
     r"F \(kernel2.shape\[1\]\) to be a multiple of 16"),
])
@pytest.mark.parametrize("implementation", ["ffi", "xla"])
def test_errors(change, error, match, implementation):
  with pytest.raises(error, match=match):
    call_with_changed_shapes(change, RECIPE, implementation)


def test_a_kernel_quantized_with_the_other_scaling_is_rejected():
  """A per-expert copy carries one scale per expert: it cannot feed the blockwise kernels
  (nor a tile-scaled copy the per-group ones), whatever recipe it claims."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  dtype = jnp.bfloat16
  x, k1, k2 = jnp.ones((8, 16), dtype), jnp.ones((2, 16, 32), dtype), jnp.ones((2, 16, 16), dtype)
  per_expert = jaxfuse.quantize_experts(k1, jaxfuse.quantization.Float8CurrentScaling())
  args = (jnp.ones((2,), jnp.int32), jnp.ones((8,), jnp.float32), "swiglu")
  with pytest.raises(ValueError, match="cannot run with recipe=Float8BlockScaling"):
    jaxfuse.grouped_mlp(x, per_expert, k2, *args, recipe=RECIPE)
  relabelled = dataclasses.replace(per_expert, recipe=RECIPE)
  with pytest.raises(TypeError, match=r"scaling_mode 'per_expert' cannot run with "
                                      r"recipe=Float8BlockScaling.*takes 'expert_block_2d'"):
    jaxfuse.grouped_mlp(x, relabelled, k2, *args, recipe=RECIPE)
  tiles = jaxfuse.quantize_experts(k2, RECIPE)
  with pytest.raises(TypeError, match=r"scaling_mode 'expert_block_2d' cannot run"):
    jaxfuse.grouped_mlp(x, k1, dataclasses.replace(
        tiles, recipe=jaxfuse.quantization.Float8CurrentScaling(per_group=True)), *args,
                        recipe=jaxfuse.quantization.Float8CurrentScaling(per_group=True))
