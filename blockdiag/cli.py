"""The ``blockdiag`` command (also ``python -m blockdiag``): ``demo`` and the tuning tools.

Every mistake in the arguments (a device this machine lacks, a non-float dtype, a grid too
large for the memory, an output path that cannot be written) is refused before any work
starts, with one line on stderr naming the option and the value, and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import sys
import time
import warnings
from typing import Sequence

import torch
from torch import nn

__all__ = ["main"]


def _parse_hidden(s: str) -> list[int]:
    try:
        out = [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hidden must be comma-separated ints, got {s!r}") from None
    if any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"--hidden sizes must be positive, got {s!r}")
    return out


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {s}")
    return v


def _seed(s: str) -> int:
    # torch.manual_seed takes a 64-bit value; anything else is an error here, not in torch.
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int in [0, 2**64), got {s!r}") from None
    if not 0 <= v < 2**64:
        raise argparse.ArgumentTypeError(f"must be an int in [0, 2**64), got {s}")
    return v


def _learning_rate(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {s!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {s}")
    return v


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


def _check_demo_memory(args) -> None:
    from ._errors import BlockDiagError

    sizes = [args.in_features, *args.hidden, args.out_features]
    params = args.heads * sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    # Two models (the loop and the grouped copy), each with gradients and Adam's two moments;
    # the samples and their targets; float32.
    need = 4 * (2 * 4 * params + args.samples * (args.in_features + args.heads * args.out_features))
    limit = _memory_limit()
    if need > limit:
        raise BlockDiagError(
            f"--heads {args.heads} with these sizes needs about {need / 2**30:.1f} GiB, more than half this "
            f"machine's memory ({limit / 2**30:.1f} GiB)"
        )


def cmd_demo(args) -> int:
    from . import GroupedMLP

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
        f"blockdiag demo: {args.heads} heads of {args.in_features} -> "
        f"{' -> '.join(map(str, args.hidden))} -> {args.out_features} (ReLU), "
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
    med_s, med_f = sorted(ts)[len(ts) // 2], sorted(tf)[len(tf) // 2]
    print(f"median epoch: loop {med_s:.3f} s, GroupedMLP {med_f:.3f} s -> speed-up {med_s / med_f:.1f}x")
    print(f"largest difference between the two models' epoch losses: {maxdiff:.2e}")
    return 0


def _int_list(s: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in s.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None
    if not out or any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"expected positive ints, got {s!r}")
    return out


def _block(s: str) -> tuple[int, int]:
    parts = s.lower().split("x")
    try:
        i, o = (int(v) for v in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a block is IN x OUT such as 150x10, got {s!r}") from None
    if i < 1 or o < 1:
        raise argparse.ArgumentTypeError(f"block sizes must be positive, got {s!r}")
    return i, o


def _blocks(s: str) -> tuple[tuple[int, int], ...]:
    return tuple(_block(v) for v in s.split(",") if v.strip())


# The dtypes blockdiag's layers take (floating point); each backend declares its own subset.
_DTYPES = ("float32", "float64", "float16", "bfloat16")


def _dtype(s: str) -> torch.dtype:
    if s.replace("torch.", "") not in _DTYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(_DTYPES)}, got {s!r}")
    return getattr(torch, s.replace("torch.", ""))


def _device(s: str) -> str:
    """A device type this machine has (``cpu``, ``cuda``, ...): checked before anything runs."""
    try:
        kind = torch.device(s).type
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {s!r} (e.g. cpu, cuda)") from None
    if kind == "meta":
        raise argparse.ArgumentTypeError("'meta' tensors hold no data: there is nothing to time (use cpu or cuda)")
    if kind != "cpu":
        mod = getattr(torch, kind, None)
        available = getattr(mod, "is_available", None)
        if available is None or not available():
            raise argparse.ArgumentTypeError(f"{s!r}: this machine has no {kind} device")
    return kind


def _nonneg_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {s!r}") from None
    if math.isnan(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {s}")
    return v


def _backend_list(s: str) -> list[str]:
    out = [v.strip() for v in s.split(",") if v.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"must name at least one backend, got {s!r}")
    return out


def _modes(args) -> tuple[str, ...]:
    return ("forward", "train") if args.mode == "both" else (args.mode,)


def _grid(args, default: str):
    from .tuning import GRIDS, Grid

    base = GRIDS["full" if args.full else "quick" if args.quick else default]
    return Grid(args.batch or base.batch, args.groups or base.groups, args.blocks or base.blocks)


def _check_output(option: str, path: str | None) -> None:
    """Refuse an output file that cannot be written before the measuring, not after it."""
    if path is None:
        return
    from pathlib import Path

    from ._errors import BlockDiagError

    target = Path(path)
    if target.is_dir():
        raise BlockDiagError(f"{option}: {path!r} is a directory; name a file in it")
    if target.exists() and not os.access(target, os.W_OK):
        raise BlockDiagError(f"{option}: {path!r} exists and is not writable")
    parent = target.resolve().parent
    if not parent.is_dir():
        raise BlockDiagError(f"{option}: the directory {parent} of {path!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise BlockDiagError(f"{option}: the directory {parent} of {path!r} is not writable")


def _memory_limit() -> int:
    """Half the machine's memory (the grid's operands must fit beside everything else)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _check_grid_memory(grid, modes, dtype: torch.dtype, max_gflop: float) -> None:
    """Refuse a grid whose largest point cannot fit, before allocating anything.

    The estimate is the operands of one point: input, output, weight and bias, and in
    training their gradients too (the backends' own workspace comes on top, so it is a
    lower bound). Points skipped by ``--max-gflop`` do not count.
    """
    from ._errors import BlockDiagError

    size = torch.empty((), dtype=dtype).element_size()
    factor = 2 if "train" in modes else 1
    worst, worst_point = 0, None
    for n in grid.batch:
        for g in grid.groups:
            for i, o in grid.blocks:
                if 2 * n * g * i * o / 1e9 > max_gflop:
                    continue
                need = factor * size * (n * g * i + n * g * o + g * o * i + g * o)
                if need > worst:
                    worst, worst_point = need, f"B={n} G={g} {i}x{o}"
    limit = _memory_limit()
    if worst > limit:
        raise BlockDiagError(
            f"the grid's largest point ({worst_point}) needs at least {worst / 2**30:.1f} GiB for its operands, "
            f"more than half this machine's memory ({limit / 2**30:.1f} GiB); use smaller --batch/--groups/--blocks "
            f"or --max-gflop"
        )


@contextlib.contextmanager
def _quiet_torch_betas():
    """Hide torch's "... is in beta" notices (sparse CSR/BSR) while our commands run."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*support is in beta state", category=UserWarning)
        yield


def _check_backends(names_: Sequence[str] | None) -> None:
    from .backends import get

    for n in names_ or ():
        get(n, "--backends", auto_valid=False)


def _add_grid_options(sp: argparse.ArgumentParser, default: str, min_time: float = 1e-2) -> None:
    sp.add_argument("--device", type=_device, default="cpu", help="device type to measure on (default cpu)")
    sp.add_argument("--dtype", type=_dtype, default=torch.float32, help=f"one of {', '.join(_DTYPES)} (default float32)")
    sp.add_argument("--mode", choices=("forward", "train", "both"), default="both",
                    help="forward only, forward+backward, or both (default)")
    size = sp.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help=f"the small grid{' (default)' if default == 'quick' else ''}")
    targets = " (default: the target grid, the full grid without those three)" if default == "targets" else ""
    size.add_argument("--full", action="store_true",
                      help=f"the full grid, with 10x150, 64x256 and 32x32 blocks{' (default)' if default == 'full' else ''}{targets}")
    sp.add_argument("--batch", type=_int_list, help="override the grid's batch sizes, e.g. 32,256")
    sp.add_argument("--groups", type=_int_list, help="override the grid's group counts, e.g. 4,50")
    sp.add_argument("--blocks", type=_blocks, help="override the grid's blocks (IN x OUT), e.g. 10x10,150x10")
    sp.add_argument("--backends", type=_backend_list, help="only these backends, comma-separated (default: all)")
    sp.add_argument("--repeat", type=_positive, default=5, help="interleaved rounds per point (median; default 5)")
    sp.add_argument("--min-time", type=_nonneg_float, default=min_time, help=f"seconds per sample (default {min_time:g})")
    sp.add_argument("--stat", choices=("median", "min"), default="median",
                    help="statistic over the rounds (default median; min on a busy shared machine)")
    sp.add_argument("--max-gflop", type=_nonneg_float, default=float("inf"),
                    help="skip points whose forward product exceeds this many GFLOP (default: none skipped)")
    sp.add_argument("--profile", help="profile file (default $BLOCKDIAG_PROFILE or the user cache directory)")


def _runnable_names(device: str) -> list[str]:
    from .backends import get, names

    return [n for n in names() if device in get(n).dtypes and get(n).unavailable_reason() is None]


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def cmd_tune(args) -> int:
    from . import profile as prof
    from .tuning import cross_check, merge_entry, plot_decision_map, tune

    _check_backends(args.backends)
    _check_output("--plot", args.plot)
    grid = _grid(args, "quick")
    modes = _modes(args)
    _check_grid_memory(grid, modes, args.dtype, args.max_gflop)
    path = args.profile or prof.default_profile_path()
    _check_output("--profile", str(path))
    n_backends = len(args.backends) if args.backends else len(_runnable_names(args.device))
    samples = len(grid) * len(modes) * n_backends * args.repeat
    print(
        f"blockdiag tune: {len(grid) * len(modes)} points on {prof.device_name(args.device)}, "
        f"{str(args.dtype).replace('torch.', '')}, {', '.join(modes)}; writes {path}\n"
        f"estimated duration: at least {_duration(samples * max(args.min_time, 1e-3) * 1.5)} "
        f"({samples} samples: points x {n_backends} backends x {args.repeat} rounds, about "
        f"{max(args.min_time, 1e-3):g} s each plus warm-up; refining and rematching add to it)",
        file=sys.stderr,
    )
    doc, _ = prof.read_profile(path)
    key = prof.profile_key(args.device, args.dtype)
    old = (doc or {}).get("entries", {}).get(key)
    # The second opinion for rematches: this machine's earlier tune where there is one
    # (same device and torch), else the built-in table.
    entry = tune(grid, device=args.device, dtype=args.dtype, modes=modes, backends=args.backends,
                 rounds=args.repeat, min_time=args.min_time, max_gflop=args.max_gflop, stat=args.stat,
                 refine=args.refine, rematch=args.rematch, prior=old, progress=sys.stderr)
    entry = merge_entry(old, entry)
    written = prof.save_entry(entry, path)
    wins: dict[str, int] = {}
    for m in entry["measurements"]:
        if m["times_us"]:
            best = min(m["times_us"], key=m["times_us"].get)
            wins[best] = wins.get(best, 0) + 1
    print(f"wrote {written} (entry {key!r})")
    print("winners: " + ", ".join(f"{n} {k}" for n, k in sorted(wins.items(), key=lambda kv: -kv[1])))
    r = entry.get("rematched")
    if r is not None:
        print(f"rematched {r['points']} points where the winner was not {r['prior']}'s choice "
              f"({r['rounds']} rounds each); {r['overturned']} overturned")
    s = entry["settings"]
    thr = "never (1.0)" if s["sparsity_threshold"] >= 1.0 else f"{s['sparsity_threshold']:.4f}"
    print(f"measured sparsity_threshold: {thr}; dense_max_groups: {s['dense_max_groups']}; "
          f"dense_max_elements: {s['dense_max_elements']}")
    for mode, c in cross_check(entry).items():
        print(f"cross-check, {mode} (each point ranked from the others, chosen/fastest): "
              f"geomean {c['geomean']:.3f}, worst {c['worst']:.2f} at {c['worst_point']}, "
              f"{c['within_1.10']} of {c['points']} within 1.10")
    if args.plot:
        print(f"decision map: {plot_decision_map(entry, args.plot)}")
    return 0


def cmd_explain(args) -> int:
    from .backends import Problem
    from .dispatch import choose
    from .settings import config

    p = Problem(args.batch, args.groups, args.block[0], args.block[1], args.dtype, args.device, args.train)
    if args.profile:
        with config(profile=args.profile):
            plan = choose(p)
    else:
        plan = choose(p)
    print(plan)
    if p.device == "cpu":  # which of simd's kernel variants runs here (avx512, avx2, neon), or why none
        from .backends import simd

        print(simd.variant_note())
    return 0


def _provenance() -> dict:
    """When and from which code a results file was written (UTC time, git commit if any)."""
    import datetime
    import subprocess
    from pathlib import Path

    from . import __version__

    commit = None
    root = Path(__file__).resolve().parent.parent
    if (root / ".git").exists():
        try:
            out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                 text=True, timeout=10)
            commit = out.stdout.strip() or None if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            commit = None
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"created": created, "commit": commit, "blockdiag": __version__}


def _unit(values_us) -> str:
    vals = [v for v in values_us if v is not None]
    return "ms" if vals and max(vals) >= 10000 else "us"


def _in_unit(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "ms":
        return f"{v / 1000:.2f}"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


# The summary's fields, labelled for people (summarize's keys stay the JSON's).
_SUMMARY_LABELS = (
    ("points", "points", "{}"),
    ("geomean_auto_over_fastest", "auto over the fastest backend, geometric mean", "{:.3f}"),
    ("max_auto_over_fastest", "auto over the fastest backend, worst", "{:.3f}"),
    ("worst_point", "  at", "{}"),
    ("within_1.10", "points where auto is within 1.10 of the fastest", "{}"),
    ("geomean_auto_over_kernel", "auto over its choice forced (dispatch cost), geometric mean", "{:.3f}"),
    ("geomean_speedup_vs_nn_linear_loop", "speed-up over the nn.Linear loop, geometric mean", "{:.2f}x"),
    ("min_speedup_vs_nn_linear_loop", "speed-up over the nn.Linear loop, smallest", "{:.2f}x"),
    ("geomean_speedup_vs_vmap", "speed-up over vmap ensembling, geometric mean", "{:.2f}x"),
    ("median_fraction_of_ideal", "fraction of the ideal GEMM, median", "{:.0%}"),
)


def _summary_lines(mode: str, s: dict) -> str:
    lines = [f"{mode}:"]
    width = max(len(label) for _, label, _ in _SUMMARY_LABELS)
    for key, label, fmt in _SUMMARY_LABELS:
        if s.get(key) is not None:
            lines.append(f"  {label:{width}s}  {fmt.format(s[key])}")
    return "\n".join(lines)


def _fmt_us(v) -> str:
    if v is None:
        return "-"
    return f"{v / 1000:.2f}ms" if v >= 10000 else f"{v:.0f}us" if v >= 100 else f"{v:.1f}us"


def _builtin_columns(r: dict) -> str:
    b = r.get("builtin_choice")
    t = r["times_us"].get(b) if b else None
    ratio = f"{t / r['times_us'][r['fastest']]:6.2f}" if t else f"{'-':>6s}"
    return f" {b or '-':>11s} {ratio}"


def _compiled_models(s: str) -> tuple[str, ...]:
    from .tuning import COMPILED_MODELS

    out = tuple(v.strip() for v in s.split(",") if v.strip())
    bad = [v for v in out if v not in COMPILED_MODELS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(COMPILED_MODELS)}, got {s!r}")
    return out


def _ratio(v, width: int = 7) -> str:
    return f"{v:{width}.2f}" if v is not None else f"{'-':>{width}s}"


def _bench_compiled(args, grid, modes) -> int:
    """``bench --compiled``: the compiled models against the compiled peers (see ``bench_compiled``)."""
    from . import profile as prof
    from .tuning import COMPILED_PEERS, allocator_env, bench_compiled, summarize_compiled

    rows = bench_compiled(grid, device=args.device, dtype=args.dtype, modes=modes, models=args.compiled,
                          backends=args.backends, rounds=args.repeat, min_time=args.min_time,
                          baselines=not args.no_baselines, max_gflop=args.max_gflop, stat=args.stat,
                          refine=args.refine, compiler=args.compiler, progress=sys.stderr)
    bd = ["auto", *dict.fromkeys(args.backends or ())]
    cols = [c for n in bd for c in (n, f"{n}_compiled")] + ([] if args.no_baselines else list(COMPILED_PEERS))
    label = {c: c.replace("_compiled", "_c") for c in cols}
    ratio_cols = [(n, "c/eager" if n == "auto" else f"{n}:c/e", "c/peer" if n == "auto" else f"{n}:c/p") for n in bd]
    print(f"torch.compile (backend {args.compiler}, dynamic=False, compile time excluded), {args.stat} of "
          f"{args.repeat} interleaved rounds; _c: compiled; c/eager: compiled blockdiag over eager blockdiag; "
          f"c/peer: compiled blockdiag over the fastest compiled peer (loop of heads, vmap)")
    head = f"{'mode':7s} {'model':6s} {'B':>5s} {'G':>4s} {'block':>8s} " + " ".join(f"{label[c]:>9s}" for c in cols)
    head += "".join(f" {e:>7s} {c:>7s}" for _, e, c in ratio_cols) + f" {'choice':>8s}"
    print(head)
    for r in rows:
        lead = (f"{r['mode']:7s} {r['model']:6s} {r['batch']:5d} {r['groups']:4d} "
                f"{str(r['block_in']) + 'x' + str(r['block_out']):>8s} ")
        if "skipped_point" in r:
            print(lead + f"skipped: {r['skipped_point']}")
            continue
        t, failed = r["times_us"], r["failed"]

        def cell(c, t=t, failed=failed):
            if c in t:
                return _fmt_us(t[c])
            return "wrong" if failed.get(c, "").startswith("wrong result") else "failed" if c in failed else "-"

        print(lead + " ".join(f"{cell(c):>9s}" for c in cols)
              + "".join(f" {_ratio(r['compiled_over_eager'].get(n))} {_ratio(r['compiled_over_best_peer'].get(n))}"
                        for n, _, _ in ratio_cols)
              + f" {r.get('auto') or '-':>8s}")
    for r in rows:
        for c, why in r.get("failed", {}).items():
            print(f"failed: {r['mode']} {r['model']} B={r['batch']} G={r['groups']} {r['block_in']}x{r['block_out']} "
                  f"{c}: {why}")
    summary = summarize_compiled(rows)
    for mode, per in summary.items():
        for key, s in per.items():
            print(f"{mode} {key}: " + ", ".join(f"{k}={v}" for k, v in s.items() if k != "targets_met"))
            if "targets_met" in s:
                met = s["targets_met"]
                print(f"{mode} {key}: issue 21's targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in met.items()))
    if args.json:
        out = {"device_name": prof.device_name(args.device), "torch": torch.__version__,
               "dtype": str(args.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
               "statistic": args.stat, "rounds": args.repeat, "refine": args.refine, "argv": sys.argv[1:],
               "compiled": {"models": list(args.compiled), "compiler": args.compiler, "dynamic": False},
               "allocator_env": allocator_env(), **_provenance(), "summary": summary, "rows": rows}
        prof.write_json_atomic(args.json, out)
        print(f"wrote {args.json}")
    return 0


def cmd_bench(args) -> int:
    import contextlib

    from . import profile as prof
    from .settings import config
    from .tuning import allocator_env, bench, summarize

    _check_backends(args.backends)
    _check_output("--json", args.json)
    grid = _grid(args, "targets")
    _check_grid_memory(grid, ("train",) if args.compiled or args.mode != "forward" else ("forward",),
                       args.dtype, args.max_gflop)
    if args.mode is None:  # bench's own default: both, and the training step alone with --compiled
        args.mode = "train" if args.compiled else "both"
    modes = _modes(args)
    ctx = config(profile=args.profile) if args.profile else contextlib.nullcontext()
    if args.compiled:
        with ctx:
            return _bench_compiled(args, grid, modes)
    with ctx:
        rows = bench(grid, device=args.device, dtype=args.dtype, modes=modes, backends=args.backends,
                     rounds=args.repeat, min_time=args.min_time, baselines=not args.no_baselines,
                     memory=args.json is not None and not args.no_memory, max_gflop=args.max_gflop,
                     stat=args.stat, refine=args.refine, progress=sys.stderr)
    names_ = sorted({n for r in rows for n in r.get("times_us", {})})
    timed = [r for r in rows if "skipped_point" not in r]
    # One unit per column, picked from its values: ms when its largest time reaches 10 ms.
    units = {n: _unit([r["times_us"].get(n) for r in timed]) for n in names_}
    units["auto"] = _unit([r["auto_us"] for r in timed])
    print(f"times in the unit of their column (us or ms), {args.stat} of {args.repeat} interleaved rounds; "
          "a/best: auto over the fastest backend; a/kern: auto over its choice forced; %ideal: the ideal "
          "GEMM's time over auto's; xloop, xvmap: auto's speed-up over the nn.Linear loop and vmap")
    head = f"{'mode':7s} {'B':>5s} {'G':>4s} {'block':>8s} " + " ".join(f"{n + ' ' + units[n]:>11s}" for n in names_)
    head += (f" {'auto ' + units['auto']:>11s} {'choice':>11s} {'a/best':>6s} {'a/kern':>6s} {'%ideal':>6s} "
             f"{'xloop':>6s} {'xvmap':>6s}")
    # Under a tuning profile: the built-in table's choice and its forced time over the fastest.
    builtin = any("builtin_choice" in r for r in rows)
    if builtin:
        head += f" {'builtin':>11s} {'b/best':>6s}"
    print(head)
    for r in rows:
        lead = f"{r['mode']:7s} {r['batch']:5d} {r['groups']:4d} {str(r['block_in']) + 'x' + str(r['block_out']):>8s} "
        if "skipped_point" in r:
            print(lead + f"skipped: {r['skipped_point']}")
            continue
        t = r["times_us"]
        bl = r.get("baselines_us", {})
        xl = f"{bl['nn_linear_loop'] / r['auto_us']:6.2f}" if "nn_linear_loop" in bl else f"{'-':>6s}"
        xv = f"{bl['vmap'] / r['auto_us']:6.2f}" if "vmap" in bl else f"{'-':>6s}"
        print(lead + " ".join(f"{_in_unit(t.get(n), units[n]):>11s}" for n in names_)
              + f" {_in_unit(r['auto_us'], units['auto']):>11s} {r['auto']:>11s} {r['auto_over_fastest']:6.2f}"
              + f" {r['auto_over_kernel']:6.2f}"
              + f" {100 * r['fraction_of_ideal']:5.0f}% {xl} {xv}"
              + (_builtin_columns(r) if builtin else ""))
    skipped = sorted({f"{n}: {why}" for r in rows for n, why in r.get("skipped", {}).items() if "skipped" in why})
    if skipped:
        print(f"not measured at some points: {len(skipped)} reasons, e.g. {skipped[0]}")
    summary = summarize(rows)
    for mode, s in summary.items():
        print(_summary_lines(mode, s))
        if "geomean_choice_over_builtin_choice" in s:
            print(f"{mode}: the profile's choices against the built-in table's, timed in this run: "
                  f"{s['geomean_choice_over_builtin_choice']:.3f}x on geometric mean (below 1: the profile "
                  f"chose faster); they differ at {s['choices_differing_from_builtin']} of {s['points']} points")
    if args.json:
        out = {"device_name": prof.device_name(args.device), "torch": torch.__version__,
               "dtype": str(args.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
               "statistic": args.stat, "rounds": args.repeat, "refine": args.refine, "argv": sys.argv[1:],
               "allocator_env": allocator_env(), **_provenance(), "summary": summary, "rows": rows}
        prof.write_json_atomic(args.json, out)
        print(f"wrote {args.json}")
    return 0


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written; every option's default shown (unless its help gives it)."""

    def _get_help_string(self, action):
        h = action.help or ""
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if "default" in h or flag or action.default is None or action.default is argparse.SUPPRESS:
            return h
        d = action.default
        if isinstance(d, torch.dtype):
            d = str(d).replace("torch.", "")
        elif isinstance(d, list):
            d = ",".join(map(str, d))
        return f"{h} (default {d})"


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(
        prog="blockdiag",
        description="blockdiag: many small independent linear layers as one block-diagonal operation. "
                    "Commands: demo (the forum's model, loop against GroupedMLP), tune (measure this "
                    "machine and write a tuning profile), explain (the plan auto follows for a shape), "
                    "bench (every backend, auto and the baselines over a grid).",
        epilog="run 'blockdiag COMMAND --help' for a command's options and an example",
    )
    p.add_argument("--version", action="version", version=f"blockdiag {__version__} (torch {torch.__version__})")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo", help="train the forum's loop-of-heads model and GroupedMLP side by side",
        description="Train the forum thread's model (a Python loop over independent heads, then cat) and "
                    "the same heads as one GroupedMLP, interleaved epoch by epoch, and print both losses "
                    "and the speed-up.",
        epilog="example:\n  blockdiag demo --heads 50 --epochs 3",
        formatter_class=_Formatter,
    )
    d.add_argument("--heads", type=_positive, default=50, help="independent heads")
    d.add_argument("--in-features", type=_positive, default=150, help="input features every head reads")
    d.add_argument("--hidden", type=_parse_hidden, default=[10, 10], help="hidden sizes, comma-separated, e.g. 10,10")
    d.add_argument("--out-features", type=_positive, default=1, help="outputs per head")
    d.add_argument("--batch", type=_positive, default=64, help="rows per training step")
    d.add_argument("--samples", type=_positive, default=4096, help="training samples (random)")
    d.add_argument("--epochs", type=_positive, default=3, help="epochs of each model")
    d.add_argument("--lr", type=_learning_rate, default=1e-3, help="Adam's learning rate")
    d.add_argument("--seed", type=_seed, default=0, help="random seed")
    d.set_defaults(func=cmd_demo)

    from .tuning import BENCH_REFINE, TIE_MARGIN

    t = sub.add_parser(
        "tune", help="measure the backends on this machine and write a tuning profile",
        description="Time every backend at each point of a grid on this machine and merge the winners into "
                    "the tuning profile that auto reads (the file is named before the run starts, with an "
                    "estimate of its duration). tune defaults to the quick grid and a 5%% refine margin: "
                    "it measures many backends per point, where bench measures the target grid and "
                    "refines auto's choice against the fastest at 10%%.",
        epilog="examples:\n"
               "  blockdiag tune --quick --mode train            # a few minutes\n"
               "  blockdiag tune --blocks 150x10 --groups 50 --batch 256 --profile /tmp/p.json",
        formatter_class=_Formatter,
    )
    _add_grid_options(t, "quick")
    t.add_argument("--plot", metavar="FILE.png", help="also draw the decision map (needs matplotlib)")
    t.add_argument("--refine", type=_nonneg_float, default=TIE_MARGIN, metavar="FRACTION",
                   help=f"backends within this fraction of the fastest get --repeat more rounds "
                        f"(default {TIE_MARGIN:g}; 0 disables)")
    t.add_argument("--no-rematch", dest="rematch", action="store_false",
                   help="do not retime the points where the winner is not the earlier table's choice")
    t.set_defaults(func=cmd_tune)

    e = sub.add_parser(
        "explain", help="print the plan auto follows for one shape, and why",
        description="Print the plan auto follows for one problem: the backend, the table entry it comes "
                    "from, the candidates and why the others were left out.",
        epilog="example:\n  blockdiag explain --batch 256 --groups 50 --block 150x10 --train",
        formatter_class=_Formatter,
    )
    e.add_argument("--batch", type=_positive, required=True, help="rows (the product of the leading dimensions)")
    e.add_argument("--groups", type=_positive, required=True, help="groups (heads)")
    e.add_argument("--block", type=_block, required=True, help="IN x OUT per group, e.g. 10x10 or 150x10")
    e.add_argument("--train", action="store_true", help="plan for forward+backward (default: forward only)")
    e.add_argument("--device", default="cpu", help="device type to plan for; no device is needed")
    e.add_argument("--dtype", type=_dtype, default=torch.float32, help=f"one of {', '.join(_DTYPES)}")
    e.add_argument("--profile", help="profile file to use (default $BLOCKDIAG_PROFILE or the user cache directory)")
    e.set_defaults(func=cmd_explain)

    b = sub.add_parser(
        "bench", help="time every backend, auto, the ideal GEMM and the baselines over a grid",
        description="Time every backend, auto, the ideal GEMM and the baselines (the nn.Linear loop, vmap "
                    "ensembling) over a grid, in interleaved rounds, and print each point's times and "
                    "ratios measured in the same run. Writes nothing unless --json is given.",
        epilog="examples:\n"
               "  blockdiag bench --quick --mode forward\n"
               "  blockdiag bench --blocks 10x10,150x10 --backends simd,bmm_fm,mkl_batch,loop --json out.json\n"
               "  blockdiag bench --compiled linear --batch 256 --groups 16",
        formatter_class=_Formatter,
    )
    _add_grid_options(b, "targets")
    b.add_argument("--json", metavar="FILE", help="write all results (with peak memory) as JSON")
    b.add_argument("--no-baselines", action="store_true", help="skip the nn.Linear loop and vmap baselines")
    b.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs of --json")
    b.add_argument("--refine", type=_nonneg_float, default=BENCH_REFINE, metavar="FRACTION",
                   help=f"auto, its choice, the nn.Linear loop and the backends within this fraction of "
                        f"the fastest get --repeat more rounds (default {BENCH_REFINE:g}; 0 disables)")
    # A flag, not a --mode value: --mode says which pass is timed (and is tune's option too),
    # --compiled says what is compared; the two combine (--mode forward --compiled is valid).
    b.add_argument("--compiled", nargs="?", const=("linear", "mlp"), type=_compiled_models, metavar="MODELS",
                   help="instead of the backends, time torch.compile(GroupedLinear) and torch.compile(GroupedMLP) "
                        "(MODELS: linear, mlp, or linear,mlp, the default) against torch.compile of the nn.Linear loop "
                        "and of vmap ensembling, with the eager blockdiag module in the same rounds; reports "
                        "compiled/eager and compiled/best compiled peer. A flag rather than a --mode value "
                        "because it changes what is compared, not which pass: --mode still picks the pass "
                        "and here defaults to train. Graphs are compiled once per point (dynamic=False, "
                        "dynamo reset between points), compile time excluded; a method that fails to compile "
                        "or differs from eager is reported in its row. --backends adds blockdiag modules "
                        "with those backends forced (default: auto only); no peak memory is recorded")
    b.add_argument("--compiler", default="inductor", metavar="BACKEND",
                   help="torch.compile's backend for --compiled (default inductor; aot_eager traces the "
                        "same graphs without code generation, to find failures fast)")
    # None: both, or train with --compiled (cmd_bench resolves it).
    b.set_defaults(func=cmd_bench, mode=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``blockdiag`` console script.

    Returns:
        the exit status: 0 on success, 2 on a bad argument or a command refused with a
        :class:`~blockdiag.BlockDiagError` (an unknown backend name, an unwritable file, a
        grid too large for the memory, ...), whose message is printed to stderr as one line.
    """
    from ._errors import BlockDiagError

    args = build_parser().parse_args(argv)
    try:
        with _quiet_torch_betas():
            return args.func(args)
    except BlockDiagError as e:
        print(f"blockdiag {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
