"""The public registry: ``register_backend`` / ``unregister_backend``, the docs' example, ``list_backends``."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import blockdiag
from blockdiag import Backend, BlockDiagError, Problem, tuning
from blockdiag.dispatch import candidates, choose
from blockdiag.testing import reference_loop

ROOT = Path(__file__).resolve().parents[1]
F32 = {"cpu": frozenset({torch.float32, torch.float64})}


def _einsum(x, weight, bias):
    g, o, i = weight.shape
    y = torch.einsum("ngi,goi->ngo", x.view(x.shape[0], g, i), weight).reshape(x.shape[0], g * o)
    return y if bias is None else y + bias


@pytest.fixture
def einsum_backend():
    b = blockdiag.register_backend(Backend("test_einsum", _einsum, dtypes=F32, summary="einsum"))
    yield b
    if "test_einsum" in blockdiag.backends.names():
        blockdiag.unregister_backend("test_einsum")


def test_docs_extending_example_runs():
    # docs/extending.md includes this file: the page's code is what runs here.
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "extending_example.py")],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "einsum" in r.stdout and "already registered" in r.stdout


def test_the_extending_page_names_every_backend_field():
    # docs/extending.md describes the Backend fields a new backend sets (its table, and the
    # list of "the other fields"): a field left out is one a backend author never hears of.
    import dataclasses

    page = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    missing = [f.name for f in dataclasses.fields(Backend) if f"`{f.name}`" not in page]
    assert not missing, missing


def _docs_block(page: str, marker: str) -> str:
    """The ```python block of ``docs/<page>`` that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(encoding="utf-8"), re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def test_the_docs_way_to_measure_a_registered_backend_saves_its_times(einsum_backend, tmp_path, monkeypatch):
    # docs/extending.md, "How auto treats it": the block, on a one-point grid instead of
    # the quick grid (whose minutes are the same code).
    path = tmp_path / "profile.json"
    monkeypatch.setenv("BLOCKDIAG_PROFILE", str(path))
    block = _docs_block("extending.md", "tuning.tune(")
    quick = 'tuning.tune(tuning.GRIDS["quick"])'
    assert quick in block
    block = block.replace(quick, 'tuning.tune(tuning.Grid((8,), (4,), ((4, 2),)), modes=("forward",), '
                                 'rounds=1, min_time=0.0, rematch=False)')
    for _ in range(2):  # the second run merges into the first one's entry
        exec(compile(block, "docs/extending.md", "exec"), {})
    (entry,) = json.loads(path.read_text())["entries"].values()
    assert len(entry["runs"]) == 2
    (m,) = entry["measurements"]
    assert "test_einsum" in m["times_us"] and "loop" in m["times_us"]
    # auto now ranks the backend by its measured time, like the built-in ones.
    (cand,) = [c for c in choose(Problem(8, 4, 4, 2)).candidates if c.name == "test_einsum"]
    assert cand.ok and cand.measured and cand.estimate_us == m["times_us"]["test_einsum"]


def test_a_registered_backend_runs_by_name_with_gradients(einsum_backend):
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    y = blockdiag.grouped_linear(x, w, b, backend="test_einsum")
    torch.testing.assert_close(y, reference_loop(x, w, b))
    assert torch.autograd.gradcheck(lambda *a: blockdiag.grouped_linear(*a, backend="test_einsum"), (x, w, b))
    # Made of differentiable torch ops, it has a double backward as it is.
    (gx,) = torch.autograd.grad(blockdiag.grouped_linear(x, w, b, backend="test_einsum").square().sum(), x,
                                create_graph=True)
    gx.sum().backward()
    assert w.grad is not None


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_a_registered_backend_is_traced_as_plain_torch_code(einsum_backend):
    layer = blockdiag.GroupedLinear(12, 6, groups=3, backend="test_einsum")
    x = torch.randn(4, 12)
    traced = torch.jit.trace(layer, x, check_trace=False)
    torch.testing.assert_close(traced(x), layer(x))


def test_registering_starts_a_new_epoch_and_auto_screens_it():
    p = Problem(32, 4, 16, 8)
    before = choose(p)
    assert "test_einsum2" not in [c.name for c in before.candidates]
    blockdiag.register_backend(Backend("test_einsum2", _einsum, dtypes=F32))
    try:
        after = choose(p)
        assert after is not before  # the cached plan was dropped
        assert "test_einsum2" in candidates(p)
        assert "test_einsum2" in [c.name for c in after.candidates if c.ok]
        assert "test_einsum2" in [b.name for b in blockdiag.list_backends()]
    finally:
        removed = blockdiag.unregister_backend("test_einsum2")
    assert removed.fn is _einsum
    assert "test_einsum2" not in [c.name for c in choose(p).candidates]


def test_a_duplicate_or_bad_backend_is_refused_by_name(einsum_backend):
    with pytest.raises(BlockDiagError, match="a backend named 'test_einsum' is already registered"):
        blockdiag.register_backend(Backend("test_einsum", _einsum, dtypes=F32))
    with pytest.raises(BlockDiagError, match="a backend named 'loop' is already registered"):
        blockdiag.register_backend(Backend("loop", _einsum, dtypes=F32))
    with pytest.raises(BlockDiagError, match="'auto' is reserved"):  # not "already registered": it is no backend
        blockdiag.register_backend(Backend("auto", _einsum, dtypes=F32))
    with pytest.raises(BlockDiagError, match="fn must be callable"):
        blockdiag.register_backend(Backend("test_bad", None, dtypes=F32))
    with pytest.raises(BlockDiagError, match="non-empty string"):
        blockdiag.register_backend(Backend("", _einsum, dtypes=F32))
    with pytest.raises(BlockDiagError, match="expected a blockdiag.Backend"):
        blockdiag.register_backend(_einsum)
    with pytest.raises(BlockDiagError, match="unknown backend 'test_nope'"):
        blockdiag.unregister_backend("test_nope")
    assert "test_bad" not in blockdiag.backends.names()


def test_backends_is_the_subpackage_and_the_old_call_warns():
    import blockdiag.backends as B

    assert isinstance(B, types.ModuleType) and B.Backend is Backend and blockdiag.backends is B
    deprecated = r"blockdiag.backends\(\) is deprecated; use blockdiag.list_backends\(\)"
    with pytest.warns(DeprecationWarning, match=deprecated) as rec:
        old = blockdiag.backends()
    assert old == blockdiag.list_backends()
    assert rec[0].filename == __file__  # the warning points at the call, not at blockdiag
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        blockdiag.list_backends()
    assert "list_backends" in blockdiag.__all__ and "register_backend" in blockdiag.__all__
    assert "backends" not in blockdiag.__all__


def test_a_fresh_import_of_the_subpackage_gives_the_subpackage():
    # Before anything else imported blockdiag: the import statement the name clash broke.
    code = ("import blockdiag.backends as B, types; assert isinstance(B, types.ModuleType), B; "
            "assert B.names()[0] == 'loop'; from blockdiag.backends import Backend; print(B.__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "blockdiag.backends", r.stdout + r.stderr


def test_auto_and_list_backends_survive_another_thread_registering_and_removing():
    # A backend removed by another thread between listing the names and looking one up made
    # `auto` raise "choose: unknown backend" for a backend it never named, and list_backends()
    # raise a bare KeyError. Both read one snapshot of the registry now.
    import threading
    import time

    from blockdiag import settings as st

    stop, errors, planned = threading.Event(), [], [0]

    def churn():
        while not stop.is_set():
            blockdiag.register_backend(Backend("test_churn", _einsum, dtypes=F32))
            blockdiag.unregister_backend("test_churn")

    def user():
        layer = blockdiag.GroupedLinear(12, 8, groups=4)
        while not stop.is_set():
            try:
                layer(torch.randn(3, 12))
                for _ in range(3):
                    blockdiag.list_backends()
                planned[0] += 1
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
                stop.set()

    threads = [threading.Thread(target=churn), threading.Thread(target=user)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 6.0  # before the fix it failed within 2 s in most runs
    while time.monotonic() < deadline and not stop.is_set():
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(30)
    if "test_churn" in blockdiag.backends.names():
        blockdiag.unregister_backend("test_churn")
    st.bump_epoch()
    assert not errors, errors[:3]
    assert planned[0] > 0


@pytest.mark.parametrize("dtypes", [frozenset({torch.float32}), {"cpu": {"float32"}}, {"cpu": torch.float32},
                                    {torch.device("cpu"): frozenset({torch.float32})}, ["cpu"], {},
                                    {"cpu": frozenset()}])
def test_a_malformed_dtypes_declaration_is_refused_at_registration(dtypes):
    # A flat set of dtypes once registered fine and then made every backend="auto" call of the
    # process raise "TypeError: sequence item 0: expected str instance"; dtype names as strings
    # kept the backend from ever running ("does not support float32 (supports float32)"), and
    # so did none at all (Backend's default), which said "does not run on cpu (runs on )".
    with pytest.raises(BlockDiagError, match=r"backend 'test_bad_dtypes': dtypes"):
        blockdiag.register_backend(Backend("test_bad_dtypes", _einsum, dtypes=dtypes))
    assert "test_bad_dtypes" not in blockdiag.backends.names()
    assert blockdiag.grouped_linear(torch.randn(2, 8), torch.randn(2, 4, 4)).shape == (2, 8)


MALFORMED_FIELDS = [
    ("reduced_precision=None", {"reduced_precision": None}, r"reduced_precision must be a mapping"),
    ("reduced_precision=flat-set", {"reduced_precision": frozenset({torch.float32})}, r"reduced_precision must be a mapping"),
    ("reduced_precision=no-reason", {"reduced_precision": {"cpu": frozenset({torch.float32})}},
     r"reduced_precision\['cpu'\] must be a \(set of torch.dtype, reason str\) pair"),
    ("upcasts=flat-set", {"upcasts": frozenset({torch.float16})}, r"upcasts must be a mapping"),
    ("upcasts=dtype-names", {"upcasts": {"cpu": {"float16"}}}, r"upcasts\['cpu'\] must be a set of torch.dtype"),
    ("upcasts=device-key", {"upcasts": {torch.device("cpu"): {torch.float16}}}, r"upcasts: keys must be device types"),
    ("requires=int", {"requires": 3}, r"requires must be a non-empty str or None, got 3"),
    ("requires=relative", {"requires": ".ext"}, r"requires must name a module .*got '\.ext'"),
    ("same_forward_as=list", {"same_forward_as": ["loop"]}, r"same_forward_as must be a non-empty str or None, got \['loop'\]"),
    ("grad=str", {"grad": "no"}, r"grad must be True or False, got 'no'"),
    ("double_grad=None", {"double_grad": None}, r"double_grad must be True or False, got None"),
    ("sparse=int", {"sparse": 1}, r"sparse must be True or False, got 1"),
    ("constraint=str", {"constraint": "block_in > 2"}, r"constraint must be callable or None"),
    ("summary=None", {"summary": None}, r"summary must be a str, got None"),
]


@pytest.mark.parametrize("fields,match", [c[1:] for c in MALFORMED_FIELDS], ids=[c[0] for c in MALFORMED_FIELDS])
def test_register_backend_refuses_a_malformed_field(fields, match):
    # reduced_precision, upcasts and requires are read for every backend on every plan: a
    # malformed one registered fine and then made every backend="auto" call of the process
    # raise an AttributeError or TypeError naming no backend. A flag such as grad="no" was
    # read as its truth value (a backward declared).
    registry = blockdiag.backends._registry
    loop = registry.get("loop")
    try:
        with pytest.raises(BlockDiagError, match=r"register: backend 'test_bad_field': " + match):
            blockdiag.register_backend(Backend("test_bad_field", _einsum, dtypes=F32, **fields))
        with pytest.raises(BlockDiagError, match=r"replace: backend 'loop': " + match):
            registry.replace(Backend("loop", _einsum, dtypes=F32, **fields))
    finally:  # a failing run leaves no malformed backend to fail the tests after it
        if "test_bad_field" in registry.names():
            blockdiag.unregister_backend("test_bad_field")
        if registry.get("loop") is not loop:
            registry.replace(loop)
    assert blockdiag.grouped_linear(torch.randn(2, 8), torch.randn(2, 4, 4)).shape == (2, 8)


def test_a_backend_requiring_a_submodule_of_a_missing_package_is_unavailable():
    # find_spec("pkg.ext") imports pkg: with pkg missing it raised ModuleNotFoundError in every
    # plan of the process (every backend is asked), so every backend="auto" call failed.
    blockdiag.register_backend(Backend("test_missing_ext", _einsum, dtypes=F32, requires="no_such_pkg_xyz.ext"))
    try:
        info = {b.name: b for b in blockdiag.list_backends()}["test_missing_ext"]
        assert not info.available and "no-such-pkg-xyz.ext is not installed" in info.reason
        assert blockdiag.grouped_linear(torch.randn(2, 8), torch.randn(2, 4, 4)).shape == (2, 8)
        with pytest.raises(BlockDiagError, match=r"test_missing_ext.*unavailable: no-such-pkg-xyz\.ext is not installed"):
            blockdiag.grouped_linear(torch.randn(2, 8), torch.randn(2, 4, 4), backend="test_missing_ext")
    finally:
        blockdiag.unregister_backend("test_missing_ext")


def _raises(*_):
    raise ValueError("oops")


@pytest.mark.parametrize("hook, match", [
    ({"constraint": _raises}, r"backend 'test_hook': its constraint raised ValueError: oops for batch=2 groups=2"),
    ({"probe": _raises}, r"backend 'test_hook': its probe raised ValueError: oops"),
    ({"constraint": lambda p: False}, r"backend 'test_hook': its constraint must return a reason string or None, got False"),
])
def test_a_backend_hook_that_raises_or_answers_a_bool_is_named(hook, match):
    # Such a hook surfaced in every backend="auto" call as a bare ValueError naming no backend
    # (a probe's in list_backends() too); a constraint answering False ("no objection") kept
    # the backend out of auto and refused it by name with the reason "False".
    blockdiag.register_backend(Backend("test_hook", _einsum, dtypes=F32, **hook))
    try:
        x, w = torch.randn(2, 8), torch.randn(2, 4, 4)
        for backend in ("auto", "test_hook"):
            with pytest.raises(BlockDiagError, match=match):
                blockdiag.grouped_linear(x, w, backend=backend)
    finally:
        blockdiag.unregister_backend("test_hook")


def _drops_a_column(x, weight, bias):
    return _einsum(x, weight, bias)[:, :-1]


def _to_float64(x, weight, bias):
    return _einsum(x, weight, bias).double()


def _detached(x, weight, bias):
    with torch.no_grad():
        return _einsum(x, weight, bias)


@pytest.mark.parametrize("fn, grad, match", [
    (_drops_a_column, False, r"fn returned a strided tensor of shape \(4, 7\), torch.float32, on cpu; it must return a strided y of shape \(4, 8\)"),
    (_to_float64, False, r"fn returned a strided tensor of shape \(4, 8\), torch.float64, on cpu; .*torch.float32"),
    (_detached, True, r"does not lead back to its operands"),
])
@pytest.mark.parametrize("how", ["eager", "eager_3d", "compiled"])
def test_a_registered_function_returning_a_wrong_result_is_named(fn, grad, match, how):
    # Its result went straight to the caller: a [4, 7] or float64 y from a float32 layer, or
    # (detached) parameters that silently got no gradient.
    if how == "compiled" and grad:
        pytest.skip("the graph differentiates the traced function itself")
    blockdiag.register_backend(Backend("test_wrong", fn, dtypes=F32))
    try:
        x, w = torch.randn(4, 8, requires_grad=grad), torch.randn(2, 4, 4)
        call = functools.partial(blockdiag.grouped_linear, backend="test_wrong")
        if how == "eager_3d":
            x = x.detach().reshape(2, 2, 8).requires_grad_(grad)
        if how == "compiled":
            torch._dynamo.reset()
            call = torch.compile(call, backend="eager", fullgraph=True)
        with pytest.raises(Exception, match=match) as info:
            call(x, w)
        assert "backend 'test_wrong'" in str(info.value)
    finally:
        blockdiag.unregister_backend("test_wrong")


def test_the_auto_op_checks_a_registered_function_it_chose(monkeypatch):
    # Inside a traced graph auto is the blockdiag::auto op, whose fake kernel promises a
    # float32 [N, G*out]: a registered function's float64 result left the op as it was.
    import blockdiag.ops.auto as auto_op

    blockdiag.register_backend(Backend("test_wrong", _to_float64, dtypes=F32))
    try:
        monkeypatch.setattr(auto_op, "choice", lambda *a, **k: "test_wrong")
        with pytest.raises(BlockDiagError, match=r"backend 'test_wrong': fn returned .*torch.float64"):
            torch.ops.blockdiag.auto(torch.randn(4, 8), torch.randn(2, 4, 4), None, False)
    finally:
        blockdiag.unregister_backend("test_wrong")


@pytest.mark.parametrize("how", ["eager", "auto_op"])
def test_a_registered_function_returning_an_alias_of_an_operand_is_named(monkeypatch, how):
    # Inside a graph auto is the blockdiag::auto op, whose schema promises a new tensor: an
    # identity-like function's x came out as it was, and an in-place op on the result then
    # changed x in eager and not under torch.compile(backend="aot_eager").
    import blockdiag.ops.auto as auto_op

    blockdiag.register_backend(Backend("test_alias", lambda x, weight, bias: x, dtypes=F32))
    try:
        x, w = torch.randn(4, 8), torch.eye(4).expand(2, 4, 4).contiguous()
        with pytest.raises(BlockDiagError, match=r"backend 'test_alias': fn returned a tensor sharing memory "
                                                 r"with its input .* return a new tensor, e.g. input.clone\(\)"):
            if how == "eager":
                blockdiag.grouped_linear(x, w, backend="test_alias")
            else:
                monkeypatch.setattr(auto_op, "choice", lambda *a, **k: "test_alias")
                torch.ops.blockdiag.auto(x, w, None, False)
    finally:
        blockdiag.unregister_backend("test_alias")


def test_a_registered_function_returning_a_sparse_result_is_named():
    # A sparse y passed the shape, dtype and device checks and failed later, in the caller's
    # next operation or in the alias check's storage read.
    blockdiag.register_backend(Backend("test_sparse_y", lambda x, w, b: _einsum(x, w, b).to_sparse(), dtypes=F32))
    try:
        with pytest.raises(BlockDiagError, match=r"backend 'test_sparse_y': fn returned a sparse_coo tensor of shape "
                                                  r"\(4, 8\).*must return a strided y"):
            blockdiag.grouped_linear(torch.randn(4, 8), torch.randn(2, 4, 4), backend="test_sparse_y")
    finally:
        blockdiag.unregister_backend("test_sparse_y")


class _WrongWeightGrad(torch.autograd.Function):
    # The right product, and the weight's gradient doubled: only a gradient check sees it.
    # The subclasses below get another gradient wrong instead (``wrong``: which, and how).
    wrong = ("weight", lambda g: 2 * g)

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return _einsum(x, weight, bias)

    @classmethod
    def backward(cls, ctx, gy):
        x, weight = ctx.saved_tensors
        g, o, i = weight.shape
        gyb, xb = gy.view(-1, g, o), x.view(-1, g, i)
        gx = torch.einsum("ngo,goi->ngi", gyb, weight).reshape(x.shape)
        grads = {"input": gx, "weight": torch.einsum("ngo,ngi->goi", gyb, xb), "bias": gy.sum(0)}
        label, how = cls.wrong
        grads[label] = how(grads[label])
        return grads["input"], grads["weight"], grads["bias"]


class _WrongInputGrad(_WrongWeightGrad):
    wrong = ("input", lambda g: -g)


class _WrongBiasGrad(_WrongWeightGrad):
    wrong = ("bias", lambda g: 0 * g)


class _NoBiasGrad(_WrongWeightGrad):
    wrong = ("bias", lambda g: None)


def _one_nan(x, w, b):
    y = _einsum(x, w, b)
    y[0, 0] = float("nan")
    return y


@pytest.mark.parametrize(("fn", "mode", "match"), [
    (lambda x, w, b: _einsum(x, w.transpose(1, 2).contiguous(), b), "forward", "wrong result"),
    (lambda x, w, b: _einsum(x, w, None), "forward", "wrong result"),
    (lambda x, w, b: _einsum(x, w, b) * (1 + 1e-3), "forward", "wrong result"),
    (_WrongWeightGrad.apply, "train", "wrong gradient of the weight"),
    (_WrongInputGrad.apply, "train", "wrong gradient of the input"),
    (_WrongBiasGrad.apply, "train", "wrong gradient of the bias"),
    (_NoBiasGrad.apply, "train", "wrong gradient of the bias: no gradient"),
    # NaN compares False with any bound: one where the reference is finite is wrong too.
    (_one_nan, "forward", "wrong result: 1 of 64 entries"),
    # Right in value, but of a dtype every eager call refuses: timed, auto would pick a
    # backend that raises at every call.
    (lambda x, w, b: _einsum(x.double(), w.double(), b.double()), "forward",
     r"torch.float64, on cpu; it must return"),
], ids=["transposed_blocks", "no_bias", "off_by_1e-3", "weight_grad_doubled", "input_grad_negated",
        "bias_grad_zero", "bias_grad_none", "one_nan", "float64_result"])
def test_tune_and_bench_do_not_time_a_backend_with_wrong_numbers(fn, mode, match):
    # A fast wrong backend timed into a profile would be what auto runs there, silently.
    blockdiag.register_backend(Backend("test_wrong", fn, dtypes=F32))
    try:
        grid = tuning.Grid((8,), (2,), ((4, 4),))
        got = tuning.tune(grid, modes=(mode,), backends=["dense", "test_wrong"], rounds=1,
                                    min_time=1e-4, rematch=False)
        row = got["measurements"][0]
        assert set(row["times_us"]) == {"dense"} and match in row["skipped"]["test_wrong"], row
        rows = tuning.bench(grid, modes=(mode,), backends=["dense", "test_wrong"], rounds=1,
                                      min_time=1e-4, baselines=False, memory=False, refine=0)
        assert "test_wrong" not in rows[0]["times_us"] and match in rows[0]["skipped"]["test_wrong"]
    finally:
        blockdiag.unregister_backend("test_wrong")


def test_bench_stops_where_auto_itself_gives_wrong_numbers(monkeypatch):
    # What auto runs is what users get: bench says so rather than timing it.
    import blockdiag.nn.linear as linear

    blockdiag.register_backend(Backend("test_wrong", lambda x, w, b: _einsum(x, w, b) + 1, dtypes=F32))
    try:
        real = linear.plan_for
        monkeypatch.setattr(linear, "plan_for", lambda backend, *a: real("test_wrong" if backend == "auto" else backend, *a))
        with pytest.raises(BlockDiagError, match=r"bench: .*: auto \(running '\w+'\): wrong result: 64 of 64 entries"):
            tuning.bench(tuning.Grid((8,), (2,), ((4, 4),)), modes=("forward",),
                                   backends=["dense"], rounds=1, min_time=1e-4, baselines=False, memory=False)
    finally:
        blockdiag.unregister_backend("test_wrong")
