"""How well a table ranks shapes it did not measure (each point left out in turn)."""

from __future__ import annotations

import torch

from ._timer import _geomean
from ._tune import _row_problem


def cross_check(entry: dict) -> dict:
    """How well a table ranks shapes it did not measure: each point ranked from the others.

    Each measurement is left out in turn; the chooser's ranking (the nearest measured
    shapes, blended) picks a backend for it from the rest, among the backends measured
    there that may run it under the settings in force; that backend's measured time is
    compared with the fastest of them. A coarse grid, or crossovers that move between
    grid points, show up as ratios over 1: a denser grid (``tune --batch/--groups/--blocks``)
    is then worth its time. Nothing is timed.

    >>> cross_check({"measurements": []})
    {}

    Args:
        entry: a profile entry (as ``tune`` returns or ``profile.load_entry`` reads).

    Returns:
        per mode with at least two measurements: ``points``, ``geomean`` and ``worst`` of
            (chosen time / fastest time), ``within_1.10``, and ``worst_point``.
    """
    from ..dispatch import blended_times, candidates

    dtype = getattr(torch, entry.get("dtype", "float32"))
    ms = [m for m in entry.get("measurements", []) if m.get("times_us")]
    out = {}
    for mode in sorted({m["mode"] for m in ms}):
        ratios = []
        for m in (m for m in ms if m["mode"] == mode):
            p = _row_problem(m, dtype, entry.get("device", "cpu"))
            rest = {"measurements": [o for o in ms if o is not m]}
            est, _ = blended_times(p, rest)
            # The chooser's filter, under this entry's settings as if it were the profile in force.
            allowed = set(candidates(p, table=entry))
            cands = [n for n in m["times_us"] if n in est and n in allowed]
            if not cands:
                continue
            chosen = min(cands, key=est.get)
            ratios.append((m["times_us"][chosen] / min(m["times_us"][n] for n in cands), m))
        if not ratios:
            continue
        worst = max(ratios, key=lambda rm: rm[0])
        out[mode] = {
            "points": len(ratios),
            "geomean": round(_geomean([r for r, _ in ratios]), 4),
            "worst": round(worst[0], 4),
            "worst_point": f"B={worst[1]['batch']} G={worst[1]['groups']} {worst[1]['block_in']}x{worst[1]['block_out']}",
            "within_1.10": sum(r <= 1.10 for r, _ in ratios),
        }
    return out
