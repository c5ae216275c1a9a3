"""Shared autograd for the sparse-layout backends (CSR, BSR, torch-sparse).

torch's own sparse autograd either does not exist (BSR) or returns a gradient shaped like the
whole sparse matrix (CSR). Here the product runs through the sparse layout in both
directions, and the weight gradient is computed compactly per block,
``dW[g] = dY[:, g]^T @ X[:, g]``, with one ``bmm`` on strided views: never a dense
``[G*out, G*in]`` gradient.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.function import once_differentiable

from ._registry import first_order_only

# spmm(w [G, r, c], dense [G*c, K]) -> [G*r, K]: block-diagonal(w) @ dense via a sparse layout.
SpMM = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _SparseBlockLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, spmm: SpMM, name: str):
        ctx.spmm = spmm
        ctx.backend_name = name
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        # y^T = W_bd @ x^T: torch's sparse kernels take the sparse operand on the left.
        yt = spmm(weight, x.t())
        if bias is not None:
            yt = yt + bias[:, None]
        return yt.t()

    @staticmethod
    @first_order_only
    @once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        g, o, i = weight.shape
        n = x.shape[0]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            # dX^T = W_bd^T @ dY^T, the transposed blocks in the same sparse layout.
            dx = ctx.spmm(weight.transpose(1, 2).contiguous(), dy.t()).t()
        if ctx.needs_input_grad[1]:
            dyg = dy.reshape(n, g, o).permute(1, 2, 0)  # [G, out, N]
            xg = x.reshape(n, g, i).transpose(0, 1)  # [G, N, in]
            dw = torch.bmm(dyg, xg)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db, None, None


def sparse_block_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spmm: SpMM, name: str
) -> torch.Tensor:
    """``x @ block_diag(*weight).T + bias`` with ``spmm`` doing the block-diagonal product."""
    return _SparseBlockLinear.apply(x, weight, bias, spmm, name)
