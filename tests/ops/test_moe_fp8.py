"""The FP8 MoE layer with the permutation folded into the quantization
(jaxfuse/_src/ops/moe/fp8_experts.py, quantize/gathered.py; CUDA: GatherLoadProducer).

quantize_gathered must give the very bytes of quantizing the gathered 16-bit rows
(jaxfuse's quantize of x[source_rows], whose kernels are tested against float64 numpy in
test_quantize*.py), copy included; the layer must give the very outputs and gradients of
moe_permute + grouped_mlp + moe_unpermute (JAXFUSE_MOE_GATHERED_FP8=0), and never write the
16-bit sorted rows. Cases: every group-size trap, repeated and out-of-range sources, odd
widths, NaN and Inf tokens, no rows, top-k > 1 with empty experts, frozen and trainable
FP8 kernels, the errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse._src.ops.moe import fp8_experts
from jaxfuse._src.ops.quantize import columnwise as quantize_columnwise
from jaxfuse._src.ops.quantize import ffi as quantize_ffi
from jaxfuse._src.ops.quantize import gathered
from tests import helpers
from tests.ops.test_grouped_linear import BACKENDS, on, sizes_cases
from tests.ops.test_grouped_mlp_fp8 import relative_error
from tests.ops.test_moe import make_layer

RECIPE = jaxfuse.quantization.Float8CurrentScaling(per_group=True)


def as_codes(value):
  return np.asarray(value).view(np.uint8)


def assert_same_bytes(actual, expected, what):
  np.testing.assert_array_equal(as_codes(actual), as_codes(expected), err_msg=what)


def gathered_case(seed, tokens, rows, width, dtype, *, special=False):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((tokens, width)) * rng.uniform(0.1, 30.0, (tokens, 1))
  if special and tokens >= 3:
    x[0, 0], x[1, -1], x[2, 1 % width] = np.nan, np.inf, -np.inf
  source_rows = rng.integers(0, tokens, rows).astype(np.int32) if tokens else np.zeros(
      rows, np.int32)
  return jnp.asarray(x, dtype), jnp.asarray(source_rows)


def quantize_both_ways(x, source_rows, sizes, fmt, copy):
  """(quantize_gathered, quantize of the gathered rows), each with its group amax."""
  offsets = jaxfuse.group_offsets(jnp.asarray(sizes, jnp.int32))
  amax = gathered.group_amax(gathered.token_amax(x), source_rows, offsets)
  got = quantize_ffi.quantize_gathered(x, source_rows, offsets, amax, fmt=fmt, columnwise=copy)
  rows = jnp.take(x, source_rows, axis=0, mode="clip")
  want = quantize_ffi.quantize(rows, offsets, scaling_mode="per_group", block=0, fmt=fmt,
                               columnwise=copy)
  return got, want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(sizes_cases(96)))
@pytest.mark.parametrize("copy", [True, False])
def test_quantize_gathered_is_the_quantize_of_the_gathered_rows(backend, case, copy):
  """Every group-size trap (empty groups, one, many, sums below and past the rows,
  negative sizes), a token repeated across rows, both layouts."""
  rows = 96 if backend == "cpu" else 1000
  sizes = sizes_cases(rows)[case]
  x, source_rows = gathered_case(len(case), 40 if backend == "cpu" else 700, rows, 48,
                                 jnp.bfloat16)
  x, source_rows = on(backend, x, source_rows)
  got, want = jax.jit(quantize_both_ways, static_argnums=(2, 3, 4))(
      x, source_rows, tuple(int(s) for s in sizes), "e4m3", copy)
  for name, actual, expected in zip(("data", "scale_inv", "copy"), got, want):
    assert_same_bytes(actual, expected, name)
  assert np.abs(np.asarray(got[0], np.float32)).max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, width, fmt", [
    (jnp.bfloat16, 40, "e5m2"),   # 5 units of 8
    (jnp.float16, 19, "e4m3"),    # no 16-byte rows: the one-by-one loads
    (jnp.float32, 24, "e5m2"),
])
def test_quantize_gathered_widths_dtypes_and_specials(backend, dtype, width, fmt):
  """NaN and Inf tokens (NaN counts as 0 in the amax, as in quantize), odd widths, every
  input dtype, both formats."""
  sizes = (30, 0, 50, 9)
  x, source_rows = gathered_case(5, 33, 89, width, dtype, special=True)
  x, source_rows = on(backend, x, source_rows)
  got, want = jax.jit(quantize_both_ways, static_argnums=(2, 3, 4))(
      x, source_rows, sizes, fmt, width % 16 == 0)
  for name, actual, expected in zip(("data", "scale_inv", "copy"), got, want):
    assert_same_bytes(actual, expected, name)
  assert np.isfinite(np.asarray(got[1])).all(), "scales stay finite with NaN and Inf tokens"


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_sources_are_clamped_never_read_past_x(backend):
  """Indices below 0 read row 0, past the tokens the last row (as the rows x[clip(i)])."""
  x, _ = gathered_case(6, 10, 0, 32, jnp.bfloat16)
  source_rows = jnp.asarray([0, -7, 9, 10, 2**31 - 1, 3], jnp.int32)
  clamped = jnp.take(x, jnp.clip(source_rows, 0, 9), axis=0)
  x, source_rows, clamped = on(backend, x, source_rows, clamped)
  offsets = jaxfuse.group_offsets(jnp.asarray([4, 2], jnp.int32))
  amax = jnp.asarray([50.0, 60.0], jnp.float32)
  got = quantize_ffi.quantize_gathered(x, source_rows, offsets, amax, fmt="e4m3")
  want = quantize_ffi.quantize_gathered(clamped, jnp.arange(6, dtype=jnp.int32), offsets,
                                        amax, fmt="e4m3")
  for name, actual, expected in zip(("data", "scale_inv"), got, want):
    assert_same_bytes(actual, expected, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_rows_and_given_amaxes(backend):
  """M = 0 gives empty data and the scales of the given amaxes (0 -> scale 1)."""
  x, _ = gathered_case(7, 4, 0, 16, jnp.bfloat16)
  x, source_rows = on(backend, x, jnp.zeros((0,), jnp.int32))
  offsets = jaxfuse.group_offsets(jnp.zeros((3,), jnp.int32))
  amax = jnp.asarray([0.0, 448.0, 2.0], jnp.float32)
  data, scale_inv, copy = quantize_ffi.quantize_gathered(x, source_rows, offsets, amax,
                                                         fmt="e4m3", columnwise=True)
  assert data.shape == (0, 16)
  np.testing.assert_allclose(np.asarray(scale_inv), [1.0, 1.0, 2.0 / 448.0], rtol=1e-7)
  assert copy.shape[0] == 16


def test_group_amax_matches_numpy():
  rng = np.random.default_rng(8)
  per_source = rng.uniform(0, 10, 20).astype(np.float32)
  source_rows = rng.integers(0, 20, 50).astype(np.int32)
  sizes = [7, 0, 30, 5]  # sum 42 < 50: the last 8 rows are in no group
  offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
  got = gathered.group_amax(jnp.asarray(per_source), jnp.asarray(source_rows),
                            jnp.asarray(offsets))
  want = [per_source[source_rows[a:b]].max() if b > a else 0.0
          for a, b in zip(offsets[:-1], offsets[1:])]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want, np.float32))


def test_token_amax_counts_nan_as_zero():
  x = jnp.asarray([[1.0, -3.0, np.nan], [np.nan, np.nan, np.nan], [-np.inf, 2.0, 0.0]],
                  jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(gathered.token_amax(x)), [3.0, 0.0, np.inf])


def test_source_rows_invert_the_routing():
  rng = np.random.default_rng(9)
  ids = np.stack([rng.permutation(6)[:3] for _ in range(11)]).astype(np.int32)
  row_map, _ = jaxfuse._src.ops.moe_permute.api.moe_routing(jnp.asarray(ids), 6)
  source_rows = np.asarray(gathered.source_rows_of(row_map))
  for t in range(11):
    for j in range(3):
      assert source_rows[int(row_map[t, j])] == t


@pytest.mark.parametrize("args, match", [
    (dict(source_rows=jnp.zeros((6,), jnp.uint32)), r"source_rows must be int32"),
    (dict(amax=jnp.zeros((3,), jnp.float32)), r"amax of 2 groups"),
    (dict(amax=jnp.zeros((2,), jnp.bfloat16)), r"amax must be float32"),
    (dict(x=jnp.zeros((0, 32), jnp.bfloat16)), r"x has no rows"),
])
def test_quantize_gathered_errors_name_the_argument(args, match):
  inputs = dict(x=jnp.ones((10, 32), jnp.bfloat16), source_rows=jnp.zeros((6,), jnp.int32),
                amax=jnp.ones((2,), jnp.float32)) | args
  offsets = jnp.asarray([0, 4, 6], jnp.int32)
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(quantize_ffi.quantize_gathered(
        inputs["x"], inputs["source_rows"], offsets, inputs["amax"], fmt="e4m3"))


# --- the layer ---------------------------------------------------------------------------

@pytest.fixture(name="one_device_rules")
def fixture_one_device_rules():
  """The fused path needs the column-wise copies, which the quantize kernels write on one
  device; the CPU tests run on eight host devices, so ask for them everywhere."""
  with quantize_columnwise.fused(True, everywhere=True):
    yield


def gathered_calls(fn, *args) -> int:
  jaxpr = jax.make_jaxpr(fn)(*args)
  return helpers.count_primitives(jaxpr, helpers.ffi_target("jaxfuse_quantize_gathered"))


def layer_grads(x, router, k1, k2, dy, *, topk, fused, make_kernels=None):

  def loss(x, router, k1, k2):
    kernels = make_kernels(k1, k2) if make_kernels else (k1, k2)
    with fp8_experts.use_gathered(fused):
      out, aux = jaxfuse.moe(x, router, *kernels, top_k=topk, recipe=RECIPE,
                             implementation="ffi")
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)) + aux, out

  grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
  # The path asked for is the path traced (forward and backward quantizations).
  assert gathered_calls(grad, x, router, k1, k2) == (2 if fused else 0)
  return jax.jit(grad)(x, router, k1, k2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk, experts", [(2, 4), (3, 8), (1, 1)])
def test_layer_is_bitwise_the_unfused_layer(backend, topk, experts, one_device_rules):
  """Outputs and gradients of x, the router and both kernels: the same bits as
  moe_permute + grouped_mlp + moe_unpermute, with every token routed (top-k > 1)."""
  tokens, hidden, ffn = (40, 32, 48) if backend == "cpu" else (2048, 256, 512)
  x, router, k1, k2 = on(backend, *make_layer(30 + topk, tokens, hidden, ffn, experts))
  dy = on(backend, helpers.random_array(np.random.default_rng(31), x.shape, jnp.bfloat16))[0]
  fused = layer_grads(x, router, k1, k2, dy, topk=topk, fused=True)
  unfused = layer_grads(x, router, k1, k2, dy, topk=topk, fused=False)
  (grads, out), (want_grads, want_out) = fused, unfused
  assert_same_bytes(out, want_out, "out")
  for name, g, w in zip(("dx", "drouter", "dkernel1", "dkernel2"), grads, want_grads):
    assert_same_bytes(g, w, name)
    # One expert's softmax weight is the constant 1: no router gradient there.
    if name != "drouter" or experts > 1:
      assert np.abs(np.asarray(g, np.float32)).max() > 0, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_with_empty_experts_matches_float64_numpy(backend, one_device_rules):
  """Feature 0 of every token is 1 and dominates the logits: every token goes to experts 0
  and 2, so experts 1 and 3 get no rows."""
  from tests.ops.test_moe import np_moe  # pylint: disable=import-outside-toplevel
  tokens, hidden, ffn = (48, 32, 16) if backend == "cpu" else (1024, 256, 256)
  x, router, k1, k2 = make_layer(33, tokens, hidden, ffn, 4)
  x = x.at[:, 0].set(1.0)
  router = router.at[0].set(jnp.asarray([50.0, -50.0, 40.0, -50.0]))
  x, router, k1, k2 = on(backend, x, router, k1, k2)
  _, ids, _ = jaxfuse.moe_router(x, router, 2)
  assert set(np.unique(np.asarray(ids))) == {0, 2}
  layer = lambda *a: jaxfuse.moe(*a, top_k=2, recipe=RECIPE, implementation="ffi")
  assert gathered_calls(layer, x, router, k1, k2) == 1
  out, _ = jax.jit(layer)(x, router, k1, k2)
  want, _ = np_moe(x, router, k1, k2, 2)
  # E4M3 rounds x, the weights and the activation to 3 mantissa bits: the FP8 ops' bound
  # against 16-bit results (test_grouped_mlp_fp8: 10% relative, Frobenius).
  assert relative_error(out, want) < 0.10


@pytest.mark.parametrize("trainable", [True, False])
def test_layer_on_quantized_kernels_is_bitwise_the_unfused_layer(trainable, one_device_rules):
  """Trainable copies (their masters get the gradients) and frozen ones (no kernel
  gradient; the FP8 x needs no column-wise copy then)."""
  x, router, k1, k2 = make_layer(34, 40, 32, 48, 4)
  dy = helpers.random_array(np.random.default_rng(35), x.shape, jnp.bfloat16)
  make = lambda a, b: tuple(jaxfuse.quantize_experts(k, RECIPE, trainable=trainable,
                                                     implementation="ffi") for k in (a, b))
  got = layer_grads(x, router, k1, k2, dy, topk=2, fused=True, make_kernels=make)
  want = layer_grads(x, router, k1, k2, dy, topk=2, fused=False, make_kernels=make)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert_same_bytes(g, w, "leaf")


def test_layer_never_writes_the_sorted_rows(one_device_rules):
  """The fused step: no permute kernel, the two quantizations read the tokens, the
  backward computes no offsets; the unfused step permutes x and dy."""
  x, router, k1, k2 = make_layer(36, 32, 32, 16, 4)
  loss = lambda x, r, k1, k2: jnp.sum(jaxfuse.moe(x, r, k1, k2, top_k=2, recipe=RECIPE,
                                                  implementation="ffi")[0].astype(jnp.float32))
  count = lambda jaxpr, name: helpers.count_primitives(jaxpr, helpers.ffi_target(name))
  fused = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, router, k1, k2)
  assert count(fused, "jaxfuse_moe_permute") == 0
  assert count(fused, "jaxfuse_quantize_gathered") == 2
  assert count(fused, "jaxfuse_quantize") == 0
  assert count(fused, "jaxfuse_group_offsets") == 1
  assert count(fused, "jaxfuse_moe_unpermute") == 2  # out, and the tokens' gradient
  with fp8_experts.use_gathered(False):
    unfused = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, router, k1, k2)
  assert count(unfused, "jaxfuse_moe_permute") == 2
  assert count(unfused, "jaxfuse_quantize_gathered") == 0


def test_shard_map_tokens_sharded_is_bitwise_the_unfused_layer():
  """Inside shard_map with every axis manual (expert weights and router replicated, each
  device its own tokens) the quantize kernels write the column-wise copies, so the
  gathered path runs there: per-device outputs and gradients (the replicated ones summed
  over the devices) are the permuted layer's bits."""
  from jax.sharding import Mesh, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from jaxfuse._src import compat  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("data",))
  x, router, k1, k2 = make_layer(37, 4 * 24, 32, 16, 4)
  dy = helpers.random_array(np.random.default_rng(38), x.shape, jnp.bfloat16)

  def loss(x, router, k1, k2, fused):
    def local(x, router, k1, k2, dy):
      with fp8_experts.use_gathered(fused):
        out, aux = jaxfuse.moe(x, router, k1, k2, top_k=2, recipe=RECIPE,
                               implementation="ffi")
      return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32))[None] + aux
    per_device = compat.shard_map(local, mesh=mesh,
                                  in_specs=(P("data"), P(), P(), P(), P("data")),
                                  out_specs=P("data"))(x, router, k1, k2, dy)
    return jnp.sum(per_device)

  grads = {}
  for fused in (True, False):
    grad = jax.grad(functools.partial(loss, fused=fused), argnums=(0, 1, 2, 3))
    assert gathered_calls(grad, x, router, k1, k2) == (2 if fused else 0)
    grads[fused] = jax.jit(grad)(x, router, k1, k2)
  for name, g, w in zip(("dx", "drouter", "dkernel1", "dkernel2"), grads[True], grads[False]):
    assert_same_bytes(g, w, name)
    assert np.abs(np.asarray(g, np.float32)).max() > 0, name
