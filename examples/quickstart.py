"""jaxfuse quick start: a residual MLP whose projections accumulate into the residual.

Each block computes ``h = h + alpha * (gelu(h @ w_in) @ w_out)`` with
``jaxfuse.linear_scale_add``: one GEMM that adds its scaled product straight into the
residual buffer (in place under jit with donation), with a custom_vjp whose backward GEMMs
carry alpha in their epilogue. It trains for a few steps with optax and checks the fused
op against the pure-jnp reference. Runs on CPU (C++ FFI handlers) and on GPU (cuBLASLt).

    python examples/quickstart.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfuse

WIDTH, HIDDEN, DEPTH, BATCH = 256, 512, 4, 512
ALPHA = 1.0 / DEPTH  # scaled residual branches


def init(key):
  params = []
  for layer_key in jax.random.split(key, DEPTH):
    k_in, k_out = jax.random.split(layer_key)
    params.append({
        "w_in": jax.random.normal(k_in, (WIDTH, HIDDEN)) / np.sqrt(WIDTH),
        "w_out": jax.random.normal(k_out, (HIDDEN, WIDTH)) / np.sqrt(HIDDEN),
    })
  return params


def forward(params, x, implementation):
  h = x
  for layer in params:
    hidden = jax.nn.gelu(h @ layer["w_in"].astype(h.dtype))
    h = jaxfuse.linear_scale_add(hidden, layer["w_out"].astype(h.dtype), h, ALPHA,
                                 implementation=implementation)
  return h


def main():
  implementation = "ffi"
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; "
        f"jaxfuse built for {jaxfuse.build_info()['platforms']}")
  key_params, key_data, key_target = jax.random.split(jax.random.key(0), 3)
  params = init(key_params)
  x = jax.random.normal(key_data, (BATCH, WIDTH), jnp.bfloat16)
  target_map = jax.random.normal(key_target, (WIDTH, WIDTH)) / np.sqrt(WIDTH)
  y = jnp.tanh(x.astype(jnp.float32) @ target_map)

  # The fused op and the reference agree.
  fused = forward(params, x, implementation)
  reference = forward(params, x, "xla")
  error = float(jnp.max(jnp.abs(fused.astype(jnp.float32) - reference.astype(jnp.float32))))
  print(f"max |fused - reference| = {error:.3g} (bf16)")
  assert error < 0.1, error

  optimizer = optax.adam(3e-3)
  opt_state = optimizer.init(params)

  @jax.jit
  def train_step(params, opt_state):
    def loss_fn(params):
      out = forward(params, x, implementation).astype(jnp.float32)
      return jnp.mean((out - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  start = time.perf_counter()
  for step in range(30):
    params, opt_state, loss = train_step(params, opt_state)
    losses.append(float(loss))
    if step % 10 == 0:
      print(f"step {step:3d}  loss {losses[-1]:.4f}")
  elapsed = time.perf_counter() - start
  print(f"step {len(losses) - 1:3d}  loss {losses[-1]:.4f}  ({len(losses) / elapsed:.1f} steps/s)")
  assert losses[-1] < losses[0], "loss did not go down"


if __name__ == "__main__":
  main()
