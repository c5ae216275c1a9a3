"""Every Python block of README.md and docs/*.md runs as written.

A block is run on its own, in a fresh process, in an empty folder, with the profile pointed
into that folder (a snippet that tunes must not write the user's). A block that includes a
file (``--8<-- "file"``, from ``docs/``) runs that file; so does every ``python -c "..."``
line of a shell block (the one-liners the pages give to check or prepare an installation).
A block that cannot run here says why in an HTML comment on the line before it, which the
page does not show: ``<!-- not run by tests/test_docs_snippets.py: reason -->``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "<!-- not run by tests/test_docs_snippets.py:"
FENCE = re.compile(r"^( *)```python[^\n]*\n(.*?)^\1```", re.S | re.M)
SHELL_FENCE = re.compile(r"^( *)```bash[^\n]*\n(.*?)^\1```", re.S | re.M)
# mkdocs' pymdownx.snippets, base_path docs/ (mkdocs.yml).
INCLUDE = re.compile(r'^--8<-- "([^"]+)"\s*$')


def _blocks():
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            code = "\n".join(s[len(m.group(1)):] for s in m.group(2).splitlines())
            if before.strip().startswith(NOT_RUN):
                continue
            included = INCLUDE.match(code.strip())
            if included:  # the page shows that file: run it
                code = (ROOT / "docs" / included.group(1)).read_text()
            assert "--8<--" not in code, f"{page.name}:{line}: an include this test cannot read"
            yield pytest.param(code, id=f"{page.relative_to(ROOT)}:{line}")
        for m in SHELL_FENCE.finditer(text):
            first = text.count("\n", 0, m.start()) + 2
            for k, cmd in enumerate(m.group(2).splitlines()):
                words = shlex.split(cmd, comments=True) if cmd.strip().startswith("python -c") else []
                if words[:2] == ["python", "-c"] and len(words) == 3:
                    yield pytest.param(words[2], id=f"{page.relative_to(ROOT)}:{first + k}")


BLOCKS = list(_blocks())


def test_the_pages_have_runnable_blocks():
    # The collection itself: a changed fence or marker must not silently run nothing.
    assert len(BLOCKS) >= 5, [b.id for b in BLOCKS]


def test_the_included_examples_and_the_shell_one_liners_are_collected():
    # The Quickstart's file had no test of its own (only .ci/docs.sh, where the docs extra is
    # installed), and the shell blocks' `python -c` lines none at all.
    codes = [b.values[0] for b in BLOCKS]
    for name in ("quickstart_example.py", "extending_example.py"):
        assert (ROOT / "docs" / name).read_text() in codes, name
    assert any("blockdiag.list_backends()" in c and "sep='\\n'" in c for c in codes), codes
    assert any("backend='simd'" in c for c in codes), codes


@pytest.mark.parametrize("code", BLOCKS)
def test_the_block_runs(code, tmp_path):
    if "backend='simd'" in code:  # naming simd raises where it cannot run (no C compiler)
        from blockdiag.backends import get

        why = get("simd").unavailable_reason()
        if why is not None:
            pytest.skip(f"simd unavailable here: {why}")
    env = dict(os.environ, BLOCKDIAG_PROFILE=str(tmp_path / "profile.json"), PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, f"exit status {p.returncode}:\n{p.stderr[-4000:]}"


def test_the_tuning_guide_lists_every_setting_and_its_variable():
    # The settings table and the environment variables of the precedence list, against
    # blockdiag.Settings: a setting added to the code must not be missing from the guide.
    import dataclasses

    from blockdiag import settings

    page = (ROOT / "docs" / "tuning.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", page.split("## The settings and their precedence")[1], re.M))
    assert {f.name for f in dataclasses.fields(settings.Settings)} <= rows, rows
    for var, _ in settings._ENV.values():
        assert f"`{var}`" in page, var


CLI_COMMAND = re.compile(r"blockdiag (demo|tune|explain|bench)((?:[ \t]+(?:\\\n[ \t]*)?(?!#)[^\s`|]+)*)")


def test_the_commands_on_the_pages_use_options_that_exist():
    # Every option of a `blockdiag <command> ...` written on a page is one of that command's
    # (the option names only: values such as --device cuda need the device to parse).
    import argparse

    from blockdiag.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    seen = 0
    for page in PAGES:
        if page.name == "changelog.md":  # history: it names options as they were
            continue
        for m in CLI_COMMAND.finditer(page.read_text()):
            known = set(sub.choices[m.group(1)]._option_string_actions)
            for option in re.findall(r"(?<![\w-])--?[a-z][\w-]*", m.group(2)):
                seen += 1
                assert option in known, f"{page.name}: {m.group(0)!r}: {option} is not an option of {m.group(1)}"
    assert seen >= 10, seen
