"""Which cuBLAS kernels XLA runs for the dense ceilings of bench_grouped_linear, and how long
they take: the dense GEMM (x [m, 2048] @ one [2048, 4096] weight) and the batched GEMMs of
equal groups (x as [G, rows, 2048] against G weights) in the forward, dgrad and wgrad forms,
at 8 x 8192, 64 x 512 and 128 x 512 rows. Kernel names and device time per call come from
CUPTI through torch.profiler (benchmarks/common.kernel_times_alternating); the tile, cluster
and schedule in a name tell what a grouped kernel would have to match (cuda/gpu/grouped_gemm/
README.md). Prints one line per case and form; writes nothing.

    python scripts/probe_cublas_kernels.py   (from the repository root; a GPU and torch)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import common

K, N = 2048, 4096
SHAPES = {"8x8192": (8, 8192), "64x512": (64, 512), "128x512": (128, 512)}


def batched_forms(groups: int, rows: int):
  """{form: (fn, args, keep_args)} of the batched GEMMs and the dense forward."""
  keys = jax.random.split(jax.random.key(groups * rows), 3)
  x = jax.random.normal(keys[0], (groups, rows, K), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (groups, K, N)) / K**0.5).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[2], (groups, rows, N), jnp.bfloat16)
  return {
      "dense fwd": (jax.jit(jnp.matmul), (x.reshape(-1, K), w[0]), common.keep_args),
      "batched fwd": (jax.jit(lambda x, w: jnp.einsum("gmk,gkn->gmn", x, w)), (x, w),
                      common.keep_args),
      "batched dgrad": (jax.jit(lambda dy, w: jnp.einsum("gmn,gkn->gmk", dy, w)), (dy, w),
                        common.keep_args),
      "batched wgrad": (jax.jit(lambda x, dy: jnp.einsum("gmk,gmn->gkn", x, dy)), (x, dy),
                        common.keep_args),
  }


def main() -> None:
  for case, (groups, rows) in SHAPES.items():
    flops = 2 * groups * rows * K * N
    for name, variant in batched_forms(groups, rows).items():
      names: dict[str, list[str]] = {}
      times = common.kernel_times_alternating({name: variant}, lambda kernel, n=name: n,
                                              rounds=3, chunk=10, kernel_names=names)
      ms = times.get(name)
      tflops = flops / (ms * 1e-3) / 1e12 if ms else float("nan")
      print(f"{case:8s} {name:14s} {ms or float('nan'):.3f} ms {tflops:6.1f} TFLOP/s "
            f"kernels: {names.get(name, [])[:3]}", flush=True)


if __name__ == "__main__":
  main()
