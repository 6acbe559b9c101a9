"""group_offsets: reference vs numpy, FFI (CPU and CUDA) vs numpy, the multi-output
variant (strides, capacity clamp, int64), vmap, jit, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse._src.ops.group_offsets import api as offsets_api

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]

SIZES = [
    [3, 0, 5, 7],
    [0, 0, 0],
    [12],
    [],
    [4, -3, 2, -1, 0, 9],            # negative sizes count as zero
    list(range(1, 40)),
]


def numpy_offsets(sizes):
  sizes = np.maximum(np.asarray(sizes, np.int64), 0)
  return np.concatenate([[0], np.cumsum(sizes)])


def on(backend, value):
  return jax.device_put(value, jax.devices(backend)[0])


@pytest.mark.parametrize("sizes", SIZES)
def test_reference_matches_numpy(sizes):
  out = jaxfuse.group_offsets(jnp.asarray(sizes, jnp.int32), implementation="xla")
  assert out.dtype == jnp.int32 and out.shape == (len(sizes) + 1,)
  np.testing.assert_array_equal(out, numpy_offsets(sizes))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sizes", SIZES)
def test_ffi_matches_numpy(backend, sizes):
  sizes = on(backend, jnp.asarray(sizes, jnp.int32))
  out = jax.jit(lambda s: jaxfuse.group_offsets(s, implementation="ffi"))(sizes)
  assert out.dtype == jnp.int32
  np.testing.assert_array_equal(out, numpy_offsets(np.asarray(sizes)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [1023, 1024, 1025, 3000])
def test_many_groups_loop_over_chunks(backend, groups):
  rng = np.random.default_rng(groups)
  sizes = rng.integers(-5, 50, size=groups).astype(np.int32)
  out = jaxfuse.group_offsets(on(backend, jnp.asarray(sizes)), implementation="ffi")
  np.testing.assert_array_equal(out, numpy_offsets(sizes))


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_strides_and_capacity(backend):
  sizes = on(backend, jnp.asarray([5, 0, 7, -2, 9], jnp.int32))
  rows = numpy_offsets([5, 0, 7, -2, 9])
  capped = np.minimum(rows, 15)
  for implementation in ("ffi", "xla"):
    row_offsets, element_offsets = offsets_api.group_offsets_multi(
        sizes, (1, 96), row_capacity=15, implementation=implementation)
    assert row_offsets.dtype == jnp.int32 and element_offsets.dtype == jnp.int32
    np.testing.assert_array_equal(row_offsets, capped)
    np.testing.assert_array_equal(element_offsets, capped * 96)


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_uses_int64_where_int32_could_overflow(backend):
  sizes = on(backend, jnp.asarray([70000, 3, 80000], jnp.int32))
  stride = 65536  # 150003 rows * 65536 > 2**31
  rows, elements = offsets_api.group_offsets_multi(sizes, (1, stride), row_capacity=1 << 20,
                                                   implementation="ffi")
  assert rows.dtype == jnp.int32 and elements.dtype == jnp.int64
  expected = numpy_offsets([70000, 3, 80000])
  np.testing.assert_array_equal(rows, expected)
  np.testing.assert_array_equal(np.asarray(elements), expected * stride)
  assert offsets_api.offsets_dtype(1, None) == jnp.int32
  assert offsets_api.offsets_dtype(4096, None) == jnp.int64
  assert offsets_api.offsets_dtype(4096, 1000) == jnp.int32


def test_multi_reference_int64_needs_x64():
  sizes = jnp.asarray([1, 2], jnp.int32)
  if not jax.config.jax_enable_x64:
    with pytest.raises(NotImplementedError, match="jax_enable_x64"):
      offsets_api.group_offsets_multi(sizes, (1, 4096), implementation="xla")


def test_vmap_and_jit():
  sizes = jnp.asarray([[1, 2, 3], [0, -1, 4]], jnp.int32)
  out = jax.jit(jax.vmap(lambda s: jaxfuse.group_offsets(s, implementation="ffi")))(sizes)
  np.testing.assert_array_equal(out, np.stack([numpy_offsets(s) for s in np.asarray(sizes)]))


def test_one_custom_call():
  hlo = jax.jit(lambda s: jaxfuse.group_offsets(s, implementation="ffi")).lower(
      jnp.zeros((8,), jnp.int32)).as_text()
  assert hlo.count("jaxfuse_group_offsets") == 1
  assert "reduce_window" not in hlo and "cumsum" not in hlo


def test_errors():
  with pytest.raises(TypeError, match="group_sizes must have dtype int32, got float32"):
    jaxfuse.group_offsets(jnp.ones((3,), jnp.float32))
  with pytest.raises(TypeError, match="group_sizes must have dtype int32, got int8"):
    jaxfuse.group_offsets(np.ones((3,), np.int8))
  with pytest.raises(ValueError, match=r"group_sizes must have rank 1 \(\[G\]\)"):
    jaxfuse.group_offsets(jnp.ones((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="strides must be positive"):
    offsets_api.group_offsets_multi(jnp.ones((3,), jnp.int32), (1, 0))
