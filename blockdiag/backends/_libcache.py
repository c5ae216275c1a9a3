"""Native libraries compiled on first use: the compiler, the private cache, the build record, the loader.

What ``simd``'s C kernels and its C++ ops share: the compiler named by ``$CC`` or ``$CXX``
(:func:`compiler_command`), a private cache folder (:func:`kernel_dir`, or a new private
temporary folder when that one cannot be used), a library renamed into place with a record
of its size and hash (:func:`_install`), and a loader that maps a file only after checking
its owner, mode, record and ELF headers on the open file (:func:`_load`). See ``simd``'s
note on how the kernels are built and found.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shlex
import shutil
import signal
import stat
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional


# Every library file ends with this record, appended at build time and renamed into place with
# the library in one step: a magic, the size of the library before it and its SHA-256. A file
# is loaded only when the record matches its content, so a truncated, damaged or foreign file
# is never mapped (mapping a truncated ELF file kills the process with SIGBUS).
_RECORD = struct.Struct("<8sQ32s")
_MAGIC = b"bdsimd\x00\x02"


def kernel_dir() -> Path:
    """Where compiled kernels are cached: ``$XDG_CACHE_HOME/blockdiag/kernels`` (``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # unset, empty or relative: the XDG spec says to ignore it
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blockdiag" / "kernels"


def _private(folder: Path) -> Optional[str]:
    """Why ``folder`` may not hold libraries loaded into this process, or None.

    It must be a folder owned by this user that no one else can write. One of ours that the
    group or others may write (an older blockdiag's, or made under a permissive umask) is
    first made private: the files in it are checked one by one before use anyway. Never
    through a symbolic link: one to a folder of this user's that is private already is used,
    but one to a shared folder (``/tmp``, which root owns) is refused, its mode untouched.
    """
    st = os.stat(folder)
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    if st.st_uid != os.getuid():
        return f"{folder} is owned by user id {st.st_uid}, not by this user ({os.getuid()})"
    if st.st_mode & 0o022:
        if os.path.islink(folder):
            return (f"{folder} is a symbolic link to a folder others may write "
                    f"(mode {stat.S_IMODE(st.st_mode):o}), which is left as it is")
        os.chmod(folder, stat.S_IMODE(st.st_mode) & ~0o022, follow_symlinks=False)
        if os.stat(folder).st_mode & 0o022:
            return f"{folder} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _cache_folder(folder: Path) -> Optional[str]:
    """Make the cache ``folder`` (``.../blockdiag/kernels``) and its parent private to this user.

    Created with mode 0700 when missing, then checked (:func:`_private`). Why it cannot be
    used, or None.
    """
    try:
        folder.parent.parent.mkdir(parents=True, exist_ok=True)
        for f in (folder.parent, folder):
            try:
                os.mkdir(f, 0o700)
            except FileExistsError:
                pass
            why = _private(f)
            if why is not None:
                return why
    except OSError as e:
        return f"cannot make the kernel cache {folder}: {e}"
    return None


def _exposed(folder: Path) -> Optional[str]:
    """Why another user could swap ``folder`` (a path with no symbolic links) for a folder of theirs, or None.

    Whoever may write a folder may rename what it holds, a private folder of ours included
    (``renameat2`` swaps two at once): between :func:`_load`'s checks of a file and the
    loader's opening of its path, that user could put their own folder, and library, on the
    path. So every folder from ``folder`` up to ``/`` must be root's or this user's, and
    writable by no one else, unless its sticky bit keeps others from renaming what they do
    not own. A folder that only this user's own group may write (a umask of 002 with a group
    per user) counts as private.
    """
    for f in (folder, *folder.parents):
        st = os.lstat(f)
        if st.st_uid not in (0, os.getuid()):
            return (f"{f}, which holds the kernel cache, is owned by user id {st.st_uid}, "
                    f"who could swap the cache for a folder of theirs")
        if st.st_mode & stat.S_ISVTX:
            continue
        if st.st_mode & 0o002 or (st.st_mode & 0o020 and not _own_group(st.st_gid)):
            return (f"{f}, which holds the kernel cache, is writable by others "
                    f"(mode {stat.S_IMODE(st.st_mode):o}), who could swap the cache for a folder of theirs")
    return None


def _own_group(gid: int) -> bool:
    """Whether group ``gid`` is this user's own (named after the user, with no other members)."""
    import grp
    import pwd

    try:
        me = pwd.getpwuid(os.getuid()).pw_name
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == os.getgid() and group.gr_name == me and set(group.gr_mem) <= {me}


_PRIVATE_TEMP: list = []


def _private_temp_folder() -> Path:
    """A new folder only this user can use (``mkdtemp``: mode 0700, an unpredictable name).

    Removed at exit.
    """
    base = Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="blockdiag-kernels-", dir=base))
    if not _PRIVATE_TEMP:
        import atexit

        atexit.register(_remove_private_temp, os.getpid())
    _PRIVATE_TEMP.append(folder)
    why = _private(folder)
    if why is None:
        folder = Path(os.path.realpath(folder))
        why = _exposed(folder)
    if why is not None:
        raise OSError(why)
    return folder


def _remove_private_temp(pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that exits normally
        for folder in _PRIVATE_TEMP:
            shutil.rmtree(folder, ignore_errors=True)


def _record(library: bytes) -> bytes:
    return _RECORD.pack(_MAGIC, len(library), hashlib.sha256(library).digest())


def _damage(data: bytes) -> Optional[str]:
    """Why ``data`` (a whole library file) is not a library as built here with its record, or None."""
    if len(data) < _RECORD.size:
        return f"is {len(data)} bytes, too short for a compiled library and its build record"
    magic, size, digest = _RECORD.unpack_from(data, len(data) - _RECORD.size)
    if magic != _MAGIC:
        return "has no build record of this blockdiag (damaged, or not written by it)"
    if size != len(data) - _RECORD.size:
        return f"is damaged: {len(data) - _RECORD.size} bytes where {size} were built"
    if hashlib.sha256(memoryview(data)[:size]).digest() != digest:
        return "is damaged: its content hash differs from the one recorded when it was built"
    return _incomplete_elf(memoryview(data)[:size].tobytes())


def compiler_command(kind: str, var: str, default: str) -> tuple[Optional[tuple[str, ...]], Optional[str]]:
    """The command running the ``kind`` compiler that ``$var`` (else ``default``) names, or why none.

    The variable may hold arguments, split as a shell splits them (``ccache gcc``,
    ``gcc -m64``), as make and setuptools take ``$CC``; its first word is looked up on PATH.

    >>> compiler_command("C", "BLOCKDIAG_EXAMPLE_CC", "no-such-cc")[1]
    'no C compiler: no-such-cc is not on PATH (set $BLOCKDIAG_EXAMPLE_CC)'

    Returns:
        ``(command, None)``: the compiler's path, then the variable's arguments; or
            ``(None, why not)``.
    """
    value = os.environ.get(var) or default
    try:
        words = shlex.split(value)
    except ValueError as e:
        return None, f"no {kind} compiler: ${var} is {value!r}, which does not split into a command ({e})"
    if not words:
        return None, f"no {kind} compiler: ${var} is {value!r}, which names no command"
    path = shutil.which(words[0])
    if path is None:
        if os.sep in words[0]:  # a path is not looked up on PATH: say what is wrong with it
            what = ("is a folder" if os.path.isdir(words[0]) else
                    "is not executable" if os.path.exists(words[0]) else "does not exist")
            return None, f"no {kind} compiler: {words[0]} {what} (set ${var})"
        return None, f"no {kind} compiler: {words[0]} is not on PATH (set ${var})"
    return (path, *words[1:]), None


def _incomplete_elf(data: bytes) -> Optional[str]:
    """Why the ELF file ``data`` is cut short (a table or segment past its end), or None.

    The loader maps segments by the offsets in the headers: one past the end of the file is
    mapped past it, and the first touch kills the process (SIGBUS). A compiler that exits 0
    after writing part of its output (a full disk, a broken wrapper) leaves such a file.
    Not ELF (another platform's format): None, the loader's own checks apply.
    """
    if data[:4] != b"\x7fELF":
        return None
    if len(data) < 64 or data[4] not in (1, 2) or data[5] not in (1, 2):
        return f"is an ELF file of {len(data)} bytes with no complete header"
    end = "<" if data[5] == 1 else ">"
    if data[4] == 2:  # 64-bit
        phoff, shoff = struct.unpack_from(end + "QQ", data, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", data, 0x36)
        seg = struct.Struct(end + "8xQ16xQ")  # p_offset, p_filesz
    else:
        phoff, shoff = struct.unpack_from(end + "II", data, 0x1C)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", data, 0x2A)
        seg = struct.Struct(end + "4xI8xI")
    size = len(data)
    if phoff + phnum * phentsize > size or (shoff and shoff + shnum * shentsize > size):
        return f"is an ELF file cut short: its header tables end past its {size} bytes"
    if phnum and phentsize < seg.size:
        return f"is an ELF file with program headers of {phentsize} bytes"
    for k in range(phnum):
        offset, filesz = seg.unpack_from(data, phoff + k * phentsize)
        if offset + filesz > size:
            return f"is an ELF file cut short: segment {k} ends at byte {offset + filesz} of {size}"
    return None


@contextlib.contextmanager
def _staging(target: Path):
    """A new temporary file beside ``target`` for a compiler to write; removed unless installed.

    Raises OSError when ``target``'s folder cannot be written.
    """
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


# How long a compile may take (a first build takes seconds) and how long ``--version`` may.
COMPILE_TIMEOUT_S = 300
VERSION_TIMEOUT_S = 60


class CompilerHung(Exception):
    """The compiler ran past its time and was stopped: trying it again would only wait again."""


def run_compiler(cmd: list, timeout: float) -> subprocess.CompletedProcess:
    """``cmd``'s exit status and output; it and everything it started are killed after ``timeout`` s.

    In a session of its own, so that the whole process group can be killed: ``subprocess``'s
    timeout kills the direct child only, and a wrapper (``ccache``, a shell script) would leave
    the real compiler running. Also killed when this process is interrupted.

    Raises:
        CompilerHung: the timeout passed.
        OSError: ``cmd`` cannot be started.
    """
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as e:
        _kill_group(proc)
        if isinstance(e, subprocess.TimeoutExpired):
            raise CompilerHung(f"{cmd[0]} did not finish in {timeout:g} s and was stopped") from None
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()  # not communicate(): a process that left the group may hold the pipes open
    for pipe in (proc.stdout, proc.stderr):
        pipe.close()


def _compile(cmd: list, what: str) -> Optional[str]:
    """Run the compiler command ``cmd`` (``what`` it builds); why it failed, or None.

    Raises:
        CompilerHung: it ran past :data:`COMPILE_TIMEOUT_S`.
    """
    try:
        done = run_compiler(cmd, COMPILE_TIMEOUT_S)
    except OSError as e:
        return f"compiling {what} with {cmd[0]} failed: {e}"
    if done.returncode == 0:
        return None
    tail = " ".join(done.stderr.strip().splitlines()[-3:])
    return f"compiling {what} with {cmd[0]} failed (exit {done.returncode}): {tail}"


def _install(built: Path, target: Path, cmd: list) -> Optional[str]:
    """Append the build record to the library ``built`` and rename it to ``target`` (one step).

    Why it cannot be (the compiler wrote nothing), or None.
    """
    data = built.read_bytes()
    if not data:
        return f"the compiler {cmd[0]} exited 0 but produced no library ({' '.join(cmd)})"
    why = _incomplete_elf(data)
    if why is not None:
        return f"the compiler {cmd[0]} exited 0 but its output {why} ({' '.join(cmd)})"
    with open(built, "ab") as f:
        f.write(_record(data))
        f.flush()
        os.fsync(f.fileno())
    os.chmod(built, 0o700)
    os.replace(built, target)
    return None


def _load(path: Path) -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    """``(library, None)`` when ``path`` is this user's, private and intact, else ``(None, why not)``.

    The file is opened once (no symbolic link followed) and its owner, mode and content are
    checked on that open file; the loader then maps ``path``, which must still be that file
    (same device and inode; only this user can write the folder). Not ``/proc/self/fd/N``:
    the loader recognises libraries by name, so a later file opened under a reused
    descriptor number would get the earlier library.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return None, f"cannot open {path}: {e}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{path} is not a regular file"
        if st.st_uid != os.getuid():
            return None, f"{path} is owned by user id {st.st_uid}, not by this user ({os.getuid()})"
        if st.st_mode & 0o022:
            return None, f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
        chunks, left = [], st.st_size + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        why = _damage(b"".join(chunks))
        if why is not None:
            return None, f"{path} {why}"
        try:
            now = os.stat(path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return None, f"{path} was replaced while it was checked"
            lib = ctypes.CDLL(str(path))
            now = os.stat(path, follow_symlinks=False)
        except OSError as e:
            return None, f"cannot load the compiled kernels {path}: {e}"
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return None, f"{path} was replaced while it was loaded"
        return lib, None
    finally:
        os.close(fd)


# How long a process waits for another one building the same library (both compiles of
# ``_build``, with OpenMP and without, may each take COMPILE_TIMEOUT_S) before building its own
# copy in a private temporary folder instead.
LOCK_TIMEOUT_S = 2 * COMPILE_TIMEOUT_S + 60


@contextlib.contextmanager
def _build_lock(path: Path, what: str):
    """Hold the lock file beside ``path`` (``flock``); yields why it could not be taken in time, or None.

    Processes making their first call at once into one cache (``torchrun``, ``pytest -n``)
    each compiled the library and renamed it over the others' copy, and one whose copy was
    replaced while it loaded judged it unusable for its lifetime. Under the lock one builds
    and the others find its library. ``flock`` goes with the holder's last descriptor, so a
    killed holder leaves no stale lock. A lock file that cannot be made (a read-only cache)
    is done without: loading a library needs no lock, and building there fails anyway.
    (``profile._locked`` polls the same way; this module imports nothing of the package, so
    that processes can load it alone, as tests/test_native_hardening.py's racers do.)
    """
    import fcntl  # POSIX only, as are the compiled backends

    lock = path.with_name(f".{path.name}.lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        yield None
        return
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield (f"another process has held {lock} for over {LOCK_TIMEOUT_S:g} s "
                           f"while building {what}")
                    return
                time.sleep(0.05)
        yield None
    finally:
        os.close(fd)  # releases the lock


def _fetch(path: Path, build, use, what: str) -> tuple[Optional[object], Optional[str], bool]:
    """The library at ``path``, built there first if missing or damaged: ``(found, why not, final)``.

    ``build(path)`` compiles it (why it failed, or None; OSError when the folder cannot be
    written); ``use(library, path)`` gives ``(found, why not)`` for a loaded library; ``what``
    names it in messages. ``final``: the failure is the compiler's or the library's, which
    another folder would not change. Other processes wait meanwhile (:func:`_build_lock`).
    """
    with _build_lock(path, what) as busy:
        if busy is not None:
            return None, busy, False
        return _fetch_locked(path, build, use, what)


def _sweep_staging(path: Path) -> None:
    """Remove the staging files (:func:`_staging`) of builds of ``path`` that were killed.

    Called under the build lock, which a live build holds: every such file left is a dead
    build's (a SIGKILL skips the cleanup), or its orphaned compiler's. That compiler runs in a
    session of its own (:func:`run_compiler`), so it outlives the build killed and its linker
    writes the whole library under the staging name, after the next process has swept it and
    built the library itself: so every process that takes the lock sweeps, the one that
    finds the library built included. No process loads such a file: a build installs only its
    own staging file, and a library only with its record (:func:`_install`).
    """
    prefix = f".{path.name}."
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix) and name.endswith(".tmp"):
            try:
                os.unlink(path.parent / name)
            except OSError:
                pass


def _fetch_locked(path: Path, build, use, what: str) -> tuple[Optional[object], Optional[str], bool]:
    stale = None
    _sweep_staging(path)
    if os.path.lexists(path):
        lib, stale = _load(path)
        if lib is not None:
            return (*use(lib, path), True)
    try:
        why = build(path)
    except OSError as e:
        return None, f"cannot write {what} to {path.parent}: {e}", False
    if why is not None:
        return None, why if stale is None else f"{stale}; rebuilding it: {why}", True
    lib, why = _load(path)
    if lib is None:
        return None, f"the library just built is unusable: {why}", True
    return (*use(lib, path), True)


def _cached(name: str, fetch, what: str) -> tuple[Optional[object], Optional[str]]:
    """``fetch(path)`` (see :func:`_fetch`) for library ``name`` in the private cache folder, or,
    when that folder cannot be used, in a new private temporary folder for this process (never
    a predictable name in a shared folder, where another user could plant a library first)."""
    folder = kernel_dir()
    why = _cache_folder(folder)
    if why is None:
        # Loaded through its real path, every folder of which only this user (or root) can change.
        folder = Path(os.path.realpath(folder))
        why = _exposed(folder)
    if why is None:
        found, why, final = fetch(folder / name)
        if found is not None or final:
            return found, why
    try:
        temp = _private_temp_folder()
    except OSError as e:
        return None, f"no usable folder for {what}: {why}; no private temporary folder either: {e}"
    found, why2, _ = fetch(temp / name)
    if found is not None:
        UNCACHED[name] = f"built for this process only in {temp}, since the cache could not be used: {why}"
    return found, None if found is not None else f"{why2} (the cache could not be used: {why})"


# Library name -> why this process built it outside the cache (every process then compiles it
# again: about a minute each, which ``blockdiag explain`` should account for).
UNCACHED: dict = {}
