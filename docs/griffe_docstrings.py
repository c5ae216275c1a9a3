"""Griffe extension for the API reference: docstrings written for pytest and Sphinx readers.

blockdiag's docstrings put their ``>>>`` examples (run as doctests) right after the summary
and cross-reference with Sphinx roles (``:class:`Plan```). Markdown would read the examples as
block quotes and print the roles literally, so before rendering this fences each example as a
``pycon`` code block and turns each role into inline code.
"""

from __future__ import annotations

import re

from griffe import Extension, Object

# :class:`~blockdiag.backends.Problem` -> `Problem`; :func:`backends` -> `backends`
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([\w.]+)`")


def _role(match: re.Match) -> str:
    full = match.group(0)
    name = match.group(1)
    return f"`{name.rsplit('.', 1)[-1]}`" if "`~" in full else f"`{name}`"


def fence_doctests(text: str) -> str:
    """Wrap each run of doctest lines (``>>>`` up to the next blank line) in a pycon fence."""
    out: list[str] = []
    indent = None
    for line in text.splitlines():
        stripped = line.lstrip()
        if indent is None and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
        elif indent is not None and not stripped:
            out.append(f"{indent}```")
            indent = None
        out.append(line)
    if indent is not None:
        out.append(f"{indent}```")
    return "\n".join(out)


class DocstringsForMarkdown(Extension):
    """Applied to every object griffe loads, before mkdocstrings renders it."""

    def on_object(self, *, obj: Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(_ROLE.sub(_role, obj.docstring.value))


def check(package: str = "blockdiag", search_path: str = ".") -> list[str]:
    """Parse every docstring of ``package`` as the site does; return griffe's warnings.

    The site build only parses the docstrings it renders; this parses all of them (with the
    options of mkdocs.yml), so a malformed section is found before a page starts rendering it.
    """
    import logging

    import griffe

    messages: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    log = logging.getLogger("griffe")
    handler = _Collect()
    log.addHandler(handler)
    try:
        pkg = griffe.load(
            package,
            search_paths=[search_path],
            docstring_parser="google",
            extensions=griffe.load_extensions(DocstringsForMarkdown),
        )

        def walk(obj):
            yield obj
            for member in obj.members.values():
                if not member.is_alias:
                    yield from walk(member)

        for obj in walk(pkg):
            if obj.docstring is not None:
                obj.docstring.parse("google", warn_missing_types=False, returns_multiple_items=False)
    finally:
        log.removeHandler(handler)
    return messages


if __name__ == "__main__":
    import sys

    found = check()
    print("\n".join(found) or "no griffe warnings")
    sys.exit(1 if found else 0)
