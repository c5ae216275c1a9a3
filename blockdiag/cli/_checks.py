"""Refusals before any work starts: outputs that cannot be written, grids too large for the memory,
backends that cannot run here, plot formats and compilers that are not there."""

from __future__ import annotations

import os
from typing import Sequence

import torch


def _check_output(option: str, path: str | None, makes_dirs: bool = False) -> None:
    """Refuse an output file that cannot be written before the measuring, not after it.

    With ``makes_dirs`` (the profile, whose directories ``save_entry`` creates) a missing
    directory is fine where the nearest existing one above it is writable.
    """
    if path is None:
        return
    from .._errors import BlockDiagError

    try:
        _check_output_path(option, path, makes_dirs)
    except OSError as e:
        # pathlib's is_dir/exists raise for every error but a missing file: a name longer
        # than the file system takes (ENAMETOOLONG), a folder on the way that cannot be
        # searched. A traceback before, where each such path is no file to write.
        raise BlockDiagError(f"{option}: {path!r} cannot be used as a file: {e.strerror or e}") from None


def _check_output_path(option: str, path: str, makes_dirs: bool) -> None:
    from pathlib import Path

    from .._errors import BlockDiagError

    target = Path(path)
    if target.is_dir():
        raise BlockDiagError(f"{option}: {path!r} is a directory; name a file in it")
    if target.exists() and not target.is_file():
        from .._files import file_kind

        raise BlockDiagError(f"{option}: {path!r} is {file_kind(os.stat(target).st_mode)}, not a regular file")
    if target.exists() and not os.access(target, os.W_OK):
        raise BlockDiagError(f"{option}: {path!r} exists and is not writable")
    try:
        parent = target.resolve().parent
    except (RuntimeError, OSError) as e:  # a loop of symbolic links (RuntimeError before Python 3.13)
        raise BlockDiagError(f"{option}: {path!r} cannot be resolved to a file: {e}") from None
    if makes_dirs:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise BlockDiagError(f"{option}: the directory {parent} of {path!r} {what}")
    if not os.access(parent, os.W_OK):
        raise BlockDiagError(f"{option}: the directory {parent} of {path!r} is not writable")


def _check_distinct(paths: dict) -> None:
    """Refuse two options naming one file (``--profile`` and ``--plot``; ``--json`` and the
    profile bench reads): the second write would replace the first, or the results the profile.

    ``paths``: option -> path (None: not given).
    """
    from .._errors import BlockDiagError

    seen: dict[str, str] = {}
    for option, path in paths.items():
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise BlockDiagError(f"{seen[real]} and {option} name the same file ({path!r}): one would replace the other")
        seen[real] = option


def _check_settings() -> None:
    """Resolve every setting now, so that a bad ``BLOCKDIAG_*`` environment value raises its
    ``BlockDiagError`` before the measuring: ``auto`` reads them only when it first chooses,
    which in ``tune`` is the cross-check after the whole grid was timed and the profile
    written (an error exit, and ``--plot``'s map never drawn)."""
    from ..settings import get_settings

    get_settings()


def _check_simd_isa(backends, device: str) -> None:
    """``$BLOCKDIAG_SIMD_ISA`` naming a kernel variant this CPU cannot run (or none at all) is
    refused before a run that times every backend: simd was left out of it without a word
    (unavailable, as on a machine without a compiler), and ``tune``'s entry, without simd's
    times, ranked it after every measured backend at every shape on this machine. With
    ``--backends``, ``_check_backends`` says it where simd is named."""
    if backends is not None or device != "cpu":
        return
    from .._errors import BlockDiagError
    from ..backends import simd

    if not os.environ.get(simd.ISA_ENV, "").strip():
        return
    _, why = simd._choose_variant(simd._cpu_description())
    if why is not None:
        raise BlockDiagError(f"{why}: simd would be left out of every point measured (unset ${simd.ISA_ENV} "
                             "for the best variant this CPU runs)")


def _check_profile_input(path: str | None) -> None:
    """An explicitly named profile to read must exist (auto would fall back to the built-in
    table without a word); what is wrong inside one, auto reports as a ProfileWarning."""
    if path is None:
        return
    from pathlib import Path

    from .._errors import BlockDiagError

    try:
        exists = Path(path).exists()
    except OSError as e:  # as in _check_output: ENAMETOOLONG, a folder that cannot be searched
        raise BlockDiagError(f"--profile: {path!r} cannot be read: {e.strerror or e}") from None
    if not exists:
        raise BlockDiagError(f"--profile: {path!r} does not exist (blockdiag tune --profile {path} writes one)")


def _memory_limit() -> int:
    """Half the machine's memory (the grid's operands must fit beside everything else)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


# An nn.Linear module's own memory beside its tensors (measured: 3.8 KB on CPython 3.11, torch 2.13).
_MODULE_BYTES = 4096


def _check_grid_memory(grid, modes, dtype: torch.dtype, max_gflop: float, baselines: bool = False) -> None:
    """Refuse a grid whose largest point cannot fit, before allocating anything.

    The estimate is the operands of one point: input, output, weight and bias, and in
    training their gradients too (the backends' own workspace comes on top, so it is a
    lower bound); with ``baselines``, also the ``G`` ``nn.Linear`` modules the loop baseline
    builds and the ``G`` more of vmap's. Points skipped by ``--max-gflop`` do not count.
    """
    from .._errors import BlockDiagError

    size = torch.empty((), dtype=dtype).element_size()
    factor = 2 if "train" in modes else 1
    worst, worst_point = 0, None
    for n in grid.batch:
        for g in grid.groups:
            for i, o in grid.blocks:
                if 2 * n * g * i * o / 1e9 > max_gflop:
                    continue
                need = factor * size * (n * g * i + n * g * o + g * o * i + g * o)
                if baselines:
                    need += 2 * g * _MODULE_BYTES
                if need > worst:
                    worst, worst_point = need, f"B={n} G={g} {i}x{o}"
    limit = _memory_limit()
    if worst > limit:
        raise BlockDiagError(
            f"the grid's largest point ({worst_point}) needs at least {worst / 2**30:.1f} GiB for its operands"
            f"{' and the baseline nn.Linear modules' if baselines else ''}, more than half this machine's memory "
            f"({limit / 2**30:.1f} GiB); use smaller --batch/--groups/--blocks or --max-gflop"
            f"{' (--no-baselines skips the modules)' if baselines else ''}"
        )


def _check_demo_memory(args) -> None:
    from .._errors import BlockDiagError

    sizes = [args.in_features, *args.hidden, args.out_features]
    params = args.heads * sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    # Two models (the loop and the grouped copy), each with gradients and Adam's two moments;
    # the samples and their targets; float32.
    need = 4 * (2 * 4 * params + args.samples * (args.in_features + args.heads * args.out_features))
    limit = _memory_limit()
    if need > limit:
        raise BlockDiagError(
            f"--heads {args.heads}, --in-features {args.in_features}, --hidden {','.join(map(str, args.hidden))}, "
            f"--out-features {args.out_features} and --samples {args.samples} need about {need / 2**30:.1f} GiB, "
            f"more than half this machine's memory ({limit / 2**30:.1f} GiB)"
        )


def _check_backends(names_: Sequence[str] | None, device: str = "cpu", dtype: torch.dtype | None = None) -> None:
    """Every name known, and able to run at this device and dtype: a named backend that cannot
    would leave bench's rows and tune's profile without times."""
    from .._errors import BlockDiagError
    from ..backends import get

    for n in names_ or ():
        b = get(n, "--backends", auto_valid=False)
        why = b.unavailable_reason()
        if why is None and device not in b.dtypes:
            why = f"it does not run on {device} (runs on {', '.join(b.dtypes)})"
        if why is None and dtype is not None and dtype not in b.dtypes[device]:
            why = f"it does not take {str(dtype).replace('torch.', '')} on {device}"
        if why is not None:
            raise BlockDiagError(f"--backends: {n!r} cannot run here: {why}")


def _check_plot_format(path: str | None) -> None:
    """Refuse a ``--plot`` file whose extension matplotlib cannot write, before the measuring."""
    if path is None:
        return
    from .._errors import BlockDiagError
    from ..tuning.plot import MATPLOTLIB_HINT

    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise BlockDiagError(f"--plot needs matplotlib, which is not installed: {MATPLOTLIB_HINT}") from None
    formats = Figure().canvas.get_supported_filetypes()
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in formats:
        raise BlockDiagError(f"--plot: {path!r} has the extension {ext!r}, which matplotlib cannot write; "
                             f"use one of {', '.join(sorted(formats))}")


def _check_compiler(name: str) -> None:
    """``--compiler`` must be a torch.compile backend: found now, not after every point failed."""
    import torch._dynamo

    from .._errors import BlockDiagError

    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise BlockDiagError(f"--compiler: {name!r} is not a torch.compile backend here (e.g. "
                             f"{', '.join(n for n in ('inductor', 'aot_eager', 'eager') if n in known)})")
