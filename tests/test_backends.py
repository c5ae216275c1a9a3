"""Every registered backend against the plain references, on every device and dtype it declares.

The parameter grid is read from the registry at collection time, so a backend registered later
is run without editing this file. Which combinations a backend must refuse is written out here
(:func:`_expected_refusal`), not read back from the backend's own ``decline_reason()``: a
combination the table refuses must be refused with a matching reason (and asking for it must
raise :class:`BlockDiagError` with that reason), and every other one must run and match the
references. A backend that gains a constraint therefore needs a row here.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import textwrap

import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockdiag
from blockdiag import BlockDiagError, Problem, grouped_linear
from blockdiag.backends import get, names
from blockdiag.testing import backend_tolerances, reference_loop, reference_scipy, tolerances

from _builds import quick_compiler
from _params import CUDA, CUDA_MARKS, DEVICES, backend_spy, require_backend, run_or_fail_on_hang


BACKENDS = [pytest.param(n, id=n) for n in names()]
DEVICE_DTYPES = [
    pytest.param(dev, dt, id=f"{dev}-{str(dt).replace('torch.', '')}",
                 marks=CUDA_MARKS if dev == "cuda" else [])
    for dev in ("cpu", "cuda")
    for dt in (torch.float32, torch.float64)
]

# (leading dims of x, groups, block_in, block_out)
SHAPES = [
    pytest.param((5,), 1, 3, 4, id="G1"),
    pytest.param((7,), 3, 1, 1, id="block1x1"),
    pytest.param((6,), 4, 5, 2, id="nonsquare-wide"),
    pytest.param((4,), 2, 3, 7, id="nonsquare-tall"),
    pytest.param((2, 3), 4, 4, 4, id="lead2d"),
    pytest.param((), 3, 2, 5, id="no-lead"),
    pytest.param((0,), 2, 3, 3, id="empty-batch"),
    pytest.param((9,), 5, 12, 8, id="gcd4"),
    pytest.param((3,), 50, 10, 10, id="forum"),
]


def _available(name: str) -> None:
    why = get(name).unavailable_reason()
    if why:
        pytest.skip(f"backend {name!r} unavailable here: {why}")


def _inputs(lead, g, i, o, dtype, device, bias=True):
    x = torch.randn(*lead, g * i, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(g, o, i, dtype=dtype, device=device, requires_grad=True)
    b = torch.randn(g * o, dtype=dtype, device=device, requires_grad=True) if bias else None
    return x, w, b


def _problem(lead, g, i, o, dtype, device, grad):
    n = int(np.prod(lead)) if lead else 1
    return Problem(n, g, i, o, dtype, device, grad)


LOW_PRECISION = (torch.float16, torch.bfloat16)
# The device types each backend is expected not to run on at all.
NOT_ON_DEVICE = {"cpu": {"grouped_mm"}, "cuda": {"mkl_batch", "simd"}}
# Backends expected to refuse float32 and float64 on a device (grouped_mm: bfloat16 only).
NO_F32_F64 = {"cuda": {"grouped_mm"}}


def _dt(dtype):
    return str(dtype).replace("torch.", "")


def _expected_refusal(name, p):
    """The regex the reason must fully match when ``name`` is expected to refuse ``p``, or None.

    Written out, not taken from the backend: float32/float64 run everywhere a backend runs
    except where listed above, and the shape rules are listed one by one. Only what depends
    on the installation follows it: a backend that cannot run here at all, and torch-sparse
    built without CUDA. Half precision follows the declared dtypes (each declared one is
    then run against the float64 reference).
    """
    if name in NOT_ON_DEVICE[p.device]:
        return rf"does not run on {p.device} \(runs on [a-z, ]+\)"
    why = get(name).unavailable_reason()
    if why:
        return rf"unavailable: {re.escape(why)}"
    if (p.dtype in LOW_PRECISION and p.dtype not in get(name).dtypes.get(p.device, ())) or (
        p.dtype not in LOW_PRECISION and name in NO_F32_F64.get(p.device, ())
    ):
        return rf"does not support {_dt(p.dtype)} on {p.device} \(supports [a-z0-9, ]+\)"
    if name == "conv" and p.batch == 0:
        return r"conv1d rejects an empty batch"
    if name == "bsr" and p.device == "cuda" and math.gcd(p.block_in, p.block_out) == 1:
        return (rf"block {p.block_in}x{p.block_out} \(in x out\) has coprime sides, so its square sub-blocks "
                r"are 1x1, which torch's CUDA BSR product rejects \(use 'csr'\)")
    if name == "torch_sparse" and p.device == "cuda":
        from blockdiag.backends.torch_sparse import _built_with_cuda

        if not _built_with_cuda():
            return r"torch-sparse was built without CUDA \(.*\)"
    return None


def _check_refusal(name, p):
    """Assert that ``decline_reason`` agrees with the table; return whether ``p`` is refused."""
    want = _expected_refusal(name, p)
    why = get(name).decline_reason(p)
    if want is None:
        assert why is None, f"{name} refuses {p.describe()}, which it must run: {why}"
        return False
    assert why is not None and re.fullmatch(want, why), (
        f"{name} on {p.describe()}: expected a refusal matching {want!r}, got {why!r}")
    return True


def _expect_decline(name, lead, g, i, o, dtype, device, grad):
    """Return True (after checking the error) when the table says ``name`` refuses this case.

    Otherwise return False, having checked that the backend does not refuse it either.
    """
    p = _problem(lead, g, i, o, dtype, device, grad)
    if not _check_refusal(name, p):
        return False
    why = get(name).decline_reason(p)
    x, w, b = _inputs(lead, g, i, o, dtype, device)
    message = rf"^grouped_linear: backend {re.escape(repr(name))} cannot run .*: {re.escape(why)}$"
    with pytest.raises(BlockDiagError, match=message):
        with torch.set_grad_enabled(grad):
            grouped_linear(x if grad else x.detach(), w if grad else w.detach(), b if grad else None, backend=name)
    return True


def _scipy_grads(x, w, r):
    """Gradients of ``sum(r * (x @ W.T + b))`` for the dense ``W = block_diag(*w)``, in numpy."""
    g, o, i = w.shape
    wd = scipy.linalg.block_diag(*w.detach().cpu().double().numpy())
    x2 = x.detach().cpu().double().numpy().reshape(-1, g * i)
    r2 = r.detach().cpu().double().numpy().reshape(-1, g * o)
    dx = (r2 @ wd).reshape(x.shape)
    dfull = r2.T @ x2
    dw = np.stack([dfull[k * o:(k + 1) * o, k * i:(k + 1) * i] for k in range(g)])
    db = r2.sum(0)
    return [torch.from_numpy(np.ascontiguousarray(a)).to(x.dtype) for a in (dx, dw, db)]


@pytest.mark.parametrize("lead, g, i, o", SHAPES)
@pytest.mark.parametrize("device, dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("name", BACKENDS)
def test_forward_backward_matches_references(name, device, dtype, lead, g, i, o):
    _available(name)
    if _expect_decline(name, lead, g, i, o, dtype, device, True):
        return
    # On CUDA conv (cuDNN) and bsr (Triton) may compute float32 in TF32 (backend_tolerances).
    tol = backend_tolerances(name, _problem(lead, g, i, o, dtype, device, True), max(i, int(np.prod(lead)) if lead else 1))
    x, w, b = _inputs(lead, g, i, o, dtype, device)
    y = grouped_linear(x, w, b, backend=name)
    assert y.shape == (*lead, g * o) and y.dtype == dtype and y.device.type == device

    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    yr = reference_loop(xr, wr, br)
    torch.testing.assert_close(y, yr, **tol)
    torch.testing.assert_close(y, reference_scipy(x, w, b), **tol)

    r = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad((y * r).sum(), (x, w, b))
    gxr, gwr, gbr = torch.autograd.grad((yr * r).sum(), (xr, wr, br))
    for got, want in ((gx, gxr), (gw, gwr), (gb, gbr)):
        assert got.layout == torch.strided and got.shape == want.shape
        torch.testing.assert_close(got, want, **tol)
    for got, want in zip((gx, gw, gb), _scipy_grads(x, w, r)):
        torch.testing.assert_close(got.cpu(), want, **tol)


CPU_GRID_DTYPES = (torch.float32, torch.float64) + LOW_PRECISION


@pytest.mark.parametrize("name", BACKENDS)
def test_cpu_refusals_are_exactly_the_table(name):
    """Every case of the CPU grid, available here or not: refused exactly where the table says."""
    for lead, g, i, o in (s.values for s in SHAPES):
        for dtype in CPU_GRID_DTYPES:
            for grad in (False, True):
                _check_refusal(name, _problem(lead, g, i, o, dtype, "cpu", grad))


@pytest.mark.parametrize("name", BACKENDS)
def test_every_cpu_backend_runs_cases_against_the_reference(name):
    """Each backend that runs on CPU here computes the grid's cases it must run, in float64."""
    if name in NOT_ON_DEVICE["cpu"]:
        pytest.skip(f"{name} is not expected to run on CPU")
    _available(name)
    ran = 0
    for lead, g, i, o in (s.values for s in SHAPES):
        if _expect_decline(name, lead, g, i, o, torch.float64, "cpu", True):
            continue
        x, w, b = _inputs(lead, g, i, o, torch.float64, "cpu")
        with backend_spy() as calls:
            y = grouped_linear(x, w, b, backend=name)
        assert calls == [name]
        xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
        yr = reference_loop(xr, wr, br)
        torch.testing.assert_close(y, yr)
        r = torch.randn_like(y)
        for got, want in zip(torch.autograd.grad((y * r).sum(), (x, w, b)),
                             torch.autograd.grad((yr * r).sum(), (xr, wr, br))):
            torch.testing.assert_close(got, want)
        ran += 1
    # conv alone refuses one shape (the empty batch); every other backend runs them all
    assert ran == len(SHAPES) - (name == "conv")


# Every (backend, half dtype) that a backend declares on CPU, read from the registry.
HALF_CPU = [
    pytest.param(n, dt, id=f"{n}-{_dt(dt)}")
    for n in names()
    for dt in LOW_PRECISION
    if dt in get(n).dtypes.get("cpu", ())
]


def _scaled_inputs(lead, g, i, o, dtype):
    # nn.Linear-like scales keep outputs O(1), so low-precision tolerances stay meaningful
    # (as in test_cuda.py); rounded to ``dtype`` first, so the float64 reference sees the
    # same values.
    x = torch.randn(*lead, g * i).to(dtype).requires_grad_()
    w = ((torch.rand(g, o, i) * 2 - 1) / math.sqrt(i)).to(dtype).requires_grad_()
    b = (torch.rand(g * o) * 0.2 - 0.1).to(dtype).requires_grad_()
    return x, w, b


@pytest.mark.parametrize("lead, g, i, o", SHAPES)
@pytest.mark.parametrize("name, dtype", HALF_CPU)
def test_half_precision_on_cpu_matches_float64_reference(name, dtype, lead, g, i, o):
    _available(name)
    if _expect_decline(name, lead, g, i, o, dtype, "cpu", True):
        return
    n = int(np.prod(lead)) if lead else 1
    x, w, b = _scaled_inputs(lead, g, i, o, dtype)
    y = grouped_linear(x, w, b, backend=name)
    assert y.dtype == dtype and y.shape == (*lead, g * o)

    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    yd = reference_loop(xd, wd, bd)
    torch.testing.assert_close(y.double(), yd, **tolerances(dtype, i))

    r = torch.randn(y.shape).to(dtype)
    got = torch.autograd.grad((y * r).sum(), (x, w, b))
    want = torch.autograd.grad((yd * r.double()).sum(), (xd, wd, bd))
    for a, e in zip(got, want):
        assert a.dtype == dtype and a.layout == torch.strided and a.shape == e.shape
        mag = float(e.abs().max()) if e.numel() else 1.0
        torch.testing.assert_close(a.double(), e, **tolerances(dtype, max(n, i, o), mag))


# Every (backend, dtype) of float32 and float16 that a backend declares on CPU.
MANY_ROWS_CPU = [
    pytest.param(n, dt, id=f"{n}-{_dt(dt)}")
    for n in names()
    for dt in (torch.float32, torch.float16)
    if dt in get(n).dtypes.get("cpu", ())
]


@pytest.mark.parametrize("name, dtype", MANY_ROWS_CPU)
def test_weight_and_bias_gradients_over_many_rows_are_as_accurate_as_nn_linear(name, dtype):
    # The weight and bias gradients sum over every row. conv's were the convolution's own
    # (oneDNN's), whose error against float64 was 14x nn.Linear's for the float32 bias
    # gradient and 45x for the float16 weight gradient at these 4096 rows (growing with the
    # rows); every other backend's is within 2.3x of nn.Linear's (simd's bias gradient).
    _available(name)
    torch.manual_seed(0)
    n, g, i, o = 4096, 2, 16, 8
    x = torch.randn(n, g * i).to(dtype)
    w = torch.randn(g, o, i).to(dtype)
    b = torch.randn(g * o).to(dtype)
    gy = (torch.randn(n, g * o) + 1).to(dtype)  # a mean, as gradients have: the sums grow

    def grads(fn, *ops):
        ops = [t.clone().requires_grad_() for t in ops]
        return torch.autograd.grad(fn(*ops), ops[1:], gy)

    def err(a, e):
        return float((a.double() - e).norm() / e.norm())

    want = grads(reference_loop, x.double(), w.double(), b.double())
    linear = grads(reference_loop, x, w, b)  # nn.Linear per block, in dtype
    got = grads(lambda *a: grouped_linear(*a, backend=name), x, w, b)
    for what, a, t, e in zip(("weight", "bias"), got, linear, want):
        ours, theirs = err(a, e), err(t, e)
        assert ours <= 4 * theirs, f"{name} {what} gradient: error {ours:.2e}, nn.Linear's {theirs:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_tolerances_fail_a_result_twice_or_none_of_the_expected(dtype):
    # blockdiag.testing.tolerances is what backends' tests compare with: a check built on it
    # must fail a gradient scaled by 2 or zeroed, however small the result (a magnitude below
    # 1 was read as 1: bfloat16's atol 0.02 passed anything under 0.01, a mean's gradient) or
    # long the reduction (k=16384 made bfloat16's rtol 0.64 and atol 0.64 * magnitude).
    base = torch.linspace(-1, 1, 101, dtype=torch.float64)
    for size in (1e-3, 1.0, 300.0):
        want = base * size
        for k in (1, 64, 16384, 10**8):
            tol = tolerances(dtype, k, magnitude=float(want.abs().max()))
            for wrong in (2 * want, 0 * want):
                with pytest.raises(AssertionError):
                    torch.testing.assert_close(wrong, want, **tol)
        # ... and still pass the expected result rounded to the dtype.
        torch.testing.assert_close(want.to(dtype).double(), want, **tolerances(dtype, magnitude=size))
    with pytest.raises(BlockDiagError, match=r"tolerances: k=-1 must be"):
        tolerances(dtype, -1)
    with pytest.raises(BlockDiagError, match=r"tolerances: k=nan must be"):
        tolerances(dtype, float("nan"))
    with pytest.raises(BlockDiagError, match=r"tolerances: dtype=torch.int32 has none"):
        tolerances(torch.int32)
    # An expected result holding an Inf: its magnitude would make atol Inf, passing anything.
    want = torch.tensor([1.0, float("inf")], dtype=torch.float64)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(torch.tensor([2.0, float("inf")], dtype=torch.float64), want,
                                   **tolerances(dtype, magnitude=float(want.abs().max())))


def test_float32_tolerances_fail_a_result_of_float16_rounding():
    # backend_tolerances gives a TF32 backend float16's tolerances because float32's must fail
    # a result with a 10-bit mantissa: loosened too fast with the reduction's length (k, not
    # sqrt(k) / 4), float32's passed float16's rounding from a few dozen terms on.
    want = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rounded = want.to(torch.float16).double()
    for k in (1, 64):
        with pytest.raises(AssertionError):
            torch.testing.assert_close(rounded, want, **tolerances(torch.float32, k, magnitude=float(want.abs().max())))
        torch.testing.assert_close(rounded, want, **tolerances(torch.float16, k, magnitude=float(want.abs().max())))


@pytest.mark.parametrize("grad_kind", ["expanded", "transposed"])
@pytest.mark.parametrize("device, dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("name", BACKENDS)
def test_backward_with_non_contiguous_output_grad(name, device, dtype, grad_kind):
    # y.sum() hands the backward a stride-0 gradient, and a gradient flowing back from a
    # transpose is column-major; backends that slice or write gradients in place must
    # read them correctly.
    _available(name)
    lead, g, i, o = (7,), 3, 4, 5
    if _expect_decline(name, lead, g, i, o, dtype, device, True):
        return
    x, w, b = _inputs(lead, g, i, o, dtype, device)
    if grad_kind == "expanded":
        gy = torch.ones((), dtype=dtype, device=device).expand(7, g * o)
    else:
        gy = torch.randn(g * o, 7, dtype=dtype, device=device).t()
    assert not gy.is_contiguous()
    got = torch.autograd.grad(grouped_linear(x, w, b, backend=name), (x, w, b), gy)
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    want = torch.autograd.grad(reference_loop(xr, wr, br), (xr, wr, br), gy.contiguous())
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, **backend_tolerances(name, _problem(lead, g, i, o, dtype, device, True), 7))


@pytest.mark.parametrize("device, dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("name", BACKENDS)
def test_no_bias_and_forward_only(name, device, dtype):
    _available(name)
    lead, g, i, o = (6,), 3, 4, 5
    if _expect_decline(name, lead, g, i, o, dtype, device, False):
        return
    x, w, _ = _inputs(lead, g, i, o, dtype, device, bias=False)
    with torch.no_grad():
        y = grouped_linear(x, w, None, backend=name)
    assert not y.requires_grad
    torch.testing.assert_close(y, reference_loop(x, w, None).detach(), **tolerances(dtype))


@pytest.mark.parametrize("name", BACKENDS)
def test_weight_only_grad(name):
    """A frozen input (the usual case: data) still gives exact weight and bias gradients."""
    _available(name)
    x = torch.randn(8, 12, dtype=torch.float64)
    w = torch.randn(3, 2, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    if _check_refusal(name, Problem(8, 3, 4, 2, torch.float64, "cpu", True)):
        pytest.skip(f"{name} is expected to decline this case on CPU")
    gw, gb = torch.autograd.grad(grouped_linear(x, w, b, backend=name).square().sum(), (w, b))
    rw, rb = torch.autograd.grad(reference_loop(x, w, b).square().sum(), (w, b))
    torch.testing.assert_close(gw, rw)
    torch.testing.assert_close(gb, rb)


GRADCHECK_SHAPES = [
    pytest.param((3,), 2, 3, 2, id="2x(3->2)"),
    pytest.param((2, 2), 3, 2, 4, id="3x(2->4)-lead2d"),
    pytest.param((4,), 1, 4, 4, id="G1"),
]


@pytest.mark.parametrize("lead, g, i, o", GRADCHECK_SHAPES)
@pytest.mark.parametrize("device", [p for p in ("cpu", "cuda")], ids=str)
@pytest.mark.parametrize("name", BACKENDS)
def test_gradcheck_float64(name, device, lead, g, i, o):
    if device == "cuda" and not CUDA:
        pytest.skip("CUDA is not available")
    _available(name)
    if _expect_decline(name, lead, g, i, o, torch.float64, device, True):
        return
    x, w, b = _inputs(lead, g, i, o, torch.float64, device)
    assert torch.autograd.gradcheck(lambda x, w, b: grouped_linear(x, w, b, backend=name), (x, w, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(0, 6),
    g=st.integers(1, 6),
    i=st.integers(1, 7),
    o=st.integers(1, 7),
    grad=st.booleans(),
    bias=st.booleans(),
)
def test_hypothesis_shapes(name, device, n, g, i, o, grad, bias):
    _available(name)
    if _expect_decline(name, (n,), g, i, o, torch.float64, device, grad):
        return
    x, w, b = _inputs((n,), g, i, o, torch.float64, device, bias)
    with torch.set_grad_enabled(grad):
        y = grouped_linear(x, w, b, backend=name)
        yr = reference_loop(x, w, b)
    torch.testing.assert_close(y, yr)
    if grad and n > 0:
        params = (x, w) + ((b,) if bias else ())
        r = torch.randn_like(y)
        for got, want in zip(torch.autograd.grad((y * r).sum(), params), torch.autograd.grad((yr * r).sum(), params)):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 40),
    g=st.integers(1, 64),
    i=st.integers(1, 24),
    o=st.integers(1, 24),
    grad=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_auto_never_picks_a_failing_backend(device, n, g, i, o, grad, dtype):
    x = torch.randn(n, g * i, dtype=dtype, device=device, requires_grad=grad)
    w = torch.randn(g, o, i, dtype=dtype, device=device, requires_grad=grad)
    # The problem of the call below: no bias, autograd recording exactly when grad is set.
    p = Problem(n, g, i, o, dtype, device, grad)
    chosen = blockdiag.choose(p).backend
    assert not _check_refusal(chosen, p), f"auto chose {chosen!r}, which must refuse {p.describe()}"
    with backend_spy() as ran:
        y = grouped_linear(x, w, None)
    assert ran == [chosen], f"planned {chosen!r} for {p.describe()}, ran {ran}"
    # The reference in float64: on CUDA some float32 products run in TF32 (backend_tolerances).
    xr, wr = (t.detach().double().requires_grad_(grad) for t in (x, w))
    yr = reference_loop(xr, wr, None)
    torch.testing.assert_close(y.double(), yr, **backend_tolerances(chosen, p, i))
    assert y.requires_grad == grad and y.dtype == dtype and y.device == x.device
    if grad:
        r = torch.randn_like(y)
        got = torch.autograd.grad((y * r).sum(), (x, w))
        want = torch.autograd.grad((yr * r.double()).sum(), (xr, wr))
        for a, e in zip(got, want):
            mag = float(e.abs().max()) if e.numel() else 1.0
            torch.testing.assert_close(a.double(), e, **backend_tolerances(chosen, p, max(n, i, o), mag))


def test_registry_lists_every_backend_with_availability():
    infos = blockdiag.list_backends()
    assert [b.name for b in infos] == list(names())
    assert {"loop", "dense", "bmm", "conv", "csr", "bsr"} <= {b.name for b in infos}
    for b in infos:
        assert b.available == (b.reason == "")
        assert b.summary
        assert b.name in str(b)


def test_declared_constraints_are_data():
    """Each backend states devices, dtypes and grad support as data; declines give reasons."""
    for n in names():
        be = get(n)
        assert be.dtypes and all(isinstance(v, frozenset) for v in be.dtypes.values())
        assert "cpu" in be.dtypes or "cuda" in be.dtypes
        why = be.decline_reason(Problem(4, 2, 3, 3, torch.float64, "meta", False))
        assert why and "meta" in why


def test_unknown_backend_lists_valid_names():
    x, w = torch.randn(2, 4), torch.randn(2, 3, 2)
    with pytest.raises(BlockDiagError, match=r"unknown backend 'nope'.*'auto'.*'loop'.*'bsr'"):
        grouped_linear(x, w, backend="nope")


def test_register_duplicate_name_raises():
    from blockdiag.backends._registry import register

    with pytest.raises(BlockDiagError, match="already registered"):
        register(get("loop"))


@pytest.mark.parametrize(
    "x_shape, w_shape, b_shape, match",
    [
        ((4, 7), (2, 3, 3), None, r"input has shape \(4, 7\).*in_features=6 \(groups=2 x block_in=3\)"),
        ((4, 6), (6,), None, r"weight must be \[groups, block_out, block_in\], got shape \(6,\)"),
        ((4, 6), (2, 3, 3), (5,), r"bias must have shape \(6,\), got \(5,\)"),
        ((), (2, 3, 3), None, r"scalar"),
    ],
    ids=["wrong-last-dim", "1d-weight", "bias-shape", "scalar-input"],
)
def test_bad_shapes(x_shape, w_shape, b_shape, match):
    b = torch.randn(*b_shape) if b_shape else None
    with pytest.raises(BlockDiagError, match=match):
        grouped_linear(torch.randn(x_shape), torch.randn(w_shape), b)


def test_mixed_dtypes_raise():
    with pytest.raises(BlockDiagError, match=r"float64.*float32|float32.*float64"):
        grouped_linear(torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 3, 2))


@pytest.mark.skipif(not CUDA, reason="CUDA is not available")
@pytest.mark.cuda
def test_mixed_devices_raise():
    with pytest.raises(BlockDiagError, match=r"cuda.*cpu|cpu.*cuda"):
        grouped_linear(torch.randn(2, 4, device="cuda"), torch.randn(2, 3, 2))


def test_mixed_devices_raise_on_meta():
    # Exercised on every machine: the meta device stands in for a second device.
    with pytest.raises(BlockDiagError, match=r"meta.*cpu|cpu.*meta"):
        grouped_linear(torch.randn(2, 4, device="meta"), torch.randn(2, 3, 2))


def test_integer_input_raises():
    with pytest.raises(BlockDiagError, match="int64"):
        grouped_linear(torch.ones(2, 4, dtype=torch.int64), torch.ones(2, 3, 2, dtype=torch.int64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", BACKENDS)
def test_double_backward_follows_declaration(name, device):
    """``double_grad=True`` backends pass gradgradcheck; the others refuse, never return a constant."""
    _available(name)
    lead, g, i, o = (3,), 2, 4, 2  # gcd 2: bsr runs on CUDA too
    if _expect_decline(name, lead, g, i, o, torch.float64, device, True):
        return
    x, w, b = _inputs(lead, g, i, o, torch.float64, device)
    fn = lambda x, w, b: grouped_linear(x, w, b, backend=name)  # noqa: E731
    if get(name).double_grad:
        assert torch.autograd.gradgradcheck(fn, (x, w, b))
    else:
        y = fn(x, w, b)
        with pytest.raises(BlockDiagError, match=rf"{name}: the backward is first-order only"):
            torch.autograd.grad(y.square().sum(), (x,), create_graph=True)
        # plain first-order backward still works
        (gx,) = torch.autograd.grad(fn(x, w, b).square().sum(), (x,))
        torch.testing.assert_close(gx, torch.autograd.grad(reference_loop(x, w, b).square().sum(), (x,))[0])


# Without anything to differentiate, a backend's autograd Function (several us) must be
# skipped, not merely leave no graph behind (which Function.apply would do as well); with
# something to differentiate, the graph node is the backend's own.
@pytest.mark.parametrize("name", BACKENDS)
def test_backends_skip_their_autograd_function_without_grad(name, monkeypatch):
    _available(name)
    if "cpu" not in get(name).dtypes:
        pytest.skip(f"{name} does not run on CPU")
    cls = get(name).fn._eager_fn
    x, w = torch.randn(4, 6), torch.randn(2, 3, 3)
    want = reference_loop(x, w, None)

    def refuse(*_):
        raise AssertionError("autograd Function used without grad")

    with monkeypatch.context() as m:
        m.setattr(cls, "apply", refuse)
        torch.testing.assert_close(grouped_linear(x, w, None, backend=name), want)
        with torch.no_grad():
            torch.testing.assert_close(grouped_linear(x, w.clone().requires_grad_(), None, backend=name), want)
    y = grouped_linear(x, w.requires_grad_(), None, backend=name)
    assert y.grad_fn is not None
    if not get(name).fn.eager_autograd:  # else torch's own derivatives of its ops record it
        assert type(y.grad_fn).__name__.startswith(f"{name}_Eager")


@pytest.mark.parametrize("observed", ["forward", "backward"])
@pytest.mark.parametrize("name", BACKENDS)
def test_checkpoint_with_a_dispatch_mode_around_one_pass(name, observed):
    # checkpoint(use_reentrant=False) matches the saved tensors of the forward with those of
    # its recomputation (in the backward). A mode (FlopCounterMode) or profiler around one of
    # them sends that pass through the op: bmm_fm and conv saved other tensors in their eager
    # torch ops than the op saves, and the backward failed with CheckpointError.
    from torch.utils.checkpoint import checkpoint
    from torch.utils.flop_counter import FlopCounterMode

    _available(name)
    if "cpu" not in get(name).dtypes:
        pytest.skip(f"{name} does not run on CPU")
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    with FlopCounterMode(display=False) if observed == "forward" else contextlib.nullcontext():
        y = checkpoint(grouped_linear, x, w, b, name, use_reentrant=False)
    with FlopCounterMode(display=False) if observed == "backward" else contextlib.nullcontext():
        got = torch.autograd.grad(y.square().sum(), (x, w, b))
    want = torch.autograd.grad(reference_loop(x, w, b).square().sum(), (x, w, b))
    torch.testing.assert_close(y, reference_loop(x, w, b))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_listing_backends_and_planning_leave_the_process_safe_to_fork(tmp_path):
    # The availability probes run in every process that lists backends or plans (asv's
    # benchmark server forks its runners after that). Had one run OpenMP or MKL code (the
    # compiled backends' probes must not: simd's compiles and loads, here from a fresh
    # cache, and mkl_batch's looks up symbols), the forked child would hang in its first
    # parallel op; the child's exit within the timeout is the check. Two threads asked for:
    # with one (CI's OMP_NUM_THREADS=1) no pool is ever started and the test could not fail.
    script = textwrap.dedent(
        """
        import os, sys, torch, blockdiag
        from blockdiag.backends import get
        torch.set_num_threads(2)
        expected = sys.argv[1].split(",") if sys.argv[1] else []
        assert all(get(n).unavailable_reason() is None for n in expected), expected
        blockdiag.list_backends()
        blockdiag.choose(blockdiag.Problem(256, 50, 10, 10, requires_grad=True))
        pid = os.fork()
        if pid == 0:
            torch.bmm(torch.randn(50, 2048, 64), torch.randn(50, 64, 64))
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        raise SystemExit(os.waitstatus_to_exitcode(status))
        """
    )
    available = ",".join(n for n in ("mkl_batch", "simd") if get(n).unavailable_reason() is None)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CC": quick_compiler(tmp_path / "quick"),
           "CXX": quick_compiler(tmp_path / "quick", "CXX", "c++")}
    # Its own session, so that a hung child (orphaned when the parent is killed) goes too.
    code, _, err = run_or_fail_on_hang([sys.executable, "-c", script, available], 120,
                                       "a child forked after listing backends and planning (torch.bmm)", env=env)
    assert code == 0, err


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("backend", ["simd", "mkl_batch"])
def test_a_small_simd_or_mkl_batch_call_leaves_the_process_safe_to_fork(tmp_path, backend):
    # A child forked after its parent started OpenMP's thread pool hangs in its first parallel
    # region. torch's small ops start none, but the first call of simd or mkl_batch did, however
    # small: their self-checks' reference was torch.bmm (which starts the pool at any size),
    # simd's kernels opened a parallel region on all of torch's threads and MKL's batched GEMM
    # woke its pool at any size. A parent that ran one tiny forward and backward, then forked
    # (Hogwild!-style training), hung its child. Two threads asked for here: with one, no pool
    # is ever started. The thread count (Linux) says so directly; the fork is the symptom.
    require_backend(backend)
    script = textwrap.dedent(
        """
        import os, sys, torch, blockdiag
        torch.set_num_threads(2)
        def threads():
            return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0
        torch.randn(3, 4) @ torch.randn(4, 5)
        before = threads()
        for dtype in (torch.float32, torch.float64):
            layer = blockdiag.GroupedLinear(8, 6, 2, backend=sys.argv[1], dtype=dtype)
            layer(torch.randn(3, 8, dtype=dtype)).sum().backward()
            blockdiag.GroupedLinear(8, 8, 2, backend=sys.argv[1], dtype=dtype)(torch.randn(1, 8, dtype=dtype))
        assert threads() == before, f"{threads() - before} threads started"
        pid = os.fork()
        if pid == 0:
            torch.bmm(torch.randn(50, 2048, 64), torch.randn(50, 64, 64))
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        raise SystemExit(os.waitstatus_to_exitcode(status))
        """
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CC": quick_compiler(tmp_path / "quick"),
           "CXX": quick_compiler(tmp_path / "quick", "CXX", "c++")}
    code, _, err = run_or_fail_on_hang([sys.executable, "-c", script, backend], 120,
                                       f"a child forked after a small {backend} call (torch.bmm)", env=env)
    assert code == 0, err


@pytest.mark.parametrize(
    "out, inp, device, side",
    [
        pytest.param(256, 256, "cpu", 256, id="cpu-gcd"),
        pytest.param(256, 256, "cuda", 64, id="cuda-capped"),
        pytest.param(96, 96, "cuda", 48, id="cuda-largest-divisor"),
        pytest.param(128, 64, "cuda", 64, id="cuda-at-cap"),
        pytest.param(150, 10, "cuda", 10, id="cuda-under-cap"),
        pytest.param(7, 5, "cuda", 1, id="cuda-coprime"),
    ],
)
def test_bsr_subblock_side(out, inp, device, side):
    from blockdiag.backends.bsr import CUDA_MAX_SUBBLOCK, subblock_side

    s = subblock_side(out, inp, device)
    assert s == side and out % s == 0 and inp % s == 0
    assert device == "cpu" or s <= CUDA_MAX_SUBBLOCK
