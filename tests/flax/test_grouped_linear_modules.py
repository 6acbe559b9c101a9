"""Flax GroupedLinear (linen and nnx) against a float64 numpy grouped GEMM: values,
gradients, hard group sizes, the FP8 recipe, and bad group_sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

import jaxfuse
from jaxfuse.flax import linen as jf_linen
from jaxfuse.flax import nnx as jf_nnx
from tests import helpers

K, N = 32, 48


def _row_ranges(sizes, rows):
  """(group, start, stop) of each group's rows, sizes clamped to [0, rows left]."""
  start = 0
  for g, size in enumerate(sizes):
    size = max(0, min(int(size), rows - start))
    yield g, start, start + size
    start += size


def numpy_grouped(x, kernel, sizes):
  """float64: rows of group g times kernel[g]; rows past sum(sizes) are zero."""
  x, kernel = helpers.as_f64(x), helpers.as_f64(kernel)
  out = np.zeros((x.shape[0], kernel.shape[2]))
  for g, start, stop in _row_ranges(sizes, x.shape[0]):
    out[start:stop] = x[start:stop] @ kernel[g]
  return out


def numpy_grouped_grads(x, kernel, sizes, dy):
  """float64 (dx, dkernel) of sum(numpy_grouped(x, kernel, sizes) * dy)."""
  x, kernel, dy = helpers.as_f64(x), helpers.as_f64(kernel), helpers.as_f64(dy)
  dx, dkernel = np.zeros_like(x), np.zeros_like(kernel)
  for g, start, stop in _row_ranges(sizes, x.shape[0]):
    dx[start:stop] = dy[start:stop] @ kernel[g].T
    dkernel[g] = x[start:stop].T @ dy[start:stop]
  return dx, dkernel


def build(flavour, groups, dtype, recipe=None):
  """(apply(x, sizes, kernel), kernel) for a fresh module of the given flavour."""
  if flavour == "linen":
    module = jf_linen.GroupedLinear(groups, N, dtype=dtype, recipe=recipe,
                                    implementation="ffi")
    x0, sizes0 = jnp.zeros((8, K), dtype), jnp.zeros((groups,), jnp.int32)
    kernel = module.init(jax.random.key(0), x0, sizes0)["params"]["kernel"]
    apply = lambda x, s, k: module.apply({"params": {"kernel": k}}, x, s)  # noqa: E731
    return apply, kernel
  model = jf_nnx.GroupedLinear(K, groups, N, dtype=dtype, recipe=recipe,
                               implementation="ffi", rngs=flax_nnx.Rngs(0))
  graphdef, state = flax_nnx.split(model)

  def apply(x, s, k):  # a module merged inside the trace takes the traced kernel
    module = flax_nnx.merge(graphdef, state)
    module.kernel = flax_nnx.Param(k)
    return module(x, s)

  return apply, model.kernel[...]


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
@pytest.mark.parametrize("sizes, rows", [([5, 0, 9, 3], 17),       # an empty group
                                         ([17], 17),               # one group
                                         ([2, 3, 0, 1], 11),       # sum < rows
                                         ([1] * 12 + [0] * 4, 16)])  # many small groups
def test_matches_float64_in_values_and_gradients(flavour, sizes, rows):
  dtype = jnp.bfloat16  # what the kernels take (float32 needs implementation="xla")
  apply, kernel = build(flavour, len(sizes), dtype)
  assert kernel.shape == (len(sizes), K, N)
  rng = np.random.default_rng(len(sizes) + rows)
  x = helpers.random_array(rng, (rows, K), dtype)
  kernel = helpers.random_array(rng, kernel.shape, jnp.float32)
  group_sizes = jnp.asarray(sizes, jnp.int32)
  # The module casts its float32 kernel to the compute dtype first.
  rounded = kernel.astype(dtype)
  helpers.assert_close(apply(x, group_sizes, kernel), numpy_grouped(x, rounded, sizes), dtype)
  dy = helpers.random_array(rng, (rows, N), dtype)
  dx, dkernel = jax.grad(
      lambda x, k: jnp.sum(apply(x, group_sizes, k).astype(jnp.float32) * dy.astype(jnp.float32)),
      argnums=(0, 1))(x, kernel)
  want_dx, want_dkernel = numpy_grouped_grads(x, rounded, sizes, dy)
  assert dx.dtype == dtype and dkernel.dtype == jnp.float32
  helpers.assert_close(dx, want_dx, dtype, msg="dx")
  helpers.assert_close(dkernel, want_dkernel, dtype, msg="dkernel")


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_bfloat16_and_the_fp8_recipe(flavour):
  sizes = jnp.asarray([7, 0, 25], jnp.int32)
  rng = np.random.default_rng(3)
  x = helpers.random_array(rng, (32, K), jnp.bfloat16)
  apply, kernel = build(flavour, 3, jnp.bfloat16)
  want = numpy_grouped(x, kernel.astype(jnp.bfloat16), [7, 0, 25])
  helpers.assert_close(apply(x, sizes, kernel), want, jnp.bfloat16)
  recipe = jaxfuse.quantization.Float8CurrentScaling(per_group=True)
  fp8_apply, _ = build(flavour, 3, jnp.bfloat16, recipe)
  got = helpers.as_f64(fp8_apply(x, sizes, kernel))
  # E4M3 keeps 3 mantissa bits: a few percent of the norm over a 32-term product.
  assert np.linalg.norm(got - want) <= 0.06 * np.linalg.norm(want)


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_group_sizes_of_the_wrong_shape_are_rejected(flavour):
  apply, kernel = build(flavour, 3, jnp.bfloat16)
  x = jnp.ones((6, K), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"group_sizes must have shape \(3,\) \(num_groups\), "
                                       r"got \(4,\)"):
    apply(x, jnp.ones((4,), jnp.int32), kernel)
