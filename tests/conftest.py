"""Test configuration shared by every test file.

CPU tests use 8 host devices (for shard_map); the flag must be set before jax starts, as
must the CPU-only compile settings below.
Tests marked ``gpu`` need an NVIDIA GPU and jaxfuse's CUDA part; without them they are
skipped with the reason, and ``pytest -m gpu`` runs only them.
"""

import importlib.util
import os
import shutil
import tempfile


def _cpu_only() -> bool:
  """Whether jax can only run on the CPU here: JAX_PLATFORMS=cpu, or no GPU plugin installed
  (checked without importing jax, whose flags must be set first)."""
  if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
    return True
  return all(importlib.util.find_spec(name) is None
             for name in ("jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin"))


# The CPU suite's time is mostly XLA compiling small programs, not running them. Where no
# GPU can run, LLVM compiles them at -O0 and the test processes (pytest-xdist's workers
# inherit the environment) share a compilation cache for this run: 658 s -> 413 s for the
# suite on 2 cores (session 57), every test passing both ways. GPU runs keep XLA's defaults.
_CPU_ONLY_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_CPU_ONLY = _cpu_only()
_OWN_CACHE = None  # the compilation cache this process made (removed at the end)
if "XLA_FLAGS" not in os.environ:
  os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8"
                             + (" " + _CPU_ONLY_XLA_FLAGS if _CPU_ONLY else ""))
if _CPU_ONLY and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _OWN_CACHE = tempfile.mkdtemp(prefix="jaxfuse-test-jax-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Tests choose implementations explicitly; a stray setting must not change them.
os.environ.pop("JAXFUSE_IMPLEMENTATION", None)

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxfuse._src import compat  # noqa: E402
from jaxfuse._src import ffi  # noqa: E402


def _gpu_unavailable_reason():
  if not compat.has_cuda_backend():
    return "no CUDA device visible to jax"
  if not ffi.cuda_built():
    return "jaxfuse was built without its CUDA part"
  return None


def pytest_collection_modifyitems(config, items):
  reason = _gpu_unavailable_reason()
  if reason is None:
    return
  skip = pytest.mark.skip(reason=reason)
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def gpu_device():
  return jax.devices("gpu")[0]


@pytest.fixture
def cpu_device():
  return jax.devices("cpu")[0]


def pytest_unconfigure(config):
  # The process that made the cache removes it (pytest-xdist's workers inherited its path).
  if _OWN_CACHE is not None and not hasattr(config, "workerinput"):
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
