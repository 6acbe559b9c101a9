"""Choosing between the FFI custom calls and the pure-jnp reference."""

from __future__ import annotations

import os

from jaxfuse._src import compat
from jaxfuse._src import ffi

IMPLEMENTATIONS = ("ffi", "xla")
ENVIRONMENT_VARIABLE = "JAXFUSE_IMPLEMENTATION"


def resolve(implementation: str | None) -> str:
  """Returns "ffi" or "xla".

  An explicit argument wins; then the ``JAXFUSE_IMPLEMENTATION`` environment variable;
  then "ffi" when the default backend is a GPU and the CUDA handlers were built, else
  "xla" (the reference).

  Raises:
    ValueError: for any other value, or "ffi" when the extension was not built.
  """
  source = "implementation"
  if implementation is None:
    implementation = os.environ.get(ENVIRONMENT_VARIABLE) or None
    source = ENVIRONMENT_VARIABLE
  if implementation is None:
    on_gpu = compat.default_platform() == "gpu"
    return "ffi" if on_gpu and ffi.cuda_built() else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{source} must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
  if implementation == "ffi":
    ffi.require_extension()
  return implementation
