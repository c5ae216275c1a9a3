"""The command line's argument types: each parses one option's value or says what is wrong with it."""

from __future__ import annotations

import argparse
import math

import torch


def _parse_hidden(s: str) -> list[int]:
    try:
        out = [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hidden must be comma-separated ints, got {s!r}") from None
    if any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"--hidden sizes must be positive, got {s!r}")
    return out


def _scalar(s: str, convert, ok, want: str):
    """``convert(s)`` if it parses and ``ok`` accepts it, else argparse's error naming ``want``."""
    try:
        v = convert(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {want}, got {s!r}") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(f"must be {want}, got {s}")
    return v


def _positive(s: str) -> int:
    return _scalar(s, int, lambda v: v >= 1, "a positive int")


def _seed(s: str) -> int:
    # torch.manual_seed takes a 64-bit value; anything else is an error here, not in torch.
    return _scalar(s, int, lambda v: 0 <= v < 2**64, "an int in [0, 2**64)")


def _learning_rate(s: str) -> float:
    # Bounded: optimizers turn a huge rate into overflow errors of their own, mid-run.
    return _scalar(s, float, lambda v: 0 < v <= 1e6, "a positive number at most 1e6")


def _int_list(s: str) -> tuple[int, ...]:
    try:
        out = tuple(dict.fromkeys(int(v) for v in s.split(",") if v.strip()))  # a repeat measured once
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None
    if not out or any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"expected positive ints, got {s!r}")
    return out


def _block(s: str) -> tuple[int, int]:
    parts = s.lower().split("x")
    try:
        i, o = (int(v) for v in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a block is IN x OUT such as 150x10, got {s!r}") from None
    if i < 1 or o < 1:
        raise argparse.ArgumentTypeError(f"block sizes must be positive, got {s!r}")
    return i, o


def _blocks(s: str) -> tuple[tuple[int, int], ...]:
    out = tuple(dict.fromkeys(_block(v) for v in s.split(",") if v.strip()))
    if not out:
        raise argparse.ArgumentTypeError(f"expected blocks IN x OUT such as 10x10,150x10, got {s!r}")
    return out


def _kernel_grid_options(ap: argparse.ArgumentParser, rounds: int, batch: tuple[int, ...], groups: tuple[int, ...],
                         blocks: tuple[tuple[int, int], ...]) -> None:
    """The options of the scripts that time ``simd``'s kernels over a grid (``scripts/bench_simd_*.py``),
    with each script's own defaults: rounds, sample length, dtype, the grid, the JSON output."""
    ap.add_argument("--rounds", type=_positive, default=rounds, help=f"interleaved rounds (default {rounds})")
    ap.add_argument("--min-time", type=_finite_nonneg_float, default=0.01,
                    help="seconds each sample lasts at least (default 0.01)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--batch", type=_int_list, default=batch, help="rows, comma-separated")
    ap.add_argument("--groups", type=_int_list, default=groups, help="groups, comma-separated")
    ap.add_argument("--blocks", type=_blocks, default=blocks, help="blocks IN x OUT, comma-separated")
    ap.add_argument("--json", type=_output_json, help="write the rows and how they were measured here")


# The dtypes blockdiag's layers take (floating point); each backend declares its own subset.
_DTYPES = ("float32", "float64", "float16", "bfloat16")


def _dtype(s: str) -> torch.dtype:
    if s.replace("torch.", "") not in _DTYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(_DTYPES)}, got {s!r}")
    return getattr(torch, s.replace("torch.", ""))


def _known_device(s: str, meta_why: str) -> str:
    """The device type of ``s`` if torch knows it, is not ``meta`` and some backend runs on it."""
    try:
        kind = torch.device(s).type
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {s!r} (e.g. cpu, cuda)") from None
    if kind == "meta":
        raise argparse.ArgumentTypeError(f"'meta' tensors hold no data: {meta_why} (use cpu or cuda)")
    _check_some_backend_runs_on(s, kind)
    return kind


def _device(s: str) -> str:
    """A device type this machine has (``cpu``, ``cuda``, ...): checked before anything runs."""
    kind = _known_device(s, "there is nothing to time")
    if kind != "cpu":
        available = getattr(getattr(torch, kind, None), "is_available", None)
        if available is None or not available():
            raise argparse.ArgumentTypeError(f"{s!r}: this machine has no {kind} device")
    return kind


def _device_type(s: str) -> str:
    """A device type torch knows, for ``explain`` (which plans and runs nothing: none is needed)."""
    return _known_device(s, "no backend runs on them")


def _check_some_backend_runs_on(s: str, kind: str) -> None:
    from ..backends import get, names

    devices = sorted({d for n in names() for d in get(n).dtypes})
    if kind not in devices:
        raise argparse.ArgumentTypeError(f"{s!r}: no backend runs on {kind} (they run on {', '.join(devices)})")


def _nonneg_float(s: str) -> float:
    return _scalar(s, float, lambda v: v >= 0, "a number >= 0")  # NaN fails v >= 0


def _finite_nonneg_float(s: str) -> float:
    return _scalar(s, float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")


def _backend_list(s: str) -> list[str]:
    out = list(dict.fromkeys(v.strip() for v in s.split(",") if v.strip()))
    if not out:
        raise argparse.ArgumentTypeError(f"must name at least one backend, got {s!r}")
    return out


def _path(s: str) -> str:
    """A file name: an empty one is an error, not "the default" (tune would write the user's profile)."""
    if not s.strip():
        raise argparse.ArgumentTypeError(f"must name a file, got {s!r}")
    return s


def _output_json(s: str) -> str:
    """The scripts' ``--json FILE``, refused now where it cannot be written, as ``bench --json`` is
    (``_check_output``): the scripts write it after minutes of measuring, and a missing folder,
    a directory or a FIFO there was a traceback with the rows lost."""
    from .._errors import BlockDiagError
    from ._checks import _check_output

    _path(s)
    try:
        _check_output("--json", s)
    except BlockDiagError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--json: ")) from None
    return s


def _compiler(s: str) -> str:
    """A torch.compile backend's name: an empty one is an error, not "the default" (inductor)."""
    if not s.strip():
        raise argparse.ArgumentTypeError(f"must name a torch.compile backend (e.g. inductor), got {s!r}")
    return s


def _compiled_models(s: str) -> tuple[str, ...]:
    from ..tuning import COMPILED_MODELS

    out = tuple(dict.fromkeys(v.strip() for v in s.split(",") if v.strip()))
    bad = [v for v in out if v not in COMPILED_MODELS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(COMPILED_MODELS)}, got {s!r}")
    return out


def _modes(args) -> tuple[str, ...]:
    return ("forward", "train") if args.mode == "both" else (args.mode,)


def _grid(args, default: str):
    from ..tuning import GRIDS, Grid

    base = GRIDS["full" if args.full else "quick" if args.quick else default]
    return Grid(args.batch or base.batch, args.groups or base.groups, args.blocks or base.blocks)


def _add_grid_options(sp: argparse.ArgumentParser, default: str, profile_help: str, min_time: float = 1e-2) -> None:
    sp.add_argument("--device", type=_device, default="cpu", help="device type to measure on (default cpu)")
    sp.add_argument("--dtype", type=_dtype, default=torch.float32, help=f"one of {', '.join(_DTYPES)} (default float32)")
    sp.add_argument("--mode", choices=("forward", "train", "both"), default="both",
                    help="forward only, forward+backward, or both (default)")
    from ..tuning import GRIDS

    def described(name: str) -> str:
        g = GRIDS[name]
        return (f"{len(g)} shapes: batch {','.join(map(str, g.batch))}; groups {','.join(map(str, g.groups))}; "
                f"blocks {','.join(f'{i}x{o}' for i, o in g.blocks)}")

    name = "target" if default == "targets" else default
    grid = sp.add_argument_group("the grid", f"The shapes measured: by default the {name} grid "
                                             f"({described(default)}); --batch, --groups and --blocks replace its values.")
    size = grid.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help=f"the quick grid ({described('quick')})")
    size.add_argument("--full", action="store_true", help=f"the full grid ({described('full')})")
    grid.add_argument("--batch", type=_int_list, help="the batch sizes, e.g. 32,256 (default: the grid's)")
    grid.add_argument("--groups", type=_int_list, help="the group counts, e.g. 4,50 (default: the grid's)")
    grid.add_argument("--blocks", type=_blocks, help="the blocks (IN x OUT), e.g. 10x10,150x10 (default: the grid's)")
    sp.add_argument("--backends", type=_backend_list, help="only these backends, comma-separated (default: all)")
    sp.add_argument("--repeat", type=_positive, default=5,
                    help="interleaved rounds per point, of which --stat takes the median or minimum")
    sp.add_argument("--min-time", type=_finite_nonneg_float, default=min_time,
                    help="seconds each sample lasts at least, repeating the call to reach it")
    sp.add_argument("--stat", choices=("median", "min"), default="median",
                    help="statistic over the rounds (default median; min on a busy shared machine)")
    sp.add_argument("--max-gflop", type=_nonneg_float, default=float("inf"),
                    help="skip points whose forward product exceeds this many GFLOP (default: none skipped)")
    sp.add_argument("--profile", type=_path, help=f"{profile_help} (default $BLOCKDIAG_PROFILE or the user cache directory's "
                                      f"profile.json)")
