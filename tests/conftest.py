"""Test configuration shared by every test file.

CPU tests use 8 host devices (for shard_map); the flag must be set before jax starts.
Tests marked ``gpu`` need an NVIDIA GPU and jaxfuse's CUDA part; without them they are
skipped with the reason, and ``pytest -m gpu`` runs only them.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
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
