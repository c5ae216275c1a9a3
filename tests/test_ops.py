"""Every backend as a registered operator (issue 21): ``torch.ops.blockdiag.<name>[_backward]``.

For every registered backend that runs on CPU here, and for ``auto``:

* ``torch.library.opcheck`` (schema, fake kernel, autograd registration, and on a subset of
  cases AOT dispatch with dynamic shapes: see ``AOT_CASES``) on the forward op over dtype x
  grad mode x bias, and on the backward op;
  the ops' values against the float64 reference, gradients not asked for as empty tensors;
* ``FlopCounterMode`` counts ``2*N*G*in*out`` per product (forward, and each gradient product
  of the backward);
* ``torch.profiler`` names the forward (and, in training, the backward) ``blockdiag::<name>``;
* meta tensors and ``FakeTensorMode``: right shape, dtype and device, without touching data;
* forward-mode AD: the tangent is the grouped product of the tangents, never ``None``, with
  frozen parameters, under ``no_grad`` and with parameter tangents;
* ``gradcheck`` (fast mode) in float64 with forward AD and batched gradients; ``gradgradcheck`` passes
  where the backend declares ``double_grad`` and raises :class:`BlockDiagError` elsewhere.

A backend unavailable here (``simd`` without AVX-512, ``torch_sparse`` not installed,
``grouped_mm`` without a recent CUDA GPU) is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.autograd import forward_ad as fwAD
from torch.utils.flop_counter import FlopCounterMode

import blockdiag
from blockdiag import BlockDiagError, grouped_linear
from blockdiag.backends import get
from blockdiag.testing import reference_loop, tolerances

from _params import DEVICES, DTYPES, backends_and_auto, require_backend

ops = pytest.importorskip("blockdiag.ops", reason="blockdiag.ops (issue 21) is not there yet")

ALL = backends_and_auto()
GRAD = [pytest.param(False, id="nograd"), pytest.param(True, id="grad")]
BIAS = [pytest.param(False, id="nobias"), pytest.param(True, id="bias")]

# (N, G, block_in, block_out): every extent distinct from the others, so that a dynamic N in
# the AOT check cannot be confused with a feature size.
SHAPE = (5, 3, 4, 2)
WIDE = (9, 2, 3, 5)


def _operands(shape=SHAPE, dtype=torch.float32, grad=False, bias=True, device="cpu"):
    n, g, i, o = shape
    x = torch.randn(n, g * i, dtype=dtype, device=device, requires_grad=grad)
    w = torch.randn(g, o, i, dtype=dtype, device=device, requires_grad=grad)
    b = torch.randn(g * o, dtype=dtype, device=device, requires_grad=grad) if bias else None
    return x, w, b


def _f64(t):
    return None if t is None else t.detach().double()


def _fwd_args(name, x, w, b, train):
    return (x, w, b, train) if name == "auto" else (x, w, b)


def _ref_grads(x, w, b, gy):
    """Reference output and gradients of ``(y * gy).sum()`` in float64."""
    x64, w64 = _f64(x).requires_grad_(), _f64(w).requires_grad_()
    b64 = None if b is None else _f64(b).requires_grad_()
    y = reference_loop(x64, w64, b64)
    ins = [t for t in (x64, w64, b64) if t is not None]
    grads = torch.autograd.grad((y * gy.double()).sum(), ins)
    gx, gw = grads[:2]
    gb = grads[2] if b is not None else None
    return y.detach(), gx, gw, gb


def _close(actual, expected, dtype, k=4, what=""):
    expected = expected.to(actual.dtype)
    tol = tolerances(dtype, k, magnitude=float(expected.abs().max()) if expected.numel() else 1.0)
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------- the ops


@pytest.mark.parametrize("name", ALL)
def test_op_schemas(name):
    require_backend(name)
    fwd, bwd = ops.forward_op(name), ops.backward_op(name)
    assert fwd is getattr(torch.ops.blockdiag, name).default
    assert bwd is getattr(torch.ops.blockdiag, name + "_backward").default
    extra = ", bool train" if name == "auto" else ""
    assert str(fwd._schema) == f"blockdiag::{name}(Tensor x, Tensor weight, Tensor? bias{extra}) -> Tensor"
    assert str(bwd._schema) == (
        f"blockdiag::{name}_backward(Tensor grad, Tensor x, Tensor weight, bool has_bias, "
        "bool need_input, bool need_weight) -> (Tensor, Tensor, Tensor)"
    )


def test_op_lookup_refuses_a_name_without_ops():
    # Neither torch's AttributeError about its namespace, nor another op of the namespace
    # (fm_rows is GroupedMLP's chain's, not a backend's) handed out as a backend's.
    for lookup in (ops.forward_op, ops.backward_op):
        for name in ("nosuch", "fm_rows"):
            with pytest.raises(BlockDiagError, match=rf"{lookup.__name__}: '{name}' is not a backend with ops; those are 'auto', 'loop'"):
                lookup(name)


# opcheck's AOT-dispatch check (make_fx and AOTAutograd with dynamic shapes) costs about as
# much as all the others together, so it runs on two of the eight dtype x grad x bias cases
# (one per dtype, one with autograd, one without) and on the second shape; every case gets the
# schema, fake-tensor and autograd-registration checks.
CHEAP_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")
FULL_UTILS = (*CHEAP_UTILS, "test_aot_dispatch_dynamic")
AOT_CASES = {(torch.float32, True, True), (torch.float64, False, False)}


@pytest.mark.parametrize("bias", BIAS)
@pytest.mark.parametrize("grad", GRAD)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ALL)
def test_forward_opcheck(name, dtype, grad, bias):
    require_backend(name)
    x, w, b = _operands(SHAPE, dtype, grad, bias)
    op = ops.forward_op(name)
    args = _fwd_args(name, x, w, b, grad)
    torch.library.opcheck(op, args, test_utils=FULL_UTILS if (dtype, grad, bias) in AOT_CASES else CHEAP_UTILS)
    y = op(*args)
    assert y.shape == (SHAPE[0], SHAPE[1] * SHAPE[3]) and y.dtype == dtype
    _check_against_reference(y, x, w, b, dtype, grad, f"{name} forward op")


def _check_against_reference(y, x, w, b, dtype, grad, what):
    """``y`` and, with ``grad``, the gradients of input, weight and bias against the float64 loop."""
    _close(y.detach(), reference_loop(_f64(x), _f64(w), _f64(b)), dtype, what=what)
    if grad:
        gy = torch.randn_like(y)
        got = torch.autograd.grad((y * gy).sum(), [t for t in (x, w, b) if t is not None])
        _, *want = _ref_grads(x, w, b, gy)
        for g_, w_, label in zip(got, want, ("input", "weight", "bias")):
            _close(g_, w_, dtype, k=SHAPE[0], what=f"{what}: gradient of {label}")


@pytest.mark.parametrize("name", ALL)
def test_forward_opcheck_other_shape(name):
    # A second shape (wider blocks, more rows), in training with bias, float64.
    require_backend(name)
    x, w, b = _operands(WIDE, torch.float64, True, True)
    torch.library.opcheck(ops.forward_op(name), _fwd_args(name, x, w, b, True), test_utils=FULL_UTILS)


# The half dtypes through the ops of each backend that declares them on CPU (simd computes them
# in float32, each result rounded once), and auto's: the matrices above run float32 and float64.
HALF = [pytest.param(dt, id=str(dt).removeprefix("torch.")) for dt in (torch.bfloat16, torch.float16)]
HALF_CPU_OPS = [p for p in ALL if p.values[0] == "auto" or any(
    dt in get(p.values[0]).dtypes.get("cpu", ()) for dt in (torch.bfloat16, torch.float16))]


@pytest.mark.parametrize("grad", GRAD)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", HALF_CPU_OPS)
def test_half_precision_forward_and_backward_ops_on_cpu(name, dtype, grad):
    require_backend(name)
    x, w, b = _operands(SHAPE, dtype, grad, True)
    op = ops.forward_op(name)
    args = _fwd_args(name, x, w, b, grad)
    full = name == "simd" and grad  # AOT dispatch once per half dtype
    torch.library.opcheck(op, args, test_utils=FULL_UTILS if full else CHEAP_UTILS)
    y = op(*args)
    assert y.dtype == dtype
    _check_against_reference(y, x, w, b, dtype, grad, f"{name} forward op")
    gy = torch.randn_like(y.detach())
    bwd_args = (gy, x.detach(), w.detach(), True, True, True)
    torch.library.opcheck(ops.backward_op(name), bwd_args, test_utils=CHEAP_UTILS)
    _, *want = _ref_grads(x, w, b, gy)
    for got, ref, label in zip(ops.backward_op(name)(*bwd_args), want, ("input", "weight", "bias")):
        assert got.dtype == dtype, label
        _close(got, ref, dtype, k=SHAPE[0], what=f"{name} backward op, {label}")


# What blockdiag::auto_inline decomposes into at a concrete batch: a backend's torch ops with
# torch's autograd (bmm_fm), its torch ops inside its own autograd Function (bmm_fm_bmm), or
# the opaque blockdiag::auto (loop: not torch ops; bmm_fm_loop: its backward writes slices).
INLINE_CHOICES = ["bmm_fm", "bmm_fm_bmm", "bmm_fm_loop", "loop"]


@pytest.mark.parametrize("bias", BIAS)
@pytest.mark.parametrize("grad", GRAD)
@pytest.mark.parametrize("chosen", INLINE_CHOICES)
def test_auto_inline_opcheck(chosen, grad, bias, monkeypatch):
    from blockdiag.ops import auto as auto_op

    monkeypatch.setattr(auto_op, "choice", lambda x, weight, train, plain=True: chosen)
    dtype = torch.float64
    x, w, b = _operands(SHAPE, dtype, grad, bias)
    torch.library.opcheck(auto_op.INLINE, (x, w, b, grad), test_utils=FULL_UTILS)
    with torch.profiler.profile() as prof:
        y = auto_op.INLINE(x, w, b, grad)
    ran = {e.name for e in prof.events() if e.name.startswith("blockdiag::")}
    assert ("blockdiag::auto" in ran) == (chosen in ("loop", "bmm_fm_loop")), sorted(ran)
    _check_against_reference(y, x, w, b, dtype, grad, f"auto_inline ({chosen})")


class _Sub(torch.Tensor):
    """A plain ``torch.Tensor`` subclass: it reaches the op's kernels as itself."""


@pytest.mark.parametrize("operand", ["input", "weight", "bias", "grad"])
@pytest.mark.parametrize("native", ["simd", "mkl_batch"])
def test_auto_op_routes_a_subclass_operand_away_from_a_c_choice(native, operand, monkeypatch):
    # A C backend refuses a subclass by name (it cannot take its pointer); auto must run the
    # best-ranked torch-ops backend instead, whichever backend the table ranks first.
    require_backend(native)
    from blockdiag import dispatch
    from blockdiag.ops import auto as auto_op

    real = dispatch.choose

    def native_first(p):
        plan = real(p)
        first = next(c for c in plan.candidates if c.name == native)
        rest = tuple(c for c in plan.candidates if c.name != native)
        return dataclasses.replace(plan, backend=native, candidates=(dataclasses.replace(first, ok=True), *rest))

    monkeypatch.setattr(dispatch, "choose", native_first)
    monkeypatch.setattr(auto_op, "_CHOICE", {})
    x, w, b = _operands(SHAPE, torch.float64, True, True)
    gy = torch.randn(SHAPE[0], SHAPE[1] * SHAPE[3], dtype=torch.float64)
    plain = auto_op.choice(x, w, True)
    assert plain == native and auto_op.choice(x, w, True, plain=False) not in ("simd", "mkl_batch")
    sub = {"input": x, "weight": w, "bias": b, "grad": gy}[operand].detach().as_subclass(_Sub)
    args = {"input": x, "weight": w, "bias": b, "grad": gy, operand: sub.requires_grad_(operand != "grad")}
    y = auto_op.auto(args["input"], args["weight"], args["bias"], True)
    leaves = [args[k] for k in ("input", "weight", "bias")]
    got = torch.autograd.grad(y, leaves, args["grad"])
    want_y, *want = _ref_grads(*leaves, gy)
    _close(y.detach(), want_y, torch.float64, what=f"auto, {operand} a subclass")
    for g_, w_, label in zip(got, want, ("input", "weight", "bias")):
        _close(g_, w_, torch.float64, k=SHAPE[0], what=f"auto, {operand} a subclass: gradient of {label}")


# Where a feature-major backend's rows are wide enough for a strided write to pay
# (``ops._define.rows_pay``: 64 bytes), the auto op writes its row-major result and input
# gradient directly, and a training graph at a batch of ``ops.auto.ROWS_OP_MIN_BATCH`` or
# more records the op instead of the transposed view.
ROWS_SHAPES = {torch.float32: (5, 3, 16, 16), torch.float64: (5, 3, 8, 8)}
FEATURE_MAJOR = ["bmm_fm", "bmm_fm_bmm", "bmm_fm_loop"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", BIAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FEATURE_MAJOR)
def test_rows_kernels_equal_the_feature_major_ones(name, dtype, bias, device):
    from blockdiag.ops._define import _ENTRIES, generic_backward, rows_pay

    entry = _ENTRIES[name]
    n, g, i, o = ROWS_SHAPES[dtype]
    assert rows_pay(o, dtype) and rows_pay(i, dtype) and not rows_pay(o // 2, dtype)
    for rows in (n, 1, 0):
        x, w, b = _operands((rows, g, i, o), dtype, False, bias, device)
        y = entry.rows(x, w, b)
        assert y.is_contiguous() and y.shape == (rows, g * o) and y.device == x.device, (y.shape, y.stride())
        _close(y, reference_loop(_f64(x), _f64(w), _f64(b)), dtype, what=f"{name} rows, {rows} rows")
        if entry.rows_input_grad is not None:
            gy = torch.randn(rows, g * o, dtype=dtype, device=device)
            gx = entry.rows_input_grad(gy, w)
            assert gx.is_contiguous() and gx.shape == x.shape
            _close(gx, generic_backward(gy, x, w, bias, True, False, False)[0], dtype, k=o, what=f"{name} rows input gradient")


@pytest.mark.parametrize("large", [pytest.param(False, id="small-batch"), pytest.param(True, id="large-batch")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grad", GRAD)
@pytest.mark.parametrize("chosen", FEATURE_MAJOR)
def test_auto_inline_writes_rows_for_a_feature_major_choice_in_training(chosen, grad, dtype, large, monkeypatch):
    from blockdiag.ops import auto as auto_op

    monkeypatch.setattr(auto_op, "choice", lambda x, weight, train, plain=True: chosen)
    shape = ROWS_SHAPES[dtype]
    assert shape[0] < auto_op.ROWS_OP_MIN_BATCH
    if large:  # the threshold moved to these operands rather than a large product computed
        monkeypatch.setattr(auto_op, "ROWS_OP_MIN_BATCH", shape[0])
    x, w, b = _operands(shape, dtype, grad, True)
    torch.library.opcheck(auto_op.INLINE, (x, w, b, grad), test_utils=FULL_UTILS)
    with torch.profiler.profile() as prof:
        y = auto_op.INLINE(x, w, b, grad)
    ran = {e.name for e in prof.events() if e.name.startswith("blockdiag::")}
    # In training at a large batch the op runs (its result row-major, so a compiled
    # backward gets the caller's gradient as it is); without autograd, or below the op's
    # fixed cost, the inlined view is kept. bmm_fm_loop is never inlined (loop's backward).
    opaque = (grad and large) or chosen == "bmm_fm_loop"
    assert ("blockdiag::auto" in ran) == opaque, sorted(ran)
    assert y.is_contiguous() == opaque, y.stride()
    _check_against_reference(y, x, w, b, dtype, grad, f"auto_inline ({chosen}, rows)")
    if grad and opaque:
        with torch.profiler.profile() as prof:
            y = auto_op.INLINE(x, w, b, grad)
            y.backward(torch.randn_like(y))
        assert "blockdiag::auto_backward" in {e.name for e in prof.events()}


# ------------------------------------------------ blockdiag::fm_rows (GroupedMLP's traced chain)


def _fm_operands(shape, dtype, grad, bias, device="cpu"):
    """``h [G, in, N]`` (the chain's feature-major hidden units), weight and bias."""
    n, g, i, o = shape
    x, w, b = _operands(shape, dtype, grad, bias, device)
    h = x.detach().view(n, g, i).permute(1, 2, 0).contiguous().requires_grad_(grad)
    return h, w, b


def _rows_of(h):
    """``h [G, in, N]`` as the row-major input ``[N, G*in]`` of the reference loop."""
    return h.permute(2, 0, 1).reshape(h.shape[2], h.shape[0] * h.shape[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", BIAS)
@pytest.mark.parametrize("grad", GRAD)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fm_rows_op(dtype, grad, bias, device):
    from blockdiag.ops.fm_rows import fm_rows

    shape = ROWS_SHAPES[dtype]
    n, g, _, o = shape
    op = torch.ops.blockdiag.fm_rows.default
    h, w, b = _fm_operands(shape, dtype, grad, bias, device)
    if device == "cpu":
        torch.library.opcheck(op, (h, w, b), test_utils=FULL_UTILS)
    for rows in (n, 1, 0):
        hr = h.detach()[..., :rows].requires_grad_(grad)
        y = fm_rows(hr, w, b)
        assert y.shape == (rows, g * o) and y.is_contiguous() and y.device == h.device, (y.shape, y.stride())
        _close(y.detach(), reference_loop(_f64(_rows_of(hr)), _f64(w), _f64(b)), dtype, what=f"fm_rows, {rows} rows")
        if grad and rows:
            gy = torch.randn_like(y)
            ins = [t for t in (hr, w, b) if t is not None]
            got = torch.autograd.grad((y * gy).sum(), ins)
            _, gx, gw, gb = _ref_grads(_rows_of(hr), w, b, gy)
            want = [gx.view(rows, g, -1).permute(1, 2, 0), gw, gb]
            for g_, w_, label in zip(got, want, ("input", "weight", "bias")):
                _close(g_, w_, dtype, k=rows, what=f"fm_rows: gradient of {label}")


def test_fm_rows_gradcheck_forward_ad_vmap_and_flops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from blockdiag.ops.fm_rows import fm_rows

    h, w, b = _fm_operands((4, 3, 2, 5), torch.float64, True, True)
    assert torch.autograd.gradcheck(fm_rows, (h, w, b), check_forward_ad=True, check_batched_grad=True, fast_mode=True)
    assert torch.autograd.gradgradcheck(fm_rows, (h, w, b), fast_mode=True)
    # vmap over stacked operands: each copy is its own product.
    hs, ws, bs = (torch.randn(2, *t.shape, dtype=t.dtype) for t in (h, w, b))
    got = torch.func.vmap(fm_rows)(hs, ws, bs)
    want = torch.stack([fm_rows(hs[k], ws[k], bs[k]) for k in range(2)])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.func.vmap(fm_rows, in_dims=(0, None, None))(hs, w, b),
                               torch.stack([fm_rows(hs[k], w, b) for k in range(2)]))
    with FlopCounterMode(display=False) as fc:
        fm_rows(h.detach(), w.detach(), b.detach())
    assert fc.get_total_flops() == 2 * 4 * 3 * 2 * 5, fc.get_flop_counts()
    with FakeTensorMode() as mode:
        y = fm_rows(mode.from_tensor(h), mode.from_tensor(w), mode.from_tensor(b))
    assert y.shape == (4, 15) and y.stride() == (15, 1)


NEEDS = [
    pytest.param(True, True, True, id="input-weight-bias"),
    pytest.param(True, False, False, id="input"),
    pytest.param(False, True, True, id="weight-bias"),
    pytest.param(False, False, True, id="bias-only"),
]


@pytest.mark.parametrize("need_input,need_weight,has_bias", NEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ALL)
def test_backward_opcheck(name, dtype, need_input, need_weight, has_bias):
    require_backend(name)
    x, w, b = _operands(SHAPE, dtype, False, has_bias)
    gy = torch.randn(SHAPE[0], SHAPE[1] * SHAPE[3], dtype=dtype)
    op = ops.backward_op(name)
    args = (gy, x, w, has_bias, need_input, need_weight)
    full = dtype == torch.float64 and need_input and need_weight  # AOT dispatch once per backend
    torch.library.opcheck(op, args, test_utils=FULL_UTILS if full else CHEAP_UTILS)
    gx, gw, gb = op(*args)
    _, rx, rw, rb = _ref_grads(x, w, b, gy)
    for got, want, needed, label in ((gx, rx, need_input, "input"), (gw, rw, need_weight, "weight"),
                                     (gb, rb, has_bias, "bias")):
        if needed:
            assert got.shape == want.shape and got.dtype == dtype, label
            _close(got, want, dtype, k=SHAPE[0], what=f"{name} backward op, {label}")
        else:
            assert got.numel() == 0, f"{label} gradient was not asked for: expected an empty tensor, got {got.shape}"


# ------------------------------------------------------------------------------ FLOPs


def _flops(x, w):
    n, (g, o, i) = x.shape[0], w.shape
    return 2 * n * g * i * o


@pytest.mark.parametrize("name", ALL)
def test_flop_counter_forward(name):
    require_backend(name)
    x, w, b = _operands(SHAPE, torch.float32, False, True)
    with FlopCounterMode(display=False) as fc:
        y = grouped_linear(x, w, b, backend=name)
    assert y.shape == (SHAPE[0], SHAPE[1] * SHAPE[3])
    assert fc.get_total_flops() == _flops(x, w), fc.get_flop_counts()
    # lead dims are rows: [2, 5, G*in] is 10 rows
    x3 = torch.randn(2, *x.shape)
    with FlopCounterMode(display=False) as fc:
        grouped_linear(x3, w, b, backend=name)
    assert fc.get_total_flops() == 2 * _flops(x, w), fc.get_flop_counts()


@pytest.mark.parametrize("frozen_input", [pytest.param(False, id="input-grad"), pytest.param(True, id="frozen-input")])
@pytest.mark.parametrize("name", ALL)
def test_flop_counter_backward(name, frozen_input):
    require_backend(name)
    x, w, b = _operands(SHAPE, torch.float32, True, True)
    if frozen_input:
        x = x.detach()
    with FlopCounterMode(display=False) as fc:
        y = grouped_linear(x, w, b, backend=name)
        fwd = fc.get_total_flops()
        y.sum().backward()
    products = 1 if frozen_input else 2  # the weight's gradient, and the input's unless frozen
    assert fwd == _flops(x, w), fc.get_flop_counts()
    assert fc.get_total_flops() == (1 + products) * _flops(x, w), fc.get_flop_counts()


# --------------------------------------------------------------------------- profiler


def _event_names(train, fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = fn()
        if train:
            y.sum().backward()
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("train", [pytest.param(False, id="inference"), pytest.param(True, id="train")])
@pytest.mark.parametrize("name", ALL)
def test_profiler_names_the_ops(name, train):
    require_backend(name)
    x, w, b = _operands(SHAPE, torch.float32, train, True)
    seen = _event_names(train, lambda: grouped_linear(x, w, b, backend=name))
    if name == "auto":
        # auto may run as its own op or as the op of the backend it planned: either is named.
        chosen = blockdiag.GroupedLinear(12, 6, 3).plan(x).backend
        fwd = {"blockdiag::auto", f"blockdiag::{chosen}"}
    else:
        fwd = {f"blockdiag::{name}"}
    assert fwd & seen, f"no profiler event among {sorted(fwd)}; blockdiag events: {sorted(s for s in seen if 'blockdiag' in s)}"
    if train:
        bwd = {f + "_backward" for f in fwd}
        assert bwd & seen, (
            f"no profiler event among {sorted(bwd)}; blockdiag events: {sorted(s for s in seen if 'blockdiag' in s)}"
        )


# ----------------------------------------------------------------------- meta and fake


LEADS = [pytest.param((5,), id="2d"), pytest.param((2, 5), id="3d")]


@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("grad", GRAD)
@pytest.mark.parametrize("name", ALL)
def test_meta_tensors(name, grad, lead):
    require_backend(name)
    g, i, o = SHAPE[1:]
    x = torch.randn(*lead, g * i, device="meta", dtype=torch.float64, requires_grad=grad)
    w = torch.randn(g, o, i, device="meta", dtype=torch.float64, requires_grad=grad)
    b = torch.randn(g * o, device="meta", dtype=torch.float64, requires_grad=grad)
    y = grouped_linear(x, w, b, backend=name)
    assert (y.shape, y.dtype, y.device.type) == ((*lead, g * o), torch.float64, "meta")
    if grad:
        y.sum().backward()
        for t in (x, w, b):
            assert t.grad is not None and t.grad.shape == t.shape and t.grad.is_meta


@pytest.mark.parametrize("grad", GRAD)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ALL)
def test_fake_tensor_mode(name, dtype, grad):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    require_backend(name)
    g, i, o = SHAPE[1:]
    with FakeTensorMode():
        layer = blockdiag.GroupedLinear(g * i, g * o, g, backend=name, dtype=dtype)
        x = torch.randn(7, g * i, dtype=dtype, requires_grad=grad)
        y = layer(x) if grad else grouped_linear(x, layer.weight.detach(), layer.bias.detach(), backend=name)
        assert isinstance(y, FakeTensor)
        assert (y.shape, y.dtype, y.device.type) == ((7, g * o), dtype, "cpu")
        if grad:
            y.sum().backward()
            for t in (x, layer.weight, layer.bias):
                assert isinstance(t.grad, FakeTensor) and t.grad.shape == t.shape


# -------------------------------------------------------------------------- forward AD


FWD_CASES = [
    pytest.param("frozen", id="frozen-params"),
    pytest.param("no_grad", id="no_grad"),
    pytest.param("trainable", id="trainable-params"),
    pytest.param("param-tangents", id="param-tangents"),
]


@pytest.mark.parametrize("case", FWD_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ALL)
def test_forward_ad_tangent(name, dtype, case):
    require_backend(name)
    x, w, b = _operands(SHAPE, dtype, False, True)
    if case == "trainable":
        w.requires_grad_()
        b.requires_grad_()
    tx, tw, tb = torch.randn_like(x), torch.randn_like(w), torch.randn_like(b)
    ctx = torch.no_grad() if case == "no_grad" else contextlib.nullcontext()
    with fwAD.dual_level(), ctx:
        xd = fwAD.make_dual(x, tx)
        if case == "param-tangents":
            wd, bd = fwAD.make_dual(w, tw), fwAD.make_dual(b, tb)
        else:
            wd, bd = w, b
        y = grouped_linear(xd, wd, bd, backend=name)
        primal, tangent = fwAD.unpack_dual(y)
    assert tangent is not None, f"{name}: forward AD dropped the tangent ({case})"
    _close(primal.detach(), reference_loop(_f64(x), _f64(w), _f64(b)), dtype, what="primal")
    want = reference_loop(_f64(tx), _f64(w), None)
    if case == "param-tangents":
        want = want + reference_loop(_f64(x), _f64(tw), _f64(tb))
    _close(tangent.detach(), want, dtype, what=f"{name} tangent ({case})")


@pytest.mark.parametrize("params", ["frozen", "trainable"])
@pytest.mark.parametrize("name", ALL)
def test_forward_ad_runs_no_product_for_an_operand_without_a_tangent(name, params):
    # An autograd.Function hands materialised zero tangents by default: a frozen weight's
    # zero tangent then cost a third product (x times zeros) on every forward-AD call.
    require_backend(name)
    x, w, b = _operands(SHAPE, torch.float64, False, True)
    w.requires_grad_(params == "trainable")
    with FlopCounterMode(display=False) as primal:
        grouped_linear(x, w, b, backend=name)
    with FlopCounterMode(display=False) as dual, fwAD.dual_level():
        y = grouped_linear(fwAD.make_dual(x, torch.randn_like(x)), w, b, backend=name)
        assert fwAD.unpack_dual(y).tangent is not None
    assert primal.get_total_flops() > 0
    assert dual.get_total_flops() == 2 * primal.get_total_flops()


class _NoGrad(torch.autograd.Function):
    """Passes its input on and gives it no gradient (an undefined one) in backward."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        return None


@pytest.mark.parametrize("name", ALL)
def test_an_undefined_gradient_under_forward_ad_is_no_gradient(name):
    # Under a dual level the ops leave gradients unmaterialised (so that a missing tangent is
    # None): a backward reached with an undefined gradient must give none, not fail.
    require_backend(name)
    x, w, b = _operands(SHAPE, torch.float64, True, True)
    with fwAD.dual_level():
        y = grouped_linear(x, w, b, backend=name)
        (_NoGrad.apply(y).sum() + x.sum()).backward()
    assert w.grad is None or not w.grad.any()
    torch.testing.assert_close(x.grad, torch.ones_like(x))


def _forward_over_reverse(fn, x, w, b, tangents):
    """The gradients of ``tanh(fn(x, w, b))**2`` summed, and their tangents, in one dual level."""
    with fwAD.dual_level():
        duals = [fwAD.make_dual(t.detach().clone().requires_grad_(), v) for t, v in zip((x, w, b), tangents)]
        grads = torch.autograd.grad(torch.tanh(fn(*duals)).pow(2).sum(), duals)
        return [fwAD.unpack_dual(g) for g in grads]


@pytest.mark.parametrize("wrt", ["input", "params", "all"])
@pytest.mark.parametrize("name", ALL)
def test_forward_over_reverse_gives_the_tangent_of_the_gradient(name, wrt):
    # A backward run inside a dual level (forward-over-reverse: the tangent of a gradient is a
    # Hessian-vector product) must carry the tangents of the gradient and the operands through
    # the gradient, as nn.Linear's does. The C kernels dropped them (the product came out
    # silently zero, under auto too); loop's out= products raised NotImplementedError.
    require_backend(name)
    x, w, b = _operands(SHAPE, torch.float64, False, True)
    zeros = [torch.zeros_like(t) for t in (x, w, b)]
    tangents = [torch.randn_like(t) if wrt == "all" or (k == 0) == (wrt == "input") else z
                for k, (t, z) in enumerate(zip((x, w, b), zeros))]
    got = _forward_over_reverse(lambda x, w, b: grouped_linear(x, w, b, backend=name), x, w, b, tangents)
    want = _forward_over_reverse(reference_loop, x, w, b, tangents)
    for what, (g, t), (gw, tw) in zip(("input", "weight", "bias"), got, want):
        torch.testing.assert_close(g, gw, msg=lambda m, what=what: f"{name}: gradient of {what}: {m}")
        assert t is not None, f"{name}: the gradient of {what} lost its tangent"
        torch.testing.assert_close(t, tw, msg=lambda m, what=what: f"{name}: tangent of the {what} gradient: {m}")


@pytest.mark.parametrize("name", ALL)
def test_gradcheck_float64(name):
    require_backend(name)
    x, w, b = _operands((3, 2, 3, 2), torch.float64, True, True)

    def f(x, w, b):
        return grouped_linear(x, w, b, backend=name)

    assert torch.autograd.gradcheck(
        f, (x, w, b), check_forward_ad=True, check_backward_ad=True, check_batched_grad=True, fast_mode=True
    )
    if name == "auto":
        chosen = blockdiag.GroupedLinear(6, 4, 2, dtype=torch.float64).plan(x).backend
        declared = get(chosen).double_grad
        assert declared, f"auto picks {chosen!r} here, which has no double backward: pick another shape"
    else:
        declared = get(name).double_grad
    if declared:
        assert torch.autograd.gradgradcheck(f, (x, w, b), fast_mode=True)
    else:
        with pytest.raises(BlockDiagError, match=name):
            torch.autograd.gradgradcheck(f, (x, w, b), fast_mode=True)


@pytest.mark.parametrize("name", ["csr", "bsr"])
def test_a_dtype_the_backend_declines_is_refused_after_another_dtype_of_the_same_shape_ran(name):
    op = getattr(torch.ops.blockdiag, name)
    x, w = torch.randn(4, 6), torch.randn(2, 3, 3)
    op(x, w, None)  # float32 of this shape: validated, and remembered
    with pytest.raises(BlockDiagError, match="does not support float16"):
        op(x.half(), w.half(), None)  # not torch's NotImplementedError from inside the kernel



# (id, forward operands (x, weight, bias) from the good ones, pattern)
BAD_FORWARD = [
    ("bias-short", lambda x, w, b: (x, w, b[:-1]), r"bias must have shape \(6,\) for weight \(2, 3, 3\), got \(5,\)"),
    ("bias-long", lambda x, w, b: (x, w, torch.randn(9)), r"bias must have shape \(6,\).*got \(9,\)"),
    ("bias-2d", lambda x, w, b: (x, w, b.view(2, 3)), r"bias must have shape \(6,\).*got \(2, 3\)"),
    ("bias-float64", lambda x, w, b: (x, w, b.double()), r"bias has dtype torch\.float64 but input has dtype torch\.float32"),
    ("weight-float64", lambda x, w, b: (x, w.double(), b), r"weight has dtype torch\.float64 but input"),
    ("weight-2d", lambda x, w, b: (x, w[0], b), r"weight must be \[groups, block_out, block_in\], got shape \(3, 3\)"),
    # The kernels index the input by the weight's shape: a wider input was read in part.
    ("input-wide", lambda x, w, b: (torch.randn(4, 7), w, b), r"input must be \[N, 6\] for weight \(2, 3, 3\), got \(4, 7\)"),
    ("input-narrow", lambda x, w, b: (x[:, :5], w, b), r"input must be \[N, 6\] for weight \(2, 3, 3\), got \(4, 5\)"),
    ("weight-no-groups", lambda x, w, b: (x[:, :0], w[:0], b[:0]),
     r"weight must hold at least one group, got shape \(0, 3, 3\) \(groups=0\)"),
]
# (id, backward operands (grad, x, weight) from the good ones, pattern)
BAD_BACKWARD = [
    # A row slice of a larger gradient: its storage holds the rows the kernels would read.
    ("grad-fewer-rows", lambda gy, x, w: (gy[:2], x, w), r"grad must be \[N, 6\] with the input's N=4 rows, got \(2, 6\)"),
    ("input-fewer-rows", lambda gy, x, w: (gy, x[:2], w), r"grad must be \[N, 6\] with the input's N=2 rows, got \(4, 6\)"),
    ("grad-narrow", lambda gy, x, w: (gy[:, :5], x, w), r"grad must be \[N, 6\].*got \(4, 5\)"),
    ("grad-float64", lambda gy, x, w: (gy.double(), x, w), r"grad has dtype torch\.float64 but input has dtype torch\.float32"),
    ("input-narrow", lambda gy, x, w: (gy, x[:, :5], w), r"input must be \[N, 6\] for weight \(2, 3, 3\), got \(4, 5\)"),
    # Grad and input agree, the weight does not: the kernels (simd's, mkl_batch's) read the
    # weight's memory as the input's dtype.
    ("weight-float64", lambda gy, x, w: (gy, x, w.double()), r"weight has dtype torch\.float64 but input has dtype torch\.float32"),
]


@pytest.mark.parametrize("case,make,pattern", BAD_FORWARD, ids=[c[0] for c in BAD_FORWARD])
@pytest.mark.parametrize("name", ALL)
def test_the_forward_op_refuses_operands_that_do_not_fit_naming_them(name, case, make, pattern):
    # The ops are public (torch.ops.blockdiag.<name>): a bias of another length was read in
    # part (loop), broadcast (bmm) or promoted to float64 (csr, bsr), or refused by torch in
    # words that named neither the op nor the argument.
    require_backend(name)
    x, w, b = torch.randn(4, 6), torch.randn(2, 3, 3), torch.randn(6)
    op = ops.forward_op(name)
    op(*_fwd_args(name, x, w, b, False))  # the good operands of this shape are remembered
    with pytest.raises(BlockDiagError, match=f"{name}: {pattern}"):
        op(*_fwd_args(name, *make(x, w, b), False))


@pytest.mark.parametrize("case,make,pattern", BAD_BACKWARD, ids=[c[0] for c in BAD_BACKWARD])
@pytest.mark.parametrize("name", ALL)
def test_the_backward_op_refuses_operands_that_do_not_fit_naming_them(name, case, make, pattern):
    # mkl_batch took the row count from the input and read a shorter gradient's slice past
    # its end (inside the storage of the tensor it was sliced from): a gradient of wrong rows.
    require_backend(name)
    x, w, gy = torch.randn(4, 6), torch.randn(2, 3, 3), torch.randn(4, 6)
    op = ops.backward_op(name)
    op(gy, x, w, True, True, True)
    with pytest.raises(BlockDiagError, match=f"{name}_backward: {pattern}"):
        op(*make(gy, x, w), True, True, True)


# --------------------------------------------------------------------------- saved tensors


@pytest.mark.parametrize("route", [pytest.param("eager", id="eager"), pytest.param("op", id="op")])
@pytest.mark.parametrize("name", ALL)
def test_a_frozen_weight_does_not_keep_the_input_alive(name, route):
    # Only the weight gradient reads the input: with a frozen weight nn.Linear frees its
    # input once the next layer is done with it, and so must every backend (otherwise each
    # frozen layer holds an activation until backward).
    import gc
    import weakref

    require_backend(name)
    if name == "conv":
        pytest.skip("conv records torch's convolution, whose autograd saves its input as nn.Conv1d's does")
    x, w, b = _operands(SHAPE, torch.float32, False, True)
    x.requires_grad_(True)
    gy = torch.randn(SHAPE[0], SHAPE[1] * SHAPE[3])
    # A dispatch mode sends the call through the registered op instead of the eager route.
    mode = FlopCounterMode(display=False) if route == "op" else contextlib.nullcontext()
    with mode:
        h = x * 2  # an activation only the graph may hold
        ref = weakref.ref(h)
        y = grouped_linear(h, w, b, backend=name)
        del h
        gc.collect()
        assert ref() is None, f"{name}: the input of a frozen-weight product is kept until backward"
        (gx,) = torch.autograd.grad(y, x, gy)
    xr = x.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad(reference_loop(2 * xr, w.double(), b.double()), xr, gy.double())
    torch.testing.assert_close(gx, gr.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("route", [pytest.param("eager", id="eager"), pytest.param("op", id="op")])
@pytest.mark.parametrize("name", ALL)
def test_an_input_without_gradient_does_not_keep_the_weight(name, route):
    # Only the input gradient reads the weight: nn.Linear on an input that needs no gradient
    # (a first layer, heads on frozen features) does not save its weight, so the weight may
    # change in place before the backward (a step between two losses' backwards) and be
    # swapped (.to() under swap_module_params_on_conversion). Every backend but conv (torch's
    # convolution autograd saves its weight, as nn.Conv1d's does) saved it: the backward
    # raised autograd's "modified by an inplace operation".
    require_backend(name)
    if name == "conv":
        pytest.skip("conv records torch's convolution, whose autograd saves its weight as nn.Conv1d's does")
    x, w, b = _operands(SHAPE, torch.float32, False, True)
    w.requires_grad_(True)
    gy = torch.randn(SHAPE[0], SHAPE[1] * SHAPE[3])
    mode = FlopCounterMode(display=False) if route == "op" else contextlib.nullcontext()
    with mode:
        y = grouped_linear(x, w, b, backend=name)
        with torch.no_grad():
            w.mul_(0.5)
        (gw,) = torch.autograd.grad(y, w, gy)
    wr = w.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad(reference_loop(x.double(), wr, b.double()), wr, gy.double())
    torch.testing.assert_close(gw, gr.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("route", [pytest.param("eager", id="eager"), pytest.param("op", id="op")])
@pytest.mark.parametrize("name", ALL)
def test_a_frozen_weight_hands_a_copying_saved_tensors_hook_no_input_sized_tensor(name, route):
    # A hook that copies what it is given (save_on_cpu: torch.empty(t.size()).copy_(t)) made
    # the stand-in saved for the input, a one-row tensor expanded to [N, G*in], a buffer of
    # the input's size: at 4096 rows and 8 blocks of 64x64, 8.5 MB per call where nn.Linear
    # (whose weight is the dense [G*out, G*in]) hands it 1 MB. The gradient is the reference's.
    require_backend(name)
    if name == "conv" and route == "op":
        pytest.skip("conv records torch's convolution, whose autograd saves its input as nn.Conv1d's does")
    n, g, i, o = 64, 2, 4, 4  # the input (n*g*i) far larger than the dense weight (g*o*g*i)
    x, w, b = _operands((n, g, i, o), torch.float32, False, True)
    x.requires_grad_(True)
    gy = torch.randn(n, g * o)
    dense = torch.nn.Linear(g * i, g * o).requires_grad_(False)

    def handed(f):
        seen = []

        def pack(t):
            seen.append(t.numel() * t.element_size())
            return torch.empty(t.size(), dtype=t.dtype).copy_(t)

        mode = FlopCounterMode(display=False) if route == "op" else contextlib.nullcontext()
        with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            (gx,) = torch.autograd.grad(f(x * 2), x, gy)
        return sum(seen), gx

    got, gx = handed(lambda h: grouped_linear(h, w, b, backend=name))
    linear, _ = handed(dense)
    assert got <= linear, f"{name}: a copying hook was handed {got} bytes, nn.Linear's {linear}"
    xr = x.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad(reference_loop(2 * xr, w.double(), b.double()), xr, gy.double())
    torch.testing.assert_close(gx, gr.float(), rtol=1e-4, atol=1e-4)



@pytest.mark.parametrize("name", ALL)
def test_an_input_without_gradient_hands_a_copying_saved_tensors_hook_no_weight_sized_tensor(name):
    # The weight's stand-in (the input needs no gradient, so the backward never reads the
    # weight) is saved as its one value, as the input's is: expanded, a copying hook
    # (save_on_cpu) made it a buffer of the weight's size. nn.Linear saves only the input.
    require_backend(name)
    if name == "conv":
        pytest.skip("conv records torch's convolution, whose autograd saves its weight as nn.Conv1d's does")
    n, g, i, o = 4, 4, 16, 16  # the weight (g*o*i) far larger than the input (n*g*i)
    x, w, b = _operands((n, g, i, o), torch.float32, False, True)
    w.requires_grad_(True)
    gy = torch.randn(n, g * o)
    seen = []

    def pack(t):
        seen.append(t.numel() * t.element_size())
        return torch.empty(t.size(), dtype=t.dtype).copy_(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        (gw,) = torch.autograd.grad(grouped_linear(x, w, b, backend=name), w, gy)
    assert sum(seen) <= x.numel() * x.element_size() + 64, f"{name}: a copying hook was handed {seen} bytes"
    wr = w.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad(reference_loop(x.double(), wr, b.double()), wr, gy.double())
    torch.testing.assert_close(gw, gr.float(), rtol=1e-4, atol=1e-4)

def test_a_frozen_weight_in_bfloat16_neither_keeps_nor_copies_the_input():
    # simd computes bfloat16 in float32: the stand-in kept for the backward is cast one row,
    # not expanded to a full float32 copy, and the input gradient is the reference's.
    import gc
    import weakref

    require_backend("simd")
    x, w, b = (t.to(torch.bfloat16) for t in _operands(SHAPE, torch.float32, False, True))
    x.requires_grad_(True)
    gy = torch.randn(SHAPE[0], SHAPE[1] * SHAPE[3], dtype=torch.bfloat16)
    h = x * 2
    ref = weakref.ref(h)
    y = grouped_linear(h, w, b, backend="simd")
    del h
    gc.collect()
    assert ref() is None
    (gx,) = torch.autograd.grad(y, x, gy)
    xr = x.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad(reference_loop(2 * xr, w.double(), b.double()), xr, gy.double())
    assert gx.dtype == torch.bfloat16
    torch.testing.assert_close(gx.double(), gr, rtol=2e-2, atol=2e-2)
