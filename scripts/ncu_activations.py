"""Scaled SwiGLU at T=65536, 2F=8192 bf16 (8 groups): the forward, its backward, the
forward fused with each FP8 recipe and the backward fused with per-group quantization, one
call each after a compile-only warm-up: a target for Nsight Compute on the GPU machine,
e.g. after `gpu_run.sh prebuilt` (the prebuilt extension sits in /tmp/jaxfuse-head, which
is not on sys.path by default):

    cd /tmp/jaxfuse-head && XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD \
        ncu --clock-control none -k regex:RowKernel --section SpeedOfLight \
        --section WarpStateStats python3 scripts/ncu_activations.py

Without XLA_PYTHON_CLIENT_PREALLOCATE=false, JAX's pool (75% of the GPU) is what ncu saves
and restores around every replay pass: one kernel then takes minutes. --launch-skip N
--launch-count M picks kernels by their order (one or two launches per op, printed below).

Each op runs once, so every kernel launch ncu reports belongs to one named op, in the order
printed. `--mlp` takes the FP8 grouped MLP's shapes instead (T=65536, H=F=2048: 2F=4096)
and adds the per-group quantization of a plain [T, 2048] input (FC1's x, FC2's dy), and
the three per-group passes again writing the FP8 wgrad's column-wise copies
(QuantizeColumnwiseKernel, as the grouped MLP runs them on one device).
"""

import sys

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse._src.ops.quantize import columnwise
from jaxfuse.quantization import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

MLP = "--mlp" in sys.argv[1:]
T, W, GROUPS = 65536, (4096 if MLP else 8192), 8
x = jax.random.normal(jax.random.key(0), (T, W), jnp.bfloat16)
dy = jax.random.normal(jax.random.key(1), (T, W // 2), jnp.bfloat16)
scales = jax.random.uniform(jax.random.key(2), (T,), jnp.float32, 0.1, 1.0)
offsets = jaxfuse.group_offsets(jnp.full((GROUPS,), T // GROUPS, jnp.int32))


def forward(x, s):
  return jaxfuse.scaled_activation(x, s, implementation="ffi")


def backward(dy, x, s):
  _, vjp = jax.vjp(forward, x, s)
  return vjp(dy)


def quantized(recipe):
  def run(x, s):
    q = jaxfuse.scaled_activation_quantize(x, s, group_offsets=offsets, recipe=recipe,
                                           implementation="ffi")
    return q.data, q.scale_inv
  return run


def dquantized(dy, x, s):
  q, _, ds = jaxfuse.scaled_dactivation_quantize(
      dy, x, s, group_offsets=offsets, recipe=Float8CurrentScaling(), implementation="ffi")
  return q.data, q.scale_inv, ds


ops = [("swiglu_fwd", forward, (x, scales)), ("swiglu_bwd", backward, (dy, x, scales)),
       ("quantize_block_1x128", quantized(Float8BlockScaling()), (x, scales)),
       ("quantize_mxfp8_1x32", quantized(MXFP8BlockScaling()), (x, scales)),
       ("quantize_current_per_group", quantized(Float8CurrentScaling()), (x, scales)),
       ("dquantize_current_per_group", dquantized, (dy, x, scales))]
if MLP:
  plain = jax.random.normal(jax.random.key(3), (T, W // 2), jnp.bfloat16)

  def quantize_plain(x):
    q = jaxfuse.quantize(x, Float8CurrentScaling(), group_offsets=offsets, implementation="ffi")
    return q.data, q.scale_inv

  ops.append(("quantize_plain_current_per_group", quantize_plain, (plain,)))
  # The same passes writing the FP8 wgrad's column-wise copies too (QuantizeColumnwiseKernel),
  # as the FP8 grouped MLP runs them on one device.
  recipe = Float8CurrentScaling()
  swiglu = dict(activation="swiglu", limit=7.0, alpha=1.702, linear_offset=1.0)

  def with_copy(fn, *args, **kwargs):
    return [a for a in fn(*args, recipe, copy=True, **kwargs) if a is not None]

  def act_copy(x, s):
    return with_copy(columnwise.scaled_activation_quantize, x, s, offsets, **swiglu)

  def dact_copy(dy, x, s):
    return with_copy(columnwise.scaled_dactivation_quantize, dy, x, s, offsets, **swiglu)

  def plain_copy(x):
    return with_copy(columnwise.quantize_rows, x, offsets=offsets, role="forward")

  ops += [("quantize_current_per_group_columnwise", act_copy, (x, scales)),
          ("dquantize_current_per_group_columnwise", dact_copy, (dy, x, scales)),
          ("quantize_plain_current_per_group_columnwise", plain_copy, (plain,))]
compiled = [(name, jax.jit(fn).lower(*args).compile(), args) for name, fn, args in ops]
for name, fn, args in compiled:
  print("op", name, flush=True)
  jax.block_until_ready(fn(*args))
print("done")
