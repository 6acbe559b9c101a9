"""Developer tools that run without a GPU: scripts/kernel_registers.py's reading of ptxas's
report, scripts/ncu_metrics_table.py's reading of Nsight Compute's raw CSV, and bench_moe's
retry of a reference that XLA's autotuner cannot compile."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from benchmarks import bench_moe

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_script(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# The shape of `nvcc -Xptxas -v` output for sm_90a (nvcc 13.0): two kernels, one spilling,
# and a device function between them that has no entry of its own.
PTXAS = """\
ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function '_ZN7jaxfuse3gpu9RowKernelIfEEvT_' for 'sm_90a'
ptxas info    : Function properties for _ZN7jaxfuse3gpu9RowKernelIfEEvT_
    24 bytes stack frame, 28 bytes spill stores, 28 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 24 bytes cumulative stack size, 1920 bytes smem
ptxas info    : Function properties for _ZN7jaxfuse3gpu6helperEv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function '_ZN7jaxfuse3gpu10AmaxKernelIfEEvT_' for 'sm_90a'
ptxas info    : Function properties for _ZN7jaxfuse3gpu10AmaxKernelIfEEvT_
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers
"""


def test_kernel_registers_reads_each_entry_function():
  tool = load_script("kernel_registers")
  rows = tool.report(PTXAS, "")
  assert [row[1:] for row in rows] == [(64, 28, 1920), (40, 0, 0)]
  assert "RowKernel" in rows[0][0] and "AmaxKernel" in rows[1][0]
  assert [row[1] for row in tool.report(PTXAS, "Amax")] == [40]


def _ncu_raw_csv(path, launches):
  """An `ncu --csv --page raw` file as ncu_check_kernels.sh --metrics writes it: the
  check's own output first, then a header row, a units row and one row per launch."""
  metrics = ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
             "lts__t_sector_hit_rate.pct",
             "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed"]
  lines = ["PERF fwd small  fwd   G=64 ...", '"ID","Kernel Name","Grid Size",' +
           ",".join(f'"{m}"' for m in metrics), '"","","",' + ",".join('"x"' for _ in metrics)]
  for i, (name, values) in enumerate(launches):
    lines.append(f'"{i}","{name}","132",' + ",".join(f'"{v:,}"' for v in values))
  path.write_text("\n".join(lines) + "\n")


def test_ncu_metrics_table_takes_the_median_launch_of_each_run(tmp_path, capsys):
  tool = load_script("ncu_metrics_table")
  grouped_ping = ("void cutlass::device_kernel<GemmUniversal<cutlass::gemm::GroupProblemShape<"
                  "int>, KernelPtrArrayTmaWarpSpecializedPingpong>>(T1::Params)")
  grouped_coop = ("void cutlass::device_kernel<GemmUniversal<cutlass::gemm::GroupProblemShape<"
                  "int>, PreparedTensormapMainloop<KernelPtrArrayTmaWarpSpecializedCooperative>>"
                  ">(T1::Params)")
  batched_ping = ("void cutlass::device_kernel<GemmUniversal<cute::tuple<int, int, int, int>, "
                  "KernelTmaWarpSpecializedPingpong>>(T1::Params)")
  # Durations in ns, bytes, percent; the middle launch of each run is the median.
  _ncu_raw_csv(tmp_path / "m.csv", [
      (grouped_ping, (1_300_000, 3.0e9, 2.7e8, 50.0, 45.0)),
      (grouped_ping, (1_200_000, 2.9e9, 2.7e8, 54.0, 48.0)),
      (grouped_ping, (1_250_000, 2.8e9, 2.7e8, 52.0, 47.0)),
      (grouped_coop, (800_000, 1.5e9, 2.6e8, 57.0, 80.0)),
      (batched_ping, (716_000, 1.22e9, 2.6e8, 68.0, 95.0)),
      (grouped_ping, (1_100_000, 2.1e9, 2.7e8, 63.0, 60.0))])
  kinds = [launch[0] for launch in tool.launches(str(tmp_path / "m.csv"))]
  assert kinds == ["grouped ping"] * 3 + ["grouped coop prep", "batched ping", "grouped ping"]
  tool.main(["ncu_metrics_table.py", str(tmp_path / "m.csv")])
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 4  # a later run of the same kind is a run of its own
  assert lines[0].startswith("grouped ping") and "launches   3" in lines[0]
  assert "1250.0 us" in lines[0] and "2.800 GB" in lines[0] and "52.0%" in lines[0]
  assert lines[2].startswith("batched ping") and "716.0 us" in lines[2]
  assert "1100.0 us" in lines[3]


class _Compiled:
  def __init__(self, log, options):
    self.log, self.options = log, options

  def __call__(self, *args):
    self.log.append(("compiled", self.options))
    return 0.0


class _Step:
  """A jitted step's stand-in whose autotuned compile fails with `message`."""

  def __init__(self, message):
    self.message, self.log = message, []

  def __call__(self, *args):
    raise RuntimeError(self.message)

  def lower(self, *args):
    step = self

    class Lowered:
      def compile(self, compiler_options=None):
        return _Compiled(step.log, compiler_options)

    return Lowered()


def test_reference_retried_without_the_autotuner_only_when_it_found_no_config():
  step = _Step("NOT_FOUND: Failed to get configs for: 2 out of 33 instructions.")
  ms, note = bench_moe.time_reference(step, (), 4, "fwd+bwd")
  assert ms is not None and ms >= 0.0 and "autotune_level=0" in note
  assert step.log and all(entry == ("compiled", bench_moe.NO_AUTOTUNE) for entry in step.log)

  out_of_memory = _Step("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 148.60GiB")
  ms, note = bench_moe.time_reference(out_of_memory, (), 4, "fwd+bwd")
  assert ms is None and "Out of memory" in note and not out_of_memory.log


def test_reference_that_compiles_is_timed_as_is():
  calls = []
  ms, note = bench_moe.time_reference(lambda: calls.append(1), (), 4, "fwd")
  assert note == "autotuned" and ms is not None and len(calls) == 4


if __name__ == "__main__":
  raise SystemExit(pytest.main([__file__]))
