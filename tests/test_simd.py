"""``simd``'s own paths: the C kernels' tiles and blocks, strided inputs, the build and its cache.

The shared backend tests (tests/test_backends.py) run it against the references as every
backend is: outputs and gradients, gradcheck, gradgradcheck, hypothesis shapes. These add
the shapes that reach every tile, chunk and row-block path of the C code, and the ways its
build can fail.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import random
import re
import tempfile
from pathlib import Path

import pytest
import torch

from blockdiag import BlockDiagError, grouped_linear
from blockdiag.backends import _simd_ops, get, simd
from blockdiag.testing import reference_loop, tolerances

from _builds import quick_compiler

pytestmark = pytest.mark.skipif(
    get("simd").unavailable_reason() is not None,
    reason=f"simd unavailable here: {get('simd').unavailable_reason()}",
)

TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.float64: {"rtol": 1e-10, "atol": 1e-10}}


def _grads(fn, x, w, b, gy):
    y = fn(x, w, b)
    return (y, *torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], gy))


def _compare(x, w, b, gy, dtype):
    got = _grads(lambda *t: grouped_linear(*t, backend="simd"), x, w, b, gy)
    want = _grads(reference_loop, x, w, b, gy)
    assert len(got) == len(want)
    for name, a, c in zip(("y", "gx", "gw", "gb"), got, want):
        torch.testing.assert_close(a, c, **TOL[dtype], msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(params=["ops", "ctypes"])
def route(request):
    """How simd's kernels are called: through the C++ ops (where they build here) or ctypes."""
    if request.param == "ctypes":
        with _simd_ops.through_ctypes():
            yield request.param
        return
    grouped_linear(torch.randn(2, 4), torch.randn(2, 2, 2), None, backend="simd")  # arms float32
    grouped_linear(torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 2, 2, dtype=torch.float64), None,
                   backend="simd")
    if _simd_ops.ops(torch.float32) is None:
        pytest.skip(f"simd's C++ ops are not built here: {_simd_ops.note()}")
    yield request.param


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """A cleared build cache pointed at ``tmp_path``, built at -O0; the real library is restored afterwards."""
    monkeypatch.setenv("CC", quick_compiler(tmp_path / "quick"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    simd._library.cache_clear()
    simd._check.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    simd._library.cache_clear()
    simd._check.cache_clear()
    assert get("simd").unavailable_reason() is None


# Sides that reach: a partial vector (1, 7, 17), exactly one vector (16), several vectors
# in one column chunk (33), several column chunks with a partial last one (65, 150), in
# float32 (16 lanes, 64-column chunks) and float64 (8 lanes, 32-column chunks). Batches
# that reach partial row tiles (1, 7, 9) and, in the weight gradient, several row blocks
# accumulated in turn (300 rows: blocks of at most 64). Groups that are one register tile
# (forward: o at most 4 vectors; weight gradient: o <= 16, 8 or 6 rows as i needs 1, 2 or
# 3-4 vectors) take the group loop inside one specialised function; (5, 4, 10, 150) takes
# the per-group calls in both, (70, 1, 64, 64) and (300, 2, 65, 7) in the weight gradient.
# Batches up to a panel's padded width run the packed products split by groups, with a group
# shared between threads in (9, 3, 16, 16). The forward dot-product form (o <= 10 and i >= 64
# in float32, o <= 5 and i >= 32 in float64) is reached, with partial row tiles and a masked
# last vector of inputs, by (13, 2, 150, 10) and (300, 2, 65, 7) in float32 and by
# (11, 3, 40, 5) in both.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize(
    "n,g,i,o",
    [(1, 1, 1, 1), (7, 3, 7, 17), (9, 2, 16, 16), (9, 5, 33, 10), (300, 3, 10, 10), (300, 2, 65, 7),
     (13, 2, 150, 10), (5, 4, 10, 150), (70, 1, 64, 64), (17, 6, 3, 33), (9, 3, 16, 16), (11, 3, 40, 5)],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_every_tile_path_matches_the_loop_reference(dtype, n, g, i, o, bias, route):
    gen = torch.Generator().manual_seed(n * 1000 + g * 100 + i + o)
    x = torch.randn(n, g * i, dtype=dtype, generator=gen, requires_grad=True)
    w = torch.randn(g, o, i, dtype=dtype, generator=gen, requires_grad=True)
    b = torch.randn(g * o, dtype=dtype, generator=gen, requires_grad=True) if bias else None
    gy = torch.randn(n, g * o, dtype=dtype, generator=gen)
    _compare(x, w, b, gy, dtype)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n,g,i,o", [(130, 7, 10, 12), (20, 5, 16, 24)], ids=["by rows", "by groups"])
def test_results_do_not_depend_on_the_thread_count(threads, n, g, i, o, route):
    # The work is split differently per thread count (the products' row tiles or groups, the
    # weight gradient's items and row blocks); every split must give the same sums. With 3
    # threads the second shape's forward splits groups between threads.
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(n, g * i, dtype=torch.float64, requires_grad=True)
        w = torch.randn(g, o, i, dtype=torch.float64, requires_grad=True)
        b = torch.randn(g * o, dtype=torch.float64, requires_grad=True)
        _compare(x, w, b, torch.randn(n, g * o, dtype=torch.float64), torch.float64)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_column_slices_are_read_and_written_in_place(dtype, monkeypatch):
    # x is columns 3.. of a [9, 40] tensor (row stride 40 > G*in = 24): the kernel must get
    # x's own pointer and the leading dimension 40, not a copy. The ctypes wrappers are spied
    # on here; tests/test_simd_ops.py checks the C++ ops make no copy either.
    g, i, o = 3, 8, 5
    wide = torch.randn(9, 40, dtype=dtype)
    x = wide[:, 3 : 3 + g * i].detach().requires_grad_(True)
    w = torch.randn(g, o, i, dtype=dtype, requires_grad=True)
    b = torch.randn(g * o, dtype=dtype, requires_grad=True)
    gy = torch.randn(9, g * o, dtype=dtype)
    assert simd._check() is None
    fns, why = simd._library()
    seen = []

    def spy(fn):
        return lambda *a: (seen.append(a), fn(*a))[1]

    monkeypatch.setattr(simd, "_library", lambda: ({dtype: tuple(spy(f) for f in fns[dtype])}, why))
    with _simd_ops.through_ctypes():
        got = _grads(lambda *t: grouped_linear(*t, backend="simd"), x, w, b, gy)
    assert seen[0][0] == x.data_ptr() and seen[0][1] == 40  # forward: x in place
    assert seen[2][2] == x.data_ptr() and seen[2][3] == 40  # weight gradient: x in place
    want = _grads(reference_loop, x, w, b, gy)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, **TOL[dtype])


@pytest.mark.parametrize("kind", ["column-major x", "expanded gy", "broadcast-row gy"])
def test_unusual_strides_are_correct(kind, route):
    g, i, o, n = 2, 3, 4, 6
    dt = torch.float64
    x = torch.randn(n, g * i, dtype=dt)
    gy = torch.randn(n, g * o, dtype=dt)
    if kind == "column-major x":
        x = torch.randn(g * i, n, dtype=dt).t()  # strides (1, 6): copied
    elif kind == "expanded gy":
        gy = torch.tensor(1.5, dtype=dt).expand(n, g * o)  # strides (0, 0), as from y.sum()
    else:
        gy = torch.randn(1, g * o, dtype=dt).expand(n, g * o)  # strides (0, 1): read in place
    x.requires_grad_(True)
    w = torch.randn(g, o, i, dtype=dt, requires_grad=True)
    b = torch.randn(g * o, dtype=dt, requires_grad=True)
    _compare(x, w, b, gy, dt)


def test_only_the_bias_needs_a_gradient(route):
    x, w = torch.randn(5, 6), torch.randn(2, 3, 3)
    b = torch.randn(6, requires_grad=True)
    gy = torch.randn(5, 6)
    (gb,) = torch.autograd.grad(grouped_linear(x, w, b, backend="simd"), b, gy)
    torch.testing.assert_close(gb, gy.sum(0))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_a_half_precision_op_refuses_operands_of_another_dtype(half, route):
    # The half dtypes are cast up to float32: without a check, a float32 weight passed for a
    # half one (an exported float32 program fed half inputs ran and returned the half dtype).
    other = torch.float16 if half == torch.bfloat16 else torch.bfloat16
    x, w, b = torch.randn(7, 15, dtype=half), torch.randn(3, 4, 5, dtype=half), torch.randn(12, dtype=half)
    for arg, args in (("weight", (x, w.float(), None)), ("weight", (x, w.to(other), b)),
                      ("bias", (x, w, b.float())), ("bias", (x, w, b.to(other)))):
        with pytest.raises(BlockDiagError, match=rf"simd: {arg} has dtype {args[1 if arg == 'weight' else 2].dtype} "
                                                 rf"but input has dtype {half}"):
            torch.ops.blockdiag.simd(*args)
    gy = torch.randn(7, 12, dtype=half)
    for pattern, args in ((rf"grad has dtype {half} but input has dtype {other}", (gy, x.to(other), w)),
                          (rf"weight has dtype torch.float32 but input has dtype {half}", (gy, x, w.float()))):
        with pytest.raises(BlockDiagError, match=f"simd_backward: {pattern}"):
            torch.ops.blockdiag.simd_backward(*args, True, True, True)


def test_a_kernel_that_disagrees_with_torch_is_refused_at_the_first_call(monkeypatch):
    real = simd._grad_input
    monkeypatch.setattr(simd, "_grad_input", lambda gy, w: real(gy, w).mul_(2))
    simd._check.cache_clear()
    try:
        assert "input gradient kernel did not match torch" in simd._check()
        with pytest.raises(BlockDiagError, match="simd: the compiled input gradient kernel did not match"):
            grouped_linear(torch.randn(2, 4), torch.randn(2, 2, 2), None, backend="simd")
    finally:
        simd._check.cache_clear()


@pytest.mark.parametrize("how", ["auto planned for inference", "the backward op"])
def test_a_backward_that_is_the_first_call_runs_the_self_check(monkeypatch, how):
    # The self-check ran only in forward paths. auto plans its backward for training: a forward
    # planned for inference (jit.trace, the op with train=False) ran another backend, and the
    # backward then ran simd's kernels unchecked, as did a first call of the public backward op:
    # a kernel that disagreed with torch gave wrong gradients instead of a BlockDiagError.
    from _profiles import entry, point, write

    from blockdiag.ops import auto

    n, g, i, o = 64, 4, 16, 16
    write(Path(os.environ["BLOCKDIAG_PROFILE"]),
          entry([point("forward", n, g, i, o, bmm=1.0, simd=100.0, loop=50.0, mkl_batch=100.0),
                 point("train", n, g, i, o, bmm=100.0, simd=1.0, loop=50.0, mkl_batch=100.0)]))
    x, w = torch.randn(n, g * i), torch.randn(g, o, i, requires_grad=True)
    real = simd._grad_weight
    monkeypatch.setattr(simd, "_grad_weight", lambda *a: tuple(t if t is None else t * 2 for t in real(*a)))
    simd._check.cache_clear()
    try:
        with pytest.raises(BlockDiagError, match="simd: the compiled weight gradient kernel did not match"):
            if how == "the backward op":
                torch.ops.blockdiag.simd_backward(torch.ones(n, g * o), x, w.detach(), False, False, True)
            else:
                assert (auto.choice(x, w, False), auto.choice(x, w, True)) == ("bmm", "simd")
                y = torch.ops.blockdiag.auto(x, w, None, False)
                y.backward(torch.ones_like(y))
    finally:
        monkeypatch.undo()
        simd._check.cache_clear()


# The forward's dot-product form (_simd_body.h's use_dot): at most this many outputs and at
# least this many inputs, per variant and dtype.
DOT_FORM = {"avx512": {torch.float32: (10, 64), torch.float64: (5, 32)},
            "avx2": {torch.float32: (5, 32), torch.float64: (2, 16)},
            "neon": {torch.float32: (2, 16), torch.float64: (1, 8)}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_the_self_check_runs_the_forwards_dot_product_form(monkeypatch, dtype):
    # Its shapes took the broadcast form only: a dot form that computed wrong products (the
    # 150x10 blocks' path) passed the check. Here exactly the dot-form calls are made wrong.
    found, why = simd._library()
    assert why is None, why
    max_o, min_i = DOT_FORM[simd.variant()][dtype]
    real = found[dtype][0]
    element = ctypes.c_float if dtype == torch.float32 else ctypes.c_double

    def forward(x, ldx, w, b, y, ldy, rows, g, i, o, threads):
        code = real(x, ldx, w, b, y, ldy, rows, g, i, o, threads)
        if o <= max_o and i >= min_i and rows * g * o:
            element.from_address(y).value += 1.0
        return code

    monkeypatch.setattr(simd, "_library", lambda: ({**found, dtype: (forward, *found[dtype][1:])}, None))
    simd._check.cache_clear()
    try:
        assert "the compiled forward kernel did not match torch" in (simd._check(dtype) or "passed")
    finally:
        monkeypatch.undo()
        simd._check.cache_clear()


def test_build_is_cached_atomically_and_reused(fresh_library, monkeypatch):
    assert simd._library()[1] is None
    names = sorted(p.name for p in (fresh_library / "blockdiag" / "kernels").iterdir())
    built = [n for n in names if not n.endswith(".lock")]
    assert len(built) == 1 and built[0].startswith("simd-") and built[0].endswith(".so"), names  # no temp files
    assert names == sorted([*built, f".{built[0]}.lock"]), names  # and the build lock (an empty file) stays
    # A second process-level lookup finds the file and compiles nothing.
    simd._library.cache_clear()
    monkeypatch.setattr(simd, "_build", lambda *a: pytest.fail("rebuilt although the library was cached"))
    assert simd._library()[1] is None


def test_an_unwritable_cache_falls_back_to_the_temporary_directory(fresh_library, monkeypatch):
    blocker = fresh_library / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # blockdiag/kernels cannot be made under a file
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(fresh_library / "tmp"))
    assert simd._library()[1] is None
    assert any((fresh_library / "tmp").glob("blockdiag-kernels-*/simd-*.so"))


@pytest.mark.parametrize(
    "setup,reason",
    [
        ("no compiler", r"no C compiler: /nonexistent/cc does not exist \(set \$CC\)"),
        ("compiler fails", r"compiling the kernels with .*false failed \(exit 1\)"),
        ("no AVX2", r"this CPU has neither AVX-512F nor AVX2 with FMA"),
        ("forced avx512", r"BLOCKDIAG_SIMD_ISA=avx512 asks for the avx512 kernels, which this CPU cannot run "
                          r"\(no AVX-512F; it can run: avx2\)"),
        ("unknown variant", r"BLOCKDIAG_SIMD_ISA='sse4' is not a kernel variant \(one of avx512, avx2, neon\)"),
        ("other platform", r"needs Linux on x86-64 or aarch64 \(this is darwin on arm64\)"),
    ],
)
def test_unavailable_with_the_reason(fresh_library, monkeypatch, setup, reason):
    if setup == "no compiler":
        monkeypatch.setenv("CC", "/nonexistent/cc")
    elif setup == "compiler fails":
        monkeypatch.setenv("CC", "false")
    elif setup == "no AVX2":
        monkeypatch.setattr(simd, "_cpu_description", lambda: "Some CPU|fpu sse2 avx f16c")
    elif setup == "forced avx512":
        monkeypatch.setattr(simd, "_cpu_description", lambda: "Some CPU|fpu sse2 avx2 fma")
        monkeypatch.setenv("BLOCKDIAG_SIMD_ISA", "avx512")
    elif setup == "unknown variant":
        monkeypatch.setenv("BLOCKDIAG_SIMD_ISA", "sse4")
    else:
        monkeypatch.setattr(simd.sys, "platform", "darwin")
        monkeypatch.setattr(simd.platform, "machine", lambda: "arm64")
    why = get("simd").unavailable_reason()
    assert why is not None and re.search(reason, why), why
    with pytest.raises(BlockDiagError, match="simd.*" + reason):
        grouped_linear(torch.randn(2, 4), torch.randn(2, 2, 2), None, backend="simd")
    assert not list(fresh_library.rglob("*.tmp"))  # a failed build leaves nothing behind


def test_a_library_with_another_abi_is_refused(fresh_library, monkeypatch):
    monkeypatch.setattr(simd, "_ABI", 999)  # as if the C sources were older than this module
    why = simd._library()[1]
    assert why is not None and "has kernel ABI 2, this blockdiag needs 999" in why


@pytest.mark.parametrize("blocks", [(4, 4), (10, 40)], ids=["4x4", "10x40"])
def test_weight_and_bias_gradients_over_many_rows_stay_accurate(route, blocks):
    # Positive terms of one size, summed over 2^20 rows: one running float32 sum per entry
    # loses about a rounding per row once the total dwarfs the terms (relative errors of
    # 4.6e-3 and 6.2e-3 for weight and bias at 4x4; BLAS's bmm gives 1.4e-6 and 9e-8). The
    # kernels sum each block of rows from zero and add the block's sum to the total.
    o, i = blocks
    g, n = 2, 2**20
    torch.manual_seed(0)
    x = 1 + 0.01 * torch.randn(n, g * i)
    gy = 0.1 + 0.001 * torch.randn(n, g * o)
    w = torch.randn(g, o, i, requires_grad=True)
    b = torch.randn(g * o, requires_grad=True)
    grouped_linear(x, w, b, backend="simd").backward(gy)
    want_w = torch.einsum("ngo,ngi->goi", gy.double().view(n, g, o), x.double().view(n, g, i))
    want_b = gy.double().sum(0)
    for name, got, want in (("weight", w.grad, want_w), ("bias", b.grad, want_b)):
        rel = float((got.double() - want).abs().max() / want.abs().max())
        assert rel < 2e-5, f"{name} gradient: relative error {rel:.1e} over {n} rows"


@pytest.mark.parametrize("blocks", [(16, 2**16), (2**14, 2), (40, 300)], ids=["16x65536", "16384x2", "40x300"])
def test_the_forward_and_input_gradient_over_many_inputs_stay_accurate(route, blocks):
    # The broadcast tile summed all of its K terms (the inputs in the forward, the outputs in
    # the input gradient) in one running float32 sum: positive terms of about one size lost
    # about a rounding per term once the total dwarfed them (an error growing with K, several
    # times nn.Linear's at these sizes; docs/changelog.md has the figures). Blocks of 256 terms are summed on their own and added to the total, as
    # BLAS adds its panels. 40x300: a last block of 44 terms, and columns in a part vector.
    o, i = blocks
    g, n = 2, 11
    torch.manual_seed(0)
    x = (1 + 0.01 * torch.randn(n, g * i)).requires_grad_()
    w = 0.1 + 0.001 * torch.randn(g, o, i)
    b = torch.randn(g * o)
    gy = 1 + 0.01 * torch.randn(n, g * o)
    y = grouped_linear(x, w, b, backend="simd")
    (gx,) = torch.autograd.grad(y, x, gy)
    want_y = reference_loop(x.detach().double(), w.double(), b.double())
    want_gx = torch.einsum("ngo,goi->ngi", gy.double().view(n, g, o), w.double()).reshape(n, g * i)
    for name, got, want in (("output", y.detach(), want_y), ("input gradient", gx, want_gx)):
        rel = float((got.double() - want).abs().max() / want.abs().max())
        assert rel < 1.5e-6, f"{name}: relative error {rel:.1e} over {o}x{i} blocks"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_products_over_more_than_one_block_of_256_terms_match_the_loop_reference(dtype, route):
    # The broadcast tile's K > 256 path (tile_long: blocks of 256 terms summed apart, then added)
    # in the forward (K = block_in) and the input gradient (K = block_out), on column slices of
    # wider tensors (leading dimensions past the width), with random sizes: a last block of any
    # length, partial row tiles, one column chunk (11-12 outputs: under every variant's chunk,
    # above its dot-form limit) and several (65-100). Input-gradient blocks stay under
    # BLAS_GRADS_MIN_BLOCK so the kernels, not BLAS, compute them.
    rng = random.Random(90)
    gen = torch.Generator().manual_seed(90)
    for which, (lo, hi), bias in itertools.product(("forward", "input gradient"), ((11, 12), (65, 100)),
                                                    (True, False)):
        k, nw = rng.randint(257, 600), rng.randint(lo, hi)
        i, o = (k, nw) if which == "forward" else (nw, k)
        n, g, pad = rng.randint(1, 40), rng.randint(1, 3), rng.randint(1, 5)
        wide = torch.randn(n, g * i + 2 * pad, dtype=dtype, generator=gen)
        x = wide[:, pad : pad + g * i].requires_grad_(True)
        w = torch.randn(g, o, i, dtype=dtype, generator=gen, requires_grad=True)
        b = torch.randn(g * o, dtype=dtype, generator=gen, requires_grad=True) if bias else None
        gy = torch.randn(n, g * o + pad, dtype=dtype, generator=gen)[:, pad:]
        got = _grads(lambda *t: grouped_linear(*t, backend="simd"), x, w, b, gy)
        up = [None if t is None else t.detach().double().requires_grad_(True) for t in (x, w, b)]
        want = _grads(reference_loop, *up, gy.double())
        for name, a, c, terms in zip(("y", "gx", "gw", "gb"), got, want, (i, o, n, n)):
            tol = tolerances(dtype, k=terms, magnitude=float(c.detach().abs().max()))
            torch.testing.assert_close(a.detach().double(), c.detach(), **tol,
                                       msg=lambda m, s=f"{which} {name} N={n} G={g} {i}x{o}": f"{s}: {m}")


def test_first_use_from_many_threads_builds_the_library_once(tmp_path):
    # simd._library was a bare lru_cache: 8 threads making their first call at once each
    # compiled the library and renamed it over the others', and a thread whose copy was
    # replaced while it loaded found simd "unusable ... was replaced while it was loaded".
    import os
    import subprocess
    import sys

    log, cc = tmp_path / "cc.log", tmp_path / "cc.sh"
    cc.write_text(f'#!/bin/sh\ncase "$*" in *--version*) ;; *) echo x >> {log};; esac\nexec "${{REAL_CC:-cc}}" "$@" -O0\n')  # -O0: see _builds.py
    cc.chmod(0o755)
    code = ("import threading, torch, blockdiag\n"
            "bar = threading.Barrier(8); errors = []\n"
            "def work():\n"
            "    layer = blockdiag.GroupedLinear(30, 35, groups=5, backend='simd'); x = torch.randn(16, 30)\n"
            "    bar.wait()\n"
            "    try: layer(x)\n"
            "    except Exception as e: errors.append(repr(e))\n"
            "ts = [threading.Thread(target=work) for _ in range(8)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n"
            "assert not errors, errors[:2]\n")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), CC=str(cc), REAL_CC=os.environ.get("CC", "cc"),
               BLOCKDIAG_PROFILE=str(tmp_path / "none.json"), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert log.read_text().count("x") == 1
