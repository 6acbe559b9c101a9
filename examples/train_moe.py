"""Train a small mixture-of-experts transformer language model with jaxfuse.

A character-level (byte) language model on real text: the Python standard library's own
source files, read from the running interpreter (a few MB, deterministic order). Each
block is pre-norm causal self-attention followed by a drop-less MoE MLP,
``jaxfuse.flax.linen.MoE``: an fp32 top-k router, a fused token permutation, the experts
as one ``jaxfuse.grouped_mlp`` (grouped GEMM -> scaled SwiGLU -> grouped GEMM, one
custom_vjp whose backward pass reuses the forward's group offsets), and the fused
unpermute. The router's load-balancing loss is added to the training loss.

    python examples/train_moe.py                       # CPU-sized default, ~1 minute
    python examples/train_moe.py --preset gpu          # bigger model, on an NVIDIA GPU
    python examples/train_moe.py --steps 50 --implementation xla
    python examples/train_moe.py --fp8-inference       # also evaluate with FP8 experts
                                                       # (per-group and blockwise scaling)
    python examples/train_moe.py --fp8                 # train with FP8 experts

The loss is printed every --log-every steps with the training throughput in tokens/s
(measured after the first, compiling, step).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfuse
from jaxfuse._src import implementation as implementation_lib
from jaxfuse.flax import linen as jf_linen


@dataclasses.dataclass(frozen=True)
class Config:
  d_model: int
  layers: int
  heads: int
  experts: int
  top_k: int
  ffn: int            # hidden size of one expert
  seq_len: int
  batch: int
  steps: int
  learning_rate: float
  aux_loss_coefficient: float = 0.01
  vocab: int = 256    # bytes


PRESETS = {
    # ~1 minute on a 2-core CPU (jaxfuse's reference implementation).
    "cpu": Config(d_model=64, layers=2, heads=4, experts=4, top_k=2, ffn=64, seq_len=64,
                  batch=16, steps=250, learning_rate=3e-3),
    # One H100/H200: ~40M parameters, 16k tokens per step.
    "gpu": Config(d_model=512, layers=4, heads=8, experts=8, top_k=2, ffn=1024, seq_len=512,
                  batch=32, steps=600, learning_rate=1e-3),
}


# --- data -------------------------------------------------------------------------------

def stdlib_text(max_bytes: int) -> np.ndarray:
  """The *.py files of Python's standard library, sorted by path, as uint8 bytes."""
  root = os.path.dirname(os.__file__)
  chunks, total = [], 0
  for directory, subdirs, files in os.walk(root):
    subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "__pycache__"))
    for name in sorted(files):
      if not name.endswith(".py"):
        continue
      with open(os.path.join(directory, name), "rb") as f:
        data = f.read()
      chunks.append(data)
      total += len(data)
      if total >= max_bytes:
        return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)
  return np.frombuffer(b"".join(chunks), np.uint8)


def batches(data: np.ndarray, batch: int, seq_len: int, seed: int):
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - seq_len - 1, batch)
    window = np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)
    yield window[:, :-1], window[:, 1:]


# --- model ------------------------------------------------------------------------------

class RMSNorm(nn.Module):
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps) * scale


class Attention(nn.Module):
  heads: int
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    batch, length, width = x.shape
    head_dim = width // self.heads
    qkv = nn.Dense(3 * width, use_bias=False, dtype=self.dtype, name="qkv")(x)
    q, k, v = jnp.split(qkv.reshape(batch, length, 3, self.heads, head_dim), 3, axis=2)
    q, k, v = (t[:, :, 0] for t in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((length, length), bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1).astype(self.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, width)
    return nn.Dense(width, use_bias=False, dtype=self.dtype, name="out")(out)


class Block(nn.Module):
  config: Config
  dtype: jnp.dtype
  implementation: str
  recipe: Any = None  # an FP8 recipe for the experts (--fp8, the --fp8-inference evaluation)

  @nn.compact
  def __call__(self, x):
    c = self.config
    x = x + Attention(c.heads, self.dtype)(RMSNorm()(x)).astype(jnp.float32)
    moe = jf_linen.MoE(num_experts=c.experts, ffn_features=c.ffn, top_k=c.top_k,
                       activation="swiglu", dtype=self.dtype, recipe=self.recipe,
                       implementation=self.implementation)
    y, aux_loss = moe(RMSNorm()(x).astype(self.dtype))
    return x + y.astype(jnp.float32), aux_loss


class MoETransformer(nn.Module):
  config: Config
  dtype: jnp.dtype
  implementation: str
  recipe: Any = None

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    embed = nn.Embed(c.vocab, c.d_model, embedding_init=nn.initializers.normal(0.02))
    position = self.param("position", nn.initializers.normal(0.02), (c.seq_len, c.d_model))
    x = embed(tokens) + position[: tokens.shape[1]]
    aux_losses = []
    for _ in range(c.layers):
      x, aux = Block(c, self.dtype, self.implementation, self.recipe)(x)
      aux_losses.append(aux)
    logits = embed.attend(RMSNorm()(x))  # tied input / output embedding, fp32
    return logits, jnp.mean(jnp.stack(aux_losses))


# --- training ---------------------------------------------------------------------------

def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                      help="model size (default: gpu on a GPU, cpu otherwise)")
  parser.add_argument("--steps", type=int, default=None, help="training steps")
  parser.add_argument("--log-every", type=int, default=None, help="print the loss every N steps")
  parser.add_argument("--implementation", choices=["ffi", "xla"], default=None,
                      help="jaxfuse implementation (default: ffi on GPU, xla on CPU)")
  parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                      help="compute dtype (default: bfloat16 with ffi, float32 with xla)")
  parser.add_argument("--data-mb", type=float, default=4.0, help="text to read, in MB")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--fp8", action="store_true",
                      help="train with the experts' GEMMs in FP8: per-expert current scaling "
                           "(Float8CurrentScaling(per_group=True): E4M3 activations and "
                           "weights, E5M2 gradients, FP8 weight gradients)")
  parser.add_argument("--fp8-inference", action="store_true",
                      help="after training, also evaluate with the experts in FP8 on weights "
                           "quantized once (jaxfuse.flax.linen.quantize_expert_params)")
  args = parser.parse_args()

  on_gpu = jax.default_backend() == "gpu"
  config = PRESETS[args.preset or ("gpu" if on_gpu else "cpu")]
  if args.steps is not None:
    config = dataclasses.replace(config, steps=args.steps)
  implementation = implementation_lib.resolve(args.implementation)
  dtype = jnp.dtype(args.dtype or ("bfloat16" if implementation == "ffi" else "float32"))
  log_every = args.log_every or max(1, config.steps // 10)

  data = stdlib_text(int(args.data_mb * 2**20))
  split = int(0.95 * len(data))
  train, valid = data[:split], data[split:]
  print(f"jaxfuse {jaxfuse.__version__} on {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), implementation={implementation}, dtype={dtype.name}")
  print(f"data: {len(data) / 2**20:.1f} MB of Python standard library source; {config}")

  recipe = jaxfuse.quantization.Float8CurrentScaling(per_group=True) if args.fp8 else None
  model = MoETransformer(config, dtype, implementation, recipe)
  tokens, _ = next(batches(train, config.batch, config.seq_len, args.seed))
  params = model.init(jax.random.key(args.seed), jnp.asarray(tokens))["params"]
  count = sum(p.size for p in jax.tree.leaves(params))
  print(f"parameters: {count / 1e6:.2f} M ({config.experts} experts, top-{config.top_k}; "
        f"experts in {'FP8' if recipe else dtype.name})")

  schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate,
                                                max(1, config.steps // 20), config.steps)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(schedule, weight_decay=0.01))
  opt_state = optimizer.init(params)

  def loss_fn(params, tokens, targets):
    logits, aux_loss = model.apply({"params": params}, tokens)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return ce + config.aux_loss_coefficient * aux_loss, (ce, aux_loss)

  @jax.jit
  def train_step(params, opt_state, tokens, targets):
    (_, (ce, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, ce, aux

  @jax.jit
  def eval_loss(params, tokens, targets):
    return loss_fn(params, tokens, targets)[1][0]

  stream = batches(train, config.batch, config.seq_len, args.seed + 1)
  tokens_per_step = config.batch * config.seq_len
  start = time.perf_counter()
  timed_since, timed_steps = None, 0
  for step in range(1, config.steps + 1):
    tokens, targets = next(stream)
    params, opt_state, ce, aux = train_step(params, opt_state, tokens, targets)
    if step == 1:
      ce.block_until_ready()
      print(f"step 1: first step (compilation included) took {time.perf_counter() - start:.1f} s")
      timed_since, timed_steps = time.perf_counter(), 0
      continue
    timed_steps += 1
    if step % log_every == 0 or step == config.steps:
      ce = float(ce)  # waits for the step
      elapsed = time.perf_counter() - timed_since
      print(f"step {step:5d}  loss {ce:.4f}  ({ce / np.log(2):.3f} bits/byte)  "
            f"aux {float(aux):.3f}  {timed_steps * tokens_per_step / elapsed:,.0f} tokens/s")
  valid_batches = list(itertools.islice(
      batches(valid, config.batch, config.seq_len, args.seed + 2), 4))
  losses = [float(eval_loss(params, *batch)) for batch in valid_batches]
  print(f"validation loss {np.mean(losses):.4f} nats ({np.mean(losses) / np.log(2):.3f} "
        f"bits/byte; a uniform guess over bytes is {np.log(256):.3f} nats, 8 bits/byte)")
  if args.fp8_inference:
    fp8_inference(config, dtype, implementation, params, valid_batches, np.mean(losses))


def fp8_inference(config, dtype, implementation, params, valid_batches, loss_16bit):
  """The validation loss with every expert GEMM in FP8, the expert weights quantized once,
  under both FP8 recipes (per-group current scaling; DeepSeek-V3's 1 x 128 / 128 x 128
  blocks): how much FP8 inference costs this model."""
  recipes = {"FP8": jaxfuse.quantization.Float8CurrentScaling(per_group=True),
             "blockwise FP8": jaxfuse.quantization.Float8BlockScaling()}
  for name, recipe in recipes.items():
    model = MoETransformer(config, dtype, implementation, recipe)
    fp8_params = jf_linen.quantize_expert_params(params, recipe, dtype=dtype)

    @jax.jit
    def fp8_eval_loss(params, tokens, targets, model=model):
      logits, _ = model.apply({"params": params}, tokens)
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    losses = [float(fp8_eval_loss(fp8_params, *batch)) for batch in valid_batches]
    print(f"validation loss with {name} experts (weights quantized once): "
          f"{np.mean(losses):.4f} nats ({np.mean(losses) - loss_16bit:+.4f} against "
          f"{dtype.name})")


if __name__ == "__main__":
  main()
