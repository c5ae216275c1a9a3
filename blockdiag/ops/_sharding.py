"""DTensor sharding rules for blockdiag's ops (registered once DTensor is in use).

A grouped product ``y [N, G*out] = x [N, G*in] . blocks(weight [G, out, in]) + bias [G*out]``
splits with no communication in three ways, on each mesh dimension:

* **groups**: the input sharded along its features by group (``Shard(1)``), the weight and bias
  by group (``Shard(0)``) give the output sharded along its features (``Shard(1)``): each rank
  runs the product of its own groups (group parallelism, :mod:`blockdiag.distributed`);
* **rows**: the input sharded by rows (``Shard(0)``, data parallel) with replicated parameters
  gives a row-sharded output;
* **columns**, for one group only (``G == 1``, the wide first layer of a shared-input
  :class:`~blockdiag.GroupedMLP`): a replicated input with the weight sharded by output rows
  (``Shard(1)`` of ``[1, out, in]``) and the bias ``Shard(0)`` gives the output ``Shard(1)``
  (column parallelism, as ``ColwiseParallel`` does for ``nn.Linear``);

and all-replicated runs everywhere. The backward op follows its operands (the input gradient
of the column split and the parameter gradients of the row split are ``Partial`` sums).
DTensor picks the cheapest: a replicated input meets group-sharded parameters by taking its
local slice, which costs no communication.

A feature shard must hold whole groups, so the group split is offered only where the number of
shards divides ``G`` (``torch.chunk`` would cut ``G*in`` features and ``G`` groups at different
places otherwise); a weight already sharded by group over ranks that do not divide ``G`` is
refused with :class:`~blockdiag.BlockDiagError` naming ``G`` and the number of ranks, instead
of being gathered silently.

The rules are op strategies in DTensor's own registry (``sharding_propagator.register_op_strategy``,
what ``torch.distributed.tensor.experimental.register_sharding`` does underneath) with each op's
flag arguments in the sharding cache key (``register_sharding`` leaves bools out, so two calls
of a backward op that differ only in ``need_input`` would share one cached output shape). If
those internals are missing, ``register_sharding`` registers the same rules without the
divisibility filter.

Registering imports ``torch.distributed.tensor`` (most of a second), so it waits for the
first call that sees a tensor subclass while that module is loaded (:func:`ensure`), or for
``import blockdiag.distributed``.
"""

from __future__ import annotations

import inspect
import sys
import threading
from math import prod

import torch

from .._errors import BlockDiagError

__all__ = ["UnevenGroupsError", "contiguous_strides", "ensure", "is_dtensor", "refuse_sharded"]

_done = False
_lock = threading.Lock()


def _forward_strategies(groups: int, has_bias: bool, n_flags: int) -> list[list]:
    """Single-mesh-dimension placements ``[out, x, weight, bias, *flags]`` of a forward op."""
    from torch.distributed.tensor import Replicate, Shard

    R = Replicate()
    b = (lambda p: p) if has_bias else (lambda p: None)
    flags = [None] * n_flags
    out = [
        [R, R, R, b(R)] + flags,
        [Shard(1), Shard(1), Shard(0), b(Shard(0))] + flags,  # groups
        [Shard(0), Shard(0), R, b(R)] + flags,  # rows
    ]
    if groups == 1:
        out.append([Shard(1), R, Shard(1), b(Shard(0))] + flags)  # columns
    return out


def _backward_strategies(groups: int) -> list[list]:
    """Single-mesh-dimension placements ``[gx, gw, gb, grad, x, weight, *flags]`` of a backward op."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    R, P = Replicate(), Partial()
    flags = [None, None, None]
    out = [
        [R, R, R, R, R, R] + flags,
        [Shard(1), Shard(0), Shard(0), Shard(1), Shard(1), Shard(0)] + flags,  # groups
        [Shard(0), P, P, Shard(0), Shard(0), R] + flags,  # rows
    ]
    if groups == 1:
        out.append([P, Shard(1), Shard(0), Shard(1), R, Shard(1)] + flags)  # columns
    return out


def _shards(spec, dim: int) -> int:
    """How many pieces ``spec``'s placements cut tensor dimension ``dim`` into."""
    return prod(spec.mesh.size(k) for k, p in enumerate(spec.placements) if p.is_shard(dim))


class UnevenGroupsError(BlockDiagError, NotImplementedError):
    """A weight sharded by group over ranks that do not divide its groups (a :class:`BlockDiagError`).

    Also a ``NotImplementedError``, the one exception DTensor's dispatcher re-raises as it is
    from a sharding rule (any other it wraps in a ``RuntimeError``), so the caller gets this.
    """


def _check_weight(op, spec) -> None:
    """Refuse a weight already sharded by group over ranks that do not divide its groups."""
    groups = spec.tensor_meta.shape[0]
    n = _shards(spec, 0)
    if n > 1 and groups % n != 0:
        raise UnevenGroupsError(
            f"{op}: the weight's {groups} groups are sharded (Shard(0)) over {n} ranks, which do not "
            f"divide them: group parallelism needs a group count divisible by the number of ranks "
            f"that split it (placements {tuple(spec.placements)} on a mesh of shape {tuple(spec.mesh.shape)})"
        )


def _valid(groups: int, weight_at: int):
    """The filter of full-mesh strategies: the group split must divide ``G`` evenly."""

    def ok(input_specs, output_specs) -> bool:
        return groups % _shards(input_specs[weight_at], 0) == 0

    return ok


def _register_strategies() -> bool:
    """Register through DTensor's op strategy registry; False where its internals are missing."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._op_schema import OpStrategy, RuntimeSchemaInfo
        from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

        propagator = DTensor._op_dispatcher.sharding_propagator
        propagator.register_op_strategy  # noqa: B018 - present?
    except (ImportError, AttributeError):
        return False
    # The filter's keyword is torch's internal name: is_valid_strategy_cb up to 2.13,
    # full_mesh_strategy_filter from 2.14. Neither: the public rules (no filter) instead.
    params = inspect.signature(expand_to_full_mesh_op_strategy).parameters
    keyword = next((k for k in ("full_mesh_strategy_filter", "is_valid_strategy_cb") if k in params), None)
    if keyword is None:
        return False

    def spec_of(arg):
        return arg.strategies[0].output_spec if isinstance(arg, OpStrategy) else None

    def forward(op_schema):
        args = op_schema.args_schema
        w = spec_of(args[1])
        _check_weight(op_schema.op, w)
        groups = w.tensor_meta.shape[0]
        strategies = _forward_strategies(groups, spec_of(args[2]) is not None, len(args) - 3)
        return expand_to_full_mesh_op_strategy(
            op_schema.get_mesh_from_args(), op_schema, strategies, input_index=1, **{keyword: _valid(groups, 1)},
        )

    def backward(op_schema):
        w = spec_of(op_schema.args_schema[2])
        _check_weight(op_schema.op, w)
        groups = w.tensor_meta.shape[0]
        return expand_to_full_mesh_op_strategy(
            op_schema.get_mesh_from_args(), op_schema, _backward_strategies(groups), input_index=3,
            **{keyword: _valid(groups, 2)},
        )

    # Every argument from the first flag on (auto's ``train``; the backward's ``has_bias``,
    # ``need_input``, ``need_weight``) is part of the sharding cache key.
    info = RuntimeSchemaInfo(static_argnum=3, needs_pytree=True)
    for name in _names():
        propagator.register_op_strategy(getattr(torch.ops.blockdiag, name).default, forward, info)
        propagator.register_op_strategy(getattr(torch.ops.blockdiag, name + "_backward").default, backward, info)
    return True


def _register_sharding() -> None:
    """The same rules through the public ``register_sharding`` (no divisibility filter)."""
    from torch.distributed.tensor.experimental import register_sharding

    def forward_rule(x, weight, bias, *train):
        strategies = _forward_strategies(weight.tensor_meta.shape[0], bias is not None, len(train))
        return [(s[:1], s[1:]) for s in strategies]

    def backward_rule(grad, x, weight, has_bias, need_input, need_weight):
        return [(s[:3], s[3:]) for s in _backward_strategies(weight.tensor_meta.shape[0])]

    for name in _names():
        register_sharding(getattr(torch.ops.blockdiag, name).default)(forward_rule)
        register_sharding(getattr(torch.ops.blockdiag, name + "_backward").default)(backward_rule)


def _names() -> list[str]:
    from ._define import entries

    return list(entries()) + ["auto"]


def ensure() -> None:
    """Register the rules for every defined op, once, if DTensor is loaded in this process."""
    global _done
    if _done or "torch.distributed.tensor" not in sys.modules:
        return
    with _lock:
        if _done:
            return
        if not _register_strategies():
            _register_sharding()
        _done = True


def contiguous_strides(shape) -> tuple:
    """The row-major strides of ``shape`` (a size of 0 counts as 1, as torch's own do), for the
    global ``stride`` that ``DTensor.from_local`` is given with an explicit global ``shape``.

    ``torch.sym_max``, not ``max``: a traced size is symbolic, and comparing it would guard.
    """
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step = step * torch.sym_max(d, 1)
    return tuple(reversed(strides))


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor, without importing DTensor (none can exist before it is loaded)."""
    dt = sys.modules.get("torch.distributed.tensor")
    return dt is not None and isinstance(t, dt.DTensor)


def refuse_sharded(fn: str, module: torch.nn.Module, prefix: str = "") -> None:
    """Raise :class:`~blockdiag.BlockDiagError` if ``module`` holds a DTensor parameter or buffer.

    For conversions that copy a model's parameters into plain modules (``to_heads``,
    ``from_heads``): on a group-parallel model each rank holds only its own groups, and
    gathering them is a collective every rank must join, so it is never done implicitly.
    Cheap when DTensor has not been imported (nothing can be one then). ``prefix`` goes
    before the parameter's name in the message.
    """
    # Not a module (a None in a list of Linears): the caller's own type check names it.
    if "torch.distributed.tensor" not in sys.modules or not isinstance(module, torch.nn.Module):
        return
    for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in items:
            if is_dtensor(t):
                raise BlockDiagError(
                    f"{fn}: {kind} {prefix + name!r} is a DTensor {tuple(t.placements)} on a mesh of shape "
                    f"{tuple(t.device_mesh.shape)} (a group-parallel or otherwise distributed model), so this "
                    "rank holds only part of it; gather it first with "
                    "blockdiag.distributed.gather_model(model) on every rank, then convert the plain copy"
                )
