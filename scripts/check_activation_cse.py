"""How many forward activation kernels one jitted grouped_mlp training step compiles to, on
the default backend (the claim in grouped_mlp's save_activation docstring: one either way,
XLA's CSE merging the backward's recompute with the forward's kernel).

    python scripts/check_activation_cse.py
"""

import re

import jax
import jax.numpy as jnp

import jaxfuse

TOKENS, HIDDEN, FFN, EXPERTS = 4096, 1024, 1024, 8


def activation_kernels(save_activation: bool) -> tuple[int, int]:
  """(calls in the lowered module, calls in the compiled executable)."""
  x = jnp.ones((TOKENS, HIDDEN), jnp.bfloat16)
  k1 = jnp.ones((EXPERTS, HIDDEN, 2 * FFN), jnp.bfloat16)
  k2 = jnp.ones((EXPERTS, FFN, HIDDEN), jnp.bfloat16)
  scales = jnp.ones((TOKENS,), jnp.float32)
  sizes = jnp.full((EXPERTS,), TOKENS // EXPERTS, jnp.int32)

  def step(x, k1, k2, s, dy):
    out, vjp = jax.vjp(lambda *a: jaxfuse.grouped_mlp(
        *a[:3], sizes, a[3], implementation="ffi", save_activation=save_activation),
                       x, k1, k2, s)
    return out, vjp(dy)

  lowered = jax.jit(step).lower(x, k1, k2, scales, x)
  compiled = lowered.compile().as_text()
  return (lowered.as_text().count("@jaxfuse_scaled_activation_fwd"),
          len(re.findall(r'custom_call_target="jaxfuse_scaled_activation_fwd"', compiled)))


if __name__ == "__main__":
  print(f"backend {jax.default_backend()}")
  for save in (False, True):
    lowered, compiled = activation_kernels(save)
    print(f"save_activation={save}: {lowered} forward activation calls lowered, "
          f"{compiled} compiled")
