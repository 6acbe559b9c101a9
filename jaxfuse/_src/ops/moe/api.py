"""Public moe_router and moe: a drop-less mixture-of-experts layer.

    weights, experts, aux = moe_router(x, router_kernel, top_k)   fp32 router, top-k
    x_sorted, row_map, sizes = moe_permute(x, experts)             expert-contiguous copies
    y_sorted = grouped_mlp(x_sorted, kernel1, kernel2, sizes,      the experts; the combine
                           scales=weights in sorted order)         weights are activation scales
    out = moe_unpermute(y_sorted, row_map)                         unit weights: already applied

The combine weights (router probabilities) are applied inside the expert MLP as the
activation's per-row scale, as TransformerEngine does, so ``moe_unpermute`` sums with unit
weights. Because FC2 is linear, FC2(act(h) * w) = w * FC2(act(h)): the result is the usual
``sum_j w_j * expert_j(x)``. Every (token, expert) copy is processed (no capacity, no drops),
and the whole layer is differentiable, router included (through the scales' gradient).

With Float8CurrentScaling(per_group=True) the permutation, the expert MLP and the unpermute
are one custom_vjp (fp8_experts.py) wherever the quantize kernels write the FP8 wgrad's
column-wise copies: the per-expert quantization of x (and of the output gradient) reads the
tokens through the routing, so x_sorted is never written in 16 bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._src import checks
from jaxfuse._src import implementation as implementation_lib
from jaxfuse._src.ops.grouped_linear import api as linear_api
from jaxfuse._src.ops.grouped_mlp import api as mlp_api
from jaxfuse._src.ops.moe import fp8_experts
from jaxfuse._src.ops.moe import reference
from jaxfuse._src.ops.moe import router_logits as router_logits_lib
from jaxfuse._src.ops.moe_permute import api as permute_api


def moe_router(x: jax.Array, router_kernel: jax.Array, top_k: int, *,
               score_function: str = "softmax", normalize_topk: bool | None = None,
               implementation: str | None = None):
  """Top-k routing in fp32.

  Args:
    x: [T, H] float.
    router_kernel: [H, E] float.
    top_k: experts per token (static, 1 <= top_k <= E).
    score_function: "softmax" (Switch / Mixtral) or "sigmoid" (DeepSeek-V3).
    normalize_topk: divide the k selected scores by their sum. Default: True for
      "sigmoid" (as DeepSeek-V3), False for "softmax".
    implementation: None, "ffi" or "xla". "xla" computes the logits with a float32
      HIGHEST dot (the specification); "ffi" computes the same float32-accurate logits and
      gradients with bfloat16 tensor-core GEMMs on exact bfloat16 splits of the operands
      (router_logits.py; router kernels 0.27 ms shorter per DeepSeek-like step on an H100,
      benchmarks/results/profile_kernels_s35*), or the HIGHEST dot with the environment
      variable JAXFUSE_MOE_ROUTER_LOGITS=highest. Both share the top-k and the loss.

  Returns:
    (combine_weights float32 [T, k], expert_indices int32 [T, k], aux_loss float32 scalar):
    aux_loss is the load-balancing loss num_experts * sum_e f_e * P_e (1.0 when balanced);
    add ``coefficient * aux_loss`` to the training loss.
  """
  if score_function not in reference.SCORE_FUNCTIONS:
    raise ValueError(f"score_function must be one of {reference.SCORE_FUNCTIONS}, got "
                     f"{score_function!r}")
  checks.check_float_array("x", x)
  checks.check_float_array("router_kernel", router_kernel)
  checks.check_rank("x", x, 2, "[T, H]")
  checks.check_rank("router_kernel", router_kernel, 2, "[H, E]")
  if router_kernel.shape[0] != x.shape[1]:
    raise ValueError(f"router_kernel.shape[0] ({router_kernel.shape[0]}) must equal x's last "
                     f"dimension ({x.shape[1]})")
  experts = router_kernel.shape[1]
  if not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= experts:
    raise ValueError(f"top_k must be an int in [1, {experts}] (the number of experts), got "
                     f"{top_k!r}")
  if normalize_topk is None:
    normalize_topk = score_function == "sigmoid"
  top_k, normalize_topk = int(top_k), bool(normalize_topk)
  if (implementation_lib.resolve(implementation) == "xla" or
      not router_logits_lib.split_bf16_enabled()):
    return reference.router(x, router_kernel, top_k, score_function, normalize_topk)
  logits = router_logits_lib.router_logits(x, router_kernel)
  return reference.route(logits, top_k, score_function, normalize_topk)


def moe(x: jax.Array, router_kernel: jax.Array, kernel1: jax.Array, kernel2: jax.Array, *,
        top_k: int, activation: str = "swiglu", score_function: str = "softmax",
        normalize_topk: bool | None = None, recipe=None, save_activation: bool | None = None,
        implementation: str | None = None, limit: float = 7.0, alpha: float = 1.702,
        linear_offset: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """A drop-less mixture-of-experts MLP layer (router, permutation, grouped MLP, unpermute).

  Args:
    x: [..., H] tokens (bfloat16 / float16; float32 with implementation="xla").
    router_kernel: [H, E] (the router runs in fp32 whatever its dtype).
    kernel1: [E, H, 2F] (GLU activations, gate first) or [E, H, F] (srelu), x's dtype.
    kernel2: [E, F, H], x's dtype. With an FP8 recipe either may be its FP8 copy from
      ``jaxfuse.quantize_experts`` (quantized once, for inference; see ``grouped_mlp``).
    top_k, score_function, normalize_topk: see ``moe_router``.
    activation, limit, alpha, linear_offset, recipe, save_activation: see ``grouped_mlp``.
      Under Float8CurrentScaling(per_group=True) with FP8 weight gradients (one device, or
      shard_map with every axis manual) the experts' quantization reads the tokens through
      the routing instead of a 16-bit permuted copy (moe/fp8_experts.py; same results).
    implementation: None, "ffi" or "xla" (the ragged_dot / jnp composition).

  Returns:
    (out [..., H] in x's dtype, aux_loss float32 scalar). out[t] = sum_j w[t, j] *
    expert_{e[t, j]}(x[t]). Differentiable in x and all three kernels (a quantized expert
    kernel gets no gradient).
  """
  checks.check_min_rank("x", x, 1, "[..., H]")
  shape = x.shape
  tokens = x.reshape(-1, shape[-1])
  experts = router_kernel.shape[-1] if np.ndim(router_kernel) == 2 else None
  kernel1_experts = linear_api.kernel_facts("kernel1", kernel1)[1][0]
  if experts is not None and kernel1_experts != experts:
    raise ValueError(f"kernel1.shape[0] ({kernel1_experts}) must equal the number of experts "
                     f"(router_kernel.shape[1] = {experts})")
  impl = implementation_lib.resolve(implementation)
  weights, indices, aux_loss = moe_router(tokens, router_kernel, top_k,
                                          score_function=score_function,
                                          normalize_topk=normalize_topk,
                                          implementation=impl)
  mlp_recipe = linear_api.recipe_for_kernels(recipe, kernel1, kernel2)
  gathered_fp8 = fp8_experts.applies(mlp_recipe, impl)
  if gathered_fp8:  # the FP8 quantization reads the tokens through the routing
    row_map, group_sizes = permute_api.moe_routing(indices, experts)
  else:
    x_sorted, row_map, group_sizes = permute_api.moe_permute(tokens, indices, experts,
                                                             implementation=impl)
  # Combine weights in expert order: scales[row_map[t, j]] = weights[t, j] (its gradient is
  # the gather back to [T, k], so the router learns through the activation's dscales).
  scales = jnp.zeros((row_map.size,), jnp.float32).at[row_map.reshape(-1)].set(
      weights.reshape(-1), mode="drop", unique_indices=True)
  if gathered_fp8:
    out = fp8_experts.moe_experts(tokens, kernel1, kernel2, row_map, group_sizes, scales,
                                  activation=activation, recipe=recipe,
                                  save_activation=save_activation, limit=limit, alpha=alpha,
                                  linear_offset=linear_offset)
    return out.reshape(shape), aux_loss
  y_sorted = mlp_api.grouped_mlp(x_sorted, kernel1, kernel2, group_sizes, scales, activation,
                                 recipe=recipe, save_activation=save_activation,
                                 implementation=impl, limit=limit, alpha=alpha,
                                 linear_offset=linear_offset)
  out = permute_api.moe_unpermute(y_sorted, row_map, None, implementation=impl)
  return out.reshape(shape), aux_loss


def flops(tokens: int, hidden: int, ffn: int, experts: int, top_k: int,
          activation: str = "swiglu", backward: bool = True) -> int:
  """GEMM FLOPs of one moe call: the experts over T*k rows plus the router."""
  router = 2 * tokens * hidden * experts * (3 if backward else 1)
  return mlp_api.flops(tokens * top_k, hidden, ffn, activation, backward) + router
