"""Sharding rules of the ops that need a global amax or global group offsets (8 CPU devices).

Current-scaling quantization (pmax of local amaxes), the fused activation + quantization,
the FP8 linear_scale_add / grouped_linear / grouped_mlp, grouped GEMMs with sharded tokens
(local group offsets) and the MoE permutation. For each: the compiled HLO has no
all-gather, and results (and gradients) equal the unsharded op's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfuse
from jaxfuse.quantization import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from tests import helpers
from tests.sharding.test_rules import _all_gathers, _check, _shardings

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
  actual = jax.jit(fn, in_shardings=_shardings(mesh, specs))(*args)
  for i, (a, e) in enumerate(zip(jax.tree.leaves(actual), jax.tree.leaves(expected))):
    if i in close:
      helpers.assert_close(a, helpers.as_f64(e), jnp.float32, msg=f"result {i}")
      continue
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=f"result {i}")
  assert _all_gathers(fn, args, mesh, specs) == 0


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


def test_quantize_without_pmax_would_differ(mesh):
  # The test above can fail: a per-shard amax gives other scales than the global one.
  rng = np.random.default_rng(21)
  x = helpers.random_array(rng, (64, 32), jnp.float32)
  x = x.at[50, 3].set(100.0)
  local = jax.jit(jax.shard_map(lambda v: _q(jaxfuse.quantize(v, PER_TENSOR, **FFI))[1],
                                mesh=mesh, in_specs=P("data"), out_specs=P("data")))(x)
  global_ = _q(jaxfuse.quantize(x, PER_TENSOR, **FFI))[1]
  assert not np.array_equal(np.asarray(local)[0], np.asarray(global_)[0])


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
