"""``csr``: the block-diagonal weight as a torch ``sparse_csr`` tensor (MKL on CPU, cuSPARSE on CUDA)."""

from __future__ import annotations

import torch

from ..construct import _sparse_csr
from ._registry import F32_F64, FLOATS, Backend, register
from ._sparse import sparse_entry


def _spmm(w: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    return torch.sparse.mm(_sparse_csr(w.contiguous()), dense)


csr = sparse_entry("csr", _spmm)


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
