#!/usr/bin/env python3
"""One-shot GPU check of blockdiag: CUDA tests, correctness, timings, the training bench, a bf16 tune.

Run from the repository root on a machine with a CUDA device (blockdiag need not be
installed: the checkout is put on the path)::

    PYTHONUNBUFFERED=1 python scripts/gpu_check.py --out gpu_check_out

``--device cpu`` dry-runs every step on a small grid where there is no GPU.

Steps (each prints progress, each failure is recorded in the report rather than stopping
the run; a global time budget skips what would not fit):

1. environment: torch, CUDA, GPU, Triton, torch-sparse, every backend's availability;
2. the CUDA test subset (``pytest -m cuda tests``), log in ``pytest.log``;
3. every backend against a float64 reference, forward and gradients, float32 and bfloat16;
4. every backend and ``auto`` timed over a small grid (CUDA events, median of repeats),
   forward and forward+backward;
5. ``python -m blockdiag bench --mode train`` on the target grid (``bench_train.json``):
   why training ``a/best`` was 1.11 on the H200 (the dispatch's cost, ``a/kern``, or the
   choice, ``geomean_choice_over_fastest``);
6. ``python -m blockdiag tune --dtype bfloat16`` on the target grid (``profile_bf16.json``),
   the bfloat16 table the built-in CUDA entry lacks;
7. the transform matrix on the device: every backend and ``auto`` x float32/bfloat16 under
   ``torch.compile`` (default and ``fullgraph=True``), ``torch.export`` with a dynamic batch
   (run at two other batch sizes), ``torch.func`` (vmap ensembling, ``jacrev``) and forward AD,
   outputs and gradients against the float64 reference.

Profiles are written into the output folder, never into the user's. Writes
``gpu_check.json`` (everything) and ``gpu_check.txt`` (a short summary) atomically into
``--out`` after every step. Sized (``--budget``, default 540 s) to fit one 10-minute
device call on one H200, with the machine's start-up outside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import blockdiag  # noqa: E402
from blockdiag import Problem, grouped_linear  # noqa: E402
from blockdiag.backends import get, names  # noqa: E402
from blockdiag.testing import computes_in_tf32, reference_loop, tolerances  # noqa: E402

T0 = time.perf_counter()
# The device checked; ``--device cpu`` is a dry run of the script itself on a machine without one.
DEV = "cuda"

# (batch, groups, block_in, block_out): few large groups ... many tiny ones, and the forum's case.
CHECK_SHAPES = [(64, 8, 32, 32), (48, 6, 24, 24), (40, 16, 16, 32), (17, 5, 3, 5)]
TIME_SHAPES = [
    (4096, 8, 128, 128),
    (2048, 32, 64, 64),
    (1024, 64, 32, 32),
    (256, 512, 16, 16),
    (8192, 16, 256, 256),
    (64, 50, 10, 10),
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def remaining(budget: float) -> float:
    return budget - (time.perf_counter() - T0)


def write_atomic(path: Path, text: str) -> None:
    # The report is read after the lent machine is gone: a half-written file is a lost run.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def environment() -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "blockdiag": blockdiag.__version__,
        "cuda_available": torch.cuda.is_available(),
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    for mod in ("triton", "torch_sparse"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError as e:
            env[mod] = f"not installed ({e})"
    env["backends"] = {b.name: (b.reason or "available") for b in blockdiag.list_backends()}
    return env


def _timed_out(e: subprocess.TimeoutExpired, timeout: float) -> str:
    """What a timed-out child printed (``TimeoutExpired`` holds bytes even with ``text=True``)."""
    def s(b) -> str:
        return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

    return f"{s(e.stdout)}{s(e.stderr)}\nTIMED OUT after {timeout:.0f}s"


def run_pytest(out: Path, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rfE", "tests"]
    log(f"pytest: {' '.join(cmd[1:])} (timeout {timeout:.0f}s)")
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                           capture_output=True, text=True, timeout=timeout)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = _timed_out(e, timeout), None
    write_atomic(out / "pytest.log", text)
    lines = [ln for ln in str(text).splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b.* in [\d.]+s", ln)), "")
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    log(f"pytest: rc={rc} {summary}")
    return {"rc": rc, "summary": summary, "failed": failed[:50], "seconds": round(time.perf_counter() - t, 1)}


def _inputs(n, g, i, o, dtype):
    x = torch.randn(n, g * i, device=DEV).to(dtype).requires_grad_()
    w = ((torch.rand(g, o, i, device=DEV) * 2 - 1) / math.sqrt(i)).to(dtype).requires_grad_()
    b = (torch.rand(g * o, device=DEV) * 0.2 - 0.1).to(dtype).requires_grad_()
    return x, w, b


def check_correctness() -> list[dict]:
    rows = []
    for dname, dtype in DTYPES.items():
        for n, g, i, o in CHECK_SHAPES:
            for name in names():
                p = Problem(n, g, i, o, dtype, DEV, True)
                row = {"backend": name, "dtype": dname, "shape": [n, g, i, o]}
                why = get(name).decline_reason(p)
                if why:
                    row["declined"] = why
                    rows.append(row)
                    continue
                try:
                    x, w, b = _inputs(n, g, i, o, dtype)
                    y = grouped_linear(x, w, b, backend=name)
                    r = torch.randn_like(y)
                    got = torch.autograd.grad((y * r).sum(), (x, w, b))
                    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
                    yd = reference_loop(xd, wd, bd)
                    want = torch.autograd.grad((yd * r.double()).sum(), (xd, wd, bd))
                    tdt = torch.float16 if computes_in_tf32(name, p) else dtype
                    ok, errs = True, {}
                    for key, a, e, k in [("y", y.detach(), yd.detach(), i)] + list(zip(("dx", "dw", "db"), got, want, (o, n, n))):
                        mag = float(e.abs().max()) if e.numel() else 1.0
                        err = float((a.double() - e).abs().max()) if e.numel() else 0.0
                        errs[key] = err / max(mag, 1e-30)
                        tol = tolerances(tdt, max(k, 1), mag)
                        ok &= bool(torch.allclose(a.double(), e, atol=tol["atol"], rtol=tol["rtol"]))
                    row.update(ok=ok, rel_err=errs, tf32=tdt != dtype)
                except Exception as e:  # recorded in the report: the point of the script
                    row.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
                rows.append(row)
    bad = [r for r in rows if r.get("ok") is False]
    log(f"correctness: {sum(1 for r in rows if r.get('ok'))} ok, {len(bad)} failed, "
        f"{sum(1 for r in rows if 'declined' in r)} declined")
    for r in bad:
        log(f"  FAIL {r['backend']} {r['dtype']} {r['shape']}: {r.get('error') or r.get('rel_err')}")
    return rows


def _time_us(fn, budget_s: float = 0.25, min_reps: int = 5, max_reps: int = 100) -> float:
    """Median time of ``fn`` in microseconds: CUDA events on the GPU, a wall clock on CPU."""
    cuda = DEV == "cuda"
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    stop = time.perf_counter() + budget_s
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < stop):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1000.0)
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def time_grid(budget: float) -> list[dict]:
    rows = []
    candidates = list(names()) + ["auto"]
    for dname, dtype in DTYPES.items():
        for n, g, i, o in TIME_SHAPES:
            for mode in ("forward", "train"):
                if remaining(budget) < 5:
                    rows.append({"dtype": dname, "shape": [n, g, i, o], "mode": mode, "skipped": "time budget"})
                    continue
                train = mode == "train"
                x, w, b = _inputs(n, g, i, o, dtype)
                if not train:
                    x, w, b = (t.detach() for t in (x, w, b))
                p = Problem(n, g, i, o, dtype, DEV, train)
                row = {"dtype": dname, "shape": [n, g, i, o], "mode": mode, "times_us": {}, "declined": {}}
                row["auto_backend"] = blockdiag.choose(p).backend
                for name in candidates:
                    why = None if name == "auto" else get(name).decline_reason(p)
                    if why:
                        row["declined"][name] = why
                        continue

                    def step(name=name, x=x, w=w, b=b):
                        y = grouped_linear(x, w, b, backend=name)
                        if train:
                            torch.autograd.grad(y.sum(), (x, w, b))

                    try:
                        row["times_us"][name] = round(_time_us(step), 2)
                    except Exception as e:  # recorded in the report
                        row["declined"][name] = f"ERROR {type(e).__name__}: {str(e)[:300]}"
                t = row["times_us"]
                if t:
                    best = min((k for k in t if k != "auto"), key=t.get, default=None)
                    row["best"] = best
                    log(f"time {dname:8s} {mode:7s} {n}x{g}x{i}x{o}: best {best} {t.get(best)} us; "
                        f"auto->{row['auto_backend']} {t.get('auto')} us")
                rows.append(row)
                del x, w, b
                step = None  # its defaults hold the operands: free them before the next shape's
    return rows


# The target grid of issue 3 (the built-in CUDA table's grid).
TARGET_GRID = ["--batch", "32,256,2048", "--groups", "4,16,50,256", "--blocks", "10x10,150x10,64x64,256x256"]


def run_cli(out: Path, name: str, argv: list[str], timeout: float, result: str | None = None) -> dict:
    """``python -m blockdiag ARGV`` with a timeout; its output in ``NAME.log``, ``result`` (a JSON file) read back.

    Profiles go into the output folder, never into the user's. The log is written even when
    the command times out, so the progress lines of a cut-off run still come back.
    """
    env = dict(os.environ, BLOCKDIAG_PROFILE=str(out / "profile.json"), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "blockdiag", *argv]
    log(f"{name}: {' '.join(cmd[1:])} (timeout {timeout:.0f}s)")
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = _timed_out(e, timeout), None
    write_atomic(out / f"{name}.log", text)
    res = {"argv": argv, "rc": rc, "output_tail": text[-3000:]}
    if result is not None and (out / result).exists():
        try:
            res["result"] = json.loads((out / result).read_text())
        except json.JSONDecodeError as e:
            res["result_error"] = str(e)
    log(f"{name}: rc={rc}")
    return res


def run_bench_train(out: Path, timeout: float) -> dict:
    # Training on the target grid with bench's diagnosis columns: a/kern (auto over the
    # chosen kernel: the dispatch's cost) and the choice alone (the chosen backend forced,
    # over the fastest). Which of the two is over 1 says why training a/best was 1.11 on
    # the H200 (docs/tuning.md, "The built-in CUDA table").
    return run_cli(out, "bench_train", ["bench", "--device", DEV, "--mode", "train", *TARGET_GRID,
                                        "--no-memory", "--min-time", "0.004", "--json", str(out / "bench_train.json")],
                   timeout, "bench_train.json")


def run_tune_bf16(out: Path, timeout: float) -> dict:
    # The bfloat16 table the built-in CUDA entry lacks, on the same grid as its float32 one.
    prof = out / "profile_bf16.json"
    return run_cli(out, "tune_bf16", ["tune", "--device", DEV, "--dtype", "bfloat16", *TARGET_GRID, "--mode", "both",
                                      "--min-time", "0.004", "--profile", str(prof)], timeout, prof.name)


# Cheap modes first: the matrix runs mode by mode, so a budget that runs out cuts the costly
# compiles, never a backend or dtype (bfloat16, grouped_mm's only one, comes second).
TRANSFORMS = ("forward_ad", "vmap", "jacrev", "double_backward", "export", "compile", "fullgraph")


def _transform_case(name: str, mode: str, dtype: torch.dtype) -> dict:
    """One backend under one transform, against the float64 reference: errors relative to the reference's size."""
    from torch.func import functional_call, jacrev, stack_module_state, vmap
    from torch.autograd import forward_ad as fwad

    n, g, i, o = 6, 3, 8, 8
    layer = blockdiag.GroupedLinear(g * i, g * o, g, backend=name, device=DEV, dtype=dtype)
    x = torch.randn(n, g * i, device=DEV).to(dtype)
    w64, b64 = layer.weight.detach().double(), layer.bias.detach().double()
    errs = {}

    def rel(got, want):
        return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))

    if mode in ("compile", "fullgraph", "export"):
        torch._dynamo.reset()
        for batch in (n, n + 3, 2 * n + 1):
            xb = torch.randn(batch, g * i, device=DEV).to(dtype).requires_grad_()
            if mode == "export":
                if batch == n:
                    run = torch.export.export(layer, (xb.detach(),), dynamic_shapes=({0: torch.export.Dim("batch")},)).module()
                y = run(xb.detach())
                errs[f"y@{batch}"] = rel(y, reference_loop(xb.detach().double(), w64, b64))
                continue
            if batch == n:
                run = torch.compile(layer, fullgraph=mode == "fullgraph")
            y = run(xb)
            r = torch.randn_like(y)
            got = torch.autograd.grad((y * r).sum(), (xb, layer.weight, layer.bias))
            xd, wd, bd = (t.detach().double().requires_grad_() for t in (xb, layer.weight, layer.bias))
            yd = reference_loop(xd, wd, bd)
            want = torch.autograd.grad((yd * r.double()).sum(), (xd, wd, bd))
            errs[f"y@{batch}"] = rel(y, yd)
            for key, a, e in zip(("dx", "dw", "db"), got, want):
                errs[f"{key}@{batch}"] = rel(a, e)
    elif mode == "vmap":
        models = [blockdiag.GroupedLinear(g * i, g * o, g, backend=name, device=DEV, dtype=dtype) for _ in range(3)]
        params, bufs = stack_module_state(models)
        base = blockdiag.GroupedLinear(g * i, g * o, g, backend=name, device="meta", dtype=dtype)
        y = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(params, bufs, x)
        want = torch.stack([reference_loop(x.double(), m.weight.detach().double(), m.bias.detach().double()) for m in models])
        errs["y"] = rel(y, want)
    elif mode == "jacrev":
        j = jacrev(lambda w: functional_call(layer, {"weight": w, "bias": layer.bias.detach()}, (x,)))(layer.weight.detach())
        want = jacrev(lambda w: reference_loop(x.double(), w, b64))(w64)
        errs["jac"] = rel(j, want)
    elif mode == "double_backward":
        # A gradient penalty: d/dW of |dL/dx|^2. First-order backends must refuse it.
        xg = x.detach().requires_grad_()
        (gx,) = torch.autograd.grad(layer(xg).square().sum(), (xg,), create_graph=True)
        if name != "auto" and not get(name).double_grad:
            raise AssertionError(f"{name} declares no double backward but create_graph=True ran")
        (gw,) = torch.autograd.grad(gx.square().sum(), (layer.weight,))
        xd, wd = x.detach().double().requires_grad_(), w64.clone().requires_grad_()
        (gxd,) = torch.autograd.grad(reference_loop(xd, wd, b64).square().sum(), (xd,), create_graph=True)
        (want,) = torch.autograd.grad(gxd.square().sum(), (wd,))
        errs["d2w"] = rel(gw, want)
    else:  # forward_ad, with frozen parameters and no grad (a residual block's JVP)
        t = torch.randn_like(x)
        with torch.no_grad(), fwad.dual_level():
            tangent = fwad.unpack_dual(layer(fwad.make_dual(x, t))).tangent
        if tangent is None:
            raise AssertionError("forward AD dropped the tangent")
        errs["tangent"] = rel(tangent, reference_loop(t.double(), w64, None))
    return errs


def check_transforms(budget: float) -> list[dict]:
    """Every backend and ``auto`` under compile, export, torch.func and forward AD (small shapes)."""
    rows = []
    names_ = ["auto"] + [nm for nm in names() if get(nm).unavailable_reason() is None and DEV in get(nm).dtypes]
    if DEV == "cpu":
        names_ = names_[:2]  # the dry run exercises the code, not the whole matrix
    for mode in TRANSFORMS:
      for dname, dtype in DTYPES.items():
        tol = 5e-2 if dtype == torch.bfloat16 else 1e-3  # relative to the reference's size; TF32 included
        for name in names_:
            if name != "auto" and get(name).decline_reason(Problem(6, 3, 8, 8, dtype, DEV, True)):
                continue
            if True:
                if remaining(budget) < 5:
                    rows.append({"backend": name, "dtype": dname, "mode": mode, "skipped": "time budget"})
                    continue
                row = {"backend": name, "dtype": dname, "mode": mode}
                try:
                    errs = _transform_case(name, mode, dtype)
                    row.update(ok=all(v <= tol for v in errs.values()), rel_err=errs)
                except blockdiag.BlockDiagError as e:
                    # A first-order backend refusing create_graph=True is the declared behaviour.
                    ok = mode == "double_backward" and name != "auto" and not get(name).double_grad and "first-order" in str(e)
                    row.update(ok=ok, refused=str(e)[:300]) if ok else row.update(ok=False, error=f"BlockDiagError: {str(e)[:300]}")
                except Exception as e:  # recorded in the report: the point of the script
                    row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                rows.append(row)
    bad = [r for r in rows if r.get("ok") is False]
    log(f"transforms: {sum(1 for r in rows if r.get('ok'))} ok, {len(bad)} failed, "
        f"{sum(1 for r in rows if 'skipped' in r)} skipped")
    for r in bad:
        log(f"  FAIL {r['backend']} {r['dtype']} {r['mode']}: {r.get('error') or r.get('rel_err')}")
    return rows


def summarize(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"blockdiag gpu_check  {time.strftime('%Y-%m-%d %H:%M:%S')}  ({report['seconds']:.0f}s)",
        f"GPU {env.get('gpu')} (cc {env.get('capability')}), torch {env['torch']} CUDA {env['torch_cuda']}, "
        f"triton {env.get('triton')}, torch_sparse {env.get('torch_sparse')}",
        "backends: " + ", ".join(f"{k}={'ok' if v == 'available' else v}" for k, v in env["backends"].items()),
    ]
    pt = report.get("pytest", {})
    lines.append(f"pytest -m cuda: rc={pt.get('rc')} {pt.get('summary', pt.get('error', ''))}")
    lines += [f"  {ln}" for ln in pt.get("failed", [])[:10]]
    corr = report.get("correctness", [])
    if isinstance(corr, list):
        bad = [r for r in corr if r.get("ok") is False]
        lines.append(f"correctness vs float64: {sum(1 for r in corr if r.get('ok'))} ok, {len(bad)} failed")
        lines += [f"  FAIL {r['backend']} {r['dtype']} {r['shape']}: {r.get('error', r.get('rel_err'))}" for r in bad[:10]]
    else:
        lines.append(f"correctness: {corr}")
    timing = report.get("timing", [])
    if isinstance(timing, list):
        lines.append("timings (median us; best backend / auto's pick):")
        for r in timing:
            t = r.get("times_us")
            if not t:
                lines.append(f"  {r['dtype']:8s} {r['mode']:7s} {r['shape']}: {r.get('skipped', 'nothing ran')}")
                continue
            best = r.get("best")
            auto = t.get("auto")
            ratio = f"{auto / t[best]:.2f}x best" if auto and best else "-"
            others = " ".join(f"{k}={v:.0f}" for k, v in sorted(t.items(), key=lambda kv: kv[1]))
            lines.append(f"  {r['dtype']:8s} {r['mode']:7s} {'x'.join(map(str, r['shape'])):16s} "
                         f"best={best} auto->{r['auto_backend']} ({ratio}) | {others}")
    tr = report.get("transforms", [])
    if isinstance(tr, list):
        bad = [r for r in tr if r.get("ok") is False]
        lines.append(f"transforms (compile/export/torch.func/forward AD): {sum(1 for r in tr if r.get('ok'))} ok, "
                     f"{len(bad)} failed")
        lines += [f"  FAIL {r['backend']} {r['dtype']} {r['mode']}: {r.get('error', r.get('rel_err'))}" for r in bad[:15]]
    else:
        lines.append(f"transforms: {tr}")
    for key in ("bench_train", "tune_bf16"):
        r = report.get(key, {})
        lines.append(f"{key}: rc={r.get('rc')} {r.get('error', r.get('skipped', ''))}")
        summary = r.get("result", {}).get("summary", {}) if key == "bench_train" else {}
        lines += [f"  {mode}: " + ", ".join(f"{k}={v}" for k, v in s.items()) for mode, s in summary.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check_out", help="output folder (created)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run")
    ap.add_argument("--skip-pytest", action="store_true")
    ap.add_argument("--skip-bench", action="store_true", help="skip the training bench on the target grid")
    ap.add_argument("--skip-tune", action="store_true", help="skip the bfloat16 tune on the target grid")
    ap.add_argument("--skip-transforms", action="store_true", help="skip the compile/export/torch.func matrix")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="'cpu' dry-runs the script (small grid) where there is no GPU")
    ap.add_argument("--quick", action="store_true", help="time only the first two shapes")
    args = ap.parse_args(argv)
    global DEV, TIME_SHAPES
    DEV = args.device
    if args.quick or DEV == "cpu":
        TIME_SHAPES = [(256, 8, 16, 16), (64, 50, 10, 10)]
    if DEV == "cpu":
        # The dry run's grid: one tiny point, so the whole script is exercised in seconds.
        TARGET_GRID[:] = ["--batch", "8", "--groups", "2", "--blocks", "4x4"]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"environment": environment()}
    log(f"environment: {json.dumps({k: v for k, v in report['environment'].items() if k != 'backends'})}")
    if DEV == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: nothing to check")
        report["seconds"] = time.perf_counter() - T0
        write_atomic(out / "gpu_check.json", json.dumps(report, indent=1, default=str))
        write_atomic(out / "gpu_check.txt", summarize(report))
        return 2

    steps = [
        ("pytest", lambda: run_pytest(out, max(30.0, min(170.0, remaining(args.budget) - 150))),
         not args.skip_pytest),
        ("correctness", check_correctness, True),
        # On the device the bench and tune after it keep 260 s; the dry run has neither to wait for.
        ("transforms", lambda: check_transforms(args.budget - (260 if DEV == "cuda" else 120)),
         not args.skip_transforms),
        ("timing", lambda: time_grid(args.budget - 100), True),
        ("bench_train", lambda: run_bench_train(out, max(30.0, remaining(args.budget) - 120)), not args.skip_bench),
        ("tune_bf16", lambda: run_tune_bf16(out, max(30.0, remaining(args.budget) - 10)), not args.skip_tune),
    ]
    for key, fn, enabled in steps:
        if not enabled:
            report[key] = {"skipped": "by option"}
            continue
        log(f"--- {key}")
        try:
            report[key] = fn()
        except Exception as e:  # one broken step must not lose the others' results
            report[key] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            log(f"{key}: ERROR {type(e).__name__}: {e}")
        report["seconds"] = time.perf_counter() - T0
        # Written after every step, so a run stopped at its limit still leaves a report.
        write_atomic(out / "gpu_check.json", json.dumps(report, indent=1, default=str))
        write_atomic(out / "gpu_check.txt", summarize(report))
    print(summarize(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
