"""``conv``: grouped ``conv1d`` with kernel size 1 (the forum's approach, done with the right groups)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import OpEntry, define
from ..ops._define import fake_rows
from ._registry import FLOATS, Backend, register


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``conv1d(x[N, G*in, 1], weight.view(G*out, in, 1), bias, groups=G)``."""
    g, o, i = weight.shape
    n = x.shape[0]
    y = F.conv1d(x.reshape(n, g * i, 1), weight.reshape(g * o, i, 1), bias, groups=g)
    return y.view(n, g * o)


def _backward(gy, x, weight, has_bias, need_x, need_w):
    """The convolution's own backward (oneDNN / cuDNN), as autograd would call it."""
    g, o, i = weight.shape
    n = x.shape[0]
    gx, gw, gb = torch.ops.aten.convolution_backward(
        gy.reshape(n, g * o, 1), x.reshape(n, g * i, 1), weight.reshape(g * o, i, 1),
        [g * o] if has_bias else None, [1], [0], [1], False, [0], g, [need_x, need_w, has_bias],
    )
    return (
        gx.view(n, g * i) if need_x else None,
        gw.view(g, o, i) if need_w else None,
        gb if has_bias else None,
    )


# An explicit fake kernel: torch's own fake convolution guards on the batch size, which
# would cost a compiled graph per batch range.
conv = define(OpEntry("conv", _forward, _backward, traceable=True, fake=fake_rows, eager_autograd=True))


def _constraint(p) -> str | None:
    if p.batch == 0:
        return "conv1d rejects an empty batch"
    if p.block_in == 0 or p.block_out == 0:
        return "conv1d rejects blocks with an empty side"
    return None


BACKEND = register(
    Backend(
        name="conv",
        fn=conv,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        constraint=_constraint,
        summary="grouped conv1d, kernel size 1 (oneDNN / cuDNN)",
        # cuDNN's default (torch.backends.cudnn.allow_tf32) is TF32 for float32 convolutions on
        # Ampere and newer; torch's float32 matmuls, nn.Linear's, default to full float32.
        reduced_precision={"cuda": (frozenset({torch.float32}), "cuDNN's TF32 by default, where nn.Linear's "
                                                                  "float32 matmul is full float32")},
    )
)
