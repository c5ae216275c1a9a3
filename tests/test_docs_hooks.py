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


def _bench_row(batch, times, auto="bmm"):
    fastest = min(times, key=times.get) if times else None
    auto_us = times.get(auto, 10.0)
    return {"mode": "forward", "batch": batch, "groups": 4, "block_in": 8, "block_out": 8, "times_us": times,
            "auto": auto, "auto_us": auto_us, "fastest": fastest,
            "auto_over_fastest": round(auto_us / times[fastest], 4) if fastest else None,
            "auto_kernel_us": auto_us, "auto_over_kernel": 1.0, "ideal_us": 5.0,
            "fraction_of_ideal": round(5.0 / auto_us, 4), "baselines_us": {}, "skipped": {}}


def test_a_bench_run_with_skipped_points_renders(hooks, tmp_path, monkeypatch):
    # bench --max-gflop records a point it skips as a row with the reason and no times, and
    # bench --backends dense above dense's limit a point with no fastest: the page crashed
    # on the first (KeyError 'times_us') and named the second's fastest `None`.
    import json

    from blockdiag.tuning import summarize

    # The summary's counts are over the points with a fastest, and the choice's over those
    # where auto's backend was timed too (a --backends run may leave it out): the page says
    # "of" how many, not one count beside "points measured".
    rows = [_bench_row(1, {"bmm": 10.0, "dense": 20.0}), _bench_row(2, {}),
            _bench_row(3, {"bmm": 10.0, "dense": 20.0}, auto="conv"),
            {"mode": "forward", "batch": 99999, "groups": 4, "block_in": 8, "block_out": 8,
             "skipped_point": "30.0 GFLOP > --max-gflop 1"}]
    (tmp_path / "b.json").write_text(json.dumps({"rows": rows, "summary": summarize(rows)}))
    monkeypatch.setattr(hooks, "RESULTS", tmp_path)
    text = hooks.bench_markdown("b.json")
    assert "| points measured | 3 |" in text and "| 2 of 2 |" in text and "| 1.000; 1 of 1 |" in text
    assert "| `bmm` | 2 of 3 | 1.00 (1.00) |" in text and "| `dense` | 0 of 3 | 2.00 (2.00) |" in text
    assert "forward B=99999 G=4 8x8 (30.0 GFLOP > --max-gflop 1)" in text
    assert "| B=2 G=4 8x8 | `bmm` | – | – |" in text and "`None`" not in text


def test_the_mlp_strategy_sentence_counts_auto_running_the_heads_apart(hooks):
    # scripts/bench_mlp_strategy.py times the chain and the layers; where auto runs the heads,
    # its time is neither, and the page counted that point as auto running the (faster) layers.
    rows = [{"auto": "fm_chain", "times_us": {"fm_chain": 1.0, "layers": 2.0}},
            {"auto": "layers", "times_us": {"fm_chain": 1.0, "layers": 1.5}},
            {"auto": "heads", "times_us": {"fm_chain": 2.0, "layers": 1.0}}]
    text = hooks._mlp_auto_sentence(rows, {"points": 3, "auto_ran_the_faster": 2})
    assert "faster of the two at 1 of 2 points" in text and "at most 1.50x" in text
    assert "at 1 point it ran `heads`" in text
    page = hooks.mlp_strategy_markdown("mlp-strategy-cpu-avx512.json")
    assert "faster of the two at 29 of 33 points" in page and "it ran `heads`" in page


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
