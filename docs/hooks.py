"""The docs site's generated sections: every table of backends, winners and timings.

Used as an mkdocs hook (``hooks:`` in mkdocs.yml). A marker in a page is replaced, when the
site is built, by Markdown generated from the code and from committed measurements, so no
count, winner or timing in the docs is typed by hand:

``<!-- support-matrix -->``
    dtypes, backward and shape rules of every backend, from the registry.
``<!-- which-backend -->``
    which backend the built-in table picks, by device, block shape and mode, and how
    often each backend is the fastest there (``blockdiag/_defaults.json``).
``<!-- builtin-tables -->``
    the machines the built-in table was measured on.
``<!-- decision-map -->``
    the decision-map picture (or how to draw it).
``<!-- api-reference -->``
    one API entry per name in ``blockdiag.__all__``.
``<!-- bench: FILE -->``
    a ``blockdiag bench --json`` file from ``docs/results/``: its machine and command, the
    summary per mode, each backend's standing and, folded, every point.
``<!-- bench-compiled: FILE -->``, ``<!-- bench-distributed: FILE -->``,
``<!-- bench-summaries: FILE -->``, ``<!-- allocator: FILE -->``,
``<!-- mlp-strategy: FILE -->``, ``<!-- asv-time-noise: FILE -->``,
``<!-- asv-history: FILE -->``, ``<!-- asv-stability: FILE -->``, ``<!-- asv-experiment: FILE -->``
    the other result files (``bench --compiled``, ``scripts/bench_distributed.py``, earlier
    bench summaries, the allocator comparison, ``scripts/bench_mlp_strategy.py``, asv runs
    of unchanged code, the published asv history, the stability of its ratios, and the
    injected-slowdown experiment).
``<!-- results-index -->``
    every file in ``docs/results/`` with the command that wrote it.
``<!-- explain: ARGS -->``
    what ``blockdiag explain ARGS`` prints on the machine building the docs, with the
    built-in table.

Run as a script to print the generated sections: ``python docs/hooks.py``.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import json
import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
RESULTS = DOCS / "results"
# Document the checkout being built, not whatever blockdiag happens to be installed.
sys.path.insert(0, str(ROOT))

import torch

import blockdiag
from blockdiag import profile as _profile
from blockdiag.backends._registry import Problem, names, registry

DEVICES = ("cpu", "cuda")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# Shapes that exercise the shape rules backends declare (empty batch, blocks with an empty
# side, one group, thin and square blocks, sizes that are not multiples of 8 or 16).
PROBES = [
    Problem(b, g, i, o, torch.float32, dev, grad)
    for b, g, (i, o), dev, grad in itertools.product(
        (0, 1, 32),
        (1, 4, 50),
        ((150, 10), (64, 64), (10, 10), (6, 4), (0, 4), (4, 0)),
        DEVICES,
        (False, True),
    )
]
MAP = DOCS / "img" / "decision-map.png"
MODES = (("forward", "forward"), ("train", "training"))


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _geomean(values) -> float:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


# --------------------------------------------------------------------------- the registry


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


# --------------------------------------------------------------------------- the built-in table


def _builtin() -> dict:
    return json.loads(_profile.DEFAULTS_PATH.read_text())


def _entry_label(key: str, entry: dict) -> str:
    """A short column title: the machine, the SIMD variant its CPU times were taken with, and
    the thread count (the table holds one entry per CPU and thread count, so without it two
    columns would read the same)."""
    full = entry.get("device_name", key.split("|")[0])
    threads = re.search(r"\((\d+) threads?\)", full)
    name = re.sub(r"\s*\(\d+ threads?\)", "", full)
    name = re.sub(r"\(R\)|\bProcessor\b|\bCPU\b", "", name).replace("  ", " ").strip()
    if entry.get("device") == "cpu":
        variant = entry.get("simd_variant") or (key.split("|")[3] if key.count("|") >= 3 else "")
        isa = {"avx512": "AVX-512", "avx2": "AVX2", "neon": "NEON"}.get(variant, variant)
        name = f"{name} CPU, {isa}" if isa else f"{name} CPU"
    if threads:
        n = int(threads.group(1))
        name += f", {n} thread" + ("" if n == 1 else "s")
    return name


def _entries_in_order(table: dict):
    """Entries by device type (CPU first), the table's named default of each type first."""
    defaults = set(table.get("defaults", {}).values())
    entries = table["entries"]
    return sorted(entries.items(), key=lambda kv: (kv[1].get("device") != "cpu", kv[0] not in defaults, kv[0]))


def _winners(entry: dict):
    """(mode, block) -> Counter of the fastest backend over that entry's measured points."""
    out: dict = {}
    for m in entry["measurements"]:
        times = m.get("times_us") or {}
        if not times:
            continue
        best = min(times, key=times.get)
        out.setdefault((m["mode"], (m["block_in"], m["block_out"])), Counter())[best] += 1
    return out


def _counter_text(c: Counter) -> str:
    if len(c) == 1:
        return f"`{next(iter(c))}`"
    return ", ".join(f"`{n}` {k}" for n, k in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def which_backend_markdown() -> str:
    """By block shape and machine: the backend(s) the built-in table has fastest, per mode."""
    table = _builtin()
    entries = _entries_in_order(table)
    wins = {key: _winners(e) for key, e in entries}
    blocks = sorted({blk for w in wins.values() for (_, blk) in w}, key=lambda b: (b[0] * b[1], b))
    head = "| block (in x out) | " + " | ".join(_entry_label(k, e) for k, e in entries) + " |"
    rows = [head, "|---|" + "---|" * len(entries)]
    for blk in blocks:
        cells = []
        for key, _ in entries:
            parts = []
            for mode, label in MODES:
                c = wins[key].get((mode, blk))
                parts.append(f"{label}: {_counter_text(c)}" if c else f"{label}: not measured")
            cells.append("<br>".join(parts))
        rows.append(f"| {blk[0]}x{blk[1]} | " + " | ".join(cells) + " |")

    # Per backend: at how many measured points it is the fastest, in each entry and mode.
    counts = {key: {mode: Counter() for mode, _ in MODES} for key, _ in entries}
    totals = {key: Counter() for key, _ in entries}
    for key, _ in entries:
        for (mode, _blk), c in wins[key].items():
            counts[key][mode].update(c)
            totals[key][mode] += sum(c.values())
    head2 = "| backend | " + " | ".join(
        f"{_entry_label(k, e)} (of {totals[k]['forward']} / {totals[k]['train']})" for k, e in entries
    ) + " |"
    rows2 = [head2, "|---|" + "---|" * len(entries)]
    for n in names():
        cells = []
        for key, _ in entries:
            f, t = counts[key]["forward"][n], counts[key]["train"][n]
            cells.append("–" if not (f or t) else f"{f} / {t}")
        rows2.append(f"| `{n}` | " + " | ".join(cells) + " |")
    groups = ", ".join(str(g) for g in sorted({m["groups"] for _, e in entries for m in e["measurements"]}))
    return (
        "\n".join(rows)
        + "\n\n"
        + f"Each cell names the fastest backend at the table's points for that block (groups "
        f"{groups} at the batches each entry measured, listed with the entries below; float32), "
        "with how many points each won where more than "
        "one did. A backend absent from a machine's column was slower everywhere there, or "
        "cannot run on it.\n\n"
        + "How many points each backend is the fastest at (forward / training):\n\n"
        + "\n".join(rows2)
        + "\n"
    )


def builtin_tables_markdown() -> str:
    """The machines the built-in table was measured on, one row per entry."""
    table = _builtin()
    defaults = table.get("defaults", {})
    rows = [
        ("| entry | device name | torch | `simd` variant | batches (forward / training) | points (forward / training) "
         "| measured | settings it implies | used |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, e in _entries_in_order(table):
        ms = e["measurements"]
        nf = sum(m["mode"] == "forward" for m in ms)
        nt = sum(m["mode"] == "train" for m in ms)
        bf, bt = ({m["batch"] for m in ms if m["mode"] == mode} for mode in ("forward", "train"))
        batches = ", ".join(map(str, sorted(bf))) + ("" if bf == bt else " / " + ", ".join(map(str, sorted(bt))))
        s = e.get("settings", {})
        st = "<br>".join(f"`{k}={v}`" for k, v in sorted(s.items())) or "–"
        used = "default for " + e["device"] if defaults.get(e["device"]) == key else "on a device of this name"
        rows.append(
            f"| {_entry_label(key, e)} | {e.get('device_name', '')} | {e.get('torch', '')} | "
            f"{e.get('simd_variant') or '–'} | {batches} | {nf} / {nt} | "
            f"{str(e.get('created', ''))[:10]} | {st} | {used} |"
        )
    return "\n".join(rows) + "\n"


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


# --------------------------------------------------------------------------- API reference


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
            # A public function named like a subpackage (none today; ``blockdiag.backends()``
            # was one): static analysis would document the subpackage, so render it at runtime.
            out.append(_manual_entry(name, obj))
        else:
            out.append(f"::: blockdiag.{name}\n")
    return "\n".join(out)


# --------------------------------------------------------------------------- results/*.json


def _load(name: str) -> dict:
    path = RESULTS / name
    if not path.exists():
        raise FileNotFoundError(f"docs: a page names docs/results/{name}, which does not exist")
    d = json.loads(path.read_text())
    if d.get("complete") is False:  # a bench run stopped part way: its summary is not the grid's
        raise ValueError(f"docs: docs/results/{name} holds a bench run stopped after {d.get('points_done')} of "
                         f"{d.get('points_total')} points; publish a complete run")
    return d


def _git_added(name: str) -> str:
    """'<date>, commit <hash>' of the commit that last changed a result file, or ''."""
    try:
        run = subprocess.run(
            ["git", "log", "-1", "--format=%cs %h", "--", f"docs/results/{name}"],
            cwd=ROOT, capture_output=True, text=True, timeout=10, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    if run.returncode != 0:  # not a git checkout (an sdist, a copy of the docs)
        return ""
    out = run.stdout.split()
    return f"committed {out[0]} in `{out[1]}`" if len(out) == 2 else "not committed yet"


def _command(argv) -> str:
    if not argv:
        return ""
    if argv and isinstance(argv[0], list):  # merged per-point runs: show the first, generalised
        argv = argv[0]
    args = list(argv)
    if "--json" in args:
        i = args.index("--json")
        args[i + 1] = "FILE.json"
    return "blockdiag " + " ".join(args)


def _provenance(d: dict, name: str) -> str:
    bits = [f"**Machine**: {d.get('device_name', '?')}"]
    if d.get("threads") and "thread" not in str(d.get("device_name", "")):
        bits.append(f"{d['threads']} threads")
    bits.append(f"torch {d.get('torch', '?')}, {d.get('dtype', '?')}")
    when = []
    if d.get("created"):
        when.append(f"measured {str(d['created'])[:10]}")
    if d.get("commit"):
        when.append(f"blockdiag at `{str(d['commit'])[:10]}`")
    added = _git_added(name)
    if added:
        when.append(added)
    alloc = d.get("allocator_env")
    env = "allocator: defaults" if not alloc else "allocator: " + ", ".join(f"`{k}={v}`" for k, v in alloc.items())
    stat = f"{d.get('statistic', 'median')} of {d.get('rounds', '?')} interleaved rounds"
    if d.get("refine"):
        stat += f", near-ties (within {d['refine']:.0%}) refined"
    lines = [", ".join(bits) + f"; {stat}; {env}.", ""]
    if when:
        lines += [f"**When**: {'; '.join(when)}.", ""]
    cmd = _command(d.get("argv"))
    if cmd:
        lines += [f"**Command**: `{cmd}` (file: `docs/results/{name}`)", ""]
    if d.get("note"):
        lines += [str(d["note"]), ""]
    return "\n".join(lines)


def _fmt(v, spec=".3f", suffix="") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:{spec}}{suffix}"


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


SUMMARY_ROWS = (
    ("points", "points measured", lambda s: str(s.get("points", "–"))),
    ("a", "`auto` over the fastest: geometric mean, worst (where)",
     lambda s: f"{_fmt(s.get('geomean_auto_over_fastest'))}, {_fmt(s.get('max_auto_over_fastest'), '.2f')}"
     f" ({s.get('worst_point', '–')})"),
    # "of" how many: the points with a fastest backend (_rated), and those where auto's choice
    # was timed too (_choice_points; a --backends run may leave it out), counted by
    # bench_markdown from the rows: the summary's counts are over those points only.
    ("w", "points where `auto` is within 1.10 of the fastest",
     lambda s: f"{s.get('within_1.10', '–')} of {s.get('_rated', s.get('points', '–'))}"),
    ("c", "the choice alone (its backend forced) over the fastest, where it was timed: geometric mean; within 1.10",
     lambda s: f"{_fmt(s.get('geomean_choice_over_fastest'))}; {s.get('choice_within_1.10', '–')}"
     + (f" of {s['_choice_points']}" if s.get("_choice_points") is not None else "")),
    ("f", "`auto` over its backend forced by name (the choosing's cost), geometric mean",
     lambda s: _fmt(s.get("geomean_auto_over_choice"))),
    ("k", "`auto` over its backend's bare kernel (the whole dispatch's cost), geometric mean",
     lambda s: _fmt(s.get("geomean_auto_over_kernel"))),
    ("i", "fraction of the ideal dense GEMM's speed, median", lambda s: _pct(s.get("median_fraction_of_ideal"))),
    ("l", "speed-up over the `nn.Linear` loop: geometric mean (minimum)",
     lambda s: f"{_fmt(s.get('geomean_speedup_vs_nn_linear_loop'), '.2f', 'x')} "
     f"({_fmt(s.get('min_speedup_vs_nn_linear_loop'), '.2f', 'x')})"),
    ("v", "speed-up over `vmap` ensembling: geometric mean (minimum)",
     lambda s: f"{_fmt(s.get('geomean_speedup_vs_vmap'), '.2f', 'x')} "
     f"({_fmt(s.get('min_speedup_vs_vmap'), '.2f', 'x')})"),
    ("b", "the built-in table's choice over the fastest (under a profile)",
     lambda s: _fmt(s.get("geomean_builtin_choice_over_fastest"))),
)


def _point(r) -> str:
    return f"B={r['batch']} G={r['groups']} {r['block_in']}x{r['block_out']}"


def bench_markdown(name: str) -> str:
    """A ``blockdiag bench --json`` file: provenance, summary, backends' standing, every point."""
    d = _load(name)
    # A point beyond --max-gflop is a row with the reason and no times: it is listed apart,
    # not counted among the points measured (nor in each backend's "fastest at N of").
    rows = [r for r in d["rows"] if "skipped_point" not in r]
    too_large = [r for r in d["rows"] if "skipped_point" in r]
    modes = [(m, label) for m, label in MODES if any(r["mode"] == m for r in rows)]
    summ = d.get("summary", {})
    out = [_provenance(d, name)]
    present = [(key, label, fn) for key, label, fn in SUMMARY_ROWS
               if key != "b" or any("geomean_builtin_choice_over_fastest" in summ.get(m, {}) for m, _ in modes)]
    counts = {}
    for m, _ in modes:
        rated = [r for r in rows if r["mode"] == m and r.get("fastest")]
        counts[m] = {"_rated": len(rated), "_choice_points": sum(r["auto"] in r["times_us"] for r in rated)}
    out.append("| | " + " | ".join(label for _, label in modes) + " |")
    out.append("|---|" + "---|" * len(modes))
    for _key, label, fn in present:
        out.append(f"| {label} | " + " | ".join(fn({**summ.get(m, {}), **counts[m]}) for m, _ in modes) + " |")
    out.append("")
    if too_large:
        out.append(f"Not measured ({len(too_large)} points): " + "; ".join(
            f"{r['mode']} {_point(r)} ({r['skipped_point']})" for r in too_large) + ".")
        out.append("")

    # Each backend's standing: fastest at how many points, its time over the fastest.
    backends = sorted({b for r in rows for b in r["times_us"]}, key=lambda n: (names().index(n) if n in names() else 99, n))
    out.append("| backend | " + " | ".join(
        f"{label}: fastest at | {label}: time over the fastest, geometric mean (worst)" for _, label in modes) + " |")
    out.append("|---|" + "---|---|" * len(modes))
    for b in backends:
        cells = []
        for m, _ in modes:
            ratios = [r["times_us"][b] / r["times_us"][r["fastest"]] for r in rows
                      if r["mode"] == m and b in r["times_us"] and r["fastest"] in r["times_us"]]
            wins = sum(1 for r in rows if r["mode"] == m and r["fastest"] == b)
            total = sum(1 for r in rows if r["mode"] == m)
            if not ratios:
                why = next((r["skipped"][b] for r in rows if r["mode"] == m and b in r.get("skipped", {})), "not run")
                cells += ["–", why.removeprefix("skipped: ")]
            else:
                cells += [f"{wins} of {total}", f"{_geomean(ratios):.2f} ({max(ratios):.2f})"]
        out.append(f"| `{b}` | " + " | ".join(cells) + " |")
    out.append("")

    for m, label in modes:
        pts = [r for r in rows if r["mode"] == m]
        out.append(f'??? note "Every {label} point ({len(pts)})"')
        out.append("")
        out.append("    | point | `auto` ran | fastest | `auto` / fastest | choice / fastest | "
                   "x `nn.Linear` loop | x vmap | % of ideal |")
        out.append("    |---|---|---|---|---|---|---|---|")
        for r in pts:
            t = r["times_us"]
            choice = t.get(r["auto"])
            fastest = t.get(r["fastest"])
            base = r.get("baselines_us") or {}
            loop = base.get("nn_linear_loop")
            vmap = base.get("vmap")
            auto = r.get("auto_us")
            # No fastest where every backend named was skipped there (only auto was timed).
            out.append(
                f"    | {_point(r)} | `{r['auto']}` | {'`' + r['fastest'] + '`' if r['fastest'] else '–'} | "
                f"{_fmt(r.get('auto_over_fastest'), '.2f')} | "
                f"{_fmt(choice / fastest if choice and fastest else None, '.2f')} | "
                f"{_fmt(loop / auto if loop and auto else None, '.2f', 'x')} | "
                f"{_fmt(vmap / auto if vmap and auto else None, '.2f', 'x')} | {_pct(r.get('fraction_of_ideal'))} |"
            )
        out.append("")
    return "\n".join(out)


def bench_compiled_markdown(name: str) -> str:
    """A ``blockdiag bench --compiled --json`` file: compiled against eager and the compiled peers."""
    d = _load(name)
    comp = d.get("compiled", {})
    out = [_provenance(d, name).replace("**Command**", "**Command** (one of its points)")]
    out.append(
        f"Compiler `{comp.get('compiler', 'inductor')}`, `dynamic={comp.get('dynamic')}`; models: "
        + ", ".join(f"`{m}`" for m in comp.get("models", [])) + ".\n"
    )
    out.append("| mode | model | points | compiled over eager: geometric mean (worst) | "
               "the peers' compiled over eager: loop, vmap (geometric means) | "
               "the control's compiled over eager (geometric mean) | "
               "compiled over the best compiled peer: geometric mean (worst) | "
               "points slower than that peer (of which beyond the noise) |")
    out.append("|---|---|---|---|---|---|---|---|")
    for mode, models in d.get("summary", {}).items():
        for model, s in models.items():
            out.append(
                f"| {mode} | {model} | {s.get('points')} | {_fmt(s.get('geomean_compiled_over_eager'), '.2f')} "
                f"({_fmt(s.get('max_compiled_over_eager'), '.2f')}) | "
                f"{_fmt(s.get('geomean_loop_compiled_over_eager'), '.2f')}, "
                f"{_fmt(s.get('geomean_vmap_compiled_over_eager'), '.2f')} | "
                f"{_fmt(s.get('geomean_control_compiled_over_eager'), '.2f')} | "
                f"{_fmt(s.get('geomean_compiled_over_best_peer'), '.2f')} "
                f"({_fmt(s.get('max_compiled_over_best_peer'), '.2f')}) | {s.get('slower_than_best_peer')}"
                + (f" ({s['slower_than_best_peer_beyond_noise']})" if "slower_than_best_peer_beyond_noise" in s else "")
                + " |"
            )
    out.append("")
    from blockdiag.tuning import FAULTS_NOTED

    order = ("mode", "model", "batch", "groups", "block_in", "block_out")
    slower = []
    for r in sorted(d.get("rows", []), key=lambda r: tuple(r.get(k, "") for k in order)):
        v = r.get("compiled_over_best_peer", {}).get("auto")
        if v is None or v <= 1.0:
            continue
        iv = r.get("compiled_over_best_peer_interval", {}).get("auto")
        verdict = "-" if iv is None else "slower beyond the noise" if iv[0] > 1.0 else "a tie"
        slower.append(f"| {r['mode']} {r['model']} B={r['batch']} G={r['groups']} {r['block_in']}x{r['block_out']} | "
                      f"`{r.get('best_peer')}` | {v:.3f} | "
                      + ("-" if iv is None else f"{iv[0]:.3f} to {iv[1]:.3f}") + f" | {verdict} |")
    if slower:
        out.append("Points where compiled blockdiag's median is slower than the best compiled peer's, with the "
                   "interval of the round-by-round ratio (a distribution-free 95% interval for its median, over "
                   "rounds that sample both moments apart; [Tuning](tuning.md#tune-explain-bench)):\n")
        out.append("| point | best compiled peer | compiled over that peer | interval | verdict |")
        out.append("|---|---|---|---|---|")
        out.extend(slower)
        out.append("")

    faulting = []
    for r in sorted(d.get("rows", []), key=lambda r: tuple(r.get(k, "") for k in order)):
        many = {k: v for k, v in r.get("faults_per_step", {}).items() if v >= FAULTS_NOTED}
        if many:
            ratio = r.get("compiled_over_best_peer", {}).get("auto")
            faulting.append(
                f"| {r['mode']} {r['model']} B={r['batch']} G={r['groups']} {r['block_in']}x{r['block_out']} | "
                + ", ".join(f"`{k}` {v:g}" for k, v in sorted(many.items(), key=lambda kv: -kv[1]))
                + f" | {_fmt(ratio, '.2f')} |")
    if faulting:
        out.append(f"Points where a timed step page-faulted {FAULTS_NOTED} times a call or more (fresh pages "
                   "from the allocator on every step, [FAQ](faq.md#training-at-large-batch-is-slower-than-expected)):\n")
        out.append("| point | page faults per step | compiled over the best compiled peer |")
        out.append("|---|---|---|")
        out.extend(faulting)
        out.append("")
    return "\n".join(out)


def bench_distributed_markdown(name: str) -> str:
    """``scripts/bench_distributed.py --json``: its machine, settings and table."""
    d = _load(name)
    m = d.get("machine", {})
    load = m.get("loadavg_before"), m.get("loadavg_after")
    loadtxt = ""
    if all(load):
        loadtxt = f"; load average {load[0][0]:.1f} before and {load[1][0]:.1f} after the run"
    when = _git_added(name)
    out = [
        (f"**Machine**: {m.get('cpu', '?')}, {m.get('cpu_count', '?')} cores, Python {m.get('python', '?')}, "
         f"torch {m.get('torch', '?')}, blockdiag {m.get('blockdiag', '?')}{loadtxt}. "
         + (f"**When**: {when}. " if when else "")
         + f"**Command**: `python {d.get('command', '')}` (file: `docs/results/{name}`)."),
        "",
        d["table_markdown"].strip(),
        "",
    ]
    return "\n".join(out)


def bench_summaries_markdown(name: str) -> str:
    """Summaries of earlier full-grid benches with the built-in table (``summaries`` list)."""
    d = _load(name)
    out = [str(d.get("description", "")).strip(), ""]
    for machine in dict.fromkeys(s["machine"] for s in d["summaries"]):
        runs = [s for s in d["summaries"] if s["machine"] == machine]
        out.append(f"**{machine}**\n")
        tables = {s.get("table", "built-in") for s in runs}
        table_col = len(tables) > 1
        if not table_col:
            out.append(f"Table: {next(iter(tables))}.\n")
        metrics = [f"{label}: {col}" for _, label in MODES
                   for col in ("`auto` / fastest", "choice / fastest", "% of ideal", "x `nn.Linear` loop")]
        head = ["date", "state of blockdiag"] + (["table"] if table_col else []) + metrics
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for s in runs:
            cells = [s.get("date", ""), s["state"]] + ([s.get("table", "built-in")] if table_col else [])
            for mode, _ in MODES:
                v = s.get(mode, {})
                cells += [_fmt(v.get("geomean_auto_over_fastest")), _fmt(v.get("geomean_choice_over_fastest")),
                          _pct(v.get("median_fraction_of_ideal")),
                          _fmt(v.get("geomean_speedup_vs_nn_linear_loop"), ".2f", "x")]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def allocator_markdown(name: str) -> str:
    """The allocator comparison: one training step per backend under each setting."""
    d = _load(name)
    settings = d["settings"]
    out = [
        (f"`{d['command']}` ({d['machine']}, torch {d['torch']}, {d['dtype']}, measured {d['measured']}; "
         f"file: `docs/results/{name}`), one run per setting, back to back:"),
        "",
    ]
    out.append("| training step, " + d["shape"] + " | " + " | ".join(settings) + " |")
    out.append("|---|" + "---|" * len(settings))
    for row in d["rows"]:
        out.append(
            f"| {row['point']}: " + " / ".join(f"`{b}`" for b in d["backends"]) + " | "
            + " | ".join(" / ".join(f"{row['ms'][s][b]:.1f}" for b in d["backends"]) + " ms" for s in settings)
            + " |"
        )
    out.append("")
    return "\n".join(out)


def _mlp_auto_sentence(rows: list[dict], sm: dict) -> str:
    """How often ``auto`` ran the faster strategy, and its worst time over the faster where not."""
    if "auto_ran_the_faster" not in sm:
        return ""
    # Counted from the rows, over the points where auto runs one of the two timed strategies:
    # where it runs another (the heads), its time is neither column, and the file's own count
    # (auto_ran_the_faster, from before the heads strategy) took it for the layers.
    two = [r for r in rows if r["auto"] in ("fm_chain", "layers")]
    worse = []
    for r in two:
        t = r["times_us"]
        worse.append(t[r["auto"]] / min(t["fm_chain"], t["layers"]))
    text = f" `auto` ran the faster of the two at {sum(w <= 1.0 for w in worse)} of {len(two)} points"
    if max(worse, default=1.0) > 1.0:
        text += f"; where it did not, it took at most {max(worse):.2f}x the faster one's time"
    other = Counter(r["auto"] for r in rows if r["auto"] not in ("fm_chain", "layers"))
    if other:
        text += ("; at " + ", ".join(f"{k} {'point' if k == 1 else 'points'} it ran `{s}`"
                                     for s, k in sorted(other.items()))
                 + ", not timed here")
    return text + "."


def mlp_strategy_markdown(name: str) -> str:
    """``scripts/bench_mlp_strategy.py --json``: the chain against the layers, whole models."""
    d = _load(name)
    sm = d["summary"]
    out = [
        (f"**Machine**: {d.get('device_name', '?')}, torch {d.get('torch', '?')}; "
         f"{d.get('statistic', 'median')} of {d.get('rounds', '?')} interleaved rounds. **When**: {d.get('created', '?')}"
         + (f", blockdiag at `{d['commit']}`" if d.get("commit") else "")
         + f". **Command**: `{d.get('command', '')}`."),
        "",
        (f"The chain was faster at {sm['chain_faster']} of {sm['points']} points; chain / layers ranged from "
         f"{sm['chain_over_layers_min']:.2f} to {sm['chain_over_layers_max']:.2f} (geometric mean "
         f"{sm['chain_over_layers_geomean']:.2f})."
         + _mlp_auto_sentence(d["rows"], sm)
         + " The last two columns are the table's per-layer sums, which `auto` no longer ranks the strategies "
         "by on CPU."),
        "",
        "| heads | sizes | batch | mode | chain | layers | chain / layers | `auto` runs | layers' backends | table: chain / layers |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        t = r["times_us"]
        est = ("-" if not r.get("table_layers_us") or r.get("table_chain_us") is None
               else f"{r['table_chain_us'] / r['table_layers_us']:.2f}")
        out.append(
            f"| {r['heads']} | {' -> '.join(map(str, r['sizes']))} | {r['batch']} | {r['mode']} | "
            f"{t['fm_chain'] / 1000:.2f} ms | {t['layers'] / 1000:.2f} ms | {r['chain_over_layers']:.2f} | "
            f"{r['auto']} | {', '.join(r['layer_backends'])} | {est} |"
        )
    out.append("")
    return "\n".join(out)


def mlp_traced_markdown(name: str) -> str:
    """A compiled ``GroupedMLP`` at a static batch under each traced rule, per point of the compiled grid."""
    d = _load(name)
    rules = d["rules"]
    out = [
        (f"**What**: {d['what']}. **Machine**: {d['machine']}. **Command** (each point, at each rule's "
         f"commit): `{d['command']}`. The rules:"),
        "",
        *(f"- *{r['name']}* (`{r['commit']}`): {r['rule']};" for r in rules),
        "",
        ("Each cell is the compiled training step, and in brackets its time over the best compiled peer "
         "(the `nn.Linear` loop or `vmap`, timed in the same run: above 1 is slower than it). The last column "
         f"is *{rules[1]['name']}* over *{rules[0]['name']}*. Rows are ordered by the grouped layer's forward "
         "FLOPs, which `TRACED_LAYERS_MIN_FLOPS` is compared with."),
        "",
        "| batch | groups | block | grouped FLOPs | eager | " + " | ".join(r["name"] for r in rules)
        + f" | {rules[1]['name']} / {rules[0]['name']} |",
        "|---" * (6 + len(rules)) + "|",
    ]
    for row in d["rows"]:
        cells = []
        for r in rules:
            c = row["compiled"].get(r["name"])
            cells.append("-" if c is None else f"{c['us'] / 1000:.2f} ms ({c['over_best_peer']:.2f})")
        a, b = row["compiled"].get(rules[0]["name"]), row["compiled"].get(rules[1]["name"])
        ratio = "-" if a is None or b is None else f"{b['us'] / a['us']:.2f}"
        out.append(f"| {row['batch']} | {row['groups']} | {row['block_in']}x{row['block_out']} | "
                   f"{row['grouped_flops']:.2e} | {row['eager_us'] / 1000:.2f} ms | " + " | ".join(cells) + f" | {ratio} |")
    out += ["", "| rule | points slower than the best compiled peer | speed-up over it, geometric mean |", "|---|---|---|"]
    for r in rules:
        sm = d["summary"][r["name"]]
        out.append(f"| {r['name']} | {sm['slower_than_best_peer']} of {sm['points']} | {sm['geomean_speedup_over_best_peer']:.3f}x |")
    out.append("")
    return "\n".join(out)


def _heads_rows(rows: list[dict]) -> list[str]:
    out = [
        "| batch | groups | block | auto runs | auto | heads | loop | heads / auto | auto_c | heads_c | loop_c "
        "| heads / auto, compiled |",
        "|---" * 12 + "|",
    ]
    for r in rows:
        t = r["times_us"]
        out.append(f"| {r['batch']} | {r['groups']} | {r['block_in']}x{r['block_out']} | {r['auto_strategy']} | "
                   + " | ".join(f"{t[k] / 1000:.2f}" for k in ("auto", "heads", "loop"))
                   + f" | {t['heads'] / t['auto']:.2f} | "
                   + " | ".join(f"{t[k] / 1000:.2f}" for k in ("auto_c", "heads_c", "loop_c"))
                   + f" | {t['heads_c'] / t['auto_c']:.2f} |")
    return out


def _script_preamble(d: dict, name: str, setting: str = "") -> str:
    """What a script's results file measured, where, and the command (``setting``: e.g. its dtype)."""
    return (f"**What**: {d['what']}. **Machine**: {d.get('device_name', '?')}, torch {d.get('torch', '?')}{setting}; "
            f"median of {d.get('rounds', '?')} interleaved rounds. **Command**: `{d.get('command', '')}` "
            f"(file: `docs/results/{name}`).")


def mlp_heads_markdown(name: str) -> str:
    """``scripts/bench_mlp_heads.py``'s rows, before the traced heads rule (its basis) and with it."""
    d = _load(name)
    out = [
        _script_preamble(d, name),
        "",
        ("Times of a training step in ms (`_c`: compiled); *heads / auto* below 1: the heads are faster. "
         "*auto runs* is eager `auto`'s strategy."),
        "",
    ]
    before = d.get("before_rule")
    if before:
        out += [f"**Before the rule** (blockdiag at `{str(before['commit'])[:10]}`; {before['note']}):", "",
                *_heads_rows(before["rows"]), ""]
    out += [f"**With the rule** (blockdiag at `{str(d.get('commit', '?'))[:10]}`: a compiled `auto` runs the heads "
            "where `TRACED_HEADS_RULE` says, so there *heads / auto, compiled* is about 1):", "",
            *_heads_rows(d["rows"]), ""]
    return "\n".join(out)


def simd_ops_markdown(name: str) -> str:
    """``scripts/bench_simd_ops.py``'s rows: simd through its C++ ops over simd through ctypes."""
    d = _load(name)
    out = [
        _script_preamble(d, name, f", {d.get('dtype', '?')}, blockdiag at `{str(d.get('commit', '?'))[:10]}`"),
        "",
        "Times in µs; *ops / ctypes* below 1: the C++ ops are faster.",
        "",
        "| batch | groups | block | forward, ops | forward, ctypes | ops / ctypes | train, ops | train, ctypes "
        "| ops / ctypes |",
        "|---" * 9 + "|",
    ]
    for r in d["rows"]:
        t = r["times_us"]
        out.append(f"| {r['batch']} | {r['groups']} | {r['block_in']}x{r['block_out']} | {t['forward_ops']:.1f} | "
                   f"{t['forward_ctypes']:.1f} | {r['forward_ops_over_ctypes']:.2f} | {t['train_ops']:.1f} | "
                   f"{t['train_ctypes']:.1f} | {r['train_ops_over_ctypes']:.2f} |")
    out += ["", "| mode | ops / ctypes, geometric mean | best | worst |", "|---|---|---|---|"]
    for mode, sm in d["summary"].items():
        out.append(f"| {mode} | {sm['geomean_ops_over_ctypes']:.3f} | {sm['min_ops_over_ctypes']:.2f} | "
                   f"{sm['max_ops_over_ctypes']:.2f} |")
    out.append("")
    return "\n".join(out)


def simd_blas_grads_markdown(name: str) -> str:
    """``scripts/bench_simd_blas_grads.py``'s rows: simd's gradient kernels against torch's BLAS."""
    d = _load(name)
    least = d["blas_grads_min_block"]
    w_least, w_rows = d.get("blas_weight_grad_min_block"), d.get("blas_weight_grad_max_rows")
    w_groups = d.get("blas_weight_grad_min_groups")

    def runs(r: dict) -> tuple[str, str]:
        # Files from before the weight gradient's own rule have no simd_runs: one threshold.
        if "simd_runs" in r:
            return r["simd_runs"]["input"], r["simd_runs"]["weight"]
        both = "BLAS" if r["block_in"] * r["block_out"] >= least else "kernels"
        return both, both

    route = {"op": "its C++ ops", "ctypes": "its ctypes wrappers"}.get(d.get("route", "ctypes"))
    rule = f"both gradients BLAS's from {least} elements a block (`BLAS_GRADS_MIN_BLOCK`)"
    if w_least is not None:
        many = d.get("blas_weight_grad_many")
        rule += (f", the weight gradient alone from {w_least} elements over at most {w_rows} rows"
                 + (f" with {w_groups} groups or more" if w_groups is not None else "")
                 + (f", or over at most {many['max_rows']} rows with {many['groups']} groups or more where a "
                    f"block has {many['min_in']} inputs or more" if many is not None else "")
                 + " (`BLAS_WEIGHT_GRAD_*`)")
    out = [
        _script_preamble(d, name, f", {d.get('dtype', '?')}, `{d.get('simd_variant', '?')}` kernels, blockdiag at "
                                  f"`{str(d.get('commit', '?'))[:10]}`"),
        "",
        (f"Times in µs, the kernels called through {route}; *BLAS / kernels* below 1: BLAS is faster. "
         "*Step*: simd's whole training step with the weight gradient by BLAS over the same with the kernels "
         f"(below `BLAS_GRADS_MIN_BLOCK`). *simd runs*: what simd computes each gradient with at that point "
         f"({rule})."),
        "",
        "| batch | groups | block | input gradient: kernels | BLAS | BLAS / kernels | weight and bias: kernels | "
        "BLAS | BLAS / kernels | step: weight by BLAS / kernels | simd runs (input, weight) |",
        "|---" * 11 + "|",
    ]
    for r in d["rows"]:
        t = r["times_us"]
        rx, rw = runs(r)
        out.append(f"| {r['batch']} | {r['groups']} | {r['block_in']}x{r['block_out']} | {t['input_kernels']:.0f} | "
                   f"{t['input_blas']:.0f} | {r['input_blas_over_kernels']:.2f} | {t['weight_kernels']:.0f} | "
                   f"{t['weight_blas']:.0f} | {r['weight_blas_over_kernels']:.2f} | "
                   f"{_fmt(r.get('step_weight_blas_over_kernels'), '.2f')} | {rx}, {rw} |")
    out += ["", "| simd runs (input, weight) | points | input gradient: BLAS / kernels, geometric mean | "
                "weight and bias: BLAS / kernels, geometric mean | step: weight by BLAS / kernels, geometric mean "
                "(worst) |", "|---|---|---|---|---|"]
    for label in ("BLAS, BLAS", "kernels, BLAS", "kernels, kernels"):
        rs = [r for r in d["rows"] if ", ".join(runs(r)) == label]
        if rs:
            gi = _geomean([r["input_blas_over_kernels"] for r in rs])
            gw = _geomean([r["weight_blas_over_kernels"] for r in rs])
            st = [r["step_weight_blas_over_kernels"] for r in rs if "step_weight_blas_over_kernels" in r]
            steps = f"{_geomean(st):.2f} ({max(st):.2f})" if st else "-"
            out.append(f"| {label} | {len(rs)} | {gi:.2f} | {gw:.2f} | {steps} |")
    out.append("")
    return "\n".join(out)


def asv_time_noise_markdown(name: str) -> str:
    """Three asv runs of unchanged code: how far each time benchmark family moved."""
    d = _load(name)
    out = [
        (f"{d['what']}. **Machine**: {d['machine']}. **When**: {d['created']}, blockdiag at `{d['commit']}`. "
         f"**Sampling**: {d['sampling']}. **Command**: `{d['command']}`."),
        "",
        "| threads | benchmark | points | median spread | within 10% | worst spread | load average (start, end) |",
        "|---|---|---|---|---|---|---|",
    ]
    for threads, fams in d["families"].items():
        load = d.get("load_average", {}).get(threads)
        for fam, v in fams.items():
            out.append(
                f"| {threads} | `{fam}` | {v['points']} | {v['median_spread']:.0%} | {v['within_10pct']} | "
                f"{v['worst_spread']:.0%} | {', '.join(f'{x:.1f}' for x in load) if load else '-'} |"
            )
    out.append("")
    return "\n".join(out)


def _span(v, fmt="{}", suffix="") -> str:
    """``v`` or a ``[lo, hi]`` range as text (``lo-hi`` when they differ)."""
    if isinstance(v, (list, tuple)):
        lo, hi = v
        return fmt.format(lo) + suffix if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}{suffix}"
    return fmt.format(v) + suffix


def asv_history_markdown(name: str) -> str:
    """The published asv history run: what it was and the steps it showed."""
    d = _load(name)
    out = [
        (f"**Run**: `{d['command']}` over the {d['commit_count']} first-parent commits of `main` from "
         f"`{d['commits'][0]}` to `{d['commits'][1]}`, on {d['machine']}, in {d['duration_min']} minutes; load "
         f"average {d['load_average'][0]} at the start and {d['load_average'][1]} at the end ({d['load_note']}). "
         f"(file: `docs/results/{name}`)"),
        "",
        f"The step at `{d['step_commit']}`: {d['step_cause']}.",
        "",
        "| benchmark | point | before the step | after it | reads as |",
        "|---|---|---|---|---|",
    ]
    for r in d["series"]:
        out.append(f"| `{r['benchmark']}` | {r['point']} | {_span(r['before'])} | {_span(r['after'])} | {r['reads']} |")
    out += ["", f"Besides: {d['step_also']}; {d['unchanged_lines']}; the gap is {d['gap']}.", ""]
    return "\n".join(out)


def asv_stability_markdown(name: str) -> str:
    """How far the ratios (and the history's points) move on unchanged code."""
    d = _load(name)
    out = [
        f"**What**: {d['what']} (file: `docs/results/{name}`; {d['machine']}).",
        "",
        "| runs | machine | headline ratios | `track_backend_over_ideal` |",
        "|---|---|---|---|",
    ]
    for r in d["ratio_runs"]:
        def cell(v):
            txt = f"{v['points']} points: median difference {v['median_difference']:.1%}, {v['within_10pct']} within 10%"
            if "within_5pct" in v:
                txt += f", {v['within_5pct']} within 5%"
            if "worst" in v:
                txt += f", worst {v['worst']:.0%}"
            return txt
        out.append(f"| {r['runs']} | {r['load']} | {cell(r['headline'])} | {cell(r['backend_over_ideal'])} |")
    lo, hi = d["times_moved_between_runs"]
    out += ["", f"The times of the same runs moved by {lo}x to {hi}x between the quiet and the loaded runs.", ""]
    h = d["history_deviation"]
    out.append(f"Over the {h['commits']} commits of the published history from `{h['from']}` on ({h['statistic']}):")
    out.append("")
    for f in h["families"]:
        worst = f" (worst {f['worst']:.0%})" if "worst" in f else ""
        med = f["median"]
        out.append(f"- `{f['benchmark']}`: {_span([round(m * 100) for m in med] if isinstance(med, list) else round(med * 100), suffix='%')}{worst}")
    e, t, g = d["load_example"], d["earlier_times_comparison"], d["ideal_gemm_bimodal"]
    out += ["", (f"Under load a {e['short_product']['us']} µs product took {e['short_product']['took_ms']} ms, and the "
                 f"{e['what']} went from {e['before_ms']} ms to {e['after_ms']} ms. The ideal GEMM at `{g['shape']}` "
                 f"(a {g['mflop']} MFLOP product) ran in either about {g['us'][0]} µs or about {g['us'][1]} µs in a "
                 f"given process, so every ratio over it there moved {g['ratio_moves']}x between runs. Earlier, "
                 f"{t['what']}, at a load average of {_span(t['load_average'])}, differed by a median "
                 f"{t['median_difference']:.0%} (the first run's {t['short_products']['us']} µs products took "
                 f"{t['short_products']['took_ms']} ms)."), ""]
    return "\n".join(out)


def asv_experiment_markdown(name: str) -> str:
    """The injected-slowdown experiment: what each commit changed and what asv flagged."""
    d = _load(name)
    out = [
        f"**What**: {d['what']}:",
        "",
        *(f"- *{k}*: {v};" for k, v in d["commits"].items()),
        "",
        (f"Each was compared with its base on {d['machine']}, load average {_span(d['load_average'])} "
         f"({d['load_note']}; file: `docs/results/{name}`):"),
        "",
        f"```bash\n{d['command']}\n```",
        "",
        "| benchmarks (points) | *slow* against its base | *unchanged* against its base |",
        "|---|---|---|",
    ]
    for r in d["rows"]:
        pts = f" ({r['points']})" if r.get("points") else ""
        out.append(f"| {r['benchmarks']}{pts} | {r['slow']} | {r['unchanged']} |")
    out += ["", f"A first try: {d['first_try']}.", ""]
    return "\n".join(out)


def explain_markdown(args: str) -> str:
    """What ``blockdiag explain ARGS`` prints here with the built-in table (no user profile)."""
    import argparse
    import tempfile

    from blockdiag.dispatch import choose
    from blockdiag.settings import config

    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--groups", type=int, required=True)
    ap.add_argument("--block", required=True)
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(args.split())
    bi, bo = (int(v) for v in a.block.lower().split("x"))
    problem = Problem(a.batch, a.groups, bi, bo, torch.float32, a.device, a.train)
    with tempfile.TemporaryDirectory() as tmp, config(profile=str(Path(tmp) / "none.json")):
        text = str(choose(problem))
    if a.device == "cpu":
        from blockdiag.backends import simd

        text += "\n" + simd.variant_note()
    return f"```text\n$ blockdiag explain {args}\n{text}\n```\n"


def results_index_markdown() -> str:
    """Every result file and the command that wrote it."""
    rows = ["| file | what | command |", "|---|---|---|"]
    for path in sorted(RESULTS.glob("*.json")):
        d = json.loads(path.read_text())
        if "compiled" in d:
            what, cmd = "`bench --compiled`", _command(d.get("argv")) + " (one point of several)"
        elif "rows" in d and "summary" in d and "argv" in d:
            what, cmd = "`bench`", _command(d.get("argv"))
        elif "table_markdown" in d:
            what, cmd = "`scripts/bench_distributed.py`", "python " + d.get("command", "")
        elif "summaries" in d:
            what, cmd = "earlier bench summaries", d.get("command", "")
        else:
            what, cmd = d.get("what", "measurements"), d.get("command", "")
        rows.append(f"| `{path.name}` | {what} | `{cmd}` |")
    return "\n".join(rows) + "\n"


_FILE_MARKERS = {
    "bench": bench_markdown,
    "bench-compiled": bench_compiled_markdown,
    "bench-distributed": bench_distributed_markdown,
    "bench-summaries": bench_summaries_markdown,
    "allocator": allocator_markdown,
    "mlp-strategy": mlp_strategy_markdown,
    "mlp-traced": mlp_traced_markdown,
    "mlp-heads": mlp_heads_markdown,
    "simd-ops": simd_ops_markdown,
    "simd-blas-grads": simd_blas_grads_markdown,
    "asv-time-noise": asv_time_noise_markdown,
    "asv-history": asv_history_markdown,
    "asv-stability": asv_stability_markdown,
    "asv-experiment": asv_experiment_markdown,
}
_EXPLAIN = re.compile(r"<!-- explain: ([\w\s.\-]+?) -->")
_FILE_MARKER = re.compile(r"<!-- (" + "|".join(map(re.escape, _FILE_MARKERS)) + r"): ([\w.\-]+) -->")
_MARKERS = {
    "<!-- support-matrix -->": support_matrix_markdown,
    "<!-- which-backend -->": which_backend_markdown,
    "<!-- builtin-tables -->": builtin_tables_markdown,
    "<!-- decision-map -->": decision_map_markdown,
    "<!-- api-reference -->": api_reference_markdown,
    "<!-- results-index -->": results_index_markdown,
}


def render(markdown: str) -> str:
    """Replace every marker in a page's Markdown with its generated section."""
    for marker, fn in _MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, fn())
    markdown = _EXPLAIN.sub(lambda m: explain_markdown(m.group(1)), markdown)
    return _FILE_MARKER.sub(lambda m: _FILE_MARKERS[m.group(1)](m.group(2)), markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """mkdocs hook: fill in the generated sections."""
    return render(markdown)


if __name__ == "__main__":
    print(which_backend_markdown())
    print(builtin_tables_markdown())
    print(support_matrix_markdown())
    print(results_index_markdown())
