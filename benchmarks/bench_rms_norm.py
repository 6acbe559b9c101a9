"""rms_norm and add_rms_norm (bf16) vs XLA's fusion of the jnp reference, as bandwidth.

For each shape: forward and forward + backward of RMSNorm and of residual add + RMSNorm,
jaxfuse's custom calls against XLA's own fusion of ``jaxfuse._src.ops.rms_norm.reference``
in the same run, reported in TB/s of the fewest bytes each pass must move (forward: read x
(and the residual), write out (and the new residual); backward: read dy, the saved input
(and dz), write dx; gamma and rsigma ignored) and as a fraction of the device copy
bandwidth measured at the start of the same run (and again at its end, to show drift).
Goal: >= 85% of copy for the forward at 65536 x 8192 (XLA: 62% for add + RMSNorm on the
H200).

jaxfuse and XLA run in alternating chunks (common.time_alternating) of ~10 ms of calls
(common.calls_per_sync, at least 5 calls). Each call's new
residual is the next call's residual; the forward-only steps donate it (the in-place
update), the forward + backward steps do not (as inside a training step, where the
residual is an intermediate; see make_step). Inputs rotate across several sets where one
set would sit in the 50 MB L2. ``*_kernel_ms`` / ``*_kernel_of_copy``: the kernels' device
time (CUPTI through torch.profiler, common.device_time_per_call), where host time measures
dispatch (4096 x 1024).

    python benchmarks/bench_rms_norm.py [--quick] [--shapes 65536x8192 ...] [--tag TAG]

JAXFUSE_RMS_NORM_THREADS_PER_ROW (32-1024) overrides the kernels' threads-per-row target.
"""

from __future__ import annotations

import argparse
import itertools
import math

import jax
import jax.numpy as jnp

import jaxfuse
from benchmarks import common
from jaxfuse._src.ops.rms_norm import api as rms_api

SHAPES = [(65536, 8192), (16384, 8192), (16384, 4096), (8192, 16384), (4096, 1024)]
L2_BYTES = 50 << 20
EPS = 1e-6


def make_step(implementation: str, add: bool, backward: bool):
  if add:
    def forward(x, residual, gamma):
      out, new_residual = jaxfuse.add_rms_norm(x, residual, gamma, EPS,
                                               implementation=implementation)
      return new_residual, out  # the new residual first: it takes the donated buffer
  else:
    def forward(x, gamma):
      return jaxfuse.rms_norm(x, gamma, EPS, implementation=implementation)

  if not backward:
    return jax.jit(forward, donate_argnums=1 if add else ())

  if add:
    # As inside a training step: the residual is not donated (a donated residual makes XLA
    # copy the differentiated forward's fresh new-residual buffer into it), and the
    # residual's gradient, the same array as x's (one kernel output), is returned once
    # (returning it twice makes XLA copy an output).
    def step(x, residual, gamma, dy, dz):
      outs, vjp = jax.vjp(forward, x, residual, gamma)
      dx, _, dgamma = vjp((dz, dy))
      return outs, (dx, dgamma)
    return jax.jit(step)

  def step(x, gamma, dy):
    out, vjp = jax.vjp(forward, x, gamma)
    return out, vjp(dy)
  return jax.jit(step)


def variant(implementation, add, backward, xs, dys, dzs, gamma):
  """A common.time_alternating variant: inputs rotate over the sets (L2), and the donated
  residual of add_rms_norm is the previous call's new residual (the in-place update)."""
  step = make_step(implementation, add, backward)
  counter = itertools.count(1)

  def args_for(index, residual=None):
    j = index % len(xs)
    if add:
      return (xs[j], residual, gamma, dys[j], dzs[j]) if backward else (xs[j], residual, gamma)
    return (xs[j], gamma, dys[j]) if backward else (xs[j], gamma)

  def advance(args, outputs):
    new_residual = None
    if add:
      new_residual = outputs[0][0] if backward else outputs[0]
    return args_for(next(counter), new_residual)

  first_residual = jnp.array(xs[-1]) if add else None  # a buffer of its own: it is donated
  return step, args_for(0, first_residual), advance


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="two small shapes, few calls")
  parser.add_argument("--shapes", nargs="*", help="TOKENSxHIDDEN, e.g. 65536x8192")
  parser.add_argument("--tag", default="", help="suffix of the results file name (sweeps)")
  args = parser.parse_args()
  shapes = SHAPES[-2:] if args.quick else SHAPES
  if args.shapes:
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
  rounds = 2 if args.quick else 8  # alternating chunks of common.CHUNK calls per variant
  copy_tbps = common.copy_bandwidth_tbps()
  print(f"device copy bandwidth: {copy_tbps:.3f} TB/s", flush=True)
  dtype = jnp.bfloat16
  rows = []
  for tokens, hidden in shapes:
    shape = (tokens, hidden)
    nbytes = tokens * hidden * jnp.dtype(dtype).itemsize
    sets = max(1, math.ceil(4 * L2_BYTES / nbytes))
    keys = jax.random.split(jax.random.key(tokens + hidden), 3 * sets + 1)
    xs = [jax.random.normal(keys[i], shape, dtype) for i in range(sets)]
    dys = [jax.random.normal(keys[sets + i], shape, dtype) for i in range(sets)]
    dzs = [jax.random.normal(keys[2 * sets + i], shape, dtype) for i in range(sets)]
    gamma = 1.0 + 0.1 * jax.random.normal(keys[-1], (hidden,), jnp.float32)
    for add in (False, True):
      for backward in (False, True):
        row = {"op": "add_rms_norm" if add else "rms_norm", "tokens": tokens,
               "hidden": hidden, "pass": "fwd+bwd" if backward else "fwd"}
        moved = rms_api.bytes_moved(shape, dtype, add=add)
        if backward:
          moved += rms_api.bytes_moved(shape, dtype, add=add, backward=True)
        row["bytes"] = moved
        # ~10 ms of calls per chunk (at 3 TB/s): one sync's latency is not charged to a
        # few 0.1 ms calls.
        chunk = common.calls_per_sync(moved / 3e12 * 1e3)
        row["calls_per_sync"] = chunk
        implementations = {"xla": "xla", "jaxfuse": "ffi"}

        def make(label):
          return variant(implementations[label], add, backward, xs, dys, dzs, gamma)

        stats = common.time_alternating({label: make(label) for label in implementations},
                                        rounds=rounds, chunk=chunk)
        for label, timing in stats.items():
          tbps = moved / (timing["median_ms"] * 1e-3) / 1e12
          row[f"{label}_ms"] = timing["median_ms"]
          row[f"{label}_tbps"] = tbps
          row[f"{label}_of_copy"] = tbps / copy_tbps
          # The kernels' own device time (CUPTI): what small shapes' host time hides. A
          # fresh variant: the timed one's first residual was donated.
          device = common.device_time_per_call(make(label), chunk)
          if device:
            row[f"{label}_kernel_ms"] = device["kernel_ms"]
            row[f"{label}_kernel_of_copy"] = moved / (device["kernel_ms"] * 1e-3) / 1e12 / copy_tbps
        row["speedup_vs_xla"] = row["xla_ms"] / row["jaxfuse_ms"]
        row["paired_speedup"] = stats["jaxfuse"]["paired_speedup_vs_xla"]
        rows.append(row)
        print(row, flush=True)
    del xs, dys, dzs
  copy_tbps_end = common.copy_bandwidth_tbps()
  print(f"device copy bandwidth at the end: {copy_tbps_end:.3f} TB/s", flush=True)
  common.print_table(rows, ["op", "tokens", "hidden", "pass", "jaxfuse_ms", "xla_ms",
                            "jaxfuse_tbps", "xla_tbps", "jaxfuse_of_copy", "xla_of_copy",
                            "speedup_vs_xla", "paired_speedup", "jaxfuse_kernel_of_copy",
                            "xla_kernel_of_copy"])
  common.write_results("rms_norm", rows, tag=args.tag, dtype="bfloat16",
                       gamma_dtype="float32", copy_tbps=copy_tbps,
                       copy_tbps_at_end=copy_tbps_end,
                       baseline="XLA fusion of the jnp reference (jaxfuse implementation='xla'), "
                                "same run, in alternating chunks (common.time_alternating)")


if __name__ == "__main__":
  main()
