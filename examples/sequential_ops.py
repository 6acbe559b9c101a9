"""A model written as a sequence of basic ops; jaxfuse's fuser swaps windows for fused ops.

The block below is a pre-norm residual MLP written TransformerEngine-style as basic ops:

    AddExtraInput("residual") -> RMSNorm       fused: add_rms_norm (new residual = extra output)
    Linear(HIDDEN) -> ConstantScale(0.5)       fused: linear_scale (alpha in every GEMM epilogue)
    Linear(WIDTH) -> ConstantScale(alpha) -> AddExtraInput("residual2", in_place=True)
                                               fused: linear_scale_add (GEMM accumulates into
                                               the residual; BackwardLinearScale in backward)

It prints the fusion plan, checks the fused model against the same ops run unfused
(``fuse=False``), then trains a few optax steps on CPU (C++ FFI handlers; cuBLASLt on GPU).

    python examples/sequential_ops.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfuse import ops

WIDTH, HIDDEN, BATCH = 64, 128, 256
ALPHA = 0.5


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


if __name__ == "__main__":
  main()
