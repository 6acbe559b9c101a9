"""Runs each call of tests/ops/test_grouped_linear_fp8_blockwise.py's
test_handler_rejects_bad_scales_and_types (the good one, then four bad inputs) in its own
process on the GPU, with the default mainloop, JAXFUSE_GROUPED_GEMM_FP8_MAINLOOP=stock and
JAXFUSE_GROUPED_GEMM_TILE=large, and prints each one's exit status and result: a crash
then names its call and its kernel config. Written for a segmentation fault seen once in
that test on an editable build made on the GPU machine (benchmarks/results/README.md,
session 32).

    python scripts/probe_blockwise_bad_inputs.py   (from the repository root; a GPU)
"""

from __future__ import annotations

import os
import subprocess
import sys

# One call of the test, chosen by argv[1]: 0 the good inputs, 1-4 the bad ones.
CALL = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
from jaxfuse._src import ffi as ffi_registry
from jaxfuse._src.ops.grouped_linear import ffi as gemm_ffi
from tests.ops.test_grouped_linear_fp8 import random_fp8
ffi_registry.ensure_registered()
blocks = lambda s: -(-s // 128)
m, k, n, groups = 32, 272, 144, 2
offsets = jnp.asarray([0, 16, 32], jnp.int32)
x = random_fp8(82, (m, k), jnp.float8_e4m3fn)
w_t = random_fp8(83, (groups, n, k), jnp.float8_e4m3fn)
good_a = jnp.ones((m, blocks(k)), jnp.float32)
good_b = jnp.ones((groups, blocks(n), blocks(k)), jnp.float32)
calls = [(x, w_t, offsets, good_a, good_b),
         (x, w_t, offsets, jnp.ones((m, 1), jnp.float32), good_b),
         (x, w_t, offsets, good_a, jnp.ones((groups, blocks(k), blocks(n)), jnp.float32)),
         (x, w_t, offsets, good_a.astype(jnp.bfloat16), good_b),
         (x.astype(jnp.float8_e5m2), w_t, offsets, good_a, good_b)]
index = int(sys.argv[1])
call = jax.jit(lambda *u: gemm_ffi.grouped_gemm_blockwise(*u, form=gemm_ffi.FORWARD))
try:
  out = np.asarray(call(*calls[index]))
  print("case", index, "ran, finite:", bool(np.isfinite(out).all()),
        "max", float(np.abs(out).max()))
except Exception as error:  # pylint: disable=broad-except
  print("case", index, "raised", type(error).__name__, str(error)[:300])
"""

MODES = [("pipelined", {}), ("stock", {"JAXFUSE_GROUPED_GEMM_FP8_MAINLOOP": "stock"}),
         ("large", {"JAXFUSE_GROUPED_GEMM_TILE": "large"})]


def main() -> int:
  for label, overrides in MODES:
    for index in range(5):
      env = dict(os.environ, **overrides)
      env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
      result = subprocess.run([sys.executable, "-c", CALL, str(index)], env=env,
                              capture_output=True, text=True, timeout=120)
      last_line = (result.stdout.strip().splitlines() or [""])[-1]
      error_tail = result.stderr.strip().splitlines()[-3:] if result.returncode else []
      print(f"[{label}] case {index}: rc={result.returncode} {last_line} {error_tail}",
            flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
