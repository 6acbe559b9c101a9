"""Full MoE layer (router + permute + grouped MLP + unpermute), forward + backward, bf16:
jaxfuse.moe vs the same layer built from the references (argsort / scatter permutation,
jax.lax.ragged_dot experts, jnp SwiGLU, gather unpermute), in one process on one GPU, and
jaxfuse.moe with recipe=Float8CurrentScaling(per_group=True) (jaxfuse_fp8_*: the experts'
GEMMs in FP8, quantization included; same bf16 parameters and inputs), and the same on
expert weights quantized once, outside the timed calls (jaxfuse_fp8_quantized_kernels_*):
the forward on jaxfuse.quantize_experts copies (inference), the forward + backward on
trainable copies (quantize_experts(..., trainable=True): a micro-batch's step when the
weights are quantized once per optimizer step); jaxfuse_fp8_blockwise_* the same two with
recipe=Float8BlockScaling() (DeepSeek-V3's blocks); jaxfuse_fp8_permuted_* is jaxfuse_fp8
with the tokens permuted in 16 bits before the FP8 quantization (moe/fp8_experts.py's
use_gathered(False): the A/B of quantizing them through the routing). The six jaxfuse
variants run in alternating chunks (common.time_alternating); the reference, ~10x slower,
on its own.

Cases: Mixtral-like (8 experts, top-2, H=4096, F=14336) and DeepSeek-like (64 experts,
top-6, H=2048, F=1408), 16384 tokens each. TFLOP/s count the experts' GEMMs over the T*k
routed rows plus the router GEMM.

    python -m benchmarks.bench_moe [--quick] [--no-reference]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxfuse
from benchmarks import common
from jaxfuse._src.ops.moe import api as moe_api
from jaxfuse._src.ops.moe import fp8_experts

CASES = {  # name: (tokens, hidden, ffn, experts, top_k)
    "Mixtral-like 8x top-2 H=4096 F=14336": (16384, 4096, 14336, 8, 2),
    "DeepSeek-like 64x top-6 H=2048 F=1408": (16384, 2048, 1408, 64, 6),
}


def inputs(tokens, hidden, ffn, experts, seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
  router = jax.random.normal(keys[1], (hidden, experts), jnp.float32) * 0.02
  k1 = (jax.random.normal(keys[2], (experts, hidden, 2 * ffn), jnp.bfloat16) /
        hidden**0.5).astype(jnp.bfloat16)
  k2 = (jax.random.normal(keys[3], (experts, ffn, hidden), jnp.bfloat16) /
        ffn**0.5).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[4], (tokens, hidden), jnp.bfloat16)
  return x, router, k1, k2, dy


FP8_RECIPE = jaxfuse.quantization.Float8CurrentScaling(per_group=True)
BLOCK_RECIPE = jaxfuse.quantization.Float8BlockScaling()
LABELS = ("jaxfuse", "jaxfuse_fp8", "jaxfuse_fp8_permuted", "jaxfuse_fp8_quantized_kernels",
          "jaxfuse_fp8_blockwise", "jaxfuse_fp8_blockwise_quantized_kernels", "reference")


def step(implementation, top_k, recipe=None, gathered=True):
  """{"fwd", "fwd+bwd"}: jitted steps of jaxfuse.moe; gathered=False traces the FP8
  experts on 16-bit permuted tokens (fp8_experts.use_gathered)."""
  def layer(x, r, k1, k2):
    with fp8_experts.use_gathered(gathered):
      return jaxfuse.moe(x, r, k1, k2, top_k=top_k, recipe=recipe,
                         implementation=implementation)

  def forward_backward(x, router, k1, k2, dy):
    (out, aux), vjp = jax.vjp(layer, x, router, k1, k2)
    # A trainable copy's gradient: its master's (common.masters).
    return out, common.masters(vjp((dy, jnp.ones_like(aux))))

  def forward(x, router, k1, k2, dy):
    del dy
    return layer(x, router, k1, k2)

  return {"fwd": jax.jit(forward), "fwd+bwd": jax.jit(forward_backward)}


# XLA's GEMM autotuner finds no config for some of the ragged_dot layer's dense expansions
# (the DeepSeek-like backward on the H200 in sessions 20-25: "Failed to get configs for: 2
# out of 33 instructions"); the reference then compiles with XLA's default configs instead.
NO_AUTOTUNE = {"xla_gpu_autotune_level": 0}


def time_reference(fn, arguments, calls: int, pass_name: str):
  """(median ms or None, a note saying how the reference was compiled or why it failed)."""
  try:
    return common.time_fn(fn, [arguments] * calls)["median_ms"], "autotuned"
  except Exception as error:  # e.g. the dense ragged_dot expansion running out of memory
    message = f"{type(error).__name__}: {str(error)[:200]}"
    print(f"reference {pass_name} failed: {message}")
    if "Failed to get configs" not in str(error):
      return None, message
  try:
    compiled = fn.lower(*arguments).compile(compiler_options=NO_AUTOTUNE)
    ms = common.time_fn(compiled, [arguments] * calls)["median_ms"]
    print(f"reference {pass_name} without XLA's autotuner: {ms:.2f} ms")
    return ms, "xla_gpu_autotune_level=0 (the autotuner found no config)"
  except Exception as error:
    message = f"{type(error).__name__}: {str(error)[:200]}"
    print(f"reference {pass_name} failed without the autotuner too: {message}")
    return None, message


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--no-reference", action="store_true",
                      help="skip the ragged_dot reference layer (minutes per case; for runs "
                           "that compare jaxfuse's variants only)")
  parser.add_argument("--tag", default="", help="suffix of the results file name (A/B runs)")
  args = parser.parse_args()
  calls = 5 if args.quick else 20
  baseline_calls = 3 if args.quick else 10  # the ragged_dot layer is G times the work
  rows = []
  for name, (tokens, hidden, ffn, experts, top_k) in CASES.items():
    arguments = inputs(tokens, hidden, ffn, experts)
    x, router, k1, k2, dy = arguments
    times, notes = {}, {}
    # jaxfuse's variants in alternating chunks of two calls (common.time_alternating): their
    # ratios come from runs that saw the same clocks. The expert weights of the last one
    # are quantized once, outside the timed calls: plain copies for the forward
    # (inference), trainable ones for the forward + backward.
    for pass_name, trainable in (("fwd", False), ("fwd+bwd", True)):
      quantized = lambda recipe, trainable=trainable: (
          x, router, jaxfuse.quantize_experts(k1, recipe, trainable=trainable),
          jaxfuse.quantize_experts(k2, recipe, trainable=trainable), dy)
      fp8_step = step("ffi", top_k, FP8_RECIPE)[pass_name]
      block_step = step("ffi", top_k, BLOCK_RECIPE)[pass_name]
      variants = {"jaxfuse": common.rotating(step("ffi", top_k)[pass_name], [arguments]),
                  "jaxfuse_fp8": common.rotating(fp8_step, [arguments]),
                  "jaxfuse_fp8_permuted": common.rotating(
                      step("ffi", top_k, FP8_RECIPE, gathered=False)[pass_name], [arguments]),
                  "jaxfuse_fp8_quantized_kernels": common.rotating(
                      fp8_step, [quantized(FP8_RECIPE)]),
                  "jaxfuse_fp8_blockwise": common.rotating(block_step, [arguments]),
                  "jaxfuse_fp8_blockwise_quantized_kernels": common.rotating(
                      block_step, [quantized(BLOCK_RECIPE)])}
      stats = common.time_alternating(variants, rounds=max(3, calls // 2), chunk=2)
      for label, timing in stats.items():
        times[(label, pass_name)] = timing["median_ms"]
      del variants
    del x, router, k1, k2, dy
    for pass_name, fn in step("xla", top_k).items():  # ~10x slower: drift does not matter
      if args.no_reference:
        times[("reference", pass_name)], notes[pass_name] = None, "not run (--no-reference)"
        continue
      times[("reference", pass_name)], notes[pass_name] = time_reference(
          fn, arguments, baseline_calls + 3, pass_name)
    for pass_name in ("fwd", "fwd+bwd"):
      flops = moe_api.flops(tokens, hidden, ffn, experts, top_k,
                            backward=pass_name == "fwd+bwd")
      row = {"case": name, "tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": experts,
             "top_k": top_k, "pass": pass_name, "flops": flops}
      for label in LABELS:
        ms = times[(label, pass_name)]
        row[f"{label}_ms"] = ms
        row[f"{label}_tflops"] = flops / (ms * 1e-3) / 1e12 if ms else None
      row["reference_note"] = notes[pass_name]
      row["speedup"] = (row["reference_ms"] / row["jaxfuse_ms"]
                        if row["reference_ms"] and row["jaxfuse_ms"] else None)
      row["fp8_speedup"] = (row["jaxfuse_ms"] / row["jaxfuse_fp8_ms"]
                            if row["jaxfuse_fp8_ms"] and row["jaxfuse_ms"] else None)
      row["fp8_gathered_speedup"] = (row["jaxfuse_fp8_permuted_ms"] / row["jaxfuse_fp8_ms"]
                                     if row["jaxfuse_fp8_ms"] and row["jaxfuse_fp8_permuted_ms"]
                                     else None)
      quantized_ms = row["jaxfuse_fp8_quantized_kernels_ms"]
      row["fp8_quantized_kernels_speedup"] = (row["jaxfuse_ms"] / quantized_ms
                                              if quantized_ms and row["jaxfuse_ms"] else None)
      rows.append(row)
      print(row, flush=True)
    del arguments
  common.print_table(rows, ["case", "pass", "jaxfuse_ms", "jaxfuse_tflops", "jaxfuse_fp8_ms",
                            "fp8_speedup", "jaxfuse_fp8_permuted_ms", "fp8_gathered_speedup",
                            "jaxfuse_fp8_quantized_kernels_ms",
                            "fp8_quantized_kernels_speedup", "jaxfuse_fp8_blockwise_ms",
                            "jaxfuse_fp8_blockwise_quantized_kernels_ms", "reference_ms",
                            "reference_tflops", "speedup"])
  common.write_results("moe", rows, tag=args.tag, dtype="bfloat16", activation="swiglu",
                       baseline="jaxfuse.moe(implementation='xla'): argsort/scatter "
                                "permutation, jax.lax.ragged_dot experts, jnp SwiGLU, same run")


if __name__ == "__main__":
  main()
