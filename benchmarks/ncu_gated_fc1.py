"""Diagnostic: run the gated FC1 kernel and the plain FC1 + activation pair twice each at
T=65536 H=F=2048, for Nsight Compute (scripts call it under ncu)."""
import jax

from benchmarks import bench_gated_fc1 as bench

x, w, offsets, scales = bench.inputs(65536, 2048, 2048, 0)
for fn in (bench.gated, bench.two_kernels):
  jitted = jax.jit(fn)
  for _ in range(2):
    jax.block_until_ready(jitted(x, w, offsets, scales))
print("done")
