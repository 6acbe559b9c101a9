"""The gated FC1 (grouped_linear ffi.grouped_gemm_gated): h = x @ w[g] and its scaled
activation from one kernel on CUDA (cuda/gpu/grouped_gemm/gated_epilogue.cuh), the two
kernels one after the other on CPU. Against float64 numpy, against the two-kernel path bit
for bit, grouped_mlp's choice of it, and its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse._src.ops.grouped_linear import ffi as gemm_ffi
from jaxfuse._src.ops.grouped_linear import sharding as gemm_sharding
from jaxfuse._src.ops.grouped_mlp import api as mlp_api
from jaxfuse._src.ops.scaled_activation import ffi as act_ffi
from tests import helpers
from tests.ops import test_grouped_mlp as mlp_tests

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]
GATED = ["swiglu", "clamped_swiglu"]
ACT = dict(limit=mlp_tests.LIMIT, alpha=mlp_tests.ALPHA, linear_offset=mlp_tests.LINEAR_OFFSET)


def sizes_cases(m):
  return {**mlp_tests.sizes_cases(m),
          "many_groups": [m // 40] * 37 + [3, 0, 1],
          "odd_sizes": [1, 129, 7, m - 137]}


def make_inputs(seed, m, hidden, ffn, groups, scales_dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  x = helpers.random_array(rng, (m, hidden), jnp.bfloat16)
  w = helpers.random_array(rng, (groups, hidden, 2 * ffn), jnp.bfloat16,
                           scale=1 / np.sqrt(hidden))
  scales = jnp.asarray(rng.uniform(0.1, 1.0, m), scales_dtype)
  return x, w, scales


def gated(x, w, offsets, scales, activation):
  return gemm_ffi.grouped_gemm_gated(x, w, offsets, scales, activation=activation, **ACT)


def two_kernels(x, w, offsets, scales, activation):
  h = gemm_ffi.grouped_gemm(x, w, offsets, form=gemm_ffi.FORWARD)
  return h, act_ffi.forward(h, scales, activation=activation, **ACT)


def offsets_of(sizes):
  return jaxfuse.group_offsets(jnp.asarray(sizes, jnp.int32), implementation="ffi")


# GPU: F / 128 odd (3 column tiles) and even (4). These problems are small enough for the
# tile heuristic's kSmall: the ping-pong kernel (both cooperative ones: the test below).
SHAPES = [pytest.param("cpu", 128, id="cpu"),
          pytest.param("gpu", 384, id="gpu-odd_tiles", marks=pytest.mark.gpu),
          pytest.param("gpu", 512, id="gpu-even_tiles", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("backend, ffn", SHAPES)
@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("case", list(sizes_cases(1000)))
def test_matches_float64_numpy_and_the_two_kernel_path(backend, ffn, activation, case):
  m, hidden = (1000, 64) if backend == "cpu" else (1000, 256)
  sizes = sizes_cases(m)[case]
  x, w, scales = make_inputs(11, m, hidden, ffn, len(sizes))
  x, w, scales = mlp_tests.on(backend, x, w, scales)
  offsets = jax.device_put(offsets_of(sizes), x.devices().pop())
  h, act = jax.jit(gated, static_argnums=4)(x, w, offsets, scales, activation)
  assert h.shape == (m, 2 * ffn) and act.shape == (m, ffn)
  assert h.dtype == act.dtype == jnp.bfloat16
  want_h = mlp_tests.np_grouped(helpers.as_f64(x), helpers.as_f64(w), sizes)
  helpers.assert_close(h, want_h, jnp.bfloat16, msg=f"{case} h")
  # The activation of the h it wrote, in float64 (h as stored: the kernel rounds first).
  want_act = mlp_tests.np_activation(helpers.as_f64(h), activation)[0] * helpers.as_f64(
      scales)[:, None]
  helpers.assert_close(act, want_act, jnp.bfloat16, msg=f"{case} act")
  # Bit for bit what the scaled activation kernel makes of that h.
  np.testing.assert_array_equal(
      np.asarray(act, np.float32),
      np.asarray(jax.jit(act_ffi.forward, static_argnames=("activation", "limit", "alpha",
                                                           "linear_offset"))(
          h, scales, activation=activation, **ACT), np.float32), err_msg=case)
  # And the same h as the plain forward (same tiles along K: same sums).
  h_plain, _ = jax.jit(two_kernels, static_argnums=4)(x, w, offsets, scales, activation)
  helpers.assert_close(h, helpers.as_f64(h_plain), jnp.bfloat16, msg=f"{case} h vs plain")
  covered = min(sum(max(s, 0) for s in sizes), m)
  assert not np.asarray(h[covered:], np.float32).any(), "h rows past the groups must be zero"
  assert not np.asarray(act[covered:], np.float32).any(), "act rows past the groups: zero"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_scales_large_values_and_nan_propagate(backend):
  m, hidden, ffn = 384, 64, 128
  sizes = [100, 200, 84]
  x, w, scales = make_inputs(12, m, hidden, ffn, len(sizes), scales_dtype=jnp.bfloat16)
  x = x.at[5].multiply(300.0).at[7, 3].set(jnp.nan)  # saturating gates; one NaN row
  x, w, scales = mlp_tests.on(backend, x, w, scales)
  offsets = jax.device_put(offsets_of(sizes), x.devices().pop())
  h, act = jax.jit(gated, static_argnums=4)(x, w, offsets, scales, "clamped_swiglu")
  h_plain, act_plain = jax.jit(two_kernels, static_argnums=4)(x, w, offsets, scales,
                                                            "clamped_swiglu")
  assert np.isnan(np.asarray(act[7], np.float32)).all(), "a NaN input row propagates"
  assert not np.isnan(np.asarray(act[:7], np.float32)).any()
  finite = np.isfinite(np.asarray(act_plain, np.float32))
  helpers.assert_close(np.where(finite, act, 0), np.where(finite, helpers.as_f64(act_plain), 0),
                       jnp.bfloat16)
  assert np.isfinite(np.asarray(h[5], np.float32)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_contraction_and_no_rows(backend):
  x, w, scales = make_inputs(13, 16, 8, 128, 2)
  x0, w0 = jnp.zeros((16, 0), jnp.bfloat16), jnp.zeros((2, 0, 256), jnp.bfloat16)
  x0, w0, scales = mlp_tests.on(backend, x0, w0, scales)
  offsets = jax.device_put(offsets_of([8, 8]), scales.devices().pop())
  h, act = gated(x0, w0, offsets, scales, "swiglu")
  assert not np.asarray(h, np.float32).any() and not np.asarray(act, np.float32).any()
  h, act = gated(x[:0], w, offsets, scales[:0], "swiglu")
  assert h.shape == (0, 256) and act.shape == (0, 128)


# --- grouped_mlp's choice -----------------------------------------------------------------

def _mlp_jaxpr(ffn, dtype=jnp.bfloat16, activation="swiglu", save_activation=None):
  groups, hidden, m = 3, 16, 48
  rng = np.random.default_rng(14)
  width = 2 * ffn if activation != "srelu" else ffn
  x = helpers.random_array(rng, (m, hidden), dtype)
  k1 = helpers.random_array(rng, (groups, hidden, width), dtype)
  k2 = helpers.random_array(rng, (groups, ffn, hidden), dtype)
  scales = jnp.ones((m,), jnp.float32) * 0.5
  sizes = jnp.asarray([20, 0, 28], jnp.int32)
  loss = lambda *a: jnp.sum(jaxfuse.grouped_mlp(
      a[0], a[1], a[2], sizes, a[3], activation, implementation="ffi",
      save_activation=save_activation).astype(jnp.float32))
  return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, k1, k2, scales)


def _count(jaxpr, target):
  return helpers.count_primitives(jaxpr, helpers.ffi_target(target))


@pytest.fixture(name="gated_on")
def _gated_on(monkeypatch):
  monkeypatch.setenv(mlp_api.GATED_FC1_ENV, "1")


@pytest.mark.usefixtures("gated_on")
def test_grouped_mlp_runs_the_gated_fc1_and_keeps_its_activation():
  jaxpr = _mlp_jaxpr(ffn=128)
  assert _count(jaxpr, "jaxfuse_grouped_gemm_gated") == 1
  # The activation kernel only in the gated op's CPU branch: the backward does not
  # recompute it (save_activation=None keeps the activation FC1's kernel wrote).
  assert _count(jaxpr, "jaxfuse_scaled_activation_fwd") == 1
  # FC1's plain forward only in that CPU branch (whose grouped_gemm has its own two
  # platform branches), and the five other GEMMs in both branches: 2 + 10.
  assert _count(jaxpr, "jaxfuse_grouped_gemm") == 12
  # save_activation=False: the backward recomputes it (its own kernel, both branches).
  assert _count(_mlp_jaxpr(ffn=128, save_activation=False),
                "jaxfuse_scaled_activation_fwd") == 2


@pytest.mark.parametrize("ffn, dtype, activation", [
    (120, jnp.bfloat16, "swiglu"),        # 2F = 240: not a multiple of 256
    (128, jnp.float16, "swiglu"),         # float16: the kernel is bfloat16 only
    (256, jnp.bfloat16, "srelu"),         # not a gated activation
])
@pytest.mark.usefixtures("gated_on")
def test_grouped_mlp_keeps_two_kernels_where_the_gated_one_does_not_apply(ffn, dtype,
                                                                          activation):
  jaxpr = _mlp_jaxpr(ffn, dtype, activation)
  assert _count(jaxpr, "jaxfuse_grouped_gemm_gated") == 0
  assert _count(jaxpr, "jaxfuse_grouped_gemm") == 12


@pytest.mark.parametrize("setting", [None, "0"])
def test_off_by_default_and_with_the_variable_at_0(setting, monkeypatch):
  if setting is None:
    monkeypatch.delenv(mlp_api.GATED_FC1_ENV, raising=False)
  else:
    monkeypatch.setenv(mlp_api.GATED_FC1_ENV, setting)
  jaxpr = _mlp_jaxpr(ffn=128)
  assert _count(jaxpr, "jaxfuse_grouped_gemm_gated") == 0
  assert _count(jaxpr, "jaxfuse_scaled_activation_fwd") == 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", GATED)
def test_grouped_mlp_gradients_identical_with_and_without_it(backend, activation, monkeypatch):
  sizes = jnp.asarray([300, 0, 212, 1], jnp.int32)
  x, k1, scales = make_inputs(15, 520, 64, 128, 4)
  k2 = helpers.random_array(np.random.default_rng(16), (4, 128, 64), jnp.bfloat16, scale=0.1)
  x, k1, k2, scales, sizes = mlp_tests.on(backend, x, k1, k2, scales, sizes)
  results = []
  for setting in ("1", "0"):
    monkeypatch.setenv(mlp_api.GATED_FC1_ENV, setting)

    def loss(x, k1, k2, s):
      out = jaxfuse.grouped_mlp(x, k1, k2, sizes, s, activation, implementation="ffi", **ACT)
      return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    results.append(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, k1, k2, scales))
  (value_on, grads_on), (value_off, grads_off) = results
  np.testing.assert_array_equal(np.asarray(value_on), np.asarray(value_off))
  for name, a, b in zip(("dx", "dk1", "dk2", "dscales"), grads_on, grads_off):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  err_msg=name)


def test_sharding_wrapper_keeps_tokens_local():
  """Under shard_map with the tokens sharded, each device's offsets become local ones."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices("cpu")), ("data",))
  devices = mesh.devices.size
  m = 64 * devices
  sizes = [m // 3, 0, m - m // 3 - 5]
  x, w, scales = make_inputs(17, m, 32, 128, len(sizes))
  offsets = offsets_of(sizes)
  f = lambda x, w, o, s: gemm_sharding.grouped_gemm_gated(x, w, o, s, activation="swiglu",
                                                          **ACT)
  rows = NamedSharding(mesh, P("data"))
  with jaxfuse.sharding_rules(True):
    h, act = jax.jit(f)(jax.device_put(x, rows), w, offsets, jax.device_put(scales, rows))
  want_h, want_act = jax.jit(two_kernels, static_argnums=4)(x, w, offsets, scales, "swiglu")
  np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(want_h, np.float32))
  np.testing.assert_array_equal(np.asarray(act, np.float32), np.asarray(want_act, np.float32))


@pytest.mark.gpu
def test_handler_rejects_a_width_that_is_not_a_multiple_of_256():
  x, w, scales = make_inputs(18, 32, 16, 120, 2)
  x, w, scales = mlp_tests.on("gpu", x, w, scales)
  offsets = jax.device_put(offsets_of([16, 16]), x.devices().pop())
  with pytest.raises(Exception, match="multiple of 256"):
    jax.block_until_ready(gated(x, w, offsets, scales, "swiglu"))


_KERNEL_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
import jaxfuse
from jaxfuse._src.ops.grouped_linear import ffi as g
from jaxfuse._src.ops.scaled_activation import ffi as a
act = dict(activation="clamped_swiglu", limit=1.5, alpha=1.702, linear_offset=1.0)
errors = []
for ffn in (384, 512):  # F / 128 odd and even: the 1x1- and 1x2-cluster cooperative kernels
  rng = np.random.default_rng(ffn)
  # Groups ending mid-warp, on a warp's last row (64 rows after 898) and past the rows.
  sizes = [300, 0, 129, 467, 2, 64]
  m = 1000
  x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((len(sizes), 256, 2 * ffn)) / 16, jnp.bfloat16)
  s = jnp.asarray(rng.uniform(0.1, 1, m), jnp.float32)
  o = jaxfuse.group_offsets(jnp.asarray(sizes, jnp.int32), implementation="ffi")
  h, act_out = jax.jit(lambda *v: g.grouped_gemm_gated(*v, **act))(x, w, o, s)
  h_plain = jax.jit(lambda x, w, o: g.grouped_gemm(x, w, o, form=0))(x, w, o)
  act_of_h = jax.jit(lambda h, s: a.forward(h, s, **act))(h, s)
  h, h_plain, act_out, act_of_h = (np.asarray(v, np.float64) for v in (h, h_plain, act_out, act_of_h))
  errors += [np.abs(act_out - act_of_h).max(), np.abs(h - h_plain).max() / np.abs(h_plain).max()]
np.save(sys.argv[1], np.asarray(errors))
"""


@pytest.mark.gpu
def test_both_kernels_and_both_store_paths_match_the_two_kernel_path(tmp_path):
  """JAXFUSE_GROUPED_GEMM_TILE (read once per process) forces the cooperative kernels
  (large; the unit tests' small problems get the ping-pong one) and the ping-pong one;
  JAXFUSE_GROUPED_GEMM_GATED_STORES the epilogue's staged TMA stores or its register
  stores (a warp whose rows pass its group's end stores from registers either way)."""
  outputs = helpers.outputs_under_environments(
      _KERNEL_SCRIPT, tmp_path,
      {f"{config}-{stores}": {"JAXFUSE_GROUPED_GEMM_TILE": config,
                              "JAXFUSE_GROUPED_GEMM_GATED_STORES": stores}
       for config in ("large", "small") for stores in ("tma", "registers")})
  for config, errors in outputs.items():
    act_errors, h_errors = errors[0::2], errors[1::2]
    assert (act_errors == 0).all(), f"{config}: act differs from scaled_activation(h)"
    assert (h_errors <= helpers.rtol(jnp.bfloat16)).all(), f"{config}: h {h_errors}"
