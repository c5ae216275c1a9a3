"""``GroupedLinear`` and ``GroupedMLP``: round trips with plain heads, training parity, persistence."""

from __future__ import annotations

import copy
import math
import io
import pickle

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

import blockdiag
from blockdiag import BlockDiagError, GroupedLinear, GroupedMLP, grouped_linear
from blockdiag.backends import get, names
from blockdiag.testing import reference_loop, tolerances

from _params import DEVICES, DTYPES, backend_spy, require_backend



def _runnable(name, device="cpu", dtype=torch.float64, grad=True, batch=8, g=4, i=3, o=2):
    be = get(name)
    return be.decline_reason(blockdiag.Problem(batch, g, i, o, dtype, device, grad)) is None


FIXED = [pytest.param(n, id=n) for n in names()]


@pytest.mark.parametrize("lead", [(0,), (1,), (5,), (2, 3), (1, 1)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", ["auto"] + FIXED)
def test_the_output_can_be_changed_in_place_in_training(name, lead):
    # nn.ReLU(inplace=True) after the layer, as after nn.Linear. Several kernels return a
    # view of their own work tensor (a permuted product reshaped, an empty or one-row
    # reshape); returned from a Function as it was, autograd refused the in-place change.
    torch.manual_seed(0)
    if name != "auto" and not _runnable(name, batch=max(1, math.prod(lead)), g=4, i=3, o=2):
        pytest.skip(f"{name} does not run this float64 training problem")
    if name == "conv" and 0 in lead:
        pytest.skip("conv refuses an empty batch")
    layer = GroupedLinear(12, 8, groups=4, backend=name, dtype=torch.float64)
    x = torch.randn(*lead, 12, dtype=torch.float64, requires_grad=True)
    x0 = x.detach().clone()
    y = layer(x)
    y.relu_()
    r = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad((y * r).sum(), (x, layer.weight, layer.bias))
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, layer.weight, layer.bias))
    yr = torch.relu(torch.nn.functional.linear(xr, torch.block_diag(*wr), br))
    torch.testing.assert_close(y, yr.detach())
    for got, want in zip((gx, gw, gb), torch.autograd.grad((yr * r).sum(), (xr, wr, br))):
        torch.testing.assert_close(got, want)
    assert torch.equal(x.detach(), x0)


@pytest.mark.parametrize("how", ["vmap", "vmap_weights", "grad", "jacrev"])
@pytest.mark.parametrize("name", ["auto"] + FIXED)
def test_the_output_can_be_changed_in_place_under_torch_func(name, how):
    # As in training (above), under a torch.func transform: the Functions those transforms
    # run returned a view (the batching rule's reshape of the product under vmap, a
    # feature-major kernel's product under grad), and autograd refused nn.ReLU(inplace=True).
    torch.manual_seed(0)
    if name != "auto" and not _runnable(name, batch=3, g=2, i=4, o=3):
        pytest.skip(f"{name} does not run this float64 training problem")
    layer = GroupedLinear(8, 6, groups=2, backend=name, dtype=torch.float64)
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    scale = torch.arange(1.0, 7.0, dtype=torch.float64)

    def f(w, b, xx, module=True):
        y = functional_call(layer, {"weight": w, "bias": b}, (xx,)) if module else \
            torch.nn.functional.linear(xx, torch.block_diag(*w), b)
        return (y.relu_() if module else y.relu()) * scale

    w, b = layer.weight.detach(), layer.bias.detach()
    for module in (True, False):
        if how == "vmap":  # autograd records outside: the parameters require grad
            wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
            y = vmap(lambda xx: f(wg, bg, xx, module))(x)
            got = (y, *torch.autograd.grad(y.sum(), (wg, bg)))
        elif how == "vmap_weights":  # an ensemble: one copy of the weights per model
            ws, bs = torch.stack([w, 2 * w]).requires_grad_(), torch.stack([b, -b]).requires_grad_()
            y = vmap(lambda ww, bb: f(ww, bb, x[0], module))(ws, bs)
            got = (y, *torch.autograd.grad(y.sum(), (ws, bs)))
        elif how == "grad":
            got = vmap(grad(lambda xx: f(w, b, xx, module).sum()))(x[0])
        else:
            got = jacrev(lambda xx: f(w, b, xx, module))(x[0])
        if module:
            result = got
        else:
            torch.testing.assert_close(result, got)


def _heads(n, sizes, bias=True, act=nn.ReLU, device="cpu", dtype=torch.float64):
    def head():
        mods = []
        for k in range(len(sizes) - 1):
            mods.append(nn.Linear(sizes[k], sizes[k + 1], bias=bias, device=device, dtype=dtype))
            if k < len(sizes) - 2:
                mods.append(act())
        return nn.Sequential(*mods)

    return nn.ModuleList(head() for _ in range(n))


# ---------------------------------------------------------------- GroupedLinear


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_linear_shapes_and_parameters(device):
    layer = GroupedLinear(12, 8, groups=4, device=device, dtype=torch.float64)
    assert layer.weight.shape == (4, 2, 3) and layer.bias.shape == (8,)
    assert layer.weight.device.type == device and layer.weight.dtype == torch.float64
    for lead in [(), (5,), (2, 3), (0,)]:
        x = torch.randn(*lead, 12, device=device, dtype=torch.float64)
        y = layer(x)
        assert y.shape == (*lead, 8)
        torch.testing.assert_close(y, reference_loop(x, layer.weight, layer.bias))
    assert set(layer.state_dict()) == {"weight", "bias"}
    assert GroupedLinear(12, 8, groups=4, bias=False).bias is None


def test_default_init_matches_nn_linear_distribution():
    torch.manual_seed(1)
    layer = GroupedLinear(64 * 50, 8 * 50, groups=50)
    ref = torch.cat([nn.Linear(64, 8).weight.detach().flatten() for _ in range(50)])
    bound = 1 / 64**0.5
    for w in (layer.weight.detach().flatten(), layer.bias.detach()):
        assert w.abs().max() <= bound
    w = layer.weight.detach().flatten()
    # uniform(-b, b): std b/sqrt(3); both samples agree to within sampling error
    assert abs(w.std() - ref.std()) < 0.05 * ref.std()
    assert abs(w.std() - bound / 3**0.5) < 0.05 * bound


def test_extra_repr_and_backend_setter():
    layer = GroupedLinear(12, 8, groups=4, backend="bmm")
    r = repr(layer)
    assert "groups=4" in r and "block=3x2" in r and "backend='bmm'" in r
    layer.backend = "loop"
    assert layer.backend == "loop"
    with pytest.raises(BlockDiagError, match=r"GroupedLinear.backend: unknown backend 'fast'; valid names are 'auto', 'loop'"):
        layer.backend = "fast"
    with pytest.raises(BlockDiagError, match=r"unknown backend 'fast'"):
        GroupedLinear(12, 8, groups=4, backend="fast")


def test_plan_is_readable_and_names_the_backend():
    layer = GroupedLinear(500, 500, groups=50)
    plan = layer.plan(torch.randn(32, 500))
    assert plan.backend in names()
    text = str(plan)
    assert plan.backend in text and "50" in text
    layer.backend = "loop"
    assert layer.plan(torch.randn(32, 500)).backend == "loop"


def test_fixed_backend_that_declines_raises():
    layer = GroupedLinear(6, 6, groups=2, backend="conv")
    with pytest.raises(BlockDiagError, match="conv"):
        layer(torch.randn(0, 6))  # conv declines an empty batch; auto would not pick it


@pytest.mark.parametrize(
    "args, match",
    [
        ((10, 8, 4), r"groups=4 must divide in_features=10 and out_features=8"),
        # Dividing in_features alone: out_features // groups rows per block made fewer outputs.
        ((8, 10, 4), r"groups=4 must divide in_features=8 and out_features=10"),
        ((12, 8, 0), r"groups must be a positive int, got 0"),
        ((12, 8, 2.0), r"groups must be a positive int, got 2.0"),
        ((0, 8, 2), r"in_features and out_features must be positive"),
    ],
    ids=["not-dividing", "not-dividing-out", "zero-groups", "float-groups", "zero-features"],
)
def test_grouped_linear_bad_construction(args, match):
    with pytest.raises(BlockDiagError, match=match):
        GroupedLinear(*args)


def test_grouped_linear_wrong_input():
    layer = GroupedLinear(12, 8, groups=4)
    with pytest.raises(BlockDiagError, match=r"input has shape \(5, 10\); its last dimension must be in_features=12"):
        layer(torch.randn(5, 10))
    with pytest.raises(BlockDiagError, match=r"float64.*float32|float32.*float64"):
        layer(torch.randn(5, 12, dtype=torch.float64))


@pytest.mark.parametrize("name", ["auto"] + FIXED)
@pytest.mark.parametrize("device", DEVICES)
def test_from_linears_to_linears_roundtrip(device, name):
    if name != "auto" and not _runnable(name, device):
        pytest.skip(f"{name} does not run float64 training on {device}")
    lins = [nn.Linear(3, 2, device=device, dtype=torch.float64) for _ in range(4)]
    layer = GroupedLinear.from_linears(lins, backend=name)
    x = torch.randn(8, 12, device=device, dtype=torch.float64)
    xs = x.clone().requires_grad_()
    y = layer(xs)
    ref_x = x.clone().requires_grad_()
    ref = torch.cat([lin(ref_x[:, 3 * k:3 * k + 3]) for k, lin in enumerate(lins)], -1)
    torch.testing.assert_close(y, ref)
    r = torch.randn_like(y)
    (y * r).sum().backward()
    (ref * r).sum().backward()
    torch.testing.assert_close(xs.grad, ref_x.grad)
    for k, lin in enumerate(lins):
        torch.testing.assert_close(layer.weight.grad[k], lin.weight.grad)
        torch.testing.assert_close(layer.bias.grad[2 * k:2 * k + 2], lin.bias.grad)
    back = layer.to_linears()
    for a, b in zip(back, lins):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
        assert a.weight.device == b.weight.device and a.weight.dtype == b.weight.dtype


def test_from_linears_bad_input():
    with pytest.raises(BlockDiagError, match="linears is empty"):
        GroupedLinear.from_linears([])
    # One Linear where the sequence belongs: named, not "'Linear' object is not iterable".
    with pytest.raises(BlockDiagError, match=r"linears must be a sequence of nn.Linear, got one Linear; .*pass \[linear\]"):
        GroupedLinear.from_linears(nn.Linear(3, 2))
    # A dict iterates its keys: "linears[0] is a str, not nn.Linear", with no word of the values.
    for linears in (nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(3, 2)}), {"a": nn.Linear(3, 2)}):
        with pytest.raises(BlockDiagError, match=r"linears is a (ModuleDict|dict), which iterates its keys; "
                                                 r"pass its values \(list\(linears.values\(\)\)\)"):
            GroupedLinear.from_linears(linears)
        GroupedLinear.from_linears(linears.values())
    with pytest.raises(BlockDiagError, match=r"linears\[1\] has weight shape \(2, 4\) but linears\[0\] has \(2, 3\)"):
        GroupedLinear.from_linears([nn.Linear(3, 2), nn.Linear(4, 2)])
    with pytest.raises(BlockDiagError, match=r"linears\[1\] has no bias"):
        GroupedLinear.from_linears([nn.Linear(3, 2), nn.Linear(3, 2, bias=False)])
    with pytest.raises(BlockDiagError, match=r"linears\[1\] is a ReLU"):
        GroupedLinear.from_linears([nn.Linear(3, 2), nn.ReLU()])
    with pytest.raises(BlockDiagError, match=r"float64.*float32|float32.*float64"):
        GroupedLinear.from_linears([nn.Linear(3, 2), nn.Linear(3, 2).double()])


# ---------------------------------------------------------------- GroupedMLP

MLP_CASES = [
    pytest.param(5, [8, 6, 4, 1], True, id="forum-like-shared"),
    pytest.param(3, [4, 2], True, id="single-layer-shared"),
    pytest.param(4, [3, 5, 2], False, id="split"),
    pytest.param(1, [4, 3, 2], True, id="one-head"),
]


def _agree_with_heads(model, ref_forward, x):
    """``model`` and ``ref_forward`` agree on ``x`` in output and input gradient; both outputs."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, yr = model(xa), ref_forward(xb)
    torch.testing.assert_close(y, yr)
    r = torch.randn_like(y)
    (y * r).sum().backward()
    (yr * r).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad)
    return y, yr


# "backend/strategy": the auto backend under each GroupedMLP strategy, and every fixed backend
# (whose layers always run as modules).
MLP_RUNS = ["auto", "auto/layers", "auto/fm_chain", "auto/heads"] + FIXED


@pytest.mark.parametrize("name", MLP_RUNS)
@pytest.mark.parametrize("heads_n, sizes, shared", MLP_CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_from_heads_matches_heads_outputs_and_grads(device, heads_n, sizes, shared, name):
    backend, _, strategy = name.partition("/")
    if backend != "auto" and not _runnable(backend, device, g=1):
        pytest.skip(f"{backend} does not run float64 training on {device}")
    heads = _heads(heads_n, sizes, device=device)
    model = GroupedMLP.from_heads(heads, shared_input=shared, backend=backend, strategy=strategy or "auto")
    n_in = sizes[0] * (1 if shared else heads_n)
    x = torch.randn(2, 7, n_in, device=device, dtype=torch.float64)

    def ref_forward(x):
        if shared:
            return torch.cat([h(x) for h in heads], -1)
        return torch.cat([h(x[..., k * sizes[0]:(k + 1) * sizes[0]]) for k, h in enumerate(heads)], -1)

    y, _ = _agree_with_heads(model, ref_forward, x)
    assert y.shape == (2, 7, heads_n * sizes[-1])
    # every parameter's gradient matches its head's, after mapping back through to_heads layout
    for k, layer in enumerate(model.layers):
        o, i = sizes[k + 1], sizes[k]
        gw = layer.weight.grad.reshape(heads_n, o, i)
        gb = layer.bias.grad.reshape(heads_n, o)
        for h, head in enumerate(heads):
            torch.testing.assert_close(gw[h], head[2 * k].weight.grad)
            torch.testing.assert_close(gb[h], head[2 * k].bias.grad)
    back = model.to_heads()
    for a, b in zip(back, heads):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)
    x0 = x[0].detach()
    torch.testing.assert_close(torch.cat([h(x0) for h in back], -1) if shared else ref_forward(x0), model(x0))


def test_shared_input_first_layer_is_one_wide_matmul():
    model = GroupedMLP(150, [10, 10], 1, heads=50)
    assert model.layers[0].groups == 1 and model.layers[0].weight.shape == (1, 500, 150)
    assert [layer.groups for layer in model.layers[1:]] == [50, 50]
    assert model(torch.randn(3, 150)).shape == (3, 50)
    split = GroupedMLP(150, 10, 1, heads=50, shared_input=False)
    assert split.layers[0].groups == 50
    with pytest.raises(BlockDiagError, match=r"input has shape \(3, 150\); its last dimension must be 7500 \(heads=50 x in_features=150\)"):
        split(torch.randn(3, 150))


def test_activation_and_no_bias():
    heads = _heads(3, [4, 5, 2], bias=False, act=nn.Tanh)
    model = GroupedMLP.from_heads(heads)
    assert isinstance(model.activations[0], nn.Tanh) and model.layers[0].bias is None
    x = torch.randn(6, 4, dtype=torch.float64)
    torch.testing.assert_close(model(x), torch.cat([h(x) for h in heads], -1))
    hidden_free = GroupedMLP(4, [], 2, heads=3, dtype=torch.float64)
    assert len(hidden_free.layers) == 1 and hidden_free(x).shape == (6, 6)


@pytest.mark.parametrize("name", ["auto", "auto/layers", "auto/fm_chain", "auto/heads", "bmm", "dense", "loop"])
def test_training_parity_50_steps(name):
    torch.manual_seed(3)
    heads = _heads(10, [15, 10, 10, 1], dtype=torch.float32)
    backend, _, strategy = name.partition("/")
    model = GroupedMLP.from_heads(heads, backend=backend, strategy=strategy or "auto")
    xs, ys = torch.randn(64, 15), torch.randn(64, 10)
    opt_a = torch.optim.Adam(heads.parameters(), lr=1e-2)
    opt_b = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for step in range(50):
        la = ((torch.cat([h(xs) for h in heads], -1) - ys) ** 2).mean()
        lb = ((model(xs) - ys) ** 2).mean()
        assert abs(la.item() - lb.item()) < 1e-4, f"step {step}: {la.item()} vs {lb.item()}"
        first = first if first is not None else lb.item()
        for opt, loss in ((opt_a, la), (opt_b, lb)):
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert lb.item() < 0.9 * first  # it trained, so the parity above compared moving models


def test_from_heads_takes_bare_linear_heads_as_one_layer_heads():
    # Single nn.Linear heads reading one input are common (multi-task heads); they used to be
    # refused until wrapped in nn.Sequential by hand.
    heads = [nn.Linear(4, 3) for _ in range(5)]
    x = torch.randn(6, 4)
    model = GroupedMLP.from_heads(heads)
    torch.testing.assert_close(model(x), torch.cat([h(x) for h in heads], -1))
    mixed = GroupedMLP.from_heads([heads[0], nn.Sequential(heads[1])])
    torch.testing.assert_close(mixed(x), torch.cat([heads[0](x), heads[1](x)], -1))
    heads[2].register_forward_hook(lambda *a: None)
    with pytest.raises(BlockDiagError, match=r"heads\[2\]\[0\] has forward or backward hooks"):
        GroupedMLP.from_heads(heads)


def test_from_heads_bad_input():
    good = _heads(2, [4, 3, 1])
    with pytest.raises(BlockDiagError, match="heads is empty"):
        GroupedMLP.from_heads([])
    with pytest.raises(BlockDiagError, match=r"heads must be a sequence of heads .*got one Linear; .*pass \[head\]"):
        GroupedMLP.from_heads(nn.Linear(3, 2))
    named = nn.ModuleDict({"a": good[0], "b": good[1]})
    with pytest.raises(BlockDiagError, match=r"heads is a ModuleDict, which iterates its keys; pass its values"):
        GroupedMLP.from_heads(named)  # "heads[0] must be an nn.Sequential or an nn.Linear, got str" before
    GroupedMLP.from_heads(named.values())
    with pytest.raises(BlockDiagError, match=r"heads\[0\] must be an nn.Sequential or an nn.Linear, got ReLU"):
        GroupedMLP.from_heads([nn.ReLU()])
    bad = nn.ModuleList([good[0], _heads(1, [4, 5, 1])[0]])
    with pytest.raises(BlockDiagError, match=r"heads\[1\]\[0\] is Linear with weight \(5, 4\).*heads\[0\]\[0\] has weight \(3, 4\)"):
        GroupedMLP.from_heads(bad)
    deeper = nn.ModuleList([good[0], _heads(1, [4, 3, 3, 1])[0]])
    with pytest.raises(BlockDiagError, match=r"heads\[1\] has 5 modules but heads\[0\] has 3"):
        GroupedMLP.from_heads(deeper)
    other_act = nn.ModuleList([good[0], _heads(1, [4, 3, 1], act=nn.Tanh)[0]])
    with pytest.raises(BlockDiagError, match=r"heads\[1\]\[1\] is Tanh but heads\[0\]\[1\] is ReLU"):
        GroupedMLP.from_heads(other_act)
    with pytest.raises(BlockDiagError, match=r"must be Sequential\(Linear, act, Linear"):
        GroupedMLP.from_heads([nn.Sequential(nn.ReLU(), nn.Linear(2, 2))])
    with pytest.raises(BlockDiagError, match=r"positive ints"):
        GroupedMLP(4, [0], 2, heads=3)


@pytest.mark.parametrize(
    "act, match",
    [
        pytest.param(lambda: nn.PReLU(), r"heads\[0\]\[1\] is PReLU.*holds parameters or buffers \(weight\)", id="prelu-parameters"),
        pytest.param(lambda: nn.LayerNorm(3), r"heads\[0\]\[1\] is LayerNorm.*holds parameters or buffers \(weight, bias\)", id="layernorm-parameters"),
        pytest.param(lambda: nn.LayerNorm(3, elementwise_affine=False), r"heads\[0\]\[1\] is LayerNorm.*not element-wise", id="layernorm-no-affine"),
        pytest.param(lambda: nn.Softmax(dim=-1), r"heads\[0\]\[1\] is Softmax.*not element-wise.*ReLU, ReLU6", id="softmax"),
    ],
)
def test_from_heads_refuses_activations_it_cannot_group(act, match):
    # Grouped, these would give silently wrong outputs: one head's parameters for all, or a
    # row-wise op over [heads, hidden, batch] that mixes heads or runs over the batch.
    heads = nn.ModuleList(nn.Sequential(nn.Linear(6, 3), act(), nn.Linear(3, 2)) for _ in range(3))
    with pytest.raises(BlockDiagError, match=match):
        GroupedMLP.from_heads(heads)
    with pytest.raises(BlockDiagError, match=r"activation\(\) after hidden layer 0 is"):
        GroupedMLP(6, 3, 2, heads=3, activation=act)


def _dropout_heads(n=3):
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Dropout(0.5), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
        for _ in range(n)
    ).double()


@pytest.mark.parametrize("strategy", ["auto", "layers", "fm_chain", "heads"])
def test_from_heads_groups_several_elementwise_modules_between_linears(strategy):
    # The common head ``Linear, ReLU, Dropout, Linear``: the modules between two Linears
    # become one nn.Sequential activation, and to_heads writes them back one by one.
    heads = _dropout_heads().eval()
    model = GroupedMLP.from_heads(heads, strategy=strategy).eval()
    assert type(model.activations[0]) is nn.Sequential and isinstance(model.activations[1], nn.Tanh)
    assert [type(m) for m in model.activations[0]] == [nn.ReLU, nn.Dropout]
    x = torch.randn(7, 6, dtype=torch.float64)
    y, yr = _agree_with_heads(model, lambda x: torch.cat([h(x) for h in heads], -1), x)
    for k, layer in enumerate(model.layers):
        for h, head in enumerate(heads):
            lin = [m for m in head if isinstance(m, nn.Linear)][k]
            torch.testing.assert_close(layer.weight.grad.reshape(3, *lin.weight.shape)[h], lin.weight.grad)
    back = model.to_heads()
    assert [type(m) for m in back[0]] == [type(m) for m in heads[0]]
    assert back[0][2].p == 0.5
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([h.eval()(x) for h in back], -1), yr)
    assert [type(m) for m in GroupedMLP.from_heads(back).activations[0]] == [nn.ReLU, nn.Dropout]


@pytest.mark.parametrize("strategy", ["auto", "layers", "fm_chain", "heads"])
def test_to_heads_gives_back_a_heads_own_nested_sequential(strategy):
    # A head built as Linear, Sequential(ReLU, Dropout), Linear, Sequential(Tanh) came back
    # flat: the same function, but state-dict keys and indexing that differ from the head's.
    torch.manual_seed(0)
    heads = nn.ModuleList(
        nn.Sequential(nn.Linear(6, 5), nn.Sequential(nn.ReLU(), nn.Dropout(0.2)), nn.Linear(5, 2),
                      nn.Sequential(nn.Tanh())) for _ in range(3)
    ).double().eval()
    model = GroupedMLP.from_heads(heads, strategy=strategy).eval()
    x = torch.randn(7, 6, dtype=torch.float64)
    _, yr = _agree_with_heads(model, lambda x: torch.cat([h(x) for h in heads], -1), x)
    back = model.to_heads()
    assert repr(back[0]) == repr(heads[0])
    assert back[0].state_dict().keys() == heads[0].state_dict().keys()
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([h.eval()(x) for h in back], -1), yr)
    assert repr(GroupedMLP.from_heads(back).to_heads()[1]) == repr(heads[1])


def test_dropout_between_linears_trains_as_dropout():
    # In training the grouped Dropout drops hidden units as each head's would: with p=1
    # every hidden unit is dropped and each head's output is its last bias alone.
    heads = _dropout_heads()
    for head in heads:
        head[2].p = 1.0
    model = GroupedMLP.from_heads(heads).train()
    y = model(torch.randn(4, 6, dtype=torch.float64))
    last = torch.cat([h[-1](torch.tanh(h[3].bias)) for h in heads]).expand(4, -1)
    torch.testing.assert_close(y, last.detach())


def test_a_hook_inside_a_sequential_activation_stops_the_chain():
    model = GroupedMLP.from_heads(_dropout_heads()).eval()
    seen = []
    model.activations[0][0].register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    model(torch.randn(7, 6, dtype=torch.float64))
    assert seen == [(7, 15)]  # the layers' layout, [batch, heads * hidden]
    with pytest.raises(BlockDiagError, match=r"strategy='fm_chain' cannot run: activations\[0\] has hooks"):
        model.strategy = "fm_chain"
        model(torch.randn(7, 6, dtype=torch.float64))


def test_a_sequential_activation_must_hold_element_wise_modules():
    with pytest.raises(BlockDiagError, match=r"activation\(\) after hidden layer 0\[1\] is Softmax.*not element-wise"):
        GroupedMLP(6, 3, 2, heads=3, activation=lambda: nn.Sequential(nn.ReLU(), nn.Softmax(-1)))
    with pytest.raises(BlockDiagError, match=r"activation\(\) after hidden layer 0 is an empty nn.Sequential"):
        GroupedMLP(6, 3, 2, heads=3, activation=nn.Sequential)
    heads = nn.ModuleList(nn.Sequential(nn.Linear(6, 3), nn.ReLU(), nn.LayerNorm(3), nn.Linear(3, 2)) for _ in range(2))
    with pytest.raises(BlockDiagError, match=r"heads\[0\]\[2\] is LayerNorm.*holds parameters"):
        GroupedMLP.from_heads(heads)
    with pytest.raises(BlockDiagError, match=r"got \(Linear, Linear\)"):
        GroupedMLP.from_heads([nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))])


@pytest.mark.parametrize("strategy", ["auto", "layers", "fm_chain", "heads"])
def test_from_heads_takes_an_activation_after_the_last_linear(strategy):
    # An RL actor's heads end with Tanh: it becomes output_activation, and to_heads puts it
    # back at the end of every head.
    torch.manual_seed(0)
    heads = nn.ModuleList(
        nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2), nn.Tanh(), nn.Dropout(0.1)) for _ in range(3)
    ).double().eval()
    model = GroupedMLP.from_heads(heads, strategy=strategy).eval()
    assert [type(m) for m in model.output_activation] == [nn.Tanh, nn.Dropout]
    x = torch.randn(2, 7, 6, dtype=torch.float64)
    y, yr = _agree_with_heads(model, lambda x: torch.cat([h(x) for h in heads], -1), x)
    assert y.abs().max() < 1  # the Tanh ran
    back = model.to_heads()
    assert [type(m) for m in back[1]] == [type(m) for m in heads[1]]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([h.eval()(x) for h in back], -1), yr)
    one = GroupedMLP.from_heads(nn.ModuleList(nn.Sequential(nn.Linear(4, 2), nn.Sigmoid()) for _ in range(2)))
    assert isinstance(one.output_activation, nn.Sigmoid) and len(one.layers) == 1


def test_output_activation_argument():
    torch.manual_seed(0)
    plain = GroupedMLP(6, 5, 2, heads=3, dtype=torch.float64)
    assert plain.output_activation is None and "output_activation" not in dict(plain.named_children())
    squashed = GroupedMLP(6, 5, 2, heads=3, output_activation=nn.Sigmoid, dtype=torch.float64)
    squashed.load_state_dict(plain.state_dict())  # stateless: the same checkpoint loads
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(squashed(x), torch.sigmoid(plain(x)))
    gathered = blockdiag.distributed.gather_model(squashed)
    torch.testing.assert_close(gathered(x), squashed(x))
    seen = []
    squashed.output_activation.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    squashed(x)
    assert seen == [(4, 6)]
    with pytest.raises(BlockDiagError, match=r"output_activation\(\) is Softmax.*not element-wise"):
        GroupedMLP(6, 5, 2, heads=3, output_activation=lambda: nn.Softmax(-1))


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "split"])
@pytest.mark.parametrize("strategy", ["auto", "layers", "fm_chain", "heads"])
def test_from_heads_with_a_bias_on_some_layers_only(strategy, shared):
    # A head whose last Linear has no bias (or whose first has none): GroupedMLP takes one
    # bias flag per layer, and each strategy runs each layer with or without its bias.
    torch.manual_seed(0)
    heads = nn.ModuleList(
        nn.Sequential(nn.Linear(6, 5, bias=False), nn.ReLU(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2, bias=False))
        for _ in range(3)
    ).double()
    model = GroupedMLP.from_heads(heads, strategy=strategy, shared_input=shared)
    assert [layer.bias is not None for layer in model.layers] == [False, True, False]
    x = torch.randn(7, 6 if shared else 18, dtype=torch.float64)

    def ref(x):
        if shared:
            return torch.cat([h(x) for h in heads], -1)
        return torch.cat([h(x[:, 6 * k:6 * (k + 1)]) for k, h in enumerate(heads)], -1)

    y, _ = _agree_with_heads(model, ref, x)
    torch.testing.assert_close(model.layers[1].bias.grad, torch.cat([h[2].bias.grad for h in heads]))
    back = model.to_heads()
    assert [m.bias is not None for m in back[0] if isinstance(m, nn.Linear)] == [False, True, False]
    for a, b in zip(back, heads):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)
    torch.testing.assert_close(blockdiag.distributed.gather_model(model)(x), y)


def test_bias_flags_per_layer_are_checked():
    assert GroupedMLP(6, [5], 2, heads=3, bias=(True, False)).layers[1].bias is None
    with pytest.raises(BlockDiagError, match=r"bias must be a bool or one bool per layer \(2 layers\), got \[True\]"):
        GroupedMLP(6, [5], 2, heads=3, bias=[True])
    with pytest.raises(BlockDiagError, match=r"bias must be a bool or one bool per layer \(3 layers\), got \(True, False\)"):
        GroupedMLP(6, [5, 4], 2, heads=3, bias=(True, False))
    assert GroupedMLP(6, [5], 2, heads=3, bias=0).layers[0].bias is None  # truthiness, as nn.Linear's


class _LoRALinear(nn.Linear):
    def __init__(self, i, o):
        super().__init__(i, o)
        self.a = nn.Parameter(torch.randn(2, i))
        self.b = nn.Parameter(torch.randn(o, 2))

    def forward(self, x):
        return super().forward(x) + x @ self.a.T @ self.b.T


class _ScaledLinear(nn.Linear):  # its own forward, no more state
    def forward(self, x):
        return 2 * super().forward(x)


class _TaggedLinear(nn.Linear):  # more state, nn.Linear's forward
    def __init__(self, i, o):
        super().__init__(i, o)
        self.register_buffer("tag", torch.zeros(1))


def _hooked_linear(i, o):
    lin = nn.Linear(i, o)
    lin.register_forward_hook(lambda m, inp, out: out * 100)
    return lin


@pytest.mark.parametrize(
    "make, match",
    [
        pytest.param(lambda: _LoRALinear(4, 3), r"is a _LoRALinear, whose own forward is not nn.Linear's", id="lora"),
        pytest.param(lambda: _ScaledLinear(4, 3), r"is a _ScaledLinear, whose own forward", id="own-forward"),
        pytest.param(lambda: _TaggedLinear(4, 3), r"is a _TaggedLinear with more state than weight and bias \(tag\)", id="more-state"),
        pytest.param(lambda: nn.LazyLinear(3), r"is an uninitialized LazyLinear: run one forward", id="lazy"),
        pytest.param(lambda: _hooked_linear(4, 3), r"has forward or backward hooks", id="hooked"),
    ],
)
def test_conversions_refuse_linears_that_compute_something_else(make, match):
    # Converting copies weight and bias only: a LoRA adapter's product was silently dropped.
    with pytest.raises(BlockDiagError, match=r"GroupedLinear.from_linears: linears\[0\] " + match):
        GroupedLinear.from_linears([make(), make()])
    heads = [nn.Sequential(make(), nn.ReLU(), nn.Linear(3, 1)) for _ in range(2)]
    with pytest.raises(BlockDiagError, match=r"GroupedMLP.from_heads: heads\[0\]\[0\] " + match):
        GroupedMLP.from_heads(heads)


class _Scale(nn.Module):  # stateless and element-wise; its setting is not in its repr
    def __init__(self, s):
        super().__init__()
        self.s = s

    def forward(self, x):
        return x * self.s


class _PrivateScale(nn.Module):  # as _Scale, its setting under a private name
    def __init__(self, s):
        super().__init__()
        self._s = s

    def forward(self, x):
        return x * self._s


def _three_heads(act=nn.ReLU):
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(5, 4), act(), nn.Linear(4, 2)) for _ in range(3))


@pytest.mark.parametrize(
    "spoil, match",
    [
        pytest.param(lambda hs: hs[1][1].register_forward_hook(lambda m, i, o: o * 100),
                     r"heads\[1\]\[1\] has forward or backward hooks", id="hook-on-an-activation"),
        pytest.param(lambda hs: hs[0][1].register_forward_pre_hook(lambda m, i: (i[0] * 2,)),
                     r"heads\[0\]\[1\] has forward or backward hooks", id="hook-on-the-first-head"),
        pytest.param(lambda hs: hs[2].register_forward_hook(lambda m, i, o: o + 1),
                     r"heads\[2\] has forward or backward hooks", id="hook-on-a-head"),
        pytest.param(lambda hs: hs[2].eval(), r"heads\[2\] is in eval mode but heads\[0\] is in training mode",
                     id="one-head-in-eval"),
        pytest.param(lambda hs: hs[1][2].bias.requires_grad_(False),
                     r"heads\[1\]\[2\] has requires_grad \{'weight': True, 'bias': False\}", id="one-frozen-bias"),
        pytest.param(lambda hs: [hs[k].__setitem__(1, _Scale(k + 1)) for k in range(3)],
                     r"heads\[1\]\[1\] is _Scale\(\) but heads\[0\]\[1\] is _Scale\(\) \(their s differ: 2 and 1\)",
                     id="custom-activation-settings"),
        pytest.param(lambda hs: [hs[k].__setitem__(1, _PrivateScale(k + 1)) for k in range(3)],
                     r"heads\[1\]\[1\] is _PrivateScale\(\) but heads\[0\]\[1\] is _PrivateScale\(\) "
                     r"\(their _s differ: 2 and 1\)",
                     id="custom-activation-private-settings"),
    ],
)
def test_from_heads_refuses_heads_it_would_run_differently(spoil, match):
    # Each was converted silently into a model computing something else: a hook dropped (or
    # one head's hook run for every head), one head's eval-mode Dropout or custom activation
    # setting applied to all heads, one head's frozen parameter trained.
    heads = _three_heads()
    spoil(heads)
    with pytest.raises(BlockDiagError, match=match):
        GroupedMLP.from_heads(heads)


@pytest.mark.parametrize("setting", [float("nan"), torch.tensor([1.0, float("nan")])], ids=["float", "tensor"])
def test_from_heads_takes_heads_whose_activation_settings_are_nan_alike(setting):
    # A NaN setting differs from itself under ==: heads[0]'s activation was compared with
    # itself and refused ("heads[0][1] is _Scale() but heads[0][1] is _Scale()"), as were
    # copies of it.
    heads = _three_heads()
    for h in range(3):
        heads[h][1] = _Scale(copy.deepcopy(setting)) if h else _Scale(setting)
    assert GroupedMLP.from_heads(heads[:1]).activations[0].s is not None
    GroupedMLP.from_heads(heads)
    heads[2][1] = _Scale(torch.tensor([1.0, 2.0])) if isinstance(setting, torch.Tensor) else _Scale(1.0)
    with pytest.raises(BlockDiagError, match=r"heads\[2\]\[1\] is _Scale\(\) but heads\[0\]\[1\]"):
        GroupedMLP.from_heads(heads)


@pytest.mark.parametrize(
    "replace, match",
    [
        pytest.param(lambda m: setattr(m, "output_activation", nn.Softmax(-1)),
                     r"GroupedMLP.output_activation: output_activation is Softmax\(dim=-1\), which is not element-wise",
                     id="softmax-output"),
        pytest.param(lambda m: m.activations.__setitem__(1, nn.LayerNorm(3, dtype=torch.float64)),
                     r"GroupedMLP.activations: activations\[1\] is LayerNorm.*holds parameters or buffers",
                     id="layernorm"),
        pytest.param(lambda m: m.activations.__setitem__(0, nn.PReLU(4, dtype=torch.float64)),
                     r"activations\[0\] is PReLU\(num_parameters=4\), which holds parameters", id="prelu"),
        pytest.param(lambda m: m.activations.__setitem__(-1, nn.Sequential(nn.ReLU(), nn.Softmax(-1))),
                     r"activations\[1\]\[1\] is Softmax", id="inside-a-sequential"),
        pytest.param(lambda m: setattr(m, "activations", nn.ModuleList([nn.Tanh()])),
                     r"activations must be an nn.ModuleList of one activation per hidden layer \(2\), got one of 1",
                     id="one-too-few"),
        pytest.param(lambda m: setattr(m, "activations", nn.ModuleList([nn.Tanh(), nn.GELU(), nn.Tanh()])),
                     r"per hidden layer \(2\), got one of 3", id="one-too-many"),
        pytest.param(lambda m: m.activations.append(nn.Tanh()),
                     r"GroupedMLP.activations: it holds one activation per hidden layer \(2\); replace one",
                     id="append"),
        pytest.param(lambda m: m.activations.__delitem__(0), r"it holds one activation per hidden layer \(2\)",
                     id="del"),
        # add_module and register_module write the container's dict past __setattr__.
        pytest.param(lambda m: m.activations.register_module("0", nn.Softmax(-1)),
                     r"GroupedMLP.activations: activations\[0\] is Softmax\(dim=-1\), which is not element-wise",
                     id="register_module"),
        pytest.param(lambda m: m.activations.add_module("2", nn.Tanh()),
                     r"it holds one activation per hidden layer \(2\); replace one", id="add_module"),
    ],
)
def test_grouped_mlp_refuses_activations_replaced_by_what_it_cannot_apply(replace, match):
    # Checked only by the constructor: put in later, each ran on every head's units at once in
    # each strategy's own layout, so the layers, the chain, the heads and to_heads' heads each
    # computed something else (a Softmax over every head's outputs, or over the chain's batch),
    # and a missing or extra activation was skipped or applied by some strategies only.
    model = GroupedMLP(5, [4, 3], 2, heads=3, dtype=torch.float64)
    model.to_heads()
    with pytest.raises(BlockDiagError, match=match):
        replace(model)
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):  # the check travels with the model
        with pytest.raises(BlockDiagError, match=match):
            replace(copied)
    # A whole-module torch.save still holds only the classes the FAQ allows for weights_only.
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    with torch.serialization.safe_globals([GroupedMLP, GroupedLinear, nn.ModuleList, nn.ReLU]):
        loaded = torch.load(buf)
    with pytest.raises(BlockDiagError, match=match):
        replace(loaded)


def test_grouped_mlp_runs_activations_replaced_after_construction_in_every_strategy():
    torch.manual_seed(0)
    model = GroupedMLP(5, [4, 3], 2, heads=3, dtype=torch.float64)
    x = torch.randn(6, 5, dtype=torch.float64)
    model(x)
    model.activations[0] = nn.Softplus(beta=2.0)
    model.activations = nn.ModuleList([model.activations[0], nn.Sequential(nn.GELU(approximate="tanh"), nn.Identity())])
    model.activations[1][1] = nn.Hardtanh(-0.1, 0.2)
    model.output_activation = nn.LeakyReLU(0.3)
    want = torch.cat([h(x) for h in model.to_heads()], -1)
    for strategy in ("layers", "fm_chain", "heads", "auto"):
        model.strategy = strategy
        torch.testing.assert_close(model(x), want, msg=strategy)
    model.output_activation = None
    torch.testing.assert_close(model(x), torch.cat([h(x) for h in model.to_heads()], -1))
    # A model pickled before the activations checked replacements held a plain ModuleList.
    model._modules["activations"] = nn.ModuleList(model.activations)
    with pytest.raises(BlockDiagError, match=r"activations\[0\] is Softmax"):
        pickle.loads(pickle.dumps(model)).activations[0] = nn.Softmax(-1)


def test_from_heads_and_to_heads_keep_training_mode_and_frozen_parameters():
    heads = _three_heads(lambda: nn.Sequential(nn.ReLU(), nn.Dropout(0.5)))
    for head in heads:
        head[0].requires_grad_(False)
    heads.eval()
    model = GroupedMLP.from_heads(heads)
    assert not model.training and not any(m.training for m in model.modules())
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True]
    x = torch.randn(7, 5)
    torch.testing.assert_close(model(x), torch.cat([h(x) for h in heads], -1))
    back = model.to_heads()
    assert not any(m.training for m in back.modules() if m is not back)
    assert [p.requires_grad for p in back[1].parameters()] == [False, False, True, True]
    model.train()
    assert all(m.training for h in model.to_heads() for m in h.modules())


def test_from_linears_and_to_linears_keep_frozen_parameters():
    lins = [nn.Linear(4, 3) for _ in range(2)]
    for lin in lins:
        lin.weight.requires_grad_(False)
        lin.eval()
    layer = GroupedLinear.from_linears(lins)
    assert (layer.weight.requires_grad, layer.bias.requires_grad, layer.training) == (False, True, False)
    back = layer.to_linears()
    assert (back[1].weight.requires_grad, back[1].bias.requires_grad, back[1].training) == (False, True, False)
    lins[1].bias.requires_grad_(False)
    with pytest.raises(BlockDiagError, match=r"linears\[1\] has requires_grad \{'weight': False, 'bias': False\}"):
        GroupedLinear.from_linears(lins)


def _old_style(kind):
    """Set ``kind`` (torch.nn.utils.prune or the old weight_norm / spectral_norm) up on a layer."""
    import warnings
    from torch.nn.utils import prune

    def setup(layer):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the old ones
            if kind == "prune":
                prune.l1_unstructured(layer, "weight", amount=0.3)
            elif kind == "weight_norm":
                nn.utils.weight_norm(layer, dim=0)
            else:
                nn.utils.spectral_norm(layer)
        return layer

    return setup


@pytest.mark.parametrize("kind", ["prune", "weight_norm", "spectral_norm"])
def test_to_linears_and_to_heads_copy_a_hook_computed_weight_as_of_now(kind):
    # prune and the old weight_norm / spectral_norm keep ``weight`` as an attribute that a
    # forward pre-hook recomputes: after an optimizer step it still held the value of the
    # last forward, and the heads converted then silently lacked the step (and, after a
    # no_grad forward, had a frozen weight).
    torch.manual_seed(0)
    x = torch.randn(8, 12, dtype=torch.float64)
    layer = _old_style(kind)(GroupedLinear(12, 8, groups=4, dtype=torch.float64)).eval()
    model = GroupedMLP(12, [6], 2, heads=3, dtype=torch.float64).eval()
    _old_style(kind)(model.layers[1])
    for m in (layer, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        m(x).square().sum().backward()
        opt.step()
        with torch.no_grad():
            m(x)  # an evaluation pass last: the attribute then requires no grad
    heads = layer.to_linears()
    torch.testing.assert_close(torch.cat([h(xs) for h, xs in zip(heads, x.split(3, -1))], -1), layer(x))
    assert all(h.weight.requires_grad for h in heads)
    heads = model.to_heads()
    torch.testing.assert_close(torch.cat([h(x) for h in heads], -1), model(x))
    assert all(h[2].weight.requires_grad for h in heads)


def test_plan_runs_no_parametrization_and_leaves_the_next_forward_as_it_was():
    # plan() reads no data, but it read layer.weight, which runs a parametrization: a
    # spectral_norm layer stepped its power iteration (the next forward's output moved), a
    # random one drew, once per call of plan() and per layer of GroupedMLP.plan().
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    x = torch.randn(8, 12)
    layer = parametrizations.spectral_norm(GroupedLinear(12, 8, groups=4))
    twin = copy.deepcopy(layer)
    model = GroupedMLP(12, [8], 2, heads=4)
    parametrizations.spectral_norm(model.layers[1])
    model_twin = copy.deepcopy(model)
    calls = []

    class Counted(nn.Module):
        def forward(self, b):
            calls.append(1)
            return b

    frozen = GroupedLinear(12, 8, groups=4).requires_grad_(False)
    parametrize.register_parametrization(frozen, "bias", Counted())
    frozen.parametrizations.bias.original.requires_grad_(True)
    calls.clear()  # registering runs it once
    for _ in range(3):
        assert layer.plan(x).problem.requires_grad
        assert model.plan(x).layers[1].problem.requires_grad
        assert frozen.plan(x).problem.requires_grad  # the original's requires_grad is the computed value's
    assert calls == []
    torch.testing.assert_close(layer(x), twin(x), rtol=0, atol=0)
    torch.testing.assert_close(model(x), model_twin(x), rtol=0, atol=0)
    with torch.no_grad():
        assert not layer.plan(x).problem.requires_grad


@pytest.mark.parametrize("kind", ["prune", "weight_norm", "spectral_norm"])
def test_plan_of_a_hook_computed_weight_follows_the_next_forward(kind):
    # prune and the old weight_norm / spectral_norm keep the weight their pre-hook computed at
    # the last forward: after a no_grad forward it required no grad, and plan() (grad on)
    # planned for inference where the next forward recomputes it with grad and trains.
    x = torch.randn(8, 12)
    layer = _old_style(kind)(GroupedLinear(12, 8, groups=4, bias=False))
    with torch.no_grad():
        layer(x)
    assert layer.plan(x).problem.requires_grad and layer(x).requires_grad
    for name in ("weight_g", "weight_v") if kind == "weight_norm" else ("weight_orig",):
        getattr(layer, name).requires_grad_(False)
    assert not layer.plan(x).problem.requires_grad and not layer(x).requires_grad


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_conversions_of_parametrized_modules_keep_requires_grad_under_no_grad(grad):
    # requires_grad was read from the computed weight, which under no_grad never requires
    # grad: converting a masked or weight_norm'd model there froze its weight silently, and
    # the check for heads frozen alike passed whatever they were.
    from torch.nn.utils import parametrizations

    heads = _three_heads()
    for head in heads:
        blockdiag.mask_block_diagonal_(head[2], 2)
    lins = [parametrizations.weight_norm(nn.Linear(3, 2)) for _ in range(2)]
    layer = parametrizations.weight_norm(GroupedLinear(12, 8, groups=4), dim=0)
    with torch.set_grad_enabled(grad):
        assert all(p.requires_grad for p in GroupedMLP.from_heads(heads).parameters())
        assert GroupedLinear.from_linears(lins).weight.requires_grad
        assert all(lin.weight.requires_grad for lin in layer.to_linears())
    # Inside a torch.func transform the computed weight is a wrapped tensor: requires_grad_
    # on the copy (as if it differed) is refused there, and building failed.
    x = torch.randn(4, 5)
    torch.func.jvp(lambda x: GroupedMLP.from_heads(heads)(x), (x,), (torch.ones_like(x),))
    for p in lins[1].parametrizations.weight.parameters():
        p.requires_grad_(False)
    with torch.set_grad_enabled(grad), pytest.raises(
            BlockDiagError, match=r"linears\[1\] has requires_grad \{'weight': False, 'bias': True\}"):
        GroupedLinear.from_linears(lins)
    for p in lins[0].parametrizations.weight.parameters():
        p.requires_grad_(False)
    with torch.set_grad_enabled(grad):
        assert not GroupedLinear.from_linears(lins).weight.requires_grad


def test_conversions_compute_a_parametrized_weight_once_per_module():
    # Every check of from_linears / from_heads read a parametrized weight again (heads[0]'s
    # at every head's check): spectral_norm stepped its power iteration each time, so the
    # converted layer differed from the heads' next forward and the heads' state moved.
    from torch.nn.utils import parametrize, parametrizations

    calls = []

    class Count(nn.Module):
        def forward(self, w):
            calls.append(1)
            return w

    lins = [parametrize.register_parametrization(nn.Linear(3, 2), "weight", Count()) for _ in range(6)]
    heads = [nn.Sequential(lin, nn.ReLU(), nn.Linear(2, 1)) for lin in copy.deepcopy(lins)]
    calls.clear()
    GroupedLinear.from_linears(lins)
    assert len(calls) == 6
    calls.clear()
    GroupedMLP.from_heads(heads)
    assert len(calls) == 6
    torch.manual_seed(0)
    sn = [parametrizations.spectral_norm(nn.Linear(6, 4, dtype=torch.float64)) for _ in range(3)]
    untouched = copy.deepcopy(sn)
    x = torch.randn(5, 18, dtype=torch.float64)
    layer = GroupedLinear.from_linears(sn)
    torch.testing.assert_close(layer(x), torch.cat([h(xs) for h, xs in zip(untouched, x.split(6, -1))], -1))
    for a, b in zip(sn, untouched):  # each head stepped once, as its forward steps
        torch.testing.assert_close(a.parametrizations.weight[0]._u, b.parametrizations.weight[0]._u)


def test_conversions_of_linears_with_an_empty_side_name_the_linear():
    # The refusal came from the layer being built and named its totals ("in_features=0,
    # out_features=6" for two nn.Linear(0, 3)), or only a list of sizes: not the linear.
    with pytest.raises(BlockDiagError, match=r"from_linears: linears\[0\] has weight shape \(3, 0\) \(nn.Linear\(0, 3\)\)"):
        GroupedLinear.from_linears([nn.Linear(0, 3) for _ in range(2)])
    with pytest.raises(BlockDiagError, match=r"from_heads: heads\[0\]\[2\] has weight shape \(0, 4\)"):
        GroupedMLP.from_heads([nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 0)) for _ in range(2)])


def test_from_heads_takes_masked_heads():
    # A masked Linear's class is made for it alone: heads[1][0] and heads[0][0], both
    # ParametrizedLinear, were refused as different types.
    heads = _three_heads()
    for head in heads:
        blockdiag.mask_block_diagonal_(head[2], 2)
    x = torch.randn(7, 5)
    torch.testing.assert_close(GroupedMLP.from_heads(heads)(x), torch.cat([h(x) for h in heads], -1))


def test_conversions_take_plain_linear_subclasses_and_masked_linears():
    from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

    lins = [NonDynamicallyQuantizableLinear(4, 3) for _ in range(2)]
    x = torch.randn(5, 4)
    torch.testing.assert_close(GroupedLinear.from_linears(lins)(torch.cat([x, x], -1)), torch.cat([m(x) for m in lins], -1))
    masked = blockdiag.mask_block_diagonal_(nn.Linear(4, 4), 2)
    GroupedLinear.from_linears([masked])


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_grouped_mlp_auto_runs_on_meta_and_fake_inputs(grad):
    # auto's strategy choice measured the layers' plans, and planning refuses meta: the
    # default GroupedMLP failed on meta where each strategy named explicitly ran.
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = GroupedMLP(4, [3], 2, heads=3, device="meta")
    with torch.set_grad_enabled(grad):
        y = model(torch.randn(5, 4, device="meta"))
        assert y.shape == (5, 6) and y.is_meta
        with FakeTensorMode():
            fake = GroupedMLP(4, [3], 2, heads=3)
            assert fake(torch.randn(5, 4)).shape == (5, 6)


@pytest.mark.parametrize("arg", ["activation", "output_activation"])
def test_an_activation_instance_instead_of_a_factory_is_refused(arg):
    with pytest.raises(BlockDiagError, match=rf"GroupedMLP: {arg} must be a factory that makes a module .* not a module instance \(Tanh\(\)\)"):
        GroupedMLP(4, 3, 2, heads=2, **{arg: nn.Tanh()})



@pytest.mark.parametrize("arg", ["activation", "output_activation"])
@pytest.mark.parametrize("make, says", [
    pytest.param("gelu", r"got 'gelu'", id="name"),
    pytest.param(torch.nn.functional.gelu, r"calling gelu\(\) raised TypeError", id="function"),
    pytest.param(lambda x: torch.tanh(x), r"calling <lambda>\(\) raised TypeError", id="lambda-of-the-input"),
])
def test_an_activation_that_is_not_a_factory_is_refused_by_name(arg, make, says):
    # What torch.nn.TransformerEncoderLayer takes as its activation (a name, F.gelu) is
    # not a factory; the error names the argument and the fix, not a TypeError inside torch.
    with pytest.raises(BlockDiagError, match=rf"GroupedMLP: {arg} must be a factory that makes a module.*{says}"):
        GroupedMLP(4, 3, 2, heads=2, **{arg: make})

def test_a_stateless_activation_of_ones_own_is_accepted():
    class Sin(nn.Module):
        def forward(self, x):
            return torch.sin(x)

    heads = nn.ModuleList(nn.Sequential(nn.Linear(6, 3), Sin(), nn.Linear(3, 2)) for _ in range(3)).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    torch.testing.assert_close(GroupedMLP.from_heads(heads)(x), torch.cat([h(x) for h in heads], -1))


# ---------------------------------------------------------------- persistence


def _switch_roundtrip(make, x, via):
    a = make("auto")
    want = a(x)
    if via == "state_dict":
        b = make("loop")
        buf = io.BytesIO()
        torch.save(a.state_dict(), buf)
        buf.seek(0)
        b.load_state_dict(torch.load(buf))
    else:
        b = pickle.loads(pickle.dumps(a))
        assert b.backend == "auto"
    b.backend = "dense"
    torch.testing.assert_close(b(x), want)
    b.backend = "bmm"
    torch.testing.assert_close(b(x), want)
    assert set(b.state_dict()) == set(a.state_dict())
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v)


@pytest.mark.parametrize("via", ["state_dict", "pickle"])
def test_grouped_linear_persistence_across_backends(via):
    _switch_roundtrip(lambda n: GroupedLinear(12, 8, groups=4, backend=n, dtype=torch.float64),
                      torch.randn(5, 12, dtype=torch.float64), via)


@pytest.mark.parametrize("via", ["state_dict", "pickle"])
def test_grouped_mlp_persistence_across_backends(via):
    _switch_roundtrip(lambda n: GroupedMLP(6, [5, 4], 2, heads=3, backend=n, dtype=torch.float64),
                      torch.randn(5, 6, dtype=torch.float64), via)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_copy_of_a_compiled_model_runs_its_own_weights(kind):
    # model.compile() stores a compiled wrapper of this instance's _call_impl; nn.Module's
    # __getstate__ drops it, GroupedMLP's own kept it: its deepcopy ran the original's weights
    # (a silently wrong result) and pickle / torch.save(model) failed.
    torch.manual_seed(0)
    if kind == "linear":
        model, x = GroupedLinear(12, 8, groups=4), torch.randn(5, 12)
    else:
        model, x = GroupedMLP(6, [5], 2, heads=3), torch.randn(5, 6)
    model.compile(backend="eager")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
        assert torch.equal(twin(x), torch.zeros(5, model.out_features * (3 if kind == "mlp" else 1)))
    back = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        torch.testing.assert_close(back(x), model(x))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_training_checkpoint_resumes_on_another_backend(kind):
    # torch.load's default (weights_only=True) must read the whole checkpoint: the model's
    # and the optimizer's state, saved under one backend and resumed under another.
    def make(backend):
        torch.manual_seed(0)
        if kind == "linear":
            return GroupedLinear(12, 8, groups=4, backend=backend, dtype=torch.float64)
        return GroupedMLP(6, [5], 2, heads=3, backend=backend, dtype=torch.float64)

    x = torch.randn(7, 12 if kind == "linear" else 6, dtype=torch.float64)

    def step(model, opt):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()

    a = make("bmm")
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    step(a, opt_a)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optimizer": opt_a.state_dict(), "step": 1}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    b = make("loop")
    b.load_state_dict(ckpt["model"])
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    opt_b.load_state_dict(ckpt["optimizer"])
    step(a, opt_a)
    step(b, opt_b)
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(w, v, msg=k)


def test_state_dict_is_backend_independent():
    a = GroupedLinear(12, 8, groups=4, backend="csr")
    b = copy.deepcopy(a)
    b.backend = "conv"
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}
    assert a.state_dict()["weight"].shape == (4, 2, 3)


def test_load_state_dict_wrong_shape_raises():
    layer = GroupedLinear(12, 8, groups=4)
    other = GroupedLinear(12, 8, groups=2).state_dict()
    with pytest.raises(RuntimeError, match=r"size mismatch for weight"):
        layer.load_state_dict(other)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_module_to_device_dtype(device, dtype):
    model = GroupedMLP(6, 4, 2, heads=3).to(device=device, dtype=dtype)
    y = model(torch.randn(2, 6, device=device, dtype=dtype))
    assert y.device.type == device and y.dtype == dtype
    x = torch.randn(2, 6, device=device, dtype=dtype)
    torch.testing.assert_close(model(x), torch.cat([h(x) for h in model.to_heads()], -1), **tolerances(dtype))


@pytest.mark.parametrize("backend", ["auto", "bmm", "loop"])
@pytest.mark.parametrize("strategy", ["auto", "layers"])
def test_grouped_mlp_empty_batch_and_mismatched_input(backend, strategy):
    model = GroupedMLP(6, [4, 3], 2, heads=5, backend=backend, strategy=strategy)
    x = torch.randn(0, 6, requires_grad=True)
    y = model(x)
    assert y.shape == (0, 10)
    y.sum().backward()
    assert x.grad.shape == (0, 6)
    with pytest.raises(BlockDiagError, match=r"^GroupedMLP: layers\[0\]\.weight is torch.float32 on cpu but the input is "
                       r"torch.float64 on cpu"):
        model(torch.randn(3, 6, dtype=torch.float64))


def test_from_linears_refuses_a_bias_in_another_dtype():
    # The copy into the grouped bias would cast it silently: not a lossless conversion.
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    b.bias.data = b.bias.data.double()
    with pytest.raises(BlockDiagError, match=r"linears\[1\]\.bias has dtype torch.float64 but linears\[0\]\.weight has dtype torch.float32"):
        GroupedLinear.from_linears([a, b])


@pytest.mark.parametrize("layer_dtype", [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")])
@pytest.mark.parametrize("name", ["auto", "loop", "bmm", "dense"])
def test_cpu_autocast_casts_as_linear_does(name, layer_dtype):
    """Under CPU autocast the output dtype is ``F.linear``'s: bfloat16 from float32, float64 kept."""
    layer = GroupedLinear(4 * 8, 4 * 6, groups=4, backend=name, dtype=layer_dtype)
    x = torch.randn(5, 4 * 8, dtype=layer_dtype)
    dense = torch.block_diag(*layer.weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        want = torch.nn.functional.linear(x, dense, layer.bias)
    assert y.dtype == want.dtype == (torch.bfloat16 if layer_dtype == torch.float32 else torch.float64)
    ref = reference_loop(x.double(), layer.weight.double(), layer.bias.double())
    torch.testing.assert_close(y.double(), ref, **tolerances(y.dtype, 8))
    y.float().square().sum().backward()
    assert layer.weight.grad.dtype == layer.bias.grad.dtype == layer_dtype


@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("call", ["layer", "functional"])
def test_cpu_autocast_over_a_backend_computing_in_float32_multiplies_the_unrounded_operands(call, amp_dtype):
    # simd computes the half dtypes in float32: under autocast it was handed operands cast
    # down, only to cast them up again (two passes over weight and input, and both rounded).
    # It now multiplies the float32 operands and rounds the result once: the weight gradient
    # is then the float32 product, not one of bfloat16-rounded inputs.
    require_backend("simd")
    gen = torch.Generator().manual_seed(3)
    layer = GroupedLinear(4 * 8, 4 * 6, groups=4, backend="simd")
    x = torch.randn(5, 4 * 8, generator=gen, requires_grad=True)
    gy = torch.randn(5, 4 * 6, generator=gen)
    with torch.autocast("cpu", dtype=amp_dtype), backend_spy() as ran:
        y = layer(x) if call == "layer" else grouped_linear(x, layer.weight, layer.bias, backend="simd")
    assert ran == ["simd"] and y.dtype == amp_dtype
    y.backward(gy.to(amp_dtype))
    w, b = layer.weight, layer.bias
    exact = reference_loop(x.double(), w.double(), b.double())
    eps = torch.finfo(amp_dtype).eps  # rounded once: within half a unit, plus float32's sums
    torch.testing.assert_close(y.double(), exact, rtol=eps, atol=1e-5)
    gx, gw, gb = torch.autograd.grad(reference_loop(x.double(), w.double(), b.double()), (x, w, b),
                                     gy.to(amp_dtype).double())
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.float32
    for got, want in ((x.grad, gx), (w.grad, gw), (b.grad, gb)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call", ["layer", "plan", "functional", "mlp"])
def test_cpu_autocast_over_a_named_float32_backend_says_autocast_cast_the_operands(call):
    # csr runs float32 and float64 only: under autocast the float32 model's operands were cast
    # to bfloat16 and the refusal named bfloat16 alone ("supports float32, float64"), a dtype
    # the model was never given.
    require_backend("csr")
    layer = GroupedLinear(4 * 8, 4 * 6, groups=4, backend="csr")
    mlp = GroupedMLP(8, [12], 2, heads=4, backend="csr", strategy="layers")
    x = torch.randn(5, 4 * 8)
    run = {"layer": lambda: layer(x), "plan": lambda: layer.plan(x), "mlp": lambda: mlp(x[:, :8]),
           "functional": lambda: grouped_linear(x, layer.weight, layer.bias, backend="csr")}[call]
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            BlockDiagError, match=r"backend 'csr' does not run bfloat16 on cpu, the dtype autocast cast the float32 "
                                  r"operands to.*enabled=False"):
        run()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert run() is not None  # outside autocast it runs


@pytest.mark.parametrize("name, shape", [("weight", (2, 4, 6)), ("bias", (4,))])
def test_a_parameter_replaced_by_another_shape_is_refused(name, shape):
    # The ops take the groups from the weight: a 2-group weight on a 4-group layer computed
    # 2 groups while the repr, to_linears and reset_parameters kept 4.
    layer = GroupedLinear(12, 8, groups=4)
    with pytest.raises(BlockDiagError, match=rf"GroupedLinear.{name}: the replacement has shape "
                                             rf"\({', '.join(map(str, shape))},?\)"):
        setattr(layer, name, nn.Parameter(torch.randn(shape)))
    same = nn.Parameter(torch.randn(tuple(getattr(layer, name).shape)))
    setattr(layer, name, same)  # the same shape (another dtype, a DTensor, ...) is the user's
    assert getattr(layer, name) is same


def test_a_parameter_of_another_shape_through_functional_call_is_named():
    # functional_call puts its tensors into the parameter dict, past __setattr__'s check: the
    # error blamed the input ("its last dimension must be in_features=10" on a 15-wide layer)
    # or the bias, and GroupedMLP's chain and heads raised torch's view errors naming nothing.
    layer = GroupedLinear(15, 12, groups=3)
    x = torch.randn(7, 15)
    params = {"weight": torch.randn(2, 4, 5), "bias": layer.bias.detach()}
    named = r"GroupedLinear: weight has shape \(2, 4, 5\), but the layer's weight has shape \(3, 4, 5\)"
    with pytest.raises(BlockDiagError, match=named):
        torch.func.functional_call(layer, params, (x,))
    with pytest.raises(BlockDiagError, match=named):  # through the op, under a transform
        torch.func.grad(lambda p: torch.func.functional_call(layer, p, (x,)).sum())(params)
    model = GroupedMLP(5, 4, 2, heads=3)
    p = {k: v.detach() for k, v in model.named_parameters()}
    p["layers.0.weight"] = p["layers.0.weight"][:, :-1]
    for strategy in ("auto", "layers", "heads"):
        model.strategy = strategy
        with pytest.raises(BlockDiagError, match=r"GroupedMLP: layers\[0\].weight has shape \(1, 11, 5\), "
                                                 r"but the layer's weight has shape \(1, 12, 5\)"):
            torch.func.functional_call(model, p, (torch.randn(6, 5),))


def test_a_layer_converts_under_swap_module_params_with_an_output_alive():
    # torch.__future__.set_swap_module_params_on_conversion(True): .double(), .to() and
    # load_state_dict swap each parameter, which torch refuses while a graph holds it. On an
    # input without gradient nn.Linear's graph does not; GroupedLinear's held its weight, so
    # converting after a forward failed with "Couldn't swap GroupedLinear.weight".
    layer, lin = GroupedLinear(6, 4, groups=2), nn.Linear(6, 4)
    x = torch.randn(3, 6)
    outputs = [layer(x), lin(x)]
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        lin.double()
        layer.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert layer.weight.dtype == lin.weight.dtype == torch.float64
    assert outputs[0].shape == (3, 4)


def test_grouped_mlp_backend_reads_its_layers():
    model = GroupedMLP(4, [3], 2, heads=2, backend="bmm")
    assert model.backend == "bmm"
    model.layers[1].backend = "loop"
    assert model.backend == "mixed" and "backend='mixed'" in repr(model)
    model.backend = "auto"
    assert model.backend == "auto" and {layer.backend for layer in model.layers} == {"auto"}


def test_from_heads_refuses_a_sequential_subclass_with_its_own_forward():
    # Converted silently: the grouped model computed the plain Sequential, not the head's forward.
    class Scaled(nn.Sequential):
        def forward(self, x):
            return super().forward(x) * 2.0

    heads = nn.ModuleList(Scaled(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2)) for _ in range(2))
    with pytest.raises(BlockDiagError, match=r"heads\[0\] is a Scaled, whose own forward is not nn.Sequential's"):
        GroupedMLP.from_heads(heads)

    class Plain(nn.Sequential):
        pass

    GroupedMLP.from_heads(nn.ModuleList(Plain(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2)) for _ in range(2)))


def test_conversions_refuse_tied_parameters():
    # A Linear shared by two heads (or one parameter tied between them) became two independent
    # copies, which then trained apart.
    lin = nn.Linear(3, 2)
    with pytest.raises(BlockDiagError, match=r"linears\[1\]\.weight is the same parameter as linears\[0\]\.weight"):
        GroupedLinear.from_linears([lin, lin])
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    b.bias = a.bias
    with pytest.raises(BlockDiagError, match=r"linears\[1\]\.bias is the same parameter as linears\[0\]\.bias"):
        GroupedLinear.from_linears([a, b])
    heads = _three_heads()
    heads[2][0] = heads[0][0]
    with pytest.raises(BlockDiagError, match=r"heads\[2\]\[0\]\.weight is the same parameter as heads\[0\]\[0\]\.weight"):
        GroupedMLP.from_heads(heads)
    masked = [blockdiag.mask_block_diagonal_(nn.Linear(4, 4), 2) for _ in range(3)]
    GroupedLinear.from_linears(masked)  # computed weights, distinct originals: not tied


@pytest.mark.parametrize("pname", ["weight", "bias"])
@pytest.mark.parametrize("how", ["data", "view"])
def test_conversions_refuse_parameters_over_shared_memory(pname, how):
    # Two distinct Parameters over one storage (nn.Parameter(a.weight.data), or a view of
    # it) are tied as a shared Parameter is, and became two independent copies.
    def tie(a, b):
        t = getattr(a, pname).data
        setattr(b, pname, nn.Parameter(t if how == "data" else t.view(t.shape)))

    a, b, c = nn.Linear(3, 2), nn.Linear(3, 2), nn.Linear(3, 2)
    tie(a, c)
    with pytest.raises(BlockDiagError, match=rf"linears\[2\]\.{pname} shares memory with linears\[0\]\.{pname}"):
        GroupedLinear.from_linears([a, b, c])
    heads = _three_heads()
    tie(heads[0][2], heads[1][2])
    with pytest.raises(BlockDiagError, match=rf"heads\[1\]\[2\]\.{pname} shares memory with heads\[0\]\[2\]\.{pname}"):
        GroupedMLP.from_heads(heads)


def test_conversions_take_parameters_on_one_storage_that_share_no_byte():
    # Slices of one buffer (as FSDP and flat-parameter optimizers keep them), rows or
    # interleaved columns, are separate memory: not tied.
    flat = torch.randn(2, 2, 4)
    lins = [nn.Linear(4, 2, bias=False) for _ in range(2)]
    for k, lin in enumerate(lins):
        lin.weight = nn.Parameter(flat[k])  # rows: disjoint spans
    assert torch.equal(GroupedLinear.from_linears(lins).weight, flat)
    wide = torch.randn(2, 8)
    for k, lin in enumerate(lins):
        lin.weight = nn.Parameter(wide[:, k::2])  # interleaved columns: the spans intersect
    assert torch.equal(GroupedLinear.from_linears(lins).weight[1], wide[:, 1::2])
    lins[1].weight = nn.Parameter(wide[:, 1:5])  # now reads wide[:, 2] and wide[:, 4] too
    with pytest.raises(BlockDiagError, match=r"linears\[1\]\.weight shares memory with linears\[0\]\.weight"):
        GroupedLinear.from_linears(lins)
    meta = [nn.Linear(3, 2, device="meta") for _ in range(2)]
    GroupedLinear.from_linears(meta)  # no memory: distinct Parameters are distinct


def test_from_heads_names_a_missing_bias_as_such():
    heads = _three_heads()
    heads[1][0] = nn.Linear(heads[0][0].in_features, heads[0][0].out_features, bias=False)
    with pytest.raises(BlockDiagError, match=r"heads\[1\]\[0\] is Linear with weight \(\d+, \d+\) bias=False"):
        GroupedMLP.from_heads(heads)


def test_from_heads_refuses_linears_that_do_not_chain():
    # A raw RuntimeError from a reshape ("shape '[2, 2, 4]' is invalid for input of size 20").
    heads = [nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(5, 2)) for _ in range(2)]
    with pytest.raises(BlockDiagError, match=r"heads\[0\]\[2\] takes 5 inputs .* but heads\[0\]\[0\] gives 4"):
        GroupedMLP.from_heads(heads)


def test_conversions_refuse_a_forward_replaced_on_the_instance():
    # Converted silently: __call__ runs an instance's own forward (monkeypatched, or a
    # wrapper such as accelerate's hooks), and the grouped module computed the class's.
    lins = [nn.Linear(4, 3) for _ in range(2)]
    for lin in lins:
        lin.forward = lambda x, lin=lin: 2 * nn.Linear.forward(lin, x)
    with pytest.raises(BlockDiagError, match=r"linears\[0\] has its forward replaced on the instance"):
        GroupedLinear.from_linears(lins)
    with pytest.raises(BlockDiagError, match=r"heads\[0\]\[0\] has its forward replaced on the instance"):
        GroupedMLP.from_heads([nn.Sequential(lin, nn.ReLU(), nn.Linear(3, 1)) for lin in lins])
    heads = [nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)) for _ in range(2)]
    heads[1].forward = lambda x: 10 * nn.Sequential.forward(heads[1], x)
    with pytest.raises(BlockDiagError, match=r"heads\[1\] has its forward replaced on the instance"):
        GroupedMLP.from_heads(heads)


def test_conversions_refuse_a_call_of_their_own():
    # Converted silently: module(x) runs type(module).__call__, then _call_impl; a class
    # overriding either (or a _call_impl set on the instance) decides what the loop computes,
    # and the grouped module computed the plain product.
    class Clamped(nn.Linear):
        def __call__(self, x):
            return super().__call__(x).clamp(-0.1, 0.1)

    class Scaled(nn.Linear):
        def _call_impl(self, *args, **kwargs):
            return 3 * super()._call_impl(*args, **kwargs)

    for cls in (Clamped, Scaled):
        lins = [cls(4, 3) for _ in range(2)]
        with pytest.raises(BlockDiagError, match=rf"linears\[0\] is a {cls.__name__}, which overrides"):
            GroupedLinear.from_linears(lins)
        with pytest.raises(BlockDiagError, match=rf"heads\[0\]\[0\] is a {cls.__name__}, which overrides"):
            GroupedMLP.from_heads([nn.Sequential(lin, nn.ReLU(), nn.Linear(3, 1)) for lin in lins])
    lins = [nn.Linear(4, 3) for _ in range(2)]
    lins[1]._call_impl = lambda x: 2 * nn.Linear._call_impl(lins[1], x)
    with pytest.raises(BlockDiagError, match=r"linears\[1\] has its _call_impl replaced on the instance"):
        GroupedLinear.from_linears(lins)

    class Doubled(nn.Sequential):
        def __call__(self, x):
            return 2 * super().__call__(x)

    heads = [Doubled(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1)) for _ in range(2)]
    with pytest.raises(BlockDiagError, match=r"heads\[0\] is a Doubled, which overrides __call__"):
        GroupedMLP.from_heads(heads)
    # A plain subclass, a masked Linear (its class made by parametrize) and a head compiled
    # in place (Module.compile) run nn.Module's call: they still convert.
    plain = [type("Plain", (nn.Linear,), {})(4, 3) for _ in range(2)]
    GroupedLinear.from_linears(plain)
    GroupedLinear.from_linears([blockdiag.mask_block_diagonal_(nn.Linear(4, 4), 2) for _ in range(2)])
    heads = [nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1)) for _ in range(2)]
    heads[0].compile()
    x = torch.randn(5, 4)
    model = GroupedMLP.from_heads(heads)
    assert torch.allclose(model(x), torch.cat([nn.Sequential.forward(h, x) for h in heads], -1), atol=1e-6)


def test_conversions_refuse_a_weight_computed_from_other_tensors():
    # Converted silently: a head whose weight is computed from a trained tensor (a hypernetwork's
    # output, a view or a multiple of one shared matrix) trains that tensor, which ties the heads
    # through it; the converted module made each a leaf copy, and after a step the two differed.
    shared = nn.Parameter(torch.randn(3, 4))
    lins = [nn.Linear(4, 3) for _ in range(2)]
    for k, lin in enumerate(lins):
        del lin.weight
        lin.weight = shared * (k + 1)
    with pytest.raises(BlockDiagError, match=r"linears\[0\] has weight \(grad_fn=MulBackward0\) computed"):
        GroupedLinear.from_linears(lins)
    with pytest.raises(BlockDiagError, match=r"heads\[0\]\[0\] has weight \(grad_fn=MulBackward0\) computed"):
        GroupedMLP.from_heads([nn.Sequential(lin, nn.ReLU(), nn.Linear(3, 1)) for lin in lins])
    stacked = nn.Parameter(torch.randn(6))
    for k, lin in enumerate(lins):
        lin.weight = nn.Parameter(torch.randn(3, 4))
        del lin.bias
        lin.bias = stacked[3 * k:3 * k + 3]
    with pytest.raises(BlockDiagError, match=r"linears\[0\] has bias \(grad_fn=\w+\) computed"):
        GroupedLinear.from_linears(lins)
    # Computed under no_grad the value trains nothing: a frozen copy, as before. Parametrized
    # weights (computed as well) convert as the weight they compute now.
    with torch.no_grad():
        for lin in lins:
            lin.bias = stacked[:3] * 2
    layer = GroupedLinear.from_linears(lins)
    assert not layer.bias.requires_grad and torch.equal(layer.bias[:3], stacked[:3].detach() * 2)
    normed = [nn.utils.parametrizations.weight_norm(nn.Linear(4, 3)) for _ in range(2)]
    assert torch.equal(GroupedLinear.from_linears(normed).weight[1], normed[1].weight.detach())


@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_conversions_refuse_gradient_hooks_on_parameters(hook):
    # Converted silently: the grouped module's new parameters ran no hook, so a head whose
    # weight gradient a hook zeroed (or clipped) trained as the others did.
    fn = (lambda g: torch.zeros_like(g)) if hook == "register_hook" else (lambda p: None)
    lins = [nn.Linear(4, 3) for _ in range(2)]
    handle = getattr(lins[1].bias, hook)(fn)
    with pytest.raises(BlockDiagError, match=r"linears\[1\] has gradient hooks on bias"):
        GroupedLinear.from_linears(lins)
    with pytest.raises(BlockDiagError, match=r"heads\[1\]\[0\] has gradient hooks on bias"):
        GroupedMLP.from_heads([nn.Sequential(lin, nn.ReLU(), nn.Linear(3, 1)) for lin in lins])
    handle.remove()  # a removed hook leaves an empty dict behind: accepted
    GroupedLinear.from_linears(lins)
    masked = blockdiag.mask_block_diagonal_(nn.Linear(4, 4), 2)
    getattr(masked.parametrizations.weight.original, hook)(fn)
    with pytest.raises(BlockDiagError, match=r"has gradient hooks on parametrizations.weight.original"):
        GroupedLinear.from_linears([masked])


def test_from_heads_refuses_linears_of_mixed_dtypes_or_devices():
    # Converted silently: the model took heads[0][0]'s dtype and device, and the copies cast a
    # float32 output layer (or a float64 bias) to bfloat16, or dropped a layer's weights onto meta.
    def heads(spoil):
        hs = [nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)) for _ in range(2)]
        for h in hs:
            spoil(h)
        return hs

    with pytest.raises(BlockDiagError, match=r"heads\[0\]\[2\].weight has dtype torch.float32 but heads\[0\]\[0\].weight "
                                             r"has dtype torch.bfloat16"):
        GroupedMLP.from_heads(heads(lambda h: h[0].bfloat16()))
    with pytest.raises(BlockDiagError, match=r"heads\[0\]\[2\].weight is on cpu but heads\[0\]\[0\].weight is on meta"):
        GroupedMLP.from_heads(heads(lambda h: h[0].to("meta")))

    def double_bias(h):
        h[2].bias.data = h[2].bias.data.double()

    with pytest.raises(BlockDiagError, match=r"heads\[0\]\[2\].bias has dtype torch.float64 but heads\[0\]\[0\].weight"):
        GroupedMLP.from_heads(heads(double_bias))
    assert GroupedMLP.from_heads(heads(lambda h: h.double())).layers[1].bias.dtype == torch.float64


def test_conversions_refuse_tied_weight_norm_linears():
    # weight_norm keeps two originals (original0, original1) and no `original`: a Linear
    # shared by two heads under it, without a bias to give the tie away, was converted into
    # independent copies.
    from torch.nn.utils.parametrizations import weight_norm

    lin = weight_norm(nn.Linear(4, 3, bias=False))
    with pytest.raises(BlockDiagError, match=r"linears\[1\]\.parametrizations\.weight\.original0 is the same "
                                             r"parameter as linears\[0\]\.parametrizations\.weight\.original0"):
        GroupedLinear.from_linears([lin, lin])
    head = nn.Sequential(weight_norm(nn.Linear(4, 3, bias=False)), nn.ReLU(), nn.Linear(3, 2, bias=False))
    with pytest.raises(BlockDiagError, match=r"heads\[1\]\[0\]\.parametrizations\.weight\.original0 is the same"):
        GroupedMLP.from_heads([head, head])
    GroupedLinear.from_linears([weight_norm(nn.Linear(4, 3, bias=False)) for _ in range(2)])  # not tied



@pytest.mark.parametrize("amp", [False, True], ids=["float32", "autocast"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("name", ["auto", "bmm", "simd"])
def test_a_parametrized_weight_and_bias_are_computed_once_per_forward(name, grad, amp):
    # forward read self.weight / self.bias again after _autocast (to compare, then for
    # _run_cast): a parametrization ran three times per forward where nn.Linear runs it once,
    # so spectral_norm advanced its power iteration three times and every parametrization
    # cost three times. The product must also use the one value computed (simd under
    # autocast multiplies the float32 operands as they were read).
    require_backend(name)
    from torch.nn.utils import parametrize

    class Recorded(nn.Module):
        def __init__(self):
            super().__init__()
            self.values = []

        def forward(self, w):
            self.values.append(w * (1.0 + torch.rand(()).item()))  # another value on every call
            return self.values[-1]

    layer = GroupedLinear(8, 6, 2, backend=name)
    rw, rb = Recorded(), Recorded()
    parametrize.register_parametrization(layer, "weight", rw)
    parametrize.register_parametrization(layer, "bias", rb)
    rw.values.clear()
    rb.values.clear()
    x = torch.randn(5, 8)
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        y = layer(x)
        want = grouped_linear(x, rw.values[0].detach(), rb.values[0].detach(), backend=name)
    assert (len(rw.values), len(rb.values)) == (1, 1)
    assert y.dtype == want.dtype
    torch.testing.assert_close(y.detach(), want)

def test_to_linears_and_to_heads_read_a_parametrized_weight_once():
    # Read per group, a parametrization that changes on every read (spectral_norm's power
    # iteration in training mode) gave each head another matrix's block.
    from torch.nn.utils import parametrize

    class Drifting(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, w):
            self.calls += 1
            return w * self.calls

    layer = GroupedLinear(8, 6, 2)
    d = Drifting()
    parametrize.register_parametrization(layer, "weight", d)
    d.calls = 0
    heads = layer.to_linears()
    assert d.calls == 1
    assert torch.equal(torch.stack([h.weight for h in heads]), layer.parametrizations.weight.original)

    model = GroupedMLP(4, [3], 2, heads=3)
    d = Drifting()
    parametrize.register_parametrization(model.layers[0], "weight", d)
    d.calls = 0
    heads = model.to_heads()
    assert d.calls == 1
    w = model.layers[0].parametrizations.weight.original.reshape(3, 3, 4)
    assert all(torch.equal(head[0].weight, w[h]) for h, head in enumerate(heads))


def test_to_heads_gives_named_heads_back_under_their_names():
    # The round trip numbered the modules: the loop's checkpoint keys (0.fc1.weight) and
    # attributes (head.fc1) no longer fitted the heads to_heads gave back.
    from collections import OrderedDict

    heads = nn.ModuleList(nn.Sequential(OrderedDict(
        fc1=nn.Linear(5, 4), act=nn.ReLU(), drop=nn.Dropout(0.0), out=nn.Linear(4, 2), squash=nn.Tanh()))
        for _ in range(3))
    model = GroupedMLP.from_heads(heads)
    back = copy.deepcopy(pickle.loads(pickle.dumps(model))).to_heads()
    assert list(back[0]._modules) == ["fc1", "act", "drop", "out", "squash"]
    heads.load_state_dict(back.state_dict())  # strict: the same keys
    x = torch.randn(6, 5)
    torch.testing.assert_close(torch.cat([h(x) for h in back], -1), model(x))
    assert list(GroupedMLP.from_heads(_three_heads()).to_heads()[0]._modules) == ["0", "1", "2"]
    # As many modules again, the Linears elsewhere: the names no longer fit, the heads are numbered
    # (the second Linear was "drop", the output Tanh "out").
    model.activations[0] = nn.GELU()
    model.output_activation = nn.Sequential(nn.Tanh(), nn.Identity())
    assert [type(m) for m in model.to_heads()[0]] == [nn.Linear, nn.GELU, nn.Linear, nn.Tanh, nn.Identity]
    assert list(model.to_heads()[0]._modules) == ["0", "1", "2", "3", "4"]


def test_fx_symbolic_trace_records_the_products_and_runs_as_the_modules():
    # torch.fx.symbolic_trace (torchvision's feature extraction, FX graph passes) calls forward
    # with Proxies: every layer raised "input must be a torch.Tensor, got Proxy", which the
    # caller never passed. The product is now recorded as a grouped_linear call.
    import torch.fx as fx

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 4, 2, dtype=torch.float64))
            self.layer = GroupedLinear(12, 6, groups=3, bias=False, dtype=torch.float64)
            self.mlp = GroupedMLP(6, [5], 2, heads=3, output_activation=nn.Tanh, dtype=torch.float64)

        def forward(self, x):
            return self.mlp(self.layer(grouped_linear(x, self.w, backend="bmm")))

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    for root in (model, model.layer, model.mlp):
        traced = fx.symbolic_trace(root)
        assert any(n.target is grouped_linear for n in traced.graph.nodes)
    traced = fx.symbolic_trace(model)
    y, yt = model(x), traced(x)
    torch.testing.assert_close(yt, y)
    got = torch.autograd.grad(yt.sum(), [x, *traced.parameters()])
    want = torch.autograd.grad(y.sum(), [x, *model.parameters()])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # cast when the traced module runs
        traced = fx.symbolic_trace(GroupedLinear(6, 4, groups=2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert traced(torch.randn(3, 6)).dtype == torch.bfloat16


# Optimizers that step each entry on its own train a GroupedLinear as they train the heads it
# replaces (the FAQ's promise): fused, foreach and single-tensor implementations, decoupled and
# L2 weight decay, maximize, a tensor learning rate, a scheduler, clipping and accumulation.
_PER_ENTRY_OPTIMIZERS = {
    "sgd-fused-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True,
                                                       weight_decay=0.01, fused=True),
    "adam-fused-wd-tensor-lr": lambda p: torch.optim.Adam(p, lr=torch.tensor(0.01), weight_decay=0.1, fused=True),
    "adamw-foreach-amsgrad-maximize": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, amsgrad=True,
                                                                  maximize=True, foreach=True),
    "rmsprop-centered-single-tensor": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True,
                                                                    weight_decay=0.1, foreach=False),
    "adagrad-fused": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, weight_decay=0.1, fused=True),
}


def _train_pair(layer, make_optimizer, steps=3, step_fn=None):
    """Train ``layer`` and the heads it replaces alike; return both weights and biases."""
    heads = layer.to_linears()
    g, i = layer.groups, layer.block_in
    loop = lambda x: torch.cat([h(x[:, k * i:(k + 1) * i]) for k, h in enumerate(heads)], -1)
    torch.manual_seed(1)
    xs = [torch.randn(6, g * i) for _ in range(steps)]
    for params, forward, fn in ((layer.parameters(), layer, step_fn), (heads.parameters(), loop, None)):
        params = list(params)
        opt = make_optimizer(params)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

        def step(x, opt=opt, forward=forward, params=params):
            for half in (x[:3], x[3:]):  # two micro-batches accumulated into one step
                forward(half).square().sum().backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=False)

        run = step if fn is None else fn(step)
        for x in xs:
            run(x)
            sched.step()
    return (layer.weight, layer.bias), (torch.stack([h.weight for h in heads]), torch.cat([h.bias for h in heads]))


@pytest.mark.parametrize("opt", list(_PER_ENTRY_OPTIMIZERS))
@pytest.mark.parametrize("name", ["auto"] + FIXED)
def test_per_entry_optimizers_train_the_layer_as_its_heads(name, opt):
    require_backend(name)
    if name != "auto" and not _runnable(name, dtype=torch.float32):
        pytest.skip(f"{name} does not train float32 here")
    torch.manual_seed(0)
    got, want = _train_pair(GroupedLinear(12, 15, groups=3, backend=name), _PER_ENTRY_OPTIMIZERS[opt])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["compiled-step", "compiled-autograd"])
def test_a_compiled_training_step_trains_the_layer_as_its_heads(mode):
    # The compiled-optimizer recipe (forward, backward and step in one compiled function) and
    # compiled autograd tracing the backward.
    torch._dynamo.reset()
    torch.manual_seed(0)
    make = _PER_ENTRY_OPTIMIZERS["adamw-foreach-amsgrad-maximize"]

    def compiled(step):
        fn = torch.compile(step, backend="aot_eager")  # tiny: inductor's codegen adds only time
        if mode == "compiled-step":
            return fn

        def run(x):
            with torch._dynamo.config.patch(compiled_autograd=True):
                fn(x)
        return run

    got, want = _train_pair(GroupedLinear(12, 15, groups=3, backend="bmm"), make, step_fn=compiled)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
