"""Every backend's grouped product ``x [batch, G*in] -> [batch, G*out]``, forward and training.

These are times, so they move with the machine's load: compare them between commits
measured on a quiet machine (``asv continuous``), and read ``ratios.BackendRatios`` (each
backend over the ideal GEMM of the same rounds) where the machine is shared. The grid is small
on purpose but spans the regimes of the landscape study: few vs many groups, small vs large batch, the
forum's thin ``150x10`` blocks vs square ``64x64`` ones.
"""

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

GROUPS = grid([4, 64], [2])
BATCH = grid([32, 1024], [8])
BLOCKS = grid(["150x10", "64x64"], ["6x4"])


@asv_sampling
class _Product:
    params = (BACKENDS, DEVICES, GROUPS, BATCH, BLOCKS)
    param_names = ["backend", "device", "groups", "batch", "block"]
    grad = False

    def setup(self, backend, device, groups, batch, block):
        require_device(device)
        require_backend(backend)
        i, o = parse_block(block)
        g = self.grad
        self.x = torch.randn(batch, groups * i, device=device, requires_grad=g)
        self.w = torch.randn(groups, o, i, device=device, requires_grad=g)
        self.b = torch.randn(groups * o, device=device, requires_grad=g)
        self.backend, self.device = backend, device
        try_run(self.step)
        sync(device)

    def forward(self):
        return blockdiag.grouped_linear(self.x, self.w, self.b, backend=self.backend)


class Forward(_Product):
    """Inference: ``grouped_linear(x, weight, bias, backend=...)`` without autograd."""

    def step(self):
        with torch.no_grad():
            return self.forward()

    def time_forward(self, *_):
        self.step()
        sync(self.device)


class ForwardBackward(_Product):
    """Training: forward, then backward to the input, weight and bias."""

    grad = True

    def step(self):
        self.forward().sum().backward()
        self.x.grad = self.w.grad = self.b.grad = None

    def time_forward_backward(self, *_):
        self.step()
        sync(self.device)
