"""How the ``blockdiag`` command lays out its help, its tables, its summaries and its estimates."""

from __future__ import annotations

import argparse
import math
import textwrap
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Union

import torch


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions wrapped to the terminal, examples (indented lines) kept as written, and
    every option's default shown unless its help already gives it."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.split("\n\n"):
            if para.startswith(" ") or "\n " in para:  # an example block: as written
                out.append("\n".join(indent + line for line in para.splitlines()))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                         subsequent_indent=indent))
        return "\n\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if "default" in h or flag or action.default is None or action.default is argparse.SUPPRESS:
            return h
        d = action.default
        if isinstance(d, torch.dtype):
            d = str(d).replace("torch.", "")
        elif isinstance(d, (list, tuple)):
            d = ",".join(map(str, d))
        return f"{h} (default {d})"


# --- durations ------------------------------------------------------------------------------

def duration(seconds: float) -> str:
    """``"under 1 s"``, ``"40 s"``, ``"12 min"`` or ``"2.5 h"``."""
    if seconds < 1:
        return "under 1 s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# A step's samples: the rounds, and about two more for its warm-up and calibration.
_CALIBRATION_SAMPLES = 2
# A call shorter than --min-time is repeated 1, 4, 16, ... times until a batch lasts
# --min-time: a sample then lasts 1-4x --min-time, about 2.2x on (geometric) average.
_SHORT_SAMPLE = 2.2
# Below this a sample still costs the call's own time and the timer's overhead.
_MIN_SAMPLE_S = 1e-3
# The assumed throughput of a call longer than --min-time, averaged over the backends (the
# slow ones pull it far below the machine's peak). With it the model puts the project's
# 2-core CPU's ``tune --full --mode both --max-gflop 20`` (634 s) at 620 s, and a tune of
# 8 small points (about 16 s there) at 13 s.
CPU_FLOPS_PER_THREAD = 24e9
ACCELERATOR_FLOPS = 10e12


def throughput(device: str) -> tuple[float, str]:
    """The FLOP rate the estimate assumes on ``device``, and how it says so."""
    if device == "cpu":
        threads = torch.get_num_threads()
        return CPU_FLOPS_PER_THREAD * threads, f"{CPU_FLOPS_PER_THREAD / 1e9:g} GFLOP/s x {threads} threads"
    return ACCELERATOR_FLOPS, f"{ACCELERATOR_FLOPS / 1e12:g} TFLOP/s"


# What one call costs per group, whatever its FLOPs: at many tiny groups (65536 1x1 blocks)
# every call is this and nothing like its FLOP time. Per (training step?): the kernels' work
# per group (the layouts, the per-group GEMM set-up), and a step that calls torch once per
# group from Python (``Backend.loops_groups``, the nn.Linear loop baseline). Measured with
# ``blockdiag bench --batch 256 --groups 65536 --blocks 1x1`` on the project's 2-core CPU:
# forward 50-117 ms for the backends (0.8-1.8 us a group), 680 ms for ``loop`` and the
# nn.Linear loop (10 us); a training step 136-300 ms (2-4.5 us), 1.0-5.5 s for the loops
# (15-83 us).
GROUP_S = {False: 1e-6, True: 3e-6}
LOOP_GROUP_S = {False: 10e-6, True: 40e-6}


class PointCost(NamedTuple):
    """What one call at a point does, for the duration estimate."""

    flops: float
    groups: int = 1
    train: bool = False


def call_seconds(point: PointCost, rate: float, loops: bool = False) -> float:
    """One call's time in the model: its FLOPs at ``rate``, at least its per-group cost."""
    per_group = (LOOP_GROUP_S if loops else GROUP_S)[point.train]
    return max(point.flops / rate, point.groups * per_group)


def estimate_seconds(points: Sequence[Union[PointCost, float]], steps: int, rounds: int, min_time: float,
                     device: str, loops: int = 0) -> float:
    """The model of :func:`estimate_line`, in seconds.

    ``points``: one :class:`PointCost` per point (a number: its FLOPs alone); ``steps``: the
    steps timed at each point, of which ``loops`` loop over the groups in Python.
    """
    rate, _ = throughput(device)
    per = max(min_time, _MIN_SAMPLE_S)

    def sample(call: float) -> float:
        return call if call >= per else _SHORT_SAMPLE * per

    total = 0.0
    for p in points:
        p = p if isinstance(p, PointCost) else PointCost(float(p))
        total += (steps - loops) * sample(call_seconds(p, rate)) + loops * sample(call_seconds(p, rate, True))
    return total * (rounds + _CALIBRATION_SAMPLES)


def estimate_line(points: Sequence[Union[PointCost, float]], steps: int, what: str, rounds: int, min_time: float,
                  device: str, extra: str, loops: int = 0) -> str:
    """``estimated duration: about ...`` and its basis: ``points x steps x (rounds + 2)``
    samples, each one call at :func:`throughput` (at least its per-group cost) or, for
    shorter calls, about 2x ``min_time``."""
    _, basis = throughput(device)
    seconds = estimate_seconds(points, steps, rounds, min_time, device, loops)
    samples = len(points) * steps * (rounds + _CALIBRATION_SAMPLES)
    per = max(min_time, _MIN_SAMPLE_S)
    n = f"{len(points)} point{'' if len(points) == 1 else 's'}"
    rounds_ = f"{rounds} round{'' if rounds == 1 else 's'}"
    return (f"estimated duration: {'' if seconds < 1 else 'about '}{duration(seconds)} ({samples} samples: {n} x "
            f"{steps} {what} x ({rounds_} + {_CALIBRATION_SAMPLES} to calibrate); each one call at "
            f"{basis} and at least {GROUP_S[False] * 1e6:g} us a group ({LOOP_GROUP_S[False] * 1e6:g} us in "
            f"a Python loop over them; more in training), or about {_SHORT_SAMPLE:g} x {per:g} s for shorter "
            f"calls; {extra})")


# --- tables: one unit per column -------------------------------------------------------------

def unit(values_us: Iterable[float | None]) -> str:
    """The unit of a column of times in microseconds: ``ms`` once its largest reaches 10 ms."""
    vals = [v for v in values_us if v is not None]
    return "ms" if vals and max(vals) >= 10000 else "us"


def in_unit(v: float | None, unit_: str) -> str:
    """``v`` (microseconds) in ``unit_``, without the unit (it is in the column's heading)."""
    if v is None:
        return "-"
    if unit_ == "ms":  # three significant digits down to 0.0xx ms
        return f"{v / 1000:.2f}" if v >= 1000 else f"{v / 1000:.3f}"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def ratio(v: float | None, width: int = 7) -> str:
    return f"{v:{width}.2f}" if v is not None else f"{'-':>{width}s}"


# --- summaries: a few labelled lines ---------------------------------------------------------

# The counts' denominators (how many points each count is of), shown as "N of M" on the
# counts' lines rather than on lines of their own.
DENOMINATORS = ("rated_points", "choice_points", "builtin_points")

# bench's summary (tuning.summarize): the JSON keys, labelled for people, in this order.
BENCH_SUMMARY = (
    ("points", "points", "{}"),
    ("geomean_auto_over_fastest", "auto over the fastest backend, geometric mean", "{:.3f}"),
    ("max_auto_over_fastest", "auto over the fastest backend, worst", "{:.3f}"),
    ("worst_point", "  at", "{}"),
    ("within_1.10", "points where auto is within 1.10 of the fastest", "{} of {rated_points}"),
    ("beyond_1.10_beyond_noise", "points where auto is beyond 1.10 of the fastest beyond the rounds' noise",
     "{} of {points_with_interval}"),
    ("geomean_choice_over_fastest", "auto's choice forced over the fastest, geometric mean", "{:.3f}"),
    ("choice_within_1.10", "points where auto's choice is within 1.10 of the fastest", "{} of {choice_points}"),
    ("geomean_auto_over_choice", "auto over its choice forced by name (the choosing's cost), geometric mean",
     "{:.3f}"),
    ("geomean_auto_over_kernel", "auto over its choice's bare kernel (the whole dispatch's cost), geometric mean",
     "{:.3f}"),
    ("median_dispatch_overhead_us", "dispatch cost, median", "{:.1f} us"),
    ("geomean_builtin_choice_over_fastest", "the built-in table's choice over the fastest, geometric mean",
     "{:.3f}"),
    ("builtin_choice_within_1.10", "points where the built-in choice is within 1.10 of the fastest",
     "{} of {builtin_points}"),
    ("geomean_choice_over_builtin_choice", "the profile's choice over the built-in one, geometric mean",
     "{:.3f}"),
    ("choices_differing_from_builtin", "points where the profile and the built-in table differ", "{}"),
    ("geomean_speedup_vs_nn_linear_loop", "speed-up over the nn.Linear loop, geometric mean", "{:.2f}x"),
    ("min_speedup_vs_nn_linear_loop", "speed-up over the nn.Linear loop, smallest", "{:.2f}x"),
    ("geomean_speedup_vs_vmap", "speed-up over vmap ensembling, geometric mean", "{:.2f}x"),
    ("min_speedup_vs_vmap", "speed-up over vmap ensembling, smallest", "{:.2f}x"),
    ("median_fraction_of_ideal", "fraction of the ideal GEMM, median", "{:.0%}"),
    ("points_with_interval", "points with an interval (paired rounds)", "{}"),
)

# bench --compiled's summary (tuning.summarize_compiled), per model.
COMPILED_SUMMARY = (
    ("points", "points", "{}"),
    ("failed_points", "points where a compiled method failed or differed from eager", "{}"),
    ("geomean_compiled_over_eager", "compiled over eager, geometric mean", "{:.3f}"),
    ("max_compiled_over_eager", "compiled over eager, worst", "{:.3f}"),
    ("worst_point_compiled_over_eager", "  at", "{}"),
    ("geomean_loop_compiled_over_eager", "the nn.Linear loop's compiled over eager, geometric mean", "{:.3f}"),
    ("geomean_vmap_compiled_over_eager", "vmap ensembling's compiled over eager, geometric mean", "{:.3f}"),
    ("geomean_control_compiled_over_eager", "the control's compiled over eager (plain layers, same work), "
     "geometric mean", "{:.3f}"),
    ("geomean_compiled_over_eager_over_control", "compiled over eager, over the control's, geometric mean", "{:.3f}"),
    ("geomean_compiled_over_best_peer", "compiled over the fastest compiled peer, geometric mean", "{:.3f}"),
    ("geomean_speedup_over_best_peer", "speed-up over the fastest compiled peer, geometric mean", "{:.2f}x"),
    ("max_compiled_over_best_peer", "compiled over the fastest compiled peer, worst", "{:.3f}"),
    ("worst_point_compiled_over_best_peer", "  at", "{}"),
    ("slower_than_best_peer", "points slower than the fastest compiled peer", "{}"),
    ("slower_than_best_peer_beyond_noise", "  of which slower beyond the rounds' noise (interval above 1)", "{}"),
    ("tied_with_best_peer", "points tied with the fastest compiled peer (interval holding 1)", "{}"),
    ("points_with_interval", "points with an interval (paired rounds)", "{}"),
)


def _note(key: str, v) -> str:
    # auto's time minus its choice's, each a median of the same few rounds: where the
    # dispatch costs less than the rounds vary, the difference can come out below zero.
    if key == "median_dispatch_overhead_us" and isinstance(v, (int, float)) and v < 0:
        return " (below zero: less than this run's timing noise)"
    return ""


def _value(fmt: str, v, s: dict) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    try:
        return fmt.format(v, **s)
    except (TypeError, ValueError, KeyError, IndexError):
        # A count without its denominator (a summary from before they were recorded).
        return fmt.split(" of {")[0].format(v) if " of {" in fmt else str(v)


def summary_lines(title: str, s: dict, labels: Sequence[tuple[str, str, str]] = BENCH_SUMMARY,
                  skip: Sequence[str] = ()) -> str:
    """``title:`` then one aligned ``label  value`` line per figure of ``s`` (unlabelled keys
    last, under their own names, so that nothing the JSON has is hidden)."""
    known = {k for k, _, _ in labels} | set(DENOMINATORS)
    rows = [(label, _value(fmt, s[k], s) + _note(k, s[k])) for k, label, fmt in labels if s.get(k) is not None]
    rows += [(k.replace("_", " "), str(v)) for k, v in s.items() if k not in known and k not in skip]
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join([f"{title}:", *(f"  {label:{width}s}  {v}" for label, v in rows)])
