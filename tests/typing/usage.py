"""A user's code, type-checked by tests/test_typing.py (``mypy --strict``); never run as a test.

Each documented call form of the public API (README, docs/, docstrings' examples), written
as a user would, with the types a user would annotate. A false error here (a documented
argument refused, a result typed wider than it is) is one every user of a type checker
sees. The bodies are functions, so that importing this file (pytest's doctest collection)
runs nothing.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Generator

import torch
from torch import nn

import blockdiag
import blockdiag.distributed as bdd
from blockdiag.testing import DTYPES_CPU, backend_tolerances, devices, reference_loop, reference_scipy, tolerances


def head() -> nn.Sequential:
    return nn.Sequential(nn.Linear(150, 10), nn.ReLU(), nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 1))


def grouped_linear_layer() -> None:
    layer = blockdiag.GroupedLinear(50 * 150, 50 * 10, groups=50)
    x = torch.randn(32, 50 * 150)
    y: torch.Tensor = layer(x)
    y2: torch.Tensor = layer.forward(x)
    plan: blockdiag.Plan = layer.plan(x)
    print(plan, y, y2)
    # The plan's fields.
    backend: str = plan.backend
    problem: blockdiag.Problem = plan.problem
    reason: str = plan.reason
    source: str = plan.source
    for c in plan.candidates:
        name: str = c.name
        ok: bool = c.ok
        est: float | None = c.estimate_us
        note: str = c.note
        measured: bool = c.measured
        print(name, ok, est, note, measured)
    for setting, value, where in plan.settings:
        print(setting, value, where)
    print(backend, problem, reason, source, plan.measured_on, plan.neighbours)
    # Attributes: sizes, parameters, backend.
    sizes: list[int] = [layer.in_features, layer.out_features, layer.groups, layer.block_in, layer.block_out]
    weight: torch.Tensor = layer.weight
    if layer.bias is not None:
        bias: torch.Tensor = layer.bias
        print(bias)
    layer.backend = "bmm"
    name2: str = layer.backend
    print(sizes, weight, name2)
    # Every keyword and factory form.
    blockdiag.GroupedLinear(8, 6, 2, False, backend="loop")
    blockdiag.GroupedLinear(8, 6, groups=2, bias=True, backend="auto", device="cpu", dtype=torch.float64)
    blockdiag.GroupedLinear(8, 6, groups=2, device=torch.device("cpu"), dtype=None)
    blockdiag.GroupedLinear(8, 6, groups=2, device=None, dtype=torch.bfloat16)
    layer.reset_parameters()
    # An ordinary module: to(), train/eval, state_dict, compile.
    moved: blockdiag.GroupedLinear = layer.to("cpu").eval().train()
    layer.load_state_dict(moved.state_dict())
    compiled = torch.compile(layer)
    print(compiled(x))


def linears_round_trip() -> None:
    heads = [nn.Linear(3, 2) for _ in range(4)]
    layer: blockdiag.GroupedLinear = blockdiag.GroupedLinear.from_linears(heads)
    layer = blockdiag.GroupedLinear.from_linears(heads, backend="dense")
    layer = blockdiag.GroupedLinear.from_linears(nn.ModuleList(heads))
    layer = blockdiag.GroupedLinear.from_linears(tuple(heads))
    back: nn.ModuleList = layer.to_linears()
    again = blockdiag.GroupedLinear.from_linears(back)
    first: nn.Module = back[0]
    print(again.weight.shape, first)


def mlp() -> None:
    heads = nn.ModuleList(head() for _ in range(50))
    model: blockdiag.GroupedMLP = blockdiag.GroupedMLP.from_heads(heads)
    model = blockdiag.GroupedMLP.from_heads([head() for _ in range(3)])
    model = blockdiag.GroupedMLP.from_heads([nn.Linear(150, 1) for _ in range(3)])  # bare Linears
    model = blockdiag.GroupedMLP.from_heads(heads, shared_input=False, backend="bmm", strategy="layers")
    model = blockdiag.GroupedMLP.from_heads(tuple(heads), strategy="fm_chain")
    x = torch.randn(64, 150)
    y: torch.Tensor = model(x)
    assert torch.allclose(y, torch.cat([h(x) for h in heads], -1), atol=1e-5)
    plan: blockdiag.MLPPlan = model.plan(x)
    strategy: str = plan.strategy
    requested: str = plan.requested
    reason: str = plan.reason
    times: list[float | None] = [plan.chain_us, plan.layers_us]
    layer_plans: tuple[blockdiag.Plan, ...] = plan.layers
    print(plan, strategy, requested, reason, times, layer_plans)
    back: nn.ModuleList = model.to_heads()
    model = blockdiag.GroupedMLP.from_heads(back)
    # The constructor's documented forms.
    blockdiag.GroupedMLP(150, [10, 10], 1, heads=50)
    blockdiag.GroupedMLP(150, (10, 10), 1, heads=50)
    blockdiag.GroupedMLP(8, 4, 1, heads=3, device="cpu", dtype=torch.float32)
    blockdiag.GroupedMLP(8, 4, 1, heads=3, device=torch.device("cpu"), dtype=None)
    blockdiag.GroupedMLP(8, [4, 4], 1, heads=3, activation=nn.Tanh, output_activation=nn.Sigmoid)
    blockdiag.GroupedMLP(8, [4, 4], 1, heads=3, activation=lambda: nn.LeakyReLU(0.1), bias=[True, False, True])
    blockdiag.GroupedMLP(8, [4], 1, heads=3, activation=lambda: nn.Sequential(nn.ReLU(), nn.Dropout(0.1)))
    blockdiag.GroupedMLP(8, [4], 1, heads=3, bias=False, shared_input=False, backend="bmm", strategy="heads")
    # Attributes and settable strategy / backend.
    sizes: list[int] = [model.in_features, model.out_features, model.heads, *model.hidden_features]
    shared: bool = model.shared_input
    model.activations[0] = nn.GELU()  # checked alike when put in later
    model.output_activation = nn.Tanh()
    blockdiag.GroupedMLP(8, [4], 1, heads=3, activation=functools.partial(nn.LeakyReLU, 0.2))
    model.strategy = "layers"
    model.backend = "auto"
    chosen: list[str] = [model.strategy, model.backend]
    print(sizes, shared, chosen)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = nn.functional.mse_loss(model(x), torch.randn(64, 50))
    print(loss)
    opt.step()
    again = blockdiag.GroupedMLP(150, [10, 10], 1, heads=50)
    again.load_state_dict(model.state_dict())
    print(torch.compile(model)(x).shape)


def functional() -> None:
    x, w, b = torch.randn(3, 8), torch.randn(2, 3, 4), torch.randn(6)
    y: torch.Tensor = blockdiag.grouped_linear(x, w, b)
    y = blockdiag.grouped_linear(x, w, None, backend="bmm")
    y = blockdiag.grouped_linear(x, w, bias=b, backend="auto")
    y = blockdiag.grouped_linear(x, w)
    print(y)


def builders() -> None:
    blocks = torch.randn(4, 3, 2)
    dense: torch.Tensor = blockdiag.block_diag_dense(blocks)
    dense = blockdiag.block_diag_dense([torch.randn(3, 2) for _ in range(4)])
    dense = blockdiag.block_diag_dense(blocks.unbind(0))
    csr: torch.Tensor = blockdiag.block_diag_csr(blocks)
    bsr: torch.Tensor = blockdiag.block_diag_bsr(blocks, blocksize=(1, 2))
    bsr = blockdiag.block_diag_bsr(list(blocks))
    g = math.gcd(3, 2)
    bsr = blockdiag.block_diag_bsr(blocks, blocksize=(g, g))  # the docstring's square blocks
    coo: torch.Tensor = blockdiag.block_diag_coo(blocks)
    mask: torch.Tensor = blockdiag.block_diag_mask(4, (3, 2))
    mask = blockdiag.block_diag_mask(4, (3, 2), device="cpu")
    mask = blockdiag.block_diag_mask(4, (3, 2), device=torch.device("cpu"))
    back: torch.Tensor = blockdiag.to_blocks(dense, 4)
    sp = blockdiag.to_scipy(csr)
    again: torch.Tensor = blockdiag.from_scipy(sp, 4)
    again = blockdiag.from_scipy(sp, 4, layout="blocks", device="cpu", dtype=torch.float64)
    again = blockdiag.from_scipy(sp, 4, layout="dense", device=torch.device("cpu"), dtype=None)
    back = blockdiag.to_blocks(sp, 4)
    print(bsr, coo, mask, back, again)


def masks() -> None:
    groups, block_in, block_out = 4, 16, 8
    lin: nn.Linear = blockdiag.mask_block_diagonal_(nn.Linear(groups * block_in, groups * block_out), groups)
    with torch.no_grad():
        lin.bias.mul_(groups**0.5)
    assert lin.weight.abs().max() <= block_in**-0.5
    plain: nn.Linear = blockdiag.remove_block_diagonal_mask_(lin)
    print(plain)


def settings() -> None:
    with blockdiag.config(sparsity_threshold=0.0):
        current: blockdiag.Settings = blockdiag.get_settings()
    with blockdiag.config(sparsity_threshold=0.98, dense_max_groups=32, double_backward=True):
        pass
    with blockdiag.config(profile="/tmp/profile.json"), blockdiag.config(dense_max_elements=1 << 20):
        pass
    with contextlib.ExitStack() as stack:
        stack.enter_context(blockdiag.config(profile=None))
    blockdiag.set_sparsity_threshold(0.9)
    blockdiag.set_sparsity_threshold(None)
    blockdiag.set_config(sparsity_threshold=0.5, dense_max_groups=8)
    threshold: float = current.sparsity_threshold
    max_groups: int = current.dense_max_groups
    max_elements: int = current.dense_max_elements
    profile: str | None = current.profile
    double: bool = current.double_backward
    print(threshold, max_groups, max_elements, profile, double)


def einsum_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    g, o, i = weight.shape
    y = torch.einsum("ngi,goi->ngo", x.view(x.shape[0], g, i), weight).reshape(x.shape[0], g * o)
    return y if bias is None else y + bias


def small_blocks_only(problem: blockdiag.Problem) -> str | None:
    return f"block_in={problem.block_in} > 1024" if problem.block_in > 1024 else None


def backends() -> None:
    for info in blockdiag.list_backends():
        row: tuple[str, bool, str, str] = (info.name, info.available, info.reason, info.summary)
        print(row)
    registered: blockdiag.Backend = blockdiag.register_backend(
        blockdiag.Backend(
            name="einsum",
            fn=einsum_fn,
            dtypes={"cpu": frozenset({torch.float32, torch.float64}),
                    "cuda": frozenset({torch.float16, torch.bfloat16, torch.float32})},
            constraint=small_blocks_only,
            summary="torch.einsum over the [N, G, in] view",
        )
    )
    blockdiag.GroupedLinear(4 * 16, 4 * 8, groups=4, backend="einsum")
    removed: blockdiag.Backend = blockdiag.unregister_backend("einsum")
    blockdiag.register_backend(removed)
    blockdiag.unregister_backend(registered.name)
    try:
        blockdiag.register_backend(blockdiag.Backend("einsum_doc", einsum_fn, dtypes={"cpu": frozenset({torch.float32})}))
    except blockdiag.BlockDiagError as e:
        print(e)
    problem = blockdiag.Problem(batch=32, groups=4, block_in=16, block_out=8)
    problem = blockdiag.Problem(256, 50, 10, 10, requires_grad=True)
    problem = blockdiag.Problem(256, 50, 10, 10, torch.bfloat16, "cpu", False)
    plan: blockdiag.Plan = blockdiag.choose(problem)
    print(plan)
    version: str = blockdiag.__version__
    print(version, blockdiag.ProfileWarning.__name__)


def testing_helpers() -> None:
    x, w = torch.randn(1, 6, dtype=torch.float64), torch.randn(2, 5, 3, dtype=torch.float64)
    want: torch.Tensor = reference_loop(x, w, None)
    torch.testing.assert_close(reference_scipy(x, w, None), want)
    torch.testing.assert_close(want, want, **tolerances(torch.bfloat16, 8, magnitude=1.0))
    torch.testing.assert_close(want, want, **backend_tolerances("loop", blockdiag.Problem(8, 2, 4, 4)))
    names: list[str] = devices()
    dtypes: tuple[torch.dtype, ...] = DTYPES_CPU
    print(names, dtypes)


def distributed(mesh: torch.distributed.device_mesh.DeviceMesh, x: torch.Tensor, target: torch.Tensor) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    model = blockdiag.GroupedMLP(150, [10, 10], 1, heads=52)
    bdd.parallelize_groups(model, mesh)
    mine: range = bdd.local_groups(model.heads, mesh)
    y: torch.Tensor = model(x)
    loss = (y - target[:, mine.start:mine.stop]).pow(2).sum() / target.numel()
    print(loss)
    plain = bdd.gather_model(model)
    heads: nn.ModuleList = plain.to_heads()
    print(heads)
    layer = bdd.parallelize_groups(blockdiag.GroupedLinear(8, 4, 4), mesh, output_layouts=Replicate())
    linears: nn.ModuleList = bdd.gather_model(layer).to_linears()
    print(linears, bdd.local_groups(layer.groups, mesh))
    net = nn.ModuleDict({"heads": blockdiag.GroupedMLP(8, 4, 1, heads=4), "proj": blockdiag.GroupedLinear(8, 4, 4)})
    parallelize_module(net, mesh, {
        "heads": bdd.GroupParallel(),
        "proj": bdd.GroupParallel(input_layouts=Shard(-1), output_layouts=Replicate(), use_local_output=False),
    })
    try:
        bdd.parallelize_groups(blockdiag.GroupedMLP(8, 4, 1, heads=3), mesh)
    except bdd.UnevenGroupsError as e:
        print(e)


@contextlib.contextmanager
def user_settings() -> Generator[blockdiag.Settings, None, None]:
    """A user's own context manager around blockdiag.config."""
    with blockdiag.config(sparsity_threshold=1.0):
        yield blockdiag.get_settings()
