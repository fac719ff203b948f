"""The run's summary, computed from its run folder: the one function ``train``, ``simulate``,
the syncer and ``ddiloco report`` all call.

Everything here reads the files of the run folder format (docs/operations.md), never a live
process, so a run started by hand, one interrupted, and one finished long ago are summarised
by the same rules. The inputs are ``metrics/*.jsonl``, ``metrics/accounting.json``, the tape,
``run.json`` and ``config.toml``; the outputs are ``summary.json``, ``metrics.jsonl``,
``tape.jsonl`` (the syncer shards' tapes, times made relative to the run's start) and
``eval_loss.png``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from ddiloco.core.counters import IncarnationCounters
from ddiloco.core.tape import RoundRecord
from ddiloco.errors import DDiLoCoError
from ddiloco.protocol.traffic import merge_traffic, traffic_figures
from ddiloco.report.invariants import check_run
from ddiloco.report.plotting import pyplot
from ddiloco.report.result import summarise_tape
from ddiloco.report.tape import parse_tape, read_json, read_jsonl, read_toml

log = logging.getLogger(__name__)

TERMS_DOC = "docs/operations.md#terms"
"""Where every figure below is defined (tables and progress lines point there)."""

MIN_ROUNDS_PER_FRAGMENT = 3.0
"""Below this many merges per fragment a run's figures are mostly start-up: warn."""

FAILURE_KINDS = ("sigkill", "fail", "crash")
"""Fault kinds that are a learner failure (restarts and straggler phases are not)."""

INJECTED_KINDS = ("sigkill", "fail", "straggle")
"""Fault kinds that chaos injects (a kill, of a learner or the syncer, or a straggler phase's
start): what "faults injected" counts; restarts, a phase's end and a learner's own exit are not."""

BUDGET_KEYS = ("run.processed_tokens", "run.merged_tokens", "runtime.duration_s")
"""The budgets a real run can end at; the syncer's end reason names the one spent last, in
brackets (``metrics/run.jsonl``: "... the budget is 120 s (runtime.duration_s)")."""

SUMMARY_ROWS = [
    ("eval loss ({unit})", "eval_loss", "{:.4f}"),
    ("tokens processed", "tokens_processed", "{:,.0f}"),
    ("tokens merged", "tokens_merged", "{:,.0f}"),
    ("merged / processed", "merged_share", "{:.1%}"),
    ("goodput", "goodput", "{:.1%}"),
    ("  lost: blocked", "blocked", "{:.1%}"),
    ("  lost: down", "down", "{:.1%}"),
    ("  lost: restarting", "restarting", "{:.1%}"),
    ("  lost: starting", "starting", "{:.1%}"),
    ("uptime (a quorum of learners up)", "uptime", "{:.1%}"),
    ("failures", "failures", "{:.0f}"),  # None: nothing watched for them ("unknown")
    ("straggler phases", "straggler_phases", "{:.0f}"),
    ("work lost in failures (steps)", "lost_steps", "{:.0f}"),
    ("fragments P", "num_fragments", "{:.0f}"),
    ("rounds per fragment", "rounds_per_fragment", "{:.1f}"),
    ("learners per merge", "learners_per_merge", "{:.2f}"),
    ("grace admissions", "grace_admissions", "{:.0f}"),
    ("rejected / late answers", "rejected", "{:.0f}"),
    ("run length (s, {clock} clock)", "run_time_s", "{:.1f}"),
]
"""The summary table: label, summary.json key, format (every term: ``TERMS_DOC``)."""

TRAFFIC_ROWS = [
    ("bytes / learner / step up (steady)", "up_bytes_per_step", "{:,.0f}"),
    ("bytes / learner / step down (steady)", "down_bytes_per_step", "{:,.0f}"),
    ("one-off bytes up / down", "one_off", ""),
    ("  one-off by kind", "one_off_by_kind", ""),
    ("observer bytes up / down", "observer", ""),
    ("data-parallel fp32 bytes / learner / step", "dp_bytes_per_step", "{:,.0f}"),
    ("x fewer bytes than data-parallel up", "dp_ratio_up", "{:,.1f}"),
    ("x fewer bytes than data-parallel down", "dp_ratio_down", "{:,.1f}"),
]
"""The traffic rows of the summary table (summary.json's ``traffic``; ``protocol/traffic.py``)."""

UNWATCHED = ("failures", "lost_steps", "straggler_phases")
"""Figures only a watcher of the learners' processes knows (a launcher, the simulator): null in
summary.json and ``UNKNOWN`` in tables for a run started by hand or as a library."""
UNKNOWN = "unknown"


def run_info(run_dir: str | Path) -> dict[str, Any]:
    """``run.json``: format, creation, who made it, ``started_at`` (a Unix time)."""
    return read_json(Path(run_dir) / "run.json")


def run_started_at(run_dir: str | Path) -> float | None:
    """The run's start (``run.json``'s ``started_at``), or None for a folder without one."""
    value = run_info(run_dir).get("started_at")
    return float(value) if isinstance(value, (int, float)) else None


def _relative_tape(run_dir: Path) -> list[dict[str, Any]] | None:
    """The syncer shards' tapes merged in time order, times as seconds since the run started;
    None when the folder has no syncer state (a simulated run writes tape.jsonl itself)."""
    state = run_dir / "state"
    paths = sorted([state / "tape.jsonl", *state.glob("shard-*/tape.jsonl")])
    paths = [p for p in paths if p.exists()]
    if not paths:
        return None
    t0 = run_started_at(run_dir)
    out = []
    for path in paths:
        for rec in read_jsonl(path):
            offset = rec.pop("wall_offset", None)
            if t0 is not None and isinstance(offset, (int, float)):
                shift = offset - t0
                for key in ("time", "opened_at", "closed_at"):
                    if isinstance(rec.get(key), (int, float)):
                        rec[key] += shift
                for r in rec.get("rejected", []) if isinstance(rec.get("rejected"), list) else []:
                    if isinstance(r, dict) and isinstance(r.get("time"), (int, float)):
                        r["time"] += shift
            out.append(rec)
    out.sort(key=lambda r: r.get("closed_at", r.get("time", 0.0)) if isinstance(r, dict) else 0.0)
    return out


def _num(value: Any, default: float = 0.0) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def learner_total(records: list[dict[str, Any]], key: str) -> float:
    """A learner counter (metrics/learners.jsonl's ``tokens``, ``busy_s`` ...) summed over learners
    and their incarnations: the one restart rule of ``core.counters`` (the HTML page uses it too)."""
    return IncarnationCounters.of_records(records, key)[0].total()


def summarise(run_dir: str | Path) -> dict[str, Any]:
    """The run's figures (what summary.json holds), from its folder alone."""
    d = Path(run_dir)
    cfg = read_toml(d / "config.toml")
    info = run_info(d)
    metrics = d / "metrics"
    evals = read_jsonl(metrics / "eval.jsonl")
    faults = read_jsonl(metrics / "faults.jsonl")
    learners = read_jsonl(metrics / "learners.jsonl")
    runlog = read_jsonl(metrics / "run.jsonl")
    acct = read_json(metrics / "accounting.json")
    tape = _relative_tape(d)
    if tape is None:
        tape = read_jsonl(d / "tape.jsonl")
    records = parse_tape(tape)  # typed once; a damaged line is skipped
    rounds = [r for r in records if isinstance(r, RoundRecord)]
    num_fragments = int(_num(acct.get("num_fragments"))) or len({r.fragment for r in rounds}) or 1
    ends = [r for r in runlog if r.get("what") in ("end", "interrupted")]
    horizon = max(_num(acct.get("horizon_s")), 0.0) or (max(_num(ends[-1].get("time")), 0.0) if ends else 0.0)
    if not horizon:
        horizon = max([_num(r.get("time")) for r in (*evals, *learners, *faults)], default=0.0)
    m_count = fleet_size(cfg, acct, learners)
    # goodput: the launcher's or simulator's accounting when there is one, else from the
    # learners' own busy time (a run started by hand: down and restarting are not known)
    alloc = max(horizon * m_count, 1e-9)
    kinds = ("compute", "blocked", "down", "restarting", "starting")
    if acct:
        shares: dict[str, float | None] = {k: _num(acct.get(f"{k}_s")) / alloc for k in kinds}
    else:
        shares = dict.fromkeys(kinds)
        shares["compute"] = learner_total(learners, "busy_s") / alloc if learners else None
    # the syncer's count that ended the run (one number with `ddiloco status` and the end's
    # reason), else the launcher's or simulator's books, else the learners' own
    processed = (_num(ends[-1].get("processed_tokens")) if ends else 0.0) or _num(acct.get("tokens"))
    processed = processed or learner_total(learners, "tokens")
    # every fragment merges the same tokens once: the global count is the mean over fragments
    merged = sum(m.tokens for r in rounds for m in r.took_part) / max(num_fragments, 1)
    if not tape:
        merged = _num(acct.get("tokens_merged"))
    final = [e for e in evals if e.get("final")]
    last_eval = (final or evals or [{}])[-1]
    stats = summarise_tape(records, num_fragments)
    if not tape and isinstance(acct.get("tape_stats"), dict):  # data-parallel: every step syncs, no tape
        stats = {k: _num(acct["tape_stats"].get(k)) for k in stats}
    interrupted = bool(ends) and ends[-1].get("what") == "interrupted"  # a resumed run that ended is whole
    watched = bool(acct) or (metrics / "faults.jsonl").exists()
    run_cfg = cfg.get("run", {}) if isinstance(cfg.get("run"), dict) else {}
    rt_cfg = cfg.get("runtime", {}) if isinstance(cfg.get("runtime"), dict) else {}
    summary: dict[str, Any] = {
        "method": acct.get("method") or cfg.get("run", {}).get("method", "?"),
        "by": info.get("by", "?"),
        "partial": interrupted,
        "ended": (ends[-1].get("reason") if ends else None),
        "ended_by": ended_by(ends[-1]) if ends else None,
        "processed_tokens_budget": _count(run_cfg.get("processed_tokens")),
        "clock": "virtual" if str(info.get("by", "")).startswith("ddiloco simulate") else "wall",
        "loss_unit": str(last_eval.get("unit", "")),
        "eval_loss": last_eval.get("loss"),
        "eval_metrics": metrics_of(last_eval),
        "tokens_processed": processed,
        "tokens_merged": merged,
        "merged_share": merged / processed if processed else 0.0,
        "goodput": shares["compute"],
        "blocked": shares["blocked"],
        "down": shares["down"],
        "restarting": shares["restarting"],
        "starting": shares["starting"],
        "uptime": acct.get("uptime"),
        # Failures are known only where something watched the learners' processes (a launcher or
        # the simulator, which keep accounts and record faults): a hand-started run's SIGKILL is
        # seen by nobody, so 0 would be a guess.
        "lost_steps": _num(acct.get("lost_steps")) if watched else None,
        "restart_latencies_s": acct.get("restart_latencies_s", []),
        "failures": sum(1 for f in faults if is_learner_failure(f)) if watched else None,
        "straggler_phases": sum(1 for f in faults if f.get("kind") == "straggle") if watched else None,
        "num_fragments": num_fragments,
        "num_learners": m_count,
        "run_time_s": horizon,
        **stats,
        # What the tape alone can vouch for (every driver keeps these; report/invariants.py).
        "invariant_violations": [f"{v.kind}: {v.detail}" for v in check_run(tape)],
        "traffic": run_traffic(d),
    }
    summary["warnings"] = warnings_for(summary, _finite(rt_cfg.get("duration_s")))
    return summary


def run_traffic(run_dir: str | Path) -> dict[str, Any] | None:
    """What crossed the learners' links (``protocol.traffic.traffic_figures``), from
    metrics/traffic*.json (one per syncer shard, or the simulator's); None when there is none."""
    parts = [read_json(p) for p in sorted((Path(run_dir) / "metrics").glob("traffic*.json"))]
    parts = [p for p in parts if p]
    return traffic_figures(merge_traffic(parts)) if parts else None


def fleet_size(config: dict[str, Any], accounting: dict[str, Any], learners: list[dict[str, Any]]) -> int:
    """M, the learners the run's time is allocated to (goodput's denominator; the summary and
    the HTML page both use this rule): the launcher's or simulator's count where it kept
    accounts, else the larger of ``run.num_learners`` (config.toml) and the learner ids that
    reported (a hand-started or library run may start more learners than it configured), at
    least 1."""
    counted = int(_num(accounting.get("learners")))
    if counted > 0:
        return counted
    run = config.get("run", {}) if isinstance(config.get("run"), dict) else {}
    ids = {
        r.get("learner")
        for r in learners
        if isinstance(r.get("learner"), int) and not isinstance(r.get("learner"), bool)
    }
    return max(int(_num(run.get("num_learners"))), len(ids), 1)


def ended_by(end: dict[str, Any]) -> str | None:
    """Which budget ended the run (one of ``BUDGET_KEYS``), from its end record in
    metrics/run.jsonl; None for an interrupted run or an end of another kind."""
    if end.get("what") != "end":
        return None
    found = re.search(r"\(([a-z_]+\.[a-z_]+)\)\s*$", str(end.get("reason", "")))
    return found.group(1) if found and found.group(1) in BUDGET_KEYS else None


def time_budget_short(summary: dict[str, Any], duration_s: float | None = None) -> str | None:
    """The warning for a run that its time budget ended short of its token budget, or None.
    The syncer logs it (WARNING) when it stops, and the summary lists it among its warnings."""
    budget = summary.get("processed_tokens_budget")
    processed = _num(summary.get("tokens_processed"))
    if summary.get("ended_by") != "runtime.duration_s" or not isinstance(budget, (int, float)) or processed >= budget:
        return None
    limit = f" = {duration_s:,.10g} s" if duration_s is not None else ""
    return (
        f"the run ended at its time budget (runtime.duration_s{limit}) after {processed:,.0f} of its {budget:,.0f} "
        f"tokens ({processed / budget:.0%}; run.processed_tokens): raise runtime.duration_s, or set it to inf for "
        "no time budget"
    )


def log_time_budget_short(run_dir: str | Path) -> str | None:
    """Log (WARNING) that the run's time budget ended it short of its tokens, from its
    summary.json and config.toml, and return the line; None when that is not so. The syncer's
    last word when it stops (``ddiloco syncer``, ``ddiloco.SyncerServer``)."""
    d = Path(run_dir)
    runtime = read_toml(d / "config.toml").get("runtime", {})
    duration = _finite(runtime.get("duration_s")) if isinstance(runtime, dict) else None
    line = time_budget_short(read_json(d / "summary.json"), duration)
    if line is not None:
        log.warning("%s", line)
    return line


def _finite(value: Any) -> float | None:
    """A finite number from a config or record, else None."""
    x = _num(value, math.nan)
    return x if math.isfinite(x) else None


def _count(value: Any) -> int | None:
    """A whole, finite count from a config, else None."""
    x = _finite(value)
    return int(x) if x is not None else None


def metrics_of(record: dict[str, Any], key: str = "metrics") -> dict[str, float]:
    """An eval record's extra metrics (an evaluation hook's, beside its loss), numbers only; with
    ``key="eval_metrics"``, a summary's (the final evaluation's)."""
    extra = record.get(key)
    if not isinstance(extra, dict):
        return {}
    return {str(k): float(v) for k, v in extra.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def is_learner_failure(fault: dict[str, Any]) -> bool:
    """A fault record that is a learner failure: a SIGKILL, crash or abnormal exit of a
    learner (restarts, straggler phases and the syncer's own faults are not)."""
    kind, target = str(fault.get("kind", "")), str(fault.get("target", ""))
    if not target.startswith("learner"):
        return False
    return kind.split(" ")[0] in FAILURE_KINDS or (kind.startswith("exit ") and kind != "exit 0")


def is_injected(fault: dict[str, Any]) -> bool:
    """A fault record that chaos injected (``INJECTED_KINDS``)."""
    return str(fault.get("kind", "")).split(" ")[0] in INJECTED_KINDS


def warnings_for(summary: dict[str, Any], duration_s: float | None = None) -> list[str]:
    """What makes these figures not mean much (said in the table, summary.json and the report);
    ``duration_s``: the run's time budget, named in the warning of a run it ended short."""
    out = []
    rounds = _num(summary.get("rounds_per_fragment"))
    if rounds < MIN_ROUNDS_PER_FRAGMENT:
        out.append(
            f"only {rounds:.1f} merges per fragment: too short a run for these figures to mean much "
            "(raise run.processed_tokens or runtime.duration_s)"
        )
    if summary.get("partial"):
        out.append("the run was interrupted: these are partial figures")
    if summary.get("eval_loss") is None:
        out.append("no evaluation of the global model was recorded")
    short = time_budget_short(summary, duration_s)
    if short is not None:
        out.append(short)
    broken = summary.get("invariant_violations") or []
    if broken:
        out.append(f"{len(broken)} invariant violations on the tape (a bug: please report it), first: {broken[0]}")
    return out


def write_summary(run_dir: str | Path) -> dict[str, Any]:
    """Compute the summary from the folder and write summary.json, metrics.jsonl, the merged
    tape.jsonl (real runs) and eval_loss.png; returns the summary. Safe to call again (every
    writer of the folder does, as its part ends): each call recomputes from the sources."""
    d = Path(run_dir)
    summary = summarise(d)
    tape = _relative_tape(d)
    if tape is not None:
        _write_lines(d / "tape.jsonl", tape)
    records = [r for name in ("eval", "faults", "learners", "run") for r in read_jsonl(d / "metrics" / f"{name}.jsonl")]
    records.sort(key=lambda r: _num(r.get("time")))
    _write_lines(d / "metrics.jsonl", [*records, {"event": "summary", **summary}])
    _atomic_write(d / "summary.json", json.dumps(summary, indent=2))
    try:
        plot_eval_loss(d, summary)
    except Exception as e:  # a plot is a courtesy: never lose the summary over it
        log.warning("could not draw %s: %s", d / "eval_loss.png", e)
    return summary


def _write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    _atomic_write(path, "".join(json.dumps(r) + "\n" for r in records))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def plot_eval_loss(run_dir: Path, summary: dict[str, Any]) -> Path | None:
    """Eval loss of the global model against time, with learner failures marked."""
    evals = read_jsonl(run_dir / "metrics" / "eval.jsonl")
    if not evals:
        return None
    try:
        plt = pyplot()
    except DDiLoCoError:  # the plot extra is not installed: the figures are in summary.json
        return None

    faults = read_jsonl(run_dir / "metrics" / "faults.jsonl")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([_num(e.get("time")) for e in evals], [_num(e.get("loss")) for e in evals], marker="o",
            label=str(summary["method"]))  # fmt: skip
    for f in faults:
        if is_learner_failure(f):
            ax.axvline(_num(f.get("time")), color="red", alpha=0.25, lw=1)
    ax.set_xlabel(f"seconds since the run started ({summary['clock']} clock)")
    ax.set_ylabel(_label("eval loss ({unit})", summary))
    title = f"{summary['method']}: global model eval loss (red: learner failures)"
    ax.set_title(title + (" — partial" if summary.get("partial") else ""))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = run_dir / "eval_loss.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _label(label: str, summary: dict[str, Any]) -> str:
    unit = summary.get("loss_unit") or ""
    return label.format(unit=unit, clock=summary.get("clock", "?")).replace(" ()", "")


def summary_table(summary: dict[str, Any], title: str) -> Any:
    """The summary as a rich table (for people; summary.json is for programs)."""
    from rich.table import Table

    table = Table(title=title + (" — PARTIAL (interrupted)" if summary.get("partial") else ""))
    table.add_column("measure")
    table.add_column("value", justify="right")
    for label, key, fmt in SUMMARY_ROWS:
        value = summary.get(key)
        if key == "rejected":
            text = f"{summary.get('rejected', 0)} / {summary.get('late', 0)}"
        elif value is None:
            text = UNKNOWN if key in UNWATCHED else "n/a"
        else:
            text = fmt.format(value)
        table.add_row(_label(label, summary), text)
        if key == "eval_loss":  # an evaluation hook's other metrics (accuracy ...) right under its loss
            for name, v in (summary.get("eval_metrics") or {}).items():
                table.add_row(f"  eval {name}", f"{v:.4g}")
    traffic = summary.get("traffic")
    if isinstance(traffic, dict):
        for label, key, fmt in TRAFFIC_ROWS:
            if key in ("one_off", "observer"):
                text = f"{_num(traffic.get(f'{key}_up_bytes')):,.0f} / {_num(traffic.get(f'{key}_down_bytes')):,.0f}"
            elif key == "one_off_by_kind":
                text = by_kind_line(traffic.get(key))
            else:
                value = traffic.get(key)
                text = fmt.format(value) if isinstance(value, (int, float)) else "n/a"
            table.add_row(label, text)
    table.caption = f"every term: {TERMS_DOC}"
    return table


def by_kind_line(kinds: Any) -> str:
    """One-off bytes by kind in one line, largest first: "rejoin 31.2 MB, handoff 20.0 MB, ..."."""
    if not isinstance(kinds, dict) or not kinds:
        return "n/a"
    sizes = {
        str(k).replace("_", " "): _num(v.get("up")) + _num(v.get("down"))
        for k, v in kinds.items()
        if isinstance(v, dict)
    }
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])
    rest = sum(b for _, b in ranked[3:])  # the largest three by name; summary.json has every kind
    return ", ".join(f"{k} {byte_size(b)}" for k, b in ranked[:3]) + (f", other {byte_size(rest)}" if rest else "")


def byte_size(n: float) -> str:
    """Bytes for a reader: "14 B", "21.7 kB", "56.1 MB" (decimal units)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def print_summary(summary: dict[str, Any], title: str, run_dir: str | Path) -> None:
    """The summary table on stdout, then its warnings, then where the run folder is."""
    from rich.console import Console

    out = Console()
    out.print(summary_table(summary, title))
    for w in summary.get("warnings", []):
        out.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
    out.print(f"run folder: {run_dir}", highlight=False)
