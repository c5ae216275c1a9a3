"""``bsr``: the block-diagonal weight as a torch ``sparse_bsr`` tensor.

torch's BSR kernels need square blocks (MKL on CPU, cuSPARSE/Triton on CUDA), so each
``out x in`` block is stored as square sub-blocks of side ``gcd(out, in)``; ``dense @ BSR``
is not implemented on CPU, so the product runs as ``y^T = W_bsr @ x^T``. torch has no BSR
backward: the shared autograd function supplies it.
"""

from __future__ import annotations

import torch

from ..construct import _sparse_bsr, square_blocksize
from ._registry import F32_F64, Backend, register
from ._sparse import sparse_block_linear


def _spmm(w: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    _, r, c = w.shape
    return _sparse_bsr(w.contiguous(), square_blocksize(r, c)) @ dense


def bsr(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ block_diag_bsr(weight, square blocks).T + bias``; compact per-block weight gradient."""
    return sparse_block_linear(x, weight, bias, _spmm)


BACKEND = register(
    Backend(
        name="bsr",
        fn=bsr,
        dtypes={"cpu": F32_F64, "cuda": F32_F64},
        sparse=True,
        summary="torch sparse BSR product (square sub-blocks), per-block weight gradient",
    )
)
