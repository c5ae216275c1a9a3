"""Blocks with an empty side (no input columns, or no outputs): every backend either computes
the product (the bias alone, or nothing) with its gradients, or refuses with a reason.

The refusals are listed, not read from the backends: ``conv`` (conv1d rejects the shapes)
and ``torch_sparse`` (its matmul kills the process with SIGFPE on such a matrix).
"""

from __future__ import annotations

import pytest
import torch

from blockdiag import BlockDiagError, grouped_linear
from blockdiag.backends import get, names

REFUSED = {"conv": r"conv1d rejects blocks with an empty side", "torch_sparse": r"has an empty side, on which torch-sparse's matmul crashes"}

# (leading dims of x, groups, block_in, block_out)
CASES = [
    pytest.param((10,), 3, 0, 4, id="no-inputs"),
    pytest.param((2, 5), 3, 0, 4, id="no-inputs-3d"),
    pytest.param((10,), 3, 4, 0, id="no-outputs"),
    pytest.param((0,), 3, 0, 4, id="no-inputs-empty-batch"),
    pytest.param((4,), 3, 0, 0, id="no-sides"),  # bsr divided by gcd(0, 0) = 0
]


@pytest.mark.parametrize("lead, g, i, o", CASES)
@pytest.mark.parametrize("name", [*names(), "auto"])
def test_empty_sides(name, lead, g, i, o):
    if name != "auto" and get(name).unavailable_reason() is not None:
        pytest.skip(get(name).unavailable_reason())
    x = torch.randn(*lead, g * i, dtype=torch.float64, requires_grad=True)
    w = torch.randn(g, o, i, dtype=torch.float64, requires_grad=True)
    b = torch.randn(g * o, dtype=torch.float64, requires_grad=True)
    batch_empty = lead == (0,)
    if name in REFUSED and not (name == "conv" and batch_empty):
        with pytest.raises(BlockDiagError, match=REFUSED[name]):
            grouped_linear(x, w, b, backend=name)
        return
    if name == "conv":
        with pytest.raises(BlockDiagError, match="conv1d rejects an empty batch"):
            grouped_linear(x, w, b, backend=name)
        return
    y = grouped_linear(x, w, b, backend=name)
    torch.testing.assert_close(y, b.expand(*lead, g * o))
    r = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad((y * r).sum(), (x, w, b), allow_unused=True, materialize_grads=True)
    torch.testing.assert_close(gx, torch.zeros_like(x))
    assert gw.shape == w.shape
    torch.testing.assert_close(gb, r.sum(dim=tuple(range(r.dim() - 1))))
