"""``scripts/bench_simd_blas_grads.py`` (simd's gradient kernels against torch's BLAS) runs end to end.

A smoke test only: no timing is asserted (the figures are in
docs/results/simd-blas-grads-avx512.json, measured by the script itself).
"""

import pytest
import torch
from _params import tiny_script_run

from blockdiag import grouped_linear
from blockdiag.backends import _simd_ops, get


@pytest.mark.skipif(get("simd").unavailable_reason() is not None, reason="simd unavailable here")
def test_bench_simd_blas_grads_tiny_run_writes_its_json(tmp_path):
    # The script calls the kernels through simd's C++ ops (built in its process with the
    # BLAS rule off): without a C++ compiler it refuses, as simd then runs through ctypes.
    grouped_linear(torch.randn(2, 4), torch.randn(2, 2, 2), backend="simd")
    if _simd_ops.ops(torch.float32) is None:
        pytest.skip(f"simd's C++ ops are not ready here: {_simd_ops.note()}")
    d = tiny_script_run("bench_simd_blas_grads.py", tmp_path)
    (row,) = d["rows"]
    assert (row["batch"], row["groups"], row["block_in"], row["block_out"]) == (8, 3, 4, 2)
    assert set(row["times_us"]) == {"input_kernels", "input_blas", "weight_kernels", "weight_blas",
                                    "step_weight_kernels", "step_weight_blas"}  # 4x2 blocks: the steps too
    assert all(v > 0 for v in row["times_us"].values())
    t = row["times_us"]
    # The ratio is rounded to 4 decimals in the file: a tiny one keeps few significant digits.
    assert row["weight_blas_over_kernels"] == pytest.approx(t["weight_blas"] / t["weight_kernels"], rel=1e-2, abs=6e-5)
    assert d["blas_grads_min_block"] == _simd_ops.BLAS_GRADS_MIN_BLOCK
    assert d["blas_weight_grad_max_rows"] == _simd_ops.BLAS_WEIGHT_GRAD_MAX_ROWS
    assert d["blas_weight_grad_many"]["max_rows"] == _simd_ops.BLAS_WEIGHT_GRAD_MANY_MAX_ROWS
    assert d["route"] == "op" and row["simd_runs"] == {"input": "kernels", "weight": "kernels"}
    assert d["command"].startswith("python scripts/bench_simd_blas_grads.py --batch 8")
