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

One module per job, all reached through this package: ``_timer`` (grids, inputs, the
interleaved sampling of :func:`measure`), ``_tune`` (:func:`tune`, :func:`rematch`,
:func:`derive_settings`), ``_memory`` (:func:`peak_memory`), ``_bench`` (:func:`bench` and
its summary), ``_compiled`` (:func:`bench_compiled` and its summary), ``plot``
(:func:`plot_decision_map`) and ``_cross_check`` (:func:`cross_check`). The names a module and a function would share are
taken by the functions: a package attribute is one or the other, and with a module
``bench.py`` beside the function ``bench``, ``import blockdiag.tuning.bench as B`` would give
the function (the clash ``blockdiag.backends`` once had), so the modules are private
(``plot`` names no function). Which backends are timed is the chooser's own filter
(:func:`blockdiag.dispatch.candidates`, without the settings' crossovers, which are derived
from these times); merging a new tune into a saved entry is
:func:`blockdiag.profile.merge_entry`.

>>> from blockdiag.tuning import Grid, tune
>>> entry = tune(Grid((8,), (2,), ((4, 4),)), modes=("forward",), rounds=1, min_time=0.0)
>>> "loop" in entry["measurements"][0]["times_us"]
True
"""

# ruff: noqa: F401  (this module re-exports its submodules' names, private ones included, as before the split)

from ..profile import MAX_RUNS, RUN_FIELDS, _run_record, merge_entry
from ._bench import (
    FAULTS_NOTED,
    INTERVAL_LEVEL,
    bench,
    summarize,
)
from ._compiled import (
    COMPILED_CONTROL,
    COMPILED_MODELS,
    COMPILED_PEERS,
    COMPILED_TARGETS,
    _HeadsLoop,
    _VmapEnsemble,
    bench_compiled,
    summarize_compiled,
)
from ._cross_check import cross_check
from ._memory import peak_memory
from ._timer import (
    ALLOCATOR_ENV,
    BENCH_GRID,
    BENCH_REFINE,
    GRIDS,
    MAX_DENSE_ELEMENTS,
    STATS,
    TIE_MARGIN,
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
    _sample,
    _step,
    _sync,
    _vmap_step,
    allocator_env,
    measure,
    median_interval,
)
from ._tune import (
    REMATCH_ROUNDS_FACTOR,
    _rematch_all,
    _row_problem,
    derive_settings,
    prior_choice,
    rematch,
    tune,
)
from .plot import plot_decision_map

__all__ = [
    "Grid",
    "GRIDS",
    "BENCH_GRID",
    "measure",
    "median_interval",
    "tune",
    "rematch",
    "prior_choice",
    "derive_settings",
    "bench",
    "summarize",
    "bench_compiled",
    "summarize_compiled",
    "plot_decision_map",
    "peak_memory",
    "cross_check",
    "merge_entry",
    "allocator_env",
]
