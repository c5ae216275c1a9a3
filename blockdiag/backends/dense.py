"""``dense``: one GEMM with the dense ``[G*out, G*in]`` block-diagonal matrix built from the blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..construct import dense_from_blocks
from ..ops import OpEntry, define
from ._registry import FLOATS, Backend, register


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, block_diag(*weight), bias)``."""
    return F.linear(x, dense_from_blocks(weight), bias)


def _backward(gy, x, weight, has_bias, need_x, need_w):
    """The input gradient through the dense matrix (one GEMM); the weight gradient per block.

    Autograd through the forward would form the dense ``[G*out, G*in]`` gradient and read
    its diagonal blocks back; ``gy_g^T @ x_g`` as one batched product gives them directly.
    """
    g, o, i = weight.shape
    n = x.shape[0]
    gx = gw = gb = None
    if need_x:
        gx = gy @ dense_from_blocks(weight)
    if need_w:
        gw = torch.bmm(gy.reshape(n, g, o).permute(1, 2, 0), x.reshape(n, g, i).transpose(0, 1))
    if has_bias:
        gb = gy.sum(0)
    return gx, gw, gb


dense = define(OpEntry("dense", _forward, _backward, traceable=True))


BACKEND = register(
    Backend(
        name="dense",
        fn=dense,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        dense_matrix=True,
        summary="one GEMM on the dense block-diagonal matrix (G^2 memory; few small groups)",
    )
)
