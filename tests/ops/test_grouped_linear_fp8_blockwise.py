"""grouped_linear with Float8BlockScaling (DeepSeek-V3's recipe: x in 1 x 128 blocks along
K, the kernel in 128 x 128 tiles): the blockwise FP8 grouped GEMM handlers (CPU, CUDA)
against float64 numpy on the same FP8 values, forward and dgrad in both gradient formats,
partial blocks, outlier blocks, gradients, empty groups, CUDA graphs, errors."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse._src import ffi as ffi_registry
from jaxfuse._src.ops.grouped_linear import ffi as gemm_ffi
from tests import helpers
from tests.ops.test_grouped_linear import (BACKENDS, make_inputs, numpy_grouped_grads, on,
                                           sizes_cases)
from tests.ops.test_grouped_linear_fp8 import (FP8_ACCUMULATION, assert_bf16_close,
                                               assert_within_accumulation_bound,
                                               check_shard_map_tokens_sharded, group_rows,
                                               random_fp8, relative_error)

RECIPE = jaxfuse.quantization.Float8BlockScaling()
E5M2_GRADIENTS = jaxfuse.quantization.Float8BlockScaling(gradient_format="e5m2")
BLOCK = 128
CASES = ["uniform", "one_group", "empty_groups", "sum_less_than_rows", "sum_more_than_rows",
         "negative_sizes", "skewed", "many_groups", "groups_32_negative"]


def shapes(backend):
  # K and N not multiples of 128 (a partial last block of the contraction and of the output
  # tiles), K != N so that a swapped operand or scale layout cannot pass.
  return (96, 160, 144) if backend == "cpu" else (1000, 400, 272)


def blocks(size: int) -> int:
  return -(-size // BLOCK)


def numpy_blockwise(a, a_scale, b, b_scale, sizes):
  """(exact, abs_sum) float64 [m, cols]: out[r, j] = sum_i a[r, i] * b[g, j, i] *
  a_scale[r, i // 128] * b_scale[g, j // 128, i // 128] per group, and the same sum of
  |products|. a [m, inner] FP8, b [G, cols, inner] FP8 (the K-major operand)."""
  a64, b64 = helpers.as_f64(a), helpers.as_f64(b)
  a_s, b_s = helpers.as_f64(a_scale), helpers.as_f64(b_scale)
  m, inner = a64.shape
  cols = b64.shape[1]
  a_dq = a64 * np.repeat(a_s, BLOCK, axis=1)[:, :inner]
  exact, abs_sum = np.zeros((m, cols)), np.zeros((m, cols))
  for g, (start, end) in enumerate(group_rows(sizes, m)):
    tile = np.repeat(np.repeat(b_s[g], BLOCK, axis=0), BLOCK, axis=1)[:cols, :inner]
    b_dq = b64[g] * tile
    exact[start:end] = a_dq[start:end] @ b_dq.T
    abs_sum[start:end] = np.abs(a_dq[start:end]) @ np.abs(b_dq).T
  return exact, abs_sum


def quantized_operands(x, kernel):
  """The FP8 operands of the forward GEMM from jaxfuse.quantize (tested on its own in
  test_quantize.py): x [m, k] with [m, k/128] scales, w^T [G, n, k] with [G, n/128, k/128]."""
  q_x = helpers.on_cpu(lambda x: jaxfuse.quantize(x, RECIPE, implementation="xla"), x)
  q_w = helpers.on_cpu(lambda w: jaxfuse.quantize(w, RECIPE, kind="weight",
                                                  implementation="xla"), kernel)
  return (q_x.data, q_x.scale_inv, jnp.swapaxes(q_w.data, 1, 2),
          jnp.swapaxes(q_w.scale_inv, 1, 2))


def blockwise_linear(implementation, recipe=RECIPE):
  return lambda x, w, s: jaxfuse.grouped_linear(x, w, s, recipe=recipe,
                                                implementation=implementation)


@pytest.mark.parametrize("case", ["uniform", "empty_groups", "sum_less_than_rows", "skewed"])
def test_reference_matches_float64_numpy_on_the_same_fp8_values(case):
  m, k, n = 64, 160, 144
  sizes = sizes_cases(m)[case]
  x, kernel = make_inputs(70, m, k, n, len(sizes), jnp.bfloat16)
  group_sizes = jnp.asarray(sizes, jnp.int32)
  out = jax.jit(blockwise_linear("xla"))(x, kernel, group_sizes)
  assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
  x_q, x_s, w_t, w_t_s = quantized_operands(x, kernel)
  exact, _ = numpy_blockwise(x_q, x_s, w_t, w_t_s, sizes)
  assert_bf16_close(out, exact, case)
  # One scale per 128 x 128 tile of each expert: its largest |w| maps to the E4M3 maximum.
  k64 = np.abs(helpers.as_f64(kernel))
  for g in range(len(sizes)):
    for kb in range(blocks(k)):
      for nb in range(blocks(n)):
        amax = k64[g, kb * BLOCK:(kb + 1) * BLOCK, nb * BLOCK:(nb + 1) * BLOCK].max()
        np.testing.assert_allclose(float(w_t_s[g, nb, kb]), amax / 448.0, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_float64_numpy(backend, case):
  m, k, n = shapes(backend)
  sizes = sizes_cases(m)[case]
  x, kernel = make_inputs(71, m, k, n, len(sizes), jnp.bfloat16)
  x, kernel, group_sizes = on(backend, x, kernel, jnp.asarray(sizes, jnp.int32))
  out = jax.jit(blockwise_linear("ffi"))(x, kernel, group_sizes)
  assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
  exact, abs_sum = numpy_blockwise(*quantized_operands(x, kernel), sizes)
  assert_within_accumulation_bound(out, exact, abs_sum, case, FP8_ACCUMULATION)
  covered = group_rows(sizes, m)[-1][1]
  assert not np.asarray(out[covered:], np.float32).any(), "rows past the groups must be zero"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form, dy_dtype", [
    pytest.param("forward", jnp.float8_e4m3fn, id="forward"),
    pytest.param("dgrad", jnp.float8_e4m3fn, id="dgrad-e4m3"),
    pytest.param("dgrad", jnp.float8_e5m2, id="dgrad-e5m2"),
])
def test_handler_matches_float64_numpy(backend, form, dy_dtype):
  """The handler alone on random FP8 codes and random positive scales of every block (no
  quantizer in the loop): a scale read from the wrong row, block or tile fails it."""
  m, k, n = shapes(backend)
  sizes = [m // 3, 0, m // 2 - 5, 7]  # an empty group, rows past the groups
  groups = len(sizes)
  cols, inner = (n, k) if form == "forward" else (k, n)
  rng = np.random.default_rng(72)
  a = random_fp8(73, (m, inner), dy_dtype if form == "dgrad" else jnp.float8_e4m3fn)
  b = random_fp8(74, (groups, cols, inner), jnp.float8_e4m3fn)
  a_scale = jnp.asarray(rng.uniform(0.01, 1.0, (m, blocks(inner))), jnp.float32)
  b_scale = jnp.asarray(rng.uniform(0.01, 1.0, (groups, blocks(cols), blocks(inner))),
                        jnp.float32)
  offsets = jaxfuse.group_offsets(jnp.asarray(sizes, jnp.int32))
  gemm_form = gemm_ffi.FORWARD if form == "forward" else gemm_ffi.DGRAD
  args = on(backend, a, b, offsets, a_scale, b_scale)
  out = jax.jit(lambda *t: gemm_ffi.grouped_gemm_blockwise(*t, form=gemm_form))(*args)
  assert out.dtype == jnp.bfloat16 and out.shape == (m, cols)
  exact, abs_sum = numpy_blockwise(a, a_scale, b, b_scale, sizes)
  assert_within_accumulation_bound(out, exact, abs_sum, form, FP8_ACCUMULATION)
  assert not np.asarray(out[group_rows(sizes, m)[-1][1]:], np.float32).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_outlier_block_keeps_the_other_blocks_accurate(backend):
  """Block scaling's point: one 128-block of a row with values 1e4 times the rest, and one
  expert tile likewise, leave every other block's own scale. Per-group scaling would flush
  the small blocks to E4M3's subnormals; here each output stays within FP8's few percent of
  the bf16 product computed without the outlier blocks' contribution."""
  m, k, n = shapes(backend)
  sizes = [m // 2, m - m // 2]
  x, kernel = make_inputs(75, m, k, n, 2, jnp.bfloat16)
  x = x.at[:, :BLOCK].multiply(1e4)          # the first K-block of every row
  kernel = kernel.at[1, :BLOCK, :].multiply(1e4)  # expert 1's first K-block of tiles
  x, kernel, group_sizes = on(backend, x, kernel, jnp.asarray(sizes, jnp.int32))
  # Zero the outlier blocks' contribution exactly: multiply by a kernel whose first K-block
  # is zero (its tiles then have amax 0: the scale must stay finite).
  kernel_tail = kernel.at[:, :BLOCK, :].set(0)
  out = jax.jit(blockwise_linear("ffi"))(x, kernel_tail, group_sizes)
  want = jaxfuse.grouped_linear(x, kernel_tail, group_sizes, implementation="xla")
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert relative_error(out, want) < 0.05
  out_full = jax.jit(blockwise_linear("ffi"))(x, kernel, group_sizes)
  want_full = jaxfuse.grouped_linear(x, kernel, group_sizes, implementation="xla")
  assert relative_error(out_full, want_full) < 0.05


@pytest.mark.parametrize("recipe", [
    pytest.param(dataclasses.replace(RECIPE, fp8_wgrad=False), id="e4m3"),
    pytest.param(dataclasses.replace(E5M2_GRADIENTS, fp8_wgrad=False), id="e5m2")])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["uniform", "empty_groups", "sum_less_than_rows"])
def test_gradients(backend, case, recipe):
  """dx: the output gradient quantized in 1 x 128 blocks along N (the recipe's gradient
  format) times the forward's FP8 weight, against float64 numpy on those FP8 values.
  dkernel with fp8_wgrad=False: the 16-bit wgrad of x and the output gradient, against
  float64 numpy (the FP8 wgrad: test_grouped_linear_fp8_blockwise_wgrad.py)."""
  m, k, n = shapes(backend)
  sizes = sizes_cases(m)[case]
  x, kernel = make_inputs(76, m, k, n, len(sizes), jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(77), (m, n), jnp.bfloat16)
  x, kernel, d_out, group_sizes = on(backend, x, kernel, d_out, jnp.asarray(sizes, jnp.int32))
  _, vjp = jax.vjp(lambda x, w: blockwise_linear("ffi", recipe)(x, w, group_sizes), x, kernel)
  d_x, d_kernel = jax.jit(vjp)(d_out)
  assert d_x.dtype == jnp.bfloat16 and d_kernel.dtype == jnp.bfloat16
  q_dy = helpers.on_cpu(lambda d: jaxfuse.quantize(d, recipe, role="gradient",
                                                   implementation="xla"), d_out)
  q_w = helpers.on_cpu(lambda w: jaxfuse.quantize(w, recipe, kind="weight",
                                                  implementation="xla"), kernel)
  exact, abs_sum = numpy_blockwise(q_dy.data, q_dy.scale_inv, q_w.data, q_w.scale_inv, sizes)
  assert_within_accumulation_bound(d_x, exact, abs_sum, f"{case} dx", FP8_ACCUMULATION)
  _, want_kernel = numpy_grouped_grads(x, kernel, sizes, helpers.as_f64(d_out))
  helpers.assert_close(d_kernel, want_kernel, jnp.bfloat16, msg=f"{case} dkernel")
  for g, (start, end) in enumerate(group_rows(sizes, m)):
    if start == end:
      assert not np.asarray(d_kernel[g], np.float32).any(), f"dkernel[{g}] of an empty group"


@pytest.mark.parametrize("backend, implementation", [
    pytest.param("cpu", "ffi", id="cpu-ffi"),
    pytest.param("cpu", "xla", id="cpu-xla"),
    pytest.param("gpu", "ffi", id="gpu-ffi", marks=pytest.mark.gpu),
])
def test_accuracy_against_the_bf16_op(backend, implementation):
  """E4M3 in small blocks: a few percent relative (Frobenius) error against the bf16 op,
  forward and backward."""
  m, k, n = (128, 256, 144) if backend == "cpu" else (2048, 1024, 1024)
  sizes = sizes_cases(m)["empty_groups"]
  x, kernel = make_inputs(78, m, k, n, len(sizes), jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(79), (m, n), jnp.bfloat16)
  x, kernel, d_out, group_sizes = on(backend, x, kernel, d_out, jnp.asarray(sizes, jnp.int32))
  fp8 = lambda x, w: blockwise_linear(implementation)(x, w, group_sizes)
  bf16 = lambda x, w: jaxfuse.grouped_linear(x, w, group_sizes, implementation="xla")
  out, vjp = jax.vjp(fp8, x, kernel)
  want, want_vjp = jax.vjp(bf16, x, kernel)
  assert relative_error(out, want) < 0.05
  for name, got, expected in zip(("dx", "dkernel"), jax.jit(vjp)(d_out), want_vjp(d_out)):
    assert got.dtype == jnp.bfloat16, name
    assert relative_error(got, expected) < 0.1, name


def test_ffi_and_reference_agree_on_cpu():
  """The two implementations quantize identically, so their forwards agree to a bf16
  rounding (only the fp32 summation order differs)."""
  m, k, n = 96, 160, 144
  sizes = sizes_cases(m)["skewed"]
  x, kernel = make_inputs(80, m, k, n, len(sizes), jnp.bfloat16)
  group_sizes = jnp.asarray(sizes, jnp.int32)
  assert_bf16_close(jax.jit(blockwise_linear("ffi"))(x, kernel, group_sizes),
                    jax.jit(blockwise_linear("xla"))(x, kernel, group_sizes))


def test_backward_reuses_the_forward_offsets():
  """One offsets computation for the step; the forward and dgrad run the blockwise kernel,
  the wgrad the 16-bit one (8 CPU devices: partitioning may follow, so no FP8 wgrad; see
  test_grouped_linear_fp8_blockwise_wgrad.py for it)."""
  x, kernel = make_inputs(81, 64, 128, 128, 4, jnp.bfloat16)
  group_sizes = jnp.asarray([16, 0, 40, 8], jnp.int32)
  loss = lambda x, w: jnp.sum(blockwise_linear("ffi")(x, w, group_sizes).astype(jnp.float32))
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, kernel)
  offsets_computations = helpers.count_primitives(
      jaxpr, lambda e: e.primitive.name == "cumsum" or
      helpers.ffi_target("jaxfuse_group_offsets")(e))
  assert offsets_computations == 1
  # One call per platform branch (cpu, cuda) of each.
  blockwise = helpers.ffi_target("jaxfuse_grouped_gemm_fp8_blockwise")
  assert helpers.count_primitives(jaxpr, blockwise) == 4
  assert helpers.count_primitives(jaxpr, helpers.ffi_target("jaxfuse_grouped_gemm")) == 2


@pytest.mark.parametrize("recipe, shapes_, error, match", [
    (jaxfuse.quantization.Float8BlockScaling(block_size=64), ((32, 32), (2, 32, 32)),
     ValueError, r"block_size must be 128, got 64"),
    (jaxfuse.quantization.Float8BlockScaling(forward_format="e5m2"), ((32, 32), (2, 32, 32)),
     ValueError, r"forward_format must be 'e4m3'"),
    (RECIPE, ((32, 24), (2, 24, 32)), ValueError,
     r"K \(x.shape\[1\]\) to be a multiple of 16 .*got 24"),
    (RECIPE, ((32, 32), (2, 32, 40)), ValueError,
     r"N \(kernel.shape\[2\]\) to be a multiple of 16 .*got 40"),
])
@pytest.mark.parametrize("implementation", ["ffi", "xla"])
def test_errors(recipe, shapes_, error, match, implementation):
  x_shape, k_shape = shapes_
  with pytest.raises(error, match=match):
    jaxfuse.grouped_linear(jnp.ones(x_shape, jnp.bfloat16), jnp.ones(k_shape, jnp.bfloat16),
                           jnp.ones((2,), jnp.int32), recipe=recipe,
                           implementation=implementation)


def test_a_per_expert_kernel_is_rejected():
  kernel = jnp.ones((2, 32, 32), jnp.bfloat16)
  quantized = jaxfuse.quantize_experts(kernel, jaxfuse.quantization.Float8CurrentScaling())
  with pytest.raises(ValueError, match="cannot run with recipe=Float8BlockScaling"):
    jaxfuse.grouped_linear(jnp.ones((32, 32), jnp.bfloat16), quantized,
                           jnp.ones((2,), jnp.int32), recipe=RECIPE)


# --- weights quantized once (quantize_experts with Float8BlockScaling) ---------------------


@pytest.mark.parametrize("backend, implementation", [
    pytest.param("cpu", "ffi", id="cpu-ffi"),
    pytest.param("cpu", "xla", id="cpu-xla"),
    pytest.param("gpu", "ffi", id="gpu-ffi", marks=pytest.mark.gpu),
])
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_quantize_experts_holds_the_tiles_of_quantize(backend, implementation, trainable):
  """The copy's data is quantize(kernel, recipe, kind="weight") transposed per expert, its
  scales the tile scales transposed (tested against numpy in test_quantize.py); a
  trainable copy also keeps the untransposed bytes and the kernel. dequantize gives back
  [G, K, N]. Shapes with partial tiles in both dimensions."""
  _, kernel = make_inputs(90, 8, 272, 144, 3, jnp.bfloat16)
  (kernel,) = on(backend, kernel)
  q = jax.jit(lambda k: jaxfuse.quantize_experts(k, RECIPE, trainable=trainable,
                                                 implementation=implementation))(kernel)
  want = helpers.on_cpu(lambda w: jaxfuse.quantize(w, RECIPE, kind="weight",
                                                   implementation="xla"), kernel)
  assert q.scaling_mode == "expert_block_2d" and q.block_size == BLOCK
  assert q.data.dtype == jnp.float8_e4m3fn and q.data.shape == (3, 144, 272)
  assert q.scale_inv.shape == (3, blocks(144), blocks(272)) and q.shape == (3, 272, 144)
  np.testing.assert_array_equal(np.asarray(q.data, np.float32),
                                np.swapaxes(np.asarray(want.data, np.float32), 1, 2))
  np.testing.assert_array_equal(np.asarray(q.scale_inv), np.swapaxes(np.asarray(want.scale_inv),
                                                                     1, 2))
  if trainable:
    np.testing.assert_array_equal(np.asarray(q.data_untransposed, np.float32),
                                  np.asarray(want.data, np.float32))
    np.testing.assert_array_equal(np.asarray(q.master, np.float32),
                                  np.asarray(kernel, np.float32))
  else:
    assert q.data_untransposed is None and q.master is None
  np.testing.assert_array_equal(np.asarray(jaxfuse.dequantize(q), np.float32),
                                np.asarray(jaxfuse.dequantize(want), np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_a_quantized_kernel_gives_the_16_bit_kernels_results(backend, trainable):
  """The same FP8 tiles as the call would make: identical output and dx; a trainable
  copy's master gets the 16-bit kernel's gradient, a frozen copy none, and neither step
  quantizes the weights again."""
  m, k, n = shapes(backend)
  sizes = sizes_cases(m)["empty_groups"]
  x, kernel = make_inputs(91, m, k, n, len(sizes), jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(92), (m, n), jnp.bfloat16)
  x, kernel, d_out, group_sizes = on(backend, x, kernel, d_out, jnp.asarray(sizes, jnp.int32))
  quantized = jax.jit(lambda k: jaxfuse.quantize_experts(k, RECIPE, trainable=trainable))(kernel)
  fn = lambda x, w: jaxfuse.grouped_linear(x, w, group_sizes, recipe=RECIPE,
                                           implementation="ffi")
  out, vjp = jax.vjp(fn, x, kernel)
  q_out, q_vjp = jax.vjp(fn, x, quantized)
  np.testing.assert_array_equal(np.asarray(q_out, np.float32), np.asarray(out, np.float32))
  (d_x, d_kernel), (q_d_x, q_d_kernel) = jax.jit(vjp)(d_out), jax.jit(q_vjp)(d_out)
  np.testing.assert_array_equal(np.asarray(q_d_x, np.float32), np.asarray(d_x, np.float32))
  if trainable:
    np.testing.assert_array_equal(np.asarray(q_d_kernel.master, np.float32),
                                  np.asarray(d_kernel, np.float32))
  else:
    assert q_d_kernel.master is None
  loss = lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32))
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, quantized)
  for target in ("jaxfuse_quantize_blocks_transposed", "jaxfuse_batch_amax",
                 "jaxfuse_quantize_batches_transposed"):
    assert helpers.count_primitives(jaxpr, helpers.ffi_target(target)) == 0, target
  # x and dy only, in 1 x 128 blocks.
  assert helpers.count_primitives(jaxpr, helpers.ffi_target("jaxfuse_quantize")) == 2
  # The reference takes the copy too: the same result as on the 16-bit kernel.
  ref = lambda x, w: jaxfuse.grouped_linear(x, w, group_sizes, recipe=RECIPE,
                                            implementation="xla")
  np.testing.assert_array_equal(np.asarray(helpers.on_cpu(ref, x, quantized), np.float32),
                                np.asarray(helpers.on_cpu(ref, x, kernel), np.float32))


def test_quantize_experts_block_errors():
  kernel = jnp.ones((2, 32, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"block_size must be 128, got 64"):
    jaxfuse.quantize_experts(kernel, jaxfuse.quantization.Float8BlockScaling(block_size=64))
  with pytest.raises(ValueError, match=r"forward_format must be 'e4m3'"):
    jaxfuse.quantize_experts(kernel,
                             jaxfuse.quantization.Float8BlockScaling(forward_format="e5m2"))
  with pytest.raises(TypeError, match=r"Float8CurrentScaling.*or Float8BlockScaling"):
    jaxfuse.quantize_experts(kernel, jaxfuse.quantization.MXFP8BlockScaling())
  import dataclasses  # pylint: disable=g-import-not-at-top
  q = jaxfuse.quantize_experts(kernel, RECIPE)
  bad = dataclasses.replace(q, scale_inv=jnp.ones((2, 1), jnp.float32))
  with pytest.raises(ValueError, match=r"scale_inv float32 \[2, 1, 1\] \(one per 128 x 128 "
                                       r"tile\), got \(2, 1\)"):
    jaxfuse.grouped_linear(jnp.ones((32, 32), jnp.bfloat16), bad, jnp.ones((2,), jnp.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_handler_rejects_bad_scales_and_types(backend):
  ffi_registry.ensure_registered()
  m, k, n, groups = 32, 272, 144, 2  # 3 K-blocks, 2 N-blocks: a transposed shape fails
  offsets = jnp.asarray([0, 16, 32], jnp.int32)
  x = random_fp8(82, (m, k), jnp.float8_e4m3fn)
  w_t = random_fp8(83, (groups, n, k), jnp.float8_e4m3fn)
  good_a = jnp.ones((m, blocks(k)), jnp.float32)
  good_b = jnp.ones((groups, blocks(n), blocks(k)), jnp.float32)
  call = lambda *t: jax.jit(lambda *u: gemm_ffi.grouped_gemm_blockwise(
      *u, form=gemm_ffi.FORWARD))(*on(backend, *t))
  np.asarray(call(x, w_t, offsets, good_a, good_b))  # the good call runs
  cases = [
      ((x, w_t, offsets, jnp.ones((m, 1), jnp.float32), good_b), r"a_scale_inv must be"),
      ((x, w_t, offsets, good_a, jnp.ones((groups, blocks(k), blocks(n)), jnp.float32)),
       r"b_scale_inv must be"),
      ((x, w_t, offsets, good_a.astype(jnp.bfloat16), good_b), r"a_scale_inv must be"),
      ((x.astype(jnp.float8_e5m2), w_t, offsets, good_a, good_b), r"float8_e5m2|not supported"),
  ]
  for args, match in cases:
    with pytest.raises(Exception, match=match):
      np.asarray(call(*args))
  with pytest.raises(ValueError, match=r"forward \(0\) and dgrad \(1\) forms, got form 2"):
    gemm_ffi.grouped_gemm_blockwise(x, w_t, offsets, good_a, good_b, form=gemm_ffi.WGRAD)


def test_shard_map_tokens_sharded_kernel_replicated():
  check_shard_map_tokens_sharded(blockwise_linear, 160, 144, 84)


_TILE_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxfuse
    inputs = np.load(sys.argv[1] + "/in.npz")
    x, w, d_out = (jnp.asarray(inputs[name], jnp.bfloat16) for name in ("x", "w", "d_out"))
    recipe = jaxfuse.quantization.Float8BlockScaling()
    @jax.jit
    def step(x, w, sizes, d_out):
      out, vjp = jax.vjp(lambda x, w: jaxfuse.grouped_linear(x, w, sizes, recipe=recipe), x, w)
      return (out, vjp(d_out)[0])
    results = {}
    for index, sizes in enumerate(sys.argv[2:]):  # one executable, sizes changed on device
      sizes = jnp.asarray([int(s) for s in sizes.split(",")], jnp.int32)
      for name, value in zip(("out", "d_x"), step(x, w, sizes, d_out)):
        results[f"{index}_{name}"] = np.asarray(value, np.float32)
    np.savez(sys.argv[1] + "/out.npz", **results)
""")


# _TILE_SCRIPT's problem: K = 1040 (9 k-tiles, the last partial), N = 656 (6 for the dgrad),
# and sizes with an empty group, sums past and short of the rows.
TILE_SHAPE = (2048, 1040, 656, 4)  # m, k, n, groups
TILE_SIZE_SETS = [[512] * 4, [700, 0, 1500, 100], [300, 41, 0, 1000]]


def save_tile_inputs(tmp_path, seed):
  """Random bf16 x [m, k], kernel [G, k, n] and d_out [m, n] of TILE_SHAPE, saved where
  _TILE_SCRIPT reads them; returns (x, kernel, d_out)."""
  m, k, n, groups = TILE_SHAPE
  x, kernel = make_inputs(seed, m, k, n, groups, jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(seed + 1), (m, n), jnp.bfloat16)
  np.savez(tmp_path / "in.npz", x=np.asarray(x, np.float32), w=np.asarray(kernel, np.float32),
           d_out=np.asarray(d_out, np.float32))
  return x, kernel, d_out


def run_tile_script(tmp_path, env_overrides, size_sets):
  """_TILE_SCRIPT's outputs (forward and dgrad per size set) in a process with
  `env_overrides` set (the knobs are read once per process)."""
  env = dict(os.environ, **env_overrides)
  subprocess.run([sys.executable, "-c", _TILE_SCRIPT, str(tmp_path)]
                 + [",".join(map(str, s)) for s in size_sets],
                 env=env, check=True, timeout=300)
  return dict(np.load(tmp_path / "out.npz"))


@pytest.mark.gpu
@pytest.mark.parametrize("tile, flags", [
    ("large", ""),
    ("small", ""),
    ("large", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
              "--xla_gpu_graph_min_graph_size=1"),
], ids=["large", "small", "large-cuda-graph"])
def test_tile_configs_and_graph_replays_match_float64_numpy(tmp_path, tile, flags):
  """Both tile configs (cooperative 128x128 with 1x2 clusters, ping-pong 64x128), forced
  through JAXFUSE_GROUPED_GEMM_TILE, and the large one replayed as a CUDA graph: one
  executable run on three sets of sizes changed on the device (an empty group, sizes
  summing past and short of the rows), forward and dgrad against float64 numpy."""
  x, kernel, d_out = save_tile_inputs(tmp_path, 86)
  size_sets = TILE_SIZE_SETS
  xla_flags = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
  results = run_tile_script(tmp_path, {"JAXFUSE_GROUPED_GEMM_TILE": tile,
                                       "XLA_FLAGS": xla_flags}, size_sets)
  x_q, x_s, w_t, w_t_s = quantized_operands(x, kernel)
  q_dy = helpers.on_cpu(lambda d: jaxfuse.quantize(d, RECIPE, role="gradient",
                                                   implementation="xla"), d_out)
  q_w = helpers.on_cpu(lambda w: jaxfuse.quantize(w, RECIPE, kind="weight",
                                                  implementation="xla"), kernel)
  for index, sizes in enumerate(size_sets):
    exact, abs_sum = numpy_blockwise(x_q, x_s, w_t, w_t_s, sizes)
    assert_within_accumulation_bound(results[f"{index}_out"], exact, abs_sum,
                                     f"{tile} forward {sizes}", FP8_ACCUMULATION)
    exact, abs_sum = numpy_blockwise(q_dy.data, q_dy.scale_inv, q_w.data, q_w.scale_inv,
                                     sizes)
    assert_within_accumulation_bound(results[f"{index}_d_x"], exact, abs_sum,
                                     f"{tile} dgrad {sizes}", FP8_ACCUMULATION)


@pytest.mark.gpu
def test_pipelined_mainloop_is_bitwise_the_stock_one(tmp_path):
  """The large config's two mainloops (fp8_blockwise_pipelined_promotion.cuh, the default,
  and CUTLASS's, JAXFUSE_GROUPED_GEMM_FP8_MAINLOOP=stock) scale and add the same k-tile
  partials in the same order: forward (9 k-tiles, the last partial) and dgrad (6) agree
  bit for bit, on sizes with an empty group and sums short of and past the rows; and the
  pipelined results match float64 numpy."""
  x, kernel, _ = save_tile_inputs(tmp_path, 92)
  size_sets = TILE_SIZE_SETS
  results = {}
  for mainloop in ("stock", "pipelined"):
    results[mainloop] = run_tile_script(
        tmp_path, {"JAXFUSE_GROUPED_GEMM_TILE": "large",
                   "JAXFUSE_GROUPED_GEMM_FP8_MAINLOOP": mainloop}, size_sets)
  assert sorted(results["stock"]) == sorted(results["pipelined"])
  for name, stock in results["stock"].items():
    np.testing.assert_array_equal(results["pipelined"][name], stock, err_msg=name)
  x_q, x_s, w_t, w_t_s = quantized_operands(x, kernel)
  for index, sizes in enumerate(size_sets):
    exact, abs_sum = numpy_blockwise(x_q, x_s, w_t, w_t_s, sizes)
    assert_within_accumulation_bound(results["pipelined"][f"{index}_out"], exact, abs_sum,
                                     f"pipelined forward {sizes}", FP8_ACCUMULATION)


@pytest.mark.gpu
@pytest.mark.sanitize
def test_hostile_group_sizes_stay_in_bounds():
  """Run under compute-sanitizer (scripts/gpu_run.sh sanitize): sizes far past the rows,
  negative, all zero: the blockwise kernels and their scale loads stay in bounds."""
  m, k, n = 256, 160, 144
  x, kernel = make_inputs(88, m, k, n, 4, jnp.bfloat16)
  for sizes in ([2**30, 2**30, 5, 7], [-2**31, 300, -7, 2**31 - 1], [0, 0, 0, 0],
                [m + 1, 0, 0, 0]):
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out, vjp = jax.vjp(lambda x, w: blockwise_linear("ffi")(x, w, group_sizes), x, kernel)
    d_x, _ = vjp(jnp.ones_like(out))
    exact, abs_sum = numpy_blockwise(*quantized_operands(x, kernel), sizes)
    assert_within_accumulation_bound(out, exact, abs_sum, str(sizes), FP8_ACCUMULATION)
    assert not np.isnan(np.asarray(d_x, np.float32)).any()


def test_flax_grouped_linear_takes_the_recipe():
  """linen.GroupedLinear with Float8BlockScaling runs the same blockwise op on its kernel."""
  from jaxfuse.flax import linen as jf_linen  # pylint: disable=g-import-not-at-top
  m, k, n, groups = 64, 160, 144, 3
  x, _ = make_inputs(89, m, k, n, groups, jnp.bfloat16)
  group_sizes = jnp.asarray([20, 0, 40], jnp.int32)
  module = jf_linen.GroupedLinear(num_groups=groups, features=n, recipe=RECIPE,
                                  dtype=jnp.bfloat16)
  params = module.init(jax.random.key(0), x, group_sizes)
  out = jax.jit(module.apply)(params, x, group_sizes)
  kernel = params["params"]["kernel"].astype(jnp.bfloat16)
  want = jaxfuse.grouped_linear(x, kernel, group_sizes, recipe=RECIPE)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
