"""jaxfuse.quantize_experts: FP8 expert weights quantized once, and grouped_linear /
grouped_mlp taking them as kernels (same values as quantizing the 16-bit kernel in the
call; no weight gradient, or with trainable=True the 16-bit kernel's, through its master),
against float64 numpy; errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxfuse
from tests import helpers
from tests.ops import test_grouped_linear as linear_tests
from tests.ops import test_grouped_mlp as mlp_tests
from tests.ops.test_grouped_linear_fp8 import BACKEND_IMPLEMENTATIONS, PROMOTED, RECIPE

E4M3_MAX = 448.0
# E4M3 keeps 3 mantissa bits: rounding to nearest errs by at most 2^-4 of a normal value;
# below the smallest normal (2^-6) the step is the subnormal spacing 2^-9, in scaled units.
E4M3_RELATIVE = 2.0 ** -4
E4M3_SUBNORMAL_STEP = 2.0 ** -9


def numpy_quantize_experts(kernel):
  """(data [G, N, K] as float64, scale_inv [G]) in float64: amax per expert, scale =
  448 / amax (1 for an all-zero expert), the transposed kernel times scale rounded to E4M3."""
  w = helpers.as_f64(kernel)
  amax = np.abs(w).max(axis=(1, 2))
  scale = np.where(amax > 0, E4M3_MAX / np.where(amax > 0, amax, 1.0), 1.0)
  scaled = np.swapaxes(w, 1, 2) * scale[:, None, None]
  data = scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
  return data, 1.0 / scale, scaled


@pytest.mark.parametrize("backend, implementation", BACKEND_IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_quantize_experts_matches_float64_numpy(backend, implementation, dtype):
  if implementation == "ffi" and backend == "gpu" and dtype == jnp.float32:
    pytest.skip("covered on the CPU; the GPU case runs bf16")
  rng = np.random.default_rng(5)
  groups, k, n = 5, 48, 80
  kernel = helpers.random_array(rng, (groups, k, n), dtype, scale=0.05)
  kernel = kernel.at[1].set(0)          # an all-zero expert: scale 1, no inf or NaN
  kernel = kernel.at[3].multiply(300)   # experts of very different magnitudes
  (kernel,) = linear_tests.on(backend, kernel)
  q = jax.jit(lambda w: jaxfuse.quantize_experts(w, RECIPE, implementation=implementation))(
      kernel)
  assert q.scaling_mode == "per_expert" and q.dtype == jnp.dtype(dtype)
  assert q.data.dtype == jnp.float8_e4m3fn and q.data.shape == (groups, n, k)
  assert q.scale_inv.dtype == jnp.float32 and q.scale_inv.shape == (groups,)
  expected_data, expected_scale_inv, scaled = numpy_quantize_experts(kernel)
  np.testing.assert_allclose(helpers.as_f64(q.scale_inv), expected_scale_inv, rtol=1e-6)
  assert float(q.scale_inv[1]) == 1.0
  data = helpers.as_f64(q.data)
  # One E4M3 rounding of the scaled value (the kernel's scale is fp32, numpy's float64:
  # a value on a rounding boundary may go either way, so compare against the bound).
  bound = np.maximum(E4M3_RELATIVE * np.abs(scaled), E4M3_SUBNORMAL_STEP)
  assert (np.abs(data - scaled) <= bound).all()
  assert np.mean(data == expected_data) > 0.99  # boundary cases are rare
  assert np.abs(data).max() == E4M3_MAX  # every non-zero expert's amax maps to 448
  # dequantize restores [G, K, N] within the same bound, in the kernel's dtype.
  restored = jaxfuse.dequantize(q)
  assert restored.shape == kernel.shape and restored.dtype == jnp.dtype(dtype)
  w = helpers.as_f64(kernel)
  restored_bound = np.swapaxes(bound, 1, 2) * expected_scale_inv[:, None, None]
  slack = 2.0 ** -8 * np.abs(w) if dtype == jnp.bfloat16 else 0.0  # bf16 rounding of the result
  assert (np.abs(helpers.as_f64(restored) - w) <= restored_bound + slack + 1e-30).all()


def _linear_case(backend, case, seed):
  """(x, kernel, dy, group_sizes on `backend`, the sizes as a list) of a grouped_linear
  case of linear_tests.sizes_cases: small on the CPU, 1024 rows on the GPU."""
  m, k, n = (96, 32, 48) if backend == "cpu" else (1024, 256, 384)
  sizes = linear_tests.sizes_cases(m)[case]
  x, kernel = linear_tests.make_inputs(seed, m, k, n, len(sizes), jnp.bfloat16)
  dy = helpers.random_array(np.random.default_rng(seed + 1), (m, n), jnp.bfloat16)
  return (*linear_tests.on(backend, x, kernel, dy, jnp.asarray(sizes, jnp.int32)), sizes)


@pytest.mark.parametrize("backend, implementation", BACKEND_IMPLEMENTATIONS)
@pytest.mark.parametrize("recipe", [pytest.param(RECIPE, id="fast"),
                                    pytest.param(PROMOTED, id="promoted")])
@pytest.mark.parametrize("case", ["uniform", "empty_groups", "sum_less_than_rows",
                                  "many_groups"])
def test_grouped_linear_quantized_kernel_is_the_quantized_16bit_kernel(
    backend, implementation, recipe, case):
  """The quantized kernel's FP8 values are the ones the call would compute from the 16-bit
  kernel, so the result and dx must be bit-identical; the kernel gets no gradient."""
  x, kernel, dy, group_sizes, sizes = _linear_case(backend, case, 7)
  q = jaxfuse.quantize_experts(kernel, recipe, implementation=implementation)

  def loss(x, w, recipe_):
    out = jaxfuse.grouped_linear(x, w, group_sizes, recipe=recipe_,
                                 implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)), out

  grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
  (dx_16, dw_16), out_16 = grad(x, kernel, recipe)
  (dx_q, dw_q), out_q = grad(x, q, None)  # recipe=None: the kernel's own
  np.testing.assert_array_equal(np.asarray(out_q, np.float32), np.asarray(out_16, np.float32))
  np.testing.assert_array_equal(np.asarray(dx_q, np.float32), np.asarray(dx_16, np.float32))
  assert not np.asarray(dw_q.data, np.float32).any() and not np.asarray(dw_q.scale_inv).any()
  assert np.abs(np.asarray(dw_16, np.float32)).max() > 0  # the 16-bit kernel's gradient
  # And the result is the FP8 product of the dequantized operands (float64 numpy).
  x_q = jaxfuse.quantize(x, recipe, group_sizes=group_sizes)
  expected = linear_tests.numpy_grouped_linear(
      helpers.as_f64(jaxfuse.dequantize(x_q).astype(jnp.float32)),
      helpers.as_f64(jaxfuse.dequantize(q).astype(jnp.float32)), sizes)
  scale = np.abs(expected).max()
  assert np.abs(helpers.as_f64(out_q) - expected).max() <= 2e-2 * scale


def _mlp_case(backend, seed):
  """(x, kernel1, kernel2, scales, dy, group_sizes) of a SwiGLU grouped MLP with an empty
  group, on `backend`: small on the CPU, 1024 rows on the GPU."""
  m, hidden, ffn = (64, 32, 16) if backend == "cpu" else (1024, 512, 256)
  sizes = mlp_tests.sizes_cases(m)["empty_groups"]
  x, k1, k2, scales = mlp_tests.make_inputs(seed, m, hidden, ffn, len(sizes), "swiglu",
                                            jnp.bfloat16)
  dy = helpers.random_array(np.random.default_rng(seed + 1), (m, hidden), jnp.bfloat16)
  return mlp_tests.on(backend, x, k1, k2, scales, dy, jnp.asarray(sizes, jnp.int32))


@pytest.mark.parametrize("backend, implementation", BACKEND_IMPLEMENTATIONS)
@pytest.mark.parametrize("quantized", ["both", "kernel1", "kernel2"])
def test_grouped_mlp_quantized_kernels_are_the_quantized_16bit_kernels(
    backend, implementation, quantized):
  x, k1, k2, scales, dy, group_sizes = _mlp_case(backend, 11)
  q1 = jaxfuse.quantize_experts(k1, RECIPE, implementation=implementation)
  q2 = jaxfuse.quantize_experts(k2, RECIPE, implementation=implementation)
  a1 = q1 if quantized in ("both", "kernel1") else k1
  a2 = q2 if quantized in ("both", "kernel2") else k2

  def loss(x, scales, w1, w2):
    out = jaxfuse.grouped_mlp(x, w1, w2, group_sizes, scales, recipe=RECIPE,
                              implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)), out

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
  (dx_16, ds_16, dk1_16, dk2_16), out_16 = grad(x, scales, k1, k2)
  (dx_q, ds_q, dk1_q, dk2_q), out_q = grad(x, scales, a1, a2)
  for actual, expected in ((out_q, out_16), (dx_q, dx_16), (ds_q, ds_16)):
    np.testing.assert_array_equal(np.asarray(actual, np.float32),
                                  np.asarray(expected, np.float32))
  for given, d_q, d_16 in ((a1, dk1_q, dk1_16), (a2, dk2_q, dk2_16)):
    if isinstance(given, jaxfuse.quantization.QuantizedArray):
      assert not np.asarray(d_q.data, np.float32).any()
    else:  # a 16-bit kernel beside a quantized one keeps its exact gradient
      np.testing.assert_array_equal(np.asarray(d_q, np.float32), np.asarray(d_16, np.float32))


# --- trainable copies: quantized once, the gradient through their master ---------------

FP8_16BIT_WGRAD = jaxfuse.quantization.Float8CurrentScaling(per_group=True, fp8_wgrad=False)


@pytest.mark.parametrize("backend, implementation", BACKEND_IMPLEMENTATIONS)
def test_trainable_copy_holds_the_kernel_and_both_layouts(backend, implementation):
  (kernel,) = linear_tests.on(backend, _kernel())
  q = jax.jit(lambda w: jaxfuse.quantize_experts(w, RECIPE, trainable=True,
                                                 implementation=implementation))(kernel)
  frozen = jaxfuse.quantize_experts(kernel, RECIPE, implementation=implementation)
  same_bits = lambda a, b: np.testing.assert_array_equal(  # noqa: E731
      np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)),
      np.asarray(jax.lax.bitcast_convert_type(b, jnp.uint8)))
  same_bits(q.data, frozen.data)
  same_bits(q.data_untransposed, jnp.swapaxes(frozen.data, 1, 2))
  np.testing.assert_array_equal(np.asarray(q.scale_inv), np.asarray(frozen.scale_inv))
  np.testing.assert_array_equal(np.asarray(q.master, np.float32), np.asarray(kernel, np.float32))
  assert frozen.master is None and frozen.data_untransposed is None


@pytest.mark.parametrize("backend, implementation", BACKEND_IMPLEMENTATIONS)
@pytest.mark.parametrize("recipe", [pytest.param(RECIPE, id="fp8_wgrad"),
                                    pytest.param(FP8_16BIT_WGRAD, id="16bit_wgrad")])
@pytest.mark.parametrize("case", ["uniform", "empty_groups", "sum_less_than_rows"])
def test_grouped_linear_trains_a_trainable_copy_like_the_16bit_kernel(
    backend, implementation, recipe, case):
  """Quantizing in the call or once with trainable=True gives the same FP8 values and the
  same backward, so output, dx and the kernel's gradient are bit-identical."""
  x, kernel, dy, group_sizes, _ = _linear_case(backend, case, 17)

  def loss(x, kernel, trainable):
    w = (jaxfuse.quantize_experts(kernel, recipe, trainable=True,
                                  implementation=implementation) if trainable else kernel)
    out = jaxfuse.grouped_linear(x, w, group_sizes, recipe=recipe,
                                 implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)), out

  grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
  (dx_16, dw_16), out_16 = grad(x, kernel, False)
  (dx_q, dw_q), out_q = grad(x, kernel, True)
  for actual, expected in ((out_q, out_16), (dx_q, dx_16), (dw_q, dw_16)):
    np.testing.assert_array_equal(np.asarray(actual, np.float32),
                                  np.asarray(expected, np.float32))
  assert np.abs(np.asarray(dw_q, np.float32)).max() > 0


@pytest.mark.parametrize("backend, implementation", BACKEND_IMPLEMENTATIONS)
@pytest.mark.parametrize("trainable", ["both", "kernel1", "kernel2"])
def test_grouped_mlp_trains_trainable_copies_like_the_16bit_kernels(
    backend, implementation, trainable):
  x, k1, k2, scales, dy, group_sizes = _mlp_case(backend, 19)
  copy = lambda k: jaxfuse.quantize_experts(k, RECIPE, trainable=True,  # noqa: E731
                                            implementation=implementation)

  def loss(x, scales, k1, k2, which):
    w1 = copy(k1) if which in ("both", "kernel1") else k1
    w2 = copy(k2) if which in ("both", "kernel2") else k2
    out = jaxfuse.grouped_mlp(x, w1, w2, group_sizes, scales, recipe=RECIPE,
                              implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)), out

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True), static_argnums=4)
  grads_16, out_16 = grad(x, scales, k1, k2, "none")
  grads_q, out_q = grad(x, scales, k1, k2, trainable)
  for actual, expected in zip((out_q, *grads_q), (out_16, *grads_16)):
    np.testing.assert_array_equal(np.asarray(actual, np.float32),
                                  np.asarray(expected, np.float32))
  assert all(np.abs(np.asarray(g, np.float32)).max() > 0 for g in grads_q[2:])


def _scan_bodies(jaxpr):
  """The body jaxprs of every scan in a (closed) jaxpr, nested ones included."""
  return [eqn.params["jaxpr"] for eqn in helpers.equations(jaxpr) if eqn.primitive.name == "scan"]


@pytest.mark.parametrize("implementation", ["ffi", "xla"])
def test_gradient_accumulation_quantizes_the_weights_once(implementation):
  """Gradient accumulation over three micro-batches, each taking its own gradient inside a
  lax.scan: on one trainable copy made before the loop, the gradients gathered at its
  master equal quantizing the 16-bit kernel in every micro-batch, and the loop body runs
  no weight quantization (the 16-bit path's does, once per micro-batch)."""
  micro, m, k, n, groups = 3, 64, 32, 48, 4
  rng = np.random.default_rng(23)
  xs = helpers.random_array(rng, (micro, m, k), jnp.bfloat16)
  dys = helpers.random_array(rng, (micro, m, n), jnp.bfloat16)
  kernel = helpers.random_array(rng, (groups, k, n), jnp.bfloat16, scale=k**-0.5)
  sizes = jnp.asarray([20, 0, 30, 14], jnp.int32)

  def micro_loss(w, x, dy):
    out = jaxfuse.grouped_linear(x, w, sizes, recipe=RECIPE, implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32))

  def accumulated_gradient(kernel, trainable):
    w = (jaxfuse.quantize_experts(kernel, RECIPE, trainable=True,
                                  implementation=implementation) if trainable else kernel)

    def micro_batch(total, batch):
      g = jax.grad(micro_loss)(w, *batch)
      return total + (g.master if trainable else g).astype(jnp.float32), None

    return jax.lax.scan(micro_batch, jnp.zeros(kernel.shape, jnp.float32), (xs, dys))[0]

  run = jax.jit(accumulated_gradient, static_argnums=1)
  np.testing.assert_array_equal(np.asarray(run(kernel, True)), np.asarray(run(kernel, False)))
  assert np.abs(np.asarray(run(kernel, True))).max() > 0
  if implementation == "ffi":
    weight_passes = lambda trainable: [  # noqa: E731
        helpers.count_primitives(body, helpers.ffi_target("jaxfuse_quantize_batches_transposed"))
        for body in _scan_bodies(jax.make_jaxpr(accumulated_gradient, static_argnums=1)(
            kernel, trainable))]
    assert weight_passes(True) == [0]
    assert weight_passes(False)[0] > 0


def test_trainable_copy_with_a_foreign_master_is_rejected():
  q = jaxfuse.quantize_experts(_kernel(), RECIPE, trainable=True)
  x, sizes = jnp.ones((8, 32), jnp.bfloat16), jnp.array([2, 2, 2, 2], jnp.int32)
  with pytest.raises(ValueError, match=r"master must have shape \(4, 32, 48\)"):
    jaxfuse.grouped_linear(x, dataclasses.replace(q, master=q.master[:, :16]), sizes)
  with pytest.raises(TypeError, match="master must have its dtype bfloat16"):
    jaxfuse.grouped_linear(x, dataclasses.replace(q, master=q.master.astype(jnp.float32)),
                           sizes)


def _kernel():
  return helpers.random_array(np.random.default_rng(3), (4, 32, 48), jnp.bfloat16)


@pytest.mark.parametrize("call, error, match", [
    pytest.param(lambda: jaxfuse.quantize_experts(
        _kernel(), jaxfuse.quantization.MXFP8BlockScaling()), TypeError,
        "Float8CurrentScaling.*or Float8BlockScaling", id="mxfp8-recipe"),
    pytest.param(lambda: jaxfuse.quantize_experts(
        _kernel(), jaxfuse.quantization.Float8CurrentScaling(forward_format="e5m2")),
        ValueError, "forward_format", id="e5m2-weights"),
    pytest.param(lambda: jaxfuse.quantize_experts(_kernel()[0], RECIPE), ValueError,
                 "rank", id="rank-2-kernel"),
    pytest.param(lambda: jaxfuse.quantize_experts(_kernel().astype(jnp.int32), RECIPE),
                 TypeError, "kernel must have dtype", id="int-kernel"),
    pytest.param(lambda: jaxfuse.grouped_linear(
        jnp.ones((8, 32), jnp.bfloat16), jaxfuse.quantize_experts(_kernel(), RECIPE),
        jnp.array([2, 2, 2, 2], jnp.int32), recipe=PROMOTED), ValueError,
        "cannot run with recipe", id="other-recipe"),
    pytest.param(lambda: jaxfuse.grouped_linear(
        jnp.ones((8, 16), jnp.bfloat16), jaxfuse.quantize_experts(_kernel(), RECIPE),
        jnp.array([2, 2, 2, 2], jnp.int32)), ValueError, "must equal kernel.shape",
        id="k-mismatch"),
    pytest.param(lambda: jaxfuse.grouped_linear(
        jnp.ones((8, 32), jnp.bfloat16),
        jaxfuse.quantize(_kernel(), RECIPE, group_sizes=jnp.array([64, 64], jnp.int32)),
        jnp.array([2, 2, 2, 2], jnp.int32), recipe=RECIPE), TypeError, "quantize_experts",
        id="rows-quantized-kernel"),
    pytest.param(lambda: jaxfuse.grouped_mlp(
        jnp.ones((8, 32), jnp.bfloat16), jaxfuse.quantize_experts(_kernel(), RECIPE),
        jnp.ones((4, 24, 32), jnp.float32), jnp.array([2, 2, 2, 2], jnp.int32),
        jnp.ones((8,), jnp.float32)), TypeError, "kernel2 dtype", id="mlp-mixed-dtypes"),
])
@pytest.mark.parametrize("implementation", ["ffi", "xla"])
def test_errors(call, error, match, implementation, monkeypatch):
  monkeypatch.setenv("JAXFUSE_IMPLEMENTATION", implementation)
  with pytest.raises(error, match=match):
    call()


def _moe_case(backend, seed):
  """(x, router, kernel1, kernel2, dy) of a small top-2 SwiGLU MoE layer on `backend`."""
  tokens, hidden, ffn, experts = (48, 32, 16, 4) if backend == "cpu" else (512, 256, 128, 8)
  rng = np.random.default_rng(seed)
  x = helpers.random_array(rng, (tokens, hidden), jnp.bfloat16)
  router = helpers.random_array(rng, (hidden, experts), jnp.float32, scale=0.5)
  k1 = helpers.random_array(rng, (experts, hidden, 2 * ffn), jnp.bfloat16, scale=hidden**-0.5)
  k2 = helpers.random_array(rng, (experts, ffn, hidden), jnp.bfloat16, scale=ffn**-0.5)
  dy = helpers.random_array(rng, (tokens, hidden), jnp.bfloat16)
  return linear_tests.on(backend, x, router, k1, k2, dy)


@pytest.mark.parametrize("backend, implementation", BACKEND_IMPLEMENTATIONS)
def test_moe_quantized_experts_are_the_quantized_16bit_experts(backend, implementation):
  """jaxfuse.moe hands quantized expert kernels to grouped_mlp: the same output and x,
  router gradients as from the 16-bit kernels under the same recipe, none for the experts."""
  x, router, k1, k2, dy = _moe_case(backend, 21)
  q1, q2 = (jaxfuse.quantize_experts(k, RECIPE, implementation=implementation)
            for k in (k1, k2))

  def loss(x, router, w1, w2):
    out, aux = jaxfuse.moe(x, router, w1, w2, top_k=2, recipe=RECIPE,
                           implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)) + aux, out

  grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
  (dx_16, dr_16), out_16 = grad(x, router, k1, k2)
  (dx_q, dr_q), out_q = grad(x, router, q1, q2)
  for actual, expected in ((out_q, out_16), (dx_q, dx_16), (dr_q, dr_16)):
    np.testing.assert_array_equal(np.asarray(actual, np.float32),
                                  np.asarray(expected, np.float32))
  assert np.abs(np.asarray(out_q, np.float32)).max() > 0


@pytest.mark.parametrize("backend, implementation", BACKEND_IMPLEMENTATIONS)
def test_moe_trains_trainable_expert_copies_like_the_16bit_experts(backend, implementation):
  """jaxfuse.moe on trainable copies made inside the loss: every gradient (x, router, both
  expert kernels) equals the 16-bit experts' under the same recipe."""
  x, router, k1, k2, dy = _moe_case(backend, 31)

  def loss(x, router, k1, k2, trainable):
    if trainable:
      k1, k2 = (jaxfuse.quantize_experts(k, RECIPE, trainable=True,
                                         implementation=implementation) for k in (k1, k2))
    out, aux = jaxfuse.moe(x, router, k1, k2, top_k=2, recipe=RECIPE,
                           implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)) + aux

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)), static_argnums=4)
  for actual, expected in zip(grad(x, router, k1, k2, True), grad(x, router, k1, k2, False)):
    np.testing.assert_array_equal(np.asarray(actual, np.float32),
                                  np.asarray(expected, np.float32))
    assert np.abs(np.asarray(actual, np.float32)).max() > 0


def test_grouped_mlp_16bit_wgrad_recipe_on_quantized_kernels():
  """recipe.fp8_wgrad=False with quantized kernels: no weight gradient is computed (the
  16-bit wgrads' inputs are not kept), dx and dscales equal the 16-bit kernels' path."""
  recipe = jaxfuse.quantization.Float8CurrentScaling(per_group=True, fp8_wgrad=False)
  m, hidden, ffn = 64, 32, 16
  sizes = mlp_tests.sizes_cases(m)["uniform"]
  x, k1, k2, scales = mlp_tests.make_inputs(13, m, hidden, ffn, len(sizes), "swiglu",
                                            jnp.bfloat16)
  group_sizes = jnp.asarray(sizes, jnp.int32)
  q1, q2 = (jaxfuse.quantize_experts(k, recipe, implementation="ffi") for k in (k1, k2))

  def loss(x, scales, w1, w2):
    out = jaxfuse.grouped_mlp(x, w1, w2, group_sizes, scales, recipe=recipe,
                              implementation="ffi")
    return jnp.sum(out.astype(jnp.float32) ** 2)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  for actual, expected in zip(grad(x, scales, q1, q2), grad(x, scales, k1, k2)):
    np.testing.assert_array_equal(np.asarray(actual, np.float32),
                                  np.asarray(expected, np.float32))
  def gemm_targets(w1, w2):
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, scales, w1, w2)
    return tuple(helpers.count_primitives(jaxpr, helpers.ffi_target(name))
                 for name in ("jaxfuse_grouped_gemm", "jaxfuse_grouped_gemm_fp8",
                              "jaxfuse_grouped_gemm_fp8_wgrad"))

  assert gemm_targets(k1, k2)[0] > 0  # the 16-bit kernels' path runs 16-bit wgrads
  plain, fp8, fp8_wgrad = gemm_targets(q1, q2)
  assert plain == 0 and fp8_wgrad == 0 and fp8 > 0
