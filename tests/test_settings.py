"""Settings: validation, precedence (config > set_* > env > profile > default), scoping."""

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import blockdiag
from blockdiag import BlockDiagError
from blockdiag import settings as st


@pytest.fixture(autouse=True)
def _reset_globals():
    yield
    blockdiag.set_config(sparsity_threshold=None, dense_max_groups=None, dense_max_elements=None, double_backward=None)


@pytest.mark.parametrize(
    "bad, rule",
    [(-0.1, r"must lie in \[0, 1\]"), (1.5, r"must lie in \[0, 1\]"), ("abc", r"must be a float")],
    ids=["negative", "above-one", "not-a-number"],
)
def test_threshold_out_of_range_names_the_value(bad, rule):
    # The whole message: who raised it, the setting, the rule broken and the value given.
    value = re.escape(repr(bad))
    with pytest.raises(BlockDiagError, match=rf"^set_sparsity_threshold: sparsity_threshold {rule}, got {value}$"):
        blockdiag.set_sparsity_threshold(bad)
    with pytest.raises(BlockDiagError, match=rf"^set_config: sparsity_threshold {rule}, got {value}$"):
        blockdiag.set_config(sparsity_threshold=bad)
    with pytest.raises(BlockDiagError, match=rf"^config: sparsity_threshold {rule}, got {value}$"):
        with blockdiag.config(sparsity_threshold=bad):
            pass


def test_unknown_setting_lists_the_valid_ones():
    with pytest.raises(BlockDiagError, match="unknown setting 'sparsity'.*sparsity_threshold"):
        blockdiag.set_config(sparsity=0.5)


def test_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("BLOCKDIAG_SPARSITY_THRESHOLD", "lots")
    with pytest.raises(BlockDiagError, match="BLOCKDIAG_SPARSITY_THRESHOLD"):
        blockdiag.get_settings()
    monkeypatch.setenv("BLOCKDIAG_SPARSITY_THRESHOLD", "2")
    with pytest.raises(BlockDiagError, match=r"must lie in \[0, 1\], got 2.0"):
        blockdiag.get_settings()


def test_precedence_each_level(monkeypatch):
    assert st.resolve("sparsity_threshold") == (1.0, "built-in default")
    assert st.resolve("sparsity_threshold", 0.2) == (0.2, "tuning profile")
    monkeypatch.setenv("BLOCKDIAG_SPARSITY_THRESHOLD", "0.3")
    assert st.resolve("sparsity_threshold", 0.2) == (0.3, "$BLOCKDIAG_SPARSITY_THRESHOLD")
    blockdiag.set_sparsity_threshold(0.4)
    assert st.resolve("sparsity_threshold", 0.2) == (0.4, "set_config()")
    with blockdiag.config(sparsity_threshold=0.5):
        assert st.resolve("sparsity_threshold", 0.2) == (0.5, "blockdiag.config()")
        with blockdiag.config(sparsity_threshold=0.6):
            assert blockdiag.get_settings().sparsity_threshold == 0.6
        assert blockdiag.get_settings().sparsity_threshold == 0.5
    assert blockdiag.get_settings().sparsity_threshold == 0.4
    blockdiag.set_sparsity_threshold(None)
    assert blockdiag.get_settings().sparsity_threshold == 0.3


def test_settings_are_resolved_one_by_one():
    with blockdiag.config(dense_max_groups=3):
        s = blockdiag.get_settings()
    assert (s.dense_max_groups, s.sparsity_threshold) == (3, 1.0)


def test_config_restores_after_an_exception():
    with pytest.raises(RuntimeError):
        with blockdiag.config(sparsity_threshold=0.1):
            raise RuntimeError("boom")
    assert blockdiag.get_settings().sparsity_threshold == 1.0


def test_config_is_thread_local():
    seen = []
    with blockdiag.config(sparsity_threshold=0.1):
        t = threading.Thread(target=lambda: seen.append(blockdiag.get_settings().sparsity_threshold))
        t.start()
        t.join()
    assert seen == [1.0]


def test_epoch_changes_with_every_explicit_source(monkeypatch):
    t0 = st.epoch()
    with blockdiag.config(sparsity_threshold=0.1):
        t1 = st.epoch()
    blockdiag.set_config(dense_max_groups=2)
    t2 = st.epoch()
    monkeypatch.setenv("BLOCKDIAG_DENSE_MAX_ELEMENTS", "7")
    t3 = st.epoch()
    monkeypatch.setenv("XDG_CACHE_HOME", "/elsewhere")
    t4 = st.epoch()
    assert len({t0, t1, t2, t3, t4}) == 5


@pytest.mark.parametrize("var", st._EPOCH_VARS)
def test_epoch_sees_each_variable_and_matches_the_plain_reading(monkeypatch, var):
    # The epoch reads os.environ's encoded mapping with the keys unpacked by hand; each
    # variable must move it, and its values must be what os.environ.get returns.
    monkeypatch.delenv(var, raising=False)
    before = st.epoch()
    monkeypatch.setenv(var, "0.5")
    after = st.epoch()
    assert before != after
    assert [None if v is None else os.fsdecode(v) for v in after[2:-1]] == [os.environ.get(v) for v in st._EPOCH_VARS]


@pytest.mark.parametrize(
    "name, value, kind",
    [
        pytest.param("sparsity_threshold", True, "a float", id="bool-threshold"),
        pytest.param("dense_max_groups", 2.7, "an int", id="fractional-groups"),
        pytest.param("dense_max_elements", False, "an int", id="bool-elements"),
        pytest.param("profile", 5, r"a path \(str or os.PathLike\)", id="int-profile"),
        pytest.param("double_backward", 1, "True or False", id="int-double-backward"),
    ],
)
def test_values_are_not_coerced(name, value, kind):
    # True is not a threshold, 2.7 is not a group count, 5 is not a path.
    before = blockdiag.get_settings()
    with pytest.raises(BlockDiagError, match=rf"set_config: {name} must be {kind}, got {re.escape(repr(value))}"):
        blockdiag.set_config(**{name: value})
    assert blockdiag.get_settings() == before


def test_exact_values_and_paths_are_accepted(tmp_path):
    try:
        blockdiag.set_config(dense_max_groups=4.0, profile=tmp_path / "p.json", sparsity_threshold=1)
        s = blockdiag.get_settings()
        assert (s.dense_max_groups, s.profile, s.sparsity_threshold) == (4, str(tmp_path / "p.json"), 1.0)
    finally:
        blockdiag.set_config(dense_max_groups=None, profile=None, sparsity_threshold=None)


@pytest.mark.parametrize("raw, value", [("1", True), ("TRUE", True), (" yes ", True), ("on", True),
                                        ("0", False), ("false", False), ("No", False), ("off", False)])
def test_double_backward_reads_the_usual_words_from_the_environment(monkeypatch, raw, value):
    monkeypatch.setenv("BLOCKDIAG_DOUBLE_BACKWARD", raw)
    assert blockdiag.get_settings().double_backward is value
    assert st.resolve("double_backward") == (value, "$BLOCKDIAG_DOUBLE_BACKWARD")


def test_double_backward_refuses_other_words_and_follows_the_precedence(monkeypatch):
    assert blockdiag.get_settings().double_backward is False  # the default
    monkeypatch.setenv("BLOCKDIAG_DOUBLE_BACKWARD", "maybe")
    with pytest.raises(BlockDiagError, match=r"environment variable BLOCKDIAG_DOUBLE_BACKWARD: double_backward "
                                             r"must be True or False \(or 1/0, true/false, yes/no, on/off\), got 'maybe'"):
        blockdiag.get_settings()
    monkeypatch.setenv("BLOCKDIAG_DOUBLE_BACKWARD", "1")
    blockdiag.set_config(double_backward=False)
    assert blockdiag.get_settings().double_backward is False  # set_config over the environment
    with blockdiag.config(double_backward=True):
        assert st.resolve("double_backward") == (True, "blockdiag.config()")
    blockdiag.set_config(double_backward=None)
    assert blockdiag.get_settings().double_backward is True


def test_set_config_applies_nothing_when_one_value_is_bad():
    before = st.get_settings().dense_max_groups
    with pytest.raises(BlockDiagError, match=r"set_config: sparsity_threshold must lie in \[0, 1\], got 2.0"):
        blockdiag.set_config(dense_max_groups=before + 3, sparsity_threshold=2.0)
    assert st.get_settings().dense_max_groups == before
    with pytest.raises(BlockDiagError, match=r"^set_config: unknown setting 'dense_max_group'"):
        blockdiag.set_config(dense_max_group=None)


def test_config_blocks_left_out_of_order_take_their_own_frames():
    # Generators and asyncio tasks can leave blocks in another order than they entered them.
    base = st.get_settings().sparsity_threshold
    a, b = blockdiag.config(sparsity_threshold=0.25), blockdiag.config(sparsity_threshold=0.75)
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert st.get_settings().sparsity_threshold == 0.75  # b's block is still open
    b.__exit__(None, None, None)
    assert st.get_settings().sparsity_threshold == base and st._local.key == 0


def test_a_thread_count_change_is_seen_by_the_next_epoch():
    import torch

    n = torch.get_num_threads()
    before = st.epoch()
    try:
        torch.set_num_threads(n + 1)
        assert st.epoch() != before  # at once, not after profile.RECHECK_S
    finally:
        torch.set_num_threads(n)


def test_no_setting_reaches_a_test_from_the_callers_environment():
    # What the subprocess below runs: every test starts with the settings' defaults.
    for var, _ in st._ENV.values():
        if var != "BLOCKDIAG_PROFILE":
            assert var not in os.environ, var


def test_the_developers_settings_do_not_reach_the_tests():
    # conftest clears each setting's variable around every test: a developer's shell with
    # BLOCKDIAG_DOUBLE_BACKWARD=1 (or another setting) failed the chooser's tests.
    env = dict(os.environ, BLOCKDIAG_DOUBLE_BACKWARD="1", BLOCKDIAG_SPARSITY_THRESHOLD="0",
               BLOCKDIAG_DENSE_MAX_GROUPS="1000", BLOCKDIAG_DENSE_MAX_ELEMENTS="7")
    node = f"{Path(__file__).resolve()}::test_no_setting_reaches_a_test_from_the_callers_environment"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
                         capture_output=True, text=True, env=env, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


@pytest.mark.parametrize(
    "name, make, stored",
    [
        pytest.param("dense_max_groups", lambda np: np.int64(8), 8, id="set_config-dense_max_groups=np.int64"),
        pytest.param("dense_max_elements", lambda np: np.uint32(4096), 4096, id="set_config-dense_max_elements=np.uint32"),
        pytest.param("sparsity_threshold", lambda np: np.float32(0.5), 0.5, id="set_config-sparsity_threshold=np.float32"),
        pytest.param("sparsity_threshold", lambda np: np.int64(1), 1.0, id="set_config-sparsity_threshold=np.int64"),
        pytest.param("double_backward", lambda np: np.True_, True, id="set_config-double_backward=np.bool_"),
        # A whole float is a count as 8.0 and np.float64(8.0) are: np.float32 (no float subclass) was refused.
        pytest.param("dense_max_groups", lambda np: np.float32(8.0), 8, id="set_config-dense_max_groups=np.float32"),
    ],
)
def test_numpy_scalars_are_the_numbers_they_hold(name, make, stored):
    # Sizes and counts take NumPy integers elsewhere (GroupedLinear(groups=np.int64(4))); the
    # settings refused np.int64(8) as "must be an int" and np.float32(0.5) as "must be a float"
    # (np.float64, a float subclass, passed). Stored as plain Python values (cache keys).
    np = pytest.importorskip("numpy")
    try:
        blockdiag.set_config(**{name: make(np)})
        got = getattr(blockdiag.get_settings(), name)
        assert got == stored and type(got) is type(stored)
        with blockdiag.config(**{name: make(np)}):
            got = getattr(blockdiag.get_settings(), name)
            assert got == stored and type(got) is type(stored)
    finally:
        blockdiag.set_config(**{name: None})


@pytest.mark.parametrize(
    "name, value, pattern",
    [
        pytest.param("dense_max_groups", "np.bool_", r"must be an int, got np\.True_", id="set_config-dense_max_groups=np.bool_"),
        pytest.param("sparsity_threshold", "np.bool_", r"must be a float, got np\.True_", id="set_config-sparsity_threshold=np.bool_"),
        pytest.param("sparsity_threshold", 2**2000, r"must be a float, got 1", id="set_config-sparsity_threshold=2**2000"),
    ],
)
def test_what_holds_no_such_number_is_still_refused(name, value, pattern):
    np = pytest.importorskip("numpy")
    value = np.True_ if value == "np.bool_" else value
    before = blockdiag.get_settings()
    with pytest.raises(BlockDiagError, match=rf"^set_config: {name} " + pattern):
        blockdiag.set_config(**{name: value})
    assert blockdiag.get_settings() == before
