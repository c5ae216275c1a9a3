"""``blockdiag demo``: the forum's loop of heads against the same heads as one ``GroupedMLP``."""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from ._checks import _check_demo_memory


class LoopOfHeads(nn.Module):
    """The forum's ``ModelSerial``: a Python loop over independent heads, then ``cat``."""

    def __init__(self, heads: nn.ModuleList):
        super().__init__()
        self.blocks = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x) for b in self.blocks], dim=-1)


def _make_heads(n_heads: int, in_f: int, hidden: list[int], out_f: int) -> nn.ModuleList:
    def head():
        sizes = [in_f, *hidden, out_f]
        mods: list[nn.Module] = []
        for k in range(len(sizes) - 1):
            mods.append(nn.Linear(sizes[k], sizes[k + 1]))
            if k < len(sizes) - 2:
                mods.append(nn.ReLU())
        return nn.Sequential(*mods)

    return nn.ModuleList(head() for _ in range(n_heads))


def _train_epoch(model, xs, ys, opt, batch):
    total, t0 = 0.0, time.perf_counter()
    for k in range(0, xs.shape[0], batch):
        xb, yb = xs[k:k + batch], ys[k:k + batch]
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        total += loss.item() * xb.shape[0]
    return time.perf_counter() - t0, total / xs.shape[0]


def cmd_demo(args) -> int:
    from .. import GroupedMLP

    _check_demo_memory(args)

    torch.manual_seed(args.seed)
    heads = _make_heads(args.heads, args.in_features, args.hidden, args.out_features)
    slow = LoopOfHeads(heads)
    fast = GroupedMLP.from_heads(copy.deepcopy(heads))
    n = args.samples
    xs = torch.randn(n, args.in_features)
    # A smooth target that every head can fit: a random linear map of a non-linearity.
    proj = torch.randn(args.in_features, args.heads * args.out_features) / args.in_features**0.5
    ys = torch.tanh(xs @ proj)
    with torch.no_grad():
        start_diff = (slow(xs[:256]) - fast(xs[:256])).abs().max().item()
    print(
        f"blockdiag demo: {args.heads} heads of "
        f"{' -> '.join(map(str, [args.in_features, *args.hidden, args.out_features]))}"
        f"{' (ReLU)' if args.hidden else ''}, "
        f"{n} samples, batch {args.batch}, Adam lr={args.lr}, {torch.get_num_threads()} threads"
    )
    print(f"same start: largest output difference {start_diff:.2e}")
    opt_s = torch.optim.Adam(slow.parameters(), lr=args.lr)
    opt_f = torch.optim.Adam(fast.parameters(), lr=args.lr)
    print(f"{'epoch':>5} {'loop s':>9} {'loop loss':>12} {'grouped s':>10} {'grouped loss':>13} {'speed-up':>9}")
    ts, tf, maxdiff = [], [], 0.0
    for ep in range(1, args.epochs + 1):
        # Interleave the two so that machine noise hits both alike.
        t_s, l_s = _train_epoch(slow, xs, ys, opt_s, args.batch)
        t_f, l_f = _train_epoch(fast, xs, ys, opt_f, args.batch)
        ts.append(t_s)
        tf.append(t_f)
        maxdiff = max(maxdiff, abs(l_s - l_f))
        print(f"{ep:5d} {t_s:9.3f} {l_s:12.6f} {t_f:10.3f} {l_f:13.6f} {t_s / t_f:8.1f}x")
    # statistics.median: of an even count, the mean of the middle two (the upper one alone was,
    # at --epochs 2, the slower epoch: the first, which pays the warm-up).
    med_s, med_f = statistics.median(ts), statistics.median(tf)
    print(f"median epoch: loop {med_s:.3f} s, GroupedMLP {med_f:.3f} s -> speed-up {med_s / med_f:.1f}x")
    print(f"largest difference between the two models' epoch losses: {maxdiff:.2e}")
    return 0
