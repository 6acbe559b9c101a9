"""Sharding rules under jax.jit with NamedSharding (8 CPU devices, see tests/conftest.py).

For each op with a rule and the common shardings: the compiled HLO has no all-gather, and
the results (and gradients) equal the unsharded FFI results. Then the persistent
compilation cache with custom_partitioning, and jax.export.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfuse
from tests import helpers

pytestmark = pytest.mark.skipif(not jaxfuse.build_info()["available"],
                                reason="jaxfuse's extension is not built")

FFI = dict(implementation="ffi")


@pytest.fixture(scope="module")
def mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _shardings(mesh, specs):
  return tuple(NamedSharding(mesh, spec) for spec in specs)


def _compiled(fn, args, mesh, specs):
  return jax.jit(fn, in_shardings=_shardings(mesh, specs)).lower(*args).compile()


def _all_gathers(fn, args, mesh, specs) -> int:
  return _compiled(fn, args, mesh, specs).as_text().count("all-gather")


def _run_sharded(fn, args, mesh, specs, gathers_allowed):
  """fn's sharded results, from one compile that is also checked for all-gathers (CI time:
  compiling once instead of once to run and once to read the HLO)."""
  compiled = _compiled(fn, args, mesh, specs)
  if not gathers_allowed:
    assert compiled.as_text().count("all-gather") == 0, "the sharded program all-gathers"
  return compiled(*args)


def _check(fn, args, mesh, specs, dtype, *, gathers_allowed=False, grad_argnums=None,
           grad_rtol=None):
  """No all-gather (unless allowed), sharded == unsharded, for fn and its gradient.

  grad_rtol: the gradients' relative error budget instead of dtype's (for gradients that
  are quantized again after a summed partial, where one FP8 step is the difference).
  """
  expected = fn(*args)
  actual = _run_sharded(fn, args, mesh, specs, gathers_allowed)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    helpers.assert_close(a, helpers.as_f64(e), dtype, msg="forward")
  if grad_argnums is None:
    return

  def loss(*a):
    return sum(jnp.sum(jnp.square(leaf.astype(jnp.float32)))
               for leaf in jax.tree.leaves(fn(*a)))

  grad = jax.grad(loss, argnums=grad_argnums)
  expected = grad(*args)
  actual = _run_sharded(grad, args, mesh, specs, gathers_allowed)
  for i, (a, e) in enumerate(zip(actual, expected)):
    if grad_rtol is None:
      helpers.assert_close(a, helpers.as_f64(e), dtype, msg=f"gradient {i}")
      continue
    a, e = helpers.as_f64(a), helpers.as_f64(e)
    error = np.abs(a - e).max(initial=0.0) / max(np.abs(e).max(initial=0.0), 1e-30)
    assert error <= grad_rtol, f"gradient {i}: relative error {error:.3g} > {grad_rtol}"


# --- linear_scale_add -------------------------------------------------------------------

LSA_SPECS = {
    "tokens": (P("data"), P(), P("data")),
    "features": (P(), P(None, "model"), P(None, None, "model")),
    "tokens_and_features": (P("data"), P(None, "model"), P("data", None, "model")),
    "contracting": (P(None, None, "model"), P("model"), P()),
    "tokens_and_contracting": (P("data", None, "model"), P("model"), P("data")),
}


@pytest.mark.parametrize("sharding", list(LSA_SPECS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_scale_add(mesh, sharding, dtype):
  rng = np.random.default_rng(0)
  x = helpers.random_array(rng, (4, 8, 32), dtype)
  kernel = helpers.random_array(rng, (32, 24), dtype, scale=1 / np.sqrt(32))
  residual = helpers.random_array(rng, (4, 8, 24), dtype)
  fn = lambda x, k, r: jaxfuse.linear_scale_add(x, k, r, 0.75, **FFI)
  _check(fn, (x, kernel, residual), mesh, LSA_SPECS[sharding], dtype, grad_argnums=(0, 1, 2))


@pytest.mark.parametrize("sharding", ["tokens", "tokens_and_contracting"])
def test_linear_scale_add_explicit_mesh(sharding):
  # jax.make_mesh's default axis types (Explicit in jax 0.11) work too.
  explicit = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  rng = np.random.default_rng(13)
  x = helpers.random_array(rng, (4, 8, 32), jnp.float32)
  kernel = helpers.random_array(rng, (32, 24), jnp.float32)
  residual = helpers.random_array(rng, (4, 8, 24), jnp.float32)
  fn = lambda x, k, r: jaxfuse.linear_scale_add(x, k, r, 0.75, **FFI)
  _check(fn, (x, kernel, residual), explicit, LSA_SPECS[sharding], jnp.float32,
         grad_argnums=(0, 1, 2))


def test_contracting_dimension_adds_the_residual_once(mesh):
  # With K sharded over 4 devices, adding the residual per partial product would add it
  # 4 times: compare against float64 numpy directly.
  rng = np.random.default_rng(1)
  x = helpers.random_array(rng, (16, 32), jnp.float32)
  kernel = helpers.random_array(rng, (32, 8), jnp.float32)
  residual = helpers.random_array(rng, (16, 8), jnp.float32, scale=10.0)
  fn = jax.jit(lambda x, k, r: jaxfuse.linear_scale_add(x, k, r, 0.5, **FFI),
               in_shardings=_shardings(mesh, (P(None, "model"), P("model"), P())))
  expected = helpers.as_f64(residual) + 0.5 * helpers.as_f64(x) @ helpers.as_f64(kernel)
  helpers.assert_close(fn(x, kernel, residual), expected, jnp.float32)


def test_without_rules_the_inputs_are_gathered(mesh):
  # The all-gather count above can fail: the plain FFI call gathers its operands.
  rng = np.random.default_rng(2)
  args = (helpers.random_array(rng, (4, 8, 32), jnp.float32),
          helpers.random_array(rng, (32, 24), jnp.float32),
          helpers.random_array(rng, (4, 8, 24), jnp.float32))
  fn = lambda x, k, r: jaxfuse.linear_scale_add(x, k, r, **FFI)
  with jaxfuse.sharding_rules(False):
    assert _all_gathers(fn, args, mesh, LSA_SPECS["tokens"]) > 0
  assert _all_gathers(fn, args, mesh, LSA_SPECS["tokens"]) == 0


def test_vmap_of_a_partitioned_op():
  rng = np.random.default_rng(3)
  x = helpers.random_array(rng, (3, 8, 16), jnp.float32)
  kernel = helpers.random_array(rng, (3, 16, 8), jnp.float32)
  residual = helpers.random_array(rng, (3, 8, 8), jnp.float32)
  out = jax.jit(jax.vmap(lambda x, k, r: jaxfuse.linear_scale_add(x, k, r, 2.0, **FFI)))(
      x, kernel, residual)
  expected = helpers.as_f64(residual) + 2.0 * np.einsum(
      "bij,bjk->bik", helpers.as_f64(x), helpers.as_f64(kernel))
  helpers.assert_close(out, expected, jnp.float32)


# --- rms_norm / add_rms_norm ---------------------------------------------------------------

NORM_SPECS = {"tokens": P("data"), "tokens_2d": P("data", "model")}


@pytest.mark.parametrize("sharding", list(NORM_SPECS))
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm(mesh, sharding, add):
  rng = np.random.default_rng(4)
  x = helpers.random_array(rng, (4, 8, 32), jnp.float32)
  residual = helpers.random_array(rng, (4, 8, 32), jnp.float32)
  gamma = helpers.random_array(rng, (32,), jnp.float32)
  if add:
    fn = lambda x, r, g: jaxfuse.add_rms_norm(x, r, g, **FFI)
  else:
    fn = lambda x, r, g: jaxfuse.rms_norm(x + r, g, **FFI)
  spec = NORM_SPECS[sharding]
  _check(fn, (x, residual, gamma), mesh, (spec, spec, P()), jnp.float32,
         grad_argnums=(0, 1, 2))


def test_rms_norm_hidden_sharded_is_gathered_but_correct(mesh):
  rng = np.random.default_rng(5)
  x = helpers.random_array(rng, (8, 32), jnp.float32)
  gamma = helpers.random_array(rng, (32,), jnp.float32)
  fn = lambda x, g: jaxfuse.rms_norm(x, g, **FFI)
  _check(fn, (x, gamma), mesh, (P("data", "model"), P("model")), jnp.float32,
         gathers_allowed=True, grad_argnums=(0, 1))


# --- scaled_activation -----------------------------------------------------------------------


@pytest.mark.parametrize("activation,x_spec,s_spec", [
    ("swiglu", P("data"), P("data")),
    ("swiglu", P("data", "model"), P("data", "model")),
    ("srelu", P("data", "model"), P("data", "model")),
    ("srelu", P("data", None, "model"), P("data")),  # features sharded: elementwise
])
def test_scaled_activation(mesh, activation, x_spec, s_spec):
  rng = np.random.default_rng(6)
  x = helpers.random_array(rng, (4, 8, 32), jnp.float32)
  scales = helpers.random_array(rng, (4, 8), jnp.float32)
  fn = lambda x, s: jaxfuse.scaled_activation(x, s, activation, **FFI)
  _check(fn, (x, scales), mesh, (x_spec, s_spec), jnp.float32, grad_argnums=(0, 1))


# --- grouped_linear / group_offsets -----------------------------------------------------------


@pytest.mark.parametrize("sharding", ["features", "tokens_replicated"])
def test_grouped_linear(mesh, sharding):
  rng = np.random.default_rng(7)
  x = helpers.random_array(rng, (64, 32), jnp.bfloat16)
  kernel = helpers.random_array(rng, (4, 32, 48), jnp.bfloat16, scale=1 / np.sqrt(32))
  sizes = jnp.array([10, 0, 31, 20], jnp.int32)  # sums to less than the rows
  fn = lambda x, k, s: jaxfuse.grouped_linear(x, k, s, **FFI)
  specs = {"features": (P(), P(None, None, "model"), P()),
           "tokens_replicated": (P(), P(), P())}[sharding]
  _check(fn, (x, kernel, sizes), mesh, specs, jnp.bfloat16, grad_argnums=(0, 1))


def test_grouped_linear_token_sharded(mesh):
  # group_sizes describe the whole x; each device runs its rows with local offsets.
  rng = np.random.default_rng(8)
  x = helpers.random_array(rng, (64, 32), jnp.bfloat16)
  kernel = helpers.random_array(rng, (3, 32, 16), jnp.bfloat16, scale=1 / np.sqrt(32))
  sizes = jnp.array([30, 5, 29], jnp.int32)
  fn = lambda x, k, s: jaxfuse.grouped_linear(x, k, s, **FFI)
  _check(fn, (x, kernel, sizes), mesh, (P("data"), P(None, None, "model"), P()),
         jnp.bfloat16, grad_argnums=(0, 1))


def grouped_mlp_inputs(rng, tokens, hidden, ffn, activation, sizes):
  """(x, kernel1, kernel2, group sizes, scales) for grouped_mlp, bfloat16 operands."""
  groups = len(sizes)
  width = 2 * ffn if activation == "swiglu" else ffn
  x = helpers.random_array(rng, (tokens, hidden), jnp.bfloat16)
  kernel1 = helpers.random_array(rng, (groups, hidden, width), jnp.bfloat16,
                                 scale=1 / np.sqrt(hidden))
  kernel2 = helpers.random_array(rng, (groups, ffn, hidden), jnp.bfloat16,
                                 scale=1 / np.sqrt(ffn))
  scales = helpers.random_array(rng, (tokens,), jnp.float32)
  return x, kernel1, kernel2, jnp.array(sizes, jnp.int32), scales


@pytest.mark.parametrize("activation", ["swiglu", "srelu"])
def test_grouped_mlp_output_features_sharded(mesh, activation):
  # grouped_mlp runs the partitioned grouped GEMMs and activation: kernel2's output
  # features (H) sharded.
  x, kernel1, kernel2, sizes, scales = grouped_mlp_inputs(
      np.random.default_rng(12), 64, 32, 16, activation, [20, 0, 33, 11])
  fn = lambda x, k1, k2, s, sc: jaxfuse.grouped_mlp(x, k1, k2, s, sc, activation, **FFI)
  _check(fn, (x, kernel1, kernel2, sizes, scales), mesh,
         (P(), P(), P(None, None, "model"), P(), P()), jnp.bfloat16, grad_argnums=(0, 1, 2))


def test_group_offsets_replicated(mesh):
  sizes = jnp.array([3, -1, 7, 0, 2, 5, 1, 4], jnp.int32)
  fn = jax.jit(lambda s: jaxfuse.group_offsets(s, **FFI),
               in_shardings=NamedSharding(mesh, P()))
  np.testing.assert_array_equal(fn(sizes), [0, 3, 3, 10, 10, 12, 17, 18, 22])
  assert _all_gathers(lambda s: jaxfuse.group_offsets(s, **FFI), (sizes,), mesh, (P(),)) == 0


# --- quantize ----------------------------------------------------------------------------------


def _quantize_fn(recipe, kind="activation"):
  def fn(x):
    q = jaxfuse.quantize(x, recipe, kind=kind, **FFI)
    return q.data.astype(jnp.float32), q.scale_inv.astype(jnp.float32)
  return fn


@pytest.mark.parametrize("recipe", [jaxfuse.quantization.MXFP8BlockScaling(),
                                    jaxfuse.quantization.Float8BlockScaling()],
                         ids=["mxfp8", "block_1d"])
@pytest.mark.parametrize("spec", [P("data"), P(("data", "model"))], ids=["rows", "rows_2axes"])
def test_quantize_rows_sharded(mesh, recipe, spec):
  rng = np.random.default_rng(10)
  x = helpers.random_array(rng, (64, 256), jnp.bfloat16, scale=3.0)
  fn = _quantize_fn(recipe)
  expected = fn(x)
  actual = jax.jit(fn, in_shardings=NamedSharding(mesh, spec))(x)
  for a, e in zip(actual, expected):  # same blocks, same scales: bitwise equal
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  assert _all_gathers(fn, (x,), mesh, (spec,)) == 0


def test_quantize_block_2d_is_gathered_but_correct(mesh):
  # 128 x 128 tiles span rows: x is kept replicated. (Current scaling: see
  # test_rules_partitioned.py.)
  rng = np.random.default_rng(11)
  x = helpers.random_array(rng, (256, 128), jnp.bfloat16, scale=3.0)
  x = x.at[200, 5].set(40.0)
  fn = _quantize_fn(jaxfuse.quantization.Float8BlockScaling(), "weight")
  expected = fn(x)
  actual = jax.jit(fn, in_shardings=NamedSharding(mesh, P("data")))(x)
  for a, e in zip(actual, expected):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


# --- persistent compilation cache ---------------------------------------------------------------

_CACHE_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxfuse
    cache_dir, remove_ptr = sys.argv[1], sys.argv[2] == "1"
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", remove_ptr)
    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    rows = NamedSharding(mesh, P("data"))
    def run(alpha):
      f = jax.jit(lambda x, k, r: jaxfuse.linear_scale_add(x, k, r, alpha, implementation="ffi"),
                  in_shardings=(rows, NamedSharding(mesh, P()), rows))
      out = np.asarray(f(x, k, r))
      return bool(np.allclose(out, np.asarray(r) + alpha * np.asarray(x) @ np.asarray(k),
                              atol=1e-4))
    entries = lambda: len([n for n in os.listdir(cache_dir) if not n.endswith("-atime")])
    ok = run(0.5); first = entries()
    jax.clear_caches()
    ok &= run(0.5); second = entries()
    jax.clear_caches()
    # Differs from the first program only in alpha (a static attribute).
    ok &= run(0.25); third = entries()
    print(json.dumps(dict(first=first, second=second, third=third, ok=ok)))
""")


def _run_cache_script(tmp_path, remove_ptr: bool) -> dict:
  cache_dir = tmp_path / ("cache_removed_ptr" if remove_ptr else "cache")
  cache_dir.mkdir()
  env = dict(os.environ)
  env.pop("JAXFUSE_IMPLEMENTATION", None)
  result = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, str(cache_dir),
                           "1" if remove_ptr else "0"], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_persistent_cache_with_custom_partitioning(tmp_path):
  # Observed with jax 0.11.2: custom_partitioning puts a per-lowering callback key into the
  # module, so a new lowering misses the cache and writes another entry (correct, but no
  # reuse). jax_remove_custom_partitioning_ptr_from_cache_key=True gives a hit, and
  # jaxfuse's attribute fingerprint keeps a program with another alpha from hitting it.
  default = _run_cache_script(tmp_path, remove_ptr=False)
  assert default["ok"] and default["first"] >= 1, default
  removed = _run_cache_script(tmp_path, remove_ptr=True)
  assert removed["ok"] and removed["first"] >= 1, removed
  assert removed["second"] == removed["first"], f"no cache hit: {removed}"
  assert removed["third"] > removed["second"], f"alpha=0.25 hit alpha=0.5's entry: {removed}"


# --- jax.export --------------------------------------------------------------------------------


def _export_inputs():
  rng = np.random.default_rng(9)
  return (helpers.random_array(rng, (16, 32), jnp.float32),
          helpers.random_array(rng, (32, 16), jnp.float32),
          helpers.random_array(rng, (16, 16), jnp.float32),
          helpers.random_array(rng, (16,), jnp.float32))


def _block(x, k, r, g):
  h = jaxfuse.linear_scale_add(x, k, r, 0.5, **FFI)
  return jaxfuse.rms_norm(h, g, **FFI)


def test_export_roundtrip():
  pytest.importorskip("flatbuffers")
  args = _export_inputs()
  assert jaxfuse.EXPORT_DISABLED_CHECKS
  with pytest.raises(ValueError, match="custom calls"):
    jax.export.export(jax.jit(_block))(*args)
  exported = jax.export.export(jax.jit(_block),
                               disabled_checks=jaxfuse.EXPORT_DISABLED_CHECKS)(*args)
  restored = jax.export.deserialize(exported.serialize())
  helpers.assert_close(restored.call(*args), helpers.as_f64(_block(*args)), jnp.float32)


_DESERIALIZE_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    import jaxfuse
    jaxfuse.register_handlers()
    restored = jax.export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
    args = np.load(sys.argv[2])
    out = restored.call(*(args[f"a{i}"] for i in range(4)))
    np.save(sys.argv[3], np.asarray(out))
""")


def test_export_deserialized_in_a_fresh_process(tmp_path):
  pytest.importorskip("flatbuffers")
  args = _export_inputs()
  exported = jax.export.export(jax.jit(_block),
                               disabled_checks=jaxfuse.EXPORT_DISABLED_CHECKS)(*args)
  (tmp_path / "blob").write_bytes(exported.serialize())
  np.savez(tmp_path / "args.npz", **{f"a{i}": np.asarray(a) for i, a in enumerate(args)})
  result = subprocess.run([sys.executable, "-c", _DESERIALIZE_SCRIPT, str(tmp_path / "blob"),
                           str(tmp_path / "args.npz"), str(tmp_path / "out.npy")],
                          capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  helpers.assert_close(np.load(tmp_path / "out.npy"), helpers.as_f64(_block(*args)),
                       jnp.float32)


def test_export_sharded_without_rules(mesh):
  pytest.importorskip("flatbuffers")
  args = _export_inputs()
  shardings = _shardings(mesh, (P("data"), P(), P("data"), P()))
  with jaxfuse.sharding_rules(False):
    exported = jax.export.export(jax.jit(_block, in_shardings=shardings),
                                 disabled_checks=jaxfuse.EXPORT_DISABLED_CHECKS)(*args)
  restored = jax.export.deserialize(exported.serialize())
  sharded = [jax.device_put(a, s) for a, s in zip(args, shardings)]
  helpers.assert_close(jax.jit(restored.call)(*sharded), helpers.as_f64(_block(*args)),
                       jnp.float32)
