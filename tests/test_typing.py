"""blockdiag is a typed package (PEP 561): a user's type checker reads its annotations.

``blockdiag/py.typed`` tells mypy and pyright to use the package's own annotations instead of
reporting "missing library stubs or py.typed marker". That is only right while the public
annotations accept what the docs say users may pass: ``tests/typing/usage.py`` writes every
documented call form as a user would, and mypy ``--strict`` must find nothing in it.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# mypy reports no error inside an installed package (it checks the user's code against it):
# blockdiag's own bodies are silenced here alike, so that this test sees what a user sees.
# Run from the repository root, mypy finds blockdiag there, whatever the install (an editable
# install's import hook is one mypy cannot follow).
CONFIG = """\
[mypy]
strict = True

[mypy-blockdiag.*]
ignore_errors = True
"""


def test_the_wheel_ships_the_py_typed_marker():
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    assert (ROOT / "blockdiag" / "py.typed").is_file()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["blockdiag"], package_data


def test_the_documented_usage_type_checks_under_mypy_strict(tmp_path):
    pytest.importorskip("mypy")
    config = tmp_path / "mypy.ini"
    config.write_text(CONFIG)
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir", str(tmp_path / "cache"),
         "--show-error-codes", str(Path("tests", "typing", "usage.py"))],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_public_annotations_resolve_at_run_time():
    """``typing.get_type_hints`` (what typeguard, beartype and jsonargparse call) resolves every
    public function's annotations: a name imported only under ``TYPE_CHECKING`` raised NameError."""
    import importlib
    import inspect
    import typing

    failures = []
    for mod_name in ("blockdiag", "blockdiag.testing", "blockdiag.distributed", "blockdiag.construct",
                     "blockdiag.masked", "blockdiag.settings", "blockdiag.dispatch", "blockdiag.backends"):
        mod = importlib.import_module(mod_name)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if not callable(obj):
                continue
            targets = [(name, obj)]
            if inspect.isclass(obj):
                targets += [(f"{name}.{k}", v) for k, v in vars(obj).items() if not k.startswith("_") and callable(v)]
            for label, target in targets:
                try:
                    typing.get_type_hints(target)
                except NameError as e:
                    failures.append(f"{mod_name}.{label}: {e}")
    assert not failures, failures
