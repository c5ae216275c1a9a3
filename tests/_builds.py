"""Fast native builds for the tests that build simd's libraries in a cache of their own.

simd's C kernels take about a minute to compile at ``-O3`` on a CI core, and about a dozen
tests check how a build is made, found, cached, shared, damaged or refused: each paid that
minute, and together they were half of CI's test time. What those tests check does not depend
on how well the kernels are optimised, so they build them with :func:`quick_compiler`
(``-O0``, a few seconds) or start from :func:`seed_cache` (this process's libraries, copied).
A test whose point is the real build flags (``-O3`` reaching the compiler) still sees them:
the wrapper passes every argument on and appends ``-O0`` last, which the compiler honours.

Imported by the test modules as ``from _builds import ...`` (pytest puts ``tests/`` on the path).
"""

import os
import shlex
import shutil
from pathlib import Path


def quick_compiler(folder: Path, var: str = "CC", default: str = "cc", then: str = "") -> str:
    """Write ``folder/<var>``: the compiler ``$var`` names, building at ``-O0``; return its path.

    Args:
        folder: where the wrapper script goes (created).
        var: ``"CC"`` or ``"CXX"``; the wrapper runs the compiler that variable names now
            (arguments included), else ``default``.
        default: the compiler when ``$var`` is unset.
        then: shell lines run after a successful compile (``$out`` is the ``-o`` file).

    Returns:
        The wrapper's path, to be put in ``$CC``/``$CXX``.
    """
    real = shlex.split(os.environ.get(var) or default)
    real[0] = shutil.which(real[0]) or real[0]
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / var.lower()
    script.write_text(
        "#!/bin/sh\n"
        'out=""; prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
        f'{shlex.join(real)} "$@" -O0 || exit $?\n'
        f"{then}"
    )
    script.chmod(0o755)
    return str(script)


def seed_cache(cache_home: Path, patterns=("simd-*.so",)) -> list:
    """Copy the libraries this process loaded, of names matching ``patterns``, into ``cache_home``.

    A fresh process whose ``$XDG_CACHE_HOME`` is ``cache_home`` then finds them in its kernel
    folder, as it would after its own build with the same compiler, flags and source (the names
    hash all of those), and builds only what was not copied. The folders are made private, as
    simd makes them. Only the files mapped into this process are copied (``/proc/self/maps``,
    after one simd product): a long-lived cache also holds the builds of older sources.
    Returns the copies (none where this process loaded nothing from its own cache).
    """
    import torch

    from blockdiag import grouped_linear
    from blockdiag.backends import _libcache, get

    if get("simd").unavailable_reason() is None:  # builds and loads this process's libraries
        grouped_linear(torch.randn(4, 6), torch.randn(2, 3, 3), None, backend="simd")
    source = _libcache.kernel_dir().resolve()
    mapped = {Path(line.split(maxsplit=5)[5]) for line in Path("/proc/self/maps").read_text().splitlines()
              if len(line.split(maxsplit=5)) == 6}
    dest = cache_home / "blockdiag" / "kernels"
    for folder in (cache_home, cache_home / "blockdiag", dest):
        folder.mkdir(mode=0o700, exist_ok=True)
    return [Path(shutil.copy2(lib, dest / lib.name)) for lib in sorted(mapped)
            if lib.parent == source and any(lib.match(p) for p in patterns)]
