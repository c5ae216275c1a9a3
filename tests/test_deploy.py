"""Deployment: an exported program and an AOTInductor package run in a fresh process.

A deployed model is loaded where it was not built: the ops must be found by name (importing
blockdiag registers them), ``auto`` must plan in the new process, and a dynamic batch must
serve sizes the export never saw. Each load runs in a subprocess, with a timeout.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _params import DTYPES, backends_and_auto, require_backend, run_or_fail_on_hang

import blockdiag

G, I, H, O = 3, 8, 4, 2  # groups, block_in, hidden, block_out
BATCHES = (5, 37)  # the export's example batch, and one it never saw
ROOT_DOCS = Path(__file__).resolve().parents[1] / "docs"


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "linear":
        return blockdiag.GroupedLinear(G * I, G * O, groups=G)
    return blockdiag.GroupedMLP(I, [H], O, heads=G)  # the forum's shape: every head reads all of x


def _loop(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The float64 loop over the model's heads (to_heads), the reference every load is held to."""
    heads = model.to_heads() if isinstance(model, blockdiag.GroupedMLP) else model.to_linears()
    x = x.double()
    if isinstance(model, blockdiag.GroupedMLP):
        return torch.cat([h.double()(x) for h in heads], -1)
    xs = x.split(I, -1)
    return torch.cat([h.double()(xi) for h, xi in zip(heads, xs)], -1)


def _width(kind: str) -> int:
    return G * I if kind == "linear" else I


def _saved(model, tmp_path, kind: str, aoti: bool) -> tuple:
    x = torch.randn(BATCHES[0], _width(kind))
    batch = torch.export.Dim("batch", min=2, max=1024)
    ep = torch.export.export(model.eval(), (x,), dynamic_shapes=({0: batch},))
    path = tmp_path / f"{kind}.pt2"
    if aoti:
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    else:
        torch.export.save(ep, path)
    inputs = [torch.randn(b, _width(kind)) for b in BATCHES]
    torch.save({"inputs": inputs, "want": [_loop(model, xi) for xi in inputs]}, tmp_path / "io.pt")
    return path, tmp_path / "io.pt"


LOAD = textwrap.dedent(
    """
    import sys
    import torch
    import blockdiag  # registers the ops the program calls by name
    path, io, aoti = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    run = torch._inductor.aoti_load_package(path) if aoti else torch.export.load(path).module()
    data = torch.load(io)
    with torch.no_grad():
        for x, want in zip(data["inputs"], data["want"]):
            got = run(x)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
            print("ok", tuple(x.shape))
    """
)


# AOTInductor compiles C++ (inductor's own compiler choice: $CXX, else g++ or clang++).
NO_CXX = not any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "g++", "clang++"))


@pytest.mark.parametrize("aoti", [False, pytest.param(True, marks=pytest.mark.skipif(NO_CXX, reason="no C++ compiler"))],
                         ids=["export", "aoti"])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_deployed_model_runs_in_a_fresh_process(kind, aoti, tmp_path):
    path, io = _saved(_model(kind), tmp_path, kind, aoti)
    rc, out, err = run_or_fail_on_hang([sys.executable, "-c", LOAD, str(path), str(io), str(int(aoti))], 300,
                                       f"loading the {kind} {'package' if aoti else 'program'}")
    assert rc == 0, err[-3000:]
    w = _width(kind)
    assert out.split() == ["ok", f"({BATCHES[0]},", f"{w})", "ok", f"({BATCHES[1]},", f"{w})"], out


def _onnx_run(model, x, tmp_path, dynamo: bool):
    """``model`` exported by torch's ONNX exporter (``dynamo``: the torch.export one, else the
    TorchScript one) with a dynamic batch, loaded in onnxruntime."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    if dynamo:
        pytest.importorskip("onnxscript")
    path = tmp_path / "model.onnx"
    if dynamo:
        batch = torch.export.Dim("batch", min=2, max=1024)
        torch.onnx.export(model.eval(), (x,), path, dynamo=True, dynamic_shapes=({0: batch},), verbose=False)
    else:
        torch.onnx.export(model.eval(), (x,), path, dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    return ort.InferenceSession(str(path))


EXPORTERS = [pytest.param(True, id="dynamo"), pytest.param(False, id="torchscript")]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("backend", backends_and_auto())
def test_onnx_export_of_every_backend_runs_in_onnxruntime(backend, dynamo, tmp_path):
    require_backend(backend)
    torch.manual_seed(0)
    model = blockdiag.GroupedLinear(G * I, G * O, groups=G, backend=backend)
    sess = _onnx_run(model, torch.randn(BATCHES[0], G * I), tmp_path, dynamo)
    for b in BATCHES:
        x = torch.randn(b, G * I)
        (got,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
        torch.testing.assert_close(torch.from_numpy(got).double(), _loop(model, x), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strategy", ["layers", "fm_chain", "heads"])
def test_onnx_export_of_mlp_runs_in_onnxruntime(strategy, dtype, dynamo, tmp_path):
    torch.manual_seed(0)
    model, width = blockdiag.GroupedMLP(I, [H], O, heads=G, strategy=strategy, dtype=dtype), I
    sess = _onnx_run(model, torch.randn(BATCHES[0], width, dtype=dtype), tmp_path, dynamo)
    for b in BATCHES:
        x = torch.randn(b, width, dtype=dtype)
        (got,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(got), model(x))


JIT_LOAD = textwrap.dedent(
    """
    import sys
    import torch
    if sys.argv[2] == "1":
        import blockdiag
    try:
        run = torch.jit.load(sys.argv[1])
    except RuntimeError as e:
        print("load failed:", str(e).strip().splitlines()[0])
        sys.exit(0)
    x = torch.randn(5, int(sys.argv[3]))
    print("ran", tuple(run(x).shape))
    """
)


@pytest.mark.parametrize("imported", [False, True], ids=["without-import", "with-import"])
def test_a_traced_torchscript_module_loads_only_after_import_blockdiag(imported, tmp_path):
    # The FAQ ("Deploying an exported model..."): torch.jit.load itself fails without
    # `import blockdiag` (it resolves the ops by name while loading), not the first call; the
    # page had said that calling the loaded module fails.
    model = _model("linear").eval()
    path = tmp_path / "traced.pt"
    torch.jit.trace(model, torch.randn(5, G * I)).save(str(path))
    rc, out, err = run_or_fail_on_hang([sys.executable, "-c", JIT_LOAD, str(path), str(int(imported)), str(G * I)],
                                       120, "loading a traced module")
    assert rc == 0, err[-3000:]
    if imported:
        assert out.strip() == f"ran (5, {G * O})", out
    else:
        assert out.startswith("load failed:") and "Unknown builtin op: blockdiag::auto" in out, out
        faq = " ".join((ROOT_DOCS / "faq.md").read_text().split())
        assert ('without it, `torch.jit.load` itself fails with "Unknown builtin op: blockdiag::auto"'
                in faq), "the FAQ must say that loading, not calling, fails"


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_tracing_formats_no_traced_size_per_call(kind):
    # torch.jit.trace (and the TorchScript ONNX exporter, which traces) makes the sizes traced
    # tensors: the operand checks built their messages on every call, so each size was
    # printed, a TracerWarning per element ("Converting a tensor to a Python number/boolean",
    # "Iterating over a tensor"): about 150 for one GroupedLinear. A check's message is built
    # only when it fails; the comparisons themselves still warn once each, as torch's do.
    import warnings

    model = _model(kind).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.jit.trace(model, torch.randn(5, _width(kind)))
    printed = [w for w in caught if w.filename.endswith(("_tensor_str.py", "_tensor.py"))]
    assert not printed, [f"{w.filename}:{w.lineno}: {w.message}" for w in printed[:3]]
