"""Scaled activations and their fusion with FP8 quantization: jaxfuse vs XLA's fusion of
the jnp reference, in the same run, with the device's copy bandwidth as the ceiling.

Cases (bf16, 8 equal groups, fp32 per-row scales): T=65536, 2F=8192 and T=2048, 2F=2048.
Ops: scaled SwiGLU forward; its backward (dx and dscales); the forward fused with FP8
quantization (per-group current scaling, 1x128 block scaling, MXFP8); the backward fused
with quantization of dx (per-group current scaling, E5M2).

Bandwidth counts the fewest bytes: every input read once and every output written once
(frac_of_copy, the issue's measure). Current scaling must read x (and dy) twice, since a
group's amax is needed before any of its elements is quantized: that caps frac_of_copy near
5/9 at T=65536; frac_of_copy_traffic counts the second read. Inputs are rotated across calls
when one set would fit in the 50 MB L2; jaxfuse and XLA run in alternating chunks
(common.time_alternating) of ~10 ms of calls (common.calls_per_sync).

kernel_ms / kernel_frac_of_copy: the same from the kernels' device time (CUPTI through
torch.profiler, chunk-long runs of each variant back to back; kernels only, overlaps
once), which at T=2048 is what the kernels do rather than a jitted call's dispatch;
span_ms adds the idle gaps between them. kernel_frac_of_size_copy divides by the kernel
bandwidth of a copy of x of the case's size (size_copy_kernel_TBps), timed the same way:
the ceiling for a kernel that moves a few MB.

Run on the GPU:  python -m benchmarks.bench_activations [--quick]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from benchmarks import common
from jaxfuse.quantization import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from jaxfuse._src.ops.scaled_activation import reference as act_reference

L2_BYTES = 50 << 20
CASES = [(65536, 8192), (2048, 2048)]
GROUPS = 8
RECIPES = {"current_per_group": Float8CurrentScaling(), "block_1x128": Float8BlockScaling(),
           "mxfp8_1x32": MXFP8BlockScaling()}


def make_sets(t, w, count, seed=0):
  rng = np.random.default_rng(seed)
  sets = []
  for i in range(count):
    x = jnp.asarray(rng.standard_normal((t, w), np.float32), jnp.bfloat16)
    scales = jnp.asarray(rng.uniform(0.1, 1.0, t), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((t, w // 2), np.float32), jnp.bfloat16)
    sets.append((x, scales, dy))
    if i == 0:
      per_set = x.nbytes + scales.nbytes + dy.nbytes
  return sets, per_set


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="fewer timed calls")
  parser.add_argument("--tag", default="", help="suffix of the results file name (sweeps)")
  args = parser.parse_args()
  rounds = 2 if args.quick else 6  # alternating chunks (common.calls_per_sync) per variant
  copy_tbps = common.copy_bandwidth_tbps()
  print(f"device copy bandwidth: {copy_tbps:.2f} TB/s")
  rows = []
  for t, w in CASES:
    f = w // 2
    sets, per_set = make_sets(t, w, 1)
    count = max(1, min(8, -(-2 * L2_BYTES // per_set)))
    if count > 1:
      sets, _ = make_sets(t, w, count)
    sizes = jnp.full((GROUPS,), t // GROUPS, jnp.int32)
    offsets = jaxfuse.group_offsets(sizes)
    x_bytes, s_bytes, dy_bytes = t * w * 2, t * 4, t * f * 2

    def record(op, impl, ms, num_bytes, baseline_ms=None, traffic_bytes=None, device=None):
      tbps = num_bytes / (ms * 1e-3) / 1e12
      row = dict(T=t, two_F=w, op=op, impl=impl, median_ms=ms, TBps=tbps,
                 frac_of_copy=tbps / copy_tbps)
      if device:  # the kernels' own time (CUPTI), without dispatch
        row["kernel_ms"], row["span_ms"] = device["kernel_ms"], device["span_ms"]
        kernel_tbps = num_bytes / (device["kernel_ms"] * 1e-3) / 1e12
        row["kernel_frac_of_copy"] = kernel_tbps / copy_tbps
        if size_copy_tbps:
          row["size_copy_kernel_TBps"] = size_copy_tbps
          row["kernel_frac_of_size_copy"] = kernel_tbps / size_copy_tbps
      if traffic_bytes is not None:  # what the two-pass algorithm must move at least
        row["frac_of_copy_traffic"] = traffic_bytes / (ms * 1e-3) / 1e12 / copy_tbps
      if baseline_ms is not None:
        row["speedup_vs_xla"] = baseline_ms / ms
      rows.append(row)
      return ms

    def pair(op, ours, theirs, operands, num_bytes, traffic_bytes=None):
      # XLA and jaxfuse in alternating chunks (common.time_alternating) of ~10 ms of calls
      # (at 3 TB/s): one sync's latency is not charged to a few short calls.
      chunk = common.calls_per_sync((traffic_bytes or num_bytes) / 3e12 * 1e3)
      variants = {"xla": common.rotating(jax.jit(theirs), operands),
                  "jaxfuse": common.rotating(jax.jit(ours), operands)}
      stats = common.time_alternating(variants, rounds=rounds, chunk=chunk)
      # Device time too: host time is dispatch-bound for the T=2048 calls.
      device = {name: common.device_time_per_call(variant, chunk)
                for name, variant in variants.items()}
      xla_ms = record(op, "xla", stats["xla"]["median_ms"], num_bytes,
                      traffic_bytes=traffic_bytes, device=device["xla"])
      record(op, "jaxfuse", stats["jaxfuse"]["median_ms"], num_bytes, xla_ms,
             traffic_bytes=traffic_bytes, device=device["jaxfuse"])
      rows[-1]["calls_per_sync"] = rows[-2]["calls_per_sync"] = chunk

    fwd_args = [(x, s) for x, s, _ in sets]
    # The kernel time of a copy of x (read once, written once), measured the same way: what
    # a kernel moving this many bytes reaches at all. At T=2048 (8 MB, a few us) launch and
    # ramp-up are a large part of any kernel, so the 4 GiB copy's bandwidth overstates it.
    copy_variant = common.rotating(jax.jit(lambda x, s: x * 1.0 + 0.0), fwd_args)
    copy_device = common.device_time_per_call(
        copy_variant, common.calls_per_sync(2 * x_bytes / 3e12 * 1e3))
    size_copy_tbps = (2 * x_bytes / (copy_device["kernel_ms"] * 1e-3) / 1e12
                      if copy_device else None)
    bwd_args = [(dy, x, s) for x, s, dy in sets]
    pair("swiglu_fwd",
         lambda x, s: jaxfuse.scaled_activation(x, s, implementation="ffi"),
         lambda x, s: act_reference.scaled_activation(x, s),
         fwd_args, x_bytes + s_bytes + t * f * 2)

    def xla_bwd(dy, x, s):
      _, vjp = jax.vjp(lambda x, s: act_reference.scaled_activation(x, s), x, s)
      return vjp(dy)

    def ffi_bwd(dy, x, s):
      _, vjp = jax.vjp(lambda x, s: jaxfuse.scaled_activation(x, s, implementation="ffi"), x, s)
      return vjp(dy)

    pair("swiglu_bwd", ffi_bwd, xla_bwd, bwd_args, dy_bytes + x_bytes + s_bytes + x_bytes + t * 4)

    for name, recipe in RECIPES.items():
      def ours(x, s, recipe=recipe):
        q = jaxfuse.scaled_activation_quantize(x, s, group_offsets=offsets, recipe=recipe,
                                               implementation="ffi")
        return q.data, q.scale_inv

      def theirs(x, s, recipe=recipe):
        q = jaxfuse.scaled_activation_quantize(x, s, group_offsets=offsets, recipe=recipe,
                                               implementation="xla")
        return q.data, q.scale_inv

      scale_bytes = {"current_per_group": GROUPS * 4, "block_1x128": t * (f // 128) * 4,
                     "mxfp8_1x32": t * (f // 32)}[name]
      fewest = x_bytes + s_bytes + t * f + scale_bytes
      # Current scaling needs each group's amax before any of its elements is quantized:
      # x is read twice unless a group fits in L2.
      two_pass = fewest + x_bytes + s_bytes if name == "current_per_group" else None
      pair(f"swiglu_quantize_{name}", ours, theirs, fwd_args, fewest, two_pass)

    def ours_dq(dy, x, s):
      q, _, ds = jaxfuse.scaled_dactivation_quantize(
          dy, x, s, group_offsets=offsets, recipe=Float8CurrentScaling(), implementation="ffi")
      return q.data, q.scale_inv, ds

    def theirs_dq(dy, x, s):
      q, _, ds = jaxfuse.scaled_dactivation_quantize(
          dy, x, s, group_offsets=offsets, recipe=Float8CurrentScaling(), implementation="xla")
      return q.data, q.scale_inv, ds

    fewest = dy_bytes + x_bytes + s_bytes + t * w + t * 4
    pair("dswiglu_quantize_current_per_group", ours_dq, theirs_dq, bwd_args, fewest,
         fewest + dy_bytes + x_bytes + s_bytes)

  common.print_table(rows, ["T", "two_F", "op", "impl", "median_ms", "TBps", "frac_of_copy",
                            "frac_of_copy_traffic", "speedup_vs_xla", "kernel_ms",
                            "kernel_frac_of_copy", "kernel_frac_of_size_copy"])
  common.write_results("activations", rows, tag=args.tag, copy_bandwidth_TBps=copy_tbps,
                       groups=GROUPS, dtype="bfloat16")


if __name__ == "__main__":
  main()
