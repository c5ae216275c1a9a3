"""Peak tensor memory of one step, counted under a dispatch mode (any device)."""

from __future__ import annotations

from typing import Callable

import torch


class _LiveBytes:
    """Bytes held by tensors created under a dispatch mode: current and peak."""

    def __init__(self):
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self.live: dict[int, tuple[object, int]] = {}
        self.current = self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        if t.layout != torch.strided:
            for part in _sparse_parts(t):
                self.add(part)
            return
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.live or st.nbytes() == 0:
            return
        self.live[key] = (self._ref(st), st.nbytes())
        self.current += st.nbytes()
        self._collect()
        self.peak = max(self.peak, self.current)

    def _collect(self) -> None:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.current -= self.live.pop(k)[1]


def _sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []


def peak_memory(step: Callable[[], None]) -> int:
    """Peak bytes of tensors allocated while ``step()`` runs (inputs and parameters excluded).

    Counts every tensor an operator returns, on any device, until it is freed; library
    scratch space (MKL, oneDNN workspaces) is not seen.

    >>> x = torch.ones(256)
    >>> peak_memory(lambda: x * 2), peak_memory(lambda: x.view(16, 16).t())
    (1024, 0)
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    live = _LiveBytes()

    def ptrs(tree) -> set:
        out = set()
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                out.add(t.untyped_storage().data_ptr())
        return out

    class _Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # Views and in-place results share an argument's storage: nothing was allocated.
            shared = ptrs((args, kwargs))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and (
                    t.layout != torch.strided or t.untyped_storage().data_ptr() not in shared
                ):
                    live.add(t)
            return out

    with _Track():
        step()
    return live.peak
