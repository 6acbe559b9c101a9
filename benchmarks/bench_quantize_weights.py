"""Per-expert current scaling of FP8 weights: one call against the amax + quantize pair.

The FP8 grouped GEMMs quantize their 16-bit weights [G, K, N] in every call (unless the
weights were quantized once with ``jaxfuse.quantize_experts``): each expert gets its own
scale from its amax, and the FP8 bytes go out in two layouts ([G, N, K] for the forward,
[G, K, N] for the dgrad). ``quantize_batches_transposed`` (one FFI call) reads an expert
from DRAM once where its tiles fit in the shared memory of a team of resident blocks
(QuantizeBatchesOnePassKernel in cuda/gpu/quantize.cu); the baseline, measured in the
same run in alternating chunks, is the pair of calls it replaces: ``batch_amax`` and
``quantize_transposed`` (two reads of the weights). Shapes: the weights of the issue's
grouped MLP (8 experts, H = F = 2048, and the small case's FC1, H = F = 1024), of the
DeepSeek-like and Mixtral-like MoE layers (bench_moe; Mixtral's experts are too large for
one pass: both variants run the same kernels there), and a dense 4096 x 4096 kernel
(linear_scale_add's, one batch).

Reported: ms per call (host clock over chunks of ~10 ms of calls), kernel ms (CUPTI), and
TB/s of the bytes one pass must move (read 2 bytes, write 2 FP8 bytes per element) as a
fraction of the device copy bandwidth measured in the same run.

    python -m benchmarks.bench_quantize_weights [--quick] [--tag TAG]
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

from benchmarks import common
from jaxfuse._src.ops.quantize import ffi as quantize_ffi

# name: [G, K, N] of 16-bit weights.
SHAPES = {
    "grouped MLP FC1 (8 x 2048 x 4096)": (8, 2048, 4096),
    "grouped MLP FC2 (8 x 2048 x 2048)": (8, 2048, 2048),
    # The T=2048 grouped MLP's FC1: 8 experts of 128 tiles, more experts than teams.
    "small grouped MLP FC1 (8 x 1024 x 2048)": (8, 1024, 2048),
    "DeepSeek-like FC1 (64 x 2048 x 2816)": (64, 2048, 2816),
    "DeepSeek-like FC2 (64 x 1408 x 2048)": (64, 1408, 2048),
    "Mixtral-like FC1 (8 x 4096 x 28672)": (8, 4096, 28672),
    "dense kernel (1 x 4096 x 4096)": (1, 4096, 4096),
}
L2_BYTES = 50 << 20


def one_call(w):
  return quantize_ffi.quantize_batches_transposed(w, fmt="e4m3", untransposed=True)


def two_calls(w):
  return quantize_ffi.quantize_transposed(w, quantize_ffi.batch_amax(w), fmt="e4m3",
                                          untransposed=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="fewer rounds")
  parser.add_argument("--tag", default="", help="suffix of the results file name")
  args = parser.parse_args()
  rounds = 4 if args.quick else 10
  copy_tbps = common.copy_bandwidth_tbps()
  print(f"device copy bandwidth: {copy_tbps:.3f} TB/s", flush=True)
  variants = {"two_calls": jax.jit(two_calls), "one_call": jax.jit(one_call)}
  rows = []
  for name, shape in SHAPES.items():
    elements = math.prod(shape)
    moved = elements * (2 + 2)  # one read of bf16, two FP8 layouts written
    sets = max(1, math.ceil(4 * L2_BYTES / (2 * elements)))
    keys = jax.random.split(jax.random.key(elements % 2**31), sets)
    weights = [(jax.random.normal(key, shape, jnp.bfloat16),) for key in keys]
    # The two variants' bytes must match before their times mean anything.
    for got, want in zip(variants["one_call"](*weights[0]), variants["two_calls"](*weights[0])):
      if not bool(jnp.array_equal(jax.lax.bitcast_convert_type(got, jnp.uint8),
                                  jax.lax.bitcast_convert_type(want, jnp.uint8))):
        raise AssertionError(f"{name}: one call and two calls differ")
    chunk = common.calls_per_sync(moved / 3e12 * 1e3)
    stats = common.time_alternating(
        {label: common.rotating(fn, weights) for label, fn in variants.items()},
        rounds=rounds, chunk=chunk)
    row = {"case": name, "shape": list(shape), "bytes": moved, "calls_per_sync": chunk}
    for label, fn in variants.items():
      row[f"{label}_ms"] = stats[label]["median_ms"]
      device = common.device_time_per_call(common.rotating(fn, weights), chunk)
      if device:
        row[f"{label}_kernel_ms"] = device["kernel_ms"]
        row[f"{label}_kernel_of_copy"] = moved / (device["kernel_ms"] * 1e-3) / 1e12 / copy_tbps
    row["speedup"] = row["two_calls_ms"] / row["one_call_ms"]
    row["paired_speedup"] = stats["one_call"]["paired_speedup_vs_two_calls"]
    rows.append(row)
    print(row, flush=True)
    del weights
  common.print_table(rows, ["case", "one_call_ms", "two_calls_ms", "speedup", "paired_speedup",
                            "one_call_kernel_ms", "two_calls_kernel_ms",
                            "one_call_kernel_of_copy", "two_calls_kernel_of_copy"])
  common.write_results("quantize_weights", rows, tag=args.tag, copy_tbps=copy_tbps,
                       baseline="batch_amax + quantize_transposed (the amax pass, then the "
                                "transposed pass), same run, alternating chunks")


if __name__ == "__main__":
  main()
