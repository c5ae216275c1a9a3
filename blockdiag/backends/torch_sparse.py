"""``torch_sparse``: the block-diagonal weight as a ``torch_sparse.SparseTensor`` (CSR storage).

The product runs through torch-sparse's own SpMM kernels (CPU, and CUDA when the package was
built with CUDA); the shared autograd function gives the input gradient through the same
kernel on the transposed blocks and the weight gradient compactly per block. torch-sparse
is optional and imported only inside the kernel; its SpMM has no bfloat16 kernel, and on
CPU only float32/float64 are declared (its half kernel accumulates in half).
"""

from __future__ import annotations

import functools

import torch

from ..construct import _layout_of
from ._registry import F32_F64, Backend, Problem, register
from ._sparse import sparse_entry


def _spmm(w: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    from torch_sparse import SparseTensor, matmul

    lay = _layout_of(w)
    if dense.shape[1] == 0:
        # torch-sparse's SpMM divides by the column count (CPU) or launches an empty grid (CUDA).
        return dense.new_zeros(lay.shape[0], 0)
    rowptr, col = lay.csr_indices(w.device)
    # torch-sparse's kernels read raw storage and ignore the negative bit of a lazily negated
    # view (`torch._neg_view`, `z.conj().imag`): materialise it, or the signs come out wrong.
    dense = dense.resolve_neg()
    # The cached indices are sorted and valid by construction, so skip torch-sparse's checks.
    st = SparseTensor(
        rowptr=rowptr,
        col=col,
        value=w.reshape(-1).resolve_neg(),
        sparse_sizes=lay.shape,
        is_sorted=True,
        trust_data=True,
    )
    return matmul(st, dense, reduce="sum")


torch_sparse = sparse_entry("torch_sparse", _spmm)


@functools.lru_cache(maxsize=None)
def _built_with_cuda() -> bool:
    import torch_sparse  # noqa: F401  (loads the extension that defines the op below)

    return torch.ops.torch_sparse.cuda_version() != -1


def _constraint(p: Problem) -> str | None:
    if p.block_in == 0 or p.block_out == 0:
        # torch-sparse 0.6.18's matmul kills the process (SIGFPE) on such a matrix: refusing
        # is the only way to keep a bad shape from taking the interpreter down.
        return f"block {p.block_in}x{p.block_out} (in x out) has an empty side, on which torch-sparse's matmul crashes"
    if p.device == "cuda" and not _built_with_cuda():
        return "torch-sparse was built without CUDA (rebuild it where nvcc and a CUDA torch are present)"
    return None


BACKEND = register(
    Backend(
        name="torch_sparse",
        double_grad=False,
        fn=torch_sparse,
        dtypes={"cpu": F32_F64, "cuda": frozenset({torch.float16, torch.float32, torch.float64})},
        sparse=True,
        requires="torch_sparse",
        constraint=_constraint,
        summary="torch-sparse SparseTensor (CSR) SpMM, per-block weight gradient (optional package)",
    )
)
