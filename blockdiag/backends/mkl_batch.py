"""``mkl_batch``: MKL's batched GEMM on pointers into the row-major tensors, no layout copies.

Every per-group product of a block-diagonal layer is a plain row-major GEMM on strided
slices: ``x[:, g*in:(g+1)*in]`` is an ``[N, in]`` matrix with leading dimension ``G*in``, and
the same holds for ``y``, ``gy`` and ``gx``. BLAS takes such slices as they are. torch's
``bmm`` does not: it runs one batched call only when its output is contiguous ``[G, ., .]``,
so the batched backends pay a transposing copy of the input gradient in backward (and
``bmm`` of the output in forward; ``bmm_fm`` returns its output column-major instead), and
``loop`` pays one Python-level GEMM call per group. Here each of the three products (``y``,
``gx``, ``gw``) is one ``cblas_?gemm_batch`` call over ``G`` pointers into the tensors
themselves: nothing is copied, in forward or backward, and MKL spreads the ``G`` GEMMs over
torch's threads.

The symbols come from the MKL that torch's x86 builds link into ``libtorch_cpu``; a torch
built without MKL (ARM, macOS) makes the backend unavailable, with the reason. Its first
call runs a small product checked against ``torch.bmm`` and raises :class:`BlockDiagError`
if they differ, so a build whose MKL does not behave as assumed is never used; the
availability probe itself only looks up the symbols (see ``_probe``). All integer arguments
are passed as 64-bit integers holding values below ``2**31``: on little-endian x86-64 that
reads correctly under both the LP64 (32-bit) and the ILP64 (64-bit) MKL interface, and the
constraint declines sizes that would not fit 32 bits.

In the built-in CPU table (``blockdiag tune --full --mode both --max-gflop 20``, 2 threads)
it is the fastest at 4 of 83 training points, where the copies it saves are large (256x256
blocks at B=256 with G >= 16, and at B=2048 G=4), and at no forward point. Before ``simd``
existed it won 27 training and 11 forward points; ``simd`` took the small-block ones, and
once its weight gradient kept its accumulators in registers, the 64x64 and 150x10 ones too. At small products MKL's batched call costs more than torch's kernels
(without autograd, 5-7 us more at B=32 with 10x10 and 64x64 blocks, 18 us at B=256 G=16
10x10), so ``auto`` picks by the measured table. Under ``create_graph=True`` its backward is
``bmm``'s, written in differentiable ops, so double backward works (and ``auto``, which
picks this backend for training, stays usable for gradient penalties). Empty problems (a
zero batch or block side) run ``bmm_fm``'s torch ops, which give the right empty or
bias-only result and gradients.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Optional

import numpy as np
import torch

from ._registry import F32_F64, Backend, Problem, register
from ..ops import OpEntry, define
from .bmm import _fm_backward, bmm_fm_forward

# CBLAS enum values (cblas.h): row-major layout, no transpose, transpose.
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
# MKL's LP64 interface takes 32-bit integers; sizes beyond this are declined.
_INT32_MAX = 2**31 - 1
_SYMBOLS = {torch.float32: ("cblas_sgemm_batch", np.float32), torch.float64: ("cblas_dgemm_batch", np.float64)}


def _torch_cpu_library() -> str:
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    name = {"darwin": "libtorch_cpu.dylib", "win32": "torch_cpu.dll"}.get(sys.platform, "libtorch_cpu.so")
    return os.path.join(lib, name)


@functools.lru_cache(maxsize=None)
def _kernels() -> tuple[Optional[dict], Optional[str]]:
    """``({dtype: (function, [alpha, beta] array)}, None)``, or ``(None, why not)``."""
    if not torch.backends.mkl.is_available():
        return None, f"torch {torch.__version__} is built without MKL"
    path = _torch_cpu_library()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return None, f"cannot load torch's CPU library {path}: {e}"
    found = {}
    for dtype, (symbol, np_dtype) in _SYMBOLS.items():
        fn = getattr(lib, symbol, None)
        if fn is None:
            return None, f"torch's CPU library does not export MKL's {symbol}"
        fn.restype = None
        # Layout and group count by value, every other argument by address.
        fn.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 13 + [ctypes.c_int64, ctypes.c_void_p]
        found[dtype] = (fn, np.array([1.0, 0.0], dtype=np_dtype))
    return found, None


@functools.lru_cache(maxsize=256)
def _offsets(groups: int, step_a: int, step_b: int, step_c: int) -> np.ndarray:
    """Byte offsets ``[3, G]`` of every group's A, B and C matrix from its tensor's start."""
    return np.arange(groups, dtype=np.int64) * np.array([[step_a], [step_b], [step_c]], dtype=np.int64)


def _gemm(trans_a, trans_b, m, n, k, a, step_a, lda, b, step_b, ldb, c, step_c, ldc, groups):
    """``C_j = op(A_j) @ op(B_j)`` for ``j < groups``, row-major; ``A_j`` starts ``j*step_a`` elements into ``a``."""
    fn, scalars = _kernels()[0][c.dtype]
    size = c.element_size()
    ptrs = _offsets(groups, step_a * size, step_b * size, step_c * size) + np.array(
        [[a.data_ptr()], [b.data_ptr()], [c.data_ptr()]], dtype=np.int64
    )
    ints = np.array([trans_a, trans_b, m, n, k, lda, ldb, ldc, groups], dtype=np.int64)
    p, q, s = ptrs.ctypes.data, ints.ctypes.data, scalars.ctypes.data
    fn(_ROW_MAJOR, q, q + 8, q + 16, q + 24, q + 32, s, p, q + 40, p + 8 * groups, q + 48,
       s + scalars.itemsize, p + 16 * groups, q + 56, 1, q + 64)


def _rows(t: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
    """``t`` (2-d) as row-major rows with unit column stride, and its leading dimension.

    torch calls a tensor with one row contiguous whatever its row stride (``x.t()`` of an
    ``[W, 1]`` column has strides ``(1, 1)``), and MKL rejects a leading dimension below
    the width without computing anything; a single row's leading dimension addresses
    nothing, so it is given as the width.
    """
    if t.size(0) <= 1:
        return (t if t.size(1) <= 1 or t.stride(1) == 1 else t.contiguous()), max(width, 1)
    if t.stride(1) != 1 or t.stride(0) < width or t.stride(0) > _INT32_MAX:
        t = t.contiguous()
    return t, t.stride(0)


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The product, computed by MKL (no autograd)."""
    g, o, i = weight.shape
    n = x.shape[0]
    x, ldx = _rows(x, g * i)
    weight = weight.contiguous()
    y = x.new_empty(n, g * o)
    _gemm(_NO_TRANS, _TRANS, n, o, i, x, i, ldx, weight, o * i, i, y, o, g * o, g)
    if bias is not None:
        # After the GEMM rather than as its C operand (beta=1): filling y with the bias
        # first (an extra pass that MKL then reads) was slower at 25 of 28 points in the
        # prototype's comparison (14 shapes, both modes, interleaved medians).
        y.add_(bias)
    return y


def _kernel_backward(gy, x, weight, has_bias, need_x, need_w):
    """The three gradient products, computed by MKL (first order)."""
    g, o, i = weight.shape
    n = x.shape[0]
    if x.numel() == 0 or weight.numel() == 0:
        return _fm_backward(gy, x, weight, has_bias, need_x, need_w)
    x, ldx = _rows(x, g * i)  # as the forward read it (a copy only if it made one)
    weight = weight.contiguous()
    gy, ldy = _rows(gy, g * o)
    gx = gw = gb = None
    if need_x:
        # gx_g [N, in] = gy_g [N, out] @ W_g [out, in], written into its columns of gx.
        gx = x.new_empty(n, g * i)
        _gemm(_NO_TRANS, _NO_TRANS, n, i, o, gy, o, ldy, weight, o * i, i, gx, i, g * i, g)
    if need_w:
        # gw_g [out, in] = gy_g^T @ x_g: the weight's own layout.
        gw = weight.new_empty(g, o, i)
        _gemm(_TRANS, _NO_TRANS, o, i, n, gy, o, ldy, x, i, ldx, gw, o * i, i, g)
    if has_bias:
        gb = gy.sum(0)
    return gx, gw, gb


def _kernel_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``y[:, g*o:(g+1)*o] = x[:, g*i:(g+1)*i] @ weight[g].T + bias[g*o:(g+1)*o]``, one MKL batch call."""
    if x.numel() == 0 or weight.numel() == 0:
        return bmm_fm_forward(x, weight, bias)  # empty or bias-only: torch's ops
    return _forward(x, weight, bias)


def _operands_check(x, weight, bias) -> Optional[str]:
    if x.numel() == 0 or weight.numel() == 0:
        return None
    why = self_check(x.dtype)
    return None if why is None else f"{why}; this torch build's MKL cannot be used, choose another backend"


mkl_batch = define(OpEntry("mkl_batch", _kernel_forward, _kernel_backward, native=True, check=_operands_check))


def _probe() -> Optional[str]:
    # Only whether the symbols exist: the probe runs whenever backends are listed or a plan
    # is made, and running MKL here would start its OpenMP threads in a process that may
    # fork next (asv's benchmark server, DataLoader workers); a forked child then hangs in
    # its first parallel torch op. The numerical check waits for the first real call.
    return _kernels()[1]


def self_check(dtype: torch.dtype) -> Optional[str]:
    """Why MKL's batched GEMM cannot be used for ``dtype`` here (unavailable or failed check), or None."""
    return _kernels()[1] or _check()


@functools.lru_cache(maxsize=None)
def _check() -> Optional[str]:
    """Run a small product through MKL and compare with ``torch.bmm``: why it differs, or None."""
    # Slices whose leading dimensions exceed their widths, in every dtype declared, so a
    # build whose MKL reads the arguments differently is caught before any result is used.
    gen = torch.Generator().manual_seed(0)
    for dtype in _kernels()[0]:
        x = torch.randn(5, 3 * 4, generator=gen, dtype=dtype)
        w = torch.randn(3, 2, 4, generator=gen, dtype=dtype)
        want = torch.bmm(x.view(5, 3, 4).transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).reshape(5, 6)
        got = _forward(x, w, None)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            return f"MKL's batched GEMM did not match torch.bmm on a {str(dtype).replace('torch.', '')} check product"
    return None


def _constraint(p: Problem) -> Optional[str]:
    widest = max(p.batch, p.groups * p.block_in, p.groups * p.block_out)
    if widest > _INT32_MAX:
        return f"a matrix side of {widest} does not fit MKL's 32-bit integers (at most {_INT32_MAX})"
    return None


BACKEND = register(
    Backend(
        name="mkl_batch",
        fn=mkl_batch,
        dtypes={"cpu": F32_F64},
        constraint=_constraint,
        probe=_probe,
        summary="MKL batched GEMM on pointers into x, y and the gradients: no layout copies (CPU, MKL builds)",
    )
)
