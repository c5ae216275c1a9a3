"""Measuring backends: the engine behind ``blockdiag tune``, ``bench`` and ``--plot``.

Every figure here is a median (or, with ``stat="min"``, the minimum) over interleaved
rounds: within a round each backend runs once (in rotating order), so slow drifts of a
shared machine hit all of them alike. A sample runs the product enough times to last
about ``min_time`` seconds (calibrated like ``timeit.autorange``, after an untimed call
that wakes the thread pool), so neither the timer's resolution nor a parked worker
thread decides the figure for small shapes. A backend more than ``prune`` times slower
than the best after two rounds (comparing each one's faster sample, so that one stall
does not count) is not run again at that point (its samples are kept): the slow layouts
would otherwise dominate the run time.

>>> from blockdiag.tuning import Grid, tune
>>> entry = tune(Grid((8,), (2,), ((4, 4),)), modes=("forward",), rounds=1, min_time=0.0)
>>> "loop" in entry["measurements"][0]["times_us"]
True
"""

from __future__ import annotations

import copy
import datetime as _dt
import math
import os
import statistics
import time
from dataclasses import dataclass
from itertools import product
from typing import Callable, Iterable, Optional, Sequence, TextIO

import torch
from torch import nn

from . import profile as _profile
from ._errors import BlockDiagError
from .backends import Problem, get, names

__all__ = [
    "Grid",
    "GRIDS",
    "BENCH_GRID",
    "measure",
    "tune",
    "derive_settings",
    "bench",
    "summarize",
    "bench_compiled",
    "summarize_compiled",
    "plot_decision_map",
    "peak_memory",
]


@dataclass(frozen=True)
class Grid:
    """Shapes to measure: every ``batch x groups x (block_in, block_out)`` combination."""

    batch: tuple[int, ...]
    groups: tuple[int, ...]
    blocks: tuple[tuple[int, int], ...]

    def problems(self, mode: str, dtype: torch.dtype, device: str) -> list[Problem]:
        return [
            Problem(b, g, i, o, dtype, device, mode == "train")
            for (i, o), g, b in product(self.blocks, self.groups, self.batch)
        ]

    def __len__(self) -> int:
        return len(self.batch) * len(self.groups) * len(self.blocks)


# The grid of the project's performance targets (``bench``'s default).
BENCH_GRID = Grid((32, 256, 2048), (4, 16, 50, 256), ((10, 10), (150, 10), (64, 64), (256, 256)))
GRIDS = {
    "quick": Grid((32, 2048), (4, 50, 256), ((10, 10), (150, 10), (64, 64))),
    # The target grid plus two blocks wider out than in (10x150 and an expert's up-projection,
    # 64x256). Without them the chooser ranks such shapes by the nearest square or narrow
    # block: at 20x100 blocks, B=128, training, it chose bmm where bmm_fm was 1.15-1.2x faster.
    # And 32x32, where mkl_batch's crossover sits between the 10x10 and 64x64 blocks: without
    # it, training at B=1024 G=8 and B=128 G=100 32x32 ran bmm_fm_bmm, mkl_batch 1.15-1.17x faster.
    "full": Grid(BENCH_GRID.batch, BENCH_GRID.groups, BENCH_GRID.blocks + ((10, 150), (64, 256), (32, 32))),
    "targets": BENCH_GRID,
}

# Backends whose cost grows with groups**2 are skipped while measuring above this many
# matrix entries: the product would take minutes, and the chooser excludes them there anyway.
MAX_DENSE_ELEMENTS = 1 << 24


def _sync(device: str) -> None:
    mod = getattr(torch, device, None)
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize()


class _Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, total: int, label: str, stream: Optional[TextIO]):
        self.total, self.label, self.stream, self.done = total, label, stream, 0
        self.t0 = time.perf_counter()
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())

    def step(self, what: str) -> None:
        self.done += 1
        if self.stream is None:
            return
        width = 24
        fill = int(width * self.done / max(self.total, 1))
        line = (
            f"{self.label} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
            f"{time.perf_counter() - self.t0:6.1f}s {what}"
        )
        if self.tty:
            self.stream.write("\r" + line[:150].ljust(150))
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _inputs(p: Problem, seed: int = 0):
    gen = torch.Generator(device=p.device).manual_seed(seed)
    kw = {"dtype": p.dtype, "device": p.device, "generator": gen}
    x = torch.randn(p.batch, p.groups * p.block_in, **kw)
    w = torch.randn(p.groups, p.block_out, p.block_in, **kw) / math.sqrt(max(p.block_in, 1))
    b = torch.randn(p.groups * p.block_out, **kw)
    gy = torch.randn(p.batch, p.groups * p.block_out, **kw) if p.requires_grad else None
    for t in (x, w, b):
        t.requires_grad_(p.requires_grad)
    return x, w, b, gy


def _step(fn: Callable, args: Sequence[torch.Tensor], gy: Optional[torch.Tensor], params: Sequence[torch.Tensor]):
    """A no-argument callable running ``fn(*args)`` (and its backward when ``gy`` is given)."""
    if gy is None:

        def run():
            with torch.no_grad():
                fn(*args)

    else:

        def run():
            fn(*args).backward(gy)
            for t in params:
                t.grad = None

    return run


def _backend_step(name: str, x, w, b, gy) -> Callable[[], None]:
    return _step(get(name).fn, (x, w, b), gy, (x, w, b))


def _api_step(name: str, x, w, b, gy) -> Callable[[], None]:
    """``name`` (a backend or ``"auto"``) called as users call it: ``grouped_linear(..., backend=name)``."""
    from .nn.linear import grouped_linear

    return _step(lambda x, w, b: grouped_linear(x, w, b, backend=name), (x, w, b), gy, (x, w, b))


def _ideal_step(p: Problem, gy_needed: bool) -> Callable[[], None]:
    # One dense GEMM with the same useful FLOPs and the same output: the shared-input wide
    # layer [B, in] @ [in, G*out] (+ bias), forward and, in training, its backward.
    gen = torch.Generator(device=p.device).manual_seed(1)
    kw = {"dtype": p.dtype, "device": p.device, "generator": gen}
    x = torch.randn(p.batch, p.block_in, **kw).requires_grad_(gy_needed)
    w = torch.randn(p.groups * p.block_out, p.block_in, **kw).requires_grad_(gy_needed)
    b = torch.randn(p.groups * p.block_out, **kw).requires_grad_(gy_needed)
    gy = torch.randn(p.batch, p.groups * p.block_out, **kw) if gy_needed else None
    return _step(torch.nn.functional.linear, (x, w, b), gy, (x, w, b))


def _linear_loop_step(p: Problem, x, gy) -> Callable[[], None]:
    # The code users write first: a ModuleList of nn.Linear over input slices, then cat.
    mods = nn.ModuleList(
        nn.Linear(p.block_in, p.block_out, device=p.device, dtype=p.dtype) for _ in range(p.groups)
    )
    mods.requires_grad_(p.requires_grad)
    i = p.block_in

    def fwd(x):
        xs = x.split(i, dim=-1)
        return torch.cat([m(xs[k]) for k, m in enumerate(mods)], dim=-1)

    return _step(fwd, (x,), gy, (x, *mods.parameters()))


def _vmap_step(p: Problem, x, gy) -> Callable[[], None]:
    # PyTorch's model-ensembling recipe: stack_module_state + functional_call + vmap.
    import copy

    from torch.func import functional_call, stack_module_state, vmap

    models = [nn.Linear(p.block_in, p.block_out, device=p.device, dtype=p.dtype) for _ in range(p.groups)]
    params, buffers = stack_module_state(models)
    for t in params.values():
        t.requires_grad_(p.requires_grad)
    base = copy.deepcopy(models[0]).to("meta")
    n, g, i, o = p.batch, p.groups, p.block_in, p.block_out

    def one(prm, buf, xx):
        return functional_call(base, (prm, buf), (xx,))

    ens = vmap(one)

    def fwd(x):
        y = ens(params, buffers, x.view(n, g, i).transpose(0, 1))
        return y.transpose(0, 1).reshape(n, g * o)

    return _step(fwd, (x,), gy, (x, *params.values()))


def measure(
    steps: dict[str, Callable[[], None]],
    device: str,
    rounds: int = 5,
    min_time: float = 1e-2,
    prune: float = 3.0,
    keep: Iterable[str] = (),
    stat: str = "median",
    refine: float = 0.0,
    refine_also: Iterable[str] = (),
) -> tuple[dict[str, float], dict[str, str]]:
    """Seconds per call of each step (median or min over interleaved rounds); ``(times, failures)``.

    Args:
        steps: name -> no-argument callable.
        device: device type to synchronize.
        rounds: samples per step (median taken).
        min_time: seconds each sample should last (the call is repeated to reach it).
        prune: after two rounds, steps whose faster sample is slower than ``prune`` x the
            best one's are not rerun (0 disables this).
        keep: steps never pruned (and not counted as the best).
        stat: ``"median"`` of the samples, or ``"min"`` (on a machine shared with other
            jobs the noise only ever adds time, and the minimum is the robust estimate).
        refine: after the rounds, the steps (other than ``keep``) whose statistic is within
            this fraction of the fastest one's, the fastest included, are timed ``rounds``
            more interleaved rounds and judged on all their samples (0 disables this). A
            near-tie is where one stalled sample decides the ranking, and only the tied
            steps pay for the extra samples.
        refine_also: steps (``keep`` ones included) that join those extra rounds whenever
            ``refine`` is on, however far from the fastest they are: ``bench`` adds ``auto``
            and what it is compared with, whose ratios are the run's result.

    Returns:
        ``({name: seconds}, {name: error message})``; a step that raised is reported in the
        second dict and not timed.
    """
    if stat not in STATS:
        raise BlockDiagError(f"measure: stat must be one of {', '.join(STATS)}, got {stat!r}")
    keep = set(keep)
    reps: dict[str, int] = {}
    failures: dict[str, str] = {}
    samples: dict[str, list[float]] = {}
    for name, run in steps.items():
        try:
            run()  # warm-up: allocator, lazy init, oneDNN primitive caches
            # Calibrate like timeit.autorange: one call can be a stall (a parked worker
            # thread waking up), so time growing batches until one lasts min_time.
            n, dt, retimed = 1, 0.0, False
            while True:
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(n):
                    run()
                _sync(device)
                total = time.perf_counter() - t0
                if n == 1 and retimed:
                    total = min(total, dt)
                dt = total / n
                if n == 1 and total >= min_time and not retimed:
                    # One call over min_time may have been a stall; its time would also be
                    # the first sample, so time it once more and keep the smaller.
                    retimed = True
                    continue
                if total >= min_time or n >= 1000:
                    break
                n = min(1000, n * 4)
        except Exception as e:  # noqa: BLE001
            # Any exception: a kernel library's own error types (Triton's OutOfResources
            # derives from Exception alone) must cost one backend at one point, reported
            # as a failure, not a whole tune.
            failures[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            continue
        reps[name] = n
        samples[name] = [dt] if n == 1 else []
    order = list(samples)
    for r in range(rounds):
        if r == 2 and prune:
            # After two samples each, judged on the faster one: a single stalled sample must
            # not drop the fastest backend from the run.
            fastest = {n: min(v) for n, v in samples.items() if v and n not in keep}
            if fastest:
                best = min(fastest.values())
                order = [n for n in order if n not in fastest or fastest[n] <= prune * best]
        k = r % max(len(order), 1)
        for name in order[k:] + order[:k]:
            if r == 0 and reps[name] == 1 and samples[name]:
                continue  # the timed warm-up run is this round's sample
            samples[name].append(_sample(steps[name], reps[name], device))
    agg = STATS[stat]
    contenders = {n: agg(samples[n]) for n in order if n not in keep}
    best = min(contenders.values(), default=0.0)
    tied = [n for n, t in contenders.items() if t <= (1 + refine) * best] if refine > 0 else []
    if refine > 0:
        tied += [n for n in refine_also if n in samples and n not in tied]
    for r in range(rounds if len(tied) > 1 else 0):
        k = r % len(tied)
        for name in tied[k:] + tied[:k]:
            samples[name].append(_sample(steps[name], reps[name], device))
    return {n: agg(v) for n, v in samples.items()}, failures


def _sample(run: Callable[[], None], n: int, device: str) -> float:
    """Seconds per call of ``n`` back-to-back calls of ``run``."""
    if n > 1:
        run()  # untimed: wakes the thread pool, so the sample measures the op, not the wake-up
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    _sync(device)
    return (time.perf_counter() - t0) / n


STATS = {"median": statistics.median, "min": min}

# Backends within this fraction of the fastest one at a tuned point are near-tied and get
# extra rounds (``tune``'s default ``refine``). On the project's shared 2-core VM the same
# kernel's median moved by 10-70% between runs (bmm_fm, forward B=2048 G=50 64x64: 5.3 ms
# in one tune, 4.2-4.3 ms in two later runs, where bmm took 4.8-7.1 ms), so a lead of a few
# percent after five rounds is not yet a ranking.
TIE_MARGIN = 0.05

# ``bench``'s ``refine``: wider than tune's, since a bench point's verdicts (auto within 1.10
# of the fastest, faster than the nn.Linear loop) are 10% margins. Run P on the project's VM
# (docs/tuning.md) had auto 10-20% behind forced runs of the very same kernel at 6 of 94
# points after five rounds, from bursts of noise that the extra rounds dilute.
BENCH_REFINE = 0.10

# The environment variables that change how the C allocator serves tensor memory. With
# glibc's defaults, a CPU tensor over 32 MB is a fresh mmap every time it is allocated, and
# first touching its pages can cost more than the product that fills it (docs/tuning.md,
# "The memory allocator"), so measurements record these next to the times they explain.
ALLOCATOR_ENV = (
    "THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_CONF", "MALLOC_MMAP_MAX_",
    "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
)


def allocator_env() -> dict[str, str]:
    """The allocator variables of :data:`ALLOCATOR_ENV` set in this process (empty: the defaults).

    >>> isinstance(allocator_env(), dict)
    True
    """
    return {k: os.environ[k] for k in ALLOCATOR_ENV if k in os.environ}


def _runnable(p: Problem, backends: Optional[Iterable[str]]) -> tuple[list[str], dict[str, str]]:
    ok, skipped = [], {}
    for name in backends if backends is not None else names():
        b = get(name, "tune", auto_valid=False)
        why = b.decline_reason(p)
        if why is None and b.dense_matrix and p.dense_elements > MAX_DENSE_ELEMENTS:
            why = f"skipped: its dense matrix would have {p.dense_elements} entries"
        if why is None and b.same_forward_as is not None and not p.requires_grad:
            why = f"skipped: without autograd it is {b.same_forward_as}'s forward"
        if why is None:
            ok.append(name)
        else:
            skipped[name] = why
    return ok, skipped


def _resolve_modes(modes: Sequence[str]) -> tuple[str, ...]:
    out = tuple(modes)
    bad = [m for m in out if m not in ("forward", "train")]
    if bad or not out:
        raise BlockDiagError(f"tune: modes must be a non-empty subset of ('forward', 'train'), got {modes!r}")
    return out


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
        device, dtype: what to measure on.
        modes: ``"forward"`` and/or ``"train"`` (forward + backward).
        backends: names to measure (default: all registered).
        rounds, min_time, stat, refine: see :func:`measure`. By default backends within
            :data:`TIE_MARGIN` of the fastest at a point get extra rounds: the table's
            winner is what ``auto`` runs, and near-ties are where noise picks it.
        max_gflop: points whose forward product exceeds this many GFLOP are not measured
            (the chooser ranks them from the nearest measured points).
        rematch: where the fastest backend at a point is not the one ``prior`` would
            choose there, time the two again head to head (see :func:`rematch`) and keep
            what that says. One tune on a shared machine can record a stalled sample as a
            40% lead (docs/tuning.md, run L); a second opinion that disagrees is where
            that costs the most, and only those points pay for the extra rounds.
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
        steps = {n: _backend_step(n, x, w, b, gy) for n in ok}
        times, failed = measure(steps, device, rounds, min_time, stat=stat, refine=refine)
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
        _rematch_all(measurements, prior, device, dtype, rounds, min_time, stat, progress)
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
    from .dispatch import blended_times

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


def rematch(m: dict, p: Problem, pair: Sequence[str], *, rounds: int, min_time: float = 1e-2,
            stat: str = "median") -> str:
    """Time the backends of ``pair`` head to head at ``p``; update ``m`` and return the faster.

    Both backends get fresh inputs and ``rounds`` interleaved rounds. The rematch decides
    the pair's ratio, not its level: their times in ``m["times_us"]`` become the rematch's,
    scaled so that the pair's geometric mean stays the first pass's. The other backends'
    times are from the first pass, and a machine that ran slower (or faster) during the
    rematch must not move the pair past them: run R on the project's VM (docs/tuning.md)
    rematched `loop` against `simd` on a machine at least 3% slower than during the first
    pass, and unscaled that handed the point to a third backend neither had been timed
    against.
    ``m["rematch"]`` records the first pass's times, the rematch's own and the outcome. A
    backend that raises in the rematch keeps its first time (and then nothing is scaled).

    Args:
        m: a measurement row of :func:`tune` (changed in place).
        p: its problem.
        pair: the first pass's winner and the challenger.
        rounds, min_time, stat: see :func:`measure`.

    Returns:
        the name that is now the faster of the two in ``m``.
    """
    x, w, b, gy = _inputs(p)
    steps = {n: _backend_step(n, x, w, b, gy) for n in pair}
    times, _ = measure(steps, p.device, rounds, min_time, prune=0.0, stat=stat)
    before = {n: m["times_us"][n] for n in pair}
    scale = 1.0
    if len(times) == len(pair) and all(t > 0 for t in times.values()):
        scale = math.prod(before[n] / (times[n] * 1e6) for n in pair) ** (1.0 / len(pair))
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


class _LiveBytes:
    """Bytes held by tensors created under a dispatch mode: current and peak."""

    def __init__(self):
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self.live: dict[int, tuple[object, int]] = {}
        self.current = self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        if t.layout != torch.strided:
            for part in _sparse_parts(t):
                self.add(part)
            return
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.live or st.nbytes() == 0:
            return
        self.live[key] = (self._ref(st), st.nbytes())
        self.current += st.nbytes()
        self._collect()
        self.peak = max(self.peak, self.current)

    def _collect(self) -> None:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.current -= self.live.pop(k)[1]


def _sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []


def peak_memory(step: Callable[[], None]) -> int:
    """Peak bytes of tensors allocated while ``step()`` runs (inputs and parameters excluded).

    Counts every tensor an operator returns, on any device, until it is freed; library
    scratch space (MKL, oneDNN workspaces) is not seen.

    >>> x = torch.ones(256)
    >>> peak_memory(lambda: x * 2), peak_memory(lambda: x.view(16, 16).t())
    (1024, 0)
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    live = _LiveBytes()

    def ptrs(tree) -> set:
        out = set()
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                out.add(t.untyped_storage().data_ptr())
        return out

    class _Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # Views and in-place results share an argument's storage: nothing was allocated.
            shared = ptrs((args, kwargs))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and (
                    t.layout != torch.strided or t.untyped_storage().data_ptr() not in shared
                ):
                    live.add(t)
            return out

    with _Track():
        step()
    return live.peak


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
) -> list[dict]:
    """Time every backend, ``auto``, the ideal GEMM and the baselines at each grid point.

    Args:
        grid, device, dtype, modes, backends, rounds, min_time, stat, progress: as for :func:`tune`.
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
        ``fastest``, ``auto_over_fastest``, ``auto_kernel_us`` (the chosen backend's bare
        kernel, no dispatch) and ``auto_over_kernel``, ``ideal_us``,
        ``fraction_of_ideal`` (ideal time over auto's), ``baselines_us``,
        ``peak_bytes``, ``skipped`` (name -> reason), ``table`` (the source of auto's plan)
        and, where that is a tuning profile, ``builtin_choice`` (what the built-in table
        would have chosen: :func:`~blockdiag.dispatch.builtin_plan`).
    """
    from .dispatch import builtin_plan, choose

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
        times, failed = measure(steps, device, rounds, min_time, keep=extra, stat=stat, refine=refine,
                                refine_also=also)
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
            skipped={**skipped, **failed},
            table=plan.source,
        )
        if builtin:
            row["builtin_choice"] = builtin
        if memory:
            row["peak_bytes"] = {n: peak_memory(steps[n]) for n in ok if n not in failed}
        rows.append(row)
        bar.step(f"{p.mode} B={p.batch} G={p.groups} {p.block_in}x{p.block_out}: auto/fastest {row['auto_over_fastest']}")
    return rows


def _geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


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
        ratios = [r["auto_over_fastest"] for r in rs]
        worst = max(rs, key=lambda r: r["auto_over_fastest"])
        s = {
            "points": len(rs),
            "geomean_auto_over_fastest": round(_geomean(ratios), 4),
            "max_auto_over_fastest": round(max(ratios), 4),
            "worst_point": f"B={worst['batch']} G={worst['groups']} {worst['block_in']}x{worst['block_out']}",
            "within_1.10": sum(x <= 1.10 for x in ratios),
            "median_fraction_of_ideal": round(statistics.median(r["fraction_of_ideal"] for r in rs), 4),
        }
        # The choice alone: the chosen backend forced by name over the fastest. It leaves out
        # the noise between auto's own samples and the forced ones of the same kernel.
        chosen = [r["times_us"][r["auto"]] / r["times_us"][r["fastest"]] for r in rs if r["auto"] in r["times_us"]]
        if chosen:
            s["geomean_choice_over_fastest"] = round(_geomean(chosen), 4)
            s["choice_within_1.10"] = sum(x <= 1.10 for x in chosen)
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
            s["geomean_choice_over_builtin_choice"] = round(_geomean([c / b for b, c, _ in vs]), 4)
            s["choices_differing_from_builtin"] = sum(r["builtin_choice"] != r["auto"] for r in rs if "builtin_choice" in r)
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
# ``torch.compile(GroupedMLP)`` against ``torch.compile`` of the peers a user would compile
# instead: the loop of ``nn.Linear`` heads and ``torch.func`` vmap ensembling, all holding the
# same weights, timed in the same interleaved rounds as the eager blockdiag module.

# ``linear``: one GroupedLinear (G blocks in x out, each group reads its slice of the input,
# the input requires grad as inside a network), against G ``nn.Linear`` over the slices.
# ``mlp``: a GroupedMLP of G heads ``in -> out -> ReLU -> out`` reading one shared input that
# needs no gradient (the forum's model on its data), against the G ``nn.Sequential`` heads.
COMPILED_MODELS = ("linear", "mlp")

# The compiled peers; the best of them at a point is what compiled blockdiag must beat.
COMPILED_PEERS = ("loop_compiled", "vmap_compiled")

# Issue 21's targets for the compiled training step (reported by :func:`summarize_compiled`,
# not enforced): compiled blockdiag no slower than eager blockdiag on geometric mean, at
# least 1.25x faster than the best compiled peer on geometric mean, slower than it nowhere.
COMPILED_TARGETS = {
    "geomean_compiled_over_eager": 1.02,
    "geomean_speedup_over_best_peer": 1.25,
    "max_compiled_over_best_peer": 1.0,
}

# How far a compiled module's output and gradients may be from the same module's eager ones,
# relative to the largest entry: the same products, summed in another order (or in TF32 on
# CUDA, where torch's settings allow it). A compiled kernel fed the wrong pointers is off by
# orders of magnitude (issue 21: mkl_batch's garbage under compile).
_COMPILED_RTOL = {torch.float64: 1e-9, torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


class _HeadsLoop(nn.Module):
    """The loop of heads: head ``k`` reads slice ``k`` of ``x`` (``split`` columns each) or all of it; then ``cat``."""

    def __init__(self, heads: nn.ModuleList, split: Optional[int]):
        super().__init__()
        self.heads, self.split = heads, split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.split(self.split, dim=-1) if self.split else [x] * len(self.heads)
        return torch.cat([h(xs[k]) for k, h in enumerate(self.heads)], dim=-1)


class _VmapEnsemble(nn.Module):
    """PyTorch's model-ensembling recipe as a module: ``stack_module_state`` of the heads
    (held as parameters) and one ``functional_call`` of a meta copy vmapped over them."""

    def __init__(self, heads: nn.ModuleList, split: Optional[int]):
        super().__init__()
        from torch.func import stack_module_state

        params, _ = stack_module_state(list(heads))
        self.keys = list(params)
        self.stacked = nn.ParameterList(nn.Parameter(params[k].detach().clone()) for k in self.keys)
        self.groups, self.split = len(heads), split
        self._base = (copy.deepcopy(heads[0]).to("meta"),)  # a tuple: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.func import functional_call, vmap

        base = self._base[0]

        def one(prm, xx):
            return functional_call(base, prm, (xx,))

        prm = dict(zip(self.keys, self.stacked))
        n = x.shape[0]
        if self.split:
            y = vmap(one)(prm, x.view(n, self.groups, self.split).transpose(0, 1))
        else:
            y = vmap(one, in_dims=(0, None))(prm, x)
        return y.transpose(0, 1).reshape(n, -1)


def _model_flops(model: str, p: Problem) -> float:
    """Forward FLOPs of ``model`` at ``p`` (the MLP has a second, ``out x out`` layer)."""
    return p.flops + (2.0 * p.batch * p.groups * p.block_out * p.block_out if model == "mlp" else 0.0)


def _compiled_modules(model: str, p: Problem, forced: Sequence[str], baselines: bool, seed: int = 0):
    """The modules of one point, all computing the same function with the same weights.

    Returns ``({name: module}, x, gy)``: ``"auto"`` and each name of ``forced`` (the
    blockdiag module with that backend), then ``"loop"`` and ``"vmap"`` (with ``baselines``).
    """
    from .nn import GroupedLinear, GroupedMLP

    g, i, o, n = p.groups, p.block_in, p.block_out, p.batch
    train = p.requires_grad
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if model == "linear":
            bd = GroupedLinear(g * i, g * o, g, dtype=p.dtype)
            heads, split, x = bd.to_linears(), i, torch.randn(n, g * i, dtype=p.dtype)
        else:
            bd = GroupedMLP(i, [o], o, heads=g, dtype=p.dtype)
            heads, split, x = bd.to_heads(), None, torch.randn(n, i, dtype=p.dtype)
        gy = torch.randn(n, g * o, dtype=p.dtype) if train else None
    mods: dict[str, nn.Module] = {"auto": bd}
    for name in forced:
        m = copy.deepcopy(bd)
        m.backend = name
        mods[name] = m
    if baselines:
        mods["loop"] = _HeadsLoop(heads, split)
        mods["vmap"] = _VmapEnsemble(heads, split)
    for m in mods.values():
        m.to(p.device).requires_grad_(train)
    x = x.to(p.device).requires_grad_(train and model == "linear")
    return mods, x, (gy.to(p.device) if gy is not None else None)


def _module_step(call: Callable, module: nn.Module, x: torch.Tensor, gy: Optional[torch.Tensor]) -> Callable[[], None]:
    """One step of ``call`` (``module`` or its compiled form): forward, and backward with ``gy``."""
    return _step(call, (x,), gy, (x, *module.parameters()))


def _results(call: Callable, module: nn.Module, x: torch.Tensor, gy: Optional[torch.Tensor]) -> dict[str, Optional[torch.Tensor]]:
    """One step's output and every gradient it leaves (copies), by name; the gradients are cleared."""
    if gy is None:
        with torch.no_grad():
            return {"output": call(x).detach().clone()}
    y = call(x)
    y.backward(gy)
    named = ([("x", x)] if x.requires_grad else []) + list(module.named_parameters())
    out = {"output": y.detach().clone()}
    for name, t in named:
        out[f"{name}.grad"] = None if t.grad is None else t.grad.detach().clone()
        t.grad = None
    return out


def _mismatch(got: dict, want: dict) -> Optional[str]:
    """Where a compiled module's results differ from the eager module's (None: they agree)."""
    for k, w in want.items():
        v = got.get(k)
        if (v is None) != (w is None):
            return f"{k} is {'missing' if v is None else 'present'} compiled but {'present' if w is not None else 'missing'} eager"
        if w is None:
            continue
        if v.shape != w.shape:
            return f"{k} has shape {tuple(v.shape)} compiled, {tuple(w.shape)} eager"
        scale = max(float(w.abs().max()), 1e-30) if w.numel() else 1.0
        err = float((v.double() - w.double()).abs().max()) / scale if w.numel() else 0.0
        if not err <= _COMPILED_RTOL.get(w.dtype, 5e-2):  # NaN fails too
            return f"{k} off by {err:.3g} of its largest entry"
    return None


def _error_line(e: BaseException) -> str:
    """The error's first line (with the next one where the first only introduces it, as
    inductor's ``backend='inductor' raised:`` does)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text += " " + lines[1]
    return f"{type(e).__name__}: {text[:200]}"


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, from dynamo's counters."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover
        return 0, 0
    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def _recompile_limit(n: int):
    """A context raising dynamo's per-code-object recompile limit to at least ``n``: every
    module of a point is a compiled instance of a few classes (GroupedLinear.forward once
    per forced backend), and none may fall back to eager for hitting it."""
    import torch._dynamo.config as cfg

    key = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return cfg.patch(**{key: max(int(getattr(cfg, key)), n)})


class _WrongResult(Exception):
    pass


def bench_compiled(
    grid: Grid = BENCH_GRID,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    modes: Sequence[str] = ("train",),
    models: Sequence[str] = COMPILED_MODELS,
    backends: Optional[Iterable[str]] = None,
    rounds: int = 5,
    min_time: float = 1e-2,
    baselines: bool = True,
    max_gflop: float = float("inf"),
    stat: str = "median",
    refine: float = BENCH_REFINE,
    dynamic: Optional[bool] = False,
    compiler: str = "inductor",
    progress: Optional[TextIO] = None,
) -> list[dict]:
    """Time ``torch.compile`` of GroupedLinear and GroupedMLP against compiled peers, per point.

    At each point and model (:data:`COMPILED_MODELS`), dynamo is reset (so no recompile
    limit is ever reached across points), then each module is built with the same weights
    (blockdiag with ``auto`` and with each of ``backends`` forced, the loop of heads, vmap
    ensembling), run once eager as the reference, compiled (``torch.compile(module,
    dynamic=dynamic)``) and run twice: the first call compiles the forward and backward
    graphs, and its results must match the eager ones (:data:`_COMPILED_RTOL`). Compile
    time is recorded, not timed. Then the eager blockdiag modules and every compiled one
    are timed in the same interleaved rounds (:func:`measure`, no pruning; with ``refine``
    every step gets ``rounds`` more rounds: each one's time is in a reported ratio).

    A module that fails to build, run, compile or match is recorded in its row's
    ``failed`` (the error's first line) and left out of the timing; the run goes on.

    Args:
        grid, device, dtype, rounds, min_time, stat, progress: as for :func:`bench`.
        modes: ``"train"`` (forward and backward, the default) and/or ``"forward"`` (under
            ``no_grad``).
        models: a subset of :data:`COMPILED_MODELS`.
        backends: blockdiag backends forced, each timed eager and compiled, besides ``auto``.
        baselines: compile and time the peers (without them, no ``compiled_over_best_peer``).
        max_gflop: points (and models) whose forward exceeds this many GFLOP are skipped.
        refine: 0 disables the extra rounds.
        dynamic: ``torch.compile``'s ``dynamic``. False (the default) specialises every
            graph to the point's batch size, as a first compile does for a model trained
            at one batch size, and for every method alike.
        compiler: ``torch.compile``'s ``backend``: ``"inductor"`` (the default, what users
            get) or e.g. ``"aot_eager"`` (dynamo and AOTAutograd without code generation:
            the same tracing and failures in a fraction of the compile time).

    Returns:
        one dict per point, model and mode: ``times_us`` (``auto``, each forced backend,
        ``<name>_compiled`` for each of those and for the peers ``loop`` and ``vmap``),
        ``compile_s``, ``graphs`` and ``graph_breaks`` (per compiled step, from its first
        two calls), ``failed`` (step -> error), ``auto`` (GroupedLinear's choice, eager),
        ``best_peer``, ``compiled_over_eager`` and ``compiled_over_best_peer`` (per
        blockdiag backend name: its compiled time over its eager time, and over the
        fastest compiled peer's), and ``graphs_while_timing`` where graphs were compiled
        during the timing (a recompile the warm-up did not catch); or ``skipped_point``.

    Raises:
        BlockDiagError: an unknown mode, model or backend name.
    """
    modes = _resolve_modes(modes)
    models = tuple(models)
    bad = [m for m in models if m not in COMPILED_MODELS]
    if bad or not models:
        raise BlockDiagError(f"bench: compiled models must be a non-empty subset of {COMPILED_MODELS}, got {models!r}")
    forced = [get(n, "bench", auto_valid=False).name for n in (backends or ())]
    forced = [n for k, n in enumerate(forced) if n not in forced[:k]]
    bd_names = ["auto", *forced]
    work = [(p, model) for m in modes for p in grid.problems(m, dtype, device) for model in models]
    bar = _Progress(len(work), "bench --compiled", progress)
    rows = []
    for p, model in work:
        row = {"mode": p.mode, "model": model, "batch": p.batch, "groups": p.groups,
               "block_in": p.block_in, "block_out": p.block_out}
        what = f"{p.mode} {model} B={p.batch} G={p.groups} {p.block_in}x{p.block_out}"
        gflop = _model_flops(model, p) / 1e9
        if gflop > max_gflop:
            row["skipped_point"] = f"{gflop:.1f} GFLOP > --max-gflop {max_gflop:g}"
            rows.append(row)
            bar.step(f"{what}: skipped (too large)")
            continue
        torch._dynamo.reset()
        try:
            row.update(_bench_compiled_point(p, model, forced, bd_names, baselines, rounds, min_time,
                                             stat, refine, dynamic, compiler))
        finally:
            torch._dynamo.reset()
        rows.append(row)
        ce = row["compiled_over_eager"].get("auto")
        cp = row["compiled_over_best_peer"].get("auto")
        bar.step(f"{what}: compiled/eager {ce if ce is not None else '-'}, compiled/peer {cp if cp is not None else '-'}"
                 + (f", {len(row['failed'])} failed" if row["failed"] else ""))
    return rows


def _bench_compiled_point(p, model, forced, bd_names, baselines, rounds, min_time, stat, refine, dynamic,
                          compiler) -> dict:
    failed: dict[str, str] = {}
    steps: dict[str, Callable[[], None]] = {}
    compile_s: dict[str, float] = {}
    graphs: dict[str, int] = {}
    breaks: dict[str, int] = {}
    out: dict = {}
    try:
        mods, x, gy = _compiled_modules(model, p, forced, baselines)
    except Exception as e:  # noqa: BLE001
        for n in bd_names:
            failed[n] = _error_line(e)
        mods, x, gy = {}, None, None
    if model == "linear" and "auto" in mods:
        try:
            out["auto"] = mods["auto"].plan(x).backend
        except Exception:  # noqa: BLE001
            pass
    with _recompile_limit(2 * len(mods) + 8):
        for name, mod in mods.items():
            cname = f"{name}_compiled"
            try:
                want = _results(mod, mod, x, gy)
            except Exception as e:  # noqa: BLE001
                failed[name if name in bd_names else cname] = _error_line(e)
                if name in bd_names:
                    failed[cname] = "not compiled: the eager module failed"
                continue
            if name in bd_names:
                steps[name] = _module_step(mod, mod, x, gy)
            g0, b0 = _dynamo_counts()
            t0 = time.perf_counter()
            try:
                cm = torch.compile(mod, dynamic=dynamic, backend=compiler)
                got = _results(cm, mod, x, gy)  # compiles the forward (and backward) graphs
                compile_s[cname] = round(time.perf_counter() - t0, 2)
                bad = _mismatch(got, want)
                if bad is not None:
                    raise _WrongResult(f"compiled result differs from eager: {bad}")
                _results(cm, mod, x, gy)  # a second call: a recompile on it is not timed either
            except Exception as e:  # noqa: BLE001
                failed[cname] = _error_line(e) if not isinstance(e, _WrongResult) else f"wrong result: {str(e)[:200]}"
                continue
            finally:
                g1, b1 = _dynamo_counts()
                graphs[cname], breaks[cname] = g1 - g0, b1 - b0
            steps[cname] = _module_step(cm, mod, x, gy)
        g_before = _dynamo_counts()[0]
        times, errs = measure(steps, p.device, rounds, min_time, prune=0.0, stat=stat, refine=refine,
                              refine_also=tuple(steps))
        g_timing = _dynamo_counts()[0] - g_before
    failed.update(errs)
    us = {n: t * 1e6 for n, t in times.items()}
    peers = {n: us[n] for n in COMPILED_PEERS if n in us}
    best_peer = min(peers, key=peers.get) if peers else None
    ce, cp = {}, {}
    for n in bd_names:
        c = us.get(f"{n}_compiled")
        if c is None:
            continue
        if n in us:
            ce[n] = round(c / us[n], 4)
        if best_peer is not None:
            cp[n] = round(c / peers[best_peer], 4)
    out.update(
        times_us={n: round(v, 3) for n, v in us.items()},
        compile_s=compile_s,
        graphs=graphs,
        graph_breaks=breaks,
        failed=failed,
        best_peer=best_peer,
        compiled_over_eager=ce,
        compiled_over_best_peer=cp,
    )
    if g_timing:
        out["graphs_while_timing"] = g_timing
    return out


def _point_name(r: dict) -> str:
    return f"{r['model']} B={r['batch']} G={r['groups']} {r['block_in']}x{r['block_out']}"


def _compiled_stats(rs: Sequence[dict], name: str) -> Optional[dict]:
    """:func:`summarize_compiled`'s figures for blockdiag backend ``name`` over rows ``rs``."""
    ce = [(r["compiled_over_eager"][name], r) for r in rs if name in r["compiled_over_eager"]]
    cp = [(r["compiled_over_best_peer"][name], r) for r in rs if name in r["compiled_over_best_peer"]]
    fails = sum(1 for r in rs if name in r["failed"] or f"{name}_compiled" in r["failed"])
    if not ce and not cp and not fails:
        return None
    s: dict = {"points": len(rs), "failed_points": fails}
    if ce:
        worst = max(ce, key=lambda t: t[0])
        s.update(
            geomean_compiled_over_eager=round(_geomean([v for v, _ in ce]), 4),
            max_compiled_over_eager=worst[0],
            worst_point_compiled_over_eager=_point_name(worst[1]),
        )
    if cp:
        worst = max(cp, key=lambda t: t[0])
        gm = _geomean([v for v, _ in cp])
        s.update(
            geomean_compiled_over_best_peer=round(gm, 4),
            geomean_speedup_over_best_peer=round(1 / gm, 3),
            max_compiled_over_best_peer=worst[0],
            worst_point_compiled_over_best_peer=_point_name(worst[1]),
            slower_than_best_peer=sum(v > 1.0 for v, _ in cp),
        )
    if ce and cp:
        t = COMPILED_TARGETS
        s["targets_met"] = {
            f"geomean_compiled_over_eager<={t['geomean_compiled_over_eager']}":
                s["geomean_compiled_over_eager"] <= t["geomean_compiled_over_eager"],
            f"geomean_speedup_over_best_peer>={t['geomean_speedup_over_best_peer']}":
                s["geomean_speedup_over_best_peer"] >= t["geomean_speedup_over_best_peer"],
            "slower_than_no_compiled_peer": s["max_compiled_over_best_peer"] <= t["max_compiled_over_best_peer"],
            "compiled_everywhere": fails == 0,
        }
    return s


def summarize_compiled(rows: Sequence[dict]) -> dict:
    """Per mode, per model (and ``"all"``, both models together): :func:`bench_compiled`'s ratios.

    For ``auto`` under the model's name, for each forced backend under ``"model[name]"``:
    ``points``, ``failed_points``, the geometric mean and the worst (largest) of compiled
    over eager and of compiled over the best compiled peer, with their points, the
    geometric-mean speed-up over the best compiled peer, the points where compiled
    blockdiag is slower than that peer, and ``targets_met`` (:data:`COMPILED_TARGETS`,
    and no failed point).

    >>> summarize_compiled([])
    {}
    """
    out = {}
    measured = [r for r in rows if "times_us" in r]
    for mode in sorted({r["mode"] for r in measured}):
        rs = [r for r in measured if r["mode"] == mode]
        # The blockdiag modules of the rows: auto, and the backends forced (timed or failed).
        steps = {k.removesuffix("_compiled") for r in rs for k in (*r["times_us"], *r["failed"])}
        names_ = ["auto"] + sorted(steps - {"auto", "loop", "vmap"})
        models = [m for m in COMPILED_MODELS if any(r["model"] == m for r in rs)]
        s = {}
        for model in models + (["all"] if len(models) > 1 else []):
            sel = [r for r in rs if model == "all" or r["model"] == model]
            for n in names_:
                st = _compiled_stats(sel, n)
                if st is not None:
                    s[model if n == "auto" else f"{model}[{n}]"] = st
        out[mode] = s
    return out


def plot_decision_map(entry: dict, path: str, backends: Optional[Iterable[str]] = None) -> str:
    """Draw which backend wins where: one panel per (mode, block shape) over groups x batch.

    Each cell is coloured by the fastest backend, shaded by its margin over the runner-up
    (pale: under 5%, full colour: 50% or more), and labelled with both. Needs matplotlib
    (``pip install blockdiag[plot]``).

    Args:
        entry: a profile entry (from :func:`tune` or a profile file).
        path: the image file to write (the format follows the extension).
        backends: only consider these backends (default: all measured).

    Returns:
        ``path``.

    Raises:
        BlockDiagError: matplotlib missing, or the entry has no measurements.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import to_rgb
    except ImportError:
        raise BlockDiagError("plot_decision_map: --plot needs matplotlib: pip install 'blockdiag[plot]'") from None
    ms = entry.get("measurements", [])
    if not ms:
        raise BlockDiagError("plot_decision_map: the profile entry has no measurements to plot")
    keep = set(backends) if backends is not None else None
    panels = sorted({(m["mode"], m["block_in"], m["block_out"]) for m in ms})
    all_names = sorted({n for m in ms for n in m["times_us"] if keep is None or n in keep})
    palette = plt.get_cmap("tab10")
    colour = {n: to_rgb(palette(k % 10)) for k, n in enumerate(all_names)}
    cols = min(4, len(panels))
    rows_n = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.6 * rows_n), squeeze=False)
    for ax, (mode, bi, bo) in zip(axes.flat, panels):
        sel = [m for m in ms if (m["mode"], m["block_in"], m["block_out"]) == (mode, bi, bo)]
        gs = sorted({m["groups"] for m in sel})
        bs = sorted({m["batch"] for m in sel})
        for m in sel:
            t = {n: v for n, v in m["times_us"].items() if keep is None or n in keep}
            if not t:
                continue
            ranked = sorted(t, key=t.get)
            win = ranked[0]
            margin = t[ranked[1]] / t[win] if len(ranked) > 1 else float("inf")
            strength = min(1.0, max(0.15, (margin - 1.0) / 0.5))
            rgb = tuple(1 - strength * (1 - c) for c in colour[win])
            gx, by = gs.index(m["groups"]), bs.index(m["batch"])
            ax.add_patch(plt.Rectangle((gx - 0.5, by - 0.5), 1, 1, color=rgb))
            label = f"{win}\n{margin:.2f}x" if math.isfinite(margin) else win
            ax.text(gx, by, label, ha="center", va="center", fontsize=7)
        ax.set_xlim(-0.5, len(gs) - 0.5)
        ax.set_ylim(-0.5, len(bs) - 0.5)
        ax.set_xticks(range(len(gs)), [str(g) for g in gs])
        ax.set_yticks(range(len(bs)), [str(b) for b in bs])
        ax.set_xlabel("groups")
        ax.set_ylabel("batch")
        ax.set_title(f"{mode}, block {bi}x{bo} (in x out)", fontsize=9)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(
        f"blockdiag decision map: {entry.get('device_name', '?')}, torch {entry.get('torch', '?')}, "
        f"{entry.get('dtype', '?')} (label: winner and its margin over the runner-up)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    from .dispatch import _resolved_settings, blended_times, settings_exclusion

    settings = {k: v for k, v, _ in _resolved_settings(entry, "tuning profile")}
    dtype = getattr(torch, entry.get("dtype", "float32"))
    ms = [m for m in entry.get("measurements", []) if m.get("times_us")]
    out = {}
    for mode in sorted({m["mode"] for m in ms}):
        ratios = []
        for m in (m for m in ms if m["mode"] == mode):
            p = _row_problem(m, dtype, entry.get("device", "cpu"))
            rest = {"measurements": [o for o in ms if o is not m]}
            est, _ = blended_times(p, rest)
            cands = [
                n for n in m["times_us"]
                if n in est and n in names()
                and get(n).decline_reason(p) is None and settings_exclusion(get(n), p, settings) is None
            ]
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


# What describes one tune run in an entry's ``runs`` list.
RUN_FIELDS = ("created", "statistic", "rounds", "threads", "allocator_env", "rematched")

# ``runs`` keeps the most recent this many (an entry tuned point by point for months stays small).
MAX_RUNS = 50


def _run_record(entry: dict) -> dict:
    rec = {k: entry[k] for k in RUN_FIELDS if k in entry}
    # One short string a point: the built-in table is read in review, point by point.
    rec["points"] = [f"{m['mode']} B={m['batch']} G={m['groups']} {m['block_in']}x{m['block_out']}"
                     for m in entry["measurements"]]
    return rec


def merge_entry(old: Optional[dict], new: dict) -> dict:
    """``new`` plus the measurements of ``old`` at points ``new`` did not measure.

    The entry's own fields (``created``, ``rounds``, ``rematched``, ...) describe the latest
    run; ``runs`` lists every run merged into it, oldest first, each with those fields and
    the points it measured, so that a point re-tuned with more rounds is told apart from
    the rest.
    """
    if not old:
        return new

    def key(m):
        return (m["mode"], m["batch"], m["groups"], m["block_in"], m["block_out"])

    seen = {key(m) for m in new["measurements"]}
    kept = [m for m in old.get("measurements", []) if key(m) not in seen]
    out = dict(new)
    out["measurements"] = kept + list(new["measurements"])
    out["settings"] = derive_settings(out["measurements"])
    out["runs"] = (list(old.get("runs") or [_run_record(old)]) + [_run_record(new)])[-MAX_RUNS:]
    return out

