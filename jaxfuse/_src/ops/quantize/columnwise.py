"""FP8 values quantized together with their column-wise copy (cast + transpose).

The FP8 grouped wgrad reads both operands column-wise (each group's rows as 16-aligned
columns, cuda/include/jaxfuse/columnwise.h). The current-scaling quantize kernels can write
that copy in the pass that writes the row-wise data (TransformerEngine's cast-transpose):
no second kernel reading the FP8 bytes back. The bytes are the same as
``ffi.group_columnwise`` makes of the row-wise result.

The copy's width depends on the number of rows *per device*, so it cannot be described by
the Shardy rules of sharded (custom-partitioned) calls, whose results must split evenly. It
is therefore written only where no such partitioning can follow (``fusion_enabled``): on
a single device, or inside shard_map with every mesh axis manual. Elsewhere the grouped
ops keep the row-wise FP8 tensors and the wgrad transposes them (``group_columnwise``).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax

from jaxfuse._src import compat
from jaxfuse._src.ops.quantize import api as quantize_api
from jaxfuse._src.ops.quantize import ffi
from jaxfuse.quantization import recipes


class Columnwise(NamedTuple):
  """The column-wise copy of per-group FP8 rows: data FP8 [K, columnwise_width(M, G)]
  (the blocked layout of jaxfuse/columnwise.h) and scale_inv float32 [G]."""
  data: jax.Array
  scale_inv: jax.Array


_ENABLED = compat.traced_bool_flag(
    "jaxfuse_fused_columnwise", True,
    "Whether the quantize kernels write the FP8 grouped wgrad's column-wise copies where no "
    "partitioning can follow (one device, or inside shard_map with every axis manual).")
_EVERYWHERE = compat.traced_bool_flag(
    "jaxfuse_fused_columnwise_everywhere", False,
    "Write the FP8 grouped wgrad's column-wise copies in the quantize kernels even where the "
    "calls may be partitioned (tests; XLA then gathers their operands).")


@contextlib.contextmanager
def fused(enabled: bool = True, *, everywhere: bool = False):
  """``with columnwise.fused(False):`` traces the separate transposing kernels;
  ``fused(everywhere=True)`` the fused copies whatever the device count (tests)."""
  with _ENABLED(enabled), _EVERYWHERE(enabled and everywhere):
    yield


def fusion_enabled() -> bool:
  """Whether the quantize kernels write the column-wise copies (see the module doc)."""
  if not _ENABLED.value:
    return False
  return bool(_EVERYWHERE.value) or jax.device_count() == 1 or compat.all_mesh_axes_manual()


def fuses(recipe) -> bool:
  """Whether an FP8 grouped op with this recipe has its quantizing passes write the wgrad's
  column-wise copies: FP8 weight gradients (recipe.fp8_wgrad) and fusion_enabled()."""
  return recipe.fp8_wgrad and fusion_enabled()


def quantize_rows(value, recipe, offsets, role: str, *, copy: bool):
  """Per-group current scaling of value [M, K] (rows grouped by offsets int32 [G + 1]):
  (data FP8 [M, K], scale_inv float32 [G], the wgrad's operand). The operand is the
  Columnwise copy written by the same kernel chain with ``copy``, else the (data,
  scale_inv) pair (jaxfuse.quantize, sharding rules included)."""
  if not copy:
    q = quantize_api.quantize(value, recipe, group_offsets=offsets, role=role,
                              implementation="ffi")
    return q.data, q.scale_inv, (q.data, q.scale_inv)
  data, scale_inv, columns = ffi.quantize(jax.lax.stop_gradient(value), offsets,
                                          scaling_mode="per_group", block=0,
                                          fmt=recipes.fp8_format(recipe, role),
                                          columnwise=True)
  return data, scale_inv, Columnwise(columns, scale_inv)


def to_columnwise(fp8, offsets) -> Columnwise:
  """A (data [M, K], scale_inv [G]) pair's column-wise copy (one transposing kernel); a
  Columnwise as it is."""
  if isinstance(fp8, Columnwise):
    return fp8
  data, scale_inv = fp8
  return Columnwise(ffi.group_columnwise(data, offsets), scale_inv)


def scaled_activation_quantize(x, scales, offsets, recipe, *, copy: bool, **act_kwargs):
  """act(x) * scales quantized per group (forward format): (data FP8 [M, F], scale_inv
  float32 [G], the wgrad's operand), as quantize_rows."""
  if not copy:
    q = quantize_api.scaled_activation_quantize(x, scales, recipe=recipe,
                                                group_offsets=offsets, implementation="ffi",
                                                **act_kwargs)
    return q.data, q.scale_inv, (q.data, q.scale_inv)
  data, scale_inv, columns = ffi.scaled_activation_quantize(
      jax.lax.stop_gradient(x), jax.lax.stop_gradient(scales), offsets,
      scaling_mode="per_group", block=0, fmt=recipes.fp8_format(recipe, "forward"),
      columnwise=True, **act_kwargs)
  return data, scale_inv, Columnwise(columns, scale_inv)


def scaled_dactivation_quantize(dy, x, scales, offsets, recipe, *, copy: bool,
                                return_dx: bool = False, **act_kwargs):
  """The activation gradient dx [M, W] quantized per group (gradient format) for FC1's
  dgrad and FP8 wgrad: (data, scale_inv, the wgrad's operand as quantize_rows, dx in x's
  dtype with ``return_dx`` else None, dscales [M]), one kernel chain."""
  if not copy:
    q, dx, dscales = quantize_api.scaled_dactivation_quantize(
        dy, x, scales, recipe=recipe, group_offsets=offsets, return_dx=return_dx,
        implementation="ffi", **act_kwargs)
    return q.data, q.scale_inv, (q.data, q.scale_inv), dx, dscales
  data, scale_inv, dx, dscales, columns = ffi.scaled_dactivation_quantize(
      *(jax.lax.stop_gradient(a) for a in (dy.astype(x.dtype), x, scales)), offsets,
      scaling_mode="per_group", block=0, fmt=recipes.fp8_format(recipe, "gradient"),
      return_dx=return_dx, columnwise=True, **act_kwargs)
  return data, scale_inv, Columnwise(columns, scale_inv), dx, dscales
