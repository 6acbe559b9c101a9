"""The operation fuser: a registry of fusions and the trace-time scan over a sequence of ops.

A fusion declares

* ``window``: the op types it matches, in order (``isinstance`` per position);
* ``condition(ops, ctx)``: ``None`` when it applies to this window and these inputs, or a
  short reason why not (e.g. "AddExtraInput.in_place is False");
* ``apply(ops, params, x, extras, ctx)``: the fused computation, returning
  ``(y, extra_outputs)``; forward and backward are the fused jaxfuse op's custom_vjp.

``run`` scans the sequence left to right. At each position it tries the registered
fusions, longest window first (then registration order), and takes the first whose window
matches and whose condition holds; otherwise the op runs unfused. Conditions see the
actual (traced) input of the window, so shape and dtype conditions are checked at trace
time. The plan therefore depends on the input's shapes and dtypes, never on its values.

Registered fusions (``registered_fusions()``):

* ``GroupedMLP`` [GroupedLinear, ScaledActivation, GroupedLinear] -> ``jaxfuse.grouped_mlp``.
  This is how the FC1 -> activation pair gets its backward fusion (dact fused with FC1's
  backward): grouped_mlp's custom_vjp owns both GEMM pairs and the activation, with one
  set of group offsets. Both GroupedLinear ops must have the same ``recipe`` (None, or FP8:
  grouped_mlp's FP8 path, with the activation quantized by the fused
  ``scaled_activation_quantize`` and dact fused with the quantization of FC1's dgrad input).
* ``LinearScaleAdd`` [Linear, ConstantScale, AddExtraInput] -> ``jaxfuse.linear_scale_add``
  (TE's ForwardLinearScaleAdd + BackwardLinearScale): only when the add is in place and
  the linear is not row tensor-parallel.
* ``ScaledActivationQuantizeGroupedLinear`` [ScaledActivation, Quantize, GroupedLinear]
  with ``GroupedLinear.recipe=None``: activation and per-group FP8 fake quantization in one
  kernel (``jaxfuse.scaled_activation_quantize``), dequantized and fed to the 16-bit grouped
  GEMM with the same group offsets: exactly the unfused semantics (fake quantization, then a
  16-bit GEMM). Only Float8CurrentScaling(per_group=True) reading the GroupedLinear's group
  sizes.
* ``ScaledActivationQuantizeGroupedLinearFP8`` [ScaledActivation, Quantize, GroupedLinear]
  with ``GroupedLinear.recipe`` equal to the Quantize recipe
  (Float8CurrentScaling(per_group=True)): TE's fused MoE hand-off. Forward: one
  ``scaled_activation_quantize`` (the fp32 activation quantized to E4M3 per group), whose
  FP8 data and scales feed the FP8 grouped GEMM as they are (no dequantization, no
  re-quantization), the kernel quantized per expert as ``grouped_linear(recipe=...)`` does;
  offsets computed once for the whole step. Backward: FP8 dgrad (dy in E5M2 per group),
  FP8 wgrad from the saved FP8 activation and that FP8 dy (``recipe.fp8_wgrad``; else a
  16-bit wgrad from the FP8 activation dequantized), then the fused dact kernel
  (straight-through the quantization, as the unfused ops). Needs the activation width and
  the output width to be multiples of 16 and, with "ffi", a bfloat16/float16 x. The unfused ops agree to FP8 accuracy: re-quantizing the Quantize
  op's output with the same per-group current scaling is idempotent; the fused kernel
  quantizes the fp32 activation where the unfused ops quantize its 16-bit rounding.
* ``LinearScale`` [Linear, ConstantScale] -> ``jaxfuse.ops.linear_scale`` (alpha in the
  epilogue of the forward, dgrad and wgrad GEMMs: TE's BackwardLinearScale).
* ``AddRMSNorm`` [AddExtraInput, RMSNorm] -> ``jaxfuse.add_rms_norm``; the new residual
  is the add's extra output.
* ``ScaledActivationGroupedLinear`` [ScaledActivation, GroupedLinear(recipe=None)] -> the
  scaled activation kernel feeding ``grouped_linear_with_offsets`` (offsets from
  ``jaxfuse.group_offsets``, reused by the backward pass).
* ``ScaledActivationGroupedLinearFP8`` [ScaledActivation, GroupedLinear(recipe=FP8)]: the
  FP8 path above (the GroupedLinear quantizes its input anyway).
* ``GroupedLinearScaledActivation`` [GroupedLinear, ScaledActivation] (the backward fusion
  of FC1 and the activation outside a GroupedMLP): the grouped GEMM (16-bit or FP8 per
  the GroupedLinear's recipe) and the activation kernel on one set of offsets; backward:
  the fused dact kernel (FP8: ``scaled_dactivation_quantize``, whose per-group E5M2 dh
  feeds the FP8 dgrad and, with ``recipe.fp8_wgrad``, the FP8 wgrad directly; else dh in
  16-bit for wgrad), dgrad, wgrad. Refused when a
  GroupedLinear or Quantize follows the activation, so the activation's forward fusion
  with the next grouped GEMM (ScaledActivation[Quantize]GroupedLinear[FP8]) wins.

Each 16-bit / FP8 pair refuses the other's case with a reason naming the path that applies,
so ``explain`` and ``fusions()`` show which path was taken.

Fusion can be switched off per Sequential (``fuse=False``) or for a block of code with
``with jaxfuse.ops.fusion_disabled(): ...`` (read at trace time); ``jaxfuse.ops.explain``
lists, for each fusion considered, why it was refused.

The custom_vjps of the fused windows capture shard_map's varying axes in the forward pass
and give each cotangent its primal's (summing a replicated kernel's gradient over the
devices), as the jaxfuse ops do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxfuse._src import compat
from jaxfuse._src import implementation as implementation_lib
from jaxfuse._src.ops.group_offsets import api as offsets_api
from jaxfuse._src.ops.grouped_linear import api as grouped_linear_api
from jaxfuse._src.ops.grouped_linear import reference as grouped_linear_reference
from jaxfuse._src.ops.grouped_linear import sharding as grouped_linear_sharding
from jaxfuse._src.ops.grouped_mlp import api as grouped_mlp_api
from jaxfuse._src.ops.linear_scale_add import api as linear_scale_add_api
from jaxfuse._src.ops.quantize import api as quantize_api
from jaxfuse._src.ops.rms_norm import api as rms_norm_api
from jaxfuse._src.ops.scaled_activation import api as activation_api
from jaxfuse.ops import basic
from jaxfuse.ops.linear_scale import linear_scale

_FLOAT = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Context:
  """What a fusion's condition and apply see besides the ops: the window's input x (a
  tracer or an array), the Sequential's extra inputs and the resolved implementation."""
  x: Any
  extras: dict
  implementation: str
  # The ops from the window's first op to the end of the sequence (what follows the window
  # is remaining[len(window):]), for conditions that defer to a fusion further on.
  remaining: tuple = ()


@dataclasses.dataclass(frozen=True)
class Fusion:
  name: str
  window: tuple
  condition: Callable[[tuple, Context], str | None]
  apply: Callable
  description: str = ""

  def matches(self, ops) -> bool:
    return len(ops) == len(self.window) and all(
        isinstance(op, kind) for op, kind in zip(ops, self.window))


_REGISTRY: list[Fusion] = []


def register_fusion(fusion: Fusion) -> Fusion:
  """Adds a fusion (replacing one of the same name). Longer windows are tried first."""
  _REGISTRY[:] = [f for f in _REGISTRY if f.name != fusion.name]
  _REGISTRY.append(fusion)
  return fusion


def unregister_fusion(name: str) -> None:
  """Removes a registered fusion by name (KeyError if there is none)."""
  if not any(f.name == name for f in _REGISTRY):
    raise KeyError(f"no fusion named {name!r}; registered: {[f.name for f in _REGISTRY]}")
  _REGISTRY[:] = [f for f in _REGISTRY if f.name != name]


def registered_fusions() -> tuple[Fusion, ...]:
  """The fusions in the order the scan tries them (longest window first)."""
  order = {id(f): i for i, f in enumerate(_REGISTRY)}
  return tuple(sorted(_REGISTRY, key=lambda f: (-len(f.window), order[id(f)])))


_STATE = threading.local()


@contextlib.contextmanager
def fusion_disabled():
  """Within this block (at trace time) every Sequential runs its ops unfused."""
  previous = getattr(_STATE, "disabled", False)
  _STATE.disabled = True
  try:
    yield
  finally:
    _STATE.disabled = previous


def fusion_is_disabled() -> bool:
  return getattr(_STATE, "disabled", False)


# --- the scan ---------------------------------------------------------------------------


def check_extras(ops, extras: dict) -> None:
  needed = {name for op in ops for name in op.extra_inputs}
  unknown = sorted(set(extras) - needed)
  if unknown:
    raise ValueError(f"unexpected extra inputs {unknown}: the ops read {sorted(needed)}")
  missing = sorted(needed - set(extras))
  if missing:
    raise ValueError(f"missing extra inputs {missing}: pass them as keyword arguments, "
                     f"e.g. seq(x, {missing[0]}=...)")


def run(ops, params, x, extras: dict, *, fuse: bool = True, implementation: str | None = None,
        plan: list | None = None, log: list | None = None):
  """Applies ops (fused where a fusion applies) to x; returns (y, extra_outputs).

  params: one dict per op (``{}`` for ops without parameters). When ``plan`` is a list,
  the steps taken are appended to it as ``(name, indices)``: a fusion's name or, for an
  op run alone, its class name. When ``log`` is a list, every fusion whose window matched
  at a position the scan visited is appended as ``(index, name, reason)``, reason None
  for the one taken.
  """
  ops = tuple(ops)
  params = tuple(params)
  if len(params) != len(ops):
    raise ValueError(f"got {len(params)} parameter dicts for {len(ops)} ops")
  check_extras(ops, extras)
  implementation = implementation_lib.resolve(implementation)
  fuse = fuse and not fusion_is_disabled()
  fusions = registered_fusions() if fuse else ()
  outputs = {}
  i = 0
  while i < len(ops):
    ctx = Context(x=x, extras=extras, implementation=implementation, remaining=ops[i:])
    chosen = None
    for fusion in fusions:
      window = ops[i:i + len(fusion.window)]
      if not fusion.matches(window):
        continue
      reason = fusion.condition(window, ctx)
      if log is not None:
        log.append((i, fusion.name, reason))
      if reason is None:
        chosen = fusion
        break
    if chosen is not None:
      width = len(chosen.window)
      x, out = chosen.apply(ops[i:i + width], params[i:i + width], x, extras, ctx)
      step = (chosen.name, tuple(range(i, i + width)))
    else:
      width = 1
      if getattr(ops[i], "takes_implementation", False):
        x, out = ops[i].apply(params[i], x, extras, implementation=implementation)
      else:
        x, out = ops[i].apply(params[i], x, extras)
      step = (type(ops[i]).__name__, (i,))
    outputs.update(out)
    if plan is not None:
      plan.append(step)
    i += width
  return x, outputs


# --- helpers shared by conditions -------------------------------------------------------


def _dtype(value):
  return jnp.dtype(value.dtype)


def _float_input(x) -> str | None:
  if _dtype(x) not in _FLOAT:
    return f"x dtype {_dtype(x)} is not float32/bfloat16/float16"
  return None


def _grouped_ffi_ok(ctx: Context, widths) -> str | None:
  """jaxfuse's grouped GEMM kernels take 16-bit inputs with widths a multiple of 8."""
  if jnp.ndim(ctx.x) != 2:
    return f"grouped ops need x of rank 2 ([M, K]), got shape {jnp.shape(ctx.x)}"
  if ctx.implementation != "ffi":
    return None
  if _dtype(ctx.x) not in _HALF:
    return f"the grouped GEMM kernels take bfloat16/float16, x is {_dtype(ctx.x)}"
  for width in widths:
    if width % 8:
      return f"the grouped GEMM kernels need widths that are multiples of 8, got {width}"
  return None


def _scales_ok(ctx: Context, act: basic.ScaledActivation) -> str | None:
  scales = ctx.extras[act.scales]
  if tuple(jnp.shape(scales)) != tuple(jnp.shape(ctx.x)[:-1]):
    return f"scales shape {jnp.shape(scales)} is not x's leading shape"
  if _dtype(scales) not in (_dtype(ctx.x), jnp.dtype(jnp.float32)):
    return f"scales dtype {_dtype(scales)} is neither float32 nor x's dtype"
  return None


def _first_reason(*reasons):
  return next((r for r in reasons if r is not None), None)


def _fp8_ok(recipe, k: int, n: int, groups: int) -> str | None:
  """None for a 16-bit GEMM (recipe None) or an FP8 grouped GEMM [*, k] x [k, n] of
  `groups` experts the kernels can run (Float8CurrentScaling(per_group=True), E4M3 forward,
  k and n multiples of 16, at most 4096 groups with FP8 wgrads); otherwise grouped_linear's
  error message."""
  if recipe is None:
    return None
  try:
    grouped_linear_api.validate_fp8(recipe, k, n, "grouped_linear", groups=groups)
  except ValueError as e:
    return str(e)
  return None


def _kernel(params, x):
  return params["kernel"].astype(x.dtype)


def _act_kwargs(act: basic.ScaledActivation) -> dict:
  return dict(limit=act.limit, alpha=act.alpha, linear_offset=act.linear_offset)


# --- LinearScaleAdd ---------------------------------------------------------------------


def _linear_scale_add_condition(ops, ctx):
  linear, _, add = ops
  if not add.in_place:
    return "AddExtraInput.in_place is False"
  if linear.tensor_parallel == "row":
    return "row tensor-parallel linear (its output is reduced before the add)"
  residual = ctx.extras[add.name]
  expected = (*jnp.shape(ctx.x)[:-1], linear.features)
  if tuple(jnp.shape(residual)) != expected:
    return f"residual shape {jnp.shape(residual)} is not the linear's output shape {expected}"
  if _dtype(residual) not in (_dtype(ctx.x), jnp.dtype(jnp.float32)):
    return f"residual dtype {_dtype(residual)} is neither x's dtype nor float32"
  return _float_input(ctx.x)


def _linear_scale_add_apply(ops, params, x, extras, ctx):
  _, scale, add = ops
  y = linear_scale_add_api.linear_scale_add(x, _kernel(params[0], x), extras[add.name],
                                            float(scale.scale),
                                            implementation=ctx.implementation)
  return y, {add.name: y}


# --- LinearScale (BackwardLinearScale) --------------------------------------------------


def _linear_scale_condition(ops, ctx):
  return _first_reason(_float_input(ctx.x),
                       None if jnp.ndim(ctx.x) >= 1 else "x must have rank >= 1")


def _linear_scale_apply(ops, params, x, extras, ctx):
  linear, scale = ops
  y = linear_scale(x, _kernel(params[0], x), float(scale.scale),
                   implementation=ctx.implementation)
  return linear.reduce(y), {}


# --- AddRMSNorm -------------------------------------------------------------------------


def _add_rms_norm_condition(ops, ctx):
  add, _ = ops
  residual = ctx.extras[add.name]
  if tuple(jnp.shape(residual)) != tuple(jnp.shape(ctx.x)):
    return f"residual shape {jnp.shape(residual)} differs from x's {jnp.shape(ctx.x)}"
  if _dtype(residual) != _dtype(ctx.x):
    return f"residual dtype {_dtype(residual)} differs from x's {_dtype(ctx.x)}"
  return _first_reason(_float_input(ctx.x),
                       None if jnp.ndim(ctx.x) >= 1 else "x must have rank >= 1")


def _add_rms_norm_apply(ops, params, x, extras, ctx):
  add, norm = ops
  gamma = params[1]["gamma"]
  if _dtype(gamma) not in (_dtype(x), jnp.dtype(jnp.float32)):
    gamma = gamma.astype(jnp.float32)
  y, new_residual = rms_norm_api.add_rms_norm(
      x, extras[add.name], gamma, float(norm.eps),
      zero_centered_gamma=bool(norm.zero_centered_gamma), implementation=ctx.implementation)
  return y, {add.name: new_residual}


# --- grouped fusions ----------------------------------------------------------------------


def _grouped_mlp_condition(ops, ctx):
  fc1, act, fc2 = ops
  if fc1.group_sizes != fc2.group_sizes:
    return "the two GroupedLinear ops read different group sizes"
  if fc1.num_groups != fc2.num_groups:
    return "the two GroupedLinear ops have different numbers of groups"
  if fc1.recipe != fc2.recipe:
    return (f"the two GroupedLinear ops have different recipes ({fc1.recipe!r} and "
            f"{fc2.recipe!r}); grouped_mlp takes one recipe for both GEMMs")
  hidden = jnp.shape(ctx.x)[-1] if jnp.ndim(ctx.x) else 0
  try:
    ffn = act.out_features(fc1.features)
  except ValueError as e:
    return str(e)
  return _first_reason(_float_input(ctx.x),
                       _grouped_ffi_ok(ctx, (hidden, fc1.features, ffn, fc2.features)),
                       _fp8_ok(fc1.recipe, hidden, fc1.features, fc1.num_groups),
                       _fp8_ok(fc1.recipe, ffn, fc2.features, fc2.num_groups),
                       _scales_ok(ctx, act))


def _grouped_mlp_apply(ops, params, x, extras, ctx):
  fc1, act, fc2 = ops
  y = grouped_mlp_api.grouped_mlp(x, _kernel(params[0], x), _kernel(params[2], x),
                                  extras[fc1.group_sizes], extras[act.scales], act.activation,
                                  recipe=fc1.recipe, implementation=ctx.implementation,
                                  **_act_kwargs(act))
  return y, {}


def _activation_width(ops, ctx):
  """(width of the activation's output, None) or (None, reason)."""
  act = ops[0]
  reason = _first_reason(_float_input(ctx.x),
                         None if jnp.ndim(ctx.x) == 2 else "x must be [M, K]")
  if reason:
    return None, reason
  try:
    return act.out_features(jnp.shape(ctx.x)[-1]), None
  except ValueError as e:
    return None, str(e)


def _activation_grouped_linear_condition(ops, ctx):
  act, linear = ops
  if linear.recipe is not None:
    return ("GroupedLinear has an FP8 recipe: the FP8 path "
            "(ScaledActivationGroupedLinearFP8) applies instead")
  width, reason = _activation_width(ops, ctx)
  if reason:
    return reason
  return _first_reason(_grouped_ffi_ok(ctx, (width, linear.features)), _scales_ok(ctx, act))


def _activation_grouped_linear_apply(ops, params, x, extras, ctx):
  act, linear = ops
  scales, sizes = extras[act.scales], extras[linear.group_sizes]
  kernel = _kernel(params[1], x)
  if ctx.implementation == "xla":
    h = activation_api.scaled_activation(x, scales, act.activation, implementation="xla",
                                         **_act_kwargs(act))
    return grouped_linear_reference.grouped_linear(h, kernel, sizes), {}
  offsets = offsets_api.group_offsets(sizes, implementation="ffi")
  h = activation_api.scaled_activation(x, scales, act.activation, implementation="ffi",
                                       **_act_kwargs(act))
  varying_axes = tuple(compat.varying_axes(a) for a in (h, kernel, offsets))
  return grouped_linear_api.grouped_linear_with_offsets(h, kernel, offsets, varying_axes), {}


def _quantize_matches_linear(quant, linear) -> str | None:
  if quant.group_sizes != linear.group_sizes:
    return "Quantize and GroupedLinear read different group sizes"
  return None


def _activation_quantize_grouped_linear_condition(ops, ctx):
  from jaxfuse.quantization import Float8CurrentScaling  # pylint: disable=g-import-not-at-top
  act, quant, linear = ops
  recipe = quant.recipe
  if not (isinstance(recipe, Float8CurrentScaling) and recipe.per_group):
    return f"the Quantize recipe is not Float8CurrentScaling(per_group=True): {recipe!r}"
  if linear.recipe is not None:
    return ("GroupedLinear has an FP8 recipe: the FP8 path "
            "(ScaledActivationQuantizeGroupedLinearFP8) applies instead")
  return _first_reason(_quantize_matches_linear(quant, linear),
                       _activation_grouped_linear_condition((act, linear), ctx))


def _fp8_activation_condition(act, linear, ctx) -> str | None:
  """The FP8 path: scaled_activation_quantize feeding the FP8 grouped GEMM."""
  width, reason = _activation_width((act, linear), ctx)
  if reason:
    return reason
  if ctx.implementation == "ffi" and _dtype(ctx.x) not in _HALF:
    return f"the FP8 grouped GEMM kernels take bfloat16/float16 x, x is {_dtype(ctx.x)}"
  return _first_reason(_fp8_ok(linear.recipe, width, linear.features, linear.num_groups),
                       _scales_ok(ctx, act))


def _activation_quantize_grouped_linear_fp8_condition(ops, ctx):
  act, quant, linear = ops
  if linear.recipe is None:
    return ("GroupedLinear.recipe is None (16-bit GEMM): the dequantizing path "
            "(ScaledActivationQuantizeGroupedLinear) applies instead")
  if quant.recipe != linear.recipe:
    return (f"the Quantize recipe {quant.recipe!r} differs from the GroupedLinear recipe "
            f"{linear.recipe!r}")
  return _first_reason(_quantize_matches_linear(quant, linear),
                       _fp8_activation_condition(act, linear, ctx))


def _activation_grouped_linear_fp8_condition(ops, ctx):
  act, linear = ops
  if linear.recipe is None:
    return "GroupedLinear.recipe is None (16-bit GEMM)"
  return _fp8_activation_condition(act, linear, ctx)


def _varying(*values):
  return tuple(compat.varying_axes(v) for v in values)


def _match(values, axes):
  return tuple(compat.match_varying_axes(v, a) for v, a in zip(values, axes))


def _activation_vjp(act, x, scales, dh, implementation, varying_axes):
  """(dx, dscales) of scaled_activation at (x, scales) for the cotangent dh: the fused
  backward kernel ("ffi") or autodiff of the jnp reference ("xla")."""
  if implementation == "xla":
    _, act_vjp = jax.vjp(lambda a, s: activation_api.scaled_activation(
        a, s, act.activation, implementation="xla", **_act_kwargs(act)), x, scales)
    return act_vjp(dh.astype(x.dtype))
  return activation_api._backward(  # pylint: disable=protected-access
      act.activation, act.limit, act.alpha, act.linear_offset, varying_axes[:2], (x, scales),
      dh.astype(x.dtype))


# 16-bit path: activation + per-group fake quantization in one kernel, 16-bit grouped GEMM.


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _act_quant_grouped_linear(x, scales, kernel, offsets, act, recipe, implementation,
                              varying_axes):
  return _aqgl_forward(x, scales, kernel, offsets, act, recipe, implementation,
                       varying_axes)[0]


def _aqgl_forward(x, scales, kernel, offsets, act, recipe, implementation, varying_axes):
  del varying_axes
  q = quantize_api.scaled_activation_quantize(
      x, scales, activation=act.activation, recipe=recipe, group_offsets=offsets,
      implementation=implementation, **_act_kwargs(act))
  h = quantize_api.dequantize(q).astype(x.dtype)
  if implementation == "xla":
    y = grouped_linear_reference.grouped_linear(
        h, kernel, jnp.diff(offsets))
  else:
    y = grouped_linear_sharding.grouped_gemm(h, kernel, offsets,
                                            form=grouped_linear_api.ffi.FORWARD)
  return y, (x, scales, kernel, offsets, h)


def _aqgl_backward(act, recipe, implementation, varying_axes, saved, dy):
  del recipe
  x, scales, kernel, offsets, h = saved
  dy = dy.astype(x.dtype)
  if implementation == "xla":
    _, gemm_vjp = jax.vjp(
        lambda a, w: grouped_linear_reference.grouped_linear(a, w, jnp.diff(offsets)), h, kernel)
    dh, d_kernel = gemm_vjp(dy)
  else:
    ffi = grouped_linear_api.ffi
    dh = grouped_linear_sharding.grouped_gemm(dy, kernel, offsets, form=ffi.DGRAD)
    d_kernel = grouped_linear_sharding.grouped_gemm(h, dy, offsets, form=ffi.WGRAD)
  # The activation's gradient is straight-through the quantization (as the unfused
  # Quantize op): the fused dact kernel at x with the dequantized activation's cotangent.
  dx, d_scales = _activation_vjp(act, x, scales, dh, implementation, varying_axes)
  return (*_match((dx, d_scales, d_kernel), varying_axes), None)


_act_quant_grouped_linear.defvjp(_aqgl_forward, _aqgl_backward)


def _activation_quantize_grouped_linear_apply(ops, params, x, extras, ctx):
  act, quant, linear = ops
  kernel = _kernel(params[2], x)
  scales = extras[act.scales]
  offsets = offsets_api.group_offsets(extras[linear.group_sizes],
                                      implementation=ctx.implementation)
  y = _act_quant_grouped_linear(x, scales, kernel, offsets, act, quant.recipe,
                                ctx.implementation, _varying(x, scales, kernel))
  return y, {}


# FP8 path: activation + per-group FP8 quantization in one kernel (one QuantizedArray), fed
# as it is to the FP8 grouped GEMM; the kernel quantized per expert as grouped_linear does.


def _fp8_gemm_reference(a_data, a_scale_inv, w_t_data, w_scale_inv, offsets, dtype):
  """What the FP8 forward kernel computes (grouped_linear's reference), rounded once to
  bfloat16; rows past the groups are zero."""
  exact, _ = grouped_linear_reference.fp8_products(
      a_data, a_scale_inv, w_t_data, w_scale_inv, jnp.minimum(offsets, a_data.shape[0]))
  return exact.astype(jnp.bfloat16).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _act_quant_grouped_linear_fp8(x, scales, kernel, offsets, act, recipe, implementation,
                                  varying_axes):
  return _aqgl8_forward(x, scales, kernel, offsets, act, recipe, implementation,
                        varying_axes, for_backward=False)[0]


def _aqgl8_forward(x, scales, kernel, offsets, act, recipe, implementation, varying_axes,
                   for_backward=True):
  """(y, residuals); the primal call (no VJP follows) skips the kernel's untransposed FP8
  copy, which only dgrad reads."""
  del varying_axes
  # One pass over x: act(x) * scales in fp32, quantized to E4M3 per group (never rounded
  # to 16-bit, never dequantized).
  q = quantize_api.scaled_activation_quantize(
      x, scales, activation=act.activation, recipe=recipe, group_offsets=offsets,
      implementation=implementation, **_act_kwargs(act))
  # The FP8 kernel as [G, N, K] for the forward and [G, K, N] for dgrad, from one pass.
  w_t, w_scale_inv, *w = grouped_linear_reference.quantize_experts_t(
      kernel, recipe, implementation, untransposed=for_backward)
  if implementation == "xla":
    y = _fp8_gemm_reference(q.data, q.scale_inv, w_t, w_scale_inv, offsets, x.dtype)
  else:
    y = grouped_linear_api.fp8_gemm(q.data, q.scale_inv, w_t, w_scale_inv, offsets,
                                    grouped_linear_api.ffi.FORWARD, x.dtype, recipe)
  if not for_backward:
    return y, None
  return y, (x, scales, q, w[0], w_scale_inv, offsets, kernel if implementation == "xla"
             else None)


def _aqgl8_backward(act, recipe, implementation, varying_axes, saved, dy):
  x, scales, q, w, w_scale_inv, offsets, kernel = saved
  dy = dy.astype(x.dtype)
  if implementation == "xla":
    # The 16-bit activation: the FP8 activation dequantized, i.e. what the unfused
    # GroupedLinear saves (its input, the Quantize op's output).
    h = quantize_api.dequantize(q).astype(x.dtype)
    # The jnp FP8 reference's gradients: straight-through the quantization of h and the
    # kernel (the products of the dequantized operands).
    _, gemm_vjp = jax.vjp(lambda a, w: grouped_linear_reference.grouped_linear_fp8(
        a, w, jnp.diff(jnp.minimum(offsets, x.shape[0])), recipe), h, kernel)
    dh, d_kernel = gemm_vjp(dy)
  else:
    # FP8 dgrad as grouped_linear's: dy in E5M2 per group, the saved FP8 kernel.
    dh, dy_fp8 = grouped_linear_api.fp8_dgrad(dy, w, w_scale_inv, offsets, recipe, x.dtype)
    if recipe.fp8_wgrad:
      # FP8 wgrad as grouped_linear's: the saved FP8 activation (the unfused GroupedLinear
      # re-quantizes the Quantize op's output to the same values) and the FP8 dy.
      d_kernel = grouped_linear_api.fp8_wgrad((q.data, q.scale_inv), dy_fp8, offsets,
                                              x.dtype, rows=dy.shape[0])
    else:
      # 16-bit wgrad from the FP8 activation dequantized (what the unfused op saves).
      h = quantize_api.dequantize(q).astype(x.dtype)
      d_kernel = grouped_linear_sharding.grouped_gemm(h, dy, offsets,
                                                      form=grouped_linear_api.ffi.WGRAD)
  # Straight-through the quantization of the activation (the unfused Quantize op and
  # grouped_linear's FP8 input): the fused dact kernel at x. dx is not quantized: the op
  # before the window decides its own precision.
  dx, d_scales = _activation_vjp(act, x, scales, dh, implementation, varying_axes)
  return (*_match((dx, d_scales, d_kernel), varying_axes), None)


_act_quant_grouped_linear_fp8.defvjp(_aqgl8_forward, _aqgl8_backward)


def _fp8_activation_apply(act, linear, params, x, extras, ctx):
  kernel = _kernel(params, x)
  scales = extras[act.scales]
  # Offsets once: the fused quantization, the FP8 GEMM and, in the backward pass, the
  # quantization of dy, dgrad and wgrad all read them.
  offsets = offsets_api.group_offsets(extras[linear.group_sizes],
                                      implementation=ctx.implementation)
  y = _act_quant_grouped_linear_fp8(x, scales, kernel, offsets, act, linear.recipe,
                                    ctx.implementation, _varying(x, scales, kernel))
  return y, {}


def _activation_quantize_grouped_linear_fp8_apply(ops, params, x, extras, ctx):
  act, _, linear = ops
  return _fp8_activation_apply(act, linear, params[2], x, extras, ctx)


def _activation_grouped_linear_fp8_apply(ops, params, x, extras, ctx):
  act, linear = ops
  return _fp8_activation_apply(act, linear, params[1], x, extras, ctx)


# --- GroupedLinearScaledActivation (backward: dact fused with the GEMM's backward) -------


def _grouped_linear_activation_condition(ops, ctx):
  linear, act = ops
  following = ctx.remaining[len(ops):]
  if following and isinstance(following[0], (basic.GroupedLinear, basic.Quantize)):
    return (f"the activation is followed by {type(following[0]).__name__}: its forward "
            "fusion with the next grouped GEMM (ScaledActivation[Quantize]GroupedLinear) "
            "is preferred")
  reason = _first_reason(_float_input(ctx.x),
                         None if jnp.ndim(ctx.x) == 2 else "x must be [M, K]")
  if reason:
    return reason
  k = jnp.shape(ctx.x)[-1]
  try:
    width = act.out_features(linear.features)
  except ValueError as e:
    return str(e)
  reason = _first_reason(_grouped_ffi_ok(ctx, (k, linear.features, width)),
                         _fp8_ok(linear.recipe, k, linear.features, linear.num_groups),
                         _scales_ok(ctx, act))
  if reason is None and linear.recipe is not None and ctx.implementation == "ffi" and \
      _dtype(ctx.x) not in _HALF:
    reason = f"the FP8 grouped GEMM kernels take bfloat16/float16 x, x is {_dtype(ctx.x)}"
  return reason


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _grouped_linear_act(x, kernel, scales, offsets, act, recipe, varying_axes):
  return _glact_forward(x, kernel, scales, offsets, act, recipe, varying_axes,
                        for_backward=False)[0]


def _glact_forward(x, kernel, scales, offsets, act, recipe, varying_axes, for_backward=True):
  """(a, residuals); the primal call (no VJP follows) skips the kernel's untransposed FP8
  copy, which only dgrad reads."""
  del varying_axes
  ffi = grouped_linear_api.ffi
  if recipe is None:
    h = grouped_linear_sharding.grouped_gemm(x, kernel, offsets, form=ffi.FORWARD)
    weights = (kernel,)
  else:
    x_data, x_scale_inv = grouped_linear_reference.quantize_rows(x, recipe, offsets,
                                                                 "forward", "ffi")
    w_t, w_scale_inv, *w = grouped_linear_reference.quantize_experts_t(
        kernel, recipe, "ffi", untransposed=for_backward)
    h = grouped_linear_api.fp8_gemm(x_data, x_scale_inv, w_t, w_scale_inv, offsets,
                                    ffi.FORWARD, x.dtype, recipe)
    weights = (w[0], w_scale_inv) if for_backward else None
    if recipe.fp8_wgrad:  # the FP8 wgrad reads the FP8 x, as grouped_linear's does
      x = (x_data, x_scale_inv)
  a = activation_api.scaled_activation(h, scales, act.activation, implementation="ffi",
                                       **_act_kwargs(act))
  return a, (x, weights, scales, offsets, h)


def _glact_backward(act, recipe, varying_axes, saved, da):
  x, weights, scales, offsets, h = saved
  ffi = grouped_linear_api.ffi
  x_axes, _, s_axes = varying_axes
  if recipe is None:
    # One fused dact kernel, then dgrad and wgrad on the forward's offsets.
    dh, d_scales = activation_api._backward(  # pylint: disable=protected-access
        act.activation, act.limit, act.alpha, act.linear_offset, (x_axes, s_axes),
        (h, scales), da.astype(h.dtype))
    dx = grouped_linear_sharding.grouped_gemm(dh, weights[0], offsets, form=ffi.DGRAD)
    d_kernel = grouped_linear_sharding.grouped_gemm(x, dh, offsets, form=ffi.WGRAD)
  else:
    # dact fused with the per-group E5M2 quantization of dh: the FP8 dgrad's input comes
    # out of the activation backward kernel (TE's dact + quantize). The wgrad reads that
    # FP8 dh and the forward's FP8 x (recipe.fp8_wgrad), else dh and x in 16-bit.
    w, w_scale_inv = weights
    dtype = h.dtype  # x's
    dh_q, dh, d_scales = quantize_api.scaled_dactivation_quantize(
        da, h, scales, activation=act.activation, recipe=recipe, group_offsets=offsets,
        return_dx=not recipe.fp8_wgrad, implementation="ffi", **_act_kwargs(act))
    dx = grouped_linear_api.fp8_gemm(dh_q.data, dh_q.scale_inv, w, w_scale_inv, offsets,
                                     ffi.DGRAD, dtype, recipe)
    if recipe.fp8_wgrad:
      d_kernel = grouped_linear_api.fp8_wgrad(x, (dh_q.data, dh_q.scale_inv), offsets, dtype,
                                              rows=h.shape[0])
    else:
      d_kernel = grouped_linear_sharding.grouped_gemm(x, dh, offsets, form=ffi.WGRAD)
  return (*_match((dx, d_kernel, d_scales.astype(scales.dtype)), varying_axes), None)


_grouped_linear_act.defvjp(_glact_forward, _glact_backward)


def _grouped_linear_activation_apply(ops, params, x, extras, ctx):
  linear, act = ops
  if ctx.implementation == "xla":  # the references: the unfused ops
    h, _ = linear.apply(params[0], x, extras, implementation="xla")
    return act.apply(params[1], h, extras)
  kernel = _kernel(params[0], x)
  scales = extras[act.scales]
  offsets = offsets_api.group_offsets(extras[linear.group_sizes], implementation="ffi")
  y = _grouped_linear_act(x, kernel, scales, offsets, act, linear.recipe,
                          _varying(x, kernel, scales))
  return y, {}


# --- registration -------------------------------------------------------------------------

register_fusion(Fusion(
    "GroupedMLP", (basic.GroupedLinear, basic.ScaledActivation, basic.GroupedLinear),
    _grouped_mlp_condition, _grouped_mlp_apply,
    "FC1 -> scaled activation -> FC2 as jaxfuse.grouped_mlp (one custom_vjp, shared offsets)"))
register_fusion(Fusion(
    "LinearScaleAdd", (basic.Linear, basic.ConstantScale, basic.AddExtraInput),
    _linear_scale_add_condition, _linear_scale_add_apply,
    "TE ForwardLinearScaleAdd / BackwardLinearScale: jaxfuse.linear_scale_add"))
register_fusion(Fusion(
    "ScaledActivationQuantizeGroupedLinear",
    (basic.ScaledActivation, basic.Quantize, basic.GroupedLinear),
    _activation_quantize_grouped_linear_condition, _activation_quantize_grouped_linear_apply,
    "fused activation + per-group FP8 quantization feeding the grouped GEMM"))
register_fusion(Fusion(
    "ScaledActivationQuantizeGroupedLinearFP8",
    (basic.ScaledActivation, basic.Quantize, basic.GroupedLinear),
    _activation_quantize_grouped_linear_fp8_condition,
    _activation_quantize_grouped_linear_fp8_apply,
    "fused activation + per-group FP8 quantization feeding the FP8 grouped GEMM directly"))
register_fusion(Fusion(
    "LinearScale", (basic.Linear, basic.ConstantScale),
    _linear_scale_condition, _linear_scale_apply,
    "TE BackwardLinearScale: alpha in the epilogues of the forward, dgrad and wgrad GEMMs"))
register_fusion(Fusion(
    "AddRMSNorm", (basic.AddExtraInput, basic.RMSNorm),
    _add_rms_norm_condition, _add_rms_norm_apply,
    "residual add + RMSNorm as jaxfuse.add_rms_norm (new residual as an extra output)"))
register_fusion(Fusion(
    "ScaledActivationGroupedLinear", (basic.ScaledActivation, basic.GroupedLinear),
    _activation_grouped_linear_condition, _activation_grouped_linear_apply,
    "scaled activation kernel feeding the grouped GEMM (offsets computed once)"))
register_fusion(Fusion(
    "ScaledActivationGroupedLinearFP8", (basic.ScaledActivation, basic.GroupedLinear),
    _activation_grouped_linear_fp8_condition, _activation_grouped_linear_fp8_apply,
    "fused activation + per-group FP8 quantization feeding the FP8 grouped GEMM "
    "(GroupedLinear with an FP8 recipe)"))
register_fusion(Fusion(
    "GroupedLinearScaledActivation", (basic.GroupedLinear, basic.ScaledActivation),
    _grouped_linear_activation_condition, _grouped_linear_activation_apply,
    "grouped GEMM (16-bit or FP8) + scaled activation; backward: fused dact (+ E5M2 "
    "quantization feeding the FP8 dgrad), dgrad and wgrad on the forward's offsets"))
