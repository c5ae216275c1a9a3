"""``scripts/bench_simd_ops.py`` (simd through its C++ ops against ctypes) runs end to end.

A smoke test only: no timing is asserted (the figures are in docs/results/simd-ops-avx512.json,
measured by the script itself).
"""

import os
import shutil

import pytest
from _params import tiny_script_run

from blockdiag.backends import get


@pytest.mark.skipif(get("simd").unavailable_reason() is not None, reason="simd unavailable here")
@pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "c++") is None, reason="no C++ compiler: the ops cannot be built")
def test_bench_simd_ops_tiny_run_writes_its_json(tmp_path):
    d = tiny_script_run("bench_simd_ops.py", tmp_path)
    (row,) = d["rows"]
    assert (row["batch"], row["groups"], row["block_in"], row["block_out"]) == (8, 3, 4, 2)
    assert set(row["times_us"]) == {"forward_ops", "forward_ctypes", "train_ops", "train_ctypes"}
    assert all(v > 0 for v in row["times_us"].values())
    assert d["summary"]["train"]["geomean_ops_over_ctypes"] == row["train_ops_over_ctypes"]
    assert d["command"].startswith("python scripts/bench_simd_ops.py --batch 8")
