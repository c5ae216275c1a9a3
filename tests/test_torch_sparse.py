"""The optional ``torch_sparse`` backend: absent, it is reported and never chosen; present, it is exact.

The generic suite (tests/test_backends.py) runs it against the references on every declared
device and dtype; this file covers what is specific to it: the missing-package behaviour
(tested on every machine by hiding the package), its SparseTensor storage and gradients.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

import blockdiag
from blockdiag import BlockDiagError, Problem, grouped_linear
from blockdiag.backends import get
from blockdiag.testing import reference_loop, reference_scipy, tolerances

from _params import DEVICES, DTYPES

HAVE_TORCH_SPARSE = importlib.util.find_spec("torch_sparse") is not None


@pytest.fixture
def hide_torch_sparse(monkeypatch):
    """Make this process look like one without torch-sparse installed."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "torch_sparse" or name.startswith("torch_sparse.") else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setitem(sys.modules, "torch_sparse", None)


def test_missing_package_is_reported(hide_torch_sparse):
    info = {b.name: b for b in blockdiag.list_backends()}["torch_sparse"]
    assert not info.available
    assert info.reason == "torch-sparse is not installed"
    why = get("torch_sparse").decline_reason(Problem(8, 4, 3, 3))
    assert why == "unavailable: torch-sparse is not installed"


def test_missing_package_fixed_backend_raises(hide_torch_sparse):
    with pytest.raises(BlockDiagError, match=r"'torch_sparse' cannot run .*torch-sparse is not installed"):
        grouped_linear(torch.randn(4, 6), torch.randn(3, 2, 2), backend="torch_sparse")


def test_missing_package_auto_never_picks_it(hide_torch_sparse):
    # Everything sparse is allowed and the table is empty, so only availability can exclude it.
    with blockdiag.config(sparsity_threshold=0.0):
        for g, i, o in [(2, 3, 3), (64, 4, 4), (512, 2, 2)]:
            plan = blockdiag.choose(Problem(32, g, i, o))
            assert plan.backend != "torch_sparse"
            notes = {c.name: c for c in plan.candidates}
            assert not notes["torch_sparse"].ok
            assert "torch-sparse is not installed" in notes["torch_sparse"].note


def test_import_and_other_backends_work_without_the_package():
    """A fresh interpreter where ``import torch_sparse`` fails: blockdiag still imports and runs."""
    code = (
        "import sys; sys.modules['torch_sparse'] = None\n"
        "import torch, blockdiag\n"
        "from blockdiag.backends import get, names\n"
        "x, w = torch.randn(5, 12), torch.randn(4, 2, 3)\n"
        "ref = blockdiag.grouped_linear(x, w, backend='loop')\n"
        "for n in names():\n"
        "    if get(n).decline_reason(blockdiag.Problem(5, 4, 3, 2)) is None:\n"
        "        torch.testing.assert_close(blockdiag.grouped_linear(x, w, backend=n), ref)\n"
        "info = {b.name: b for b in blockdiag.list_backends()}['torch_sparse']\n"
        "assert not info.available, info\n"
        "print(blockdiag.GroupedLinear(12, 8, 4)(x).shape)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([5, 8])" in out.stdout


def test_declared_dtypes():
    be = get("torch_sparse")
    assert be.sparse and be.grad and be.requires == "torch_sparse"
    # torch-sparse's SpMM has no bfloat16 kernel on any device.
    assert all(torch.bfloat16 not in d for d in be.dtypes.values())
    assert be.dtypes["cpu"] == {torch.float32, torch.float64}


needs_torch_sparse = pytest.mark.skipif(not HAVE_TORCH_SPARSE, reason="torch-sparse is not installed")


@needs_torch_sparse
def test_storage_is_csr_of_the_blocks():
    from torch_sparse import SparseTensor

    from blockdiag.backends.torch_sparse import _spmm

    w = torch.randn(3, 2, 4, dtype=torch.float64)
    dense = torch.randn(12, 5, dtype=torch.float64)
    torch.testing.assert_close(_spmm(w, dense), blockdiag.block_diag_dense(w) @ dense)
    # The same storage torch-sparse would build from the dense matrix.
    st = SparseTensor.from_dense(blockdiag.block_diag_dense(w))
    rowptr, col, value = st.csr()
    crow, ccol = blockdiag.block_diag_csr(w).crow_indices(), blockdiag.block_diag_csr(w).col_indices()
    assert torch.equal(rowptr, crow) and torch.equal(col, ccol)
    torch.testing.assert_close(value, w.reshape(-1))


@needs_torch_sparse
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n, g, i, o", [(7, 5, 3, 4), (16, 32, 8, 8), (1, 1, 6, 2)], ids=["5x(3->4)", "32x(8->8)", "G1"])
def test_matches_references_with_compact_grads(device, dtype, n, g, i, o):
    x = torch.randn(n, g * i, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(g, o, i, dtype=dtype, device=device, requires_grad=True)
    b = torch.randn(g * o, dtype=dtype, device=device, requires_grad=True)
    tol = tolerances(dtype, max(i, n))
    y = grouped_linear(x, w, b, backend="torch_sparse")
    torch.testing.assert_close(y, reference_scipy(x, w, b), **tol)
    r = torch.randn_like(y)
    grads = torch.autograd.grad((y * r).sum(), (x, w, b))
    want = torch.autograd.grad((reference_loop(x, w, b) * r).sum(), (x, w, b))
    # The weight gradient is the [G, out, in] blocks, never a sparse or dense full matrix.
    assert grads[1].shape == (g, o, i) and grads[1].layout == torch.strided
    for got, exp in zip(grads, want):
        torch.testing.assert_close(got, exp, **tol)


@needs_torch_sparse
def test_gradcheck():
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: grouped_linear(*a, backend="torch_sparse"), (x, w, b))


@needs_torch_sparse
def test_double_backward_is_refused():
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    y = grouped_linear(x, w, backend="torch_sparse")
    v = torch.randn_like(y, requires_grad=True)
    with pytest.raises(blockdiag.BlockDiagError, match="torch_sparse: the backward is first-order only"):
        torch.autograd.grad(y, (x,), v, create_graph=True)


@needs_torch_sparse
def test_layer_with_torch_sparse_backend_trains():
    layer = blockdiag.GroupedLinear(24, 16, groups=4, backend="torch_sparse", dtype=torch.float64)
    ref = blockdiag.GroupedLinear(24, 16, groups=4, backend="loop", dtype=torch.float64)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(10, 24, dtype=torch.float64)
    layer(x).square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad)
