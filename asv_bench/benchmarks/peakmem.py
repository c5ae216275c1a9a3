"""Peak memory of one forward+backward per backend.

asv's ``peakmem_`` is the process's peak resident memory (CPU); it includes the interpreter
and torch, so compare backends with each other, not with zero. On CUDA, ``CudaPeak.track_cuda_peak_mb``
reports ``torch.cuda.max_memory_allocated`` of the same step.
"""

import torch

import blockdiag

from .common import BACKENDS, DEVICES, grid, parse_block, require_backend, require_device, sync, try_run

# Large enough that the working set (x is 32 MiB at float32) dominates torch's baseline.
SHAPES = grid(["64/2048/64x64", "50/2048/150x10"], ["3/4/6x4"])


class ForwardBackward:
    """Inputs are allocated in ``setup``; the step itself allocates outputs and gradients."""

    params = (BACKENDS, DEVICES, SHAPES)
    param_names = ["backend", "device", "shape (groups/batch/in x out)"]

    def setup(self, backend, device, shape):
        require_device(device)
        require_backend(backend)
        g, n, block = shape.split("/")
        g, n = int(g), int(n)
        i, o = parse_block(block)
        if backend == "dense" and (g * i) * (g * o) > 1 << 24:
            raise NotImplementedError("dense block-diagonal matrix over 16M entries")
        self.x = torch.randn(n, g * i, device=device, requires_grad=True)
        self.w = torch.randn(g, o, i, device=device, requires_grad=True)
        self.b = torch.randn(g * o, device=device, requires_grad=True)
        self.backend, self.device = backend, device
        # Validate the backend on a tiny slice only: a full warm-up would set the peak here.
        try_run(lambda: blockdiag.grouped_linear(self.x[:1], self.w, self.b, backend=backend))

    def step(self):
        blockdiag.grouped_linear(self.x, self.w, self.b, backend=self.backend).sum().backward()
        sync(self.device)

    def peakmem_forward_backward(self, *_):
        self.step()


if "cuda" in DEVICES:

    class CudaPeak:
        """``torch.cuda.max_memory_allocated`` of the same step (only where CUDA is)."""

        params = (BACKENDS, ["cuda"], SHAPES)
        param_names = ForwardBackward.param_names
        setup = ForwardBackward.setup
        step = ForwardBackward.step

        def track_cuda_peak_mb(self, *_):
            torch.cuda.reset_peak_memory_stats()
            self.step()
            return torch.cuda.max_memory_allocated() / 2**20

        track_cuda_peak_mb.unit = "MiB"
