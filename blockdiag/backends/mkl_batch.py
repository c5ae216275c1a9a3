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
call in a dtype runs that dtype's three products (forward, input and weight gradient) on
small slices, checked against torch in float64, and raises :class:`BlockDiagError`, saying
what differed, if they differ, so a build whose MKL does not behave as assumed is never used
(``self_check``: on explicit CPU tensors, outside autocast, inference mode, ``torch.func``
transforms, dispatch modes and ``torch.set_default_device``; cached per dtype); the
availability probe itself only looks up the symbols (see ``_probe``). ``_gemm`` refuses
with :class:`BlockDiagError` anything but plain strided CPU tensors of the kernel's dtype,
sizes beyond 32 bits and matrices that would reach outside their tensor's storage, and
applies negative and conjugate views before taking pointers. All integer arguments
are passed as 64-bit integers holding values below ``2**31``: on little-endian x86-64 that
reads correctly under both the LP64 (32-bit) and the ILP64 (64-bit) MKL interface, and the
constraint declines sizes that would not fit 32 bits.

A product under ``SERIAL_MACS`` multiply-adds (the ``BD_SERIAL_MACS`` of ``simd``'s
``_simd.c``) runs on the calling thread: MKL's batched call otherwise wakes its OpenMP pool
at any size, and a pool once started makes the process unsafe to fork (the child of a later
``fork`` hangs in its first parallel op), where torch's own small ops start none.
``MKL_Set_Num_Threads_Local(1)`` asks this thread's MKL calls for one thread, and the
previous thread-local value is restored after the call; a library without that symbol runs
every product as before. The self-check's products are that small, and its float64
reference is summed from elementwise products rather than taken from ``torch.bmm`` (whose
path, and threads, depend on the build), so a first call starts no pool either.

It wins where the copies it saves are large (large blocks at large batches); at small
products MKL's batched call costs more per call than torch's kernels, so ``auto`` picks by
the measured table. Under ``create_graph=True`` its backward is
``bmm``'s, written in differentiable ops, so double backward works (and ``auto``, which
picks this backend for training, stays usable for gradient penalties). Empty problems (a
zero batch or block side) run ``bmm_fm``'s torch ops, which give the right empty or
bias-only result and gradients.

The kernels are reached only through the ops ``blockdiag::mkl_batch`` and
``blockdiag::mkl_batch_backward``, which ``torch.compile`` treats as opaque: dynamo must not
trace into ``_gemm``, whose NumPy pointer arithmetic it would rebuild as torch ops, breaking
the graph around the ctypes call and handing MKL arguments it rejects.
``tests/test_transforms.py`` compiles this backend against the reference.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Optional

import numpy as np
import torch

from .._errors import BlockDiagError
from ._registry import F32_F64, Backend, Problem, register
from ..ops import OpEntry, define
from ._native import check_stored
from .bmm import _fm_backward, bmm_fm_forward

# CBLAS enum values (cblas.h): row-major layout, no transpose, transpose.
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
# MKL's LP64 interface takes 32-bit integers; sizes beyond this are declined.
_INT32_MAX = 2**31 - 1
_SYMBOLS = {torch.float32: ("cblas_sgemm_batch", np.float32), torch.float64: ("cblas_dgemm_batch", np.float64)}
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# Products (rows*G*O*I multiply-adds) below this run on the calling thread: simd's
# BD_SERIAL_MACS (_simd.c), see the module docstring.
SERIAL_MACS = 32768


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
        if not hasattr(lib, symbol):
            return None, f"torch's CPU library does not export MKL's {symbol}"
        fn = getattr(lib, symbol)
        fn.restype = None
        # Layout and group count by value, every other argument by address.
        fn.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 13 + [ctypes.c_int64, ctypes.c_void_p]
        found[dtype] = (fn, np.array([1.0, 0.0], dtype=np_dtype))
    return found, None


@functools.lru_cache(maxsize=None)
def _local_threads():
    """MKL's ``MKL_Set_Num_Threads_Local`` (an int by value, the previous value back), or None.

    Not the lowercase ``mkl_set_num_threads_local`` the library also exports: that one is the
    Fortran entry point, which reads its argument through a pointer (a C int there is a wild
    pointer read; mkl_service.h maps the lowercase C name to this one by a macro).
    """
    try:
        fn = ctypes.CDLL(_torch_cpu_library()).MKL_Set_Num_Threads_Local
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int]
    return fn


@functools.lru_cache(maxsize=256)
def _offsets(groups: int, step_a: int, step_b: int, step_c: int) -> np.ndarray:
    """Byte offsets ``[3, G]`` of every group's A, B and C matrix from its tensor's start."""
    return np.arange(groups, dtype=np.int64) * np.array([[step_a], [step_b], [step_c]], dtype=np.int64)


def _operand(arg: str, t: torch.Tensor, dtype: torch.dtype, output: bool = False) -> torch.Tensor:
    """``t`` if MKL may take its pointer (neg/conj bits resolved, strides kept), else BlockDiagError.

    A plain strided CPU tensor (no subclass, FakeTensor or meta tensor) of ``dtype``; an output
    must carry no negative or conjugate bit (what MKL writes would not be what ``t`` reads).
    """
    if type(t) not in _PLAIN or not t.is_cpu or t.layout is not torch.strided:
        raise BlockDiagError(
            f"mkl_batch: {arg} must be a plain strided CPU tensor for MKL, got "
            f"{type(t).__name__} on {t.device} with layout {t.layout}"
        )
    if t.dtype is not dtype:
        raise BlockDiagError(f"mkl_batch: {arg} must be {dtype}, got {t.dtype}")
    check_stored("mkl_batch", arg, t)
    if t.is_neg() or t.is_conj():
        if output:
            raise BlockDiagError(
                f"mkl_batch: {arg} is written by MKL and must not be a negative or conjugate view"
            )
        t = _resolved(t)
    return t



def _resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its negative and conjugate bits applied, with the same shape and strides.

    The span of storage the view covers is resolved as one vector and viewed again with
    ``t``'s strides, so a leading dimension computed from ``t`` still holds (``resolve_neg``
    alone may re-lay out a non-dense view, e.g. an expanded one).
    """
    if not (t.is_neg() or t.is_conj()):
        return t
    if t.numel() == 0:
        return t.resolve_neg().resolve_conj()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    span = t.as_strided((extent,), (1,), t.storage_offset()).resolve_neg().resolve_conj()
    return span.as_strided(t.shape, t.stride(), 0)


def _reach(arg: str, t: torch.Tensor, groups: int, step: int, rows: int, cols: int, ld: int) -> None:
    """BlockDiagError unless ``groups`` matrices ``rows x cols``, ``step`` apart, lie in ``t``'s storage."""
    if groups == 0 or rows == 0 or cols == 0:
        return
    if ld < max(cols, 1) or step < 0:
        raise BlockDiagError(f"mkl_batch: {arg}'s leading dimension {ld} is below its width {cols} "
                             f"(or its group step {step} is negative)")
    storage = t.untyped_storage()
    need = (groups - 1) * step + (rows - 1) * ld + cols
    have = storage.nbytes() // t.element_size() - t.storage_offset()
    if storage.data_ptr() == 0 or need > have:
        raise BlockDiagError(
            f"mkl_batch: {arg} holds {max(have, 0)} elements from its start (shape {tuple(t.shape)}, "
            f"storage of {storage.nbytes()} bytes), the GEMM would reach {need}: {groups} matrices of "
            f"{rows}x{cols}, leading dimension {ld}, {step} apart"
        )


def _gemm(trans_a, trans_b, m, n, k, a, step_a, lda, b, step_b, ldb, c, step_c, ldc, groups):
    """``C_j = op(A_j) @ op(B_j)`` for ``j < groups``, row-major; ``A_j`` starts ``j*step_a`` elements in ``a``.

    Every argument is checked first (plain CPU tensors of one dtype, sizes that fit 32 bits,
    every matrix inside its tensor's storage) and refused with BlockDiagError: MKL is never
    handed a pointer it could read or write out of bounds.
    """
    if torch.compiler.is_compiling():
        # Dynamo reached the kernel (a graph broken inside a torch.func transform resumes in
        # traced frames): it would trace the numpy arrays of sizes and pointers as tensors,
        # and MKL would read garbage ("Parameter 2 was incorrect", then garbage out). The
        # disabled call runs outside the trace, on the real values.
        return _untraced()(trans_a, trans_b, m, n, k, a, step_a, lda, b, step_b, ldb, c, step_c, ldc, groups)
    return _gemm_impl(trans_a, trans_b, m, n, k, a, step_a, lda, b, step_b, ldb, c, step_c, ldc, groups)


def _gemm_impl(trans_a, trans_b, m, n, k, a, step_a, lda, b, step_b, ldb, c, step_c, ldc, groups):
    found, why = _kernels()
    if found is None:
        raise BlockDiagError(f"mkl_batch: {why}")
    dtype = c.dtype
    if dtype not in found:
        raise BlockDiagError(f"mkl_batch: MKL's batched GEMM runs float32 and float64, got {dtype}")
    a = _operand("A", a, dtype)
    b = _operand("B", b, dtype)
    c = _operand("C", c, dtype, output=True)
    ints = (m, n, k, lda, ldb, ldc, groups)
    if trans_a not in (_NO_TRANS, _TRANS) or trans_b not in (_NO_TRANS, _TRANS) or not all(
        isinstance(v, int) and 0 <= v <= _INT32_MAX for v in ints
    ):
        raise BlockDiagError(
            f"mkl_batch: GEMM arguments out of range (transposes {trans_a}, {trans_b}; m={m} n={n} k={k} "
            f"lda={lda} ldb={ldb} ldc={ldc} groups={groups}: sizes must be integers in [0, {_INT32_MAX}])"
        )
    _reach("A", a, groups, step_a, *((m, k) if trans_a == _NO_TRANS else (k, m)), lda)
    _reach("B", b, groups, step_b, *((k, n) if trans_b == _NO_TRANS else (n, k)), ldb)
    _reach("C", c, groups, step_c, m, n, ldc)
    if groups == 0 or m == 0 or n == 0:
        return
    fn, scalars = found[dtype]
    size = c.element_size()
    ptrs = _offsets(groups, step_a * size, step_b * size, step_c * size) + np.array(
        [[a.data_ptr()], [b.data_ptr()], [c.data_ptr()]], dtype=np.int64
    )
    ints = np.array([trans_a, trans_b, m, n, k, lda, ldb, ldc, groups], dtype=np.int64)
    p, q, s = ptrs.ctypes.data, ints.ctypes.data, scalars.ctypes.data
    local = _local_threads() if m * n * k * groups < SERIAL_MACS else None
    previous = None if local is None else local(1)
    try:
        fn(_ROW_MAJOR, q, q + 8, q + 16, q + 24, q + 32, s, p, q + 40, p + 8 * groups, q + 48,
           s + scalars.itemsize, p + 16 * groups, q + 56, 1, q + 64)
    finally:
        if previous is not None:
            local(previous)  # torch's own: at::set_num_threads sets MKL's thread-local count


@functools.lru_cache(maxsize=None)
def _untraced():
    # Made on first use: torch.compiler.disable imports dynamo (and DTensor with it), which
    # importing blockdiag must not.
    return torch.compiler.disable(_gemm_impl, recursive=True)


def _rows(t: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
    """``t`` (2-d) as row-major rows with unit column stride, and its leading dimension.

    torch calls a tensor with one row contiguous whatever its row stride (``x.t()`` of an
    ``[W, 1]`` column has strides ``(1, 1)``), and MKL rejects a leading dimension below
    the width without computing anything; a single row's leading dimension addresses
    nothing, so it is given as the width. A negative or conjugate bit is resolved first:
    MKL reads the memory, not the view.
    """
    if t.is_neg() or t.is_conj():
        t = t.resolve_neg().resolve_conj()
    if t.size(0) <= 1:
        return (t if t.size(1) <= 1 or t.stride(1) == 1 else t.contiguous()), max(width, 1)
    if t.stride(1) != 1 or t.stride(0) < width or t.stride(0) > _INT32_MAX:
        t = t.contiguous()
    return t, t.stride(0)


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The product, computed by MKL (no autograd)."""
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[0] * weight.shape[2] or (
        bias is not None and tuple(bias.shape) != (weight.shape[0] * weight.shape[1],)
    ):
        raise BlockDiagError(
            f"mkl_batch: inconsistent shapes: input {tuple(x.shape)}, weight {tuple(weight.shape)}"
            + ("" if bias is None else f", bias {tuple(bias.shape)}")
        )
    if x.dtype not in _SYMBOLS:
        raise BlockDiagError(f"mkl_batch: input is {x.dtype}; MKL's batched GEMM runs float32 and float64")
    g, o, i = weight.shape
    n = x.shape[0]
    x, ldx = _rows(_operand("input", x, x.dtype), g * i)
    weight = _operand("weight", weight, x.dtype).contiguous()
    y = x.new_empty(n, g * o)
    _gemm(_NO_TRANS, _TRANS, n, o, i, x, i, ldx, weight, o * i, i, y, o, g * o, g)
    if bias is not None:
        # After the GEMM rather than as its C operand (beta=1): filling y with the bias
        # first (an extra pass that MKL then reads) was slower at 25 of 28 points in the
        # prototype's comparison (14 shapes, both modes, interleaved medians).
        y.add_(_operand("bias", bias, x.dtype))
    return y


def _kernel_backward(gy, x, weight, has_bias, need_x, need_w):
    """The three gradient products, computed by MKL (first order)."""
    g, o, i = weight.shape
    n = x.shape[0]
    if x.numel() == 0 or weight.numel() == 0:
        return _fm_backward(gy, x, weight, has_bias, need_x, need_w)
    gy, ldy = _rows(gy, g * o)
    gx = gw = gb = None
    if need_x:
        # Only here: without an input gradient the weight may be a stand-in
        # (ops._define.kept_weight_for_backward), which a contiguous copy would fill.
        weight = weight.contiguous()
        # gx_g [N, in] = gy_g [N, out] @ W_g [out, in], written into its columns of gx.
        gx = x.new_empty(n, g * i)
        _gemm(_NO_TRANS, _NO_TRANS, n, i, o, gy, o, ldy, weight, o * i, i, gx, i, g * i, g)
    if need_w:
        # Only here: without a weight gradient x may be a stand-in (ops._define.kept_for_backward).
        x, ldx = _rows(x, g * i)  # as the forward read it (a copy only if it made one)
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
    """Why MKL's batched GEMM cannot be used for ``dtype`` here (unavailable or failed check), or None.

    Never raises; safe in any context (the check runs in ``simd._isolated``: plain eager CPU
    torch). The verdict is cached per dtype.
    """
    try:
        found, why = _kernels()
        if found is None:
            return why
        if dtype not in found:
            return f"MKL's batched GEMM runs float32 and float64, not {dtype}"
        return _check(dtype)
    except Exception as e:  # noqa: BLE001  (a verdict, never an exception: not cached)
        return f"the self-check of MKL's {dtype} batched GEMM could not run: {type(e).__name__}: {e}"


_CHECKED: dict = {}


def _check(dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Run small products through MKL and compare with torch: why they differ, or None.

    ``dtype`` None: every dtype declared. Cached per dtype (``_check.cache_clear()`` forgets).
    """
    if dtype is None:
        for d in _kernels()[0] or ():
            why = _check(d)
            if why is not None:
                return why
        return None
    if dtype not in _CHECKED:
        from .simd import _isolated

        with _isolated():
            _CHECKED[dtype] = _run_check(dtype)
    return _CHECKED[dtype]


_check.cache_clear = _CHECKED.clear


def _run_check(dtype: torch.dtype) -> Optional[str]:
    # The three products the backend runs (forward, input and weight gradient), on slices whose
    # leading dimensions exceed their widths, so a build whose MKL reads the arguments
    # differently is caught before any result is used. Operands are rounded to ``dtype``; the
    # reference is computed from them in float64.
    from .simd import _mismatch

    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64, device="cpu").to(dtype)

    n, g, i, o = 5, 3, 4, 2
    x = rand(n, g * i + 2)[:, 1 : 1 + g * i]
    gy = rand(n, g * o + 3)[:, 2 : 2 + g * o]
    w = rand(g, o, i)
    gx = torch.empty(n, g * i, dtype=dtype, device="cpu")
    gw = torch.empty(g, o, i, dtype=dtype, device="cpu")
    _gemm(_NO_TRANS, _NO_TRANS, n, i, o, gy, o, gy.stride(0), w, o * i, i, gx, i, g * i, g)
    _gemm(_TRANS, _NO_TRANS, o, i, n, gy, o, gy.stride(0), x, i, x.stride(0), gw, o * i, i, g)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    # Broadcast products summed, not torch.bmm: these elementwise ops are below torch's grain
    # size and run on the calling thread, where bmm's path (parallel, or MKL's own batched
    # GEMM) depends on the build and the sizes; a pool started here would make a process
    # forked after its first mkl_batch call hang in its child's first parallel op.
    xs, gys, wd = x.double().reshape(n, g, 1, i), gy.double().reshape(n, g, o, 1), w.double()
    for what, got, want in (
        ("forward", _forward(x, w, None), (xs * wd).sum(-1).reshape(n, g * o)),
        ("input gradient", gx, (gys * wd).sum(2).reshape(n, g * i)),
        ("weight gradient", gw, (gys * xs).sum(0)),
    ):
        why = _mismatch(got, want, **tol)
        if why is not None:
            return (f"MKL's batched GEMM did not match torch's float64 product on a "
                    f"{str(dtype).replace('torch.', '')} check product ({what}, N={n}, G={g}, {i}x{o}): {why}")
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
