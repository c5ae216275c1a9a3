"""``bmm_fm_loop``: ``bmm_fm``'s forward with ``loop``'s backward.

Without autograd it is ``bmm_fm`` (declared as ``same_forward_as``, so ``auto`` ranks and
``tune`` times only ``bmm_fm`` in forward mode). In training it won where neither parent does: 150x10
blocks at B=256 (G >= 16) and at B=2048, 1.2-1.4x ahead of ``loop`` and 1.6-2.4x ahead of
``bmm_fm`` (CPU, 2 threads, interleaved medians). ``bmm_fm``'s forward suits the skinny
10-wide output, and ``loop``'s backward avoids ``bmm_fm``'s ``[G, in, N]`` input-gradient
buffer and its transposing copy. In the built-in table it is the fastest at 2 of 83
training points (256x256 blocks at B=2048 with G=16 and G=50); ``bmm_fm_bmm``, ``mkl_batch``
and ``simd`` took the points it had before those backends existed. It is a separate backend, not a
change to ``bmm_fm``, because ``bmm_fm``'s own backward still wins training at small batch
(10x10 and 10x150 blocks, B <= 256); ``auto`` picks by the measured table.
"""

from __future__ import annotations

import torch

from ..ops import OpEntry, define
from ._registry import FLOATS, Backend, register
from .bmm import bmm_fm_forward
from .loop import _backward

bmm_fm_loop = define(OpEntry("bmm_fm_loop", bmm_fm_forward, _backward, traceable=True))


BACKEND = register(
    Backend(
        name="bmm_fm_loop",
        fn=bmm_fm_loop,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        summary="bmm_fm's forward, loop's backward; wins training at large batch",
        same_forward_as="bmm_fm",
    )
)
