"""Tuning profiles: measured backend times per machine, loaded by ``auto``, written atomically.

A profile file is JSON::

    {"format": "blockdiag-profile", "version": 1,
     "entries": {"<device name>|<torch version>|<dtype>": {
         "device_name": ..., "device": "cpu" | "cuda", "torch": ..., "dtype": "float32",
         "created": ISO time, "threads": int,
         "settings": {"sparsity_threshold": float, "dense_max_groups": int, ...},
         "measurements": [{"mode": "forward" | "train", "batch": B, "groups": G,
                           "block_in": i, "block_out": o, "times_us": {backend: median us}}]}}}

``auto`` uses the entry whose key matches the problem's device name, the running torch and
the dtype. A CPU entry records the ``simd`` kernel variant it was measured with
(``"simd_variant": "avx512" | "avx2" | "neon"``, stamped by :func:`save_entry`); where this
machine runs another variant, ``simd``'s times in it describe other kernels and are dropped
(:func:`fit_variant`: ``simd`` then ranks by the fallback order), and the built-in table
prefers an entry measured with the running variant (keyed ``...|<dtype>|<variant>``). Without one it uses the built-in table shipped in ``blockdiag/_defaults.json``
(measured on a 2-core CPU). A missing file is silent; a corrupt file, one holding only
entries for another torch version or device (stale), a path naming something other than a
regular file (a FIFO, a device, a directory: never opened for reading, so never blocks), a
file over :data:`MAX_PROFILE_BYTES` or one of a later format (a newer blockdiag's, which
:func:`save_entry` does not replace) gives one warning per file and falls back to the
defaults: ``auto`` never crashes, or hangs, on a profile.

What was read is cached until it may have changed: a profile written (:func:`save_entry`)
or forgotten (:func:`clear_cache`) in this process starts a new chooser epoch at once; a
file changed by another process is found by :func:`changed_on_disk`, which the chooser's
:func:`~blockdiag.dispatch.epoch` calls at most every :data:`RECHECK_S` seconds (see
:mod:`blockdiag.dispatch`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import stat
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from . import settings as _settings
from ._checks import is_int
from ._errors import BlockDiagError
from ._files import file_kind as _file_kind, real_path, write_json_atomic

FORMAT = "blockdiag-profile"
VERSION = 1
DEFAULTS_PATH = Path(__file__).with_name("_defaults.json")

__all__ = [
    "ProfileWarning",
    "default_profile_path",
    "device_name",
    "profile_key",
    "load_entry",
    "cached_entry",
    "changed_on_disk",
    "save_entry",
    "clear_cache",
    "merge_entry",
]

# How long the chooser trusts its last look at the profile files (and the thread count):
# ``auto`` runs on every forward call, and a stat per call would cost more than the smallest
# products. A profile written in this process (``save_entry``) is seen at once; one written
# by another process within this many seconds (``changed_on_disk``, called from
# ``blockdiag.settings.epoch``).
RECHECK_S = 1.0

# The source a plan names when the built-in table ranked it (``load_entry``, ``Plan.source``).
BUILTIN_SOURCE = "built-in defaults"


class ProfileWarning(UserWarning):
    """A tuning profile was corrupt or stale and the built-in defaults are used instead."""


def default_profile_path() -> Path:
    """``$BLOCKDIAG_PROFILE``, else ``$XDG_CACHE_HOME/blockdiag/profile.json`` (``~/.cache``)."""
    env = os.environ.get("BLOCKDIAG_PROFILE")
    if env and env.strip():  # blank as unset, as every BLOCKDIAG_* variable
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # unset, empty or relative: the XDG spec says to ignore it
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blockdiag" / "profile.json"


def device_name(device: str) -> str:
    """A stable name of the device kind (``torch.cuda.get_device_name`` or the CPU model).

    On CPU the name includes the thread count in force now (``torch.set_num_threads`` moves
    the crossovers, so a profile measured with 2 threads does not describe 8).
    """
    if device == "cpu":
        return f"{_cpu_model()} ({torch.get_num_threads()} threads)"
    return _device_name(device)


@functools.lru_cache(maxsize=None)
def _cpu_model() -> str:
    model = "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        # Not Linux: the platform's processor string is the best name there is.
        import platform

        model = platform.processor() or "cpu"
    return model


@functools.lru_cache(maxsize=None)
def _device_name(device: str) -> str:
    if device == "cuda":
        # Without a usable CUDA device (a CPU-only build, no driver) no entry can match:
        # a name that matches none sends auto to the built-in table instead of a crash.
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda (no device)"
    return device


def profile_key(device: str, dtype: torch.dtype) -> str:
    return f"{device_name(device)}|{torch.__version__}|{str(dtype).replace('torch.', '')}"


def _validate(doc: Any, path: str) -> dict:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} file")
    version = doc.get("version")
    if is_int(version, VERSION + 1):
        raise ValueError(f"{_NEWER}: version {version}, this blockdiag reads version {VERSION}")
    if version != VERSION:
        raise ValueError(f"version {version!r}, this blockdiag reads version {VERSION}")
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        raise ValueError("'entries' is missing or not an object")
    for key, e in entries.items():
        ms = e.get("measurements") if isinstance(e, dict) else None
        if not isinstance(ms, list):
            raise ValueError(f"entry {key!r} has no 'measurements' list")
        for m in ms:
            if not (
                isinstance(m, dict)
                and m.get("mode") in ("forward", "train")
                and all(
                    is_int(m.get(k), 1 if k == "groups" else 0) and m[k] <= _MAX_SIZE
                    for k in ("batch", "groups", "block_in", "block_out")
                )
                and isinstance(m.get("times_us"), dict)
                # NaN and infinity would make every ranking that touches them meaningless,
                # and the ranking takes logarithms of times scaled by FLOPs.
                and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and _TIME_RANGE_US[0] <= v <= _TIME_RANGE_US[1]
                    for v in m["times_us"].values()
                )
                and isinstance(m.get("skipped", {}), dict)
            ):
                raise ValueError(f"entry {key!r} has a malformed measurement {m!r:.120}")
        nm = e.get("not_measured", {})
        # Its values are the plans' notes (text joined into Plan.reason): anything else crashed auto.
        if not isinstance(nm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in nm.items()):
            raise ValueError(f"entry {key!r} has 'not_measured' that is not an object of backend names to reasons")
        if not isinstance(e.get("runs", []), list):
            raise ValueError(f"entry {key!r} has 'runs' that is not a list")
        st = e.get("settings", {})
        if not isinstance(st, dict):
            raise ValueError(f"entry {key!r} has 'settings' that is not an object")
        for k, v in st.items():
            if k not in _SETTING_RANGES:
                raise ValueError(f"entry {key!r} has an unknown setting {k!r}")
            lo, hi = _SETTING_RANGES[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ValueError(f"entry {key!r} has {k}={v!r}, outside [{lo}, {hi}]")
    return doc


# What a measurement may hold: sizes up to 2**40 (float arithmetic on their products stays
# exact enough and finite), times from a picosecond to about eleven days.
_MAX_SIZE = 2**40
_TIME_RANGE_US = (1e-6, 1e12)

_SETTING_RANGES = {
    "sparsity_threshold": (0.0, 1.0),
    "dense_max_groups": (0, float("inf")),
    "dense_max_elements": (0, float("inf")),
}


# The largest profile file read. A real one is a few hundred KiB (one entry per device,
# torch and dtype, a few hundred points each); a path naming something far larger (a disk
# image, a log) is a mistake, and reading it whole would exhaust memory.
MAX_PROFILE_BYTES = 64 * 2**20

# A profile of a later format, from a newer blockdiag sharing the path (a downgrade, two
# environments): not damaged, and not this version's to replace.
_NEWER = "written by a newer blockdiag"

# Reasons a file was not read at all (as opposed to read and found corrupt): their
# warning says "is not read" and what the path names.
_NOT_READ = ("not a regular file", "too large", f"ValueError: {_NEWER}", "not readable")

# Why a path names no file: anything else a stat or an open raises (a directory on the way
# that this user may not search, a name too long, a loop of links) leaves a file there
# unread, which is not the same as no file, and is said so.
_MISSING = (errno.ENOENT, errno.ENOTDIR)


def _unreadable(e: OSError) -> str:
    return f"not readable: {type(e).__name__}: {e}"


def _too_large(size: int) -> str:
    return f"too large: it is {size} bytes, over the {MAX_PROFILE_BYTES} bytes ({MAX_PROFILE_BYTES >> 20} MiB) a profile may be"


class _NotReadable(Exception):
    """Raised out of :func:`_read_cached` so that lru_cache does not keep the outcome."""


def _read(path: str, signature: tuple) -> tuple[Optional[dict], Optional[str]]:
    """:func:`_read_cached`'s answer; a file that could not be opened or read is not remembered.

    The signature is ``(mtime, size, inode)``, none of which a fix of the file's permissions
    changes: cached, the failure would outlive the fix for the whole process (``save_entry``
    and ``tune`` refusing to replace a profile that can be read again).
    """
    try:
        return _read_cached(path, signature)
    except _NotReadable as e:
        return None, str(e)


@functools.lru_cache(maxsize=16)
def _read_cached(path: str, signature: tuple) -> tuple[Optional[dict], Optional[str]]:
    # Only a regular file of bounded size is read: opening a FIFO blocks until a writer
    # comes (forever, in every ``auto`` forward), and reading a device such as /dev/zero
    # never ends. The path is checked before it is opened (opening some devices has
    # effects), and the opened file again (the path may have been replaced in between),
    # opened non-blocking so that even a FIFO swapped in then cannot block the open.
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            return None, f"not a regular file: it is {_file_kind(st.st_mode)}"
        if st.st_size > MAX_PROFILE_BYTES:
            return None, _too_large(st.st_size)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None, f"not a regular file: it is {_file_kind(st.st_mode)}"
            data = f.read(MAX_PROFILE_BYTES + 1)
        if len(data) > MAX_PROFILE_BYTES:  # grew since the stat
            return None, _too_large(len(data))
        return _validate(json.loads(data), path), None
    except OSError as e:
        if e.errno in _MISSING:
            return None, None  # removed since the caller's stat: a missing file, not a corrupt one
        raise _NotReadable(_unreadable(e)) from None
    # json.JSONDecodeError (and a UnicodeDecodeError) is a ValueError; a deeply nested
    # document raises RecursionError.
    except (ValueError, RecursionError) as e:
        return None, f"{type(e).__name__}: {e}"


_warned: set = set()


def _warn_once(path: str, msg: str) -> None:
    if (path, msg) not in _warned:
        _warned.add((path, msg))
        warnings.warn(f"blockdiag: {msg}; using the built-in defaults", ProfileWarning, stacklevel=4)


def _signature(path: str) -> Optional[tuple]:
    """What a stat says about a file's content: ``(mtime, size, inode)``, None if missing.

    The size and the inode catch a rewrite within the file system's timestamp granularity
    (``write_json_atomic`` renames a new file over the old one: a new inode). A stat that
    fails for another reason than a missing file gives ``("error", errno)``.
    """
    return _stat(path)[0]


def _stat(path: str) -> tuple[Optional[tuple], Optional[str]]:
    """``(signature, None)``, or ``(("error", errno), why)`` where the stat failed."""
    try:
        st = os.stat(path)
    except OSError as e:
        return (None, None) if e.errno in _MISSING else (("error", e.errno), _unreadable(e))
    return (st.st_mtime_ns, st.st_size, st.st_ino), None


# Every file whose content (or absence) an answer was built from, with its signature then:
# what ``changed_on_disk`` looks at again.
_seen: dict[str, Optional[tuple]] = {}


def read_profile(path: Path | str) -> tuple[Optional[dict], Optional[str]]:
    """``(document, None)`` or ``(None, why it is unusable)``; ``(None, None)`` if missing."""
    path = str(path)
    sig, err = _stat(path)
    if len(_seen) > 256:  # many paths read over time: forget them all, entries included
        _forget()
    _seen[path] = sig
    if sig is None or err is not None:
        return None, err
    return _read(path, sig)


def load_entry(device: str, dtype: torch.dtype, path: Path | str | None = None) -> tuple[Optional[dict], str]:
    """The profile entry for ``(device, dtype)`` and a description of its source.

    Falls back to the built-in table (``(entry, "built-in defaults")``) with one
    :class:`ProfileWarning` for a corrupt or stale file. Never raises.
    """
    p = str(path or default_profile_path())
    doc, err = read_profile(p)
    if err is not None:
        if err.startswith("not readable"):
            _warn_once(p, f"tuning profile {p} cannot be read ({err.removeprefix('not readable: ')})")
        elif err.startswith(_NOT_READ):
            _warn_once(p, f"tuning profile {p} is not read, {err.removeprefix('ValueError: ')}")
        else:
            _warn_once(p, f"tuning profile {p} is corrupt ({err})")
    elif doc is not None:
        key = profile_key(device, dtype)
        entry = doc["entries"].get(key)
        if entry is not None:
            return fit_variant(entry, device), f"tuning profile {p}"
        same_dev = [k for k in doc["entries"] if k.split("|")[0] == key.split("|")[0]]
        has = ", ".join(map(repr, doc["entries"])) or "none"
        tune = "`blockdiag tune" + ("" if device == "cpu" else f" --device {device}") + "`"
        if not same_dev:
            # Another machine's profile, this machine's other device, or another thread count.
            _warn_once(p, f"tuning profile {p} has no entry for this device, {key.split('|')[0]!r} "
                          f"(it has {has}); {tune} measures one")
        elif all(k.split("|")[1] != torch.__version__ for k in same_dev):
            _warn_once(p, f"tuning profile {p} is stale: it has no entry for {key!r}, only other torch "
                          f"versions' (it has {has}); run {tune}")
    return builtin_entry(device, dtype), BUILTIN_SOURCE


def _running_simd_variant(device: str) -> Optional[str]:
    """The ``simd`` kernel variant this machine runs (None off CPU, or where simd is unavailable)."""
    if device != "cpu":
        return None
    from .backends import simd

    try:
        return simd.variant()
    except Exception:  # noqa: BLE001  (the chooser never fails on the table)
        return None


_fitted: dict = {}


def fit_variant(entry: Optional[dict], device: str) -> Optional[dict]:
    """``entry``, or a copy without ``simd``'s times where they were measured with another variant.

    An entry's ``simd_variant`` says which ``simd`` kernels its times are of (absent: not
    known, kept as they are). On a machine running another variant (an AVX2 CPU reading
    AVX-512 measurements) those times would rank kernels that do not run here: the copy drops
    them, and says why in ``not_measured`` (the plan's candidate note).
    """
    if entry is None or device != "cpu" or "simd_variant" not in entry:
        return entry
    running = _running_simd_variant(device)
    if running is None or running == entry["simd_variant"]:
        return entry
    hit = _fitted.get(id(entry))
    if hit is not None and hit[0] is entry and hit[1] == running:
        return hit[2]
    why = f"not measured: the table's simd times are of the {entry['simd_variant']} kernels, this machine runs {running}"
    fitted = {
        **entry,
        "measurements": [{**m, "times_us": {k: v for k, v in m["times_us"].items() if k != "simd"},
                          "skipped": {**m.get("skipped", {}), "simd": why}}
                         for m in entry["measurements"]],
        "not_measured": {"simd": why},
    }
    if len(_fitted) > 64:
        _fitted.clear()
    _fitted[id(entry)] = (entry, running, fitted)
    return fitted


_entry_cache: dict = {}


def cached_entry(device: str, dtype: torch.dtype, path: Path | str | None = None) -> tuple[Optional[dict], str, tuple]:
    """:func:`load_entry`, cached until the files it was read from may have changed.

    That is: until :func:`save_entry` or :func:`clear_cache` in this process, or until
    :func:`changed_on_disk` finds a change (the chooser's epoch looks at most every
    :data:`RECHECK_S` seconds; so does this function). The CPU entry's key holds the
    thread count (see :func:`device_name`), and so does this cache's key.

    Returns:
        ``(entry, source, signature)``: ``signature`` is the profile's path and what a stat
            said about it and about the built-in table when they were read.
    """
    _settings.epoch()  # the periodic look at the files, for callers other than the chooser
    p = str(path or default_profile_path())
    key = (p, device, dtype, torch.get_num_threads() if device == "cpu" else 0)
    hit = _entry_cache.get(key)
    if hit is not None:
        return hit
    gen = _settings.generation
    entry, source = load_entry(device, dtype, p)
    out = (entry, source, (p, _seen.get(p), _seen.get(str(DEFAULTS_PATH))))
    # Not kept if the files were forgotten meanwhile (another thread found a change): what
    # was read may predate it.
    if gen == _settings.generation:
        _entry_cache[key] = out
    return out


def changed_on_disk() -> bool:
    """Whether a profile file read so far changed since it was read.

    Stats each file an answer was built from (usually the profile and the built-in table).
    On a change it starts a new chooser epoch, forgets the cached entries and returns True.
    The chooser's :func:`~blockdiag.dispatch.epoch` calls it every :data:`RECHECK_S`
    seconds at most. The thread count is not looked at here: it is part of the epoch and of
    :func:`cached_entry`'s key, per calling thread (threads may differ under OpenMP).
    """
    changed = False
    for path, sig in list(_seen.items()):
        now = _signature(path)
        if now != sig:
            _seen[path] = now  # a vanished file is recorded as missing, so it reports once
            changed = True
    if changed:
        # The epoch first: an entry another thread is reading now is then not kept (see
        # cached_entry), and one it kept before is cleared here.
        _settings.bump_epoch()
        _entry_cache.clear()
    return changed


def _forget() -> None:
    """Start a new epoch and forget what was read from profile files (as changed_on_disk)."""
    _settings.bump_epoch()
    _entry_cache.clear()
    _seen.clear()


# Retired: this module's own counter before the chooser's one epoch (``generation`` in
# blockdiag.settings, part of :func:`blockdiag.dispatch.epoch`). It stays, fixed at 0, for
# memos that still check it beside ``settings.token()``: that is the epoch now, which
# moves whenever this counter would have.
generation = 0


def clear_cache() -> None:
    """Forget what was read from profile files (the next ``auto`` call reads them again)."""
    _forget()
    _read_cached.cache_clear()
    _warned.clear()


def builtin_entry(device: str, dtype: torch.dtype) -> Optional[dict]:
    """The shipped table for the device type (any dtype), or None where none ships.

    The built-in table holds entries measured on a few machines. The one measured on a
    device of this name (:func:`device_name`, the CPU's thread count included) is used;
    else the one the table's ``"defaults"`` names for the device type; else the first
    entry of that type. On CPU each step prefers an entry measured with the ``simd`` kernel
    variant this machine runs: one of this device's name and variant; else one of this name
    (another variant); else the default, or any CPU entry, of this variant; else the default.
    One measured with another variant is used without its ``simd`` times (:func:`fit_variant`).
    """
    doc, err = read_profile(DEFAULTS_PATH)
    if doc is None:
        return None
    entries = doc["entries"]
    name = device_name(device)
    running = _running_simd_variant(device)
    default = doc.get("defaults", {}).get(device)
    ours = [e for e in entries.values() if e.get("device") == device]
    named = [e for e in ours if e.get("device_name") == name]
    defaults = [entries[default]] if default in entries and entries[default].get("device") == device else []

    def same(e: dict) -> bool:  # measured with the kernels that run here (or not known)
        return running is None or e.get("simd_variant", running) == running

    for e in named:
        if same(e):
            return e
    if named:
        return fit_variant(named[0], device)
    for e in defaults + ours:
        if same(e):
            return e
    return fit_variant((defaults + ours)[0], device) if ours else None


# How long save_entry waits for another process's write to the same profile (a write
# takes milliseconds; a process stopped while holding the lock must not hang this one).
LOCK_TIMEOUT_S = 60.0


@contextlib.contextmanager
def _locked(p: Path):
    """Hold an exclusive lock on ``p``'s lock file (``.<name>.lock`` beside it) while the block runs.

    Two processes saving into one profile (two ``blockdiag tune`` runs) each read, merge
    and rename: without the lock the second rename drops what the first wrote. Where
    ``fcntl`` is missing (Windows), no lock is taken.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    # Never through a link: one planted there would have this user create its target.
    fd = os.open(p.parent / f".{p.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BlockDiagError(
                        f"save_entry: another process has held the lock on {p} for {LOCK_TIMEOUT_S:.0f} s; "
                        f"nothing was written (the lock file is {p.parent / f'.{p.name}.lock'})"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def save_entry(entry: dict, path: Path | str | None = None, merge: Optional[Callable[[Optional[dict], dict], dict]] = None) -> Path:
    """Merge ``entry`` into the profile at ``path`` atomically (temp file, then rename).

    A corrupt existing profile is replaced (its content could not be used anyway); a path
    naming something other than a regular file (a FIFO, a device, a directory), a file over
    :data:`MAX_PROFILE_BYTES` and JSON of another format are not, nor is a profile that
    cannot be opened or read (its permissions): its entries would be lost unread. The read, the
    merge and the rename hold a lock on the file, so that concurrent savers (two ``blockdiag
    tune`` runs) each keep the other's entries.

    Args:
        entry: the entry to store under its key.
        path: the profile file (default: :func:`default_profile_path`).
        merge: ``merge(stored, entry)`` gives what is stored, from the entry the file holds
            under the same key when it is read under the lock (None if none); default:
            ``entry`` replaces it.

    Returns:
        the path written.

    Raises:
        BlockDiagError: if the entry is malformed (nothing is written, and ``auto`` does not
            see it), the path names something other than a profile or a profile it cannot
            read (see above), the directory cannot be created or written, or another process
            holds the lock too long.
    """
    p = Path(path or default_profile_path())
    try:
        # The directory the file is written in: a symbolic link's target's, which the lock
        # file and the write (both through the link) need.
        real = real_path(p)
        real.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BlockDiagError(f"save_entry: cannot write profile {p}: {e}") from e
    try:
        with _locked(real):
            return _save_locked(entry, p, merge)
    except OSError as e:
        raise BlockDiagError(f"save_entry: cannot write profile {p}: {e}") from e


def _save_locked(entry: dict, p: Path, merge) -> Path:
    doc, err = read_profile(p)
    if err is not None and err.startswith(f"ValueError: {_NEWER}"):
        # Rewritten in this version's format, the newer version's entries would be lost.
        raise BlockDiagError(f"save_entry: refusing to write {p}: it was {err[len('ValueError: '):]}; "
                             "upgrade blockdiag, or name another path")
    if err is not None and err.startswith("not readable"):
        # Renamed over, a profile this user cannot read would be lost with its entries.
        raise BlockDiagError(f"save_entry: refusing to write {p}: it is {err}, and would be replaced unread; "
                             "fix its permissions, or name another path")
    if err is not None and (err.startswith(_NOT_READ) or err == f"ValueError: not a {FORMAT} file"):
        # Renaming a file over a FIFO or a device would silently replace it; a file too large
        # to be a profile, or JSON of another format, is likely someone's data (a disk image,
        # notes.json), not a damaged profile.
        raise BlockDiagError(f"save_entry: refusing to write {p}: it is not a blockdiag profile ({err}); "
                             "remove it, or name another path")
    # read_profile's document is the cached one that auto reads: merge into a copy, so that
    # an entry refused below never reaches auto.
    doc = {"format": FORMAT, "version": VERSION, "entries": {}} if doc is None else {**doc, "entries": dict(doc["entries"])}
    key = f"{entry['device_name']}|{entry['torch']}|{entry['dtype']}"
    if merge is not None:
        entry = merge(doc["entries"].get(key), entry)
    if (entry.get("device") == "cpu" and "simd_variant" not in entry
            and any("simd" in m.get("times_us", {}) for m in entry.get("measurements", []))):
        running = _running_simd_variant("cpu")  # the kernels these simd times are of
        if running is not None:
            entry = {**entry, "simd_variant": running}
    doc["entries"][key] = entry
    try:
        _validate(doc, str(p))
    except ValueError as e:
        raise BlockDiagError(f"save_entry: refusing to write {p}: {e}") from e
    try:
        write_json_atomic(p, doc)
    except OSError as e:
        raise BlockDiagError(f"save_entry: cannot write profile {p}: {e}") from e
    _forget()
    return p


# What describes one tune run in an entry's ``runs`` list.
RUN_FIELDS = ("created", "statistic", "rounds", "threads", "allocator_env", "rematched")

# ``runs`` keeps the most recent this many (an entry tuned point by point for months stays small).
MAX_RUNS = 50


def _run_record(entry: dict) -> dict:
    rec = {k: entry[k] for k in RUN_FIELDS if k in entry}
    # One short string a point: the built-in table is read in review, point by point.
    rec["points"] = [f"{m['mode']} B={m['batch']} G={m['groups']} {m['block_in']}x{m['block_out']}"
                     for m in entry["measurements"]]
    return rec


def merge_entry(old: Optional[dict], new: dict) -> dict:
    """``new`` plus the measurements of ``old`` at points ``new`` did not measure.

    The entry's own fields (``created``, ``rounds``, ``rematched``, ...) describe the latest
    run; ``runs`` lists every run merged into it, oldest first, each with those fields and
    the points it measured, so that a point re-tuned with more rounds is told apart from
    the rest.
    """
    from .tuning._tune import derive_settings  # tuning imports this module: import it at call time

    if not old:
        return new

    def key(m):
        return (m["mode"], m["batch"], m["groups"], m["block_in"], m["block_out"])

    seen = {key(m) for m in new["measurements"]}
    kept = [m for m in old.get("measurements", []) if key(m) not in seen]
    out = dict(new)
    out["measurements"] = kept + list(new["measurements"])
    out["settings"] = derive_settings(out["measurements"])
    out["runs"] = (list(old.get("runs") or [_run_record(old)]) + [_run_record(new)])[-MAX_RUNS:]
    return out
