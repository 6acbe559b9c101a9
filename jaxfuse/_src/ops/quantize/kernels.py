"""Weights quantized once (``quantize_experts``, ``quantize_kernel``) as GEMM kernels:
which ones get a gradient, and how a backward pass builds their cotangents.

A kernel argument is a 16-bit array or a QuantizedArray. A QuantizedArray with a
``master`` (a trainable copy) receives the kernel's gradient there; one without is a
constant. The FP8 leaves never get a cotangent.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxfuse.quantization import recipes


def is_quantized_kernel(kernel) -> bool:
  """Whether `kernel` holds FP8 weights quantized once (a QuantizedArray)."""
  return isinstance(kernel, recipes.QuantizedArray)


def is_frozen_kernel(kernel) -> bool:
  """Whether `kernel` gets no gradient: a quantized kernel without a master."""
  return is_quantized_kernel(kernel) and kernel.master is None


def check_copy_arrays(name: str, kernel, shape: tuple[int, ...], layout: str) -> None:
  """A trainable copy's kernel-layout arrays (data_untransposed, master) must have the
  kernel's logical `shape` (its data `layout`), and the master the copy's dtype.

  Raises ValueError (shape) or TypeError (dtype), naming the argument and the field.
  """
  for field in ("data_untransposed", "master"):
    value = getattr(kernel, field)
    if value is not None and tuple(value.shape) != tuple(shape):
      raise ValueError(f"a quantized {name}'s {field} must have shape {tuple(shape)} (its data "
                       f"{tuple(kernel.data.shape)} {layout}), got {tuple(value.shape)}")
  if kernel.master is not None and jnp.dtype(kernel.master.dtype) != jnp.dtype(kernel.dtype):
    raise TypeError(f"a quantized {name}'s master must have its dtype {jnp.dtype(kernel.dtype)}, "
                    f"got {kernel.master.dtype}")


def gradient_target(kernel):
  """The array a kernel's gradient goes to: the kernel itself (16-bit), the master of a
  trainable quantized copy, or None (frozen)."""
  return kernel.master if is_quantized_kernel(kernel) else kernel


def cotangent_template(kernel):
  """What a backward pass needs to build ``kernel_cotangent``, as a residual: a quantized
  kernel's pytree structure and static fields without its arrays (None for a 16-bit one)."""
  if not is_quantized_kernel(kernel):
    return None
  return dataclasses.replace(kernel, data=None, scale_inv=None, group_offsets=None,
                             data_untransposed=None, master=None)


def kernel_cotangent(template, d_kernel):
  """The cotangent of a kernel argument from its gradient d_kernel (the kernel's shape)
  and its ``cotangent_template``: d_kernel for a 16-bit kernel (template None), else the
  QuantizedArray holding d_kernel at ``master`` (no cotangent for the FP8 leaves)."""
  return d_kernel if template is None else dataclasses.replace(template, master=d_kernel)
