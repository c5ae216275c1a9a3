"""``scripts/bench_mlp_heads.py`` (the timings behind a traced GroupedMLP's heads rule) runs end to end.

A smoke test only: no timing is asserted (the figures are in
docs/results/mlp-heads-strategy-avx512.json, measured by the script itself).
"""

from _params import tiny_script_run


def test_bench_mlp_heads_tiny_run_writes_its_json(tmp_path):
    d = tiny_script_run("bench_mlp_heads.py", tmp_path)
    (row,) = d["rows"]
    assert (row["batch"], row["groups"], row["block_in"], row["block_out"]) == (8, 3, 4, 2)
    assert set(row["times_us"]) == {"auto", "heads", "loop", "auto_c", "heads_c", "loop_c"}
    assert all(v > 0 for v in row["times_us"].values()) and row["auto_strategy"] in ("fm_chain", "layers", "heads")
    assert d["command"].startswith("python scripts/bench_mlp_heads.py --batch 8")
