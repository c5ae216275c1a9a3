"""Plan, then execute: choose a backend for a :class:`Problem` and say why.

``choose`` is a pure function of the problem (shape, dtype, device, sparsity, grad), the
settings in force and the tuning table; its result is cached. It works in two steps:

1. Constraints as data: every registered backend is asked why it would decline the
   problem (device, dtype, grad, shape rules, optional package missing), then the
   crossovers of :mod:`blockdiag.settings` filter the rest (the sparsity threshold for
   sparse layouts; ``dense_max_groups`` / ``dense_max_elements`` for the dense GEMM; with
   ``double_backward`` set, training keeps to backends declaring ``double_grad``).
   :func:`candidates` is this filter on its own, the one ``tune`` and ``bench`` use too.
2. Ranking by data: the measured table (the tuning profile, or the built-in table) gives
   each backend's time in the problem's mode. At a measured shape that is the measurement;
   elsewhere it is blended from the ``NEIGHBOURS`` measured shapes nearest in log space
   (batch, groups, block in and out), weighted by inverse squared distance: a weighted
   geometric mean of each backend's time over the fastest there (where it was measured),
   times a weighted geometric mean of the fastest time scaled by useful FLOPs. The
   fastest surviving candidate wins. Without a table, or where the table measured no
   survivor, a fixed preference order per device is used (``FALLBACK_ORDER``).

``loop`` accepts every problem, so a plan always exists and never names a backend that
cannot run the input.

One plan cache, one epoch
-------------------------

Plans (for ``auto`` and for a named backend alike) live in one cache keyed by
``(backend, problem, epoch())`` (:func:`cached_plan`; :func:`choose` and :func:`plan_for` are
served from it). :func:`epoch` is a cheap hashable value that changes whenever anything a
plan depends on may have changed, so a cached plan is never checked, only looked up:

- ``generation``, one counter that every in-process mutator bumps
  (:func:`blockdiag.settings.bump_epoch`): ``set_config`` / ``set_sparsity_threshold``; a
  profile written (``save_entry``, ``blockdiag tune``) or forgotten (``clear_cache``); a
  backend registered, replaced or removed (the registry is a mapping whose every mutation
  bumps, so ``monkeypatch.setitem`` on it does too);
- this thread's ``config`` stack, as a small id (equal stacks share one: re-entering the same
  ``with config(...)`` block finds the plans cached the first time);
- the environment variables the chooser reads (``BLOCKDIAG_*`` and ``XDG_CACHE_HOME``,
  which name the settings and the profile's path). The environment cannot tell anyone it
  changed, so :func:`epoch` reads them on every call, straight from ``os.environ``'s
  mapping (a dictionary lookup each, no system call): a change is seen at the next call.

Two more things change without telling anyone: the calling thread's torch thread count
(``torch.set_num_threads``, part of the CPU profile's key), which :func:`epoch` reads on
every call (one C call) and carries as its last item, so threads whose counts differ (under
OpenMP the count is per thread) keep plans of their own, and a thread whose own count changed
bumps ``generation``; and the profile files, which another process can rewrite and are
dearer to look at (a ``stat`` system call each). :func:`epoch` looks at them at most every
:data:`blockdiag.profile.RECHECK_S` seconds (1 s; one ``time.monotonic`` per call decides),
at the first call after any bump: it stats each file a plan was built from,
missing ones included, compares mtime, size and inode with what they were when read, and
bumps ``generation`` on a change. So a profile written by another process is followed
within a second, one written in this process at once.

Plans are computed only from state the epoch covers, plus each backend's availability, which
is fixed for the process (its probe is cached); a plan whose epoch moved while it was being
computed is returned but not kept. ``choose`` reads no tensor and takes no lock (the
dictionary operations are atomic under the GIL), so it can be called from any thread and
from inside a registered op at run time. The per-call memo of ``GroupedLinear``
(``nn/linear.py``) keys on the operands and the same epoch, so it needs no checks of its own
either: its hit path costs one ``epoch()`` call (a few dictionary lookups and one clock
read: most of what ``auto`` costs over a named backend) and one dictionary lookup.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from . import settings as _config
from . import profile as _profile
from ._errors import BlockDiagError
from .backends import Backend, Problem, get, names, registry
from .settings import epoch

__all__ = [
    "Plan", "Candidate", "choose", "candidates", "exclusions", "settings_exclusion", "builtin_plan", "plan_for", "cached_plan", "epoch", "FALLBACK_ORDER",
    "NEIGHBOURS", "nearest_measurements", "blended_times", "plan_state",
]

# Used where no measured table covers the problem, or for backends it did not measure: per
# device type, the backends in the order of their geometric-mean time over the fastest in
# the built-in table, over both modes (bmm_fm_bmm and bmm_fm_loop run only with autograd: in
# forward mode they are screened out, and the order starts at bmm_fm). A backend the table
# measured in another dtype only (grouped_mm on CUDA) is placed by that dtype's ranks, one
# it could not measure (torch_sparse, an optional package) comes last, and a backend
# registered later (blockdiag.register_backend) after all of these.
FALLBACK_ORDER = {
    "cpu": ("simd", "bmm_fm_bmm", "bmm_fm_loop", "bmm_fm", "mkl_batch", "bmm", "loop", "csr", "bsr", "conv", "dense", "torch_sparse"),
    "cuda": ("bmm_fm_bmm", "bmm_fm", "bmm", "grouped_mm", "dense", "conv", "bmm_fm_loop", "bsr", "csr", "loop", "torch_sparse"),
}

# The crossovers: a profile derives them from its times, so each resolves from the profile's
# value too, and every plan lists them. ``double_backward`` is the user's word only (no
# table can know whether the gradients are differentiated again) and is listed where set.
SETTINGS_USED = ("sparsity_threshold", "dense_max_groups", "dense_max_elements")

# Off-grid shapes are ranked from this many nearest measurements, not only the nearest: a
# shape between grid points (B=128 between 32 and 256, G=8 between 4 and 16) otherwise
# takes one neighbour's winner, and the winner changes along batch and groups (see
# docs/design.md, "Ranking between measured shapes"). Checked against the built-in CPU
# table on off-grid shapes: blending several neighbours brought the choice closer to the
# fastest than the nearest alone did, any number from 4 to 12 about equally, and the grid's
# own shapes (each left out in turn and predicted from the rest) lost nothing.
NEIGHBOURS = 6


@dataclass(frozen=True)
class Candidate:
    """One backend's standing in a plan.

    Attributes:
        name: the backend.
        ok: whether it may run this problem (``False``: declined, see ``note``).
        estimate_us: its time from the table in microseconds, or None where not measured.
        note: why it was declined, or how the time was obtained.
        measured: the time was measured at exactly this shape (not scaled from a neighbour).
    """

    name: str
    ok: bool
    estimate_us: Optional[float]
    note: str
    measured: bool = False

    def __str__(self) -> str:
        est = f"{self.estimate_us:10.1f} us" if self.estimate_us is not None else "         -   "
        mark = "ok " if self.ok else "-- "
        return f"  {mark}{self.name:13s}{est}  {self.note}"


@dataclass(frozen=True)
class Plan:
    """The backend chosen for a problem, why, and how every candidate fared.

    ``str(plan)`` is the report ``blockdiag explain`` prints.

    >>> from blockdiag.backends import Problem
    >>> plan = choose(Problem(batch=256, groups=50, block_in=10, block_out=10))
    >>> plan.backend in names()
    True

    Attributes:
        backend: the chosen backend's name.
        problem: what was planned for.
        reason: one sentence on why.
        source: which table ranked the candidates.
        candidates: every registered backend, runnable ones first, fastest first.
        settings: ``(name, value, where the value came from)`` for each setting used.
        neighbours: for a shape the table did not measure, the measured shapes its times
            were blended from: ``(batch, groups, block_in, block_out, weight, fastest)``,
            ``weight`` the share in the blend and ``fastest`` the fastest runnable backend
            measured there; empty at a measured shape.
        measured_on: the device name and torch version of the table's entry (the
            built-in table holds entries of several machines), or empty.
    """

    backend: str
    problem: Problem
    reason: str
    source: str
    candidates: tuple[Candidate, ...] = ()
    settings: tuple[tuple[str, object, str], ...] = ()
    neighbours: tuple[tuple[int, int, int, int, float, str], ...] = ()
    measured_on: str = ""

    def __str__(self) -> str:
        on = f" (measured on {self.measured_on})" if self.measured_on else ""
        lines = [
            f"Plan for {self.problem.describe()}",
            f"  backend: {self.backend}",
            f"  reason:  {self.reason}",
            f"  table:   {self.source}{on}",
        ]
        if self.settings:
            lines.append("  settings: " + "; ".join(f"{k}={v!r} ({src})" for k, v, src in self.settings))
        if self.neighbours:
            lines.append("  blended from (share of the weight, fastest runnable backend there):")
            lines += [f"    batch={b} groups={g} block={i}x{o}: {w:.0%}, {f}" for b, g, i, o, w, f in self.neighbours]
        if self.candidates:
            lines.append("  candidates (time at this shape; declined ones last):")
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


def _resolved_settings(entry: Optional[dict], label: str) -> tuple[tuple[str, object, str], ...]:
    prof = (entry or {}).get("settings", {})
    out = tuple((k, *_config.resolve(k, prof.get(k), label)) for k in SETTINGS_USED)
    double = _config._explicit("double_backward")
    return out + (("double_backward", *double),) if double is not None and double[0] else out


def choose(problem: Problem) -> Plan:
    """The plan ``backend="auto"`` follows for ``problem``: pure, cached, explained.

    The answer depends only on ``problem``, the settings in force (see
    :mod:`blockdiag.settings` for their precedence: ``config()`` > ``set_config`` /
    ``set_sparsity_threshold`` > environment > tuning profile > built-in default) and the
    measured table (the matching tuning profile, else the built-in one). Equal inputs give
    the same (cached) :class:`Plan`. A backend that declines the problem (device, dtype,
    no backward, shape rule, package missing) or that a setting excludes is never chosen.

    >>> from blockdiag.backends import Problem
    >>> plan = choose(Problem(256, 50, 10, 10, requires_grad=True))
    >>> plan.backend in names() and plan is choose(Problem(256, 50, 10, 10, requires_grad=True))
    True

    Args:
        problem: a :class:`~blockdiag.backends.Problem`.

    Returns:
        a :class:`Plan` (print it for a readable report).

    Raises:
        BlockDiagError: a malformed problem (see :class:`~blockdiag.backends.Problem`), or
            one that no backend can run (a dtype none supports, such as an integer type).
    """
    if not isinstance(problem, Problem):
        # Anything else failed deep in the ranking ("'tuple' object has no attribute 'device'").
        raise BlockDiagError(
            f"choose: problem must be a blockdiag.Problem (e.g. Problem(batch, groups, block_in, block_out)), "
            f"got {type(problem).__name__}"
        )
    return cached_plan("auto", problem)


def builtin_plan(problem: Problem) -> Plan:
    """The plan :func:`choose` would give under the built-in table, whatever profile is in force.

    ``blockdiag bench`` times every backend, so where a tuning profile is in force it can
    say, from the same run, whether the profile's choices beat the built-in table's: on a
    machine whose speed drifts between runs, two benches compared across runs cannot. The
    settings in force apply as for :func:`choose`, with the built-in table's settings in
    the profile's place.

    >>> from blockdiag.backends import Problem
    >>> builtin_plan(Problem(256, 50, 10, 10)).source
    'built-in defaults'

    Args:
        problem: a :class:`~blockdiag.backends.Problem`.

    Returns:
        a :class:`Plan` whose ``source`` is ``"built-in defaults"``.
    """
    entry = _profile.builtin_entry(problem.device, problem.dtype)
    return _rank(problem, _resolved_settings(entry, "built-in table"), _profile.BUILTIN_SOURCE, entry)


def _table_in_force(problem: Problem) -> tuple[Optional[dict], str, str]:
    """``(entry, source, label)``: the table ``auto`` ranks ``problem`` by now."""
    # The profile's path is a setting (config, set_config, $BLOCKDIAG_PROFILE; None: the
    # default location), so the epoch covers it like the others.
    path = _config.resolve("profile")[0]
    entry, source, _ = _profile.cached_entry(problem.device, problem.dtype, path)
    label = "built-in table" if source == _profile.BUILTIN_SOURCE else "tuning profile"
    return entry, source, label


def _auto_plan(problem: Problem) -> Plan:
    entry, source, label = _table_in_force(problem)
    return _rank(problem, _resolved_settings(entry, label), source, entry)


def _screen(
    problem: Problem, backends: Optional[Iterable[str]], settings: Optional[dict], fn_name: str
) -> tuple[list[str], dict[str, str]]:
    """The one filter: ``(names that may run, {name: why not})``, in the order given.

    Each backend is asked why it declines ``problem`` (:meth:`Backend.decline_reason`),
    then :func:`settings_exclusion` applies the crossovers ``settings`` (None: only the
    rule that a forward-only duplicate is ranked under its original's name).
    """
    ok: list[str] = []
    notes: dict[str, str] = {}
    # One snapshot of the registry (a C-level copy, atomic under the GIL): another thread may
    # register or unregister a backend meanwhile, and a name listed but gone by the time it is
    # looked up made `auto` fail with "unknown backend" for a backend it never named.
    pairs = tuple(registry().items()) if backends is None else [
        (name, get(name, fn_name, auto_valid=False)) for name in backends]
    for name, b in pairs:
        why = b.decline_reason(problem) or settings_exclusion(b, problem, settings)
        if why is None:
            ok.append(name)
        else:
            notes[name] = why
    return ok, notes


def _screen_settings(problem: Problem, table: Optional[dict], crossovers: bool) -> Optional[dict]:
    if not crossovers:
        return None
    label = "tuning profile"
    if table is None:
        table, _, label = _table_in_force(problem)
    return {k: v for k, v, _ in _resolved_settings(table, label)}


def candidates(
    problem: Problem,
    backends: Optional[Iterable[str]] = None,
    *,
    table: Optional[dict] = None,
    crossovers: bool = True,
) -> list[str]:
    """The backends :func:`choose` considers for ``problem``, in registration order.

    The same filter ``choose`` applies before it ranks: every backend that declines the
    problem (device, dtype, no backward, shape rule, package missing) or that the
    settings' crossovers exclude (:func:`settings_exclusion`) is left out.
    :func:`exclusions` gives the reasons for the rest.

    >>> from blockdiag.backends import Problem
    >>> p = Problem(256, 50, 10, 10, requires_grad=True)
    >>> choose(p).backend in candidates(p) and "loop" in candidates(p)
    True

    Args:
        problem: a :class:`~blockdiag.backends.Problem`.
        backends: the names to screen, in this order (default: every registered backend).
        table: a profile entry whose settings apply, as if it were the tuning profile in
            force (default: the table ``auto`` uses now, with the settings in force).
        crossovers: ``False`` leaves out the settings' crossovers, keeping only what each
            backend declares and the rule that a forward-only duplicate
            (``same_forward_as``) is not screened without autograd: the backends that
            ``tune`` and ``bench`` time, since the crossovers are derived from those times.

    Returns:
        the names that pass, a list.

    Raises:
        BlockDiagError: an unknown name in ``backends`` (listing the valid ones).
    """
    return _screen(problem, backends, _screen_settings(problem, table, crossovers), "candidates")[0]


def exclusions(
    problem: Problem,
    backends: Optional[Iterable[str]] = None,
    *,
    table: Optional[dict] = None,
    crossovers: bool = True,
) -> dict[str, str]:
    """Why each backend that :func:`candidates` leaves out is left out.

    >>> from blockdiag.backends import Problem
    >>> exclusions(Problem(8, 4, 4, 4), ["loop", "bmm_fm_loop"])
    {'bmm_fm_loop': "without autograd it is bmm_fm's forward, ranked under that name"}

    Args:
        problem: a :class:`~blockdiag.backends.Problem`.
        backends: the names to screen (default: every registered backend).
        table: as for :func:`candidates`.
        crossovers: as for :func:`candidates`.

    Returns:
        ``{name: reason}`` for each name left out, in the order screened.

    Raises:
        BlockDiagError: an unknown name in ``backends`` (listing the valid ones).
    """
    return _screen(problem, backends, _screen_settings(problem, table, crossovers), "exclusions")[1]


# The one plan cache: (backend, problem, epoch()) -> Plan. Entries of past epochs are dropped
# when the first plan of a new generation is stored (and all of them past 4096 entries).
_cache: dict = {}
_cache_generation = -1


_CODE_SUFFIXES = (".py", ".c", ".h", ".cpp")
_CODE_DIGESTS: dict = {}


def code_digest(root: Optional[str] = None) -> str:
    """A digest of the source under ``root`` (blockdiag's package: its .py, .c, .h and .cpp files).

    Read once per process and root. The version alone does not tell two checkouts of one
    version apart (an editable install, a git pull), whose traced graphs can decompose
    differently: torch's compile caches served one the other's code.

    >>> code_digest() == code_digest()
    True

    Args:
        root: a directory (default: the installed blockdiag package).

    Returns:
        a short hexadecimal string.
    """
    root = root or os.path.dirname(os.path.abspath(__file__))
    digest = _CODE_DIGESTS.get(root)
    if digest is None:
        h = hashlib.sha256()
        for here, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(_CODE_SUFFIXES):
                    path = os.path.join(here, name)
                    h.update(os.path.relpath(path, root).encode() + b"\0")
                    with open(path, "rb") as f:
                        h.update(f.read())
        digest = _CODE_DIGESTS[root] = h.hexdigest()[:16]
    return digest


def plan_state() -> str:
    """A digest of everything ``auto``'s plans depend on besides the problem.

    Graphs traced with a static batch plan while tracing (``blockdiag::auto_inline``), and
    torch keeps compiled graphs in caches of its own (AOTAutograd's and inductor's, on disk
    across processes) keyed by the graph it was given, not by what the plan read. So that
    graph carries this digest as an argument: another settings value, profile file, thread
    count, registry, or blockdiag version or source (:func:`code_digest`) gives another
    graph, never a cached one planned under the old state. The digest is stable across
    processes where all of those agree, so those caches still serve a new process.

    >>> plan_state() == plan_state()
    True

    Returns:
        a short hexadecimal string.
    """
    from . import __version__  # here: the package imports this module before it is complete

    def stat(path) -> tuple:
        try:
            st = os.stat(path)
        except OSError:
            return (str(path), None)
        return (str(path), st.st_mtime_ns, st.st_size)

    backends = []
    for name, b in tuple(registry().items()):  # a snapshot, as in _screen
        fn = b.fn
        fn = getattr(fn, "forward", fn)  # an OpEntry: its kernel names the code
        backends.append((name, getattr(fn, "__module__", None), getattr(fn, "__qualname__", type(fn).__qualname__)))
    path = _config.resolve("profile")[0] or _profile.default_profile_path()
    parts = (__version__, code_digest(), torch.get_num_threads(), repr(_config.get_settings()), stat(path),
             stat(_profile.DEFAULTS_PATH), tuple(backends))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def cached_plan(backend: str, problem: Problem, fn_name: str = "GroupedLinear") -> Plan:
    """The plan for ``backend`` (a registered name or ``"auto"``) at ``problem``, cached.

    A pure function of ``(backend, problem, epoch())``: equal arguments in the same epoch
    give the same :class:`Plan` object; see the module docstring for what moves the epoch.
    Reads no tensor; safe to call from any thread.

    >>> from blockdiag.backends import Problem
    >>> p = Problem(256, 50, 10, 10)
    >>> cached_plan("auto", p) is choose(p) and cached_plan("bmm", p).backend == "bmm"
    True

    Args:
        backend: a registered backend name, or ``"auto"`` for :func:`choose`'s plan.
        problem: a :class:`~blockdiag.backends.Problem`.
        fn_name: the caller's name in error messages.

    Raises:
        BlockDiagError: unknown name (listing the valid ones), a named backend that
            cannot run the problem (with its reason), or a problem no backend can run.
    """
    global _cache_generation
    ep = epoch()
    key = (backend, problem, ep)
    try:
        plan = _cache.get(key)
    except TypeError:  # an unhashable name is no backend's: get() says which names are
        get(backend, fn_name)
        raise
    if plan is not None:
        return plan
    if backend == "auto":
        plan = _auto_plan(problem)
    else:
        b = get(backend, fn_name)
        why = b.decline_reason(problem)
        if why is not None:
            raise BlockDiagError(f"{fn_name}: backend {backend!r} cannot run {problem.describe()}: {why}")
        plan = Plan(backend, problem, f"fixed by the user (backend={backend!r})", "none (fixed backend)")
    if epoch() == ep:  # else the state moved while planning: the plan may mix two epochs
        if ep[0] != _cache_generation or len(_cache) > 4096:
            _cache.clear()
            _cache_generation = ep[0]
        _cache[key] = plan
    return plan


def settings_exclusion(b: Backend, p: Problem, s: Optional[dict]) -> Optional[str]:
    """Why the chooser's settings (or a forward-only duplicate) exclude ``b`` from ``p``, or None.

    ``s`` maps each of :data:`SETTINGS_USED` to its value, and ``double_backward`` where it
    is set; None applies only the forward-only duplicate rule (``Backend.same_forward_as``).
    """
    if b.same_forward_as is not None and not p.requires_grad:
        return f"without autograd it is {b.same_forward_as}'s forward, ranked under that name"
    if s is None:
        return None
    low = b.reduced_precision.get(p.device)
    if low is not None and p.dtype in low[0]:
        # A change of results, not only of speed: auto's answer must be as precise as the
        # nn.Linear it replaces, whichever backend is fastest.
        return f"computes {str(p.dtype).replace('torch.', '')} with reduced precision on {p.device} ({low[1]})"
    if b.sparse and p.sparsity < s["sparsity_threshold"]:
        return f"sparsity {p.sparsity:.3f} is below sparsity_threshold={s['sparsity_threshold']}"
    # With one group the "block-diagonal" matrix is the weight itself: the dense GEMM does no
    # extra work, needs no extra memory and has no other group to leak into (ONE_GROUP_RULE).
    if b.dense_matrix and p.groups > 1:
        if p.groups > s["dense_max_groups"]:
            return f"groups={p.groups} > dense_max_groups={s['dense_max_groups']}"
        if p.dense_elements > s["dense_max_elements"]:
            return f"dense matrix has {p.dense_elements} entries > dense_max_elements={s['dense_max_elements']}"
    if not b.isolates_groups and p.groups > 1 and not any(map(_config._explicit, ("dense_max_groups", "dense_max_elements"))):
        # A NaN/Inf in one group would reach every group (0 * NaN is NaN in a dense GEMM):
        # a change of results, not only of speed, for at best a small gain where the dense
        # GEMM wins at all. So `auto` takes that only on the user's word (config, set_config,
        # the environment), never on a table's.
        return ("does not isolate groups (a NaN/Inf in one group's input reaches every group); "
                "auto uses it only where dense_max_groups or dense_max_elements is set explicitly")
    if s.get("double_backward") and p.requires_grad and not b.double_grad:
        return "its backward is first-order only (double_grad=False), and double_backward is set"
    return None


def nearest_measurements(p: Problem, entry: Optional[dict], k: Optional[int] = None) -> list[tuple[float, dict]]:
    """Up to ``k`` (default ``NEIGHBOURS``) ``(distance, measurement)`` pairs in ``p``'s mode, nearest first."""
    ms = [
        (_distance(p, m), m)
        for m in (entry or {}).get("measurements", [])
        if m["mode"] == p.mode and m["times_us"]  # a point where every backend failed ranks nothing
    ]
    ms.sort(key=lambda dm: dm[0])
    return ms[: NEIGHBOURS if k is None else k]


def _weight(distance: float) -> float:
    """A neighbour's weight in the blend (and, normalised, its share in ``Plan.neighbours``)."""
    return 1.0 / distance**2


def blended_times(p: Problem, entry: Optional[dict]) -> tuple[dict[str, float], list[tuple[float, dict]]]:
    """Each measured backend's time for ``p`` in microseconds, and the measurements used.

    At a measured shape: that measurement's times. Elsewhere: the ``NEIGHBOURS`` nearest,
    weighted by ``1 / distance**2``. A backend's time over the fastest at each neighbour
    is averaged in log space over the neighbours that measured it (so one skipped at a
    large neighbour is not penalised), then multiplied by the weighted geometric mean of
    the neighbours' fastest times, each scaled by the ratio of useful FLOPs.
    """
    near = nearest_measurements(p, entry)
    if not near:
        return {}, []
    if near[0][0] == 0.0:
        return dict(near[0][1]["times_us"]), near[:1]
    flops = max(p.flops, 1)  # an empty batch (N=0) still ranks
    log_ratio: dict[str, float] = {}
    weight: dict[str, float] = {}
    log_best = total = 0.0
    for dist, m in near:
        w = _weight(dist)
        best = min(m["times_us"].values())
        m_flops = max(Problem(m["batch"], m["groups"], m["block_in"], m["block_out"]).flops, 1)
        log_best += w * math.log(best * flops / m_flops)
        total += w
        for name, t in m["times_us"].items():
            log_ratio[name] = log_ratio.get(name, 0.0) + w * math.log(t / best)
            weight[name] = weight.get(name, 0.0) + w
    base = math.exp(log_best / total)
    return {n: base * math.exp(log_ratio[n] / weight[n]) for n in log_ratio}, near


# A table measures grouped products (groups >= 2): with one group every backend is the same
# GEMM with its own layout shuffles around it, and the table's neighbours of another group
# count rank them by shuffles that do not exist here. So unless the table itself measured
# one group, `auto` runs such a problem as the plain product.
ONE_GROUP_RULE = ("one group: the block-diagonal matrix is the weight itself, so the dense backend "
                  "is F.linear, the plain GEMM (the table measured no one-group shape)")


def _one_group_choice(p: Problem, ok: list[str], entry: Optional[dict]) -> Optional[str]:
    """The backend :data:`ONE_GROUP_RULE` picks for ``p``, or None where it does not apply."""
    if p.groups != 1 or any(m["groups"] == 1 and m["mode"] == p.mode for m in (entry or {}).get("measurements", [])):
        return None
    reg = registry()
    return next((n for n in ok if getattr(reg.get(n), "dense_matrix", False)), None)


# A table's grid has blocks of several inputs (the built-in one: 10 and more). With one input
# per group each block is an outer product, with nothing to reduce: the backends that call a
# library GEMM (batched, per group or through a convolution) run it with k = 1, where the
# GEMM's packing and blocking have no reduction to spread over, so their time over the
# fastest at the neighbours (all of larger k) does not carry over, and the blend handed such
# shapes a GEMM backend slower than the nn.Linear loop. So unless the table itself measured
# one input per group in this mode, `auto` ranks such a problem as one nothing was measured
# near: by the device's preference order (FALLBACK_ORDER).
ONE_INPUT_RULE = ("one input per group: each block is an outer product, which the table measured no "
                  "shape of (its neighbours' times are of GEMMs that reduce); first runnable backend "
                  "in the preference order")


# Where the rule applies: on CPU the preference order starts with simd, whose outer product
# has no GEMM behind it. On CUDA every backend of the order is a library GEMM too, so the
# rule would only trade one GEMM at k = 1 for another, unmeasured: the blend stands there.
ONE_INPUT_DEVICES = ("cpu",)


def _one_input_applies(p: Problem, entry: Optional[dict]) -> bool:
    """Whether :data:`ONE_INPUT_RULE` sets the table's times aside for ``p``."""
    return p.block_in == 1 and p.groups > 1 and p.device in ONE_INPUT_DEVICES and not any(
        m["block_in"] == 1 and m["mode"] == p.mode for m in (entry or {}).get("measurements", []))


# A table measured in float32 only (the built-in one) ranks a bfloat16 or float16 problem from
# float32 times. For a backend that computes the half dtype in float32 (``Backend.upcasts``:
# ``simd`` on CPU) those times hold, casts aside; for the others they do not: their half
# kernels can be many times slower than their float32 ones (on a CPU without half arithmetic,
# torch's half GEMMs convert inside their inner loops). So where the table has no entry of
# the problem's dtype, the backends that upcast it rank first. A table measured in that dtype
# (``blockdiag tune --dtype bfloat16``) ranks them all by their own times.
UPCAST_RULE = ("computed in float32: the table has no entry of this dtype, and only a backend that "
               "computes it in float32 runs at the speed of its float32 times")


def half_upcast(device: str, dtype: torch.dtype) -> bool:
    """Whether :data:`UPCAST_RULE` applies to ``dtype`` on ``device`` now: the table in force has
    no entry of that dtype, and an available backend computes it in float32 there.

    Shape-free, for callers that plan around the layers (``GroupedMLP``'s strategies run
    torch's half kernels where the layers would run in float32). Marked for dynamo as
    ``torch.compiler.assume_constant_result`` marks: a traced graph records the answer.
    """
    if not any(dtype in b.upcasts.get(device, ()) for b in registry().values()):
        return False
    entry = _table_in_force(Problem(1, 2, 1, 1, dtype, device))[0]
    if (entry or {}).get("dtype") in (None, str(dtype).replace("torch.", "")):
        return False
    return any(dtype in b.upcasts.get(device, ()) and b.unavailable_reason() is None for b in registry().values())


half_upcast._dynamo_marked_constant = True


def _upcasting(p: Problem, ok: list[str], entry: Optional[dict]) -> list[str]:
    """The runnable backends that :data:`UPCAST_RULE` ranks first for ``p`` (none where it does not apply)."""
    if (entry or {}).get("dtype") in (None, str(p.dtype).replace("torch.", "")):
        return []
    reg = registry()
    return [n for n in ok if p.dtype in getattr(reg.get(n), "upcasts", {}).get(p.device, ())]


def _rank(p: Problem, settings, source: str, entry: Optional[dict]) -> Plan:
    ok, notes = _screen(p, None, {k: v for k, v, _ in settings}, "choose")

    one_input = _one_input_applies(p, entry)
    estimates, used = ({}, []) if one_input else blended_times(p, entry)
    exact = bool(used) and used[0][0] == 0.0

    measured = sorted((n for n in ok if n in estimates), key=lambda n: estimates[n])
    order = FALLBACK_ORDER.get(p.device, ())
    unmeasured = sorted(
        (n for n in ok if n not in estimates),
        key=lambda n: order.index(n) if n in order else len(order),
    )
    ranked = measured + unmeasured
    upcast = _upcasting(p, ok, entry)
    if upcast:
        ranked = [n for n in ranked if n in upcast] + [n for n in ranked if n not in upcast]
    # The one-group rule's plain GEMM is a half GEMM too where the upcast rule applies.
    one_group = None if upcast else _one_group_choice(p, ok, entry)
    if one_group is not None:
        ranked.remove(one_group)
        ranked.insert(0, one_group)
        if estimates:
            # The neighbours' dense times are of several groups' zeros; the plain GEMM does
            # no more work than the fastest grouped backend there.
            estimates = {**estimates, one_group: min(estimates.values())}
    if not ranked:  # a dtype no backend runs (integer, complex): grouped_linear and the layers
        # refuse it first, in their own name; choose() called directly gets here
        raise BlockDiagError(
            f"choose: no backend can run {p.describe()}: " + "; ".join(f"{k}: {v}" for k, v in notes.items())
        )
    best = ranked[0]
    # The table entry may be of another dtype (the nearest one the table holds): say so,
    # never "measured at this shape" for a dtype nobody measured.
    table_dtype = (entry or {}).get("dtype")
    asked = str(p.dtype).replace("torch.", "")
    if one_group is not None:
        reason = ONE_GROUP_RULE
    elif one_input:
        reason = ONE_INPUT_RULE
    elif best in upcast:
        reason = f"{UPCAST_RULE} (the table has no {asked} entry, only {table_dtype} times; {best} casts {asked} up)"
    elif measured:
        near = used[0][1]
        at = f"batch={near['batch']} groups={near['groups']} block={near['block_in']}x{near['block_out']}"
        where = (
            "measured at this shape"
            if exact
            else f"fastest as ranked from the {len(used)} nearest measured shapes (nearest: {at})"
        )
        if table_dtype and table_dtype != asked:
            where = f"{where} in {table_dtype} (the table has no {asked} entry; ranked from those times)"
        reason = f"{where}, {p.mode}"
        if len(measured) > 1:
            reason += f": {estimates[measured[1]] / estimates[best]:.2f}x ahead of {measured[1]}"
        else:
            reason += ": the only runnable backend measured there"
    elif entry is None:
        reason = f"no measured table for {p.device}; first runnable backend in the {p.device} preference order"
    else:
        reason = "no runnable backend was measured near this shape; first in the preference order"

    how = "measured" if exact else f"estimated ({len(used)} nearest measured shapes, scaled by FLOPs)"
    if measured and table_dtype and table_dtype != asked:
        how += f" in {table_dtype}"
    cands = []
    for n in ranked:
        # An entry may say why a backend has no times (profile.fit_variant: another simd variant).
        unmeasured_note = (entry or {}).get("not_measured", {}).get(n, "not measured")
        if one_input:
            unmeasured_note = "placed by the preference order (one input per group)"
        note = ("chosen; " if n == best else "") + (how if n in estimates else unmeasured_note)
        if n == best and one_group is not None:
            note = "chosen by the one-group rule; the fastest time blended here" if n in estimates else "chosen by the one-group rule"
        cands.append(Candidate(n, True, estimates.get(n), note, exact and n in estimates))
    for n in names():
        if n in notes:
            cands.append(Candidate(n, False, estimates.get(n), notes[n], exact and n in estimates))
    neighbours = ()
    if used and not exact:
        total = sum(_weight(d) for d, _ in used)
        neighbours = tuple(
            (
                m["batch"], m["groups"], m["block_in"], m["block_out"], round(_weight(d) / total, 4),
                min((n for n in ok if n in m["times_us"]), key=m["times_us"].get, default="-"),
            )
            for d, m in used
        )
    measured_on = f"{entry.get('device_name', '?')}, torch {entry.get('torch', '?')}" if entry else ""
    return Plan(best, p, reason, source, tuple(cands), settings, neighbours, measured_on)


def plan_for(backend: str, problem: Problem, fn_name: str = "GroupedLinear") -> Plan:
    """The plan for a fixed backend name, or ``auto``; raises if the backend declines.

    The same as :func:`cached_plan` (the name callers have used).

    Raises:
        BlockDiagError: unknown name (listing the valid ones), or the backend cannot run
            the problem (with its reason).
    """
    return cached_plan(backend, problem, fn_name)
