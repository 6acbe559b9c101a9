"""Helpers shared by the tests: random inputs, float64 references, tolerances."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Relative error budgets by compute dtype. Results are rounded once to the output dtype
# (bf16: 8 mantissa bits, 2^-8 ~ 4e-3 per rounding of inputs and output; f16: 2^-11);
# fp32 accumulations of a few hundred terms stay near 1e-6.
RTOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2,
        jnp.dtype(jnp.float16): 4e-3}


def rtol(dtype) -> float:
  return RTOL[jnp.dtype(dtype)]


def random_array(rng: np.random.Generator, shape, dtype, scale: float = 1.0) -> jax.Array:
  """Fresh normal random values, rounded to `dtype` (never zeros or ones)."""
  return jnp.asarray(rng.standard_normal(shape) * scale, dtype=dtype)


def as_f64(value) -> np.ndarray:
  return np.asarray(jnp.asarray(value, jnp.float32), dtype=np.float64)


def assert_close(actual, expected, dtype, *, scale=None, msg: str = "") -> None:
  """|actual - expected| <= rtol(dtype) * scale elementwise, scale = max|expected| by default.

  Comparing against the tensor's magnitude rather than each element's avoids false
  failures from cancellation in elements near zero; NaN never passes.
  """
  actual = as_f64(actual)
  expected = np.asarray(expected, dtype=np.float64)
  assert actual.shape == expected.shape, f"{msg} shape {actual.shape} != {expected.shape}"
  assert not np.isnan(actual).any(), f"{msg} NaN in result"
  if scale is None:
    scale = max(np.abs(expected).max(initial=0.0), 1e-30)
  error = np.abs(actual - expected).max(initial=0.0) / scale
  assert error <= rtol(dtype), f"{msg} relative error {error:.3g} > {rtol(dtype):.3g} ({dtype})"


def equations(jaxpr):
  """Every equation of a (closed) jaxpr, those of its sub-jaxprs (scan and cond bodies,
  custom rules) included, depth first."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
          yield from equations(sub)


def count_primitives(jaxpr, predicate) -> int:
  """Equations of a (closed) jaxpr, sub-jaxprs included, for which predicate(eqn) holds."""
  return sum(1 for eqn in equations(jaxpr) if predicate(eqn))


def ffi_target(name: str):
  """Predicate for count_primitives: an ffi_call of the given target."""
  return lambda eqn: eqn.primitive.name == "ffi_call" and eqn.params.get("target_name") == name


def untransposed_copy_sizes(jaxpr) -> list[int]:
  """Sizes of the untransposed FP8 weight copies the weight quantization calls write (0 when
  a call skips it)."""
  sizes = []

  def walk(jaxpr):
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
      if (ffi_target("jaxfuse_quantize_transposed")(eqn)
          or ffi_target("jaxfuse_quantize_batches_transposed")(eqn)):
        sizes.append(eqn.outvars[2].aval.size)
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
            walk(sub)

  walk(jaxpr)
  return sizes


def on_cpu(fn, *args):
  """jit(fn)(*args) evaluated on the CPU, where XLA's arithmetic is IEEE-exact.

  References that quantize must run here: XLA's GPU lowering may round fp8_max / amax
  differently in the last bit, which moves a scale by an ulp and some FP8 values by one
  step, far more than the bf16 tolerance of an exact comparison.
  """
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    return jax.jit(fn)(*[jax.device_put(a, cpu) for a in args])


# XLA flags of the two runs of plain_and_graph_runs: without command buffers, and with CUDA
# graphs for fusions and custom calls from the first instruction on.
_COMMAND_BUFFER_FLAGS = (("plain", "--xla_gpu_enable_command_buffer="),
                         ("graphs", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                                    "--xla_gpu_graph_min_graph_size=1"))


def outputs_under_environments(script: str, tmp_path, environments) -> dict:
  """Runs the Python source `script` (it saves one array to the .npy path in sys.argv[1])
  in one fresh process per entry of `environments` (name -> variables set on top of
  os.environ, a value of None removing one: settings read once per process need a process
  each) and returns the saved arrays by name."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  outputs = {}
  for name, variables in environments.items():
    path = tmp_path / f"{name}.npy"
    subprocess.run([sys.executable, "-c", script, str(path)],
                   env={key: value for key, value in {**os.environ, **variables}.items()
                        if value is not None},
                   check=True, timeout=300)
    outputs[name] = np.load(path)
  return outputs


def plain_and_graph_runs(script: str, tmp_path) -> np.ndarray:
  """Runs `script` as outputs_under_environments does, without and with XLA's CUDA graphs,
  checks that both saved the same array and returns it: a replayed graph must follow what
  changed on the device."""
  outputs = outputs_under_environments(
      script, tmp_path, {name: {"XLA_FLAGS": flags} for name, flags in _COMMAND_BUFFER_FLAGS})
  np.testing.assert_array_equal(outputs["plain"], outputs["graphs"])
  return outputs["graphs"]


def run_host_driver(source: str, tmp_path, name: str):
  """Compiles the C++ `source` (which may include cuda/include headers) with the system's
  C++ compiler, runs it and returns the finished process (returncode, stdout); skips the
  test without a compiler."""
  import pathlib  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top
  compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
  if compiler is None:
    pytest.skip("no C++ compiler on this machine")
  include = pathlib.Path(__file__).resolve().parents[1] / "cuda" / "include"
  driver = tmp_path / f"{name}.cc"
  driver.write_text(source)
  binary = tmp_path / name
  subprocess.run([compiler, "-std=c++17", "-O2", f"-I{include}", str(driver), "-o", str(binary)],
                 check=True, capture_output=True, text=True)
  return subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
