"""The headline numbers: ratios measured in one process with interleaved rounds.

Every number here is a time divided by another time measured in the same process, in
interleaved rounds of short samples (``common.interleaved``), each side's fastest sample
(``common.ratio_of_minima``): the machine's load reaches both sides alike, which a time
benchmark measured minutes apart cannot offer on a shared machine. All are "lower is better",
like a time, so asv's regression detection (the *Regressions* tab, ``asv continuous``,
``asv compare``) reads a rise as a regression:

* ``GroupedLinearRatios.track_auto_over_fastest``: ``auto`` over the fastest fixed backend
  (1.0: the chooser picked the winner; a rise means dispatch quality regressed).
* ``GroupedLinearRatios.track_auto_over_linear_loop``: ``auto`` over a ``ModuleList`` of
  ``nn.Linear`` plus ``cat`` (the code users write first): the inverse of the speed-up,
  0.25 is a 4x speed-up.
* ``GroupedLinearRatios.track_auto_over_ideal``: ``auto`` over one dense GEMM with the same
  useful FLOPs and output, ``[B, in] @ [in, G*out]``: the inverse of the fraction of the
  ideal GEMM that ``blockdiag bench`` reports as ``%ideal``.
* ``BackendRatios.track_backend_over_ideal``: each fixed backend over the same ideal GEMM, so
  a slowdown of one backend shows even where ``auto`` does not choose it.
* ``ForumMLPRatio.track_grouped_over_loop``: the forum model (50 heads
  ``150 -> 10 -> 10 -> 1``), ``GroupedMLP`` over the loop of heads, inference and one Adam
  training step: the inverse of the speed-up the README promises.

``GroupedLinearRatios`` and ``BackendRatios`` share one measurement (``_measure``, asv's
``setup_cache``): at each point every backend, ``auto``, the ideal GEMM and the loop are
timed in the same rounds.
"""

import copy

import torch
from torch import nn

import blockdiag

from .common import (
    BACKENDS,
    DEVICES,
    grid,
    interleaved,
    parse_block,
    ratio_of_minima,
    require_backend,
    require_device,
    sync,
    try_run,
)
from .mlp import HEADS, IN, OUT, _heads

# (groups/batch/block): the forum shape, a square-block shape, few large groups, many tiny ones;
# then a few rows (serving, acting) and a very large batch of tiny blocks (memory-bound), the
# batches beyond most of the built-in table's, where auto ranks from its nearest points.
SHAPES = grid(["50/256/150x10", "16/256/64x64", "4/1024/256x256", "256/64/10x10", "4/4/10x10", "4/16384/10x10"],
              ["3/4/6x4"])
MODES = ["forward", "train"]
REFERENCES = ("auto", "ideal", "linear_loop")


def _steps(shape, device, mode):
    """name -> one call (forward, or forward + backward to input, weight and bias)."""
    g, n, block = shape.split("/")
    g, n = int(g), int(n)
    i, o = parse_block(block)
    train = mode == "train"
    torch.manual_seed(0)
    x = torch.randn(n, g * i, device=device, requires_grad=train)
    w = (torch.randn(g, o, i, device=device) / i**0.5).requires_grad_(train)
    b = torch.randn(g * o, device=device, requires_grad=train)
    gy = torch.randn(n, g * o, device=device)

    def step(fn, params):
        if not train:
            def run():
                with torch.no_grad():
                    fn()
        else:
            def run():
                fn().backward(gy)
                for t in params:
                    t.grad = None
        return run

    steps = {}
    for name in ["auto"] + BACKENDS:
        try:
            if name != "auto":
                require_backend(name)
            if name == "dense" and g * g * i * o > 1 << 24:
                raise NotImplementedError("dense block-diagonal matrix over 16M entries")
            run = step(lambda name=name: blockdiag.grouped_linear(x, w, b, backend=name), (x, w, b))
            try_run(run)
        except NotImplementedError:
            continue
        steps[name] = run

    # The ideal: one dense GEMM with the same useful FLOPs and output (the shared-input wide layer).
    xi = torch.randn(n, i, device=device, requires_grad=train)
    wi = torch.randn(g * o, i, device=device, requires_grad=train)
    bi = torch.randn(g * o, device=device, requires_grad=train)
    steps["ideal"] = step(lambda: nn.functional.linear(xi, wi, bi), (xi, wi, bi))

    # The loop users write first: nn.Linear per group over its input slice, then cat.
    lins = nn.ModuleList(nn.Linear(i, o, device=device) for _ in range(g)).requires_grad_(train)

    def loop():
        xs = x.split(i, dim=-1)
        return torch.cat([m(xs[k]) for k, m in enumerate(lins)], dim=-1)

    steps["linear_loop"] = step(loop, (x, *lins.parameters()))
    return steps


def _measure(self):
    """Every point's interleaved samples: (device, shape, mode) -> {name: [seconds per call]}."""
    out = {}
    for device in DEVICES:
        for shape in SHAPES:
            for mode in MODES:
                try:
                    steps = _steps(shape, device, mode)
                    out[(device, shape, mode)] = interleaved(steps, device)
                except Exception as e:  # noqa: BLE001 (reported by setup, per combination)
                    out[(device, shape, mode)] = f"{type(e).__name__}: {e}"
                sync(device)
    return out


def _point(cache, device, shape, mode):
    require_device(device)
    got = cache.get((device, shape, mode))
    if got is None:
        raise NotImplementedError("not measured here")
    if isinstance(got, str):
        raise RuntimeError(got)
    return got


class GroupedLinearRatios:
    """``auto`` over the fastest fixed backend, the ``nn.Linear`` loop and the ideal GEMM."""

    params = (DEVICES, SHAPES, MODES)
    param_names = ["device", "shape (groups/batch/in x out)", "mode"]
    unit = "ratio"
    timeout = 1200  # setup_cache measures every point
    setup_cache = _measure

    def setup(self, cache, device, shape, mode):
        self.samples = _point(cache, device, shape, mode)

    def track_auto_over_fastest(self, *_):
        fixed = [n for n in self.samples if n not in REFERENCES]
        return ratio_of_minima(self.samples, "auto", fixed)

    def track_auto_over_linear_loop(self, *_):
        return ratio_of_minima(self.samples, "auto", "linear_loop")

    def track_auto_over_ideal(self, *_):
        return ratio_of_minima(self.samples, "auto", "ideal")


class BackendRatios:
    """Each fixed backend over the ideal GEMM of the same round (n/a where it cannot run)."""

    params = (BACKENDS, DEVICES, SHAPES, MODES)
    param_names = ["backend", "device", "shape (groups/batch/in x out)", "mode"]
    unit = "ratio"
    timeout = 1200
    setup_cache = _measure

    def setup(self, cache, backend, device, shape, mode):
        self.samples = _point(cache, device, shape, mode)
        if backend not in self.samples:
            raise NotImplementedError(f"backend {backend!r} does not run here")
        self.backend = backend

    def track_backend_over_ideal(self, *_):
        return ratio_of_minima(self.samples, self.backend, "ideal")


# The forum model of mlp.py: the same heads, so the ratio and the times describe one model.


class ForumMLPRatio:
    """The forum model: ``GroupedMLP`` over the loop of heads, in one process.

    ``train`` is one Adam step (zero_grad, forward, MSE, backward, step), ``forward`` is
    inference without autograd; both models hold the same weights.
    """

    params = (DEVICES, grid([64, 1024], [4]), MODES)
    param_names = ["device", "batch", "mode"]
    unit = "ratio"
    # 41 rounds of the loop's 40 ms training step passed asv's default 60 s on a busy machine.
    timeout = 300

    def setup(self, device, batch, mode):
        require_device(device)
        torch.manual_seed(0)
        heads = _heads(device)
        models = {"loop": heads, "grouped": blockdiag.GroupedMLP.from_heads(copy.deepcopy(heads))}
        x = torch.randn(batch, IN, device=device)
        y = torch.randn(batch, HEADS * OUT, device=device)
        steps = {}
        for name, model in models.items():
            if name == "loop":
                def fwd(m=model):
                    return torch.cat([h(x) for h in m], dim=-1)
            else:
                def fwd(m=model):
                    return m(x)
            if mode == "train":
                opt = torch.optim.Adam(model.parameters(), lr=1e-3)

                def run(fwd=fwd, opt=opt):
                    opt.zero_grad(set_to_none=True)
                    nn.functional.mse_loss(fwd(), y).backward()
                    opt.step()
            else:
                def run(fwd=fwd):
                    with torch.no_grad():
                        fwd()
            steps[name] = run
        self.samples = interleaved(steps, device)

    def track_grouped_over_loop(self, *_):
        return ratio_of_minima(self.samples, "grouped", "loop")
