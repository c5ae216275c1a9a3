"""``mkl_batch``'s own paths: pointer arithmetic on strided tensors, the probe, the constraint.

The shared backend tests (test_backends.py) cover outputs, gradients, gradcheck and drawn
shapes; these check what only this backend does: it reads row-major slices through their
leading dimension instead of copying, and it must refuse to run where its assumptions fail.
"""

from __future__ import annotations

import pytest
import torch

from blockdiag import BlockDiagError, Problem, grouped_linear
from blockdiag.backends import get, mkl_batch
from blockdiag.testing import reference_loop

pytestmark = pytest.mark.skipif(
    get("mkl_batch").unavailable_reason() is not None,
    reason=f"mkl_batch unavailable here: {get('mkl_batch').unavailable_reason()}",
)


def _grads(fn, x, w, b, gy):
    y = fn(x, w, b)
    return (y, *torch.autograd.grad(y, (x, w, b), gy))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_column_slice_of_a_wider_tensor_is_read_in_place(dtype, monkeypatch):
    # x is columns 3.. of a [9, 40] tensor: row stride 40 > G*in = 24. The GEMM must use
    # the leading dimension 40, not copy, and not assume 24.
    g, i, o = 3, 8, 5
    wide = torch.randn(9, 40, dtype=dtype)
    x = wide[:, 3 : 3 + g * i].detach().requires_grad_(True)
    assert not x.is_contiguous()
    w = torch.randn(g, o, i, dtype=dtype, requires_grad=True)
    b = torch.randn(g * o, dtype=dtype, requires_grad=True)
    gy = torch.randn(9, g * o, dtype=dtype)

    assert mkl_batch._check() is None  # the first call's check product, before recording
    seen = []
    real = mkl_batch._gemm
    monkeypatch.setattr(mkl_batch, "_gemm", lambda *a: (seen.append(a), real(*a))[1])
    got = _grads(lambda *t: grouped_linear(*t, backend="mkl_batch"), x, w, b, gy)
    assert seen[0][5] is x or seen[0][5].data_ptr() == x.data_ptr()  # no copy of x
    assert seen[0][7] == 40  # its leading dimension

    want = _grads(reference_loop, x, w, b, gy)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c)


def test_column_major_input_is_copied_and_correct():
    g, i, o = 2, 3, 4
    x = torch.randn(g * i, 6).t().requires_grad_(True)  # stride (1, 6): not row-major
    w = torch.randn(g, o, i, requires_grad=True)
    b = torch.randn(g * o, requires_grad=True)
    gy = torch.randn(6, g * o)
    got = _grads(lambda *t: grouped_linear(*t, backend="mkl_batch"), x, w, b, gy)
    want = _grads(reference_loop, x, w, b, gy)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c)


def test_missing_symbols_make_it_unavailable_with_the_reason(monkeypatch):
    monkeypatch.setattr(mkl_batch, "_kernels", lambda: (None, "torch's CPU library does not export MKL's cblas_sgemm_batch"))
    why = get("mkl_batch").unavailable_reason()
    assert why == "torch's CPU library does not export MKL's cblas_sgemm_batch"
    with pytest.raises(BlockDiagError, match="mkl_batch.*cblas_sgemm_batch"):
        grouped_linear(torch.randn(2, 4), torch.randn(2, 2, 2), None, backend="mkl_batch")


def test_an_mkl_that_disagrees_with_torch_is_refused_at_the_first_call(monkeypatch):
    real = mkl_batch._gemm

    def wrong(*a):
        real(*a)
        a[11].mul_(2)  # C

    monkeypatch.setattr(mkl_batch, "_gemm", wrong)
    mkl_batch._check.cache_clear()
    try:
        assert "did not match torch's float64 product" in mkl_batch._check()
        with pytest.raises(BlockDiagError, match="mkl_batch: MKL's batched GEMM did not match"):
            grouped_linear(torch.randn(2, 4), torch.randn(2, 2, 2), None, backend="mkl_batch")
    finally:
        mkl_batch._check.cache_clear()


def test_small_products_run_on_one_thread_and_restore_the_callers_setting(monkeypatch):
    # A product under SERIAL_MACS multiply-adds asks MKL for this thread alone (so no OpenMP
    # pool starts: test_backends' fork test) and gives back the caller's thread-local setting
    # afterwards, here 3, whatever MKL computed with; the larger one leaves it alone.
    local = mkl_batch._local_threads()
    assert local is not None, "torch's MKL exports MKL_Set_Num_Threads_Local"
    seen = []
    real = mkl_batch._kernels()[0][torch.float32][0]

    def spy(*a):
        seen.append(local(0))  # the setting MKL runs under (0: the global one), put back below
        local(seen[-1])
        return real(*a)

    found = {**mkl_batch._kernels()[0]}
    found[torch.float32] = (spy, found[torch.float32][1])
    monkeypatch.setattr(mkl_batch, "_kernels", lambda: (found, None))
    previous = local(3)
    try:
        for n in (1, mkl_batch.SERIAL_MACS // 64):  # [n, 16] @ 2 blocks 8x4: 64 multiply-adds a row
            x, w = torch.randn(n, 8), torch.randn(2, 8, 4)
            torch.testing.assert_close(mkl_batch._forward(x, w, None), reference_loop(x, w, None))
        assert local(3) == 3
    finally:
        local(previous)
    assert seen == [1, 3]


def test_a_library_without_the_thread_setter_still_computes(monkeypatch):
    monkeypatch.setattr(mkl_batch, "_local_threads", lambda: None)
    x, w, b = torch.randn(3, 8), torch.randn(2, 5, 4), torch.randn(10)
    torch.testing.assert_close(mkl_batch._forward(x, w, b), reference_loop(x, w, b))


def test_sizes_beyond_32_bits_are_declined():
    why = get("mkl_batch").decline_reason(Problem(2**31, 2, 4, 4))
    assert why is not None and str(2**31) in why and "32-bit" in why
    assert get("mkl_batch").decline_reason(Problem(2**31 - 1, 2, 4, 4)) is None


@pytest.mark.parametrize("which", ["x", "gy"])
def test_single_row_with_a_row_stride_below_its_width(which):
    # x.t() of a [W, 1] column is "contiguous" with strides (1, 1); passed on as the
    # leading dimension, MKL refuses the call and leaves the output unwritten.
    g, i, o = 3, 4, 5
    if which == "x":
        x = torch.randn(g * i, 1, dtype=torch.float64).t().requires_grad_(True)
        gy = torch.randn(1, g * o, dtype=torch.float64)
    else:
        x = torch.randn(1, g * i, dtype=torch.float64, requires_grad=True)
        gy = torch.randn(g * o, 1, dtype=torch.float64).t()
    assert (x if which == "x" else gy).stride() == (1, 1)
    w = torch.randn(g, o, i, dtype=torch.float64, requires_grad=True)
    b = torch.randn(g * o, dtype=torch.float64, requires_grad=True)
    got = _grads(lambda *t: grouped_linear(*t, backend="mkl_batch"), x, w, b, gy)
    want = _grads(reference_loop, x, w, b, gy)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c)


def test_auto_picks_it_for_training_and_double_backward_still_works(tmp_path):
    # A table with mkl_batch fastest for training at B=256 G=16 256x256 (which built-in entry
    # applies depends on the machine, so the test writes its own): a gradient penalty
    # through `auto` there must differentiate the backward, not refuse or drop it.
    from blockdiag import choose, config

    from _profiles import entry, point, write

    path = write(tmp_path / "p.json", entry([point("train", 256, 16, 256, 256, mkl_batch=10.0, bmm=20.0, loop=30.0)], dtype=torch.float64))
    with config(profile=str(path)):
        assert choose(Problem(256, 16, 256, 256, torch.float64, "cpu", True)).backend == "mkl_batch"
        _penalty_through_auto()


def _penalty_through_auto():
    g, i, o = 16, 256, 256
    x = torch.randn(256, g * i, dtype=torch.float64, requires_grad=True)
    w = torch.randn(g, o, i, dtype=torch.float64, requires_grad=True)
    b = torch.randn(g * o, dtype=torch.float64, requires_grad=True)

    def penalty(fn):
        (gx,) = torch.autograd.grad(fn(x, w, b).square().sum(), (x,), create_graph=True)
        return torch.autograd.grad(gx.square().sum(), (x, w, b))

    got = penalty(grouped_linear)  # backend="auto"
    want = penalty(reference_loop)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c)


def test_gemm_refuses_an_operand_one_element_short():
    why = get("mkl_batch").unavailable_reason()
    if why:
        pytest.skip(why)
    w, y = torch.randn(2, 3, 3), torch.empty(4, 6)
    # The forward's GEMM: A = x [4, 2*3] read as 2 groups of 4x3, 3 apart, leading dimension 6:
    # it reaches (2 - 1) * 3 + (4 - 1) * 6 + 3 = 24 elements.
    def gemm(a):
        return mkl_batch._gemm(111, 112, 4, 3, 3, a, 3, 6, w, 9, 3, y, 3, 6, 2)

    gemm(torch.randn(24))  # exactly enough
    with pytest.raises(BlockDiagError, match="would reach 24"):
        gemm(torch.randn(23))  # one element short: MKL would read past the storage
