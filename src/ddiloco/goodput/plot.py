"""PNG plots: goodput against fleet size (one line per strategy), and the Decoupled DiLoCo
predictions along the valley of consistent calibrations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ddiloco.goodput.report import fmt_chips
from ddiloco.goodput.simulate import Cell


def plot_goodput(
    cells: Sequence[Cell],
    path: str | Path,
    paper: Mapping[str, Mapping[int, float]] | None = None,
    title: str = "Goodput vs fleet size (MTBI 1 year)",
) -> Path:
    """Write the plot to ``path``; ``paper`` adds the paper's cells as hollow markers."""
    from ddiloco.report.plotting import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    names = list(dict.fromkeys(c.strategy.name for c in cells))
    colours = {}
    for name in names:
        pts = sorted((c.chips, c.goodput.mean, c.goodput.ci95) for c in cells if c.strategy.name == name)
        x = [p[0] for p in pts]
        y = [100 * p[1] for p in pts]
        err = [100 * p[2] if p[2] == p[2] else 0.0 for p in pts]  # nan with one seed
        line = ax.errorbar(x, y, yerr=err, marker="o", ms=4, capsize=2, label=name)
        colours[name] = line[0].get_color()
    for name, table in (paper or {}).items():
        xs = sorted(table)
        ax.plot(
            xs,
            [table[n] for n in xs],
            linestyle="none",
            marker="s",
            mfc="none",
            ms=8,
            color=colours.get(name, "black"),
            label=f"paper: {name}",
        )
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


def plot_valley(
    points: Mapping[str, Sequence[float]],
    predictions: Mapping[tuple[str, int], Sequence[float]],
    learners: Sequence[int],
    path: str | Path,
    title: str = "Decoupled DiLoCo predictions along the valley",
) -> Path:
    """Each Decoupled DiLoCo cell's prediction against repair time (top row) and pause (bottom
    row), one column per M, over the consistent set's distinct (shape, pause, repair) points.

    ``points`` holds ``repair_mean_s``, ``reconfig_mean_s`` and ``weight`` per point;
    ``predictions[(name, chips)]`` the cell's goodput (%) at each point. Filled dots: K = 1;
    crosses: K = M / 2.
    """
    from ddiloco.report.plotting import pyplot

    plt = pyplot()

    x_of = {"repair (h)": [v / 3600 for v in points["repair_mean_s"]], "pause (s)": list(points["reconfig_mean_s"])}
    w = list(points["weight"])
    wmax = max(w) if w else 1.0
    sizes = [8 + 40 * v / wmax for v in w]  # marker area follows the posterior weight
    chips = sorted({n for _, n in predictions})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(2, len(learners), figsize=(3.2 * len(learners), 6.0), dpi=110, sharey="col", squeeze=False)
    for row, (xlabel, xs) in enumerate(x_of.items()):
        for col, m in enumerate(learners):
            ax = axes[row][col]
            for ci, n in enumerate(chips):
                c = colours[ci % len(colours)]
                k1 = predictions.get((f"DDiLoCo M={m}", n))
                if k1 is not None:
                    ax.scatter(
                        xs, k1, s=sizes, color=c, alpha=0.6, lw=0, label=fmt_chips(n) if (row, col) == (0, 0) else None
                    )
                kh = predictions.get((f"DDiLoCo M={m} K={m // 2}", n))
                if kh is not None and m // 2 > 1:
                    ax.scatter(xs, kh, s=10, color=c, marker="x", lw=0.7)
            if row == 0:
                ax.set_xscale("log")
                ax.set_title(f"M = {m}")
            ax.set_xlabel(xlabel)
            if col == 0:
                ax.set_ylabel("goodput (%)")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7, title="chips", title_fontsize=7)
    fig.suptitle(f"{title} (dots K = 1, size = posterior weight; x: K = M/2)", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
