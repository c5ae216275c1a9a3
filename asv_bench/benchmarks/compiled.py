"""``torch.compile``'d training steps: GroupedLinear and GroupedMLP against the compiled peers.

The models of ``blockdiag bench --compiled``: ``GroupedLinear`` (G groups of in x out, each
reading its slice of the input, whose gradient is needed as inside a network) and
``GroupedMLP`` (G heads ``in -> out -> ReLU -> out`` on one shared input, the forum's model),
each against ``torch.compile`` of the loop of heads (``nn.Linear`` / ``nn.Sequential``, then
``cat``) and of ``torch.func`` vmap ensembling (``stack_module_state`` + ``functional_call``),
all holding the same weights. A training step is forward and backward. Every graph is
compiled before timing (``dynamic=False``, dynamo reset first), so compile time is never timed.

``CompiledTransformRatio`` times ``torch.func`` recipes (per-sample gradients, ensembling)
compiled whole against the same recipes eager.

``CompiledRatio``'s two tracks are the numbers to watch (issue 21's targets in brackets):
``track_compiled_over_eager``, compiled blockdiag over eager blockdiag (<= 1.02 on geometric
mean), and ``track_compiled_over_best_peer``, compiled blockdiag over the fastest compiled
peer (<= 0.8 on geometric mean, under 1 at every shape), each measured in one process with
interleaved rounds (``common.interleaved``, the ratio of the minima).
"""

import copy

import torch
from torch import nn

import blockdiag

from .common import (
    DEVICES,
    asv_sampling,
    grid,
    interleaved,
    parse_block,
    ratio_of_minima,
    require_device,
    sync,
    try_run,
)

# (groups, batch, block): the forum shape, a square-block shape, few large groups. The loop of
# 256 heads is left out: compiling it takes minutes on a small machine.
SHAPES = grid(["50/256/150x10", "16/256/64x64", "4/1024/256x256"], ["3/4/6x4"])
MODELS = ["GroupedLinear", "GroupedMLP"]
METHODS = ["blockdiag", "blockdiag_compiled", "loop_compiled", "vmap_compiled"]
PEERS = ("loop_compiled", "vmap_compiled")
# The CI smoke run times only compiled blockdiag step by step: CompiledRatio compiles and
# runs every method anyway, and each compile costs seconds on 2 cores.
STEP_METHODS = grid(METHODS, ["blockdiag_compiled"])


class _Loop(nn.Module):
    def __init__(self, heads, split):
        super().__init__()
        self.heads, self.split = heads, split

    def forward(self, x):
        xs = x.split(self.split, dim=-1) if self.split else [x] * len(self.heads)
        return torch.cat([h(xs[k]) for k, h in enumerate(self.heads)], dim=-1)


class _Vmap(nn.Module):
    def __init__(self, heads, split):
        super().__init__()
        from torch.func import stack_module_state

        params, _ = stack_module_state(list(heads))
        self.keys = list(params)
        self.stacked = nn.ParameterList(nn.Parameter(params[k].detach().clone()) for k in self.keys)
        self.groups, self.split = len(heads), split
        self._base = (copy.deepcopy(heads[0]).to("meta"),)  # a tuple: not a submodule

    def forward(self, x):
        from torch.func import functional_call, vmap

        base = self._base[0]

        def one(prm, xx):
            return functional_call(base, prm, (xx,))

        prm = dict(zip(self.keys, self.stacked))
        n = x.shape[0]
        if self.split:
            y = vmap(one)(prm, x.view(n, self.groups, self.split).transpose(0, 1))
        else:
            y = vmap(one, in_dims=(0, None))(prm, x)
        return y.transpose(0, 1).reshape(n, -1)


def _modules(model, shape, device):
    g, n, block = shape.split("/")
    g, n = int(g), int(n)
    i, o = parse_block(block)
    torch.manual_seed(0)
    if model == "GroupedLinear":
        bd = blockdiag.GroupedLinear(g * i, g * o, g, device=device)
        heads, split = bd.to_linears(), i
        x = torch.randn(n, g * i, device=device, requires_grad=True)
    else:
        bd = blockdiag.GroupedMLP(i, [o], o, heads=g, device=device)
        heads, split = bd.to_heads(), None
        x = torch.randn(n, i, device=device)
    gy = torch.randn(n, g * o, device=device)
    return {"blockdiag": bd, "loop": _Loop(heads, split), "vmap": _Vmap(heads, split)}, x, gy


def _steps(model, shape, device, methods):
    """method -> a warm training step (compiled ones compiled by two calls)."""
    torch._dynamo.reset()
    mods, x, gy = _modules(model, shape, device)
    steps = {}
    for method in methods:
        mod = mods[method.removesuffix("_compiled")]
        fn = torch.compile(mod, dynamic=False) if method.endswith("_compiled") else mod
        params = [x, *mod.parameters()]

        def step(fn=fn, params=params):
            fn(x).backward(gy)
            for t in params:
                t.grad = None

        try_run(step)  # compiles the forward and backward graphs
        step()  # a recompile on the second call is not timed either
        steps[method] = step
    sync(device)
    return steps


def _ratios_per_combination(combos, make_steps, ratios) -> dict:
    """``{combination: ratios(samples)}``, the steps of each timed in interleaved rounds.

    ``make_steps(*combination)`` builds them (device second); one that raises
    ``NotImplementedError`` is left out, another exception is kept as its message for
    :func:`_cached` to raise in that combination's setup.
    """
    out = {}
    for combo in combos:
        try:
            steps = make_steps(*combo)
        except NotImplementedError:
            continue
        except Exception as e:  # noqa: BLE001 (reported by setup, per combination)
            first = str(e).splitlines()[0] if str(e) else ""
            out[combo] = f"{type(e).__name__}: {first}"
            continue
        out[combo] = ratios(interleaved(steps, combo[1]))
        del steps
    torch._dynamo.reset()
    return out


def _cached(cache: dict, combo):
    """The ratios ``setup_cache`` measured for ``combo``; its failure raised here."""
    got = cache.get(combo)
    if got is None:
        raise NotImplementedError("not measured here")
    if isinstance(got, str):
        raise RuntimeError(got)
    return got


@asv_sampling
class CompiledStep:
    """One training step of each method: eager blockdiag, and the compiled models."""

    params = (MODELS, STEP_METHODS, DEVICES, SHAPES)
    param_names = ["model", "method", "device", "shape (groups/batch/in x out)"]
    timeout = 600  # setup compiles

    def setup(self, model, method, device, shape):
        require_device(device)
        self.device = device
        self.step = _steps(model, shape, device, [method])[method]

    def time_train_step(self, *_):
        self.step()
        sync(self.device)


class CompiledRatio:
    """Compiled blockdiag over eager blockdiag, and over the fastest compiled peer, in one process.

    Everything is measured once, in ``setup_cache`` (every graph of every shape compiled
    there): each track reads its ratio from it.
    """

    params = (MODELS, DEVICES, SHAPES)
    param_names = ["model", "device", "shape (groups/batch/in x out)"]
    unit = "ratio"
    timeout = 1800

    def setup_cache(self):
        return _ratios_per_combination(
            [(m, d, s) for m in MODELS for d in DEVICES for s in SHAPES],
            lambda model, device, shape: _steps(model, shape, device, METHODS),
            lambda samples: {"eager": ratio_of_minima(samples, "blockdiag_compiled", "blockdiag"),
                             "peer": ratio_of_minima(samples, "blockdiag_compiled", PEERS)})

    def setup(self, cache, model, device, shape):
        require_device(device)
        self.ratios = _cached(cache, (model, device, shape))

    def track_compiled_over_eager(self, *_):
        return self.ratios["eager"]

    def track_compiled_over_best_peer(self, *_):
        return self.ratios["peer"]


# ``torch.func`` recipes over a GroupedLinear, compiled whole (``fullgraph=True``) against the
# same recipe eager: per-sample gradients (``vmap(grad)``) and model ensembling (``vmap`` over
# eight stacked copies' parameters). Under a transform ``torch.compile`` records the product as
# torch ops (docs/concepts.md), which it fuses with the transform's own work.
TRANSFORMS = ["per_sample_grad", "ensemble"]
TRANSFORM_SHAPES = grid(["8/32/16x16", "16/64/64x64"], ["3/4/6x4"])
ENSEMBLE = 8


def _transform_steps(transform, shape, device):
    """``{"eager": recipe, "compiled": torch.compile(recipe, fullgraph=True)}``, both warm."""
    from torch.func import functional_call, grad, stack_module_state, vmap

    torch._dynamo.reset()
    g, n, block = shape.split("/")
    g, n = int(g), int(n)
    i, o = parse_block(block)
    torch.manual_seed(0)
    x = torch.randn(n, g * i, device=device)
    if transform == "per_sample_grad":
        m = blockdiag.GroupedLinear(g * i, g * o, g, device=device)
        p = {k: v.detach() for k, v in m.named_parameters()}

        def loss(prm, row):
            return functional_call(m, prm, (row[None],)).square().sum()

        def recipe():
            return vmap(grad(loss), in_dims=(None, 0))(p, x)
    else:
        models = [blockdiag.GroupedLinear(g * i, g * o, g, device=device) for _ in range(ENSEMBLE)]
        params, buffers = stack_module_state(models)
        base = models[0]

        def recipe():
            return vmap(lambda prm, buf, xx: functional_call(base, (prm, buf), (xx,)),
                        in_dims=(0, 0, None))(params, buffers, x)

    steps = {"eager": recipe, "compiled": torch.compile(recipe, fullgraph=True)}
    for step in steps.values():
        try_run(step)
        step()
    sync(device)
    return steps


class CompiledTransformRatio:
    """A compiled ``torch.func`` recipe over its eager run, per recipe and shape, in one process."""

    params = (TRANSFORMS, DEVICES, TRANSFORM_SHAPES)
    param_names = ["transform", "device", "shape (groups/batch/in x out)"]
    unit = "ratio"
    timeout = 900

    def setup_cache(self):
        return _ratios_per_combination(
            [(t, d, s) for t in TRANSFORMS for d in DEVICES for s in TRANSFORM_SHAPES],
            lambda transform, device, shape: _transform_steps(transform, shape, device),
            lambda samples: ratio_of_minima(samples, "compiled", "eager"))

    def setup(self, cache, transform, device, shape):
        require_device(device)
        self.ratio = _cached(cache, (transform, device, shape))

    def track_compiled_over_eager(self, *_):
        return self.ratio
