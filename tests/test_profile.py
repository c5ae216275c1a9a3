"""Tuning profiles: loading, every failure mode (one warning, then defaults), atomic writes."""

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import blockdiag
from blockdiag import BlockDiagError, Problem, ProfileWarning, choose, profile

from _profiles import entry, point, write


@pytest.fixture(autouse=True)
def _fresh():
    profile.clear_cache()
    yield
    profile.clear_cache()


def load(path):
    return profile.load_entry("cpu", torch.float32, path)


def test_missing_file_is_silent(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        e, src = load(tmp_path / "none.json")
    assert src == "built-in defaults"
    assert e is profile.builtin_entry("cpu", torch.float32)


def test_matching_entry_is_used(tmp_path):
    path = write(tmp_path / "p.json", entry([point(loop=1.0)]))
    e, src = load(path)
    assert src == f"tuning profile {path}" and e["measurements"][0]["times_us"] == {"loop": 1.0}


def _bad_files(tmp_path):
    good = json.dumps({"format": profile.FORMAT, "version": 1, "entries": {"k": entry([point(loop=1.0)])}})
    return {
        "corrupt": ("{not json", "corrupt"),
        "half-written": (good[: len(good) // 2], "corrupt"),
        "empty": ("", "corrupt"),
        "wrong-format": (json.dumps({"format": "something", "version": 1}), "not a blockdiag-profile"),
        "wrong-version": (json.dumps({"format": profile.FORMAT, "version": 99, "entries": {}}), "version 99"),
        "no-version": (json.dumps({"format": profile.FORMAT, "entries": {"k": entry([point(loop=1.0)])}}), "version None"),
        "bad-measurement": (
            json.dumps({"format": profile.FORMAT, "version": 1,
                        "entries": {"k": entry([point(loop=-1.0)])}}),
            "malformed measurement",
        ),
        "bad-setting": (
            json.dumps({"format": profile.FORMAT, "version": 1,
                        "entries": {"k": entry([point(loop=1.0)], {"sparsity_threshold": 3})}}),
            "sparsity_threshold=3",
        ),
    }


@pytest.mark.parametrize(
    "kind", ["corrupt", "half-written", "empty", "wrong-format", "wrong-version", "no-version", "bad-measurement",
             "bad-setting"]
)
def test_unusable_file_warns_once_and_uses_defaults(tmp_path, monkeypatch, kind):
    text, msg = _bad_files(tmp_path)[kind]
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.warns(ProfileWarning, match=msg) as rec:
        e, src = load(path)
        load(path)
        monkeypatch.setenv("BLOCKDIAG_PROFILE", str(path))
        plan = choose(Problem(256, 50, 10, 10))
        choose(Problem(32, 4, 10, 10))
    assert len([w for w in rec if issubclass(w.category, ProfileWarning)]) == 1
    assert src == "built-in defaults" and plan.source == "built-in defaults"


@pytest.mark.parametrize("stale", ["torch", "device"])
def test_stale_profile_warns_once(tmp_path, stale):
    e = entry([point(loop=1.0)], torch_version="1.0.0") if stale == "torch" else entry([point(loop=1.0)])
    if stale == "device":
        e["device_name"] = "Some Other CPU (64 threads)"
    path = write(tmp_path / "p.json", e)
    want = "is stale: .*only other torch versions'.*run `blockdiag tune`" if stale == "torch" else (
        "has no entry for this device, .*`blockdiag tune` measures one")
    with pytest.warns(ProfileWarning, match=want) as rec:
        _, src = load(path)
        load(path)
    assert len(rec) == 1 and src == "built-in defaults"


def test_other_dtype_only_is_not_stale(tmp_path):
    path = write(tmp_path / "p.json", entry([point(loop=1.0)], dtype=torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, src = load(path)
    assert src == "built-in defaults"
    assert load(path)[1] == "built-in defaults"
    assert profile.load_entry("cpu", torch.float64, path)[1].startswith("tuning profile")


def test_save_merges_entries_and_is_valid(tmp_path):
    path = tmp_path / "sub" / "p.json"
    profile.save_entry(entry([point(loop=1.0)]), path)
    profile.save_entry(entry([point(bmm=1.0)], dtype=torch.float64), path)
    doc = json.loads(path.read_text())
    assert doc["format"] == profile.FORMAT and doc["version"] == profile.VERSION
    assert len(doc["entries"]) == 2
    # No temporary file left; the lock file of concurrent savers stays (removing it would race).
    assert sorted(p.name for p in path.parent.iterdir()) == [".p.json.lock", "p.json"]


def test_save_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    path = write(tmp_path / "p.json", entry([point(loop=1.0)]))
    before = path.read_text()

    def broken_dump(obj, f, **kw):
        f.write('{"format": "blockdiag-pro')
        raise OSError("disk full")

    monkeypatch.setattr(profile.json, "dump", broken_dump)
    with pytest.raises(BlockDiagError, match="cannot write profile .*disk full"):
        profile.save_entry(entry([point(bmm=1.0)]), path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".p.json.lock", "p.json"]


def test_a_link_planted_at_the_lock_file_is_not_followed(tmp_path):
    # The lock file is opened with O_CREAT: through a link planted at its name, this user
    # would create the link's target wherever it points.
    path = tmp_path / "p.json"
    target = tmp_path / "elsewhere" / "created"
    target.parent.mkdir()
    os.symlink(target, tmp_path / ".p.json.lock")
    with pytest.raises(BlockDiagError, match="cannot write profile"):
        profile.save_entry(entry([point(loop=1.0)]), path)
    assert not target.exists() and not path.exists()


def test_save_replaces_a_corrupt_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{garbage")
    profile.save_entry(entry([point(loop=1.0)]), path)
    assert load(path)[1].startswith("tuning profile")


def test_save_rejects_a_malformed_entry(tmp_path):
    with pytest.raises(ValueError, match="malformed measurement"):
        profile.save_entry(entry([point(loop=0.0)]), tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()


def test_default_path_follows_env(monkeypatch, tmp_path):
    monkeypatch.delenv("BLOCKDIAG_PROFILE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert profile.default_profile_path() == tmp_path / "blockdiag" / "profile.json"
    monkeypatch.setenv("BLOCKDIAG_PROFILE", str(tmp_path / "x.json"))
    assert profile.default_profile_path() == tmp_path / "x.json"
    # Blank is unset, as for every BLOCKDIAG_* variable: tune wrote a profile named " ".
    monkeypatch.setenv("BLOCKDIAG_PROFILE", " ")
    assert profile.default_profile_path() == tmp_path / "blockdiag" / "profile.json"
    assert blockdiag.settings._explicit("profile") is None


def test_builtin_table_is_valid():
    doc, err = profile.read_profile(profile.DEFAULTS_PATH)
    assert err is None
    if doc is not None:
        cpu = profile.builtin_entry("cpu", torch.float32)
        assert cpu is not None and {m["mode"] for m in cpu["measurements"]} == {"forward", "train"}


def test_builtin_table_covers_every_registered_backend():
    # A backend registered (or rewritten) without re-running `blockdiag tune` for the
    # built-in table is "not measured" there, and auto ranks it after every measured one
    # wherever it is faster; that happened to bmm_fm_loop. Each point must time each
    # registered backend or say why not.
    from blockdiag.backends import names

    cpu = profile.builtin_entry("cpu", torch.float32)
    for m in cpu["measurements"]:
        missing = set(names()) - set(m["times_us"]) - set(m.get("skipped", {}))
        assert not missing, (
            f"built-in table point {m['mode']} B={m['batch']} G={m['groups']} "
            f"{m['block_in']}x{m['block_out']} has no time for {sorted(missing)}: re-run "
            "`blockdiag tune --full --mode both --max-gflop 20` into blockdiag/_defaults.json"
        )


def test_device_name_without_cuda_matches_no_entry(monkeypatch):
    # A CPU-only build raises inside torch.cuda.get_device_name; auto must fall back instead.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    profile._device_name.cache_clear()
    try:
        assert profile.device_name("cuda") == "cuda (no device)"
    finally:
        profile._device_name.cache_clear()


def test_builtin_table_has_a_cuda_entry():
    e = profile.builtin_entry("cuda", torch.float32)
    assert e is not None and e["device"] == "cuda" and e["device_name"] != profile.builtin_entry("cpu", torch.float32)["device_name"]
    modes = {m["mode"] for m in e["measurements"]}
    assert modes == {"forward", "train"}


@pytest.mark.parametrize(
    "bad, why",
    [
        pytest.param({"bmm": float("inf")}, "malformed measurement", id="inf-time"),
        pytest.param({"bmm": float("nan")}, "malformed measurement", id="nan-time"),
        pytest.param({"bmm": True}, "malformed measurement", id="bool-time"),
    ],
)
def test_save_entry_refuses_bad_times_and_auto_never_sees_them(tmp_path, bad, why):
    path = tmp_path / "p.json"
    good = {"device": "cpu", "device_name": "x", "torch": "t", "dtype": "float32",
            "measurements": [{"mode": "forward", "batch": 8, "groups": 4, "block_in": 4, "block_out": 4, "times_us": {"bmm": 1.0}}]}
    profile.save_entry(good, path)
    worse = {**good, "dtype": "float64", "measurements": [{**good["measurements"][0], "times_us": bad}]}
    with pytest.raises(BlockDiagError, match=f"save_entry: refusing to write {re.escape(str(path))}: .*{why}"):
        profile.save_entry(worse, path)
    doc, err = profile.read_profile(path)
    assert err is None and list(doc["entries"]) == ["x|t|float32"]


def test_a_profile_with_zero_groups_or_a_bool_size_is_corrupt(tmp_path):
    for m in ({"groups": 0}, {"batch": True}):
        path = tmp_path / f"p{len(m)}{list(m)[0]}.json"
        meas = {"mode": "forward", "batch": 8, "groups": 4, "block_in": 4, "block_out": 4, "times_us": {"bmm": 1.0}, **m}
        path.write_text(json.dumps({"format": profile.FORMAT, "version": profile.VERSION, "entries": {"k": {"measurements": [meas]}}}))
        doc, err = profile.read_profile(path)
        assert doc is None and "malformed measurement" in err


_M = {"mode": "forward", "batch": 8, "groups": 4, "block_in": 4, "block_out": 4, "times_us": {"bmm": 1.0, "loop": 2.0}}


@pytest.mark.parametrize(
    "entry, why",
    [
        pytest.param({"measurements": [_M], "not_measured": ["simd"]}, "'not_measured' that is not an object", id="not-measured-list"),
        pytest.param({"measurements": [_M], "runs": 5}, "'runs' that is not a list", id="runs-int"),
        pytest.param({"measurements": [{**_M, "skipped": [1]}]}, "malformed measurement", id="skipped-list"),
        pytest.param({"measurements": [{**_M, "times_us": {"bmm": 5e-324, "loop": 1.0}}]}, "malformed measurement", id="subnormal-time"),
        pytest.param({"measurements": [{**_M, "batch": 10**400}]}, "malformed measurement", id="huge-size"),
    ],
)
def test_a_profile_that_would_break_the_ranking_is_corrupt(tmp_path, monkeypatch, entry, why):
    # Each of these passed the check and then made every auto forward raise (a .get on a
    # list, log(0) from a subnormal time, an int too large for a float). Now the file is
    # corrupt: one warning, and auto ranks by the built-in table.
    path = tmp_path / "p.json"
    key = f"{profile.device_name('cpu')}|{torch.__version__}|float32"
    ent = {"device": "cpu", "device_name": profile.device_name("cpu"), "torch": torch.__version__, "dtype": "float32", **entry}
    path.write_text(json.dumps({"format": profile.FORMAT, "version": profile.VERSION, "entries": {key: ent}}))
    doc, err = profile.read_profile(path)
    assert doc is None and why in err, err
    monkeypatch.setenv("BLOCKDIAG_PROFILE", str(path))
    from blockdiag import grouped_linear

    x, w = torch.randn(6, 12), torch.randn(4, 5, 3)
    with pytest.warns(profile.ProfileWarning):
        y = grouped_linear(x, w, None, backend="auto")
    torch.testing.assert_close(y, x @ torch.block_diag(*w).T)


def test_a_deeply_nested_profile_is_corrupt_not_a_crash(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100000)
    doc, err = profile.read_profile(path)
    assert doc is None and err.startswith("RecursionError")


def test_written_files_are_not_private(tmp_path):
    path = tmp_path / "r.json"
    profile.write_json_atomic(path, {"a": 1})
    assert path.stat().st_mode & 0o777 == 0o644
    path.chmod(0o664)
    profile.write_json_atomic(path, {"a": 2})
    assert path.stat().st_mode & 0o777 == 0o664 and json.loads(path.read_text()) == {"a": 2}


def test_a_rewrite_replaces_the_file_rather_than_writing_into_it(tmp_path):
    # Readers must see the old file or the new one, never a half-written one, and
    # changed_on_disk tells a rewrite within the timestamp granularity apart by its new
    # inode: so the new content goes to a new file renamed over the old, whose own content
    # (seen here through a second link to it) stays as it was.
    path = tmp_path / "r.json"
    profile.write_json_atomic(path, {"a": 1})
    old = tmp_path / "old.json"
    os.link(path, old)
    profile.write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2} and json.loads(old.read_text()) == {"a": 1}
    assert path.stat().st_ino != old.stat().st_ino


def test_the_cpu_entry_follows_the_thread_count(tmp_path, monkeypatch):
    # A profile tuned with one thread count must not serve another one.
    threads = torch.get_num_threads()
    mine = {"device": "cpu", "device_name": profile.device_name("cpu"), "torch": torch.__version__, "dtype": "float32",
            "measurements": [{"mode": "forward", "batch": 8, "groups": 4, "block_in": 4, "block_out": 4, "times_us": {"bmm": 1.0}}]}
    path = tmp_path / "p.json"
    profile.save_entry(mine, path)
    assert profile.cached_entry("cpu", torch.float32, path)[1].startswith("tuning profile")
    other = threads + 1
    try:
        torch.set_num_threads(other)
        assert profile.device_name("cpu").endswith(f"({other} threads)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", profile.ProfileWarning)
            assert not profile.cached_entry("cpu", torch.float32, path)[1].startswith("tuning profile")
    finally:
        torch.set_num_threads(threads)
    assert profile.cached_entry("cpu", torch.float32, path)[1].startswith("tuning profile")


def _shipped(tmp_path, names, defaults=None):
    doc = {"format": profile.FORMAT, "version": profile.VERSION, "entries": {}}
    for n in names:
        e = entry([point(bmm=1.0)])
        e["device_name"] = n
        doc["entries"][f"{n}|{e['torch']}|{e['dtype']}"] = e
    if defaults is not None:
        doc["defaults"] = defaults
    path = tmp_path / "defaults.json"
    path.write_text(json.dumps(doc))
    return path


def test_the_builtin_entry_of_this_very_device_wins(tmp_path, monkeypatch):
    here = profile.device_name("cpu")
    path = _shipped(tmp_path, ["Other CPU (2 threads)", here], {"cpu": f"Other CPU (2 threads)|{torch.__version__}|float32"})
    monkeypatch.setattr(profile, "DEFAULTS_PATH", path)
    assert profile.builtin_entry("cpu", torch.float32)["device_name"] == here


def test_elsewhere_the_builtin_default_of_the_device_type_is_used(tmp_path, monkeypatch):
    names = ["A CPU (2 threads)", "B CPU (2 threads)"]
    path = _shipped(tmp_path, names, {"cpu": f"B CPU (2 threads)|{torch.__version__}|float32"})
    monkeypatch.setattr(profile, "DEFAULTS_PATH", path)
    assert profile.builtin_entry("cpu", torch.float32)["device_name"] == "B CPU (2 threads)"
    # Without a named default, the first entry of the device type; none for another type.
    monkeypatch.setattr(profile, "DEFAULTS_PATH", _shipped(tmp_path, names))
    assert profile.builtin_entry("cpu", torch.float32)["device_name"] == "A CPU (2 threads)"
    assert profile.builtin_entry("mps", torch.float32) is None


def test_the_shipped_defaults_name_shipped_entries():
    doc, err = profile.read_profile(profile.DEFAULTS_PATH)
    assert err is None
    for device, key in doc["defaults"].items():
        assert doc["entries"][key]["device"] == device


def test_the_plan_names_the_machine_its_table_was_measured_on(tmp_path):
    path = write(tmp_path / "p.json", entry([point(bmm=1.0, loop=2.0)]))
    with blockdiag.config(profile=str(path)):
        plan = choose(Problem(256, 50, 10, 10))
    assert plan.measured_on == f"{profile.device_name('cpu')}, torch {torch.__version__}"
    assert f"table:   tuning profile {path} (measured on {plan.measured_on})" in str(plan)


# A profile path naming a FIFO used to block ``open()`` forever (in every ``auto`` forward
# and in ``explain``), and /dev/zero to raise MemoryError. These run in a subprocess with a
# timeout, so that a regression fails instead of hanging the suite.
_SPECIAL_FILE_SCRIPT = r"""
import sys, warnings
import torch, blockdiag
from blockdiag import cli, profile

warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as rec:
    torch.manual_seed(0)
    layer = blockdiag.GroupedLinear(4 * 3, 4 * 2, groups=4)  # backend "auto"
    x = torch.randn(5, 12)
    y = layer(x)
    layer(x)
    ref = torch.cat([x[:, 3 * g:3 * g + 3] @ layer.weight[g].T for g in range(4)], 1) + layer.bias
    assert torch.allclose(y, ref, atol=1e-5), (y - ref).abs().max()
    assert cli.main(["explain", "--batch", "8", "--groups", "4", "--block", "3x2",
                     "--profile", sys.argv[1]]) == 0
warned = [str(w.message) for w in rec if issubclass(w.category, profile.ProfileWarning)]
print("WARNINGS", len(warned))
for m in warned:
    print("MESSAGE", m)
"""


def _run_with_profile(path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "BLOCKDIAG_PROFILE": str(path)}
    try:
        r = subprocess.run([sys.executable, "-c", _SPECIAL_FILE_SCRIPT, str(path)], env=env,
                           capture_output=True, text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading the profile {path} hung")
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_profile_warns_once_and_never_blocks(tmp_path):
    import os

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    out = _run_with_profile(fifo)
    assert "WARNINGS 1\n" in out, out
    assert f"tuning profile {fifo} is not read, not a regular file: it is a FIFO" in out, out
    assert "built-in defaults" in out  # explain's plan names its source


@pytest.mark.skipif(not __import__("os").path.exists("/dev/zero"), reason="no /dev/zero")
def test_dev_zero_as_profile_warns_once_instead_of_memory_error():
    out = _run_with_profile("/dev/zero")
    assert "WARNINGS 1\n" in out, out
    assert "tuning profile /dev/zero is not read, not a regular file: it is a character device" in out, out


def test_a_directory_as_profile_warns_once(tmp_path):
    d = tmp_path / "adir"
    d.mkdir()
    with pytest.warns(ProfileWarning, match=f"{re.escape(str(d))} is not read, not a regular file: it is a directory") as rec:
        _, src = load(d)
        load(d)
    assert len(rec) == 1 and src == "built-in defaults"
    with pytest.raises(BlockDiagError, match="refusing to write .*not a regular file"):
        profile.save_entry(entry([point(loop=1.0)]), d)


def test_a_huge_profile_is_refused_unread(tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:  # sparse: no disk is used
        f.truncate(profile.MAX_PROFILE_BYTES + 1)
    with pytest.warns(ProfileWarning, match=f"{re.escape(str(path))} is not read, too large: it is {profile.MAX_PROFILE_BYTES + 1} bytes") as rec:
        _, src = load(path)
        load(path)
    assert len(rec) == 1 and src == "built-in defaults"


def test_written_json_goes_through_a_symbolic_link_and_refuses_a_fifo(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target.name)
    profile.write_json_atomic(link, {"a": 1})
    assert link.is_symlink() and json.loads(target.read_text()) == {"a": 1}
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file: it is a FIFO"):
        profile.write_json_atomic(fifo, {"a": 1})
    assert fifo.is_fifo() and not list(tmp_path.glob("*.tmp"))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="another user's link needs root")
def test_another_users_link_in_a_shared_folder_is_not_written_through(tmp_path, monkeypatch):
    # bench --json FILE saves part way to FILE.partial, a name made up here: another user's
    # link planted there in /tmp had its target (any file of this user's) replaced, since
    # realpath reads links where open() would refuse to follow them (fs.protected_symlinks).
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    precious = tmp_path / "notes.txt"
    precious.write_text("mine")
    link = shared / "results.json.partial"
    link.symlink_to(precious)
    os.lchown(link, 65534, 65534)
    with pytest.raises(OSError, match=f"{link} is a symbolic link of user id 65534 in the shared folder {shared}"):
        profile.write_json_atomic(link, {"a": 1})
    assert precious.read_text() == "mine" and link.is_symlink() and not list(tmp_path.rglob("*.tmp"))
    with pytest.raises(BlockDiagError, match="cannot write profile"):
        profile.save_entry(entry([point(loop=1.0)]), link)
    assert precious.read_text() == "mine"
    # One's own link there, or one of the folder's owner, is written through as before.
    for owner in (os.geteuid(), 65534):
        os.chown(shared, owner, -1)
        os.lchown(link, owner, -1)
        profile.write_json_atomic(link, {"owner": owner})
        assert json.loads(precious.read_text()) == {"owner": owner}
        precious.write_text("mine")
    # A relative path with "..", and one through a link of ours to a folder.
    (tmp_path / "sub").mkdir()
    (tmp_path / "to_sub").symlink_to(tmp_path / "sub")
    monkeypatch.chdir(tmp_path / "sub")
    profile.write_json_atomic("../to_sub/x.json", {"b": 2})
    assert json.loads((tmp_path / "sub" / "x.json").read_text()) == {"b": 2}
    assert profile.real_path("../to_sub/../notes.txt") == tmp_path / "notes.txt"


def test_concurrent_savers_keep_each_others_entries(tmp_path):
    # Two processes each saving 12 entries under their own keys into one profile: every
    # read-merge-rename holds the file's lock, so none of the 24 is lost (without it, a
    # run kept about half).
    path = tmp_path / "p.json"
    code = textwrap.dedent(f"""
        import sys
        from blockdiag import profile
        tag = sys.argv[1]
        for k in range(12):
            profile.save_entry({{"device": "cuda", "device_name": f"{{tag}}{{k}}", "torch": "t", "dtype": "float32",
                                 "measurements": [{{"mode": "forward", "batch": 8, "groups": 4, "block_in": 4,
                                                    "block_out": 4, "times_us": {{"bmm": 1.0}}}}]}}, {str(path)!r})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, tag]) for tag in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    doc, err = profile.read_profile(path)
    assert err is None and len(doc["entries"]) == 24


def test_save_entry_merges_into_what_the_file_holds_when_it_writes(tmp_path):
    path = tmp_path / "p.json"
    m = {"mode": "forward", "batch": 8, "groups": 4, "block_in": 4, "block_out": 4, "times_us": {"bmm": 1.0}}
    base = {"device": "cuda", "device_name": "x", "torch": "t", "dtype": "float32"}
    profile.save_entry({**base, "measurements": [m]}, path)
    seen = []

    def merge(stored, new):
        seen.append(stored)
        return {**new, "measurements": stored["measurements"] + new["measurements"]}

    profile.save_entry({**base, "measurements": [{**m, "batch": 16}]}, path, merge=merge)
    assert seen[0]["measurements"] == [m]
    doc, _ = profile.read_profile(path)
    assert [e["batch"] for e in doc["entries"]["x|t|float32"]["measurements"]] == [8, 16]


@pytest.mark.parametrize("bad", [{"loop": 5}, {"loop": None}, {"loop": ["x"]}], ids=["int", "null", "list"])
def test_a_not_measured_reason_that_is_not_text_is_a_corrupt_profile(tmp_path, monkeypatch, bad):
    # Its values are joined into the plan's reason: an int crashed every auto call.
    e = entry([point(loop=1.0, bmm=2.0)])
    e["not_measured"] = bad
    path = write(tmp_path / "p.json", e)
    monkeypatch.setenv("BLOCKDIAG_PROFILE", str(path))
    with pytest.warns(profile.ProfileWarning, match="is corrupt .*'not_measured' that is not an object"):
        plan = blockdiag.GroupedLinear(500, 500, groups=50).plan(torch.randn(256, 500))
    assert plan.source == profile.BUILTIN_SOURCE


@pytest.mark.parametrize("kind", ["too large", "other JSON"])
def test_save_entry_replaces_no_file_that_is_not_a_profile(tmp_path, monkeypatch, kind):
    path = tmp_path / ("big.log" if kind == "too large" else "notes.json")
    if kind == "too large":
        monkeypatch.setattr(profile, "MAX_PROFILE_BYTES", 1000)
        path.write_bytes(b"x" * 2000)
    else:
        path.write_text('{"my": "notes"}')
    before = path.read_bytes()
    with pytest.raises(BlockDiagError, match=r"save_entry: refusing to write .*: it is not a blockdiag profile"):
        profile.save_entry(entry([point(loop=1.0)]), path)
    assert path.read_bytes() == before


def test_other_dtype_of_this_torch_beside_an_old_torch_entry_is_not_stale(tmp_path):
    # A profile with this torch's float64 entry and an older torch's float32 entry: asking for
    # float32 finds no entry, but the profile was tuned with this torch, so it is not stale
    # (only a profile with no entry for this torch on this device is).
    old = entry([point(loop=1.0)], torch_version="1.0.0")
    new64 = entry([point(loop=1.0)], dtype=torch.float64)
    path = write(tmp_path / "p.json", old, new64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, src = profile.load_entry("cpu", torch.float32, path)
    assert src == profile.BUILTIN_SOURCE


def test_the_builtin_entry_of_this_machine_measured_with_another_variant_drops_simds_times(monkeypatch):
    # builtin_entry: an entry of this device's name, but only of another simd variant, is used
    # without its simd times (fit_variant), as the default's is.
    e = {"device": "cpu", "device_name": "Some CPU (2 threads)", "torch": torch.__version__, "dtype": "float32",
         "simd_variant": "avx512",
         "measurements": [{"mode": "forward", "batch": 64, "groups": 16, "block_in": 10, "block_out": 10,
                           "times_us": {"simd": 5.0, "bmm_fm": 50.0, "loop": 100.0}}]}
    doc = {"format": profile.FORMAT, "version": profile.VERSION, "entries": {"n512": e}}
    monkeypatch.setattr(profile, "read_profile", lambda path: (doc, None))
    monkeypatch.setattr(profile, "device_name", lambda device: "Some CPU (2 threads)")
    monkeypatch.setattr(profile, "_running_simd_variant", lambda device: "avx2")
    got = profile.builtin_entry("cpu", torch.float32)
    assert got["device_name"] == "Some CPU (2 threads)"
    assert "simd" not in got["measurements"][0]["times_us"] and "bmm_fm" in got["measurements"][0]["times_us"]


def test_a_profile_of_a_newer_blockdiag_is_not_read_and_not_replaced(tmp_path):
    # It was called corrupt, and save_entry rewrote it in this version's format: the newer
    # version's entries were lost.
    path = tmp_path / "p.json"
    text = json.dumps({"format": profile.FORMAT, "version": profile.VERSION + 1, "entries": {"k": {"new": 1}}})
    path.write_text(text)
    with pytest.warns(ProfileWarning, match=rf"is not read, written by a newer blockdiag: version {profile.VERSION + 1}"):
        assert load(path)[1] == "built-in defaults"
    with pytest.raises(BlockDiagError, match="written by a newer blockdiag.*upgrade blockdiag"):
        profile.save_entry(entry([point(loop=1.0)]), path)
    assert path.read_text() == text


def test_a_profile_removed_between_the_stat_and_the_read_is_missing_not_corrupt(tmp_path):
    # The warning called a profile deleted in that window "corrupt (FileNotFoundError ...)".
    assert profile._read(str(tmp_path / "gone.json"), (1, 2, 3)) == (None, None)


@pytest.mark.parametrize("kind", ["link-loop", "name-too-long"])
def test_a_profile_path_that_cannot_be_looked_at_warns_once_instead_of_reading_as_missing(tmp_path, kind):
    # A stat failing for another reason than a missing file (a folder this user may not
    # search, a name too long, a loop of links) read as "no profile": auto silently ran the
    # built-in table in place of the user's profile.
    if kind == "link-loop":
        (tmp_path / "loop").symlink_to(tmp_path / "loop")
        path = tmp_path / "loop" / "profile.json"
    else:
        path = tmp_path / ("x" * 300) / "profile.json"
    with pytest.warns(ProfileWarning, match=r"cannot be read \(OSError: \[Errno \d+\]") as rec:
        assert load(path)[1] == "built-in defaults"
        assert load(path)[1] == "built-in defaults"
    assert len(rec) == 1
    with pytest.raises(BlockDiagError, match="cannot write profile"):
        profile.save_entry(entry([point(loop=1.0)]), path)


def test_save_entry_does_not_replace_a_profile_it_cannot_read(tmp_path, monkeypatch):
    # Renamed over, a profile this user may not read was lost with its entries ("corrupt").
    path = write(tmp_path / "p.json", entry([point(loop=1.0)]))
    text = path.read_text()

    def unreadable(p, sig):
        raise PermissionError(13, "Permission denied", p)

    monkeypatch.setattr(profile.os, "fdopen", unreadable)
    with pytest.warns(ProfileWarning, match=r"cannot be read \(PermissionError"):
        assert load(path)[1] == "built-in defaults"
    with pytest.raises(BlockDiagError, match="PermissionError.*would be replaced unread; fix its permissions"):
        profile.save_entry(entry([point(loop=2.0)]), path)
    monkeypatch.undo()
    assert path.read_text() == text


def test_a_profile_path_under_a_regular_file_is_missing(tmp_path):
    # ENOTDIR names no file, as ENOENT does (a folder of the path is a file): no profile,
    # silently, not one that "cannot be read".
    (tmp_path / "f").write_text("")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(tmp_path / "f" / "profile.json")[1] == "built-in defaults"


@pytest.mark.parametrize("how", ["rewritten", "removed"])
def test_a_change_on_disk_is_reported_once(tmp_path, how):
    # What changed_on_disk saw becomes what it compares with next: reported again and again,
    # each look started a new chooser epoch, dropping every plan cache every RECHECK_S.
    path = write(tmp_path / "p.json", entry([point(loop=1.0)]))
    assert load(path)[1].startswith("tuning profile")
    profile.changed_on_disk()  # anything read before this test
    if how == "rewritten":
        path.write_text(path.read_text() + " ")  # a new size (write() would clear the cache)
    else:
        path.unlink()
    assert profile.changed_on_disk() is True
    assert profile.changed_on_disk() is False


def test_a_profile_that_could_not_be_opened_is_read_once_it_can_be(tmp_path, monkeypatch):
    # The read was cached on (mtime, size, inode), which fixing a file's permissions leaves
    # alone: once refused, save_entry (and tune) went on refusing to write it, "fix its
    # permissions", after they were fixed, until the process ended.
    path = write(tmp_path / "p.json", entry([point(loop=1.0)]))

    def unreadable(p, sig):
        raise PermissionError(13, "Permission denied", p)

    monkeypatch.setattr(profile.os, "fdopen", unreadable)
    with pytest.raises(BlockDiagError, match="would be replaced unread"):
        profile.save_entry(entry([point(loop=2.0)]), path)
    monkeypatch.undo()  # the permissions fixed: the file itself is as it was
    doc, err = profile.read_profile(path)
    assert err is None and doc is not None
    profile.save_entry(entry([point(loop=2.0)]), path)
