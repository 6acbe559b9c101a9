"""Property-based tests (hypothesis): the ops against float64 numpy over generated problems,
on every implementation (the jnp reference, the CPU handlers, the CUDA kernels).

Each property draws a problem (rows, widths, number of groups, group sizes with negatives,
zeros and sums below, at and past the rows, activation parameters, magnitudes) and a seed
for fresh normal values. The fixed hard cases live in each op's own test file and so do
the float64 numpy specifications used here; these tests search the space between those
cases. On failure hypothesis prints the smallest problem it found and the seed.

Error bounds are per element and follow from the arithmetic, not from a tensor-wide rtol:
a product of 16-bit inputs is exact in fp32, a K-term fp32 sum errs by at most
K * 2^-24 * sum|terms|, and the one rounding to the output dtype by half an ulp
(2^-8 relative for bf16, 2^-11 for f16).

float32 properties bound each element by 1e-5 of its own magnitude plus 1e-6 of the largest
(a few fp32 ulps of the math, the CUDA kernels' approximate ex2/rcp/rsqrt included).

Compositions (grouped_mlp, the MoE layer) store intermediates in 16 bits; their rounding
errors are propagated through what follows (an exact value plus a radius), not compared.
FP8 ops are checked against the float64 product of their quantized operands (GEMMs) or
within half an FP8 ulp of the float64 value, with each scale on its amax (quantization).
The FP8 grouped MLP (per-group current scaling and 1 x 128 / 128 x 128 blocks) maps every
interval through each quantization and rounding (the interval of the rounded ends), which
keeps the bounds near the exact FP8 computation.

``JAXFUSE_PROPERTY_EXAMPLES`` sets the number of problems per property (default 20).
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import jaxfuse
from jaxfuse._src.ops.group_offsets import api as group_offsets_api
from jaxfuse._src.ops.quantize import columnwise as quantize_columnwise
from jaxfuse.quantization import (FP8_MAX, Float8BlockScaling, Float8CurrentScaling,
                                  MXFP8BlockScaling)
from tests import helpers
from tests.ops.test_grouped_linear import numpy_grouped_grads, numpy_grouped_linear
from tests.ops.test_grouped_linear_fp8 import (FP8_ACCUMULATION, group_rows,
                                               PROMOTED as FP8_GROUPED_PROMOTED,
                                               RECIPE as FP8_GROUPED, accumulation_bound,
                                               assert_within_accumulation_bound,
                                               fast_accumulation_bound, fp8_products)
from tests.ops.test_grouped_linear_fp8_blockwise import (RECIPE as FP8_BLOCKWISE,
                                                         numpy_blockwise,
                                                         quantized_operands as blockwise_operands)
from tests.ops.test_linear_scale_add import numpy_linear_scale_add
from tests.ops.test_moe import np_router
from tests.ops.test_quantize import check_round_trip, element_scale_inv
from tests.ops.test_rms_norm import numpy_rms_norm, numpy_rms_norm_grads
from tests.ops.test_scaled_activation import np_act, np_backward

# (implementation, device platform)
IMPLEMENTATIONS = [
    pytest.param(("xla", "cpu"), id="xla"),
    pytest.param(("ffi", "cpu"), id="ffi-cpu"),
    pytest.param(("ffi", "gpu"), id="ffi-gpu", marks=pytest.mark.gpu),
]
# Rounding to the output dtype: half an ulp relative in the normal range, half the
# subnormal step below it (f16's subnormals start at 2^-14, its step is 2^-24).
HALF_ULP = {jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11,
            jnp.dtype(jnp.float32): 2.0**-24}
HALF_SUBNORMAL_STEP = {jnp.dtype(jnp.bfloat16): 2.0**-134, jnp.dtype(jnp.float16): 2.0**-25,
                       jnp.dtype(jnp.float32): 2.0**-150}

PROPERTY = settings(
    max_examples=int(os.environ.get("JAXFUSE_PROPERTY_EXAMPLES", "20")),
    deadline=None,  # each new shape compiles
    database=None,  # no .hypothesis directory in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def on(platform, *arrays):
  device = jax.devices(platform)[0]
  return [jax.device_put(a, device) for a in arrays]


# --- strategies ------------------------------------------------------------------------


@st.composite
def group_sizes(draw, rows: int, max_groups: int = 12) -> list[int]:
  """G sizes for `rows` rows: either a partition of the rows (sum == rows, empty groups
  where cut points coincide) or free sizes (zeros, negatives, sums below or past rows)."""
  groups = draw(st.integers(1, max_groups))
  if draw(st.booleans()):
    cuts = sorted(draw(st.lists(st.integers(0, rows), min_size=groups - 1,
                                max_size=groups - 1)))
    return list(np.diff([0, *cuts, rows]).astype(int))
  size = st.one_of(st.just(0), st.integers(-4, -1), st.integers(1, max(rows, 1)))
  return draw(st.lists(size, min_size=groups, max_size=groups))


# --- group_offsets ---------------------------------------------------------------------


@st.composite
def many_group_sizes(draw, max_groups: int, max_size: int) -> np.ndarray:
  """Up to `max_groups` int32 sizes (past the GPU scan's 1024-group chunks), drawn by numpy
  from a hypothesis seed: small or large, a share of them negative."""
  groups = draw(st.integers(1, max_groups))
  largest = draw(st.sampled_from([1, 7, 1000, max_size]))
  negative_share = draw(st.sampled_from([0.0, 0.1, 0.5]))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  sizes = rng.integers(0, largest + 1, groups)
  negative = rng.random(groups) < negative_share
  sizes[negative] = -rng.integers(1, 6, int(negative.sum()))
  return sizes.astype(np.int32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@PROPERTY
@given(sizes=many_group_sizes(max_groups=2100, max_size=1_000_000))
def test_group_offsets_is_the_exclusive_prefix_sum_of_clamped_sizes(implementation, sizes):
  impl, platform = implementation
  (group_sizes_,) = on(platform, jnp.asarray(sizes))
  offsets = jaxfuse.group_offsets(group_sizes_, implementation=impl)
  expected = np.concatenate([[0], np.cumsum(np.maximum(sizes, 0, dtype=np.int64))])
  assert offsets.dtype == jnp.int32 and offsets.shape == (len(sizes) + 1,)
  np.testing.assert_array_equal(np.asarray(offsets, np.int64), expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@PROPERTY
@given(sizes=many_group_sizes(max_groups=300, max_size=50_000),
       row_capacity=st.integers(0, 3_000_000),
       strides=st.lists(st.sampled_from([1, 3, 8, 4096, 14336, 1 << 20]), min_size=1,
                        max_size=3))
def test_offsets_of_every_stride_are_clamped_rows_times_stride(implementation, sizes,
                                                               row_capacity, strides):
  """The internal multi-output offsets: 64-bit wherever rows * stride could pass int32.
  The jnp reference produces int64 only under jax_enable_x64 and says so otherwise."""
  impl, platform = implementation
  (group_sizes_,) = on(platform, jnp.asarray(sizes))
  wide_any = any(row_capacity * stride >= 2**31 for stride in strides)
  if impl == "xla" and wide_any and not jax.config.jax_enable_x64:
    with pytest.raises(NotImplementedError, match="jax_enable_x64"):
      group_offsets_api.group_offsets_multi(group_sizes_, strides, row_capacity=row_capacity,
                                            implementation=impl)
    return
  outputs = group_offsets_api.group_offsets_multi(group_sizes_, strides,
                                                  row_capacity=row_capacity,
                                                  implementation=impl)
  rows = np.minimum(np.concatenate([[0], np.cumsum(np.maximum(sizes, 0, dtype=np.int64))]),
                    row_capacity)
  for stride, out in zip(strides, outputs):
    wide = row_capacity * stride >= 2**31
    assert out.dtype == (jnp.int64 if wide else jnp.int32), (stride, row_capacity)
    np.testing.assert_array_equal(np.asarray(out, np.int64), rows * stride)


# --- grouped_linear --------------------------------------------------------------------


def assert_zero_past_groups(sizes, rows, row_outputs, kernel_gradients=None):
  """Rows past the (clamped) groups of each row output, and each kernel gradient's slice
  of an empty group, are exactly zero (fresh GPU buffers hold garbage until written)."""
  bounds = group_rows(sizes, rows)
  for what, value in row_outputs.items():
    assert not np.asarray(value[bounds[-1][1]:], np.float32).any(), f"{what} past the groups"
  for what, value in (kernel_gradients or {}).items():
    for g, (start, end) in enumerate(bounds):
      if start == end:
        assert not np.asarray(value[g], np.float32).any(), f"{what}[{g}] of an empty group"


@st.composite
def grouped_problems(draw):
  rows = draw(st.integers(1, 80))
  return dict(rows=rows, k=8 * draw(st.integers(1, 8)), n=8 * draw(st.integers(1, 8)),
              sizes=draw(group_sizes(rows)),
              dtype=draw(st.sampled_from([jnp.bfloat16, jnp.float16])),
              seed=draw(st.integers(0, 2**32 - 1)))


def assert_within(actual, expected, magnitude, dtype, terms, what, roundings=1,
                  rounded_term=None):
  """|actual - expected| <= rounding to `dtype` + terms * 2^-22 * magnitude, elementwise:
  one rounding to the output dtype and an fp32 sum of `terms` products (4x slack).
  `roundings` > 1: a sum whose partial sums are each rounded to `dtype` (each of those
  roundings errs by at most half an ulp of the sum of |terms|, `magnitude`).
  `rounded_term`: the magnitude of a term rounded to `dtype` before it is added (half an
  ulp of it more)."""
  actual = helpers.as_f64(actual)
  dtype = jnp.dtype(dtype)
  bound = (HALF_ULP[dtype] * (np.abs(expected) + (roundings - 1) * magnitude)
           + roundings * HALF_SUBNORMAL_STEP[dtype] + terms * 2.0**-22 * magnitude)
  if rounded_term is not None:
    bound = (bound + HALF_ULP[dtype] * (1 + HALF_ULP[dtype]) * rounded_term
             + HALF_SUBNORMAL_STEP[dtype])
  excess = np.abs(actual - expected) - bound
  assert not np.isnan(actual).any(), f"{what}: NaN"
  assert (excess <= 0).all(), (f"{what}: {int((excess > 0).sum())} elements past the bound, "
                               f"worst by {excess.max():.3g}")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@PROPERTY
@given(problem=grouped_problems())
def test_grouped_linear_and_its_gradients_match_float64_numpy(implementation, problem):
  impl, platform = implementation
  rows, k, n, sizes, dtype = (problem[key] for key in ("rows", "k", "n", "sizes", "dtype"))
  rng = np.random.default_rng(problem["seed"])
  x = helpers.random_array(rng, (rows, k), dtype)
  kernel = helpers.random_array(rng, (len(sizes), k, n), dtype, scale=1 / np.sqrt(k))
  d_out = helpers.random_array(rng, (rows, n), dtype)
  x_, kernel_, d_out_, sizes_ = on(platform, x, kernel, d_out, jnp.asarray(sizes, jnp.int32))

  def forward(x, kernel):
    return jaxfuse.grouped_linear(x, kernel, sizes_, implementation=impl)

  out, vjp = jax.vjp(jax.jit(forward), x_, kernel_)
  d_x, d_kernel = vjp(d_out_)
  assert (out.dtype, d_x.dtype, d_kernel.dtype) == (dtype,) * 3
  # |x| @ |W| and friends: the sums of |products| each element's fp32 sum runs over.
  abs_x, abs_k, abs_d = (np.abs(helpers.as_f64(a)) for a in (x, kernel, d_out))
  assert_within(out, numpy_grouped_linear(x, kernel, sizes),
                numpy_grouped_linear(abs_x, abs_k, sizes), dtype, k, "out")
  want_dx, want_dk = numpy_grouped_grads(x, kernel, sizes, d_out)
  mag_dx, mag_dk = numpy_grouped_grads(abs_x, abs_k, sizes, abs_d)
  assert_within(d_x, want_dx, mag_dx, dtype, n, "dx")
  assert_within(d_kernel, want_dk, mag_dk, dtype, rows, "dkernel")
  assert_zero_past_groups(sizes, rows, {"out": out, "dx": d_x}, {"dkernel": d_kernel})



@st.composite
def fp8_grouped_problems(draw):
  rows = draw(st.integers(1, 80))
  # Widths past one 128-wide block, with a partial last block, for Float8BlockScaling.
  return dict(rows=rows, k=16 * draw(st.integers(1, 12)), n=16 * draw(st.integers(1, 12)),
              sizes=draw(group_sizes(rows)),
              recipe=draw(st.sampled_from([FP8_GROUPED, FP8_GROUPED_PROMOTED, FP8_BLOCKWISE])),
              dtype=draw(st.sampled_from([jnp.bfloat16, jnp.float16])),
              seed=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@PROPERTY
@given(problem=fp8_grouped_problems())
def test_fp8_grouped_linear_is_the_product_of_its_fp8_operands(implementation, problem):
  """out = the float64 product of the FP8 operands jaxfuse.quantize gives (its own
  properties are tested above), dequantized with their scales: per group and expert for
  Float8CurrentScaling(per_group=True), per 1 x 128 block of x and 128 x 128 tile of the
  kernel for Float8BlockScaling. Within test_grouped_linear_fp8's accumulation bound
  (exact sums on the CPU, Hopper's reduced-precision FP8 accumulation on the GPU) and one
  rounding."""
  impl, platform = implementation
  rows, k, n, sizes, recipe, dtype = (problem[key] for key in
                                      ("rows", "k", "n", "sizes", "recipe", "dtype"))
  rng = np.random.default_rng(problem["seed"])
  x = helpers.random_array(rng, (rows, k), dtype)
  kernel = helpers.random_array(rng, (len(sizes), k, n), dtype, scale=1 / np.sqrt(k))
  x_, kernel_, sizes_ = on(platform, x, kernel, jnp.asarray(sizes, jnp.int32))
  out = jax.jit(lambda x, w, s: jaxfuse.grouped_linear(x, w, s, recipe=recipe,
                                                       implementation=impl))(x_, kernel_, sizes_)
  assert out.dtype == dtype and out.shape == (rows, n)
  if recipe is FP8_BLOCKWISE:
    exact, abs_sum = numpy_blockwise(*blockwise_operands(x, kernel), sizes)
    accumulation = FP8_ACCUMULATION
  else:
    exact, abs_sum = fp8_products(x, kernel, sizes)
    accumulation = accumulation_bound(recipe, platform, k)
  assert_within_accumulation_bound(out, exact, abs_sum, "out", accumulation)
  assert_zero_past_groups(sizes, rows, {"out": out})

# --- linear_scale_add ------------------------------------------------------------------


@st.composite
def linear_problems(draw):
  """16-bit operands only: an fp32 GEMM may run in TF32 on the GPU, which these bounds
  would not cover (test_linear_scale_add.py covers float32 against its own tolerance)."""
  return dict(leading=tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=3))),
              # Odd widths (cuBLASLt on the GPU) and multiples of 8 (the CUTLASS kernel).
              k=draw(st.integers(1, 72) | st.integers(1, 9).map(lambda m: 8 * m)),
              n=draw(st.integers(1, 72) | st.integers(1, 9).map(lambda m: 8 * m)),
              alpha=draw(st.sampled_from([1.0, 0.5, -2.0, 0.037])),
              dtype=draw(st.sampled_from([jnp.bfloat16, jnp.float16])),
              seed=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@PROPERTY
@given(problem=linear_problems())
# Found on an H100 (session 49): cuBLASLt's epilogue rounds alpha * x @ kernel to bf16
# before the residual is added (product -1.16 on a residual of 0.93: 1.7% off the result),
# with every algorithm its heuristic offers (session 51, scripts/probe_linear_rounding.py).
# K = N = 8 runs the CUTLASS kernel, which must round once; K = 7 runs cuBLASLt.
@example(problem=dict(leading=(1,), k=8, n=8, alpha=1.0, dtype=jnp.bfloat16, seed=0))
@example(problem=dict(leading=(1,), k=7, n=8, alpha=1.0, dtype=jnp.bfloat16, seed=0))
def test_linear_scale_add_and_its_gradients_match_float64_numpy(implementation, problem):
  """out within one rounding of the fp32 sum; on the GPU with K or N not a multiple of 8
  (cuBLASLt) also half an ulp of |alpha x @ kernel|, which cuBLASLt's epilogue rounds to
  the output dtype first (see linear_scale_add's docstring). dx and dkernel: one rounding
  each."""
  impl, platform = implementation
  leading, k, n, alpha, dtype = (problem[key] for key in ("leading", "k", "n", "alpha", "dtype"))
  rng = np.random.default_rng(problem["seed"])
  x = helpers.random_array(rng, (*leading, k), dtype)
  kernel = helpers.random_array(rng, (k, n), dtype, scale=1 / np.sqrt(k))
  residual = helpers.random_array(rng, (*leading, n), dtype)
  d_out = helpers.random_array(rng, (*leading, n), dtype)
  args = on(platform, x, kernel, residual, d_out)

  def forward(x, kernel, residual):
    return jaxfuse.linear_scale_add(x, kernel, residual, alpha, implementation=impl)

  out, vjp = jax.vjp(jax.jit(forward), *args[:3])
  d_x, d_kernel, d_residual = vjp(args[3])
  abs_x, abs_k, abs_d = (np.abs(helpers.as_f64(a)) for a in (x, kernel, d_out))
  flat = lambda a: a.reshape(-1, a.shape[-1])
  product = alpha * helpers.as_f64(x) @ helpers.as_f64(kernel)
  assert_within(out, numpy_linear_scale_add(x, kernel, residual, alpha),
                abs(alpha) * abs_x @ abs_k + np.abs(helpers.as_f64(residual)), dtype, k + 1,
                "out", rounded_term=(np.abs(product) if platform == "gpu" and (k % 8 or n % 8)
                                     else None))
  assert_within(d_x, alpha * helpers.as_f64(d_out) @ helpers.as_f64(kernel).T,
                abs(alpha) * abs_d @ abs_k.T, dtype, n, "dx")
  assert_within(d_kernel, alpha * flat(helpers.as_f64(x)).T @ flat(helpers.as_f64(d_out)),
                abs(alpha) * flat(abs_x).T @ flat(abs_d), dtype, flat(abs_x).shape[0],
                "dkernel")
  np.testing.assert_array_equal(np.asarray(d_residual, np.float32),
                                np.asarray(d_out, np.float32))


# --- rms_norm --------------------------------------------------------------------------


@st.composite
def norm_problems(draw):
  return dict(leading=tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=2))),
              hidden=draw(st.integers(1, 300)), eps=draw(st.sampled_from([1e-6, 1e-5, 0.1])),
              zero_centered=draw(st.booleans()),
              magnitude=draw(st.sampled_from([1e-3, 1.0, 30.0])),
              seed=draw(st.integers(0, 2**32 - 1)))


def assert_float32_within(what, actual, expected, magnitude, dtype=jnp.float32):
  """The float32 bound of the module docstring, then one rounding to `dtype`."""
  actual = helpers.as_f64(actual)
  assert actual.shape == expected.shape, what
  float32_bound = 1e-5 * magnitude + 1e-6 * (magnitude.max(initial=0.0) + 1e-30)
  dtype = jnp.dtype(dtype)
  bound = (float32_bound + HALF_ULP[dtype] * (np.abs(expected) + float32_bound)
           + HALF_SUBNORMAL_STEP[dtype])
  excess = np.abs(actual - expected) - bound
  assert (excess <= 0).all(), f"{what}: worst excess {excess.max():.3g}"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@PROPERTY
@given(problem=norm_problems())
def test_rms_norm_and_its_gradients_match_float64_numpy(implementation, problem):
  """float32; add_rms_norm's sum is checked exactly (one fp32 addition) and its norm like
  rms_norm's."""
  impl, platform = implementation
  leading, hidden, eps = problem["leading"], problem["hidden"], problem["eps"]
  zero_centered = problem["zero_centered"]
  rng = np.random.default_rng(problem["seed"])
  x = helpers.random_array(rng, (*leading, hidden), jnp.float32, scale=problem["magnitude"])
  residual = helpers.random_array(rng, (*leading, hidden), jnp.float32)
  gamma = helpers.random_array(rng, (hidden,), jnp.float32, scale=0.5)
  d_out = helpers.random_array(rng, (*leading, hidden), jnp.float32)
  x_, residual_, gamma_, d_out_ = on(platform, x, residual, gamma, d_out)
  options = dict(zero_centered_gamma=zero_centered, implementation=impl)

  out, vjp = jax.vjp(jax.jit(lambda x, g: jaxfuse.rms_norm(x, g, eps, **options)), x_, gamma_)
  d_x, d_gamma = vjp(d_out_)

  x64, g64, dy64 = map(helpers.as_f64, (x, gamma, d_out))
  rs = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
  xhat, scale = x64 * rs, (1.0 + g64) if zero_centered else g64
  want = numpy_rms_norm(x, gamma, eps, zero_centered)
  want_dx, want_dgamma = numpy_rms_norm_grads(x, gamma, d_out, eps, zero_centered)
  # dx = rs (dxhat - xhat mean(dxhat xhat)): bounded by the same terms in absolute value.
  dxhat = np.abs(dy64 * scale)
  mag_dx = rs * (dxhat + np.abs(xhat) * np.mean(dxhat * np.abs(xhat), -1, keepdims=True))
  assert_float32_within("out", out, want, np.abs(want))
  assert_float32_within("dx", d_x, want_dx, mag_dx)
  assert_float32_within("dgamma", d_gamma, want_dgamma,
                        np.sum(np.abs(dy64 * xhat).reshape(-1, hidden), 0))

  normed, summed = jax.jit(lambda x, r, g: jaxfuse.add_rms_norm(x, r, g, eps, **options))(
      x_, residual_, gamma_)
  want_sum = np.asarray(x, np.float32) + np.asarray(residual, np.float32)
  np.testing.assert_array_equal(np.asarray(summed), want_sum)
  want_normed = numpy_rms_norm(want_sum, gamma, eps, zero_centered)
  assert_float32_within("add_rms_norm", normed, want_normed, np.abs(want_normed))


# --- MoE permute / unpermute -----------------------------------------------------------


@st.composite
def routing_problems(draw):
  experts = draw(st.integers(1, 16))
  return dict(tokens=draw(st.integers(1, 64)), topk=draw(st.integers(1, min(4, experts))),
              experts=experts, hidden=draw(st.integers(1, 40)),
              # Ids outside [0, E) (dropped copies) in a share of the problems.
              invalid_share=draw(st.sampled_from([0.0, 0.0, 0.15])),
              dtype=draw(st.sampled_from([jnp.bfloat16, jnp.float16, jnp.float32])),
              seed=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@PROPERTY
@given(problem=routing_problems())
def test_moe_permute_and_unpermute_match_a_stable_sort_by_expert(implementation, problem):
  """moe_permute is a stable sort of the token copies by expert id (ids outside [0, E) last,
  in no group) and copies rows exactly; moe_unpermute sums each token's k rows with its
  weights in fp32 (one rounding); both gradients too."""
  impl, platform = implementation
  tokens, topk, experts, hidden, dtype = (problem[key] for key in
                                          ("tokens", "topk", "experts", "hidden", "dtype"))
  rng = np.random.default_rng(problem["seed"])
  ids = np.stack([rng.choice(experts, topk, replace=False) for _ in range(tokens)])
  invalid = rng.random(ids.shape) < problem["invalid_share"]
  ids[invalid] = rng.choice([-1, experts, experts + 5], int(invalid.sum()))
  x = helpers.random_array(rng, (tokens, hidden), dtype)
  y = helpers.random_array(rng, (tokens * topk, hidden), dtype)
  weights = jnp.asarray(rng.uniform(0.05, 1.0, (tokens, topk)), jnp.float32)
  d_sorted = helpers.random_array(rng, (tokens * topk, hidden), dtype)
  d_out = helpers.random_array(rng, (tokens, hidden), dtype)
  x_, ids_, y_, weights_, d_sorted_, d_out_ = on(platform, x, jnp.asarray(ids, jnp.int32), y,
                                                 weights, d_sorted, d_out)

  def permute(x):
    return jaxfuse.moe_permute(x, ids_, experts, implementation=impl)

  x_sorted, row_map, sizes = permute(x_)
  key = np.where((ids >= 0) & (ids < experts), ids, experts).reshape(-1)
  order = np.argsort(key, kind="stable")  # order[i]: the flat (t, j) copy at sorted row i
  want_row_map = np.empty(tokens * topk, np.int64)
  want_row_map[order] = np.arange(tokens * topk)
  np.testing.assert_array_equal(np.asarray(row_map).reshape(-1), want_row_map)
  np.testing.assert_array_equal(np.asarray(sizes),
                                np.bincount(key, minlength=experts + 1)[:experts])
  np.testing.assert_array_equal(np.asarray(x_sorted, np.float32),
                                np.asarray(x, np.float32)[order // topk])

  def unpermute(y, weights):
    return jaxfuse.moe_unpermute(y, row_map, weights, implementation=impl)

  out, unpermute_vjp = jax.vjp(unpermute, y_, weights_)
  d_y, d_weights = unpermute_vjp(d_out_)
  (d_x,) = jax.vjp(lambda x: permute(x)[0], x_)[1](d_sorted_)

  rows = want_row_map.reshape(tokens, topk)
  y64, w64, dy64, ds64 = (helpers.as_f64(a) for a in (y, weights, d_out, d_sorted))
  terms = w64[:, :, None] * y64[rows]
  assert_within(out, terms.sum(1), np.abs(terms).sum(1), dtype, topk, "unpermute")
  # The jnp reference's dx is XLA's transpose of its gather, a scatter-add in x's dtype
  # (a rounding per copy); the kernels' is an unpermute (fp32, one rounding).
  assert_within(d_x, ds64[rows].sum(1), np.abs(ds64[rows]).sum(1), dtype, topk, "permute dx",
                roundings=topk if impl == "xla" else 1)
  want_dy = np.zeros_like(y64)
  want_dy[rows.reshape(-1)] = (w64[:, :, None] * dy64[:, None, :]).reshape(-1, hidden)
  assert_within(d_y, want_dy, np.abs(want_dy), dtype, 1, "unpermute dy")
  products = dy64[:, None, :] * y64[rows]
  assert_within(d_weights, products.sum(-1), np.abs(products).sum(-1), jnp.float32, hidden,
                "unpermute dweights")


# --- scaled_activation -----------------------------------------------------------------


@st.composite
def activation_parameters(draw, max_limit: float) -> dict:
  """limit, alpha and linear_offset of the activations (limits up to `max_limit`), float32
  values: the ops compute in fp32, so a float64 parameter is rounded to float32 first (a
  limit of 1.9999999999999991 is 2.0, which decides whether x = 2 is clamped; CI's draw of
  session 53 found the float64 model disagreeing there)."""
  return dict(limit=draw(st.floats(0.25, max_limit, width=32)),
              alpha=draw(st.floats(0.5, 3.0, width=32)),
              linear_offset=draw(st.floats(-1.5, 1.5, width=32)))


@st.composite
def activation_problems(draw):
  activation = draw(st.sampled_from(["swiglu", "srelu", "clamped_swiglu"]))
  leading = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=2)))
  features = draw(st.integers(1, 40))
  return dict(activation=activation, leading=leading, features=features,
              params=draw(activation_parameters(max_limit=8.0)),
              magnitude=draw(st.sampled_from([0.05, 1.0, 4.0, 12.0])),
              dtype=draw(st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])),
              seed=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@PROPERTY
@given(problem=activation_problems())
# x = 2.0 exactly at limit 2.0: the clamp's boundary (session 53's CI draw, there with the
# float64 limit 1.9999999999999991, which the ops round to 2.0).
@example(problem=dict(activation="clamped_swiglu", leading=(2, 4), features=5,
                      params=dict(limit=2.0, alpha=1.0, linear_offset=0.0), magnitude=1.0,
                      dtype=jnp.bfloat16, seed=0))
def test_scaled_activation_and_its_gradients_match_float64_numpy(implementation, problem):
  """fp32 math (the float32 bound of the module docstring) and one rounding of out and dx
  to x's dtype; dscales in float32."""
  impl, platform = implementation
  activation, leading, features = problem["activation"], problem["leading"], problem["features"]
  dtype = problem["dtype"]
  params = problem["params"]
  rng = np.random.default_rng(problem["seed"])
  width = features if activation == "srelu" else 2 * features
  x = helpers.random_array(rng, (*leading, width), dtype, scale=problem["magnitude"])
  scales = jnp.asarray(rng.uniform(0.1, 1.5, leading), jnp.float32)
  d_out = helpers.random_array(rng, (*leading, features), dtype)
  x_, scales_, d_out_ = on(platform, x, scales, d_out)

  def forward(x, scales):
    return jaxfuse.scaled_activation(x, scales, activation, implementation=impl, **params)

  out, vjp = jax.vjp(jax.jit(forward), x_, scales_)
  d_x, d_scales = vjp(d_out_)
  assert (out.dtype, d_x.dtype, d_scales.dtype) == (dtype, dtype, jnp.float32)

  spec = (activation, params["limit"], params["alpha"], params["linear_offset"])
  value = np_act(x, *spec)[0]
  want_dx, want_dscales = np_backward(d_out, x, scales, *spec)
  s64, g64 = helpers.as_f64(scales)[..., None], helpers.as_f64(d_out)
  checks = [("out", out, value * s64, np.abs(value * s64), dtype),
            ("dx", d_x, want_dx, np.abs(want_dx), dtype),
            # dscales[row] = sum_j dy_j act_j: bounded by the sum of |terms|.
            ("dscales", d_scales, want_dscales, np.sum(np.abs(g64 * value), -1), jnp.float32)]
  for what, actual, expected, magnitude, out_dtype in checks:
    assert_float32_within(f"{what} ({activation})", actual, expected, magnitude, out_dtype)


# --- scaled_activation_quantize / scaled_dactivation_quantize (fused with FP8) --------


def scale_amaxes(q, expected, slack):
  """(amax implied by each scale, float64 amax of `expected` over the scale's elements,
  its slack) for every scaling mode: per tensor, per group of rows (rows past the groups
  in none), per 1 x block of a row."""
  values = np.abs(expected).reshape(-1, expected.shape[-1])
  slack = slack.reshape(values.shape)
  scale_inv = np.asarray(jax.device_get(q.scale_inv)).astype(np.float64)
  if q.scaling_mode in ("per_tensor", "per_group"):
    rows = values.shape[0]
    offsets = (np.asarray([0, rows]) if q.scaling_mode == "per_tensor"
               else np.clip(np.asarray(q.group_offsets), 0, rows))
    pairs = [(values[a:b].max(initial=0.0), slack[a:b].max(initial=0.0))
             for a, b in zip(offsets[:-1], offsets[1:])]
  else:
    block = q.block_size
    pad = (-values.shape[1]) % block
    blocked = lambda v: np.pad(v, ((0, 0), (0, pad))).reshape(v.shape[0], -1, block)
    pairs = list(zip(blocked(values).max(-1).ravel(), blocked(slack).max(-1).ravel()))
    scale_inv = scale_inv.ravel()
    if q.scaling_mode == "mxfp8":
      scale_inv = np.exp2(scale_inv - 127)
  amax, amax_slack = (np.asarray(v) for v in zip(*pairs))
  return scale_inv, amax, amax_slack


def assert_quantized(what, q, expected, slack):
  """The FP8 values of `expected` (float64) computed in fp32 within `slack` of it: each
  dequantized element within half an FP8 ulp (plus the slack) or half the subnormal step;
  each scale maps its amax to the format's maximum (MXFP8: the power of two at or above
  amax / max); rows a per-group scale does not cover are zeros."""
  fmt = "e5m2" if q.data.dtype == jnp.float8_e5m2 else "e4m3"
  fp8_max, mantissa = FP8_MAX[fmt], {"e4m3": 3, "e5m2": 2}[fmt]
  half_subnormal = 2.0**-10 if fmt == "e4m3" else 2.0**-17
  s = element_scale_inv(q)
  deq = helpers.as_f64(q.data) * s
  covered = s > 0
  bound = (2.0**-(mantissa + 1) * (np.abs(expected) + slack) + slack + half_subnormal * s
           + 1e-30)
  excess = (np.abs(deq - expected) - bound)[covered]
  assert (excess <= 0).all(), f"{what}: {int((excess > 0).sum())} values past the FP8 bound"
  assert (deq[~covered] == 0).all(), f"{what}: rows past the groups are not zero"
  scale_inv, amax, amax_slack = scale_amaxes(q, expected, slack)
  nonzero = amax - amax_slack > 0
  implied, low, high = scale_inv * fp8_max, amax - amax_slack, amax + amax_slack
  if q.scaling_mode == "mxfp8":  # a power of two in [amax, 2 amax)
    ok = (implied >= low * (1 - 1e-6)) & (implied <= 2 * high * (1 + 1e-6))
  else:
    ok = (implied >= low * (1 - 1e-6)) & (implied <= high * (1 + 1e-6))
  assert ok[nonzero].all(), f"{what}: {int((~ok[nonzero]).sum())} scales off their amax"
  assert (scale_inv[amax == 0] == 1.0).all(), f"{what}: the scale of an all-zero group"


@st.composite
def activation_quantize_problems(draw):
  rows = draw(st.integers(1, 40))
  return dict(rows=rows, features=draw(st.integers(1, 96)), sizes=draw(group_sizes(rows)),
              activation=draw(st.sampled_from(["swiglu", "srelu", "clamped_swiglu"])),
              params=draw(activation_parameters(max_limit=8.0)),
              magnitude=draw(st.sampled_from([0.05, 1.0, 4.0])),
              recipe=draw(st.sampled_from([Float8CurrentScaling(),
                                           Float8CurrentScaling(per_group=False),
                                           Float8BlockScaling(), Float8BlockScaling(block_size=32),
                                           Float8BlockScaling(gradient_format="e5m2"),
                                           MXFP8BlockScaling()])),
              dtype=draw(st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])),
              seed=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@PROPERTY
@given(problem=activation_quantize_problems())
def test_activation_quantize_and_its_backward_match_float64_numpy(implementation, problem):
  """The fused FC1 -> FC2 hand-off: act(x) * scales quantized (never rounded to x's dtype
  first), and the backward: dx in x's dtype, dscales in fp32, dx quantized with the
  gradient format, each against float64 numpy."""
  impl, platform = implementation
  rows, features, sizes, activation, recipe, dtype = (
      problem[key] for key in ("rows", "features", "sizes", "activation", "recipe", "dtype"))
  params = problem["params"]
  rng = np.random.default_rng(problem["seed"])
  width = features if activation == "srelu" else 2 * features
  x = helpers.random_array(rng, (rows, width), dtype, scale=problem["magnitude"])
  scales = jnp.asarray(rng.uniform(0.1, 1.5, rows), jnp.float32)
  d_out = helpers.random_array(rng, (rows, features), dtype)
  x_, scales_, d_out_, sizes_ = on(platform, x, scales, d_out, jnp.asarray(sizes, jnp.int32))
  options = dict(recipe=recipe, implementation=impl, **params)

  q = jax.jit(lambda x, s, g: jaxfuse.scaled_activation_quantize(
      x, s, g, activation, **options))(x_, scales_, sizes_)
  q_dx, d_x, d_scales = jax.jit(lambda dy, x, s, g: jaxfuse.scaled_dactivation_quantize(
      dy, x, s, g, activation, return_dx=True, **options))(d_out_, x_, scales_, sizes_)
  assert (q.data.dtype, q.role, q.data.shape) == (jnp.float8_e4m3fn, "forward", (rows, features))
  want_fmt = jnp.float8_e5m2 if recipe.gradient_format == "e5m2" else jnp.float8_e4m3fn
  assert (q_dx.data.dtype, q_dx.role, q_dx.data.shape) == (want_fmt, "gradient", x.shape)
  assert (d_x.dtype, d_scales.dtype) == (dtype, jnp.float32)

  spec = (activation, params["limit"], params["alpha"], params["linear_offset"])
  value = np_act(x, *spec)[0]
  s64, g64 = helpers.as_f64(scales)[:, None], helpers.as_f64(d_out)
  want = value * s64
  # fp32 math (the float32 bound of the module docstring) before the one rounding.
  fp32_slack = lambda v: 1e-5 * np.abs(v) + 1e-6 * (np.abs(v).max(initial=0.0) + 1e-30)
  assert_quantized("act", q, want, fp32_slack(want))
  want_dx, want_dscales = np_backward(d_out, x, scales, *spec)
  assert_quantized("dx quantized", q_dx, want_dx, fp32_slack(want_dx))
  half_ulp, half_step = HALF_ULP[jnp.dtype(dtype)], HALF_SUBNORMAL_STEP[jnp.dtype(dtype)]
  dx_bound = fp32_slack(want_dx) * (1 + half_ulp) + half_ulp * np.abs(want_dx) + half_step
  dx_excess = np.abs(helpers.as_f64(d_x) - want_dx) - dx_bound
  assert (dx_excess <= 0).all(), f"dx: worst excess {dx_excess.max():.3g}"
  assert_float32_within("dscales", d_scales, want_dscales, np.sum(np.abs(g64 * value), -1))

# --- quantize / dequantize -------------------------------------------------------------


@st.composite
def quantize_problems(draw):
  rows = draw(st.integers(1, 48))
  return dict(rows=rows, cols=draw(st.integers(1, 300)), sizes=draw(group_sizes(rows)),
              recipe=draw(st.sampled_from([Float8CurrentScaling(),
                                           Float8CurrentScaling(per_group=False),
                                           Float8BlockScaling(), Float8BlockScaling(block_size=32),
                                           MXFP8BlockScaling()])),
              role=draw(st.sampled_from(["forward", "gradient"])),
              dtype=draw(st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])),
              seed=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@PROPERTY
@given(problem=quantize_problems())
def test_quantize_round_trip_stays_within_the_format_bound(implementation, problem):
  """Rows of magnitudes 2^-10..2^6 (f16: 2^-6..2^6, inside its normal range): each scale
  must adapt to its group or block; rows past the groups come back as zeros."""
  impl, platform = implementation
  rows, cols, dtype = problem["rows"], problem["cols"], problem["dtype"]
  rng = np.random.default_rng(problem["seed"])
  low = -6 if dtype == jnp.float16 else -10
  values = rng.standard_normal((rows, cols)) * np.exp2(rng.integers(low, 7, (rows, 1)))
  x = jnp.asarray(values, dtype)
  x_, sizes_ = on(platform, x, jnp.asarray(problem["sizes"], jnp.int32))
  q = jaxfuse.quantize(x_, problem["recipe"], group_sizes=sizes_, role=problem["role"],
                       implementation=impl)
  check_round_trip(x, q)
  deq = jaxfuse.dequantize(q)
  assert deq.dtype == x.dtype and deq.shape == x.shape


# --- grouped_mlp (a composition: FC1, scaled activation, FC2 and their gradients) ------
#
# Each intermediate the op stores is rounded to x's dtype, so its error is propagated, not
# compared: every quantity is carried as its exact float64 value plus a radius bounding
# the distance of the op's value from it (first order in the radius plus the second-order
# terms, with the activations' derivative bounds below). A wrong group, scale, offset or
# operand errs by a share of the value itself; the radius stays a few ulps of the terms.

SUM_TERM = 2.0**-22  # an fp32 sum, per term of its sum of |terms| (4x slack, as assert_within)
FP32_MATH = 2.0**-18  # the kernels' fp32 activation math (approximate exp and rcp), relative
SILU_SLOPE = 1.1  # max |d/dz z sigmoid(z)| = 1.0998
SILU_CURVATURE = 0.5  # max |d2/dz2 z sigmoid(z)|, at z = 0


def rounded(exact, radius, dtype):
  """The radius of a value within `radius` of `exact` once rounded to `dtype`."""
  dtype = jnp.dtype(dtype)
  return radius + HALF_ULP[dtype] * (np.abs(exact) + radius) + HALF_SUBNORMAL_STEP[dtype]


def product(multiply, a, radius_a, b, radius_b, terms):
  """(exact, radius) of an fp32-accumulated bilinear `multiply` of two uncertain operands."""
  abs_a, abs_b = np.abs(a), np.abs(b)
  radius = (multiply(radius_a, abs_b) + multiply(abs_a, radius_b)
            + multiply(radius_a, radius_b)
            + terms * SUM_TERM * multiply(abs_a + radius_a, abs_b + radius_b))
  return multiply(a, b), radius


def grouped_products(sizes, groups):
  """float64 (forward, dgrad, wgrad) of a grouped GEMM over clamped group rows (the
  intermediates are float64 values, which numpy_grouped_linear would round to float32)."""
  def row_slices(rows):
    for g, (start, end) in enumerate(group_rows(sizes, rows)):
      yield g, slice(start, end)

  def forward(a, w):  # [M, K] x [G, K, N] -> [M, N]
    out = np.zeros((a.shape[0], w.shape[2]))
    for g, rows in row_slices(a.shape[0]):
      out[rows] = a[rows] @ w[g]
    return out

  def dgrad(d, w):  # [M, N] x [G, K, N] -> [M, K]
    out = np.zeros((d.shape[0], w.shape[1]))
    for g, rows in row_slices(d.shape[0]):
      out[rows] = d[rows] @ w[g].T
    return out

  def wgrad(a, d):  # [M, K] x [M, N] -> [G, K, N]
    out = np.zeros((groups, a.shape[1], d.shape[1]))
    for g, rows in row_slices(a.shape[0]):
      out[g] = a[rows].T @ d[rows]
    return out

  return forward, dgrad, wgrad


def activation_intervals(h, radius_h, activation, limit, alpha, linear_offset):
  """Exact float64 act(h), d act/d a, d act/d b (None for srelu) and the radius of each
  over every h' within radius_h of h. Kinks (srelu at 0 is smooth in its derivative; the
  clamps of clamped_swiglu are not) widen the derivative's radius to its whole range."""
  if activation == "srelu":
    r = np.maximum(h, 0.0)
    return (r * r, (2 * r + radius_h) * radius_h), (2 * r, 2 * radius_h), (None, None)
  f = h.shape[1] // 2
  a, b, ra, rb = h[:, :f], h[:, f:], radius_h[:, :f], radius_h[:, f:]
  if activation == "swiglu":
    s = 1 / (1 + np.exp(-a))
    gate, d_gate, other = a * s, s * (1 + a * (1 - s)), b
    curvature = SILU_CURVATURE
    kink_a = kink_b = np.zeros(a.shape, bool)
  else:
    ac = np.minimum(a, limit)
    other = np.clip(b, -limit, limit) + linear_offset
    s = 1 / (1 + np.exp(-alpha * ac))
    gate = ac * s
    d_gate = np.where(a > limit, 0.0, s * (1 + alpha * ac * (1 - s)))
    curvature = SILU_CURVATURE * alpha
    kink_a, kink_b = np.abs(a - limit) <= ra, np.abs(np.abs(b) - limit) <= rb
    gate_b = np.where(np.abs(b) > limit, 0.0, gate)
  act = gate * other
  radius_act = SILU_SLOPE * ra * (np.abs(other) + rb) + (np.abs(gate) + SILU_SLOPE * ra) * rb
  d_a = other * d_gate
  radius_d_a = (SILU_SLOPE * rb + (np.abs(other) + rb) * curvature * ra
                + kink_a * SILU_SLOPE * (np.abs(other) + rb))
  d_b = gate if activation == "swiglu" else gate_b
  radius_d_b = SILU_SLOPE * ra + kink_b * (np.abs(gate) + SILU_SLOPE * ra)
  return (act, radius_act), (d_a, radius_d_a), (d_b, radius_d_b)


def assert_inside(what, actual, exact, radius):
  actual = helpers.as_f64(actual)
  assert actual.shape == exact.shape, what
  assert not np.isnan(actual).any(), f"{what}: NaN"
  excess = np.abs(actual - exact) - radius
  assert (excess <= 0).all(), (f"{what}: {int((excess > 0).sum())} elements past the bound, "
                               f"worst by {excess.max():.3g} (radius there "
                               f"{radius.flat[excess.argmax()]:.3g})")


def scaled_activation_backward_intervals(d_a, act, derivatives, s, terms):
  """(dscales, dh) of the fused scaled-activation backward, each (exact, radius), from
  da, act(h) and the activation's derivatives (activation_intervals; None for srelu's
  second) as (exact, radius) pairs and scales s [M, 1] (exact, radius): dscales =
  sum(da act) over `terms` columns and dh = da s act' in fp32, not yet rounded."""
  d_scales = product(lambda u, v: np.sum(u * v, axis=1), *d_a, *act, terms)
  d_as = product(np.multiply, *d_a, *s, 1)
  d_h, radius_dh = [], []
  for derivative, radius_derivative in derivatives:
    if derivative is None:
      continue
    value, radius = product(np.multiply, *d_as, derivative, radius_derivative, 1)
    d_h.append(value)
    radius_dh.append(radius + FP32_MATH * (np.abs(value) + radius))
  return d_scales, (np.concatenate(d_h, axis=1), np.concatenate(radius_dh, axis=1))


def grouped_mlp_intervals(x, kernel1, kernel2, scales, d_out, sizes, activation, params,
                          dtype, radius_scales=None):
  """{name: (exact float64 value, radius)} of grouped_mlp's out, dscales, dx, dkernel1 and
  dkernel2 in `dtype` (dscales: float32): x [M, H], kernel1 [G, H, W], kernel2 [G, F, H],
  scales [M] (within `radius_scales` of the op's), d_out [M, H], all float64.

  The op stores FC1's output h, the scaled activation a, FC2's dgrad da and the
  activation's dx dh in `dtype`: one rounding each, carried through what follows."""
  rows, hidden = x.shape
  groups, ffn = kernel2.shape[0], kernel2.shape[1]
  fc, dgrad, wgrad = grouped_products(sizes, groups)
  zero = np.zeros_like
  s = scales[:, None]
  radius_s = zero(s) if radius_scales is None else radius_scales[:, None]
  # Forward: h = FC1(x) stored, a = act(h) * scales stored, y = FC2(a).
  h, radius_h = product(fc, x, zero(x), kernel1, zero(kernel1), hidden)
  radius_h = rounded(h, radius_h, dtype)
  (act, radius_act), *derivatives = activation_intervals(h, radius_h, activation, **params)
  radius_act = radius_act + FP32_MATH * (np.abs(act) + radius_act)
  a, radius_a = product(np.multiply, act, radius_act, s, radius_s, 1)
  radius_a = rounded(a, radius_a, dtype)
  y, radius_y = product(fc, a, radius_a, kernel2, zero(kernel2), ffn)
  # Backward: da = FC2 dgrad(dy) stored; dscales = sum(da act); dh = da scales act' stored.
  d_a, radius_da = product(dgrad, d_out, zero(d_out), kernel2, zero(kernel2), hidden)
  radius_da = rounded(d_a, radius_da, dtype)
  (d_scales, radius_ds), (d_h, radius_dh) = scaled_activation_backward_intervals(
      (d_a, radius_da), (act, radius_act), derivatives, (s, radius_s), ffn)
  radius_dh = rounded(d_h, radius_dh, dtype)
  intervals = {
      "out": (y, radius_y),
      "dscales": (d_scales, radius_ds),
      "dx": product(dgrad, d_h, radius_dh, kernel1, zero(kernel1), d_h.shape[1]),
      "dkernel1": product(wgrad, x, zero(x), d_h, radius_dh, rows),
      "dkernel2": product(wgrad, a, radius_a, d_out, zero(d_out), rows),
  }
  return {name: (exact, rounded(exact, radius, jnp.float32 if name == "dscales" else dtype))
          for name, (exact, radius) in intervals.items()}


def run_grouped_mlp(problem, implementation, recipe=None):
  """grouped_mlp on fresh random inputs of an mlp problem (rows, hidden, ffn, sizes,
  activation, params, save_activation, dtype, seed) on (implementation, platform):
  (the inputs x, kernel1, kernel2, scales, d_out in float64, out, backward), where
  backward() gives (dx, dkernel1, dkernel2, dscales) for the cotangent d_out."""
  impl, platform = implementation
  rows, hidden, ffn, sizes, activation, dtype = (
      problem[key] for key in ("rows", "hidden", "ffn", "sizes", "activation", "dtype"))
  width = ffn if activation == "srelu" else 2 * ffn
  groups = len(sizes)
  rng = np.random.default_rng(problem["seed"])
  x = helpers.random_array(rng, (rows, hidden), dtype)
  kernel1 = helpers.random_array(rng, (groups, hidden, width), dtype, scale=1 / np.sqrt(hidden))
  kernel2 = helpers.random_array(rng, (groups, ffn, hidden), dtype, scale=1 / np.sqrt(ffn))
  scales = jnp.asarray(rng.uniform(0.1, 1.5, rows), jnp.float32)
  d_out = helpers.random_array(rng, (rows, hidden), dtype)
  args = on(platform, x, kernel1, kernel2, scales, d_out, jnp.asarray(sizes, jnp.int32))
  group_sizes_ = args[5]

  def forward(x, kernel1, kernel2, scales):
    return jaxfuse.grouped_mlp(x, kernel1, kernel2, group_sizes_, scales, activation,
                               recipe=recipe, save_activation=problem["save_activation"],
                               implementation=impl, **problem["params"])

  out, vjp = jax.vjp(jax.jit(forward), *args[:4])
  inputs = tuple(helpers.as_f64(v) for v in (x, kernel1, kernel2, scales, d_out))
  return inputs, out, lambda: vjp(args[4])


@st.composite
def mlp_problems(draw):
  rows = draw(st.integers(1, 64))
  return dict(rows=rows, hidden=8 * draw(st.integers(1, 5)), ffn=8 * draw(st.integers(1, 5)),
              sizes=draw(group_sizes(rows, max_groups=8)),
              activation=draw(st.sampled_from(["swiglu", "srelu", "clamped_swiglu"])),
              # Limits small enough for h (about unit normal) to be clamped.
              params=draw(activation_parameters(max_limit=3.0)),
              save_activation=draw(st.booleans()),
              dtype=draw(st.sampled_from([jnp.bfloat16, jnp.float16])),
              seed=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@PROPERTY
@given(problem=mlp_problems())
def test_grouped_mlp_and_its_gradients_match_float64_numpy(implementation, problem):
  """y = FC2(act(FC1(x)) * scales) per group, dx, dkernel1, dkernel2 and dscales; FC1's
  output, the scaled activation, FC2's dgrad and the activation's dx are each stored in x's
  dtype (one rounding each, propagated through what follows)."""
  rows, sizes, activation, dtype = (problem[key] for key in ("rows", "sizes", "activation",
                                                             "dtype"))
  inputs, out, backward = run_grouped_mlp(problem, implementation)
  d_x, d_kernel1, d_kernel2, d_scales = backward()
  assert (out.dtype, d_x.dtype, d_kernel1.dtype, d_kernel2.dtype, d_scales.dtype) == (
      dtype, dtype, dtype, dtype, jnp.float32)

  bounds = grouped_mlp_intervals(*inputs, sizes, activation, problem["params"], dtype)
  for what, actual in (("out", out), ("dscales", d_scales), ("dx", d_x),
                       ("dkernel1", d_kernel1), ("dkernel2", d_kernel2)):
    assert_inside(f"{what} ({activation})", actual, *bounds[what])
  assert_zero_past_groups(sizes, rows, {"out": out, "dx": d_x, "dscales": d_scales},
                          {"dkernel1": d_kernel1, "dkernel2": d_kernel2})


# --- grouped_mlp in FP8 (Float8CurrentScaling(per_group=True)) -------------------------
#
# An E4M3 rounding errs by up to 2^-4 of its value, so radii that grow by half an ulp at
# every rounding (as above) would bound nothing useful. Here a rounding maps the interval
# of a value to the interval of its rounded ends: a value whose interval holds no rounding
# boundary (nearly all of them, since every input and weight is exact and the fp32 math
# errs by ~2^-18) is exact after it. Only values near a boundary of bf16, of E4M3 or E5M2,
# or in a group whose scale is uncertain keep a radius, so each output is bounded to about
# the FP8 GEMMs' accumulation error of the exact FP8 computation.

FP8_DTYPE = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
FP32_DIVISION = 2.0**-22  # the scale fp8_max / amax and its inverse: fp32, 2x slack
FLOAT32_MAX = float(np.finfo(np.float32).max)


def rounded_interval(center, radius, dtype):
  """(center, radius) of the interval of a value within `radius` of `center` once rounded
  to `dtype` (ml_dtypes or numpy): the rounded ends, nudged outward by 2^-40 so that a
  double rounding on the way (float64 -> float32 -> 8 or 16 bits) cannot move an end
  inward."""
  lo, hi = center - radius, center + radius
  lo = (lo - np.abs(lo) * 2.0**-40).astype(np.float32).astype(dtype).astype(np.float64)
  hi = (hi + np.abs(hi) * 2.0**-40).astype(np.float32).astype(dtype).astype(np.float64)
  return (lo + hi) / 2, (hi - lo) / 2 + 2.0**-50 * np.maximum(np.abs(lo), np.abs(hi))


def fp8_gemm_output(center, radius, dtype):
  """The FP8 GEMMs round their fp32 result to bfloat16, then cast it to x's dtype."""
  return rounded_interval(*rounded_interval(center, radius, ml_dtypes.bfloat16),
                          jnp.dtype(dtype).type)


def fp8_block_quantized(center, radius, block, fmt):
  """(center, radius) of the dequantized FP8 values (data * scale_inv) that current scaling
  with one scale per `block` = (rows, columns) tile (partial tiles at the ends) gives for
  values within `radius` of `center` [R, C].

  A tile's amax lies between the largest |lower end| and the largest |upper end| of its
  values, so its scale fp8_max / amax (fp32) lies in an interval too: each value is scaled
  by both ends, rounded to the format (saturating) at the extremes and dequantized by both
  ends of 1 / scale. An amax that may be zero allows any scale up to the fp32 cap (the
  scale 1 of a zero amax only applies where every value is zero, which quantizes to 0)."""
  fp8_max = FP8_MAX[fmt]
  rows, columns = center.shape
  block_rows, block_columns = min(block[0], rows), min(block[1], columns)

  def tiles(value):  # [R, C] -> [R / br, br, C / bc, bc], zero-padded (no effect on amax)
    padded = np.pad(value, ((0, -rows % block_rows), (0, -columns % block_columns)))
    return padded.reshape(padded.shape[0] // block_rows, block_rows,
                          padded.shape[1] // block_columns, block_columns)

  low, high = tiles(center - radius), tiles(center + radius)
  abs_low, abs_high = np.abs(low), np.abs(high)
  amax_hi = np.max(np.maximum(abs_low, abs_high), axis=(1, 3), keepdims=True)
  amax_lo = np.max(np.where((low <= 0) & (high >= 0), 0.0, np.minimum(abs_low, abs_high)),
                   axis=(1, 3), keepdims=True)
  zero = amax_hi == 0
  scale_lo = np.where(zero, 1.0, np.minimum(fp8_max / np.where(zero, 1.0, amax_hi),
                                            FLOAT32_MAX) * (1 - FP32_DIVISION))
  scale_hi = np.where(zero, 1.0, np.minimum(fp8_max / np.maximum(amax_lo, 1e-300),
                                            FLOAT32_MAX) * (1 + FP32_DIVISION))
  scaled = np.stack([low * scale_lo, low * scale_hi, high * scale_lo, high * scale_hi])
  scaled_lo = np.clip(scaled.min(axis=0), -fp8_max, fp8_max)
  scaled_hi = np.clip(scaled.max(axis=0), -fp8_max, fp8_max)
  data, data_radius = rounded_interval((scaled_lo + scaled_hi) / 2,
                                       (scaled_hi - scaled_lo) / 2, FP8_DTYPE[fmt])
  data_lo, data_hi = data - data_radius, data + data_radius
  inverse_lo, inverse_hi = 1 / scale_hi, 1 / scale_lo
  out_lo = np.minimum(data_lo * inverse_lo, data_lo * inverse_hi)
  out_hi = np.maximum(data_hi * inverse_lo, data_hi * inverse_hi)

  def untiled(value):
    return value.reshape(value.shape[0] * block_rows, -1)[:rows, :columns]

  return untiled((out_lo + out_hi) / 2), untiled((out_hi - out_lo) / 2)


def group_quantized(center, radius, bounds, fmt, block=None):
  """fp8_block_quantized over each group's rows (bounds[g] = (start, end)): one scale per
  group (Float8CurrentScaling(per_group=True)), or per `block` tile starting at each
  group's first row (Float8BlockScaling's 128 x 1 column-wise blocks); rows past the
  groups quantize to zero."""
  out, out_radius = np.zeros_like(center), np.zeros_like(center)
  for start, end in bounds:
    if start < end:
      out[start:end], out_radius[start:end] = fp8_block_quantized(
          center[start:end], radius[start:end], block or (end - start, center.shape[1]), fmt)
  return out, out_radius


def expert_quantized(kernel, block=None, fmt="e4m3"):
  """Each expert's weight [K, N] with one scale (or one per `block` tile): (center, radius)
  of its dequantized FP8 values, [G, K, N]."""
  pairs = [fp8_block_quantized(w, np.zeros_like(w), block or w.shape, fmt) for w in kernel]
  return np.stack([c for c, _ in pairs]), np.stack([r for _, r in pairs])


def fp8_grouped_mlp_intervals(x, kernel1, kernel2, scales, d_out, sizes, activation, params,
                              dtype, recipe, platform, fp8_wgrad, radius_scales=None):
  """{name: (exact float64 value, radius)} of grouped_mlp's out, dscales, dx, dkernel1 and
  dkernel2 under an FP8 `recipe` on `platform`, as grouped_mlp/api.py computes them.

  Float8CurrentScaling(per_group=True) (Fp8Stages): x, dy, the scaled activation and its
  gradient quantized per group of rows, each weight per expert. Float8BlockScaling
  (_Blockwise): those four in 1 x 128 blocks of each row, the weights in 128 x 128 tiles.
  Forward values in recipe.forward_format, gradients in recipe.gradient_format. FP8 GEMM
  results are rounded to bfloat16 (then x's dtype); the activation and its gradient are
  computed in fp32 and quantized without a rounding to 16 bits. Weight gradients
  (`fp8_wgrad`: whether the op runs them in FP8) come from the same FP8 values (per group),
  from the 16-bit operands quantized in 128 x 1 blocks down each group's rows (blocks), or
  in 16 bits from the activation and dh rounded to x's dtype. The scales are within
  `radius_scales` of the op's (the MoE router's float32 weights), or exact."""
  rows, hidden = x.shape
  groups, ffn = kernel2.shape[0], kernel2.shape[1]
  bounds = group_rows(sizes, rows)
  fc, dgrad, wgrad = grouped_products(sizes, groups)
  zero = np.zeros_like
  s = scales[:, None]
  radius_s = zero(s) if radius_scales is None else radius_scales[:, None]
  forward, gradient = recipe.forward_format, recipe.gradient_format
  blockwise = isinstance(recipe, Float8BlockScaling)

  def rows_quantized(value, fmt):
    if blockwise:
      return fp8_block_quantized(*value, (1, recipe.block_size), fmt)
    return group_quantized(*value, bounds, fmt)

  def fp8_product(multiply, a, b, terms, fast=False):
    # Exact FP8 products; the sum errs by the accumulation bound of test_grouped_linear_fp8
    # (Hopper's fast accumulation: a truncation per 32-term step) of the sum of |products|.
    accumulation = (fast_accumulation_bound(terms) if fast and platform == "gpu"
                    else FP8_ACCUMULATION)
    value, radius = product(multiply, *a, *b, terms=0)
    radius = radius + accumulation * multiply(np.abs(a[0]) + a[1], np.abs(b[0]) + b[1])
    return fp8_gemm_output(value, radius, dtype)

  def rounded_16(value):
    return rounded_interval(*value, jnp.dtype(dtype).type)

  fast = not blockwise and recipe.forward_fast_accumulation
  weight_block = (recipe.block_size,) * 2 if blockwise else None
  x_q = rows_quantized((x, zero(x)), forward)
  w1_q, w2_q = (expert_quantized(k, weight_block, forward) for k in (kernel1, kernel2))
  h, radius_h = fp8_product(fc, x_q, w1_q, hidden, fast)
  (act, radius_act), *derivatives = activation_intervals(h, radius_h, activation, **params)
  radius_act = radius_act + FP32_MATH * (np.abs(act) + radius_act)
  a = product(np.multiply, act, radius_act, s, radius_s, 1)
  a_q = rows_quantized(a, forward)
  y = fp8_product(fc, a_q, w2_q, ffn, fast)
  dy_q = rows_quantized((d_out, zero(d_out)), gradient)
  d_a = fp8_product(dgrad, dy_q, w2_q, hidden)
  d_scales, d_h = scaled_activation_backward_intervals(d_a, (act, radius_act), derivatives,
                                                       (s, radius_s), ffn)
  d_h_q = rows_quantized(d_h, gradient)
  if fp8_wgrad and not blockwise:  # the forward's and the dgrads' FP8 values
    d_kernel2 = fp8_product(wgrad, a_q, dy_q, rows)
    d_kernel1 = fp8_product(wgrad, x_q, d_h_q, rows)
  elif fp8_wgrad:  # the 16-bit operands in 128 x 1 blocks down each group's rows
    def columns_quantized(value, fmt):
      return group_quantized(*value, bounds, fmt, (recipe.block_size, 1))
    d_kernel2 = fp8_product(wgrad, columns_quantized(rounded_16(a), forward),
                            columns_quantized((d_out, zero(d_out)), gradient), rows)
    d_kernel1 = fp8_product(wgrad, columns_quantized((x, zero(x)), forward),
                            columns_quantized(rounded_16(d_h), gradient), rows)
  else:  # 16-bit: the activation and dh rounded to x's dtype, fp32 sums
    d_kernel2 = rounded_16(product(wgrad, *rounded_16(a), d_out, zero(d_out), rows))
    d_kernel1 = rounded_16(product(wgrad, x, zero(x), *rounded_16(d_h), rows))
  return {"out": y, "dscales": rounded_interval(*d_scales, np.float32),
          "dx": fp8_product(dgrad, d_h_q, w1_q, d_h[0].shape[1]),
          "dkernel1": d_kernel1, "dkernel2": d_kernel2}


@st.composite
def fp8_expert_recipes(draw):
  """Float8CurrentScaling(per_group=True) (fast or promoted accumulation) or
  Float8BlockScaling (E4M3 or E5M2 gradients), with FP8 or 16-bit weight gradients; and
  the largest width (in 16s) to draw with it: past one 128-wide block for the blockwise
  recipe, with a partial last one."""
  if draw(st.sampled_from(["current", "block"])) == "current":
    return Float8CurrentScaling(per_group=True, forward_fast_accumulation=draw(st.booleans()),
                                fp8_wgrad=draw(st.booleans())), 3
  return Float8BlockScaling(gradient_format=draw(st.sampled_from(["e4m3", "e5m2"])),
                            fp8_wgrad=draw(st.booleans())), 10


def columnwise_copies(problem):
  """The context an FP8 problem runs in: with problem["columnwise_everywhere"], the
  quantize kernels write the wgrad's column-wise copies whatever the device count (on one
  device, as on the GPU, they do anyway), so the CPU tests' eight devices also take the
  paths that need them (blockwise FP8 weight gradients, moe's gathered FP8 experts)."""
  if problem["columnwise_everywhere"]:
    return quantize_columnwise.fused(True, everywhere=True)
  return contextlib.nullcontext()


def runs_fp8_wgrad(recipe) -> bool:
  """Whether the op runs recipe's weight gradients in FP8 (call it where the op is traced):
  always per group; blockwise only where the column-wise copies are written."""
  return recipe.fp8_wgrad and (isinstance(recipe, Float8CurrentScaling)
                               or quantize_columnwise.fusion_enabled())


@st.composite
def fp8_mlp_problems(draw):
  rows = draw(st.integers(1, 64))
  recipe, max_width = draw(fp8_expert_recipes())
  return dict(rows=rows, hidden=16 * draw(st.integers(1, max_width)),
              ffn=16 * draw(st.integers(1, max_width)),
              sizes=draw(group_sizes(rows, max_groups=8)),
              activation=draw(st.sampled_from(["swiglu", "srelu", "clamped_swiglu"])),
              params=draw(activation_parameters(max_limit=3.0)), recipe=recipe,
              save_activation=draw(st.booleans()),
              columnwise_everywhere=draw(st.booleans()),
              dtype=draw(st.sampled_from([jnp.bfloat16, jnp.float16])),
              seed=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@PROPERTY
@given(problem=fp8_mlp_problems())
def test_fp8_grouped_mlp_is_its_quantized_stages_in_float64(implementation, problem):
  """Under Float8CurrentScaling(per_group=True) and Float8BlockScaling: out, and on the FFI
  paths dx, dkernel1, dkernel2 and dscales, within the interval that the FP8 stages give
  when every quantization and rounding is applied to the interval of its input (see
  fp8_grouped_mlp_intervals). The jnp reference's gradients pass straight through its
  quantization (grouped_mlp/reference.py), so only its forward is checked here."""
  impl, platform = implementation
  rows, sizes, activation, recipe, dtype = (
      problem[key] for key in ("rows", "sizes", "activation", "recipe", "dtype"))
  with columnwise_copies(problem):
    inputs, out, backward = run_grouped_mlp(problem, implementation, recipe)
    fp8_wgrad = runs_fp8_wgrad(recipe)
    if impl == "ffi":
      d_x, d_kernel1, d_kernel2, d_scales = backward()
  assert out.dtype == dtype
  bounds = fp8_grouped_mlp_intervals(*inputs, sizes, activation, problem["params"], dtype,
                                     recipe, platform, fp8_wgrad)
  results = {"out": out}
  if impl == "ffi":
    assert (d_x.dtype, d_kernel1.dtype, d_kernel2.dtype, d_scales.dtype) == (
        dtype, dtype, dtype, jnp.float32)
    results.update(dscales=d_scales, dx=d_x, dkernel1=d_kernel1, dkernel2=d_kernel2)
    assert_zero_past_groups(sizes, rows, {"dx": d_x, "dscales": d_scales},
                            {"dkernel1": d_kernel1, "dkernel2": d_kernel2})
  for what, actual in results.items():
    assert_inside(f"{what} ({activation})", actual, *bounds[what])
  assert_zero_past_groups(sizes, rows, {"out": out})


# --- moe (router, permutation, grouped MLP, unpermute) ---------------------------------


def moe_problem(draw, recipe=None, width_unit=8, max_width=4):
  experts = draw(st.integers(1, 8))
  return dict(tokens=draw(st.integers(1, 40)), experts=experts,
              top_k=draw(st.integers(1, min(3, experts))),
              hidden=width_unit * draw(st.integers(1, max_width)),
              ffn=width_unit * draw(st.integers(1, max_width)),
              activation=draw(st.sampled_from(["swiglu", "srelu", "clamped_swiglu"])),
              params=draw(activation_parameters(max_limit=3.0)),
              scoring=draw(st.sampled_from([("softmax", False), ("softmax", True),
                                            ("sigmoid", True)])),
              recipe=recipe, save_activation=draw(st.booleans()),
              dtype=draw(st.sampled_from([jnp.bfloat16, jnp.float16])),
              seed=draw(st.integers(0, 2**32 - 1)))


@st.composite
def moe_problems(draw):
  return moe_problem(draw)


@st.composite
def fp8_moe_problems(draw):
  recipe, max_width = draw(fp8_expert_recipes())
  return dict(moe_problem(draw, recipe, width_unit=16, max_width=max_width),
              columnwise_everywhere=draw(st.booleans()))


def run_moe(problem, implementation):
  """jaxfuse.moe on fresh random inputs of a moe problem, with its float64 router.

  Problems whose k-th and (k+1)-th logits nearly tie are rejected (hypothesis `assume`):
  either choice is right. Returns a dict: the op's out, aux, and (FFI paths) dkernel1,
  dkernel2 for a random cotangent; the float64 router's weights, experts and aux loss;
  score_radius (how far the op's fp32 combine weights may be from the float64 ones,
  relative); and `sorted`, the expert-sorted rows as grouped_mlp_intervals takes them
  (x, kernel1, kernel2, scales, d_out, sizes), with `rows` [T, k]: each token copy's
  sorted row."""
  impl, platform = implementation
  tokens, experts, top_k, hidden, ffn, activation, dtype = (
      problem[key] for key in ("tokens", "experts", "top_k", "hidden", "ffn", "activation",
                               "dtype"))
  score_function, normalize = problem["scoring"]
  width = ffn if activation == "srelu" else 2 * ffn
  rng = np.random.default_rng(problem["seed"])
  x = helpers.random_array(rng, (tokens, hidden), dtype)
  router = helpers.random_array(rng, (hidden, experts), jnp.float32, scale=2 / np.sqrt(hidden))
  kernel1 = helpers.random_array(rng, (experts, hidden, width), dtype, scale=1 / np.sqrt(hidden))
  kernel2 = helpers.random_array(rng, (experts, ffn, hidden), dtype, scale=1 / np.sqrt(ffn))
  d_out = helpers.random_array(rng, (tokens, hidden), dtype)

  weights, ids, aux_loss = np_router(x, router, top_k, score_function, normalize)
  # The fp32 logits err by at most hidden * 2^-22 of sum |x r| (4x slack); a score (and a
  # normalized weight) moves by a few times that, relative.
  logit_radius = float(np.max(hidden * 2.0**-22 * np.abs(helpers.as_f64(x))
                              @ np.abs(helpers.as_f64(router))))
  if top_k < experts:
    logits = helpers.as_f64(x) @ helpers.as_f64(router)
    ordered = -np.sort(-logits, axis=1)
    assume(np.min(ordered[:, top_k - 1] - ordered[:, top_k]) > 4 * logit_radius + 1e-6)

  x_, router_, kernel1_, kernel2_, d_out_ = on(platform, x, router, kernel1, kernel2, d_out)

  def layer(kernel1, kernel2):
    return jaxfuse.moe(x_, router_, kernel1, kernel2, top_k=top_k, activation=activation,
                       score_function=score_function, normalize_topk=normalize,
                       recipe=problem["recipe"], save_activation=problem["save_activation"],
                       implementation=impl, **problem["params"])

  (out, aux), vjp = jax.vjp(jax.jit(layer), kernel1_, kernel2_)
  result = dict(out=out, aux=aux, weights=weights, aux_loss=aux_loss,
                score_radius=4 * logit_radius + 2.0**-20)
  if impl == "ffi" or problem["recipe"] is None:  # the FP8 reference's are straight-through
    result["dkernel1"], result["dkernel2"] = vjp((d_out_, jnp.zeros((), jnp.float32)))
  assert (out.dtype, out.shape) == (dtype, (tokens, hidden))
  # The expert-sorted rows: a stable sort of the token copies by expert.
  order = np.argsort(ids.reshape(-1), kind="stable")
  token_of_row = order // top_k
  x64, dy64 = helpers.as_f64(x), helpers.as_f64(d_out)
  result["sorted"] = (x64[token_of_row], helpers.as_f64(kernel1), helpers.as_f64(kernel2),
                      weights.reshape(-1)[order], dy64[token_of_row],
                      np.bincount(ids.reshape(-1), minlength=experts))
  row_of_copy = np.empty(tokens * top_k, np.int64)
  row_of_copy[order] = np.arange(tokens * top_k)
  result["rows"] = row_of_copy.reshape(tokens, top_k)
  return result


def assert_moe_within(problem, result, bounds):
  """The layer's out (each token's k expert rows summed in fp32, one rounding) within the
  expert rows' `bounds` (grouped_mlp_intervals or fp8_grouped_mlp_intervals of
  result["sorted"]); the kernels' gradients where they were taken; the load-balancing
  loss."""
  rows, top_k = result["rows"], problem["top_k"]
  y, radius_y = bounds["out"]
  exact = y[rows].sum(1)
  radius = (radius_y[rows].sum(1)
            + top_k * SUM_TERM * (np.abs(y) + radius_y)[rows].sum(1))
  activation = problem["activation"]
  assert_inside(f"out ({activation})", result["out"], exact,
                rounded(exact, radius, problem["dtype"]))
  for what in ("dkernel1", "dkernel2"):
    if what in result:
      assert result[what].dtype == problem["dtype"], (what, result[what].dtype)
      assert_inside(f"{what} ({activation})", result[what], *bounds[what])
  aux, aux_loss = float(result["aux"]), result["aux_loss"]
  assert abs(aux - aux_loss) <= abs(aux_loss) * (result["score_radius"] + 1e-5), (aux, aux_loss)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@PROPERTY
@given(problem=moe_problems())
def test_moe_layer_matches_float64_numpy(implementation, problem):
  """out[t] = sum_j w[t, j] expert_{e[t, j]}(x[t]) with the float64 router's experts and
  weights (problems whose k-th and (k+1)-th scores nearly tie are skipped: either choice
  is right), the grouped MLP's bounds per expert-sorted row, the unpermute's fp32 sum and
  one rounding; the gradients of both expert kernels; the load-balancing loss. (dx also
  flows through the router: test_moe.py checks it.)"""
  result = run_moe(problem, implementation)
  *sorted_rows, sizes = result["sorted"]
  bounds = grouped_mlp_intervals(
      *sorted_rows, sizes, problem["activation"], problem["params"],
      problem["dtype"], radius_scales=result["score_radius"] * sorted_rows[3])
  assert_moe_within(problem, result, bounds)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@PROPERTY
@given(problem=fp8_moe_problems())
def test_fp8_moe_layer_is_its_quantized_stages_in_float64(implementation, problem):
  """As test_moe_layer_matches_float64_numpy, with the experts' FP8 stages
  (fp8_grouped_mlp_intervals) under Float8CurrentScaling(per_group=True), whose FFI path
  quantizes the tokens through the routing (moe/fp8_experts.py) where the weight gradients
  are FP8, and Float8BlockScaling (moe_permute + grouped_mlp + moe_unpermute). The jnp
  reference's gradients are straight-through: only its forward is checked."""
  recipe = problem["recipe"]
  with columnwise_copies(problem):
    result = run_moe(problem, implementation)
    fp8_wgrad = runs_fp8_wgrad(recipe)
  *sorted_rows, sizes = result["sorted"]
  bounds = fp8_grouped_mlp_intervals(
      *sorted_rows, sizes, problem["activation"], problem["params"], problem["dtype"],
      recipe, implementation[1], fp8_wgrad,
      radius_scales=result["score_radius"] * sorted_rows[3])
  assert_moe_within(problem, result, bounds)
