"""Every Python block of README.md and docs/*.md runs as written.

A block is run on its own, in a fresh process, in an empty folder, with the profile pointed
into that folder (a snippet that tunes must not write the user's). Blocks that include a
file (``--8<--``) are the example files, run by their own tests; a block that cannot run
here says why in an HTML comment on the line before it, which the page does not show:
``<!-- not run by tests/test_docs_snippets.py: reason -->``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "<!-- not run by tests/test_docs_snippets.py:"
FENCE = re.compile(r"^( *)```python[^\n]*\n(.*?)^\1```", re.S | re.M)


def _blocks():
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            code = "\n".join(s[len(m.group(1)):] for s in m.group(2).splitlines())
            if "--8<--" in code or before.strip().startswith(NOT_RUN):
                continue
            yield pytest.param(code, id=f"{page.relative_to(ROOT)}:{line}")


BLOCKS = list(_blocks())


def test_the_pages_have_runnable_blocks():
    # The collection itself: a changed fence or marker must not silently run nothing.
    assert len(BLOCKS) >= 5, [b.id for b in BLOCKS]


@pytest.mark.parametrize("code", BLOCKS)
def test_the_block_runs(code, tmp_path):
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
