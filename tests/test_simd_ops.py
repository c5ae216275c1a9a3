"""simd's kernels through its C++ ops (``blockdiag::simd_native`` and its backward).

tests/test_simd.py runs every tile path through both call routes (the ops and ctypes), and
tests/test_backends.py runs simd as every backend is run. These check the ops themselves:
the same results as the ctypes wrappers on drawn shapes and strides, ``opcheck``, what they
refuse and how simd falls back, when they are armed, and how a failed build leaves simd.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockdiag import BlockDiagError, grouped_linear
from blockdiag.backends import _libcache, _simd_ops, get, simd
from blockdiag.testing import reference_loop

from _builds import seed_cache
from _params import run_or_fail_on_hang

pytestmark = pytest.mark.skipif(
    get("simd").unavailable_reason() is not None,
    reason=f"simd unavailable here: {get('simd').unavailable_reason()}",
)

DTYPES = [torch.float32, torch.float64]
DTYPE_IDS = ["float32", "float64"]


@pytest.fixture
def native():
    """The ops, armed for both dtypes (skipped only where no C++ compiler is on PATH)."""
    for dtype in DTYPES:
        grouped_linear(torch.randn(2, 4, dtype=dtype), torch.randn(2, 2, 2, dtype=dtype), None, backend="simd")
    found = _simd_ops.ops(torch.float32)
    if found is None:
        if shutil.which(os.environ.get("CXX") or "c++") is None:
            pytest.skip(f"no C++ compiler here: {_simd_ops.note()}")
        pytest.fail(f"a C++ compiler is here but simd's ops are not armed: {_simd_ops.note()}")
    assert _simd_ops.ops(torch.float64) is found
    return found


def _through_ctypes(fn, *args):
    """simd's kernel function ``fn`` (forward or backward) run through the ctypes wrappers."""
    with _simd_ops.through_ctypes():
        return fn(*args)


@st.composite
def _operands(draw):
    dtype = draw(st.sampled_from(DTYPES))
    g, i, o = draw(st.integers(1, 5)), draw(st.integers(1, 20)), draw(st.integers(1, 20))
    n = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    x_kind = draw(st.sampled_from(["contiguous", "column slice", "column-major", "one row broadcast"]))
    gy_kind = draw(st.sampled_from(["contiguous", "column slice", "expanded scalar"]))
    if x_kind == "contiguous":
        x = torch.randn(n, g * i, dtype=dtype, generator=gen)
    elif x_kind == "column slice":
        extra = draw(st.integers(1, 7))
        x = torch.randn(n, g * i + extra, dtype=dtype, generator=gen)[:, extra:]
    elif x_kind == "column-major":
        x = torch.randn(g * i, n, dtype=dtype, generator=gen).t()
    else:
        x = torch.randn(1, g * i, dtype=dtype, generator=gen).expand(n, g * i)
    if gy_kind == "contiguous":
        gy = torch.randn(n, g * o, dtype=dtype, generator=gen)
    elif gy_kind == "column slice":
        gy = torch.randn(n, g * o + 3, dtype=dtype, generator=gen)[:, 2 : 2 + g * o]
    else:
        gy = torch.tensor(1.25, dtype=dtype).expand(n, g * o)
    w = torch.randn(g, o, i, dtype=dtype, generator=gen)
    if draw(st.booleans()):
        w = w.transpose(1, 2).contiguous().transpose(1, 2)  # a non-contiguous weight: copied
    b = torch.randn(g * o, dtype=dtype, generator=gen) if draw(st.booleans()) else None
    return x, w, b, gy


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_operands(), need=st.sampled_from([(True, True), (True, False), (False, True), (False, False)]))
def test_the_ops_equal_the_ctypes_wrappers_on_drawn_shapes_and_strides(native, ops, need):
    # The same kernels on the same operands: bitwise equal, outputs and every gradient.
    x, w, b, gy = ops
    assert torch.equal(native.forward(x, w, b), _through_ctypes(simd._kernel_forward, x, w, b))
    need_x, need_w = need
    got = native.backward(gy, x, w, b is not None, need_x, need_w)
    want = _through_ctypes(simd._kernel_backward, gy, x, w, b is not None, need_x, need_w)
    for name, a, c in zip(("input", "weight", "bias"), got, want):
        if c is None:
            assert a.numel() == 0, name  # not asked for: 0 elements
        else:
            assert torch.equal(a, c), name


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_the_ops_match_the_float64_loop_reference(native, dtype):
    x = torch.randn(37, 3 * 11, dtype=dtype, requires_grad=True)
    w = torch.randn(3, 9, 11, dtype=dtype, requires_grad=True)
    b = torch.randn(27, dtype=dtype, requires_grad=True)
    gy = torch.randn(37, 27, dtype=dtype)
    want = reference_loop(x.double(), w.double(), b.double())
    want_grads = torch.autograd.grad(want, (x, w, b), gy.double())
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype is torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    with torch.no_grad():
        torch.testing.assert_close(native.forward(x, w, b).double(), want, **tol)
        for got, ref in zip(native.backward(gy, x, w, True, True, True), want_grads):
            torch.testing.assert_close(got.double(), ref.double(), **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("block", [(4, 5), (256, 256)], ids=["kernels", "blas-gradients"])
def test_opcheck(native, dtype, bias, block):
    # Schema, fake kernels and dynamic shapes; no autograd test: these ops run below autograd.
    # At 256x256 blocks the backward takes its BLAS branch (BLAS_GRADS_MIN_BLOCK).
    (i, o), g = block, 3 if block == (4, 5) else 1
    x, w = torch.randn(6, g * i, dtype=dtype), torch.randn(g, o, i, dtype=dtype)
    b = torch.randn(g * o, dtype=dtype) if bias else None
    gy = torch.randn(6, g * o, dtype=dtype)
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(native.forward, (x, w, b), test_utils=tests)
    for need in [(True, True), (True, False), (False, True)]:
        torch.library.opcheck(native.backward, (gy, x, w, bias, *need), test_utils=tests)


def test_the_fake_kernels_give_shapes_without_data(native):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w, gy = torch.randn(7, 12), torch.randn(3, 5, 4), torch.randn(7, 15)
        assert native.forward(x, w, None).shape == (7, 15)
        gx, gw, gb = native.backward(gy, x, w, True, True, False)
        assert (gx.shape, gw.shape, gb.shape) == ((7, 12), (0,), (15,))
    y = native.forward(torch.randn(7, 12, device="meta"), torch.randn(3, 5, 4, device="meta"), None)
    assert y.device.type == "meta" and y.shape == (7, 15)


def test_a_gradient_through_the_ops_is_refused(native):
    # A call autograd records runs (torch's higher-order ops re-trace graphs holding these ops
    # with grad mode on, and never differentiate that re-trace), but a gradient reaching it
    # raises: the ops have no derivative of their own, simd's op and Function hold it.
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(2, 3, 3)
    y = native.forward(x, w, None)
    torch.testing.assert_close(y.detach(), native.forward(x.detach(), w, None))
    with pytest.raises(RuntimeError, match="simd_native is one of simd's kernels and has no autograd"):
        y.sum().backward()
    gx, gw, gb = native.backward(torch.randn(4, 6), x, w, False, True, True)
    assert gx.requires_grad and gw.requires_grad
    with pytest.raises(RuntimeError, match="simd_native_backward is one of simd's kernels"):
        gw.sum().backward()
    with torch.no_grad():
        assert not native.forward(x, w, None).requires_grad
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level(), torch.no_grad():  # a tangent would be dropped: refused
        dual = fwad.make_dual(torch.randn(4, 6), torch.randn(4, 6))
        with pytest.raises(RuntimeError, match="without a forward-mode tangent"):
            native.forward(dual, w, None)


@pytest.mark.parametrize(
    "case,match",
    [
        ("dtypes differ", "weight must be Float"),
        ("3-d input", "input must be 2-d"),
        ("width", "does not match weight"),
        ("bias shape", "bias must be"),
        ("no storage", "has no"),
    ],
)
def test_the_ops_refuse_what_the_kernels_cannot_take(native, case, match):
    x, w, b = torch.randn(5, 6), torch.randn(2, 3, 3), torch.randn(6)
    if case == "dtypes differ":
        w = w.double()
    elif case == "3-d input":
        x = x.reshape(5, 2, 3)
    elif case == "width":
        x = torch.randn(5, 7)
    elif case == "bias shape":
        b = torch.randn(7)
    else:
        x.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=match):
        native.forward(x, w, b)


def test_simd_falls_back_to_the_ctypes_wrappers_where_the_ops_refuse(native):
    x = torch.randn(5, 6)
    w, b = torch.randn(2, 3, 3), torch.randn(6)
    # A lazily negated input: the dispatcher resolves it before the ops' kernel sees it.
    torch.testing.assert_close(native.forward(torch._neg_view(x), w, b), native.forward(-x, w, b))
    torch.testing.assert_close(grouped_linear(torch._neg_view(x), w, b, backend="simd"), reference_loop(-x, w, b))
    # Mixed dtypes: refused by the ops, then precisely by the wrapper.
    with pytest.raises(BlockDiagError, match=r"simd: weight must be torch.float32 like the input, got torch.float64"):
        simd._kernel_forward(x, w.double(), None)


def test_the_ops_make_no_copy_of_a_column_slice(native):
    # x is columns 3.. of a [9, 40] tensor: read in place (no copy under the op), while a
    # column-major x is copied once. The profiler takes the op route, so the ops' calls show.
    wide = torch.randn(9, 40)
    w, b = torch.randn(3, 5, 8), torch.randn(15)

    def copies(x):
        with torch.profiler.profile() as prof:
            grouped_linear(x, w, b, backend="simd")
        names = [e.name for e in prof.events()]
        assert "blockdiag::simd_native" in names
        return names.count("aten::copy_")

    assert copies(wide[:, 3:27]) == 0
    assert copies(torch.randn(24, 9).t()) == 1


def test_disarmed_ops_refuse_and_simd_arms_them_again(native):
    x, w = torch.randn(4, 6), torch.randn(2, 3, 3)
    _simd_ops.disarm()
    with pytest.raises(RuntimeError, match="kernels are not loaded and self-checked"):
        native.forward(x, w, None)
    torch.testing.assert_close(grouped_linear(x, w, None, backend="simd"), reference_loop(x, w, None))
    assert _simd_ops.ops(torch.float32) is native  # armed again by that call's check
    native.forward(x, w, None)


def test_a_disarm_racing_a_call_refuses_it_never_calls_a_null_kernel(native):
    # disarm (bd_ops_clear) on one thread while another calls the ops: each call must either
    # run or refuse. The ops once checked the forward pointer and loaded it again to call it,
    # so a clear between the two loads called a null function (SIGSEGV). In a child process,
    # the cache shared with this one.
    code = textwrap.dedent(
        """
        import ctypes, threading, torch
        from blockdiag import grouped_linear
        from blockdiag.backends import _simd_ops, simd
        grouped_linear(torch.randn(2, 4), torch.randn(2, 2, 2), None, backend="simd")
        ops = _simd_ops.ops(torch.float32)
        assert ops is not None, _simd_ops.note()
        kernels = [ctypes.cast(f, ctypes.c_void_p).value for f in simd._library()[0][torch.float32]]
        done = threading.Event()
        def flip():
            while not done.is_set():
                ops.library.bd_ops_clear()
                ops.library.bd_ops_set(0, *kernels)
        t = threading.Thread(target=flip)
        t.start()
        x, w, gy = torch.randn(1, 4), torch.randn(1, 4, 4), torch.randn(1, 4)
        try:
            for _ in range(50_000):
                for call in (lambda: ops.forward(x, w, None), lambda: ops.backward(gy, x, w, False, True, True)):
                    try:
                        call()
                    except RuntimeError as e:
                        assert "not loaded and self-checked" in str(e), e
        finally:
            done.set()
            t.join()
        print("survived")
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rc, out, err = run_or_fail_on_hang([sys.executable, "-c", code], 300, "the racing process", env=env)
    assert rc == 0 and "survived" in out, f"exit status {rc}: {err[-2000:]}"


def test_ops_that_disagree_with_ctypes_are_not_armed(native, monkeypatch):
    monkeypatch.setattr(_simd_ops, "_ARMED", {})
    monkeypatch.setattr(_simd_ops, "_WHY", {})
    _simd_ops.arm(torch.float32, simd._library()[0][torch.float32], lambda ops: "planted disagreement")
    assert _simd_ops.ops(torch.float32) is None
    assert "a product through the ops differs from ctypes: planted disagreement" in _simd_ops.note()
    with pytest.raises(RuntimeError, match="not loaded and self-checked"):
        native.forward(torch.randn(4, 6), torch.randn(2, 3, 3), None)
    # simd still runs, through ctypes
    x, w = torch.randn(4, 6), torch.randn(2, 3, 3)
    torch.testing.assert_close(grouped_linear(x, w, None, backend="simd"), reference_loop(x, w, None))
    monkeypatch.undo()
    _simd_ops.disarm()


def test_the_explain_line_says_how_the_kernels_are_called(native):
    assert "called through C++ ops (float32, float64)" in simd.variant_note()


def test_without_a_cpp_compiler_simd_runs_through_ctypes_and_says_why(tmp_path):
    # A fresh process and cache, $CXX a compiler that always fails: the C kernels build with
    # $CC as ever, the ops do not; simd still computes, and the explain line says why.
    code = textwrap.dedent(
        """
        import torch
        from blockdiag import grouped_linear
        from blockdiag.backends import _simd_ops, simd
        from blockdiag.testing import reference_loop
        x, w = torch.randn(4, 6), torch.randn(2, 3, 3)
        torch.testing.assert_close(grouped_linear(x, w, None, backend="simd"), reference_loop(x, w, None))
        assert _simd_ops.ops(torch.float32) is None
        print(simd.variant_note())
        """
    )
    seed_cache(tmp_path / "cache")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "CXX": shutil.which("false")}
    rc, out, err = run_or_fail_on_hang([sys.executable, "-c", code], 300, "the subprocess", env=env)
    assert rc == 0, err
    assert "called through ctypes: compiling simd's C++ ops with" in out and "failed (exit 1)" in out


def test_before_first_use_the_explain_line_says_a_missing_cpp_compiler(tmp_path):
    # Nothing has armed the ops yet: the line must not promise C++ ops that cannot be built.
    code = "from blockdiag.backends import simd; print(simd.variant_note())"
    seed_cache(tmp_path / "cache")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "CXX": str(tmp_path / "no-such-c++")}
    rc, out, err = run_or_fail_on_hang([sys.executable, "-c", code], 300, "the subprocess", env=env)
    assert rc == 0, err
    assert f"called through ctypes: no C++ compiler: {tmp_path / 'no-such-c++'} does not exist (set $CXX)" in out, out


@pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "c++") is None, reason="no C++ compiler: nothing is built")
def test_a_damaged_cached_ops_library_is_rebuilt_never_loaded(tmp_path):
    # The ops' library is fetched as simd's C library is (one _fetch): a truncated file in the
    # cache is rebuilt, not mapped. Two fresh processes over one cache, seeded with this
    # process's libraries: the first loads them, the ops' file is cut in half, the second must
    # rebuild it and arm the ops.
    code = textwrap.dedent(
        """
        import torch
        from blockdiag import grouped_linear
        from blockdiag.backends import _simd_ops
        grouped_linear(torch.randn(4, 6), torch.randn(2, 3, 3), None, backend="simd")
        assert _simd_ops.ops(torch.float32) is not None, _simd_ops.note()
        print("armed")
        """
    )
    seed_cache(tmp_path / "cache", ("simd-*.so", "torchops-simd-*.so"))
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    rc, out, err = run_or_fail_on_hang([sys.executable, "-c", code], 300, "the first process", env=env)
    assert rc == 0 and "armed" in out, err
    (built,) = (tmp_path / "cache" / "blockdiag" / "kernels").glob("torchops-simd-*.so")
    whole = built.read_bytes()
    built.write_bytes(whole[: len(whole) // 2])
    rc, out, err = run_or_fail_on_hang([sys.executable, "-c", code], 300, "the second process", env=env)
    assert rc == 0 and "armed" in out, err
    assert _libcache._damage(built.read_bytes()) is None and len(built.read_bytes()) > len(whole) // 2


def test_through_ctypes_runs_the_wrappers_and_keeps_the_ops_armed(native):
    x, w = torch.randn(4, 6), torch.randn(2, 3, 3)
    with _simd_ops.through_ctypes():
        assert _simd_ops.ops(torch.float32) is None
        with torch.profiler.profile() as prof:
            grouped_linear(x, w, None, backend="simd")
        assert "blockdiag::simd_native" not in [e.name for e in prof.events()]
    assert _simd_ops.ops(torch.float32) is native


def _large_operands(kind: str, n: int, g: int, i: int, o: int):
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(g, o, i, generator=gen)
    gy = torch.randn(n, g * o, generator=gen)
    if kind == "contiguous":
        x = torch.randn(n, g * i, generator=gen)
    elif kind == "column slice":
        x = torch.randn(n, g * i + 5, generator=gen)[:, 3 : 3 + g * i]
        gy = torch.randn(n, g * o + 2, generator=gen)[:, 1 : 1 + g * o]
    elif kind == "column-major":
        x = torch.randn(g * i, n, generator=gen).t()
    else:
        x = torch.randn(1, g * i, generator=gen).expand(n, g * i)
        gy = torch.tensor(0.5).expand(n, g * o)
    return x, w, gy


@pytest.mark.parametrize("kind", ["contiguous", "column slice", "column-major", "one row broadcast"])
def test_large_blocks_take_torchs_blas_gradients_in_both_routes(native, kind):
    # At blocks of BLAS_GRADS_MIN_BLOCK elements or more, simd's gradients are the loop
    # backend's BLAS products, bitwise, through the ops and through ctypes alike; one element
    # fewer and the input gradient is simd's kernels' (the weight gradient's rule over few
    # rows is the next test's). The two weight or bias gradients (BLAS's, and the kernels'
    # sums over blocks of rows) differ in the last bits here, so the test tells the two apart.
    from blockdiag.backends.loop import _backward as blas

    assert _simd_ops.BLAS_GRADS_MIN_BLOCK == 256 * 256
    for (i, o), large in (((256, 256), True), ((255, 257), False)):
        assert (i * o >= _simd_ops.BLAS_GRADS_MIN_BLOCK) is large
        x, w, gy = _large_operands(kind, 37, 2, i, o)
        cx, cgy = simd._cols(x), simd._cols(gy)
        by_blas = blas(cgy, cx, w, True, True, True)
        by_kernels = (simd._grad_input(cgy, w), *simd._grad_weight(cgy, cx, w.shape, True))
        if kind != "one row broadcast":  # a broadcast gradient sums equal terms: the same in any order
            assert not (torch.equal(by_blas[1], by_kernels[1]) and torch.equal(by_blas[2], by_kernels[2]))
        assert _simd_ops.blas_grads(37, 2, i, o) == (large, large)  # 2 groups: no weight rule
        want = by_blas if large else by_kernels
        for got in (native.backward(gy, x, w, True, True, True),
                    _through_ctypes(simd._kernel_backward, gy, x, w, True, True, True)):
            for name, a, c in zip(("input", "weight", "bias"), got, want):
                assert torch.equal(a, c), (name, i, o)
        # The float64 loop reference, within float32's rounding.
        xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
        bd = torch.zeros(2 * o, dtype=torch.float64, requires_grad=True)
        ref = torch.autograd.grad(reference_loop(xd, wd, bd), (xd, wd, bd), gy.double())
        for a, r in zip(want, ref):
            torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-3)
        # Each gradient asked for alone.
        gx, gw, gb = native.backward(gy, x, w, False, True, False)
        assert torch.equal(gx, want[0]) and gw.numel() == 0 and gb.numel() == 0
        gx, gw, gb = native.backward(gy, x, w, True, False, True)
        assert gx.numel() == 0 and torch.equal(gw, want[1]) and torch.equal(gb, want[2])


@pytest.mark.parametrize("kind", ["contiguous", "column slice", "column-major", "one row broadcast"])
def test_the_weight_gradient_alone_takes_blas_over_few_rows(native, kind):
    # Below BLAS_GRADS_MIN_BLOCK, at blocks of BLAS_WEIGHT_GRAD_MIN_BLOCK elements or more,
    # over at most BLAS_WEIGHT_GRAD_MAX_ROWS rows and with BLAS_WEIGHT_GRAD_MIN_GROUPS groups
    # or more, the weight and bias gradients are BLAS's (a bmm, a sum) and the input gradient
    # the kernels', in both routes; one row more, one group fewer or one element fewer, and
    # all three are the kernels'. With BLAS_WEIGHT_GRAD_MANY_GROUPS groups, the same up to
    # BLAS_WEIGHT_GRAD_MANY_MAX_ROWS rows where a block has BLAS_WEIGHT_GRAD_MANY_MIN_IN
    # inputs or more. The weight and bias gradients tell the methods apart (see above).
    from blockdiag.backends.loop import _backward as blas

    rows, groups = _simd_ops.BLAS_WEIGHT_GRAD_MAX_ROWS, _simd_ops.BLAS_WEIGHT_GRAD_MIN_GROUPS
    assert (_simd_ops.BLAS_WEIGHT_GRAD_MIN_BLOCK, rows, groups) == (128 * 128, 256, 16)
    many, many_rows, many_in = (_simd_ops.BLAS_WEIGHT_GRAD_MANY_GROUPS, _simd_ops.BLAS_WEIGHT_GRAD_MANY_MAX_ROWS,
                                _simd_ops.BLAS_WEIGHT_GRAD_MANY_MIN_IN)
    assert (many, many_rows, many_in) == (32, 512, 128)
    cases = (((37, groups, 128, 128), True), ((rows, groups, 128, 128), True),
             ((rows + 1, groups, 128, 128), False), ((37, groups - 1, 128, 128), False),
             ((37, groups, 127, 129), False),
             ((rows + 1, many, 128, 128), True), ((many_rows, many, 128, 128), True),
             ((many_rows + 1, many, 128, 128), False), ((rows + 1, many - 1, 128, 128), False),
             ((rows + 1, many, many_in - 1, 130), False))
    for (n, g, i, o), weight_by_blas in cases:
        assert _simd_ops.blas_grads(n, g, i, o) == (False, weight_by_blas)
        x, w, gy = _large_operands(kind, n, g, i, o)
        cx, cgy = simd._cols(x), simd._cols(gy)
        by_blas = blas(cgy, cx, w, True, True, True)
        by_kernels = (simd._grad_input(cgy, w), *simd._grad_weight(cgy, cx, w.shape, True))
        if kind != "one row broadcast":
            assert not (torch.equal(by_blas[1], by_kernels[1]) and torch.equal(by_blas[2], by_kernels[2]))
        want = (by_kernels[0], *by_blas[1:]) if weight_by_blas else by_kernels
        for got in (native.backward(gy, x, w, True, True, True),
                    _through_ctypes(simd._kernel_backward, gy, x, w, True, True, True)):
            for name, a, c in zip(("input", "weight", "bias"), got, want):
                assert torch.equal(a, c), (name, n, i, o)
        xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
        bd = torch.zeros(g * o, dtype=torch.float64, requires_grad=True)
        ref = torch.autograd.grad(reference_loop(xd, wd, bd), (xd, wd, bd), gy.double())
        for a, r in zip(want, ref):
            torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-3)
        for route in (native.backward, lambda *a: _through_ctypes(simd._kernel_backward, *a)):
            gx, gw, gb = route(gy, x, w, False, True, False)
            assert torch.equal(gx, want[0]) and (gw is None or gw.numel() == 0) and (gb is None or gb.numel() == 0)
            gx, gw, gb = route(gy, x, w, True, False, True)
            assert (gx is None or gx.numel() == 0) and torch.equal(gw, want[1]) and torch.equal(gb, want[2])


@pytest.mark.parametrize("arg", ["input", "weight", "bias"])
def test_the_ops_refuse_an_operand_whose_storage_is_one_element_short(native, arg):
    ops = {"input": torch.randn(5, 6), "weight": torch.randn(2, 3, 3), "bias": torch.randn(6)}
    t = ops[arg]
    t.untyped_storage().resize_((t.numel() - 1) * t.element_size())  # the last element is unstored
    with pytest.raises(RuntimeError, match="has no storage for its elements"):
        native.forward(ops["input"], ops["weight"], ops["bias"])


@pytest.mark.parametrize("overlap", [1, 3])
def test_the_ops_copy_rows_that_overlap_and_run_them(native, overlap):
    # Rows 6 - overlap apart (0 < ld < width): matrix() must hand the kernels a contiguous copy;
    # the C kernel refuses such a leading dimension, so passing it on makes the op raise.
    w, b = torch.randn(2, 3, 3), torch.randn(6)
    x = torch.randn(64).as_strided((5, 6), (6 - overlap, 1))
    torch.testing.assert_close(native.forward(x, w, b), reference_loop(x.contiguous(), w, b))
    gy = torch.randn(64).as_strided((5, 6), (6 - overlap, 1))
    gx, gw, gb = native.backward(gy, x, w, True, True, True)
    torch.testing.assert_close(gx, gy.contiguous() @ torch.block_diag(*w))
