"""Developer tools that run without a GPU: scripts/kernel_registers.py's reading of ptxas's
report, and bench_moe's retry of a reference that XLA's autotuner cannot compile."""

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
