"""Flax NNX Sequential: owns the parameters of its ops, applies fusions at trace time."""

from __future__ import annotations

from typing import Any

from flax import nnx

from jaxfuse.ops import sequential as sequential_lib


class Sequential(nnx.Module):
  """``Sequential(*ops, in_features=K, rngs=nnx.Rngs(0), fuse=True, implementation=None,
  return_extra=False)``: the NNX twin of ``jaxfuse.ops.linen.Sequential``.

  Parameters are ``nnx.Param`` attributes named ``op{i}_{name}`` (e.g. ``op0_kernel``).
  """

  def __init__(self, *ops, in_features: int, rngs: nnx.Rngs, fuse: bool = True,
               implementation: str | None = None, return_extra: bool = False):
    self.ops = sequential_lib.check_ops(ops)
    self.fuse = fuse
    self.implementation = implementation
    self.return_extra = return_extra
    key = rngs.params()
    params = sequential_lib.init_params(self.ops, key, in_features)
    self._names = tuple(tuple(sorted(p)) for p in params)
    for i, op_params in enumerate(params):
      for name, value in op_params.items():
        setattr(self, f"op{i}_{name}", nnx.Param(value))

  def params_tuple(self) -> tuple:
    return tuple({name: getattr(self, f"op{i}_{name}")[...] for name in names}
                 for i, names in enumerate(self._names))

  def __call__(self, x, **extras) -> Any:
    return sequential_lib.apply(self.ops, self.params_tuple(), x, fuse=self.fuse,
                                implementation=self.implementation,
                                return_extra=self.return_extra, **extras)

  def fusion_plan(self, x, **extras):
    return sequential_lib.fusion_plan(self.ops, x, fuse=self.fuse,
                                      implementation=self.implementation, **extras)

  def fusions(self, x, **extras):
    return sequential_lib.fusions(self.ops, x, fuse=self.fuse,
                                  implementation=self.implementation, **extras)

  def explain(self, x, **extras):
    return sequential_lib.explain(self.ops, x, implementation=self.implementation, **extras)
