"""GroupedMLP's ``heads`` strategy against ``auto`` and the loop of heads, eager and compiled.

``strategy="heads"`` runs each head's layers in turn, as the loop of ``nn.Sequential`` heads
does. This script times, at each point of ``blockdiag bench``'s grid and for the model
``bench --compiled mlp`` times (``GroupedMLP(i, [o], o, heads=G)``), a training step
(forward, then backward with a fixed gradient; the parameters require grad, the input does
not) of ``auto``, of ``heads`` and of the loop of heads, each eager and under
``torch.compile(dynamic=False)`` (keys with ``_c``), in interleaved rounds, the median kept.
The rule by which a traced ``auto`` runs the heads (``TRACED_HEADS_RULE`` in
``blockdiag/nn/mlp/strategy.py``) rests on it.

    OMP_NUM_THREADS=1 python scripts/bench_mlp_heads.py [--rounds 5] [--json docs/results/mlp-heads-strategy-avx512.json]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import timeit

import torch

import blockdiag
from blockdiag.cli._args import _finite_nonneg_float, _output_json, _positive
from blockdiag.cli._run import _provenance
from blockdiag.profile import device_name, write_json_atomic
from blockdiag.tuning._compiled import _HeadsLoop

# blockdiag bench's target grid, as bench --compiled runs it.
BATCHES = (32, 256, 2048)
GROUPS = (4, 16, 50)
BLOCKS = ((10, 10), (64, 64), (150, 10), (256, 256))


def points(batches=BATCHES, groups=GROUPS, blocks=BLOCKS) -> list[tuple[int, int, int, int]]:
    """(batch, heads, in, out) of each point (the largest models at 50 heads are left out, as bench's grid does)."""
    return [(b, g, i, o) for b in batches for g in groups for i, o in blocks
            if not (b == 2048 and g == 50 and (i, o) != (150, 10))]


def measure(batch: int, heads: int, i: int, o: int, rounds: int, min_time: float) -> dict:
    """One point's row: the median step time of each model, eager and compiled, in microseconds."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    auto = blockdiag.GroupedMLP(i, [o], o, heads=heads)
    by_heads = copy.deepcopy(auto)
    by_heads.strategy = "heads"
    loop = _HeadsLoop(auto.to_heads(), None)
    x, gy = torch.randn(batch, i), torch.randn(batch, heads * o)
    calls = {}
    for name, model in (("auto", auto), ("heads", by_heads), ("loop", loop)):
        calls[name] = model
        calls[name + "_c"] = torch.compile(model, dynamic=False)

    def step(call):
        return lambda: call(x).backward(gy)

    steps = {k: step(c) for k, c in calls.items()}
    for s in steps.values():  # compile, and warm up
        s()
        s()
    once = min(timeit.repeat(steps["auto"], number=1, repeat=3))
    number = max(1, int(min_time / once))
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for k, s in steps.items():
            times[k].append(min(timeit.repeat(s, number=number, repeat=2)) / number * 1e6)
    med = {k: round(statistics.median(v), 2) for k, v in times.items()}
    return {"batch": batch, "groups": heads, "block_in": i, "block_out": o, "times_us": med,
            "auto_strategy": auto.plan(x).strategy,
            "heads_over_auto": round(med["heads"] / med["auto"], 4),
            "heads_over_auto_compiled": round(med["heads_c"] / med["auto_c"], 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=_positive, default=5)
    ap.add_argument("--min-time", type=_finite_nonneg_float, default=0.02, help="seconds each sample lasts at least")
    ap.add_argument("--batch", type=lambda s: tuple(map(int, s.split(","))), default=BATCHES)
    ap.add_argument("--groups", type=lambda s: tuple(map(int, s.split(","))), default=GROUPS)
    ap.add_argument("--blocks", type=lambda s: tuple(tuple(map(int, b.split("x"))) for b in s.split(",")), default=BLOCKS)
    ap.add_argument("--json", type=_output_json, help="write the rows and how they were measured here")
    args = ap.parse_args(argv)
    rows = []
    for p in points(args.batch, args.groups, args.blocks):
        row = measure(*p, rounds=args.rounds, min_time=args.min_time)
        rows.append(row)
        print(f"B={p[0]} G={p[1]} {p[2]}x{p[3]}: auto runs {row['auto_strategy']}; heads/auto "
              f"{row['heads_over_auto']:.3f} eager, {row['heads_over_auto_compiled']:.3f} compiled", flush=True)
    if args.json:
        doc = {"what": "GroupedMLP(i, [o], o, heads=G): strategy='heads' against auto and the loop of heads, "
                       "eager and compiled (_c), training step, medians of interleaved rounds",
               "command": "python scripts/bench_mlp_heads.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "device_name": device_name("cpu"), "threads": torch.get_num_threads(), "torch": torch.__version__,
               "rounds": args.rounds, **_provenance(), "rows": rows}
        write_json_atomic(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
