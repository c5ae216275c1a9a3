"""Writing a feature-major product into rows directly, against writing it and copying.

``bmm_fm``'s product ``W_g @ x_g^T`` comes out as ``[G, out, N]``: a transposed view of the
``[N, G*out]`` result. A caller that must return a contiguous result (the ``auto`` op in a
compiled graph) either copies that view (``.contiguous()``) or hands the batched GEMM a
strided ``out=`` view of a new row-major tensor (``OpEntry.rows``), which writes each group's
rows as runs of ``out`` elements. The same choice arises for the input gradient, whose runs
are ``in`` elements. ``blockdiag.ops._define.ROWS_MIN_RUN_BYTES`` is the run length from which
the direct write is taken; this script shows where it pays on the machine it runs on.
Rounds are interleaved; medians are printed, with direct/copy (below 1: the direct write wins).

With ``--compiled`` it times instead what ``blockdiag.ops.auto.ROWS_OP_MIN_BATCH`` decides: a
compiled training step of ``GroupedLinear`` whose ``auto`` chooses ``bmm_fm_bmm``, traced once
with the choice inlined (a transposed output, so AOTAutograd transposes the gradient) and once
as the ``blockdiag::auto`` op (rows written directly, Python kernels), with op/inlined per
point.

    python scripts/bench_rows.py [--batch 32,256,2048] [--groups 4,16] [--runs 8,10,16,32,64,256]
    python scripts/bench_rows.py --compiled [--batch 32,256] [--groups 4,16] [--runs 64,256]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch


def _median_us(fns, rounds: int, reps: int) -> list[float]:
    times: list[list[float]] = [[] for _ in fns]
    for f in fns:
        f()
    for _ in range(rounds):
        for k, f in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            times[k].append((time.perf_counter() - t0) / reps * 1e6)
    return [statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="32,256,2048", help="rows, comma-separated")
    ap.add_argument("--groups", default="4,16", help="groups, comma-separated")
    ap.add_argument("--runs", default="8,10,16,32,64,256", help="block widths (in = out), comma-separated")
    ap.add_argument("--dtype", default="float32", help="a torch floating dtype (default float32)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--compiled", action="store_true", help="time the compiled training step's two graphs instead")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    if args.compiled:
        _compiled(ints(args.batch), ints(args.groups), ints(args.runs), dtype, args.rounds)
        return
    print(f"{args.dtype}, {torch.get_num_threads()} threads; run = block width in elements "
          f"({dtype.itemsize} bytes each)")
    print(f"{'batch':>6} {'groups':>6} {'run':>4} | {'forward copy/direct us':>24} {'ratio':>6} | "
          f"{'input grad copy/direct us':>26} {'ratio':>6}")
    for n, g, r in itertools.product(ints(args.batch), ints(args.groups), ints(args.runs)):
        x, w, b = torch.randn(n, g * r, dtype=dtype), torch.randn(g, r, r, dtype=dtype), torch.randn(g * r, dtype=dtype)
        gy = torch.randn(n, g * r, dtype=dtype)

        def fwd_copy():
            yt = torch.baddbmm(b.view(g, r, 1), w, x.view(n, g, r).permute(1, 2, 0))
            return yt.permute(2, 0, 1).reshape(n, g * r).contiguous()

        def fwd_direct():
            y = x.new_empty(n, g * r)
            torch.baddbmm(b.view(g, r, 1), w, x.view(n, g, r).permute(1, 2, 0), out=y.view(n, g, r).permute(1, 2, 0))
            return y

        def gx_copy():
            return torch.bmm(gy.view(n, g, r).transpose(0, 1), w).transpose(0, 1).reshape(n, g * r)

        def gx_direct():
            gx = x.new_empty(n, g * r)
            torch.bmm(gy.view(n, g, r).transpose(0, 1), w, out=gx.view(n, g, r).transpose(0, 1))
            return gx

        reps = max(3, min(300, int(3e6 / (n * g * r * r))))
        fc, fd, gc, gd = _median_us([fwd_copy, fwd_direct, gx_copy, gx_direct], args.rounds, reps)
        print(f"{n:>6} {g:>6} {r:>4} | {fc:>11.1f} / {fd:>10.1f} {fd / fc:>6.2f} | "
              f"{gc:>12.1f} / {gd:>11.1f} {gd / gc:>6.2f}", flush=True)


def _compiled(batches, groups, runs, dtype, rounds: int) -> None:
    import torch._dynamo

    from blockdiag import GroupedLinear
    from blockdiag.ops import auto as auto_op

    # Both graphs of a point must be compiled, not served from torch's caches.
    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.fx_graph_cache = False
    torch._dynamo.config.cache_size_limit = 64
    auto_op.choice = lambda x, weight, train: "bmm_fm_bmm"
    threshold = auto_op.ROWS_OP_MIN_BATCH
    print(f"{torch.get_num_threads()} threads; ROWS_OP_MIN_BATCH = {threshold}")
    print(f"{'batch':>6} {'groups':>6} {'run':>4} {'output KiB':>10} | {'eager us':>9} {'inlined us':>10} "
          f"{'op us':>9} | {'op/inlined':>10}")
    for n, g, r in itertools.product(batches, groups, runs):
        torch.manual_seed(0)
        layer = GroupedLinear(g * r, g * r, g, dtype=dtype)
        x = torch.randn(n, g * r, dtype=dtype, requires_grad=True)
        gy = torch.randn(n, g * r, dtype=dtype)
        graphs = {}
        for name, bound in (("inlined", n + 1), ("op", 0)):
            auto_op.ROWS_OP_MIN_BATCH = bound
            graphs[name] = torch.compile(lambda t: layer(t))
            graphs[name](x)  # traced here, under this bound
        auto_op.ROWS_OP_MIN_BATCH = threshold

        def step(fn):
            def run():
                fn(x).backward(gy)
                x.grad = None
                for p in layer.parameters():
                    p.grad = None
            return run

        reps = max(3, min(300, int(3e6 / (n * g * r * r))))
        e, i, o = _median_us([step(layer), step(graphs["inlined"]), step(graphs["op"])], rounds, reps)
        kib = n * g * r * dtype.itemsize / 1024
        print(f"{n:>6} {g:>6} {r:>4} {kib:>10.0f} | {e:>9.1f} {i:>10.1f} {o:>9.1f} | {o / i:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
