"""Grouped MLP (MoE experts, SwiGLU, 8 experts, bf16), forward and forward + backward:
jaxfuse.grouped_mlp vs a jax.lax.ragged_dot + jnp composition vs a torch._grouped_mm
composition vs a tokamax composition, in one process on one GPU.

tokamax_*: tokamax.ragged_dot's Pallas Mosaic GPU kernels for FC1 and FC2 (its own VJP for
the backward) around the jnp SwiGLU (benchmarks/tokamax_baseline.py), in the same
alternating chunks as jaxfuse when tokamax can be imported; tokamax_max_rel_error is its
output against jaxfuse's bf16 output on the same inputs.

torch_*: torch._grouped_mm with SwiGLU in fp32 (jaxfuse's math); torch_bf16_act_*: the same
with SwiGLU on bf16 tensors, as a PyTorch user would write it (fwd+bwd rows).

jaxfuse_saved_activation_*: the bf16 op with save_activation=True (the forward's activation,
FC2's input, kept as a residual: 2 * T * F bytes more memory, no recompute in the backward).
jaxfuse_gated_fc1_*: the bf16 op with the gated FC1 kernel (FC1 and the scaled activation
in one kernel, session 55; JAXFUSE_GROUPED_MLP_GATED_FC1=1 while it is traced, the
activation then kept for FC2's wgrad), timed in the same alternating chunks; the row's
gated_fc1_speedup is jaxfuse_ms over its time.

jaxfuse_fp8_* columns: the same op with recipe=Float8CurrentScaling(per_group=True)
(quantization kernels included; every GEMM in FP8, the wgrads from column-wise copies);
jaxfuse_fp8_wgrad16_*: the same recipe with fp8_wgrad=False (16-bit wgrads);
jaxfuse_fp8_quantized_kernels_*: the FP8 op on weights quantized once, outside the timed
calls: the forward on jaxfuse.quantize_experts copies (inference), the forward + backward on
trainable copies (quantize_experts(..., trainable=True), the gradients going to their
masters): a micro-batch's step when the weights are quantized once per optimizer step and
shared by its micro-batches. jaxfuse_fp8_blockwise_*: recipe=Float8BlockScaling()
(DeepSeek-V3's 1 x 128 / 128 x 128 blocks, the blockwise FP8 GEMMs, 16-bit wgrads),
jaxfuse_fp8_blockwise_fp8_wgrad_* the same with fp8_wgrad=True (FP8 wgrads from 128 x 1
blocks; results of 2da1c0b6 and before have a *_wgrad16_* column instead), and
jaxfuse_fp8_blockwise_quantized_kernels_* the blockwise op on copies quantized once. All timed in
alternating chunks with the bf16 op (common.time_alternating), after 2 s of warm-up; a
chunk holds ~10 ms of calls (5 to 200, calls_per_sync), so that one sync's latency is not
charged to a few short steps.

Cases: the issue's T=65536, H=F=2048 and T=2048, H=F=1024 (the small one also with torch
inside a CUDA graph; a jitted JAX step is already one executable), plus a token sweep at
H=F=2048 for the TFLOP/s plot (benchmarks/plot_grouped_mlp.py). FLOPs count the GEMMs of
routed rows: forward 2*T*H*2F + 2*T*F*H, forward + backward three times that.

    python -m benchmarks.bench_grouped_mlp [--quick] [--no-sweep] [--tag TAG]

`--protocol anchors` times the seed cases the way shared/ANCHORS.md measured its reference
points (torch 9.74 ms at T=65536): each implementation after 3 s of idle, 3 warm-up calls,
then 30 calls each synchronised on its own (JAX: host clock around the call and
`jax.block_until_ready`, dispatch included; torch: CUDA events), median; the
implementations (jaxfuse bf16, jaxfuse FP8, torch autograd with SwiGLU in fp32 and in bf16)
in two rounds, the second in reverse order. A burst lasts ~0.3 s at T=65536, against the
default protocol's 2 s of warm-up and then minutes of alternating chunks; the H100s of
session 54 still reached their 700 W cap in half of a burst's clock samples, so the two
protocols differ less than the 9.74 ms against our harness's ~12 ms for torch suggests.
The default protocol stays the figure the issues' goals are read from.

    python -m benchmarks.bench_grouped_mlp --protocol anchors [--tag TAG]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # leave room for torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxfuse  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks import tokamax_baseline  # noqa: E402
from jaxfuse._src.ops.grouped_mlp import api as mlp_api  # noqa: E402

EXPERTS = 8
CASES = {  # name: (tokens, hidden, ffn)
    "T=65536 H=2048 F=2048": (65536, 2048, 2048),
    "T=2048 H=1024 F=1024": (2048, 1024, 1024),
}
SWEEP_TOKENS = (2048, 4096, 8192, 16384, 32768, 65536)
SWEEP_HIDDEN = SWEEP_FFN = 2048
L2_BYTES = 50 << 20


def group_sizes(tokens: int) -> np.ndarray:
  """Mildly uneven expert loads summing to tokens, in multiples of 16 rows (what
  torch._grouped_mm's kernels are safest with; jaxfuse takes any sizes)."""
  rng = np.random.default_rng(tokens)
  sizes = rng.multinomial(tokens // 16, np.ones(EXPERTS) / EXPERTS) * 16
  sizes[-1] += tokens - sizes.sum()
  return sizes.astype(np.int32)


def jax_inputs(tokens, hidden, ffn, seed):
  keys = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
  k1 = (jax.random.normal(keys[1], (EXPERTS, hidden, 2 * ffn)) / hidden**0.5).astype(jnp.bfloat16)
  k2 = (jax.random.normal(keys[2], (EXPERTS, ffn, hidden)) / ffn**0.5).astype(jnp.bfloat16)
  scales = jax.random.uniform(keys[3], (tokens,), jnp.float32, 0.1, 1.0)
  dy = jax.random.normal(keys[4], (tokens, hidden), jnp.bfloat16)
  return x, k1, k2, scales, dy


FP8_RECIPE = jaxfuse.quantization.Float8CurrentScaling(per_group=True)
FP8_WGRAD16_RECIPE = jaxfuse.quantization.Float8CurrentScaling(per_group=True, fp8_wgrad=False)
BLOCK_RECIPE = jaxfuse.quantization.Float8BlockScaling()
BLOCK_FP8_WGRAD_RECIPE = jaxfuse.quantization.Float8BlockScaling(fp8_wgrad=True)
JAX_IMPLS = ("jaxfuse", "jaxfuse_saved_activation", "jaxfuse_gated_fc1",
             "jaxfuse_fp8", "jaxfuse_fp8_wgrad16",
             "jaxfuse_fp8_quantized_kernels",
             "jaxfuse_fp8_blockwise", "jaxfuse_fp8_blockwise_fp8_wgrad",
             "jaxfuse_fp8_blockwise_quantized_kernels", "tokamax", "ragged_dot")


def jax_fns(implementation, recipe=None, save_activation=None):
  def forward(x, k1, k2, scales, sizes, dy):
    del dy
    return jaxfuse.grouped_mlp(x, k1, k2, sizes, scales, implementation=implementation,
                               recipe=recipe, save_activation=save_activation)

  def forward_backward(x, k1, k2, scales, sizes, dy):
    # The output is returned too, so XLA cannot drop the forward's last GEMM.
    out, vjp = jax.vjp(lambda x, k1, k2, s: jaxfuse.grouped_mlp(
        x, k1, k2, sizes, s, implementation=implementation, recipe=recipe,
        save_activation=save_activation), x, k1, k2, scales)
    return out, common.masters(vjp(dy))  # a trainable copy's gradient: its master's

  return {"fwd": jax.jit(forward), "fwd+bwd": jax.jit(forward_backward)}


def traced_under_environment(fn, variables: dict):
  """``fn`` (a jitted step) traced and compiled, at its first call, with the environment
  `variables` set (jaxfuse reads its switches while tracing), then called compiled: the
  timed calls pay nothing for the switch."""
  compiled = {}

  def call(*args):
    if "fn" not in compiled:
      saved = {name: os.environ.get(name) for name in variables}
      os.environ.update(variables)
      try:
        compiled["fn"] = fn.lower(*args).compile()
      finally:
        for name, value in saved.items():
          if value is None:
            os.environ.pop(name, None)
          else:
            os.environ[name] = value
    return compiled["fn"](*args)

  return call


def calls_per_sync(tokens, hidden, ffn) -> int:
  """Calls per timed chunk: ~10 ms of device time, 5 to 200 (common.calls_per_sync).

  At T=2048 (130 calls) the device runs a step in 0.177 ms of kernels and the host keeps up
  (every launch comes from XLA's CUDA graphs: scripts/probe_command_buffers.py, 0.180 ms per
  step over 200 calls back to back at b1d3225f), so what a chunk adds beyond the steps is
  its first call's latency and its sync (0.1-0.4 ms): 2-8% of a 50-call chunk, which was
  the cap up to b1d3225f (0.195-0.2015 ms per step in session 18's runs)."""
  estimated_ms = mlp_api.flops(tokens, hidden, ffn) / 500e12 * 1e3  # forward + backward
  return common.calls_per_sync(estimated_ms, most=200)


def tokamax_variants(tokamax, bf16_fns, arg_sets):
  """({pass: time_alternating variant}, max relative error of the forward against jaxfuse's
  bf16 output) of the tokamax composition, or ({}, None) when it is unavailable or fails."""
  if tokamax is None:
    return {}, None
  fns = tokamax_baseline.mlp_fns(tokamax)
  try:
    out = jax.block_until_ready(fns["fwd"](*arg_sets[0]))
    jax.block_until_ready(fns["fwd+bwd"](*arg_sets[0]))
  except Exception as error:  # pylint: disable=broad-except  (a baseline must not stop the run)
    print(f"tokamax grouped MLP failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
    return {}, None
  error = tokamax_baseline.max_relative_error(out, bf16_fns["fwd"](*arg_sets[0]))
  return {name: common.rotating(fn, arg_sets) for name, fn in fns.items()}, error


def rotated_arg_sets(tokens, hidden, ffn):
  """Argument tuples (x, k1, k2, scales, sizes, dy) for the timed steps: three input sets
  to rotate through where one set's working set would sit in the 50 MB L2, else one."""
  working_set = 2 * (tokens * hidden * 2 + EXPERTS * hidden * ffn * 3)
  rotations = 3 if working_set < 2 * L2_BYTES else 1
  sizes = jnp.asarray(group_sizes(tokens))
  return [(x, k1, k2, s, sizes, dy)
          for x, k1, k2, s, dy in (jax_inputs(tokens, hidden, ffn, seed)
                                   for seed in range(rotations))]


def time_jax(tokens, hidden, ffn, calls, baseline_calls, tokamax=None):
  """{impl: {pass: ms}} for jaxfuse (bf16 and FP8) and the ragged_dot composition.

  jaxfuse_fp8: recipe=Float8CurrentScaling(per_group=True), the quantization kernels
  included (every GEMM in FP8); jaxfuse_fp8_wgrad16: with 16-bit wgrads; FLOPs counted as
  for bf16.
  jaxfuse runs `calls` rounds of alternating chunks of calls_per_sync calls; the tokamax
  composition (when `tokamax` is the module) runs in the same chunks."""
  arg_sets = rotated_arg_sets(tokens, hidden, ffn)
  out = {impl: {} for impl in JAX_IMPLS}
  # jaxfuse bf16 and FP8 in alternating chunks (common.time_alternating): the FP8 speedup
  # is a ratio of two runs that saw the same clocks.
  bf16_fns, fp8_fns = jax_fns("ffi"), jax_fns("ffi", FP8_RECIPE)
  saved_fns = jax_fns("ffi", save_activation=True)
  gated_fns = {name: traced_under_environment(fn, {mlp_api.GATED_FC1_ENV: "1"})
               for name, fn in jax_fns("ffi").items()}
  fp8_wgrad16_fns = jax_fns("ffi", FP8_WGRAD16_RECIPE)
  # Clocks settle under load first (the first timings of a fresh process ran 5-10% slow).
  common.warm_up_device(bf16_fns["fwd+bwd"], *arg_sets[0], seconds=2.0)
  chunk = calls_per_sync(tokens, hidden, ffn)
  out["calls_per_sync"] = chunk
  tokamax_steps, out["tokamax_max_rel_error"] = tokamax_variants(tokamax, bf16_fns, arg_sets)
  # The weights quantized once, outside the timed calls: plain copies for the forward
  # (inference), trainable ones for the forward + backward (a micro-batch's step).
  def quantized(recipe):
    return {
        pass_name: [(x, jaxfuse.quantize_experts(k1, recipe, trainable=trainable),
                     jaxfuse.quantize_experts(k2, recipe, trainable=trainable), s, sizes_, dy)
                    for x, k1, k2, s, sizes_, dy in arg_sets]
        for pass_name, trainable in (("fwd", False), ("fwd+bwd", True))}

  quantized_sets, block_quantized_sets = quantized(FP8_RECIPE), quantized(BLOCK_RECIPE)
  block_fns = jax_fns("ffi", BLOCK_RECIPE)
  block_fp8_wgrad_fns = jax_fns("ffi", BLOCK_FP8_WGRAD_RECIPE)
  for pass_name in bf16_fns:
    variants = {"jaxfuse": common.rotating(bf16_fns[pass_name], arg_sets),
                "jaxfuse_saved_activation": common.rotating(saved_fns[pass_name], arg_sets),
                "jaxfuse_gated_fc1": common.rotating(gated_fns[pass_name], arg_sets),
                "jaxfuse_fp8": common.rotating(fp8_fns[pass_name], arg_sets),
                "jaxfuse_fp8_wgrad16": common.rotating(fp8_wgrad16_fns[pass_name], arg_sets)}
    if pass_name in tokamax_steps:
      variants["tokamax"] = tokamax_steps[pass_name]
    variants["jaxfuse_fp8_quantized_kernels"] = common.rotating(fp8_fns[pass_name],
                                                                quantized_sets[pass_name])
    variants["jaxfuse_fp8_blockwise"] = common.rotating(block_fns[pass_name], arg_sets)
    if pass_name == "fwd+bwd":  # the forward is the same
      variants["jaxfuse_fp8_blockwise_fp8_wgrad"] = common.rotating(
          block_fp8_wgrad_fns[pass_name], arg_sets)
    variants["jaxfuse_fp8_blockwise_quantized_kernels"] = common.rotating(
        block_fns[pass_name], block_quantized_sets[pass_name])
    stats = common.time_alternating(variants, rounds=max(2, calls // common.CHUNK), chunk=chunk)
    for name, timing in stats.items():
      out[name][pass_name] = timing["median_ms"]
  for pass_name, fn in jax_fns("xla").items():  # ~15x slower: drift does not matter here
    try:
      args = [arg_sets[i % len(arg_sets)] for i in range(baseline_calls + 3)]
      out["ragged_dot"][pass_name] = common.time_fn(fn, args)["median_ms"]
    except Exception as error:  # an out-of-memory baseline must not stop the run
      print(f"ragged_dot {pass_name} failed: {type(error).__name__}: {str(error)[:200]}")
      out["ragged_dot"][pass_name] = None
  del arg_sets, quantized_sets, block_quantized_sets
  return out


# --- torch -------------------------------------------------------------------------------

torch_time = common.time_torch_ms


def torch_fns(tokens, hidden, ffn):
  """(forward, explicit forward + backward, autograd forward + backward or None, and the
  autograd step with SwiGLU in bf16 or None).

  The first three compute SwiGLU in fp32, as jaxfuse does. The last is what a PyTorch
  user would write, `F.silu(a) * b * scales` on bf16 tensors: fewer bytes per eager
  kernel, bf16 rounding after each of them."""
  import torch
  import torch.nn.functional as F
  gen = torch.Generator(device="cuda").manual_seed(0)
  x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
  w1 = (torch.randn(EXPERTS, hidden, 2 * ffn, device="cuda", generator=gen) /
        hidden**0.5).to(torch.bfloat16)
  w2 = (torch.randn(EXPERTS, ffn, hidden, device="cuda", generator=gen) /
        ffn**0.5).to(torch.bfloat16)
  # Column-major per expert (what _grouped_mm's fast path wants for the right operand).
  w1c = w1.transpose(-2, -1).contiguous().transpose(-2, -1)
  w2c = w2.transpose(-2, -1).contiguous().transpose(-2, -1)
  scales = torch.rand(tokens, device="cuda", generator=gen) * 0.9 + 0.1
  dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
  offs = torch.tensor(np.cumsum(group_sizes(tokens)), device="cuda", dtype=torch.int32)
  gmm = torch._grouped_mm

  def forward():
    h = gmm(x, w1c, offs=offs)
    a, b = h.chunk(2, dim=-1)
    act = (F.silu(a.float()) * b.float() * scales[:, None]).to(torch.bfloat16)
    return gmm(act, w2c, offs=offs)

  def forward_backward():  # the six grouped GEMMs, SwiGLU's backward in eager torch
    h = gmm(x, w1c, offs=offs)
    a, b = (t.float() for t in h.chunk(2, dim=-1))
    sig = torch.sigmoid(a)
    silu = a * sig
    act = silu * b
    act_s = (act * scales[:, None]).to(torch.bfloat16)
    y = gmm(act_s, w2c, offs=offs)
    da = gmm(dy, w2.transpose(-2, -1), offs=offs).float()
    dw2 = gmm(act_s.t(), dy, offs=offs)
    dscales = (da * act).sum(-1)
    dact = da * scales[:, None]
    dh = torch.cat([dact * b * sig * (1 + a * (1 - sig)), dact * silu], -1).to(torch.bfloat16)
    dx = gmm(dh, w1.transpose(-2, -1), offs=offs)
    dw1 = gmm(x.t(), dh, offs=offs)
    return y, dx, dw1, dw2, dscales

  autograd = None
  try:
    xa = x.detach().requires_grad_()
    w1a, w2a = w1c.detach().requires_grad_(), w2c.detach().requires_grad_()
    sa = scales.detach().requires_grad_()

    def autograd_step_with(activation):
      def step():
        h = gmm(xa, w1a, offs=offs)
        a, b = h.chunk(2, dim=-1)
        y = gmm(activation(a, b, sa[:, None]), w2a, offs=offs)
        grads = torch.autograd.grad(y, (xa, w1a, w2a, sa), dy)
        return y, grads
      return step

    autograd_step = autograd_step_with(  # fp32 SwiGLU, jaxfuse's math
        lambda a, b, s: (F.silu(a.float()) * b.float() * s).to(torch.bfloat16))
    autograd_bf16_act_step = autograd_step_with(  # on bf16 tensors
        lambda a, b, s: F.silu(a) * b * s.to(torch.bfloat16))

    autograd_step()
    autograd_bf16_act_step()
    autograd, autograd_bf16_act = autograd_step, autograd_bf16_act_step
  except Exception as error:  # older torch: no autograd formula for _grouped_mm
    print(f"torch autograd through _grouped_mm unavailable ({type(error).__name__}); "
          "timing the explicit backward only")
    autograd_bf16_act = None
  return forward, forward_backward, autograd, autograd_bf16_act


def torch_graph_time(fn, calls):
  import torch
  stream = torch.cuda.Stream()
  stream.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(stream):
    for _ in range(3):
      fn()
  torch.cuda.current_stream().wait_stream(stream)
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    fn()
  return torch_time(graph.replay, calls)


def time_torch(tokens, hidden, ffn, calls, graphs):
  try:
    import torch
    if not torch.cuda.is_available():
      return None
  except ImportError:
    return None
  try:
    forward, forward_backward, autograd, autograd_bf16_act = torch_fns(tokens, hidden, ffn)
    out = {"fwd": torch_time(forward, calls),
           "fwd+bwd": torch_time(autograd or forward_backward, calls),
           "fwd+bwd explicit": torch_time(forward_backward, calls),
           "mode": "autograd" if autograd else "explicit"}
    if autograd_bf16_act is not None:
      out["fwd+bwd bf16 act"] = torch_time(autograd_bf16_act, calls)
    if graphs:
      out["fwd graph"] = torch_graph_time(forward, calls)
      out["fwd+bwd graph"] = torch_graph_time(forward_backward, calls)
  except Exception as error:
    print(f"torch._grouped_mm failed: {type(error).__name__}: {str(error)[:300]}")
    return None
  finally:
    torch.cuda.empty_cache()
  return out


ANCHOR_CALLS = 30
ANCHOR_WARMUP = 3
ANCHOR_IDLE_S = 3.0


def time_jax_per_call_ms(fn, arg_sets, calls, warmup):
  """Per-call times (ms) of ``fn``, each call synchronised on its own, inputs rotated."""
  for index in range(warmup):
    jax.block_until_ready(fn(*arg_sets[index % len(arg_sets)]))
  times = []
  for index in range(calls):
    args = arg_sets[index % len(arg_sets)]
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return times


def anchor_protocol_rows(name, tokens, hidden, ffn):
  """Rows of the fwd+bwd seed case under ANCHORS.md's protocol (module docstring)."""
  arg_sets = rotated_arg_sets(tokens, hidden, ffn)
  timers = {"jaxfuse": functools.partial(time_jax_per_call_ms,
                                         jax_fns("ffi")["fwd+bwd"], arg_sets),
            "jaxfuse_fp8": functools.partial(time_jax_per_call_ms,
                                             jax_fns("ffi", FP8_RECIPE)["fwd+bwd"], arg_sets)}
  try:
    import torch
    if torch.cuda.is_available():
      _, _, autograd, autograd_bf16_act = torch_fns(tokens, hidden, ffn)
      if autograd is not None:
        for impl, step in (("torch", autograd), ("torch_bf16_act", autograd_bf16_act)):
          timers[impl] = functools.partial(common.torch_call_times_ms, step)
  except ImportError:
    pass
  for timer in timers.values():  # compile everything before the first idle period
    timer(calls=1, warmup=1)
  times = {impl: [] for impl in timers}
  rounds = {impl: [] for impl in timers}
  for order in (list(timers), list(timers)[::-1]):
    for impl in order:
      time.sleep(ANCHOR_IDLE_S)
      with common.GpuMonitor() as gpu:
        block = timers[impl](calls=ANCHOR_CALLS, warmup=ANCHOR_WARMUP)
      times[impl] += block
      rounds[impl].append({"median_ms": statistics.median(block), "gpu": gpu.summary})
  flops = mlp_api.flops(tokens, hidden, ffn, "swiglu", backward=True)
  row = {"section": "anchors protocol", "case": name, "tokens": tokens, "hidden": hidden,
         "ffn": ffn, "experts": EXPERTS, "pass": "fwd+bwd", "flops": flops,
         "calls_per_block": ANCHOR_CALLS, "idle_before_block_s": ANCHOR_IDLE_S}
  for impl, impl_times in times.items():
    row[f"{impl}_ms"] = statistics.median(impl_times)
    row[f"{impl}_tflops"] = flops / (row[f"{impl}_ms"] * 1e-3) / 1e12
    row[f"{impl}_blocks"] = rounds[impl]
  if "torch_ms" in row:
    row["jaxfuse_vs_torch"] = row["torch_ms"] / row["jaxfuse_ms"]
    row["jaxfuse_vs_torch_bf16_act"] = row["torch_bf16_act_ms"] / row["jaxfuse_ms"]
  print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
         if not k.endswith("_blocks")}, flush=True)
  return [row]


def rows_for(section, name, tokens, hidden, ffn, jax_times, torch_times):
  rows = []
  for pass_name in ("fwd", "fwd+bwd"):
    flops = mlp_api.flops(tokens, hidden, ffn, "swiglu", backward=pass_name == "fwd+bwd")
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12 if ms else None
    row = {"section": section, "case": name, "tokens": tokens, "hidden": hidden, "ffn": ffn,
           "experts": EXPERTS, "pass": pass_name, "flops": flops,
           "jaxfuse_calls_per_sync": jax_times.get("calls_per_sync"),
           "tokamax_max_rel_error": jax_times.get("tokamax_max_rel_error")}
    for impl in JAX_IMPLS:
      row[f"{impl}_ms"] = jax_times[impl].get(pass_name)
      row[f"{impl}_tflops"] = tflops(row[f"{impl}_ms"])
    t = torch_times or {}
    row["torch_ms"] = t.get(pass_name)
    row["torch_tflops"] = tflops(row["torch_ms"])
    row["torch_mode"] = t.get("mode")
    if f"{pass_name} graph" in t:
      row["torch_graph_ms"] = t[f"{pass_name} graph"]
      row["torch_graph_tflops"] = tflops(row["torch_graph_ms"])
    if pass_name == "fwd+bwd" and "fwd+bwd explicit" in t:
      row["torch_explicit_ms"] = t["fwd+bwd explicit"]
    if pass_name == "fwd+bwd" and "fwd+bwd bf16 act" in t:
      row["torch_bf16_act_ms"] = t["fwd+bwd bf16 act"]
      row["torch_bf16_act_tflops"] = tflops(row["torch_bf16_act_ms"])
      row["jaxfuse_vs_torch_bf16_act"] = (row["torch_bf16_act_ms"] / row["jaxfuse_ms"]
                                          if row["jaxfuse_ms"] else None)
    row["jaxfuse_vs_torch"] = (row["torch_ms"] / row["jaxfuse_ms"]
                               if row["torch_ms"] and row["jaxfuse_ms"] else None)
    row["jaxfuse_vs_ragged_dot"] = (row["ragged_dot_ms"] / row["jaxfuse_ms"]
                                    if row["ragged_dot_ms"] and row["jaxfuse_ms"] else None)
    row["jaxfuse_vs_tokamax"] = (row["tokamax_ms"] / row["jaxfuse_ms"]
                                 if row["tokamax_ms"] and row["jaxfuse_ms"] else None)
    row["fp8_speedup"] = (row["jaxfuse_ms"] / row["jaxfuse_fp8_ms"]
                          if row["jaxfuse_ms"] and row["jaxfuse_fp8_ms"] else None)
    row["gated_fc1_speedup"] = (row["jaxfuse_ms"] / row["jaxfuse_gated_fc1_ms"]
                                if row["jaxfuse_ms"] and row["jaxfuse_gated_fc1_ms"]
                                else None)
    rows.append(row)
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="fewer calls, shorter sweep")
  parser.add_argument("--no-sweep", action="store_true", help="the seed cases only")
  parser.add_argument("--tag", default="", help="suffix of the results file name")
  parser.add_argument("--protocol", choices=("sustained", "anchors"), default="sustained",
                      help="sustained: alternating chunks after 2 s of warm-up (default); "
                           "anchors: shared/ANCHORS.md's bursts (module docstring)")
  args = parser.parse_args()
  if args.protocol == "anchors":
    rows = []
    for name, (tokens, hidden, ffn) in CASES.items():
      rows += anchor_protocol_rows(name, tokens, hidden, ffn)
    common.print_table(rows, ["case", "pass", "jaxfuse_ms", "jaxfuse_fp8_ms", "torch_ms",
                              "torch_bf16_act_ms", "jaxfuse_vs_torch",
                              "jaxfuse_vs_torch_bf16_act"])
    common.write_results("grouped_mlp_anchors", rows, tag=args.tag, dtype="bfloat16",
                         method="ANCHORS.md protocol: per implementation, 3 s idle, 3 warm-up "
                                "calls, 30 calls each synchronised on its own (JAX: host "
                                "clock with block_until_ready; torch: CUDA events), median; "
                                "two rounds, the second in reverse order",
                         fp8_recipe="Float8CurrentScaling(per_group=True) (jaxfuse_fp8_*)",
                         activation="swiglu", experts=EXPERTS,
                         baselines="torch._grouped_mm + eager SwiGLU (fp32: torch_*; bf16: "
                                   "torch_bf16_act_*), autograd, same run")
    return
  calls = 5 if args.quick else 40
  baseline_calls = 3 if args.quick else 10  # ragged_dot is G times the work
  tokamax, tokamax_missing = tokamax_baseline.load()
  if tokamax is None:
    print(f"tokamax baseline unavailable: {tokamax_missing}", flush=True)
  rows = []
  for name, (tokens, hidden, ffn) in CASES.items():
    with common.GpuMonitor() as gpu:  # clocks and power: sustained GEMMs hit the power cap
      jax_times = time_jax(tokens, hidden, ffn, calls, baseline_calls, tokamax)
      torch_times = time_torch(tokens, hidden, ffn, calls, graphs=tokens <= 4096)
    case_rows = rows_for("case", name, tokens, hidden, ffn, jax_times, torch_times)
    rows += [dict(row, gpu=gpu.summary) for row in case_rows]
    print(f"{name}: GPU during the case {gpu.summary}", flush=True)
  sweep = [] if args.no_sweep else SWEEP_TOKENS[::2] if args.quick else SWEEP_TOKENS
  for tokens in sweep:
    if (tokens, SWEEP_HIDDEN, SWEEP_FFN) == CASES["T=65536 H=2048 F=2048"]:
      case_rows = [r for r in rows if r["case"] == "T=65536 H=2048 F=2048"]
      rows += [dict(r, section="sweep") for r in case_rows]
      continue
    jax_times = time_jax(tokens, SWEEP_HIDDEN, SWEEP_FFN, calls, baseline_calls, tokamax)
    torch_times = time_torch(tokens, SWEEP_HIDDEN, SWEEP_FFN, calls, graphs=False)
    rows += rows_for("sweep", f"sweep T={tokens}", tokens, SWEEP_HIDDEN, SWEEP_FFN, jax_times,
                     torch_times)
  common.print_table(rows, ["case", "pass", "jaxfuse_ms", "jaxfuse_tflops",
                            "jaxfuse_saved_activation_ms", "jaxfuse_gated_fc1_ms",
                            "gated_fc1_speedup",
                            "jaxfuse_fp8_tflops", "jaxfuse_fp8_wgrad16_tflops",
                            "jaxfuse_fp8_quantized_kernels_tflops",
                            "jaxfuse_fp8_blockwise_tflops", "jaxfuse_fp8_blockwise_fp8_wgrad_ms",
                            "jaxfuse_fp8_blockwise_quantized_kernels_tflops",
                            "fp8_speedup", "torch_tflops", "torch_bf16_act_tflops",
                            "torch_graph_tflops", "tokamax_tflops", "ragged_dot_tflops",
                            "jaxfuse_vs_torch", "jaxfuse_vs_torch_bf16_act", "jaxfuse_vs_tokamax",
                            "jaxfuse_vs_ragged_dot"])
  common.write_results("grouped_mlp", rows, tag=args.tag, dtype="bfloat16",
                       fp8_recipe="Float8CurrentScaling(per_group=True) (jaxfuse_fp8_*); "
                                  "fp8_wgrad=False (jaxfuse_fp8_wgrad16_*); "
                                  "Float8BlockScaling() (jaxfuse_fp8_blockwise_*)",
                       activation="swiglu",
                       experts=EXPERTS,
                       baselines="jax.lax.ragged_dot + jnp SwiGLU (XLA), torch._grouped_mm "
                                 "+ eager SwiGLU (autograd when available; CUDA graph for the "
                                 "small case) and tokamax.ragged_dot (Pallas Mosaic GPU) + jnp "
                                 "SwiGLU, same run",
                       tokamax=(tokamax_baseline.version(tokamax) if tokamax is not None
                                else f"unavailable: {tokamax_missing}"))


if __name__ == "__main__":
  main()
