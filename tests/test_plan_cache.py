"""One plan cache keyed by (backend, Problem, epoch), and one epoch every mutator moves."""

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import blockdiag
from blockdiag import BlockDiagError, Problem, choose, dispatch, profile
from blockdiag import settings as st
from blockdiag.backends import _registry
from blockdiag.dispatch import cached_plan, epoch

from _params import backend_spy
from _profiles import entry, point, write

P = Problem(8, 2, 3, 5)  # forward, the shape the small layers below run
SHAPE = dict(batch=8, groups=2, block_in=3, block_out=5)


@pytest.fixture
def prof(tmp_path):
    """Write a profile at $BLOCKDIAG_PROFILE (the conftest points it into tmp_path)."""
    path = tmp_path / "profile.json"
    assert os.environ["BLOCKDIAG_PROFILE"] == str(path)

    def make(**times):
        return write(path, entry([point(**SHAPE, **times)]))

    yield make
    profile.clear_cache()


@pytest.fixture
def recheck_every(monkeypatch):
    """Set profile.RECHECK_S for the test; the next epoch() call looks at the files at once."""

    def set_(seconds):
        monkeypatch.setattr(profile, "RECHECK_S", seconds)
        st.bump_epoch()  # resets the deadline computed with the old RECHECK_S
        epoch()

    yield set_
    st.bump_epoch()  # the next test's first call looks again, under the usual RECHECK_S


def _declines(b, why="declines for the test"):
    return dataclasses.replace(b, constraint=lambda p: why)


def test_every_mutator_moves_the_epoch(monkeypatch, tmp_path):
    seen = [epoch()]

    def moved():
        seen.append(epoch())
        assert seen[-1] != seen[-2]

    blockdiag.set_config(dense_max_groups=3)
    moved()
    blockdiag.set_config(dense_max_groups=None)
    moved()
    before = epoch()
    with blockdiag.config(sparsity_threshold=0.5):
        moved()
    assert epoch() == before  # left the block: the state, and the epoch, of before it
    monkeypatch.setenv("BLOCKDIAG_DENSE_MAX_ELEMENTS", "7")
    moved()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    moved()
    profile.save_entry(entry([point(bmm=1.0)]))
    moved()
    profile.clear_cache()
    moved()
    loop = _registry.get("loop")
    monkeypatch.setitem(_registry._REGISTRY, "loop", dataclasses.replace(loop))  # as tests' spies do
    moved()
    assert _registry.replace(loop) is not loop
    moved()
    _registry.register(dataclasses.replace(loop, name="loop_again"))
    moved()
    _registry.unregister("loop_again")
    moved()


def test_equal_states_share_an_epoch():
    # Re-entering the same config block (once per step, say) finds the plans cached the
    # first time; an unchanged state reads the same epoch.
    assert epoch() == epoch()
    with blockdiag.config(dense_max_groups=3, sparsity_threshold=0.5):
        inside = epoch()
        plan = choose(P)
    with blockdiag.config(sparsity_threshold=0.5, dense_max_groups=3):
        assert epoch() == inside
        assert choose(P) is plan
    with blockdiag.config(dense_max_groups=4, sparsity_threshold=0.5):
        assert epoch() != inside


def test_choose_plan_for_and_cached_plan_share_one_cache(prof):
    prof(loop=1.0, bmm=2.0)
    assert cached_plan("auto", P) is choose(P) is dispatch.plan_for("auto", P)
    fixed = cached_plan("bmm", P)
    assert fixed.backend == "bmm" and fixed is dispatch.plan_for("bmm", P)
    auto = choose(P)
    # A generation bump drops every plan of past generations at the next store, also where
    # the settings end up as they were.
    blockdiag.set_config(dense_max_groups=3)
    blockdiag.set_config(dense_max_groups=None)
    again = choose(P)
    assert again is not auto and again.backend == auto.backend
    assert all(k[2][0] == st.generation for k in dispatch._cache)


@pytest.mark.parametrize("how", ["replace", "setitem", "unregister"])
def test_a_backend_re_registered_under_its_name_reaches_auto(prof, how):
    # The case: len(_REGISTRY) did not change, so the layer's memo kept running a
    # backend that now declines the problem.
    prof(loop=1.0, bmm=2.0)
    layer = blockdiag.GroupedLinear(6, 10, groups=2)
    x = torch.randn(8, 6)
    with backend_spy() as ran, torch.no_grad():
        layer(x)
        assert ran[-1] == "loop" and choose(P).backend == "loop"
        loop = _registry.get("loop")
        order = list(_registry._REGISTRY.items())
        m = pytest.MonkeyPatch()
        if how == "replace":
            old = _registry.replace(_declines(loop))
            assert old is loop
        elif how == "setitem":
            m.setitem(_registry._REGISTRY, "loop", _declines(loop))
        else:
            # loop stays the last resort for the problems only it accepts; unregistering
            # it here is safe for this shape.
            _registry.unregister("loop")
        try:
            layer(x)
            assert ran[-1] == "bmm" and choose(P).backend == "bmm"
        finally:
            m.undo()
            if how == "replace":
                _registry.replace(old)
            elif how == "unregister":
                _registry._REGISTRY.clear()  # back in its place in the registration order
                _registry._REGISTRY.update(order)
        layer(x)
        assert ran[-1] == "loop"


def test_a_named_backend_replaced_by_one_that_declines_is_refused(monkeypatch):
    x, w = torch.randn(8, 6), torch.randn(2, 5, 3)
    blockdiag.grouped_linear(x, w, backend="bmm")  # memoized as valid
    monkeypatch.setitem(_registry._REGISTRY, "bmm", _declines(_registry.get("bmm"), "no longer runs this"))
    with pytest.raises(BlockDiagError, match="backend 'bmm' cannot run .*: no longer runs this"):
        blockdiag.grouped_linear(x, w, backend="bmm")


def test_registry_replace_and_unregister_refuse_what_register_would():
    with pytest.raises(BlockDiagError, match="replace: unknown backend 'nope'"):
        _registry.replace(dataclasses.replace(_registry.get("loop"), name="nope"))
    with pytest.raises(BlockDiagError, match="unregister: unknown backend 'nope'"):
        _registry.unregister("nope")
    with pytest.raises(BlockDiagError, match="'bmm_fm_loop', 'bmm_fm_bmm' declare same_forward_as='bmm_fm'"):
        _registry.unregister("bmm_fm")
    bad = dataclasses.replace(_registry.get("bmm_fm_bmm"), same_forward_as="missing")
    with pytest.raises(BlockDiagError, match="replace: 'bmm_fm_bmm' declares same_forward_as='missing'"):
        _registry.replace(bad)
    assert _registry.get("bmm_fm_bmm").same_forward_as == "bmm_fm"
    with pytest.raises(BlockDiagError, match="already registered"):
        _registry.register(_registry.get("loop"))


def test_the_registry_keeps_its_order_and_every_mutation_bumps():
    names = _registry.names()
    g = st.generation
    loop = _registry.get("loop")
    _registry.replace(loop)
    assert _registry.names() == names and st.generation != g
    r = _registry._REGISTRY
    for mutate in (lambda: r.update(loop=loop), lambda: r.setdefault("loop", loop), lambda: r.__ior__({"loop": loop})):
        g = st.generation
        mutate()
        assert st.generation != g
    assert _registry.names() == names


def test_a_profile_rewritten_by_another_process_is_followed(prof, recheck_every):
    path = prof(loop=1.0, bmm=2.0)
    recheck_every(0.05)
    layer = blockdiag.GroupedLinear(6, 10, groups=2)
    x = torch.randn(8, 6)
    with backend_spy() as ran, torch.no_grad():
        layer(x)
        assert ran[-1] == "loop"
        doc = json.loads(path.read_text())
        for e in doc["entries"].values():
            e["measurements"][0]["times_us"] = {"loop": 2.0, "bmm": 1.0}
        # Another process: nothing in this one hears of it (no clear_cache, no save_entry).
        # The same size as before: the change shows in the mtime (and here the inode).
        code = "import os, sys; open(sys.argv[1] + '.tmp', 'w').write(sys.argv[2]); os.replace(sys.argv[1] + '.tmp', sys.argv[1])"
        subprocess.run([sys.executable, "-c", code, str(path), json.dumps(doc)], check=True)
        time.sleep(0.1)
        layer(x)
        assert ran[-1] == "bmm"
        assert choose(P).backend == "bmm"


def test_a_profile_that_appears_later_is_followed(tmp_path, recheck_every):
    path = tmp_path / "profile.json"
    assert not path.exists()
    recheck_every(0.05)
    before = choose(P)
    assert before.source == profile.BUILTIN_SOURCE
    doc = {"format": profile.FORMAT, "version": profile.VERSION, "entries": {}}
    e = entry([point(**SHAPE, loop=1.0, conv=0.5)])
    doc["entries"][f"{e['device_name']}|{e['torch']}|{e['dtype']}"] = e
    path.write_text(json.dumps(doc))  # no clear_cache: as if written elsewhere
    time.sleep(0.1)
    plan = choose(P)
    assert plan.source.startswith("tuning profile") and plan.backend == "conv"


def test_the_thread_count_is_followed(recheck_every):
    threads = torch.get_num_threads()
    recheck_every(0.0)
    before = epoch()
    try:
        torch.set_num_threads(threads + 1)
        assert epoch() != before
    finally:
        torch.set_num_threads(threads)


def test_the_hit_path_looks_at_no_file(prof, monkeypatch, recheck_every):
    # Between two looks (RECHECK_S apart) auto's per-call path costs no system call.
    prof(loop=1.0, bmm=2.0)
    recheck_every(3600.0)
    layer = blockdiag.GroupedLinear(6, 10, groups=2)
    x = torch.randn(8, 6)
    with torch.no_grad():
        layer(x)
        choose(P)
        stats = []
        real = os.stat
        monkeypatch.setattr(os, "stat", lambda *a, **k: stats.append(a) or real(*a, **k))
        for _ in range(200):
            layer(x)
            blockdiag.grouped_linear(x, layer.weight, layer.bias)
            choose(P)
    assert stats == []


def test_a_plan_whose_epoch_moved_while_planning_is_not_kept(monkeypatch):
    # A backend whose shape rule changes a setting: every plan is made in two epochs.
    def rule(p):
        st.bump_epoch()
        return None

    b = dataclasses.replace(_registry.get("bmm"), name="bumper", constraint=rule)
    monkeypatch.setitem(_registry._REGISTRY, "bumper", b)
    assert choose(P) is not choose(P)
    monkeypatch.delitem(_registry._REGISTRY, "bumper")
    assert choose(P) is choose(P)


def test_choose_from_many_threads_each_with_its_own_config(prof):
    # csr wins where sparse layouts are allowed; a thread outside config(sparsity_threshold=0)
    # must never get it, one inside always, while another thread moves the epoch.
    prof(csr=1.0, loop=2.0, bmm=3.0)
    errors, barrier = [], threading.Barrier(6)

    def work(k):
        try:
            barrier.wait()
            for i in range(300):
                if (k + i) % 2:
                    with blockdiag.config(sparsity_threshold=0.0):
                        assert choose(P).backend == "csr"
                else:
                    assert choose(P).backend == "loop"
                if i % 50 == 0 and k == 0:
                    blockdiag.set_config(dense_max_groups=16)  # a bump seen by all threads
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        blockdiag.set_config(dense_max_groups=None)
    assert errors == []


def test_the_old_names_read_the_one_epoch():
    # Memos written before the epoch (keyed on settings.token(), checking
    # profile.generation) keep working: the token is the epoch.
    assert st.token is st.epoch
    assert profile.generation == 0


@pytest.mark.parametrize("how", ["pop", "popitem"])
def test_a_backend_popped_from_the_registry_is_no_longer_planned(how):
    loop = _registry.get("loop")
    _registry.register(dataclasses.replace(loop, name="loop_popped"))  # the last entry
    try:
        p = Problem(8, 2, 3, 3)
        assert cached_plan("loop_popped", p).backend == "loop_popped"  # now cached
        g = st.generation
        if how == "pop":
            _registry._REGISTRY.pop("loop_popped")
        else:
            assert _registry._REGISTRY.popitem()[0] == "loop_popped"
        assert st.generation != g
        with pytest.raises(BlockDiagError, match="loop_popped"):
            cached_plan("loop_popped", p)  # a stale plan would name the removed backend
    finally:
        if "loop_popped" in _registry.names():
            _registry.unregister("loop_popped")


def test_the_thread_count_is_followed_at_once_between_file_looks(monkeypatch):
    # The profile has an entry per thread count, so a change must move the epoch on the next
    # call, not only at the next periodic look at the files (RECHECK_S): here an hour away.
    import torch

    from blockdiag import profile

    monkeypatch.setattr(profile, "RECHECK_S", 3600.0)
    st.bump_epoch()
    st.epoch()  # looks now; the next periodic look is an hour away
    threads = torch.get_num_threads()
    before = st.epoch()
    try:
        torch.set_num_threads(threads + 1)
        assert st.epoch() != before
    finally:
        torch.set_num_threads(threads)
        st.bump_epoch()


@pytest.mark.parametrize("backend", ["auto", "loop"])
def test_a_layer_selection_whose_epoch_moved_while_planning_is_not_kept(monkeypatch, backend):
    # nn.linear._select memoises the backend name per (operands, epoch); a plan made while the
    # epoch moved (another thread's set_config, register, profile write) may be of the old state
    # and must not be kept under the new epoch (as cached_plan does for its own cache).
    import torch

    from blockdiag.nn import linear

    real = linear.plan_for

    def moving(*a, **k):
        plan = real(*a, **k)
        st.bump_epoch()  # the state moves while this call plans
        return plan

    monkeypatch.setattr(linear, "plan_for", moving)
    linear._SELECTED.clear()
    linear._select("GroupedLinear", backend, torch.randn(3, 4), torch.randn(2, 2, 2), None)
    assert linear._SELECTED == {}


def test_the_compiled_ops_choice_made_while_the_epoch_moved_is_not_kept(monkeypatch):
    # blockdiag::auto (compiled graphs with a dynamic batch, exported programs, jit.trace)
    # memoises its backend per (rows, weight, ..., epoch). A plan made while another thread
    # changed a setting's environment variable is of the new value; kept under the old key,
    # it came back once the variable was set back, where auto plans under the old value.
    import torch

    from blockdiag.ops import auto as auto_op

    var = "BLOCKDIAG_DENSE_MAX_GROUPS"
    monkeypatch.delenv(var, raising=False)
    real, calls = dispatch.choose, []

    def moving(p):
        calls.append(os.environ.get(var))
        if len(calls) == 1:
            os.environ[var] = "0"  # another thread, while this one plans
        return real(p)

    monkeypatch.setattr(dispatch, "choose", moving)
    monkeypatch.setattr(auto_op, "_CHOICE", {})
    x, w = torch.randn(8, 6), torch.randn(2, 5, 3)
    auto_op.choice(x, w, False)
    os.environ.pop(var)  # set back: the first call's key again
    auto_op.choice(x, w, False)
    assert calls == [None, None], f"the second call planned with {calls[1:]!r} or not at all"


def test_threads_whose_counts_differ_do_not_move_the_epoch_when_switching():
    # Under OpenMP torch.set_num_threads sets the calling thread's count only (and that of
    # threads whose first torch call comes later): a thread that called torch earlier keeps
    # its count. Calls alternating between two such threads changed nothing, yet each switch
    # bumped the generation (a process-wide "count last seen"): every plan made again.
    threads = torch.get_num_threads()
    ready, asked, answered = threading.Event(), threading.Event(), threading.Event()
    out = {}

    def other():
        torch.get_num_threads()  # its first torch call: its count is fixed here
        ready.set()
        for _ in range(5):
            asked.wait()
            asked.clear()
            out.setdefault("threads", torch.get_num_threads())
            out.setdefault("epochs", []).append(epoch())
            answered.set()

    t = threading.Thread(target=other)
    t.start()
    ready.wait()
    torch.set_num_threads(threads + 1)
    try:
        mine = []
        for _ in range(5):
            mine.append(epoch())
            asked.set()
            assert answered.wait(30)
            answered.clear()
        t.join(30)
        if out["threads"] == torch.get_num_threads():
            pytest.skip("this torch's thread count is process-wide: the threads cannot differ")
        assert len(set(mine)) == 1 and len(set(out["epochs"])) == 1
        assert mine[0] != out["epochs"][0]  # each thread's plans are its own count's
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("operand", ["input", "weight", "bias", "input-no-bias", "weight-no-bias"])
@pytest.mark.parametrize("backend", ["auto", "loop"])
def test_an_operand_of_another_dtype_after_a_cached_call_is_still_refused(backend, operand):
    # The layers' per-call memo (nn.linear._select) skips the operand checks on a hit, so its
    # key (one tuple with a bias, one without) must hold every operand's dtype: a key without
    # one let a float64 operand of a cached shape skip them and reach a kernel, which
    # refused it in its own words (torch's matmul's, for loop).
    x, w = torch.randn(3, 4), torch.randn(2, 3, 2)
    b = None if operand.endswith("no-bias") else torch.randn(6)
    blockdiag.grouped_linear(x, w, b, backend=backend)  # remembered
    bad, pattern = {
        "input": ((x.double(), w, b), r"weight has dtype torch\.float32 but input has dtype torch\.float64"),
        "weight": ((x, w.double(), b), r"weight has dtype torch\.float64 but input has dtype torch\.float32"),
        "bias": ((x, w, b), r"bias has dtype torch\.float64 but input has dtype torch\.float32"),
    }[operand.replace("-no-bias", "")]
    if operand == "bias":
        bad = (x, w, b.double())
    with pytest.raises(BlockDiagError, match=pattern):
        blockdiag.grouped_linear(*bad, backend=backend)


def test_a_change_of_this_threads_count_moves_the_generation(recheck_every):
    # Graphs compiled with a plan inlined are guarded on the generation (nn.linear's
    # _compile_guard), not on the epoch's thread count: a change of the calling thread's own
    # count must bump it, or such a graph keeps the plan of the old count.
    threads = torch.get_num_threads()
    recheck_every(3600.0)
    epoch()
    before = st.generation
    try:
        torch.set_num_threads(threads + 1)
        epoch()
        assert st.generation != before
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", ["auto", "simd"])
def test_a_training_step_plans_once_and_looks_at_no_file(monkeypatch, recheck_every, backend):
    # Training steps through auto cost what the chosen backend costs plus the hit path: after
    # the first step no call plans again (a re-plan per call costs several times a small
    # product's forward and backward) and none stats a file between two looks.
    if backend == "simd" and blockdiag.backends.get("simd").decline_reason(Problem(32, 4, 16, 16)):
        pytest.skip("simd does not run here")
    recheck_every(3600.0)
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(4, 16, 16, requires_grad=True)
    b = torch.randn(64, requires_grad=True)
    gy = torch.randn(32, 64)

    def step():
        blockdiag.grouped_linear(x, w, b, backend=backend).backward(gy)
        x.grad = w.grad = b.grad = None

    step()
    step()
    plans, stats = [], []
    real_plan, real_stat = dispatch._auto_plan, os.stat
    monkeypatch.setattr(dispatch, "_auto_plan", lambda *a, **k: plans.append(a) or real_plan(*a, **k))
    monkeypatch.setattr(os, "stat", lambda *a, **k: stats.append(a) or real_stat(*a, **k))
    gen = st.generation
    for _ in range(50):
        step()
    assert (plans, stats, st.generation) == ([], [], gen)
