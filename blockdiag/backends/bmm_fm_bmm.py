"""``bmm_fm_bmm``: ``bmm_fm``'s forward with ``bmm``'s backward.

Without autograd it is ``bmm_fm`` (declared as ``same_forward_as``, so ``auto`` ranks and
``tune`` times only ``bmm_fm`` in forward mode). In training each parent loses half of the
step:

* ``bmm_fm``'s autograd backward forms the input gradient as ``W^T @ gy^T`` in
  ``[G, in, N]`` order. Turning that into ``[N, G*in]`` is an element-by-element transpose,
  which torch's CPU copy does 6-15x slower than a plain copy of the same bytes (a
  ``[160, 256]`` float32 transpose: 28.6 us against 4.3 us for ``clone``).
* ``bmm``'s backward forms it as ``gy_g @ W`` in ``[G, N, in]`` order, whose copy to
  ``[N, G*in]`` moves contiguous runs of ``in`` elements; but ``bmm``'s forward is slower than
  ``bmm_fm``'s, whose result ``[G, out, N]`` is already a view of ``[N, G*out]``.

Measured on CPU (2 threads, float32, interleaved medians of 5 rounds) over the training
grid, B in {32, 256, 2048} x G in {4, 16, 50, 256} x blocks {10x10, 150x10, 64x64}: it was
the fastest of ``bmm``, ``bmm_fm``, ``bmm_fm_loop`` and itself at 22 of 32 points, up to
1.4x ahead of the best of the others (B=32 G=256 10x10 and 150x10). It loses to ``bmm_fm``
at a few small-batch 10x10 points (by up to 12%, the cost of a Python autograd Function)
and to ``bmm_fm_loop`` at large 150x10 products. In the built-in table (which adds 256x256,
10x150, 64x256 and 32x32 blocks) it is the fastest at 8 of 83 training points (B=32 with
256x256, 64x256 or 10x150 blocks), most of the rest going to ``simd`` (68). ``auto`` picks by the measured table.

The backward is ``bmm``'s, written in differentiable ops, so double backward works.
"""

from __future__ import annotations

import torch

from ..ops import OpEntry, define
from ._registry import FLOATS, Backend, register
from .bmm import bmm_fm_forward

# bmm's backward is ``ops.generic_backward`` (backward=None).
bmm_fm_bmm = define(OpEntry("bmm_fm_bmm", bmm_fm_forward, traceable=True))


BACKEND = register(
    Backend(
        name="bmm_fm_bmm",
        fn=bmm_fm_bmm,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        summary="bmm_fm's forward, bmm's backward; wins most mid-size training points",
        same_forward_as="bmm_fm",
    )
)
