"""linear_scale_add vs XLA's own fusion of ``residual + alpha * (x @ kernel)`` (bf16).

XLA rewrites the jnp expression into one cuBLASLt call with alpha and beta = 1, so this
measures whether jaxfuse's custom call matches it (goal: within 3% or faster), forward
and forward + backward, at 4096-65536 tokens x 4096-8192 features. Residuals are donated
and fresh for every call, as in a training step that updates the residual stream.

    python benchmarks/bench_linear_scale_add.py [--quick]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxfuse
from benchmarks import common

ALPHA = 0.5
SHAPES = [(tokens, features) for tokens in (4096, 16384, 65536) for features in (4096, 8192)]
# FP8 (per-tensor current scaling) against the bf16 XLA baseline: issue 3's two shapes.
FP8_SHAPES = [(8192, 8192), (65536, 4096)]
FP8_RECIPE = jaxfuse.quantization.Float8CurrentScaling(per_group=False)


def xla_linear_scale_add(x, kernel, residual):
  """The baseline: XLA's own lowering of the plain jnp expression (one cuBLASLt call)."""
  return residual + ALPHA * (x @ kernel)


def make_step(implementation: str, backward: bool, recipe=None):
  def forward(x, kernel, residual):
    if implementation == "xla":
      return xla_linear_scale_add(x, kernel, residual)
    return jaxfuse.linear_scale_add(x, kernel, residual, ALPHA, recipe=recipe,
                                    implementation=implementation)

  if not backward:
    return jax.jit(forward, donate_argnums=2)

  def forward_backward(x, kernel, residual, d_out):
    out, vjp = jax.vjp(forward, x, kernel, residual)
    return out, *vjp(d_out)

  return jax.jit(forward_backward, donate_argnums=2)


def operands(tokens, features, seed):
  """x [tokens, features], kernel [features, features] (unit-scale output), d_out; bf16."""
  kx, kk, kr = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (tokens, features), jnp.bfloat16)
  kernel = (jax.random.normal(kk, (features, features)) / features**0.5).astype(jnp.bfloat16)
  d_out = jax.random.normal(kr, (tokens, features), jnp.bfloat16)
  return x, kernel, d_out


def time_step(step, x, kernel, d_out, backward, calls) -> float:
  """Median ms of `step`, with a fresh residual per call (it is donated)."""
  tokens, features = d_out.shape
  residuals = [jax.random.normal(jax.random.key(i), (tokens, features), jnp.bfloat16)
               for i in range(calls)]
  arg_tuples = [(x, kernel, r, d_out) if backward else (x, kernel, r) for r in residuals]
  return common.time_fn(step, arg_tuples)["median_ms"]


def time_fp8(shapes, calls) -> list[dict]:
  """FP8 linear_scale_add (forward, forward + backward) against bf16 XLA, same run."""
  rows = []
  for tokens, features in shapes:
    x, kernel, d_out = operands(tokens, features, tokens * 7 + features)
    flops = 2 * tokens * features * features
    for backward in (False, True):
      row = {"tokens": tokens, "features": features, "pass": "fwd+bwd" if backward else "fwd"}
      for implementation, recipe, label in (("ffi", FP8_RECIPE, "jaxfuse_fp8"),
                                            ("xla", None, "xla_bf16")):
        ms = time_step(make_step(implementation, backward, recipe), x, kernel, d_out,
                       backward, calls)
        row[f"{label}_ms"] = ms
        row[f"{label}_tflops"] = flops * (3 if backward else 1) / (ms * 1e-3) / 1e12
      row["fp8_speedup_vs_xla_bf16"] = row["xla_bf16_ms"] / row["jaxfuse_fp8_ms"]
      rows.append(row)
      print(row, flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="two small shapes, few calls")
  args = parser.parse_args()
  shapes = SHAPES[:2] if args.quick else SHAPES
  calls = 8 if args.quick else 23
  rows = []
  for tokens, features in shapes:
    x, kernel, d_out = operands(tokens, features, tokens + features)
    flops = 2 * tokens * features * features
    for backward in (False, True):
      row = {"tokens": tokens, "features": features, "pass": "fwd+bwd" if backward else "fwd"}
      for implementation, label in (("ffi", "jaxfuse"), ("xla", "xla")):
        ms = time_step(make_step(implementation, backward), x, kernel, d_out, backward, calls)
        row[f"{label}_ms"] = ms
        row[f"{label}_tflops"] = flops * (3 if backward else 1) / (ms * 1e-3) / 1e12
      row["speedup_vs_xla"] = row["xla_ms"] / row["jaxfuse_ms"]
      rows.append(row)
      print(row, flush=True)
  common.print_table(rows, ["tokens", "features", "pass", "jaxfuse_ms", "xla_ms",
                            "jaxfuse_tflops", "xla_tflops", "speedup_vs_xla"])
  common.write_results("linear_scale_add", rows, alpha=ALPHA, dtype="bfloat16",
                       baseline="XLA lowering of residual + alpha * (x @ kernel) in bf16, same run")
  fp8_rows = time_fp8(FP8_SHAPES[:1] if args.quick else FP8_SHAPES, calls)
  common.print_table(fp8_rows, ["tokens", "features", "pass", "jaxfuse_fp8_ms", "xla_bf16_ms",
                                "jaxfuse_fp8_tflops", "fp8_speedup_vs_xla_bf16"])
  common.write_results("linear_scale_add_fp8", fp8_rows, alpha=ALPHA, recipe=repr(FP8_RECIPE),
                       baseline="XLA lowering of residual + alpha * (x @ kernel) in bf16, "
                                "same run")


if __name__ == "__main__":
  main()
