"""Strided, offset, negated, conjugated, expanded, overlapping and subclassed operands.

The views the fuzz tests draw (``tests/test_native_hardening.py`` for the compiled kernels,
``tests/test_fuzz_backends.py`` for every backend) and the one check they share: a backend
against the float64 loop reference, outputs and the gradients of input, weight and bias.
"""

from __future__ import annotations

import pytest
import torch

from blockdiag import BlockDiagError, grouped_linear
from blockdiag.backends import get
from blockdiag.testing import reference_loop, tolerances

X_KINDS = ["plain", "slice", "column-major", "neg", "conj().imag", "expanded", "overlapping", "offset", "subclass"]
W_KINDS = ["plain", "transposed", "neg", "expanded", "offset", "subclass"]
B_KINDS = ["none", "plain", "neg", "expanded"]
GY_KINDS = ["plain", "slice", "column-major", "neg", "expanded", "overlapping"]


class Subclass(torch.Tensor):
    """A trivial tensor subclass: it must give the same numbers as a plain tensor."""


def view(kind: str, rows: int, cols: int, dtype, gen):
    """``(leaf, view)``: a leaf tensor and a ``[rows, cols]`` view of it of the given kind."""
    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dt)

    if kind == "slice":  # a column slice at an offset: row stride above the width
        leaf = rand(rows, cols + 5)
        return leaf, lambda t: t[:, 2 : 2 + cols]
    if kind == "column-major":
        leaf = rand(cols, rows)
        return leaf, lambda t: t.t()
    if kind == "neg":
        leaf = rand(rows, cols)
        return leaf, torch._neg_view
    if kind == "conj().imag":
        leaf = torch.complex(rand(rows, cols), rand(rows, cols))
        return leaf, lambda t: t.conj().imag
    if kind == "expanded":  # every row the same (row stride 0)
        leaf = rand(1, cols)
        return leaf, lambda t: t.expand(rows, cols)
    if kind == "overlapping":  # rows that overlap (row stride 1)
        leaf = rand(rows + cols)
        return leaf, lambda t: t.as_strided((rows, cols), (1, 1), 0)
    if kind == "offset":
        leaf = rand(rows * cols + 3)
        return leaf, lambda t: t[3:].view(rows, cols)
    if kind == "subclass":  # goes through the registered op, not the eager fast path
        leaf = rand(rows, cols)
        return leaf, lambda t: t.as_subclass(Subclass)
    leaf = rand(rows, cols)
    return leaf, lambda t: t


def weight_view(kind: str, g: int, o: int, i: int, dtype, gen):
    """``(leaf, view)``: a leaf weight and a ``[g, o, i]`` view of it of the given kind."""
    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    if kind == "transposed":
        return rand(g, i, o), lambda t: t.transpose(1, 2)
    if kind == "neg":
        return rand(g, o, i), torch._neg_view
    if kind == "expanded":  # one weight shared by every group (stride 0)
        return rand(1, o, i), lambda t: t.expand(g, o, i)
    if kind == "offset":
        return rand(g * o * i + 3), lambda t: t[3:].view(g, o, i)
    if kind == "subclass":
        return rand(g, o, i), lambda t: t.as_subclass(Subclass)
    return rand(g, o, i), lambda t: t


def check_against_reference(name, dtype, n, g, i, o, xk, wk, bk, gk, seed):
    """Backend ``name`` on the drawn views against the float64 loop: outputs and all gradients."""
    gen = torch.Generator().manual_seed(seed)
    xleaf, xf = view(xk, n, g * i, dtype, gen)
    wleaf, wf = weight_view(wk, g, o, i, dtype, gen)
    if bk == "none":
        bleaf, bf = None, None
    elif bk == "expanded":
        bleaf, bf = torch.randn(1, generator=gen, dtype=torch.float64).to(dtype), (lambda t: t.expand(g * o))
    else:
        bleaf = torch.randn(g * o, generator=gen, dtype=torch.float64).to(dtype)
        bf = torch._neg_view if bk == "neg" else (lambda t: t)
    gleaf, gfn = view(gk, n, g * o, dtype, gen)
    gy = gfn(gleaf)

    leaves = [t for t in (xleaf, wleaf, bleaf) if t is not None]
    got_leaves = [t.clone().requires_grad_() for t in leaves]
    ref_leaves = [(t.to(torch.complex128) if t.is_complex() else t.double()).requires_grad_() for t in leaves]

    def operands(ls):
        return [xf(ls[0]), wf(ls[1])] + ([bf(ls[2])] if bleaf is not None else [])

    def run(fn, ls):
        ops = operands(ls)
        return fn(*ops, *([None] if bleaf is None else []))

    if "subclass" in (xk, wk) and getattr(get(name).fn, "native", False) if name != "auto" else False:
        # The compiled kernels run on plain tensors only: a subclass is refused by name
        # (``auto`` routes it to a backend that runs it).
        with pytest.raises(BlockDiagError, match="plain strided CPU tensor .* got Subclass"):
            run(lambda x, w, b: grouped_linear(x, w, b, backend=name), got_leaves)
        return
    # The gradients compared are those of the op's operands (the views), which the backend
    # returns; a leaf's own gradient adds only torch's view backward, which for an expanded
    # leaf sums the op's low-precision gradient over the expanded entries: a float64 sum of
    # those is off by a cancellation no tolerance in units of the result can bound.
    got_ops, ref_ops = operands(got_leaves), operands(ref_leaves)
    y = grouped_linear(*got_ops, *([None] if bleaf is None else []), backend=name)
    yr = reference_loop(*ref_ops, *([None] if bleaf is None else []))
    grads = torch.autograd.grad(y, got_ops, gy)
    want = torch.autograd.grad(yr, ref_ops, gy.double())
    k = max(i, o, n)
    tol = tolerances(dtype, k=k, magnitude=max(1.0, float(yr.detach().abs().max())))
    torch.testing.assert_close(y.double(), yr.detach(), **tol, msg=lambda m: f"y: {m}")
    for what, a, c in zip(("input", "weight", "bias"), grads, want):
        a = a.to(c.dtype)
        tol = tolerances(dtype, k=k * 4, magnitude=max(1.0, float(c.abs().max())))
        torch.testing.assert_close(a, c, **tol, msg=lambda m, what=what: f"{what} grad: {m}")
