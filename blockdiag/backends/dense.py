"""``dense``: one GEMM with the dense ``[G*out, G*in]`` block-diagonal matrix built from the blocks.

Non-finite values cross groups here, and only here: the off-diagonal zeros are multiplied,
and ``0 * NaN`` and ``0 * inf`` are NaN. A NaN or Inf in group ``g``'s input in row ``n``
makes row ``n``'s output NaN in every group (forward), and one in the upstream gradient of
group ``g`` in row ``n`` makes row ``n``'s input gradient NaN in every group (backward, the
same GEMM transposed). Other rows, and the weight and bias gradients (per block), stay
confined, as they are with every other backend. The backend therefore declares
``isolates_groups=False``, and ``auto`` uses it only where ``dense_max_groups`` or
``dense_max_elements`` is set explicitly (``blockdiag.config``, ``set_config`` or the
environment). Naming ``backend="dense"`` still runs it.
"""

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


def _forward_copies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``B`` copies' products, one dense matrix per copy: ``x [B or 1, N, G*in]``, ``weight [B, G, out, in]``.

    What a vmapped weight runs (the batching rule): folded into ``B*G`` groups, the copies
    would share one ``[B*G*out, B*G*in]`` matrix, ``B`` times the memory of theirs.
    """
    nb, g, o, i = weight.shape
    # As dense_from_blocks, per copy: W[k, g] at [k, :, :, g, g], then rows and columns by group.
    dense_w = torch.diag_embed(weight.permute(0, 2, 3, 1)).permute(0, 3, 1, 4, 2).reshape(nb, g * o, g * i)
    y = torch.matmul(x, dense_w.transpose(1, 2))
    return y if bias is None else y + bias[:, None, :]


dense = define(OpEntry("dense", _forward, _backward, traceable=True, traceable_backward=True,
                       forward_copies=_forward_copies))


BACKEND = register(
    Backend(
        name="dense",
        fn=dense,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        dense_matrix=True,
        summary="one GEMM on the dense block-diagonal matrix (G^2 memory; few small groups; "
        "a NaN/Inf in one group's input reaches every group's output)",
        isolates_groups=False,
    )
)
