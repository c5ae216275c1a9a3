"""The README example runs, and ``blockdiag demo`` trains both models and reports the speed-up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from blockdiag.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs(capsys):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README.md has no python example"
    exec(compile(blocks[0], "README.md", "exec"), {})
    assert "backend" in capsys.readouterr().out.lower()


def test_readme_gives_exactly_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up on a fresh machine", 1)[1].split("###", 1)[0]
    cmds = re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)
    assert cmds == [
        "pip install torch==2.13.0 && pip install -e . && python -m blockdiag demo",
        'pip install torch==2.13.0 && pip install -e ".[test]" && pytest',
    ]


def test_demo_small(capsys):
    assert main(["demo", "--heads", "4", "--in-features", "6", "--hidden", "5,3", "--samples", "128",
                 "--batch", "32", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 heads of 6 -> 5 -> 3 -> 1" in out
    start = float(re.search(r"largest output difference (\S+)", out).group(1))
    assert start < 1e-5
    speed = re.search(r"speed-up (\S+)x", out)
    assert speed and float(speed.group(1)) > 0
    diff = float(re.search(r"epoch losses: (\S+)", out).group(1))
    assert diff < 1e-4
    assert len(re.findall(r"^\s+[12]\s", out, flags=re.M)) == 2


def test_module_entry_point_rejects_bad_options():
    r = subprocess.run([sys.executable, "-m", "blockdiag", "demo", "--heads", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "--heads" in r.stderr and "positive" in r.stderr


def test_demo_median_of_an_even_number_of_epochs_is_the_middle_two(monkeypatch, capsys):
    # With --epochs 2 the "median epoch" was the slower of the two (the upper middle of the
    # sorted times): the first epoch, which pays the warm-up, alone.
    from blockdiag.cli import demo

    times = iter([4.0, 1.0, 2.0, 0.5])  # loop, grouped; loop, grouped

    def fake_epoch(model, xs, ys, opt, batch):
        return next(times), 0.25

    monkeypatch.setattr(demo, "_train_epoch", fake_epoch)
    assert main(["demo", "--heads", "2", "--in-features", "3", "--hidden", "2", "--samples", "8",
                 "--batch", "4", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "median epoch: loop 3.000 s, GroupedMLP 0.750 s -> speed-up 4.0x" in out, out
