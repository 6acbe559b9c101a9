"""quantize_columnwise_blocks: the blockwise FP8 grouped wgrad's operand (Float8BlockScaling),
x [M, C] transposed per group into the blocked column-wise layout of
cuda/include/jaxfuse/columnwise.h, with one scale per column of x and 128-row block of each
group (scale rows from ColumnwiseScaleRow).

Every handler against the jnp reference (reference.quantize_columnwise_blocks, built on the
1 x 128 block quantization), bit for bit; the reference and the handlers against an
independent float64/numpy reading of the layout (columns of no row zero, scale rows of no
block 1, dequantized blocks within the format's rounding, exact scale_inv); each
(block, column) against jaxfuse.quantize's block_1d of the same values as one row. Cases:
empty groups (first, middle, last), one and many groups, odd sizes, sums short of M,
hostile offsets (negative, decreasing, past M, a first offset > 0), C not a multiple of 16
and C = 1, all-zero blocks, large magnitudes, NaN/inf, empty shapes, jit/vmap, errors; on
the GPU both kernels (raw 16-bit, float) against the CPU handler, and CUDA graphs."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxfuse
from jaxfuse._src import ffi as ffi_registry
from jaxfuse._src.ops.quantize import ffi as quantize_ffi
from jaxfuse._src.ops.quantize import reference
from jaxfuse.quantization import Float8BlockScaling
from tests import helpers

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
FORMATS = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
# Largest relative rounding error of a normal FP8 value (half an ulp: 2^-(mantissa bits + 1))
# and the spacing of the format's subnormals (the absolute error floor, in FP8 units).
ROUNDING = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}
SUBNORMAL_STEP = {"e4m3": 2.0 ** -9, "e5m2": 2.0 ** -16}
BLOCK = quantize_ffi.COLUMNWISE_SCALE_BLOCK
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


def offsets_of(sizes):
  return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)


def multinomial(seed, m, groups):
  return list(np.random.default_rng(seed).multinomial(m, np.ones(groups) / groups))


# name -> (M, offsets int32 [G + 1]) (raw offsets: the hostile ones are not group_offsets').
CASES = {
    "one_group": (300, offsets_of([300])),
    "empty_first_middle_last": (600, offsets_of([0, 250, 0, 350, 0])),
    "odd_sizes_sum_less": (1000, offsets_of([1, 127, 128, 129, 255, 257])),
    "sum_less_than_rows": (700, offsets_of([140, 100, 233])),
    "groups_64": (1000, offsets_of(multinomial(0, 1000, 64))),
    "groups_300": (900, offsets_of(multinomial(1, 900, 300))),  # many empty groups
    "all_empty": (200, offsets_of([0, 0, 0])),
    "negative_offsets": (500, np.array([-5, 10, -3, 200, 150, 499], np.int32)),
    "decreasing_offsets": (500, np.array([0, 300, 100, 50, 400], np.int32)),
    "past_rows": (400, np.array([0, 50, 10 ** 6, 405, 7], np.int32)),
    "first_offset_positive": (600, np.array([37, 300, 301, 555], np.int32)),
    "first_offset_past_blocks": (1000, np.array([700, 800], np.int32)),  # 5 leading slots
    "int32_extremes": (300, np.array([INT32_MIN, 130, INT32_MAX, INT32_MIN], np.int32)),
    "all_past_rows": (300, np.array([301, 5000], np.int32)),
}
QUICK_CASES = ["empty_first_middle_last", "odd_sizes_sum_less", "first_offset_positive",
               "negative_offsets"]
# Offsets group_offsets cannot produce (clamping changes them).
HOSTILE_CASES = ["negative_offsets", "decreasing_offsets", "past_rows", "first_offset_positive",
                 "first_offset_past_blocks", "int32_extremes", "all_past_rows"]
# Every case in bfloat16 / E4M3, the quick ones in the other dtypes and formats (CI time).
DTYPE_FORMAT_CASES = [(case, dtype, fmt) for dtype in DTYPES for fmt in FORMATS
                      for case in CASES
                      if case in QUICK_CASES or (dtype == jnp.bfloat16 and fmt == "e4m3")]


def clamp_offsets(offsets, m):
  """c_g: clamp(offsets, 0, M) made non-decreasing (jaxfuse/grouped_linear.h)."""
  return np.maximum.accumulate(np.clip(np.asarray(offsets, np.int64), 0, m))


def random_x(seed, m, c, dtype, scale=3.0):
  """Normal values with a magnitude per 128-row band (so the blocks' scales differ)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, c)) * scale
  x *= np.exp2(rng.integers(-6, 7, (-(-m // 64), 1))).repeat(64, 0)[:m]
  return jnp.asarray(x, dtype)


def on(backend, *arrays):
  device = jax.devices(backend)[0]
  return [jax.device_put(jnp.asarray(a), device) for a in arrays]


def codes(a):
  return np.asarray(a).view(np.uint8)


def run_op(backend, x, offsets, fmt):
  x, offsets = on(backend, x, offsets)
  fn = jax.jit(lambda x, o: quantize_ffi.quantize_columnwise_blocks(x, o, fmt=fmt))
  return jax.device_get(fn(x, offsets))


def run_reference(x, offsets, fmt):
  x, offsets = on("cpu", x, offsets)
  fn = jax.jit(lambda x, o: reference.quantize_columnwise_blocks(x, o, fmt))
  return jax.device_get(fn(x, offsets))


def same_bits(got, want, msg=""):
  """data (FP8) by bytes, scale_inv by float32 bits. A NaN must stay a NaN at the same
  place, but its code may differ: the GPU's float arithmetic returns its canonical NaN
  (0x7fffffff), which the hardware E5M2 conversion keeps as 0x7f, where the CPU encoder
  writes 0x7e (both NaN; E4M3 has a single NaN code)."""
  for g, w, name in zip(got, want, ("data", "scale_inv")):
    assert g.shape == w.shape and g.dtype == w.dtype, f"{msg} {name}"
    g_bits = np.asarray(g).view(f"u{g.dtype.itemsize}").copy()
    w_bits = np.asarray(w).view(f"u{w.dtype.itemsize}").copy()
    g_nan, w_nan = np.isnan(np.asarray(g, np.float32)), np.isnan(np.asarray(w, np.float32))
    np.testing.assert_array_equal(g_nan, w_nan, err_msg=f"{msg} {name}: NaN positions")
    g_bits[g_nan], w_bits[w_nan] = 0, 0
    np.testing.assert_array_equal(g_bits, w_bits, err_msg=f"{msg} {name}")


# --- an independent numpy reading of the layout ----------------------------------------


def unblocked(data, clamped):
  """The [C, W] column matrix (column col = copy column col) from the blocked storage:
  G + 1 blocks cut at the group starts, each a row-major [C, end - begin] matrix in turn."""
  flat = codes(data).ravel()
  c, width = data.shape
  groups = len(clamped) - 1
  bounds = ([0] + [int(quantize_ffi.columnwise_start(int(clamped[b]), b))
                   for b in range(1, groups + 1)] + [width])
  columns = np.zeros((c, width), np.uint8)
  position = 0
  for begin, end in zip(bounds[:-1], bounds[1:]):
    size = c * (end - begin)
    columns[:, begin:end] = flat[position:position + size].reshape(c, end - begin)
    position += size
  assert position == flat.size
  return columns


def blocks_of(clamped):
  """(group, j, first row, rows, copy column of the first row, scale row) of every block."""
  out = []
  for g in range(len(clamped) - 1):
    start = int(quantize_ffi.columnwise_start(int(clamped[g]), g))
    row = int(quantize_ffi.columnwise_scale_row(int(clamped[g]), g))
    for j, r0 in enumerate(range(int(clamped[g]), int(clamped[g + 1]), BLOCK)):
      n = min(BLOCK, int(clamped[g + 1]) - r0)
      out.append((g, j, r0, n, start + BLOCK * j, row + j))
  return out


def check_against_numpy(x, offsets, data, scale_inv, fmt):
  """The layout and values in float64/numpy: shapes, zero columns, unit scale rows, exact
  scale_inv (float32 ScaleFromAmax), dequantized values within the rounding bound, NaN
  kept, the largest magnitude of each finite block at fp8_max."""
  fp8_dtype, fp8_max = FORMATS[fmt]
  m, c = x.shape
  groups = len(offsets) - 1
  width = quantize_ffi.columnwise_width(m, groups)
  scale_rows = quantize_ffi.columnwise_scale_rows(m, groups)
  assert data.shape == (c, width) and data.dtype == fp8_dtype
  assert scale_inv.shape == (scale_rows, c) and scale_inv.dtype == np.float32
  clamped = clamp_offsets(offsets, m)
  columns = unblocked(data, clamped)
  values = columns.view(fp8_dtype).astype(np.float64)
  x64 = np.asarray(helpers.as_f64(x))
  used_columns = np.zeros(width, bool)
  used_rows = np.zeros(scale_rows, bool)
  for g, j, r0, n, col, row in blocks_of(clamped):
    assert not used_columns[col:col + n].any() and not used_rows[row]
    used_columns[col:col + n] = True
    used_rows[row] = True
    want = x64[r0:r0 + n].T  # [C, n]
    amax = np.where(np.isnan(want), 0.0, np.abs(want)).max(axis=1).astype(np.float32)
    with np.errstate(over="ignore", divide="ignore"):
      scale = np.where((amax > 0) & np.isfinite(amax),
                       np.minimum(np.float32(fp8_max) / amax, np.finfo(np.float32).max),
                       np.float32(1.0)).astype(np.float32)
    np.testing.assert_array_equal(scale_inv[row], np.float32(1.0) / scale,
                                  err_msg=f"scale_inv of block {j} of group {g}")
    got = values[:, col:col + n]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    deq = got * scale_inv[row].astype(np.float64)[:, None]
    bound = ROUNDING[fmt] * np.abs(want) + SUBNORMAL_STEP[fmt] * scale_inv[row][:, None]
    assert (np.abs(deq - want)[finite] <= bound[finite]).all(), f"block {j} of group {g}"
    peak = np.abs(np.where(np.isnan(got), 0.0, got)).max(axis=1)
    full = (amax > 0) & np.isfinite(amax) & (scale < np.finfo(np.float32).max)
    np.testing.assert_array_equal(peak[full], fp8_max)
  assert (columns[:, ~used_columns] == 0).all(), "columns of no row must be zero"
  assert (scale_inv[~used_rows] == 1.0).all(), "scale rows of no block must be 1"


# --- the handlers against the reference and numpy ---------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case, dtype, fmt", DTYPE_FORMAT_CASES)
def test_matches_the_reference_and_numpy(backend, fmt, dtype, case):
  m, offsets = CASES[case]
  c = 40 if backend == "cpu" else 272  # not a multiple of 16; GPU: 3 column tiles
  x = random_x(len(case), m, c, dtype)
  got = run_op(backend, x, offsets, fmt)
  want = run_reference(x, offsets, fmt)
  same_bits(got, want, case)
  check_against_numpy(x, offsets, *got, fmt)


@pytest.mark.parametrize("case", HOSTILE_CASES)
def test_hostile_offsets_equal_their_clamped_offsets(case):
  m, offsets = CASES[case]
  x = random_x(7, m, 24, jnp.bfloat16)
  clamped = clamp_offsets(offsets, m).astype(np.int32)
  got = run_op("cpu", x, offsets, "e4m3")
  same_bits(got, run_op("cpu", x, clamped, "e4m3"), case)
  same_bits(run_reference(x, offsets, "e4m3"), run_reference(x, clamped, "e4m3"), case)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("implementation", ["ffi", "xla"])
def test_every_block_is_the_1x128_block_quantization(backend, fmt, implementation):
  """Each (block, column) against jaxfuse.quantize(Float8BlockScaling) of the block's
  values of that column as one row (zero-padded to 128: zeros change neither the amax nor
  the other values), on the same device."""
  if backend == "gpu" and implementation == "xla":
    pytest.skip("the jnp reference runs on the CPU")
  m, offsets = CASES["odd_sizes_sum_less"]
  c = 33
  x = random_x(3, m, c, jnp.bfloat16)
  data, scale_inv = run_op(backend, x, offsets, fmt)
  clamped = clamp_offsets(offsets, m)
  blocks = blocks_of(clamped)
  rows = np.zeros((len(blocks), c, BLOCK), np.float32)
  xf = np.asarray(x, np.float32)
  for index, (_, _, r0, n, _, _) in enumerate(blocks):
    rows[index, :, :n] = xf[r0:r0 + n].T
  recipe = Float8BlockScaling(forward_format=fmt)
  q = jax.jit(lambda v: jaxfuse.quantize(v, recipe, implementation=implementation))(
      on(backend, jnp.asarray(rows, jnp.bfloat16))[0])
  assert q.scaling_mode == "block_1d" and q.block_size == BLOCK
  q_codes, q_scale_inv = codes(q.data), np.asarray(q.scale_inv)[..., 0]  # [B, C, 128], [B, C]
  columns = unblocked(data, clamped)
  for index, (g, j, _, n, col, row) in enumerate(blocks):
    np.testing.assert_array_equal(scale_inv[row], q_scale_inv[index], err_msg=f"{g}, {j}")
    np.testing.assert_array_equal(columns[:, col:col + n], q_codes[index, :, :n],
                                  err_msg=f"block {j} of group {g}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c", [1, 17, 128, 136])
def test_column_counts(backend, c):
  """C = 1, not a multiple of 8 or 16, one whole 128-column tile, a tile and a bit."""
  m, offsets = CASES["empty_first_middle_last"]
  x = random_x(c, m, c, jnp.float16)
  got = run_op(backend, x, offsets, "e4m3")
  same_bits(got, run_reference(x, offsets, "e4m3"), f"C = {c}")
  check_against_numpy(x, offsets, *got, "e4m3")


def special_x(dtype, fmt):
  """[600, 24] values: block 0 of group 0 all zeros, block 1 of group 0 large (1e4, and
  fp8_max in one column), group 1's block 0 a NaN in column 3 and +inf in column 5, tiny
  but normal values in group 1's block 1 (scale far above 1)."""
  rng = np.random.default_rng(11)
  x = rng.standard_normal((600, 24)) * 2.0
  x[0:128] = 0.0
  x[128:256] *= 1e4 if dtype != jnp.float16 else 5e3
  x[130, 7] = FORMATS[fmt][1] if dtype != jnp.float16 or fmt == "e4m3" else 6e4
  x[300, 3] = np.nan
  x[310, 5] = np.inf
  x[428:556] *= 2.0 ** -12
  return jnp.asarray(x, dtype)


SPECIAL_OFFSETS = np.array([0, 300, 600], np.int32)  # blocks: g0 [0, 128, 256], g1 [300, 428, 556]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_blocks_large_values_nan_and_inf(backend, fmt, dtype):
  x = special_x(dtype, fmt)
  data, scale_inv = got = run_op(backend, x, SPECIAL_OFFSETS, fmt)
  same_bits(got, run_reference(x, SPECIAL_OFFSETS, fmt), "special values")
  check_against_numpy(x, SPECIAL_OFFSETS, data, scale_inv, fmt)
  fp8_max = FORMATS[fmt][1]
  assert np.isfinite(scale_inv).all() and (scale_inv > 0).all()
  columns = unblocked(data, clamp_offsets(SPECIAL_OFFSETS, 600)).view(FORMATS[fmt][0])
  values = columns.astype(np.float32)
  start_1 = int(quantize_ffi.columnwise_start(300, 1))
  row_1 = int(quantize_ffi.columnwise_scale_row(300, 1))
  # The all-zero block: scale 1 and zero bytes.
  assert (scale_inv[0] == 1.0).all() and (codes(columns[:, :128]) == 0).all()
  # The NaN is kept, alone, and ignored by its column's amax; the inf saturates with scale 1.
  assert np.isnan(values[3, start_1]) and np.isnan(values).sum() == 1
  assert scale_inv[row_1, 5] == 1.0 and values[5, start_1 + 10] == fp8_max
  # The other blocks, columns and scale rows are what they are without the NaN and inf.
  clean = np.asarray(x, np.float32).copy()
  clean[300, 3], clean[310, 5] = 0.0, 0.0
  clean_data, clean_scale_inv = run_op(backend, jnp.asarray(clean, dtype), SPECIAL_OFFSETS, fmt)
  changed = scale_inv != clean_scale_inv
  assert not changed[np.arange(len(changed)) != row_1].any()
  assert not changed[row_1, np.arange(24) != 5].any()  # NaN counts as 0: column 3 unchanged
  diff = codes(unblocked(data, clamp_offsets(SPECIAL_OFFSETS, 600))) != codes(
      unblocked(clean_data, clamp_offsets(SPECIAL_OFFSETS, 600)))
  diff[5, start_1:start_1 + 128] = False  # the inf's block and column (rescaled)
  diff[3, start_1] = False  # the NaN itself
  assert not diff.any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape, offsets", [
    ((0, 16), [0, 0]),          # no rows: W = 16 G zero columns, G unit scale rows
    ((0, 5), [3, -1, 2]),
    ((50, 0), [0, 20, 50]),     # no columns: empty data and scale_inv
    ((0, 0), [0, 0]),
], ids=str)
def test_empty_shapes(backend, shape, offsets):
  offsets = np.asarray(offsets, np.int32)
  x = jnp.zeros(shape, jnp.bfloat16)
  got = run_op(backend, x, offsets, "e5m2")
  m, c = shape
  groups = len(offsets) - 1
  assert got[0].shape == (c, quantize_ffi.columnwise_width(m, groups))
  assert got[1].shape == (quantize_ffi.columnwise_scale_rows(m, groups), c)
  assert (codes(got[0]) == 0).all() and (got[1] == 1.0).all()
  same_bits(got, run_reference(x, offsets, "e5m2"))


def test_layout_helpers():
  assert quantize_ffi.columnwise_scale_rows(0, 3) == 3
  assert quantize_ffi.columnwise_scale_rows(128, 1) == 2
  assert quantize_ffi.columnwise_scale_rows(129, 2) == 4
  assert quantize_ffi.columnwise_scale_row(0, 0) == 0
  assert quantize_ffi.columnwise_scale_row(255, 3) == 4
  # Consecutive groups never share a scale row, whatever their sizes.
  rng = np.random.default_rng(5)
  for _ in range(200):
    sizes = rng.integers(0, 400, rng.integers(1, 20))
    clamped = offsets_of(sizes)
    ends = [quantize_ffi.columnwise_scale_row(int(clamped[g]), g) + -(-int(sizes[g]) // BLOCK)
            for g in range(len(sizes))]
    starts = [quantize_ffi.columnwise_scale_row(int(clamped[g]), g) for g in range(len(sizes))]
    assert all(e <= s for e, s in zip(ends[:-1], starts[1:]))
    assert ends[-1] <= quantize_ffi.columnwise_scale_rows(int(clamped[-1]), len(sizes))


def test_jit_lowers_to_one_custom_call_and_vmaps():
  m, offsets = CASES["odd_sizes_sum_less"]
  x = jnp.stack([random_x(s, m, 24, jnp.bfloat16) for s in range(2)])
  fn = lambda x, o: quantize_ffi.quantize_columnwise_blocks(x, o, fmt="e4m3")
  offsets = jnp.asarray(offsets)
  hlo = jax.jit(fn).lower(x[0], offsets).as_text()
  assert hlo.count("jaxfuse_") == 1 and hlo.count("jaxfuse_quantize_columnwise_blocks") == 1
  data, scale_inv = jax.jit(jax.vmap(fn, in_axes=(0, None)))(x, offsets)
  for i in range(2):
    same_bits((data[i], scale_inv[i]), fn(x[i], offsets))


# --- errors ------------------------------------------------------------------------------


def test_python_errors():
  x, offsets = jnp.ones((64, 16), jnp.float32), jnp.asarray([0, 64], jnp.int32)
  call = quantize_ffi.quantize_columnwise_blocks
  with pytest.raises(ValueError, match=r"x must have rank 2 \(\[M, C\]\), got shape \(64,\)"):
    call(jnp.ones((64,), jnp.float32), offsets, fmt="e4m3")
  with pytest.raises(TypeError, match="x must have dtype float32, bfloat16 or float16, got "
                                      "int32"):
    call(x.astype(jnp.int32), offsets, fmt="e4m3")
  with pytest.raises(TypeError, match=r"offsets must be int32 \[G \+ 1\], got float32"):
    call(x, offsets.astype(jnp.float32), fmt="e4m3")
  with pytest.raises(ValueError, match=r"offsets must be int32 \[G \+ 1\] with 1 <= G <= 4096, "
                                       r"got shape \(1,\)"):
    call(x, jnp.zeros((1,), jnp.int32), fmt="e4m3")
  with pytest.raises(ValueError, match=r"with 1 <= G <= 4096, got shape \(4098,\)"):
    call(x, jnp.zeros((4098,), jnp.int32), fmt="e4m3")
  with pytest.raises(ValueError, match=r"with 1 <= G <= 4096, got shape \(2, 2\)"):
    call(x, jnp.zeros((2, 2), jnp.int32), fmt="e4m3")
  with pytest.raises(ValueError, match=r"fmt must be one of \('e4m3', 'e5m2'\), got 'e3m4'"):
    call(x, offsets, fmt="e3m4")


def _raw_call(x, offsets, data, scale_inv):
  """The handler with hand-made result types (the wrapper always builds valid ones)."""
  ffi_registry.ensure_registered()
  types = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (data, scale_inv))
  return jax.ffi.ffi_call("jaxfuse_quantize_columnwise_blocks", types)(x, offsets)


@pytest.mark.parametrize("backend", BACKENDS)
def test_handler_errors(backend):
  f32, e4m3 = jnp.float32, jnp.float8_e4m3fn
  x, offsets, vector, integers, floats, wide = on(
      backend, jnp.ones((200, 24), f32), jnp.asarray([0, 100, 200], jnp.int32),
      jnp.ones((200,), f32), jnp.ones((200, 24), jnp.int32), jnp.asarray([0.0, 1.0], f32),
      jnp.zeros((4098,), jnp.int32))
  # M = 200, G = 2: W = 208 + 32 = 240, S = 2 + 2 = 4.
  good = (((24, 240), e4m3), ((4, 24), f32))
  cases = [
      (vector, offsets, good, r"quantize_columnwise_blocks: x must be a float32/bfloat16/"
                              r"float16 array \[M, C\], got float32 \[200\]"),
      (integers, offsets, good, r"x must be a float32/bfloat16/float16 array \[M, C\], got "
                                r"int32"),
      (x, floats, good, r"quantize_columnwise_blocks: group_offsets must be int32 \[G \+ 1\] "
                        r"with G >= 1, got float32"),
      (x, wide, (((24, 208 + 16 * 4097), e4m3), ((2 + 4097, 24), f32)),
       r"quantize_columnwise_blocks: at most 4096 groups, got 4097"),
      (x, offsets, (((24, 240), jnp.int8), good[1]), "quantized data must be float8_e4m3fn "
                                                     "or float8_e5m2, got unsupported"),
      (x, offsets, (((24, 224), e4m3), good[1]),
       r"quantize_columnwise_blocks: data must be \[C, ColumnwiseWidth\(M, G\)\] = \[24, 240\], "
       r"got \[24, 224\]"),
      (x, offsets, (good[0], ((3, 24), f32)),
       r"quantize_columnwise_blocks: scale_inv must be float32 \[ColumnwiseScaleRows\(M, G\), "
       r"C\] = \[4, 24\], got float32 \[3, 24\]"),
      (x, offsets, (good[0], ((4, 24), jnp.bfloat16)), r"scale_inv must be float32 .* got "
                                                       r"bfloat16 \[4, 24\]"),
  ]
  for operand, offs, types, match in cases:
    with pytest.raises(Exception, match=match):
      jax.block_until_ready(_raw_call(operand, offs, *types))


# --- GPU: both kernels on larger shapes, hostile offsets, CUDA graphs ----------------------


def sizes_offsets(seed, m, groups, total=None):
  return offsets_of(multinomial(seed, m if total is None else total, groups))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, shape, groups", [
    (jnp.bfloat16, (8192, 2048), 8),   # raw 16-bit kernel, whole 128-column tiles
    (jnp.float16, (4000, 1000), 37),   # raw, a partial column tile
    (jnp.bfloat16, (3001, 257), 5),    # float kernel: C % 8 != 0
    (jnp.float32, (2000, 384), 300),   # float kernel, many (and empty) groups
    (jnp.bfloat16, (700, 16), 4096),   # the most groups: 16 KB of offsets in shared memory
], ids=str)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gpu_kernels_match_the_cpu_handler(dtype, shape, groups, fmt):
  m, c = shape
  x = random_x(sum(shape), m, c, dtype)
  offsets = sizes_offsets(groups, m, groups, total=m - m // 10)  # a tail of rows
  got = run_op("gpu", x, offsets, fmt)
  same_bits(got, run_op("cpu", x, offsets, fmt), f"{shape} {groups}")
  if m * c <= 4000 * 1000:
    check_against_numpy(x, offsets, *got, fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_hostile_and_hard_offsets_match_the_cpu_handler(case):
  m, offsets = CASES[case]
  x = random_x(len(case), m, 264, jnp.bfloat16)
  same_bits(run_op("gpu", x, offsets, "e4m3"), run_op("cpu", x, offsets, "e4m3"), case)


@pytest.mark.gpu
@pytest.mark.sanitize
def test_gpu_hostile_offsets_stay_in_bounds():
  """Run under compute-sanitizer (scripts/gpu_run.sh sanitize): offsets far past the rows,
  negative, decreasing, all zero; results as on the CPU."""
  m = 1000
  x = random_x(9, m, 136, jnp.bfloat16)
  for offsets in ([INT32_MIN, INT32_MAX, 5, 7], [2 ** 30, -7, 2 ** 30, INT32_MAX],
                  [0, 0, 0, 0], [m + 1, 0, 0, 0], [999, 1000, 1001, 998]):
    offsets = np.asarray(offsets, np.int32)
    same_bits(run_op("gpu", x, offsets, "e5m2"), run_op("cpu", x, offsets, "e5m2"),
              str(offsets))


_GRAPH_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jaxfuse._src.ops.quantize import ffi as quantize_ffi
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4096, 512)), jnp.bfloat16)
    @jax.jit
    def step(x, offsets):
      data, scale_inv = quantize_ffi.quantize_columnwise_blocks(x * 2, offsets, fmt="e4m3")
      return data.view(jnp.uint8), scale_inv
    results = []
    # One executable (and CUDA graph) replayed with offsets changed on the device.
    for offsets in ([0, 512, 1024, 2048, 4096], [0, 0, 1000, 1000, 3000],
                    [300, 200, 5000, -1, 4096], [0, 1, 2, 3, 4]):
      data, scale_inv = step(x, jnp.asarray(offsets, jnp.int32))
      results.append(np.concatenate([np.asarray(data, np.float32).ravel(),
                                     np.asarray(scale_inv).ravel()]))
    np.save(sys.argv[1], np.stack(results))
""")


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_follow_device_side_offsets(tmp_path):
  graphs = helpers.plain_and_graph_runs(_GRAPH_SCRIPT, tmp_path)
  for a, b in zip(graphs[:-1], graphs[1:]):
    assert not np.array_equal(a, b)
  # And the same as the CPU handler for each set of offsets.
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4096, 512)), jnp.bfloat16)
  for index, offsets in enumerate(([0, 512, 1024, 2048, 4096], [0, 0, 1000, 1000, 3000],
                                   [300, 200, 5000, -1, 4096], [0, 1, 2, 3, 4])):
    data, scale_inv = run_op("cpu", x * 2, np.asarray(offsets, np.int32), "e4m3")
    want = np.concatenate([codes(data).astype(np.float32).ravel(), scale_inv.ravel()])
    np.testing.assert_array_equal(graphs[index], want)
