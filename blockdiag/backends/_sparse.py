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

from ..ops import OpEntry, define

# spmm(w [G, r, c], dense [G*c, K]) -> [G*r, K]: block-diagonal(w) @ dense via a sparse layout.
SpMM = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def sparse_entry(name: str, spmm: SpMM) -> OpEntry:
    """The ops of a sparse-layout backend whose block-diagonal product is ``spmm``."""

    def forward(x, weight, bias):
        # y^T = W_bd @ x^T: torch's sparse kernels take the sparse operand on the left.
        yt = spmm(weight, x.t())
        if bias is not None:
            yt = yt + bias[:, None]
        return yt.t()

    def backward(dy, x, weight, has_bias, need_x, need_w):
        g, o, i = weight.shape
        n = x.shape[0]
        dx = dw = db = None
        if need_x:
            # dX^T = W_bd^T @ dY^T, the transposed blocks in the same sparse layout.
            dx = spmm(weight.transpose(1, 2).contiguous(), dy.t()).t()
        if need_w:
            dyg = dy.reshape(n, g, o).permute(1, 2, 0)  # [G, out, N]
            xg = x.reshape(n, g, i).transpose(0, 1)  # [G, N, in]
            dw = torch.bmm(dyg, xg)
        if has_bias:
            db = dy.sum(0)
        return dx, dw, db

    return define(OpEntry(name, forward, backward))
