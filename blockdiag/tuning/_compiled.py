"""``bench_compiled``: ``torch.compile`` of blockdiag's modules against the compiled peers.

The modules are compiled once per point (``dynamic=False``), checked against their eager
results, then timed in the same interleaved rounds as the eager module, the peers and the
control (``bench --compiled``).
"""

from __future__ import annotations

import copy
import time
from typing import Callable, Iterable, Optional, Sequence, TextIO

import torch
from torch import nn

# ``measure`` is looked up on the package at call time (see ``_bench``).
from .. import tuning as _tuning
from .._errors import BlockDiagError
from ..backends import Problem, get
from ._bench import INTERVAL_LEVEL
from ._timer import (
    BENCH_GRID,
    BENCH_REFINE,
    Grid,
    _geomean,
    _Progress,
    _resolve_modes,
    _step,
    autograd_as_in_training,
    median_interval,
)

# ``torch.compile(GroupedMLP)`` against ``torch.compile`` of the peers a user would compile
# instead: the loop of ``nn.Linear`` heads and ``torch.func`` vmap ensembling, all holding the
# same weights, timed in the same interleaved rounds as the eager blockdiag module.

# ``linear``: one GroupedLinear (G blocks in x out, each group reads its slice of the input,
# the input requires grad as inside a network), against G ``nn.Linear`` over the slices.
# ``mlp``: a GroupedMLP of G heads ``in -> out -> ReLU -> out`` reading one shared input that
# needs no gradient (the forum's model on its data), against the G ``nn.Sequential`` heads.
COMPILED_MODELS = ("linear", "mlp")

# The compiled peers; the best of them at a point is what compiled blockdiag must beat.
COMPILED_PEERS = ("loop_compiled", "vmap_compiled")

# The control, timed with the peers but compared with nothing: plain torch layers with the
# same input and the same FLOPs as the model, one op per layer and no grouping
# (``nn.Linear(G*in, out)`` for ``linear``; ``Linear(in, G*out), ReLU, Linear(G*out, out)``
# for ``mlp``). torch.compile has nothing to batch or take out of such a module, so its
# compiled over eager time is what torch.compile's own per-call runtime costs a module of
# that work: the floor under blockdiag's, which is one op per layer too.
COMPILED_CONTROL = "control"

# Issue 21's targets for the compiled training step (reported by :func:`summarize_compiled`,
# not enforced): compiled blockdiag no slower than eager blockdiag on geometric mean, at
# least 1.25x faster than the best compiled peer on geometric mean, slower than it nowhere.
COMPILED_TARGETS = {
    "geomean_compiled_over_eager": 1.02,
    "geomean_speedup_over_best_peer": 1.25,
    "max_compiled_over_best_peer": 1.0,
}



# How far a compiled module's output and gradients may be from the same module's eager ones,
# relative to the largest entry: the same products, summed in another order (or in TF32 on
# CUDA, where torch's settings allow it). A compiled kernel fed the wrong pointers is off by
# orders of magnitude (issue 21: mkl_batch's garbage under compile).
_COMPILED_RTOL = {torch.float64: 1e-9, torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


class _HeadsLoop(nn.Module):
    """The loop of heads: head ``k`` reads slice ``k`` of ``x`` (``split`` columns each) or all of it; then ``cat``."""

    def __init__(self, heads: nn.ModuleList, split: Optional[int]):
        super().__init__()
        self.heads, self.split = heads, split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.split(self.split, dim=-1) if self.split else [x] * len(self.heads)
        return torch.cat([h(xs[k]) for k, h in enumerate(self.heads)], dim=-1)


class _VmapEnsemble(nn.Module):
    """PyTorch's model-ensembling recipe as a module: ``stack_module_state`` of the heads
    (held as parameters) and one ``functional_call`` of a meta copy vmapped over them."""

    def __init__(self, heads: nn.ModuleList, split: Optional[int]):
        super().__init__()
        from torch.func import stack_module_state

        params, _ = stack_module_state(list(heads))
        self.keys = list(params)
        self.stacked = nn.ParameterList(nn.Parameter(params[k].detach().clone()) for k in self.keys)
        self.groups, self.split = len(heads), split
        self._base = (copy.deepcopy(heads[0]).to("meta"),)  # a tuple: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.func import functional_call, vmap

        base = self._base[0]

        def one(prm, xx):
            return functional_call(base, prm, (xx,))

        prm = dict(zip(self.keys, self.stacked))
        n = x.shape[0]
        if self.split:
            y = vmap(one)(prm, x.view(n, self.groups, self.split).transpose(0, 1))
        else:
            y = vmap(one, in_dims=(0, None))(prm, x)
        return y.transpose(0, 1).reshape(n, -1)


def _model_flops(model: str, p: Problem) -> float:
    """Forward FLOPs of ``model`` at ``p`` (the MLP has a second, ``out x out`` layer)."""
    return p.flops + (2.0 * p.batch * p.groups * p.block_out * p.block_out if model == "mlp" else 0.0)


def _compiled_modules(model: str, p: Problem, forced: Sequence[str], baselines: bool, seed: int = 0):
    """The modules of one point, all but the control computing the same function with the same weights.

    Returns ``({name: module}, x, {name: gy})``: ``"auto"`` and each name of ``forced`` (the
    blockdiag module with that backend), then ``"loop"``, ``"vmap"`` and
    :data:`COMPILED_CONTROL` (with ``baselines``); each module's output gradient (None in
    inference).
    """
    from ..nn import GroupedLinear, GroupedMLP

    g, i, o, n = p.groups, p.block_in, p.block_out, p.batch
    train = p.requires_grad
    # Built on the CPU from the forked CPU generator, then moved: torch.device("cpu") because
    # the factories here would otherwise follow the caller's default device (torch.device(...),
    # set_default_device), and a module built on meta cannot be moved.
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        if model == "linear":
            bd = GroupedLinear(g * i, g * o, g, dtype=p.dtype)
            heads, split, x = bd.to_linears(), i, torch.randn(n, g * i, dtype=p.dtype)
            control: nn.Module = nn.Linear(g * i, o, dtype=p.dtype)
        else:
            bd = GroupedMLP(i, [o], o, heads=g, dtype=p.dtype)
            heads, split, x = bd.to_heads(), None, torch.randn(n, i, dtype=p.dtype)
            control = nn.Sequential(nn.Linear(i, g * o, dtype=p.dtype), nn.ReLU(), nn.Linear(g * o, o, dtype=p.dtype))
        gy = torch.randn(n, g * o, dtype=p.dtype) if train else None
        gy_control = torch.randn(n, o, dtype=p.dtype) if train else None
    mods: dict[str, nn.Module] = {"auto": bd}
    for name in forced:
        m = copy.deepcopy(bd)
        m.backend = name
        mods[name] = m
    gys = {name: gy for name in mods}
    if baselines:
        mods["loop"] = _HeadsLoop(heads, split)
        mods["vmap"] = _VmapEnsemble(heads, split)
        mods[COMPILED_CONTROL] = control
        gys.update(loop=gy, vmap=gy)
        gys[COMPILED_CONTROL] = gy_control
    for m in mods.values():
        m.to(p.device).requires_grad_(train)
    x = x.to(p.device).requires_grad_(train and model == "linear")
    return mods, x, {k: (v.to(p.device) if v is not None else None) for k, v in gys.items()}


def _module_step(call: Callable, module: nn.Module, x: torch.Tensor, gy: Optional[torch.Tensor]) -> Callable[[], None]:
    """One step of ``call`` (``module`` or its compiled form): forward, and backward with ``gy``."""
    return _step(call, (x,), gy, (x, *module.parameters()))


def _results(call: Callable, module: nn.Module, x: torch.Tensor, gy: Optional[torch.Tensor]) -> dict[str, Optional[torch.Tensor]]:
    """One step's output and every gradient it leaves (copies), by name; the gradients are cleared."""
    if gy is None:
        with torch.no_grad():
            return {"output": call(x).detach().clone()}
    y = call(x)
    y.backward(gy)
    named = ([("x", x)] if x.requires_grad else []) + list(module.named_parameters())
    out = {"output": y.detach().clone()}
    for name, t in named:
        out[f"{name}.grad"] = None if t.grad is None else t.grad.detach().clone()
        t.grad = None
    return out


def _mismatch(got: dict, want: dict) -> Optional[str]:
    """Where a compiled module's results differ from the eager module's (None: they agree)."""
    for k, w in want.items():
        v = got.get(k)
        if (v is None) != (w is None):
            return f"{k} is {'missing' if v is None else 'present'} compiled but {'present' if w is not None else 'missing'} eager"
        if w is None:
            continue
        if v.shape != w.shape:
            return f"{k} has shape {tuple(v.shape)} compiled, {tuple(w.shape)} eager"
        scale = max(float(w.abs().max()), 1e-30) if w.numel() else 1.0
        err = float((v.double() - w.double()).abs().max()) / scale if w.numel() else 0.0
        if not err <= _COMPILED_RTOL.get(w.dtype, 5e-2):  # NaN fails too
            return f"{k} off by {err:.3g} of its largest entry"
    return None


def _error_line(e: BaseException) -> str:
    """The error's first line (with the next one where the first only introduces it, as
    inductor's ``backend='inductor' raised:`` does)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text += " " + lines[1]
    return f"{type(e).__name__}: {text[:200]}"


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, from dynamo's counters."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover
        return 0, 0
    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def _recompile_limit(n: int):
    """A context raising dynamo's per-code-object recompile limit to at least ``n``: every
    module of a point is a compiled instance of a few classes (GroupedLinear.forward once
    per forced backend), and none may fall back to eager for hitting it."""
    import torch._dynamo.config as cfg

    key = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return cfg.patch(**{key: max(int(getattr(cfg, key)), n)})


class _WrongResult(Exception):
    pass


@autograd_as_in_training()
def bench_compiled(
    grid: Grid = BENCH_GRID,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    modes: Sequence[str] = ("train",),
    models: Sequence[str] = COMPILED_MODELS,
    backends: Optional[Iterable[str]] = None,
    rounds: int = 5,
    min_time: float = 1e-2,
    baselines: bool = True,
    max_gflop: float = float("inf"),
    stat: str = "median",
    refine: float = BENCH_REFINE,
    dynamic: Optional[bool] = False,
    compiler: str = "inductor",
    progress: Optional[TextIO] = None,
    on_row: Optional[Callable[[list[dict], int], None]] = None,
) -> list[dict]:
    """Time ``torch.compile`` of GroupedLinear and GroupedMLP against compiled peers, per point.

    At each point and model (:data:`COMPILED_MODELS`), dynamo is reset (so no recompile
    limit is ever reached across points), then each module is built with the same weights
    (blockdiag with ``auto`` and with each of ``backends`` forced, the loop of heads, vmap
    ensembling; and :data:`COMPILED_CONTROL`, plain layers of the same work), run once eager
    as the reference, compiled (``torch.compile(module, dynamic=dynamic)``) and run twice: the first call compiles the forward and backward
    graphs, and its results must match the eager ones (:data:`_COMPILED_RTOL`). Compile
    time is recorded, not timed. Then every module, eager and compiled (the peers too: their
    compiled over eager time is torch.compile's own on the same computation), is timed in
    the same interleaved rounds (:func:`measure`, no pruning; with ``refine``
    every step gets ``rounds`` more rounds: each one's time is in a reported ratio).

    A module that fails to build, run, compile or match is recorded in its row's
    ``failed`` (the error's first line) and left out of the timing; the run goes on.

    Args:
        grid: the shapes (default: :data:`BENCH_GRID`).
        device: the device type to measure on.
        dtype: the dtype to measure.
        rounds: interleaved rounds per point (see :func:`measure`).
        min_time: seconds each sample should last (see :func:`measure`).
        stat: ``"median"`` or ``"min"`` of the samples (see :func:`measure`).
        progress: a stream for the progress bar (e.g. ``sys.stderr``), or None.
        on_row: called after each point and model with the rows so far and the number of
            them the run makes, so that a caller can save a long run as it goes.
        modes: ``"train"`` (forward and backward, the default) and/or ``"forward"`` (under
            ``no_grad``).
        models: a subset of :data:`COMPILED_MODELS`.
        backends: blockdiag backends forced, each timed eager and compiled, besides ``auto``.
        baselines: compile and time the peers (without them, no ``compiled_over_best_peer``).
        max_gflop: points (and models) whose forward exceeds this many GFLOP are skipped.
        refine: 0 disables the extra rounds.
        dynamic: ``torch.compile``'s ``dynamic``. False (the default) specialises every
            graph to the point's batch size, as a first compile does for a model trained
            at one batch size, and for every method alike.
        compiler: ``torch.compile``'s ``backend``: ``"inductor"`` (the default, what users
            get) or e.g. ``"aot_eager"`` (dynamo and AOTAutograd without code generation:
            the same tracing and failures in a fraction of the compile time).

    Returns:
        one dict per point, model and mode: ``times_us`` (``auto``, each forced backend,
            the peers ``loop`` and ``vmap``, the control, and ``<name>_compiled`` for each),
            ``compile_s``, ``graphs`` and ``graph_breaks`` (per compiled step, from its first
            two calls), ``failed`` (step -> error), ``auto`` (GroupedLinear's choice, eager),
            ``best_peer``, ``compiled_over_eager`` and ``compiled_over_best_peer`` (per
            blockdiag backend name: its compiled time over its eager time, and over the
            fastest compiled peer's), ``peer_compiled_over_eager`` (per compiled peer: its
            compiled time over its eager time), ``control_compiled_over_eager`` (the same
            for :data:`COMPILED_CONTROL`, timed with ``baselines``), ``faults_per_step`` (per
            step: its minor page faults per call, the median over its samples, where the
            platform counts them: a warm step that faults is paying the allocator for fresh
            pages), and ``graphs_while_timing`` where graphs were compiled
            during the timing (a recompile the warm-up did not catch); or ``skipped_point``.

    Raises:
        BlockDiagError: an unknown mode, model or backend name.
    """
    modes = _resolve_modes(modes)
    models = tuple(models)
    bad = [m for m in models if m not in COMPILED_MODELS]
    if bad or not models:
        raise BlockDiagError(f"bench: compiled models must be a non-empty subset of {COMPILED_MODELS}, got {models!r}")
    forced = [get(n, "bench", auto_valid=False).name for n in (backends or ())]
    forced = [n for k, n in enumerate(forced) if n not in forced[:k]]
    bd_names = ["auto", *forced]
    work = [(p, model) for m in modes for p in grid.problems(m, dtype, device) for model in models]
    bar = _Progress(len(work), "bench --compiled", progress)
    rows = []
    for p, model in work:
        row = {"mode": p.mode, "model": model, "batch": p.batch, "groups": p.groups,
               "block_in": p.block_in, "block_out": p.block_out}
        what = f"{p.mode} {model} B={p.batch} G={p.groups} {p.block_in}x{p.block_out}"
        gflop = _model_flops(model, p) / 1e9
        if gflop > max_gflop:
            row["skipped_point"] = f"{gflop:.1f} GFLOP > --max-gflop {max_gflop:g}"
            rows.append(row)
            bar.step(f"{what}: skipped (too large)")
            if on_row is not None:
                on_row(rows, len(work))
            continue
        torch._dynamo.reset()
        try:
            row.update(_bench_compiled_point(p, model, forced, bd_names, baselines, rounds, min_time,
                                             stat, refine, dynamic, compiler))
        finally:
            torch._dynamo.reset()
        rows.append(row)
        ce = row["compiled_over_eager"].get("auto")
        cp = row["compiled_over_best_peer"].get("auto")
        bar.step(f"{what}: compiled/eager {ce if ce is not None else '-'}, compiled/peer {cp if cp is not None else '-'}"
                 + (f", {len(row['failed'])} failed" if row["failed"] else ""))
        if on_row is not None:
            on_row(rows, len(work))
    return rows


def _bench_compiled_point(p, model, forced, bd_names, baselines, rounds, min_time, stat, refine, dynamic,
                          compiler) -> dict:
    failed: dict[str, str] = {}
    steps: dict[str, Callable[[], None]] = {}
    compile_s: dict[str, float] = {}
    graphs: dict[str, int] = {}
    breaks: dict[str, int] = {}
    out: dict = {}
    try:
        mods, x, gys = _compiled_modules(model, p, forced, baselines)
    except Exception as e:  # noqa: BLE001
        for n in bd_names:
            failed[n] = _error_line(e)
        mods, x, gys = {}, None, {}
    if model == "linear" and "auto" in mods:
        try:
            out["auto"] = mods["auto"].plan(x).backend
        except Exception:  # noqa: BLE001
            pass
    with _recompile_limit(2 * len(mods) + 8):
        for name, mod in mods.items():
            cname, gy = f"{name}_compiled", gys[name]
            try:
                want = _results(mod, mod, x, gy)
            except Exception as e:  # noqa: BLE001
                failed[name if name in bd_names else cname] = _error_line(e)
                if name in bd_names:
                    failed[cname] = "not compiled: the eager module failed"
                continue
            # The peers run eager too: their compiled over eager time is torch.compile's own
            # cost and gain on the same computation, the yardstick for blockdiag's.
            steps[name] = _module_step(mod, mod, x, gy)
            g0, b0 = _dynamo_counts()
            t0 = time.perf_counter()
            try:
                cm = torch.compile(mod, dynamic=dynamic, backend=compiler)
                got = _results(cm, mod, x, gy)  # compiles the forward (and backward) graphs
                compile_s[cname] = round(time.perf_counter() - t0, 2)
                bad = _mismatch(got, want)
                if bad is not None:
                    raise _WrongResult(f"compiled result differs from eager: {bad}")
                _results(cm, mod, x, gy)  # a second call: a recompile on it is not timed either
            except Exception as e:  # noqa: BLE001
                failed[cname] = _error_line(e) if not isinstance(e, _WrongResult) else f"wrong result: {str(e)[:200]}"
                continue
            finally:
                g1, b1 = _dynamo_counts()
                graphs[cname], breaks[cname] = g1 - g0, b1 - b0
            steps[cname] = _module_step(cm, mod, x, gy)
        g_before = _dynamo_counts()[0]
        faults: dict[str, float] = {}
        taken: dict[str, list[float]] = {}
        times, errs = _tuning.measure(steps, p.device, rounds, min_time, prune=0.0, stat=stat, refine=refine,
                                      refine_also=tuple(steps), faults=faults, per_round=taken)
        g_timing = _dynamo_counts()[0] - g_before
    failed.update(errs)
    us = {n: t * 1e6 for n, t in times.items()}
    peers = {n: us[n] for n in COMPILED_PEERS if n in us}
    best_peer = min(peers, key=peers.get) if peers else None
    ce, cp, cp_interval = {}, {}, {}
    peer_ce = {
        n: round(us[n] / us[n.removesuffix("_compiled")], 4)
        for n in COMPILED_PEERS if n in us and n.removesuffix("_compiled") in us
    }
    for n in bd_names:
        c = us.get(f"{n}_compiled")
        if c is None:
            continue
        if n in us:
            ce[n] = round(c / us[n], 4)
        if best_peer is not None:
            cp[n] = round(c / peers[best_peer], 4)
            # Round by round, the compiled module over that peer: samples taken moments apart,
            # so a drift of the machine cancels; the interval says whether the point's ratio
            # is apart from 1 by more than the rounds vary.
            paired = [a / b for a, b in zip(taken.get(f"{n}_compiled", ()), taken.get(best_peer, ()))]
            iv = median_interval(paired, INTERVAL_LEVEL)
            if iv is not None:
                cp_interval[n] = [round(iv[0], 4), round(iv[1], 4)]
    if faults:
        out["faults_per_step"] = {n: round(v, 1) for n, v in faults.items()}
    ctl, ctl_c = us.get(COMPILED_CONTROL), us.get(f"{COMPILED_CONTROL}_compiled")
    if ctl is not None and ctl_c is not None:
        out["control_compiled_over_eager"] = round(ctl_c / ctl, 4)
    out.update(
        times_us={n: round(v, 3) for n, v in us.items()},
        compile_s=compile_s,
        graphs=graphs,
        graph_breaks=breaks,
        failed=failed,
        best_peer=best_peer,
        compiled_over_eager=ce,
        compiled_over_best_peer=cp,
        compiled_over_best_peer_interval=cp_interval,
        peer_compiled_over_eager=peer_ce,
    )
    if g_timing:
        out["graphs_while_timing"] = g_timing
    return out


def _point_name(r: dict) -> str:
    return f"{r['model']} B={r['batch']} G={r['groups']} {r['block_in']}x{r['block_out']}"


def _compiled_stats(rs: Sequence[dict], name: str) -> Optional[dict]:
    """:func:`summarize_compiled`'s figures for blockdiag backend ``name`` over rows ``rs``."""
    ce = [(r["compiled_over_eager"][name], r) for r in rs if name in r["compiled_over_eager"]]
    cp = [(r["compiled_over_best_peer"][name], r) for r in rs if name in r["compiled_over_best_peer"]]
    fails = sum(1 for r in rs if name in r["failed"] or f"{name}_compiled" in r["failed"])
    if not ce and not cp and not fails:
        return None
    s: dict = {"points": len(rs), "failed_points": fails}
    if ce:
        worst = max(ce, key=lambda t: t[0])
        s.update(
            geomean_compiled_over_eager=round(_geomean([v for v, _ in ce]), 4),
            max_compiled_over_eager=worst[0],
            worst_point_compiled_over_eager=_point_name(worst[1]),
        )
        # The same ratio for each peer, over the same points: what torch.compile does to
        # the loop of heads and to vmap ensembling (rows from before peers ran eager lack it).
        for peer in COMPILED_PEERS:
            pv = [r["peer_compiled_over_eager"][peer] for _, r in ce if peer in r.get("peer_compiled_over_eager", {})]
            if pv:
                s[f"geomean_{peer.removesuffix('_compiled')}_compiled_over_eager"] = round(_geomean(pv), 4)
        # The control's, and blockdiag's over the control's point by point: 1 where
        # torch.compile costs blockdiag what it costs plain layers of the same work.
        both = [(v, r["control_compiled_over_eager"]) for v, r in ce if "control_compiled_over_eager" in r]
        if both:
            s["geomean_control_compiled_over_eager"] = round(_geomean([c for _, c in both]), 4)
            s["geomean_compiled_over_eager_over_control"] = round(_geomean([v / c for v, c in both]), 4)
    if cp:
        worst = max(cp, key=lambda t: t[0])
        gm = _geomean([v for v, _ in cp])
        s.update(
            geomean_compiled_over_best_peer=round(gm, 4),
            geomean_speedup_over_best_peer=round(1 / gm, 3),
            max_compiled_over_best_peer=worst[0],
            worst_point_compiled_over_best_peer=_point_name(worst[1]),
            slower_than_best_peer=sum(v > 1.0 for v, _ in cp),
        )
        # The same verdict with each point's interval (rows from before intervals lack it):
        # slower only where every plausible median of the paired ratios is above 1.
        iv = [(r["compiled_over_best_peer_interval"][name], r) for _, r in cp
              if name in r.get("compiled_over_best_peer_interval", {})]
        if iv:
            apart = [(lo, r) for (lo, _), r in iv if lo > 1.0]
            s.update(
                points_with_interval=len(iv),
                slower_than_best_peer_beyond_noise=len(apart),
                slower_beyond_noise_points=[_point_name(r) for _, r in sorted(apart, key=lambda t: -t[0])],
                tied_with_best_peer=sum(lo <= 1.0 <= hi for (lo, hi), _ in iv),
            )
    if ce and cp:
        t = COMPILED_TARGETS
        s["targets_met"] = {
            f"geomean_compiled_over_eager<={t['geomean_compiled_over_eager']}":
                s["geomean_compiled_over_eager"] <= t["geomean_compiled_over_eager"],
            f"geomean_speedup_over_best_peer>={t['geomean_speedup_over_best_peer']}":
                s["geomean_speedup_over_best_peer"] >= t["geomean_speedup_over_best_peer"],
            "slower_than_no_compiled_peer": s["max_compiled_over_best_peer"] <= t["max_compiled_over_best_peer"],
        }
        if s.get("points_with_interval") == len(cp):
            s["targets_met"]["slower_than_no_compiled_peer_beyond_noise"] = s["slower_than_best_peer_beyond_noise"] == 0
        s["targets_met"]["compiled_everywhere"] = fails == 0
    return s


def summarize_compiled(rows: Sequence[dict]) -> dict:
    """Per mode, per model (and ``"all"``, both models together): :func:`bench_compiled`'s ratios.

    For ``auto`` under the model's name, for each forced backend under ``"model[name]"``:
    ``points``, ``failed_points``, the geometric mean and the worst (largest) of compiled
    over eager and of compiled over the best compiled peer, with their points, the
    geometric-mean speed-up over the best compiled peer, the points where compiled
    blockdiag is slower than that peer; where the rows carry intervals
    (:data:`INTERVAL_LEVEL`), ``slower_than_best_peer_beyond_noise`` (the points whose
    whole interval lies above 1, named in ``slower_beyond_noise_points``, slowest first),
    ``tied_with_best_peer`` (intervals holding 1) and ``points_with_interval``;
    ``targets_met`` (:data:`COMPILED_TARGETS`, the slower-nowhere target judged both on the
    medians and, where every point has an interval, beyond the noise, and no failed point); and ``geomean_loop_compiled_over_eager`` /
    ``geomean_vmap_compiled_over_eager``: each peer's compiled over eager time over the
    same points, torch.compile's effect on the computations blockdiag replaces;
    ``geomean_control_compiled_over_eager``, the same for :data:`COMPILED_CONTROL` (plain
    layers of the same work), and ``geomean_compiled_over_eager_over_control``, blockdiag's
    compiled over eager divided by the control's, point by point: at or under 1, compiling
    costs blockdiag no more than it costs plain layers.

    >>> summarize_compiled([])
    {}
    """
    out = {}
    measured = [r for r in rows if "times_us" in r]
    for mode in sorted({r["mode"] for r in measured}):
        rs = [r for r in measured if r["mode"] == mode]
        # The blockdiag modules of the rows: auto, and the backends forced (timed or failed).
        steps = {k.removesuffix("_compiled") for r in rs for k in (*r["times_us"], *r["failed"])}
        names_ = ["auto"] + sorted(steps - {"auto", "loop", "vmap", COMPILED_CONTROL})
        models = [m for m in COMPILED_MODELS if any(r["model"] == m for r in rs)]
        s = {}
        for model in models + (["all"] if len(models) > 1 else []):
            sel = [r for r in rs if model == "all" or r["model"] == model]
            for n in names_:
                st = _compiled_stats(sel, n)
                if st is not None:
                    s[model if n == "auto" else f"{model}[{n}]"] = st
        out[mode] = s
    return out
