"""``bsr``: the block-diagonal weight as a torch ``sparse_bsr`` tensor.

torch's BSR kernels need square blocks (MKL on CPU; on CUDA cuSPARSE for float64 and
Triton or a blocked-``bmm`` fallback for float16/bfloat16/float32), so each ``out x in``
block is stored as square sub-blocks of side ``gcd(out, in)``; ``dense @ BSR`` is not
implemented on CPU, so the product runs as ``y^T = W_bsr @ x^T``. torch has no BSR
backward: the shared autograd function supplies it.

On CUDA torch takes its Triton kernel when the sub-block side is a power of two of at
least 16 and divides the batch (:func:`triton_applies`), and its blocked fallback
otherwise; a side of 1 (coprime block sides) is refused there, since cuSPARSE asserts
blocks larger than 1x1 (the ``csr`` backend is the same layout then).

On CUDA the sub-block side is also capped at :data:`CUDA_MAX_SUBBLOCK` (64): the largest
divisor of ``gcd(out, in)`` not above it (:func:`subblock_side`). With 256x256 sub-blocks
torch's Triton kernel hung in float32 and asked for more shared memory than an H200 has in
bfloat16 (``OutOfResources``); 64x64 sub-blocks run. A 256x256 block is then 16 stored
64x64 sub-blocks: the same values, no zeros added.
"""

from __future__ import annotations

import importlib.util

import torch

from ..construct import _sparse_bsr, square_blocksize
from ._registry import F32_F64, FLOATS, Backend, Problem, register
from ._sparse import sparse_entry

# The dtypes torch's Triton BSR kernel accepts (torch/sparse/_triton_ops.py, check_dtype).
TRITON_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})


# The largest square sub-block side used on CUDA (see the module docstring).
CUDA_MAX_SUBBLOCK = 64


def subblock_side(block_out: int, block_in: int, device: str) -> int:
    """The side of the square sub-blocks the ``bsr`` backend stores an ``out x in`` block as.

    ``gcd(out, in)`` on CPU; on CUDA its largest divisor not above :data:`CUDA_MAX_SUBBLOCK`.

    >>> subblock_side(256, 256, "cpu"), subblock_side(256, 256, "cuda"), subblock_side(150, 10, "cuda")
    (256, 64, 10)

    Args:
        block_out: rows of one diagonal block.
        block_in: columns of one diagonal block.
        device: the device type the product runs on.

    Returns:
        the sub-block side (1 when the sides are coprime).
    """
    s = square_blocksize(block_out, block_in)[0]
    if device != "cuda" or s <= CUDA_MAX_SUBBLOCK:
        return s
    return max(d for d in range(1, CUDA_MAX_SUBBLOCK + 1) if s % d == 0)


def _spmm(w: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    _, r, c = w.shape
    s = subblock_side(r, c, w.device.type)
    return _sparse_bsr(w.contiguous(), (s, s)) @ dense


bsr = sparse_entry("bsr", _spmm)


def triton_applies(p: Problem) -> bool:
    """Whether torch runs the forward product of ``p`` through its Triton BSR kernel.

    Mirrors ATen's ``operands_support_triton_mm_kernel``: CUDA, float16/bfloat16/float32,
    a square sub-block side (:func:`subblock_side`) that is a power of two of at least 16 and divides the number
    of dense columns (the batch), and Triton installed.

    >>> triton_applies(Problem(batch=64, groups=8, block_in=32, block_out=64, device="cpu"))
    False

    Args:
        p: the problem.

    Returns:
        True when the Triton kernel would run the forward product.
    """
    s = subblock_side(p.block_out, p.block_in, p.device)
    return (
        p.device == "cuda"
        and p.dtype in TRITON_DTYPES
        and s >= 16
        and s & (s - 1) == 0
        and p.batch % s == 0
        and importlib.util.find_spec("triton") is not None
    )


def _constraint(p: Problem) -> str | None:
    if p.device == "cuda" and subblock_side(p.block_out, p.block_in, p.device) == 1:
        return (
            f"block {p.block_in}x{p.block_out} (in x out) has coprime sides, so its square "
            "sub-blocks are 1x1, which torch's CUDA BSR product rejects (use 'csr')"
        )
    return None


BACKEND = register(
    Backend(
        name="bsr",
        double_grad=False,
        fn=bsr,
        dtypes={"cpu": F32_F64, "cuda": FLOATS},
        sparse=True,
        constraint=_constraint,
        summary="torch sparse BSR product (square sub-blocks; Triton on CUDA), per-block weight gradient",
        reduced_precision={"cuda": (frozenset({torch.float32}), "torch's Triton BSR kernel computes float32 in TF32")},
    )
)
