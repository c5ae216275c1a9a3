"""``scripts/bench_mlp_strategy.py`` (the timings behind GroupedMLP's CPU rule) runs end to end.

A smoke test only: no timing is asserted (the figures are in docs/results/mlp-strategy-cpu.json,
measured by the script itself). It checks the exit code and the JSON the docs page renders.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_mlp_strategy_tiny_run_writes_its_json(tmp_path):
    out = tmp_path / "mlp.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_mlp_strategy.py"), "--tiny", "--rounds", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert d["summary"]["points"] == len(d["rows"]) == 2
    for row in d["rows"]:
        assert set(row["times_us"]) == {"fm_chain", "layers"} and all(v > 0 for v in row["times_us"].values())
        assert row["auto"] in ("fm_chain", "layers") and len(row["layer_backends"]) == len(row["sizes"]) - 1
    assert not list(tmp_path.glob("*.tmp"))
