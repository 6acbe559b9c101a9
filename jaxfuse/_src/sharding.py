"""Sharding rules for jaxfuse's FFI calls under ``jax.jit`` with sharded arrays.

An ``ffi_call`` has no partitioning rule of its own: XLA gathers its operands onto every
device and runs the whole op everywhere. :func:`partitioned` wraps an FFI-level function
(arrays in, arrays out, static attributes as keywords) in
``jax.experimental.custom_partitioning`` with a Shardy sharding rule written in einsum-like
notation (one factor name per dimension, e.g. ``"r k, k n, r n -> r n"``; a compound
dimension such as ``"(t j)"``, t major, is one entry of a factor list).

How a rule is applied (the same for every op):

* Shardy propagates shardings through the op following the rule's factors. Factors named
  in ``replicated`` are ``need_replication`` factors: Shardy reshards those dimensions to
  replicated before the op (e.g. the hidden dimension of a norm). Factors named in
  ``reduction`` are contracted dimensions that may stay sharded: each device computes a
  partial result and the op's ``local`` function reduces it (``psum``) itself.
* The partition callback reads the operand shardings Shardy chose, assigns each factor the
  mesh axes of the first operand dimension that carries it (an axis is used by one factor
  only), and builds consistent operand and result shardings from them. The FFI call then
  runs on each device's shard.
* Ops whose per-device work depends on where a shard lies use a ``local`` function with
  ``local_factors=True``: it gets each sharded factor's mesh axes and uses
  ``jax.lax.axis_index`` (``shard_start``, ``global_row_ids``) and collectives. So grouped
  GEMMs with sharded tokens turn the global group offsets into their row block's
  (wgrad psums over the token axes), and current-scaling quantization combines per-device
  amaxes with ``pmax`` before quantizing with the global scale.
* ``result_axes_from`` gives a result dimension the mesh axes of an operand factor: the
  expert-sorted rows of ``moe_permute`` (the compound factor ``(t j)``) come out sharded
  over the tokens' axes, and the local function moves the rows (``psum_scatter``).

Only used when Shardy is the partitioner (``jax.config.jax_use_shardy_partitioner``, the
default in jax 0.11): under GSPMD the plain FFI call is used (XLA gathers, still correct).
Inside ``shard_map`` (all mesh axes manual) and on one device custom_partitioning inlines
the plain call, so per-device code is unchanged. ``jax.vmap`` of a partitioned op batches
the plain FFI call (custom_partitioning has no batching rule of its own), so a vmapped op
is not partitioned by these rules. ``with jaxfuse.sharding_rules(False):`` traces the plain
calls (needed for ``jax.export`` of sharded functions: custom_partitioning's callbacks
cannot be serialized).

Persistent compilation cache: custom_partitioning puts a per-lowering Python callback key
into the module, so its cache key changes each time a function is lowered, and entries are
written but not found again by a new lowering (observed with jax 0.11.2, see
``tests/sharding/test_rules.py``). jax's ``jax_remove_custom_partitioning_ptr_from_cache_key
=True`` removes the key and restores hits. custom_partitioning keeps static arguments in
Python only, so on its own that flag would let two programs differing only in an op's
attributes (alpha, eps, activation, ...) share a cache entry and run the wrong one (checked
with a constant fingerprint: the alpha=0.25 program ran alpha=0.5's executable); every
partitioned call therefore takes a fingerprint of its attributes
as an extra, unused int32 constant operand, which puts them in the module text and the key.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from typing import Callable, Sequence

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jaxfuse._src import compat

# rule(attrs: dict, in_ranks, out_ranks) -> (operand factor lists, result factor lists).
RuleFn = Callable[[dict, Sequence[int], Sequence[int]],
                  tuple[Sequence[Sequence[str]], Sequence[Sequence[str]]]]


_RULES = compat.traced_bool_flag(
    "jaxfuse_sharding_rules", True,
    "Whether jaxfuse's FFI calls carry custom_partitioning sharding rules.")


def shardy_enabled() -> bool:
  return bool(jax.config.jax_use_shardy_partitioner)


def rules_enabled() -> bool:
  return bool(_RULES.value) and shardy_enabled()


@contextlib.contextmanager
def sharding_rules(enabled: bool):
  """Turns jaxfuse's sharding rules on or off while tracing (this thread).

  The setting is part of jax's jit and trace cache keys (the jax config flag
  ``jaxfuse_sharding_rules``; ``jax.config.update("jaxfuse_sharding_rules", False)`` sets
  it for the process), so a function traced with the rules is retraced without them.

  Off, the ops are plain FFI calls: XLA gathers sharded operands (correct, not cheap).
  Needed to ``jax.export`` a function with sharded inputs: custom_partitioning's Python
  callbacks cannot be serialized ("serialization of host_callbacks is not yet
  implemented").
  """
  with _RULES(bool(enabled)):
    yield


def rule_string(in_factors, out_factors) -> str:
  """Einsum-like rule text from factor lists: [["r", "k"], ["k", "n"]], [["r", "n"]]."""
  side = lambda lists: ", ".join(" ".join(f) if f else "" for f in lists)
  return f"{side(in_factors)} -> {side(out_factors)}"


def leading(prefix: str, rank: int) -> list[str]:
  """Names for `rank` leading (row/batch) dimensions: b0, b1, ..."""
  return [f"{prefix}{i}" for i in range(rank)]


def _spec_entry(spec, dim):
  entries = tuple(spec) if spec is not None else ()
  return entries[dim] if dim < len(entries) else None


def _axes_tuple(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _assign_factors(in_factors, arg_specs, replicated) -> dict[str, tuple[str, ...]]:
  """Mesh axes for each factor, from the first operand dimension that has some."""
  assignment: dict[str, tuple[str, ...]] = {}
  used: set[str] = set()
  for factors, spec in zip(in_factors, arg_specs):
    for dim, factor in enumerate(factors):
      if factor in replicated or factor in assignment:
        continue
      axes = _axes_tuple(_spec_entry(spec, dim))
      if axes and not used.intersection(axes):
        assignment[factor] = axes
        used.update(axes)
  return assignment


def _spec(factors, assignment) -> PartitionSpec:
  entries = []
  for factor in factors:
    axes = assignment.get(factor, ())
    entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*entries)


def partitioned(fn: Callable, rule: RuleFn, *, replicated: Sequence[str] = (),
                reduction: Sequence[str] = (), summed: Sequence[str] = (),
                local: Callable | None = None, local_factors: bool = False,
                result_axes_from: dict[str, str] | None = None) -> Callable:
  """Wraps ``fn(*arrays, **attrs)`` in custom_partitioning with a Shardy rule.

  Args:
    fn: the FFI-level function; called with every device's shards.
    rule: gives the factor names of each operand and result dimension from the static
      attributes and the operand and result ranks.
    replicated: factors that must not be sharded (need_replication in Shardy).
    reduction: contracted factors (in operands only) that may be sharded; when any is,
      ``local`` is used.
    summed: factors that some results keep and others are summed over (the rows of a
      norm's backward: dx keeps them, dgamma sums them); not declared to Shardy, but when
      sharded ``local`` is used, like for ``reduction``.
    local: ``local(reduce_axes, *shards, **attrs)``, the per-device computation when some
      factor of ``reduction`` or ``summed`` is sharded over the mesh axes ``reduce_axes``
      (it must psum what is summed).
    local_factors: call ``local(factor_axes, *shards, **attrs)`` instead, with
      ``factor_axes`` a dict from every sharded factor to its mesh axes (for a local
      function that needs to know which dimension is sharded how, e.g. to turn global row
      offsets into local ones with ``jax.lax.axis_index``).
    result_axes_from: {factor: source factor}, applied in order: when the source factor is
      sharded, the factor gets the same mesh axes (overriding its own): e.g. the sorted
      rows of a permutation sharded like the tokens they come from (``local`` moves the
      data between the two layouts).

  Returns:
    ``call(*arrays, **attrs)``: the partitioned op (the plain ``fn`` without Shardy).
  """
  replicated = frozenset(replicated) | {_FINGERPRINT}
  reduction = frozenset(reduction)
  summed_or_reduced = reduction | frozenset(summed)

  def factors_for(attrs, in_ranks, out_ranks):
    # Operand 0 is the attributes' fingerprint (see _fingerprint).
    in_factors, out_factors = rule(attrs, in_ranks[1:], out_ranks)
    return ([[_FINGERPRINT]] + [list(f) for f in in_factors],
            [list(f) for f in out_factors])

  @functools.partial(custom_partitioning, static_argnums=(0,))
  def op(attr_items, fingerprint, *args):
    del fingerprint
    return fn(*args, **dict(attr_items))

  def sharding_rule(attr_items, mesh, operand_types, result_types):
    del mesh
    in_factors, out_factors = factors_for(
        dict(attr_items), [len(t.shape) for t in operand_types],
        [len(t.shape) for t in result_types])
    # In order of first appearance: Shardy wants special factors' indices sorted.
    # A compound dimension "(t j)" counts as its factors t, j.
    order = list(dict.fromkeys(name for fs in in_factors + out_factors for f in fs
                               for name in f.strip("()").split()))
    special = {}
    if replicated.intersection(order):
      special["need_replication_factors"] = tuple(f for f in order if f in replicated)
    if reduction.intersection(order):
      special["reduction_factors"] = tuple(f for f in order if f in reduction)
    return rule_string(in_factors, out_factors), special

  def partition(attr_items, mesh, arg_shapes, result_shape):
    attrs = dict(attr_items)
    results = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
    in_factors, out_factors = factors_for(attrs, [len(a.shape) for a in arg_shapes],
                                          [len(r.shape) for r in results])
    specs = []
    for arg in arg_shapes:
      sharding = arg.sharding
      specs.append(sharding.spec if isinstance(sharding, NamedSharding) else None)
    assignment = _assign_factors(in_factors, specs, replicated)
    for target, source in (result_axes_from or {}).items():
      if source in assignment:
        assignment[target] = assignment[source]
    reduce_axes = tuple(axis for factor in sorted(summed_or_reduced)
                        for axis in assignment.get(factor, ()))
    arg_shardings = tuple(NamedSharding(mesh, _spec(f, assignment)) for f in in_factors)
    out_shardings = [NamedSharding(mesh, _spec(f, assignment)) for f in out_factors]
    out_shardings = (tuple(out_shardings) if isinstance(result_shape, (tuple, list))
                     else out_shardings[0])

    sizes = {}
    for factors, arg in zip(in_factors, arg_shapes):
      for factor, size in zip(factors, arg.shape):
        sizes.setdefault(factor, int(size))
    for factors, res in zip(out_factors, results):
      for factor, size in zip(factors, res.shape):
        sizes.setdefault(factor, int(size))

    def lower_fn(fingerprint, *shards):
      del fingerprint
      if reduce_axes:
        if local_factors:
          return local(FactorAxes(assignment, sizes), *shards, **attrs)
        return local(reduce_axes, *shards, **attrs)
      return fn(*shards, **attrs)

    return mesh, lower_fn, out_shardings, arg_shardings

  op.def_partition(partition=partition, sharding_rule=sharding_rule)

  def call(*args, **attrs):
    if not rules_enabled():
      return fn(*args, **attrs)
    attr_items = tuple(sorted(attrs.items()))
    return _batchable(op, fn, attr_items)(_fingerprint(attr_items), *args)

  call.__wrapped__ = fn
  return call


_FINGERPRINT = "attrs_fp"


class FactorAxes(dict):
  """{factor: mesh axes} of the sharded factors, with ``sizes``: {factor: global size}.

  A local function sees per-device blocks; when a dimension does not divide evenly, XLA
  pads the last blocks, and ``sizes`` tells which rows or columns are padding.
  """

  def __init__(self, assignment, sizes):
    super().__init__(assignment)
    self.sizes = dict(sizes)


def _fingerprint(attr_items) -> np.ndarray:
  """The static attributes as a small int32 constant operand of the partitioned call.

  custom_partitioning keeps static arguments in Python only: two programs differing only
  in an op's attributes (alpha, eps, ...) would lower to the same module text apart from
  the callback key, which ``jax_remove_custom_partitioning_ptr_from_cache_key`` removes
  from the persistent cache key. With the fingerprint in the module as a constant, they
  get different cache keys, so that flag is safe with jaxfuse's ops. It is replicated,
  unused by the computation, and removed by XLA.
  """
  digest = hashlib.sha256(repr(attr_items).encode()).digest()[:8]
  return np.frombuffer(digest, dtype=np.int32).copy()


def _batchable(op, fn, attr_items):
  """custom_partitioning has no batching rule: under vmap, batch the plain call."""

  @jax.custom_batching.custom_vmap
  def batched(fingerprint, *args):
    return op(attr_items, fingerprint, *args)

  @batched.def_vmap
  def _rule(axis_size, in_batched, fingerprint, *args):
    del axis_size, fingerprint
    attrs = dict(attr_items)
    axes = tuple(0 if b else None for b in in_batched[1:])
    out = jax.vmap(lambda *a: fn(*a, **attrs), in_axes=axes)(*args)
    out_batched = jax.tree.map(lambda _: True, out)
    return out, out_batched

  # Differentiating the op itself (not through its api's custom_vjp) fails like a plain
  # ffi_call does, with a ValueError, instead of custom_partitioning's NotImplementedError.
  @jax.custom_jvp
  def guarded(*args):
    return batched(*args)

  @guarded.defjvp
  def _jvp(primals, tangents):
    del primals, tangents
    name = getattr(fn, "__qualname__", repr(fn))
    raise ValueError(f"The FFI call `{name}` (jaxfuse) cannot be differentiated. Use the op's "
                     "differentiable public function (it has a custom_vjp).")

  return guarded


# --- helpers for local functions (called inside the partitioned computation) ---------------


def all_axes(factor_axes: dict, factors: Sequence[str]) -> tuple[str, ...]:
  """The mesh axes of `factors` in a ``local_factors`` assignment, in factor order."""
  return tuple(axis for f in factors for axis in factor_axes.get(f, ()))


def shard_start(axes: Sequence[str], local_size: int):
  """Global index of this device's first element along a dimension sharded over `axes`.

  For a dimension split over several mesh axes (``PartitionSpec(("a", "b"))``), the
  blocks are ordered major-to-minor like the axes, as ``jax.lax.axis_index`` counts them.
  """
  if not axes:
    return jax.numpy.int32(0)
  return jax.lax.axis_index(tuple(axes)).astype(np.int32) * np.int32(local_size)


def axes_size(axes: Sequence[str]) -> int:
  """Number of devices along `axes` (1 for none)."""
  size = 1
  for axis in axes:
    size *= jax.lax.axis_size(axis)
  return size


def global_index(size: int, factor_axes, factor: str):
  """int32 [size]: the global index of each element of a local block along one dimension."""
  axes = factor_axes.get(factor, ())
  return jax.numpy.arange(size, dtype=np.int32) + shard_start(axes, size)


def global_size(local_size: int, factor_axes, factor: str) -> int:
  """The dimension's global size (without XLA's padding of uneven blocks)."""
  sizes = getattr(factor_axes, "sizes", {})
  if factor in sizes:
    return sizes[factor]
  return local_size * axes_size(factor_axes.get(factor, ()))


def global_row_ids(shape: Sequence[int], factor_axes: dict, factors: Sequence[str]):
  """(int32 [prod(shape)] row ids, total rows): row-major global row of each local row.

  `shape` is the local block's shape (the leading, row dimensions of an operand),
  `factors` their factor names; each dimension sharded over some mesh axes contributes
  its shard's offset. Rows of a device are not contiguous globally when more than one
  dimension is sharded; this gives each its global row number (the one group offsets
  refer to). Padding rows of uneven blocks get the id ``total`` (past every row).
  """
  jnp = jax.numpy
  total = 1
  for dim, factor in enumerate(factors):
    total *= global_size(shape[dim], factor_axes, factor)
  ids = jnp.zeros(tuple(shape), np.int32)
  valid = jnp.ones(tuple(shape), bool)
  stride = 1
  for dim in reversed(range(len(shape))):
    index = global_index(shape[dim], factor_axes, factors[dim])
    size = global_size(shape[dim], factor_axes, factors[dim])
    bshape = [1] * len(shape)
    bshape[dim] = shape[dim]
    ids = ids + index.reshape(bshape) * np.int32(stride)
    valid = valid & (index < size).reshape(bshape)
    stride *= size
  return jnp.where(valid, ids, np.int32(total)).reshape(-1), total
