"""``blockdiag bench``: every backend, ``auto`` and the baselines over a grid, or the compiled
modules against the compiled peers (``--compiled``)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Sequence

import torch

from . import _format as fmt
from ._args import _grid, _modes
from ._checks import (
    _check_backends,
    _check_compiler,
    _check_distinct,
    _check_grid_memory,
    _check_output,
    _check_profile_input,
    _check_settings,
    _check_simd_isa,
)
from ._run import _announce, _looping, _point_costs, _print_faults, _provenance, _runnable_names, _writing


class _Saver:
    """``--json``'s writer. The run so far is saved after each point, marked ``"complete":
    false`` with ``points_done`` of ``points_total``, so that a run stopped part way (a
    timeout, Ctrl-C, a failure at a later point) keeps what it measured; the end of the
    run saves it all as ``"complete": true``. Every write is atomic (``write_json_atomic``).
    A failed save part way is said once on stderr and the measuring goes on: the final save
    raises the command's error, after the table is printed.

    Where ``FILE`` already exists when the run starts (an earlier run's results, kept to
    compare with), the saves part way go to ``FILE.partial`` beside it and ``FILE`` is
    replaced only by the complete run: an interrupted rerun must not trade a complete file
    for a few points. :meth:`interrupted` says on stderr where the run so far is."""

    def __init__(self, args, head: dict, summarize) -> None:
        self.args, self.head, self.summarize = args, head, summarize
        self.warned = False
        self.saved = 0
        self.partial_path = args.json + ".partial" if os.path.lexists(args.json) else args.json

    def _out(self, rows: list, total: int, complete: bool) -> dict:
        return {**self.head, **_provenance(), "complete": complete, "points_done": len(rows), "points_total": total,
                "summary": self.summarize(rows), "rows": rows}

    def partial(self, rows: list, total: int) -> None:
        from .. import profile as prof

        if len(rows) >= total:  # the final save follows
            return
        try:
            prof.write_json_atomic(self.partial_path, self._out(rows, total, False))
            self.saved = len(rows)
        except OSError as e:
            if not self.warned:
                self.warned = True
                print(f"--json: cannot save the run so far to {self.partial_path!r}: {e}; measuring goes on",
                      file=sys.stderr)

    def final(self, rows: list) -> None:
        from .. import profile as prof

        with _writing("--json", self.args.json):
            prof.write_json_atomic(self.args.json, self._out(rows, len(rows), True))
        if self.partial_path != self.args.json:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.partial_path)

    def interrupted(self) -> None:
        """Say where the points measured before the run stopped are (or that none were saved)."""
        if self.saved:
            kept = "" if self.partial_path == self.args.json else f"; {self.args.json} is as it was"
            print(f"--json: the {self.saved} points measured so far are in {self.partial_path} "
                  f"(\"complete\": false){kept}", file=sys.stderr)
        else:
            print(f"--json: no point was complete; nothing was written to {self.args.json}", file=sys.stderr)


@contextlib.contextmanager
def _telling(saver):
    """Where measuring stops early (Ctrl-C, SIGTERM, an error at a later point), ``saver``
    says where the run so far is."""
    try:
        yield
    except BaseException:
        if saver:
            saver.interrupted()
        raise


def _builtin_columns(r: dict) -> str:
    b = r.get("builtin_choice")
    t = r["times_us"].get(b) if b else None
    ratio = f"{t / r['times_us'][r['fastest']]:6.2f}" if t else f"{'-':>6s}"
    return f" {b or '-':>11s} {ratio}"


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


def _print_compiled_table(args, rows: Sequence[dict], bd: list, summary: dict) -> None:
    """``bench --compiled``'s table, its failures and the summary per mode (on stdout)."""
    from ..tuning import COMPILED_CONTROL, COMPILED_PEERS

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
    for mode, per in summary.items():
        for key, s in per.items():
            print(fmt.summary_lines(f"{mode} {key}", s, fmt.COMPILED_SUMMARY,
                                    skip=("targets_met", "slower_beyond_noise_points")))
            if "targets_met" in s:
                met = s["targets_met"]
                print("  the project's compiled-mode targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in met.items()))


def _bench_compiled(args, grid, modes) -> int:
    """``bench --compiled``: the compiled models against the compiled peers (see ``bench_compiled``)."""
    from .. import profile as prof
    from ..tuning import COMPILED_PEERS, allocator_env, bench_compiled, summarize_compiled

    bd = ["auto", *dict.fromkeys(args.backends or ())]
    # Per point and model: each blockdiag module eager and compiled, the peers and the control.
    points = _point_costs(grid, modes, args.max_gflop) * len(args.compiled)
    steps = 2 * (len(bd) + (0 if args.no_baselines else len(COMPILED_PEERS) + 1))
    # The loop of heads, eager and compiled, calls torch once per group.
    loops = 2 * _looping(n for n in bd if n != "auto") + (0 if args.no_baselines else 2)
    _announce("bench", args, len(points), modes, args.json or "nothing (no --json)",
              fmt.estimate_line(points, steps, "modules", args.repeat, args.min_time, args.device,
                                "compiling adds seconds to minutes per point", loops=loops))
    saver = _Saver(args, {"device_name": prof.device_name(args.device), "torch": torch.__version__,
                          "dtype": str(args.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
                          "statistic": args.stat, "rounds": args.repeat, "refine": args.refine,
                          "argv": sys.argv[1:],
                          "compiled": {"models": list(args.compiled), "compiler": args.compiler, "dynamic": False},
                          "allocator_env": allocator_env()}, summarize_compiled) if args.json else None
    with _telling(saver):
        rows = bench_compiled(grid, device=args.device, dtype=args.dtype, modes=modes, models=args.compiled,
                              backends=args.backends, rounds=args.repeat, min_time=args.min_time,
                              baselines=not args.no_baselines, max_gflop=args.max_gflop, stat=args.stat,
                              refine=args.refine, compiler=args.compiler, progress=sys.stderr,
                              on_row=saver.partial if saver else None)
    summary = summarize_compiled(rows)
    # The results file first if printing fails (see cmd_bench).
    try:
        _print_compiled_table(args, rows, bd, summary)
    finally:
        if saver:
            saver.final(rows)
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _print_table(args, rows: Sequence[dict], summary: dict) -> None:
    """``bench``'s table, the notes on its points and the summary per mode (on stdout)."""
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
    for mode, s in summary.items():
        print(fmt.summary_lines(mode, s))


def cmd_bench(args) -> int:
    from .. import profile as prof
    from .._errors import BlockDiagError
    from ..settings import config
    from ..tuning import allocator_env, bench, summarize

    _check_settings()
    _check_backends(args.backends, args.device, args.dtype)
    _check_simd_isa(args.backends, args.device)
    _check_output("--json", args.json)
    _check_profile_input(args.profile)
    read = args.profile if args.profile is not None else str(prof.default_profile_path())
    _check_distinct({"--profile" if args.profile is not None else "the profile read": read, "--json": args.json})
    if args.compiled:
        args.compiler = args.compiler or "inductor"
        _check_compiler(args.compiler)
    elif args.compiler is not None:  # it would be silently ignored
        raise BlockDiagError(f"--compiler {args.compiler} applies to --compiled runs only")
    grid = _grid(args, "targets")
    _check_grid_memory(grid, ("train",) if args.compiled or args.mode != "forward" else ("forward",),
                       args.dtype, args.max_gflop, baselines=not args.no_baselines)
    if args.mode is None:  # bench's own default: both, and the training step alone with --compiled
        args.mode = "train" if args.compiled else "both"
    modes = _modes(args)
    if not _point_costs(grid, modes, args.max_gflop):  # as tune refuses it: a run that times nothing
        raise BlockDiagError(f"--max-gflop {args.max_gflop:g} skips every point of the grid: nothing to measure")
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
    saver = _Saver(args, {"device_name": prof.device_name(args.device), "torch": torch.__version__,
                          "dtype": str(args.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
                          "statistic": args.stat, "rounds": args.repeat, "refine": args.refine,
                          "argv": sys.argv[1:], "allocator_env": allocator_env()}, summarize) if args.json else None
    with ctx, _telling(saver):
        rows = bench(grid, device=args.device, dtype=args.dtype, modes=modes, backends=args.backends,
                     rounds=args.repeat, min_time=args.min_time, baselines=not args.no_baselines,
                     memory=args.json is not None and not args.no_memory, max_gflop=args.max_gflop,
                     stat=args.stat, refine=args.refine, progress=sys.stderr,
                     on_row=saver.partial if saver else None)
    summary = summarize(rows)
    # The results file first if printing fails (stdout piped into head, a full disk): a
    # closed pipe lost the whole run's --json.
    try:
        _print_table(args, rows, summary)
    finally:
        if saver:
            saver.final(rows)
    if args.json:
        print(f"wrote {args.json}")
    return 0
