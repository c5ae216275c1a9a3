"""``tune``: measure every runnable backend over a grid, rematch disputed winners, derive the settings."""

from __future__ import annotations

import datetime as _dt
from typing import Iterable, Optional, Sequence, TextIO

import torch

from .. import profile as _profile

# ``measure`` (and ``_rematch_all``) are looked up on the package at call time, so that
# replacing ``blockdiag.tuning.measure`` (the tests script it) reaches every caller.
from .. import tuning as _tuning
from ..backends import Problem, get, names
from ._timer import (
    TIE_MARGIN,
    Grid,
    _backend_step,
    _inputs,
    _Progress,
    _resolve_modes,
    _runnable,
    allocator_env,
    autograd_as_in_training,
)
from ._verify import wrong_results


@autograd_as_in_training()
def tune(
    grid: Grid,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    modes: Sequence[str] = ("forward", "train"),
    backends: Optional[Iterable[str]] = None,
    rounds: int = 5,
    min_time: float = 1e-2,
    max_gflop: float = float("inf"),
    stat: str = "median",
    refine: float = TIE_MARGIN,
    rematch: bool = True,
    prior: Optional[dict] = None,
    progress: Optional[TextIO] = None,
) -> dict:
    """Measure every runnable backend over ``grid``; returns a profile entry (not saved).

    Args:
        grid: the shapes.
        device: the device type to measure on.
        dtype: the dtype to measure.
        modes: ``"forward"`` and/or ``"train"`` (forward + backward).
        backends: names to measure (default: all registered).
        rounds: interleaved rounds per point (see :func:`measure`).
        min_time: seconds each sample should last (see :func:`measure`).
        stat: ``"median"`` or ``"min"`` of the samples (see :func:`measure`).
        refine: backends within this fraction of the fastest at a point get extra rounds
            (see :func:`measure`; default :data:`TIE_MARGIN`): the table's winner is what
            ``auto`` runs, and near-ties are where noise picks it.
        max_gflop: points whose forward product exceeds this many GFLOP are not measured
            (the chooser ranks them from the nearest measured points).
        rematch: where the fastest backend at a point is not the one ``prior`` would
            choose there, time the two again head to head (see :func:`rematch`) and keep
            what that says. On a shared machine one stalled sample can hand a point to the
            wrong backend by a wide margin, which more rounds of the same pass do not undo
            when the stall hit the winner's rivals; a second opinion that disagrees is where
            such an error costs the most, and only those points pay for the extra rounds.
        prior: the table whose choices are the second opinion (default: the built-in
            table for ``device``; none ships for some devices, and then nothing is
            rematched).
        progress: a stream for the progress bar (e.g. ``sys.stderr``), or None.

    Returns:
        an entry for :func:`blockdiag.profile.save_entry`, with the settings derived from
            the measurements (:func:`derive_settings`).

    Raises:
        BlockDiagError: unknown mode or backend name.
    """
    modes = _resolve_modes(modes)
    problems = [p for m in modes for p in grid.problems(m, dtype, device) if p.flops / 1e9 <= max_gflop]
    bar = _Progress(len(problems), "tune", progress)
    measurements = []
    for p in problems:
        ok, skipped = _runnable(p, backends)
        x, w, b, gy = _inputs(p)
        # A wrong backend must not be timed into the profile, where auto would then run it.
        wrong = wrong_results(p, {n: get(n).fn for n in ok}, x, w, b, gy)
        steps = {n: _backend_step(n, x, w, b, gy) for n in ok if n not in wrong}
        times, failed = _tuning.measure(steps, device, rounds, min_time, stat=stat, refine=refine)
        failed = {**wrong, **failed}
        row = {
            "mode": p.mode,
            "batch": p.batch,
            "groups": p.groups,
            "block_in": p.block_in,
            "block_out": p.block_out,
            "times_us": {n: round(t * 1e6, 3) for n, t in times.items()},
        }
        if skipped or failed:
            row["skipped"] = {**skipped, **failed}
        measurements.append(row)
        best = min(times, key=times.get) if times else "-"
        bar.step(f"{p.mode} B={p.batch} G={p.groups} {p.block_in}x{p.block_out}: {best}")
    if prior is None:
        prior = _profile.builtin_entry(device, dtype)
    rematched = (
        _tuning._rematch_all(measurements, prior, device, dtype, rounds, min_time, stat, progress)
        if rematch and prior is not None
        else None
    )
    return {
        "device_name": _profile.device_name(device),
        "device": device,
        "torch": torch.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(),
        "statistic": stat,
        "rounds": rounds,
        "allocator_env": allocator_env(),
        "settings": derive_settings(measurements),
        **({"rematched": rematched} if rematched is not None else {}),
        "measurements": measurements,
    }


def _row_problem(m: dict, dtype: torch.dtype, device: str) -> Problem:
    """The problem a measurement row was timed on."""
    return Problem(m["batch"], m["groups"], m["block_in"], m["block_out"], dtype, device, m["mode"] == "train")


def prior_choice(m: dict, prior: Optional[dict], dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> Optional[str]:
    """The backend ``prior`` ranks first at measurement ``m``'s shape, among those ``m`` timed.

    Only the table's times decide (no settings): the question is which of the backends
    measured here the other table expects to be fastest.

    >>> m = {"mode": "forward", "batch": 8, "groups": 4, "block_in": 2, "block_out": 2,
    ...      "times_us": {"dense": 1.0, "bmm": 2.0}}
    >>> prior_choice(m, {"measurements": [dict(m, times_us={"dense": 3.0, "bmm": 2.0})]})
    'bmm'
    """
    from ..dispatch import blended_times

    est, _ = blended_times(_row_problem(m, dtype, device), prior)
    cands = [n for n in m["times_us"] if n in est]
    return min(cands, key=est.get) if cands else None


def _rematch_all(measurements, prior, device, dtype, rounds, min_time, stat, progress) -> dict:
    disputed = []
    for m in measurements:
        if len(m["times_us"]) < 2:
            continue
        winner = min(m["times_us"], key=m["times_us"].get)
        other = prior_choice(m, prior, dtype, device)
        if other is not None and other != winner:
            disputed.append((m, winner, other))
    bar = _Progress(len(disputed), "rematch", progress)
    overturned = 0
    for m, winner, other in disputed:
        p = _row_problem(m, dtype, device)
        kept = rematch(m, p, (winner, other), rounds=REMATCH_ROUNDS_FACTOR * rounds, min_time=min_time, stat=stat)
        overturned += kept != winner
        bar.step(f"{p.mode} B={p.batch} G={p.groups} {p.block_in}x{p.block_out}: {winner} vs {other} -> {kept}")
    return {"points": len(disputed), "overturned": overturned,
            "prior": (prior or {}).get("device_name", "?"), "rounds": REMATCH_ROUNDS_FACTOR * rounds}


@autograd_as_in_training()
def rematch(m: dict, p: Problem, pair: Sequence[str], *, rounds: int, min_time: float = 1e-2,
            stat: str = "median") -> str:
    """Time the backends of ``pair`` head to head at ``p``; update ``m`` and return the faster.

    Both backends get fresh inputs and ``rounds`` interleaved rounds. The rematch decides
    the pair's ratio, not its level: their times in ``m["times_us"]`` become the rematch's,
    scaled so that the faster of the two gets the first pass's time of its winner, the
    fastest of all backends then. The other backends' times are from the first pass, and a
    machine that ran slower (or faster) during the rematch must not move the pair past them:
    unscaled, a rematch on a machine slowed down meanwhile would push both of the pair behind
    a third backend that neither was timed against in the rematch, and hand it the point.
    (Scaled to keep the pair's geometric mean, a rematch that found the two about equal put
    both above a third backend slower than the winner, which the table then chose, against
    both passes.)
    ``m["rematch"]`` records the first pass's times, the rematch's own and the outcome. Where
    a backend raises in the rematch, both keep their first times.

    Args:
        m: a measurement row of :func:`tune` (changed in place).
        p: its problem.
        pair: the first pass's winner and the challenger.
        rounds: interleaved rounds of the rematch (see :func:`measure`).
        min_time: seconds each sample should last (see :func:`measure`).
        stat: ``"median"`` or ``"min"`` of the samples (see :func:`measure`).

    Returns:
        the name that is now the faster of the two in ``m``.
    """
    x, w, b, gy = _inputs(p)
    steps = {n: _backend_step(n, x, w, b, gy) for n in pair}
    times, _ = _tuning.measure(steps, p.device, rounds, min_time, prune=0.0, stat=stat)
    before = {n: m["times_us"][n] for n in pair}
    # Only a rematch that timed both says anything about their ratio: one timed alone, on a
    # machine that may run faster or slower meanwhile, was compared with nothing.
    if len(times) == len(pair) and all(t > 0 for t in times.values()):
        scale = min(before.values()) / (min(times.values()) * 1e6)
        for n, t in times.items():
            m["times_us"][n] = round(t * 1e6 * scale, 3)
    kept = min(pair, key=lambda n: m["times_us"][n])
    m["rematch"] = {"first_us": before, "rematch_us": {n: round(t * 1e6, 3) for n, t in times.items()}, "kept": kept}
    return kept


# A rematch runs this many times tune's rounds: it decides between two backends that the
# first pass and the other table rank in opposite orders, so it needs more samples than
# the first pass had, and it times only those two.
REMATCH_ROUNDS_FACTOR = 2


def derive_settings(measurements: Sequence[dict]) -> dict:
    """The chooser's crossovers as measured: where sparse layouts and the dense GEMM win.

    ``sparsity_threshold`` is the lowest measured sparsity from which on a sparse backend
    was the fastest at every measured point (``1.0``, "never", when it never was at the
    sparsest); ``dense_max_groups`` / ``dense_max_elements`` are the largest group count and
    matrix size at which ``dense`` was fastest (0 when it never was).

    >>> derive_settings([{"mode": "forward", "batch": 8, "groups": 4, "block_in": 2,
    ...                   "block_out": 2, "times_us": {"dense": 1.0, "bmm": 2.0}}])
    {'sparsity_threshold': 1.0, 'dense_max_groups': 4, 'dense_max_elements': 64}
    """
    reg = {n: get(n) for n in names()}
    wins_sparse: dict[float, list[bool]] = {}
    dense_g, dense_e = 0, 0
    for m in measurements:
        t = m["times_us"]
        if not t:
            continue
        best = min(t, key=t.get)
        s = 1.0 - 1.0 / m["groups"] if m["groups"] else 0.0
        wins_sparse.setdefault(round(s, 6), []).append(best in reg and reg[best].sparse)
        if best in reg and reg[best].dense_matrix:
            dense_g = max(dense_g, m["groups"])
            dense_e = max(dense_e, m["groups"] ** 2 * m["block_in"] * m["block_out"])
    threshold = 1.0
    for s in sorted(wins_sparse, reverse=True):
        if not all(wins_sparse[s]):
            break
        threshold = s
    return {"sparsity_threshold": threshold, "dense_max_groups": dense_g, "dense_max_elements": dense_e}
