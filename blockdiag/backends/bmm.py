"""``bmm`` and ``bmm_fm``: batched matmul on strided views, bias fused by ``baddbmm``.

Neither copies nor expands an operand: the input is read through a strided view and the
weight as stored (or through its transposed view); only the output is written once into
``[N, G*out]`` order. The two differ in which side the long batch dimension sits on:

* ``bmm`` computes ``[G, N, in] @ [G, in, out]`` (the weight as the transposed operand);
* ``bmm_fm`` ("feature-major") computes ``W [G, out, in] @ x^T [G, in, N]``, so each GEMM
  streams along the batch, and its result ``[G, out, N]`` is already a (transposed) view
  of ``[N, G*out]``.

Which is faster depends on shape, mode and device, so both are registered and ``auto``
picks by the measured table (``blockdiag tune``); ``bmm`` also stays as the plainest
batched form.

``bmm``'s backward (``blockdiag.ops.generic_backward``) forms the weight gradient as
``gy_g^T @ x_g``, which gives ``[G, out, in]``, the weight's own layout, where autograd would
form ``x_g^T @ gy_g`` (``[G, in, out]``) and transpose it. ``bmm_fm``'s backward is the one
autograd derives from its forward (``[G, ., N]`` order), written out as its kernel.
"""

from __future__ import annotations

import torch

from ..ops import OpEntry, define
from ..ops.fm_rows import fm_rows_backward, write_rows
from ._registry import FLOATS, Backend, register


def _bmm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y.view(N, G, out)[:, g] = x.view(N, G, in)[:, g] @ weight[g].T + bias.view(G, out)[g]``."""
    g, o, i = weight.shape
    n = x.shape[0]
    xg = x.view(n, g, i).transpose(0, 1)  # [G, N, in], no copy
    if bias is None:
        y = torch.bmm(xg, weight.transpose(1, 2))
    else:
        y = torch.baddbmm(bias.view(g, 1, o), xg, weight.transpose(1, 2))
    return y.transpose(0, 1).reshape(n, g * o)


def bmm_fm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y^T`` per group as ``weight[g] @ x_g^T + bias_g`` in ``[G, out, N]``, then one transpose."""
    g, o, i = weight.shape
    n = x.shape[0]
    xt = x.view(n, g, i).permute(1, 2, 0)  # [G, in, N], no copy
    if bias is None:
        yt = torch.bmm(weight, xt)
    else:
        yt = torch.baddbmm(bias.view(g, o, 1), weight, xt)
    return yt.permute(2, 0, 1).reshape(n, g * o)


def bmm_fm_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``bmm_fm``'s product written straight into a new row-major ``[N, G*out]``.

    The batched GEMM's ``out=`` is the ``[G, out, N]`` strided view of the new tensor (each
    group's block is a transposed matrix with leading dimension ``G*out``), so the result is
    row-major without the transposing copy ``.contiguous()`` would make of ``bmm_fm``'s view.
    What a caller that must return a contiguous result runs (``OpEntry.rows``).
    """
    g, _, i = weight.shape
    return write_rows(x.view(x.shape[0], g, i).permute(1, 2, 0), weight, bias)


def rows_input_grad(gy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The input gradient ``gy_g @ W_g`` written straight into a new row-major ``[N, G*in]``."""
    g, o, i = weight.shape
    n = gy.shape[0]
    gx = gy.new_empty(n, g * i)
    torch.bmm(gy.reshape(n, g, o).transpose(0, 1), weight, out=gx.view(n, g, i).transpose(0, 1))
    return gx


def _fm_backward(gy, x, weight, has_bias, need_x, need_w):
    """What autograd derives from ``bmm_fm``'s forward: the products in ``[G, ., N]`` order."""
    g, _, i = weight.shape
    n = x.shape[0]
    gh, gw, gb = fm_rows_backward(gy, x.reshape(n, g, i).permute(1, 2, 0), weight, need_x, need_w, has_bias)
    gx = None if gh is None else gh.permute(2, 0, 1).reshape(n, g * i)
    return gx, gw, gb


# bmm's backward is the batched-matmul formula of ``ops.generic_backward`` (backward=None):
# its weight gradient ``gy_g^T @ x_g`` comes out as ``[G, out, in]``, the weight's own layout.
bmm = define(OpEntry("bmm", _bmm_forward, traceable=True))
bmm_fm = define(
    OpEntry("bmm_fm", bmm_fm_forward, _fm_backward, traceable=True, eager_autograd=True,
            rows=bmm_fm_rows, rows_input_grad=rows_input_grad)
)


BACKEND = register(
    Backend(
        name="bmm",
        fn=bmm,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        summary="batched matmul, [G,N,in] @ weight^T views, bias fused (baddbmm)",
    )
)

BACKEND_FM = register(
    Backend(
        name="bmm_fm",
        fn=bmm_fm,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        summary="batched matmul, feature-major weight @ x^T views, bias fused (baddbmm)",
    )
)
