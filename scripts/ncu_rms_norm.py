"""rms_norm and add_rms_norm at 65536 x 8192 bf16 (fp32 gamma), forwards and gradients, a
few calls each: a target for Nsight Compute on the GPU machine, e.g. after `gpu_run.sh
prebuilt` (the prebuilt extension sits in /tmp/jaxfuse-head, which is not on sys.path by
default):

    cd /tmp/jaxfuse-head && PYTHONPATH=$PWD ncu --clock-control none -k regex:RmsNormStagedBwd \
        -c 2 --section SpeedOfLight --section WarpStateStats python3 scripts/ncu_rms_norm.py
"""

import jax
import jax.numpy as jnp

import jaxfuse

x = jax.random.normal(jax.random.key(0), (65536, 8192), jnp.bfloat16)
residual = jax.random.normal(jax.random.key(1), (65536, 8192), jnp.bfloat16)
dy = jax.random.normal(jax.random.key(3), (65536, 8192), jnp.bfloat16)
gamma = 1.0 + 0.1 * jax.random.normal(jax.random.key(2), (8192,), jnp.float32)
plain = jax.jit(lambda x, g: jaxfuse.rms_norm(x, g))
added = jax.jit(lambda x, r, g: jaxfuse.add_rms_norm(x, r, g))


@jax.jit
def plain_grads(x, g, dy):
  _, vjp = jax.vjp(jaxfuse.rms_norm, x, g)
  return vjp(dy)


@jax.jit
def added_grads(x, r, g, dy):
  _, vjp = jax.vjp(jaxfuse.add_rms_norm, x, r, g)
  return vjp((dy, dy))


for _ in range(2):
  jax.block_until_ready(plain(x, gamma))
  jax.block_until_ready(added(x, residual, gamma))
  jax.block_until_ready(plain_grads(x, gamma, dy))
  jax.block_until_ready(added_grads(x, residual, gamma, dy))
print("done")
