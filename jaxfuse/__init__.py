"""jaxfuse: TransformerEngine-style fused operations for JAX on NVIDIA GPUs.

Every op takes ``implementation=None | "ffi" | "xla"``. ``"ffi"`` runs jaxfuse's XLA FFI
custom calls (CUDA kernels on GPU; C++ reference loops on CPU, so CI exercises the same
plumbing); ``"xla"`` runs the pure-jnp reference. ``None`` picks ``"ffi"`` on GPU when the
CUDA part was built and ``"xla"`` elsewhere; the ``JAXFUSE_IMPLEMENTATION`` environment
variable overrides that default for the whole process.
"""

from jaxfuse import quantization
from jaxfuse._src.ffi import build_info as _build_info
from jaxfuse._src.ops.group_offsets.api import group_offsets
from jaxfuse._src.ops.grouped_linear.api import grouped_linear
from jaxfuse._src.ops.linear_scale_add.api import linear_scale_add
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

__version__ = "0.1.0"


def build_info() -> dict:
  """What the compiled extension was built with.

  Keys: ``available`` (bool), ``platforms`` (["cpu"] or ["cpu", "CUDA"]),
  ``cuda_architectures``, ``cuda_version``, ``cublas_header_version``,
  ``cutlass_version``, ``jaxlib_version`` (the jaxlib whose FFI headers were used) and
  ``ffi_api_version``.
  """
  return dict(_build_info())


__all__ = ["add_rms_norm", "build_info", "dequantize", "group_offsets", "grouped_linear",
           "grouped_mlp", "linear_scale_add", "moe", "moe_permute", "moe_router",
           "moe_unpermute", "quantization", "quantize", "rms_norm", "scaled_activation",
           "scaled_activation_quantize", "scaled_dactivation_quantize"]
