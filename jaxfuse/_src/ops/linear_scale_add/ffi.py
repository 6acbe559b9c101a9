"""ffi_call wrappers for the scaled matrix product handlers.

Two targets share one handler family (cuda/cpu/linear_scale_add.cc,
cuda/gpu/linear_scale_add.cu):

* ``jaxfuse_linear_scale_add``: out = c + alpha * op(a) @ op(b), with c aliased to out
  (in place when the caller donates c);
* ``jaxfuse_scaled_matmul``: out = alpha * op(a) @ op(b), used by the backward pass so
  that alpha rides in the GEMM epilogue instead of a separate scaling pass.

Leading dimensions of a (when not transposed), c and out fold into rows inside the
handler, so an aliased residual keeps its shape: reshaping it here would make XLA copy it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._src import compat
from jaxfuse._src import ffi as ffi_registry

# cuBLASLt's recommended workspace on Hopper. XLA assigns it like any other temporary.
CUDA_WORKSPACE_BYTES = 32 * 1024 * 1024


def _output_shape(a_shape, b_shape, transpose_a: bool, transpose_b: bool) -> tuple[int, ...]:
  leading = (a_shape[1],) if transpose_a else tuple(a_shape[:-1])
  cols = b_shape[0] if transpose_b else b_shape[1]
  return (*leading, cols)


def _attrs(alpha: float, transpose_a: bool, transpose_b: bool) -> dict:
  # FFI attributes: a Python float would arrive as f64 and not decode into a C++ float.
  return dict(alpha=np.float32(alpha), transpose_a=bool(transpose_a),
              transpose_b=bool(transpose_b))


def _call(target: str, operands, out_type, *, aliases: dict, attrs: dict):
  """Runs `target` on the platform being lowered for, with a workspace only on CUDA."""
  ffi_registry.ensure_registered()

  def cpu(*args):
    return jax.ffi.ffi_call(target, out_type, input_output_aliases=aliases,
                            vmap_method="sequential")(*args, **attrs)

  def cuda(*args):
    workspace = jax.ShapeDtypeStruct((CUDA_WORKSPACE_BYTES,), jnp.uint8)
    out, _ = jax.ffi.ffi_call(target, (out_type, workspace), input_output_aliases=aliases,
                              vmap_method="sequential")(*args, **attrs)
    return out

  out = jax.lax.platform_dependent(*operands, cpu=cpu, cuda=cuda)
  return compat.vary_like(out, *operands)


def linear_scale_add(a: jax.Array, b: jax.Array, c: jax.Array, *, alpha: float,
                     transpose_a: bool = False, transpose_b: bool = False) -> jax.Array:
  """c + alpha * op(a) @ op(b), written into c's buffer.

  Args:
    a: [..., R] (or [R, P] with transpose_a), float32/bfloat16/float16.
    b: [R, Q] (or [Q, R] with transpose_b), a's dtype.
    c: [..., Q] holding P rows, a's dtype or float32. Aliased to the result: donate it
      for an in-place update.
  """
  out_type = jax.ShapeDtypeStruct(c.shape, c.dtype)
  return _call("jaxfuse_linear_scale_add", (a, b, c), out_type, aliases={2: 0},
               attrs=_attrs(alpha, transpose_a, transpose_b))


def scaled_matmul(a: jax.Array, b: jax.Array, *, alpha: float, transpose_a: bool = False,
                  transpose_b: bool = False, out_dtype=None) -> jax.Array:
  """alpha * op(a) @ op(b) in out_dtype (a's dtype or float32; default a's dtype).

  a is [..., R] (the result keeps its leading shape) or, with transpose_a, [R, P].
  """
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  out_type = jax.ShapeDtypeStruct(_output_shape(a.shape, b.shape, transpose_a, transpose_b),
                                  out_dtype)
  return _call("jaxfuse_scaled_matmul", (a, b), out_type, aliases={},
               attrs=_attrs(alpha, transpose_a, transpose_b))


def _fp8_attrs(alpha: float, fast_accumulation: bool) -> dict:
  return dict(alpha=np.float32(alpha), fast_accumulation=bool(fast_accumulation))


def linear_scale_add_fp8(a: jax.Array, b: jax.Array, c: jax.Array, a_scale_inv: jax.Array,
                         b_scale_inv: jax.Array, *, alpha: float,
                         fast_accumulation: bool) -> jax.Array:
  """c + alpha * (a_scale_inv * b_scale_inv) * a @ b^T, written into c's buffer.

  a: FP8 [..., R]; b: FP8 [Q, R] (K-major, as Hopper's FP8 tensor cores need); scales:
  float32 [1] on the device; c: [..., Q] bf16/f16/f32, aliased to the result.
  """
  out_type = jax.ShapeDtypeStruct(c.shape, c.dtype)
  return _call("jaxfuse_linear_scale_add_fp8", (a, b, c, a_scale_inv, b_scale_inv), out_type,
               aliases={2: 0}, attrs=_fp8_attrs(alpha, fast_accumulation))


def scaled_matmul_fp8(a: jax.Array, b: jax.Array, a_scale_inv: jax.Array,
                      b_scale_inv: jax.Array, *, alpha: float, out_dtype,
                      fast_accumulation: bool = False) -> jax.Array:
  """alpha * (a_scale_inv * b_scale_inv) * a @ b^T in out_dtype; a [..., R], b [Q, R] FP8."""
  out_type = jax.ShapeDtypeStruct((*a.shape[:-1], b.shape[0]), jnp.dtype(out_dtype))
  return _call("jaxfuse_scaled_matmul_fp8", (a, b, a_scale_inv, b_scale_inv), out_type,
               aliases={}, attrs=_fp8_attrs(alpha, fast_accumulation))
