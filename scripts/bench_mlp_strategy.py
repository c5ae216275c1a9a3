"""GroupedMLP's two strategies, the feature-major chain and the layers, timed against each other.

``GroupedMLP(strategy="auto")`` runs the chain or the layers. The measured table holds one
layer's product at a time, and each table time includes the layout changes a lone layer
pays (``bmm_fm`` transposes its input and its output); the chain pays them once for the
whole model, and between layers whose backends differ the layers pay more. So the table's
per-layer sums cannot rank the two strategies, and this script times the models themselves.
For each model and batch: an Adam training step (``train``) and an inference forward
(``forward``), each strategy forced, in interleaved rounds (the order rotated each round),
the median kept. It records what ``auto`` decides and the table's per-layer sums beside it.
The CPU rule in ``blockdiag/nn/mlp/strategy.py`` (``CHAIN_WHEREVER_ALLOWED``) rests on this.

    python scripts/bench_mlp_strategy.py [--rounds 15] [--json docs/results/mlp-strategy-cpu.json]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import time

import torch
from torch import nn

import blockdiag
from blockdiag.cli._args import _output_json, _positive
from blockdiag.cli._run import _provenance
from blockdiag.profile import device_name, write_json_atomic

# (heads, [in, hidden..., out], batches): the forum's model first, then wider blocks, then
# models with one hidden layer (one grouped layer after the shared one: no layout change
# between grouped layers for the chain to save), the last ones with 256x256 blocks, where the
# grouped layer's own backend is a bmm_fm variant at small batches.
MODELS = [
    (50, [150, 10, 10, 1], [64, 256, 1024]),
    (16, [64, 64, 64, 8], [256, 2048]),
    (8, [32, 128, 128, 4], [512]),
    (4, [256, 256, 256, 16], [256]),
    (50, [10, 10, 10], [256, 2048]),
    (50, [150, 10, 10], [2048]),
    (16, [64, 64, 64], [256, 2048]),
    (4, [64, 64, 64], [2048]),
    (4, [256, 256, 256], [32, 256]),
    (16, [256, 256, 256], [32, 256]),
]


def _heads(h: int, sizes: list[int]) -> nn.ModuleList:
    def head():
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(sizes):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1])

    return nn.ModuleList(head() for _ in range(h))


def _runner(model: blockdiag.GroupedMLP, x: torch.Tensor, y: torch.Tensor, mode: str):
    if mode == "forward":
        def run():
            with torch.no_grad():
                model(x)
        return run
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return step


def _median_times(fns: dict, rounds: int) -> dict:
    for f in fns.values():  # warm: plans, caches, the kernels' first-use build
        f()
        f()
    calls = {}
    for k, f in fns.items():  # calls per sample: about 5 ms
        t = time.perf_counter()
        f()
        calls[k] = max(1, int(5e-3 / max(time.perf_counter() - t, 1e-7)))
    samples = {k: [] for k in fns}
    keys = list(fns)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[: r % len(keys)]:
            t = time.perf_counter()
            for _ in range(calls[k]):
                fns[k]()
            samples[k].append((time.perf_counter() - t) / calls[k])
    return {k: statistics.median(v) * 1e6 for k, v in samples.items()}


def measure(rounds: int, models=MODELS) -> list[dict]:
    """One row per model, batch and mode: both strategies' median times and ``auto``'s pick."""
    rows = []
    for h, sizes, batches in models:
        torch.manual_seed(0)
        heads = _heads(h, sizes)
        for batch in batches:
            x = torch.randn(batch, sizes[0])
            y = torch.randn(batch, h * sizes[-1])
            for mode in ("train", "forward"):
                fns = {}
                for strategy in ("fm_chain", "layers"):
                    model = blockdiag.GroupedMLP.from_heads(copy.deepcopy(heads), strategy=strategy)
                    fns[strategy] = _runner(model, x, y, mode)
                auto = blockdiag.GroupedMLP.from_heads(copy.deepcopy(heads))
                with torch.set_grad_enabled(mode == "train"):
                    plan = auto.plan(x)
                times = _median_times(fns, rounds)
                rows.append({
                    "heads": h, "sizes": sizes, "batch": batch, "mode": mode,
                    "times_us": {k: round(v, 1) for k, v in times.items()},
                    "chain_over_layers": round(times["fm_chain"] / times["layers"], 3),
                    "auto": plan.strategy,
                    "layer_backends": [p.backend for p in plan.layers],
                    "table_chain_us": None if plan.chain_us is None else round(plan.chain_us, 1),
                    "table_layers_us": None if plan.layers_us is None else round(plan.layers_us, 1),
                })
                r = rows[-1]
                print(f"{h} heads {sizes} B={batch} {mode}: chain {r['times_us']['fm_chain']:.0f} us, "
                      f"layers {r['times_us']['layers']:.0f} us ({r['chain_over_layers']:.2f}); auto runs {r['auto']}",
                      flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=_positive, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--json", type=_output_json, help="write the rows and a summary to this file")
    ap.add_argument("--tiny", action="store_true", help="one tiny model (a smoke test; default off)")
    args = ap.parse_args()
    rows = measure(args.rounds, [(3, [6, 4, 2], [5])] if args.tiny else MODELS)
    ratios = [r["chain_over_layers"] for r in rows]
    summary = {
        "points": len(rows),
        "chain_faster": sum(v < 1 for v in ratios),
        "chain_over_layers_min": min(ratios),
        "chain_over_layers_max": max(ratios),
        "chain_over_layers_geomean": round(statistics.geometric_mean(ratios), 3),
        # Of the points where auto runs one of the two timed strategies (not the heads).
        "auto_ran_the_faster": sum((r["auto"] == "fm_chain") == (r["chain_over_layers"] <= 1) for r in rows
                                   if r["auto"] in ("fm_chain", "layers")),
    }
    print(json.dumps(summary))
    if args.json:
        doc = {
            "what": "GroupedMLP: the feature-major chain against the layers (each with auto's backends), "
                    "Adam training step and inference forward, medians of interleaved rounds",
            "command": "python scripts/bench_mlp_strategy.py " + ("--tiny " if args.tiny else "") + "--json " + args.json,
            "device_name": device_name("cpu"),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "rounds": args.rounds,
            "statistic": "median",
            **_provenance(),  # created, commit, commit_dirty, blockdiag: as bench --json records them
            "summary": summary,
            "rows": rows,
        }
        write_json_atomic(args.json, doc)


if __name__ == "__main__":
    main()
