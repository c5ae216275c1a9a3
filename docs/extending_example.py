"""Add your own backend: an einsum multiply, registered, run by name, screened by ``auto``."""

import torch

import blockdiag
from blockdiag.dispatch import candidates


def einsum_grouped(x, weight, bias):
    """x [N, G*in], weight [G, out, in], bias [G*out] or None -> y [N, G*out]."""
    g, o, i = weight.shape
    y = torch.einsum("ngi,goi->ngo", x.view(x.shape[0], g, i), weight)
    y = y.reshape(x.shape[0], g * o)
    return y if bias is None else y + bias


def small_blocks_only(problem):
    """A shape rule: the reason this backend declines a problem, or None."""
    if problem.block_in > 1024:
        return f"block_in={problem.block_in} > 1024"
    return None


blockdiag.register_backend(
    blockdiag.Backend(
        name="einsum",
        fn=einsum_grouped,
        dtypes={"cpu": frozenset({torch.float32, torch.float64}),
                "cuda": frozenset({torch.float16, torch.bfloat16, torch.float32})},
        constraint=small_blocks_only,
        summary="torch.einsum over the [N, G, in] view",
    )
)

# Run it by name: forward and backward (autograd differentiates the torch ops in fn).
layer = blockdiag.GroupedLinear(4 * 16, 4 * 8, groups=4, backend="einsum")
x = torch.randn(32, 64, requires_grad=True)
y = layer(x)
y.sum().backward()
reference = torch.cat([x[:, 16 * g:16 * (g + 1)] @ layer.weight[g].T for g in range(4)], 1) + layer.bias
assert torch.allclose(y, reference, atol=1e-5)
assert x.grad is not None and layer.weight.grad is not None

# It is listed, and auto screens it like the built-in backends (until `blockdiag tune`
# has measured it, auto ranks it after the measured ones).
assert "einsum" in [b.name for b in blockdiag.list_backends()]
assert "einsum" in candidates(blockdiag.Problem(batch=32, groups=4, block_in=16, block_out=8))
assert "einsum" not in candidates(blockdiag.Problem(batch=32, groups=4, block_in=2048, block_out=8))
print(blockdiag.choose(blockdiag.Problem(batch=32, groups=4, block_in=16, block_out=8)))

# A second backend of the same name is refused; remove it to register another.
try:
    blockdiag.register_backend(blockdiag.Backend(name="einsum", fn=einsum_grouped))
except blockdiag.BlockDiagError as e:
    print(e)  # register: a backend named 'einsum' is already registered
blockdiag.unregister_backend("einsum")
