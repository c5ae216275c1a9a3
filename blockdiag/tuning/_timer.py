"""The timer under ``tune`` and ``bench``: grids, inputs, steps, interleaved sampling, progress."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from itertools import product
from typing import Callable, Iterable, Optional, Sequence, TextIO

import torch
from torch import nn

from .._errors import BlockDiagError
from ..backends import Problem, get, names


@contextlib.contextmanager
def autograd_as_in_training():
    """Autograd on, whatever grad mode the caller is in: the measuring entry points run under it.

    A training point times a forward and its backward, and the backward needs the graph
    that only recording builds: under the caller's ``no_grad`` (or ``set_grad_enabled(False)``)
    every backward would fail, and under ``inference_mode`` the inputs made inside would be
    inference tensors, which no backward may save. Inference points stay under ``no_grad``
    (:func:`_step`). Used as a decorator.
    """
    with torch.inference_mode(False), torch.enable_grad():
        yield


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
    from ..nn.linear import grouped_linear

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
    faults: Optional[dict[str, float]] = None,
    per_round: Optional[dict[str, list[float]]] = None,
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
        faults: a dict to fill with each step's minor page faults per call, the median over
            its samples (counted around each sample, outside its timing; left empty where
            the platform does not count them). A warm step that faults is paying for fresh
            pages from the allocator, not for its own work (docs/faq.md).
        per_round: a dict to fill with each step's samples (seconds per call) in the order
            taken. Index ``r`` of two steps' lists is the same round wherever both lists
            reach it (a pruned step's list stops early, a step outside ``refine``'s extra
            rounds stops at ``rounds``), so ``a[r] / b[r]`` pairs samples taken moments apart:
            what :func:`median_interval` of such ratios reads.

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
    counts: Optional[dict[str, list[float]]] = None
    if faults is not None and _minor_faults() is not None:
        counts = {n: [] for n in steps}
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
            samples[name].append(_sample(steps[name], reps[name], device, None if counts is None else counts[name]))
    agg = STATS[stat]
    contenders = {n: agg(samples[n]) for n in order if n not in keep}
    best = min(contenders.values(), default=0.0)
    tied = [n for n, t in contenders.items() if t <= (1 + refine) * best] if refine > 0 else []
    if refine > 0:
        tied += [n for n in refine_also if n in samples and n not in tied]
    for r in range(rounds if len(tied) > 1 else 0):
        k = r % len(tied)
        for name in tied[k:] + tied[:k]:
            samples[name].append(_sample(steps[name], reps[name], device, None if counts is None else counts[name]))
    if faults is not None and counts:
        faults.update({n: statistics.median(v) for n, v in counts.items() if v and n in samples})
    if per_round is not None:
        per_round.update({n: list(v) for n, v in samples.items()})
    return {n: agg(v) for n, v in samples.items()}, failures


def _minor_faults() -> Optional[int]:
    """This process's minor page faults so far (None where the platform does not count them)."""
    if sys.platform == "win32":
        return None
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _sample(run: Callable[[], None], n: int, device: str, faults: Optional[list[float]] = None) -> float:
    """Seconds per call of ``n`` back-to-back calls of ``run``; appends its page faults per call to ``faults``."""
    if n > 1:
        run()  # untimed: wakes the thread pool, so the sample measures the op, not the wake-up
    _sync(device)
    f0 = _minor_faults() if faults is not None else None
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    _sync(device)
    dt = time.perf_counter() - t0
    if f0 is not None:
        faults.append((_minor_faults() - f0) / n)
    return dt / n


STATS = {"median": statistics.median, "min": min}

# Backends within this fraction of the fastest one at a tuned point are near-tied and get
# extra rounds (``tune``'s default ``refine``). On a shared machine the same kernel's median
# moves between runs by far more than a few percent (docs/results/asv-time-noise-*.json), so
# a lead of a few percent after five rounds is not yet a ranking.
TIE_MARGIN = 0.05

# ``bench``'s ``refine``: wider than tune's, since a bench point's verdicts (auto within 1.10
# of the fastest, faster than the nn.Linear loop) are 10% margins. On a shared machine a
# burst of noise can put auto 10-20% behind a forced run of the very same kernel after five
# rounds; the extra rounds dilute such bursts (see docs/design.md, "How `tune` measures").
BENCH_REFINE = 0.10

# The environment variables that change how the C allocator serves tensor memory. With
# glibc's defaults, a CPU tensor over 32 MB is a fresh mmap every time it is allocated, and
# first touching its pages can cost more than the product that fills it (docs/faq.md,
# "Training at large batch is slower than expected"), so measurements record these next to
# the times they explain.
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


def _resolve_modes(modes: Sequence[str]) -> tuple[str, ...]:
    out = tuple(modes)
    bad = [m for m in out if m not in ("forward", "train")]
    if bad or not out:
        raise BlockDiagError(f"tune: modes must be a non-empty subset of ('forward', 'train'), got {modes!r}")
    return out


def median_interval(values: Sequence[float], level: float = 0.95) -> Optional[tuple[float, float]]:
    """A distribution-free confidence interval for the median of ``values``; None below 6 of them.

    The interval runs from the ``j``-th smallest value to the ``j``-th largest, with ``j`` the
    largest rank whose interval covers the median with probability ``level`` or more
    whatever the distribution (the sign test's order statistics: coverage
    ``1 - 2 P(Binomial(n, 1/2) < j)``). Timings are skewed, stalls only ever add time, and a
    normal interval would be pulled by a single stall; this one is not. Fewer than 6 values
    cannot reach 95%: the widest interval, smallest to largest, covers ``1 - 2 / 2**n``.

    >>> median_interval([1.02, 0.99, 1.01, 1.00, 0.98, 1.03, 1.00, 0.97, 1.05, 1.01])
    (0.98, 1.03)
    >>> median_interval([1.0, 1.1]) is None
    True

    Args:
        values: the samples (for ``bench``, ratios of paired samples of two steps).
        level: the least coverage wanted, in (0, 1).

    Returns:
        ``(low, high)``, or None where ``values`` are too few for ``level``.

    Raises:
        BlockDiagError: ``level`` not in (0, 1).
    """
    if not 0.0 < level < 1.0:
        raise BlockDiagError(f"median_interval: level must be in (0, 1), got {level!r}")
    xs = sorted(values)
    n = len(xs)
    alpha = 1.0 - level
    below = 0  # P(X <= j - 1) * 2**n for X ~ Binomial(n, 1/2), at the current j
    j = 0
    while j < n // 2 and 2 * (below + math.comb(n, j)) <= alpha * 2**n:
        below += math.comb(n, j)
        j += 1
    return None if j == 0 else (xs[j - 1], xs[n - j])


def _geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def _runnable(p: Problem, backends: Optional[Iterable[str]]) -> tuple[list[str], dict[str, str]]:
    """What ``tune`` and ``bench`` time at ``p``, and why each other backend is skipped.

    The chooser's own filter (:func:`blockdiag.dispatch.exclusions`) without the
    settings' crossovers (they are derived from these times), plus one guard of measuring:
    a backend that materializes the dense matrix is skipped above
    :data:`MAX_DENSE_ELEMENTS` entries.
    """
    from ..dispatch import exclusions

    order = list(names() if backends is None else backends)
    for name in order:
        get(name, "tune", auto_valid=False)  # an unknown name: the message lists the valid ones
    skipped = exclusions(p, order, crossovers=False)
    ok = []
    for name in order:
        if name in skipped:
            continue
        if get(name).dense_matrix and p.dense_elements > MAX_DENSE_ELEMENTS:
            skipped[name] = f"skipped: its dense matrix would have {p.dense_elements} entries"
        else:
            ok.append(name)
    return ok, skipped
