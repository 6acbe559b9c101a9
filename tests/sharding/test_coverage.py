"""Every public op that calls an FFI target does so through a sharding rule.

For each name in ``jaxfuse.__all__``: either it is not an op calling FFI targets (listed in
NOT_FFI_OPS with the reason), or it is traced here (forward and, where differentiable, the
gradient, with each recipe it supports) and every ``ffi_call`` in the jaxpr must sit inside
a ``custom_partitioning`` call, unless its target is listed in UNPARTITIONED with the
reason. A new public op therefore fails this test until it has a rule or a listed reason.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse.quantization import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from tests import helpers

pytestmark = pytest.mark.skipif(not jaxfuse.build_info()["available"],
                                reason="jaxfuse's extension is not built")

FFI = dict(implementation="ffi")

NOT_FFI_OPS = {
    "EXPORT_DISABLED_CHECKS": "a constant",
    "build_info": "build information",
    "quantization": "the recipes module",
    "register_handlers": "registers the FFI handlers",
    "sharding_rules": "the rules' on/off switch",
    "dequantize": "pure jnp (XLA fuses it into its consumer)",
    "moe_router": "pure jnp (a small GEMM, softmax and top-k)",
}

# ffi targets that may appear outside custom_partitioning, with the reason. Empty: every
# FFI call of every public op has a rule.
UNPARTITIONED: dict[str, str] = {}

BF16 = jnp.bfloat16
_RNG = np.random.default_rng(0)


def _a(shape, dtype=jnp.float32):
  return jnp.asarray(_RNG.standard_normal(shape), dtype)


SIZES = jnp.array([10, 0, 30, 20], jnp.int32)
PER_TENSOR = Float8CurrentScaling(per_group=False)
PER_GROUP = Float8CurrentScaling(per_group=True)


def _sum(out):
  return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(out)
             if jnp.issubdtype(leaf.dtype, jnp.floating))


# name -> list of (case id, fn, args, differentiable argnums or None)
CASES = {
    "linear_scale_add": [
        ("bf16", lambda x, k, r: jaxfuse.linear_scale_add(x, k, r, 0.5, **FFI),
         (_a((64, 32), BF16), _a((32, 32), BF16), _a((64, 32), BF16)), (0, 1, 2)),
        ("fp8", lambda x, k, r: jaxfuse.linear_scale_add(x, k, r, 0.5, recipe=PER_TENSOR,
                                                         **FFI),
         (_a((64, 32), BF16), _a((32, 32), BF16), _a((64, 32), BF16)), (0, 1, 2)),
        ("fp8 trainable quantized kernel", lambda x, k, r: jaxfuse.linear_scale_add(
            x, jaxfuse.quantize_kernel(k, PER_TENSOR, trainable=True, **FFI), r, 0.5, **FFI),
         (_a((64, 32), BF16), _a((32, 32), BF16), _a((64, 32), BF16)), (0, 1, 2)),
    ],
    "rms_norm": [("f32", lambda x, g: jaxfuse.rms_norm(x, g, **FFI),
                  (_a((8, 32)), _a((32,))), (0, 1))],
    "add_rms_norm": [("f32", lambda x, r, g: jaxfuse.add_rms_norm(x, r, g, **FFI),
                      (_a((8, 32)), _a((8, 32)), _a((32,))), (0, 1, 2))],
    "scaled_activation": [
        (act, lambda x, s, act=act: jaxfuse.scaled_activation(x, s, act, **FFI),
         (_a((8, 32)), _a((8,))), (0, 1)) for act in ("swiglu", "srelu")],
    "group_offsets": [("sizes", lambda s: jaxfuse.group_offsets(s, **FFI), (SIZES,), None)],
    "grouped_linear": [
        ("bf16", lambda x, k, s: jaxfuse.grouped_linear(x, k, s, **FFI),
         (_a((64, 32), BF16), _a((4, 32, 32), BF16), SIZES), (0, 1)),
        ("fp8", lambda x, k, s: jaxfuse.grouped_linear(x, k, s, recipe=PER_GROUP, **FFI),
         (_a((64, 32), BF16), _a((4, 32, 32), BF16), SIZES), (0, 1)),
        ("fp8 quantized kernel", lambda x, k, s: jaxfuse.grouped_linear(
            x, jaxfuse.quantize_experts(k, PER_GROUP, **FFI), s, **FFI),
         (_a((64, 32), BF16), _a((4, 32, 32), BF16), SIZES), (0,)),
    ],
    "quantize_experts": [
        ("per_expert", lambda k: jaxfuse.quantize_experts(k, PER_GROUP, **FFI).data,
         (_a((4, 32, 48), BF16),), None)],
    "quantize_kernel": [
        ("per_kernel", lambda k: jaxfuse.quantize_kernel(k, PER_TENSOR, trainable=True,
                                                         **FFI).data_untransposed,
         (_a((32, 48), BF16),), None)],
    "grouped_mlp": [
        (name, lambda x, k1, k2, s, sc, recipe=recipe: jaxfuse.grouped_mlp(
            x, k1, k2, s, sc, "swiglu", recipe=recipe, **FFI),
         (_a((64, 32), BF16), _a((4, 32, 64), BF16), _a((4, 32, 32), BF16), SIZES, _a((64,))),
         (0, 1, 2, 4)) for name, recipe in (("bf16", None), ("fp8", PER_GROUP))],
    "moe": [("bf16", lambda x, r, k1, k2: jaxfuse.moe(x, r, k1, k2, top_k=2, **FFI),
             (_a((32, 32), BF16), _a((32, 4), BF16), _a((4, 32, 64), BF16),
              _a((4, 32, 32), BF16)), (0, 1, 2, 3))],
    "moe_permute": [("f32", lambda x, i: jaxfuse.moe_permute(x, i, 4, **FFI)[0],
                     (_a((16, 32)), jnp.asarray(_RNG.integers(0, 4, (16, 2)), jnp.int32)),
                     (0,))],
    "moe_unpermute": [
        (name, lambda y, w, weighted=weighted: jaxfuse.moe_unpermute(
            y, jnp.arange(32, dtype=jnp.int32).reshape(16, 2), w if weighted else None, **FFI),
         (_a((32, 32)), _a((16, 2))), (0, 1)) for name, weighted in (("weights", True),
                                                                   ("unweighted", False))],
    "quantize": [
        (name, lambda x, recipe=recipe, kind=kind: jaxfuse.quantize(
            x, recipe, group_sizes=SIZES if getattr(recipe, "per_group", False) else None,
            kind=kind, **FFI).data, (_a((64, 256), BF16),), None)
        for name, recipe, kind in (("per_tensor", PER_TENSOR, "activation"),
                                   ("per_group", PER_GROUP, "activation"),
                                   ("block_1d", Float8BlockScaling(), "activation"),
                                   ("block_2d", Float8BlockScaling(), "weight"),
                                   ("mxfp8", MXFP8BlockScaling(), "activation"))],
    "scaled_activation_quantize": [
        (name, lambda x, s, recipe=recipe: jaxfuse.scaled_activation_quantize(
            x, s, SIZES, "swiglu", recipe=recipe, **FFI).data,
         (_a((64, 512), BF16), _a((64,))), None)
        for name, recipe in (("per_group", PER_GROUP), ("block_1d", Float8BlockScaling()))],
    "scaled_dactivation_quantize": [
        (name, lambda dy, x, s, recipe=recipe: jaxfuse.scaled_dactivation_quantize(
            dy, x, s, SIZES, "swiglu", recipe=recipe, return_dx=True, **FFI)[0].data,
         (_a((64, 256), BF16), _a((64, 512), BF16), _a((64,))), None)
        for name, recipe in (("per_group", PER_GROUP), ("mxfp8", MXFP8BlockScaling()))],
}


def _unpartitioned_targets(jaxpr, inside=False) -> set[str]:
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  found = set()
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "ffi_call" and not inside:
      found.add(eqn.params["target_name"])
    nested = inside or name == "custom_partitioning"
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
          found |= _unpartitioned_targets(sub, nested)
  return found


def _ffi_targets(jaxpr) -> set[str]:
  return {eqn.params["target_name"] for eqn in helpers.equations(jaxpr)
          if eqn.primitive.name == "ffi_call"}


def test_every_public_name_is_classified():
  missing = [n for n in jaxfuse.__all__ if n not in NOT_FFI_OPS and n not in CASES]
  assert not missing, (f"public names {missing} are neither traced by this test (CASES) nor "
                       "listed in NOT_FFI_OPS with a reason: add a case (and a sharding rule)")
  stale = [n for n in list(CASES) + list(NOT_FFI_OPS) if n not in jaxfuse.__all__]
  assert not stale, f"{stale} are not in jaxfuse.__all__ any more"


def _params():
  return [pytest.param(name, *case, id=f"{name}-{case[0]}")
          for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("name,case_id,fn,args,argnums", _params())
def test_ffi_calls_are_partitioned(name, case_id, fn, args, argnums):
  del name, case_id
  jaxprs = [jax.make_jaxpr(fn)(*args)]
  if argnums is not None:
    jaxprs.append(jax.make_jaxpr(jax.grad(lambda *a: _sum(fn(*a)), argnums=argnums))(*args))
  targets = set().union(*(_ffi_targets(j) for j in jaxprs))
  assert targets, "the case calls no FFI target: move the op to NOT_FFI_OPS"
  bare = set().union(*(_unpartitioned_targets(j) for j in jaxprs)) - set(UNPARTITIONED)
  assert not bare, f"FFI targets called without a sharding rule: {sorted(bare)}"


def test_the_check_can_fail():
  # Without the rules the same traversal finds the bare FFI calls.
  fn, args = CASES["rms_norm"][0][1], CASES["rms_norm"][0][2]
  with jaxfuse.sharding_rules(False):
    jaxpr = jax.make_jaxpr(fn)(*args)
  assert _unpartitioned_targets(jaxpr) == {"jaxfuse_rms_norm_fwd"}


def test_non_ops_call_no_ffi_target():
  jaxpr = jax.make_jaxpr(lambda x, k: jaxfuse.moe_router(x, k, 2))(_a((16, 32)), _a((32, 4)))
  assert not _ffi_targets(jaxpr)
  q = jaxfuse.quantize(_a((64, 256), BF16), PER_TENSOR, **FFI)
  assert not _ffi_targets(jax.make_jaxpr(jaxfuse.dequantize)(q))


# The op fuser's fused windows call the grouped GEMMs themselves: they must go through the
# rules too. (sequential name, op list, input width, fusion expected)
def _fuser_cases():
  from jaxfuse import ops  # pylint: disable=g-import-not-at-top
  groups, hidden, ffn = 4, 16, 32
  return [
      ("grouped_mlp", (ops.GroupedLinear(groups, 2 * ffn), ops.ScaledActivation("swiglu"),
                       ops.GroupedLinear(groups, hidden)), hidden, "GroupedMLP"),
      ("act_quantize_linear_fp8", (ops.ScaledActivation(), ops.Quantize(PER_GROUP),
                                   ops.GroupedLinear(groups, hidden, recipe=PER_GROUP)),
       2 * ffn, "ScaledActivationQuantizeGroupedLinearFP8"),
      ("act_quantize_linear", (ops.ScaledActivation(), ops.Quantize(PER_GROUP),
                               ops.GroupedLinear(groups, hidden)),
       2 * ffn, "ScaledActivationQuantizeGroupedLinear"),
      ("linear_act", (ops.GroupedLinear(groups, 2 * ffn), ops.ScaledActivation("swiglu")),
       hidden, "GroupedLinearScaledActivation"),
      ("linear_act_fp8", (ops.GroupedLinear(groups, 2 * ffn, recipe=PER_GROUP),
                          ops.ScaledActivation("swiglu")),
       hidden, "GroupedLinearScaledActivation"),
  ]


@pytest.mark.parametrize("case", range(5), ids=lambda i: _fuser_cases()[i][0])
def test_fuser_fused_windows_are_partitioned(case):
  from jaxfuse import ops  # pylint: disable=g-import-not-at-top
  _, op_list, width, fusion = _fuser_cases()[case]
  tokens = 60
  x = _a((tokens, width), BF16)
  extras = dict(scales=_a((tokens,)), group_sizes=jnp.array([10, 0, 30, 20], jnp.int32))
  model = ops.Sequential(op_list, implementation="ffi")
  assert [name for name, _ in model.fusions(x, **extras)] == [fusion]
  params = model.init(jax.random.key(0), x, **extras)
  loss = lambda p, x: _sum(model.apply(p, x, **extras))
  jaxprs = [jax.make_jaxpr(loss)(params, x),
            jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x)]
  assert set().union(*(_ffi_targets(j) for j in jaxprs))
  bare = set().union(*(_unpartitioned_targets(j) for j in jaxprs)) - set(UNPARTITIONED)
  assert not bare, f"{fusion}: FFI targets called without a sharding rule: {sorted(bare)}"
