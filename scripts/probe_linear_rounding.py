"""Does linear_scale_add round its product once (GPU)? For bf16 shapes from one row up,
compares the op with float64 residual + alpha * x @ kernel and counts the elements past
one rounding, and among those the ones equal to round(residual + round(alpha * x @ kernel)):
the two roundings of an algorithm that stores the product in bfloat16 before adding the
residual.

By default the op runs what it runs (the CUTLASS residual GEMM: every shape here has K and
N multiples of 8). `--gemm cublaslt` probes cuBLASLt instead
(JAXFUSE_LINEAR_SCALE_ADD_GEMM=cublaslt), as do the two cuBLASLt options:
`--candidates N` also runs each of the heuristic's first N candidates
(JAXFUSE_CUBLASLT_CANDIDATE) on every shape, and JAXFUSE_CUBLASLT_LOG=1 describes each one
(algorithm id, tile, stages, split-K count, reduction scheme); `--compute pedantic` runs
everything with JAXFUSE_CUBLASLT_COMPUTE=pedantic (CUBLAS_COMPUTE_32F_PEDANTIC).

  python scripts/probe_linear_rounding.py [--gemm cublaslt] [--candidates 8]
      [--compute pedantic]
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jaxfuse

ROWS = (1, 2, 3, 8, 16, 64, 256)
WIDTHS = ((8, 8), (64, 64), (256, 256), (1024, 8), (8, 1024), (4096, 4096))


def bf16(values):
  return np.asarray(values, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def check(rows, k, n, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
  kernel = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
  residual = jnp.asarray(rng.standard_normal((rows, n)), jnp.bfloat16)
  # A new function each time: a new executable, whose custom call picks its algorithm anew.
  out = jax.jit(lambda x, w, r: jaxfuse.linear_scale_add(x, w, r, implementation="ffi"))(
      x, kernel, residual)
  x64, w64, r64 = (np.asarray(v, np.float64) for v in (x, kernel, residual))
  product = x64 @ w64
  exact = r64 + product
  magnitude = np.abs(r64) + np.abs(x64) @ np.abs(w64)
  bound = 2.0**-8 * np.abs(exact) + k * 2.0**-22 * magnitude + 2.0**-133
  out64 = np.asarray(out, np.float64)
  past = np.abs(out64 - exact) > bound
  twice = out64 == bf16(r64 + bf16(product))
  return dict(rows=rows, k=k, n=n, elements=int(out64.size), past_one_rounding=int(past.sum()),
              of_which_two_roundings=int((past & twice).sum()),
              worst_in_bounds=float(np.max(np.abs(out64 - exact) / bound)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--candidates", type=int, default=0,
                      help="also run each of the heuristic's first N candidates")
  parser.add_argument("--compute", choices=("default", "pedantic"), default="default",
                      help="cuBLASLt compute type (JAXFUSE_CUBLASLT_COMPUTE)")
  parser.add_argument("--gemm", choices=("default", "cublaslt"), default="default",
                      help="the 16-bit forward's GEMM (JAXFUSE_LINEAR_SCALE_ADD_GEMM)")
  args = parser.parse_args()
  if args.compute == "pedantic":
    os.environ["JAXFUSE_CUBLASLT_COMPUTE"] = "pedantic"
  if args.gemm == "cublaslt" or args.candidates or args.compute != "default":
    # Read once per process, at the first call: set before any.
    os.environ["JAXFUSE_LINEAR_SCALE_ADD_GEMM"] = "cublaslt"
  runs = [None] + list(range(args.candidates))
  for candidate in runs:
    if candidate is None:
      os.environ.pop("JAXFUSE_CUBLASLT_CANDIDATE", None)
    else:
      os.environ["JAXFUSE_CUBLASLT_CANDIDATE"] = str(candidate)
    for rows in ROWS:
      for k, n in WIDTHS:
        if rows * k * n > 2**28:
          continue
        row = check(rows, k, n)
        row["candidate"] = "heuristic" if candidate is None else candidate
        row["compute"] = args.compute
        row["gemm"] = os.environ.get("JAXFUSE_LINEAR_SCALE_ADD_GEMM", "default")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
