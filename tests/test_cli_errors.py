"""The CLI refuses bad arguments with one line on stderr and exit status 2 (issue 22 item 12).

Each case is checked before any measuring or allocating starts: no traceback, the option and
the value named. Cases that used to crash or allocate run in a subprocess with a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from _params import run_or_fail_on_hang

from blockdiag.cli import main
from blockdiag import profile

TINY = ["--batch", "2", "--groups", "2", "--blocks", "2x2", "--repeat", "1", "--min-time", "0"]


def _run(args: list[str], timeout: float = 120) -> tuple[int, str, str]:
    return run_or_fail_on_hang([sys.executable, "-m", "blockdiag", *args], timeout, f"blockdiag {' '.join(args)}")


def _refused(args: list[str], *expected: str, capsys=None) -> None:
    if capsys is None:
        rc, _, err = _run(args)
    else:
        try:
            rc = main(args)
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err
    assert rc == 2, (args, rc, err)
    assert "Traceback" not in err, err
    # One line: no usage block before it, nothing announced before the refusal.
    assert len(err.strip().splitlines()) == 1, err
    last = err.strip()
    for text in expected:
        assert text in last, (args, last)


CUDA_MISSING = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@pytest.mark.parametrize("cmd", ["tune", "bench"])
@pytest.mark.parametrize(
    "device,expected",
    [
        pytest.param("cuda", "this machine has no cuda device", marks=CUDA_MISSING, id="cuda"),
        pytest.param("meta", "'meta' tensors hold no data", id="meta"),
        pytest.param("nonsense", "unknown device 'nonsense'", id="nonsense"),
    ],
)
def test_a_device_this_machine_lacks(cmd, device, expected, capsys):
    _refused([cmd, *TINY, "--device", device], "--device", expected, capsys=capsys)


@pytest.mark.parametrize("cmd", ["tune", "bench", "explain"])
def test_a_dtype_that_is_not_floating(cmd, capsys):
    extra = ["--batch", "2", "--groups", "2", "--block", "2x2"] if cmd == "explain" else TINY
    _refused([cmd, *extra, "--dtype", "int32"], "--dtype", "'int32'", "float32", capsys=capsys)


@pytest.mark.parametrize("cmd", ["tune", "bench"])
def test_a_grid_larger_than_the_memory_is_refused_before_allocating(cmd):
    rc, _, err = _run([cmd, "--batch", "100000000", "--groups", "1000", "--blocks", "1000x1000", "--mode", "forward"],
                      timeout=60)
    assert rc == 2 and "Traceback" not in err, err
    assert "B=100000000 G=1000 1000x1000" in err and "GiB" in err, err


def test_max_gflop_leaves_the_huge_points_out_of_the_estimate(monkeypatch, tmp_path):
    from blockdiag.cli import _checks

    seen = []
    monkeypatch.setattr(_checks, "_memory_limit", lambda: 1 << 40)
    monkeypatch.setattr("blockdiag.tuning.bench", lambda grid, **kw: seen.append(grid) or [])
    assert main(["bench", "--batch", "2,100000000", "--groups", "2", "--blocks", "2x2", "--max-gflop", "1",
                 "--mode", "forward", "--no-baselines"]) == 0
    assert seen


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--lr", "nan"], ("--lr", "got nan")),
        (["--lr", "-1"], ("--lr", "got -1")),
        (["--lr", "inf"], ("--lr", "got inf")),
        (["--lr", "1e38"], ("--lr", "at most 1e6", "got 1e38")),
        (["--seed", "1e23"], ("--seed", "'1e23'")),
        (["--seed", str(10**23)], ("--seed", str(10**23))),
        (["--seed", "-1"], ("--seed", "got -1")),
        (["--heads", "1e8"], ("--heads", "'1e8'")),
    ],
    ids=["lr-nan", "lr-negative", "lr-inf", "lr-huge", "seed-float", "seed-huge", "seed-negative", "heads-float"],
)
def test_demo_arguments(args, expected, capsys):
    _refused(["demo", *args], *expected, capsys=capsys)


def test_demo_with_more_heads_than_memory_is_refused_before_allocating():
    rc, _, err = _run(["demo", "--heads", "100000000"], timeout=60)
    assert rc == 2 and "Traceback" not in err, err
    assert "--heads 100000000" in err and "GiB" in err, err


def test_bench_json_naming_a_folder_is_refused_before_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("blockdiag.tuning.bench", lambda *a, **k: pytest.fail("the run started"))
    _refused(["bench", *TINY, "--json", str(tmp_path)], "--json", "is a directory", capsys=capsys)


def test_bench_json_in_a_missing_folder_is_refused_before_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("blockdiag.tuning.bench", lambda *a, **k: pytest.fail("the run started"))
    _refused(["bench", *TINY, "--json", str(tmp_path / "no" / "x.json")], "--json", "does not exist", capsys=capsys)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write anywhere")
def test_bench_json_unwritable_is_refused_before_the_run(tmp_path, monkeypatch, capsys):
    target = tmp_path / "x.json"
    target.write_text("{}")
    target.chmod(0o400)
    monkeypatch.setattr("blockdiag.tuning.bench", lambda *a, **k: pytest.fail("the run started"))
    _refused(["bench", *TINY, "--json", str(target)], "--json", "not writable", capsys=capsys)


def test_bench_json_unwritable_as_seen_by_os_access(tmp_path, monkeypatch, capsys):
    # The same check where the test runs as root: os.access says what the user may do.
    target = tmp_path / "x.json"
    target.write_text("{}")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(target) else real(p, mode))
    monkeypatch.setattr("blockdiag.tuning.bench", lambda *a, **k: pytest.fail("the run started"))
    _refused(["bench", *TINY, "--json", str(target)], "--json", "not writable", capsys=capsys)


@pytest.mark.parametrize("cmd", ["tune", "bench"])
def test_max_gflop_nan_is_refused(cmd, capsys):
    _refused([cmd, *TINY, "--max-gflop", "nan"], "--max-gflop", "got nan", capsys=capsys)


@pytest.mark.parametrize("cmd", ["tune", "bench"])
@pytest.mark.parametrize("value", ["", ","])
def test_an_empty_backend_list_is_refused(cmd, value, capsys):
    _refused([cmd, *TINY, "--backends", value], "--backends", "at least one backend", capsys=capsys)


def test_an_unknown_backend_is_one_line_and_status_2(capsys):
    _refused(["bench", *TINY, "--backends", "nope"], "nope", capsys=capsys)


# --- refused as well: values that would hang, be ignored or fail after the whole run -------

@pytest.mark.parametrize("option,value", [("--min-time", "inf"), ("--min-time", "nan"), ("--min-time", "-1"),
                                          ("--refine", "inf"), ("--refine", "nan")])
@pytest.mark.parametrize("cmd", ["tune", "bench"])
def test_min_time_and_refine_must_be_finite(cmd, option, value, capsys):
    # --min-time inf would time one sample forever (and estimate "inf min").
    _refused([cmd, *TINY, option, value], option, f"got {value}", capsys=capsys)


@pytest.mark.parametrize("cmd", ["tune", "bench"])
def test_an_empty_block_list_is_refused(cmd, capsys):
    # It used to fall back to the default grid's blocks without a word.
    _refused([cmd, "--batch", "2", "--groups", "2", "--blocks", ","], "--blocks", "','", capsys=capsys)


@pytest.mark.parametrize("device,expected", [("nonsense", "unknown device 'nonsense'"),
                                             ("meta", "'meta' tensors hold no data"),
                                             ("xpu", "no backend runs on xpu (they run on cpu, cuda")])
def test_explain_refuses_a_device_torch_does_not_know(device, expected, capsys):
    # It used to print every backend's "does not run on nonsense" as one 1000-character line.
    _refused(["explain", "--batch", "2", "--groups", "2", "--block", "2x2", "--device", device],
             "--device", expected, capsys=capsys)


@CUDA_MISSING
def test_explain_plans_for_a_device_this_machine_lacks(capsys):
    # explain runs nothing: planning for a GPU on a machine without one is its use.
    assert main(["explain", "--batch", "2", "--groups", "2", "--block", "2x2", "--device", "cuda"]) == 0
    assert "cuda" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", ["explain", "bench"])
def test_a_named_profile_that_does_not_exist_is_refused(cmd, tmp_path, monkeypatch, capsys):
    # auto would fall back to the built-in table in silence: the user named a file to be used.
    monkeypatch.setattr("blockdiag.tuning.bench", lambda *a, **k: pytest.fail("the run started"))
    missing = tmp_path / "typo.json"
    shape = ["--batch", "2", "--groups", "2", "--block", "2x2"] if cmd == "explain" else TINY
    _refused([cmd, *shape, "--profile", str(missing)], "--profile", f"{str(missing)!r} does not exist",
             capsys=capsys)


def test_tune_creates_the_directories_of_its_profile(tmp_path, monkeypatch, capsys):
    # On a fresh machine the user cache directory does not exist yet: tune makes it.
    path = tmp_path / "fresh" / "cache" / "blockdiag" / "profile.json"
    monkeypatch.setenv("BLOCKDIAG_PROFILE", str(path))
    assert main(["tune", *TINY, "--backends", "loop", "--mode", "forward", "--no-rematch"]) == 0
    assert path.is_file() and f"writes {path}" in capsys.readouterr().err


def test_a_profile_under_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    _refused(["tune", *TINY, "--profile", str(tmp_path / "f" / "p.json")], "--profile", "is not a directory",
             capsys=capsys)


def test_an_unknown_compiler_is_refused_before_the_run(monkeypatch, capsys):
    # It used to run every point, each failing with InvalidBackend.
    monkeypatch.setattr("blockdiag.tuning.bench_compiled", lambda *a, **k: pytest.fail("the run started"))
    _refused(["bench", *TINY, "--compiled", "--compiler", "nonsense"], "--compiler", "'nonsense'", capsys=capsys)


def test_a_compiler_without_compiled_is_refused(monkeypatch, capsys):
    # It was silently ignored: the run timed eager backends only.
    monkeypatch.setattr("blockdiag.tuning.bench", lambda *a, **k: pytest.fail("the run started"))
    _refused(["bench", *TINY, "--compiler", "aot_eager"], "--compiler aot_eager applies to --compiled runs only",
             capsys=capsys)


def test_a_library_error_over_several_lines_is_printed_as_one(monkeypatch, capsys):
    from blockdiag import BlockDiagError, cli

    def fails(args):
        raise BlockDiagError("first part\n  second part")

    monkeypatch.setattr(cli, "cmd_explain", fails)
    _refused(["explain", "--batch", "2", "--groups", "2", "--block", "2x2"],
             "blockdiag explain: error: first part; second part", capsys=capsys)


def test_an_interrupt_is_one_line_and_status_130(monkeypatch, capsys):
    from blockdiag import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_tune", interrupted)
    assert main(["tune", *TINY]) == 130
    assert capsys.readouterr().err == "blockdiag tune: interrupted\n"


def _console_script(argv: list[str], slow_torch: bool = False) -> subprocess.Popen:
    """The ``blockdiag`` script as pip writes it for pyproject's entry point, started on ``argv``.

    ``slow_torch``: torch's import waits (a minute, or until a signal) after printing a line,
    so that a signal can be sent while it runs, whatever this machine's speed.
    """
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    root = Path(__file__).resolve().parent.parent  # the cwd: the entry module lies at the root
    entry = tomllib.loads((root / "pyproject.toml").read_text())
    module, func = entry["project"]["scripts"]["blockdiag"].split(":")
    code = textwrap.dedent(f"""
        import sys, time
        class SlowTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch":
                    print("importing torch", flush=True)
                    time.sleep(60)
        if {slow_torch}:
            sys.meta_path.insert(0, SlowTorch())
        sys.argv[0] = "blockdiag"
        from {module} import {func}
        sys.exit({func}())
    """)
    return subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=root)


def test_an_interrupt_while_torch_imports_is_one_line_and_status_130():
    # The console script's entry was blockdiag.cli, whose import imports torch before main
    # runs: a Ctrl-C in the command's first second printed a traceback from inside torch.
    p = _console_script(["explain", "--batch", "2", "--groups", "2", "--block", "2x2"], slow_torch=True)
    try:
        assert p.stdout.readline() == "importing torch\n"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert (p.returncode, err) == (130, "blockdiag: interrupted\n"), (p.returncode, err)
    p = _console_script(["--version"])  # and the entry point runs the command line
    out, err = p.communicate(timeout=120)
    assert (p.returncode, err) == (0, "") and out.startswith("blockdiag "), (p.returncode, out, err)


def test_a_corrupt_profile_is_one_warning_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    rc, out, err = _run(["explain", "--batch", "2", "--groups", "2", "--block", "2x2", "--profile", str(bad)])
    assert rc == 0 and "Plan for" in out, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"blockdiag explain: ProfileWarning: tuning profile {bad} is corrupt"), line


@pytest.mark.parametrize("cmd,option", [("tune", "--profile"), ("bench", "--profile"), ("explain", "--profile"),
                                        ("tune", "--plot"), ("bench", "--json")])
def test_an_empty_file_name_is_refused_not_taken_for_the_default(cmd, option, capsys, monkeypatch, tmp_path):
    # tune --profile '' used to write the user's profile in the cache directory.
    monkeypatch.setenv("BLOCKDIAG_PROFILE", str(tmp_path / "never.json"))
    monkeypatch.setattr("blockdiag.tuning.tune", lambda *a, **k: pytest.fail("the run started"))
    monkeypatch.setattr("blockdiag.tuning.bench", lambda *a, **k: pytest.fail("the run started"))
    shape = ["--batch", "2", "--groups", "2", "--block", "2x2"] if cmd == "explain" else TINY
    _refused([cmd, *shape, option, ""], option, "must name a file, got ''", capsys=capsys)
    assert not (tmp_path / "never.json").exists()


@pytest.mark.parametrize("cmd", ["tune", "bench"])
@pytest.mark.parametrize("name", ["torch_sparse", "grouped_mm"])
def test_a_named_backend_that_cannot_run_here_is_refused(cmd, name, capsys, monkeypatch, tmp_path):
    # bench used to crash formatting a ratio of nothing (TypeError); tune wrote a profile
    # without a single winner.
    from blockdiag.backends import get

    b = get(name)
    if b.unavailable_reason() is None and "cpu" in b.dtypes:
        pytest.skip(f"{name} runs here")
    monkeypatch.setenv("BLOCKDIAG_PROFILE", str(tmp_path / "p.json"))
    _refused([cmd, *TINY, "--backends", name], "--backends", f"{name!r} cannot run here", capsys=capsys)
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("cmd", ["tune", "bench"])
def test_a_named_backend_without_the_dtype_is_refused(cmd, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("BLOCKDIAG_PROFILE", str(tmp_path / "p.json"))
    _refused([cmd, *TINY, "--backends", "mkl_batch", "--dtype", "float16"], "--backends",
             "'mkl_batch' cannot run here: it does not take float16 on cpu", capsys=capsys)


def test_the_baselines_modules_count_in_the_memory_estimate(tmp_path):
    # 1x1 blocks: the operands of 1e8 groups are small, but the nn.Linear loop and vmap
    # baselines build 2e8 modules (about 760 GiB); this used to hang building them.
    rc, _, err = _run(["bench", "--batch", "1", "--groups", "100000000", "--blocks", "1x1", "--mode", "forward"],
                      timeout=60)
    assert rc == 2 and "Traceback" not in err, err
    assert "B=1 G=100000000 1x1" in err and "--no-baselines" in err, err


def test_tune_refuses_a_grid_that_max_gflop_empties_and_an_unknown_plot_format(tmp_path, capsys):
    # Before: the first wrote an empty entry that replaced the built-in table for this
    # machine; the second measured the whole grid, then failed with a traceback.
    profile = tmp_path / "p.json"
    _refused(["tune", *TINY, "--max-gflop", "0", "--profile", str(profile)],
             "--max-gflop 0 skips every point of the grid", capsys=capsys)
    pytest.importorskip("matplotlib")
    _refused(["tune", *TINY, "--plot", str(tmp_path / "map.xyz"), "--profile", str(profile)],
             "--plot", "'xyz', which matplotlib cannot write", capsys=capsys)
    assert not profile.exists()


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    # Before: "pip install 'blockdiag[plot]'", which installs PyPI's blockdiag, another project
    # with no plot extra, where this checkout's is not installed.
    from blockdiag import BlockDiagError
    from blockdiag.tuning import plot_decision_map

    for name in ("matplotlib", "matplotlib.figure", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    profile = tmp_path / "p.json"
    _refused(["tune", *TINY, "--plot", str(tmp_path / "map.png"), "--profile", str(profile)],
             "--plot needs matplotlib, which is not installed: pip install matplotlib", capsys=capsys)
    assert not profile.exists()
    with pytest.raises(BlockDiagError, match=r"needs matplotlib, which is not installed: pip install matplotlib \(the plot "
                                             r"extra: pip install -e '\.\[plot\]' in blockdiag's checkout\)"):
        plot_decision_map({"measurements": []}, str(tmp_path / "map.png"))


@pytest.mark.parametrize("cmd, option", [("bench", "--json"), ("tune", "--profile"), ("tune", "--plot")])
def test_an_output_that_is_not_a_regular_file_is_refused_before_measuring(tmp_path, cmd, option, capsys):
    # Renaming the result over a FIFO (or a device) replaced that node with a regular file.
    fifo = tmp_path / "out.png"
    os.mkfifo(fifo)
    extra = ["--no-baselines"] if cmd == "bench" else []
    _refused([cmd, *TINY, *extra, option, str(fifo)], option, "is a FIFO, not a regular file", capsys=capsys)
    assert fifo.is_fifo()


def test_tune_that_measured_nothing_writes_nothing(tmp_path, monkeypatch, capsys):
    # Every point failed or was skipped while measuring: an empty entry would replace the
    # built-in table for this machine, so nothing is written and the run says why.
    profile = tmp_path / "p.json"
    monkeypatch.setattr("blockdiag.tuning.tune", lambda grid, **kw: {"measurements": []})
    assert main(["tune", *TINY, "--profile", str(profile)]) == 2
    err = capsys.readouterr().err
    assert "no point was measured, so nothing was written" in err, err
    assert not profile.exists()


def test_an_output_path_in_a_symlink_loop_is_one_line(tmp_path, monkeypatch, capsys):
    # pathlib's resolve() raised RuntimeError("Symlink loop"): a traceback, exit status 1.
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    monkeypatch.setattr("blockdiag.tuning.bench", lambda *a, **k: pytest.fail("the run started"))
    _refused(["bench", *TINY, "--json", str(tmp_path / "a")], "--json", "cannot be resolved", capsys=capsys)


@pytest.mark.parametrize("cmd, option", [("bench", "--json"), ("tune", "--profile"), ("tune", "--plot"),
                                         ("explain", "--profile"), ("bench", "--profile")])
def test_a_file_name_longer_than_the_file_system_takes_is_one_line(tmp_path, monkeypatch, capsys, cmd, option):
    # pathlib's is_dir()/exists() raise OSError(ENAMETOOLONG) rather than answer False: a
    # traceback, exit status 1, before any check said which option it was.
    long = str(tmp_path / ("a" * 300 + ".png"))
    monkeypatch.setattr("blockdiag.tuning.bench", lambda *a, **k: pytest.fail("the run started"))
    monkeypatch.setattr("blockdiag.tuning.tune", lambda *a, **k: pytest.fail("the run started"))
    shape = ["--batch", "2", "--groups", "2", "--block", "2x2"] if cmd == "explain" else TINY
    _refused([cmd, *shape, option, long], option, f"{long!r}", "File name too long", capsys=capsys)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_output_that_fails_when_written_is_one_line(capsys):
    # /proc passes the checks before the run (as root, os.access says yes) and refuses the
    # file when it is written: that OSError was a traceback after the whole run.
    rc = main(["bench", *TINY, "--no-baselines", "--mode", "forward", "--json", "/proc/blockdiag-test.json"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(
        "blockdiag bench: error: --json: cannot write '/proc/blockdiag-test.json'"), err


def test_a_tune_whose_profile_cannot_be_written_at_the_end_keeps_its_measurements(tmp_path, monkeypatch, capsys):
    # The profile passed the checks before the run, and the write after it failed (a full
    # disk): the minutes of measurements were lost with the error.
    import errno

    from blockdiag import profile

    target, real = tmp_path / "p.json", profile.write_json_atomic

    def full(path, obj):
        if Path(path) == target:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, obj)

    monkeypatch.setattr(profile, "write_json_atomic", full)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rc = main(["tune", *TINY, "--mode", "forward", "--profile", str(target)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and "No space left on device" in err, err
    (spare,) = tmp_path.glob("blockdiag-tune-*/profile.json")
    assert f"saved to {spare}" in err and not target.exists()
    doc, why = profile.read_profile(spare)
    assert why is None
    (entry,) = doc["entries"].values()
    assert entry["measurements"] and {m["mode"] for m in entry["measurements"]} == {"forward"}


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_two_options_naming_one_file_are_refused(tmp_path, monkeypatch, capsys, command):
    # tune --profile same.png --plot same.png replaced the profile just written by the map;
    # bench --json over the profile it reads replaced the profile by the results.
    same = tmp_path / "same.png"
    monkeypatch.setattr(f"blockdiag.tuning.{command}", lambda *a, **k: pytest.fail("the run started"))
    if command == "tune":
        pytest.importorskip("matplotlib")
        args = ["tune", *TINY, "--profile", str(same), "--plot", str(tmp_path / "." / "same.png")]
    else:
        args = ["bench", *TINY, "--json", str(same)]
        monkeypatch.setenv("BLOCKDIAG_PROFILE", str(same))
    _refused(args, "name the same file", capsys=capsys)


def test_the_decision_map_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    # savefig wrote into the file itself: a failure left a truncated image over the old one.
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from blockdiag.tuning import plot

    target = tmp_path / "map.png"
    target.write_bytes(b"OLD MAP")

    def fails(self, fname, **kw):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError(27, "File too large")

    monkeypatch.setattr(Figure, "savefig", fails)
    with pytest.raises(OSError, match="File too large"):
        plot._save_atomic(Figure(), str(target))
    assert target.read_bytes() == b"OLD MAP" and [p.name for p in tmp_path.iterdir()] == ["map.png"]


def test_bench_that_would_measure_nothing_is_refused(monkeypatch, capsys):
    # bench --max-gflop 0 ran, timed nothing and exited 0 with an empty summary (tune refused).
    monkeypatch.setattr("blockdiag.tuning.bench", lambda *a, **k: pytest.fail("the run started"))
    _refused(["bench", *TINY, "--max-gflop", "0"], "--max-gflop 0 skips every point", capsys=capsys)


def test_a_repeated_value_is_measured_once():
    from blockdiag.cli import build_parser

    args = build_parser().parse_args(["bench", "--batch", "4,4,8", "--blocks", "2x2,2X2", "--backends", "loop,loop",
                                      "--compiled", "linear,linear"])
    assert (args.batch, args.blocks, args.backends, args.compiled) == ((4, 8), ((2, 2),), ["loop"], ("linear",))


def test_a_relative_cache_home_is_ignored(monkeypatch, tmp_path):
    # The XDG spec: a relative $XDG_CACHE_HOME is invalid and ignored (it put the kernel cache
    # and the profile under whatever the current directory was).
    from blockdiag import profile
    from blockdiag.backends import _libcache

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("BLOCKDIAG_PROFILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert _libcache.kernel_dir() == tmp_path / ".cache" / "blockdiag" / "kernels"
    assert profile.default_profile_path() == tmp_path / ".cache" / "blockdiag" / "profile.json"


@pytest.mark.parametrize("content", ['{"notes": 1}\n', "# a README, not JSON\n", '{"format": "blockdiag-profile", "ver'])
def test_tune_replaces_no_file_that_is_not_a_profile(tmp_path, monkeypatch, capsys, content):
    # tune --profile notes.json replaced the user's file by a profile, silently.
    target = tmp_path / "notes.json"
    target.write_text(content)
    monkeypatch.setattr("blockdiag.tuning.tune", lambda *a, **k: pytest.fail("the run started"))
    _refused(["tune", *TINY, "--profile", str(target)], "exists but is not a blockdiag profile", capsys=capsys)
    assert target.read_text() == content


@pytest.mark.parametrize("cmd", ["demo", "tune", "explain", "bench"])
def test_an_unknown_option_is_named_by_its_command(cmd, capsys):
    # argparse's top-level parser would say "blockdiag: error" and point at the top-level help,
    # which does not list the command's options.
    required = ["--batch", "2", "--groups", "2", "--block", "2x2"] if cmd == "explain" else []
    _refused([cmd, *required, "--no-such-option", "7"], f"blockdiag {cmd}: error: unrecognized arguments: --no-such-option 7",
             f"see blockdiag {cmd} --help", capsys=capsys)


def test_tune_writes_through_a_symlink_whose_target_directory_is_missing(tmp_path, capsys):
    # The check before the run accepted the link (the profile's directories are made), but
    # save_entry made the link's own directory, not its target's: the run measured the grid,
    # then failed on the lock file with nothing written.
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "newdir" / "profile.json")
    rc = main(["tune", *TINY, "--mode", "forward", "--backends", "loop", "--profile", str(link)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert link.is_symlink() and (tmp_path / "newdir" / "profile.json").is_file()


def test_bench_whose_stdout_reader_went_away_still_writes_json_without_a_traceback(tmp_path):
    # `blockdiag bench --json r.json | head`: printing the table raised BrokenPipeError once
    # stdout's buffer filled, a traceback, and the run's --json was never written.
    out = tmp_path / "r.json"
    batches = ",".join(str(b) for b in range(1, 81))  # a table larger than stdout's buffer
    args = [sys.executable, "-m", "blockdiag", "bench", "--batch", batches, "--groups", "2", "--blocks", "2x2",
            "--repeat", "1", "--min-time", "0", "--mode", "forward", "--backends", "loop", "--no-baselines",
            "--no-memory", "--refine", "0", "--json", str(out)]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    p.stdout.close()  # the reader is gone before the first line
    err = p.stderr.read().decode()
    rc = p.wait(timeout=300)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert rc == 141, (rc, err)
    assert json.loads(out.read_text())["rows"]


@pytest.mark.parametrize("stderr_is", ["closed", "read-only", "full"])
def test_a_stderr_that_cannot_be_written_neither_ends_the_command_nor_writes_into_stdout(tmp_path, stderr_is):
    # `blockdiag tune 2>&-`: Python starts with sys.stderr None, and print(file=None) is
    # stdout: the announcement, progress and errors went into stdout's table. Through a shell
    # wrapper (pyenv's shims) descriptor 2 is the wrapper's script, open for reading; or the
    # disk of `2>log` is full: the first line for stderr raised OSError and the command ended
    # silently with status 1 (tune and bench before measuring, or in the middle of the run).
    if stderr_is == "full" and not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    missing = tmp_path / "typo.json"

    def close_stderr():
        if stderr_is == "full":
            os.dup2(os.open("/dev/full", os.O_WRONLY), 2)
            return
        os.close(2)
        if stderr_is == "read-only":
            assert os.open(sys.executable, os.O_RDONLY) == 2
            os.set_inheritable(2, True)

    p = subprocess.run([sys.executable, "-m", "blockdiag", "explain", "--batch", "2", "--groups", "2", "--block",
                        "2x2", "--profile", str(missing)], stdout=subprocess.PIPE, text=True, timeout=120,
                       preexec_fn=close_stderr)
    assert (p.returncode, p.stdout) == (2, ""), (p.returncode, p.stdout)


def test_sigterm_while_writing_leaves_the_old_file_and_no_temporary(tmp_path):
    # Python's default SIGTERM ended the process inside the write, leaving r.json.XXXX.tmp.
    out = tmp_path / "r.json"
    out.write_text('{"old": true}')
    code = textwrap.dedent(f"""
        import os, signal, sys
        from blockdiag.cli import main
        replace = os.replace
        def terminated_replace(a, b):  # the signal arrives as the file is about to be replaced
            os.kill(os.getpid(), signal.SIGTERM)
            replace(a, b)
        os.replace = terminated_replace
        sys.exit(main(["bench", "--batch", "2", "--groups", "2", "--blocks", "2x2", "--repeat", "1",
                       "--min-time", "0", "--mode", "forward", "--backends", "loop", "--no-baselines",
                       "--no-memory", "--refine", "0", "--json", {str(out)!r}]))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["r.json"] and json.loads(out.read_text()) == {"old": True}


def test_a_tune_that_timed_no_backend_anywhere_writes_nothing(tmp_path, capsys):
    # --backends dense where its dense matrix is over the limit: every point skipped it, and the
    # entry written had points without times, replacing the built-in table for this CPU with
    # one that ranks no backend anywhere (auto fell back to the preference order everywhere).
    path = tmp_path / "p.json"
    rc = main(["tune", "--backends", "dense", "--batch", "1", "--groups", "256", "--blocks", "256x256",
               "--mode", "forward", "--repeat", "1", "--min-time", "0", "--refine", "0", "--profile", str(path)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "no backend was timed" in err and "dense: skipped" in err and "Traceback" not in err
    assert not path.exists()


@pytest.mark.parametrize("cmd", ["tune", "bench"])
def test_a_bad_settings_variable_is_refused_before_the_measuring(cmd, tmp_path, monkeypatch, capsys):
    # auto reads BLOCKDIAG_* when it first chooses: tune timed its whole grid, wrote the
    # profile, then failed in the cross-check with status 2 (and no --plot); bench announced
    # the run and failed at its first point.
    monkeypatch.setenv("BLOCKDIAG_SPARSITY_THRESHOLD", "abc")
    profile = tmp_path / "p.json"
    _refused([cmd, *TINY, "--mode", "forward", "--backends", "loop", "--profile", str(profile)]
             if cmd == "tune" else [cmd, *TINY, "--mode", "forward", "--backends", "loop"],
             "BLOCKDIAG_SPARSITY_THRESHOLD", "'abc'", capsys=capsys)
    assert not profile.exists()


@pytest.mark.parametrize("cmd", ["tune", "bench"])
def test_a_simd_isa_variable_naming_no_variant_is_refused_before_the_measuring(cmd, tmp_path, monkeypatch, capsys):
    # simd was left out of the run without a word (unavailable), and tune's entry, without
    # simd's times, ranked it after every measured backend at every shape on this machine.
    monkeypatch.setenv("BLOCKDIAG_SIMD_ISA", "sse4")
    monkeypatch.setattr("blockdiag.tuning.bench", lambda *a, **k: pytest.fail("the run started"))
    monkeypatch.setattr("blockdiag.tuning.tune", lambda *a, **k: pytest.fail("the run started"))
    profile = tmp_path / "p.json"
    _refused([cmd, *TINY, "--mode", "forward", "--profile", str(profile)] if cmd == "tune" else [cmd, *TINY],
             "BLOCKDIAG_SIMD_ISA='sse4' is not a kernel variant", "simd would be left out", capsys=capsys)
    assert not profile.exists()


def test_a_path_stdout_cannot_encode_is_printed_escaped_not_a_traceback(tmp_path):
    # `wrote FILE` and explain's "table: tuning profile FILE" print the user's path on stdout,
    # whose error handler is strict: a non-ASCII path under PYTHONIOENCODING=ascii (or one with
    # bytes that are not UTF-8 in a UTF-8 locale) raised UnicodeEncodeError, exit status 1.
    profile = tmp_path / "pr\u00e9.json"
    rc = main(["tune", *TINY, "--mode", "forward", "--backends", "loop", "--refine", "0", "--no-rematch",
               "--profile", str(profile)])
    assert rc == 0
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    p = subprocess.run([sys.executable, "-m", "blockdiag", "explain", "--batch", "2", "--groups", "2", "--block",
                        "2x2", "--profile", str(profile)], capture_output=True, env=env, timeout=300, cwd=tmp_path)
    out, err = p.stdout.decode("ascii"), p.stderr.decode("ascii", "replace")
    assert p.returncode == 0 and "Traceback" not in err, err
    assert "pr\\xe9.json" in out, out


def test_an_empty_compiler_is_refused_not_taken_for_inductor(capsys):
    # `--compiler ''` (an unset shell variable) fell through `args.compiler or "inductor"`:
    # the run compiled with inductor, which was not asked for.
    _refused(["bench", *TINY, "--mode", "forward", "--compiled", "linear", "--no-baselines", "--compiler", ""],
             "--compiler", "''", capsys=capsys)


def test_tune_does_not_replace_a_profile_of_a_newer_blockdiag(tmp_path, monkeypatch, capsys):
    # A profile shared with a newer blockdiag (a downgrade, a second environment) was called
    # "not a blockdiag profile", and the advice was to remove it.
    target = tmp_path / "p.json"
    content = json.dumps({"format": "blockdiag-profile", "version": profile.VERSION + 1, "entries": {}})
    target.write_text(content)
    monkeypatch.setattr("blockdiag.tuning.tune", lambda *a, **k: pytest.fail("the run started"))
    _refused(["tune", *TINY, "--profile", str(target)], "written by a newer blockdiag", "upgrade blockdiag",
             capsys=capsys)
    assert target.read_text() == content


def test_tune_does_not_replace_a_profile_it_cannot_read(tmp_path, monkeypatch, capsys):
    # Called "not a blockdiag profile" (advice: remove it) when only its permissions were wrong.
    target = tmp_path / "p.json"
    target.write_text("{}")

    def unreadable(p, sig):
        raise PermissionError(13, "Permission denied", p)

    monkeypatch.setattr(profile.os, "fdopen", unreadable)
    monkeypatch.setattr("blockdiag.tuning.tune", lambda *a, **k: pytest.fail("the run started"))
    _refused(["tune", *TINY, "--profile", str(target)], "PermissionError", "cannot read: fix its permissions",
             capsys=capsys)
    monkeypatch.undo()
    assert target.read_text() == "{}"


@pytest.mark.parametrize("script", ["bench_simd_ops.py", "bench_simd_blas_grads.py", "bench_mlp_heads.py",
                                    "bench_distributed.py"])
def test_the_scripts_refuse_a_json_they_cannot_write_and_no_rounds_before_measuring(script, tmp_path, capsys):
    # The scripts wrote --json after minutes of measuring: a missing folder or a directory
    # there was a traceback, the rows lost; --rounds 0 was statistics' "no median for empty data".
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / script
    spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def measured(*a, **k):
        raise AssertionError("the script measured before refusing its arguments")

    mod.measure = mod._launch = measured
    cases = [(["--json", str(tmp_path / "missing" / "r.json")], "--json", "does not exist"),
             (["--json", str(tmp_path)], "--json", "is a directory")]
    if script != "bench_distributed.py":
        cases += [(["--rounds", "0"], "--rounds", "got 0"), (["--min-time", "nan"], "--min-time", "got nan")]
    for argv, option, expected in cases:
        with pytest.raises(SystemExit) as e:
            mod.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {option}: " in err and expected in err, (argv, err)
