"""The docs hook (``docs/hooks.py``) renders the Performance history page's figures from the
committed files in ``docs/results/``: every marker there renders, and the figures it renders
are the ones in its file."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "performance-history.md"


@pytest.fixture(scope="module")
def hooks():
    spec = importlib.util.spec_from_file_location("_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A figure of each file that must appear, as rendered, in its generated section.
FIGURES = {
    "asv-history-2026-12.json": ["0.24-0.29", "11.3-14.1", "8bd049f", "31 minutes", "2.9", "2.6"],
    "asv-stability-2026-12.json": ["2.4%", "51%", "16-18%", "74%", "75 µs", "155 µs", "1.4 ms", "6.7 ms"],
    "asv-regression-experiment.json": ["f64bad7", "1.10 to 1.40", "exit status 1", "1.5-2.0"],
    "asv-time-noise-2026-12-05.json": ["3a79b6d", "26%"],
}


def test_every_marker_of_the_history_page_renders(hooks):
    page = PAGE.read_text()
    markers = re.findall(r"<!-- ([\w-]+): ([\w.\-]+) -->", page)
    assert {f for _, f in markers} == set(FIGURES)
    rendered = hooks.render(page)
    assert not re.search(r"<!-- [\w-]+: [\w.\-]+ -->", rendered)
    for marker, name in markers:
        section = hooks._FILE_MARKERS[marker](name)
        for figure in FIGURES[name]:
            assert figure in section, (marker, name, figure)


def test_the_heads_results_render_both_tables(hooks):
    # The Performance page's heads section: the rule's basis (before it) and the run with it.
    page = (ROOT / "docs" / "performance.md").read_text()
    assert "<!-- mlp-heads: mlp-heads-strategy-avx512.json -->" in page
    text = hooks.mlp_heads_markdown("mlp-heads-strategy-avx512.json")
    assert "**Before the rule** (blockdiag at `f725cd0d00`" in text and "**With the rule**" in text
    assert text.count("| 2048 | 16 | 256x256 |") == 2


def test_the_compiled_results_render_the_control_and_the_faulting_points(hooks):
    # The Performance page's Intel compiled grid: the control's column, and the points where a
    # timed step page-faulted FAULTS_NOTED times a call or more, with their figures.
    import json

    from blockdiag.tuning import FAULTS_NOTED

    name = "bench-compiled-cpu-avx512.json"
    assert f"<!-- bench-compiled: {name} -->" in (ROOT / "docs" / "performance.md").read_text()
    doc = json.loads((ROOT / "docs" / "results" / name).read_text())
    text = hooks.bench_compiled_markdown(name)
    all_ = doc["summary"]["train"]["all"]
    assert f"| train | all | 66 | {all_['geomean_compiled_over_eager']:.2f} " in text
    assert f"| {all_['geomean_control_compiled_over_eager']:.2f} |" in text
    faulting = [r for r in doc["rows"] if any(v >= FAULTS_NOTED for v in r.get("faults_per_step", {}).values())]
    assert faulting and text.count(" page faults per step ") == 1
    text = text[text.index("page-faulted"):]  # the faulting points' table
    for r in faulting:
        point = f"| {r['mode']} {r['model']} B={r['batch']} G={r['groups']} {r['block_in']}x{r['block_out']} |"
        assert point in text
        worst = max(r["faults_per_step"], key=r["faults_per_step"].get)
        assert f"`{worst}` {r['faults_per_step'][worst]:g}" in text
    quiet = [r for r in doc["rows"] if r not in faulting]
    assert quiet and all(
        f"| {r['mode']} {r['model']} B={r['batch']} G={r['groups']} {r['block_in']}x{r['block_out']} |" not in text
        for r in quiet)


def test_the_compiled_results_render_each_slower_point_with_its_interval(hooks):
    # Every point where compiled blockdiag's median is slower than the best compiled peer's
    # is listed with the interval of its round-by-round ratio and the verdict it gives.
    import json

    name = "bench-compiled-cpu-avx512.json"
    doc = json.loads((ROOT / "docs" / "results" / name).read_text())
    text = hooks.bench_compiled_markdown(name)
    slower = [r for r in doc["rows"] if r["compiled_over_best_peer"].get("auto", 0) > 1]
    all_ = doc["summary"]["train"]["all"]
    assert all_["slower_than_best_peer"] == len(slower)
    assert all_["points_with_interval"] == all_["points"]  # the committed grid has them all
    assert f" | {all_['slower_than_best_peer']} ({all_['slower_than_best_peer_beyond_noise']}) |" in text
    for r in slower:
        lo, hi = r["compiled_over_best_peer_interval"]["auto"]
        verdict = "slower beyond the noise" if lo > 1 else "a tie"
        assert (f"| {r['mode']} {r['model']} B={r['batch']} G={r['groups']} {r['block_in']}x{r['block_out']} | "
                f"`{r['best_peer']}` | {r['compiled_over_best_peer']['auto']:.3f} | {lo:.3f} to {hi:.3f} | {verdict} |") in text
    assert text.count(" | a tie |") + text.count(" | slower beyond the noise |") == len(slower)


def test_the_simd_blas_grads_results_render_every_row(hooks):
    import json

    name = "simd-blas-grads-avx512.json"
    assert f"<!-- simd-blas-grads: {name} -->" in (ROOT / "docs" / "performance.md").read_text()
    doc = json.loads((ROOT / "docs" / "results" / name).read_text())
    text = hooks.simd_blas_grads_markdown(name)
    from blockdiag.backends import _simd_ops

    assert doc["route"] == "op"  # the kernels as simd calls them, through its C++ ops
    assert [doc[k] for k in ("blas_grads_min_block", "blas_weight_grad_min_block", "blas_weight_grad_max_rows",
                             "blas_weight_grad_min_groups")] == [
        _simd_ops.BLAS_GRADS_MIN_BLOCK, _simd_ops.BLAS_WEIGHT_GRAD_MIN_BLOCK, _simd_ops.BLAS_WEIGHT_GRAD_MAX_ROWS,
        _simd_ops.BLAS_WEIGHT_GRAD_MIN_GROUPS]
    assert doc["blas_weight_grad_many"] == {"groups": _simd_ops.BLAS_WEIGHT_GRAD_MANY_GROUPS,
                                            "max_rows": _simd_ops.BLAS_WEIGHT_GRAD_MANY_MAX_ROWS,
                                            "min_in": _simd_ops.BLAS_WEIGHT_GRAD_MANY_MIN_IN}
    assert f"or over at most {_simd_ops.BLAS_WEIGHT_GRAD_MANY_MAX_ROWS} rows" in text
    for r in doc["rows"]:
        rule = _simd_ops.blas_grads(r["batch"], r["groups"], r["block_in"], r["block_out"])
        runs = ", ".join("BLAS" if v else "kernels" for v in rule)
        assert (f"| {r['batch']} | {r['groups']} | {r['block_in']}x{r['block_out']} | "
                f"{r['times_us']['input_kernels']:.0f} |") in text
        step = r.get("step_weight_blas_over_kernels")
        assert ("step_weight_blas" in r["times_us"]) is (r["block_in"] * r["block_out"] < doc["blas_grads_min_block"])
        assert f"| {r['weight_blas_over_kernels']:.2f} | {'–' if step is None else f'{step:.2f}'} | {runs} |" in text
    for label in ("BLAS, BLAS", "kernels, BLAS", "kernels, kernels"):
        assert f"\n| {label} | " in text


def test_a_bench_run_stopped_part_way_is_not_published(hooks, tmp_path, monkeypatch):
    # bench --json saves a run as it goes; a file it left part way has a summary of the
    # points it reached, not of the grid, so the docs refuse it.
    (tmp_path / "partial.json").write_text('{"complete": false, "points_done": 2, "points_total": 48, "rows": []}')
    (tmp_path / "whole.json").write_text('{"complete": true, "rows": []}')
    monkeypatch.setattr(hooks, "RESULTS", tmp_path)
    with pytest.raises(ValueError, match="stopped after 2 of 48 points"):
        hooks._load("partial.json")
    assert hooks._load("whole.json") == {"complete": True, "rows": []}


def test_the_support_matrix_names_every_shape_rule_of_an_available_backend(hooks):
    # The Backends page's "shape rules (why it declines a problem)" column is read as the
    # whole list: every reason a backend's constraint gives at an edge shape (an empty
    # batch, blocks with an empty side, one group) must be in its row.
    import itertools

    import torch

    from blockdiag.backends._registry import Problem, names, registry

    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \| [^|]+ \| [^|]+ \|.*$",
                                                        hooks.support_matrix_markdown(), re.M)}
    reg = registry()
    for name in names():
        b = reg[name]
        if b.constraint is None or b.unavailable_reason() or "cpu" not in b.dtypes:
            continue
        for batch, groups, (i, o), grad in itertools.product(
                (0, 32), (1, 4), ((0, 4), (4, 0), (10, 10)), (False, True)):
            why = b.constraint(Problem(batch, groups, i, o, torch.float32, "cpu", grad))
            if why:
                assert why in rows[name], (name, why, rows[name])


def test_the_builtin_table_columns_name_each_entry_apart(hooks):
    # The Backends page's "which backend when" table has one column per entry of the built-in
    # table, and the table holds one entry per CPU, simd variant and thread count: columns
    # titled alike (the thread count dropped) cannot be told apart.
    head = hooks.which_backend_markdown().splitlines()[0]
    titles = [t.strip() for t in head.strip("|").split("|")[1:]]
    entries = hooks._builtin()["entries"]
    assert len(titles) == len(entries)
    assert len(set(titles)) == len(titles), titles
