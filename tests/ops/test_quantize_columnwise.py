"""The column-wise copy that the current-scaling quantize kernels write besides their
row-wise FP8 data (jaxfuse/_src/ops/quantize/columnwise.py; CUDA: QuantizeColumnwiseKernel,
TransformerEngine's cast-transpose).

The copy must hold exactly the bytes that quantizing row-wise and then transposing with
group_columnwise gives, on every backend, for plain values, the scaled activation and its
gradient: the row-wise kernels and the transposing kernel are the independent reference
(and numpy's layout of the copy, for well-formed sizes). Cases: every group-size trap,
offsets that decrease or run past the rows, shapes whose units do not fill a tile, NaN,
every activation, the CUDA kernel's tile orders, and the errors."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse._src.ops.quantize import columnwise
from jaxfuse._src.ops.quantize import ffi as quantize_ffi
from tests.ops.test_grouped_linear import BACKENDS, on, sizes_cases
from tests.ops.test_grouped_linear_fp8 import numpy_columnwise

OPS = ["quantize", "activation", "dactivation"]
ACT = dict(limit=7.0, alpha=1.702, linear_offset=1.0)


def shapes(backend):
  """(rows, features): on the GPU 272 features are 34 units, two full 16-unit tiles and a
  partial one; 1000 rows are several 128-row tiles with groups straddling them."""
  return (77, 48) if backend == "cpu" else (1000, 272)


def make_inputs(seed, op, m, features, activation, dtype):
  rng = np.random.default_rng(seed)
  width = features if activation == "srelu" or op == "quantize" else 2 * features
  x = jnp.asarray(rng.standard_normal((m, width)) * 3.0, dtype)
  scales = jnp.asarray(rng.uniform(0.1, 2.0, (m,)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((m, features)), dtype)
  return x, scales, dy


def quantized(op, x, scales, dy, offsets, *, activation, fmt, copy, mode="per_group"):
  """The op's (data, scale_inv[, column-wise copy]) through the FFI wrappers."""
  common = dict(scaling_mode=mode, block=0, fmt=fmt, columnwise=copy)
  if op == "quantize":
    return quantize_ffi.quantize(x, offsets, **common)
  if op == "activation":
    return quantize_ffi.scaled_activation_quantize(x, scales, offsets, activation=activation,
                                                   **ACT, **common)
  out = quantize_ffi.scaled_dactivation_quantize(dy, x, scales, offsets, activation=activation,
                                                 return_dx=False, **ACT, **common)
  return (out[0], out[1], out[4]) if copy else out[:2]


def codes(array):
  return np.asarray(array).view(np.uint8)


def check_against_two_passes(backend, op, x, scales, dy, offsets, *, activation="swiglu",
                             fmt="e4m3", mode="per_group"):
  """The fused results against the row-wise op and group_columnwise of its data; returns
  the row-wise data."""
  x, scales, dy, offsets = on(backend, x, scales, dy, offsets)
  run = lambda copy: jax.jit(lambda *a: quantized(op, *a, activation=activation, fmt=fmt,
                                                  copy=copy, mode=mode))(x, scales, dy, offsets)
  data, scale_inv, copy = run(True)
  want_data, want_scale_inv = run(False)
  np.testing.assert_array_equal(codes(data), codes(want_data))
  np.testing.assert_array_equal(np.asarray(scale_inv), np.asarray(want_scale_inv))
  want_copy = jax.jit(quantize_ffi.group_columnwise)(want_data, offsets)
  assert copy.dtype == want_data.dtype and copy.shape == want_copy.shape
  np.testing.assert_array_equal(codes(copy), codes(want_copy))
  return want_data


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", list(sizes_cases(96)))
def test_copy_matches_row_wise_then_transposed(backend, op, case):
  m, features = shapes(backend)
  sizes = sizes_cases(m)[case]
  fmt = "e5m2" if op == "dactivation" else "e4m3"
  x, scales, dy = make_inputs(len(case), op, m, features, "swiglu", jnp.bfloat16)
  offsets = jaxfuse.group_offsets(jnp.asarray(sizes, jnp.int32))
  data = check_against_two_passes(backend, op, x, scales, dy, offsets, fmt=fmt)
  # The copy's layout itself, in numpy, from the row-wise bytes.
  copy = quantized(op, *on(backend, x, scales, dy, offsets), activation="swiglu", fmt=fmt,
                   copy=True)[2]
  np.testing.assert_array_equal(codes(copy), numpy_columnwise(data, sizes))


@pytest.mark.gpu
@pytest.mark.parametrize("panel", ["1", "3", "1000000"])
def test_gpu_tile_orders_give_the_same_bytes(panel):
  """QuantizeColumnwiseKernel's tile order as JAXFUSE_COLUMNWISE_PANEL sets it (read once
  per process, hence a subprocess): one column tile per panel, three (the GPU shapes have
  eight or nine column tiles, so the last panel is narrower), and every column tile in one
  panel (the column-tiles-fastest order; the default, 16, is one panel at these shapes and
  runs in this process). Every op and group-size case must give the two-pass path's bytes."""
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-k", "gpu",
       f"{__file__}::test_copy_matches_row_wise_then_transposed"],
      env=dict(os.environ, JAXFUSE_COLUMNWISE_PANEL=panel), cwd=pathlib.Path(__file__).parents[2],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
  assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["activation", "dactivation"])
@pytest.mark.parametrize("activation", ["swiglu", "srelu", "clamped_swiglu"])
def test_copy_of_every_activation(backend, op, activation):
  m, features = shapes(backend)
  x, scales, dy = make_inputs(3, op, m, features, activation, jnp.bfloat16)
  offsets = jaxfuse.group_offsets(jnp.asarray([m // 3, 0, m // 2], jnp.int32))
  check_against_two_passes(backend, op, x, scales, dy, offsets, activation=activation)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_copy_of_hostile_offsets(backend, op):
  """Offsets that decrease, start past 0, go negative or run past the rows: rows outside
  every clamped group, rows the row-wise pass puts in another group, all as two passes."""
  m, features = shapes(backend)
  x, scales, dy = make_inputs(5, op, m, features, "swiglu", jnp.bfloat16)
  hostile = jnp.asarray([5, -20, m // 2, m // 3, 10 * m, m - 9], jnp.int32)
  check_against_two_passes(backend, op, x, scales, dy, hostile)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_copy_per_tensor_nan_and_float32(backend, op):
  """One group over all rows (per-tensor current scaling), float32 inputs holding NaN and
  inf (they propagate into the same bytes), unit counts that do not fill a tile (the GPU's
  transposing reference kernel takes K % 16 == 0)."""
  m, features = (40, 24) if backend == "cpu" else (300, 48)
  x, scales, dy = make_inputs(6, op, m, features, "swiglu", jnp.float32)
  x = x.at[3, 1].set(jnp.nan).at[7, 2].set(jnp.inf)
  offsets = jnp.asarray([0, m], jnp.int32)
  check_against_two_passes(backend, op, x, scales, dy, offsets, mode="per_tensor")


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_of_no_rows(backend):
  """Zero rows: the copy is the padding alone (zeros), the scales those of zero amaxes."""
  x = jnp.zeros((0, 32), jnp.bfloat16)
  offsets = jnp.asarray([0, 0, 0], jnp.int32)
  x, offsets = on(backend, x, offsets)
  data, scale_inv, copy = jax.jit(lambda x, o: quantize_ffi.quantize(
      x, o, scaling_mode="per_group", block=0, fmt="e4m3", columnwise=True))(x, offsets)
  assert data.shape == (0, 32) and copy.shape == (32, quantize_ffi.columnwise_width(0, 2))
  assert not codes(copy).any()
  np.testing.assert_array_equal(np.asarray(scale_inv), np.ones(2, np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_errors(backend):
  x = jnp.ones((16, 32), jnp.bfloat16) * 0.5
  x, = on(backend, x)
  with pytest.raises(Exception, match="column-wise copy is written by current scaling"):
    jax.block_until_ready(quantize_ffi.quantize(x, jnp.zeros((1,), jnp.int32),
                                                scaling_mode="block_1d", block=16, fmt="e4m3",
                                                columnwise=True))


def test_fusion_is_traced_only_where_nothing_is_partitioned():
  """The test process has 8 CPU devices: by default the grouped ops keep the row-wise FP8
  tensors (the copies' width cannot be split by the sharding rules); inside shard_map with
  every axis manual, under fused(everywhere=True) or on one device they fuse."""
  assert jax.device_count() > 1
  assert not columnwise.fusion_enabled()
  with columnwise.fused(everywhere=True):
    assert columnwise.fusion_enabled()
  with columnwise.fused(False, everywhere=True):
    assert not columnwise.fusion_enabled()
  mesh = jax.make_mesh((jax.device_count(),), ("d",))
  seen = []

  def body(x):
    seen.append(columnwise.fusion_enabled())
    return x

  spec = jax.sharding.PartitionSpec("d")
  x = jax.device_put(jnp.ones(jax.device_count()), jax.NamedSharding(mesh, spec))
  jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(x)
  assert seen == [True]
