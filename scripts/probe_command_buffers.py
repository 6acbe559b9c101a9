"""Which launches of the T=2048 grouped MLP step reach the GPU through CUDA graphs.

XLA records thunks into command buffers (CUDA graphs) by command type
(--xla_gpu_enable_command_buffer) and, for FFI custom calls, by the handler's
command-buffer trait. Whether jaxfuse's custom calls are captured decides where the host
time of a launch-bound step goes, and XLA's optimized HLO does not show it when the
conversion happens after thunk emission. This script looks at the launches themselves:
for each command-buffer setting (one process each: XLA_FLAGS is read once) it profiles
steps with CUPTI (torch's profiler) and counts

  * the CUDA runtime/driver calls that launch work, by name: a kernel launched eagerly
    shows up as a launch call of its own, a kernel replayed from a CUDA graph does not (the
    handlers are not even called then: XLA replays what it recorded);
  * the kernels' device executions by name (kineto's trace carries no graph id, so the
    launch calls are the evidence);

and times the step back to back on the host clock (one input set, 200 calls, one sync).

At b1d3225f on the H200 (logs/probe_command_buffers_2026-11-30_b1d3225f_s18call5.log):
with command buffers off, 15 launch calls a step (0.250 ms a step); with jax's defaults or
with every type forced, none (0.180 / 0.179 ms): every jaxfuse custom call of the step
already runs inside XLA's CUDA graphs by default.

    python scripts/probe_command_buffers.py [--tokens 2048] [--steps 20]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

MODES = {
    "none": "--xla_gpu_enable_command_buffer=",
    "default": "",
    "all": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL "
           "--xla_gpu_graph_min_graph_size=1",
}


def short(name: str) -> str:
  for marker in ("SetupKernel", "GroupOffsetsKernel", "RowKernel", "StagedRowKernel"):
    if marker in name:
      return marker
  if "cutlass" in name[:40]:
    return "cutlass grouped GEMM"
  return name[:60]


def child(tokens: int, steps: int) -> dict:
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
  import jax  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  from torch.profiler import ProfilerActivity, profile  # pylint: disable=g-import-not-at-top

  sys.path.insert(0, os.getcwd())
  from benchmarks import profile_kernels  # pylint: disable=g-import-not-at-top

  step, args = profile_kernels.grouped_mlp_case(tokens, 1024, 1024)
  for _ in range(20):
    out = step(*args)
  jax.block_until_ready(out)

  calls = 200
  start = time.perf_counter()
  for _ in range(calls):
    out = step(*args)
  jax.block_until_ready(out)
  wall_ms = (time.perf_counter() - start) / calls * 1e3

  with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(steps):
      out = step(*args)
    jax.block_until_ready(out)
    torch.cuda.synchronize()
  with tempfile.TemporaryDirectory() as directory:
    path = os.path.join(directory, "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
      events = json.load(f)["traceEvents"]

  api, kernels = collections.Counter(), collections.Counter()
  for event in events:
    category = event.get("cat", "")
    name = event.get("name", "")
    if category in ("cuda_runtime", "cuda_driver"):
      if "aunch" in name or "Graph" in name:
        api[name] += 1
    elif category == "kernel":
      kernels[short(name)] += 1
  return {"wall_ms_per_step": wall_ms, "steps_profiled": steps,
          "api_calls": dict(api), "kernels": dict(kernels)}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--tokens", type=int, default=2048)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print("RESULT " + json.dumps(child(args.tokens, args.steps)), flush=True)
    return
  for mode, flags in MODES.items():
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
    result = subprocess.run([sys.executable, __file__, "--child", mode, "--tokens",
                             str(args.tokens), "--steps", str(args.steps)],
                            env=env, capture_output=True, text=True, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
      print(f"== {mode}: failed (rc {result.returncode})\n{result.stderr[-3000:]}", flush=True)
      continue
    report = json.loads(lines[-1][7:])
    print(f"== {mode} ({flags or 'jax defaults'}): {report['wall_ms_per_step']:.4f} ms per "
          f"step on the host clock", flush=True)
    print(f"   launch API calls in {report['steps_profiled']} steps: {report['api_calls']}")
    print(f"   kernel executions: {report['kernels']}")


if __name__ == "__main__":
  main()
