"""``GroupedLinear`` with ``backend="auto"`` and every fixed backend, timed; what ``auto`` costs.

These are times. auto's quality (its time over the fastest fixed backend's, measured in one
process) is ``ratios.GroupedLinearRatios.track_auto_over_fastest``.
"""

import timeit

import torch

import blockdiag

from .common import (
    BACKENDS,
    DEVICES,
    asv_sampling,
    grid,
    parse_block,
    require_backend,
    require_device,
    sync,
    try_run,
)

# (groups, batch, block): the forum shape, a square-block shape, few large groups, many tiny ones.
SHAPES = grid(["50/256/150x10", "16/256/64x64", "4/1024/256x256", "256/64/10x10"], ["3/4/6x4"])
MODES = ["forward", "train"]


def _make(shape, device, mode, backend):
    g, n, block = shape.split("/")
    g, n = int(g), int(n)
    i, o = parse_block(block)
    layer = blockdiag.GroupedLinear(g * i, g * o, g, backend=backend, device=device)
    layer.requires_grad_(mode == "train")
    x = torch.randn(n, g * i, device=device)

    if mode == "train":
        def step():
            layer(x).sum().backward()
            layer.weight.grad = layer.bias.grad = None
    else:
        def step():
            with torch.no_grad():
                layer(x)

    return step


@asv_sampling
class Layer:
    """One call of a ``GroupedLinear`` layer, ``auto`` or a fixed backend."""

    params = (["auto"] + BACKENDS, DEVICES, SHAPES, MODES)
    param_names = ["backend", "device", "shape (groups/batch/in x out)", "mode"]

    def setup(self, backend, device, shape, mode):
        require_device(device)
        if backend != "auto":
            require_backend(backend)
        self.step = _make(shape, device, mode, backend)
        try_run(self.step)
        self.device = device
        sync(device)

    def time_call(self, *_):
        self.step()
        sync(self.device)


class Dispatch:
    """Microseconds per call that ``auto`` costs over naming its own choice.

    Both go through ``grouped_linear`` on a product small enough (batch 4, 3 groups of 6x4)
    that the dispatch is most of the call, so the difference is the settings token and the
    memo entry's checks that only ``auto`` pays.
    """

    params = (DEVICES,)
    param_names = ["device"]
    unit = "us per call"
    rounds = 15
    number = 2000

    def setup(self, device):
        require_device(device)
        self.device = device
        x = torch.randn(4, 18, device=device)
        w = torch.randn(3, 4, 6, device=device)
        b = torch.randn(12, device=device)
        choice = blockdiag.GroupedLinear(18, 12, 3, device=device).plan(x).backend
        self.calls = {
            name: (lambda name=name: blockdiag.grouped_linear(x, w, b, backend=name)) for name in ("auto", choice)
        }
        self.choice = choice
        for call in self.calls.values():
            call()
        sync(device)

    def _per_call(self, call) -> float:
        t0 = timeit.default_timer()
        for _ in range(self.number):
            call()
        sync(self.device)
        return (timeit.default_timer() - t0) / self.number

    def track_auto_premium_us(self, _):
        # Interleaved rounds, the median of the per-round differences: both sides of one
        # difference saw the same moment of the machine.
        diffs = []
        for _ in range(self.rounds):
            auto = self._per_call(self.calls["auto"])
            fixed = self._per_call(self.calls[self.choice])
            diffs.append((auto - fixed) * 1e6)
        return sorted(diffs)[len(diffs) // 2]
