"""quantize_transposed on one shape, once after a compile-only warm-up: a target for Nsight
Compute on the GPU machine (see scripts/ncu_activations.py for the setup), e.g.

    cd /tmp/jaxfuse-head && XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD \\
        ncu --clock-control none -k regex:QuantizeTransposed --section SpeedOfLight \\
        python3 scripts/ncu_quantize_transposed.py 128 2048 4096 [--untransposed]

Arguments: B R C of the bf16 input [B, R, C] (default: 128 experts of 2048 x 4096, the
grouped GEMM's weights at 128 x 512). JAXFUSE_QUANTIZE_TRANSPOSED=general picks the
general kernel.
"""

import sys

import jax
import jax.numpy as jnp

from jaxfuse._src.ops.quantize import ffi as quantize_ffi

args = [a for a in sys.argv[1:] if not a.startswith("--")]
batch, rows, cols = (int(a) for a in args) if args else (128, 2048, 4096)
untransposed = "--untransposed" in sys.argv[1:]
x = jax.random.normal(jax.random.key(0), (batch, rows, cols), jnp.bfloat16)
amax = jnp.max(jnp.abs(x).astype(jnp.float32), axis=(1, 2))
step = jax.jit(lambda x, a: quantize_ffi.quantize_transposed(x, a, fmt="e4m3",
                                                             untransposed=untransposed))
step.lower(x, amax).compile()
print(f"quantize_transposed [{batch}, {rows}, {cols}] untransposed={untransposed}", flush=True)
jax.block_until_ready(step(x, amax))
