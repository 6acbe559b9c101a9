"""FP8 GEMM ceilings on this GPU: what cuBLAS and CUTLASS reach through torch, with and
without fast accumulation.

The promoted FP8 mainloop (fp32 promotion of the tensor cores' partial sums every k-tile,
TransformerEngine's split accumulator for the gradient GEMMs) is what jaxfuse's FP8 dgrad
and wgrad run; fast accumulation is what its forward runs. This benchmark puts a number on
both for the vendors' kernels, in the same run as jaxfuse's own FP8 grouped GEMM:

- torch._scaled_mm (cuBLASLt), per-tensor scales, e4m3 x e4m3 -> bf16, use_fast_accum
  False / True, at 8192^3 and at the grouped cases' total size (65536 x 2048 x 4096);
- torch._scaled_grouped_mm (CUTLASS, row-wise scales) on 8 groups of 8192 rows, K = 2048,
  N = 4096, both accumulation modes, where the installed torch has it;
- jaxfuse's FP8 grouped forward (promoted and fast accumulation) and dgrad on the same
  8 x 8192 case (pre-quantized operands, no quantization in the timing).

Times are CUDA-event medians (torch) and chunked host-clock medians (jaxfuse, common.time_fn).

    python -m benchmarks.bench_fp8_ceilings [--calls N]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks import common
from jaxfuse._src import ffi
from jaxfuse._src.ops.grouped_linear import ffi as grouped_ffi


def _row(kernel: str, shape: str, fast: bool, ms: float, flops: float) -> dict:
  return {"kernel": kernel, "shape": shape, "fast_accum": fast, "ms": ms,
          "tflops": flops / ms * 1e-9}


def _torch_rows(calls: int) -> list[dict]:
  import torch  # pylint: disable=g-import-not-at-top  (torch is optional: baselines only)
  rows = []
  fp8 = torch.float8_e4m3fn
  one = torch.ones((), device="cuda", dtype=torch.float32)
  for m, k, n in ((8192, 8192, 8192), (65536, 2048, 4096)):
    a = torch.randn(m, k, device="cuda").to(fp8)
    b = torch.randn(n, k, device="cuda").to(fp8).t()  # column-major [k, n], as cuBLASLt wants
    for fast in (False, True):
      def call(a=a, b=b, fast=fast):
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                use_fast_accum=fast)
      rows.append(_row("torch._scaled_mm (cuBLASLt)", f"{m}x{k}x{n}", fast,
                       common.time_torch_ms(call, calls), 2 * m * k * n))
  groups, rows_per_group, k, n = 8, 8192, 2048, 4096
  m = groups * rows_per_group
  if hasattr(torch, "_scaled_grouped_mm"):
    a = torch.randn(m, k, device="cuda").to(fp8)
    b = torch.randn(groups, n, k, device="cuda").to(fp8).transpose(-2, -1)  # [G, k, n], K-major
    scale_a = torch.ones(m, device="cuda", dtype=torch.float32)
    scale_b = torch.ones(groups, n, device="cuda", dtype=torch.float32)
    offs = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * rows_per_group
    for fast in (False, True):
      def call(fast=fast):
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)
      try:
        ms = common.time_torch_ms(call, calls)
      except (RuntimeError, TypeError) as error:  # an unsupported mode in this torch build
        rows.append({"kernel": "torch._scaled_grouped_mm", "shape": f"{groups}x{rows_per_group}",
                     "fast_accum": fast, "error": str(error)[:200]})
        continue
      rows.append(_row("torch._scaled_grouped_mm", f"{groups}x{rows_per_group}", fast, ms,
                       2 * m * k * n))
  return rows


def _jaxfuse_rows(calls: int) -> list[dict]:
  groups, rows_per_group, k, n = 8, 8192, 2048, 4096
  m = groups * rows_per_group
  keys = jax.random.split(jax.random.key(0), 3)
  f8 = jnp.float8_e4m3fn
  x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(f8)
  w_t = jax.random.normal(keys[1], (groups, n, k), jnp.float32).astype(f8)  # forward: K-major
  w = jax.random.normal(keys[1], (groups, k, n), jnp.float32).astype(f8)
  dy = jax.random.normal(keys[2], (m, n), jnp.float32).astype(jnp.float8_e5m2)
  offsets = jnp.arange(groups + 1, dtype=jnp.int32) * rows_per_group
  ones = jnp.ones((groups,), jnp.float32)
  rows = []
  for fast in (False, True):
    fwd = jax.jit(lambda x, w_t, o, fast=fast: grouped_ffi.grouped_gemm(
        x, w_t, o, form=grouped_ffi.FORWARD, a_scale_inv=ones, b_scale_inv=ones,
        fast_accumulation=fast))
    ms = common.time_fn(fwd, [(x, w_t, offsets)] * calls)["median_ms"]
    rows.append(_row("jaxfuse grouped fwd", f"{groups}x{rows_per_group}", fast, ms,
                     2 * m * k * n))
  dgrad = jax.jit(lambda dy, w, o: grouped_ffi.grouped_gemm(
      dy, w, o, form=grouped_ffi.DGRAD, a_scale_inv=ones, b_scale_inv=ones))
  ms = common.time_fn(dgrad, [(dy, w, offsets)] * calls)["median_ms"]
  rows.append(_row("jaxfuse grouped dgrad (e5m2 x e4m3)", f"{groups}x{rows_per_group}", False,
                   ms, 2 * m * k * n))
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--calls", type=int, default=50)
  parser.add_argument("--tag", default="")
  args = parser.parse_args()
  common.warm_up_device(jnp.dot, jnp.ones((4096, 4096), jnp.bfloat16),
                        jnp.ones((4096, 4096), jnp.bfloat16))
  rows = _torch_rows(args.calls)
  if ffi.cuda_built():  # the torch rows alone need no jaxfuse build
    rows += _jaxfuse_rows(args.calls)
  common.print_table(rows, ("kernel", "shape", "fast_accum", "ms", "tflops", "error"))
  common.write_results("fp8_ceilings", rows, tag=args.tag,
                       method="torch: CUDA events per call (median); jaxfuse: common.time_fn")


if __name__ == "__main__":
  main()
