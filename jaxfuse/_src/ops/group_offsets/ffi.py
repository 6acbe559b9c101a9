"""ffi_call wrapper for the group offsets handler (cuda/cpu/group_offsets.cc,
cuda/gpu/group_offsets.cu). The CUDA handler needs no workspace."""

from __future__ import annotations

import jax
import numpy as np

from jaxfuse._src import compat
from jaxfuse._src import ffi as ffi_registry


def group_offsets_multi(group_sizes: jax.Array, strides, dtypes, row_capacity) -> tuple:
  ffi_registry.ensure_registered()
  num = group_sizes.shape[0] + 1
  out_types = tuple(jax.ShapeDtypeStruct((num,), dtype) for dtype in dtypes)
  outs = jax.ffi.ffi_call("jaxfuse_group_offsets", out_types, vmap_method="sequential")(
      group_sizes, strides=np.asarray(strides, np.int64),
      row_capacity=np.int64(-1 if row_capacity is None else row_capacity))
  return tuple(compat.vary_like(out, group_sizes) for out in outs)
