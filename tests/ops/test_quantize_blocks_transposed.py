"""quantize_blocks_transposed: the blockwise FP8 grouped GEMM's weights [B, R, C] with one
scale per 128 x 128 tile, written transposed ([B, C, R]) and optionally untransposed from
one pass. Against a float64/ml_dtypes numpy reference and against the 2-D block
quantization (kind="weight") swapped, bit for bit: partial tiles, zero and subnormal tiles,
an outlier, NaN/inf, both formats, every input dtype, empty shapes, jit, sharding, errors;
on the GPU the tiled kernel (aligned 16-bit) and the general one against the CPU handler."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfuse
from jaxfuse._src import ffi as ffi_registry
from jaxfuse._src.ops.quantize import ffi as quantize_ffi
from jaxfuse._src.ops.quantize import sharding as quantize_sharding
from jaxfuse.quantization import Float8BlockScaling
from tests import helpers

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
FORMATS = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
BLOCK = 128
FLT_MAX = np.float32(np.finfo(np.float32).max)

# (B, R, C): partial tiles in C (48 x 200) and in R (130 x 16), one whole tile, several
# tiles with partial edges, scalar-sized edges (33 x 17), R % 16 != 0 with C % 8 == 0.
SHAPES = [(1, 48, 200), (3, 130, 16), (1, 128, 128), (3, 272, 200), (2, 33, 17),
          (1, 300, 256)]


def on(backend, *arrays):
  device = jax.devices(backend)[0]
  return [jax.device_put(a, device) for a in arrays]


def bits(a):
  """The bit patterns, one unsigned integer per element."""
  a = np.asarray(a)
  return a.view(f"u{a.dtype.itemsize}")


def same_bits(a, b, msg=""):
  np.testing.assert_array_equal(bits(a), bits(b), err_msg=msg)


def same_values(a, b, msg=""):
  """Equal FP8 bytes wherever b is not NaN, NaN where b is (the NaN code may differ between
  ml_dtypes and the kernels' conversion)."""
  a, b = np.asarray(a), np.asarray(b)
  nan = np.isnan(b.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(a.astype(np.float32)), nan, err_msg=msg)
  np.testing.assert_array_equal(bits(a)[~nan], bits(b)[~nan], err_msg=msg)


def numpy_blocks_transposed(x, fmt):
  """(data [B, C, R] FP8, scale_inv float32 [B, ceil(R/128), ceil(C/128)]) in numpy.

  Per tile: amax = max |x| in float64 (NaN counted as 0; exact, then exactly float32), and
  ScaleFromAmax (cuda/include/jaxfuse/fp8.h): scale = float32(fp8_max) / amax in float32,
  1 when amax is 0 or inf, FLT_MAX when the division overflows; scale_inv = 1 / scale;
  data = the float32 product x * scale clipped to +-fp8_max (satfinite) and rounded to
  nearest even by ml_dtypes.
  """
  fp8_dtype, fp8_max = FORMATS[fmt]
  v = np.asarray(helpers.as_f64(x)).astype(np.float32)  # exact: x is float32 or narrower
  b, r, c = v.shape
  rb, cb = -(-r // BLOCK), -(-c // BLOCK)
  magnitude = np.zeros((b, rb * BLOCK, cb * BLOCK), np.float64)
  magnitude[:, :r, :c] = np.where(np.isnan(v), 0.0, np.abs(v.astype(np.float64)))
  amax = magnitude.reshape(b, rb, BLOCK, cb, BLOCK).max(axis=(2, 4)).astype(np.float32)
  with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
    scale = np.float32(fp8_max) / amax
    scale = np.where((amax > 0) & np.isfinite(amax), np.minimum(scale, FLT_MAX),
                     np.float32(1.0)).astype(np.float32)
    scale_inv = (np.float32(1.0) / scale).astype(np.float32)
    full = np.repeat(np.repeat(scale, BLOCK, axis=1), BLOCK, axis=2)[:, :r, :c]
    scaled = (v * full).astype(np.float32)
  data = np.clip(scaled, -fp8_max, fp8_max).astype(fp8_dtype)  # NaN stays NaN
  return np.swapaxes(data, 1, 2), scale_inv


def block_2d(x, fmt, implementation):
  """jaxfuse.quantize(kind="weight") with Float8BlockScaling: (data [B, R, C], scale_inv)."""
  recipe = Float8BlockScaling(forward_format=fmt)
  q = jax.jit(lambda x: jaxfuse.quantize(x, recipe, kind="weight",
                                         implementation=implementation))(x)
  return jax.device_get(q.data), jax.device_get(q.scale_inv)


def blocks_transposed(x, fmt, untransposed):
  fn = jax.jit(lambda x: quantize_ffi.quantize_blocks_transposed(x, fmt=fmt,
                                                                 untransposed=untransposed))
  return jax.device_get(fn(x))


def special_values(rng, shape, dtype, scale=3.0):
  """Random x with tiles of very different magnitudes; where the shape allows, tile (0, 0)
  of the last batch all zeros, tile (0, 1) a NaN and an outlier, tile (1, 0) an inf, and
  tile (0, 0) of batch 0 (if it is not the last) tiny values: float16 subnormals, else
  normal floats near 2^-123, where fp8_max / amax overflows float32. (Not float32
  subnormals: XLA's CPU runtime flushes them, on the host the handlers see zeros.)"""
  b, r, c = shape
  x = rng.standard_normal(shape) * scale
  rb, cb = -(-r // BLOCK), -(-c // BLOCK)
  x *= np.exp2(rng.integers(-8, 9, (b, rb, cb))).repeat(BLOCK, 1).repeat(BLOCK, 2)[:, :r, :c]
  if x.size:
    x[-1, :BLOCK, :BLOCK] = 0.0
    if c > BLOCK:
      x[0, 1, BLOCK + 2] = np.nan
      x[0, 3, BLOCK + 5] = 6e4 if dtype == jnp.float16 else 1e20
    if r > BLOCK:
      x[0, BLOCK + 1, 1] = -np.inf
    if b > 1:
      tiny = 2.0 ** -20 if dtype == jnp.float16 else 2.0 ** -124
      corner = x[0, :BLOCK, :BLOCK].shape
      x[0, :BLOCK, :BLOCK] = (rng.choice([-1.0, 1.0], corner) * tiny
                              * (1.0 + 3.0 * rng.random(corner)))
  return jnp.asarray(x, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_numpy_and_the_2d_block_quantization(backend, fmt, dtype, shape):
  rng = np.random.default_rng(sum(shape))
  x = special_values(rng, shape, dtype)
  want_data, want_scale_inv = numpy_blocks_transposed(x, fmt)
  xb, = on(backend, x)
  data, scale_inv, straight = blocks_transposed(xb, fmt, untransposed=True)
  b, r, c = shape
  assert data.shape == (b, c, r) and data.dtype == FORMATS[fmt][0]
  assert scale_inv.shape == (b, -(-r // BLOCK), -(-c // BLOCK)) and scale_inv.dtype == np.float32
  assert straight.shape == shape and straight.dtype == data.dtype
  np.testing.assert_array_equal(scale_inv, want_scale_inv)
  same_values(data, want_data)
  same_bits(straight, np.swapaxes(data, 1, 2))
  # The 2-D block quantization's kernels (same device): the same bytes, NaN codes too.
  ref_data, ref_scale_inv = block_2d(xb, fmt, "ffi")
  same_bits(data, np.swapaxes(ref_data, 1, 2))
  np.testing.assert_array_equal(scale_inv, ref_scale_inv)
  # Its jnp reference (on the CPU, where XLA's division is IEEE-exact). XLA's CPU code
  # flushes subnormal results, so the tiny tile's scale_inv (1 / FLT_MAX) is 0 there.
  ref_data, ref_scale_inv = block_2d(on("cpu", x)[0], fmt, "xla")
  same_values(data, np.swapaxes(ref_data, 1, 2))
  normal = scale_inv >= np.finfo(np.float32).tiny
  np.testing.assert_array_equal(scale_inv[normal], ref_scale_inv[normal])
  # Without the untransposed copy: the same transposed bytes and an empty third result.
  data_only, scale_inv_only, empty = blocks_transposed(xb, fmt, untransposed=False)
  same_bits(data_only, data)
  np.testing.assert_array_equal(scale_inv_only, scale_inv)
  assert empty.shape == (0,) and empty.dtype == data.dtype


@pytest.mark.sanitize
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_tile_subnormal_tile_and_special_values(backend):
  x = special_values(np.random.default_rng(0), (3, 260, 300), jnp.bfloat16)
  xb, = on(backend, x)
  data, scale_inv, _ = blocks_transposed(xb, "e4m3", untransposed=False)
  values = np.asarray(data, np.float32)  # [B, C, R]
  # All-zero tile: scale 1 and zeros.
  assert scale_inv[2, 0, 0] == 1.0 and (values[2, :BLOCK, :BLOCK] == 0).all()
  # The NaN is kept and ignored by its tile's amax, which is the outlier's.
  assert np.isnan(values[0, BLOCK + 2, 1]) and np.isnan(values).sum() == 1
  assert values[0, BLOCK + 5, 3] == 448.0
  outlier = float(np.asarray(x[0, 3, BLOCK + 5], np.float32))
  np.testing.assert_allclose(scale_inv[0, 0, 1], outlier / 448.0, rtol=1e-6)
  # An infinite amax gives scale 1: the inf saturates, the rest keeps its raw value.
  assert scale_inv[0, 1, 0] == 1.0 and values[0, 1, BLOCK + 1] == -448.0
  # Tiny values: the scale overflows float32 and is clamped to FLT_MAX.
  assert scale_inv[0, 0, 0] == np.float32(1.0) / FLT_MAX
  assert np.abs(values[0, :BLOCK, :BLOCK]).max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_outlier_changes_only_its_tiles_scale(backend):
  rng = np.random.default_rng(1)
  shape = (2, 200, 300)
  x = helpers.random_array(rng, shape, jnp.float32)
  spiked = x.at[1, 130, 140].set(500.0)  # tile (b=1, rb=1, cb=1)
  xb, sb = on(backend, x, spiked)
  data, scale_inv, _ = blocks_transposed(xb, "e4m3", untransposed=False)
  data_s, scale_inv_s, _ = blocks_transposed(sb, "e4m3", untransposed=False)
  changed = scale_inv != scale_inv_s
  assert changed[1, 1, 1] and changed.sum() == 1
  np.testing.assert_allclose(scale_inv_s[1, 1, 1], 500.0 / 448.0, rtol=1e-6)
  diff = bits(data) != bits(data_s)  # [B, C, R]
  inside = np.zeros_like(diff)
  inside[1, BLOCK:2 * BLOCK, BLOCK:] = True
  assert diff[inside].any() and not diff[~inside].any()


@pytest.mark.sanitize
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("untransposed", [False, True])
@pytest.mark.parametrize("shape", [(0, 16, 16), (2, 0, 16), (2, 16, 0), (0, 0, 0)], ids=str)
def test_empty_shapes(backend, untransposed, shape):
  x, = on(backend, jnp.zeros(shape, jnp.bfloat16))
  data, scale_inv, straight = blocks_transposed(x, "e5m2", untransposed)
  b, r, c = shape
  assert data.shape == (b, c, r) and data.dtype == jnp.float8_e5m2
  assert scale_inv.shape == (b, -(-r // BLOCK), -(-c // BLOCK))
  assert straight.shape == (shape if untransposed else (0,))


def test_jit_lowers_to_one_custom_call_and_vmaps():
  x = helpers.random_array(np.random.default_rng(2), (2, 3, 40, 136), jnp.bfloat16)
  fn = lambda x: quantize_ffi.quantize_blocks_transposed(x, fmt="e4m3", untransposed=True)
  hlo = jax.jit(fn).lower(x[0]).as_text()
  assert hlo.count("jaxfuse_") == 1 and hlo.count("jaxfuse_quantize_blocks_transposed") == 1
  assert "stablehlo.transpose" not in hlo
  data, scale_inv, straight = jax.jit(jax.vmap(fn))(x)
  assert data.shape == (2, 3, 136, 40) and scale_inv.shape == (2, 3, 1, 2)
  for i in range(2):
    single = fn(x[i])
    for got, want in zip((data[i], scale_inv[i], straight[i]), single):
      same_bits(got, want)


def test_sharding_rule_public_wrapper():
  x = helpers.random_array(np.random.default_rng(3), (2, 40, 136), jnp.float16)
  data, scale_inv, straight = quantize_sharding.quantize_blocks_transposed(x, fmt="e4m3")
  assert straight is None
  want = quantize_ffi.quantize_blocks_transposed(x, fmt="e4m3", untransposed=True)
  same_bits(data, want[0])
  same_bits(scale_inv, want[1])
  _, _, straight = quantize_sharding.quantize_blocks_transposed(x, fmt="e4m3",
                                                                untransposed=True)
  same_bits(straight, want[2])


# x specs: the batch over a 1-device mesh and over 4 devices (no communication), and R or
# C asked to be sharded (the rule keeps them replicated: tiles are never split).
SPECS = {"batch_1_device": (1, P("data")), "batch": (4, P("data")),
         "rows": (4, P(None, "data")), "cols": (4, P(None, None, "data")),
         "all": (4, P("data", None, "model"))}


@pytest.mark.parametrize("untransposed", [False, True])
@pytest.mark.parametrize("case", list(SPECS))
def test_sharded(case, untransposed):
  devices, spec = SPECS[case]
  if len(jax.devices("cpu")) < devices:
    pytest.skip(f"needs {devices} CPU devices")
  shape = (2, 2) if case == "all" else (devices, 1)
  mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices("cpu")[:devices])
  x, = on("cpu", special_values(np.random.default_rng(4), (4, 136, 264), jnp.bfloat16))
  fn = lambda x: quantize_sharding.quantize_blocks_transposed(x, fmt="e4m3",
                                                              untransposed=untransposed)
  want = jax.device_get(jax.jit(fn)(x))  # unsharded, on the CPU like the mesh
  x = jax.device_put(x, NamedSharding(mesh, spec))
  sharded = jax.jit(fn)
  got = jax.device_get(sharded(x))
  for g, w in zip(got, want):
    if w is None:
      assert g is None
    else:
      same_bits(g, w)
  compiled = sharded.lower(x).compile().as_text()
  if case.startswith("batch"):
    assert "all-gather" not in compiled and "all-to-all" not in compiled
  assert compiled.count("jaxfuse_quantize_blocks_transposed") >= 1


# --- errors ------------------------------------------------------------------------------


def test_python_errors():
  with pytest.raises(ValueError, match=r"x must have rank 3 \(\[B, R, C\]\), got shape "
                                       r"\(16, 16\)"):
    quantize_ffi.quantize_blocks_transposed(jnp.ones((16, 16), jnp.float32), fmt="e4m3")
  with pytest.raises(TypeError, match="x must have dtype float32, bfloat16 or float16, got "
                                      "int32"):
    quantize_ffi.quantize_blocks_transposed(jnp.ones((2, 16, 16), jnp.int32), fmt="e4m3")
  with pytest.raises(ValueError, match=r"fmt must be one of \('e4m3', 'e5m2'\), got 'e3m4'"):
    quantize_ffi.quantize_blocks_transposed(jnp.ones((2, 16, 16), jnp.float32), fmt="e3m4")
  with pytest.raises(ValueError, match=r"x must have rank 3"):
    quantize_sharding.quantize_blocks_transposed(jnp.ones((16,), jnp.float32), fmt="e4m3")


def _raw_call(x, data, scale_inv, straight):
  """The handler with hand-made result types (the wrapper always builds valid ones)."""
  ffi_registry.ensure_registered()
  types = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (data, scale_inv,
                                                                          straight))
  return jax.ffi.ffi_call("jaxfuse_quantize_blocks_transposed", types)(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_handler_errors(backend):
  f32, e4m3 = jnp.float32, jnp.float8_e4m3fn
  x, matrix, integers = on(backend, jnp.ones((2, 16, 200), f32), jnp.ones((16, 200), f32),
                           jnp.ones((2, 16, 200), jnp.int32))
  good = (((2, 200, 16), e4m3), ((2, 1, 2), f32), ((0,), e4m3))
  cases = [
      (matrix, good, r"quantize_blocks_transposed: x must be a float32/bfloat16/float16 "
                     r"array \[B, R, C\], got float32 \[16, 200\]"),
      (integers, good, r"quantize_blocks_transposed: x must be .* \[B, R, C\], got int32"),
      (x, (((2, 200, 16), jnp.int8), *good[1:]), "quantized data must be float8_e4m3fn or "
                                                 "float8_e5m2"),
      (x, (((2, 16, 200), e4m3), *good[1:]), r"quantize_blocks_transposed: data must be "
                                             r"\[B, C, R\] = \[2, 200, 16\], got \[2, 16, 200\]"),
      (x, (good[0], ((2,), f32), good[2]),
       r"quantize_blocks_transposed: scale_inv must be float32 \[B, ceil\(R / 128\), "
       r"ceil\(C / 128\)\] = \[2, 1, 2\], got float32 \[2\]"),
      (x, (good[0], ((2, 1, 2), jnp.bfloat16), good[2]), r"scale_inv must be float32 .* got "
                                                         r"bfloat16 \[2, 1, 2\]"),
      (x, (*good[:2], ((2, 16, 199), e4m3)), r"quantize_blocks_transposed: data_untransposed "
                                             r"must be \[B, R, C\] = \[2, 16, 200\] or \[0\]"),
      (x, (*good[:2], ((2, 16, 200), jnp.float8_e5m2)), r"data_untransposed must be .* in "
                                                        r"data's dtype"),
  ]
  for operand, types, match in cases:
    with pytest.raises(Exception, match=match):
      jax.block_until_ready(_raw_call(operand, *types))


# --- GPU: the tiled and the general kernel on larger shapes ------------------------------


def cpu_handler(x, fmt, untransposed):
  return blocks_transposed(on("cpu", x)[0], fmt, untransposed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("untransposed", [False, True])
def test_gpu_tiled_kernel_matches_the_cpu_handler(dtype, untransposed):
  # C % 8 == 0, R % 16 == 0, 16-bit: the tiled kernel, 8 x 16 x 32 tiles.
  x = special_values(np.random.default_rng(5), (8, 2048, 4096), dtype)
  got = blocks_transposed(on("gpu", x)[0], "e4m3", untransposed)
  want = cpu_handler(x, "e4m3", untransposed)
  for g, w in zip(got, want):
    same_values(g, w)
  ref_data, ref_scale_inv = block_2d(on("gpu", x)[0], "e4m3", "ffi")
  same_bits(got[0], np.swapaxes(ref_data, 1, 2))
  np.testing.assert_array_equal(got[1], ref_scale_inv)


@pytest.mark.sanitize
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, shape", [
    (jnp.float32, (3, 1024, 2048)),   # general kernel: float32 always
    (jnp.bfloat16, (3, 1000, 2048)),  # general: R % 16 != 0
    (jnp.float16, (2, 1040, 2004)),   # general: C % 8 != 0
    (jnp.float32, (2, 33, 17)),       # general: scalar loads and stores
    (jnp.bfloat16, (4, 272, 200)),    # tiled, partial tiles in R and C
], ids=str)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gpu_kernels_on_other_shapes_match_numpy_and_the_cpu_handler(dtype, shape, fmt):
  x = special_values(np.random.default_rng(sum(shape)), shape, dtype)
  got = blocks_transposed(on("gpu", x)[0], fmt, True)
  want = cpu_handler(x, fmt, True)
  for g, w in zip(got, want):
    same_values(g, w)
  want_data, want_scale_inv = numpy_blocks_transposed(x, fmt)
  same_values(got[0], want_data)
  np.testing.assert_array_equal(got[1], want_scale_inv)
  same_bits(got[2], np.swapaxes(got[0], 1, 2))
