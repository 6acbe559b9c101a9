"""Grouped GEMM (MoE expert layer): jaxfuse vs jax.lax.ragged_dot vs torch._grouped_mm vs
tokamax.

Forward (x_g @ W_g), dgrad (dy_g @ W_g^T) and wgrad (x_g^T @ dy_g) TFLOP/s, bf16, on the
issue's cases, plus a dense bf16 GEMM of the same total size through XLA as the ceiling
(x [m, K] @ one [K, N] weight, timed in the same alternating chunks as the forward, so
jaxfuse_vs_dense is a ratio under the same clocks), all in one process on one GPU. FLOPs count routed rows only: 2 * sum(sizes) * K * N.
On equal group sizes covering every row, XLA's batched GEMM of the same groups (x as
[G, rows, K] against the G weights, jnp.einsum) runs in the same chunks as each form: a
dense kernel with the grouped one's memory traffic (G distinct weights read, or for the
wgrad G weight gradients written), so jaxfuse_vs_batched_dense separates what the grouping
costs from what reading G weights does (kernel_jaxfuse_vs_batched_dense: the same from
device time, alternating the two alone; the results' batched_dense_kernel_names: which
cuBLAS kernels XLA ran).

FP8 rows (precision "fp8"): the FP8 grouped GEMM on pre-quantized E4M3 operands (fwd:
x [m, K] x w^T [G, N, K], fast accumulation as the recipe's default; "fp8 promoted" the same
forward with fp32 promotion; dgrad: E5M2 dy x E4M3 w [G, K, N]), and "op fwd" / "op fwd+bwd":
jaxfuse.grouped_linear with recipe=Float8CurrentScaling(per_group=True), quantization
included, against the bf16 op (precision "bf16", same rows); "fp8 quantized kernel" the
op on weights quantized once: its forward on a constant copy (jaxfuse.quantize_experts, as
for inference), its fwd+bwd on a trainable one (trainable=True: one micro-batch of a step
whose weights are quantized before its micro-batch loop, the kernel's gradient included). FP8
wgrad: "fp8" takes the row-wise E4M3 x and E5M2 dy, so it includes their two column-wise
copies (jaxfuse_group_columnwise); "fp8 columnwise" is the wgrad kernel alone on ready
copies. "fp8 blockwise": Float8BlockScaling (DeepSeek-V3's recipe), its fwd and dgrad
kernels on pre-quantized operands (x / dy in E4M3 with 1 x 128 block scales, w in E4M3 with
128 x 128 tile scales), its wgrad kernel on x and dy quantized in 128 x 1 blocks down each
group's rows (column-wise copies), and the op with quantization included (16-bit wgrad);
"fp8 blockwise fp8 wgrad" the op with fp8_wgrad=True (results of 2da1c0b6 and before have
the 16-bit one as "fp8 blockwise wgrad16"); "fp8 blockwise
quantized kernel" that op on tiles quantized once (a constant copy for its forward, a
trainable one for fwd+bwd), as "fp8 quantized kernel".

tokamax (benchmarks/tokamax_baseline.py: tokamax.ragged_dot with its Pallas Mosaic GPU
kernels, the backward through its own VJP) runs in the same alternating chunks when it can be
imported; tokamax_max_rel_error is its result against jaxfuse's on the same operands, and
ragged_dot_max_rel_error XLA's.

jaxfuse bf16, jaxfuse FP8, torch._grouped_mm and tokamax run in alternating chunks with the same
host-clock timing (common.time_alternating), so GPU clock drift cannot favour one of them.
Chunks are CHUNK calls long: a chunk's time includes its first call's latency once (a
jitted JAX call's is several times torch's, see scripts/call_latency.py), which over 20
calls of a millisecond-long GEMM weighs ~1%, over the default 5 calls up to ~10%.

    python -m benchmarks.bench_grouped_linear [--quick] [--smoke] [--tag TAG]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks import tokamax_baseline
from jaxfuse._src.ops.grouped_linear import api as grouped_api
from jaxfuse._src.ops.grouped_linear import ffi as grouped_ffi
from jaxfuse._src.ops.quantize import ffi as quantize_ffi

K, N = 2048, 4096
CASES = {
    "8x8192 uniform": [8192] * 8,
    "8x8192 skewed, one empty": [16384, 12288, 0, 8192, 8192, 8192, 6144, 6144],
    "64x512": [512] * 64,
    "128x512": [512] * 128,
    # As routed tokens arrive: 32768 rows over 64 experts at random (multinomial, fixed
    # seed), sizes around 512 but rarely a multiple of 128. Not an issue case: it shows
    # what a cluster of two CTAs along M (torch's choice) costs once tile counts are odd.
    "64x~512 routed": [int(size) for size in
                       np.random.default_rng(64).multinomial(32768, np.ones(64) / 64)],
}
FORMS = ("fwd", "dgrad", "wgrad")
FP8_PRECISIONS = ("fp8", "fp8 promoted", "fp8 columnwise", "fp8 blockwise")
# The whole op: grouped_linear.
OP_FP8_PRECISIONS = ("fp8", "fp8 quantized kernel", "fp8 blockwise",
                     "fp8 blockwise quantized kernel", "fp8 blockwise fp8 wgrad")
CHUNK = 20  # calls per alternating chunk (see the module docstring)


def jaxfuse_steps(x, w, dy, offsets):
  fwd = jax.jit(lambda x, w, o: grouped_ffi.grouped_gemm(x, w, o, form=grouped_ffi.FORWARD))
  dgrad = jax.jit(lambda dy, w, o: grouped_ffi.grouped_gemm(dy, w, o, form=grouped_ffi.DGRAD))
  wgrad = jax.jit(lambda x, dy, o: grouped_ffi.grouped_gemm(x, dy, o, form=grouped_ffi.WGRAD))
  return {"fwd": (fwd, (x, w, offsets)), "dgrad": (dgrad, (dy, w, offsets)),
          "wgrad": (wgrad, (x, dy, offsets))}


def batched_dense_steps(x, w, dy, sizes):
  """{form: (fn, args)}: XLA's batched GEMMs over G equal groups, or {} unless every group
  has the same rows and together they cover x."""
  groups = len(sizes)
  if len(set(sizes)) != 1 or sum(sizes) != x.shape[0] or sizes[0] == 0:
    return {}
  rows = lambda a: a.reshape(groups, sizes[0], a.shape[-1])  # noqa: E731
  fwd = jax.jit(lambda x, w: jnp.einsum("gmk,gkn->gmn", rows(x), w))
  dgrad = jax.jit(lambda dy, w: jnp.einsum("gmn,gkn->gmk", rows(dy), w))
  wgrad = jax.jit(lambda x, dy: jnp.einsum("gmk,gmn->gkn", rows(x), rows(dy)))
  return {"fwd": (fwd, (x, w)), "dgrad": (dgrad, (dy, w)), "wgrad": (wgrad, (x, dy))}


def fp8_steps(x, w, dy, offsets):
  """{form: (fn, args)} for the FP8 GEMMs on pre-quantized operands and the whole op."""
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse._src.ops.grouped_linear import reference as grouped_reference
  recipe = jaxfuse.quantization.Float8CurrentScaling(per_group=True)
  x_q, x_s = grouped_reference.quantize_rows(x, recipe, offsets, "forward", "ffi")
  dy_q, dy_s = grouped_reference.quantize_rows(dy, recipe, offsets, "gradient", "ffi")
  w_t_q, w_s = grouped_reference.quantize_experts_t(w, recipe, "ffi")
  w_q = jnp.swapaxes(w_t_q, 1, 2)
  x_t = quantize_ffi.group_columnwise(x_q, offsets)
  dy_t = quantize_ffi.group_columnwise(dy_q, offsets)
  wgrad_columnwise = jax.jit(functools.partial(grouped_ffi.fp8_wgrad_columnwise,
                                               rows=x.shape[0]))
  gemm = lambda form, fast=False: jax.jit(lambda a, b, o, sa, sb: grouped_ffi.grouped_gemm(
      a, b, o, form=form, a_scale_inv=sa, b_scale_inv=sb, fast_accumulation=fast))
  sizes = jnp.diff(offsets)

  def op(recipe_):
    def fwd(x, w, s):
      return jaxfuse.grouped_linear(x, w, s, recipe=recipe_, implementation="ffi")
    def fwd_bwd(x, w, s, dy):
      out, vjp = jax.vjp(lambda x, w: fwd(x, w, s), x, w)
      return out, vjp(dy)
    return jax.jit(fwd), jax.jit(fwd_bwd)

  fp8_fwd, fp8_fwd_bwd = op(recipe)
  bf16_fwd, bf16_fwd_bwd = op(None)
  # Weights quantized once (jaxfuse.quantize_experts, e.g. for inference): the op's forward
  # without the weight's amax and quantizing passes.
  w_quantized = jaxfuse.quantize_experts(w, recipe)
  quantized_kernel_fwd = jax.jit(lambda x, q, s: jaxfuse.grouped_linear(
      x, q, s, implementation="ffi"))
  # fwd+bwd on a trainable copy quantized once (quantize_experts(..., trainable=True)): one
  # micro-batch of a step whose weights were quantized before its micro-batch loop; the
  # kernel's gradient comes back at the copy's master.
  w_trainable = jaxfuse.quantize_experts(w, recipe, trainable=True)

  @jax.jit
  def quantized_kernel_fwd_bwd(x, q, s, dy):
    out, vjp = jax.vjp(lambda x, q: jaxfuse.grouped_linear(x, q, s, implementation="ffi"), x, q)
    d_x, d_q = vjp(dy)
    return out, (d_x, d_q.master)

  # Float8BlockScaling: 1 x 128 blocks of x and dy, 128 x 128 tiles of w.
  block_recipe = jaxfuse.quantization.Float8BlockScaling()
  x_b, x_bs = grouped_api.blockwise_rows(x, block_recipe, "forward", "ffi")
  dy_b, dy_bs = grouped_api.blockwise_rows(dy, block_recipe, "gradient", "ffi")
  (w_t_b, w_t_bs), (w_b, w_bs) = grouped_api.blockwise_weights(w, block_recipe,
                                                                untransposed=True)
  block_gemm = lambda form: jax.jit(lambda a, b, o, sa, sb: grouped_ffi.grouped_gemm_blockwise(
      a, b, o, sa, sb, form=form))
  block_fwd, block_fwd_bwd = op(block_recipe)
  # The same op with FP8 weight gradients (fp8_wgrad=True; 16-bit by default).
  _, block_fp8_wgrad_fwd_bwd = op(jaxfuse.quantization.Float8BlockScaling(fp8_wgrad=True))
  # The blockwise FP8 wgrad alone, on x and dy quantized in 128 x 1 blocks down each group's
  # rows into their column-wise copies (what the op's backward feeds it).
  x_tb, x_tbs = quantize_ffi.quantize_columnwise_blocks(x, offsets, fmt="e4m3")
  dy_tb, dy_tbs = quantize_ffi.quantize_columnwise_blocks(dy, offsets, fmt="e4m3")
  block_wgrad = jax.jit(functools.partial(grouped_ffi.fp8_blockwise_wgrad_columnwise,
                                          rows=x.shape[0]))
  # The blockwise op on 128 x 128 tiles quantized once: forward on a constant copy,
  # fwd+bwd on a trainable one (the kernel's gradient at its master).
  w_block_quantized = jaxfuse.quantize_experts(w, block_recipe)
  w_block_trainable = jaxfuse.quantize_experts(w, block_recipe, trainable=True)

  return {
      ("fp8 blockwise", "fwd"): (block_gemm(grouped_ffi.FORWARD),
                                 (x_b, w_t_b, offsets, x_bs, w_t_bs)),
      ("fp8 blockwise", "dgrad"): (block_gemm(grouped_ffi.DGRAD),
                                   (dy_b, w_b, offsets, dy_bs, w_bs)),
      ("fp8 blockwise", "wgrad"): (block_wgrad, (x_tb, dy_tb, offsets, x_tbs, dy_tbs)),
      ("fp8 blockwise", "op fwd"): (block_fwd, (x, w, sizes)),
      ("fp8 blockwise fp8 wgrad", "op fwd+bwd"): (block_fp8_wgrad_fwd_bwd, (x, w, sizes, dy)),
      ("fp8 blockwise", "op fwd+bwd"): (block_fwd_bwd, (x, w, sizes, dy)),
      ("fp8 blockwise quantized kernel", "op fwd"): (quantized_kernel_fwd,
                                                     (x, w_block_quantized, sizes)),
      ("fp8 blockwise quantized kernel", "op fwd+bwd"): (quantized_kernel_fwd_bwd,
                                                         (x, w_block_trainable, sizes, dy)),
      ("fp8", "fwd"): (gemm(grouped_ffi.FORWARD, recipe.forward_fast_accumulation),
                       (x_q, w_t_q, offsets, x_s, w_s)),
      ("fp8 promoted", "fwd"): (gemm(grouped_ffi.FORWARD), (x_q, w_t_q, offsets, x_s, w_s)),
      ("fp8", "dgrad"): (gemm(grouped_ffi.DGRAD), (dy_q, w_q, offsets, dy_s, w_s)),
      ("fp8", "wgrad"): (gemm(grouped_ffi.WGRAD), (x_q, dy_q, offsets, x_s, dy_s)),
      ("fp8 columnwise", "wgrad"): (wgrad_columnwise, (x_t, dy_t, offsets, x_s, dy_s)),
      ("fp8", "op fwd"): (fp8_fwd, (x, w, sizes)),
      ("fp8 quantized kernel", "op fwd"): (quantized_kernel_fwd, (x, w_quantized, sizes)),
      ("fp8", "op fwd+bwd"): (fp8_fwd_bwd, (x, w, sizes, dy)),
      ("fp8 quantized kernel", "op fwd+bwd"): (quantized_kernel_fwd_bwd,
                                               (x, w_trainable, sizes, dy)),
      ("bf16", "op fwd"): (bf16_fwd, (x, w, sizes)),
      ("bf16", "op fwd+bwd"): (bf16_fwd_bwd, (x, w, sizes, dy)),
  }


def ragged_dot_steps(x, w, dy, sizes):
  fwd = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s))
  # XLA's own backward of ragged_dot: dgrad and wgrad as jax.vjp derives them.
  def dgrad(x, w, s, dy):
    return jax.vjp(lambda x: jax.lax.ragged_dot(x, w, s), x)[1](dy)[0]
  def wgrad(x, w, s, dy):
    return jax.vjp(lambda w: jax.lax.ragged_dot(x, w, s), w)[1](dy)[0]
  return {"fwd": (fwd, (x, w, sizes)), "dgrad": (jax.jit(dgrad), (x, w, sizes, dy)),
          "wgrad": (jax.jit(wgrad), (x, w, sizes, dy))}


def tokamax_variants(tokamax, x, w, dy, sizes, gemms):
  """({form: time_alternating variant}, {form: max relative error against jaxfuse}) of
  tokamax's grouped GEMMs; a form that fails to compile or run is reported and left out."""
  if tokamax is None:
    return {}, {}
  variants, errors = {}, {}
  for form, fn in tokamax_baseline.gemm_fns(tokamax).items():
    fn_args = (x, w, sizes) if form == "fwd" else (x, w, sizes, dy)
    try:
      result = jax.block_until_ready(fn(*fn_args))
    except Exception as error:  # pylint: disable=broad-except  (a baseline must not stop the run)
      print(f"tokamax {form} failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
      continue
    jaxfuse_fn, jaxfuse_args = gemms[form]
    errors[form] = tokamax_baseline.max_relative_error(result, jaxfuse_fn(*jaxfuse_args))
    variants[form] = (fn, fn_args, common.keep_args)
  return variants, errors


def time_jax(fn, args, calls):
  return common.time_fn(fn, [args] * (calls + 3))["median_ms"]  # 3 warm-up calls


def torch_variants(sizes, k, n):
  """{form: time_alternating variant} of torch._grouped_mm on fresh bf16 operands, or {}
  without torch or CUDA. Timed like the JAX variants: host clock around chunks."""
  try:
    import torch  # pylint: disable=g-import-not-at-top  (optional baseline)
  except ImportError:
    return {}
  if not torch.cuda.is_available():
    return {}
  m, g = sum(sizes), len(sizes)
  x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
  w = torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16) / k**0.5
  dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
  offs = torch.tensor(np.cumsum(sizes), device="cuda", dtype=torch.int32)
  w_t = w.transpose(-2, -1).contiguous().transpose(-2, -1)  # column-major per group, as torch prefers
  wait = lambda _: torch.cuda.synchronize()  # noqa: E731
  return {
      "fwd": (lambda: torch._grouped_mm(x, w_t, offs=offs), (), common.keep_args, wait),
      "dgrad": (lambda: torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs), (),
                common.keep_args, wait),
      "wgrad": (lambda: torch._grouped_mm(x.t(), dy, offs=offs), (), common.keep_args, wait),
  }


def kernel_owner(kernel_name: str) -> str:
  """Which variant of a kernel-time alternation launched a kernel: torch._grouped_mm's
  kernels live in at::cuda, jaxfuse's are the setup kernel and CUTLASS grouped kernels
  (GroupProblemShape), and XLA's dense GEMM is whatever else runs."""
  if "at4cuda" in kernel_name or "at::cuda" in kernel_name:
    return "torch"
  if "jaxfuse" in kernel_name or "GroupProblemShape" in kernel_name:
    return "jaxfuse"
  return "dense"


def alternate(variants, rounds) -> dict[str, float | None]:
  """Median ms per variant from common.time_alternating; a variant whose call fails (out
  of memory, unsupported) is reported, dropped and gets None."""
  variants = dict(variants)
  while variants:
    try:
      stats = common.time_alternating(variants, rounds=rounds, chunk=CHUNK)
      return {name: stats.get(name, {}).get("median_ms") for name in variants}
    except Exception as error:  # find the failing variant, keep the others
      for name, (fn, args, *_) in list(variants.items()):
        try:
          jax.block_until_ready(fn(*args))
        except Exception:  # pylint: disable=broad-except
          print(f"{name} failed: {type(error).__name__}: {str(error)[:200]}")
          del variants[name]
          break
      else:
        raise
  return {}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny sizes on whatever device exists (checks the script, e.g. on "
                           "CPU); writes no results")
  parser.add_argument("--tag", default="", help="suffix of the results file name")
  parser.add_argument("--cases", nargs="*", default=[],
                      help="substrings, space- or comma-separated: run only the cases whose "
                           "name has one (scripts/gpu_run.sh turns an entry's commas into "
                           "spaces)")
  args = parser.parse_args()
  global K, N
  cases = CASES
  if args.cases:
    wanted = [w for arg in args.cases for w in arg.split(",") if w]
    cases = {name: sizes for name, sizes in CASES.items() if any(w in name for w in wanted)}
  if args.smoke:
    K, N = 64, 128
    cases = {name: [max(0, size // 256) for size in sizes][:16] for name, sizes in CASES.items()}
  calls = 5 if args.quick or args.smoke else 20
  rounds = max(2, calls // common.CHUNK)  # alternating chunks per variant
  tokamax, tokamax_missing = tokamax_baseline.load()
  if tokamax is None:
    print(f"tokamax baseline unavailable: {tokamax_missing}", flush=True)
  rows = []
  dense_kernel_names = {}  # case -> XLA's dense GEMM kernels (what the ceiling runs)
  batched_kernel_names = {}  # case -> {form: XLA's batched GEMM kernels}
  # A dense bf16 GEMM of 65536 x 2048 x 4096 through XLA, timed alone first (the per-case
  # ceiling is the dense GEMM alternated with each forward, below).
  dense_m = 256 if args.smoke else 65536
  a = jax.random.normal(jax.random.key(0), (dense_m, K), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (K, N), jnp.bfloat16)
  dense_ms = time_jax(jax.jit(jnp.matmul), (a, b), calls)
  dense_tflops = 2 * dense_m * K * N / (dense_ms * 1e-3) / 1e12
  del a, b
  print(f"dense XLA bf16 {dense_m}x{K}x{N}: {dense_ms:.3f} ms, {dense_tflops:.1f} TFLOP/s",
        flush=True)
  for name, sizes in cases.items():
    m, g = sum(sizes), len(sizes)
    key = jax.random.key(m + g)
    kx, kw, kd = jax.random.split(key, 3)
    x = jax.random.normal(kx, (m, K), jnp.bfloat16)
    w = (jax.random.normal(kw, (g, K, N)) / K**0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (m, N), jnp.bfloat16)
    sizes_array = jnp.asarray(sizes, jnp.int32)
    offsets = grouped_api.group_offsets(sizes_array)
    flops = 2 * m * K * N
    gpu = common.GpuMonitor().start()  # clocks and power while this case runs
    gemms = jaxfuse_steps(x, w, dy, offsets)
    batched = batched_dense_steps(x, w, dy, sizes)
    fp8 = fp8_steps(x, w, dy, offsets)
    torch_gemms = torch_variants(sizes, K, N)
    tokamax_gemms, tokamax_errors = tokamax_variants(tokamax, x, w, dy, sizes_array, gemms)
    # jaxfuse bf16, jaxfuse FP8 (fwd, dgrad) and torch._grouped_mm in alternating chunks.
    times, kernel_ms, batched_kernel_ms = {}, {}, {}
    dense = (jax.jit(jnp.matmul), (x, w[0]), common.keep_args)
    for form in FORMS:
      variants = {"jaxfuse": (*gemms[form], common.keep_args)}
      if form == "fwd":
        variants["dense"] = dense
      if form in batched:
        variants["batched dense"] = (*batched[form], common.keep_args)
      for precision in FP8_PRECISIONS:
        if (precision, form) in fp8:
          variants[precision] = (*fp8[precision, form], common.keep_args)
      if form in torch_gemms:
        variants["torch"] = torch_gemms[form]
      if form in tokamax_gemms:
        variants["tokamax"] = tokamax_gemms[form]
      times[form] = alternate(variants, rounds)
      # Device time of the bf16 kernels alone, jaxfuse against torch and the dense GEMM,
      # in alternating chunks of their own (the FP8 variants would share jaxfuse's names).
      kernel_variants = {key: variants[key] for key in ("jaxfuse", "dense", "torch")
                         if key in variants}
      names = {}
      kernel_ms[form] = common.kernel_times_alternating(
          kernel_variants, kernel_owner, rounds=rounds, chunk=CHUNK, kernel_names=names)
      if form == "fwd" and names.get("dense"):
        dense_kernel_names[name] = names["dense"][:3]
        print(f"dense GEMM kernels ({name}): {names['dense'][:3]}", flush=True)
      if form in batched:  # the batched ceiling's device time and kernels, same way
        names = {}
        batched_kernel_ms[form] = common.kernel_times_alternating(
            {key: variants[key] for key in ("jaxfuse", "batched dense")},
            lambda kernel: "jaxfuse" if kernel_owner(kernel) == "jaxfuse" else "batched dense",
            rounds=rounds, chunk=CHUNK, kernel_names=names)
        batched_kernel_names.setdefault(name, {})[form] = names.get("batched dense", [])[:2]
        print(f"batched GEMM kernels ({name}, {form}): {batched_kernel_names[name][form]}",
              flush=True)
    del torch_gemms, tokamax_gemms
    # The whole op (quantization included), FP8 against bf16, alternating.
    for form in ("op fwd", "op fwd+bwd"):
      times[form] = alternate({precision: (*fp8[precision, form], common.keep_args)
                               for precision in ("bf16",) + OP_FP8_PRECISIONS
                               if (precision, form) in fp8}, rounds)
    ragged, ragged_errors = {}, {}
    for form, (fn, fn_args) in ragged_dot_steps(x, w, dy, sizes_array).items():
      try:  # XLA's ragged_dot wgrad of 128 groups wants ~96 GB of temporaries per call
        ragged[form] = time_jax(fn, fn_args, max(3, calls // 4))
        # XLA's result against jaxfuse's: a second opinion where tokamax disagrees.
        jaxfuse_fn, jaxfuse_args = gemms[form]
        ragged_errors[form] = tokamax_baseline.max_relative_error(fn(*fn_args),
                                                                  jaxfuse_fn(*jaxfuse_args))
      except Exception as error:  # an out-of-memory baseline must not stop the run
        print(f"ragged_dot {name} {form} failed: {type(error).__name__}: {str(error)[:200]}")
        ragged[form] = None
    del x, w, dy, gemms, fp8, batched
    print(f"{name}: GPU during the case {gpu.stop()}", flush=True)
    tflops = lambda ms, passes=1: passes * flops / (ms * 1e-3) / 1e12 if ms else None  # noqa: E731
    for form in FORMS:
      jaxfuse_ms, torch_ms = times[form].get("jaxfuse"), times[form].get("torch")
      row = {"case": name, "groups": g, "rows": m, "K": K, "N": N, "form": form,
             "precision": "bf16", "jaxfuse_ms": jaxfuse_ms, "jaxfuse_tflops": tflops(jaxfuse_ms),
             "ragged_dot_ms": ragged[form], "ragged_dot_tflops": tflops(ragged[form]),
             "ragged_dot_max_rel_error": ragged_errors.get(form),
             "torch_ms": torch_ms, "torch_tflops": tflops(torch_ms), "gpu": gpu.summary}
      tokamax_ms = times[form].get("tokamax")
      row.update({"tokamax_ms": tokamax_ms, "tokamax_tflops": tflops(tokamax_ms),
                  "tokamax_max_rel_error": tokamax_errors.get(form),
                  "jaxfuse_vs_tokamax": tokamax_ms / jaxfuse_ms
                                        if tokamax_ms and jaxfuse_ms else None})
      # The dense GEMM alternated with the forward, in the same chunks.
      case_dense_ms = times["fwd"].get("dense")
      row["dense_tflops"] = tflops(case_dense_ms)
      row["jaxfuse_vs_dense"] = (row["jaxfuse_tflops"] / row["dense_tflops"]
                                 if jaxfuse_ms and case_dense_ms else None)
      row["jaxfuse_vs_torch"] = torch_ms / jaxfuse_ms if torch_ms and jaxfuse_ms else None
      batched_ms = times[form].get("batched dense")
      row["batched_dense_tflops"] = tflops(batched_ms)
      row["jaxfuse_vs_batched_dense"] = (batched_ms / jaxfuse_ms
                                         if batched_ms and jaxfuse_ms else None)
      # Kernel (device) time per call under the same alternating load; the dense GEMM's
      # from the forward's alternation.
      kernels = kernel_ms[form]
      dense_kernel_ms = kernel_ms["fwd"].get("dense")
      row.update({"jaxfuse_kernel_ms": kernels.get("jaxfuse"),
                  "torch_kernel_ms": kernels.get("torch"), "dense_kernel_ms": dense_kernel_ms})
      row["kernel_jaxfuse_vs_torch"] = (kernels["torch"] / kernels["jaxfuse"]
                                        if kernels.get("torch") and kernels.get("jaxfuse")
                                        else None)
      row["kernel_jaxfuse_vs_dense"] = (dense_kernel_ms / kernels["jaxfuse"]
                                        if dense_kernel_ms and kernels.get("jaxfuse") else None)
      batched_kernels = batched_kernel_ms.get(form, {})
      row["batched_dense_kernel_ms"] = batched_kernels.get("batched dense")
      row["kernel_jaxfuse_vs_batched_dense"] = (
          batched_kernels["batched dense"] / batched_kernels["jaxfuse"]
          if batched_kernels.get("batched dense") and batched_kernels.get("jaxfuse") else None)
      rows.append(row)
      print(row, flush=True)
    for form in FORMS + ("op fwd", "op fwd+bwd"):
      bf16_ms = times[form].get("jaxfuse" if form in FORMS else "bf16")
      passes = 3 if form == "op fwd+bwd" else 1
      precisions = FP8_PRECISIONS if form in FORMS else OP_FP8_PRECISIONS
      fp8_rows = [(p, times[form][p]) for p in precisions if p in times[form]]
      for precision, ms in fp8_rows + ([("bf16", bf16_ms)] if form not in FORMS else []):
        row = {"case": name, "groups": g, "rows": m, "K": K, "N": N, "form": form,
               "precision": precision, "jaxfuse_ms": ms, "jaxfuse_tflops": tflops(ms, passes),
               "fp8_speedup": bf16_ms / ms if precision != "bf16" and ms and bf16_ms else None}
        rows.append(row)
        print(row, flush=True)
  common.print_table(rows, ["case", "form", "precision", "jaxfuse_tflops", "fp8_speedup",
                            "torch_tflops", "tokamax_tflops",
                            "ragged_dot_tflops", "dense_tflops", "jaxfuse_vs_dense",
                            "batched_dense_tflops", "jaxfuse_vs_batched_dense",
                            "jaxfuse_vs_torch", "kernel_jaxfuse_vs_dense",
                            "kernel_jaxfuse_vs_torch"])
  if args.smoke:
    return
  common.write_results("grouped_linear", rows, tag=args.tag, dtype="bfloat16",
                       dense_xla_tflops=dense_tflops,
                       dense_kernel_names=dense_kernel_names,
                       batched_dense_kernel_names=batched_kernel_names,
                       baselines="jax.lax.ragged_dot (XLA), torch._grouped_mm and "
                                 "tokamax.ragged_dot (Pallas Mosaic GPU), same run",
                       tokamax=(tokamax_baseline.version(tokamax) if tokamax is not None
                                else f"unavailable: {tokamax_missing}"),
                       method="jaxfuse bf16, jaxfuse FP8, torch._grouped_mm and tokamax timed in "
                              "alternating chunks (common.time_alternating), host clock "
                              "around each chunk for all of them; ragged_dot alone. "
                              "*_kernel_ms: device time of each variant's kernels (CUPTI via "
                              "torch.profiler) in alternating chunks of jaxfuse bf16, the "
                              "dense GEMM (forward) and torch, common.kernel_times_alternating")


if __name__ == "__main__":
  main()
