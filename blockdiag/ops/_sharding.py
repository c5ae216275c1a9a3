"""DTensor sharding rules for blockdiag's ops (registered once DTensor is in use).

A grouped product splits along its groups with no communication: an input sharded along its
features by group (``Shard(1)`` of ``[N, G*in]``) with the weight and bias sharded by group
(``Shard(0)``) gives the output sharded along its features (``Shard(1)``), each rank running
the product of its own groups; an input sharded by rows (``Shard(0)``, data parallel) with
replicated parameters gives row-sharded output; all-replicated runs everywhere. DTensor
picks the cheapest: a replicated input meets group-sharded parameters by taking its local
slice, which costs no communication. A feature shard must hold whole groups: where the
mesh splits the groups unevenly the slices do not line up, and the local op refuses them
with :class:`~blockdiag.BlockDiagError` naming the shapes.

Registering imports ``torch.distributed.tensor`` (most of a second), so it waits for the
first call that sees a tensor subclass while that module is loaded (:func:`ensure`).
"""

from __future__ import annotations

import sys
import threading

import torch

__all__ = ["ensure"]

_done = False
_lock = threading.Lock()


def ensure() -> None:
    """Register the rules for every defined op, once, if DTensor is loaded in this process."""
    global _done
    if _done or "torch.distributed.tensor" not in sys.modules:
        return
    with _lock:
        if _done:
            return
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.experimental import register_sharding

        from ._define import entries

        def forward_rule(x, weight, bias, *train):
            b = lambda p: None if bias is None else p  # noqa: E731
            return [
                ([Replicate()], [Replicate(), Replicate(), b(Replicate())] + [None] * len(train)),
                ([Shard(1)], [Shard(1), Shard(0), b(Shard(0))] + [None] * len(train)),
                ([Shard(0)], [Shard(0), Replicate(), b(Replicate())] + [None] * len(train)),
            ]

        def backward_rule(grad, x, weight, has_bias, need_input, need_weight):
            # The gradients follow their operands; the bias and weight gradients of a
            # row-sharded batch are partial sums.
            from torch.distributed.tensor import Partial

            flags = [None, None, None]
            return [
                ([Replicate(), Replicate(), Replicate()], [Replicate(), Replicate(), Replicate()] + flags),
                ([Shard(1), Shard(0), Shard(0)], [Shard(1), Shard(1), Shard(0)] + flags),
                ([Shard(0), Partial(), Partial()], [Shard(0), Shard(0), Replicate()] + flags),
            ]

        names = list(entries()) + ["auto"]
        for name in names:
            register_sharding(getattr(torch.ops.blockdiag, name).default)(forward_rule)
            register_sharding(getattr(torch.ops.blockdiag, name + "_backward").default)(backward_rule)
        _done = True
