"""The decision map: which backend wins where, drawn from a profile entry."""

from __future__ import annotations

import math
from typing import Iterable, Optional

from .._errors import BlockDiagError


def plot_decision_map(entry: dict, path: str, backends: Optional[Iterable[str]] = None) -> str:
    """Draw which backend wins where: one panel per (mode, block shape) over groups x batch.

    Each cell is coloured by the fastest backend, shaded by its margin over the runner-up
    (pale: under 5%, full colour: 50% or more), and labelled with both. Needs matplotlib
    (``pip install blockdiag[plot]``).

    Args:
        entry: a profile entry (from :func:`tune` or a profile file).
        path: the image file to write (the format follows the extension).
        backends: only consider these backends (default: all measured).

    Returns:
        ``path``.

    Raises:
        BlockDiagError: matplotlib missing, or the entry has no measurements.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import to_rgb
    except ImportError:
        raise BlockDiagError("plot_decision_map: --plot needs matplotlib: pip install 'blockdiag[plot]'") from None
    ms = entry.get("measurements", [])
    if not ms:
        raise BlockDiagError("plot_decision_map: the profile entry has no measurements to plot")
    keep = set(backends) if backends is not None else None
    panels = sorted({(m["mode"], m["block_in"], m["block_out"]) for m in ms})
    all_names = sorted({n for m in ms for n in m["times_us"] if keep is None or n in keep})
    # Distinct colours for every backend (tab10 repeats from the 11th name).
    palette = plt.get_cmap("tab10" if len(all_names) <= 10 else "tab20")
    colour = {n: to_rgb(palette(k % palette.N)) for k, n in enumerate(all_names)}
    cols = min(4, len(panels))
    rows_n = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.6 * rows_n), squeeze=False)
    for ax, (mode, bi, bo) in zip(axes.flat, panels):
        sel = [m for m in ms if (m["mode"], m["block_in"], m["block_out"]) == (mode, bi, bo)]
        gs = sorted({m["groups"] for m in sel})
        bs = sorted({m["batch"] for m in sel})
        for m in sel:
            t = {n: v for n, v in m["times_us"].items() if keep is None or n in keep}
            if not t:
                continue
            ranked = sorted(t, key=t.get)
            win = ranked[0]
            margin = t[ranked[1]] / t[win] if len(ranked) > 1 else float("inf")
            strength = min(1.0, max(0.15, (margin - 1.0) / 0.5))
            rgb = tuple(1 - strength * (1 - c) for c in colour[win])
            gx, by = gs.index(m["groups"]), bs.index(m["batch"])
            ax.add_patch(plt.Rectangle((gx - 0.5, by - 0.5), 1, 1, color=rgb))
            label = f"{win}\n{margin:.2f}x" if math.isfinite(margin) else win
            ax.text(gx, by, label, ha="center", va="center", fontsize=7)
        ax.set_xlim(-0.5, len(gs) - 0.5)
        ax.set_ylim(-0.5, len(bs) - 0.5)
        ax.set_xticks(range(len(gs)), [str(g) for g in gs])
        ax.set_yticks(range(len(bs)), [str(b) for b in bs])
        ax.set_xlabel("groups")
        ax.set_ylabel("batch")
        ax.set_title(f"{mode}, block {bi}x{bo} (in x out)", fontsize=9)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    # Two short title lines (a long single line was cut at both ends at docs width) and a
    # legend of the backends that win somewhere, with how the shade reads.
    fig.suptitle(
        f"blockdiag decision map: {entry.get('device_name', '?')}\n"
        f"torch {entry.get('torch', '?')}, {entry.get('dtype', '?')}; cell: winner and its margin over the runner-up",
        fontsize=9,
    )
    winners = sorted({min(t, key=t.get) for m in ms
                      if (t := {n: v for n, v in m["times_us"].items() if keep is None or n in keep})})
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[n]) for n in winners]
    fig.legend(handles, winners, loc="lower center", ncol=min(6, max(1, len(winners))), fontsize=8,
               frameon=False, title="fastest backend (pale: within 5% of the runner-up; full: 50% or more ahead)",
               title_fontsize=8)
    fig.tight_layout(rect=(0, 0.03 + 0.15 / (3.6 * rows_n) * math.ceil(len(winners) / 6), 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
