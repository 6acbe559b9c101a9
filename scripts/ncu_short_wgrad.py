"""The bf16 wgrad of G equal groups, jaxfuse's grouped kernel and XLA's batched GEMM (cuBLAS),
one call each after a compile-only warm-up: a target for Nsight Compute on the GPU machine,
to see why cuBLAS's batched kernel runs a 512-row contraction ~25% faster than CUTLASS's
SM90 kernels, grouped or not (cuda/gpu/grouped_gemm/README.md, "The short-contraction
wgrad"). After `gpu_run.sh prebuilt` (the prebuilt extension sits in /tmp/jaxfuse-head):

    cd /tmp/jaxfuse-head && XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD \\
        XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false" \\
        ncu --clock-control none -k regex:'device_kernel|nvjet' --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python3 scripts/ncu_short_wgrad.py [G ROWS K N]

Arguments: groups, rows per group, K (x's columns) and N (dy's columns); default 64 512
2048 4096, the issue's 64 x 512 case. The kernels run in the order printed: jaxfuse's setup
kernel, its CUTLASS wgrad kernel (JAXFUSE_GROUPED_GEMM_WGRAD_PAIR=0 or
JAXFUSE_GROUPED_GEMM_TILE=large pick the other configs, per process), then XLA's batched
GEMM. Without a GPU it runs the CPU handlers (use small shapes). The XLA flags keep XLA's
GEMM autotuner out: under ncu every cuBLAS candidate it times is profiled too, and in
session 37 (without the flags) 16 nvjet candidates were, while the batched call's own
kernel matched neither name. With `--section SourceCounters -o REPORT` instead of the
sections above, scripts/ncu_stall_table.py reads the per-instruction stall samples
(its docstring has the commands).
"""

import sys

import jax
import jax.numpy as jnp

from jaxfuse._src.ops.grouped_linear import ffi as grouped_ffi
import jaxfuse

groups, rows, k, n = (int(a) for a in sys.argv[1:5]) if len(sys.argv) >= 5 else (64, 512, 2048,
                                                                                 4096)
x = jax.random.normal(jax.random.key(0), (groups * rows, k), jnp.bfloat16)
dy = jax.random.normal(jax.random.key(1), (groups * rows, n), jnp.bfloat16)
offsets = jaxfuse.group_offsets(jnp.full((groups,), rows, jnp.int32))
grouped = jax.jit(lambda x, dy, o: grouped_ffi.grouped_gemm(x, dy, o, form=grouped_ffi.WGRAD))
batched = jax.jit(lambda x, dy: jnp.einsum("gmk,gmn->gkn", x.reshape(groups, rows, k),
                                           dy.reshape(groups, rows, n)))
grouped.lower(x, dy, offsets).compile()
batched.lower(x, dy).compile()
jax.block_until_ready((x, dy, offsets))
print(f"1. jaxfuse grouped wgrad, {groups} x {rows} rows, k={k}, n={n}", flush=True)
ours = jax.block_until_ready(grouped(x, dy, offsets))
print("2. XLA batched wgrad (cuBLAS)", flush=True)
theirs = jax.block_until_ready(batched(x, dy))
error = float(jnp.max(jnp.abs(ours.astype(jnp.float32) - theirs.astype(jnp.float32))) /
              jnp.max(jnp.abs(theirs.astype(jnp.float32))))
print(f"max relative difference {error:.2e}", flush=True)
