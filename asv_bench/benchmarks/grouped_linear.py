"""``GroupedLinear`` with ``backend="auto"`` against every fixed backend, and auto's quality.

``track_auto_ratio_to_best`` is the number to watch in the history: the time of ``auto``
divided by the time of the fastest fixed backend on the same shape, measured in one process
with interleaved rounds (minimum per backend). 1.0 means the chooser picked the winner; a rise means dispatch
quality regressed (a worse table, a wrong crossover, or new overhead in planning).
"""

import timeit

import torch

import blockdiag

from .common import BACKENDS, DEVICES, grid, parse_block, require_backend, require_device, sync, try_run

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


class Layer:
    """One call of a ``GroupedLinear`` layer, ``auto`` or a fixed backend."""

    params = (["auto"] + BACKENDS, DEVICES, SHAPES, MODES)
    param_names = ["backend", "device", "shape (groups/batch/in x out)", "mode"]
    repeat = (1, 5, 2.0)
    warmup_time = 0.05

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


class AutoQuality:
    """auto's time over the fastest fixed backend's, on the same shape, in one process."""

    params = (DEVICES, SHAPES, MODES)
    param_names = ["device", "shape (groups/batch/in x out)", "mode"]
    unit = "auto time / best time"
    # Many short interleaved samples: on a shared machine a quiet window is then likely to
    # fall inside every backend's samples, and the minimum finds it.
    rounds = 10
    target_s = 0.02

    def setup(self, device, shape, mode):
        require_device(device)
        self.device = device
        self.steps = {}
        for name in ["auto"] + BACKENDS:
            try:
                if name != "auto":
                    require_backend(name)
                step = _make(shape, device, mode, name)
                try_run(step)
            except NotImplementedError:
                continue
            self.steps[name] = step
        sync(device)

    def _time(self, step) -> float:
        def run():
            step()
            sync(self.device)

        number = 1
        while True:
            t = timeit.timeit(run, number=number)
            if t >= self.target_s:
                return t / number
            number *= 2

    def track_auto_ratio_to_best(self, *_):
        times = {name: [] for name in self.steps}
        # Interleaved rounds so that machine noise hits every backend alike; the minimum over
        # rounds is the least-disturbed measurement (noise on a shared machine only adds time).
        for _ in range(self.rounds):
            for name, step in self.steps.items():
                times[name].append(self._time(step))
        fastest = {name: min(ts) for name, ts in times.items()}
        best = min(v for k, v in fastest.items() if k != "auto")
        return fastest["auto"] / best


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
