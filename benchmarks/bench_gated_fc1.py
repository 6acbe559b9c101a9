"""The gated FC1 (grouped_linear ffi.grouped_gemm_gated: FC1 and its scaled SwiGLU in one
kernel) against the plain path it replaces, FC1's grouped GEMM then the scaled activation
kernel, and against FC1's GEMM alone (what the fused kernel's epilogue costs on top of it),
in alternating chunks of one run (common.time_alternating).

Cases: bench_grouped_mlp's seed cases' FC1 (8 experts, bf16, x [T, H] @ w1 [G, H, 2F]) and
an odd F / 128 tile count (F = 1408, a 64-expert layer's width: the 1x1-cluster kernel).
Before timing, each case checks the gated op against the plain path: the activation bit for
bit against scaled_activation of the gated op's h, h within bf16 rounding of the plain
GEMM's (the row's max_act_diff and h_rel_diff; a nonzero max_act_diff fails the run).

    python -m benchmarks.bench_gated_fc1 [--quick] [--tag TAG]

JAXFUSE_GROUPED_GEMM_TILE=small|large forces the ping-pong or the cooperative kernel (the
tile heuristic picks per problem; the plain GEMM follows the same variable).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_grouped_mlp
from benchmarks import common
from jaxfuse._src.ops.group_offsets import api as offsets_api
from jaxfuse._src.ops.grouped_linear import ffi as gemm_ffi
from jaxfuse._src.ops.scaled_activation import ffi as act_ffi

ACT = dict(activation="swiglu", limit=7.0, alpha=1.702, linear_offset=1.0)
CASES = {  # name: (tokens, hidden, ffn)
    "T=65536 H=2048 F=2048": (65536, 2048, 2048),
    "T=2048 H=1024 F=1024": (2048, 1024, 1024),
    "T=16384 H=2048 F=1408": (16384, 2048, 1408),
}


def gated(x, w, offsets, scales):
  return gemm_ffi.grouped_gemm_gated(x, w, offsets, scales, **ACT)


def two_kernels(x, w, offsets, scales):
  h = gemm_ffi.grouped_gemm(x, w, offsets, form=gemm_ffi.FORWARD)
  return h, act_ffi.forward(h, scales, **ACT)


def fc1_alone(x, w, offsets, scales):
  del scales
  return gemm_ffi.grouped_gemm(x, w, offsets, form=gemm_ffi.FORWARD)


def inputs(tokens, hidden, ffn, seed):
  x, k1, _, scales, _ = bench_grouped_mlp.jax_inputs(tokens, hidden, ffn, seed)
  sizes = jnp.asarray(bench_grouped_mlp.group_sizes(tokens))
  return x, k1, offsets_api.group_offsets(sizes, implementation="ffi"), scales


def check(fns, args) -> dict:
  """The gated op against the plain path on one input set (see the module docstring)."""
  h, act = fns["gated"](*args)
  h_plain, _ = fns["two_kernels"](*args)
  act_of_h = jax.jit(lambda h, s: act_ffi.forward(h, s, **ACT))(h, args[3])
  h, h_plain, act, act_of_h = (np.asarray(v, np.float64) for v in (h, h_plain, act, act_of_h))
  return {"max_act_diff": float(np.abs(act - act_of_h).max()),
          "h_rel_diff": float(np.abs(h - h_plain).max() / np.abs(h_plain).max())}


def run_case(name, tokens, hidden, ffn, rounds):
  working_set = 2 * (tokens * hidden + bench_grouped_mlp.EXPERTS * hidden * 2 * ffn)
  arg_sets = [inputs(tokens, hidden, ffn, seed)
              for seed in range(3 if working_set < 2 * bench_grouped_mlp.L2_BYTES else 1)]
  fns = {"gated": jax.jit(gated), "two_kernels": jax.jit(two_kernels),
         "fc1_alone": jax.jit(fc1_alone)}
  row = {"case": name, "tokens": tokens, "hidden": hidden, "ffn": ffn,
         "experts": bench_grouped_mlp.EXPERTS, **check(fns, arg_sets[0])}
  if row["max_act_diff"] != 0:
    raise AssertionError(f"{name}: the gated op's activation differs from "
                         f"scaled_activation of its h by {row['max_act_diff']}")
  common.warm_up_device(fns["two_kernels"], *arg_sets[0], seconds=2.0)
  flops = 2 * tokens * hidden * 2 * ffn
  chunk = common.calls_per_sync(flops / 600e12 * 1e3, most=200)
  with common.GpuMonitor() as gpu:
    stats = common.time_alternating({n: common.rotating(f, arg_sets) for n, f in fns.items()},
                                    rounds=rounds, chunk=chunk)
  for impl, timing in stats.items():
    row[f"{impl}_ms"] = timing["median_ms"]
    row[f"{impl}_tflops"] = flops / (timing["median_ms"] * 1e-3) / 1e12
  row["gated_vs_two_kernels"] = row["two_kernels_ms"] / row["gated_ms"]
  # time_alternating pairs chunks against its first variant (gated): chunk time of gated
  # over two_kernels', round by round; its inverse is the gated op's speedup.
  row["paired_gated_vs_two_kernels"] = 1 / stats["two_kernels"]["paired_speedup_vs_gated"]
  row["epilogue_cost_ms"] = row["gated_ms"] - row["fc1_alone_ms"]
  row["calls_per_sync"] = chunk
  row["gpu"] = gpu.summary
  print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
  return row


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="fewer rounds")
  parser.add_argument("--tag", default="", help="suffix of the results file name")
  args = parser.parse_args()
  rounds = 4 if args.quick else 12
  rows = [run_case(name, *shape, rounds) for name, shape in CASES.items()]
  common.print_table(rows, ["case", "gated_ms", "two_kernels_ms", "fc1_alone_ms",
                            "gated_vs_two_kernels", "epilogue_cost_ms", "max_act_diff",
                            "h_rel_diff"])
  common.write_results("gated_fc1", rows, tag=args.tag, dtype="bfloat16", activation="swiglu",
                       baselines="FC1's grouped GEMM then the scaled activation kernel "
                                 "(two_kernels_*), and the GEMM alone (fc1_alone_*), same run")


if __name__ == "__main__":
  main()
