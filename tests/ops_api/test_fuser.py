"""jaxfuse.ops: the fuser picks exactly the windows whose conditions hold, and fused
sequences (CPU FFI handlers) match the unfused jnp sequences in values and gradients."""

import functools
import re

from flax import nnx
import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import ops
from jaxfuse._src import compat
from jaxfuse.quantization import Float8CurrentScaling
from tests import helpers

F32, BF16 = jnp.float32, jnp.bfloat16
S = jax.ShapeDtypeStruct


def plan(op_list, x, fuse=True, implementation="ffi", **extras):
  return ops.Sequential(op_list, fuse=fuse, implementation=implementation).fusion_plan(
      x, **extras)


# --- which fusions apply ---------------------------------------------------------------

LIN_SCALE_ADD = (ops.Linear(32), ops.ConstantScale(0.5), ops.AddExtraInput(in_place=True))
X16, R32 = S((4, 16), F32), S((4, 32), F32)


def test_linear_scale_add_applies():
  assert plan(LIN_SCALE_ADD, X16, residual=R32) == [("LinearScaleAdd", (0, 1, 2))]
  # Column tensor parallelism does not block it, leading batch dims are fine.
  column = (ops.Linear(32, tensor_parallel="column"),) + LIN_SCALE_ADD[1:]
  assert plan(column, S((2, 3, 16), F32), residual=S((2, 3, 32), F32)) == [
      ("LinearScaleAdd", (0, 1, 2))]
  # An fp32 residual with a bf16 x is accepted by linear_scale_add.
  assert plan(LIN_SCALE_ADD, S((4, 16), BF16), residual=R32) == [("LinearScaleAdd", (0, 1, 2))]


@pytest.mark.parametrize("case", ["not_in_place", "row_parallel", "residual_dtype",
                                  "residual_shape"])
def test_linear_scale_add_refused_falls_back_to_linear_scale(case):
  op_list, residual = list(LIN_SCALE_ADD), R32
  if case == "not_in_place":
    op_list[2] = ops.AddExtraInput(in_place=False)
  elif case == "row_parallel":
    op_list[0] = ops.Linear(32, tensor_parallel="row")
  elif case == "residual_dtype":
    residual = S((4, 32), jnp.float16)
  else:
    residual = S((1, 32), F32)  # broadcasts in the unfused add, cannot alias the output
  assert plan(op_list, X16, residual=residual) == [("LinearScale", (0, 1)),
                                                   ("AddExtraInput", (2,))]


def test_windows_need_adjacent_ops_and_room_at_the_end():
  interleaved = (ops.Linear(32), ops.RMSNorm(), ops.ConstantScale(0.5),
                 ops.AddExtraInput(in_place=True))
  assert plan(interleaved, X16, residual=R32) == [
      ("Linear", (0,)), ("RMSNorm", (1,)), ("ConstantScale", (2,)), ("AddExtraInput", (3,))]
  # A window cut by the end of the sequence does not match; a shorter one may.
  assert plan((ops.RMSNorm(), ops.Linear(32)), X16) == [("RMSNorm", (0,)), ("Linear", (1,))]
  assert plan((ops.RMSNorm(), ops.Linear(32), ops.ConstantScale(3.0)), X16) == [
      ("RMSNorm", (0,)), ("LinearScale", (1, 2))]
  assert plan((ops.AddExtraInput(in_place=True),), R32, residual=R32) == [
      ("AddExtraInput", (0,))]
  # Order matters: [ConstantScale, Linear] is not a window.
  assert plan((ops.ConstantScale(2.0), ops.Linear(32)), X16) == [
      ("ConstantScale", (0,)), ("Linear", (1,))]


def test_add_rms_norm_conditions():
  seq = (ops.Linear(32), ops.AddExtraInput(), ops.RMSNorm(), ops.Linear(8))
  assert plan(seq, X16, residual=R32) == [("Linear", (0,)), ("AddRMSNorm", (1, 2)),
                                          ("Linear", (3,))]
  # Residual dtype differs from x's: add_rms_norm needs equal dtypes.
  assert plan(seq, S((4, 16), BF16), residual=R32) == [
      ("Linear", (0,)), ("AddExtraInput", (1,)), ("RMSNorm", (2,)), ("Linear", (3,))]
  # The add already fused into the linear: the norm stays alone.
  lsa_norm = LIN_SCALE_ADD + (ops.RMSNorm(),)
  assert plan(lsa_norm, X16, residual=R32) == [("LinearScaleAdd", (0, 1, 2)), ("RMSNorm", (3,))]


G, H, FFN, M = 4, 16, 24, 40
XG = S((M, H), BF16)
GROUP_EXTRAS = dict(scales=S((M,), F32), group_sizes=S((G,), jnp.int32))
MLP = (ops.GroupedLinear(G, 2 * FFN), ops.ScaledActivation("swiglu"), ops.GroupedLinear(G, H))


def test_grouped_fusions():
  assert plan(MLP, XG, **GROUP_EXTRAS) == [("GroupedMLP", (0, 1, 2))]
  assert plan(MLP[1:], S((M, 2 * FFN), BF16), **GROUP_EXTRAS) == [
      ("ScaledActivationGroupedLinear", (0, 1))]
  # A lone FC1 -> activation pair: the backward fusion (dact fused with FC1's backward).
  assert plan(MLP[:2], XG, **GROUP_EXTRAS) == [("GroupedLinearScaledActivation", (0, 1))]
  # ... unless the activation can fuse forward with a following grouped GEMM.
  log = ops.Sequential(MLP[:2] + (ops.Quantize(Float8CurrentScaling()), MLP[2]),
                       implementation="ffi").explain(XG, **GROUP_EXTRAS)
  assert log[0][1] == "GroupedLinearScaledActivation" and "followed by Quantize" in log[0][2]
  assert log[-1] == (1, "ScaledActivationQuantizeGroupedLinear", None)
  # Different routings: no GroupedMLP, but the activation still fuses with FC2.
  split = (ops.GroupedLinear(G, 2 * FFN, group_sizes="a"), MLP[1],
           ops.GroupedLinear(G, H, group_sizes="b"))
  extras = dict(scales=GROUP_EXTRAS["scales"], a=GROUP_EXTRAS["group_sizes"],
                b=GROUP_EXTRAS["group_sizes"])
  assert plan(split, XG, **extras) == [("GroupedLinear", (0,)),
                                       ("ScaledActivationGroupedLinear", (1, 2))]


def test_grouped_fusions_follow_the_kernels_limits():
  # float32 has no grouped GEMM kernel: refused with "ffi", applied with "xla".
  x32 = S((M, H), F32)
  assert [name for name, _ in plan(MLP, x32, **GROUP_EXTRAS)] == [
      "GroupedLinear", "ScaledActivation", "GroupedLinear"]
  assert plan(MLP, x32, implementation="xla", **GROUP_EXTRAS) == [("GroupedMLP", (0, 1, 2))]
  # Widths must be multiples of 8 for the kernels.
  odd = (ops.GroupedLinear(G, 2 * 12), ops.ScaledActivation(), ops.GroupedLinear(G, H))
  assert [name for name, _ in plan(odd, XG, **GROUP_EXTRAS)] == [
      "GroupedLinear", "ScaledActivation", "GroupedLinear"]


def test_quantize_fusion_conditions():
  act_q_gl = (ops.ScaledActivation(), ops.Quantize(Float8CurrentScaling(per_group=True)),
              ops.GroupedLinear(G, H))
  x = S((M, 2 * FFN), BF16)
  assert plan(act_q_gl, x, **GROUP_EXTRAS) == [
      ("ScaledActivationQuantizeGroupedLinear", (0, 1, 2))]
  per_tensor = (act_q_gl[0], ops.Quantize(Float8CurrentScaling(per_group=False)), act_q_gl[2])
  assert plan(per_tensor, x, **GROUP_EXTRAS) == [
      ("ScaledActivation", (0,)), ("Quantize", (1,)), ("GroupedLinear", (2,))]


def test_fusion_can_be_disabled():
  unfused = [("Linear", (0,)), ("ConstantScale", (1,)), ("AddExtraInput", (2,))]
  assert plan(LIN_SCALE_ADD, X16, fuse=False, residual=R32) == unfused
  with ops.fusion_disabled():
    assert plan(LIN_SCALE_ADD, X16, residual=R32) == unfused
  assert plan(LIN_SCALE_ADD, X16, residual=R32) == [("LinearScaleAdd", (0, 1, 2))]
  assert ops.Sequential(LIN_SCALE_ADD).fusions(X16, residual=R32) == [
      ("LinearScaleAdd", (0, 1, 2))]
  log = ops.Sequential((ops.Linear(32), ops.ConstantScale(0.5), ops.AddExtraInput(),
                        ops.RMSNorm())).explain(X16, residual=R32)
  assert log == [(0, "LinearScaleAdd", "AddExtraInput.in_place is False"),
                 (0, "LinearScale", None),
                 (2, "AddRMSNorm", None)]


def test_user_registered_fusion():
  """A fusion registered by the user: two constant scales folded into one."""
  def apply(op_list, params, x, extras, ctx):
    return ops.ConstantScale(op_list[0].scale * op_list[1].scale).apply({}, x, extras)

  ops.register_fusion(ops.Fusion(
      "ScaleScale", (ops.ConstantScale, ops.ConstantScale),
      lambda op_list, ctx: None if op_list[1].scale != 0 else "zero scale", apply))
  try:
    seq = ops.Sequential((ops.ConstantScale(2.0), ops.ConstantScale(3.0), ops.ConstantScale(0.0)))
    assert seq.fusions(X16) == [("ScaleScale", (0, 1))]
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(seq.apply({}, x), 0.0 * x)
    assert ops.Sequential(seq.ops[1:]).fusions(X16) == []  # condition: zero scale
  finally:
    ops.unregister_fusion("ScaleScale")
  assert ops.Sequential(seq.ops).fusions(X16) == []
  assert "ScaleScale" not in [f.name for f in ops.registered_fusions()]


def test_errors():
  seq = ops.Sequential(LIN_SCALE_ADD)
  with pytest.raises(ValueError, match="missing extra inputs"):
    seq.fusion_plan(X16)
  with pytest.raises(ValueError, match="unexpected extra inputs"):
    seq.fusion_plan(X16, residual=R32, scales=R32)
  with pytest.raises(TypeError, match="basic op"):
    ops.Sequential((jnp.tanh,)).fusion_plan(X16)
  with pytest.raises(ValueError, match="tensor_parallel"):
    ops.Linear(8, tensor_parallel="rows")


# --- numerics: fused (CPU FFI) == unfused (jnp) ------------------------------------------


def _random_tree(rng, tree, dtype):
  return jax.tree.map(lambda a: helpers.random_array(rng, a.shape, dtype), tree)


def _compare(op_list, x, extras, dtype, *, fusions, diff_extras, atol_scale=1.0,
             implementation="ffi"):
  """Forward values, extra outputs and gradients (params, x, float extras) agree."""
  fused = ops.Sequential(op_list, implementation=implementation, return_extra=True)
  reference = fused.clone(fuse=False)
  assert fused.fusions(x, **extras) == fusions
  params = fused.init(jax.random.key(1), x, **extras)
  rng = np.random.default_rng(7)
  out_shape = jax.eval_shape(lambda: reference.apply(params, x, **extras))
  cotangent = _random_tree(rng, out_shape, F32)

  def loss(module, params, x, diff):
    y = module.apply(params, x, **{**extras, **diff})
    return sum(jnp.sum(a.astype(F32) * c) for a, c in
               zip(jax.tree.leaves(y), jax.tree.leaves(cotangent)))

  diff = {name: extras[name] for name in diff_extras}
  got = jax.jit(lambda *a: (fused.apply(a[0], a[1], **extras),
                            jax.grad(functools.partial(loss, fused), argnums=(0, 1, 2))(*a)))(
                                params, x, diff)
  want = jax.jit(lambda *a: (reference.apply(a[0], a[1], **extras),
                             jax.grad(functools.partial(loss, reference),
                                      argnums=(0, 1, 2))(*a)))(params, x, diff)
  got_leaves, tree = jax.tree.flatten(got)
  want_leaves, want_tree = jax.tree.flatten(want)
  assert tree == want_tree
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(got)[0]]
  for path, a, b in zip(paths, got_leaves, want_leaves):
    expected = helpers.as_f64(b)
    scale = atol_scale * max(np.abs(expected).max(initial=0.0), 1e-30)
    helpers.assert_close(a, expected, dtype, scale=scale, msg=path)
  return got


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_transformer_block_matches_unfused(dtype):
  rng = np.random.default_rng(0)
  x = helpers.random_array(rng, (2, 8, 16), dtype)
  residual = helpers.random_array(rng, (2, 8, 32), dtype)
  op_list = (ops.Linear(32), ops.ConstantScale(0.5), ops.AddExtraInput(in_place=True),
             ops.RMSNorm(1e-5), ops.Linear(24), ops.ConstantScale(-1.5))
  _compare(op_list, x, dict(residual=residual), dtype, diff_extras=("residual",),
           fusions=[("LinearScaleAdd", (0, 1, 2)), ("LinearScale", (4, 5))])


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_add_rms_norm_matches_unfused(dtype, zero_centered_gamma):
  rng = np.random.default_rng(1)
  x = helpers.random_array(rng, (6, 24), dtype)
  residual = helpers.random_array(rng, (6, 32), dtype)
  op_list = (ops.Linear(32), ops.AddExtraInput(), ops.RMSNorm(1e-6, zero_centered_gamma),
             ops.Linear(16, tensor_parallel="column"))
  got = _compare(op_list, x, dict(residual=residual), dtype, diff_extras=("residual",),
                 fusions=[("AddRMSNorm", (1, 2))])
  (y, extra), _ = got
  assert set(extra) == {"residual"} and extra["residual"].shape == residual.shape


def _routing(rng, groups, rows):
  # An empty group, and sizes summing to less than rows (the tail rows are padding).
  sizes = rng.multinomial(rows - 5, np.ones(groups) / groups)
  sizes[1] = 0
  return jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("activation,implementation,dtype",
                         [("swiglu", "ffi", BF16), ("srelu", "ffi", BF16),
                          ("clamped_swiglu", "xla", F32)])
def test_grouped_mlp_matches_unfused(activation, implementation, dtype):
  rng = np.random.default_rng(2)
  x = helpers.random_array(rng, (M, H), dtype)
  scales = jnp.asarray(rng.uniform(0.2, 1.0, M), F32)
  width = FFN if activation == "srelu" else 2 * FFN
  op_list = (ops.GroupedLinear(G, width), ops.ScaledActivation(activation),
             ops.GroupedLinear(G, H))
  _compare(op_list, x, dict(scales=scales, group_sizes=_routing(rng, G, M)), dtype,
           diff_extras=("scales",), fusions=[("GroupedMLP", (0, 1, 2))],
           implementation=implementation)


def test_activation_grouped_linear_matches_unfused():
  rng = np.random.default_rng(3)
  x = helpers.random_array(rng, (M, 2 * FFN), BF16)
  scales = helpers.random_array(rng, (M,), BF16)
  op_list = (ops.ScaledActivation("clamped_swiglu"), ops.GroupedLinear(G, H))
  _compare(op_list, x, dict(scales=scales, group_sizes=_routing(rng, G, M)), BF16,
           diff_extras=("scales",), fusions=[("ScaledActivationGroupedLinear", (0, 1))])


@pytest.mark.parametrize("implementation,dtype", [("ffi", BF16), ("xla", F32)])
def test_activation_quantize_grouped_linear_matches_unfused(implementation, dtype):
  rng = np.random.default_rng(4)
  x = helpers.random_array(rng, (M, 2 * FFN), dtype)
  scales = jnp.asarray(rng.uniform(0.2, 1.0, M), F32)
  op_list = (ops.ScaledActivation(), ops.Quantize(Float8CurrentScaling(per_group=True)),
             ops.GroupedLinear(G, H))
  # The fused kernel quantizes the fp32 activation, the unfused op its bf16 rounding: an
  # element may land one E4M3 step away, but summed over FFN terms the difference stays
  # within bf16's budget relative to the largest output.
  _compare(op_list, x, dict(scales=scales, group_sizes=_routing(rng, G, M)), dtype,
           diff_extras=("scales",), atol_scale=1.0, implementation=implementation,
           fusions=[("ScaledActivationQuantizeGroupedLinear", (0, 1, 2))])


# --- the fused forward is the fused custom call ----------------------------------------


def _count(fn, *args, target):
  return helpers.count_primitives(jax.make_jaxpr(fn)(*args), helpers.ffi_target(target))


@pytest.mark.parametrize("fuse", [True, False])
def test_lowers_to_fused_custom_calls(fuse):
  rng = np.random.default_rng(5)
  x = helpers.random_array(rng, (4, 16), F32)
  residual = helpers.random_array(rng, (4, 32), F32)
  seq = ops.Sequential(LIN_SCALE_ADD + (ops.AddExtraInput("r2"), ops.RMSNorm(),
                                        ops.Linear(8), ops.ConstantScale(2.0)),
                       implementation="ffi", fuse=fuse)
  extras = dict(residual=residual, r2=residual)
  params = seq.init(jax.random.key(0), x, **extras)
  apply = lambda p, x: seq.apply(p, x, **extras)
  expected = 1 if fuse else 0
  assert _count(apply, params, x, target="jaxfuse_linear_scale_add") >= expected
  assert _count(apply, params, x, target="jaxfuse_add_rms_norm_fwd") >= expected
  assert _count(apply, params, x, target="jaxfuse_scaled_matmul") >= expected
  if not fuse:
    assert _count(apply, params, x, target="jaxfuse_linear_scale_add") == 0
    assert _count(apply, params, x, target="jaxfuse_add_rms_norm_fwd") == 0
  # The backward GEMMs carry alpha: scaled_matmul custom calls for dgrad and wgrad.
  grad = jax.grad(lambda p, x: jnp.sum(apply(p, x)))
  assert _count(grad, params, x, target="jaxfuse_scaled_matmul") >= (3 if fuse else 0)
  hlo = jax.jit(apply).lower(params, x).as_text()
  assert ("jaxfuse_linear_scale_add" in hlo) == fuse
  assert ("jaxfuse_add_rms_norm_fwd" in hlo) == fuse


@pytest.mark.parametrize("window", ["mlp", "act_linear", "act_quantize_linear"])
def test_grouped_lowers_to_grouped_gemm(window):
  rng = np.random.default_rng(6)
  op_list, width, targets = {
      "mlp": (MLP, H, ("jaxfuse_grouped_gemm", "jaxfuse_scaled_activation_fwd")),
      "act_linear": (MLP[1:], 2 * FFN, ("jaxfuse_grouped_gemm", "jaxfuse_group_offsets",
                                        "jaxfuse_scaled_activation_fwd")),
      "act_quantize_linear": ((MLP[1], ops.Quantize(Float8CurrentScaling(per_group=True)),
                               MLP[2]), 2 * FFN,
                              ("jaxfuse_grouped_gemm", "jaxfuse_scaled_activation_quantize")),
  }[window]
  x = helpers.random_array(rng, (M, width), BF16)
  extras = dict(scales=jnp.ones((M,), F32), group_sizes=_routing(rng, G, M))
  for fuse in (True, False):
    seq = ops.Sequential(op_list, implementation="ffi", fuse=fuse)
    params = seq.init(jax.random.key(0), x, **extras)
    hlo = jax.jit(lambda p, x: seq.apply(p, x, **extras)).lower(params, x).as_text()
    for target in targets:
      assert (target in hlo) == fuse, (target, fuse)


# --- linear_scale on its own, nnx, shard_map ----------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_linear_scale_op(dtype):
  rng = np.random.default_rng(8)
  x = helpers.random_array(rng, (3, 5, 16), dtype)
  kernel = helpers.random_array(rng, (16, 24), dtype)
  dy = helpers.random_array(rng, (3, 5, 24), F32)
  alpha = -0.75
  f = lambda x, k: jnp.sum(ops.linear_scale(x, k, alpha, implementation="ffi") * dy)
  y = ops.linear_scale(x, kernel, alpha, implementation="ffi")
  x64, k64, dy64 = helpers.as_f64(x), helpers.as_f64(kernel), np.asarray(dy, np.float64)
  helpers.assert_close(y, alpha * x64 @ k64, dtype)
  dx, dk = jax.grad(f, argnums=(0, 1))(x, kernel)
  helpers.assert_close(dx, alpha * dy64 @ k64.T, dtype)
  helpers.assert_close(dk, alpha * np.einsum("bsk,bsn->kn", x64, dy64), dtype)


def test_nnx_sequential():
  rng = np.random.default_rng(9)
  x = helpers.random_array(rng, (4, 16), F32)
  residual = helpers.random_array(rng, (4, 32), F32)
  seq = ops.nnx.Sequential(*LIN_SCALE_ADD, ops.RMSNorm(), in_features=16, rngs=nnx.Rngs(0),
                           implementation="ffi", return_extra=True)
  assert seq.fusions(x, residual=residual) == [("LinearScaleAdd", (0, 1, 2))]
  assert seq.op0_kernel[...].shape == (16, 32) and seq.op3_gamma[...].shape == (32,)

  def loss(model, x):
    y, extra = model(x, residual=residual)
    return jnp.sum(y * y) + jnp.sum(extra["residual"])

  (y, extra), grads = seq(x, residual=residual), nnx.grad(loss)(seq, x)
  seq.fuse = False
  (y_ref, extra_ref), grads_ref = seq(x, residual=residual), nnx.grad(loss)(seq, x)
  helpers.assert_close(y, helpers.as_f64(y_ref), F32)
  helpers.assert_close(extra["residual"], helpers.as_f64(extra_ref["residual"]), F32)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    helpers.assert_close(a, helpers.as_f64(b), F32)


def test_row_parallel_linear_in_shard_map():
  """A row-parallel linear all-reduces before the add: the fused LinearScaleAdd would add
  the residual on every device, so the fuser must (and does) refuse it."""
  mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
  rng = np.random.default_rng(10)
  x = helpers.random_array(rng, (4, 16), F32)
  residual = helpers.random_array(rng, (4, 32), F32)
  op_list = (ops.Linear(32, tensor_parallel="row", axis_name="tp"), ops.ConstantScale(0.5),
             ops.AddExtraInput(in_place=True))
  kernel = helpers.random_array(rng, (16, 32), F32)

  log = []

  def local(x, kernel, residual):
    y, _ = ops.fuser.run(op_list, ({"kernel": kernel}, {}, {}), x, {"residual": residual},
                         implementation="ffi", log=log)
    return y

  y = jax.jit(compat.shard_map(local, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None), P()),
                               out_specs=P()))(x, kernel, residual)
  expected = helpers.as_f64(residual) + 0.5 * helpers.as_f64(x) @ helpers.as_f64(kernel)
  helpers.assert_close(y, expected, F32)
  reasons = dict((name, reason) for _, name, reason in log)
  assert "row tensor-parallel" in reasons["LinearScaleAdd"] and reasons["LinearScale"] is None


# --- FP8: scaled activation + per-group quantization feeding the FP8 grouped GEMM ---------

FP8 = Float8CurrentScaling(per_group=True)
FFN8 = 32  # the FP8 kernels need K and N multiples of 16: activation width 32, H = 16
X8 = S((M, 2 * FFN8), BF16)
ACT_Q_GL8 = (ops.ScaledActivation(), ops.Quantize(FP8), ops.GroupedLinear(G, H, recipe=FP8))


def _fusion(name):
  return next(f for f in ops.registered_fusions() if f.name == name)


def _condition(name, op_list, x, implementation="ffi", **extras):
  ctx = ops.fuser.Context(x=x, extras={**GROUP_EXTRAS, **extras},
                          implementation=implementation)
  fusion = _fusion(name)
  assert fusion.matches(op_list)
  return fusion.condition(op_list, ctx)


def test_fp8_fusion_applies_with_a_grouped_linear_recipe():
  assert plan(ACT_Q_GL8, X8, **GROUP_EXTRAS) == [
      ("ScaledActivationQuantizeGroupedLinearFP8", (0, 1, 2))]
  # The log says which path was taken and why the other one was not.
  log = ops.Sequential(ACT_Q_GL8, implementation="ffi").explain(X8, **GROUP_EXTRAS)
  assert log == [
      (0, "ScaledActivationQuantizeGroupedLinear",
       "GroupedLinear has an FP8 recipe: the FP8 path "
       "(ScaledActivationQuantizeGroupedLinearFP8) applies instead"),
      (0, "ScaledActivationQuantizeGroupedLinearFP8", None)]
  # Without a recipe on the GroupedLinear: the dequantizing 16-bit path (its unfused
  # semantics: fake quantization, then a 16-bit GEMM).
  bf16_linear = ACT_Q_GL8[:2] + (ops.GroupedLinear(G, H),)
  assert plan(bf16_linear, X8, **GROUP_EXTRAS) == [
      ("ScaledActivationQuantizeGroupedLinear", (0, 1, 2))]
  assert _condition("ScaledActivationQuantizeGroupedLinearFP8", bf16_linear, X8) == (
      "GroupedLinear.recipe is None (16-bit GEMM): the dequantizing path "
      "(ScaledActivationQuantizeGroupedLinear) applies instead")
  # No Quantize op: the GroupedLinear's recipe alone asks for the same FP8 hand-off.
  pair = (ACT_Q_GL8[0], ACT_Q_GL8[2])
  assert plan(pair, X8, **GROUP_EXTRAS) == [("ScaledActivationGroupedLinearFP8", (0, 1))]
  assert plan((pair[0], ops.GroupedLinear(G, H)), X8, **GROUP_EXTRAS) == [
      ("ScaledActivationGroupedLinear", (0, 1))]
  # float32 x: no FP8 kernel ("ffi"), the jnp FP8 path ("xla") fuses.
  assert plan(ACT_Q_GL8, S((M, 2 * FFN8), F32), implementation="xla", **GROUP_EXTRAS) == [
      ("ScaledActivationQuantizeGroupedLinearFP8", (0, 1, 2))]


@pytest.mark.parametrize("case", ["recipes_differ", "group_sizes_differ", "float32_ffi",
                                  "k_not_16", "n_not_16", "srelu_k_not_16", "scales_shape",
                                  "per_tensor_quantize"])
def test_fp8_fusion_refusals(case):
  act, quant, linear = ACT_Q_GL8
  x, extras, match = X8, {}, None
  if case == "recipes_differ":
    quant = ops.Quantize(Float8CurrentScaling(per_group=True, gradient_format="e4m3"))
    match = "differs from the GroupedLinear recipe"
  elif case == "group_sizes_differ":
    quant = ops.Quantize(FP8, group_sizes="other")
    match = "different group sizes"
  elif case == "float32_ffi":
    x, match = S((M, 2 * FFN8), F32), "bfloat16/float16 x, x is float32"
  elif case == "k_not_16":
    x, match = S((M, 2 * 24), BF16), r"K to be a multiple of 16 .*got 24"
  elif case == "n_not_16":
    linear, match = ops.GroupedLinear(G, 24, recipe=FP8), r"N to be a multiple of 16 .*got 24"
  elif case == "srelu_k_not_16":
    act, x = ops.ScaledActivation("srelu"), S((M, 40), BF16)
    match = r"K to be a multiple of 16 .*got 40"
  elif case == "scales_shape":
    extras, match = dict(scales=S((M + 1,), F32)), "scales shape"
  else:
    quant = ops.Quantize(Float8CurrentScaling(per_group=False))
    match = "differs from the GroupedLinear recipe"
  reason = _condition("ScaledActivationQuantizeGroupedLinearFP8", (act, quant, linear), x,
                      **extras)
  assert reason is not None and re.search(match, reason), reason
  # The unrefused window for comparison: the condition can hold.
  assert _condition("ScaledActivationQuantizeGroupedLinearFP8", ACT_Q_GL8, X8) is None
  # The 16-bit paths never take a GroupedLinear with a recipe (they would drop it).
  assert "FP8 recipe" in _condition("ScaledActivationQuantizeGroupedLinear",
                                    (act, ops.Quantize(FP8), linear), x, **extras)
  assert "FP8 recipe" in _condition("ScaledActivationGroupedLinear", (act, linear), x,
                                    **extras)


def test_fp8_grouped_mlp_needs_equal_recipes():
  mlp8 = (ops.GroupedLinear(G, 2 * FFN8, recipe=FP8), ops.ScaledActivation(),
          ops.GroupedLinear(G, H, recipe=FP8))
  assert plan(mlp8, S((M, H), BF16), **GROUP_EXTRAS) == [("GroupedMLP", (0, 1, 2))]
  mixed = mlp8[:2] + (ops.GroupedLinear(G, H),)
  assert "different recipes" in _condition("GroupedMLP", mixed, S((M, H), BF16))
  # FC1 alone is FP8: no GroupedMLP; the activation still fuses with the 16-bit FC2.
  assert plan(mixed, S((M, H), BF16), **GROUP_EXTRAS) == [
      ("GroupedLinear", (0,)), ("ScaledActivationGroupedLinear", (1, 2))]
  ffn_not_16 = (ops.GroupedLinear(G, 2 * 24, recipe=FP8),) + mlp8[1:]
  assert "multiple of 16" in _condition("GroupedMLP", ffn_not_16, S((M, H), BF16))


def test_grouped_linear_recipe_is_checked():
  with pytest.raises(ValueError, match=r"recipe must be None or Float8CurrentScaling"):
    ops.GroupedLinear(G, H, recipe=Float8CurrentScaling(per_group=False))
  with pytest.raises(ValueError, match=r"forward_format='e4m3'"):
    ops.GroupedLinear(G, H, recipe=Float8CurrentScaling(forward_format="e5m2"))


def test_unfused_fp8_grouped_linear_is_grouped_linear_with_the_recipe():
  rng = np.random.default_rng(11)
  x = helpers.random_array(rng, (M, 32), BF16)
  sizes = _routing(rng, G, M)
  for implementation in ("ffi", "xla"):
    seq = ops.Sequential((ops.GroupedLinear(G, H, recipe=FP8),), implementation=implementation)
    params = seq.init(jax.random.key(0), x, group_sizes=sizes)
    kernel = params["params"]["op0"]["kernel"].astype(BF16)
    want = jaxfuse.grouped_linear(x, kernel, sizes, recipe=FP8, implementation=implementation)
    np.testing.assert_array_equal(np.asarray(seq.apply(params, x, group_sizes=sizes), F32),
                                  np.asarray(want, F32))
    # ... and not the 16-bit GEMM.
    bf16 = jaxfuse.grouped_linear(x, kernel, sizes, implementation="xla")
    assert np.abs(np.asarray(want, F32) - np.asarray(bf16, F32)).max() > 0


# Tolerance of the FP8 comparisons (x 2% bf16 rtol of the largest |value|, see _compare):
# the fused kernel quantizes the fp32 activation, the unfused ops quantize its bf16
# rounding (re-quantizing the fake-quantized tensor in GroupedLinear is idempotent: same
# amax, so the same scale and codes). About 1 element in 2^(9-4) = 32 lies within a bf16
# rounding of an E4M3 rounding midpoint and lands one E4M3 step (<= 2^-3 relative) away;
# over a K = 32 term product that moves an output by up to a few percent of the largest
# output, so 2 x 2%. The dgrad sees the same E5M2 dy and FP8 kernel in both (bit-equal
# dh); wgrad differs by the same flipped activation elements, contracted over one group's
# rows only (M / G terms, fewer than K, so a flip weighs more): measured 4.06% of the
# largest FC2 weight gradient with FP8 wgrads (the same E5M2 dy in both), so 2.5 x 2%.
FP8_ATOL_SCALE = 2.5


@pytest.mark.parametrize("implementation,dtype", [("ffi", BF16), ("xla", BF16), ("xla", F32)])
@pytest.mark.parametrize("window", ["act_quantize_linear", "act_linear"])
def test_fp8_activation_grouped_linear_matches_unfused(window, implementation, dtype):
  rng = np.random.default_rng(12)
  x = helpers.random_array(rng, (M, 2 * FFN8), dtype)
  scales = jnp.asarray(rng.uniform(0.2, 1.0, M), F32)
  if window == "act_quantize_linear":
    op_list, fused = ACT_Q_GL8, [("ScaledActivationQuantizeGroupedLinearFP8", (0, 1, 2))]
  else:
    op_list, fused = (ACT_Q_GL8[0], ACT_Q_GL8[2]), [("ScaledActivationGroupedLinearFP8", (0, 1))]
  # BF16 tolerances for float32 x too: the FP8 GEMM rounds its result to bfloat16.
  _compare(op_list, x, dict(scales=scales, group_sizes=_routing(rng, G, M)), BF16,
           diff_extras=("scales",), atol_scale=FP8_ATOL_SCALE, implementation=implementation,
           fusions=fused)


@pytest.mark.parametrize("implementation", ["ffi", "xla"])
def test_fp8_grouped_mlp_matches_unfused(implementation):
  rng = np.random.default_rng(13)
  x = helpers.random_array(rng, (M, H), BF16)
  scales = jnp.asarray(rng.uniform(0.2, 1.0, M), F32)
  op_list = (ops.GroupedLinear(G, 2 * FFN8, recipe=FP8), ops.ScaledActivation(),
             ops.GroupedLinear(G, H, recipe=FP8))
  # grouped_mlp quantizes the fp32 activation, the unfused FC2 its bf16 rounding: as above.
  # FC1's dgrad quantizes dh (E5M2) in both; its input there differs by FC2-level FP8 noise.
  _compare(op_list, x, dict(scales=scales, group_sizes=_routing(rng, G, M)), BF16,
           diff_extras=("scales",), atol_scale=FP8_ATOL_SCALE, implementation=implementation,
           fusions=[("GroupedMLP", (0, 1, 2))])


def test_fp8_fusion_feeds_the_fp8_activation_to_the_fp8_gemm():
  rng = np.random.default_rng(14)
  x = helpers.random_array(rng, (M, 2 * FFN8), BF16)
  extras = dict(scales=jnp.asarray(rng.uniform(0.2, 1.0, M), F32),
                group_sizes=_routing(rng, G, M))
  count = lambda jaxpr, target: helpers.count_primitives(jaxpr, helpers.ffi_target(target))

  def fp8_to_wide(eqn):  # a dequantization: an FP8 value converted to a wider float
    return (eqn.primitive.name == "convert_element_type"
            and eqn.invars[0].aval.dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2))

  jaxprs = {}
  for fuse in (True, False):
    seq = ops.Sequential(ACT_Q_GL8, implementation="ffi", fuse=fuse)
    params = seq.init(jax.random.key(0), x, **extras)
    forward = jax.make_jaxpr(lambda p, x: seq.apply(p, x, **extras))(params, x)
    grad = jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(
        seq.apply(p, x, **extras).astype(F32)), argnums=(0, 1)))(params, x)
    jaxprs[fuse] = (forward, grad)
  forward, grad = jaxprs[True]
  # platform_dependent lowers a cpu and a cuda branch: each FFI call appears twice.
  assert count(forward, "jaxfuse_scaled_activation_quantize") == 1
  assert count(forward, "jaxfuse_grouped_gemm_fp8") == 2
  assert count(forward, "jaxfuse_grouped_gemm") == 0
  # The activation is neither dequantized nor re-quantized: the one quantize call is the
  # kernel's (per expert, transposed in the same pass).
  assert helpers.count_primitives(forward, fp8_to_wide) == 0
  assert count(forward, "jaxfuse_quantize") == 0
  assert count(forward, "jaxfuse_quantize_batches_transposed") == 1
  # The kernel's untransposed FP8 copy is for dgrad: written only when a backward follows.
  assert helpers.untransposed_copy_sizes(forward) == [0]
  assert helpers.untransposed_copy_sizes(grad) == [G * FFN8 * H]
  # Backward: FP8 dgrad, FP8 wgrad (the saved FP8 activation and the FP8 dy, column-wise),
  # the fused dact kernel; offsets computed once for the whole step.
  assert count(grad, "jaxfuse_grouped_gemm_fp8") == 2 * 2
  assert count(grad, "jaxfuse_grouped_gemm_fp8_wgrad") == 2 * 1
  assert count(grad, "jaxfuse_group_columnwise") == 2
  assert count(grad, "jaxfuse_grouped_gemm") == 0
  assert helpers.count_primitives(grad, fp8_to_wide) == 0  # nothing dequantized
  assert count(grad, "jaxfuse_scaled_activation_bwd") >= 1
  assert count(grad, "jaxfuse_group_offsets") == 1
  # Unfused: no fused activation + quantization; the activation is dequantized (Quantize)
  # and quantized again by GroupedLinear.
  forward, _ = jaxprs[False]
  assert count(forward, "jaxfuse_scaled_activation_quantize") == 0
  assert count(forward, "jaxfuse_grouped_gemm_fp8") == 2
  assert count(forward, "jaxfuse_quantize") == 1
  assert count(forward, "jaxfuse_quantize_batches_transposed") == 1
  assert helpers.count_primitives(forward, fp8_to_wide) >= 1


def test_fp8_fusion_in_shard_map():
  """Tokens and routings per device, kernel replicated: the fused FP8 window's kernel
  gradient is summed over the devices, as autodiff of the unfused ops sums it."""
  mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("data",))
  rng = np.random.default_rng(15)
  x = helpers.random_array(rng, (2 * M, 2 * FFN8), BF16)
  scales = jnp.asarray(rng.uniform(0.2, 1.0, 2 * M), F32)
  sizes = jnp.stack([_routing(rng, G, M) for _ in range(2)])
  kernel = helpers.random_array(rng, (G, FFN8, H), F32)
  dy = helpers.random_array(rng, (2 * M, H), F32)

  def loss(fuse):
    def local(x, scales, sizes, kernel, dy):
      y, _ = ops.fuser.run(ACT_Q_GL8, ({}, {}, {"kernel": kernel}), x,
                           dict(scales=scales, group_sizes=sizes[0]), fuse=fuse,
                           implementation="ffi")
      return jax.lax.psum(jnp.sum(y.astype(F32) * dy), "data")
    sharded = compat.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data"), P("data"),
                                                           P(), P("data")), out_specs=P())
    return lambda x, scales, kernel: sharded(x, scales, sizes, kernel, dy)

  got = jax.jit(jax.value_and_grad(loss(True), argnums=(0, 1, 2)))(x, scales, kernel)
  want = jax.jit(jax.value_and_grad(loss(False), argnums=(0, 1, 2)))(x, scales, kernel)
  for name, a, b in zip(("loss", "dx", "dscales", "dkernel"), jax.tree.leaves(got),
                        jax.tree.leaves(want)):
    expected = helpers.as_f64(b)
    helpers.assert_close(a, expected, BF16, msg=name,
                         scale=FP8_ATOL_SCALE * max(np.abs(expected).max(), 1e-30))


# --- GroupedLinearScaledActivation: the backward fusion of FC1 and the activation ----------


@pytest.mark.parametrize("case", ["followed_by_grouped_linear", "float32_ffi", "fp8_k_not_16",
                                  "scales_shape"])
def test_grouped_linear_activation_refusals(case):
  linear, act = ops.GroupedLinear(G, 2 * FFN8), ops.ScaledActivation()
  x, extras, remaining, match = S((M, H), BF16), {}, (), None
  if case == "followed_by_grouped_linear":
    remaining, match = (ops.GroupedLinear(G, H),), "followed by GroupedLinear"
  elif case == "float32_ffi":
    x, match = S((M, H), F32), "bfloat16/float16"
  elif case == "fp8_k_not_16":
    linear, x = ops.GroupedLinear(G, 2 * FFN8, recipe=FP8), S((M, 24), BF16)
    match = r"K to be a multiple of 16 .*got 24"
  else:
    extras, match = dict(scales=S((M, 1), F32)), "scales shape"
  ctx = ops.fuser.Context(x=x, extras={**GROUP_EXTRAS, **extras}, implementation="ffi",
                          remaining=(linear, act) + remaining)
  reason = _fusion("GroupedLinearScaledActivation").condition((linear, act), ctx)
  assert reason is not None and re.search(match, reason), reason
  ok = ops.fuser.Context(x=S((M, H), BF16), extras=GROUP_EXTRAS, implementation="ffi",
                         remaining=(linear, act, ops.RMSNorm()))
  assert _fusion("GroupedLinearScaledActivation").condition((linear, act), ok) is None


@pytest.mark.parametrize("implementation,recipe", [("ffi", None), ("xla", None), ("ffi", FP8),
                                                   ("xla", FP8)])
def test_grouped_linear_activation_matches_unfused(implementation, recipe):
  rng = np.random.default_rng(16)
  x = helpers.random_array(rng, (M, H), BF16)
  scales = jnp.asarray(rng.uniform(0.2, 1.0, M), F32)
  op_list = (ops.GroupedLinear(G, 2 * FFN8, recipe=recipe), ops.ScaledActivation("swiglu"))
  # 16-bit: the same GEMMs and the dact kernel (bf16 tolerance). FP8: the forward is the
  # same FP8 GEMM; the fused dact quantizes the fp32 dh to E5M2 where the unfused
  # GroupedLinear quantizes its bf16 rounding: ~1 element in 2^(9-3) = 64 moves one E5M2
  # step (<= 2^-2 relative), i.e. dx within ~2 bf16 budgets of its largest value.
  _compare(op_list, x, dict(scales=scales, group_sizes=_routing(rng, G, M)), BF16,
           diff_extras=("scales",), implementation=implementation,
           atol_scale=1.0 if recipe is None else FP8_ATOL_SCALE,
           fusions=[("GroupedLinearScaledActivation", (0, 1))])


def test_grouped_linear_activation_fp8_backward_quantizes_in_the_dact_kernel():
  rng = np.random.default_rng(17)
  x = helpers.random_array(rng, (M, H), BF16)
  extras = dict(scales=jnp.asarray(rng.uniform(0.2, 1.0, M), F32),
                group_sizes=_routing(rng, G, M))
  count = lambda jaxpr, target: helpers.count_primitives(jaxpr, helpers.ffi_target(target))
  for fuse in (True, False):
    seq = ops.Sequential((ops.GroupedLinear(G, 2 * FFN8, recipe=FP8), ops.ScaledActivation()),
                         implementation="ffi", fuse=fuse)
    params = seq.init(jax.random.key(0), x, **extras)
    grad = jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(
        seq.apply(p, x, **extras).astype(F32)), argnums=(0, 1)))(params, x)
    assert count(grad, "jaxfuse_grouped_gemm_fp8") == 2 * 2  # forward + dgrad
    # wgrad in FP8 (recipe.fp8_wgrad): the column-wise copies of the FP8 x and dy.
    assert count(grad, "jaxfuse_grouped_gemm_fp8_wgrad") == 2 * 1
    assert count(grad, "jaxfuse_group_columnwise") == 2
    assert count(grad, "jaxfuse_grouped_gemm") == 0
    # Fused: dh quantized by the dact kernel; x by quantize, the kernel by the transposed
    # quantization (both layouts in one pass). Unfused: dh (the jnp activation's gradient)
    # by a separate quantize.
    assert count(grad, "jaxfuse_scaled_dactivation_quantize") == (1 if fuse else 0)
    assert count(grad, "jaxfuse_quantize") == (1 if fuse else 2)
    assert count(grad, "jaxfuse_quantize_batches_transposed") == 1
    assert count(grad, "jaxfuse_group_offsets") == (1 if fuse else 0)


# --- the same comparisons with the CUDA kernels ----------------------------------------


GPU_COMPARISONS = {
    "transformer_block": lambda: test_transformer_block_matches_unfused(BF16),
    "add_rms_norm": lambda: test_add_rms_norm_matches_unfused(BF16, True),
    "grouped_mlp": lambda: test_grouped_mlp_matches_unfused("swiglu", "ffi", BF16),
    "activation_quantize_grouped_linear": lambda: (
        test_activation_quantize_grouped_linear_matches_unfused("ffi", BF16)),
    "fp8_act_quantize_linear": lambda: test_fp8_activation_grouped_linear_matches_unfused(
        "act_quantize_linear", "ffi", BF16),
    "fp8_act_linear": lambda: test_fp8_activation_grouped_linear_matches_unfused(
        "act_linear", "ffi", BF16),
    "fp8_grouped_mlp": lambda: test_fp8_grouped_mlp_matches_unfused("ffi"),
    "grouped_linear_activation_fp8": lambda: (
        test_grouped_linear_activation_matches_unfused("ffi", FP8)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_COMPARISONS))
def test_fused_matches_unfused_on_the_gpu(name):
  """Fused and unfused sequences agree when both run the CUDA kernels (the CPU tests above
  run the C++ loops): the arrays and parameters are created on the GPU."""
  with jax.default_device(jax.devices("gpu")[0]):
    GPU_COMPARISONS[name]()
