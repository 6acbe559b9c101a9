"""grouped_linear with Float8CurrentScaling(per_group=True): the FP8 grouped GEMM handler
vs the FP8 reference (same FP8 products), the reference vs float64 numpy on the same FP8
values, accuracy against the 16-bit op, gradients, empty groups, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxfuse
from jaxfuse._src import ffi as ffi_registry
from jaxfuse._src.ops.grouped_linear import ffi as gemm_ffi
from jaxfuse._src.ops.grouped_linear import reference
from jaxfuse._src.ops.quantize import columnwise as quantize_columnwise
from jaxfuse._src.ops.quantize import ffi as quantize_ffi
from tests import helpers
from tests.ops.test_grouped_linear import BACKENDS, make_inputs, on, sizes_cases

RECIPE = jaxfuse.quantization.Float8CurrentScaling(per_group=True)
# The forward GEMM accumulates fast by default (RECIPE); PROMOTED promotes to fp32 like dgrad.
PROMOTED = jaxfuse.quantization.Float8CurrentScaling(per_group=True,
                                                     forward_fast_accumulation=False)
ACCUMULATIONS = [pytest.param(RECIPE, id="fast"), pytest.param(PROMOTED, id="promoted")]
# The jnp reference ("xla") is checked on the CPU; on the GPU it would only add minutes
# of XLA compilation and autotuning of its float32 ragged_dot.
BACKEND_IMPLEMENTATIONS = [
    pytest.param("cpu", "ffi", id="cpu-ffi"),
    pytest.param("cpu", "xla", id="cpu-xla"),
    pytest.param("gpu", "ffi", id="gpu-ffi", marks=pytest.mark.gpu),
]
CASES = ["uniform", "one_group", "empty_groups", "sum_less_than_rows", "sum_more_than_rows",
         "negative_sizes", "skewed", "many_groups"]
# One bf16 rounding of the result (2^-8 relative), with room for a tie flipping: the
# handler and the reference multiply the same FP8 values, only the fp32 summation order
# differs.
BF16_ULP = 2.0 ** -7
# Hopper's FP8 tensor cores add products with reduced precision (about 14 bits, truncated)
# inside a wgmma and between CUTLASS's fp32 promotions (every 4 k-blocks), so the GPU's
# sum differs from the exact one by a fraction of the sum of |products|, not of |result|:
# an element that cancels to near zero keeps the absolute error of its large terms.
# 2^-12 of sum(|products|) allows several truncations per promotion interval; a wrong
# scale, operand or layout errs by percents of |result| and fails it.
FP8_ACCUMULATION = 2.0 ** -12
# Fast accumulation never promotes: each of the k/32 wgmma steps adds its chunk to the
# reduced-precision accumulator with a truncation of up to 2^-13 of the running sum.
# At k = 512 that is 2^-9 of sum(|products|), about 3% of |result| for random data; a wrong
# scale, operand or layout still errs by tens of percents and fails it.


def fast_accumulation_bound(k: int) -> float:
  return max(k // 32, 1) * 2.0 ** -13


def accumulation_bound(recipe, backend: str, k: int) -> float:
  # The CPU handler sums exactly; only the GPU's fast accumulation needs the wider bound.
  if backend == "gpu" and recipe.forward_fast_accumulation:
    return fast_accumulation_bound(k)
  return FP8_ACCUMULATION


def relative_error(actual, expected) -> float:
  actual, expected = helpers.as_f64(actual), helpers.as_f64(expected)
  return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def shapes(backend):
  return (96, 32, 48) if backend == "cpu" else (1000, 512, 768)


def group_rows(sizes, m):
  """Clamped [start, end) of each group."""
  bounds, start = [], 0
  for size in sizes:
    end = min(start + max(int(size), 0), m)
    bounds.append((start, end))
    start = end
  return bounds


def fp8_linear(implementation, recipe=RECIPE):
  return lambda x, w, s: jaxfuse.grouped_linear(x, w, s, recipe=recipe,
                                                implementation=implementation)


def fp8_products(x, kernel, sizes):
  """(exact, abs_sum) in float64: per group, sum_k x_q * w_q * alpha_g and the same sum of
  |products|, from the reference's quantization (on the CPU)."""
  m, k = x.shape
  groups, _, n = kernel.shape
  group_sizes = jnp.asarray(sizes, jnp.int32)
  q_x = helpers.on_cpu(lambda x, s: jaxfuse.quantize(x, RECIPE, group_sizes=s,
                                                     implementation="xla"), x, group_sizes)
  w_t, w_s = helpers.on_cpu(lambda w: reference.quantize_experts_t(w, RECIPE, "xla"), kernel)
  x_q, x_s = helpers.as_f64(q_x.data), helpers.as_f64(q_x.scale_inv)
  w_q, w_s = helpers.as_f64(w_t).reshape(groups, n, k), helpers.as_f64(w_s)
  exact, abs_sum = np.zeros((m, n)), np.zeros((m, n))
  for g, (start, end) in enumerate(group_rows(sizes, m)):
    alpha = x_s[g] * w_s[g]
    exact[start:end] = (x_q[start:end] @ w_q[g].T) * alpha
    abs_sum[start:end] = (np.abs(x_q[start:end]) @ np.abs(w_q[g]).T) * alpha
  return exact, abs_sum


def assert_within_accumulation_bound(actual, exact, abs_sum, msg="",
                                     accumulation=FP8_ACCUMULATION):
  """|actual - exact| <= accumulation * sum|products| + one bf16 rounding of exact."""
  actual = helpers.as_f64(actual)
  assert not np.isnan(actual).any(), msg
  bound = accumulation * abs_sum + BF16_ULP * np.abs(exact) + 1e-30
  worst = float(np.max(np.abs(actual - exact) / bound, initial=0.0))
  assert worst <= 1.0, f"{msg}: error {worst:.3g} x the accumulation bound"


def assert_bf16_close(actual, expected, msg=""):
  actual, expected = helpers.as_f64(actual), helpers.as_f64(expected)
  assert not np.isnan(actual).any(), msg
  scale = np.maximum(np.abs(expected), np.abs(expected).max(initial=0.0) * 1e-3)
  error = float(np.max(np.abs(actual - expected) / scale, initial=0.0))
  assert error <= BF16_ULP, f"{msg}: relative error {error:.3g} > {BF16_ULP:.3g}"


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_float64_numpy_on_the_same_fp8_values(case):
  """The reference's result is sum(x_q * w_q) * x_scale_inv[g] * w_scale_inv[g] per group."""
  m, k, n = 64, 32, 16
  sizes = sizes_cases(m)[case]
  x, kernel = make_inputs(10, m, k, n, len(sizes), jnp.bfloat16)
  group_sizes = jnp.asarray(sizes, jnp.int32)
  out = jax.jit(fp8_linear("xla"))(x, kernel, group_sizes)
  assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
  q_x = jaxfuse.quantize(x, RECIPE, group_sizes=group_sizes, implementation="xla")
  q_w = jaxfuse.quantize(jnp.swapaxes(kernel, 1, 2).reshape(-1, k), RECIPE,
                         group_offsets=jnp.arange(len(sizes) + 1, dtype=jnp.int32) * n,
                         implementation="xla")
  x_q, x_s = helpers.as_f64(q_x.data), helpers.as_f64(q_x.scale_inv)
  w_q, w_s = helpers.as_f64(q_w.data).reshape(len(sizes), n, k), helpers.as_f64(q_w.scale_inv)
  expected = np.zeros((m, n))
  for g, (start, end) in enumerate(group_rows(sizes, m)):
    expected[start:end] = (x_q[start:end] @ w_q[g].T) * (x_s[g] * w_s[g])
  assert_bf16_close(out, expected, case)
  # Per-expert scales: every expert's largest |w| maps to the E4M3 maximum.
  amax = np.abs(helpers.as_f64(kernel)).reshape(len(sizes), -1).max(axis=1)
  np.testing.assert_allclose(w_s, amax / 448.0, rtol=1e-6)


@pytest.mark.parametrize("recipe", ACCUMULATIONS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_ffi_matches_the_fp8_reference(backend, case, recipe):
  m, k, n = shapes(backend)
  sizes = sizes_cases(m)[case]
  x, kernel = make_inputs(11, m, k, n, len(sizes), jnp.bfloat16)
  x, kernel, group_sizes = on(backend, x, kernel, jnp.asarray(sizes, jnp.int32))
  out = jax.jit(fp8_linear("ffi", recipe))(x, kernel, group_sizes)
  assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
  expected = helpers.on_cpu(fp8_linear("xla", recipe), x, kernel, group_sizes)
  exact, abs_sum = fp8_products(x, kernel, sizes)
  # The XLA reference is the exact FP8 product rounded once to bf16.
  assert_bf16_close(expected, exact, f"{case} (reference)")
  assert_within_accumulation_bound(out, exact, abs_sum, case,
                                   accumulation_bound(recipe, backend, k))
  covered = group_rows(sizes, m)[-1][1]
  assert not np.asarray(out[covered:], np.float32).any(), "rows past the groups must be zero"


@pytest.mark.parametrize("recipe", ACCUMULATIONS)
@pytest.mark.parametrize("backend, implementation", BACKEND_IMPLEMENTATIONS)
@pytest.mark.parametrize("case", ["uniform", "empty_groups", "sum_less_than_rows"])
def test_accuracy_against_the_bf16_op(backend, implementation, case, recipe):
  """E4M3 keeps 3 mantissa bits; over a K-term product of unit-variance data the errors
  average out to a few percent of the norm. dgrad uses E5M2 (2 bits) for dy; so does the
  FP8 wgrad (E4M3 x times E5M2 dy)."""
  m, k, n = (128, 64, 48) if backend == "cpu" else (2048, 1024, 1024)
  sizes = sizes_cases(m)[case]
  x, kernel = make_inputs(12, m, k, n, len(sizes), jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(13), (m, n), jnp.bfloat16)
  x, kernel, d_out, group_sizes = on(backend, x, kernel, d_out, jnp.asarray(sizes, jnp.int32))
  fp8 = lambda x, w: fp8_linear(implementation, recipe)(x, w, group_sizes)
  bf16 = lambda x, w: jaxfuse.grouped_linear(x, w, group_sizes, implementation="xla")
  out, vjp = jax.vjp(fp8, x, kernel)
  want, want_vjp = jax.vjp(bf16, x, kernel)
  assert relative_error(out, want) < 0.05
  for name, got, expected in zip(("dx", "dkernel"), jax.jit(vjp)(d_out), want_vjp(d_out)):
    assert got.dtype == jnp.bfloat16, name
    assert relative_error(got, expected) < 0.1, name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["empty_groups", "sum_less_than_rows", "negative_sizes"])
def test_gradients_of_empty_groups_and_uncovered_rows_are_zero(backend, case):
  m, k, n = shapes(backend)
  sizes = sizes_cases(m)[case]
  x, kernel = make_inputs(14, m, k, n, len(sizes), jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(15), (m, n), jnp.bfloat16)
  x, kernel, d_out, group_sizes = on(backend, x, kernel, d_out, jnp.asarray(sizes, jnp.int32))
  _, vjp = jax.vjp(lambda x, w: fp8_linear("ffi")(x, w, group_sizes), x, kernel)
  d_x, d_kernel = jax.jit(vjp)(d_out)
  bounds = group_rows(sizes, m)
  for g, (start, end) in enumerate(bounds):
    if start == end:
      assert not np.asarray(d_kernel[g], np.float32).any(), f"dkernel[{g}] of an empty group"
    else:
      assert np.asarray(d_kernel[g], np.float32).any(), f"dkernel[{g}]"
  assert not np.asarray(d_x[bounds[-1][1]:], np.float32).any(), "dx rows past the groups"
  # dgrad in FP8 against float64 numpy on the dequantized E5M2 dy and E4M3 weights.
  q_dy = helpers.on_cpu(lambda d_out, group_sizes: jaxfuse.quantize(
      d_out, RECIPE, group_sizes=group_sizes, role="gradient", implementation="xla"),
                        d_out, group_sizes)
  w_t, w_s = helpers.on_cpu(lambda kernel: reference.quantize_experts_t(kernel, RECIPE, "xla"),
                            kernel)
  dy_q, dy_s = helpers.as_f64(q_dy.data), helpers.as_f64(q_dy.scale_inv)
  w_q = helpers.as_f64(w_t)
  want, abs_sum = np.zeros((m, k)), np.zeros((m, k))
  for g, (start, end) in enumerate(bounds):
    alpha = dy_s[g] * helpers.as_f64(w_s)[g]
    want[start:end] = dy_q[start:end] @ w_q[g] * alpha
    abs_sum[start:end] = np.abs(dy_q[start:end]) @ np.abs(w_q[g]) * alpha
  assert_within_accumulation_bound(d_x, want, abs_sum, "dx")


@pytest.mark.parametrize("fused", [False, True], ids=["transposing_kernels", "fused_copies"])
@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_fp8_gemms_forward_dgrad_and_wgrad(fp8_wgrad, fused):
  x, kernel = make_inputs(16, 32, 32, 16, 2, jnp.bfloat16)
  group_sizes = jnp.asarray([20, 12], jnp.int32)
  recipe = jaxfuse.quantization.Float8CurrentScaling(per_group=True, fp8_wgrad=fp8_wgrad)
  loss = lambda x, w: jnp.sum(fp8_linear("ffi", recipe)(x, w, group_sizes)
                              .astype(jnp.float32))
  with quantize_columnwise.fused(fused, everywhere=True):
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, kernel)
  count = lambda target: helpers.count_primitives(jaxpr, helpers.ffi_target(target))
  # platform_dependent lowers a cpu and a cuda branch: each GEMM appears twice.
  assert count("jaxfuse_grouped_gemm_fp8") == 2 * 2
  # FP8 wgrad: the column-wise copies of the forward's FP8 x and the dgrad's FP8 dy, by a
  # transposing kernel each or written by their quantization passes.
  assert count("jaxfuse_grouped_gemm_fp8_wgrad") == 2 * fp8_wgrad
  assert count("jaxfuse_group_columnwise") == 2 * fp8_wgrad * (not fused)
  assert count("jaxfuse_quantize") == 2
  assert count("jaxfuse_grouped_gemm") == 2 * (not fp8_wgrad)
  # Offsets computed once: x's and dy's quantization and all three GEMMs share them.
  assert helpers.count_primitives(jaxpr, lambda e: e.primitive.name == "cumsum") == 1


# --- The FP8 wgrad: column-wise copies and the wgrad kernel -----------------------------

COLUMNWISE_CASES = CASES + ["groups_31_sum_less", "groups_32_negative"]


def blocked_storage(columns, clamped):
  """The blocked storage (cuda/include/jaxfuse/columnwise.h) of a column-wise matrix
  [K, W]: G + 1 blocks cut at the group starts (block 0 from column 0, block G the tail),
  each stored row-major in turn, returned as the [K, W] buffer the op gives."""
  k, width = columns.shape
  groups = len(clamped) - 1
  bounds = [0] + [quantize_ffi.columnwise_start(int(clamped[b]), b)
                  for b in range(1, groups + 1)] + [width]
  assert all(bound % 16 == 0 for bound in bounds) and bounds == sorted(bounds)
  flat = np.concatenate([columns[:, begin:end].ravel()
                         for begin, end in zip(bounds[:-1], bounds[1:])])
  return flat.reshape(k, width)


def numpy_columnwise(data, sizes):
  """The column-wise copy (cuda/include/jaxfuse/columnwise.h) in numpy, as uint8 codes:
  group g's rows as columns from columnwise_start(c_g, g) of a [K, W] matrix, zeros
  elsewhere, in the blocked storage."""
  codes = np.asarray(data).view(np.uint8)
  m, k = codes.shape
  columns = np.zeros((k, quantize_ffi.columnwise_width(m, len(sizes))), np.uint8)
  rows = group_rows(sizes, m)
  for g, (start, end) in enumerate(rows):
    first = quantize_ffi.columnwise_start(start, g)
    assert first % 16 == 0
    columns[:, first:first + end - start] = codes[start:end].T
  return blocked_storage(columns, [start for start, _ in rows] + [rows[-1][1]])


def random_fp8(seed, shape, dtype):
  """Random FP8 codes of every finite magnitude class (no NaN)."""
  values = np.random.default_rng(seed).standard_normal(shape) * 8.0
  return jnp.asarray(values.astype(np.float32), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", COLUMNWISE_CASES)
def test_group_columnwise_matches_numpy(backend, case):
  m, k = (77, 48) if backend == "cpu" else (1000, 272)
  sizes = sizes_cases(m)[case]
  data = random_fp8(40, (m, k), jnp.float8_e4m3fn)
  offsets = jaxfuse.group_offsets(jnp.asarray(sizes, jnp.int32))
  data, offsets = on(backend, data, offsets)
  out = jax.jit(quantize_ffi.group_columnwise)(data, offsets)
  assert out.dtype == data.dtype
  np.testing.assert_array_equal(np.asarray(out).view(np.uint8), numpy_columnwise(data, sizes))


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_columnwise_of_hostile_offsets(backend):
  """Offsets that decrease, go negative or run past M: clamped and made non-decreasing,
  as the wgrad kernel reads them; nothing lands outside the copy."""
  m, k = 70, 32
  data = random_fp8(41, (m, k), jnp.float8_e5m2)
  hostile = np.asarray([5, -20, 40, 30, 900, 60], np.int32)  # G = 5
  data, offsets = on(backend, data, jnp.asarray(hostile))
  out = np.asarray(jax.jit(quantize_ffi.group_columnwise)(data, offsets)).view(np.uint8)
  codes = np.asarray(data).view(np.uint8)
  clamped = np.maximum.accumulate(np.clip(hostile, 0, m))
  columns = np.zeros_like(out)
  for g in range(5):
    first = quantize_ffi.columnwise_start(int(clamped[g]), g)
    columns[:, first:first + clamped[g + 1] - clamped[g]] = codes[clamped[g]:clamped[g + 1]].T
  np.testing.assert_array_equal(out, blocked_storage(columns, clamped))


def numpy_fp8_wgrad(x, x_s, dy, dy_s, sizes):
  """(exact, abs_sum) float64 [G, K, N]: x_s[g] * dy_s[g] * x_g^T @ dy_g and the sum of
  |products| per element."""
  x64, dy64 = helpers.as_f64(x), helpers.as_f64(dy)
  x_s, dy_s = helpers.as_f64(x_s), helpers.as_f64(dy_s)
  groups, k, n = len(sizes), x64.shape[1], dy64.shape[1]
  exact, abs_sum = np.zeros((groups, k, n)), np.zeros((groups, k, n))
  for g, (start, end) in enumerate(group_rows(sizes, x64.shape[0])):
    alpha = x_s[g] * dy_s[g]
    exact[g] = x64[start:end].T @ dy64[start:end] * alpha
    abs_sum[g] = np.abs(x64[start:end]).T @ np.abs(dy64[start:end]) * alpha
  return exact, abs_sum


@pytest.mark.parametrize("gradient_dtype", [jnp.float8_e5m2, jnp.float8_e4m3fn])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", COLUMNWISE_CASES)
def test_fp8_wgrad_matches_float64_numpy(backend, case, gradient_dtype):
  """dw[g] = alpha_g * x_g^T @ dy_g from FP8 x (E4M3) and dy (E5M2 or E4M3), exact products
  in fp32 (promoted accumulation on the GPU), one bf16 rounding; empty groups exactly 0."""
  m, k, n = (77, 32, 48) if backend == "cpu" else (1000, 256, 272)
  sizes = sizes_cases(m)[case]
  groups = len(sizes)
  x = random_fp8(42, (m, k), jnp.float8_e4m3fn)
  dy = random_fp8(43, (m, n), gradient_dtype)
  rng = np.random.default_rng(44)
  x_s = jnp.asarray(rng.uniform(0.01, 0.1, groups), jnp.float32)
  dy_s = jnp.asarray(rng.uniform(0.01, 0.1, groups), jnp.float32)
  offsets = jaxfuse.group_offsets(jnp.asarray(sizes, jnp.int32))
  x, dy, x_s, dy_s, offsets = on(backend, x, dy, x_s, dy_s, offsets)
  dw = jax.jit(lambda *a: gemm_ffi.grouped_gemm(*a[:3], form=gemm_ffi.WGRAD, a_scale_inv=a[3],
                                                b_scale_inv=a[4]))(x, dy, offsets, x_s, dy_s)
  assert dw.dtype == jnp.bfloat16 and dw.shape == (groups, k, n)
  exact, abs_sum = numpy_fp8_wgrad(x, x_s, dy, dy_s, sizes)
  assert_within_accumulation_bound(dw, exact, abs_sum, case)
  for g, (start, end) in enumerate(group_rows(sizes, m)):
    if start == end:
      assert not np.asarray(dw[g], np.float32).any(), f"dw[{g}] of an empty group"


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["forward", "dgrad", "wgrad"])
def test_fp8_large_tile_gemms_match_float64_numpy(form):
  """The promoted FP8 GEMMs at a size where the heuristic picks the large (cooperative
  128x128) config, whose mainloop overlaps each k-tile's promotion with the next k-tile's
  wgmma (grouped_gemm/fp8_pipelined_promotion.cuh): 9 and 10 k-tiles with a partial last
  one (k = 1040, n = 1168; k != n, so a swapped operand layout cannot pass), odd group
  sizes, an empty group. The other tests' shapes run the small config."""
  m, k, n = 4096, 1040, 1168
  sizes = [1500, 0, 1803, 700]  # 93 rows past the groups
  groups = len(sizes)
  rng = np.random.default_rng(45)
  a_scale = jnp.asarray(rng.uniform(0.01, 0.1, groups), jnp.float32)
  b_scale = jnp.asarray(rng.uniform(0.01, 0.1, groups), jnp.float32)
  offsets = jaxfuse.group_offsets(jnp.asarray(sizes, jnp.int32))
  bounds = group_rows(sizes, m)
  if form == "wgrad":
    x = random_fp8(46, (m, k), jnp.float8_e4m3fn)
    dy = random_fp8(47, (m, n), jnp.float8_e5m2)
    args = on("gpu", x, dy, offsets, a_scale, b_scale)
    out = jax.jit(lambda *a: gemm_ffi.grouped_gemm(
        *a[:3], form=gemm_ffi.WGRAD, a_scale_inv=a[3], b_scale_inv=a[4]))(*args)
    exact, abs_sum = numpy_fp8_wgrad(x, a_scale, dy, b_scale, sizes)
  else:
    # forward: x e4m3 [m, k] times w^T [G, n, k]; dgrad: dy e5m2 [m, n] times w [G, k, n]:
    # both out[r, c] = sum_i a[r, i] * b[g, c, i], with cols = n or k, inner = k or n.
    cols, inner = (n, k) if form == "forward" else (k, n)
    a = random_fp8(48, (m, inner), jnp.float8_e4m3fn if form == "forward"
                   else jnp.float8_e5m2)
    b = random_fp8(49, (groups, cols, inner), jnp.float8_e4m3fn)
    args = on("gpu", a, b, offsets, a_scale, b_scale)
    gemm_form = gemm_ffi.FORWARD if form == "forward" else gemm_ffi.DGRAD
    out = jax.jit(lambda *t: gemm_ffi.grouped_gemm(
        *t[:3], form=gemm_form, a_scale_inv=t[3], b_scale_inv=t[4]))(*args)
    a64, b64 = helpers.as_f64(a), helpers.as_f64(b)
    exact, abs_sum = np.zeros((m, cols)), np.zeros((m, cols))
    for g, (start, end) in enumerate(bounds):
      w_g = b64[g]  # [cols, inner]
      alpha = float(a_scale[g]) * float(b_scale[g])
      exact[start:end] = a64[start:end] @ w_g.T * alpha
      abs_sum[start:end] = np.abs(a64[start:end]) @ np.abs(w_g).T * alpha
  assert_within_accumulation_bound(out, exact, abs_sum, form)
  if form == "wgrad":
    assert not np.asarray(out[1], np.float32).any(), "dw of the empty group"
  else:
    assert not np.asarray(out[bounds[-1][1]:], np.float32).any(), "rows past the groups"


def test_fp8_wgrad_handler_errors():
  ffi_registry.ensure_registered()  # raw ffi_calls below
  offsets = jnp.asarray([0, 8, 16], jnp.int32)
  ones = jnp.ones((2,), jnp.float32)
  width = quantize_ffi.columnwise_width(16, 2)
  x_t = jnp.ones((16, width), jnp.float8_e4m3fn)
  out = jax.ShapeDtypeStruct((2, 16, 16), jnp.bfloat16)
  wgrad = lambda a, b, rows, s=ones: jax.block_until_ready(jax.ffi.ffi_call(
      "jaxfuse_grouped_gemm_fp8_wgrad", out)(a, b, offsets, s, ones, rows=np.int64(rows)))
  with pytest.raises(Exception, match=r"column-wise copies \[K, W\] and \[N, W\] with "
                                      r"W = ColumnwiseWidth\(rows = 17"):
    wgrad(x_t, x_t, 17)
  with pytest.raises(Exception, match=r"a \(x\^T\) must be float8_e4m3fn"):
    wgrad(x_t.astype(jnp.float8_e5m2), x_t, 16)
  with pytest.raises(Exception, match=r"scale_inv must be float32 \[G = 2\]"):
    wgrad(x_t, x_t, 16, ones[:1])
  # The row-wise FP8 handler refuses the wgrad form: it needs column-wise copies.
  a = jnp.ones((16, 16), jnp.float8_e4m3fn)
  with pytest.raises(Exception, match="reads column-wise copies"):
    jax.block_until_ready(jax.ffi.ffi_call("jaxfuse_grouped_gemm_fp8", out)(
        a, a, offsets, ones, ones, form=np.int32(2), fast_accumulation=False))


def test_fp8_wgrad_group_limit():
  """The column-wise copies hold at most 4096 group starts: more groups name the limit and
  the way out (16-bit weight gradients), which runs."""
  groups = 4097
  x, kernel = jnp.ones((32, 16), jnp.bfloat16), jnp.ones((groups, 16, 16), jnp.bfloat16)
  sizes = jnp.zeros((groups,), jnp.int32).at[0].set(32)
  with pytest.raises(ValueError, match="at most 4096 groups, got 4097; pass a recipe with "
                                       "fp8_wgrad=False"):
    jaxfuse.grouped_linear(x, kernel, sizes, recipe=RECIPE, implementation="ffi")
  recipe = jaxfuse.quantization.Float8CurrentScaling(per_group=True, fp8_wgrad=False)
  loss = lambda w: jnp.sum(jaxfuse.grouped_linear(x, w, sizes, recipe=recipe,
                                                  implementation="ffi").astype(jnp.float32))
  d_kernel = jax.jit(jax.grad(loss))(kernel)
  np.testing.assert_allclose(np.asarray(d_kernel[0], np.float32), 32.0)
  assert not np.asarray(d_kernel[1:], np.float32).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_columnwise_errors(backend):
  offsets, = on(backend, jnp.asarray([0, 8, 16], jnp.int32))
  data, = on(backend, jnp.ones((16, 32), jnp.bfloat16))
  with pytest.raises(Exception, match="data must be float8_e4m3fn or float8_e5m2"):
    jax.block_until_ready(quantize_ffi.group_columnwise(data, offsets))


def test_group_columnwise_of_unaligned_k_on_cpu():
  """Any K on the CPU (a tensor-parallel shard of N may hold 8 columns there); the GPU
  kernel needs K % 16 == 0, as the FP8 GEMMs do (test below)."""
  data = random_fp8(45, (20, 24), jnp.float8_e4m3fn)
  sizes = [7, 0, 13]
  out = quantize_ffi.group_columnwise(data, jaxfuse.group_offsets(jnp.asarray(sizes, jnp.int32)))
  np.testing.assert_array_equal(np.asarray(out).view(np.uint8), numpy_columnwise(data, sizes))


@pytest.mark.gpu
def test_group_columnwise_rejects_unaligned_k_on_gpu():
  data, offsets = on("gpu", jnp.ones((16, 24), jnp.float8_e4m3fn),
                     jnp.asarray([0, 8, 16], jnp.int32))
  with pytest.raises(Exception, match=r"K \(data.shape\[1\]\) must be a multiple of 16 on GPU"):
    jax.block_until_ready(quantize_ffi.group_columnwise(data, offsets))


def test_float16_x_gives_float16():
  x, kernel = make_inputs(17, 32, 16, 16, 2, jnp.float16)
  group_sizes = jnp.asarray([10, 22], jnp.int32)
  out = fp8_linear("ffi")(x, kernel, group_sizes)
  assert out.dtype == jnp.float16
  assert_bf16_close(out, fp8_linear("xla")(x, kernel, group_sizes))


def test_handler_rejects_bad_scales():
  a = jnp.ones((16, 16), jnp.float8_e4m3fn)
  offsets = jnp.asarray([0, 8, 16], jnp.int32)
  ones = jnp.ones((2,), jnp.float32)
  w_t = jnp.ones((2, 16, 16), jnp.float8_e4m3fn)
  with pytest.raises(Exception, match=r"scale_inv must be float32 \[G = 2\]"):
    jax.block_until_ready(gemm_ffi.grouped_gemm(a, w_t, offsets, form=gemm_ffi.FORWARD,
                                                a_scale_inv=ones[:1], b_scale_inv=ones))


@pytest.mark.parametrize("backend", BACKENDS)
def test_handler_rejects_fast_accumulation_outside_the_e4m3_forward(backend):
  offsets = jnp.asarray([0, 8, 16], jnp.int32)
  ones = jnp.ones((2,), jnp.float32)
  dy = jnp.ones((16, 16), jnp.float8_e5m2)
  w = jnp.ones((2, 16, 16), jnp.float8_e4m3fn)
  dy, w, offsets, ones = on(backend, dy, w, offsets, ones)
  with pytest.raises(Exception, match="fast_accumulation is only available for the forward"):
    jax.block_until_ready(gemm_ffi.grouped_gemm(dy, w, offsets, form=gemm_ffi.DGRAD,
                                                a_scale_inv=ones, b_scale_inv=ones,
                                                fast_accumulation=True))
  x = jnp.ones((16, 16), jnp.float8_e5m2)
  x, = on(backend, x)
  with pytest.raises(Exception, match="with float8_e5m2"):
    jax.block_until_ready(gemm_ffi.grouped_gemm(x, w, offsets, form=gemm_ffi.FORWARD,
                                                a_scale_inv=ones, b_scale_inv=ones,
                                                fast_accumulation=True))


def test_forward_fast_accumulation_reaches_only_the_forward_gemm():
  x, kernel = make_inputs(18, 32, 32, 16, 2, jnp.bfloat16)
  group_sizes = jnp.asarray([20, 12], jnp.int32)

  def fast_flags(recipe):
    loss = lambda x, w: jnp.sum(fp8_linear("ffi", recipe)(x, w, group_sizes)
                                .astype(jnp.float32))
    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, kernel).as_text()
    return sorted(line.split("fast_accumulation = ")[1].startswith("true")
                  for line in hlo.splitlines()
                  if "jaxfuse_grouped_gemm_fp8" in line and "fast_accumulation = " in line)

  # The lowering keeps this platform's branch: one forward and one dgrad call.
  assert fast_flags(RECIPE) == [False, True]
  assert fast_flags(PROMOTED) == [False, False]


def test_handler_decodes_fp8_exactly():
  """Every E4M3 x E5M2 code pair (finite) through the dgrad form, one element per row."""
  e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
  e5m2 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e5m2)
  finite4 = e4m3[np.isfinite(e4m3.astype(np.float32))]
  finite5 = e5m2[np.isfinite(e5m2.astype(np.float32))]
  a = np.zeros((finite5.size, 16), ml_dtypes.float8_e5m2)
  a[:, 0] = finite5
  w = np.zeros((1, finite4.size, 16), ml_dtypes.float8_e4m3fn)
  w[0, :, 0] = finite4
  out = gemm_ffi.grouped_gemm(jnp.asarray(a), jnp.asarray(w),
                              jnp.asarray([0, finite5.size], jnp.int32), form=gemm_ffi.DGRAD,
                              a_scale_inv=jnp.ones((1,), jnp.float32),
                              b_scale_inv=jnp.ones((1,), jnp.float32))
  expected = (finite5.astype(np.float32)[:, None] * finite4.astype(np.float32)[None, :])
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                expected.astype(jnp.bfloat16).astype(np.float32))


@pytest.mark.parametrize("recipe, shapes_, match", [
    (jaxfuse.quantization.Float8CurrentScaling(per_group=False), ((32, 32), (2, 32, 32)),
     r"supports recipe=Float8CurrentScaling\(per_group=True\)"),
    (jaxfuse.quantization.MXFP8BlockScaling(), ((32, 32), (2, 32, 32)),
     r"supports recipe=Float8CurrentScaling\(per_group=True\).* or Float8BlockScaling"),
    (jaxfuse.quantization.Float8CurrentScaling(forward_format="e5m2"), ((32, 32), (2, 32, 32)),
     r"forward_format must be 'e4m3'"),
    (RECIPE, ((32, 24), (2, 24, 32)), r"K \(x.shape\[1\]\) to be a multiple of 16 .*got 24"),
    (RECIPE, ((32, 32), (2, 32, 40)), r"N \(kernel.shape\[2\]\) to be a multiple of 16 .*got 40"),
])
@pytest.mark.parametrize("implementation", ["ffi", "xla"])
def test_errors(recipe, shapes_, match, implementation):
  x_shape, k_shape = shapes_
  with pytest.raises(ValueError, match=match):
    jaxfuse.grouped_linear(jnp.ones(x_shape, jnp.bfloat16), jnp.ones(k_shape, jnp.bfloat16),
                           jnp.ones((2,), jnp.int32), recipe=recipe,
                           implementation=implementation)


def check_shard_map_tokens_sharded(linear, k, n, seed):
  """Per-device tokens and sizes under shard_map, the kernel replicated (its gradient summed
  over the devices): `linear(implementation)` -> fn(x, kernel, sizes). The FFI forward
  equals the reference's (bf16-level), gradients within FP8 accuracy (the FFI dgrad
  quantizes dy, the reference's gradients are straight-through)."""
  from jax.sharding import Mesh, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from jaxfuse._src import compat  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices("cpu")), ("data",))
  devices = mesh.devices.size
  m_local, groups = 32, 3
  x, kernel = make_inputs(seed, m_local * devices, k, n, groups, jnp.bfloat16)
  rng = np.random.default_rng(seed + 1)
  sizes = jnp.asarray(np.stack([rng.multinomial(m_local - 2, np.ones(groups) / groups)
                                for _ in range(devices)]).astype(np.int32))

  def layer(implementation):
    f = lambda x, w, s: linear(implementation)(x, w, s[0])
    return compat.shard_map(f, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                            out_specs=P("data"))

  out = jax.jit(layer("ffi"))(x, kernel, sizes)
  assert_bf16_close(out, jax.jit(layer("xla"))(x, kernel, sizes))
  loss = lambda impl: lambda x, w: jnp.sum(jnp.sin(layer(impl)(x, w, sizes).astype(jnp.float32)))
  got = jax.jit(jax.grad(loss("ffi"), argnums=(0, 1)))(x, kernel)
  want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1)))(x, kernel)
  for name, g, w in zip(("dx", "dkernel"), got, want):
    assert relative_error(g, w) < 0.1, name


def test_shard_map_tokens_sharded_kernel_replicated():
  check_shard_map_tokens_sharded(fp8_linear, 32, 16, 18)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["uniform", "empty_groups", "sum_less_than_rows", "skewed",
                                  "many_groups"])
def test_fused_columnwise_copies_give_identical_gradients(backend, case):
  """The wgrad on the copies its quantizations wrote (quantize/columnwise.py) against the
  transposing kernels' copies: the same FP8 bytes, so bit-identical results."""
  m, k, n = (64, 32, 48) if backend == "cpu" else (1000, 272, 144)
  sizes = sizes_cases(m)[case]
  x, kernel = make_inputs(60, m, k, n, len(sizes), jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(61), (m, n), jnp.bfloat16)
  group_sizes = jnp.asarray(sizes, jnp.int32)
  x, kernel, d_out, group_sizes = on(backend, x, kernel, d_out, group_sizes)
  results = []
  for fused in (False, True):
    with quantize_columnwise.fused(fused, everywhere=True):
      out, vjp = jax.vjp(lambda x, w: fp8_linear("ffi")(x, w, group_sizes), x, kernel)
      results.append((out, *vjp(d_out)))
  for name, unfused, fused in zip(("out", "dx", "dkernel"), *results):
    np.testing.assert_array_equal(np.asarray(fused, np.float32),
                                  np.asarray(unfused, np.float32), err_msg=name)
  assert np.abs(np.asarray(results[0][2], np.float32)).max() > 0  # a real wgrad
