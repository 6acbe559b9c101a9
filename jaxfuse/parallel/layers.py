"""Megatron-style tensor-parallel layers, written for ``jax.shard_map``.

Every function here runs *inside* ``jax.shard_map`` (or ``jaxfuse._src.compat.shard_map``)
over a mesh axis named by ``axis_name`` (tensor-parallel size ``tp``), on per-device
shards, and uses XLA's collectives (NCCL on GPU; no symmetric-memory / NVLink multicast
tricks). They are Megatron-Core's inference chain (InferenceLinear,
InferenceLayerNormColumnParallelLinear, InferenceColumnParallelLinear,
InferenceRowParallelLinear) as functions:

    x_shard [S/tp, ..., H] --rms_norm--> --all-gather(seq)--> @ W_col [H, N/tp] -> [S, ..., N/tp]
    ... [S, ..., K/tp] @ W_row [K/tp, H] --reduce-scatter(seq)--> + residual shard
        --rms_norm(next gamma)--> --all-gather(seq)--> next column-parallel layer

Conventions:

* Activations are sequence-first: ``[S, ...batch, features]``. A *sequence-parallel*
  shard holds ``S/tp`` consecutive positions of dimension 0 on each device.
* Kernels are Flax-layout ``[in_features, out_features]`` per-device shards:
  column-parallel ``[H, N/tp]`` (a slice of the output features), row-parallel
  ``[K/tp, N]`` (a slice of the input features). Weights are never gathered.
* Matmuls accumulate in fp32 and round once to the activation dtype; collectives run in
  the activation dtype, like Megatron's (half the bytes of fp32). The row-parallel
  reduction always happens *before* any residual add: the fused scaled-residual GEMM
  (``jaxfuse.linear_scale_add``) is valid only without row parallelism (as in
  TransformerEngine), so only ``linear`` and ``column_parallel_linear`` use it.
* ``reduce="scatter"`` (sequence parallel, training and prefill) reduce-scatters the
  partial sums to ``[S/tp, ..., N]``; ``reduce="all"`` (decode-sized batches, where S is
  a handful of tokens) all-reduces them to the full ``[S, ..., N]`` on every device.
* A sequence length not divisible by ``tp`` cannot be reduce-scattered: the functions
  raise ``ValueError`` naming the argument, the size and tp before tracing further.

Training and inference variants. Every layer takes ``inference: bool = False``. Both
compute the same values with the same collectives. The training variant (default) is
differentiable: the norms go through the ``custom_vjp`` of ``jaxfuse.rms_norm`` /
``jaxfuse.add_rms_norm`` (which keep ``rsigma`` for the backward kernel and sum the
gamma gradient over the devices that hold sequence shards), and JAX's autodiff
transposes the collectives (all-gather <-> reduce-scatter, psum for replicated inputs).
``inference=True`` calls the norms' forward kernels directly, without the custom_vjp,
so nothing is kept for a backward pass (rsigma is discarded and no residuals are
saved); on the "ffi" implementation it is not differentiable (JAX raises if you try).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._src import checks
from jaxfuse._src.ops.linear_scale_add.api import linear_scale_add
from jaxfuse._src.ops.rms_norm import api as rms_norm_api

REDUCTIONS = ("scatter", "all")


# --- helpers -------------------------------------------------------------------------


def tensor_parallel_size(axis_name) -> int:
  """The size of mesh axis ``axis_name`` (tp); call inside shard_map."""
  return int(jax.lax.axis_size(axis_name))


def _check_divisible(name: str, x, tp: int, axis_name) -> None:
  if np.ndim(x) < 1:
    raise ValueError(f"{name} must have rank >= 1 (sequence first), got shape {np.shape(x)}")
  length = np.shape(x)[0]
  if length % tp != 0:
    raise ValueError(
        f"{name}.shape[0] (the sequence length, {length}) must be divisible by the "
        f"tensor-parallel size tp={tp} (mesh axis {axis_name!r}) to reduce-scatter it into "
        f"sequence-parallel shards; pad the sequence or use reduce='all'")


def _check_reduce(reduce: str) -> str:
  if reduce not in REDUCTIONS:
    raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
  return reduce


def _check_linear(x, kernel, x_name="x", kernel_name="kernel_shard") -> None:
  x_dtype = checks.check_float_array(x_name, x)
  kernel_dtype = checks.check_float_array(kernel_name, kernel)
  checks.check_min_rank(x_name, x, 1, "[S, ..., K]")
  checks.check_rank(kernel_name, kernel, 2, "[K, N]")
  if kernel_dtype != x_dtype:
    raise TypeError(f"{kernel_name} dtype {kernel_dtype} must equal {x_name} dtype {x_dtype} "
                    "(cast both to the compute dtype first)")
  if np.shape(x)[-1] != np.shape(kernel)[0]:
    raise ValueError(f"{x_name}'s last dimension ({np.shape(x)[-1]}) must equal "
                     f"{kernel_name}.shape[0] ({np.shape(kernel)[0]}); {x_name} is "
                     f"{np.shape(x)}, {kernel_name} is {np.shape(kernel)}")


def _matmul(x, kernel):
  """x @ kernel with fp32 accumulation, rounded once to x's dtype."""
  return jnp.matmul(x, kernel, preferred_element_type=jnp.float32).astype(x.dtype)


def _add(a, residual):
  """a + residual in fp32, rounded once to residual's dtype."""
  return (a.astype(jnp.float32) + residual.astype(jnp.float32)).astype(residual.dtype)


def _rms_norm(x, gamma, eps, zero_centered_gamma, inference, implementation):
  fn = rms_norm_api.rms_norm_inference if inference else rms_norm_api.rms_norm
  return fn(x, gamma, eps, zero_centered_gamma=zero_centered_gamma,
            implementation=implementation)


def _add_rms_norm(x, residual, gamma, eps, zero_centered_gamma, inference, implementation):
  fn = rms_norm_api.add_rms_norm_inference if inference else rms_norm_api.add_rms_norm
  return fn(x, residual, gamma, eps, zero_centered_gamma=zero_centered_gamma,
            implementation=implementation)


# --- sequence-parallel collectives ---------------------------------------------------


def gather_from_sequence_parallel(x, *, axis_name):
  """All-gathers sequence-parallel shards [S/tp, ...] into the full sequence [S, ...].

  Its transpose (backward) is a reduce-scatter."""
  checks.check_min_rank("x", x, 1, "[S/tp, ...]")
  return jax.lax.all_gather(x, axis_name, axis=0, tiled=True)


def reduce_scatter_to_sequence_parallel(x, *, axis_name):
  """Sums per-device partial activations [S, ...] (e.g. a vocab-parallel embedding
  lookup) and scatters the sum into sequence-parallel shards [S/tp, ...].

  Raises:
    ValueError: when S is not divisible by tp.
  """
  _check_divisible("x", x, tensor_parallel_size(axis_name), axis_name)
  return jax.lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)


def gather_last_dim(x, *, axis_name):
  """All-gathers the last dimension: column-parallel logits [..., V/tp] -> [..., V]."""
  checks.check_min_rank("x", x, 1, "[..., V/tp]")
  return jax.lax.all_gather(x, axis_name, axis=np.ndim(x) - 1, tiled=True)


# --- linears -------------------------------------------------------------------------


def linear(x, kernel, *, residual=None, alpha: float = 1.0,
           implementation: str | None = None):
  """A plain (not parallel) linear, Megatron's InferenceLinear: ``x @ kernel``, or with a
  residual ``residual + alpha * (x @ kernel)`` through the fused, in-place
  ``jaxfuse.linear_scale_add``."""
  _check_linear(x, kernel, kernel_name="kernel")
  if residual is not None:
    return linear_scale_add(x, kernel, residual, alpha, implementation=implementation)
  if alpha != 1.0:
    raise ValueError("alpha applies to the residual form only; pass residual=")
  return _matmul(x, kernel)


def column_parallel_linear(x, kernel_shard, *, axis_name, gather_input: bool = True,
                           residual=None, alpha: float = 1.0, inference: bool = False,
                           implementation: str | None = None):
  """Column-parallel linear: ``gather(x) @ kernel_shard``.

  Args:
    x: with ``gather_input=True``, a sequence-parallel shard [S/tp, ..., H], all-gathered
      along the sequence first; with ``gather_input=False``, the full [S, ..., H] (already
      gathered, e.g. by ``row_parallel_residual_rms_norm``, or replicated for decode).
    kernel_shard: [H, N/tp], this device's output columns; never gathered.
    axis_name: the tensor-parallel mesh axis.
    residual: optional [S, ..., N/tp]: returns ``residual + alpha * (x @ kernel_shard)``
      through the fused ``jaxfuse.linear_scale_add`` (valid here: no reduction follows).
    inference: accepted for symmetry with the other layers; the math and the collectives
      are the same either way.
    implementation: for linear_scale_add.

  Returns:
    [S, ..., N/tp] in x's dtype (residual's dtype with a residual).
  """
  del inference
  _check_linear(x, kernel_shard, kernel_name="kernel_shard")
  if gather_input:
    x = gather_from_sequence_parallel(x, axis_name=axis_name)
  if residual is not None:
    return linear_scale_add(x, kernel_shard, residual, alpha, implementation=implementation)
  if alpha != 1.0:
    raise ValueError("alpha applies to the residual form only; pass residual=")
  return _matmul(x, kernel_shard)


def row_parallel_linear(x_shard, kernel_shard, *, axis_name, reduce: str = "scatter",
                        residual=None, scatter_output: bool | None = None,
                        inference: bool = False):
  """Row-parallel linear: ``reduce(x_shard @ kernel_shard)`` (+ residual after the reduce).

  Args:
    x_shard: [S, ..., K/tp], this device's input features (e.g. the attention heads or
      the MLP columns it computed).
    kernel_shard: [K/tp, N], the matching rows of the kernel.
    axis_name: the tensor-parallel mesh axis.
    reduce: "scatter" reduce-scatters the partial products along the sequence into
      [S/tp, ..., N] (sequence parallel); "all" all-reduces them into [S, ..., N] (decode).
    residual: optional, the output's shape ([S/tp, ..., N] or [S, ..., N]); added in fp32
      after the reduction, never inside the GEMM (each device holds only a partial sum).
    scatter_output: alias of reduce (True: "scatter", False: "all").
    inference: accepted for symmetry; same math and collectives.

  Returns:
    The reduced product, in x's dtype (residual's dtype with a residual).

  Raises:
    ValueError: S not divisible by tp with reduce="scatter"; a bad reduce; mismatched
      residual shape.
  """
  del inference
  if scatter_output is not None:
    reduce = "scatter" if scatter_output else "all"
  reduce = _check_reduce(reduce)
  _check_linear(x_shard, kernel_shard, x_name="x_shard", kernel_name="kernel_shard")
  tp = tensor_parallel_size(axis_name)
  if reduce == "scatter":
    _check_divisible("x_shard", x_shard, tp, axis_name)
  y = _matmul(x_shard, kernel_shard)
  if reduce == "scatter":
    y = jax.lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True)
  else:
    y = jax.lax.psum(y, axis_name)
  if residual is not None:
    checks.check_float_array("residual", residual)
    if np.shape(residual) != y.shape:
      raise ValueError(f"residual must have the reduced output's shape {y.shape}, "
                       f"got {np.shape(residual)}")
    y = _add(y, residual)
  return y


# --- fused norm + linear chains ------------------------------------------------------


def rms_norm_column_parallel_linear(x_shard, gamma, kernel_shard, *, axis_name,
                                    eps: float = 1e-6, zero_centered_gamma: bool = False,
                                    gather_input: bool = True, inference: bool = False,
                                    implementation: str | None = None):
  """Megatron's LayerNormColumnParallelLinear with RMSNorm: normalize the local
  sequence-parallel shard (1/tp of the norm work), all-gather it, multiply by the column
  shard.

  Args:
    x_shard: [S/tp, ..., H] (or the full [S, ..., H] with ``gather_input=False``).
    gamma: [H], replicated. Its gradient is summed over the devices.
    kernel_shard: [H, N/tp].
    eps, zero_centered_gamma: as in ``jaxfuse.rms_norm``.
    inference: forward kernels only (see the module docs).
    implementation: for the norm ("ffi" or "xla"; None picks as usual).

  Returns:
    [S, ..., N/tp] in x's dtype.
  """
  _check_linear(x_shard, kernel_shard, x_name="x_shard", kernel_name="kernel_shard")
  normalized = _rms_norm(x_shard, gamma, eps, zero_centered_gamma, inference, implementation)
  return column_parallel_linear(normalized, kernel_shard, axis_name=axis_name,
                                gather_input=gather_input)


def row_parallel_residual_rms_norm(y_partial, residual_shard, next_gamma, *, axis_name,
                                   eps: float = 1e-6, zero_centered_gamma: bool = False,
                                   reduce: str = "scatter", gather_output: bool = True,
                                   inference: bool = False,
                                   implementation: str | None = None):
  """The fused row-parallel tail: reduce -> add residual -> RMSNorm(next gamma) -> gather.

  Args:
    y_partial: [S, ..., H], this device's partial sum (the local product of a
      row-parallel layer, ``x_shard @ kernel_shard``, before any reduction).
    residual_shard: the residual stream, [S/tp, ..., H] with reduce="scatter" or
      [S, ..., H] with reduce="all"; y_partial's dtype. Updated in place by
      ``jaxfuse.add_rms_norm`` when its buffer can be reused (donated / dead).
    next_gamma: [H], the next layer's norm weight.
    reduce: "scatter" (sequence parallel) or "all" (decode; nothing is gathered then).
    gather_output: with reduce="scatter", all-gather the normalized shard for the next
      column-parallel layer (``column_parallel_linear(..., gather_input=False)``).
    inference: forward kernels only (see the module docs).

  Returns:
    (new residual shard, normalized activations): the new residual has residual_shard's
    shape; the normalized activations are [S, ..., H] (gathered, or all-reduced), or
    the [S/tp, ..., H] shard with gather_output=False.

  Raises:
    ValueError: S not divisible by tp with reduce="scatter", a bad reduce, or mismatched
      shapes (named).
  """
  reduce = _check_reduce(reduce)
  checks.check_float_array("y_partial", y_partial)
  checks.check_min_rank("y_partial", y_partial, 1, "[S, ..., H]")
  tp = tensor_parallel_size(axis_name)
  if reduce == "scatter":
    _check_divisible("y_partial", y_partial, tp, axis_name)
    y = jax.lax.psum_scatter(y_partial, axis_name, scatter_dimension=0, tiled=True)
  else:
    y = jax.lax.psum(y_partial, axis_name)
  if np.shape(residual_shard) != y.shape:
    raise ValueError(f"residual_shard must have shape {y.shape} (y_partial reduced with "
                     f"reduce={reduce!r}, tp={tp}), got {np.shape(residual_shard)}")
  normalized, new_residual = _add_rms_norm(y.astype(residual_shard.dtype), residual_shard,
                                           next_gamma, eps, zero_centered_gamma, inference,
                                           implementation)
  if reduce == "scatter" and gather_output:
    normalized = gather_from_sequence_parallel(normalized, axis_name=axis_name)
  return new_residual, normalized
