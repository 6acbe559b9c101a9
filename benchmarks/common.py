"""Timing and result-writing helpers shared by the benchmark scripts.

Times are medians of many calls after warm-up, each call synchronised with
``jax.block_until_ready`` (the METHOD: device work is asynchronous). Inputs are rotated
across calls where one set would sit in the 50 MB L2, and donated buffers are fresh per
call. Results land in ``benchmarks/results/<name>_<date>_<commit>.json`` with the commit,
date, device and software versions, so every figure is traceable to the code that made it.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


# Calls dispatched back to back per timed chunk: one host sync per chunk instead of per
# call, so the ~20-60 us of dispatch and block_until_ready of a jitted call overlap the
# device work of the previous call, as in a training loop (and as the torch baselines,
# timed with CUDA events, see it). A host-bound step still shows its host time.
CHUNK = 5
TIMING = (f"JAX: wall time of chunks of {CHUNK} calls dispatched back to back, one sync per "
          "chunk, median over chunks of chunk time / calls; torch: CUDA events per call, median")


def time_fn(fn: Callable, args_per_call: Sequence[tuple], *, warmup: int = 3) -> dict:
  """Median/min time in ms per call of ``fn(*args)``, cycling through ``args_per_call``.

  Each argument tuple is used once, in order (pass several tuples to rotate inputs, or
  fresh donated buffers: a donated tuple cannot be reused, so give one per call). The
  first ``warmup`` calls compile and warm up; the rest are timed in chunks of ``CHUNK``
  calls dispatched without waiting (see ``TIMING``).
  """
  calls = list(args_per_call)
  for args in calls[:warmup]:
    jax.block_until_ready(fn(*args))
  timed = calls[warmup:]
  times = []
  for start_index in range(0, len(timed), CHUNK):
    chunk = timed[start_index:start_index + CHUNK]
    start = time.perf_counter()
    outputs = [fn(*args) for args in chunk]
    jax.block_until_ready(outputs)
    times.append((time.perf_counter() - start) * 1e3 / len(chunk))
    del outputs
  return {"median_ms": statistics.median(times), "min_ms": min(times), "calls": len(timed)}


def calls_per_sync(estimated_ms: float, *, target_ms: float = 10.0,
                   most: int = 100) -> int:
  """Calls per timed chunk for a step of about ``estimated_ms``: ~``target_ms`` of device
  time, at least CHUNK and at most ``most``.

  A chunk's time includes one sync's latency (for a jitted step on the H200 about 0.05 ms
  for one custom call, ~0.3 ms for a grouped MLP step); over CHUNK calls of a 0.1-0.2 ms
  step that is 10-60% of what is measured, a cost a training loop, which does not sync
  every few steps, never pays."""
  return int(min(most, max(CHUNK, math.ceil(target_ms / max(estimated_ms, 1e-6)))))


def time_alternating(variants: dict[str, tuple], *, rounds: int = 12,
                     warmup: int = 3, chunk: int = CHUNK) -> dict[str, dict]:
  """Times several variants in alternating chunks (A B, B A, A B, ...), ms per call each.

  Back-to-back sweeps of one variant after another let clock and thermal drift of the
  GPU (seen at +-10% between runs of one cuBLAS kernel on the H200) land on one variant
  only; alternating chunks spreads it over all of them alike. Each variant is
  ``(fn, args, advance)`` or ``(fn, args, advance, wait)``: every call runs ``fn(*args)``
  and then ``args = advance(args, outputs)``, which lets a donated buffer be replaced by
  the output that took its place (a residual stream updated in place, as in training)
  instead of keeping one fresh buffer per call in memory (``keep_args`` leaves them as
  they are). A chunk ends with ``wait(last outputs)``: ``jax.block_until_ready`` unless
  given (a torch baseline passes ``lambda _: torch.cuda.synchronize()``, so that both
  frameworks are timed the same way, by the host clock around whole chunks).

  Returns, per variant, ``median_ms``/``min_ms`` over its chunks (each chunk: ``chunk``
  calls dispatched back to back, one sync), and ``paired_speedup_vs_<first variant>``:
  the median over rounds of (first variant's chunk time / this one's). A chunk's time
  includes the latency of its first call once (for a jitted JAX call on the H200 about
  0.1-0.4 ms, against ~0.05 ms for torch); a longer ``chunk`` amortizes it when the
  device time per call is what is compared.
  """
  state = {name: variant[1] for name, variant in variants.items()}

  def run_chunk(name, calls):
    fn, _, advance, *rest = variants[name]
    wait = rest[0] if rest else jax.block_until_ready
    args = state[name]
    start = time.perf_counter()
    for _ in range(calls):
      outputs = fn(*args)
      args = advance(args, outputs)
    wait(outputs)
    state[name] = args
    return (time.perf_counter() - start) * 1e3 / calls

  names = list(variants)
  for name in names:
    for _ in range(warmup):
      run_chunk(name, 1)
  times = {name: [] for name in names}
  for round_index in range(rounds):
    for name in (names if round_index % 2 == 0 else names[::-1]):
      times[name].append(run_chunk(name, chunk))
  first = names[0]
  return {name: {"median_ms": statistics.median(times[name]), "min_ms": min(times[name]),
                 "calls": rounds * chunk,
                 "paired_speedup_vs_" + first: statistics.median(
                     a / b for a, b in zip(times[first], times[name]))}
          for name in names}


def kernel_times_alternating(variants: dict[str, tuple], owner: Callable[[str], str | None],
                             *, rounds: int, chunk: int, warmup: int = 1,
                             kernel_names: dict[str, list[str]] | None = None
                             ) -> dict[str, float]:
  """Device time per call (ms) of each variant's kernels while the variants run exactly as
  ``time_alternating`` runs them (alternating chunks, so under the same sustained load and
  clocks), read from CUPTI's activity records through torch.profiler, which sees the
  kernels of every framework in the process. ``owner(kernel_name)`` names the variant a
  kernel belongs to (None: ignored). {} without torch or a CUDA device.

  The host clock also holds launch gaps and first-call latency; this holds only the time
  the GPU spent in each variant's kernels. ``kernel_names``, if given, receives each
  variant's kernel names, longest total time first."""
  try:
    import torch  # pylint: disable=g-import-not-at-top  (torch is optional)
    from torch.profiler import ProfilerActivity, profile  # pylint: disable=g-import-not-at-top
  except ImportError:
    return {}
  if not torch.cuda.is_available():
    return {}
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    time_alternating(variants, rounds=rounds, warmup=warmup, chunk=chunk)
    torch.cuda.synchronize()
  totals = {name: 0.0 for name in variants}
  per_kernel: dict[str, dict[str, float]] = {name: {} for name in variants}
  for event in prof.events():
    if event.device_type != torch.autograd.DeviceType.CUDA:
      continue
    name = owner(event.name)
    if name in totals:
      totals[name] += event.time_range.elapsed_us()
      per_kernel[name][event.name] = (per_kernel[name].get(event.name, 0.0)
                                      + event.time_range.elapsed_us())
  if kernel_names is not None:
    for name, kernels in per_kernel.items():
      kernel_names[name] = sorted(kernels, key=lambda kernel: -kernels[kernel])
  calls = warmup + rounds * chunk
  return {name: total / calls / 1e3 for name, total in totals.items()}


def summarize_kernel_events(events: Sequence[tuple[float, float]], calls: int) -> dict:
  """Device time per call from (start_us, end_us) kernel intervals of ``calls`` calls run
  back to back: ``kernel_ms`` sums the kernels (overlaps counted once), ``span_ms`` spans
  the first start to the last end (idle gaps between kernels included). {} without
  events."""
  if not events or calls <= 0:
    return {}
  ordered = sorted(events)
  busy, (current_start, current_end) = 0.0, ordered[0]
  for start, end in ordered[1:]:
    if start > current_end:
      busy += current_end - current_start
      current_start, current_end = start, end
    else:
      current_end = max(current_end, end)
  busy += current_end - current_start
  span = max(end for _, end in ordered) - ordered[0][0]
  return {"kernel_ms": busy / calls / 1e3, "span_ms": span / calls / 1e3}


def device_time_per_call(variant: tuple, calls: int) -> dict:
  """Device time per call of one ``time_alternating`` variant, its calls dispatched back
  to back with one sync at the end, from CUPTI's activity records through torch.profiler
  (every kernel of the process, XLA's and jaxfuse's alike): summarize_kernel_events.
  {} without torch or a CUDA device.

  Host timing of a call that moves a few MB measures the dispatch of a jitted call
  (~40 us on the H200), not the kernels; this measures the kernels."""
  try:
    import torch  # pylint: disable=g-import-not-at-top  (torch is optional)
    from torch.profiler import ProfilerActivity, profile  # pylint: disable=g-import-not-at-top
  except ImportError:
    return {}
  if not torch.cuda.is_available():
    return {}
  fn, args, advance, *rest = variant
  wait = rest[0] if rest else jax.block_until_ready
  outputs = fn(*args)  # warm: compiled, buffers allocated
  wait(outputs)
  args = advance(args, outputs)
  try:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
      for _ in range(calls):
        outputs = fn(*args)
        args = advance(args, outputs)
      wait(outputs)
      torch.cuda.synchronize()
  except RuntimeError as error:  # a profiler that cannot attach: the host times still stand
    print(f"device_time_per_call: no device time ({type(error).__name__}: {error})",
          flush=True)
    return {}
  events = [(event.time_range.start, event.time_range.end) for event in prof.events()
            if event.device_type == torch.autograd.DeviceType.CUDA]
  return summarize_kernel_events(events, calls)


def keep_args(args, outputs):
  """``advance`` for time_alternating when the arguments are reused unchanged."""
  del outputs
  return args


def masters(cotangents):
  """`cotangents` with every QuantizedArray replaced by its master's gradient (None for a
  frozen copy): what a training step keeps. Returned whole from a jitted step, a copy's
  cotangent would also materialize zeros for its FP8 leaves (at Mixtral-like experts
  ~2.8 GB written per step) that XLA drops when only the master's gradient is used."""
  from jaxfuse.quantization import QuantizedArray  # pylint: disable=g-import-not-at-top
  return jax.tree.map(lambda c: c.master if isinstance(c, QuantizedArray) else c, cotangents,
                      is_leaf=lambda c: isinstance(c, QuantizedArray))


def rotating(fn: Callable, args_list: Sequence[tuple]) -> tuple:
  """A time_alternating variant calling ``fn`` on each tuple of ``args_list`` in turn
  (inputs rotated so that one set does not sit in the L2 cache)."""
  counter = itertools.count(1)
  return fn, args_list[0], lambda args, outputs: args_list[next(counter) % len(args_list)]


def torch_call_times_ms(fn: Callable, calls: int, *, warmup: int = 3) -> list[float]:
  """Times in ms of ``calls`` calls of a torch callable on the GPU, after ``warmup`` calls:
  CUDA events around each call."""
  import torch  # pylint: disable=g-import-not-at-top  (torch is optional: baselines only)
  for _ in range(warmup):
    fn()
  torch.cuda.synchronize()
  times = []
  for _ in range(calls):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end))
  return times


def time_torch_ms(fn: Callable, calls: int, *, warmup: int = 3) -> float:
  """Median time in ms of a torch callable on the GPU, measured with CUDA events."""
  return statistics.median(torch_call_times_ms(fn, calls, warmup=warmup))


# nvidia-smi's clock event reason bits (clocks_event_reasons.active) that slow the clocks
# down: what a benchmark's figures were measured under.
_SLOWDOWN_BITS = {"power_cap": 0x4, "hw_slowdown": 0x8 | 0x100,
                  "thermal": 0x20 | 0x40 | 0x80}
_SMI_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")


def summarize_gpu_samples(lines: Sequence[str]) -> dict[str, Any]:
  """Summary of ``nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,
  clocks_event_reasons.active --format=csv,noheader,nounits`` lines (the reasons column may
  be missing): sample count, SM clock min/median (MHz), power median/max (W), peak
  temperature (C), and the fraction of samples under each slowdown reason."""
  clocks, powers, temperatures, reasons = [], [], [], []
  for line in lines:
    fields = [field.strip() for field in line.split(",")]
    try:
      clock, power, temperature = float(fields[0]), float(fields[1]), float(fields[2])
    except (IndexError, ValueError):
      continue  # a header, "[N/A]" or a partial line
    clocks.append(clock)
    powers.append(power)
    temperatures.append(temperature)
    if len(fields) > 3:
      try:
        reasons.append(int(fields[3], 16))
      except ValueError:
        pass
  if not clocks:
    return {}
  summary = {"samples": len(clocks), "sm_clock_mhz_min": min(clocks),
             "sm_clock_mhz_median": statistics.median(clocks),
             "power_w_median": statistics.median(powers), "power_w_max": max(powers),
             "temperature_c_max": max(temperatures)}
  for name, bits in _SLOWDOWN_BITS.items():
    if reasons:
      summary[f"{name}_fraction"] = sum(1 for r in reasons if r & bits) / len(reasons)
  return summary


class GpuMonitor:
  """Samples GPU ``index``'s SM clock, power, temperature and clock slowdown reasons with
  nvidia-smi while the ``with`` block runs; ``summary`` (summarize_gpu_samples) is set on
  exit, {} without nvidia-smi.

  Sustained GEMM benchmarks on the H200 run at its 700 W power cap with the clocks below
  their 1980 MHz boost (session 16, `results/logs/clocks_*`): a figure means little
  without the clocks it was measured at."""

  def __init__(self, interval_ms: int = 200, index: int = 0):
    self.interval_ms, self.index = interval_ms, index
    self.summary: dict[str, Any] = {}
    self._process = None

  def _command(self, fields) -> list[str]:
    return ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
            "-i", str(self.index)]

  def __enter__(self):
    return self.start()

  def __exit__(self, *exc_info):
    self.stop()
    return False

  def start(self) -> "GpuMonitor":
    """Starts sampling (what ``with`` does on entry); returns self."""
    if shutil.which("nvidia-smi") is None:
      return self
    fields = _SMI_FIELDS
    probe = subprocess.run(self._command(fields), capture_output=True, text=True)
    if probe.returncode != 0:  # an older driver without clocks_event_reasons
      fields = _SMI_FIELDS[:3]
    self._process = subprocess.Popen(self._command(fields) + ["-lms", str(self.interval_ms)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
    return self

  def stop(self) -> dict[str, Any]:
    """Stops sampling (what ``with`` does on exit); returns and keeps ``summary``."""
    if self._process is not None:
      self._process.terminate()
      output, _ = self._process.communicate(timeout=10)
      self._process = None
      self.summary = summarize_gpu_samples(output.splitlines())
    return self.summary


_WARMED_UP = False


def warm_up_device(fn, *args, seconds: float = 1.5) -> None:
  """Keeps the device busy with ``fn(*args)`` for ``seconds``, once per process.

  The first benchmark of a fresh GPU process ran 5-10% slower than the same configuration
  later in the process (session 15 runs): clocks and caches settle under sustained load.
  Every script measures the copy bandwidth first, so that is where the warm-up goes.
  """
  global _WARMED_UP
  if _WARMED_UP:
    return
  _WARMED_UP = True
  jax.block_until_ready(fn(*args))
  deadline = time.perf_counter() + seconds
  while time.perf_counter() < deadline:
    jax.block_until_ready([fn(*args) for _ in range(10)])


def copy_bandwidth_tbps(num_bytes: int | None = None, iters: int = 20) -> float:
  """Device copy bandwidth (bytes read + written per second) through XLA, in TB/s, of a
  4 GiB float32 array on a GPU (64 MiB elsewhere: smoke runs of the scripts on the CPU)."""
  if num_bytes is None:
    num_bytes = 4 << 30 if jax.devices()[0].platform == "gpu" else 64 << 20
  n = num_bytes // 4
  source = jnp.arange(n, dtype=jnp.float32)
  copy = jax.jit(lambda x: x * 1.0 + 0.0)  # not folded away: a real read and write
  warm_up_device(copy, source)
  stats = time_fn(copy, [(source,)] * (iters + 3))
  return 2 * n * 4 / (stats["median_ms"] * 1e-3) / 1e12


def git_commit() -> str:
  """HEAD's commit; on the GPU machine (no git history) JAXFUSE_COMMIT, or the commit that
  scripts/prepare_gpu_run.sh packed (.gpu_src/COMMIT, which gpu_run.sh copies along)."""
  try:
    return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                   cwd=pathlib.Path(__file__).parent,
                                   stderr=subprocess.DEVNULL).strip()
  except (OSError, subprocess.CalledProcessError):
    if "JAXFUSE_COMMIT" in os.environ:
      return os.environ["JAXFUSE_COMMIT"]
    packed = pathlib.Path(__file__).resolve().parent.parent / ".gpu_src" / "COMMIT"
    return packed.read_text().strip() if packed.is_file() else "unknown"


def environment() -> dict[str, Any]:
  import jaxfuse
  device = jax.devices()[0]
  return {
      "commit": git_commit(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "device": device.device_kind,
      "platform": device.platform,
      "jax": jax.__version__,
      "timing": TIMING,
      "jaxfuse_build": {k: v for k, v in jaxfuse.build_info().items()},
      # Tuning knobs set for this run (JAXFUSE_GROUPED_GEMM_RASTER, ..._THREADS_PER_ROW, ...):
      # unset ones ran the library's defaults.
      "jaxfuse_environment": {k: v for k, v in sorted(os.environ.items())
                              if k.startswith("JAXFUSE_") and k != "JAXFUSE_COMMIT"},
  }


def write_results(name: str, rows: list[dict], tag: str = "", **extra) -> pathlib.Path:
  """Writes results/<name>[_<tag>]_<date>_<commit>.json (a tag keeps sweep runs apart)."""
  env = environment()
  if "method" in extra:  # the benchmark's own timing method replaces the generic description
    env["timing"] = extra["method"]
  RESULTS_DIR.mkdir(parents=True, exist_ok=True)
  day = env["date"][:10]
  path = RESULTS_DIR / f"{name}{'_' + tag if tag else ''}_{day}_{env['commit'][:8]}.json"
  path.write_text(json.dumps({**env, **extra, "rows": rows}, indent=1, default=str) + "\n")
  print(f"wrote {path}")
  return path


def print_table(rows: list[dict], columns: Sequence[str]) -> None:
  widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
  print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
  for row in rows:
    print("  ".join(_fmt(row.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(value) -> str:
  if isinstance(value, float):
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
  return str(value)
