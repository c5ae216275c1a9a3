"""``simd``: blockdiag's own register-blocked AVX-512 kernels, compiled for this CPU.

The library backends lose most of the ideal GEMM's speed on small blocks (10x10, 150x10):
each per-group product is too small for a BLAS call to pay for itself, and the batched
calls add layout copies or per-call overhead. These kernels are written for the
block-diagonal product itself (``_simd.c`` and ``_simd_body.h`` beside this module):

- a tile of up to 8 rows by up to 64 output columns is accumulated in vector registers
  while the group's weight streams through, with the input broadcast one element at a time;
  the weight is first repacked into zero-padded panels, by each thread for the groups it
  runs, in one parallel region (split by groups at small batches, by rows above);
- a forward block with few outputs and many inputs (at most 10 outputs and at least 64
  inputs in float32, 5 and 32 in float64: 150x10) takes a dot-product form instead: the
  vectors run along the inputs, so every lane is used, the weight is read in place with no
  repacking, and each output is a horizontal sum, reduced 16 at a time;
- input, output and gradient slices are read and written in place (row-major with any
  leading dimension, so a column slice of a wider tensor costs no copy);
- the weight gradient walks the rows in short blocks and carries the bias gradient in
  the same pass;
- the work is spread over torch's threads with OpenMP.

How it is built and found:

- The sources are compiled on first use, on the machine that runs them, with the C compiler
  ``$CC`` (default ``cc``): ``-O3 -march=native -fopenmp``.
- The shared library is cached in ``$XDG_CACHE_HOME/blockdiag/kernels`` (``~/.cache``), or
  in the system temporary directory when that is not writable. It is written to a temporary
  name and renamed, so concurrent first uses never load a half-written file.
- Its name hashes the sources, the flags, the compiler's version and this CPU's model and
  flags, so a home directory shared by different machines never loads a library built for
  another CPU.
- OpenMP resolves to the ``libgomp.so.1`` that torch has already loaded (the same soname),
  so the kernels share torch's thread pool rather than starting a second one.

The availability probe compiles (once per machine; about 10 s) and loads the library, but
runs nothing: running OpenMP code before a ``fork`` would hang the forked child's first
parallel op (see ``mkl_batch``). The backend is unavailable, with the reason, off Linux
x86-64, without AVX-512F, without a C compiler, or when compiling fails. The first call
checks the kernels against torch on small products in both dtypes and raises
:class:`BlockDiagError` if they differ.

It runs float32 and float64 on CPU. Under ``create_graph=True`` its backward is ``bmm``'s,
written in differentiable ops, so double backward works. Empty problems (a zero batch or
block side) run ``bmm_fm``'s torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from ._registry import F32_F64, Backend, register
from ..ops import OpEntry, define
from .bmm import _fm_backward, bmm_fm_forward

# Bumped with _simd.c's bd_abi_version() whenever an exported signature changes.
_ABI = 1
_SOURCES = ("_simd.c", "_simd_body.h")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    # name: (restype, argtypes); see _simd_body.h for the meaning of each argument.
    "bd_forward": (_INT, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT]),
    "bd_grad_input": (_INT, [_P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT]),
    "bd_grad_weight": (None, [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _INT]),
}


def _cpu_description() -> str:
    """This CPU's model name and feature flags (Linux's ``/proc/cpuinfo``, first processor)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    keep = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags") and key not in keep:
            keep[key] = value.strip()
    return f"{keep.get('model name', '')}|{keep.get('flags', '')}"


def kernel_dir() -> Path:
    """Where compiled kernels are cached: ``$XDG_CACHE_HOME/blockdiag/kernels`` (``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blockdiag" / "kernels"


def _build(cc: str, source_dir: Path, target: Path) -> Optional[str]:
    """Compile the kernels into ``target`` (atomically); why it failed, or None."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    cmd = [cc, *_FLAGS, "-o", str(tmp), str(source_dir / "_simd.c")]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"compiling the kernels with {cc} failed: {e}"
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = " ".join(done.stderr.strip().splitlines()[-3:])
        return f"compiling the kernels with {cc} failed (exit {done.returncode}): {tail}"
    os.replace(tmp, target)
    return None


@functools.lru_cache(maxsize=None)
def _library() -> tuple[Optional[dict], Optional[str]]:
    """``({dtype: (forward, grad_input, grad_weight)}, None)``, or ``(None, why not)``."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"needs Linux on x86-64 (this is {sys.platform} on {platform.machine()})"
    cpu = _cpu_description()
    if "avx512f" not in cpu.split("|")[-1].split():
        return None, "this CPU has no AVX-512F"
    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        return None, f"no C compiler: {os.environ.get('CC') or 'cc'} is not on PATH (set $CC)"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"cannot run the C compiler {cc}: {e}"
    source_dir = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for part in (str(_ABI), " ".join(_FLAGS), cc, version, cpu):
        digest.update(part.encode() + b"\0")
    for name in _SOURCES:
        digest.update((source_dir / name).read_bytes())
    name = f"simd-{digest.hexdigest()[:20]}.so"
    path = None
    for folder in (kernel_dir(), Path(tempfile.gettempdir()) / f"blockdiag-kernels-{os.getuid()}"):
        candidate = folder / name
        if candidate.exists():
            path = candidate
            break
        try:
            why = _build(cc, source_dir, candidate)
        except OSError:
            continue  # not writable: try the next folder
        if why is not None:
            return None, why
        path = candidate
        break
    if path is None:
        return None, f"no writable folder for the compiled kernels ({kernel_dir()} or the temporary directory)"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"cannot load the compiled kernels {path}: {e}"
    if lib.bd_abi_version() != _ABI:
        return None, f"{path} has kernel ABI {lib.bd_abi_version()}, this blockdiag needs {_ABI}"
    found = {}
    for dtype, sfx in _SUFFIX.items():
        fns = []
        for base, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, f"{base}_{sfx}")
            fn.restype, fn.argtypes = restype, argtypes
            fns.append(fn)
        found[dtype] = tuple(fns)
    return found, None


def _cols(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-d) with unit column stride; any row stride is read in place."""
    return t if t.size(1) <= 1 or t.stride(1) == 1 else t.contiguous()


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    g, o, i = weight.shape
    n = x.shape[0]
    x = _cols(x)
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = x.new_empty(n, g * o)
    fn = _library()[0][x.dtype][0]
    if fn(x.data_ptr(), x.stride(0), weight.data_ptr(), _ptr(bias), y.data_ptr(), y.stride(0), n, g, i, o,
          torch.get_num_threads()) != 0:
        raise MemoryError(f"simd: no memory for the packed weight of shape {list(weight.shape)}")
    return y


def _grad_input(gy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    g, o, i = weight.shape
    n = gy.shape[0]
    gx = gy.new_empty(n, g * i)
    fn = _library()[0][gy.dtype][1]
    if fn(gy.data_ptr(), gy.stride(0), weight.data_ptr(), gx.data_ptr(), gx.stride(0), n, g, i, o,
          torch.get_num_threads()) != 0:
        raise MemoryError(f"simd: no memory for the packed weight of shape {list(weight.shape)}")
    return gx


def _grad_weight(gy: torch.Tensor, x: torch.Tensor, shape, with_bias: bool):
    g, o, i = shape
    gw = gy.new_empty(g, o, i)
    gb = gy.new_empty(g * o) if with_bias else None
    fn = _library()[0][gy.dtype][2]
    fn(gy.data_ptr(), gy.stride(0), x.data_ptr(), x.stride(0), gw.data_ptr(), _ptr(gb), gy.shape[0], g, i, o,
       torch.get_num_threads())
    return gw, gb


def _kernel_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``y[:, g*o:(g+1)*o] = x[:, g*i:(g+1)*i] @ weight[g].T + bias[g*o:(g+1)*o]``, in the C kernels."""
    if x.numel() == 0 or weight.numel() == 0:
        return bmm_fm_forward(x, weight, bias)  # empty or bias-only: torch's ops
    return _forward(x, weight, bias)


def _kernel_backward(gy, x, weight, has_bias, need_x, need_w):
    """The gradients, computed by the kernels (first order)."""
    if x.numel() == 0 or weight.numel() == 0:
        return _fm_backward(gy, x, weight, has_bias, need_x, need_w)
    weight = weight.contiguous()
    gy = _cols(gy)
    gx = _grad_input(gy, weight) if need_x else None
    gw = gb = None
    if need_w:
        gw, gb = _grad_weight(gy, _cols(x), weight.shape, has_bias)
    elif has_bias:
        gb = gy.sum(0)
    return gx, gw, gb


def _operands_check(x, weight, bias) -> Optional[str]:
    if x.numel() == 0 or weight.numel() == 0:
        return None
    why = self_check(x.dtype)
    return None if why is None else f"{why}; choose another backend"


simd = define(OpEntry("simd", _kernel_forward, _kernel_backward, native=True, check=_operands_check))


def _probe() -> Optional[str]:
    # Compiles and loads, runs nothing (see the module docstring: fork safety).
    return _library()[1]


def self_check(dtype: torch.dtype) -> Optional[str]:
    """Why the kernels cannot be used for ``dtype`` here (unavailable or failed check), or None."""
    return _library()[1] or _check()


@functools.lru_cache(maxsize=None)
def _check() -> Optional[str]:
    """Run small products through every kernel and compare with torch: why they differ, or None."""
    # Shapes with partial vectors, several column chunks and row tiles, and leading
    # dimensions larger than the widths (column slices), in both dtypes.
    gen = torch.Generator().manual_seed(0)
    for dtype in _SUFFIX:
        for n, g, i, o in ((13, 3, 5, 7), (9, 2, 70, 19), (40, 2, 3, 33)):
            wide = torch.randn(n, g * i + 3, generator=gen, dtype=dtype)
            x = wide[:, 1 : 1 + g * i]
            w = torch.randn(g, o, i, generator=gen, dtype=dtype)
            b = torch.randn(g * o, generator=gen, dtype=dtype)
            gy = torch.randn(n, g * o, generator=gen, dtype=dtype)
            xs = x.reshape(n, g, i).transpose(0, 1)
            want_y = torch.bmm(xs, w.transpose(1, 2)).transpose(0, 1).reshape(n, g * o) + b
            gys = gy.reshape(n, g, o).transpose(0, 1)
            want_gx = torch.bmm(gys, w).transpose(0, 1).reshape(n, g * i)
            want_gw = torch.bmm(gys.transpose(1, 2), xs)
            gw, gb = _grad_weight(gy, x, w.shape, True)
            tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
            for what, got, want in (("forward", _forward(x, w, b), want_y), ("input gradient", _grad_input(gy, w), want_gx),
                                    ("weight gradient", gw, want_gw), ("bias gradient", gb, gy.sum(0))):
                if not torch.allclose(got, want, **tol):
                    return (f"the compiled {what} kernel did not match torch on a "
                            f"{str(dtype).replace('torch.', '')} check product of shape (N={n}, G={g}, {i}x{o})")
    return None


BACKEND = register(
    Backend(
        name="simd",
        fn=simd,
        dtypes={"cpu": F32_F64},
        probe=_probe,
        summary="blockdiag's own AVX-512 kernels, compiled for this CPU: register-blocked, no layout copies",
    )
)
