"""``dense``: one GEMM with the dense ``[G*out, G*in]`` block-diagonal matrix built from the blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..construct import dense_from_blocks
from ._registry import FLOATS, Backend, register


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, block_diag(*weight), bias)``; the weight gradient is read back per block."""
    return F.linear(x, dense_from_blocks(weight), bias)


BACKEND = register(
    Backend(
        name="dense",
        fn=dense,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        dense_matrix=True,
        summary="one GEMM on the dense block-diagonal matrix (G^2 memory; few small groups)",
    )
)
