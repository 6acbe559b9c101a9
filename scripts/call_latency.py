"""Diagnostic: per-call wall time of one large op at several chunk lengths (calls dispatched
back to back, one sync per chunk), for jaxfuse's grouped GEMM, XLA's dense dot and
torch._grouped_mm. A chunk of n calls costs latency + n * device time, so the n = 1 row
is the latency and long chunks approach the kernel time. Run it under different XLA_FLAGS
(e.g. --xla_gpu_enable_command_buffer=) to see what XLA's runtime adds per call.

    PYTHONPATH=. python3 scripts/call_latency.py [--groups 64 --rows 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # leave room for torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxfuse  # noqa: E402
from benchmarks import bench_grouped_linear  # noqa: E402

CHUNKS = (1, 2, 5, 20)


def per_call_ms(fn, wait, calls, repeats=7):
  fn()
  wait(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn()
    wait(out)
    times.append((time.perf_counter() - start) * 1e3 / calls)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--groups", type=int, default=64)
  parser.add_argument("--rows", type=int, default=512)
  args = parser.parse_args()
  k, n = bench_grouped_linear.K, bench_grouped_linear.N
  sizes = [args.rows] * args.groups
  m = sum(sizes)
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (args.groups, k, n)) / k**0.5).astype(jnp.bfloat16)
  dense_w = w[0]
  offsets = jaxfuse.group_offsets(jnp.asarray(sizes, jnp.int32))
  fwd, fwd_args = bench_grouped_linear.jaxfuse_steps(x, w, x, offsets)["fwd"]
  dense = jax.jit(jnp.matmul)
  variants = {
      "jaxfuse grouped fwd": (lambda: fwd(*fwd_args), jax.block_until_ready),
      "XLA dense dot, same m k n": (lambda: dense(x, dense_w), jax.block_until_ready),
  }
  try:
    import torch  # pylint: disable=g-import-not-at-top
    torch_fwd = bench_grouped_linear.torch_variants(sizes, k, n)["fwd"][0]
    variants["torch._grouped_mm fwd"] = (torch_fwd, lambda _: torch.cuda.synchronize())
  except (ImportError, KeyError):
    pass
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; {args.groups} x {args.rows}, "
        f"K={k} N={n}; ms per call by chunk length {CHUNKS}")
  for name, (fn, wait) in variants.items():
    row = [per_call_ms(fn, wait, calls) for calls in CHUNKS]
    print(f"{name:28s} " + "  ".join(f"{value:7.3f}" for value in row))


if __name__ == "__main__":
  main()
