"""``simd``'s gradient kernels against torch's BLAS products of the same gradients.

``simd`` computes its gradients with its own kernels below ``BLAS_GRADS_MIN_BLOCK``
(``blockdiag/backends/_simd_ops.py``) and with torch's BLAS products at blocks that large
or larger: the input gradient one ``mm`` per group written into its slice, the weight
gradient one ``bmm`` of strided views, the bias gradient a ``sum`` (the ``loop`` backend's
backward). This script times both on the same operands at each point, the input gradient
and the weight and bias gradients apart, in interleaved rounds, the median kept; BLAS over
kernels per point (below 1: BLAS is faster), timed by ``blockdiag.tuning.measure``. The rule rests on it.

    OMP_NUM_THREADS=1 python scripts/bench_simd_blas_grads.py [--rounds 11] [--json docs/results/simd-blas-grads-avx512.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from blockdiag import grouped_linear, tuning
from blockdiag.backends import _simd_ops, get, simd
from blockdiag.backends.loop import _backward as blas_backward
from blockdiag.cli import _kernel_grid_options, _provenance
from blockdiag.profile import device_name

BATCHES = (32, 256, 2048)
GROUPS = (4, 16)
BLOCKS = ((64, 64), (128, 128), (64, 256), (256, 64), (256, 256), (512, 512))
# The largest problems are left out (B=2048 G=16 512x512 is minutes per point on 2 cores).
MAX_MACS = 2048 * 16 * 256 * 256 // 4


def measure(batch: int, groups: int, i: int, o: int, dtype: torch.dtype, rounds: int, min_time: float) -> dict:
    """One point's row: the median time of each gradient by each method, in microseconds."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, groups * i, generator=gen, dtype=dtype)
    w = torch.randn(groups, o, i, generator=gen, dtype=dtype)
    gy = torch.randn(batch, groups * o, generator=gen, dtype=dtype)
    steps = {
        "input_kernels": lambda: simd._grad_input(gy, w),
        "input_blas": lambda: blas_backward(gy, x, w, False, True, False),
        "weight_kernels": lambda: simd._grad_weight(gy, x, w.shape, True),
        "weight_blas": lambda: blas_backward(gy, x, w, True, False, True),
    }
    # bench's timer: warm-up, calibrated samples, interleaved rounds, medians; nothing pruned.
    times, failed = tuning.measure(steps, "cpu", rounds, min_time, prune=0.0)
    if failed:
        raise RuntimeError(f"bench_simd_blas_grads: B={batch} G={groups} {i}x{o}: {failed}")
    med = {k: round(t * 1e6, 2) for k, t in times.items()}
    return {"batch": batch, "groups": groups, "block_in": i, "block_out": o, "times_us": med,
            **{f"{g}_blas_over_kernels": round(med[f"{g}_blas"] / med[f"{g}_kernels"], 4) for g in ("input", "weight")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _kernel_grid_options(ap, 11, BATCHES, GROUPS, BLOCKS)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    why = get("simd").unavailable_reason()
    if why is not None:
        print(f"bench_simd_blas_grads: simd is unavailable here: {why}", file=sys.stderr)
        return 2
    grouped_linear(torch.randn(2, 4, dtype=dtype), torch.randn(2, 2, 2, dtype=dtype), backend="simd")  # loads it
    rows = []
    for bsz in args.batch:
        for g in args.groups:
            for i, o in args.blocks:
                if bsz * g * i * o > MAX_MACS:
                    continue
                row = measure(bsz, g, i, o, dtype, args.rounds, args.min_time)
                rows.append(row)
                print(f"B={bsz} G={g} {i}x{o}: BLAS/kernels {row['input_blas_over_kernels']:.2f} input gradient, "
                      f"{row['weight_blas_over_kernels']:.2f} weight and bias", flush=True)
    doc = {"what": "simd's gradient kernels (through ctypes) against torch's BLAS products of the same gradients "
                   "(the loop backend's backward), on the same operands; medians of interleaved rounds",
           "command": "python scripts/bench_simd_blas_grads.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "device_name": device_name("cpu"), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "dtype": args.dtype, "rounds": args.rounds, "blas_grads_min_block": _simd_ops.BLAS_GRADS_MIN_BLOCK,
           "simd_variant": simd.variant(), **_provenance(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
