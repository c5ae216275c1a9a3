"""The ``blockdiag`` command (also ``python -m blockdiag``): ``demo`` and the tuning tools.

One module per command (``demo``, ``tune`` with ``explain``, ``bench``); the argument
types, the refusals before any work and what the measuring commands share beside them.

Every mistake in the arguments (a device this machine lacks, a non-float dtype, a grid too
large for the memory, an output path that cannot be written) is refused before any work
starts, with one line on stderr naming the option and the value, and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import warnings
from typing import Sequence

import torch

from . import _format as fmt
from ._args import (
    _DTYPES,
    _add_grid_options,
    _block,
    _compiled_models,
    _compiler,
    _device_type,
    _dtype,
    _finite_nonneg_float,
    _learning_rate,
    _parse_hidden,
    _path,
    _positive,
    _seed,
)
from .bench import cmd_bench
from .demo import cmd_demo
from .tune import cmd_explain, cmd_tune

__all__ = ["main"]


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


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line on stderr and exit status 2, without the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

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
    _add_threads_option(d)
    d.set_defaults(func=cmd_demo)

    from ..tuning import BENCH_REFINE, TIE_MARGIN

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
    _add_threads_option(t)
    t.set_defaults(func=cmd_tune)

    e = sub.add_parser(
        "explain", help="print the plan auto follows for one shape, and why",
        description="Print the plan auto follows for one problem: the backend, the table entry it comes "
                    "from, the candidates and why the others were left out. Nothing is run or timed, so "
                    "the device need not be present (for the CPU, on a machine where simd's kernels "
                    "were never built, they are compiled first, once, to say whether simd runs: a "
                    "pause of up to a minute).",
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
    _add_threads_option(e)
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
                   help="also write all results (with peak memory) as JSON, saved after each point and marked "
                        "complete at the end (default: none, the table only)")
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
    b.add_argument("--compiler", type=_compiler, default=None, metavar="BACKEND",
                   help="torch.compile's backend for --compiled (default inductor; aot_eager traces the "
                        "same graphs without code generation, to find failures fast)")
    _add_threads_option(b)
    # None: both, or train with --compiled (cmd_bench resolves it).
    b.set_defaults(func=cmd_bench, mode=None)
    return p


def _add_threads_option(sp: argparse.ArgumentParser) -> None:
    # An option, not only OMP_NUM_THREADS: the profile's entries and the plans are per thread
    # count, and explaining the plan of a run with 4 threads from a shell with the default
    # count showed another entry's plan.
    sp.add_argument("--threads", type=_positive, default=None,
                    help="CPU threads torch runs with, as torch.set_num_threads (default: torch's, "
                         f"{torch.get_num_threads()} here, set by OMP_NUM_THREADS); the profile's "
                         "CPU entries are per thread count")


@contextlib.contextmanager
def _threads(n: int | None):
    """Run the command with ``n`` torch threads (``None``: as they are), restored afterwards,
    since :func:`main` may be called inside a process that goes on."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The sub-parser of ``command`` in ``parser``."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@contextlib.contextmanager
def _printable_stdout():
    """Characters stdout's encoding cannot take printed as backslash escapes, as on stderr.

    Our lines print the user's paths (``wrote FILE``, the profile a plan came from): one with
    bytes that are not UTF-8, or any non-ASCII one under ``PYTHONIOENCODING=ascii``, raised
    ``UnicodeEncodeError`` from ``print`` after the measuring, a traceback and the rest of
    the command (``tune --plot``'s map) not done. Python's stderr already escapes them;
    stdout's strict handler is set back afterwards.
    """
    stream = sys.stdout
    if getattr(stream, "errors", None) != "strict" or not hasattr(stream, "reconfigure"):
        yield
        return
    stream.reconfigure(errors="backslashreplace")
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # closed meanwhile
            stream.reconfigure(errors="strict")


@contextlib.contextmanager
def _terminate_cleanly():
    """SIGTERM (``kill``, a job scheduler's time limit) as an exit that unwinds.

    Python's default for SIGTERM ends the process where it stands, which leaves a results or
    profile file's temporary twin behind; as ``SystemExit`` the writes' cleanup runs (the
    file replaced stays whole either way) and the status is the shell's 128 + 15. Only the
    main thread can set a handler; the previous one is restored.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _plug_closed_streams() -> None:
    """Give a closed stdout or stderr (``2>&-``, a daemon's or a cron job's) ``/dev/null``.

    Python starts with ``sys.stderr = None`` there, and ``print(..., file=None)`` prints to
    stdout: the announcement and the progress bar of ``tune`` and ``bench`` went into the
    table on stdout. Started through a shell wrapper (pyenv's shims) the descriptor is the
    wrapper's script, open for reading: the announcement raised ``OSError: Bad file
    descriptor`` and the command ended silently with status 1 before measuring. And the
    next file opened takes a free descriptor, so that whatever a C library writes to it
    would land in that file. ``/dev/null`` holds the number instead: the lines for a closed
    stream are dropped, as closing it means.
    """
    import os

    try:
        import fcntl
    except ImportError:  # not POSIX: no descriptors to plug
        return
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
                continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_WRONLY)
        if null != fd:  # a lower descriptor was free (stdin closed too) or ``fd`` is the wrapper's
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:  # Python found it closed at start: print(file=None) is stdout
            setattr(sys, name, open(fd, "w", closefd=False, errors="backslashreplace"))


class _Lossy:
    """stderr, whose writes are dropped once one fails: a full disk under ``2>log``, a reader
    gone (``2>&1 | head -1``), ``2>/dev/full``. It carries the announcement, the progress
    bar and the notes: the first failed write raised ``OSError`` and ended ``tune`` or
    ``bench`` with status 1 and no word (the traceback had nowhere to go), whatever had been
    measured lost. The run goes on; what it writes to files and stdout is written."""

    def __init__(self, stream) -> None:
        self._stream, self._failed = stream, False

    def write(self, text: str) -> int:
        if not self._failed:
            try:
                return self._stream.write(text)
            except OSError:
                self._failed = True
        return len(text)

    def flush(self) -> None:
        if not self._failed:
            try:
                self._stream.flush()
            except OSError:
                self._failed = True

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``blockdiag`` console script.

    Returns:
        the exit status: 0 on success, 2 on a bad argument or a command refused with a
        :class:`~blockdiag.BlockDiagError` (an unknown backend name, an unwritable file, a
        grid too large for the memory, ...), whose message is printed to stderr as one line.
    """
    _plug_closed_streams()
    stderr = sys.stderr
    sys.stderr = _Lossy(stderr)
    try:
        return _main(argv)
    finally:
        if isinstance(sys.stderr, _Lossy):
            sys.stderr = stderr


def _main(argv: Sequence[str] | None) -> int:
    from .._errors import BlockDiagError

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The top-level parser would name itself; the command's parser names the command,
        # whose --help lists the options the user meant.
        _command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        with _quiet_torch_betas(), _one_line_warnings(args.command), _terminate_cleanly(), _printable_stdout(), \
                _threads(args.threads):
            return args.func(args)
    except BlockDiagError as e:
        message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"blockdiag {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"blockdiag {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout's reader went away (``| head``): not an error of ours, and no traceback. What
        # is still buffered for stdout cannot be written: point it at devnull, so that the
        # interpreter's flush at exit does not raise again.
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # as a shell reports a command ended by SIGPIPE
