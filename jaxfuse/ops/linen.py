"""Flax linen Sequential: owns the parameters of its ops, applies fusions at trace time."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from jaxfuse.ops import sequential as sequential_lib


class Sequential(nn.Module):
  """A model written as a sequence of basic ops, fused at trace time.

  ``Sequential(op0, op1, ..., fuse=True, implementation=None, return_extra=False)`` (or
  ``Sequential(ops=(op0, ...))``). Called as ``seq(x, residual=r, scales=s,
  group_sizes=g)`` with the extra inputs its ops read, by name. Parameters: one linen
  param per op that has any, named ``op{i}`` (a dict, e.g. ``{"kernel": ...}``), shaped
  from x's last dimension at init.

  Returns y, or ``(y, extra_outputs)`` with ``return_extra=True`` (see
  ``jaxfuse.ops.sequential``). ``fuse=False`` (or ``jaxfuse.ops.fusion_disabled()``) runs
  every op unfused, in plain jnp: the reference to compare fused results against.
  ``implementation`` (None, "ffi", "xla") is passed to the fused ops.
  """
  ops: tuple = ()
  fuse: bool = True
  implementation: Any = None
  return_extra: bool = False

  @nn.compact
  def __call__(self, x, **extras):
    ops = sequential_lib.check_ops(self.ops)
    shapes = sequential_lib.param_shapes(ops, x.shape[-1])
    params = []
    for i, (op, op_shapes) in enumerate(zip(ops, shapes)):
      if not op_shapes:
        params.append({})
        continue
      dtype = getattr(op, "param_dtype", None)

      def init(key, op_shapes=op_shapes, dtype=dtype):
        return {name: fn(jax.random.fold_in(key, j), shape, dtype)
                for j, (name, (shape, fn)) in enumerate(sorted(op_shapes.items()))}

      params.append(self.param(f"op{i}", init))
    return sequential_lib.apply(ops, tuple(params), x, fuse=self.fuse,
                                implementation=self.implementation,
                                return_extra=self.return_extra, **extras)

  def fusion_plan(self, x, **extras):
    """``[(name, op indices), ...]`` for every step (see ``jaxfuse.ops.sequential``)."""
    return sequential_lib.fusion_plan(self.ops, x, fuse=self.fuse,
                                      implementation=self.implementation, **extras)

  def fusions(self, x, **extras):
    """The fused windows only: ``[(fusion name, op indices), ...]``."""
    return sequential_lib.fusions(self.ops, x, fuse=self.fuse,
                                  implementation=self.implementation, **extras)

  def explain(self, x, **extras):
    """``[(op index, fusion name, reason or None), ...]``: why each fusion considered was
    refused (None: taken)."""
    return sequential_lib.explain(self.ops, x, implementation=self.implementation, **extras)


_generated_init = Sequential.__init__


def _init(self, *ops, **kwargs):
  """Accepts the ops positionally: Sequential(Linear(8), ConstantScale(0.5), ...)."""
  if ops:
    if "ops" in kwargs:
      raise TypeError("pass the ops either positionally or as ops=..., not both")
    if len(ops) == 1 and isinstance(ops[0], (tuple, list)):
      ops = tuple(ops[0])
    kwargs["ops"] = tuple(ops)
  elif "ops" in kwargs:
    kwargs["ops"] = tuple(kwargs["ops"])
  _generated_init(self, **kwargs)


Sequential.__init__ = _init
