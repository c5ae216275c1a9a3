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
