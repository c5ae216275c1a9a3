"""A differential fuzz case of ``GroupedMLP`` against the loop of heads it replaces.

One case draws the model (heads, shared input, sizes, layers, per-layer bias, activations,
output activation, dtype, strategy, backend, train/eval), the grad mode (training, some
layers frozen, only the input or nothing requiring a gradient, ``no_grad``,
``inference_mode``) and the input's layout (0-3 leading dims, empty and one-row batches,
transposed, expanded, column-sliced, strided), runs the model, and compares its output and
every gradient (input, each weight and bias) with ``to_heads()`` run as
``torch.cat([head(x_h) for head in heads], -1)`` in float64. It also checks that the call
changed neither the input nor any parameter. Shared by ``tests/test_mlp_fuzz.py`` (a few
seeded cases) and longer runs of the same generator.
"""

from __future__ import annotations

import contextlib
import math
import random

import torch
from torch import nn

from blockdiag import BlockDiagError, GroupedMLP
from blockdiag.backends import get, names
from blockdiag.nn.mlp.strategy import STRATEGIES
from blockdiag.testing import tolerances

# (label, factory, deterministic in training mode)
ACTIVATIONS = [
    ("ReLU", nn.ReLU, True),
    ("ReLU(inplace)", lambda: nn.ReLU(inplace=True), True),
    ("GELU", nn.GELU, True),
    ("GELU(tanh)", lambda: nn.GELU(approximate="tanh"), True),
    ("SiLU", nn.SiLU, True),
    ("SiLU(inplace)", lambda: nn.SiLU(inplace=True), True),
    ("Tanh", nn.Tanh, True),
    ("LeakyReLU", lambda: nn.LeakyReLU(0.1), True),
    ("LeakyReLU(inplace)", lambda: nn.LeakyReLU(0.2, inplace=True), True),
    ("Identity", nn.Identity, True),
    ("Softplus", nn.Softplus, True),
    ("Softplus(beta=2,thr=1)", lambda: nn.Softplus(beta=2.0, threshold=1.0), True),
    ("Hardtanh(inplace)", lambda: nn.Hardtanh(-0.5, 0.5, inplace=True), True),
    ("ELU(inplace)", lambda: nn.ELU(inplace=True), True),
    ("Dropout(0)", lambda: nn.Dropout(0.0), True),
    ("ReLU+Dropout(0)", lambda: nn.Sequential(nn.ReLU(), nn.Dropout(0.0)), True),
    ("Dropout(0.5)", lambda: nn.Dropout(0.5), False),  # eval mode only
    ("RReLU", nn.RReLU, False),  # eval mode only
    ("Sigmoid", nn.Sigmoid, True),
]
OUTPUT_ACTIVATIONS = [("none", None, True)] + ACTIVATIONS
GRAD_MODES = ("train", "frozen", "x_only", "params_only", "nothing", "no_grad", "inference_mode", "jvp", "vmap")
LAYOUTS = ("contiguous", "transposed", "expanded", "sliced", "strided", "scalar_lead")
DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def backend_choices() -> list[str]:
    out = ["auto"]
    for n in names():
        b = get(n)
        if "cpu" in b.dtypes and not b.unavailable_reason():
            out.append(n)
    return out


def draw(rng: random.Random) -> dict:
    """One case's parameters (a plain dict: printable, replayable with :func:`run`)."""
    small = lambda: rng.choice([1, 1, 2, 3, 4, 5, 7, 8]) if rng.random() < 0.9 else rng.choice([16, 33, 64])
    n_layers = rng.randint(1, 4)
    act, out = rng.choice(ACTIVATIONS), rng.choice(OUTPUT_ACTIVATIONS)
    deterministic = act[2] and out[2]  # a random one (Dropout, RReLU) is drawn in eval mode only
    n_calls = 1 if rng.random() < 0.6 else rng.randint(2, 4)
    calls = []
    for _ in range(n_calls):
        lead = [rng.choice([0, 1, 1, 2, 3, 5]) if rng.random() < 0.85 else rng.choice([17, 40])
                for _ in range(rng.randint(0, 3))]
        while math.prod(lead) > 2000:  # a few thousand rows at most: the float64 loop is slow
            lead[lead.index(max(lead))] = 5
        calls.append(dict(
            grad=rng.choice(GRAD_MODES),
            frozen=[rng.random() < 0.4 for _ in range(2 * n_layers)],
            lead=lead,
            layout=rng.choice(LAYOUTS),
            mode=rng.choice(["train", "eval"]) if deterministic else "eval",
            # Later calls may change the strategy or backend of the same model (its caches).
            strategy=None if rng.random() < 0.8 else rng.choice(STRATEGIES),
            backend=None if rng.random() < 0.85 else rng.choice(["auto"] + backend_choices()),
            seed=rng.randrange(2**31),
        ))
    return dict(
        heads=rng.choice([1, 1, 2, 3, 4, 5, 8]),
        shared_input=rng.random() < 0.5,
        in_features=small(),
        hidden=[small() for _ in range(n_layers - 1)],
        out_features=small(),
        bias=[rng.random() < 0.75 for _ in range(n_layers)] if rng.random() < 0.6 else rng.random() < 0.8,
        activation=act[0],
        output_activation=out[0],
        dtype=rng.choice(DTYPES),
        strategy=rng.choice(STRATEGIES),
        backend=rng.choice(["auto", "auto", "auto"] + backend_choices()),
        from_heads=rng.random() < 0.2,
        calls=calls,
        seed=rng.randrange(2**31),
    )


def _factory(label: str, table=OUTPUT_ACTIVATIONS):
    return {a[0]: a[1] for a in table}[label]


def _make_input(call: dict, n_in: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    lead, layout = list(call["lead"]), call["layout"]
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)
    if layout == "scalar_lead" or not lead:
        return rnd(*lead, n_in)
    if layout == "transposed":
        # The feature dim first in memory: x is a permuted view.
        base = rnd(n_in, *reversed(lead))
        return base.permute(*range(base.dim() - 1, 0, -1), 0)
    if layout == "expanded":
        k = len(lead) - 1 if len(lead) == 1 else random.Random(call["seed"]).randrange(len(lead))
        one = list(lead)
        one[k] = 1
        return rnd(*one, n_in).expand(*lead, n_in)
    if layout == "sliced":
        return rnd(*lead, n_in + 5)[..., 2:2 + n_in]
    if layout == "strided":
        return rnd(*lead, 2 * n_in)[..., ::2]
    return rnd(*lead, n_in)


def build(case: dict) -> GroupedMLP:
    torch.manual_seed(case["seed"])
    hidden = case["hidden"]
    act = _factory(case["activation"])
    model = GroupedMLP(
        case["in_features"], hidden, case["out_features"], case["heads"],
        activation=act if act is not None else nn.ReLU,
        output_activation=_factory(case["output_activation"]),
        bias=case["bias"], shared_input=case["shared_input"], backend=case["backend"],
        strategy=case["strategy"], dtype=case["dtype"])
    with torch.no_grad():
        for p in model.parameters():  # biases as large as weights: a bias mixed up shows
            p.uniform_(-1, 1)
    if case["from_heads"]:
        # The round trip: the model rebuilt from its heads computes what it did.
        model = GroupedMLP.from_heads(model.to_heads(), shared_input=case["shared_input"],
                                      backend=case["backend"], strategy=case["strategy"])
    return model


def _reference(model: GroupedMLP, x: torch.Tensor, gy: torch.Tensor | None, x_grad: bool, frozen: set,
               dtype: torch.dtype = torch.float64):
    """The loop of heads in ``dtype``: output, input gradient, and each layer parameter's gradient."""
    heads = model.to_heads().to(dtype)
    G = model.heads
    lins = [[m for m in h if isinstance(m, nn.Linear)] for h in heads]
    for h in lins:
        for k, lin in enumerate(h):
            for name, p in lin.named_parameters():
                p.requires_grad_((k, name) not in frozen)
    xr = x.detach().to(dtype).requires_grad_(x_grad)
    if model.shared_input:
        parts = [xr] * G
    else:
        parts = xr.split(model.in_features, -1)
    y = torch.cat([head(p) for head, p in zip(heads, parts)], -1)
    grads = {}
    if gy is not None and y.requires_grad:
        y.backward(gy.to(dtype))
        for k, layer in enumerate(model.layers):
            w = [lins[g][k].weight.grad for g in range(G)]
            grads[(k, "weight")] = None if w[0] is None else (
                torch.cat(w, 0)[None] if k == 0 and model.shared_input else torch.stack(w))
            if layer.bias is not None:
                b = [lins[g][k].bias.grad for g in range(G)]
                grads[(k, "bias")] = None if b[0] is None else torch.cat(b)
        grads["x"] = xr.grad
    return y.detach(), grads


def _close(what: str, got: torch.Tensor, want, dtype: torch.dtype, k: int, layers: int) -> str | None:
    """Whether ``got`` matches the float64 loop's ``want`` (or, in bfloat16, where not, the bfloat16 loop's).

    A bfloat16 hidden unit near an activation's kink (ReLU's 0, Softplus's threshold) may
    fall on the other side of it than the float64 one does; the bfloat16 loop rounds as
    the model does, so an entry is accepted where it is close to either loop's.
    """
    want, want16 = want if isinstance(want, tuple) else (want, None)
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype != dtype:
        return f"{what}: dtype {got.dtype} != {dtype}"
    if want.numel() == 0:
        return None
    want = want.detach()
    mag = float(want.abs().max())
    # The terms summed are of size ~1 (weights in [-1, 1], a normal input): a result that
    # cancels to near 0 still carries their rounding.
    tol = tolerances(dtype, k=k * layers, magnitude=max(mag, 0.1))
    if dtype == torch.bfloat16:
        # Every layer's output is rounded to bfloat16 before the next reads it.
        tol = {"atol": tol["atol"] * layers, "rtol": min(0.25, tol["rtol"] * layers)}
    if want16 is not None:
        bound = tol["atol"] + tol["rtol"] * want.abs()
        off = torch.minimum((got.double() - want).abs(), (got.double() - want16.double()).abs())
        bad = ~(off <= bound)
        # bfloat16 rounding puts a few entries on the other side of a kink (LeakyReLU's slope
        # at 0 scales a gradient 5x) than both loops do: a handful in a large tensor.
        if int(bad.sum()) <= bad.numel() // 500:
            return None
        i = int(bad.flatten().nonzero()[0])
        return f"{what}: {int(bad.sum())}/{bad.numel()} entries off, e.g. got {got.flatten()[i].item()} want {want.flatten()[i].item()} (bf16 loop {want16.flatten()[i].item()})"
    try:
        torch.testing.assert_close(got.double(), want, **tol)
    except AssertionError as e:
        return f"{what}: {str(e).splitlines()[1:4]}"
    return None



def run(case: dict) -> tuple[str, str | None]:
    """Run a case's calls on one model: ``("ok" | "refused: ...", None)`` or ``(status, mismatch)``."""
    model = build(case)
    for j, call in enumerate(case["calls"]):
        if call["strategy"] is not None and j:
            model.strategy = call["strategy"]
        if call["backend"] is not None and j:
            model.backend = call["backend"]
        status, problem = _call(model, case, call)
        if problem:
            return status, f"call {j}: {problem}"
        if status != "ok":
            return status, None
    return "ok", None


def _set_grads(model: GroupedMLP, call: dict) -> set:
    grad = call["grad"]
    frozen = set()
    keys = [(k, n) for k in range(len(model.layers)) for n in ("weight", "bias")]
    for (k, n), f in zip(keys, call["frozen"]):
        p = getattr(model.layers[k], n)
        if p is None:
            continue
        p.grad = None
        off = grad in ("x_only", "nothing") or (grad == "frozen" and f)
        p.requires_grad_(not off)
        if off:
            frozen.add((k, n))
    return frozen


def _call(model: GroupedMLP, case: dict, call: dict) -> tuple[str, str | None]:
    model.train(call["mode"] == "train")
    dtype = case["dtype"]
    gen = torch.Generator().manual_seed(call["seed"])
    n_in = case["in_features"] * (1 if case["shared_input"] else case["heads"])
    x = _make_input(call, n_in, dtype, gen)
    grad = call["grad"]
    frozen = _set_grads(model, call)
    if grad in ("jvp", "vmap"):
        return _call_func(model, case, call, x, gen)
    x_grad = grad in ("train", "frozen", "x_only") and (grad != "frozen" or call["seed"] % 2 == 0)
    x_before = x.clone()
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x_in = x.detach().requires_grad_(x_grad) if x_grad else x
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(grad, contextlib.nullcontext)
    try:
        with ctx():
            y = model(x_in)
    except BlockDiagError as e:
        return "refused: " + str(e)[:300], None
    records = grad not in ("no_grad", "inference_mode") and (x_grad or any(p.requires_grad for p in model.parameters()))
    if y.requires_grad != records:
        return "label", f"output requires_grad={y.requires_grad}, expected {records}"
    gy = None
    if records:
        gy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)
        y.backward(gy)
    ref_y, ref_g = _reference(model, x, gy, x_grad, frozen)
    if dtype == torch.bfloat16:
        y16, g16 = _reference(model, x, gy, x_grad, frozen, dtype)
        ref_y = (ref_y, y16)
        ref_g = {key: (v, g16[key]) if v is not None else None for key, v in ref_g.items()}
    n_layers = len(model.layers)
    k = max([case["in_features"], *case["hidden"], case["out_features"]])
    rows = max(1, x.shape[:-1].numel())
    problems = []
    p = _close("output", y.detach(), ref_y, dtype, k, n_layers)
    if p:
        problems.append(p)
    if not torch.equal(x.detach(), x_before):
        problems.append("the input changed")
    for n, q in model.named_parameters():
        if not torch.equal(q.detach(), params_before[n]):
            problems.append(f"parameter {n} changed")
    if records:
        for kk, layer in enumerate(model.layers):
            for name in ("weight", "bias"):
                q = getattr(layer, name)
                if q is None:
                    continue
                want = ref_g.get((kk, name))
                if (kk, name) in frozen:
                    if q.grad is not None:
                        problems.append(f"layers[{kk}].{name} is frozen but got a gradient")
                    continue
                if q.grad is None:
                    problems.append(f"layers[{kk}].{name}.grad is None")
                    continue
                p = _close(f"layers[{kk}].{name}.grad", q.grad, want, dtype, max(k, rows), n_layers)
                if p:
                    problems.append(p)
        if x_grad:
            if x_in.grad is None:
                problems.append("x.grad is None")
            else:
                p = _close("x.grad", x_in.grad, ref_g["x"], dtype, k, n_layers)
                if p:
                    problems.append(p)
    else:
        for n, q in model.named_parameters():
            if q.grad is not None:
                problems.append(f"{n} got a gradient without autograd recording")
    return "ok", ("; ".join(problems) or None)


def _call_func(model: GroupedMLP, case: dict, call: dict, x: torch.Tensor, gen) -> tuple[str, str | None]:
    """torch.func: the model's jvp in the input, or vmap over the first leading dim (and the
    gradients through it), against the loop's."""
    from torch.func import jvp, vmap

    dtype = case["dtype"]
    heads = model.to_heads().double()

    def loop(xx):
        parts = [xx] * model.heads if model.shared_input else xx.split(model.in_features, -1)
        return torch.cat([h(p) for h, p in zip(heads, parts)], -1)

    k = max([case["in_features"], *case["hidden"], case["out_features"]])
    n_layers = len(model.layers)
    if dtype == torch.bfloat16:
        return "ok", None  # a tangent through bfloat16 kinks: checked in float32/64 only
    try:
        if call["grad"] == "jvp":
            # torch's make_dual refuses an expanded primal (nn.Linear's too): a copy.
            x = x.contiguous()
            t = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(dtype)
            y, dy = jvp(model, (x,), (t,))
            ry, rdy = jvp(loop, (x.double(),), (t.double(),))
            return "ok", (_close("jvp output", y, ry, dtype, k, n_layers)
                          or _close("jvp tangent", dy, rdy, dtype, k, n_layers))
        if x.dim() < 2 or "RReLU" in (case["activation"], case["output_activation"]):
            return "ok", None  # vmap has no rule for rrelu (nn.Linear heads' neither)
        frozen = {(kk, n) for kk, layer in enumerate(model.layers) for n in ("weight", "bias")
                  if getattr(layer, n) is not None and not getattr(layer, n).requires_grad}
        y = vmap(model)(x)
        problems = []
        ref_y = loop(x.double()).detach()
        p = _close("vmap output", y.detach(), ref_y, dtype, k, n_layers)
        if p:
            problems.append(p)
        if y.requires_grad:
            gy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)
            y.backward(gy)
            _, ref_g = _reference(model, x, gy, False, frozen)
            rows = max(1, x.shape[:-1].numel())
            for key, want in ref_g.items():
                if key == "x" or want is None:
                    continue
                kk, n = key
                got = getattr(model.layers[kk], n).grad
                p = "missing" if got is None else _close(f"vmap layers[{kk}].{n}.grad", got, want, dtype, max(k, rows),
                                                          n_layers)
                if p:
                    problems.append(p)
        return "ok", ("; ".join(problems) or None)
    except BlockDiagError as e:
        return "refused: " + str(e)[:300], None
