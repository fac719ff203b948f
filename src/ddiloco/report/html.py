"""``ddiloco report RUN_DIR [RUN_DIR ...]``: one self-contained HTML page about one or more runs.

Reads the run folder format 2 of docs/operations.md (``run.json``, ``summary.json``,
``config.toml``, ``metrics/*.jsonl``, ``metrics/accounting.json``, ``tape.jsonl``) and draws
every figure with matplotlib (Agg) into inline base64 PNGs, so the page needs nothing else.

Every file is read defensively: a missing file is empty, a torn or garbled JSON line is skipped,
records per file and bytes per line are capped, and a figure without data says so in one line.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.core.tape import RoundRecord
from ddiloco.errors import DDiLoCoError
from ddiloco.report.run_view import (
    Run,
    _by_learner,
    _key,
    _num,
    _sort_key,
    cumulative,
    goodput_series,
    load_run,
)
from ddiloco.report.summary import metrics_of

MAX_FRAGMENT_PANELS = 6
"""Participation panels drawn per run (one per fragment); further fragments are only counted."""
TERMS = "docs/operations.md#terms"

RUN_COLOURS = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666"]
"""One colour per run (Dark2), distinct from the learners' tab10/tab20 colours."""
FAULT_MARKERS = ["v", "X", "D", "s", "P", "*", "^", "o"]


# --- figures ----------------------------------------------------------------------------------


def _plt():
    from ddiloco.report.plotting import pyplot

    return pyplot()


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")  # legends placed outside stay in
    _plt().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def learner_colour(learner: Any, order: list[Any]) -> Any:
    """The learner's colour on every figure of the page (tab10, or tab20 beyond 10 learners)."""
    plt = _plt()
    idx = learner if isinstance(learner, int) else order.index(learner) if learner in order else 0
    big = len(order) > 10 or any(isinstance(x, int) and x >= 10 for x in order)
    cmap = plt.get_cmap("tab20" if big else "tab10")
    return cmap(idx % cmap.N)


def _byte_unit(peak: float) -> tuple[str, float]:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if peak >= scale:
            return unit, scale
    return "bytes", 1.0


def _fault_times(run: Run, include_restarts: bool) -> list[tuple[float, str, str]]:
    out = []
    for f in run.faults:
        t = _num(f.get("time"))
        if t is None:
            continue
        kind = str(f.get("kind", "fault"))
        if kind in ("restart", "straggle_end") and not include_restarts:  # a return to health, not a fault
            continue
        out.append((t, kind, str(f.get("target", ""))))
    return out


def _time_label(runs: list[Run]) -> str:
    clocks = {r.clock for r in runs}
    if len(clocks) == 1:
        return f"seconds since the run started ({clocks.pop()} clock)"
    return "seconds since each run started (" + ", ".join(f"{r.name}: {r.clock}" for r in runs) + " clock)"


@dataclass
class Figure:
    """One figure of the page: its id, title, a one-line reading guide, images and notes."""

    fid: str
    title: str
    how: str
    images: list[tuple[str, str]] = field(default_factory=list)
    """(caption, base64 PNG)."""
    notes: list[str] = field(default_factory=list)
    """Short "no data" lines (plain text, escaped when written)."""


def fig_eval_loss(runs: list[Run], colours: list[str]) -> Figure:
    fg = Figure(
        "eval-loss",
        "Global eval loss",
        "The global model's evaluation loss over time (lower is better); one colour per run, a star for the "
        "final evaluation, dashed vertical lines for injected faults (restarts not drawn).",
    )
    have = [(r, c) for r, c in zip(runs, colours) if any(_num(e.get("loss")) is not None for e in r.evals)]
    for r in runs:
        if not any(_num(e.get("loss")) is not None for e in r.evals):
            fg.notes.append(f"{r.label}: no eval records (metrics/eval.jsonl missing or empty, e.g. interrupted early)")
    if not have:
        return fg
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for r, c in have:
        pts = sorted(
            (e["time"], e["loss"])
            for e in r.evals
            if _num(e.get("loss")) is not None and _num(e.get("time")) is not None
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=c, label=r.label)
        finals = [
            e for e in r.evals if e.get("final") and _num(e.get("loss")) is not None and _num(e.get("time")) is not None
        ]
        if finals:
            ax.plot([e["time"] for e in finals], [e["loss"] for e in finals], "*", ms=13, color=c, mec="black", mew=0.6)
        for t, _, _ in _fault_times(r, include_restarts=False):
            ax.axvline(t, color=c, ls="--", lw=0.9, alpha=0.45)
    if any(_fault_times(r, include_restarts=False) for r, _ in have):
        ax.plot([], [], color="grey", ls="--", lw=0.9, label="fault (run's colour)")
    units = {r.loss_unit for r, _ in have}
    ax.set_ylabel("eval loss" + (f" ({units.pop()})" if len(units) == 1 and "loss" not in units else ""))
    ax.set_xlabel(_time_label([r for r, _ in have]))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=9)
    fig.tight_layout()
    fg.images.append(("", _png(fig)))
    return fg


def fig_eval_metrics(runs: list[Run], colours: list[str]) -> Figure | None:
    """The evaluation's other figures (an evaluate hook's ``{"loss": ..., "accuracy": ...}``),
    one panel per name, over time; None (no figure) when no evaluation gave any."""
    fg = Figure(
        "eval-metrics",
        "Other evaluation figures",
        "What the evaluation returned beside its loss (SyncerServer(evaluate=) returning a dict, e.g. accuracy), "
        "over time; a star for the final evaluation.",
    )
    names = sorted({str(k) for r in runs for e in r.evals for k in metrics_of(e)})[:4]
    if not names:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(names), figsize=(10, 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        for r, c in zip(runs, colours):
            pts = sorted((float(e["time"]), v[name], bool(e.get("final"))) for e in r.evals
                         if _num(e.get("time")) is not None and name in (v := metrics_of(e)))  # fmt: skip
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=c, label=r.label)
                ax.plot([p[0] for p in pts if p[2]], [p[1] for p in pts if p[2]], "*", ms=12, color=c, mec="black")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(_time_label(runs))
        ax.grid(alpha=0.3)
    axes[0][0].legend(loc="best", fontsize=8)
    fig.tight_layout()
    fg.images.append(("", _png(fig)))
    return fg


def fig_train_loss(runs: list[Run], orders: list[list[Any]]) -> Figure:
    fg = Figure(
        "train-loss",
        "Training loss per learner",
        "Each learner's last training loss as it reported it (one line per learner, same colour as in every "
        "other figure); a gap is a time the learner was down or had no loss yet.",
    )
    plt = _plt()
    for r, order in zip(runs, orders):
        per = _by_learner(r.learners)
        if not any(_num(x.get("loss")) is not None for rs in per.values() for x in rs):
            fg.notes.append(f"{r.label}: no training losses (metrics/learners.jsonl missing or without losses)")
            continue
        fig, ax = plt.subplots(figsize=(10, 3.6))
        for learner, rs in per.items():
            ts = [x["time"] for x in rs]
            ls = [_num(x.get("loss")) if x.get("state", "up") == "up" else None for x in rs]
            ax.plot(ts, [math.nan if v is None else v for v in ls], lw=1.2, color=learner_colour(learner, order),
                    label=f"learner {learner}")  # fmt: skip
        ax.set_xlabel(_time_label([r]))
        ax.set_ylabel(f"train loss ({r.loss_unit})" if r.loss_unit != "loss" else "train loss")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8, ncol=max(1, math.ceil(len(per) / 6)))
        fig.tight_layout()
        fg.images.append((r.label, _png(fig)))
    return fg


def fig_goodput(runs: list[Run], colours: list[str]) -> Figure:
    fg = Figure(
        "goodput",
        "Goodput over time",
        "Share of the fleet's learner-time spent on inner steps, per time bucket: the sum over learners of the "
        "busy seconds gained in the bucket / (M learners x bucket length); 100% = every learner computing all the "
        "time (a learner counts at most the whole bucket). Counter resets (restarts) are handled. The dotted line "
        "is the run's goodput as its summary gives it (for ddiloco train and simulate, from the launcher's or "
        "simulator's books: the buckets come from the learners' reports and may average a little apart). Markers "
        "at the top are faults, by kind.",
    )
    series = []
    for r, c in zip(runs, colours):
        s = goodput_series(r)
        if s is None:
            fg.notes.append(f"{r.label}: no busy-time counters (metrics/learners.jsonl missing or empty)")
        else:
            series.append((r, c, s))
    if not series:
        return fg
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4.2))
    kinds: dict[str, str] = {}
    for r, c, (edges, values, mean) in series:
        # the dotted line is the run's goodput, the summary's (the launcher's or simulator's books
        # where they exist): one goodput per run on the page
        headline = _num(r.summary.get("goodput"))
        goodput = headline if headline is not None else mean
        ax.stairs([100 * v for v in values], edges, baseline=None, color=c, lw=1.6, label=f"{r.label}: per bucket")
        ax.axhline(100 * goodput, color=c, ls=":", lw=1, label=f"{r.label}: goodput {goodput:.1%} (the summary's)")
    top = max(105.0, max(100 * v for _, _, (_, vals, _) in series for v in vals) * 1.05)
    for i, (r, c, _) in enumerate(series):
        for t, kind, _target in _fault_times(r, include_restarts=True):
            marker = kinds.setdefault(kind, FAULT_MARKERS[len(kinds) % len(FAULT_MARKERS)])
            ax.axvline(t, color=c, lw=0.8, alpha=0.3)
            ax.plot([t], [top * (1.0 + 0.05 * i)], marker=marker, color=c, ms=7, mec="black", mew=0.5, ls="none")
    for kind, marker in kinds.items():
        ax.plot([], [], marker=marker, color="white", mec="black", ls="none", label=f"fault: {kind}")
    ax.set_ylim(0, top * (1.08 + 0.05 * (len(series) - 1)))
    ax.set_ylabel("goodput (% of learner-time)")
    ax.set_xlabel(_time_label([r for r, _, _ in series]))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8, ncol=2, framealpha=0.9)
    fig.tight_layout()
    fg.images.append(("", _png(fig)))
    return fg


def fig_participation(runs: list[Run], orders: list[list[Any]]) -> Figure:
    fg = Figure(
        "participation",
        "Merge participation per fragment",
        "One panel per fragment; each column is one of its rounds that got answers, in the order they closed "
        "(the k-th round of that fragment), each row a learner. Colour: the learner's share of the merge's total "
        "weight; grey: it answered but got weight 0 (not merged); white: no answer from it in that round.",
    )
    plt = _plt()
    import matplotlib.colors as mcolors
    import numpy as np  # a dependency of matplotlib

    for r, order in zip(runs, orders):
        frags: dict[int, list[RoundRecord]] = {}
        for rd in r.rounds:
            if rd.merged:
                frags.setdefault(rd.fragment, []).append(rd)
        if not frags:
            fg.notes.append(f"{r.label}: no rounds with answers on the tape (tape.jsonl missing or empty)")
            continue
        learners = sorted({m.learner for rs in frags.values() for rd in rs for m in rd.merged} | set(order),
                          key=_sort_key)  # fmt: skip
        row = {lrn: i for i, lrn in enumerate(learners)}
        shown = sorted(frags, key=_sort_key)[:MAX_FRAGMENT_PANELS]
        h = max(0.9, 0.2 * len(learners) + 0.6)
        fig, axes = plt.subplots(len(shown), 1, figsize=(10, h * len(shown) + 0.9), sharex=True, squeeze=False)
        cmap = plt.get_cmap("viridis").with_extremes(under="#bdbdbd", bad="white")
        meshes = []
        for ax, p in zip(axes[:, 0], shown):
            rounds = sorted(frags[p], key=lambda rd: rd.closed_at)
            data = np.full((len(learners), len(rounds)), np.nan)
            for j, rd in enumerate(rounds):
                total = sum(m.weight for m in rd.took_part)
                for m in rd.merged:  # grey (-1): it answered but took no part
                    data[row[m.learner], j] = m.weight / total if m.was_merged else -1.0
            masked = np.ma.masked_invalid(data)
            extent = (0.5, len(rounds) + 0.5, len(learners) - 0.5, -0.5)
            meshes.append(
                ax.imshow(masked, cmap=cmap, aspect="auto", interpolation="nearest", extent=extent, origin="upper")
            )
            ax.text(1.0, 1.02, f"{len(rounds)} rounds, closed {rounds[0].closed_at:,.0f} s to "
                    f"{rounds[-1].closed_at:,.0f} s", transform=ax.transAxes, ha="right", va="bottom",
                    fontsize=7, color="#555")  # fmt: skip
            ax.set_yticks(range(len(learners)))
            ax.set_yticklabels([str(lrn) for lrn in learners], fontsize=7 if len(learners) > 12 else 8)
            for tick, lrn in zip(ax.get_yticklabels(), learners):
                tick.set_color(learner_colour(lrn, order))
                tick.set_fontweight("bold")
            ax.set_ylabel(f"fragment {p}\nlearner", fontsize=8)
        norm = mcolors.Normalize(vmin=0.0, vmax=1.0)  # one scale for every run: shares compare across runs
        for mesh in meshes:
            mesh.set_norm(norm)
        axes[-1, 0].set_xlabel("round of the fragment (k-th round that got answers; time runs left to right)")
        axes[-1, 0].xaxis.get_major_locator().set_params(integer=True)
        fig.tight_layout(rect=(0, 0, 0.9, 1))
        cax = fig.add_axes((0.915, 0.15, 0.015, 0.7))
        cb = fig.colorbar(meshes[0], cax=cax, extend="min")
        cb.set_label("weight share (grey: weight 0)", fontsize=8)
        extra = len(frags) - len(shown)
        caption = r.label + (f" ({extra} more fragments not drawn)" if extra > 0 else "")
        fg.images.append((caption, _png(fig)))
    return fg


def fig_staleness(runs: list[Run], colours: list[str]) -> Figure:
    fg = Figure(
        "staleness",
        "Staleness and grace windows",
        "Left: staleness of the merged contributions (weight > 0), i.e. how many versions the fragment moved "
        "between the learner's base and the merge, as a share of all merged entries. Right: length of the grace "
        "windows granted (rounds with a window only); the legend counts the entries admitted inside one.",
    )
    data = []
    for r, c in zip(runs, colours):
        rounds = r.rounds
        stale = [m.staleness for rd in rounds for m in rd.took_part]
        grace = [rd.grace_s for rd in rounds if rd.grace_s > 0]
        admitted = sum(1 for rd in rounds for m in rd.took_part if m.in_grace)
        if not stale and not grace:
            fg.notes.append(f"{r.label}: no merged entries on the tape (tape.jsonl missing or empty)")
            continue
        data.append((r, c, stale, grace, admitted))
    if not data:
        return fg
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(data)
    top = 0.0
    for i, (r, c, stale, _, _) in enumerate(data):
        if not stale:
            continue
        values = sorted(set(stale))
        shares = [100 * stale.count(v) / len(stale) for v in values]
        top = max(top, *shares)
        a1.bar([v - 0.4 + width * (i + 0.5) for v in values], shares, width=width, color=c,
               label=f"{r.label}: mean {sum(stale) / len(stale):.2f}")  # fmt: skip
    a1.set_xlabel("staleness (versions)")
    a1.set_ylabel("% of merged entries")
    a1.xaxis.get_major_locator().set_params(integer=True)
    a1.grid(alpha=0.3, axis="y")
    if top > 0:
        a1.set_ylim(0, top * 1.08)
        a1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))  # below: never over a bar
    all_grace = sorted({g for _, _, _, gs, _ in data for g in gs})
    if all_grace:
        top = 0.0
        for i, (r, c, _, gs, admitted) in enumerate(data):
            label = f"{r.label}: {len(gs)} windows, {admitted} entries admitted"
            if len(all_grace) <= 12:  # a few distinct lengths (the usual case): one bar group per length
                counts = [gs.count(g) for g in all_grace]
                a2.bar([j - 0.4 + width * (i + 0.5) for j in range(len(all_grace))], counts, width=width, color=c,
                       label=label)  # fmt: skip
            else:
                counts, _, _ = a2.hist(gs, bins=20, range=(all_grace[0], all_grace[-1]), histtype="step", lw=1.8,
                                       color=c, label=label)  # fmt: skip
            top = max(top, *counts) if len(counts) else top
        if len(all_grace) <= 12:
            a2.set_xticks(range(len(all_grace)))
            a2.set_xticklabels([f"{g:.3g}" for g in all_grace])
        a2.set_ylim(0, max(top, 1) * 1.08)
        a2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    else:
        a2.text(0.5, 0.5, "no round had a grace window", ha="center", va="center", transform=a2.transAxes)
    a2.set_xlabel("grace window granted (s)")
    a2.set_ylabel("rounds")
    a2.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fg.images.append(("", _png(fig)))
    return fg


def fig_bytes(runs: list[Run], orders: list[list[Any]], colours: list[str]) -> Figure:
    fg = Figure(
        "bytes-sent",
        "Bytes sent",
        "Left: bytes each learner has sent to the syncer so far (summed over its restarts). Right: the whole "
        "fleet's total, one line per run.",
    )
    plt = _plt()
    totals = []
    for r, order, c in zip(runs, orders, colours):
        per = {lrn: cumulative(rs, "bytes_sent") for lrn, rs in _by_learner(r.learners).items()}
        per = {k: v for k, v in per.items() if v[0]}
        if not per:
            fg.notes.append(f"{r.label}: no bytes_sent counters (metrics/learners.jsonl missing or empty)")
            continue
        grid = sorted({t for ts, _ in per.values() for t in ts})
        total = [0.0] * len(grid)
        for ts, vs in per.values():
            j, last = 0, 0.0
            for i, t in enumerate(grid):
                while j < len(ts) and ts[j] <= t:
                    last, j = vs[j], j + 1
                total[i] += last
        totals.append((r, c, grid, total, per, order))
    if not totals:
        return fg
    peak_total = max(max(t) for _, _, _, t, _, _ in totals)
    unit_t, scale_t = _byte_unit(peak_total)
    for r, _c, _grid, _total, per, order in totals:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [3, 2]})
        unit, scale = _byte_unit(max(max(vs) for _, vs in per.values()))
        for lrn, (ts, vs) in per.items():
            a1.plot(ts, [v / scale for v in vs], color=learner_colour(lrn, order), lw=1.3, label=f"learner {lrn}")
        a1.set_ylabel(f"sent per learner ({unit})")
        a1.set_xlabel(_time_label([r]))
        a1.grid(alpha=0.3)
        a1.legend(fontsize=7, ncol=max(1, math.ceil(len(per) / 6)), loc="upper left")
        for r2, c2, grid2, total2, _, _ in totals:
            lw, alpha = (2.2, 1.0) if r2 is r else (1.0, 0.35)
            a2.plot(grid2, [v / scale_t for v in total2], color=c2, lw=lw, alpha=alpha, label=r2.label)
        a2.set_ylabel(f"fleet total ({unit_t})")
        a2.set_xlabel("seconds since start")
        a2.grid(alpha=0.3)
        if len(totals) > 1:
            a2.legend(fontsize=7)
        fig.tight_layout()
        fg.images.append((r.label, _png(fig)))
    return fg


# --- the page ---------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    v = _num(value)
    if v is None:
        return "–" if value is None else str(value)
    try:
        return format(v, spec)
    except ValueError:
        return str(value)


def _summary_rows(run: Run) -> list[tuple[str, str]]:
    s = run.summary
    partial = s.get("partial")
    tape_rounds = sum(1 for rd in run.rounds if rd.took_part)
    return [
        ("method", run.method),
        ("clock", run.clock),
        ("partial (interrupted)?", "yes" if partial else "no" if partial is False or s else "–"),
        (
            "final eval loss" + (f" ({run.loss_unit})" if run.loss_unit != "loss" else ""),
            _fmt(s.get("eval_loss"), ".4f"),
        ),
        # the evaluate hook's other figures at the final evaluation (accuracy, ...)
        *((f"final eval {name}", _fmt(value, ".4f")) for name, value in metrics_of(s, "eval_metrics").items()),
        ("tokens processed", _fmt(s.get("tokens_processed"), ",.0f")),
        ("tokens merged", _fmt(s.get("tokens_merged"), ",.0f")),
        ("goodput", _fmt(s.get("goodput"), ".1%")),
        ("uptime (a quorum of learners up)", _fmt(s.get("uptime"), ".1%")),
        ("learners M", str(run.num_learners or "–")),
        # null: nothing watched the learners' processes (a run started by hand or as a library)
        ("failures", _fmt(s.get("failures"), ".0f") if s.get("failures") is not None or not s else "unknown"),
        ("straggler phases", _fmt(s.get("straggler_phases"), ".0f") if s.get("straggler_phases") is not None else "–"),
        ("rounds per fragment", _fmt(s.get("rounds_per_fragment"), ".1f")),
        ("learners per merge", _fmt(s.get("learners_per_merge"), ".2f")),
        ("merging rounds on the tape", f"{tape_rounds:,}"),
        ("run length (s)", _fmt(s.get("run_time_s", s.get("virtual_time_s")), ",.1f")),
        *_traffic_rows(s.get("traffic") if isinstance(s.get("traffic"), dict) else {}),
    ]


def _traffic_rows(t: dict[str, Any]) -> list[tuple[str, str]]:
    """The link's traffic (summary.json's ``traffic``): steady bytes per learner per inner step,
    one-off bytes, and data-parallel's fp32 ring all-reduce for the same model."""
    ratios = [t.get("dp_ratio_up"), t.get("dp_ratio_down")]
    return [
        ("bytes / learner / inner step up (steady)", _fmt(t.get("up_bytes_per_step"), ",.0f")),
        ("bytes / learner / inner step down (steady)", _fmt(t.get("down_bytes_per_step"), ",.0f")),
        (
            "one-off bytes up / down",
            f"{_fmt(t.get('one_off_up_bytes'), ',.0f')} / {_fmt(t.get('one_off_down_bytes'), ',.0f')}",
        ),
        ("data-parallel fp32 bytes / learner / step", _fmt(t.get("dp_bytes_per_step"), ",.0f")),
        ("x fewer bytes than data-parallel up / down", " / ".join(_fmt(r, ",.1f") for r in ratios)),
    ]


def _traffic_table(run: Run) -> str:
    """Per learner: inner steps, steady bytes per step up and down, one-off bytes ("" when the
    run counted no traffic)."""
    t = run.summary.get("traffic")
    by = t.get("by_learner") if isinstance(t, dict) else None
    if not isinstance(by, dict) or not by:
        return ""
    e = html.escape
    out = [
        f'<p class="cap">{e(run.label)}: traffic per learner (steady state per inner step; one-off: joins, '
        "rejoins, the optimizer hand-off, the final sync, the run's end)</p>",
        "<table><tr><th>learner</th><th>inner steps</th><th>up B/step</th><th>down B/step</th>"
        "<th>one-off up B</th><th>one-off down B</th></tr>",
    ]
    for m, row in sorted(by.items(), key=lambda kv: _sort_key(int(kv[0]) if kv[0].isdigit() else kv[0])):
        if not isinstance(row, dict):
            continue
        cells = [
            _fmt(row.get("steps"), ",.0f"),
            _fmt(row.get("up_bytes_per_step"), ",.0f"),
            _fmt(row.get("down_bytes_per_step"), ",.0f"),
            _fmt(row.get("one_off_up_bytes"), ",.0f"),
            _fmt(row.get("one_off_down_bytes"), ",.0f"),
        ]
        out.append(f"<tr><th>{e(str(m))}</th>" + "".join(f'<td class="v">{e(c)}</td>' for c in cells) + "</tr>")
    out.append("</table>")
    return "".join(out)


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1000px;
color:#222;line-height:1.4;padding:0 12px}
h1{margin:0 0 4px}h2{margin:28px 0 2px;font-size:1.2em}.sub{color:#555;margin:0 0 12px}
table{border-collapse:collapse;font-size:.92em;margin:6px 0}th,td{border:1px solid #ccc;padding:3px 9px}
th{background:#f3f3f3;text-align:left}td.v{text-align:right;font-variant-numeric:tabular-nums}
.swatch{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:5px;vertical-align:-1px}
figure{margin:0 0 10px;padding:0}figcaption p{margin:2px 0 6px;color:#444;font-size:.93em}
img{max-width:100%;display:block;margin:4px 0 10px}.cap{font-size:.88em;color:#333;margin:8px 0 0}
.nodata{color:#8a5a00;background:#fff7e6;border-left:3px solid #e6a700;padding:3px 8px;margin:4px 0;font-size:.9em}
.warn{color:#8a1f11}code{background:#f3f3f3;padding:0 3px;border-radius:3px}
"""


def _labels(runs: list[Run]) -> None:
    names = [r.name for r in runs]
    for r in runs:
        name = r.name if names.count(r.name) == 1 else f"{r.path.parent.name}/{r.name}"
        r.label = f"{name} ({r.method})"


def _page(runs: list[Run], colours: list[str], figures: list[Figure]) -> str:
    e = html.escape
    title = "ddiloco report: " + ", ".join(r.name for r in runs)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        f'<p class="sub">{len(runs)} run folder(s), report made {e(stamp)} by <code>ddiloco report</code>. '
        f"Every term (goodput, staleness, grace window, weight, round, fragment ...) is defined in "
        f"<code>{e(TERMS)}</code> of the ddiloco repository; the folder layout in "
        "<code>docs/operations.md#the-run-folder-format</code>.</p>",
        '<section id="summary"><h2>Summary</h2><table><tr><th>measure</th>',
    ]
    for r, c in zip(runs, colours):
        out.append(f'<th><span class="swatch" style="background:{c}"></span>{e(r.label)}</th>')
    out.append("</tr>")
    rows = [_summary_rows(r) for r in runs]
    out.append("<tr><th>folder</th>" + "".join(f"<td>{e(str(r.path))}</td>" for r in runs) + "</tr>")
    for i, (label, _) in enumerate(rows[0]):
        out.append(f"<tr><th>{e(label)}</th>" + "".join(f'<td class="v">{e(rr[i][1])}</td>' for rr in rows) + "</tr>")
    out.append("</table>")
    out += [table for r in runs if (table := _traffic_table(r))]
    for r in runs:
        warns = r.summary.get("warnings")
        if isinstance(warns, str):
            warns = [warns]
        items = [f'<li class="warn">{e(str(w))}</li>' for w in warns or [] if w] if isinstance(warns, list) else []
        items += [f"<li>{e(n)}</li>" for n in r.notes]
        if items:
            out.append(f"<p class=\"cap\">{e(r.label)}: warnings and notes</p><ul>{''.join(items)}</ul>")
    out.append("</section>")
    for n, fg in enumerate(figures, 1):
        out.append(f'<figure id="{e(fg.fid)}"><figcaption><h2>{n}. {e(fg.title)}</h2><p>{e(fg.how)}</p></figcaption>')
        for caption, png in fg.images:
            if caption:
                out.append(f'<p class="cap">{e(caption)}</p>')
            out.append(
                f'<img alt="{e(fg.title + (": " + caption if caption else ""))}" src="data:image/png;base64,{png}">'
            )
        for note in fg.notes:
            out.append(f'<p class="nodata">No data: {e(note)}</p>')
        out.append("</figure>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def default_output(run_dirs: Iterable[str | Path]) -> Path:
    """RUN_DIR/report.html for one run, ./ddiloco-report.html for several."""
    dirs = list(run_dirs)
    return Path(dirs[0]) / "report.html" if len(dirs) == 1 else Path("ddiloco-report.html")


def render_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write the HTML report of ``run_dirs`` to ``out`` (default: :func:`default_output`); returns it."""
    if not run_dirs:
        raise DDiLoCoError("ddiloco report needs at least one run folder")
    runs = [load_run(d) for d in run_dirs]
    _labels(runs)
    colours = [RUN_COLOURS[i % len(RUN_COLOURS)] for i in range(len(runs))]
    orders = []
    for r in runs:
        seen = {_key(x.get("learner")) for x in r.learners if x.get("learner") is not None}
        seen |= {m.learner for rd in r.rounds for m in rd.merged}
        orders.append(sorted(seen, key=_sort_key))
    drawn = [
        fig_eval_loss(runs, colours),
        fig_eval_metrics(runs, colours),
        fig_train_loss(runs, orders),
        fig_goodput(runs, colours),
        fig_participation(runs, orders),
        fig_staleness(runs, colours),
        fig_bytes(runs, orders, colours),
    ]
    figures = [f for f in drawn if f is not None]
    path = Path(out) if out is not None else default_output(run_dirs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(_page(runs, colours, figures), encoding="utf-8")
    tmp.replace(path)
    return path
