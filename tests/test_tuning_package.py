"""``blockdiag.tuning`` as a package: its names, its modules, and the chooser's filter it uses."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import blockdiag
from blockdiag import Problem, dispatch, profile, tuning
from blockdiag.backends import names

from _profiles import entry, point

ROOT = Path(__file__).resolve().parents[1]
# Where the package's names are used: the library, its tests, scripts, benchmarks and docs.
SOURCES = ("blockdiag", "tests", "scripts", "asv_bench/benchmarks", "docs")
SUBMODULES = [m.name for m in pkgutil.iter_modules(tuning.__path__)]


def _names_used_from_tuning() -> dict[str, set[str]]:
    """Every ``tuning.<name>`` and ``from ...tuning import <name>`` in the project's files."""
    used: dict[str, set[str]] = {}

    def add(name, f):
        used.setdefault(name, set()).add(str(f.relative_to(ROOT)))

    for d in SOURCES:
        for f in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom):
                    if node.module == "blockdiag.tuning" or (node.level and node.module == "tuning"):
                        for alias in node.names:
                            add(alias.name, f)
                elif isinstance(node, ast.Attribute):
                    v = node.value
                    if (isinstance(v, ast.Name) and v.id in ("tuning", "_tuning")) or (
                        isinstance(v, ast.Attribute) and v.attr == "tuning"
                    ):
                        add(node.attr, f)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    # monkeypatch.setattr("blockdiag.tuning.bench", ...) and docstrings.
                    for m in re.finditer(r"\bblockdiag\.tuning\.([A-Za-z_]\w*)", node.value):
                        add(m.group(1), f)
    for f in (ROOT / "docs").glob("*.md"):
        for m in re.finditer(r"\btuning\.([A-Za-z_]\w*)\b(?!\.md|\.py)", f.read_text(encoding="utf-8")):
            if m.group(1) not in ("md", "py"):
                add(m.group(1), f)
    return used


def test_every_name_the_project_uses_from_tuning_is_there():
    used = _names_used_from_tuning()
    assert {"tune", "bench", "measure", "merge_entry", "cross_check", "plot_decision_map"} <= set(used)
    missing = {n: sorted(fs) for n, fs in used.items() if not hasattr(tuning, n)}
    assert not missing, f"used but not importable from blockdiag.tuning: {missing}"
    for name in tuning.__all__:
        assert hasattr(tuning, name), name


def test_no_module_of_the_package_is_hidden_by_a_name():
    # A package attribute is a function or a module, not both: were a module called like
    # the function it holds, `import blockdiag.tuning.<name> as m` would give the function.
    assert {"_timer", "_tune", "_bench", "_compiled", "_memory", "_cross_check", "plot"} <= set(SUBMODULES)
    for sub in SUBMODULES:
        module = importlib.import_module(f"blockdiag.tuning.{sub}")
        assert getattr(tuning, sub, module) is module, sub
    # The public functions stay functions.
    for name in ("tune", "bench", "cross_check", "peak_memory", "measure"):
        assert callable(getattr(tuning, name)) and not isinstance(getattr(tuning, name), type(tuning))


def test_profile_merging_lives_in_profile():
    assert tuning.merge_entry is profile.merge_entry
    assert tuning._run_record is profile._run_record and tuning.MAX_RUNS == profile.MAX_RUNS
    old = entry([point(loop=2.0), point(batch=32, loop=3.0)])
    new = entry([point(loop=1.0)])
    merged = profile.merge_entry(old, new)
    assert sorted(m["batch"] for m in merged["measurements"]) == [32, 256]
    assert [m["times_us"] for m in merged["measurements"] if m["batch"] == 256] == [{"loop": 1.0}]
    assert len(merged["runs"]) == 2


def test_tuning_reads_no_private_helper_of_the_chooser():
    # The chooser's rules are used through its public functions (candidates, exclusions,
    # blended_times, ...), never re-implemented on its private ones.
    for f in (ROOT / "blockdiag" / "tuning").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("dispatch"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{f.name} imports {private} from dispatch"
            v = getattr(node, "value", None)
            if isinstance(node, ast.Attribute) and isinstance(v, ast.Name) and v.id == "dispatch":
                assert not node.attr.startswith("_"), f"{f.name} reads dispatch.{node.attr}"


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("shape", [(32, 4, 10, 10), (256, 50, 10, 10), (8, 256, 64, 64), (2048, 1, 150, 10)])
def test_what_tune_times_is_the_choosers_filter_without_the_crossovers(shape, requires_grad):
    p = Problem(*shape, requires_grad=requires_grad)
    ok, skipped = tuning._runnable(p, None)
    free = dispatch.candidates(p, crossovers=False)
    # The one extra guard of measuring: no dense matrix too large to time.
    too_big = p.dense_elements > tuning.MAX_DENSE_ELEMENTS
    guard = {n for n in free if too_big and blockdiag.backends.get(n).dense_matrix}
    assert ok == [n for n in free if n not in guard]
    assert set(ok) | set(skipped) == set(names())
    assert {n: skipped[n] for n in skipped if n not in guard} == dispatch.exclusions(p, crossovers=False)
    # The settings move what auto considers, never what tune times (it derives them).
    with blockdiag.config(sparsity_threshold=0.0, dense_max_groups=0, double_backward=True):
        assert tuning._runnable(p, None) == (ok, skipped)


def test_cross_check_screens_with_the_entrys_own_settings():
    # Only csr is measured: it may be chosen only where the entry's settings let it run.
    ms = [point(batch=b, groups=4, csr=float(b)) for b in (32, 64, 128, 256)]
    allowed = tuning.cross_check(entry(ms, settings={"sparsity_threshold": 0.5}))
    assert allowed["forward"]["points"] == 4 and allowed["forward"]["worst"] == 1.0
    assert tuning.cross_check(entry(ms, settings={"sparsity_threshold": 1.0})) == {}


def test_replacing_measure_on_the_package_reaches_tune_and_bench(monkeypatch):
    # The CLI's tests script the timer by replacing blockdiag.tuning.measure: every caller
    # in the package must look it up there.
    calls = []

    def fake(steps, device, *args, **kwargs):
        calls.append(sorted(steps))
        return {n: 1e-6 * (i + 1) for i, n in enumerate(steps)}, {}

    monkeypatch.setattr(tuning, "measure", fake)
    grid = tuning.Grid((8,), (2,), ((4, 4),))
    got = tuning.tune(grid, modes=("forward",), backends=["loop", "bmm"], rematch=False)
    assert calls == [["bmm", "loop"]] and got["measurements"][0]["times_us"] == {"loop": 1.0, "bmm": 2.0}
    rows = tuning.bench(grid, modes=("forward",), backends=["loop"], baselines=False, memory=False)
    assert "auto" in calls[1] and "loop" in calls[1] and rows[0]["times_us"] == {"loop": 1.0}


@pytest.mark.parametrize("context", [
    pytest.param(torch.no_grad, id="no_grad"),
    pytest.param(lambda: torch.set_grad_enabled(False), id="set_grad_enabled"),
    pytest.param(torch.inference_mode, id="inference_mode"),
])
def test_training_points_are_measured_under_the_callers_grad_mode(context):
    # Every backward failed under the caller's no_grad or inference mode: tune's training
    # points came back with every backend skipped and no time, and bench raised.
    grid = tuning.Grid((8,), (2,), ((4, 4),))
    with context():
        got = tuning.tune(grid, modes=("train",), backends=["loop", "bmm"], rounds=1, min_time=0.0, rematch=False)
        rows = tuning.bench(grid, modes=("train",), backends=["loop"], rounds=1, min_time=0.0, baselines=False,
                            memory=False, refine=0.0)
        compiled = tuning.bench_compiled(grid, models=("linear",), baselines=False, rounds=1, min_time=0.0,
                                         refine=0.0, compiler="eager")
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    assert set(got["measurements"][0]["times_us"]) == {"loop", "bmm"}, got["measurements"][0].get("skipped")
    assert set(rows[0]["times_us"]) == {"loop"} and rows[0]["auto_us"] > 0
    assert compiled[0]["failed"] == {} and {"auto", "auto_compiled"} <= set(compiled[0]["times_us"])


def test_the_compiled_benchmark_builds_its_modules_on_the_cpu_under_another_default_device():
    # Built on the default device and then moved: under torch.device("meta") every module was
    # a meta one, and moving it failed ("Cannot copy out of meta tensor").
    grid = tuning.Grid((8,), (2,), ((4, 4),))
    with torch.device("meta"):
        rows = tuning.bench_compiled(grid, models=("linear",), baselines=False, rounds=1, min_time=0.0,
                                     refine=0.0, compiler="eager")
    assert rows[0]["failed"] == {} and {"auto", "auto_compiled"} <= set(rows[0]["times_us"])


def test_importing_tuning_leaves_matplotlib_alone():
    # Plotting is one job of its own, loaded only when a map is drawn.
    code = "import sys, blockdiag.tuning; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
