"""``bmm_fm_bmm``: ``bmm_fm``'s forward with ``bmm``'s backward.

Without autograd it is ``bmm_fm`` (declared as ``same_forward_as``, so ``auto`` ranks and
``tune`` times only ``bmm_fm`` in forward mode). In training each parent loses half of the
step:

* ``bmm_fm``'s autograd backward forms the input gradient as ``W^T @ gy^T`` in
  ``[G, in, N]`` order. Turning that into ``[N, G*in]`` is an element-by-element transpose,
  which torch's CPU copy does several times slower than a plain copy of the same bytes.
* ``bmm``'s backward forms it as ``gy_g @ W`` in ``[G, N, in]`` order, whose copy to
  ``[N, G*in]`` moves contiguous runs of ``in`` elements; but ``bmm``'s forward is slower than
  ``bmm_fm``'s, whose result ``[G, out, N]`` is already a view of ``[N, G*out]``.

So this pairing wins training steps where neither parent does, mostly at small batches; it
loses to ``bmm_fm`` where the cost of an autograd Function matters (tiny products) and to
``bmm_fm_loop`` at large products with thin blocks. ``auto`` picks by the measured table.

The backward is ``bmm``'s, written in differentiable ops, so double backward works.
"""

from __future__ import annotations

from ..ops import OpEntry, define
from ._registry import FLOATS, Backend, register
from .bmm import bmm_fm_forward, bmm_fm_rows, rows_input_grad

# bmm's backward is ``ops.generic_backward`` (backward=None).
bmm_fm_bmm = define(OpEntry("bmm_fm_bmm", bmm_fm_forward, traceable=True, rows=bmm_fm_rows, rows_input_grad=rows_input_grad))


BACKEND = register(
    Backend(
        name="bmm_fm_bmm",
        fn=bmm_fm_bmm,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        summary="bmm_fm's forward, bmm's backward; wins most mid-size training points",
        same_forward_as="bmm_fm",
    )
)
