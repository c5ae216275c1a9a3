"""``simd``'s gradient kernels against torch's BLAS products of the same gradients.

``simd`` computes its gradients with its own kernels or with torch's BLAS products, by the
rule of ``blockdiag.backends._simd_ops.blas_grads``: both gradients BLAS's from
``BLAS_GRADS_MIN_BLOCK`` elements a block, the weight gradient alone from
``BLAS_WEIGHT_GRAD_MIN_BLOCK`` over at most ``BLAS_WEIGHT_GRAD_MAX_ROWS`` rows (more with
many groups: ``BLAS_WEIGHT_GRAD_MANY_*``). BLAS's products
are the ``loop`` backend's backward: the input gradient one ``mm`` per group written into its
slice, the weight gradient one ``bmm`` of strided views, the bias gradient a ``sum``. This
script times both methods on the same operands at each point, the input gradient and the
weight and bias gradients apart, in interleaved rounds (``blockdiag.tuning.measure``), the
median kept; BLAS over kernels per point (below 1: BLAS is faster). The rule rests on it.

The kernels are timed as simd calls them: through its C++ ops (``--route op``, the default),
built in this process with the rule off so that they run the kernels at every size, or
through its ctypes wrappers (``--route ctypes``, whose Python adds to small calls). BLAS's
products are called from Python, so at small sizes BLAS is charged a few microseconds the
C++ ops' BLAS branch does not pay. Below ``BLAS_GRADS_MIN_BLOCK`` each point also times
simd's whole training step (forward and backward, through its ctypes route, which reads the
rule per call) with the weight gradient by each method: a gradient faster alone can still
make the step slower (the weight gradient rule rests on the steps).

    OMP_NUM_THREADS=1 python scripts/bench_simd_blas_grads.py [--rounds 11] [--json docs/results/simd-blas-grads-avx512.json]
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from blockdiag import grouped_linear, tuning
from blockdiag.backends import _simd_ops, get, simd
from blockdiag.backends.loop import _backward as blas_backward
from blockdiag.cli._args import _kernel_grid_options
from blockdiag.cli._run import _provenance
from blockdiag.profile import device_name, write_json_atomic

BATCHES = (32, 256, 512, 2048)
GROUPS = (4, 16, 32, 50)
BLOCKS = ((64, 64), (128, 128), (64, 256), (256, 64), (256, 256), (512, 512))
ROUTES = ("op", "ctypes")
# What the rule is switched off with in this process (the C++ ops are built with it).
_NEVER = 1 << 62
# The largest problems are left out (B=2048 G=16 512x512 is minutes per point on 2 cores).
MAX_MACS = 2048 * 16 * 256 * 256 // 4


@contextlib.contextmanager
def _weight_by(method: str):
    """simd's weight gradient computed by ``method`` ("blas" or "kernels") at every size, within."""
    names = ("BLAS_WEIGHT_GRAD_MIN_BLOCK", "BLAS_WEIGHT_GRAD_MAX_ROWS", "BLAS_WEIGHT_GRAD_MIN_GROUPS")
    saved = [getattr(_simd_ops, k) for k in names]
    for k, v in zip(names, (0, _NEVER, 0) if method == "blas" else (_NEVER, 0, _NEVER)):
        setattr(_simd_ops, k, v)
    try:
        yield
    finally:
        for k, v in zip(names, saved):
            setattr(_simd_ops, k, v)


def _train_step(x, w, b, gy, method: str):
    """simd's training step through its ctypes route, the weight gradient by ``method``
    (the ctypes route reads the rule per call; the C++ ops were built with one)."""
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))

    def step():
        with _simd_ops.through_ctypes(), _weight_by(method):
            grouped_linear(x, w, b, backend="simd").backward(gy)
        x.grad = w.grad = b.grad = None

    return step


def measure(batch: int, groups: int, i: int, o: int, dtype: torch.dtype, rounds: int, min_time: float,
            route: str = "ctypes", steps_too: bool = False) -> dict:
    """One point's row: the median time of each gradient by each method, in microseconds; with
    ``steps_too``, also a whole training step with the weight gradient by each method."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, groups * i, generator=gen, dtype=dtype)
    w = torch.randn(groups, o, i, generator=gen, dtype=dtype)
    gy = torch.randn(batch, groups * o, generator=gen, dtype=dtype)
    b = torch.randn(groups * o, generator=gen, dtype=dtype)
    if route == "op":
        native = _simd_ops.ops(dtype)
        kernels_x = lambda: native.backward(gy, x, w, False, True, False)  # noqa: E731
        kernels_w = lambda: native.backward(gy, x, w, True, False, True)  # noqa: E731
    else:
        kernels_x = lambda: simd._grad_input(gy, w)  # noqa: E731
        kernels_w = lambda: simd._grad_weight(gy, x, w.shape, True)  # noqa: E731
    steps = {
        "input_kernels": kernels_x,
        "input_blas": lambda: blas_backward(gy, x, w, False, True, False),
        "weight_kernels": kernels_w,
        "weight_blas": lambda: blas_backward(gy, x, w, True, False, True),
    }
    if steps_too:
        steps.update(step_weight_kernels=_train_step(x, w, b, gy, "kernels"),
                     step_weight_blas=_train_step(x, w, b, gy, "blas"))
    # bench's timer: warm-up, calibrated samples, interleaved rounds, medians; nothing pruned.
    times, failed = tuning.measure(steps, "cpu", rounds, min_time, prune=0.0)
    if failed:
        raise RuntimeError(f"bench_simd_blas_grads: B={batch} G={groups} {i}x{o}: {failed}")
    med = {k: round(t * 1e6, 2) for k, t in times.items()}
    return {"batch": batch, "groups": groups, "block_in": i, "block_out": o, "times_us": med,
            **{f"{g}_blas_over_kernels": round(med[f"{g}_blas"] / med[f"{g}_kernels"], 4)
               for g in ("input", "weight", "step_weight") if f"{g}_blas" in med}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _kernel_grid_options(ap, 11, BATCHES, GROUPS, BLOCKS)
    ap.add_argument("--route", choices=ROUTES, default="op",
                    help="call the kernels through simd's C++ ops (built here with the BLAS rule off) or its "
                         "ctypes wrappers (default op)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    why = get("simd").unavailable_reason()
    if why is not None:
        print(f"bench_simd_blas_grads: simd is unavailable here: {why}", file=sys.stderr)
        return 2
    rule = {"blas_grads_min_block": _simd_ops.BLAS_GRADS_MIN_BLOCK,
            "blas_weight_grad_min_block": _simd_ops.BLAS_WEIGHT_GRAD_MIN_BLOCK,
            "blas_weight_grad_max_rows": _simd_ops.BLAS_WEIGHT_GRAD_MAX_ROWS,
            "blas_weight_grad_min_groups": _simd_ops.BLAS_WEIGHT_GRAD_MIN_GROUPS,
            "blas_weight_grad_many": {"groups": _simd_ops.BLAS_WEIGHT_GRAD_MANY_GROUPS,
                                      "max_rows": _simd_ops.BLAS_WEIGHT_GRAD_MANY_MAX_ROWS,
                                      "min_in": _simd_ops.BLAS_WEIGHT_GRAD_MANY_MIN_IN}}
    points = [(bsz, g, i, o) for bsz in args.batch for g in args.groups for i, o in args.blocks
              if bsz * g * i * o <= MAX_MACS]
    runs = {pt: _simd_ops.blas_grads(*pt) for pt in points}  # the rule as the library has it
    both_least = _simd_ops.BLAS_GRADS_MIN_BLOCK
    if args.route == "op":
        # Before simd's first call, which builds and loads its C++ ops with these constants.
        _simd_ops.BLAS_GRADS_MIN_BLOCK = _simd_ops.BLAS_WEIGHT_GRAD_MIN_BLOCK = _NEVER
    grouped_linear(torch.randn(2, 4, dtype=dtype), torch.randn(2, 2, 2, dtype=dtype), backend="simd")  # loads it
    if args.route == "op" and _simd_ops.ops(dtype) is None:
        print(f"bench_simd_blas_grads: simd's C++ ops are not ready here: {_simd_ops.note()}; try --route ctypes",
              file=sys.stderr)
        return 2
    rows = []
    for bsz, g, i, o in points:
        # Below BLAS_GRADS_MIN_BLOCK the weight gradient's method is the rule's own choice:
        # whole training steps with each say what it does to a step.
        row = measure(bsz, g, i, o, dtype, args.rounds, args.min_time, args.route, steps_too=i * o < both_least)
        row["simd_runs"] = {k: "BLAS" if v else "kernels" for k, v in zip(("input", "weight"), runs[bsz, g, i, o])}
        rows.append(row)
        step = row.get("step_weight_blas_over_kernels")
        print(f"B={bsz} G={g} {i}x{o}: BLAS/kernels {row['input_blas_over_kernels']:.2f} input gradient, "
              f"{row['weight_blas_over_kernels']:.2f} weight and bias"
              + (f", {step:.2f} training step (weight gradient by each)" if step is not None else ""), flush=True)
    doc = {"what": f"simd's gradient kernels (through its {'C++ ops' if args.route == 'op' else 'ctypes wrappers'}) "
                   "against torch's BLAS products of the same gradients (the loop backend's backward), on the same "
                   "operands; medians of interleaved rounds", "route": args.route, **rule,
           "command": "python scripts/bench_simd_blas_grads.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "device_name": device_name("cpu"), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "dtype": args.dtype, "rounds": args.rounds,
           "simd_variant": simd.variant(), **_provenance(), "rows": rows}
    if args.json:
        write_json_atomic(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
