"""jaxfuse.ops: write a model as a sequence of basic ops; a fuser swaps known windows for
jaxfuse's fused operations at trace time (TransformerEngine's op API / op fuser).

    from jaxfuse import ops
    seq = ops.Sequential(ops.Linear(256), ops.ConstantScale(0.5),
                         ops.AddExtraInput("residual", in_place=True),
                         ops.RMSNorm(1e-6))
    params = seq.init(key, x, residual=r)
    y = seq.apply(params, x, residual=r)
    seq.fusions(x, residual=r)   # [("LinearScaleAdd", (0, 1, 2))]

``jaxfuse.ops.Sequential`` is the Flax linen module (``jaxfuse.ops.linen.Sequential``);
``jaxfuse.ops.nnx.Sequential`` is the NNX one. ``jaxfuse.ops.sequential`` has the
functional core (``init_params``, ``apply``, ``fusion_plan``) and ``jaxfuse.ops.fuser``
the fusion registry (see its docstring for the fusions and their conditions).
"""

from jaxfuse.ops import fuser
from jaxfuse.ops import linen
from jaxfuse.ops import nnx
from jaxfuse.ops import sequential
from jaxfuse.ops.basic import AddExtraInput
from jaxfuse.ops.basic import BasicOp
from jaxfuse.ops.basic import ConstantScale
from jaxfuse.ops.basic import GroupedLinear
from jaxfuse.ops.basic import Linear
from jaxfuse.ops.basic import Quantize
from jaxfuse.ops.basic import RMSNorm
from jaxfuse.ops.basic import ScaledActivation
from jaxfuse.ops.fuser import Fusion
from jaxfuse.ops.fuser import fusion_disabled
from jaxfuse.ops.fuser import register_fusion
from jaxfuse.ops.fuser import registered_fusions
from jaxfuse.ops.fuser import unregister_fusion
from jaxfuse.ops.linear_scale import linear_scale
from jaxfuse.ops.linen import Sequential
from jaxfuse.ops.sequential import explain
from jaxfuse.ops.sequential import fusion_plan
from jaxfuse.ops.sequential import fusions

__all__ = ["AddExtraInput", "BasicOp", "ConstantScale", "Fusion", "GroupedLinear", "Linear",
           "Quantize", "RMSNorm", "ScaledActivation", "Sequential", "explain", "fuser",
           "fusion_disabled", "fusion_plan", "fusions", "linear_scale", "linen", "nnx",
           "register_fusion",
           "registered_fusions", "sequential", "unregister_fusion"]
