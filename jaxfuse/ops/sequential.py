"""Functional core of Sequential: parameter init, apply with fusion, fusion plans.

The Flax modules (``jaxfuse.ops.linen.Sequential``, ``jaxfuse.ops.nnx.Sequential``) own the
parameters and call ``apply``; these functions can also be used directly with a tuple of
per-op parameter dicts.

Extra outputs: every AddExtraInput op produces its sum as an extra output under its extra
input's name (the new residual stream); a fused window that contains the add produces
the same value (e.g. AddRMSNorm's new residual, LinearScaleAdd's output). With
``return_extra=True`` the result is ``(y, {name: value, ...})``; otherwise just ``y``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse.ops import basic
from jaxfuse.ops import fuser


def check_ops(ops) -> tuple:
  ops = tuple(ops)
  if not ops:
    raise ValueError("Sequential needs at least one op")
  for i, op in enumerate(ops):
    if not isinstance(op, basic.BasicOp):
      raise TypeError(f"op {i} must be a jaxfuse.ops basic op (Linear, ConstantScale, ...), "
                      f"got {type(op).__name__}")
  return ops


def param_shapes(ops, in_features: int) -> tuple:
  """Per op: {name: (shape, init)}, following the widths through the sequence."""
  shapes = []
  width = in_features
  for op in ops:
    shapes.append(op.param_shapes(width))
    width = op.out_features(width)
  return tuple(shapes)


def init_params(ops, key, in_features: int) -> tuple:
  """One dict of freshly initialized parameters per op (in each op's param_dtype)."""
  ops = check_ops(ops)
  params = []
  for i, (op, shapes) in enumerate(zip(ops, param_shapes(ops, in_features))):
    op_key = jax.random.fold_in(key, i)
    dtype = getattr(op, "param_dtype", jnp.float32)
    params.append({name: init(jax.random.fold_in(op_key, j), shape, dtype)
                   for j, (name, (shape, init)) in enumerate(sorted(shapes.items()))})
  return tuple(params)


def apply(ops, params, x, *, fuse: bool = True, implementation: str | None = None,
          return_extra: bool = False, **extras):
  """Runs the ops on x, fused where a registered fusion applies (see ``jaxfuse.ops.fuser``)."""
  y, outputs = fuser.run(check_ops(ops), params, x, extras, fuse=fuse,
                         implementation=implementation)
  return (y, outputs) if return_extra else y


def _trace(ops, x, extras, *, fuse, implementation, plan=None, log=None):
  ops = check_ops(ops)
  in_features = jnp.shape(x)[-1]

  def trace(x, extras):
    params = init_params(ops, jax.random.key(0), in_features)
    fuser.run(ops, params, x, extras, fuse=fuse, implementation=implementation, plan=plan,
              log=log)

  jax.eval_shape(trace, x, extras)


def fusion_plan(ops, x, *, fuse: bool = True, implementation: str | None = None, **extras):
  """The steps a call would take, as a list of ``(name, op indices)``: a fusion's name for a
  fused window, the op's class name for an op run alone. Traced abstractly (nothing runs);
  x and extras may be arrays or ``jax.ShapeDtypeStruct``s."""
  plan = []
  _trace(ops, x, extras, fuse=fuse, implementation=implementation, plan=plan)
  return plan


def explain(ops, x, *, implementation: str | None = None, **extras):
  """Why fusions were taken or refused: ``[(op index, fusion name, reason), ...]`` for every
  fusion whose window matched where the scan looked; reason None for the one taken."""
  log = []
  _trace(ops, x, extras, fuse=True, implementation=implementation, log=log)
  return log


def fusions(ops, x, *, fuse: bool = True, implementation: str | None = None, **extras):
  """The fused windows only: ``[(fusion name, op indices), ...]``."""
  names = {f.name for f in fuser.registered_fusions()}
  return [step for step in fusion_plan(ops, x, fuse=fuse, implementation=implementation,
                                       **extras) if step[0] in names]
