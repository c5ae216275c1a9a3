"""Writing files safely: links resolved as ``open`` would, and atomic replacement.

The profile, ``bench --json`` and ``--plot`` write files that users keep, often in shared
folders (``/tmp``) or through links. Two rules hold for every such write: a symbolic link
is followed only where ``open`` would follow it (:func:`real_path`), and the new content
replaces the old in one rename after it is on disk (:func:`write_atomic`), so a reader,
a crash or a full disk never meets a half-written file.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words, from its ``st_mode`` (for messages)."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def real_path(path: Path | str) -> Path:
    """``os.path.realpath(path)``, refusing a symbolic link that Linux would not follow for ``open``.

    ``realpath`` reads links (``readlink``), which ``fs.protected_symlinks`` does not check:
    ``open`` refuses to follow a link in a sticky folder that anyone may write (``/tmp``) when
    the link is another user's and not the folder owner's. Through ``realpath`` such a planted
    link (at ``FILE.partial``, say, a name made up here) redirected a write to any file of this
    user's. Links are resolved one by one here and held to that rule, wherever the system's
    setting stands.

    Raises:
        OSError: a link on the way is another user's in such a folder, or there are too many.
    """
    path = os.fspath(path)
    full = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    pending = list(reversed(Path(full).parts))  # ".." kept: resolved after the link before it, as the kernel does
    done, hops = Path("/"), 0
    while pending:
        part = pending.pop()
        if part == "/" or part == "..":
            done = Path("/") if part == "/" else done.parent
            continue
        step = done / part
        try:
            st = os.lstat(step)
        except FileNotFoundError:
            st = None
        if st is None or not stat.S_ISLNK(st.st_mode):
            done = step
            continue
        hops += 1
        if hops > 40:
            raise OSError(f"refusing to write {path}: too many symbolic links on the way")
        folder = os.stat(done)
        shared = folder.st_mode & stat.S_ISVTX and folder.st_mode & stat.S_IWOTH
        if shared and st.st_uid not in (os.geteuid(), folder.st_uid):
            raise OSError(f"refusing to write {path}: {step} is a symbolic link of user id {st.st_uid} "
                          f"in the shared folder {done}, which open() would not follow (fs.protected_symlinks)")
        pending.extend(reversed(Path(os.readlink(step)).parts))
    return done


def write_atomic(path: Path | str, write: Callable[[str], None], suffix: str = ".tmp") -> None:
    """Have ``write(temp)`` fill a new file beside ``path``, then rename it over ``path``.

    Readers see the old file or the new one, never a half-written one; on any error the
    temp file is removed and ``path`` is untouched. The new file is flushed to disk before
    the rename (the rename can reach the disk before the data: a crash would leave an empty
    file where the old one was) and keeps the mode of the file it replaces, else 0644. A
    symbolic link is written through (its target is replaced, the link kept), as an ordinary
    write would, and refused where an ordinary ``open`` would refuse it (:func:`real_path`).

    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "notes.txt"
    >>> write_atomic(p, lambda tmp: Path(tmp).write_text("hello"))
    >>> p.read_text()
    'hello'

    Args:
        path: the file to replace or create.
        write: called with the temp file's path; writes the whole content there.
        suffix: the temp file's suffix (a writer that takes its format from the name, such
            as matplotlib's ``savefig``, needs ``path``'s own).

    Raises:
        OSError: ``path`` names something other than a regular file (a FIFO, a device, a
            directory): renaming over it would replace that node, not write to it; or a
            symbolic link on the way is another user's in a shared folder (:func:`real_path`).
    """
    p = real_path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OSError(f"refusing to write {path}: not a regular file: it is {file_kind(st.st_mode)}")
    # mkstemp creates the file 0600; a profile or a results file is not a secret. Keep the
    # mode of the file replaced, else 0644 (reading the umask is not thread-safe).
    mode = st.st_mode & 0o777 if st is not None else 0o644
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=suffix, dir=p.parent)
    os.close(fd)
    try:
        os.chmod(tmp, mode)
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json_atomic(path: Path | str, obj: Any) -> None:
    """Write ``obj`` as JSON (indented, keys sorted) to ``path`` through :func:`write_atomic`.

    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "r.json"
    >>> write_json_atomic(p, {"b": 1, "a": 2})
    >>> json.loads(p.read_text())
    {'a': 2, 'b': 1}

    Raises:
        OSError: as :func:`write_atomic`.
    """
    def dump(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)

    write_atomic(path, dump)
