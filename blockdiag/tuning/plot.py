"""The decision map: which backend wins where, drawn from a profile entry."""

from __future__ import annotations

import math
from typing import Iterable, Optional

from .._errors import BlockDiagError

# Drawn at its final size: 8 inches at 100 dpi is 800 px, the docs' content width, so the
# labels are read at the size they are set in.
_WIDTH_IN, _DPI = 8.0, 100
# Full colour from this margin over the runner-up; under 5% the cell stays pale.
_FULL_MARGIN = 1.5
_SHADE_KEY = (1.0, 1.1, 1.25, _FULL_MARGIN)
# How to get matplotlib. Not ``pip install 'blockdiag[plot]'``: this blockdiag is installed
# from its checkout, and ``blockdiag`` on PyPI is another project (a diagram generator, with
# no ``plot`` extra), which that command installs where this one is not installed.
MATPLOTLIB_HINT = "pip install matplotlib (the plot extra: pip install -e '.[plot]' in blockdiag's checkout)"


def _strength(margin: float) -> float:
    return min(1.0, max(0.15, (margin - 1.0) / (_FULL_MARGIN - 1.0)))


def _shade(rgb, margin: float):
    s = _strength(margin)
    return tuple(1 - s * (1 - c) for c in rgb)


def plot_decision_map(entry: dict, path: str, backends: Optional[Iterable[str]] = None) -> str:
    """Draw which backend wins where: one panel per (mode, block shape) over groups x batch.

    With both modes measured, each row is one block shape, forward on the left and training
    on the right. Each cell is coloured by the fastest backend, shaded by its margin over the
    runner-up (pale: under 5%, full colour: 50% or more), and labelled with both; a legend
    under the title names the colours and a key at the bottom shows the shades. The figure
    is 800 px wide, the docs' width. Needs matplotlib (:data:`MATPLOTLIB_HINT`).

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
        raise BlockDiagError(f"plot_decision_map: needs matplotlib, which is not installed: {MATPLOTLIB_HINT}") from None
    ms = entry.get("measurements", [])
    if not ms:
        raise BlockDiagError("plot_decision_map: the profile entry has no measurements to plot")
    keep = set(backends) if backends is not None else None

    def times(m):
        return {n: v for n, v in m["times_us"].items() if keep is None or n in keep}

    winners = sorted({min(t, key=t.get) for m in ms if (t := times(m))})
    # One colour per backend that wins somewhere: tab10's ten, then tab20's light shades,
    # which only come in beyond ten winners (the shading already lightens the colours).
    palette = [to_rgb(c) for c in plt.get_cmap("tab10").colors]
    palette += [to_rgb(c) for c in plt.get_cmap("tab20").colors[1::2]]
    colour = {n: palette[k % len(palette)] for k, n in enumerate(winners)}

    modes = sorted({m["mode"] for m in ms})
    shapes = sorted({(m["block_in"], m["block_out"]) for m in ms})
    if len(modes) == 2:  # a row per block shape: forward | train
        slots = {(mode, s): (r, c) for r, s in enumerate(shapes) for c, mode in enumerate(modes)}
        rows_n, cols = len(shapes), 2
    else:
        cols = 1 if len(shapes) == 1 else 2
        slots = {(modes[0], s): divmod(k, cols) for k, s in enumerate(shapes)}
        rows_n = math.ceil(len(shapes) / cols)
    # Laid out in inches, top to bottom: the title, the legend of colours, the panels, the key
    # of shades (matplotlib's constrained layout draws a legend above the panels over the title).
    title_h, legend_h, panel_h, key_h = 0.5, 0.3 + 0.2 * math.ceil(len(winners) / 5), 2.05, 0.85
    height = title_h + legend_h + panel_h * rows_n + key_h
    fig, axes = plt.subplots(rows_n, cols, figsize=(_WIDTH_IN, height), squeeze=False)
    fig.subplots_adjust(left=0.08, right=0.98, top=1 - (title_h + legend_h + 0.25) / height,
                        bottom=key_h / height, hspace=0.6, wspace=0.22)
    used = set()
    for (mode, (bi, bo)), (r, c) in slots.items():
        sel = [m for m in ms if (m["mode"], m["block_in"], m["block_out"]) == (mode, bi, bo)]
        if not sel:
            continue
        ax = axes[r][c]
        used.add((r, c))
        gs = sorted({m["groups"] for m in sel})
        bs = sorted({m["batch"] for m in sel})
        for m in sel:
            t = times(m)
            if not t:
                continue
            ranked = sorted(t, key=t.get)
            win = ranked[0]
            margin = t[ranked[1]] / t[win] if len(ranked) > 1 else float("inf")
            gx, by = gs.index(m["groups"]), bs.index(m["batch"])
            rgb = _shade(colour[win], margin)
            ax.add_patch(plt.Rectangle((gx - 0.5, by - 0.5), 1, 1, color=rgb))
            label = f"{win}\n{margin:.2f}x" if math.isfinite(margin) else win
            dark = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 0.5
            ax.text(gx, by, label, ha="center", va="center", fontsize=7, linespacing=1.1,
                    color="white" if dark else "black")
        ax.set_xlim(-0.5, len(gs) - 0.5)
        ax.set_ylim(-0.5, len(bs) - 0.5)
        ax.set_xticks(range(len(gs)), [str(g) for g in gs])
        ax.set_yticks(range(len(bs)), [str(b) for b in bs])
        ax.tick_params(labelsize=8, length=2)
        ax.set_xlabel("groups", fontsize=8, labelpad=1)
        ax.set_ylabel("batch", fontsize=8, labelpad=1)
        ax.set_title(f"{mode}, block {bi}x{bo} (in x out)", fontsize=9)
    for r in range(rows_n):
        for c in range(cols):
            if (r, c) not in used:
                axes[r][c].axis("off")
    # Two short title lines: one line with the machine's name is cut at both ends at 800 px.
    fig.suptitle(
        f"blockdiag decision map: {entry.get('device_name', '?')}\n"
        f"torch {entry.get('torch', '?')}, {entry.get('dtype', '?')}; cell: winner and its margin over the runner-up",
        fontsize=10, y=1 - 0.08 / height, va="top",
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[n]) for n in winners]
    fig.legend(handles, winners, loc="upper center",
               bbox_to_anchor=(0.5, 1 - title_h / height), ncol=min(5, max(1, len(winners))), fontsize=8,
               frameon=False, title="fastest backend (full colour: 50% or more ahead of the runner-up)",
               title_fontsize=8, handlelength=1.5, columnspacing=1.2)
    grey = to_rgb("0.35")
    key = [plt.Rectangle((0, 0), 1, 1, facecolor=_shade(grey, v), edgecolor="0.6", linewidth=0.5)
           for v in _SHADE_KEY]
    key_labels = [f"{v:.2f}x" if v < _FULL_MARGIN else f"{v:.2f}x or more" for v in _SHADE_KEY]
    key_labels[0] = "under 1.05x"
    fig.legend(key, key_labels, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=len(key), fontsize=8,
               frameon=False, title="shade: the winner's margin over the runner-up", title_fontsize=8, handlelength=1.5)
    _save_atomic(fig, path)
    plt.close(fig)
    return path


def _save_atomic(fig, path: str) -> None:
    """``fig.savefig(path)`` through a temp file beside ``path``, renamed over it when complete.

    A failure (a full disk, a file-size limit, an interrupt) leaves the old file as it was,
    not a truncated image. The format is ``path``'s extension, as ``savefig`` would take it.
    """
    import os

    from .._files import write_atomic

    ext = os.path.splitext(path)[1]
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=_DPI, format=ext.lstrip(".").lower() or None),
                 suffix=ext or ".tmp")
