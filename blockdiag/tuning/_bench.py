"""``bench``: time ``auto`` against every backend, the ideal GEMM and the baselines, eager.

``bench_compiled`` (``_compiled``) times the compiled modules; both share the timer and these
intervals.
"""

from __future__ import annotations

import statistics
from functools import partial
from typing import Callable, Iterable, Optional, Sequence, TextIO

import torch

from .. import profile as _profile

# ``measure`` (and ``_rematch_all``) are looked up on the package at call time, so that
# replacing ``blockdiag.tuning.measure`` (the tests script it) reaches every caller.
from .. import tuning as _tuning
from .._errors import BlockDiagError
from ._memory import peak_memory
from ._timer import (
    BENCH_GRID,
    BENCH_REFINE,
    Grid,
    _api_step,
    _backend_step,
    _geomean,
    _ideal_step,
    _inputs,
    _linear_loop_step,
    _Progress,
    _resolve_modes,
    _runnable,
    _vmap_step,
    autograd_as_in_training,
    median_interval,
)
from ._verify import wrong_results

# The coverage of the intervals ``bench`` gives its ratios (:func:`median_interval` of the
# round-by-round ratios of two steps sampled moments apart): ``auto_over_fastest_interval``
# per point, and with ``--compiled`` ``compiled_over_best_peer_interval``. A whole interval
# above a margin is beyond it by more than the run's noise; one holding it is a tie at this
# many rounds. With bench's defaults (5 rounds, and 5 more for the steps it compares) a point
# has 10 paired ratios, and the interval runs from the second smallest to the second largest
# (97.9% coverage).
INTERVAL_LEVEL = 0.95


@autograd_as_in_training()
def bench(
    grid: Grid = BENCH_GRID,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    modes: Sequence[str] = ("forward", "train"),
    backends: Optional[Iterable[str]] = None,
    rounds: int = 5,
    min_time: float = 1e-2,
    baselines: bool = True,
    memory: bool = True,
    max_gflop: float = float("inf"),
    stat: str = "median",
    refine: float = BENCH_REFINE,
    progress: Optional[TextIO] = None,
    on_row: Optional[Callable[[list[dict], int], None]] = None,
) -> list[dict]:
    """Time every backend, ``auto``, the ideal GEMM and the baselines at each grid point.

    Args:
        grid: the shapes (default: the project's performance targets, :data:`BENCH_GRID`).
        device: the device type to measure on.
        dtype: the dtype to measure.
        modes: ``"forward"`` and/or ``"train"`` (forward + backward).
        backends: backends to time (default: all registered; ``auto`` is always timed).
        rounds: interleaved rounds per point (see :func:`measure`).
        min_time: seconds each sample should last (see :func:`measure`).
        stat: ``"median"`` or ``"min"`` of the samples (see :func:`measure`).
        progress: a stream for the progress bar (e.g. ``sys.stderr``), or None.
        on_row: called after each point with the rows so far and the number of points, so
            that a caller can save a long run as it goes (``bench --json`` does).
        refine: after the rounds, ``auto``, the chosen backend's bare kernel, the ``nn.Linear``
            loop and the backends within this fraction of the fastest (the fastest, and
            ``auto``'s choice forced by name, always; under a profile the built-in table's
            choice too) get ``rounds`` more interleaved rounds, and are judged on all their
            samples (see :func:`measure`; 0 disables it).
        baselines: also time a loop of ``nn.Linear`` and ``torch.func.vmap`` ensembling.
        memory: record each backend's peak tensor memory of one call (forward+backward in
            training) with :func:`peak_memory`.
        max_gflop: points whose forward product exceeds this many GFLOP are skipped (and
            listed as skipped in the result).

    Returns:
        one dict per point and mode: ``times_us`` (each backend through
            ``grouped_linear(..., backend=name)``), ``auto`` (its choice), ``auto_us``,
            ``fastest``, ``auto_over_fastest``, ``auto_over_choice`` (auto over its choice
            forced by name through the same entry point: what choosing costs, where that
            backend was timed), ``auto_kernel_us`` (the chosen backend's bare kernel, no
            dispatch) and ``auto_over_kernel``, ``ideal_us``,
            ``fraction_of_ideal`` (ideal time over auto's), ``baselines_us``,
            ``peak_bytes``, ``faults_per_step`` (every step's minor page faults per call,
            where the platform counts them; see :data:`FAULTS_NOTED`), ``skipped`` (name ->
            reason), ``table`` (the source of auto's plan) and, where that is a tuning profile, ``builtin_choice`` (what the built-in table
            would have chosen: :func:`~blockdiag.dispatch.builtin_plan`).
    """
    from ..dispatch import builtin_plan, choose
    from ..nn.linear import grouped_linear

    modes = _resolve_modes(modes)
    problems = [p for m in modes for p in grid.problems(m, dtype, device)]
    bar = _Progress(len(problems), "bench", progress)
    rows = []
    for p in problems:
        row = {"mode": p.mode, "batch": p.batch, "groups": p.groups, "block_in": p.block_in, "block_out": p.block_out}
        if p.flops / 1e9 > max_gflop:
            row["skipped_point"] = f"{p.flops / 1e9:.1f} GFLOP > --max-gflop {max_gflop:g}"
            rows.append(row)
            bar.step("skipped (too large)")
            if on_row is not None:
                on_row(rows, len(problems))
            continue
        ok, skipped = _runnable(p, backends)
        x, w, b, gy = _inputs(p)
        plan = choose(p)
        choice = plan.backend
        # Under a tuning profile, what the built-in table would have run: its time is in
        # times_us (every backend is timed), so the profile is judged against it in one run.
        builtin = builtin_plan(p).backend if plan.source != _profile.BUILTIN_SOURCE else None
        # Every backend is timed through the same public entry point as auto, so that
        # auto/fastest measures the choice; the choice's bare kernel is timed as well, so
        # that auto/kernel measures what the dispatch itself costs.
        # A backend whose numbers are wrong is not timed (it would be "fastest" for nothing);
        # auto itself wrong ends the run: what it runs is what users get.
        wrong = wrong_results(p, {n: partial(grouped_linear, backend=n) for n in (*ok, "auto")}, x, w, b, gy)
        if "auto" in wrong:
            raise BlockDiagError(f"bench: {p.describe()}: auto (running {choice!r}): "
                                 f"{wrong['auto'].removeprefix('skipped: ')}")
        ok = [n for n in ok if n not in wrong]
        steps = {n: _api_step(n, x, w, b, gy) for n in ok}
        steps["auto"] = _api_step("auto", x, w, b, gy)
        steps["auto_kernel"] = _backend_step(choice, x, w, b, gy)
        steps["ideal"] = _ideal_step(p, p.requires_grad)
        if baselines:
            steps["nn_linear_loop"] = _linear_loop_step(p, x, gy)
            steps["vmap"] = _vmap_step(p, x, gy)
        extra = ("auto", "auto_kernel", "ideal", "nn_linear_loop", "vmap")
        # auto and the references are never pruned: their times are the point of the run.
        # The ratios the run reports (auto over the fastest and over its own kernel and
        # choice, the nn.Linear loop over auto) are where one burst of noise would decide
        # a verdict; those steps get the extra rounds, at every point alike.
        also = ("auto", "auto_kernel", choice, "nn_linear_loop") + ((builtin,) if builtin else ())
        faults: dict[str, float] = {}
        taken: dict[str, list[float]] = {}
        times, failed = _tuning.measure(steps, device, rounds, min_time, keep=extra, stat=stat, refine=refine,
                                        refine_also=also, faults=faults, per_round=taken)
        if "auto" in failed or "ideal" in failed:
            raise BlockDiagError(f"bench: {p.describe()}: auto or the ideal GEMM failed: {failed}")
        bt = {n: t for n, t in times.items() if n not in extra}
        fastest = min(bt, key=bt.get) if bt else None
        row.update(
            times_us={n: round(t * 1e6, 3) for n, t in bt.items()},
            auto=choice,
            auto_us=round(times["auto"] * 1e6, 3),
            fastest=fastest,
            auto_over_fastest=round(times["auto"] / bt[fastest], 4) if fastest else None,
            auto_kernel_us=round(times["auto_kernel"] * 1e6, 3),
            auto_over_kernel=round(times["auto"] / times["auto_kernel"], 4),
            ideal_us=round(times["ideal"] * 1e6, 3),
            fraction_of_ideal=round(times["ideal"] / times["auto"], 4),
            baselines_us={n: round(times[n] * 1e6, 3) for n in ("nn_linear_loop", "vmap") if n in times},
            skipped={**skipped, **wrong, **failed},
            table=plan.source,
        )
        if fastest:
            # Round by round, auto over the fastest: whether a verdict (within 1.10) holds
            # beyond the run's noise.
            paired = [a / f for a, f in zip(taken.get("auto", ()), taken.get(fastest, ()))]
            iv = median_interval(paired, INTERVAL_LEVEL)
            if iv is not None:
                row["auto_over_fastest_interval"] = [round(iv[0], 4), round(iv[1], 4)]
        if choice in bt:
            row["auto_over_choice"] = round(times["auto"] / bt[choice], 4)
        if faults:
            row["faults_per_step"] = {n: round(v, 1) for n, v in faults.items()}
        if builtin:
            row["builtin_choice"] = builtin
        if memory:
            row["peak_bytes"] = {n: peak_memory(steps[n]) for n in ok if n not in failed}
        rows.append(row)
        bar.step(f"{p.mode} B={p.batch} G={p.groups} {p.block_in}x{p.block_out}: auto/fastest {row['auto_over_fastest']}")
        if on_row is not None:
            on_row(rows, len(problems))
    return rows


def summarize(rows: Sequence[dict]) -> dict:
    """Per mode: geomean and worst auto/fastest, median fraction of ideal, baseline speed-ups.

    Where rows were measured under a tuning profile, also the built-in table's choices
    against the same run's fastest, and the profile's choices over the built-in table's.

    >>> summarize([])
    {}
    """
    out = {}
    for mode in sorted({r["mode"] for r in rows}):
        rs = [r for r in rows if r["mode"] == mode and "auto_us" in r]
        if not rs:
            continue
        # A point where every backend named was skipped (--backends dense above the dense
        # limit) has auto's time but no fastest to divide by: it counts in the figures of
        # auto alone, not in those over the fastest.
        rated = [r for r in rs if r["auto_over_fastest"] is not None]
        s: dict = {"points": len(rs)}
        if rated:
            ratios = [r["auto_over_fastest"] for r in rated]
            worst = max(rated, key=lambda r: r["auto_over_fastest"])
            s.update({
                "geomean_auto_over_fastest": round(_geomean(ratios), 4),
                "max_auto_over_fastest": round(max(ratios), 4),
                "worst_point": f"B={worst['batch']} G={worst['groups']} {worst['block_in']}x{worst['block_out']}",
                "within_1.10": sum(x <= 1.10 for x in ratios),
                "rated_points": len(rated),
            })
        s["median_fraction_of_ideal"] = round(statistics.median(r["fraction_of_ideal"] for r in rs), 4)
        # The same verdict with each point's interval (rows from before intervals lack it).
        iv = [r["auto_over_fastest_interval"] for r in rs if "auto_over_fastest_interval" in r]
        if iv:
            s["points_with_interval"] = len(iv)
            s["beyond_1.10_beyond_noise"] = sum(lo > 1.10 for lo, _ in iv)
        # The choice alone: the chosen backend forced by name over the fastest. It leaves out
        # the noise between auto's own samples and the forced ones of the same kernel.
        chosen = [r["times_us"][r["auto"]] / r["times_us"][r["fastest"]] for r in rated if r["auto"] in r["times_us"]]
        if chosen:
            s["geomean_choice_over_fastest"] = round(_geomean(chosen), 4)
            s["choice_within_1.10"] = sum(x <= 1.10 for x in chosen)
            s["choice_points"] = len(chosen)
        # Under a tuning profile: the built-in table's choice at the same points, in the
        # same run, and the profile's choice over it (below 1: the profile chose better).
        vs = [
            (r["times_us"][r["builtin_choice"]], r["times_us"][r["auto"]], r["times_us"][r["fastest"]])
            for r in rs
            if "builtin_choice" in r and r["builtin_choice"] in r["times_us"] and r["auto"] in r["times_us"]
        ]
        if vs:
            s["geomean_builtin_choice_over_fastest"] = round(_geomean([b / f for b, _, f in vs]), 4)
            s["builtin_choice_within_1.10"] = sum(b / f <= 1.10 for b, _, f in vs)
            s["builtin_points"] = len(vs)
            s["geomean_choice_over_builtin_choice"] = round(_geomean([c / b for b, c, _ in vs]), 4)
            s["choices_differing_from_builtin"] = sum(r["builtin_choice"] != r["auto"] for r in rs if "builtin_choice" in r)
        # What choosing costs: auto over the same backend forced by name, both through the
        # public entry point (the dispatch both pay is in neither ratio's difference).
        forced = [r["auto_over_choice"] for r in rs if "auto_over_choice" in r]
        if forced:
            s["geomean_auto_over_choice"] = round(_geomean(forced), 4)
        kernel = [r["auto_over_kernel"] for r in rs if "auto_over_kernel" in r]
        if kernel:
            s["geomean_auto_over_kernel"] = round(_geomean(kernel), 4)
            s["median_dispatch_overhead_us"] = round(
                statistics.median(r["auto_us"] - r["auto_kernel_us"] for r in rs if "auto_kernel_us" in r), 2
            )
        for base in ("nn_linear_loop", "vmap"):
            sp = [r["baselines_us"][base] / r["auto_us"] for r in rs if base in r.get("baselines_us", {})]
            if sp:
                s[f"geomean_speedup_vs_{base}"] = round(_geomean(sp), 3)
                s[f"min_speedup_vs_{base}"] = round(min(sp), 3)
        out[mode] = s
    return out


# --- Compiled mode (``bench --compiled``) -------------------------------------------------
#
# The training step (or the forward) of ``torch.compile(GroupedLinear)`` and


# ``bench`` (eager and compiled) names the points where a timed step page-faults at least
# this many times a call: 40 KB of fresh pages a step, where an allocator that keeps what
# the step freed needs none. Above it the step pays for new memory every call (docs/faq.md),
# which can decide a comparison.
FAULTS_NOTED = 10
