"""``bmm_fm_loop``: ``bmm_fm``'s forward with ``loop``'s backward.

Without autograd it is ``bmm_fm`` (declared as ``same_forward_as``, so ``auto`` ranks and
``tune`` times only ``bmm_fm`` in forward mode). In training it can win where neither parent
does: ``bmm_fm``'s forward suits a skinny output (10-wide blocks), and ``loop``'s backward
avoids ``bmm_fm``'s ``[G, in, N]`` input-gradient buffer and its transposing copy, which
matters for large tensors at large batches. It is a separate backend, not a change to
``bmm_fm``, because ``bmm_fm``'s own backward still wins some training points at small
batches; ``auto`` picks by the measured table.
"""

from __future__ import annotations

from ..ops import OpEntry, define
from ._registry import FLOATS, Backend, register
from .bmm import bmm_fm_forward, bmm_fm_rows
from .loop import _backward

bmm_fm_loop = define(OpEntry("bmm_fm_loop", bmm_fm_forward, _backward, traceable=True, rows=bmm_fm_rows))


BACKEND = register(
    Backend(
        name="bmm_fm_loop",
        fn=bmm_fm_loop,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        summary="bmm_fm's forward, loop's backward; wins training at large batch",
        same_forward_as="bmm_fm",
        loops_groups=True,
    )
)
