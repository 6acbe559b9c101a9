"""Where the device time of a jitted jaxfuse step goes: every kernel, its count and time.

The GPU machine has torch, whose profiler reads CUPTI's activity records for the whole
process, so the kernels XLA launches for a jitted JAX function appear in it too. For each
case this prints and saves (JSON in benchmarks/results/) one row per kernel name, plus
the step's wall time (a sync after each step), the summed kernel time, and, for steps
dispatched back to back as the benchmarks do, the span per step from the first kernel's
start to the last one's end and the idle device time between kernels (the largest gaps by
kernel pair): span >> summed kernels means the device waits, on launches or handler work.

    python -m benchmarks.profile_kernels [--cases NAME ...] [--grep REGEX] [--tag TAG]

Run it again with XLA_FLAGS (e.g. "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL
--xla_gpu_graph_min_graph_size=1") and a --tag to see what CUDA graphs change.

A diagnostic, not a benchmark: the speed claims come from the bench_*.py scripts.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # leave room for torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxfuse  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks import bench_grouped_linear  # noqa: E402
from benchmarks import bench_grouped_mlp  # noqa: E402
from benchmarks import bench_linear_scale_add  # noqa: E402
from benchmarks import bench_moe  # noqa: E402
from benchmarks import tokamax_baseline  # noqa: E402

STEPS = 10


def grouped_mlp_case(tokens, hidden, ffn, recipe=None, pass_name="fwd+bwd",
                     save_activation=None):
  x, k1, k2, scales, dy = bench_grouped_mlp.jax_inputs(tokens, hidden, ffn, 0)
  sizes = jnp.asarray(bench_grouped_mlp.group_sizes(tokens))
  step = bench_grouped_mlp.jax_fns("ffi", recipe, save_activation)[pass_name]
  return step, (x, k1, k2, scales, sizes, dy)


def tokamax_mlp_case(tokens, hidden, ffn, pass_name="fwd"):
  """bench_grouped_mlp's tokamax composition (benchmarks/tokamax_baseline.py)."""
  tokamax, missing = tokamax_baseline.load()
  if tokamax is None:
    raise RuntimeError(f"tokamax unavailable: {missing}")
  x, k1, k2, scales, dy = bench_grouped_mlp.jax_inputs(tokens, hidden, ffn, 0)
  sizes = jnp.asarray(bench_grouped_mlp.group_sizes(tokens))
  return tokamax_baseline.mlp_fns(tokamax)[pass_name], (x, k1, k2, scales, sizes, dy)


def linear_scale_add_case(m, k, n, xla=False):
  keys = jax.random.split(jax.random.key(1), 4)
  x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  kernel = (jax.random.normal(keys[1], (k, n)) / k**0.5).astype(jnp.bfloat16)
  residual = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
  dy = jax.random.normal(keys[3], (m, n), jnp.bfloat16)

  @jax.jit
  def step(x, kernel, residual, dy):
    if xla:  # the benchmark's baseline: XLA's own expression, plain bf16
      fn = lambda x, w, r: r + 0.5 * (x @ w)
    else:
      fn = lambda x, w, r: jaxfuse.linear_scale_add(x, w, r, 0.5)
    out, vjp = jax.vjp(fn, x, kernel, residual)
    return out, vjp(dy)

  return step, (x, kernel, residual, dy)


def linear_scale_add_forward_case(tokens, features, xla=False):
  """The forward alone as bench_linear_scale_add times it (its step, residual donated): the
  output is fed back as the next call's residual (a donated buffer cannot be reused)."""
  x, kernel, residual = bench_linear_scale_add.operands(tokens, features, 1)
  step = bench_linear_scale_add.make_step("xla" if xla else "ffi", backward=False)
  return step, (x, kernel, residual), lambda args, out: (args[0], args[1], out)


def linear_scale_add_stack_case(tokens, features, xla=False, backward=False, layers=8):
  """bench_linear_scale_add's stack of residual layers in one jit (make_stack_step), the
  FP8 op or the bf16 XLA baseline: where a scanned step's time goes (per step = `layers`
  layers)."""
  keys = jax.random.split(jax.random.key(3), 3)
  xs = jax.random.normal(keys[0], (layers, tokens, features), jnp.bfloat16)
  kernels = (jax.random.normal(keys[1], (layers, features, features)) /
             features**0.5).astype(jnp.bfloat16)
  residual = jax.random.normal(keys[2], (tokens, features), jnp.bfloat16)
  recipe = None if xla else jaxfuse.quantization.Float8CurrentScaling(per_group=False)
  step = bench_linear_scale_add.make_stack_step("xla" if xla else "ffi", backward, recipe,
                                                layers)
  if backward:
    return step, (xs, kernels, residual, jnp.copy(residual)), lambda args, out: (
        args[0], args[1], out[0], args[3])
  return step, (xs, kernels, residual), lambda args, out: (args[0], args[1], out)


def activation_case(tokens, width, quantize):
  keys = jax.random.split(jax.random.key(2), 3)
  x = jax.random.normal(keys[0], (tokens, width), jnp.bfloat16)
  scales = jax.random.uniform(keys[1], (tokens,), jnp.float32, 0.1, 1.0)
  dy = jax.random.normal(keys[2], (tokens, width // 2), jnp.bfloat16)
  sizes = jnp.asarray(bench_grouped_mlp.group_sizes(tokens))
  if quantize:
    recipe = jaxfuse.quantization.Float8CurrentScaling(per_group=True)
    step = jax.jit(lambda x, s, g, dy: jaxfuse.scaled_activation_quantize(
        x, s, g, "swiglu", recipe=recipe))
  else:
    step = jax.jit(lambda x, s, g, dy: jax.vjp(
        lambda x, s: jaxfuse.scaled_activation(x, s, "swiglu"), x, s)[1](dy))
  return step, (x, scales, sizes, dy)


def rms_norm_case(rows, hidden):
  keys = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(keys[0], (rows, hidden), jnp.bfloat16)
  residual = jax.random.normal(keys[1], (rows, hidden), jnp.bfloat16)
  gamma = jax.random.normal(keys[2], (hidden,), jnp.bfloat16)
  dy = jax.random.normal(keys[3], (rows, hidden), jnp.bfloat16)
  step = jax.jit(lambda x, r, g, dy: jax.vjp(
      lambda x, r, g: jaxfuse.add_rms_norm(x, r, g), x, r, g)[1]((dy, dy)))
  return step, (x, residual, gamma, dy)


def grouped_linear_fp8_case(groups, rows_per_group, k=2048, n=4096):
  """The FP8 grouped_linear forward (per-group current scaling, quantization included) as
  bench_grouped_linear's "op fwd" times it: where the time beyond the FP8 GEMM goes."""
  keys = jax.random.split(jax.random.key(4), 2)
  x = jax.random.normal(keys[0], (groups * rows_per_group, k), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (groups, k, n)) / k**0.5).astype(jnp.bfloat16)
  sizes = jnp.full((groups,), rows_per_group, jnp.int32)
  recipe = jaxfuse.quantization.Float8CurrentScaling(per_group=True)
  step = jax.jit(lambda x, w, s: jaxfuse.grouped_linear(x, w, s, recipe=recipe))
  return step, (x, w, sizes)


def linear_scale_add_fp8_case(tokens, features):
  """FP8 linear_scale_add forward (per-tensor current scaling): quantization passes
  against the FP8 cuBLASLt GEMM (issue 3's 1.7x goal over bf16 XLA)."""
  x, kernel, residual = bench_linear_scale_add.operands(tokens, features, 1)
  recipe = jaxfuse.quantization.Float8CurrentScaling(per_group=False)
  step = jax.jit(lambda x, w, r: jaxfuse.linear_scale_add(x, w, r, 0.5, recipe=recipe))
  return step, (x, kernel, residual)


def linear_scale_add_fp8_backward_case(tokens, features, xla=False, residual_cotangent=True):
  """bench_linear_scale_add's FP8 fwd+bwd step (residual donated, fed back; with
  ``residual_cotangent=False`` the step does not return d_out as the residual's
  cotangent), or its bf16 XLA baseline: the three GEMMs against the quantizing passes."""
  x, kernel, d_out = bench_linear_scale_add.operands(tokens, features, 1)
  recipe = None if xla else jaxfuse.quantization.Float8CurrentScaling(per_group=False)
  step = bench_linear_scale_add.make_step("xla" if xla else "ffi", backward=True, recipe=recipe,
                                          residual_cotangent=residual_cotangent)
  residual = jnp.copy(d_out)  # its own buffer: the step donates it
  return step, (x, kernel, residual, d_out), lambda args, out: (args[0], args[1], out[0], args[3])


def moe_case(name, recipe=None, pass_name="fwd+bwd", gathered=True):
  """bench_moe's layer step (router, permutation, grouped MLP, unpermute) on its inputs:
  what the layer spends outside the grouped GEMMs."""
  tokens, hidden, ffn, experts, top_k = bench_moe.CASES[name]
  x, router, k1, k2, dy = bench_moe.inputs(tokens, hidden, ffn, experts)
  return bench_moe.step("ffi", top_k, recipe, gathered)[pass_name], (x, router, k1, k2, dy)


def grouped_gemm_case(groups, rows_per_group, form, torch_baseline=False):
  """One bf16 grouped GEMM form on bench_grouped_linear's operands (K=2048, N=4096, equal
  sizes), jaxfuse's or torch._grouped_mm: the kernels' own device time, next to the
  benchmark's host-clock chunks (which also hold dispatch and the setup launch)."""
  sizes = [rows_per_group] * groups
  k, n = bench_grouped_linear.K, bench_grouped_linear.N
  if torch_baseline:
    import torch  # pylint: disable=g-import-not-at-top
    fn = bench_grouped_linear.torch_variants(sizes, k, n)[form][0]

    def torch_step():
      fn()
      torch.cuda.synchronize()

    return torch_step, ()
  m = groups * rows_per_group
  keys = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (groups, k, n)) / k**0.5).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
  offsets = jaxfuse.group_offsets(jnp.asarray(sizes, jnp.int32))
  return bench_grouped_linear.jaxfuse_steps(x, w, dy, offsets)[form]


CASES = {
    "grouped_mlp T=2048 H=1024 F=1024": lambda: grouped_mlp_case(2048, 1024, 1024),
    "grouped_mlp T=65536 H=2048 F=2048": lambda: grouped_mlp_case(65536, 2048, 2048),
    # The kernels of save_activation=True against the default's (which XLA's CSE makes
    # one activation kernel too, see grouped_mlp's docstring).
    "grouped_mlp saved activation T=65536 H=2048 F=2048": lambda: grouped_mlp_case(
        65536, 2048, 2048, save_activation=True),
    "grouped_mlp fwd T=2048 H=1024 F=1024": lambda: grouped_mlp_case(2048, 1024, 1024,
                                                                     pass_name="fwd"),
    "tokamax grouped_mlp fwd T=2048 H=1024 F=1024": lambda: tokamax_mlp_case(2048, 1024, 1024),
    "grouped_mlp fp8 T=65536 H=2048 F=2048": lambda: grouped_mlp_case(
        65536, 2048, 2048, bench_grouped_mlp.FP8_RECIPE),
    # The small case in FP8 (0.275 against bf16's 0.189 ms fwd+bwd in session 26): which of
    # its kernels cost more than the GEMMs save.
    "grouped_mlp fp8 T=2048 H=1024 F=1024": lambda: grouped_mlp_case(
        2048, 1024, 1024, bench_grouped_mlp.FP8_RECIPE),
    "linear_scale_add 4096^3 fwd+bwd": lambda: linear_scale_add_case(4096, 4096, 4096),
    "xla residual + alpha * (x @ kernel) 4096^3 fwd+bwd": lambda: linear_scale_add_case(
        4096, 4096, 4096, xla=True),
    "linear_scale_add 4096^3 fwd, residual donated": lambda: linear_scale_add_forward_case(
        4096, 4096),
    "xla residual + alpha * (x @ kernel) 4096^3 fwd, residual donated":
        lambda: linear_scale_add_forward_case(4096, 4096, xla=True),
    "swiglu fwd+bwd T=65536 2F=8192": lambda: activation_case(65536, 8192, False),
    "swiglu+fp8 quantize T=65536 2F=8192": lambda: activation_case(65536, 8192, True),
    "add_rms_norm bwd 65536x8192": lambda: rms_norm_case(65536, 8192),
    "grouped_linear fp8 op fwd 128x512": lambda: grouped_linear_fp8_case(128, 512),
    "grouped_linear fp8 op fwd 8x8192": lambda: grouped_linear_fp8_case(8, 8192),
    "linear_scale_add fp8 8192^3 fwd": lambda: linear_scale_add_fp8_case(8192, 8192),
    "linear_scale_add fp8 8192^3 fwd+bwd": lambda: linear_scale_add_fp8_backward_case(8192, 8192),
    "xla bf16 linear_scale_add 8192^3 fwd+bwd": lambda: linear_scale_add_fp8_backward_case(
        8192, 8192, xla=True),
    "linear_scale_add fp8 65536x4096 fwd+bwd": lambda: linear_scale_add_fp8_backward_case(
        65536, 4096),
    "xla bf16 linear_scale_add 65536x4096 fwd+bwd": lambda: linear_scale_add_fp8_backward_case(
        65536, 4096, xla=True),
    "linear_scale_add fp8 8192^3 fwd, 8-layer stack": lambda: linear_scale_add_stack_case(
        8192, 8192),
    "xla bf16 linear_scale_add 8192^3 fwd, 8-layer stack": lambda: linear_scale_add_stack_case(
        8192, 8192, xla=True),
    "linear_scale_add fp8 8192^3 fwd+bwd, 8-layer stack":
        lambda: linear_scale_add_stack_case(8192, 8192, backward=True),
    "xla bf16 linear_scale_add 8192^3 fwd+bwd, 8-layer stack":
        lambda: linear_scale_add_stack_case(8192, 8192, xla=True, backward=True),
    "linear_scale_add fp8 65536x4096 fwd+bwd, d_residual passed on":
        lambda: linear_scale_add_fp8_backward_case(65536, 4096, residual_cotangent=False),
    "xla bf16 linear_scale_add 65536x4096 fwd+bwd, d_residual passed on":
        lambda: linear_scale_add_fp8_backward_case(65536, 4096, xla=True,
                                                   residual_cotangent=False),
}
for _moe in bench_moe.CASES:
  CASES[f"moe {_moe}"] = lambda n=_moe: moe_case(n)
  CASES[f"moe fp8 {_moe}"] = lambda n=_moe: moe_case(n, bench_moe.FP8_RECIPE)
  CASES[f"moe fp8 permuted {_moe}"] = lambda n=_moe: moe_case(n, bench_moe.FP8_RECIPE,
                                                             gathered=False)
for _groups, _rows in ((8, 8192), (64, 512), (128, 512)):
  for _form in ("fwd", "dgrad", "wgrad"):
    for _torch in (False, True):
      CASES[f"grouped_gemm {'torch' if _torch else 'jaxfuse'} {_form} {_groups}x{_rows}"] = (
          lambda g=_groups, r=_rows, f=_form, t=_torch: grouped_gemm_case(g, r, f, t))


def short_kernel_name(name: str) -> str:
  """The first 100 characters, plus a CUTLASS SM90 kernel's cluster shape (mangled
  "NS5_1CILi<m>EEENSC_ILi<n>EEE" after the mainloop's stage count) when the name has one."""
  cluster = re.search(r"WarpSpecializedILi(\d+)ENS\d+_IJNS\d+_1CILi(\d+)EEENS\w+?_ILi(\d+)EEE", name)
  suffix = (f" [stages {cluster.group(1)}, cluster {cluster.group(2)}x{cluster.group(3)}]"
            if cluster else "")
  return name[:100] + suffix


def profile(step, args, carry=None):
  """(kernel rows, wall ms per step, summed kernel ms per step, span ms per step, gaps).

  wall: host time per step with a sync after each. The profiled steps are dispatched back
  to back with one sync at the end, as the benchmarks' chunks are: span is the device
  time per step from the first kernel's start to the last one's end, and gaps lists the
  idle device time between consecutive kernels, summed per (previous, next) kernel pair.

  carry(args, output) -> the next call's args, for steps that donate an argument."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch.profiler import ProfilerActivity, profile as torch_profile  # pylint: disable=g-import-not-at-top
  state = {"args": args, "out": None}

  def call(sync=True):
    out = step(*state["args"])
    if sync:
      out = jax.block_until_ready(out)
    state["out"] = out
    if carry is not None:
      state["args"] = carry(state["args"], out)

  for _ in range(3):
    call()
  start = time.perf_counter()
  for _ in range(STEPS):
    call()
  wall_ms = (time.perf_counter() - start) * 1e3 / STEPS
  with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(STEPS):
      call(sync=False)
    jax.block_until_ready(state["out"])
    torch.cuda.synchronize()
  kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
  by_name: dict[str, list[float]] = {}
  for event in kernels:
    by_name.setdefault(event.name, []).append(event.time_range.elapsed_us())
  # Full names: CUTLASS kernels of one family differ only past the first ~150 characters
  # of their mangled names (stages, cluster shape), e.g. kAdaptive's two grouped kernels.
  rows = sorted(({"kernel": name, "per_step": len(times) / STEPS,
                  "us_per_step": sum(times) / STEPS} for name, times in by_name.items()),
                key=lambda row: -row["us_per_step"])
  total_ms = sum(row["us_per_step"] for row in rows) / 1e3
  span_ms = 0.0
  gaps: dict[tuple[str, str], float] = collections.Counter()
  if kernels:
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    span_ms = (max(e.time_range.end for e in kernels) - ordered[0].time_range.start) / 1e3 / STEPS
    for before, after in zip(ordered, ordered[1:]):
      idle = after.time_range.start - before.time_range.end
      if idle > 0:
        gaps[(short_kernel_name(before.name), short_kernel_name(after.name))] += idle / STEPS
  gap_rows = [{"before": before, "after": after, "us_per_step": us}
              for (before, after), us in gaps.most_common(12)]
  return rows, wall_ms, total_ms, span_ms, {"gap_ms": sum(gaps.values()) / 1e3,
                                            "largest": gap_rows}


GRAPH_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL " \
              "--xla_gpu_graph_min_graph_size=1"


def command_buffer_summary(step, args) -> dict:
  """Which custom calls of the compiled step sit in HLO computations named command_buffer*.

  Only what XLA's HLO-level command-buffer scheduling shows: XLA versions that convert
  thunks to commands after emission keep their graphs out of the HLO. jax 0.11.2 on the
  H200 lists none here, yet replays every launch of the T=2048 grouped MLP step from CUDA
  graphs under its default flags: scripts/probe_command_buffers.py counts the launch calls.
  """
  if not hasattr(step, "lower"):  # a torch baseline
    return {"in_command_buffers": {}, "eager": {}}
  text = step.lower(*args).compile().as_text()
  inside, outside = collections.Counter(), collections.Counter()
  computation = ""
  for line in text.splitlines():
    header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if header:
      computation = header.group(1)
    target = re.search(r'custom_call_target="([^"]+)"', line)
    if target:
      (inside if "command_buffer" in computation else outside)[target.group(1)] += 1
  return {"in_command_buffers": dict(inside), "eager": dict(outside)}


def main():
  global STEPS
  parser = argparse.ArgumentParser()
  parser.add_argument("--cases", nargs="*", default=list(CASES), help="names in CASES")
  parser.add_argument("--grep", default=None,
                      help="a regular expression: only the CASES whose names it matches "
                           "(no spaces needed, e.g. 'fp8.T=65536', for gpu_run.sh entries)")
  parser.add_argument("--tag", default="", help="suffix of the results file name")
  parser.add_argument("--quick", action="store_true", help="accepted for gpu_run.sh; no-op")
  parser.add_argument("--steps", type=int, default=STEPS,
                      help="profiled steps per case (more: a longer sustained load)")
  parser.add_argument("--hlo-dir", default=None,
                      help="also write each case's compiled HLO there (to name XLA's fusions)")
  parser.add_argument("--with-graphs", action="store_true",
                      help=f"then profile the same cases again with XLA_FLAGS={GRAPH_FLAGS!r}")
  args = parser.parse_args()
  STEPS = args.steps
  names = args.cases
  if args.grep is not None:
    names = [name for name in names if re.search(args.grep, name)]
    if not names:
      parser.error(f"--grep {args.grep!r} matches no case")
  results = []
  for name in names:
    step, step_args, *carry = CASES[name]()
    graphs = command_buffer_summary(step, step_args)  # before donation consumes step_args
    if args.hlo_dir and hasattr(step, "lower"):
      os.makedirs(args.hlo_dir, exist_ok=True)
      file_name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".hlo.txt"
      with open(os.path.join(args.hlo_dir, file_name), "w") as hlo_file:
        hlo_file.write(step.lower(*step_args).compile().as_text())
    rows, wall_ms, total_ms, span_ms, gaps = profile(step, step_args, *carry)
    print(f"\n== {name}: wall {wall_ms:.3f} ms/step, kernels {total_ms:.3f} ms, "
          f"span {span_ms:.3f} ms (back to back), idle between kernels "
          f"{gaps['gap_ms']:.3f} ms, {sum(r['per_step'] for r in rows):.0f} kernels/step")
    print(f"   custom calls in command buffers: {graphs['in_command_buffers']}; "
          f"eager: {graphs['eager']}")
    common.print_table([{**row, "kernel": short_kernel_name(row["kernel"])} for row in rows[:25]],
                       ["kernel", "per_step", "us_per_step"])
    common.print_table(gaps["largest"], ["before", "after", "us_per_step"])
    results.append({"case": name, "wall_ms": wall_ms, "kernel_ms": total_ms,
                    "span_ms": span_ms, "idle_ms": gaps["gap_ms"],
                    "largest_idle": gaps["largest"], "command_buffers": graphs,
                    "kernels": rows})
    del step, step_args
  common.write_results("profile_kernels", results, tag=args.tag,
                       xla_flags=os.environ.get("XLA_FLAGS", ""))
  if args.with_graphs:
    flags = f"{os.environ.get('XLA_FLAGS', '')} {GRAPH_FLAGS}".strip()
    subprocess.run([sys.executable, "-m", "benchmarks.profile_kernels", "--tag", "graphs",
                    "--steps", str(STEPS),
                    "--cases", *names], env=dict(os.environ, XLA_FLAGS=flags), check=True)


if __name__ == "__main__":
  main()
