"""``GroupedMLP``'s strategies: the layers run as modules (hooks, pruning, parametrizations), the
fused feature-major chain only where nothing observes the layers and the table says it is faster.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize, prune
from torch.utils.checkpoint import checkpoint

import blockdiag
from blockdiag import BlockDiagError, GroupedMLP
from blockdiag.dispatch import Candidate, Plan
from blockdiag.nn.mlp import activations as mlp_activations
from blockdiag.nn.mlp import strategy as mlp_mod
from blockdiag.nn.linear import GroupedLinear

F64 = dict(rtol=1e-12, atol=1e-12)


def _model(strategy="auto", backend="auto", shared=True, bias=True, hidden=(5, 4), heads=3, dtype=torch.float64):
    torch.manual_seed(0)
    return GroupedMLP(6, list(hidden), 2, heads=heads, bias=bias, shared_input=shared, backend=backend,
                      strategy=strategy, dtype=dtype)


def _x(model, *lead, requires_grad=False):
    n_in = model.in_features * (1 if model.shared_input else model.heads)
    return torch.randn(*lead, n_in, dtype=model.layers[0].weight.dtype, requires_grad=requires_grad)


def _spy(monkeypatch, method: str) -> list:
    """A list that gets the input's shape each time ``GroupedMLP.<method>`` runs."""
    calls = []
    inner = getattr(GroupedMLP, method)

    def spy(self, x):
        calls.append(x.shape)
        return inner(self, x)

    monkeypatch.setattr(GroupedMLP, method, spy)
    return calls


@pytest.fixture
def chain_spy(monkeypatch):
    """Counts the calls of the fused chain."""
    return _spy(monkeypatch, "_forward_feature_major")


@pytest.fixture
def heads_spy(monkeypatch):
    """Counts the calls of the head-by-head strategy."""
    return _spy(monkeypatch, "_forward_heads")


# ---------------------------------------------------------------- the layers are called


@pytest.mark.parametrize("backend", ["auto", "bmm"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_layer_hooks_fire_forward_and_backward(backend, k, table_prefers_chain):
    model = _model(backend=backend)
    seen = []
    layer = model.layers[k]
    handles = [
        layer.register_forward_pre_hook(lambda m, args: seen.append("pre")),
        layer.register_forward_hook(lambda m, args, out: seen.append(("fwd", tuple(out.shape)))),
        layer.register_full_backward_hook(lambda m, gin, gout: seen.append(("bwd", tuple(gout[0].shape)))),
    ]
    x = _x(model, 7, requires_grad=True)
    y = model(x)
    out = model.layers[k].out_features
    assert seen == ["pre", ("fwd", (7, out))]
    y.sum().backward()
    assert seen[-1] == ("bwd", (7, out))
    assert model.plan(x).strategy == "layers"
    # Forcing the chain or the heads would skip the hooks: refused, with the reason.
    model.strategy = "heads"
    with pytest.raises(BlockDiagError, match=rf"strategy='heads' cannot run: layers\[{k}\] has forward or backward "
                                             r"hooks .* and the heads strategy never calls the layer"):
        model(x)
    model.strategy = "fm_chain"
    with pytest.raises(BlockDiagError, match=rf"strategy='fm_chain' cannot run: layers\[{k}\] has forward or backward hooks"):
        model(x)
    for h in handles:
        h.remove()
    # Without the hooks the chain runs again (the check is made on every call, not cached).
    assert model(x).shape == y.shape


def test_hook_added_after_the_chain_was_chosen_takes_effect_at_once(chain_spy, table_prefers_chain):
    model = _model()
    x = _x(model, 4)
    model(x)
    assert len(chain_spy) == 1  # chosen, and the decision is now cached
    seen = []
    h = model.layers[1].register_forward_hook(lambda *a: seen.append(1))
    model(x)
    assert seen == [1] and len(chain_spy) == 1
    h.remove()
    model(x)
    assert len(chain_spy) == 2


def _train_step_against_heads(model, x, target):
    """One step: the model's gradients (through the pruning) equal the loop of heads'."""
    y = model(x)
    heads = model.to_heads()  # the effective weights (prune recomputes them in the forward), as plain heads
    yr = torch.cat([h(x) for h in heads], -1)
    torch.testing.assert_close(y, yr, **F64)
    ((y - target) ** 2).mean().backward()
    ((yr - target) ** 2).mean().backward()
    return heads


@pytest.mark.parametrize("backend", ["auto", "bmm"])
def test_pruned_layer_trains_with_the_heads_gradients(backend):
    model = _model(backend=backend)
    prune.l1_unstructured(model.layers[1], "weight", amount=0.4)
    layer = model.layers[1]
    mask = layer.weight_mask
    assert 0 < int((mask == 0).sum()) < mask.numel()
    x, target = _x(model, 8), torch.randn(8, model.heads * model.out_features, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # the old chain failed on the second step: "backward through the graph a second time"
        opt.zero_grad()
        heads = _train_step_against_heads(model, x, target)
        g, o, i = layer.weight.shape
        ref = torch.stack([h[2].weight.grad for h in heads]).reshape(g, o, i)
        torch.testing.assert_close(layer.weight_orig.grad, ref * mask, **F64)
        for k in (0, 2):
            lk = model.layers[k]
            ref_w = torch.stack([h[2 * k].weight.grad for h in heads]).reshape(lk.weight.shape)
            torch.testing.assert_close(lk.weight.grad, ref_w, **F64)
            torch.testing.assert_close(lk.bias.grad, torch.cat([h[2 * k].bias.grad for h in heads]), **F64)
        opt.step()
    assert torch.all(layer.weight[mask == 0] == 0)


def test_old_weight_norm_trains():
    model = _model(dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the old weight_norm
        torch.nn.utils.weight_norm(model.layers[0], dim=0)
    x, target = _x(model, 16), torch.randn(16, model.heads * model.out_features)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = ((model(x) - target) ** 2).mean()
        loss.backward()
        assert model.layers[0].weight_g.grad is not None and model.layers[0].weight_v.grad is not None
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert model.plan(x).strategy == "layers"


def test_parametrized_layer_runs_its_parametrization(chain_spy, table_prefers_chain):
    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    model = _model()
    x = _x(model, 5)
    want = model(x)
    parametrize.register_parametrization(model.layers[2], "weight", Double())
    got = model(x)
    assert len(chain_spy) == 1  # only the first call ran the chain
    b = model.layers[2].bias
    torch.testing.assert_close(got, 2 * (want - b) + b, **F64)


# ---------------------------------------------------------------- the two strategies agree


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "split"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("hidden", [(5, 4), (), (3,)], ids=["2hidden", "nohidden", "1hidden"])
@pytest.mark.parametrize("strategy", ["fm_chain", "heads"])
def test_strategies_agree_with_the_layers(strategy, shared, bias, hidden, chain_spy, heads_spy):
    a = _model(strategy, shared=shared, bias=bias, hidden=hidden)
    b = _model("layers", shared=shared, bias=bias, hidden=hidden)
    b.load_state_dict(a.state_dict())
    x = _x(a, 2, 7)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = a(xa), b(xb)
    assert (len(chain_spy), len(heads_spy)) == ((1, 0) if strategy == "fm_chain" else (0, 1))
    torch.testing.assert_close(ya, yb, **F64)
    r = torch.randn_like(ya)
    (ya * r).sum().backward()
    (yb * r).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, **F64)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, **F64)


ACTIVATIONS = [
    pytest.param(nn.ReLU, id="relu"), pytest.param(lambda: nn.LeakyReLU(0.3), id="leaky"),
    pytest.param(nn.SiLU, id="silu"), pytest.param(nn.Tanh, id="tanh"), pytest.param(nn.Sigmoid, id="sigmoid"),
    pytest.param(nn.GELU, id="gelu-not-in-place"),
    pytest.param(lambda: nn.Sequential(nn.ReLU(), nn.Dropout(0.0), nn.Tanh()), id="relu-dropout-tanh"),
]


def _against_the_layers(strategy, activation, mode):
    """A float64 GroupedMLP of ``strategy``, the same with ``strategy="layers"`` and an input,
    frozen or requiring grad as ``mode`` ("no_grad", "frozen", "train") says."""
    torch.manual_seed(0)
    a = GroupedMLP(6, [5, 4], 2, heads=3, activation=activation, strategy=strategy, dtype=torch.float64)
    b = GroupedMLP(6, [5, 4], 2, heads=3, activation=activation, strategy="layers", dtype=torch.float64)
    b.load_state_dict(a.state_dict())
    if mode == "frozen":
        a.requires_grad_(False)
        b.requires_grad_(False)
    return a, b, _x(a, 7, requires_grad=mode == "train")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("mode", ["no_grad", "frozen", "train"])
@pytest.mark.parametrize("strategy", ["fm_chain", "heads"])
def test_in_place_activations_agree_with_the_layers(strategy, activation, mode, chain_spy, heads_spy, monkeypatch):
    # Where nothing differentiates the call, the chain (or each head) applies an activation
    # with an in-place form on its own hidden tensor; the result is the layers' in every
    # case, the caller's input is untouched, and training (which needs the activation's
    # input) is unchanged.
    a, b, x = _against_the_layers(strategy, activation, mode)
    x0 = x.detach().clone()
    called = []  # one entry per call of an in-place form
    for cls, make in list(mlp_activations._IN_PLACE.items()):
        monkeypatch.setitem(mlp_activations._IN_PLACE, cls,
                            lambda m, make=make: lambda h, f=make(m): called.append(1) or f(h))
    with torch.set_grad_enabled(mode != "no_grad"):
        ya, yb = a(x), b(x)
    assert chain_spy if strategy == "fm_chain" else heads_spy, f"{strategy} did not run"
    in_place = mode != "train" and type(a.activations[0]) is not nn.GELU
    assert bool(called) == in_place, (mode, len(called))
    torch.testing.assert_close(ya, yb, **F64)
    torch.testing.assert_close(x.detach(), x0, rtol=0, atol=0)
    if mode == "train":
        r = torch.randn_like(ya)
        ga = torch.autograd.grad((ya * r).sum(), [x, *a.parameters()])
        gb = torch.autograd.grad((yb * r).sum(), [x, *b.parameters()])
        for u, v in zip(ga, gb):
            torch.testing.assert_close(u, v, **F64)


def _doubling(act):
    """``act`` with its forward replaced on the instance by one that doubles its input (a monkeypatch)."""
    act.forward = lambda h: h * 2
    return act


REPLACED_FORWARDS = [
    pytest.param(lambda: _doubling(nn.ReLU()), id="relu"),
    pytest.param(lambda: _doubling(nn.Sequential(nn.ReLU(), nn.Tanh())), id="sequential"),
    pytest.param(lambda: nn.Sequential(_doubling(nn.Tanh()), nn.ReLU()), id="step-of-sequential"),
]


@pytest.mark.parametrize("activation", REPLACED_FORWARDS)
@pytest.mark.parametrize("mode", ["no_grad", "frozen", "train"])
@pytest.mark.parametrize("strategy", ["fm_chain", "heads", "auto"])
def test_an_activation_with_its_forward_replaced_runs_that_forward(strategy, activation, mode):
    # __call__ runs a forward set on the instance; the in-place form stands for the class's
    # forward, so such an activation must run as the module on every path.
    a, b, x = _against_the_layers(strategy, activation, mode)
    with torch.set_grad_enabled(mode != "no_grad"):
        torch.testing.assert_close(a(x), b(x), **F64)


def test_a_sequential_activation_is_in_place_only_after_torch_nn_steps():
    # A step of the caller's own may return a tensor it keeps: the step after it must not
    # overwrite that tensor; after a torch.nn step (here Identity, which returns its
    # input) the tensor is the chain's own and may be overwritten.
    from blockdiag.nn.mlp.activations import _in_place

    class Kept(nn.Module):
        def __init__(self):
            super().__init__()
            self.kept = torch.full((2, 3), -1.0)

        def forward(self, h):
            return self.kept

    kept = Kept()
    out = _in_place(nn.Sequential(kept, nn.ReLU()))(torch.randn(2, 3))
    assert torch.equal(kept.kept, torch.full((2, 3), -1.0)) and torch.equal(out, torch.zeros(2, 3))
    h = torch.full((2, 3), -2.0)
    assert _in_place(nn.Sequential(nn.Identity(), nn.ReLU()))(h) is h and torch.equal(h, torch.zeros(2, 3))
    # A torch.nn step whose forward is replaced on the instance is the caller's code too.
    held = torch.full((2, 3), -1.0)
    step = nn.Identity()
    step.forward = lambda h: held
    out = _in_place(nn.Sequential(step, nn.ReLU()))(torch.randn(2, 3))
    assert torch.equal(held, torch.full((2, 3), -1.0)) and torch.equal(out, torch.zeros(2, 3))


class _Recorder(nn.Module):
    """GELU, keeping its output (as a module logging activation statistics would)."""

    def forward(self, h):
        self.last = nn.functional.gelu(h)
        return self.last


@pytest.mark.parametrize("activation", [
    pytest.param(lambda: nn.Sequential(nn.Sequential(_Recorder()), nn.ReLU()), id="nested"),
    pytest.param(lambda: nn.Sequential(_Recorder(), nn.Identity(), nn.ReLU()), id="behind-identity"),
    pytest.param(lambda: nn.Sequential(_Recorder(), nn.Dropout(0.5), nn.ReLU()), id="behind-dropout"),
])
@pytest.mark.parametrize("strategy", ["fm_chain", "heads"])
def test_a_tensor_a_step_keeps_is_not_overwritten_further_on(strategy, activation):
    # The step after a caller's module was not made in place, but one further on was when a
    # torch.nn step between passed the kept tensor on, or when the module sat in a nested
    # Sequential: the ReLU zeroed the negative entries of the tensor the module kept
    # (Dropout in eval mode returns its input).
    torch.manual_seed(0)
    model = GroupedMLP(6, [5], 2, heads=3, activation=activation, strategy=strategy, dtype=torch.float64).eval()
    rec = next(m for m in model.modules() if isinstance(m, _Recorder))
    x = _x(model, 16)
    with torch.no_grad():
        y = model(x)
        kept = rec.last.clone()
        model.strategy = "layers"
        torch.testing.assert_close(y, model(x), **F64)
    assert kept.min() < 0  # GELU's output, not the ReLU's


@pytest.mark.parametrize("strategy", ["fm_chain", "heads"])
def test_a_strategy_runs_an_empty_batch_and_refuses_a_mismatched_input(strategy):
    model = _model(strategy)
    x = _x(model, 0, requires_grad=True)
    y = model(x)
    assert y.shape == (0, 6)
    y.sum().backward()
    assert x.grad.shape == (0, 6)
    with pytest.raises(BlockDiagError, match=rf"strategy='{strategy}' cannot run: layers\[0\]\.weight is torch.float64 on cpu but the input is torch.float32") as e:
        model(torch.randn(3, 6))
    # The layers (and auto) refuse that input too, so the advice is the cast, not another strategy.
    assert "use strategy=" not in str(e.value) and "pass it as torch.float64 on cpu" in str(e.value)
    model.strategy = "layers"
    # In the model's name, not the first layer's ("GroupedLinear: weight has dtype ...").
    with pytest.raises(BlockDiagError, match=r"^GroupedMLP: layers\[0\]\.weight is torch.float64 on cpu but the input "
                       r"is torch.float32 on cpu; .*pass it as torch.float64 on cpu"):
        model(torch.randn(3, 6))


@pytest.mark.parametrize("strategy", ["auto", "layers", "fm_chain", "heads"])
def test_layers_of_different_dtypes_are_named_with_the_conversion(strategy):
    # load_state_dict(assign=True) keeps a checkpoint's dtypes: a checkpoint whose last layer
    # was saved in bfloat16 made a model no strategy runs. The layers failed in a GroupedLinear's
    # name ("weight has dtype ... cast them to one dtype"), a forced chain or heads advised the
    # layers, which fail alike.
    model = _model(strategy, dtype=torch.float32)
    sd = {k: (v.bfloat16() if k.startswith("layers.1.") else v) for k, v in model.state_dict().items()}
    model.load_state_dict(sd, assign=True)
    x = _x(model, 3).float()
    want = (r"layers\[1\]\.weight is torch.bfloat16 on cpu but layers\[0\]\.weight is torch.float32 on cpu, "
            r"and no strategy converts between layers .*convert the model \(model.to\(torch.float32\)\)")
    forced = f"strategy='{strategy}' cannot run: " if strategy in ("fm_chain", "heads") else ""
    with pytest.raises(BlockDiagError, match=r"^GroupedMLP: " + forced + want) as e:
        model(x)
    assert "use strategy=" not in str(e.value)
    with pytest.raises(BlockDiagError, match=r"^GroupedMLP.plan: " + want):
        model.plan(x)
    # Autocast casts every layer's operands: such a model runs there, as before.
    if strategy in ("auto", "layers"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(x).dtype == torch.bfloat16 and model.plan(x).strategy == "layers"
    model.to(torch.float32)
    assert model(x).shape == (3, 6)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("strategy", ["auto", "layers", "fm_chain", "heads"])
def test_a_model_built_under_fake_tensor_mode_runs_every_strategy(strategy, shared, chain_spy, heads_spy):
    # A model built under FakeTensorMode (shape and memory estimation) holds FakeTensor
    # parameters. The layers and auto ran it; a forced fm_chain or heads refused it as "not a
    # plain tensor parameter (a DTensor of group parallelism or FSDP2, or another subclass)".
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        model = _model(strategy, shared=shared)
        assert type(model.layers[0].weight) is FakeTensor
        x = _x(model, 2, 5, requires_grad=True)
        y = model(x)
        y.sum().backward()
        with torch.no_grad():
            assert model(_x(model, 7)).shape == (7, 6)
    assert type(y) is FakeTensor and y.shape == (2, 5, 6) and x.grad.shape == x.shape
    assert all(p.grad.shape == p.shape for p in model.parameters())
    if strategy in ("fm_chain", "heads"):
        assert (chain_spy if strategy == "fm_chain" else heads_spy) == [(2, 5, 6 if shared else 18), (7, 6 if shared else 18)]


@pytest.mark.parametrize("strategy", ["auto", "layers", "fm_chain", "heads"])
@pytest.mark.parametrize("left", ["layers.2.weight", "layers.2.bias", "layers.1.weight"])
def test_a_layer_left_on_meta_is_refused_not_run(strategy, left):
    # The meta-device flow with a checkpoint that lacks a layer (load_state_dict(assign=True,
    # strict=False)) leaves that layer on meta. torch's products take a meta operand beside CPU
    # ones and return a CPU tensor of uninitialised memory (or a meta one): the chain and the
    # heads ran silently, and so did auto where it had chosen the chain before.
    trained = _model(dtype=torch.float32)
    x = _x(trained, 5)
    with torch.device("meta"):
        model = _model(strategy, dtype=torch.float32)
    if strategy == "auto":  # the decision for x cached while every layer was real
        model.load_state_dict(trained.state_dict(), assign=True)
        model(x)
        model.layers[int(left.split(".")[1])]._parameters[left.split(".")[2]] = nn.Parameter(
            torch.empty_like(trained.get_parameter(left), device="meta"))
    else:
        sd = {k: v for k, v in trained.state_dict().items() if k != left}
        model.load_state_dict(sd, assign=True, strict=False)
    assert model.get_parameter(left).is_meta
    forced = f"strategy='{strategy}' cannot run: " if strategy in ("fm_chain", "heads") else ""
    want = (rf"^GroupedMLP: {forced}{re.escape(left.replace('layers.', 'layers[').replace('.', '].', 1))} is "
            r"torch.float32 on meta but layers\[0\]\.weight is torch.float32 on cpu, .*materialise it "
            r"\(model.to_empty\(device='cpu'\), then load_state_dict or reset_parameters\)")
    with pytest.raises(BlockDiagError, match=want):
        model(x)
    with torch.no_grad(), pytest.raises(BlockDiagError, match=want):
        model(x)
    model.load_state_dict(trained.state_dict(), assign=True)
    torch.testing.assert_close(model(x), trained(x))


def test_strategy_setting():
    model = _model()
    assert model.strategy == "auto" and "strategy='auto'" in repr(model)
    model.strategy = "layers"
    assert model.strategy == "layers"
    with pytest.raises(BlockDiagError, match=r"GroupedMLP.strategy: unknown strategy 'fast'; valid strategies are 'auto', 'layers', 'fm_chain', 'heads'"):
        model.strategy = "fast"
    with pytest.raises(BlockDiagError, match="unknown strategy"):
        GroupedMLP(4, 3, 2, heads=2, strategy="bmm")
    heads = model.to_heads()
    assert GroupedMLP.from_heads(heads, strategy="fm_chain").strategy == "fm_chain"


# ---------------------------------------------------------------- auto: allowed, then measured


class _Sub(torch.Tensor):
    pass


def _blockers():
    """(id, how to set the model and input up) for every case where auto must run the layers."""

    def hook(kind, k):
        def setup(model, x):
            layer = model.layers[k]
            {
                "fwd": lambda: layer.register_forward_hook(lambda *a: None),
                "pre": lambda: layer.register_forward_pre_hook(lambda *a: None),
                "bwd": lambda: layer.register_full_backward_hook(lambda *a: None),
                "bwd_pre": lambda: layer.register_full_backward_pre_hook(lambda *a: None),
                "act": lambda: model.activations[0].register_forward_hook(lambda *a: None),
            }[kind]()
            return x

        return setup

    def prune_(model, x):
        prune.random_unstructured(model.layers[1], "weight", amount=0.5)
        return x

    def param_(model, x):
        parametrize.register_parametrization(model.layers[0], "weight", nn.Identity())
        return x

    def subclass(model, x):
        model.layers[2].weight = nn.Parameter(model.layers[2].weight.detach().as_subclass(_Sub))
        return x

    def backend(model, x):
        model.layers[1].backend = "bmm"
        return x

    return [
        pytest.param(hook("fwd", 0), id="forward-hook"),
        pytest.param(hook("pre", 2), id="forward-pre-hook"),
        pytest.param(hook("bwd", 1), id="backward-hook"),
        pytest.param(hook("bwd_pre", 0), id="backward-pre-hook"),
        pytest.param(hook("act", 0), id="activation-hook"),
        pytest.param(prune_, id="pruned"),
        pytest.param(param_, id="parametrized"),
        pytest.param(subclass, id="tensor-subclass-parameter"),
        pytest.param(backend, id="a-named-backend"),
        pytest.param(lambda model, x: x.float(), id="input-dtype"),
        pytest.param(lambda model, x: x[:0], id="empty-batch"),
    ]


def test_auto_runs_the_chain_when_allowed_and_measured_faster(chain_spy, table_prefers_chain):
    model = _model()
    x = _x(model, 4)
    assert model.plan(x).strategy == "fm_chain"
    model(x)
    assert len(chain_spy) == 1


@pytest.mark.parametrize("setup", _blockers())
def test_auto_runs_the_layers_where_the_chain_is_not_allowed(setup, chain_spy, table_prefers_chain):
    model = _model()
    x = setup(model, _x(model, 4))
    plan_ok = True
    try:
        plan = model.plan(x)
    except BlockDiagError:  # the mismatched input: the layers path says what is wrong
        plan_ok = False
    if plan_ok:
        assert plan.strategy == "layers" and plan.reason.startswith("the chain is not allowed here")
        model(x)
    else:
        with pytest.raises(BlockDiagError, match="dtype"):
            model(x)
    assert chain_spy == []


def test_auto_runs_the_layers_under_a_global_hook_autocast_and_torch_func(chain_spy, table_prefers_chain):
    model = _model(dtype=torch.float32)
    x = _x(model, 4)
    h = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert "global module hook" in model.plan(x).reason
        model(x)
    finally:
        h.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "autocast" in model.plan(x).reason
        assert model(x).dtype == torch.bfloat16
        # An input already in autocast's dtype is what the layers cast to: planned as it runs,
        # not refused as of another dtype than the (float32) parameters.
        xb = x.to(torch.bfloat16)
        assert "autocast" in model.plan(xb).reason
        assert model(xb).dtype == torch.bfloat16
    params = dict(model.named_parameters())
    torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).sum())(params)
    assert chain_spy == []
    model(x)
    assert len(chain_spy) == 1


def test_forward_ad_and_the_chain_agree():
    # forward AD: the layers route through blockdiag's ops; the chain through torch's.
    import torch.autograd.forward_ad as fwad

    a, b = _model("fm_chain"), _model("layers")
    x, t = _x(a, 3), _x(a, 3)
    outs = []
    for m in (a, b):
        with fwad.dual_level():
            outs.append(fwad.unpack_dual(m(fwad.make_dual(x, t))).tangent)
    torch.testing.assert_close(outs[0], outs[1], **F64)


def _fake_plans(monkeypatch, own_us, fm_us, fm_ok=True):
    """Each layer's plan says: its backend ('bmm') takes own_us[k], bmm_fm takes fm_us[k]."""
    calls = iter(range(10**6))

    def plan(self, x):
        k = next(calls) % len(own_us)
        prob = blockdiag.Problem(8, self.groups, self.block_in, self.block_out)
        cands = (Candidate("bmm", True, own_us[k], "chosen"), Candidate("bmm_fm", fm_ok, fm_us[k], "test"))
        return Plan("bmm", prob, "test", "test table", cands)

    monkeypatch.setattr(GroupedLinear, "plan", plan)


@pytest.mark.parametrize(
    "own, fm, ok, want, says",
    [
        ([10.0, 5.0, 1.0], [9.0, 5.0, 1.0], True, "fm_chain", "sum to 0.94x the layers'"),
        ([10.0, 5.0, 1.0], [10.0, 5.0, 1.0], True, "fm_chain", "sum to 1.00x the layers'"),  # a tie: the chain
        # Within CHAIN_ADVANTAGE (1.1): the chain's savings are in no table, so it is credited them.
        ([10.0, 5.0, 1.0], [11.0, 5.0, 1.0], True, "fm_chain", "sum to 1.06x the layers'"),
        ([10.0, 5.0, 1.0], [12.0, 5.0, 1.0], True, "layers", "measured 1.12x faster than fm_chain"),
        ([10.0, 5.0, 1.0], [9.0, None, 1.0], True, "layers", "no estimate for fm_chain"),
        ([10.0, None, 1.0], [9.0, 5.0, 1.0], True, "layers", "no estimate for layers"),
        ([10.0, 5.0, 1.0], [1.0, 1.0, 1.0], False, "layers", "no estimate for fm_chain"),  # bmm_fm declines
    ],
)
def test_auto_follows_the_measured_sums(monkeypatch, chain_spy, own, fm, ok, want, says):
    # The sums decide on a device where the strategies were never timed whole.
    monkeypatch.setattr(mlp_mod, "CHAIN_WHEREVER_ALLOWED", frozenset())
    _fake_plans(monkeypatch, own, fm, ok)
    model = _model(shared=False)  # every layer grouped: a one-group layer is left out of both sums
    x = _x(model, 4)
    plan = model.plan(x)
    assert plan.strategy == want and says in plan.reason
    assert plan.chain_us == (None if None in fm or not ok else sum(fm))
    model(x)
    assert len(chain_spy) == (want == "fm_chain")


def test_the_decision_is_cached_per_shape_and_settings(monkeypatch):
    model = _model()
    asked = []
    inner = GroupedMLP._measured_choice

    def counting(self, x):
        asked.append(tuple(x.shape))
        return inner(self, x)

    monkeypatch.setattr(GroupedMLP, "_measured_choice", counting)
    x = _x(model, 4)
    for _ in range(3):
        model(x)
    assert asked == [(4, 6)]
    model(_x(model, 5))
    with torch.no_grad():  # another grad mode: another decision
        model(x)
    assert asked == [(4, 6), (5, 6), (4, 6)]
    with blockdiag.config(dense_max_groups=3):  # other chooser settings: decided again
        model(x)
    assert len(asked) == 4


# ---------------------------------------------------------------- the plan


def test_plan_explains_itself():
    model = _model()
    x = _x(model, 64)
    plan = model.plan(x)
    text = str(plan)
    assert plan.strategy in ("fm_chain", "layers") and plan.requested == "auto"
    assert f"runs:    {plan.strategy}" in text and plan.reason in text
    assert "estimates from the measured table: fm_chain" in text
    assert len(plan.layers) == 3 and all(isinstance(p, Plan) for p in plan.layers)
    for k in range(3):
        assert f"layers[{k}]" in text
    assert text.count("Plan for batch=64") == 3
    assert plan.layers[1].problem.groups == 3 and plan.layers[0].problem.groups == 1
    assert plan.layers[0].problem.requires_grad  # the parameters require grad
    with torch.no_grad():
        assert not model.plan(x).layers[2].problem.requires_grad
    model.strategy = "layers"
    assert model.plan(x).reason == "fixed by the user (strategy='layers')"
    model.strategy = "fm_chain"
    p = model.plan(x)
    assert p.strategy == "fm_chain" and "not used: the chain runs instead" in str(p)
    model.strategy = "heads"
    p = model.plan(x)
    assert p.strategy == "heads" and p.reason == "fixed by the user (strategy='heads')"
    assert "not used: the heads run instead" in str(p)
    model.activations[0].register_forward_hook(lambda *a: None)
    with pytest.raises(BlockDiagError, match=r"strategy='heads' cannot run: activations\[0\] has hooks, which would "
                                             r"see one head's \[batch, hidden\] at a time"):
        model.plan(x)
    model.strategy = "fm_chain"
    with pytest.raises(BlockDiagError, match=r"strategy='fm_chain' cannot run: activations\[0\] has hooks, which "
                                             r"would see the chain's feature-major"):
        model.plan(x)
    model.layers[0].register_forward_hook(lambda *a: None)
    with pytest.raises(BlockDiagError, match=r"GroupedMLP.plan: strategy='fm_chain' cannot run: layers\[0\] has forward"):
        model.plan(x)
    with pytest.raises(BlockDiagError, match=r"last dimension must be 6"):
        model.plan(torch.randn(3, 5))


# ---------------------------------------------------------------- activations (issue 22, item 9)


def test_a_subclass_of_a_torch_nn_module_that_is_not_elementwise_is_refused():
    class MySoftmax(nn.Softmax):
        pass

    class MyDropout2d(nn.Dropout2d):
        pass

    for cls, base in ((MySoftmax, "Softmax"), (MyDropout2d, "Dropout2d")):
        heads = nn.ModuleList(nn.Sequential(nn.Linear(6, 3), cls(dim=-1) if cls is MySoftmax else cls(), nn.Linear(3, 2))
                              for _ in range(3))
        with pytest.raises(BlockDiagError, match=rf"heads\[0\]\[1\] is {cls.__name__}.*not element-wise \(it derives from torch.nn.{base}\)"):
            GroupedMLP.from_heads(heads)
        with pytest.raises(BlockDiagError, match=rf"activation\(\) after hidden layer 0 is {cls.__name__}.*derives from torch.nn.{base}"):
            GroupedMLP(6, 3, 2, heads=3, activation=cls)


def test_a_subclass_of_an_elementwise_module_is_accepted():
    class MyReLU(nn.ReLU):
        pass

    class MyReLU6(nn.ReLU6):  # ReLU6 derives from Hardtanh, also element-wise
        pass

    for cls in (MyReLU, MyReLU6):
        heads = nn.ModuleList(nn.Sequential(nn.Linear(6, 3), cls(), nn.Linear(3, 2)) for _ in range(3)).double()
        x = torch.randn(5, 6, dtype=torch.float64)
        torch.testing.assert_close(GroupedMLP.from_heads(heads)(x), torch.cat([h(x) for h in heads], -1))
    assert mlp_activations._not_elementwise_base(nn.Dropout()) is None


# ---------------------------------------------------------------- FSDP2, one shard per layer

_FSDP_SCRIPT = r"""
import copy, sys, warnings
import torch, torch.distributed as dist
import blockdiag
warnings.simplefilter("ignore", UserWarning)  # FSDP2's note on view outputs
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
ref = blockdiag.GroupedMLP(6, [5, 4], 2, heads=3, dtype=torch.float64)
model = copy.deepcopy(ref)
for layer in model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
x = torch.randn(7, 6, dtype=torch.float64)
y, yr = model(x), ref(x)
torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
y.sum().backward()
yr.sum().backward()
for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
    torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-12, atol=1e-12, msg=name)
dist.destroy_process_group()
print("ok")
"""


def test_fsdp2_fully_shard_per_layer(tmp_path):
    import subprocess
    import sys

    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    script = tmp_path / "fsdp2.py"
    script.write_text(_FSDP_SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]


def test_on_cpu_the_chain_runs_whatever_the_sums_say(monkeypatch, chain_spy):
    # The whole models were timed on CPU (scripts/bench_mlp_strategy.py): the chain won, so
    # per-layer sums that favour the layers tenfold do not decide there.
    _fake_plans(monkeypatch, [1.0, 1.0, 1.0], [10.0, 10.0, 10.0])
    model = _model(shared=False)
    x = _x(model, 4)
    plan = model.plan(x)
    assert plan.strategy == "fm_chain" and "faster than the layers, or level" in plan.reason
    assert (plan.chain_us, plan.layers_us) == (30.0, 3.0)
    model(x)
    assert len(chain_spy) == 1


def test_on_cpu_the_sums_still_need_bmm_fm(monkeypatch, chain_spy):
    _fake_plans(monkeypatch, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], fm_ok=False)
    model = _model(shared=False)
    x = _x(model, 4)
    assert model.plan(x).strategy == "layers"
    model(x)
    assert chain_spy == []


@pytest.mark.parametrize("batch", [64, 1024])
@pytest.mark.parametrize("train", [False, True], ids=["forward", "train"])
def test_the_forum_model_runs_the_chain_on_cpu(batch, train):
    # The built-in table's per-layer sums favour the layers here, and the layers ran slower than
    # the chain (docs/results/mlp-strategy-cpu.json): the regression the asv history showed.
    torch.manual_seed(0)
    model = GroupedMLP(150, [10, 10], 1, heads=50)
    x = torch.randn(batch, 150)
    with torch.set_grad_enabled(train):
        plan = model.plan(x)
    assert plan.strategy == "fm_chain", str(plan)
    assert plan.layers[0].backend == "dense"  # the shared first layer: one group, one plain GEMM


def _one_grouped_layer(heads=50, block=10):
    torch.manual_seed(0)
    return GroupedMLP(block, [block], block, heads=heads)  # shared input: dense, then one grouped layer


@pytest.mark.parametrize("own, train", [
    pytest.param("table", False, id="forward"),
    pytest.param("table", True, id="train"),
    # The grouped layer's backend as the table picks it at other shapes, in training (bmm_fm_bmm
    # does not run without autograd: it is ranked as bmm_fm there).
    pytest.param("bmm_fm_bmm", True, id="train-bmm_fm_bmm"),
    pytest.param("simd", True, id="train-simd"),
])
def test_on_cpu_one_grouped_layer_in_training_runs_the_layers(own, train, monkeypatch, chain_spy):
    # The whole-model timings (docs/results/mlp-strategy-cpu*.json): with one grouped layer
    # the chain only swaps that layer's backend for bmm_fm, which was slower in training
    # whatever the backend (a bmm_fm variant too: 256x256 blocks); in the forward it was
    # faster or level.
    model = _one_grouped_layer()
    if own != "table":
        times = {c.name: c.estimate_us for c in model.layers[1].plan(torch.empty(256, 500, requires_grad=train)).candidates}
        if times.get(own) is None:
            # The built-in table at this machine's thread count may hold another simd variant's
            # times (1 thread on an AVX-512 AMD EPYC: avx2 only): no estimate to compare.
            pytest.skip(f"the table in use has no {own} time at this shape on this machine")
        inner = GroupedLinear.plan

        def plan(self, x):
            p = inner(self, x)
            return p if self.groups == 1 else Plan(own, p.problem, "test", "test table", p.candidates)

        monkeypatch.setattr(GroupedLinear, "plan", plan)
    x = torch.randn(256, 10, requires_grad=train)
    layer_backend = model.layers[1].plan(torch.empty(256, 500, requires_grad=train)).backend
    with torch.set_grad_enabled(train):
        plan = model.plan(x)
        model(x)
    assert plan.strategy == ("layers" if train else "fm_chain"), str(plan)
    assert bool(chain_spy) == (not train)
    if train:
        assert f"one grouped layer, in training: with no layout change between grouped layers to save, " \
               f"the chain would only replace its backend ({layer_backend})" in plan.reason


def test_a_one_group_layer_is_left_out_of_both_sums(monkeypatch):
    # The shared first layer is one plain GEMM whichever strategy runs it.
    monkeypatch.setattr(mlp_mod, "CHAIN_WHEREVER_ALLOWED", frozenset())
    _fake_plans(monkeypatch, [100.0, 5.0, 1.0], [1.0, 5.0, 1.0])
    model = _model(shared=True)
    plan = model.plan(_x(model, 4))
    assert (plan.chain_us, plan.layers_us) == (6.0, 6.0)


# ---------------------------------------------------------------- eager auto and the heads


@pytest.mark.parametrize("rule, rows, grad, want", [
    pytest.param((8, 3, 7), 7, True, "heads", id="at-every-bound"),
    pytest.param((9, 3, 7), 7, True, "fm_chain", id="smaller-block"),
    pytest.param((8, 4, 7), 7, True, "fm_chain", id="fewer-heads"),
    pytest.param((8, 3, 8), 7, True, "fm_chain", id="fewer-rows"),
    pytest.param((8, 3, 7), 7, False, "fm_chain", id="inference"),
])
def test_eager_auto_runs_the_heads_where_the_rule_says(rule, rows, grad, want, monkeypatch, chain_spy, heads_spy):
    # _model's grouped blocks are 5x4 and 4x2 (the smallest: 8 elements), with 3 heads. The
    # table is told to prefer the chain, so whatever is not the heads is the chain.
    monkeypatch.setattr(mlp_mod, "EAGER_HEADS_RULE", rule)
    monkeypatch.setattr(GroupedMLP, "_measured_choice", lambda self, x: (True, "test", 1.0, 2.0, self._layer_plans(x)))
    model, ref = _model(), _model("layers")
    x = _x(model, rows)
    with torch.set_grad_enabled(grad):
        assert model.plan(x).strategy == want
        y = model(x)
        assert (len(heads_spy), len(chain_spy)) == ((1, 0) if want == "heads" else (0, 1))
        torch.testing.assert_close(y, ref(x), **F64)
    if want == "heads":
        assert "EAGER_HEADS_RULE" in model.plan(x).reason
        model.activations[0].register_forward_hook(lambda *a: None)  # not allowed any more: the layers
        heads_spy.clear()
        model(x)
        assert not heads_spy and model.plan(x).strategy == "layers"


@pytest.mark.parametrize("limit, rows, grad, want", [
    pytest.param((840, 8, 7), 7, True, "heads", id="at-every-bound"),
    pytest.param((841, 8, 7), 7, True, "fm_chain", id="smaller-hidden"),
    pytest.param((840, 9, 7), 7, True, "fm_chain", id="smaller-block"),
    pytest.param((840, 8, 8), 7, True, "fm_chain", id="fewer-rows"),
    pytest.param((840, 8, 7), 7, False, "fm_chain", id="inference"),
])
def test_eager_auto_runs_the_heads_where_the_hidden_layer_is_large(limit, rows, grad, want, monkeypatch, chain_spy, heads_spy):
    # _model's widest hidden layer is 3 heads x 5 units, 7 rows of float64: 840 bytes; its
    # smallest grouped block has 8 elements. EAGER_HEADS_RULE is out of reach here.
    monkeypatch.setattr(mlp_mod, "EAGER_HEADS_RULE", (10**9, 1, 1))
    monkeypatch.setattr(mlp_mod, "HEADS_MIN_HIDDEN_BYTES", limit)
    monkeypatch.setattr(GroupedMLP, "_measured_choice", lambda self, x: (True, "test", 1.0, 2.0, self._layer_plans(x)))
    model, ref = _model(), _model("layers")
    x = _x(model, rows)
    with torch.set_grad_enabled(grad):
        plan = model.plan(x)
        assert plan.strategy == want
        y = model(x)
        assert (len(heads_spy), len(chain_spy)) == ((1, 0) if want == "heads" else (0, 1))
        torch.testing.assert_close(y, ref(x), **F64)
    if want == "heads":
        assert "HEADS_MIN_HIDDEN_BYTES" in plan.reason and "840 bytes" in plan.reason


def test_eager_auto_sizes_the_hidden_layers_not_the_output(monkeypatch, chain_spy, heads_spy):
    # The output is made whatever runs; the heads save only the hidden layers' tensors. Here
    # the widest hidden layer (3 heads x 5 units, 7 rows of float64) is 840 bytes, under
    # the limit, and the output (3 x 40) far over it: the chain, not the heads.
    monkeypatch.setattr(mlp_mod, "EAGER_HEADS_RULE", (10**9, 1, 1))
    monkeypatch.setattr(mlp_mod, "HEADS_MIN_HIDDEN_BYTES", (841, 8, 7))
    monkeypatch.setattr(GroupedMLP, "_measured_choice", lambda self, x: (True, "test", 1.0, 2.0, self._layer_plans(x)))
    torch.manual_seed(0)
    model = GroupedMLP(6, [5, 4], 40, heads=3, dtype=torch.float64)
    x = _x(model, 7)
    assert model.plan(x).strategy == "fm_chain"
    model(x)
    assert (len(heads_spy), len(chain_spy)) == (0, 1)


def test_eager_auto_runs_the_heads_at_the_compiled_benchs_large_point():
    # bench --compiled's mlp point of 2048 rows, 256 heads of 64x64, float32: each layer-wise
    # tensor of the hidden width is 128 MiB, a fresh mmap faulted in on every step, where
    # the heads make one (the output), as the loop of nn.Linear heads does.
    model = GroupedMLP(64, [64], 64, heads=256)
    assert model.plan(torch.empty(2048, 64)).strategy == "heads"
    assert model.plan(torch.empty(256, 64)).strategy != "heads"  # 16 MiB


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_half_dtype_without_its_table_runs_the_layers_that_compute_in_float32(dtype, monkeypatch, chain_spy,
                                                                                heads_spy):
    # The layers' simd computes the half dtype in float32 (UPCAST_RULE); the chain and the
    # heads would run torch's half kernels, which the float32 table does not describe (on a
    # CPU without half arithmetic the forum model ran the chain 7x slower than the layers).
    monkeypatch.setattr(mlp_mod, "half_upcast", lambda device, dtype: True)
    monkeypatch.setattr(mlp_mod, "EAGER_HEADS_RULE", (1, 1, 1))  # the heads would pay by shape
    torch.manual_seed(0)
    model = GroupedMLP(6, [5, 4], 2, heads=3, dtype=dtype)
    ref = GroupedMLP(6, [5, 4], 2, heads=3, dtype=torch.float64, strategy="layers")
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    x = torch.randn(7, 6, dtype=dtype)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            assert model.plan(x).strategy == "layers"
            torch.testing.assert_close(model(x).double(), ref(x.double()), atol=3e-2, rtol=3e-2)
    assert not chain_spy and not heads_spy
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled(x).float().sum().backward()
    assert not chain_spy and not heads_spy


def test_the_built_in_table_runs_a_bf16_mlp_on_cpu_in_the_layers():
    from blockdiag.backends import get

    if get("simd").unavailable_reason() is not None:
        pytest.skip(f"simd is unavailable here: {get('simd').unavailable_reason()}")
    model = GroupedMLP(150, [10, 10], 1, heads=50, dtype=torch.bfloat16)
    plan = model.plan(torch.empty(256, 150, dtype=torch.bfloat16))
    assert plan.strategy == "layers" and "UPCAST_RULE" in plan.reason, str(plan)
    assert all(p.backend == "simd" for p in plan.layers), str(plan)
    assert GroupedMLP(150, [10, 10], 1, heads=50).plan(torch.empty(256, 150)).strategy == "fm_chain"

@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16])
def test_compiled_chain_under_cpu_autocast_trains_as_eager(amp_dtype):
    # The traced chain's last product is blockdiag::fm_rows (block_out 32 pays the row write),
    # which autocast does not cast: it got the autocast-dtype hidden units and the float32
    # weight ("mat1 and mat2 must have the same dtype").
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GroupedMLP(16, 32, 32, heads=4, strategy="fm_chain")
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=amp_dtype):
        want = model(x)
        got = torch.compile(model)(x)
    assert got.dtype == want.dtype == amp_dtype
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    got.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def _relu_dropout():
    return nn.Sequential(nn.ReLU(), nn.Dropout())


@pytest.mark.parametrize("act, compiled", [(_relu_dropout, False), (nn.RReLU, False), (_relu_dropout, True)],
                         ids=["dropout", "rrelu", "dropout-compiled"])
def test_reentrant_checkpoint_recomputes_the_random_activation_it_ran(act, compiled):
    # The forward of a reentrant checkpoint runs under no_grad and is recomputed with grad:
    # auto's strategy (whose layout the random numbers are drawn in) must not follow the
    # grad mode, or the gradients are of another mask than the output returned. RReLU alone:
    # after a ReLU it would see no negative input and draw nothing that shows.
    torch.manual_seed(0)
    model = GroupedMLP(8, 16, 4, heads=4, activation=act)
    run = model
    if compiled:
        torch._dynamo.reset()
        run = torch.compile(model)
    x = torch.randn(32, 8, requires_grad=True)
    torch.manual_seed(1)
    y = checkpoint(run, x, use_reentrant=True)
    gy = torch.randn_like(y)
    y.backward(gy)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.manual_seed(1)
    want_y = run(x)
    want_y.backward(gy)
    torch.testing.assert_close(y, want_y)
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    with torch.inference_mode():
        model(torch.randn(32, 8))  # deciding as in training runs under inference mode too


def test_plan_under_no_grad_with_a_random_activation_shows_the_layer_plans_that_run():
    # Under no_grad with a Dropout in training, auto decides its strategy as in training (the
    # mask is drawn in the strategy's layout), but where that is the layers, each layer runs
    # its own no_grad plan: plan() reported the training plans the decision compared (another
    # backend than the one that ran, where the table ranks the two modes apart).
    model = GroupedMLP(8, 16, 4, heads=4, activation=_relu_dropout)
    ran = []  # each layer's plan for the input it gets, as its forward plans it
    for layer in model.layers:  # hooked layers: auto runs the layers
        layer.register_forward_pre_hook(lambda mod, args: ran.append(mod.plan(args[0])))
    x = torch.randn(32, 8)
    with torch.no_grad():
        plan = model.plan(x)
        model(x)
    assert plan.strategy == "layers"
    assert [p.problem for p in plan.layers] == [p.problem for p in ran]
    assert [p.backend for p in plan.layers] == [p.backend for p in ran]
    assert not any(p.problem.requires_grad for p in plan.layers)


def test_plan_under_no_grad_and_saved_tensor_hooks_with_a_random_activation(chain_spy, heads_spy):
    # Saved-tensor hooks rule the chain and the heads out only where autograd records: under
    # no_grad the forward decides from the table (as in training, for the Dropout), but plan()
    # decided in training's grad mode and named the hooks and the layers, which did not run.
    model = GroupedMLP(8, [16, 16], 2, heads=50, shared_input=False, activation=_relu_dropout)
    x = torch.randn(64, 8 * 50)
    with torch.no_grad(), torch.autograd.graph.save_on_cpu():
        plan = model.plan(x)
        model(x)
    ran = "fm_chain" if chain_spy else "heads" if heads_spy else "layers"
    assert plan.strategy == ran, plan.reason
    assert "saved-tensor hooks" not in plan.reason


@pytest.mark.parametrize("how", ["layers", "auto-hooked", "layers-planned", "fx-planned"])
def test_reentrant_checkpoint_draws_the_dropout_mask_of_the_returned_forward(how, monkeypatch):
    # The layers strategy under a reentrant checkpoint: each layer's auto plan follows the
    # grad mode, and with it its output's layout (bmm_fm's feature-major view under no_grad,
    # simd's rows with grad here), in which Dropout draws its mask: the recomputation dropped
    # other units than the output returned, and the gradients were of that other forward.
    # "planned": auto's plans made to differ so on any machine (the table's choice decides
    # whether the others do here); "fx": the model as torch.fx.symbolic_trace records it.
    if how.endswith("-planned"):
        from blockdiag.nn import linear

        real = linear.plan_for
        monkeypatch.setattr(linear, "plan_for", lambda backend, p, fn: real(
            ("bmm" if p.requires_grad else "bmm_fm") if backend == "auto" else backend, p, fn))
    torch.manual_seed(0)
    model = GroupedMLP(5, [6, 7], 7, heads=4, activation=_relu_dropout,
                       strategy="auto" if how.startswith("fx") else how.split("-")[0])
    if how == "auto-hooked":
        model.layers[1].register_forward_hook(lambda *args: None)  # auto then runs the layers
    run = torch.fx.symbolic_trace(model) if how.startswith("fx") else model
    x = torch.randn(32, 5, requires_grad=True)
    h = torch.empty(32, model.layers[1].in_features)
    with torch.no_grad():
        inference = model.layers[1](h).is_contiguous()
    if inference == model.layers[1](h).is_contiguous():
        pytest.skip("here the layer's plans give one output layout with and without grad")
    torch.manual_seed(1)
    y = checkpoint(run, x, use_reentrant=True)
    gy = torch.randn_like(y)
    y.backward(gy)
    got = x.grad.clone()
    x.grad = None
    torch.manual_seed(1)
    want_y = run(x)
    want_y.backward(gy)
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(got, x.grad)


@pytest.mark.parametrize("observed", ["forward", "backward"])
def test_non_reentrant_checkpoint_with_flop_counter_around_one_pass(observed):
    # checkpoint(use_reentrant=False) matches the tensors the forward saved with those its
    # recomputation saves. FlopCounterMode registers global module hooks, which made auto
    # run the layers in the pass it observed and the chain in the other: CheckpointError.
    from torch.utils.flop_counter import FlopCounterMode

    model = GroupedMLP(8, [16, 16], 4, heads=4)
    x = torch.randn(32, 8, requires_grad=True)
    with FlopCounterMode(display=False) if observed == "forward" else torch.enable_grad():
        y = checkpoint(model, x, use_reentrant=False)
    with FlopCounterMode(display=False) if observed == "backward" else torch.enable_grad():
        y.square().sum().backward()  # (autograd.grad under FlopCounterMode is torch's refusal)
    got = [t.grad for t in (x, *model.parameters())]
    want = torch.autograd.grad(model(x).square().sum(), (x, *model.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert model.plan(x).strategy == "layers"
        assert "saved-tensor hooks" in model.plan(x).reason
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert "saved-tensor hooks" not in model.plan(x).reason  # nothing is saved or recomputed


def test_one_input_per_head_runs_the_layers_and_says_why():
    # Each head reads one scalar: the layer's plan is ONE_INPUT_RULE's (simd first on CPU),
    # which the chain would replace by bmm_fm's GEMM at k = 1.
    model = GroupedMLP(1, [64], 4, heads=16, shared_input=False)
    plan = model.plan(torch.empty(256, 16))
    assert plan.layers[0].reason == blockdiag.dispatch.ONE_INPUT_RULE
    assert plan.strategy == "layers" and "one input per head" in plan.reason, str(plan)


class _ShiftedLayer(GroupedLinear):
    """A layer with a forward of its own (an adapter's), which only calling the layer runs."""

    def forward(self, x):
        return super().forward(x) + 1.0


def _with_own_forward(model, how):
    if how == "subclass":
        layer = _ShiftedLayer(model.layers[1].in_features, model.layers[1].out_features, model.heads,
                              dtype=model.layers[1].weight.dtype)
        layer.load_state_dict(model.layers[1].state_dict())
        model.layers[1] = layer
    else:  # a forward wrapped on the instance, as accelerate's add_hook_to_module does
        plain = model.layers[1].forward
        model.layers[1].forward = lambda h: plain(h) * 2
    return model


@pytest.mark.parametrize("how", ["subclass", "instance"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_layer_with_a_forward_of_its_own_is_called(how, compiled, chain_spy, heads_spy):
    # The chain and the heads compute the plain weight's product and never call the layer:
    # auto runs the layers, and the forced strategies refuse, naming the layer.
    model = _with_own_forward(_model(), how)
    x = _x(model, 4)
    want = x
    for k, layer in enumerate(model.layers):
        want = layer(want)
        if k < len(model.activations):
            want = model.activations[k](want)
    if compiled:
        torch._dynamo.reset()
        got = torch.compile(model, backend="eager")(x)
    else:
        assert model.plan(x).strategy == "layers"
        assert "layers[1] runs" in model.plan(x).reason
        got = model(x)
    torch.testing.assert_close(got, want, **F64)
    assert chain_spy == [] and heads_spy == []
    for strategy in ("fm_chain", "heads"):
        model.strategy = strategy
        with pytest.raises(BlockDiagError, match=r"layers\[1\] runs .*never calls the layer"):
            model(x)


def test_a_refusal_for_a_global_hook_names_the_hook_flopcountermode_registers():
    # FlopCounterMode registers global module hooks (its module tracker) while it counts: a
    # forced chain was refused for "a global module hook", which the user never registered.
    from torch.utils.flop_counter import FlopCounterMode

    model = GroupedMLP(6, [4], 2, heads=3, strategy="fm_chain")
    with FlopCounterMode(display=False):
        with pytest.raises(BlockDiagError, match=r"ModuleTracker\._fw_pre_hook.*FlopCounterMode"):
            model(torch.randn(3, 6))
