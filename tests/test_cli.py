"""The command line: tune / explain / bench on tiny grids (no timings are asserted)."""

import json
import math
import random
import re
import statistics
import subprocess
import sys
import warnings

import pytest
import torch

from blockdiag import profile, tuning
from blockdiag.backends import names
from blockdiag.cli import main
from blockdiag.tuning import Grid, bench, cross_check, derive_settings, measure, merge_entry, peak_memory, summarize, tune

TINY = ["--batch", "4", "--groups", "2,3", "--blocks", "3x2", "--repeat", "1", "--min-time", "0"]


@pytest.fixture(autouse=True)
def _fresh():
    profile.clear_cache()
    yield
    profile.clear_cache()


def test_tune_writes_a_valid_profile_that_auto_uses(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert main(["tune", *TINY, "--profile", str(path)]) == 0
    out = capsys.readouterr()
    assert f"wrote {path}" in out.out and "measured sparsity_threshold" in out.out
    assert "cross-check, train (each point ranked from the others" in out.out
    assert "tune [" in out.err  # the progress bar
    doc, err = profile.read_profile(path)
    assert err is None
    (e,) = doc["entries"].values()
    assert {(m["mode"], m["groups"]) for m in e["measurements"]} == {
        ("forward", 2), ("forward", 3), ("train", 2), ("train", 3)}
    assert all("loop" in m["times_us"] for m in e["measurements"])
    assert e["torch"] == torch.__version__ and e["dtype"] == "float32"
    assert e["allocator_env"] == tuning.allocator_env()
    assert 0.0 <= e["settings"]["sparsity_threshold"] <= 1.0
    # explain reads it back
    assert main(["explain", "--batch", "4", "--groups", "2", "--block", "3x2", "--train",
                 "--profile", str(path)]) == 0
    text = capsys.readouterr().out
    assert "Plan for batch=4 groups=2 block=3x2" in text and f"tuning profile {path}" in text
    assert "measured at this shape, train" in text


def test_tune_merges_with_earlier_runs(tmp_path, capsys):
    path = tmp_path / "p.json"
    main(["tune", *TINY, "--mode", "forward", "--profile", str(path)])
    main(["tune", *TINY, "--mode", "train", "--groups", "2", "--profile", str(path)])
    (e,) = profile.read_profile(path)[0]["entries"].values()
    assert sorted((m["mode"], m["groups"]) for m in e["measurements"]) == [
        ("forward", 2), ("forward", 3), ("train", 2)]


def test_a_narrowed_tune_names_the_backends_auto_will_rank_last(tmp_path, capsys):
    # The entry replaces the built-in table everywhere on this device: a tune of two
    # backends kept auto off every other one, and said nothing.
    path = tmp_path / "p.json"
    assert main(["tune", *TINY, "--mode", "forward", "--backends", "loop,bmm", "--profile", str(path)]) == 0
    note = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: this profile has no times")]
    assert len(note) == 1, note
    named = note[0].split(" for ", 1)[1].split(":", 1)[0].split(", ")
    assert named and "loop" not in named and "bmm" not in named, named
    main(["tune", *TINY, "--mode", "forward", "--profile", str(path)])
    assert "note: this profile has no times" not in capsys.readouterr().out


def test_tune_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "map.png"
    assert main(["tune", *TINY, "--profile", str(tmp_path / "p.json"), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_explain_without_profile_uses_builtin(capsys):
    assert main(["explain", "--batch", "256", "--groups", "50", "--block", "10x10"]) == 0
    out = capsys.readouterr().out
    assert "backend:" in out and "built-in defaults" in out and "sparsity_threshold=" in out


@pytest.mark.parametrize("train", [True, False], ids=["train", "frozen"])
def test_explain_prints_the_plan_of_the_layer_on_the_backends_page(capsys, train):
    # backends.md: "blockdiag explain ... prints the same report" as layer.plan(x). A layer
    # whose parameters require grad plans for training, which explain says with --train only.
    import blockdiag

    layer = blockdiag.GroupedLinear(50 * 150, 50 * 10, groups=50).requires_grad_(train)
    plan = layer.plan(torch.randn(256, 50 * 150))
    argv = ["explain", "--batch", "256", "--groups", "50", "--block", "150x10"] + (["--train"] if train else [])
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith(str(plan) + "\n")


def test_bench_json(tmp_path, capsys, monkeypatch):
    out_json = tmp_path / "b.json"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert main(["bench", *TINY, "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "a/best" in printed and "forward:" in printed and "train:" in printed
    doc = json.loads(out_json.read_text())
    assert set(doc["summary"]) == {"forward", "train"}
    assert len(doc["rows"]) == 4
    assert doc["complete"] is True and doc["points_done"] == doc["points_total"] == 4
    for r in doc["rows"]:
        assert r["auto"] in names() and r["auto"] not in r["skipped"]
        # The derived columns follow from the recorded times (each rounded on its own).
        assert r["times_us"][r["fastest"]] == min(r["times_us"].values())
        # (ratios are rounded to 4 decimals, times to 1 ns)
        fastest_us = r["times_us"][r["fastest"]]
        assert r["auto_over_fastest"] == pytest.approx(r["auto_us"] / fastest_us, rel=2e-3, abs=1e-4)
        assert r["fraction_of_ideal"] == pytest.approx(r["ideal_us"] / r["auto_us"], rel=2e-3, abs=1e-4)
        assert set(r["baselines_us"]) == {"nn_linear_loop", "vmap"}
        assert set(r["peak_bytes"]) == set(r["times_us"]) and all(v > 0 for v in r["peak_bytes"].values())
    for mode, s in doc["summary"].items():
        ratios = [r["auto_over_fastest"] for r in doc["rows"] if r["mode"] == mode]
        assert s["points"] == len(ratios) == 2
        assert s["within_1.10"] == sum(x <= 1.10 for x in ratios)
        assert s["max_auto_over_fastest"] == max(ratios)
        assert s["geomean_auto_over_fastest"] == pytest.approx((ratios[0] * ratios[1]) ** 0.5, abs=1e-4)
    assert "geomean_speedup_vs_vmap" in doc["summary"]["train"]
    # The allocator settings in force are recorded with the times they affect.
    assert doc["allocator_env"]["GLIBC_TUNABLES"] == "glibc.malloc.mmap_max=0"
    assert "LD_PRELOAD" not in doc["allocator_env"]


def test_bench_skips_huge_points_and_says_so(capsys):
    # B=4 G=2 3x2 is 9.6e-8 GFLOP, G=3 1.44e-7: the larger is skipped (all skipped: refused).
    assert main(["bench", *TINY, "--mode", "forward", "--max-gflop", "1.2e-7", "--no-baselines"]) == 0
    assert capsys.readouterr().out.count("skipped:") == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "--batch", "4", "--groups", "2", "--block", "10"],
         "blockdiag explain: error: argument --block: a block is IN x OUT such as 150x10, got '10'"),
        (["explain", "--batch", "0", "--groups", "2", "--block", "3x2"],
         "blockdiag explain: error: argument --batch: must be a positive int, got 0"),
        (["bench", "--dtype", "float99"],
         "blockdiag bench: error: argument --dtype: must be one of float32, float64, float16, bfloat16, "
         "got 'float99'"),
        (["tune", "--quick", "--full"],
         "blockdiag tune: error: argument --full: not allowed with argument --quick"),
        (["tune", "--blocks", "3x0"],
         "blockdiag tune: error: argument --blocks: block sizes must be positive, got '3x0'"),
        # argparse words the list of choices differently across Python versions
        (["bench", "--mode", "sideways"],
         "blockdiag bench: error: argument --mode: invalid choice: 'sideways'"),
    ],
    ids=["block-not-AxB", "batch-zero", "dtype", "quick-and-full", "zero-block", "mode"],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("cmd", ["bench", "tune"])
def test_unknown_backend_lists_valid_ones(tmp_path, capsys, cmd):
    extra = ["--profile", str(tmp_path / "p.json")] if cmd == "tune" else []
    assert main([cmd, *TINY, *extra, "--backends", "nope"]) == 2
    err = capsys.readouterr().err
    assert f"blockdiag {cmd}: error: --backends: unknown backend 'nope'; valid names are" in err
    assert "'bmm_fm'" in err and "'auto'" not in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()
    assert main([cmd, *TINY, *extra, "--backends", "loop,auto"]) == 2
    assert "'auto' is the choice among the backends" in capsys.readouterr().err


def test_measure_reports_failures_and_prunes():
    calls = {"slow": 0}

    def slow():
        calls["slow"] += 1
        sum(range(20000))

    def broken():
        raise RuntimeError("not implemented here")

    times, failed = measure({"fast": lambda: None, "slow": slow, "broken": broken}, "cpu", rounds=4, min_time=0.0)
    assert set(times) == {"fast", "slow"} and "not implemented here" in failed["broken"]
    # Warm-up, the calibration run timed twice (a single slow call may be a stall), the
    # second round's sample; then pruned after two rounds.
    assert calls["slow"] == 4


@pytest.mark.parametrize("min_time", [0.0, 1e-2])
def test_measure_never_times_a_steps_first_call(monkeypatch, min_time):
    # A step's first call can do one-time work (auto's plan, simd's library build and
    # self-check): measure makes it untimed, so no sample holds it. On a scripted clock that
    # only the steps move, the first call of "cold" costs 1000 s and every later call 1 ms.
    from types import SimpleNamespace

    from blockdiag.tuning import _timer

    now = [0.0]
    monkeypatch.setattr(_timer, "time", SimpleNamespace(perf_counter=lambda: now[0], monotonic=lambda: now[0]))
    calls = {"cold": 0}

    def cold():
        calls["cold"] += 1
        now[0] += 1000.0 if calls["cold"] == 1 else 1e-3

    def warm():
        now[0] += 2e-3

    taken = {}
    times, failed = measure({"cold": cold, "warm": warm}, "cpu", rounds=3, min_time=min_time, keep=("cold",),
                            per_round=taken)
    assert not failed and times["cold"] == pytest.approx(1e-3) and times["warm"] == pytest.approx(2e-3)
    assert taken["cold"] == pytest.approx([1e-3] * len(taken["cold"]))


@pytest.mark.skipif(sys.platform == "win32", reason="the platform does not count page faults")
def test_measure_counts_page_faults_per_call():
    import mmap

    def fresh_pages():
        # 1 MB of anonymous memory the kernel faults in page by page, then hands back.
        m = mmap.mmap(-1, 1 << 20)
        for off in range(0, 1 << 20, mmap.PAGESIZE):
            m[off] = 1
        m.close()

    kept = bytearray(1 << 20)

    def same_pages():
        for off in range(0, 1 << 20, mmap.PAGESIZE):
            kept[off] = 1

    faults: dict = {}
    times, _ = measure({"fresh": fresh_pages, "same": same_pages}, "cpu", rounds=3, min_time=0.0, faults=faults)
    assert set(faults) == set(times) == {"fresh", "same"}
    pages = (1 << 20) // mmap.PAGESIZE
    # Fault-around or huge pages can map a few pages per fault, never none.
    assert faults["fresh"] >= pages / 16 and faults["same"] < 1
    assert measure({"same": same_pages}, "cpu", rounds=1, min_time=0.0)[0].keys() == {"same"}  # faults optional


def test_measure_hands_back_every_sample_in_round_order():
    # Steps tied within refine (and the refine_also ones) get as many rounds again; a step
    # pruned after two rounds keeps its two samples; index r is round r for every step.
    # "a" is kept: two no-ops timed on a loaded machine can differ 7-fold, which pruned it.
    def slow():
        sum(range(200000))

    per_round: dict = {}
    times, _ = measure({"a": lambda: None, "b": lambda: None, "slow": slow}, "cpu", rounds=4, min_time=0.0,
                       prune=3.0, keep=("a",), refine=0.5, refine_also=("a",), per_round=per_round)
    assert set(per_round) == {"a", "b", "slow"}
    assert len(per_round["slow"]) == 2 and len(per_round["a"]) == 8
    for name, t in times.items():
        assert t == statistics.median(per_round[name])
    assert all(v > 0 for vs in per_round.values() for v in vs)


@pytest.mark.parametrize("n", range(1, 41))
def test_median_interval_is_the_sign_tests_widest_rank_at_the_level(n):
    # Coverage of (x_(j), x_(n+1-j)) for the median of any continuous distribution is
    # 1 - 2 P(Binomial(n, 1/2) <= j - 1); the interval is the narrowest with >= 95%.
    from blockdiag.tuning import median_interval

    def coverage(j):
        return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n

    values = [float(v) for v in random.Random(n).sample(range(1000), n)]
    ranked = sorted(values)
    got = median_interval(values)
    ok = [j for j in range(1, n // 2 + 1) if coverage(j) >= 0.95]
    if not ok:
        assert got is None and n < 6
    else:
        j = max(ok)
        assert got == (ranked[j - 1], ranked[n - j])
    assert median_interval(values, level=0.5) is not None or n == 1


def test_median_interval_ignores_one_stall_and_checks_its_level():
    from blockdiag import BlockDiagError
    from blockdiag.tuning import median_interval

    ratios = [1.01, 0.99, 1.02, 1.00, 0.98, 1.03, 1.00, 0.97, 1.01, 1.04]
    base = median_interval(ratios)
    assert base == (0.98, 1.03)
    # One sample stalled 100x (a page-in, another job) widens a normal interval past any
    # verdict; it moves this one to the next order statistic at most.
    assert median_interval(ratios[:-1] + [104.0]) == (0.98, 1.03)
    for level in (0.0, 1.0, -0.5, 95):
        with pytest.raises(BlockDiagError, match=rf"median_interval: level must be in \(0, 1\), got {level!r}"):
            median_interval(ratios, level=level)


def test_measure_records_exceptions_of_any_type():
    # A kernel library's own error class (Triton's OutOfResources derives from Exception
    # alone) is one backend's failure, not the end of the tune.
    class LibraryError(Exception):
        pass

    def broken():
        raise LibraryError("out of resource: shared memory")

    times, failed = measure({"ok": lambda: None, "broken": broken}, "cpu", rounds=2, min_time=0.0)
    assert set(times) == {"ok"} and failed["broken"] == "LibraryError: out of resource: shared memory"


def test_a_single_stall_does_not_prune_the_fastest():
    import time as _time

    calls = {"flaky": 0, "other": 0}

    def step(name, stall_on=None):
        # Each call sleeps 1 ms so that the two steps' times are equal within the sleep's
        # jitter: two empty steps, timed at a fraction of a microsecond, differ by more than
        # the prune factor by chance, and that made this test flaky.
        def run():
            calls[name] += 1
            _time.sleep(0.02 if calls[name] == stall_on else 0.001)

        return run

    # The flaky step's first timed call stalls (the old rule, pruning on the first sample,
    # dropped it); it is as fast as the other step, so it must be timed in every round.
    times, _ = measure({"other": step("other"), "flaky": step("flaky", stall_on=2)}, "cpu", rounds=4, min_time=0.0)
    assert calls["flaky"] == calls["other"] == 6
    assert times["flaky"] < 0.01


def test_near_ties_get_more_rounds_and_clear_winners_do_not(monkeypatch):
    import types

    from blockdiag.tuning import _timer

    # A virtual clock that only the steps move: the ties below are exact on any machine
    # (real sleeps of 5 ms drifted apart by more than the margin on a loaded one).
    now = [0.0]
    monkeypatch.setattr(_timer, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    calls = {"a": 0, "b": 0, "slow": 0}

    def step(name, seconds):
        def run():
            calls[name] += 1
            now[0] += seconds

        return run

    # "a" and "b" take the same 5 ms (within any margin of each other); "slow" takes 40 ms.
    steps = {"a": step("a", 0.005), "b": step("b", 0.005), "slow": step("slow", 0.04)}
    measure(steps, "cpu", rounds=3, min_time=0.0, prune=0, refine=0.5)
    # Warm-up, the calibration run timed twice (it is round 0's sample), 2 more rounds; then
    # the tied pair alone gets 3 more rounds.
    assert calls == {"a": 8, "b": 8, "slow": 5}
    calls.update(a=0, b=0, slow=0)
    measure(steps, "cpu", rounds=3, min_time=0.0, prune=0, refine=0.0)
    assert calls == {"a": 5, "b": 5, "slow": 5}
    calls.update(a=0, b=0, slow=0)
    # A kept step (a reference in bench) is never a contender, so "b" alone has no tie.
    measure(steps, "cpu", rounds=3, min_time=0.0, prune=0, refine=0.5, keep=("a",))
    assert calls == {"a": 5, "b": 5, "slow": 5}
    calls.update(a=0, b=0, slow=0)
    # refine_also brings a kept step and a far one into the extra rounds (bench's auto and
    # its references), and a name that is not a step is ignored.
    measure(steps, "cpu", rounds=3, min_time=0.0, prune=0, refine=0.5, keep=("a",), refine_also=("a", "slow", "nope"))
    assert calls == {"a": 8, "b": 8, "slow": 8}
    calls.update(a=0, b=0, slow=0)
    measure(steps, "cpu", rounds=3, min_time=0.0, prune=0, refine=0.0, refine_also=("slow",))
    assert calls == {"a": 5, "b": 5, "slow": 5}  # refine off: no extra rounds at all


def test_derive_settings_finds_the_sparse_crossover():
    def m(g, best):
        return {"mode": "forward", "batch": 8, "groups": g, "block_in": 4, "block_out": 4,
                "times_us": {best: 1.0, "loop": 2.0 if best != "loop" else 0.5}}

    assert derive_settings([m(2, "loop"), m(16, "csr"), m(64, "csr")])["sparsity_threshold"] == pytest.approx(15 / 16)
    assert derive_settings([m(2, "loop"), m(16, "loop"), m(64, "csr")])["sparsity_threshold"] == pytest.approx(63 / 64)
    assert derive_settings([m(2, "csr"), m(64, "loop")])["sparsity_threshold"] == 1.0
    d = derive_settings([m(4, "dense"), m(8, "dense"), m(64, "loop")])
    assert (d["dense_max_groups"], d["dense_max_elements"]) == (8, 64 * 16)


def test_merge_entry_keeps_other_points():
    old = {"measurements": [{"mode": "forward", "batch": 1, "groups": 2, "block_in": 1, "block_out": 1,
                             "times_us": {"loop": 1.0}}]}
    new = tune(Grid((1,), (3,), ((1, 1),)), modes=("forward",), backends=["loop"], rounds=1, min_time=0.0)
    merged = merge_entry(old, new)
    assert sorted(m["groups"] for m in merged["measurements"]) == [2, 3]
    # Each run's description survives the merge, with the points it measured.
    old["rounds"], old["created"] = 7, "2026-01-01T00:00:00+00:00"
    merged = merge_entry(old, new)
    assert merged["rounds"] == 1 and [r["rounds"] for r in merged["runs"]] == [7, 1]
    assert merged["runs"][0]["created"] == "2026-01-01T00:00:00+00:00"
    assert merged["runs"][0]["points"] == ["forward B=1 G=2 1x1"] and merged["runs"][1]["points"] == ["forward B=1 G=3 1x1"]
    again = merge_entry(merged, new)
    assert [r["rounds"] for r in again["runs"]] == [7, 1, 1]
    assert len(merge_entry({**merged, "runs": merged["runs"] * 40}, new)["runs"]) == tuning.MAX_RUNS


def test_peak_memory_counts_temporaries():
    x = torch.randn(64, 64)
    # one 16 KiB product alive at a time, plus the 16 KiB sum: at least 32 KiB
    assert peak_memory(lambda: (x @ x) + (x @ x)) >= 2 * 64 * 64 * 4
    assert peak_memory(lambda: None) == 0


def test_bench_api_and_summary():
    rows = bench(Grid((4,), (2,), ((3, 2),)), modes=("train",), rounds=1, min_time=0.0, baselines=False,
                 memory=False, backends=["loop", "bmm"])
    (r,) = rows
    assert set(r["times_us"]) == {"loop", "bmm"}
    assert r["times_us"][r["fastest"]] == min(r["times_us"].values())
    fastest_us = r["times_us"][r["fastest"]]
    assert r["auto_over_fastest"] == pytest.approx(r["auto_us"] / fastest_us, rel=2e-3, abs=1e-4)
    s = summarize(rows)["train"]
    assert s["points"] == 1 and s["within_1.10"] == int(r["auto_over_fastest"] <= 1.10)
    assert s["max_auto_over_fastest"] == s["geomean_auto_over_fastest"] == r["auto_over_fastest"]
    # The choice alone (the chosen backend's forced time over the fastest's), scored only
    # where the choice was one of the backends timed.
    if r["auto"] in r["times_us"]:
        chosen = r["times_us"][r["auto"]] / r["times_us"][r["fastest"]]
        assert s["geomean_choice_over_fastest"] == pytest.approx(chosen, abs=1e-4)
        assert s["choice_within_1.10"] == int(chosen <= 1.10)
        # What choosing costs: auto over the same backend forced by name.
        assert r["auto_over_choice"] == pytest.approx(r["auto_us"] / r["times_us"][r["auto"]], rel=2e-3, abs=1e-4)
        assert s["geomean_auto_over_choice"] == r["auto_over_choice"]
    else:
        assert "geomean_choice_over_fastest" not in s and "choice_within_1.10" not in s
        assert "auto_over_choice" not in r and "geomean_auto_over_choice" not in s


def test_bench_refines_auto_and_what_it_is_compared_with(monkeypatch, tmp_path):
    from _profiles import entry, point, write

    from blockdiag import config
    from blockdiag.backends import Problem
    from blockdiag.dispatch import builtin_plan

    seen = {}
    real = tuning.measure

    def spy(steps, device, rounds, min_time, **kw):
        seen.update(kw)
        return real(steps, device, rounds, min_time, **kw)

    monkeypatch.setattr(tuning, "measure", spy)
    (r,) = bench(Grid((4,), (2,), ((3, 2),)), modes=("forward",), rounds=1, min_time=0.0, memory=False, refine=0.2)
    assert seen["refine"] == 0.2
    assert set(seen["refine_also"]) == {"auto", "auto_kernel", r["auto"], "nn_linear_loop"}
    bench(Grid((4,), (2,), ((3, 2),)), modes=("forward",), rounds=1, min_time=0.0, memory=False)
    assert seen["refine"] == tuning.BENCH_REFINE
    # Under a profile, the built-in table's choice is refined too (both sides of its verdict).
    builtin = builtin_plan(Problem(4, 2, 3, 2)).backend
    other = "loop" if builtin != "loop" else "bmm"
    path = write(tmp_path / "p.json", entry([point("forward", 4, 2, 3, 2, **{other: 1.0, builtin: 50.0})]))
    with config(profile=str(path)):
        (r,) = bench(Grid((4,), (2,), ((3, 2),)), modes=("forward",), rounds=1, min_time=0.0, memory=False)
    assert r["auto"] == other and r["builtin_choice"] == builtin
    assert set(seen["refine_also"]) == {"auto", "auto_kernel", other, builtin, "nn_linear_loop"}


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "blockdiag", "explain", "--batch", "8", "--groups", "4",
                        "--block", "4x4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Plan for batch=8 groups=4" in r.stdout


def test_bench_defaults_to_the_target_grid_and_tune_full_adds_wide_blocks():
    from blockdiag.cli import build_parser
    from blockdiag.cli._args import _grid
    from blockdiag.tuning import BENCH_GRID, GRIDS

    p = build_parser()
    assert _grid(p.parse_args(["bench"]), "targets") == BENCH_GRID
    full = _grid(p.parse_args(["tune", "--full"]), "quick")
    assert full == GRIDS["full"] and set(full.blocks) - set(BENCH_GRID.blocks) == {(10, 150), (64, 256), (32, 32)}
    assert _grid(p.parse_args(["bench", "--blocks", "3x2"]), "targets").blocks == ((3, 2),)


def _m(mode="train", batch=256, groups=50, **times):
    return {"mode": mode, "batch": batch, "groups": groups, "block_in": 10, "block_out": 10, "times_us": times}


def test_cross_check_ranks_each_point_from_the_others():
    # Along batch, loop wins at the ends and bmm in the middle: leaving out the middle
    # point, its neighbours say loop, which was 2x slower there.
    e = {"device": "cpu", "dtype": "float32", "settings": {},
         "measurements": [_m(batch=32, loop=1.0, bmm=2.0), _m(batch=256, loop=2.0, bmm=1.0),
                          _m(batch=2048, loop=1.0, bmm=2.0), _m(mode="forward", loop=1.0)]}
    c = cross_check(e)
    assert set(c) == {"train"}  # one forward point: nothing to rank it from
    t = c["train"]
    # The end points are ranked mostly from the middle one, and get it wrong too.
    assert t["points"] == 3 and t["worst"] == 2.0 and t["within_1.10"] == 0
    assert t["geomean"] == pytest.approx(2.0)


def test_cross_check_respects_the_settings():
    # dense is fastest but excluded by dense_max_groups=0: it is never the "chosen" one,
    # nor the fastest it is compared with.
    e = {"device": "cpu", "dtype": "float32", "settings": {"dense_max_groups": 0},
         "measurements": [_m(batch=32, dense=0.1, loop=1.0, bmm=2.0), _m(batch=256, dense=0.1, loop=1.0, bmm=2.0)]}
    t = cross_check(e)["train"]
    assert t["geomean"] == 1.0 and t["within_1.10"] == 2


def test_summary_scores_the_choice_alone():
    def row(auto, **t):
        return {"mode": "train", "batch": 4, "groups": 2, "block_in": 3, "block_out": 2, "times_us": t,
                "auto": auto, "fastest": min(t, key=t.get), "auto_us": 9.0, "auto_over_fastest": 9.0 / min(t.values()),
                "fraction_of_ideal": 0.5}
    s = summarize([row("bmm", loop=1.0, bmm=2.0), row("loop", loop=1.0, bmm=2.0), row("dense", loop=1.0)])["train"]
    # The third row's choice was not timed forced: it is left out, not counted as right.
    assert s["geomean_choice_over_fastest"] == pytest.approx(2 ** 0.5, abs=1e-4) and s["choice_within_1.10"] == 1
    assert s["within_1.10"] == 0  # auto's own 9.0 us against 1.0 us


def test_summary_scores_the_profile_against_the_builtin_table():
    def row(auto, builtin=None, **t):
        r = {"mode": "train", "batch": 4, "groups": 2, "block_in": 3, "block_out": 2, "times_us": t,
             "auto": auto, "fastest": min(t, key=t.get), "auto_us": 9.0, "auto_over_fastest": 9.0 / min(t.values()),
             "fraction_of_ideal": 0.5}
        if builtin is not None:
            r["builtin_choice"] = builtin
        return r

    rows = [row("loop", "bmm", loop=1.0, bmm=4.0), row("bmm", "bmm", loop=1.0, bmm=2.0),
            row("loop", "dense", loop=1.0, bmm=2.0)]  # dense not timed: left out
    s = summarize(rows)["train"]
    assert s["geomean_builtin_choice_over_fastest"] == pytest.approx((4.0 * 2.0) ** 0.5, abs=1e-4)
    assert s["builtin_choice_within_1.10"] == 0
    # profile's choice over the built-in's: 1/4 at the first row, 1 at the second
    assert s["geomean_choice_over_builtin_choice"] == pytest.approx(0.5, abs=1e-4)
    assert s["choices_differing_from_builtin"] == 2
    # Without a profile (no builtin_choice in any row) none of these keys appear.
    plain = summarize([row("loop", loop=1.0, bmm=2.0)])["train"]
    assert not any("builtin" in k for k in plain)


def test_bench_under_a_profile_times_the_builtin_choice_too(tmp_path, capsys):
    from _profiles import entry, point, write

    from blockdiag.backends import Problem
    from blockdiag.dispatch import builtin_plan, choose

    # A profile that sends this point to bmm; the built-in table decides for itself.
    path = write(tmp_path / "p.json", entry([point("train", 4, 2, 3, 2, bmm=1.0, loop=50.0),
                                             point("forward", 4, 2, 3, 2, bmm=1.0, loop=50.0)]))
    assert main(["bench", *TINY, "--groups", "2", "--no-baselines",
                 "--profile", str(path), "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "b.json").read_text())
    for r in doc["rows"]:
        p = Problem(4, 2, 3, 2, requires_grad=r["mode"] == "train")
        assert r["auto"] == "bmm" and r["table"] == f"tuning profile {path}"
        assert r["builtin_choice"] == builtin_plan(p).backend
        s = doc["summary"][r["mode"]]
        b = r["times_us"][r["builtin_choice"]]
        assert s["geomean_choice_over_builtin_choice"] == pytest.approx(r["times_us"]["bmm"] / b, rel=2e-3, abs=1e-4)
        block = out.split(f"\n{r['mode']}:\n", 1)[1]  # the mode's labelled summary
        assert "the profile's choice over the built-in one, geometric mean" in block.split("\n\n")[0]
        b_best = f"{b / r['times_us'][r['fastest']]:6.2f}"
        assert any(ln.startswith(r["mode"]) and ln.endswith(f" {r['builtin_choice']:>11s} {b_best}")
                   for ln in out.splitlines())
    # Without the profile, auto is the built-in table and no comparison is made.
    p = Problem(4, 2, 3, 2)
    assert choose(p).backend == builtin_plan(p).backend
    assert main(["bench", *TINY, "--groups", "2", "--mode", "forward", "--no-baselines",
                 "--json", str(tmp_path / "c.json")]) == 0
    (r,) = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert r["table"] == "built-in defaults" and "builtin_choice" not in r
    assert "against the built-in table's" not in capsys.readouterr().out


def _scripted_measure(monkeypatch, first, second):
    """``tuning.measure`` returning ``first`` on the grid pass and ``second`` in rematches."""
    calls = []

    def fake(steps, device, rounds, min_time, prune=3.0, keep=(), stat="median", refine=0.0, refine_also=()):
        calls.append((sorted(steps), rounds))
        table = first if len(calls) == 1 else second
        return {n: table[n] * 1e-6 for n in steps}, {}

    monkeypatch.setattr(tuning, "measure", fake)
    return calls


def _prior(fastest):
    # A table measured at the tuned shape itself, ranking ``fastest`` first.
    times = {"loop": 5.0, "bmm": 5.0, fastest: 1.0}
    return {"device_name": "other machine", "measurements": [
        {"mode": "forward", "batch": 4, "groups": 2, "block_in": 3, "block_out": 2, "times_us": times}]}


TINY_GRID = Grid((4,), (2,), ((3, 2),))


@pytest.mark.parametrize("second, kept", [({"loop": 3.0, "bmm": 2.0}, "bmm"), ({"loop": 1.5, "bmm": 2.0}, "loop")],
                         ids=["overturned", "confirmed"])
def test_tune_rematches_a_winner_the_prior_table_disputes(monkeypatch, second, kept):
    calls = _scripted_measure(monkeypatch, {"loop": 1.0, "bmm": 2.0}, second)
    e = tune(TINY_GRID, modes=("forward",), backends=["loop", "bmm"], rounds=3, min_time=0.0, prior=_prior("bmm"))
    (m,) = e["measurements"]
    # The rematch times exactly the disputed pair, with more rounds than the grid pass.
    assert calls == [(["bmm", "loop"], 3), (["bmm", "loop"], 3 * tuning.REMATCH_ROUNDS_FACTOR)]
    # The rematch's ratio at the first pass's level: the pair's faster gets the winner's 1.0.
    scale = 1.0 / min(second.values())
    assert m["times_us"] == pytest.approx({n: t * scale for n, t in second.items()}, abs=1e-3)
    assert min(m["times_us"], key=m["times_us"].get) == kept
    assert m["rematch"] == {"first_us": {"loop": 1.0, "bmm": 2.0}, "rematch_us": second, "kept": kept}
    assert e["rematched"] == {"points": 1, "overturned": int(kept == "bmm"), "prior": "other machine",
                              "rounds": 3 * tuning.REMATCH_ROUNDS_FACTOR}


def test_a_slower_rematch_does_not_hand_the_point_to_a_third_backend(monkeypatch):
    # First pass: loop 1.0, dense 1.05, bmm 2.0. The rematch confirms loop ahead of bmm by
    # the same ratio, but on a machine running 1.5x slower: unscaled, loop's 1.5 would put
    # dense (never rematched) first.
    _scripted_measure(monkeypatch, {"loop": 1.0, "dense": 1.05, "bmm": 2.0}, {"loop": 1.5, "bmm": 3.0})
    e = tune(TINY_GRID, modes=("forward",), backends=["loop", "bmm", "dense"], rounds=3, min_time=0.0,
             prior=_prior("bmm"))
    (m,) = e["measurements"]
    assert m["times_us"] == pytest.approx({"loop": 1.0, "dense": 1.05, "bmm": 2.0}, abs=1e-3)
    assert min(m["times_us"], key=m["times_us"].get) == "loop"


def test_a_rematch_finding_a_near_tie_does_not_hand_the_point_to_a_third_backend(monkeypatch):
    # First pass: loop 1.0, dense 1.2, bmm 2.0; the rematch finds bmm 1% ahead of loop. Scaled
    # to keep the pair's geometric mean (1.41), both landed above dense, which the table then
    # chose though both passes ranked it behind the pair's winner (17 points of the shipped
    # table, where the recorded "kept" was not the backend auto ran).
    _scripted_measure(monkeypatch, {"loop": 1.0, "dense": 1.2, "bmm": 2.0}, {"loop": 1.01, "bmm": 1.0})
    e = tune(TINY_GRID, modes=("forward",), backends=["loop", "bmm", "dense"], rounds=3, min_time=0.0,
             prior=_prior("bmm"))
    (m,) = e["measurements"]
    assert m["times_us"] == pytest.approx({"loop": 1.01, "dense": 1.2, "bmm": 1.0}, abs=1e-3)
    assert min(m["times_us"], key=m["times_us"].get) == m["rematch"]["kept"] == "bmm"


def test_a_backend_failing_in_the_rematch_leaves_the_first_pass_times(monkeypatch):
    # First pass: loop 1.0, dense 1.05, bmm 2.0; in the rematch loop raises and bmm is timed
    # alone, on a machine running faster meanwhile. Nothing compared the two then: bmm's lone
    # time (written as it was, or scaled to loop's level) put it ahead of loop and dense,
    # which both passes had ranked ahead of it.
    calls = []

    def fake(steps, device, rounds, min_time, prune=3.0, keep=(), stat="median", refine=0.0, refine_also=()):
        calls.append(sorted(steps))
        if len(calls) == 1:
            return {n: t * 1e-6 for n, t in {"loop": 1.0, "dense": 1.05, "bmm": 2.0}.items()}, {}
        return {"bmm": 0.5e-6}, {"loop": "RuntimeError: out of memory"}

    monkeypatch.setattr(tuning, "measure", fake)
    e = tune(TINY_GRID, modes=("forward",), backends=["loop", "bmm", "dense"], rounds=3, min_time=0.0,
             prior=_prior("bmm"))
    (m,) = e["measurements"]
    assert len(calls) == 2
    assert m["times_us"] == pytest.approx({"loop": 1.0, "dense": 1.05, "bmm": 2.0}, abs=1e-3)
    assert m["rematch"]["kept"] == "loop" and m["rematch"]["rematch_us"] == {"bmm": 0.5}


def test_tune_does_not_rematch_where_the_prior_measured_none_of_the_backends(monkeypatch):
    # A prior table with no times for the backends tuned here (backends registered since, or
    # `tune --backends` naming others) has no choice to dispute the winner with: rematching
    # "None" against it failed the whole tune.
    calls = _scripted_measure(monkeypatch, {"loop": 1.0, "bmm": 2.0}, None)
    prior = {"device_name": "other machine", "measurements": [
        {"mode": "forward", "batch": 4, "groups": 2, "block_in": 3, "block_out": 2, "times_us": {"dense": 1.0}}]}
    e = tune(TINY_GRID, modes=("forward",), backends=["loop", "bmm"], rounds=3, min_time=0.0, prior=prior)
    assert len(calls) == 1 and e["rematched"]["points"] == 0 and "rematch" not in e["measurements"][0]


def test_the_builtin_tables_rematched_points_choose_what_the_rematch_kept():
    table = json.loads(profile.DEFAULTS_PATH.read_text())
    for key, e in table["entries"].items():
        for m in e["measurements"]:
            if "rematch" in m:
                fastest = min(m["times_us"], key=m["times_us"].get)
                assert fastest == m["rematch"]["kept"], (key, m)


def test_tune_does_not_rematch_where_the_prior_agrees_or_when_told_not_to(monkeypatch):
    calls = _scripted_measure(monkeypatch, {"loop": 1.0, "bmm": 2.0}, None)
    e = tune(TINY_GRID, modes=("forward",), backends=["loop", "bmm"], rounds=3, min_time=0.0, prior=_prior("loop"))
    assert len(calls) == 1 and e["rematched"]["points"] == 0 and "rematch" not in e["measurements"][0]
    calls = _scripted_measure(monkeypatch, {"loop": 1.0, "bmm": 2.0}, None)
    e = tune(TINY_GRID, modes=("forward",), backends=["loop", "bmm"], rounds=3, min_time=0.0,
             prior=_prior("bmm"), rematch=False)
    assert len(calls) == 1 and "rematched" not in e


def test_tune_rematch_defaults_to_the_builtin_table(monkeypatch):
    seen = []
    monkeypatch.setattr(tuning, "_rematch_all", lambda ms, prior, *a: seen.append(prior) or {"points": 0})
    tune(TINY_GRID, modes=("forward",), backends=["loop"], rounds=1, min_time=0.0)
    assert seen == [profile.builtin_entry("cpu", torch.float32)] and seen[0] is not None


def test_prior_choice_only_ranks_backends_measured_here():
    m = {"mode": "forward", "batch": 4, "groups": 2, "block_in": 3, "block_out": 2, "times_us": {"loop": 1.0}}
    assert tuning.prior_choice(m, _prior("bmm")) == "loop"
    assert tuning.prior_choice(m, {"measurements": []}) is None


def test_tune_cli_rematches_against_the_earlier_profile(tmp_path, capsys):
    path = tmp_path / "p.json"
    main(["tune", *TINY, "--mode", "forward", "--profile", str(path)])
    out = capsys.readouterr().out
    builtin = profile.builtin_entry("cpu", torch.float32)["device_name"]
    assert f"winner was not the earlier table's choice ({builtin})" in out and "overturned" in out
    main(["tune", *TINY, "--mode", "forward", "--profile", str(path)])
    assert f"winner was not the earlier table's choice ({profile.device_name('cpu')})" in capsys.readouterr().out
    main(["tune", *TINY, "--mode", "forward", "--no-rematch", "--profile", str(path)])
    assert "rematched " not in capsys.readouterr().out


@pytest.mark.parametrize(
    "cmd, option, ext",
    [pytest.param("bench", "--json", "json", id="bench-json"), pytest.param("tune", "--plot", "png", id="tune-plot")],
)
def test_an_unwritable_output_is_refused_before_measuring(cmd, option, ext, tmp_path, capsys, monkeypatch):
    # Found after the whole run, a bad path would lose every measurement.
    from blockdiag import tuning

    monkeypatch.setattr(tuning, "measure", lambda *a, **k: pytest.fail("measured before checking the output"))
    missing = tmp_path / "no" / f"out.{ext}"
    assert main([cmd, *TINY, option, str(missing), "--profile", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert f"blockdiag {cmd}: error: {option}: the directory {missing.parent} of {str(missing)!r} does not exist" in err


def test_bench_compiled_json_and_failures_recorded_per_row(tmp_path, capsys, monkeypatch):
    # --compiler aot_eager: dynamo and AOTAutograd trace the same graphs as inductor without
    # generating code (seconds, not minutes, on 2 cores); asv's smoke run compiles with
    # inductor (asv_bench/benchmarks/compiled.py). At G=3 the compiled vmap peer raises and the
    # compiled loop of heads returns a wrong result: both are recorded in their rows, the run
    # goes on, and that point has no compiled peer to compare with.
    real_compile = torch.compile

    def compile_(mod, **kw):
        compiled = real_compile(mod, **kw)
        if isinstance(mod, tuning._VmapEnsemble) and mod.groups == 3:
            def fails(x):
                raise RuntimeError("backend='x' raised:\nboom\nmore")
            return fails
        if isinstance(mod, tuning._HeadsLoop) and len(mod.heads) == 3:
            return lambda x: compiled(x) * 2
        return compiled

    monkeypatch.setattr(torch, "compile", compile_)
    out_json = tmp_path / "c.json"
    assert main(["bench", *TINY, "--compiled", "--compiler", "aot_eager", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "c/eager" in printed and "c/peer" in printed and "ctl c/e" in printed and "wrong" in printed
    assert "failed: train linear B=4 G=3 3x2 vmap_compiled: RuntimeError: backend='x' raised: boom" in printed
    assert "\ntrain all:\n" in printed and "the project's compiled-mode targets:" in printed.split("\ntrain all:\n")[1]
    doc = json.loads(out_json.read_text())
    assert doc["compiled"] == {"models": ["linear", "mlp"], "compiler": "aot_eager", "dynamic": False}
    rows = doc["rows"]
    # --mode defaults to train with --compiled; each point has a GroupedLinear and a GroupedMLP row.
    assert [(r["mode"], r["model"], r["groups"]) for r in rows] == [
        ("train", "linear", 2), ("train", "mlp", 2), ("train", "linear", 3), ("train", "mlp", 3)]
    for r in rows:
        t = r["times_us"]
        assert r["compiled_over_eager"]["auto"] == pytest.approx(t["auto_compiled"] / t["auto"], rel=2e-3, abs=1e-4)
        assert r["compile_s"]["auto_compiled"] > 0 and r["graphs"]["auto_compiled"] >= 1
        # The control (plain layers, same input and FLOPs) ran eager and compiled at every point.
        assert r["control_compiled_over_eager"] == pytest.approx(
            t["control_compiled"] / t["control"], rel=2e-3, abs=1e-4)
        if r["groups"] == 2:
            assert r["failed"] == {} and set(t) == {
                "auto", "auto_compiled", "loop", "loop_compiled", "vmap", "vmap_compiled", "control", "control_compiled"}
            assert t[r["best_peer"]] == min(t["loop_compiled"], t["vmap_compiled"])
            assert r["compiled_over_best_peer"]["auto"] == pytest.approx(
                t["auto_compiled"] / t[r["best_peer"]], rel=2e-3, abs=1e-4)
            for peer in ("loop", "vmap"):
                assert r["peer_compiled_over_eager"][f"{peer}_compiled"] == pytest.approx(
                    t[f"{peer}_compiled"] / t[peer], rel=2e-3, abs=1e-4)
        else:
            # The peers ran eager (their compiled forms failed): no compiled over eager for them.
            assert set(r["failed"]) == {"loop_compiled", "vmap_compiled"}
            assert set(t) == {"auto", "auto_compiled", "loop", "vmap", "control", "control_compiled"}
            assert r["peer_compiled_over_eager"] == {}
            assert r["failed"]["vmap_compiled"] == "RuntimeError: backend='x' raised: boom"
            assert r["failed"]["loop_compiled"].startswith("wrong result: compiled result differs from eager: output off by")
            assert r["best_peer"] is None and r["compiled_over_best_peer"] == {}
    s = doc["summary"]["train"]
    assert set(s) == {"linear", "mlp", "all"}
    lin = [r["compiled_over_eager"]["auto"] for r in rows if r["model"] == "linear"]
    assert s["linear"]["points"] == 2 and s["all"]["points"] == 4 and s["linear"]["failed_points"] == 0
    assert s["linear"]["geomean_compiled_over_eager"] == pytest.approx((lin[0] * lin[1]) ** 0.5, abs=1e-4)
    assert s["linear"]["max_compiled_over_eager"] == max(lin)
    (one,) = [r for r in rows if r["model"] == "linear" and r["groups"] == 2]
    # Each peer's compiled over eager, over the points where it compiled (G=2 only).
    for peer in ("loop", "vmap"):
        assert s["linear"][f"geomean_{peer}_compiled_over_eager"] == one["peer_compiled_over_eager"][f"{peer}_compiled"]
    ctl = [r["control_compiled_over_eager"] for r in rows if r["model"] == "linear"]
    assert s["linear"]["geomean_control_compiled_over_eager"] == pytest.approx((ctl[0] * ctl[1]) ** 0.5, abs=1e-4)
    assert s["linear"]["geomean_compiled_over_eager_over_control"] == pytest.approx(
        (lin[0] / ctl[0] * lin[1] / ctl[1]) ** 0.5, abs=2e-4)
    assert s["linear"]["max_compiled_over_best_peer"] == one["compiled_over_best_peer"]["auto"]
    assert s["linear"]["worst_point_compiled_over_best_peer"] == "linear B=4 G=2 3x2"
    assert set(s["all"]["targets_met"]) == {
        "geomean_compiled_over_eager<=1.02", "geomean_speedup_over_best_peer>=1.25",
        "slower_than_no_compiled_peer", "compiled_everywhere"}


def _script_rounds(monkeypatch, step: str, slow: str, series: list) -> None:
    """``tuning.measure`` scripted over 10 rounds: every step 100 us a round, ``slow`` 200 us,
    and ``step`` the next list of ``series`` at each call (one call a point)."""
    it = iter(series)

    def fake(steps, device, rounds, min_time, per_round=None, **kw):
        taken = {n: [100.0] * 10 for n in steps}
        taken[slow] = [200.0] * 10
        taken[step] = [float(v) for v in next(it)]
        if per_round is not None:
            per_round.update(taken)
        return {n: statistics.median(v) * 1e-6 for n, v in taken.items()}, {}

    monkeypatch.setattr(tuning, "measure", fake)


def test_bench_judges_auto_beyond_its_margin_by_the_paired_rounds(tmp_path, capsys, monkeypatch):
    # A scripted timer: at G=2 auto is 24-27% slower than loop in every round (beyond 1.10
    # beyond the noise); at G=3 its median is 12% slower but rounds spread from 5% to 30%
    # (within the noise of the margin).
    _script_rounds(monkeypatch, "auto", "bmm", [[125, 124, 126, 125, 127, 125, 124, 126, 125, 125],
                                                [105, 130, 112, 109, 125, 111, 108, 128, 113, 112]])
    out = tmp_path / "b.json"
    assert main(["bench", "--batch", "4", "--groups", "2,3", "--blocks", "3x2", "--backends", "loop,bmm",
                 "--mode", "train", "--no-baselines", "--no-memory", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert ("auto beyond 1.10 of the fastest (loop): train B=4 G=2 3x2 1.250, interval 1.240-1.260: "
            "beyond 1.10 beyond the noise") in printed
    assert ("auto beyond 1.10 of the fastest (loop): train B=4 G=3 3x2 1.120, interval 1.080-1.280: "
            "within the noise of 1.10") in printed
    doc = json.loads(out.read_text())
    assert [r["auto_over_fastest_interval"] for r in doc["rows"]] == [[1.24, 1.26], [1.08, 1.28]]
    s = doc["summary"]["train"]
    assert (s["within_1.10"], s["beyond_1.10_beyond_noise"], s["points_with_interval"]) == (0, 1, 2)


def test_bench_compiled_judges_each_slower_point_by_its_paired_rounds(tmp_path, capsys, monkeypatch):
    # A scripted timer: at G=2 compiled blockdiag is 4-7% slower than the compiled loop in
    # every round (slower beyond the noise); at G=3 its median is 2% slower but rounds go
    # either way (a tie). The vmap peer is slower than both everywhere.
    _script_rounds(monkeypatch, "auto_compiled", "vmap_compiled", [[105, 106, 104, 105, 107, 105, 104, 106, 105, 105],
                                                                   [97, 103, 104, 99, 102, 101, 98, 103, 104, 102]])
    out_json = tmp_path / "c.json"
    assert main(["bench", *TINY, "--compiled", "linear", "--compiler", "aot_eager", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert ("slower than loop_compiled: train linear B=4 G=2 3x2 auto 1.050, interval 1.040-1.060: "
            "slower beyond the noise") in printed
    assert "slower than loop_compiled: train linear B=4 G=3 3x2 auto 1.020, interval 0.980-1.040: a tie" in printed
    doc = json.loads(out_json.read_text())
    assert [r["compiled_over_best_peer_interval"] for r in doc["rows"]] == [{"auto": [1.04, 1.06]}, {"auto": [0.98, 1.04]}]
    s = doc["summary"]["train"]["linear"]
    assert (s["slower_than_best_peer"], s["slower_than_best_peer_beyond_noise"], s["tied_with_best_peer"],
            s["points_with_interval"]) == (2, 1, 1, 2)
    assert s["slower_beyond_noise_points"] == ["linear B=4 G=2 3x2"]
    met = s["targets_met"]
    assert met["slower_than_no_compiled_peer"] is False and met["slower_than_no_compiled_peer_beyond_noise"] is False
    assert re.search(r"\n    of which slower beyond the rounds' noise \(interval above 1\) +1\n", printed)


@pytest.mark.parametrize("extra, point, step", [
    (["--compiled", "linear", "--compiler", "aot_eager"], "train linear B=4 G=2 3x2", "auto_compiled 30"),
    (["--backends", "bmm", "--mode", "train"], "train B=4 G=2 3x2", "bmm 30"),
], ids=["compiled", "eager"])
def test_bench_names_the_steps_that_page_fault(extra, point, step, capsys, monkeypatch, tmp_path):
    # A fake fault counter: every step "faults" 30 pages a call, at or above FAULTS_NOTED.
    from blockdiag.tuning import _timer

    count = iter(range(0, 10**9, 30))
    monkeypatch.setattr(_timer, "_minor_faults", lambda: next(count))
    assert tuning.FAULTS_NOTED <= 30
    out = tmp_path / "b.json"
    # Two rounds: a step's first sample can be its calibration run, timed but not counted.
    assert main(["bench", "--batch", "4", "--groups", "2", "--blocks", "3x2", "--repeat", "2", "--min-time", "0",
                 "--no-baselines", "--no-memory", *extra, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    line = [ln for ln in printed.splitlines() if ln.startswith("page faults per step:")]
    assert len(line) == 1 and line[0].startswith(f"page faults per step: {point}: ")
    assert "auto 30" in line[0] and step in line[0] and line[0].endswith("(fresh pages from the allocator every step: see docs/faq.md)")
    (row,) = json.loads(out.read_text())["rows"]
    assert row["faults_per_step"]["auto"] == 30.0


def test_bench_compiled_rejects_unknown_models(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--compiled", "conv"])
    assert e.value.code == 2
    assert "argument --compiled: expected a comma-separated subset of linear,mlp, got 'conv'" in capsys.readouterr().err


# --- for users: help, version, what tune announces, units, explain's wording ----------------

def test_version(capsys):
    import blockdiag

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"blockdiag {blockdiag.__version__} (torch {torch.__version__})"


@pytest.mark.parametrize("cmd", [[], ["demo"], ["tune"], ["explain"], ["bench"]], ids=lambda c: c[0] if c else "top")
def test_help_has_a_description_an_example_and_defaults(cmd, capsys):
    with pytest.raises(SystemExit):
        main([*cmd, "--help"])
    out = capsys.readouterr().out
    assert "``" not in out, out  # no raw reStructuredText
    if cmd:
        assert "example" in out and f"blockdiag {cmd[0]}" in out.split("example")[-1], out
    if cmd in (["demo"], ["tune"], ["bench"]):
        # every option with a value shows its default
        flat = " ".join(out.split())  # argparse wraps lines
        assert ("(default 50)" if cmd == ["demo"] else "(default float32)") in flat, out


def test_tune_names_its_profile_and_estimates_before_starting(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert main(["tune", *TINY, "--backends", "loop,bmm", "--mode", "forward", "--no-rematch",
                 "--profile", str(path)]) == 0
    err = capsys.readouterr().err
    first = err.split("\n", 2)[:2]
    assert f"writes {path}" in first[0] and "estimated duration" in first[1], err
    assert "2 backends" in first[1], err


def test_bench_estimates_its_duration_before_starting(capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(tuning, "bench", lambda *a, **k: seen.append(capsys.readouterr().err) or [])
    assert main(["bench", *TINY, "--backends", "loop,bmm", "--mode", "forward", "--no-baselines"]) == 0
    (err,) = seen  # what was on stderr when the run started
    first, second = err.splitlines()[:2]
    assert first.startswith("blockdiag bench: 2 points on ") and first.endswith("writes nothing (no --json)"), err
    assert second.startswith(("estimated duration: about ", "estimated duration: under 1 s")) and "2 backends" in second, err
    assert "about under" not in second, err


def test_the_duration_estimate_and_its_basis(monkeypatch):
    from blockdiag.cli import _format as fmt
    from blockdiag.cli._run import _point_costs

    monkeypatch.setattr(fmt.torch, "get_num_threads", lambda: 2)
    # The run the model is calibrated on: tune --full --mode both --max-gflop 20 took 634 s
    # on the project's 2-core CPU (11 backends, 2 of which loop over the groups).
    points = _point_costs(tuning.GRIDS["full"], ("forward", "train"), 20.0)
    assert len(points) == 166
    assert 500 < fmt.estimate_seconds(points, 11, 5, 1e-2, "cpu", loops=2) < 800
    # Short calls: a sample lasts about 2.2 x --min-time (the repeat count grows 4x at a time).
    assert fmt.estimate_seconds([1.0], 1, 5, 1e-2, "cpu") == pytest.approx(7 * 2.2e-2)
    # Long calls: one call at the assumed rate, 24 GFLOP/s per thread.
    assert fmt.estimate_seconds([48e9], 1, 5, 1e-2, "cpu") == pytest.approx(7.0)
    line = fmt.estimate_line([48e9], 3, "backends", 5, 1e-2, "cpu", "more")
    assert line == ("estimated duration: about 21 s (21 samples: 1 point x 3 backends x (5 rounds + 2 to "
                    "calibrate); each one call at 24 GFLOP/s x 2 threads and at least 1 us a group (10 us in "
                    "a Python loop over them; more in training), or about 2.2 x 0.01 s for shorter calls; more)")
    assert [fmt.duration(s) for s in (0.2, 40, 720, 9000)] == ["under 1 s", "40 s", "12 min", "2.5 h"]


def test_the_duration_estimate_counts_the_work_per_group(monkeypatch):
    from blockdiag.cli import _format as fmt
    from blockdiag.cli._run import _looping, _point_costs

    monkeypatch.setattr(fmt.torch, "get_num_threads", lambda: 2)
    grid = tuning.Grid(batch=(256,), groups=(65536,), blocks=((1, 1),))
    # `bench --batch 256 --groups 65536 --blocks 1x1` (16 steps: 11 backends, auto, its
    # kernel, the ideal GEMM, the nn.Linear loop and vmap) took 28 s forward and 108 s for
    # the training step on the project's 2-core CPU; by FLOPs alone the model said 2 s.
    # Three of the steps loop over the groups in Python: loop, bmm_fm_loop and the nn.Linear loop.
    assert _looping(["loop", "bmm_fm_loop", "bmm", "simd"]) == 2
    for mode, took in (("forward", 28), ("train", 108)):
        points = _point_costs(grid, (mode,), float("inf"))
        assert points == [fmt.PointCost(2.0 * 256 * 65536 * (3 if mode == "train" else 1), 65536, mode == "train")]
        assert fmt.estimate_seconds([p.flops for p in points], 16, 5, 1e-2, "cpu") < took / 10
        assert took / 2 < fmt.estimate_seconds(points, 16, 5, 1e-2, "cpu", loops=3) < took * 2
    # Few groups: the FLOPs decide, as before.
    big = fmt.PointCost(48e9, 4, True)
    assert fmt.estimate_seconds([big], 1, 5, 1e-2, "cpu", loops=1) == pytest.approx(7.0)


def test_a_column_of_times_has_one_unit_chosen_from_its_values():
    from blockdiag.cli import _format as fmt

    # The column: 6171us beside 24.45ms. One unit, from the column's largest value.
    col = [6171.0, 24450.0, 91.0, None]
    assert fmt.unit(col) == "ms" and [fmt.in_unit(v, "ms") for v in col] == ["6.17", "24.45", "0.091", "-"]
    assert fmt.unit([12.0, 9999.0]) == "us" and [fmt.in_unit(v, "us") for v in (12.0, 9999.0)] == ["12.0", "9999"]


def test_the_summary_labels_every_figure():
    from blockdiag.cli import _format as fmt

    text = fmt.summary_lines("forward", {"points": 3, "geomean_auto_over_fastest": 1.0234, "worst_point": "B=4",
                                         "median_fraction_of_ideal": 0.5, "a_new_figure": 7})
    lines = text.splitlines()
    assert lines[0] == "forward:"
    assert [ln.split("  ")[-1].strip() for ln in lines[1:]] == ["3", "1.023", "B=4", "50%", "7"]
    assert "a new figure" in lines[-1] and "_fastest" not in text and "a_new" not in text
    # A figure not computed (None) is left out, one without a value says so bare (not "nan%"),
    # and what the caller prints itself (bench --compiled's targets) is not repeated raw.
    text = fmt.summary_lines("forward", {"points": 3, "geomean_auto_over_fastest": None,
                                         "median_fraction_of_ideal": float("nan"), "targets_met": {"a": True}},
                             skip=("targets_met",))
    lines = text.splitlines()
    assert len(lines) == 3 and lines[1].split() == ["points", "3"], text
    assert lines[2].split("  ")[-1] == "nan" and "None" not in text and "targets" not in text, text


def test_each_count_says_how_many_points_it_is_of():
    # "points where auto's choice is within 1.10 of the fastest  3" read as 3 of the run's
    # points, where it was 3 of those whose choice was timed (and likewise the others).
    from blockdiag.cli import _format as fmt
    from blockdiag.tuning._bench import summarize

    def row(auto, times, fastest):
        return {"mode": "forward", "batch": 8, "groups": 2, "block_in": 4, "block_out": 4, "auto": auto,
                "times_us": times, "fastest": fastest, "auto_us": 10.0, "fraction_of_ideal": 0.5,
                "auto_over_fastest": 10.0 / times[fastest]}

    rows = [row("bmm", {"bmm": 10.0, "dense": 9.5}, "dense"), row("simd", {"bmm": 10.0, "dense": 20.0}, "bmm"),
            row("bmm", {"bmm": 5.0, "dense": 6.0}, "bmm")]
    s = summarize(rows)["forward"]
    text = fmt.summary_lines("forward", s)
    assert re.search(r"auto is within 1\.10 of the fastest +2 of 3$", text, re.M), text
    assert re.search(r"auto's choice is within 1\.10 of the fastest +2 of 2$", text, re.M), text
    assert "choice points" not in text and "rated points" not in text
    # A summary from before the denominators were recorded shows the bare count.
    old = fmt.summary_lines("forward", {"choice_within_1.10": 4})
    assert old.splitlines()[1].endswith(" 4"), old


@pytest.mark.parametrize("cost,says", [(-17.9, "below zero: less than this run's timing noise"), (3.2, None)])
def test_a_negative_dispatch_cost_is_called_noise(cost, says):
    from blockdiag.cli import _format as fmt

    line = fmt.summary_lines("train", {"median_dispatch_overhead_us": cost}).splitlines()[1]
    assert f"{cost:.1f} us" in line
    assert (says in line) if says else "noise" not in line


def test_every_option_has_help_and_every_value_option_its_default():
    import argparse

    from blockdiag.cli import build_parser

    top = build_parser()
    (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    for name, parser in sub.choices.items():
        assert parser.description and "example" in (parser.epilog or ""), name
        fmt = parser._get_formatter()
        for a in parser._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            assert a.help, (name, a.option_strings)
            flag = a.nargs == 0
            if not flag and not a.required and not (name == "bench" and a.dest == "mode"):
                # bench's --mode defaults to both, or train with --compiled: its help says so
                text = fmt._get_help_string(a)
                assert "default" in text, (name, a.option_strings, text)
            if flag:  # a switch: "(default False)" says nothing its name does not
                assert "(default " not in fmt._get_help_string(a), (name, a.option_strings)


def test_help_fits_an_80_column_terminal(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    for cmd in ([], ["demo"], ["tune"], ["explain"], ["bench"]):
        with pytest.raises(SystemExit):
            main([*cmd, "--help"])
        out = capsys.readouterr().out
        long = [line for line in out.splitlines() if len(line) > 80]
        assert not long, (cmd, long)


def test_bench_columns_have_one_unit_and_the_summary_is_labelled(capsys):
    assert main(["bench", *TINY, "--backends", "loop,bmm", "--mode", "forward", "--no-baselines"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(line for line in lines if line.startswith("mode"))
    assert "loop us" in head or "loop ms" in head, head
    row = next(line for line in lines if line.startswith("forward "))
    assert "us" not in row.split()[4:] and not any(c.endswith(("us", "ms")) for c in row.split()[4:]), row
    assert "auto over the fastest backend, geometric mean" in out and "geomean_auto_over_fastest=" not in out, out


def test_no_beta_warnings_from_our_commands(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "blockdiag", "bench", *TINY, "--backends", "csr,bsr,loop",
                        "--mode", "forward", "--no-baselines"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "beta" not in r.stdout + r.stderr, r.stderr


def test_explain_never_claims_a_measurement_in_another_dtype(capsys):
    assert main(["explain", "--batch", "256", "--groups", "50", "--block", "150x10", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "the table has no float16 entry" in out and "measured in float32" in out, out
    assert main(["explain", "--batch", "256", "--groups", "50", "--block", "150x10"]) == 0
    assert "no float32 entry" not in capsys.readouterr().out


def test_the_decision_map_has_a_legend_and_a_title_that_fits(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from PIL import Image

    from blockdiag.tuning import plot_decision_map

    seen = {}
    real_savefig = plt.Figure.savefig

    def spy(fig, path, **kw):
        out = real_savefig(fig, path, **kw)
        seen["legends"] = [[t.get_text() for t in leg.get_texts()] for leg in fig.legends]
        seen["title"] = fig._suptitle.get_text()
        renderer = fig.canvas.get_renderer()
        box = fig.bbox
        # Every title (the figure's, the panels', the legends') lies wholly inside the image.
        titles = [fig._suptitle, *(ax.title for ax in fig.axes), *(leg.get_title() for leg in fig.legends)]
        seen["cut"] = [t.get_text() for t in titles if t.get_text() and not (
            box.x0 <= t.get_window_extent(renderer).x0 and t.get_window_extent(renderer).x1 <= box.x1
            and box.y0 <= t.get_window_extent(renderer).y0 and t.get_window_extent(renderer).y1 <= box.y1)]
        return out

    entry = {"device_name": "A CPU with a rather long marketing name (2 threads)", "torch": "2.13.0+cpu",
             "dtype": "float32", "measurements": [
                 {"mode": mode, "batch": b, "groups": g, "block_in": i, "block_out": 2,
                  "times_us": {"loop": 1.0 + b, "bmm": 2.0 * g, "bmm_fm_bmm": 3.0}}
                 for mode in ("forward", "train") for i in (2, 150) for b in (1, 8) for g in (1, 4)]}
    path = tmp_path / "map.png"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(plt.Figure, "savefig", spy)
        plot_decision_map(entry, str(path))
    # A legend naming the backends that win somewhere, and a key to the shades.
    assert seen["legends"][0] == ["bmm", "bmm_fm_bmm", "loop"], seen["legends"]
    assert len(seen["legends"]) == 2 and "under 1.05x" in seen["legends"][1], seen["legends"]
    assert all(len(line) <= 90 for line in seen["title"].splitlines()), seen["title"]
    assert seen["cut"] == [], seen["cut"]
    # Drawn at the docs' width, so that its 7-9 pt labels are read at that size.
    assert Image.open(path).size[0] == 800


def test_results_name_their_commit_and_whether_it_was_edited(tmp_path, monkeypatch):
    import shutil
    import subprocess

    from blockdiag.cli import _run

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "repo"
    pkg = root / "blockdiag" / "cli"
    pkg.mkdir(parents=True)
    (pkg / "_run.py").write_text("x = 1\n")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    monkeypatch.setattr(_run, "__file__", str(pkg / "_run.py"))
    clean = _run._provenance()
    assert len(clean["commit"]) == 40 and clean["commit_dirty"] is False
    (pkg / "_run.py").write_text("x = 2\n")
    assert _run._provenance()["commit_dirty"] is True


def _bench_stopped_at(k: int, compiled: bool, out_json):
    """``bench``'s argv writing ``out_json``, and a function that makes its ``k``-th point raise
    ``KeyboardInterrupt`` (through ``monkeypatch``) and returns a function undoing that."""
    import blockdiag.tuning._bench as bench_mod
    import blockdiag.tuning._compiled as compiled_mod

    mod, name = (compiled_mod, "_bench_compiled_point") if compiled else (bench_mod._tuning, "measure")
    real = getattr(mod, name)
    argv = ["bench", *TINY, "--no-baselines", "--no-memory", "--json", str(out_json)]
    argv += ["--compiled", "linear", "--compiler", "eager", "--groups", "2,3,4"] if compiled else []

    def stop(monkeypatch):
        calls = []

        def stops(*a, **kw):
            calls.append(1)
            if len(calls) == k:
                raise KeyboardInterrupt
            return real(*a, **kw)

        monkeypatch.setattr(mod, name, stops)
        return lambda: monkeypatch.setattr(mod, name, real)

    return argv, stop


@pytest.mark.parametrize("compiled", [False, True], ids=["bench", "bench-compiled"])
def test_bench_json_keeps_the_points_measured_before_the_run_stops(compiled, tmp_path, capsys, monkeypatch):
    # A run killed part way (a timeout, Ctrl-C, a later point failing) used to lose every
    # point: the file was written only at the end. Here the third point is interrupted.
    out_json = tmp_path / "b.json"
    argv, stop = _bench_stopped_at(3, compiled, out_json)
    stop(monkeypatch)
    assert main(argv) == 130  # the CLI's exit status for an interrupt
    doc = json.loads(out_json.read_text())
    assert doc["complete"] is False
    assert (doc["points_done"], doc["points_total"]) == (2, 3 if compiled else 4)
    assert len(doc["rows"]) == 2 and doc["summary"] and "argv" in doc and "torch" in doc


@pytest.mark.parametrize("compiled", [False, True], ids=["bench", "bench-compiled"])
def test_an_interrupted_bench_rerun_keeps_the_earlier_complete_file(compiled, tmp_path, capsys, monkeypatch):
    # Rerunning into the same --json FILE and stopping part way replaced the earlier complete
    # run with the few points of the new one. Now the saves part way go to FILE.partial, FILE
    # is replaced only by a complete run, and stderr says where the points are.
    out_json, partial = tmp_path / "b.json", tmp_path / "b.json.partial"
    argv, stop = _bench_stopped_at(3, compiled, out_json)
    assert main(argv) == 0
    earlier = out_json.read_text()
    assert json.loads(earlier)["complete"] is True and not partial.exists()
    capsys.readouterr()
    undo = stop(monkeypatch)
    assert main(argv) == 130
    assert out_json.read_text() == earlier
    doc = json.loads(partial.read_text())
    assert doc["complete"] is False and len(doc["rows"]) == 2
    err = capsys.readouterr().err
    assert f"the 2 points measured so far are in {partial}" in err and f"{out_json} is as it was" in err
    undo()
    assert main(argv) == 0  # a complete rerun replaces the file and leaves no partial beside it
    assert json.loads(out_json.read_text())["complete"] is True and not partial.exists()


def test_an_interrupted_tune_leaves_the_profile_as_it_was_and_says_so(tmp_path, capsys, monkeypatch):
    import blockdiag.tuning as tune_mod

    path = tmp_path / "p.json"
    assert main(["tune", *TINY, "--profile", str(path)]) == 0
    before = path.read_bytes()
    real, calls = tune_mod.measure, []

    def stops_at_the_second(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(tune_mod, "measure", stops_at_the_second)
    capsys.readouterr()
    assert main(["tune", *TINY, "--profile", str(path)]) == 130
    assert path.read_bytes() == before
    assert f"tune: stopped before the end; {path} was not changed" in capsys.readouterr().err


def test_a_bench_stopped_before_its_first_point_says_nothing_was_written(tmp_path, capsys, monkeypatch):
    import blockdiag.tuning._bench as bench_mod

    def stops(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_mod._tuning, "measure", stops)
    out_json = tmp_path / "b.json"
    assert main(["bench", *TINY, "--no-baselines", "--no-memory", "--json", str(out_json)]) == 130
    assert "no point was complete; nothing was written" in capsys.readouterr().err
    assert not out_json.exists()


def test_bench_json_goes_on_measuring_when_a_save_part_way_fails(tmp_path, capsys, monkeypatch):
    real, calls = profile.write_json_atomic, []

    def full_disk_once(path, obj):
        calls.append(obj["complete"])
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(path, obj)

    monkeypatch.setattr(profile, "write_json_atomic", full_disk_once)
    out_json = tmp_path / "b.json"
    assert main(["bench", *TINY, "--no-baselines", "--no-memory", "--json", str(out_json)]) == 0
    err = capsys.readouterr().err
    assert err.count("cannot save the run so far") == 1 and "No space left on device" in err
    assert calls == [False, False, False, True]
    doc = json.loads(out_json.read_text())
    assert doc["complete"] is True and len(doc["rows"]) == 4


def test_bench_of_backends_all_skipped_at_a_point_summarizes_and_writes_json(tmp_path, capsys):
    # --backends dense where its dense matrix is over the limit: the point has auto's time but
    # no fastest, and summarize raised TypeError (round(max([None]))) before the table or the
    # --json file, losing the whole run.
    out = tmp_path / "r.json"
    rc = main(["bench", "--backends", "dense", "--batch", "1", "--groups", "256", "--blocks", "256x256",
               "--mode", "forward", "--repeat", "1", "--min-time", "0", "--refine", "0", "--no-baselines",
               "--no-memory", "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["complete"] and d["rows"][0]["fastest"] is None and "dense" in d["rows"][0]["skipped"]
    assert d["summary"]["forward"]["points"] == 1 and "max_auto_over_fastest" not in d["summary"]["forward"]
    assert "skipped: its dense matrix" in capsys.readouterr().out


def test_threads_option_picks_the_profile_entry_of_that_thread_count(tmp_path, capsys):
    # The profile's CPU entries are per thread count: explaining the plan of a run with N
    # threads needs N threads in the explaining process too, whatever the shell's default.
    path = tmp_path / "p.json"
    before = torch.get_num_threads()
    assert main(["tune", *TINY, "--mode", "forward", "--threads", "1", "--profile", str(path)]) == 0
    assert torch.get_num_threads() == before  # restored: main() may run inside a process that goes on
    assert json.loads(path.read_text())["entries"]
    capsys.readouterr()
    explain = ["explain", "--batch", "32", "--groups", "4", "--block", "16x16", "--profile", str(path)]
    for threads, source in (("1", str(path)), ("3", "built-in defaults")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main([*explain, "--threads", threads]) == 0
        # Under another count, the warning names both counts: the user sees why the entry was not used.
        named = [str(w.message) for w in caught if "(1 threads)" in str(w.message) and "(3 threads)" in str(w.message)]
        assert len(named) == (threads == "3"), [str(w.message) for w in caught]
        out = capsys.readouterr().out
        table = next(line for line in out.splitlines() if line.strip().startswith("table:"))
        assert source in table, (threads, table)
        assert f"planned for {threads} CPU threads" in out
    assert torch.get_num_threads() == before
