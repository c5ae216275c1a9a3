"""The source itself: what a reviewer would otherwise have to catch by eye."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The package whose job is to print: the command line and its formatting.
PRINTING = ROOT / "blockdiag" / "cli"


def test_pyflakes_finds_nothing():
    # Unused imports and names, undefined names, shadowed loop variables: ruff's F rules over
    # the library, scripts, docs' Python and tests (ruff comes with the docs extra).
    pytest.importorskip("ruff")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "F",
                          "--output-format", "concise", str(ROOT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_library_prints_only_from_the_command_line():
    # A print left in library code writes into every user's output; the CLI prints on purpose.
    # Docstring examples are strings, not calls, so ast does not see them.
    found = []
    for path in sorted((ROOT / "blockdiag").rglob("*.py")):
        if path.is_relative_to(PRINTING):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("print", "breakpoint"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}()")
    assert not found, found


def test_scripts_write_their_json_reports_atomically():
    # A report written in place is half a file when the run is interrupted or the disk fills,
    # and a fixed "<path>.tmp" beside it can be another user's link in a shared folder:
    # every script writes its --json report through blockdiag.profile.write_json_atomic.
    found = []
    for path in sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "dump" and getattr(node.func.value, "id", None) == "json"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} json.dump()")
    assert not found, found


def test_every_file_the_native_builds_include_names_their_cached_library():
    # The compiled kernels are cached under a name hashing their sources: a file the build
    # includes but the name does not hash (a header edited by an upgrade) would leave the
    # old library loaded, its kernels no longer the source's.
    from blockdiag.backends import _simd_ops, simd

    here = ROOT / "blockdiag" / "backends"

    def includes(name, seen):
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', (here / name).read_text(), re.M):
            if inc not in seen:
                seen.add(inc)
                includes(inc, seen)
        return seen

    assert includes("_simd.c", set()) <= set(simd._SOURCES)
    assert "_simd.c" in simd._SOURCES
    # The C++ ops' name hashes their one source file only.
    assert includes(_simd_ops._SOURCE, set()) == set()


def test_pyproject_gives_every_dependency_a_floor():
    # An unbounded requirement lets pip keep (or pick) a release that nothing here ran against:
    # virtualenv before 20.4 makes asv environments whose pip cannot install torch's wheels.
    # docs/installation.md lists the floors that were tested.
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    reqs = [*project["dependencies"], *(r for extra in extras for r in extra)]
    floors = (">=", ">", "==", "~=", "===")
    unbounded = [r for r in reqs if not any(s.operator in floors for s in Requirement(r).specifier)]
    assert not unbounded, f"pyproject.toml: no lower bound for {unbounded}"
