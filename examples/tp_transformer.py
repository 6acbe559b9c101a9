"""A tensor-parallel, sequence-parallel transformer with jax.shard_map and jaxfuse.parallel.

Megatron-style: vocab-parallel embedding (reduce-scatter into sequence shards), blocks
with column-parallel QKV / up-gate and row-parallel out / down projections whose
reduce-scatter, residual add, RMSNorm and all-gather form one fused tail
(``jaxfuse.parallel.row_parallel_residual_rms_norm``), and a column-parallel LM head whose
logits are gathered over the vocabulary (``gather_last_dim``).

It trains a few optax steps on a toy next-token task (loss printed), then runs a decode
step with the all-reduce variant (replicated activations, no sequence parallelism) and
checks that its last-position logits equal the sequence-parallel forward's.

Runs on all GPUs when present, else on 8 CPU devices (set below, before jax starts):

    python examples/tp_transformer.py [--steps 8]
"""

from __future__ import annotations

import argparse
import glob
import os
import time

if not glob.glob("/dev/nvidia[0-9]*"):  # no GPU: simulate 8 devices on the host
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from jaxfuse import parallel  # noqa: E402
from jaxfuse.parallel import block as tp_block  # noqa: E402

AXIS = "tp"
VOCAB, HIDDEN, HEADS, HEAD_DIM, MLP, LAYERS = 64, 64, 8, 8, 128, 2
SEQ, BATCH = 32, 4
EPS = 1e-6


def init_params(key):
  """Global parameters; `param_specs` says how each is sharded over the tp axis."""
  shapes = tp_block.global_param_shapes(HIDDEN, HEADS, HEAD_DIM, MLP)
  keys = iter(jax.random.split(key, 3 + LAYERS * len(shapes)))
  blocks = []
  for _ in range(LAYERS):
    blocks.append({name: (jnp.ones(shape) if name.endswith("_norm")
                          else 0.05 * jax.random.normal(next(keys), shape))
                   for name, shape in shapes.items()})
  return {"embedding": 0.5 * jax.random.normal(next(keys), (VOCAB, HIDDEN)),
          "blocks": blocks,
          "final_norm": jnp.ones((HIDDEN,)),
          "lm_head": 0.05 * jax.random.normal(next(keys), (HIDDEN, VOCAB))}


def param_specs():
  return {"embedding": P(AXIS, None),            # vocab-parallel rows
          "blocks": [tp_block.param_specs(AXIS) for _ in range(LAYERS)],
          "final_norm": P(),
          "lm_head": P(None, AXIS)}              # vocab-parallel columns


def embed_partial(embedding_shard, tokens):
  """This device's part of the embedding lookup: rows it owns, zeros elsewhere."""
  rows = embedding_shard.shape[0]
  local = tokens - jax.lax.axis_index(AXIS) * rows
  mine = (local >= 0) & (local < rows)
  vectors = embedding_shard[jnp.clip(local, 0, rows - 1)]
  return jnp.where(mine[..., None], vectors, 0.0)


def forward(params, tokens, *, sequence_parallel: bool):
  """Per-device forward: tokens [S, B] (replicated) -> gathered logits [S, B, V]."""
  partial = embed_partial(params["embedding"], tokens)
  if sequence_parallel:
    x = parallel.reduce_scatter_to_sequence_parallel(partial, axis_name=AXIS)  # [S/tp, B, H]
  else:
    x = jax.lax.psum(partial, AXIS)                                            # [S, B, H]
  for block_params in params["blocks"]:
    x = tp_block.transformer_block(block_params, x, axis_name=AXIS, head_dim=HEAD_DIM,
                                   eps=EPS, sequence_parallel=sequence_parallel,
                                   inference=not sequence_parallel)
  logits_shard = parallel.rms_norm_column_parallel_linear(
      x, params["final_norm"], params["lm_head"], axis_name=AXIS, eps=EPS,
      gather_input=sequence_parallel, inference=not sequence_parallel)  # [S, B, V/tp]
  return parallel.gather_last_dim(logits_shard, axis_name=AXIS)        # [S, B, V]


def make_loss(mesh):
  def per_device(params, tokens, targets):
    logits = forward(params, tokens, sequence_parallel=True)
    # Each device scores its own sequence chunk; the psum makes the mean.
    tp = parallel.tensor_parallel_size(AXIS)
    chunk = SEQ // tp
    start = jax.lax.axis_index(AXIS) * chunk
    logits = jax.lax.dynamic_slice_in_dim(logits, start, chunk, axis=0)
    targets = jax.lax.dynamic_slice_in_dim(targets, start, chunk, axis=0)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jax.lax.psum(jnp.sum(losses), AXIS) / (SEQ * BATCH)

  return jax.shard_map(per_device, mesh=mesh, in_specs=(param_specs(), P(), P()),
                       out_specs=P())


def make_decode(mesh):
  def per_device(params, tokens):
    logits = forward(params, tokens, sequence_parallel=False)
    return logits[-1][None]  # identical on every device; stacked for the out_spec

  decode = jax.shard_map(per_device, mesh=mesh, in_specs=(param_specs(), P()),
                         out_specs=P(AXIS))
  return jax.jit(lambda params, tokens: decode(params, tokens)[0])


def make_prefill_logits(mesh):
  def per_device(params, tokens):
    return forward(params, tokens, sequence_parallel=True)[-1][None]

  prefill = jax.shard_map(per_device, mesh=mesh, in_specs=(param_specs(), P()),
                          out_specs=P(AXIS))
  return jax.jit(lambda params, tokens: prefill(params, tokens)[0])


def toy_batch(key):
  """Sequences counting up modulo VOCAB from a random start: next token = token + 1."""
  starts = jax.random.randint(key, (1, BATCH), 0, VOCAB)
  tokens = (starts + jnp.arange(SEQ + 1)[:, None]) % VOCAB  # [S + 1, B], sequence first
  return tokens[:-1], tokens[1:]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=8)
  args = parser.parse_args()
  devices = jax.devices()
  tp = len(devices)
  assert SEQ % tp == 0 and HEADS % tp == 0 and VOCAB % tp == 0, f"tp={tp} does not divide"
  mesh = Mesh(np.array(devices), (AXIS,))
  print(f"{tp} x {devices[0].platform} devices, tensor parallel over {AXIS!r}")

  params = init_params(jax.random.key(0))
  optimizer = optax.adamw(3e-3)
  opt_state = optimizer.init(params)
  loss_fn = make_loss(mesh)

  @jax.jit
  def train_step(params, opt_state, tokens, targets):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  key = jax.random.key(1)
  start = time.perf_counter()
  losses = []
  for step in range(args.steps):
    key, batch_key = jax.random.split(key)
    tokens, targets = toy_batch(batch_key)
    params, opt_state, loss = train_step(params, opt_state, tokens, targets)
    losses.append(float(loss))
    print(f"step {step}: loss {losses[-1]:.4f}")
  print(f"trained {args.steps} steps in {time.perf_counter() - start:.1f} s "
        f"(loss {losses[0]:.3f} -> {losses[-1]:.3f})")

  # Decode: replicated activations, all-reduce instead of reduce-scatter.
  tokens, _ = toy_batch(jax.random.key(2))
  decode_logits = make_decode(mesh)(params, tokens)
  prefill_logits = make_prefill_logits(mesh)(params, tokens)
  gap = float(jnp.max(jnp.abs(decode_logits - prefill_logits)))
  print(f"decode (all-reduce) next tokens {np.asarray(jnp.argmax(decode_logits, -1))}, "
        f"expected {np.asarray((tokens[-1] + 1) % VOCAB)}; "
        f"max |decode - sequence-parallel| logits = {gap:.2e}")
  assert gap < 1e-3 * max(1.0, float(jnp.max(jnp.abs(prefill_logits)))), gap


if __name__ == "__main__":
  main()
