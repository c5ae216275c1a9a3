"""``simd``: blockdiag's own register-blocked SIMD kernels, compiled for this CPU.

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
- at blocks of ``_simd_ops.BLAS_GRADS_MIN_BLOCK`` elements (256x256) or more the gradients
  are torch's BLAS products instead (the ``loop`` backend's backward): there BLAS's packed
  panels beat the kernels' register tiles, which stream the operands row by row;
- the work is spread over torch's threads with OpenMP.

Three variants of the one kernel body, one per instruction set (``_simd.c``'s macro sets):

- ``avx512``: AVX-512F, 16 float32 lanes, 32 registers, masked loads and stores for tails;
- ``avx2``: AVX2 + FMA (x86-64-v3), 8 lanes, 16 registers (smaller tiles), tails loaded
  through ``_mm256_maskload`` and stored in 128-, 64- and 32-bit pieces (a masked store is
  slow on AMD Zen);
- ``neon``: aarch64 Advanced SIMD, 4 lanes, 32 registers, tails through a zero-padded buffer.

The variant is chosen at first use from the CPU's features (``/proc/cpuinfo``'s flags on
x86-64; every aarch64 CPU has Advanced SIMD), the best it supports; ``$BLOCKDIAG_SIMD_ISA``
(``avx512``, ``avx2`` or ``neon``) forces another the CPU supports, for tests and comparisons
(one it does not support makes the backend unavailable, saying so). :func:`variant` says which
runs (``blockdiag explain`` prints it).

How it is built and found:

- The sources are compiled on first use, on the machine that runs them, with the C compiler
  ``$CC`` (default ``cc``; gcc and clang; with its arguments, if any: ``_libcache.compiler_command``):
  ``-O3`` and the variant's flags (``VARIANTS``:
  ``-march=native -mno-avx512f -mavx2 -mfma`` for avx2, ``-march=armv8-a`` for neon) with
  ``-fopenmp``, as C (``-x c``) whatever the driver, so ``CC=g++`` works too. When the
  compiler has no OpenMP (``-fopenmp`` fails: clang without libomp), the kernels are built
  without it and run on one thread.
- The shared library is cached in ``$XDG_CACHE_HOME/blockdiag/kernels`` (``~/.cache``). That
  folder and its parent are created private (mode 0700) and checked before use: owned by this
  user and writable by no one else (one of this user's that the group or others may write is
  made private); so must every folder above them be, root's or this user's (or sticky, as
  ``/tmp`` is), since whoever may write one could swap the cache for a folder of theirs
  between the file's checks and its loading. When the cache cannot be used, the library is built in a new private folder
  of the temporary directory (``mkdtemp``: an unpredictable name, mode 0700) for this process
  only: never at a predictable shared path, where another user could plant a library first.
- The library file carries a build record: its size and SHA-256, appended when it is built
  and renamed into place with it, so concurrent first uses never load a half-written file.
  A cached file is opened (no symbolic link followed), checked on that open file (a regular
  file owned by this user, writable by no one else, its size and content hash as recorded)
  and only then loaded, if its path still names that same file: a truncated, damaged or
  foreign file is rebuilt (or the backend reported unavailable with the reason), never mapped.
- Every symbol is looked up before use: a library without them (a C++ build, another
  library) makes the backend unavailable with the reason, as does a compiler that exits
  without producing a library.
- The exported entry points check their arguments (null pointers, negative sizes, leading
  dimensions below the widths, sizes whose products overflow) and return a code, which
  becomes a :class:`BlockDiagError` naming the argument and its value (see ``_simd.c``); the
  Python side first refuses anything but plain strided CPU tensors with real storage, and
  resolves negative and conjugate views before taking their pointers.
- Its name holds the variant and hashes the sources, the flags, the compiler's version and
  this CPU's model and flags, so a home directory shared by different machines never loads
  a library built for another CPU, and each variant has its own file.
- With gcc, OpenMP resolves to the ``libgomp.so.1`` that torch has already loaded (the same
  soname), so the kernels share torch's thread pool rather than starting a second one (clang
  links its own ``libomp``).

The availability probe compiles (once per machine: see docs/installation.md) and loads the library, but
runs nothing: running OpenMP code before a ``fork`` would hang the forked child's first
parallel op (see ``mkl_batch``). The first call's self-check and every product under
``BD_SERIAL_MACS`` multiply-adds (``_simd.c``) run on the calling thread and start no thread
pool either, as torch's own small ops. The backend is unavailable, with the reason, off Linux
x86-64 and aarch64, on an x86-64 CPU with neither AVX-512F nor AVX2 and FMA, when
``$BLOCKDIAG_SIMD_ISA`` asks for a variant this CPU cannot run, without a C compiler, or when
compiling fails. The first call in
a dtype checks that dtype's kernels against torch on small products (``self_check``: on
explicit CPU tensors, outside autocast, inference mode, ``torch.func`` transforms, dispatch
modes and ``torch.set_default_device``; the verdict cached per dtype) and raises
:class:`BlockDiagError`, saying what differed, if they do.

It runs float32 and float64 on CPU, and bfloat16 and float16 computed in float32 (the
operands cast up, the float32 kernels run, each result rounded once: ``UPCAST``). Under ``create_graph=True`` its backward is ``bmm``'s,
written in differentiable ops, so double backward works. Empty problems (a zero batch or
block side) run ``bmm_fm``'s torch ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Optional

import torch

from .._errors import BlockDiagError
from ._registry import F32_F64, Backend, register
from ..ops import OpEntry, define
from . import _simd_ops
from ._libcache import (
    UNCACHED,
    VERSION_TIMEOUT_S,
    CompilerHung,
    _cached,
    _compile,
    _fetch,
    _install,
    _staging,
    compiler_command,
    run_compiler,
)
from ._native import check_stored
from .bmm import _fm_backward, bmm_fm_forward
from .loop import _backward as _blas_backward

# Bumped with _simd.c's bd_abi_version() whenever an exported signature or return convention
# changes. 2: every entry point checks its arguments and returns a code (see _simd.c).
_ABI = 2
_SOURCES = ("_simd.c", "_simd_body.h")
_FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11")
# Tried first; a compiler without OpenMP (clang without libomp, ...) builds the serial kernels.
_OPENMP = "-fopenmp"
# The kernel variants, best first, with their compiler flags (see _simd.c). avx2 turns AVX-512
# off explicitly, so that forcing it on an AVX-512 CPU runs AVX2 code only.
VARIANTS = {
    "avx512": ("-march=native", "-DBD_ISA_AVX512"),
    "avx2": ("-march=native", "-mno-avx512f", "-mavx2", "-mfma", "-DBD_ISA_AVX2"),
    "neon": ("-march=armv8-a", "-DBD_ISA_NEON"),
}
_VARIANT_ISA = {"avx512": "AVX-512F", "avx2": "AVX2 and FMA", "neon": "aarch64 Advanced SIMD"}
ISA_ENV = "BLOCKDIAG_SIMD_ISA"
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    # name: (restype, argtypes, argument names); see _simd_body.h for the meaning of each argument.
    "bd_forward": (_INT, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT],
                   ("x", "ldx", "weight", "bias", "y", "ldy", "rows", "G", "I", "O", "nthreads")),
    "bd_grad_input": (_INT, [_P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT],
                      ("grad", "ldgrad", "weight", "grad_input", "ldgrad_input",
                       "rows", "G", "I", "O", "nthreads")),
    "bd_grad_weight": (_INT, [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _INT],
                       ("grad", "ldgrad", "x", "ldx", "grad_weight", "grad_bias",
                        "rows", "G", "I", "O", "nthreads")),
}
# The kinds of refusal in the entry points' return codes -(100 * kind + argument), see _simd.c.
_REFUSED = {
    1: "a null pointer for a non-empty matrix",
    2: "a negative size or a thread count below 1",
    3: "a leading dimension below its matrix's width",
    4: "an element count or byte offset that overflows 64 bits",
}
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _cpu_description() -> str:
    """This CPU's model and feature flags, ``"model|flags"`` (Linux's ``/proc/cpuinfo``, first processor).

    x86-64 lists ``model name`` and ``flags``; aarch64 ``CPU implementer``, ``CPU part`` and
    ``Features``.
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    keep = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags", "CPU implementer", "CPU part", "Features") and key not in keep:
            keep[key] = value.strip()
    model = keep.get("model name") or " ".join(keep.get(k, "") for k in ("CPU implementer", "CPU part")).strip()
    return f"{model}|{keep.get('flags') or keep.get('Features', '')}"


def _x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def _choose_variant(cpu: str) -> tuple[Optional[str], Optional[str]]:
    """``(variant, None)``: the kernel variant to build for this CPU (``cpu``: ``_cpu_description()``),
    the best it supports unless ``$BLOCKDIAG_SIMD_ISA`` names another it supports; else ``(None, why)``.
    """
    flags = set(cpu.split("|")[-1].split())
    if _x86():
        runs = [v for v, need in (("avx512", {"avx512f"}), ("avx2", {"avx2", "fma"})) if need <= flags]
    else:  # aarch64: Advanced SIMD is part of the base architecture
        runs = ["neon"]
    asked = os.environ.get(ISA_ENV, "").strip().lower()
    if asked:
        if asked not in VARIANTS:
            return None, f"{ISA_ENV}={asked!r} is not a kernel variant (one of {', '.join(VARIANTS)})"
        if asked not in runs:
            return None, (f"{ISA_ENV}={asked} asks for the {asked} kernels, which this CPU cannot run "
                          f"(no {_VARIANT_ISA[asked]}; it can run: {', '.join(runs) or 'none'})")
        return asked, None
    if not runs:
        return None, "this CPU has neither AVX-512F nor AVX2 with FMA"
    return runs[0], None


# What _library() last built or found: {"variant": ..., "openmp": bool or None, "forced": bool,
# "uncached": why it was built outside the cache, or None}.
_INFO: dict = {}


def variant() -> Optional[str]:
    """The kernel variant that runs here: ``"avx512"``, ``"avx2"`` or ``"neon"``; None when ``simd``
    is unavailable (see ``blockdiag.list_backends()`` for why).

    Chosen at first use from the CPU's features, the best it supports; ``$BLOCKDIAG_SIMD_ISA``
    forces another the CPU supports (a lower one, for tests and comparisons). Compiles and
    loads the kernels if that has not happened yet (once per machine).
    """
    return _INFO.get("variant") if _library()[1] is None else None


def variant_note() -> str:
    """One line saying which kernel variant ``simd`` runs here and how, or why it is unavailable."""
    why = _library()[1]
    if why is not None:
        return f"simd kernels: unavailable: {why}"
    v = _INFO.get("variant")
    threads = {True: "OpenMP threads", False: "serial: the compiler has no OpenMP", None: "threads unknown"}
    forced = f", forced by {ISA_ENV}" if _INFO.get("forced") else ""
    uncached = f"; {_INFO['uncached']}" if _INFO.get("uncached") else ""
    return (f"simd kernels: {v} ({_VARIANT_ISA.get(v, v)}; {threads[_INFO.get('openmp')]}{forced}); "
            f"{_simd_ops.note()}{uncached}")


def _build(cc: tuple[str, ...], source_dir: Path, target: Path, flags: tuple = ()) -> Optional[str]:
    """Compile the kernels into ``target`` with their build record (atomically); why it failed, or None.

    ``flags``: the variant's (``VARIANTS``). With OpenMP first; when that fails, once more
    without (the serial kernels: a compiler without OpenMP). Raises OSError when ``target``'s
    folder cannot be written.
    """
    with _staging(target) as tmp:
        for openmp in ((_OPENMP,), ()):
            # -x c: the sources are C whatever the driver (g++ would compile C++ and mangle the names).
            cmd = [*cc, *_FLAGS, *flags, *openmp, "-o", str(tmp), "-x", "c", str(source_dir / "_simd.c")]
            try:
                why = _compile(cmd, "the kernels")
            except CompilerHung as e:  # not retried without OpenMP: it would only wait again
                return f"compiling the kernels failed: {e}"
            if why is None:
                break
            if openmp:
                first = why
            elif first != why:
                why = f"{why} (and with {_OPENMP}: {first})"
        if why is not None:
            return why
        return _install(tmp, target, cmd)


def _entry_points(lib: ctypes.CDLL, path: Path, cc: str,
                  variant: Optional[str] = None) -> tuple[Optional[dict], Optional[str]]:
    """The kernels by dtype, or why ``lib`` lacks them (every symbol is looked up before use).

    ``variant``: the one ``lib`` must be, when it says (``bd_isa``); whether it runs on OpenMP
    threads (``bd_openmp``) goes to ``_INFO``.
    """
    if not hasattr(lib, "bd_abi_version"):
        return None, (f"{path} does not export bd_abi_version (built by {cc}: not compiled as C, "
                      f"or not blockdiag's kernels)")
    lib.bd_abi_version.restype, lib.bd_abi_version.argtypes = _INT, []
    abi = lib.bd_abi_version()
    if abi != _ABI:
        return None, f"{path} has kernel ABI {abi}, this blockdiag needs {_ABI}"
    if variant is not None and hasattr(lib, "bd_isa"):
        lib.bd_isa.restype, lib.bd_isa.argtypes = ctypes.c_char_p, []
        built = (lib.bd_isa() or b"").decode(errors="replace")
        if built != variant:
            return None, f"{path} holds the {built} kernels where {variant} was built"
    if hasattr(lib, "bd_openmp"):
        lib.bd_openmp.restype, lib.bd_openmp.argtypes = _INT, []
        _INFO["openmp"] = bool(lib.bd_openmp())
    found = {}
    for dtype, sfx in _SUFFIX.items():
        fns = []
        for base, (restype, argtypes, _) in _SIGNATURES.items():
            if not hasattr(lib, f"{base}_{sfx}"):
                return None, f"{path} does not export {base}_{sfx} (built by {cc})"
            fn = getattr(lib, f"{base}_{sfx}")
            fn.restype, fn.argtypes = restype, argtypes
            fns.append(fn)
        found[dtype] = tuple(fns)
    return found, None


def _load_or_build(cc: tuple[str, ...], source_dir: Path, path: Path,
                   variant: str = "avx512") -> tuple[Optional[dict], Optional[str], bool]:
    """The kernels from ``path``, built there first if missing or damaged: ``(kernels, why not, final)``."""
    return _fetch(path, lambda p: _build(cc, source_dir, p, VARIANTS[variant]),
                  lambda lib, p: _entry_points(lib, p, " ".join(cc), variant), "the compiled kernels")


# Serialises the first look in this process: lru_cache does not, so threads making their first
# simd call at once each compiled the library and renamed it over the others' copy, and a
# thread whose copy was replaced while it was loading found simd "unusable" (and, if it
# finished last, left that verdict cached for the process). Taken only on a cache miss; the
# threads that waited get the first one's result from ``_library_once``'s cache.
_LIBRARY_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _library() -> tuple[Optional[dict], Optional[str]]:
    """``({dtype: (forward, grad_input, grad_weight)}, None)``, or ``(None, why not)``."""
    with _LIBRARY_LOCK:
        return _library_once()


_clear_outer = _library.cache_clear


def _library_cache_clear() -> None:
    with _LIBRARY_LOCK:
        _library_once.cache_clear()
        _clear_outer()


@functools.lru_cache(maxsize=None)
def _library_once() -> tuple[Optional[dict], Optional[str]]:
    _INFO.clear()
    _simd_ops.disarm()  # the C++ ops hold the previous library's kernels
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return None, f"needs Linux on x86-64 or aarch64 (this is {sys.platform} on {platform.machine()})"
    cpu = _cpu_description()
    chosen, why = _choose_variant(cpu)
    if chosen is None:
        return None, why
    _INFO.update(variant=chosen, openmp=None, forced=bool(os.environ.get(ISA_ENV, "").strip()))
    cc, why = compiler_command("C", "CC", "cc")
    if cc is None:
        return None, why
    try:
        version = run_compiler([*cc, "--version"], VERSION_TIMEOUT_S).stdout
    except (OSError, CompilerHung) as e:
        return None, f"cannot run the C compiler {' '.join(cc)}: {e}"
    source_dir = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    # The variant and its flags are part of the key and of the name: one library per CPU and variant.
    for part in (str(_ABI), chosen, " ".join((*_FLAGS, *VARIANTS[chosen], _OPENMP)), " ".join(cc), version, cpu):
        digest.update(part.encode() + b"\0")
    for name in _SOURCES:
        digest.update((source_dir / name).read_bytes())
    name = f"simd-{chosen}-{digest.hexdigest()[:20]}.so"
    found = _cached(name, lambda path: _load_or_build(cc, source_dir, path, chosen), "the compiled kernels")
    _INFO["uncached"] = UNCACHED.get(name)
    return found


_library.cache_clear = _library_cache_clear  # forgets both caches (a forced variant, tests)


def _operand(arg: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` if the kernels may take its pointer (negative and conjugate bits resolved), else BlockDiagError.

    A plain strided CPU tensor (no subclass, FakeTensor or meta tensor) of ``dtype`` whose
    storage is allocated and holds every element of the view.
    """
    if type(t) not in _PLAIN or not t.is_cpu or t.layout is not torch.strided:
        raise BlockDiagError(
            f"simd: {arg} must be a plain strided CPU tensor for the compiled kernels, got "
            f"{type(t).__name__} on {t.device} with layout {t.layout}"
        )
    if t.dtype is not dtype:
        raise BlockDiagError(f"simd: {arg} must be {dtype} like the input, got {t.dtype}")
    if t.is_neg() or t.is_conj():
        t = t.resolve_neg().resolve_conj()  # the kernels read memory: apply the lazy negation
    check_stored("simd", arg, t)
    return t


def _cols(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-d) with unit column stride and a row stride of 0 or at least its width, bits resolved.

    Any other row stride is read in place (column slices of wider tensors); a row stride of 0
    (one row broadcast) too. Rows that partly overlap (0 < stride < width) are copied: the
    kernels refuse them.
    """
    if t.is_neg() or t.is_conj():
        t = t.resolve_neg().resolve_conj()
    if t.dim() != 2:
        return t
    rows, width = t.shape
    if (width > 1 and t.stride(1) != 1) or (rows > 1 and 0 < t.stride(0) < width):
        return t.contiguous()
    return t


def _matrix(arg: str, t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``_cols(_operand(arg, t, dtype))`` and its leading dimension, each attribute read once.

    The leading dimension is the row stride, or a single row's width. Every kernel call
    checks two or three operands this way, around products that are often small. A ``t``
    that is not 2-d comes back as it is with a leading dimension of 0, for the caller's
    shape check to refuse.
    """
    t = _operand(arg, t, dtype)
    if t.dim() != 2:
        return t, 0
    rows, width = t.shape
    ld, unit = t.stride()
    if (width > 1 and unit != 1) or (rows > 1 and 0 < ld < width):
        t, ld = t.contiguous(), width
    return t, (ld if rows > 1 else max(width, 1))


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _shape_error(what: str, **shapes) -> BlockDiagError:
    told = ", ".join(f"{k} {tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v)}"
                     for k, v in shapes.items())
    return BlockDiagError(f"simd: the {what} kernel got inconsistent shapes: {told}")


def _run(what: str, base: str, fn, *args) -> None:
    """Call kernel ``fn`` (``base``: its C name); a non-zero return code raises."""
    code = fn(*args)
    if code == 0:
        return
    names = _SIGNATURES[base][2]
    if code == -1:
        raise MemoryError(f"simd: no memory for the {what} kernel's packed weight "
                          f"(rows={args[names.index('rows')]}, G={args[names.index('G')]}, "
                          f"I={args[names.index('I')]}, O={args[names.index('O')]})")
    kind, k = divmod(-code, 100) if code < 0 else (0, 0)
    shown = ", ".join(f"{n}={v}" for n, v, t in zip(names, args, _SIGNATURES[base][1]) if t is not _P)
    if kind in _REFUSED and 1 <= k <= len(names):
        value = args[k - 1]
        value = "NULL" if value is None else (hex(value) if _SIGNATURES[base][1][k - 1] is _P else value)
        raise BlockDiagError(f"simd: the compiled {what} kernel refused {names[k - 1]}={value}: "
                             f"{_REFUSED[kind]} ({shown})")
    raise BlockDiagError(f"simd: the compiled {what} kernel returned the unknown code {code} ({shown})")


def _dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in _SUFFIX:
        raise BlockDiagError(f"simd: the kernels run float32 and float64, got {dtype}")
    return dtype


def _kernel(dtype: torch.dtype, which: int):
    """Kernel ``which`` (0 forward, 1 input gradient, 2 weight gradient) of ``dtype``, or BlockDiagError."""
    found, why = _library()
    if found is None:
        raise BlockDiagError(f"simd: {why}")
    return found[dtype][which]


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if x.dim() != 2 or weight.dim() != 3:
        raise _shape_error("forward", input=x, weight=weight)
    g, o, i = weight.shape
    n = x.shape[0]
    dtype = _dtype(x.dtype)
    x, ldx = _matrix("input", x, dtype)
    weight = _operand("weight", weight, dtype).contiguous()
    if bias is not None:
        bias = _operand("bias", bias, dtype).contiguous()
    if x.shape[1] != g * i or (bias is not None and tuple(bias.shape) != (g * o,)):
        raise _shape_error("forward", input=x, weight=weight, **({} if bias is None else {"bias": bias}))
    y = x.new_empty(n, g * o)
    # y is new and contiguous: its leading dimension is its width.
    _run("forward", "bd_forward", _kernel(dtype, 0), x.data_ptr(), ldx, weight.data_ptr(), _ptr(bias),
         y.data_ptr(), max(g * o, 1), n, g, i, o, torch.get_num_threads())
    return y


def _grad_input(gy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if gy.dim() != 2 or weight.dim() != 3:
        raise _shape_error("input gradient", grad=gy, weight=weight)
    g, o, i = weight.shape
    n = gy.shape[0]
    dtype = _dtype(gy.dtype)
    gy, ldg = _matrix("grad", gy, dtype)
    weight = _operand("weight", weight, dtype).contiguous()
    if gy.shape[1] != g * o:
        raise _shape_error("input gradient", grad=gy, weight=weight)
    gx = gy.new_empty(n, g * i)
    _run("input gradient", "bd_grad_input", _kernel(dtype, 1), gy.data_ptr(), ldg, weight.data_ptr(),
         gx.data_ptr(), max(g * i, 1), n, g, i, o, torch.get_num_threads())
    return gx


def _grad_weight(gy: torch.Tensor, x: torch.Tensor, shape, with_bias: bool):
    g, o, i = (int(s) for s in shape)
    dtype = _dtype(gy.dtype)
    gy, ldg = _matrix("grad", gy, dtype)
    x, ldx = _matrix("input", x, dtype)
    if (gy.dim() != 2 or x.dim() != 2 or gy.shape[0] != x.shape[0]
            or gy.shape[1] != g * o or x.shape[1] != g * i):
        raise _shape_error("weight gradient", grad=gy, input=x, weight=(g, o, i))
    gw = gy.new_empty(g, o, i)
    gb = gy.new_empty(g * o) if with_bias else None
    _run("weight gradient", "bd_grad_weight", _kernel(dtype, 2), gy.data_ptr(), ldg, x.data_ptr(), ldx,
         gw.data_ptr(), _ptr(gb), gy.shape[0], g, i, o, torch.get_num_threads())
    return gw, gb


@contextlib.contextmanager
def _isolated():
    """Plain eager CPU torch, whatever the caller's context: for the kernels' self-checks.

    Torch function modes (``torch.set_default_device``'s among them) and subclasses, dispatch
    modes (FakeTensorMode, FlopCounterMode, tracing), ``torch.func`` transforms, inference
    mode, autograd recording and autocast (CPU and CUDA) are all off inside, so a check runs
    the same products, in the same dtypes, wherever it is first called.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._C.DisableTorchFunction())
        stack.enter_context(_disable_current_modes())
        stack.enter_context(torch._C._DisableFuncTorch())
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        yield


def _mismatch(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> Optional[str]:
    """Where ``got`` differs from the float64 ``want`` beyond the tolerance (the largest gap), or None."""
    got = got.double()
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} where {tuple(want.shape)} was expected"
    bad = ~((got - want).abs() <= atol + rtol * want.abs())  # NaN counts as bad
    if not bool(bad.any()):
        return None
    err = torch.where(bad, (got - want).abs().nan_to_num(float("inf")), torch.zeros_like(want))
    at = tuple(int(v) for v in torch.unravel_index(err.argmax(), err.shape))
    return (f"{int(bad.sum())} of {want.numel()} elements differ, the largest at {list(at)}: "
            f"got {got[at].item():.9g}, expected {want[at].item():.9g} (rtol {rtol:g}, atol {atol:g})")


# The half dtypes are computed in float32: the operands are cast up, the float32 kernels run,
# and each result is rounded once to the half dtype. That is as precise as torch's own half
# products on CPU (which accumulate in float32), and on a CPU without half arithmetic the
# casts cost far less than torch's half GEMMs, which convert inside their inner loops.
UPCAST = frozenset({torch.bfloat16, torch.float16})


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute ``dtype`` in (float32 for the half dtypes)."""
    return torch.float32 if dtype in UPCAST else dtype


def _up(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is not None and t.dim() == 2 and t.shape[0] > 1 and t.stride(0) == 0:
        # The backward's stand-in for an input it does not read (ops._define.kept_for_backward):
        # one row cast, still expanded, not a full-size copy.
        return t[:1].float().expand(t.shape)
    if t is not None and t.numel() > 1 and not any(t.stride()):
        # Its stand-in for a weight it does not read (ops._define.kept_weight_for_backward).
        return t.reshape(-1)[:1].float().expand(t.shape)
    return None if t is None else t.float()


def _same_dtype(like: str, dtype: torch.dtype, **operands: Optional[torch.Tensor]) -> None:
    """BlockDiagError unless each operand has ``dtype``, as the kernels require of float32 and float64.

    Cast up, operands of different dtypes would all be float32, and the product would run and
    be rounded to one of them: a float32 weight would pass for a bfloat16 one.
    """
    for arg, t in operands.items():
        if t is not None and t.dtype != dtype:
            raise BlockDiagError(f"simd: {arg} must be {dtype} like the {like}, got {t.dtype}")


def _kernel_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``y[:, g*o:(g+1)*o] = x[:, g*i:(g+1)*i] @ weight[g].T + bias[g*o:(g+1)*o]``, in the C kernels."""
    if x.numel() == 0 or weight.numel() == 0:
        return bmm_fm_forward(x, weight, bias)  # empty or bias-only: torch's ops
    if x.dtype in UPCAST:
        _same_dtype("input", x.dtype, weight=weight, bias=bias)
        return _kernel_forward(_up(x), _up(weight), _up(bias)).to(x.dtype)
    native = _simd_ops.ops(x.dtype)
    if native is not None:
        try:
            return native.forward(x, weight, bias)
        except RuntimeError:
            pass  # refused: the ctypes wrapper copies or resolves the operands, or says precisely why not
    return _forward(x, weight, bias)


def _kernel_backward(gy, x, weight, has_bias, need_x, need_w):
    """The gradients, computed by the kernels (first order)."""
    if x.numel() == 0 or weight.numel() == 0:
        return _fm_backward(gy, x, weight, has_bias, need_x, need_w)
    if gy.dtype in UPCAST:
        _same_dtype("grad", gy.dtype, input=x, weight=weight)
        gx, gw, gb = _kernel_backward(_up(gy), _up(x), _up(weight), has_bias, need_x, need_w)
        return (None if gx is None else gx.to(x.dtype), None if gw is None else gw.to(weight.dtype),
                None if gb is None else gb.to(gy.dtype))
    native = _simd_ops.ops(gy.dtype)
    if native is not None:
        try:
            gx, gw, gb = native.backward(gy, x, weight, has_bias, need_x, need_w)
            return (gx if need_x else None), (gw if need_w else None), (gb if has_bias else None)
        except RuntimeError:
            pass  # refused: the ctypes wrappers copy or resolve the operands, or say precisely why not
    if need_x:  # else the weight may be a stand-in (see mkl_batch's backward)
        weight = weight.contiguous()
    gy = _cols(gy)
    blas_x, blas_w = _simd_ops.blas_grads(gy.shape[0], weight.shape[0], weight.shape[2], weight.shape[1])
    if blas_x:
        return _blas_backward(gy, _cols(x), weight, has_bias, need_x, need_w)
    gx = _grad_input(gy, weight) if need_x else None
    gw = gb = None
    if need_w and blas_w:
        _, gw, gb = _blas_backward(gy, _cols(x), weight, has_bias, False, True)
    elif need_w:
        gw, gb = _grad_weight(gy, _cols(x), weight.shape, has_bias)
    elif has_bias:
        gb = gy.sum(0)
    return gx, gw, gb


def _operands_check(x, weight, bias) -> Optional[str]:
    if x.numel() == 0 or weight.numel() == 0:
        return None
    why = self_check(compute_dtype(x.dtype))
    if why is not None:
        return f"{why}; choose another backend"
    _prepare_ops(compute_dtype(x.dtype))
    return None


def _prepare_ops(dtype: torch.dtype, device_type: str = "cpu") -> None:
    """Arm the C++ ops with ``dtype``'s kernels once they passed their self-check (built and
    loaded on the first call); nothing where they cannot run. Never raises."""
    if device_type != "cpu" or dtype in _simd_ops._ARMED or self_check(dtype) is not None:
        return
    # Checked: the C++ ops may call these kernels from now on.
    with _isolated():
        _simd_ops.arm(dtype, _library()[0][dtype], functools.partial(_ops_agree, dtype))


def _ops_agree(dtype: torch.dtype, native) -> Optional[str]:
    """Why products through the C++ ops ``native`` differ from the same through ctypes, or None.

    The same kernels on the same operands: every result must be bitwise equal. A column slice
    of a wider input checks the leading dimensions the ops pass.
    """
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 20, generator=gen, dtype=dtype)
    weight = torch.randn(3, 5, 4, generator=gen, dtype=dtype)
    bias = torch.randn(15, generator=gen, dtype=dtype)
    gy = torch.randn(6, 15, generator=gen, dtype=dtype)
    for x in (wide[:, :12].contiguous(), wide[:, 4:16]):
        if not torch.equal(native.forward(x, weight, bias), _forward(x, weight, bias)):
            return f"the forward on a {tuple(x.shape)} input with strides {x.stride()}"
        got = native.backward(gy, x, weight, True, True, True)
        want = (_grad_input(gy, weight), *_grad_weight(gy, x, weight.shape, True))
        for name, a, b in zip(("input", "weight", "bias"), got, want):
            if not torch.equal(a, b):
                return f"the {name} gradient on a {tuple(x.shape)} input with strides {x.stride()}"
    return None


simd = define(OpEntry("simd", _kernel_forward, _kernel_backward, native=True, check=_operands_check,
                      compiled_ops=_simd_ops.armed, prepare_ops=_prepare_ops))


def _probe() -> Optional[str]:
    # Compiles and loads, runs nothing (see the module docstring: fork safety).
    return _library()[1]


def self_check(dtype: torch.dtype) -> Optional[str]:
    """Why the kernels cannot be used for ``dtype`` here (unavailable, or a failed check), or None.

    Never raises; safe in any context (see :func:`_isolated`). The verdict is cached per dtype.
    """
    try:
        why = _library()[1]
        if why is not None:
            return why
        if dtype not in _SUFFIX:
            return f"the kernels run float32 and float64, not {dtype}"
        return _check(dtype)
    except Exception as e:  # noqa: BLE001  (a verdict, never an exception: not cached)
        return f"the self-check of the {dtype} kernels could not run: {type(e).__name__}: {e}"


_CHECKED: dict = {}


def _check(dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Run small products through every kernel of ``dtype`` (None: every dtype) and compare with torch.

    Why they differ, or None; cached per dtype (``_check.cache_clear()`` forgets).
    """
    if dtype is None:
        for d in _SUFFIX:
            why = _check(d)
            if why is not None:
                return why
        return None
    if dtype not in _CHECKED:
        with _isolated():
            _CHECKED[dtype] = _run_check(dtype)
    return _CHECKED[dtype]


_check.cache_clear = _CHECKED.clear


def _run_check(dtype: torch.dtype) -> Optional[str]:
    # Shapes with partial vectors, several column chunks and row tiles, and leading dimensions
    # larger than the widths (column slices). The last three take the forward's dot-product
    # form (``use_dot`` in _simd_body.h), with a partial last vector of inputs and partial row
    # tiles: 70x1 in every variant and dtype, 70x5 in AVX-512 and in AVX2 float32, 150x10 in
    # AVX-512 float32; the first three take the broadcast form only. Operands are rounded to
    # ``dtype``, the reference is computed from them in float64.
    gen = torch.Generator(device="cpu").manual_seed(0)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    for n, g, i, o in ((13, 3, 5, 7), (9, 2, 70, 19), (40, 2, 3, 33), (11, 2, 70, 1), (13, 3, 70, 5),
                       (9, 2, 150, 10)):
        def rand(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float64, device="cpu").to(dtype)

        wide = rand(n, g * i + 3)
        x, w, b, gy = wide[:, 1 : 1 + g * i], rand(g, o, i), rand(g * o), rand(n, g * o)
        # Broadcast products summed, not torch.bmm: bmm starts OpenMP's thread pool at any
        # size, and a process forked after its first simd call would hang in its child's
        # first parallel op (these products are below the grain size of torch's elementwise ops).
        xs, gys, wd = x.double().reshape(n, g, 1, i), gy.double().reshape(n, g, o, 1), w.double()
        want_y = (xs * wd).sum(-1).reshape(n, g * o) + b.double()
        want_gx = (gys * wd).sum(2).reshape(n, g * i)
        want_gw = (gys * xs).sum(0)
        gw, gb = _grad_weight(gy, x, w.shape, True)
        for what, got, want in (("forward", _forward(x, w, b), want_y),
                                ("input gradient", _grad_input(gy, w), want_gx),
                                ("weight gradient", gw, want_gw), ("bias gradient", gb, gy.double().sum(0))):
            why = _mismatch(got, want, **tol)
            if why is not None:
                return (f"the compiled {what} kernel did not match torch on a "
                        f"{str(dtype).replace('torch.', '')} check product of shape "
                        f"(N={n}, G={g}, {i}x{o}): {why}")
    return None


BACKEND = register(
    Backend(
        name="simd",
        fn=simd,
        dtypes={"cpu": F32_F64 | UPCAST},
        upcasts={"cpu": UPCAST},
        probe=_probe,
        summary=("blockdiag's own kernels (AVX-512, AVX2+FMA or NEON), compiled for this CPU: "
                 "register-blocked, no layout copies"),
    )
)
