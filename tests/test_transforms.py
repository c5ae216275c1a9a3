"""PyTorch's transforms and tools over every backend (issue 21), against the float64 reference.

The matrix: every backend that runs on CPU here and ``auto`` x

* ``eager``, ``torch.func.vmap`` over stacked parameters (the model-ensembling recipe:
  ``stack_module_state`` + ``functional_call``), ``jacrev``, ``jacfwd`` and ``grad``, in
  float32 and float64 (``test_func_family``);
* ``torch.compile`` (inductor), ``torch.compile(fullgraph=True)`` (inductor) and
  ``torch.export.export`` with a dynamic batch ``Dim`` run at two other batch sizes, in float32
  (``test_compile_family``: the slow family, one parametrized test, tiny shapes);

each comparing the output and the gradients of input, weight and bias (or the Jacobians) with
:func:`blockdiag.testing.reference_loop` in float64, within :func:`blockdiag.testing.tolerances`.

Then: the recompile count of a compiled ``GroupedLinear`` over 13 batch sizes (at most 3
graphs, no graph break, no eager fallback; every backend with ``torch.compile``'s default
``dynamic=None``, a representative subset with ``dynamic=True``; both through
``aot_eager``, which traces the fake kernels and autograd as inductor does); compiled
``auto`` running what eager ``auto`` picks at each batch size (a tuning profile makes the pick
change with the batch); ``GroupedMLP`` layer hooks and pruning; DTensor (gloo, world size 1),
each former segfault (FakeTensorMode, DTensor weight, default device meta before the first
call) and the first call of a process made under ``torch.compile(fullgraph=True)`` or ``vmap``,
each in a fresh subprocess; ``torch.jit.trace`` and ``torch.jit.script``.

A backend unavailable here is skipped with the reason.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import blockdiag
from blockdiag import BlockDiagError, GroupedLinear, GroupedMLP, grouped_linear
from blockdiag.backends import get, names
from blockdiag.testing import reference_loop, tolerances
from blockdiag.nn.mlp import strategy as mlp_module

from _builds import seed_cache
from _params import DTYPES, backend_spy, backends_and_auto, require_backend

pytest.importorskip("blockdiag.ops", reason="blockdiag.ops (issue 21) is not there yet")

ALL = backends_and_auto()
G, I, O = 3, 4, 2  # groups, block_in, block_out
N = 5  # batch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _dt(dtype):
    return str(dtype).replace("torch.", "")


def _params(dtype, g=G, i=I, o=O):
    return torch.randn(g, o, i, dtype=dtype), torch.randn(g * o, dtype=dtype)


def _layer(name, w, b):
    g, o, i = w.shape
    layer = GroupedLinear(g * i, g * o, g, backend=name, dtype=w.dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    return layer


def _close(actual, expected, dtype, k=N, what=""):
    assert actual is not None, f"{what}: missing (None)"
    expected = expected.to(actual.dtype)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    tol = tolerances(dtype, k, magnitude=float(expected.abs().max()) if expected.numel() else 1.0)
    torch.testing.assert_close(actual.detach(), expected, **tol, msg=lambda m: f"{what}: {m}")


def _reference(x, w, b, gy):
    """Output and gradients of ``(y * gy).sum()`` for input, weight and bias, in float64."""
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y = reference_loop(x64, w64, b64)
    gx, gw, gb = torch.autograd.grad((y * gy.double()).sum(), (x64, w64, b64))
    return {"y": y.detach(), "input": gx, "weight": gw, "bias": gb}


def _run_module(module, params, x, gy):
    """``module(x)`` and the gradients of ``(y * gy).sum()`` for x and ``params`` (weight, bias)."""
    x = x.detach().requires_grad_()
    y = module(x)
    gx, gw, gb = torch.autograd.grad((y * gy).sum(), (x, *params))
    return {"y": y, "input": gx, "weight": gw, "bias": gb}


def _check(got, want, dtype, what):
    for key, expected in want.items():
        _close(got[key], expected, dtype, what=f"{what}: {key}")


# ------------------------------------------------------------- eager and torch.func family


FUNC_MODES = ["eager", "vmap", "jacrev", "jacfwd", "grad"]


def _ensemble(name, dtype, e=2):
    return [_layer(name, *_params(dtype)) for _ in range(e)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", FUNC_MODES)
@pytest.mark.parametrize("name", ALL)
def test_func_family(name, mode, dtype):
    require_backend(name)
    w, b = _params(dtype)
    x = torch.randn(N, G * I, dtype=dtype)
    gy = torch.randn(N, G * O, dtype=dtype)
    what = f"{name} {mode} {_dt(dtype)}"

    def f(x, w, b):
        return grouped_linear(x, w, b, backend=name)

    if mode == "eager":
        layer = _layer(name, w, b)
        _check(_run_module(layer, (layer.weight, layer.bias), x, gy), _reference(x, w, b, gy), dtype, what)

    elif mode == "vmap":
        models = _ensemble(name, dtype)
        params, buffers = torch.func.stack_module_state(models)
        base = copy.deepcopy(models[0]).to("meta")

        def one(p, bufs, xx):
            return torch.func.functional_call(base, (p, bufs), (xx,))

        ws, bs = params["weight"], params["bias"]
        assert ws.requires_grad and bs.requires_grad
        # the same minibatch for every model, then one minibatch each
        for x_in, in_dim in ((x, None), (torch.randn(len(models), N, G * I, dtype=dtype), 0)):
            x_in = x_in.detach().requires_grad_()
            y = torch.func.vmap(one, in_dims=(0, 0, in_dim))(params, buffers, x_in)
            gys = torch.randn(len(models), N, G * O, dtype=dtype)
            gx, gw, gb = torch.autograd.grad((y * gys).sum(), (x_in, ws, bs))
            gx_want = torch.zeros_like(x_in, dtype=torch.float64)
            for k in range(len(models)):
                xk = x_in if in_dim is None else x_in[k]
                want = _reference(xk, ws[k], bs[k], gys[k])
                where = f"{what} (model {k}, x in_dim {in_dim})"
                _close(y[k], want["y"], dtype, what=f"{where}: y")
                _close(gw[k], want["weight"], dtype, what=f"{where}: weight")
                _close(gb[k], want["bias"], dtype, what=f"{where}: bias")
                if in_dim is None:
                    gx_want += want["input"]
                else:
                    gx_want[k] = want["input"]
            _close(gx, gx_want, dtype, what=f"{what} (x in_dim {in_dim}): input")

    elif mode in ("jacrev", "jacfwd"):
        transform = getattr(torch.func, mode)
        got = transform(f, argnums=(0, 1, 2))(x, w, b)
        want = torch.autograd.functional.jacobian(reference_loop, (x.double(), w.double(), b.double()))
        for label, jg, jw in zip(("input", "weight", "bias"), got, want):
            _close(jg, jw, dtype, what=f"{what}: d y / d {label}")

    elif mode == "grad":
        def loss(x, w, b):
            return (f(x, w, b) * gy).sum()

        (gx, gw, gb), value = torch.func.grad_and_value(loss, argnums=(0, 1, 2))(x, w, b)
        want = _reference(x, w, b, gy)
        _close(value, (want["y"] * gy.double()).sum(), dtype, k=N * G * O, what=f"{what}: value")
        _check({"input": gx, "weight": gw, "bias": gb},
               {k: v for k, v in want.items() if k != "y"}, dtype, what)


# ------------------------------------------------------------ compile and export family


COMPILE_MODES = ["compile", "compile-fullgraph", "export"]


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="f32")])
@pytest.mark.parametrize("mode", COMPILE_MODES)
@pytest.mark.parametrize("name", ALL)
def test_compile_family(name, mode, dtype):
    require_backend(name)
    w, b = _params(dtype)
    layer = _layer(name, w, b)
    what = f"{name} {mode}"
    if mode == "export":
        batch = torch.export.Dim("batch", min=2, max=1024)
        x0 = torch.randn(N, G * I, dtype=dtype)
        ep = torch.export.export(layer, (x0,), dynamic_shapes={"x": {0: batch}})
        module = ep.module()
        p = dict(module.named_parameters())
        params = (p["weight"], p["bias"])
        sizes = (3, 9)  # the exported program at two other batch sizes
    else:
        module = torch.compile(layer, fullgraph=mode == "compile-fullgraph")
        params = (layer.weight, layer.bias)
        sizes = (N, 8)  # the second size is the dynamic-shape recompile
    for n in sizes:
        x = torch.randn(n, G * I, dtype=dtype)
        gy = torch.randn(n, G * O, dtype=dtype)
        _check(_run_module(module, params, x, gy), _reference(x, w, b, gy), dtype, f"{what} batch {n}")


# ------------------------------------------------------------------ recompiles over batch


BATCHES = (4, 6, 1, 2, 3, 5, 7, 8, 16, 31, 64, 100, 256)
assert len(BATCHES) == 13
# Every backend with torch.compile's default (dynamic=None: static first, then automatic
# dynamic shapes), where a fake kernel that guards on the batch shows; dynamic=True for a
# representative subset.
RECOMPILE_CASES = [pytest.param(n, None, id=f"{n}-default") for n in (*names(), "auto")] + [
    pytest.param(n, True, id=f"{n}-dynamic") for n in ("auto", "simd", "mkl_batch", "loop", "conv")
]


@pytest.mark.parametrize("name,dynamic", RECOMPILE_CASES)
def test_recompiles_across_batch_sizes(name, dynamic):
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    require_backend(name)
    w, b = _params(torch.float32)
    layer = _layer(name, w, b)
    cnt = CompileCounterWithBackend("aot_eager")
    kw = {} if dynamic is None else {"dynamic": dynamic}
    compiled = torch.compile(layer, backend=cnt, **kw)
    counters.clear()
    # a recompile limit hit (dynamo silently running eager) becomes an error
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for n in BATCHES:
            x = torch.randn(n, G * I)
            gy = torch.randn(n, G * O)
            _check(_run_module(compiled, (layer.weight, layer.bias), x, gy), _reference(x, w, b, gy),
                   torch.float32, f"{name} compiled batch {n}")
    assert cnt.frame_count <= 3, f"{cnt.frame_count} graphs for {len(BATCHES)} batch sizes"
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("name", ["auto", "bmm"])
def test_registering_dtensors_rules_after_compiling_recompiles_nothing(name, monkeypatch):
    # The layer registers DTensor's sharding rules on its first eager call once DTensor is
    # loaded (blockdiag.ops._sharding); a compiled graph must not be guarded on whether
    # that happened, or loading DTensor after compiling would recompile every layer.
    from torch._dynamo.testing import CompileCounterWithBackend

    from blockdiag.ops import _sharding

    require_backend(name)
    w, b = _params(torch.float32)
    layer = _layer(name, w, b)
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=cnt, dynamic=False)
    x = torch.randn(N, G * I)
    compiled(x)
    monkeypatch.setattr(_sharding, "_done", not _sharding._done)
    torch.testing.assert_close(compiled(x), layer(x))
    assert cnt.frame_count == 1, f"{cnt.frame_count} graphs"


# A tuning profile whose measured winner (train mode, G=3, 4x2 blocks, float32) changes along
# the batch, so that a graph fixing auto's choice at trace time would run the wrong backend.
# conv's float32 results differ in the last bits from the other winners' at this shape, and
# every other batch size is conv's: a compiled auto fixed on one backend, or running another
# than eager's pick, shows in a bit-for-bit comparison.
WINNERS = ("loop", "conv", "bmm", "conv", "mkl_batch", "conv", "bmm_fm_bmm", "conv")
CANDIDATES = ("loop", "bmm", "bmm_fm", "bmm_fm_loop", "bmm_fm_bmm", "mkl_batch", "conv")


@pytest.fixture
def batch_varying_profile():
    from _profiles import entry, point, write

    from blockdiag import profile

    winners = {}
    points = []
    for k, n in enumerate(BATCHES):
        win = WINNERS[k % len(WINNERS)]
        if get(win).unavailable_reason():
            win = "bmm"
        winners[n] = win
        times = {c: 10.0 for c in CANDIDATES if not get(c).unavailable_reason()}
        times[win] = 1.0
        points.append(point(mode="train", batch=n, groups=G, block_in=I, block_out=O, **times))
    write(profile.default_profile_path(), entry(points))
    yield winners
    profile.clear_cache()


def test_compiled_auto_runs_eager_autos_choice(batch_varying_profile):
    from torch._dynamo.testing import CompileCounterWithBackend

    w, b = _params(torch.float32)
    layer = _layer("auto", w, b)
    eager_runs = {}
    for n in BATCHES:
        x = torch.randn(n, G * I)
        plan = layer.plan(x.requires_grad_())
        assert plan.backend == batch_varying_profile[n], (n, str(plan))  # the profile is in force
        with backend_spy() as ran:
            layer(x)
        assert ran == [plan.backend], f"eager auto at batch {n} planned {plan.backend} but ran {ran}"
        eager_runs[n] = plan.backend
    assert len(set(eager_runs.values())) >= 4 and "conv" in eager_runs.values()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=cnt)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for n in BATCHES:
            x = torch.randn(n, G * I)
            gy = torch.randn(n, G * O)
            got = _run_module(compiled, (layer.weight, layer.bias), x, gy)
            forced = _layer(eager_runs[n], w, b)
            want = _run_module(forced, (forced.weight, forced.bias), x, gy)
            for key in want:
                assert torch.equal(got[key], want[key]), (
                    f"batch {n}: compiled auto's {key} differs from eager {eager_runs[n]!r} (eager auto's choice)"
                )
    assert cnt.frame_count <= 3, f"{cnt.frame_count} graphs for {len(BATCHES)} batch sizes"


def _graph_ops():
    """A torch.compile backend (AOTAutograd, no codegen) and the ops of each forward graph it got."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: list[set[str]] = []

    def forward_graph(gm, _inputs):
        seen.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return make_boxed_func(gm.forward)

    def backward_graph(gm, _inputs):
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=forward_graph, bw_compiler=backward_graph), seen


# batch_varying_profile's winners at these batch sizes: conv is written in torch ops, loop is not.
INLINED_AT, OPAQUE_AT = 6, 4


@pytest.mark.parametrize("dynamic", [pytest.param(False, id="static"), pytest.param(True, id="dynamic")])
def test_compiled_auto_inlines_a_torch_ops_choice_at_a_static_batch(batch_varying_profile, dynamic):
    assert batch_varying_profile[INLINED_AT] == "conv" and batch_varying_profile[OPAQUE_AT] == "loop"
    w, b = _params(torch.float32)
    for n in (INLINED_AT, OPAQUE_AT):
        torch._dynamo.reset()
        backend, seen = _graph_ops()
        layer = _layer("auto", w, b)
        x, gy = torch.randn(n, G * I), torch.randn(n, G * O)
        got = _run_module(torch.compile(layer, backend=backend, dynamic=dynamic), (layer.weight, layer.bias), x, gy)
        forced = _layer(batch_varying_profile[n], w, b)
        want = _run_module(forced, (forced.weight, forced.bias), x, gy)
        for key in want:
            assert torch.equal(got[key], want[key]), f"batch {n} dynamic={dynamic}: {key} differs from eager auto's"
        (ops,) = seen
        opaque = "blockdiag.auto.default" in ops
        if dynamic or n == OPAQUE_AT:
            # a graph serving every batch size plans per call; loop is not torch ops
            assert opaque and "aten.convolution.default" not in ops, sorted(ops)
        else:
            assert not opaque and "aten.convolution.default" in ops, sorted(ops)


def _fw_bw_ops():
    """A torch.compile backend (AOTAutograd, no codegen) and the ops of each forward and backward graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    fw: list[set[str]] = []
    bw: list[set[str]] = []

    def recorder(seen):
        def compiler(gm, _inputs):
            seen.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=recorder(fw), bw_compiler=recorder(bw)), fw, bw


def _saved_by_backward(partition):
    """A torch.compile backend (AOTAutograd with ``partition``, no codegen) and, per graph, the
    values its backward graph takes from the forward (not the incoming gradients)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    saved: list[list] = []

    def recording(joint, joint_inputs, **kw):
        fw, bw = partition(joint, joint_inputs, **kw)
        saved.append([n.meta["val"] for n in bw.graph.find_nodes(op="placeholder")
                      if not n.name.startswith("tangents") and isinstance(n.meta.get("val"), torch.Tensor)])
        return fw, bw

    def nop(gm, _inputs):
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=recording), saved


def _input_sized(t, n, width):
    """Whether saved value ``t`` holds an activation: its storage grows with the batch (a
    symbolic size) or holds at least ``n`` rows of ``width``. An expanded one-row stand-in holds one."""
    nbytes = t.untyped_storage().nbytes()
    return isinstance(nbytes, torch.SymInt) or nbytes >= n * width * t.element_size()


@pytest.mark.parametrize("dynamic", [pytest.param(False, id="static"), pytest.param(True, id="dynamic")])
@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
@pytest.mark.parametrize("name", ["simd", "bmm_fm", "dense", "loop", "auto"])
def test_a_compiled_frozen_layer_does_not_keep_its_input_for_backward(name, partitioner, dynamic):
    # Only the weight gradient reads the input. A frozen layer whose input needs a gradient
    # (saliency, a frozen head behind trained layers) compiled: nn.Linear's backward graph
    # takes the weight only, and so must the layer's, for aot_eager's partitioner (default)
    # and inductor's (min_cut), where the backward op still had the activation. Trained, the
    # input is kept.
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    require_backend(name)
    partition = default_partition if partitioner == "default" else min_cut_rematerialization_partition
    w, b = _params(torch.float32)
    x, gy = torch.randn(N, G * I), torch.randn(N, G * O)
    want = _reference(2 * x, w, b, gy)["input"] * 2
    for frozen in (True, False):
        torch._dynamo.reset()
        layer = _layer(name, w, b).requires_grad_(not frozen)
        backend, saved = _saved_by_backward(partition)
        compiled = torch.compile(lambda t: layer(2 * t), backend=backend, dynamic=dynamic, fullgraph=True)
        xg = x.detach().requires_grad_()
        (gx,) = torch.autograd.grad((compiled(xg) * gy).sum(), xg)
        _close(gx, want, torch.float32, what=f"{name} input gradient, frozen={frozen}")
        (values,) = saved
        kept = [tuple(t.shape) for t in values if _input_sized(t, N, G * I)]
        if frozen:
            assert not kept, f"{name}: a frozen layer's compiled backward keeps {kept}, an input-sized activation"
        else:
            assert kept, f"{name}: a trained layer's compiled backward keeps no input: {[tuple(t.shape) for t in values]}"


@pytest.mark.parametrize("name", ["loop", "auto"])
def test_a_compiled_layer_on_an_input_without_gradient_does_not_keep_its_weight(name):
    # Only the input gradient reads the weight: compiled nn.Linear on an input without
    # gradient keeps none, so the weight may change in place before the backward. The layer's
    # stand-in for it was made from the weight (new_zeros), and aot_eager's partitioner
    # recomputed it in the backward from the weight it then kept: autograd's
    # "modified by an inplace operation".
    require_backend(name)
    torch._dynamo.reset()
    w, b = _params(torch.float32)
    layer = _layer(name, w, b)
    x, gy = torch.randn(N, G * I), torch.randn(N, G * O)
    y = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    with torch.no_grad():
        layer.weight.mul_(0.5)
    (gw,) = torch.autograd.grad(y, layer.weight, gy)
    _close(gw, _reference(x, w, b, gy)["weight"], torch.float32, what=f"{name} weight gradient")


def test_a_compiled_frozen_auto_layer_on_simds_cpp_ops_does_not_keep_its_input():
    # The native route (simd's C++ ops recorded by auto at a static batch) saves what the
    # ops' autograd Function saves.
    from torch._functorch.partitioners import default_partition

    w, b, x, gy, _want = _simd_chosen()
    layer = _layer("auto", w, b).requires_grad_(False)
    backend, fw, _bw = _fw_bw_ops()
    compiled = torch.compile(layer, backend=backend, dynamic=False)
    compiled(x.detach().requires_grad_()).sum().backward()
    assert "blockdiag.simd_native.default" in fw[0], sorted(fw[0])
    torch._dynamo.reset()
    backend, saved = _saved_by_backward(default_partition)
    xg = x.detach().requires_grad_()
    (gx,) = torch.autograd.grad((torch.compile(layer, backend=backend, dynamic=False)(xg) * gy).sum(), xg)
    _close(gx, _reference(x, w, b, gy)["input"], torch.float32, what="input gradient")
    kept = [tuple(t.shape) for t in saved[0] if _input_sized(t, N, G * I)]
    assert not kept, f"the native route keeps {kept}"


def _simd_chosen():
    """A profile where auto picks simd at batch N, and eager simd's results, float32.

    Returns ``(w, b, x, gy, want)``; skips unless simd's C++ ops are armed after that eager
    call (its self-check arms them).
    """
    from blockdiag.backends import _simd_ops

    require_backend("simd")
    _write_winner("simd", N)
    w, b = _params(torch.float32)
    x, gy = torch.randn(N, G * I), torch.randn(N, G * O)
    forced = _layer("simd", w, b)
    want = _run_module(forced, (forced.weight, forced.bias), x, gy)
    if torch.float32 not in _simd_ops.armed():
        pytest.skip(f"simd's C++ ops are not ready here: {_simd_ops.note()}")
    return w, b, x, gy, want


@pytest.mark.parametrize("dynamic", [pytest.param(False, id="static"), pytest.param(True, id="dynamic")])
def test_compiled_auto_records_simds_cpp_ops_at_a_static_batch(dynamic):
    # Where auto chooses simd and its C++ ops are ready, a graph traced at a static batch calls
    # them, forward and backward, and no blockdiag Python runs per call; the results are
    # simd's, bit for bit. A graph serving every batch size keeps blockdiag::auto.
    w, b, x, gy, want = _simd_chosen()
    layer = _layer("auto", w, b)
    assert layer.plan(x.requires_grad_()).backend == "simd"
    backend, fw, bw = _fw_bw_ops()
    compiled = torch.compile(layer, backend=backend, dynamic=dynamic)
    got = _run_module(compiled, (layer.weight, layer.bias), x, gy)
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from eager simd's"
    (f,), (g,) = fw, bw
    if dynamic:
        assert "blockdiag.auto.default" in f and "blockdiag.simd_native.default" not in f, sorted(f)
    else:
        assert "blockdiag.simd_native.default" in f and "blockdiag.auto.default" not in f, sorted(f)
        assert "blockdiag.simd_native_backward.default" in g and "blockdiag.auto_backward.default" not in g, sorted(g)
    # FlopCounterMode counts the C++ ops as it counts the op: the forward and both gradients.
    from torch.utils.flop_counter import FlopCounterMode

    xg = x.detach().requires_grad_()
    with FlopCounterMode(display=False) as counter:  # backward(), not autograd.grad: its module tracker's hooks
        (compiled(xg) * gy).sum().backward()
    assert counter.get_total_flops() == 3 * 2 * N * G * I * O


def test_compiled_auto_under_forward_ad_takes_no_native_route():
    # simd's C++ ops have no forward-mode rule: a compiled graph run with a dual input is
    # retraced (the graph is guarded on the forward-AD level) without the native route, and
    # the tangent is the product applied to the input's tangent.
    import torch.autograd.forward_ad as fwad

    w, b, x, _gy, _want = _simd_chosen()
    layer = _layer("auto", w, b).requires_grad_(False)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    compiled(x)  # the native route's graph
    tangent = torch.randn_like(x)
    with fwad.dual_level():
        try:
            y = compiled(fwad.make_dual(x, tangent))
        except torch._dynamo.exc.Unsupported as e:
            # torch >= 2.14 refuses a dual input to any compiled graph (nn.Linear's too)
            # rather than drop its tangent; under fullgraph that refusal is an error.
            if "dual tensor" not in str(e):
                raise
            pytest.skip(f"torch {torch.__version__} compiles no input that carries a tangent")
        got = fwad.unpack_dual(y).tangent
    assert got is not None, "the tangent was dropped"
    want = reference_loop(tangent.double(), w.double(), None)
    _close(got, want, torch.float32, what="forward-AD tangent through the compiled layer")


def test_compiled_auto_inside_torch_cond_trains():
    # torch.cond traces its branches below autograd (ADInplaceOrView excluded), where the
    # native route's forward-AD probe (_unpack_dual) hit an internal assert of torch's and
    # the route's C++ ops would be recorded without the autograd Function that differentiates them.
    w, b, x, gy, _want = _simd_chosen()
    layer = _layer("auto", w, b)

    def run(xx):
        return torch.cond(xx.sum() > -1e9, lambda t: layer(t), lambda t: 2 * layer(t), (xx,))

    _check(_run_module(run, (layer.weight, layer.bias), x, gy), _reference(x, w, b, gy), torch.float32, "cond")
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    _check(_run_module(compiled, (layer.weight, layer.bias), x, gy), _reference(x, w, b, gy), torch.float32,
           "compiled cond")


def _simd_chosen_model(kind):
    """A training model whose every GroupedLinear plans simd at batch N (its C++ ops armed):
    GroupedLinear(backend="auto") or GroupedMLP(strategy="layers"); skips where simd's C++ ops
    are not ready."""
    from _profiles import entry, point, write

    from blockdiag import profile

    _simd_chosen()  # arms simd's C++ ops (or skips)
    times = {c: 10.0 for c in names() if c != "auto" and not get(c).unavailable_reason()}
    times["simd"] = 1.0
    write(profile.default_profile_path(), entry([point(mode="train", batch=N, groups=G, block_in=I, block_out=o, **times)
                                                 for o in (O, I)]))
    if kind == "linear":
        model = _layer("auto", *_params(torch.float32))
    else:
        model = GroupedMLP(I, [I], O, heads=G, shared_input=False, strategy="layers")
    for layer in model.modules():
        if isinstance(layer, GroupedLinear):
            p = layer.plan(layer.weight.new_empty(N, layer.in_features).requires_grad_()); assert p.backend == "simd", p
    return model


def _hop_reference(model, xs, gy, gc):
    """The loop ``_hop_loss`` unrolls, in float64 eager: {name: gradient} and the loss."""
    m64 = copy.deepcopy(model).double()
    x64 = xs.detach().double().requires_grad_()
    c = torch.zeros(N, G * O, dtype=torch.float64)
    ys = []
    for t in range(xs.shape[0]):
        y = m64(x64[t])
        c = c + y
        ys.append(y)
    loss = (torch.stack(ys) * gy.double()).sum() + (c * gc.double()).sum()
    names_, params = zip(*m64.named_parameters())
    grads = torch.autograd.grad(loss, (x64, *params))
    return loss.detach(), dict(zip(("input", *names_), grads))


@pytest.mark.parametrize("compiled", [pytest.param(False, id="eager"), pytest.param(True, id="aot_eager")])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_auto_inside_scan_trains_where_it_takes_simds_cpp_ops(kind, compiled):
    # scan traces its body, differentiates that graph, then re-traces the joint graph with grad
    # mode on to functionalize it: the re-trace called simd's C++ ops (the native route's,
    # recorded bare) on grad-requiring operands, which their Autograd kernels refused. The
    # outputs and every gradient are the unrolled loop's.
    from torch._higher_order_ops.scan import scan

    model = _simd_chosen_model(kind)
    t = 3
    xs, gy, gc = torch.randn(t, N, G * I), torch.randn(t, N, G * O), torch.randn(N, G * O)

    def body(c, x):
        y = model(x)
        return c + y, y

    def loss(a):
        c, ys = scan(body, torch.zeros(N, G * O), a)
        return (ys * gy).sum() + (c * gc).sum()

    run = torch.compile(loss, backend="aot_eager", fullgraph=True) if compiled else loss
    a = xs.clone().requires_grad_()
    got = run(a)
    names_, params = zip(*model.named_parameters())
    grads = dict(zip(("input", *names_), torch.autograd.grad(got, (a, *params))))
    want_loss, want = _hop_reference(model, xs, gy, gc)
    _close(got, want_loss, torch.float32, k=G * I * t, what="scan: loss")
    for key, expected in want.items():
        _close(grads[key], expected, torch.float32, k=G * I * t, what=f"scan: {key}")


def test_auto_inside_map_and_while_loop_where_it_takes_simds_cpp_ops():
    # The other higher-order ops that trace their body: map (trained, as scan) and
    # while_loop (forward only: it has no autograd).
    from torch._higher_order_ops.map import map as hop_map
    from torch._higher_order_ops.while_loop import while_loop

    model = _simd_chosen_model("linear")
    w, b = model.weight.detach().double(), model.bias.detach().double()
    xs, gy = torch.randn(3, N, G * I), torch.randn(3, N, G * O)
    a = xs.clone().requires_grad_()
    ys = hop_map(lambda x: model(x), a)
    gx, gw, gb = torch.autograd.grad((ys * gy).sum(), (a, model.weight, model.bias))
    for k in range(3):
        want = _reference(xs[k], w, b, gy[k])
        _check({"y": ys[k], "input": gx[k]}, {"y": want["y"], "input": want["input"]}, torch.float32, f"map {k}")
    want = [_reference(xs[k], w, b, gy[k]) for k in range(3)]
    _close(gw, sum(r["weight"] for r in want), torch.float32, k=3 * N, what="map: weight")
    _close(gb, sum(r["bias"] for r in want), torch.float32, k=3 * N, what="map: bias")

    x0 = torch.randn(N, G * I)

    def step(i, h):
        return i + 1, torch.cat([model(h)] * (I // O), 1)  # O divides I: back to the input's width

    _, got = while_loop(lambda i, h: i < 3, step, (torch.tensor(0), x0))
    h = x0.double()
    for _ in range(3):
        h = torch.cat([reference_loop(h, w, b)] * (I // O), 1)
    _close(got, h, torch.float32, k=3 * I, what="while_loop")


def test_a_graph_compiled_before_any_eager_call_records_simds_cpp_ops():
    # The usual order, a model compiled right away: in a fresh process no simd call has
    # armed the C++ ops when dynamo traces, so tracing arms them (OpEntry.prepare_ops)
    # before reading which routes are ready; the graph then calls them, as one traced after
    # an eager call does, instead of the op with its Python per call.
    from _params import run_or_fail_on_hang

    require_backend("simd")
    _write_winner("simd", N)  # the subprocess reads the same profile (BLOCKDIAG_PROFILE)
    code = textwrap.dedent(f"""
        import torch
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from blockdiag import GroupedLinear
        from blockdiag.backends import _simd_ops
        from blockdiag.testing import reference_loop
        G, I, O, N = {G}, {I}, {O}, {N}
        seen = []
        def compiler(gm, _):
            seen.append({{str(n.target) for n in gm.graph.nodes if n.op == "call_function"}})
            return make_boxed_func(gm.forward)
        layer = GroupedLinear(G * I, G * O, G)
        x = torch.randn(N, G * I)
        assert layer.plan(x).backend == "simd", layer.plan(x)
        assert not _simd_ops.armed(), "armed before the first call"
        y = torch.compile(layer, backend=aot_autograd(fw_compiler=compiler, bw_compiler=compiler), dynamic=False)(x)
        y.sum().backward()
        fw, bw = seen
        if torch.float32 in _simd_ops.armed():
            assert "blockdiag.simd_native.default" in fw and "blockdiag.auto.default" not in fw, sorted(fw)
            assert "blockdiag.simd_native_backward.default" in bw, sorted(bw)
            print("native route")
        else:
            print("not ready:", _simd_ops.note())
        w = layer.weight.detach().double()
        want = reference_loop(x.double(), w, layer.bias.detach().double())
        torch.testing.assert_close(y.detach().double(), want, rtol=1e-5, atol=1e-6)
        """)
    rc, out, err = run_or_fail_on_hang([sys.executable, "-c", code], 300, "the subprocess")
    assert rc == 0, f"exit {rc}: {err[-3000:]}"
    if "not ready:" in out:
        pytest.skip(f"simd's C++ ops are not ready here: {out.strip()}")
    assert "native route" in out, out


def test_compiled_auto_keeps_the_op_where_the_state_names_no_native_route(monkeypatch):
    # The route is taken only where the graph's plan state names it (what a graph traced
    # before the ops were ready carries): graphs with and without it differ, so torch's
    # compile caches never hand one to a process whose state is the other's.
    from blockdiag.nn import linear

    w, b, x, gy, want = _simd_chosen()
    assert "native:simd:float32" in linear._traced_plan_state().split()
    monkeypatch.setattr(linear, "traced_routes", lambda *a: "")
    layer = _layer("auto", w, b)
    backend, fw, bw = _fw_bw_ops()
    got = _run_module(torch.compile(layer, backend=backend, dynamic=False), (layer.weight, layer.bias), x, gy)
    _check(got, want, torch.float32, "compiled without a native route")
    (f,), (g,) = fw, bw
    assert "blockdiag.auto.default" in f and "blockdiag.simd_native.default" not in f, sorted(f)
    assert "blockdiag.auto_backward.default" in g, sorted(g)


def test_exported_programs_never_record_simds_cpp_ops():
    # torch.export keeps the op (its decompositions need the op's autograd), even where
    # torch.compile would take the native route; the decomposed program trains.
    from blockdiag.nn import linear

    w, b, x, gy, want = _simd_chosen()
    assert "native:simd:float32" in linear._traced_plan_state().split()  # what torch.compile would see
    layer = _layer("auto", w, b)
    decomposed = torch.export.export(layer, (x,)).run_decompositions()
    ops = {str(n.target) for n in decomposed.graph.nodes if n.op == "call_function"}
    assert "blockdiag.auto.default" in ops and "blockdiag.simd_native.default" not in ops, sorted(ops)
    module = decomposed.module()
    p = dict(module.named_parameters())
    _check(_run_module(module, (p["weight"], p["bias"]), x, gy), want, torch.float32, "exported, decomposed")


def test_exported_auto_decomposes_by_batch_and_round_trips(tmp_path):
    # An exported program keeps auto_inline (a composite custom op) until its decompositions
    # run: then a static batch plans (the chosen backend's ops, or blockdiag::auto for a C or
    # loop backend) and a dynamic one records blockdiag::auto. Each runs, saved and loaded too.
    w, b = _params(torch.float32)
    layer = _layer("auto", w, b)
    x = torch.randn(N, G * I)
    want = reference_loop(x.double(), w.double(), b.double())
    static = torch.export.export(layer, (x,))
    dynamic = torch.export.export(layer, (x,), dynamic_shapes={"x": {0: torch.export.Dim("batch", min=2, max=64)}})
    for ep in (static, dynamic):
        ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert "blockdiag.auto_inline.default" in ops, sorted(ops)
    decomposed = dynamic.run_decompositions()
    ops = {str(n.target) for n in decomposed.graph.nodes if n.op == "call_function"}
    assert "blockdiag.auto.default" in ops and "blockdiag.auto_inline.default" not in ops, sorted(ops)
    x9 = torch.randn(9, G * I)
    _close(decomposed.module()(x9), reference_loop(x9.double(), w.double(), b.double()), torch.float32, what="dynamic")
    decomposed = static.run_decompositions()
    ops = {str(n.target) for n in decomposed.graph.nodes if n.op == "call_function"}
    assert "blockdiag.auto_inline.default" not in ops, sorted(ops)
    _close(decomposed.module()(x), want, torch.float32, what="static, decomposed")
    path = tmp_path / "layer.pt2"
    torch.export.save(static, path)
    _close(torch.export.load(path).module()(x), want, torch.float32, what="static, saved and loaded")


def _write_winner(winner, batch, path=None):
    """Write a profile (default: the default one) with ``winner`` fastest at ``batch`` (the
    module's G, I, O), train; its path."""
    from _profiles import entry, point, write

    from blockdiag import profile

    times = {c: 10.0 for c in CANDIDATES if not get(c).unavailable_reason()}
    times[winner] = 1.0
    return write(path or profile.default_profile_path(),
                 entry([point(mode="train", batch=batch, groups=G, block_in=I, block_out=O, **times)]))


def _compiled_auto():
    """An auto layer compiled without codegen, run once at INLINED_AT: (layer, compiled, graphs seen, x, gy)."""
    w, b = _params(torch.float32)
    layer = _layer("auto", w, b)
    backend, seen = _graph_ops()
    compiled = torch.compile(layer, backend=backend, dynamic=False)
    x, gy = torch.randn(INLINED_AT, G * I), torch.randn(INLINED_AT, G * O)
    _run_module(compiled, (layer.weight, layer.bias), x, gy)
    return layer, compiled, seen, x, gy


@pytest.mark.parametrize("name", ["auto", "bmm", "simd"])
def test_export_of_a_3d_input_with_a_dynamic_batch(name):
    # The rows of a 3-D input were counted with torch.Size.numel(), which made the symbolic
    # batch a constant: the export failed ("your code specialized it to be a constant").
    require_backend(name)
    layer = GroupedLinear(G * I, G * O, G, backend=name)
    ep = torch.export.export(layer, (torch.randn(5, 3, G * I),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    x = torch.randn(7, 3, G * I)
    torch.testing.assert_close(ep.module()(x), layer(x))


@pytest.mark.parametrize("name", ["simd", "bmm", "loop"])
def test_exported_backend_op_decomposes_saves_and_loads(name, tmp_path):
    # An exported layer records the backend's op, and so do its decompositions (the
    # ATen-level program a runtime takes): the op itself, whose autograd a training step
    # through the decomposed program needs. It saves, loads and runs at another batch size.
    require_backend(name)
    w, b = _params(torch.float32)
    layer = _layer(name, w, b)
    x0 = torch.randn(N, G * I)
    ep = torch.export.export(layer, (x0,), dynamic_shapes={"x": {0: torch.export.Dim("batch", min=2, max=64)}})
    decomposed = ep.run_decompositions()
    ops = {str(n.target) for n in decomposed.graph.nodes if n.op == "call_function"}
    assert f"blockdiag.{name}.default" in ops, sorted(ops)
    path = tmp_path / "layer.pt2"
    torch.export.save(decomposed, path)
    module = torch.export.load(path).module()
    p = dict(module.named_parameters())
    x, gy = torch.randn(7, G * I), torch.randn(7, G * O)
    _check(_run_module(module, (p["weight"], p["bias"]), x, gy), _reference(x, w, b, gy), torch.float32,
           f"{name} exported, decomposed, saved and loaded")


def test_static_graph_follows_a_settings_change(batch_varying_profile):
    layer, compiled, seen, x, gy = _compiled_auto()
    assert "aten.convolution.default" in seen[-1], sorted(seen[-1])
    # The same shape's winner becomes bmm: the profile is rewritten (clear_cache moves the
    # generation the graph is guarded on), and the compiled layer must follow eager auto.
    _write_winner("bmm", INLINED_AT)
    assert layer.plan(x.requires_grad_()).backend == "bmm"
    _run_module(compiled, (layer.weight, layer.bias), x, gy)
    assert len(seen) == 2, f"{len(seen)} forward graphs: the settings change did not recompile"
    assert {"aten.bmm.default", "aten.baddbmm.default"} & seen[-1], sorted(seen[-1])
    assert "aten.convolution.default" not in seen[-1], sorted(seen[-1])


def test_static_graph_follows_a_config_block(batch_varying_profile, tmp_path):
    # A config block changes eager auto's choice without moving the generation (re-entering
    # one per step must not re-plan): the graph is guarded on the thread's config stack too,
    # so it recompiles inside the block and runs the first graph again outside it.
    # Written first: writing a profile moves the generation, which alone recompiles.
    other = _write_winner("bmm", INLINED_AT, tmp_path / "bmm.json")
    layer, compiled, seen, x, gy = _compiled_auto()
    assert "aten.convolution.default" in seen[-1], sorted(seen[-1])
    with blockdiag.config(profile=other):
        assert layer.plan(x.requires_grad_()).backend == "bmm"
        _run_module(compiled, (layer.weight, layer.bias), x, gy)
    assert len(seen) == 2, f"{len(seen)} forward graphs: the config block did not recompile"
    assert {"aten.bmm.default", "aten.baddbmm.default"} & seen[-1], sorted(seen[-1])
    _run_module(compiled, (layer.weight, layer.bias), x, gy)
    assert len(seen) == 2  # outside the block: the first graph, cached


def test_a_config_block_inside_a_compiled_function_is_followed(batch_varying_profile, tmp_path):
    # Dynamo traced the block's thread-local frame only symbolically, while the layer planned,
    # and read its plan state, from the real settings: the compiled function silently ran the
    # plan of the settings outside the block (conv), not the block's (bmm), as eager does.
    other = _write_winner("bmm", INLINED_AT, tmp_path / "bmm.json")
    w, b = _params(torch.float32)
    layer = _layer("auto", w, b)
    x, gy = torch.randn(INLINED_AT, G * I), torch.randn(INLINED_AT, G * O)
    with blockdiag.config(profile=other):
        assert layer.plan(x.requires_grad_()).backend == "bmm"

    def step(xx):
        with blockdiag.config(profile=other):
            return layer(xx)

    compiled = torch.compile(step, backend=_graph_ops()[0])
    got = _run_module(compiled, (layer.weight, layer.bias), x, gy)  # traces
    _check(got, _reference(x, w, b, gy), torch.float32, "config block inside the compiled function")
    ran = _aten_ops_run(lambda: _run_module(compiled, (layer.weight, layer.bias), x, gy))
    assert "aten::convolution" not in ran and {"aten::bmm", "aten::baddbmm"} & ran, sorted(ran)


def test_a_config_block_under_fullgraph_says_what_to_do():
    # The block's graph break named no reason ("User-inserted graph break. Message: None").
    layer = blockdiag.GroupedLinear(G * I, G * O, groups=G, backend="bmm")

    def step(xx):
        with blockdiag.config(sparsity_threshold=0.5):
            return layer(xx)

    with pytest.raises(Exception, match=r"blockdiag\.config\(\.\.\.\) runs eagerly.*set_config") as info:
        torch.compile(step, backend="eager", fullgraph=True)(torch.randn(2, G * I))
    assert isinstance(info.value, torch._dynamo.exc.Unsupported), type(info.value)


def _aten_ops_run(fn) -> set[str]:
    from torch.profiler import profile as torch_profile

    with torch_profile() as prof:
        fn()
    return {e.key for e in prof.key_averages() if e.key.startswith("aten::")}


def test_inductor_caches_do_not_bring_back_an_old_plan(batch_varying_profile):
    # torch keeps compiled graphs in caches keyed by the graph dynamo gives it (AOTAutograd's
    # and inductor's, on disk too). The recompile after a settings change gives the same graph
    # but for the plan state it carries; without it the cache hands back the old plan's kernels.
    from blockdiag.dispatch import plan_state

    w, b = _params(torch.float32)
    layer = _layer("auto", w, b)
    x, gy = torch.randn(INLINED_AT, G * I), torch.randn(INLINED_AT, G * O)
    before = plan_state()
    with torch._functorch.config.patch(enable_autograd_cache=True), torch._inductor.config.patch(fx_graph_cache=True):
        compiled = torch.compile(layer, dynamic=False)
        ran = _aten_ops_run(lambda: _run_module(compiled, (layer.weight, layer.bias), x, gy))
        assert "aten::convolution" in ran, sorted(ran)
        _write_winner("bmm", INLINED_AT)
        assert layer.plan(x.requires_grad_()).backend == "bmm" and plan_state() != before
        got = {}
        ran = _aten_ops_run(lambda: got.update(_run_module(compiled, (layer.weight, layer.bias), x, gy)))
    assert "aten::convolution" not in ran and "aten::convolution_backward" not in ran, sorted(ran)
    assert {"aten::bmm", "aten::baddbmm"} & ran, sorted(ran)
    ref = _layer("bmm", w, b)
    _check(got, _run_module(ref, (ref.weight, ref.bias), x, gy), torch.float32, "after the profile change")


_OTHER_PROCESS = """
import json, sys
import torch
import blockdiag
from blockdiag import profile
from blockdiag.backends import get
from torch.profiler import profile as torch_profile
sys.path.insert(0, TESTS)
from _profiles import entry, point, write

G, I, O, N = 3, 4, 2, 6
times = {c: 10.0 for c in CANDIDATES if not get(c).unavailable_reason()}
times[WINNER] = 1.0
write(profile.default_profile_path(), entry([point(mode="train", batch=N, groups=G, block_in=I, block_out=O, **times)]))
torch.manual_seed(0)
layer = blockdiag.GroupedLinear(G * I, G * O, G)
x = torch.randn(N, G * I, requires_grad=True)
compiled = torch.compile(layer, dynamic=False)
compiled(x).sum().backward()
with torch_profile() as prof:
    compiled(x).sum().backward()
ops = sorted({e.key for e in prof.key_averages() if e.key.startswith("aten::")})
print("RESULT " + json.dumps({"plan": layer.plan(x).backend, "ops": ops}), flush=True)
"""


def test_another_process_with_another_profile_is_not_served_the_old_plan(tmp_path):
    # One on-disk compile cache, two processes whose profiles pick different backends at the
    # same shape (what a second training run after `blockdiag tune` is): the second must not
    # be handed the first one's compiled graph.
    cache = tmp_path / "inductor-cache"
    seen = {}
    for winner in ("conv", "bmm"):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
               "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "BLOCKDIAG_PROFILE": str(tmp_path / f"{winner}.json")}
        code = _OTHER_PROCESS.replace("TESTS", repr(os.path.dirname(__file__))).replace(
            "CANDIDATES", repr(CANDIDATES)).replace("WINNER", repr(winner))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        seen[winner] = json.loads(line[len("RESULT "):])
        assert seen[winner]["plan"] == winner, seen
    assert "aten::convolution" in seen["conv"]["ops"], seen["conv"]
    assert "aten::convolution" not in seen["bmm"]["ops"], seen["bmm"]
    assert {"aten::bmm", "aten::baddbmm"} & set(seen["bmm"]["ops"]), seen["bmm"]


_NATIVE_PROCESS = """
import json, sys
import torch
import blockdiag
from blockdiag import profile
from blockdiag.backends import get
from blockdiag.ops.auto import native_routes
from torch.profiler import profile as torch_profile
sys.path.insert(0, TESTS)
from _profiles import entry, point, write

G, I, O, N = 3, 4, 2, 6
times = {c: 10.0 for c in CANDIDATES if not get(c).unavailable_reason()}
times["simd"] = 1.0
write(profile.default_profile_path(), entry([point(mode="train", batch=N, groups=G, block_in=I, block_out=O, **times)]))
torch.manual_seed(0)
layer = blockdiag.GroupedLinear(G * I, G * O, G)
x = torch.randn(N, G * I, requires_grad=True)
layer(x).sum().backward()  # eager first: simd's self-check arms its C++ ops where they built
compiled = torch.compile(layer, dynamic=False)
compiled(x).sum().backward()
with torch_profile() as prof:
    y = compiled(x)
    y.sum().backward()
ops = sorted({e.key for e in prof.key_averages() if e.key.startswith("blockdiag::")})
print("RESULT " + json.dumps({"plan": layer.plan(x).backend, "routes": native_routes(), "ops": ops,
                              "y": y.tolist(), "gx": x.grad.tolist()}), flush=True)
"""


def test_a_process_without_simds_cpp_ops_is_not_served_a_graph_calling_them(tmp_path):
    # One on-disk compile cache, two processes at the same shape, both choosing simd: the first
    # has its C++ ops and its graph calls them; the second cannot build them ($CXX fails, a fresh
    # kernel cache) and must not be handed that graph, whose ops it never registered.
    require_backend("simd")
    if shutil.which(os.environ.get("CXX") or "c++") is None:
        pytest.skip("no C++ compiler: simd's C++ ops are never built here")
    cache = tmp_path / "inductor-cache"
    seen = {}
    seed_cache(tmp_path / "fresh")  # simd's C kernels, not its C++ ops
    for name, extra in (("with", {}), ("without", {"XDG_CACHE_HOME": str(tmp_path / "fresh"),
                                                    "CXX": shutil.which("false") or "/nonexistent"})):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
               "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "BLOCKDIAG_PROFILE": str(tmp_path / "simd.json"), **extra}
        code = _NATIVE_PROCESS.replace("TESTS", repr(os.path.dirname(__file__))).replace("CANDIDATES", repr(CANDIDATES))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, f"{name}: stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        seen[name] = json.loads(line[len("RESULT "):])
        assert seen[name]["plan"] == "simd", seen[name]
    if "native:simd:float32" not in seen["with"]["routes"].split():
        pytest.skip(f"simd's C++ ops did not arm in the first process: {seen['with']}")
    assert "blockdiag::simd_native" in seen["with"]["ops"], seen["with"]["ops"]
    assert seen["without"]["routes"] == "", seen["without"]
    assert "blockdiag::simd_native" not in seen["without"]["ops"], seen["without"]["ops"]
    assert "blockdiag::auto" in seen["without"]["ops"], seen["without"]["ops"]
    for key in ("y", "gx"):
        assert seen["with"][key] == seen["without"][key], key  # the same kernels, bit for bit


def test_plan_state_is_marked_as_assume_constant_result_marks():
    # nn/linear.py marks its reader by hand (the decorator would import torch._dynamo).
    from blockdiag.nn.linear import _traced_plan_state

    def probe():
        return ""

    marked = torch.compiler.assume_constant_result(probe)
    assert marked is probe and set(vars(probe)) == {"_dynamo_marked_constant"}, vars(probe)
    assert vars(_traced_plan_state) == vars(probe)


def test_plan_state_moves_with_what_plans_read(monkeypatch):
    from blockdiag.dispatch import plan_state

    base = plan_state()
    assert plan_state() == base
    with blockdiag.config(dense_max_groups=blockdiag.get_settings().dense_max_groups + 1):
        assert plan_state() != base
    assert plan_state() == base
    with monkeypatch.context() as env:
        env.setenv("BLOCKDIAG_PROFILE", "/nonexistent/elsewhere.json")
        assert plan_state() != base
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert plan_state() != base
    finally:
        torch.set_num_threads(threads)
    assert plan_state() == base

    def einsum(x, weight, bias):
        g, o, i = weight.shape
        y = torch.einsum("ngi,goi->ngo", x.view(-1, g, i), weight).reshape(-1, g * o)
        return y if bias is None else y + bias

    blockdiag.register_backend(blockdiag.Backend("test_plan_state", einsum, dtypes={"cpu": frozenset({torch.float32})}))
    try:
        assert plan_state() != base
    finally:
        blockdiag.unregister_backend("test_plan_state")
    assert plan_state() == base
    with monkeypatch.context() as m:
        m.setattr(blockdiag.dispatch, "code_digest", lambda: "another checkout")
        assert plan_state() != base


def test_code_digest_moves_with_the_source(tmp_path):
    from blockdiag.dispatch import code_digest

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "kernel.c").write_text("int f(void) { return 1; }\n")
    (tmp_path / "notes.txt").write_text("not code")
    before = code_digest(str(tmp_path))
    (tmp_path / "sub" / "kernel.c").write_text("int f(void) { return 3; }\n")
    assert code_digest(str(tmp_path)) == before  # read once per process: a later edit is not seen
    other = tmp_path / "other"
    other.mkdir()
    (other / "sub").mkdir()
    (other / "sub" / "kernel.c").write_text("int f(void) { return 2; }\n")
    (other / "notes.txt").write_text("not code either")
    assert code_digest(str(other)) != before
    same = tmp_path / "same"
    (same / "sub").mkdir(parents=True)
    (same / "sub" / "kernel.c").write_text("int f(void) { return 1; }\n")
    assert code_digest(str(same)) == before  # by content and relative path, not by place or mtime
    # The C++ ops' source too (_simd_ops.cpp): it was not hashed.
    cpp = tmp_path / "cpp"
    cpp.mkdir()
    (cpp / "ops.cpp").write_text("int g() { return 1; }\n")
    first = code_digest(str(cpp))
    cpp2 = tmp_path / "cpp2"
    cpp2.mkdir()
    (cpp2 / "ops.cpp").write_text("int g() { return 2; }\n")
    assert code_digest(str(cpp2)) != first


# ----------------------------------------------------------------------- GroupedMLP hooks


MLP_BACKENDS = [pytest.param("auto", id="auto"), pytest.param("bmm", id="bmm")]


def _mlp(backend):
    return GroupedMLP(6, [4, 4], 2, heads=3, backend=backend, dtype=torch.float64)


def _heads_output(model, x):
    return torch.cat([h(x) for h in model.to_heads()], -1)


@pytest.mark.parametrize("backend", MLP_BACKENDS)
def test_mlp_layer_hooks_fire(backend):
    model = _mlp(backend)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    fired = []
    for k, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda m, args, k=k: fired.append(("pre", k)))
        layer.register_forward_hook(lambda m, args, out, k=k: fired.append(("forward", k)))
        layer.register_full_backward_hook(lambda m, gin, gout, k=k: fired.append(("backward", k)))
    y = model(x)
    torch.testing.assert_close(y, _heads_output(model, x))
    y.sum().backward()
    layers = range(len(model.layers))
    assert sorted(e for e in fired if e[0] == "pre") == [("pre", k) for k in layers], fired
    assert sorted(e for e in fired if e[0] == "forward") == [("forward", k) for k in layers], fired
    assert sorted(e for e in fired if e[0] == "backward") == [("backward", k) for k in layers], fired
    # a hook's returned output is what the model continues with
    h = model.layers[-1].register_forward_hook(lambda m, args, out: out + 1.0)
    torch.testing.assert_close(model(x), _heads_output(model, x) + 1.0)
    h.remove()


@pytest.mark.parametrize("backend", MLP_BACKENDS)
def test_mlp_pruned_layer_trains(backend):
    import torch.nn.utils.prune as prune

    model = _mlp(backend)
    prune.l1_unstructured(model.layers[1], "weight", 0.5)
    mask = model.layers[1].weight_mask.clone()
    assert 0 < int(mask.sum()) < mask.numel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 6, dtype=torch.float64)
    for _ in range(2):  # two steps: the second forward must see the first step's update
        opt.zero_grad()
        y = model(x)
        torch.testing.assert_close(y, _heads_output(model, x))
        y.square().mean().backward()
        g = model.layers[1].weight_orig.grad
        assert g is not None and bool(g.abs().sum() > 0)
        assert bool((g[mask == 0] == 0).all()), "pruned entries received gradient"
        opt.step()
    assert bool((model.layers[1].weight[mask == 0] == 0).all())


# ------------------------------------------------------------------- compiled GroupedMLP


def _mlp_grads(model, x, gy):
    x = x.detach().requires_grad_()
    y = model(x)
    params = [p for _, p in sorted(model.named_parameters())]
    return y, torch.autograd.grad((y * gy).sum(), [x, *params])


@pytest.fixture
def chain_spy(monkeypatch):
    """A list that gets an entry each time GroupedMLP runs the chain (dynamo replays it too)."""
    ran = []
    chain = GroupedMLP._forward_feature_major

    def spy(self, x):
        ran.append(1)
        return chain(self, x)

    monkeypatch.setattr(GroupedMLP, "_forward_feature_major", spy)
    return ran


def _compiled_chain_runs(model, batches, chain_spy, no_grad_batch=None):
    """Compile ``model`` (fullgraph), run a training step per batch size and check each against
    the eager chain; returns ``(graphs compiled, forward graphs' op sets, compiled outputs)``.

    Fails on a graph break, on hitting the recompile limit, and where the compiled model ran
    the layers. With ``no_grad_batch``, one more call without autograd (its graph is last).
    """
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    n_in = model.in_features * (1 if model.shared_input else model.heads)
    n_out = model.out_features * model.heads
    dt = model.layers[0].weight.dtype
    chain = copy.deepcopy(model)
    chain.strategy = "fm_chain"
    backend, seen = _graph_ops()
    cnt = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    counters.clear()
    outputs = []
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for n in batches:
            x, gy = torch.randn(n, n_in, dtype=dt), torch.randn(n, n_out, dtype=dt)
            chain_spy.clear()
            y, grads = _mlp_grads(compiled, x, gy)
            assert chain_spy, f"batch {n}: the compiled model ran the layers"
            y_want, grads_want = _mlp_grads(chain, x, gy)
            torch.testing.assert_close(y, y_want, msg=lambda m: f"batch {n}: output: {m}")
            for g, w in zip(grads, grads_want):
                torch.testing.assert_close(g, w, msg=lambda m: f"batch {n}: gradient: {m}")
            outputs.append(y)
        if no_grad_batch is not None:
            with torch.no_grad():
                outputs.append(compiled(torch.randn(no_grad_batch, n_in, dtype=dt)))
    assert not counters["graph_break"], dict(counters["graph_break"])
    return cnt.frame_count, seen, outputs


def test_compiled_mlp_runs_the_chain_on_cpu_for_every_batch(chain_spy, table_prefers_chain):
    # On the CPU eager auto runs the chain wherever it is allowed; a compiled model does too,
    # in one graph per shape class (no blockdiag op in it at these narrow heads: the chain is
    # bmm/addmm), with the eager chain's results.
    graphs, seen, _ = _compiled_chain_runs(_mlp("auto"), BATCHES, chain_spy)
    assert graphs <= 3, f"{graphs} graphs for {len(BATCHES)} batch sizes"
    for ops in seen:
        assert not any(op.startswith("blockdiag.") for op in ops), sorted(ops)
        assert "aten.baddbmm.default" in ops, sorted(ops)


@pytest.mark.parametrize("shared", [pytest.param(True, id="shared-input"), pytest.param(False, id="own-inputs")])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="f32"), pytest.param(torch.float64, id="f64")])
def test_compiled_mlp_training_writes_rows(dtype, shared, chain_spy, table_prefers_chain):
    # Where a head's output row is 64 bytes or more, a traced training chain ends in
    # blockdiag::fm_rows: a row-major output, so the backward takes the caller's gradient as
    # it is. One graph per shape class still, the eager chain's results, no graph break;
    # without autograd, or with rows too short for the strided write, the chain keeps its
    # transposed view.
    from blockdiag.ops._define import rows_pay

    wide = 64 // dtype.itemsize
    assert rows_pay(wide, dtype) and not rows_pay(wide // 2, dtype)
    for out, rows in ((wide, True), (wide // 2, False)):
        model = GroupedMLP(6, [4], out, heads=3, shared_input=shared, dtype=dtype)
        graphs, seen, outputs = _compiled_chain_runs(model, (4, 6, 31), chain_spy, no_grad_batch=5)
        *trained, no_grad = outputs
        assert all(y.is_contiguous() == rows for y in trained), [y.stride() for y in trained]
        assert not no_grad.is_contiguous(), no_grad.stride()
        assert graphs <= 3, f"{graphs} graphs"
        *train_graphs, no_grad_graph = seen
        assert train_graphs and all(("blockdiag.fm_rows.default" in ops) == rows for ops in train_graphs), \
            [sorted(ops) for ops in train_graphs]
        assert "blockdiag.fm_rows.default" not in no_grad_graph, sorted(no_grad_graph)


# The grouped layers' forward FLOPs of _mlp at 5 rows: 2*5*3*(4*4 + 4*2) (the shared first
# layer, groups=1, is not counted).
_MLP_GROUPED_FLOPS_AT_5 = 720


@pytest.mark.parametrize("floor", [pytest.param(_MLP_GROUPED_FLOPS_AT_5, id="at-floor"),
                                   pytest.param(_MLP_GROUPED_FLOPS_AT_5 + 1, id="below-floor")])
@pytest.mark.parametrize("table_says", [pytest.param(True, id="chain"), pytest.param(False, id="layers")])
def test_compiled_mlp_at_a_static_batch_decides_as_eager_does(table_says, floor, chain_spy, monkeypatch):
    # A graph traced at a concrete batch follows eager auto's decision at that batch (the
    # table's) where the grouped products reach TRACED_LAYERS_MIN_FLOPS, and the CPU's device
    # rule (the chain) below it; a graph serving every batch size cannot read the table and
    # runs the device rule. All compute the heads' result.
    asked = []

    def choice(self, x):
        asked.append((x.shape[0], x.requires_grad))
        return table_says, "test: the table's answer", 1.0, 2.0, self._layer_plans(x)

    monkeypatch.setattr(GroupedMLP, "_measured_choice", choice)
    monkeypatch.setattr(mlp_module, "TRACED_LAYERS_MIN_FLOPS", floor)
    monkeypatch.setattr(mlp_module, "traced_routes", lambda *a: "")  # the floor alone decides (see below)
    model = _mlp("auto")
    torch._dynamo.reset()
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    chain_spy.clear()
    y = torch.compile(model, fullgraph=True, dynamic=False)(x)
    follows = floor <= _MLP_GROUPED_FLOPS_AT_5
    assert bool(chain_spy) == (table_says or not follows) and asked == [(5, True)], (chain_spy, asked)
    torch.testing.assert_close(y, _heads_output(model, x))
    torch._dynamo.reset()
    chain_spy.clear()
    x = torch.randn(7, 6, dtype=torch.float64)
    y = torch.compile(model, fullgraph=True, dynamic=True)(x)
    assert chain_spy and asked == [(5, True)], (chain_spy, asked)
    torch.testing.assert_close(y, _heads_output(model, x))


@pytest.mark.parametrize("native", [pytest.param(True, id="every-grouped-layer-native"),
                                    pytest.param(False, id="no-native-route")])
def test_compiled_mlp_below_the_floor_follows_eager_where_its_layers_take_native_routes(native, chain_spy, monkeypatch):
    # Below TRACED_LAYERS_MIN_FLOPS a graph at a concrete batch keeps the device rule (the
    # chain), unless every grouped layer would record its backend's C++ ops: then no layer
    # costs the graph Python per call, and it follows eager (here: the layers).
    from blockdiag.ops.auto import route_token

    monkeypatch.setattr(GroupedMLP, "_measured_choice",
                        lambda self, x: (False, "test: the layers", 2.0, 1.0, self._layer_plans(x)))
    monkeypatch.setattr(mlp_module, "TRACED_LAYERS_MIN_FLOPS", _MLP_GROUPED_FLOPS_AT_5 + 1)
    model = _mlp("auto")
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    routes = " ".join(route_token(p.backend, p.problem.dtype) for p in model._layer_plans(x) if p.problem.groups > 1)
    monkeypatch.setattr(mlp_module, "traced_routes", lambda *a: routes if native else "")
    torch._dynamo.reset()
    chain_spy.clear()
    y = torch.compile(model, fullgraph=True, dynamic=False)(x)
    assert bool(chain_spy) != native, chain_spy
    torch.testing.assert_close(y, _heads_output(model, x))


@pytest.mark.parametrize("rule, runs_heads", [
    pytest.param(((8, None),), True, id="smallest-block-at-the-area"),
    pytest.param(((9, None),), False, id="smallest-block-below-the-area"),
    pytest.param(((8, 3),), True, id="at-the-most-heads"),
    pytest.param(((8, 2),), False, id="more-heads-than-the-rule"),
    pytest.param(((99, None), (8, 3)), True, id="second-pair"),
])
@pytest.mark.parametrize("how", ["static", "dynamic", "export"])
def test_traced_auto_runs_the_heads_where_the_rule_says(rule, runs_heads, how, chain_spy, monkeypatch):
    # _mlp's grouped blocks are 4x4 and 4x2 (the smallest: 8 elements), 3 heads. The rule
    # reads shapes only, so graphs at a concrete batch, at a symbolic one and exported
    # programs follow it alike; every one computes the heads' outputs and gradients.
    ran = []
    inner = GroupedMLP._forward_heads
    monkeypatch.setattr(GroupedMLP, "_forward_heads", lambda self, x: ran.append(1) or inner(self, x))
    monkeypatch.setattr(mlp_module, "TRACED_HEADS_RULE", rule)
    model = _mlp("auto")
    torch._dynamo.reset()
    x, gy = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    if how == "export":
        ep = torch.export.export(model, (x,), dynamic_shapes={"x": {0: torch.export.Dim("batch", min=2, max=64)}})
        assert bool(ran) == runs_heads and bool(chain_spy) != runs_heads, (ran, chain_spy)
        x9 = torch.randn(9, 6, dtype=torch.float64)
        torch.testing.assert_close(ep.module()(x9), _heads_output(model, x9))
        return
    compiled = torch.compile(model, fullgraph=True, dynamic=how == "dynamic")
    y, grads = _mlp_grads(compiled, x, gy)
    assert bool(ran) == runs_heads, (ran, chain_spy)
    _, ref = _mlp_grads(model, x, gy)
    torch.testing.assert_close(y, _heads_output(model, x))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("limit, how, runs_heads", [
    pytest.param((5 * 12 * 8, 8, 5), "static", True, id="static-at-the-bounds"),
    pytest.param((5 * 12 * 8 + 1, 8, 5), "static", False, id="static-smaller-hidden"),
    pytest.param((5 * 12 * 8, 9, 5), "static", False, id="static-smaller-block"),
    pytest.param((5 * 12 * 8, 8, 6), "static", False, id="static-fewer-rows"),
    pytest.param((8, 8, 1), "dynamic", False, id="symbolic-batch"),
])
def test_traced_auto_runs_the_heads_where_the_hidden_layer_is_large(limit, how, runs_heads, monkeypatch):
    # HEADS_MIN_HIDDEN_BYTES reads the batch: only a graph at a concrete one follows it.
    # _mlp's widest hidden layer is 3 heads x 4 units, float64; 5 rows: 480 bytes.
    ran = []
    inner = GroupedMLP._forward_heads
    monkeypatch.setattr(GroupedMLP, "_forward_heads", lambda self, x: ran.append(1) or inner(self, x))
    monkeypatch.setattr(mlp_module, "TRACED_HEADS_RULE", ())
    monkeypatch.setattr(mlp_module, "HEADS_MIN_HIDDEN_BYTES", limit)
    model = _mlp("auto")
    torch._dynamo.reset()
    x, gy = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    compiled = torch.compile(model, fullgraph=True, dynamic=how == "dynamic")
    y, grads = _mlp_grads(compiled, x, gy)
    assert bool(ran) == runs_heads, ran
    _, ref = _mlp_grads(model, x, gy)
    torch.testing.assert_close(y, _heads_output(model, x))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("blocker", ["named-backend", "layer-hook", "activation-hook", "other-device"])
def test_traced_auto_keeps_off_the_heads_where_they_are_not_allowed(blocker, monkeypatch):
    ran = []
    inner = GroupedMLP._forward_heads
    monkeypatch.setattr(GroupedMLP, "_forward_heads", lambda self, x: ran.append(1) or inner(self, x))
    monkeypatch.setattr(mlp_module, "TRACED_HEADS_RULE", ((1, None),))
    model = _mlp("auto")
    if blocker == "named-backend":
        model.layers[1].backend = "bmm"
    elif blocker == "layer-hook":
        model.layers[2].register_forward_hook(lambda *a: None)
    elif blocker == "activation-hook":
        model.activations[0].register_forward_hook(lambda *a: None)
    else:
        monkeypatch.setattr(mlp_module, "HEADS_DEVICES", frozenset({"cuda"}))
    torch._dynamo.reset()
    x = torch.randn(5, 6, dtype=torch.float64)
    y = torch.compile(model, dynamic=False)(x)
    assert not ran
    torch.testing.assert_close(y, _heads_output(model, x))


@pytest.mark.parametrize("lo", [2, 16])
@pytest.mark.parametrize("strategy", ["auto", "fm_chain"])
def test_exported_mlp_runs_the_chain_on_cpu(strategy, lo, chain_spy):
    # torch.export traces with FakeTensor parameters: they count as plain, so the exported
    # program is the chain (torch ops only), with a dynamic batch (whatever its range: the
    # batch is told from a number by comparisons, nn/mlp/strategy.py's _concrete).
    model = _mlp("auto")
    model.strategy = strategy
    x = torch.randn(lo + 3, 6, dtype=torch.float64)
    ep = torch.export.export(model, (x,), dynamic_shapes={"x": {0: torch.export.Dim("batch", min=lo, max=64)}})
    assert chain_spy, "the export traced the layers"
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any(op.startswith("blockdiag.") for op in ops) and "aten.baddbmm.default" in ops, sorted(ops)
    for n in (lo + 1, lo + 17):
        x = torch.randn(n, 6, dtype=torch.float64)
        torch.testing.assert_close(ep.module()(x), _heads_output(model, x))


@pytest.mark.parametrize("how", ["compile-fullgraph", "export-dynamic", "forward-ad", "jacrev", "vmap-ensemble"])
def test_the_heads_strategy_under_every_transform(how):
    # strategy="heads" is F.linear, activations and cat: every transform takes it as it takes
    # the loop of nn.Sequential heads, and gives the heads' outputs and gradients.
    torch.manual_seed(0)
    model = _mlp("auto")
    model.strategy = "heads"
    x = torch.randn(5, 6, dtype=torch.float64)
    params = dict(model.named_parameters())
    if how == "compile-fullgraph":
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, dynamic=True)
        for n in (5, 9):
            xn, gyn = torch.randn(n, 6, dtype=torch.float64), torch.randn(n, 6, dtype=torch.float64)
            y, grads = _mlp_grads(compiled, xn, gyn)
            yr, ref = _mlp_grads(model, xn, gyn)
            torch.testing.assert_close(y, _heads_output(model, xn))
            for a, b in zip(grads, ref):
                torch.testing.assert_close(a, b)
    elif how == "export-dynamic":
        ep = torch.export.export(model, (x,), dynamic_shapes={"x": {0: torch.export.Dim("batch", min=2, max=64)}})
        for n in (3, 17):
            xn = torch.randn(n, 6, dtype=torch.float64)
            torch.testing.assert_close(ep.module()(xn), _heads_output(model, xn))
    elif how == "forward-ad":
        t = torch.randn_like(x)
        _, jvp = torch.func.jvp(model, (x,), (t,))
        _, jvp_ref = torch.func.jvp(lambda v: _heads_output(model, v), (x,), (t,))
        torch.testing.assert_close(jvp, jvp_ref)
    elif how == "jacrev":
        jac = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x,)))(params)
        model.strategy = "layers"
        ref = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x,)))(params)
        for k in params:
            torch.testing.assert_close(jac[k], ref[k])
    else:  # the model-ensembling recipe: vmap over stacked parameters
        other = _mlp("auto")
        other.strategy = "heads"
        stacked = {k: torch.stack([v, dict(other.named_parameters())[k]]) for k, v in params.items()}
        ys = torch.func.vmap(lambda p: torch.func.functional_call(model, p, (x,)))(stacked)
        torch.testing.assert_close(ys[0], _heads_output(model, x))
        torch.testing.assert_close(ys[1], _heads_output(other, x))


def _heads_of(model, params, x):
    """The heads' loop as a function of the grouped parameters (``params`` by name): the reference
    for derivatives with respect to them (``to_heads`` copies the values)."""
    hds, n = model.heads, len(model.layers)
    outs = []
    for g in range(hds):
        h = x
        for k in range(n):
            w, b = params[f"layers.{k}.weight"], params[f"layers.{k}.bias"]
            h = torch.nn.functional.linear(h, w.reshape(hds, -1, w.shape[-1])[g], b.reshape(hds, -1)[g])
            if k < n - 1:
                h = model.activations[k](h)
        outs.append(h)
    return torch.cat(outs, -1)


@pytest.mark.parametrize("how", ["vmap-ensemble-meta", "hessian-params", "dual-params", "compile-modes"])
@pytest.mark.parametrize("strategy", ["auto", "layers", "fm_chain", "heads"])
def test_every_strategy_under_the_transforms(strategy, how):
    # Each strategy against the heads' loop in float64: the model-ensembling recipe (a meta
    # base model), second derivatives and forward-mode tangents with respect to the
    # parameters, and one compiled graph across a dynamic batch, train/eval, no_grad and
    # frozen layers (dynamo guards each; the gradients are the loop's).
    fc = torch.func.functional_call
    torch.manual_seed(0)
    model = GroupedMLP(6, [4, 3], 2, heads=3, activation=torch.nn.Tanh, strategy=strategy, dtype=torch.float64)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(4, 6, dtype=torch.float64)
    if how == "vmap-ensemble-meta":
        other = GroupedMLP(6, [4, 3], 2, heads=3, activation=torch.nn.Tanh, strategy=strategy, dtype=torch.float64)
        stacked, buffers = torch.func.stack_module_state([model, other])
        base = copy.deepcopy(model).to("meta")
        ys = torch.func.vmap(lambda p, b: fc(base, (p, b), (x,)))(stacked, buffers)
        xs = torch.randn(2, 4, 6, dtype=torch.float64)
        own = torch.func.vmap(lambda p, b, v: fc(base, (p, b), (v,)))(stacked, buffers, xs)
        for k, m in enumerate((model, other)):
            torch.testing.assert_close(ys[k], _heads_output(m, x))
            torch.testing.assert_close(own[k], _heads_output(m, xs[k]))
    elif how == "hessian-params":
        got = torch.func.hessian(lambda p: fc(model, p, (x,)).sin().sum())(params)
        want = torch.func.hessian(lambda p: _heads_of(model, p, x).sin().sum())(params)
        for a in params:
            for b in params:
                torch.testing.assert_close(got[a][b], want[a][b])
    elif how == "dual-params":
        fwad = torch.autograd.forward_ad
        tangents = {k: torch.randn_like(v) for k, v in params.items()}
        tx = torch.randn_like(x)
        with fwad.dual_level():
            duals = {k: fwad.make_dual(v, tangents[k]) for k, v in params.items()}
            got = fwad.unpack_dual(fc(model, duals, (fwad.make_dual(x, tx),))).tangent
        _, want = torch.func.jvp(lambda p, v: _heads_of(model, p, v), (params, x), (tangents, tx))
        torch.testing.assert_close(got, want)
    else:
        compiled = torch.compile(model, fullgraph=True)
        for n, mode, frozen in ((4, "train", False), (7, "eval", False), (3, "train", True)):
            getattr(model, mode)()
            model.layers[1].requires_grad_(not frozen)
            xn, gy = torch.randn(n, 6, dtype=torch.float64), torch.randn(n, 6, dtype=torch.float64)
            torch._dynamo.mark_dynamic(xn, 0)
            with torch.no_grad():
                torch.testing.assert_close(compiled(xn), _heads_output(model, xn))
            live = {k: v for k, v in model.named_parameters() if v.requires_grad}
            xr = xn.clone().requires_grad_()
            got = torch.autograd.grad((compiled(xr) * gy).sum(), [xr, *live.values()])
            xw = xn.clone().requires_grad_()
            want = torch.autograd.grad((_heads_of(model, dict(model.named_parameters()), xw) * gy).sum(),
                                       [xw, *live.values()])
            assert len(got) == len(want) == (5 if frozen else 7)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)


def test_compiled_mlp_runs_hooked_layers(chain_spy):
    model = _mlp("auto")
    fired = []
    model.layers[1].register_forward_hook(lambda m, args, out: fired.append(out.shape))
    backend, seen = _graph_ops()
    x = torch.randn(5, 6, dtype=torch.float64)
    y = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(y, _heads_output(model, x))
    assert fired == [torch.Size([5, 12])], fired
    assert not chain_spy and seen, "the compiled model ran the chain past a hooked layer"


# ------------------------------------------------------------------ fresh subprocesses


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELUDE = """
import json, sys
import torch
import blockdiag
from blockdiag.testing import reference_loop

def report(**kw):
    print("RESULT " + json.dumps(kw), flush=True)

def max_err(a, b):
    return float((a.detach().double() - b.detach().double()).abs().max())

torch.manual_seed(0)
G, I, O, N = 3, 4, 2, 5
"""


def _run_child(code, timeout=120, results=None):
    """Run ``code`` in a fresh interpreter: its one RESULT (or a list of ``results`` of them)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, env=os.environ.copy(),
    )
    assert proc.returncode == 0, (
        f"child exited with {proc.returncode}{' (segfault)' if proc.returncode in (-11, 139) else ''}\n"
        f"stdout:\n{proc.stdout[-3000:]}\n"
        f"stderr:\n{proc.stderr[-3000:]}"
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == (results or 1), f"results missing:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    outs = [json.loads(ln[len("RESULT "):]) for ln in lines]
    return outs if results is not None else outs[0]


_DTENSOR = """
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

backends, port = BACKENDS, PORT
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
mesh = init_device_mesh("cpu", (1,))
full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t
for name in backends:
    print("START", name, flush=True)  # a crash shows which backend it was
    layer = blockdiag.GroupedLinear(G * I, G * O, G, backend=name)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.weight = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
    layer.bias = torch.nn.Parameter(distribute_tensor(b, mesh, [Shard(0)]))
    x = torch.randn(N, G * I)
    xd = distribute_tensor(x, mesh, [Replicate()])
    w64, b64 = w.double().requires_grad_(), b.double().requires_grad_()
    ref = reference_loop(x.double(), w64, b64)
    ref.sum().backward()
    try:
        y = layer(xd)
        out = dict(result="ok", forward=max_err(full(y), ref), shape=list(y.shape))
        y.sum().backward()
        out.update(weight=max_err(full(layer.weight.grad), w64.grad), bias=max_err(full(layer.bias.grad), b64.grad))
    except blockdiag.BlockDiagError as e:
        out = dict(result="refused", message=str(e))
    report(name=name, **out)
# Compiled auto with DTensor parameters: the graph keeps blockdiag::auto (its sharding rules),
# not the chosen backend's torch ops on global DTensors.
print("START auto compiled", flush=True)
layer = blockdiag.GroupedLinear(G * I, G * O, G)
w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
layer.weight = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
layer.bias = torch.nn.Parameter(distribute_tensor(b, mesh, [Shard(0)]))
seen = []
def backend(gm, inputs):
    from torch._functorch.aot_autograd import aot_module_simplified
    from functorch.compile import make_boxed_func
    def fw(g, _):
        seen.extend(str(n.target) for n in g.graph.nodes if n.op == "call_function")
        return make_boxed_func(g.forward)
    return aot_module_simplified(gm, inputs, fw_compiler=fw, bw_compiler=lambda g, _: make_boxed_func(g.forward))
y = torch.compile(layer, backend=backend)(distribute_tensor(x, mesh, [Replicate()]))
ref = reference_loop(x.double(), w.double(), b.double())
report(name="auto compiled", result="ok" if "blockdiag.auto.default" in seen else f"graph ops: {sorted(set(seen))}",
       forward=max_err(full(y), ref), shape=list(y.shape))
dist.destroy_process_group()
"""


def _check_child_result(out, name):
    if out["result"] == "refused":
        msg = out["message"]
        assert msg and (name in msg or "DTensor" in msg), f"refusal does not say why: {msg!r}"
        return
    assert out["result"] == "ok", out
    for key in ("forward", "weight", "bias", "real"):
        if key in out:
            assert out[key] < 1e-4, out


DTENSOR_BACKENDS = ("simd", "mkl_batch", "auto", "bmm")


def test_dtensor_world_size_1():
    # One process for the four backends (a former segfault each, bmm the pure-torch control):
    # a crash names the backend it happened in (START lines).
    # find_spec, not importorskip: importing DTensor here would change this process for the
    # tests that follow (blockdiag registers sharding rules once DTensor is loaded)
    if importlib.util.find_spec("torch.distributed.tensor") is None:
        pytest.skip("torch.distributed.tensor is not available")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    backends = [n for n in DTENSOR_BACKENDS if n == "auto" or not get(n).unavailable_reason()]
    code = _DTENSOR.replace("BACKENDS, PORT", f"{backends!r}, {_free_port()}")
    outs = _run_child(code, results=len(backends) + 1)
    assert [o["name"] for o in outs] == [*backends, "auto compiled"]
    for out in outs:
        if out["result"] == "ok":
            assert out["shape"] == [N, G * O], out
        _check_child_result(out, out["name"])


_FAKE = """
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

name = NAME
with FakeTensorMode():
    layer = blockdiag.GroupedLinear(G * I, G * O, G, backend=name)
    x = torch.randn(N, G * I, requires_grad=True)
    y = layer(x)
    y2 = blockdiag.grouped_linear(x.detach(), layer.weight.detach(), None, backend=name)
    y.sum().backward()
    fake_ok = (isinstance(y, FakeTensor) and list(y.shape) == [N, G * O] and isinstance(y2, FakeTensor)
               and list(layer.weight.grad.shape) == [G, O, I])
# the kernels still work, and right, on real tensors afterwards (a self-check first run under
# FakeTensorMode must not have failed or been poisoned)
layer = blockdiag.GroupedLinear(G * I, G * O, G, backend=name)
x = torch.randn(N, G * I)
report(result="ok" if fake_ok else "wrong fake result",
       real=max_err(layer(x), reference_loop(x.double(), layer.weight.double(), layer.bias.double())))
"""

_META_DEFAULT = """
name = NAME
torch.set_default_device("meta")
layer = blockdiag.GroupedLinear(G * I, G * O, G, backend=name)
x = torch.randn(N, G * I)
try:
    y = layer(x)
    first = "ok" if (y.is_meta and list(y.shape) == [N, G * O]) else f"wrong: {y.device} {list(y.shape)}"
except blockdiag.BlockDiagError as e:
    first = "refused: " + str(e)
torch.set_default_device("cpu")
layer = blockdiag.GroupedLinear(G * I, G * O, G, backend=name)
x = torch.randn(N, G * I)
report(result="ok" if first == "ok" or first.startswith("refused: ") else first, first=first,
       real=max_err(layer(x), reference_loop(x.double(), layer.weight.double(), layer.bias.double())))
"""


# The first call of a fresh process made inside a transform: the kernels' one-time set-up
# (library load, self-check, rule registration) must not run inside it or break the graph.
_FIRST_CALL = """
name, mode = NAME, MODE
layer = blockdiag.GroupedLinear(G * I, G * O, G, backend=name)
x = torch.randn(N, G * I)
ref = reference_loop(x.double(), layer.weight.double(), layer.bias.double())
if mode == "compile-fullgraph":
    y = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
else:  # vmap over two stacked copies of the parameters
    params, bufs = torch.func.stack_module_state([layer, layer])
    y = torch.func.vmap(lambda p, b: torch.func.functional_call(layer, (p, b), (x,)))(params, bufs)[1]
report(result="ok", real=max_err(y, ref))
"""

FIRST_CALLS = [
    pytest.param(mode, name, id=f"{mode}-{name}")
    for mode, backends in (("compile-fullgraph", ("simd", "mkl_batch", "auto")), ("vmap", ("simd", "auto")))
    for name in backends
]


@pytest.mark.parametrize("mode,name", FIRST_CALLS)
def test_first_call_in_fresh_process_under_a_transform(mode, name):
    require_backend(name)
    out = _run_child(_FIRST_CALL.replace("NAME, MODE", f"{name!r}, {mode!r}"))
    _check_child_result(out, name)


SEGFAULTS = [
    pytest.param(code, name, id=f"{label}-{name}")
    for label, code, backends in (
        ("fake", _FAKE, ("simd", "mkl_batch", "auto")),
        ("default-meta", _META_DEFAULT, ("simd", "mkl_batch")),
    )
    for name in backends
]


@pytest.mark.parametrize("code,name", SEGFAULTS)
def test_former_segfault_in_fresh_process(code, name):
    require_backend(name)
    out = _run_child(code.replace("NAME", repr(name)))
    _check_child_result(out, name)


# torch.compile around torch.func: the per-sample-gradient and ensembling recipes.
_FUNC_IN_COMPILE = {
    "grad": lambda m, p, x: torch.func.grad(lambda p, x: torch.func.functional_call(m, p, (x,)).square().sum())(p, x),
    "vmap(grad)": lambda m, p, x: torch.func.vmap(
        torch.func.grad(lambda p, x: torch.func.functional_call(m, p, (x[None],)).square().sum()), in_dims=(None, 0))(p, x),
    "jacfwd": lambda m, p, x: torch.func.jacfwd(m)(x),
    "jvp": lambda m, p, x: torch.func.jvp(m, (x,), (torch.ones_like(x),)),
    "vmap": lambda m, p, x: torch.func.vmap(m)(x.view(N, 1, -1)),
}


def _compiled_transform_matches_eager(m, how):
    """``_FUNC_IN_COMPILE[how]`` over ``m``, compiled in one graph, against the same run eagerly."""
    p = {k: v.detach() for k, v in m.named_parameters()}
    x = torch.randn(N, G * I)
    want = _FUNC_IN_COMPILE[how](m, p, x)
    got = torch.compile(lambda: _FUNC_IN_COMPILE[how](m, p, x), fullgraph=True)()
    for a, e in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("how", list(_FUNC_IN_COMPILE))
@pytest.mark.parametrize("name", ALL)
def test_torch_func_inside_torch_compile(name, how):
    # grad, jacrev and vmap(grad) failed to compile (the op's autograd Function had no
    # setup_context for functorch), and with mkl_batch a graph broken inside the transform
    # resumed in traced frames: dynamo traced its numpy arrays of sizes and pointers, and MKL
    # computed garbage ("Parameter 2 was incorrect"). Then the graph broke at the op under
    # every transform (functorch cannot run the op's Function from inside the op), and jvp
    # and jacfwd ran eagerly: fullgraph holds now. Eager results are the reference.
    require_backend(name)
    torch.manual_seed(0)
    w, b = _params(torch.float32)
    _compiled_transform_matches_eager(_layer(name, w, b), how)


@pytest.mark.parametrize("how", ["grad", "vmap(grad)", "jvp"])
@pytest.mark.parametrize("strategy", ["auto", "layers", "fm_chain"])
def test_torch_func_over_a_grouped_mlp_inside_torch_compile(strategy, how):
    torch.manual_seed(0)
    _compiled_transform_matches_eager(GroupedMLP(G * I, [6, 5], O, heads=G, strategy=strategy), how)


@pytest.mark.parametrize("name", ALL)
def test_torch_func_functionalize(name):
    # functorch has no functionalize rule for an autograd Function: every backend's layer
    # under torch.func.functionalize (alone, around grad or vmap, or under make_fx) raised
    # "NYI: Functionalize rule for custom_function_call". Float64: exact against the loop.
    from torch.fx.experimental.proxy_tensor import make_fx

    require_backend(name)
    torch.manual_seed(0)
    w, b = _params(torch.float64)
    layer = _layer(name, w, b)
    x, gy = torch.randn(N, G * I, dtype=torch.float64), torch.randn(N, G * O, dtype=torch.float64)
    want = _reference(x, w, b, gy)
    fz = torch.func.functionalize
    torch.testing.assert_close(fz(layer)(x), want["y"])
    with torch.no_grad():
        torch.testing.assert_close(fz(layer)(x), want["y"])
    torch.testing.assert_close(make_fx(fz(layer))(x)(x), want["y"])
    xr = x.clone().requires_grad_()
    (fz(layer)(xr) * gy).sum().backward()
    torch.testing.assert_close(xr.grad, want["input"])
    loss = lambda v: (layer(v) * gy).sum()
    torch.testing.assert_close(fz(torch.func.grad(loss))(x), want["input"])
    torch.testing.assert_close(torch.func.grad(fz(loss))(x), want["input"])
    torch.testing.assert_close(fz(torch.func.vmap(layer))(x[:, None]), want["y"][:, None])


@pytest.mark.parametrize("strategy", ["auto", "layers", "fm_chain", "heads"])
def test_torch_func_functionalize_over_a_grouped_mlp(strategy):
    # The layers (strategy="layers", and auto, which runs them under a transform) raised
    # "NYI: Functionalize rule for custom_function_call"; the chain and the heads ran.
    torch.manual_seed(0)
    model = _mlp("auto")
    model.strategy = strategy
    x = torch.randn(N, 6, dtype=torch.float64)
    torch.testing.assert_close(torch.func.functionalize(model)(x), _heads_output(model, x))
    loss = lambda v: model(v).sin().sum()
    torch.testing.assert_close(torch.func.functionalize(torch.func.grad(loss))(x),
                               torch.func.grad(lambda v: _heads_output(model, v).sin().sum())(x))


@pytest.mark.parametrize("compiler", ["aot_eager", "eager"])
@pytest.mark.parametrize("name", ALL)
def test_forward_ad_inside_a_compiled_function(name, compiler):
    # The dual level entered inside the compiled function is entered in C, where Python's
    # forward_ad._current_level does not see it: the ops skipped the Function carrying their
    # jvp and the tangent came back None, for every backend ("eager": when the graph runs;
    # "aot_eager": when AOTAutograd traces it).
    require_backend(name)
    fwad = torch.autograd.forward_ad
    torch.manual_seed(0)
    w, b = _params(torch.float32)
    x, tx, tw = torch.randn(N, G * I), torch.randn(N, G * I), torch.randn_like(w)

    def f(x, w, tx, tw):
        with fwad.dual_level():
            y = grouped_linear(fwad.make_dual(x, tx), fwad.make_dual(w, tw), b, backend=name)
            return fwad.unpack_dual(y).tangent

    got = torch.compile(f, fullgraph=True, backend=compiler)(x, w, tx, tw)
    want = reference_loop(tx.double(), w.double(), None) + reference_loop(x.double(), tw.double(), None)
    _close(got, want, torch.float32, k=I, what=f"tangent through compiled {name}")


@pytest.mark.parametrize("forward", ["eager", "eager-compiled", "aot_eager-compiled"])
@pytest.mark.parametrize("name", ALL)
def test_compiled_autograd_traces_the_backward_in_one_graph(name, forward):
    # Compiled autograd traces each node's Python backward with dynamo. The backward's check
    # for a legacy-batched gradient (torch._C._functorch.is_legacy_batchedtensor) is a builtin
    # dynamo cannot trace: a graph break per layer, and with fullgraph=True an Unsupported
    # error, for every backend. With an eager forward the backward also called the kernels
    # (ctypes, out= into views), which dynamo cannot trace either. (A forward compiled
    # through AOTAutograd hands compiled autograd its own backward graph, not the op's.)
    from torch._dynamo import compiled_autograd

    require_backend(name)
    torch.manual_seed(0)
    w, b = _params(torch.float32)
    layer = _layer(name, w, b)
    compiler = forward.split("-")[0]
    module = torch.compile(layer, backend=compiler, fullgraph=True) if forward.endswith("compiled") else layer
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm

    for n in (N, N):  # the second step runs the cached backward graph
        x = torch.randn(n, G * I, requires_grad=True)
        gy = torch.randn(n, G * O)
        layer.zero_grad()
        y = module(x)
        with compiled_autograd._enable(torch.compile(backend=counting, fullgraph=True)):
            (y * gy).sum().backward()
        got = {"y": y, "input": x.grad, "weight": layer.weight.grad, "bias": layer.bias.grad}
        _check(got, _reference(x, w, b, gy), torch.float32, f"{name} {forward} forward, compiled autograd")
    assert len(graphs) == 1, f"{len(graphs)} compiled autograd graphs"


@pytest.mark.parametrize("make", [
    pytest.param(lambda: GroupedLinear(G * I, G * O, G, backend="bmm"), id="GroupedLinear"),
    pytest.param(lambda: GroupedMLP(I, [5], O, heads=G, shared_input=False, strategy="layers"), id="mlp-layers"),
    pytest.param(lambda: GroupedMLP(I, [5], O, heads=G, shared_input=False, strategy="fm_chain"), id="mlp-fm_chain"),
])
def test_a_module_frozen_with_its_parameters_discarded_says_so(make):
    # Inductor's freezing with freezing_discard_parameters swaps the module's parameters for
    # meta-device ErasedTensors once the graph is built. The frozen graph ran right, but an
    # eager call (as a recompile at another shape makes) was refused as a device mismatch
    # ("weight is on meta but input is on cpu; move them to one device") or, for the chain,
    # as a DTensor: nn.Linear's own error there names the freezing.
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(N, G * I)
    with torch.no_grad():
        want = model(x)
        with torch._inductor.config.patch(freezing=True, freezing_discard_parameters=True):
            got = torch.compile(model, fullgraph=True)(x)
        torch.testing.assert_close(got, want)
        with pytest.raises(BlockDiagError, match="discarded by torch.compile's freezing .*freezing_discard_parameters=False"):
            model(x)


def test_the_heads_strategy_frozen_with_max_autotune_uses_each_heads_weight():
    # Freezing folds the parameters into constants, and max-autotune's CPU GEMM template read
    # a constant that is a view at a storage offset from offset 0: every head of the heads
    # strategy (F.linear on views of the grouped weight) computed with head 0's weight,
    # silently (outputs off by order 1), where a loop of nn.Linear heads runs right.
    torch.manual_seed(0)
    model = GroupedMLP(I, [], O, heads=2, strategy="heads").eval()
    x = torch.randn(N, I)
    with torch.no_grad():
        want = model(x)
        with torch._inductor.config.patch(freezing=True):
            got = torch.compile(model, fullgraph=True, mode="max-autotune-no-cudagraphs")(x)
    torch.testing.assert_close(got, want)


def test_compiled_auto_serves_new_group_counts_and_symbolic_shapes():
    # A second group count makes the weight's sizes symbolic (automatic dynamic shapes): auto
    # planned with them and failed ("unhashable type: non-nested SymInt", "groups must be an
    # int >= 1, got 3").
    f = torch.compile(lambda x, w, b: grouped_linear(x, w, b))
    for g in (3, 4, 5):
        w, b = _params(torch.float32, g=g)
        x = torch.randn(N, g * I)
        _close(f(x, w, b), reference_loop(x.double(), w.double(), b.double()), torch.float32, k=I)
    w, b = _params(torch.float32)
    x = torch.randn(N, G * I)

    def per_sample(w, x):
        return torch.func.vmap(torch.func.grad(lambda w, xi: grouped_linear(xi[None], w, b).square().sum()),
                               (None, 0))(w, x)

    torch.testing.assert_close(torch.compile(per_sample, dynamic=True)(w, x), per_sample(w, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("how", ["grad", "jvp"])
def test_torch_func_over_chains_that_write_rows(how):
    # Blocks of 16 float32 outputs make the chain's last product blockdiag::fm_rows in traced
    # graphs, which had no path for a transform reaching it: an exported GroupedMLP under
    # torch.func, and torch.func inside torch.compile, raised "must override setup_context".
    torch.manual_seed(0)
    m = GroupedMLP(16, 16, 16, heads=2, strategy="fm_chain")
    x = torch.randn(4, 16)
    program = torch.export.export(m, (x,)).module()
    assert any("fm_rows" in str(n.target) for n in program.graph.nodes)
    p = {k: v.detach() for k, v in m.named_parameters()}
    run = {
        "grad": lambda mod: torch.func.grad(lambda p: torch.func.functional_call(mod, p, (x,)).square().sum())(p),
        "jvp": lambda mod: torch.func.jvp(mod, (x,), (torch.ones_like(x),))[1],
    }[how]
    want = run(m)
    for got in (run(program), torch.compile(lambda: run(m), fullgraph=True)()):
        for a, e in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wd", [0, 1, 3])
def test_fm_rows_vmap_over_any_weight_dimension(wd):
    # The rule read the blocks' sizes before moving the vmapped dimension first.
    from blockdiag.ops.fm_rows import fm_rows

    torch.manual_seed(0)
    h, b, w = torch.randn(G, I, N), torch.randn(G * O), torch.randn(2, G, O, I)
    got = torch.func.vmap(fm_rows, (None, wd, None))(h, w.movedim(0, wd), b)
    want = torch.stack([fm_rows(h, wk, b) for wk in w])
    torch.testing.assert_close(got, want)


# torch.func over the ops themselves: an exported program's graph calls them directly.
_FUNC_ON_OPS = {
    "grad": lambda f, x: torch.func.grad(lambda x: f(x).square().sum())(x),
    "jacrev": lambda f, x: torch.func.jacrev(f)(x),
    "jvp": lambda f, x: torch.func.jvp(f, (x,), (torch.ones_like(x),))[1],
    "vmap": lambda f, x: torch.func.vmap(f)(x[None])[0],
}


@pytest.mark.parametrize("how", list(_FUNC_ON_OPS))
@pytest.mark.parametrize("name", ALL)
def test_torch_func_over_an_exported_program(name, how):
    # grad, jacrev and jvp failed for every backend: an op reached under a transform ran its
    # autograd Function from inside its kernel, where functorch has no kernel for it.
    require_backend(name)
    torch.manual_seed(0)
    w, b = _params(torch.float32)
    x = torch.randn(N, G * I)
    program = torch.export.export(_layer(name, w, b), (x,)).module()
    got = _FUNC_ON_OPS[how](program, x)
    want = _FUNC_ON_OPS[how](lambda x: reference_loop(x, w.double(), b.double()), x.double())
    _close(got, want, torch.float32, k=G * I, what=f"{how} of the exported {name}")


def test_vmap_inside_torch_compile_batches_auto_inline_once():
    # Without a vmap rule for blockdiag::auto_inline, a compiled vmap (the ensembling recipe)
    # ran torch's batched fallback: the op, and its planning, once per vmapped slice.
    from blockdiag.ops import auto as auto_module

    torch.manual_seed(0)
    w, b = _params(torch.float32)
    layer = _layer("auto", w, b)
    x = torch.randn(4, N, G * I)
    planned = []
    real = auto_module.choice

    def spy(x2, *args, **kwargs):
        planned.append(x2.shape[0])
        return real(x2, *args, **kwargs)

    auto_module.choice = spy
    try:
        got = torch.compile(torch.func.vmap(layer), fullgraph=True)(x)
    finally:
        auto_module.choice = real
    _close(got, torch.stack([reference_loop(s.double(), w.double(), b.double()) for s in x]), torch.float32)
    assert planned and set(planned) == {4 * N}, f"auto_inline planned batches {planned}, want one of {4 * N} rows"


# ------------------------------------------------------------------------- TorchScript


@pytest.mark.parametrize("name", ALL)
def test_jit_trace_works_or_refuses_clearly(name):
    require_backend(name)
    w, b = _params(torch.float32)
    layer = _layer(name, w, b)
    x = torch.randn(N, G * I)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        try:
            traced = torch.jit.trace(layer, x)
        except BlockDiagError as e:
            msg = str(e)
            assert "trace" in msg or "jit" in msg, f"refusal does not mention jit.trace: {msg!r}"
            return
    with torch.no_grad():
        torch.testing.assert_close(traced(x), layer(x))
        _close(traced(x), reference_loop(x.double(), w.double(), b.double()), torch.float32, what="traced")


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("strategy", ["auto", "layers", "fm_chain", "heads"])
def test_jit_trace_of_a_grouped_mlp(strategy, grad):
    # The default model failed (the strategy choice planned with the tracer's tensor sizes),
    # and with grad the chain and the heads failed jit's own check run (in-place activations
    # under its no_grad repeat recorded another graph).
    from blockdiag import GroupedMLP

    torch.manual_seed(0)
    model = GroupedMLP(4, [5, 3], 2, heads=3, strategy=strategy, dtype=torch.float64)
    x = torch.randn(6, 4, dtype=torch.float64)
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(model, x)
    torch.testing.assert_close(traced(x), model(x))
    x2 = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    g_traced, = torch.autograd.grad(traced(x2).sum(), x2)
    g_model, = torch.autograd.grad(model(x2).sum(), x2)
    torch.testing.assert_close(g_traced, g_model)


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in ("auto", "bmm")])
def test_jit_script_refuses_clearly(name):
    layer = _layer(name, *_params(torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises((BlockDiagError, RuntimeError)) as info:
            torch.jit.script(layer)
    msg = str(info.value)
    assert "blockdiag" in msg.lower() or "torch.compile" in msg, f"unclear message: {msg[:500]!r}"


@pytest.mark.parametrize("backend", ["auto", "loop", "bmm"])
def test_an_exported_program_run_under_autocast_casts_as_linear_does(backend):
    # A graph calling the ops itself never runs GroupedLinear.forward's Python cast: the ops'
    # own autocast kernels cast, as autocast casts nn.Linear's aten::linear. Eager, a layer
    # whose backend computes bfloat16 in float32 (simd) multiplies the unrounded operands
    # instead, so the two agree within bfloat16's rounding of the operands, not bit for bit.
    torch.manual_seed(0)
    layer = blockdiag.GroupedLinear(12, 15, groups=3, backend=backend)
    x = torch.randn(6, 12)
    want_lin = torch.export.export(torch.nn.Linear(12, 15), (x,)).module()
    ep = torch.export.export(layer, (x,)).module()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(x)
        got = ep(x)
        assert want_lin(x).dtype == torch.bfloat16
    assert got.dtype == want.dtype == torch.bfloat16
    exact = reference_loop(x.double(), layer.weight.double(), layer.bias.double())
    tol = tolerances(torch.bfloat16, 4, magnitude=float(exact.abs().max()))
    torch.testing.assert_close(got.double(), exact, **tol)
    torch.testing.assert_close(want.double(), exact, **tol)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.ops.blockdiag.auto(x, layer.weight, layer.bias, True)
    assert got.dtype == torch.bfloat16
    got.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32


def _amp_model(kind: str) -> tuple[torch.nn.Module, int]:
    """A grouped layer or model (``kind``) followed by an ``nn.Linear``, and its input width."""
    torch.manual_seed(0)
    if kind.startswith("mlp"):
        return torch.nn.Sequential(GroupedMLP(4, [5], 4, heads=3, strategy=kind.split("-")[1]), torch.nn.Linear(12, 3)), 4
    return torch.nn.Sequential(GroupedLinear(12, 12, groups=3, backend=kind), torch.nn.Linear(12, 3)), 12


@pytest.mark.parametrize("kind", ["auto", "simd", "mlp-layers", "mlp-fm_chain"])
def test_a_program_exported_under_autocast_casts_where_it_runs_as_linear_does(kind):
    # torch.export records nn.Linear's aten.linear above autocast, uncast: the autocast of the
    # export is not in the program, which casts under the autocast where it runs. The layers
    # cast in Python while tracing, which baked bfloat16 into the program: run without
    # autocast it returned bfloat16, and a following nn.Linear failed on mixed dtypes.
    if kind == "simd":
        require_backend("simd")
    model, width = _amp_model(kind)
    x = torch.randn(6, width)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=2, max=64)},))
        want_amp = model(x)
        got_amp = ep.module()(x)
    assert got_amp.dtype == want_amp.dtype == torch.bfloat16
    with torch.no_grad():
        exact = model.double()(x.double())
    tol = tolerances(torch.bfloat16, 12, magnitude=float(exact.abs().max()))
    torch.testing.assert_close(got_amp.double(), exact, **tol)
    model.float()
    x9 = torch.randn(9, width)
    got = ep.module()(x9)  # no autocast here: float32, as nn.Linear's program and the eager model
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, model(x9))


class _AmpBlock(torch.nn.Module):
    """A model that runs its grouped part under its own autocast block, then an nn.Linear."""

    def __init__(self, kind: str):
        super().__init__()
        self.body, self.width = _amp_model(kind)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.body[0](x)
        return self.body[1](y.to(self.body[1].weight.dtype))


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
@pytest.mark.parametrize("kind", ["auto", "bmm", "mlp-layers"])
def test_an_autocast_block_inside_an_exported_model_stays_in_the_program(kind, strict):
    # The model's own autocast block is in the program (torch's wrap_with_autocast), decomposed
    # or not. Decomposing it traces auto_inline's body under autocast: without an autocast
    # kernel of its own the composite op recorded a float32 product there, and the program
    # failed its own dtype check (bfloat16 expected).
    model = _AmpBlock(kind)
    x = torch.randn(6, model.width)
    ep = torch.export.export(model, (x,), strict=strict)
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double())  # autocast leaves float64 alone
    tol = tolerances(torch.bfloat16, 12, magnitude=float(exact.abs().max()))
    for program in (ep, ep.run_decompositions()):
        got = program.module()(x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exact, **tol)


@pytest.mark.parametrize("backend", ["auto", "bmm"])
def test_decompositions_traced_under_autocast_record_its_casts_as_linear_does(backend):
    # run_decompositions under autocast records autocast's casts for aten.linear and each
    # backend's op; auto_inline (composite) had no autocast kernel and recorded a float32
    # product: the decomposed program then returned float32 where nn.Linear's returns bfloat16.
    torch.manual_seed(0)
    x = torch.randn(6, 12)
    lin = torch.export.export(torch.nn.Linear(12, 6), (x,))
    layer = GroupedLinear(12, 6, groups=3, backend=backend)
    ep = torch.export.export(layer, (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin, got = lin.run_decompositions(), ep.run_decompositions()
    assert lin.module()(x).dtype == torch.bfloat16
    out = got.module()(x)
    assert out.dtype == torch.bfloat16
    exact = reference_loop(x.double(), layer.weight.detach().double(), layer.bias.detach().double())
    torch.testing.assert_close(out.double(), exact, **tolerances(torch.bfloat16, 4, magnitude=float(exact.abs().max())))


def test_an_export_under_autocast_checks_dtypes_as_autocast_casts_them():
    # Exporting under autocast, the layer checks its uncast operands by the dtypes autocast
    # gives them: a bfloat16 layer takes a float32 input (autocast casts it), a float64 one
    # does not (autocast leaves float64 alone), as in eager mode.
    x = torch.randn(6, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = GroupedLinear(12, 6, groups=3).bfloat16()
        got = torch.export.export(half, (x,)).module()(x)
        assert got.dtype == torch.bfloat16
        with pytest.raises(BlockDiagError, match="weight has dtype torch.float64 but input has dtype"):
            torch.export.export(GroupedLinear(12, 6, groups=3).double(), (x,))


@pytest.mark.parametrize("how", ["vjp", "jacrev-chunk1"])
@pytest.mark.parametrize("name", ALL)
def test_first_order_torch_func_outside_its_transform_runs_on_every_backend(name, how):
    # torch.func.vjp's pullback runs after its transform has exited, with create_graph=True
    # wherever grad mode is on (so does jacrev with chunk_size=1, which calls it without
    # vmap): a first-order product that the first-order backends (csr, bsr) refused as a
    # double backward.
    require_backend(name)
    torch.manual_seed(0)
    w, b = _params(torch.float64)
    x, ct = torch.randn(N, G * I, dtype=torch.float64), torch.randn(N, G * O, dtype=torch.float64)

    def f(x, w, b):
        return grouped_linear(x, w, b, backend=name)

    if how == "vjp":
        got = torch.func.vjp(f, x, w, b)[1](ct)
        want = torch.func.vjp(reference_loop, x, w, b)[1](ct)
    else:
        got = torch.func.jacrev(f, argnums=(0, 1, 2), chunk_size=1)(x, w, b)
        want = torch.autograd.functional.jacobian(reference_loop, (x, w, b))
    for label, g, e in zip(("input", "weight", "bias"), got, want):
        _close(g, e, torch.float64, what=f"{name} {how}: {label}")


@pytest.mark.parametrize("how", ["ensemble", "bias-only", "hessian"])
def test_vmap_over_denses_weight_builds_one_matrix_per_copy(how, monkeypatch):
    # The batching rule folded B vmapped copies of the weight into B*G groups of one product:
    # for dense, one [B*G*out, B*G*in] matrix, B times the memory and FLOPs of the copies'
    # matrices (64 ensembled models of 16 8x8 blocks took 1 GB for 8 MiB of matrices; a
    # Hessian w.r.t. a 4 x 9x17 weight, vmapped over its 612 entries, asked for 14 GB).
    from blockdiag.ops import entries

    entry = entries()["dense"]
    groups = []
    real = entry.forward

    def spy(x, w, b):
        groups.append(w.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(entry, "forward", spy)
    torch.manual_seed(0)
    dt = torch.float64
    w, b = _params(dt)
    x = torch.randn(N, G * I, dtype=dt)
    f = lambda x, w, b: grouped_linear(x, w, b, backend="dense")
    if how == "ensemble":
        ws, bs, xs = torch.randn(4, G, O, I, dtype=dt), torch.randn(G * O, 4, dtype=dt), torch.randn(N, 4, G * I, dtype=dt)
        got = torch.func.vmap(f, in_dims=(1, 0, 1))(xs, ws, bs)
        want = torch.stack([reference_loop(xs[:, k], ws[k], bs[:, k]) for k in range(4)])
    elif how == "bias-only":
        bs = torch.randn(4, G * O, dtype=dt)
        got = torch.func.vmap(f, in_dims=(None, None, 0))(x, w, bs)
        want = torch.stack([reference_loop(x, w, bs[k]) for k in range(4)])
    else:
        def loss(fn):
            return lambda w: torch.tanh(fn(x, w, b)).pow(2).sum()

        got = torch.func.hessian(loss(f))(w)
        want = torch.func.hessian(loss(reference_loop))(w)
    _close(got, want, dt, what=f"dense, vmapped weight ({how})")
    assert max(groups, default=G) == G, f"dense built a matrix of {max(groups)} groups for a {G}-group weight"
