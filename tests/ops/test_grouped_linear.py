"""grouped_linear: reference and FFI (CPU, CUDA) vs float64 numpy on hard group sizes,
gradients, offsets reuse, vmap, shard_map, errors, CUDA graphs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxfuse
from jaxfuse._src import compat
from jaxfuse._src.ops.grouped_linear import reference
from tests import helpers

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]


def sizes_cases(m: int) -> dict[str, list[int]]:
  """Group sizes that exercise every trap, for m rows."""
  rng = np.random.default_rng(m)
  return {
      "uniform": [m // 4] * 4,
      "one_group": [m],
      "empty_groups": [0, m // 2, 0, m - m // 2, 0],
      "sum_less_than_rows": [m // 5, m // 7, m // 3],
      "sum_more_than_rows": [m // 2, m // 2, m // 2],
      "negative_sizes": [-5, m // 2, -1, m // 3],
      "skewed": [m - 3, 1, 1, 1],
      "many_groups": list(rng.multinomial(m, np.ones(128) / 128)),
      # The CUDA setup kernel's two paths: one warp up to 31 groups, the block from 32.
      "groups_31_sum_less": list(rng.multinomial(m - 7, np.ones(31) / 31)),
      "groups_32_negative": [-2] + list(rng.multinomial(m, np.ones(31) / 31)),
  }


def numpy_grouped_linear(x, kernel, sizes):
  x64, k64 = helpers.as_f64(x), helpers.as_f64(kernel)
  m = x64.shape[0]
  out = np.zeros((m, k64.shape[2]))
  start = 0
  for g, size in enumerate(sizes):
    end = min(start + max(int(size), 0), m)
    out[start:end] = x64[start:end] @ k64[g]
    start = end
  return out


def numpy_grouped_grads(x, kernel, sizes, d_out):
  x64, k64, d64 = helpers.as_f64(x), helpers.as_f64(kernel), helpers.as_f64(d_out)
  m = x64.shape[0]
  d_x, d_k = np.zeros_like(x64), np.zeros_like(k64)
  start = 0
  for g, size in enumerate(sizes):
    end = min(start + max(int(size), 0), m)
    d_x[start:end] = d64[start:end] @ k64[g].T
    d_k[g] = x64[start:end].T @ d64[start:end]
    start = end
  return d_x, d_k


def make_inputs(seed, m, k, n, groups, dtype):
  rng = np.random.default_rng(seed)
  x = helpers.random_array(rng, (m, k), dtype)
  kernel = helpers.random_array(rng, (groups, k, n), dtype, scale=1 / np.sqrt(k))
  return x, kernel


def on(device_kind, *arrays):
  device = jax.devices(device_kind)[0]
  return [jax.device_put(a, device) for a in arrays]


@pytest.mark.parametrize("case", list(sizes_cases(96)))
def test_reference_matches_float64_numpy(case):
  sizes = sizes_cases(96)[case]
  x, kernel = make_inputs(0, 96, 24, 40, len(sizes), jnp.float32)
  out = reference.grouped_linear(x, kernel, jnp.asarray(sizes, jnp.int32))
  helpers.assert_close(out, numpy_grouped_linear(x, kernel, sizes), jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", list(sizes_cases(96)))
def test_ffi_matches_float64_numpy(backend, dtype, case):
  m, k, n = (96, 24, 40) if backend == "cpu" else (1000, 264, 520)
  sizes = sizes_cases(m)[case]
  x, kernel = make_inputs(1, m, k, n, len(sizes), dtype)
  x, kernel, group_sizes = on(backend, x, kernel, jnp.asarray(sizes, jnp.int32))
  # Outputs are fresh (uninitialised on GPU) buffers: rows past the groups must be written as zeros.
  out = jax.jit(lambda *a: jaxfuse.grouped_linear(*a, implementation="ffi"))(
      x, kernel, group_sizes)
  assert out.dtype == dtype and out.shape == (m, n)
  expected = numpy_grouped_linear(x, kernel, sizes)
  helpers.assert_close(out, expected, dtype, msg=case)
  covered = min(sum(max(s, 0) for s in sizes), m)
  assert not np.asarray(out[covered:], np.float32).any(), "rows past the groups must be zero"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["uniform", "empty_groups", "sum_less_than_rows",
                                  "sum_more_than_rows", "many_groups", "groups_31_sum_less",
                                  "groups_32_negative"])
def test_gradients_match_float64_numpy(backend, case):
  dtype = jnp.bfloat16
  m, k, n = (64, 16, 24) if backend == "cpu" else (768, 128, 256)
  sizes = sizes_cases(m)[case]
  x, kernel = make_inputs(2, m, k, n, len(sizes), dtype)
  d_out = helpers.random_array(np.random.default_rng(3), (m, n), dtype)
  x, kernel, d_out, group_sizes = on(backend, x, kernel, d_out,
                                     jnp.asarray(sizes, jnp.int32))
  _, vjp = jax.vjp(lambda x, w: jaxfuse.grouped_linear(x, w, group_sizes,
                                                        implementation="ffi"), x, kernel)
  d_x, d_kernel = jax.jit(vjp)(d_out)
  want_x, want_kernel = numpy_grouped_grads(x, kernel, sizes, d_out)
  helpers.assert_close(d_x, want_x, dtype, msg="dx")
  helpers.assert_close(d_kernel, want_kernel, dtype, msg="dkernel")
  for g, size in enumerate(sizes):  # empty groups: exactly zero, not garbage
    start = min(sum(max(s, 0) for s in sizes[:g]), m)
    if min(start + max(size, 0), m) == start:
      assert not np.asarray(d_kernel[g], np.float32).any(), f"dkernel[{g}] of an empty group"


def test_backward_reuses_the_forward_offsets():
  x, kernel = make_inputs(4, 32, 16, 8, 4, jnp.bfloat16)
  group_sizes = jnp.asarray([8, 0, 16, 8], jnp.int32)
  loss = lambda x, w: jnp.sum(jaxfuse.grouped_linear(x, w, group_sizes,
                                                     implementation="ffi").astype(jnp.float32))
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, kernel)
  offsets_computations = helpers.count_primitives(
      jaxpr, lambda e: e.primitive.name == "cumsum" or
      helpers.ffi_target("jaxfuse_group_offsets")(e))
  assert offsets_computations == 1
  # forward, dgrad and wgrad: three grouped GEMMs per platform branch (cpu, cuda).
  assert helpers.count_primitives(jaxpr, helpers.ffi_target("jaxfuse_grouped_gemm")) == 6


def test_vmap():
  x, kernel = make_inputs(5, 32, 16, 8, 3, jnp.bfloat16)
  xs = jnp.stack([x, -x])
  sizes = jnp.asarray([[10, 0, 22], [3, 3, 3]], jnp.int32)
  out = jax.vmap(lambda x, s: jaxfuse.grouped_linear(x, kernel, s, implementation="ffi"))(
      xs, sizes)
  for b in range(2):
    helpers.assert_close(out[b], numpy_grouped_linear(xs[b], kernel, np.asarray(sizes[b])),
                         jnp.bfloat16)


def test_shard_map_tokens_sharded_kernel_replicated():
  mesh = Mesh(np.array(jax.devices("cpu")), ("data",))
  devices = mesh.devices.size
  m_local, k, n, groups = 16, 16, 8, 3
  x, kernel = make_inputs(6, m_local * devices, k, n, groups, jnp.bfloat16)
  rng = np.random.default_rng(7)
  # Each device holds its own tokens, sorted by expert, with its own group sizes.
  local_sizes = np.stack([rng.multinomial(m_local - 2, np.ones(groups) / groups)
                          for _ in range(devices)]).astype(np.int32)

  def layer(implementation):
    def f(x, w, sizes):
      return jaxfuse.grouped_linear(x, w, sizes[0], implementation=implementation)
    return compat.shard_map(f, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                            out_specs=P("data"))

  sizes = jnp.asarray(local_sizes)
  out = jax.jit(layer("ffi"))(x, kernel, sizes)
  expected = np.concatenate([
      numpy_grouped_linear(x[d * m_local:(d + 1) * m_local], kernel, local_sizes[d])
      for d in range(devices)])
  helpers.assert_close(out, expected, jnp.bfloat16)
  loss = lambda impl: lambda x, w: jnp.sum(jnp.sin(layer(impl)(x, w, sizes).astype(jnp.float32)))
  got = jax.jit(jax.grad(loss("ffi"), argnums=(0, 1)))(x, kernel)
  want = jax.grad(loss("xla"), argnums=(0, 1))(x, kernel)
  for g, w in zip(got, want):
    helpers.assert_close(g, helpers.as_f64(w), jnp.bfloat16)


@pytest.mark.parametrize("args, error, match", [
    (((8, 16), (2, 8, 8), (2,), jnp.bfloat16), ValueError,
     r"x's last dimension \(16\) must equal kernel.shape\[1\] \(8\)"),
    (((8, 16), (2, 16, 8), (3,), jnp.bfloat16), ValueError,
     r"group_sizes must have shape \(2,\)"),
    (((8, 16), (16, 8), (2,), jnp.bfloat16), ValueError, r"kernel must have rank 3 \(\[G, K, N\]\)"),
    (((8, 12), (2, 12, 8), (2,), jnp.bfloat16), ValueError,
     r"K \(x.shape\[1\]\) to be a multiple of 8"),
    (((8, 16), (2, 16, 6), (2,), jnp.bfloat16), ValueError,
     r"N \(kernel.shape\[2\]\) to be a multiple of 8"),
    (((8, 16), (2, 16, 8), (2,), jnp.float32), TypeError, r"take bfloat16 or float16 x"),
])
def test_errors_name_the_argument(args, error, match):
  x_shape, k_shape, s_shape, dtype = args
  with pytest.raises(error, match=match):
    jaxfuse.grouped_linear(jnp.ones(x_shape, dtype), jnp.ones(k_shape, dtype),
                           jnp.ones(s_shape, jnp.int32), implementation="ffi")


def test_group_sizes_must_be_int32():
  with pytest.raises(TypeError, match=r"group_sizes must be int32 \[G\], got float32"):
    jaxfuse.grouped_linear(jnp.ones((8, 16), jnp.bfloat16), jnp.ones((2, 16, 8), jnp.bfloat16),
                           jnp.ones((2,), jnp.float32))


# --- GPU only ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.sanitize
def test_hostile_group_sizes_stay_in_bounds():
  """Run under compute-sanitizer (scripts/gpu_run.sh sanitize): no access out of bounds."""
  m, k, n = 256, 64, 128
  x, kernel = make_inputs(8, m, k, n, 4, jnp.bfloat16)
  for sizes in ([2**30, 2**30, 5, 7], [-2**31, 300, -7, 2**31 - 1], [0, 0, 0, 0],
                [m + 1, 0, 0, 0]):
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out, vjp = jax.vjp(lambda x, w: jaxfuse.grouped_linear(x, w, group_sizes,
                                                            implementation="ffi"), x, kernel)
    d_x, d_kernel = vjp(jnp.ones_like(out))
    helpers.assert_close(out, numpy_grouped_linear(x, kernel, sizes), jnp.bfloat16)
    want_x, want_kernel = numpy_grouped_grads(x, kernel, sizes, np.ones((m, n)))
    helpers.assert_close(d_x, want_x, jnp.bfloat16)
    helpers.assert_close(d_kernel, want_kernel, jnp.bfloat16)


_GRAPH_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxfuse
    rng = np.random.default_rng(0)
    m, k, n, g = 2048, 256, 512, 8
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / 16, jnp.bfloat16)
    @jax.jit
    def step(x, w, sizes):
      out, vjp = jax.vjp(lambda x, w: jaxfuse.grouped_linear(x, w, sizes,
                                                             implementation="ffi"), x, w)
      return (out, *vjp(out))
    results = []
    # The same executable (and CUDA graph) replayed with group sizes changed on the device.
    for sizes in ([256] * 8, [0, 1000, 0, 48, 500, 500, 0, 0], [2048, 0, 0, 0, 0, 0, 0, 0],
                  [100] * 8):
      results.append(np.concatenate([np.asarray(a, np.float32).ravel()
                                     for a in step(x, w, jnp.asarray(sizes, jnp.int32))]))
    np.save(sys.argv[1], np.stack(results))
""")


@pytest.mark.gpu
def test_cuda_graph_replays_follow_device_side_sizes(tmp_path):
  graphs = helpers.plain_and_graph_runs(_GRAPH_SCRIPT, tmp_path)
  assert not np.array_equal(graphs[0], graphs[1])


_TILE_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxfuse
    inputs = np.load(sys.argv[1] + "/in.npz")
    x, w, d_out = (jnp.asarray(inputs[name], jnp.bfloat16) for name in ("x", "w", "d_out"))
    @jax.jit
    def step(x, w, sizes, d_out):
      out, vjp = jax.vjp(lambda x, w: jaxfuse.grouped_linear(x, w, sizes,
                                                             implementation="ffi"), x, w)
      return (out, *vjp(d_out))
    results = {}
    for index, sizes in enumerate(sys.argv[2:]):  # one executable, sizes changed on device
      sizes = jnp.asarray([int(s) for s in sizes.split(",")], jnp.int32)
      for name, value in zip(("out", "d_x", "d_kernel"), step(x, w, sizes, d_out)):
        results[f"{index}_{name}"] = np.asarray(value, np.float32)
    np.savez(sys.argv[1] + "/out.npz", **results)
""")


def _tile_script_runs(tmp_path, size_sets, environments):
  """_TILE_SCRIPT's arrays ("{index}_out", "_d_x", "_d_kernel" per size set) from one fresh
  process per entry of `environments` (name -> variables set on top of os.environ: the
  grouped GEMM reads its tuning variables once per process), by name. The inputs are
  tmp_path/in.npz."""
  runs = {}
  for name, variables in environments.items():
    subprocess.run([sys.executable, "-c", _TILE_SCRIPT, str(tmp_path),
                    *(",".join(map(str, sizes)) for sizes in size_sets)],
                   env=dict(os.environ, **variables), check=True, timeout=300)
    with np.load(tmp_path / "out.npz") as results:  # the next process overwrites it
      runs[name] = dict(results)
  return runs


_PDL_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxfuse
    rng = np.random.default_rng(3)
    m, k, n, groups = 2304, 256, 384, 6
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((groups, k, n)) / 16, jnp.bfloat16)
    d_out = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    fp8 = jaxfuse.quantization.Float8CurrentScaling(per_group=True)
    @jax.jit
    def step(x, w, sizes, d_out):
      outputs = []
      for recipe in (None, fp8):
        out, vjp = jax.vjp(lambda x, w: jaxfuse.grouped_linear(
            x, w, sizes, recipe=recipe, implementation="ffi"), x, w)
        outputs += [out, *vjp(d_out)]
      return outputs
    results = []
    # One executable (XLA's CUDA graphs where it makes them), sizes changed on the device:
    # ragged with an empty group and sum < m, then a sum past m.
    for sizes in ([700, 0, 333, 600, 517, 100], [1024, 512, 512, 0, 512, 1024]):
      results.append(np.concatenate([np.asarray(a, np.float32).ravel()
                                     for a in step(x, w, jnp.asarray(sizes, jnp.int32), d_out)]))
    np.save(sys.argv[1], np.stack(results))
""")


@pytest.mark.gpu
def test_programmatic_dependent_launch_changes_no_bit(tmp_path):
  """Small problems (these are) launch the CUTLASS kernels as programmatic dependents of
  the setup kernel by default, JAXFUSE_GROUPED_GEMM_PDL=1 always, =0 never (their CTAs wait
  in griddepcontrol.wait): bf16 and FP8 forward, dgrad and wgrad, kAdaptive's two kernels
  included, must give the very bits of ordinary launches."""
  runs = helpers.outputs_under_environments(
      _PDL_SCRIPT, tmp_path, {"default": {"JAXFUSE_GROUPED_GEMM_PDL": None},
                              "plain": {"JAXFUSE_GROUPED_GEMM_PDL": "0"},
                              "pdl": {"JAXFUSE_GROUPED_GEMM_PDL": "1"},
                              "pdl_adaptive": {"JAXFUSE_GROUPED_GEMM_PDL": "1",
                                               "JAXFUSE_GROUPED_GEMM_TILE": "adaptive"},
                              "plain_adaptive": {"JAXFUSE_GROUPED_GEMM_PDL": "0",
                                                 "JAXFUSE_GROUPED_GEMM_TILE": "adaptive"}})
  assert np.isfinite(runs["plain"]).all() and np.abs(runs["plain"]).max() > 0
  np.testing.assert_array_equal(runs["pdl"], runs["plain"])
  np.testing.assert_array_equal(runs["default"], runs["plain"])
  np.testing.assert_array_equal(runs["pdl_adaptive"], runs["plain_adaptive"])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1000, 520])
def test_small_wgrad_cluster_pairing_matches_float64_numpy(tmp_path, n):
  """The bf16 wgrad's kSmall runs a 1x2-cluster kernel where the column tiles pair up
  (ceil(n / 128) even: n = 1000, with a partial last tile) and the 1x1 kernel otherwise
  (n = 520); JAXFUSE_GROUPED_GEMM_WGRAD_PAIR=0 forces the 1x1 one. Both against float64
  numpy on ragged sizes with an empty group, sum < m and sum > m, and bit for bit against
  each other (same tile, same accumulation order: only the operand loads are shared)."""
  m, k, groups = 2560, 136, 5
  x, kernel = make_inputs(11, m, k, n, groups, jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(12), (m, n), jnp.bfloat16)
  np.savez(tmp_path / "in.npz", **{name: np.asarray(a, np.float32)
                                   for name, a in (("x", x), ("w", kernel), ("d_out", d_out))})
  size_sets = ([700, 0, 333, 600, 517],  # ragged, an empty group, sum < m
               [1024, 1024, 512, 512, 2048])  # sum > m: cut at m
  runs = _tile_script_runs(tmp_path, size_sets, {
      pair: {"JAXFUSE_GROUPED_GEMM_TILE": "small", "JAXFUSE_GROUPED_GEMM_WGRAD_PAIR": pair}
      for pair in ("1", "0")})
  for index, sizes in enumerate(size_sets):
    _, want_kernel = numpy_grouped_grads(x, kernel, sizes, d_out)
    for pair, results in runs.items():
      helpers.assert_close(results[f"{index}_d_kernel"], want_kernel, jnp.bfloat16,
                           msg=f"wgrad pair={pair} n={n} {sizes}")
    np.testing.assert_array_equal(runs["1"][f"{index}_d_kernel"], runs["0"][f"{index}_d_kernel"])


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["large", "adaptive", "uniform"])
def test_prepared_tensormaps_match_float64_numpy_and_cutlass(tmp_path, tile):
  """The bf16 cooperative kernels (kLarge, kUniform; kAdaptive launches both) read
  per-group TMA descriptors that a kernel launched before them writes
  (prepared_tensormaps.cuh) instead of rewriting CUTLASS's per-SM ones at each group
  change; JAXFUSE_GROUPED_GEMM_TENSORMAPS=cutlass brings those back. Forward, dgrad and wgrad of 37
  groups (several empty, the first and the last among them; ragged; sums below and past m)
  against float64 numpy, and bit for bit against CUTLASS's descriptors (same tiles, same
  accumulation order), with the preparing kernel launched as a programmatic dependent (the
  default at this size) and plainly."""
  m, k, n, groups = 3000, 136, 264, 37
  x, kernel = make_inputs(13, m, k, n, groups, jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(14), (m, n), jnp.bfloat16)
  np.savez(tmp_path / "in.npz", **{name: np.asarray(a, np.float32)
                                   for name, a in (("x", x), ("w", kernel), ("d_out", d_out))})
  rng = np.random.default_rng(15)
  ragged = rng.integers(0, 130, groups)
  ragged[[0, 5, 17, groups - 1]] = 0
  size_sets = (list(ragged), [128] * groups)  # sum < m; sum 4736 > m: cut at m
  environments = {"cutlass": {"JAXFUSE_GROUPED_GEMM_TENSORMAPS": "cutlass"},
                  "prepared": {"JAXFUSE_GROUPED_GEMM_TENSORMAPS": "prepared"}}
  if tile == "large":
    environments["prepared_plain"] = {"JAXFUSE_GROUPED_GEMM_TENSORMAPS": "prepared",
                                      "JAXFUSE_GROUPED_GEMM_PDL": "0"}
  runs = _tile_script_runs(tmp_path, size_sets, {
      name: {"JAXFUSE_GROUPED_GEMM_TILE": tile, **variables}
      for name, variables in environments.items()})
  for index, sizes in enumerate(size_sets):
    want_x, want_kernel = numpy_grouped_grads(x, kernel, sizes, d_out)
    prepared = runs["prepared"]
    helpers.assert_close(prepared[f"{index}_out"], numpy_grouped_linear(x, kernel, sizes),
                         jnp.bfloat16, msg=f"{tile} forward {sizes}")
    helpers.assert_close(prepared[f"{index}_d_x"], want_x, jnp.bfloat16, msg=f"{tile} dgrad")
    helpers.assert_close(prepared[f"{index}_d_kernel"], want_kernel, jnp.bfloat16,
                         msg=f"{tile} wgrad")
  for name, results in runs.items():
    for key, value in results.items():
      np.testing.assert_array_equal(value, runs["cutlass"][key], err_msg=f"{name} {key}")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1000, 520])
def test_team_tile_scheduler_matches_float64_numpy_and_cutlass_order(tmp_path, n):
  """The bf16 ping-pong kernels (kSmall) hand out their tiles through the team scheduler
  (team_tile_scheduler.cuh): JAXFUSE_GROUPED_GEMM_TEAMS=T splits the CTAs into T teams,
  each walking its own contiguous share of all groups' tiles; T = 1 is CUTLASS's order.
  Forward, dgrad and wgrad (n = 1000: the wgrad's 1x2-cluster kernel; n = 520: the 1x1
  one) on 37 ragged groups (empty ones first, last and between; sums below and past m)
  against float64 numpy for several team counts (more teams than groups, and more than
  the CTAs, which clamps), and bit for bit against CUTLASS's order: only which CTA computes
  a tile changes, not how."""
  m, k, groups = 3000, 136, 37
  x, kernel = make_inputs(16, m, k, n, groups, jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(17), (m, n), jnp.bfloat16)
  np.savez(tmp_path / "in.npz", **{name: np.asarray(a, np.float32)
                                   for name, a in (("x", x), ("w", kernel), ("d_out", d_out))})
  rng = np.random.default_rng(18)
  ragged = rng.integers(0, 200, groups)
  ragged[[0, 9, 20, groups - 1]] = 0
  size_sets = (list(ragged), [128] * groups)  # sum < m; sum 4736 > m: cut at m
  runs = _tile_script_runs(tmp_path, size_sets, {
      teams: {"JAXFUSE_GROUPED_GEMM_TILE": "small", "JAXFUSE_GROUPED_GEMM_TEAMS": teams}
      for teams in ("1", "3", "7", "64", "1000")})
  for index, sizes in enumerate(size_sets):
    want_x, want_kernel = numpy_grouped_grads(x, kernel, sizes, d_out)
    for teams, results in runs.items():
      helpers.assert_close(results[f"{index}_out"], numpy_grouped_linear(x, kernel, sizes),
                           jnp.bfloat16, msg=f"teams={teams} forward {sizes}")
      helpers.assert_close(results[f"{index}_d_x"], want_x, jnp.bfloat16,
                           msg=f"teams={teams} dgrad")
      helpers.assert_close(results[f"{index}_d_kernel"], want_kernel, jnp.bfloat16,
                           msg=f"teams={teams} wgrad")
  for teams, results in runs.items():
    for key, value in results.items():
      np.testing.assert_array_equal(value, runs["1"][key], err_msg=f"teams={teams} {key}")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["adaptive", "uniform", "large"])
def test_large_tile_configs_match_float64_numpy(tmp_path, tile):
  """The 128-row-tile kernel, the kUniform kernel (fit for multiples of its row granularity,
  correct for any sizes) and kAdaptive, which launches both and lets the setup kernel hand
  the tiles to one of them from the sizes on the device, each forced through
  JAXFUSE_GROUPED_GEMM_TILE (read once per process): forward, dgrad and wgrad against
  float64 numpy, on sizes that fit kUniform and on ragged ones, in one executable."""
  m, k, n, groups = 3072, 192, 520, 5
  x, kernel = make_inputs(9, m, k, n, groups, jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(10), (m, n), jnp.bfloat16)
  np.savez(tmp_path / "in.npz", **{name: np.asarray(a, np.float32)
                                   for name, a in (("x", x), ("w", kernel), ("d_out", d_out))})
  size_sets = ([512, 1024, 0, 512, 512],  # multiples of 512 (and of 256), sum < m
               [700, 0, 333, 1200, 517],  # ragged
               [1024, 1024, 512, 512, 2048])  # multiples, sum > m: cut at m
  results = _tile_script_runs(tmp_path, size_sets,
                             {tile: {"JAXFUSE_GROUPED_GEMM_TILE": tile}})[tile]
  for index, sizes in enumerate(size_sets):
    out, d_x, d_kernel = (results[f"{index}_{name}"] for name in ("out", "d_x", "d_kernel"))
    helpers.assert_close(out, numpy_grouped_linear(x, kernel, sizes), jnp.bfloat16,
                         msg=f"{tile} forward {sizes}")
    want_x, want_kernel = numpy_grouped_grads(x, kernel, sizes, d_out)
    helpers.assert_close(d_x, want_x, jnp.bfloat16, msg=f"{tile} dgrad {sizes}")
    helpers.assert_close(d_kernel, want_kernel, jnp.bfloat16, msg=f"{tile} wgrad {sizes}")
