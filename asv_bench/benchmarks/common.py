"""Shared parameters and helpers of the blockdiag benchmarks.

Parameter lists must not depend on the blockdiag version installed: asv discovers the
benchmarks once (on the newest commit) and then addresses each parameter combination by its
index when it benchmarks older commits, so a list that grew with the registry would shift the
indices. ``KNOWN_BACKENDS`` therefore lists every backend name any commit registers;
``.ci/asv_check.sh`` fails when the registry holds a name missing here. A backend that a commit
lacks, or that cannot run a shape there, raises ``NotImplementedError`` in ``setup`` (shown as
n/a), so one suite benchmarks every commit.

``BLOCKDIAG_ASV_GRID=tiny`` shrinks every shape grid to one small point (CI smoke runs only:
never mix its results with the real ones).

``auto`` is measured as each commit ships it: importing this module points
``$BLOCKDIAG_PROFILE`` at a profile that never exists and drops the chooser's other
``BLOCKDIAG_*`` settings (:data:`PINNED_ENV`), so no tuning on the machine reaches the suite.

Two kinds of benchmark live here (see docs/performance-history.md):

* ``track_*`` **ratios** (unit ``"ratio"``, lower is better, like a time): several methods
  timed in one process in interleaved rounds (:func:`interleaved`), each round timing every
  method once in short samples, and the ratio of each side's fastest sample
  (:func:`ratio_of_minima`). Both sides were sampled over the same seconds of the machine and
  noise only adds time, so a loaded machine moves the ratio far less than it moves a time.
  These are the headline numbers.
* ``time_*`` **times**: asv's own sampler, with :data:`TIME_SAMPLING`. They move with the
  machine's load and state (see the comment there), so they answer "how long" on a quiet
  machine and are never the headline.

Only public API that every benchmarked commit has is used here (``GroupedLinear``,
``grouped_linear``, ``backends``), and the timer is this file's own, so the suite runs against
old commits too.
"""

import gc
import os
import time
import warnings

import torch

import blockdiag
from blockdiag import BlockDiagError

# Each commit is measured as it ships: ``auto`` ranks by the commit's built-in table with the
# default crossovers, never by a tuning profile that ``blockdiag tune`` left on this machine
# (the user's cache, or $BLOCKDIAG_PROFILE) nor by the chooser's BLOCKDIAG_* settings. asv
# passes the caller's environment on, so without this a history would step where the user
# tuned, and a change to the built-in table would never show. The profile's path names a
# folder that never exists (a missing profile means the built-in table, on every commit);
# environment variables because every commit reads them at each choice, not at import.
NO_PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "no-tuning-profile", "profile.json")
PINNED_ENV = ("BLOCKDIAG_SPARSITY_THRESHOLD", "BLOCKDIAG_DENSE_MAX_GROUPS", "BLOCKDIAG_DENSE_MAX_ELEMENTS",
              "BLOCKDIAG_DOUBLE_BACKWARD")
os.environ["BLOCKDIAG_PROFILE"] = NO_PROFILE
for _var in PINNED_ENV:
    os.environ.pop(_var, None)

# torch announces its beta sparse layouts once per process; it would flood every log.
warnings.filterwarnings("ignore", "Sparse (CSR|BSR|CSC|BSC) tensor support is in beta state", UserWarning)

KNOWN_BACKENDS = ("loop", "dense", "bmm", "conv", "csr", "bsr", "torch_sparse", "grouped_mm", "bmm_fm", "bmm_fm_loop", "bmm_fm_bmm", "mkl_batch", "simd")
TINY = os.environ.get("BLOCKDIAG_ASV_GRID", "") == "tiny"

# The registry: list_backends() where a commit has it, backends() (its older, now deprecated
# name) before that, so that one suite runs on old and new commits alike.
list_backends = getattr(blockdiag, "list_backends", None) or blockdiag.backends

# Every known name first (stable indices), then any name only this installation registers.
BACKENDS = list(KNOWN_BACKENDS) + [b.name for b in list_backends() if b.name not in KNOWN_BACKENDS]

# The GPU parameter exists only where CUDA does (results are stored per machine).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def grid(full, tiny):
    """``full`` normally, ``tiny`` under ``BLOCKDIAG_ASV_GRID=tiny``."""
    return tiny if TINY else full


def parse_block(block: str) -> tuple[int, int]:
    """``"150x10"`` (in x out) -> ``(150, 10)``."""
    i, o = block.split("x")
    return int(i), int(o)


def sync(device: str) -> None:
    """Wait for queued kernels so a timing covers the work, not just its launch."""
    if device == "cuda":
        torch.cuda.synchronize()


def require_backend(name: str) -> None:
    """Raise ``NotImplementedError`` when ``name`` is not registered or cannot run here."""
    info = {b.name: b for b in list_backends()}
    if name not in info:
        raise NotImplementedError(f"backend {name!r} is not registered in this commit")
    if not info[name].available:
        raise NotImplementedError(f"backend {name!r} is unavailable here: {info[name].reason}")


def require_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise NotImplementedError("CUDA is not available")


def try_run(fn):
    """Run ``fn()`` once (warm-up); a backend declining the problem becomes ``NotImplementedError``."""
    try:
        return fn()
    except BlockDiagError as e:
        raise NotImplementedError(str(e)) from None


# asv's sampling of every time_* benchmark: 2 processes ("rounds") x 10-25 samples of at least
# 25 ms each (the call repeated to fill them), at most 3 s of samples per process. On the
# project's shared 2-core VM that does not make a time repeatable: three runs of unchanged
# code, minutes apart, differ far more than 10% at most points (docs/results/
# asv-time-noise-*.json, rendered on docs/performance-history.md), because the machine's
# state changes between processes; more samples per process do not help. Compare times only
# between commits measured together on a quiet machine; the ratios are the history. --quick
# takes one sample and is only a smoke test, never history.
TIME_SAMPLING = {
    "rounds": 2, "repeat": (10, 25, 3.0), "sample_time": 0.025, "min_run_count": 10, "warmup_time": 0.1,
}


def asv_sampling(cls):
    """Class decorator: :data:`TIME_SAMPLING` as the class's asv attributes."""
    for k, v in TIME_SAMPLING.items():
        setattr(cls, k, v)
    return cls


# The interleaved timer of the ratio benchmarks: ROUNDS rounds, each sample at least TARGET_S
# seconds (the call repeated to fill it; most products take longer, so one call). Short samples
# on purpose: a stall of the machine lasts a few ms, and a short sample often escapes it. The
# tiny CI grid takes 3 rounds: it checks only that the benchmark runs.
ROUNDS = grid(41, 3)
TARGET_S = grid(0.001, 0.0005)


def _sample(step, number: int, device: str, warm: bool = True) -> float:
    """Seconds per call of ``step`` over ``number`` back-to-back calls (garbage collector off).

    ``warm``: one untimed call first, so the sample sees the caches as a loop of calls does,
    not as the previous method left them (without it, the method that happens to run twice
    in a row, or after a small one, looks faster).
    """
    gcold = gc.isenabled()
    gc.disable()
    try:
        if warm:
            step()
            sync(device)
        t0 = time.perf_counter()
        for _ in range(number):
            step()
        sync(device)
        return (time.perf_counter() - t0) / number
    finally:
        if gcold:
            gc.enable()


def calibrate(step, device: str, target_s: float) -> int:
    """Calls per sample so that one sample lasts at least ``target_s`` (one warm call first)."""
    step()
    sync(device)
    number = 1
    while True:
        t = _sample(step, number, device, warm=False) * number
        if t >= target_s or number >= 1 << 20:
            return number
        # Aim a little past the target from the measured rate (doubling at most 10x per try).
        number = max(number + 1, min(number * 10, int(number * 1.2 * target_s / max(t, 1e-9))))


def interleaved(steps: dict, device: str, rounds: int | None = None, target_s: float | None = None) -> dict:
    """Time ``steps`` (name -> no-argument callable) in interleaved rounds, in this process.

    Each round times every step once (one sample of ``calibrate``'d length, after an untimed
    warm call), the order rotated by one each round, so no step always follows the same one.
    Returns name -> list of seconds per call, one per round.
    """
    rounds = ROUNDS if rounds is None else rounds
    target_s = TARGET_S if target_s is None else target_s
    numbers = {name: calibrate(step, device, target_s) for name, step in steps.items()}
    samples = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(_sample(steps[name], numbers[name], device))
    return samples


def ratio_of_minima(samples: dict, num: str, den) -> float:
    """``min(samples[num]) / min(samples[den])``: the least-disturbed time of each side.

    ``den`` may also be a collection of names: then it is the fastest of them (the fastest
    fixed backend, say). On a shared machine noise only ever adds time, and with short
    interleaved samples every side gets undisturbed moments alike; the minimum finds them.
    (The median of per-round ratios was tried and is worse here: with two OpenMP threads on
    two busy cores, a sample is hit by a stall of a few ms, which the other side of the round
    does not share; see docs/performance-history.md.)
    """
    names = [den] if isinstance(den, str) else [n for n in den if n != num]
    d = [min(samples[n]) for n in names if samples.get(n)]
    if not samples.get(num) or not d:
        raise NotImplementedError(f"nothing measured for {num} over {den}")
    return min(samples[num]) / min(d)
