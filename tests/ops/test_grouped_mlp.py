"""grouped_mlp: reference and FFI (CPU, CUDA) vs float64 numpy, gradients of x, both kernels
and the scales, save_activation, one offsets computation, fused kernels in the jaxpr and
HLO, shard_map, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxfuse
from jaxfuse._src import compat
from jaxfuse._src.ops.grouped_mlp import reference
from tests import helpers

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]
ACTIVATIONS = ["swiglu", "srelu", "clamped_swiglu"]
LIMIT, ALPHA, LINEAR_OFFSET = 1.5, 1.702, 1.0  # a small limit so clamping happens


def sizes_cases(m: int) -> dict[str, list[int]]:
  return {
      "uniform": [m // 4] * 4,
      "one_group": [m],
      "empty_groups": [0, m // 2, 0, m - m // 2],
      "sum_less_than_rows": [m // 5, m // 7, m // 3],
      "negative_sizes": [-3, m // 2, m // 3],
  }


# --- float64 numpy model ----------------------------------------------------------------

def np_activation(h, activation):
  """(act, d act/d a, d act/d b or None) of h [M, W] in float64."""
  if activation == "srelu":
    r = np.maximum(h, 0.0)
    return r * r, 2 * r, None
  f = h.shape[1] // 2
  a, b = h[:, :f], h[:, f:]
  if activation == "swiglu":
    s = 1 / (1 + np.exp(-a))
    return a * s * b, b * s * (1 + a * (1 - s)), a * s
  a_clamped = a > LIMIT
  ac = np.minimum(a, LIMIT)
  bc = np.clip(b, -LIMIT, LIMIT) + LINEAR_OFFSET
  s = 1 / (1 + np.exp(-ALPHA * ac))
  gate = ac * s
  d_gate = s * (1 + ALPHA * ac * (1 - s))
  return (gate * bc, np.where(a_clamped, 0.0, bc * d_gate),
          np.where(np.abs(b) > LIMIT, 0.0, gate))


def group_rows(sizes, m):
  start = 0
  for g, size in enumerate(sizes):
    end = min(start + max(int(size), 0), m)
    yield g, start, end
    start = end


def np_grouped(a, w, sizes):
  out = np.zeros((a.shape[0], w.shape[2]))
  for g, s, e in group_rows(sizes, a.shape[0]):
    out[s:e] = a[s:e] @ w[g]
  return out


def round_to(value, dtype):
  return helpers.as_f64(jnp.asarray(value, dtype)) if dtype is not None else value


def np_grouped_mlp(x, k1, k2, sizes, scales, activation, d_out=None, rounding=None):
  """Forward (and, with d_out, the float64 derivatives dx, dk1, dk2, dscales).

  `rounding` (a dtype) rounds FC1's output and the activation as the op stores them, so
  derivatives are evaluated where the op evaluates them (clamped_swiglu's derivative jumps
  at the clamp limit).
  """
  x, k1, k2, scales = (helpers.as_f64(v) for v in (x, k1, k2, scales))
  m = x.shape[0]
  h = round_to(np_grouped(x, k1, sizes), rounding)
  act, da_, db_ = np_activation(h, activation)
  a = round_to(act * scales[:, None], rounding)
  y = np_grouped(a, k2, sizes)
  if d_out is None:
    return y
  dy = helpers.as_f64(d_out)
  d_a = np.zeros_like(a)
  d_k2 = np.zeros_like(k2)
  for g, s, e in group_rows(sizes, m):
    d_a[s:e] = dy[s:e] @ k2[g].T
    d_k2[g] = a[s:e].T @ dy[s:e]
  d_scales = np.sum(d_a * act, axis=1)
  d_act = d_a * scales[:, None]
  dh = d_act * da_ if db_ is None else np.concatenate([d_act * da_, d_act * db_], axis=1)
  dx = np.zeros_like(x)
  d_k1 = np.zeros_like(k1)
  for g, s, e in group_rows(sizes, m):
    dx[s:e] = dh[s:e] @ k1[g].T
    d_k1[g] = x[s:e].T @ dh[s:e]
  return y, (dx, d_k1, d_k2, d_scales)


def make_inputs(seed, m, hidden, ffn, groups, activation, dtype):
  rng = np.random.default_rng(seed)
  width = ffn if activation == "srelu" else 2 * ffn
  x = helpers.random_array(rng, (m, hidden), dtype)
  k1 = helpers.random_array(rng, (groups, hidden, width), dtype, scale=1 / np.sqrt(hidden))
  k2 = helpers.random_array(rng, (groups, ffn, hidden), dtype, scale=1 / np.sqrt(ffn))
  scales = jnp.asarray(rng.uniform(0.1, 1.0, m), jnp.float32)
  return x, k1, k2, scales


def on(device_kind, *arrays):
  device = jax.devices(device_kind)[0]
  return [jax.device_put(a, device) for a in arrays]


def call(impl, activation, save_activation=False):
  return lambda x, k1, k2, sizes, scales: jaxfuse.grouped_mlp(
      x, k1, k2, sizes, scales, activation, implementation=impl, limit=LIMIT, alpha=ALPHA,
      linear_offset=LINEAR_OFFSET, save_activation=save_activation)


# --- values ---------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_matches_float64_numpy(activation):
  sizes = [9, 0, 20, 11]
  x, k1, k2, scales = make_inputs(0, 48, 12, 10, len(sizes), activation, jnp.float32)
  out = reference.grouped_mlp(x, k1, k2, jnp.asarray(sizes, jnp.int32), scales, activation,
                              LIMIT, ALPHA, LINEAR_OFFSET)
  helpers.assert_close(out, np_grouped_mlp(x, k1, k2, sizes, scales, activation), jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", list(sizes_cases(64)))
def test_ffi_matches_float64_numpy(backend, activation, case):
  m, hidden, ffn = (64, 16, 24) if backend == "cpu" else (1000, 256, 384)
  sizes = sizes_cases(m)[case]
  x, k1, k2, scales = make_inputs(1, m, hidden, ffn, len(sizes), activation, jnp.bfloat16)
  x, k1, k2, scales, group_sizes = on(backend, x, k1, k2, scales,
                                      jnp.asarray(sizes, jnp.int32))
  out = jax.jit(call("ffi", activation))(x, k1, k2, group_sizes, scales)
  assert out.dtype == jnp.bfloat16 and out.shape == (m, hidden)
  helpers.assert_close(out, np_grouped_mlp(x, k1, k2, sizes, scales, activation),
                       jnp.bfloat16, msg=case)
  covered = min(sum(max(s, 0) for s in sizes), m)
  assert not np.asarray(out[covered:], np.float32).any(), "rows past the groups must be zero"


# --- gradients ------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", ["uniform", "one_group", "empty_groups", "sum_less_than_rows"])
def test_gradients_match_float64_numpy(backend, activation, case):
  m, hidden, ffn = (64, 16, 24) if backend == "cpu" else (768, 256, 384)
  sizes = sizes_cases(m)[case]
  x, k1, k2, scales = make_inputs(2, m, hidden, ffn, len(sizes), activation, jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(3), (m, hidden), jnp.bfloat16)
  x, k1, k2, scales, d_out, group_sizes = on(backend, x, k1, k2, scales, d_out,
                                             jnp.asarray(sizes, jnp.int32))
  f = call("ffi", activation)
  _, vjp = jax.vjp(lambda x, k1, k2, s: f(x, k1, k2, group_sizes, s), x, k1, k2, scales)
  got = jax.jit(vjp)(d_out)
  _, want = np_grouped_mlp(x, k1, k2, sizes, scales, activation, d_out, rounding=jnp.bfloat16)
  for name, g, w in zip(("dx", "dkernel1", "dkernel2", "dscales"), got, want):
    helpers.assert_close(g, w, jnp.bfloat16, msg=f"{case} {name}")
  assert got[3].dtype == jnp.float32
  for g, s, e in group_rows(sizes, m):  # empty experts: exactly zero weight gradients
    if s == e:
      assert not np.asarray(got[1][g], np.float32).any(), f"dkernel1[{g}] of an empty group"
      assert not np.asarray(got[2][g], np.float32).any(), f"dkernel2[{g}] of an empty group"


def test_gradients_match_reference_autodiff():
  """The custom_vjp against JAX's autodiff of the ragged_dot composition (same dtype)."""
  sizes = jnp.asarray([20, 0, 30, 14], jnp.int32)
  x, k1, k2, scales = make_inputs(4, 64, 16, 16, 4, "swiglu", jnp.bfloat16)
  loss = lambda impl: lambda *a: jnp.sum(jnp.sin(
      call(impl, "swiglu")(a[0], a[1], a[2], sizes, a[3]).astype(jnp.float32)))
  got = jax.jit(jax.grad(loss("ffi"), argnums=(0, 1, 2, 3)))(x, k1, k2, scales)
  want = jax.grad(loss("xla"), argnums=(0, 1, 2, 3))(x, k1, k2, scales)
  for g, w in zip(got, want):
    helpers.assert_close(g, helpers.as_f64(w), jnp.bfloat16)


@pytest.mark.parametrize("activation", ["swiglu", "srelu"])
def test_save_activation_gives_identical_gradients(activation):
  sizes = jnp.asarray([10, 0, 22], jnp.int32)
  x, k1, k2, scales = make_inputs(5, 40, 16, 8, 3, activation, jnp.bfloat16)
  grads = []
  for save in (False, True):
    loss = lambda *a: jnp.sum(jnp.cos(call("ffi", activation, save)(
        a[0], a[1], a[2], sizes, a[3]).astype(jnp.float32)))
    grads.append(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, k1, k2, scales))
  for a, b in zip(*grads):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# --- what runs ------------------------------------------------------------------------

def _grad_jaxpr(save_activation=False):
  x, k1, k2, scales = make_inputs(6, 32, 16, 8, 4, "swiglu", jnp.bfloat16)
  sizes = jnp.asarray([8, 0, 16, 8], jnp.int32)
  f = call("ffi", "swiglu", save_activation)
  loss = lambda x, k1, k2, s: jnp.sum(f(x, k1, k2, sizes, s).astype(jnp.float32))
  args = (x, k1, k2, scales)
  return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args), loss, args


@pytest.mark.parametrize("save_activation", [False, True])
def test_one_offsets_computation_and_only_fused_kernels(save_activation):
  jaxpr, _, _ = _grad_jaxpr(save_activation)
  count = lambda predicate: helpers.count_primitives(jaxpr, predicate)
  name_is = lambda *names: lambda e: e.primitive.name in names
  # Exactly one offsets computation in forward + backward, shared by all six GEMMs.
  assert count(helpers.ffi_target("jaxfuse_group_offsets")) == 1
  assert count(name_is("cumsum", "cumlogsumexp", "cummax")) == 0
  # FC1 fwd, FC2 fwd, FC2 dgrad, FC2 wgrad, FC1 dgrad, FC1 wgrad: six grouped GEMMs, each
  # in both platform branches (cpu, cuda) of platform_dependent.
  assert count(helpers.ffi_target("jaxfuse_grouped_gemm")) == 12
  # The activation: forward once, recomputed once in the backward pass unless saved.
  assert count(helpers.ffi_target("jaxfuse_scaled_activation_fwd")) == (1 if save_activation
                                                                         else 2)
  assert count(helpers.ffi_target("jaxfuse_scaled_activation_bwd")) == 1
  # Nothing of the experts is left to XLA's own GEMMs or element-wise activations.
  assert count(name_is("ragged_dot_general", "ragged_dot", "dot_general")) == 0
  assert count(name_is("logistic", "exp")) == 0


def test_lowered_hlo_runs_the_fused_kernels():
  _, loss, args = _grad_jaxpr()
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args).as_text()
  assert text.count("@jaxfuse_group_offsets") == 1
  assert "@jaxfuse_grouped_gemm" in text and "@jaxfuse_scaled_activation_bwd" in text
  assert "ragged_dot" not in text and "stablehlo.dot_general" not in text


@pytest.mark.parametrize("save_activation", [False, True])
def test_one_activation_kernel_in_a_jitted_training_step(save_activation):
  """grouped_mlp's docstring: in one program that runs the forward (its output kept) and
  the backward, XLA merges the backward's recompute of the activation with the forward's
  kernel (same operands), so either setting runs one forward activation kernel."""
  x, k1, k2, scales = make_inputs(6, 32, 16, 8, 4, "swiglu", jnp.bfloat16)
  sizes = jnp.asarray([8, 0, 16, 8], jnp.int32)
  f = call("ffi", "swiglu", save_activation)

  def step(x, k1, k2, s, dy):
    out, vjp = jax.vjp(lambda *a: f(*a[:3], sizes, a[3]), x, k1, k2, s)
    return out, vjp(dy)

  lowered = jax.jit(step).lower(x, k1, k2, scales, jnp.ones_like(x))
  assert lowered.as_text().count("@jaxfuse_scaled_activation_fwd") == 2 - save_activation
  target = 'custom_call_target="jaxfuse_scaled_activation_fwd"'
  assert lowered.compile().as_text().count(target) == 1


# --- shard_map, errors ------------------------------------------------------------------

def test_shard_map_tokens_sharded_kernels_replicated():
  mesh = Mesh(np.array(jax.devices("cpu")), ("data",))
  devices = mesh.devices.size
  m_local, groups = 16, 3
  x, k1, k2, scales = make_inputs(7, m_local * devices, 16, 8, groups, "swiglu", jnp.bfloat16)
  rng = np.random.default_rng(8)
  sizes = jnp.asarray(np.stack([rng.multinomial(m_local - 2, np.ones(groups) / groups)
                                for _ in range(devices)]).astype(np.int32))

  def layer(impl):
    f = lambda x, k1, k2, s, sz: call(impl, "swiglu")(x, k1, k2, sz[0], s)
    return compat.shard_map(f, mesh=mesh, in_specs=(P("data"), P(), P(), P("data"), P("data")),
                            out_specs=P("data"))

  out = jax.jit(layer("ffi"))(x, k1, k2, scales, sizes)
  helpers.assert_close(out, helpers.as_f64(layer("xla")(x, k1, k2, scales, sizes)),
                       jnp.bfloat16)
  loss = lambda impl: lambda *a: jnp.sum(jnp.sin(layer(impl)(*a, sizes).astype(jnp.float32)))
  got = jax.jit(jax.grad(loss("ffi"), argnums=(0, 1, 2, 3)))(x, k1, k2, scales)
  want = jax.grad(loss("xla"), argnums=(0, 1, 2, 3))(x, k1, k2, scales)
  for g, w in zip(got, want):
    helpers.assert_close(g, helpers.as_f64(w), jnp.bfloat16)


@pytest.mark.parametrize("change, error, match", [
    (dict(k1=(2, 8, 32)), ValueError, r"kernel1.shape\[1\] \(8\) must equal x's last dimension"),
    (dict(k1=(2, 16, 31)), ValueError, r"kernel1.shape\[2\] must be even"),
    (dict(k2=(2, 16, 8)), ValueError, r"kernel2 must have shape \(2, 16, 16\)"),
    (dict(sizes=(3,)), ValueError, r"group_sizes must have shape \(2,\)"),
    (dict(scales=(7,)), ValueError, r"scales must have shape \(8,\)"),
    (dict(dtype=jnp.float32), TypeError, r"take bfloat16 or float16 x"),
    (dict(x=(8, 12), k1=(2, 12, 32), k2=(2, 16, 12)), ValueError, r"multiple of 8"),
    (dict(activation="gelu"), ValueError, r"activation must be one of"),
    (dict(recipe=jaxfuse.quantization.Float8CurrentScaling(per_group=False)), ValueError,
     r"supports recipe=Float8CurrentScaling\(per_group=True\)"),
])
def test_errors_name_the_argument(change, error, match):
  shapes = dict(x=(8, 16), k1=(2, 16, 32), k2=(2, 16, 16), sizes=(2,), scales=(8,))
  shapes.update({k: v for k, v in change.items() if k in shapes})
  dtype = change.get("dtype", jnp.bfloat16)
  with pytest.raises(error, match=match):
    jaxfuse.grouped_mlp(jnp.ones(shapes["x"], dtype), jnp.ones(shapes["k1"], dtype),
                        jnp.ones(shapes["k2"], dtype), jnp.ones(shapes["sizes"], jnp.int32),
                        jnp.ones(shapes["scales"], jnp.float32),
                        change.get("activation", "swiglu"), recipe=change.get("recipe"),
                        implementation="ffi")
