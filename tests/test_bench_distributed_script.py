"""``scripts/bench_distributed.py`` (issue 24's measurements) runs end to end on a tiny configuration.

A smoke test only: no timing is asserted (speed claims live in docs/distributed.md, measured by
the script itself). It checks the exit code, the JSON's keys, and the two facts the script
exists to show, which hold at any size: each of 2 ranks holds half of the parameters, and the
group-parallel step communicates nothing unless the output is replicated (then one all-gather).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gloo() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available() and sys.platform.startswith("linux")


@pytest.mark.skipif(not _gloo(), reason="needs torch.distributed with gloo on Linux")
def test_bench_distributed_tiny_run_writes_its_json(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_distributed.py"), "--heads", "8", "--batch", "4",
         "--rounds", "1", "--steps", "2", "--warmup", "1", "--timeout", "90", "--json", str(out)],
        capture_output=True, text=True, timeout=180, env=env, start_new_session=True,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"command", "machine", "settings", "results", "table_markdown", "wall_s"} <= report.keys()
    assert {"loadavg_before", "loadavg_after", "cpu_count", "torch"} <= report["machine"].keys()
    results = {res["config"]: res for res in report["results"]}
    assert set(results) == {"1x2", "1x1", "2x1-shard", "2x1-repl"}
    for res in results.values():
        assert res["heads"] == 8 and len(res["step_ms_rounds"]) == 1 and res["step_ms_median"] > 0
        for key in ("step_ms_min", "step_ms_max", "param_bytes_per_rank", "param_bytes_total",
                    "state_bytes_per_rank", "train_peak_over_before_model_bytes_per_rank", "peak_method",
                    "comm_count_per_step", "comm_bytes_in_per_step", "comm_bytes_out_per_step"):
            assert key in res, key
        world = res["processes"]
        assert len(res["param_bytes_per_rank"]) == world
        assert all(b * world == res["param_bytes_total"] for b in res["param_bytes_per_rank"]), res
    assert results["1x2"]["comm_count_per_step"] == [0]
    assert results["2x1-shard"]["comm_count_per_step"] == [0, 0]
    assert results["2x1-shard"]["comm_bytes_in_per_step"] == [0, 0]
    # The replicated output: one all-gather of the [4, 8] float32 output, half of it from each rank.
    assert results["2x1-repl"]["comm_count_per_step"] == [1, 1]
    assert results["2x1-repl"]["comm_bytes_in_per_step"] == [4 * 4 * 4] * 2
    assert results["2x1-repl"]["comm_bytes_out_per_step"] == [4 * 8 * 4] * 2
    assert "| heads |" in r.stdout
