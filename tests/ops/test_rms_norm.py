"""rms_norm / add_rms_norm: reference vs float64 numpy, FFI (CPU and CUDA) vs reference,
gradients vs float64, in-place HLO, vmap, shard_map, errors."""

from __future__ import annotations

import jax
import jax.test_util  # noqa: F401  (check_grads)
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxfuse
from jaxfuse._src import compat
from jaxfuse._src.ops.rms_norm import api as rms_api
from jaxfuse._src.ops.rms_norm import reference
from tests import helpers

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (leading shape, H): vector-friendly H, odd H (scalar path on GPU), H = 1, many rows,
# an empty batch, rank 1.
SHAPES = [((4,), 64), ((3, 5), 37), ((2,), 1), ((300,), 24), ((0,), 16), ((), 40),
          ((2, 3), 200)]
# On the GPU, rows of at least 128 16-byte vectors run the staged kernels (whole rows
# through shared memory) when two stages fit: 1024 and 2056 (a ragged second vector per
# thread) wrap the stages several times per block.
GPU_SHAPES = SHAPES + [((129,), 8192), ((7,), 16384), ((33,), 1000), ((5,), 4096 + 4),
                       ((3,), 40000), ((1000,), 128), ((1500,), 1024), ((300,), 2056),
                       ((300,), 16384)]
EPS = 1e-5

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]


def on(device_kind, *arrays):
  device = jax.devices(device_kind)[0]
  return [jax.device_put(a, device) for a in arrays]


def numpy_rms_norm(x, gamma, eps=EPS, zero_centered=False):
  x64, g64 = helpers.as_f64(x), helpers.as_f64(gamma)
  rs = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
  return x64 * rs * ((1.0 + g64) if zero_centered else g64)


def numpy_add(x, residual):
  """x + residual rounded to the residual dtype, as the op stores it."""
  return (jnp.asarray(x, jnp.float32) + jnp.asarray(residual, jnp.float32)).astype(
      residual.dtype)


def make_inputs(seed, leading, h, dtype, gamma_dtype=None):
  rng = np.random.default_rng(seed)
  x = helpers.random_array(rng, (*leading, h), dtype, scale=2.0)
  residual = helpers.random_array(rng, (*leading, h), dtype)
  gamma = helpers.random_array(rng, (h,), gamma_dtype or dtype, scale=0.5)
  return x, residual, gamma


# --- the reference is the specification ---------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_reference_matches_float64_numpy(dtype, zero_centered):
  x, residual, gamma = make_inputs(0, (6, 5), 48, dtype)
  out = reference.rms_norm(x, gamma, EPS, zero_centered)
  assert out.dtype == x.dtype and out.shape == x.shape
  helpers.assert_close(out, numpy_rms_norm(x, gamma, EPS, zero_centered), dtype)
  out, new_residual = reference.add_rms_norm(x, residual, gamma, EPS, zero_centered)
  helpers.assert_close(new_residual, helpers.as_f64(x) + helpers.as_f64(residual), dtype)
  helpers.assert_close(out, numpy_rms_norm(numpy_add(x, residual), gamma, EPS, zero_centered),
                       dtype)


# --- FFI handlers against the reference --------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma_f32", [False, True])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_ffi_matches_float64(backend, dtype, gamma_f32, zero_centered):
  shapes = GPU_SHAPES if backend == "gpu" else SHAPES
  gamma_dtype = jnp.float32 if gamma_f32 else dtype
  norm = jax.jit(lambda x, g: jaxfuse.rms_norm(x, g, EPS, zero_centered_gamma=zero_centered,
                                               implementation="ffi"))
  add_norm = jax.jit(lambda x, r, g: jaxfuse.add_rms_norm(
      x, r, g, EPS, zero_centered_gamma=zero_centered, implementation="ffi"))
  for seed, (leading, h) in enumerate(shapes):
    x, residual, gamma = on(backend, *make_inputs(seed, leading, h, dtype, gamma_dtype))
    out = norm(x, gamma)
    assert out.dtype == x.dtype and out.shape == x.shape
    helpers.assert_close(out, numpy_rms_norm(x, gamma, EPS, zero_centered), dtype,
                         msg=f"rms_norm {leading}x{h}")
    out, new_residual = add_norm(x, residual, gamma)
    assert new_residual.dtype == residual.dtype and new_residual.shape == residual.shape
    summed = numpy_add(x, residual)
    np.testing.assert_array_equal(helpers.as_f64(new_residual), helpers.as_f64(summed))
    helpers.assert_close(out, numpy_rms_norm(summed, gamma, EPS, zero_centered), dtype,
                         msg=f"add_rms_norm {leading}x{h}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ffi_and_reference_agree_closely_in_float32(backend):
  x, residual, gamma = on(backend, *make_inputs(1, (50,), 96, jnp.float32))
  for impl_out, ref_out in (
      (jaxfuse.rms_norm(x, gamma, implementation="ffi"), reference.rms_norm(x, gamma, 1e-6)),
      (jaxfuse.add_rms_norm(x, residual, gamma, implementation="ffi")[0],
       reference.add_rms_norm(x, residual, gamma, 1e-6)[0])):
    np.testing.assert_allclose(np.asarray(impl_out), np.asarray(ref_out), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_inf_stay_in_their_row(backend):
  x, residual, gamma = make_inputs(2, (4,), 32, jnp.float32)
  x = x.at[1, 3].set(jnp.nan).at[2, 5].set(jnp.inf)
  x, residual, gamma = on(backend, x, residual, gamma)
  for out in (jaxfuse.rms_norm(x, gamma, implementation="ffi"),
              jaxfuse.add_rms_norm(x, residual, gamma, implementation="ffi")[0]):
    out = np.asarray(out)
    assert np.isnan(out[1]).all()
    assert np.isnan(out[2]).any()  # inf * 0 = nan where it is normalized away
    assert np.isfinite(out[[0, 3]]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_rows_give_finite_output_with_eps(backend):
  x, residual, gamma = on(backend, jnp.zeros((3, 16)), -jnp.ones((3, 16)), jnp.ones((16,)))
  out = jaxfuse.rms_norm(x, gamma, 1e-6, implementation="ffi")
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  out, new_residual = jaxfuse.add_rms_norm(residual, -residual, gamma, implementation="ffi")
  np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_ffi_runs_the_custom_calls():
  x, residual, gamma = make_inputs(3, (4,), 16, jnp.float32)
  hlo = jax.jit(jax.grad(lambda x, r, g: jnp.sum(jaxfuse.add_rms_norm(
      x, r, g, implementation="ffi")[0]), argnums=(0, 1, 2))).lower(x, residual, gamma).as_text()
  assert hlo.count("jaxfuse_add_rms_norm_fwd") == 1
  assert hlo.count("jaxfuse_add_rms_norm_bwd") == 1
  assert "rsqrt" not in hlo


# --- autodiff ----------------------------------------------------------------------


def numpy_rms_norm_grads(x, gamma, dy, eps, zero_centered):
  """Float64 gradients of sum(dy * rms_norm(x, gamma)) in x and gamma."""
  x64, g64, dy64 = map(helpers.as_f64, (x, gamma, dy))
  h = x64.shape[-1]
  rs = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
  xhat = x64 * rs
  scale = (1.0 + g64) if zero_centered else g64
  dxhat = dy64 * scale
  dx = rs * (dxhat - xhat * np.sum(dxhat * xhat, axis=-1, keepdims=True) / h)
  dgamma = np.sum((dy64 * xhat).reshape(-1, h), axis=0)
  return dx, dgamma


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("leading, h", [((3, 4), 24), ((37,), 13), ((700,), 8)])
def test_gradients_match_float64(backend, dtype, zero_centered, leading, h):
  check_gradients(backend, dtype, zero_centered, leading, h)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("leading, h", [((1500,), 1024), ((300,), 2056), ((129,), 8192),
                                        ((40,), 16384), ((300,), 16384)])
def test_gpu_wide_row_gradients_match_float64(dtype, leading, h):
  """Rows wide enough for the staged backward (1, 2, 4 and 8 vectors per thread in bf16),
  many rows per block: dx, dresidual and dgamma against float64. Rows whose two stages
  exceed 112 KB (bf16 16384, float32 8192; add_rms_norm's three streams) run one block per
  SM on the opt-in budget; float32 16384 does not fit and keeps the register kernels."""
  check_gradients("gpu", dtype, True, leading, h)


def check_gradients(backend, dtype, zero_centered, leading, h):
  x, residual, gamma = on(backend, *make_inputs(4, leading, h, dtype, jnp.float32))
  rng = np.random.default_rng(5)
  dy, dz = on(backend, helpers.random_array(rng, x.shape, dtype),
              helpers.random_array(rng, x.shape, dtype))

  def norm_loss(x, g):
    out = jaxfuse.rms_norm(x, g, EPS, zero_centered_gamma=zero_centered, implementation="ffi")
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32))

  dx, dgamma = jax.jit(jax.grad(norm_loss, argnums=(0, 1)))(x, gamma)
  want_dx, want_dgamma = numpy_rms_norm_grads(x, gamma, dy, EPS, zero_centered)
  assert dx.dtype == x.dtype and dgamma.dtype == gamma.dtype
  helpers.assert_close(dx, want_dx, dtype, msg="dx")
  helpers.assert_close(dgamma, want_dgamma, dtype, msg="dgamma")

  def add_loss(x, r, g):
    out, new_residual = jaxfuse.add_rms_norm(x, r, g, EPS, zero_centered_gamma=zero_centered,
                                             implementation="ffi")
    return (jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)) +
            jnp.sum(new_residual.astype(jnp.float32) * dz.astype(jnp.float32)))

  dx, dresidual, dgamma = jax.jit(jax.grad(add_loss, argnums=(0, 1, 2)))(x, residual, gamma)
  summed = numpy_add(x, residual)
  want_ds, want_dgamma = numpy_rms_norm_grads(summed, gamma, dy, EPS, zero_centered)
  want_ds = want_ds + helpers.as_f64(dz)
  helpers.assert_close(dx, want_ds, dtype, msg="add dx")
  helpers.assert_close(dresidual, want_ds, dtype, msg="add dresidual")
  helpers.assert_close(dgamma, want_dgamma, dtype, msg="add dgamma")


def test_check_grads_ffi():
  x, residual, gamma = make_inputs(6, (5,), 7, jnp.float32)
  jax.test_util.check_grads(
      lambda x, g: jaxfuse.rms_norm(x, g, zero_centered_gamma=True, implementation="ffi"),
      (x, gamma), order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-2)
  jax.test_util.check_grads(
      lambda x, r, g: jaxfuse.add_rms_norm(x, r, g, implementation="ffi"),
      (x, residual, gamma), order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-2)


def test_ffi_gradients_equal_reference_autodiff():
  x, residual, gamma = make_inputs(7, (9, 3), 20, jnp.float32)

  def loss(implementation):
    def f(x, r, g):
      out, s = jaxfuse.add_rms_norm(x, r, g, implementation=implementation)
      return jnp.sum(jnp.sin(out)) + jnp.sum(s * s)
    return f

  got = jax.grad(loss("ffi"), argnums=(0, 1, 2))(x, residual, gamma)
  want = jax.grad(loss("xla"), argnums=(0, 1, 2))(x, residual, gamma)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# --- in place ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("leading", [(64,), (4, 16)])
def test_donated_residual_is_updated_in_place(backend, leading):
  x, residual, gamma = on(backend, *make_inputs(8, leading, 48, jnp.bfloat16))
  expected_residual = numpy_add(x, residual)

  def step(x, r, g):
    out, new_residual = jaxfuse.add_rms_norm(x, r, g, implementation="ffi")
    # At the jit boundary JAX pairs a donated input with the FIRST output of its shape and
    # dtype, so the new residual goes first (as a training step's carried stream would).
    return new_residual, out

  step = jax.jit(step, donate_argnums=1)
  compiled = step.lower(x, residual, gamma).compile().as_text()
  assert "output_to_operand_aliasing" in compiled
  copies = [line for line in compiled.splitlines() if " copy(" in line or "copy-start" in line]
  assert not copies, "the residual was copied:\n" + "\n".join(copies)
  new_residual, out = step(x, residual, gamma)
  assert residual.is_deleted()
  np.testing.assert_array_equal(helpers.as_f64(new_residual), helpers.as_f64(expected_residual))
  helpers.assert_close(out, numpy_rms_norm(expected_residual, gamma), jnp.bfloat16)


def test_training_forward_does_not_alias_a_live_residual():
  # An earlier norm saves the residual for its backward pass; an aliased add_rms_norm
  # output would force XLA to copy it. The differentiated forward writes a fresh buffer.
  x, residual, gamma = make_inputs(15, (32,), 64, jnp.float32)
  kernel = helpers.random_array(np.random.default_rng(16), (64, 64), jnp.float32, 0.1)

  def loss(x, r, g, w):
    h = jaxfuse.rms_norm(r, g, implementation="ffi")
    out, new_residual = jaxfuse.add_rms_norm(jnp.tanh(h @ w) + x, r, g, implementation="ffi")
    return jnp.sum(out * out) + jnp.sum(new_residual)

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(
      x, residual, gamma, kernel).compile().as_text()
  copies = [line for line in compiled.splitlines() if " copy(" in line or "copy-start" in line]
  assert not copies, "\n".join(copies)
  got = jax.grad(loss, argnums=(0, 1, 2, 3))(x, residual, gamma, kernel)
  want = jax.grad(lambda x, r, g, w: _xla_loss(x, r, g, w), argnums=(0, 1, 2, 3))(
      x, residual, gamma, kernel)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def _xla_loss(x, r, g, w):
  h = jaxfuse.rms_norm(r, g, implementation="xla")
  out, new_residual = jaxfuse.add_rms_norm(jnp.tanh(h @ w) + x, r, g, implementation="xla")
  return jnp.sum(out * out) + jnp.sum(new_residual)


# --- vmap and shard_map ------------------------------------------------------------


def test_vmap():
  x, residual, gamma = make_inputs(9, (3, 5), 12, jnp.float32)
  gammas = jnp.stack([gamma, 2 * gamma, -gamma])
  f = lambda x, g: jaxfuse.rms_norm(x, g, EPS, implementation="ffi")
  shared = jax.vmap(f, in_axes=(0, None))(x, gamma)
  per = jax.vmap(f)(x, gammas)
  for b in range(3):
    helpers.assert_close(shared[b], numpy_rms_norm(x[b], gamma), jnp.float32)
    helpers.assert_close(per[b], numpy_rms_norm(x[b], gammas[b]), jnp.float32)
  g = lambda x, r, g: jaxfuse.add_rms_norm(x, r, g, EPS, implementation="ffi")
  out, s = jax.vmap(g, in_axes=(0, 0, None))(x, residual, gamma)
  helpers.assert_close(out, numpy_rms_norm(numpy_add(x, residual), gamma), jnp.float32)
  per_example = jax.vmap(jax.grad(lambda x, g: jnp.sum(jnp.sin(f(x, g))), argnums=1),
                         in_axes=(0, None))(x, gamma)
  expected = jax.vmap(jax.grad(lambda x, g: jnp.sum(jnp.sin(reference.rms_norm(x, g, EPS))),
                               argnums=1), in_axes=(0, None))(x, gamma)
  helpers.assert_close(per_example, helpers.as_f64(expected), jnp.float32)


def test_shard_map_gamma_gradient_is_summed_over_devices():
  mesh = Mesh(np.array(jax.devices("cpu")), ("data",))
  x, residual, gamma = make_inputs(10, (32,), 16, jnp.float32)

  def total(implementation):
    def f(x, r, g):
      out, s = jaxfuse.add_rms_norm(x, r, g, implementation=implementation)
      return out, s
    sharded = compat.shard_map(f, mesh=mesh, in_specs=(P("data"), P("data"), P()),
                               out_specs=(P("data"), P("data")))
    return lambda x, r, g: sum(jnp.sum(jnp.sin(o)) for o in sharded(x, r, g))

  got = jax.jit(jax.grad(total("ffi"), argnums=(0, 1, 2)))(x, residual, gamma)
  want = jax.grad(total("xla"), argnums=(0, 1, 2))(x, residual, gamma)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# --- inference (forward-only) entry points -----------------------------------------


def test_inference_entry_points_match():
  x, residual, gamma = make_inputs(11, (6,), 24, jnp.bfloat16)
  for implementation in ("ffi", "xla"):
    np.testing.assert_array_equal(
        np.asarray(rms_api.rms_norm_inference(x, gamma, implementation=implementation),
                   np.float32),
        np.asarray(jaxfuse.rms_norm(x, gamma, implementation=implementation), np.float32))
    a = rms_api.add_rms_norm_inference(x, residual, gamma, implementation=implementation)
    b = jaxfuse.add_rms_norm(x, residual, gamma, implementation=implementation)
    for u, v in zip(a, b):
      np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


# --- errors ------------------------------------------------------------------------


@pytest.mark.parametrize("shapes, match", [
    (((4, 8), (9,)), r"gamma must have shape \(8,\)"),
    (((4, 8), (1, 8)), r"gamma must have rank 1"),
    (((), (1,)), r"x must have rank >= 1"),
    (((4, 0), (0,)), r"x's last dimension \(H\) must be >= 1"),
])
def test_shape_errors_name_the_argument(shapes, match):
  x, gamma = (jnp.ones(s, jnp.float32) for s in shapes)
  for implementation in ("ffi", "xla"):
    with pytest.raises(ValueError, match=match):
      jaxfuse.rms_norm(x, gamma, implementation=implementation)


def test_add_rms_norm_errors():
  x, gamma = jnp.ones((4, 8)), jnp.ones((8,))
  with pytest.raises(ValueError, match=r"residual must have x's shape \(4, 8\), got \(4, 9\)"):
    jaxfuse.add_rms_norm(x, jnp.ones((4, 9)), gamma)
  with pytest.raises(TypeError, match=r"residual dtype must equal x's dtype \(float32\)"):
    jaxfuse.add_rms_norm(x, jnp.ones((4, 8), jnp.bfloat16), gamma)


def test_dtype_and_attribute_errors():
  with pytest.raises(TypeError, match=r"x must have dtype float32, bfloat16 or float16, got int32"):
    jaxfuse.rms_norm(jnp.ones((2, 4), jnp.int32), jnp.ones((4,)))
  with pytest.raises(TypeError, match=r"gamma dtype must be x's dtype \(bfloat16\) or float32, got float16"):
    jaxfuse.rms_norm(jnp.ones((2, 4), jnp.bfloat16), jnp.ones((4,), jnp.float16))
  with pytest.raises(ValueError, match=r"eps must be >= 0, got -1.0"):
    jaxfuse.rms_norm(jnp.ones((2, 4)), jnp.ones((4,)), -1.0)
  with pytest.raises(TypeError, match="eps must be a static Python scalar"):
    jax.jit(lambda e: jaxfuse.rms_norm(jnp.ones((2, 4)), jnp.ones((4,)), e))(1e-6)
  with pytest.raises(TypeError, match="zero_centered_gamma must be a bool"):
    jaxfuse.rms_norm(jnp.ones((2, 4)), jnp.ones((4,)), zero_centered_gamma=1)


# --- GPU only ----------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_default_implementation_is_ffi():
  x, residual, gamma = make_inputs(12, (8,), 64, jnp.bfloat16)
  hlo = jax.jit(lambda *a: jaxfuse.add_rms_norm(*a)).lower(x, residual, gamma).as_text()
  assert "jaxfuse_add_rms_norm_fwd" in hlo


@pytest.mark.gpu
def test_gpu_dgamma_is_deterministic():
  x, _, gamma = on("gpu", *make_inputs(13, (4096,), 1024, jnp.bfloat16, jnp.float32))
  grad = jax.jit(jax.grad(lambda x, g: jnp.sum(
      jaxfuse.rms_norm(x, g, implementation="ffi").astype(jnp.float32) ** 2), argnums=1))
  first = np.asarray(grad(x, gamma))
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(grad(x, gamma)), first)


@pytest.mark.gpu
def test_gpu_odd_hidden_takes_the_scalar_path():
  # H = 513 is no multiple of 8: the generic (scalar, two-pass) kernels run.
  x, residual, gamma = on("gpu", *make_inputs(14, (64,), 8 * 64 + 2, jnp.bfloat16))
  out = jaxfuse.rms_norm(x[:, 1:], gamma[1:], implementation="ffi")
  helpers.assert_close(out, numpy_rms_norm(x[:, 1:], gamma[1:], 1e-6), jnp.bfloat16)
