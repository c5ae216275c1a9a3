"""torch.compile's fixed cost on a small training step, against the eager step it replaces.

Issue 21 asks compiled blockdiag to be no slower than eager blockdiag. At small shapes a
compiled training step pays a fixed runtime cost (guards, the AOTAutograd wrappers, the
compiled backward's autograd node) that can exceed the whole eager step; this script shows
that cost for a plain ``nn.Linear`` too, so a reader can tell torch.compile's floor from
blockdiag's own overhead. Rounds are interleaved; medians are printed.

    python scripts/bench_compile_floor.py [--batch 32] [--groups 4] [--block 10x10] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import blockdiag


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32, help="rows (default 32)")
    ap.add_argument("--groups", type=int, default=4, help="groups (default 4)")
    ap.add_argument("--block", default="10x10", help="IN x OUT per group (default 10x10)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--steps", type=int, default=200, help="training steps per round (default 200)")
    args = ap.parse_args()
    i, o = (int(v) for v in args.block.split("x"))
    g = args.groups
    torch.manual_seed(0)
    x = torch.randn(args.batch, g * i)

    def step(m):
        def run():
            m(x).sum().backward()
        return run

    cases = {
        "eager nn.Linear (one dense layer)": step(torch.nn.Linear(g * i, g * o)),
        "compiled nn.Linear": step(torch.compile(torch.nn.Linear(g * i, g * o))),
        "eager GroupedLinear": step(blockdiag.GroupedLinear(g * i, g * o, g)),
        "compiled GroupedLinear": step(torch.compile(blockdiag.GroupedLinear(g * i, g * o, g))),
    }
    for run in cases.values():  # compile and warm up
        for _ in range(50):
            run()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for k, run in cases.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                run()
            times[k].append((time.perf_counter() - t) / args.steps * 1e6)
    print(f"training step, B={args.batch} G={g} {i}x{o}, {torch.get_num_threads()} threads, median of {args.rounds}")
    for k, v in times.items():
        print(f"  {k:36s} {statistics.median(v):9.1f} us")


if __name__ == "__main__":
    main()
