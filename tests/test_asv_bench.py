"""The asv suite's own machinery: the interleaved timer of the ratio benchmarks, and the
scripts that publish and serve the history (asv_bench/preview.sh, history.sh).

The benchmarks themselves run in CI through .ci/asv_check.sh (every one, once, on a tiny grid).
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ASV = ROOT / "asv_bench"


def _common():
    spec = importlib.util.spec_from_file_location("_asv_common", ASV / "benchmarks" / "common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ratio_of_minima():
    c = _common()
    s = {"auto": [3.0, 2.0, 5.0], "a": [4.0, 1.0, 9.0], "b": [2.0, 2.0, 2.0], "ideal": [8.0, 4.0, 6.0]}
    assert c.ratio_of_minima(s, "auto", "ideal") == 0.5
    # a collection: its fastest member, never the numerator itself
    assert c.ratio_of_minima(s, "auto", ["auto", "a", "b"]) == 2.0
    with pytest.raises(NotImplementedError):
        c.ratio_of_minima(s, "auto", ["auto"])
    with pytest.raises(NotImplementedError):
        c.ratio_of_minima({"auto": []}, "auto", "ideal")


def test_interleaved_rounds_rotate_and_warm():
    c = _common()
    calls = []
    steps = {n: (lambda n=n: calls.append(n)) for n in "abc"}
    samples = c.interleaved(steps, "cpu", rounds=4, target_s=0.0)
    assert {n: len(v) for n, v in samples.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t >= 0 for v in samples.values() for t in v)
    # After calibration (one warm call and one timed call each), every sample is a warm call
    # then one timed call; the order rotates by one each round, so no method always follows
    # the same one and none runs twice in a row across a round boundary.
    timed = calls[6:]
    firsts = timed[0::2]
    assert timed[1::2] == firsts  # warm call, then the timed call of the same method
    assert firsts == list("abc" "bca" "cab" "abc")


def test_time_sampling_is_not_quick():
    c = _common()
    s = c.TIME_SAMPLING
    lo, hi, _ = s["repeat"]
    assert s["rounds"] >= 2 and lo >= 10 and hi >= lo and s["min_run_count"] >= 10 and s["sample_time"] >= 0.01

    @c.asv_sampling
    class Bench:
        pass

    assert Bench.repeat == s["repeat"] and Bench.rounds == s["rounds"]


CDN_PAGE = """<!DOCTYPE html><html><head>
<script src="https://code.jquery.com/jquery-3.3.1.min.js" integrity="sha256-x" crossorigin="anonymous" onerror="js_load_failure()"></script>
<script src="https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.min.js" integrity="sha512-y" crossorigin="anonymous"></script>
<script src="https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.time.min.js" integrity="sha512-y"></script>
<script src="https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.selection.min.js"></script>
<script src="https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.categories.min.js"></script>
<script src="https://cdn.jsdelivr.net/npm/flot-orderbars@1.0.0/js/jquery.flot.orderBars.js" integrity="sha256-z"></script>
<script src="https://cdnjs.cloudflare.com/ajax/libs/stupidtable/1.0.1/stupidtable.min.js"></script>
<script src="https://cdnjs.cloudflare.com/ajax/libs/blueimp-md5/2.19.0/js/md5.min.js"></script>
<script src="https://cdn.jsdelivr.net/npm/bootstrap@3.1.1/dist/js/bootstrap.min.js"></script>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/bootstrap@3.1.1/dist/css/bootstrap.min.css" integrity="sha256-w">
</head><body><a href="https://github.com/airspeed-velocity/asv/">asv</a></body></html>
"""


def _asv_copy(tmp_path):
    """A copy of asv_bench's scripts and vendored files (preview.sh edits html/ beside itself)."""
    dst = tmp_path / "asv_bench"
    dst.mkdir()
    for name in ("preview.sh", "history.sh"):
        shutil.copy2(ASV / name, dst / name)
    shutil.copytree(ASV / "vendor", dst / "vendor")
    return dst


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sed") is None, reason="needs bash and sed")
def test_preview_makes_the_site_offline(tmp_path):
    asv = _asv_copy(tmp_path)
    html = asv / "html"
    html.mkdir()
    (html / "index.html").write_text(CDN_PAGE)
    (html / "regressions.html").write_text(CDN_PAGE)
    for _ in range(2):  # idempotent: history.sh runs it after every publish
        out = subprocess.run(["bash", str(asv / "preview.sh"), "--no-serve"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    page = (html / "index.html").read_text()
    assert "cdnjs" not in page and "code.jquery" not in page and "jsdelivr" not in page
    assert "integrity=" not in page
    refs = re.findall(r'"(vendor/[^"]+)"', page)
    assert len(refs) == 10
    for ref in refs:
        assert (html / ref).is_file(), ref
    assert (html / "vendor" / "LICENSES.txt").is_file()
    assert "https://github.com/airspeed-velocity/asv/" in page  # plain links stay


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sed") is None, reason="needs bash and sed")
def test_preview_refuses_unknown_cdn_files_and_a_missing_site(tmp_path):
    asv = _asv_copy(tmp_path)
    out = subprocess.run(["bash", str(asv / "preview.sh"), "--no-serve"], capture_output=True, text=True)
    assert out.returncode == 1 and "history.sh" in out.stderr
    html = asv / "html"
    html.mkdir()
    (html / "index.html").write_text(CDN_PAGE.replace("md5.min.js", "newlib.min.js"))
    out = subprocess.run(["bash", str(asv / "preview.sh"), "--no-serve"], capture_output=True, text=True)
    assert out.returncode == 1 and "vendor/newlib.min.js" in out.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("args", [["3", "--quick"], ["3", "-b", "mlp", "-q"], ["x"], ["0"]])
def test_history_refuses_quick_and_bad_counts(tmp_path, args):
    asv = _asv_copy(tmp_path)
    # ASV points at something that must never run: the refusal comes first.
    out = subprocess.run(["bash", str(asv / "history.sh"), *args], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "ASV": str(tmp_path / "no-asv")})
    assert out.returncode == 2, out.stderr
    assert "history.sh:" in out.stderr


def test_benchmark_parameters_do_not_depend_on_the_grid_size():
    # ratios.py's parameter lists are static (asv addresses combinations by index across commits).
    sys.path.insert(0, str(ASV))
    try:
        from benchmarks import ratios
        from benchmarks.common import KNOWN_BACKENDS
    finally:
        sys.path.remove(str(ASV))
    assert ratios.GroupedLinearRatios.unit == ratios.BackendRatios.unit == ratios.ForumMLPRatio.unit == "ratio"
    assert ratios.BackendRatios.params[0][: len(KNOWN_BACKENDS)] == list(KNOWN_BACKENDS)
    assert len(ratios.SHAPES) == 6 and ratios.MODES == ["forward", "train"]


def test_the_history_page_says_how_asv_gets_a_cpu_torch():
    # asv installs the pinned torch into its own virtualenvs with pip, whose Linux wheel on PyPI
    # is the CUDA build: a user following the page on a CPU-only machine must be told to point
    # pip at PyTorch's CPU index, as the Installation page does for their own environment.
    conf = (ASV / "asv.conf.json").read_text()
    assert re.search(r'"torch":\s*\["2\.13\.0"\]', conf), "the pin changed: update the page's wording"
    page = (ROOT / "docs" / "performance-history.md").read_text()
    browsing = page.split("## Browsing the history", 1)[1].split("## ", 1)[0]
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in browsing
    # The config's own comment must not claim that pinning alone avoids the CUDA build.
    assert "whose CPU wheel lies on this machine" not in conf


def test_the_history_page_keeps_the_results_of_a_run_in_the_current_environment():
    # `asv run --python=same` saves nothing unless the run names a commit
    # (--set-commit-hash): the page's command for the current checkout must name one, or
    # a user's long run leaves nothing to compare or publish.
    page = (ROOT / "docs" / "performance-history.md").read_text()
    commands = [line for line in page.splitlines() if re.search(r"\basv run\b.*--python=same", line)]
    assert commands
    for line in commands:
        assert "--set-commit-hash" in line or "--dry-run" in line, line


_SUITE_PLAN = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import os
from benchmarks import ratios  # imports blockdiag, then the suite's common module
plan = ratios.blockdiag.GroupedLinear(50 * 150, 50 * 10, 50).plan(torch.randn(256, 50 * 150))
print(plan.backend, plan.source, sep="|")
names = ("SPARSITY_THRESHOLD", "DENSE_MAX_GROUPS", "DENSE_MAX_ELEMENTS", "DOUBLE_BACKWARD")
print(*(f"{v}={os.environ.get('BLOCKDIAG_' + v)}" for v in names), sep="|")
"""


def test_the_suite_measures_the_built_in_table_not_the_users_tuning(tmp_path):
    # asv hands the benchmarks the caller's environment, and `auto` ranks by the tuning
    # profile it finds there ($BLOCKDIAG_PROFILE, or the one `blockdiag tune` saved in the
    # user's cache): the suite's auto then measured the user's tuning, so a history stepped
    # where the user tuned and never showed a change to the commit's built-in table.
    import copy

    import torch

    from blockdiag import profile

    entry = copy.deepcopy(profile.builtin_entry("cpu", torch.float32))
    entry.update(device_name=profile.device_name("cpu"), threads=torch.get_num_threads(), torch=torch.__version__)
    for m in entry["measurements"]:  # a tuned table in which `loop` wins everywhere
        m["times_us"]["loop"] = 0.001
    tuned = tmp_path / "profile.json"
    profile.save_entry(entry, tuned)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(ROOT), BLOCKDIAG_PROFILE=str(tuned), BLOCKDIAG_SPARSITY_THRESHOLD="0",
               BLOCKDIAG_DENSE_MAX_GROUPS="1000", BLOCKDIAG_DOUBLE_BACKWARD="1",
               OMP_NUM_THREADS=str(torch.get_num_threads()))
    out = subprocess.run([sys.executable, "-c", _SUITE_PLAN, str(ASV)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    plan, pinned = out.stdout.splitlines()[-2:]
    backend, source = plan.split("|")
    assert source == "built-in defaults" and backend != "loop", plan
    assert all(kv.endswith("=None") for kv in pinned.split("|")), pinned


_SUITE_PARAMS = """
import inspect, json, pkgutil, importlib, sys
sys.path.insert(0, sys.argv[1])
import benchmarks
out = {}
for m in pkgutil.iter_modules(benchmarks.__path__):
    mod = importlib.import_module(f"benchmarks.{m.name}")
    for name, cls in vars(mod).items():
        if name.startswith("_") or not inspect.isclass(cls) or cls.__module__ != mod.__name__:
            continue
        methods = [k for k in dir(cls) if k.startswith(("time_", "track_", "peakmem_", "mem_"))]
        if not methods:
            continue
        params = getattr(cls, "params", [])
        if params and not all(isinstance(p, (list, tuple)) for p in params):
            params = [params]  # asv's one-parameter form
        out[f"{m.name}.{name}"] = {"names": list(getattr(cls, "param_names", [])),
                                   "params": [[repr(v) for v in p] for p in params]}
print(json.dumps(out))
"""


def _suite_params(grid: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(ROOT), BLOCKDIAG_ASV_GRID=grid)
    out = subprocess.run([sys.executable, "-c", _SUITE_PARAMS, str(ASV)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_every_benchmark_names_each_parameter_once_with_distinct_values():
    # asv keys a result by its parameter values' reprs and addresses combinations by index
    # across commits: a parameter without a name, an empty list or a repeated value breaks
    # that silently; and the tiny CI grid must have the real grid's parameters.
    full, tiny = _suite_params(""), _suite_params("tiny")
    assert full.keys() == tiny.keys() and len(full) >= 15
    for name, b in full.items():
        assert len(b["names"]) == len(b["params"]), (name, b["names"])
        assert len(set(b["names"])) == len(b["names"]), name
        for pname, values in zip(b["names"], b["params"]):
            assert values and len(set(values)) == len(values), (name, pname, values)
        assert tiny[name]["names"] == b["names"], name
