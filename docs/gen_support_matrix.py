"""Backend support matrix for the docs, generated from the registry's declared constraints.

Used as an mkdocs hook (``hooks:`` in mkdocs.yml): ``<!-- support-matrix -->`` in a page is
replaced by the tables, ``<!-- decision-map -->`` by the decision-map picture (or, while
``docs/img/decision-map.png`` has not been generated, by how to generate it), and
``<!-- api-reference -->`` by one API entry per name in ``blockdiag.__all__``. Run as a script
to print the tables: ``python docs/gen_support_matrix.py``.

Everything comes from the registry (``Backend.dtypes``, ``grad``, ``sparse``, ``requires``,
``constraint``), so a new backend appears here without editing the docs.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Document the checkout being built, not whatever blockdiag happens to be installed.
sys.path.insert(0, str(ROOT))

import torch

import blockdiag
from blockdiag.backends._registry import Problem, names, registry

DEVICES = ("cpu", "cuda")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# Shapes that exercise the shape rules backends declare (empty batch, one group, thin and
# square blocks, sizes that are not multiples of 8 or 16).
PROBES = [
    Problem(b, g, i, o, torch.float32, dev, grad)
    for b, g, (i, o), dev, grad in itertools.product(
        (0, 1, 32), (1, 4, 50), ((150, 10), (64, 64), (10, 10), (6, 4)), DEVICES, (False, True)
    )
]
MAP = Path(__file__).resolve().parent / "img" / "decision-map.png"


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _cell(backend, device: str, dtype: torch.dtype) -> str:
    ok = backend.dtypes.get(device, frozenset())
    if dtype not in ok:
        return "–"
    if not backend.grad:
        return "fwd"
    return "fwd + bwd²" if getattr(backend, "double_grad", True) else "fwd + bwd"


def _shape_rules(backend) -> str:
    if backend.constraint is None:
        return "none"
    why = backend.unavailable_reason()
    if why:
        # The registry asks a constraint only of an available backend: it may need the package.
        return f"not probed (unavailable where these docs were built: {why})"
    reasons = []
    for p in PROBES:
        if p.device not in backend.dtypes:
            continue
        why = backend.constraint(p)
        if why and why not in reasons:
            reasons.append(why)
    return "; ".join(reasons) if reasons else "none on the probed shapes"


def support_matrix_markdown() -> str:
    """The support tables as Markdown."""
    reg = registry()
    tables = []
    for device in DEVICES:
        head = f"| backend ({device}) | layout | " + " | ".join(_short(t) for t in DTYPES) + " |"
        rows = [head, "|" + "---|" * (2 + len(DTYPES))]
        for n in names():
            b = reg[n]
            layout = "sparse" if b.sparse else "dense"
            cells = " | ".join(_cell(b, device, t) for t in DTYPES)
            rows.append(f"| `{n}` | {layout} | {cells} |")
        tables.append("\n".join(rows))
    table = "\n\n".join(tables)
    legend = (
        "*fwd + bwd*: forward and backward (gradients for input, weight and bias), first-order "
        "only (a `create_graph=True` backward raises `BlockDiagError`); *fwd + bwd²*: the "
        "backward is itself differentiable (double backward, gradient penalties); *fwd*: "
        "forward only; *–*: declined (`auto` skips it, a fixed `backend=` raises "
        "`BlockDiagError` with the reason). *sparse* backends are candidates for `auto` "
        "only above the sparsity threshold."
    )

    notes = ["| backend | needs | shape rules (why it declines a problem) | summary |", "|---|---|---|---|"]
    for n in names():
        b = reg[n]
        needs = f"`{b.requires.replace('_', '-')}`" if b.requires else "torch only"
        notes.append(f"| `{n}` | {needs} | {_shape_rules(b)} | {b.summary} |")
    return f"{table}\n\n{legend}\n\n{chr(10).join(notes)}\n"


def decision_map_markdown() -> str:
    if MAP.exists():
        return (
            "![Decision map: the backend auto picks per (groups, block) shape]"
            "(img/decision-map.png)\n"
        )
    return (
        '!!! note "Decision map not generated yet"\n'
        "    Generate it on the machine you care about with\n"
        "    `blockdiag tune --plot docs/img/decision-map.png`; the docs build picks it up.\n"
    )


def _docstring_markdown(doc: str) -> str:
    """A Google-style docstring as Markdown: ``>>>`` examples fenced, section titles bold."""
    out, in_example = [], False
    for line in inspect.cleandoc(doc).splitlines():
        if line.startswith((">>>", "...")) and not in_example:
            out.append("```pycon")
            in_example = True
        if in_example and not line.strip():
            out.append("```")
            in_example = False
        if not in_example and line.rstrip(":") in ("Args", "Returns", "Raises") and line.endswith(":"):
            line = f"**{line}**"
        out.append(line)
    if in_example:
        out.append("```")
    return "\n".join(out)


def _manual_entry(name: str, obj) -> str:
    sig = re.sub(r"\bblockdiag(\.\w+)*\.(?=[A-Z])", "", str(inspect.signature(obj)))
    return (
        f"## `{name}` {{ #blockdiag.{name} }}\n\n"
        f"```python\nblockdiag.{name}{sig}\n```\n\n{_docstring_markdown(obj.__doc__ or '')}\n"
    )


def api_reference_markdown() -> str:
    """One mkdocstrings entry per public name, in ``blockdiag.__all__`` order."""
    out = []
    for name in blockdiag.__all__:
        obj = getattr(blockdiag, name)
        if name == "__version__":
            out.append(f"## `__version__`\n\nThe package version, `{obj!r}` in this build.\n")
        elif not inspect.ismodule(obj) and importlib.util.find_spec(f"blockdiag.{name}") is not None:
            # A public function named like a subpackage (``blockdiag.backends()``): static
            # analysis would document the subpackage, so render the function from runtime.
            out.append(_manual_entry(name, obj))
        else:
            out.append(f"::: blockdiag.{name}\n")
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """mkdocs hook: fill in the generated sections."""
    if "<!-- support-matrix -->" in markdown:
        markdown = markdown.replace("<!-- support-matrix -->", support_matrix_markdown())
    if "<!-- decision-map -->" in markdown:
        markdown = markdown.replace("<!-- decision-map -->", decision_map_markdown())
    if "<!-- api-reference -->" in markdown:
        markdown = markdown.replace("<!-- api-reference -->", api_reference_markdown())
    return markdown


if __name__ == "__main__":
    print(support_matrix_markdown())
