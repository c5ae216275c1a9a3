"""Operands blockdiag cannot take get a BlockDiagError naming the argument and what it was.

Issue 22 item 11: sparse COO/CSR, nested (strided and jagged) and non-tensor operands, through
the functional form, the layer and the MLP, for every backend and ``auto``; each also after a
dense call of the same shape, when the per-call plan cache already holds the shape (its key
holds shapes, not layouts).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import blockdiag
from _params import backends_and_auto, require_backend
from blockdiag import BlockDiagError, GroupedLinear, GroupedMLP, grouped_linear

G, I, O, N = 3, 2, 4, 5


def _nested(layout):
    with warnings.catch_warnings():  # "nested tensors are a prototype": expected here
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.randn(2, G * I), torch.randn(3, G * I)], layout=layout)


def _sparse(kind, t):
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        return t.to_sparse() if kind == "coo" else t.to_sparse_csr()


# (id, input maker, pattern the message must contain)
INPUTS = [
    ("coo", lambda: _sparse("coo", torch.randn(N, G * I)), r"input is a sparse_coo tensor.*input\.to_dense\(\)"),
    ("csr", lambda: _sparse("csr", torch.randn(N, G * I)), r"input is a sparse_csr tensor.*input\.to_dense\(\)"),
    ("nested", lambda: _nested(torch.strided), r"input is a nested tensor.*to_padded_tensor"),
    ("jagged", lambda: _nested(torch.jagged), r"input is a nested tensor.*to_padded_tensor"),
    ("none", lambda: None, r"input must be a torch\.Tensor, got NoneType"),
    ("list", lambda: [[0.0] * (G * I)] * N, r"input must be a torch\.Tensor, got list"),
]


def _entries(backend):
    w = torch.randn(G, O, I)
    layer = GroupedLinear(G * I, G * O, G, backend=backend)
    mlp = GroupedMLP(I, [O], 1, heads=G, shared_input=False, backend=backend)
    return {
        "grouped_linear": lambda x: grouped_linear(x, w, backend=backend),
        "GroupedLinear": layer,
        "GroupedMLP": mlp,
    }


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after-dense-call"])
@pytest.mark.parametrize("kind,make,pattern", [pytest.param(*c, id=c[0]) for c in INPUTS])
@pytest.mark.parametrize("backend", backends_and_auto())
def test_bad_input_is_named(backend, kind, make, pattern, warm):
    require_backend(backend)
    for fn, call in _entries(backend).items():
        if warm:
            call(torch.randn(N, G * I))  # the same shape, dense: the plan cache now holds it
        with pytest.raises(BlockDiagError, match=f"{fn}: {pattern}"):
            call(make())


@pytest.mark.parametrize(
    "arg,kind",
    [(a, k) for a in ("weight", "bias") for k in ("coo", "csr", "none", "nested") if (a, k) != ("bias", "none")],
    ids=lambda v: v,
)
@pytest.mark.parametrize("backend", backends_and_auto())
def test_bad_weight_or_bias_is_named(backend, arg, kind):
    require_backend(backend)
    x, w, b = torch.randn(N, G * I), torch.randn(G, O, I), torch.randn(G * O)
    grouped_linear(x, w, b, backend=backend)  # warm: the plan cache holds the shapes
    t = {"weight": w, "bias": b}[arg]
    if kind == "none":  # (bias=None means no bias)
        bad, pattern = None, "weight must be a torch.Tensor, got NoneType"
    elif kind == "nested":
        bad = torch.nested.as_nested_tensor(list(t.unbind()))
        pattern = f"{arg} is a nested tensor"
    else:
        # COO for either; CSR needs 2-D, so the bias takes COO again under another id.
        bad = _sparse(kind if t.dim() == 2 or kind == "coo" else "coo", t if kind == "coo" else t.reshape(t.shape[0], -1))
        pattern = f"{arg} is a sparse_(coo|csr) tensor.*{arg}\\.to_dense\\(\\)"
    kwargs = {"weight": w, "bias": b, arg: bad}
    with pytest.raises(BlockDiagError, match=f"grouped_linear: {pattern}"):
        grouped_linear(x, kwargs["weight"], kwargs["bias"], backend=backend)


@pytest.mark.parametrize("backend", backends_and_auto())
def test_a_weight_of_no_groups_is_named(backend):
    # It reached Problem, whose message named neither the function nor the weight.
    require_backend(backend)
    x, w = torch.randn(3, 0), torch.randn(0, 2, 5)
    with pytest.raises(BlockDiagError, match=r"grouped_linear: weight must hold at least one group, got shape \(0, 2, 5\)"):
        grouped_linear(x, w, None, backend=backend)
    op = torch.ops.blockdiag.auto if backend == "auto" else getattr(torch.ops.blockdiag, backend, None)
    if op is not None:
        args = (x, w, None, False) if backend == "auto" else (x, w, None)
        with pytest.raises(BlockDiagError, match=f"{backend}: weight must hold at least one group"):
            op(*args)


def test_the_hint_for_a_sparse_weight_names_the_sparse_backends():
    w = _sparse("coo", torch.randn(G, O, I))
    with pytest.raises(BlockDiagError, match="backend='csr' or 'bsr'"):
        grouped_linear(torch.randn(N, G * I), w)


def test_bad_inputs_under_compile_are_named_too():
    layer = GroupedLinear(G * I, G * O, G)
    with pytest.raises(BlockDiagError, match="input must be a torch.Tensor, got NoneType"):
        torch.compile(layer, backend="eager")(None)
    assert blockdiag.BlockDiagError is BlockDiagError


@pytest.mark.parametrize("dtype,pattern", [
    pytest.param(torch.complex64, r"dtype=torch\.complex64 is not one any backend runs \(they run .*float32", id="complex64"),
    pytest.param(torch.int32, r"dtype=torch\.int32 is not one any backend runs", id="int32"),
    pytest.param(torch.float8_e4m3fn, r"dtype=torch\.float8_e4m3fn is not one any backend runs", id="float8"),
    pytest.param("float32", r"dtype must be a torch\.dtype such as torch\.float32, got 'float32'", id="string"),
])
@pytest.mark.parametrize("module", ["GroupedLinear", "GroupedMLP"])
def test_a_dtype_no_backend_runs_is_refused_at_construction(module, dtype, pattern):
    # complex64 used to construct and fail only at the first call; int32 and float8 failed in
    # torch's initialisers with messages that named neither the module nor the argument.
    make = {"GroupedLinear": lambda: GroupedLinear(G * I, G * O, G, dtype=dtype),
            "GroupedMLP": lambda: GroupedMLP(I, O, 1, G, dtype=dtype)}[module]
    with pytest.raises(BlockDiagError, match=rf"^{module}: {pattern}"):
        make()


@pytest.mark.parametrize("strategy", ["auto", "fm_chain"])
@pytest.mark.parametrize("shared_input", [False, True], ids=["own-inputs", "shared-input"])
def test_a_jagged_input_to_a_compiled_mlp_is_named(strategy, shared_input):
    # The chain's reshape failed inside dynamo's fake-tensor run (TorchRuntimeError, "cannot
    # view shape (2, s27, 6) as [-1, 6]"), which GroupedMLP.forward's except never sees.
    mlp = GroupedMLP(I, [O], 1, heads=G, shared_input=shared_input, strategy=strategy)
    n_in = I if shared_input else G * I
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        x = torch.nested.nested_tensor([torch.randn(2, n_in), torch.randn(3, n_in)], layout=torch.jagged)
    torch._dynamo.reset()
    with pytest.raises(BlockDiagError, match=r"GroupedMLP: input is a nested tensor.*to_padded_tensor"):
        torch.compile(mlp, backend="eager")(x)


@pytest.mark.parametrize("call", ["forward", "plan"])
@pytest.mark.parametrize("strategy", ["auto", "layers", "fm_chain", "heads"])
def test_an_mlp_input_of_another_dtype_or_device_is_named_by_the_model(strategy, call):
    # The layers' path and plan() failed inside the first layer, whose error named a
    # "GroupedLinear" and its "weight" the user never built ("GroupedLinear: weight has dtype
    # torch.float32 but input has dtype torch.float64; cast them to one dtype").
    mlp = GroupedMLP(I, [O], 1, heads=G, strategy=strategy)
    name = "GroupedMLP" if call == "forward" else r"GroupedMLP\.plan"
    for x, where in ((torch.randn(N, I, dtype=torch.float64), r"torch\.float64 on cpu"),
                     (torch.empty(N, I, device="meta"), r"torch\.float32 on meta")):
        pattern = rf"layers\[0\]\.weight is torch\.float32 on cpu but the input is {where}"
        run = mlp if call == "forward" else mlp.plan
        with pytest.raises(BlockDiagError, match=rf"^{name}: .*{pattern}"):
            run(x)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64], ids=str)
@pytest.mark.parametrize("backend", ["auto", "bmm"])
def test_an_input_dtype_no_backend_runs_is_named_by_the_caller(backend, dtype):
    # auto raised "choose: no backend can run ...", a 1 kB list of every backend's refusal
    # under the name of a function the caller never called.
    x, w = torch.ones(N, G * I, dtype=dtype), torch.ones(G, O, I, dtype=dtype)
    pattern = rf"input dtype={dtype!r} is not one any backend runs \(they run .*float32"
    with pytest.raises(BlockDiagError, match=rf"^grouped_linear: {pattern}"):
        grouped_linear(x, w, backend=backend)
    layer = GroupedLinear(G * I, G * O, G, bias=False, backend=backend)
    with pytest.raises(BlockDiagError, match=rf"^GroupedLinear: {pattern}"):
        torch.func.functional_call(layer, {"weight": w}, (x,))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("backend", ["auto", "bmm"])
def test_an_input_dtype_no_backend_runs_is_refused_on_meta_and_compiled(backend, dtype):
    # Meta operands ran (an int64 meta result), where CPU ones are refused; a compiled auto
    # listed every backend's refusal under "choose:" inside dynamo's error, and a compiled
    # named backend gave its own wording.
    pattern = rf"^grouped_linear: input dtype={dtype!r} is not one any backend runs \(they run .*float32"
    with pytest.raises(BlockDiagError, match=pattern):
        grouped_linear(torch.ones(N, G * I, dtype=dtype, device="meta"),
                       torch.ones(G, O, I, dtype=dtype, device="meta"), backend=backend)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: grouped_linear(x, w, backend=backend), backend="eager")
    with pytest.raises(BlockDiagError, match=pattern):
        compiled(torch.ones(N, G * I, dtype=dtype), torch.ones(G, O, I, dtype=dtype))


# Sizes and counts take what operator.index takes, as nn.Linear's do; stored as plain ints.
SIZE_TAKERS = [
    ("GroupedLinear", lambda n: GroupedLinear(6 * n, 4 * n, groups=n),
     lambda m: (m.in_features, m.out_features, m.groups, m.block_in)),
    ("GroupedMLP", lambda n: GroupedMLP(3 * n, [n, n], n, heads=n),
     lambda m: (m.in_features, *m.hidden_features, m.out_features, m.heads)),
    ("block_diag_mask", lambda n: blockdiag.block_diag_mask(n, (n, n)), lambda t: tuple(t.shape)),
    ("to_blocks", lambda n: blockdiag.to_blocks(torch.eye(4), n), lambda t: tuple(t.shape)),
    ("mask_block_diagonal_", lambda n: blockdiag.mask_block_diagonal_(torch.nn.Linear(4, 4), n),
     lambda m: (m.parametrizations.weight[0].groups, *m.parametrizations.weight[0].block_shape)),
    ("block_diag_bsr", lambda n: blockdiag.block_diag_bsr(torch.ones(2, 2, 2), blocksize=(n, n)),
     lambda t: tuple(t.values().shape)),
    ("Problem", lambda n: blockdiag.Problem(n, n, n, n), lambda p: (p.batch, p.groups, p.block_in, p.block_out)),
]


@pytest.mark.parametrize("make,read", [t[1:] for t in SIZE_TAKERS], ids=[t[0] for t in SIZE_TAKERS])
def test_numpy_integers_are_sizes_stored_as_ints(make, read):
    np = pytest.importorskip("numpy")
    with warnings.catch_warnings():  # "Sparse BSR tensor support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        plain = read(make(2))
        for kind in (np.int64, np.int32, np.uint8):
            got = read(make(kind(2)))
            assert got == plain and all(type(v) is int for v in got), (kind, got)


@pytest.mark.parametrize("make", [t[1] for t in SIZE_TAKERS], ids=[t[0] for t in SIZE_TAKERS])
@pytest.mark.parametrize("bad", ["bool", "numpy_bool", "float", "tensor"])
def test_what_is_not_an_integer_is_still_no_size(make, bad):
    np = pytest.importorskip("numpy")
    value = {"bool": True, "numpy_bool": np.True_, "float": 2.0, "tensor": torch.tensor(2)}[bad]
    with pytest.raises(BlockDiagError, match=r"must be|two positive ints|int >= "):
        make(value)


# Public entry points given an argument of the wrong kind: each raised an AttributeError or
# TypeError from inside blockdiag (or, for GroupedMLP.plan of a sparse input, planned what
# forward refuses). (id naming the entry point and argument, call, pattern.)
def _from_linears(linears):
    import torch.distributed.tensor  # noqa: F401  (loaded, the DTensor check reads every item)

    return GroupedLinear.from_linears(linears)


def _testing(name, *args, **kwargs):
    from blockdiag import testing

    return getattr(testing, name)(*args, **kwargs)


WRONG_KINDS = [
    ("choose-problem=tuple", lambda: blockdiag.choose((N, G, I, O)),
     r"choose: problem must be a blockdiag\.Problem .*got tuple"),
    ("choose-problem=None", lambda: blockdiag.choose(None), r"choose: problem must be a blockdiag\.Problem .*got NoneType"),
    ("GroupedMLP.plan-x=None", lambda: GroupedMLP(I, [O], 1, heads=G).plan(None),
     r"GroupedMLP\.plan: input must be a torch\.Tensor, got NoneType"),
    ("GroupedMLP.plan-x=list", lambda: GroupedMLP(I, [O], 1, heads=G).plan([[0.0] * I]),
     r"GroupedMLP\.plan: input must be a torch\.Tensor, got list"),
    ("GroupedMLP.plan-x=coo", lambda: GroupedMLP(I, [O], 1, heads=G, strategy="layers").plan(_sparse("coo", torch.randn(N, I))),
     r"GroupedMLP\.plan: input is a sparse_coo tensor.*input\.to_dense\(\)"),
    ("GroupedMLP.plan-x=csr", lambda: GroupedMLP(I, [O], 1, heads=G, strategy="fm_chain").plan(_sparse("csr", torch.randn(N, I))),
     r"GroupedMLP\.plan: input is a sparse_csr tensor.*input\.to_dense\(\)"),
    ("GroupedLinear.from_linears-linears=[None]", lambda: _from_linears([None]),
     r"from_linears: linears\[0\] is a NoneType, not nn\.Linear"),
    ("grouped_linear-backend=list", lambda: grouped_linear(torch.randn(N, G * I), torch.randn(G, O, I), backend=["bmm"]),
     r"grouped_linear: unknown backend \['bmm'\]; valid names are 'auto', 'loop'"),
    ("GroupedMLP-backend=unknown", lambda: GroupedMLP(I, [O], 1, heads=G, backend="nope"),
     r"^GroupedMLP: unknown backend 'nope'"),
    ("Problem-requires_grad=str", lambda: blockdiag.Problem(N, G, I, O, requires_grad="no"),
     r"Problem: requires_grad must be True or False, got 'no'"),
    ("Problem-device=empty", lambda: blockdiag.Problem(N, G, I, O, device=""),
     r"Problem: device must be a device type such as 'cpu', got ''"),
    ("Problem-requires_grad=None", lambda: blockdiag.Problem(N, G, I, O, requires_grad=None),
     r"Problem: requires_grad must be True or False, got None"),
    ("testing.backend_tolerances-problem=None", lambda: _testing("backend_tolerances", "bmm", None),
     r"backend_tolerances: problem must be a blockdiag\.Problem, got NoneType"),
    ("testing.computes_in_tf32-problem=str", lambda: _testing("computes_in_tf32", "bmm", "cpu"),
     r"computes_in_tf32: problem must be a blockdiag\.Problem, got str"),
    ("testing.reference_loop-weight=None", lambda: _testing("reference_loop", torch.ones(1, 4), None, None),
     r"reference_loop: weight must be a torch\.Tensor, got NoneType"),
    ("testing.reference_scipy-weight=2d", lambda: _testing("reference_scipy", torch.ones(1, 4), torch.ones(4, 4), None),
     r"reference_scipy: weight must be \[groups, block_out, block_in\], got shape \(4, 4\)"),
    ("testing.tolerances-k=None", lambda: _testing("tolerances", torch.float32, None), r"tolerances: k=None must be"),
    ("testing.tolerances-magnitude=None", lambda: _testing("tolerances", torch.float32, 1, None),
     r"tolerances: magnitude=None must be a real number"),
    ("testing.tolerances-dtype=list", lambda: _testing("tolerances", [torch.float32]),
     r"tolerances: dtype=\[torch\.float32\] has none"),
]


@pytest.mark.parametrize("call,pattern", [t[1:] for t in WRONG_KINDS], ids=[t[0] for t in WRONG_KINDS])
def test_an_argument_of_the_wrong_kind_is_named(call, pattern):
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(BlockDiagError, match=pattern):
            call()


def test_a_numpy_bool_requires_grad_is_the_bool_it_holds():
    np = pytest.importorskip("numpy")
    p = blockdiag.Problem(N, G, I, O, requires_grad=np.True_)
    assert p.requires_grad is True and p == blockdiag.Problem(N, G, I, O, requires_grad=True)
