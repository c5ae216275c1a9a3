"""The forum scenario: 50 independent heads ``150 -> 10 -> 10 -> 1`` reading one shared input.

``loop`` is the forum's model (a Python loop over ``nn.Sequential`` heads, then ``cat``);
``GroupedMLP`` is ``GroupedMLP.from_heads`` of the same heads (identical outputs). These are
times; ``ratios.ForumMLPRatio`` is the same comparison as a ratio measured in one process,
the number to read on a shared machine.
"""

import copy

import torch
from torch import nn

import blockdiag

from .common import DEVICES, asv_sampling, grid, require_device, sync

HEADS, IN, HIDDEN, OUT = grid((50, 150, (10, 10), 1), (3, 6, (4,), 1))


def _heads(device):
    def head():
        sizes = [IN, *HIDDEN, OUT]
        mods = []
        for k in range(len(sizes) - 1):
            mods.append(nn.Linear(sizes[k], sizes[k + 1]))
            if k < len(sizes) - 2:
                mods.append(nn.ReLU())
        return nn.Sequential(*mods)

    return nn.ModuleList(head() for _ in range(HEADS)).to(device)


class _LoopOfHeads(nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.heads = heads

    def forward(self, x):
        return torch.cat([h(x) for h in self.heads], dim=-1)


@asv_sampling
class ForumMLP:
    """Loop of heads vs ``GroupedMLP``: inference, and one Adam training step."""

    params = (["loop", "GroupedMLP"], DEVICES, grid([64, 1024], [4]))
    param_names = ["model", "device", "batch"]
    timeout = 300  # the loop's training step at batch 1024 passed asv's 60 s on a busy machine

    def setup(self, model, device, batch):
        require_device(device)
        torch.manual_seed(0)
        heads = _heads(device)
        if model == "loop":
            self.model = _LoopOfHeads(heads)
        else:
            self.model = blockdiag.GroupedMLP.from_heads(copy.deepcopy(heads))
        self.x = torch.randn(batch, IN, device=device)
        self.y = torch.randn(batch, HEADS * OUT, device=device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.device = device
        self.train_step()
        sync(device)

    def train_step(self):
        self.opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(self.model(self.x), self.y).backward()
        self.opt.step()

    def time_forward(self, *_):
        with torch.no_grad():
            self.model(self.x)
        sync(self.device)

    def time_train_step(self, *_):
        self.train_step()
        sync(self.device)


@asv_sampling
class ForumMLPOneThread(ForumMLP):
    """The same times on one thread: the repeatable series on a shared machine.

    With two OpenMP threads on a 2-core VM, a thread that loses its core for a moment stalls
    every parallel region, and three runs of unchanged code differed by a median 10-18% here;
    on one thread they stayed within 10% (docs/results/asv-time-noise-*.json). This series
    measures per-core speed, not the default configuration's.
    """

    def setup(self, model, device, batch):
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        super().setup(model, device, batch)

    def teardown(self, *_):
        torch.set_num_threads(self._threads)
