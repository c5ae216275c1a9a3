"""What the measuring commands share: the announcement of a run, its points' costs, the page
faults noted, and the provenance every results file records."""

from __future__ import annotations

import contextlib
import sys

from . import _format as fmt


def _announce(command: str, args, points: int, modes, writes: str, estimate: str) -> None:
    """Before the run, on stderr: what is measured, what is written, and how long it may take."""
    from .. import profile as prof

    print(f"blockdiag {command}: {points} points on {prof.device_name(args.device)}, "
          f"{str(args.dtype).replace('torch.', '')}, {', '.join(modes)}; writes {writes}\n{estimate}",
          file=sys.stderr)


def _point_costs(grid, modes, max_gflop: float) -> list:
    """One call's FLOPs and groups at each point measured: the grid times the modes, less what
    ``--max-gflop`` skips (a training step: the forward product and two for backward)."""
    pts = [(2.0 * n * g * i * o, g) for n in grid.batch for g in grid.groups for i, o in grid.blocks]
    return [fmt.PointCost(f * (3 if mode == "train" else 1), g, mode == "train")
            for mode in modes for f, g in pts if f / 1e9 <= max_gflop]


def _looping(names) -> int:
    """How many of the backends ``names`` loop over the groups in Python (``Backend.loops_groups``)."""
    from ..backends import get

    return sum(get(n).loops_groups for n in names)


def _runnable_names(device: str) -> list[str]:
    from ..backends import get, names

    return [n for n in names() if device in get(n).dtypes and get(n).unavailable_reason() is None]


def _print_faults(rows) -> None:
    """One line per point where a timed step page-faulted ``FAULTS_NOTED`` times a call or more."""
    from ..tuning import FAULTS_NOTED

    for r in rows:
        many = {c: v for c, v in r.get("faults_per_step", {}).items() if v >= FAULTS_NOTED}
        if many:
            model = f" {r['model']}" if "model" in r else ""
            print(f"page faults per step: {r['mode']}{model} B={r['batch']} G={r['groups']} "
                  f"{r['block_in']}x{r['block_out']}: " + ", ".join(f"{c} {v:g}" for c, v in many.items())
                  + " (fresh pages from the allocator every step: see docs/faq.md)")


def _provenance() -> dict:
    """When and from which code a results file was written (UTC time, git commit if any)."""
    import datetime
    import subprocess
    from pathlib import Path

    from .. import __version__

    commit = dirty = None
    root = Path(__file__).resolve().parents[2]  # the checkout holding blockdiag/cli/
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


@contextlib.contextmanager
def _writing(option: str, path: str):
    """An output written after the measuring: an ``OSError`` (a full disk, a file-size limit,
    ``/proc``) becomes the command's one-line error naming ``option``, not a traceback. The
    writers leave the old file as it was (``write_json_atomic``, ``plot_decision_map``)."""
    from .._errors import BlockDiagError

    try:
        yield
    except OSError as e:
        raise BlockDiagError(f"{option}: cannot write {path!r}: {e}; the results were printed above") from None
