"""Pure-jnp router of the MoE layer: the specification (float32 logits from a HIGHEST dot,
then ``route``). The fused path computes the same logits with bfloat16 tensor-core GEMMs
(router_logits.py) and shares ``route``: small float32 work that XLA fuses well."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse._src.ops.moe_permute.reference import expert_counts

SCORE_FUNCTIONS = ("softmax", "sigmoid")


def router_logits(x, router_kernel):
  """float32 [T, E] logits x @ router_kernel at full float32 precision (HIGHEST)."""
  # The GPU's default f32 matmul uses TF32 (10-bit mantissa), which flips top-k choices
  # between near-tied experts; routing must not depend on that.
  return jnp.dot(x.astype(jnp.float32), router_kernel.astype(jnp.float32),
                 preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)


def route(logits, top_k: int, score_function: str = "softmax", normalize_topk: bool = False):
  """(combine weights f32 [T, k], expert ids int32 [T, k], aux loss f32 scalar) from f32
  logits [T, E]: see ``router``."""
  if score_function == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
    balance_scores = scores
  else:
    scores = jax.nn.sigmoid(logits)
    balance_scores = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)
  weights, indices = jax.lax.top_k(scores, top_k)
  if normalize_topk:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  tokens, experts = logits.shape
  counts = expert_counts(indices, experts, jnp.float32)
  fraction = jax.lax.stop_gradient(counts / max(tokens * top_k, 1))
  mean_scores = jnp.mean(balance_scores, axis=0)
  aux_loss = experts * jnp.sum(fraction * mean_scores)
  return weights, indices.astype(jnp.int32), aux_loss


def router(x, router_kernel, top_k: int, score_function: str = "softmax",
           normalize_topk: bool = False):
  """(combine weights f32 [T, k], expert ids int32 [T, k], aux loss f32 scalar).

  logits = x @ router_kernel in fp32; scores = softmax(logits) or sigmoid(logits); the k
  largest scores pick the experts; their scores (divided by their sum when normalize_topk)
  are the combine weights. The load-balancing loss (Switch / GShard, as Megatron computes
  it) is num_experts * sum_e f_e * P_e with f_e = (copies routed to e) / (T * k) (not
  differentiable) and P_e the mean over tokens of e's (sum-normalized, for sigmoid) score:
  1.0 when routing is perfectly balanced.
  """
  return route(router_logits(x, router_kernel), top_k, score_function, normalize_topk)
