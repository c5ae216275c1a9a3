"""``blockdiag tune`` (measure this machine, write its profile) and ``blockdiag explain`` (one plan)."""

from __future__ import annotations

import sys

from . import _format as fmt
from ._args import _grid, _modes
from ._checks import (
    _check_backends,
    _check_distinct,
    _check_grid_memory,
    _check_output,
    _check_plot_format,
    _check_profile_input,
    _check_settings,
    _check_simd_isa,
)
from ._run import _announce, _looping, _point_costs, _runnable_names, _writing


def cmd_tune(args) -> int:
    from .. import profile as prof
    from .._errors import BlockDiagError
    from ..tuning import cross_check, merge_entry, plot_decision_map, tune

    _check_settings()
    _check_backends(args.backends, args.device, args.dtype)
    _check_simd_isa(args.backends, args.device)
    _check_output("--plot", args.plot)
    _check_plot_format(args.plot)
    grid = _grid(args, "quick")
    modes = _modes(args)
    _check_grid_memory(grid, modes, args.dtype, args.max_gflop)
    path = args.profile if args.profile is not None else prof.default_profile_path()
    profile_option = "--profile" if args.profile is not None else "the default profile"
    _check_output(profile_option, str(path), makes_dirs=True)
    _check_distinct({profile_option: str(path), "--plot": args.plot})
    _, unreadable = prof.read_profile(path)
    if unreadable is not None and unreadable.startswith(f"ValueError: {prof._NEWER}"):
        raise BlockDiagError(f"{profile_option}: {path} was {unreadable[len('ValueError: '):]}; "
                             "tune does not replace it: upgrade blockdiag, or name another profile")
    if unreadable is not None and unreadable.startswith("not readable"):
        raise BlockDiagError(f"{profile_option}: {path} is {unreadable}; tune does not replace a profile it "
                             "cannot read: fix its permissions, or name another profile")
    if unreadable is not None:
        # It may be something else than a damaged profile (--profile notes.json): not replaced.
        raise BlockDiagError(f"{profile_option}: {path} exists but is not a blockdiag profile ({unreadable}); "
                             "tune replaces no such file: remove it, or name another")
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
    try:
        entry = tune(grid, device=args.device, dtype=args.dtype, modes=modes, backends=args.backends,
                     rounds=args.repeat, min_time=args.min_time, max_gflop=args.max_gflop, stat=args.stat,
                     refine=args.refine, rematch=args.rematch, prior=old, progress=sys.stderr)
    except BaseException:
        # A tune stopped part way (Ctrl-C, SIGTERM, an error) writes nothing: the settings it
        # derives and the points it ranks need the whole grid, and a part of a grid saved
        # as an entry would replace the table for every shape on this device.
        print(f"tune: stopped before the end; {path} was not changed", file=sys.stderr)
        raise
    if not entry["measurements"]:
        raise BlockDiagError("tune: no point was measured, so nothing was written (an empty entry would "
                             "replace the built-in table for this machine)")
    if not any(m["times_us"] for m in entry["measurements"]):
        # Points without a single time (every backend named skipped there) are as empty:
        # saved, auto would rank no backend at any shape on this device.
        reasons = sorted({f"{n}: {why}" for m in entry["measurements"] for n, why in m.get("skipped", {}).items()})
        raise BlockDiagError("tune: no backend was timed at any point, so nothing was written (an entry without "
                             "times would replace the built-in table for this machine)"
                             + (f"; e.g. {reasons[0]}" if reasons else ""))
    # Merged into the entry the file holds when it is written (under its lock), not the one
    # read before the measuring: another run may have saved meanwhile.
    kept: dict = {}

    def merge(stored, new):
        kept["entry"] = merge_entry(stored, new)
        return kept["entry"]

    try:
        written = prof.save_entry(entry, path, merge=merge)
    except BlockDiagError as e:  # a full disk, a folder made read-only meanwhile
        raise BlockDiagError(f"{e}; {_rescued(entry)}") from None
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
        print(f"rematched {r['points']} points where the winner was not the earlier table's choice ({r['prior']}) "
              f"({r['rounds']} rounds each); {r['overturned']} overturned")
    if args.backends:
        # The entry replaces the built-in table for every shape on this device: a backend it
        # has no time for ranks after every measured one, everywhere (docs/tuning.md).
        measured = {n for m in entry["measurements"] for n in m["times_us"]}
        unmeasured = [n for n in _runnable_names(args.device) if n not in measured]
        if unmeasured:
            print(f"note: this profile has no times for {', '.join(unmeasured)}: auto ranks them after the measured "
                  f"backends at every shape on this device; `blockdiag tune` without --backends measures them")
    s = entry["settings"]
    thr = "never (1.0)" if s["sparsity_threshold"] >= 1.0 else f"{s['sparsity_threshold']:.4f}"
    print(f"measured sparsity_threshold: {thr}; dense_max_groups: {s['dense_max_groups']}; "
          f"dense_max_elements: {s['dense_max_elements']}")
    for mode, c in cross_check(entry).items():
        print(f"cross-check, {mode} (each point ranked from the others, chosen/fastest): "
              f"geomean {c['geomean']:.3f}, worst {c['worst']:.2f} at {c['worst_point']}, "
              f"{c['within_1.10']} of {c['points']} within 1.10")
    if args.plot:
        with _writing("--plot", args.plot):
            print(f"decision map: {plot_decision_map(entry, args.plot)}")
    return 0


def _rescued(entry: dict) -> str:
    """Save the measured ``entry`` somewhere else when its profile cannot be written; where, said.

    A tune measures for minutes before it writes: the entry goes to a profile of its own in a
    new private temporary folder (usable with ``--profile``), else onto stdout as JSON.
    """
    import json
    import tempfile
    from pathlib import Path

    from .. import profile as prof
    from .._errors import BlockDiagError

    try:
        spare = Path(tempfile.mkdtemp(prefix="blockdiag-tune-")) / "profile.json"
        prof.save_entry(entry, spare)
    except (OSError, BlockDiagError) as e:
        print(json.dumps(entry, indent=1, sort_keys=True))
        return f"the measured entry could not be saved elsewhere either ({e}) and was printed on stdout"
    return (f"the measurements were saved to {spare} instead: use it with --profile or "
            "$BLOCKDIAG_PROFILE, or copy its entry into the profile once that can be written")


def cmd_explain(args) -> int:
    from ..backends import Problem
    from ..dispatch import choose
    from ..settings import config

    _check_profile_input(args.profile)
    p = Problem(args.batch, args.groups, args.block[0], args.block[1], args.dtype, args.device, args.train)
    if args.profile:
        with config(profile=args.profile):
            plan = choose(p)
    else:
        plan = choose(p)
    print(plan)
    if p.device == "cpu":  # which of simd's kernel variants runs here (avx512, avx2, neon), or why none
        import torch

        from ..backends import simd

        print(simd.variant_note())
        print(f"planned for {torch.get_num_threads()} CPU threads (--threads; the profile's CPU entries are "
              "per thread count)")
    return 0
