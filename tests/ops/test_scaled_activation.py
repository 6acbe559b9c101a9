"""scaled_activation: reference vs float64 numpy, FFI (CPU and CUDA) vs numpy, gradients
(dx and dscales) vs float64 derivatives, clamps, NaN/Inf, large magnitudes, vmap, jit,
the fused backward's HLO, errors."""

from __future__ import annotations

import jax
import jax.test_util  # noqa: F401
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse._src.ops.scaled_activation import reference
from tests import helpers

ACTIVATIONS = ["swiglu", "srelu", "clamped_swiglu"]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (leading shape, F): F multiple of 8 (vector path), odd F (scalar tail), one row, no rows.
SHAPES = [((6,), 16), ((3, 5), 7), ((1,), 1), ((4,), 37), ((0,), 8), ((2, 3), 64)]
# On the GPU, the backward of 16-byte-aligned rows runs the staged kernel (rowwise.cuh) in
# tiles of 512 vectors of 8: F=4800 is a full tile and a ragged one per row.
GPU_SHAPES = SHAPES + [((300,), 1024), ((129,), 4100), ((64,), 4096), ((40,), 4800)]
LIMIT, ALPHA, OFFSET = 7.0, 1.702, 1.0

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]


def on(backend, *arrays):
  device = jax.devices(backend)[0]
  return [jax.device_put(a, device) for a in arrays]


# --- float64 numpy specification -----------------------------------------------------


def np_sigmoid(x):
  with np.errstate(over="ignore", invalid="ignore"):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def np_act(x, activation, limit=LIMIT, alpha=ALPHA, offset=OFFSET):
  """(act, d/da, d/db) in float64."""
  x = helpers.as_f64(x)
  with np.errstate(invalid="ignore", over="ignore"):
    if activation == "srelu":
      r = np.where(x <= 0, 0.0, x)
      return r * r, 2 * r, None
    f = x.shape[-1] // 2
    a, b = x[..., :f], x[..., f:]
    if activation == "swiglu":
      s = np_sigmoid(a)
      return a * s * b, b * s * (1 + a * (1 - s)), a * s
    ac = np.where(a > limit, limit, a)
    bc = np.where(b > limit, limit, np.where(b < -limit, -limit, b)) + offset
    s = np_sigmoid(alpha * ac)
    return (ac * s * bc, np.where(a > limit, 0.0, bc * s * (1 + alpha * ac * (1 - s))),
            np.where((b > limit) | (b < -limit), 0.0, ac * s))


def np_forward(x, scales, activation):
  return np_act(x, activation)[0] * helpers.as_f64(scales)[..., None]


def np_backward(dy, x, scales, activation, limit=LIMIT, alpha=ALPHA, offset=OFFSET):
  value, da, db = np_act(x, activation, limit, alpha, offset)
  g = helpers.as_f64(dy)
  gs = g * helpers.as_f64(scales)[..., None]
  dx = gs * da if db is None else np.concatenate([gs * da, gs * db], axis=-1)
  return dx, np.sum(g * value, axis=-1)


def make_inputs(seed, leading, f, dtype, activation, scale_dtype=jnp.float32, magnitude=2.0):
  rng = np.random.default_rng(seed)
  width = f if activation == "srelu" else 2 * f
  x = helpers.random_array(rng, (*leading, width), dtype, scale=magnitude)
  scales = jnp.asarray(rng.uniform(0.1, 1.5, size=leading), scale_dtype)
  return x, scales


# --- forward -------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_float64_numpy(activation, dtype):
  x, scales = make_inputs(0, (4, 6), 24, dtype, activation, magnitude=4.0)
  out = reference.scaled_activation(x, scales, activation)
  assert out.dtype == x.dtype and out.shape == (4, 6, 24)
  helpers.assert_close(out, np_forward(x, scales, activation), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ffi_matches_float64_numpy(backend, activation, dtype):
  shapes = GPU_SHAPES if backend == "gpu" else SHAPES
  for seed, (leading, f) in enumerate(shapes):
    for scale_dtype in (jnp.float32, dtype):
      x, scales = on(backend, *make_inputs(seed, leading, f, dtype, activation, scale_dtype,
                                           magnitude=4.0))
      out = jax.jit(lambda x, s: jaxfuse.scaled_activation(
          x, s, activation, implementation="ffi"))(x, scales)
      assert out.dtype == x.dtype and out.shape == (*leading, f)
      helpers.assert_close(out, np_forward(x, scales, activation), dtype,
                           msg=f"{leading}x{f} scales {jnp.dtype(scale_dtype)}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ffi_equals_reference_bits_in_float32(backend):
  # Same fp32 formulas. exp's last bits may differ between libm and XLA, and the CUDA
  # kernels use the hardware ex2/rcp approximations (activation.h): under 1e-6 relative
  # for these |x| < 5.
  for activation in ACTIVATIONS:
    x, scales = on(backend, *make_inputs(1, (33,), 40, jnp.float32, activation, magnitude=5.0))
    a = jaxfuse.scaled_activation(x, scales, activation, implementation="ffi")
    b = jaxfuse.scaled_activation(x, scales, activation, implementation="xla")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("limit, alpha, offset", [(7.0, 1.702, 1.0), (2.5, 1.0, 0.0),
                                                  (0.5, 3.0, -1.0)])
def test_clamped_swiglu_clamps(backend, limit, alpha, offset):
  x, scales = on(backend, *make_inputs(2, (16,), 32, jnp.float32, "clamped_swiglu",
                                       magnitude=3 * limit + 1))
  x64 = helpers.as_f64(x)
  assert (x64 > limit).any() and (x64 < -limit).any()
  out = jaxfuse.scaled_activation(x, scales, "clamped_swiglu", limit=limit, alpha=alpha,
                                  linear_offset=offset, implementation="ffi")
  expected = np_act(x, "clamped_swiglu", limit, alpha, offset)[0] * helpers.as_f64(scales)[:, None]
  helpers.assert_close(out, expected, jnp.float32)
  dy = jnp.ones_like(out)
  dx = jax.grad(lambda x: jnp.sum(jaxfuse.scaled_activation(
      x, scales, "clamped_swiglu", limit=limit, alpha=alpha, linear_offset=offset,
      implementation="ffi") * dy))(x)
  _, da, db = np_act(x, "clamped_swiglu", limit, alpha, offset)
  s = helpers.as_f64(scales)[:, None]
  helpers.assert_close(dx, np.concatenate([s * da, s * db], -1), jnp.float32)
  assert (np.asarray(dx)[:, :32][x64[:, :32] > limit] == 0).all()
  assert (np.asarray(dx)[:, 32:][np.abs(x64[:, 32:]) > limit] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("implementation", ["ffi", "xla"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_large_magnitudes_nan_and_inf(backend, implementation, activation):
  f = 16
  width = f if activation == "srelu" else 2 * f
  row = np.zeros(width, np.float32)
  row[:5] = [-1e4, 1e4, -3e4, 80.0, -90.0]
  if activation != "srelu":
    row[f:f + 5] = [1.5, -2.0, 3.0, 1e4, -1e4]
  x = np.stack([row, row * 0.5])
  x[1, 7] = np.nan
  x[1, 8] = np.inf
  x[1, 9] = -np.inf
  scales = np.array([0.5, 2.0], np.float32)
  xj, sj = on(backend, jnp.asarray(x), jnp.asarray(scales))
  out = np.asarray(jaxfuse.scaled_activation(xj, sj, activation, implementation=implementation))
  expected = np_forward(x, scales, activation)
  # Large finite magnitudes never give NaN (stable sigmoid), only the NaN input does.
  assert not np.isnan(out[0]).any()
  assert np.isnan(out[1, 7])
  finite = np.isfinite(expected)
  np.testing.assert_allclose(out[finite], expected[finite], rtol=1e-5, atol=1e-30)
  np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
  # NaN propagates through the backward pass too.
  dx = jax.grad(lambda x: jnp.sum(jaxfuse.scaled_activation(
      x, sj, activation, implementation=implementation)[0]))(xj)
  assert not np.isnan(np.asarray(dx)[0]).any()  # row 0: large but finite inputs
  dx1 = np.asarray(jax.grad(lambda x: jnp.sum(jaxfuse.scaled_activation(
      x, sj, activation, implementation=implementation)[1]))(xj))
  assert np.isnan(dx1[1, 7])


def test_zero_rows_and_zero_scales():
  x, _ = make_inputs(3, (5,), 8, jnp.float32, "swiglu")
  x = x.at[2].set(0.0)
  scales = jnp.asarray([1.0, 0.0, 1.0, 2.0, -1.0], jnp.float32)
  out = np.asarray(jaxfuse.scaled_activation(x, scales, implementation="ffi"))
  assert (out[1] == 0).all() and (out[2] == 0).all()
  helpers.assert_close(out, np_forward(x, scales, "swiglu"), jnp.float32)


# --- gradients ---------------------------------------------------------------------


def loss(activation, implementation):
  def f(x, scales):
    out = jaxfuse.scaled_activation(x, scales, activation, implementation=implementation)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))
  return f


# The reference ("xla") is checked on the CPU, where XLA's arithmetic is the spec's; on the
# GPU, XLA's own lowering of sigmoid/exp at reduced precision is not what this tests.
@pytest.mark.parametrize("backend, implementation", [
    pytest.param("cpu", "ffi", id="ffi-cpu"),
    pytest.param("cpu", "xla", id="xla-cpu"),
    pytest.param("gpu", "ffi", id="ffi-gpu", marks=pytest.mark.gpu),
])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_float64(backend, implementation, activation, dtype):
  for leading, f in [((3, 4), 24), ((5,), 13)]:
    x, scales = on(backend, *make_inputs(4, leading, f, dtype, activation, magnitude=3.0))
    dx, dscales = jax.jit(jax.grad(loss(activation, implementation), argnums=(0, 1)))(x, scales)
    assert dx.dtype == x.dtype and dx.shape == x.shape
    assert dscales.dtype == scales.dtype and dscales.shape == scales.shape
    out = helpers.as_f64(jaxfuse.scaled_activation(x, scales, activation,
                                                   implementation="xla"))
    dy = np.cos(out)  # d sum(sin(out)) / d out, from the same rounded forward
    want_dx, want_ds = np_backward(dy, x, scales, activation)
    helpers.assert_close(dx, want_dx, dtype, msg="dx")
    helpers.assert_close(dscales, want_ds, dtype, msg="dscales")


def test_check_grads_ffi():
  for activation in ACTIVATIONS:
    x, scales = make_inputs(5, (4,), 6, jnp.float32, activation)
    jax.test_util.check_grads(
        lambda x, s: jaxfuse.scaled_activation(x, s, activation, implementation="ffi"),
        (x, scales), order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-2)


def test_backward_is_one_fused_kernel():
  x, scales = make_inputs(6, (8,), 16, jnp.bfloat16, "swiglu")
  hlo = jax.jit(jax.grad(loss("swiglu", "ffi"), argnums=(0, 1))).lower(x, scales).as_text()
  assert hlo.count("jaxfuse_scaled_activation_bwd") == 1
  assert hlo.count("jaxfuse_scaled_activation_fwd") == 1
  assert "logistic" not in hlo and "exponential" not in hlo


def test_gradient_only_wrt_x_still_works():
  x, scales = make_inputs(7, (8,), 16, jnp.bfloat16, "srelu")
  dx = jax.grad(lambda x: loss("srelu", "ffi")(x, scales))(x)
  want = jax.grad(lambda x: loss("srelu", "xla")(x, scales))(x)
  helpers.assert_close(dx, helpers.as_f64(want), jnp.bfloat16)


# --- vmap and jit --------------------------------------------------------------------


def test_vmap():
  x, scales = make_inputs(8, (3, 5), 12, jnp.float32, "swiglu")
  f = lambda x, s: jaxfuse.scaled_activation(x, s, implementation="ffi")
  out = jax.jit(jax.vmap(f))(x, scales)
  helpers.assert_close(out, np_forward(x, scales, "swiglu"), jnp.float32)
  shared = jax.vmap(f, in_axes=(0, None))(x, scales[0])
  for b in range(3):
    helpers.assert_close(shared[b], np_forward(x[b], scales[0], "swiglu"), jnp.float32)
  grads = jax.vmap(jax.grad(loss("swiglu", "ffi"), argnums=(0, 1)))(x, scales)
  want = jax.vmap(jax.grad(loss("swiglu", "xla"), argnums=(0, 1)))(x, scales)
  for got, w in zip(grads, want):
    helpers.assert_close(got, helpers.as_f64(w), jnp.float32)


# --- errors --------------------------------------------------------------------------


def test_errors_name_the_argument():
  x = jnp.ones((4, 8), jnp.float32)
  s = jnp.ones((4,), jnp.float32)
  with pytest.raises(ValueError, match=r"activation must be one of \('swiglu', 'srelu', 'clamped_swiglu'\), got 'gelu'"):
    jaxfuse.scaled_activation(x, s, "gelu")
  with pytest.raises(ValueError, match="x's last dimension must be even for swiglu"):
    jaxfuse.scaled_activation(jnp.ones((4, 7)), s, "swiglu")
  jaxfuse.scaled_activation(jnp.ones((4, 7)), s, "srelu")  # odd is fine for srelu
  with pytest.raises(ValueError, match=r"scales must have shape \(4,\)"):
    jaxfuse.scaled_activation(x, jnp.ones((4, 1)), implementation="ffi")
  with pytest.raises(ValueError, match=r"scales must have shape \(4,\)"):
    jaxfuse.scaled_activation(x, jnp.ones((3,)))
  with pytest.raises(TypeError, match="scales dtype must be float32 or x's dtype"):
    jaxfuse.scaled_activation(x.astype(jnp.bfloat16), s.astype(jnp.float16))
  with pytest.raises(TypeError, match="x must have dtype"):
    jaxfuse.scaled_activation(jnp.ones((4, 8), jnp.int32), s)
  with pytest.raises(TypeError, match="limit must be a static Python scalar"):
    jax.jit(lambda l: jaxfuse.scaled_activation(x, s, "clamped_swiglu", limit=l))(1.0)


def test_shard_map_on_8_cpu_devices():
  from jax.sharding import Mesh, PartitionSpec as P
  from jaxfuse._src import compat
  devices = jax.devices("cpu")
  mesh = Mesh(np.array(devices), ("data",))
  x, scales = make_inputs(9, (32,), 16, jnp.float32, "clamped_swiglu")

  def total(implementation):
    def f(x, s):
      out = jaxfuse.scaled_activation(x, s, "clamped_swiglu", implementation=implementation)
      return jax.lax.psum(jnp.sum(jnp.sin(out)), "data")
    return compat.shard_map(f, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())

  grads = jax.jit(jax.grad(total("ffi"), argnums=(0, 1)))(x, scales)
  expected = jax.grad(total("xla"), argnums=(0, 1))(x, scales)
  for got, want in zip(grads, expected):
    helpers.assert_close(got, helpers.as_f64(want), jnp.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu"])
def test_gpu_large_problem_matches_float64(activation):
  # 8192 rows x 512 vectors of 8 outputs: past the size from which the CUDA kernels walk
  # each row with 64 threads of 8 vectors each (rowwise.cuh, kLargeProblemUnits = 2^22)
  # instead of covering it.
  leading, f = (8192,), 4096
  assert leading[0] * f // 8 >= 1 << 22
  x, scales = on("gpu", *make_inputs(11, leading, f, jnp.bfloat16, activation, magnitude=4.0))
  out = jaxfuse.scaled_activation(x, scales, activation, implementation="ffi")
  helpers.assert_close(out, np_forward(x, scales, activation), jnp.bfloat16, msg="forward")
  dy = on("gpu", helpers.random_array(np.random.default_rng(12), out.shape, jnp.bfloat16))[0]
  _, vjp = jax.vjp(lambda x, s: jaxfuse.scaled_activation(x, s, activation,
                                                          implementation="ffi"), x, scales)
  dx, dscales = vjp(dy)
  want_dx, want_ds = np_backward(dy, x, scales, activation)
  helpers.assert_close(dx, want_dx, jnp.bfloat16, msg="dx")
  helpers.assert_close(dscales, want_ds, jnp.bfloat16, msg="dscales")  # from bf16 dy, x
