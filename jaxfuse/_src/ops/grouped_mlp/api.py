"""Public grouped_mlp: the expert MLP of a mixture-of-experts layer as one custom_vjp.

    h = FC1(x)                      grouped GEMM, kernel1 [G, H, W]
    a = act(h) * scales[:, None]    fused scaled activation
    y = FC2(a)                      grouped GEMM, kernel2 [G, F, H]

The group sizes become offsets once per step (one ``group_offsets`` launch); the six
grouped GEMMs of the forward and backward passes (FC1 fwd, FC2 fwd, FC2 dgrad, FC2 wgrad,
FC1 dgrad, FC1 wgrad) all read those offsets. The backward pass is

    da      = FC2 dgrad(dy)                      dy @ kernel2[g]^T
    a       = act(h) * scales                    recomputed (or saved: save_activation=True)
    dk2     = FC2 wgrad(a, dy)
    dh, ds  = fused scaled activation backward   (da, h, scales) -> d(h), d(scales)
    dx      = FC1 dgrad(dh),  dk1 = FC1 wgrad(x, dh)

Residuals: x, the kernels, the offsets, scales and h (FC1's output, pre-activation); the
activation is recomputed in the backward pass unless ``save_activation=True`` keeps it too.

An FP8 recipe swaps three pieces (see ``Fp8Stages``): the GEMM inputs are quantized per group,
the activation hand-off to FC2 is the fused ``scaled_activation_quantize`` and the backward
activation is the fused ``scaled_dactivation_quantize`` feeding FC1's dgrad and wgrad.
Weight gradients run in FP8 from those same FP8 tensors (``recipe.fp8_wgrad``, the
default) or in 16-bit. Float8BlockScaling (``_Blockwise``) runs the blockwise FP8 GEMMs
through the same fused activation stages, with 16-bit weight gradients (FP8 ones from
128 x 1 blocks with ``fp8_wgrad=True``).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxfuse._src import checks
from jaxfuse._src import compat
from jaxfuse._src import implementation as implementation_lib
from jaxfuse._src.ops.group_offsets import api as offsets_api
from jaxfuse._src.ops.grouped_linear import api as linear_api
from jaxfuse._src.ops.grouped_linear import ffi as gemm_ffi
from jaxfuse._src.ops.grouped_linear import sharding as gemm_sharding
from jaxfuse._src.ops.grouped_mlp import reference
from jaxfuse._src.ops.quantize import api as quantize_api
from jaxfuse._src.ops.quantize import columnwise as quantize_columnwise
from jaxfuse._src.ops.quantize import kernels as quantized_kernels
from jaxfuse._src.ops.scaled_activation import sharding as act_sharding
from jaxfuse._src.ops.scaled_activation import reference as act_reference
from jaxfuse.quantization import recipes

_FFI_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_ALIGNMENT_ELEMENTS = 8


class Config(NamedTuple):
  """Static (hashable) settings of one grouped_mlp call."""
  activation: str
  limit: float
  alpha: float
  linear_offset: float
  save_activation: bool
  recipe: object = None
  # Which of (kernel1, kernel2) are frozen quantize_experts results: used as given, no
  # gradient (a trainable one's gradient goes to its master).
  frozen_kernels: tuple = (False, False)
  # FC1 and the scaled activation from one kernel (grouped_gemm_gated; see _gated_fc1).
  gated_fc1: bool = False

  @property
  def act_kwargs(self) -> dict:
    return dict(activation=self.activation, limit=self.limit, alpha=self.alpha,
                linear_offset=self.linear_offset)


def _validate(x, kernel1, kernel2, group_sizes, scales, activation, recipe,
              implementation) -> None:
  if activation not in act_reference.ACTIVATIONS:
    raise ValueError(f"activation must be one of {act_reference.ACTIVATIONS}, got {activation!r}")
  x_dtype = checks.check_float_array("x", x)
  shapes = {}
  for name, value in (("kernel1", kernel1), ("kernel2", kernel2)):
    dtype, shapes[name] = linear_api.kernel_facts(name, value)
    if dtype != x_dtype:
      raise TypeError(f"{name} dtype {dtype} must equal x dtype {x_dtype}"
                      + linear_api.QUANTIZED_DTYPE_HINT * linear_api.is_quantized_kernel(value))
  scales_dtype = checks.check_float_array("scales", scales)
  checks.check_rank("x", x, 2, "[M, H]")
  checks.check_rank("scales", scales, 1, "[M]")
  offsets_api.check_group_sizes(group_sizes)
  m, hidden = x.shape
  groups, k1_in, width = shapes["kernel1"]
  glu = activation in act_reference.GLU
  if groups < 1:
    raise ValueError("kernel1 must have at least one group (kernel1.shape[0] >= 1)")
  if k1_in != hidden:
    raise ValueError(f"kernel1.shape[1] ({k1_in}) must equal x's last dimension ({hidden}); "
                     f"x is {x.shape}, kernel1 is {shapes['kernel1']}")
  if glu and width % 2:
    raise ValueError(f"kernel1.shape[2] must be even (2F: gate then linear half) for "
                     f"{activation}, got {width}")
  ffn = width // 2 if glu else width
  if shapes["kernel2"] != (groups, ffn, hidden):
    raise ValueError(f"kernel2 must have shape {(groups, ffn, hidden)} ([G, F, H] with F = "
                     f"{'kernel1.shape[2] // 2' if glu else 'kernel1.shape[2]'}), got "
                     f"{shapes['kernel2']}")
  if tuple(group_sizes.shape) != (groups,):
    raise ValueError(f"group_sizes must have shape ({groups},) (kernel1.shape[0] groups), "
                     f"got {tuple(group_sizes.shape)}")
  if tuple(scales.shape) != (m,):
    raise ValueError(f"scales must have shape ({m},) (one value per row of x), got "
                     f"{tuple(scales.shape)}")
  if scales_dtype not in (jnp.dtype(jnp.float32), x_dtype):
    raise TypeError(f"scales dtype must be float32 or x's dtype ({x_dtype}), got {scales_dtype}")
  for name, value in (("kernel1", kernel1), ("kernel2", kernel2)):
    linear_api.check_kernel_mode(name, value, recipe)
  if isinstance(recipe, recipes.Float8BlockScaling):
    _Blockwise.check(recipe, hidden, width, ffn)
  elif recipe is not None:
    Fp8Stages.check(recipe, hidden, width, ffn, groups if implementation == "ffi" else 1)
  if implementation == "ffi":
    if x_dtype not in _FFI_DTYPES:
      raise TypeError(f"grouped_mlp's kernels take bfloat16 or float16 x, got {x_dtype}; "
                      "cast x and the kernels, or pass implementation='xla'")
    for name, size in (("H (x.shape[1])", hidden), ("kernel1.shape[2]", width),
                       ("F (kernel2.shape[1])", ffn)):
      if size % _ALIGNMENT_ELEMENTS:
        raise ValueError(f"grouped_mlp needs {name} to be a multiple of {_ALIGNMENT_ELEMENTS} "
                         f"for 16-bit inputs (16-byte aligned rows for TMA), got {size}; pad "
                         "it, or pass implementation='xla'")


def _gemm(a, b, offsets, form):
  return gemm_sharding.grouped_gemm(a, b, offsets, form=form)


# JAXFUSE_GROUPED_MLP_GATED_FC1=1 turns the gated FC1 kernel on (default: off, FC1 then the
# scaled activation kernel); read when a call is traced. Off by default until a GPU run has
# checked the kernel as it stands and measured it faster (cuda/gpu/grouped_gemm/README.md,
# "The gated FC1").
GATED_FC1_ENV = "JAXFUSE_GROUPED_MLP_GATED_FC1"
GATED_FC1_DEFAULT = "0"


def _gated_fc1(x, kernel1, activation, recipe, implementation) -> bool:
  """Whether FC1 and the activation run as one kernel: the 16-bit FFI path with bfloat16
  operands, a gated activation and 2F a multiple of 256 (grouped_linear ffi.supports_gated),
  when JAXFUSE_GROUPED_MLP_GATED_FC1 is 1."""
  if implementation != "ffi" or recipe is not None:
    return False
  if os.environ.get(GATED_FC1_ENV, GATED_FC1_DEFAULT) != "1":
    return False
  return gemm_ffi.supports_gated(x, kernel1, activation)


def _fc1(x, kernel1, group_offsets, scales, config: Config):
  """(h, a): FC1's output and its scaled activation, from one kernel where config says."""
  if config.gated_fc1:
    return gemm_sharding.grouped_gemm_gated(x, kernel1, group_offsets, scales,
                                            **config.act_kwargs)
  h = _gemm(x, kernel1, group_offsets, gemm_ffi.FORWARD)
  return h, _activation(h, scales, config)


def _activation(h, scales, config: Config):
  return act_sharding.forward(h, scales, **config.act_kwargs)


class Fp8Stages:
  """The FP8 (Float8CurrentScaling(per_group=True)) variant of the three fused stages.

    forward:  x_q = quantize(x, per group, E4M3), w1_q = per-expert quantize(kernel1^T);
              h = FP8 grouped GEMM(x_q, w1_q)                          (16-bit h, saved)
              a_q = scaled_activation_quantize(h, scales, offsets)    (one fused op: the
                    activation in fp32 quantized per group, never rounded to 16-bit)
              y = FP8 grouped GEMM(a_q, per-expert quantize(kernel2^T))
    backward: dy_q = quantize(dy, per group, E5M2);
              da = FP8 FC2 dgrad(dy_q, w2_q^T)      (the saved FP8 kernel2^T transposed back)
              dh_q, ds = scaled_dactivation_quantize(da, h, scales)
              dx = FP8 FC1 dgrad(dh_q, w1_q^T)
              dk2 = FP8 wgrad(a_q, dy_q), dk1 = FP8 wgrad(x_q, dh_q)

  recipe.fp8_wgrad (the default) runs the weight gradients in FP8 as above, as
  TransformerEngine's Hopper recipe does: the forward's x_q and a_q are saved instead of the
  16-bit x (no activation recompute), and the wgrad kernels read column-wise copies of the
  FP8 tensors. With fp8_wgrad=False they run in 16-bit: dk2 = wgrad(act(h) * scales, dy)
  (the activation recomputed, or saved with save_activation=True) and dk1 = wgrad(x, dh),
  dh from the same fused kernel (return_dx=True).
  """

  @staticmethod
  def check(recipe, hidden: int, width: int, ffn: int, groups: int) -> None:
    linear_api.validate_fp8(recipe, hidden, width, "grouped_mlp",
                            ("H (x.shape[1])", "kernel1.shape[2]"), groups, blockwise_too=True)
    linear_api.validate_fp8(recipe, ffn, hidden, "grouped_mlp",
                            ("F (kernel2.shape[1])", "H (x.shape[1])"), groups,
                            blockwise_too=True)

  @staticmethod
  def forward(x, kernel1, kernel2, group_offsets, scales, config, for_backward=True,
              x_quantized=None):
    """(y, residuals). ``x_quantized``: x's (data, scale_inv, wgrad operand) triple made by
    the caller (as quantize_columnwise.quantize_rows; recipe.fp8_wgrad only), x then only
    gives the dtype (the MoE layer's gathered tokens: moe/fp8_experts.py)."""
    recipe = config.recipe
    frozen1, frozen2 = config.frozen_kernels
    # The wgrads' column-wise copies of x and the activation from the quantizing passes
    # (quantize/columnwise.py) when a backward with FP8 wgrads follows.
    fuse = for_backward and quantize_columnwise.fuses(recipe)
    if x_quantized is None:
      x_quantized = quantize_columnwise.quantize_rows(x, recipe, group_offsets, "forward",
                                                      copy=fuse and not frozen1)
    elif not recipe.fp8_wgrad:
      raise ValueError("a pre-quantized x needs recipe.fp8_wgrad (the 16-bit wgrad reads x)")
    x_data, x_scale_inv, x_fp8 = x_quantized
    # Each weight's FP8 values in both layouts from one pass when a backward follows:
    # [G, N, K] for the forward, [G, K, N] saved for the backward's dgrad.
    w1_t, w1_scale_inv, *w1 = linear_api.expert_weights(kernel1, recipe,
                                                        untransposed=for_backward)
    h = linear_api.fp8_gemm(x_data, x_scale_inv, w1_t, w1_scale_inv, group_offsets,
                            gemm_ffi.FORWARD, x.dtype, recipe)
    a_data, a_scale_inv, a_fp8 = quantize_columnwise.scaled_activation_quantize(
        h, scales, group_offsets, recipe, copy=fuse and not frozen2, **config.act_kwargs)
    w2_t, w2_scale_inv, *w2 = linear_api.expert_weights(kernel2, recipe,
                                                        untransposed=for_backward)
    y = linear_api.fp8_gemm(a_data, a_scale_inv, w2_t, w2_scale_inv, group_offsets,
                            gemm_ffi.FORWARD, x.dtype, recipe)
    if not for_backward:
      return y, None
    if recipe.fp8_wgrad:  # the wgrads read the FP8 x and activation
      x_saved, a_saved = x_fp8, a_fp8
    else:
      x_saved = x
      a_saved = _activation(h, scales, config) if config.save_activation else None
    # A frozen quantized kernel gets no gradient: its wgrad's input need not be kept.
    x_saved = None if frozen1 else x_saved
    a_saved = None if frozen2 else a_saved
    templates = tuple(quantized_kernels.cotangent_template(k) for k in (kernel1, kernel2))
    return y, (x_saved, w1[0], w1_scale_inv, w2[0], w2_scale_inv, group_offsets, scales, h,
               a_saved, templates)

  @staticmethod
  def backward(config, varying_axes, saved, dy, dy_quantized=None):
    """The cotangents of (x, kernel1, kernel2, offsets, scales). ``dy_quantized``: dy's
    (data, scale_inv, wgrad operand) triple made by the caller (fp8_dgrad's
    d_out_quantized); dy is then only a ShapeDtypeStruct (rows and dtype)."""
    x, w1, w1_scale_inv, w2, w2_scale_inv, group_offsets, scales, h, a, templates = saved
    recipe = config.recipe
    dtype = dy.dtype  # the output's, which is x's
    frozen1, frozen2 = config.frozen_kernels  # no weight gradient for these
    rows = dy.shape[0]
    # The forward's choice: dy's and dh's column-wise copies from their quantizing passes.
    fuse = isinstance(x, quantize_columnwise.Columnwise) or isinstance(
        a, quantize_columnwise.Columnwise)
    da, dy_q = linear_api.fp8_dgrad(dy, w2, w2_scale_inv, group_offsets, recipe, dtype,
                                    columnwise=fuse and not frozen2,
                                    d_out_quantized=dy_quantized)
    if frozen2:
      d_kernel2 = None
    elif recipe.fp8_wgrad:
      d_kernel2 = linear_api.fp8_wgrad(a, dy_q, group_offsets, dtype, rows=rows)
    else:
      if a is None:
        a = _activation(h, scales, config)
      d_kernel2 = _gemm(a, dy, group_offsets, gemm_ffi.WGRAD)
    # dact + quantization for FC1's dgrad and its wgrad (the FP8 one's operand, or dh).
    dh_data, dh_scale_inv, dh_fp8, dh, d_scales = quantize_columnwise.scaled_dactivation_quantize(
        da, h, scales, group_offsets, recipe, copy=fuse and not frozen1,
        return_dx=not (recipe.fp8_wgrad or frozen1),  # the 16-bit wgrad's input only
        **config.act_kwargs)
    dx = linear_api.fp8_gemm(dh_data, dh_scale_inv, w1, w1_scale_inv, group_offsets,
                             gemm_ffi.DGRAD, dtype, recipe)
    if frozen1:
      d_kernel1 = None
    elif recipe.fp8_wgrad:
      d_kernel1 = linear_api.fp8_wgrad(x, dh_fp8, group_offsets, dtype, rows=rows)
    else:
      d_kernel1 = _gemm(x, dh, group_offsets, gemm_ffi.WGRAD)
    return _cotangents(varying_axes, templates, dx, d_kernel1, d_kernel2, d_scales, scales)


class _Blockwise:
  """The blockwise FP8 (Float8BlockScaling(): DeepSeek-V3's recipe) variant.

    forward:  x_q = x in E4M3, one scale per row and 128 columns; w1 in E4M3, one scale
              per 128 x 128 tile ([G, 2F, H] for the forward and [G, H, 2F] for the dgrad
              from one pass, or a quantize_experts copy)
              h = blockwise FP8 grouped GEMM(x_q, w1)                   (16-bit h, saved)
              a_q = scaled_activation_quantize(h, scales)   (fused, 1 x 128 blocks of the
                    fp32 activation, never rounded to 16-bit)
              y = blockwise FP8 grouped GEMM(a_q, w2)
    backward: da = blockwise FP8 dgrad(dy in 1 x 128 blocks of the gradient format, w2)
              dk2 = wgrad(act(h) * scales, dy)    (recomputed, or saved)
              dh_q, dh, ds = scaled_dactivation_quantize(da, h, scales)  (one fused kernel:
                    the FP8 dh for the dgrad and the 16-bit dh for the wgrad)
              dx = blockwise FP8 dgrad(dh_q, w1), dk1 = wgrad(x, dh)

  The weight gradients (grouped_linear's blockwise_wgrad) run in FP8 with recipe.fp8_wgrad
  where no partitioning follows: each operand quantized in 128 x 1 blocks down each group's
  rows from its 16-bit value; else in 16-bit.
  """

  @staticmethod
  def check(recipe, hidden: int, width: int, ffn: int) -> None:
    linear_api.validate_blockwise(recipe, hidden, width, "grouped_mlp",
                                  ("H (x.shape[1])", "kernel1.shape[2]"))
    linear_api.validate_blockwise(recipe, ffn, hidden, "grouped_mlp",
                                  ("F (kernel2.shape[1])", "H (x.shape[1])"))

  @staticmethod
  def forward(x, kernel1, kernel2, group_offsets, scales, config, for_backward=True):
    recipe = config.recipe
    frozen1, frozen2 = config.frozen_kernels
    x_data, x_scale_inv = linear_api.blockwise_rows(x, recipe, "forward", "ffi")
    w1_t, w1 = linear_api.blockwise_weights(kernel1, recipe, untransposed=for_backward)
    h = linear_api.blockwise_gemm(x_data, x_scale_inv, w1_t, group_offsets, gemm_ffi.FORWARD,
                                  x.dtype)
    a_q = quantize_api.scaled_activation_quantize(h, scales, recipe=recipe,
                                                  implementation="ffi", **config.act_kwargs)
    w2_t, w2 = linear_api.blockwise_weights(kernel2, recipe, untransposed=for_backward)
    y = linear_api.blockwise_gemm(a_q.data, a_q.scale_inv, w2_t, group_offsets,
                                  gemm_ffi.FORWARD, x.dtype)
    if not for_backward:
      return y, None
    # A frozen quantized kernel gets no gradient: its wgrad's input need not be kept.
    x_saved = None if frozen1 else x
    a_saved = (_activation(h, scales, config)
               if config.save_activation and not frozen2 else None)
    templates = tuple(quantized_kernels.cotangent_template(k) for k in (kernel1, kernel2))
    return y, (x_saved, w1, w2, group_offsets, scales, h, a_saved, templates)

  @staticmethod
  def backward(config, varying_axes, saved, dy):
    x, w1, w2, group_offsets, scales, h, a, templates = saved
    recipe = config.recipe
    dtype = dy.dtype  # the output's, which is x's
    frozen1, frozen2 = config.frozen_kernels
    dy = dy.astype(h.dtype)
    da = linear_api.blockwise_dgrad(dy, w2, group_offsets, recipe, dtype)
    d_kernel2 = None
    if not frozen2:
      a = _activation(h, scales, config) if a is None else a
      d_kernel2 = linear_api.blockwise_wgrad(a, dy, group_offsets, recipe)
    dh_q, dh, d_scales = quantize_api.scaled_dactivation_quantize(
        da, h, scales, recipe=recipe, return_dx=not frozen1, implementation="ffi",
        **config.act_kwargs)
    dx = linear_api.blockwise_gemm(dh_q.data, dh_q.scale_inv, w1, group_offsets,
                                   gemm_ffi.DGRAD, dtype)
    d_kernel1 = None if frozen1 else linear_api.blockwise_wgrad(x, dh, group_offsets, recipe)
    return _cotangents(varying_axes, templates, dx, d_kernel1, d_kernel2, d_scales, scales)


def _cotangents(varying_axes, templates, dx, d_kernel1, d_kernel2, d_scales, scales):
  """The backward's cotangents for (x, kernel1, kernel2, offsets, scales): each matched to
  its primal's shard_map varying axes; a trainable quantized kernel's gradient at its
  master, none for a frozen one."""
  x_axes, k1_axes, k2_axes, _, s_axes = varying_axes

  def kernel_ct(d_kernel, axes, template):
    if d_kernel is None:
      return None
    return quantized_kernels.kernel_cotangent(template,
                                             compat.match_varying_axes(d_kernel, axes))

  return (compat.match_varying_axes(dx, x_axes), kernel_ct(d_kernel1, k1_axes, templates[0]),
          kernel_ct(d_kernel2, k2_axes, templates[1]), None,
          compat.match_varying_axes(d_scales.astype(scales.dtype), s_axes))


def _variant(recipe):
  """The FP8 variant of a recipe: _Blockwise for Float8BlockScaling, else Fp8Stages."""
  return _Blockwise if isinstance(recipe, recipes.Float8BlockScaling) else Fp8Stages


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def grouped_mlp_with_offsets(x, kernel1, kernel2, group_offsets, scales, config: Config,
                             varying_axes=(frozenset(),) * 5):
  """grouped_mlp on precomputed int32 [G + 1] offsets (the FFI path, differentiable).

  `config` (static) holds the activation and its parameters; `varying_axes` (static)
  shard_map's varying axes of (x, kernel1, kernel2, group_offsets, scales).
  """
  return _forward(x, kernel1, kernel2, group_offsets, scales, config, varying_axes,
                  for_backward=False)[0]


def _forward(x, kernel1, kernel2, group_offsets, scales, config, varying_axes,
             for_backward=True):
  """(y, residuals); without ``for_backward`` (the primal call: no VJP follows) the FP8
  path skips what only the backward reads (the weights' untransposed FP8 copies)."""
  del varying_axes
  if config.recipe is not None:
    return _variant(config.recipe).forward(x, kernel1, kernel2, group_offsets, scales, config,
                                           for_backward)
  h, a = _fc1(x, kernel1, group_offsets, scales, config)
  y = _gemm(a, kernel2, group_offsets, gemm_ffi.FORWARD)
  saved_activation = a if config.save_activation else None
  return y, (x, kernel1, kernel2, group_offsets, scales, h, saved_activation)


def _backward(config, varying_axes, saved, dy):
  if config.recipe is not None:
    return _variant(config.recipe).backward(config, varying_axes, saved, dy)
  x, kernel1, kernel2, group_offsets, scales, h, a = saved
  dy = dy.astype(x.dtype)
  da = _gemm(dy, kernel2, group_offsets, gemm_ffi.DGRAD)
  if a is None:
    a = _activation(h, scales, config)
  d_kernel2 = _gemm(a, dy, group_offsets, gemm_ffi.WGRAD)
  dh, d_scales = act_sharding.backward(da, h, scales, **config.act_kwargs)
  dx = _gemm(dh, kernel1, group_offsets, gemm_ffi.DGRAD)
  d_kernel1 = _gemm(x, dh, group_offsets, gemm_ffi.WGRAD)
  d_scales = d_scales.astype(scales.dtype)
  x_axes, k1_axes, k2_axes, _, s_axes = varying_axes
  return (compat.match_varying_axes(dx, x_axes), compat.match_varying_axes(d_kernel1, k1_axes),
          compat.match_varying_axes(d_kernel2, k2_axes), None,
          compat.match_varying_axes(d_scales, s_axes))


grouped_mlp_with_offsets.defvjp(_forward, _backward)


def grouped_mlp(x: jax.Array, kernel1: jax.Array, kernel2: jax.Array, group_sizes: jax.Array,
                scales: jax.Array, activation: str = "swiglu", *, recipe=None,
                save_activation: bool | None = None, implementation: str | None = None,
                limit: float = 7.0, alpha: float = 1.702,
                linear_offset: float = 1.0) -> jax.Array:
  """The expert MLP of an MoE layer: FC2(act(FC1(x)) * scales[:, None]), per group.

  Rows of group g (rows sorted by group, as ``jaxfuse.grouped_linear``) go through expert
  g's weights: ``kernel2[g]`` after the scaled activation of ``x @ kernel1[g]``.

  Args:
    x: [M, H] bfloat16 or float16 (float32 too with implementation="xla").
    kernel1: [G, H, 2F] for "swiglu" / "clamped_swiglu" (gate columns first), [G, H, F]
      for "srelu"; x's dtype.
    kernel2: [G, F, H], x's dtype. With an FP8 recipe either kernel may instead be its
      FP8 copy from ``jaxfuse.quantize_experts`` (quantized once: for inference, or for the
      micro-batches of one step), which skips its quantization passes; it gets no gradient
      unless made with ``trainable=True`` (then its master gets the 16-bit kernel's).
    group_sizes: int32 [G] on the device (negative sizes count as zero; rows past the sum
      come out as zeros).
    scales: [M] float32 or x's dtype: per-row activation scale (an MoE layer passes the
      router probabilities, so the combine weights are applied inside the MLP).
    activation: "swiglu", "clamped_swiglu" or "srelu" (see ``jaxfuse.scaled_activation``;
      limit, alpha and linear_offset are its static parameters).
    recipe: None (16-bit GEMMs) or
      ``jaxfuse.quantization.Float8CurrentScaling(per_group=True)``: both GEMMs and both
      dgrads run in FP8 (E4M3 inputs, E5M2 gradients, one scale per group of rows and per
      expert); the FC1 -> FC2 hand-off is the fused ``scaled_activation_quantize`` and the
      backward activation the fused ``scaled_dactivation_quantize``. Weight gradients run
      in FP8 from the same FP8 tensors (``recipe.fp8_wgrad``, the default) or in 16-bit.
      Or ``jaxfuse.quantization.Float8BlockScaling()`` (DeepSeek-V3's recipe): the four
      GEMMs and dgrads run the blockwise FP8 kernels (1 x 128 blocks of x, the activation
      and the gradients, 128 x 128 tiles of the weights), through the same fused
      activation and activation-gradient kernels; the weight gradients run in 16-bit, or
      with ``fp8_wgrad=True`` in FP8 from 128 x 1 blocks of their operands (on one device
      or inside shard_map with every axis manual; not yet faster on the H200).
      H, kernel1.shape[2] and F must be multiples of 16. The "xla" implementation is the
      FP8 reference (straight-through gradients).
    save_activation: keep the activation as a residual instead of recomputing it from FC1's
      output in the backward pass (more memory, one activation kernel less). Gradients are
      identical either way. (An FP8 recipe with fp8_wgrad saves the FP8 activation anyway.)
      When the forward and backward passes are one XLA program (jax.grad inside one jit),
      XLA's common-subexpression elimination merges the recompute with the forward's own
      activation kernel, so False runs one activation kernel as well and keeps its
      result alive until FC2's wgrad; the choice matters where the residuals cross a
      program boundary (a vjp applied in another jit, offloaded residuals). None (the
      default) saves it where FC1's kernel writes the activation itself (the gated FC1:
      bfloat16, a gated activation, 2F a multiple of 256, JAXFUSE_GROUPED_MLP_GATED_FC1=1;
      there is no forward activation kernel for a recompute to merge with), else
      recomputes it.
    implementation: None, "ffi" or "xla" (the ``ragged_dot`` + jnp composition).

  Returns:
    [M, H] in x's dtype.

  Differentiable in x, kernel1, kernel2 (unless frozen quantized copies) and scales; one
  custom_vjp whose backward pass reuses the forward pass's offsets (computed once with
  ``jaxfuse.group_offsets``).
  """
  implementation, config = checked_config(x, kernel1, kernel2, group_sizes, scales,
                                          activation, recipe, save_activation,
                                          implementation, limit, alpha, linear_offset)
  recipe = config.recipe
  if implementation == "xla":
    act = (activation, config.limit, config.alpha, config.linear_offset)
    if isinstance(recipe, recipes.Float8BlockScaling):
      return reference.grouped_mlp_blockwise(x, kernel1, kernel2, group_sizes, scales, *act,
                                             recipe)
    if recipe is not None:
      return reference.grouped_mlp_fp8(x, kernel1, kernel2, group_sizes, scales, *act, recipe)
    return reference.grouped_mlp(x, kernel1, kernel2, group_sizes, scales, *act)
  offsets = offsets_api.group_offsets(group_sizes, implementation="ffi")
  varying_axes = tuple(compat.varying_axes(a) for a in (
      x, linear_api.kernel_leaf(kernel1), linear_api.kernel_leaf(kernel2), offsets, scales))
  return grouped_mlp_with_offsets(x, kernel1, kernel2, offsets, scales, config, varying_axes)


def checked_config(x, kernel1, kernel2, group_sizes, scales, activation, recipe,
                   save_activation, implementation, limit, alpha, linear_offset):
  """Validates a grouped_mlp call (x may be a jax.ShapeDtypeStruct): (the resolved
  implementation, its static Config). Raises as grouped_mlp documents."""
  implementation = implementation_lib.resolve(implementation)
  recipe = linear_api.recipe_for_kernels(recipe, kernel1, kernel2)
  _validate(x, kernel1, kernel2, group_sizes, scales, activation, recipe, implementation)
  limit = checks.static_float("limit", limit)
  alpha = checks.static_float("alpha", alpha)
  linear_offset = checks.static_float("linear_offset", linear_offset)
  frozen = tuple(quantized_kernels.is_frozen_kernel(k) for k in (kernel1, kernel2))
  gated_fc1 = _gated_fc1(x, kernel1, activation, recipe, implementation)
  if save_activation is None:
    save_activation = gated_fc1
  return implementation, Config(activation, limit, alpha, linear_offset,
                                bool(save_activation), recipe, frozen, gated_fc1)


def flops(tokens: int, hidden: int, ffn: int, activation: str = "swiglu",
          backward: bool = True) -> int:
  """GEMM floating-point operations of one grouped_mlp over `tokens` routed rows."""
  width = 2 * ffn if activation in act_reference.GLU else ffn
  forward = 2 * tokens * hidden * width + 2 * tokens * ffn * hidden
  return 3 * forward if backward else forward

