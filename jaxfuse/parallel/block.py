"""A tensor-parallel, sequence-parallel pre-norm transformer block as a function of its
per-device parameter shards (used by the Flax modules and the example).

Parameters (per device; the global layout in brackets, sharded by ``PARAM_SPECS``):

* ``attn_norm`` [H], ``mlp_norm`` [H]: RMSNorm gammas, replicated.
* ``qkv_kernel`` [H, heads/tp * 3 * head_dim] (global [H, heads * 3 * head_dim], laid out
  (head, q|k|v, head_dim) so a column shard holds whole heads): column parallel.
* ``out_kernel`` [heads/tp * head_dim, H] (global [heads * head_dim, H]): row parallel.
* ``up_gate_kernel`` [H, mlp/tp * 2] (global [H, mlp * 2], laid out (feature, gate|up)):
  column parallel, SwiGLU.
* ``down_kernel`` [mlp/tp, H] (global [mlp, H]): row parallel.

With ``sequence_parallel=True`` (training, prefill) the residual stream x is a sequence
shard [S/tp, B, H]; the block is norm -> all-gather -> QKV -> attention -> out-proj ->
reduce-scatter + residual + norm -> all-gather -> up/gate -> SwiGLU -> down ->
reduce-scatter + residual. With ``sequence_parallel=False`` (decode-sized batches) x is
replicated [S, B, H] and the two reductions are all-reduces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxfuse.parallel import layers

PARAM_NAMES = ("attn_norm", "qkv_kernel", "out_kernel", "mlp_norm", "up_gate_kernel",
               "down_kernel")


def param_specs(axis_name: str = "tp") -> dict:
  """PartitionSpecs of the block's parameters (global arrays) over ``axis_name``."""
  return {"attn_norm": P(), "mlp_norm": P(),
          "qkv_kernel": P(None, axis_name), "up_gate_kernel": P(None, axis_name),
          "out_kernel": P(axis_name, None), "down_kernel": P(axis_name, None)}


def global_param_shapes(hidden: int, num_heads: int, head_dim: int, mlp_dim: int) -> dict:
  return {"attn_norm": (hidden,), "mlp_norm": (hidden,),
          "qkv_kernel": (hidden, num_heads * 3 * head_dim),
          "out_kernel": (num_heads * head_dim, hidden),
          "up_gate_kernel": (hidden, mlp_dim * 2), "down_kernel": (mlp_dim, hidden)}


def check_divisible(num_heads: int, mlp_dim: int, tp: int) -> None:
  if num_heads % tp:
    raise ValueError(f"num_heads ({num_heads}) must be divisible by the tensor-parallel "
                     f"size tp={tp}")
  if mlp_dim % tp:
    raise ValueError(f"mlp_dim ({mlp_dim}) must be divisible by the tensor-parallel size "
                     f"tp={tp}")


def causal_attention(q, k, v):
  """Softmax attention with a causal mask, in fp32: q, k, v [S, B, heads, d] -> same."""
  d = q.shape[-1]
  scores = jnp.einsum("sbhd,tbhd->bhst", q, k, preferred_element_type=jnp.float32)
  scores = scores / jnp.sqrt(jnp.float32(d))
  s = q.shape[0]
  mask = jnp.tril(jnp.ones((s, s), dtype=bool))
  scores = jnp.where(mask, scores, -jnp.inf)
  weights = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bhst,tbhd->sbhd", weights, v.astype(jnp.float32))
  return out.astype(q.dtype)


def transformer_block(params: dict, x, *, axis_name: str = "tp", head_dim: int,
                      eps: float = 1e-6, sequence_parallel: bool = True,
                      inference: bool = False, implementation: str | None = None):
  """One block on per-device shards; call inside shard_map. Returns the new x (x's
  shape: [S/tp, B, H] sequence parallel, [S, B, H] replicated otherwise)."""
  reduce = "scatter" if sequence_parallel else "all"
  common = dict(axis_name=axis_name, eps=eps, inference=inference,
                implementation=implementation)
  qkv = layers.rms_norm_column_parallel_linear(
      x, params["attn_norm"], params["qkv_kernel"], gather_input=sequence_parallel, **common)
  s, b = qkv.shape[:2]
  heads_local = qkv.shape[-1] // (3 * head_dim)
  qkv = qkv.reshape(s, b, heads_local, 3, head_dim)
  attention = causal_attention(qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :])
  attention = attention.reshape(s, b, heads_local * head_dim)
  # Row-parallel out-projection: the local partial product; the reduction, the residual
  # add, the MLP norm and the gather follow in one fused tail.
  y_partial = jnp.matmul(attention, params["out_kernel"],
                         preferred_element_type=jnp.float32).astype(x.dtype)
  x, normalized = layers.row_parallel_residual_rms_norm(
      y_partial, x, params["mlp_norm"], reduce=reduce, **common)
  up_gate = layers.column_parallel_linear(normalized, params["up_gate_kernel"],
                                          axis_name=axis_name, gather_input=False)
  up_gate = up_gate.reshape(s, b, -1, 2).astype(jnp.float32)
  hidden = (jax.nn.silu(up_gate[..., 0]) * up_gate[..., 1]).astype(x.dtype)
  return layers.row_parallel_linear(hidden, params["down_kernel"], axis_name=axis_name,
                                    reduce=reduce, residual=x)
