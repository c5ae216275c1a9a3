"""``scripts/bench_rows.py`` (the timings behind ``ops._define.ROWS_MIN_RUN_BYTES``) runs end to end.

A smoke test only: no timing is asserted. It checks the exit code and that every point of the
grid asked for is printed with both ratios.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_rows_tiny_run_prints_each_point():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_rows.py"), "--batch", "3", "--groups", "2,5",
                        "--runs", "8,16", "--rounds", "1", "--dtype", "float64"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.split() and line.split()[0] == "3"]
    assert [(row[1], row[2]) for row in rows] == [("2", "8"), ("2", "16"), ("5", "8"), ("5", "16")], r.stdout
    for row in rows:
        # Times are positive; a ratio is printed to two decimals, so one stalled sample of a
        # single round can print it as 0.00 (no timing is asserted).
        times = [float(row[i]) for i in (4, 6, 9, 11)]
        ratios = [float(row[i]) for i in (7, 12)]
        assert all(t > 0 for t in times) and all(v >= 0 for v in ratios), row
