"""What the native backends (``simd``, ``mkl_batch``) check before a data pointer is taken."""

from __future__ import annotations

import torch

from .._errors import BlockDiagError

__all__ = ["check_stored"]


def check_stored(backend: str, arg: str, t: torch.Tensor) -> None:
    """Raise BlockDiagError unless ``t``'s storage is allocated and holds every element of the view."""
    n = t.numel()
    if not n:
        return
    if t.is_contiguous():
        end = t.storage_offset() + n
    else:
        end = t.storage_offset() + 1 + sum([(a - 1) * b for a, b in zip(t.shape, t.stride())])
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError) as e:  # a batched or functional wrapper (legacy vmap, ...)
        raise BlockDiagError(f"{backend}: {arg} has no storage of its own ({e}): a wrapper tensor cannot be "
                             f"handed to the kernels") from None
    if storage.nbytes() < end * t.element_size() or not storage.data_ptr():
        raise BlockDiagError(
            f"{backend}: {arg} has no storage for its elements (shape {tuple(t.shape)}, "
            f"strides {t.stride()}, offset {t.storage_offset()}, {storage.nbytes()} bytes of storage)"
        )
