"""PNG plot: goodput against fleet size, one line per strategy (and M)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ddiloco.goodput.report import fmt_chips
from ddiloco.goodput.simulate import Cell


def plot_goodput(cells: Sequence[Cell], path: str | Path,
                 paper: Mapping[str, Mapping[int, float]] | None = None,
                 title: str = "Goodput vs fleet size (MTBI 1 year)") -> Path:
    """Write the plot to ``path``; ``paper`` adds the paper's cells as hollow markers."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    names = list(dict.fromkeys(c.strategy.name for c in cells))
    colours = {}
    for name in names:
        pts = sorted((c.chips, c.goodput.mean, c.goodput.ci95) for c in cells
                     if c.strategy.name == name)
        x = [p[0] for p in pts]
        y = [100 * p[1] for p in pts]
        err = [100 * p[2] if p[2] == p[2] else 0.0 for p in pts]  # nan with one seed
        line = ax.errorbar(x, y, yerr=err, marker="o", ms=4, capsize=2, label=name)
        colours[name] = line[0].get_color()
    for name, table in (paper or {}).items():
        xs = sorted(table)
        ax.plot(xs, [table[n] for n in xs], linestyle="none", marker="s", mfc="none", ms=8,
                color=colours.get(name, "black"), label=f"paper: {name}")
    ax.set_xscale("log")
    sizes = sorted({c.chips for c in cells})
    ax.set_xticks(sizes, [fmt_chips(n) for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
