"""``loop``: the reference. A Python loop of ``F.linear`` over the groups, then ``torch.cat``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._registry import FLOATS, Backend, register


def loop(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y[:, g*o:(g+1)*o] = x[:, g*i:(g+1)*i] @ weight[g].T + bias[g*o:(g+1)*o]``."""
    g, o, i = weight.shape
    xs = x.split(i, dim=-1)
    bs = bias.split(o) if bias is not None else [None] * g
    return torch.cat([F.linear(xs[k], weight[k], bs[k]) for k in range(g)], dim=-1)


BACKEND = register(
    Backend(
        name="loop",
        fn=loop,
        dtypes={"cpu": FLOATS, "cuda": FLOATS},
        summary="Python loop of F.linear + cat (the reference; wins for few, large groups)",
    )
)
