"""The blockwise FP8 wgrad (Float8BlockScaling(fp8_wgrad=True), DeepSeek-V3's recipe end to
end): the handlers (CPU, CUDA) against float64 numpy on the same FP8 values and 128 x 1
block scales, every hard case of group sizes (multi-block groups, partial last blocks,
empty groups, hostile offsets); grouped_linear's and grouped_mlp's weight gradients against
float64 numpy on the values the op quantizes; what runs; the 16-bit fallback; errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse._src.ops.grouped_linear import ffi as gemm_ffi
from jaxfuse._src.ops.quantize import columnwise
from jaxfuse._src.ops.quantize import ffi as quantize_ffi
from tests import helpers
from tests.ops.test_grouped_linear import BACKENDS, make_inputs, on, sizes_cases
from tests.ops.test_grouped_linear_fp8 import (COLUMNWISE_CASES, FP8_ACCUMULATION,
                                               assert_within_accumulation_bound,
                                               blocked_storage, group_rows, numpy_columnwise,
                                               random_fp8, relative_error)

RECIPE = jaxfuse.quantization.Float8BlockScaling(fp8_wgrad=True)
E5M2_GRADIENTS = jaxfuse.quantization.Float8BlockScaling(gradient_format="e5m2", fp8_wgrad=True)
WGRAD16 = jaxfuse.quantization.Float8BlockScaling(fp8_wgrad=False)
BLOCK = 128


# Group g's first scale row and the scale rows of a copy (jaxfuse/columnwise.h).
scale_row = quantize_ffi.columnwise_scale_row
scale_rows = quantize_ffi.columnwise_scale_rows


def shapes(backend):
  # Groups of more than 128 rows (several scale blocks, a partial last one) on both
  # backends; K != N so that swapped operands or scale layouts cannot pass.
  return (600, 32, 48) if backend == "cpu" else (2000, 256, 272)


def dequantized_rows(data, scale_inv, sizes):
  """float64 [m, C]: each grouped row's FP8 values times its block's scales, from row-major
  FP8 data [m, C] and scales [S, C] laid out per group as ColumnwiseScaleRow says."""
  values, scales = helpers.as_f64(data), helpers.as_f64(scale_inv)
  out = np.zeros_like(values)
  for g, (start, end) in enumerate(group_rows(sizes, values.shape[0])):
    for r in range(start, end):
      out[r] = values[r] * scales[scale_row(start, g) + (r - start) // BLOCK]
  return out


def numpy_blockwise_wgrad(x_dq, dy_dq, sizes):
  """(exact, abs_sum) float64 [G, K, N] of x_g^T @ dy_g on dequantized rows."""
  groups, k, n = len(sizes), x_dq.shape[1], dy_dq.shape[1]
  exact, abs_sum = np.zeros((groups, k, n)), np.zeros((groups, k, n))
  for g, (start, end) in enumerate(group_rows(sizes, x_dq.shape[0])):
    exact[g] = x_dq[start:end].T @ dy_dq[start:end]
    abs_sum[g] = np.abs(x_dq[start:end]).T @ np.abs(dy_dq[start:end])
  return exact, abs_sum


def random_scales(seed, rows, columns):
  return jnp.asarray(np.random.default_rng(seed).uniform(0.01, 0.1, (rows, columns)),
                     jnp.float32)


def wgrad_kernel_operands(x, dy, sizes, seed):
  """The blockwise wgrad kernel's operands for `sizes` from FP8 x [m, k] and dy [m, n]:
  (x^T, dy^T column-wise copies, the group offsets, random 128 x 1 block scales of x and of
  dy drawn with seeds `seed` and `seed + 1`)."""
  m, k = x.shape
  n, groups = dy.shape[1], len(sizes)
  x_s = random_scales(seed, scale_rows(m, groups), k)
  dy_s = random_scales(seed + 1, scale_rows(m, groups), n)
  x_t = jnp.asarray(numpy_columnwise(x, sizes)).view(x.dtype)
  dy_t = jnp.asarray(numpy_columnwise(dy, sizes)).view(dy.dtype)
  offsets = jaxfuse.group_offsets(jnp.asarray(sizes, jnp.int32))
  return x_t, dy_t, offsets, x_s, dy_s


def blockwise_wgrad_call(x_t, dy_t, offsets, x_s, dy_s, rows):
  return jax.jit(lambda *a: gemm_ffi.fp8_blockwise_wgrad_columnwise(*a, rows=rows))(
      x_t, dy_t, offsets, x_s, dy_s)


@pytest.mark.parametrize("gradient_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", COLUMNWISE_CASES)
def test_handler_matches_float64_numpy(backend, case, gradient_dtype):
  """dw[g] = sum over the group's 128-row blocks of (x block scaled per column) ^T @
  (dy block scaled per column): exact FP8 products in fp32 per block, promoted with the two
  scales, one bf16 rounding; empty groups exactly 0. Random codes of every magnitude and
  random scales in every used row, in the layouts the quantize kernel writes."""
  m, k, n = shapes(backend)
  sizes = sizes_cases(m)[case]
  groups = len(sizes)
  x = random_fp8(60, (m, k), jnp.float8_e4m3fn)
  dy = random_fp8(61, (m, n), gradient_dtype)
  x_t, dy_t, offsets, x_s, dy_s = wgrad_kernel_operands(x, dy, sizes, 62)
  args = on(backend, x_t, dy_t, offsets, x_s, dy_s)
  dw = blockwise_wgrad_call(*args, rows=m)
  assert dw.dtype == jnp.bfloat16 and dw.shape == (groups, k, n)
  exact, abs_sum = numpy_blockwise_wgrad(dequantized_rows(x, x_s, sizes),
                                         dequantized_rows(dy, dy_s, sizes), sizes)
  assert_within_accumulation_bound(dw, exact, abs_sum, case, FP8_ACCUMULATION)
  for g, (start, end) in enumerate(group_rows(sizes, m)):
    if start == end:
      assert not np.asarray(dw[g], np.float32).any(), f"dw[{g}] of an empty group"


@pytest.mark.parametrize("backend", BACKENDS)
def test_hostile_offsets_read_only_their_clamped_rows(backend):
  """Offsets that decrease, go negative or run past M (G = 5): the kernel clamps them and
  makes them non-decreasing, as every grouped form does; the result is the one of the
  clamped offsets, and nothing is read or written out of bounds (memcheck on the GPU)."""
  m, k, n = 400, 32, 48
  hostile = np.asarray([5, -20, 300, 250, 900, 60], np.int32)
  clamped = np.maximum.accumulate(np.clip(hostile, 0, m))
  x = random_fp8(64, (m, k), jnp.float8_e4m3fn)
  dy = random_fp8(65, (m, n), jnp.float8_e4m3fn)
  x_s, dy_s = random_scales(66, scale_rows(m, 5), k), random_scales(67, scale_rows(m, 5), n)
  # The copies as the quantize kernel writes them for these offsets (rows before the first
  # clamped offset belong to no group).
  columns_x = np.zeros((k, quantize_ffi.columnwise_width(m, 5)), np.uint8)
  columns_dy = np.zeros((n, quantize_ffi.columnwise_width(m, 5)), np.uint8)
  for g in range(5):
    first = quantize_ffi.columnwise_start(int(clamped[g]), g)
    rows = slice(int(clamped[g]), int(clamped[g + 1]))
    columns_x[:, first:first + rows.stop - rows.start] = np.asarray(x).view(np.uint8)[rows].T
    columns_dy[:, first:first + rows.stop - rows.start] = np.asarray(dy).view(np.uint8)[rows].T
  x_t = jnp.asarray(blocked_storage(columns_x, clamped)).view(x.dtype)
  dy_t = jnp.asarray(blocked_storage(columns_dy, clamped)).view(dy.dtype)
  args = on(backend, x_t, dy_t, jnp.asarray(hostile), x_s, dy_s)
  dw = helpers.as_f64(blockwise_wgrad_call(*args, rows=m))
  xs64, dys64 = helpers.as_f64(x_s), helpers.as_f64(dy_s)
  for g in range(5):
    start, end = int(clamped[g]), int(clamped[g + 1])
    block = (np.arange(start, end) - start) // BLOCK + scale_row(start, g)
    x_dq = helpers.as_f64(x)[start:end] * xs64[block]
    dy_dq = helpers.as_f64(dy)[start:end] * dys64[block]
    exact, abs_sum = x_dq.T @ dy_dq, np.abs(x_dq).T @ np.abs(dy_dq)
    assert_within_accumulation_bound(dw[g], exact, abs_sum, f"group {g}", FP8_ACCUMULATION)


def column_blocks_of(value, sizes, recipe, role):
  """float64 [m, C]: value's grouped rows dequantized as the FP8 wgrad sees them, computed
  without the op's kernels: each group's 128-row blocks, transposed (zero rows padding the
  last one, which leave its amax alone), quantized by jaxfuse.quantize's 1 x 128 blocks
  (the xla reference, tested on its own) in one call; rows of no group are zero."""
  value = np.asarray(value, np.float32)
  m, columns = value.shape
  spans = [(first, min(end, first + BLOCK)) for start, end in group_rows(sizes, m)
           for first in range(start, end, BLOCK)]
  out = np.zeros((m, columns), np.float64)
  if not spans:
    return out
  blocks = np.zeros((len(spans), BLOCK, columns), np.float32)
  for index, (first, last) in enumerate(spans):
    blocks[index, :last - first] = value[first:last]
  quantize = jax.jit(lambda b: jaxfuse.quantize(jnp.swapaxes(b, 1, 2), recipe, role=role,
                                                implementation="xla"))
  q = helpers.on_cpu(quantize, jnp.asarray(blocks, jnp.bfloat16))
  assert q.scale_inv.shape == (len(spans), columns, 1)
  dequantized = np.swapaxes(helpers.as_f64(q.data) * helpers.as_f64(q.scale_inv), 1, 2)
  for index, (first, last) in enumerate(spans):
    out[first:last] = dequantized[index, :last - first]
  return out


@pytest.mark.parametrize("recipe", [pytest.param(RECIPE, id="e4m3"),
                                    pytest.param(E5M2_GRADIENTS, id="e5m2")])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["uniform", "empty_groups", "sum_less_than_rows", "skewed"])
def test_grouped_linear_kernel_gradient(backend, case, recipe):
  """grouped_linear's dkernel with fp8_wgrad: x (E4M3) and the output gradient (the
  recipe's gradient format) in 128 x 1 blocks down each group's rows, against float64
  numpy on those values (quantized here by the reference of 1 x 128 blocks applied to
  each block transposed); dx unchanged (the blockwise dgrad, tested elsewhere)."""
  m, k, n = shapes(backend)
  m = min(m, 1000)
  sizes = sizes_cases(m)[case]
  x, kernel = make_inputs(68, m, k, n, len(sizes), jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(69), (m, n), jnp.bfloat16)
  x, kernel, d_out, group_sizes = on(backend, x, kernel, d_out, jnp.asarray(sizes, jnp.int32))
  linear = lambda x, w: jaxfuse.grouped_linear(x, w, group_sizes, recipe=recipe,
                                               implementation="ffi")
  with columnwise.fused(everywhere=True):
    _, vjp = jax.vjp(linear, x, kernel)
    _, d_kernel = jax.jit(vjp)(d_out)
  assert d_kernel.dtype == jnp.bfloat16 and d_kernel.shape == kernel.shape
  exact, abs_sum = numpy_blockwise_wgrad(column_blocks_of(x, sizes, recipe, "forward"),
                                         column_blocks_of(d_out, sizes, recipe, "gradient"),
                                         sizes)
  assert_within_accumulation_bound(d_kernel, exact, abs_sum, case, FP8_ACCUMULATION)
  for g, (start, end) in enumerate(group_rows(sizes, m)):
    if start == end:
      assert not np.asarray(d_kernel[g], np.float32).any(), f"dkernel[{g}] of an empty group"


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_wgrad_accuracy_against_the_bf16_op(backend):
  """E4M3 in 128 x 1 blocks for both operands: a few percent relative (Frobenius) error
  against the 16-bit weight gradient."""
  m, k, n = (300, 64, 48) if backend == "cpu" else (4096, 1024, 1024)
  sizes = sizes_cases(m)["empty_groups"]
  x, kernel = make_inputs(70, m, k, n, len(sizes), jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(71), (m, n), jnp.bfloat16)
  x, kernel, d_out, group_sizes = on(backend, x, kernel, d_out, jnp.asarray(sizes, jnp.int32))
  grads = {}
  for name, recipe in (("fp8", RECIPE), ("16-bit", WGRAD16)):
    linear = lambda x, w, recipe=recipe: jaxfuse.grouped_linear(
        x, w, group_sizes, recipe=recipe, implementation="ffi")
    with columnwise.fused(everywhere=True):
      _, vjp = jax.vjp(linear, x, kernel)
      grads[name] = jax.jit(vjp)(d_out)
  np.testing.assert_array_equal(np.asarray(grads["fp8"][0], np.float32),
                                np.asarray(grads["16-bit"][0], np.float32))
  error = relative_error(grads["fp8"][1], grads["16-bit"][1])
  assert 1e-3 < error < 0.06, error  # FP8 rounding is there, and small


def _grad_jaxpr(recipe, *, fused: bool):
  x, kernel = make_inputs(72, 64, 128, 128, 4, jnp.bfloat16)
  group_sizes = jnp.asarray([16, 0, 40, 8], jnp.int32)
  loss = lambda x, w: jnp.sum(jaxfuse.grouped_linear(x, w, group_sizes, recipe=recipe,
                                                     implementation="ffi")
                              .astype(jnp.float32))
  with columnwise.fused(fused, everywhere=fused):
    return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, kernel)


@pytest.mark.parametrize("recipe, fused, fp8", [
    pytest.param(RECIPE, True, True, id="fp8-wgrad"),
    pytest.param(RECIPE, False, False, id="partitionable-16-bit"),
    pytest.param(WGRAD16, True, False, id="fp8_wgrad=False"),
])
def test_what_runs(recipe, fused, fp8):
  """The FP8 wgrad: two column-wise block quantizations (x, dy) and the blockwise wgrad
  kernel, no 16-bit grouped GEMM, offsets computed once; where partitioning may follow
  (fusion disabled) or with fp8_wgrad=False, the 16-bit wgrad and no column-wise copy."""
  jaxpr = _grad_jaxpr(recipe, fused=fused)
  count = lambda target: helpers.count_primitives(jaxpr, helpers.ffi_target(target))
  assert helpers.count_primitives(
      jaxpr, lambda e: e.primitive.name == "cumsum" or
      helpers.ffi_target("jaxfuse_group_offsets")(e)) == 1
  # One call per platform branch (cpu, cuda) of each GEMM.
  assert count("jaxfuse_grouped_gemm_fp8_blockwise_wgrad") == (2 if fp8 else 0)
  assert count("jaxfuse_quantize_columnwise_blocks") == (2 if fp8 else 0)
  assert count("jaxfuse_grouped_gemm") == (0 if fp8 else 2)
  assert count("jaxfuse_grouped_gemm_fp8_blockwise") == 4  # forward and dgrad


def test_handler_errors():
  """Scales of the wrong shape or dtype, a per-group scale vector, copies of the wrong
  width: clear errors naming the argument."""
  m, k, n, groups = 300, 32, 48, 3
  offsets = jaxfuse.group_offsets(jnp.asarray([100, 0, 150], jnp.int32))
  width = quantize_ffi.columnwise_width(m, groups)
  x_t = jnp.zeros((k, width), jnp.float8_e4m3fn)
  dy_t = jnp.zeros((n, width), jnp.float8_e4m3fn)
  good_x_s = jnp.ones((scale_rows(m, groups), k), jnp.float32)
  good_dy_s = jnp.ones((scale_rows(m, groups), n), jnp.float32)
  cases = [
      ((x_t, dy_t, offsets, good_x_s[:-1], good_dy_s), r"a_scale_inv must be float32"),
      ((x_t, dy_t, offsets, good_x_s, good_dy_s[:, :-1]), r"b_scale_inv must be float32"),
      ((x_t, dy_t, offsets, good_x_s.astype(jnp.bfloat16), good_dy_s),
       r"a_scale_inv must be float32"),
      ((x_t, dy_t, offsets, jnp.ones((groups,), jnp.float32), good_dy_s),
       r"a_scale_inv must be float32"),
      ((x_t[:, :-16], dy_t, offsets, good_x_s, good_dy_s), r"column-wise copies"),
      ((x_t.astype(jnp.float8_e5m2), dy_t, offsets, good_x_s, good_dy_s),
       r"a \(x\^T\) must be float8_e4m3fn"),
  ]
  for args, match in cases:
    with pytest.raises(Exception, match=match):
      jax.block_until_ready(blockwise_wgrad_call(*on("cpu", *args), rows=m))


@pytest.mark.gpu
def test_graph_replay_after_the_sizes_change_on_the_device(tmp_path):
  """The blockwise wgrad inside a CUDA graph (XLA command buffers on), replayed after the
  group sizes changed on the device: each replay matches float64 numpy for its sizes."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import textwrap  # pylint: disable=g-import-not-at-top
  script = tmp_path / "replay.py"
  script.write_text(textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np
      import jaxfuse
      from jaxfuse._src.ops.grouped_linear import ffi as gemm_ffi
      from tests.ops.test_grouped_linear_fp8 import (FP8_ACCUMULATION,
          assert_within_accumulation_bound, random_fp8)
      from tests.ops.test_grouped_linear_fp8_blockwise_wgrad import (dequantized_rows,
          numpy_blockwise_wgrad, wgrad_kernel_operands)
      m, k, n = 1024, 256, 272
      step = jax.jit(lambda *a: gemm_ffi.fp8_blockwise_wgrad_columnwise(*a, rows=m))
      x = random_fp8(80, (m, k), jnp.float8_e4m3fn)
      dy = random_fp8(81, (m, n), jnp.float8_e4m3fn)
      for sizes in ([300, 0, 500, 224], [0, 129, 128, 700], [1024, 0, 0, 0]):
        x_t, dy_t, offsets, x_s, dy_s = wgrad_kernel_operands(x, dy, sizes, 82)
        for _ in range(3):
          dw = step(x_t, dy_t, offsets, x_s, dy_s)
        exact, abs_sum = numpy_blockwise_wgrad(dequantized_rows(x, x_s, sizes),
                                               dequantized_rows(dy, dy_s, sizes), sizes)
        assert_within_accumulation_bound(dw, exact, abs_sum, str(sizes), FP8_ACCUMULATION)
      print("ok")
      """))
  env = dict(os.environ, XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
             "--xla_gpu_graph_min_graph_size=1")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=root)
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


_MAINLOOP_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jaxfuse._src.ops.grouped_linear import ffi as gemm_ffi
from tests.ops.test_grouped_linear_fp8 import random_fp8
from tests.ops.test_grouped_linear_fp8_blockwise_wgrad import wgrad_kernel_operands
m, k, n = 1024, 256, 272
step = jax.jit(lambda *a: gemm_ffi.fp8_blockwise_wgrad_columnwise(*a, rows=m))
x = random_fp8(94, (m, k), jnp.float8_e4m3fn)
dy = random_fp8(95, (m, n), jnp.float8_e5m2)
results = []
for sizes in ([300, 0, 500, 224], [1024, 0, 0, 0], [129, 1, 127, 640]):
  results.append(np.asarray(step(*wgrad_kernel_operands(x, dy, sizes, 96)), np.float32))
np.save(sys.argv[1], np.stack(results))  # [size set, G, k, n]
"""


@pytest.mark.gpu
def test_pipelined_mainloop_is_bitwise_the_stock_one(tmp_path):
  """The wgrad's two mainloops (fp8_blockwise_pipelined_promotion.cuh, the default, which
  reads the column scales from shared memory as it promotes, and CUTLASS's,
  JAXFUSE_GROUPED_GEMM_FP8_MAINLOOP=stock) give the same bits: E4M3 x E5M2, groups of 0 to
  8 row blocks (the wgrad's k-tiles), partial blocks, an empty group."""
  results = helpers.outputs_under_environments(
      _MAINLOOP_SCRIPT, tmp_path,
      {mainloop: {"JAXFUSE_GROUPED_GEMM_FP8_MAINLOOP": mainloop}
       for mainloop in ("stock", "pipelined")})
  stock, pipelined = results["stock"], results["pipelined"]
  assert stock.shape == (3, 4, 256, 272)
  for index in range(len(stock)):
    assert np.abs(stock[index]).max() > 0, index  # the groups produced something to compare
    np.testing.assert_array_equal(pipelined[index], stock[index], err_msg=str(index))


@pytest.mark.gpu
@pytest.mark.sanitize
def test_hostile_group_sizes_stay_in_bounds_in_the_fp8_wgrad():
  """Run under compute-sanitizer (scripts/gpu_run.sh sanitize): sizes far past the rows,
  negative, all zero, one past M: the column-wise block quantizations and the blockwise
  wgrad (scale loads included) stay in bounds; the weight gradient is finite and zero for
  the groups left empty by clamping."""
  m, k, n = 384, 160, 144
  x, kernel = make_inputs(90, m, k, n, 4, jnp.bfloat16)
  d_out = helpers.random_array(np.random.default_rng(91), (m, n), jnp.bfloat16)
  for sizes in ([2**30, 2**30, 5, 7], [-2**31, 300, -7, 2**31 - 1], [0, 0, 0, 0],
                [m + 1, 0, 0, 0], [129, 1, 127, 127]):
    group_sizes = jnp.asarray(sizes, jnp.int32)
    with columnwise.fused(everywhere=True):
      _, vjp = jax.vjp(lambda x, w: jaxfuse.grouped_linear(
          x, w, group_sizes, recipe=RECIPE, implementation="ffi"), x, kernel)
      _, d_kernel = jax.jit(vjp)(d_out)
    d_kernel = np.asarray(d_kernel, np.float32)
    assert np.isfinite(d_kernel).all(), sizes
    clamped = np.maximum.accumulate(np.clip(np.cumsum([0] + [max(s, 0) for s in sizes]),
                                            0, m))
    for g in range(4):
      if clamped[g] == clamped[g + 1]:
        assert not d_kernel[g].any(), f"{sizes}: dkernel[{g}] of an empty group"
