"""linear_scale_add: reference vs float64 numpy, FFI (CPU and CUDA) vs reference,
gradients, in-place HLO, vmap, shard_map, errors."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.test_util  # noqa: F401  (check_grads)
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxfuse
from jaxfuse._src import compat
from jaxfuse._src.ops.linear_scale_add import reference
from tests import helpers

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
ALPHAS = [1.0, 0.0, -2.5, 3.5]
# (x leading shape, K, N): batch dims, odd sizes, single rows, an empty batch.
SHAPES = [((8,), 16, 24), ((3, 5), 7, 9), ((1,), 1, 1), ((2, 3, 4), 33, 17), ((0,), 8, 8),
          ((64,), 128, 96)]
GPU_SHAPES = SHAPES + [((512,), 1024, 768), ((4, 100), 264, 520)]

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]


def numpy_linear_scale_add(x, kernel, residual, alpha):
  return helpers.as_f64(residual) + alpha * helpers.as_f64(x) @ helpers.as_f64(kernel)


def make_inputs(seed, leading, k, n, dtype, residual_dtype=None):
  rng = np.random.default_rng(seed)
  x = helpers.random_array(rng, (*leading, k), dtype)
  kernel = helpers.random_array(rng, (k, n), dtype, scale=1 / np.sqrt(max(k, 1)))
  residual = helpers.random_array(rng, (*leading, n), residual_dtype or dtype)
  return x, kernel, residual


def on(device_kind, *arrays):
  device = jax.devices(device_kind)[0]
  return [jax.device_put(a, device) for a in arrays]


# --- the reference is the specification ---------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alpha", ALPHAS)
def test_reference_matches_float64_numpy(dtype, alpha):
  x, kernel, residual = make_inputs(0, (3, 5), 40, 24, dtype)
  out = reference.linear_scale_add(x, kernel, residual, alpha)
  assert out.dtype == residual.dtype and out.shape == residual.shape
  helpers.assert_close(out, numpy_linear_scale_add(x, kernel, residual, alpha), dtype)


# --- FFI handlers against the reference --------------------------------------------


@pytest.mark.sanitize
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alpha", ALPHAS)
def test_ffi_matches_reference(backend, dtype, alpha):
  shapes = GPU_SHAPES if backend == "gpu" else SHAPES
  for seed, (leading, k, n) in enumerate(shapes):
    x, kernel, residual = on(backend, *make_inputs(seed, leading, k, n, dtype))
    out = jax.jit(lambda x, k_, r: jaxfuse.linear_scale_add(
        x, k_, r, alpha, implementation="ffi"))(x, kernel, residual)
    assert out.dtype == residual.dtype and out.shape == residual.shape
    expected = numpy_linear_scale_add(x, kernel, residual, alpha)
    helpers.assert_close(out, expected, dtype, msg=f"{leading}x{k}x{n}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_float32_residual_with_16_bit_inputs(backend, dtype):
  x, kernel, residual = on(backend, *make_inputs(1, (6, 5), 48, 40, dtype, jnp.float32))
  out = jaxfuse.linear_scale_add(x, kernel, residual, 0.75, implementation="ffi")
  assert out.dtype == jnp.float32
  # Inputs are exact in fp32; only the fp32 accumulation order differs.
  helpers.assert_close(out, numpy_linear_scale_add(x, kernel, residual, 0.75), jnp.float32)


def test_ffi_runs_the_custom_call_not_the_reference():
  x, kernel, residual = make_inputs(2, (4,), 8, 8, jnp.float32)
  hlo = jax.jit(lambda *a: jaxfuse.linear_scale_add(*a, implementation="ffi")).lower(
      x, kernel, residual).as_text()
  assert "jaxfuse_linear_scale_add" in hlo
  assert "dot_general" not in hlo


# --- autodiff ----------------------------------------------------------------------


def loss(implementation, alpha):
  def f(x, kernel, residual):
    out = jaxfuse.linear_scale_add(x, kernel, residual, alpha, implementation=implementation)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))
  return f


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_float64(backend, alpha, dtype):
  x, kernel, residual = on(backend, *make_inputs(3, (3, 4), 24, 16, dtype))
  grads = jax.jit(jax.grad(loss("ffi", alpha), argnums=(0, 1, 2)))(x, kernel, residual)
  # float64 numpy: dL/dout = cos(out), evaluated at the forward output the op produced
  # (rounded to dtype; re-deriving it in float64 would move cos by up to an ulp of out),
  # and rounded to dtype as the cotangent of out.astype(float32) is.
  out = jaxfuse.linear_scale_add(x, kernel, residual, alpha, implementation="ffi")
  d_out = helpers.as_f64(jnp.asarray(np.cos(helpers.as_f64(out)), dtype))
  x64, k64 = helpers.as_f64(x), helpers.as_f64(kernel)
  expected = (alpha * d_out @ k64.T,
              alpha * x64.reshape(-1, 24).T @ d_out.reshape(-1, 16),
              d_out)
  for name, got, want, primal in zip(("dx", "dkernel", "dresidual"), grads, expected,
                                     (x, kernel, residual)):
    assert got.dtype == primal.dtype and got.shape == primal.shape, name
    scale = max(np.abs(want).max(), 1.0)  # alpha = 0 gives exact zeros
    helpers.assert_close(got, want, dtype, scale=scale, msg=name)


def test_check_grads_ffi():
  x, kernel, residual = make_inputs(4, (5,), 6, 7, jnp.float32)
  jax.test_util.check_grads(
      lambda x, k, r: jaxfuse.linear_scale_add(x, k, r, -1.5, implementation="ffi"),
      (x, kernel, residual), order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-2)


def test_backward_is_two_scaled_gemms_with_alpha_in_the_epilogue():
  x, kernel, residual = make_inputs(5, (4,), 8, 8, jnp.float32)
  hlo = jax.jit(jax.grad(loss("ffi", 2.5), argnums=(0, 1))).lower(
      x, kernel, residual).as_text()
  assert hlo.count("jaxfuse_scaled_matmul") == 2
  assert "alpha = 2.500000e+00" in hlo
  assert "dot_general" not in hlo


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("leading, k, n", [((1,), 8, 8), ((4, 100), 264, 520),
                                           ((1000,), 136, 1032), ((2048,), 1024, 768)])
def test_16_bit_forward_rounds_once_on_the_gpu(dtype, leading, k, n):
  """K and N multiples of 8: the CUTLASS kernel adds the residual in fp32 and rounds once,
  so every element is within half an ulp of the float64 result plus the fp32 sum's error
  (cuBLASLt's epilogue, which rounds alpha * x @ kernel first, fails this: session 51).
  Shapes with partial tiles in both dimensions, and many tiles per SM."""
  for alpha in (1.0, -0.37):
    x, kernel, residual = on("gpu", *make_inputs(k + n, leading, k, n, dtype))
    out = jax.jit(lambda x, k_, r: jaxfuse.linear_scale_add(x, k_, r, alpha,
                                                           implementation="ffi"))(
        x, kernel, residual)
    expected = numpy_linear_scale_add(x, kernel, residual, alpha)
    magnitude = (np.abs(helpers.as_f64(residual))
                 + abs(alpha) * np.abs(helpers.as_f64(x)) @ np.abs(helpers.as_f64(kernel)))
    half_ulp = 2.0**-8 if dtype == jnp.bfloat16 else 2.0**-11
    # One rounding, an fp32 sum of K + 1 terms (4x slack), and f16's subnormal step.
    bound = half_ulp * np.abs(expected) + (k + 1) * 2.0**-22 * magnitude + 2.0**-25
    excess = np.abs(helpers.as_f64(out) - expected) - bound
    assert (excess <= 0).all(), (f"alpha={alpha}: {int((excess > 0).sum())} elements past "
                                 f"one rounding, worst by {excess.max():.3g}")


# --- in place ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("leading", [(64,), (4, 16)])
def test_donated_residual_is_updated_in_place(backend, leading):
  x, kernel, residual = on(backend, *make_inputs(6, leading, 32, 48, jnp.bfloat16))
  step = jax.jit(lambda x, k, r: jaxfuse.linear_scale_add(x, k, r, 0.5, implementation="ffi"),
                 donate_argnums=2)
  compiled = step.lower(x, kernel, residual).compile().as_text()
  assert "output_to_operand_aliasing" in compiled
  copies = [line for line in compiled.splitlines() if " copy(" in line or "copy-start" in line]
  assert not copies, "the residual was copied:\n" + "\n".join(copies)
  expected = numpy_linear_scale_add(x, kernel, residual, 0.5)
  out = step(x, kernel, residual)
  assert residual.is_deleted()
  helpers.assert_close(out, expected, jnp.bfloat16)


# --- vmap and shard_map ------------------------------------------------------------


def test_vmap_over_activations_and_over_everything():
  x, kernel, residual = make_inputs(7, (3, 5), 12, 10, jnp.float32)
  f = lambda x, k, r: jaxfuse.linear_scale_add(x, k, r, -2.5, implementation="ffi")
  shared = jax.vmap(f, in_axes=(0, None, 0))(x, kernel, residual)
  for b in range(3):
    helpers.assert_close(shared[b], numpy_linear_scale_add(x[b], kernel, residual[b], -2.5),
                         jnp.float32)
  kernels = jnp.stack([kernel, 2 * kernel, -kernel])
  batched = jax.vmap(f)(x, kernels, residual)
  for b in range(3):
    helpers.assert_close(batched[b], numpy_linear_scale_add(x[b], kernels[b], residual[b],
                                                             -2.5), jnp.float32)
  per_example = jax.vmap(jax.grad(loss("ffi", 1.5), argnums=1), in_axes=(0, None, 0))(
      x, kernel, residual)
  expected = jax.vmap(jax.grad(loss("xla", 1.5), argnums=1), in_axes=(0, None, 0))(
      x, kernel, residual)
  helpers.assert_close(per_example, helpers.as_f64(expected), jnp.float32)


def test_shard_map_on_8_cpu_devices():
  devices = jax.devices("cpu")
  assert len(devices) == 8, "conftest asks XLA for 8 host devices"
  mesh = Mesh(np.array(devices), ("data",))
  x, kernel, residual = make_inputs(8, (32,), 16, 24, jnp.float32)

  def sharded(implementation):
    def f(x, k, r):
      return jaxfuse.linear_scale_add(x, k, r, 0.5, implementation=implementation)
    return compat.shard_map(f, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                            out_specs=P("data"))

  out = jax.jit(sharded("ffi"))(x, kernel, residual)
  helpers.assert_close(out, numpy_linear_scale_add(x, kernel, residual, 0.5), jnp.float32)

  def total(implementation):
    return lambda x, k, r: jnp.sum(jnp.sin(sharded(implementation)(x, k, r)))

  grads = jax.jit(jax.grad(total("ffi"), argnums=(0, 1, 2)))(x, kernel, residual)
  expected = jax.grad(total("xla"), argnums=(0, 1, 2))(x, kernel, residual)
  for got, want in zip(grads, expected):
    helpers.assert_close(got, helpers.as_f64(want), jnp.float32)


# --- errors ------------------------------------------------------------------------


@pytest.mark.parametrize("args, error, match", [
    (((4, 8), (9, 5), (4, 5)), ValueError, r"x's last dimension \(8\) must equal kernel.shape\[0\] \(9\)"),
    (((4, 8), (8, 5), (4, 6)), ValueError, r"residual must have shape \(4, 5\)"),
    (((4, 8), (8, 5), (3, 5)), ValueError, r"residual must have shape \(4, 5\)"),
    (((4, 8), (2, 8, 5), (4, 5)), ValueError, r"kernel must have rank 2 \(\[K, N\]\)"),
    (((), (8, 5), (5,)), ValueError, r"x must have rank >= 1"),
])
def test_shape_errors_name_the_argument(args, error, match):
  x, kernel, residual = (jnp.ones(s, jnp.float32) for s in args)
  for implementation in ("ffi", "xla"):
    with pytest.raises(error, match=match):
      jaxfuse.linear_scale_add(x, kernel, residual, implementation=implementation)


def test_dtype_errors_name_the_argument():
  f32, bf16 = jnp.float32, jnp.bfloat16
  with pytest.raises(TypeError, match=r"x must have dtype float32, bfloat16 or float16, got int32"):
    jaxfuse.linear_scale_add(jnp.ones((2, 4), jnp.int32), jnp.ones((4, 3), f32), jnp.ones((2, 3), f32))
  with pytest.raises(TypeError, match=r"kernel dtype float32 must equal x dtype bfloat16"):
    jaxfuse.linear_scale_add(jnp.ones((2, 4), bf16), jnp.ones((4, 3), f32), jnp.ones((2, 3), f32))
  with pytest.raises(TypeError, match=r"residual dtype must be x's dtype \(bfloat16\) or float32, got float16"):
    jaxfuse.linear_scale_add(jnp.ones((2, 4), bf16), jnp.ones((4, 3), bf16),
                             jnp.ones((2, 3), jnp.float16))
  with pytest.raises(TypeError, match=r"residual must have dtype .* got float64|residual must have dtype"):
    jaxfuse.linear_scale_add(jnp.ones((2, 4), f32), jnp.ones((4, 3), f32), np.ones((2, 3), np.int8))


@pytest.mark.parametrize("alpha, match", [
    (np.ones(2), r"alpha must be a real scalar, got ndarray with shape \(2,\)"),
    ("2", r"alpha must be a real scalar, got str"),
    (True, r"alpha must be a real scalar, got a bool"),
])
def test_alpha_must_be_a_real_scalar(alpha, match):
  x, kernel, residual = make_inputs(9, (2,), 4, 3, jnp.float32)
  with pytest.raises(TypeError, match=match):
    jaxfuse.linear_scale_add(x, kernel, residual, alpha)


def test_traced_alpha_is_rejected_with_a_clear_message():
  x, kernel, residual = make_inputs(10, (2,), 4, 3, jnp.float32)
  with pytest.raises(TypeError, match="alpha must be a static Python scalar"):
    jax.jit(lambda a: jaxfuse.linear_scale_add(x, kernel, residual, a))(1.0)


def test_numpy_and_0d_array_alphas_are_accepted():
  x, kernel, residual = make_inputs(11, (2,), 4, 3, jnp.float32)
  expected = numpy_linear_scale_add(x, kernel, residual, 2.0)
  for alpha in (np.float32(2.0), np.array(2.0), jnp.asarray(2.0), 2):
    helpers.assert_close(jaxfuse.linear_scale_add(x, kernel, residual, alpha,
                                                  implementation="ffi"), expected, jnp.float32)


# --- implementation choice ---------------------------------------------------------


def test_implementation_choice(monkeypatch):
  x, kernel, residual = make_inputs(12, (2,), 4, 3, jnp.float32)
  lowered = lambda **kw: jax.jit(lambda *a: jaxfuse.linear_scale_add(*a, **kw)).lower(
      x, kernel, residual).as_text()
  assert "jaxfuse_linear_scale_add" not in lowered()  # CPU default: the reference
  monkeypatch.setenv("JAXFUSE_IMPLEMENTATION", "ffi")
  assert "jaxfuse_linear_scale_add" in lowered()
  assert "jaxfuse_linear_scale_add" not in lowered(implementation="xla")  # argument wins
  monkeypatch.setenv("JAXFUSE_IMPLEMENTATION", "cuda")
  with pytest.raises(ValueError, match=r"JAXFUSE_IMPLEMENTATION must be one of \('ffi', 'xla'\)"):
    lowered()
  with pytest.raises(ValueError, match=r"implementation must be one of"):
    lowered(implementation="triton")


# --- GPU only ----------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_default_implementation_is_ffi():
  x, kernel, residual = make_inputs(13, (8,), 16, 16, jnp.bfloat16)
  hlo = jax.jit(lambda *a: jaxfuse.linear_scale_add(*a)).lower(x, kernel, residual).as_text()
  assert "jaxfuse_linear_scale_add" in hlo


_COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxfuse
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 512)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((512, 384)) / 20, jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((256, 384)), jnp.bfloat16)
    def step(x, k, r):
      out = jaxfuse.linear_scale_add(x, k, r, -0.5, implementation="ffi")
      g = jax.grad(lambda x, k, r: jnp.sum(jaxfuse.linear_scale_add(
          x, k, r, -0.5, implementation="ffi").astype(jnp.float32) ** 2), argnums=(0, 1))(x, k, r)
      return out, *g
    f = jax.jit(step)
    results = [f(x, k, r) for _ in range(3)]  # replays
    np.save(sys.argv[1], np.concatenate([np.asarray(a, np.float32).ravel() for a in results[-1]]))
""")


@pytest.mark.gpu
def test_identical_results_with_cuda_graphs_for_custom_calls(tmp_path):
  outputs = {}
  for name, flags in (("plain", "--xla_gpu_enable_command_buffer="),
                      ("graphs", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                                 "--xla_gpu_graph_min_graph_size=1")):
    path = tmp_path / f"{name}.npy"
    env = dict(os.environ, XLA_FLAGS=flags)
    subprocess.run([sys.executable, "-c", _COMMAND_BUFFER_SCRIPT, str(path)], env=env,
                   check=True, timeout=300)
    outputs[name] = np.load(path)
  np.testing.assert_array_equal(outputs["plain"], outputs["graphs"])


# --- FP8 (per-tensor current scaling) ------------------------------------------------

FP8_RECIPE = jaxfuse.quantization.Float8CurrentScaling(per_group=False)


def relative_error(actual, expected) -> float:
  actual, expected = helpers.as_f64(actual), helpers.as_f64(expected)
  return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.mark.sanitize
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("alpha", [1.0, -2.5])
def test_fp8_forward_matches_the_fp8_reference(backend, alpha):
  leading, k, n = ((32,), 48, 64) if backend == "cpu" else ((4, 256), 512, 768)
  x, kernel, residual = on(backend, *make_inputs(20, leading, k, n, jnp.bfloat16))
  out = jax.jit(lambda *a: jaxfuse.linear_scale_add(*a, alpha, recipe=FP8_RECIPE,
                                                    implementation="ffi"))(x, kernel, residual)
  expected = jaxfuse.linear_scale_add(x, kernel, residual, alpha, recipe=FP8_RECIPE,
                                      implementation="xla")
  # Same FP8 products; only the fp32 accumulation order and the final rounding differ.
  helpers.assert_close(out, helpers.as_f64(expected), jnp.bfloat16)


def numpy_fp8_per_tensor(value, fp8_dtype):
  """(FP8 values as float64, scale_inv) of per-tensor current scaling, in numpy: scale =
  fp8_max / amax in float32, values rounded to nearest even (ml_dtypes)."""
  value = np.asarray(value, np.float32)
  fp8_max = np.float32(float(jnp.finfo(fp8_dtype).max))
  scale = fp8_max / np.float32(np.abs(value).max())
  data = (value * scale).astype(fp8_dtype)
  return data.astype(np.float64), 1.0 / np.float64(scale)


@pytest.mark.sanitize
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_backward_matches_float64_of_the_fp8_operands(backend):
  """dx = alpha * dy_q @ kernel_q^T and dkernel = alpha * x_q^T @ dy_q, with x and kernel
  in E4M3 and dy in E5M2 (one scale each), dequantized and multiplied in float64: each
  backward GEMM reads the right FP8 copy in the right layout (a wrong transpose or a
  swapped scale is far outside bf16's tolerance)."""
  leading, k, n = ((3, 32), 48, 64) if backend == "cpu" else ((2, 512), 512, 768)
  alpha = -1.5
  x, kernel, residual = on(backend, *make_inputs(25, leading, k, n, jnp.bfloat16))
  d_out = on(backend, helpers.random_array(np.random.default_rng(26), (*leading, n),
                                           jnp.bfloat16))[0]
  fp8 = lambda *a: jaxfuse.linear_scale_add(*a, alpha, recipe=FP8_RECIPE, implementation="ffi")
  d_x, d_kernel, d_residual = jax.jit(lambda *a: jax.vjp(fp8, *a[:3])[1](a[3]))(
      x, kernel, residual, d_out)
  x_q, x_si = numpy_fp8_per_tensor(helpers.as_f64(x).reshape(-1, k), jnp.float8_e4m3fn)
  w_q, w_si = numpy_fp8_per_tensor(helpers.as_f64(kernel), jnp.float8_e4m3fn)
  dy_q, dy_si = numpy_fp8_per_tensor(helpers.as_f64(d_out).reshape(-1, n), jnp.float8_e5m2)
  expected_dx = alpha * (dy_q * dy_si) @ (w_q * w_si).T
  expected_dkernel = alpha * (x_q * x_si).T @ (dy_q * dy_si)
  helpers.assert_close(d_x, expected_dx.reshape(*leading, k), jnp.bfloat16, msg="dx")
  helpers.assert_close(d_kernel, expected_dkernel, jnp.bfloat16, msg="dkernel")
  np.testing.assert_array_equal(helpers.as_f64(d_residual), helpers.as_f64(d_out))


# (x leading shape, K, N, fast accumulation): partial tiles in both dimensions, many tiles
# per SM, both mainloops. Fast accumulation stops at K = 512: at K = 1024 the tensor cores'
# FP8 accumulator, which keeps only about 14 bits after aligning the addends, put 2-6 of
# 1.5M elements past the bound on an H100 (session 53); the promoted mainloop adds its
# partial sums in fp32 and is exact there too.
FP8_ROUNDING_CASES = [((16,), 16, 16, True), ((4, 100), 512, 528, True),
                      ((1008,), 256, 1040, True), ((1008,), 256, 1040, False),
                      ((2048,), 1024, 768, False)]
FP8_ROUNDING_ALPHAS = (1.0, -0.37)

_FP8_ROUNDING_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxfuse
    inputs = np.load(sys.argv[1])
    outputs = {}
    for name in sorted({key.rsplit("/", 1)[0] for key in inputs.files}):
      dtype, fast = name.split("/")[1:3]
      recipe = jaxfuse.quantization.Float8CurrentScaling(
          per_group=False, forward_fast_accumulation=fast == "True")
      x, kernel, residual = (jnp.asarray(inputs[f"{name}/{part}"], dtype)
                             for part in ("x", "kernel", "residual"))
      for alpha in (1.0, -0.37):
        out = jax.jit(lambda *a: jaxfuse.linear_scale_add(*a, alpha, recipe=recipe,
                                                          implementation="ffi"))(
            x, kernel, residual)
        outputs[f"{name}/{alpha}"] = np.asarray(out, np.float32)
    np.savez(sys.argv[2], **outputs)
""")


def fp8_rounding_inputs(leading, k, n, dtype):
  """x and kernel of values +-amax and +-amax / 2 (amax itself included): per-tensor E4M3
  scaling maps them to +-448 and +-224 exactly, so the FP8 operands carry no quantization
  error; a random residual."""
  rng = np.random.default_rng(k + n)

  def power_of_two_steps(shape, amax):
    values = amax * rng.choice([-1.0, -0.5, 0.5, 1.0], size=shape)
    values.flat[0] = amax
    return jnp.asarray(values, dtype)

  return (power_of_two_steps((*leading, k), 1.5), power_of_two_steps((k, n), 1 / np.sqrt(k)),
          helpers.random_array(rng, (*leading, n), dtype))


@pytest.fixture(scope="module")
def fp8_cutlass_outputs(tmp_path_factory):
  """Every FP8_ROUNDING_CASES forward under JAXFUSE_LINEAR_SCALE_ADD_GEMM=cutlass (read once
  per process, so in a child process): {case/dtype/fast/alpha: output}."""
  directory = tmp_path_factory.mktemp("fp8_rounding")
  inputs = {}
  for leading, k, n, fast in FP8_ROUNDING_CASES:
    for dtype in (jnp.bfloat16, jnp.float16):
      name = f"{leading}x{k}x{n}/{jnp.dtype(dtype).name}/{fast}"
      for part, value in zip(("x", "kernel", "residual"),
                             fp8_rounding_inputs(leading, k, n, dtype)):
        inputs[f"{name}/{part}"] = np.asarray(value, np.float32)
  np.savez(directory / "inputs.npz", **inputs)
  env = dict(os.environ, JAXFUSE_LINEAR_SCALE_ADD_GEMM="cutlass",
             XLA_PYTHON_CLIENT_PREALLOCATE="false")
  subprocess.run([sys.executable, "-c", _FP8_ROUNDING_SCRIPT, str(directory / "inputs.npz"),
                  str(directory / "outputs.npz")], env=env, check=True, timeout=300)
  return dict(np.load(directory / "outputs.npz"))


@pytest.mark.gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("leading, k, n, fast_accumulation", FP8_ROUNDING_CASES)
def test_fp8_forward_rounds_once_with_cutlass_on_the_gpu(fp8_cutlass_outputs, leading, k, n,
                                                         fast_accumulation, dtype):
  """With JAXFUSE_LINEAR_SCALE_ADD_GEMM=cutlass the FP8 forward adds the residual in fp32
  and rounds once (the CUTLASS FP8 residual GEMM), as the 16-bit one does by default. The
  operands make the FP8 GEMM exact: every value quantizes without error, and every product
  is 448^2 times 1, 1/2 or 1/4, so the partial sums are short multiples of 448^2 / 4. What
  is left is alpha * a_scale_inv * b_scale_inv in fp32 (three roundings), the fp32 sum with
  the residual, and the one rounding to 16 bits. cuBLASLt's FP8 epilogue (the default),
  which rounds the scaled product to 16 bits before adding the residual, errs by up to
  half an ulp of the product more: it put 35854 of 211200 elements past this bound on an
  H100 (session 53)."""
  x, kernel, residual = fp8_rounding_inputs(leading, k, n, dtype)
  x_q, x_si = numpy_fp8_per_tensor(helpers.as_f64(x).reshape(-1, k), jnp.float8_e4m3fn)
  w_q, w_si = numpy_fp8_per_tensor(helpers.as_f64(kernel), jnp.float8_e4m3fn)
  for q in (x_q, w_q):
    np.testing.assert_array_equal(np.unique(np.abs(q)), [224.0, 448.0])
  name = f"{leading}x{k}x{n}/{jnp.dtype(dtype).name}/{fast_accumulation}"
  for alpha in FP8_ROUNDING_ALPHAS:
    out = fp8_cutlass_outputs[f"{name}/{alpha}"].astype(np.float64)
    product = (alpha * x_si * w_si * (x_q @ w_q)).reshape(*leading, n)
    expected = helpers.as_f64(residual) + product
    half_ulp = 2.0**-8 if dtype == jnp.bfloat16 else 2.0**-11
    # One rounding; fp32's roundings of the scale product and of the sum (4x slack);
    # f16's subnormal step.
    bound = (half_ulp * np.abs(expected)
             + 2.0**-21 * (np.abs(product) + np.abs(helpers.as_f64(residual))) + 2.0**-25)
    excess = np.abs(out - expected) - bound
    assert (excess <= 0).all(), (f"alpha={alpha}: {int((excess > 0).sum())} elements past "
                                 f"one rounding, worst by {excess.max():.3g}")


_AUTOTUNE_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxfuse
    rng = np.random.default_rng(31)
    x = jnp.asarray(rng.standard_normal((1024, 512)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((512, 768)) / 512 ** 0.5, jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((1024, 768)), jnp.bfloat16)
    recipe = jaxfuse.quantization.Float8CurrentScaling(per_group=False)
    fp8 = jax.jit(lambda *a: jaxfuse.linear_scale_add(*a, -0.5, recipe=recipe,
                                                      implementation="ffi"))(x, k, r)
    bf16 = jax.jit(lambda *a: jaxfuse.linear_scale_add(*a, -0.5, implementation="ffi"))(x, k, r)
    np.save(sys.argv[1], np.stack([np.asarray(fp8, np.float64), np.asarray(bf16, np.float64)]))
""")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "0", "1", "sustained"])
def test_cublaslt_autotune_modes_pick_algorithms_that_compute_the_product(mode, tmp_path):
  """JAXFUSE_CUBLASLT_AUTOTUNE unset or 0 (the heuristic's first choice, the default), 1
  (burst timing) and sustained (~50 ms per candidate on random bits): whichever candidate
  wins, the bf16 and FP8 products match float64, and with JAXFUSE_CUBLASLT_LOG=1 the log
  shows that the mode ran: candidates timed (a sustained time > 0 only in the sustained
  mode) and one chosen."""
  path = tmp_path / "out.npy"
  env = {key: value for key, value in os.environ.items() if key != "JAXFUSE_CUBLASLT_AUTOTUNE"}
  if mode is not None:
    env["JAXFUSE_CUBLASLT_AUTOTUNE"] = mode
  # The pytest process already holds most of the GPU's memory (XLA preallocates 75%): the
  # child allocates as it goes, so the autotuner's scratch fits in what is left. Both
  # forwards on cuBLASLt (the 16-bit one runs CUTLASS by default).
  done = subprocess.run(
      [sys.executable, "-c", _AUTOTUNE_SCRIPT, str(path)],
      env=dict(env, JAXFUSE_CUBLASLT_LOG="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               JAXFUSE_LINEAR_SCALE_ADD_GEMM="cublaslt"),
      capture_output=True, text=True, check=True, timeout=300)
  fp8, bf16 = np.load(path)
  rng = np.random.default_rng(31)
  x = helpers.as_f64(jnp.asarray(rng.standard_normal((1024, 512)), jnp.bfloat16))
  k = helpers.as_f64(jnp.asarray(rng.standard_normal((512, 768)) / 512 ** 0.5, jnp.bfloat16))
  r = helpers.as_f64(jnp.asarray(rng.standard_normal((1024, 768)), jnp.bfloat16))
  helpers.assert_close(bf16, r - 0.5 * x @ k, jnp.bfloat16, msg="bf16")
  x_q, x_si = numpy_fp8_per_tensor(x, jnp.float8_e4m3fn)
  k_q, k_si = numpy_fp8_per_tensor(k.T, jnp.float8_e4m3fn)
  helpers.assert_close(fp8, r - 0.5 * (x_q * x_si) @ (k_q * k_si).T, jnp.bfloat16, msg="fp8")
  key = r"autotune \[(\d+, \d+, \d+)\]( fp8)?"
  timed = re.findall(key + r" candidate \d+ \([^)]*\): burst ([-\d.]+) ms(.*)", done.stderr)
  failed = re.findall(key + r" candidate \d+ \(.*\) failed", done.stderr)
  chosen = re.findall(key + r": candidate (\d+) of (\d+) chosen(.*)", done.stderr)
  if mode in (None, "0"):
    assert not timed and not failed and not chosen, done.stderr
    return
  # Each product with more than one candidate timed them all (or logged why one failed),
  # timed at least one, and chose among them.
  assert chosen, done.stderr
  for shape, fp8_tag, index, count, untimed in chosen:
    assert not untimed and int(index) < int(count), done.stderr
    timed_here = [t for t in timed if t[:2] == (shape, fp8_tag)]
    failed_here = [f for f in failed if f == (shape, fp8_tag)]
    assert timed_here and len(timed_here) + len(failed_here) == int(count), done.stderr
  for *_, burst, sustained in timed:
    assert float(burst) > 0, done.stderr
    if mode == "sustained":
      sustained_ms = re.fullmatch(r", sustained ([\d.]+) ms", sustained)
      assert sustained_ms and float(sustained_ms[1]) > 0, done.stderr
    else:
      assert not sustained, done.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_accuracy_against_the_bf16_op(backend):
  """E4M3 keeps 3 mantissa bits (relative rounding <= 2^-4 per element); over a K-term
  product of unit-variance data the errors average out to a few percent of the norm.
  Gradients use E5M2 (2 bits, <= 2^-3) for dy."""
  leading, k, n = ((64,), 128, 96) if backend == "cpu" else ((2048,), 1024, 1024)
  x, kernel, residual = on(backend, *make_inputs(21, leading, k, n, jnp.bfloat16))
  residual = residual * 0  # compare the products themselves, not the residual
  fp8 = lambda *a: jaxfuse.linear_scale_add(*a, 1.0, recipe=FP8_RECIPE, implementation="ffi")
  bf16 = lambda *a: jaxfuse.linear_scale_add(*a, 1.0, implementation="ffi")
  assert relative_error(fp8(x, kernel, residual), bf16(x, kernel, residual)) < 0.05
  d_out = helpers.random_array(np.random.default_rng(22), (*leading, n), jnp.bfloat16)
  d_fp8 = jax.vjp(fp8, x, kernel, residual)[1](d_out)
  d_bf16 = jax.vjp(bf16, x, kernel, residual)[1](d_out)
  for name, got, want in zip(("dx", "dkernel", "dresidual"), d_fp8, d_bf16):
    assert relative_error(got, want) < 0.1, name


def test_fp8_runs_fp8_gemms_forward_and_backward():
  x, kernel, residual = make_inputs(23, (32,), 32, 16, jnp.bfloat16)
  loss = lambda x, k, r: jnp.sum(jaxfuse.linear_scale_add(
      x, k, r, 0.5, recipe=FP8_RECIPE, implementation="ffi").astype(jnp.float32))
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, kernel, residual)
  per_platform = lambda target: helpers.count_primitives(jaxpr, helpers.ffi_target(target)) // 2
  assert per_platform("jaxfuse_linear_scale_add_fp8") == 1
  assert per_platform("jaxfuse_scaled_matmul_fp8") == 2
  assert per_platform("jaxfuse_scaled_matmul") == 0


def test_fp8_operands_are_never_transposed_by_xla():
  """Every FP8 operand comes from a quantizing pass in the layout its GEMM reads: the
  kernel's [N, K] (forward) and [K, N] (dgrad) copies, and with a backward x's and dy's
  [M, *] (forward, dgrad) and [*, M] (wgrad) copies. So neither the compiled forward nor
  the backward holds a transpose, and the gradient runs three two-layout quantizing passes
  (kernel, x, dy) (M = 64, K = 128, N = 256)."""
  x, kernel, residual = make_inputs(24, (64,), 128, 256, jnp.bfloat16)
  forward = lambda x, k, r: jaxfuse.linear_scale_add(x, k, r, 0.5, recipe=FP8_RECIPE,
                                                     implementation="ffi")
  loss = lambda x, k, r: jnp.sum(forward(x, k, r).astype(jnp.float32))

  def compiled(fn):
    return jax.jit(fn).lower(x, kernel, residual).compile().as_text()

  def transposes(text):
    return re.findall(r"= (\w+)\[([\d,]+)\]\{[^}]*\} transpose\(", text)

  assert transposes(compiled(forward)) == []
  backward = compiled(jax.grad(loss, argnums=(0, 1)))
  assert transposes(backward) == []
  two_layout_passes = re.findall(r'custom_call_target="jaxfuse_quantize_batches_transposed"',
                                 backward)
  assert len(two_layout_passes) == 3, backward


def test_fp8_donated_residual_is_updated_in_place():
  x, kernel, residual = make_inputs(24, (64,), 32, 48, jnp.bfloat16)
  step = jax.jit(lambda x, k, r: jaxfuse.linear_scale_add(x, k, r, 0.5, recipe=FP8_RECIPE,
                                                          implementation="ffi"),
                 donate_argnums=2)
  compiled = step.lower(x, kernel, residual).compile().as_text()
  custom_call = [l for l in compiled.splitlines() if "jaxfuse_linear_scale_add_fp8" in l]
  assert custom_call and "output_to_operand_aliasing" in custom_call[0]
  assert not [l for l in compiled.splitlines() if " copy(" in l and "f32" not in l.split("=")[0]
              and "bf16[64,48]" in l]


@pytest.mark.parametrize("recipe, shapes, match", [
    (jaxfuse.quantization.Float8CurrentScaling(per_group=True), ((32, 32), (32, 32)),
     r"supports recipe=Float8CurrentScaling\(per_group=False\)"),
    (jaxfuse.quantization.Float8BlockScaling(), ((32, 32), (32, 32)),
     r"supports recipe=Float8CurrentScaling\(per_group=False\)"),
    (FP8_RECIPE, ((32, 24), (24, 32)), r"K \(x.shape\[-1\]\) to be a multiple of 16"),
    (FP8_RECIPE, ((32, 32), (32, 40)), r"N \(kernel.shape\[1\]\) to be a multiple of 16"),
    (FP8_RECIPE, ((30, 32), (32, 32)), r"row count of x .* multiple of 16, got 30"),
])
def test_fp8_errors(recipe, shapes, match):
  x_shape, k_shape = shapes
  x, kernel = jnp.ones(x_shape, jnp.bfloat16), jnp.ones(k_shape, jnp.bfloat16)
  residual = jnp.ones((x_shape[0], k_shape[1]), jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    jaxfuse.linear_scale_add(x, kernel, residual, recipe=recipe, implementation="ffi")


# --- FP8 weights quantized once (quantize_kernel) ---------------------------------------


def _same_bits(actual, expected):
  np.testing.assert_array_equal(np.asarray(actual, np.float32), np.asarray(expected, np.float32))


def _within_one_bf16_rounding(actual, expected):
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                             rtol=2.0 ** -7, atol=0)


def _fp8_loss(implementation):
  def loss(x, kernel, residual, d_out):
    out = jaxfuse.linear_scale_add(x, kernel, residual, -1.5, recipe=FP8_RECIPE,
                                   implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * d_out)
  return loss


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("implementation", ["ffi", "xla"])
@pytest.mark.parametrize("trainable", [False, True])
def test_quantized_kernel_gives_the_results_of_quantizing_in_the_call(backend, implementation,
                                                                     trainable):
  """The same FP8 values, so the same bits on the FFI path (the GEMMs read the same bytes):
  the output, dx, dresidual, and for a trainable copy the kernel's gradient (at its
  master); a frozen copy's cotangent is zero. On the XLA path within one bfloat16 rounding
  (XLA's float32 dot sums in an order that depends on how it lays out its operands)."""
  x, kernel, residual = make_inputs(31, (4, 16), 48, 32, jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(32), (4, 16, 32), jnp.float32)
  x, kernel, residual, d_out = on(backend, x, kernel, residual, d_out)
  q = jaxfuse.quantize_kernel(kernel, FP8_RECIPE, trainable=trainable,
                              implementation=implementation)
  forward = jax.jit(lambda x, k, r: jaxfuse.linear_scale_add(
      x, k, r, -1.5, recipe=FP8_RECIPE, implementation=implementation))
  same = _same_bits if implementation == "ffi" else _within_one_bf16_rounding
  same(forward(x, q, residual), forward(x, kernel, residual))
  grad = jax.jit(jax.grad(_fp8_loss(implementation), argnums=(0, 1, 2)))
  want_dx, want_dkernel, want_dresidual = grad(x, kernel, residual, d_out)
  dx, dq, dresidual = grad(x, q, residual, d_out)
  same(dx, want_dx)
  same(dresidual, want_dresidual)
  assert isinstance(dq, jaxfuse.quantization.QuantizedArray)
  if trainable:
    same(dq.master, want_dkernel)
    assert float(jnp.max(jnp.abs(want_dkernel.astype(jnp.float32)))) > 0
  else:
    assert dq.master is None
    for leaf in jax.tree.leaves(dq):
      assert not np.any(np.asarray(leaf, np.float32))


@pytest.mark.sanitize
@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_kernel_values_against_float64(backend):
  """data [N, K] = E4M3(kernel.T / scale_inv) with scale_inv = amax / 448 (NaN ignored),
  every value within E4M3's half ulp (2^-4 relative); data_untransposed its transpose;
  dequantize gives [K, N]; an all-zero kernel gets scale_inv 1."""
  rng = np.random.default_rng(33)
  values = rng.standard_normal((40, 24)) * np.exp2(rng.integers(-6, 6, (40, 24)))
  values[3, 5] = -900.0
  values[7, 1] = np.nan
  kernel, zeros = on(backend, jnp.asarray(values, jnp.bfloat16), jnp.zeros((16, 32), jnp.float16))
  q = jax.jit(lambda k: jaxfuse.quantize_kernel(k, FP8_RECIPE, trainable=True,
                                                implementation="ffi"))(kernel)
  assert q.scaling_mode == "per_kernel" and q.shape == (40, 24) and q.dtype == jnp.bfloat16
  assert q.data.shape == (24, 40) and q.data.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(np.asarray(q.data_untransposed).view(np.uint8),
                                np.asarray(q.data).T.view(np.uint8))
  k64 = helpers.as_f64(kernel)
  amax = np.nanmax(np.abs(k64))
  np.testing.assert_allclose(float(q.scale_inv[0]), amax / 448.0, rtol=1e-6)
  dequantized = helpers.as_f64(jaxfuse.dequantize(q))
  assert dequantized.shape == (40, 24)
  finite = np.isfinite(k64)
  np.testing.assert_allclose(dequantized[finite], k64[finite], rtol=2.0 ** -4,
                             atol=amax / 448.0 * 2.0 ** -9)
  assert np.isnan(dequantized[~finite]).all()
  zero = jaxfuse.quantize_kernel(zeros, FP8_RECIPE, implementation="ffi")
  np.testing.assert_array_equal(np.asarray(zero.scale_inv), [1.0])
  assert zero.data_untransposed is None and zero.master is None


def _ffi_calls(fn, *args):
  """How many custom calls of each quantizing / backward-GEMM target the compiled fn runs."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  return {target: len(re.findall(f'custom_call_target="{target}"', text))
          for target in ("jaxfuse_batch_amax", "jaxfuse_quantize_batches_transposed",
                         "jaxfuse_quantize", "jaxfuse_scaled_matmul_fp8")}


def test_quantized_kernel_skips_the_weight_passes():
  """With the 16-bit kernel a training step quantizes x, the kernel and dy (three
  two-layout current-scaling calls, amax included) and runs two backward GEMMs; with a
  trainable copy the kernel's call is gone; with a frozen one there is no wgrad GEMM, and x
  and dy are quantized in one layout each (the row-wise quantize)."""
  x, kernel, residual = make_inputs(34, (32,), 32, 48, jnp.bfloat16)
  d_out = jnp.ones((32, 48), jnp.float32)
  # value_and_grad: the forward GEMM and x's quantization stay in the program.
  grad = jax.value_and_grad(_fp8_loss("ffi"), argnums=(0, 1, 2))
  assert _ffi_calls(grad, x, kernel, residual, d_out) == {
      "jaxfuse_batch_amax": 0, "jaxfuse_quantize_batches_transposed": 3, "jaxfuse_quantize": 0,
      "jaxfuse_scaled_matmul_fp8": 2}
  trainable = jaxfuse.quantize_kernel(kernel, FP8_RECIPE, trainable=True, implementation="ffi")
  assert _ffi_calls(grad, x, trainable, residual, d_out) == {
      "jaxfuse_batch_amax": 0, "jaxfuse_quantize_batches_transposed": 2, "jaxfuse_quantize": 0,
      "jaxfuse_scaled_matmul_fp8": 2}
  frozen = jaxfuse.quantize_kernel(kernel, FP8_RECIPE, implementation="ffi")
  assert _ffi_calls(grad, x, frozen, residual, d_out) == {
      "jaxfuse_batch_amax": 0, "jaxfuse_quantize_batches_transposed": 0, "jaxfuse_quantize": 2,
      "jaxfuse_scaled_matmul_fp8": 1}


def test_quantize_kernel_errors():
  kernel = jnp.ones((32, 48), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"quantize_kernel takes recipe=Float8CurrentScaling\("
                                       r"per_group=False\)"):
    jaxfuse.quantize_kernel(kernel, jaxfuse.quantization.Float8CurrentScaling())
  with pytest.raises(ValueError, match=r"forward_format must be 'e4m3', got 'e5m2'"):
    jaxfuse.quantize_kernel(kernel, jaxfuse.quantization.Float8CurrentScaling(
        per_group=False, forward_format="e5m2"))
  with pytest.raises(ValueError, match=r"kernel must have rank 2 \(\[K, N\]\)"):
    jaxfuse.quantize_kernel(jnp.ones((2, 32, 48), jnp.bfloat16), FP8_RECIPE)
  with pytest.raises(TypeError, match=r"kernel"):
    jaxfuse.quantize_kernel(jnp.ones((32, 48), jnp.int32), FP8_RECIPE)


def test_linear_scale_add_rejects_bad_quantized_kernels():
  x, kernel, residual = make_inputs(35, (32,), 32, 48, jnp.bfloat16)
  q = jaxfuse.quantize_kernel(kernel, FP8_RECIPE, trainable=True, implementation="ffi")
  call = lambda k, **kw: jaxfuse.linear_scale_add(x, k, residual, implementation="ffi", **kw)
  other = jaxfuse.quantization.Float8CurrentScaling(per_group=False,
                                                    forward_fast_accumulation=False)
  with pytest.raises(ValueError, match=r"cannot run with recipe="):
    call(q, recipe=other)
  experts = jaxfuse.quantize_experts(kernel[None], jaxfuse.quantization.Float8CurrentScaling())
  with pytest.raises(TypeError, match=r"must come from jaxfuse.quantize_kernel"):
    call(experts)
  with pytest.raises(ValueError, match=r"master must have shape \(32, 48\)"):
    call(dataclasses.replace(q, master=kernel[:16]))
  with pytest.raises(TypeError, match=r"master must have its dtype bfloat16"):
    call(dataclasses.replace(q, master=kernel.astype(jnp.float32)))
  with pytest.raises(ValueError, match=r"x's last dimension \(16\) must equal kernel.shape\[0\] "
                                       r"\(32\)"):
    jaxfuse.linear_scale_add(x[:, :16], q, residual, implementation="ffi")
