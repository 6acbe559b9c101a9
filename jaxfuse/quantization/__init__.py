"""FP8 recipes and the QuantizedArray pytree.

Recipes are frozen (hashable) dataclasses, so they can be static arguments:

* ``Float8CurrentScaling(per_group=True)``: one scale per group of rows (the rows of group
  g are located through ``group_offsets``), ``scale = fp8_max / amax``; ``per_group=False``
  is one scale per tensor. E4M3 for forward tensors, E5M2 for gradients.
  ``forward_fast_accumulation=True`` (the default, as TransformerEngine's fprop): the
  forward GEMMs of ``linear_scale_add`` and ``grouped_linear`` accumulate in the FP8
  tensor cores' own accumulator; the gradient GEMMs always promote to fp32.
* ``Float8BlockScaling()``: DeepSeek-V3's recipe: 1 x 128 blocks along the last dimension
  for activations (``scale_inv [rows, ceil(K / 128)]``), 128 x 128 tiles for weights
  (``kind="weight"``), fp32 scales; E4M3 for both roles by default. ``grouped_linear``,
  ``grouped_mlp`` and ``moe`` run it on the blockwise FP8 grouped GEMMs (16-bit wgrads).
* ``MXFP8BlockScaling()``: the OCP MX format: 1 x 32 blocks with power-of-two E8M0 scales
  stored as uint8 biased exponents (quantize / dequantize only).

``role="forward" | "gradient"`` in ``jaxfuse.quantize`` picks the recipe's
``forward_format`` or ``gradient_format`` ("e4m3" or "e5m2").

``jaxfuse.quantize_experts(kernel, Float8CurrentScaling(...))`` quantizes grouped-GEMM
weights [G, K, N] once, one scale per expert (scaling_mode "per_expert", data [G, N, K]);
with ``Float8BlockScaling()`` one scale per 128 x 128 tile (scaling_mode
"expert_block_2d", data [G, N, K], scale_inv [G, ceil(N / 128), ceil(K / 128)]):
``grouped_linear``, ``grouped_mlp``, ``moe`` and the Flax modules take the result as a
kernel and skip the per-call quantization of the weights. ``jaxfuse.quantize_kernel(kernel,
Float8CurrentScaling(per_group=False))`` does the same for a dense kernel [K, N] and
``linear_scale_add`` (scaling_mode "per_kernel", data [N, K]).
"""

from jaxfuse.quantization.recipes import Float8BlockScaling
from jaxfuse.quantization.recipes import Float8CurrentScaling
from jaxfuse.quantization.recipes import MXFP8BlockScaling
from jaxfuse.quantization.recipes import QuantizedArray
from jaxfuse.quantization.recipes import Recipe
from jaxfuse.quantization.recipes import FP8_DTYPES
from jaxfuse.quantization.recipes import FP8_MAX

__all__ = ["Float8BlockScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "QuantizedArray",
           "Recipe", "FP8_DTYPES", "FP8_MAX"]
