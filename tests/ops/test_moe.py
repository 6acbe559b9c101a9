"""MoE pieces: permutation (routing, kernels, round trip, gradients), router (top-k, aux
loss), the whole layer vs float64 numpy, gradients through the router, what runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse._src.ops.moe import router_logits as router_logits_lib
from jaxfuse._src.ops.moe_permute import reference as permute_reference
from tests import helpers

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]
IMPLS = ["ffi", "xla"]


def on(device_kind, *arrays):
  device = jax.devices(device_kind)[0]
  return [jax.device_put(a, device) for a in arrays]


def random_routing(rng, tokens, topk, experts):
  """Distinct experts per token, like top-k."""
  return np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)]).astype(np.int32)


# --- permutation -------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("tokens, hidden, topk, experts",
                         [(37, 24, 2, 5), (16, 13, 3, 3), (8, 16, 1, 1), (20, 8, 4, 64)])
def test_permute_is_exact_and_expert_contiguous(backend, impl, dtype, tokens, hidden, topk,
                                                experts):
  rng = np.random.default_rng(tokens)
  x = helpers.random_array(rng, (tokens, hidden), dtype)
  ids = random_routing(rng, tokens, topk, experts)
  x, ids_dev = on(backend, x, jnp.asarray(ids))
  x_sorted, row_map, sizes = jax.jit(
      lambda x, i: jaxfuse.moe_permute(x, i, experts, implementation=impl))(x, ids_dev)
  np.testing.assert_array_equal(np.asarray(sizes), np.bincount(ids.ravel(), minlength=experts))
  row_map = np.asarray(row_map)
  assert sorted(row_map.ravel()) == list(range(tokens * topk)), "row_map is a permutation"
  # Expert-contiguous, experts in order, tokens in order within an expert (stable).
  sorted_expert = np.empty(tokens * topk, np.int64)
  sorted_token = np.empty(tokens * topk, np.int64)
  sorted_expert[row_map.ravel()] = ids.ravel()
  sorted_token[row_map.ravel()] = np.repeat(np.arange(tokens), topk)
  assert (np.diff(sorted_expert) >= 0).all()
  for e in range(experts):
    assert (np.diff(sorted_token[sorted_expert == e]) > 0).all()
  # Bit-exact row copies.
  np.testing.assert_array_equal(np.asarray(x_sorted, np.float32),
                                np.asarray(x, np.float32)[sorted_token])
  # Round trip: unpermute with one-hot weights returns x exactly; unit weights give k * x.
  one_hot = jnp.zeros((tokens, topk), jnp.float32).at[:, topk - 1].set(1.0)
  back = jaxfuse.moe_unpermute(x_sorted, jnp.asarray(row_map), one_hot, implementation=impl)
  np.testing.assert_array_equal(np.asarray(back, np.float32), np.asarray(x, np.float32))
  summed = jaxfuse.moe_unpermute(x_sorted, jnp.asarray(row_map), implementation=impl)
  helpers.assert_close(summed, topk * helpers.as_f64(x), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("weighted", [True, False])
def test_unpermute_and_gradients_match_float64_numpy(backend, impl, weighted):
  tokens, hidden, topk, experts = (29, 24, 3, 6) if backend == "cpu" else (3001, 1032, 3, 6)
  rng = np.random.default_rng(11)
  ids = random_routing(rng, tokens, topk, experts)
  y = helpers.random_array(rng, (tokens * topk, hidden), jnp.bfloat16)
  w = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, topk)), jnp.float32)
  d_out = helpers.random_array(rng, (tokens, hidden), jnp.bfloat16)
  row_map, _ = jaxfuse._src.ops.moe_permute.api.moe_routing(jnp.asarray(ids), experts)
  y, w, d_out, row_map = on(backend, y, w, d_out, row_map)
  weights = w if weighted else None
  out, vjp = jax.vjp(lambda y, w: jaxfuse.moe_unpermute(
      y, row_map, w if weighted else None, implementation=impl), y, w)
  d_y, d_w = jax.jit(vjp)(d_out)
  rows = helpers.as_f64(y)[np.asarray(row_map)]                       # [T, k, H]
  w64 = helpers.as_f64(w) if weighted else np.ones((tokens, topk))
  helpers.assert_close(out, np.einsum("tkh,tk->th", rows, w64), jnp.bfloat16)
  want_dy = np.zeros((tokens * topk, hidden))
  want_dy[np.asarray(row_map)] = w64[..., None] * helpers.as_f64(d_out)[:, None, :]
  helpers.assert_close(d_y, want_dy, jnp.bfloat16, msg="d_y_sorted")
  if weighted:
    helpers.assert_close(d_w, np.einsum("tkh,th->tk", rows, helpers.as_f64(d_out)),
                         jnp.float32 if backend == "gpu" else jnp.bfloat16, msg="d_weights")
  del weights
  # permute's gradient: each token sums its k rows' cotangents.
  x = helpers.random_array(rng, (tokens, hidden), jnp.bfloat16)
  d_sorted = helpers.random_array(rng, (tokens * topk, hidden), jnp.bfloat16)
  x, d_sorted, ids_dev = on(backend, x, d_sorted, jnp.asarray(ids))
  _, vjp = jax.vjp(lambda x: jaxfuse.moe_permute(x, ids_dev, experts,
                                                  implementation=impl)[0], x)
  (d_x,) = jax.jit(vjp)(d_sorted)
  helpers.assert_close(d_x, helpers.as_f64(d_sorted)[np.asarray(row_map)].sum(1), jnp.bfloat16)


_PERMUTE_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
import jaxfuse
rng = np.random.default_rng(5)
outputs = []
# Token counts that leave a partial block iteration for 2, 4 and 8 tokens per iteration;
# hidden 13 takes the scalar path, 1032 the 16-byte one.
for tokens, hidden, topk, experts in ((37, 1032, 3, 6), (1027, 13, 2, 5), (9, 264, 6, 64)):
  x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
  ids = np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)]).astype(np.int32)
  x_sorted, row_map, _ = jaxfuse.moe_permute(x, jnp.asarray(ids), experts,
                                             implementation="ffi")
  want = np.repeat(np.asarray(x, np.float32), topk, axis=0)[
      np.argsort(np.asarray(row_map).ravel())]
  outputs.append(np.abs(np.asarray(x_sorted, np.float32) - want).max())
np.save(sys.argv[1], np.asarray(outputs))
"""


@pytest.mark.gpu
def test_permute_kernel_variants_copy_rows_exactly(tmp_path):
  """Every PermuteKernel variant (JAXFUSE_MOE_PERMUTE_TOKENS tokens per block iteration,
  JAXFUSE_MOE_PERMUTE_STREAMING stores; read once per process) copies each token's rows
  bit for bit, including the last, partial block iteration and the scalar path."""
  environments = {f"tokens{tokens}_streaming{streaming}": {
      "JAXFUSE_MOE_PERMUTE_TOKENS": str(tokens), "JAXFUSE_MOE_PERMUTE_STREAMING": streaming}
      for tokens in (1, 2, 4, 8) for streaming in ("0", "1")}
  for name, errors in helpers.outputs_under_environments(
      _PERMUTE_SCRIPT, tmp_path, environments).items():
    np.testing.assert_array_equal(errors, 0.0, err_msg=name)


def test_out_of_range_expert_ids_are_in_no_group():
  ids = jnp.asarray([[0, 7], [-1, 1], [1, 0]], jnp.int32)
  x = helpers.random_array(np.random.default_rng(0), (3, 8), jnp.bfloat16)
  x_sorted, row_map, sizes = jaxfuse.moe_permute(x, ids, 2, implementation="ffi")
  np.testing.assert_array_equal(np.asarray(sizes), [2, 2])
  # The two invalid copies sort last, after both experts' rows.
  assert set(np.asarray(row_map)[[0, 1], [1, 0]]) == {4, 5}


# --- router -----------------------------------------------------------------------------

def np_router(x, kernel, topk, score_function, normalize):
  logits = helpers.as_f64(x) @ helpers.as_f64(kernel)
  if score_function == "softmax":
    scores = np.exp(logits - logits.max(1, keepdims=True))
    scores /= scores.sum(1, keepdims=True)
    balance = scores
  else:
    scores = 1 / (1 + np.exp(-logits))
    balance = scores / scores.sum(1, keepdims=True)
  ids = np.argsort(-scores, axis=1, kind="stable")[:, :topk]
  weights = np.take_along_axis(scores, ids, 1)
  if normalize:
    weights /= weights.sum(1, keepdims=True)
  tokens, experts = logits.shape
  fraction = np.bincount(ids.ravel(), minlength=experts) / (tokens * topk)
  aux = experts * np.sum(fraction * balance.mean(0))
  return weights, ids, aux


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("score_function, normalize", [("softmax", None), ("softmax", True),
                                                       ("sigmoid", None)])
def test_router_matches_float64_numpy(score_function, normalize, impl):
  rng = np.random.default_rng(12)
  x = helpers.random_array(rng, (50, 16), jnp.float32)
  kernel = helpers.random_array(rng, (16, 8), jnp.float32)
  weights, ids, aux = jaxfuse.moe_router(x, kernel, 3, score_function=score_function,
                                         normalize_topk=normalize, implementation=impl)
  normalize = score_function == "sigmoid" if normalize is None else normalize
  want_w, want_ids, want_aux = np_router(x, kernel, 3, score_function, normalize)
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  helpers.assert_close(weights, want_w, jnp.float32)
  np.testing.assert_allclose(float(aux), want_aux, rtol=1e-5)
  if normalize:
    np.testing.assert_allclose(np.asarray(weights).sum(1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_split_bf16_router_logits_and_gradients_are_float32_accurate(backend, dtype):
  # The "ffi" router's logits come from bfloat16 GEMMs on exact bfloat16 parts of the
  # operands: float32 accuracy is the claim, so the float32 tolerance (1e-5 of the largest
  # value) applies to the logits and to both gradients, on operands of several magnitudes.
  rng = np.random.default_rng(31)
  tokens, hidden, experts = (70, 96, 12) if backend == "cpu" else (1000, 2048, 64)
  x = helpers.random_array(rng, (tokens, hidden), dtype, scale=3.0)
  kernel = jnp.asarray(rng.standard_normal((hidden, experts)) *
                       np.exp(rng.uniform(-6, 2, (hidden, experts))), jnp.float32)
  d_logits = jnp.asarray(rng.standard_normal((tokens, experts)) * 1e-3, jnp.float32)
  x, kernel, d_logits = on(backend, x, kernel, d_logits)
  logits, vjp = jax.vjp(router_logits_lib.router_logits, x, kernel)
  d_x, d_kernel = jax.jit(vjp)(d_logits)
  x64, kernel64, d64 = (helpers.as_f64(v) for v in (x, kernel, d_logits))
  assert logits.dtype == jnp.float32 and d_kernel.dtype == jnp.float32
  assert d_x.dtype == dtype
  helpers.assert_close(logits, x64 @ kernel64, jnp.float32, msg="logits")
  helpers.assert_close(d_kernel, x64.T @ d64, jnp.float32, msg="d_kernel")
  # d_x is rounded once to x's dtype, as the HIGHEST dot's gradient is.
  helpers.assert_close(d_x, d64 @ kernel64.T, dtype, msg="d_x")
  want_d_x = np.asarray(jnp.asarray(d64 @ kernel64.T, jnp.float32).astype(dtype), np.float64)
  helpers.assert_close(d_x, want_d_x, jnp.float32 if dtype == jnp.float32 else dtype,
                       msg="d_x against its rounded float64 value")


def test_split_parts_reconstruct_float32_exactly():
  rng = np.random.default_rng(32)
  values = (rng.standard_normal(4096) * np.exp(rng.uniform(-60, 60, 4096))).astype(np.float32)
  parts = router_logits_lib.split_parts(jnp.asarray(values), 3)
  assert all(part.dtype == jnp.bfloat16 for part in parts)
  total = sum(np.asarray(part, np.float64) for part in parts)
  np.testing.assert_array_equal(total, values.astype(np.float64))
  # A float16 value needs two parts, a bfloat16 value one.
  halves = jnp.asarray(rng.standard_normal(512) * 100, jnp.float16)
  two = router_logits_lib.split_parts(halves, router_logits_lib.part_count(jnp.float16))
  np.testing.assert_array_equal(sum(np.asarray(p, np.float64) for p in two),
                                np.asarray(halves, np.float64))
  assert router_logits_lib.part_count(jnp.bfloat16) == 1


def test_split_parts_never_round_trip_through_bfloat16():
  # Under XLA's default excess precision the GPU compiler folds convert(convert(v, bf16),
  # f32) back to v: a split that rounds through bfloat16 and subtracts gets zero remainders
  # there (session 34), while the CPU keeps the rounding. The parts must come from bit
  # masks, so no bfloat16 -> float32 convert may appear in the split.
  jaxpr = jax.make_jaxpr(lambda v: router_logits_lib.split_parts(v, 3))(
      jnp.ones((8,), jnp.float32))
  widening = [e for e in helpers.equations(jaxpr) if e.primitive.name == "convert_element_type"
              and e.invars[0].aval.dtype == jnp.bfloat16 and e.outvars[0].aval.dtype == jnp.float32]
  assert not widening, widening


@pytest.mark.parametrize("backend", BACKENDS)
def test_both_routers_pick_the_same_experts(backend, monkeypatch):
  # Near-ties are where a less accurate GEMM would flip the choice: logits of unit scale
  # from a wide hidden dimension, many tokens, k of 6 among 64 experts.
  rng = np.random.default_rng(33)
  tokens, hidden, experts = (256, 512, 64) if backend == "cpu" else (8192, 2048, 64)
  x = helpers.random_array(rng, (tokens, hidden), jnp.bfloat16)
  kernel = helpers.random_array(rng, (hidden, experts), jnp.float32, scale=hidden**-0.5)
  x, kernel = on(backend, x, kernel)
  monkeypatch.setenv(router_logits_lib.KNOB, "split_bf16")  # read when "ffi" is traced
  route = jax.jit(lambda x, k, impl: jaxfuse.moe_router(
      x, k, 6, score_function="sigmoid", implementation=impl), static_argnums=2)
  fast, spec = route(x, kernel, "ffi"), route(x, kernel, "xla")
  np.testing.assert_array_equal(np.asarray(fast[1]), np.asarray(spec[1]))
  helpers.assert_close(fast[0], spec[0], jnp.float32)
  np.testing.assert_allclose(float(fast[2]), float(spec[2]), rtol=1e-6)


def float32_dots(jaxpr) -> list:
  """The dot_general equations of a jaxpr (sub-jaxprs included) on float32 operands."""
  return [e for e in helpers.equations(jaxpr)
          if e.primitive.name == "dot_general" and e.invars[0].aval.dtype == jnp.float32]


def test_the_fast_router_runs_bfloat16_gemms_only(monkeypatch):
  # What runs: no float32 dot is left in the split router, forward or backward.
  monkeypatch.setenv(router_logits_lib.KNOB, "split_bf16")
  x = jnp.ones((64, 32), jnp.bfloat16)
  kernel = jnp.ones((32, 8), jnp.float32)

  def loss(x, kernel, impl):
    weights, _, aux = jaxfuse.moe_router(x, kernel, 2, implementation=impl)
    return jnp.sum(weights) + aux

  for impl, want_f32_dots in (("ffi", 0), ("xla", 3)):
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, k: loss(x, k, impl), argnums=(0, 1)))(x, kernel)
    dots = [e for e in helpers.equations(jaxpr) if e.primitive.name == "dot_general"]
    assert len(float32_dots(jaxpr)) == want_f32_dots, (impl, [str(e) for e in dots])
    if impl == "ffi":
      assert dots and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in dots)


@pytest.mark.parametrize("ids", [
    [[0, 3], [3, 3], [1, 0]],
    [[-1, 5], [2, 4], [4, 4]],  # out-of-range ids count for no expert
])
def test_expert_counts_match_bincount(ids):
  ids = np.asarray(ids, np.int32)
  counts = permute_reference.expert_counts(jnp.asarray(ids), 5)
  valid = ids[(ids >= 0) & (ids < 5)]
  np.testing.assert_array_equal(np.asarray(counts), np.bincount(valid, minlength=5))
  assert counts.dtype == jnp.int32


def test_aux_loss_is_one_when_balanced_and_differentiable():
  x = jnp.zeros((16, 4), jnp.float32)  # equal scores: softmax gives 1/E everywhere
  kernel = jnp.ones((4, 4), jnp.float32)
  _, _, aux = jaxfuse.moe_router(x, kernel, 2)
  np.testing.assert_allclose(float(aux), 1.0, rtol=1e-6)
  rng = np.random.default_rng(13)
  x = helpers.random_array(rng, (16, 4), jnp.float32)
  grad = jax.grad(lambda k: jaxfuse.moe_router(x, k, 2)[2])(kernel)
  assert np.abs(np.asarray(grad)).max() > 0


# --- the layer --------------------------------------------------------------------------

def np_moe(x, router, k1, k2, topk, score_function="softmax"):
  weights, ids, aux = np_router(x, router, topk, score_function, score_function == "sigmoid")
  x64, k1_64, k2_64 = (helpers.as_f64(v) for v in (x, k1, k2))
  f = k2_64.shape[1]
  out = np.zeros_like(x64)
  for t in range(x64.shape[0]):
    for j in range(topk):
      e = ids[t, j]
      h = x64[t] @ k1_64[e]
      a, b = h[:f], h[f:]
      out[t] += weights[t, j] * ((a / (1 + np.exp(-a)) * b) @ k2_64[e])
  return out, aux


def make_layer(seed, tokens, hidden, ffn, experts, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  x = helpers.random_array(rng, (tokens, hidden), dtype)
  # Logits of unit scale, as a trained router's: with a unit-variance kernel the logits
  # would grow like sqrt(hidden), and at hidden=256 (the GPU shapes) sigmoid rounds many
  # of them to exactly 1.0 in float32, where top-k breaks the ties by index while the
  # float64 reference still tells them apart (the sigmoid top-3 GPU cases failed so).
  router = helpers.random_array(rng, (hidden, experts), jnp.float32, scale=1 / np.sqrt(hidden))
  k1 = helpers.random_array(rng, (experts, hidden, 2 * ffn), dtype, scale=1 / np.sqrt(hidden))
  k2 = helpers.random_array(rng, (experts, ffn, hidden), dtype, scale=1 / np.sqrt(ffn))
  return x, router, k1, k2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("topk, experts, score_function",
                         [(2, 4, "softmax"), (3, 8, "sigmoid"), (1, 1, "softmax")])
def test_layer_matches_float64_numpy(backend, impl, topk, experts, score_function):
  tokens, hidden, ffn = (40, 16, 24) if backend == "cpu" else (2048, 256, 512)
  x, router, k1, k2 = on(backend, *make_layer(20, tokens, hidden, ffn, experts))
  out, aux = jax.jit(lambda *a: jaxfuse.moe(*a, top_k=topk, score_function=score_function,
                                            implementation=impl))(x, router, k1, k2)
  want, want_aux = np_moe(x, router, k1, k2, topk, score_function)
  helpers.assert_close(out, want, jnp.bfloat16)
  np.testing.assert_allclose(float(aux), want_aux, rtol=1e-4)


def test_every_token_is_processed():
  """Drop-less: one expert takes every token (a capacity would drop most of them)."""
  tokens, hidden, ffn, experts = 64, 16, 8, 4
  x, router, k1, k2 = make_layer(21, tokens, hidden, ffn, experts)
  router = router.at[:, 0].set(0.0).at[:, 0].add(100.0 * jnp.sign(jnp.sum(x, 0)).astype(
      jnp.float32))  # a strongly preferred expert 0
  out, _ = jaxfuse.moe(x, router, k1, k2, top_k=2, implementation="ffi")
  want, _ = np_moe(x, router, k1, k2, 2)
  helpers.assert_close(out, want, jnp.bfloat16)
  assert (np.abs(np.asarray(out, np.float32)).sum(axis=1) > 0).all(), "no token dropped"


def test_gradients_through_router_and_experts():
  x, router, k1, k2 = make_layer(22, 48, 16, 16, 4)

  def loss(impl, cast):
    def f(x, router, k1, k2):
      args = [a.astype(jnp.float32) if cast else a for a in (x, k1, k2)]
      out, aux = jaxfuse.moe(args[0], router, args[1], args[2], top_k=2, implementation=impl)
      return jnp.sum(jnp.sin(out.astype(jnp.float32))) + 0.1 * aux
    return f

  got = jax.jit(jax.grad(loss("ffi", False), argnums=(0, 1, 2, 3)))(x, router, k1, k2)
  want = jax.grad(loss("xla", True), argnums=(0, 1, 2, 3))(x, router, k1, k2)
  for name, g, w in zip(("dx", "drouter", "dkernel1", "dkernel2"), got, want):
    helpers.assert_close(g, helpers.as_f64(w), jnp.bfloat16, msg=name)
  assert np.abs(np.asarray(got[1])).max() > 0, "the router gets a gradient"
  # The router's gradient through the combine weights (not only through the aux loss).
  only_aux = jax.grad(lambda r: jaxfuse.moe(x, r, k1, k2, top_k=2, implementation="ffi")[1])
  assert not np.allclose(np.asarray(only_aux(router)) * 0.1, np.asarray(got[1]))


def test_layer_runs_the_fused_kernels_and_one_offsets_computation():
  x, router, k1, k2 = make_layer(23, 32, 16, 8, 4)
  loss = lambda x, r, k1, k2: jnp.sum(
      jaxfuse.moe(x, r, k1, k2, top_k=2, implementation="ffi")[0].astype(jnp.float32))
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, router, k1, k2)
  count = lambda predicate: helpers.count_primitives(jaxpr, predicate)
  name_is = lambda *names: lambda e: e.primitive.name in names
  assert count(helpers.ffi_target("jaxfuse_group_offsets")) == 1
  assert count(name_is("cumsum")) == 0
  assert count(helpers.ffi_target("jaxfuse_grouped_gemm")) == 12
  assert count(name_is("ragged_dot_general", "ragged_dot")) == 0
  # permute forward + unpermute backward (unit weights) are the row-copy kernel; unpermute
  # forward + permute backward the gather-sum kernel.
  assert count(helpers.ffi_target("jaxfuse_moe_permute")) == 2
  assert count(helpers.ffi_target("jaxfuse_moe_unpermute")) == 2
  # Only the router is a dense GEMM: forward, and its two backward products.
  assert count(name_is("dot_general")) == 3


def test_layer_in_shard_map_with_tokens_sharded():
  """Data parallel inside shard_map: each of 4 devices routes its own tokens through
  replicated router and expert weights. Outputs and token gradients are each device's own
  layer's; the replicated weights' gradients the sum of the devices' (the split-bfloat16
  router's custom_vjp once returned them per device, which shard_map refused)."""
  from jax.sharding import Mesh, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from jaxfuse._src import compat  # pylint: disable=g-import-not-at-top
  devices, local = 4, 24
  mesh = Mesh(np.array(jax.devices("cpu")[:devices]), ("data",))
  x, router, k1, k2 = make_layer(25, devices * local, 16, 8, 4)
  dy = helpers.random_array(np.random.default_rng(26), x.shape, jnp.bfloat16)

  def local_loss(x, router, k1, k2, dy):
    out, aux = jaxfuse.moe(x, router, k1, k2, top_k=2, implementation="ffi")
    return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)) + aux

  sharded = lambda *a: jnp.sum(compat.shard_map(
      lambda *b: local_loss(*b)[None], mesh=mesh, in_specs=(P("data"), P(), P(), P(),
                                                             P("data")),
      out_specs=P("data"))(*a))
  got = jax.jit(jax.grad(sharded, argnums=(0, 1, 2, 3)))(x, router, k1, k2, dy)
  per_device = [jax.grad(local_loss, argnums=(0, 1, 2, 3))(
      x[d * local:(d + 1) * local], router, k1, k2, dy[d * local:(d + 1) * local])
                for d in range(devices)]
  want_dx = np.concatenate([helpers.as_f64(g[0]) for g in per_device])
  helpers.assert_close(got[0], want_dx, jnp.bfloat16, msg="dx")
  for i, name in ((1, "drouter"), (2, "dkernel1"), (3, "dkernel2")):
    want = sum(helpers.as_f64(g[i]) for g in per_device)
    helpers.assert_close(got[i], want, jnp.bfloat16, msg=name)


@pytest.mark.parametrize("args, error, match", [
    (dict(top_k=5), ValueError, r"top_k must be an int in \[1, 4\]"),
    (dict(score_function="relu"), ValueError, r"score_function must be one of"),
])
def test_errors_name_the_argument(args, error, match):
  x, router, k1, k2 = make_layer(24, 8, 16, 8, 4)
  kwargs = dict(top_k=2) | args
  with pytest.raises(error, match=match):
    jaxfuse.moe(x, router, k1, k2, implementation="ffi", **kwargs)


def test_router_logits_knob(monkeypatch):
  # The fused path runs the split GEMMs by default; JAXFUSE_MOE_ROUTER_LOGITS=highest
  # keeps the specification's dot; anything else is refused by name.
  x = jnp.ones((8, 16), jnp.bfloat16)
  kernel = jnp.ones((16, 4), jnp.float32)
  route = lambda: jax.make_jaxpr(lambda x, k: jaxfuse.moe_router(
      x, k, 2, implementation="ffi"))(x, kernel)
  f32_dots = lambda jaxpr: len(float32_dots(jaxpr))
  monkeypatch.delenv(router_logits_lib.KNOB, raising=False)
  assert f32_dots(route()) == 0
  monkeypatch.setenv(router_logits_lib.KNOB, "split_bf16")
  assert f32_dots(route()) == 0
  monkeypatch.setenv(router_logits_lib.KNOB, "highest")
  assert f32_dots(route()) == 1
  monkeypatch.setenv(router_logits_lib.KNOB, "tf32")
  with pytest.raises(ValueError, match="JAXFUSE_MOE_ROUTER_LOGITS must be"):
    route()
