"""scaled_activation_quantize and scaled_dactivation_quantize: handlers vs the reference,
both vs float64 numpy within the FP8 bound, groups, dscales and dx, HLO (fused: jaxfuse
custom calls only, offsets not recomputed in the backward), jit, vmap, errors."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse.quantization import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from tests import helpers
from tests.ops import test_quantize as tq
from tests.ops import test_scaled_activation as ta

BACKENDS = tq.BACKENDS
ACTIVATIONS = ta.ACTIVATIONS
RECIPES = [Float8CurrentScaling(), Float8CurrentScaling(per_group=False), Float8BlockScaling(),
           Float8BlockScaling(block_size=32), MXFP8BlockScaling()]
SIZES = [4, 0, 7, 3]   # 14 of 16 rows: the last two rows belong to no group
ROWS = 16


# 40: a full 32-block plus a partial one, 13: odd and shorter than a block; the GPU adds
# 64 (whole blocks only) and the widths its vectorized and multi-tile paths take.
FEATURES = {"cpu": [40, 13], "gpu": [64, 40, 13, 1024, 520]}


def on(backend, *arrays):
  device = jax.devices(backend)[0]
  return [jax.device_put(a, device) for a in arrays]


def inputs(seed, f, dtype, activation, rows=ROWS):
  x, scales = ta.make_inputs(seed, (rows,), f, dtype, activation, magnitude=3.0)
  dy = helpers.random_array(np.random.default_rng(seed + 100), (rows, f), dtype)
  return x, scales, dy


def assert_fp8_close(a, b, max_fraction=0.01):
  """Same bits except where exp's last fp32 bit flips a rounding: at most one FP8 step."""
  da, db = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
  assert np.array_equal(np.isnan(da), np.isnan(db))
  bits_differ = tq.bits(a) != tq.bits(b)
  assert bits_differ.mean() <= max_fraction, bits_differ.mean()
  # NaN against NaN (same places, asserted above) is agreement whatever its sign bit.
  differ = bits_differ & ~np.isnan(da)
  # At least one FP8 step of the larger magnitude.
  step = np.maximum(np.abs(da[differ]), np.abs(db[differ])) * 2.0 ** -2 + 2.0 ** -9
  assert (np.abs(da[differ] - db[differ]) <= step).all()


# --- forward ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_handler_vs_reference_and_float64(backend, recipe, activation, dtype):
  fs = FEATURES[backend]
  for seed, f in enumerate(fs):
    x, scales, _ = inputs(seed, f, dtype, activation)
    xb, sb, gb = on(backend, x, scales, jnp.asarray(SIZES, jnp.int32))
    run = lambda impl: jax.jit(lambda x, s, g: jaxfuse.scaled_activation_quantize(
        x, s, g, activation, recipe=recipe, implementation=impl))(xb, sb, gb)
    q_ffi, q_ref = run("ffi"), run("xla")
    assert q_ffi.data.shape == (ROWS, f) and q_ffi.dtype == x.dtype
    assert q_ffi.data.dtype == jnp.float8_e4m3fn and q_ffi.role == "forward"
    assert_fp8_close(q_ffi.data, q_ref.data)
    np.testing.assert_allclose(np.asarray(q_ffi.scale_inv, np.float64),
                               np.asarray(q_ref.scale_inv, np.float64), rtol=1e-5)
    # Quantized act(x) * scale within the FP8 bound of the float64 value.
    expected = ta.np_forward(x, scales, activation)
    tq.check_round_trip(jnp.asarray(expected, jnp.float32), q_ffi)


@pytest.mark.parametrize("backend", BACKENDS)
def test_current_scaling_rows_past_groups_are_zero(backend):
  x, scales, _ = inputs(1, 32, jnp.bfloat16, "swiglu")
  xb, sb, gb = on(backend, x, scales, jnp.asarray(SIZES, jnp.int32))
  for implementation in ("ffi", "xla"):
    q = jaxfuse.scaled_activation_quantize(xb, sb, gb, recipe=Float8CurrentScaling(),
                                           implementation=implementation)
    assert (tq.bits(q.data)[14:] == 0).all()
    assert float(q.scale_inv[1]) == 1.0  # the empty group


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_rows_and_large_magnitudes(backend):
  x, scales, _ = inputs(2, 32, jnp.float32, "swiglu")
  x = x.at[3, 5].set(jnp.nan).at[5, :4].set(-1e4).at[6, 40:44].set(1e4)
  xb, sb, gb = on(backend, x, scales, jnp.asarray(SIZES, jnp.int32))
  for recipe in RECIPES:
    q = jaxfuse.scaled_activation_quantize(xb, sb, gb, recipe=recipe, implementation="ffi")
    data = np.asarray(q.data.astype(jnp.float32))
    assert np.isnan(data[3, 5]) and np.isnan(data).sum() == 1
    assert np.isfinite(np.asarray(q.scale_inv).astype(np.float32)).all()


# --- backward --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_backward_handler_vs_reference_and_float64(backend, recipe, activation, dtype):
  fs = FEATURES[backend]
  for seed, f in enumerate(fs):
    x, scales, dy = inputs(seed + 10, f, dtype, activation)
    xb, sb, dyb, gb = on(backend, x, scales, dy, jnp.asarray(SIZES, jnp.int32))
    run = lambda impl: jax.jit(lambda dy, x, s, g: jaxfuse.scaled_dactivation_quantize(
        dy, x, s, g, activation, recipe=recipe, return_dx=True, implementation=impl))(
            dyb, xb, sb, gb)
    (q_ffi, dx_ffi, ds_ffi), (q_ref, dx_ref, ds_ref) = run("ffi"), run("xla")
    fmt = recipe.gradient_format
    assert q_ffi.data.dtype == (jnp.float8_e5m2 if fmt == "e5m2" else jnp.float8_e4m3fn)
    assert q_ffi.data.shape == x.shape and q_ffi.role == "gradient"
    assert dx_ffi.dtype == x.dtype and ds_ffi.dtype == scales.dtype
    assert_fp8_close(q_ffi.data, q_ref.data)
    want_dx, want_ds = ta.np_backward(dy, x, scales, activation)
    helpers.assert_close(dx_ffi, want_dx, dtype, msg="dx")
    helpers.assert_close(ds_ffi, want_ds, jnp.float32, msg="dscales")
    tq.check_round_trip(jnp.asarray(want_dx, jnp.float32), q_ffi)
    helpers.assert_close(dx_ref, want_dx, dtype, msg="dx reference")


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_without_dx_and_with_bf16_scales(backend):
  x, scales, dy = inputs(3, 48, jnp.bfloat16, "clamped_swiglu")
  scales = scales.astype(jnp.bfloat16)
  xb, sb, dyb, gb = on(backend, x, scales, dy, jnp.asarray(SIZES, jnp.int32))
  q, dx, ds = jaxfuse.scaled_dactivation_quantize(dyb, xb, sb, gb, "clamped_swiglu",
                                                  recipe=Float8CurrentScaling(),
                                                  implementation="ffi")
  assert dx is None and ds.dtype == jnp.bfloat16
  want_dx, want_ds = ta.np_backward(dy, x, scales, "clamped_swiglu")
  helpers.assert_close(ds, want_ds, jnp.bfloat16)
  tq.check_round_trip(jnp.asarray(want_dx, jnp.float32), q)


def current_scaling_both_ways(dy, x, scales, sizes):
  """The per-group current-scaling forward and backward (swiglu) of jaxfuse's handler and of
  the XLA reference: ((q_ffi, q_ref), ((dq, dx, dscales)_ffi, (dq, dx, dscales)_ref))."""
  forward = lambda impl: jax.jit(lambda x, s, g: jaxfuse.scaled_activation_quantize(
      x, s, g, "swiglu", recipe=Float8CurrentScaling(), implementation=impl))(x, scales, sizes)
  backward = lambda impl: jax.jit(lambda dy, x, s, g: jaxfuse.scaled_dactivation_quantize(
      dy, x, s, g, "swiglu", recipe=Float8CurrentScaling(), implementation=impl))(
          dy, x, scales, sizes)
  return (forward("ffi"), forward("xla")), (backward("ffi"), backward("xla"))


def nan_to_zero(fp8):
  """FP8 data with its NaNs (whose sign bit the backends may set differently) as zeros."""
  return jnp.where(jnp.isnan(fp8.astype(jnp.float32)), jnp.zeros_like(fp8), fp8)


@pytest.mark.parametrize("f", [64, 256])
@pytest.mark.parametrize("backend", BACKENDS)
def test_current_scaling_with_many_rows(backend, f):
  """Forward and backward at 20000 rows and 300 groups: the fused amax passes (the
  backward's also writes dscales) must merge every row into its own group's amax. On GPU,
  F=64 runs RowKernel<kAmax> (8 units a row) and F=256 RunAmaxKernel (32 units a row: a
  run of several rows per warp, whose groups change within the run)."""
  rng = np.random.default_rng(40)
  rows = 20000
  x, scales, dy = inputs(41, f, jnp.bfloat16, "swiglu", rows=rows)
  sizes = tq.random_sizes(rng, 300, rows)
  xb, sb, dyb, gb = on(backend, x, scales, dy, sizes)
  (q_ffi, q_ref), ((dq_ffi, _, ds_ffi), (dq_ref, _, ds_ref)) = current_scaling_both_ways(
      dyb, xb, sb, gb)
  assert_fp8_close(q_ffi.data, q_ref.data)
  np.testing.assert_allclose(np.asarray(q_ffi.scale_inv), np.asarray(q_ref.scale_inv),
                             rtol=1e-5)
  assert_fp8_close(dq_ffi.data, dq_ref.data)
  np.testing.assert_allclose(np.asarray(dq_ffi.scale_inv), np.asarray(dq_ref.scale_inv),
                             rtol=1e-5)
  helpers.assert_close(ds_ffi, helpers.as_f64(ds_ref), jnp.float32, msg="dscales")


@pytest.mark.parametrize("backend", BACKENDS)
def test_current_scaling_nan_and_large_values_at_wide_rows(backend):
  """bf16 rows of F=256 (on GPU the amax passes run RunAmaxKernel: 32 units a row, a run of
  rows per warp) holding a NaN in the gate half and +-1e4 in both halves: the group amaxes
  skip the NaN, which reaches the FP8 data (and its row's dscales) where it was; forward
  and backward against the XLA reference, rows past the groups included."""
  f = 256
  x, scales, dy = inputs(9, f, jnp.bfloat16, "swiglu", rows=64)
  x = x.at[3, 5].set(jnp.nan).at[21, 7].set(1e4).at[40, f + 9].set(-1e4)
  sizes = jnp.asarray([20, 0, 30, 10], jnp.int32)  # 60 of 64 rows
  xb, sb, dyb, gb = on(backend, x, scales, dy, sizes)
  (q_ffi, q_ref), ((dq_ffi, _, ds_ffi), (dq_ref, _, ds_ref)) = current_scaling_both_ways(
      dyb, xb, sb, gb)
  data = np.asarray(q_ffi.data.astype(jnp.float32))
  assert np.isnan(data[3, 5]) and np.isnan(data).sum() == 1
  assert_fp8_close(*map(nan_to_zero, (q_ffi.data, q_ref.data)))
  assert np.isfinite(np.asarray(q_ffi.scale_inv)).all()
  np.testing.assert_allclose(np.asarray(q_ffi.scale_inv), np.asarray(q_ref.scale_inv),
                             rtol=1e-5)
  ddata = np.asarray(dq_ffi.data.astype(jnp.float32))
  assert np.isnan(ddata[3, [5, f + 5]]).all() and np.isnan(ddata).sum() == 2
  assert_fp8_close(*map(nan_to_zero, (dq_ffi.data, dq_ref.data)))
  assert np.isfinite(np.asarray(dq_ffi.scale_inv)).all()
  np.testing.assert_allclose(np.asarray(dq_ffi.scale_inv), np.asarray(dq_ref.scale_inv),
                             rtol=1e-5)
  ds_ffi, ds_ref = np.asarray(ds_ffi, np.float64), np.asarray(ds_ref, np.float64)
  assert np.isnan(ds_ffi[3]) and np.isnan(ds_ffi).sum() == 1
  finite = ~np.isnan(ds_ref)
  helpers.assert_close(ds_ffi[finite], ds_ref[finite], jnp.float32, msg="dscales")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_gpu_large_problem_matches_the_reference(recipe):
  """8192 rows x 512 vectors of 8 outputs: past the size from which the row kernels walk a
  row with 64 threads, several vectors each (rowwise.cuh: kLargeProblemUnits), forward and
  backward, against the XLA reference and the float64 values within the FP8 bound."""
  rows, f = 8192, 4096
  assert rows * f // 8 >= 1 << 22
  x, scales, dy = inputs(50, f, jnp.bfloat16, "swiglu", rows=rows)
  sizes = jnp.asarray([1000, 0, 3000, 2500, 1600], jnp.int32)  # 8100 of 8192 rows
  xb, sb, dyb, gb = on("gpu", x, scales, dy, sizes)
  forward = lambda impl: jax.jit(lambda x, s, g: jaxfuse.scaled_activation_quantize(
      x, s, g, "swiglu", recipe=recipe, implementation=impl))(xb, sb, gb)
  q_ffi, q_ref = forward("ffi"), forward("xla")
  assert_fp8_close(q_ffi.data, q_ref.data)
  np.testing.assert_allclose(np.asarray(q_ffi.scale_inv, np.float64),
                             np.asarray(q_ref.scale_inv, np.float64), rtol=1e-5)
  expected = ta.np_forward(x, scales, "swiglu")
  tq.check_round_trip(jnp.asarray(expected, jnp.float32), q_ffi)
  backward = lambda impl: jax.jit(lambda dy, x, s, g: jaxfuse.scaled_dactivation_quantize(
      dy, x, s, g, "swiglu", recipe=recipe, return_dx=True, implementation=impl))(
          dyb, xb, sb, gb)
  (dq_ffi, dx_ffi, ds_ffi), (dq_ref, _, _) = backward("ffi"), backward("xla")
  assert_fp8_close(dq_ffi.data, dq_ref.data)
  want_dx, want_ds = ta.np_backward(dy, x, scales, "swiglu")
  helpers.assert_close(dx_ffi, want_dx, jnp.bfloat16, msg="dx")
  helpers.assert_close(ds_ffi, want_ds, jnp.float32, msg="dscales")


_ROW_KERNEL_SCRIPT = r"""
import sys
import numpy as np, jax, jax.numpy as jnp
import jaxfuse
from jaxfuse.quantization import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
inputs = np.load(sys.argv[1] + "/in.npz")
gpu = jax.devices("gpu")[0]
put = lambda name, dtype: jax.device_put(jnp.asarray(inputs[name], dtype), gpu)
sizes = put("sizes", jnp.int32)
out = {}
for dtype, activation in ((jnp.bfloat16, "swiglu"), (jnp.float32, "srelu")):
  x = put(f"x_{activation}", dtype)
  scales = put("scales", jnp.float32)
  dy = put("dy", dtype)
  y, vjp = jax.vjp(lambda x, s: jaxfuse.scaled_activation(x, s, activation, implementation="ffi"),
                   x, scales)
  dx, ds = vjp(dy)
  out.update({f"{activation}_y": y, f"{activation}_dx": dx, f"{activation}_ds": ds})
x, scales, dy = put("x_swiglu", jnp.bfloat16), put("scales", jnp.float32), put("dy", jnp.bfloat16)
for name, recipe in (("current", Float8CurrentScaling()), ("block", Float8BlockScaling()),
                     ("mx", MXFP8BlockScaling())):
  for impl in ("ffi", "xla"):
    q = jax.jit(lambda x, s, g: jaxfuse.scaled_activation_quantize(
        x, s, g, "swiglu", recipe=recipe, implementation=impl))(x, scales, sizes)
    dq, dx, ds = jax.jit(lambda dy, x, s, g: jaxfuse.scaled_dactivation_quantize(
        dy, x, s, g, "swiglu", recipe=recipe, return_dx=True, implementation=impl))(
            dy, x, scales, sizes)
    bits = lambda data: jax.lax.bitcast_convert_type(data, jnp.uint8)
    out.update({f"{name}_{impl}_q": bits(q.data), f"{name}_{impl}_qs": q.scale_inv,
                f"{name}_{impl}_dq": bits(dq.data),
                f"{name}_{impl}_dqs": dq.scale_inv, f"{name}_{impl}_dx": dx,
                f"{name}_{impl}_ds": ds})
np.savez(sys.argv[1] + "/out.npz", **{k: np.asarray(v, np.uint8 if v.dtype == jnp.uint8 else np.float32)
                                      for k, v in out.items()})
"""


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    {"JAXFUSE_ROWWISE_STAGED": "0"},
    {},
    {"JAXFUSE_ROWWISE_STAGED": "1"},
    {"JAXFUSE_ROWWISE_STAGED": "1", "JAXFUSE_ROWWISE_STAGES": "2",
     "JAXFUSE_ROWWISE_TILE_UNITS": "32", "JAXFUSE_ROWWISE_STAGED_THREADS": "64"},
    {"JAXFUSE_ROWWISE_STAGED": "0", "JAXFUSE_ROWWISE_MAX_THREADS": "64",
     "JAXFUSE_ROWWISE_PREFETCH": "2"},
    {"JAXFUSE_ROWWISE_STAGED": "0", "JAXFUSE_ROWWISE_MAX_THREADS": "64",
     "JAXFUSE_ROWWISE_PREFETCH": "0"},
    {"JAXFUSE_ROWWISE_STAGED": "0", "JAXFUSE_ROWWISE_MIN_BLOCKS": "0"},
    {"JAXFUSE_ROWWISE_STAGED": "0", "JAXFUSE_ROWWISE_MIN_BLOCKS": "5"},
    {"JAXFUSE_ROWWISE_STAGED": "0", "JAXFUSE_ROWWISE_MIN_BLOCKS": "6",
     "JAXFUSE_ROWWISE_MAX_THREADS": "64"},
    {"JAXFUSE_RUN_AMAX": "0"},
], ids=["unstaged", "default", "staged", "staged_small_tiles", "prefetch_l2_long_rows",
        "no_prefetch_long_rows", "gradient_registers_uncapped", "gradient_registers_48",
        "gradient_registers_40_long_rows", "row_kernel_amax"])
def test_gpu_row_kernel_variants_match(tmp_path, config):
  """The row kernels as the environment shapes them (read once per process, hence a
  subprocess each): RowKernel everywhere, the default choice (staged for the plain
  backward only), the staged kernel for every producer and sink with its default tiles
  (F=4800: a full tile and a ragged one per row), and with 32-vector tiles two stages deep
  (19 tiles a row, so the stages wrap many times within a row), and RowKernel at 64
  threads (10 steps a row, each prefetching the next) with L2 prefetch and without, and the
  activation-gradient passes with RowKernel's registers (uncapped) and with every sink's
  registers capped (RowKernelCapped; by default only the current-scaling passes), and the
  current-scaling amax passes in RowKernel<kAmax> instead of RunAmaxKernel. The
  plain activation and its backward (bf16 SwiGLU, float32 squared ReLU) against float64
  numpy; the fused quantization, forward and backward, per-group current, 1x128 and MXFP8,
  against the XLA reference."""
  rows, f = 70, 4800
  x, scales, dy = inputs(60, f, jnp.bfloat16, "swiglu", rows=rows)
  x_srelu, _ = ta.make_inputs(61, (rows,), f, jnp.float32, "srelu", magnitude=3.0)
  sizes = np.asarray([20, 0, 33, 11], np.int32)  # 64 of 70 rows
  np.savez(tmp_path / "in.npz", x_swiglu=np.asarray(x, np.float32),
           x_srelu=np.asarray(x_srelu, np.float32), scales=np.asarray(scales, np.float32),
           dy=np.asarray(dy, np.float32), sizes=sizes)
  subprocess.run([sys.executable, "-c", _ROW_KERNEL_SCRIPT, str(tmp_path)],
                 env=dict(os.environ, **config), check=True, timeout=300)
  out = np.load(tmp_path / "out.npz")
  for activation, x_in, dtype in (("swiglu", x, jnp.bfloat16), ("srelu", x_srelu, jnp.float32)):
    dy_in = dy if dtype == jnp.bfloat16 else jnp.asarray(dy, jnp.float32)
    helpers.assert_close(out[f"{activation}_y"], ta.np_forward(x_in, scales, activation), dtype,
                         msg=f"{activation} forward")
    want_dx, want_ds = ta.np_backward(dy_in, x_in, scales, activation)
    helpers.assert_close(out[f"{activation}_dx"], want_dx, dtype, msg=f"{activation} dx")
    helpers.assert_close(out[f"{activation}_ds"], want_ds, dtype, msg=f"{activation} ds")
  for name in ("current", "block", "mx"):
    for key, fp8 in (("q", jnp.float8_e4m3fn), ("dq", jnp.float8_e5m2)):  # forward, gradient
      assert_fp8_close(*(jnp.asarray(out[f"{name}_{impl}_{key}"].view(fp8))
                         for impl in ("ffi", "xla")))
      np.testing.assert_allclose(out[f"{name}_ffi_{key}s"], out[f"{name}_xla_{key}s"], rtol=1e-5,
                                 err_msg=f"{name} {key} scale_inv")
    helpers.assert_close(out[f"{name}_ffi_dx"], helpers.as_f64(out[f"{name}_xla_dx"]),
                         jnp.bfloat16, msg=f"{name} dx")
    helpers.assert_close(out[f"{name}_ffi_ds"], helpers.as_f64(out[f"{name}_xla_ds"]),
                         jnp.bfloat16, msg=f"{name} dscales")


# --- HLO: fused, offsets computed once ---------------------------------------------------


def test_forward_lowers_to_jaxfuse_custom_calls_only():
  x, scales, dy = inputs(4, 64, jnp.bfloat16, "swiglu")
  sizes = jnp.asarray(SIZES, jnp.int32)
  for recipe in RECIPES:
    f = jax.jit(lambda x, s, g: jaxfuse.scaled_activation_quantize(
        x, s, g, recipe=recipe, implementation="ffi"))
    hlo = f.lower(x, scales, sizes).as_text()
    calls = [line for line in hlo.splitlines() if "custom_call" in line]
    assert calls and all("@jaxfuse_" in line for line in calls), calls
    assert hlo.count("jaxfuse_scaled_activation_quantize") == 1
    for op in ("logistic", "exponential", "stablehlo.multiply", "stablehlo.clamp",
               "stablehlo.convert"):
      assert op not in hlo, op  # no XLA computation of the activation or the cast
    compiled = f.lower(x, scales, sizes).compile().as_text()
    assert "logistic" not in compiled and "exponential" not in compiled


def test_backward_reuses_offsets():
  x, scales, dy = inputs(5, 64, jnp.bfloat16, "swiglu")
  offsets = jaxfuse.group_offsets(jnp.asarray(SIZES, jnp.int32))
  f = jax.jit(lambda dy, x, s, o: jaxfuse.scaled_dactivation_quantize(
      dy, x, s, group_offsets=o, recipe=Float8CurrentScaling(), implementation="ffi"))
  hlo = f.lower(dy, x, scales, offsets).as_text()
  assert "jaxfuse_group_offsets" not in hlo
  assert hlo.count("jaxfuse_scaled_dactivation_quantize") == 1
  assert "logistic" not in hlo and "exponential" not in hlo


# --- vmap, grad, errors ----------------------------------------------------------------


def test_vmap_runs_per_example():
  x, scales, _ = inputs(6, 32, jnp.float32, "srelu", rows=2 * ROWS)
  x, scales = x.reshape(2, ROWS, 32), scales.reshape(2, ROWS)
  sizes = jnp.asarray([SIZES, [16, 0, 0, 0]], jnp.int32)
  q = jax.vmap(lambda x, s, g: jaxfuse.scaled_activation_quantize(
      x, s, g, "srelu", recipe=Float8CurrentScaling(), implementation="ffi"))(x, scales, sizes)
  for b in range(2):
    single = jaxfuse.scaled_activation_quantize(x[b], scales[b], sizes[b], "srelu",
                                                recipe=Float8CurrentScaling(),
                                                implementation="xla")
    assert_fp8_close(q.data[b], single.data)


def test_not_differentiable_gradients_are_stopped():
  x, scales, _ = inputs(7, 16, jnp.float32, "swiglu")
  g = jax.grad(lambda x: jnp.sum(jaxfuse.dequantize(jaxfuse.scaled_activation_quantize(
      x, scales, None, recipe=Float8BlockScaling(), implementation="ffi"))))(x)
  np.testing.assert_array_equal(g, np.zeros_like(x))


def test_errors():
  x = jnp.ones((8, 32), jnp.bfloat16)
  s = jnp.ones((8,), jnp.float32)
  g = jnp.asarray([8], jnp.int32)
  with pytest.raises(ValueError, match="activation must be one of"):
    jaxfuse.scaled_activation_quantize(x, s, g, "relu", recipe=Float8CurrentScaling())
  with pytest.raises(ValueError, match="x's last dimension must be even"):
    jaxfuse.scaled_activation_quantize(jnp.ones((8, 31)), s, g, recipe=Float8CurrentScaling())
  with pytest.raises(ValueError, match=r"scales must have shape \(8,\)"):
    jaxfuse.scaled_activation_quantize(x, jnp.ones((7,)), g, recipe=Float8CurrentScaling())
  with pytest.raises(TypeError, match="group_sizes must have dtype int32, got int8"):
    jaxfuse.scaled_activation_quantize(x, s, np.array([8], np.int8), recipe=Float8CurrentScaling())
  with pytest.raises(ValueError, match="needs group_sizes"):
    jaxfuse.scaled_activation_quantize(x, s, None, recipe=Float8CurrentScaling())
  with pytest.raises(ValueError, match=r"dy must have shape \(8, 16\)"):
    jaxfuse.scaled_dactivation_quantize(jnp.ones((8, 32), jnp.bfloat16), x, s, g,
                                        recipe=Float8CurrentScaling())
