"""``grouped_mm``: one grouped GEMM over the ``G`` blocks through ``torch._grouped_mm``.

torch runs ``_grouped_mm`` as one fused CUTLASS kernel only for bfloat16 on GPUs of compute
capability 9.x or 10.x (Hopper, Blackwell datacenter); everywhere else it falls back to the
same ``bmm`` the ``bmm`` backend runs directly. So the backend is declared for bfloat16 on
CUDA only, reports itself unavailable without such a GPU, and declines unaligned blocks.

The kernel reads its operands through TMA, which needs 16-byte aligned base pointers and
leading strides: with 2-byte elements both block sides must be multiples of 8. torch's own
derivative of ``_grouped_mm`` rejects the broadcast (stride 0) gradients that ``sum()``
produces, so this module supplies the backward: the input gradient and the compact
per-block weight gradient are two more grouped GEMMs on a contiguous ``dY``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..ops import OpEntry, define
from ._registry import Backend, Problem, register

# TMA transfers need 16-byte alignment of base pointers and leading strides.
_ALIGN_BYTES = 16
# Compute-capability majors for which torch builds the fused bf16 grouped-GEMM kernel.
_FUSED_MAJORS = (9, 10)


def _grouped_mm_op() -> Optional[Callable]:
    """torch's grouped GEMM (public name first), or None on a torch without one."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when contiguous and 16-byte aligned, else an aligned contiguous copy."""
    if t.is_contiguous() and t.data_ptr() % _ALIGN_BYTES == 0:
        return t
    # A fresh allocation is aligned; .contiguous() alone would keep a misaligned offset.
    return t.clone(memory_format=torch.contiguous_format)


def _gmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    op = _grouped_mm_op()
    return op(a, b)


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ block_diag(*weight).T + bias`` as one grouped GEMM (bias added after: the op has none)."""
    g, o, i = weight.shape
    n = x.shape[0]
    xg = _aligned(x).view(n, g, i).transpose(0, 1)  # [G, N, in], row-major rows of stride G*in
    y = _gmm(xg, _aligned(weight).transpose(1, 2)).transpose(0, 1).reshape(n, g * o)  # [G, in, out] read column-major
    return y if bias is None else y + bias


def _backward(dy, x, weight, has_bias, need_x, need_w):
    g, o, i = weight.shape
    n = x.shape[0]
    dyg = _aligned(dy).view(n, g, o).transpose(0, 1)  # [G, N, out]
    dx = dw = db = None
    if need_x:
        # weight aligned only here: without an input gradient it may be a stand-in
        # (ops._define.kept_weight_for_backward), which aligning would copy to full size.
        dx = _gmm(dyg, _aligned(weight)).transpose(0, 1).reshape(n, g * i)
    if need_w:
        # dW[g] = dY[:, g]^T @ X[:, g]: compact [G, out, in], never the dense matrix.
        # x aligned only here: without a weight gradient it may be a stand-in
        # (ops._define.kept_for_backward), which aligning would copy to full size.
        dw = _gmm(dyg.transpose(1, 2), _aligned(x).view(n, g, i).transpose(0, 1))
    if has_bias:
        db = dy.sum(0)
    return dx, dw, db


grouped_mm = define(OpEntry("grouped_mm", _forward, _backward))


def _probe() -> str | None:
    if _grouped_mm_op() is None:
        return f"torch {torch.__version__} has no grouped GEMM (torch._grouped_mm)"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU of compute capability 9.x or 10.x (no CUDA device here)"
    # Problems (and so plans) are keyed by device type, not index: the capability checked
    # is the current device's. On a machine mixing GPU generations, name the backend per
    # device rather than relying on auto for this one.
    return _capability_reason(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability_reason(index: int) -> str | None:
    major, minor = torch.cuda.get_device_capability(index)
    if major not in _FUSED_MAJORS:
        return (
            f"torch fuses grouped GEMMs only on compute capability 9.x/10.x; cuda:{index} is "
            f"{major}.{minor} (where torch falls back to the bmm the 'bmm' backend runs)"
        )
    return None


def _constraint(p: Problem) -> str | None:
    if p.batch == 0:
        return "the grouped GEMM kernel is not run on an empty batch"
    step = _ALIGN_BYTES // torch.empty((), dtype=p.dtype).element_size()
    if p.block_in % step or p.block_out % step:
        return (
            f"block {p.block_in}x{p.block_out} (in x out): both sides must be multiples of "
            f"{step} for 16-byte aligned {str(p.dtype).replace('torch.', '')} rows"
        )
    return None


BACKEND = register(
    Backend(
        name="grouped_mm",
        double_grad=False,
        fn=grouped_mm,
        dtypes={"cuda": frozenset({torch.bfloat16})},
        constraint=_constraint,
        probe=_probe,
        summary="one fused grouped GEMM (torch._grouped_mm; bf16 on compute capability 9.x/10.x)",
    )
)
