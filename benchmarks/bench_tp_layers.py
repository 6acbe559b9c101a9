"""Tensor-parallel layers (jaxfuse.parallel) on several GPUs: layer time and collective
bytes against tokens.

For each layer and token count: the median time of the layer inside ``jax.shard_map``
over all local GPUs (bf16, hidden 8192, MLP 4x), the time of the same local math with no
collective (the layer's compute floor), and the bytes each device sends through its
collectives (ring algorithms: all-gather and reduce-scatter move (tp - 1) / tp of the
full tensor, all-reduce twice that), with the bus bandwidth they imply. Sequence-parallel
layers use 1K-64K tokens; the all-reduce (decode) variants use 1-1024 tokens.

Needs at least 2 GPUs (NCCL through XLA's collectives; NVLink multicast is not used):

    python benchmarks/bench_tp_layers.py [--quick]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxfuse
from benchmarks import common
from jaxfuse import parallel

AXIS = "tp"
HIDDEN = 8192
MLP = 4 * HIDDEN
DTYPE = jnp.bfloat16
TOKENS = [1024, 4096, 16384, 65536]
DECODE_TOKENS = [1, 8, 64, 256, 1024]


def _matmul(x, k):
  return jnp.matmul(x, k, preferred_element_type=jnp.float32).astype(x.dtype)


def _local_tail(y, r, g, tp):
  normalized, new_residual = jaxfuse.add_rms_norm(y[:r.shape[0]], r, g)
  return new_residual, jnp.concatenate([normalized] * tp)


def layer_cases(tp):
  """name -> (per-device fn, local-math-only fn, global shapes, in specs, out spec,
  collective bytes per device as a function of tokens, token counts)."""
  itemsize = jnp.dtype(DTYPE).itemsize
  ring = (tp - 1) / tp
  act = lambda s: s * HIDDEN * itemsize  # noqa: E731  bytes of a full [S, H] activation
  return {
      "column_parallel_linear": (
          lambda x, k: parallel.column_parallel_linear(x, k, axis_name=AXIS),
          lambda x, k: _matmul(jnp.concatenate([x] * tp), k),
          lambda s: [(s, HIDDEN), (HIDDEN, MLP)], (P(AXIS), P(None, AXIS)), P(None, AXIS),
          lambda s: ring * act(s), TOKENS),
      "rms_norm_column_parallel_linear": (
          lambda x, g, k: parallel.rms_norm_column_parallel_linear(x, g, k, axis_name=AXIS),
          lambda x, g, k: _matmul(jnp.concatenate([jaxfuse.rms_norm(x, g)] * tp), k),
          lambda s: [(s, HIDDEN), (HIDDEN,), (HIDDEN, MLP)], (P(AXIS), P(), P(None, AXIS)),
          P(None, AXIS), lambda s: ring * act(s), TOKENS),
      "row_parallel_linear(scatter)": (
          lambda x, k, r: parallel.row_parallel_linear(x, k, axis_name=AXIS, residual=r),
          lambda x, k, r: _matmul(x, k)[:r.shape[0]] + r,
          lambda s: [(s, MLP), (MLP, HIDDEN), (s, HIDDEN)], (P(None, AXIS), P(AXIS), P(AXIS)),
          P(AXIS), lambda s: ring * act(s), TOKENS),
      "row_parallel_residual_rms_norm": (
          lambda y, r, g: parallel.row_parallel_residual_rms_norm(y, r, g, axis_name=AXIS),
          lambda y, r, g: _local_tail(y, r, g, tp),
          lambda s: [(tp * s, HIDDEN), (s, HIDDEN), (HIDDEN,)], (P(AXIS), P(AXIS), P()),
          (P(AXIS), P(AXIS)), lambda s: 2 * ring * act(s), TOKENS),
      "row_parallel_linear(all)": (
          lambda x, k: parallel.row_parallel_linear(x, k, axis_name=AXIS, reduce="all"),
          lambda x, k: _matmul(x, k),
          lambda s: [(s, MLP), (MLP, HIDDEN)], (P(None, AXIS), P(AXIS)), P(),
          lambda s: 2 * ring * act(s), DECODE_TOKENS),
  }


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="fewer token counts and calls")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny sizes on whatever devices exist (checks the script on CPU, "
                           "e.g. with XLA_FLAGS=--xla_force_host_platform_device_count=8); "
                           "writes no results")
  args = parser.parse_args()
  global HIDDEN, MLP, TOKENS, DECODE_TOKENS
  if args.smoke:
    HIDDEN, MLP, TOKENS, DECODE_TOKENS = 64, 256, [64, 128], [1, 8]
    gpus = jax.devices()
  else:
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if len(gpus) < 2:
    sys.exit(f"bench_tp_layers needs at least 2 GPUs for tensor parallelism; found "
             f"{len(gpus)} ({jax.devices()[0].platform}). Nothing was measured.")
  tp = len(gpus)
  mesh = Mesh(np.array(gpus), (AXIS,))
  calls = 8 if args.quick else 23
  rows = []
  for name, (fn, local_fn, shapes_of, in_specs, out_spec, comm_bytes, tokens_list) in (
      layer_cases(tp).items()):
    for tokens in (tokens_list[:2] if args.quick else tokens_list):
      shapes = shapes_of(tokens)
      arrays = []
      for i, (shape, spec) in enumerate(zip(shapes, in_specs)):
        make = jax.jit(lambda key, shape=shape: jax.random.normal(key, shape, DTYPE) * 0.02,
                       out_shardings=NamedSharding(mesh, spec))
        arrays.append(make(jax.random.key(i)))
      layer = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec))
      # The local math alone, on the same per-device shapes, with no collective.
      local = jax.jit(jax.shard_map(local_fn, mesh=mesh, in_specs=in_specs,
                                    out_specs=out_spec, check_vma=False))
      row = {"layer": name, "tp": tp, "tokens": tokens, "hidden": HIDDEN}
      try:
        row["layer_ms"] = common.time_fn(layer, [tuple(arrays)] * calls)["median_ms"]
        row["local_math_ms"] = common.time_fn(local, [tuple(arrays)] * calls)["median_ms"]
      except Exception as error:  # e.g. out of memory at the largest size
        row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        rows.append(row)
        print(row, flush=True)
        continue
      row["collective_bytes_per_device"] = int(comm_bytes(tokens))
      row["collective_overhead_ms"] = row["layer_ms"] - row["local_math_ms"]
      # Bus bandwidth if the collectives ran after the math, not overlapped with it.
      row["bus_gbps_if_serial"] = (
          row["collective_bytes_per_device"] / row["collective_overhead_ms"] / 1e6
          if row["collective_overhead_ms"] > 0 else None)
      rows.append(row)
      print(row, flush=True)
      del arrays
  common.print_table(rows, ["layer", "tokens", "layer_ms", "local_math_ms",
                            "collective_overhead_ms", "collective_bytes_per_device",
                            "bus_gbps_if_serial"])
  if args.smoke:
    return
  common.write_results("tp_layers", rows, dtype="bfloat16", tp=tp, hidden=HIDDEN, mlp=MLP)


if __name__ == "__main__":
  main()
