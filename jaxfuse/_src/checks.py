"""Argument checks shared by the public ops: clear errors before tracing goes far."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_FLOAT_NAMES = "float32, bfloat16 or float16"


def dtype_of(name: str, value: Any) -> np.dtype:
  try:
    return jnp.dtype(jnp.result_type(value))
  except TypeError as error:
    raise TypeError(f"{name} must be an array, got {type(value).__name__}") from error


def check_float_array(name: str, value: Any) -> np.dtype:
  """Returns the dtype; raises TypeError unless it is float32, bfloat16 or float16."""
  dtype = dtype_of(name, value)
  if dtype not in FLOAT_DTYPES:
    raise TypeError(f"{name} must have dtype {_FLOAT_NAMES}, got {dtype}")
  return dtype


def check_min_rank(name: str, value: Any, rank: int, layout: str) -> None:
  if np.ndim(value) < rank:
    raise ValueError(f"{name} must have rank >= {rank} ({layout}), got shape {np.shape(value)}")


def check_rank(name: str, value: Any, rank: int, layout: str) -> None:
  if np.ndim(value) != rank:
    raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {np.shape(value)}")


def static_float(name: str, value: Any) -> float:
  """A Python float from a static real scalar; FFI attributes must be known at trace time.

  Raises:
    TypeError: for traced values, arrays with more than one element, and non-reals.
  """
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be a static Python scalar (it becomes a kernel attribute), "
                    "got a traced value; pass a float, not a jax array computed under jit")
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a real scalar, got a bool")
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    array = np.asarray(value)
    if array.ndim == 0 and (np.issubdtype(array.dtype, np.floating) or
                            np.issubdtype(array.dtype, np.integer)):
      return float(array)
  raise TypeError(f"{name} must be a real scalar, got {type(value).__name__} "
                  f"with shape {np.shape(value)}")
