"""``BlockLayout``: the geometry of a block-diagonal matrix and its cached index tensors.

Index tensors (CSR row pointers, column indices, COO indices) depend only on
``(groups, block_out, block_in)``, the device and the index dtype, so they are built once and
cached here instead of on every forward call. The dense mask is built afresh on each call: it has an
entry for every entry of the full matrix (``groups**2`` blocks), no product reads it, and
cached it would hold a matrix-sized tensor per shape for the life of the process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockLayout:
    """Shape of a block-diagonal ``[groups * block_out, groups * block_in]`` matrix.

    >>> lay = BlockLayout(groups=3, block_out=2, block_in=4)
    >>> lay.shape
    (6, 12)
    >>> lay.csr_indices(torch.device("cpu"))[0].tolist()
    [0, 4, 8, 12, 16, 20, 24]
    """

    groups: int
    block_out: int
    block_in: int

    @property
    def shape(self) -> tuple[int, int]:
        """The full matrix shape ``(rows, cols)``."""
        return (self.groups * self.block_out, self.groups * self.block_in)

    @property
    def nnz(self) -> int:
        """Number of stored entries (every entry of every block)."""
        return self.groups * self.block_out * self.block_in

    @property
    def density(self) -> float:
        """Fraction of the full matrix inside the blocks: ``1 / groups``."""
        return 1.0 / self.groups

    def csr_indices(
        self, device: torch.device, dtype: torch.dtype = torch.int64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(crow_indices, col_indices)`` for CSR whose values are ``blocks.reshape(-1)``.

        ``dtype`` is ``torch.int64`` or ``torch.int32`` (half the bytes: one column index per
        stored entry; refused where ``nnz`` does not fit).
        """
        if dtype == torch.int32 and self.nnz > torch.iinfo(torch.int32).max:
            raise ValueError(f"int32 CSR indices cannot count {self.nnz} stored entries (layout {self})")
        return _get(_csr_indices, self.groups, self.block_out, self.block_in, _dev(device), dtype)

    def bsr_indices(
        self, blocksize: tuple[int, int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(crow_indices, col_indices)`` of the BSR index with the given blocksize."""
        p, q = blocksize
        return _get(_csr_indices, self.groups, self.block_out // p, self.block_in // q, _dev(device))

    def coo_indices(self, device: torch.device) -> torch.Tensor:
        """``[2, nnz]`` coalesced COO indices whose values are ``blocks.reshape(-1)``."""
        return _get(_coo_indices, self.groups, self.block_out, self.block_in, _dev(device))

    def mask(self, device: torch.device) -> torch.Tensor:
        """Bool ``[rows, cols]`` mask, True inside the diagonal blocks: a new tensor (not cached)."""
        return _mask(self.groups, self.block_out, self.block_in, _dev(device))


def _dev(device: torch.device | str | None) -> torch.device:
    device = torch.device("cpu") if device is None else torch.device(device)
    # Normalise "cuda" to "cuda:0" so that the cache has one entry per physical device.
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, torch.empty(0, device=device).device.index)
    return device


def _get(fn, *args):
    """``fn(*args)`` from its cache, or built afresh where the result must not outlive the call.

    Under a dispatch mode (FakeTensorMode: export, fake tracing, memory estimators) the
    factories return FakeTensors, and while dynamo traces, graph values: cached, they would
    be handed to every later real call (which then fails on a FakeTensor).
    """
    if torch._C._len_torch_dispatch_stack() or torch.compiler.is_compiling():
        return fn.__wrapped__(*args)
    return fn(*args)


@functools.lru_cache(maxsize=256)
def _csr_indices(
    g: int, r: int, c: int, device: torch.device, dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, torch.Tensor]:
    # Row (or block-row) k belongs to group k // r and holds c consecutive columns.
    crow = torch.arange(0, g * r + 1, device=device, dtype=dtype) * c
    start = torch.arange(g, device=device, dtype=dtype).repeat_interleave(r) * c
    col = (start[:, None] + torch.arange(c, device=device, dtype=dtype)).reshape(-1)
    return crow, col


@functools.lru_cache(maxsize=256)
def _coo_indices(g: int, r: int, c: int, device: torch.device) -> torch.Tensor:
    # The CSR column index is only a step here: cached too, it would keep another index per
    # stored entry beside the COO one for the life of the process.
    crow, col = _csr_indices.__wrapped__(g, r, c, device)
    row = torch.arange(g * r, device=device, dtype=torch.int64).repeat_interleave(c)
    return torch.stack([row, col])


def _mask(g: int, r: int, c: int, device: torch.device) -> torch.Tensor:
    eye = torch.eye(g, dtype=torch.bool, device=device)
    # contiguous(): with one group the reshape is a view of the expanded eye, every entry one
    # element (strides (0, 0)), which a caller could neither write one entry of nor view.
    return eye[:, None, :, None].expand(g, r, g, c).reshape(g * r, g * c).contiguous()
