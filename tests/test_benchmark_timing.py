"""The benchmarks' timing helpers (benchmarks/common.py): alternation order, chained
arguments, the wait on the last outputs, the paired ratio, the warm-up, the chunk lengths,
the GPU monitor and the kernel-time summary, and bench_grouped_linear's handling of a
failing variant. Host-only: sleeps and stand-ins replace device work."""

from __future__ import annotations

import os
import time

import pytest

from benchmarks import bench_grouped_linear
from benchmarks import common


def test_alternating_order_chaining_and_wait():
  calls, waited = [], []

  def make(name):
    def fn(value):
      calls.append(name)
      return value + 1
    return fn

  variants = {
      "a": (make("a"), (0,), lambda args, out: (out,), waited.append),
      "b": (make("b"), (100,), common.keep_args, waited.append),
  }
  stats = common.time_alternating(variants, rounds=3, warmup=1)
  chunk = common.CHUNK
  # Warm-up (one call each), then a b, b a, a b in chunks of CHUNK calls.
  expected = ["a", "b"] + ["a"] * chunk + ["b"] * chunk + ["b"] * chunk + ["a"] * chunk + (
      ["a"] * chunk + ["b"] * chunk)
  assert calls == expected
  # "a" chained its output into its next call (1 + 3 * CHUNK calls from 0); "b" did not.
  assert waited[-1] == 1 + 3 * chunk or waited[-2] == 1 + 3 * chunk
  assert 101 in waited and max(w for w in waited if w >= 100) == 101
  assert stats["a"]["calls"] == stats["b"]["calls"] == 3 * chunk


def test_chunk_length_sets_the_calls_between_syncs():
  calls, waits = [], []
  variants = {"a": (lambda: calls.append("a"), (), common.keep_args,
                    lambda _: waits.append(len(calls)))}
  stats = common.time_alternating(variants, rounds=2, warmup=1, chunk=7)
  # One warm-up call, then two chunks of 7 calls, each ended by one wait.
  assert waits == [1, 8, 15]
  assert stats["a"]["calls"] == 14


def test_warm_up_keeps_the_device_busy_once_per_process(monkeypatch):
  monkeypatch.setattr(common, "_WARMED_UP", False)
  calls = []
  common.warm_up_device(lambda: calls.append(time.perf_counter()), seconds=0.05)
  assert len(calls) >= 11 and calls[-1] - calls[0] >= 0.04  # busy for about `seconds`
  first = len(calls)
  common.warm_up_device(lambda: calls.append(time.perf_counter()), seconds=0.05)
  assert len(calls) == first  # later scripts' calls in the same process add nothing


def test_gpu_samples_summary_reads_nvidia_smi_lines():
  # Lines as nvidia-smi --format=csv,noheader,nounits prints them (values from
  # results/logs/clocks_2026-11-30_c515327a_s16call2.log), plus lines it must skip.
  lines = ["1980, 129.67, 41, 0x0000000000000000",
           "1485, 708.51, 55, 0x0000000000000004",
           "1695, 683.68, 57, 0x0000000000000004",
           "1965, 681.72, 57, 0x0000000000000044",
           "[N/A], [N/A], 40, 0x0", "clocks.current.sm [MHz], power.draw [W]", ""]
  summary = common.summarize_gpu_samples(lines)
  assert summary["samples"] == 4
  assert summary["sm_clock_mhz_min"] == 1485 and summary["sm_clock_mhz_median"] == 1830
  assert summary["power_w_max"] == pytest.approx(708.51)
  assert summary["temperature_c_max"] == 57
  assert summary["power_cap_fraction"] == 0.75
  assert summary["thermal_fraction"] == 0.25 and summary["hw_slowdown_fraction"] == 0.0
  # Without the reasons column (older drivers): no fractions, the rest still there.
  short = common.summarize_gpu_samples(["1980, 100.0, 40", "1700, 690.0, 50"])
  assert short["samples"] == 2 and "power_cap_fraction" not in short
  assert common.summarize_gpu_samples(["garbage"]) == {}


def test_gpu_monitor_without_nvidia_smi_is_a_no_op(monkeypatch):
  monkeypatch.setattr(common.shutil, "which", lambda name: None)
  with common.GpuMonitor() as monitor:
    pass
  assert monitor.summary == {}


def test_gpu_monitor_samples_while_the_block_runs(tmp_path, monkeypatch):
  # A stand-in nvidia-smi: one line for the probe, then samples until terminated.
  fake = tmp_path / "nvidia-smi"
  fake.write_text("#!/bin/sh\n"
                  "case \"$*\" in *-lms*) echo '1500, 700.0, 60, 0x4'; "
                  "echo '1980, 300.0, 50, 0x0'; exec sleep 30;; esac\n"
                  "echo '1980, 100.0, 40, 0x0'\n")
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
  with common.GpuMonitor(interval_ms=50) as monitor:
    time.sleep(0.3)
  assert monitor.summary["samples"] == 2
  assert monitor.summary["power_w_max"] == 700.0
  assert monitor.summary["power_cap_fraction"] == 0.5


def test_kernel_events_summary_counts_overlaps_once_and_spans_gaps():
  # Two calls: kernels [0, 10) and [5, 12) overlap (12 us busy), a gap, then [20, 30).
  events = [(20.0, 30.0), (0.0, 10.0), (5.0, 12.0)]
  summary = common.summarize_kernel_events(events, calls=2)
  assert summary["kernel_ms"] == pytest.approx(22.0 / 2 / 1e3)
  assert summary["span_ms"] == pytest.approx(30.0 / 2 / 1e3)
  assert common.summarize_kernel_events([], calls=2) == {}


def test_device_time_needs_torch_and_cuda():
  try:
    import torch  # pylint: disable=g-import-not-at-top
    if torch.cuda.is_available():
      pytest.skip("a CUDA device is visible: the GPU runs measure this")
  except ImportError:
    pass
  variant = (lambda: None, (), common.keep_args, lambda _: None)
  assert common.device_time_per_call(variant, calls=3) == {}


def test_grouped_mlp_chunks_hold_about_ten_ms_of_calls():
  from benchmarks import bench_grouped_mlp  # pylint: disable=g-import-not-at-top
  large = bench_grouped_mlp.calls_per_sync(65536, 2048, 2048)
  small = bench_grouped_mlp.calls_per_sync(2048, 1024, 1024)
  middle = bench_grouped_mlp.calls_per_sync(4096, 2048, 2048)
  assert large == common.CHUNK
  assert large < middle < small <= 200
  # The T=2048 step (~0.08 ms at the estimate's 500 TFLOP/s): its chunk holds ~10 ms.
  from jaxfuse._src.ops.grouped_mlp import api as mlp_api  # pylint: disable=g-import-not-at-top
  estimated_ms = mlp_api.flops(2048, 1024, 1024) / 500e12 * 1e3
  assert 10.0 <= small * estimated_ms < 10.0 + estimated_ms


def test_grouped_mlp_anchor_protocol_times_each_implementation_in_two_rounds(monkeypatch):
  from benchmarks import bench_grouped_mlp  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(bench_grouped_mlp, "ANCHOR_CALLS", 3)
  monkeypatch.setattr(bench_grouped_mlp, "ANCHOR_IDLE_S", 0.0)
  block_calls = []
  timer = bench_grouped_mlp.time_jax_per_call_ms

  def counting_timer(fn, arg_sets, calls=3, warmup=3):
    block_calls.append(calls)
    return timer(fn, arg_sets, calls=calls, warmup=warmup)

  monkeypatch.setattr(bench_grouped_mlp, "time_jax_per_call_ms", counting_timer)
  (row,) = bench_grouped_mlp.anchor_protocol_rows("tiny", 64, 16, 16)
  # One compile call per JAX implementation, then a block of 3 calls per round.
  assert sorted(block_calls) == [1, 1, 3, 3, 3, 3]
  for impl in ("jaxfuse", "jaxfuse_fp8"):
    assert len(row[f"{impl}_blocks"]) == 2
    assert row[f"{impl}_ms"] > 0.0
    assert row[f"{impl}_tflops"] == pytest.approx(row["flops"] / row[f"{impl}_ms"] / 1e9)
  assert row["section"] == "anchors protocol" and row["pass"] == "fwd+bwd"


def test_grouped_mlp_rows_compare_jaxfuse_with_both_torch_compositions():
  from benchmarks import bench_grouped_mlp  # pylint: disable=g-import-not-at-top
  jax_times = {impl: {"fwd": 2.0, "fwd+bwd": 8.0} for impl in bench_grouped_mlp.JAX_IMPLS}
  torch_times = {"fwd": 4.0, "fwd+bwd": 12.0, "fwd+bwd explicit": 14.0,
                 "fwd+bwd bf16 act": 10.0, "mode": "autograd"}
  forward, both = bench_grouped_mlp.rows_for("case", "c", 64, 16, 16, jax_times, torch_times)
  assert forward["jaxfuse_vs_torch"] == pytest.approx(2.0)
  assert "torch_bf16_act_ms" not in forward  # timed for the forward + backward only
  assert both["jaxfuse_vs_torch"] == pytest.approx(1.5)
  assert both["jaxfuse_vs_torch_bf16_act"] == pytest.approx(1.25)
  assert both["torch_bf16_act_tflops"] == pytest.approx(both["flops"] / 10.0e-3 / 1e12)
  assert both["torch_explicit_ms"] == 14.0


def test_alternating_times_and_paired_ratio():
  variants = {
      "fast": (lambda: time.sleep(0.002), (), common.keep_args, lambda _: None),
      "slow": (lambda: time.sleep(0.008), (), common.keep_args, lambda _: None),
  }
  stats = common.time_alternating(variants, rounds=2, warmup=1)
  assert 1.5 <= stats["fast"]["median_ms"] <= 20.0
  assert stats["slow"]["median_ms"] > stats["fast"]["median_ms"] * 1.8
  assert stats["fast"]["paired_speedup_vs_fast"] == pytest.approx(1.0)
  assert 0.1 <= stats["slow"]["paired_speedup_vs_fast"] <= 0.75


def test_rotating_cycles_through_the_argument_sets():
  seen = []
  fn, first, advance = common.rotating(lambda value: seen.append(value), [(1,), (2,), (3,)])
  common.time_alternating({"r": (fn, first, advance, lambda _: None)}, rounds=1, warmup=2)
  assert seen[:2] == [1, 2]  # warm-up
  assert seen[2:] == [[3, 1, 2][i % 3] for i in range(common.CHUNK)]


def test_a_failing_variant_is_dropped_and_the_others_timed(capsys):
  def fails():
    raise MemoryError("out of memory")

  times = bench_grouped_linear.alternate(
      {"ok": (lambda: time.sleep(0.001), (), common.keep_args, lambda _: None),
       "bad": (fails, (), common.keep_args, lambda _: None)}, rounds=1)
  assert set(times) == {"ok"} and times["ok"] > 0
  assert "bad failed" in capsys.readouterr().out


@pytest.mark.parametrize("kernel_name, owner", [
    # torch._grouped_mm's CUTLASS kernel (mangled) and its setup kernel (demangled).
    ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13"
     "GemmUniversalINS5_17GroupProblem", "torch"),
    ("void at::cuda::detail::prepare_grouped_gemm_data<cutlass::bfloat16_t>", "torch"),
    # jaxfuse's CUTLASS grouped kernel and setup kernel.
    ("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17GroupProblemShapeIN4cute5",
     "jaxfuse"),
    ("jaxfuse::grouped_gemm::(anonymous namespace)::SetupKernel(SetupParams)", "jaxfuse"),
    # XLA's dense GEMM (cuBLAS).
    ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NNT", "dense"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize256x128x64", "dense"),
])
def test_kernel_owner_attributes_each_framework(kernel_name, owner):
  assert bench_grouped_linear.kernel_owner(kernel_name) == owner


def test_kernel_times_need_torch_and_cuda():
  """Without torch or a CUDA device (CI) there are no kernel times, and nothing runs."""
  ran = []
  variants = {"a": (lambda: ran.append(1), (), common.keep_args, lambda _: None)}
  try:
    import torch  # pylint: disable=g-import-not-at-top
    if torch.cuda.is_available():
      pytest.skip("a CUDA device is present: the GPU benchmark run covers this")
  except ImportError:
    pass
  assert common.kernel_times_alternating(variants, lambda name: "a", rounds=1, chunk=1) == {}
  assert not ran


def test_linear_scale_add_rows_carry_the_device_clock_of_fresh_residuals(monkeypatch):
  """bench_linear_scale_add times each FP8 variant on the device clock after the host
  clock, on a residual of its own (the host-timed one was donated), and the row's
  device_speedup is XLA's device time over jaxfuse's."""
  import jax  # pylint: disable=g-import-not-at-top
  from benchmarks import bench_linear_scale_add as bench  # pylint: disable=g-import-not-at-top
  steps = {"xla_bf16": bench.make_step("xla", backward=True),
           "jaxfuse_fp8": bench.make_step("ffi", backward=True, recipe=bench.FP8_RECIPE)}
  device_ms = {steps["xla_bf16"]: 3.0, steps["jaxfuse_fp8"]: 2.0}
  timed_calls = []

  def device_time(variant, calls):
    fn, args, advance = variant
    for _ in range(calls):  # a residual donated by the host timing would raise here
      outputs = fn(*args)
      args = advance(args, outputs)
    jax.block_until_ready(outputs)
    timed_calls.append(calls)
    return {"span_ms": device_ms[fn], "kernel_ms": device_ms[fn] * 0.9}

  monkeypatch.setattr(common, "device_time_per_call", device_time)
  x, kernel, d_out = bench.operands(16, 32, seed=0)
  timing = bench.time_pair(steps, x, kernel, d_out, backward=True, rounds=1, chunk=2,
                           device_calls=3)
  assert timed_calls == [3, 3]
  assert timing["jaxfuse_fp8"]["calls"] == timing["xla_bf16"]["calls"] == 2
  row = bench._fp8_row({}, timing, common.GpuMonitor(), flops=1.0)  # pylint: disable=protected-access
  assert row["xla_bf16_device_ms"] == 3.0 and row["jaxfuse_fp8_device_ms"] == 2.0
  assert row["device_speedup"] == pytest.approx(1.5)
  # Without device_calls the rows keep the host clock alone.
  timing = bench.time_pair(steps, x, kernel, d_out, backward=True, rounds=1, chunk=1)
  assert timed_calls == [3, 3] and "device_span_ms" not in timing["xla_bf16"]


def test_gated_fc1_bench_checks_then_times_three_variants(monkeypatch):
  """bench_gated_fc1 on CPU (the gated op's CPU branch is the two kernels): the bit-for-bit
  check passes, and each variant gets a time and the derived ratios."""
  from benchmarks import bench_gated_fc1  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(common, "warm_up_device", lambda *args, **kwargs: None)
  row = bench_gated_fc1.run_case("tiny", 256, 64, 128, rounds=2)
  assert row["max_act_diff"] == 0.0 and row["h_rel_diff"] <= 2e-2
  for impl in ("gated", "two_kernels", "fc1_alone"):
    assert row[f"{impl}_ms"] > 0.0
  assert row["gated_vs_two_kernels"] == pytest.approx(row["two_kernels_ms"] / row["gated_ms"])
  assert row["paired_gated_vs_two_kernels"] > 0.0
  assert row["epilogue_cost_ms"] == pytest.approx(row["gated_ms"] - row["fc1_alone_ms"])
