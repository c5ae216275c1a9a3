#!/usr/bin/env python3
"""Group parallelism on CPU with gloo: one process x 2 threads against 2 processes x 1 thread.

The **Measure** item of issue 24, as a script (not a timed test). Run from the repository root
(blockdiag need not be installed: the checkout is put on the path)::

    python scripts/bench_distributed.py --json bench_distributed.json

The model: ``blockdiag.GroupedMLP(150, [10, 10], 1, heads=G)`` with a shared input (the forum's
per-head shape, ``auto`` strategy and backends), float32, batch 256, for ``G`` in 256 and 1024
heads. One training step is forward, a mean-squared-error loss, backward, ``torch.optim.Adam``
step and ``zero_grad``. The configurations:

* ``1x2``: one process, ``torch.set_num_threads(2)``, the plain model;
* ``1x1``: the same on one thread (for context: what one rank's core does alone);
* ``2x1-shard``: two gloo processes, one thread each, ``parallelize_groups(model, mesh)``, the
  output kept sharded (each rank's loss is its heads' share, no collective);
* ``2x1-repl``: the same with ``output_layouts=Replicate()`` (every rank gets the whole output
  through one all-gather, and computes the whole loss).

Every (configuration, G) runs in freshly forked processes (from this launcher, which has
imported torch and blockdiag but computed nothing), so each has its own memory high-water mark.
The configurations are interleaved: ``--rounds`` rounds, each running every configuration once,
in reversed order every other round. Per run: ``--warmup`` steps, then ``--steps`` timed steps
(after a barrier in the 2-process runs); the run's time per step is the slowest rank's wall
time over the timed steps divided by their number. Reported: the median over rounds and the
spread (min-max).

Memory, per rank: (1) the tensors, exactly: parameter bytes held by the rank (``to_local()`` of
a DTensor) against the whole model's, and the training state (parameters, gradients, Adam's two
moments); (2) the process's resident-set high-water mark (``VmHWM`` of ``/proc/self/status``,
reset through ``/proc/self/clear_refs`` after the model is built and sharded, so it covers the
training steps only), reported as its increase over the resident set before the model was
built (after one step of a tiny model through the same code paths, so one-time allocations such
as thread pools and caches are not counted). Where the reset is not allowed,
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (the process's lifetime peak) is used instead;
the JSON says which.

Communication: one further step (after the timed ones; not timed) runs under
``torch.distributed.tensor.debug.CommDebugMode`` (its collective count), subclassed to add up
the bytes of every collective it sees: for a functional collective (what DTensor issues) the
local input and the output; for a ``c10d`` op (a plain ``dist.*`` call) every tensor argument.
This is payload per rank, not bytes on the wire (gloo's ring all-gather sends
``(world - 1) / world`` of the output per rank).

Writes ``--json PATH`` (every run, every rank) and prints a Markdown table. About 1-2 minutes
on 2 quiet cores with the defaults, 3 on busy ones. A run that takes longer than ``--timeout``
seconds is killed and the script fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the workers set their own thread counts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import blockdiag  # noqa: E402
import blockdiag.distributed as bdd  # noqa: E402
from blockdiag.cli._args import _output_json  # noqa: E402
from blockdiag.profile import write_json_atomic  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402
from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING  # noqa: E402
from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops as _C10D_COLLECTIVES  # noqa: E402

# The functional collectives (what DTensor issues): CommDebugMode's own list of them.
_FUNCOL_COLLECTIVES = set(NATIVE_TO_PY_MAPPING)

IN, HIDDEN, OUT = 150, [10, 10], 1
CONFIGS = {
    # name: (processes, threads per process, output layout)
    "1x2": (1, 2, None),
    "1x1": (1, 1, None),  # context: the plain model on one thread
    "2x1-shard": (2, 1, "shard"),
    "2x1-repl": (2, 1, "replicate"),
}
MB = 1e6

# ----------------------------------------------------------------------------- measuring


class _CommBytes(CommDebugMode):
    """``CommDebugMode`` that also adds up the bytes of the collectives it sees (per rank)."""

    def __enter__(self):
        self.ops = []  # (op name, input bytes, output bytes)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator) or any(t is DTensor for t in types):
            return super().__torch_dispatch__(func, types, args, kwargs)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        packet = func._overloadpacket
        name = f"{func.namespace}.{packet.__name__}"
        if packet in _FUNCOL_COLLECTIVES or packet in self.comm_registry:
            self.ops.append((name, _nbytes(args[0]), _nbytes(out)))
        elif packet in _C10D_COLLECTIVES:
            self.ops.append((name, _nbytes(args), 0))
        return out


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _proc_status() -> dict:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set (Linux >= 4.0)
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ----------------------------------------------------------------------------- the worker


def _worker(rank: int, config: str, heads: int, args: dict, tmp: str, tag: str) -> None:
    from datetime import timedelta

    world, threads, output = CONFIGS[config]
    torch.set_num_threads(threads)
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group(
            "gloo", rank=rank, world_size=world, init_method=f"file://{os.path.join(tmp, tag + '-store')}",
            timeout=timedelta(seconds=args["timeout"]),
        )
        mesh = init_device_mesh("cpu", (world,))
    try:
        res = _run(rank, world, mesh, heads, output, args)
        if world > 1:
            dist.barrier()
    except BaseException:
        sys.stderr.write(f"rank {rank} of {tag} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        raise
    finally:
        if world > 1:
            dist.destroy_process_group()
    write_json_atomic(os.path.join(tmp, f"{tag}-{rank}.json"), res)


def _build(world, mesh, heads, output):
    """The model (the same initial parameters on every rank), group parallel when world > 1."""
    torch.manual_seed(0)
    model = blockdiag.GroupedMLP(IN, HIDDEN, OUT, heads=heads)
    cols = slice(0, heads)
    if world > 1:
        bdd.parallelize_groups(model, mesh, output_layouts=Replicate() if output == "replicate" else None)
        if output != "replicate":
            mine = bdd.local_groups(heads, mesh)
            cols = slice(mine.start, mine.stop)
    return model, cols


def _prime(world, mesh, output) -> None:
    """One step of a tiny model through the same code paths, so that what the first step loads
    or allocates once (thread pools, plans, DTensor's caches) is in the baseline resident set."""
    model, cols = _build(world, mesh, 2 * world, output)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, IN)).sum().backward()
    opt.step()
    del model, opt
    gc.collect()


def _run(rank, world, mesh, heads, output, args) -> dict:
    batch, steps, warmup = args["batch"], args["steps"], args["warmup"]
    _prime(world, mesh, output)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, IN, generator=gen)  # the whole (shared) input, on every rank
    target = torch.randn(batch, heads, generator=gen)
    scale = batch * heads  # the loss: mean squared error over every head's output

    rss_before = _proc_status().get("VmRSS", 0)
    model, cols = _build(world, mesh, heads, output)
    tgt = target[:, cols].contiguous()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    setup_hwm = _proc_status().get("VmHWM", _peak_rss())
    reset = _reset_hwm()
    rss_after_setup = _proc_status().get("VmRSS", 0)

    def step(keep_grads: bool = False):
        y = model(x)
        loss = (y - tgt).pow(2).sum() / scale  # sharded: this rank's heads' share
        loss.backward()
        opt.step()
        if not keep_grads:
            opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step()
    if world > 1:
        dist.barrier()
    times = []
    t_all = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - t_all
    hwm = _proc_status().get("VmHWM") if reset else None
    peak_method = "VmHWM after /proc/self/clear_refs" if reset else "getrusage ru_maxrss (lifetime)"
    peak = hwm if hwm is not None else _peak_rss()

    with warnings.catch_warnings():  # CommDebugMode's module tracker: "Full backward hook is firing ..."
        warnings.simplefilter("ignore", UserWarning)
        with _CommBytes() as comm:
            step(keep_grads=True)
    params = list(model.parameters())
    param_local = sum(_nbytes(_local(p)) for p in params)
    param_total = sum(p.numel() * p.element_size() for p in params)
    grads = sum(_nbytes(_local(p.grad)) for p in params if p.grad is not None)
    adam = sum(_nbytes(_local(s[k])) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s)
    return {
        "rank": rank,
        "threads": torch.get_num_threads(),
        "step_s": elapsed / steps,
        "step_times_s": times,
        "param_bytes_local": param_local,
        "param_bytes_total": param_total,
        "state_bytes_local": param_local + grads + adam,  # parameters + gradients + Adam moments
        "rss_before_model_bytes": rss_before,
        "rss_after_setup_bytes": rss_after_setup,
        "setup_hwm_bytes": setup_hwm,
        "train_peak_bytes": peak,
        "train_peak_over_before_model_bytes": peak - rss_before,
        "peak_method": peak_method,
        "comm_count": comm.get_total_counts(),
        "comm_ops": [list(o) for o in comm.ops],
        "comm_bytes_in": sum(o[1] for o in comm.ops),
        "comm_bytes_out": sum(o[2] for o in comm.ops),
        "local_heads": cols.stop - cols.start,
    }


# ----------------------------------------------------------------------------- the launcher


def _launch(config: str, heads: int, args: dict, tmp: str, tag: str) -> list[dict]:
    world = CONFIGS[config][0]
    ctx = mp.start_processes(_worker, args=(config, heads, args, tmp, tag), nprocs=world,
                             join=False, start_method="fork")
    deadline = time.monotonic() + args["timeout"]
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise SystemExit(f"{tag}: no result within {args['timeout']} s; its processes were killed")
    return [json.load(open(os.path.join(tmp, f"{tag}-{r}.json"))) for r in range(world)]


def _summary(config: str, heads: int, runs: list[list[dict]]) -> dict:
    world, threads, output = CONFIGS[config]
    per_round = [max(r["step_s"] for r in ranks) * 1e3 for ranks in runs]  # the slowest rank
    last = runs[-1]
    return {
        "heads": heads,
        "config": config,
        "processes": world,
        "threads_per_process": threads,
        "output": output or "plain model",
        "step_ms_rounds": per_round,
        "step_ms_median": statistics.median(per_round),
        "step_ms_min": min(per_round),
        "step_ms_max": max(per_round),
        "param_bytes_per_rank": [r["param_bytes_local"] for r in last],
        "param_bytes_total": last[0]["param_bytes_total"],
        "param_share_per_rank": [r["param_bytes_local"] / r["param_bytes_total"] for r in last],
        "state_bytes_per_rank": [r["state_bytes_local"] for r in last],
        # The highest peak a rank reached in any round (the median is in the runs).
        "train_peak_over_before_model_bytes_per_rank": [
            max(ranks[i]["train_peak_over_before_model_bytes"] for ranks in runs) for i in range(world)
        ],
        "train_peak_bytes_per_rank": [
            max(ranks[i]["train_peak_bytes"] for ranks in runs) for i in range(world)
        ],
        "peak_method": last[0]["peak_method"],
        "comm_count_per_step": [r["comm_count"] for r in last],
        "comm_bytes_in_per_step": [r["comm_bytes_in"] for r in last],
        "comm_bytes_out_per_step": [r["comm_bytes_out"] for r in last],
        "comm_ops": last[0]["comm_ops"],
        "runs": runs,
    }


def _fmt_bytes(n: float) -> str:
    return f"{n / MB:.2f} MB" if n >= 0.01 * MB else f"{int(n)} B"


def _table(results: list[dict]) -> str:
    head = ("| heads | configuration | ms / step, median (min-max) | vs 1x2 | parameters per rank (of total) "
            "| params+grads+Adam per rank | peak RSS over baseline per rank (highest round) "
            "| collectives / step | bytes / step / rank (in -> out) |")
    lines = [head, "|" + "---|" * 9]
    base = {r["heads"]: r["step_ms_median"] for r in results if r["config"] == "1x2"}
    for r in results:
        ref = base.get(r["heads"])
        speed = f"{ref / r['step_ms_median']:.2f}x" if ref else "-"
        params = " / ".join(_fmt_bytes(b) for b in r["param_bytes_per_rank"])
        share = "/".join(f"{s:.2f}" for s in sorted(set(r["param_share_per_rank"])))
        peak = " / ".join(f"{b / MB:.1f} MB" for b in r["train_peak_over_before_model_bytes_per_rank"])
        state = " / ".join(_fmt_bytes(b) for b in r["state_bytes_per_rank"])
        count = max(r["comm_count_per_step"])
        sent, got = max(r["comm_bytes_in_per_step"]), max(r["comm_bytes_out_per_step"])
        bytes_ = f"{_fmt_bytes(sent)} -> {_fmt_bytes(got)}" if count else "0"
        lines.append(
            f"| {r['heads']} | {r['config']} "
            f"({r['processes']} x {r['threads_per_process']} thr, {r['output']}) "
            f"| {r['step_ms_median']:.1f} ({r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}) | {speed} "
            f"| {params} ({share} of {_fmt_bytes(r['param_bytes_total'])}) | {state} | {peak} | {count} "
            f"| {bytes_} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, nargs="+", default=[256, 1024],
                   help="head counts G (default: 256 1024)")
    p.add_argument("--batch", type=int, default=256, help="batch size (default: 256)")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds of every configuration (default: 5)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (default: 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default: 3)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one run may take before it is killed")
    p.add_argument("--json", metavar="PATH", type=_output_json, help="write every figure here")
    a = p.parse_args(argv)
    for g in a.heads:
        if g % 2:
            p.error(f"--heads {g}: the 2-process configurations need an even head count")
    args = {"batch": a.batch, "steps": a.steps, "warmup": max(a.warmup, 1), "timeout": a.timeout}

    load_before = os.getloadavg()
    t_start = time.monotonic()
    runs = {(g, c): [] for g in a.heads for c in a.configs}
    with tempfile.TemporaryDirectory(prefix="bench_distributed-") as tmp:
        for rnd in range(a.rounds):
            order = a.configs if rnd % 2 == 0 else a.configs[::-1]
            for g in a.heads:
                for c in order:
                    tag = f"r{rnd}-g{g}-{c}"
                    ranks = _launch(c, g, args, tmp, tag)
                    runs[(g, c)].append(ranks)
                    ms = max(r["step_s"] for r in ranks) * 1e3
                    print(f"round {rnd + 1}/{a.rounds}  G={g:<5} {c:<10} {ms:8.1f} ms/step", flush=True)
    load_after = os.getloadavg()
    results = [_summary(c, g, runs[(g, c)]) for g in a.heads for c in a.configs]

    ncpu = os.cpu_count() or 1
    loaded = max(load_before[0], load_after[0]) > max(3.0, 1.5 * ncpu)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    report = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            "cpu": cpu, "cpu_count": ncpu, "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__, "blockdiag": getattr(blockdiag, "__version__", "?"),
            "loadavg_before": load_before, "loadavg_after": load_after, "loaded": loaded,
        },
        "settings": {
            "model": f"GroupedMLP({IN}, {HIDDEN}, {OUT}, heads=G), shared input, float32, strategy auto",
            "step": "forward, MSE loss, backward, Adam step, zero_grad",
            **{k: v for k, v in args.items()}, "rounds": a.rounds, "heads": a.heads, "configs": a.configs,
            "time": "per run: the slowest rank's wall time over the timed steps / steps; "
                    "median and min-max over rounds",
            "memory": "tensor bytes per rank (to_local); peak RSS: VmHWM reset after setup (or ru_maxrss) "
                      "minus VmRSS before the model, highest over rounds",
            "communication": "CommDebugMode counts; bytes per rank: a functional collective's input and "
                             "output, a c10d op's tensor arguments",
        },
        "wall_s": time.monotonic() - t_start,
        "results": results,
    }
    table = _table(results)
    print()
    print(table)
    print(f"\nload average {load_before[0]:.2f} before, {load_after[0]:.2f} after, on {ncpu} CPUs"
          + ("  (LOADED: other work shares the cores; times are noisy)" if loaded else "")
          + f"; {report['wall_s']:.0f} s; peak: {results[0]['peak_method']}")
    report["table_markdown"] = table
    if a.json:
        write_json_atomic(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
