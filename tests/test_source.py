"""The source itself: what a reviewer would otherwise have to catch by eye."""

import ast
import os
import re
import subprocess
import sys
import textwrap
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


def _pyproject():
    """pyproject.toml's [project] table, read with tomllib (Python 3.11+) or tomli before it."""
    # pytest itself requires tomli below Python 3.11, so the oldest supported Python checks too.
    toml = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    return toml.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_pyproject_gives_every_dependency_a_floor():
    # An unbounded requirement lets pip keep (or pick) a release that nothing here ran against:
    # virtualenv before 20.4 makes asv environments whose pip cannot install torch's wheels.
    # docs/installation.md lists the floors that were tested.
    from packaging.requirements import Requirement

    project = _pyproject()
    extras = project["optional-dependencies"].values()
    reqs = [*project["dependencies"], *(r for extra in extras for r in extra)]
    floors = (">=", ">", "==", "~=", "===")
    unbounded = [r for r in reqs if not any(s.operator in floors for s in Requirement(r).specifier)]
    assert not unbounded, f"pyproject.toml: no lower bound for {unbounded}"


# Pinned releases that publish no wheel for a Python that requires-python admits: the name,
# the first release without one, and that Python. A bare pin of such a release makes
# `pip install -e ".[test]"` fail to resolve there (nothing of the extra installs).
NO_WHEEL_FROM = [("onnxruntime", "1.24", "3.10")]


def test_pyproject_pins_resolve_on_every_supported_python():
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = _pyproject()
    oldest = re.fullmatch(r">=\s*(3\.\d+)", project["requires-python"]).group(1)
    reqs = [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    for name, first_without, python in NO_WHEEL_FROM:
        assert Version(python) >= Version(oldest), f"{name}: {python} is below requires-python; drop it"
        env = {"python_version": python, "python_full_version": f"{python}.0"}
        here = [r for r in reqs if r.name == name and (r.marker is None or r.marker.evaluate(env))]
        pins = [Version(s.version) for r in here for s in r.specifier if s.operator == "=="]
        assert all(v < Version(first_without) for v in pins), (
            f"pyproject.toml pins {name} to {[str(r) for r in here]} on Python {python}, "
            f"which has no wheel there from {first_without} on")


def test_everything_but_the_scipy_interop_runs_without_scipy(tmp_path):
    # SciPy is optional (pyproject.toml): the layers, the builders, the chooser, the CLI and
    # blockdiag.testing's loop reference must run where it is not installed, and the scipy
    # functions must say how to install it rather than fail with a bare ModuleNotFoundError.
    script = textwrap.dedent("""
        import subprocess, sys
        sys.modules["scipy"] = None  # as if not installed: importing it raises ImportError
        import torch, blockdiag
        from blockdiag import GroupedLinear, GroupedMLP, BlockDiagError
        from blockdiag.testing import reference_loop, reference_scipy
        blocks = torch.randn(2, 3, 4)
        for backend in ("auto", "loop", "dense", "bmm", "csr", "bsr"):
            m = GroupedLinear(8, 6, groups=2, backend=backend)
            x = torch.randn(5, 8, requires_grad=True)
            m(x).sum().backward()
            torch.testing.assert_close(m(x), reference_loop(x, m.weight, m.bias))
        GroupedMLP(8, 6, 2, heads=2)(torch.randn(3, 8)).sum().backward()
        for build in (blockdiag.block_diag_dense, blockdiag.block_diag_csr, blockdiag.block_diag_bsr,
                      blockdiag.block_diag_coo):
            torch.testing.assert_close(blockdiag.to_blocks(build(blocks), 2), blocks)
        try:
            blockdiag.to_blocks([[1.0]], 1)
        except BlockDiagError as e:
            assert "scipy sparse matrix, got list" in str(e), e
        else:
            raise AssertionError("to_blocks took a list")
        for call in (lambda: blockdiag.to_scipy(torch.eye(4)), lambda: blockdiag.from_scipy(object(), 1),
                     lambda: reference_scipy(torch.ones(1, 4), torch.ones(2, 1, 2), None)):
            try:
                call()
            except ImportError as e:
                assert "needs SciPy" in str(e) and "pip install" in str(e), e
            except BlockDiagError as e:
                assert "scipy sparse matrix, got object" in str(e), e
            else:
                raise AssertionError("ran without scipy")
        from blockdiag.cli import main
        assert main(["explain", "--batch", "4", "--groups", "2", "--block", "4x3"]) == 0
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "BLOCKDIAG_PROFILE": str(tmp_path / "p.json")})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_a_scipy_that_does_not_import_is_not_called_missing(tmp_path):
    # A SciPy that is installed but fails to import (a shared library missing, built for
    # another numpy) was reported as "not installed: pip install 'scipy>=1.10'", advice that
    # changes nothing (pip says it is already satisfied); the cause was only in the chain.
    (tmp_path / "scipy").mkdir()
    (tmp_path / "scipy" / "__init__.py").write_text('raise ImportError("libgfortran.so.5: cannot open")\n')
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        import torch, blockdiag
        from blockdiag.testing import reference_scipy
        for call in (lambda: blockdiag.to_scipy(torch.eye(2)),
                     lambda: reference_scipy(torch.ones(1, 2), torch.ones(1, 2, 1), None)):
            try:
                call()
            except ImportError as e:
                assert "installed but does not import: libgfortran.so.5" in str(e), e
                assert "not installed" not in str(e), e
            else:
                raise AssertionError("ran with a broken scipy")
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "BLOCKDIAG_PROFILE": str(tmp_path / "p.json")})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
