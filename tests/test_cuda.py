"""Every backend on CUDA in float32/float64/float16/bfloat16, autocast, BSR's Triton path, grouped GEMM.

All tests here need a CUDA device and skip cleanly without one. A (backend, dtype, shape) that
the backend declares it cannot run is not skipped: the test asserts that asking for it raises
:class:`BlockDiagError` with the reason. References are computed in float64 from the same
(already rounded) inputs, compared with :func:`blockdiag.testing.tolerances` for the dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

import blockdiag
from blockdiag import BlockDiagError, Problem, grouped_linear
from blockdiag.backends import get, names
from blockdiag.backends.bsr import triton_applies
from blockdiag.testing import backend_tolerances, reference_loop, reference_scipy, tolerances

from _params import CUDA_MARKS

pytestmark = CUDA_MARKS

DTYPES = [
    pytest.param(torch.float32, id="f32"),
    pytest.param(torch.float64, id="f64"),
    pytest.param(torch.float16, id="f16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
# (batch, groups, block_in, block_out)
SHAPES = [
    pytest.param(64, 8, 32, 32, id="pow2-32"),  # BSR: Triton; grouped_mm: aligned
    pytest.param(48, 6, 24, 24, id="block24"),  # BSR: blocked fallback (24 is not a power of 2)
    pytest.param(40, 16, 16, 32, id="16to32"),  # BSR: sub-blocks 16, batch 40 not a multiple: fallback
    pytest.param(17, 5, 3, 5, id="coprime"),  # BSR: declined (1x1 sub-blocks)
    pytest.param(3, 50, 10, 10, id="forum"),
    pytest.param(0, 4, 8, 8, id="empty-batch"),
]
BACKENDS = [pytest.param(n, id=n) for n in names()]


def _inputs(n, g, i, o, dtype, device="cuda"):
    # nn.Linear-like scales keep outputs O(1), so low-precision tolerances stay meaningful.
    x = torch.randn(n, g * i, device=device).to(dtype).requires_grad_()
    w = ((torch.rand(g, o, i, device=device) * 2 - 1) / math.sqrt(i)).to(dtype).requires_grad_()
    b = (torch.rand(g * o, device=device) * 0.2 - 0.1).to(dtype).requires_grad_()
    return x, w, b


def _skip_unavailable(name):
    why = get(name).unavailable_reason()
    if why:
        pytest.skip(f"backend {name!r} unavailable here: {why}")


@pytest.mark.parametrize("n, g, i, o", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", BACKENDS)
def test_backend_on_cuda_matches_float64_reference(name, dtype, n, g, i, o):
    _skip_unavailable(name)
    x, w, b = _inputs(n, g, i, o, dtype)
    p = Problem(n, g, i, o, dtype, "cuda", True)
    why = get(name).decline_reason(p)
    if why is not None:
        with pytest.raises(BlockDiagError, match=name):
            grouped_linear(x, w, b, backend=name)
        return
    y = grouped_linear(x, w, b, backend=name)
    assert y.dtype == dtype and y.device.type == "cuda" and y.shape == (n, g * o)

    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    yd = reference_loop(xd, wd, bd)
    torch.testing.assert_close(y.double(), yd, **backend_tolerances(name, p, i))

    r = torch.randn(n, g * o, device="cuda").to(dtype)
    got = torch.autograd.grad((y * r).sum(), (x, w, b))
    want = torch.autograd.grad((yd * r.double()).sum(), (xd, wd, bd))
    for a, e in zip(got, want):
        assert a.dtype == dtype and a.layout == torch.strided
        mag = float(e.abs().max()) if e.numel() else 1.0
        torch.testing.assert_close(a.double(), e, **backend_tolerances(name, p, max(n, i, o), mag))


@pytest.mark.parametrize("name", BACKENDS)
def test_gradcheck_float64_on_cuda(name):
    _skip_unavailable(name)
    if get(name).decline_reason(Problem(3, 2, 4, 4, torch.float64, "cuda", True)):
        pytest.skip(f"{name} declines float64 training on CUDA")
    x = torch.randn(3, 8, dtype=torch.float64, device="cuda", requires_grad=True)
    w = torch.randn(2, 4, 4, dtype=torch.float64, device="cuda", requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: grouped_linear(*a, backend=name), (x, w, b))


AUTOCAST_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="f16")]


@pytest.mark.parametrize("amp_dtype", AUTOCAST_DTYPES)
@pytest.mark.parametrize("name", [pytest.param("auto", id="auto")] + BACKENDS)
def test_autocast_casts_like_linear(name, amp_dtype):
    """Under autocast a float32 layer computes in the autocast dtype whatever the backend."""
    if name != "auto":
        _skip_unavailable(name)
    layer = blockdiag.GroupedLinear(8 * 32, 8 * 32, groups=8, backend=name, device="cuda")
    x = torch.randn(64, 8 * 32, device="cuda")
    if name != "auto" and get(name).decline_reason(Problem(64, 8, 32, 32, amp_dtype, "cuda", True)):
        with torch.autocast("cuda", dtype=amp_dtype), pytest.raises(BlockDiagError, match=name):
            layer(x)
        return
    with torch.autocast("cuda", dtype=amp_dtype):
        y = layer(x)
        y_low_in = layer(x.to(amp_dtype))  # a low-precision input meets float32 parameters
    assert y.dtype == amp_dtype and y_low_in.dtype == amp_dtype
    y.float().square().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32
    ref = reference_loop(x.double(), layer.weight.double(), layer.bias.double())
    torch.testing.assert_close(y.double(), ref, **tolerances(amp_dtype, 32))


def test_autocast_off_inside_keeps_float32():
    layer = blockdiag.GroupedLinear(64, 64, groups=4, device="cuda")
    x = torch.randn(16, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with torch.autocast("cuda", enabled=False):
            assert layer(x).dtype == torch.float32


def _triton_kernels():
    """torch's registered Triton BSR kernels (wrappers that record whether they ran)."""
    torch.cuda.init()  # the kernels are registered lazily, at CUDA initialisation
    table = getattr(torch, "_TritonLibrary").ops_table
    ks = [table.get((k, "SparseCsrCUDA")) for k in ("_triton_bsr_dense_mm_out", "_triton_bsr_dense_addmm_out")]
    ks = [k for k in ks if k is not None]
    if not ks:
        pytest.skip("torch registered no Triton BSR kernel (Triton not installed)")
    return ks


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="f16"), pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="f32")])
@pytest.mark.parametrize(
    "n, g, i, o, triton",
    [
        pytest.param(64, 8, 32, 32, True, id="triton-32"),
        pytest.param(64, 4, 64, 16, True, id="triton-16"),
        # 256x256 blocks are stored as 64x64 sub-blocks on CUDA (bsr.CUDA_MAX_SUBBLOCK).
        pytest.param(128, 2, 256, 256, True, id="triton-256-as-64"),
        pytest.param(48, 6, 24, 24, False, id="fallback-block24"),
        pytest.param(40, 8, 16, 16, False, id="fallback-batch40"),
        pytest.param(32, 8, 8, 8, False, id="fallback-block8"),
    ],
)
def test_bsr_triton_path_and_fallback(dtype, n, g, i, o, triton):
    p = Problem(n, g, i, o, dtype, "cuda")
    kernels = _triton_kernels()
    assert triton_applies(p) == triton
    for k in kernels:
        k.kernel_invoked = False
    x, w, b = _inputs(n, g, i, o, dtype)
    with torch.no_grad():
        y = grouped_linear(x, w, b, backend="bsr")
    torch.cuda.synchronize()
    assert any(k.kernel_invoked for k in kernels) == triton
    ref = reference_loop(x.detach().double(), w.detach().double(), b.detach().double())
    torch.testing.assert_close(y.double(), ref, **backend_tolerances("bsr", p, i))


def test_bsr_refuses_coprime_blocks_on_cuda():
    why = get("bsr").decline_reason(Problem(8, 4, 3, 5, torch.float32, "cuda"))
    assert why and "coprime" in why and "csr" in why
    x, w, _ = _inputs(8, 4, 3, 5, torch.float32)
    with pytest.raises(BlockDiagError, match="coprime"):
        grouped_linear(x, w, backend="bsr")


def test_grouped_mm_where_the_gpu_fuses_it():
    be = get("grouped_mm")
    major, minor = torch.cuda.get_device_capability()
    why = be.decline_reason(Problem(64, 8, 16, 32, torch.bfloat16, "cuda", True))
    if major not in (9, 10):
        assert why and f"{major}.{minor}" in why
        return
    assert why is None
    x, w, b = _inputs(64, 8, 16, 32, torch.bfloat16)
    y = grouped_linear(x, w, b, backend="grouped_mm")
    torch.testing.assert_close(y, grouped_linear(x, w, b, backend="bmm"), **tolerances(torch.bfloat16, 16))
    # float32 and misaligned blocks are declined, not silently run through torch's fallback.
    assert "float32" in be.decline_reason(Problem(64, 8, 16, 32, torch.float32, "cuda"))
    assert "multiples of 8" in be.decline_reason(Problem(64, 8, 12, 32, torch.bfloat16, "cuda"))


def test_grouped_mm_misaligned_view_input():
    if get("grouped_mm").unavailable_reason():
        pytest.skip(get("grouped_mm").unavailable_reason())
    big = torch.randn(65, 8 * 16, device="cuda", dtype=torch.bfloat16)
    x = big[1:]  # starts 256 bytes in: aligned
    x_odd = big.view(-1)[1 : 1 + 64 * 128].view(64, 128)  # starts 2 bytes in: misaligned
    w = torch.randn(8, 16, 16, device="cuda", dtype=torch.bfloat16)
    for inp in (x, x_odd):
        torch.testing.assert_close(
            grouped_linear(inp, w, backend="grouped_mm"),
            reference_loop(inp.double(), w.double(), None).to(torch.bfloat16),
            **tolerances(torch.bfloat16, 16),
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, g, i, o", [(1, 2, 3, 3), (256, 64, 16, 16), (8, 512, 4, 4), (128, 4, 128, 64)])
def test_auto_on_cuda_picks_a_backend_that_runs(dtype, n, g, i, o):
    x, w, b = _inputs(n, g, i, o, dtype)
    p = Problem(n, g, i, o, dtype, "cuda", True)
    with blockdiag.config(sparsity_threshold=0.0):
        plan = blockdiag.GroupedLinear(g * i, g * o, g, device="cuda", dtype=dtype).plan(x)
        assert get(plan.backend).decline_reason(p) is None
        y = grouped_linear(x, w, b)
    ref = reference_loop(x.detach().double(), w.detach().double(), b.detach().double())
    torch.testing.assert_close(y.double(), ref, **backend_tolerances(plan.backend, p, i))


def test_layout_indices_are_cached_per_cuda_device():
    from blockdiag.layout import BlockLayout

    lay = BlockLayout(4, 2, 3)
    a = lay.csr_indices(torch.device("cuda"))
    b = lay.csr_indices(torch.device("cuda", torch.cuda.current_device()))
    assert a[0] is b[0] and a[0].device.type == "cuda"


def test_reference_scipy_returns_on_the_input_device():
    # It returned a CPU tensor for a CUDA input (reference_loop returns on the input's
    # device): assert_close(run(x, w, b), reference_scipy(x, w, b)), the documented check of
    # a new backend, failed on the devices alone.
    pytest.importorskip("scipy")
    x, w, b = (torch.randn(*shape, device="cuda") for shape in ((5, 6), (3, 4, 2), (12,)))
    y = reference_scipy(x, w, b)
    assert (y.device, y.dtype) == (x.device, x.dtype)
    want = reference_loop(x.double(), w.double(), b.double()).float()
    torch.testing.assert_close(y, want, **tolerances(torch.float32, 2))
