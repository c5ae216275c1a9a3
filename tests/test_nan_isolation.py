"""A NaN/Inf in one group stays in that group, except with ``dense``, which ``auto`` avoids.

Issue 22, item 8. ``dense`` multiplies the off-diagonal zeros of the block-diagonal matrix, and
``0 * NaN`` is NaN: a non-finite input entry of one group in row ``n`` reaches row ``n``'s
output in every group, and a non-finite upstream-gradient entry reaches row ``n``'s input
gradient in every group. Every other backend confines it to its group. Backends declare which
they are (``Backend.isolates_groups``), and ``auto`` uses a backend that does not isolate
groups only where the user set a dense crossover explicitly.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

import blockdiag
from blockdiag import Problem
from blockdiag.backends import _registry, get, names

from _params import DEVICES, backends_and_auto, require_backend
from _profiles import entry, point, write

G, I, O, N = 6, 8, 8, 5  # square blocks: every backend (bsr, grouped_mm) accepts them
BAD_GROUP, BAD_ROW = 3, 2
NON_FINITE = [pytest.param(float("nan"), id="nan"), pytest.param(float("inf"), id="inf")]


def _dtype_for(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.float32
    ok = get(name).dtypes[device]
    return next(t for t in (torch.float32, torch.float64, torch.bfloat16, torch.float16) if t in ok)


def _setup(name: str, device: str):
    require_backend(name, device)
    dtype = _dtype_for(name, device)
    if name != "auto":
        why = get(name).decline_reason(Problem(N, G, I, O, dtype, device, requires_grad=True))
        if why:
            pytest.skip(f"backend {name!r} declines the problem: {why}")
    kw = dict(device=device, dtype=dtype)
    x = torch.randn(N, G * I, **kw)
    w = torch.randn(G, O, I, **kw)
    b = torch.randn(G * O, **kw)
    return x, w, b


def _per_group_finite(t: torch.Tensor, block: int) -> torch.Tensor:
    """``[rows, G]``: whether each row's slice of each group is finite."""
    return torch.isfinite(t.detach().float().reshape(t.shape[0], G, block)).all(-1).cpu()


def _isolates(name: str) -> bool:
    return name == "auto" or get(name).isolates_groups


@pytest.mark.parametrize("bad", NON_FINITE)
@pytest.mark.parametrize("name", backends_and_auto())
@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_input_stays_in_its_group(device, name, bad):
    x, w, b = _setup(name, device)
    x[BAD_ROW, BAD_GROUP * I + 1] = bad
    y = blockdiag.grouped_linear(x, w, b, backend=name)
    fin = _per_group_finite(y, O)
    assert not fin[BAD_ROW, BAD_GROUP]  # the group that read it
    others = torch.ones(N, G, dtype=torch.bool)
    others[BAD_ROW, BAD_GROUP] = False
    if _isolates(name):
        assert bool(fin[others].all()), f"{name}: the non-finite input reached {(~fin).nonzero().tolist()}"
    else:
        # Documented (dense.py, the backend's summary): that row is NaN in every group,
        # every other row is untouched.
        assert not bool(fin[BAD_ROW].any())
        assert bool(torch.cat([fin[:BAD_ROW], fin[BAD_ROW + 1 :]]).all())


@pytest.mark.parametrize("bad", NON_FINITE)
@pytest.mark.parametrize("name", backends_and_auto())
@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_upstream_gradient_stays_in_its_group(device, name, bad):
    if name != "auto" and not get(name).grad:
        pytest.skip(f"backend {name!r} has no backward")
    x, w, b = _setup(name, device)
    x.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    y = blockdiag.grouped_linear(x, w, b, backend=name)
    gy = torch.randn_like(y)
    gy[BAD_ROW, BAD_GROUP * O + 2] = bad
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), gy)
    # The weight and bias gradients are per block with every backend, dense included.
    gw_fin = torch.isfinite(gw.float()).flatten(1).all(1).cpu()
    gb_fin = torch.isfinite(gb.float()).reshape(G, O).all(1).cpu()
    for fin in (gw_fin, gb_fin):
        assert not fin[BAD_GROUP] and bool(torch.cat([fin[:BAD_GROUP], fin[BAD_GROUP + 1 :]]).all())
    fin = _per_group_finite(gx, I)
    assert not fin[BAD_ROW, BAD_GROUP]
    others = torch.ones(N, G, dtype=torch.bool)
    others[BAD_ROW, BAD_GROUP] = False
    if _isolates(name):
        assert bool(fin[others].all()), f"{name}: the non-finite gradient reached {(~fin).nonzero().tolist()}"
    else:
        assert not bool(fin[BAD_ROW].any())
        assert bool(torch.cat([fin[:BAD_ROW], fin[BAD_ROW + 1 :]]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", backends_and_auto())
def test_an_infinite_upstream_gradient_gives_an_infinite_weight_gradient(name, dtype):
    # gW[g, o, :] = sum_n gy[n, g*O + o] * x[n, g, :]: one infinite gy entry makes that row
    # +-inf (x has no zero), as nn.Linear's is. conv's bfloat16 weight gradient (the
    # convolution's own) was NaN there.
    require_backend(name)
    if name != "auto" and dtype not in get(name).dtypes["cpu"]:
        pytest.skip(f"backend {name!r} does not run {dtype} on CPU")
    torch.manual_seed(0)
    x = (torch.rand(N, G * I) + 0.5).to(dtype)  # positive: the row's sign is the gradient's
    w = torch.randn(G, O, I).to(dtype).requires_grad_()
    b = torch.randn(G * O).to(dtype)
    gy = torch.randn(N, G * O).to(dtype)
    gy[BAD_ROW, BAD_GROUP * O + 2] = float("-inf")
    (gw,) = torch.autograd.grad(blockdiag.grouped_linear(x, w, b, backend=name), w, gy)
    assert bool((gw[BAD_GROUP, 2] == float("-inf")).all()), f"{name}: {gw[BAD_GROUP, 2].tolist()}"
    others = torch.ones(G, O, dtype=torch.bool)
    others[BAD_GROUP, 2] = False
    assert bool(torch.isfinite(gw[others]).all())


def test_only_dense_declares_that_it_mixes_groups():
    # The two tests above check each declaration against what the backend does.
    assert [n for n in names() if not get(n).isolates_groups] == ["dense"]
    assert "NaN" in get("dense").summary


# A grid of problems on which a tuning profile says dense is fastest by far, and whose
# measured crossovers (the profile's settings) allow it: where `auto` used to pick dense.
GRID = [
    Problem(batch, groups, block, block, requires_grad=grad)
    for batch in (8, 256, 2048)
    for groups in (2, 4, 8)
    for block in (4, 16, 64)
    for grad in (False, True)
]


def _profile_path() -> Path:
    return Path(os.environ["BLOCKDIAG_PROFILE"])  # the root conftest points it into tmp_path


@pytest.fixture
def dense_fastest_profile():
    ms = [
        point(mode=p.mode, batch=p.batch, groups=p.groups, block_in=p.block_in, block_out=p.block_out,
              dense=1.0, bmm=2.0, loop=3.0, **{"bmm_fm_bmm" if p.requires_grad else "bmm_fm": 2.5})
        for p in GRID
    ]
    write(_profile_path(), entry(ms, settings={"dense_max_groups": 64, "dense_max_elements": 1 << 30}))
    yield
    blockdiag.profile.clear_cache()


def test_auto_never_picks_dense_where_it_used_to(dense_fastest_profile):
    # Before: dense, declaring itself group-isolating, won every point of the grid.
    with pytest.MonkeyPatch.context() as m:  # not the shared `monkeypatch`: its undo resets the env
        m.setitem(_registry._REGISTRY, "dense", dataclasses.replace(get("dense"), isolates_groups=True))
        assert {blockdiag.choose(p).backend for p in GRID} == {"dense"}
    # Now: never, and the plan says why; the next-fastest backend is taken instead.
    for p in GRID:
        plan = blockdiag.choose(p)
        assert plan.backend == "bmm", str(plan)
        note = next(c.note for c in plan.candidates if c.name == "dense")
        assert "does not isolate groups" in note
    # Named, it still runs.
    x, w = torch.randn(3, 8), torch.randn(2, 4, 4)
    torch.testing.assert_close(blockdiag.grouped_linear(x, w, backend="dense"),
                               blockdiag.grouped_linear(x, w, backend="loop"))


@pytest.mark.parametrize("how", ["config", "set_config", "environment"])
def test_an_explicit_dense_crossover_lets_auto_pick_dense(dense_fastest_profile, monkeypatch, how):
    p = Problem(256, 4, 16, 16)
    assert blockdiag.choose(p).backend == "bmm"
    if how == "config":
        with blockdiag.config(dense_max_groups=8):
            assert blockdiag.choose(p).backend == "dense"
    elif how == "set_config":
        blockdiag.set_config(dense_max_elements=1 << 30)
        try:
            assert blockdiag.choose(p).backend == "dense"
        finally:
            blockdiag.set_config(dense_max_elements=None)
    else:
        monkeypatch.setenv("BLOCKDIAG_DENSE_MAX_GROUPS", "8")
        assert blockdiag.choose(p).backend == "dense"
        monkeypatch.delenv("BLOCKDIAG_DENSE_MAX_GROUPS")
    assert blockdiag.choose(p).backend == "bmm"  # withdrawn: off auto again


def test_a_registered_backend_that_mixes_groups_is_kept_off_auto(monkeypatch):
    write(_profile_path(), entry([point(groups=4, mixer=0.1, loop=1.0)]))
    mixer = _registry.Backend(name="mixer", fn=get("loop").fn, dtypes={"cpu": _registry.FLOATS},
                              isolates_groups=False)
    monkeypatch.setitem(_registry._REGISTRY, "mixer", mixer)
    assert blockdiag.choose(Problem(256, 4, 10, 10)).backend == "loop"
    monkeypatch.setitem(_registry._REGISTRY, "mixer", dataclasses.replace(mixer, isolates_groups=True))
    assert blockdiag.choose(Problem(256, 4, 10, 10)).backend == "mixer"
