"""Cost per custom call of a launch-bound chain (issue 5's T=2048 MLP): host and graph replay.

Each case jits a chain of CALLS calls of one op on tiny inputs (separated by optimization
barriers, so XLA fuses nothing across calls), so the device work is a few microseconds
and the time per call is what the host spends to issue it: JAX dispatch amortized over
the chain, XLA's thunk, the FFI call frame and the handler (argument checks, CUTLASS's
host-side setup, the launches). XLA's own ops (a cuBLAS dot, a fusion) are the yardstick.
The T=2048 grouped MLP step (forward + backward) runs beside them.

Every case runs under three XLA command-buffer settings, each in its own process
(XLA_FLAGS is read once per process):
  none:    --xla_gpu_enable_command_buffer= (every thunk launched eagerly);
  default: jax's defaults;
  all:     FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL with --xla_gpu_graph_min_graph_size=1.
Only "none" measures the host's cost per call. Under the other two, jax 0.11.2 replays the
chain from CUDA graphs without calling the handlers (scripts/probe_command_buffers.py), so
a row is the graph's device time per call: the tiny kernels and the gaps between them.

    python -m benchmarks.bench_dispatch [--calls 16] [--tag TAG]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODES = {
    "none": "--xla_gpu_enable_command_buffer=",
    "default": "",
    "all": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL "
           "--xla_gpu_graph_min_graph_size=1",
}
ROWS, WIDTH, GROUPS = 256, 128, 8


def chain(op, calls):
  """jit of `calls` applications of op(state) -> state, with a barrier after each."""
  import jax  # pylint: disable=g-import-not-at-top

  def run(state, *constants):
    for _ in range(calls):
      state = jax.lax.optimization_barrier(op(state, *constants))
    return state

  return jax.jit(run)


def cases():
  """name -> (op, state, constants); tiny bf16 inputs so that device time is negligible."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import jaxfuse  # pylint: disable=g-import-not-at-top

  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (ROWS, WIDTH), jnp.bfloat16)
  square = (jax.random.normal(keys[1], (WIDTH, WIDTH)) / WIDTH**0.5).astype(jnp.bfloat16)
  experts = (jax.random.normal(keys[2], (GROUPS, WIDTH, WIDTH)) / WIDTH**0.5).astype(jnp.bfloat16)
  sizes = jnp.asarray(np.full(GROUPS, ROWS // GROUPS, np.int32))
  scales = jax.random.uniform(keys[3], (ROWS,), jnp.float32, 0.5, 1.0)
  gamma = jnp.ones((WIDTH,), jnp.bfloat16)
  return {
      "jaxfuse grouped_linear": (lambda s, w, g: jaxfuse.grouped_linear(s, w, g),
                                 x, (experts, sizes)),
      "jaxfuse linear_scale_add": (lambda s, xx, w: jaxfuse.linear_scale_add(xx, w, s, 0.5),
                                   x, (x, square)),
      "jaxfuse scaled_activation (srelu)": (
          lambda s, c: jaxfuse.scaled_activation(s, c, "srelu"), x, (scales,)),
      "jaxfuse rms_norm": (lambda s, g: jaxfuse.rms_norm(s, g), x, (gamma,)),
      "xla dot (cuBLAS)": (lambda s, w: s @ w, x, (square,)),
      "xla fusion (elementwise)": (lambda s: jnp.tanh(s) * 1.5, x, ()),
  }


def measure(calls: int, with_mlp: bool) -> list[dict]:
  """All cases under the current process's XLA_FLAGS."""
  import jax  # pylint: disable=g-import-not-at-top

  from benchmarks import bench_grouped_mlp, common  # pylint: disable=g-import-not-at-top

  rows = []
  for name, (op, state, constants) in cases().items():
    step = chain(op, calls)
    timing = common.time_fn(step, [(state, *constants)] * 43)
    rows.append({"case": name, "calls_per_step": calls, "step_ms": timing["median_ms"],
                 "us_per_call": timing["median_ms"] * 1e3 / calls})
  for tokens, hidden, ffn in ((2048, 1024, 1024),) if with_mlp else ():
    args = bench_grouped_mlp.jax_inputs(tokens, hidden, ffn, 0)
    x, k1, k2, scales, dy = args
    sizes = jax.numpy.asarray(bench_grouped_mlp.group_sizes(tokens))
    step = bench_grouped_mlp.jax_fns("ffi")["fwd+bwd"]
    timing = common.time_fn(step, [(x, k1, k2, scales, sizes, dy)] * 43)
    rows.append({"case": f"grouped_mlp fwd+bwd T={tokens} H={hidden} F={ffn}",
                 "calls_per_step": 1, "step_ms": timing["median_ms"],
                 "us_per_call": timing["median_ms"] * 1e3})
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--calls", type=int, default=16, help="op calls per jitted step")
  parser.add_argument("--no-mlp", action="store_true",
                      help="skip the grouped MLP step (slow on the CPU handlers)")
  parser.add_argument("--tag", default="", help="suffix of the results file name (knob A/Bs)")
  parser.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:  # one mode, in this process: print the rows as one JSON line
    print("ROWS " + json.dumps(measure(args.calls, not args.no_mlp)), flush=True)
    return

  from benchmarks import common  # pylint: disable=g-import-not-at-top

  rows = []
  for mode, flags in MODES.items():
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
    result = subprocess.run([sys.executable, "-m", "benchmarks.bench_dispatch", "--child", mode,
                             "--calls", str(args.calls)] + (["--no-mlp"] if args.no_mlp else []),
                            env=env, capture_output=True,
                            text=True, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("ROWS ")]
    if result.returncode != 0 or not lines:
      print(f"mode {mode} failed (rc {result.returncode}):\n{result.stderr[-3000:]}", flush=True)
      continue
    for row in json.loads(lines[-1][5:]):
      row["command_buffers"] = mode
      rows.append(row)
      print(row, flush=True)
  common.print_table(rows, ["case", "command_buffers", "calls_per_step", "step_ms",
                            "us_per_call"])
  common.write_results("dispatch", rows, tag=args.tag, modes=MODES, shapes=f"{ROWS}x{WIDTH} bf16, "
                       f"{GROUPS} groups", baseline="XLA's own dot and fusion, same process")


if __name__ == "__main__":
  main()
