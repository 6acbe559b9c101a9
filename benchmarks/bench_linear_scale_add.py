"""linear_scale_add vs XLA's own fusion of ``residual + alpha * (x @ kernel)`` (bf16).

XLA rewrites the jnp expression into one cuBLASLt call with alpha and beta = 1, so this
measures whether jaxfuse's custom call matches it (goal: within 3% or faster), forward
and forward + backward, at 4096-65536 tokens x 4096-8192 features. Residuals are donated
and each call's output is the next call's residual, as in a training step that updates
the residual stream; the two variants run in alternating chunks (common.time_alternating).

FP8 rows (issue 3's shapes, against the same bf16 XLA step): the FP8 op with per-tensor
current scaling, forward and fwd+bwd; fwd+bwd without returning the residual's cotangent
(see make_step); on a kernel quantized once (jaxfuse.quantize_kernel): the forward on a
frozen copy, fwd+bwd on a trainable one; and per layer of a stack of 8 layers in one jit
(make_stack_step), as a model's training step runs them.

Each FP8 row also gives the device time per call of both variants (``*_device_ms``: the span
of their kernels over calls dispatched back to back, from CUPTI; common.device_time_per_call)
and the speedup on that clock. The host clock's chunks of ``--chunk`` calls each hold one
call's dispatch latency (about 0.1-0.4 ms on the H200), which weighs more on the faster
variant: a training loop that dispatches steps back to back never pays it.

    python benchmarks/bench_linear_scale_add.py [--quick] [--fp8-only | --bf16-only] [--tag TAG]
        [--chunk CALLS] [--device-calls CALLS]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxfuse
from benchmarks import common

ALPHA = 0.5
SHAPES = [(tokens, features) for tokens in (4096, 16384, 65536) for features in (4096, 8192)]
# FP8 (per-tensor current scaling) against the bf16 XLA baseline: issue 3's two shapes.
FP8_SHAPES = [(8192, 8192), (65536, 4096)]
FP8_RECIPE = jaxfuse.quantization.Float8CurrentScaling(per_group=False)


def xla_linear_scale_add(x, kernel, residual):
  """The baseline: XLA's own lowering of the plain jnp expression (one cuBLASLt call)."""
  return residual + ALPHA * (x @ kernel)


def make_step(implementation: str, backward: bool, recipe=None, residual_cotangent=True):
  """The jitted step; the residual is donated. The residual's cotangent is d_out itself:
  returning it from the step (``residual_cotangent``, the default) makes XLA copy d_out
  into a new output buffer, a full read and write of [tokens, features] for every
  implementation alike (donating d_out does not avoid it: XLA gives d_out's buffer to dx,
  of the same shape). Inside a training step that cotangent is an intermediate handed on
  to the layer below, with no copy; ``residual_cotangent=False`` measures that case (the
  step returns out, dx and dkernel; nothing is computed for the residual either way)."""
  def forward(x, kernel, residual):
    if implementation == "xla":
      return xla_linear_scale_add(x, kernel, residual)
    return jaxfuse.linear_scale_add(x, kernel, residual, ALPHA, recipe=recipe,
                                    implementation=implementation)

  if not backward:
    return jax.jit(forward, donate_argnums=2)

  def forward_backward(x, kernel, residual, d_out):
    out, vjp = jax.vjp(forward, x, kernel, residual)
    # A trainable kernel copy's gradient: its master's (common.masters).
    dx, dkernel, dresidual = common.masters(vjp(d_out))
    return (out, dx, dkernel, dresidual) if residual_cotangent else (out, dx, dkernel)

  return jax.jit(forward_backward, donate_argnums=2)


# Layers of the stacked FP8 rows: one jit runs this many residual layers (lax.scan).
STACK_LAYERS = 8


def make_stack_step(implementation: str, backward: bool, recipe=None, layers=STACK_LAYERS):
  """A stack of `layers` residual layers in one jitted step, as in a model's training
  step: h <- h + alpha * x_l @ kernel_l for l < layers (jax.lax.scan over xs [L, T, K] and
  kernels [L, K, N], the residual stream h carried and updated in place, h donated). With
  ``backward`` the VJP of the whole stack: dh flows from layer to layer as it does in
  training, where no copy of it is made (so the step returns out, dxs and dkernels).
  Host dispatch is paid once per `layers` layers, not per layer."""
  def layer(h, operands_l):
    x, kernel = operands_l
    if implementation == "xla":
      return xla_linear_scale_add(x, kernel, h), None
    return jaxfuse.linear_scale_add(x, kernel, h, ALPHA, recipe=recipe,
                                    implementation=implementation), None

  def forward(xs, kernels, residual):
    return jax.lax.scan(layer, residual, (xs, kernels), length=layers)[0]

  if not backward:
    return jax.jit(forward, donate_argnums=2)

  def forward_backward(xs, kernels, residual, d_out):
    out, vjp = jax.vjp(forward, xs, kernels, residual)
    dxs, dkernels, _ = vjp(d_out)
    return out, dxs, dkernels

  return jax.jit(forward_backward, donate_argnums=2)


def operands(tokens, features, seed):
  """x [tokens, features], kernel [features, features] (unit-scale output), d_out; bf16."""
  kx, kk, kr = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (tokens, features), jnp.bfloat16)
  kernel = (jax.random.normal(kk, (features, features)) / features**0.5).astype(jnp.bfloat16)
  d_out = jax.random.normal(kr, (tokens, features), jnp.bfloat16)
  return x, kernel, d_out


def time_pair(steps: dict, x, kernel, d_out, backward, rounds, chunk=common.CHUNK,
              device_calls=0) -> dict[str, dict]:
  """common.time_alternating over `steps` (label -> jitted step): each step's residual is
  donated and replaced by its output, as a residual stream is updated in training.
  `kernel`: one for every step, or {label: kernel}. With `device_calls`, each label's
  stats also hold ``device_span_ms`` and ``device_kernel_ms`` (common.device_time_per_call
  over that many calls back to back, on a fresh residual: the timed one was donated)."""
  tokens, features = d_out.shape

  def variant(index, label, step):
    residual = jax.random.normal(jax.random.key(index), (tokens, features), jnp.bfloat16)
    kernel_ = kernel[label] if isinstance(kernel, dict) else kernel
    args = (x, kernel_, residual, d_out) if backward else (x, kernel_, residual)
    advance = lambda args, outputs: (*args[:2], outputs[0] if backward else outputs,
                                     *args[3:])
    return step, args, advance

  timing = common.time_alternating(
      {label: variant(index, label, step) for index, (label, step) in enumerate(steps.items())},
      rounds=rounds, chunk=chunk)
  for index, (label, step) in enumerate(steps.items() if device_calls else ()):
    device = common.device_time_per_call(variant(index, label, step), device_calls)
    timing[label].update({f"device_{key}": value for key, value in device.items()})
  return timing


def time_fp8(shapes, rounds, chunk=common.CHUNK, device_calls=0) -> list[dict]:
  """FP8 linear_scale_add (forward, forward + backward) against bf16 XLA, same run."""
  rows = []
  for tokens, features in shapes:
    x, kernel, d_out = operands(tokens, features, tokens * 7 + features)
    flops = 2 * tokens * features * features
    # fwd+bwd whose residual cotangent is not returned (make_step: no copy of d_out, as
    # inside a training step); then the FP8 op on the kernel quantized once, outside the
    # timed calls (jaxfuse.quantize_kernel): a frozen copy for the forward (inference), a
    # trainable one for fwd+bwd (a micro-batch's step, the weights quantized once per
    # optimizer step). The XLA bf16 step is the same in every pass.
    frozen = jaxfuse.quantize_kernel(kernel, FP8_RECIPE)
    trainable = jaxfuse.quantize_kernel(kernel, FP8_RECIPE, trainable=True)
    passes = (("fwd", False, True, kernel), ("fwd+bwd", True, True, kernel),
              ("fwd+bwd, d_residual passed on", True, False, kernel),
              ("fwd, kernel quantized once", False, True, frozen),
              ("fwd+bwd, trainable kernel copy", True, True, trainable))
    for pass_name, backward, returned, fp8_kernel in passes:
      row = {"tokens": tokens, "features": features, "pass": pass_name}
      with common.GpuMonitor() as gpu:
        timing = time_pair({"xla_bf16": make_step("xla", backward, residual_cotangent=returned),
                            "jaxfuse_fp8": make_step("ffi", backward, FP8_RECIPE,
                                                     residual_cotangent=returned)},
                           x, {"xla_bf16": kernel, "jaxfuse_fp8": fp8_kernel}, d_out,
                           backward, rounds, chunk, device_calls)
      rows.append(_fp8_row(row, timing, gpu, flops * (3 if backward else 1)))
    rows.extend(time_stack(tokens, features, rounds, chunk=chunk, device_calls=device_calls))
  return rows


def _fp8_row(row, timing, gpu, flops, layers=1) -> dict:
  """`row` completed from a time_pair of "xla_bf16" and "jaxfuse_fp8": ms (per layer of a
  `layers`-layer step), TFLOP/s of `flops` per layer, the speedups (host clock, paired, and
  on the device clock where time_pair measured it), the GPU's clocks."""
  row["gpu"] = gpu.summary
  for label, stats in timing.items():
    row[f"{label}_ms"] = stats["median_ms"] / layers
    row[f"{label}_tflops"] = flops / (row[f"{label}_ms"] * 1e-3) / 1e12
    if "device_span_ms" in stats:
      row[f"{label}_device_ms"] = stats["device_span_ms"] / layers
  row["fp8_speedup_vs_xla_bf16"] = row["xla_bf16_ms"] / row["jaxfuse_fp8_ms"]
  row["paired_speedup"] = timing["jaxfuse_fp8"]["paired_speedup_vs_xla_bf16"]
  if "jaxfuse_fp8_device_ms" in row and "xla_bf16_device_ms" in row:
    row["device_speedup"] = row["xla_bf16_device_ms"] / row["jaxfuse_fp8_device_ms"]
  print(row, flush=True)
  return row


def time_stack(tokens, features, rounds, layers=STACK_LAYERS, chunk=common.CHUNK,
               device_calls=0) -> list[dict]:
  """The FP8 and bf16 XLA stacks of make_stack_step (fresh x and kernel per layer), forward
  and fwd+bwd; times per layer (the step's median over `layers`)."""
  keys = jax.random.split(jax.random.key(tokens + features), 3)
  xs = jax.random.normal(keys[0], (layers, tokens, features), jnp.bfloat16)
  kernels = (jax.random.normal(keys[1], (layers, features, features)) /
             features**0.5).astype(jnp.bfloat16)
  d_out = jax.random.normal(keys[2], (tokens, features), jnp.bfloat16)
  flops = 2 * tokens * features * features
  rows = []
  for backward in (False, True):
    row = {"tokens": tokens, "features": features, "layers": layers,
           "pass": f"{'fwd+bwd' if backward else 'fwd'}, {layers} layers in one jit (per layer)"}
    with common.GpuMonitor() as gpu:
      timing = time_pair({"xla_bf16": make_stack_step("xla", backward, layers=layers),
                          "jaxfuse_fp8": make_stack_step("ffi", backward, FP8_RECIPE, layers)},
                         xs, kernels, d_out, backward, rounds, chunk, device_calls)
    rows.append(_fp8_row(row, timing, gpu, flops * (3 if backward else 1), layers))
  del xs, kernels
  return rows


def timing_method(chunk: int, device_calls: int) -> str:
  """The results file's description of how the rows were timed."""
  method = (f"wall time of alternating chunks of {chunk} calls dispatched back to back, one "
            "sync per chunk, median over chunks of chunk time / calls")
  if device_calls:
    method += (f"; *_device_ms: span of the variant's kernels over {device_calls} calls "
               "dispatched back to back (CUPTI through torch.profiler) / calls")
  return method


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="two small shapes, few calls")
  parser.add_argument("--fp8-only", action="store_true", help="the FP8 rows alone")
  parser.add_argument("--bf16-only", action="store_true", help="the bf16 rows alone")
  parser.add_argument("--tag", default="", help="suffix of the results file names (a knob sweep)")
  parser.add_argument("--chunk", type=int, default=common.CHUNK,
                      help="calls per host-clock chunk (one sync each)")
  parser.add_argument("--device-calls", type=int, default=10,
                      help="calls per FP8 variant on the device clock (0: none)")
  args = parser.parse_args()
  shapes = SHAPES[:2] if args.quick else SHAPES
  rounds = 2 if args.quick else 12  # chunks per variant, alternating (--chunk calls each)
  rows = []
  for tokens, features in ([] if args.fp8_only else shapes):
    x, kernel, d_out = operands(tokens, features, tokens + features)
    flops = 2 * tokens * features * features
    for backward in (False, True):
      row = {"tokens": tokens, "features": features, "pass": "fwd+bwd" if backward else "fwd"}
      with common.GpuMonitor() as gpu:
        timing = time_pair({"xla": make_step("xla", backward),
                            "jaxfuse": make_step("ffi", backward)},
                           x, kernel, d_out, backward, rounds, args.chunk)
      row["gpu"] = gpu.summary
      for label, stats in timing.items():
        row[f"{label}_ms"] = stats["median_ms"]
        row[f"{label}_tflops"] = flops * (3 if backward else 1) / (stats["median_ms"] * 1e-3) / 1e12
      row["speedup_vs_xla"] = row["xla_ms"] / row["jaxfuse_ms"]
      row["paired_speedup"] = timing["jaxfuse"]["paired_speedup_vs_xla"]
      rows.append(row)
      print(row, flush=True)
  if rows:
    common.print_table(rows, ["tokens", "features", "pass", "jaxfuse_ms", "xla_ms",
                              "jaxfuse_tflops", "xla_tflops", "speedup_vs_xla", "paired_speedup"])
    common.write_results("linear_scale_add", rows, tag=args.tag, alpha=ALPHA, dtype="bfloat16",
                         method=timing_method(args.chunk, 0),
                         baseline="XLA lowering of residual + alpha * (x @ kernel) in bf16, "
                                  "same run")
  if args.bf16_only:
    return
  fp8_rows = time_fp8(FP8_SHAPES[:1] if args.quick else FP8_SHAPES, rounds, args.chunk,
                      args.device_calls)
  common.print_table(fp8_rows, ["tokens", "features", "pass", "jaxfuse_fp8_ms", "xla_bf16_ms",
                                "jaxfuse_fp8_tflops", "fp8_speedup_vs_xla_bf16", "paired_speedup",
                                "jaxfuse_fp8_device_ms", "xla_bf16_device_ms", "device_speedup"])
  common.write_results("linear_scale_add_fp8", fp8_rows, tag=args.tag, alpha=ALPHA,
                       recipe=repr(FP8_RECIPE), method=timing_method(args.chunk,
                                                                     args.device_calls),
                       baseline="XLA lowering of residual + alpha * (x @ kernel) in bf16, "
                                "same run")


if __name__ == "__main__":
  main()
