"""jaxfuse: TransformerEngine-style fused operations for JAX on NVIDIA GPUs.

Every op takes ``implementation=None | "ffi" | "xla"``. ``"ffi"`` runs jaxfuse's XLA FFI
custom calls (CUDA kernels on GPU; C++ reference loops on CPU, so CI exercises the same
plumbing); ``"xla"`` runs the pure-jnp reference. ``None`` picks ``"ffi"`` on GPU when the
CUDA part was built and ``"xla"`` elsewhere; the ``JAXFUSE_IMPLEMENTATION`` environment
variable overrides that default for the whole process.
"""

from jaxfuse import quantization
from jaxfuse._src.ffi import build_info as _build_info
from jaxfuse._src.ffi import ensure_registered as _ensure_registered
from jaxfuse._src.ffi import export_disabled_checks as _export_disabled_checks
from jaxfuse._src.ops.group_offsets.api import group_offsets
from jaxfuse._src.ops.grouped_linear.api import grouped_linear
from jaxfuse._src.ops.grouped_linear.api import quantize_experts
from jaxfuse._src.ops.linear_scale_add.api import linear_scale_add
from jaxfuse._src.ops.linear_scale_add.api import quantize_kernel
from jaxfuse._src.ops.quantize.api import dequantize
from jaxfuse._src.ops.quantize.api import quantize
from jaxfuse._src.ops.quantize.api import scaled_activation_quantize
from jaxfuse._src.ops.quantize.api import scaled_dactivation_quantize
from jaxfuse._src.ops.grouped_mlp.api import grouped_mlp
from jaxfuse._src.ops.moe.api import moe
from jaxfuse._src.ops.moe.api import moe_router
from jaxfuse._src.ops.moe_permute.api import moe_permute
from jaxfuse._src.ops.moe_permute.api import moe_unpermute
from jaxfuse._src.ops.rms_norm.api import add_rms_norm
from jaxfuse._src.ops.rms_norm.api import rms_norm
from jaxfuse._src.ops.scaled_activation.api import scaled_activation
from jaxfuse._src.sharding import sharding_rules

__version__ = "0.1.0"

# jax.export refuses custom calls it does not know to be stable; jaxfuse's FFI targets
# keep their ABI within a jaxfuse version. Pass these to jax.export.export:
#   exported = jax.export.export(jax.jit(f), disabled_checks=jaxfuse.EXPORT_DISABLED_CHECKS)(*args)
#   blob = exported.serialize(); jax.export.deserialize(blob).call(*args)
# The process that runs the deserialized function must register jaxfuse's handlers first:
# jaxfuse.register_handlers() (tracing any op with implementation="ffi" does it too). With sharded inputs, export inside
# ``with jaxfuse.sharding_rules(False):``: the rules use custom_partitioning, whose Python
# callbacks cannot be serialized. Empty when the extension is not built.
EXPORT_DISABLED_CHECKS = _export_disabled_checks()


def register_handlers() -> None:
  """Registers jaxfuse's FFI handlers with XLA now (idempotent).

  Ops register them when first traced with implementation="ffi"; a process that only runs
  a deserialized ``jax.export`` program must call this before calling it.
  """
  _ensure_registered()


def build_info() -> dict:
  """What the compiled extension was built with.

  Keys: ``available`` (bool), ``platforms`` (["cpu"] or ["cpu", "CUDA"]),
  ``cuda_architectures``, ``cuda_version``, ``cublas_header_version``,
  ``cutlass_version``, ``jaxlib_version`` (the jaxlib whose FFI headers were used) and
  ``ffi_api_version``.
  """
  return dict(_build_info())


__all__ = ["EXPORT_DISABLED_CHECKS", "add_rms_norm", "build_info", "dequantize", "group_offsets",
           "grouped_linear", "grouped_mlp", "linear_scale_add", "moe", "moe_permute",
           "moe_router", "moe_unpermute", "quantization", "quantize", "quantize_experts",
           "quantize_kernel", "register_handlers", "rms_norm", "scaled_activation",
           "scaled_activation_quantize", "scaled_dactivation_quantize", "sharding_rules"]
