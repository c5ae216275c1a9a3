"""The ``blockdiag`` command (also ``python -m blockdiag``): ``demo`` and the tuning tools.

Every mistake in the arguments (a device this machine lacks, a non-float dtype, a grid too
large for the memory, an output path that cannot be written) is refused before any work
starts, with one line on stderr naming the option and the value, and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import sys
import time
import warnings
from typing import Sequence

import torch
from torch import nn

from . import _cli_format as fmt

__all__ = ["main"]


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
    return _scalar(s, float, lambda v: math.isfinite(v) and v > 0, "a positive finite number")


class LoopOfHeads(nn.Module):
    """The forum's ``ModelSerial``: a Python loop over independent heads, then ``cat``."""

    def __init__(self, heads: nn.ModuleList):
        super().__init__()
        self.blocks = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x) for b in self.blocks], dim=-1)


def _make_heads(n_heads: int, in_f: int, hidden: list[int], out_f: int) -> nn.ModuleList:
    def head():
        sizes = [in_f, *hidden, out_f]
        mods: list[nn.Module] = []
        for k in range(len(sizes) - 1):
            mods.append(nn.Linear(sizes[k], sizes[k + 1]))
            if k < len(sizes) - 2:
                mods.append(nn.ReLU())
        return nn.Sequential(*mods)

    return nn.ModuleList(head() for _ in range(n_heads))


def _train_epoch(model, xs, ys, opt, batch):
    total, t0 = 0.0, time.perf_counter()
    for k in range(0, xs.shape[0], batch):
        xb, yb = xs[k:k + batch], ys[k:k + batch]
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        total += loss.item() * xb.shape[0]
    return time.perf_counter() - t0, total / xs.shape[0]


def _check_demo_memory(args) -> None:
    from ._errors import BlockDiagError

    sizes = [args.in_features, *args.hidden, args.out_features]
    params = args.heads * sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    # Two models (the loop and the grouped copy), each with gradients and Adam's two moments;
    # the samples and their targets; float32.
    need = 4 * (2 * 4 * params + args.samples * (args.in_features + args.heads * args.out_features))
    limit = _memory_limit()
    if need > limit:
        raise BlockDiagError(
            f"--heads {args.heads} with these sizes needs about {need / 2**30:.1f} GiB, more than half this "
            f"machine's memory ({limit / 2**30:.1f} GiB)"
        )


def cmd_demo(args) -> int:
    from . import GroupedMLP

    _check_demo_memory(args)

    torch.manual_seed(args.seed)
    heads = _make_heads(args.heads, args.in_features, args.hidden, args.out_features)
    slow = LoopOfHeads(heads)
    fast = GroupedMLP.from_heads(copy.deepcopy(heads))
    n = args.samples
    xs = torch.randn(n, args.in_features)
    # A smooth target that every head can fit: a random linear map of a non-linearity.
    proj = torch.randn(args.in_features, args.heads * args.out_features) / args.in_features**0.5
    ys = torch.tanh(xs @ proj)
    with torch.no_grad():
        start_diff = (slow(xs[:256]) - fast(xs[:256])).abs().max().item()
    print(
        f"blockdiag demo: {args.heads} heads of "
        f"{' -> '.join(map(str, [args.in_features, *args.hidden, args.out_features]))}"
        f"{' (ReLU)' if args.hidden else ''}, "
        f"{n} samples, batch {args.batch}, Adam lr={args.lr}, {torch.get_num_threads()} threads"
    )
    print(f"same start: largest output difference {start_diff:.2e}")
    opt_s = torch.optim.Adam(slow.parameters(), lr=args.lr)
    opt_f = torch.optim.Adam(fast.parameters(), lr=args.lr)
    print(f"{'epoch':>5} {'loop s':>9} {'loop loss':>12} {'grouped s':>10} {'grouped loss':>13} {'speed-up':>9}")
    ts, tf, maxdiff = [], [], 0.0
    for ep in range(1, args.epochs + 1):
        # Interleave the two so that machine noise hits both alike.
        t_s, l_s = _train_epoch(slow, xs, ys, opt_s, args.batch)
        t_f, l_f = _train_epoch(fast, xs, ys, opt_f, args.batch)
        ts.append(t_s)
        tf.append(t_f)
        maxdiff = max(maxdiff, abs(l_s - l_f))
        print(f"{ep:5d} {t_s:9.3f} {l_s:12.6f} {t_f:10.3f} {l_f:13.6f} {t_s / t_f:8.1f}x")
    med_s, med_f = sorted(ts)[len(ts) // 2], sorted(tf)[len(tf) // 2]
    print(f"median epoch: loop {med_s:.3f} s, GroupedMLP {med_f:.3f} s -> speed-up {med_s / med_f:.1f}x")
    print(f"largest difference between the two models' epoch losses: {maxdiff:.2e}")
    return 0


def _int_list(s: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in s.split(",") if v.strip())
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
    out = tuple(_block(v) for v in s.split(",") if v.strip())
    if not out:
        raise argparse.ArgumentTypeError(f"expected blocks IN x OUT such as 10x10,150x10, got {s!r}")
    return out


def _kernel_grid_options(ap: argparse.ArgumentParser, rounds: int, batch: tuple[int, ...], groups: tuple[int, ...],
                         blocks: tuple[tuple[int, int], ...]) -> None:
    """The options of the scripts that time ``simd``'s kernels over a grid (``scripts/bench_simd_*.py``),
    with each script's own defaults: rounds, sample length, dtype, the grid, the JSON output."""
    ap.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})")
    ap.add_argument("--min-time", type=float, default=0.01, help="seconds each sample lasts at least (default 0.01)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--batch", type=_int_list, default=batch, help="rows, comma-separated")
    ap.add_argument("--groups", type=_int_list, default=groups, help="groups, comma-separated")
    ap.add_argument("--blocks", type=_blocks, default=blocks, help="blocks IN x OUT, comma-separated")
    ap.add_argument("--json", help="write the rows and how they were measured here")


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
    from .backends import get, names

    devices = sorted({d for n in names() for d in get(n).dtypes})
    if kind not in devices:
        raise argparse.ArgumentTypeError(f"{s!r}: no backend runs on {kind} (they run on {', '.join(devices)})")


def _nonneg_float(s: str) -> float:
    return _scalar(s, float, lambda v: v >= 0, "a number >= 0")  # NaN fails v >= 0


def _finite_nonneg_float(s: str) -> float:
    return _scalar(s, float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")


def _backend_list(s: str) -> list[str]:
    out = [v.strip() for v in s.split(",") if v.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"must name at least one backend, got {s!r}")
    return out


def _modes(args) -> tuple[str, ...]:
    return ("forward", "train") if args.mode == "both" else (args.mode,)


def _grid(args, default: str):
    from .tuning import GRIDS, Grid

    base = GRIDS["full" if args.full else "quick" if args.quick else default]
    return Grid(args.batch or base.batch, args.groups or base.groups, args.blocks or base.blocks)


def _path(s: str) -> str:
    """A file name: an empty one is an error, not "the default" (tune would write the user's profile)."""
    if not s.strip():
        raise argparse.ArgumentTypeError(f"must name a file, got {s!r}")
    return s


def _check_output(option: str, path: str | None, makes_dirs: bool = False) -> None:
    """Refuse an output file that cannot be written before the measuring, not after it.

    With ``makes_dirs`` (the profile, whose directories ``save_entry`` creates) a missing
    directory is fine where the nearest existing one above it is writable.
    """
    if path is None:
        return
    from pathlib import Path

    from ._errors import BlockDiagError

    target = Path(path)
    if target.is_dir():
        raise BlockDiagError(f"{option}: {path!r} is a directory; name a file in it")
    if target.exists() and not target.is_file():
        from .profile import _file_kind

        raise BlockDiagError(f"{option}: {path!r} is {_file_kind(os.stat(target).st_mode)}, not a regular file")
    if target.exists() and not os.access(target, os.W_OK):
        raise BlockDiagError(f"{option}: {path!r} exists and is not writable")
    parent = target.resolve().parent
    if makes_dirs:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise BlockDiagError(f"{option}: the directory {parent} of {path!r} {what}")
    if not os.access(parent, os.W_OK):
        raise BlockDiagError(f"{option}: the directory {parent} of {path!r} is not writable")


def _check_profile_input(path: str | None) -> None:
    """An explicitly named profile to read must exist (auto would fall back to the built-in
    table without a word); what is wrong inside one, auto reports as a ProfileWarning."""
    if path is None:
        return
    from pathlib import Path

    from ._errors import BlockDiagError

    if not Path(path).exists():
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
    from ._errors import BlockDiagError

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


@contextlib.contextmanager
def _quiet_torch_betas():
    """Hide torch's "... is in beta" notices (sparse CSR/BSR) while our commands run."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*support is in beta state", category=UserWarning)
        yield


@contextlib.contextmanager
def _one_line_warnings(command: str):
    """Warnings shown while our commands run (a corrupt profile's ProfileWarning) as one line
    each, ``blockdiag explain: ProfileWarning: ...``, without the source file and line."""
    original = warnings.formatwarning

    def one_line(message, category, filename, lineno, line=None):
        text = " ".join(str(message).split()).removeprefix("blockdiag: ")
        return f"blockdiag {command}: {category.__name__}: {text}\n"

    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = original


def _check_backends(names_: Sequence[str] | None, device: str = "cpu", dtype: torch.dtype | None = None) -> None:
    """Every name known, and able to run at this device and dtype: a named backend that cannot
    would leave bench's rows and tune's profile without times."""
    from ._errors import BlockDiagError
    from .backends import get

    for n in names_ or ():
        b = get(n, "--backends", auto_valid=False)
        why = b.unavailable_reason()
        if why is None and device not in b.dtypes:
            why = f"it does not run on {device} (runs on {', '.join(b.dtypes)})"
        if why is None and dtype is not None and dtype not in b.dtypes[device]:
            why = f"it does not take {str(dtype).replace('torch.', '')} on {device}"
        if why is not None:
            raise BlockDiagError(f"--backends: {n!r} cannot run here: {why}")


def _add_grid_options(sp: argparse.ArgumentParser, default: str, profile_help: str, min_time: float = 1e-2) -> None:
    sp.add_argument("--device", type=_device, default="cpu", help="device type to measure on (default cpu)")
    sp.add_argument("--dtype", type=_dtype, default=torch.float32, help=f"one of {', '.join(_DTYPES)} (default float32)")
    sp.add_argument("--mode", choices=("forward", "train", "both"), default="both",
                    help="forward only, forward+backward, or both (default)")
    from .tuning import GRIDS

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


def _point_costs(grid, modes, max_gflop: float) -> list:
    """One call's FLOPs and groups at each point measured: the grid times the modes, less what
    ``--max-gflop`` skips (a training step: the forward product and two for backward)."""
    pts = [(2.0 * n * g * i * o, g) for n in grid.batch for g in grid.groups for i, o in grid.blocks]
    return [fmt.PointCost(f * (3 if mode == "train" else 1), g, mode == "train")
            for mode in modes for f, g in pts if f / 1e9 <= max_gflop]


def _looping(names) -> int:
    """How many of the backends ``names`` loop over the groups in Python (``Backend.loops_groups``)."""
    from .backends import get

    return sum(get(n).loops_groups for n in names)


def _runnable_names(device: str) -> list[str]:
    from .backends import get, names

    return [n for n in names() if device in get(n).dtypes and get(n).unavailable_reason() is None]


def _check_plot_format(path: str | None) -> None:
    """Refuse a ``--plot`` file whose extension matplotlib cannot write, before the measuring."""
    if path is None:
        return
    from ._errors import BlockDiagError

    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise BlockDiagError("--plot needs matplotlib: pip install 'blockdiag[plot]'") from None
    formats = Figure().canvas.get_supported_filetypes()
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in formats:
        raise BlockDiagError(f"--plot: {path!r} has the extension {ext!r}, which matplotlib cannot write; "
                             f"use one of {', '.join(sorted(formats))}")


def cmd_tune(args) -> int:
    from . import profile as prof
    from ._errors import BlockDiagError
    from .tuning import cross_check, merge_entry, plot_decision_map, tune

    _check_backends(args.backends, args.device, args.dtype)
    _check_output("--plot", args.plot)
    _check_plot_format(args.plot)
    grid = _grid(args, "quick")
    modes = _modes(args)
    _check_grid_memory(grid, modes, args.dtype, args.max_gflop)
    path = args.profile if args.profile is not None else prof.default_profile_path()
    _check_output("--profile" if args.profile is not None else "the default profile", str(path), makes_dirs=True)
    timed = args.backends or _runnable_names(args.device)
    n_backends = len(timed)
    points = _point_costs(grid, modes, args.max_gflop)
    if not points:
        raise BlockDiagError(f"--max-gflop {args.max_gflop:g} skips every point of the grid: nothing to measure")
    writes = f"{path}" + (f" and the decision map {args.plot}" if args.plot else "")
    _announce("tune", args, len(points), modes, writes,
              fmt.estimate_line(points, n_backends, "backends", args.repeat, args.min_time, args.device,
                                "pruning the slow backends saves some, refining near-ties and rematching "
                                "add some", loops=_looping(timed)))
    doc, _ = prof.read_profile(path)
    key = prof.profile_key(args.device, args.dtype)
    old = (doc or {}).get("entries", {}).get(key)
    # The second opinion for rematches: this machine's earlier tune where there is one
    # (same device and torch), else the built-in table.
    entry = tune(grid, device=args.device, dtype=args.dtype, modes=modes, backends=args.backends,
                 rounds=args.repeat, min_time=args.min_time, max_gflop=args.max_gflop, stat=args.stat,
                 refine=args.refine, rematch=args.rematch, prior=old, progress=sys.stderr)
    if not entry["measurements"]:
        raise BlockDiagError("tune: no point was measured, so nothing was written (an empty entry would "
                             "replace the built-in table for this machine)")
    # Merged into the entry the file holds when it is written (under its lock), not the one
    # read before the measuring: another run may have saved meanwhile.
    kept: dict = {}

    def merge(stored, new):
        kept["entry"] = merge_entry(stored, new)
        return kept["entry"]

    written = prof.save_entry(entry, path, merge=merge)
    entry = kept["entry"]
    wins: dict[str, int] = {}
    for m in entry["measurements"]:
        if m["times_us"]:
            best = min(m["times_us"], key=m["times_us"].get)
            wins[best] = wins.get(best, 0) + 1
    print(f"wrote {written} (entry {key!r})")
    print("winners: " + ", ".join(f"{n} {k}" for n, k in sorted(wins.items(), key=lambda kv: -kv[1])))
    r = entry.get("rematched")
    if r is not None:
        print(f"rematched {r['points']} points where the winner was not {r['prior']}'s choice "
              f"({r['rounds']} rounds each); {r['overturned']} overturned")
    s = entry["settings"]
    thr = "never (1.0)" if s["sparsity_threshold"] >= 1.0 else f"{s['sparsity_threshold']:.4f}"
    print(f"measured sparsity_threshold: {thr}; dense_max_groups: {s['dense_max_groups']}; "
          f"dense_max_elements: {s['dense_max_elements']}")
    for mode, c in cross_check(entry).items():
        print(f"cross-check, {mode} (each point ranked from the others, chosen/fastest): "
              f"geomean {c['geomean']:.3f}, worst {c['worst']:.2f} at {c['worst_point']}, "
              f"{c['within_1.10']} of {c['points']} within 1.10")
    if args.plot:
        print(f"decision map: {plot_decision_map(entry, args.plot)}")
    return 0


def cmd_explain(args) -> int:
    from .backends import Problem
    from .dispatch import choose
    from .settings import config

    _check_profile_input(args.profile)
    p = Problem(args.batch, args.groups, args.block[0], args.block[1], args.dtype, args.device, args.train)
    if args.profile:
        with config(profile=args.profile):
            plan = choose(p)
    else:
        plan = choose(p)
    print(plan)
    if p.device == "cpu":  # which of simd's kernel variants runs here (avx512, avx2, neon), or why none
        from .backends import simd

        print(simd.variant_note())
    return 0


def _provenance() -> dict:
    """When and from which code a results file was written (UTC time, git commit if any)."""
    import datetime
    import subprocess
    from pathlib import Path

    from . import __version__

    commit = dirty = None
    root = Path(__file__).resolve().parent.parent
    if (root / ".git").exists():
        try:
            out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                 text=True, timeout=10)
            commit = out.stdout.strip() or None if out.returncode == 0 else None
            if commit is not None:
                # The commit alone does not name the code measured when tracked files were
                # edited since: say so (untracked files are ignored: results, caches).
                out = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                     capture_output=True, text=True, timeout=10)
                dirty = bool(out.stdout.strip()) if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            commit = dirty = None
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"created": created, "commit": commit, "commit_dirty": dirty, "blockdiag": __version__}


def _builtin_columns(r: dict) -> str:
    b = r.get("builtin_choice")
    t = r["times_us"].get(b) if b else None
    ratio = f"{t / r['times_us'][r['fastest']]:6.2f}" if t else f"{'-':>6s}"
    return f" {b or '-':>11s} {ratio}"


def _compiled_models(s: str) -> tuple[str, ...]:
    from .tuning import COMPILED_MODELS

    out = tuple(v.strip() for v in s.split(",") if v.strip())
    bad = [v for v in out if v not in COMPILED_MODELS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(COMPILED_MODELS)}, got {s!r}")
    return out


def _check_compiler(name: str) -> None:
    """``--compiler`` must be a torch.compile backend: found now, not after every point failed."""
    import torch._dynamo

    from ._errors import BlockDiagError

    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise BlockDiagError(f"--compiler: {name!r} is not a torch.compile backend here (e.g. "
                             f"{', '.join(n for n in ('inductor', 'aot_eager', 'eager') if n in known)})")


def _announce(command: str, args, points: int, modes, writes: str, estimate: str) -> None:
    """Before the run, on stderr: what is measured, what is written, and how long it may take."""
    from . import profile as prof

    print(f"blockdiag {command}: {points} points on {prof.device_name(args.device)}, "
          f"{str(args.dtype).replace('torch.', '')}, {', '.join(modes)}; writes {writes}\n{estimate}",
          file=sys.stderr)


def _print_faults(rows) -> None:
    """One line per point where a timed step page-faulted ``FAULTS_NOTED`` times a call or more."""
    from .tuning import FAULTS_NOTED

    for r in rows:
        many = {c: v for c, v in r.get("faults_per_step", {}).items() if v >= FAULTS_NOTED}
        if many:
            model = f" {r['model']}" if "model" in r else ""
            print(f"page faults per step: {r['mode']}{model} B={r['batch']} G={r['groups']} "
                  f"{r['block_in']}x{r['block_out']}: " + ", ".join(f"{c} {v:g}" for c, v in many.items())
                  + " (fresh pages from the allocator every step: see docs/faq.md)")


def _print_beyond_margin(rows: Sequence[dict]) -> None:
    """Each point where auto's median is beyond 1.10 of the fastest backend's, with the interval
    of its round-by-round ratio: within the noise of that margin or beyond it."""
    for r in rows:
        v, iv = r.get("auto_over_fastest"), r.get("auto_over_fastest_interval")
        if v is None or v <= 1.10:
            continue
        verdict = ("no interval (too few rounds)" if iv is None else f"interval {iv[0]:.3f}-{iv[1]:.3f}: "
                   + ("beyond 1.10 beyond the noise" if iv[0] > 1.10 else "within the noise of 1.10"))
        print(f"auto beyond 1.10 of the fastest ({r['fastest']}): {r['mode']} B={r['batch']} G={r['groups']} "
              f"{r['block_in']}x{r['block_out']} {v:.3f}, {verdict}")


def _print_slower_points(rows: Sequence[dict], names: Sequence[str]) -> None:
    """Each point where a compiled blockdiag module's median is slower than the best compiled
    peer's, with the interval of its round-by-round ratio: a tie or slower beyond the noise."""
    for r in rows:
        for n in names:
            v = r.get("compiled_over_best_peer", {}).get(n)
            if v is None or v <= 1.0:
                continue
            iv = r.get("compiled_over_best_peer_interval", {}).get(n)
            verdict = ("no interval (too few rounds)" if iv is None else
                       f"interval {iv[0]:.3f}-{iv[1]:.3f}: " + ("slower beyond the noise" if iv[0] > 1.0 else "a tie"))
            print(f"slower than {r['best_peer']}: {r['mode']} {r['model']} B={r['batch']} G={r['groups']} "
                  f"{r['block_in']}x{r['block_out']} {n} {v:.3f}, {verdict}")


def _bench_compiled(args, grid, modes) -> int:
    """``bench --compiled``: the compiled models against the compiled peers (see ``bench_compiled``)."""
    from . import profile as prof
    from .tuning import COMPILED_CONTROL, COMPILED_PEERS, allocator_env, bench_compiled, summarize_compiled

    bd = ["auto", *dict.fromkeys(args.backends or ())]
    # Per point and model: each blockdiag module eager and compiled, the peers and the control.
    points = _point_costs(grid, modes, args.max_gflop) * len(args.compiled)
    steps = 2 * (len(bd) + (0 if args.no_baselines else len(COMPILED_PEERS) + 1))
    # The loop of heads, eager and compiled, calls torch once per group.
    loops = 2 * _looping(n for n in bd if n != "auto") + (0 if args.no_baselines else 2)
    _announce("bench", args, len(points), modes, args.json or "nothing (no --json)",
              fmt.estimate_line(points, steps, "modules", args.repeat, args.min_time, args.device,
                                "compiling adds seconds to minutes per point", loops=loops))
    rows = bench_compiled(grid, device=args.device, dtype=args.dtype, modes=modes, models=args.compiled,
                          backends=args.backends, rounds=args.repeat, min_time=args.min_time,
                          baselines=not args.no_baselines, max_gflop=args.max_gflop, stat=args.stat,
                          refine=args.refine, compiler=args.compiler, progress=sys.stderr)
    peers = [] if args.no_baselines else [*(p.removesuffix("_compiled") for p in COMPILED_PEERS), COMPILED_CONTROL]
    cols = [c for n in (*bd, *peers) for c in (n, f"{n}_compiled")]
    timed = [r for r in rows if "times_us" in r]
    units = {c: fmt.unit(r["times_us"].get(c) for r in timed) for c in cols}
    label = {c: f"{c.replace('_compiled', '_c')} {units[c]}" for c in cols}
    width = max([9, *(len(v) for v in label.values())])
    ratio_cols = [(n, "c/eager" if n == "auto" else f"{n}:c/e", "c/peer" if n == "auto" else f"{n}:c/p") for n in bd]
    print(f"torch.compile (backend {args.compiler}, dynamic=False, compile time excluded), {args.stat} of "
          f"{args.repeat} interleaved rounds; times in the unit of their column (us or ms); _c: compiled; "
          f"c/eager: compiled blockdiag over eager blockdiag; c/peer: compiled blockdiag over the fastest "
          f"compiled peer (loop of heads, vmap; each also timed eager); ctl c/e: the control's compiled over "
          f"eager (plain layers, same input and FLOPs: torch.compile's own cost at that work)")
    head = f"{'mode':7s} {'model':6s} {'B':>5s} {'G':>4s} {'block':>8s} " + " ".join(f"{label[c]:>{width}s}" for c in cols)
    head += "".join(f" {e:>7s} {c:>7s}" for _, e, c in ratio_cols)
    head += ("" if args.no_baselines else f" {'ctl c/e':>7s}") + f" {'choice':>8s}"
    print(head)
    for r in rows:
        lead = (f"{r['mode']:7s} {r['model']:6s} {r['batch']:5d} {r['groups']:4d} "
                f"{str(r['block_in']) + 'x' + str(r['block_out']):>8s} ")
        if "skipped_point" in r:
            print(lead + f"skipped: {r['skipped_point']}")
            continue
        t, failed = r["times_us"], r["failed"]

        def cell(c, t=t, failed=failed):
            if c in t:
                return fmt.in_unit(t[c], units[c])
            return "wrong" if failed.get(c, "").startswith("wrong result") else "failed" if c in failed else "-"

        print(lead + " ".join(f"{cell(c):>{width}s}" for c in cols)
              + "".join(f" {fmt.ratio(r['compiled_over_eager'].get(n))} "
                        f"{fmt.ratio(r['compiled_over_best_peer'].get(n))}" for n, _, _ in ratio_cols)
              + ("" if args.no_baselines else f" {fmt.ratio(r.get('control_compiled_over_eager'))}")
              + f" {r.get('auto') or '-':>8s}")
    for r in rows:
        for c, why in r.get("failed", {}).items():
            print(f"failed: {r['mode']} {r['model']} B={r['batch']} G={r['groups']} {r['block_in']}x{r['block_out']} "
                  f"{c}: {why}")
    _print_faults(rows)
    _print_slower_points(rows, bd)
    summary = summarize_compiled(rows)
    for mode, per in summary.items():
        for key, s in per.items():
            print(fmt.summary_lines(f"{mode} {key}", s, fmt.COMPILED_SUMMARY,
                                    skip=("targets_met", "slower_beyond_noise_points")))
            if "targets_met" in s:
                met = s["targets_met"]
                print("  issue 21's targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in met.items()))
    if args.json:
        out = {"device_name": prof.device_name(args.device), "torch": torch.__version__,
               "dtype": str(args.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
               "statistic": args.stat, "rounds": args.repeat, "refine": args.refine, "argv": sys.argv[1:],
               "compiled": {"models": list(args.compiled), "compiler": args.compiler, "dynamic": False},
               "allocator_env": allocator_env(), **_provenance(), "summary": summary, "rows": rows}
        prof.write_json_atomic(args.json, out)
        print(f"wrote {args.json}")
    return 0


def cmd_bench(args) -> int:
    from . import profile as prof
    from .settings import config
    from .tuning import allocator_env, bench, summarize

    _check_backends(args.backends, args.device, args.dtype)
    _check_output("--json", args.json)
    _check_profile_input(args.profile)
    if args.compiled:
        _check_compiler(args.compiler)
    grid = _grid(args, "targets")
    _check_grid_memory(grid, ("train",) if args.compiled or args.mode != "forward" else ("forward",),
                       args.dtype, args.max_gflop, baselines=not args.no_baselines)
    if args.mode is None:  # bench's own default: both, and the training step alone with --compiled
        args.mode = "train" if args.compiled else "both"
    modes = _modes(args)
    ctx = config(profile=args.profile) if args.profile else contextlib.nullcontext()
    if args.compiled:
        with ctx:
            return _bench_compiled(args, grid, modes)
    timed = args.backends or _runnable_names(args.device)
    n_backends = len(timed)
    points = _point_costs(grid, modes, args.max_gflop)
    # Per point: the backends, auto, auto's choice forced, the ideal GEMM and the baselines
    # (of which the nn.Linear loop calls torch once per group).
    steps = n_backends + 3 + (0 if args.no_baselines else 2)
    loops = _looping(timed) + (0 if args.no_baselines else 1)
    what = f"steps ({n_backends} backends, auto, its kernel, the ideal GEMM" + (
        ")" if args.no_baselines else ", 2 baselines)")
    more = "refining near-ties adds some" + ("" if args.json is None or args.no_memory else
                                             ", --json's peak-memory runs more")
    _announce("bench", args, len(points), modes, args.json or "nothing (no --json)",
              fmt.estimate_line(points, steps, what, args.repeat, args.min_time, args.device, more, loops=loops))
    with ctx:
        rows = bench(grid, device=args.device, dtype=args.dtype, modes=modes, backends=args.backends,
                     rounds=args.repeat, min_time=args.min_time, baselines=not args.no_baselines,
                     memory=args.json is not None and not args.no_memory, max_gflop=args.max_gflop,
                     stat=args.stat, refine=args.refine, progress=sys.stderr)
    names_ = sorted({n for r in rows for n in r.get("times_us", {})})
    timed = [r for r in rows if "skipped_point" not in r]
    # One unit per column, picked from its values: ms when its largest time reaches 10 ms.
    units = {n: fmt.unit(r["times_us"].get(n) for r in timed) for n in names_}
    units["auto"] = fmt.unit(r["auto_us"] for r in timed)
    print(f"times in the unit of their column (us or ms), {args.stat} of {args.repeat} interleaved rounds; "
          "a/best: auto over the fastest backend; a/forc: auto over its choice forced by name; a/kern: auto "
          "over its choice's bare kernel (no dispatch); %ideal: the ideal "
          "GEMM's time over auto's; xloop, xvmap: auto's speed-up over the nn.Linear loop and vmap")
    head = f"{'mode':7s} {'B':>5s} {'G':>4s} {'block':>8s} " + " ".join(f"{n + ' ' + units[n]:>11s}" for n in names_)
    head += (f" {'auto ' + units['auto']:>11s} {'choice':>11s} {'a/best':>6s} {'a/forc':>6s} {'a/kern':>6s} {'%ideal':>6s} "
             f"{'xloop':>6s} {'xvmap':>6s}")
    # Under a tuning profile: the built-in table's choice and its forced time over the fastest.
    builtin = any("builtin_choice" in r for r in rows)
    if builtin:
        head += f" {'builtin':>11s} {'b/best':>6s}"
    print(head)
    for r in rows:
        lead = f"{r['mode']:7s} {r['batch']:5d} {r['groups']:4d} {str(r['block_in']) + 'x' + str(r['block_out']):>8s} "
        if "skipped_point" in r:
            print(lead + f"skipped: {r['skipped_point']}")
            continue
        t = r["times_us"]
        bl = r.get("baselines_us", {})
        xl = f"{bl['nn_linear_loop'] / r['auto_us']:6.2f}" if "nn_linear_loop" in bl else f"{'-':>6s}"
        xv = f"{bl['vmap'] / r['auto_us']:6.2f}" if "vmap" in bl else f"{'-':>6s}"
        print(lead + " ".join(f"{fmt.in_unit(t.get(n), units[n]):>11s}" for n in names_)
              + f" {fmt.in_unit(r['auto_us'], units['auto']):>11s} {r['auto']:>11s} {fmt.ratio(r['auto_over_fastest'], 6)}"
              + (f" {r['auto_over_choice']:6.2f}" if "auto_over_choice" in r else f" {'-':>6s}")
              + f" {r['auto_over_kernel']:6.2f}"
              + f" {100 * r['fraction_of_ideal']:5.0f}% {xl} {xv}"
              + (_builtin_columns(r) if builtin else ""))
    skipped = sorted({f"{n}: {why}" for r in rows for n, why in r.get("skipped", {}).items() if "skipped" in why})
    if skipped:
        print(f"not measured at some points: {len(skipped)} reasons, e.g. {skipped[0]}")
    _print_faults(rows)
    _print_beyond_margin(rows)
    summary = summarize(rows)
    for mode, s in summary.items():
        print(fmt.summary_lines(mode, s))
    if args.json:
        out = {"device_name": prof.device_name(args.device), "torch": torch.__version__,
               "dtype": str(args.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
               "statistic": args.stat, "rounds": args.repeat, "refine": args.refine, "argv": sys.argv[1:],
               "allocator_env": allocator_env(), **_provenance(), "summary": summary, "rows": rows}
        prof.write_json_atomic(args.json, out)
        print(f"wrote {args.json}")
    return 0


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line on stderr and exit status 2, without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = _Parser(
        prog="blockdiag",
        description="blockdiag: many small independent linear layers (ensemble, multi-task and per-agent "
                    "heads) as one block-diagonal operation. These commands show the speed-up, and measure "
                    "and explain which multiply auto picks on this machine.",
        epilog="examples:\n"
               "  blockdiag demo                 # the forum's 50 heads: loop against GroupedMLP\n"
               "  blockdiag explain --batch 256 --groups 50 --block 150x10\n"
               "  blockdiag tune                 # measure this machine, write its profile\n"
               "  blockdiag bench --quick        # every backend against auto and the baselines\n"
               "\n"
               "'blockdiag COMMAND --help' gives a command's options and examples.",
        formatter_class=fmt.HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"blockdiag {__version__} (torch {torch.__version__})")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    d = sub.add_parser(
        "demo", help="train the forum's loop-of-heads model and GroupedMLP side by side",
        description="Train the forum thread's model (a Python loop over independent heads, then cat) and "
                    "the same heads as one GroupedMLP, interleaved epoch by epoch, and print both losses "
                    "and the speed-up.",
        epilog="example:\n  blockdiag demo --heads 50 --epochs 3",
        formatter_class=fmt.HelpFormatter,
    )
    d.add_argument("--heads", type=_positive, default=50, help="independent heads")
    d.add_argument("--in-features", type=_positive, default=150, help="input features every head reads")
    d.add_argument("--hidden", type=_parse_hidden, default=[10, 10],
                   help="hidden sizes, comma-separated, e.g. 10,10 ('' for one linear layer per head)")
    d.add_argument("--out-features", type=_positive, default=1, help="outputs per head")
    d.add_argument("--batch", type=_positive, default=64, help="rows per training step")
    d.add_argument("--samples", type=_positive, default=4096, help="training samples (random)")
    d.add_argument("--epochs", type=_positive, default=3, help="epochs of each model")
    d.add_argument("--lr", type=_learning_rate, default=1e-3, help="Adam's learning rate")
    d.add_argument("--seed", type=_seed, default=0, help="random seed")
    d.set_defaults(func=cmd_demo)

    from .tuning import BENCH_REFINE, TIE_MARGIN

    t = sub.add_parser(
        "tune", help="measure the backends on this machine and write a tuning profile",
        description="Time every backend at each point of a grid on this machine and merge the winners into "
                    "the tuning profile that auto reads. Before it starts, tune names the profile file it "
                    "will write and estimates how long the run takes (on stderr).\n\n"
                    "Its defaults differ from bench's on purpose: tune times every backend at every "
                    "point, so it defaults to the quick grid (18 shapes, a minute or two on a 2-core CPU; "
                    "the target grid's 48, with 256x256 blocks, take about eight times as long), and "
                    "near-ties within 5% get more rounds, since the winner it records is a ranking; "
                    "bench's verdicts are 10% margins (auto within 1.10 of the fastest), so it refines "
                    "at 10%.",
        epilog="examples:\n"
               "  # the quick grid, training only: about a minute on a 2-core CPU\n"
               "  blockdiag tune --mode train\n"
               "  # one shape, into a profile of its own\n"
               "  blockdiag tune --blocks 150x10 --groups 50 --batch 256 --profile /tmp/p.json\n"
               "  # the built-in table's grid, and its decision map\n"
               "  blockdiag tune --full --max-gflop 20 --plot map.png",
        formatter_class=fmt.HelpFormatter,
    )
    _add_grid_options(t, "quick", "profile file to merge the results into")
    t.add_argument("--plot", type=_path, metavar="FILE.png",
                   help="also draw the decision map, 800 px wide (needs matplotlib; default: none)")
    t.add_argument("--refine", type=_finite_nonneg_float, default=TIE_MARGIN, metavar="FRACTION",
                   help=f"backends within this fraction of the fastest get --repeat more rounds "
                        f"(default {TIE_MARGIN:g}; 0 disables)")
    t.add_argument("--no-rematch", dest="rematch", action="store_false",
                   help="do not retime the points where the winner is not the earlier table's choice")
    t.set_defaults(func=cmd_tune)

    e = sub.add_parser(
        "explain", help="print the plan auto follows for one shape, and why",
        description="Print the plan auto follows for one problem: the backend, the table entry it comes "
                    "from, the candidates and why the others were left out. Nothing is run or timed, so "
                    "the device need not be present.",
        epilog="example:\n  blockdiag explain --batch 256 --groups 50 --block 150x10 --train",
        formatter_class=fmt.HelpFormatter,
    )
    e.add_argument("--batch", type=_positive, required=True, help="rows (the product of the leading dimensions)")
    e.add_argument("--groups", type=_positive, required=True, help="groups (heads)")
    e.add_argument("--block", type=_block, required=True, help="IN x OUT per group, e.g. 10x10 or 150x10")
    e.add_argument("--train", action="store_true", help="plan for forward+backward (default: forward only)")
    e.add_argument("--device", type=_device_type, default="cpu",
                   help="device type to plan for (cpu, cuda, ...); no device is needed")
    e.add_argument("--dtype", type=_dtype, default=torch.float32, help=f"one of {', '.join(_DTYPES)}")
    e.add_argument("--profile", type=_path, help="profile file to read (default $BLOCKDIAG_PROFILE or the user cache directory)")
    e.set_defaults(func=cmd_explain)

    b = sub.add_parser(
        "bench", help="time every backend, auto, the ideal GEMM and the baselines over a grid",
        description="Time every backend, auto, the ideal GEMM and the baselines (the nn.Linear loop, vmap "
                    "ensembling) over a grid, in interleaved rounds, and print each point's times and "
                    "ratios measured in the same run, then a summary per mode. Before it starts, bench "
                    "estimates how long the run takes (on stderr). Writes nothing unless --json is given.\n\n"
                    "Its defaults differ from tune's on purpose: bench checks the project's performance "
                    "targets, so it defaults to the target grid (48 shapes, about 20 minutes on a 2-core "
                    "CPU; --quick: a minute or two), and refines at 10% because its "
                    "verdicts are 10% margins (auto within 1.10 of the fastest); tune refines near-ties "
                    "at 5%.",
        epilog="examples:\n"
               "  # the quick grid, forward only: about a minute on a 2-core CPU\n"
               "  blockdiag bench --quick --mode forward\n"
               "  # three backends at two block shapes, every result into a file\n"
               "  blockdiag bench --blocks 10x10,150x10 --backends simd,bmm_fm,loop \\\n"
               "      --json out.json\n"
               "  # torch.compile(GroupedLinear) against the compiled loop and vmap\n"
               "  blockdiag bench --compiled linear --batch 256 --groups 16",
        formatter_class=fmt.HelpFormatter,
    )
    _add_grid_options(b, "targets", "profile file auto reads")
    b.add_argument("--json", type=_path, metavar="FILE",
                   help="also write all results (with peak memory) as JSON (default: none, the table only)")
    b.add_argument("--no-baselines", action="store_true", help="skip the nn.Linear loop and vmap baselines")
    b.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs of --json")
    b.add_argument("--refine", type=_finite_nonneg_float, default=BENCH_REFINE, metavar="FRACTION",
                   help=f"auto, its choice, the nn.Linear loop and the backends within this fraction of "
                        f"the fastest get --repeat more rounds (default {BENCH_REFINE:g}; 0 disables)")
    # A flag, not a --mode value: --mode says which pass is timed (and is tune's option too),
    # --compiled says what is compared; the two combine (--mode forward --compiled is valid).
    b.add_argument("--compiled", nargs="?", const=("linear", "mlp"), type=_compiled_models, metavar="MODELS",
                   help="instead of the backends, time torch.compile(GroupedLinear) and torch.compile(GroupedMLP) "
                        "(MODELS: linear, mlp, or linear,mlp, the default) against torch.compile of the nn.Linear loop "
                        "and of vmap ensembling, with the eager blockdiag module in the same rounds; reports "
                        "compiled/eager and compiled/best compiled peer. A flag rather than a --mode value "
                        "because it changes what is compared, not which pass: --mode still picks the pass "
                        "and here defaults to train. Graphs are compiled once per point (dynamic=False, "
                        "dynamo reset between points), compile time excluded; a method that fails to compile "
                        "or differs from eager is reported in its row. --backends adds blockdiag modules "
                        "with those backends forced (default: auto only); no peak memory is recorded")
    b.add_argument("--compiler", default="inductor", metavar="BACKEND",
                   help="torch.compile's backend for --compiled (default inductor; aot_eager traces the "
                        "same graphs without code generation, to find failures fast)")
    # None: both, or train with --compiled (cmd_bench resolves it).
    b.set_defaults(func=cmd_bench, mode=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``blockdiag`` console script.

    Returns:
        the exit status: 0 on success, 2 on a bad argument or a command refused with a
        :class:`~blockdiag.BlockDiagError` (an unknown backend name, an unwritable file, a
        grid too large for the memory, ...), whose message is printed to stderr as one line.
    """
    from ._errors import BlockDiagError

    args = build_parser().parse_args(argv)
    try:
        with _quiet_torch_betas(), _one_line_warnings(args.command):
            return args.func(args)
    except BlockDiagError as e:
        message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"blockdiag {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"blockdiag {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
