"""Sharding rules of the ops that need a global amax or global group offsets (8 CPU devices).

Current-scaling quantization (pmax of local amaxes), the fused activation + quantization,
the FP8 linear_scale_add / grouped_linear / grouped_mlp, grouped GEMMs with sharded tokens
(local group offsets) and the MoE permutation. For each: the compiled HLO has no
all-gather, and results (and gradients) equal the unsharded op's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfuse
from jaxfuse.quantization import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from tests import helpers
from tests.sharding.test_rules import _check, _run_sharded, _shardings, grouped_mlp_inputs

pytestmark = pytest.mark.skipif(not jaxfuse.build_info()["available"],
                                reason="jaxfuse's extension is not built")

FFI = dict(implementation="ffi")
PER_TENSOR = Float8CurrentScaling(per_group=False)
PER_GROUP = Float8CurrentScaling(per_group=True)


@pytest.fixture(scope="module")
def mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _assert_bitwise(fn, args, mesh, specs, close=()):
  """Sharded == unsharded bit for bit (results `close`: within float32 rounding), and no
  all-gather in the compiled program."""
  expected = fn(*args)
  actual = _run_sharded(fn, args, mesh, specs, gathers_allowed=False)
  for i, (a, e) in enumerate(zip(jax.tree.leaves(actual), jax.tree.leaves(expected))):
    if i in close:
      helpers.assert_close(a, helpers.as_f64(e), jnp.float32, msg=f"result {i}")
      continue
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=f"result {i}")


def _q(q):
  return q.data.astype(jnp.float32), q.scale_inv.astype(jnp.float32)


# --- quantize, current scaling --------------------------------------------------------------

X_SPECS = {"rows": P("data"), "rows_2d": P("data", "model"), "features": P(None, None, "model"),
           "rows_and_features": P("data", None, "model"), "rows_2axes": P(None, ("data", "model"))}


@pytest.mark.parametrize("sharding", list(X_SPECS))
@pytest.mark.parametrize("recipe", [PER_TENSOR, PER_GROUP], ids=["per_tensor", "per_group"])
def test_quantize_current_scaling(mesh, recipe, sharding):
  rng = np.random.default_rng(20)
  x = helpers.random_array(rng, (4, 16, 64), jnp.bfloat16, scale=3.0)
  x = x.at[3, 9, 7].set(-60.0)  # the amax lives on one shard
  sizes = jnp.array([20, 0, 27, 9], jnp.int32)  # an empty group, sums to less than 64 rows

  def fn(x, s):
    return _q(jaxfuse.quantize(x, recipe, group_sizes=s if recipe.per_group else None, **FFI))

  _assert_bitwise(fn, (x, sizes), mesh, (X_SPECS[sharding], P()))


@pytest.mark.parametrize("special", ["nan", "inf"])
def test_quantize_current_scaling_nan_inf(mesh, special):
  # NaN is stored as NaN and ignored by the amax; inf makes its group's scale 1.
  rng = np.random.default_rng(32)
  x = helpers.random_array(rng, (64, 32), jnp.float32, scale=3.0)
  x = x.at[40, 2].set(float(special)).at[5, 1].set(float(special))
  sizes = jnp.array([20, 30, 10], jnp.int32)
  fn = lambda x, s: _q(jaxfuse.quantize(x, PER_GROUP, group_sizes=s, **FFI))
  _assert_bitwise(fn, (x, sizes), mesh, (P(("data", "model")), P()))


def test_quantize_without_pmax_would_differ(mesh):
  # The test above can fail: a per-shard amax gives other scales than the global one.
  rng = np.random.default_rng(21)
  x = helpers.random_array(rng, (64, 32), jnp.float32)
  x = x.at[50, 3].set(100.0)
  local = jax.jit(jax.shard_map(lambda v: _q(jaxfuse.quantize(v, PER_TENSOR, **FFI))[1],
                                mesh=mesh, in_specs=P("data"), out_specs=P("data")))(x)
  global_ = _q(jaxfuse.quantize(x, PER_TENSOR, **FFI))[1]
  assert not np.array_equal(np.asarray(local)[0], np.asarray(global_)[0])


# --- batch_amax (per-tensor current scaling of quantize_batches_transposed) -----------------

BATCH_AMAX_SPECS = {"batches": P("data"), "rows": P(None, "model"),
                    "rows_and_cols": P(None, "data", "model"), "all": P("data", None, "model")}


@pytest.mark.parametrize("sharding", list(BATCH_AMAX_SPECS))
def test_batch_amax(mesh, sharding):
  from jaxfuse._src.ops.quantize import sharding as quantize_sharding  # pylint: disable=g-import-not-at-top
  x = helpers.random_array(np.random.default_rng(31), (4, 16, 32), jnp.bfloat16)
  x = x.at[1, 13, 29].set(-50.0)  # batch 1's amax lives on one shard: a missing pmax fails
  _assert_bitwise(quantize_sharding.batch_amax, (x,), mesh, (BATCH_AMAX_SPECS[sharding],))
  assert float(quantize_sharding.batch_amax(x)[1]) == 50.0


@pytest.mark.parametrize("sharding", list(BATCH_AMAX_SPECS))
def test_quantize_batches_transposed(mesh, sharding):
  """B sharded: each device's batches alone; R or C sharded: amax by pmax, then the
  given-amax kernel on each block (all bit for bit the unsharded op's)."""
  from jaxfuse._src.ops.quantize import sharding as quantize_sharding  # pylint: disable=g-import-not-at-top
  x = helpers.random_array(np.random.default_rng(37), (4, 16, 32), jnp.bfloat16)
  x = x.at[1, 13, 29].set(-50.0)  # batch 1's amax on one shard: a missing pmax changes scales
  quantize = functools.partial(quantize_sharding.quantize_batches_transposed, fmt="e4m3",
                               untransposed=True)
  _assert_bitwise(quantize, (x,), mesh, (BATCH_AMAX_SPECS[sharding],))
  np.testing.assert_allclose(float(quantize(x)[1][1]), 50.0 / 448.0, rtol=1e-6)


# --- scaled_activation_quantize / scaled_dactivation_quantize --------------------------------

ACT_RECIPES = {"per_tensor": PER_TENSOR, "per_group": PER_GROUP,
               "block_1d": Float8BlockScaling(), "mxfp8": MXFP8BlockScaling()}
ACT_CASES = [  # (activation, x spec, scales spec)
    ("swiglu", P("data"), P("data")),
    ("clamped_swiglu", P("data", "model"), P("data", "model")),
    ("srelu", P(None, ("data", "model")), P(None, ("data", "model"))),
]
SRELU_FEATURES = [  # srelu under current scaling: features may be sharded too
    ("srelu", P(None, None, "model"), P()),
    ("srelu", P("data", None, "model"), P("data")),
]


def _act_cases(recipe_name):
  return ACT_CASES + (SRELU_FEATURES if recipe_name in ("per_tensor", "per_group") else [])


def _act_params():
  return [pytest.param(r, *case, id=f"{r}-{case[0]}-{i}")
          for r in ACT_RECIPES for i, case in enumerate(_act_cases(r))]


def _act_inputs(rng, activation):
  width = 256 if activation == "srelu" else 512  # F = 256: two 128 blocks
  x = helpers.random_array(rng, (4, 16, width), jnp.bfloat16, scale=2.0)
  scales = helpers.random_array(rng, (4, 16), jnp.float32)
  sizes = jnp.array([13, 0, 30, 11], jnp.int32)  # empty group, sums to less than 64
  return x, scales, sizes


@pytest.mark.parametrize("recipe_name,activation,x_spec,s_spec", _act_params())
def test_scaled_activation_quantize(mesh, recipe_name, activation, x_spec, s_spec):
  rng = np.random.default_rng(22)
  x, scales, sizes = _act_inputs(rng, activation)
  x = x.at[3, 14, 1].set(9.0)
  recipe = ACT_RECIPES[recipe_name]

  def fn(x, s, sizes):
    return _q(jaxfuse.scaled_activation_quantize(x, s, sizes, activation, recipe=recipe, **FFI))

  _assert_bitwise(fn, (x, scales, sizes), mesh, (x_spec, s_spec, P()))


@pytest.mark.parametrize("return_dx", [True, False])
@pytest.mark.parametrize("recipe_name,activation,x_spec,s_spec", _act_params())
def test_scaled_dactivation_quantize(mesh, recipe_name, activation, x_spec, s_spec, return_dx):
  rng = np.random.default_rng(23)
  x, scales, sizes = _act_inputs(rng, activation)
  dy = helpers.random_array(rng, (4, 16, 256), jnp.bfloat16)
  dy = dy.at[2, 3, 5].set(30.0)
  recipe = ACT_RECIPES[recipe_name]
  dy_spec = x_spec

  def fn(dy, x, s, sizes):
    q, dx, ds = jaxfuse.scaled_dactivation_quantize(dy, x, s, sizes, activation, recipe=recipe,
                                                    return_dx=return_dx, **FFI)
    return (*_q(q), ds) + ((dx,) if return_dx else ())

  # srelu with sharded features: dscales sums per-device partials (another fp32 order).
  close = (2,) if len(x_spec) > 2 else ()
  _assert_bitwise(fn, (dy, x, scales, sizes), mesh, (dy_spec, x_spec, s_spec, P()), close)


# --- grouped_linear / grouped_mlp with sharded tokens ---------------------------------------

GL_SPECS = {  # (x, kernel, group_sizes)
    "tokens": (P("data"), P(), P()),
    "tokens_2axes": (P(("data", "model")), P(), P()),
    "features": (P(), P(None, None, "model"), P()),
    "tokens_and_features": (P("data"), P(None, None, "model"), P()),
}
GL_SIZES = {
    "short_with_empty": [10, 0, 31, 20],  # sums to 61 < 64; group 0 and 2 cross shards
    "one_group": [64, 0, 0, 0],
    "all_in_last_shard": [0, 0, 0, 5],  # every other shard runs on empty groups
    "negative_and_past_end": [40, -3, 30, 9],  # counts as 40, 0, 30 (cut at 64), 9 (none)
}


@pytest.mark.parametrize("sharding", list(GL_SPECS))
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_grouped_linear(mesh, sharding, fp8):
  rng = np.random.default_rng(24)
  x = helpers.random_array(rng, (64, 32), jnp.bfloat16)
  kernel = helpers.random_array(rng, (4, 32, 64), jnp.bfloat16, scale=1 / np.sqrt(32))
  recipe = PER_GROUP if fp8 else None
  fn = lambda x, k, s: jaxfuse.grouped_linear(x, k, s, recipe=recipe, **FFI)
  # Every size pattern through one fn: group sizes are data, so jax reuses the compiled
  # programs (CI time) and only the values change.
  for name, sizes in GL_SIZES.items():
    try:
      _check(fn, (x, kernel, jnp.array(sizes, jnp.int32)), mesh, GL_SPECS[sharding],
             jnp.bfloat16, grad_argnums=(0, 1))
    except AssertionError as error:
      raise AssertionError(f"group sizes {name} {sizes}: {error}") from error


def test_grouped_linear_token_sharded_matches_reference(mesh):
  # Local offsets are right, not merely self-consistent: against ragged_dot in float64.
  rng = np.random.default_rng(25)
  x = helpers.random_array(rng, (64, 32), jnp.bfloat16)
  kernel = helpers.random_array(rng, (3, 32, 16), jnp.bfloat16, scale=1 / np.sqrt(32))
  sizes = jnp.array([7, 30, 19], jnp.int32)
  fn = jax.jit(lambda x, k, s: jaxfuse.grouped_linear(x, k, s, **FFI),
               in_shardings=_shardings(mesh, (P(("data", "model")), P(), P())))
  x64, k64 = helpers.as_f64(x), helpers.as_f64(kernel)
  expected = np.zeros((64, 16))
  starts = np.concatenate([[0], np.cumsum(sizes)])
  for g in range(3):
    expected[starts[g]:starts[g + 1]] = x64[starts[g]:starts[g + 1]] @ k64[g]
  helpers.assert_close(fn(x, kernel, sizes), expected, jnp.bfloat16)


@pytest.mark.parametrize("sharding", ["tokens", "tokens_and_features"])
@pytest.mark.parametrize("activation", ["swiglu", "srelu"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_grouped_mlp_tokens_sharded(mesh, activation, sharding, fp8):
  x, kernel1, kernel2, sizes, scales = grouped_mlp_inputs(
      np.random.default_rng(26), 64, 32, 32, activation, [20, 0, 33, 9])
  recipe = PER_GROUP if fp8 else None
  fn = lambda x, k1, k2, s, sc: jaxfuse.grouped_mlp(x, k1, k2, s, sc, activation,
                                                    recipe=recipe, **FFI)
  features = sharding == "tokens_and_features"
  k2_spec = P(None, None, "model") if features else P()
  # With H sharded, FC2's dgrad sums bf16-rounded partials; under FP8 that gradient is
  # quantized again (E5M2, 2 mantissa bits), so a last-bit difference can move an element
  # by one FP8 step: a budget of a few percent for FP8 gradients then.
  grad_rtol = 0.1 if (fp8 and features) else None
  _check(fn, (x, kernel1, kernel2, sizes, scales), mesh,
         (P("data"), P(), k2_spec, P(), P("data")), jnp.bfloat16, grad_argnums=(0, 1, 2, 4),
         grad_rtol=grad_rtol)


@pytest.mark.parametrize("sharding", ["tokens", "tokens_2axes"])
def test_grouped_linear_and_mlp_on_quantized_kernels(mesh, sharding):
  # Expert weights quantized once (quantize_experts), replicated, with sharded tokens: the
  # same result and dx (dscales) as unsharded; the kernels are constants (unless trainable).
  x_spec = GL_SPECS[sharding][0]
  rng = np.random.default_rng(27)
  x = helpers.random_array(rng, (64, 32), jnp.bfloat16)
  kernel = helpers.random_array(rng, (4, 32, 64), jnp.bfloat16, scale=1 / np.sqrt(32))
  sizes = jnp.array(GL_SIZES["short_with_empty"], jnp.int32)
  q = jaxfuse.quantize_experts(kernel, PER_GROUP, **FFI)
  _check(lambda x, q, s: jaxfuse.grouped_linear(x, q, s, **FFI), (x, q, sizes), mesh,
         (x_spec, P(), P()), jnp.bfloat16, grad_argnums=(0,))
  # A trainable copy made inside the differentiated function: the kernel's gradient (the
  # wgrad summed over the token axes) reaches it through the copy's master as unsharded.
  trainable = lambda x, k, s: jaxfuse.grouped_linear(  # noqa: E731
      x, jaxfuse.quantize_experts(k, PER_GROUP, trainable=True, **FFI), s, **FFI)
  _check(trainable, (x, kernel, sizes), mesh, (x_spec, P(), P()), jnp.bfloat16,
         grad_argnums=(0, 1))
  x, kernel1, kernel2, sizes, scales = grouped_mlp_inputs(
      np.random.default_rng(28), 64, 32, 32, "swiglu", [20, 0, 33, 9])
  q1, q2 = (jaxfuse.quantize_experts(k, PER_GROUP, **FFI) for k in (kernel1, kernel2))
  _check(lambda x, q1, q2, s, sc: jaxfuse.grouped_mlp(x, q1, q2, s, sc, **FFI),
         (x, q1, q2, sizes, scales), mesh, (x_spec, P(), P(), P(), x_spec), jnp.bfloat16,
         grad_argnums=(0, 4))


# --- FP8 linear_scale_add --------------------------------------------------------------------

LSA_FP8_SPECS = {  # (x, kernel, residual)
    "tokens": (P("data"), P(), P("data")),
    "tokens_2d": (P("data", "model"), P(), P("data", "model")),
    "features": (P(), P(None, "model"), P(None, None, "model")),
    "tokens_and_features": (P("data"), P(None, "model"), P("data", None, "model")),
    # K contracted across devices: float32 partials, psum, the residual added once.
    "contraction": (P(None, None, "model"), P("model"), P()),
    "tokens_and_contraction": (P("data", None, "model"), P("model"), P("data")),
}


@pytest.mark.parametrize("sharding", list(LSA_FP8_SPECS))
def test_linear_scale_add_fp8(mesh, sharding):
  rng = np.random.default_rng(27)
  # The FP8 path views x as [rows, K]: with both leading dimensions sharded, that view is
  # a block sharding only when the first one has one row per device (else XLA reshards
  # the reshape itself, not an op), hence 2 x 32 tokens on the 2 x 4 mesh.
  x = helpers.random_array(rng, (2, 32, 32), jnp.bfloat16)
  x = x.at[1, 30, 2].set(12.0)  # the amax lives on one shard
  kernel = helpers.random_array(rng, (32, 64), jnp.bfloat16, scale=1 / np.sqrt(32))
  residual = helpers.random_array(rng, (2, 32, 64), jnp.bfloat16)
  fn = lambda x, k, r: jaxfuse.linear_scale_add(x, k, r, 0.75, recipe=PER_TENSOR, **FFI)
  _check(fn, (x, kernel, residual), mesh, LSA_FP8_SPECS[sharding], jnp.bfloat16,
         grad_argnums=(0, 1, 2))


@pytest.mark.parametrize("sharding", ["tokens", "tokens_2d"])
def test_linear_scale_add_fp8_on_quantized_kernels(mesh, sharding):
  # A dense kernel quantized once (quantize_kernel), replicated, with sharded tokens: the
  # same result, dx and dresidual as unsharded; a trainable copy made inside the
  # differentiated function gets the kernel's gradient (summed over the token axes).
  rng = np.random.default_rng(29)
  x = helpers.random_array(rng, (2, 32, 32), jnp.bfloat16)
  x = x.at[0, 3, 7].set(-9.0)  # the amax lives on one shard
  kernel = helpers.random_array(rng, (32, 64), jnp.bfloat16, scale=1 / np.sqrt(32))
  residual = helpers.random_array(rng, (2, 32, 64), jnp.bfloat16)
  x_spec, _, residual_spec = LSA_FP8_SPECS[sharding]
  frozen = jaxfuse.quantize_kernel(kernel, PER_TENSOR, **FFI)
  _check(lambda x, q, r: jaxfuse.linear_scale_add(x, q, r, 0.75, **FFI), (x, frozen, residual),
         mesh, (x_spec, P(), residual_spec), jnp.bfloat16, grad_argnums=(0, 2))
  trainable = lambda x, k, r: jaxfuse.linear_scale_add(  # noqa: E731
      x, jaxfuse.quantize_kernel(k, PER_TENSOR, trainable=True, **FFI), r, 0.75, **FFI)
  _check(trainable, (x, kernel, residual), mesh, (x_spec, P(), residual_spec), jnp.bfloat16,
         grad_argnums=(0, 1, 2))


# --- moe_permute / moe_unpermute --------------------------------------------------------------

HIDDEN = 48  # distinct from every other dimension: all-gathers of activations end in 48


def _activation_gathers(fn, args, mesh, specs) -> list[str]:
  """all-gathers in the compiled program whose result has the hidden size last."""
  compiled = jax.jit(fn, in_shardings=_shardings(mesh, specs)).lower(*args).compile()
  lines = [l for l in compiled.as_text().splitlines() if "all-gather(" in l]
  return [l for l in lines if f",{HIDDEN}]" in l.split("all-gather(")[0]]


def _moe_inputs(rng, tokens=32, topk=2, experts=5):
  x = helpers.random_array(rng, (tokens, HIDDEN), jnp.float32)
  logits = rng.standard_normal((tokens, experts))
  indices = jnp.asarray(np.argsort(-logits, axis=1)[:, :topk], jnp.int32)
  weights = helpers.random_array(rng, (tokens, topk), jnp.float32)
  return x, indices, weights


MOE_SPECS = {"tokens": P("data"), "tokens_2axes": P(("data", "model")),
             "hidden": P(None, "model"), "tokens_and_hidden": P("data", "model")}


@pytest.mark.parametrize("sharding", list(MOE_SPECS))
def test_moe_permute(mesh, sharding):
  rng = np.random.default_rng(28)
  x, indices, _ = _moe_inputs(rng)
  spec = MOE_SPECS[sharding]
  token_spec = P(spec[0]) if len(spec) else P()

  def fn(x, idx):
    x_sorted, row_map, sizes = jaxfuse.moe_permute(x, idx, 5, **FFI)
    return x_sorted, row_map, sizes

  expected = fn(x, indices)
  actual = jax.jit(fn, in_shardings=_shardings(mesh, (spec, token_spec)))(x, indices)
  for a, e in zip(actual, expected):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  assert not _activation_gathers(fn, (x, indices), mesh, (spec, token_spec))
  # The gradient (an unpermute of the sorted cotangent) too.
  loss = lambda x, idx: jnp.sum(jnp.sin(fn(x, idx)[0]) * jnp.arange(HIDDEN))
  grad = jax.grad(loss)
  helpers.assert_close(jax.jit(grad, in_shardings=_shardings(mesh, (spec, token_spec)))(
      x, indices), helpers.as_f64(grad(x, indices)), jnp.float32)
  assert not _activation_gathers(grad, (x, indices), mesh, (spec, token_spec))


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("sharding", list(MOE_SPECS))
def test_moe_unpermute(mesh, sharding, weighted):
  rng = np.random.default_rng(29)
  x, indices, weights = _moe_inputs(rng)
  _, row_map, _ = jaxfuse.moe_permute(x, indices, 5, **FFI)
  y_sorted = helpers.random_array(rng, (64, HIDDEN), jnp.bfloat16)
  spec = MOE_SPECS[sharding]  # y_sorted's rows; row_map and weights replicated

  def fn(y, w):
    return jaxfuse.moe_unpermute(y, row_map, w if weighted else None, **FFI)

  specs = (spec, P())
  # row_map and the weights (the full index set, [T, k]) are replicated: only gathers of
  # activations ([..., H]) are ruled out.
  _check(fn, (y_sorted, weights), mesh, specs, jnp.bfloat16, gathers_allowed=True,
         grad_argnums=(0, 1) if weighted else (0,))
  assert not _activation_gathers(fn, (y_sorted, weights), mesh, specs)
  grad = jax.grad(lambda y, w: jnp.sum(jnp.sin(fn(y, w).astype(jnp.float32))),
                  argnums=(0, 1))
  assert not _activation_gathers(grad, (y_sorted, weights), mesh, specs)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_moe_layer_tokens_sharded(mesh, fp8):
  # The whole layer under token sharding: router (jnp), permute (tokens -> row blocks),
  # grouped MLP on row blocks (local offsets), unpermute (row blocks -> tokens).
  rng = np.random.default_rng(30)
  tokens, experts, ffn = 64, 4, 32
  x = helpers.random_array(rng, (tokens, HIDDEN), jnp.bfloat16)
  router = helpers.random_array(rng, (HIDDEN, experts), jnp.float32)
  kernel1 = helpers.random_array(rng, (experts, HIDDEN, 2 * ffn), jnp.bfloat16,
                                 scale=1 / np.sqrt(HIDDEN))
  kernel2 = helpers.random_array(rng, (experts, ffn, HIDDEN), jnp.bfloat16,
                                 scale=1 / np.sqrt(ffn))
  recipe = PER_GROUP if fp8 else None
  fn = lambda x, r, k1, k2: jaxfuse.moe(x, r, k1, k2, top_k=2, recipe=recipe, **FFI)[0]
  specs = (P("data"), P(), P(), P())
  _check(fn, (x, router, kernel1, kernel2), mesh, specs, jnp.bfloat16, gathers_allowed=True,
         grad_argnums=(0, 2, 3), grad_rtol=0.1 if fp8 else None)
  args = (x, router, kernel1, kernel2)
  assert not _activation_gathers(fn, args, mesh, specs)
  grad = jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a).astype(jnp.float32))), argnums=(0, 2, 3))
  assert not _activation_gathers(grad, args, mesh, specs)


# --- uneven blocks ----------------------------------------------------------------------------


def test_uneven_row_blocks(mesh):
  # 62 rows over 4 devices: XLA pads the last block; padding rows must count in no group,
  # no amax and no weight gradient (sizes sum past the rows too).
  rng = np.random.default_rng(31)
  x = helpers.random_array(rng, (64, 32), jnp.bfloat16)
  x = x.at[62:].set(1000.0)  # sliced away: must not reach any amax
  kernel = helpers.random_array(rng, (3, 32, 16), jnp.bfloat16, scale=1 / np.sqrt(32))
  sizes = jnp.array([20, 30, 40], jnp.int32)

  def fn(x, k, s, constrain=False):
    y = x[:62] * 1
    if constrain:
      y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P("model")))
    q = jaxfuse.quantize(y, PER_GROUP, group_sizes=s, **FFI)
    out = jaxfuse.grouped_linear(y, k, s, **FFI)
    return q.data.astype(jnp.float32), q.scale_inv, out

  def loss(x, k, s, constrain=False):
    return jnp.sum(fn(x, k, s, constrain)[2].astype(jnp.float32) ** 2)

  shardings = _shardings(mesh, (P("model"), P(), P()))
  expected = fn(x, kernel, sizes)
  actual = jax.jit(lambda *a: fn(*a, constrain=True), in_shardings=shardings)(x, kernel, sizes)
  for a, e in zip(actual[:2], expected[:2]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  helpers.assert_close(actual[2], helpers.as_f64(expected[2]), jnp.bfloat16)
  grad = jax.grad(loss, argnums=(0, 1))
  actual = jax.jit(lambda *a: jax.grad(loss, argnums=(0, 1))(*a, constrain=True),
                   in_shardings=shardings)(x, kernel, sizes)
  for a, e in zip(actual, grad(x, kernel, sizes)):
    helpers.assert_close(a, helpers.as_f64(e), jnp.bfloat16)
