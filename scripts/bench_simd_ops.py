"""``simd`` called through its C++ ops against the same kernels called through ctypes.

``simd``'s C kernels are reached either through two C++ torch operators
(``blockdiag::simd_native`` and its backward, ``blockdiag/backends/_simd_ops.cpp``), which do
the operand checks, allocations and calls in C++, or through the ctypes wrappers in
``blockdiag/backends/simd.py``, which do them in Python (what runs without a C++ compiler).
The kernels and their results are the same; this script times the difference at each point:
``grouped_linear(x, w, b, backend="simd")``, the forward under ``no_grad`` and a training step
(forward, then backward with a fixed gradient; input, weight and bias require grad), each
through both routes in interleaved rounds, the median kept, with ops/ctypes per point (below
1: the ops are faster).

    OMP_NUM_THREADS=1 python scripts/bench_simd_ops.py [--rounds 7] [--json docs/results/simd-ops-avx512.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import timeit

import torch

from blockdiag import grouped_linear
from blockdiag.backends import _simd_ops, get
from blockdiag.cli._args import _kernel_grid_options
from blockdiag.cli._run import _provenance
from blockdiag.profile import device_name, write_json_atomic

BATCHES = (32, 256, 2048)
GROUPS = (4, 16, 50)
BLOCKS = ((10, 10), (64, 64), (150, 10))
ROUTES = ("ops", "ctypes")


def _route(name: str):
    """Within it simd's kernels are called through ``name``: "ops" (as armed) or "ctypes"."""
    return _simd_ops.through_ctypes() if name == "ctypes" else contextlib.nullcontext()


def measure(batch: int, groups: int, i: int, o: int, dtype: torch.dtype, rounds: int, min_time: float) -> dict:
    """One point's row: the median forward and training-step time of each route, in microseconds."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, groups * i, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(groups, o, i, generator=gen, dtype=dtype, requires_grad=True)
    b = torch.randn(groups * o, generator=gen, dtype=dtype, requires_grad=True)
    gy = torch.randn(batch, groups * o, generator=gen, dtype=dtype)

    def forward():
        with torch.no_grad():
            grouped_linear(x, w, b, backend="simd")

    def train():
        grouped_linear(x, w, b, backend="simd").backward(gy)
        x.grad = w.grad = b.grad = None

    steps = {(mode, route): fn for mode, fn in (("forward", forward), ("train", train)) for route in ROUTES}
    numbers = {}
    for (mode, route), fn in steps.items():  # warm up, and size each sample
        with _route(route):
            fn()
            once = min(timeit.repeat(fn, number=1, repeat=3))
        numbers[mode, route] = max(1, int(min_time / max(once, 1e-7)))
    times: dict = {k: [] for k in steps}
    order = list(steps.items())
    for r in range(rounds):
        # Every other round in reverse: a step that runs after another's large allocations
        # (page faults, cache) should not always be the same one.
        for (mode, route), fn in order if r % 2 == 0 else order[::-1]:
            with _route(route):
                n = numbers[mode, route]
                times[mode, route].append(min(timeit.repeat(fn, number=n, repeat=2)) / n * 1e6)
    med = {f"{mode}_{route}": round(statistics.median(v), 2) for (mode, route), v in times.items()}
    return {"batch": batch, "groups": groups, "block_in": i, "block_out": o, "times_us": med,
            **{f"{mode}_ops_over_ctypes": round(med[f"{mode}_ops"] / med[f"{mode}_ctypes"], 4)
               for mode in ("forward", "train")}}


def _geomean(values: list[float]) -> float:
    return round(statistics.geometric_mean(values), 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _kernel_grid_options(ap, 7, BATCHES, GROUPS, BLOCKS)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    why = get("simd").unavailable_reason()
    if why is not None:
        print(f"bench_simd_ops: simd is unavailable here: {why}", file=sys.stderr)
        return 2
    grouped_linear(torch.randn(2, 4, dtype=dtype), torch.randn(2, 2, 2, dtype=dtype), backend="simd")  # arms the ops
    if _simd_ops.ops(dtype) is None:
        print(f"bench_simd_ops: simd's C++ ops are not armed here ({_simd_ops.note()})", file=sys.stderr)
        return 2
    rows = []
    for bsz in args.batch:
        for g in args.groups:
            for i, o in args.blocks:
                row = measure(bsz, g, i, o, dtype, args.rounds, args.min_time)
                rows.append(row)
                print(f"B={bsz} G={g} {i}x{o}: ops/ctypes {row['forward_ops_over_ctypes']:.3f} forward, "
                      f"{row['train_ops_over_ctypes']:.3f} train", flush=True)
    summary = {mode: {"geomean_ops_over_ctypes": _geomean([r[f"{mode}_ops_over_ctypes"] for r in rows]),
                      "min_ops_over_ctypes": min(r[f"{mode}_ops_over_ctypes"] for r in rows),
                      "max_ops_over_ctypes": max(r[f"{mode}_ops_over_ctypes"] for r in rows)}
               for mode in ("forward", "train")}
    print(json.dumps(summary))
    if args.json:
        doc = {"what": "grouped_linear(x, w, b, backend='simd'), the forward under no_grad and a training step, "
                       "with the kernels called through simd's C++ ops and through ctypes; medians of interleaved "
                       "rounds",
               "command": "python scripts/bench_simd_ops.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "device_name": device_name("cpu"), "threads": torch.get_num_threads(), "torch": torch.__version__,
               "dtype": args.dtype, "rounds": args.rounds, **_provenance(), "summary": summary, "rows": rows}
        write_json_atomic(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
