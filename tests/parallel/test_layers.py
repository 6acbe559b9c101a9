"""jaxfuse.parallel: each layer equals the unsharded reference for tp in {1, 2, 4, 8},
forward and gradients; the compiled HLO has exactly the expected collectives and never
gathers a weight; bad sequence lengths are rejected."""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxfuse import parallel
from jaxfuse._src import compat
from jaxfuse._src.ops.rms_norm import reference as norm_ref
from tests import helpers

S, B, H, K, N, V = 24, 2, 16, 32, 16, 40  # S != H, K: all-gathers on dim 0 must be activations
EPS = 1e-5
AXIS = "tp"


def mesh_of(tp):
  return Mesh(np.array(jax.devices("cpu")[:tp]), (AXIS,))


@dataclasses.dataclass
class Case:
  fn: Callable              # per-device function (inside shard_map)
  ref: Callable             # the same on full arrays, no parallelism
  args: tuple               # global arrays
  in_specs: tuple
  out_specs: tuple
  copies: tuple             # per output: per-device copies stacked as [tp, ...] ([None], P(AXIS))
  forward: tuple            # (all-gather, reduce-scatter, all-reduce) in the forward
  forward_backward: tuple   # the same for forward + backward (vjp)
  gather_dims: tuple = (0,)  # dimensions activations may be all-gathered along


def _matmul(x, k):
  return jnp.matmul(x, k, preferred_element_type=jnp.float32).astype(x.dtype)


def make_case(name, tp, implementation="ffi", dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  arr = lambda *shape, scale=1.0: helpers.random_array(rng, shape, dtype, scale)
  x, xs = arr(S, B, H), P(AXIS)
  gamma = arr(H, scale=0.5)
  col = arr(H, N, scale=H**-0.5)
  row_in = arr(S, B, K)
  row = arr(K, H, scale=K**-0.5)
  norm = dict(eps=EPS, implementation=implementation)
  stacked = lambda out: out[None]

  if name == "column_gather":
    return Case(lambda x, k: parallel.column_parallel_linear(x, k, axis_name=AXIS),
                _matmul, (x, col), (xs, P(None, AXIS)), P(None, None, AXIS), (False,),
                (1, 0, 0), (1, 1, 0))
  if name == "column_replicated_residual":
    residual = arr(S, B, N)
    return Case(lambda x, k, r: parallel.column_parallel_linear(
        x, k, axis_name=AXIS, gather_input=False, residual=r, alpha=0.5,
        implementation=implementation),
                lambda x, k, r: (r + 0.5 * jnp.matmul(x, k)).astype(dtype),
                (x, col, residual), (P(), P(None, AXIS), P(None, None, AXIS)),
                P(None, None, AXIS), (False,), (0, 0, 0), (0, 0, 1))
  if name == "row_scatter_residual":
    residual = arr(S, B, H)
    return Case(lambda x, k, r: parallel.row_parallel_linear(x, k, axis_name=AXIS, residual=r),
                lambda x, k, r: (r + _matmul(x, k)).astype(dtype),
                (row_in, row, residual), (P(None, None, AXIS), P(AXIS), xs), xs, (False,),
                (0, 1, 0), (1, 1, 0))
  if name == "row_all":
    return Case(lambda x, k: parallel.row_parallel_linear(x, k, axis_name=AXIS, reduce="all"),
                _matmul, (row_in, row), (P(None, None, AXIS), P(AXIS)), P(), (False,),
                (0, 0, 1), (0, 0, 1))
  if name == "norm_column":
    return Case(lambda x, g, k: parallel.rms_norm_column_parallel_linear(
        x, g, k, axis_name=AXIS, **norm),
                lambda x, g, k: _matmul(norm_ref.rms_norm(x, g, EPS), k),
                (x, gamma, col), (xs, P(), P(None, AXIS)), P(None, None, AXIS), (False,),
                (1, 0, 0), (1, 1, 1))
  if name == "row_tail_scatter":
    residual = arr(S, B, H)

    def fn(x, k, r, g):
      new_residual, normalized = parallel.row_parallel_residual_rms_norm(
          _matmul(x, k), r, g, axis_name=AXIS, **norm)
      return new_residual, stacked(normalized)

    def ref(x, k, r, g):
      normalized, s = norm_ref.add_rms_norm(_matmul(x, k), r, g, EPS)
      return s, normalized

    return Case(fn, ref, (row_in, row, residual, gamma),
                (P(None, None, AXIS), P(AXIS), xs, P()), (xs, P(AXIS)), (False, True),
                (1, 1, 0), (2, 2, 1))
  if name == "row_tail_all":
    residual = arr(S, B, H)

    def fn(x, k, r, g):
      return parallel.row_parallel_residual_rms_norm(_matmul(x, k), r, g, axis_name=AXIS,
                                                     reduce="all", **norm)

    def ref(x, k, r, g):
      normalized, s = norm_ref.add_rms_norm(_matmul(x, k), r, g, EPS)
      return s, normalized

    return Case(fn, ref, (row_in, row, residual, gamma), (P(None, None, AXIS), P(AXIS), P(), P()),
                (P(), P()), (False, False), (0, 0, 1), (0, 0, 1))
  if name == "gather_last_dim":
    logits = arr(S, B, V)
    return Case(lambda x: stacked(parallel.gather_last_dim(x, axis_name=AXIS)), lambda x: x,
                (logits,), (P(None, None, AXIS),), P(AXIS), (True,), (1, 0, 0), (1, 1, 0),
                gather_dims=(2,))
  if name == "reduce_scatter":
    partials = arr(tp * S, B, H)   # one [S, B, H] partial sum per device
    return Case(lambda x: parallel.reduce_scatter_to_sequence_parallel(x, axis_name=AXIS),
                lambda x: x.reshape(tp, S, B, H).sum(0), (partials,), (P(AXIS),), xs, (False,),
                (0, 1, 0), (1, 1, 0))
  raise ValueError(name)


CASES = ["column_gather", "column_replicated_residual", "row_scatter_residual", "row_all",
         "norm_column", "row_tail_scatter", "row_tail_all", "gather_last_dim",
         "reduce_scatter"]


def _as_tuple(value):
  return value if isinstance(value, tuple) else (value,)


def sharded_vjp(case, tp):
  """One shard_map program: the layer's outputs and its vjp for given cotangents."""
  out_specs = _as_tuple(case.out_specs)

  def body(args, cotangents):
    outs, vjp = jax.vjp(lambda *a: _as_tuple(case.fn(*a)), *args)
    return outs, vjp(cotangents)

  return jax.jit(compat.shard_map(body, mesh=mesh_of(tp),
                                  in_specs=(case.in_specs, out_specs),
                                  out_specs=(out_specs, case.in_specs)))


def sharded_forward(case, tp):
  return jax.jit(compat.shard_map(case.fn, mesh=mesh_of(tp), in_specs=case.in_specs,
                                  out_specs=case.out_specs))


def reference_vjp(case, cotangents, tp):
  outs, vjp = jax.vjp(lambda *a: _as_tuple(case.ref(*a)), *case.args)
  # Stacked copies: each device's copy has its own cotangent; they sum.
  ref_cts = tuple(ct.sum(0) if copy else ct
                  for ct, o, copy in zip(cotangents, outs, case.copies))
  return outs, vjp(ref_cts)


def random_cotangents(case, tp, seed=1):
  rng = np.random.default_rng(seed)
  shapes = [o.shape for o in _as_tuple(jax.eval_shape(case.ref, *case.args))]
  return tuple(helpers.random_array(rng, (tp, *s) if copy else s, jnp.float32)
               for s, copy in zip(shapes, case.copies))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", CASES)
def test_layer_matches_unsharded_reference(name, tp):
  case = make_case(name, tp)
  cotangents = random_cotangents(case, tp)
  outs, grads = sharded_vjp(case, tp)(case.args, cotangents)
  ref_outs, ref_grads = reference_vjp(case, cotangents, tp)
  for i, (out, ref, copy) in enumerate(zip(outs, ref_outs, case.copies)):
    expected = np.asarray(ref)[None].repeat(tp, 0) if copy else ref
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=2e-5, atol=2e-5,
                               err_msg=f"{name} output {i}")
  for i, (grad, ref) in enumerate(zip(grads, ref_grads)):
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref), rtol=5e-5, atol=5e-5,
                               err_msg=f"{name} gradient of argument {i}")


def test_xla_implementation_and_bfloat16_match_too():
  for name in ("norm_column", "row_tail_scatter"):
    for implementation, dtype in (("xla", jnp.float32), ("ffi", jnp.bfloat16)):
      case = make_case(name, 4, implementation=implementation, dtype=dtype)
      outs = _as_tuple(sharded_forward(case, 4)(*case.args))
      ref_outs = _as_tuple(case.ref(*case.args))
      for out, ref, copy in zip(outs, ref_outs, case.copies):
        if copy:
          out = out[0]
        helpers.assert_close(out, helpers.as_f64(ref), dtype, msg=f"{name} {implementation}")


# --- compiled HLO: exactly the expected collectives, no weight gathers ----------------

_COLLECTIVE = re.compile(
    r"= (?P<shape>[^ ]+) (?P<op>all-gather|reduce-scatter|all-reduce)(?:-start)?\(")
_DIMENSIONS = re.compile(r"dimensions=\{(\d+)\}")


def collectives(compiled_text):
  counts = {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}
  gathers = []
  for line in compiled_text.splitlines():
    match = _COLLECTIVE.search(line)
    if match:
      counts[match["op"]] += 1
      if match["op"] == "all-gather":
        dims = _DIMENSIONS.search(line)
        dims_text = match["shape"].split("[")[1].split("]")[0]
        shape = tuple(int(d) for d in re.findall(r"\d+", dims_text))
        gathers.append((int(dims.group(1)) if dims else None, shape))
  return (counts["all-gather"], counts["reduce-scatter"], counts["all-reduce"]), gathers


@pytest.mark.parametrize("name", CASES)
def test_compiled_collectives(name):
  tp = 4
  case = make_case(name, tp)
  cotangents = random_cotangents(case, tp)
  forward_text = sharded_forward(case, tp).lower(*case.args).compile().as_text()
  both_text = sharded_vjp(case, tp).lower(case.args, cotangents).compile().as_text()
  forward, forward_gathers = collectives(forward_text)
  both, both_gathers = collectives(both_text)
  assert forward == case.forward, f"{name}: forward (AG, RS, AR) = {forward}"
  assert both == case.forward_backward, f"{name}: forward+backward (AG, RS, AR) = {both}"
  # Only activations are gathered (along the sequence, or the vocabulary for logits):
  # a gathered weight would be [H, N], [K, H] or along another dimension.
  for dim, shape in forward_gathers + both_gathers:
    assert dim in case.gather_dims, f"{name}: all-gather along dimension {dim}: {shape}"
    if dim == 0:
      assert shape[0] == S, f"{name}: all-gather of a non-activation {shape}"


# --- errors ------------------------------------------------------------------------


def test_sequence_not_divisible_by_tp_is_rejected():
  mesh = mesh_of(4)
  x = jnp.ones((4 * 6, B, K // 4 * 4))  # each device sees 6 positions: not divisible by 4

  def run(fn, *args, in_specs):
    return compat.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P())(*args)

  with pytest.raises(ValueError, match=r"x_shard.shape\[0\] \(the sequence length, 6\) must be "
                                       r"divisible by the tensor-parallel size tp=4"):
    run(lambda x, k: parallel.row_parallel_linear(x, k, axis_name=AXIS)[:0].sum(),
        jnp.ones((6, B, K)), jnp.ones((K, H)), in_specs=(P(), P()))
  with pytest.raises(ValueError, match=r"y_partial.shape\[0\] \(the sequence length, 6\)"):
    run(lambda y, r, g: parallel.row_parallel_residual_rms_norm(y, r, g, axis_name=AXIS)[0].sum(),
        jnp.ones((6, H)), jnp.ones((1, H)), jnp.ones((H,)), in_specs=(P(), P(), P()))
  with pytest.raises(ValueError, match=r"x.shape\[0\] \(the sequence length, 6\)"):
    run(lambda x: parallel.reduce_scatter_to_sequence_parallel(x, axis_name=AXIS).sum(),
        x, in_specs=(P(AXIS),))
  # reduce="all" has no such constraint.
  out = compat.shard_map(lambda x, k: parallel.row_parallel_linear(x, k, axis_name=AXIS,
                                                                   reduce="all"),
                         mesh=mesh, in_specs=(P(None, None, AXIS), P(AXIS)), out_specs=P())(
      jnp.ones((6, B, K)), jnp.ones((K, H)))
  assert out.shape == (6, B, H)


def test_argument_errors():
  mesh = mesh_of(2)

  def run(fn):
    return compat.shard_map(fn, mesh=mesh, in_specs=(), out_specs=P())()

  with pytest.raises(ValueError, match=r"reduce must be one of \('scatter', 'all'\), got 'sum'"):
    run(lambda: parallel.row_parallel_linear(jnp.ones((4, K)), jnp.ones((K, H)),
                                             axis_name=AXIS, reduce="sum"))
  with pytest.raises(ValueError, match=r"x's last dimension \(8\) must equal kernel_shard.shape\[0\]"):
    run(lambda: parallel.column_parallel_linear(jnp.ones((4, 8)), jnp.ones((K, H)),
                                                axis_name=AXIS))
  with pytest.raises(TypeError, match=r"kernel_shard dtype bfloat16 must equal x dtype float32"):
    run(lambda: parallel.column_parallel_linear(jnp.ones((4, K)),
                                                jnp.ones((K, H), jnp.bfloat16), axis_name=AXIS))
  with pytest.raises(ValueError, match=r"residual_shard must have shape \(2, 16\)"):
    run(lambda: parallel.row_parallel_residual_rms_norm(jnp.ones((4, H)), jnp.ones((4, H)),
                                                        jnp.ones((H,)), axis_name=AXIS)[0])


def test_inference_variant_matches_training_variant():
  tp = 4
  for name in ("norm_column", "row_tail_scatter", "row_tail_all"):
    case = make_case(name, tp)
    train = sharded_forward(case, tp)(*case.args)
    inference_case = dataclasses.replace(case, fn=_with_inference(case.fn))
    infer = sharded_forward(inference_case, tp)(*case.args)
    for a, b in zip(_as_tuple(train), _as_tuple(infer)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The inference variant runs the forward kernels without the custom_vjp: on the "ffi"
  # path it cannot be differentiated (the training variant can: see the tests above).
  case = make_case("norm_column", tp)
  inference_case = dataclasses.replace(case, fn=_with_inference(case.fn))
  with pytest.raises(ValueError, match="cannot be differentiated"):
    sharded_vjp(inference_case, tp)(case.args, random_cotangents(case, tp))


def _with_inference(fn):
  """Runs fn with every jaxfuse.parallel layer called with inference=True."""
  import functools

  def wrapped(*args):
    originals = {}
    for layer in ("rms_norm_column_parallel_linear", "row_parallel_residual_rms_norm"):
      originals[layer] = getattr(parallel, layer)
      setattr(parallel, layer, functools.partial(originals[layer], inference=True))
    try:
      return fn(*args)
    finally:
      for layer, original in originals.items():
        setattr(parallel, layer, original)

  return wrapped
