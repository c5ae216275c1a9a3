"""Shared pytest parameters: devices (CUDA skipped cleanly without it) and dtypes, with readable ids.

Imported by the test modules as ``from _params import ...`` (pytest puts ``tests/`` on the path).
"""

import contextlib
import dataclasses

import pytest
import torch

CUDA = torch.cuda.is_available()
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="CUDA is not available")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA_MARKS)]
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")]


@contextlib.contextmanager
def backend_spy():
    """Record which backends run (each registered kernel wrapped), for the ``with`` block."""
    from blockdiag.backends import _registry, names

    ran = []
    with pytest.MonkeyPatch.context() as m:
        for n in names():
            b = _registry.get(n)

            def fn(x, w, bias, _inner=b.fn, _name=n):
                ran.append(_name)
                return _inner(x, w, bias)

            m.setitem(_registry._REGISTRY, n, dataclasses.replace(b, fn=fn))
        yield ran


def backends_and_auto():
    """pytest params for every registered backend, then ``auto``, each with its name as id."""
    from blockdiag.backends import names

    return [pytest.param(n, id=n) for n in (*names(), "auto")]


def require_backend(name, device="cpu"):
    """Skip the calling test, with the reason, unless backend ``name`` runs on ``device`` here.

    ``"auto"`` always runs (it picks among the backends that do).
    """
    if name == "auto":
        return
    from blockdiag.backends import get

    b = get(name)
    if device not in b.dtypes:
        pytest.skip(f"backend {name!r} does not run on {device} (runs on {', '.join(sorted(b.dtypes))})")
    why = b.unavailable_reason()
    if why:
        pytest.skip(f"backend {name!r} unavailable here: {why}")


def run_or_fail_on_hang(argv, timeout: float, what: str, env=None):
    """Run ``argv`` in its own session; ``(returncode, stdout, stderr)``, or fail the test on a hang.

    A hang kills the whole process group (children too), so a regression fails the test
    instead of stalling the run.
    """
    import os
    import signal
    import subprocess

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{what} hung (>{timeout} s)")
    return proc.returncode, out, err


def tiny_script_run(script: str, out_dir) -> dict:
    """Run ``scripts/<script>`` on one tiny point of its grid (B=8, G=3, 4x2 blocks, one short
    round) with ``--json``; the JSON it wrote. A smoke test's run: no timing means anything."""
    import json
    import sys
    from pathlib import Path

    out = Path(out_dir) / "tiny.json"
    script_path = Path(__file__).resolve().parents[1] / "scripts" / script
    rc, _, err = run_or_fail_on_hang([sys.executable, str(script_path), "--batch", "8", "--groups", "3", "--blocks",
                                      "4x2", "--rounds", "1", "--min-time", "0.001", "--json", str(out)],
                                     300, script)
    assert rc == 0, err
    return json.loads(out.read_text())
