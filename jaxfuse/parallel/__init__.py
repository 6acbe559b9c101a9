"""Megatron-style tensor-parallel layers for ``jax.shard_map``.

See ``jaxfuse.parallel.layers`` for the conventions (sequence-first activations,
sequence-parallel shards on dimension 0, weight shards per device).
"""

from jaxfuse.parallel.layers import column_parallel_linear
from jaxfuse.parallel.layers import gather_from_sequence_parallel
from jaxfuse.parallel.layers import gather_last_dim
from jaxfuse.parallel.layers import linear
from jaxfuse.parallel.layers import reduce_scatter_to_sequence_parallel
from jaxfuse.parallel.layers import rms_norm_column_parallel_linear
from jaxfuse.parallel.layers import row_parallel_linear
from jaxfuse.parallel.layers import row_parallel_residual_rms_norm
from jaxfuse.parallel.layers import tensor_parallel_size

__all__ = [
    "column_parallel_linear",
    "gather_from_sequence_parallel",
    "gather_last_dim",
    "linear",
    "reduce_scatter_to_sequence_parallel",
    "rms_norm_column_parallel_linear",
    "row_parallel_linear",
    "row_parallel_residual_rms_norm",
    "tensor_parallel_size",
]
