"""simd's kernels called through C++ torch operators instead of ctypes (``_simd_ops.cpp``).

Around each C kernel call, simd's Python wrapper checks every operand, allocates the result
and converts a dozen ctypes arguments: at small products that costs more than the product
(``blockdiag bench`` measures the effect). ``_simd_ops.cpp`` does the same checks, allocations and calls in C++,
as two ops reached through one dispatcher call each:

* ``blockdiag::simd_native(Tensor x, Tensor weight, Tensor? bias) -> Tensor``;
* ``blockdiag::simd_native_backward(Tensor grad, Tensor x, Tensor weight, bool has_bias,
  bool need_input, bool need_weight) -> (Tensor, Tensor, Tensor)``.

They are simd's kernels, not another backend: simd's op, its autograd and its routes are
unchanged, and call these where they called the C kernels. Each has a fake kernel; their
Autograd kernels refuse an operand with a forward-mode tangent, and give the outputs of a call
autograd records a node that raises when a gradient reaches it (their derivative is simd's).
Recording alone is allowed: torch's higher-order ops (``scan``) re-trace graphs that hold
these ops with grad mode on, and never differentiate that re-trace.

How they come to run, once per process:

* built on first use with the C++ compiler ``$CXX`` (default ``c++``) against the installed
  torch's headers and libraries (``-std=c++20``, torch's C++ ABI), and cached as
  simd's C library is: in the same private folder, with the same build record, checked the
  same way before it is loaded (see :mod:`blockdiag.backends.simd`); the name hashes the
  source, the flags, the compiler's version and torch's version and build;
* loaded once (its ops cannot be registered twice in one process);
* armed per dtype with the C kernels simd loaded, only after that dtype's self-check
  passed, and only when one small product through the ops equals the same product through
  ctypes; disarmed when simd loads another library.

When any step fails (no C++ compiler, no torch headers, a build error) simd runs through
ctypes as before, and :func:`note` says why. A call the ops refuse (an operand they cannot
take in place, which the ctypes wrapper copies, resolves or refuses precisely) falls back to
the ctypes wrapper for that call.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import threading
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from ._libcache import (
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

__all__ = ["NativeOps", "arm", "disarm", "note", "ops", "through_ctypes"]

_SOURCE = "_simd_ops.cpp"
_ABI = 1
_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++20")

# simd's gradients at blocks of this many elements (``in * out``) or more are torch's BLAS
# products instead of simd's kernels, in both routes (passed to _simd_ops.cpp at build time;
# simd.py's ctypes path reads it here): the input gradient one ``mm`` per group written into
# its slice, the weight gradient one ``bmm`` of strided views, the bias gradient a ``sum``,
# as the ``loop`` backend computes them. The kernels' register tiles stream the weight
# gradient's operands from cache row by row; at large blocks BLAS's packed panels were faster
# (scripts/bench_simd_blas_grads.py; docs/results/simd-blas-grads-avx512.json). The forward
# stays simd's at every size.
BLAS_GRADS_MIN_BLOCK = 256 * 256

# The weight gradient alone (and the bias's, then a ``sum``) is BLAS's from blocks of
# BLAS_WEIGHT_GRAD_MIN_BLOCK elements, over at most BLAS_WEIGHT_GRAD_MAX_ROWS rows, with at
# least BLAS_WEIGHT_GRAD_MIN_GROUPS groups: a reduction over that few rows gains nothing from
# the kernels' register tiles while BLAS's packed panels pay at such blocks, and one batched
# call pays for itself over many groups. Timed as whole training steps (the weight gradient
# by each method, the rest the same), BLAS was faster or level at every such point and
# slower with 4 groups or over more rows; the input gradient keeps the kernels there
# (scripts/bench_simd_blas_grads.py).
BLAS_WEIGHT_GRAD_MIN_BLOCK = 128 * 128
BLAS_WEIGHT_GRAD_MAX_ROWS = 256
BLAS_WEIGHT_GRAD_MIN_GROUPS = 16

# With many groups the batched call pays over more rows, where the block's reduction is over
# at least BLAS_WEIGHT_GRAD_MANY_MIN_IN inputs: with BLAS_WEIGHT_GRAD_MANY_GROUPS groups or
# more, the weight gradient is BLAS's over at most BLAS_WEIGHT_GRAD_MANY_MAX_ROWS rows. Timed
# as whole training steps from 320 to 768 rows with 32 and 50 groups, BLAS was faster at
# every such point up to 512 rows and level or mixed at 768; blocks of 64 inputs (64x256)
# were level or slower above 256 rows, and 16 groups mixed (scripts/bench_simd_blas_grads.py).
BLAS_WEIGHT_GRAD_MANY_GROUPS = 32
BLAS_WEIGHT_GRAD_MANY_MAX_ROWS = 512
BLAS_WEIGHT_GRAD_MANY_MIN_IN = 128


def blas_grads(rows: int, groups: int, block_in: int, block_out: int) -> tuple[bool, bool]:
    """Whether simd's (input, weight) gradients at this size are BLAS's products, not its kernels'.

    The rule both routes follow (``_simd_ops.cpp`` is built with its constants):
    :data:`BLAS_GRADS_MIN_BLOCK` for both gradients, then the ``BLAS_WEIGHT_GRAD_*`` constants
    for the weight gradient alone.

    >>> blas_grads(2048, 4, 256, 256), blas_grads(256, 16, 128, 128), blas_grads(257, 16, 128, 128)
    ((True, True), (False, True), (False, False))
    >>> blas_grads(512, 32, 128, 128), blas_grads(512, 32, 64, 256), blas_grads(513, 32, 128, 128)
    ((False, True), (False, False), (False, False))
    """
    area = block_in * block_out
    both = area >= BLAS_GRADS_MIN_BLOCK
    weight = area >= BLAS_WEIGHT_GRAD_MIN_BLOCK and (
        (rows <= BLAS_WEIGHT_GRAD_MAX_ROWS and groups >= BLAS_WEIGHT_GRAD_MIN_GROUPS)
        or (rows <= BLAS_WEIGHT_GRAD_MANY_MAX_ROWS and groups >= BLAS_WEIGHT_GRAD_MANY_GROUPS
            and block_in >= BLAS_WEIGHT_GRAD_MANY_MIN_IN))
    return both, both or weight


_PREFIX = "torchops-simd-"
_DTYPES = {torch.float32: 0, torch.float64: 1}
_LOCK = threading.Lock()


class NativeOps(NamedTuple):
    """The two ops (their default overloads) and the library that registered them."""

    forward: object
    backward: object
    library: ctypes.CDLL


def _torch_paths() -> tuple[list, Path]:
    """(include folders, library folder) of the installed torch."""
    root = Path(torch.__file__).resolve().parent
    return [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"], root / "lib"


def _command(cxx: tuple[str, ...], out: Path, source: Path) -> list:
    includes, libdir = _torch_paths()
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [*cxx, *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DBD_BLAS_GRADS_MIN_BLOCK={BLAS_GRADS_MIN_BLOCK}",
            f"-DBD_BLAS_WEIGHT_GRAD_MIN_BLOCK={BLAS_WEIGHT_GRAD_MIN_BLOCK}",
            f"-DBD_BLAS_WEIGHT_GRAD_MAX_ROWS={BLAS_WEIGHT_GRAD_MAX_ROWS}",
            f"-DBD_BLAS_WEIGHT_GRAD_MIN_GROUPS={BLAS_WEIGHT_GRAD_MIN_GROUPS}",
            f"-DBD_BLAS_WEIGHT_GRAD_MANY_GROUPS={BLAS_WEIGHT_GRAD_MANY_GROUPS}",
            f"-DBD_BLAS_WEIGHT_GRAD_MANY_MAX_ROWS={BLAS_WEIGHT_GRAD_MANY_MAX_ROWS}",
            f"-DBD_BLAS_WEIGHT_GRAD_MANY_MIN_IN={BLAS_WEIGHT_GRAD_MANY_MIN_IN}",
            *(f"-I{p}" for p in includes), "-o", str(out),
            "-x", "c++", str(source), f"-L{libdir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{libdir}"]


def _build(cxx: tuple[str, ...], source: Path, target: Path) -> Optional[str]:
    with _staging(target) as tmp:
        cmd = _command(cxx, tmp, source)
        try:
            why = _compile(cmd, "simd's C++ ops")
        except CompilerHung as e:
            return f"compiling simd's C++ ops failed: {e}"
        return why if why is not None else _install(tmp, target, cmd)


def _fake_forward(x, weight, bias):
    g, o, _ = weight.shape
    return x.new_empty(x.shape[0], g * o)


def _register(lib: ctypes.CDLL, path: Path) -> tuple[Optional[NativeOps], Optional[str]]:
    if not hasattr(lib, "bd_ops_abi_version"):
        return None, f"{path} does not export bd_ops_abi_version (not blockdiag's C++ ops)"
    lib.bd_ops_abi_version.restype, lib.bd_ops_abi_version.argtypes = ctypes.c_int, []
    if lib.bd_ops_abi_version() != _ABI:
        return None, f"{path} has ops ABI {lib.bd_ops_abi_version()}, this blockdiag needs {_ABI}"
    for name in ("bd_ops_set", "bd_ops_clear"):
        if not hasattr(lib, name):
            return None, f"{path} does not export {name}"
    lib.bd_ops_set.restype = ctypes.c_int
    lib.bd_ops_set.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.bd_ops_clear.restype, lib.bd_ops_clear.argtypes = None, []
    try:
        forward = torch.ops.blockdiag.simd_native.default
        backward = torch.ops.blockdiag.simd_native_backward.default
    except (AttributeError, RuntimeError) as e:
        return None, f"{path} loaded but registered no ops: {e}"
    from ..ops._define import _register_flops, fake_backward

    torch.library.register_fake("blockdiag::simd_native", _fake_forward)
    torch.library.register_fake("blockdiag::simd_native_backward", fake_backward)
    # Compiled graphs call these ops directly (blockdiag.ops.auto's native route): counted
    # there as simd's own ops are. (Once per process: a second library registers the same ops.)
    from torch.utils.flop_counter import flop_registry

    if forward.overloadpacket not in flop_registry:
        _register_flops(forward, backward)
    return NativeOps(forward, backward, lib), None


@functools.lru_cache(maxsize=None)
def _loaded() -> tuple[Optional[NativeOps], Optional[str]]:
    """``(ops, None)`` once the library is built and loaded in this process, else ``(None, why not)``.

    Never cleared: a library's ops are registered for the life of the process.
    """
    cxx, why = compiler_command("C++", "CXX", "c++")
    if cxx is None:
        return None, why
    includes, _ = _torch_paths()
    if not (includes[0] / "torch" / "library.h").is_file():
        return None, f"the installed torch has no C++ headers ({includes[0]})"
    try:
        version = run_compiler([*cxx, "--version"], VERSION_TIMEOUT_S).stdout
    except (OSError, CompilerHung) as e:
        return None, f"cannot run the C++ compiler {' '.join(cxx)}: {e}"
    source = Path(__file__).resolve().parent / _SOURCE
    digest = hashlib.sha256()
    # The command with placeholder paths: the source's content, not where it lies, names the build.
    for part in (str(_ABI), " ".join(_command(cxx, Path("out"), Path(_SOURCE))), version, torch.__version__,
                 str(torch.version.git_version)):
        digest.update(part.encode() + b"\0")
    digest.update(source.read_bytes())
    name = f"{_PREFIX}{digest.hexdigest()[:20]}.so"
    what = "simd's C++ ops"
    return _cached(name, lambda path: _fetch(path, lambda p: _build(cxx, source, p), _register, what), what)


# dtype -> NativeOps while armed with the current C library's kernels; dtype -> None once
# arming failed for that library (see _WHY).
_ARMED: dict = {}
_WHY: dict = {}


def ops(dtype: torch.dtype) -> Optional[NativeOps]:
    """The ops armed for ``dtype``, or None (not armed: the ctypes wrapper runs)."""
    return _ARMED.get(dtype)


def armed() -> dict:
    """``{dtype: NativeOps}`` for every dtype the ops are armed for now."""
    return {dt: o for dt, o in _ARMED.items() if o is not None}


def arm(dtype: torch.dtype, kernels: tuple, agree) -> None:
    """Hand ``dtype``'s self-checked C ``kernels`` (forward, input and weight gradient, ctypes
    functions) to the ops, once per loaded C library; ``agree(ops)`` says why a small product
    through them differs from the ctypes wrapper's, or None. Builds and loads the ops on the
    first call. Whether it worked is in :func:`ops` and :func:`note`.
    """
    with _LOCK:
        if dtype in _ARMED:
            return
        found, why = _loaded()
        if found is None or dtype not in _DTYPES:
            _ARMED[dtype], _WHY[dtype] = None, why or f"no ops for {dtype}"
            return
        addresses = [ctypes.cast(fn, ctypes.c_void_p).value for fn in kernels]
        if found.library.bd_ops_set(_DTYPES[dtype], *addresses) != 0:
            _ARMED[dtype], _WHY[dtype] = None, f"the ops refused the {dtype} kernels (a null address)"
            return
        why = agree(found)
        if why is not None:
            found.library.bd_ops_clear()
            _ARMED.clear()
            _ARMED[dtype], _WHY[dtype] = None, f"a product through the ops differs from ctypes: {why}"
            return
        _ARMED[dtype] = found
        _WHY.pop(dtype, None)


@contextlib.contextmanager
def through_ctypes():
    """Within it simd calls its kernels through ctypes, as without a C++ compiler; the ops stay
    armed and come back at exit. For comparing the two routes (tests, ``scripts/bench_simd_ops.py``).
    """
    global _ARMED
    saved = _ARMED
    _ARMED = dict.fromkeys(_DTYPES)  # every dtype present and not armed: nothing arms it meanwhile
    try:
        yield
    finally:
        _ARMED = saved


def disarm() -> None:
    """Take every dtype's kernels back (simd is loading another library): the ops refuse until armed again."""
    with _LOCK:
        _ARMED.clear()
        _WHY.clear()
        found = _loaded()[0] if _loaded.cache_info().currsize else None
        if found is not None:
            found.library.bd_ops_clear()


def note() -> str:
    """How simd's kernels are called here: through the C++ ops, or through ctypes and why."""
    armed = [str(d).removeprefix("torch.") for d, o in _ARMED.items() if o is not None]
    if armed:
        return f"called through C++ ops ({', '.join(sorted(armed))})"
    why = next(iter(_WHY.values()), None)
    if why is None and not _loaded.cache_info().currsize:
        # Nothing armed yet: say now what the first use will find, where it is cheap to know.
        why = compiler_command("C++", "CXX", "c++")[1]
    if why is not None:
        return f"called through ctypes: {why}"
    return "called through C++ ops once a dtype's kernels pass their self-check"
