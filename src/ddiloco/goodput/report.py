"""Tables (terminal and markdown) and JSON for the goodput simulator's results."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from ddiloco.goodput.bands import Band
from ddiloco.goodput.bandwidth import BandwidthConfig, Requirement, StepTraffic
from ddiloco.goodput.calibrate import Calibration, Residual
from ddiloco.goodput.simulate import Cell


def fmt_chips(n: int) -> str:
    """150k, 1.2M: the paper's way of writing fleet sizes."""
    if n >= 1_000_000 and n % 100_000 == 0:
        return f"{n / 1e6:g}M"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


def fmt_pct(mean: float, ci: float | None = None) -> str:
    s = f"{100 * mean:.1f}"
    return s if ci is None or math.isnan(ci) else f"{s} ± {100 * ci:.1f}"


def grid_rows(cells: Sequence[Cell], metric: str = "goodput") -> tuple[list[str], list[list[str]]]:
    """Header and rows: one row per strategy, one column per fleet size, 'mean ± ci' in %."""
    sizes = sorted({c.chips for c in cells})
    names = list(dict.fromkeys(c.strategy.name for c in cells))
    by = {(c.strategy.name, c.chips): c for c in cells}
    rows = []
    for name in names:
        row = [name]
        for n in sizes:
            c = by.get((name, n))
            stat = getattr(c, metric) if c else None
            row.append(fmt_pct(stat.mean, stat.ci95) if stat else "")
        rows.append(row)
    return ["strategy"] + [fmt_chips(n) for n in sizes], rows


def fmt_band(b: Band) -> str:
    """'median [lo, hi]', goodput %."""
    return f"{b.median:.1f} [{b.lo:.1f}, {b.hi:.1f}]"


def band_rows(
    bands: dict[tuple[str, int], Band], cells: Sequence[Cell] | None = None
) -> tuple[list[str], list[list[str]]]:
    """One row per strategy, one column per fleet size: the band, and beside it the seed CI of
    ``cells`` (the default calibration) where it has that cell."""
    sizes = sorted({n for _, n in bands})
    names = list(dict.fromkeys(name for name, _ in bands))
    by = {(c.strategy.name, c.chips): c for c in cells or ()}
    rows = []
    for name in names:
        row = [name]
        for n in sizes:
            b, c = bands.get((name, n)), by.get((name, n))
            text = fmt_band(b) if b else ""
            if c is not None:
                text = f"{fmt_pct(c.goodput.mean, c.goodput.ci95)} · {text}"
            row.append(text)
        rows.append(row)
    return ["strategy"] + [fmt_chips(n) for n in sizes], rows


def rich_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    table = Table(title=title, title_justify="left")
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for r in rows:
        table.add_row(*r)
    return table


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def calibration_rows(cal: Calibration) -> tuple[list[str], list[list[str]]]:
    return residual_rows(cal.residuals)


def residual_rows(residuals: Sequence[Residual]) -> tuple[list[str], list[list[str]]]:
    header = ["strategy", "chips", "paper %", "model %", "± 95% CI", "residual (pts)"]
    rows = [
        [r.strategy, fmt_chips(r.chips), f"{r.paper:.0f}", f"{r.model:.1f}", f"{r.ci95:.1f}", f"{r.residual:+.1f}"]
        for r in residuals
    ]
    return header, rows


def bandwidth_rows(reqs: Sequence[Requirement]) -> tuple[list[str], list[list[str]]]:
    header = ["method", "payload / sync", "every (steps)", "window (steps)", "Gbit/s per site", "Gbit/s at hub"]
    rows = [
        [
            r.method,
            f"{r.payload_bits / 8e9:.3g} GB",
            f"{r.interval_steps:g}",
            f"{r.window_steps:g}",
            f"{r.gbps:.3g}",
            f"{r.hub_gbps:.3g}",
        ]
        for r in reqs
    ]
    return header, rows


def step_rows(step: StepTraffic) -> tuple[list[str], list[list[str]]]:
    """The predicted bytes per learner per inner step, up and down, against data-parallel's."""
    header = ["direction", "payload (B)", "overhead (B)", "total (B)", "data-parallel fp32 (B)", "x fewer"]
    rows = [
        [
            name,
            f"{payload:,.0f}",
            f"{overhead:,.0f}",
            f"{payload + overhead:,.0f}",
            f"{step.dp_bytes:,.0f}",
            f"{step.dp_bytes / (payload + overhead):,.1f}" if payload + overhead > 0 else "-",
        ]
        for name, payload, overhead in (
            ("up", step.up_payload, step.up_overhead),
            ("down", step.down_payload, step.down_overhead),
        )
    ]
    return header, rows


def bandwidth_title(cfg: BandwidthConfig) -> str:
    return (
        f"Cross-site bandwidth for full overlap: {cfg.params:.3g} params, "
        f"{cfg.step_s:g} s/step, {cfg.sites} sites, P={cfg.fragments}, H={cfg.sync_every}, "
        f"tau={cfg.overlap}, {cfg.encoding} (DP {cfg.dp_encoding})"
    )


def print_table(
    title: str, header: Sequence[str], rows: Sequence[Sequence[str]], console: Console | None = None
) -> None:
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: don't squeeze the table to 80 columns
            console = Console(width=160)
    console.print(rich_table(title, header, rows))
