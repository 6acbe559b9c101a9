"""Weights quantized once (``jaxfuse.quantize_experts``, ``jaxfuse.quantize_kernel``) inside
the Flax modules.

The MoE, GroupedLinear and LinearScaleAdd modules of ``jaxfuse.flax.linen`` and
``jaxfuse.flax.nnx`` take a kernel parameter that holds a QuantizedArray instead of an
array: the weights are quantized once (``quantize_expert_params`` /
``quantize_kernel_params`` in either module) and the call skips their quantization passes.
These helpers keep the modules' dtype handling for the 16-bit kernels and pass the
quantized ones through.
"""

from __future__ import annotations

from jaxfuse._src.ops.grouped_linear import api as linear_api
from jaxfuse._src.ops.linear_scale_add import api as dense_api


is_quantized = linear_api.is_quantized_kernel


def quantize(kernel, recipe, dtype=None, trainable=False):
  """quantize_experts (an expert kernel [G, K, N]) or quantize_kernel (a dense one [K, N])
  of the kernel in `dtype`: cast first, so that the FP8 values equal those a module with
  compute dtype `dtype` quantizes from its kernel in every call (a trainable copy's master
  is the cast kernel, whose gradient flows back through the cast)."""
  if is_quantized(kernel):
    return kernel
  kernel = kernel if dtype is None else kernel.astype(dtype)
  if kernel.ndim == 2:
    return dense_api.quantize_kernel(kernel, recipe, trainable=trainable)
  return linear_api.quantize_experts(kernel, recipe, trainable=trainable)


def promote(promote_dtype, x, kernels, dtype):
  """(x, *kernels) with x and the 16-bit kernels promoted by Flax's `promote_dtype` to
  `dtype` (their common dtype when None); quantized kernels are returned as they are."""
  arrays = [k for k in kernels if not is_quantized(k)]
  promoted = promote_dtype(x, *arrays, dtype=dtype)
  x, arrays = promoted[0], list(promoted[1:])
  out = [k if is_quantized(k) else arrays.pop(0) for k in kernels]
  return (x, *out)
