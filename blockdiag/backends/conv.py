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
    """The input gradient from the convolution's own backward; weight and bias gradients as ``loop``'s.

    The convolution's own weight and bias gradients (oneDNN's on CPU) sum over the batch far
    less accurately than ``nn.Linear``'s, the more so the more rows and the lower the
    precision, and a bfloat16 weight gradient with one infinite upstream entry came back NaN
    where ``nn.Linear``'s is +-inf (tests/test_backends.py and tests/test_nan_isolation.py
    bound both). ``gy_g^T @ x_g`` as one batched product and ``sum`` are what ``nn.Linear``
    and the other backends compute.
    """
    g, o, i = weight.shape
    n = x.shape[0]
    gx = gw = gb = None
    if need_x:
        gx = torch.ops.aten.convolution_backward(
            gy.reshape(n, g * o, 1), x.reshape(n, g * i, 1), weight.reshape(g * o, i, 1),
            None, [1], [0], [1], False, [0], g, [True, False, False],
        )[0].view(n, g * i)
    if need_w:
        gw = torch.bmm(gy.reshape(n, g, o).permute(1, 2, 0), x.reshape(n, g, i).transpose(0, 1))
    if has_bias:
        gb = gy.sum(0)
    return gx, gw, gb


# An explicit fake kernel: torch's own fake convolution guards on the batch size, which
# would cost a compiled graph per batch range. Not eager_autograd: torch's derivative of the
# forward has the convolution's inaccurate weight and bias gradients (see _backward); the
# backward is torch ops, so a compiled graph may still inline it.
conv = define(OpEntry("conv", _forward, _backward, traceable=True, fake=fake_rows, traceable_backward=True))


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
