"""A model written as a sequence of basic ops; jaxfuse's fuser swaps windows for fused ops.

The block below is a pre-norm residual MLP written TransformerEngine-style as basic ops:

    AddExtraInput("residual") -> RMSNorm       fused: add_rms_norm (new residual = extra output)
    Linear(HIDDEN) -> ConstantScale(0.5)       fused: linear_scale (alpha in every GEMM epilogue)
    Linear(WIDTH) -> ConstantScale(alpha) -> AddExtraInput("residual2", in_place=True)
                                               fused: linear_scale_add (GEMM accumulates into
                                               the residual; BackwardLinearScale in backward)

It prints the fusion plan, checks the fused model against the same ops run unfused
(``fuse=False``), then trains a few optax steps on CPU (C++ FFI handlers; cuBLASLt on GPU).

A second, MoE-style block shows the FP8 hand-off between an expert MLP's activation and its
second grouped GEMM:

    ScaledActivation("swiglu") -> Quantize(FP8) -> GroupedLinear(recipe=FP8)
                                               fused: ScaledActivationQuantizeGroupedLinearFP8
                                               (activation + per-group E4M3 quantization in
                                               one kernel, its FP8 output fed as it is to
                                               the FP8 grouped GEMM; FP8 dgrad + fused dact)

    python examples/sequential_ops.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfuse import ops
from jaxfuse.quantization import Float8CurrentScaling

WIDTH, HIDDEN, BATCH = 64, 128, 256
ALPHA = 0.5
EXPERTS = 4
FP8 = Float8CurrentScaling(per_group=True)  # one scale per expert's rows / per expert


def make_model(fuse: bool = True) -> ops.Sequential:
  return ops.Sequential(
      ops.AddExtraInput("residual"),
      ops.RMSNorm(1e-6),
      ops.Linear(HIDDEN, tensor_parallel="column"),
      ops.ConstantScale(0.5),
      ops.Linear(WIDTH, tensor_parallel="row"),  # row parallel: LinearScaleAdd is refused
      ops.ConstantScale(ALPHA),
      ops.AddExtraInput("residual2", in_place=True),
      fuse=fuse, implementation="ffi", return_extra=True)


def main():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((BATCH, WIDTH)), jnp.float32)
  residual = jnp.asarray(rng.standard_normal((BATCH, WIDTH)), jnp.float32)
  target = jnp.asarray(rng.standard_normal((BATCH, WIDTH)), jnp.float32)
  extras = dict(residual=residual, residual2=residual)

  model, reference = make_model(), make_model(fuse=False)
  print("fusions:", model.fusions(x, **extras))
  print("why not:", [row for row in model.explain(x, **extras) if row[2]])

  # A column-parallel second linear instead: now the linear + scale + in-place add fuse.
  column = model.clone(ops=model.ops[:4] + (ops.Linear(WIDTH),) + model.ops[5:])
  print("fusions (no row parallelism):", column.fusions(x, **extras))
  model = column
  reference = column.clone(fuse=False)

  params = model.init(jax.random.key(0), x, **extras)
  y, extra = model.apply(params, x, **extras)
  y_ref, extra_ref = reference.apply(params, x, **extras)
  print(f"max |fused - unfused|: y {float(jnp.abs(y - y_ref).max()):.2e}, new residual "
        f"{float(jnp.abs(extra['residual'] - extra_ref['residual']).max()):.2e}")

  def loss(params, module):
    y, _ = module.apply(params, x, **extras)
    return jnp.mean((y - target) ** 2)

  optimizer = optax.adam(1e-2)

  @jax.jit
  def step(params, opt_state):
    value, grads = jax.value_and_grad(loss)(params, model)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  opt_state = optimizer.init(params)
  start = time.perf_counter()
  for i in range(10):
    params, opt_state, value = step(params, opt_state)
    if i % 3 == 0 or i == 9:
      print(f"step {i}: loss {float(value):.4f}")
  print(f"10 steps in {time.perf_counter() - start:.2f} s; final loss fused "
        f"{float(loss(params, model)):.5f}, unfused {float(loss(params, reference)):.5f}")



def moe_fp8():
  """The second half of an expert MLP in FP8: [routed tokens, 2 * HIDDEN] -> [tokens, WIDTH]."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((BATCH, 2 * HIDDEN)), jnp.bfloat16)  # FC1's output
  scales = jnp.asarray(rng.uniform(0.2, 1.0, BATCH), jnp.float32)  # router probabilities
  group_sizes = jnp.asarray(rng.multinomial(BATCH - 16, np.ones(EXPERTS) / EXPERTS), jnp.int32)
  extras = dict(scales=scales, group_sizes=group_sizes)
  block = ops.Sequential(ops.ScaledActivation("swiglu"), ops.Quantize(FP8),
                         ops.GroupedLinear(EXPERTS, WIDTH, recipe=FP8), implementation="ffi")
  print("MoE FP8 fusions:", block.fusions(x, **extras))
  bf16 = block.clone(ops=block.ops[:2] + (ops.GroupedLinear(EXPERTS, WIDTH),))
  print("  with a 16-bit GroupedLinear:", bf16.fusions(x, **extras))
  params = block.init(jax.random.key(1), x, **extras)
  unfused = block.clone(fuse=False)
  loss = lambda module: lambda p, x: jnp.sum(module.apply(p, x, **extras).astype(jnp.float32) ** 2)
  (y, (dp, dx)) = (block.apply(params, x, **extras),
                   jax.jit(jax.grad(loss(block), argnums=(0, 1)))(params, x))
  (y_ref, (dp_ref, dx_ref)) = (unfused.apply(params, x, **extras),
                               jax.jit(jax.grad(loss(unfused), argnums=(0, 1)))(params, x))
  rel = lambda a, b: float(jnp.linalg.norm((a.astype(jnp.float32) - b.astype(jnp.float32)))
                           / jnp.linalg.norm(b.astype(jnp.float32)))
  dk, dk_ref = (jax.tree.leaves(t)[0] for t in (dp, dp_ref))
  print(f"  fused vs unfused FP8 (relative): y {rel(y, y_ref):.1e}, dx {rel(dx, dx_ref):.1e}, "
        f"dkernel {rel(dk, dk_ref):.1e}")
  y_bf16 = bf16.clone(fuse=False).apply(params, x, **extras)
  print(f"  FP8 vs 16-bit GEMM (relative): y {rel(y, y_bf16):.1e}")


if __name__ == "__main__":
  main()
  moe_fp8()
