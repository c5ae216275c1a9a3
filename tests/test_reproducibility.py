"""Reproducibility on CPU: what the FAQ's "Reproducibility" section says holds.

- The same seeded script in fresh processes gives the same bits through ``simd``'s own
  kernels, with two threads at sizes above the serial threshold (the work is split over
  threads: a split whose order followed thread scheduling would show here), whatever
  Python's string hashing seed.
- ``simd``'s forward gives a row the same bits alone as in a batch, and at any thread count.
- ``torch.use_deterministic_algorithms(True)`` runs every CPU backend and strategy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import blockdiag

_CPU = [b.name for b in blockdiag.list_backends() if b.available]

# Above simd's and mkl_batch's serial threshold (32768 multiply-adds per product), so both
# run on two threads; 96 x 4 x 150 x 10 takes simd's dot-product form. One Adam step, then the
# forward again with the stepped weights.
_SCRIPT = r"""
import hashlib, json, sys, torch, blockdiag
torch.set_num_threads(2)
backends = json.loads(sys.argv[1])
out = {}
def digest(*ts):
    h = hashlib.sha256()
    for t in ts:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()
for name in backends:
    for n, g, i, o in ((128, 16, 64, 64), (96, 4, 150, 10)):
        torch.manual_seed(0)
        layer = blockdiag.GroupedLinear(g * i, g * o, g, backend=name)
        x = torch.randn(n, g * i, requires_grad=True)
        opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
        y = layer(x)
        y.square().sum().backward()
        opt.step()
        out[f"{name} {n}x{g}x{i}x{o}"] = digest(y, x.grad, layer.weight.grad, layer.bias.grad, layer.weight,
                                                 layer.bias, layer(x))
print(json.dumps(out))
"""


def _start(hash_seed: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONHASHSEED=hash_seed)
    return subprocess.Popen([sys.executable, "-c", _SCRIPT, json.dumps(["simd"])], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_fresh_processes_give_the_same_bits():
    # simd's own kernels, whose thread split is fixed; the products of MKL (the other backends,
    # nn.Linear) may take another code path from one process to the next (a run of `loop`
    # matched `dense`'s bits in one process and not in another): the FAQ says so.
    if "simd" not in _CPU:
        pytest.skip("simd does not run here")
    procs = [_start("1"), _start("2")]  # at once: the comparison is of bits, not of times
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    first, second = results
    assert len(first) == 2
    assert {k for k in first if first[k] != second[k]} == set()


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# Broadcast and dot-product forms, partial vectors and row tiles, more than 256 inputs (summed
# in blocks), blocks above the BLAS-gradient size, several column chunks.
_SHAPES = [(8, 32, 16), (4, 150, 10), (3, 70, 5), (2, 300, 33), (2, 256, 256), (16, 10, 10), (1, 17, 130)]


@pytest.mark.skipif("simd" not in _CPU, reason="simd unavailable here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_simd_forward_is_batch_and_thread_invariant(threads, dtype):
    # Each output is one sum over its block's inputs, in the same order whatever the rows
    # around it and however the rows or groups are shared among threads.
    for g, i, o in _SHAPES:
        w = torch.randn(g, o, i).to(dtype)
        b = torch.randn(g * o).to(dtype)
        x = torch.randn(256, g * i).to(dtype)
        torch.set_num_threads(1)
        ref = blockdiag.grouped_linear(x, w, b, backend="simd")
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(blockdiag.grouped_linear(x, w, b, backend="simd"), ref), (g, i, o, t)
            for lo, hi in ((0, 1), (100, 101), (255, 256), (3, 10), (0, 255)):
                got = blockdiag.grouped_linear(x[lo:hi], w, b, backend="simd")
                assert torch.equal(got, ref[lo:hi]), (g, i, o, t, lo, hi)


@pytest.mark.skipif("simd" not in _CPU, reason="simd unavailable here")
@pytest.mark.parametrize("shared", [True, False])
def test_simd_layers_mlp_is_batch_invariant(threads, shared):
    # The FAQ's recipe for a batch-invariant GroupedMLP: each layer is simd's forward, the
    # activations are element-wise.
    torch.set_num_threads(2)
    m = blockdiag.GroupedMLP(48, [64, 32], 8, 8, shared_input=shared, backend="simd", strategy="layers")
    x = torch.randn(256, 48 if shared else 48 * 8)
    with torch.no_grad():
        full = m(x)
        for lo, hi in ((0, 1), (100, 101), (3, 10), (0, 255)):
            assert torch.equal(m(x[lo:hi]), full[lo:hi]), (lo, hi)


@pytest.fixture(params=[False, True], ids=["raise", "warn_only"])
def deterministic(request):
    before, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=request.param)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    torch.use_deterministic_algorithms(before, warn_only=warn)
    assert not [str(w.message) for w in caught if "determinis" in str(w.message)]


def test_deterministic_mode_runs_every_cpu_backend(deterministic):
    for name in _CPU + ["auto"]:
        for n, g, i, o in ((64, 8, 32, 16), (3, 4, 8, 8)):
            layer = blockdiag.GroupedLinear(g * i, g * o, g, backend=name)
            x = torch.randn(n, g * i, requires_grad=True)
            y = layer(x)
            y.square().sum().backward()
            assert torch.isfinite(y).all() and torch.isfinite(layer.weight.grad).all(), name
    for strategy in ("layers", "fm_chain", "heads", "auto"):
        m = blockdiag.GroupedMLP(16, [32], 8, 4, strategy=strategy)
        m(torch.randn(32, 16, requires_grad=True)).sum().backward()
