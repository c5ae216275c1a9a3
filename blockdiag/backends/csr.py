"""``csr``: the block-diagonal weight as a torch ``sparse_csr`` tensor (MKL on CPU, cuSPARSE on CUDA)."""

from __future__ import annotations

import torch

from ..construct import _sparse_csr
from ._registry import F32_F64, FLOATS, Backend, register
from ._sparse import sparse_block_linear


def _spmm(w: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    return torch.sparse.mm(_sparse_csr(w.contiguous()), dense)


def csr(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ block_diag_csr(weight).T + bias``; compact per-block weight gradient."""
    return sparse_block_linear(x, weight, bias, _spmm, "csr")


BACKEND = register(
    Backend(
        name="csr",
        double_grad=False,
        fn=csr,
        dtypes={"cpu": F32_F64, "cuda": FLOATS},
        sparse=True,
        summary="torch sparse CSR product, per-block weight gradient",
    )
)
