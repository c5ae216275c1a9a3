"""The ``grouped_mm`` backend's own autograd and constraints, exercised on CPU.

The backend is declared for bfloat16 on CUDA GPUs of compute capability 9.x/10.x only (the
generic suite and tests/test_cuda.py run it there). torch also runs ``_grouped_mm`` on CPU
(float32/bfloat16/float16, same stride rules), so the wrapper, its strides and its backward
are checked here by calling the kernel function directly.
"""

from __future__ import annotations

import re

import pytest
import torch

from blockdiag import BlockDiagError, Problem, grouped_linear
from blockdiag.backends import get
from blockdiag.backends.grouped_mm import _constraint, _grouped_mm_op, grouped_mm
from blockdiag.testing import reference_loop, tolerances

pytestmark = pytest.mark.skipif(_grouped_mm_op() is None, reason="this torch has no grouped GEMM")

CPU_DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]


def _ref_grads(x, w, b, r):
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = reference_loop(xr, wr, br)
    return y, torch.autograd.grad((y * r).sum(), (xr, wr, br))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n, g, i, o", [(6, 3, 8, 16), (1, 1, 8, 8), (33, 7, 16, 8)], ids=["3x(8->16)", "G1", "7x(16->8)"])
def test_kernel_matches_reference_with_grads(dtype, n, g, i, o):
    x = torch.randn(n, g * i, dtype=dtype, requires_grad=True)
    w = torch.randn(g, o, i, dtype=dtype, requires_grad=True)
    b = torch.randn(g * o, dtype=dtype, requires_grad=True)
    y = grouped_mm(x, w, b)
    r = torch.randn_like(y)
    yr, want = _ref_grads(x, w, b, r)
    tol = tolerances(dtype, max(i, o, n))
    torch.testing.assert_close(y, yr, **tol)
    got = torch.autograd.grad((y * r).sum(), (x, w, b))
    assert got[1].shape == (g, o, i)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, **tol)


def test_broadcast_gradient_is_accepted():
    # y.sum() hands back a stride-0 gradient, which torch's own _grouped_mm derivative rejects.
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(2, 8, 8, requires_grad=True)
    grouped_mm(x, w, None).sum().backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    reference_loop(xr, wr, None).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


def test_offset_and_strided_inputs():
    # A view starting one row in (a misaligned base pointer on CUDA) and a transposed weight.
    big = torch.randn(9, 24)
    x = big[1:]
    w = torch.randn(3, 8, 8).transpose(1, 2)
    torch.testing.assert_close(grouped_mm(x, w, None), reference_loop(x, w, None))


def test_declared_for_bf16_cuda_only():
    be = get("grouped_mm")
    assert dict(be.dtypes) == {"cuda": frozenset({torch.bfloat16})}
    why = be.decline_reason(Problem(8, 2, 8, 8, torch.bfloat16, "cpu"))
    assert why and "does not run on cpu" in why
    with pytest.raises(BlockDiagError, match="grouped_mm"):
        grouped_linear(torch.randn(8, 16), torch.randn(2, 8, 8), backend="grouped_mm")


@pytest.mark.parametrize(
    "p, match",
    [
        (Problem(8, 4, 12, 16, torch.bfloat16, "cuda"), r"block 12x16 .*multiples of 8"),
        (Problem(8, 4, 16, 4, torch.bfloat16, "cuda"), r"block 16x4 .*multiples of 8"),
        (Problem(0, 4, 16, 16, torch.bfloat16, "cuda"), r"empty batch"),
    ],
    ids=["in-not-aligned", "out-not-aligned", "empty"],
)
def test_constraint_reasons(p, match):
    why = _constraint(p)
    assert why is not None
    assert re.search(match, why), why


def test_constraint_accepts_aligned_blocks():
    assert _constraint(Problem(8, 4, 16, 8, torch.bfloat16, "cuda")) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report on a machine without CUDA")
def test_unavailable_without_cuda():
    assert "CUDA" in get("grouped_mm").unavailable_reason()
