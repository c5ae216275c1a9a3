"""The CLI refuses bad arguments with one line on stderr and exit status 2 (issue 22 item 12).

Each case is checked before any measuring or allocating starts: no traceback, the option and
the value named. Cases that used to crash or allocate run in a subprocess with a timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from blockdiag.cli import main

TINY = ["--batch", "2", "--groups", "2", "--blocks", "2x2", "--repeat", "1", "--min-time", "0"]


def _run(args: list[str], timeout: float = 120) -> tuple[int, str, str]:
    proc = subprocess.Popen([sys.executable, "-m", "blockdiag", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"blockdiag {' '.join(args)} hung (>{timeout} s)")
    return proc.returncode, out, err


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
    last = err.strip().splitlines()[-1]
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
    from blockdiag import cli

    seen = []
    monkeypatch.setattr(cli, "_memory_limit", lambda: 1 << 40)
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
        (["--seed", "1e23"], ("--seed", "'1e23'")),
        (["--seed", str(10**23)], ("--seed", str(10**23))),
        (["--seed", "-1"], ("--seed", "got -1")),
        (["--heads", "1e8"], ("--heads", "'1e8'")),
    ],
    ids=["lr-nan", "lr-negative", "lr-inf", "seed-float", "seed-huge", "seed-negative", "heads-float"],
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
    from blockdiag import cli

    target = tmp_path / "x.json"
    target.write_text("{}")
    real = os.access
    monkeypatch.setattr(cli.os, "access", lambda p, mode: False if str(p) == str(target) else real(p, mode))
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
