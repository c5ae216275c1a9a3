"""``bmm``: batched matmul over ``[G, N, in] x [G, in, out]`` views, bias fused by ``baddbmm``.

No operand is copied or expanded: the input is read through a strided ``[G, N, in]`` view
and the weight through its transposed ``[G, in, out]`` view (the layout measured fastest
on CPU, see docs/backends.md); only the output is written once into ``[N, G*out]`` order.
"""

from __future__ import annotations

import torch

from ._registry import FLOATS, Backend, register


def bmm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y.view(N, G, out)[:, g] = x.view(N, G, in)[:, g] @ weight[g].T + bias.view(G, out)[g]``."""
    g, o, i = weight.shape
    n = x.shape[0]
    xg = x.view(n, g, i).transpose(0, 1)  # [G, N, in], no copy
    if bias is None:
        y = torch.bmm(xg, weight.transpose(1, 2))
    else:
        y = torch.baddbmm(bias.view(g, 1, o), xg, weight.transpose(1, 2))
    return y.transpose(0, 1).reshape(n, g * o)


BACKEND = register(
    Backend(
        name="bmm",
        fn=bmm,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        summary="batched matmul on strided views, bias fused (baddbmm)",
    )
)
