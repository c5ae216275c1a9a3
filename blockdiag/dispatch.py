"""Plan, then execute: choose a backend for a :class:`Problem` and say why.

``choose`` is a pure function of the problem (shape, dtype, device, sparsity, grad), the
settings in force and the tuning table; its result is cached. It works in two steps:

1. Constraints as data: every registered backend is asked why it would decline the
   problem (device, dtype, grad, shape rules, optional package missing), then the
   crossovers of :mod:`blockdiag.settings` filter the rest (the sparsity threshold for
   sparse layouts; ``dense_max_groups`` / ``dense_max_elements`` for the dense GEMM).
2. Ranking by data: the measured table (the tuning profile, or the built-in table) gives,
   at the measured point nearest to the problem (log-distance over batch, groups and
   block shape, same mode), each backend's time, scaled by the ratio of useful FLOPs.
   The fastest surviving candidate wins. Without a table, or where the table measured no
   survivor, a fixed preference order per device is used (``FALLBACK_ORDER``).

``loop`` accepts every problem, so a plan always exists and never names a backend that
cannot run the input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from . import settings as _config
from . import profile as _profile
from ._errors import BlockDiagError
from .backends import Problem, get, names

__all__ = ["Plan", "Candidate", "choose", "plan_for", "FALLBACK_ORDER"]

# Used when no measured table covers the problem: the order of the landscape's geomean ranks.
FALLBACK_ORDER = {
    "cpu": ("bmm", "loop", "conv", "dense", "csr", "bsr", "torch_sparse"),
    "cuda": ("bmm", "grouped_mm", "loop", "dense", "conv", "bsr", "csr", "torch_sparse"),
}


@dataclass(frozen=True)
class Candidate:
    """One backend's standing in a plan."""

    name: str
    ok: bool
    estimate_us: Optional[float]
    note: str

    def __str__(self) -> str:
        est = f"{self.estimate_us:10.1f} us" if self.estimate_us is not None else "         -   "
        mark = "ok " if self.ok else "-- "
        return f"  {mark}{self.name:13s}{est}  {self.note}"


@dataclass(frozen=True)
class Plan:
    """The backend chosen for a problem, why, and how every candidate fared.

    >>> from blockdiag.backends import Problem
    >>> plan = choose(Problem(batch=256, groups=50, block_in=10, block_out=10))
    >>> plan.backend in names()
    True
    """

    backend: str
    problem: Problem
    reason: str
    source: str
    candidates: tuple[Candidate, ...] = ()
    settings: tuple[tuple[str, object, str], ...] = ()

    def __str__(self) -> str:
        lines = [
            f"Plan for {self.problem.describe()}",
            f"  backend: {self.backend}",
            f"  reason:  {self.reason}",
            f"  table:   {self.source}",
        ]
        if self.settings:
            lines.append(
                "  settings: "
                + "; ".join(f"{k}={v!r} ({src})" for k, v, src in self.settings if k != "profile")
            )
        if self.candidates:
            lines.append("  candidates (estimated time at this shape):")
            lines += [str(c) for c in self.candidates]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):  # IPython shows the readable form
        p.text(str(self))


def _distance(p: Problem, m: dict) -> float:
    def d(a: int, b: int) -> float:
        return math.log2(max(a, 1)) - math.log2(max(b, 1))

    return math.sqrt(
        d(p.batch, m["batch"]) ** 2
        + d(p.groups, m["groups"]) ** 2
        + d(p.block_in, m["block_in"]) ** 2
        + d(p.block_out, m["block_out"]) ** 2
    )


def _resolved_settings(entry: Optional[dict]) -> tuple[tuple[str, object, str], ...]:
    prof = (entry or {}).get("settings", {}) if entry else {}
    out = []
    for k in ("sparsity_threshold", "dense_max_groups", "dense_max_elements"):
        v, src = _config.resolve(k, prof.get(k))
        out.append((k, v, src))
    return tuple(out)


def choose(problem: Problem) -> Plan:
    """The plan ``backend="auto"`` follows for ``problem``.

    >>> from blockdiag.backends import Problem
    >>> print(choose(Problem(256, 50, 10, 10)).backend in names())
    True

    Args:
        problem: a :class:`~blockdiag.backends.Problem`.

    Returns:
        a :class:`Plan` (print it for a readable report).
    """
    path = _config.resolve("profile")[0]
    entry, source = _profile.load_entry(problem.device, problem.dtype, path)
    settings = _resolved_settings(entry)
    return _choose(problem, settings, source, id(entry), entry)


_cache: dict = {}


def _choose(problem, settings, source, entry_id, entry) -> Plan:
    key = (problem, settings, source, entry_id)
    plan = _cache.get(key)
    if plan is None:
        if len(_cache) > 4096:
            _cache.clear()
        plan = _cache[key] = _rank(problem, settings, source, entry)
    return plan


def _rank(p: Problem, settings, source: str, entry: Optional[dict]) -> Plan:
    s = {k: v for k, v, _ in settings}
    notes: dict[str, str] = {}
    ok: list[str] = []
    for name in names():
        b = get(name)
        why = b.decline_reason(p)
        if why is None and b.sparse and p.sparsity < s["sparsity_threshold"]:
            why = f"sparsity {p.sparsity:.3f} is below sparsity_threshold={s['sparsity_threshold']}"
        if why is None and name == "dense":
            elems = p.groups**2 * p.block_in * p.block_out
            if p.groups > s["dense_max_groups"]:
                why = f"groups={p.groups} > dense_max_groups={s['dense_max_groups']}"
            elif elems > s["dense_max_elements"]:
                why = f"dense matrix has {elems} entries > dense_max_elements={s['dense_max_elements']}"
        if why is None:
            ok.append(name)
        else:
            notes[name] = why

    estimates: dict[str, float] = {}
    near = None
    ms = [m for m in (entry or {}).get("measurements", []) if m["mode"] == p.mode]
    if ms:
        near = min(ms, key=lambda m: _distance(p, m))
        scale = max(p.flops, 1) / max(2 * near["batch"] * near["groups"] * near["block_in"] * near["block_out"], 1)
        estimates = {k: v * scale for k, v in near["times_us"].items()}

    measured = sorted((n for n in ok if n in estimates), key=lambda n: estimates[n])
    order = FALLBACK_ORDER.get(p.device, ())
    unmeasured = sorted(
        (n for n in ok if n not in estimates),
        key=lambda n: order.index(n) if n in order else len(order),
    )
    ranked = measured + unmeasured
    if not ranked:  # unreachable while 'loop' is registered; kept as a clear error
        raise BlockDiagError(f"choose: no backend can run {p.describe()}: " + "; ".join(f"{k}: {v}" for k, v in notes.items()))
    best = ranked[0]
    if measured:
        at = f"batch={near['batch']} groups={near['groups']} block={near['block_in']}x{near['block_out']}"
        reason = f"fastest measured at the nearest table point ({at}, {p.mode})"
        if len(measured) > 1:
            reason += f": {estimates[measured[1]] / estimates[best]:.2f}x ahead of {measured[1]}"
    elif entry is None:
        reason = f"no measured table for {p.device}; first runnable backend in the {p.device} preference order"
    else:
        reason = "no runnable backend was measured near this shape; first in the preference order"

    cands = []
    for n in ranked:
        cands.append(Candidate(n, True, estimates.get(n), "chosen" if n == best else ""))
    for n in names():
        if n in notes:
            cands.append(Candidate(n, False, estimates.get(n), notes[n]))
    return Plan(best, p, reason, source, tuple(cands), settings)


def plan_for(backend: str, problem: Problem, fn_name: str = "GroupedLinear") -> Plan:
    """The plan for a fixed backend name, or ``auto``; raises if the backend declines.

    Raises:
        BlockDiagError: unknown name (listing the valid ones), or the backend cannot run
            the problem (with its reason).
    """
    if backend == "auto":
        return choose(problem)
    b = get(backend, fn_name)
    why = b.decline_reason(problem)
    if why is not None:
        raise BlockDiagError(f"{fn_name}: backend {backend!r} cannot run {problem.describe()}: {why}")
    return Plan(backend, problem, f"fixed by the user (backend={backend!r})", "none (fixed backend)")
