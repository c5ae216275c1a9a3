"""The prepared GPU script's dry run (``--device cpu``): it must work before a GPU is lent."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_runs_every_step(tmp_path):
    out = tmp_path / "out"
    # pytest -m cuda is skipped here: it would run this suite's CUDA subset inside a test.
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick",
                        "--skip-pytest", "--budget", "240", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["pytest"] == {"skipped": "by option"}
    # Every row is a backend that declined (with its reason) or matched the float64 reference.
    rows = report["correctness"]
    assert any(c.get("ok") for c in rows) and all(c.get("ok") or c.get("declined") for c in rows), rows
    assert report["timing"] and all(t.get("times_us") for t in report["timing"])
    # The compile/export/torch.func matrix ran, on auto among others, and matched the reference.
    transforms = report["transforms"]
    assert any(r["backend"] == "auto" and r.get("ok") for r in transforms), transforms
    assert all(r.get("ok") or "skipped" in r for r in transforms), transforms
    for step, result in (("bench_train", "bench_train.json"), ("tune_bf16", "profile_bf16.json")):
        assert report[step]["rc"] == 0, report[step]["output_tail"]
        assert (out / result).exists() and "result" in report[step]
    assert set(report["bench_train"]["result"]["summary"]) == {"train"}
    (entry,) = report["tune_bf16"]["result"]["entries"].values()
    assert entry["dtype"] == "bfloat16" and entry["measurements"]
    assert (out / "gpu_check.txt").read_text().startswith("blockdiag gpu_check")
