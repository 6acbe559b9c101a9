"""FP8 quantization: the rounding (handlers vs ml_dtypes, bit for bit), each recipe's
handlers vs the jnp reference (bit for bit), round-trip error bounds vs float64, zero
amax, NaN/Inf, groups (empty, short of rows, negative sizes), vmap, jit, grad, errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxfuse
from jaxfuse.quantization import (Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                                  QuantizedArray)
from tests import helpers

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
FORMATS = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 3), "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 2)}
RECIPES = [Float8CurrentScaling(), Float8CurrentScaling(per_group=False), Float8BlockScaling(),
           Float8BlockScaling(block_size=32), MXFP8BlockScaling()]
GROUPS = [[5, 0, 9, 3], [17], [0, 17], [4, -2, 6], [2, 3]]  # sums 17 or less (rows = 17)


def on(backend, *arrays):
  device = jax.devices(backend)[0]
  return [jax.device_put(a, device) for a in arrays]


def bits(a):
  return np.asarray(a).view(np.uint8)


def same_bits(a, b):
  np.testing.assert_array_equal(bits(a), bits(b))


# --- the FP8 rounding itself -----------------------------------------------------------


def wide_values(rng, fmt):
  """Values across the format's whole range: subnormals, ties, near and above the max."""
  _, fp8_max, mantissa = FORMATS[fmt]
  every_code = np.arange(256, dtype=np.uint8).view(FORMATS[fmt][0]).astype(np.float32)
  every_code = every_code[np.isfinite(every_code)]
  grid = np.sort(np.unique(every_code))
  midpoints = (grid[1:] + grid[:-1]) / 2  # exact ties: round to even
  nudged = np.concatenate([np.nextafter(midpoints, np.float32(np.inf)),
                           np.nextafter(midpoints, np.float32(-np.inf))])
  random = rng.standard_normal(2000).astype(np.float32) * np.exp2(
      rng.integers(-20, 17, 2000)).astype(np.float32)
  big = np.array([fp8_max * 1.03, fp8_max * 1.1, -fp8_max * 5, 3e38, 1e-40, -1e-45], np.float32)
  # inf makes amax infinite, so the per-tensor scale is exactly 1: the raw rounding is tested.
  return np.concatenate([every_code, midpoints, nudged, random, big,
                         np.array([np.inf, -np.inf, np.nan, -0.0], np.float32)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_rounding_matches_ml_dtypes_bit_for_bit(backend, fmt):
  values = wide_values(np.random.default_rng(0), fmt)
  fp8_dtype, fp8_max, _ = FORMATS[fmt]
  recipe = Float8CurrentScaling(per_group=False, forward_format=fmt)
  (x,) = on(backend, jnp.asarray(values[None, :]))
  q = jaxfuse.quantize(x, recipe, implementation="ffi")
  np.testing.assert_array_equal(np.asarray(q.scale_inv), [1.0])
  expected = np.clip(values, -fp8_max, fp8_max).astype(fp8_dtype)  # NaN stays NaN
  got = np.asarray(q.data)[0]
  nan = np.isnan(values)
  np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
  same_bits(got[~nan], expected[~nan])
  same_bits(jaxfuse.quantize(x, recipe, implementation="xla").data[0][~nan], expected[~nan])


# --- handlers vs the reference, bit for bit --------------------------------------------


@functools.cache
def _jitted_ffi_quantize(recipe, static_kwargs):
  """One jitted handler call per (recipe, static keywords): arrays such as group_sizes are
  arguments, so new values reuse the compiled program (CI time)."""
  return jax.jit(lambda x, arrays: jaxfuse.quantize(x, recipe, implementation="ffi",
                                                    **dict(static_kwargs), **arrays))


def quantize_both(backend, x, recipe, **kw):
  """The handler on `backend` and the reference on the CPU.

  The reference is evaluated where its arithmetic is IEEE-exact: XLA's GPU lowering may
  round fp8_max / amax differently in the last bit, which moves scale_inv by an ulp.
  """
  arrays = {k: on(backend, v)[0] for k, v in kw.items() if isinstance(v, jax.Array)}
  static = tuple(sorted((k, v) for k, v in kw.items() if not isinstance(v, jax.Array)))
  q_ffi = _jitted_ffi_quantize(recipe, static)(on(backend, x)[0], arrays)
  kw_cpu = {k: (on("cpu", v)[0] if isinstance(v, jax.Array) else v) for k, v in kw.items()}
  with jax.default_device(jax.devices("cpu")[0]):
    q_ref = jaxfuse.quantize(on("cpu", x)[0], recipe, implementation="xla", **kw_cpu)
  return jax.device_get(q_ffi), jax.device_get(q_ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("role", ["forward", "gradient"])
def test_handler_matches_reference_bits(backend, recipe, dtype, role):
  rng = np.random.default_rng(1)
  shapes = [(17, 64), (17, 200), (17, 13)]
  if backend == "gpu":
    shapes += [(17, 4096), (17, 1000)]
  for shape in shapes:
    for sizes in GROUPS:
      x = helpers.random_array(rng, shape, dtype, scale=3.0)
      q_ffi, q_ref = quantize_both(backend, x, recipe, role=role,
                                   group_sizes=jnp.asarray(sizes, jnp.int32))
      assert q_ffi.data.dtype == jnp.dtype(
          jnp.float8_e5m2 if role == "gradient" and recipe.gradient_format == "e5m2"
          else jnp.float8_e4m3fn)
      assert q_ffi.scale_inv.shape == q_ref.scale_inv.shape
      same_bits(q_ffi.data, q_ref.data)
      np.testing.assert_array_equal(np.asarray(q_ffi.scale_inv), np.asarray(q_ref.scale_inv))
      if isinstance(recipe, Float8BlockScaling) or isinstance(recipe, MXFP8BlockScaling):
        break  # group sizes do not matter


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_128x128_blocks(backend, dtype):
  rng = np.random.default_rng(2)
  for shape in [(3, 200, 130), (256, 128), (5, 7)]:
    x = helpers.random_array(rng, shape, dtype)
    q_ffi, q_ref = quantize_both(backend, x, Float8BlockScaling(), kind="weight")
    assert q_ffi.scale_inv.shape == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    same_bits(q_ffi.data, q_ref.data)
    np.testing.assert_array_equal(np.asarray(q_ffi.scale_inv), np.asarray(q_ref.scale_inv))
    check_round_trip(x, q_ffi)


# --- round-trip error vs float64 ------------------------------------------------------


def element_scale_inv(q):
  """scale_inv broadcast to every element, float64."""
  s = np.asarray(jax.device_get(q.scale_inv))
  shape = q.data.shape
  if q.scaling_mode == "per_tensor":
    return np.full(shape, float(s[0]))
  if q.scaling_mode == "per_group":
    rows = int(np.prod(shape[:-1]))
    offsets = np.asarray(q.group_offsets)
    group = np.searchsorted(np.clip(offsets, 0, rows)[1:], np.arange(rows), side="right")
    per_row = np.concatenate([s, [0.0]])[group]
    return np.broadcast_to(per_row[:, None], (rows, shape[-1])).reshape(shape)
  if q.scaling_mode == "mxfp8":
    s = np.exp2(s.astype(np.float64) - 127)
  if q.scaling_mode == "block_2d":
    b = q.block_size
    return np.repeat(np.repeat(s, b, -1), b, -2)[..., :shape[-2], :shape[-1]]
  return np.repeat(s, q.block_size, -1)[..., :shape[-1]].astype(np.float64)


def check_round_trip(x, q):
  """|dequant - x| <= 2^-(m+1) |x| + half the smallest subnormal step, in scaled units.

  After scaling, an element v = x / scale_inv lies within the FP8 range (|v| <= fp8_max by
  construction of the scale). In the normal range, rounding to nearest with m mantissa bits
  errs by at most half an ulp: 2^-(m+1) relative (2^-4 for E4M3, 2^-3 for E5M2); below the
  smallest normal the error is at most half the subnormal step (2^-10 for E4M3, 2^-17 for
  E5M2), absolute in scaled units. Multiplying back by scale_inv is exact up to fp32
  rounding (2^-24 relative), covered by a small slack.
  """
  fmt = "e5m2" if q.data.dtype == jnp.float8_e5m2 else "e4m3"
  mantissa = FORMATS[fmt][2]
  half_subnormal = 2.0 ** -10 if fmt == "e4m3" else 2.0 ** -17
  x64 = helpers.as_f64(x)
  s = element_scale_inv(q)
  deq = np.asarray(q.data.astype(jnp.float32), np.float64) * s
  covered = s > 0  # per-group rows past the last offset are zeros by design
  bound = 2.0 ** -(mantissa + 1) * np.abs(x64) * (1 + 1e-6) + half_subnormal * s + 1e-30
  error = np.abs(deq - x64)
  assert (error[covered] <= bound[covered]).all(), float(np.max((error - bound)[covered]))
  assert (deq[~covered] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("role", ["forward", "gradient"])
def test_round_trip_error_within_format_bound(backend, recipe, role):
  rng = np.random.default_rng(3)
  # Rows of very different magnitudes: one scale per group / block must adapt.
  x = rng.standard_normal((17, 96)) * np.exp2(rng.integers(-12, 12, (17, 1)))
  x = jnp.asarray(x, jnp.float32)
  for implementation in ("ffi", "xla"):
    (xb,) = on(backend, x)
    q = jaxfuse.quantize(xb, recipe, group_sizes=jnp.asarray([5, 0, 9, 3], jnp.int32),
                         role=role, implementation=implementation)
    check_round_trip(x, q)
    deq = jaxfuse.dequantize(q)
    assert deq.dtype == x.dtype and deq.shape == x.shape
    np.testing.assert_allclose(np.asarray(deq, np.float64),
                               np.asarray(q.data.astype(jnp.float32), np.float64)
                               * element_scale_inv(q), rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_amax_element_maps_to_fp8_max(backend):
  x = jnp.asarray(np.random.default_rng(4).standard_normal((8, 128)), jnp.float32)
  (xb,) = on(backend, x)
  q = jaxfuse.quantize(xb, Float8CurrentScaling(per_group=False), implementation="ffi")
  i = np.unravel_index(np.argmax(np.abs(np.asarray(x))), x.shape)
  assert abs(float(q.data[i].astype(jnp.float32))) == 448.0
  np.testing.assert_allclose(float(q.scale_inv[0]), np.abs(np.asarray(x)).max() / 448, rtol=1e-6)


# --- zero amax, NaN, Inf, groups --------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("implementation", ["ffi", "xla"])
def test_all_zero_rows_and_empty_groups_give_scale_one(backend, recipe, implementation):
  x = np.random.default_rng(5).standard_normal((12, 64)).astype(np.float32)
  x[4:8] = 0.0  # group 1 (rows 4..7) is all zeros; group 2 is empty
  xb, sizes = on(backend, jnp.asarray(x), jnp.asarray([4, 4, 0, 4], jnp.int32))
  q = jaxfuse.quantize(xb, recipe, group_sizes=sizes, implementation=implementation)
  s = np.asarray(q.scale_inv)
  assert np.isfinite(s.astype(np.float32)).all()
  assert not np.isnan(np.asarray(q.data.astype(jnp.float32))).any()
  assert (np.asarray(q.data.astype(jnp.float32))[4:8] == 0).all()
  if recipe == Float8CurrentScaling():
    assert s[1] == 1.0 and s[2] == 1.0
  if isinstance(recipe, Float8BlockScaling):
    assert (s[4:8] == 1.0).all()
  if isinstance(recipe, MXFP8BlockScaling):
    assert (s[4:8] == 127).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("implementation", ["ffi", "xla"])
def test_nan_is_kept_and_inf_saturates(backend, recipe, implementation):
  x = np.random.default_rng(6).standard_normal((6, 64)).astype(np.float32)
  x[1, 3] = np.nan
  x[2, 5] = np.inf
  x[3, 7] = -np.inf
  xb, sizes = on(backend, jnp.asarray(x), jnp.asarray([3, 3], jnp.int32))
  q = jaxfuse.quantize(xb, recipe, group_sizes=sizes, implementation=implementation)
  data = np.asarray(q.data.astype(jnp.float32))
  assert np.isnan(data[1, 3]) and np.isnan(data).sum() == 1
  assert data[2, 5] == 448.0 and data[3, 7] == -448.0
  # NaN does not poison its group's / block's scale.
  assert np.isfinite(np.asarray(q.scale_inv).astype(np.float32)).all()
  assert np.isfinite(data[0]).all() and np.abs(data[1, 4:]).max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_past_the_groups_are_zero_and_negative_sizes_count_as_zero(backend):
  x = jnp.asarray(np.random.default_rng(7).standard_normal((10, 32)) + 3, jnp.bfloat16)
  xb, sizes = on(backend, x, jnp.asarray([3, -4, 2], jnp.int32))
  for implementation in ("ffi", "xla"):
    q = jaxfuse.quantize(xb, Float8CurrentScaling(), group_sizes=sizes,
                         implementation=implementation)
    np.testing.assert_array_equal(np.asarray(q.group_offsets), [0, 3, 3, 5])
    assert (bits(q.data)[5:] == 0).all() and (bits(q.data)[:5] != 0).all()
    assert float(q.scale_inv[1]) == 1.0
    assert (np.asarray(jaxfuse.dequantize(q).astype(jnp.float32))[5:] == 0).all()


def random_sizes(rng, groups, rows):
  """Random group sizes with empty groups, summing to about 90% of rows."""
  sizes = rng.integers(0, 2 * int(0.9 * rows) // groups + 1, groups)
  sizes[rng.random(groups) < 0.2] = 0
  return jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [7, 1500], ids=["7_groups", "1500_groups"])
@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8CurrentScaling(per_group=False)],
                         ids=["per_group", "per_tensor"])
@pytest.mark.parametrize("rows, k", [(40000, 64), (6000, 2048)], ids=["narrow", "wide"])
def test_current_scaling_with_many_rows(backend, groups, recipe, rows, k):
  """Thousands of rows and up to 1500 groups: every row's group is found by a binary search
  over the device offsets and its amax merged atomically into its group's. The GPU's plain
  amax pass (GroupAmaxKernel) takes about 64 KB of rows per block, 512 narrow rows or 16
  wide ones: with 7 groups most blocks lie inside one group (one flat run, one atomic) and
  some straddle a boundary (a warp per row); with 1500 most straddle. A wrong merge at a
  group boundary in either path changes a scale."""
  rng = np.random.default_rng(groups)
  x = helpers.random_array(rng, (rows, k), jnp.bfloat16, scale=2.0)
  x = x.at[rng.integers(0, rows, 50), rng.integers(0, k, 50)].set(40.0)  # lone maxima
  sizes = random_sizes(rng, groups, rows) if recipe.per_group else None
  kw = {"group_sizes": sizes} if sizes is not None else {}
  q_ffi, q_ref = quantize_both(backend, x, recipe, **kw)
  same_bits(q_ffi.data, q_ref.data)
  np.testing.assert_array_equal(np.asarray(q_ffi.scale_inv), np.asarray(q_ref.scale_inv))


# (rows, K, groups or the group sizes): most blocks inside one group and some across
# boundaries; most across (1500 groups); the T=2048 grouped MLP's x (by default four rows,
# 8 KB, a block); sizes summing to less than the rows (the tail in no group).
GROUP_AMAX_CASES = [(40000, 64, 7), (6000, 2048, 1500), (2048, 1024, 8),
                    (301, 64, [40, 0, 200, 50])]

_GROUP_AMAX_SCRIPT = """
import sys
import jax.numpy as jnp, numpy as np
import jaxfuse
from jaxfuse.quantization import Float8CurrentScaling
inputs = np.load(sys.argv[1].rsplit("/", 1)[0] + "/in.npz")
pieces = []
for index in range(len(inputs.files) // 2):
  x = jnp.asarray(inputs[f"x{index}"]).view(jnp.bfloat16)
  q = jaxfuse.quantize(x, Float8CurrentScaling(), group_sizes=jnp.asarray(inputs[f"s{index}"]),
                       implementation="ffi")
  pieces += [np.asarray(q.data).reshape(-1).view(np.uint8),
             np.asarray(q.scale_inv).reshape(-1).view(np.uint8)]
np.save(sys.argv[1], np.concatenate(pieces))
"""


@pytest.mark.gpu
def test_group_amax_rows_per_block_change_no_bit(tmp_path):
  """GroupAmaxKernel with its own rows per block and with JAXFUSE_GROUP_AMAX_ROWS forcing
  1, 3 and more rows than the input has (one block) gives the bits of XLA's per-group
  quantization on the CPU: every split of the rows into blocks, within groups and across
  their boundaries, merges to the same group amaxes. (Session 46's first version compared
  with XLA on the GPU, whose fp8_max / amax moved 1500-group scales by an ulp.)"""
  arrays, pieces = {}, []
  for index, (rows, k, groups) in enumerate(GROUP_AMAX_CASES):
    rng = np.random.default_rng(100 + index)
    x = helpers.random_array(rng, (rows, k), jnp.bfloat16, scale=2.0)
    x = x.at[rng.integers(0, rows, 20), rng.integers(0, k, 20)].set(40.0)  # lone maxima
    sizes = (jnp.asarray(groups, jnp.int32) if isinstance(groups, list)
             else random_sizes(rng, groups, rows))
    arrays[f"x{index}"] = np.asarray(x).view(np.uint16)
    arrays[f"s{index}"] = np.asarray(sizes)
    with jax.default_device(jax.devices("cpu")[0]):  # IEEE-exact: see quantize_both
      q = jaxfuse.quantize(on("cpu", x)[0], Float8CurrentScaling(),
                           group_sizes=on("cpu", sizes)[0], implementation="xla")
    pieces += [np.asarray(q.data).reshape(-1).view(np.uint8),
               np.asarray(q.scale_inv).reshape(-1).view(np.uint8)]
  expected = np.concatenate(pieces)
  np.savez(tmp_path / "in.npz", **arrays)
  outputs = helpers.outputs_under_environments(_GROUP_AMAX_SCRIPT, tmp_path, {
      f"rows_{rows}": {"JAXFUSE_GROUP_AMAX_ROWS": rows}
      for rows in (None, "1", "3", "100000")})
  for name, got in outputs.items():
    assert got.shape == expected.shape, name
    mismatches = np.flatnonzero(got != expected)
    assert mismatches.size == 0, (name, mismatches[:10])


def test_group_offsets_can_be_passed_instead_of_sizes():
  x = jnp.asarray(np.random.default_rng(8).standard_normal((10, 32)), jnp.float32)
  sizes = jnp.asarray([3, 4, 2], jnp.int32)
  a = jaxfuse.quantize(x, Float8CurrentScaling(), group_sizes=sizes, implementation="ffi")
  b = jaxfuse.quantize(x, Float8CurrentScaling(), group_offsets=jaxfuse.group_offsets(sizes),
                       implementation="ffi")
  same_bits(a.data, b.data)


# --- jit, vmap, grad, pytree ------------------------------------------------------------


def test_quantized_array_is_a_pytree_through_jit_and_vmap():
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((3, 12, 64)), jnp.float32)
  sizes = jnp.asarray([[4, 8], [12, 0], [1, 1]], jnp.int32)
  f = jax.jit(jax.vmap(lambda x, s: jaxfuse.quantize(x, Float8CurrentScaling(), group_sizes=s,
                                                     implementation="ffi")))
  q = f(x, sizes)
  assert isinstance(q, QuantizedArray) and q.data.shape == (3, 12, 64)
  assert q.scale_inv.shape == (3, 2) and q.group_offsets.shape == (3, 3)
  for b in range(3):
    single = jaxfuse.quantize(x[b], Float8CurrentScaling(), group_sizes=sizes[b],
                              implementation="xla")
    same_bits(q.data[b], single.data)
  leaves, tree = jax.tree_util.tree_flatten(q)
  assert len(leaves) == 3
  assert jax.tree_util.tree_unflatten(tree, leaves).recipe == Float8CurrentScaling()
  deq = jax.jit(jaxfuse.dequantize)(jaxfuse.quantize(x[0], MXFP8BlockScaling()))
  assert deq.shape == (12, 64)


def test_quantize_stops_gradients():
  x = jnp.asarray(np.random.default_rng(10).standard_normal((4, 32)), jnp.float32)
  for implementation in ("ffi", "xla"):
    g = jax.grad(lambda x: jnp.sum(jaxfuse.dequantize(jaxfuse.quantize(
        x, Float8BlockScaling(), implementation=implementation))))(x)
    np.testing.assert_array_equal(g, np.zeros_like(x))


def test_ffi_lowers_to_one_custom_call():
  x = jnp.ones((16, 64), jnp.bfloat16)
  sizes = jnp.asarray([8, 8], jnp.int32)
  hlo = jax.jit(lambda x, s: jaxfuse.quantize(x, Float8CurrentScaling(), group_sizes=s,
                                              implementation="ffi").data).lower(x, sizes).as_text()
  assert hlo.count("jaxfuse_quantize") == 1 and hlo.count("jaxfuse_group_offsets") == 1


# --- errors ------------------------------------------------------------------------------


def test_errors():
  x = jnp.ones((8, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"per_group=True\) needs group_sizes"):
    jaxfuse.quantize(x, Float8CurrentScaling())
  with pytest.raises(TypeError, match="group_sizes must have dtype int32, got float32"):
    jaxfuse.quantize(x, Float8CurrentScaling(), group_sizes=jnp.ones((2,), jnp.float32))
  with pytest.raises(TypeError, match="recipe must be Float8CurrentScaling"):
    jaxfuse.quantize(x, "fp8")
  with pytest.raises(ValueError, match=r"role must be one of \('forward', 'gradient'\)"):
    jaxfuse.quantize(x, Float8BlockScaling(), role="backward")
  with pytest.raises(ValueError, match="MXFP8BlockScaling quantizes 1 x 32 blocks"):
    jaxfuse.quantize(x, MXFP8BlockScaling(), kind="weight")
  with pytest.raises(ValueError, match="kind must be one of"):
    jaxfuse.quantize(x, Float8BlockScaling(), kind="bias")
  with pytest.raises(ValueError, match="block_size must be a power of two"):
    Float8BlockScaling(block_size=96)
  with pytest.raises(ValueError, match="forward_format must be one of"):
    Float8CurrentScaling(forward_format="e3m4")
  with pytest.raises(TypeError, match="x must have dtype"):
    jaxfuse.quantize(jnp.ones((4, 4), jnp.int32), Float8BlockScaling())
  with pytest.raises(TypeError, match="dequantize expects a QuantizedArray"):
    jaxfuse.dequantize(x)


# --- the grouped GEMM's FP8 forward weights: transposed, per expert ---------------------


def experts_with_special_values(rng, shape, dtype):
  """Random experts [G, K, N]; expert 1 all zeros, expert 2 with NaN, inf and a huge value
  (when G allows), so zero amax, NaN-as-zero amax and infinite amax are all covered."""
  kernel = rng.standard_normal(shape).astype(np.float32) * np.exp2(
      rng.integers(-6, 7, shape[:1])).astype(np.float32)[:, None, None]
  if shape[0] > 1 and kernel[1].size:
    kernel[1] = 0.0
  if shape[0] > 2 and kernel[2].size >= 3:
    kernel[2].flat[0] = np.nan
    kernel[2].flat[1] = 6e4 if dtype == jnp.float16 else 1e30
    kernel[2].flat[2] = -np.inf
  return jnp.asarray(kernel, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 256, 128),  # tiled kernel (GPU), whole tiles
                                   (3, 272, 200),  # tiled, partial tiles in R and C
                                   (2, 48, 392),   # tiled, C % 16 == 8, one partial R tile
                                   (3, 300, 200),  # general kernel (R % 16 != 0), partial tiles
                                   (5, 40, 24),    # general, 8-wide loads, byte stores
                                   (2, 33, 17),    # general, scalar loads and stores
                                   (1, 16, 16)])
def test_experts_transposed_kernel_matches_the_reference_bit_for_bit(backend, dtype, shape):
  from jaxfuse._src.ops.grouped_linear import reference  # pylint: disable=g-import-not-at-top
  recipe = Float8CurrentScaling()
  kernel = experts_with_special_values(np.random.default_rng(sum(shape)), shape, dtype)
  want_data, want_scale_inv = helpers.on_cpu(
      lambda k: reference.quantize_experts_t(k, recipe, "xla"), kernel)
  kernel, = on(backend, kernel)
  data, scale_inv = jax.jit(lambda k: reference.quantize_experts_t(k, recipe, "ffi"))(kernel)
  assert data.shape == (shape[0], shape[2], shape[1]) and data.dtype == jnp.float8_e4m3fn
  same_bits(data, want_data)
  same_bits(scale_inv, want_scale_inv)
  # The same pass can also write the values untransposed ([G, K, N], for the FP8 dgrad).
  both = jax.jit(lambda k: reference.quantize_experts_t(k, recipe, "ffi", untransposed=True))
  data_t, scale_inv_t, data_straight = both(kernel)
  same_bits(data_t, want_data)
  same_bits(scale_inv_t, want_scale_inv)
  same_bits(data_straight, np.swapaxes(np.asarray(want_data), 1, 2))
  # Against float64 numpy: scale_inv = amax / 448 (NaN counts as 0; zero or inf amax give 1),
  # and every finite element round-trips within E4M3's half-ulp (2^-4 relative).
  k64 = np.asarray(helpers.as_f64(kernel))
  magnitude = np.where(np.isnan(k64), 0.0, np.abs(k64))
  amax = magnitude.reshape(shape[0], -1).max(axis=1, initial=0.0)
  expected_scale_inv = np.where((amax > 0) & np.isfinite(amax), amax / 448.0, 1.0)
  np.testing.assert_allclose(np.asarray(scale_inv, np.float64), expected_scale_inv, rtol=1e-6)
  dequantized = np.asarray(data, np.float64) * expected_scale_inv[:, None, None]
  transposed = np.swapaxes(k64, 1, 2)
  # Finite values within the FP8 range at their expert's scale (an infinite amax gives
  # scale 1, so the huge value saturates instead).
  finite = np.abs(transposed) <= 448.0 * expected_scale_inv[:, None, None]
  np.testing.assert_allclose(dequantized[finite], transposed[finite], rtol=2.0 ** -4,
                             atol=expected_scale_inv.max() * 2.0 ** -9)
  assert np.isnan(np.asarray(data, np.float32)[~finite & np.isnan(transposed)]).all()


# --- quantize_batches_transposed: the amax and the transposed pass in one call -------------

# (B, R, C) and dtype, each with the team layout QuantizeBatchesOnePassKernel gets on a
# 132-SM GPU: 132 resident blocks of up to 6 tiles by default, 264 of up to 3 under
# JAXFUSE_QUANTIZE_ONE_PASS_BLOCKS=2, one tile a block under JAXFUSE_QUANTIZE_ONE_PASS_TILES=1.
# (300, 128, 64): one partial tile a batch, 132 (264) teams of one block, the later batches
# in further rounds; (6, 272, 200): partial tiles in R and C, 6 teams; (5, 512, 768): 24
# tiles, 5 teams of 26 (52) blocks, most holding one tile, some none; (2, 2048, 2560): 320
# tiles, 2 teams of 66 (132) blocks holding 5 (3) each, and past what 132 or 264 blocks of
# one tile hold (the amax kernel and the transposed pass then); (8, 1024, 2048): 128 tiles,
# 4 teams of 33 blocks holding 4 in two rounds (6 teams of 22 holding 6 under
# JAXFUSE_QUANTIZE_ONE_PASS_PLAN=most_teams). Batches 1 and 2 hold zeros / NaN, inf, a huge
# value (experts_with_special_values).
ONE_PASS_CASES = [((300, 128, 64), "bfloat16"), ((6, 272, 200), "float16"),
                  ((5, 512, 768), "bfloat16"), ((2, 2048, 2560), "bfloat16"),
                  ((8, 1024, 2048), "bfloat16")]

_ONE_PASS_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jaxfuse._src.ops.quantize import ffi as quantize_ffi
inputs = np.load(sys.argv[1].rsplit("/", 1)[0] + "/in.npz")
run = jax.jit(lambda x: quantize_ffi.quantize_batches_transposed(x, fmt="e4m3",
                                                                 untransposed=True))
pieces = []
for name in sorted(inputs.files, key=int):
  x = jnp.asarray(inputs[name]).view(jnp.bfloat16 if name.endswith("0") else jnp.float16)
  for _ in range(2):  # the second call replays the first's graph, if any
    outputs = run(x)
  pieces += [np.asarray(o).reshape(-1).view(np.uint8) for o in outputs]
np.save(sys.argv[1], np.concatenate(pieces))
"""


def _one_pass_inputs():
  """ONE_PASS_CASES' arrays, keyed "<index>0" (bf16) / "<index>1" (f16) as raw uint16."""
  arrays = {}
  for index, (shape, dtype) in enumerate(ONE_PASS_CASES):
    x = experts_with_special_values(np.random.default_rng(index), shape, getattr(jnp, dtype))
    arrays[f"{index}{int(dtype == 'float16')}"] = np.asarray(x).view(np.uint16)
  return arrays


def test_batches_transposed_matches_the_amax_and_transposed_calls_on_cpu():
  from jaxfuse._src.ops.quantize import ffi as quantize_ffi  # pylint: disable=g-import-not-at-top
  for shape, dtype in ONE_PASS_CASES[:3]:
    x = experts_with_special_values(np.random.default_rng(7), shape, getattr(jnp, dtype))
    one_call = quantize_ffi.quantize_batches_transposed(x, fmt="e5m2", untransposed=True)
    two_calls = quantize_ffi.quantize_transposed(x, quantize_ffi.batch_amax(x), fmt="e5m2",
                                                 untransposed=True)
    for got, want in zip(one_call, two_calls):
      same_bits(got, want)
    assert np.asarray(one_call[1])[1] == 1.0  # batch 1 holds zeros: scale 1


@pytest.mark.gpu
def test_one_pass_batch_quantization_matches_the_cpu_bit_for_bit(tmp_path):
  """The GPU's one-pass kernel (one or two blocks an SM; default tiles a block, and one tile
  a block: many teams and idle blocks; the least-work plan and the most teams; inside XLA's
  CUDA graphs and without) and its two-kernel fallback (JAXFUSE_QUANTIZE_ONE_PASS=0) give
  the CPU handler's bytes on every case."""
  from jaxfuse._src.ops.quantize import ffi as quantize_ffi  # pylint: disable=g-import-not-at-top
  inputs = _one_pass_inputs()
  np.savez(tmp_path / "in.npz", **inputs)
  cpu = jax.devices("cpu")[0]
  pieces = []
  for name in sorted(inputs, key=int):
    x = jax.device_put(jnp.asarray(inputs[name]).view(
        jnp.bfloat16 if name.endswith("0") else jnp.float16), cpu)
    outputs = quantize_ffi.quantize_batches_transposed(x, fmt="e4m3", untransposed=True)
    pieces += [np.asarray(o).reshape(-1).view(np.uint8) for o in outputs]
  expected = np.concatenate(pieces)
  graphs = dict(helpers._COMMAND_BUFFER_FLAGS)["graphs"]  # pylint: disable=protected-access
  one_block = {"JAXFUSE_QUANTIZE_ONE_PASS": None, "JAXFUSE_QUANTIZE_ONE_PASS_BLOCKS": "1",
               "JAXFUSE_QUANTIZE_ONE_PASS_PLAN": None}
  two_blocks = {**one_block, "JAXFUSE_QUANTIZE_ONE_PASS_BLOCKS": "2"}
  outputs = helpers.outputs_under_environments(_ONE_PASS_SCRIPT, tmp_path, {
      "two_kernels": {"JAXFUSE_QUANTIZE_ONE_PASS": "0"},
      "one_pass": {**one_block},
      "one_pass_graphs": {**one_block, "XLA_FLAGS": graphs},
      "one_tile_graphs": {**one_block, "JAXFUSE_QUANTIZE_ONE_PASS_TILES": "1",
                          "XLA_FLAGS": graphs},
      "most_teams": {**one_block, "JAXFUSE_QUANTIZE_ONE_PASS_PLAN": "most_teams"},
      "two_blocks": {**two_blocks},
      "two_blocks_one_tile_graphs": {**two_blocks, "JAXFUSE_QUANTIZE_ONE_PASS_TILES": "1",
                                     "XLA_FLAGS": graphs},
  })
  for name, got in outputs.items():
    assert got.shape == expected.shape, name
    mismatches = np.flatnonzero(got != expected)
    assert mismatches.size == 0, (name, mismatches[:10])


@pytest.mark.parametrize("backend", BACKENDS)
def test_batches_transposed_of_empty_batches_and_bad_inputs(backend):
  from jaxfuse._src.ops.quantize import ffi as quantize_ffi  # pylint: disable=g-import-not-at-top
  empty_rows, no_batches, integers, matrix = on(
      backend, jnp.zeros((3, 0, 16), jnp.bfloat16), jnp.zeros((0, 16, 16), jnp.bfloat16),
      jnp.ones((2, 16, 16), jnp.int32), jnp.ones((16, 16), jnp.bfloat16))
  data, scale_inv, straight = quantize_ffi.quantize_batches_transposed(
      empty_rows, fmt="e4m3", untransposed=True)
  assert data.shape == (3, 16, 0) and straight.shape == (3, 0, 16)
  np.testing.assert_array_equal(np.asarray(scale_inv), [1.0, 1.0, 1.0])
  data, scale_inv, _ = quantize_ffi.quantize_batches_transposed(no_batches, fmt="e4m3")
  assert data.shape == (0, 16, 16) and scale_inv.shape == (0,)
  with pytest.raises(Exception, match=r"quantize_batches_transposed: x must be a "
                                      r"float32/bfloat16/float16 array \[B, R, C\], got int32"):
    jax.block_until_ready(quantize_ffi.quantize_batches_transposed(integers, fmt="e4m3"))
  with pytest.raises(ValueError, match=r"x must have rank 3 \(\[B, R, C\]\), got shape \(16, 16\)"):
    quantize_ffi.quantize_batches_transposed(matrix, fmt="e4m3")


# --- batch_amax (pass 1 of per-tensor current scaling) --------------------------------------

# (B, R, C): one aligned batch; unaligned single batch (vector body + scalar tail); several
# batches whose starts are not 16-byte aligned (scalar path); many rounds of loads per block;
# more batches than the grid's y dimension holds (65535); an empty batch dimension / batch.
AMAX_SHAPES = [(1, 16, 64), (1, 37, 41), (3, 5, 7), (2, 1024, 1032), (70001, 1, 8),
               (0, 4, 8), (2, 0, 8)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", AMAX_SHAPES, ids=str)
def test_batch_amax_matches_numpy(backend, dtype, shape):
  from jaxfuse._src.ops.quantize import ffi as quantize_ffi  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(hash(shape) % 2**32)
  values = rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, shape))
  flat = values.reshape(shape[0], shape[1] * shape[2])
  if flat.size:
    # Each batch's largest magnitude somewhere random, negative in odd batches; batch 0
    # gets a NaN (counted as 0) and, with several batches, batch 1 an inf and the last
    # one only zeros.
    cols = rng.integers(0, flat.shape[1], shape[0])
    flat[np.arange(shape[0]), cols] = np.where(np.arange(shape[0]) % 2, -1, 1) * 1000.0
    flat[0, (cols[0] + 1) % flat.shape[1]] = np.nan
    if shape[0] > 2:
      flat[1, 0] = np.inf
      flat[-1] = 0.0
  x, = on(backend, jnp.asarray(flat.reshape(shape), dtype))
  amax = jax.jit(quantize_ffi.batch_amax)(x)
  assert amax.shape == (shape[0],) and amax.dtype == jnp.float32
  magnitude = np.abs(np.asarray(helpers.as_f64(x)).reshape(shape[0], shape[1] * shape[2]))
  expected = np.where(np.isnan(magnitude), 0.0, magnitude).max(axis=1, initial=0.0)
  np.testing.assert_array_equal(np.asarray(amax, np.float64), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_amax_rejects_bad_inputs(backend):
  from jaxfuse._src.ops.quantize import ffi as quantize_ffi  # pylint: disable=g-import-not-at-top
  integers, matrix = on(backend, jnp.ones((2, 4, 8), jnp.int32), jnp.ones((4, 8), jnp.float32))
  with pytest.raises(Exception, match=r"batch_amax: x must be a float32/bfloat16/float16 "
                                      r"array \[B, R, C\], got int32"):
    jax.block_until_ready(quantize_ffi.batch_amax(integers))
  with pytest.raises(Exception,
                     match=r"batch_amax: x must be .* \[B, R, C\], got float32 \[4, 8\]"):
    jax.block_until_ready(quantize_ffi.batch_amax(matrix))


@pytest.mark.parametrize("backend", BACKENDS)
def test_transposed_quantization_of_empty_experts_still_writes_the_scales(backend):
  from jaxfuse._src.ops.quantize import ffi as quantize_ffi  # pylint: disable=g-import-not-at-top
  kernel, amax = on(backend, jnp.zeros((3, 0, 16), jnp.bfloat16),
                    jnp.asarray([0.0, 896.0, np.inf], jnp.float32))
  data, scale_inv, straight = quantize_ffi.quantize_transposed(kernel, amax, fmt="e4m3",
                                                               untransposed=True)
  assert data.shape == (3, 16, 0) and straight.shape == (3, 0, 16)
  np.testing.assert_array_equal(np.asarray(scale_inv), [1.0, 2.0, 1.0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_transposed_quantization_rejects_bad_shapes(backend):
  from jaxfuse._src.ops.quantize import ffi as quantize_ffi  # pylint: disable=g-import-not-at-top
  kernel, wrong_amax, integers, amax = on(
      backend, jnp.ones((2, 16, 16), jnp.bfloat16), jnp.ones((3,), jnp.float32),
      jnp.ones((2, 16, 16), jnp.int32), jnp.ones((2,), jnp.float32))
  with pytest.raises(Exception, match=r"amax must be float32 \[B = 2\]"):
    jax.block_until_ready(quantize_ffi.quantize_transposed(kernel, wrong_amax, fmt="e4m3"))
  with pytest.raises(Exception, match=r"x must be a float32/bfloat16/float16 array \[B, R, C\]"):
    jax.block_until_ready(quantize_ffi.quantize_transposed(integers, amax, fmt="e4m3"))
