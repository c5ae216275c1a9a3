"""``loop``: one GEMM per group, each written straight into its slice of the result.

The naive loop (``F.linear`` per input slice, then ``torch.cat``) copies the output once in
forward and, worse, the whole input gradient once in backward (``split``'s backward is a
``cat``). Here every per-group product is an ``addmm``/``mm`` with ``out=`` a strided view
of one preallocated tensor: a ``[N, o]`` slice of ``[N, G*o]`` has strides ``(G*o, 1)``,
which BLAS takes as a leading dimension, so nothing is copied, in forward or backward.
For few, large per-group GEMMs in training (large batches) that backward can beat a batched
matmul's, which pays for a ``[G, N, in]`` input-gradient buffer and its transpose; the
forward rarely beats ``bmm_fm``'s, so ``bmm_fm_loop`` pairs ``bmm_fm``'s forward with this
backward. ``loop`` stays registered as the backend that accepts every problem (``auto``
always has a plan) and the plainest reference of the product; where it wins is in the
measured table (the docs' "which backend when" table is generated from it).

The weight gradient is the exception: one ``bmm`` of ``gy_g^T [G, out, N]`` by ``x_g [G, N, in]``
(both strided views, and the result is ``[G, out, in]`` as the weight is stored): one
batched call instead of ``G`` small ones, never slower than per-group ``mm`` calls where it
was measured. Per-group ``mm`` writes stay for the output and the input gradient: those are
the large ``[N, G*in]``/``[N, G*out]`` tensors, and a batched product would need a second
buffer and a transposing copy.

The kernels are the ops ``blockdiag::loop`` and ``blockdiag::loop_backward``; under
``create_graph=True`` the backward is computed from differentiable ops instead of ``out=``
writes (see :mod:`blockdiag.ops`).
"""

from __future__ import annotations

import torch

from ..ops import OpEntry, define
from ..ops._define import fake_rows as _fake_rows
from ._registry import FLOATS, Backend, register


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel: per-group views from one ``split``/``unbind`` each, GEMMs written in place."""
    g, o, i = weight.shape
    if i == 0 or o == 0:
        # Blocks with an empty side: split() takes no size 0, and the block-diagonal matrix
        # is empty, so the product is the bias alone (or nothing).
        return torch.nn.functional.linear(x, weight.reshape(g * o, g * i), bias)
    y = x.new_empty(x.shape[0], g * o)
    xs, ys, wts = x.split(i, dim=1), y.split(o, dim=1), weight.transpose(1, 2).unbind(0)
    if bias is None:
        for k in range(g):
            torch.mm(xs[k], wts[k], out=ys[k])
    else:
        bs = bias.split(o)
        for k in range(g):
            torch.addmm(bs[k], xs[k], wts[k], out=ys[k])
    return y


def _backward(gy, x, weight, has_bias, need_x, need_w):
    """Input gradient per group into its slice; weight gradient as one ``bmm`` on views."""
    g, o, i = weight.shape
    gx = gw = gb = None
    n = x.shape[0]
    if need_x and (i == 0 or o == 0):
        gx = torch.zeros_like(x)  # blocks with an empty side
    elif need_x:
        gys = gy.split(o, dim=1)
        gx = x.new_empty(x.shape)
        gxs, ws = gx.split(i, dim=1), weight.unbind(0)
        for k in range(g):
            torch.mm(gys[k], ws[k], out=gxs[k])
    if need_w:
        # Splitting one dimension is always a view, whatever gy's and x's strides.
        gw = torch.bmm(gy.view(n, g, o).permute(1, 2, 0), x.view(n, g, i).transpose(0, 1))
    if has_bias:
        gb = gy.sum(0)
    return gx, gw, gb


loop = define(OpEntry("loop", _forward, _backward, fake=_fake_rows))


BACKEND = register(
    Backend(
        name="loop",
        fn=loop,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        summary="one GEMM per group written in place (no cat, in forward or backward); runs every problem",
        loops_groups=True,
    )
)

