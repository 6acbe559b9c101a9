"""grouped_mlp with Float8CurrentScaling(per_group=True): FFI vs the FP8 reference,
accuracy of both against the 16-bit op, what runs (FP8 GEMMs, fused activation +
quantization), empty groups, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse._src.ops.quantize import columnwise as quantize_columnwise
from tests import helpers
from tests.ops.test_grouped_mlp import (ACTIVATIONS, ALPHA, BACKENDS, LIMIT, LINEAR_OFFSET,
                                        group_rows, make_inputs, on, sizes_cases)

RECIPE = jaxfuse.quantization.Float8CurrentScaling(per_group=True)
PROMOTED = jaxfuse.quantization.Float8CurrentScaling(per_group=True,
                                                     forward_fast_accumulation=False)
# The jnp reference ("xla") is checked on the CPU; on the GPU it would only add minutes
# of XLA compilation and autotuning of its float32 ragged_dot.
BACKEND_IMPLEMENTATIONS = [
    pytest.param("cpu", "ffi", id="cpu-ffi"),
    pytest.param("cpu", "xla", id="cpu-xla"),
    pytest.param("gpu", "ffi", id="gpu-ffi", marks=pytest.mark.gpu),
]


def relative_error(actual, expected) -> float:
  actual, expected = helpers.as_f64(actual), helpers.as_f64(expected)
  return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def shapes(backend):
  return (64, 32, 16) if backend == "cpu" else (1024, 512, 256)


def call(impl, activation, recipe=RECIPE, save_activation=False):
  return lambda x, k1, k2, sizes, scales: jaxfuse.grouped_mlp(
      x, k1, k2, sizes, scales, activation, recipe=recipe, implementation=impl, limit=LIMIT,
      alpha=ALPHA, linear_offset=LINEAR_OFFSET, save_activation=save_activation)


@pytest.mark.parametrize("recipe", [pytest.param(RECIPE, id="fast"),
                                    pytest.param(PROMOTED, id="promoted")])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", list(sizes_cases(64)))
def test_ffi_matches_the_fp8_reference(backend, activation, case, recipe):
  """Same quantization and FP8 products; h may differ by one bf16 rounding, which can move
  an activation across an FP8 rounding boundary, hence bf16-level (not bit) agreement.

  On the GPU, FC1's FP8 tensor cores accumulate with reduced precision (see
  test_grouped_linear_fp8.FP8_ACCUMULATION), so more activations cross an E4M3 rounding
  boundary than on the CPU; each crossing moves one FC2 input by one E4M3 step (2^-3 of
  it). The largest element error then reaches a few percent of the largest output (2-4%
  measured on the H200 at 97f44ec0) while the Frobenius error stays at the 1e-2 level.

  With fast accumulation (the default recipe) neither forward GEMM promotes to fp32: FC1's
  sums drift by up to k/32 truncations (test_grouped_linear_fp8.fast_accumulation_bound),
  and more activations cross a boundary. The H200 measured 2.1% Frobenius (swiglu, 5863d69;
  the largest element error stayed within 2^-4): the budget is 4e-2 there."""
  m, hidden, ffn = shapes(backend)
  sizes = sizes_cases(m)[case]
  x, k1, k2, scales = make_inputs(30, m, hidden, ffn, len(sizes), activation, jnp.bfloat16)
  x, k1, k2, scales, group_sizes = on(backend, x, k1, k2, scales,
                                      jnp.asarray(sizes, jnp.int32))
  out = jax.jit(call("ffi", activation, recipe))(x, k1, k2, group_sizes, scales)
  assert out.dtype == jnp.bfloat16 and out.shape == (m, hidden)
  expected = helpers.on_cpu(call("xla", activation, recipe), x, k1, k2, group_sizes, scales)
  scale = np.abs(helpers.as_f64(expected)).max()
  max_error = np.abs(helpers.as_f64(out) - helpers.as_f64(expected)).max() / scale
  assert max_error <= (helpers.rtol(jnp.bfloat16) if backend == "cpu" else 2.0 ** -4), case
  fast_on_gpu = backend == "gpu" and recipe.forward_fast_accumulation
  assert relative_error(out, expected) < (4e-2 if fast_on_gpu else 1e-2)
  covered = list(group_rows(sizes, m))[-1][2]
  assert not np.asarray(out[covered:], np.float32).any(), "rows past the groups must be zero"


def check_accuracy_against_the_bf16_op(fp8_call, backend, activation, shapes_, seed):
  """fp8_call(activation) against the bf16 op: forward within 10% relative (Frobenius),
  the four gradients within 20% and in the bf16 op's dtypes, exactly zero weight gradients
  for empty groups. `shapes_` (m, hidden, ffn) for the CPU; the GPU runs (2048, 1024, 512)."""
  m, hidden, ffn = shapes_ if backend == "cpu" else (2048, 1024, 512)
  sizes = sizes_cases(m)["empty_groups"]
  x, k1, k2, scales = make_inputs(seed, m, hidden, ffn, len(sizes), activation, jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(seed + 1), (m, hidden), jnp.bfloat16)
  x, k1, k2, scales, d_out, group_sizes = on(backend, x, k1, k2, scales, d_out,
                                             jnp.asarray(sizes, jnp.int32))
  fp8 = lambda *a: fp8_call(activation)(*a[:3], group_sizes, a[3])
  bf16 = lambda *a: call("xla", activation, recipe=None)(*a[:3], group_sizes, a[3])
  out, vjp = jax.vjp(fp8, x, k1, k2, scales)
  want, want_vjp = jax.vjp(bf16, x, k1, k2, scales)
  assert relative_error(out, want) < 0.10
  got_grads = jax.jit(vjp)(d_out)
  for name, got, expected in zip(("dx", "dkernel1", "dkernel2", "dscales"), got_grads,
                                 want_vjp(d_out)):
    assert got.dtype == expected.dtype, name
    assert relative_error(got, expected) < 0.2, name
  for g, start, end in group_rows(sizes, m):
    if start == end:  # empty groups: exactly zero weight gradients
      assert not np.asarray(got_grads[1][g], np.float32).any(), f"dkernel1[{g}]"
      assert not np.asarray(got_grads[2][g], np.float32).any(), f"dkernel2[{g}]"


@pytest.mark.parametrize("backend, implementation", BACKEND_IMPLEMENTATIONS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_accuracy_against_the_bf16_op(backend, implementation, activation):
  """Two chained FP8 GEMMs compound their errors: one E4M3 GEMM is ~3-5% relative
  (Frobenius, see test_grouped_linear_fp8), the MLP forward measures 6-7% on CPU shapes.
  dx goes through two E5M2-quantized gradients (dy, then dh) and two E4M3 weights; it
  measures up to ~14% (clamped_swiglu). The FP8 wgrads multiply an E4M3 input by an E5M2
  gradient. Budgets: 10% forward, 20% gradients."""
  check_accuracy_against_the_bf16_op(lambda act: call(implementation, act), backend,
                                     activation, (128, 64, 32), seed=31)


def check_save_activation_gives_identical_gradients(call_with, hidden, ffn, seed):
  """call_with(save_activation) gives bit-identical gradients either way."""
  x, k1, k2, scales = make_inputs(seed, 64, hidden, ffn, 4, "swiglu", jnp.bfloat16)
  sizes = jnp.asarray([16, 0, 30, 10], jnp.int32)
  grads = []
  for save in (False, True):
    loss = lambda *a, save=save: jnp.sum(jnp.sin(call_with(save)(
        *a[:3], sizes, a[3]).astype(jnp.float32)))
    grads.append(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, k1, k2, scales))
  for a, b in zip(*grads):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_save_activation_gives_identical_gradients():
  check_save_activation_gives_identical_gradients(
      lambda save: call("ffi", "swiglu", save_activation=save), 32, 16, seed=33)


@pytest.mark.parametrize("fused", [False, True], ids=["transposing_kernels", "fused_copies"])
@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_fp8_gemms_and_fused_quantization_run(fp8_wgrad, fused):
  x, k1, k2, scales = make_inputs(34, 32, 16, 16, 4, "swiglu", jnp.bfloat16)
  sizes = jnp.asarray([8, 0, 16, 8], jnp.int32)
  recipe = jaxfuse.quantization.Float8CurrentScaling(per_group=True, fp8_wgrad=fp8_wgrad)
  loss = lambda *a: jnp.sum(call("ffi", "swiglu", recipe)(*a[:3], sizes, a[3])
                            .astype(jnp.float32))
  with quantize_columnwise.fused(fused, everywhere=True):
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, k1, k2, scales)
  count = lambda predicate: helpers.count_primitives(jaxpr, predicate)
  name_is = lambda *names: lambda e: e.primitive.name in names
  assert count(helpers.ffi_target("jaxfuse_group_offsets")) == 1
  assert count(name_is("cumsum")) == 0
  # FC1 fwd, FC2 fwd, FC2 dgrad, FC1 dgrad in FP8; each in both platform branches of
  # platform_dependent. The two wgrads: FP8 from four column-wise copies (x, a, dy, dh),
  # by a transposing kernel each or written by their quantizing passes; or 16-bit.
  assert count(helpers.ffi_target("jaxfuse_grouped_gemm_fp8")) == 4 * 2
  assert count(helpers.ffi_target("jaxfuse_grouped_gemm_fp8_wgrad")) == 2 * 2 * fp8_wgrad
  assert count(helpers.ffi_target("jaxfuse_group_columnwise")) == 4 * fp8_wgrad * (not fused)
  assert count(helpers.ffi_target("jaxfuse_quantize")) == 2
  assert count(helpers.ffi_target("jaxfuse_grouped_gemm")) == 2 * 2 * (not fp8_wgrad)
  assert count(helpers.ffi_target("jaxfuse_scaled_activation_quantize")) == 1
  assert count(helpers.ffi_target("jaxfuse_scaled_dactivation_quantize")) == 1
  # With FP8 wgrads the activation is saved in FP8, never recomputed in 16-bit.
  assert count(helpers.ffi_target("jaxfuse_scaled_activation_fwd")) == (not fp8_wgrad)
  assert count(name_is("ragged_dot_general", "ragged_dot", "dot_general")) == 0


def test_untransposed_weights_only_when_a_backward_follows():
  """The FP8 dgrad reads each weight's FP8 values untransposed, written by the forward's
  quantization pass; a forward alone (inference) must not write them."""
  x, k1, k2, scales = make_inputs(35, 32, 16, 16, 4, "swiglu", jnp.bfloat16)
  sizes = jnp.asarray([8, 0, 16, 8], jnp.int32)
  forward = jax.make_jaxpr(lambda *a: call("ffi", "swiglu")(*a[:3], sizes, a[3]))(
      x, k1, k2, scales)
  assert helpers.untransposed_copy_sizes(forward) == [0, 0]  # one call per weight
  loss = lambda *a: jnp.sum(call("ffi", "swiglu")(*a[:3], sizes, a[3]).astype(jnp.float32))
  training = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, k1, k2, scales)
  assert sorted(helpers.untransposed_copy_sizes(training)) == sorted([k1.size, k2.size])


@pytest.mark.parametrize("change, match", [
    (dict(recipe=jaxfuse.quantization.Float8CurrentScaling(per_group=False)),
     r"supports recipe=Float8CurrentScaling\(per_group=True\)"),
    (dict(recipe=jaxfuse.quantization.MXFP8BlockScaling()),
     r"supports recipe=Float8CurrentScaling\(per_group=True\)"),
    (dict(x=(8, 24), k1=(2, 24, 32), k2=(2, 16, 24)), r"H \(x.shape\[1\]\) to be a multiple of 16"),
    (dict(k1=(2, 16, 40), k2=(2, 20, 16)), r"kernel1.shape\[2\] to be a multiple of 16"),
    (dict(k1=(2, 16, 48), k2=(2, 24, 16)), r"F \(kernel2.shape\[1\]\) to be a multiple of 16"),
])
@pytest.mark.parametrize("implementation", ["ffi", "xla"])
def test_errors(change, match, implementation):
  with pytest.raises(ValueError, match=match):
    call_with_changed_shapes(change, RECIPE, implementation)


def call_with_changed_shapes(change, default_recipe, implementation):
  """grouped_mlp on x [8, 16], kernel1 [2, 16, 32], kernel2 [2, 16, 16] (bf16, swiglu) with
  the shapes and recipe of `change` swapped in: the error tests' call."""
  shapes_ = dict(x=(8, 16), k1=(2, 16, 32), k2=(2, 16, 16))
  shapes_.update({k: v for k, v in change.items() if k in shapes_})
  dtype = jnp.bfloat16
  return jaxfuse.grouped_mlp(jnp.ones(shapes_["x"], dtype), jnp.ones(shapes_["k1"], dtype),
                             jnp.ones(shapes_["k2"], dtype), jnp.ones((2,), jnp.int32),
                             jnp.ones((8,), jnp.float32), "swiglu",
                             recipe=change.get("recipe", default_recipe),
                             implementation=implementation)


def test_fp8_wgrad_group_limit():
  """FP8 weight gradients take at most 4096 groups (grouped_linear's limit, checked up
  front); the xla reference has no such limit."""
  groups, dtype = 4097, jnp.bfloat16
  args = (jnp.ones((8, 16), dtype), jnp.ones((groups, 16, 32), dtype),
          jnp.ones((groups, 16, 16), dtype), jnp.zeros((groups,), jnp.int32),
          jnp.ones((8,), jnp.float32))
  with pytest.raises(ValueError, match="at most 4096 groups, got 4097"):
    jaxfuse.grouped_mlp(*args, "swiglu", recipe=RECIPE, implementation="ffi")
  jax.eval_shape(lambda *a: jaxfuse.grouped_mlp(*a, "swiglu", recipe=RECIPE,
                                                implementation="xla"), *args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", ["uniform", "empty_groups", "sum_less_than_rows",
                                  "negative_sizes"])
def test_fused_columnwise_copies_give_identical_gradients(backend, activation, case):
  """The wgrads on the copies that the quantizing passes wrote (x, the activation, dy, and
  dh from the dact kernel) against the transposing kernels' copies: bit-identical."""
  m, hidden, ffn = (64, 32, 16) if backend == "cpu" else (1000, 272, 144)
  sizes = sizes_cases(m)[case]
  x, k1, k2, scales = make_inputs(62, m, hidden, ffn, len(sizes), activation, jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(63), (m, hidden), jnp.bfloat16)
  group_sizes = jnp.asarray(sizes, jnp.int32)
  args = on(backend, x, k1, k2, scales, d_out, group_sizes)
  x, k1, k2, scales, d_out, group_sizes = args
  results = []
  for fused in (False, True):
    with quantize_columnwise.fused(fused, everywhere=True):
      out, vjp = jax.vjp(lambda x, k1, k2, s: call("ffi", activation)(x, k1, k2, group_sizes, s),
                         x, k1, k2, scales)
      results.append((out, *vjp(d_out)))
  names = ("out", "dx", "dkernel1", "dkernel2", "dscales")
  for name, unfused, fused in zip(names, *results):
    np.testing.assert_array_equal(np.asarray(fused, np.float32),
                                  np.asarray(unfused, np.float32), err_msg=name)
  for name, grad in zip(names[2:4], results[0][2:4]):
    assert np.abs(np.asarray(grad, np.float32)).max() > 0, name
