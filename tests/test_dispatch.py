"""The chooser's logic: constraint filtering, thresholds, ranking by the table, caching."""

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import blockdiag
from blockdiag import BlockDiagError, Problem, choose, dispatch, profile
from blockdiag.backends import Backend, _registry, names
from blockdiag.backends._registry import FLOATS
from blockdiag.dispatch import FALLBACK_ORDER, NEIGHBOURS, blended_times, candidates, nearest_measurements, plan_for
from blockdiag.testing import reference_loop, tolerances

from _params import backend_spy
from _profiles import entry, point, write


@pytest.fixture
def prof(tmp_path):
    """Write a profile at $BLOCKDIAG_PROFILE (the conftest points it into tmp_path)."""
    path = tmp_path / "profile.json"
    assert os.environ["BLOCKDIAG_PROFILE"] == str(path)

    def make(*measurements, settings=None):
        return write(path, entry(list(measurements), settings))

    yield make
    profile.clear_cache()


@pytest.fixture
def fake_backend(monkeypatch):
    """Register throw-away backends for one test only."""

    def add(name, **kw):
        b = Backend(name=name, fn=_registry.get("loop").fn, dtypes=kw.pop("dtypes", {"cpu": FLOATS}), **kw)
        monkeypatch.setitem(_registry._REGISTRY, name, b)
        return b

    return add


def test_table_winner_is_chosen_and_explained(prof):
    prof(point(bmm=30.0, loop=10.0, bmm_fm=20.0))
    plan = choose(Problem(256, 50, 10, 10))
    assert plan.backend == "loop"
    assert "measured at this shape" in plan.reason and "2.00x ahead of bmm_fm" in plan.reason
    assert plan.source.startswith("tuning profile")
    text = str(plan)
    assert "backend: loop" in text and "bmm_fm" in text and "chosen; measured" in text
    ok = [c.name for c in plan.candidates if c.ok]
    assert ok[:3] == ["loop", "bmm_fm", "bmm"]
    assert all(c.measured for c in plan.candidates if c.name in ("loop", "bmm", "bmm_fm"))


def test_builtin_plan_ignores_the_profile_in_force(prof):
    p = Problem(256, 50, 10, 10)
    builtin = choose(p)  # no profile written yet: the built-in table
    assert builtin.source == "built-in defaults" and builtin.backend != "csr"
    # A profile that sends this point to csr (sparsity_threshold lifted so it may run).
    prof(point(csr=1.0, **{n: 50.0 for n in ("loop", "bmm", "bmm_fm", builtin.backend)}),
         settings={"sparsity_threshold": 0.5})
    assert choose(p).backend == "csr"
    plan = blockdiag.dispatch.builtin_plan(p)
    assert plan.backend == builtin.backend and plan.source == "built-in defaults"
    # The settings in force still apply, and the profile's settings do not.
    assert plan.settings[0] == ("sparsity_threshold", 1.0, "built-in table")
    with blockdiag.config(sparsity_threshold=0.0):
        assert blockdiag.dispatch.builtin_plan(p).settings[0] == ("sparsity_threshold", 0.0, "blockdiag.config()")


def test_mode_is_part_of_the_key(prof):
    prof(point(loop=10.0, bmm=30.0), point(mode="train", loop=30.0, bmm=10.0))
    assert choose(Problem(256, 50, 10, 10)).backend == "loop"
    assert choose(Problem(256, 50, 10, 10, requires_grad=True)).backend == "bmm"


def test_nearest_point_in_log_space_is_used(prof):
    prof(point(batch=32, groups=4, loop=1.0, bmm=2.0), point(batch=2048, groups=256, loop=2.0, bmm=1.0))
    near_small = choose(Problem(64, 8, 10, 10))
    assert near_small.backend == "loop"
    assert "2 nearest measured shapes (nearest: batch=32 groups=4" in near_small.reason
    assert choose(Problem(1024, 128, 10, 10)).backend == "bmm"


def test_estimate_is_scaled_by_useful_flops(prof):
    prof(point(batch=32, groups=4, loop=1.0, bmm=2.0))
    est = {c.name: c for c in choose(Problem(64, 8, 10, 10)).candidates}
    # 2x batch and 2x groups -> 4x the FLOPs -> 4x the time; ratios between backends kept.
    assert est["loop"].estimate_us == pytest.approx(4.0) and not est["loop"].measured
    assert est["bmm"].estimate_us == pytest.approx(8.0)
    assert "estimated (1 nearest measured shapes, scaled by FLOPs)" in est["loop"].note


def test_off_grid_shape_blends_its_neighbours(prof):
    # B=128 lies between B=256 (distance 1, a near tie) and B=32 (distance 2, bmm 2x ahead).
    # The nearest point alone says loop; weighting both by 1/distance**2 says bmm.
    prof(point(batch=256, loop=1.0, bmm=1.02), point(batch=32, loop=2.0, bmm=1.0))
    plan = choose(Problem(128, 50, 10, 10))
    assert plan.backend == "bmm"
    est = {c.name: c.estimate_us for c in plan.candidates}
    w_near, w_far = 1.0, 0.25
    ratio_loop = math.exp(w_far * math.log(2.0) / (w_near + w_far))
    ratio_bmm = math.exp(w_near * math.log(1.02) / (w_near + w_far))
    base = math.exp((w_near * math.log(1.0 / 2) + w_far * math.log(1.0 * 4)) / (w_near + w_far))
    assert est["loop"] == pytest.approx(base * ratio_loop)
    assert est["bmm"] == pytest.approx(base * ratio_bmm)
    assert plan.neighbours == ((256, 50, 10, 10, 0.8, "loop"), (32, 50, 10, 10, 0.2, "bmm"))
    assert "batch=256 groups=50 block=10x10: 80%, loop" in str(plan)


def test_exact_point_ignores_its_neighbours(prof):
    prof(point(loop=1.0, bmm=1.02), point(batch=128, loop=9.0, bmm=1.0), point(batch=512, loop=9.0, bmm=1.0))
    plan = choose(Problem(256, 50, 10, 10))
    assert plan.backend == "loop" and "measured at this shape" in plan.reason
    assert [c.estimate_us for c in plan.candidates if c.name == "loop"] == [1.0]
    assert plan.neighbours == () and "blended from" not in str(plan)


def test_backend_skipped_at_a_neighbour_is_not_penalised(prof):
    # Each backend is compared with the fastest where it was measured. bmm is 1.1x loop at
    # the near point and bmm_fm (skipped there, say by --max-gflop) 1.05x loop at the far
    # one: loop is ahead everywhere and is chosen. Blending absolute FLOP-scaled times
    # instead would rank bmm first, because the far point's times enter loop's blend only.
    prof(point(batch=256, loop=1.0, bmm=1.1), point(batch=32, loop=1.0, bmm_fm=1.05))
    plan = choose(Problem(128, 50, 10, 10))
    assert plan.backend == "loop"
    est = {c.name: c.estimate_us for c in plan.candidates}
    assert est["bmm_fm"] / est["loop"] == pytest.approx(1.05)
    assert est["bmm"] / est["loop"] == pytest.approx(1.1)


def test_only_the_nearest_neighbours_count(prof):
    near = [point(batch=256 + i, loop=1.0, bmm=2.0) for i in range(NEIGHBOURS)]
    prof(*near, point(batch=1 << 20, loop=1000.0, bmm=1.0))
    entry_, _ = profile.load_entry("cpu", torch.float32)
    times, used = blended_times(Problem(300, 50, 10, 10), entry_)
    assert len(used) == NEIGHBOURS and all(m["batch"] < 1 << 20 for _, m in used)
    assert times["bmm"] / times["loop"] == pytest.approx(2.0)


def test_no_measurements_without_a_table_in_the_mode():
    assert nearest_measurements(Problem(1, 1, 1, 1), None) == []
    assert nearest_measurements(Problem(1, 1, 1, 1), {"measurements": [point(mode="train")]}) == []
    assert blended_times(Problem(1, 1, 1, 1), None) == ({}, [])


def test_unmeasured_backends_follow_the_fallback_order(prof):
    prof(point(mode="train", loop=1.0))  # nothing measured for forward
    plan = choose(Problem(256, 50, 10, 10))
    runnable = [c.name for c in plan.candidates if c.ok]
    order = [n for n in FALLBACK_ORDER["cpu"] if n in runnable]
    assert runnable[: len(order)] == order
    assert plan.backend == order[0]
    assert "preference order" in plan.reason


@pytest.mark.parametrize("why", ["dtype", "grad", "constraint", "device", "missing-package"])
def test_never_chooses_a_declining_backend(prof, fake_backend, why):
    kw = {
        "dtype": {"dtypes": {"cpu": frozenset({torch.float64})}},
        "grad": {"grad": False},
        "constraint": {"constraint": lambda p: "needs groups <= 8" if p.groups > 8 else None},
        "device": {"dtypes": {"fakedevice": FLOATS}},
        "missing-package": {"requires": "blockdiag_no_such_module_xyz"},
    }[why]
    fake_backend("fast_but_limited", **kw)
    prof(point(mode="train", fast_but_limited=0.001, loop=1.0, bmm=2.0))
    plan = choose(Problem(256, 50, 10, 10, requires_grad=True))
    assert plan.backend == "loop"
    declined = {c.name: c for c in plan.candidates if not c.ok}
    assert "fast_but_limited" in declined and declined["fast_but_limited"].note


def test_constraint_allows_where_it_holds(prof, fake_backend):
    fake_backend("small_only", constraint=lambda p: "needs groups <= 8" if p.groups > 8 else None)
    prof(point(groups=4, small_only=0.5, loop=1.0), point(groups=64, small_only=0.5, loop=1.0))
    assert choose(Problem(256, 4, 10, 10)).backend == "small_only"
    assert choose(Problem(256, 64, 10, 10)).backend == "loop"


def test_auto_never_picks_a_backend_of_reduced_precision_there(prof, fake_backend, tmp_path):
    # conv on CUDA float32 (cuDNN's TF32) was auto's choice at 32 inference shapes of the
    # built-in H200 table: a default layer 1e-3 off where nn.Linear is 1e-6 off.
    fake_backend("tf32ish", reduced_precision={"cpu": (frozenset({torch.float32}), "the reason")})
    prof(point(groups=4, tf32ish=0.5, loop=1.0))
    plan = choose(Problem(256, 4, 10, 10))
    assert plan.backend == "loop", str(plan)
    note = [c for c in plan.candidates if c.name == "tf32ish"][0].note
    assert note == "computes float32 with reduced precision on cpu (the reason)", note
    from blockdiag.backends import get

    conv = get("conv").reduced_precision
    assert torch.float32 in conv["cuda"][0] and "cpu" not in conv, conv
    with blockdiag.config(profile=str(tmp_path / "none.json")):  # the built-in H200 table
        for batch, groups, block in [(2048, 4, 256), (4096, 50, 64), (32, 4, 10)]:
            cuda = choose(Problem(batch, groups, block, block, torch.float32, "cuda"))
            assert cuda.backend not in ("conv", "bsr"), str(cuda)
        assert choose(Problem(2048, 4, 256, 256, torch.bfloat16, "cuda")).backend == "conv"  # the table's pick



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_half_dtype_without_its_table_ranks_the_upcasting_backend_first(fake_backend, monkeypatch, dtype):
    # The built-in (float32) table ranks a half problem from float32 times, which hold for a
    # backend that computes it in float32 and not for the half kernels of the others (bf16 on
    # a CPU without bf16 arithmetic: bmm_fm, auto's pick from the float32 times, was 10x and
    # more slower). "up", never measured, is the only backend declaring it upcasts here.
    monkeypatch.setitem(_registry._REGISTRY, "simd", dataclasses.replace(_registry.get("simd"), upcasts={}))
    fake_backend("up", upcasts={"cpu": frozenset({torch.bfloat16, torch.float16})})
    for train in (False, True):
        plan = choose(Problem(256, 4, 10, 10, dtype, requires_grad=train))
        assert plan.backend == "up" and plan.reason.startswith(dispatch.UPCAST_RULE), str(plan)
        assert f"the table has no {str(dtype)[6:]} entry, only float32 times; up casts" in plan.reason
    for other in (torch.float32, torch.float64):  # not upcast: ranked by the times
        assert choose(Problem(256, 4, 10, 10, other)).backend != "up"


def test_a_half_dtype_with_its_own_table_ranks_by_its_times(fake_backend):
    # blockdiag tune --dtype bfloat16 measured them all: the table decides.
    fake_backend("up", upcasts={"cpu": frozenset({torch.bfloat16})})
    write(Path(os.environ["BLOCKDIAG_PROFILE"]), entry([point(groups=4, up=3.0, loop=1.0)], dtype=torch.bfloat16))
    try:
        plan = choose(Problem(256, 4, 10, 10, torch.bfloat16))
    finally:
        profile.clear_cache()
    assert plan.backend == "loop" and dispatch.UPCAST_RULE not in plan.reason, str(plan)


def test_the_built_in_table_runs_bf16_on_cpu_in_simd():
    from blockdiag.backends import get

    if get("simd").unavailable_reason() is not None:
        pytest.skip(f"simd is unavailable here: {get('simd').unavailable_reason()}")
    for train in (False, True):
        for shape in [(256, 50, 10, 10), (2048, 4, 150, 10), (32, 16, 64, 64)]:
            plan = choose(Problem(*shape, torch.bfloat16, requires_grad=train))
            assert plan.backend == "simd", str(plan)
        # One group (GroupedMLP's shared first layer): F.linear would run in bfloat16 too.
        assert choose(Problem(256, 1, 150, 500, torch.bfloat16, requires_grad=train)).backend == "simd"
    assert choose(Problem(256, 1, 150, 500, torch.float32)).backend == "dense"


def test_sparse_backends_only_at_or_above_the_threshold(prof, fake_backend):
    fake_backend("fake_sparse", sparse=True)
    prof(point(groups=4, fake_sparse=0.5, loop=1.0), point(groups=16, fake_sparse=0.5, loop=1.0))
    # Default threshold 1.0: never.
    plan = choose(Problem(256, 16, 10, 10))
    assert plan.backend == "loop"
    assert "below sparsity_threshold=1.0" in [c for c in plan.candidates if c.name == "fake_sparse"][0].note
    with blockdiag.config(sparsity_threshold=0.9):
        assert choose(Problem(256, 4, 10, 10)).backend == "loop"  # sparsity 0.75 < 0.9
        assert choose(Problem(256, 16, 10, 10)).backend == "fake_sparse"  # 0.9375 >= 0.9
    with blockdiag.config(sparsity_threshold=0.75):
        assert choose(Problem(256, 4, 10, 10)).backend == "fake_sparse"  # equal counts as above


def test_dense_crossovers_exclude_dense(prof):
    prof(point(groups=4, dense=0.1, loop=1.0), settings={"dense_max_groups": 16})
    # dense does not isolate groups (a NaN in one group reaches all): auto considers it only
    # where the user set a dense crossover explicitly, not from a profile's value.
    assert choose(Problem(256, 4, 10, 10)).backend == "loop"
    with blockdiag.config(dense_max_groups=16):
        assert choose(Problem(256, 4, 10, 10)).backend == "dense"
    with blockdiag.config(dense_max_groups=2):
        plan = choose(Problem(256, 4, 10, 10))
        assert plan.backend == "loop"
        assert "groups=4 > dense_max_groups=2" in str(plan)
    with blockdiag.config(dense_max_elements=100):
        assert "dense_max_elements=100" in str(choose(Problem(256, 4, 10, 10)))


def test_threshold_precedence_reaches_the_plan(prof, monkeypatch):
    prof(point(loop=1.0), settings={"sparsity_threshold": 0.3})

    def src():
        return {k: (v, s) for k, v, s in choose(Problem(256, 50, 10, 10)).settings}["sparsity_threshold"]

    assert src() == (0.3, "tuning profile")
    monkeypatch.setenv("BLOCKDIAG_SPARSITY_THRESHOLD", "0.4")
    assert src() == (0.4, "$BLOCKDIAG_SPARSITY_THRESHOLD")
    blockdiag.set_sparsity_threshold(0.5)
    try:
        assert src() == (0.5, "set_config()")
        with blockdiag.config(sparsity_threshold=0.6):
            assert src() == (0.6, "blockdiag.config()")
        assert src() == (0.5, "set_config()")
    finally:
        blockdiag.set_sparsity_threshold(None)
    monkeypatch.delenv("BLOCKDIAG_SPARSITY_THRESHOLD")
    assert src() == (0.3, "tuning profile")


def test_default_without_profile_or_builtin(monkeypatch):
    monkeypatch.setattr(profile, "builtin_entry", lambda device, dtype: None)
    profile.clear_cache()
    plan = choose(Problem(3, 2, 5, 5, dtype=torch.float64))
    assert {k: s for k, _, s in plan.settings}["sparsity_threshold"] == "built-in default"
    assert "no measured table" in plan.reason
    profile.clear_cache()


def test_choose_is_cached_and_pure(prof):
    prof(point(loop=1.0, bmm=2.0))
    p = Problem(256, 50, 10, 10)
    assert choose(p) is choose(Problem(256, 50, 10, 10))
    with blockdiag.config(dense_max_groups=3):
        inside = choose(p)
        assert inside is choose(p)
    # Different settings in force: a different plan object, saying so.
    assert inside is not choose(p)
    assert ("dense_max_groups", 3, "blockdiag.config()") in inside.settings


def test_new_profile_is_seen_at_once(prof):
    prof(point(loop=1.0, bmm=2.0))
    assert choose(Problem(256, 50, 10, 10)).backend == "loop"
    e = entry([point(loop=2.0, bmm=1.0)])
    profile.save_entry(e)  # the default path: $BLOCKDIAG_PROFILE
    assert choose(Problem(256, 50, 10, 10)).backend == "bmm"


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "train"])
@pytest.mark.parametrize("name", names())
def test_every_registered_backend_runs_when_named(spy, name, grad):
    # Named explicitly, a backend is the one that runs (not the chooser's pick, nor a
    # backend with the same forward), and it computes the product; one that refuses the
    # problem says why instead.
    p = Problem(8, 4, 16, 16, torch.float32, "cpu", grad)
    why = _registry.get(name).decline_reason(p)
    if why is not None:
        assert _registry.get(name).unavailable_reason() is not None or "does not run on cpu" in why, why
        with pytest.raises(BlockDiagError, match=re.escape(why)):
            plan_for(name, p)
        return
    x = torch.randn(8, 64, requires_grad=grad)
    w = torch.randn(4, 16, 16, requires_grad=grad)
    b = torch.randn(64, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        y = blockdiag.grouped_linear(x, w, b, backend=name)
    assert spy == [name]
    xr, wr, br = (t.detach().clone().requires_grad_(grad) for t in (x, w, b))
    yr = reference_loop(xr, wr, br)
    torch.testing.assert_close(y, yr, **tolerances(torch.float32, 16))
    if grad:
        r = torch.randn_like(y)
        for a, e in zip(torch.autograd.grad((y * r).sum(), (x, w, b)),
                        torch.autograd.grad((yr * r).sum(), (xr, wr, br))):
            torch.testing.assert_close(a, e, **tolerances(torch.float32, 16))


def test_plan_for_rejects_unknown_and_declining(fake_backend):
    with pytest.raises(BlockDiagError, match="unknown backend 'nope'; valid names are 'auto', 'loop'"):
        plan_for("nope", Problem(8, 4, 4, 4))
    fake_backend("no_grad", grad=False)
    with pytest.raises(BlockDiagError, match="'no_grad' cannot run .* has no backward"):
        plan_for("no_grad", Problem(8, 4, 4, 4, requires_grad=True))


def test_grouped_linear_plan_is_choose(prof):
    prof(point(batch=8, groups=2, block_in=3, block_out=5, mode="train", bmm=1.0, loop=2.0))
    layer = blockdiag.GroupedLinear(6, 10, groups=2)
    plan = layer.plan(torch.randn(8, 6))
    assert plan is choose(Problem(8, 2, 3, 5, requires_grad=True))
    assert plan.backend == "bmm"


@pytest.fixture
def spy():
    """Record which backends actually run (wrapping each registered kernel)."""
    with backend_spy() as ran:
        yield ran


def test_forward_fast_path_follows_settings_profile_and_grad(prof, spy, monkeypatch):
    """The per-call memo of GroupedLinear / grouped_linear never runs a stale choice."""
    prof(point(batch=8, groups=2, block_in=3, block_out=5, loop=1.0, bmm=2.0),
         point(batch=8, groups=2, block_in=3, block_out=5, mode="train", bmm=1.0, loop=2.0))
    layer = blockdiag.GroupedLinear(6, 10, groups=2)
    x = torch.randn(8, 6)

    def runs(**kw):
        spy.clear()
        with torch.set_grad_enabled(kw.get("grad", False)):
            layer(x)
            blockdiag.grouped_linear(x, layer.weight, layer.bias)
        assert spy[0] == spy[1], spy
        return spy[0]

    assert runs() == "loop" and runs() == "loop"
    assert runs(grad=True) == "bmm"  # requires_grad flips the mode
    # a new profile on disk is seen at once
    write(profile.default_profile_path(),
          entry([point(batch=8, groups=2, block_in=3, block_out=5, loop=2.0, conv=1.0, csr=0.5)]))
    assert runs() == "conv"  # csr is faster but below the default threshold ("never")
    with blockdiag.config(sparsity_threshold=0.0):
        assert runs() == "csr"
    assert runs() == "conv"
    monkeypatch.setenv("BLOCKDIAG_SPARSITY_THRESHOLD", "0.5")
    assert runs() == "csr"
    monkeypatch.delenv("BLOCKDIAG_SPARSITY_THRESHOLD")
    assert runs() == "conv"
    monkeypatch.setenv("BLOCKDIAG_PROFILE", str(profile.default_profile_path()) + ".missing")
    profile.clear_cache()
    assert runs() == choose(Problem(8, 2, 3, 5)).backend != "conv"
    # a fixed backend bypasses the table, and switching it back to auto is immediate
    layer.backend = "dense"
    spy.clear()
    layer(x)
    assert spy == ["dense"]


def test_fast_path_sees_a_profile_rewritten_by_another_process(prof, spy, monkeypatch):
    # No clear_cache here, as when another process rewrites the file: only the entry's
    # expiry (profile.RECHECK_S, zero for the test) makes the layer look at the file again.
    path = prof(point(batch=8, groups=2, block_in=3, block_out=5, loop=1.0, bmm=2.0))
    layer = blockdiag.GroupedLinear(6, 10, groups=2)
    x = torch.randn(8, 6)
    monkeypatch.setattr(profile, "RECHECK_S", 0.0)
    with torch.no_grad():
        layer(x)
        assert spy[-1] == "loop"
        doc = json.loads(path.read_text())
        for e in doc["entries"].values():
            e["measurements"][0]["times_us"] = {"loop": 2.0, "bmm": 1.0}
        path.write_text(json.dumps(doc))
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        layer(x)
        assert spy[-1] == "bmm"


def test_fast_path_still_checks_new_shapes():
    layer = blockdiag.GroupedLinear(6, 10, groups=2)
    layer(torch.randn(4, 6))
    with pytest.raises(BlockDiagError, match=r"input has shape \(4, 7\)"):
        layer(torch.randn(4, 7))
    with pytest.raises(BlockDiagError, match=r"float64"):
        layer(torch.randn(4, 6, dtype=torch.float64))
    assert layer(torch.randn(2, 3, 6)).shape == (2, 3, 10)


def test_forward_duplicate_is_ranked_only_in_training(prof):
    # bmm_fm_loop runs bmm_fm's forward: without autograd it must not compete with itself.
    prof(point(bmm_fm=20.0, bmm_fm_loop=10.0, bmm=30.0),
         point(mode="train", bmm_fm=20.0, bmm_fm_loop=10.0, bmm=30.0))
    fwd = choose(Problem(256, 50, 10, 10))
    assert fwd.backend == "bmm_fm"
    (c,) = [c for c in fwd.candidates if c.name == "bmm_fm_loop"]
    assert not c.ok and "without autograd it is bmm_fm's forward" in c.note
    assert choose(Problem(256, 50, 10, 10, requires_grad=True)).backend == "bmm_fm_loop"


def test_forward_duplicate_forced_by_name_still_runs(spy):
    # Without autograd bmm_fm_loop is bmm_fm's forward, but named, it is what runs.
    x, w, b = torch.randn(8, 12), torch.randn(3, 2, 4, requires_grad=True), torch.randn(6)
    with torch.no_grad():
        y = blockdiag.grouped_linear(x, w, b, backend="bmm_fm_loop")
    assert spy == ["bmm_fm_loop"]
    assert not y.requires_grad
    torch.testing.assert_close(y, reference_loop(x, w.detach(), b))


def test_tune_skips_a_forward_duplicate_in_forward_mode():
    from blockdiag.tuning import _runnable

    ok, skipped = _runnable(Problem(32, 4, 10, 10), None)
    assert "bmm_fm" in ok and "bmm_fm_loop" not in ok
    assert "without autograd" in skipped["bmm_fm_loop"]
    ok, _ = _runnable(Problem(32, 4, 10, 10, requires_grad=True), None)
    assert "bmm_fm_loop" in ok


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("shape", [(256, 50, 10, 10), (32, 4, 10, 10), (8, 256, 64, 64), (2048, 1, 150, 10)])
def test_candidates_are_what_choose_ranks(shape, requires_grad):
    # One filter: the plan's runnable candidates are exactly candidates(), in the same
    # set, and exclusions() gives each declined candidate's note.
    p = Problem(*shape, requires_grad=requires_grad)
    plan = choose(p)
    ok = dispatch.candidates(p)
    assert sorted(c.name for c in plan.candidates if c.ok) == sorted(ok)
    assert plan.backend in ok
    assert ok == [n for n in _registry.names() if n in ok]  # registration order
    assert dispatch.exclusions(p) == {c.name: c.note for c in plan.candidates if not c.ok}


def test_candidates_follow_the_settings_and_a_given_table():
    p = Problem(256, 50, 10, 10)
    assert "csr" not in dispatch.candidates(p)
    with blockdiag.config(sparsity_threshold=0.5):
        assert "csr" in dispatch.candidates(p)
    assert "csr" in dispatch.candidates(p, table={"settings": {"sparsity_threshold": 0.5}})
    # Without the crossovers: what tune times (the forward-only duplicate still left out).
    free = dispatch.candidates(p, crossovers=False)
    assert "csr" in free and "dense" in free and "bmm_fm_loop" not in free
    assert dispatch.candidates(p, ["bmm", "loop"]) == ["bmm", "loop"]
    with pytest.raises(BlockDiagError, match="candidates: unknown backend 'nope'"):
        dispatch.candidates(p, ["nope"])


def test_the_double_backward_hint_is_derived_from_the_registry(monkeypatch):
    from blockdiag.backends._registry import double_grad_backends, double_grad_hint

    declared = [n for n in _registry.names() if _registry.get(n).double_grad and _registry.get(n).grad]
    assert double_grad_backends() == declared
    assert double_grad_hint().endswith("or name one: " + ", ".join(map(repr, declared)))
    assert "double_backward=True" in double_grad_hint()
    assert "'csr'" not in double_grad_hint()
    assert double_grad_hint("tpu") == "no registered backend for tpu has a double backward"
    assert double_grad_backends("cuda") == [n for n in declared if "cuda" in _registry.get(n).dtypes]
    extra = dataclasses.replace(_registry.get("loop"), name="my_double")
    _registry.register(extra)
    try:
        assert "'my_double'" in double_grad_hint("cpu")
    finally:
        _registry.unregister("my_double")


def test_double_backward_keeps_auto_on_backends_with_a_double_backward(prof):
    # A table in which csr (first-order backward only) is the fastest, in both modes.
    times = dict(csr=1.0, loop=5.0, bmm=6.0)
    prof(point(batch=4, groups=4, block_in=3, block_out=2, **times),
         point(mode="train", batch=4, groups=4, block_in=3, block_out=2, **times),
         settings={"sparsity_threshold": 0.0})
    train, fwd = Problem(4, 4, 3, 2, requires_grad=True), Problem(4, 4, 3, 2)
    assert choose(train).backend == "csr"
    assert "double_backward" not in {k for k, _, _ in choose(train).settings}  # listed only where set
    x = torch.randn(4, 12, requires_grad=True)
    layer = blockdiag.GroupedLinear(12, 8, groups=4)
    with pytest.raises(BlockDiagError, match="csr: the backward is first-order only"):
        torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    with blockdiag.config(double_backward=True):
        plan = choose(train)
        assert plan.backend == "loop" and _registry.get(plan.backend).double_grad
        assert ("double_backward", True, "blockdiag.config()") in plan.settings
        assert "csr" not in dispatch.candidates(train)
        assert dispatch.exclusions(train)["csr"] == (
            "its backward is first-order only (double_grad=False), and double_backward is set")
        assert all(_registry.get(n).double_grad for n in dispatch.candidates(train))
        assert choose(fwd).backend == "csr"  # a forward has no backward to differentiate
        assert "csr" in dispatch.candidates(train, crossovers=False)  # tune still times it
        (gx,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
        gx.sum().backward()
    torch.testing.assert_close(layer.weight.grad, torch.autograd.grad(
        torch.autograd.grad(reference_loop(x, layer.weight, layer.bias).square().sum(), x, create_graph=True)[0].sum(),
        layer.weight)[0])


def test_same_forward_as_must_name_a_registered_backend():
    bad = dataclasses.replace(_registry.get("loop"), name="orphan", same_forward_as="nope")
    with pytest.raises(BlockDiagError, match=r"'orphan' declares same_forward_as='nope', which is not registered"):
        _registry.register(bad)
    assert "orphan" not in names()


_sizes = st.sampled_from([1, 2, 3, 8, 10, 32, 64, 150, 256, 2048])
_shape = st.tuples(_sizes, _sizes, _sizes, _sizes)


@settings(max_examples=200, deadline=None)
@given(
    shapes=st.lists(_shape, min_size=1, max_size=9, unique=True),
    times=st.lists(st.tuples(st.floats(0.01, 1e4), st.floats(0.01, 1e4)), min_size=9, max_size=9),
    problem=_shape,
)
def test_blend_stays_within_what_the_neighbours_measured(shapes, times, problem):
    # In log space the blend is a weighted mean: the estimated ratio between two backends
    # lies between the smallest and largest ratio measured at the neighbours used, and an
    # exactly measured shape returns its own times.
    ms = [
        {"mode": "forward", "batch": b, "groups": g, "block_in": i, "block_out": o,
         "times_us": {"loop": t[0], "bmm": t[1]}}
        for (b, g, i, o), t in zip(shapes, times)
    ]
    p = Problem(*problem)
    est, used = blended_times(p, {"measurements": ms})
    assert 1 <= len(used) <= NEIGHBOURS
    ratios = [m["times_us"]["bmm"] / m["times_us"]["loop"] for _, m in used]
    r = est["bmm"] / est["loop"]
    assert min(ratios) * (1 - 1e-9) <= r <= max(ratios) * (1 + 1e-9)
    if problem in shapes:
        assert est == ms[shapes.index(problem)]["times_us"]


def test_empty_shapes_rank_without_error(prof):
    # A profile may hold a measurement of an empty batch (the format allows sizes >= 0),
    # and an empty input is planned too: no log of zero FLOPs.
    prof(point(batch=0, loop=1.0, bmm=2.0), point(batch=64, loop=2.0, bmm=1.0))
    assert choose(Problem(0, 50, 10, 10)).backend == "loop"
    assert choose(Problem(32, 50, 10, 10)).backend in ("loop", "bmm")


# ------------------------------------------------------------------ one group


@pytest.mark.parametrize("train", [False, True], ids=["forward", "train"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_one_group_runs_the_plain_gemm(train, dtype):
    # (bfloat16: the upcast rule comes first, test_the_built_in_table_runs_bf16_on_cpu_in_simd.)
    # The built-in table measured grouped shapes only; its neighbours rank the layout
    # shuffles around the one GEMM, and its crossovers keep dense off for the groups' sake.
    plan = choose(Problem(1024, 1, 150, 500, dtype, requires_grad=train))
    assert plan.backend == "dense" and plan.reason == dispatch.ONE_GROUP_RULE
    chosen = next(c for c in plan.candidates if c.name == "dense")
    fastest = min(c.estimate_us for c in plan.candidates if c.ok and c.estimate_us is not None)
    assert chosen.estimate_us == fastest and "one-group rule" in chosen.note
    assert "one group" in str(plan)
    # Two groups: the table ranks again, and the crossovers keep dense out.
    two = choose(Problem(1024, 2, 150, 500, dtype, requires_grad=train))
    assert two.backend != "dense" and two.reason != dispatch.ONE_GROUP_RULE


def test_one_group_follows_a_table_that_measured_one_group(prof):
    prof(point(groups=1, block_in=150, block_out=500, bmm=5.0, loop=9.0, dense=7.0))
    plan = choose(Problem(256, 1, 150, 500))
    assert plan.backend == "bmm" and "measured at this shape" in plan.reason


def test_one_group_without_a_dense_backend_ranks_by_the_table(monkeypatch):
    # Replaced in place (a deletion would move 'dense' to the registry's end when undone).
    monkeypatch.setitem(_registry._REGISTRY, "dense", dataclasses.replace(_registry.get("dense"), dense_matrix=False))
    plan = choose(Problem(1024, 1, 150, 500))
    assert plan.backend != "dense" and plan.reason != dispatch.ONE_GROUP_RULE


# ------------------------------------------------------------------ one input per group


@pytest.mark.parametrize("train", [False, True], ids=["forward", "train"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_one_input_per_group_ranks_by_the_preference_order(train, dtype):
    # The built-in table measured blocks of 10 inputs and more: its neighbours rank GEMMs
    # that reduce, which do not carry over to an outer product (k = 1); blended, they handed
    # 256 rows of 64 groups of 1x64 to bmm_fm in forward.
    plan = choose(Problem(256, 64, 1, 64, dtype, requires_grad=train))
    runnable = [c.name for c in plan.candidates if c.ok]
    order = [n for n in FALLBACK_ORDER["cpu"] if n in runnable]
    assert plan.backend == order[0] and runnable[: len(order)] == order
    assert "one input per group" in plan.reason and not plan.neighbours
    assert all(c.estimate_us is None for c in plan.candidates if c.ok)
    # Two inputs per group: the table ranks again.
    assert "one input per group" not in choose(Problem(256, 64, 2, 64, dtype, requires_grad=train)).reason


def test_one_input_per_group_keeps_the_blend_on_cuda():
    # Every backend of CUDA's preference order is a GEMM: the rule would trade one for another.
    plan = choose(Problem(256, 64, 1, 64, torch.float32, device="cuda"))
    assert "one input per group" not in plan.reason


def test_one_input_per_group_follows_a_table_that_measured_it(prof):
    prof(point(batch=256, groups=64, block_in=1, block_out=64, bmm=5.0, loop=9.0),
         point(batch=256, groups=64, block_in=10, block_out=64, bmm=9.0, loop=5.0))
    assert choose(Problem(256, 64, 1, 64)).backend == "bmm"
    plan = choose(Problem(512, 32, 1, 32))
    assert "one input per group" not in plan.reason and plan.neighbours
    # Measured in the other mode only: the rule still applies to this one.
    assert choose(Problem(256, 64, 1, 64, requires_grad=True)).reason == dispatch.ONE_INPUT_RULE


def test_one_group_auto_matches_the_reference():
    torch.manual_seed(0)
    layer = blockdiag.GroupedLinear(20, 30, groups=1, dtype=torch.float64)
    x = torch.randn(7, 20, dtype=torch.float64, requires_grad=True)
    assert layer.plan(x).backend == "dense"
    y = layer(x)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight[0], layer.bias))
    y.sum().backward()
    assert layer.weight.grad.shape == layer.weight.shape


@pytest.fixture(autouse=True)
def _no_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDIAG_PROFILE", str(tmp_path / "profile.json"))
    blockdiag.profile.clear_cache()


def test_dense_max_groups_is_inclusive():
    # "the dense block-diagonal GEMM is a candidate only up to this many groups"
    p = Problem(256, 4, 10, 10)
    with blockdiag.config(dense_max_groups=4, dense_max_elements=10**9):
        assert "dense" in candidates(p)
    with blockdiag.config(dense_max_groups=3, dense_max_elements=10**9):
        assert "dense" not in candidates(p)


def test_dense_max_elements_is_inclusive():
    p = Problem(256, 4, 10, 10)
    assert p.dense_elements == 1600
    with blockdiag.config(dense_max_groups=64, dense_max_elements=1600):
        assert "dense" in candidates(p)
    with blockdiag.config(dense_max_groups=64, dense_max_elements=1599):
        assert "dense" not in candidates(p)
