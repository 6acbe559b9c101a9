"""Loads jaxfuse's extension and registers its FFI handlers with XLA, lazily.

Registration happens the first time an op is traced with ``implementation="ffi"``:
after jax's backends exist (registering stateful handlers' types before the CPU backend
starts can break its start-up), types first, then targets, for every platform the
extension was built for and jax can run. It is idempotent.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import threading
from typing import Any

import jax

from jaxfuse._src import compat

try:
  from jaxfuse import _jaxfuse as _extension  # the compiled pybind11 module
  _IMPORT_ERROR: Exception | None = None
except ImportError as error:  # e.g. running from a source tree that was never built
  _extension = None
  _IMPORT_ERROR = error

_lock = threading.Lock()
_registered = False


def extension_available() -> bool:
  return _extension is not None


def require_extension() -> Any:
  if _extension is None:
    raise RuntimeError(
        "jaxfuse's compiled extension is not available, so implementation='ffi' cannot "
        "run. Install jaxfuse with pip (pip install -e .) or use implementation='xla'. "
        f"Import error: {_IMPORT_ERROR}")
  return _extension


def built_platforms() -> tuple[str, ...]:
  """Platforms the extension has handlers for ("cpu", and "CUDA" when built)."""
  if _extension is None:
    return ()
  return tuple(_extension.build_info()["platforms"])


def cuda_built() -> bool:
  return "CUDA" in built_platforms()


def _preload_cublaslt() -> None:
  """Makes libcublasLt.so.13 from the nvidia-cublas wheel loadable by soname.

  The CUDA handlers open cuBLASLt with dlopen by soname; the wheel's directory is not on
  the loader's search path, so load it here by full path first (jax's CUDA plugin does
  the same for its own libraries). Harmless when the system has it instead.
  """
  spec = importlib.util.find_spec("nvidia")
  if spec is None or not spec.submodule_search_locations:
    return
  for root in spec.submodule_search_locations:
    for subdir in ("cu13/lib", "cublas/lib"):
      path = os.path.join(root, subdir, "libcublasLt.so.13")
      if os.path.exists(path):
        try:
          ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
          return
        except OSError:
          continue


def _version_prefix(version: str) -> tuple[int, int]:
  major, minor = version.split(".")[:2]
  return int(major), int(minor)


def check_runtime_jaxlib() -> None:
  """Refuses a jaxlib older than the one whose FFI headers the handlers were built with.

  Each jaxlib minor release may speak a newer XLA FFI API (0.10: 0.3, 0.11: 0.4); an older
  runtime rejects the handlers with an error far from the cause.
  """
  import jaxlib
  built = build_info()["jaxlib_version"]
  running = jaxlib.__version__
  if _version_prefix(running) < _version_prefix(built):
    raise RuntimeError(
        f"jaxfuse's handlers were built against jaxlib {built}'s XLA FFI headers, but this "
        f"process runs jaxlib {running}, which speaks an older FFI API. Rebuild against the "
        "installed jaxlib: pip install --no-build-isolation --force-reinstall --no-deps "
        "<path to jaxfuse>")


def _register_platform(platform: str) -> None:
  extension = require_extension()
  for name, registration in extension.types().get(platform, {}).items():
    jax.ffi.register_ffi_type(name, registration, platform=platform)
  for name, handler in extension.handlers()[platform].items():
    jax.ffi.register_ffi_target(name, handler, platform=platform)


def ensure_registered() -> None:
  """Registers every handler for the platforms that are both built and present."""
  global _registered
  if _registered:
    return
  with _lock:
    if _registered:
      return
    check_runtime_jaxlib()
    jax.devices()  # start the backends before registering anything
    _register_platform("cpu")
    if cuda_built() and compat.has_cuda_backend():
      _preload_cublaslt()
      _register_platform("CUDA")
    _registered = True


@functools.cache
def build_info() -> dict[str, Any]:
  """What the extension was built with; see ``jaxfuse.build_info``."""
  if _extension is None:
    return {"available": False, "platforms": [], "error": str(_IMPORT_ERROR)}
  info = dict(_extension.build_info())
  info["available"] = True
  info["platforms"] = list(info["platforms"])
  info["ffi_api_version"] = tuple(info["ffi_api_version"])
  return info


def loaded_cublaslt_version() -> int:
  """Version of the cuBLASLt library the CUDA handlers opened (0 if none)."""
  if not cuda_built():
    return 0
  _preload_cublaslt()
  return int(require_extension().loaded_cublaslt_version())


def all_targets() -> tuple[str, ...]:
  """Names of every FFI target the extension registers, on any platform (sorted)."""
  if _extension is None:
    return ()
  return tuple(sorted({name for handlers in _extension.handlers().values()
                       for name in handlers}))


def export_disabled_checks() -> list:
  """jax.export.DisabledSafetyCheck for each target (jaxfuse.EXPORT_DISABLED_CHECKS)."""
  return [jax.export.DisabledSafetyCheck.custom_call(name) for name in all_targets()]
